//! The `lastcall` binary's commands as a user runs them.

mod common;

use common::*;
use std::process::Command;

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn submit_then_inspect_with_jobs_show_and_list() {
    let env = Env::sqlite("cli").await;
    let out = env.cli(&[
        "submit",
        "--kind",
        "incident.summary",
        "--deadline-ms",
        "60000",
        "--job-id",
        "cli-1",
        "--prompt",
        "summarize",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(text(&out.stdout).trim(), "cli-1");
    let show = env.cli(&["jobs", "show", "cli-1", "--json"]);
    assert!(show.status.success(), "{}", text(&show.stderr));
    let v: serde_json::Value = serde_json::from_slice(&show.stdout).unwrap();
    assert_eq!(v["state"], "accepted");
    assert_eq!(v["kind"], "incident.summary");
    assert!(v["expires_at_ms"].as_i64().unwrap() > v["created_at_ms"].as_i64().unwrap());
    let list = env.cli(&["jobs", "list", "--state", "accepted", "--json"]);
    let arr: serde_json::Value = serde_json::from_slice(&list.stdout).unwrap();
    assert_eq!(arr.as_array().unwrap().len(), 1);
    let none = env.cli(&["jobs", "list", "--state", "completed", "--json"]);
    assert_eq!(
        serde_json::from_slice::<serde_json::Value>(&none.stdout).unwrap(),
        serde_json::json!([])
    );
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_errors_that_name_the_field() {
    let env = Env::sqlite("clierr").await;
    let cases: &[(&[&str], &str)] = &[
        (
            &[
                "submit",
                "--kind",
                "Bad Kind",
                "--deadline-ms",
                "1000",
                "--prompt",
                "x",
            ],
            "kind",
        ),
        (
            &[
                "submit",
                "--kind",
                "k",
                "--deadline-ms",
                "1000",
                "--payload",
                "[1]",
            ],
            "--payload must be a JSON object",
        ),
        (
            &[
                "submit",
                "--kind",
                "k",
                "--deadline-ms",
                "1000",
                "--payload",
                "{oops",
            ],
            "--payload is not valid JSON",
        ),
        (
            &[
                "submit",
                "--kind",
                "k",
                "--deadline-ms",
                "1000",
                "--job-id",
                "a b",
                "--prompt",
                "x",
            ],
            "job_id",
        ),
        (
            &[
                "submit",
                "--kind",
                "k",
                "--deadline-ms",
                "50",
                "--prompt",
                "x",
            ],
            "refused before publishing",
        ),
        (&["jobs", "list", "--state", "done"], "expected one of"),
        (&["jobs", "show", "nope"], "no job `nope`"),
        (&["worker", "--slots", "0"], "--slots must be at least 1"),
        // No --backend: the embedded model, never the simulator. Its file is missing here.
        (
            &["worker", "--model-path", "/nonexistent/model.gguf"],
            "cannot load the local model /nonexistent/model.gguf",
        ),
    ];
    for (args, needle) in cases {
        let out = env.cli(args);
        assert!(!out.status.success(), "{args:?} should fail");
        let err = text(&out.stderr);
        assert!(err.contains(needle), "{args:?}: stderr was {err}");
    }
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        0,
        "nothing was published"
    );
    env.cleanup().await;
}

#[test]
fn every_command_has_help() {
    for cmd in [
        vec!["--help"],
        vec!["submit", "--help"],
        vec!["worker", "--help"],
        vec!["jobs", "list", "--help"],
        vec!["topology", "apply", "--help"],
        vec!["demo", "--help"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args(&cmd)
            .output()
            .unwrap();
        assert!(out.status.success(), "{cmd:?}");
        assert!(text(&out.stdout).len() > 200, "{cmd:?} help is too thin");
    }
    let worker = Command::new(env!("CARGO_BIN_EXE_lastcall"))
        .args(["worker", "--help"])
        .output()
        .unwrap();
    let h = text(&worker.stdout);
    assert!(
        h.contains("--clock-uncertainty-ms") && h.contains("measured"),
        "the uncertainty rule is documented"
    );
    assert!(!h.contains("--fault"), "test hooks stay hidden");
}

/// The README's demo, shortened, on both backends: it prints the outcome table and never
/// makes a model call for an expired job (the demo itself exits non-zero if it did).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn demo_runs_end_to_end_on_both_backends() {
    let env = Env::sqlite("demo").await;
    for backend in ["sim", "local"] {
        let store = format!(
            "sqlite://{}",
            env.dir.join(format!("demo-{backend}.db")).display()
        );
        let out = env.cli(&[
            "demo",
            "--backend",
            backend,
            "--jobs",
            "6",
            "--rate",
            "4",
            "--deadline-ms",
            "4000",
            "--worker-delay-ms",
            "2000",
            "--demo-store-url",
            &store,
        ]);
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{backend}: {}\n{stdout}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("job_id") && stdout.contains("demo-006"),
            "{backend}: {stdout}"
        );
        assert!(stdout.contains("0 for expired jobs"), "{backend}: {stdout}");
        assert!(
            stdout.contains("expired_before_receive"),
            "{backend}: the early pages expire at the broker: {stdout}"
        );
        let ledger = lastcall_store::Ledger::connect(&store).await.unwrap();
        let all = ledger
            .list(&lastcall_store::ListFilter::default())
            .await
            .unwrap();
        assert_eq!(all.len(), 6, "{backend}: every job has a record");
        assert!(
            all.iter().all(|r| r
                .state
                .parse::<lastcall_core::State>()
                .unwrap()
                .is_terminal()),
            "{backend}: {all:?}"
        );
        ledger.close().await;
    }
    let demo = lastcall_broker::Topology::new(&format!("{}-demo", env.prefix));
    demo.delete(&env.broker).await.unwrap();
    env.cleanup().await;
}
