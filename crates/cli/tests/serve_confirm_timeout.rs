//! `lastcall serve` when the broker's publisher confirm does not arrive in time: a real
//! RabbitMQ behind a loopback proxy that holds the broker's bytes (the publish goes
//! through, its confirm does not). The client is told 503, the ledger does not call the job
//! accepted, a retry with the same id after the broker recovers is accepted, and the
//! duplicate message the first attempt left in the queue runs no second model call.

use crate::common;

use common::http::curl;
use common::proxy::FreezableProxy;
use common::*;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const TOKEN: &str = "confirm-timeout-token-0123456789";

fn post(base: &str, body: &str) -> (u16, String) {
    curl(&[
        "-X",
        "POST",
        &format!("{base}/v1/jobs"),
        "-H",
        &format!("Authorization: Bearer {TOKEN}"),
        "-H",
        "Content-Type: application/json",
        "--data",
        body,
    ])
}

fn stop(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_confirm_that_never_arrives_is_503_not_accepted_and_a_retry_runs_once() {
    let env = Env::sqlite("confirm-timeout").await;
    let proxy = FreezableProxy::start("127.0.0.1:5672".parse().unwrap()).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let base = format!("http://127.0.0.1:{port}");
    let mut serve = Command::new(env!("CARGO_BIN_EXE_lastcall"))
        .args([
            "--amqp-url",
            &format!("amqp://guest:guest@{}/%2f", proxy.addr),
            "--store-url",
            &env.store_url,
            "--prefix",
            &env.prefix,
            "serve",
            "--addr",
            &format!("127.0.0.1:{port}"),
            "--retry-delays-ms",
            "1000,5000",
            "--confirm-timeout-ms",
            "1000",
            "--no-management",
        ])
        .env("LASTCALL_HTTP_TOKEN", TOKEN)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let until = Instant::now() + Duration::from_secs(20);
    while curl(&[&format!("{base}/readyz")]).0 != 200 {
        assert!(Instant::now() < until, "serve did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let body = |id: &str| {
        format!(
            r#"{{"job_id":"{id}","kind":"incident.summary","deadline_ms":60000,"payload":{{"messages":[{{"role":"user","content":"summarize"}}]}}}}"#
        )
    };
    // Through the proxy, the path works.
    let (code, resp) = post(&base, &body("ct-ok"));
    assert_eq!(code, 202, "{resp}");

    // The broker's bytes are held: the publish reaches the queue, the confirm does not.
    proxy.freeze();
    let (code, resp) = post(&base, &body("ct-1"));
    assert_eq!(code, 503, "{resp}");
    let err: serde_json::Value = serde_json::from_str(&resp).unwrap();
    assert_eq!(err["error"], "broker_unavailable", "{resp}");
    let msg = err["message"].as_str().unwrap();
    assert!(
        msg.contains("did not confirm the publish within 1000 ms") && msg.contains("same job_id"),
        "{msg}"
    );
    assert!(
        env.ledger.get("ct-1").await.unwrap().is_none(),
        "told 503: the ledger must not say accepted"
    );

    // The broker recovers; the client retries with the same id and is accepted.
    proxy.thaw();
    let (code, resp) = post(&base, &body("ct-1"));
    assert_eq!(code, 202, "{resp}");
    let accepted: serde_json::Value = serde_json::from_str(&resp).unwrap();
    assert_eq!(accepted["state"], "accepted", "{resp}");
    assert!(
        accepted.get("duplicate").is_none(),
        "a fresh publish: {resp}"
    );
    let rec = env.ledger.get("ct-1").await.unwrap().expect("accepted");
    assert_eq!(rec.state, "accepted");
    assert!(rec.accepted_at_ms.is_some(), "stamped after the confirm");
    // The unconfirmed first publish did reach the queue: ct-ok plus ct-1 twice.
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 3);
    stop(&mut serve);

    // One slot, one unacked delivery at a time: the second copy of ct-1 arrives after the
    // first one's outcome is durable and is acked as a duplicate, without a model call.
    let sim = sim(5);
    let worker = env
        .start_worker(env.worker_config(1, 1), sim.clone(), system_clock())
        .await;
    let recs = env
        .wait_terminal(&["ct-ok".into(), "ct-1".into()], Duration::from_secs(20))
        .await;
    let until = Instant::now() + Duration::from_secs(10);
    while env.ready(&env.topo.names.work_queue).await > 0 {
        assert!(Instant::now() < until, "the duplicate was not consumed");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    worker.stop().await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
    }
    let ct1 = env.ledger.get("ct-1").await.unwrap().unwrap();
    assert_eq!(
        ct1.backend_calls, 1,
        "the duplicate delivery ran no model call"
    );
    env.cleanup().await;
}
