//! `lastcall bench …`: a thin alias of the `lastcall-bench` binary.
//!
//! The benchmarks live in their own crate and binary (`crates/bench`); `lastcall` does not
//! link them. This command finds `lastcall-bench` next to its own executable and runs it
//! with everything after `bench`, so `lastcall bench goodput --smoke` is `lastcall-bench
//! goodput --smoke` with this command's settings:
//!
//! - the broker URL, the prefix and the config file that `lastcall` resolved from its own
//!   flags or environment go to the child in its environment (`LASTCALL_AMQP_URL`,
//!   `LASTCALL_PREFIX`, `LASTCALL_CONFIG`), never on its command line, where `ps` would
//!   show a password. Values from the config file or the defaults are left to the child,
//!   which reads the same file the same way (flag > environment > `lastcall.toml` >
//!   default), so that a flag after `bench` still wins over them;
//! - `-v` and `--log-format json` given before `bench` go along as flags;
//! - on Unix the process becomes `lastcall-bench` (`exec`): its exit code, signals
//!   (Ctrl-C) and output are the command's own, with no second process to orphan. It
//!   runs under the name `lastcall bench` (`argv[0]`), which its help and errors show.

use crate::cli::{BenchArgs, Global};
use anyhow::{Context, Result, bail};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

/// The benchmark binary's file name.
pub const BENCH_BIN: &str = "lastcall-bench";

/// Run `lastcall-bench` with `a`'s arguments and the settings `lastcall` got from `g`.
/// Returns only if it cannot be started (or, off Unix, with its exit code).
pub fn run(g: &Global, a: BenchArgs) -> Result<ExitCode> {
    let exe = std::env::current_exe().context("cannot find the path of this executable")?;
    let bench = beside(&exe);
    if !bench.is_file() {
        bail!(
            "`lastcall bench` runs {BENCH_BIN}, which is not next to this lastcall ({}). Build \
             it in the same profile as lastcall: `cargo build -p {BENCH_BIN}` (add --release \
             for a release lastcall), or install both with scripts/install.sh",
            bench.display()
        );
    }
    let mut c = std::process::Command::new(&bench);
    // Set from this command's flags or environment: the child's own flags (after `bench`)
    // still win, the config file and the defaults still lose.
    if let Some(url) = &g.amqp_url {
        c.env("LASTCALL_AMQP_URL", url);
    }
    if let Some(prefix) = &g.prefix {
        c.env("LASTCALL_PREFIX", prefix);
    }
    if let Some(config) = &g.config {
        c.env("LASTCALL_CONFIG", config);
    }
    if g.verbose {
        c.arg("--verbose");
    }
    if g.log_format != "text" {
        c.args(["--log-format", &g.log_format]);
    }
    c.args(&a.args);
    exec(c, &bench)
}

/// `lastcall-bench` in the directory of `exe`.
fn beside(exe: &Path) -> PathBuf {
    exe.with_file_name(format!("{BENCH_BIN}{}", std::env::consts::EXE_SUFFIX))
}

#[cfg(unix)]
fn exec(mut c: std::process::Command, bench: &Path) -> Result<ExitCode> {
    use std::os::unix::process::CommandExt;
    // clap takes the program's name from argv[0]: usage lines read `lastcall bench goodput`.
    let e = c.arg0("lastcall bench").exec();
    Err(e).with_context(|| format!("cannot run {}", bench.display()))
}

#[cfg(not(unix))]
fn exec(mut c: std::process::Command, bench: &Path) -> Result<ExitCode> {
    let status = c
        .status()
        .with_context(|| format!("cannot run {}", bench.display()))?;
    Ok(match status.code() {
        Some(0) => ExitCode::SUCCESS,
        Some(code) => ExitCode::from(u8::try_from(code).unwrap_or(1)),
        None => ExitCode::FAILURE,
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_bench_binary_is_looked_for_beside_this_one() {
        let exe = std::path::Path::new("/opt/lastcall/bin/lastcall");
        assert_eq!(
            super::beside(exe),
            std::path::Path::new(&format!(
                "/opt/lastcall/bin/lastcall-bench{}",
                std::env::consts::EXE_SUFFIX
            ))
        );
    }
}
