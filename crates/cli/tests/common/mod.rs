//! Shared set-up of the pipeline tests: a real RabbitMQ with a fresh prefix per test, and
//! a real ledger (a fresh SQLite file, or a fresh PostgreSQL database).
#![allow(dead_code)]

pub mod chaos;
pub mod http;
pub mod llama;
pub mod private_pg;
pub mod private_rabbit;
pub mod proxy;
pub mod rabbitmqctl;
pub mod serve;
pub mod soak;
pub mod upstream;

use lastcall_backend::Backend;
use lastcall_backend::sim::{SimBackend, SimConfig};
use lastcall_broker::topology::queue_depth;
use lastcall_broker::{Broker, Publisher, Topology};
use lastcall_core::{AdmissionPolicy, EnvelopeLimits};
use lastcall_store::{JobRecord, Ledger};
use lastcall_worker::clock::now_ms;
use lastcall_worker::dlq::DeadLetterProcessor;
use lastcall_worker::{
    Clock, DeadlineSpec, NewJob, Submitter, SystemClock, Worker, WorkerConfig, WorkerStats,
};
use serde_json::json;
use sqlx::Connection;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

pub fn pg_admin_url() -> String {
    std::env::var("LASTCALL_TEST_PG_URL")
        .unwrap_or_else(|_| "postgres://postgres@127.0.0.1:5432/test".into())
}

pub fn unique(name: &str) -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(
        "t-{name}-{}-{}-{n}",
        std::process::id(),
        now_ms() % 1_000_000
    )
}

pub struct Env {
    pub prefix: String,
    pub topo: Topology,
    pub broker: Broker,
    pub ledger: Arc<Ledger>,
    pub store_url: String,
    pub dir: PathBuf,
    pg_db: Option<String>,
}

impl Env {
    pub async fn sqlite(name: &str) -> Env {
        let prefix = unique(name);
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        let store_url = format!("sqlite://{}", dir.join("ledger.db").display());
        Self::with_store(prefix, dir, store_url, None).await
    }

    pub async fn postgres(name: &str) -> Env {
        let prefix = unique(name);
        let db = prefix.replace('-', "_");
        let mut admin = sqlx::PgConnection::connect(&pg_admin_url())
            .await
            .expect("PostgreSQL must be reachable at LASTCALL_TEST_PG_URL (default postgres://postgres@127.0.0.1:5432/test)");
        sqlx::query(sqlx::AssertSqlSafe(format!("CREATE DATABASE {db}")))
            .execute(&mut admin)
            .await
            .unwrap();
        let base = pg_admin_url();
        let store_url = format!("{}/{db}", &base[..base.rfind('/').unwrap()]);
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        Self::with_store(prefix, dir, store_url, Some(db)).await
    }

    /// A fresh prefix and a ledger at `store_url` (a database the caller owns).
    #[allow(dead_code)]
    pub async fn with_store_url(name: &str, store_url: &str) -> Env {
        let prefix = unique(name);
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        Self::with_store(prefix, dir, store_url.to_owned(), None).await
    }

    async fn with_store(
        prefix: String,
        dir: PathBuf,
        store_url: String,
        pg_db: Option<String>,
    ) -> Env {
        let broker = Broker::connect(AMQP)
            .await
            .expect("RabbitMQ must be running on 127.0.0.1:5672 (guest/guest)");
        let mut topo = Topology::new(&prefix);
        topo.retry_delays_ms = vec![1_000, 5_000];
        topo.apply(&broker).await.unwrap();
        let ledger = Arc::new(Ledger::connect(&store_url).await.unwrap());
        Env {
            prefix,
            topo,
            broker,
            ledger,
            store_url,
            dir,
            pg_db,
        }
    }

    pub async fn submitter(&self, uncertainty_ms: u64, with_ledger: bool) -> Submitter {
        let publisher = Publisher::new(&self.broker, Duration::from_secs(5))
            .await
            .unwrap();
        let admission = AdmissionPolicy {
            clock_uncertainty_ms: uncertainty_ms,
            default_min_runtime_ms: 0,
        };
        Submitter::new(
            publisher,
            self.topo.names.clone(),
            with_ledger.then(|| self.ledger.clone()),
            admission,
            EnvelopeLimits::default(),
        )
    }

    pub fn worker_config(&self, slots: usize, prefetch: u16) -> WorkerConfig {
        let mut cfg = WorkerConfig::new(&self.prefix, slots);
        cfg.topology = self.topo.clone();
        cfg.prefetch = prefetch;
        cfg.name = "test-worker".into();
        cfg.shutdown_grace = Duration::from_secs(3);
        cfg
    }

