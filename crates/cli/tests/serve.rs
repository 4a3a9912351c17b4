//! `lastcall serve` as an operator runs it: the real binary on a real socket, with the
//! token from the environment, in front of the real broker and ledger.

use crate::common;

use common::serve::Serve;
use common::*;
use std::process::Command;
use std::time::{Duration, Instant};

const TOKEN: &str = "serve-test-token-0123456789";

fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output_bounded()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_binary_accepts_jobs_over_http_with_auth_and_exposes_metrics() {
    let env = Env::sqlite("serve").await;
    // Killed on drop: a failed assertion leaves no server behind.
    let mut serve = Serve::start(&env, TOKEN, &[]).await;
    let base = serve.base.clone();
    let child = &mut serve.child;
    let auth = format!("Authorization: Bearer {TOKEN}");
    let body = r#"{"job_id":"http-1","kind":"incident.summary","deadline_ms":60000,"payload":{"prompt":"summarize"}}"#;
    let (code, _) = curl(&[
        "-X",
        "POST",
        &format!("{base}/v1/jobs"),
        "-H",
        "Content-Type: application/json",
        "--data",
        body,
    ]);
    assert_eq!(code, 401, "no token, no job");
    let (code, resp) = curl(&[
        "-X",
        "POST",
        &format!("{base}/v1/jobs"),
        "-H",
        &auth,
        "-H",
        "Content-Type: application/json",
        "--data",
        body,
    ]);
    assert_eq!(code, 202, "{resp}");
    assert!(resp.contains("http-1"), "{resp}");
    let rec = env
        .ledger
        .get("http-1")
        .await
        .unwrap()
        .expect("accepted in the ledger");
    assert_eq!(rec.state, "accepted");
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 1, "published");
    let (code, resp) = curl(&[&format!("{base}/v1/jobs/http-1"), "-H", &auth]);
    assert_eq!(code, 200, "{resp}");
    assert!(resp.contains("\"state\":\"accepted\""), "{resp}");
    let (code, resp) = curl(&[
        "-X",
        "POST",
        &format!("{base}/v1/jobs"),
        "-H",
        &auth,
        "-H",
        "Content-Type: application/json",
        "--data",
        r#"{"kind":"Bad Kind","deadline_ms":1000,"payload":{}}"#,
    ]);
    assert_eq!(code, 400, "{resp}");
    assert!(resp.contains("kind"), "the error names the field: {resp}");
    let (code, metrics) = curl(&[&format!("{base}/metrics"), "-H", &auth]);
    assert_eq!(code, 200);
    assert!(metrics.contains("# TYPE"), "{metrics}");
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(10);
    while child.try_wait().unwrap().is_none() {
        if Instant::now() > until {
            let _ = child.kill();
            panic!("serve did not stop on SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    env.cleanup().await;
}

/// A port that is taken is an error at once, before `serve` (or a worker with
/// `--metrics-addr`) waits for its broker: here the broker URL points at a closed port, so
/// a process that waited for it first would not exit until the test's time limit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_taken_port_is_an_error_at_once_naming_the_address() {
    let env = Env::sqlite("serve-port-taken").await;
    let taken = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = taken.local_addr().unwrap().to_string();
    let nowhere = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f",
        common::private_rabbit::free_port()
    );
    let runs = [
        (
            vec!["serve", "--addr", addr.as_str()],
            format!(
                "cannot serve HTTP on {addr} (another process listens there: stop it, or pass another --addr)"
            ),
        ),
        (
            vec![
                "worker",
                "--backend",
                "sim",
                "--metrics-addr",
                addr.as_str(),
            ],
            format!("cannot listen on --metrics-addr {addr} (another process listens there"),
        ),
    ];
    for (args, expected) in runs {
        let out = env
            .command_with_amqp(&nowhere)
            .args(&args)
            .env("LASTCALL_HTTP_TOKEN", TOKEN)
            .output_bounded()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(1), "{args:?}: {stderr}");
        assert!(stderr.contains(&expected), "{args:?}: {stderr}");
        assert!(stderr.contains("in use"), "the OS's reason: {stderr}");
        assert!(
            !stderr.contains("waiting for the broker"),
            "{args:?} waited for the broker first: {stderr}"
        );
    }
    drop(taken);
    env.cleanup().await;
}
