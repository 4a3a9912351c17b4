//! OpenTelemetry export (`--features otlp`): a worker started with `--otlp-endpoint` sends
//! its job spans over OTLP/HTTP. The receiver here is a bare HTTP listener that keeps the
//! POSTed protobuf bodies; the test looks for the job's span fields in them.
#![cfg(feature = "otlp")]

use crate::common;

use common::*;
use lastcall_worker::clock::now_ms;
use std::io::{Read, Write};
use std::net::TcpListener;
use std::process::{Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// The requests a receiver got: (path, body).
type Received = Arc<Mutex<Vec<(String, Vec<u8>)>>>;

/// Accept OTLP/HTTP POSTs, answer 200, and keep (path, body) of each.
fn receiver() -> (String, Received) {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", listener.local_addr().unwrap());
    let got = Arc::new(Mutex::new(Vec::new()));
    let keep = got.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut s) = stream else { continue };
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let mut buf = Vec::new();
            let mut chunk = [0u8; 8192];
            // Headers, then Content-Length bytes of body.
            let (head_end, len) = loop {
                let n = s.read(&mut chunk).unwrap_or(0);
                if n == 0 {
                    break (None, 0);
                }
                buf.extend_from_slice(&chunk[..n]);
                if let Some(i) = buf.windows(4).position(|w| w == b"\r\n\r\n") {
                    let head = String::from_utf8_lossy(&buf[..i]).to_lowercase();
                    let len = head
                        .lines()
                        .find_map(|l| {
                            l.strip_prefix("content-length:")
                                .map(|v| v.trim().parse::<usize>().unwrap_or(0))
                        })
                        .unwrap_or(0);
                    break (Some(i + 4), len);
                }
            };
            let Some(start) = head_end else { continue };
            while buf.len() < start + len {
                let n = s.read(&mut chunk).unwrap_or(0);
                if n == 0 {
                    break;
                }
                buf.extend_from_slice(&chunk[..n]);
            }
            let path = String::from_utf8_lossy(&buf[..start])
                .split_whitespace()
                .nth(1)
                .unwrap_or("")
                .to_owned();
            keep.lock().unwrap().push((path, buf[start..].to_vec()));
            let _ = s.write_all(b"HTTP/1.1 200 OK\r\ncontent-type: application/x-protobuf\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
    });
    (url, got)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_exports_job_spans_over_otlp() {
    let env = Env::sqlite("otlp").await;
    let (url, got) = receiver();
    let mut child = env
        .command()
        .args([
            "--otlp-endpoint",
            &url,
            "worker",
            "--backend",
            "sim",
            "--slots",
            "1",
            "--sim-latency-ms",
            "10",
            "--retry-delays-ms",
            "1000,5000",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    env.submitter(0, true)
        .await
        .submit(&job("otlp-job-1", 30_000), now_ms())
        .await
        .unwrap();
    env.wait_terminal(&["otlp-job-1".into()], Duration::from_secs(20))
        .await;
    // SIGTERM: the worker drains, and dropping the exporter flushes the batch.
    let _ = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(15);
    while child.try_wait().unwrap().is_none() {
        assert!(Instant::now() < until, "worker did not stop");
        std::thread::sleep(Duration::from_millis(50));
    }
    let until = Instant::now() + Duration::from_secs(5);
    loop {
        let bodies = got.lock().unwrap().clone();
        let traces: Vec<_> = bodies.iter().filter(|(p, _)| p == "/v1/traces").collect();
        let has = |needle: &[u8]| {
            traces
                .iter()
                .any(|(_, b)| b.windows(needle.len()).any(|w| w == needle))
        };
        if has(b"otlp-job-1") {
            assert!(has(b"job_id"), "the span carries the job_id field");
            assert!(has(b"expires_at_ms"), "and the deadline");
            assert!(has(b"lastcall"), "service name");
            break;
        }
        assert!(
            Instant::now() < until,
            "no OTLP trace export with the job's span arrived ({} requests)",
            bodies.len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    env.cleanup().await;
}
