//! The `lastcall` binary's commands as a user runs them.

use crate::common;

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
            "invalid_field (kind)",
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
        // The embedded model runs a fixed number of copies: no adaptive slots.
        (
            &["worker", "--slots", "auto"],
            "--slots auto needs a batching model server",
        ),
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
        assert_eq!(
            err.matches(needle).count(),
            1,
            "{args:?}: the reason is said once: {err}"
        );
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
            .output_bounded()
            .unwrap();
        assert!(out.status.success(), "{cmd:?}");
        assert!(text(&out.stdout).len() > 200, "{cmd:?} help is too thin");
    }
    let worker = Command::new(env!("CARGO_BIN_EXE_lastcall"))
        .args(["worker", "--help"])
        .output_bounded()
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
        // Not `env.cli`: the demo refuses the global --store-url (it keeps its own ledger).
        let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args(["--amqp-url", AMQP, "--prefix", &env.prefix])
            .args([
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
            ])
            .output_bounded()
            .unwrap();
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
        // The table: rows in id order, a deadline column, the pages under their own kind.
        let rows: Vec<&str> = stdout.lines().filter(|l| l.starts_with("demo-")).collect();
        let ids: Vec<&str> = rows.iter().map(|l| &l[..8]).collect();
        assert_eq!(
            ids,
            [
                "demo-001", "demo-002", "demo-003", "demo-004", "demo-005", "demo-006"
            ],
            "{backend}: {stdout}"
        );
        assert!(stdout.contains("deadline_ms"), "{backend}: {stdout}");
        for (i, row) in rows.iter().enumerate() {
            let cols: Vec<&str> = row.split_whitespace().collect();
            let (kind, deadline) = if i < 3 {
                ("incident.page", "1500")
            } else {
                ("incident.summary", "4000")
            };
            assert_eq!((cols[1], cols[2]), (kind, deadline), "{backend}: {row}");
        }
        assert!(
            stdout.contains("what this run showed: "),
            "{backend}: {stdout}"
        );
        if backend == "sim" {
            assert!(
                !stdout.contains("decode speed"),
                "only a real model has a decode speed: {stdout}"
            );
        }
        // The closing hints run as printed.
        let hints: Vec<&str> = stdout
            .lines()
            .filter_map(|l| {
                l.strip_prefix("inspect: ")
                    .or_else(|| l.strip_prefix("         "))
            })
            .collect();
        assert!(!hints.is_empty(), "{backend}: {stdout}");
        for hint in hints {
            let run = Command::new("sh").args(["-c", hint]).output().unwrap();
            assert!(
                run.status.success() && run.stdout.len() > 50,
                "{backend}: `{hint}` failed: {}",
                text(&run.stderr)
            );
        }
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

/// Every `--help` page of the binary, found by following the "Commands:" lists.
fn all_help_pages(envs: &[(&str, &str)]) -> Vec<(String, String)> {
    fn walk(path: Vec<String>, envs: &[(&str, &str)], out: &mut Vec<(String, String)>) {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lastcall"));
        c.args(&path).arg("--help");
        for (k, v) in envs {
            c.env(k, v);
        }
        let o = c.output_bounded().unwrap();
        assert!(o.status.success(), "{path:?} --help: {}", text(&o.stderr));
        let help = text(&o.stdout);
        let subcommands: Vec<String> = help
            .lines()
            .skip_while(|l| *l != "Commands:")
            .skip(1)
            .take_while(|l| l.starts_with("  "))
            // A command's line; its wrapped description is indented further.
            .filter(|l| !l.starts_with("   "))
            .filter_map(|l| l.split_whitespace().next().map(str::to_owned))
            .filter(|s| s != "help")
            .collect();
        out.push((path.join(" "), help));
        for s in subcommands {
            let mut p = path.clone();
            p.push(s);
            walk(p, envs, out);
        }
    }
    let mut out = Vec::new();
    walk(Vec::new(), envs, &mut out);
    out
}

