//! Issue #14 item 10, "secrets stay out of output": every command runs with an HTTP token,
//! OpenAI API keys, signing keys and the management password set (in the environment, and
//! through the file flags where they exist), at `-v` in text and JSON logs, and none of
//! them may appear in stdout, stderr, an HTTP body (metrics included) or anywhere in the
//! ledger (every column of every row of every table, and the raw database files).
//!
//! The secrets are distinctive (`…-SECRET-<hex>`) and use only `[A-Za-z0-9-]`, so that JSON
//! or URL escaping cannot hide a copy. Each is searched for in several spellings: as is,
//! its random tail, hex, base64, and Rust's `Debug` of its bytes (`[115, 107, …]`); any
//! `SECRET-` at all counts as a leak too. AMQP passwords: against the real broker the URL
//! has guest's password, too common to search for, so output must never contain
//! `:guest@` (the URL must appear redacted, `guest:***@`); where the login is refused or
//! the broker is down, the URL carries a distinctive password instead.
//!
//! The secrets are also checked to have been *used* (signed jobs complete at workers that
//! require signatures, the token opens the API, the fake OpenAI server sees each key, the
//! refused broker URL is shown masked), so that a test in which no secret was loaded cannot
//! pass by saying nothing. Only the management password's use is not observable here.

use crate::common;

use common::*;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Output, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const TOKEN: &str = "tok-SECRET-7f3a9c1e5b2d4a6f";
const TOKEN_IN_FILE: &str = "tok-SECRET-file-0d8e2b7a4c6f1e93";
const API_KEY: &str = "sk-SECRET-4e9b1c7a2f5d8e03";
/// In the variable named by `--api-key-env`.
const API_KEY_OTHER_ENV: &str = "LASTCALL_SECRETS_TEST_API_KEY";
const API_KEY_OTHER: &str = "sk-SECRET-other-6a2d9f4b1e7c5a08";
const API_KEY_IN_FILE: &str = "sk-SECRET-file-3c8e1a6f9b2d7e41";
const SIGNING_KEY: &str = "sig-SECRET-5b8d2e7f1a4c9e6b3d0f8a2c5e7b1d4f";
const SIGNING_KEY_IN_FILE: &str = "sig-SECRET-file-8c1f4a7d2e9b6c3f0a5d8e1b4c7f2a9d";
const MANAGEMENT_PASSWORD: &str = "mgmt-SECRET-9e1c4a7f2b5d6c80";
/// Used only where no login succeeds (refused, or no broker), and in `--help` runs.
const AMQP_PASSWORD: &str = "amqp-SECRET-2f7b4d9e1a6c3b58";
/// Store-URL password (PostgreSQL): `--help` runs here, the rest in its own test below.
const STORE_PASSWORD: &str = "pg-SECRET-1d6a9f3c7e2b4d05";
/// The user name the tests send with the token as HTTP Basic credentials.
const BASIC_USER: &str = "lastcall";

const ALL_SECRETS: &[(&str, &str)] = &[
    ("http token", TOKEN),
    ("http token (--token-file)", TOKEN_IN_FILE),
    ("api key (LASTCALL_API_KEY)", API_KEY),
    ("api key (--api-key-env)", API_KEY_OTHER),
    ("api key (--api-key-file)", API_KEY_IN_FILE),
    ("signing key", SIGNING_KEY),
    ("signing key (--signing-key-file)", SIGNING_KEY_IN_FILE),
    ("management password", MANAGEMENT_PASSWORD),
    ("amqp password", AMQP_PASSWORD),
    ("store url password", STORE_PASSWORD),
];

// ---------------------------------------------------------------------------------------
// The scanner.

fn hex(s: &str) -> String {
    s.bytes().map(|b| format!("{b:02x}")).collect()
}

fn base64(s: &str) -> String {
    const A: &[u8] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let b = s.as_bytes();
    let mut out = String::new();
    for chunk in b.chunks(3) {
        let n = chunk
            .iter()
            .enumerate()
            .fold(0u32, |n, (i, x)| n | u32::from(*x) << (16 - 8 * i));
        for i in 0..4 {
            if i <= chunk.len() {
                out.push(A[(n >> (18 - 6 * i) & 63) as usize] as char);
            } else {
                out.push('=');
            }
        }
    }
    out
}

/// The bytes as `Debug` prints a `&[u8]`, without the brackets: `115, 107, 45, …`.
fn debug_bytes(s: &str) -> String {
    let d = format!("{:?}", s.as_bytes());
    d[1..d.len() - 1].to_owned()
}

/// `(what, needle)`: every spelling of every secret that must never appear.
fn needles() -> Vec<(String, String)> {
    let mut n = vec![("any secret".to_owned(), "SECRET-".to_owned())];
    for (what, s) in ALL_SECRETS {
        let tail = &s[s.find("SECRET-").unwrap() + "SECRET-".len()..];
        n.push((what.to_string(), s.to_string()));
        n.push((format!("{what}, random tail"), tail.to_owned()));
        n.push((format!("{what}, hex"), hex(s)));
        n.push((format!("{what}, base64"), base64(s)));
        n.push((format!("{what}, Debug bytes"), debug_bytes(s)));
    }
    for t in [TOKEN, TOKEN_IN_FILE] {
        n.push((
            "http token as Basic credentials".into(),
            base64(&format!("{BASIC_USER}:{t}")),
        ));
    }
    n
}

