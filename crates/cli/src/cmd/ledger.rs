//! `lastcall ledger prune|export|copy`, and the workers' background pruning.
//!
//! Retention is decided here (cutoffs from the clock, batches, pauses, the archive file);
//! the statements and the rule of what is never pruned are the store's
//! (`lastcall_store`, `ledger/retention.rs`). The workers prune in the background
//! ([`spawn_background`]) with the `[ledger]` section's settings ([`retention_settings`]),
//! and export the ledger's size and last prune on their `/metrics` ([`LedgerGauges`]).

use crate::cli::{
    Cli, Command, CopyArgs, ExportArgs, ExportFormat, Keep, LedgerCommand, PruneArgs, RetentionArgs,
};
use crate::config::{Loaded, Settings};
use anyhow::{Context, Result, anyhow, bail};
use clap::FromArgMatches;
use futures_util::TryStreamExt;
use lastcall_clock::Clock;
use lastcall_store::{COPY_TABLES, JobRecord, Ledger, PruneCounts};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Exit status of `ledger prune` when another process holds the prune lock.
const EXIT_BUSY: u8 = 3;

pub async fn run(s: &Settings, c: LedgerCommand, clock: &dyn Clock) -> Result<ExitCode> {
    match c {
        LedgerCommand::Prune(a) => prune(s, a, clock).await,
        LedgerCommand::Export(a) => export(s, a, clock).await,
        LedgerCommand::Copy(a) => copy(s, a).await,
    }
}

/// What retention keeps, checked.
#[derive(Debug, Clone)]
pub struct Policy {
    pub retention_ms: Option<i64>,
    pub text_retention_ms: Option<i64>,
    pub archive_dir: Option<PathBuf>,
    pub batch_rows: u32,
    pub pause: Duration,
}

impl Policy {
    /// A text retention longer than the row retention changes nothing: the rows go first.
    pub fn from_args(a: &RetentionArgs) -> Result<Policy> {
        Ok(Policy {
            retention_ms: a.retention.0,
            text_retention_ms: a.text_retention.0,
            archive_dir: a.archive_dir.clone(),
            batch_rows: a.batch_rows,
            pause: Duration::from_millis(a.batch_pause_ms),
        })
    }

    /// Whether this policy prunes anything.
    pub fn prunes(&self) -> bool {
        self.retention_ms.is_some() || self.text_retention_ms.is_some()
    }

    fn describe(&self) -> String {
        format!(
            "retention {}, text retention {}",
            Keep(self.retention_ms),
            Keep(self.text_retention_ms)
        )
    }
}

/// The retention settings in effect for a process that prunes in the background:
/// `ledger prune`'s flags as the environment and the `[ledger]` section set them.
pub fn retention_settings(loaded: &Loaded) -> Result<Policy> {
    let m = loaded
        .command
        .clone()
        .try_get_matches_from(["lastcall", "ledger", "prune"])
        .map_err(|e| anyhow!("invalid [ledger] retention settings: {}", e.render()))?;
    let cli = Cli::from_arg_matches(&m)?;
    let Command::Ledger(LedgerCommand::Prune(p)) = cli.command else {
        bail!("`ledger prune` did not parse as itself");
    };
    Policy::from_args(&p.retention)
}

/// One prune pass: every batch due now, rows first (with the archive), then texts.
/// `Ok(None)`: another process holds the prune lock (PostgreSQL); nothing was done.
pub async fn prune_pass(
    ledger: &Ledger,
    p: &Policy,
    now_ms: i64,
    stop: &CancellationToken,
) -> Result<Option<PruneCounts>> {
    let Some(lock) = ledger.try_prune_lock().await? else {
        return Ok(None);
    };
    let result = prune_holding_lock(ledger, p, now_ms, stop).await;
    lock.release().await;
    result.map(Some)
}

