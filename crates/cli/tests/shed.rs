//! Shedding at the door through the real binaries: with a deep queue and a measured ack
//! rate, `lastcall submit` refuses a job that would expire in the queue (exit 75, nothing
//! published or recorded) and `lastcall serve` answers it `429 would_expire_in_queue` with
//! `Retry-After`; with `--no-shed` both accept it.

use crate::common;

use common::serve::Serve;
use common::*;
use lastcall_broker::management::{Management, QueueStats};
use lastcall_worker::clock::now_ms;
use std::process::Command;
use std::time::{Duration, Instant};

const TOKEN: &str = "shed-test-token-0123456789";
const MANAGEMENT: &str = "http://127.0.0.1:15672";

/// curl with the response headers in front of the body; (status, headers and body).
fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-D", "-", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output_bounded()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

fn post(base: &str, id: &str, deadline_ms: u64) -> (u16, String) {
    let body = format!(
        r#"{{"job_id":"{id}","kind":"incident.summary","deadline_ms":{deadline_ms},"payload":{{"prompt":"summarize"}}}}"#
    );
    curl(&[
        "-X",
        "POST",
        &format!("{base}/v1/jobs"),
        "-H",
        &format!("Authorization: Bearer {TOKEN}"),
        "-H",
        "Content-Type: application/json",
        "--data",
        &body,
    ])
}

fn submit(env: &Env, id: &str, extra: &[&str]) -> std::process::Output {
    env.submit_cli(id, "1000", extra)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_and_serve_shed_a_job_that_would_expire_in_the_queue_unless_no_shed() {
    let env = Env::sqlite("shed-cli").await;
    let submitter = env.submitter(100, true).await;
    for i in 0..400 {
        submitter
            .submit(&job(&format!("fill-{i}"), 120_000), now_ms())
            .await
            .unwrap();
    }
    // One slot, 100 ms calls: ~10 acks/s, so the backlog lasts ~40 s; the checks below
    // take a few seconds, and more than 150 ready is 15 s of queue for a 1 s budget.
    let worker = env
        .start_worker(env.worker_config(1, 4), sim(100), system_clock())
        .await;
    let m = Management::from_amqp_url(AMQP, MANAGEMENT);
    let until = Instant::now() + Duration::from_secs(20);
    let mut last: Option<QueueStats> = None;
    loop {
        if let Ok(Some(s)) = m.queue_stats(&env.topo.names.work_queue).await {
            if s.ack_rate_per_s.is_some_and(|r| r > 0.0) && s.ready > 150 {
                break;
            }
            last = Some(s);
        }
        assert!(Instant::now() < until, "no ack rate sampled: {last:?}");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }

    // `lastcall submit`: refused before publishing, exit 75, the estimate named.
    let out = submit(&env, "cli-shed", &[]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    assert!(
        stderr.contains("would expire in the queue") && stderr.contains(" ready at "),
        "{stderr}"
    );
    assert!(env.ledger.get("cli-shed").await.unwrap().is_none());
    // `--no-shed` publishes it.
    let out = submit(&env, "cli-no-shed", &["--no-shed"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(env.ledger.get("cli-no-shed").await.unwrap().is_some());

    // `lastcall serve`: 429 with Retry-After, counted; `serve --no-shed`: 202.
    let shedding = Serve::start(&env, TOKEN, &[]).await;
    let base = shedding.base.clone();
    let (code, resp) = post(&base, "http-shed", 1_000);
    assert_eq!(code, 429, "{resp}");
    let lower = resp.to_ascii_lowercase();
    assert!(lower.contains("\nretry-after: "), "{resp}");
    assert!(
        resp.contains(r#""error":"would_expire_in_queue""#),
        "{resp}"
    );
    assert!(env.ledger.get("http-shed").await.unwrap().is_none());
    let (code, metrics) = curl(&[
        &format!("{base}/metrics"),
        "-H",
        &format!("Authorization: Bearer {TOKEN}"),
    ]);
    assert_eq!(code, 200);
    assert!(
        metrics.contains("\nlastcall_http_shed_total 1\n"),
        "{metrics}"
    );
    let plain = Serve::start(&env, TOKEN, &["--no-shed"]).await;
    let base = plain.base.clone();
    let (code, resp) = post(&base, "http-no-shed", 1_000);
    assert_eq!(code, 202, "{resp}");
    drop((shedding, plain));
    worker.stop().await;
    env.cleanup().await;
}
