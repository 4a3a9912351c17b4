//! The broker's `consumer_timeout` (#12.7), on a private RabbitMQ node of this test's own
//! (never the shared broker), lowered at runtime to 5 s
//! (`application:set_env(rabbit, consumer_timeout, 5000)`, and the channel tick that checks
//! it to 1 s) while a sim model call runs 12 s under a 120 s deadline. Two real
//! `lastcall worker --backend sim` processes, one per case:
//! - the value known (`--consumer-timeout-ms 5000`): the worker warns that `--horizon-ms`
//!   exceeds it and cuts the call inside the ack window, before the broker would close the
//!   channel: one model call, the outcome `failed`/`consumer_timeout`, no lost channel;
//! - the value unknown: the broker closes the channel (PRECONDITION_FAILED, delivery
//!   acknowledgement timed out); the worker survives it like any lost channel (reconnects,
//!   holds the redelivery while the call runs): one model call, one outcome (`completed`),
//!   and the queue drains.
//!
//! In both cases the worker keeps running and consuming: a short job afterwards completes.

use crate::common;

use common::http::Children;
use common::private_rabbit::PrivateRabbit;
use common::{calls_in, job_with, unique};
use lastcall_broker::{Broker, Publisher, Topology};
use lastcall_core::{AdmissionPolicy, EnvelopeLimits};
use lastcall_store::Ledger;
use lastcall_worker::Submitter;
use lastcall_worker::clock::now_ms;
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Restores the node's consumer timeout and channel tick on drop.
struct Lowered<'r>(&'r PrivateRabbit);

impl Drop for Lowered<'_> {
    fn drop(&mut self) {
        let _ = self.0.ctl(&[
            "eval",
            "application:set_env(rabbit, consumer_timeout, 1800000), application:set_env(rabbit, channel_tick_interval, 60000).",
        ]);
    }
}

