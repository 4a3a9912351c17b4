//! `lastcall`: a deadline-aware dispatcher for AI inference jobs on RabbitMQ.
//! Work whose business deadline has passed is never started.
//!
//! This binary is a thin shell: argument parsing ([`cli`]), configuration ([`config`])
//! and one module per subcommand under [`cmd`]. All decisions live in `lastcall-core`.

mod cli;
mod cmd;
mod config;

/// The plain-text tables every command prints (shared with `lastcall-bench`).
use lastcall_core::table;

use clap::{CommandFactory, FromArgMatches};

fn main() -> std::process::ExitCode {
    let argv: Vec<std::ffi::OsString> = std::env::args_os().collect();
    // lastcall.toml's sections become the defaults of their commands' flags.
    let loaded = match config::load(command(), &argv) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            return std::process::ExitCode::FAILURE;
        }
    };
    let mut command = loaded.command.clone();
    let matches = loaded.parse(&argv).unwrap_or_else(|e| e.exit());
    if let Some(demo) = matches.subcommand_matches("demo")
        && [&matches, demo]
            .iter()
            .any(|m| m.value_source("store_url") == Some(clap::parser::ValueSource::CommandLine))
    {
        command
            .error(
                clap::error::ErrorKind::ArgumentConflict,
                "the demo keeps its own ledger (a fresh ./lastcall-demo.db); \
                 use `lastcall demo --demo-store-url URL` to keep it elsewhere",
            )
            .exit();
    }
    let args = match cli::Cli::from_arg_matches(&matches) {
        Ok(args) => args,
        Err(e) => e.format(&mut command).exit(),
    };
    // `lastcall bench …` becomes `lastcall-bench …`, which sets up its own logging and
    // runtime: nothing of this process's is started for it.
    let args = match args {
        cli::Cli {
            global,
            command: cli::Command::Bench(bench),
        } => {
            return match cmd::bench::run(&global, bench) {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("error: {}", error_text(&e));
                    std::process::ExitCode::FAILURE
                }
            };
        }
        args => args,
    };
    // `topology delete` asks the broker which queues exist with passive declares; lapin
    // logs the broker's NOT_FOUND answer for each missing one as an error.
    // `ledger export` and `ledger copy` read whole tables as one stream on purpose: sqlx's
    // "slow statement" warning for each is noise there.
    let quiet: &[&str] = match &args.command {
        cli::Command::Topology(cli::TopologyCommand::Delete(_)) => &["lapin::channel"],
        cli::Command::Ledger(_) => &["sqlx::query"],
        _ => &[],
    };
    let _tracing = match config::init_tracing(&args.global, quiet) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            return std::process::ExitCode::FAILURE;
        }
    };
    let rt = match tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: cannot start the async runtime: {e}");
            return std::process::ExitCode::FAILURE;
        }
    };
    match rt.block_on(cmd::run(args, &loaded, &matches)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {}", error_text(&e));
            std::process::ExitCode::FAILURE
        }
    }
}

/// An error and its causes on one line, each cause said once: many errors already carry
/// their cause's text in their own message (`cannot read the token file …: No such file or
/// directory`), and anyhow's `{:#}` would repeat it after them.
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

/// The command line, with changes the derive cannot express:
///
/// - no `--help` shows the value of an environment variable: a set one may hold a secret
///   (a password in a URL), an unset one would print as `[env: NAME=]`. Every argument of
///   every subcommand gets `hide_env_values`, so a flag added later cannot leak either;
/// - the global options are listed under their own heading, not mixed into each command's;
/// - `demo --help` does not list the global `--store-url` and `--prefix`: the demo keeps
///   its own ledger and its own queues (`{prefix}-demo.*`). The demo gets hidden
///   arguments of the same ids, which clap then does not replace with the global ones;
///   their values still reach the global options (clap matches global values by id);
/// - `demo --backend` defaults to `sim` in a build without the embedded model.
fn command() -> clap::Command {
    fn hide_env_values(c: clap::Command) -> clap::Command {
        c.mut_args(|a| a.hide_env_values(true))
            .mut_subcommands(hide_env_values)
    }
    // The options every command shares go under their own heading, after the command's own.
    let root = cli::Cli::command().mut_args(|a| {
        if a.is_global_set() {
            a.help_heading("Global options")
        } else {
            a
        }
    });
    hide_env_values(root).mut_subcommand("demo", |d| {
        d.arg(
            clap::Arg::new("store_url")
                .long("store-url")
                .value_name("STORE_URL")
                .hide(true),
        )
        .arg(
            clap::Arg::new("prefix")
                .long("prefix")
                .value_name("PREFIX")
                .hide(true),
        )
        .mut_arg("backend", |a| {
            if cfg!(feature = "local-model") {
                a
            } else {
                a.default_value("sim")
            }
        })
    })
}

#[cfg(test)]
mod tests {
    use super::error_text;

    #[derive(Debug)]
    struct Io;
    impl std::fmt::Display for Io {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("No such file or directory")
        }
    }
    impl std::error::Error for Io {}

    #[derive(Debug)]
    struct Wrapping(Io);
    impl std::fmt::Display for Wrapping {
        fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            write!(f, "cannot read the token file /x: {}", self.0)
        }
    }
    impl std::error::Error for Wrapping {
        fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
            Some(&self.0)
        }
    }

    #[test]
    fn each_cause_is_said_once_and_context_is_kept() {
        let e = anyhow::Error::new(Wrapping(Io)).context("serve cannot start");
        assert_eq!(
            error_text(&e),
            "serve cannot start: cannot read the token file /x: No such file or directory"
        );
        // A cause whose text is not in the message yet is still said.
        let e = anyhow::Error::new(Io).context("opening the ledger");
        assert_eq!(
            error_text(&e),
            "opening the ledger: No such file or directory"
        );
    }
}
