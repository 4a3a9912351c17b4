//! `lastcall config show`: the effective settings, each with its source, secrets masked.

use crate::cli::{ConfigShowArgs, ConfigTarget};
use crate::config::{DEFAULT_AMQP_URL, DEFAULT_PREFIX, DEFAULT_STORE_URL, Loaded, Source, key_of};
use anyhow::{Result, anyhow, bail};
use clap::builder::Resettable;
use clap::parser::ValueSource;
use clap::{Arg, ArgMatches};
use std::ffi::OsString;
use std::path::PathBuf;
use std::process::ExitCode;

pub fn show(loaded: &Loaded, top: &ArgMatches, a: ConfigShowArgs) -> Result<ExitCode> {
    // The shown command's line, parsed as it would run (its required flags excused).
    let shown = match a.command {
        Some(t) => Some((t, parse_target(loaded, t, &a.flags)?)),
        None => None,
    };
    let mut matches = vec![top];
    if let Some((_, m)) = &shown {
        matches.push(m);
    }
    println!(
        "config file: {}",
        match &loaded.path {
            Some(p) => p.display().to_string(),
            None => "none (no --config, no LASTCALL_CONFIG, no ./lastcall.toml)".to_owned(),
        }
    );
    let f = &loaded.file;
    let mut rows = vec![
        global_row(
            "amqp_url",
            &matches,
            f.amqp_url.as_deref(),
            DEFAULT_AMQP_URL,
        ),
        global_row(
            "store_url",
            &matches,
            f.store_url.as_deref(),
            DEFAULT_STORE_URL,
        ),
        global_row("prefix", &matches, f.prefix.as_deref(), DEFAULT_PREFIX),
    ];
    rows.push(match &f.routing {
        Some(t) => vec![
            "routing".into(),
            format!(
                "[routing] table, {} routes, {} named backends",
                t.table.routes.len(),
                t.backends.len()
            ),
            Source::File.to_string(),
        ],
        None => vec!["routing".into(), "-".into(), Source::Default.to_string()],
    });
    if let Some((target, m)) = &shown {
        let name = target.name();
        let sub_m =
            target_matches(m, *target).ok_or_else(|| anyhow!("no `{name}` in the parsed line"))?;
        let sub = target_command(&loaded.command, *target)
            .ok_or_else(|| anyhow!("no `{name}` command"))?;
        for arg in sub.get_arguments() {
            let Some(key) = key_of(arg) else { continue };
            let value = match sub_m.get_raw(arg.get_id().as_str()) {
                Some(vals) => vals
                    .map(|v| v.to_string_lossy().into_owned())
                    .collect::<Vec<_>>()
                    .join(","),
                None => "-".to_owned(),
            };
            rows.push(vec![
                format!("{name}.{key}"),
                mask(&key, arg, &value),
                loaded.source(name, arg, sub_m).to_string(),
            ]);
        }
    }
    print!(
        "{}",
        crate::table::render(&["setting", "value", "source"], &rows)
    );
    if let Some((target, m)) = &shown {
        let secrets = secrets(*target, target_matches(m, *target));
        if !secrets.is_empty() {
            println!("secrets from the environment (never shown):");
            for var in secrets {
                let set = std::env::var_os(&var).is_some_and(|v| !v.is_empty());
                println!("  {var}: {}", if set { "set" } else { "not set" });
            }
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// The command whose flags a target shows (`ledger` shows `ledger prune`'s).
fn target_command(c: &clap::Command, t: ConfigTarget) -> Option<&clap::Command> {
    crate::config::section_path(t.name())
        .iter()
        .try_fold(c, |c, name| c.find_subcommand(name))
}

/// That command's matches in a parsed line.
fn target_matches(m: &ArgMatches, t: ConfigTarget) -> Option<&ArgMatches> {
    crate::config::section_path(t.name())
        .iter()
        .try_fold(m, |m, name| m.subcommand_matches(name))
}

/// `lastcall <target> <flags…>` parsed with the file's defaults, its required flags
/// excused (the settings of a submit without --kind can still be shown).
fn parse_target(loaded: &Loaded, t: ConfigTarget, flags: &[OsString]) -> Result<ArgMatches> {
    let name = t.name();
    let path = crate::config::section_path(name);
    let mut command = loaded.command.clone();
    let groups: Vec<clap::Id> = command
        .find_subcommand(name)
        .map(|s| s.get_groups().map(|g| g.get_id().clone()).collect())
        .unwrap_or_default();
    command = command.mut_subcommand(name, |mut c| {
        for g in groups {
            c = c.mut_group(g, |g| g.required(false));
        }
        c.mut_args(|a| a.required(false).required_unless_present(Resettable::Reset))
    });
    let argv: Vec<OsString> = std::iter::once("lastcall".into())
        .chain(path.iter().map(OsString::from))
        .chain(flags.iter().cloned())
        .collect();
    let m = loaded.parse_with(command, &argv).map_err(|e| {
        let text = e.render().to_string();
        anyhow!(
            "{}",
            text.trim_start_matches("error: ").trim_end().replace(
                "lastcall <COMMAND>",
                &format!("lastcall config show {name}")
            )
        )
    })?;
    if m.value_source("config") == Some(ValueSource::CommandLine) {
        bail!("give --config before `config show` (the file is read before the command's flags)");
    }
    Ok(m)
}

/// A connection setting: a flag anywhere on the line (before `config show`, or among the
/// shown command's flags), its environment variable, the file's top-level key, the default.
fn global_row(
    key: &str,
    matches: &[&ArgMatches],
    file: Option<&str>,
    default: &str,
) -> Vec<String> {
    let from = |wanted: ValueSource| {
        matches
            .iter()
            .find(|m| m.value_source(key) == Some(wanted))
            .and_then(|m| m.get_one::<String>(key).cloned())
    };
    let (value, source) = if let Some(v) = from(ValueSource::CommandLine) {
        (v, Source::Flag)
    } else if let Some(v) = from(ValueSource::EnvVariable) {
        (
            v,
            Source::Env(format!("LASTCALL_{}", key.to_ascii_uppercase())),
        )
    } else if let Some(v) = file {
        (v.to_owned(), Source::File)
    } else {
        (default.to_owned(), Source::Default)
    };
    vec![key.to_owned(), mask_urls(&value), source.to_string()]
}

/// The environment variables holding a command's secrets (their values are never printed).
fn secrets(t: ConfigTarget, m: Option<&ArgMatches>) -> Vec<String> {
    let mut vars: Vec<String> = match t {
        ConfigTarget::Worker => vec!["LASTCALL_SIGNING_KEY", "LASTCALL_MANAGEMENT_PASSWORD"],
        ConfigTarget::Serve => vec![
            "LASTCALL_HTTP_TOKEN",
            "LASTCALL_SIGNING_KEY",
            "LASTCALL_WEBHOOK_KEY",
            "LASTCALL_MANAGEMENT_PASSWORD",
        ],
        ConfigTarget::Dlq | ConfigTarget::Submit => vec!["LASTCALL_SIGNING_KEY"],
        ConfigTarget::Ledger => vec![],
    }
    .into_iter()
    .map(str::to_owned)
    .collect();
    // The OpenAI backend's key lives in the variable --api-key-env names.
    if let Some(var) = m.and_then(|m| m.try_get_one::<String>("api_key_env").ok().flatten()) {
        vars.push(var.clone());
    }
    vars
}

/// A setting's value as printed: whole if its name says it is a secret (a password, token,
/// secret or key, not the file or variable holding one), else with URL passwords masked.
pub fn mask(key: &str, arg: &Arg, value: &str) -> String {
    let last = key.rsplit('_').next().unwrap_or(key);
    let is_path = arg.get_value_parser().type_id() == std::any::TypeId::of::<PathBuf>();
    if ["password", "token", "secret", "key"].contains(&last) && !is_path && value != "-" {
        return "****".to_owned();
    }
    mask_urls(value)
}

/// Mask the password of every URL in a comma-separated list (`scheme://user:***@host`),
/// and the values of query parameters that name a secret (`?password=***`).
pub fn mask_urls(value: &str) -> String {
    lastcall_core::redact::url(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    // The URLs' own cases are lastcall_core::redact's.
    #[test]
    fn url_passwords_and_secret_parameters_are_masked() {
        assert_eq!(
            mask_urls("amqp://guest:secret@h:5672/%2f"),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(
            mask_urls("amqp://a:p1@h1:5672,amqp://b:p2@h2:5672"),
            "amqp://a:***@h1:5672,amqp://b:***@h2:5672"
        );
        assert_eq!(
            mask_urls("postgres://u@db/x?sslmode=require&password=hunter2"),
            "postgres://u@db/x?sslmode=require&password=***"
        );
        assert_eq!(
            mask_urls("amqps://h/%2f?cacertfile=/ca.pem"),
            "amqps://h/%2f?cacertfile=/ca.pem"
        );
        assert_eq!(mask_urls("sqlite://lastcall.db"), "sqlite://lastcall.db");
        // An '@' in the path is not a password.
        assert_eq!(mask_urls("http://h:15672/a@b"), "http://h:15672/a@b");
    }

    #[test]
    fn values_of_secret_names_are_masked_but_not_their_files() {
        let text = Arg::new("x");
        let path = Arg::new("x").value_parser(clap::value_parser!(PathBuf));
        assert_eq!(mask("api_token", &text, "abc"), "****");
        assert_eq!(mask("tls_key", &path, "/etc/k.pem"), "/etc/k.pem");
        assert_eq!(
            mask("api_key_env", &text, "LASTCALL_API_KEY"),
            "LASTCALL_API_KEY"
        );
        assert_eq!(mask("max_tokens", &text, "256"), "256");
    }
}
