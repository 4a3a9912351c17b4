//! `lastcall demo`: the whole pipeline end to end on the local defaults.
//!
//! A burst of jobs with short deadlines goes to a worker with few model slots, so the
//! worker cannot serve them all in time. The table shows which jobs completed, which were
//! refused at the last admission check (`expired_not_started`, zero model calls) and which
//! expired at the broker before any worker received them (`expired_before_receive`).

use crate::cli::{DemoArgs, DemoBackend};
use crate::config::Settings;
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use lastcall_backend::Backend;
use lastcall_backend::sim::{SimBackend, SimConfig};
use lastcall_broker::{Broker, Publisher};
use lastcall_clock::Clock;
use lastcall_core::State;
use lastcall_producer::{DeadlineSpec, NewJob, Submitter};
use lastcall_store::ListFilter;
use lastcall_worker::{Worker, WorkerConfig, WorkerStats};
use serde_json::json;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// The kind of the summaries, and of the urgent pages sent first (their own kind, so the
/// table shows them as such).
const SUMMARY_KIND: &str = "incident.summary";
const PAGE_KIND: &str = "incident.page";

const INCIDENTS: &[&str] = &[
    "api-gateway p99 latency above 2s since 14:02, error rate 4%",
    "disk usage on db-3 at 97%, autovacuum lagging",
    "checkout service 502s after deploy 7f3c, rollback pending",
    "certificate for auth.internal expires in 3 days",
    "queue depth on payments.work growing 500/min, consumers healthy",
    "memory leak suspected in search-indexer, RSS +200MB/h",
];

/// The demo's settings after applying the per-backend defaults.
struct Plan {
    jobs: usize,
    deadline_ms: u64,
    slots: usize,
    rate: f64,
    min_runtime_ms: u64,
}

fn plan(a: &DemoArgs) -> Result<Plan> {
    let local = a.backend == DemoBackend::Local;
    let p = Plan {
        jobs: a.jobs.unwrap_or(if local { 10 } else { 30 }),
        deadline_ms: a.deadline_ms.unwrap_or(if local { 10_000 } else { 2_000 }),
        slots: a.slots.unwrap_or(if local { 1 } else { 2 }),
        rate: a.rate.unwrap_or(if local { 1.0 } else { 8.0 }),
        min_runtime_ms: a
            .min_runtime_ms
            .unwrap_or(if local { 3_000 } else { a.sim_latency_ms }),
    };
    if p.jobs == 0 || p.slots == 0 || p.rate.is_nan() || p.rate <= 0.0 {
        bail!("--jobs and --slots must be at least 1, and --rate positive");
    }
    Ok(p)
}

