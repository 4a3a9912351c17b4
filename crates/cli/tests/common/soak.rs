//! The soak under faults (#35, `tests/chaos.rs`'s `soak_under_faults`, driven by
//! `scripts/soak.sh`): the fault suite's harness ([`Run`]) for minutes instead of seconds.
//!
//! - **Services**: a private RabbitMQ node and a private PostgreSQL cluster, as every chaos
//!   scenario has.
//! - **Load**, about 1.5× what the workers can do: the harness's POSTs to `lastcall serve`
//!   and a pika producer (`soak_producer.py`, the Python example's own publish code) on one
//!   connection; three `lastcall worker --backend sim` (2 slots, 400 ms calls: 15 jobs/s
//!   in all) on the one PostgreSQL ledger, pruning every 30 s with a 2 min retention of
//!   rows and 1 min of result texts (below the product's floors of 1d and 1h, through the
//!   workers' test-only `--test-retention` flags).
//! - **Faults**, on a schedule scaled with the length ([`Plan`]): a clean broker restart
//!   every 10 min, a worker SIGKILLed (and started again) every 7 min — workers 1 and 2 by
//!   turns, so that worker 0 lives through the whole run as the memory witness — and one
//!   PostgreSQL stop (`-m immediate`) and start.
//! - **Samples** every 30 s: every process's resident memory (`VmRSS`) and open file
//!   descriptors, the broker's AMQP connections and channels (`rabbitmqctl list_channels`),
//!   the ledger's rows and bytes, the dispatch p99 (publish → model call start, exact,
//!   from the ledger's rows of the jobs started since the previous sample) and the
//!   workers' queue-dwell and consumer-dwell histograms, the outcome events, and late
//!   starts in the attempt rows (before retention prunes them).
//! - **Accounting**: the fault suite's row (lost, duplicate outcomes, late starts,
//!   duplicate model calls), memory growth from the baseline sample (minute 10, or a third
//!   of a shorter run) to the last, p99 growth, the ledger's size against its bound.
//!
//! The output directory (`LASTCALL_SOAK_OUT`) gets `samples.csv`, `summary.md` (a table of
//! samples, the accounting, memory and p99) and `rss.svg` (resident memory over time).

use super::chaos::{Row, Run, Spec};
use super::private_pg::PrivatePg;
use super::private_rabbit::PrivateRabbit;
use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Every worker's slots and simulated call time: 3 × 2 slots / 0.4 s = 15 jobs/s.
const WORKERS: usize = 3;
const SLOTS: usize = 2;
const SIM_LATENCY_MS: u64 = 400;
/// The offered load: 12.5 jobs/s of POSTs and 10 jobs/s from pika, 1.5× the capacity.
const POST_INTERVAL_MS: u64 = 80;
const PIKA_RATE: f64 = 10.0;
const BUDGET_MS: u64 = 8_000;
/// Retention for the soak: rows 2 min, result texts 1 min, a prune pass every 30 s.
const RETENTION_S: u64 = 120;
const TEXT_RETENTION_S: u64 = 60;
const PRUNE_EVERY_S: u64 = 30;

/// One fault of the schedule.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Fault {
    BrokerRestart,
    KillWorker(usize),
    PostgresRestart,
}

impl Fault {
    fn label(self) -> String {
        match self {
            Fault::BrokerRestart => "broker restart".into(),
            Fault::KillWorker(i) => format!("SIGKILL worker {i}"),
            Fault::PostgresRestart => "postgres restart".into(),
        }
    }
}

/// The run's length, its fault schedule and its memory rule.
#[derive(Debug, Clone)]
pub struct Plan {
    pub minutes: f64,
    pub sample_every: Duration,
    pub faults: Vec<(Duration, Fault)>,
    /// The sample memory growth and p99 growth are measured from.
    pub baseline_at: Duration,
    /// The largest resident-memory growth allowed from the baseline to the last sample.
    pub memory_limit: f64,
    pub out: PathBuf,
}