/// guest's password in a URL: output about the real broker must show `guest:***@`.
fn guest_needles() -> Vec<(String, String)> {
    vec![
        (
            "amqp url with guest's password".into(),
            "guest:guest@".into(),
        ),
        ("amqp password guest in a url".into(), ":guest@".into()),
    ]
}

/// Every needle found in `text`, with its context.
fn find_leaks(label: &str, text: &str, needles: &[(String, String)]) -> Vec<String> {
    let mut hits = Vec::new();
    for (what, needle) in needles {
        if let Some(at) = text.find(needle.as_str()) {
            let mut from = at.saturating_sub(80);
            while !text.is_char_boundary(from) {
                from -= 1;
            }
            let mut to = (at + needle.len() + 80).min(text.len());
            while !text.is_char_boundary(to) {
                to += 1;
            }
            hits.push(format!(
                "[{label}] {what} ({needle:?}): …{}…",
                &text[from..to]
            ));
        }
    }
    hits
}

/// Everything a run showed, and where it came from.
#[derive(Default)]
struct Seen {
    texts: Vec<(String, String, bool)>,
}

impl Seen {
    /// Text from talking to the real broker: also checked for guest's password.
    fn add(&mut self, label: impl Into<String>, text: impl Into<String>) {
        self.texts.push((label.into(), text.into(), true));
    }

    /// Text that may mention the documented default URL (help output).
    fn add_help(&mut self, label: impl Into<String>, text: impl Into<String>) {
        self.texts.push((label.into(), text.into(), false));
    }

    fn add_output(&mut self, label: &str, out: &Output) {
        self.add(
            format!("{label} stdout"),
            String::from_utf8_lossy(&out.stdout),
        );
        self.add(
            format!("{label} stderr"),
            String::from_utf8_lossy(&out.stderr),
        );
    }

    fn leaks(&self) -> Vec<String> {
        let (base, guest) = (needles(), guest_needles());
        let mut hits = Vec::new();
        for (label, text, check_guest) in &self.texts {
            hits.extend(find_leaks(label, text, &base));
            if *check_guest {
                hits.extend(find_leaks(label, text, &guest));
            }
        }
        hits
    }

    fn assert_clean(&self) {
        let hits = self.leaks();
        let bytes: usize = self.texts.iter().map(|(_, t, _)| t.len()).sum();
        assert!(
            hits.is_empty(),
            "{} secret leak(s) in {} captured texts ({bytes} bytes):\n{}",
            hits.len(),
            self.texts.len(),
            hits.join("\n")
        );
        eprintln!(
            "secrets: {} texts, {bytes} bytes scanned, no secret found",
            self.texts.len()
        );
    }

    fn text_of(&self, label_prefix: &str) -> String {
        self.texts
            .iter()
            .filter(|(l, _, _)| l.starts_with(label_prefix))
            .map(|(_, t, _)| t.as_str())
            .collect::<Vec<_>>()
            .join("\n")
    }
}

/// The scanner itself: every spelling is found, clean text passes. Needs no services.
#[test]
fn the_scanner_finds_every_spelling_of_a_secret() {
    let mut seen = Seen::default();
    seen.add(
        "clean",
        "job sec-1 completed; broker amqp://guest:***@127.0.0.1:5672/%2f",
    );
    seen.add_help("help", "[default: amqp://guest:guest@127.0.0.1:5672/%2f]");
    assert!(seen.leaks().is_empty(), "{:?}", seen.leaks());
    let spellings = [
        format!("Authorization: Bearer {TOKEN}"),
        format!("key={}", &API_KEY["sk-SECRET-".len()..]),
        format!("key {}", hex(SIGNING_KEY_IN_FILE)),
        format!("Basic {}", base64(&format!("{BASIC_USER}:{TOKEN_IN_FILE}"))),
        format!("x {}", base64(MANAGEMENT_PASSWORD)),
        format!("response: LongString({:?})", AMQP_PASSWORD.as_bytes()),
        "partly masked sk-SECRET-****".to_owned(),
        "amqp://guest:guest@127.0.0.1:5672/%2f".to_owned(),
    ];
    for s in spellings {
        let mut seen = Seen::default();
        seen.add("leaky", s.clone());
        assert!(!seen.leaks().is_empty(), "not caught: {s}");
    }
    assert_eq!(base64("lastcall:s3cret"), "bGFzdGNhbGw6czNjcmV0");
    assert_eq!(base64("ab"), "YWI=");
    assert_eq!(base64("a"), "YQ==");
}

// ---------------------------------------------------------------------------------------
// Running the binary.

#[derive(Clone, Copy, Debug)]
enum Log {
    /// `-v`: info level, text.
    Text,
    /// `-v --log-format json`.
    Json,
    /// `LASTCALL_LOG=debug --log-format json`: the dependencies' debug logs too.
    Debug,
}

impl Log {
    fn apply(self, c: &mut Command) {
        c.env_remove("LASTCALL_LOG");
        match self {
            Log::Text => {
                c.arg("-v");
            }
            Log::Json => {
                c.args(["-v", "--log-format", "json"]);
            }
            Log::Debug => {
                c.args(["--log-format", "json"])
                    .env("LASTCALL_LOG", "debug");
            }
        }
    }
}