/// Run `lastcall demo` with the broker and prefix of `s` (not its ledger: the demo keeps
/// its own).
pub async fn run(s: &Settings, a: DemoArgs) -> Result<ExitCode> {
    let p = plan(&a)?;
    let broker = ensure_broker(&s.amqp_url).await?;
    let prefix = format!("{}-demo", s.prefix);
    let store_url = match &a.demo_store_url {
        Some(u) => u.clone(),
        None => {
            for f in [
                "lastcall-demo.db",
                "lastcall-demo.db-wal",
                "lastcall-demo.db-shm",
            ] {
                let _ = std::fs::remove_file(f);
            }
            "sqlite://lastcall-demo.db".to_owned()
        }
    };
    let ledger = super::open_ledger(&store_url).await?;
    let mut cfg = WorkerConfig::new(&prefix, p.slots);
    cfg.name = "demo-worker".into();
    cfg.shutdown_grace = Duration::from_secs(2);
    cfg.topology.apply(&broker).await?;
    for q in [
        &cfg.topology.names.work_queue,
        &cfg.topology.names.dead_queue,
    ] {
        broker.purge(q).await?;
    }
    let clock: Arc<dyn Clock> = Arc::new(lastcall_worker::SystemClock::default());
    let sim = Arc::new(SimBackend::new(SimConfig {
        latency_ms: a.sim_latency_ms,
        ..SimConfig::default()
    })?);
    let (backend, model_desc): (Arc<dyn Backend>, String) = match a.backend {
        DemoBackend::Sim => (
            sim.clone(),
            format!("simulated model at {} ms per call", a.sim_latency_ms),
        ),
        DemoBackend::Local => {
            eprintln!("loading the local model …");
            (
                super::worker::local(a.model_path.as_deref(), p.slots)?,
                "SmolLM2-135M-Instruct (local, CPU)".to_owned(),
            )
        }
    };
    let stats = Arc::new(WorkerStats::default());
    let pages = a.early_jobs.min(p.jobs);
    println!(
        "lastcall demo: {pages} urgent pages ({PAGE_KIND}, deadline {} ms) at once, then {} summaries ({SUMMARY_KIND}, deadline {} ms) at {}/s; {} slot(s) of {}, prefetch {}, min runtime {} ms",
        a.early_deadline_ms,
        p.jobs - pages,
        p.deadline_ms,
        p.rate,
        p.slots,
        model_desc,
        cfg.prefetch,
        p.min_runtime_ms
    );
    println!(
        "the worker starts {} ms after the first job (as after a restart)",
        a.worker_delay_ms
    );
    println!(
        "broker {} · ledger {} · queues {}.*",
        lastcall_broker::redact(&s.amqp_url),
        lastcall_broker::redact(&store_url),
        prefix
    );
    let topo = cfg.topology.clone();
    let worker = Worker::build(
        cfg,
        broker.clone(),
        ledger.clone(),
        backend,
        clock.clone(),
        stats.clone(),
    )
    .await?;
    let stop = CancellationToken::new();
    let (stop2, delay) = (stop.clone(), Duration::from_millis(a.worker_delay_ms));
    let worker_task = tokio::spawn(async move {
        tokio::time::sleep(delay).await;
        worker.run(stop2).await
    });
    let dlq_task = spawn_dead_letters(
        broker.clone(),
        ledger.clone(),
        topo.clone(),
        clock.clone(),
        stop.clone(),
    )
    .await?;

    let publisher = Publisher::new(&broker, Duration::from_secs(5)).await?;
    let (admission, limits) = (
        lastcall_core::AdmissionPolicy::default(),
        lastcall_core::EnvelopeLimits::default(),
    );
    let submitter = Submitter::new(
        publisher,
        topo.names.clone(),
        Some(ledger.clone()),
        admission,
        limits,
    );
    let bar = ProgressBar::new(p.jobs as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message("submitting");
    let mut last_expiry = 0;
    let mut tick = tokio::time::interval(Duration::from_secs_f64(1.0 / p.rate));
    for i in 0..p.jobs {
        let early = i < a.early_jobs;
        if !early {
            tick.tick().await; // the early pages go out at once, the rest at the rate
        }
        let incident = INCIDENTS[i % INCIDENTS.len()];
        let deadline_ms = if early {
            a.early_deadline_ms
        } else {
            p.deadline_ms
        };
        let job = NewJob {
            job_id: Some(format!("demo-{:03}", i + 1)),
            kind: if early { PAGE_KIND } else { SUMMARY_KIND }.into(),
            payload: json!({
                "messages": [
                    {"role": "system", "content": "Summarize the incident for the on-call operator in one short sentence."},
                    {"role": "user", "content": incident}
                ],
                "max_tokens": a.max_tokens
            })
            .as_object()
            .cloned()
            .expect("object"),
            deadline: DeadlineSpec::RelativeMs(deadline_ms),
            // An urgent page only needs some budget left; the others need a whole call.
            min_runtime_ms: (!early).then_some(p.min_runtime_ms),
            trace_id: None,
        };
        let sub = submitter
            .submit(&job, clock.now_ms())
            .await
            .context("submitting a demo job")?;
        last_expiry = last_expiry.max(sub.expires_at_ms);
        bar.inc(1);
    }
    bar.set_position(0);
    bar.set_message("outcomes");
    let give_up_at = last_expiry + 5_000;
    loop {
        let done: i64 = ledger
            .counts_by_state()
            .await?
            .iter()
            .filter(|(st, _)| st.parse::<State>().is_ok_and(State::is_terminal))
            .map(|(_, n)| *n)
            .sum();
        bar.set_position(done as u64);
        if done as usize >= p.jobs || clock.now_ms() > give_up_at {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bar.finish_and_clear();
    // Anything still without an outcome after deadline + grace is named, not guessed.
    let unknown = ledger.mark_unknown(clock.now_ms(), 1_000).await?;
    stop.cancel();
    let _ = worker_task.await;
    let _ = dlq_task.await;

    let mut recs = ledger
        .list(&ListFilter {
            limit: Some(p.jobs as i64 + 10),
            ..ListFilter::default()
        })
        .await?;
    recs.sort_by(|a, b| a.job_id.cmp(&b.job_id));
    println!();
    print!("{}", super::jobs::render(&recs));
    println!();
    let mut counts: Vec<(String, usize)> = Vec::new();
    for st in State::ALL {
        let n = recs.iter().filter(|r| r.state == st.as_str()).count();
        if n > 0 {
            counts.push((st.as_str().to_owned(), n));
        }
    }
    println!(
        "outcomes: {}",
        counts
            .iter()
            .map(|(s, n)| format!("{s}={n}"))
            .collect::<Vec<_>>()
            .join("  ")
    );
    let expired_calls: i64 = recs
        .iter()
        .filter(|r| r.state == "expired_not_started" || r.state == "expired_before_receive")
        .map(|r| r.backend_calls)
        .sum();
    println!(
        "model calls: {} in total, {} for expired jobs · jobs never received by a worker: {} · unknown: {}",
        stats.backend_calls.load(Ordering::Relaxed),
        expired_calls,
        recs.iter()
            .filter(|r| r.state == "expired_before_receive")
            .count(),
        unknown.len()
    );
    // Only a real model has a decode speed; the simulator's token counts are made up.
    if a.backend == DemoBackend::Local
        && let Some(tps) = tokens_per_second(&recs)
    {
        println!("decode speed: {tps:.1} tokens/s over the completed calls");
    }
    println!();
    let outcomes: Vec<(&str, &str)> = recs
        .iter()
        .map(|r| (r.kind.as_str(), r.state.as_str()))
        .collect();
    println!("{}", story(&outcomes, unknown.len()));
    let inspect = format!(
        "{} --store-url {}",
        program(),
        shell_word(&lastcall_broker::redact(&absolute_sqlite(&store_url)))
    );
    // Commands that work as printed: this binary's path unless the PATH finds it, and the
    // ledger's absolute path.
    match recs.iter().find(|r| r.state == "expired_not_started") {
        Some(r) => {
            println!("inspect: {inspect} jobs list --state expired_not_started");
            println!("         {inspect} jobs show {} --attempts", r.job_id);
        }
        None => println!("inspect: {inspect} jobs list"),
    }
    broker.close().await;
    ledger.close().await;
    if expired_calls != 0 {
        bail!("invariant violated: {expired_calls} model call(s) were made for expired jobs");
    }
    Ok(ExitCode::SUCCESS)
}

/// Start a dead-letter processor on `topo` (as `lastcall dlq` runs it: broker expiries are
/// recorded `expired_before_receive`) until `stop` fires.
async fn spawn_dead_letters(
    broker: Broker,
    ledger: Arc<lastcall_store::Ledger>,
    topo: lastcall_broker::Topology,
    clock: Arc<dyn Clock>,
    stop: CancellationToken,
) -> Result<tokio::task::JoinHandle<()>> {
    let dlq = lastcall_worker::dlq::DeadLetterProcessor::build(broker, ledger, topo, clock, false)
        .await
        .map_err(anyhow::Error::msg)?;
    Ok(dlq.spawn(stop))
}

/// One sentence on what the run showed, from the (kind, state) of every job.
fn story(jobs: &[(&str, &str)], unknown: usize) -> String {
    let count = |state: &str| jobs.iter().filter(|(_, s)| *s == state).count();
    let (completed, refused, expired_in_queue, cancelled, failed) = (
        count("completed"),
        count("expired_not_started"),
        count("expired_before_receive"),
        count("deadline_exceeded"),
        count("failed"),
    );
    let pages = jobs.iter().filter(|(k, _)| *k == PAGE_KIND).count();
    let pages_expired = jobs
        .iter()
        .filter(|(k, s)| *k == PAGE_KIND && *s == "expired_before_receive")
        .count();
    let plural = |n: usize, one: &str, many: &str| if n == 1 { one } else { many }.to_owned();
    let mut parts = vec![format!(
        "{completed} of {} jobs completed within their deadline",
        jobs.len()
    )];
    let never = refused + expired_in_queue;
    if never > 0 {
        let mut why = Vec::new();
        if expired_in_queue > 0 {
            let who = if pages > 0 && pages_expired == pages && pages == expired_in_queue {
                // Exactly the urgent pages: say so.
                format!("the {} urgent {}", pages, plural(pages, "page", "pages"))
            } else if pages > 0 && pages_expired == pages {
                format!(
                    "{expired_in_queue}, the urgent {} among them,",
                    plural(pages, "page", "pages")
                )
            } else {
                expired_in_queue.to_string()
            };
            why.push(format!(
                "{who} expired in the queue before a worker received {}",
                plural(expired_in_queue, "it", "them")
            ));
        }
        if refused > 0 {
            why.push(format!(
                "{refused} {} refused by the worker, with too little budget left for a call",
                plural(refused, "was", "were")
            ));
        }
        parts.push(format!(
            "{never} that could no longer finish in time {} never started and cost no model call ({})",
            plural(never, "was", "were"),
            why.join("; ")
        ));
    }
    if cancelled > 0 {
        parts.push(format!(
            "{cancelled} ran out of time during the model call and {} cancelled at the deadline",
            plural(cancelled, "was", "were")
        ));
    }
    if failed > 0 {
        parts.push(format!("{failed} failed"));
    }
    if unknown > 0 {
        parts.push(format!("{unknown} ended without an outcome (unknown)"));
    }
    let last = parts.pop().expect("one part at least");
    let body = if parts.is_empty() {
        last
    } else {
        format!("{}, and {last}", parts.join(", "))
    };
    format!("what this run showed: {body}.")
}

/// How to run this binary again: `lastcall` if that is what the PATH finds, else its path.
fn program() -> String {
    let Ok(exe) = std::env::current_exe().and_then(std::fs::canonicalize) else {
        return "lastcall".into();
    };
    let on_path = std::env::var_os("PATH").and_then(|path| {
        std::env::split_paths(&path)
            .map(|d| d.join("lastcall"))
            .find(|p| p.is_file())
    });
    match on_path.and_then(|p| std::fs::canonicalize(p).ok()) {
        Some(p) if p == exe => "lastcall".into(),
        _ => shell_word(&exe.display().to_string()),
    }
}

/// A relative `sqlite://` URL made absolute, so that the hint works from any directory.
fn absolute_sqlite(url: &str) -> String {
    match url.strip_prefix("sqlite://") {
        Some(path) if !path.starts_with('/') && !path.starts_with(':') => {
            match std::env::current_dir() {
                Ok(cwd) => format!("sqlite://{}", cwd.join(path).display()),
                Err(_) => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
}

/// `s` quoted for a POSIX shell when it holds anything but plain path characters.
fn shell_word(s: &str) -> String {
    if s.chars()
        .all(|c| c.is_ascii_alphanumeric() || "/._-+:%@=,".contains(c))
    {
        s.to_owned()
    } else {
        format!("'{}'", s.replace('\'', "'\\''"))
    }
}

/// Generated tokens per second of call time, over the completed jobs that report usage.
fn tokens_per_second(recs: &[lastcall_store::JobRecord]) -> Option<f64> {
    let (tokens, ms) = recs
        .iter()
        .filter(|r| r.state == "completed")
        .filter_map(|r| Some((r.completion_tokens?, r.latency_ms?)))
        .fold((0i64, 0i64), |(t, m), (a, b)| (t + a, m + b));
    (tokens > 0 && ms > 0).then(|| tokens as f64 * 1000.0 / ms as f64)
}

/// Connect to the local broker, starting it where possible.
async fn ensure_broker(url: &str) -> Result<Broker> {
    if let Ok(b) = Broker::connect(url).await {
        return Ok(b);
    }
    let local = url.contains("127.0.0.1") || url.contains("localhost");
    let have_server = std::process::Command::new("sh")
        .args(["-c", "command -v rabbitmq-server"])
        .output()
        .is_ok_and(|o| o.status.success());
    if !(local && have_server) {
        bail!(
            "RabbitMQ is not reachable at {}. Install and start it (Debian: `apt-get install rabbitmq-server && rabbitmq-server -detached`), or point LASTCALL_AMQP_URL at a running broker",
            lastcall_broker::redact(url)
        );
    }
    eprintln!("RabbitMQ is not running; starting it with `rabbitmq-server -detached` …");
    let _ = std::process::Command::new("rabbitmq-server")
        .arg("-detached")
        .status();
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        if let Ok(b) = Broker::connect(url).await {
            return Ok(b);
        }
    }
    bail!(
        "started rabbitmq-server but it did not accept connections within 60 s; check `rabbitmqctl status`"
    )
}

#[cfg(test)]
mod tests {
    use super::{PAGE_KIND, SUMMARY_KIND, story};

    #[test]
    fn the_closing_sentence_says_what_happened() {
        let (p, s) = (PAGE_KIND, SUMMARY_KIND);
        let run = [
            (p, "expired_before_receive"),
            (p, "expired_before_receive"),
            (s, "completed"),
            (s, "expired_not_started"),
            (s, "deadline_exceeded"),
        ];
        assert_eq!(
            story(&run, 0),
            "what this run showed: 1 of 5 jobs completed within their deadline, 3 that could \
             no longer finish in time were never started and cost no model call (the 2 urgent \
             pages expired in the queue before a worker received them; 1 was refused by the \
             worker, with too little budget left for a call), and 1 ran out of time during the \
             model call and was cancelled at the deadline."
        );
        let run = [
            (p, "expired_before_receive"),
            (s, "expired_before_receive"),
            (s, "completed"),
        ];
        assert_eq!(
            story(&run, 1),
            "what this run showed: 1 of 3 jobs completed within their deadline, 2 that could \
             no longer finish in time were never started and cost no model call (2, the urgent \
             page among them, expired in the queue before a worker received them), and 1 ended \
             without an outcome (unknown)."
        );
        assert_eq!(
            story(&[(s, "completed")], 0),
            "what this run showed: 1 of 1 jobs completed within their deadline."
        );
    }
}