impl Plan {
    /// `LASTCALL_SOAK_MINUTES` (default 5), `LASTCALL_SOAK_OUT` (default a new directory
    /// under the target's test scratch directory).
    pub fn from_env() -> Plan {
        let minutes = match std::env::var("LASTCALL_SOAK_MINUTES") {
            Ok(m) => m
                .parse::<f64>()
                .ok()
                .filter(|m| *m >= 3.0)
                .unwrap_or_else(|| {
                    panic!("LASTCALL_SOAK_MINUTES={m}: give a number of minutes, at least 3")
                }),
            Err(_) => 5.0,
        };
        let out = std::env::var_os("LASTCALL_SOAK_OUT")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                Path::new(env!("CARGO_TARGET_TMPDIR"))
                    .join(format!("soak-{}", lastcall_worker::clock::now_ms() / 1000))
            });
        Plan::new(minutes, out)
    }

    /// The schedule of an `minutes`-long run. The 60-minute run has a broker restart every
    /// 10 min, a worker kill every 7 min (20 s later in each period) and the PostgreSQL
    /// restart at 27 min; shorter runs scale the intervals by minutes/60, but restart the
    /// broker at most every 1.5 min and kill a worker at most every minute (a 5-minute run:
    /// broker at 1:30 and 3:00, kills at 1:20, 2:20, 3:20, 4:20, PostgreSQL at 2:15). No
    /// fault in the last tenth of the run: the accounting starts from a quiet system.
    pub fn new(minutes: f64, out: PathBuf) -> Plan {
        let run_s = minutes * 60.0;
        let quiet_from = run_s * 0.9;
        let broker_every = (run_s / 6.0).clamp(90.0, 600.0);
        let kill_every = (run_s * 7.0 / 60.0).clamp(60.0, 420.0);
        let mut faults = Vec::new();
        let mut t = broker_every;
        while t < quiet_from {
            faults.push((t, Fault::BrokerRestart));
            t += broker_every;
        }
        let mut t = kill_every + 20.0;
        let mut k = 0;
        while t < quiet_from {
            faults.push((t, Fault::KillWorker(1 + k % 2)));
            k += 1;
            t += kill_every;
        }
        faults.push((run_s * 0.45, Fault::PostgresRestart));
        faults.sort_by(|a, b| a.0.total_cmp(&b.0));
        Plan {
            minutes,
            sample_every: Duration::from_secs(30),
            faults: faults
                .into_iter()
                .map(|(t, f)| (Duration::from_secs_f64(t), f))
                .collect(),
            baseline_at: Duration::from_secs_f64((run_s / 3.0).min(600.0)),
            // The target (+10% of minute 10) for runs of 30 minutes or more; a shorter run
            // measures from a third of its length, still inside the processes' warm-up
            // (allocator arenas, connection pools, the learned-call windows filling): +20%.
            memory_limit: if minutes >= 30.0 { 0.10 } else { 0.20 },
            out,
        }
    }

    fn duration(&self) -> Duration {
        Duration::from_secs_f64(self.minutes * 60.0)
    }
}

/// One process's resident memory (kB) and open descriptors at a sample, with its pid
/// (a restarted process has a new one).
#[derive(Debug, Clone, Copy)]
struct ProcSample {
    pid: u32,
    rss_kb: u64,
    fds: u64,
}

#[derive(Debug, Clone, Default)]
struct Sample {
    t: Duration,
    procs: BTreeMap<String, ProcSample>,
    amqp_connections: Option<usize>,
    amqp_channels: Option<usize>,
    ledger_rows: Option<i64>,
    ledger_bytes: Option<i64>,
    /// Per worker: the cumulative queue-dwell and consumer-dwell buckets (`le` in s, count).
    dwell: Vec<Option<(Buckets, Buckets)>>,
    /// Publish → model call start (ms) of every job whose call started since the previous
    /// sample, from the ledger (`started_at_ms − created_at_ms`): the exact dispatch delay.
    starts: Vec<i64>,
    events: Vec<String>,
}

type Buckets = Vec<(f64, f64)>;

/// The pika producer, stopped (SIGTERM) by [`stop`](PikaProducer::stop) or on drop.
struct PikaProducer {
    child: Child,
    out: PathBuf,
}

