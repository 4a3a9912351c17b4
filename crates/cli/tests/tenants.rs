//! Tenants from the command line (issue #33): `submit --tenant/--priority`, `jobs list
//! --tenant`, `report --tenant` and its per-tenant table, `tokens hash`, and the real
//! `serve --tokens-file` on a socket in front of the real broker and ledger.

use crate::common;

use common::serve::Serve;
use common::*;
use lastcall_core::{Decision, State, Tenant};
use lastcall_store::OutcomeRecord;
use std::io::Write;
use std::process::{Command, Stdio};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_list_and_report_by_tenant() {
    let env = Env::sqlite("cli-tenants").await;
    let submit = |id: &str, extra: &[&str]| {
        let mut args = vec![
            "submit",
            "--kind",
            "incident.summary",
            "--deadline-ms",
            "60000",
            "--job-id",
            id,
            "--prompt",
            "summarize",
        ];
        args.extend_from_slice(extra);
        env.cli(&args)
    };
    let out = submit("ta-1", &["--tenant", "team-a", "--priority", "batch"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = submit("tb-1", &["--tenant", "team-b"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let out = submit("td-1", &[]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    for (bad, names) in [
        (vec!["--tenant", "team a"], "--tenant"),
        (vec!["--priority", "urgent"], "--priority"),
    ] {
        let out = submit("bad-1", &bad);
        assert!(!out.status.success());
        assert!(text(&out.stderr).contains(names), "{}", text(&out.stderr));
    }
    assert!(env.ledger.get("bad-1").await.unwrap().is_none());

    let list = |tenant: &str| {
        let out = env.cli(&["jobs", "list", "--tenant", tenant, "--json"]);
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).unwrap()
    };
    let a = list("team-a");
    assert_eq!(a.as_array().unwrap().len(), 1, "{a}");
    assert_eq!(a[0]["job_id"], "ta-1");
    assert_eq!(a[0]["priority"], "batch");
    let d = list("default");
    assert_eq!(d[0]["job_id"], "td-1");
    assert_eq!(d[0]["priority"], "standard");
    assert_eq!(list("nobody"), serde_json::json!([]));

    // Outcomes: team-a completed (a 120 ms call), team-b cut at its deadline.
    let now = lastcall_clock::now_ms();
    for (id, tenant, state) in [
        ("ta-1", "team-a", State::Completed),
        ("tb-1", "team-b", State::DeadlineExceeded),
    ] {
        env.ledger
            .record_outcome(&OutcomeRecord {
                attempt_key: format!("{id}:1"),
                tenant: Tenant::parse(tenant).unwrap(),
                model_called: true,
                latency_ms: Some(120),
                prompt_tokens: Some(9),
                ..OutcomeRecord::new(id, "incident.summary", state, Decision::Ack, now)
            })
            .await
            .unwrap();
    }
    let out = env.cli(&[
        "report", "--since", "1h", "--format", "json", "--tenant", "team-b",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rep: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(rep["total"], 1, "only team-b's job: {rep}");
    let t = &rep["by_tenant"];
    assert_eq!(t.as_array().unwrap().len(), 1, "{t}");
    assert_eq!(t[0]["tenant"], "team-b");
    assert_eq!(t[0]["on_time"], 0);
    assert_eq!(t[0]["wasted_model_ms"], 120);
    assert_eq!(t[0]["not_on_time"][0]["key"], "deadline_exceeded");
    let out = env.cli(&["report", "--since", "1h"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let table = text(&out.stdout);
    assert!(table.contains("per tenant"), "{table}");
    let row = table
        .lines()
        .find(|l| l.contains("team-a"))
        .unwrap_or_else(|| panic!("a team-a row: {table}"));
    assert!(row.contains("1 (100%)"), "{row}");
    let out = env.cli(&["report", "--since", "1h", "--format", "csv"]);
    assert!(text(&out.stdout).contains("tenant_on_time,team-a,1,,,,\n"));
    env.cleanup().await;
}

/// `lastcall tokens hash` with the token on stdin.
fn hash(token: &str, args: &[&str]) -> std::process::Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_lastcall"))
        .args(["tokens", "hash"])
        .args(args)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    child
        .stdin
        .take()
        .unwrap()
        .write_all(token.as_bytes())
        .unwrap();
    child.wait_with_output().unwrap()
}

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
async fn serve_maps_a_hashed_token_to_its_tenant() {
    const OPERATOR: &str = "operator-token-0123456789";
    const TEAM_A: &str = "team-a-token-0123456789abcdef";
    let env = Env::sqlite("serve-tenants").await;
    let dir = tempfile_dir(&env.prefix);

    // The hash, from stdin; a short token is refused.
    let out = hash(&format!("{TEAM_A}\n"), &["--tenant", "team-a"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let entry = text(&out.stdout);
    assert!(!entry.contains(TEAM_A), "never the token itself: {entry}");
    let bare = hash(TEAM_A, &["--bare"]);
    assert!(entry.contains(text(&bare.stdout).trim()), "{entry}");
    let short = hash("short", &[]);
    assert!(!short.status.success());
    assert!(
        text(&short.stderr).contains("at least 16"),
        "{}",
        text(&short.stderr)
    );

    // A file with a mistake: serve refuses to start, naming the entry and field.
    let bad = dir.join("bad.toml");
    std::fs::write(
        &bad,
        format!("[[token]]\nsha256 = \"{TEAM_A}\"\ntenant = \"team-a\"\n"),
    )
    .unwrap();
    let out = env
        .command()
        .args(["serve", "--addr", "127.0.0.1:0", "--tokens-file"])
        .arg(&bad)
        .env("LASTCALL_HTTP_TOKEN", OPERATOR)
        .output_bounded()
        .unwrap();
    assert!(!out.status.success());
    let err = text(&out.stderr);
    assert!(err.contains("`sha256`") && err.contains("#1"), "{err}");

    let file = dir.join("tokens.toml");
    std::fs::write(&file, &entry).unwrap();
    let serve = Serve::start(&env, OPERATOR, &["--tokens-file", file.to_str().unwrap()]).await;
    let base = serve.base.clone();
    let post = |token: &str, body: &str| {
        curl(&[
            "-X",
            "POST",
            &format!("{base}/v1/jobs"),
            "-H",
            &format!("Authorization: Bearer {token}"),
            "-H",
            "Content-Type: application/json",
            "--data",
            body,
        ])
    };
    let (code, resp) = post(
        TEAM_A,
        r#"{"job_id":"sa-1","kind":"incident.summary","deadline_ms":60000,"payload":{"prompt":"x"}}"#,
    );
    assert_eq!(code, 202, "{resp}");
    assert_eq!(
        env.ledger.get("team-a:sa-1").await.unwrap().unwrap().tenant,
        "team-a"
    );
    let (code, resp) = post(
        TEAM_A,
        r#"{"job_id":"sa-2","kind":"incident.summary","deadline_ms":60000,"payload":{"prompt":"x"},"tenant":"team-b"}"#,
    );
    assert_eq!(code, 403, "{resp}");
    assert!(resp.contains("tenant_mismatch"), "{resp}");
    let (code, _) = curl(&[
        &format!("{base}/metrics"),
        "-H",
        &format!("Authorization: Bearer {TEAM_A}"),
    ]);
    assert_eq!(code, 403, "every tenant's numbers are the operator's");
    let (code, metrics) = curl(&[
        &format!("{base}/metrics"),
        "-H",
        &format!("Authorization: Bearer {OPERATOR}"),
    ]);
    assert_eq!(code, 200);
    assert!(
        metrics.contains("lastcall_http_tenant_accepted_total{tenant=\"team-a\"} 1"),
        "{metrics}"
    );
    // The operator's token is never also a tenant's.
    let clash = dir.join("clash.toml");
    let out = hash(OPERATOR, &["--tenant", "team-x"]);
    std::fs::write(&clash, &out.stdout).unwrap();
    let out = env
        .command()
        .args(["serve", "--addr", "127.0.0.1:0", "--tokens-file"])
        .arg(&clash)
        .env("LASTCALL_HTTP_TOKEN", OPERATOR)
        .output_bounded()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("operator's token"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    env.cleanup().await;
}

fn tempfile_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("{name}-tokens"));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}