async fn prune_holding_lock(
    ledger: &Ledger,
    p: &Policy,
    now_ms: i64,
    stop: &CancellationToken,
) -> Result<PruneCounts> {
    let mut total = PruneCounts::default();
    // After each batch: at least `batch_pause_ms`, and long enough that the batches hold
    // the ledger's write lock at most `PRUNE_DUTY` (5%) of the time.
    let pause = |batch: std::time::Duration| async move {
        tokio::select! {
            _ = tokio::time::sleep(lastcall_store::prune_pause(p.pause, batch)) => false,
            _ = stop.cancelled() => true,
        }
    };
    let rows_cut = p.retention_ms.map(|r| now_ms.saturating_sub(r));
    if let Some(cut) = rows_cut {
        let mut archive = p.archive_dir.as_deref().map(|d| Archive::new(d, now_ms));
        loop {
            let t0 = std::time::Instant::now();
            let batch = match archive.as_mut() {
                Some(a) => {
                    let mut f = |jobs: &[JobRecord]| a.append(jobs);
                    ledger.prune_batch(cut, p.batch_rows, Some(&mut f)).await?
                }
                None => ledger.prune_batch(cut, p.batch_rows, None).await?,
            };
            total.add(&batch);
            if batch.jobs < u64::from(p.batch_rows) || pause(t0.elapsed()).await {
                break;
            }
        }
        total.held_by_webhooks = ledger.held_by_webhooks(cut).await?;
        total.workers = ledger.prune_worker_leases(cut).await?;
        loop {
            let t0 = std::time::Instant::now();
            let batch = ledger.prune_batches_and_files(cut, p.batch_rows).await?;
            total.add(&batch);
            if batch.batches + batch.files == 0 || pause(t0.elapsed()).await {
                break;
            }
        }
    }
    if let Some(t) = p.text_retention_ms {
        let cut = now_ms.saturating_sub(t);
        let floor = rows_cut.unwrap_or(i64::MIN).min(cut);
        loop {
            let t0 = std::time::Instant::now();
            let n = ledger.clear_texts_batch(cut, floor, p.batch_rows).await?;
            total.texts += n;
            if n < u64::from(p.batch_rows) || pause(t0.elapsed()).await {
                break;
            }
        }
        if rows_cut.is_none() {
            total.held_by_webhooks = ledger.held_by_webhooks(cut).await?;
        }
    }
    Ok(total)
}

/// `options` creating a file readable and writable by its owner only (0600): exports
/// and archives hold job payloads and results.
fn private_file(options: &mut std::fs::OpenOptions) -> &mut std::fs::OpenOptions {
    #[cfg(unix)]
    std::os::unix::fs::OpenOptionsExt::mode(options, 0o600);
    options
}

/// Create (or truncate) `path` for an export, owner-only (0600); an existing regular file
/// is made owner-only too before anything is written to it (a device or pipe, such as
/// `/dev/stdout`, is left as it is).
fn create_private(path: &Path) -> std::io::Result<std::fs::File> {
    let file = private_file(
        std::fs::OpenOptions::new()
            .write(true)
            .create(true)
            .truncate(true),
    )
    .open(path)?;
    make_private(&file)?;
    Ok(file)
}

/// An existing regular file made owner-only (one an earlier version created
/// world-readable); a device or pipe is left as it is.
fn make_private(file: &std::fs::File) -> std::io::Result<()> {
    #[cfg(unix)]
    if file.metadata()?.is_file() {
        use std::os::unix::fs::PermissionsExt;
        file.set_permissions(std::fs::Permissions::from_mode(0o600))?;
    }
    Ok(())
}

/// The archive of one prune pass: `DIR/ledger-YYYY-MM-DD.jsonl` (the UTC day of the
/// pass), appended and synced before each batch's deletion commits.
struct Archive {
    path: PathBuf,
    dir: PathBuf,
}

impl Archive {
    fn new(dir: &Path, now_ms: i64) -> Archive {
        let day = &super::jobs::utc(now_ms)[..10];
        Archive {
            path: dir.join(format!("ledger-{day}.jsonl")),
            dir: dir.to_owned(),
        }
    }

    fn append(&mut self, jobs: &[JobRecord]) -> std::io::Result<()> {
        // Blocking file IO on a runtime thread: let the runtime move its other tasks away.
        tokio::task::block_in_place(|| {
            std::fs::create_dir_all(&self.dir)?;
            let new = !self.path.exists();
            // Job payloads and results: readable by the owner only.
            let mut file = private_file(std::fs::OpenOptions::new().create(true).append(true))
                .open(&self.path)?;
            make_private(&file)?;
            let mut buf = Vec::with_capacity(jobs.len() * 512);
            for j in jobs {
                serde_json::to_writer(&mut buf, j)?;
                buf.push(b'\n');
            }
            file.write_all(&buf)?;
            file.sync_data()?;
            if new {
                // The new file's directory entry must be durable too.
                std::fs::File::open(&self.dir)?.sync_all()?;
            }
            Ok(())
        })
    }
}