/// Every secret in the environment of every run, and nothing from the caller's.
fn with_secrets(c: &mut Command, dir: &Path) {
    for var in [
        "LASTCALL_AMQP_URL",
        "LASTCALL_STORE_URL",
        "LASTCALL_PREFIX",
        "LASTCALL_CONFIG",
        "LASTCALL_OTLP_ENDPOINT",
        "LASTCALL_BENCH_PG_URL",
        "LASTCALL_MANAGEMENT_URL",
        "LASTCALL_OPENAI_BASE_URL",
        "LASTCALL_OPENAI_MODEL",
    ] {
        c.env_remove(var);
    }
    c.env("LASTCALL_HTTP_TOKEN", TOKEN)
        .env("LASTCALL_API_KEY", API_KEY)
        .env(API_KEY_OTHER_ENV, API_KEY_OTHER)
        .env("LASTCALL_SIGNING_KEY", SIGNING_KEY)
        .env("LASTCALL_MANAGEMENT_PASSWORD", MANAGEMENT_PASSWORD)
        .env("NO_COLOR", "1")
        .current_dir(dir)
        .stdin(Stdio::null());
}

fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_lastcall"))
}

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A process running in the background, its output going to files.
struct Proc {
    label: String,
    child: Child,
    out: PathBuf,
    err: PathBuf,
}

struct Harness<'a> {
    env: &'a Env,
    seen: Seen,
    n: usize,
}

impl<'a> Harness<'a> {
    fn new(env: &'a Env) -> Self {
        Self {
            env,
            seen: Seen::default(),
            n: 0,
        }
    }

    /// `lastcall` on the test's broker, ledger and prefix, with every secret set.
    fn cmd(&self, log: Log, args: &[&str]) -> Command {
        let mut c = self.env.command();
        with_secrets(&mut c, &self.env.dir);
        log.apply(&mut c);
        c.args(args);
        c
    }

    fn run_cmd(&mut self, label: &str, mut c: Command) -> Output {
        let out = output_within(&mut c, label, CHILD_LIMIT);
        self.seen.add_output(label, &out);
        out
    }

    /// Run to the end; panics unless it succeeds.
    fn ok(&mut self, log: Log, args: &[&str]) -> Output {
        let label = format!("{log:?} lastcall {}", args.join(" "));
        let out = self.run_cmd(&label, self.cmd(log, args));
        assert!(
            out.status.success(),
            "{label}: {}\n{}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    fn spawn(&mut self, label: &str, mut c: Command) -> Proc {
        self.n += 1;
        let out = self.env.dir.join(format!("proc-{}.out", self.n));
        let err = self.env.dir.join(format!("proc-{}.err", self.n));
        c.stdout(File::create(&out).unwrap())
            .stderr(File::create(&err).unwrap());
        Proc {
            label: label.to_owned(),
            child: c.spawn().expect("start the lastcall binary"),
            out,
            err,
        }
    }

    fn start(&mut self, log: Log, args: &[&str]) -> Proc {
        let label = format!("{log:?} lastcall {}", args.join(" "));
        let c = self.cmd(log, args);
        self.spawn(&label, c)
    }

    /// SIGTERM, wait for the exit (polled), keep its output; panics unless it exits 0.
    fn stop(&mut self, mut p: Proc) {
        let _ = Command::new("kill")
            .args(["-TERM", &p.child.id().to_string()])
            .status();
        let status = wait_exit(&mut p.child, Duration::from_secs(20));
        let (out, err) = self.collect(&p);
        let status = status.unwrap_or_else(|| {
            let _ = p.child.kill();
            let _ = p.child.wait();
            panic!("{} did not stop on SIGTERM:\n{out}\n{err}", p.label)
        });
        assert!(status.success(), "{}: {status}\n{out}\n{err}", p.label);
    }

    fn collect(&mut self, p: &Proc) -> (String, String) {
        let out = std::fs::read_to_string(&p.out).unwrap_or_default();
        let err = std::fs::read_to_string(&p.err).unwrap_or_default();
        self.seen.add(format!("{} stdout", p.label), out.clone());
        self.seen.add(format!("{} stderr", p.label), err.clone());
        (out, err)
    }

    /// One curl request; the response (status line, headers and body) is kept.
    fn http(&mut self, args: &[&str]) -> (u16, String) {
        let out = Command::new("curl")
            .args([
                "-s",
                "-i",
                "--max-time",
                "10",
                "-o",
                "-",
                "-w",
                "\n%{http_code}",
            ])
            .args(args)
            .output()
            .expect("curl");
        let text = String::from_utf8_lossy(&out.stdout).into_owned();
        let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
        // The request's own credentials are in `args`: only the response is searched.
        let url = args.iter().find(|a| a.starts_with("http")).unwrap_or(&"?");
        self.seen.add(format!("http {url}"), body.to_owned());
        (code.trim().parse().unwrap_or(0), body.to_owned())
    }
}

fn wait_exit(child: &mut Child, timeout: Duration) -> Option<ExitStatus> {
    let until = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return Some(s);
        }
        if Instant::now() > until {
            return None;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn poll_until(what: &str, timeout: Duration, mut done: impl FnMut() -> bool) {
    let until = Instant::now() + timeout;
    while !done() {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn bearer(token: &str) -> String {
    format!("Authorization: Bearer {token}")
}

/// `lastcall --help` and every subcommand's `--help` and `-h`, found from the help itself.
fn help_pages(seen: &mut Seen, dir: &Path) -> usize {
    let mut todo: Vec<Vec<String>> = vec![vec![]];
    let mut pages = 0;
    while let Some(path) = todo.pop() {
        for flag in ["--help", "-h"] {
            let mut c = bin();
            with_secrets(&mut c, dir);
            // Env values clap could print in `[env: NAME=value]`: URLs with passwords.
            c.env(
                "LASTCALL_AMQP_URL",
                format!("amqp://guest:{AMQP_PASSWORD}@127.0.0.1:5672/%2f"),
            )
            .env(
                "LASTCALL_STORE_URL",
                format!("postgres://lastcall:{STORE_PASSWORD}@127.0.0.1:5432/ledger"),
            )
            .env(
                "LASTCALL_BENCH_PG_URL",
                format!("postgres://lastcall:{STORE_PASSWORD}@127.0.0.1:5432/bench"),
            );
            c.args(&path).arg(flag);
            let label = format!("help: lastcall {} {flag}", path.join(" "));
            let out = output_within(&mut c, &label, CHILD_LIMIT);
            assert!(out.status.success(), "{label}: {}", out.status);
            let text = String::from_utf8_lossy(&out.stdout).into_owned();
            assert!(text.contains("Usage:"), "{label}: {text}");
            seen.add_help(&label, text.clone());
            seen.add_help(
                format!("{label} stderr"),
                String::from_utf8_lossy(&out.stderr),
            );
            pages += 1;
            if flag == "--help" {
                for sub in subcommands(&text) {
                    let mut p = path.clone();
                    p.push(sub);
                    todo.push(p);
                }
            }
        }
    }
    let mut c = bin();
    with_secrets(&mut c, dir);
    c.args(["--version"]);
    let out = output_within(&mut c, "lastcall --version", CHILD_LIMIT);
    seen.add_output("lastcall --version", &out);
    let mut c = bin();
    with_secrets(&mut c, dir);
    c.args(["help", "worker"]);
    let out = output_within(&mut c, "lastcall help worker", CHILD_LIMIT);
    seen.add_help("lastcall help worker", String::from_utf8_lossy(&out.stdout));
    seen.add_help(
        "lastcall help worker stderr",
        String::from_utf8_lossy(&out.stderr),
    );
    pages
}

/// The names under `Commands:` in a help page (two-space indent; wrapped lines have more).
fn subcommands(help: &str) -> Vec<String> {
    help.lines()
        .skip_while(|l| !l.starts_with("Commands:"))
        .skip(1)
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|name| *name != "help")
        .map(str::to_owned)
        .collect()
}

// ---------------------------------------------------------------------------------------
// The ledger, read whole.

/// Every column of every row of every table of a SQLite ledger, as text, one row a line.
async fn dump_sqlite(store_url: &str) -> (String, usize) {
    use sqlx::Connection;
    let mut c = sqlx::SqliteConnection::connect(store_url).await.unwrap();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE 'sqlite_%'",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    assert!(tables.iter().any(|t| t == "jobs"), "{tables:?}");
    let mut text = String::new();
    let mut rows = 0;
    for t in &tables {
        let cols: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT name FROM pragma_table_info('{t}')"
        )))
        .fetch_all(&mut c)
        .await
        .unwrap();
        let expr = cols
            .iter()
            .map(|col| format!("'{col}=' || coalesce(CAST(\"{col}\" AS TEXT), 'NULL')"))
            .collect::<Vec<_>>()
            .join(" || ' | ' || ");
        let lines: Vec<String> =
            sqlx::query_scalar(sqlx::AssertSqlSafe(format!("SELECT {expr} FROM \"{t}\"")))
                .fetch_all(&mut c)
                .await
                .unwrap();
        rows += lines.len();
        for l in lines {
            text.push_str(&format!("{t}: {l}\n"));
        }
    }
    c.close().await.unwrap();
    (text, rows)
}

