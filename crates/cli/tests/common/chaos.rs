//! The fault suite's harness (#12, `tests/chaos.rs`): the real binaries (`lastcall serve
//! --dlq` as the producer's front door, `lastcall worker --backend sim` processes) on the
//! test's own services, a steady load of `POST /v1/jobs` while one fault is injected, and
//! Jepsen-style accounting computed afterwards from what was observed, never assumed:
//! - **attempted / confirmed**: POSTs sent, and those answered 202 (serve answers 202 only
//!   after the broker's publisher confirm);
//! - **outcomes by state**: the ledger's record of every confirmed job;
//! - **lost**: confirmed jobs with no terminal outcome (or `unknown`) once every deadline
//!   plus a grace has passed;
//! - **duplicate outcomes**: jobs whose terminal state was seen to change (a monitor reads
//!   the ledger every 250 ms during the run), or with more than one outcome event on
//!   `{prefix}.events` (an event is published only by the writer that won the write-once
//!   terminal write; events are best effort, so this side can only under-count);
//! - **late starts**: attempts with a model call whose `started_at_ms` (written right
//!   before the call) lies after the job's `expires_at_ms`;
//! - **model calls / duplicate calls**: from the sim backend's call log, which every
//!   worker process appends to before each call (independent of the ledger), against the
//!   ledger's `backend_calls`; a duplicate call is any call after a job's first;
//! - **recovery**: from the end of the fault to the first `completed` of a job delivered
//!   after it.
//!
//! The services a scenario faults are private (`private_rabbit`, `private_pg`); their
//! guards restore and remove them on drop, also when an assertion fails.

use super::private_rabbit::free_port;
use super::unique;
use lastcall_core::OutcomeEvent;
use lastcall_store::{JobRecord, Ledger, ListFilter};
use lastcall_worker::clock::now_ms;
use std::collections::{BTreeMap, HashMap};
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "chaos-suite-token-0123456789abcdef";

/// The shape of a scenario's pipeline and load.
#[derive(Clone, Debug)]
pub struct Spec {
    pub workers: usize,
    pub slots: usize,
    pub sim_latency_ms: u64,
    /// Pause between POSTs (one producer, one request at a time).
    pub interval_ms: u64,
    /// Each job's budget.
    pub deadline_ms: u64,
    pub queue_type: &'static str,
    /// How long after the last deadline a confirmed job may still lack its outcome
    /// before it counts as lost.
    pub grace: Duration,
    /// More arguments for every worker (after the harness's own).
    pub worker_args: Vec<String>,
    /// Each worker serves `/metrics` on a free port ([`Run::metrics_url`]).
    pub metrics: bool,
    /// How often the monitor reads the whole ledger (every terminal state it sees counts,
    /// also of a job that retention prunes before the end).
    pub monitor_every: Duration,
}

impl Default for Spec {
    fn default() -> Self {
        Self {
            workers: 1,
            slots: 2,
            sim_latency_ms: 200,
            interval_ms: 150,
            deadline_ms: 8_000,
            queue_type: "classic",
            grace: Duration::from_secs(30),
            worker_args: Vec::new(),
            metrics: false,
            monitor_every: Duration::from_millis(250),
        }
    }
}

/// One `lastcall` child process, restartable with the same arguments.
struct Proc {
    name: String,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
}

impl Proc {
    fn spawn(&mut self) {
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.log)
            .unwrap();
        self.child = Some(
            Command::new(env!("CARGO_BIN_EXE_lastcall"))
                .args(&self.args)
                .env("LASTCALL_HTTP_TOKEN", TOKEN)
                .env(
                    "LASTCALL_LOG",
                    std::env::var("LASTCALL_CHAOS_LOG").unwrap_or_else(|_| "info".into()),
                )
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(log)
                .spawn()
                .expect("spawn the lastcall binary"),
        );
    }

    fn pid(&self) -> u32 {
        self.child.as_ref().expect("running").id()
    }

    fn signal(&self, sig: &str) {
        let ok = Command::new("kill")
            .args([sig, &self.pid().to_string()])
            .status()
            .unwrap();
        assert!(ok.success(), "kill {sig} {}", self.name);
    }

    /// `Some(status)` if it has exited.
    fn exited(&mut self) -> Option<std::process::ExitStatus> {
        self.child.as_mut().and_then(|c| c.try_wait().unwrap())
    }

    fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            // A stopped process (SIGSTOP) dies of SIGKILL too; SIGCONT first anyway, so
            // that nothing is left stopped whatever happens next.
            let _ = Command::new("kill")
                .args(["-CONT", &c.id().to_string()])
                .status();
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    fn log_tail(&self) -> String {
        let s = std::fs::read_to_string(&self.log).unwrap_or_default();
        let tail = std::env::var("LASTCALL_CHAOS_TAIL")
            .ok()
            .and_then(|t| t.parse().ok())
            .unwrap_or(12_000);
        let start = s.len().saturating_sub(tail);
        format!("--- {}:\n{}", self.name, &s[s.ceil_char_boundary(start)..])
    }
}