    pub async fn start_worker(
        &self,
        cfg: WorkerConfig,
        backend: Arc<dyn Backend>,
        clock: Arc<dyn Clock>,
    ) -> Running {
        let stats = Arc::new(WorkerStats::default());
        let broker = Broker::connect(AMQP).await.unwrap();
        let w = Worker::build(
            cfg,
            broker,
            self.ledger.clone(),
            backend,
            clock,
            stats.clone(),
        )
        .await
        .unwrap();
        let stop = CancellationToken::new();
        let handle = tokio::spawn({
            let stop = stop.clone();
            async move {
                w.run(stop).await.unwrap();
            }
        });
        Running {
            stop,
            handle,
            stats,
        }
    }

    /// Run the dead-letter processor until the dead queue has been idle for 1.5 s.
    pub async fn drain_dead_letters(&self, park: bool) -> Arc<lastcall_worker::dlq::DlqStats> {
        let broker = Broker::connect(AMQP).await.unwrap();
        let dlq = DeadLetterProcessor::build(
            broker.clone(),
            self.ledger.clone(),
            self.topo.clone(),
            Arc::new(SystemClock::default()),
            park,
        )
        .await
        .unwrap();
        let stats = dlq.stats.clone();
        dlq.run(CancellationToken::new(), Some(Duration::from_millis(1_500)))
            .await
            .unwrap();
        broker.close().await;
        stats
    }

