//! The HTTP surface's views of a running worker, against the real broker and ledger:
//! `/metrics` after a scripted run matches the ledger and its series stay bounded; the
//! dashboard in real headless Chromium (Debian's `chromium`), opened with Basic
//! credentials (the token as password), shows the ledger's numbers, and a screenshot is
//! written. (These need a worker and the dead-letter processor, so they live here and not
//! in `crates/http`, which does not depend on the worker runtime.)

use crate::common;

use common::*;
use lastcall_broker::management::Management;
use lastcall_http::depth::DepthProbe;
use lastcall_http::metrics::sample_value;
use lastcall_http::{AppState, MetricsSource, Token};
use lastcall_worker::clock::now_ms;
use lastcall_worker::stats::{DlqCollector, WorkerCollector};
use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

const TOKEN: &str = "test-token-0123456789";

/// `{prefix}0` .. `{prefix}{n-1}`: the ids of one phase of submissions.
fn ids(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}{i}")).collect()
}

/// The ingress API's state on this environment (what `lastcall serve` builds).
async fn app_state(env: &Env) -> AppState {
    AppState::new(
        env.submitter(100, true).await,
        env.ledger.clone(),
        system_clock(),
        Token::new(TOKEN).unwrap(),
        env.topo.names.clone(),
    )
}

/// Sum of a family's samples by one label.
fn sum_by(text: &str, family: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text
        .lines()
        .filter(|l| l.starts_with(&format!("{family}{{")))
    {
        let (series, value) = line.rsplit_once(' ').unwrap();
        let key = format!("{label}=\"");
        let Some(start) = series.find(&key) else {
            continue;
        };
        let rest = &series[start + key.len()..];
        let v = rest[..rest.find('"').unwrap()].to_owned();
        *out.entry(v).or_default() += value.parse::<f64>().unwrap();
    }
    out
}

fn series(text: &str) -> usize {
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .count()
}

