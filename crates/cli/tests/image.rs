//! The container image (deploy/Containerfile, built by scripts/image.sh) as users run it:
//! `serve`, a worker and the dead-letter processor in containers of the image, against the
//! local RabbitMQ and a fresh PostgreSQL ledger; a job submitted through the image's
//! `lastcall submit --wait` and one through its `serve`, their outcomes read back; the
//! image's health check on `/readyz`; a non-root user.
//!
//! What this machine's podman needs (docs/deploy.md): host networking (the services listen
//! on 127.0.0.1), and explicit `--ulimit nofile=…` and `nproc=…` no higher than the limits
//! this process has — runc's defaults are higher, and raising a limit is refused here.
//!
//! Skipped, saying why, only when `scripts/image.sh --check` finds it cannot be set up on
//! the machine (no podman and no apt-get as root); with LASTCALL_REQUIRE_IMAGE=1 (CI) that
//! fails instead.

use crate::common;

use common::http::{curl, post_job};
use common::*;
use std::path::PathBuf;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

const TOKEN: &str = "image-test-token-0123456789";

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The image's tag after `scripts/image.sh` made sure it is up to date (seconds when it is;
/// a first run builds the release binaries, the base and the image), or `None` when the
/// script cannot be set up here.
fn image() -> Option<String> {
    let script = repo().join("scripts/image.sh");
    let check = output_within(
        Command::new(&script).arg("--check"),
        "scripts/image.sh --check",
        Duration::from_secs(60),
    );
    if check.status.code() == Some(2) {
        let why = text(&check.stderr);
        assert!(
            std::env::var_os("LASTCALL_REQUIRE_IMAGE").is_none(),
            "LASTCALL_REQUIRE_IMAGE is set but scripts/image.sh cannot be set up: {why}"
        );
        eprintln!("SKIPPED: scripts/image.sh cannot be set up on this machine: {why}");
        return None;
    }
    assert!(check.status.success(), "{}", text(&check.stderr));
    let out = output_within(
        &mut Command::new(&script),
        "scripts/image.sh",
        Duration::from_secs(30 * 60),
    );
    assert!(
        out.status.success(),
        "scripts/image.sh failed:\n{}",
        text(&out.stderr)
    );
    Some(std::env::var("LASTCALL_IMAGE").unwrap_or_else(|_| "lastcall:dev".into()))
}

/// `podman` with `args`, bounded; panics naming the command when it fails.
fn podman(args: &[&str]) -> Output {
    let out = output_within(
        Command::new("podman").args(args),
        &format!("podman {}", args.join(" ")),
        CHILD_LIMIT,
    );
    assert!(
        out.status.success(),
        "podman {}: {}",
        args.join(" "),
        text(&out.stderr)
    );
    out
}

/// The run flags this machine's podman needs (module docs): host networking and the
/// limits of this process, at most 65536 open files and 4096 processes.
fn run_flags() -> Vec<String> {
    let hard = |opt: &str| -> u64 {
        let out = Command::new("sh")
            .args(["-c", &format!("ulimit -H{opt}")])
            .output()
            .unwrap();
        text(&out.stdout).trim().parse().unwrap_or(u64::MAX)
    };
    let nofile = hard("n").min(65_536);
    let nproc = hard("u").min(4_096);
    vec![
        "--network".into(),
        "host".into(),
        "--ulimit".into(),
        format!("nofile={nofile}:{nofile}"),
        "--ulimit".into(),
        format!("nproc={nproc}:{nproc}"),
    ]
}

/// Containers removed on drop, also when the test fails (their logs printed first).
struct Containers(Vec<String>);

impl Drop for Containers {
    fn drop(&mut self) {
        for name in &self.0 {
            if std::thread::panicking()
                && let Ok(out) = Command::new("podman").args(["logs", name]).output()
            {
                eprintln!(
                    "--- podman logs {name}:\n{}{}",
                    text(&out.stdout),
                    text(&out.stderr)
                );
            }
            let _ = Command::new("podman")
                .args(["rm", "--force", "--time", "2", name])
                .output();
        }
    }
}

