//! `lastcall bench ack-modes`: the seed's comparison table, measured.
//!
//! All lapin work happens in [`crate::raw`]; this module only orchestrates runs and turns
//! the numbers into a table, JSON and percentiles.

use crate::Env;
use crate::raw::{self, AckMode, ConsumeSpec, RunConfig};
use crate::{Percentiles, f1};
use anyhow::{Result, bail};
use clap::Args;
use lapin::Connection;
use lastcall_backend::Backend;
use lastcall_backend::sim::{SimBackend, SimConfig};
use lastcall_broker::{Broker, Publisher, QueueType};

use lastcall_core::table::render;
use lastcall_core::{AdmissionPolicy, EnvelopeLimits};
use lastcall_producer::{DeadlineSpec, NewJob, Submitter};
use lastcall_worker::{Worker, WorkerConfig, WorkerStats};
use serde::Serialize;
use serde_json::json;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// `lastcall bench ack-modes` options.
#[derive(Debug, Args)]
pub struct AckModesArgs {
    /// Messages per mode
    #[arg(long, default_value_t = 20_000)]
    pub messages: u64,
    /// Body size in bytes (the first 8 carry the publish time)
    #[arg(long, default_value_t = 1024)]
    pub message_bytes: usize,
    /// Queue type
    #[arg(long, default_value = "classic", value_parser = ["classic", "quorum"])]
    pub queue_type: String,
    /// Non-durable queue and transient messages (default: durable and persistent)
    #[arg(long)]
    pub transient: bool,
    /// Unconfirmed publishes in flight at most
    #[arg(long, default_value_t = 128)]
    pub confirm_window: usize,
    /// Consumers on the queue
    #[arg(long, default_value_t = 1)]
    pub consumers: usize,
    /// Prefetch values of the manual-ack modes
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,64,256,1024")]
    pub prefetch: Vec<u16>,
    /// Prefetch N of the `multiple` mode
    #[arg(long, default_value_t = 256)]
    pub multiple_prefetch: u16,
    /// One `multiple` ack every k deliveries (k < N, or the consumer would stall)
    #[arg(long, default_value_t = 32)]
    pub multiple_every: u16,
    /// Crash variant: messages in the queue, and deliveries processed before the kill
    #[arg(long, default_value_t = 2_000)]
    pub crash_messages: u64,
    #[arg(long, default_value_t = 200)]
    pub crash_after: u64,
    /// Crash variant: prefetch of the manual-ack consumer
    #[arg(long, default_value_t = 64)]
    pub crash_prefetch: u16,
    /// Baseline vs pipeline: lastcall envelopes drained by each
    #[arg(long, default_value_t = 3_000)]
    pub pipeline_messages: u64,
    /// Baseline vs pipeline: the worker's model slots (prefetch = 2 × slots for both)
    #[arg(long, default_value_t = 8)]
    pub pipeline_slots: usize,
    /// Baseline vs pipeline: the worker's ledger [default: a fresh SQLite file]
    #[arg(long)]
    pub pipeline_ledger_url: Option<String>,
    /// Skip the mode table (run only the crash variant and the pipeline comparison)
    #[arg(long)]
    pub skip_modes: bool,
    /// Print one JSON object instead of the tables
    #[arg(long)]
    pub json: bool,
    /// Small N for a CI smoke test (numbers from it mean nothing)
    #[arg(long)]
    pub smoke: bool,
}

#[derive(Debug, Clone, Serialize)]
struct ModeRow {
    mode: String,
    messages: u64,
    consumed: u64,
    /// Messages per second consumed, over the wall time of the run.
    consume_per_s: f64,
    publish_per_s: f64,
    nacked: u64,
    latency: Percentiles,
}

