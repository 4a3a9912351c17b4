//! `lastcall ledger prune|export|copy` as a user runs them, and the worker's background
//! pruning with its gauges on `/metrics`, against real SQLite and PostgreSQL ledgers.

use crate::common;

use common::http::{Children, curl};
use common::*;
use lastcall_core::{Decision, State};
use lastcall_http::metrics::sample_value;
use lastcall_store::{Ledger, OutcomeRecord};
use std::time::{Duration, Instant};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

const DAY_MS: i64 = 86_400_000;

fn now() -> i64 {
    lastcall_worker::clock::now_ms()
}

/// A `completed` job recorded `age_days` ago, with a result text and an attempt row.
async fn completed(l: &Ledger, id: &str, age_days: i64) {
    let at = now() - age_days * DAY_MS;
    let rec = OutcomeRecord {
        attempt_key: format!("w:{id}"),
        attempt: 1,
        created_at_ms: Some(at - 100),
        expires_at_ms: Some(at + 60_000),
        model_called: true,
        result: Some(format!("the answer to {id}")),
        worker: "w1".into(),
        ..OutcomeRecord::new(id, "chat", State::Completed, Decision::Ack, at)
    };
    assert!(l.record_outcome(&rec).await.unwrap());
}

/// Old and new completed jobs, an old job still `accepted`, an old job held by its
/// undelivered webhook.
async fn fixture(l: &Ledger) {
    for (id, age) in [("old-1", 40), ("old-2", 35), ("mid-1", 10), ("new-1", 1)] {
        completed(l, id, age).await;
    }
    l.register_webhook("old-hook", "http://hooks.invalid/x", now() - 50 * DAY_MS)
        .await
        .unwrap();
    completed(l, "old-hook", 45).await;
    l.record_accepted(&lastcall_store::AcceptedJob {
        job_id: "old-waiting".into(),
        kind: "chat".into(),
        created_at_ms: now() - 60 * DAY_MS,
        expires_at_ms: now() + DAY_MS,
        accepted_at_ms: now() - 60 * DAY_MS,
        trace_id: None,
        payload_hash: "h".into(),
        tenant: lastcall_core::Tenant::default_tenant(),
        priority: lastcall_core::Priority::Standard,
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn prune_dry_run_changes_nothing_then_prune_archives_and_deletes() {
    let env = Env::sqlite("lprune").await;
    fixture(&env.ledger).await;
    let dry = env.cli(&["ledger", "prune", "--dry-run", "--json"]);
    assert!(dry.status.success(), "{}", text(&dry.stderr));
    let v: serde_json::Value = serde_json::from_slice(&dry.stdout).unwrap();
    assert_eq!(v["dry_run"], true);
    assert_eq!(
        (v["retention"].as_str(), v["text_retention"].as_str()),
        (Some("30d"), Some("7d"))
    );
    assert_eq!(
        (v["jobs"].as_u64(), v["attempts"].as_u64()),
        (Some(2), Some(2)),
        "{v}"
    );
    assert_eq!(
        (v["texts"].as_u64(), v["held_by_webhooks"].as_u64()),
        (Some(1), Some(1)),
        "{v}"
    );
    assert!(
        env.ledger.get("old-1").await.unwrap().is_some(),
        "a dry run deletes nothing"
    );
    assert!(
        env.ledger
            .get("mid-1")
            .await
            .unwrap()
            .unwrap()
            .result
            .is_some()
    );

    let archive = env.dir.join("archive");
    let out = env.cli(&[
        "ledger",
        "prune",
        "--archive-dir",
        archive.to_str().unwrap(),
        "--batch-rows",
        "1",
        "--batch-pause-ms",
        "1",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.contains("deleted 2 jobs (2 attempt rows"), "{said}");
    assert!(said.contains("cleared 1 result texts"), "{said}");
    assert!(
        said.contains("1 old jobs held by undelivered webhooks"),
        "{said}"
    );
    for gone in ["old-1", "old-2"] {
        assert!(env.ledger.get(gone).await.unwrap().is_none(), "{gone}");
    }
    let mid = env.ledger.get("mid-1").await.unwrap().unwrap();
    assert_eq!(
        (mid.state.as_str(), mid.result),
        ("completed", None),
        "row kept, text gone"
    );
    for kept in ["old-hook", "old-waiting", "new-1"] {
        assert!(env.ledger.get(kept).await.unwrap().is_some(), "{kept}");
    }
    // The archive holds the deleted jobs, one JSON object a line.
    let files: Vec<_> = std::fs::read_dir(&archive)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(
        name.starts_with("ledger-") && name.ends_with(".jsonl"),
        "{name}"
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&files[0])
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<&str> = lines
        .iter()
        .map(|l| l["job_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["old-1", "old-2"]);
    assert_eq!(lines[0]["result"], "the answer to old-1");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_postgres_a_second_pruner_waits_for_nobody_and_says_so() {
    let env = Env::postgres("lpbusy").await;
    fixture(&env.ledger).await;
    let lock = env.ledger.try_prune_lock().await.unwrap().expect("free");
    let out = env.cli(&["ledger", "prune"]);
    assert_eq!(out.status.code(), Some(3), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("another process is pruning"),
        "{}",
        text(&out.stderr)
    );
    assert!(env.ledger.get("old-1").await.unwrap().is_some());
    lock.release().await;
    let out = env.cli(&["ledger", "prune", "--json"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["jobs"], 2, "{v}");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn export_writes_one_json_line_per_job_in_the_window() {
    let env = Env::sqlite("lexport").await;
    fixture(&env.ledger).await;
    let file = env.dir.join("out.jsonl");
    let out = env.cli(&[
        "ledger",
        "export",
        "--since",
        "36d",
        "--until",
        "2d",
        "--format",
        "jsonl",
        "--out",
        file.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert!(
        text(&out.stderr).contains("exported 2 jobs"),
        "{}",
        text(&out.stderr)
    );
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&file)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let ids: Vec<&str> = lines
        .iter()
        .map(|l| l["job_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["old-2", "mid-1"]);
    // Each line is the job's record as `jobs show --json` prints it.
    let show = env.cli(&["jobs", "show", "mid-1", "--json"]);
    let shown: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(lines[1], shown);
    // To stdout, everything up to now.
    let all = env.cli(&["ledger", "export"]);
    assert!(all.status.success(), "{}", text(&all.stderr));
    assert_eq!(text(&all.stdout).lines().count(), 5, "every terminal job");
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn copy_from_sqlite_to_postgres_checks_itself_and_a_second_run_copies_nothing() {
    let src = Env::sqlite("lcopy").await;
    fixture(&src.ledger).await;
    let dst = Env::postgres("lcopyd").await;
    let args = [
        "ledger",
        "copy",
        "--to",
        dst.store_url.as_str(),
        "--batch-rows",
        "2",
    ];
    let out = src.cli(&args);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    assert!(said.contains("copy complete and checked"), "{said}");
    assert_eq!(
        said.lines().filter(|l| l.ends_with("  ok")).count(),
        lastcall_store::COPY_TABLES.len(),
        "{said}"
    );
    assert!(
        text(&out.stderr).contains("jobs: 6 rows read, 6 copied"),
        "{}",
        text(&out.stderr)
    );
    assert_eq!(
        dst.ledger.get("mid-1").await.unwrap(),
        src.ledger.get("mid-1").await.unwrap()
    );
    let again = src.cli(&args);
    assert!(again.status.success(), "{}", text(&again.stderr));
    assert!(
        text(&again.stderr).contains("jobs: 6 rows read, 0 copied, 6 already there"),
        "{}",
        text(&again.stderr)
    );
    src.cleanup().await;
    dst.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_ledger_input_names_the_field_and_what_is_accepted() {
    let env = Env::sqlite("lbad").await;
    let out = env.cli(&["ledger", "prune", "--retention", "7x"]);
    assert!(!out.status.success());
    let e = text(&out.stderr);
    assert!(e.contains("--retention"), "{e}");
    assert!(
        e.contains("unknown unit `x`") && e.contains("e.g. 30d") && e.contains("`off`"),
        "{e}"
    );
    let out = env.cli(&["ledger", "prune", "--retention", "2h"]);
    assert!(
        text(&out.stderr).contains("shorter than the minimum, 1d"),
        "{}",
        text(&out.stderr)
    );
    let out = env.cli(&["ledger", "export", "--since", "yesterday"]);
    let e = text(&out.stderr);
    assert!(
        !out.status.success() && e.contains("--since") && e.contains("epoch milliseconds"),
        "{e}"
    );
    let out = env.cli(&["ledger", "copy"]);
    assert!(
        text(&out.stderr).contains("--to <STORE_URL>"),
        "{}",
        text(&out.stderr)
    );
    // The same rule for the file's [ledger] section, which the workers read too.
    let cfg = env.dir.join("lastcall.toml");
    std::fs::write(&cfg, "[ledger]\nretention = \"7x\"\n").unwrap();
    for args in [
        &["ledger", "prune"][..],
        &["worker", "--backend", "sim"][..],
    ] {
        let out = env.cli(&[&["--config", cfg.to_str().unwrap()][..], args].concat());
        let e = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            e.contains("`retention` in section [ledger]") && e.contains("e.g. 30d"),
            "{args:?}: {e}"
        );
    }
    // Every command teaches.
    for (args, expect) in [
        (&["ledger", "--help"][..], "Keep the ledger from growing"),
        (&["ledger", "prune", "--help"][..], "Never pruned"),
        (&["ledger", "export", "--help"][..], "constant memory"),
        (&["ledger", "copy", "--help"][..], "ON CONFLICT DO NOTHING"),
    ] {
        let out = env.cli(args);
        assert!(out.status.success());
        assert!(
            text(&out.stdout).contains(expect),
            "{args:?}: {}",
            text(&out.stdout)
        );
    }
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_prunes_in_the_background_and_shows_it_on_metrics() {
    let env = Env::sqlite("lworker").await;
    fixture(&env.ledger).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let addr = format!("127.0.0.1:{port}");
    let cfg = env.dir.join("lastcall.toml");
    std::fs::write(
        &cfg,
        "[ledger]\nretention = \"20d\"\ntext_retention = \"off\"\n",
    )
    .unwrap();
    let mut c = env.command();
    c.args(["--config", cfg.to_str().unwrap()]);
    c.args([
        "worker",
        "--backend",
        "sim",
        "--metrics-addr",
        &addr,
        "--prune-every",
        "1s",
    ]);
    c.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let _worker = Children(vec![c.spawn().unwrap()]);
    let deadline = Instant::now() + Duration::from_secs(60);
    let metrics = loop {
        let (code, body) = curl(&[&format!("http://{addr}/metrics")]);
        if code == 200
            && sample_value(&body, "lastcall_ledger_pruned_jobs_total").is_some_and(|n| n >= 2.0)
            && sample_value(&body, "lastcall_ledger_job_rows").is_some_and(|n| n == 4.0)
        {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "no prune on /metrics within 60 s: {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(sample_value(&metrics, "lastcall_ledger_bytes").unwrap() > 0.0);
    let last = sample_value(&metrics, "lastcall_ledger_last_prune_timestamp_seconds").unwrap();
    assert!((last - now() as f64 / 1_000.0).abs() < 120.0, "{last}");
    // 20d: old-1 and old-2 are gone; old-hook is held; the text retention is off.
    assert!(env.ledger.get("old-1").await.unwrap().is_none());
    assert!(env.ledger.get("old-hook").await.unwrap().is_some());
    assert!(
        env.ledger
            .get("mid-1")
            .await
            .unwrap()
            .unwrap()
            .result
            .is_some()
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn config_show_ledger_names_each_retention_settings_source() {
    let env = Env::sqlite("lshow").await;
    let cfg = env.dir.join("lastcall.toml");
    std::fs::write(&cfg, "[ledger]\nretention = \"14d\"\n").unwrap();
    let out = env.cli(&[
        "--config",
        cfg.to_str().unwrap(),
        "config",
        "show",
        "ledger",
        "--batch-rows",
        "500",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let said = text(&out.stdout);
    let row = |key: &str| {
        said.lines()
            .find(|l| l.starts_with(&format!("ledger.{key} ")))
            .map(|l| l.split_whitespace().collect::<Vec<_>>())
            .unwrap_or_else(|| panic!("no ledger.{key} in {said}"))
    };
    assert_eq!(row("retention")[1..], ["14d", "file"]);
    assert_eq!(row("text_retention")[1..], ["7d", "default"]);
    assert_eq!(row("batch_rows")[1..], ["500", "flag"]);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_shows_the_ledgers_size_but_prunes_nothing() {
    let env = Env::sqlite("lserve").await;
    fixture(&env.ledger).await;
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let mut c = env.command();
    c.args([
        "serve",
        "--addr",
        &format!("127.0.0.1:{port}"),
        "--no-management",
    ]);
    c.env("LASTCALL_HTTP_TOKEN", "ledger-test-token-0123456789");
    c.stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null());
    let _serve = Children(vec![c.spawn().unwrap()]);
    let url = format!("http://127.0.0.1:{port}/metrics");
    let deadline = Instant::now() + Duration::from_secs(60);
    let metrics = loop {
        let (code, body) = curl(&[
            "-H",
            "Authorization: Bearer ledger-test-token-0123456789",
            &url,
        ]);
        if code == 200 && sample_value(&body, "lastcall_ledger_job_rows") == Some(6.0) {
            break body;
        }
        assert!(
            Instant::now() < deadline,
            "no ledger size on /metrics within 60 s: {code} {body}"
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    };
    assert!(sample_value(&metrics, "lastcall_ledger_bytes").unwrap() > 0.0);
    assert!(!metrics.contains("lastcall_ledger_last_prune"), "{metrics}");
    assert!(
        env.ledger.get("old-1").await.unwrap().is_some(),
        "serve never prunes"
    );
    env.cleanup().await;
}

/// `ledger export --out` and prune archives hold payloads and results: created 0600
/// (issue #48; they were created with the umask's 0644, readable by every local user),
/// and an existing export target is made owner-only before it is written.
#[cfg(unix)]
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn exports_and_prune_archives_are_readable_by_their_owner_only() {
    use std::os::unix::fs::PermissionsExt;
    let mode = |p: &std::path::Path| std::fs::metadata(p).unwrap().permissions().mode() & 0o777;
    let env = Env::sqlite("lprivate").await;
    fixture(&env.ledger).await;
    let fresh = env.dir.join("fresh.jsonl");
    let existing = env.dir.join("existing.jsonl");
    std::fs::write(&existing, "old contents\n").unwrap();
    std::fs::set_permissions(&existing, std::fs::Permissions::from_mode(0o644)).unwrap();
    for file in [&fresh, &existing] {
        let out = env.cli(&["ledger", "export", "--out", file.to_str().unwrap()]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        assert_eq!(mode(file), 0o600, "{}", file.display());
        assert!(
            std::fs::read_to_string(file)
                .unwrap()
                .contains("the answer to mid-1"),
            "the export was written"
        );
    }
    let archive = env.dir.join("archive");
    let out = env.cli(&[
        "ledger",
        "prune",
        "--archive-dir",
        archive.to_str().unwrap(),
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let files: Vec<_> = std::fs::read_dir(&archive)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    assert_eq!(mode(&files[0]), 0o600, "{}", files[0].display());
    env.cleanup().await;
}

/// A password in a PostgreSQL URL's query (`?password=`, `sslpassword=`) is masked like
/// one in `user:password@`: in `ledger copy`'s progress and in the error of a ledger that
/// cannot be opened (issue #48: only `user:password@` was).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn passwords_in_a_ledger_urls_query_stay_out_of_output() {
    const SECRET: &str = "qp-SECRET-7c2e9a41";
    const SSL_SECRET: &str = "ssl-SECRET-0b5d3f86";
    let src = Env::sqlite("lqcopy").await;
    fixture(&src.ledger).await;
    let dst = Env::postgres("lqcopyd").await;
    // The test server trusts local connections: the password is sent and ignored.
    let to = format!("{}?password={SECRET}", dst.store_url);
    let out = src.cli(&["ledger", "copy", "--to", &to, "--no-progress"]);
    let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("password=***"),
        "the URL is shown, masked: {stderr}"
    );
    assert!(
        !stdout.contains(SECRET) && !stderr.contains(SECRET),
        "{stdout}\n{stderr}"
    );

    // Nothing listens on port 1: the open fails, and its error shows the URL.
    let unreachable =
        format!("postgres://lastcall@127.0.0.1:1/x?sslpassword={SSL_SECRET}&password={SECRET}");
    for args in [
        &["--store-url", &unreachable, "jobs", "list"][..],
        &[
            "--store-url",
            &src.store_url,
            "ledger",
            "copy",
            "--to",
            &unreachable,
        ],
    ] {
        let mut c = std::process::Command::new(env!("CARGO_BIN_EXE_lastcall"));
        c.args(args);
        let out = output_within(&mut c, &format!("lastcall {args:?}"), CHILD_LIMIT);
        let (stdout, stderr) = (text(&out.stdout), text(&out.stderr));
        assert!(!out.status.success(), "{args:?}: {stdout}");
        assert!(
            stderr.contains("127.0.0.1:1"),
            "{args:?}: the URL is named: {stderr}"
        );
        for s in [SECRET, SSL_SECRET] {
            assert!(
                !stdout.contains(s) && !stderr.contains(s),
                "{args:?}: {stdout}\n{stderr}"
            );
        }
    }
    src.cleanup().await;
    dst.cleanup().await;
}