/// `--help` names the environment variables but never shows their values: no empty
/// `[env: NAME=]` when unset, and no secret when set.
#[test]
fn help_shows_no_env_values_and_no_secrets() {
    let unset = all_help_pages(&[]);
    assert!(unset.len() >= 15, "found {} help pages", unset.len());
    for (cmd, help) in &unset {
        assert!(
            !help.contains("=]"),
            "`{cmd} --help` shows an empty env value:\n{help}"
        );
    }
    let top = &unset[0].1;
    assert!(top.contains("[env: LASTCALL_CONFIG]"), "{top}");
    let secrets = [
        (
            "LASTCALL_SIGNING_KEY",
            "signing-key-secret-0123456789abcdef0123",
        ),
        ("LASTCALL_API_KEY", "sk-api-key-secret-4567"),
        ("LASTCALL_HTTP_TOKEN", "http-token-secret-89ab"),
        ("LASTCALL_MANAGEMENT_PASSWORD", "mgmt-password-secret"),
        (
            "LASTCALL_AMQP_URL",
            "amqp://bob:amqp-password-secret@127.0.0.1:5672/%2f",
        ),
        (
            "LASTCALL_STORE_URL",
            "postgres://bob:pg-password-secret@db/ledger",
        ),
        (
            "LASTCALL_OTLP_ENDPOINT",
            "http://otlp-token-secret@127.0.0.1:4318",
        ),
        (
            "LASTCALL_OPENAI_BASE_URL",
            "http://base-url-secret@127.0.0.1:8080/v1",
        ),
        (
            "LASTCALL_MANAGEMENT_URL",
            "http://mgmt-url-secret@127.0.0.1:15672",
        ),
        ("LASTCALL_MODEL_PATH", "/model-path-secret.gguf"),
        (
            "LASTCALL_BENCH_PG_URL",
            "postgres://bob:bench-pg-secret@db/b",
        ),
    ];
    let set = all_help_pages(&secrets);
    assert_eq!(set.len(), unset.len());
    for (cmd, help) in &set {
        for (name, value) in &secrets {
            let marker = value
                .split(['@', ':', '/'])
                .find(|p| p.contains("secret"))
                .unwrap();
            assert!(
                !help.contains(marker),
                "`{cmd} --help` shows the value of {name}:\n{help}"
            );
        }
        assert!(!help.contains("=]"), "`{cmd} --help`:\n{help}");
    }
}

/// The demo keeps its own ledger and queues, so its help does not offer the global
/// `--store-url` and `--prefix`, and an explicit `--store-url` is refused, not ignored.
#[test]
fn demo_help_lists_only_the_options_the_demo_uses() {
    let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
        .args(["demo", "--help"])
        .output_bounded()
        .unwrap();
    let help = text(&out.stdout);
    assert!(out.status.success());
    assert!(
        help.contains("--amqp-url") && help.contains("--demo-store-url"),
        "{help}"
    );
    assert!(
        !help.contains("--store-url <") && !help.contains("--prefix <"),
        "{help}"
    );
    // The other commands still have them.
    let worker = Command::new(env!("CARGO_BIN_EXE_lastcall"))
        .args(["worker", "--help"])
        .output_bounded()
        .unwrap();
    assert!(text(&worker.stdout).contains("--store-url <"));
    for args in [
        &["--store-url", "sqlite://elsewhere.db", "demo"][..],
        &["demo", "--store-url", "sqlite://elsewhere.db"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args(args)
            .output_bounded()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        assert!(
            text(&out.stderr).contains("--demo-store-url"),
            "{args:?}: {}",
            text(&out.stderr)
        );
    }
}

/// Log lines written to a pipe carry no colour codes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn logs_to_a_pipe_have_no_ansi_escapes() {
    let env = Env::sqlite("cliansi").await;
    let out = env
        .command()
        .args(["-v", "jobs", "list"])
        .env_remove("NO_COLOR")
        .env_remove("LASTCALL_LOG")
        .output_bounded()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let err = text(&out.stderr);
    assert!(err.contains("INFO"), "-v logs at info level: {err}");
    assert!(
        !err.contains('\u{1b}'),
        "ANSI escape in piped stderr: {err:?}"
    );
    env.cleanup().await;
}

/// A broker that refuses the connection is named once, with its password masked, and the
/// message says what to check.
#[test]
fn a_refused_broker_connection_is_reported_once_with_the_masked_url() {
    let port = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().port()
    }; // closed again: nothing listens there now
    let url = format!("amqp://guest:pw-hunter2@127.0.0.1:{port}/%2f");
    let masked = format!("amqp://guest:***@127.0.0.1:{port}/%2f");
    for args in [
        &["topology", "apply"][..],
        &["topology", "delete", "--yes"][..],
        &[
            "submit",
            "--kind",
            "k",
            "--deadline-ms",
            "60000",
            "--prompt",
            "x",
        ][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args(["--amqp-url", &url, "--store-url", "sqlite::memory:"])
            .args(args)
            .env_remove("LASTCALL_LOG")
            .output_bounded()
            .unwrap();
        let err = text(&out.stderr);
        assert!(!out.status.success(), "{args:?}");
        assert!(
            !err.contains("hunter2"),
            "{args:?}: the password leaked: {err}"
        );
        assert_eq!(err.matches(&masked).count(), 1, "{args:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{args:?}: one line: {err}");
        assert!(
            err.contains("connection refused")
                && err.contains("is it running?")
                && err.contains("LASTCALL_AMQP_URL"),
            "{args:?}: {err}"
        );
    }
    // A running broker that refuses the login: the message says so, not "is it running?".
    let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
        .args([
            "--amqp-url",
            "amqp://guest:pw-hunter2@127.0.0.1:5672/%2f",
            "topology",
            "apply",
        ])
        .output_bounded()
        .unwrap();
    let err = text(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("hunter2"), "the password leaked: {err}");
    assert!(
        err.contains("RabbitMQ at amqp://guest:***@127.0.0.1:5672/%2f refused the login"),
        "{err}"
    );
}

