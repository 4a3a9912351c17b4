//! `lastcall bench ledger`: outcome writes per second on SQLite and PostgreSQL.
//!
//! Single-row writes only: every outcome is its own committed transaction, which is what
//! "durable before ack" needs per delivery. Batched commits (ack a contiguous range with
//! `multiple` after one transaction) are not implemented in the ledger yet.

use crate::Env;
use crate::{Percentiles, f1};
use anyhow::{Result, bail};
use clap::Args;
use lastcall_clock::Clock;
use lastcall_core::{Decision, State};
use lastcall_store::{AttemptStart, Ledger, LedgerWrite, OutcomeRecord};
use serde::Serialize;
use serde_json::json;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Instant;
use tokio::task::JoinSet;

/// `lastcall bench ledger` options.
#[derive(Debug, Args)]
pub struct LedgerArgs {
    /// Writes (and worker sequences) per backend
    #[arg(long, default_value_t = 2_000)]
    pub writes: u64,
    /// Concurrent writers (like a worker's model slots)
    #[arg(long, default_value_t = 8)]
    pub writers: usize,
    /// Outcomes per transaction in the `grouped_outcome` rows (the worker's group commit
    /// writes whatever finished while the previous transaction committed)
    #[arg(long, default_value_t = 64)]
    pub batch: u64,
    /// Also measure PostgreSQL at this URL (rows are written under fresh job ids)
    #[arg(long, env = "LASTCALL_BENCH_PG_URL", hide_env_values = true)]
    pub postgres_url: Option<String>,
    /// Skip SQLite
    #[arg(long)]
    pub no_sqlite: bool,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
    /// Small N for a CI smoke test (numbers from it mean nothing)
    #[arg(long)]
    pub smoke: bool,
}

#[derive(Debug, Clone, Serialize)]
struct Row {
    backend: &'static str,
    /// `outcome` (one terminal write per transaction), `grouped_outcome` (`batch` outcomes
    /// per transaction) or `worker_sequence` (receipt lookup, running row, outcome, ack
    /// mark, one transaction each).
    what: &'static str,
    writes: u64,
    writers: usize,
    ok: u64,
    errors: u64,
    per_s: f64,
    latency: Percentiles,
}

