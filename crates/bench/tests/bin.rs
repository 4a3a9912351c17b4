//! The `lastcall-bench` binary on its own (not through `lastcall bench`): its help, its
//! settings (flag > environment > lastcall.toml > default, as `lastcall`'s), and one smoke
//! bench against the real broker. `crates/cli/tests/bench.rs` runs the benches through the
//! `lastcall bench` alias.

use serde_json::Value;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

/// The broker of the test suite (RabbitMQ on 127.0.0.1:5672, guest/guest).
const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

fn unique(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    format!("lcb-{tag}-{}-{nanos:x}", std::process::id())
}

/// A fresh empty directory to run in (no lastcall.toml unless the test writes one).
fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(unique(tag));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `lastcall-bench ARGS` in `dir`, with none of the caller's LASTCALL_* settings; killed
/// (and the test failed) if it runs past two minutes.
fn bench(dir: &std::path::Path, args: &[&str], env: &[(&str, &str)]) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lastcall-bench"));
    for var in [
        "LASTCALL_AMQP_URL",
        "LASTCALL_PREFIX",
        "LASTCALL_CONFIG",
        "LASTCALL_LOG",
    ] {
        c.env_remove(var);
    }
    c.envs(env.iter().copied())
        .env("NO_COLOR", "1")
        .args(args)
        .current_dir(dir)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c.spawn().expect("lastcall-bench starts");
    let started = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > Duration::from_secs(120) {
            let _ = child.kill();
            let _ = child.wait();
            panic!("lastcall-bench {args:?} ran past 2 minutes");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

#[test]
fn help_teaches_and_shows_no_setting_s_value() {
    let dir = temp_dir("help");
    let secret = [("LASTCALL_AMQP_URL", "amqp://bob:pw-SECRET-1f2e@h:5672/%2f")];
    let out = bench(&dir, &["--help"], &secret);
    assert!(out.status.success(), "{}", text(&out.stderr));
    let help = text(&out.stdout);
    for word in [
        "Usage: lastcall-bench",
        "goodput",
        "ack-modes",
        "ledger",
        "front-door",
        "sim",
        "--smoke",
        "--release",
        "--amqp-url",
        "[env: LASTCALL_AMQP_URL]",
        "--prefix",
        "lastcall.toml",
        "Global options",
    ] {
        assert!(help.contains(word), "help lacks {word}: {help}");
    }
    assert!(!help.contains("SECRET"), "{help}");
    let out = bench(&dir, &["goodput", "--help"], &secret);
    assert!(out.status.success());
    let help = text(&out.stdout);
    assert!(
        help.contains("capacity") && help.contains("--service"),
        "{help}"
    );
    assert!(!help.contains("SECRET") && !help.contains("=]"), "{help}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The broker URL a run used, from its error against a port where nothing listens: the
/// config file's, then the environment's over it, then the flag's over both; the
/// password masked each time.
#[test]
fn the_broker_url_comes_from_flag_then_environment_then_lastcall_toml() {
    let dir = temp_dir("settings");
    let url = |port: u16| format!("amqp://guest:pw-{port}@127.0.0.1:{port}/%2f");
    std::fs::write(
        dir.join("lastcall.toml"),
        format!(
            "amqp_url = \"{}\"\nprefix = \"from-file\"\n\n[worker]\nslots = 3\n",
            url(1)
        ),
    )
    .unwrap();
    let refused_at = |out: &Output, port: u16| {
        assert_eq!(out.status.code(), Some(1), "{}", text(&out.stderr));
        let err = text(&out.stderr);
        assert!(
            err.contains(&format!("guest:***@127.0.0.1:{port}/")),
            "not the URL on port {port}: {err}"
        );
        assert!(!err.contains("pw-"), "the password shows: {err}");
    };
    let ack = ["ack-modes", "--smoke", "--json"];
    refused_at(&bench(&dir, &ack, &[]), 1);
    let env_url = url(2);
    refused_at(&bench(&dir, &ack, &[("LASTCALL_AMQP_URL", &env_url)]), 2);
    let flag_url = url(3);
    let mut with_flag = vec!["--amqp-url", flag_url.as_str()];
    with_flag.extend(ack);
    refused_at(
        &bench(&dir, &with_flag, &[("LASTCALL_AMQP_URL", &env_url)]),
        3,
    );
    // --config (or LASTCALL_CONFIG) names another file, from anywhere.
    let elsewhere = temp_dir("settings-elsewhere");
    let config = dir.join("lastcall.toml");
    let out = bench(
        &elsewhere,
        &ack,
        &[("LASTCALL_CONFIG", config.to_str().unwrap())],
    );
    refused_at(&out, 1);
    // A file that is not TOML is refused, naming it.
    std::fs::write(elsewhere.join("lastcall.toml"), "amqp_url = [").unwrap();
    let out = bench(&elsewhere, &ack, &[]);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        text(&out.stderr).contains("invalid config file lastcall.toml"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
    let _ = std::fs::remove_dir_all(&elsewhere);
}

/// One smoke bench, end to end against the real broker: the JSON is well-formed and the
/// counts add up (no figure is asserted: the numbers of a smoke run mean nothing).
#[test]
fn a_goodput_smoke_run_on_its_own() {
    let dir = temp_dir("goodput");
    let prefix = unique("goodput");
    let out = bench(
        &dir,
        &[
            "--prefix", &prefix, "goodput", "--smoke", "--policy", "deadline", "--no-svg", "--json",
        ],
        &[("LASTCALL_AMQP_URL", AMQP)],
    );
    assert!(
        out.status.success(),
        "{}\n{}",
        text(&out.stdout),
        text(&out.stderr)
    );
    let j: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("not JSON ({e}): {}", text(&out.stdout)));
    assert_eq!(j["bench"], "goodput");
    let p = &j["policies"][0];
    assert_eq!(p["policy"], "deadline", "{j}");
    let submitted = p["submitted"].as_u64().unwrap();
    let outcomes: u64 = (p["outcomes"].as_object().unwrap().values())
        .map(|v| v.as_u64().unwrap())
        .sum();
    assert!(submitted > 0, "{p}");
    assert_eq!(
        outcomes + p["no_outcome"].as_u64().unwrap(),
        submitted,
        "{p}"
    );
    assert_eq!(p["started_after_deadline"], 0, "{p}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `LASTCALL_LOG=trace` turns on lapin's frame log, which would print the AMQP login
/// (user and password as bytes): capped at debug for that target, as in `lastcall`.
#[test]
fn the_amqp_password_stays_out_of_trace_logs() {
    let dir = temp_dir("trace");
    let password = "pw-SECRET-5e1d9c";
    let url = format!("amqp://guest:{password}@127.0.0.1:5672/%2f");
    let out = bench(
        &dir,
        &["ack-modes", "--smoke", "--json"],
        &[("LASTCALL_AMQP_URL", &url), ("LASTCALL_LOG", "trace")],
    );
    assert!(!out.status.success(), "the login is refused");
    let all = format!("{}{}", text(&out.stdout), text(&out.stderr));
    assert!(all.contains("guest:***@"), "{all}");
    let as_bytes = format!("{:?}", password.as_bytes());
    for needle in [password, "SECRET", &as_bytes[1..as_bytes.len() - 1]] {
        assert!(!all.contains(needle), "{needle} in the output: {all}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