#[derive(Debug, Clone, Serialize)]
struct CrashRow {
    mode: String,
    messages: u64,
    /// Processed (and settled) before the kill.
    processed_before_kill: u64,
    /// Delivered to the killed consumer beyond what it processed.
    left_in_queue_after_kill: u64,
    /// Neither processed nor left in the queue: gone.
    lost: u64,
    /// Left in the queue with the `redelivered` flag (handed back by the broker).
    redelivered: u64,
}

#[derive(Debug, Clone, Serialize)]
struct PipelineRow {
    messages: u64,
    prefetch: u16,
    slots: usize,
    ledger: String,
    /// The broker ceiling: the bare consumer acking with `multiple` every
    /// `baseline_multiple_every` deliveries (the worker coalesces its acks too).
    baseline_per_s: f64,
    baseline_multiple_every: u16,
    /// The bare consumer with one `basic.ack` per delivery.
    baseline_single_ack_per_s: f64,
    pipeline_per_s: f64,
    /// pipeline / baseline (the `multiple`-ack ceiling): the figure the target is about.
    fraction: f64,
    /// pipeline / the single-ack baseline.
    fraction_of_single_ack: f64,
    pipeline_completed: u64,
    /// Calls the sim backend received in the pipeline run (one per job: no duplicates ran).
    model_calls: u64,
    /// CPU time of this process (worker, ledger threads and the progress loop) per settled
    /// job over the pipeline run, in µs; `null` where `/proc` is not available.
    pipeline_cpu_us_per_job: Option<f64>,
    /// Share of the machine's CPU time (all cores, every process: the broker included) that
    /// was busy during the pipeline run, 0–1; `null` where `/proc` is not available.
    machine_cpu_busy: Option<f64>,
    /// CPU time of this process per message during the `multiple`-ack baseline, in µs.
    baseline_cpu_us_per_msg: Option<f64>,
    /// CPU time of everything else on the machine (the broker, mostly) per message during
    /// the `multiple`-ack baseline, in µs.
    broker_cpu_us_per_msg: Option<f64>,
    /// The most CPU per job the worker may use for 80% of the ceiling to fit on this
    /// machine's cores next to the broker's share, in µs (≤ 0: it cannot fit at all).
    cpu_budget_us_per_job_at_80: Option<f64>,
}

