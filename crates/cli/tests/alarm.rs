//! A real resource alarm (#12.3), on a private RabbitMQ node of this test's own (never the
//! shared broker): `lastcall serve` and `lastcall worker --backend sim` (the real binaries)
//! run against it, then `rabbitmqctl set_vm_memory_high_watermark 0.0001` raises the memory
//! alarm and the broker blocks publishing connections (`connection.blocked`):
//! - `POST /v1/jobs` answers 503 at once (well under the confirm timeout) with the clear
//!   "blocking publishers" error, and nothing is recorded for that job;
//! - `/readyz` answers 503 naming `broker_alarm` as soon as the alarm is on, before any
//!   publish (serve reads the alarms from the node's management API), then also `broker`
//!   once a publish was blocked; `/healthz` stays 200;
//! - jobs already delivered to the worker complete and are acked during the alarm (the
//!   worker publishes on a connection of its own, so its consumer connection is never held
//!   back): the queue's unacked count goes to 0 and the ledger has their `acked_at_ms`
//!   while the alarm is still on;
//! - once the watermark is restored, serve accepts jobs again and they complete.

use crate::common;

use common::calls_in;
use common::http::{Children, curl};
use common::private_rabbit::{PrivateRabbit, free_port};
use common::unique;
use lastcall_store::Ledger;
use std::path::PathBuf;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "alarm-test-token-0123456789abcdef";

/// Restores the node's memory watermark on drop (the node is private and goes away after
/// the test anyway, but a failing assertion must not leave the alarm on while it lives).
struct Watermark<'r>(&'r PrivateRabbit);

