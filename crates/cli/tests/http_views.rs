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

/// The tenants of the dashboard test: long names, to hold the layout to its cards.
const TENANTS: [&str; 3] = [
    "research-evaluation-batch-nightly",
    "support-chat",
    "acme-corp-internal-tools-platform",
];

/// `GET path` on the dashboard server with the token.
async fn get_text(addr: std::net::SocketAddr, path: &str) -> String {
    reqwest::Client::new()
        .get(format!("http://{addr}{path}"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .error_for_status()
        .unwrap()
        .text()
        .await
        .unwrap()
}

/// Poll `/v1/dashboard` until `ok` holds (management statistics and lease renewals lag).
async fn dashboard_until(
    addr: std::net::SocketAddr,
    what: &str,
    ok: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let until = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let d: serde_json::Value =
            serde_json::from_str(&get_text(addr, "/v1/dashboard").await).unwrap();
        if ok(&d) {
            return d;
        }
        assert!(
            std::time::Instant::now() < until,
            "{what}: {}",
            serde_json::to_string_pretty(&d).unwrap()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

fn has_alert(d: &serde_json::Value, alert: &str) -> bool {
    d["alerts"]
        .as_array()
        .unwrap()
        .iter()
        .any(|a| a["alert"] == alert)
}

/// The dashboard as a new user meets it (issue #53): `serve` with no worker address, a
/// worker, jobs of three tenants, in headless Chromium at 1024 and 1400 px. The headline
/// figures are the ledger's (and `lastcall report`'s), the live tiles come from the
/// worker's lease, dead letters left unprocessed raise an alert, the server-rendered first
/// state carries the numbers, and no element runs out of its card at either width.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dashboard_in_chromium_shows_the_ledger_numbers() {
    let env = Env::sqlite("dash").await;
    let sub = env.submitter(100, true).await;
    let submit = async |id: String, budget: u64, tenant: &str| {
        let e = sub
            .envelope(&job(&id, budget), now_ms())
            .unwrap()
            .with_tenant(lastcall_core::Tenant::parse(tenant).unwrap());
        sub.submit_envelope(&e, None, now_ms()).await.unwrap();
    };

    // `serve` as README runs it: no `--worker-metrics`.
    let stop = CancellationToken::new();
    let mut state = app_state(&env).await;
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
    assert!(state.worker_metrics.is_empty());
    let addr = lastcall_http::listen(
        "127.0.0.1:0".parse().unwrap(),
        lastcall_http::app(Arc::new(state)),
        stop.clone(),
        None,
    )
    .await
    .unwrap()
    .addr;

    // Two jobs expire in the queue before any worker runs: dead letters that nothing
    // processes yet, which the page must say.
    for i in 0..2 {
        submit(format!("b{i}"), 300, "default").await;
    }
    env.wait_ready(&env.topo.names.dead_queue, 2).await;
    dashboard_until(addr, "the unprocessed dead letters' alert", |d| {
        has_alert(d, "dead_letters_unprocessed")
    })
    .await;

    let worker = env
        .start_worker(env.worker_config(1, 4), sim(250), system_clock())
        .await;
    let mut all = ids("b", 2);
    for i in 0..12 {
        let id = format!("d{i}");
        submit(id.clone(), 900, TENANTS[i % 3]).await;
        all.push(id);
    }
    env.drain_dead_letters(false).await;
    env.wait_terminal(&all, Duration::from_secs(20)).await;
    // The worker found without wiring: its lease carries its numbers.
    let d = dashboard_until(addr, "the worker's live numbers from its lease", |d| {
        d["waiting"]["concurrency_limit"] == 1
            && d["waiting"]["workers_live"] == 1
            && d["waiting"]["running"] == 0
            && d["workers"]["workers"][0]["live"]["learned_call_ms"]["incident.summary"]
                .as_u64()
                .is_some()
            && !has_alert(d, "dead_letters_unprocessed")
    })
    .await;
    assert_eq!(d["waiting"]["live_source"], "leases");
    let w = &d["workers"]["workers"][0];
    assert_eq!(
        (w["worker"].as_str(), w["stale"].as_bool()),
        (Some("test-worker"), Some(false))
    );
    assert!(
        w["live"]["learned_call_ms"]["incident.summary"]
            .as_u64()
            .unwrap()
            > 0,
        "the learned call time: {w}"
    );

    // The headline from the ledger's own records: every job here arrived in the window.
    let mut recs = Vec::new();
    for id in &all {
        recs.push(env.ledger.get(id).await.unwrap().unwrap());
    }
    let n = |p: &dyn Fn(&str) -> bool| recs.iter().filter(|r| p(&r.state)).count() as u64;
    let arrivals = recs.len() as u64;
    let on_time = n(&|s| s == "completed");
    let refused =
        n(&|s| ["expired_not_started", "expired_before_receive", "rejected"].contains(&s));
    let wasted: u64 = recs.iter().map(|r| r.wasted_model_ms.max(0) as u64).sum();
    assert!(
        on_time >= 1 && refused >= 3,
        "{:?}",
        recs.iter().map(|r| &r.state).collect::<Vec<_>>()
    );
    let pct = format!(
        "{:.1}%",
        (1000.0 * on_time as f64 / arrivals as f64).round() / 10.0
    );
    let wasted_text = format!("{:.1} s", wasted as f64 / 1000.0);
    let h = &d["headline"];
    assert_eq!(
        (
            h["arrivals"].as_u64(),
            h["on_time"].as_u64(),
            h["refused"].as_u64(),
            h["wasted_model_ms"].as_u64()
        ),
        (Some(arrivals), Some(on_time), Some(refused), Some(wasted)),
        "{h}"
    );
    // `lastcall report` prints the same figures (the same computation).
    let out = env.cli(&["report", "--since", "15m", "--format", "json"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    for k in [
        "arrivals",
        "on_time",
        "on_time_pct",
        "refused",
        "pending",
        "wasted_model_ms",
        "queue_dwell_p99_ms",
    ] {
        assert_eq!(rep["headline"][k], h[k], "report vs dashboard: {k}");
    }

    // The first state is rendered by the server: numbers without running any script.
    let html = get_text(addr, "/").await;
    for (id, want) in [
        ("h-on_time", pct.as_str()),
        ("h-refused", &refused.to_string()),
        ("h-wasted", &wasted_text),
        ("wait-concurrency_limit", "1"),
        ("wait-running", "0"),
    ] {
        assert_eq!(
            text_of(&html, id).as_deref(),
            Some(want),
            "server-rendered {id}"
        );
    }
    assert!(!html.contains("{{"), "every placeholder is filled");

    // The browser: Basic credentials (token as password) answer the page's 401 challenge;
    // the page's polls carry them from the auth cache. No token in any URL the server sees.
    let url = format!("http://lastcall:{TOKEN}@{addr}/");
    let counts = env.ledger.counts_by_state().await.unwrap();
    let count = |s: &str| {
        counts
            .iter()
            .find(|(st, _)| st == s)
            .map(|(_, n)| *n)
            .unwrap_or(0)
    };
    for width in [1024, 1400] {
        let dom_out = {
            let (url, profile) = (url.clone(), env.dir.join(format!("chromium-dom-{width}")));
            tokio::task::spawn_blocking(move || {
                chromium(
                    &[
                        "--virtual-time-budget=10000",
                        &format!("--window-size={width},1100"),
                        "--dump-dom",
                        &url,
                    ],
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
        assert!(
            dom.contains(&format!("data-width=\"{width}\"")),
            "{width} px wide"
        );
        assert!(
            dom.contains("data-overflow=\"\""),
            "nothing runs out of its card at {width} px: {:?}",
            dom.split("data-overflow=\"")
                .nth(1)
                .and_then(|r| r.split('"').next())
        );
        for (id, want) in [
            ("h-on_time", pct.clone()),
            ("h-refused", refused.to_string()),
            ("h-wasted", wasted_text.clone()),
            ("wait-waiting_for_slot", "0".into()),
            ("wait-running", "0".into()),
            ("wait-concurrency_limit", "1".into()),
            ("worker-limit-test-worker", "1".into()),
        ] {
            assert_eq!(
                text_of(&dom, id).as_deref(),
                Some(want.as_str()),
                "{id} at {width} px"
            );
        }
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
                "{state} on the page vs the ledger ({counts:?})"
            );
        }
        assert_eq!(
            text_of(&dom, "outcome-expired_before_receive").as_deref(),
            Some("2")
        );
        assert_eq!(
            text_of(&dom, "dead-broker_ttl_expired").or_else(|| text_of(&dom, "dead-expired")),
            Some("2".into()),
            "dead letters by reason:\n{dom}"
        );
        for t in TENANTS {
            let want = recs
                .iter()
                .filter(|r| r.tenant == t && r.state == "completed")
                .count();
            assert_eq!(
                text_of(&dom, &format!("tenant-on-time-{t}")).as_deref(),
                Some(want.to_string().as_str()),
                "the per-tenant table:\n{dom}"
            );
        }

        // The screenshot: a real PNG of some size.
        let png = env.dir.join(format!("dashboard-{width}.png"));
        let shot = chromium(
            &[
                "--virtual-time-budget=10000",
                // Tall enough for every card (the per-tenant table too).
                &format!("--window-size={width},1800"),
                &format!("--screenshot={}", png.display()),
                &url,
            ],
            &env.dir.join(format!("chromium-shot-{width}")),
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
        if width == 1400
            && let Ok(keep) = std::env::var("LASTCALL_DASHBOARD_PNG")
        {
            std::fs::copy(&png, keep).unwrap();
        }
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