pub async fn run(env: &Env, mut a: AckModesArgs) -> Result<ExitCode> {
    if a.smoke {
        a.messages = a.messages.min(300);
        a.prefetch = vec![1, 64];
        a.crash_messages = a.crash_messages.min(200);
        a.crash_after = a.crash_after.min(20);
        a.pipeline_messages = a.pipeline_messages.min(100);
    }
    if a.multiple_every == 0 || a.multiple_every >= a.multiple_prefetch {
        bail!("--multiple-every must be at least 1 and below --multiple-prefetch");
    }
    if a.consumers == 0 || a.messages == 0 || a.crash_after >= a.crash_messages {
        bail!("--consumers and --messages must be positive, --crash-after below --crash-messages");
    }
    let queue_type: QueueType = a.queue_type.parse().map_err(anyhow::Error::msg)?;
    let broker = Broker::connect(&env.amqp_url).await?;
    let conn = Arc::new(raw::connect(&env.amqp_url).await?);
    let base = RunConfig {
        queue: format!("{}-bench-ack-{:x}", env.prefix, env.clock.now_ms()),
        queue_type,
        durable: !a.transient,
        message_bytes: a.message_bytes.max(8),
        confirm_window: a.confirm_window.max(1),
        consumers: a.consumers,
        messages: a.messages,
        origin: Instant::now(),
    };
    let fixed = json!({
        "message_bytes": base.message_bytes,
        "queue_type": a.queue_type,
        "durable_persistent": base.durable,
        "confirm_window": base.confirm_window,
        "consumers": base.consumers,
        "messages_per_mode": base.messages,
        "publisher": "one, concurrent with the consumers",
    });
    if !a.json {
        println!(
            "bench ack-modes: {} B messages, {} queue, {}, confirm window {}, {} consumer(s), {} messages per mode",
            base.message_bytes,
            a.queue_type,
            if base.durable {
                "durable + persistent"
            } else {
                "transient"
            },
            base.confirm_window,
            base.consumers,
            base.messages
        );
    }
    let mut modes = vec![AckMode::Auto];
    modes.extend(a.prefetch.iter().map(|p| AckMode::Manual { prefetch: *p }));
    modes.push(AckMode::Multiple {
        prefetch: a.multiple_prefetch,
        every: a.multiple_every,
    });
    let mut rows = Vec::new();
    if !a.skip_modes {
        for m in modes {
            rows.push(run_mode(env, &conn, &base, m, a.json).await?);
        }
    }
    let mut crash = Vec::new();
    for m in [
        AckMode::Auto,
        AckMode::Manual {
            prefetch: a.crash_prefetch,
        },
    ] {
        crash.push(run_crash(env, &conn, &base, m, &a).await?);
    }
    let pipeline = run_pipeline(env, &broker, &base, &a).await?;
    raw::delete_queue(&conn, &base.queue).await?;
    let _ = conn.close(200, "bye".into()).await;
    broker.close().await;

    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "bench": "ack-modes",
                "smoke": a.smoke,
                "fixed": fixed,
                "machine": crate::machine(),
                "modes": rows,
                "crash": crash,
                "pipeline": pipeline,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    if !rows.is_empty() {
        println!();
        let t: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                vec![
                    r.mode.clone(),
                    format!("{}/{}", r.consumed, r.messages),
                    format!("{:.0}", r.consume_per_s),
                    format!("{:.0}", r.publish_per_s),
                    f1(r.latency.p50_ms),
                    f1(r.latency.p90_ms),
                    f1(r.latency.p99_ms),
                    f1(r.latency.max_ms),
                ]
            })
            .collect();
        print!(
            "{}",
            render(
                &[
                    "mode",
                    "consumed",
                    "consume_msg_s",
                    "publish_msg_s",
                    "lat_p50_ms",
                    "lat_p90_ms",
                    "lat_p99_ms",
                    "lat_max_ms",
                ],
                &t
            )
        );
    }
    println!();
    let t: Vec<Vec<String>> = crash
        .iter()
        .map(|r| {
            vec![
                r.mode.clone(),
                r.messages.to_string(),
                r.processed_before_kill.to_string(),
                r.left_in_queue_after_kill.to_string(),
                r.lost.to_string(),
                r.redelivered.to_string(),
            ]
        })
        .collect();
    print!(
        "{}",
        render(
            &[
                "crash: mode",
                "messages",
                "processed",
                "left_in_queue",
                "lost",
                "redelivered"
            ],
            &t
        )
    );
    println!();
    let p = &pipeline;
    println!(
        "pipeline ({} lastcall envelopes in the worker's queue, prefetch {}):\n  \
         bare consumer, `multiple` ack every {}: {:.0} msg/s (the broker ceiling)\n  \
         bare consumer, one ack per delivery: {:.0} msg/s\n  \
         lastcall worker ({} slots, sim 0 ms, ledger {}): {:.0} jobs/s = {:.1}% of the ceiling, \
         {:.1}% of the single-ack consumer{}",
        p.messages,
        p.prefetch,
        p.baseline_multiple_every,
        p.baseline_per_s,
        p.baseline_single_ack_per_s,
        p.slots,
        p.ledger,
        p.pipeline_per_s,
        p.fraction * 100.0,
        p.fraction_of_single_ack * 100.0,
        match (
            p.pipeline_cpu_us_per_job,
            p.machine_cpu_busy,
            p.baseline_cpu_us_per_msg,
            p.broker_cpu_us_per_msg,
            p.cpu_budget_us_per_job_at_80,
        ) {
            (Some(us), Some(busy), Some(bare), Some(broker), Some(budget)) => format!(
                "\n  CPU per message in the ceiling run: bare consumer {bare:.0} µs, the rest of \
                 the machine (the broker) {broker:.0} µs\n  \
                 CPU per job in the worker run: {us:.0} µs (machine busy {:.0}%); \
                 80% of the ceiling leaves the worker {budget:.0} µs per job on these cores",
                busy * 100.0
            ),
            _ => String::new(),
        }
    );
    Ok(ExitCode::SUCCESS)
}

