//! Reconciliation and reports: every accepted job of a mixed failure run ends in exactly
//! one terminal outcome, `lastcall reconcile` proves it (and is idempotent), a real
//! outcome that arrives after reconciliation replaces `unknown` (a late outcome, counted),
//! and `lastcall report` aggregates it. Real broker, real ledgers, the real binary.

use crate::common;

use common::*;
use lastcall_core::State;
use lastcall_store::ListFilter;
use lastcall_worker::clock::now_ms;
use serde_json::{Value, json};
use std::time::Duration;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// Run `lastcall reconcile --json` with `extra` flags: (exit code, parsed output).
fn reconcile(env: &Env, extra: &[&str]) -> (i32, Value) {
    let mut args = vec!["reconcile", "--json"];
    args.extend_from_slice(extra);
    let out = env.cli(&args);
    let code = out.status.code().expect("exited normally");
    let v = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {} / {}", text(&out.stdout), text(&out.stderr)));
    (code, v)
}

/// Every job in the ledger is terminal, and the inventory is exactly `ids`.
async fn assert_all_terminal(env: &Env, ids: &[&str]) -> Vec<lastcall_store::JobRecord> {
    let all = env.ledger.list(&ListFilter::default()).await.unwrap();
    let mut seen: Vec<&str> = all.iter().map(|r| r.job_id.as_str()).collect();
    seen.sort();
    let mut want = ids.to_vec();
    want.sort();
    assert_eq!(seen, want, "one record per accepted job");
    for r in &all {
        assert!(
            r.state.parse::<State>().unwrap().is_terminal(),
            "{} is still {}",
            r.job_id,
            r.state
        );
    }
    all
}