impl PikaProducer {
    fn start(amqp: &str, prefix: &str, out: &Path) -> Self {
        let python = super::example_python("pika");
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/common/soak_producer.py");
        let child = Command::new(python)
            .arg(script)
            .args(["--amqp-url", amqp, "--prefix", prefix])
            .args(["--rate", &PIKA_RATE.to_string()])
            .args(["--budget-ms", &BUDGET_MS.to_string()])
            .args(["--id-prefix", "soak-pika"])
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(out).unwrap())
            .stderr(std::fs::File::create(out.with_extension("err")).unwrap())
            .spawn()
            .expect("start the pika producer");
        Self {
            child,
            out: out.to_owned(),
        }
    }

    /// SIGTERM, wait for it to exit (30 s at most), and read what it published:
    /// (attempted, confirmed ids).
    async fn stop(&mut self) -> (usize, Vec<String>) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let until = Instant::now() + Duration::from_secs(30);
        while self.child.try_wait().unwrap().is_none() {
            assert!(
                Instant::now() < until,
                "the pika producer did not exit within 30 s of SIGTERM"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let text = std::fs::read_to_string(&self.out).unwrap();
        let mut attempted = 0;
        let mut confirmed = Vec::new();
        for l in text.lines() {
            let mut f = l.split(' ');
            match (f.next(), f.next()) {
                (Some("confirmed"), Some(id)) => {
                    attempted += 1;
                    confirmed.push(id.to_owned());
                }
                (Some("failed"), Some(_)) => attempted += 1,
                _ => {}
            }
        }
        assert!(
            !confirmed.is_empty(),
            "the pika producer had no job confirmed: {}\n{}",
            self.out.display(),
            std::fs::read_to_string(self.out.with_extension("err")).unwrap_or_default()
        );
        (attempted, confirmed)
    }
}

impl Drop for PikaProducer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `VmRSS` (kB) and the number of open descriptors of `pid`, if it runs.
fn proc_stats(pid: u32) -> Option<(u64, u64)> {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let rss = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))?
        .split_whitespace()
        .next()?
        .parse()
        .ok()?;
    let fds = std::fs::read_dir(format!("/proc/{pid}/fd")).ok()?.count() as u64;
    Some((rss, fds))
}

/// The pids whose parent is `ppid` (PostgreSQL's backends and helpers).
fn children_of(ppid: u32) -> Vec<u32> {
    let Ok(dir) = std::fs::read_dir("/proc") else {
        return Vec::new();
    };
    dir.filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read_to_string(format!("/proc/{pid}/stat"))
                .ok()
                // pid (comm) state ppid …: the comm may hold spaces, so from its ')'.
                .and_then(|s| {
                    s.rsplit_once(')')?
                        .1
                        .split_whitespace()
                        .nth(1)?
                        .parse::<u32>()
                        .ok()
                })
                == Some(ppid)
        })
        .collect()
}

/// Cumulative buckets of histogram `name` in a Prometheus text exposition.
fn buckets(text: &str, name: &str) -> Buckets {
    let prefix = format!("{name}_bucket{{le=\"");
    text.lines()
        .filter_map(|l| {
            let rest = l.strip_prefix(&prefix)?;
            let (le, rest) = rest.split_once("\"}")?;
            let le = if le == "+Inf" {
                f64::INFINITY
            } else {
                le.parse().ok()?
            };
            Some((le, rest.trim().parse().ok()?))
        })
        .collect()
}

/// The increase of cumulative buckets from `before` to `after` (a restarted process starts
/// from zero: then `after` itself).
fn increase(before: Option<&Buckets>, after: &Buckets) -> Buckets {
    match before {
        Some(b)
            if b.len() == after.len()
                && b.iter()
                    .zip(after)
                    .all(|((lb, cb), (la, ca))| lb == la && ca >= cb) =>
        {
            after
                .iter()
                .zip(b)
                .map(|((le, ca), (_, cb))| (*le, ca - cb))
                .collect()
        }
        _ => after.clone(),
    }
}

fn add(acc: &mut Buckets, b: &Buckets) {
    if acc.is_empty() {
        *acc = b.clone();
    } else if acc.len() == b.len() {
        for (a, x) in acc.iter_mut().zip(b) {
            a.1 += x.1;
        }
    }
}