async fn run_mode(
    env: &Env,
    conn: &Arc<Connection>,
    base: &RunConfig,
    mode: AckMode,
    quiet: bool,
) -> Result<ModeRow> {
    raw::declare_queue(conn, base).await?;
    let bar = crate::bar(base.messages, &mode.to_string());
    if quiet {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let shared = Arc::new(AtomicU64::new(0));
    let t0 = Instant::now();
    let mut consumers = JoinSet::new();
    for _ in 0..base.consumers {
        let (url, q, shared) = (env.amqp_url.clone(), base.queue.clone(), shared.clone());
        let spec = ConsumeSpec {
            mode,
            stop_after: base.messages,
            crash_after: None,
            work: Duration::ZERO,
            record_latency: true,
            origin: base.origin,
        };
        consumers.spawn(async move { raw::consume(&url, &q, spec, shared).await });
    }
    let published = Arc::new(AtomicU64::new(0));
    let (c2, cfg2, p2) = (conn.clone(), base.clone(), published.clone());
    let publisher = tokio::spawn(async move { raw::publish(&c2, &cfg2, None, p2).await });
    // A consumer that finishes while the publisher still waits for its last confirms is
    // taken out of the set here: keep its samples (dropping them lost every latency of a
    // one-consumer run whenever the consumer beat the confirms, as on a loaded machine).
    let mut lat = Vec::new();
    while !publisher.is_finished() || shared.load(Ordering::Relaxed) < base.messages {
        bar.set_position(shared.load(Ordering::Relaxed));
        if consumers.is_empty() {
            break;
        }
        if let Some(r) = consumers.try_join_next() {
            lat.extend(r??.latencies_us);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let pubd = publisher.await??;
    while let Some(r) = consumers.join_next().await {
        lat.extend(r??.latencies_us);
    }
    let wall = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let consumed = shared.load(Ordering::Relaxed);
    Ok(ModeRow {
        mode: mode.to_string(),
        messages: base.messages,
        consumed,
        consume_per_s: consumed as f64 / wall.max(1e-9),
        publish_per_s: base.messages as f64 / pubd.elapsed.as_secs_f64().max(1e-9),
        nacked: pubd.nacked,
        latency: Percentiles::from_us(lat),
    })
}

async fn run_crash(
    env: &Env,
    conn: &Connection,
    base: &RunConfig,
    mode: AckMode,
    a: &AckModesArgs,
) -> Result<CrashRow> {
    let cfg = RunConfig {
        messages: a.crash_messages,
        ..base.clone()
    };
    raw::declare_queue(conn, &cfg).await?;
    raw::publish(conn, &cfg, None, Arc::new(AtomicU64::new(0))).await?;
    // A slow consumer (1 ms per delivery) killed after `crash_after` deliveries.
    let killed = raw::consume(
        &env.amqp_url,
        &cfg.queue,
        ConsumeSpec {
            mode,
            stop_after: u64::MAX,
            crash_after: Some(a.crash_after),
            work: Duration::from_millis(1),
            record_latency: false,
            origin: cfg.origin,
        },
        Arc::new(AtomicU64::new(0)),
    )
    .await?;
    // Let the broker notice the closed connection and requeue.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let left = raw::ready(conn, &cfg.queue).await?;
    let drain = if left > 0 {
        raw::consume(
            &env.amqp_url,
            &cfg.queue,
            ConsumeSpec {
                mode: AckMode::Manual { prefetch: 256 },
                stop_after: left,
                crash_after: None,
                work: Duration::ZERO,
                record_latency: false,
                origin: base.origin,
            },
            Arc::new(AtomicU64::new(0)),
        )
        .await?
    } else {
        raw::ConsumeResult::default()
    };
    Ok(CrashRow {
        mode: mode.to_string(),
        messages: cfg.messages,
        processed_before_kill: killed.processed,
        left_in_queue_after_kill: left,
        lost: cfg.messages.saturating_sub(killed.processed + left),
        redelivered: drain.redelivered,
    })
}

async fn run_pipeline(
    env: &Env,
    broker: &Broker,
    base: &RunConfig,
    a: &AckModesArgs,
) -> Result<PipelineRow> {
    let n = a.pipeline_messages.max(1);
    let slots = a.pipeline_slots.max(1);
    let prefetch = (slots * 2).clamp(1, u16::MAX as usize) as u16;
    let stamp = env.clock.now_ms();
    let prefix = format!("{}-bench-pipe-{stamp:x}", env.prefix);
    // Ids unique to this run: a shared ledger (--pipeline-ledger-url) must not turn a
    // later run's jobs into duplicates of an earlier run's.
    let id_prefix = format!("pipe-{stamp:x}-");
    let mut cfg = WorkerConfig::new(&prefix, slots);
    cfg.name = "bench-pipeline".into();
    cfg.prefetch = prefetch;
    cfg.shutdown_grace = Duration::from_secs(5);
    cfg.topology.queue_type = base.queue_type;
    cfg.topology.apply(broker).await?;
    let topo = cfg.topology.clone();
    let submitter = Submitter::new(
        Publisher::new(broker, Duration::from_secs(10)).await?,
        topo.names.clone(),
        None,
        AdmissionPolicy::default(),
        EnvelopeLimits::default(),
    );
    let job = |ids: &str, i: u64| {
        NewJob {
        job_id: Some(format!("{ids}{i}")),
        kind: "bench.pipeline".into(),
        payload: json!({"messages": [{"role": "user", "content": "x".repeat(base.message_bytes.saturating_sub(200).max(1))}]})
            .as_object()
            .cloned()
            .expect("object"),
        deadline: DeadlineSpec::RelativeMs(600_000),
        min_runtime_ms: None,
        trace_id: None,
    }
    };

    // Both consumers drain the same thing: envelopes published by the submitter (headers,
    // per-message TTL = remaining budget, message id) into the worker's own work queue
    // (its dead-letter arguments and type), so the baseline is the broker's ceiling for
    // exactly these messages. The queue is filled first, then drained.
    let fill = |what: &'static str, ids: String| {
        let submitter = submitter.clone();
        let bar = crate::bar(n, what);
        if a.json {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        async move {
            let mut set = JoinSet::new();
            for i in 0..n {
                let (sub, j) = (submitter.clone(), job(&ids, i));
                let now = env.clock.now_ms();
                set.spawn(async move { sub.submit(&j, now).await });
                if set.len() >= 64
                    && let Some(r) = set.join_next().await
                {
                    r??;
                }
                bar.inc(1);
            }
            while let Some(r) = set.join_next().await {
                r??;
            }
            Ok::<_, anyhow::Error>(bar)
        }
    };

    // Baselines: a bare consumer that only acks, once coalescing its acks with
    // `multiple` (as the worker does; k below the prefetch, or it would stall) and once
    // acking every delivery on its own.
    let every = a.multiple_every.min(prefetch / 2).max(1);
    let mut baselines = Vec::new();
    let mut baseline_cpu = None;
    for (what, mode) in [
        (
            "baseline (multiple acks): filling",
            AckMode::Multiple { prefetch, every },
        ),
        (
            "baseline (single acks): filling",
            AckMode::Manual { prefetch },
        ),
    ] {
        fill(what, format!("{id_prefix}base-{}-", baselines.len()))
            .await?
            .finish_and_clear();
        let from = CpuTimes::now();
        let r = raw::consume(
            &env.amqp_url,
            &topo.names.work_queue,
            ConsumeSpec {
                mode,
                stop_after: n,
                crash_after: None,
                work: Duration::ZERO,
                record_latency: false,
                origin: base.origin,
            },
            Arc::new(AtomicU64::new(0)),
        )
        .await?;
        if baselines.is_empty() {
            baseline_cpu = from
                .zip(CpuTimes::now())
                .map(|(from, to)| (to.since(&from), r.processed.max(1) as f64));
        }
        baselines.push(r.processed as f64 / r.elapsed.as_secs_f64().max(1e-9));
    }
    let (baseline_per_s, baseline_single_ack_per_s) = (baselines[0], baselines[1]);

    // Pipeline: fill the work queue again, then time the worker from its first receipt
    // to its last settle.
    let bar = fill("pipeline: filling", id_prefix.clone()).await?;
    let (ledger_url, dir) = match &a.pipeline_ledger_url {
        Some(u) => (u.clone(), None),
        None => {
            let d = crate::temp_dir("pipeline", &*env.clock)?;
            (
                format!("sqlite://{}", d.join("ledger.db").display()),
                Some(d),
            )
        }
    };
    let ledger = crate::open_ledger(&ledger_url).await?;
    let sim = Arc::new(SimBackend::new(SimConfig::default())?);
    let backend: Arc<dyn Backend> = sim.clone();
    let clock = env.clock.clone();
    let stats = Arc::new(WorkerStats::default());
    let worker = Worker::build(
        cfg,
        Broker::connect(&env.amqp_url).await?,
        ledger.clone(),
        backend,
        clock,
        stats.clone(),
    )
    .await?;
    let stop = CancellationToken::new();
    bar.set_message("pipeline: worker");
    bar.set_position(0);
    let task = tokio::spawn(worker.run(stop.clone()));
    let mut first: Option<(Instant, Option<CpuTimes>)> = None;
    let give_up = Instant::now() + Duration::from_secs(600);
    loop {
        let settled = stats.settled.load(Ordering::Relaxed);
        if first.is_none() && stats.received.load(Ordering::Relaxed) > 0 {
            first = Some((Instant::now(), CpuTimes::now()));
        }
        bar.set_position(settled);
        if settled >= n || Instant::now() > give_up || task.is_finished() {
            break;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let secs = first.map(|t| t.0.elapsed().as_secs_f64()).unwrap_or(0.0);
    let cpu = first
        .and_then(|(_, from)| from.zip(CpuTimes::now()))
        .map(|(from, to)| to.since(&from));
    bar.finish_and_clear();
    stop.cancel();
    let _ = task.await;
    let completed = ledger
        .list(&lastcall_store::ListFilter {
            state: Some("completed".into()),
            kind: Some("bench.pipeline".into()),
            limit: None,
            tenant: None,
        })
        .await?
        .iter()
        .filter(|r| r.job_id.starts_with(&id_prefix))
        .count() as u64;
    ledger.close().await;
    let _ = topo.delete(broker).await;
    if let Some(d) = dir {
        let _ = std::fs::remove_dir_all(d);
    }
    let settled = stats.settled.load(Ordering::Relaxed);
    let pipeline_per_s = settled as f64 / secs.max(1e-9);
    let broker_cpu_us_per_msg = baseline_cpu.map(|(c, n)| c.others_s() * 1e6 / n);
    Ok(PipelineRow {
        messages: n,
        prefetch,
        slots,
        ledger: if a.pipeline_ledger_url.is_some() {
            ledger_url
        } else {
            "fresh SQLite".into()
        },
        baseline_per_s,
        baseline_multiple_every: every,
        baseline_single_ack_per_s,
        pipeline_per_s,
        fraction: pipeline_per_s / baseline_per_s.max(1e-9),
        fraction_of_single_ack: pipeline_per_s / baseline_single_ack_per_s.max(1e-9),
        pipeline_completed: completed,
        model_calls: sim.calls(),
        pipeline_cpu_us_per_job: cpu.map(|c| c.process_s * 1e6 / settled.max(1) as f64),
        machine_cpu_busy: cpu.map(|c| c.busy()),
        baseline_cpu_us_per_msg: baseline_cpu.map(|(c, n)| c.process_s * 1e6 / n),
        broker_cpu_us_per_msg,
        cpu_budget_us_per_job_at_80: baseline_cpu.zip(broker_cpu_us_per_msg).map(
            |((c, _), broker)| {
                // Core-seconds per second the machine has, spent at 0.8 × the ceiling's
                // rate, less the broker's share.
                c.cores() * 1e6 / (0.8 * baseline_per_s.max(1e-9)) - broker
            },
        ),
    })
}

/// CPU time counters from `/proc` (Linux), for the pipeline's CPU cost per job.
#[derive(Debug, Clone, Copy)]
struct CpuTimes {
    /// This process: user + system, in clock ticks.
    process_ticks: u64,
    /// The machine, summed over all cores: busy and total ticks.
    machine_busy_ticks: u64,
    machine_total_ticks: u64,
    at: Instant,
}

/// What [`CpuTimes::since`] derives: CPU seconds over a wall-clock interval.
#[derive(Debug, Clone, Copy)]
struct CpuUse {
    /// This process, user + system.
    process_s: f64,
    /// The machine, summed over cores: busy, and in all (busy + idle).
    machine_busy_s: f64,
    machine_total_s: f64,
    wall_s: f64,
}

impl CpuUse {
    fn busy(&self) -> f64 {
        self.machine_busy_s / self.machine_total_s.max(1e-9)
    }

    /// Busy CPU time of everything but this process.
    fn others_s(&self) -> f64 {
        (self.machine_busy_s - self.process_s).max(0.0)
    }

    /// Cores the machine has, as seen by its counters.
    fn cores(&self) -> f64 {
        self.machine_total_s / self.wall_s.max(1e-9)
    }
}

impl CpuTimes {
    /// Clock ticks per second of `/proc`'s counters (USER_HZ, 100 on Linux).
    const TICKS_PER_S: f64 = 100.0;

    fn now() -> Option<Self> {
        let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
        // Fields after the command name (which may hold spaces) start at field 3;
        // utime and stime are fields 14 and 15.
        let rest = stat.rsplit_once(')')?.1;
        let f: Vec<&str> = rest.split_whitespace().collect();
        let process_ticks = f.get(11)?.parse::<u64>().ok()? + f.get(12)?.parse::<u64>().ok()?;
        let all = std::fs::read_to_string("/proc/stat").ok()?;
        let cpu: Vec<u64> = all
            .lines()
            .next()?
            .strip_prefix("cpu ")?
            .split_whitespace()
            .filter_map(|v| v.parse().ok())
            .collect();
        // user nice system idle iowait irq softirq steal (guest time is inside user).
        let total: u64 = cpu.iter().take(8).sum();
        let idle = cpu.get(3)? + cpu.get(4).copied().unwrap_or(0);
        Some(Self {
            process_ticks,
            machine_busy_ticks: total - idle,
            machine_total_ticks: total,
            at: Instant::now(),
        })
    }

    fn since(&self, from: &Self) -> CpuUse {
        let secs = |to: u64, from: u64| to.saturating_sub(from) as f64 / Self::TICKS_PER_S;
        CpuUse {
            process_s: secs(self.process_ticks, from.process_ticks),
            machine_busy_s: secs(self.machine_busy_ticks, from.machine_busy_ticks),
            machine_total_s: secs(self.machine_total_ticks, from.machine_total_ticks),
            wall_s: self.at.duration_since(from.at).as_secs_f64(),
        }
    }
}