/// Every column of every row of every table of a PostgreSQL ledger, as JSON lines.
async fn dump_postgres(store_url: &str) -> (String, usize) {
    use sqlx::Connection;
    let mut c = sqlx::PgConnection::connect(store_url).await.unwrap();
    let tables: Vec<String> = sqlx::query_scalar(
        "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public'",
    )
    .fetch_all(&mut c)
    .await
    .unwrap();
    let mut text = String::new();
    let mut rows = 0;
    for t in &tables {
        let lines: Vec<String> = sqlx::query_scalar(sqlx::AssertSqlSafe(format!(
            "SELECT row_to_json(t)::text FROM \"{t}\" t"
        )))
        .fetch_all(&mut c)
        .await
        .unwrap();
        rows += lines.len();
        for l in lines {
            text.push_str(&format!("{t}: {l}\n"));
        }
    }
    c.close().await.unwrap();
    (text, rows)
}

/// The raw bytes of a SQLite database and its journal files (freed pages included).
fn raw_sqlite_files(db: &Path) -> Vec<(String, String)> {
    let mut out = Vec::new();
    for suffix in ["", "-wal", "-journal", "-shm"] {
        let p = PathBuf::from(format!("{}{suffix}", db.display()));
        if let Ok(bytes) = std::fs::read(&p) {
            out.push((
                format!("raw file {}", p.display()),
                String::from_utf8_lossy(&bytes).into_owned(),
            ));
        }
    }
    out
}

// ---------------------------------------------------------------------------------------
// A fake OpenAI-compatible server: answers every request with one status and body, and
// keeps the request heads (to check which key was sent).

struct FakeOpenAi {
    port: u16,
    heads: Arc<Mutex<Vec<String>>>,
}