/// Poll the container's health check (`podman healthcheck run`, the image's HEALTHCHECK)
/// until it passes; panics after 60 s with the last answer.
fn wait_healthy(name: &str) {
    let until = Instant::now() + Duration::from_secs(60);
    loop {
        let out = Command::new("podman")
            .args(["healthcheck", "run", name])
            .output()
            .unwrap();
        if out.status.success() {
            return;
        }
        assert!(
            Instant::now() < until,
            "{name} not healthy after 60 s: {}{}",
            text(&out.stdout),
            text(&out.stderr)
        );
        std::thread::sleep(Duration::from_millis(250));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_image_runs_serve_worker_and_dlq_against_the_broker_and_ledger() {
    let Some(tag) = image() else { return };
    let env = Env::postgres("image").await;
    let flags = run_flags();
    let connect = [
        "--amqp-url",
        AMQP,
        "--store-url",
        env.store_url.as_str(),
        "--prefix",
        env.prefix.as_str(),
    ];
    let delays = ["--retry-delays-ms", "1000,5000"];
    let mut containers = Containers(Vec::new());
    // `podman run -d` of the image with `command`; returns the container's name.
    let mut start = |role: &str, envs: &[(&str, &str)], command: &[&str]| -> String {
        let name = format!("{}-{role}", env.prefix);
        let mut args: Vec<String> = vec!["run".into(), "--detach".into(), "--name".into()];
        args.push(name.clone());
        args.extend(flags.iter().cloned());
        for (k, v) in envs {
            args.push("--env".into());
            args.push(format!("{k}={v}"));
        }
        args.push(tag.clone());
        args.extend(connect.iter().map(|s| s.to_string()));
        args.extend(command.iter().map(|s| s.to_string()));
        podman(&args.iter().map(String::as_str).collect::<Vec<_>>());
        containers.0.push(name.clone());
        name
    };

    // Non-root: the image's user, and the user its processes run as.
    let user = podman(&["image", "inspect", "--format", "{{.Config.User}}", &tag]);
    assert_eq!(text(&user.stdout).trim(), "10001:10001");

    // The dead-letter processor first, and no worker yet: a job whose deadline passes in the
    // queue expires at the broker, and the container records it.
    let dlq = start("dlq", &[], &["dlq", delays[0], delays[1]]);
    let submit = |extra: &[&str]| -> Output {
        let mut args: Vec<String> = vec!["run".into(), "--rm".into()];
        args.extend(flags.iter().cloned());
        args.push(tag.clone());
        args.extend(connect.iter().map(|s| s.to_string()));
        args.push("submit".into());
        args.extend(extra.iter().map(|s| s.to_string()));
        output_within(
            Command::new("podman").args(&args),
            &format!("podman {}", args.join(" ")),
            CHILD_LIMIT,
        )
    };
    let late = submit(&[
        "--kind",
        "incident.summary",
        "--prompt",
        "too late",
        "--job-id",
        "img-late",
        "--deadline-ms",
        "1500",
    ]);
    assert!(late.status.success(), "{}", text(&late.stderr));
    let rec = env
        .wait_terminal(&["img-late".into()], Duration::from_secs(30))
        .await
        .remove(0);
    assert_eq!(rec.state, "expired_before_receive", "{rec:?}");
    assert_eq!(rec.backend_calls, 0);
    let running = podman(&["inspect", "--format", "{{.State.Running}}", &dlq]);
    assert_eq!(text(&running.stdout).trim(), "true");

    // A worker with the sim backend; its health check points at its metrics address.
    let metrics = common::private_rabbit::free_port();
    let metrics_addr = format!("127.0.0.1:{metrics}");
    let health = format!("http://{metrics_addr}/readyz");
    let worker = start(
        "worker",
        &[("LASTCALL_HEALTH_URL", &health)],
        &[
            "worker",
            "--backend",
            "sim",
            "--sim-latency-ms",
            "50",
            "--name",
            "image-worker",
            "--metrics-addr",
            &metrics_addr,
            delays[0],
            delays[1],
        ],
    );
    wait_healthy(&worker);
    let uid = podman(&["exec", &worker, "id", "-u"]);
    assert_eq!(text(&uid.stdout).trim(), "10001", "the worker runs as root");

    // A job through the image's `submit --wait`: its outcome printed, and in the ledger.
    let done = submit(&[
        "--kind",
        "incident.summary",
        "--prompt",
        "hello from the image",
        "--job-id",
        "img-cli",
        "--deadline-ms",
        "30000",
        "--wait",
    ]);
    assert!(
        done.status.success(),
        "submit --wait: {}{}",
        text(&done.stdout),
        text(&done.stderr)
    );
    assert!(
        text(&done.stdout).contains("state: completed"),
        "{}",
        text(&done.stdout)
    );
    let rec = env.ledger.get("img-cli").await.unwrap().unwrap();
    assert_eq!(rec.state, "completed", "{rec:?}");
    assert_eq!(rec.worker.as_deref(), Some("image-worker"));
    assert_eq!(rec.backend_calls, 1);

    // `serve` from the image: healthy by the image's own check once /readyz answers 200;
    // a job posted to it runs on the worker, and its outcome is read back through it.
    let port = common::private_rabbit::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let serve = start(
        "serve",
        &[
            ("LASTCALL_HTTP_TOKEN", TOKEN),
            ("LASTCALL_HEALTH_URL", &format!("{base}/readyz")),
        ],
        &[
            "serve",
            "--addr",
            &format!("127.0.0.1:{port}"),
            delays[0],
            delays[1],
        ],
    );
    wait_healthy(&serve);
    let (code, body) = post_job(&base, TOKEN, "img-http", 30_000);
    assert_eq!(code, 202, "{body}");
    let until = Instant::now() + Duration::from_secs(30);
    let outcome = loop {
        let (code, body) = curl(&[
            "-H",
            &format!("Authorization: Bearer {TOKEN}"),
            &format!("{base}/v1/jobs/img-http"),
        ]);
        assert_eq!(code, 200, "{body}");
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        if v["state"] != "accepted" && v["state"] != "running" {
            break v;
        }
        assert!(Instant::now() < until, "no outcome through serve: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert_eq!(outcome["state"], "completed", "{outcome}");
    assert_eq!(outcome["worker"], "image-worker", "{outcome}");

    drop(containers);
    env.cleanup().await;
}