/// Jobs alternate between two kinds: the even ones `incident.summary`, the odd ones
/// `code.answer`.
fn two_kinds(i: usize) -> &'static str {
    if i.is_multiple_of(2) {
        "incident.summary"
    } else {
        "code.answer"
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_match_the_ledger_and_series_stay_bounded() {
    let env = Env::sqlite("metrics").await;
    let sub = env.submitter(100, true).await;
    // Two jobs expire in the broker before any worker runs.
    for i in 0..2 {
        sub.submit(
            &job_of_kind(&format!("b{i}"), "incident.summary", 300),
            now_ms(),
        )
        .await
        .unwrap();
    }
    env.wait_ready(&env.topo.names.dead_queue, 2).await;
    let worker = env
        .start_worker(env.worker_config(1, 4), sim(250), system_clock())
        .await;
    let stats = worker.stats.clone();
    let dlq = env.drain_dead_letters(false).await;
    // Known outcomes first: one job of each kind with a budget far beyond any wait, so
    // both kinds have a `completed` series whatever the machine's load (under CI load the
    // timed phase below once completed no `code.answer` job, and the second phase then
    // added that series).
    for (i, kind) in ["incident.summary", "code.answer"].iter().enumerate() {
        sub.submit(&job_of_kind(&format!("w{i}"), kind, 600_000), now_ms())
            .await
            .unwrap();
    }
    env.wait_terminal(&ids("w", 2), Duration::from_secs(30))
        .await;
    // One slot, 250 ms per call, 900 ms budgets: at most 4 of these 8 fit (by the clock,
    // not by the machine's speed), so the rest expire waiting.
    for i in 0..8 {
        let kind = two_kinds(i);
        sub.submit(&job_of_kind(&format!("m{i}"), kind, 900), now_ms())
            .await
            .unwrap();
    }
    env.wait_terminal(&ids("m", 8), Duration::from_secs(15))
        .await;
    let source = MetricsSource::default()
        .with_collector(WorkerCollector(stats.clone()))
        .with_collector(DlqCollector(dlq.clone()))
        .with_ledger(env.ledger.clone());
    let text = source.render().await;
    let ledger: BTreeMap<String, i64> = env
        .ledger
        .counts_by_state()
        .await
        .unwrap()
        .into_iter()
        .collect();
    let outcomes = sum_by(&text, "lastcall_outcomes_total", "state");
    for state in ["completed", "expired_not_started"] {
        assert_eq!(
            outcomes.get(state).copied().unwrap_or(0.0) as i64,
            ledger.get(state).copied().unwrap_or(0),
            "{state}: metrics vs ledger\n{text}"
        );
    }
    assert!(
        ledger.get("completed").copied().unwrap_or(0) >= 1,
        "{ledger:?}"
    );
    assert!(
        ledger.get("expired_not_started").copied().unwrap_or(0) >= 1,
        "{ledger:?}"
    );
    assert_eq!(
        sample_value(&text, "lastcall_dead_letters_total{reason=\"expired\"}").unwrap() as i64,
        ledger["expired_before_receive"],
    );
    // The two `b` jobs expire in the broker by design; on a very busy machine a 900 ms `m`
    // job may also expire there before its delivery. Every other job was received.
    let in_broker = ledger["expired_before_receive"];
    assert!(in_broker >= 2, "{ledger:?}");
    let received = 12 - in_broker;
    let recs = env.ledger.records_since(0).await.unwrap();
    let calls: i64 = recs.iter().map(|r| r.backend_calls).sum();
    assert_eq!(
        sample_value(&text, "lastcall_worker_backend_calls_total").unwrap() as i64,
        calls
    );
    assert_eq!(
        sample_value(&text, "lastcall_model_call_seconds_count").unwrap() as i64,
        calls
    );
    let tokens: i64 = recs.iter().filter_map(|r| r.completion_tokens).sum();
    assert!(tokens > 0, "the sim backend reports usage");
    assert_eq!(
        sample_value(&text, "lastcall_model_tokens_total{type=\"completion\"}").unwrap() as i64,
        tokens,
        "token usage in the metrics matches the ledger"
    );
    let checked = recs.iter().filter(|r| r.checked_at_ms.is_some()).count() as i64;
    assert_eq!(
        sample_value(&text, "lastcall_consumer_dwell_seconds_count").unwrap() as i64,
        checked
    );
    assert_eq!(
        sample_value(&text, "lastcall_queue_dwell_seconds_count").unwrap() as i64,
        received
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_received_total").unwrap() as i64,
        received
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_slots_total").unwrap() as i64,
        1
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_slots_busy").unwrap() as i64,
        0
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_concurrency_limit").unwrap() as i64,
        1,
        "fixed slots: the limit is their count"
    );
    assert_eq!(
        sample_value(&text, "lastcall_worker_prefetch").unwrap() as i64,
        4
    );
    for (state, n) in &ledger {
        assert_eq!(
            sample_value(&text, &format!("lastcall_ledger_jobs{{state=\"{state}\"}}")).unwrap()
                as i64,
            *n
        );
    }
    assert!(
        !text.contains("m0") && !text.contains("b0"),
        "no job id in any label"
    );

    // Many more jobs of the same kinds and outcome (`completed`, which both kinds already
    // have): the same number of series.
    let before = series(&text);
    for i in 0..20 {
        let kind = two_kinds(i);
        // A budget far beyond any wait: every one of these completes.
        sub.submit(&job_of_kind(&format!("n{i}"), kind, 600_000), now_ms())
            .await
            .unwrap();
    }
    env.wait_terminal(&ids("n", 20), Duration::from_secs(30))
        .await;
    let completed_after = env
        .ledger
        .counts_by_state()
        .await
        .unwrap()
        .into_iter()
        .find(|(s, _)| s == "completed")
        .unwrap()
        .1;
    assert_eq!(
        completed_after - ledger["completed"],
        20,
        "every second-phase job completes (the premise of the series check)"
    );
    let text2 = source.render().await;
    assert_eq!(
        series(&text2),
        before,
        "series grew with the number of jobs:\n{text2}"
    );
    assert_eq!(
        sum_by(&text2, "lastcall_outcomes_total", "state")["completed"] as i64,
        env.ledger
            .counts_by_state()
            .await
            .unwrap()
            .into_iter()
            .find(|(s, _)| s == "completed")
            .unwrap()
            .1
    );
    worker.stop().await;
    env.cleanup().await;
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
    let env = Env::sqlite("dash").await;
    let sub = env.submitter(100, true).await;
    for i in 0..2 {
        sub.submit(&job(&format!("b{i}"), 300), now_ms())
            .await
            .unwrap();
    }
    env.wait_ready(&env.topo.names.dead_queue, 2).await;
    let worker = env
        .start_worker(env.worker_config(1, 4), sim(250), system_clock())
        .await;
    for i in 0..8 {
        sub.submit(&job(&format!("d{i}"), 900), now_ms())
            .await
            .unwrap();
    }
    env.drain_dead_letters(false).await;
    env.wait_terminal(
        &[ids("b", 2), ids("d", 8)].concat(),
        Duration::from_secs(15),
    )
    .await;

    // The worker's metrics endpoint, scraped by the dashboard.
    let stop = CancellationToken::new();
    let worker_addr = lastcall_http::listen(
        "127.0.0.1:0".parse().unwrap(),
        lastcall_http::metrics_app(
            MetricsSource::default().with_collector(WorkerCollector(worker.stats.clone())),
        ),
        stop.clone(),
        None,
    )
    .await
    .unwrap()
    .addr;
    let mut state = app_state(&env).await;
    state.worker_metrics = vec![format!("http://{worker_addr}/metrics")];
    state.depth = Some(DepthProbe::new(
        vec![
            env.topo.names.work_queue.clone(),
            env.topo.names.dead_queue.clone(),
        ],
        Some(Management::new(
            "http://127.0.0.1:15672",
            "guest",
            "guest",
            "/",
        )),
        Some(env.broker.clone()),
    ));
    let addr = lastcall_http::listen(
        "127.0.0.1:0".parse().unwrap(),
        lastcall_http::app(Arc::new(state)),
        stop.clone(),
        None,
    )
    .await
    .unwrap()
    .addr;
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
    // The per-tenant table: every job here is tenant `default`'s (it named none).
    assert_eq!(
        text_of(&dom, "tenant-on-time-default").as_deref(),
        Some(count("completed").to_string().as_str()),
        "the per-tenant table:\n{dom}"
    );
    assert_eq!(text_of(&dom, "wait-waiting_for_slot").as_deref(), Some("0"));
    assert_eq!(text_of(&dom, "wait-running").as_deref(), Some("0"));
    assert_eq!(
        text_of(&dom, "wait-concurrency_limit").as_deref(),
        Some("1"),
        "the workers' concurrency limit (1 slot)"
    );

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
    worker.stop().await;
    env.cleanup().await;
}

/// The dashboard bins the ledger's dwell times with the worker histograms' bounds.
#[test]
fn the_dashboard_uses_the_workers_dwell_buckets() {
    assert_eq!(
        lastcall_http::dashboard::DWELL_BUCKETS_MS,
        lastcall_worker::stats::DWELL_BUCKETS_MS
    );
}
