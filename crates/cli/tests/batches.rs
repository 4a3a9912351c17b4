//! The OpenAI-compatible Batch API through the official `openai` Python SDK (the venv of
//! `scripts/setup-python-example.sh`), against the real `lastcall serve` with a tokens
//! file, a real `lastcall worker --backend sim`, RabbitMQ and the ledger:
//! - `files.create`, `batches.create`, `retrieve`, `list`, `files.content` of the output and
//!   error files: every well-formed line ran as a job of tier `batch` with the deadline
//!   `created_at + window`, a malformed one is in the error file with its line number;
//! - `batches.cancel`: the lines not started end `cancelled`, the batch `cancelled`;
//! - another tenant's token finds none of it (`404`, as a missing one);
//! - a `serve` restarted in the middle of publishing goes on from its persisted cursor, and
//!   every line is one job with one outcome;
//! - `lastcall batch` (create, show --wait, list, results, results --errors, cancel) does
//!   the same from the command line.

use crate::common;

use common::http::Children;
use common::*;
use serde_json::{Value, json};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const OPERATOR: &str = "operator-token-batches-0123456789";
const TEAM_A: &str = "team-a-token-batches-0123456789";
const TEAM_B: &str = "team-b-token-batches-0123456789";

const SDK: &str = r#"
import json, sys, time
import openai

base, token, case = sys.argv[1], sys.argv[2], sys.argv[3]
args = sys.argv[4:]
client = openai.OpenAI(base_url=base + "/v1", api_key=token, max_retries=0, timeout=30.0)

def out(**kw):
    print(json.dumps(kw))

def wait(batch_id, until_status, seconds):
    end = time.time() + seconds
    seen = []
    while True:
        b = client.batches.retrieve(batch_id)
        if not seen or seen[-1] != b.status:
            seen.append(b.status)
        if b.status in until_status or time.time() > end:
            return b, seen
        time.sleep(0.2)

try:
    if case == "create":
        path, window = args[0], args[1]
        f = client.files.create(file=open(path, "rb"), purpose="batch")
        got = client.files.retrieve(f.id)
        b = client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                                  completion_window=window, metadata={"run": "test"})
        out(file=f.model_dump(), retrieved=got.model_dump(), batch=b.model_dump())
    elif case == "finish":
        b, seen = wait(args[0], ("completed", "expired", "failed", "cancelled"), 90)
        listed = [x.id for x in client.batches.list(limit=100)]
        page = client.batches.list(limit=1)
        output = client.files.content(b.output_file_id).text if b.output_file_id else None
        errors = client.files.content(b.error_file_id).text if b.error_file_id else None
        out(batch=b.model_dump(), seen=seen, listed=listed,
            page=[x.id for x in page.data], has_more=page.has_more,
            output=output, errors=errors)
    elif case == "cancel":
        c = client.batches.cancel(args[0])
        b, seen = wait(args[0], ("cancelled",), 90)
        errors = client.files.content(b.error_file_id).text if b.error_file_id else None
        out(first=c.status, batch=b.model_dump(), seen=seen, errors=errors)
    elif case == "content":
        out(text=client.files.content(args[0]).text)
    elif case == "probe":
        # Another tenant's ids: each call must fail as a missing one would.
        batch_id, file_id = args[0], args[1]
        res = {}
        for name, call in [
            ("batch", lambda: client.batches.retrieve(batch_id)),
            ("cancel", lambda: client.batches.cancel(batch_id)),
            ("file", lambda: client.files.retrieve(file_id)),
            ("content", lambda: client.files.content(file_id)),
            ("delete", lambda: client.files.delete(file_id)),
            ("missing", lambda: client.batches.retrieve("batch_000000000000000000000000")),
        ]:
            try:
                call()
                res[name] = 200
            except openai.APIStatusError as e:
                res[name] = e.status_code
        out(status=res, listed=[x.id for x in client.batches.list()])
    elif case == "upload":
        client.files.create(file=open(args[0], "rb"), purpose="batch")
        out(unexpected="uploaded")
    elif case == "bad-window":
        f = client.files.create(file=open(args[0], "rb"), purpose="batch")
        client.batches.create(input_file_id=f.id, endpoint="/v1/chat/completions",
                              completion_window="3 weeks")
        out(unexpected="created")
except openai.APIStatusError as e:
    out(status=e.status_code, body=e.body)
"#;