fn fake_openai(status: &'static str, body: &'static str) -> FakeOpenAi {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let heads = Arc::new(Mutex::new(Vec::new()));
    let kept = heads.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut reader = BufReader::new(stream.try_clone().unwrap());
            let mut head = String::new();
            let mut length = 0usize;
            loop {
                let mut line = String::new();
                if reader.read_line(&mut line).unwrap_or(0) == 0 || line == "\r\n" {
                    break;
                }
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                head.push_str(&line);
            }
            let mut body_in = vec![0; length];
            let _ = reader.read_exact(&mut body_in);
            kept.lock().unwrap().push(head);
            let _ = write!(
                stream,
                "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
                body.len()
            );
        }
    });
    FakeOpenAi { port, heads }
}

impl FakeOpenAi {
    fn saw_key(&self, key: &str) -> bool {
        let want = format!("authorization: bearer {}", key.to_ascii_lowercase());
        self.heads
            .lock()
            .unwrap()
            .iter()
            .any(|h| h.to_ascii_lowercase().contains(&want))
    }
}

// ---------------------------------------------------------------------------------------

const RETRY: &str = "1000,5000";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn secrets_stay_out_of_output_metrics_and_the_ledger() {
    let env = Env::sqlite("secrets").await;
    let dir = env.dir.clone();
    let token_file = dir.join("http.token");
    std::fs::write(&token_file, format!("{TOKEN_IN_FILE}\n")).unwrap();
    let key_file = dir.join("signing.key");
    std::fs::write(&key_file, SIGNING_KEY_IN_FILE).unwrap();
    let api_key_file = dir.join("openai.key");
    std::fs::write(&api_key_file, format!("{API_KEY_IN_FILE}\n")).unwrap();
    let (token_file, key_file, api_key_file) = (
        token_file.to_str().unwrap(),
        key_file.to_str().unwrap(),
        api_key_file.to_str().unwrap(),
    );
    let mut h = Harness::new(&env);

    // 1. Help: clap's `[env: NAME=value]` would print a set variable's value.
    let pages = help_pages(&mut h.seen, &dir);
    assert!(pages >= 30, "only {pages} help pages");

    // 2. Broker logins that fail: refused (wrong password) and no broker at all. The URL
    //    with the password is in the flags; the messages must show it redacted.
    let closed = free_port();
    for (what, url) in [
        (
            "refused",
            format!("amqp://guest:{AMQP_PASSWORD}@127.0.0.1:5672/%2f"),
        ),
        (
            "down",
            format!("amqp://guest:{AMQP_PASSWORD}@127.0.0.1:{closed}/%2f"),
        ),
    ] {
        let serve_addr = format!("127.0.0.1:{}", free_port());
        let runs: [&[&str]; 6] = [
            &["topology", "apply", "--retry-delays-ms", RETRY],
            &["topology", "delete", "--yes", "--retry-delays-ms", RETRY],
            &[
                "submit",
                "--kind",
                "incident.summary",
                "--prompt",
                "hi",
                "--deadline-ms",
                "60000",
                "--retry-delays-ms",
                RETRY,
            ],
            &[
                "worker",
                "--backend",
                "sim",
                "--connect-timeout-ms",
                "1000",
                "--retry-delays-ms",
                RETRY,
            ],
            &[
                "dlq",
                "--idle-exit-ms",
                "500",
                "--connect-timeout-ms",
                "1000",
                "--retry-delays-ms",
                RETRY,
            ],
            &[
                "serve",
                "--dlq",
                "--addr",
                &serve_addr,
                "--connect-timeout-ms",
                "1000",
                "--retry-delays-ms",
                RETRY,
            ],
        ];
        for log in [Log::Text, Log::Json, Log::Debug] {
            for args in runs {
                let mut c = env.command_with_amqp(&url);
                with_secrets(&mut c, &dir);
                log.apply(&mut c);
                c.args(args);
                let label = format!("{what} broker: {log:?} lastcall {}", args.join(" "));
                let out = h.run_cmd(&label, c);
                let err = String::from_utf8_lossy(&out.stderr);
                assert!(!out.status.success(), "{label} succeeded: {err}");
                assert!(
                    err.contains("guest:***@"),
                    "{label}: the error names the broker, password masked: {err}"
                );
            }
        }
    }

    // 3. The topology, with the broker policies (management API, credentials from the URL).
    h.ok(
        Log::Text,
        &["topology", "apply", "--retry-delays-ms", RETRY],
    );
    h.ok(
        Log::Json,
        &[
            "topology",
            "apply",
            "--policies",
            "--retry-delays-ms",
            RETRY,
        ],
    );

    // 4. Signed submits: the key from the environment, and from --signing-key-file.
    let submit = |id: &'static str, deadline_ms: &'static str| -> Vec<&'static str> {
        vec![
            "submit",
            "--kind",
            "incident.summary",
            "--prompt",
            "summarize the incident",
            "--deadline-ms",
            deadline_ms,
            "--job-id",
            id,
            "--trace-id",
            "trace-secrets",
            "--retry-delays-ms",
            RETRY,
        ]
    };
    let out = h.ok(Log::Text, &submit("sec-submit-text", "60000"));
    assert!(String::from_utf8_lossy(&out.stdout).contains("sec-submit-text"));
    h.ok(Log::Debug, &submit("sec-submit-debug", "60000"));

    // 5. serve --dlq: the token from the environment (text logs), then from --token-file
    //    (JSON logs); every route, with the right token, a wrong one and none.
    for (log, token, token_args, job) in [
        (Log::Text, TOKEN, &[][..], "sec-http-text"),
        (
            Log::Json,
            TOKEN_IN_FILE,
            &["--token-file", token_file][..],
            "sec-http-json",
        ),
        (Log::Debug, TOKEN, &[][..], "sec-http-debug"),
    ] {
        let port = free_port();
        let addr = format!("127.0.0.1:{port}");
        let base = format!("http://{addr}");
        let mut args = vec![
            "serve",
            "--dlq",
            "--addr",
            &addr,
            "--retry-delays-ms",
            RETRY,
        ];
        args.extend_from_slice(token_args);
        let p = h.start(log, &args);
        poll_until("serve to answer /readyz", Duration::from_secs(30), || {
            Command::new("curl")
                .args(["-sf", "-o", "/dev/null", &format!("{base}/readyz")])
                .status()
                .is_ok_and(|s| s.success())
        });
        let auth = bearer(token);
        let body = format!(
            r#"{{"job_id":"{job}","kind":"incident.summary","deadline_ms":60000,"trace_id":"trace-secrets","payload":{{"prompt":"summarize"}}}}"#
        );
        let (code, resp) = h.http(&[
            "-X",
            "POST",
            &format!("{base}/v1/jobs"),
            "-H",
            &auth,
            "-H",
            "Content-Type: application/json",
            "--data",
            &body,
        ]);
        assert_eq!(code, 202, "{resp}");
        for path in [
            "/metrics",
            "/openapi.json",
            "/v1/jobs",
            &format!("/v1/jobs/{job}"),
            "/v1/dashboard",
            "/",
            "/readyz",
            "/healthz",
        ] {
            let (code, resp) = h.http(&[&format!("{base}{path}"), "-H", &auth]);
            assert!(code == 200 || code == 503, "{path}: {code} {resp}");
        }
        let (code, resp) = h.http(&[
            &format!("{base}/v1/jobs"),
            "-u",
            &format!("{BASIC_USER}:{token}"),
        ]);
        assert_eq!(code, 200, "Basic credentials with the token: {resp}");
        // Wrong and missing credentials: 401, and nothing echoes the right token.
        for wrong in [
            vec!["-H".to_owned(), bearer("tok-wrong-00000000000000000")],
            vec![
                "-u".to_owned(),
                format!("{BASIC_USER}:tok-wrong-0000000000000"),
            ],
            vec![],
        ] {
            for path in ["/metrics", "/v1/jobs", "/"] {
                let url = format!("{base}{path}");
                let mut a: Vec<&str> = vec![&url];
                a.extend(wrong.iter().map(String::as_str));
                let (code, resp) = h.http(&a);
                assert_eq!(code, 401, "{path} {wrong:?}: {resp}");
            }
        }
        h.stop(p);
    }

    // 6. Sim workers: signed jobs only (a missing or wrong signature would end
    //    `rejected`), metrics served while they run. The env key first (text logs) for the
    //    jobs signed with it, then the file key (JSON logs) for a job signed with the file.
    let sim_worker = |metrics: &str, key_args: &[&str]| -> Vec<String> {
        let mut a: Vec<String> = [
            "worker",
            "--backend",
            "sim",
            "--sim-latency-ms",
            "20",
            "--name",
            "secrets-worker",
            "--shutdown-grace-ms",
            "2000",
            "--retry-delays-ms",
            RETRY,
            "--metrics-addr",
            metrics,
        ]
        .map(str::to_owned)
        .to_vec();
        a.extend(key_args.iter().map(|s| s.to_string()));
        a
    };
    let env_key_jobs: Vec<String> = [
        "sec-submit-text",
        "sec-submit-debug",
        "sec-http-text",
        "sec-http-json",
        "sec-http-debug",
    ]
    .map(str::to_owned)
    .to_vec();
    let metrics = format!("127.0.0.1:{}", free_port());
    let args = sim_worker(&metrics, &[]);
    let p = h.start(
        Log::Text,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let recs = env
        .wait_terminal(&env_key_jobs, Duration::from_secs(60))
        .await;
    for r in &recs {
        assert_eq!(r.state, "completed", "signed with the env key: {r:?}");
    }
    let metrics_url = format!("http://{metrics}/metrics");
    poll_until("the worker's /metrics", Duration::from_secs(20), || {
        h.http(&[&metrics_url]).0 == 200
    });
    let (_, m) = h.http(&[&metrics_url]);
    assert!(m.contains("# TYPE"), "{m}");
    h.stop(p);

    let args = {
        let mut a = submit("sec-submit-json", "60000");
        a.extend(["--signing-key-file", key_file]);
        a
    };
    h.ok(Log::Json, &args);
    let metrics = format!("127.0.0.1:{}", free_port());
    let args = sim_worker(&metrics, &["--signing-key-file", key_file]);
    let p = h.start(
        Log::Json,
        &args.iter().map(String::as_str).collect::<Vec<_>>(),
    );
    let r = &env
        .wait_terminal(&["sec-submit-json".into()], Duration::from_secs(60))
        .await[0];
    assert_eq!(r.state, "completed", "signed with the file key: {r:?}");
    let metrics_url = format!("http://{metrics}/metrics");
    poll_until("the worker's /metrics", Duration::from_secs(20), || {
        h.http(&[&metrics_url]).0 == 200
    });
    h.stop(p);

    // 7. The dead-letter processor with each key: a signed job expires in the queue and is
    //    recorded under its own id (a signature check that failed would record a synthetic
    //    id instead).
    for (log, id, key_args) in [
        (Log::Text, "sec-expire-text", &[][..]),
        (
            Log::Json,
            "sec-expire-json",
            &["--signing-key-file", key_file][..],
        ),
    ] {
        // Long enough for `lastcall submit` to publish it on a loaded machine (its
        // deadline counts from the command's start: 400 ms once ran out before the
        // publish), short enough to expire in the queue soon after.
        let mut args = submit(id, "1500");
        args.extend_from_slice(key_args);
        h.ok(log, &args);
        let until = Instant::now() + Duration::from_secs(20);
        while env.ready(&env.topo.names.dead_queue).await < 1 {
            assert!(Instant::now() < until, "{id} did not reach the dead queue");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let mut args = vec!["dlq", "--idle-exit-ms", "1000", "--retry-delays-ms", RETRY];
        args.extend_from_slice(key_args);
        h.ok(log, &args);
        let r = env.ledger.get(id).await.unwrap().expect("recorded by dlq");
        assert_eq!(r.state, "expired_before_receive", "{r:?}");
    }

    // 8. The OpenAI backend with each way of giving the key: a server that is down (the key
    //    from LASTCALL_API_KEY), one that answers 500 (--api-key-env) and one that answers
    //    401 (--api-key-file). The error text recorded must not carry the key.
    let server_500 = fake_openai(
        "500 Internal Server Error",
        r#"{"error":{"message":"upstream exploded","type":"server_error"}}"#,
    );
    let server_401 = fake_openai(
        "401 Unauthorized",
        r#"{"error":{"message":"Incorrect API key provided","type":"invalid_request_error"}}"#,
    );
    let down = free_port();
    for (log, id, port, key_args) in [
        (Log::Text, "sec-openai-down", down, vec![]),
        (
            Log::Json,
            "sec-openai-500",
            server_500.port,
            vec!["--api-key-env", API_KEY_OTHER_ENV],
        ),
        (
            Log::Debug,
            "sec-openai-401",
            server_401.port,
            vec!["--api-key-file", api_key_file],
        ),
    ] {
        h.ok(Log::Text, &submit(id, "60000"));
        let base_url = format!("http://127.0.0.1:{port}/v1");
        let mut args = vec![
            "worker",
            "--backend",
            "openai",
            "--base-url",
            &base_url,
            "--model",
            "secrets-model",
            "--max-attempts",
            "2",
            "--shutdown-grace-ms",
            "2000",
            "--retry-delays-ms",
            RETRY,
        ];
        args.extend(key_args);
        let p = h.start(log, &args);
        let r = &env
            .wait_terminal(&[id.to_owned()], Duration::from_secs(60))
            .await[0];
        h.stop(p);
        assert_eq!(r.state, "failed", "{r:?}");
        assert!(
            !r.error.as_deref().unwrap_or("").is_empty(),
            "the error is recorded: {r:?}"
        );
    }
    assert!(
        server_500.saw_key(API_KEY_OTHER),
        "--api-key-env: the key was sent"
    );
    assert!(
        server_401.saw_key(API_KEY_IN_FILE),
        "--api-key-file: the key was sent"
    );

    // 9. Reading commands, each in every log format, over every job.
    let out = h.ok(Log::Text, &["jobs", "list", "--json"]);
    let list: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let ids: Vec<String> = list
        .as_array()
        .unwrap()
        .iter()
        .map(|r| r["job_id"].as_str().unwrap().to_owned())
        .collect();
    assert!(ids.len() >= 11, "{ids:?}");
    for log in [Log::Text, Log::Json, Log::Debug] {
        h.ok(log, &["jobs", "list"]);
        h.ok(log, &["jobs", "list", "--json"]);
        for id in &ids {
            h.ok(log, &["jobs", "show", id, "--json", "--attempts"]);
            h.ok(log, &["jobs", "show", id, "--attempts"]);
        }
        let missing = h.run_cmd(
            "jobs show missing",
            h.cmd(log, &["jobs", "show", "sec-no-such-job"]),
        );
        assert!(!missing.status.success());
        for format in ["table", "json", "csv"] {
            h.ok(log, &["report", "--format", format]);
        }
        h.ok(log, &["reconcile", "--json", "--allow-unknown"]);
        h.ok(log, &["reconcile"]);
    }

    // 10. The demo (its own queues and ledger) and the ledger benchmark.
    let demo_db = dir.join("demo.db");
    let demo_url = format!("sqlite://{}", demo_db.display());
    let mut c = bin();
    with_secrets(&mut c, &dir);
    Log::Text.apply(&mut c);
    c.args([
        "--amqp-url",
        AMQP,
        "--prefix",
        &env.prefix,
        "demo",
        "--backend",
        "sim",
        "--jobs",
        "3",
        "--early-jobs",
        "1",
        "--worker-delay-ms",
        "0",
        "--sim-latency-ms",
        "50",
        "--demo-store-url",
        &demo_url,
    ]);
    let out = h.run_cmd("demo", c);
    let demo_topo = lastcall_broker::Topology::new(&format!("{}-demo", env.prefix));
    let _ = demo_topo.delete(&env.broker).await;
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let mut c = bin();
    with_secrets(&mut c, &dir);
    Log::Json.apply(&mut c);
    c.args(["bench", "ledger", "--smoke", "--json"]);
    let out = h.run_cmd("bench ledger", c);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    // 11. Take the topology and its policies down again.
    h.ok(
        Log::Text,
        &[
            "topology",
            "delete",
            "--yes",
            "--policies",
            "--retry-delays-ms",
            RETRY,
        ],
    );

    // 12. The ledgers, whole: every column of every row, and the raw database files.
    let (text, rows) = dump_sqlite(&env.store_url).await;
    assert!(rows >= 20, "{rows} rows: {text}");
    // The calls' failures by their class; the server's own text stays out (issue #48).
    for needle in [
        "upstream returned HTTP 500",
        "upstream returned HTTP 401",
        "upstream exploded",
        "bad_signature",
    ] {
        if needle == "bad_signature" {
            assert!(!text.contains(needle), "a signature did not verify: {text}");
        } else if needle == "upstream exploded" {
            assert!(!text.contains(needle), "the server's text recorded: {text}");
        } else {
            assert!(text.contains(needle), "{needle} recorded: {text}");
        }
    }
    h.seen.add("ledger rows", text);
    let (text, rows) = dump_sqlite(&demo_url).await;
    assert!(rows >= 3, "{text}");
    h.seen.add("demo ledger rows", text);
    for db in [dir.join("ledger.db"), demo_db] {
        for (label, text) in raw_sqlite_files(&db) {
            h.seen.add(label, text);
        }
    }

    // The redacted broker URL was shown somewhere: the check above is not vacuous.
    assert!(h.seen.text_of("demo").contains("guest:***@"));
    let seen = std::mem::take(&mut h.seen);
    drop(h);
    env.cleanup().await;
    seen.assert_clean();
}

// ---------------------------------------------------------------------------------------
// Leaks found by this suite and fixed: the store URL password (open_ledger, jobs show, the
// demo), and lapin's trace log of the AMQP login (capped at debug in init_tracing).

/// A store URL with a password (`postgres://user:PASSWORD@host/db`), on a PostgreSQL
/// ledger: the test server trusts local connections, so any password logs in.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn store_url_password_stays_out_of_output() {
    let env = Env::postgres("secrets-pg").await;
    let with_password = |url: &str| {
        let (scheme, rest) = url.split_once("://").unwrap();
        let (user, host) = rest.split_once('@').unwrap();
        assert!(!user.contains(':'), "the test URL has no password: {url}");
        format!("{scheme}://{user}:{STORE_PASSWORD}@{host}")
    };
    let store = with_password(&env.store_url);
    let missing_db = format!("{store}_missing");
    let mut seen = Seen::default();
    let run = |seen: &mut Seen, store: &str, args: &[&str]| -> Output {
        let mut c = bin();
        with_secrets(&mut c, &env.dir);
        Log::Text.apply(&mut c);
        c.args([
            "--amqp-url",
            AMQP,
            "--store-url",
            store,
            "--prefix",
            &env.prefix,
        ]);
        c.args(args);
        let label = format!("lastcall {}", args.join(" "));
        let out = output_within(&mut c, &label, CHILD_LIMIT);
        seen.add_output(&label, &out);
        out
    };
    let submit = [
        "submit",
        "--kind",
        "incident.summary",
        "--prompt",
        "hi",
        "--deadline-ms",
        "60000",
        "--job-id",
        "sec-pg-1",
        "--retry-delays-ms",
        RETRY,
    ];
    assert!(run(&mut seen, &store, &submit).status.success());
    for args in [
        &["jobs", "list"][..],
        &["jobs", "show", "sec-pg-1", "--json", "--attempts"],
        &["jobs", "show", "sec-no-such-job"],
        &["report", "--format", "json"],
        &["reconcile", "--json", "--allow-unknown"],
    ] {
        run(&mut seen, &store, args);
    }
    run(&mut seen, &missing_db, &["jobs", "list"]);
    let mut c = bin();
    with_secrets(&mut c, &env.dir);
    Log::Text.apply(&mut c);
    c.args([
        "--amqp-url",
        AMQP,
        "--prefix",
        &env.prefix,
        "demo",
        "--backend",
        "sim",
        "--jobs",
        "2",
        "--early-jobs",
        "0",
        "--worker-delay-ms",
        "0",
        "--sim-latency-ms",
        "20",
        "--demo-store-url",
        &store,
    ]);
    let out = output_within(&mut c, "demo", CHILD_LIMIT);
    seen.add_output("demo", &out);
    let _ = lastcall_broker::Topology::new(&format!("{}-demo", env.prefix))
        .delete(&env.broker)
        .await;
    let (text, rows) = dump_postgres(&env.store_url).await;
    assert!(rows > 0);
    seen.add("ledger rows", text);
    env.cleanup().await;
    seen.assert_clean();
}

/// `LASTCALL_LOG=trace` turns on lapin's frame log, which prints the AMQP login
/// (`StartOk { response: LongString([0, 103, 117, …]) }`: user and password as bytes).
#[test]
fn amqp_password_stays_out_of_trace_logs() {
    let dir = std::env::temp_dir().join(unique("secrets-trace"));
    std::fs::create_dir_all(&dir).unwrap();
    let mut seen = Seen::default();
    let mut c = bin();
    with_secrets(&mut c, &dir);
    c.env("LASTCALL_LOG", "trace").args([
        "--amqp-url",
        &format!("amqp://guest:{AMQP_PASSWORD}@127.0.0.1:5672/%2f"),
        "--prefix",
        &unique("secrets-trace"),
        "topology",
        "apply",
    ]);
    let out = output_within(&mut c, "LASTCALL_LOG=trace topology apply", CHILD_LIMIT);
    assert!(!out.status.success(), "the login is refused");
    seen.add_output("LASTCALL_LOG=trace topology apply", &out);
    let _ = std::fs::remove_dir_all(&dir);
    seen.assert_clean();
}
