//! A producer outside Rust (issue #16): `examples/python/producer.py` publishes with pika
//! and signs with Python's `hmac`, against the real broker, a real `lastcall worker` that
//! requires signatures (so an unsigned or wrongly signed job would be `rejected`), and a
//! real `lastcall serve` whose `GET /v1/jobs/{id}` it long-polls for the outcome.
//!
//! The example runs with the venv of `scripts/setup-python-example.sh` (pika from PyPI);
//! without it these tests fail and say so.

use crate::common;

use common::http::{Children, curl};
use common::*;
use lastcall_broker::topology::queue_depth;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const KEY: &str = "python-example-key-0123456789abcdef-0123";
const TOKEN: &str = "python-example-token-0123456789";
const EXPIRED: [&str; 3] = [
    "expired_not_started",
    "expired_before_receive",
    "deadline_exceeded",
];

fn producer_py() -> PathBuf {
    PathBuf::from(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../examples/python/producer.py"
    ))
}

/// A worker that requires signatures and `serve` (with the dead-letter processor, so a
/// job the broker expires is recorded too), both holding the key; killed on drop.
struct Stack {
    python: PathBuf,
    base: String,
    log: PathBuf,
    _children: Children,
}

impl Stack {
    async fn start(env: &Env, python: PathBuf) -> Stack {
        let log = env.dir.join("calls.log");
        let port = common::private_rabbit::free_port();
        let base = format!("http://127.0.0.1:{port}");
        let spawn = |c: &mut Command| {
            c.args(["--retry-delays-ms", "1000,5000"])
                .env("LASTCALL_SIGNING_KEY", KEY)
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .expect("spawn the lastcall binary")
        };
        let worker = spawn(
            env.command()
                .args(["worker", "--backend", "sim", "--slots", "1"])
                .args(["--sim-latency-ms", "10"])
                .arg("--sim-call-log")
                .arg(&log),
        );
        let serve = spawn(
            env.command()
                .args(["serve", "--addr", &format!("127.0.0.1:{port}")])
                .args(["--no-management", "--dlq"])
                .env("LASTCALL_HTTP_TOKEN", TOKEN),
        );
        let stack = Stack {
            python,
            base,
            log,
            _children: Children(vec![worker, serve]),
        };
        let until = Instant::now() + Duration::from_secs(30);
        while curl(&[&format!("{}/readyz", stack.base)]).0 != 200 {
            assert!(Instant::now() < until, "serve did not come up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        // The worker consumes the work queue: a job is delivered as soon as it is queued.
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let consumers = queue_depth(&env.broker, &env.topo.names.work_queue)
                .await
                .unwrap()
                .map_or(0, |(_, c)| c);
            if consumers >= 1 {
                break;
            }
            assert!(Instant::now() < until, "the worker did not start consuming");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        stack
    }

    /// Run the example against this stack; it exits on its own by expires_at_ms + grace.
    async fn produce(&self, env: &Env, args: &[&str]) -> Output {
        let mut c = Command::new(&self.python);
        c.arg(producer_py())
            .args(["--amqp-url", AMQP, "--prefix", &env.prefix])
            .args(["--http-url", &self.base, "--grace-ms", "5000"])
            .args(args)
            .env("LASTCALL_TOKEN", TOKEN)
            .env("LASTCALL_SIGNING_KEY", KEY);
        let out = tokio::task::spawn_blocking(move || c.output().expect("run producer.py"))
            .await
            .unwrap();
        // Shown with `--no-capture`, and by nextest when the test fails.
        eprintln!("producer.py {}\n{}", args.join(" "), show(&out));
        out
    }
}

fn show(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn self_test_reproduces_the_documented_signature_and_no_budget_is_refused() {
    let python = example_python("pika");
    let out = Command::new(&python)
        .arg(producer_py())
        .arg("--self-test")
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stdout)
            .contains("v1=deec069eaa47cf6661668e68036555c21668599ccded1876aa39a08cd02b454d"),
        "{}",
        show(&out)
    );
    // A job whose budget is already spent is never published (exit 2, said why); no broker
    // is needed to refuse it.
    let out = Command::new(&python)
        .arg(producer_py())
        .args(["--budget-ms", "0", "--amqp-url", "amqp://127.0.0.1:1/%2f"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("remaining budget is <= 0"),
        "{}",
        show(&out)
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_signed_python_job_completes_and_its_outcome_is_read_over_http() {
    // First, so that a missing venv fails before anything is set up.
    let python = example_python("pika");
    let env = Env::sqlite("py-example").await;
    let stack = Stack::start(&env, python).await;
    let out = stack
        .produce(
            &env,
            &[
                "--job-id",
                "py-ok",
                "--budget-ms",
                "30000",
                "--tenant",
                "team-py",
                "--priority",
                "critical",
            ],
        )
        .await;
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("state: completed"), "{}", show(&out));
    assert!(stdout.contains("backend_calls: 1"), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains(", signed)"),
        "{}",
        show(&out)
    );

    let rec = env.ledger.get("py-ok").await.unwrap().expect("a record");
    assert_eq!(rec.state, "completed", "{rec:?}");
    assert_eq!(rec.backend_calls, 1, "{rec:?}");
    // The tenant and tier, signed with the body, reached the worker's record.
    assert_eq!(
        (rec.tenant.as_str(), rec.priority.as_str()),
        ("team-py", "critical"),
        "{rec:?}"
    );
    assert_eq!(calls_in(&stack.log, "py-ok"), 1);
    assert_eq!(
        rec.expires_at_ms.unwrap() - rec.created_at_ms.unwrap(),
        30_000,
        "the deadline the example stamped: {rec:?}"
    );
    assert!(
        stdout.contains(&format!(
            "result: {}",
            rec.result.clone().unwrap_or_default()
        )),
        "the result text is printed: {}",
        show(&out)
    );
    // Nothing was refused as badly signed (that would be a `rejected` record under a
    // synthetic id).
    let rejected = env
        .ledger
        .list(&lastcall_store::ListFilter {
            state: Some("rejected".into()),
            ..Default::default()
        })
        .await
        .unwrap();
    assert!(rejected.is_empty(), "{rejected:?}");
    drop(stack);
    env.cleanup().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_python_job_that_cannot_finish_in_its_budget_exits_expired() {
    // First, so that a missing venv fails before anything is set up.
    let python = example_python("pika");
    let env = Env::sqlite("py-example-expired").await;
    let stack = Stack::start(&env, python).await;
    // The sim backend takes 30 s for this job; its budget is 1.5 s.
    let out = stack
        .produce(
            &env,
            &[
                "--job-id",
                "py-late",
                "--budget-ms",
                "1500",
                "--payload-json",
                r#"{"sim_latency_ms": 30000}"#,
            ],
        )
        .await;
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    let rec = env.ledger.get("py-late").await.unwrap().expect("a record");
    assert!(EXPIRED.contains(&rec.state.as_str()), "{rec:?}");
    assert!(
        String::from_utf8_lossy(&out.stdout).contains(&format!("state: {}", rec.state)),
        "{}",
        show(&out)
    );
    assert!(rec.backend_calls <= 1, "{rec:?}");
    drop(stack);
    env.cleanup().await;
}
