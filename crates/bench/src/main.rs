//! `lastcall-bench`: lastcall's benchmarks, measured against the real broker and ledgers.
//! `lastcall bench …` runs this binary; the library (`lib.rs`) holds the commands.

use clap::{CommandFactory, FromArgMatches, Parser};
use lastcall_bench::settings::Global;
use std::process::ExitCode;
use std::sync::Arc;

/// lastcall-bench — measured numbers for lastcall against the real broker and ledgers.
///
/// Each command runs lastcall's own worker, producer and ledger code in this process
/// against a real RabbitMQ (and SQLite or PostgreSQL), on queues of its own under the
/// prefix (`PREFIX-bench-…`), and prints a table at the end: `--json` prints one JSON
/// object instead, `--smoke` shrinks the run to a few seconds (for CI; its numbers mean
/// nothing). Build with `--release` for numbers worth quoting (`cargo build --release -p
/// lastcall-bench`); BENCHMARKS.md has this project's numbers with the exact commands.
///
/// Start with `goodput` (the headline: useful work under overload for lastcall's deadline
/// policy against a naive and a receipt-only check, about 45 s), or `sim` (the same
/// scheduling rules simulated: no broker, seconds). `lastcall bench …` is the same
/// binary, run by `lastcall` with its settings.
///
/// The broker URL and prefix come from the flag, else LASTCALL_AMQP_URL / LASTCALL_PREFIX,
/// else the top-level `amqp_url` / `prefix` of lastcall.toml, else the defaults: as
/// for `lastcall`.
#[derive(Debug, Parser)]
#[command(
    name = "lastcall-bench",
    version,
    propagate_version = true,
    max_term_width = 100
)]
struct Cli {
    #[command(flatten)]
    global: Global,
    #[command(subcommand)]
    command: lastcall_bench::BenchCommand,
}

/// The command line: no `--help` shows an environment variable's value (a set one may
/// hold a secret, such as a password in a URL; an unset one would print as `[env: NAME=]`),
/// and the shared options go under their own heading, as in `lastcall`.
fn command() -> clap::Command {
    fn hide_env_values(c: clap::Command) -> clap::Command {
        c.mut_args(|a| a.hide_env_values(true))
            .mut_subcommands(hide_env_values)
    }
    hide_env_values(Cli::command().mut_args(|a| {
        if a.is_global_set() {
            a.help_heading("Global options")
        } else {
            a
        }
    }))
}

fn main() -> ExitCode {
    let mut command = command();
    let matches = command.clone().get_matches();
    let cli = match Cli::from_arg_matches(&matches) {
        Ok(cli) => cli,
        Err(e) => e.format(&mut command).exit(),
    };
    lastcall_bench::settings::init_tracing(&cli.global);
    let settings = match cli.global.settings() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            return ExitCode::FAILURE;
        }
    };
    let env = lastcall_bench::Env {
        amqp_url: settings.amqp_url,
        prefix: settings.prefix,
        clock: Arc::new(lastcall_worker::SystemClock::default()),
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    match rt.block_on(lastcall_bench::run(&env, cli.command)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, each cause said once (as `lastcall` prints them:
/// many errors already carry their cause's text, which anyhow's `{:#}` would repeat).
fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if text.contains(&said) {
            continue;
        }
        if !text.is_empty() {
            text.push_str(": ");
        }
        text.push_str(&said);
    }
    text
}