async fn prune(s: &Settings, a: PruneArgs, clock: &dyn Clock) -> Result<ExitCode> {
    let p = Policy::from_args(&a.retention)?;
    let ledger = super::open_ledger_to_read(&s.store_url).await?;
    let now = clock.now_ms();
    let counts = if a.dry_run {
        let rows_cut = p.retention_ms.map(|r| now.saturating_sub(r));
        let text_cut = p.text_retention_ms.map(|t| now.saturating_sub(t));
        Some(ledger.prune_preview(rows_cut, text_cut).await?)
    } else {
        prune_pass(&ledger, &p, now, &CancellationToken::new()).await?
    };
    ledger.close().await;
    let Some(c) = counts else {
        eprintln!(
            "another process is pruning this ledger now (it holds the prune lock); nothing done"
        );
        return Ok(ExitCode::from(EXIT_BUSY));
    };
    if a.json {
        println!(
            "{}",
            serde_json::json!({
                "dry_run": a.dry_run,
                "retention": Keep(p.retention_ms).to_string(),
                "text_retention": Keep(p.text_retention_ms).to_string(),
                "jobs": c.jobs,
                "attempts": c.attempts,
                "webhooks": c.webhooks,
                "webhook_attempts": c.webhook_attempts,
                "texts": c.texts,
                "held_by_webhooks": c.held_by_webhooks,
                "worker_leases": c.workers,
                "batches": c.batches,
                "files": c.files,
            })
        );
    } else {
        let (verb, cleared) = if a.dry_run {
            ("would delete", "would clear")
        } else {
            ("deleted", "cleared")
        };
        println!(
            "{}{}: {verb} {} jobs ({} attempt rows, {} webhooks, {} webhook attempts); \
             {cleared} {} result texts; {} old jobs held by undelivered webhooks; \
             {verb} {} stale worker leases, {} batches past their window and {} unused files",
            if a.dry_run { "dry run, " } else { "" },
            p.describe(),
            c.jobs,
            c.attempts,
            c.webhooks,
            c.webhook_attempts,
            c.texts,
            c.held_by_webhooks,
            c.workers,
            c.batches,
            c.files
        );
        if let (Some(dir), false) = (&p.archive_dir, a.dry_run) {
            println!("archive: {}", dir.display());
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The workers' gauges of the ledger: its size (read every minute) and the last prune
/// this process ran.
#[derive(Debug, Default)]
pub struct LedgerGauges {
    /// Whether this process prunes (a worker); `serve` shows only the size.
    size_only: bool,
    job_rows: AtomicI64,
    bytes: AtomicI64,
    /// Epoch ms of the last prune pass this process ran; 0 before the first.
    last_prune_ms: AtomicI64,
    last_prune_jobs: AtomicU64,
    last_prune_texts: AtomicU64,
    pruned_jobs: AtomicU64,
    cleared_texts: AtomicU64,
}

impl LedgerGauges {
    /// The gauges of a process that does not prune (`serve`): rows and bytes only.
    pub fn size_only() -> LedgerGauges {
        LedgerGauges {
            size_only: true,
            ..LedgerGauges::default()
        }
    }

    fn record(&self, now_ms: i64, c: &PruneCounts) {
        self.last_prune_ms.store(now_ms, Ordering::Relaxed);
        self.last_prune_jobs.store(c.jobs, Ordering::Relaxed);
        self.last_prune_texts.store(c.texts, Ordering::Relaxed);
        self.pruned_jobs.fetch_add(c.jobs, Ordering::Relaxed);
        self.cleared_texts.fetch_add(c.texts, Ordering::Relaxed);
    }

    async fn refresh_size(&self, ledger: &Ledger) {
        match ledger.size().await {
            Ok(size) => {
                self.job_rows.store(size.job_rows, Ordering::Relaxed);
                self.bytes.store(size.bytes, Ordering::Relaxed);
            }
            Err(e) => tracing::warn!(error = %e, "cannot read the ledger's size"),
        }
    }
}

/// [`LedgerGauges`] on `/metrics`.
#[derive(Debug)]
pub struct LedgerCollector(pub Arc<LedgerGauges>);

impl Collector for LedgerCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> std::fmt::Result {
        let g = &self.0;
        let load = |a: &AtomicI64| a.load(Ordering::Relaxed);
        let gauges: [(&str, &str, i64); 5] = [
            (
                "lastcall_ledger_job_rows",
                "Job rows in the ledger (exact on SQLite, PostgreSQL's estimate), read every minute",
                load(&g.job_rows),
            ),
            (
                "lastcall_ledger_bytes",
                "Approximate bytes of the ledger's data (SQLite pages in use; PostgreSQL tables with indexes), read every minute",
                load(&g.bytes),
            ),
            (
                "lastcall_ledger_last_prune_timestamp_seconds",
                "When this process last ran a prune pass (0: never)",
                load(&g.last_prune_ms) / 1_000,
            ),
            (
                "lastcall_ledger_last_prune_jobs",
                "Jobs the last prune pass of this process deleted",
                g.last_prune_jobs.load(Ordering::Relaxed) as i64,
            ),
            (
                "lastcall_ledger_last_prune_texts",
                "Result texts the last prune pass of this process cleared",
                g.last_prune_texts.load(Ordering::Relaxed) as i64,
            ),
        ];
        let shown = if g.size_only { 2 } else { gauges.len() };
        for (name, help, v) in gauges.into_iter().take(shown) {
            let m = ConstGauge::new(v);
            m.encode(enc.encode_descriptor(name, help, None, m.metric_type())?)?;
        }
        if g.size_only {
            return Ok(());
        }
        for (name, help, v) in [
            (
                "lastcall_ledger_pruned_jobs",
                "Jobs this process's pruning deleted",
                &g.pruned_jobs,
            ),
            (
                "lastcall_ledger_cleared_texts",
                "Result texts this process's pruning cleared",
                &g.cleared_texts,
            ),
        ] {
            let m = ConstCounter::new(v.load(Ordering::Relaxed));
            m.encode(enc.encode_descriptor(name, help, None, m.metric_type())?)?;
        }
        Ok(())
    }
}

/// How often the gauges read the ledger's size.
const SIZE_EVERY: Duration = Duration::from_secs(60);

/// The background pruner of a worker: a pass at once, then every `every`, until `stop`;
/// the ledger's size every minute. On PostgreSQL a pass whose turn another process holds
/// is skipped.
pub fn spawn_background(
    ledger: Arc<Ledger>,
    p: Policy,
    every: Option<Duration>,
    clock: Arc<dyn Clock>,
    gauges: Arc<LedgerGauges>,
    stop: CancellationToken,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut next_prune = tokio::time::Instant::now();
        loop {
            if let Some(every) = every.filter(|_| p.prunes())
                && tokio::time::Instant::now() >= next_prune
            {
                let now = clock.now_ms();
                match prune_pass(&ledger, &p, now, &stop).await {
                    Ok(Some(c)) => {
                        gauges.record(now, &c);
                        if c.jobs > 0 || c.texts > 0 {
                            tracing::info!(
                                jobs = c.jobs,
                                attempts = c.attempts,
                                texts = c.texts,
                                held_by_webhooks = c.held_by_webhooks,
                                "ledger pruned"
                            );
                        }
                    }
                    Ok(None) => tracing::debug!("another process is pruning the ledger"),
                    Err(e) => tracing::warn!(error = %e, "ledger pruning failed; next pass later"),
                }
                next_prune = tokio::time::Instant::now() + every;
            }
            gauges.refresh_size(&ledger).await;
            let wait = match every.filter(|_| p.prunes()) {
                Some(_) => next_prune
                    .saturating_duration_since(tokio::time::Instant::now())
                    .min(SIZE_EVERY),
                None => SIZE_EVERY,
            };
            tokio::select! {
                _ = tokio::time::sleep(wait) => {}
                _ = stop.cancelled() => return,
            }
        }
    })
}

