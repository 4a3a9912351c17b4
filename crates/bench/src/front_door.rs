//! `lastcall bench front-door`: what the OpenAI-compatible front door adds to a model call.
//!
//! One request at a time (low load): `POST /v1/chat/completions` on a real socket, through
//! the whole path (ingress claim and confirmed publish, the worker's receipt read, start row,
//! sim call, outcome, ack, the outcome event, the waiter's ledger read, the answer), against
//! calling the same simulated model directly. The overhead is the difference of the two
//! latency distributions' percentiles.

use crate::Env;
use crate::{Percentiles, f1};
use anyhow::{Result, bail};
use clap::Args;
use lastcall_backend::sim::{SimBackend, SimConfig};
use lastcall_backend::{Backend, CallRequest};
use lastcall_broker::{Broker, Publisher};

use lastcall_core::table::render;
use lastcall_core::{AdmissionPolicy, EnvelopeLimits};
use lastcall_http::{AppState, Token};
use lastcall_producer::Submitter;
use lastcall_worker::{Worker, WorkerConfig, WorkerStats};
use serde_json::json;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

/// `lastcall bench front-door` options.
#[derive(Debug, Args)]
pub struct FrontDoorArgs {
    /// Requests, one at a time
    #[arg(long, default_value_t = 300)]
    pub requests: u64,
    /// The simulated model's call time, in ms (the direct baseline takes as long)
    #[arg(long, default_value_t = 0)]
    pub sim_latency_ms: u64,
    /// Ledger [default: a fresh SQLite file in a temp directory]
    #[arg(long)]
    pub ledger_url: Option<String>,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
    /// 20 requests (CI smoke test; the numbers mean little)
    #[arg(long)]
    pub smoke: bool,
}

