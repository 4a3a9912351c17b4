//! `lastcall demo`: the whole pipeline end to end on the local defaults.
//!
//! A burst of jobs with short deadlines goes to a worker with few model slots, so the
//! worker cannot serve them all in time. The table shows which jobs completed, which were
//! refused at the last admission check (`expired_not_started`, zero model calls) and which
//! expired at the broker before any worker received them (`expired_before_receive`).

use crate::cli::DemoArgs;
use crate::config::Settings;
use anyhow::{Context, Result, bail};
use indicatif::{ProgressBar, ProgressStyle};
use lastcall_backend::Backend;
use lastcall_backend::sim::{SimBackend, SimConfig};
use lastcall_broker::{Broker, Publisher};
use lastcall_core::State;
use lastcall_store::ListFilter;
use lastcall_worker::clock::now_ms;
use lastcall_worker::dlq::DeadLetterProcessor;
use lastcall_worker::{
    Clock, DeadlineSpec, NewJob, Submitter, SystemClock, Worker, WorkerConfig, WorkerStats,
};
use serde_json::json;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const INCIDENTS: &[&str] = &[
    "api-gateway p99 latency above 2s since 14:02, error rate 4%",
    "disk usage on db-3 at 97%, autovacuum lagging",
    "checkout service 502s after deploy 7f3c, rollback pending",
    "certificate for auth.internal expires in 3 days",
    "queue depth on payments.work growing 500/min, consumers healthy",
    "memory leak suspected in search-indexer, RSS +200MB/h",
];

pub async fn run(s: &Settings, a: DemoArgs) -> Result<ExitCode> {
    if a.jobs == 0 || a.slots == 0 || a.rate <= 0.0 {
        bail!("--jobs and --slots must be at least 1, and --rate positive");
    }
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
    let mut cfg = WorkerConfig::new(&prefix, a.slots);
    cfg.name = "demo-worker".into();
    cfg.shutdown_grace = Duration::from_secs(2);
    cfg.topology.apply(&broker).await?;
    for q in [
        &cfg.topology.names.work_queue,
        &cfg.topology.names.dead_queue,
    ] {
        broker.purge(q).await?;
    }
    let clock: Arc<dyn Clock> = Arc::new(SystemClock::default());
    let sim = Arc::new(SimBackend::new(SimConfig {
        latency_ms: a.sim_latency_ms,
        ..SimConfig::default()
    })?);
    let backend: Arc<dyn Backend> = sim.clone();
    let stats = Arc::new(WorkerStats::default());
    println!(
        "lastcall demo: {} jobs at {}/s, deadline {} ms each, {} model slot(s) at {} ms per call (capacity ≈ {:.1} jobs/s), prefetch {}",
        a.jobs,
        a.rate,
        a.deadline_ms,
        a.slots,
        a.sim_latency_ms,
        a.slots as f64 * 1000.0 / a.sim_latency_ms.max(1) as f64,
        cfg.prefetch
    );
    println!(
        "the worker starts {} ms after the first job (as after a restart)",
        a.worker_delay_ms
    );
    println!(
        "broker {} · ledger {} · queues {}.*",
        lastcall_broker::redact(&s.amqp_url),
        store_url,
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
    let dlq = DeadLetterProcessor::build(
        broker.clone(),
        ledger.clone(),
        topo.clone(),
        clock.clone(),
        false,
    )
    .await
    .map_err(anyhow::Error::msg)?;
    let dlq_task = tokio::spawn(dlq.run(stop.clone(), None));

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
    let bar = ProgressBar::new(a.jobs as u64);
    bar.set_style(
        ProgressStyle::with_template("{msg:>12} [{bar:40}] {pos}/{len}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    bar.set_message("submitting");
    let mut last_expiry = 0;
    let gap = Duration::from_secs_f64(1.0 / a.rate.max(0.1));
    let mut tick = tokio::time::interval(gap);
    for i in 0..a.jobs {
        tick.tick().await;
        let incident = INCIDENTS[i % INCIDENTS.len()];
        let job = NewJob {
            job_id: Some(format!("demo-{:03}", i + 1)),
            kind: "incident.summary".into(),
            payload: json!({"messages": [
                {"role": "system", "content": "Summarize the incident for the on-call operator in one sentence."},
                {"role": "user", "content": incident}
            ]})
            .as_object()
            .cloned()
            .expect("object"),
            deadline: DeadlineSpec::RelativeMs(a.deadline_ms),
            min_runtime_ms: Some(a.min_runtime_ms.unwrap_or(a.sim_latency_ms)),
            trace_id: None,
        };
        let sub = submitter
            .submit(&job, now_ms())
            .await
            .context("submitting a demo job")?;
        last_expiry = sub.expires_at_ms;
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
        if done as usize >= a.jobs || now_ms() > give_up_at {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    bar.finish_and_clear();
    // Anything still without an outcome after deadline + grace is named, not guessed.
    let unknown = ledger.mark_unknown(now_ms(), 1_000).await?;
    stop.cancel();
    let _ = worker_task.await;
    let _ = dlq_task.await;

    let recs = ledger
        .list(&ListFilter {
            limit: Some(a.jobs as i64 + 10),
            ..ListFilter::default()
        })
        .await?;
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
        "model calls: {} in total (backend counter), {} for expired jobs · jobs never received by a worker: {} · unknown: {}",
        sim.calls(),
        expired_calls,
        recs.iter()
            .filter(|r| r.state == "expired_before_receive")
            .count(),
        unknown.len()
    );
    println!(
        "worker: received {} deliveries, {} model calls started",
        stats.received.load(Ordering::Relaxed),
        stats.backend_calls.load(Ordering::Relaxed)
    );
    println!("inspect: lastcall --store-url {store_url} jobs list --state expired_not_started");
    broker.close().await;
    ledger.close().await;
    if expired_calls != 0 {
        bail!("invariant violated: {expired_calls} model call(s) were made for expired jobs");
    }
    Ok(ExitCode::SUCCESS)
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
