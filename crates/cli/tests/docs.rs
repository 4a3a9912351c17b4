//! The documentation cannot drift from the code: every relative link in the repository's
//! Markdown resolves (the file, and the heading an `#anchor` names), and the two generated
//! references — `docs/cli.md` (every command's `--help`) and `docs/http-endpoints.md` (the
//! OpenAPI document's operations) — are what the code generates today.
//!
//! After changing a flag, its help or an endpoint: `LASTCALL_BLESS_DOCS=1 cargo nextest run
//! --workspace --features lastcall/otlp,lastcall/test-hooks -E 'test(/^docs::/)'` rewrites
//! the two files.

use std::collections::{BTreeSet, HashMap};
use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

/// Every Markdown file of the repository outside build output and vendored trees.
fn markdown_files() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        for e in std::fs::read_dir(dir).unwrap().flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().into_owned();
            if p.is_dir() {
                if !(name.starts_with('.') || name == "target" || name == "node_modules") {
                    walk(&p, out);
                }
            } else if name.ends_with(".md") {
                out.push(p);
            }
        }
    }
    let mut out = Vec::new();
    walk(&repo(), &mut out);
    out.sort();
    out
}

/// GitHub's anchor of a heading: lowercase, spaces to `-`, punctuation dropped.
fn slug(heading: &str) -> String {
    heading
        .trim()
        .to_lowercase()
        .chars()
        .filter_map(|c| match c {
            ' ' => Some('-'),
            c if c.is_alphanumeric() || c == '-' || c == '_' => Some(c),
            _ => None,
        })
        .collect()
}

/// The lines of `text` outside fenced code blocks.
fn prose(text: &str) -> impl Iterator<Item = &str> {
    let mut fenced = false;
    text.lines().filter(move |l| {
        if l.trim_start().starts_with("```") {
            fenced = !fenced;
            return false;
        }
        !fenced
    })
}

/// The anchors of a Markdown file's headings (duplicates get `-1`, `-2`, … as on GitHub).
fn anchors(text: &str) -> BTreeSet<String> {
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut out = BTreeSet::new();
    for l in prose(text) {
        let hashes = l.chars().take_while(|&c| c == '#').count();
        if (1..=6).contains(&hashes) && l[hashes..].starts_with(' ') {
            let s = slug(&l[hashes..]);
            let n = seen.entry(s.clone()).or_insert(0);
            out.insert(if *n == 0 {
                s.clone()
            } else {
                format!("{s}-{n}")
            });
            *n += 1;
        }
    }
    out
}

/// The targets of the inline links `[text](target)` and images of a line (code spans
/// excluded).
fn link_targets(line: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_code = false;
    let b = line.as_bytes();
    let mut i = 0;
    while i < b.len() {
        match b[i] {
            b'`' => in_code = !in_code,
            b']' if !in_code && b.get(i + 1) == Some(&b'(') => {
                let rest = &line[i + 2..];
                if let Some(end) = rest.find(')') {
                    let t = rest[..end].split_whitespace().next().unwrap_or("");
                    out.push(t.to_owned());
                }
            }
            _ => {}
        }
        i += 1;
    }
    out
}

#[test]
fn every_relative_link_resolves() {
    let files = markdown_files();
    assert!(files.len() > 10, "found only {files:?}");
    let mut broken = Vec::new();
    for f in &files {
        let text = std::fs::read_to_string(f).unwrap();
        for line in prose(&text) {
            for t in link_targets(line) {
                if t.is_empty() || t.contains("://") || t.starts_with("mailto:") {
                    continue;
                }
                let (path, anchor) = match t.split_once('#') {
                    Some((p, a)) => (p, Some(a)),
                    None => (t.as_str(), None),
                };
                let target = if path.is_empty() {
                    f.clone()
                } else {
                    f.parent().unwrap().join(path)
                };
                let shown = f.strip_prefix(repo()).unwrap_or(f).display().to_string();
                if !target.exists() {
                    broken.push(format!("{shown}: {t} (no such file)"));
                    continue;
                }
                if let Some(a) = anchor
                    && target.extension().is_some_and(|e| e == "md")
                    && !anchors(&std::fs::read_to_string(&target).unwrap()).contains(a)
                {
                    broken.push(format!("{shown}: {t} (no heading with that anchor)"));
                }
            }
        }
    }
    assert!(
        broken.is_empty(),
        "broken relative links:\n{}",
        broken.join("\n")
    );
}

/// `lastcall ARGS… --help`, in an empty directory (no `lastcall.toml`) with no
/// `LASTCALL_*` variables, so its defaults are the built-in ones.
fn help(args: &[&str]) -> String {
    let dir = std::env::temp_dir();
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_lastcall"));
    cmd.args(args).arg("--help").current_dir(&dir);
    for (k, _) in std::env::vars() {
        if k.starts_with("LASTCALL_") {
            cmd.env_remove(&k);
        }
    }
    let out = cmd.env_remove("COLUMNS").output().unwrap();
    assert!(out.status.success(), "{args:?} --help: {out:?}");
    String::from_utf8(out.stdout).unwrap()
}

