//! `lastcall.toml` as a user writes it: per-command sections, their precedence against
//! flags and environment variables, `config show`, and errors for unknown keys.

use crate::common;

use common::*;
use std::process::{Command, Output};

fn text(b: &[u8]) -> String {
    String::from_utf8_lossy(b).into_owned()
}

/// The line of `config show`'s table for `setting`, split into its value and source.
fn row(out: &Output, setting: &str) -> (String, String) {
    let stdout = text(&out.stdout);
    let line = stdout
        .lines()
        .find(|l| l.split_whitespace().next() == Some(setting))
        .unwrap_or_else(|| panic!("no row {setting} in:\n{stdout}"));
    let cells: Vec<&str> = line.split("  ").filter(|c| !c.trim().is_empty()).collect();
    assert_eq!(cells.len(), 3, "setting, value, source: {line:?}");
    (cells[1].trim().to_owned(), cells[2].trim().to_owned())
}

/// The binary in `dir`, with no lastcall variable of the test's own environment.
fn bare(dir: &std::path::Path) -> Command {
    let mut c = Command::new(env!("CARGO_BIN_EXE_lastcall"));
    c.current_dir(dir);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("LASTCALL_") {
            c.env_remove(k);
        }
    }
    c
}

fn fresh_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!(
        "lastcall-config-{name}-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap()
            .as_nanos()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn config_show_names_each_source_and_masks_secrets() {
    let dir = fresh_dir("show");
    std::fs::write(
        dir.join("lastcall.toml"),
        r#"
amqp_url = "amqp://app:file-secret@rabbit.example:5672/%2f"
prefix = "from-file"

[worker]
slots = 7
max_starts = 5
management_url = "http://file.example:15672"
backend = "sim"
"#,
    )
    .unwrap();
    let out = bare(&dir)
        .args(["config", "show", "worker", "--max-starts", "9"])
        .env("LASTCALL_MANAGEMENT_URL", "http://env.example:15672")
        .env(
            "LASTCALL_SIGNING_KEY",
            "env-signing-secret-0123456789abcdef",
        )
        .output_bounded()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let stdout = text(&out.stdout);
    assert!(stdout.starts_with("config file: lastcall.toml"), "{stdout}");
    // file > default; flag > file; env > file; default where nothing says otherwise.
    assert_eq!(row(&out, "worker.slots"), ("7".into(), "file".into()));
    assert_eq!(row(&out, "worker.max_starts"), ("9".into(), "flag".into()));
    assert_eq!(
        row(&out, "worker.management_url"),
        (
            "http://env.example:15672".into(),
            "env LASTCALL_MANAGEMENT_URL".into()
        )
    );
    assert_eq!(
        row(&out, "worker.max_attempts"),
        ("3".into(), "default".into())
    );
    assert_eq!(row(&out, "prefix"), ("from-file".into(), "file".into()));
    assert_eq!(
        row(&out, "store_url"),
        ("sqlite://lastcall.db".into(), "default".into())
    );
    // Secrets: the URL's password is masked, a key from the environment is never shown.
    assert_eq!(
        row(&out, "amqp_url"),
        (
            "amqp://app:***@rabbit.example:5672/%2f".into(),
            "file".into()
        )
    );
    assert!(!stdout.contains("file-secret"), "{stdout}");
    assert!(!stdout.contains("env-signing-secret"), "{stdout}");
    assert!(stdout.contains("LASTCALL_SIGNING_KEY: set"), "{stdout}");

    // A flag before `config show` and a variable for the connection settings.
    let out = bare(&dir)
        .args(["--amqp-url", "amqp://u:flag-secret@h/%2f", "config", "show"])
        .env("LASTCALL_PREFIX", "from-env")
        .output_bounded()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    assert_eq!(
        row(&out, "amqp_url"),
        ("amqp://u:***@h/%2f".into(), "flag".into())
    );
    assert_eq!(
        row(&out, "prefix"),
        ("from-env".into(), "env LASTCALL_PREFIX".into())
    );
    assert!(
        !text(&out.stdout).contains("worker."),
        "no command, no flags"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_unknown_key_is_an_error_naming_key_section_and_file() {
    let dir = fresh_dir("unknown");
    std::fs::write(
        dir.join("other.toml"),
        "[serve]\nadress = \"127.0.0.1:1\"\n",
    )
    .unwrap();
    let out = bare(&dir)
        .args(["--config", "other.toml", "config", "show"])
        .output_bounded()
        .unwrap();
    assert!(!out.status.success());
    let stderr = text(&out.stderr);
    assert!(
        stderr.contains("unknown key `adress` in section [serve] of other.toml"),
        "{stderr}"
    );
    // The same file through the variable, for a command that never reads [serve]: still
    // refused, before anything runs.
    let out = bare(&dir)
        .args(["jobs", "list"])
        .env("LASTCALL_CONFIG", "other.toml")
        .output_bounded()
        .unwrap();
    assert!(!out.status.success());
    assert!(
        text(&out.stderr).contains("`adress`"),
        "{}",
        text(&out.stderr)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_file_value_takes_effect_and_a_flag_overrides_it() {
    let env = Env::sqlite("cfgfile").await;
    std::fs::write(
        env.dir.join("lastcall.toml"),
        "[submit]\nkind = \"incident.summary\"\ndeadline_ms = 60000\nno_shed = true\n",
    )
    .unwrap();
    // No --kind and no --deadline-ms on the line: the file's serve.
    let out = env
        .command()
        .current_dir(&env.dir)
        .args(["submit", "--job-id", "cfg-1", "--prompt", "from the file"])
        .output_bounded()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let job = env.ledger.get("cfg-1").await.unwrap().expect("recorded");
    assert_eq!(job.kind, "incident.summary");
    let budget = job.expires_at_ms.unwrap() - job.created_at_ms.unwrap();
    assert_eq!(budget, 60_000, "the file's deadline_ms");
    // The flag wins over the file.
    let out = env
        .command()
        .current_dir(&env.dir)
        .args([
            "submit",
            "--job-id",
            "cfg-2",
            "--prompt",
            "from the flag",
            "--kind",
            "code.review",
            "--deadline-ms",
            "30000",
        ])
        .output_bounded()
        .unwrap();
    assert!(out.status.success(), "{}", text(&out.stderr));
    let job = env.ledger.get("cfg-2").await.unwrap().expect("recorded");
    assert_eq!(job.kind, "code.review");
    assert_eq!(
        job.expires_at_ms.unwrap() - job.created_at_ms.unwrap(),
        30_000
    );
    env.cleanup().await;
}
