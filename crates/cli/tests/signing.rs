//! Envelope signatures end to end (docs/wire-format.md, `x-lastcall-signature`): the real
//! `lastcall worker` binary holds the key (from the environment) and `lastcall submit`
//! signs with it (from a file). An unsigned job and a signed job re-published with a later
//! deadline are `rejected`/`bad_signature`, dead-lettered, and never reach the model; they
//! are recorded under synthetic ids, so a forged copy cannot block the real job it names.

use crate::common;

use common::*;
use lastcall_broker::{IncomingStream, PublishProps, Publisher};
use lastcall_worker::clock::now_ms;
use serde_json::Value;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

const KEY: &str = "signing-test-key-0123456789abcdef-0123";

fn worker_with_key(env: &Env, call_log: &std::path::Path) -> Child {
    env.command()
        .args([
            "worker",
            "--backend",
            "sim",
            "--slots",
            "2",
            "--sim-latency-ms",
            "10",
        ])
        .args(["--retry-delays-ms", "1000,5000"])
        .arg("--sim-call-log")
        .arg(call_log)
        .env("LASTCALL_SIGNING_KEY", KEY)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("spawn the lastcall binary")
}

fn terminate(child: &mut Child) {
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(15);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn submit_signed(env: &Env, key_file: &std::path::Path, id: &str) {
    let key_file = key_file.to_str().unwrap();
    let out = env.submit_cli(id, "60000", &["--signing-key-file", key_file]);
    assert!(
        out.status.success(),
        "submit failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_with_the_key_runs_signed_jobs_and_rejects_unsigned_or_extended_ones() {
    let env = Env::sqlite("signing").await;
    let key_file = env.dir.join("signing.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let log = env.dir.join("calls.log");

    // A signed job, taken off the queue and re-published by an untrusted producer with an
    // extra hour of deadline and the original signature.
    submit_signed(&env, &key_file, "sig-extended");
    let mut work = IncomingStream::open(&env.broker, &env.topo.names.work_queue, 1, "tamper")
        .await
        .unwrap();
    let original = tokio::time::timeout(Duration::from_secs(5), work.next())
        .await
        .expect("the signed job is in the work queue")
        .unwrap()
        .unwrap();
    let signature = original
        .signature
        .clone()
        .expect("`lastcall submit` signed");
    assert!(signature.starts_with("v1="), "{signature}");
    let mut body: Value = serde_json::from_slice(&original.body).unwrap();
    let signed_expires = body["expires_at_ms"].as_i64().unwrap();
    let extended = signed_expires + 3_600_000;
    body["expires_at_ms"] = extended.into();
    original.settler.ack().await.unwrap();
    work.close().await;
    let publisher = Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let publish = |id: &'static str, body: Vec<u8>, signature: Option<String>| {
        let publisher = publisher.clone();
        let exchange = env.topo.names.jobs_exchange.clone();
        async move {
            let props = PublishProps {
                job_id: id.into(),
                ttl_ms: Some(60_000),
                attempt: 0,
                timestamp_s: (now_ms() / 1000) as u64,
                signature,
            };
            publisher
                .publish(&exchange, "incident.summary", &body, &props)
                .await
                .unwrap();
        }
    };
    publish(
        "sig-extended",
        serde_json::to_vec(&body).unwrap(),
        Some(signature),
    )
    .await;

    // A valid job published without a signature (recorded `accepted` like any other).
    env.submitter(0, true)
        .await
        .submit(&job("sig-unsigned", 60_000), now_ms())
        .await
        .unwrap();
    // A forger publishes an unsigned message claiming the id of a real job queued after
    // it: it must not block the real one (outcomes are write-once).
    let forged = serde_json::json!({"schema_version": 1, "job_id": "sig-victim",
        "kind": "incident.summary", "created_at_ms": now_ms(), "expires_at_ms": now_ms() + 60_000,
        "payload": {"messages": [{"role": "user", "content": "forged"}]}});
    publish("sig-victim", serde_json::to_vec(&forged).unwrap(), None).await;
    submit_signed(&env, &key_file, "sig-victim");
    // And one signed by `lastcall submit` with the key.
    submit_signed(&env, &key_file, "sig-ok");

    let mut worker = worker_with_key(&env, &log);
    let ids = ["sig-ok", "sig-victim"].map(String::from);
    let recs = env.wait_terminal(&ids, Duration::from_secs(20)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
        assert_eq!(r.backend_calls, 1);
        assert_eq!(calls_in(&log, &r.job_id), 1);
    }

    // The three badly signed messages are recorded under synthetic ids, each naming the
    // id it claimed; the claimed ids' own records are untouched.
    let bad = wait_bad_signatures(&env, 3).await;
    for (claimed, why) in [
        ("sig-unsigned", "no x-lastcall-signature"),
        ("sig-extended", "does not match"),
        ("sig-victim", "no x-lastcall-signature"),
    ] {
        let r = bad
            .iter()
            .find(|r| {
                r.error
                    .as_deref()
                    .unwrap_or_default()
                    .contains(&format!("`{claimed}`"))
            })
            .unwrap_or_else(|| panic!("no bad_signature record claims {claimed}: {bad:?}"));
        assert!(r.job_id.starts_with("invalid-"), "{r:?}");
        assert_eq!(r.backend_calls, 0, "{claimed} never reached the model");
        let err = r.error.clone().unwrap_or_default();
        assert!(err.contains(why), "{claimed}: {err}");
    }
    for id in ["sig-unsigned", "sig-extended"] {
        let r = env.ledger.get(id).await.unwrap().unwrap();
        assert_eq!(
            r.state, "accepted",
            "{id}: the forged copy did not touch it"
        );
        assert_eq!(calls_in(&log, id), 0, "{id}: the sim backend saw no call");
    }

    // The refusals went to the dead queue (rejected by the worker), nothing is left to run.
    let until = Instant::now() + Duration::from_secs(10);
    while env.ready(&env.topo.names.dead_queue).await < 3 {
        assert!(Instant::now() < until, "three dead letters expected");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    terminate(&mut worker);
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 0);
    // The dead-letter processor with the key keeps to the synthetic ids as well.
    let out = env
        .command()
        .args(["dlq", "--idle-exit-ms", "1500"])
        .env("LASTCALL_SIGNING_KEY", KEY)
        .output_bounded()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(env.ready(&env.topo.names.dead_queue).await, 0);
    for id in ["sig-unsigned", "sig-extended"] {
        assert_eq!(
            env.ledger.get(id).await.unwrap().unwrap().state,
            "accepted",
            "{id}"
        );
    }
    assert_eq!(wait_bad_signatures(&env, 3).await.len(), 3);
    env.cleanup().await;
}

/// With signing on, an *invalid* unsigned message (no payload, bad JSON, a deadline past
/// the horizon) that claims a real job's id is recorded under a synthetic id, so the real
/// signed job still runs; and `lastcall submit` refuses an id that already has an outcome.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn forged_invalid_messages_do_not_block_real_signed_jobs() {
    let env = Env::sqlite("signing-invalid").await;
    let key_file = env.dir.join("signing.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let log = env.dir.join("calls.log");
    let publisher = Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let now = now_ms();
    let forgeries: [(&str, Vec<u8>, &str); 3] = [
        (
            "inv-nopayload",
            serde_json::to_vec(&serde_json::json!({"schema_version": 1,
                "job_id": "inv-nopayload", "kind": "incident.summary",
                "created_at_ms": now, "expires_at_ms": now + 60_000}))
            .unwrap(),
            "missing_field",
        ),
        ("inv-json", b"{not json".to_vec(), "invalid_json"),
        (
            "inv-horizon",
            serde_json::to_vec(&serde_json::json!({"schema_version": 1,
                "job_id": "inv-horizon", "kind": "incident.summary",
                "created_at_ms": now, "expires_at_ms": now + 10 * 365 * 86_400_000i64,
                "payload": {"messages": []}}))
            .unwrap(),
            "",
        ),
    ];
    // The forgeries are queued ahead of the real jobs whose ids they claim (the
    // `message_id` property claims it too).
    for (id, body, _) in &forgeries {
        let props = PublishProps {
            job_id: (*id).into(),
            ttl_ms: Some(60_000),
            attempt: 0,
            timestamp_s: (now_ms() / 1000) as u64,
            signature: None,
        };
        publisher
            .publish(
                &env.topo.names.jobs_exchange,
                "incident.summary",
                body,
                &props,
            )
            .await
            .unwrap();
    }
    let ids = forgeries.each_ref().map(|(id, _, _)| id.to_string());
    for id in &ids {
        submit_signed(&env, &key_file, id);
    }
    let mut worker = worker_with_key(&env, &log);
    let recs = env.wait_terminal(&ids, Duration::from_secs(20)).await;
    for r in &recs {
        assert_eq!(
            r.state, "completed",
            "the forgery blocked the real job: {r:?}"
        );
        assert_eq!(calls_in(&log, &r.job_id), 1);
    }
    // Each forgery is `rejected` under a synthetic id, its error naming the claimed id.
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let rejected = env
            .ledger
            .list(&lastcall_store::ListFilter {
                state: Some("rejected".into()),
                ..Default::default()
            })
            .await
            .unwrap();
        let found = forgeries
            .iter()
            .filter(|(id, _, reason)| {
                rejected.iter().any(|r| {
                    r.job_id.starts_with("invalid-")
                        && r.backend_calls == 0
                        && r.error
                            .as_deref()
                            .unwrap_or_default()
                            .contains(&format!("`{id}`"))
                        && (reason.is_empty() || r.reason.as_deref() == Some(*reason))
                })
            })
            .count();
        if found == forgeries.len() {
            break;
        }
        assert!(
            Instant::now() < until,
            "each forgery is rejected under a synthetic id: {rejected:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    terminate(&mut worker);

    // `lastcall submit` does not say "accepted" for an id that already has an outcome.
    let out = env.cli(&[
        "submit",
        "--kind",
        "incident.summary",
        "--prompt",
        "again",
        "--deadline-ms",
        "60000",
        "--job-id",
        "inv-json",
        "--signing-key-file",
        key_file.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(!err.lines().any(|l| l.starts_with("accepted:")), "{err}");
    assert!(
        err.contains("already has an outcome") && err.contains("completed"),
        "{err}"
    );
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        0,
        "nothing published"
    );
    env.cleanup().await;
}

/// The `rejected`/`bad_signature` records, once there are at least `n`.
async fn wait_bad_signatures(env: &Env, n: usize) -> Vec<lastcall_store::JobRecord> {
    let until = Instant::now() + Duration::from_secs(15);
    loop {
        let bad: Vec<_> = env
            .ledger
            .list(&lastcall_store::ListFilter {
                state: Some("rejected".into()),
                ..Default::default()
            })
            .await
            .unwrap()
            .into_iter()
            .filter(|r| r.reason.as_deref() == Some("bad_signature"))
            .collect();
        if bad.len() >= n {
            return bad;
        }
        assert!(
            Instant::now() < until,
            "{n} bad_signature records expected: {bad:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// `lastcall serve` with the key (from a file) signs what it publishes: the message in the
/// work queue carries a signature that verifies against its id, deadline and exact body.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_with_a_key_signs_every_job_it_publishes() {
    let env = Env::sqlite("signing-serve").await;
    let key_file = env.dir.join("signing.key");
    std::fs::write(&key_file, format!("{KEY}\n")).unwrap();
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let token = "signing-serve-token-0123456789";
    let mut serve = env
        .command()
        .args(["serve", "--addr", &format!("127.0.0.1:{port}")])
        .args(["--retry-delays-ms", "1000,5000", "--no-management"])
        .arg("--signing-key-file")
        .arg(&key_file)
        .env("LASTCALL_HTTP_TOKEN", token)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let curl = |args: &[&str]| {
        let out = Command::new("curl")
            .args([
                "-s",
                "--max-time",
                "20",
                "-o",
                "/dev/null",
                "-w",
                "%{http_code}",
            ])
            .args(args)
            .output()
            .expect("curl");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let until = Instant::now() + Duration::from_secs(20);
    while curl(&[&format!("http://127.0.0.1:{port}/readyz")]) != "200" {
        assert!(Instant::now() < until, "serve did not come up");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let code = curl(&[
        "-X",
        "POST",
        &format!("http://127.0.0.1:{port}/v1/jobs"),
        "-H",
        &format!("Authorization: Bearer {token}"),
        "-H",
        "Content-Type: application/json",
        "--data",
        r#"{"job_id":"served-1","kind":"incident.summary","deadline_ms":60000,"payload":{"prompt":"x"}}"#,
    ]);
    assert_eq!(code, "202");
    terminate(&mut serve);

    let mut work = IncomingStream::open(&env.broker, &env.topo.names.work_queue, 1, "inspect")
        .await
        .unwrap();
    let msg = tokio::time::timeout(Duration::from_secs(5), work.next())
        .await
        .expect("the job is in the work queue")
        .unwrap()
        .unwrap();
    let body: Value = serde_json::from_slice(&msg.body).unwrap();
    let key = lastcall_core::SigningKey::new(KEY).unwrap();
    assert_eq!(
        lastcall_core::signature::verify(
            &key,
            "served-1",
            body["expires_at_ms"].as_i64().unwrap(),
            &msg.body,
            msg.signature.as_deref(),
        ),
        Ok(()),
        "signature {:?}",
        msg.signature
    );
    msg.settler.ack().await.unwrap();
    work.close().await;
    env.cleanup().await;
}