async fn mixed_run(env: Env) {
    let sim = sim(0);
    let s = env.submitter(0, true).await;
    // 1. Expired at the broker while no worker ran; the DLQ processor records it.
    s.submit(&job("exp-broker", 500), now_ms()).await.unwrap();
    env.wait_ready(&env.topo.names.dead_queue, 1).await;
    env.drain_dead_letters(false).await;

    // 2. One slot: `ok` runs 1.5 s; `late` is delivered but cannot start in time while it
    //    waits for the slot; `bad` fails for good and is dead-lettered by the worker.
    let w = env
        .start_worker(env.worker_config(1, 2), sim.clone(), system_clock())
        .await;
    s.submit(
        &job_with("ok", 60_000, json!({"sim_latency_ms": 1_500})),
        now_ms(),
    )
    .await
    .unwrap();
    let until = std::time::Instant::now() + Duration::from_secs(10);
    while sim.calls_for("ok") == 0 {
        assert!(std::time::Instant::now() < until, "`ok` did not start");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    s.submit(&job("late", 800), now_ms()).await.unwrap();
    s.submit(&job_of_kind("bad", "sim.fail-terminal", 60_000), now_ms())
        .await
        .unwrap();
    env.wait_terminal(
        &["ok".into(), "late".into(), "bad".into()],
        Duration::from_secs(15),
    )
    .await;
    w.stop().await;

    // 3. The worker and the DLQ processor are stopped: two jobs expire at the broker and
    //    their dead letters wait unprocessed.
    s.submit(&job("orphan-1", 400), now_ms()).await.unwrap();
    let last = s.submit(&job("orphan-2", 400), now_ms()).await.unwrap();
    // 4. Accepted with a long deadline and not consumed yet: not due, so not unknown.
    s.submit(&job("pending", 60_000), now_ms()).await.unwrap();
    // bad + two orphans
    env.wait_ready(&env.topo.names.dead_queue, 3).await;
    // Reconciliation below marks what is past deadline + 200 ms grace: let the clock get
    // there (a time condition, not a wait for an event).
    let due = last.expires_at_ms + 200;
    while now_ms() <= due {
        tokio::time::sleep(Duration::from_millis((due + 1 - now_ms()).max(1) as u64)).await;
    }

    let (code, v) = reconcile(&env, &["--grace-ms", "200"]);
    assert_eq!(code, 3, "unknown jobs exit non-zero: {v}");
    assert_eq!(v["marked_unknown"], json!(["orphan-1", "orphan-2"]));
    assert_eq!(v["unknown"], 2);
    assert_eq!(v["pending"], 1);
    assert_eq!(v["late_outcomes"], 0);
    assert_eq!(v["total"], 7);
    assert_eq!(
        v["counts"],
        json!({"accepted": 1, "completed": 1, "failed": 1, "expired_not_started": 1,
               "expired_before_receive": 1, "unknown": 2})
    );
    // Idempotent: nothing new, the same counts, still non-zero because unknowns exist.
    let (code2, v2) = reconcile(&env, &["--grace-ms", "200"]);
    assert_eq!(code2, 3);
    assert_eq!(v2["marked_unknown"], json!([]));
    assert_eq!(v2["counts"], v["counts"]);
    let (code3, _) = reconcile(&env, &["--grace-ms", "200", "--allow-unknown"]);
    assert_eq!(code3, 0);

    let reconciled_at = |r: &lastcall_store::JobRecord| {
        assert_eq!(r.state, "unknown");
        r.reconciled_at_ms
            .expect("marked unknown: reconciled_at_ms set")
    };
    let orphan_marked_at = reconciled_at(&env.ledger.get("orphan-1").await.unwrap().unwrap());
    reconciled_at(&env.ledger.get("orphan-2").await.unwrap().unwrap());

    // The DLQ processor comes back: the orphans' real outcome (expired at the broker)
    // replaces `unknown`, counted once as recorded; `bad` already had its outcome and keeps
    // it.
    let dlq = env.drain_dead_letters(false).await;
    assert_eq!(
        (
            dlq.recorded.load(std::sync::atomic::Ordering::Relaxed),
            dlq.kept_existing.load(std::sync::atomic::Ordering::Relaxed)
        ),
        (2, 1)
    );
    let orphan = env.ledger.get("orphan-1").await.unwrap().unwrap();
    assert_eq!(
        (orphan.state.as_str(), orphan.reason.as_deref()),
        ("expired_before_receive", Some("broker_ttl_expired"))
    );
    assert_eq!(orphan.reconciled_at_ms, Some(orphan_marked_at), "kept");
    assert!(orphan.recorded_at_ms.unwrap() >= orphan_marked_at);
    assert_eq!(env.ledger.late_outcomes().await.unwrap(), 2);
    let show = env.cli(&["jobs", "show", "orphan-1"]);
    assert!(show.status.success(), "{}", text(&show.stderr));
    assert!(
        text(&show.stdout).contains(&format!("reconciled_at_ms: {orphan_marked_at}")),
        "{}",
        text(&show.stdout)
    );
    // The ledger part of `serve`'s /metrics.
    let metrics = lastcall_http::MetricsSource::default()
        .with_ledger(env.ledger.clone())
        .render()
        .await;
    assert_eq!(
        lastcall_http::metrics::sample_value(&metrics, "lastcall_ledger_late_outcomes"),
        Some(2.0),
        "{metrics}"
    );
    assert_eq!(
        lastcall_http::metrics::sample_value(&metrics, "lastcall_ledger_jobs{state=\"unknown\"}"),
        Some(0.0),
        "{metrics}"
    );
    // The last job runs to completion; then every accepted job is terminal.
    let w = env
        .start_worker(env.worker_config(1, 2), sim.clone(), system_clock())
        .await;
    env.wait_terminal(&["pending".into()], Duration::from_secs(10))
        .await;
    w.stop().await;
    // No job is `unknown` any more: reconciliation is clean, and names the late outcomes.
    let (code4, v4) = reconcile(&env, &["--grace-ms", "200"]);
    assert_eq!(
        (code4, &v4["marked_unknown"], &v4["pending"], &v4["unknown"]),
        (0, &json!([]), &json!(0), &json!(0))
    );
    assert_eq!(v4["late_outcomes"], 2);
    assert_eq!(
        v4["counts"],
        json!({"completed": 2, "failed": 1, "expired_not_started": 1,
               "expired_before_receive": 3})
    );
    let all = assert_all_terminal(
        &env,
        &[
            "exp-broker",
            "ok",
            "late",
            "bad",
            "orphan-1",
            "orphan-2",
            "pending",
        ],
    )
    .await;
    let state = |id: &str| {
        let r = all.iter().find(|r| r.job_id == id).unwrap();
        (r.state.as_str(), r.reason.as_deref())
    };
    assert_eq!(state("exp-broker").0, "expired_before_receive");
    assert_eq!(state("ok").0, "completed");
    assert_eq!(state("pending").0, "completed");
    // `late` leaves the buffer unstarted: at its deadline, or before it once the call in
    // flight has run longer than its remaining budget (with too few calls to estimate, a
    // running call's elapsed time is a lower bound on the call time).
    let (late_state, late_reason) = state("late");
    assert_eq!(late_state, "expired_not_started");
    assert!(
        matches!(
            late_reason,
            Some("admission:deadline_passed" | "admission:below_learned_runtime")
        ),
        "{late_reason:?}"
    );
    assert_eq!(state("bad"), ("failed", Some("sim_400")));
    for id in ["orphan-1", "orphan-2"] {
        assert_eq!(
            state(id),
            ("expired_before_receive", Some("broker_ttl_expired"))
        );
    }
    let late: Vec<&str> = all
        .iter()
        .filter(|r| r.reconciled_at_ms.is_some())
        .map(|r| r.job_id.as_str())
        .collect();
    assert_eq!(
        late,
        ["orphan-1", "orphan-2"],
        "only the orphans were reconciled"
    );
    for id in ["exp-broker", "late", "orphan-1", "orphan-2"] {
        assert_eq!(sim.calls_for(id), 0, "{id} never reached the model");
    }

    // The report over the same ledger.
    let out = env.cli(&["report", "--since", "1h", "--format", "json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let r: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["total"], 7);
    let count = |section: &str, key: &str| {
        r[section]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["key"] == key)
            .map(|c| c["count"].as_u64().unwrap())
    };
    assert_eq!(count("by_state", "unknown"), None);
    assert_eq!(count("by_state", "expired_before_receive"), Some(3));
    assert_eq!(count("by_state", "completed"), Some(2));
    assert_eq!(count("by_kind", "incident.summary"), Some(6));
    assert_eq!(count("by_reason", "failed/sim_400"), Some(1));
    assert_eq!(count("by_error_class", "deadline"), Some(4));
    assert_eq!(count("by_error_class", "unaccounted"), None);
    assert_eq!(r["late_outcomes"], 2);
    assert_eq!(count("late_by_state", "expired_before_receive"), Some(2));
    assert_eq!(count("by_error_class", "backend_terminal"), Some(1));
    assert!(
        r["top_errors"]
            .as_array()
            .unwrap()
            .iter()
            .any(|e| e["key"].as_str().unwrap().contains("failed (sim_400)")),
        "{}",
        r["top_errors"]
    );
    let lat = r["latency"].as_array().unwrap();
    let done = lat.iter().find(|l| l["state"] == "completed").unwrap();
    assert_eq!(done["count"], 2);
    for k in ["p50_ms", "p90_ms", "p99_ms", "max_ms"] {
        assert!(done[k].as_i64().unwrap() >= 0, "{k}");
    }
    assert!(done["p50_ms"].as_i64() <= done["max_ms"].as_i64());
    let csv = env.cli(&["report", "--since", "90m", "--format", "csv"]);
    assert!(csv.status.success());
    let csv = text(&csv.stdout);
    assert!(csv.starts_with("section,key,count,p50_ms,p90_ms,p99_ms,max_ms\n"));
    assert!(
        csv.contains("state,expired_before_receive,3,,,,\n"),
        "{csv}"
    );
    assert!(csv.contains("late_outcome,total,2,,,,\n"), "{csv}");
    assert!(
        csv.contains("late_outcome,expired_before_receive,2,,,,\n"),
        "{csv}"
    );
    let table = env.cli(&["report"]);
    assert!(table.status.success());
    let table = text(&table.stdout);
    assert!(table.contains("expired_before_receive"));
    assert!(
        table.contains("real outcome recorded later): 2\n"),
        "{table}"
    );
    // A window that ends before anything was recorded is empty, not an error.
    let empty = env.cli(&["report", "--since", "1ms", "--format", "json"]);
    assert!(empty.status.success());
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_covers_every_accepted_job_of_a_mixed_run_sqlite() {
    mixed_run(Env::sqlite("recon").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliation_covers_every_accepted_job_of_a_mixed_run_postgres() {
    mixed_run(Env::postgres("reconpg").await).await;
}

/// The seed's prefetch-1 case: one job is delivered and refused before start; the two
/// others expire at the broker. With the DLQ processor they are `expired_before_receive`;
/// without it, reconciliation names them `unknown`.
async fn prefetch_one(env: Env, run_dlq: bool) {
    let sim = sim(0);
    let mut cfg = env.worker_config(1, 1);
    cfg.hold_before_admission = Duration::from_millis(1_050);
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    let s = env.submitter(0, true).await;
    let ids: Vec<String> = (1..=3).map(|i| format!("p1-{i}")).collect();
    let mut due = 0;
    for id in &ids {
        due = s
            .submit(&job(id, 600), now_ms())
            .await
            .unwrap()
            .expires_at_ms
            + 100;
    }
    env.wait_terminal(&ids[..1], Duration::from_secs(10)).await;
    w.stop().await;
    env.wait_ready(&env.topo.names.dead_queue, 2).await;
    // Past deadline + the 100 ms grace reconciliation is given below (a time condition).
    while now_ms() <= due {
        tokio::time::sleep(Duration::from_millis((due + 1 - now_ms()).max(1) as u64)).await;
    }
    if run_dlq {
        env.drain_dead_letters(false).await;
    }
    let (code, v) = reconcile(&env, &["--grace-ms", "100"]);
    let all = assert_all_terminal(&env, &["p1-1", "p1-2", "p1-3"]).await;
    let states: Vec<&str> = all.iter().map(|r| r.state.as_str()).collect();
    if run_dlq {
        assert_eq!(code, 0, "{v}");
        assert_eq!(v["marked_unknown"], json!([]));
        assert_eq!(
            states,
            [
                "expired_not_started",
                "expired_before_receive",
                "expired_before_receive"
            ]
        );
    } else {
        assert_eq!(code, 3, "{v}");
        assert_eq!(v["marked_unknown"], json!(["p1-2", "p1-3"]));
        assert_eq!(states, ["expired_not_started", "unknown", "unknown"]);
    }
    assert_eq!(sim.calls(), 0);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_one_broker_expiries_are_recorded_when_the_dlq_ran() {
    prefetch_one(Env::sqlite("p1dlq").await, true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prefetch_one_broker_expiries_are_unknown_when_the_dlq_did_not_run() {
    prefetch_one(Env::postgres("p1nodlq").await, false).await;
}

/// Text output, help and flag errors of `reconcile` and `report`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_and_report_text_help_and_errors() {
    let env = Env::sqlite("reconcli").await;
    let out = env.cli(&["reconcile"]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out.stderr));
    assert!(text(&out.stdout).contains("newly marked unknown: none"));
    let cases: &[(&[&str], &str)] = &[
        (&["report", "--since", "10y"], "--since"),
        (&["report", "--since", "10"], "--since"),
        (&["report", "--format", "xml"], "--format"),
        (&["reconcile", "--grace-ms=-5"], "--grace-ms"),
        (&["dlq", "--idle-exit-ms", "soon"], "--idle-exit-ms"),
    ];
    for (args, needle) in cases {
        let out = env.cli(args);
        assert!(!out.status.success(), "{args:?} should fail");
        assert!(
            text(&out.stderr).contains(needle),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
    for cmd in [
        ["dlq", "--help"],
        ["reconcile", "--help"],
        ["report", "--help"],
    ] {
        let out = env.cli(&cmd);
        assert!(out.status.success());
        assert!(text(&out.stdout).len() > 400, "{cmd:?} help is too thin");
    }
    let help = text(&env.cli(&["reconcile", "--help"]).stdout);
    assert!(help.contains("--allow-unknown") && help.contains("3"));
    env.cleanup().await;
}