/// `histogram_quantile` as Prometheus computes it (linear within the bucket), in ms;
/// `None` without observations. Above the last finite bound: that bound.
fn quantile_ms(q: f64, b: &Buckets) -> Option<f64> {
    let total = b.last()?.1;
    if total <= 0.0 {
        return None;
    }
    let rank = q * total;
    let mut prev = (0.0, 0.0);
    for &(le, c) in b {
        if c >= rank {
            if le.is_infinite() {
                return Some(prev.0 * 1e3);
            }
            let within = if c > prev.1 {
                (rank - prev.1) / (c - prev.1)
            } else {
                1.0
            };
            return Some((prev.0 + (le - prev.0) * within) * 1e3);
        }
        prev = (le, c);
    }
    None
}

struct Soak<'a> {
    run: Run,
    rabbit: &'a mut PrivateRabbit,
    pg: &'a PrivatePg,
    pool: sqlx::PgPool,
    producer: PikaProducer,
    samples: Vec<Sample>,
    started: Instant,
    pending: Vec<String>,
    /// The wall-clock time of the previous sample (ms).
    last_sample_ms: i64,
}

impl Soak<'_> {
    async fn sample(&mut self) {
        let mut s = Sample {
            t: self.started.elapsed(),
            events: std::mem::take(&mut self.pending),
            ..Sample::default()
        };
        let mut add_proc = |name: &str, pid: u32, stats: Option<(u64, u64)>| {
            if let Some((rss_kb, fds)) = stats {
                s.procs
                    .insert(name.to_owned(), ProcSample { pid, rss_kb, fds });
            }
        };
        for (name, pid) in self.run.pids() {
            if let Some(pid) = pid {
                add_proc(&name.replace(' ', ""), pid, proc_stats(pid));
            }
        }
        let producer = self.producer.child.id();
        add_proc("producer", producer, proc_stats(producer));
        if let Some(pid) = self.rabbit.vm_pid() {
            add_proc("rabbitmq", pid, proc_stats(pid));
        }
        // PostgreSQL: the postmaster and its backends and helpers, summed (RSS counts the
        // shared buffers each of them has touched again: an upper bound).
        if let Some(pid) = self.pg.postmaster_pid() {
            let all: Vec<(u64, u64)> = std::iter::once(pid)
                .chain(children_of(pid))
                .filter_map(proc_stats)
                .collect();
            if !all.is_empty() {
                let sum = all.iter().fold((0, 0), |a, b| (a.0 + b.0, a.1 + b.1));
                add_proc("postgres", pid, Some(sum));
            }
        }
        let channels = tokio::task::block_in_place(|| {
            self.rabbit.ctl(&[
                "list_channels",
                "--quiet",
                "--no-table-headers",
                "connection",
            ])
        });
        if channels.status.success() {
            let text = String::from_utf8_lossy(&channels.stdout);
            let conns: Vec<&str> = text
                .lines()
                .map(str::trim)
                .filter(|l| l.starts_with('<'))
                .collect();
            s.amqp_channels = Some(conns.len());
            s.amqp_connections = Some(
                conns
                    .iter()
                    .collect::<std::collections::BTreeSet<_>>()
                    .len(),
            );
        }
        s.ledger_rows = sqlx::query_scalar::<_, i64>("SELECT COUNT(*) FROM jobs")
            .fetch_one(&self.pool)
            .await
            .ok();
        s.ledger_bytes = self.run.ledger().size().await.ok().map(|z| z.bytes);
        let now = lastcall_worker::clock::now_ms();
        if let Ok(starts) = sqlx::query_scalar::<_, i64>(
            "SELECT started_at_ms - created_at_ms FROM jobs \
             WHERE started_at_ms > $1 AND started_at_ms <= $2 AND created_at_ms IS NOT NULL",
        )
        .bind(self.last_sample_ms)
        .bind(now)
        .fetch_all(&self.pool)
        .await
        {
            s.starts = starts;
            self.last_sample_ms = now;
        }
        // Model calls started after the deadline, in the attempt rows still there (the
        // retention is minutes; a sample every 30 s reads every row at least once).
        if let Ok(late) = sqlx::query_scalar::<_, String>(
            "SELECT DISTINCT a.job_id FROM attempts a JOIN jobs j ON j.job_id = a.job_id \
             WHERE a.model_called AND a.started_at_ms > j.expires_at_ms",
        )
        .fetch_all(&self.pool)
        .await
        {
            self.run.note_late_starts(late);
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_secs(5))
            .build()
            .unwrap();
        for i in 0..WORKERS {
            let text = match http.get(self.run.metrics_url(i)).send().await {
                Ok(r) => r.text().await.unwrap_or_default(),
                Err(_) => String::new(),
            };
            let q = buckets(&text, "lastcall_queue_dwell_seconds");
            let c = buckets(&text, "lastcall_consumer_dwell_seconds");
            s.dwell
                .push((!q.is_empty() && !c.is_empty()).then_some((q, c)));
        }
        self.run.collect_events().await;
        eprintln!("soak: {}", self.describe(&s));
        self.samples.push(s);
    }

    fn describe(&self, s: &Sample) -> String {
        let mut line = format!("t={:>5}s", s.t.as_secs());
        for (name, p) in &s.procs {
            let _ = write!(line, " {name}={}MB/{}fd", p.rss_kb / 1024, p.fds);
        }
        let _ = write!(
            line,
            " channels={} rows={}",
            opt(s.amqp_channels),
            opt(s.ledger_rows)
        );
        if !s.events.is_empty() {
            let _ = write!(line, " [{}]", s.events.join("; "));
        }
        line
    }

    async fn fault(&mut self, f: Fault) {
        eprintln!(
            "soak: t={}s {}",
            self.started.elapsed().as_secs(),
            f.label()
        );
        match f {
            Fault::BrokerRestart => tokio::task::block_in_place(|| self.rabbit.restart()),
            Fault::KillWorker(i) => {
                self.run.kill_worker(i);
                self.run.run_for(Duration::from_secs(2)).await;
                self.run.restart_worker(i);
            }
            Fault::PostgresRestart => {
                self.pg.stop_immediate();
                assert!(!self.pg.is_up(), "PostgreSQL still answers after its stop");
                self.run.run_for(Duration::from_secs(5)).await;
                tokio::task::block_in_place(|| self.pg.ctl_start());
            }
        }
        self.pending.push(f.label());
        self.run.fault_ended();
    }
}