/// The subcommands a help text lists (without `help`).
fn subcommands(help: &str) -> Vec<String> {
    let Some(start) = help.find("\nCommands:\n") else {
        return Vec::new();
    };
    help[start + "\nCommands:\n".len()..]
        .lines()
        .take_while(|l| !l.trim().is_empty())
        .filter(|l| l.starts_with("  ") && !l.starts_with("   "))
        .filter_map(|l| l.split_whitespace().next())
        .filter(|c| *c != "help")
        .map(String::from)
        .collect()
}

fn cli_reference() -> String {
    let mut md = String::from(
        "# CLI reference\n\n\
         Generated from `lastcall … --help` by `crates/cli/tests/docs.rs` (a test fails when\n\
         this file and the code disagree; `LASTCALL_BLESS_DOCS=1` rewrites it). Settings come\n\
         from flags, then environment variables, then `lastcall.toml`, then the defaults shown\n\
         ([configuration.md](configuration.md)). `lastcall bench` runs the benchmarks' own\n\
         binary: `lastcall bench --help`.\n",
    );
    let mut queue: Vec<Vec<String>> = vec![vec![]];
    while let Some(path) = queue.pop() {
        let args: Vec<&str> = path.iter().map(String::as_str).collect();
        let text = help(&args);
        let title = std::iter::once("lastcall")
            .chain(args.iter().copied())
            .collect::<Vec<_>>()
            .join(" ");
        md.push_str(&format!(
            "\n## {title}\n\n```text\n{}\n```\n",
            text.trim_end()
        ));
        let mut subs = subcommands(&text);
        subs.retain(|s| !(path.is_empty() && s == "bench"));
        for s in subs.into_iter().rev() {
            let mut p = path.clone();
            p.push(s);
            queue.push(p);
        }
    }
    md
}

fn http_endpoints() -> String {
    // `serve`'s defaults: a 24 h horizon, 60 s long-polls, 1 MiB bodies.
    let text = lastcall_http::openapi::document(
        lastcall_core::EnvelopeLimits::default().horizon_ms,
        60_000,
        1_048_576,
    )
    .unwrap();
    let doc: serde_json::Value = serde_json::from_str(&text).unwrap();
    let mut md = String::from(
        "# HTTP endpoints\n\n\
         Generated from the OpenAPI document (`GET /openapi.json` on `serve`) by\n\
         `crates/cli/tests/docs.rs`; `LASTCALL_BLESS_DOCS=1` rewrites it. The behaviour behind\n\
         each is in [http-api.md](http-api.md).\n\n\
         | method | path | what it does | answers |\n|---|---|---|---|\n",
    );
    let paths = doc["paths"].as_object().expect("paths");
    for (path, ops) in paths {
        for (method, op) in ops.as_object().unwrap() {
            if !matches!(method.as_str(), "get" | "post" | "put" | "delete" | "patch") {
                continue;
            }
            let summary = op["summary"].as_str().unwrap_or("").replace('|', "\\|");
            let codes: Vec<&str> = op["responses"]
                .as_object()
                .map(|r| r.keys().map(String::as_str).collect())
                .unwrap_or_default();
            md.push_str(&format!(
                "| {} | `{path}` | {summary} | {} |\n",
                method.to_uppercase(),
                codes.join(", ")
            ));
        }
    }
    md
}

/// Compare a generated file with the committed one; rewrite it under `LASTCALL_BLESS_DOCS`.
fn check_generated(rel: &str, generated: &str) {
    let path = repo().join(rel);
    if std::env::var_os("LASTCALL_BLESS_DOCS").is_some() {
        std::fs::write(&path, generated).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    if committed != generated {
        let new = path.with_extension("md.new");
        std::fs::write(&new, generated).unwrap();
        panic!(
            "{rel} is not what the code generates (the new text is in {}): run \
             `LASTCALL_BLESS_DOCS=1 cargo nextest run --workspace --features \
             lastcall/otlp,lastcall/test-hooks -E 'test(/^docs::/)'` and commit it",
            new.display()
        );
    }
}

#[test]
fn the_cli_reference_is_what_the_cli_says() {
    check_generated("docs/cli.md", &cli_reference());
}

#[test]
fn the_http_endpoint_list_is_what_the_openapi_document_says() {
    check_generated("docs/http-endpoints.md", &http_endpoints());
}

#[test]
fn the_readme_stays_short() {
    let n = std::fs::read_to_string(repo().join("README.md"))
        .unwrap()
        .lines()
        .count();
    assert!(
        n <= 300,
        "README.md has {n} lines; the reference belongs in docs/"
    );
}
