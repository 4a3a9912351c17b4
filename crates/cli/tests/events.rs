//! Outcome events (`{prefix}.events`) and what waits on them: `GET /v1/jobs/{id}?wait_ms=N`
//! of the real `lastcall serve` binary and `lastcall submit --wait`, against the real
//! broker, a real worker and a real ledger.

use crate::common;

use common::*;
use lastcall_core::OutcomeEvent;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "events-test-token-0123456789";

/// Every event of `env`'s prefix, with its routing key, from a follower that is bound
/// when this returns.
struct Events {
    seen: Arc<Mutex<Vec<(String, OutcomeEvent)>>>,
    stop: CancellationToken,
}

impl Events {
    async fn follow(env: &Env) -> Self {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let bound = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stop = CancellationToken::new();
        let (s, b) = (seen.clone(), bound.clone());
        tokio::spawn(lastcall_broker::events::follow(
            env.broker.clone(),
            env.topo.names.events_exchange.clone(),
            stop.clone(),
            move |key, body| {
                let e = OutcomeEvent::from_json(body).expect("a v1 event body");
                s.lock().unwrap().push((key.to_owned(), e));
            },
            move |following| b.store(following, std::sync::atomic::Ordering::SeqCst),
        ));
        let until = Instant::now() + Duration::from_secs(10);
        while !bound.load(std::sync::atomic::Ordering::SeqCst) {
            assert!(Instant::now() < until, "the events follower did not bind");
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        Self { seen, stop }
    }

    fn of(&self, id: &str) -> Vec<(String, OutcomeEvent)> {
        let seen = self.seen.lock().unwrap();
        seen.iter()
            .filter(|(_, e)| e.job_id == id)
            .cloned()
            .collect()
    }

    /// Wait until `id` has an event; panics after 20 s.
    async fn wait_for(&self, id: &str) -> (String, OutcomeEvent) {
        let until = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(e) = self.of(id).into_iter().next() {
                return e;
            }
            assert!(Instant::now() < until, "no event for {id}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

impl Drop for Events {
    fn drop(&mut self) {
        self.stop.cancel();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_terminal_outcome_is_published_after_its_ledger_write() {
    let env = Env::sqlite("events").await;
    let events = Events::follow(&env).await;
    let w = env
        .start_worker(env.worker_config(2, 4), sim(30), system_clock())
        .await;
    let sub = env.submitter(0, true).await;
    let now = lastcall_worker::clock::now_ms();
    sub.submit(&job("ev-ok", 20_000), now).await.unwrap();
    sub.submit(&job_of_kind("ev-fail", "sim.fail-terminal", 20_000), now)
        .await
        .unwrap();
    let ids = ["ev-ok".to_owned(), "ev-fail".to_owned()];
    let recs = env.wait_terminal(&ids, Duration::from_secs(20)).await;
    for rec in &recs {
        let (key, e) = events.wait_for(&rec.job_id).await;
        assert_eq!(e.state, rec.state, "{e:?}");
        assert_eq!(e.kind, rec.kind);
        assert_eq!(key, format!("{}.{}", rec.state, rec.kind), "routing key");
        assert_eq!(i64::from(e.model_calls), rec.backend_calls, "{e:?}");
        assert_eq!(e.reason, rec.reason);
        assert_eq!(Some(e.recorded_at_ms), rec.recorded_at_ms);
        assert_eq!(e.recorded_by, "test-worker");
    }
    assert_eq!(
        recs.iter().find(|r| r.job_id == "ev-ok").unwrap().state,
        "completed"
    );
    assert_eq!(
        recs.iter().find(|r| r.job_id == "ev-fail").unwrap().state,
        "failed"
    );
    w.stop().await;
    // Exactly one event per outcome, none for the `running` rows before them.
    assert_eq!(events.of("ev-ok").len(), 1);
    assert_eq!(events.of("ev-fail").len(), 1);
    env.cleanup().await;
}

async fn wait_connected(sink: &lastcall_broker::EventSink, what: &str) {
    let until = Instant::now() + Duration::from_secs(10);
    while !sink
        .counts()
        .connected
        .load(std::sync::atomic::Ordering::Relaxed)
    {
        assert!(Instant::now() < until, "{what} did not connect");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// `open()` connects a sink before its first event; without it, the first event does
/// (a flush alone does not).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_opened_event_sink_connects_before_its_first_event() {
    let env = Env::sqlite("sink-open").await;
    let lazy = lastcall_broker::EventSink::spawn(&env.broker, &env.topo.names.events_exchange);
    let opened =
        lastcall_broker::EventSink::spawn(&env.broker, &env.topo.names.events_exchange).open();
    wait_connected(&opened, "the opened sink").await;
    lazy.flush(Duration::from_secs(5)).await;
    let connected = |s: &lastcall_broker::EventSink| {
        s.counts()
            .connected
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    assert!(!connected(&lazy), "a sink connects only at its first event");
    lazy.emit("test.ping".into(), b"{}".to_vec());
    wait_connected(&lazy, "the lazy sink at its first event").await;
    assert_eq!(
        opened
            .counts()
            .published
            .load(std::sync::atomic::Ordering::Relaxed),
        0
    );
    opened.close(Duration::from_secs(5)).await;
    lazy.close(Duration::from_secs(5)).await;
    env.cleanup().await;
}

/// A worker that stops between the durable write and the event (the `pause-after-store`
/// fault, then it is stopped): the outcome is in the ledger, and no event ever announced
/// it — the event never runs ahead of the write, and losing it loses nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_between_the_write_and_the_event_keeps_the_outcome() {
    let env = Env::sqlite("events-crash").await;
    let events = Events::follow(&env).await;
    let mut cfg = env.worker_config(1, 1);
    cfg.fault = Some(lastcall_worker::Fault::PauseAfterStore);
    cfg.shutdown_grace = Duration::from_millis(300);
    let paused = env.start_worker(cfg, sim(20), system_clock()).await;
    let sub = env.submitter(0, true).await;
    let now = lastcall_worker::clock::now_ms();
    sub.submit(&job("crash-1", 20_000), now).await.unwrap();
    let rec = env
        .wait_terminal(&["crash-1".to_owned()], Duration::from_secs(20))
        .await;
    assert_eq!(rec[0].state, "completed");
    // Stopped while paused: its delivery goes back unacked; its sink is closed (flushed).
    paused.stop().await;
    let w = env
        .start_worker(env.worker_config(1, 1), sim(20), system_clock())
        .await;
    // A later job's event arrives through the same exchange and queue: any event of
    // crash-1 was published before it and would have arrived first.
    sub.submit(&job("marker", 20_000), lastcall_worker::clock::now_ms())
        .await
        .unwrap();
    events.wait_for("marker").await;
    assert!(
        events.of("crash-1").is_empty(),
        "{:?}",
        events.of("crash-1")
    );
    let rec = env.ledger.get("crash-1").await.unwrap().unwrap();
    assert_eq!(rec.state, "completed", "the ledger keeps the outcome");
    assert_eq!(rec.backend_calls, 1, "the redelivery made no second call");
    w.stop().await;
    env.cleanup().await;
}

/// `lastcall serve --no-shed` ([`common::serve::Serve`]: `base`, killed on drop) and what
/// these tests ask of it.
struct Serve(common::serve::Serve);

impl std::ops::Deref for Serve {
    type Target = common::serve::Serve;
    fn deref(&self) -> &Self::Target {
        &self.0
    }
}

impl Serve {
    async fn start(env: &Env) -> Self {
        Self::start_with(env, &[], &[]).await
    }

    /// With more flags and environment variables.
    async fn start_with(env: &Env, args: &[&str], vars: &[(&str, &str)]) -> Self {
        let flags: Vec<&str> = std::iter::once("--no-shed")
            .chain(args.iter().copied())
            .collect();
        Self(common::serve::Serve::start_with(env, TOKEN, &flags, vars).await)
    }

    /// `GET {base}{path}` with the token.
    async fn get(&self, http: &reqwest::Client, path: &str) -> reqwest::Response {
        http.get(format!("{}{path}", self.base))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap()
    }

    /// Its `/metrics` text.
    async fn metrics(&self, http: &reqwest::Client) -> String {
        self.get(http, "/metrics").await.text().await.unwrap()
    }

    async fn job_reads(&self, http: &reqwest::Client) -> u64 {
        let text = self.metrics(http).await;
        text.lines()
            .find_map(|l| l.strip_prefix("lastcall_http_job_reads_total "))
            .expect("lastcall_http_job_reads_total in /metrics")
            .trim()
            .parse()
            .unwrap()
    }
}

/// Hundreds of long-polls on one job: each reads the ledger once when it arrives and once
/// when the job's outcome event wakes it — none while it waits. The wake delay after the
/// outcome was recorded is printed and bounded loosely (docs/http-api.md cites 23 ms p50,
/// 32 ms max; asserted: p50 ≤ 1 s, max ≤ 5 s, for a loaded machine — a long-poll that
/// missed the event would answer only at its 60 s `wait_ms`).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn long_polls_wake_on_the_outcome_event_without_polling_the_ledger() {
    const WAITERS: u64 = 200;
    let env = Env::sqlite("longpoll").await;
    let serve = Serve::start(&env).await;
    let http = reqwest::Client::builder()
        .pool_max_idle_per_host(0)
        .build()
        .unwrap();
    let sub = env.submitter(0, true).await;
    sub.submit(&job("lp-1", 60_000), lastcall_worker::clock::now_ms())
        .await
        .unwrap();
    let before = serve.job_reads(&http).await;
    let mut polls = tokio::task::JoinSet::new();
    for _ in 0..WAITERS {
        let (http, url) = (
            http.clone(),
            format!("{}/v1/jobs/lp-1?wait_ms=60000", serve.base),
        );
        polls.spawn(async move {
            let r = http.get(url).bearer_auth(TOKEN).send().await.unwrap();
            let status = r.status().as_u16();
            let body: serde_json::Value = r.json().await.unwrap();
            (status, body, lastcall_worker::clock::now_ms())
        });
    }
    // Every waiter has made its first read (and waits) before the job can run.
    let until = Instant::now() + Duration::from_secs(30);
    while serve.job_reads(&http).await < before + WAITERS {
        assert!(Instant::now() < until, "the long-polls did not all arrive");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let waiting_reads = serve.job_reads(&http).await;
    let w = env
        .start_worker(env.worker_config(1, 1), sim(50), system_clock())
        .await;
    let mut wakes = Vec::new();
    while let Some(r) = polls.join_next().await {
        let (status, body, at_ms) = r.unwrap();
        assert_eq!(status, 200, "{body}");
        assert_eq!(body["state"], "completed", "{body}");
        wakes.push(at_ms - body["recorded_at_ms"].as_i64().unwrap());
    }
    let after = serve.job_reads(&http).await;
    assert_eq!(waiting_reads, before + WAITERS, "no read while waiting");
    assert_eq!(
        after - before,
        2 * WAITERS,
        "one read on arrival and one on the event per long-poll"
    );
    wakes.sort_unstable();
    println!(
        "{WAITERS} long-polls woken after the outcome was recorded: p50 {} ms, max {} ms",
        wakes[wakes.len() / 2],
        wakes[wakes.len() - 1]
    );
    assert!(
        wakes[wakes.len() / 2] <= 1_000 && wakes[wakes.len() - 1] <= 5_000,
        "long-polls woken late after the outcome (ms): {wakes:?}"
    );
    // A long-poll on a terminal job answers at once; on an unknown id it answers 404 at
    // the end of its wait; a bad wait_ms is the documented JSON error naming the field.
    let r = serve.get(&http, "/v1/jobs/lp-1?wait_ms=60000").await;
    assert_eq!(r.status().as_u16(), 200);
    let r = serve.get(&http, "/v1/jobs/nope?wait_ms=200").await;
    assert_eq!(r.status().as_u16(), 404);
    let r = serve.get(&http, "/v1/jobs/lp-1?wait_ms=60001").await;
    assert_eq!(r.status().as_u16(), 400);
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["field"], "wait_ms", "{body}");
    w.stop().await;
    drop(serve);
    env.cleanup().await;
}

/// The binary, off the runtime's threads (the worker under test runs on them).
async fn cli(env: &Env, args: &[&str]) -> std::process::Output {
    let mut c = env.command();
    c.args(args);
    tokio::task::spawn_blocking(move || c.output_bounded().expect("run the lastcall binary"))
        .await
        .unwrap()
}

/// `lastcall submit --kind KIND --prompt hi --deadline-ms MS --no-shed --wait EXTRA…`:
/// its exit status and stdout (stderr appended after a marker, for messages).
async fn submit_wait(
    env: &Env,
    kind: &str,
    deadline_ms: &str,
    extra: &[&str],
) -> (Option<i32>, String) {
    let mut args = vec![
        "submit",
        "--kind",
        kind,
        "--prompt",
        "hi",
        "--deadline-ms",
        deadline_ms,
        "--no-shed",
        "--wait",
    ];
    args.extend_from_slice(extra);
    let out = cli(env, &args).await;
    let text = format!(
        "{}\n--- stderr ---\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.code(), text)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_wait_prints_the_outcome_and_exits_with_its_class() {
    let env = Env::sqlite("submit-wait").await;
    let w = env
        .start_worker(env.worker_config(2, 4), sim(30), system_clock())
        .await;
    let (code, out) = submit_wait(&env, "incident.summary", "20000", &[]).await;
    assert_eq!(code, Some(0), "{out}");
    assert!(out.contains("state: completed"), "{out}");
    assert!(out.contains("model calls: 1"), "{out}");
    let id = out.lines().next().unwrap().trim().to_owned();
    let rec = env.ledger.get(&id).await.unwrap().unwrap();
    let text = rec.result.expect("a result text");
    assert!(out.contains(&text), "the result text is printed: {out}");
    let (code, out) = submit_wait(&env, "sim.fail-terminal", "20000", &[]).await;
    assert_eq!(code, Some(1), "{out}");
    assert!(out.contains("state: failed"), "{out}");
    w.stop().await;
    // Past its deadline with no worker: the broker expires it and the dead-letter
    // processor records it; `--wait` reads that outcome, exit status 3.
    let dlq_stop = CancellationToken::new();
    let dlq = lastcall_worker::dlq::DeadLetterProcessor::build(
        lastcall_broker::Broker::connect(AMQP).await.unwrap(),
        env.ledger.clone(),
        env.topo.clone(),
        system_clock(),
        false,
    )
    .await
    .unwrap();
    // Its sink's connection is opened now, not at its first outcome (which may come only
    // at the first outage, hours later: a step in a long-running process's memory).
    wait_connected(dlq.event_sink(), "the dead-letter processor's event sink").await;
    let dlq_task = tokio::spawn({
        let stop = dlq_stop.clone();
        async move { dlq.run(stop, None).await }
    });
    let (code, out) = submit_wait(
        &env,
        "incident.summary",
        "1500",
        &["--wait-grace-ms", "20000"],
    )
    .await;
    assert_eq!(code, Some(3), "{out}");
    assert!(out.contains("state: expired_before_receive"), "{out}");
    dlq_stop.cancel();
    dlq_task.await.unwrap().unwrap();
    env.cleanup().await;
}

/// Cancelled before any worker had it: `cancelled` at once, announced as an event, and the
/// worker that receives it later acks it without a model call. Cancelling again changes
/// nothing and says so; an unknown id is an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_cancelled_before_its_start_is_never_run() {
    let env = Env::sqlite("cancel-before").await;
    let events = Events::follow(&env).await;
    let sub = env.submitter(0, true).await;
    sub.submit(&job("c-wait", 60_000), lastcall_worker::clock::now_ms())
        .await
        .unwrap();
    let out = cli(&env, &["cancel", "c-wait"]).await;
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        out.status.code(),
        Some(0),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("cancelled before it started"), "{stdout}");
    let (key, e) = events.wait_for("c-wait").await;
    assert_eq!(
        (key.as_str(), e.model_calls),
        ("cancelled.incident.summary", 0)
    );
    let w = env
        .start_worker(env.worker_config(1, 2), sim(20), system_clock())
        .await;
    let until = Instant::now() + Duration::from_secs(20);
    while w.stats.duplicates.load(std::sync::atomic::Ordering::SeqCst) < 1 {
        assert!(
            Instant::now() < until,
            "the worker never settled the cancelled job"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        w.stats
            .backend_calls
            .load(std::sync::atomic::Ordering::SeqCst),
        0
    );
    let rec = env.ledger.get("c-wait").await.unwrap().unwrap();
    assert_eq!(
        (rec.state.as_str(), rec.reason.as_deref(), rec.backend_calls),
        ("cancelled", Some("cancelled_before_start"), 0)
    );
    let out = cli(&env, &["cancel", "c-wait"]).await;
    assert_eq!(out.status.code(), Some(3));
    assert!(
        String::from_utf8_lossy(&out.stdout).contains("already ended (cancelled); nothing changed")
    );
    let out = cli(&env, &["cancel", "no-such-job"]).await;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("no job `no-such-job`"));
    w.stop().await;
    env.cleanup().await;
}

/// A job waiting in the worker's buffer for a slot and a job whose call runs: both stop
/// on `DELETE /v1/jobs/{id}` of the real `serve` binary — the waiting one with no model
/// call, the running one aborted through the backend's cancellation (confirmed).
/// With a worker of one slot: `running`'s 60 s call holds the slot, then `waiting` waits
/// for it in the buffer (submitted one after the other: two jobs received together race
/// for a free slot). Both have 120 s budgets.
async fn one_running_one_waiting(env: &Env, w: &Running, running: &str, waiting: &str) {
    let sub = env.submitter(0, true).await;
    let long = |id: &str| {
        job_with(
            id,
            120_000,
            serde_json::json!({"prompt": "x", "sim_latency_ms": 60_000}),
        )
    };
    let now = lastcall_worker::clock::now_ms();
    sub.submit(&long(running), now).await.unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while env.ledger.get(running).await.unwrap().unwrap().state != "running" {
        assert!(Instant::now() < until, "{running} did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    sub.submit(&long(waiting), now).await.unwrap();
    while w.stats.waiting.load(std::sync::atomic::Ordering::SeqCst) < 1 {
        assert!(Instant::now() < until, "{waiting} did not wait");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// A job cancelled before its start while it waits in a worker's buffer, with no
/// broadcast (lost, or the follower not yet subscribed): the worker's sweep of the ledger
/// finds the request within its period and the job leaves the buffer without a call,
/// while the one slot stays busy (not at its slot, where it would be called).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_waiting_job_cancelled_without_a_broadcast_leaves_the_buffer_uncalled() {
    let env = Env::sqlite("cancel-sweep").await;
    let w = env
        .start_worker(env.worker_config(1, 4), sim(20), system_clock())
        .await;
    one_running_one_waiting(&env, &w, "s-run", "s-waiting").await;
    // The ledger alone: no broadcast on the control exchange.
    env.ledger
        .cancel("s-waiting", lastcall_worker::clock::now_ms())
        .await
        .unwrap();
    let until = Instant::now() + Duration::from_secs(15);
    while w.stats.waiting.load(std::sync::atomic::Ordering::SeqCst) != 0 {
        assert!(Instant::now() < until, "s-waiting still waits");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let rec = env.ledger.get("s-waiting").await.unwrap().unwrap();
    assert_eq!(rec.state, "cancelled", "{rec:?}");
    assert_eq!(rec.backend_calls, 0, "{rec:?}");
    assert_eq!(
        env.ledger.get("s-run").await.unwrap().unwrap().state,
        "running",
        "the slot stayed busy"
    );
    w.stop().await;
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cancelling_over_http_stops_a_waiting_and_a_running_job() {
    let env = Env::sqlite("cancel-http").await;
    let serve = Serve::start(&env).await;
    let http = reqwest::Client::new();
    let w = env
        .start_worker(env.worker_config(1, 4), sim(20), system_clock())
        .await;
    one_running_one_waiting(&env, &w, "c-run", "c-buffered").await;
    let delete = async |id: &str| {
        let r = http
            .delete(format!("{}/v1/jobs/{id}", serve.base))
            .bearer_auth(TOKEN)
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().await.unwrap(),
        )
    };
    let (status, body) = delete("c-buffered").await;
    assert_eq!(status, 200, "{body}");
    assert_eq!(body["state"], "cancelled", "{body}");
    let (status, body) = delete("c-run").await;
    assert_eq!(status, 202, "{body}");
    assert_eq!(body["cancel_requested"], true, "{body}");
    // The long-poll returns the running job's outcome once its worker recorded it.
    let r = serve.get(&http, "/v1/jobs/c-run?wait_ms=20000").await;
    let rec: serde_json::Value = r.json().await.unwrap();
    assert_eq!(rec["state"], "cancelled", "{rec}");
    assert_eq!(rec["reason"], "cancel_requested", "{rec}");
    assert_eq!(rec["cancel_confirmed"], true, "{rec}");
    assert_eq!(rec["backend_calls"], 1, "{rec}");
    // The buffered one left the buffer without a call (the worker acked it).
    let until = Instant::now() + Duration::from_secs(20);
    while w.stats.waiting.load(std::sync::atomic::Ordering::SeqCst) != 0
        || env
            .ledger
            .get("c-buffered")
            .await
            .unwrap()
            .unwrap()
            .backend_calls
            != 0
    {
        assert!(Instant::now() < until, "c-buffered still waits");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(
        w.stats
            .backend_calls
            .load(std::sync::atomic::Ordering::SeqCst),
        1
    );
    let (status, body) = delete("c-run").await;
    assert_eq!(status, 409, "{body}");
    assert_eq!(
        (body["error"].as_str(), body["state"].as_str()),
        (Some("already_terminal"), Some("cancelled"))
    );
    w.stop().await;
    drop(serve);
    env.cleanup().await;
}

/// The worker's `/readyz` (`--metrics-addr`) names the retry publisher's connection beside
/// the consumer's and the ledger's, refreshed with the lease.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_workers_readyz_checks_its_retry_publisher() {
    let env = Env::sqlite("readyz").await;
    let w = env
        .start_worker(env.worker_config(1, 2), sim(20), system_clock())
        .await;
    let stop = CancellationToken::new();
    let addr = lastcall_http::listen(
        "127.0.0.1:0".parse().unwrap(),
        lastcall_http::metrics_app(
            lastcall_http::MetricsSource::default()
                .with_ready({
                    let stats = w.stats.clone();
                    move || stats.readiness()
                })
                .with_collector(lastcall_worker::stats::WorkerCollector(w.stats.clone())),
        ),
        stop.clone(),
        None,
    )
    .await
    .unwrap()
    .addr;
    let until = Instant::now() + Duration::from_secs(20);
    let body = loop {
        let r = reqwest::get(format!("http://{addr}/readyz")).await.unwrap();
        let status = r.status().as_u16();
        let body: serde_json::Value = r.json().await.unwrap();
        if status == 200 {
            break body;
        }
        assert!(
            Instant::now() < until,
            "the worker never became ready: {body}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_eq!(body["checks"]["retry_publisher"], true, "{body}");
    assert_eq!(body["checks"]["broker"], true, "{body}");
    w.stop().await;
    stop.cancel();
    env.cleanup().await;
}

/// A webhook receiver on a real socket: answers each request with the next status of
/// `script` (the last one after that), and keeps what it got.
struct Receiver {
    port: u16,
    got: Arc<Mutex<Vec<Request>>>,
}

/// One request as the receiver got it: the lower-cased head, and the body.
type Request = (String, Vec<u8>);

impl Receiver {
    async fn start(script: Vec<u16>) -> Self {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let port = listener.local_addr().unwrap().port();
        let got = Arc::new(Mutex::new(Vec::new()));
        let seen = got.clone();
        tokio::spawn(async move {
            loop {
                let Ok((mut sock, _)) = listener.accept().await else {
                    return;
                };
                let mut buf = Vec::new();
                let mut chunk = [0u8; 4096];
                // Headers, then Content-Length bytes of body.
                let (head, body) = loop {
                    let n = sock.read(&mut chunk).await.unwrap_or(0);
                    if n == 0 {
                        break (String::new(), Vec::new());
                    }
                    buf.extend_from_slice(&chunk[..n]);
                    let Some(end) = buf.windows(4).position(|w| w == b"\r\n\r\n") else {
                        continue;
                    };
                    let head = String::from_utf8_lossy(&buf[..end]).to_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| l.strip_prefix("content-length:"))
                        .and_then(|v| v.trim().parse::<usize>().ok())
                        .unwrap_or(0);
                    while buf.len() < end + 4 + len {
                        let n = sock.read(&mut chunk).await.unwrap_or(0);
                        if n == 0 {
                            break;
                        }
                        buf.extend_from_slice(&chunk[..n]);
                    }
                    break (head, buf[end + 4..].to_vec());
                };
                let status = {
                    let mut g = seen.lock().unwrap();
                    g.push((head, body));
                    script
                        .get(g.len() - 1)
                        .or(script.last())
                        .copied()
                        .unwrap_or(200)
                };
                let reply = format!(
                    "HTTP/1.1 {status} X\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
                );
                let _ = sock.write_all(reply.as_bytes()).await;
                let _ = sock.shutdown().await;
            }
        });
        Self { port, got }
    }

    fn count(&self) -> usize {
        self.got.lock().unwrap().len()
    }
}

/// A job with a `callback_url` under the allowed prefix: its outcome event is POSTed there,
/// signed, retried after two 500s, and every attempt is in the ledger. URLs outside the
/// allow-list are refused at the ingress, naming the field.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_are_signed_retried_recorded_and_allow_listed() {
    const KEY: &str = "webhook-test-key-0123456789abcdef0123";
    let env = Env::sqlite("webhooks").await;
    let receiver = Receiver::start(vec![500, 500, 200]).await;
    let allow = format!("http://127.0.0.1:{}/hooks/", receiver.port);
    // A receiver that never takes one: its delivery is given up after the attempts.
    let refuser = Receiver::start(vec![500]).await;
    let allow_refuser = format!("http://127.0.0.1:{}/hooks/", refuser.port);
    let serve = Serve::start_with(
        &env,
        &[
            "--webhook-allow",
            &allow,
            "--webhook-allow",
            &allow_refuser,
            "--webhook-attempts",
            "3",
        ],
        &[("LASTCALL_WEBHOOK_KEY", KEY)],
    )
    .await;
    let http = reqwest::Client::new();
    let post = async |body: serde_json::Value| {
        let r = http
            .post(format!("{}/v1/jobs", serve.base))
            .bearer_auth(TOKEN)
            .json(&body)
            .send()
            .await
            .unwrap();
        (
            r.status().as_u16(),
            r.json::<serde_json::Value>().await.unwrap(),
        )
    };
    let job = |id: &str, url: &str| {
        serde_json::json!({"job_id": id, "kind": "incident.summary", "deadline_ms": 60000,
            "payload": {"prompt": "x"}, "callback_url": url})
    };
    for refused in [
        format!("http://127.0.0.1:{}/elsewhere", receiver.port),
        format!("http://127.0.0.1:{}/hooks/x", receiver.port + 1),
        "https://hooks.example.com/hooks/".to_owned(),
    ] {
        let (status, body) = post(job("wh-refused", &refused)).await;
        assert_eq!(status, 422, "{refused}: {body}");
        assert_eq!(body["field"], "callback_url", "{body}");
        assert_eq!(body["error"], "callback_not_allowed", "{body}");
    }
    assert!(
        env.ledger.get("wh-refused").await.unwrap().is_none(),
        "nothing accepted"
    );
    let (status, body) = post(job("wh-1", &format!("{allow}wh-1"))).await;
    assert_eq!(status, 202, "{body}");
    let w = env
        .start_worker(env.worker_config(1, 2), sim(20), system_clock())
        .await;
    let until = Instant::now() + Duration::from_secs(30);
    while env
        .ledger
        .webhook_attempts("wh-1")
        .await
        .unwrap()
        .last()
        .is_none_or(|a| a.error.is_some())
    {
        assert!(
            Instant::now() < until,
            "not delivered: {:?}",
            env.ledger.webhook_attempts("wh-1").await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let attempts = env.ledger.webhook_attempts("wh-1").await.unwrap();
    let statuses: Vec<Option<i64>> = attempts.iter().map(|a| a.status).collect();
    assert_eq!(statuses, [Some(500), Some(500), Some(200)], "{attempts:?}");
    assert!(attempts[0].error.is_some() && attempts[2].error.is_none());
    assert!(
        attempts[1].at_ms - attempts[0].at_ms >= 1_000,
        "backoff: {attempts:?}"
    );
    assert_eq!(receiver.count(), 3);
    let key = lastcall_core::SigningKey::new(KEY).unwrap();
    for (head, body) in receiver.got.lock().unwrap().iter() {
        let e = OutcomeEvent::from_json(body).expect("the body is the outcome event");
        assert_eq!((e.job_id.as_str(), e.state.as_str()), ("wh-1", "completed"));
        let sig = lastcall_core::signature::sign_body(&key, body);
        assert!(
            head.contains(&format!("x-lastcall-webhook-signature: {sig}")),
            "signed: {head}"
        );
        assert!(head.starts_with("post /hooks/wh-1 "), "{head}");
    }

    // Issue #35: a delivery that used up its attempts is recorded as given up, and no
    // longer holds its job against retention; a delivered one never did.
    let far = system_clock().now_ms() + 86_400_000;
    let (status, body) = post(job("wh-2", &format!("{allow_refuser}wh-2"))).await;
    assert_eq!(status, 202, "{body}");
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let tried = env.ledger.webhook_attempts("wh-2").await.unwrap();
        if tried.len() == 3 && env.ledger.held_by_webhooks(far).await.unwrap() == 0 {
            assert!(tried.iter().all(|a| a.status == Some(500)), "{tried:?}");
            break;
        }
        assert!(
            Instant::now() < until,
            "not given up: {tried:?}, held {:?}",
            env.ledger.held_by_webhooks(far).await
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(refuser.count(), 3, "--webhook-attempts 3");
    let pruned = env.ledger.prune_batch(far, 100, None).await.unwrap();
    assert_eq!((pruned.jobs, pruned.webhooks), (2, 2), "{pruned:?}");
    assert!(env.ledger.get("wh-2").await.unwrap().is_none());
    w.stop().await;
    drop(serve);
    env.cleanup().await;
}

/// The official `openai` Python SDK (PyPI, pinned by scripts/setup-python-example.sh)
/// against the front door: one JSON line per call.
const SDK_CLIENT: &str = r#"
import json, sys, openai
base, token, case = sys.argv[1], sys.argv[2], sys.argv[3]
def client(**kw):
    return openai.OpenAI(base_url=base + "/v1", api_key=token, **kw)
msgs = [{"role": "user", "content": "Summarise db-7's alerts."}]
def out(**kw):
    print(json.dumps(kw), flush=True)
try:
    if case == "complete":
        r = client(timeout=20.0).chat.completions.with_raw_response.create(model="m", messages=msgs)
        c = r.parse()
        out(job=r.headers.get("x-lastcall-job-id"), state=r.headers.get("x-lastcall-state"),
            text=c.choices[0].message.content, usage=c.usage.total_tokens)
    elif case == "idempotent":
        ids = []
        for _ in range(2):
            r = client(timeout=20.0).chat.completions.with_raw_response.create(
                model="m", messages=msgs, extra_headers={"Idempotency-Key": "fd-idem"})
            ids.append((r.headers.get("x-lastcall-job-id"), r.parse().choices[0].message.content))
        out(ids=ids)
    elif case == "expired":
        client(timeout=10.0).chat.completions.create(
            model="m", messages=msgs, extra_headers={"X-Lastcall-Deadline-Ms": "1500"})
        out(unexpected="completed")
    elif case == "disconnect":
        client(timeout=1.0, max_retries=0).chat.completions.create(
            model="m", messages=msgs, extra_headers={"X-Lastcall-Deadline-Ms": "60000",
            "Idempotency-Key": "fd-gone"}, extra_body={"sim_latency_ms": 30000})
        out(unexpected="completed")
    elif case in ("stream", "stream-model"):
        extra = {"sim_latency_ms": 600} if case == "stream" else {"max_tokens": 16}
        r = client(timeout=60.0).chat.completions.with_raw_response.create(
            model="m", messages=msgs, stream=True, stream_options={"include_usage": True},
            extra_body=extra)
        chunks = [c.model_dump() for c in r.parse()]
        content = [c["choices"][0]["delta"].get("content") for c in chunks if c["choices"]]
        out(job=r.headers.get("x-lastcall-job-id"), type=r.headers.get("content-type"),
            role=chunks[0]["choices"][0]["delta"].get("role"),
            pieces=[t for t in content if t], text="".join(t for t in content if t),
            finish=[c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1],
            usage=chunks[-1]["usage"] and chunks[-1]["usage"]["total_tokens"],
            objects=sorted({c["object"] for c in chunks}))
    elif case == "stream-raw":
        import urllib.request
        req = urllib.request.Request(base + "/v1/chat/completions", method="POST",
            data=json.dumps({"model": "m", "messages": msgs, "stream": True}).encode(),
            headers={"Authorization": "Bearer " + token, "Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=20) as resp:
            lines = [l.decode().rstrip("\n") for l in resp]
        out(status=resp.status, data=[l for l in lines if l.startswith("data: ")])
    elif case == "stream-disconnect":
        s = client(timeout=30.0, max_retries=0).chat.completions.create(
            model="m", messages=msgs, stream=True, extra_headers={"Idempotency-Key": "fd-stream-gone"},
            extra_body={"sim_latency_ms": 20000})
        for c in s:
            if c.choices and c.choices[0].delta.content:
                break
        s.close()
        out(closed=True)
    elif case == "stream-expired":
        s = client(timeout=10.0).chat.completions.create(
            model="m", messages=msgs, stream=True, extra_headers={"X-Lastcall-Deadline-Ms": "1500"})
        out(unexpected=[c.model_dump() for c in s])
    elif case == "unknown-model":
        client().chat.completions.create(model="nope", messages=msgs)
    elif case == "models":
        out(models=[m.id for m in client().models.list()])
except openai.APIStatusError as e:
    out(status=e.status_code, body=e.body, job=e.response.headers.get("x-lastcall-job-id"),
        retry=e.response.headers.get("x-should-retry"))
except openai.APITimeoutError:
    out(timeout=True)
"#;

async fn sdk(script: &std::path::Path, base: &str, case: &str) -> serde_json::Value {
    let mut c = std::process::Command::new(example_python("openai"));
    c.arg(script).args([base, TOKEN, case]);
    let out = tokio::task::spawn_blocking(move || c.output().unwrap())
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or("")).unwrap_or_else(|e| {
        panic!(
            "{case}: {e}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

/// The counter of front-door responses with `status`, from `/metrics`.
async fn front_door_responses(serve: &Serve, status: u16) -> u64 {
    let text = serve.metrics(&reqwest::Client::new()).await;
    text.lines()
        .filter(|l| {
            l.starts_with("lastcall_http_responses_total")
                && l.contains("/v1/chat/completions")
                && l.contains(&format!("\"{status}\""))
        })
        .filter_map(|l| l.rsplit(' ').next()?.parse::<u64>().ok())
        .sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_gets_answers_deadlines_and_cancellation_through_the_front_door() {
    let env = Env::sqlite("front-door").await;
    let serve = Serve::start_with(&env, &["--model", "m=incident.summary"], &[]).await;
    let script = env.dir.join("sdk.py");
    std::fs::write(&script, SDK_CLIENT).unwrap();
    let w = env
        .start_worker(env.worker_config(1, 4), sim(20), system_clock())
        .await;
    let base = serve.base.clone();

    // A completion with usage; the SDK's own timeout (20 s) is the job's deadline.
    let r = sdk(&script, &base, "complete").await;
    assert_eq!(r["state"], "completed", "{r}");
    assert!(r["usage"].as_u64().unwrap() > 0, "{r}");
    let rec = env
        .ledger
        .get(r["job"].as_str().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.result.as_deref(), r["text"].as_str());
    assert_eq!(
        rec.expires_at_ms.unwrap() - rec.created_at_ms.unwrap(),
        20_000,
        "{rec:?}"
    );
    assert_eq!(rec.kind, "incident.summary");

    // The same Idempotency-Key twice: one job, one model call.
    let r = sdk(&script, &base, "idempotent").await;
    assert_eq!(r["ids"][0], r["ids"][1], "{r}");
    assert_eq!(
        env.ledger
            .get("fd-idem")
            .await
            .unwrap()
            .unwrap()
            .backend_calls,
        1
    );

    // Models: the mapped ones; another is a 404 in OpenAI's shape.
    let r = sdk(&script, &base, "models").await;
    assert_eq!(r["models"], serde_json::json!(["m"]), "{r}");
    let r = sdk(&script, &base, "unknown-model").await;
    assert_eq!(r["status"], 404, "{r}");
    assert_eq!(r["body"]["code"], "model_not_found", "{r}");

    // A client that gives up (its 1 s timeout, no retries) cancels its job.
    let r = sdk(&script, &base, "disconnect").await;
    assert_eq!(r["timeout"], true, "{r}");
    let rec = env
        .wait_terminal(&["fd-gone".to_owned()], Duration::from_secs(20))
        .await
        .remove(0);
    assert_eq!(rec.state, "cancelled", "{rec:?}");

    // Overloaded (the one slot busy for 30 s): the job expires in the buffer and the SDK
    // gets one prompt deadline_expired answer — no retry, no model call.
    sub_long(&env, "fd-busy").await;
    let until = Instant::now() + Duration::from_secs(20);
    while env.ledger.get("fd-busy").await.unwrap().unwrap().state != "running" {
        assert!(Instant::now() < until, "fd-busy did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let before = front_door_responses(&serve, 504).await;
    let r = sdk(&script, &base, "expired").await;
    assert_eq!(r["status"], 504, "{r}");
    assert_eq!(r["body"]["type"], "deadline_expired", "{r}");
    assert_eq!(r["retry"], "false", "{r}");
    assert_eq!(
        front_door_responses(&serve, 504).await - before,
        1,
        "the SDK asked once"
    );
    let rec = env
        .ledger
        .get(r["job"].as_str().unwrap())
        .await
        .unwrap()
        .unwrap();
    assert_eq!(
        (rec.state.as_str(), rec.backend_calls),
        ("expired_not_started", 0),
        "{rec:?}"
    );
    w.stop().await;
    drop(serve);
    env.cleanup().await;
}

/// `stream: true` through the front door (the sim backend streams its text in a few
/// deltas over direct reply-to): the SDK's chunks carry exactly the ledger's text, the raw
/// event stream ends in `data: [DONE]`, a client that leaves mid-stream cancels its job,
/// and an expiry before the first byte is a plain 504.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_streams_exactly_the_ledgers_text() {
    let env = Env::sqlite("front-door-stream").await;
    let serve = Serve::start_with(&env, &["--model", "m=incident.summary"], &[]).await;
    let script = env.dir.join("sdk.py");
    std::fs::write(&script, SDK_CLIENT).unwrap();
    let w = env
        .start_worker(env.worker_config(1, 4), sim(300), system_clock())
        .await;
    let base = serve.base.clone();

    let r = sdk(&script, &base, "stream").await;
    let rec = env
        .ledger
        .get(r["job"].as_str().expect("x-lastcall-job-id"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.state, "completed", "{rec:?}");
    assert_eq!(rec.result.as_deref(), r["text"].as_str(), "{r}");
    assert!(
        r["pieces"].as_array().unwrap().len() > 3,
        "streamed in deltas: {r}"
    );
    assert_eq!(r["role"], "assistant", "{r}");
    assert_eq!(r["finish"], "stop", "{r}");
    assert!(r["usage"].as_u64().unwrap() > 0, "{r}");
    assert_eq!(r["objects"], serde_json::json!(["chat.completion.chunk"]));
    assert!(r["type"].as_str().unwrap().starts_with("text/event-stream"));

    let r = sdk(&script, &base, "stream-raw").await;
    let data: Vec<&str> = r["data"]
        .as_array()
        .unwrap()
        .iter()
        .map(|d| d.as_str().unwrap())
        .collect();
    assert_eq!(data.last(), Some(&"data: [DONE]"), "{r}");
    let mut text = String::new();
    for d in &data[..data.len() - 1] {
        let v: serde_json::Value = serde_json::from_str(&d["data: ".len()..]).unwrap();
        if let Some(t) = v["choices"][0]["delta"]["content"].as_str() {
            text.push_str(t);
        }
    }
    let id = serde_json::from_str::<serde_json::Value>(&data[0]["data: ".len()..]).unwrap()["id"]
        .as_str()
        .unwrap()
        .trim_start_matches("chatcmpl-")
        .to_owned();
    let rec = env.ledger.get(&id).await.unwrap().unwrap();
    assert_eq!(rec.result.as_deref(), Some(text.as_str()), "{r}");

    // A client that closes the stream after its first content chunk cancels the job.
    let r = sdk(&script, &base, "stream-disconnect").await;
    assert_eq!(r["closed"], true, "{r}");
    let rec = env
        .wait_terminal(&["fd-stream-gone".to_owned()], Duration::from_secs(30))
        .await
        .remove(0);
    assert_eq!(rec.state, "cancelled", "{rec:?}");

    // The one slot busy: the job expires before any byte was sent, so the SDK gets the
    // non-streaming 504 deadline_expired.
    sub_long(&env, "fd-stream-busy").await;
    let until = Instant::now() + Duration::from_secs(20);
    while env
        .ledger
        .get("fd-stream-busy")
        .await
        .unwrap()
        .unwrap()
        .state
        != "running"
    {
        assert!(Instant::now() < until, "fd-stream-busy did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let r = sdk(&script, &base, "stream-expired").await;
    assert_eq!(r["status"], 504, "{r}");
    assert_eq!(r["body"]["type"], "deadline_expired", "{r}");
    w.stop().await;
    drop(serve);
    env.cleanup().await;
}

/// `stream: true` through a worker with the OpenAI-compatible backend against a real
/// llama.cpp server (llama.cpp's C++ `llama-server`, SmolLM2-135M, `scripts/llama-server.sh`): the
/// server's streamed chunks reach the SDK as deltas, and their text is the ledger's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_streams_a_real_llama_cpp_generation() {
    let (_server, base_url) = common::llama::LlamaServer::start(&[]);
    let backend = Arc::new(
        lastcall_openai::OpenAiBackend::new(
            lastcall_openai::OpenAiConfig::new(&base_url, "smollm2").with_max_tokens(16),
        )
        .unwrap(),
    );
    let env = Env::sqlite("front-door-llama").await;
    let serve = Serve::start_with(&env, &["--model", "m=incident.summary"], &[]).await;
    let script = env.dir.join("sdk.py");
    std::fs::write(&script, SDK_CLIENT).unwrap();
    let w = env
        .start_worker(env.worker_config(1, 2), backend, system_clock())
        .await;
    let r = sdk(&script, &serve.base, "stream-model").await;
    let rec = env
        .ledger
        .get(r["job"].as_str().expect("x-lastcall-job-id"))
        .await
        .unwrap()
        .unwrap();
    assert_eq!(rec.state, "completed", "{rec:?}");
    assert_eq!(rec.result.as_deref(), r["text"].as_str(), "{r}");
    assert!(
        r["pieces"].as_array().unwrap().len() > 1,
        "the server's chunks arrive as deltas: {r}"
    );
    assert_eq!(r["finish"], "stop", "{r}");
    w.stop().await;
    drop(serve);
    env.cleanup().await;
}

async fn sub_long(env: &Env, id: &str) {
    env.submitter(0, true)
        .await
        .submit(
            &job_with(
                id,
                120_000,
                serde_json::json!({"prompt": "x", "sim_latency_ms": 30_000}),
            ),
            lastcall_worker::clock::now_ms(),
        )
        .await
        .unwrap();
}