pub async fn run(env: &Env, mut a: LedgerArgs) -> Result<ExitCode> {
    if a.smoke {
        a.writes = a.writes.min(100);
    }
    if a.writes == 0 || a.writers == 0 || a.batch == 0 {
        bail!("--writes, --writers and --batch must be at least 1");
    }
    let mut targets: Vec<(String, Option<std::path::PathBuf>)> = Vec::new();
    if !a.no_sqlite {
        let d = crate::temp_dir("ledger", &*env.clock)?;
        targets.push((
            format!("sqlite://{}", d.join("ledger.db").display()),
            Some(d),
        ));
    }
    if let Some(u) = &a.postgres_url {
        targets.push((u.clone(), None));
    }
    let mut rows = Vec::new();
    for (url, dir) in targets {
        let ledger = crate::open_ledger(&url).await?;
        for what in ["outcome", "grouped_outcome", "worker_sequence"] {
            rows.push(measure(&ledger, what, &a, &env.clock).await?);
        }
        ledger.close().await;
        if let Some(d) = dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "bench": "ledger",
                "smoke": a.smoke,
                "machine": crate::machine(),
                "results": rows,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    let table: Vec<Vec<String>> = rows
        .iter()
        .map(|r| {
            vec![
                r.backend.to_owned(),
                r.what.to_owned(),
                r.writers.to_string(),
                format!("{}/{}", r.ok, r.writes),
                r.errors.to_string(),
                format!("{:.0}", r.per_s),
                f1(r.latency.p50_ms),
                f1(r.latency.p99_ms),
            ]
        })
        .collect();
    print!(
        "{}",
        (env.table)(
            &[
                "backend", "what", "writers", "ok", "errors", "per_s", "p50_ms", "p99_ms"
            ],
            &table
        )
    );
    println!(
        "one committed transaction per write (\"durable before ack\"), except grouped_outcome: {} outcomes per transaction (latency per transaction); worker_sequence = receipt lookup + running row + outcome + ack mark",
        a.batch
    );
    Ok(ExitCode::SUCCESS)
}

async fn measure(
    ledger: &Arc<Ledger>,
    what: &'static str,
    a: &LedgerArgs,
    clock: &Arc<dyn Clock>,
) -> Result<Row> {
    let nonce = format!("{:x}", clock.now_ms());
    let bar = crate::bar(a.writes, &format!("{} {what}", ledger.backend_name()));
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let step = if what == "grouped_outcome" {
        a.batch
    } else {
        1
    };
    let t0 = Instant::now();
    let mut set = JoinSet::new();
    for _ in 0..a.writers {
        let (ledger, next, bar, nonce) = (ledger.clone(), next.clone(), bar.clone(), nonce.clone());
        let clock = clock.clone();
        let n = a.writes;
        set.spawn(async move {
            let (mut ok, mut err, mut lat) = (0u64, 0u64, Vec::new());
            loop {
                let i = next.fetch_add(step, std::sync::atomic::Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let ids: Vec<String> = (i..(i + step).min(n))
                    .map(|j| format!("lb-{nonce}-{what}-{j}"))
                    .collect();
                let t = Instant::now();
                let r = if what == "grouped_outcome" {
                    let writes: Vec<LedgerWrite> = ids
                        .iter()
                        .map(|id| LedgerWrite::outcome(outcome(id, false, clock.now_ms())))
                        .collect();
                    ledger.write_batch(&writes).await.map(|_| ())
                } else {
                    one(&ledger, what, &ids[0], &*clock).await
                };
                lat.push(t.elapsed().as_micros() as u64);
                match r {
                    Ok(()) => ok += ids.len() as u64,
                    Err(_) => err += ids.len() as u64,
                }
                bar.inc(ids.len() as u64);
            }
            (ok, err, lat)
        });
    }
    let (mut ok, mut errors, mut lat) = (0, 0, Vec::new());
    while let Some(r) = set.join_next().await {
        let (o, e, l) = r?;
        ok += o;
        errors += e;
        lat.extend(l);
    }
    let secs = t0.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok(Row {
        backend: ledger.backend_name(),
        what,
        writes: a.writes,
        writers: a.writers,
        ok,
        errors,
        per_s: ok as f64 / secs.max(1e-9),
        latency: Percentiles::from_us(lat),
    })
}

async fn one(
    ledger: &Ledger,
    what: &str,
    job_id: &str,
    clock: &dyn Clock,
) -> Result<(), lastcall_store::StoreError> {
    let now = clock.now_ms();
    let key = format!("{job_id}:a");
    if what == "worker_sequence" {
        ledger.receipt_info(job_id).await?;
        ledger
            .record_start(&AttemptStart {
                attempt_key: key.clone(),
                job_id: job_id.to_owned(),
                kind: "bench.ledger".into(),
                attempt: 0,
                created_at_ms: now,
                expires_at_ms: now + 60_000,
                worker: "bench".into(),
                redelivered: false,
                received_at_ms: now,
                checked_at_ms: now,
                started_at_ms: now,
                tenant: lastcall_core::Tenant::default_tenant(),
                priority: lastcall_core::Priority::Standard,
            })
            .await?;
    }
    ledger
        .record_outcome(&outcome(job_id, what == "worker_sequence", clock.now_ms()))
        .await?;
    if what == "worker_sequence" {
        ledger.mark_acked(&key, clock.now_ms()).await?;
    }
    Ok(())
}

/// A completed outcome for `job_id` (attempt key `{job_id}:a`), recorded at `now`.
fn outcome(job_id: &str, model_called: bool, now: i64) -> OutcomeRecord {
    OutcomeRecord {
        attempt_key: format!("{job_id}:a"),
        created_at_ms: Some(now),
        expires_at_ms: Some(now + 60_000),
        received_at_ms: Some(now),
        started_at_ms: Some(now),
        finished_at_ms: Some(now),
        recorded_at_ms: now,
        worker: "bench".into(),
        model_called,
        result: Some("ok".into()),
        ..OutcomeRecord::new(job_id, "bench.ledger", State::Completed, Decision::Ack, now)
    }
}