/// A port that accepts the TCP connection and never speaks AMQP (a wrong port, a stuck
/// node): the command gives up after the handshake limit with a message that says so,
/// instead of hanging.
#[test]
fn a_broker_that_never_answers_the_handshake_fails_the_command_instead_of_hanging() {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    // Accept and hold every connection, reading nothing and writing nothing.
    std::thread::spawn(move || {
        let mut held = Vec::new();
        for s in listener.incoming() {
            held.push(s);
        }
    });
    let mut c = Command::new(env!("CARGO_BIN_EXE_lastcall"));
    c.args([
        "--amqp-url",
        &format!("amqp://guest:pw-hunter2@127.0.0.1:{port}/%2f"),
        "topology",
        "apply",
    ])
    .env_remove("LASTCALL_LOG");
    let limit = lastcall_broker::HANDSHAKE_LIMIT + std::time::Duration::from_secs(60);
    let out = output_within(&mut c, "topology apply against a silent port", limit);
    let err = text(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(!err.contains("hunter2"), "the password leaked: {err}");
    assert!(
        err.contains(&format!("amqp://guest:***@127.0.0.1:{port}/%2f"))
            && err.contains("no answer to the AMQP handshake"),
        "{err}"
    );
}

/// `jobs show` prints each time as epoch milliseconds and as a UTC time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_show_prints_readable_utc_times() {
    let env = Env::sqlite("clitime").await;
    let out = env.cli(&[
        "submit",
        "--kind",
        "incident.summary",
        "--deadline-ms",
        "60000",
        "--job-id",
        "time-1",
        "--prompt",
        "x",
    ]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let rec = env.ledger.get("time-1").await.unwrap().unwrap();
    let created = rec.created_at_ms.unwrap();
    let show = env.cli(&["jobs", "show", "time-1"]);
    assert!(show.status.success(), "{}", text(&show.stderr));
    let stdout = text(&show.stdout);
    let line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("created_at_ms:"))
        .unwrap_or_else(|| panic!("{stdout}"));
    // The same instant, formatted by date(1).
    let date = Command::new("date")
        .args([
            "-u",
            "-d",
            &format!("@{}", created / 1000),
            "+%Y-%m-%d %H:%M:%S",
        ])
        .output()
        .unwrap();
    let expected = format!(
        "{created}  ({}.{:03} UTC)",
        text(&date.stdout).trim(),
        created % 1000
    );
    assert!(line.ends_with(&expected), "{line:?} vs {expected:?}");
    assert!(
        stdout.contains("deadline: 60000 ms after created_at"),
        "{stdout}"
    );
    let expires = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("expires_at_ms:"))
        .unwrap();
    assert!(expires.ends_with(" UTC)"), "{expires}");
    env.cleanup().await;
}

/// `jobs list` says which ledger it read when it finds nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_list_on_an_empty_ledger_names_the_ledger() {
    let env = Env::sqlite("cliempty").await;
    let out = env.cli(&["jobs", "list"]);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!("the ledger at {} is empty", env.store_url)),
        "{stdout}"
    );
    // A ledger file that did not exist: opening it created it, and the output says so.
    let fresh = format!("sqlite://{}", env.dir.join("new.db").display());
    let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
        .args(["--store-url", &fresh, "jobs", "list"])
        .output_bounded()
        .unwrap();
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!("the ledger at {fresh} is empty"))
            && stdout.contains("did not exist"),
        "{stdout}"
    );
    // `report` and `reconcile` say it too (on stderr: their JSON stays JSON), and not of an
    // existing file.
    let fresh = |name: &str| format!("sqlite://{}", env.dir.join(name).display());
    let (report, reconcile) = (fresh("new-report.db"), fresh("new-reconcile.db"));
    for (url, command, new) in [
        (report.as_str(), "report", true),
        (reconcile.as_str(), "reconcile", true),
        (env.store_url.as_str(), "report", false),
        (env.store_url.as_str(), "reconcile", false),
    ] {
        let json = if command == "report" {
            "--format=json"
        } else {
            "--json"
        };
        let out = Command::new(env!("CARGO_BIN_EXE_lastcall"))
            .args(["--store-url", url, command, json])
            .output_bounded()
            .unwrap();
        assert!(out.status.success(), "{}", text(&out.stderr));
        serde_json::from_slice::<serde_json::Value>(&out.stdout).expect("the report is JSON");
        let err = text(&out.stderr);
        assert_eq!(
            err.contains(&format!("the ledger at {url} did not exist")),
            new,
            "{url}: {err}"
        );
    }
    // A filter that matches nothing in a ledger that has jobs.
    let sub = env.cli(&[
        "submit",
        "--kind",
        "incident.summary",
        "--deadline-ms",
        "60000",
        "--prompt",
        "x",
    ]);
    assert!(sub.status.success(), "{}", text(&sub.stderr));
    let out = env.cli(&["jobs", "list", "--state", "completed"]);
    let stdout = text(&out.stdout);
    assert!(
        stdout.contains(&format!(
            "no job matches state=completed in the ledger at {} (1 job(s) in all)",
            env.store_url
        )),
        "{stdout}"
    );
    env.cleanup().await;
}

