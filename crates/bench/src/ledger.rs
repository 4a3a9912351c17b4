//! `lastcall bench ledger`: outcome writes per second on SQLite and PostgreSQL.
//!
//! With `--prune-rows N`: the ledger is first filled with N terminal jobs
//! recorded long ago, then the grouped writers run for `--measure-s` seconds alone, then
//! again while a pruner deletes those N jobs the way a worker's background pruning does
//! (batches of 1,000 rows, at least 50 ms apart and paced by `lastcall_store::prune_pause`:
//! the defaults of `[ledger] batch_rows` and `batch_pause_ms`), then alone once more: the writers' throughput while pruning ÷ without
//! is the cost of pruning. With `--copy-to URL` the filled SQLite ledger is copied there by
//! `lastcall ledger copy`, killed with SIGKILL after `--copy-kill-after-s` and run again to
//! completion (the command checks every table's count and checksum itself).
//!
//! Single-row writes only: every outcome is its own committed transaction, which is what
//! "durable before ack" needs per delivery. Batched commits (ack a contiguous range with
//! `multiple` after one transaction) are not implemented in the ledger yet.

use crate::Env;
use crate::{Percentiles, f1};
use anyhow::{Result, bail};
use clap::Args;
use lastcall_clock::Clock;
use lastcall_core::table::render;
use lastcall_core::{Decision, State};
use lastcall_store::{AttemptStart, Ledger, LedgerWrite, OutcomeRecord};
use serde::Serialize;
use serde_json::json;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
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
    /// Fill the ledger with this many old terminal jobs and measure the writers' throughput
    /// while they are pruned (instead of the three write measurements)
    #[arg(long, value_name = "N")]
    pub prune_rows: Option<u64>,
    /// Seconds of each throughput measurement around pruning (alone, then alone again)
    #[arg(long, default_value_t = 10)]
    pub measure_s: u64,
    /// After filling the SQLite ledger (--prune-rows N), copy it to this PostgreSQL
    /// database with `lastcall ledger copy` (killed once, then resumed) instead of pruning;
    /// use an empty database
    #[arg(long, value_name = "STORE_URL", requires = "prune_rows")]
    pub copy_to: Option<String>,
    /// When to SIGKILL the first `ledger copy` (0: never)
    #[arg(long, default_value_t = 5)]
    pub copy_kill_after_s: u64,
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
    if let Some(n) = a.prune_rows {
        return prune_or_copy(env, &a, n, targets).await;
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
        render(
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

/// The background pruner's defaults (`[ledger] batch_rows`, `batch_pause_ms`).
const PRUNE_BATCH_ROWS: u32 = 1_000;
const PRUNE_PAUSE: std::time::Duration = std::time::Duration::from_millis(50);
/// The length of each pruning and each non-pruning period of the paired measurement.
const PAIR_PERIOD: Duration = Duration::from_secs(4);

/// One throughput measurement of `--prune-rows`.
#[derive(Debug, Clone, Serialize)]
struct PhaseRow {
    backend: &'static str,
    phase: &'static str,
    secs: f64,
    /// Outcomes the writers recorded (grouped, `--batch` per transaction).
    writes: u64,
    per_s: f64,
    latency: Percentiles,
    /// Jobs the pruner deleted in this phase (with their attempt rows).
    pruned: u64,
}

/// Fill each target with `n` old terminal jobs (one attempt row each, a 200-byte result),
/// `batch` writes per transaction. Their `recorded_at_ms` lies 40 days back.
async fn fill(ledger: &Ledger, n: u64, json: bool, clock: &dyn Clock) -> Result<i64> {
    let old = clock.now_ms() - 40 * 86_400_000;
    let bar = crate::bar(n, &format!("{} filling", ledger.backend_name()));
    if json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let text = "x".repeat(200);
    let mut i = 0;
    while i < n {
        let writes: Vec<LedgerWrite> = (i..(i + 1_000).min(n))
            .map(|j| {
                let mut o = outcome(&format!("old-{j:08}"), true, old + (j / 1_000) as i64);
                o.result = Some(text.clone());
                LedgerWrite::outcome(o)
            })
            .collect();
        ledger.write_batch(&writes).await?;
        i += writes.len() as u64;
        bar.set_position(i);
    }
    bar.finish_and_clear();
    Ok(old + (n / 1_000) as i64 + 1)
}

/// Grouped writers for `secs`, or until `until` is cancelled when it is given.
async fn write_for(
    ledger: &Arc<Ledger>,
    a: &LedgerArgs,
    clock: &Arc<dyn Clock>,
    tag: &str,
    stop: tokio_util::sync::CancellationToken,
    done: Arc<std::sync::atomic::AtomicU64>,
) -> Result<(u64, Vec<u64>, f64)> {
    let nonce = format!("{:x}-{tag}", clock.now_ms());
    let next = Arc::new(std::sync::atomic::AtomicU64::new(0));
    let t0 = Instant::now();
    let mut set = JoinSet::new();
    for _ in 0..a.writers {
        let (ledger, next, nonce, clock, stop, done) = (
            ledger.clone(),
            next.clone(),
            nonce.clone(),
            clock.clone(),
            stop.clone(),
            done.clone(),
        );
        let step = a.batch;
        set.spawn(async move {
            let (mut ok, mut lat) = (0u64, Vec::new());
            while !stop.is_cancelled() {
                let i = next.fetch_add(step, std::sync::atomic::Ordering::Relaxed);
                let writes: Vec<LedgerWrite> = (i..i + step)
                    .map(|j| {
                        LedgerWrite::outcome(outcome(
                            &format!("lp-{nonce}-{j}"),
                            false,
                            clock.now_ms(),
                        ))
                    })
                    .collect();
                let t = Instant::now();
                if ledger.write_batch(&writes).await.is_ok() {
                    ok += step;
                    done.fetch_add(step, std::sync::atomic::Ordering::Relaxed);
                }
                lat.push(t.elapsed().as_micros() as u64);
            }
            (ok, lat)
        });
    }
    let (mut ok, mut lat) = (0, Vec::new());
    while let Some(r) = set.join_next().await {
        let (o, l) = r?;
        ok += o;
        lat.extend(l);
    }
    Ok((ok, lat, t0.elapsed().as_secs_f64()))
}

/// [`write_for`] for `measure`, with nothing else running.
async fn write_alone(
    ledger: &Arc<Ledger>,
    a: &LedgerArgs,
    clock: &Arc<dyn Clock>,
    tag: &str,
    measure: Duration,
) -> Result<(u64, Vec<u64>, f64)> {
    let stop = tokio_util::sync::CancellationToken::new();
    let timer = {
        let stop = stop.clone();
        tokio::spawn(async move {
            tokio::time::sleep(measure).await;
            stop.cancel();
        })
    };
    let got = write_for(ledger, a, clock, tag, stop, Default::default()).await?;
    timer.await?;
    Ok(got)
}

async fn prune_or_copy(
    env: &Env,
    a: &LedgerArgs,
    n: u64,
    targets: Vec<(String, Option<std::path::PathBuf>)>,
) -> Result<ExitCode> {
    use tokio_util::sync::CancellationToken;
    let n = if a.smoke { n.min(2_000) } else { n };
    let measure = Duration::from_secs(if a.smoke { 1 } else { a.measure_s.max(1) });
    let mut rows: Vec<PhaseRow> = Vec::new();
    let mut copies: Vec<serde_json::Value> = Vec::new();
    let mut pairs: Vec<serde_json::Value> = Vec::new();
    for (url, dir) in targets {
        let ledger = crate::open_ledger(&url).await?;
        let t = Instant::now();
        let cut = fill(&ledger, n, a.json, &*env.clock).await?;
        let fill_s = t.elapsed().as_secs_f64();
        if !a.json {
            println!(
                "{}: {n} old jobs written in {fill_s:.1} s",
                ledger.backend_name()
            );
        }
        if let Some(to) = &a.copy_to {
            if dir.is_none() {
                ledger.close().await;
                continue;
            }
            ledger.close().await;
            copies.push(copy_killed_then_resumed(&url, to, a.copy_kill_after_s, n).await?);
            if let Some(d) = dir {
                let _ = std::fs::remove_dir_all(d);
            }
            continue;
        }
        let backend = ledger.backend_name();
        let phase = |phase, (writes, lat, secs): (u64, Vec<u64>, f64), pruned| PhaseRow {
            backend,
            phase,
            secs,
            writes,
            per_s: writes as f64 / secs.max(1e-9),
            latency: Percentiles::from_us(lat),
            pruned,
        };
        // Alone.
        let before = write_alone(&ledger, a, &env.clock, "before", measure).await?;
        rows.push(phase("alone, before", before, 0));
        // While the pruner deletes the old jobs, in alternating periods of PAIR_PERIOD:
        // pruning, then not, so that each pruning period is compared with its neighbours
        // (the machine's other load drifts slowly; the pairs cancel it).
        let stop = CancellationToken::new();
        let done = Arc::new(std::sync::atomic::AtomicU64::new(0));
        let pruner = {
            let (ledger, stop, done) = (ledger.clone(), stop.clone(), done.clone());
            tokio::spawn(async move {
                let mut pruned = 0u64;
                // (pruning?, writes, seconds) per period.
                let mut periods: Vec<(bool, u64, f64)> = Vec::new();
                let mut on = false;
                let mut finished = false;
                while !finished {
                    let (t0, w0) = (Instant::now(), done.load(Ordering::Relaxed));
                    let end = t0 + PAIR_PERIOD;
                    if on {
                        while Instant::now() < end {
                            let t = Instant::now();
                            let c = ledger.prune_batch(cut, PRUNE_BATCH_ROWS, None).await?;
                            pruned += c.jobs;
                            if c.jobs < u64::from(PRUNE_BATCH_ROWS) {
                                finished = true;
                                break;
                            }
                            let pause = lastcall_store::prune_pause(PRUNE_PAUSE, t.elapsed());
                            tokio::time::sleep(pause).await;
                        }
                    } else {
                        tokio::time::sleep(PAIR_PERIOD).await;
                    }
                    let secs = t0.elapsed().as_secs_f64();
                    periods.push((on, done.load(Ordering::Relaxed) - w0, secs));
                    on = !on;
                }
                // One more period without pruning, the last pruning one's right neighbour.
                let (t0, w0) = (Instant::now(), done.load(Ordering::Relaxed));
                tokio::time::sleep(PAIR_PERIOD).await;
                periods.push((
                    false,
                    done.load(Ordering::Relaxed) - w0,
                    t0.elapsed().as_secs_f64(),
                ));
                stop.cancel();
                anyhow::Ok((pruned, periods))
            })
        };
        let during = write_for(&ledger, a, &env.clock, "during", stop, done).await?;
        let (pruned, periods) = pruner.await??;
        let rate = |(_, w, s): &(bool, u64, f64)| *w as f64 / s.max(1e-9);
        let mut ratios: Vec<f64> = Vec::new();
        for i in 1..periods.len().saturating_sub(1) {
            if periods[i].0 && !periods[i - 1].0 && !periods[i + 1].0 {
                let off = (rate(&periods[i - 1]) + rate(&periods[i + 1])) / 2.0;
                ratios.push(rate(&periods[i]) / off.max(1e-9));
            }
        }
        ratios.sort_by(f64::total_cmp);
        let sum = |on: bool| {
            periods
                .iter()
                .filter(|p| p.0 == on)
                .fold((0u64, 0f64), |(w, s), p| (w + p.1, s + p.2))
        };
        let ((won, son), (woff, soff)) = (sum(true), sum(false));
        pairs.push(json!({
            "backend": ledger.backend_name(),
            "pairs": ratios.len(),
            "period_s": PAIR_PERIOD.as_secs_f64(),
            "median_ratio": ratios.get(ratios.len() / 2),
            "p10_ratio": ratios.get(ratios.len() / 10),
            "p90_ratio": ratios.get(ratios.len() * 9 / 10),
            "pruning_per_s": won as f64 / son.max(1e-9),
            "not_pruning_per_s": woff as f64 / soff.max(1e-9),
            "pruning_s": son,
        }));
        rows.push(phase("while pruning", during, pruned));
        // Alone again (the ledger is smaller now).
        let after = write_alone(&ledger, a, &env.clock, "after", measure).await?;
        rows.push(phase("alone, after", after, 0));
        ledger.close().await;
        if let Some(d) = dir {
            let _ = std::fs::remove_dir_all(d);
        }
    }
    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "bench": "ledger-prune",
                "smoke": a.smoke,
                "machine": crate::machine(),
                "prune_rows": n,
                "results": rows,
                "paired": pairs,
                "copies": copies,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    if !rows.is_empty() {
        let table: Vec<Vec<String>> = rows
            .iter()
            .map(|r| {
                vec![
                    r.backend.to_owned(),
                    r.phase.to_owned(),
                    format!("{:.1}", r.secs),
                    r.writes.to_string(),
                    format!("{:.0}", r.per_s),
                    f1(r.latency.p50_ms),
                    f1(r.latency.p99_ms),
                    r.pruned.to_string(),
                ]
            })
            .collect();
        print!(
            "{}",
            render(
                &[
                    "backend", "phase", "secs", "writes", "per_s", "p50_ms", "p99_ms", "pruned"
                ],
                &table
            )
        );
        for (w, p) in rows.chunks(3).zip(&pairs) {
            if let [b, d, af] = w {
                println!(
                    "{}: writers over the whole pruning of {n} jobs = {:.2} × alone before, {:.2} × alone after ({} outcomes per transaction, {} writers)",
                    b.backend,
                    d.per_s / b.per_s.max(1e-9),
                    d.per_s / af.per_s.max(1e-9),
                    a.batch,
                    a.writers
                );
                println!(
                    "{}: paired {} s periods, pruning ÷ not pruning (its neighbours): median {:.3}, p10 {:.3}, p90 {:.3} over {} pairs; {:.0} vs {:.0} writes/s",
                    b.backend,
                    p["period_s"],
                    p["median_ratio"].as_f64().unwrap_or(f64::NAN),
                    p["p10_ratio"].as_f64().unwrap_or(f64::NAN),
                    p["p90_ratio"].as_f64().unwrap_or(f64::NAN),
                    p["pairs"],
                    p["pruning_per_s"].as_f64().unwrap_or(0.0),
                    p["not_pruning_per_s"].as_f64().unwrap_or(0.0),
                );
            }
        }
    }
    for c in &copies {
        println!("{}", serde_json::to_string(c)?);
    }
    Ok(ExitCode::SUCCESS)
}

/// `lastcall ledger copy --from FROM --to TO` (the `lastcall` beside this binary), SIGKILLed after `kill_after_s` (if it is
/// still running), then run again to the end. Fails unless the second run succeeds (its
/// own check compares every table's count and checksum).
async fn copy_killed_then_resumed(
    from: &str,
    to: &str,
    kill_after_s: u64,
    n: u64,
) -> Result<serde_json::Value> {
    // `ledger copy` is a `lastcall` command: the `lastcall` built beside this binary.
    let exe = std::env::current_exe()?
        .with_file_name(format!("lastcall{}", std::env::consts::EXE_SUFFIX));
    if !exe.is_file() {
        bail!(
            "--copy-to runs `lastcall ledger copy`, and there is no lastcall next to this \
             lastcall-bench ({}): build it in the same profile, `cargo build -p lastcall`",
            exe.display()
        );
    }
    let cmd = || {
        let mut c = tokio::process::Command::new(&exe);
        c.args([
            "ledger",
            "copy",
            "--no-progress",
            "--from",
            from,
            "--to",
            to,
        ])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .kill_on_drop(true);
        c
    };
    let t0 = Instant::now();
    let mut killed_at = None;
    if kill_after_s > 0 {
        let mut child = cmd().spawn()?;
        tokio::select! {
            r = child.wait() => { r?; }
            _ = tokio::time::sleep(Duration::from_secs(kill_after_s)) => {
                child.start_kill()?;
                child.wait().await?;
                killed_at = Some(t0.elapsed().as_secs_f64());
            }
        }
    }
    let t1 = Instant::now();
    let out = cmd().output().await?;
    let resume_s = t1.elapsed().as_secs_f64();
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        bail!(
            "the resumed `ledger copy` failed ({}): {}{}",
            out.status,
            stdout,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(json!({
        "copy": format!("{} jobs → {}", n, lastcall_broker::redact(to)),
        "killed_after_s": killed_at,
        "resumed_run_s": resume_s,
        "total_s": t0.elapsed().as_secs_f64(),
        "report": stdout,
    }))
}