pub async fn run(env: &Env, mut a: FrontDoorArgs) -> Result<ExitCode> {
    if a.smoke {
        a.requests = a.requests.min(20);
    }
    if a.requests == 0 {
        bail!("--requests must be positive");
    }
    let prefix = format!("{}-bench-front-door-{:x}", env.prefix, env.clock.now_ms());
    let dir = crate::temp_dir("front-door", &*env.clock)?;
    let ledger_url = a
        .ledger_url
        .clone()
        .unwrap_or_else(|| format!("sqlite://{}", dir.join("ledger.db").display()));
    let ledger = crate::open_ledger(&ledger_url).await?;
    let clock = env.clock.clone();
    let sim = || {
        SimBackend::new(SimConfig {
            latency_ms: a.sim_latency_ms,
            ..SimConfig::default()
        })
    };
    let mut cfg = WorkerConfig::new(&prefix, 4);
    cfg.name = "bench-front-door".into();
    let topo = cfg.topology.clone();
    let broker = Broker::connect(&env.amqp_url).await?;
    let worker = Worker::build(
        cfg,
        Broker::connect(&env.amqp_url).await?,
        ledger.clone(),
        Arc::new(sim()?),
        clock.clone(),
        Arc::new(WorkerStats::default()),
    )
    .await?;
    let stop = CancellationToken::new();
    let worker_task = tokio::spawn(worker.run(stop.clone()));

    // `serve` in this process, as `lastcall serve` wires it.
    let token = "bench-front-door-token-0123456789";
    let submitter = Submitter::new(
        Publisher::new(&broker, Duration::from_secs(5)).await?,
        topo.names.clone(),
        Some(ledger.clone()),
        AdmissionPolicy::default(),
        EnvelopeLimits::default(),
    );
    let state = AppState::new(
        submitter,
        ledger.clone(),
        clock.clone(),
        Token::new(token)?,
        topo.names.clone(),
    );
    state.waiters.follow(
        broker.clone(),
        topo.names.events_exchange.clone(),
        stop.clone(),
        |_| {},
    );
    let addr = lastcall_http::listen(
        "127.0.0.1:0".parse()?,
        lastcall_http::app(Arc::new(state)),
        stop.clone(),
        None,
    )
    .await?
    .addr;
    // The follower binds its queue right after connecting; give it the first request's
    // time by warming up (not measured) until one request completes.
    let http = reqwest::Client::new();
    let url = format!("http://{addr}/v1/chat/completions");
    let body = json!({"model": "bench", "messages": [{"role": "user", "content": "hi"}]});
    let body_bytes = serde_json::to_vec(&body)?;
    let call = async || -> Result<u64> {
        let t0 = Instant::now();
        let r = http
            .post(&url)
            .bearer_auth(token)
            .header("x-lastcall-deadline-ms", "10000")
            .header("content-type", "application/json")
            .body(body_bytes.clone())
            .send()
            .await?;
        let status = r.status();
        let _ = r.bytes().await?;
        if !status.is_success() {
            bail!("the front door answered {status}");
        }
        Ok(t0.elapsed().as_micros() as u64)
    };
    for _ in 0..5 {
        call().await?;
    }
    let bar = crate::bar(a.requests, "front door");
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut via = Vec::new();
    for _ in 0..a.requests {
        via.push(call().await?);
        bar.inc(1);
    }
    bar.finish_and_clear();
    // The same model called directly.
    let direct_backend = sim()?;
    let mut direct = Vec::new();
    for i in 0..a.requests {
        let req = CallRequest {
            job_id: format!("direct-{i}"),
            kind: "chat".into(),
            attempt: 0,
            payload: body.as_object().cloned().unwrap_or_default(),
            timeout: Duration::from_secs(10),
            priority: lastcall_core::Priority::Standard,
        };
        let t0 = Instant::now();
        direct_backend.call(req, CancellationToken::new()).await?;
        direct.push(t0.elapsed().as_micros() as u64);
    }
    stop.cancel();
    let _ = worker_task.await;
    let _ = lastcall_broker::Topology::new(&prefix)
        .delete(&broker)
        .await;
    broker.close().await;
    ledger.close().await;
    let _ = std::fs::remove_dir_all(&dir);

    let (v, d) = (Percentiles::from_us(via), Percentiles::from_us(direct));
    let over = |x: f64, y: f64| (x - y).max(0.0);
    let overhead = json!({
        "p50_ms": over(v.p50_ms, d.p50_ms),
        "p90_ms": over(v.p90_ms, d.p90_ms),
        "p99_ms": over(v.p99_ms, d.p99_ms),
    });
    if a.json {
        let j = json!({
            "bench": "front-door",
            "requests": a.requests,
            "sim_latency_ms": a.sim_latency_ms,
            "ledger": if a.ledger_url.is_some() { "given" } else { "sqlite" },
            "front_door": v,
            "direct": d,
            "overhead": overhead,
            "machine": crate::machine(),
        });
        println!("{}", serde_json::to_string_pretty(&j)?);
    } else {
        println!(
            "front door, {} requests one at a time, sim model at {} ms ({} cores, {} build)",
            a.requests,
            a.sim_latency_ms,
            crate::machine().cores,
            crate::machine().build
        );
        let rows = vec![
            vec![
                "front door".into(),
                f1(v.p50_ms),
                f1(v.p90_ms),
                f1(v.p99_ms),
                f1(v.max_ms),
            ],
            vec![
                "direct".into(),
                f1(d.p50_ms),
                f1(d.p90_ms),
                f1(d.p99_ms),
                f1(d.max_ms),
            ],
            vec![
                "overhead".into(),
                f1(over(v.p50_ms, d.p50_ms)),
                f1(over(v.p90_ms, d.p90_ms)),
                f1(over(v.p99_ms, d.p99_ms)),
                String::new(),
            ],
        ];
        print!("{}", render(&["ms", "p50", "p90", "p99", "max"], &rows));
    }
    Ok(ExitCode::SUCCESS)
}