/// The load: one POST at a time, every `interval_ms`.
struct Load {
    stop: CancellationToken,
    handle: JoinHandle<Vec<Post>>,
}

#[derive(Clone, Debug)]
struct Post {
    id: String,
    status: u16,
}

/// The accounting row of one run.
#[derive(Debug, Default)]
pub struct Row {
    pub scenario: String,
    pub attempted: usize,
    pub confirmed: usize,
    /// The HTTP answers to the POSTs, by status (0: no answer).
    pub statuses: BTreeMap<u16, usize>,
    /// Outcomes of the confirmed jobs, by state (`accepted`/`running`/none when open).
    pub states: BTreeMap<String, usize>,
    pub lost: Vec<String>,
    pub duplicate_outcomes: Vec<String>,
    pub late_starts: Vec<String>,
    pub model_calls: usize,
    pub ledger_calls: i64,
    pub duplicate_calls: usize,
    pub duplicate_bound: usize,
    /// Jobs the ledger holds that were not confirmed to the producer (a 503 whose publish
    /// reached the queue after all), and how many of them ran.
    pub unconfirmed_recorded: usize,
    pub recovery_ms: Option<i64>,
    pub events: usize,
}

impl Row {
    pub const HEADER: &str = "| scenario | attempted | confirmed | outcomes (confirmed jobs) | lost | dup. outcomes | late starts | model calls (ledger) | dup. calls (bound) | unconfirmed recorded | events | recovery |\n|---|---|---|---|---|---|---|---|---|---|---|---|";

    pub fn markdown(&self) -> String {
        let states = self
            .states
            .iter()
            .map(|(s, n)| format!("{s} {n}"))
            .collect::<Vec<_>>()
            .join(", ");
        format!(
            "| {} | {} | {} | {} | {} | {} | {} | {} ({}) | {} (≤ {}) | {} | {} | {} |",
            self.scenario,
            self.attempted,
            self.confirmed,
            states,
            self.lost.len(),
            self.duplicate_outcomes.len(),
            self.late_starts.len(),
            self.model_calls,
            self.ledger_calls,
            self.duplicate_calls,
            self.duplicate_bound,
            self.unconfirmed_recorded,
            self.events,
            self.recovery_ms
                .map_or("none".to_owned(), |ms| format!("{:.1} s", ms as f64 / 1e3)),
        )
    }
}

/// A running scenario: serve, the workers, the load, the ledger monitor.
pub struct Run {
    pub scenario: String,
    pub prefix: String,
    pub dir: PathBuf,
    pub store: String,
    pub spec: Spec,
    /// Where the events queue is read (a node that stays up).
    events_amqp: String,
    base: String,
    http: reqwest::Client,
    ledger: Option<Arc<Ledger>>,
    serve: Proc,
    workers: Vec<Proc>,
    calls: PathBuf,
    load: Option<Load>,
    monitor: Option<(CancellationToken, JoinHandle<()>)>,
    seen: Arc<Mutex<Seen>>,
    fault_end_ms: Option<i64>,
    /// `http://127.0.0.1:PORT/metrics` of each worker (with `spec.metrics`).
    metrics: Vec<String>,
    /// Outcome events drained so far, per job.
    events: Mutex<HashMap<String, usize>>,
    /// Jobs another producer (not the harness's POSTs) attempted and had confirmed.
    other_attempted: usize,
    other_confirmed: Vec<String>,
    /// Late starts found while the run went on ([`note_late_starts`](Self::note_late_starts)).
    late_seen: Vec<String>,
}