/// A chat line of a batch input file.
fn line(custom_id: &str, extra: Value) -> String {
    let mut body = json!({"model": "m", "messages": [{"role": "user", "content": format!("hello {custom_id}")}]});
    if let (Value::Object(b), Value::Object(e)) = (&mut body, extra) {
        b.extend(e);
    }
    json!({"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body})
        .to_string()
}

struct Stack {
    dir: PathBuf,
    tokens: PathBuf,
    script: PathBuf,
    base: String,
    port: u16,
    serve: Option<Children>,
    _worker: Children,
}

impl Stack {
    fn start(env: &Env, quota: &str) -> Stack {
        let tokens = env.dir.join("tokens.toml");
        std::fs::write(
            &tokens,
            format!(
                "[[token]]\nsha256 = \"{}\"\ntenant = \"team-a\"\n{quota}\n\n[[token]]\nsha256 = \"{}\"\ntenant = \"team-b\"\n",
                lastcall_http::tokens::hash_token(TEAM_A),
                lastcall_http::tokens::hash_token(TEAM_B),
            ),
        )
        .unwrap();
        let script = env.dir.join("sdk.py");
        std::fs::write(&script, SDK).unwrap();
        let worker = env
            .command()
            .args(["worker", "--backend", "sim", "--slots", "2"])
            .args(["--sim-latency-ms", "10", "--retry-delays-ms", "1000,5000"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the worker");
        let port = common::private_rabbit::free_port();
        let mut s = Stack {
            dir: env.dir.clone(),
            tokens,
            script,
            base: format!("http://127.0.0.1:{port}"),
            port,
            serve: None,
            _worker: Children(vec![worker]),
        };
        s.start_serve(env);
        s
    }

    fn start_serve(&mut self, env: &Env) {
        let child = env
            .command()
            .args(["serve", "--addr", &format!("127.0.0.1:{}", self.port)])
            .args([
                "--retry-delays-ms",
                "1000,5000",
                "--no-shed",
                "--no-management",
            ])
            .arg("--tokens-file")
            .arg(&self.tokens)
            .env("LASTCALL_HTTP_TOKEN", OPERATOR)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn serve");
        self.serve = Some(Children(vec![child]));
        let until = Instant::now() + Duration::from_secs(30);
        while common::http::curl(&[&format!("{}/readyz", self.base)]).0 != 200 {
            assert!(Instant::now() < until, "serve did not come up");
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn input(&self, name: &str, lines: &[String]) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, lines.join("\n") + "\n").unwrap();
        path
    }

    async fn sdk(&self, token: &str, case: &str, args: &[&str]) -> Value {
        sdk_at(&self.script, &self.base, token, case, args).await
    }
}

async fn sdk_at(script: &Path, base: &str, token: &str, case: &str, args: &[&str]) -> Value {
    let mut c = Command::new(example_python("openai"));
    c.arg(script).args([base, token, case]).args(args);
    let out = tokio::task::spawn_blocking(move || c.output().unwrap())
        .await
        .unwrap();
    let text = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(text.lines().last().unwrap_or("")).unwrap_or_else(|e| {
        panic!(
            "{case}: {e}: {text}{}",
            String::from_utf8_lossy(&out.stderr)
        )
    })
}

fn jsonl(text: &Value) -> Vec<Value> {
    text.as_str()
        .unwrap_or_default()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_runs_lists_and_cancels_batches_within_its_tenant() {
    sdk_batches(Env::sqlite("batches-sdk").await).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_openai_sdk_runs_batches_on_postgres() {
    sdk_batches(Env::postgres("batches-sdk-pg").await).await;
}

async fn sdk_batches(env: Env) {
    let stack = Stack::start(&env, "");

    // Three requests, a line that is not JSON (line 3) and one for another endpoint (5).
    let input = stack.input(
        "input.jsonl",
        &[
            line("a", json!({})),
            line("b", json!({})),
            "{not json".into(),
            line("c", json!({})),
            line("d", json!({})).replace("/v1/chat/completions", "/v1/embeddings"),
        ],
    );
    let created = stack
        .sdk(TEAM_A, "create", &[input.to_str().unwrap(), "2h"])
        .await;
    assert_eq!(created["file"]["purpose"], "batch", "{created}");
    assert_eq!(created["retrieved"], created["file"], "{created}");
    let batch = &created["batch"];
    let batch_id = batch["id"].as_str().unwrap().to_owned();
    let file_id = created["file"]["id"].as_str().unwrap().to_owned();
    assert_eq!(batch["completion_window"], "2h");
    assert_eq!(batch["metadata"]["run"], "test");
    assert_eq!(batch["request_counts"]["total"], 5, "{batch}");
    assert_eq!(
        batch["expires_at"].as_i64().unwrap() - batch["created_at"].as_i64().unwrap(),
        7_200
    );

    let done = stack.sdk(TEAM_A, "finish", &[&batch_id]).await;
    let b = &done["batch"];
    assert_eq!(b["status"], "completed", "{done}");
    assert_eq!(b["request_counts"]["completed"], 3, "{done}");
    assert_eq!(b["request_counts"]["failed"], 2, "{done}");
    assert!(
        done["listed"]
            .as_array()
            .unwrap()
            .contains(&json!(batch_id))
    );
    let output = jsonl(&done["output"]);
    let ids: Vec<&str> = output
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap())
        .collect();
    assert_eq!(ids, ["a", "b", "c"], "{done}");
    for l in &output {
        assert_eq!(l["response"]["status_code"], 200);
        let body = &l["response"]["body"];
        assert_eq!(body["object"], "chat.completion");
        assert!(
            !body["choices"][0]["message"]["content"]
                .as_str()
                .unwrap()
                .is_empty()
        );
        // Each line ran as a job of the batch's tenant, tier `batch`, with the deadline
        // `created_at + window`.
        let rec = env
            .ledger
            .get(l["response"]["request_id"].as_str().unwrap())
            .await
            .unwrap()
            .unwrap();
        assert_eq!(
            (rec.tenant.as_str(), rec.priority.as_str()),
            ("team-a", "batch")
        );
        let row = env.ledger.get_batch(&batch_id).await.unwrap().unwrap();
        assert_eq!(rec.expires_at_ms, Some(row.created_at_ms + 7_200_000));
        assert_eq!(
            rec.result.as_deref(),
            body["choices"][0]["message"]["content"].as_str()
        );
    }
    let errors = jsonl(&done["errors"]);
    assert_eq!(errors.len(), 2, "{done}");
    assert_eq!(errors[0]["error"]["code"], "invalid_json_line");
    assert!(
        errors[0]["error"]["message"]
            .as_str()
            .unwrap()
            .contains("line 3")
    );
    assert_eq!(errors[1]["custom_id"], "d");
    assert_eq!(errors[1]["error"]["code"], "invalid_url");

    // Cancelled: the worker runs two lines at a time for 20 s each; the rest never start.
    let slow: Vec<String> = (0..6)
        .map(|i| line(&format!("slow-{i}"), json!({"sim_latency_ms": 20_000})))
        .collect();
    let input = stack.input("slow.jsonl", &slow);
    let created = stack
        .sdk(TEAM_A, "create", &[input.to_str().unwrap(), "30m"])
        .await;
    let slow_id = created["batch"]["id"].as_str().unwrap().to_owned();
    let cancelled = stack.sdk(TEAM_A, "cancel", &[&slow_id]).await;
    assert!(
        ["cancelling", "cancelled"].contains(&cancelled["first"].as_str().unwrap()),
        "{cancelled}"
    );
    assert_eq!(cancelled["batch"]["status"], "cancelled", "{cancelled}");
    let counts = &cancelled["batch"]["request_counts"];
    assert_eq!(counts["total"], 6);
    assert_eq!(counts["failed"], 6, "{cancelled}");
    let errors = jsonl(&cancelled["errors"]);
    assert_eq!(errors.len(), 6, "{cancelled}");
    assert!(
        errors
            .iter()
            .all(|l| l["error"]["code"] == "batch_cancelled"),
        "{cancelled}"
    );

    // Another tenant finds none of it, as if it did not exist.
    let probe = stack.sdk(TEAM_B, "probe", &[&batch_id, &file_id]).await;
    for (call, status) in probe["status"].as_object().unwrap() {
        assert_eq!(status, 404, "team-b's {call}: {probe}");
    }
    assert_eq!(probe["listed"], json!([]), "{probe}");
    // Its owner still does.
    let content = stack.sdk(TEAM_A, "content", &[&file_id]).await;
    assert_eq!(content["text"].as_str().unwrap().lines().count(), 5);

    // A window that is no window is refused, naming the field.
    let bad = stack
        .sdk(TEAM_A, "bad-window", &[input.to_str().unwrap()])
        .await;
    assert_eq!(bad["status"], 400, "{bad}");
    assert!(
        bad["body"].to_string().contains("completion_window"),
        "{bad}"
    );
    drop(stack);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restarted_serve_goes_on_publishing_from_the_batch_cursor() {
    let env = Env::sqlite("batches-restart").await;
    // Four lines a second: publishing 40 takes about ten seconds.
    let mut stack = Stack::start(&env, "jobs_per_second = 4");
    let lines: Vec<String> = (0..40)
        .map(|i| line(&format!("r-{i}"), json!({})))
        .collect();
    let input = stack.input("restart.jsonl", &lines);
    let created = stack
        .sdk(TEAM_A, "create", &[input.to_str().unwrap(), "24h"])
        .await;
    let batch_id = created["batch"]["id"].as_str().unwrap().to_owned();
    // Stop `serve` once some lines, not all, are published.
    let until = Instant::now() + Duration::from_secs(60);
    let at_stop = loop {
        let row = env.ledger.get_batch(&batch_id).await.unwrap().unwrap();
        if row.cursor >= 4 {
            break row.cursor;
        }
        assert!(Instant::now() < until, "no line was published");
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    stack.serve = None;
    let row = env.ledger.get_batch(&batch_id).await.unwrap().unwrap();
    assert!(
        row.cursor < 40,
        "all published before the stop ({at_stop}): the test proves nothing"
    );
    stack.start_serve(&env);
    let done = stack.sdk(TEAM_A, "finish", &[&batch_id]).await;
    assert_eq!(done["batch"]["status"], "completed", "{done}");
    assert_eq!(done["batch"]["request_counts"]["completed"], 40, "{done}");
    let output = jsonl(&done["output"]);
    let mut ids: Vec<String> = output
        .iter()
        .map(|l| l["custom_id"].as_str().unwrap().to_owned())
        .collect();
    ids.dedup();
    assert_eq!(ids.len(), 40, "{done}");
    // One job per line, each with one model call.
    let row = env.ledger.get_batch(&batch_id).await.unwrap().unwrap();
    let job_ids: Vec<String> = (1..=40).map(|n| row.job_id(n)).collect();
    let recs = env.ledger.jobs_many(&job_ids).await.unwrap();
    assert_eq!(recs.len(), 40);
    assert!(
        recs.iter()
            .all(|r| r.state == "completed" && r.backend_calls == 1),
        "{recs:?}"
    );
    drop(stack);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lines_not_done_by_the_window_end_are_in_the_error_file_as_expired() {
    let env = Env::sqlite("batches-expired").await;
    let stack = Stack::start(&env, "");
    // A 5 s window; each call would take 20 s, and the worker runs two at a time.
    let lines: Vec<String> = (0..4)
        .map(|i| line(&format!("late-{i}"), json!({"sim_latency_ms": 20_000})))
        .collect();
    let input = stack.input("late.jsonl", &lines);
    // A 7-day batch first: its deadline lies beyond the 24 h horizon, so no line of it is
    // published yet (the publisher takes batches in creation order, so by the time the
    // 5 s batch has ended it has passed this one many times).
    let week = stack
        .sdk(TEAM_A, "create", &[input.to_str().unwrap(), "7d"])
        .await;
    let week_id = week["batch"]["id"].as_str().unwrap().to_owned();
    assert_eq!(
        week["batch"]["expires_at"].as_i64().unwrap()
            - week["batch"]["created_at"].as_i64().unwrap(),
        7 * 86_400
    );
    let created = stack
        .sdk(TEAM_A, "create", &[input.to_str().unwrap(), "5s"])
        .await;
    let batch_id = created["batch"]["id"].as_str().unwrap().to_owned();
    let done = stack.sdk(TEAM_A, "finish", &[&batch_id]).await;
    let b = &done["batch"];
    assert_eq!(b["status"], "expired", "{done}");
    assert_eq!(b["expired_at"], b["expires_at"], "{done}");
    assert_eq!(b["request_counts"]["completed"], 0, "{done}");
    assert_eq!(b["request_counts"]["failed"], 4, "{done}");
    assert_eq!(jsonl(&done["output"]).len(), 0, "{done}");
    let errors = jsonl(&done["errors"]);
    assert_eq!(errors.len(), 4, "{done}");
    assert!(
        errors.iter().all(|l| l["error"]["code"] == "batch_expired"),
        "{done}"
    );
    // No call started after the window's end: each job ended by its deadline.
    let row = env.ledger.get_batch(&batch_id).await.unwrap().unwrap();
    let ids: Vec<String> = (1..=4).map(|n| row.job_id(n)).collect();
    for rec in env.ledger.jobs_many(&ids).await.unwrap() {
        assert!(
            rec.started_at_ms.is_none_or(|s| s < row.expires_at_ms),
            "{rec:?}"
        );
    }
    let week_row = env.ledger.get_batch(&week_id).await.unwrap().unwrap();
    assert_eq!(
        week_row.cursor, 0,
        "a line beyond the horizon was published"
    );
    // Cancelled before any line was published: every line ends never run.
    let cancelled = stack.sdk(TEAM_A, "cancel", &[&week_id]).await;
    assert_eq!(cancelled["batch"]["status"], "cancelled", "{cancelled}");
    assert_eq!(
        cancelled["batch"]["request_counts"]["failed"], 4,
        "{cancelled}"
    );
    drop(stack);
    env.cleanup().await;
}

/// `lastcall batch …` against the stack with `token`; (exit status, stdout, stderr).
fn batch_cli(env: &Env, stack: &Stack, token: &str, args: &[&str]) -> (i32, String, String) {
    let mut c = env.command();
    c.args(["batch", "--url", &stack.base])
        .args(args)
        .env("LASTCALL_HTTP_TOKEN", token);
    let out = output_within(
        &mut c,
        &format!("lastcall batch {}", args.join(" ")),
        CHILD_LIMIT,
    );
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_batch_command_creates_waits_for_and_reads_a_batch() {
    let env = Env::sqlite("batches-cli").await;
    let stack = Stack::start(&env, "");
    let mut lines: Vec<String> = (0..3)
        .map(|i| line(&format!("cli-{i}"), json!({})))
        .collect();
    lines.push("not json".into());
    let input = stack.input("cli.jsonl", &lines);
    let input = input.to_str().unwrap();

    let (code, out, err) = batch_cli(
        &env,
        &stack,
        TEAM_A,
        &["create", input, "--window", "1h", "--metadata", "run=cli"],
    );
    assert_eq!(code, 0, "{out}{err}");
    let id = out.trim().to_owned();
    assert!(id.starts_with("batch_"), "{out}");
    assert!(
        err.contains("uploaded") && err.contains("window 1h"),
        "{err}"
    );
    let row = env.ledger.get_batch(&id).await.unwrap().expect("the batch");
    assert_eq!(row.completion_window, "1h");
    assert_eq!(row.metadata.as_deref(), Some(r#"{"run":"cli"}"#));

    let (code, out, err) = batch_cli(&env, &stack, TEAM_A, &["show", &id, "--wait"]);
    assert_eq!(code, 0, "{out}{err}");
    assert!(
        out.contains(&id)
            && out.contains("completed")
            && out.contains("3 of 4 completed, 1 failed"),
        "{out}"
    );
    let (_, listed, _) = batch_cli(&env, &stack, TEAM_A, &["list"]);
    assert!(listed.contains(&id), "{listed}");

    let (code, out, err) = batch_cli(&env, &stack, TEAM_A, &["results", &id]);
    assert_eq!(code, 0, "{err}");
    let answers: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let mut ids: Vec<&str> = answers
        .iter()
        .map(|a| a["custom_id"].as_str().unwrap())
        .collect();
    ids.sort();
    assert_eq!(ids, ["cli-0", "cli-1", "cli-2"], "{out}");
    let (code, out, err) = batch_cli(&env, &stack, TEAM_A, &["results", &id, "--errors"]);
    assert_eq!(code, 0, "{err}");
    let errors: Vec<Value> = out
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(errors.len(), 1, "the malformed line: {out}");

    // Another tenant finds nothing, and the error says why.
    let (code, _, err) = batch_cli(&env, &stack, TEAM_B, &["show", &id]);
    assert_ne!(code, 0);
    assert!(err.contains("404"), "{err}");
    // A window the API refuses: the error names it.
    let (code, _, err) = batch_cli(
        &env,
        &stack,
        TEAM_A,
        &["create", input, "--window", "3 weeks"],
    );
    assert_ne!(code, 0);
    assert!(
        err.contains("400") && err.contains("`3 weeks` is not a completion window"),
        "{err}"
    );
    // Cancelled: a 7-day batch whose lines are beyond the publishing horizon.
    let (_, week, _) = batch_cli(&env, &stack, TEAM_A, &["create", input, "--window", "7d"]);
    let (code, out, err) = batch_cli(&env, &stack, TEAM_A, &["cancel", week.trim()]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("cancel"), "{out}");
    env.cleanup().await;
}