/// The size gauges of a process that does not prune (`serve`): the ledger's size every
/// minute until `stop`.
pub fn spawn_size_gauges(ledger: Arc<Ledger>, gauges: Arc<LedgerGauges>, stop: CancellationToken) {
    tokio::spawn(async move {
        loop {
            gauges.refresh_size(&ledger).await;
            tokio::select! {
                _ = tokio::time::sleep(SIZE_EVERY) => {}
                _ = stop.cancelled() => return,
            }
        }
    });
}

/// A point in time of `--since`/`--until`: a duration before `now_ms` (`7d`), a date
/// (`2026-12-01`, midnight UTC), or epoch milliseconds.
fn when(s: &str, now_ms: i64, flag: &str) -> Result<i64> {
    let t = s.trim();
    if !t.is_empty() && t.bytes().all(|b| b.is_ascii_digit()) {
        return t
            .parse()
            .map_err(|_| anyhow!("{flag} `{t}` is too large for epoch milliseconds"));
    }
    if let Some(ms) = date_ms(t) {
        return Ok(ms);
    }
    match crate::cli::duration_ms(t) {
        Ok(d) => Ok(now_ms.saturating_sub(d)),
        Err(e) => bail!(
            "{flag} {e}; accepted: a duration before now (e.g. 7d, 24h), a date \
             (2026-12-01, UTC) or epoch milliseconds"
        ),
    }
}