fn opt<T: std::fmt::Display>(v: Option<T>) -> String {
    v.map_or(String::new(), |v| v.to_string())
}

/// The dwell p99s (queue, consumer) over the samples `from..=to` (the increase of every
/// worker's buckets from sample `from - 1`).
fn p99_between(samples: &[Sample], from: usize, to: usize) -> (Option<f64>, Option<f64>) {
    let (mut q, mut c) = (Buckets::new(), Buckets::new());
    for k in from.max(1)..=to {
        for w in 0..WORKERS {
            let Some((qa, ca)) = samples[k].dwell.get(w).cloned().flatten() else {
                continue;
            };
            let before = samples[k - 1].dwell.get(w).cloned().flatten();
            add(&mut q, &increase(before.as_ref().map(|b| &b.0), &qa));
            add(&mut c, &increase(before.as_ref().map(|b| &b.1), &ca));
        }
    }
    (quantile_ms(0.99, &q), quantile_ms(0.99, &c))
}

/// The exact p99 (nearest rank) of the dispatch delays of samples `from..=to`.
fn start_p99(samples: &[Sample], from: usize, to: usize) -> Option<i64> {
    let mut all: Vec<i64> = samples[from..=to]
        .iter()
        .flat_map(|s| s.starts.iter().copied())
        .collect();
    if all.is_empty() {
        return None;
    }
    all.sort_unstable();
    Some(all[(all.len() * 99).div_ceil(100) - 1])
}

const PROCS: [&str; 7] = [
    "serve", "worker0", "worker1", "worker2", "producer", "rabbitmq", "postgres",
];

fn csv(samples: &[Sample]) -> String {
    let mut out = String::from("t_s");
    for p in PROCS {
        let _ = write!(out, ",rss_kb_{p}");
    }
    for p in PROCS {
        let _ = write!(out, ",fds_{p}");
    }
    out.push_str(",amqp_connections,amqp_channels,ledger_rows,ledger_bytes,dispatch_p99_ms,queue_dwell_p99_ms,consumer_dwell_p99_ms,events\n");
    for (k, s) in samples.iter().enumerate() {
        let _ = write!(out, "{}", s.t.as_secs());
        for p in PROCS {
            let _ = write!(out, ",{}", opt(s.procs.get(p).map(|p| p.rss_kb)));
        }
        for p in PROCS {
            let _ = write!(out, ",{}", opt(s.procs.get(p).map(|p| p.fds)));
        }
        let (q, c) = p99_between(samples, k, k);
        let _ = writeln!(
            out,
            ",{},{},{},{},{},{},{},{}",
            opt(s.amqp_connections),
            opt(s.amqp_channels),
            opt(s.ledger_rows),
            opt(s.ledger_bytes),
            opt(start_p99(samples, k, k)),
            opt(q.map(|v| v.round())),
            opt(c.map(|v| v.round())),
            s.events.join("; ")
        );
    }
    out
}