/// `topology delete` removes the prefix's queues and exchanges, and without --yes and
/// without a terminal to ask on it refuses and deletes nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_delete_asks_first_then_removes_queues_and_exchanges() {
    let env = Env::sqlite("clidel").await;
    let sub = env.cli(&[
        "submit",
        "--kind",
        "incident.summary",
        "--deadline-ms",
        "60000",
        "--prompt",
        "x",
    ]);
    assert!(sub.status.success(), "{}", text(&sub.stderr));
    let n = &env.topo.names;
    let mut queues = n.lane_queues();
    queues.extend([
        n.dead_queue.clone(),
        n.retry_ready_queue(),
        n.retry_queue(1_000),
        n.retry_queue(5_000),
    ]);
    let exists = |q: String| {
        let broker = env.broker.clone();
        async move {
            lastcall_broker::topology::queue_depth(&broker, &q)
                .await
                .unwrap()
                .is_some()
        }
    };

    let refused = env
        .command()
        .args(["topology", "delete", "--retry-delays-ms", "1000,5000"])
        .stdin(std::process::Stdio::null())
        .output_bounded()
        .unwrap();
    assert!(!refused.status.success());
    let err = text(&refused.stderr);
    assert!(
        err.contains("--yes") && err.contains(&format!("{}: 1 ready", n.work_queue)),
        "{err}"
    );
    for q in &queues {
        assert!(exists(q.clone()).await, "{q} was deleted without --yes");
    }

    // On a terminal (script(1) gives it one) it asks, and "n" deletes nothing.
    let words = [
        env!("CARGO_BIN_EXE_lastcall"),
        "--amqp-url",
        AMQP,
        "--prefix",
        &env.prefix,
        "topology",
        "delete",
        "--retry-delays-ms",
        "1000,5000",
    ];
    let line = words
        .iter()
        .map(|w| format!("'{w}'"))
        .collect::<Vec<_>>()
        .join(" ");
    let mut tty = Command::new("script")
        .args(["-qec", &line, "/dev/null"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("script(1) from util-linux");
    use std::io::Write as _;
    tty.stdin.take().unwrap().write_all(b"n\n").unwrap();
    let asked = tty.wait_with_output().unwrap();
    let shown = text(&asked.stdout);
    assert!(!asked.status.success(), "{shown}");
    assert!(
        shown.contains("[y/N]") && shown.contains("nothing deleted"),
        "{shown}"
    );
    for q in &queues {
        assert!(exists(q.clone()).await, "{q} was deleted after answering n");
    }

    let out = env
        .command()
        .args([
            "topology",
            "delete",
            "--yes",
            "--retry-delays-ms",
            "1000,5000",
        ])
        .env_remove("LASTCALL_LOG")
        .output_bounded()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    // The passive declares of the queues that never existed (parked, dead.*) log nothing.
    assert_eq!(text(&out.stderr), "", "stderr");
    assert!(
        text(&out.stdout).contains(&format!("deleted {} queue(s)", queues.len())),
        "{}",
        text(&out.stdout)
    );
    for q in &queues {
        assert!(!exists(q.clone()).await, "{q} still exists");
    }
    // The exchanges are gone too: a passive declare finds nothing.
    let conn = lapin::Connection::connect(AMQP, lapin::ConnectionProperties::default())
        .await
        .unwrap();
    for (x, kind) in [
        (&n.jobs_exchange, lapin::ExchangeKind::Topic),
        (&n.dlx, lapin::ExchangeKind::Topic),
        (&n.lanes_exchange, lapin::ExchangeKind::Direct),
    ] {
        let ch = conn.create_channel().await.unwrap();
        let r = ch
            .exchange_declare(
                x.as_str().into(),
                kind,
                lapin::options::ExchangeDeclareOptions {
                    passive: true,
                    ..Default::default()
                },
                lapin::types::FieldTable::default(),
            )
            .await;
        let e = r.expect_err("the exchange should be gone");
        assert!(e.to_string().contains("NOT_FOUND"), "{x}: {e}");
    }
    let _ = conn.close(200, "bye".into()).await;
    env.cleanup().await;
}