/// `YYYY-MM-DD` as epoch ms at midnight UTC.
fn date_ms(s: &str) -> Option<i64> {
    let mut parts = s.splitn(3, '-');
    let (y, m, d) = (parts.next()?, parts.next()?, parts.next()?);
    if y.len() != 4 || m.len() != 2 || d.len() != 2 {
        return None;
    }
    let (y, m, d): (i64, i64, i64) = (y.parse().ok()?, m.parse().ok()?, d.parse().ok()?);
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) {
        return None;
    }
    // Days since 1970-01-01 from a civil date (Howard Hinnant's algorithm).
    let y = if m <= 2 { y - 1 } else { y };
    let era = y.div_euclid(400);
    let yoe = y - era * 400;
    let mp = (m + 9) % 12;
    let doy = (153 * mp + 2) / 5 + d - 1;
    let doe = yoe * 365 + yoe / 4 - yoe / 100 + doy;
    Some((era * 146_097 + doe - 719_468) * 86_400_000)
}

async fn export(s: &Settings, a: ExportArgs, clock: &dyn Clock) -> Result<ExitCode> {
    let ExportFormat::Jsonl = a.format;
    let now = clock.now_ms();
    let since = match &a.since {
        Some(w) => when(w, now, "--since")?,
        None => i64::MIN,
    };
    let until = match &a.until {
        Some(w) => when(w, now, "--until")?,
        None => now,
    };
    if since >= until {
        bail!("--since must be before --until: the window [since, until) is empty");
    }
    let ledger = super::open_ledger_to_read(&s.store_url).await?;
    let mut out: Box<dyn Write> = match &a.out {
        Some(path) => Box::new(std::io::BufWriter::new(
            create_private(path)
                .with_context(|| format!("cannot create --out {}", path.display()))?,
        )),
        None => Box::new(std::io::BufWriter::new(std::io::stdout())),
    };
    let mut n = 0u64;
    let mut jobs = ledger.export(since, until);
    while let Some(job) = jobs.try_next().await? {
        serde_json::to_writer(&mut out, &job)?;
        out.write_all(b"\n")?;
        n += 1;
    }
    drop(jobs);
    out.flush()?;
    drop(out);
    ledger.close().await;
    eprintln!(
        "exported {n} jobs recorded from {} to {}",
        if since == i64::MIN {
            "the beginning".to_owned()
        } else {
            super::jobs::utc(since)
        },
        super::jobs::utc(until)
    );
    Ok(ExitCode::SUCCESS)
}