/// Resident memory of the lastcall processes and the producer over time, in MB.
fn rss_chart(samples: &[Sample], minutes: f64) -> String {
    let series = PROCS[..5]
        .iter()
        .map(|p| {
            (
                (*p).to_owned(),
                samples
                    .iter()
                    .map(|s| s.procs.get(*p).map_or(0.0, |x| x.rss_kb as f64 / 1024.0))
                    .collect(),
            )
        })
        .collect();
    lastcall_bench::chart::line_chart(&lastcall_bench::chart::Chart {
        title: format!(
            "Resident memory over a {minutes}-minute soak under faults (a dip to 0: the worker was killed)"
        ),
        x_label: "sample (every 30 s)".into(),
        y_label: "VmRSS (MB)".into(),
        series,
        reference: None,
    })
    .expect("draw the RSS chart")
}

/// Growth of each process from the baseline sample to the last one, when the same process
/// (pid) was there at both; `None` for one restarted in between.
fn growth(base: &Sample, last: &Sample) -> Vec<(String, u64, u64, Option<f64>)> {
    PROCS
        .iter()
        .filter_map(|p| {
            let (b, l) = (base.procs.get(*p)?, last.procs.get(*p)?);
            let same = b.pid == l.pid;
            Some((
                (*p).to_owned(),
                b.rss_kb,
                l.rss_kb,
                same.then(|| l.rss_kb as f64 / b.rss_kb as f64 - 1.0),
            ))
        })
        .collect()
}