impl Run {
    /// Start serve (on `serve_amqp`) and `spec.workers` workers (on `worker_amqp`, which
    /// may be a comma-separated node list or a proxy), both on the ledger `store`; wait
    /// until a first job completes end to end. Nothing is loaded yet.
    pub async fn start(
        scenario: &str,
        serve_amqp: &str,
        worker_amqp: &str,
        store_for: impl FnOnce(&std::path::Path) -> String,
        spec: Spec,
    ) -> Run {
        let prefix = unique(&format!("chaos-{scenario}"));
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        let store = store_for(&dir);
        let port = free_port();
        let base = format!("http://127.0.0.1:{port}");
        let calls = dir.join("calls.log");
        let global = |amqp: &str| {
            vec![
                "--amqp-url".to_owned(),
                amqp.to_owned(),
                "--store-url".to_owned(),
                store.clone(),
                "--prefix".to_owned(),
                prefix.clone(),
            ]
        };
        let topology = [
            "--retry-delays-ms",
            "1000,5000",
            "--queue-type",
            spec.queue_type,
        ]
        .map(str::to_owned);
        let mut serve_args = global(serve_amqp);
        serve_args.extend(
            [
                "serve",
                "--addr",
                &format!("127.0.0.1:{port}"),
                "--no-management",
                "--dlq",
                "--confirm-timeout-ms",
                "3000",
            ]
            .map(str::to_owned),
        );
        serve_args.extend(topology.clone());
        let mut serve = Proc {
            name: "serve".into(),
            args: serve_args,
            log: dir.join("serve.log"),
            child: None,
        };
        serve.spawn();
        let metrics: Vec<u16> = (0..spec.workers)
            .map(|_| if spec.metrics { free_port() } else { 0 })
            .collect();
        let workers = (0..spec.workers)
            .map(|i| {
                let mut args = global(worker_amqp);
                args.extend(
                    [
                        "worker",
                        "--backend",
                        "sim",
                        "--slots",
                        &spec.slots.to_string(),
                        "--sim-latency-ms",
                        &spec.sim_latency_ms.to_string(),
                        "--sim-call-log",
                        calls.to_str().unwrap(),
                        "--shutdown-grace-ms",
                        "2000",
                    ]
                    .map(str::to_owned),
                );
                args.extend(topology.clone());
                if spec.metrics {
                    args.extend(["--metrics-addr".into(), format!("127.0.0.1:{}", metrics[i])]);
                }
                args.extend(spec.worker_args.iter().cloned());
                Proc {
                    name: format!("worker {i}"),
                    args,
                    log: dir.join(format!("worker-{i}.log")),
                    child: None,
                }
            })
            .collect();
        let mut run = Run {
            scenario: scenario.to_owned(),
            prefix,
            dir,
            store,
            spec,
            events_amqp: serve_amqp.split(',').next_back().unwrap().to_owned(),
            base,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(15))
                .build()
                .unwrap(),
            ledger: None,
            serve,
            workers,
            calls,
            load: None,
            monitor: None,
            seen: Arc::default(),
            fault_end_ms: None,
            metrics: metrics
                .iter()
                .filter(|p| **p != 0)
                .map(|p| format!("http://127.0.0.1:{p}/metrics"))
                .collect(),
            events: Mutex::default(),
            other_attempted: 0,
            other_confirmed: Vec::new(),
            late_seen: Vec::new(),
        };
        run.wait_for("serve to be ready", Duration::from_secs(90), async |r| {
            r.get("/readyz").await == 200
        })
        .await;
        run.ledger = Some(Arc::new(Ledger::connect(&run.store).await.unwrap()));
        run.bind_events().await;
        for w in &mut run.workers {
            w.spawn();
        }
        // The first job end to end: every worker consumes (one is enough to go on).
        assert_eq!(run.post("warmup").await, 202, "{}", run.logs());
        run.wait_for(
            "the warm-up job to complete",
            Duration::from_secs(90),
            async |r| {
                r.record("warmup")
                    .await
                    .is_some_and(|j| j.state == "completed")
            },
        )
        .await;
        run
    }

    /// Every `interval_ms` one POST, until [`finish`](Self::finish).
    pub fn start_load(&mut self) {
        let stop = CancellationToken::new();
        let (http, base, every, deadline) = (
            self.http.clone(),
            self.base.clone(),
            Duration::from_millis(self.spec.interval_ms),
            self.spec.deadline_ms,
        );
        let scenario = self.scenario.clone();
        let handle = tokio::spawn({
            let stop = stop.clone();
            async move {
                let mut posts = Vec::new();
                let mut tick = tokio::time::interval(every);
                tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                for n in 0.. {
                    tokio::select! {
                        _ = stop.cancelled() => break,
                        _ = tick.tick() => {}
                    }
                    let id = format!("{scenario}-{n:05}");
                    let status = post(&http, &base, &id, deadline).await;
                    posts.push(Post { id, status });
                }
                posts
            }
        });
        self.load = Some(Load { stop, handle });
        // The monitor: the first terminal state of every job, and any change of it.
        let stop = CancellationToken::new();
        let (ledger, seen) = (self.ledger().clone(), self.seen.clone());
        let every = self.spec.monitor_every;
        let handle = tokio::spawn({
            let stop = stop.clone();
            async move {
                while !stop.is_cancelled() {
                    // The ledger may be down (the PostgreSQL scenario): skip a round.
                    if let Ok(recs) = ledger.list(&ListFilter::default()).await {
                        observe(&seen, &recs);
                    }
                    tokio::select! {
                        _ = stop.cancelled() => {}
                        _ = tokio::time::sleep(every) => {}
                    }
                }
            }
        });
        self.monitor = Some((stop, handle));
    }

    /// Let the load run for `d` (the fault's duration, or before/after it).
    pub async fn run_for(&self, d: Duration) {
        tokio::time::sleep(d).await;
    }

    /// The fault is over (the service is back): recovery is measured from now.
    pub fn fault_ended(&mut self) {
        self.fault_end_ms = Some(now_ms());
    }

    pub fn worker_pid(&self, i: usize) -> u32 {
        self.workers[i].pid()
    }

    /// `(name, pid)` of serve and every worker; `None` for a worker killed and not
    /// restarted.
    pub fn pids(&self) -> Vec<(String, Option<u32>)> {
        std::iter::once(&self.serve)
            .chain(&self.workers)
            .map(|p| (p.name.clone(), p.child.as_ref().map(Child::id)))
            .collect()
    }

    /// `http://127.0.0.1:PORT/metrics` of worker `i` (a run with `spec.metrics`).
    pub fn metrics_url(&self, i: usize) -> &str {
        &self.metrics[i]
    }

    /// Jobs published by another producer than the harness's POSTs: `attempted` in all,
    /// `confirmed` those the broker confirmed. [`finish`](Self::finish) accounts for them
    /// like the confirmed POSTs.
    pub fn add_other_producer(&mut self, attempted: usize, confirmed: Vec<String>) {
        self.other_attempted += attempted;
        self.other_confirmed.extend(confirmed);
    }

    /// Late starts found during the run (e.g. in attempt rows that retention prunes before
    /// the end); [`finish`](Self::finish) reports them with its own.
    pub fn note_late_starts(&mut self, ids: impl IntoIterator<Item = String>) {
        self.late_seen.extend(ids);
    }

    /// `kill -SIG` worker `i` (`-STOP`, `-CONT`, …).
    pub fn signal_worker(&self, i: usize, sig: &str) {
        self.workers[i].signal(sig);
    }

    /// SIGKILL worker `i` and reap it.
    pub fn kill_worker(&mut self, i: usize) {
        let w = &mut self.workers[i];
        let mut c = w.child.take().expect("running");
        c.kill().unwrap();
        c.wait().unwrap();
    }

    pub fn restart_worker(&mut self, i: usize) {
        self.workers[i].spawn();
    }

    /// Poll `cond` every 100 ms until it holds; panics with the logs after `within`.
    pub async fn wait_for(
        &self,
        what: &str,
        within: Duration,
        mut cond: impl AsyncFnMut(&Self) -> bool,
    ) {
        let until = Instant::now() + within;
        while !cond(self).await {
            assert!(
                Instant::now() < until,
                "{}: timed out waiting for {what}\n{}",
                self.scenario,
                self.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Wait until `n` jobs are `completed` in the ledger (e.g. before a fault: load flows).
    pub async fn wait_completed(&self, n: usize, within: Duration) {
        self.wait_for(&format!("{n} completed jobs"), within, async |r| {
            r.ledger()
                .list(&ListFilter {
                    state: Some("completed".into()),
                    ..ListFilter::default()
                })
                .await
                .is_ok_and(|l| l.len() >= n)
        })
        .await;
    }

    pub fn logs(&self) -> String {
        std::iter::once(&self.serve)
            .chain(&self.workers)
            .map(Proc::log_tail)
            .collect::<Vec<_>>()
            .join("\n")
    }

    pub fn ledger(&self) -> &Arc<Ledger> {
        self.ledger.as_ref().expect("connected")
    }

    async fn record(&self, id: &str) -> Option<JobRecord> {
        self.ledger().get(id).await.ok().flatten()
    }

    async fn get(&self, path: &str) -> u16 {
        self.http
            .get(format!("{}{path}", self.base))
            .send()
            .await
            .map_or(0, |r| r.status().as_u16())
    }

    async fn post(&self, id: &str) -> u16 {
        post(&self.http, &self.base, id, 60_000).await
    }

    /// A durable queue of this run's own on `{prefix}.events`, read at the end.
    async fn bind_events(&self) {
        let conn = lapin::Connection::connect(&self.events_amqp, Default::default())
            .await
            .unwrap();
        let ch = conn.create_channel().await.unwrap();
        let q = format!("{}.chaos-events", self.prefix);
        ch.queue_declare(
            q.as_str().into(),
            lapin::options::QueueDeclareOptions {
                durable: true,
                ..Default::default()
            },
            Default::default(),
        )
        .await
        .unwrap();
        ch.queue_bind(
            q.as_str().into(),
            format!("{}.events", self.prefix).as_str().into(),
            "#".into(),
            Default::default(),
            Default::default(),
        )
        .await
        .unwrap();
        let _ = conn.close(200, "bound".into()).await;
    }

    /// Drain the run's events queue into the count of outcome events per job (a long run
    /// does this now and then, so that the queue does not grow). `false` when the broker
    /// did not answer (the events stay queued for the next drain).
    pub async fn collect_events(&self) -> bool {
        self.drain_events(false).await
    }

    /// Drain the run's events queue into the count of outcome events per job (then delete
    /// the queue when `delete`).
    async fn drain_events(&self, delete: bool) -> bool {
        let Ok(conn) = lapin::Connection::connect(&self.events_amqp, Default::default()).await
        else {
            return false;
        };
        let mut per_job = HashMap::new();
        let ch = conn.create_channel().await.unwrap();
        let q = format!("{}.chaos-events", self.prefix);
        while let Ok(Some(m)) = ch
            .basic_get(
                q.as_str().into(),
                lapin::options::BasicGetOptions { no_ack: true },
            )
            .await
        {
            if let Some(e) = OutcomeEvent::from_json(&m.delivery.data) {
                *per_job.entry(e.job_id).or_insert(0) += 1;
            }
        }
        if delete {
            let _ = ch.queue_delete(q.as_str().into(), Default::default()).await;
        }
        let _ = conn.close(200, "drained".into()).await;
        let mut all = self.events.lock().unwrap();
        for (id, n) in per_job {
            *all.entry(id).or_insert(0) += n;
        }
        true
    }

    /// Stop the load, wait until every confirmed job has its outcome (or its deadline plus
    /// the grace has passed), compute and print the accounting row, and assert what must
    /// hold: lost = 0, duplicate outcomes = 0, late starts = 0, duplicate model calls
    /// within `duplicate_bound`, a completion after the fault, and no process died.
    pub async fn finish(mut self, duplicate_bound: usize) -> Row {
        let row = self.account(duplicate_bound).await;
        self.check(&row);
        row
    }

    /// [`finish`](Self::finish) without the assertions: stop the load, wait for the
    /// outcomes, compute and print the row (and append it to `LASTCALL_CHAOS_ROWS`).
    pub async fn account(&mut self, duplicate_bound: usize) -> Row {
        let load = self.load.take().expect("start_load was called");
        load.stop.cancel();
        let posts = load.handle.await.unwrap();
        let confirmed: Vec<&Post> = posts.iter().filter(|p| p.status == 202).collect();
        let mut row = Row {
            scenario: self.scenario.clone(),
            attempted: posts.len() + 1 + self.other_attempted,
            confirmed: confirmed.len() + 1 + self.other_confirmed.len(),
            statuses: posts.iter().fold(BTreeMap::new(), |mut m, p| {
                *m.entry(p.status).or_insert(0) += 1;
                m
            }),
            duplicate_bound,
            ..Row::default()
        };
        let mut confirmed_ids: Vec<String> = confirmed.iter().map(|p| p.id.clone()).collect();
        confirmed_ids.push("warmup".into());
        confirmed_ids.extend(self.other_confirmed.iter().cloned());
        // A job the monitor saw end counts as ended even if retention has pruned its row
        // since (its terminal state is what the monitor saw first).
        let seen_ended = |seen: &Mutex<Seen>, id: &str| -> Option<String> {
            seen.lock().unwrap().first.get(id).cloned()
        };
        // Every confirmed job's deadline is at most `deadline_ms` after the last POST.
        let until = Instant::now()
            + Duration::from_millis(self.spec.deadline_ms)
            + self.spec.grace
            + Duration::from_secs(5);
        let recs = loop {
            let recs: HashMap<String, JobRecord> =
                match self.ledger().list(&ListFilter::default()).await {
                    Ok(l) => l.into_iter().map(|r| (r.job_id.clone(), r)).collect(),
                    Err(_) => HashMap::new(),
                };
            let open = confirmed_ids
                .iter()
                .filter(|id| recs.get(*id).is_none_or(|r| !r.is_terminal()))
                .filter(|id| seen_ended(&self.seen, id).is_none())
                .count();
            if (open == 0 && !recs.is_empty()) || Instant::now() > until {
                break recs;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        };
        let (stop, handle) = self.monitor.take().unwrap();
        stop.cancel();
        handle.await.unwrap();
        let all: Vec<JobRecord> = recs.values().cloned().collect();
        observe(&self.seen, &all);
        for id in &confirmed_ids {
            let state = match (recs.get(id), seen_ended(&self.seen, id)) {
                (Some(r), _) if r.is_terminal() => r.state.clone(),
                // Pruned after the monitor saw it end.
                (_, Some(first)) => first,
                (Some(r), None) => r.state.clone(),
                (None, None) => "none".to_owned(),
            };
            let ended = state
                .parse::<lastcall_core::State>()
                .is_ok_and(|s| s.is_terminal());
            if !ended || state == "unknown" {
                row.lost.push(id.clone());
            }
            *row.states.entry(state).or_insert(0) += 1;
        }
        let confirmed_set: std::collections::HashSet<&String> = confirmed_ids.iter().collect();
        row.unconfirmed_recorded = recs.keys().filter(|id| !confirmed_set.contains(id)).count();
        // Late starts: a model call started after the job's deadline.
        for r in recs.values() {
            row.ledger_calls += r.backend_calls;
            let Some(expires) = r.expires_at_ms else {
                continue;
            };
            let attempts = self.ledger().attempts(&r.job_id).await.unwrap();
            if attempts
                .iter()
                .any(|a| a.model_called && a.started_at_ms.is_some_and(|s| s > expires))
            {
                row.late_starts.push(r.job_id.clone());
            }
        }
        row.late_starts.extend(self.late_seen.iter().cloned());
        row.late_starts.sort();
        row.late_starts.dedup();
        // Model calls, from the sim's own log.
        let log = std::fs::read_to_string(&self.calls).unwrap_or_default();
        let mut calls: HashMap<&str, usize> = HashMap::new();
        for l in log.lines() {
            if let Some(id) = l.split(' ').next() {
                *calls.entry(id).or_insert(0) += 1;
            }
        }
        row.model_calls = calls.values().sum();
        row.duplicate_calls = calls.values().map(|n| n.saturating_sub(1)).sum();
        // Duplicate outcomes: a terminal state that changed, or two winning writers.
        self.drain_events(true).await;
        let events = std::mem::take(&mut *self.events.lock().unwrap());
        row.events = events.values().sum();
        let mut dups: Vec<String> = self.seen.lock().unwrap().changed.clone();
        dups.extend(
            events
                .iter()
                .filter(|(_, n)| **n > 1)
                .map(|(id, _)| id.clone()),
        );
        dups.sort();
        dups.dedup();
        row.duplicate_outcomes = dups;
        // Recovery: the fault's end to the first completion of a job delivered after it
        // (calls that ran through the fault and finish at once do not count).
        // (Completions the monitor saw count too: retention may have pruned their rows.)
        let seen_completions = self.seen.lock().unwrap().completions.clone();
        row.recovery_ms = self.fault_end_ms.and_then(|end| {
            recs.values()
                .filter(|r| r.state == "completed")
                .filter_map(|r| Some((r.received_at_ms?, r.recorded_at_ms?)))
                .chain(seen_completions)
                .filter(|(received, _)| *received >= end)
                .map(|(_, recorded)| recorded)
                .min()
                .map(|t| t - end)
        });
        let line = row.markdown();
        println!("{}\n{line}", Row::HEADER);
        if let Some(path) = std::env::var_os("LASTCALL_CHAOS_ROWS") {
            use std::io::Write;
            let mut f = std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(path)
                .unwrap();
            writeln!(f, "{line}").unwrap();
        }
        row
    }

    /// The assertions of [`finish`](Self::finish) on `row`.
    pub fn check(&mut self, row: &Row) {
        let detail = format!("{}\n{row:?}\n{}", row.markdown(), self.logs());
        assert!(
            row.confirmed > 1,
            "no job was confirmed under load\n{detail}"
        );
        assert!(row.lost.is_empty(), "lost jobs: {:?}\n{detail}", row.lost);
        assert!(
            row.duplicate_outcomes.is_empty(),
            "duplicate outcomes: {:?}\n{detail}",
            row.duplicate_outcomes
        );
        assert!(
            row.late_starts.is_empty(),
            "model calls started after the deadline: {:?}\n{detail}",
            row.late_starts
        );
        assert!(
            row.duplicate_calls <= row.duplicate_bound,
            "{} duplicate model calls, bound {}\n{detail}",
            row.duplicate_calls,
            row.duplicate_bound
        );
        if self.fault_end_ms.is_some() {
            assert!(
                row.recovery_ms.is_some(),
                "no job completed after the fault ended\n{detail}"
            );
        }
        for p in std::iter::once(&mut self.serve).chain(&mut self.workers) {
            if p.child.is_some() {
                assert!(p.exited().is_none(), "{} exited\n{detail}", p.name);
            }
        }
    }
}

impl Drop for Run {
    fn drop(&mut self) {
        for p in std::iter::once(&mut self.serve).chain(&mut self.workers) {
            p.kill();
        }
        if let Some(l) = self.load.take() {
            l.handle.abort();
        }
        if let Some((_, h)) = self.monitor.take() {
            h.abort();
        }
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

/// The first terminal state seen per job, and the jobs seen to change it.
#[derive(Default)]
struct Seen {
    first: HashMap<String, String>,
    changed: Vec<String>,
    /// `(received_at_ms, recorded_at_ms)` of every completed job seen (the recovery, also
    /// of completions that retention pruned before the end).
    completions: Vec<(i64, i64)>,
}

fn observe(seen: &Mutex<Seen>, recs: &[JobRecord]) {
    let mut guard = seen.lock().unwrap();
    let Seen {
        first,
        changed,
        completions,
    } = &mut *guard;
    for r in recs.iter().filter(|r| r.is_terminal()) {
        match first.get(&r.job_id) {
            None => {
                first.insert(r.job_id.clone(), r.state.clone());
                if r.state == "completed"
                    && let (Some(rcv), Some(rec)) = (r.received_at_ms, r.recorded_at_ms)
                {
                    completions.push((rcv, rec));
                }
            }
            Some(s) if *s != r.state && !changed.contains(&r.job_id) => {
                changed.push(r.job_id.clone());
            }
            Some(_) => {}
        }
    }
}

async fn post(http: &reqwest::Client, base: &str, id: &str, deadline_ms: u64) -> u16 {
    let body = format!(
        r#"{{"job_id":"{id}","kind":"incident.summary","deadline_ms":{deadline_ms},"payload":{{"messages":[]}}}}"#
    );
    let r = http
        .post(format!("{base}/v1/jobs"))
        .bearer_auth(TOKEN)
        .header("content-type", "application/json")
        .body(body)
        .send()
        .await;
    r.map_or(0, |r| r.status().as_u16())
}
