//! The dashboard in real headless Chromium (Debian's `chromium`) against a running system:
//! the page is opened with Basic credentials (the token as password), the numbers it shows
//! match the ledger, and a screenshot is written.

mod common;

use common::*;
use lastcall_clock::now_ms;
use lastcall_http::MetricsSource;
use lastcall_http::depth::{DepthProbe, Management};
use lastcall_producer::{DeadlineSpec, NewJob};
use lastcall_worker::stats::WorkerCollector;
use serde_json::json;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

fn new_job(id: &str, budget_ms: u64) -> NewJob {
    NewJob {
        job_id: Some(id.into()),
        kind: "incident.summary".into(),
        payload: json!({"messages": [{"role": "user", "content": "x"}]})
            .as_object()
            .cloned()
            .unwrap(),
        deadline: DeadlineSpec::RelativeMs(budget_ms),
        min_runtime_ms: None,
        trace_id: None,
    }
}

fn chromium(args: &[&str], profile: &Path) -> std::process::Output {
    let bin = ["chromium", "chromium-browser"]
        .into_iter()
        .find(|b| Command::new(b).arg("--version").output().is_ok_and(|o| o.status.success()))
        .expect("Chromium is needed for the dashboard test: run scripts/setup-browser.sh (Debian package `chromium`)");
    Command::new(bin)
        .args([
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--hide-scrollbars",
        ])
        .arg(format!("--user-data-dir={}", profile.display()))
        .args(args)
        .output()
        .expect("run chromium")
}

/// The text of the element with `id` in a dumped DOM.
fn text_of(dom: &str, id: &str) -> Option<String> {
    let start = dom.find(&format!("id=\"{id}\""))?;
    let rest = &dom[start..];
    let open = rest.find('>')? + 1;
    let close = rest[open..].find('<')?;
    Some(rest[open..open + close].to_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_chromium_shows_the_ledger_numbers() {
    let env = Env::new("dash").await;
    let sub = env.submitter(Duration::from_secs(5)).await;
    for i in 0..2 {
        sub.submit(&new_job(&format!("b{i}"), 300), now_ms())
            .await
            .unwrap();
    }
    env.wait_ready(&env.topo.names.dead_queue, 2).await;
    let (stop_worker, worker, stats) = env.start_worker(1, 250).await;
    for i in 0..8 {
        sub.submit(&new_job(&format!("d{i}"), 900), now_ms())
            .await
            .unwrap();
    }
    env.drain_dead_letters().await;
    env.wait_settled(Duration::from_secs(15)).await;

    // The worker's metrics endpoint, scraped by the dashboard.
    let stop = CancellationToken::new();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(lastcall_http::serve(
        "127.0.0.1:0".parse().unwrap(),
        lastcall_http::metrics_app(MetricsSource::default().with_collector(WorkerCollector(stats))),
        stop.clone(),
        Some(tx),
    ));
    let worker_addr = rx.await.unwrap();
    let mut state = env.state_with(Duration::from_secs(5)).await;
    state.worker_metrics = vec![format!("http://{worker_addr}/metrics")];
    state.depth = Some(DepthProbe::new(
        vec![
            env.topo.names.work_queue.clone(),
            env.topo.names.dead_queue.clone(),
        ],
        Some(Management {
            base_url: "http://127.0.0.1:15672".into(),
            user: "guest".into(),
            password: "guest".into(),
            vhost: "%2f".into(),
        }),
        Some(env.broker.clone()),
    ));
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(lastcall_http::serve(
        "127.0.0.1:0".parse().unwrap(),
        lastcall_http::app(Arc::new(state)),
        stop.clone(),
        Some(tx),
    ));
    let addr = rx.await.unwrap();
    // The browser's way in: Basic credentials (token as password) answer the page's 401
    // challenge; the page's polls carry them from the auth cache. No token in any URL
    // the server sees.
    let url = format!("http://lastcall:{TOKEN}@{addr}/");

    let profile = env.dir.join("chromium-profile");
    let dom_out = {
        let url = url.clone();
        let profile = profile.clone();
        tokio::task::spawn_blocking(move || {
            chromium(
                &["--virtual-time-budget=10000", "--dump-dom", &url],
                &profile,
            )
        })
        .await
        .unwrap()
    };
    let dom = String::from_utf8_lossy(&dom_out.stdout).into_owned();
    assert!(
        dom.contains("data-loaded=\"1\""),
        "the page loaded its data: {}\n{dom}",
        String::from_utf8_lossy(&dom_out.stderr)
    );
    let ledger = env.ledger.counts_by_state().await.unwrap();
    let count = |s: &str| {
        ledger
            .iter()
            .find(|(st, _)| st == s)
            .map(|(_, n)| *n)
            .unwrap_or(0)
    };
    for state in [
        "completed",
        "expired_not_started",
        "expired_before_receive",
        "failed",
        "unknown",
    ] {
        assert_eq!(
            text_of(&dom, &format!("outcome-{state}")).as_deref(),
            Some(count(state).to_string().as_str()),
            "{state} on the page vs the ledger ({ledger:?})"
        );
    }
    assert!(
        count("completed") >= 1 && count("expired_not_started") >= 1,
        "{ledger:?}"
    );
    assert_eq!(
        text_of(&dom, "outcome-expired_before_receive").as_deref(),
        Some("2")
    );
    assert_eq!(
        text_of(&dom, "dead-broker_ttl_expired").or_else(|| text_of(&dom, "dead-expired")),
        Some("2".into()),
        "dead letters by reason:\n{dom}"
    );
    assert_eq!(text_of(&dom, "wait-waiting_for_slot").as_deref(), Some("0"));
    assert_eq!(text_of(&dom, "wait-running").as_deref(), Some("0"));

    // The screenshot: a real PNG of some size.
    let png = env.dir.join("dashboard.png");
    let shot = chromium(
        &[
            "--virtual-time-budget=10000",
            "--window-size=1280,1000",
            &format!("--screenshot={}", png.display()),
            &url,
        ],
        &env.dir.join("chromium-profile-2"),
    );
    let bytes = std::fs::read(&png).unwrap_or_else(|e| {
        panic!(
            "no screenshot ({e}): {}",
            String::from_utf8_lossy(&shot.stderr)
        )
    });
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        bytes.len() > 20_000,
        "a non-trivial image, got {} bytes",
        bytes.len()
    );
    if let Ok(keep) = std::env::var("LASTCALL_DASHBOARD_PNG") {
        std::fs::copy(&png, keep).unwrap();
    }

    stop.cancel();
    stop_worker.cancel();
    worker.await.unwrap();
    env.cleanup().await;
}
