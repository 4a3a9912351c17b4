//! The worker rides through a lost broker connection: a loopback proxy between the worker
//! and the shared RabbitMQ cuts every connection (what a broker restart or a reset looks
//! like from the client) while calls run and jobs wait. The shared broker itself is never
//! touched. Nothing is lost, nothing runs twice, and the worker resumes by itself.

use crate::common;

use common::http::curl;
use common::proxy::FreezableProxy;
use common::*;
use lastcall_broker::Broker;
use lastcall_worker::clock::now_ms;
use lastcall_worker::{Worker, WorkerStats};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio_util::sync::CancellationToken;

async fn wait_for(what: &str, timeout: Duration, mut cond: impl FnMut() -> bool) {
    let until = Instant::now() + timeout;
    while !cond() {
        assert!(Instant::now() < until, "timed out waiting for: {what}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_lost_connection_loses_nothing_and_runs_nothing_twice() {
    let env = Env::sqlite("reconnect").await;
    let proxy = FreezableProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let url = format!("amqp://guest:guest@{}/%2f", proxy.addr);
    let sim = sim(1_500);
    let stats = Arc::new(WorkerStats::default());
    let worker = Worker::build(
        env.worker_config(2, 8),
        Broker::connect(&url).await.unwrap(),
        env.ledger.clone(),
        sim.clone(),
        system_clock(),
        stats.clone(),
    )
    .await
    .unwrap();
    let stop = CancellationToken::new();
    let handle = tokio::spawn(worker.run(stop.clone()));

    // Two calls running, four jobs waiting for a slot.
    let s = env.submitter(100, true).await;
    let ids: Vec<String> = (0..6).map(|i| format!("rc-{i}")).collect();
    for id in &ids {
        s.submit(&job(id, 60_000), now_ms()).await.unwrap();
    }
    wait_for(
        "two running calls and waiting jobs",
        Duration::from_secs(15),
        || stats.running.load(Ordering::Relaxed) == 2 && stats.waiting.load(Ordering::Relaxed) >= 1,
    )
    .await;

    // The connection drops, and the proxy refuses new ones for a moment (backoff).
    proxy.refuse(true);
    proxy.reset();
    wait_for("the worker notices", Duration::from_secs(10), || {
        WorkerStats::get(&stats.reconnects) >= 1
    })
    .await;
    assert!(!handle.is_finished(), "the worker keeps running");
    // The node stays down until it has refused the worker's reconnection twice.
    wait_for("two refused reconnections", Duration::from_secs(30), || {
        proxy.refused() >= 2
    })
    .await;
    proxy.refuse(false);

    // Every job ends completed, with exactly one model call each, and the queue is empty
    // (the redeliveries of the calls that were running are acked as duplicates).
    let recs = env.wait_terminal(&ids, Duration::from_secs(60)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
        assert_eq!(r.backend_calls, 1, "{r:?}");
        assert_eq!(sim.calls_for(&r.job_id), 1, "{}: one model call", r.job_id);
    }
    let until = Instant::now() + Duration::from_secs(20);
    loop {
        let ready = env.ready(&env.topo.names.work_queue).await;
        let depth = lastcall_broker::topology::queue_depth(&env.broker, &env.topo.names.work_queue)
            .await
            .unwrap();
        if ready == 0 && depth.is_some_and(|(_, consumers)| consumers == 1) {
            break;
        }
        assert!(
            Instant::now() < until,
            "the queue drains and the worker consumes again: ready {ready}, {depth:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Work submitted after the outage runs too.
    s.submit(&job("rc-after", 60_000), now_ms()).await.unwrap();
    let r = env
        .wait_terminal(&["rc-after".into()], Duration::from_secs(20))
        .await;
    assert_eq!(r[0].state, "completed");
    assert_eq!(WorkerStats::get(&stats.task_panics), 0);
    stop.cancel();
    handle.await.unwrap().unwrap();
    env.cleanup().await;
}

const TOKEN: &str = "reconnect-serve-token-0123456789";

fn post_job(base: &str, id: &str) -> (u16, String) {
    common::http::post_job(base, TOKEN, id, 60_000)
}

/// `lastcall serve` through a broker outage: while the broker is gone, `POST /v1/jobs`
/// answers 503 promptly and `/readyz` says the broker is down (`/healthz` stays 200: the
/// process is alive); once the broker is back, serve accepts jobs again by itself, well
/// within 15 s, and `/readyz` is 200 again. Its `--dlq` task reconnects too.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_accepts_jobs_again_after_the_broker_comes_back() {
    let env = Env::sqlite("reconnect-serve").await;
    let proxy = FreezableProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base = format!("http://127.0.0.1:{port}");
    let mut serve = env
        .command_with_amqp(&format!("amqp://guest:guest@{}/%2f", proxy.addr))
        .args([
            "serve",
            "--addr",
            &format!("127.0.0.1:{port}"),
            "--confirm-timeout-ms",
            "2000",
            "--no-management",
            "--dlq",
        ])
        .env("LASTCALL_HTTP_TOKEN", TOKEN)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(30);
    while curl(&[&format!("{base}/readyz")]).0 != 200 {
        assert!(Instant::now() < until, "serve never became ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(post_job(&base, "before").0, 202);

    // The broker goes away (every connection cut, new ones refused).
    proxy.refuse(true);
    proxy.reset();
    let until = Instant::now() + Duration::from_secs(10);
    let (code, body) = loop {
        let r = curl(&[&format!("{base}/readyz")]);
        if r.0 == 503 {
            break r;
        }
        assert!(
            Instant::now() < until,
            "/readyz never reported the outage: {r:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(code, 503);
    assert!(body.contains("broker"), "{body}");
    assert_eq!(curl(&[&format!("{base}/healthz")]).0, 200, "alive");
    let t = Instant::now();
    let (code, body) = post_job(&base, "during");
    assert_eq!(code, 503, "{body}");
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "503 promptly, not after a timeout"
    );
    assert!(
        env.ledger.get("during").await.unwrap().is_none(),
        "a 503 leaves nothing accepted"
    );

    // The broker is back: serve accepts again by itself, within 15 s.
    proxy.refuse(false);
    let back = Instant::now();
    loop {
        let (code, body) = post_job(&base, "after");
        if code == 202 {
            break;
        }
        assert!(
            back.elapsed() < Duration::from_secs(15),
            "serve did not accept jobs again: {code} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let until = Instant::now() + Duration::from_secs(15);
    while curl(&[&format!("{base}/readyz")]).0 != 200 {
        assert!(Instant::now() < until, "/readyz did not recover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &serve.id().to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(10);
    while serve.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = serve.kill();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        2,
        "before and after"
    );
    env.cleanup().await;
}

/// `lastcall serve` started while its broker is down (a host booting, the broker
/// restarting): it listens at once and waits. Meanwhile `/healthz` is 200, `/readyz` is
/// 503 naming the broker, and a job is answered 503 `starting` with `Retry-After`, and
/// nothing is recorded. Once the broker answers, serve becomes ready by itself and takes
/// jobs; SIGTERM still ends it cleanly.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_started_while_the_broker_is_down_listens_and_becomes_ready_when_it_is_back() {
    let env = Env::sqlite("serve-late-broker").await;
    let proxy = FreezableProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    proxy.refuse(true);
    let port = common::private_rabbit::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let log = env.dir.join("serve.log");
    let serve = env
        .command_with_amqp(&format!("amqp://guest:guest@{}/%2f", proxy.addr))
        .args(["serve", "--addr", &format!("127.0.0.1:{port}")])
        .args(["--no-management", "--retry-delays-ms", "1000,5000"])
        .env("LASTCALL_HTTP_TOKEN", TOKEN)
        .stdout(std::process::Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    let mut serve = common::http::Children(vec![serve]);
    let said = || std::fs::read_to_string(&log).unwrap_or_default();
    let until = Instant::now() + Duration::from_secs(30);
    while curl(&[&format!("{base}/healthz")]).0 != 200 {
        assert!(
            serve.0[0].try_wait().unwrap().is_none(),
            "serve exited instead of waiting for the broker: {}",
            said()
        );
        assert!(Instant::now() < until, "serve did not listen: {}", said());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, body) = curl(&[&format!("{base}/readyz")]);
    assert_eq!(code, 503, "{body}");
    let v: serde_json::Value = serde_json::from_str(&body).unwrap();
    assert_eq!(v["ready"], false, "{v}");
    assert_eq!(v["down"][0], "broker", "{v}");
    let out = std::process::Command::new("curl")
        .args(["-s", "-i", "-X", "POST", &format!("{base}/v1/jobs")])
        .args(["-H", &format!("Authorization: Bearer {TOKEN}")])
        .args(["-H", "Content-Type: application/json", "--data"])
        .arg(r#"{"job_id":"early","kind":"incident.summary","deadline_ms":60000,"payload":{}}"#)
        .output()
        .unwrap();
    let answer = String::from_utf8_lossy(&out.stdout).to_lowercase();
    assert!(answer.starts_with("http/1.1 503"), "{answer}");
    assert!(answer.contains("retry-after: 1"), "{answer}");
    assert!(answer.contains(r#""error":"starting""#), "{answer}");
    assert!(answer.contains("waiting for the broker"), "{answer}");
    assert!(env.ledger.get("early").await.unwrap().is_none());

    // The broker answers: ready by itself, and jobs are taken.
    proxy.refuse(false);
    let until = Instant::now() + Duration::from_secs(30);
    while curl(&[&format!("{base}/readyz")]).0 != 200 {
        assert!(
            Instant::now() < until,
            "serve did not become ready: {}",
            said()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, body) = post_job(&base, "late");
    assert_eq!(code, 202, "{body}");
    assert_eq!(
        env.ledger.get("late").await.unwrap().map(|r| r.state),
        Some("accepted".to_owned())
    );
    let _ = std::process::Command::new("kill")
        .args(["-TERM", &serve.0[0].id().to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(10);
    let status = loop {
        if let Some(s) = serve.0[0].try_wait().unwrap() {
            break s;
        }
        assert!(Instant::now() < until, "serve did not stop on SIGTERM");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(status.success(), "{status}: {}", said());
    env.cleanup().await;
}

/// A frozen worker (SIGSTOP for longer than the AMQP heartbeat, then SIGCONT): the broker
/// has closed its connection meanwhile and requeued its deliveries; the worker reconnects
/// by itself, the calls that were running finish and are recorded once, their
/// redeliveries are acked as duplicates, and every job ends with exactly one outcome and
/// one model call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_frozen_worker_reconnects_and_records_each_job_once() {
    let env = Env::sqlite("frozen").await;
    let log = env.dir.join("calls.log");
    // A 1 s heartbeat, so that the broker gives up on the frozen worker within seconds.
    let mut worker = env
        .command_with_amqp("amqp://guest:guest@127.0.0.1:5672/%2f?heartbeat=1")
        .args([
            "worker",
            "--backend",
            "sim",
            "--slots",
            "2",
            "--sim-latency-ms",
            "3000",
            "--shutdown-grace-ms",
            "1000",
        ])
        .arg("--sim-call-log")
        .arg(&log)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let s = env.submitter(100, true).await;
    let ids: Vec<String> = (0..4).map(|i| format!("fz-{i}")).collect();
    for id in &ids {
        s.submit(&job(id, 120_000), now_ms()).await.unwrap();
    }
    let calls = |log: &std::path::Path| {
        std::fs::read_to_string(log)
            .map(|t| t.lines().count())
            .unwrap_or(0)
    };
    let until = Instant::now() + Duration::from_secs(20);
    while calls(&log) < 2 {
        assert!(Instant::now() < until, "no call started");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let pid = worker.id().to_string();
    let signal = |sig: &str| {
        std::process::Command::new("kill")
            .args([sig, &pid])
            .status()
            .unwrap()
    };
    signal("-STOP");
    // The broker notices the missed heartbeats and drops the consumer.
    let until = Instant::now() + Duration::from_secs(30);
    loop {
        let depth = lastcall_broker::topology::queue_depth(&env.broker, &env.topo.names.work_queue)
            .await
            .unwrap();
        if depth.is_some_and(|(_, consumers)| consumers == 0) {
            break;
        }
        assert!(
            Instant::now() < until,
            "the broker kept the frozen consumer: {depth:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    signal("-CONT");
    let recs = env.wait_terminal(&ids, Duration::from_secs(60)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
        assert_eq!(r.backend_calls, 1, "{r:?}");
        assert_eq!(calls_in(&log, &r.job_id), 1, "{}: one model call", r.job_id);
    }
    let until = Instant::now() + Duration::from_secs(20);
    while env.ready(&env.topo.names.work_queue).await != 0 {
        assert!(Instant::now() < until, "jobs left in the queue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(
        worker.try_wait().unwrap().is_none(),
        "the worker is still running"
    );
    signal("-TERM");
    let until = Instant::now() + Duration::from_secs(15);
    while worker.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = worker.kill();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    env.cleanup().await;
}

/// Two workers on one queue. The first loses its broker connection while two calls run;
/// the broker redelivers those jobs to the second worker, which sees in the ledger that
/// their calls still run on a live worker (its lease is fresh) and holds them, without a
/// slot, until they settle — then acks them as duplicates. One model call per job, in all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_running_on_a_disconnected_worker_is_not_run_again_by_another() {
    let env = Env::sqlite("lease").await;
    let proxy = FreezableProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let url = format!("amqp://guest:guest@{}/%2f", proxy.addr);
    let start = |name: &str, broker: Broker, sim: Arc<lastcall_backend::sim::SimBackend>| {
        let mut cfg = env.worker_config(2, 2);
        cfg.name = name.to_owned();
        let ledger = env.ledger.clone();
        async move {
            let stats = Arc::new(WorkerStats::default());
            let w = Worker::build(cfg, broker, ledger, sim, system_clock(), stats.clone())
                .await
                .unwrap();
            let stop = CancellationToken::new();
            let handle = tokio::spawn(w.run(stop.clone()));
            (stop, handle, stats)
        }
    };
    let sim1 = sim(3_000);
    let (stop1, h1, stats1) = start("w1", Broker::connect(&url).await.unwrap(), sim1.clone()).await;
    let s = env.submitter(100, true).await;
    let ids: Vec<String> = (0..2).map(|i| format!("ls-{i}")).collect();
    for id in &ids {
        s.submit(&job(id, 120_000), now_ms()).await.unwrap();
    }
    wait_for("both calls running on w1", Duration::from_secs(15), || {
        stats1.running.load(Ordering::Relaxed) == 2
    })
    .await;
    let sim2 = sim(3_000);
    let (stop2, h2, stats2) = start(
        "w2",
        Broker::connect("amqp://guest:guest@127.0.0.1:5672/%2f")
            .await
            .unwrap(),
        sim2.clone(),
    )
    .await;
    // w1 loses the broker (and cannot come back for now); the broker redelivers to w2.
    proxy.refuse(true);
    proxy.reset();
    wait_for(
        "w2 receives the redeliveries",
        Duration::from_secs(15),
        || WorkerStats::get(&stats2.received) >= 2,
    )
    .await;
    let recs = env.wait_terminal(&ids, Duration::from_secs(30)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
        assert_eq!(sim1.calls_for(&r.job_id), 1, "{}: w1 ran it", r.job_id);
        assert_eq!(
            sim2.calls_for(&r.job_id),
            0,
            "{}: w2 did not run it again",
            r.job_id
        );
    }
    wait_for("w2 acks the duplicates", Duration::from_secs(15), || {
        WorkerStats::get(&stats2.duplicates) == 2
    })
    .await;
    let until = Instant::now() + Duration::from_secs(15);
    while env.ready(&env.topo.names.work_queue).await != 0 {
        assert!(Instant::now() < until, "jobs left in the queue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    proxy.refuse(false);
    stop1.cancel();
    stop2.cancel();
    h1.await.unwrap().unwrap();
    h2.await.unwrap().unwrap();
    env.cleanup().await;
}

/// A broker that stops answering mid-connection (the proxy holds every byte it sends):
/// cancelling a consumer, closing its channel and closing the connection each give up
/// after `GOODBYE_LIMIT` instead of waiting for replies that may never come (lapin would
/// wait until its heartbeat gave up on the connection, a minute or more).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn goodbyes_do_not_wait_for_a_broker_that_stopped_answering() {
    let env = Env::sqlite("goodbye").await;
    let proxy = FreezableProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let url = format!("amqp://guest:guest@{}/%2f", proxy.addr);
    let broker = Broker::connect(&url).await.unwrap();
    let stream =
        lastcall_broker::IncomingStream::open(&broker, &env.topo.names.work_queue, 1, "goodbye")
            .await
            .unwrap();
    proxy.freeze();
    let limit = lastcall_broker::GOODBYE_LIMIT;
    let started = Instant::now();
    let goodbyes = async {
        stream.cancel().await;
        stream.close().await;
        broker.close().await;
    };
    tokio::time::timeout(limit * 3 + Duration::from_secs(15), goodbyes)
        .await
        .expect("the three goodbyes give up on a silent broker");
    // Each one waited for its reply first (the broker really was silent).
    assert!(
        started.elapsed() >= limit * 3 - Duration::from_millis(500),
        "{:?}",
        started.elapsed()
    );
    proxy.thaw();
    env.cleanup().await;
}