fn eval(rabbit: &PrivateRabbit, expr: &str) -> String {
    let out = rabbit.ctl(&["eval", expr]);
    assert!(
        out.status.success(),
        "eval {expr}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

/// `(ready, unacked)` of `queue` on the private node (its management plugin is off).
fn queue_counts(rabbit: &PrivateRabbit, queue: &str) -> Option<(u64, u64)> {
    common::rabbitmqctl::queue_counts(|a| rabbit.ctl(a), queue)
}

async fn wait_until(
    what: &str,
    within: Duration,
    mut cond: impl AsyncFnMut() -> bool,
    detail: impl Fn() -> String,
) {
    let until = Instant::now() + within;
    while !cond().await {
        assert!(
            Instant::now() < until,
            "timed out waiting for {what}\n{}",
            detail()
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// One worker's world: its prefix (queues), ledger, call log and process log.
struct Case {
    prefix: String,
    ledger: Arc<Ledger>,
    store: String,
    calls: PathBuf,
    log: PathBuf,
    submitter: Submitter,
}

impl Case {
    async fn new(name: &str, amqp: &str, dir: &Path) -> Case {
        let prefix = unique(name);
        let store = format!("sqlite://{}", dir.join(format!("{name}.db")).display());
        let broker = Broker::connect(amqp).await.unwrap();
        let mut topo = Topology::new(&prefix);
        topo.retry_delays_ms = vec![1_000, 5_000];
        topo.apply(&broker).await.unwrap();
        let ledger = Arc::new(Ledger::connect(&store).await.unwrap());
        let submitter = Submitter::new(
            Publisher::new(&broker, Duration::from_secs(5))
                .await
                .unwrap(),
            topo.names.clone(),
            Some(ledger.clone()),
            AdmissionPolicy {
                clock_uncertainty_ms: 100,
                default_min_runtime_ms: 0,
            },
            EnvelopeLimits::default(),
        );
        Case {
            prefix,
            ledger,
            store,
            calls: dir.join(format!("{name}-calls.log")),
            log: dir.join(format!("{name}-worker.log")),
            submitter,
        }
    }

    fn worker(&self, amqp: &str, extra: &[&str]) -> Child {
        Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args([
                "--amqp-url",
                amqp,
                "--store-url",
                &self.store,
                "--prefix",
                &self.prefix,
                "worker",
                "--backend",
                "sim",
                "--sim-latency-ms",
                "20",
                "--sim-call-log",
                self.calls.to_str().unwrap(),
                "--slots",
                "2",
                "--retry-delays-ms",
                "1000,5000",
            ])
            .args(extra)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&self.log).unwrap())
            .spawn()
            .unwrap()
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    async fn submit(&self, id: &str, latency_ms: u64) {
        let payload =
            json!({"messages": [{"role": "user", "content": "x"}], "sim_latency_ms": latency_ms});
        self.submitter
            .submit(&job_with(id, 120_000, payload), now_ms())
            .await
            .unwrap();
    }

    async fn state(&self, id: &str) -> Option<lastcall_store::JobRecord> {
        self.ledger.get(id).await.unwrap()
    }

    async fn wait_state(&self, id: &str, within: Duration, want: &[&str]) {
        wait_until(
            &format!("{id} in {want:?}"),
            within,
            async || {
                self.state(id)
                    .await
                    .is_some_and(|r| want.contains(&r.state.as_str()))
            },
            || self.log(),
        )
        .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_call_longer_than_the_consumer_timeout_never_crashes_the_worker() {
    let rabbit = PrivateRabbit::start(|port| format!("listeners.tcp.default = 127.0.0.1:{port}\n"));
    // Lowered before any channel opens (a channel reads both when it starts).
    let lowered = Lowered(&rabbit);
    eval(
        &rabbit,
        "application:set_env(rabbit, consumer_timeout, 5000), application:set_env(rabbit, channel_tick_interval, 1000).",
    );
    assert_eq!(
        eval(&rabbit, "application:get_env(rabbit, consumer_timeout)."),
        "{ok,5000}"
    );
    let dir = rabbit.dir.join("lastcall");
    std::fs::create_dir_all(&dir).unwrap();
    let amqp = format!("amqp://guest:guest@127.0.0.1:{}/%2f", rabbit.port);
    let known = Case::new("ct-known", &amqp, &dir).await;
    let unknown = Case::new("ct-unknown", &amqp, &dir).await;
    let mut children = Children(vec![
        known.worker(&amqp, &["--consumer-timeout-ms", "5000"]),
        unknown.worker(&amqp, &[]),
    ]);
    // The known case says at startup that the horizon (24 h by default) exceeds it.
    wait_until(
        "the horizon warning",
        Duration::from_secs(30),
        async || {
            known
                .log()
                .contains("exceeds the broker's consumer_timeout")
        },
        || known.log(),
    )
    .await;

    // Three long jobs for two slots in the known case: the third waits for a slot until
    // its ack window has (nearly) closed: it is handed back (before its start, or when
    // writing the start took the rest of the window, as on a loaded machine) and
    // redelivered with a fresh window, or cut at what is left of it. Never failed unstarted.
    for id in ["ct-known-long", "ct-known-long-2", "ct-known-long-3"] {
        known.submit(id, 12_000).await;
    }
    unknown.submit("ct-unknown-long", 12_000).await;

    // Known: cut inside the ack window (5 s − 1 s margin after receipt), before the
    // broker would close the channel.
    known
        .wait_state("ct-known-long", Duration::from_secs(30), &["failed"])
        .await;
    let r = known.state("ct-known-long").await.unwrap();
    assert_eq!(r.reason.as_deref(), Some("consumer_timeout"), "{r:?}");
    assert_eq!(r.backend_calls, 1, "{r:?}");
    let ran = r.finished_at_ms.unwrap() - r.received_at_ms.unwrap();
    assert!(ran < 5_000, "ended {ran} ms after receipt: {r:?}");
    assert!(
        r.error
            .as_deref()
            .is_some_and(|e| e.contains("consumer_timeout")),
        "{r:?}"
    );

    for id in ["ct-known-long-2", "ct-known-long-3"] {
        known
            .wait_state(id, Duration::from_secs(30), &["failed"])
            .await;
        let r = known.state(id).await.unwrap();
        assert_eq!(r.reason.as_deref(), Some("consumer_timeout"), "{r:?}");
        assert_eq!(r.backend_calls, 1, "{r:?}");
        assert_eq!(calls_in(&known.calls, id), 1, "{id}");
    }

    // Unknown: the broker closes the channel; the worker reconnects, the call goes on and
    // its redelivery waits for it.
    wait_until(
        "the broker to close the unknown case's channel",
        Duration::from_secs(30),
        async || unknown.log().contains("broker connection lost"),
        || unknown.log(),
    )
    .await;
    assert!(
        unknown
            .log()
            .contains("PRECONDITION_FAILED - delivery acknowledgement"),
        "the broker's reason: {}",
        unknown.log()
    );
    unknown
        .wait_state("ct-unknown-long", Duration::from_secs(60), &["completed"])
        .await;
    let r = unknown.state("ct-unknown-long").await.unwrap();
    assert_eq!(r.backend_calls, 1, "{r:?}");
    let work = format!("{}.work", unknown.prefix);
    wait_until(
        "the unknown case's work queue to drain (the redelivery acked as a duplicate)",
        Duration::from_secs(60),
        async || queue_counts(&rabbit, &work) == Some((0, 0)),
        || format!("{:?}\n{}", queue_counts(&rabbit, &work), unknown.log()),
    )
    .await;

    // Both keep consuming.
    known.submit("ct-known-after", 20).await;
    unknown.submit("ct-unknown-after", 20).await;
    known
        .wait_state("ct-known-after", Duration::from_secs(60), &["completed"])
        .await;
    unknown
        .wait_state("ct-unknown-after", Duration::from_secs(60), &["completed"])
        .await;

    // One model call each, one terminal outcome each (the ledger's terminal row is never
    // overwritten; the state read above stayed), and the known case never lost its channel.
    assert_eq!(calls_in(&known.calls, "ct-known-long"), 1);
    assert_eq!(calls_in(&unknown.calls, "ct-unknown-long"), 1);
    assert_eq!(known.state("ct-known-long").await.unwrap().state, "failed");
    assert_eq!(
        unknown.state("ct-unknown-long").await.unwrap().state,
        "completed"
    );
    assert!(
        !known.log().contains("broker connection lost"),
        "{}",
        known.log()
    );
    assert_eq!(
        queue_counts(&rabbit, &format!("{}.work", known.prefix)),
        Some((0, 0))
    );
    for c in &mut children.0 {
        assert!(
            c.try_wait().unwrap().is_none(),
            "a worker exited\n{}\n{}",
            known.log(),
            unknown.log()
        );
    }
    drop(children);
    known.ledger.close().await;
    unknown.ledger.close().await;
    drop(lowered);
}