/// The soak: set up, load, faults and samples for `plan.minutes`, then the accounting.
/// Panics (the test fails, `scripts/soak.sh` exits non-zero) when an invariant breaks.
pub async fn soak(plan: Plan) {
    std::fs::create_dir_all(&plan.out).unwrap();
    eprintln!(
        "soak: {} min, output in {}; faults at {}",
        plan.minutes,
        plan.out.display(),
        plan.faults
            .iter()
            .map(|(t, f)| format!("{}s {}", t.as_secs(), f.label()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    let mut rabbit =
        PrivateRabbit::start(|port| format!("listeners.tcp.default = 127.0.0.1:{port}\n"));
    let pg = PrivatePg::start();
    let url = pg.url();
    let spec = Spec {
        workers: WORKERS,
        slots: SLOTS,
        sim_latency_ms: SIM_LATENCY_MS,
        interval_ms: POST_INTERVAL_MS,
        deadline_ms: BUDGET_MS,
        metrics: true,
        monitor_every: Duration::from_secs(2),
        worker_args: [
            "--prune-every".to_owned(),
            format!("{PRUNE_EVERY_S}s"),
            "--test-retention".to_owned(),
            format!("{RETENTION_S}s"),
            "--test-text-retention".to_owned(),
            format!("{TEXT_RETENTION_S}s"),
        ]
        .into(),
        ..Spec::default()
    };
    let amqp = rabbit.url("");
    let mut run = Run::start("soak", &amqp, &amqp, |_| url.clone(), spec.clone()).await;
    let producer = PikaProducer::start(&amqp, &run.prefix, &plan.out.join("producer.out"));
    let pool = sqlx::postgres::PgPoolOptions::new()
        .max_connections(1)
        .connect_lazy(&url)
        .unwrap();
    run.start_load();
    let mut soak = Soak {
        run,
        rabbit: &mut rabbit,
        pg: &pg,
        pool,
        producer,
        samples: Vec::new(),
        started: Instant::now(),
        pending: Vec::new(),
        last_sample_ms: lastcall_worker::clock::now_ms(),
    };
    let end = plan.duration();
    let mut faults = plan.faults.iter().copied().peekable();
    let mut next_sample = Duration::ZERO;
    loop {
        let now = soak.started.elapsed();
        if now >= next_sample {
            soak.sample().await;
            next_sample += plan.sample_every;
            continue;
        }
        if let Some((at, f)) = faults.peek().copied()
            && now >= at
        {
            faults.next();
            soak.fault(f).await;
            continue;
        }
        if now >= end {
            break;
        }
        let wake = faults
            .peek()
            .map_or(next_sample, |(at, _)| (*at).min(next_sample))
            .min(end);
        soak.run.run_for(wake.saturating_sub(now)).await;
    }
    let (attempted, confirmed) = soak.producer.stop().await;
    let Soak {
        mut run, samples, ..
    } = soak;
    run.add_other_producer(attempted, confirmed);

    // The accounting of the fault suite. Every fault may repeat the calls running at that
    // moment: a broker or PostgreSQL restart those of every worker, a kill those of one.
    let count = |f: fn(&Fault) -> bool| plan.faults.iter().filter(|(_, x)| f(x)).count();
    let restarts = count(|f| matches!(f, Fault::BrokerRestart | Fault::PostgresRestart));
    let kills = count(|f| matches!(f, Fault::KillWorker(_)));
    let bound = restarts * WORKERS * SLOTS + kills * SLOTS;
    let row = run.account(bound).await;

    // Memory, p99 and the ledger's size, from the samples.
    let last = samples.len() - 1;
    let base = samples
        .iter()
        .position(|s| s.t >= plan.baseline_at)
        .unwrap_or(last / 3);
    let window = ((plan.baseline_at.as_secs_f64() / plan.sample_every.as_secs_f64()) / 2.0)
        .clamp(1.0, 4.0) as usize;
    let from_base = base + 1 - window.min(base);
    let p99_base = p99_between(&samples, from_base, base);
    let p99_last = p99_between(&samples, last + 1 - window, last);
    let start_base = start_p99(&samples, from_base, base);
    let start_last = start_p99(&samples, last + 1 - window, last);
    let growths = growth(&samples[base], &samples[last]);
    let offered = 1000.0 / POST_INTERVAL_MS as f64 + PIKA_RATE;
    let rows_bound =
        (offered * (RETENTION_S + PRUNE_EVERY_S + BUDGET_MS / 1000 + 60) as f64) as i64;
    let max_rows_after_base = samples[base..]
        .iter()
        .filter_map(|s| s.ledger_rows)
        .max()
        .unwrap_or(0);

    let mut summary = format!(
        "# Soak: {} min under faults\n\noutput: {}\n\nfaults: {}\n\n",
        plan.minutes,
        plan.out.display(),
        plan.faults
            .iter()
            .map(|(t, f)| format!("{}:{:02} {}", t.as_secs() / 60, t.as_secs() % 60, f.label()))
            .collect::<Vec<_>>()
            .join(", ")
    );
    summary.push_str(&sample_table(&samples, base));
    let _ = write!(
        summary,
        "\n## Accounting\n\n{}\n{}\n\n(model calls: the sim's call log counts every call; \
         the ledger's Σ backend_calls in brackets covers only the rows retention has not pruned)\n\n",
        Row::HEADER,
        row.markdown()
    );
    let _ = writeln!(
        summary,
        "## Resident memory, sample {} (t = {} s) → last (t = {} s); limit +{:.0}%\n",
        base,
        samples[base].t.as_secs(),
        samples[last].t.as_secs(),
        plan.memory_limit * 100.0
    );
    summary.push_str("| process | baseline MB | last MB | growth |\n|---|---|---|---|\n");
    let mut too_much = Vec::new();
    for (p, b, l, g) in &growths {
        let verdict = match g {
            Some(g) => {
                // The lastcall processes and the producer are held to the limit; the
                // broker and PostgreSQL are reported (their caches fill as they please).
                if *g > plan.memory_limit && PROCS[..5].contains(&p.as_str()) {
                    too_much.push(format!("{p} {:+.1}%", g * 100.0));
                }
                format!("{:+.1}%", g * 100.0)
            }
            None => "restarted since the baseline: not compared".to_owned(),
        };
        let _ = writeln!(
            summary,
            "| {p} | {:.1} | {:.1} | {verdict} |",
            *b as f64 / 1024.0,
            *l as f64 / 1024.0
        );
    }
    let ms = |v: Option<f64>| v.map_or("-".to_owned(), |v| format!("{v:.0} ms"));
    let _ = writeln!(
        summary,
        "\n## Dispatch p99\n\n\
         Publish → model call start (the ledger's `started_at_ms − created_at_ms`, exact), over \
         the {window} sample(s) ending at the baseline: {}; ending at the last sample: {}; \
         growth {}. The workers' histograms (interpolated within their buckets, which are 5 s \
         wide between 5 and 10 s): queue dwell (publish → receipt) p99 {} → {}, consumer dwell \
         (receipt → admission) p99 {} → {}.\n",
        ms(start_base.map(|v| v as f64)),
        ms(start_last.map(|v| v as f64)),
        match (start_base, start_last) {
            (Some(b), Some(l)) if b > 0 => format!("{:.2}× (target ≤ 2×)", l as f64 / b as f64),
            _ => "-".to_owned(),
        },
        ms(p99_base.0),
        ms(p99_last.0),
        ms(p99_base.1),
        ms(p99_last.1),
    );
    let _ = writeln!(
        summary,
        "## Ledger\n\nrows at most {max_rows_after_base} from the baseline on (bound {rows_bound}: \
         {offered} jobs/s offered × (retention {RETENTION_S} s + prune every {PRUNE_EVERY_S} s + \
         budget + 60 s)); last {} rows, {} bytes\n",
        opt(samples[last].ledger_rows),
        opt(samples[last].ledger_bytes)
    );
    std::fs::write(plan.out.join("samples.csv"), csv(&samples)).unwrap();
    std::fs::write(plan.out.join("rss.svg"), rss_chart(&samples, plan.minutes)).unwrap();
    std::fs::write(plan.out.join("summary.md"), &summary).unwrap();
    println!("{summary}");

    run.check(&row);
    assert!(
        too_much.is_empty(),
        "resident memory grew more than +{:.0}% from the baseline: {}\n{summary}",
        plan.memory_limit * 100.0,
        too_much.join(", ")
    );
    assert!(
        max_rows_after_base <= rows_bound,
        "the ledger held {max_rows_after_base} rows, more than retention allows \
         ({rows_bound}): is the workers' pruning running? {summary}"
    );
}

/// The samples at 0, the baseline, and about every sixth of the run, and the last.
fn sample_table(samples: &[Sample], base: usize) -> String {
    let last = samples.len() - 1;
    let mut picks: Vec<usize> = (0..=6).map(|k| k * last / 6).collect();
    picks.push(base);
    picks.sort();
    picks.dedup();
    let mut t = String::from(
        "| t | serve MB | worker 0 MB | worker 1 MB | worker 2 MB | producer MB | RabbitMQ MB | PostgreSQL MB | fds serve / w0 / w1 / w2 | AMQP conns / channels | ledger rows | ledger MB | dispatch p99 | queue dwell p99 |\n\
         |---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n",
    );
    for k in picks {
        let s = &samples[k];
        let mb = |p: &str| {
            s.procs.get(p).map_or("-".to_owned(), |x| {
                format!("{:.1}", x.rss_kb as f64 / 1024.0)
            })
        };
        let fd = |p: &str| s.procs.get(p).map_or("-".to_owned(), |x| x.fds.to_string());
        let (q, _) = p99_between(samples, k, k);
        let _ = writeln!(
            t,
            "| {}:{:02}{} | {} | {} | {} | {} | {} | {} | {} | {} / {} / {} / {} | {} / {} | {} | {} | {} | {} |",
            s.t.as_secs() / 60,
            s.t.as_secs() % 60,
            if k == base { " (baseline)" } else { "" },
            mb("serve"),
            mb("worker0"),
            mb("worker1"),
            mb("worker2"),
            mb("producer"),
            mb("rabbitmq"),
            mb("postgres"),
            fd("serve"),
            fd("worker0"),
            fd("worker1"),
            fd("worker2"),
            opt(s.amqp_connections),
            opt(s.amqp_channels),
            opt(s.ledger_rows),
            s.ledger_bytes
                .map_or("-".to_owned(), |b| format!("{:.1}", b as f64 / 1048576.0)),
            start_p99(samples, k, k).map_or("-".to_owned(), |v| format!("{v} ms")),
            q.map_or("-".to_owned(), |v| format!("{v:.0} ms")),
        );
    }
    t
}