    /// Poll the ready count of `queue` until it is `n` (e.g. messages the broker expired
    /// into the dead-letter queue); panics after 30 s with the count last seen.
    pub async fn wait_ready(&self, queue: &str, n: u32) {
        let until = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.ready(queue).await;
            if got == n {
                return;
            }
            assert!(
                std::time::Instant::now() < until,
                "queue {queue} holds {got} ready messages, expected {n}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn ready(&self, queue: &str) -> u32 {
        queue_depth(&self.broker, queue)
            .await
            .unwrap()
            .map(|(m, _)| m)
            .unwrap_or(0)
    }

    /// Wait until every id has a terminal outcome; panics with the states seen otherwise.
    pub async fn wait_terminal(&self, ids: &[String], timeout: Duration) -> Vec<JobRecord> {
        self.wait_terminal_as(ids, timeout, false).await
    }

    /// [`Env::wait_terminal`], recording the dead letters before each look (jobs that
    /// expired in the broker end through the dead-letter processor).
    pub async fn wait_terminal_draining(
        &self,
        ids: &[String],
        timeout: Duration,
    ) -> Vec<JobRecord> {
        self.wait_terminal_as(ids, timeout, true).await
    }

    async fn wait_terminal_as(
        &self,
        ids: &[String],
        timeout: Duration,
        drain: bool,
    ) -> Vec<JobRecord> {
        let until = std::time::Instant::now() + timeout;
        loop {
            if drain {
                self.drain_dead_letters(false).await;
            }
            let mut recs = Vec::new();
            for id in ids {
                if let Some(r) = self.ledger.get(id).await.unwrap() {
                    recs.push(r);
                }
            }
            let done = recs
                .iter()
                .filter(|r| {
                    r.state
                        .parse::<lastcall_core::State>()
                        .is_ok_and(|s| s.is_terminal())
                })
                .count();
            if done == ids.len() {
                return recs;
            }
            if std::time::Instant::now() > until {
                panic!(
                    "timed out waiting for outcomes: {:?}",
                    recs.iter()
                        .map(|r| (&r.job_id, &r.state))
                        .collect::<Vec<_>>()
                );
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    pub async fn cleanup(self) {
        self.topo.delete(&self.broker).await.unwrap();
        self.broker.close().await;
        self.ledger.close().await;
        if let Some(db) = self.pg_db
            && let Ok(mut admin) = sqlx::PgConnection::connect(&pg_admin_url()).await
        {
            let _ = sqlx::query(sqlx::AssertSqlSafe(format!(
                "DROP DATABASE IF EXISTS {db} WITH (FORCE)"
            )))
            .execute(&mut admin)
            .await;
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A worker running in this process.
pub struct Running {
    pub stop: CancellationToken,
    pub handle: JoinHandle<()>,
    pub stats: Arc<WorkerStats>,
}

impl Running {
    pub async fn stop(self) {
        self.stop.cancel();
        self.handle.await.unwrap();
    }
}

pub fn sim(latency_ms: u64) -> Arc<SimBackend> {
    Arc::new(
        SimBackend::new(SimConfig {
            latency_ms,
            // The tests use the fault kinds (`sim.fail-*`) on purpose.
            faults: true,
            ..SimConfig::default()
        })
        .unwrap(),
    )
}

pub fn system_clock() -> Arc<dyn Clock> {
    Arc::new(SystemClock::default())
}

pub fn job(id: &str, budget_ms: u64) -> NewJob {
    NewJob {
        job_id: Some(id.into()),
        kind: "incident.summary".into(),
        payload: json!({"messages": [{"role": "user", "content": "summarize"}]})
            .as_object()
            .cloned()
            .unwrap(),
        deadline: DeadlineSpec::RelativeMs(budget_ms),
        min_runtime_ms: None,
        trace_id: None,
    }
}

pub fn job_with(id: &str, budget_ms: u64, payload: serde_json::Value) -> NewJob {
    NewJob {
        payload: payload.as_object().cloned().unwrap(),
        ..job(id, budget_ms)
    }
}

impl Env {
    /// A fresh environment whose topology is changed by `edit` (queue type, retry delays,
    /// length limit) before it is declared: the default one is deleted and re-applied.
    pub async fn with_topology(
        name: &str,
        postgres: bool,
        edit: impl FnOnce(&mut Topology),
    ) -> Env {
        let mut env = if postgres {
            Self::postgres(name).await
        } else {
            Self::sqlite(name).await
        };
        env.topo.delete(&env.broker).await.unwrap();
        edit(&mut env.topo);
        env.topo.apply(&env.broker).await.unwrap();
        env
    }

    /// The `lastcall` binary with this environment's broker, ledger and prefix set.
    pub fn command(&self) -> std::process::Command {
        self.command_with_amqp(AMQP)
    }

    /// [`command`](Self::command) with another broker URL (e.g. through a fault proxy).
    pub fn command_with_amqp(&self, amqp: &str) -> std::process::Command {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_lastcall"));
        c.args([
            "--amqp-url",
            amqp,
            "--store-url",
            &self.store_url,
            "--prefix",
            &self.prefix,
        ]);
        c
    }

    /// Run the `lastcall` binary against this environment's broker, ledger and prefix
    /// (killed, and the test failed naming it, if it runs past [`CHILD_LIMIT`]).
    pub fn cli(&self, args: &[&str]) -> std::process::Output {
        let mut c = self.command();
        c.args(args);
        output_within(&mut c, &format!("lastcall {}", args.join(" ")), CHILD_LIMIT)
    }

    /// `lastcall submit` of an `incident.summary` job `id` with the prompt "summarize",
    /// `deadline_ms` and the test topology's retry delays, then `extra` flags.
    pub fn submit_cli(&self, id: &str, deadline_ms: &str, extra: &[&str]) -> std::process::Output {
        let mut args = vec![
            "submit",
            "--kind",
            "incident.summary",
            "--prompt",
            "summarize",
            "--deadline-ms",
            deadline_ms,
            "--job-id",
            id,
            "--retry-delays-ms",
            "1000,5000",
        ];
        args.extend_from_slice(extra);
        self.cli(&args)
    }

    /// The next dead letter, handed straight back to the dead queue (for inspection only).
    pub async fn peek_dead_letter(&self) -> lastcall_broker::Incoming {
        let mut dead = lastcall_broker::IncomingStream::open(
            &self.broker,
            &self.topo.names.dead_queue,
            1,
            "inspect",
        )
        .await
        .unwrap();
        let d = tokio::time::timeout(Duration::from_secs(5), dead.next())
            .await
            .expect("a dead letter within 5 s")
            .unwrap()
            .unwrap();
        d.settler.requeue().await.unwrap();
        dead.close().await;
        d
    }
}

/// How long a `lastcall` command run to its end may take in a test before it counts as hung.
pub const CHILD_LIMIT: Duration = Duration::from_secs(90);

/// `Command::output()` with a deadline: stdin closed, stdout and stderr collected. A child
/// still running after `limit` is killed and the test panics naming the command and what it
/// had printed, instead of hanging until the test runner's own timeout says nothing.
pub fn output_within(
    c: &mut std::process::Command,
    what: &str,
    limit: Duration,
) -> std::process::Output {
    use std::io::Read;
    use std::process::Stdio;
    let mut child = c
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{what}: cannot start: {e}"));
    fn drain(mut r: impl Read + Send + 'static) -> std::thread::JoinHandle<Vec<u8>> {
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let _ = r.read_to_end(&mut buf);
            buf
        })
    }
    let out = drain(child.stdout.take().expect("piped stdout"));
    let err = drain(child.stderr.take().expect("piped stderr"));
    let until = std::time::Instant::now() + limit;
    let status = loop {
        if let Some(status) = child.try_wait().expect("wait for the child") {
            break Some(status);
        }
        if std::time::Instant::now() >= until {
            break None;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let Some(status) = status else {
        let _ = child.kill();
        let _ = child.wait();
        let out = out.join().unwrap_or_default();
        let err = err.join().unwrap_or_default();
        panic!(
            "{what}: still running after {limit:?}, killed.\nstdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&out),
            String::from_utf8_lossy(&err)
        );
    };
    std::process::Output {
        status,
        stdout: out.join().unwrap_or_default(),
        stderr: err.join().unwrap_or_default(),
    }
}

/// [`output_within`] with [`CHILD_LIMIT`], in `Command::output`'s place (the command line is
/// the label: no secrets in the arguments of a test that uses it).
pub trait OutputBounded {
    fn output_bounded(&mut self) -> std::io::Result<std::process::Output>;
}

impl OutputBounded for std::process::Command {
    fn output_bounded(&mut self) -> std::io::Result<std::process::Output> {
        let what = std::iter::once(self.get_program())
            .chain(self.get_args())
            .map(|a| a.to_string_lossy().into_owned())
            .collect::<Vec<_>>()
            .join(" ");
        Ok(output_within(self, &what, CHILD_LIMIT))
    }
}

/// Model calls the sim backend logged for `id` (`--sim-call-log`), across processes.
pub fn calls_in(log: &std::path::Path, id: &str) -> usize {
    std::fs::read_to_string(log)
        .unwrap_or_default()
        .lines()
        .filter(|l| l.split(' ').next() == Some(id))
        .count()
}

/// A job of `kind` with a relative deadline.
pub fn job_of_kind(id: &str, kind: &str, budget_ms: u64) -> NewJob {
    NewJob {
        kind: kind.into(),
        ..job(id, budget_ms)
    }
}

/// The Python of `scripts/setup-python-example.sh`'s venv, with `module` importable;
/// panics saying how to install it otherwise (never skips).
#[allow(dead_code)]
pub fn example_python(module: &str) -> PathBuf {
    let cache = std::env::var_os("LASTCALL_CACHE")
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(std::env::var_os("HOME").expect("HOME is set")).join(".cache/lastcall")
        });
    let python = cache.join("python-example-venv/bin/python");
    let ok = python.is_file()
        && std::process::Command::new(&python)
            .args(["-c", &format!("import {module}")])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
    assert!(
        ok,
        "no python with {module} at {}: run scripts/setup-python-example.sh first \
         (scripts/test.sh does)",
        python.display()
    );
    python
}

/// One worker slot of 400 ms sim calls, taken FIFO (`edit` changes the rest of its
/// configuration): three jobs teach it the call duration (it needs three samples), then B
/// runs and C and D wait behind it for the slot (`b`, `c`, `d`, 10 s budgets). The worker,
/// its sim backend (to count calls) and the submitter (100 ms clock margin, recording to the
/// ledger) that sent them, for the next job.
pub async fn two_waiting_behind_one_slot(
    env: &Env,
    edit: impl FnOnce(&mut WorkerConfig),
) -> (Running, Arc<SimBackend>, Submitter) {
    let sim = sim(400);
    let mut cfg = env.worker_config(1, 16);
    cfg.buffer_order = lastcall_worker::BufferOrder::Fifo;
    edit(&mut cfg);
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    let s = env.submitter(100, true).await;
    for id in ["a1", "a2", "a3"] {
        s.submit(&job(id, 10_000), now_ms()).await.unwrap();
    }
    env.wait_terminal(
        &["a1", "a2", "a3"].map(String::from),
        Duration::from_secs(10),
    )
    .await;
    for id in ["b", "c", "d"] {
        s.submit(&job(id, 10_000), now_ms()).await.unwrap();
    }
    let t0 = std::time::Instant::now();
    while w.stats.waiting.load(std::sync::atomic::Ordering::Relaxed) < 2 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "C and D never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    (w, sim, s)
}