async fn copy(s: &Settings, a: CopyArgs) -> Result<ExitCode> {
    let from = a.from.clone().unwrap_or_else(|| s.store_url.clone());
    if from == a.to {
        bail!(
            "--from and --to are the same ledger ({})",
            lastcall_broker::redact(&from)
        );
    }
    if let Some(path) = super::jobs::sqlite_path(&from)
        && !path.exists()
    {
        bail!(
            "there is no ledger at {} to copy (--from, else --store-url)",
            lastcall_broker::redact(&from)
        );
    }
    let src = super::open_ledger(&from).await?;
    let dst = super::open_ledger(&a.to)
        .await
        .context("cannot open the destination (--to)")?;
    let (sv, dv) = (src.schema_versions().await?, dst.schema_versions().await?);
    if sv != dv {
        bail!("schema versions differ: source {sv:?}, destination {dv:?}");
    }
    eprintln!(
        "copying {} → {}",
        lastcall_broker::redact(&from),
        lastcall_broker::redact(&a.to)
    );
    let mut rows = Vec::new();
    for table in COPY_TABLES {
        let total = src.table_rows(table).await?;
        let bar = if a.no_progress {
            indicatif::ProgressBar::hidden()
        } else {
            indicatif::ProgressBar::new(total)
        };
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "{prefix:>16} [{bar:40}] {pos}/{len} rows ({per_sec}, {eta} left)",
            )
            .expect("a valid template")
            .progress_chars("=> "),
        );
        bar.set_prefix(table);
        let mut progress = |n: u64| bar.set_position(n);
        let c = src
            .copy_table_to(&dst, table, a.batch_rows, &mut progress)
            .await
            .with_context(|| format!("copying table {table}"))?;
        bar.finish_and_clear();
        eprintln!(
            "{table}: {} rows read, {} copied, {} already there",
            c.read,
            c.inserted,
            c.read - c.inserted
        );
        rows.push(table);
    }
    // Check: per-table counts and checksums, computed the same way on both sides.
    let mut table_rows = Vec::new();
    let mut differ = Vec::new();
    for table in rows {
        let (s_d, d_d) = (
            src.table_digest(table).await?,
            dst.table_digest(table).await?,
        );
        let same = s_d == d_d;
        if !same {
            differ.push(table);
        }
        table_rows.push(vec![
            table.to_owned(),
            s_d.rows.to_string(),
            d_d.rows.to_string(),
            s_d.checksum.clone(),
            if same { "ok" } else { "DIFFERENT" }.to_owned(),
        ]);
    }
    src.close().await;
    dst.close().await;
    print!(
        "{}",
        crate::table::render(
            &[
                "table",
                "source rows",
                "destination rows",
                "checksum",
                "check"
            ],
            &table_rows
        )
    );
    if !differ.is_empty() {
        bail!(
            "the copy differs from the source in {}: did a process write to either ledger \
             during the copy, or does the destination hold other rows? Stop every writer and \
             run the copy again (into an empty database if the destination had rows of its own)",
            differ.join(", ")
        );
    }
    println!(
        "copy complete and checked; point store_url (--store-url, LASTCALL_STORE_URL or \
         lastcall.toml) at the destination"
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::show_duration;

    #[test]
    fn when_takes_durations_dates_and_epoch_ms() {
        let now = 1_786_000_000_000;
        assert_eq!(when("7d", now, "--since").unwrap(), now - 7 * 86_400_000);
        assert_eq!(
            when("1786000000123", now, "--since").unwrap(),
            1_786_000_000_123
        );
        assert_eq!(when("1970-01-01", now, "--since").unwrap(), 0);
        assert_eq!(when("2000-02-29", now, "--since").unwrap(), 951_782_400_000);
        assert_eq!(
            super::super::jobs::utc(date_ms("2026-12-04").unwrap()),
            "2026-12-04 00:00:00.000 UTC"
        );
        let e = when("7x", now, "--until").unwrap_err().to_string();
        assert!(e.contains("--until") && e.contains("a date"), "{e}");
    }

    #[test]
    fn a_text_retention_longer_than_the_rows_is_harmless() {
        let a = RetentionArgs {
            retention: Keep(Some(86_400_000)),
            text_retention: Keep(Some(2 * 86_400_000)),
            archive_dir: None,
            batch_rows: 10,
            batch_pause_ms: 0,
        };
        let p = Policy::from_args(&a).unwrap();
        assert_eq!(p.describe(), "retention 1d, text retention 2d");
        let off = RetentionArgs {
            retention: Keep(None),
            text_retention: Keep(None),
            ..a
        };
        assert!(!Policy::from_args(&off).unwrap().prunes());
        assert_eq!(show_duration(30 * 86_400_000), "30d");
        assert_eq!(show_duration(90_000), "90s");
    }
}