impl Watermark<'_> {
    fn set(&self, fraction: &str) {
        let out = self.0.ctl(&["set_vm_memory_high_watermark", fraction]);
        assert!(
            out.status.success(),
            "set_vm_memory_high_watermark {fraction}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

impl Drop for Watermark<'_> {
    fn drop(&mut self) {
        let _ = self.0.ctl(&["set_vm_memory_high_watermark", "0.4"]);
    }
}

/// `(ready, unacked)` of `queue` on the private node, from `rabbitmqctl` (exact now; the
/// management API samples every few seconds).
fn queue_counts(rabbit: &PrivateRabbit, queue: &str) -> Option<(u64, u64)> {
    common::rabbitmqctl::queue_counts(|a| rabbit.ctl(a), queue)
}

/// The node's active resource alarms, as `rabbitmqctl eval` prints them (`[]` when none).
fn alarms(rabbit: &PrivateRabbit) -> String {
    let out = rabbit.ctl(&["eval", "rabbit_alarm:get_alarms()."]);
    String::from_utf8_lossy(&out.stdout).trim().to_owned()
}

fn post_job(base: &str, id: &str) -> (u16, String) {
    common::http::post_job(base, TOKEN, id, 120_000)
}

/// Poll `cond` every 50 ms until it holds; panics with `what` (and `detail()`) after
/// `within`.
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_memory_alarm_blocks_the_ingress_but_never_the_workers_acks() {
    let rabbit = PrivateRabbit::start_with_management();
    let management_url = rabbit.management_url();
    let dir: PathBuf = rabbit.dir.join("lastcall");
    std::fs::create_dir_all(&dir).unwrap();
    let amqp = format!("amqp://guest:guest@127.0.0.1:{}/%2f", rabbit.port);
    let store = format!("sqlite://{}", dir.join("ledger.db").display());
    let prefix = unique("alarm");
    let work_queue = format!("{prefix}.work");
    let call_log = dir.join("calls.log");
    let port = free_port();
    let base = format!("http://127.0.0.1:{port}");
    let lastcall = |args: &[&str], log: &str| {
        let log = std::fs::File::create(dir.join(log)).unwrap();
        Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args([
                "--amqp-url",
                &amqp,
                "--store-url",
                &store,
                "--prefix",
                &prefix,
            ])
            .args(args)
            .env("LASTCALL_HTTP_TOKEN", TOKEN)
            .env("RUST_LOG", "info")
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap()
    };
    let logs = || {
        ["serve.log", "worker.log"]
            .iter()
            .map(|l| {
                format!(
                    "--- {l}:\n{}",
                    std::fs::read_to_string(dir.join(l)).unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    };
    let mut children = Children(vec![lastcall(
        &[
            "serve",
            "--addr",
            &format!("127.0.0.1:{port}"),
            "--management-url",
            &management_url,
            "--retry-delays-ms",
            "1000,5000",
        ],
        "serve.log",
    )]);
    wait_until(
        "serve to be ready",
        Duration::from_secs(60),
        async || curl(&[&format!("{base}/readyz")]).0 == 200,
        logs,
    )
    .await;
    children.0.push(lastcall(
        &[
            "worker",
            "--backend",
            "sim",
            "--sim-latency-ms",
            "500",
            "--sim-call-log",
            call_log.to_str().unwrap(),
            "--slots",
            "2",
            "--retry-delays-ms",
            "1000,5000",
        ],
        "worker.log",
    ));
    let ledger = Ledger::connect(&store).await.unwrap();

    // Two slow jobs, delivered and running before the alarm. Their calls (30 s) outlast
    // setting the alarm and the checks below even on a loaded machine, where one
    // `rabbitmqctl` alone can take seconds (with 4 s calls they once finished before the
    // alarm was on).
    let before = ["alarm-before-0", "alarm-before-1"];
    for id in before {
        let (code, body) = common::http::post_job_with(
            &base,
            TOKEN,
            id,
            120_000,
            r#"{"messages":[],"sim_latency_ms":30000}"#,
        );
        assert_eq!(code, 202, "{id}: {body}");
    }
    wait_until(
        "both jobs running in the worker",
        Duration::from_secs(30),
        async || {
            let mut running = 0;
            for id in before {
                if ledger
                    .get(id)
                    .await
                    .unwrap()
                    .is_some_and(|r| r.state == "running")
                {
                    running += 1;
                }
            }
            running == 2
        },
        logs,
    )
    .await;
    assert_eq!(queue_counts(&rabbit, &work_queue), Some((0, 2)));

    // The memory alarm.
    let watermark = Watermark(&rabbit);
    watermark.set("0.0001");
    wait_until(
        "the memory alarm",
        Duration::from_secs(30),
        async || alarms(&rabbit).contains("memory"),
        || alarms(&rabbit),
    )
    .await;
    // Readiness sees the alarm before anything was published: the publisher's connection
    // is not blocked yet (`broker` is up), the alarm is (`broker_alarm`).
    wait_until(
        "/readyz to report the alarm before any publish",
        Duration::from_secs(20),
        async || {
            let (code, body) = curl(&[&format!("{base}/readyz")]);
            code == 503 && body.contains(r#""down":["broker_alarm"]"#)
        },
        || format!("{:?}\n{}", curl(&[&format!("{base}/readyz")]), logs()),
    )
    .await;
    assert_eq!(curl(&[&format!("{base}/healthz")]).0, 200);
    // RabbitMQ blocks a connection only when it publishes during the alarm: the first POST
    // is what the broker blocks, and it is answered at once too (the broker's
    // `connection.blocked` ends the wait for its confirm), well under the 5 s confirm
    // timeout. Its message may still reach the queue when the alarm clears.
    let started = Instant::now();
    let (code, body) = post_job(&base, "alarm-first");
    let took = started.elapsed();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("blocking publishers"), "{body}");
    assert!(took < Duration::from_secs(2), "503 after {took:?}");
    // Readiness names the blocked broker; liveness stays 200.
    wait_until(
        "/readyz to say the broker is down",
        Duration::from_secs(10),
        async || {
            let (code, body) = curl(&[&format!("{base}/readyz")]);
            code == 503 && body.contains(r#""down":["broker","broker_alarm"]"#)
        },
        || format!("{:?}\n{}", curl(&[&format!("{base}/readyz")]), logs()),
    )
    .await;
    assert_eq!(curl(&[&format!("{base}/healthz")]).0, 200);
    // Now every publish fails before it is sent, with the clear error.
    let started = Instant::now();
    let (code, body) = post_job(&base, "alarm-during");
    let took = started.elapsed();
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("the broker is blocking publishers"), "{body}");
    assert!(took < Duration::from_secs(2), "503 after {took:?}");
    for id in ["alarm-first", "alarm-during"] {
        assert!(
            ledger.get(id).await.unwrap().is_none(),
            "{id}: a refused job leaves no record"
        );
    }

    // The jobs that were running complete and are acked while the alarm is on.
    wait_until(
        "the running jobs to complete and be acked during the alarm",
        Duration::from_secs(90),
        async || {
            let mut done = 0;
            for id in before {
                let completed = ledger
                    .get(id)
                    .await
                    .unwrap()
                    .is_some_and(|r| r.state == "completed");
                let acked = ledger
                    .attempts(id)
                    .await
                    .unwrap()
                    .iter()
                    .any(|a| a.acked_at_ms.is_some());
                if completed && acked {
                    done += 1;
                }
            }
            done == 2 && queue_counts(&rabbit, &work_queue) == Some((0, 0))
        },
        || format!("{:?}\n{}", queue_counts(&rabbit, &work_queue), logs()),
    )
    .await;
    assert!(
        alarms(&rabbit).contains("memory"),
        "the alarm was still on: {}",
        alarms(&rabbit)
    );
    let (code, body) = curl(&[&format!("{base}/readyz")]);
    assert_eq!(code, 503, "still blocked: {body}");
    for id in before {
        assert_eq!(calls_in(&call_log, id), 1, "{id}: one model call");
    }

    // The alarm clears: serve is ready and accepts jobs again, and they complete.
    watermark.set("0.4");
    wait_until(
        "/readyz 200 after the alarm",
        Duration::from_secs(30),
        async || curl(&[&format!("{base}/readyz")]).0 == 200,
        || format!("{:?}\n{}", curl(&[&format!("{base}/readyz")]), logs()),
    )
    .await;
    let (code, body) = post_job(&base, "alarm-after");
    assert_eq!(code, 202, "{body}");
    wait_until(
        "the job posted after the alarm to complete",
        Duration::from_secs(30),
        async || {
            ledger
                .get("alarm-after")
                .await
                .unwrap()
                .is_some_and(|r| r.state == "completed")
        },
        logs,
    )
    .await;
    assert_eq!(calls_in(&call_log, "alarm-after"), 1);
    // The publish that was cut by the block was never sent again: the job that was refused
    // before it was sent never runs; the one the broker blocked mid-publish runs at most
    // once (it may have reached the queue when the alarm cleared).
    assert_eq!(calls_in(&call_log, "alarm-during"), 0);
    assert!(calls_in(&call_log, "alarm-first") <= 1);
    for c in &mut children.0 {
        assert!(
            c.try_wait().unwrap().is_none(),
            "a process exited\n{}",
            logs()
        );
    }
    ledger.close().await;
    drop(children);
    drop(watermark);
}
