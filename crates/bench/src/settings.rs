//! The global options of `lastcall-bench`: the broker URL and prefix every run uses, the
//! config file they may come from, and logging.
//!
//! They resolve as `lastcall`'s do (its `config.rs`): the flag, then the environment
//! variable (clap reads both), then the top-level key of the config file (`--config`,
//! LASTCALL_CONFIG, else `./lastcall.toml` if present), then the default shared with
//! `lastcall` (`lastcall_broker::DEFAULT_AMQP_URL`, `DEFAULT_PREFIX`). Only the keys
//! `amqp_url` and `prefix` are read from the file; its sections are the other commands'
//! business (`lastcall config show` checks the whole file).

use anyhow::{Context, Result, bail};
use clap::Args;
use std::path::{Path, PathBuf};

/// Options every `lastcall-bench` command shares.
#[derive(Debug, Args)]
pub struct Global {
    /// RabbitMQ URL (one node, or a comma-separated list) [default:
    /// amqp://guest:guest@127.0.0.1:5672/%2f]
    #[arg(long, env = "LASTCALL_AMQP_URL", global = true, hide_env_values = true)]
    pub amqp_url: Option<String>,
    /// Prefix of the exchanges and queues; each run declares its own under it
    /// (`PREFIX-bench-…`) [default: lastcall]
    #[arg(long, env = "LASTCALL_PREFIX", global = true, hide_env_values = true)]
    pub prefix: Option<String>,
    /// Config file whose top-level `amqp_url` and `prefix` apply when neither flag nor
    /// environment sets them (the file `lastcall` reads) [default: ./lastcall.toml if
    /// present]
    #[arg(long, env = "LASTCALL_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Log format on stderr: `text` or `json`
    #[arg(long, default_value = "text", global = true, value_parser = ["text", "json"])]
    pub log_format: String,
    /// Log at info level (set LASTCALL_LOG for finer control, e.g. `lastcall=debug`)
    #[arg(long, short, global = true)]
    pub verbose: bool,
}

/// The resolved broker URL and prefix.
#[derive(Clone, PartialEq, Eq)]
pub struct Settings {
    pub amqp_url: String,
    pub prefix: String,
}

impl std::fmt::Debug for Settings {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Settings")
            .field("amqp_url", &lastcall_broker::redact(&self.amqp_url))
            .field("prefix", &self.prefix)
            .finish()
    }
}

/// The two keys of the config file this binary reads.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct FileKeys {
    pub amqp_url: Option<String>,
    pub prefix: Option<String>,
}

impl Global {
    /// Resolve the settings, reading the config file when one is named or
    /// `./lastcall.toml` exists.
    pub fn settings(&self) -> Result<Settings> {
        let path = match &self.config {
            Some(p) => Some(p.clone()),
            None if Path::new("lastcall.toml").exists() => Some("lastcall.toml".into()),
            None => None,
        };
        let file = match &path {
            Some(p) => read_file(p)?,
            None => FileKeys::default(),
        };
        Ok(self.settings_with(file))
    }

    /// [`settings`](Self::settings) with the file's keys already read.
    pub fn settings_with(&self, file: FileKeys) -> Settings {
        Settings {
            amqp_url: (self.amqp_url.clone())
                .or(file.amqp_url)
                .unwrap_or_else(|| lastcall_broker::DEFAULT_AMQP_URL.into()),
            prefix: (self.prefix.clone())
                .or(file.prefix)
                .unwrap_or_else(|| lastcall_broker::DEFAULT_PREFIX.into()),
        }
    }
}

/// The top-level `amqp_url` and `prefix` of a config file.
pub fn read_file(path: &Path) -> Result<FileKeys> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    parse_file(&text).with_context(|| format!("invalid config file {}", path.display()))
}

fn parse_file(text: &str) -> Result<FileKeys> {
    let table: toml::Table = toml::from_str(text)?;
    let key = |name: &str| -> Result<Option<String>> {
        match table.get(name) {
            None => Ok(None),
            Some(toml::Value::String(s)) => Ok(Some(s.clone())),
            Some(other) => bail!("`{name}` must be a string, found {}", other.type_str()),
        }
    };
    Ok(FileKeys {
        amqp_url: key("amqp_url")?,
        prefix: key("prefix")?,
    })
}

/// Set up logging on stderr, as `lastcall` does: warnings by default, info with `-v`,
/// LASTCALL_LOG for anything finer; colour only at a terminal and without NO_COLOR.
pub fn init_tracing(g: &Global) {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer};
    let default = if g.verbose { "info" } else { "warn" };
    let filter =
        EnvFilter::try_from_env("LASTCALL_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    // lapin's trace level logs the AMQP login frame, password included.
    let filter = tracing_subscriber::filter::FilterExt::and(filter, lastcall_broker::log_cap());
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty());
    let fmt = tracing_subscriber::fmt::layer()
        .with_writer(std::io::stderr)
        .with_ansi(ansi);
    let fmt = if g.log_format == "json" {
        fmt.json().boxed()
    } else {
        fmt.boxed()
    };
    tracing_subscriber::registry()
        .with(fmt.with_filter(filter))
        .init();
}

#[cfg(test)]
mod tests {
    use super::*;

    fn global(amqp_url: Option<&str>, prefix: Option<&str>) -> Global {
        Global {
            amqp_url: amqp_url.map(str::to_owned),
            prefix: prefix.map(str::to_owned),
            config: None,
            log_format: "text".into(),
            verbose: false,
        }
    }

    #[test]
    fn flag_or_environment_then_file_then_the_defaults_lastcall_uses() {
        let file = || parse_file("amqp_url = \"amqp://file\"\nprefix = \"from-file\"\n").unwrap();
        assert_eq!(
            global(None, None).settings_with(FileKeys::default()),
            Settings {
                amqp_url: "amqp://guest:guest@127.0.0.1:5672/%2f".into(),
                prefix: "lastcall".into(),
            }
        );
        assert_eq!(
            global(None, None).settings_with(file()),
            Settings {
                amqp_url: "amqp://file".into(),
                prefix: "from-file".into(),
            }
        );
        assert_eq!(
            global(Some("amqp://flag"), None).settings_with(file()),
            Settings {
                amqp_url: "amqp://flag".into(),
                prefix: "from-file".into(),
            }
        );
    }

    #[test]
    fn the_file_s_sections_are_left_alone_and_a_bad_key_is_named() {
        let keys = parse_file(
            "store_url = \"sqlite://x.db\"\n[worker]\nslots = 3\n[routing]\ndefault = \"sim\"\n",
        )
        .unwrap();
        assert_eq!(keys, FileKeys::default());
        let e = parse_file("prefix = 3\n").unwrap_err();
        assert_eq!(e.to_string(), "`prefix` must be a string, found integer");
    }

    #[test]
    fn settings_debug_masks_the_password() {
        let s = Settings {
            amqp_url: "amqp://bob:hunter2@host/%2f".into(),
            prefix: "p".into(),
        };
        assert!(!format!("{s:?}").contains("hunter2"));
    }
}
