//! `lastcall`: a deadline-aware dispatcher for AI inference jobs on RabbitMQ.
//! Work whose business deadline has passed is never started.
//!
//! This binary is a thin shell: argument parsing ([`cli`]), configuration ([`config`])
//! and one module per subcommand under [`cmd`]. All decisions live in `lastcall-core`.

mod cli;
mod cmd;
mod config;
mod table;

use clap::Parser;

fn main() -> std::process::ExitCode {
    let args = cli::Cli::parse();
    let _tracing = match config::init_tracing(&args.global) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("error: {e:#}");
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
    match rt.block_on(cmd::run(args)) {
        Ok(code) => code,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
