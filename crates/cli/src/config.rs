//! Configuration: flags override environment variables, which override `lastcall.toml`,
//! which overrides the built-in defaults.
//!
//! One layered loader on clap's own machinery, no second parser: each section of the file
//! (`[worker]`, `[serve]`, `[dlq]`, `[submit]`) becomes the *defaults* of its command's
//! arguments before the command line is parsed. clap then applies its usual order
//! (command line, then the argument's environment variable, then the default), validates a
//! file value with the flag's own value parser, and `ArgMatches::value_source` tells where
//! each value came from (a default the file set is the file's). The top-level keys
//! `amqp_url`, `store_url` and `prefix` are global options and are resolved by
//! [`settings`].

use crate::cli::Global;
use anyhow::{Context, Result, anyhow, bail};
use clap::builder::Resettable;
use clap::parser::ValueSource;
use clap::{Arg, ArgAction, ArgMatches};
use serde::Deserialize;
use std::ffi::OsString;
use std::path::{Path, PathBuf};

pub const DEFAULT_AMQP_URL: &str = lastcall_broker::DEFAULT_AMQP_URL;
pub const DEFAULT_STORE_URL: &str = "sqlite://lastcall.db";
pub const DEFAULT_PREFIX: &str = lastcall_broker::DEFAULT_PREFIX;

/// The commands whose flags `lastcall.toml` may set, one section each.
pub const SECTIONS: [&str; 5] = ["worker", "serve", "dlq", "submit", "ledger"];

/// The command whose flags a section sets: its own name, except `[ledger]`, whose keys are
/// the flags of `ledger prune` (the retention settings, which the workers' background
/// pruning reads too).
pub fn section_path(section: &str) -> &'static [&'static str] {
    match section {
        "worker" => &["worker"],
        "serve" => &["serve"],
        "dlq" => &["dlq"],
        "submit" => &["submit"],
        "ledger" => &["ledger", "prune"],
        _ => &[],
    }
}

/// Keys `lastcall.toml` may set: the connection settings at the top level (the same as
/// the environment variables), the `[routing]` table, and one section per command whose
/// keys are that command's flags (`--max-buffer-bytes` → `max_buffer_bytes`).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub amqp_url: Option<String>,
    pub store_url: Option<String>,
    pub prefix: Option<String>,
    /// Kind → backend routes for `worker --backend routed` (see the README).
    pub routing: Option<Routing>,
    /// `lastcall worker`'s flags.
    #[serde(default)]
    pub worker: toml::Table,
    /// `lastcall serve`'s flags.
    #[serde(default)]
    pub serve: toml::Table,
    /// `lastcall dlq`'s flags.
    #[serde(default)]
    pub dlq: toml::Table,
    /// `lastcall submit`'s flags.
    #[serde(default)]
    pub submit: toml::Table,
    /// Retention: `lastcall ledger prune`'s flags, also read by the workers.
    #[serde(default)]
    pub ledger: toml::Table,
}

impl FileConfig {
    /// The section of a command (empty when the file has none).
    pub fn section(&self, command: &str) -> Option<&toml::Table> {
        match command {
            "worker" => Some(&self.worker),
            "serve" => Some(&self.serve),
            "dlq" => Some(&self.dlq),
            "submit" => Some(&self.submit),
            "ledger" => Some(&self.ledger),
            _ => None,
        }
    }
}

/// The resolved connection settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub amqp_url: String,
    pub store_url: String,
    pub prefix: String,
    /// The `[routing]` table of the config file, if any.
    pub routing: Option<Routing>,
}

/// The `[routing]` table: the routes (`default`, `[[routing.routes]]`), and the named
/// OpenAI-compatible backends they may name besides the built-in `sim`, `openai` and
/// `local` (`[routing.backends.NAME]`), e.g. a local vLLM and a hosted API on one
/// fallback route.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct Routing {
    #[serde(flatten)]
    pub table: lastcall_backend::route::RouteTable,
    #[serde(default)]
    pub backends: std::collections::BTreeMap<String, NamedBackend>,
    /// Keys the table does not know (a misspelt `default`): refused by
    /// [`Routing::check_names`].
    #[serde(flatten)]
    pub unknown: std::collections::BTreeMap<String, toml::Value>,
}

/// One `[routing.backends.NAME]`: an OpenAI-compatible server. Its API key comes only
/// from its own `api_key_env` or `api_key_file` (never the `openai` backend's key: a key
/// for one server is not sent to another).
#[derive(Debug, Clone, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamedBackend {
    pub base_url: String,
    pub model: String,
    #[serde(default)]
    pub api_key_env: Option<String>,
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// `max_tokens` for a job that sets none (default 256).
    #[serde(default)]
    pub max_tokens: Option<u32>,
    /// The most a job may ask for (default 4096).
    #[serde(default)]
    pub max_tokens_limit: Option<u32>,
    /// Send the job's tier as the request's `priority` (vLLM's priority scheduling);
    /// default off.
    #[serde(default)]
    pub send_priority: bool,
    /// Send the budget left, in ms, in this header; default none.
    #[serde(default)]
    pub budget_header: Option<String>,
}

/// The built-in backend names, which a `[routing.backends]` entry may not take.
pub const BUILT_IN_BACKENDS: [&str; 3] = ["sim", "openai", "local"];

impl Routing {
    /// No unknown key; the named backends' names are not the built-in ones, and not blank.
    pub fn check_names(&self) -> Result<(), String> {
        if let Some(key) = self.unknown.keys().next() {
            return Err(format!(
                "unknown key {key:?} in [routing]: it takes `default`, `[[routing.routes]]` and `[routing.backends.NAME]`"
            ));
        }
        for name in self.backends.keys() {
            if name.trim().is_empty() {
                return Err("[routing.backends] has an entry with an empty name".into());
            }
            if BUILT_IN_BACKENDS.contains(&name.as_str()) {
                return Err(format!(
                    "[routing.backends.{name}]: {name:?} is a built-in backend; give the server another name"
                ));
            }
        }
        Ok(())
    }
}

/// The config file in effect and the command line it shapes.
pub struct Loaded {
    /// Where the file was read from; `None`: no file (none given, no `./lastcall.toml`).
    pub path: Option<PathBuf>,
    pub file: FileConfig,
    /// The command line with each section's values as the defaults of its command's flags.
    pub command: clap::Command,
}

/// Where one setting's value came from, highest precedence first.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Source {
    Flag,
    /// The named environment variable.
    Env(String),
    File,
    Default,
}

impl std::fmt::Display for Source {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Source::Flag => f.write_str("flag"),
            Source::Env(name) => write!(f, "env {name}"),
            Source::File => f.write_str("file"),
            Source::Default => f.write_str("default"),
        }
    }
}

/// Find the config file (`--config`, LASTCALL_CONFIG, else `./lastcall.toml` if present),
/// read it and fold its sections into `command`.
pub fn load(command: clap::Command, argv: &[OsString]) -> Result<Loaded> {
    let path = match config_flag(&command, argv) {
        Some(p) => Some(p),
        None if Path::new("lastcall.toml").exists() => Some("lastcall.toml".into()),
        None => None,
    };
    let file = match &path {
        Some(p) => read_file(p)?,
        None => FileConfig::default(),
    };
    let name = path
        .as_deref()
        .map_or_else(|| "lastcall.toml".to_owned(), |p| p.display().to_string());
    let command = apply_file(command, &file, &name)?;
    Ok(Loaded {
        path,
        file,
        command,
    })
}

/// The `--config` value (or LASTCALL_CONFIG): a lenient first parse, before the file's
/// values can shape the real one.
fn config_flag(command: &clap::Command, argv: &[OsString]) -> Option<PathBuf> {
    let lenient = command.clone().ignore_errors(true);
    match lenient.try_get_matches_from(argv) {
        Ok(m) => m.get_one::<PathBuf>("config").cloned(),
        // --help, --version: the real parse says so; the variable may still name a file.
        Err(_) => std::env::var_os("LASTCALL_CONFIG").map(PathBuf::from),
    }
}

pub fn read_file(path: &Path) -> Result<FileConfig> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))
}

/// The file key of an argument: its long flag with `_` for `-`. Hidden (test-only)
/// arguments and positional ones have none.
pub fn key_of(arg: &Arg) -> Option<String> {
    if arg.is_hide_set() {
        return None;
    }
    arg.get_long().map(|l| l.replace('-', "_"))
}

/// Fold every section of `file` into the defaults of its command's arguments. `name` is
/// the file's name for error messages.
pub fn apply_file(
    mut command: clap::Command,
    file: &FileConfig,
    name: &str,
) -> Result<clap::Command> {
    for section in SECTIONS {
        let table = file.section(section).expect("a known section");
        if table.is_empty() {
            continue;
        }
        let path = section_path(section);
        let mut sub = &command;
        for name in path {
            sub = sub
                .find_subcommand(name)
                .ok_or_else(|| anyhow!("no `{}` command", path.join(" ")))?;
        }
        let sub = apply_section(sub.clone(), section, table, name)?;
        command = match path {
            [one] => command.mut_subcommand(one, |_| sub),
            [outer, inner] => command.mut_subcommand(outer, |c| c.mut_subcommand(inner, |_| sub)),
            _ => bail!("no command for section [{section}]"),
        };
    }
    Ok(command)
}

/// Set the defaults of one command's arguments from its section.
fn apply_section(
    mut sub: clap::Command,
    section: &str,
    table: &toml::Table,
    file: &str,
) -> Result<clap::Command> {
    let mut set: Vec<(String, clap::Id, Vec<String>)> = Vec::new();
    for (key, value) in table {
        let Some(arg) = sub
            .get_arguments()
            .find(|a| key_of(a).as_deref() == Some(key.as_str()))
        else {
            let hint = if ["amqp_url", "store_url", "prefix", "routing"].contains(&key.as_str()) {
                " (it belongs at the top level of the file, before any section)".to_owned()
            } else {
                let mut known: Vec<String> = sub.get_arguments().filter_map(key_of).collect();
                known.sort();
                format!(" (known keys: {})", known.join(", "))
            };
            bail!("unknown key `{key}` in section [{section}] of {file}{hint}");
        };
        let values = file_values(arg, value)
            .and_then(|vs| {
                vs.iter().try_for_each(|v| check_value(arg, v))?;
                Ok(vs)
            })
            .map_err(|e| {
                anyhow!("invalid value of `{key}` in section [{section}] of {file}: {e}")
            })?;
        set.push((key.clone(), arg.get_id().clone(), values));
    }
    // Two keys of one section that exclude each other (e.g. submit's payload and prompt).
    for (i, (ka, ida, _)) in set.iter().enumerate() {
        for (kb, idb, _) in &set[i + 1..] {
            if conflicting(&sub, ida, idb) {
                bail!("keys `{ka}` and `{kb}` of section [{section}] of {file} exclude each other");
            }
        }
    }
    for (_, id, values) in set {
        // A value from the file satisfies the argument (or its group) being required.
        let groups: Vec<clap::Id> = sub
            .get_groups()
            .filter(|g| g.get_args().any(|a| *a == id))
            .map(|g| g.get_id().clone())
            .collect();
        for g in groups {
            sub = sub.mut_group(g, |g| g.required(false));
        }
        sub = sub.mut_arg(id, |a| {
            a.required(false)
                .required_unless_present(Resettable::Reset)
                .default_values(values)
        });
    }
    Ok(sub)
}

/// Whether clap refuses `a` and `b` together (a conflict is declared on either side).
fn conflicting(sub: &clap::Command, a: &clap::Id, b: &clap::Id) -> bool {
    let declared = |x: &clap::Id, y: &clap::Id| {
        sub.get_arguments()
            .find(|arg| arg.get_id() == x)
            .is_some_and(|arg| {
                sub.get_arg_conflicts_with(arg)
                    .iter()
                    .any(|c| c.get_id() == y)
            })
    };
    declared(a, b) || declared(b, a)
}

/// A TOML value as the argument's raw values: scalars as text, an array (for a repeatable
/// flag) one value per element, and a string split at the flag's delimiter as on the
/// command line.
fn file_values(arg: &Arg, value: &toml::Value) -> Result<Vec<String>, String> {
    let many = matches!(arg.get_action(), ArgAction::Append);
    let scalar = |v: &toml::Value| -> Result<String, String> {
        match v {
            toml::Value::String(s) => Ok(s.clone()),
            toml::Value::Integer(i) => Ok(i.to_string()),
            toml::Value::Float(f) => Ok(f.to_string()),
            toml::Value::Boolean(b) => Ok(b.to_string()),
            other => Err(format!(
                "expected a string, number or boolean, found {}",
                other.type_str()
            )),
        }
    };
    match value {
        toml::Value::Array(items) if many => items.iter().map(scalar).collect(),
        toml::Value::Array(_) => Err("expected one value, found an array".into()),
        toml::Value::String(s) if many => Ok(match arg.get_value_delimiter() {
            Some(d) => s.split(d).map(str::to_owned).collect(),
            None => vec![s.clone()],
        }),
        v => Ok(vec![scalar(v)?]),
    }
}

/// Check one raw value with the flag's own value parser (number ranges, choices, enums).
fn check_value(arg: &Arg, value: &str) -> Result<(), String> {
    let long = arg.get_long().unwrap_or("value").to_owned();
    let probe = clap::Command::new("lastcall.toml")
        .no_binary_name(true)
        .disable_help_flag(true)
        .arg(
            Arg::new("v")
                .long(long)
                .action(ArgAction::Set)
                .allow_hyphen_values(true)
                .value_parser(arg.get_value_parser().clone()),
        );
    let flag = format!("--{}", arg.get_long().unwrap_or("value"));
    match probe.try_get_matches_from([flag.as_str(), value]) {
        Ok(_) => Ok(()),
        Err(e) => {
            let text = e.render().to_string();
            let first = text.lines().next().unwrap_or_default();
            Err(first.trim_start_matches("error: ").to_owned())
        }
    }
}

impl Loaded {
    /// Parse the command line. A flag wins over a file value it conflicts with (the file's
    /// `payload` gives way to `--prompt`): such file values are dropped and the line parsed
    /// again.
    pub fn parse(&self, argv: &[OsString]) -> Result<ArgMatches, clap::Error> {
        self.parse_with(self.command.clone(), argv)
    }

    /// [`parse`](Self::parse) with `command`, a variant of [`Loaded::command`].
    pub fn parse_with(
        &self,
        command: clap::Command,
        argv: &[OsString],
    ) -> Result<ArgMatches, clap::Error> {
        let matches = command.clone().try_get_matches_from(argv)?;
        let Some((name, sub_m)) = matches.subcommand() else {
            return Ok(matches);
        };
        let (Some(table), Some(sub)) = (self.file.section(name), command.find_subcommand(name))
        else {
            return Ok(matches);
        };
        let explicit: Vec<&clap::Id> = sub
            .get_arguments()
            .filter(|a| {
                matches!(
                    sub_m.value_source(a.get_id().as_str()),
                    Some(ValueSource::CommandLine | ValueSource::EnvVariable)
                )
            })
            .map(Arg::get_id)
            .collect();
        let overridden: Vec<clap::Id> = sub
            .get_arguments()
            .filter(|a| key_of(a).is_some_and(|k| table.contains_key(&k)))
            .filter(|a| sub_m.value_source(a.get_id().as_str()) == Some(ValueSource::DefaultValue))
            .filter(|a| explicit.iter().any(|e| conflicting(sub, a.get_id(), e)))
            .map(|a| a.get_id().clone())
            .collect();
        if overridden.is_empty() {
            return Ok(matches);
        }
        let command = command.clone().mut_subcommand(name, |mut c| {
            for id in overridden {
                c = c.mut_arg(id, |a| a.default_values(Vec::<String>::new()));
            }
            c
        });
        command.try_get_matches_from(argv)
    }

    /// Where the value of `arg` of command `section` in its matches `m` came from.
    pub fn source(&self, section: &str, arg: &Arg, m: &ArgMatches) -> Source {
        match m.value_source(arg.get_id().as_str()) {
            Some(ValueSource::CommandLine) => Source::Flag,
            Some(ValueSource::EnvVariable) => Source::Env(
                arg.get_env()
                    .map(|e| e.to_string_lossy().into_owned())
                    .unwrap_or_default(),
            ),
            _ => {
                let in_file = key_of(arg)
                    .zip(self.file.section(section))
                    .is_some_and(|(k, t)| t.contains_key(&k));
                if in_file {
                    Source::File
                } else {
                    Source::Default
                }
            }
        }
    }
}

/// The connection settings: flag, then environment variable (clap reads both into
/// `g`), then the file's top-level key, then the default.
pub fn settings(g: &Global, f: &FileConfig) -> Settings {
    Settings {
        amqp_url: g
            .amqp_url
            .clone()
            .or_else(|| f.amqp_url.clone())
            .unwrap_or_else(|| DEFAULT_AMQP_URL.into()),
        store_url: g
            .store_url
            .clone()
            .or_else(|| f.store_url.clone())
            .unwrap_or_else(|| DEFAULT_STORE_URL.into()),
        prefix: g
            .prefix
            .clone()
            .or_else(|| f.prefix.clone())
            .unwrap_or_else(|| DEFAULT_PREFIX.into()),
        routing: f.routing.clone(),
    }
}

/// Keeps the trace exporter alive; dropping it flushes and shuts the exporter down.
pub struct TracingGuard {
    #[cfg(feature = "otlp")]
    provider: Option<opentelemetry_sdk::trace::SdkTracerProvider>,
}

impl Drop for TracingGuard {
    fn drop(&mut self) {
        #[cfg(feature = "otlp")]
        if let Some(p) = self.provider.take() {
            let _ = p.shutdown();
        }
    }
}

/// Set up logging (and trace export). `quiet` names log targets to silence unless
/// LASTCALL_LOG asks for them: a command that expects an error answer (a passive declare of
/// a queue that may not exist) does not want lapin's "Channel closed" error line for it.
pub fn init_tracing(g: &Global, quiet: &[&str]) -> Result<TracingGuard> {
    use tracing_subscriber::layer::SubscriberExt;
    use tracing_subscriber::util::SubscriberInitExt;
    use tracing_subscriber::{EnvFilter, Layer};
    let mut default = if g.verbose { "info" } else { "warn" }.to_owned();
    for target in quiet {
        default.push_str(&format!(",{target}=off"));
    }
    let filter =
        EnvFilter::try_from_env("LASTCALL_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    // lapin's trace level logs the AMQP login frame, password included: capped.
    let filter = tracing_subscriber::filter::FilterExt::and(filter, lastcall_broker::log_cap());
    // Colour only for a person at a terminal: piped or redirected logs (files, CI, test
    // harnesses) get plain text, and NO_COLOR turns colour off everywhere.
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
    let registry = tracing_subscriber::registry().with(fmt.with_filter(filter));
    #[cfg(feature = "otlp")]
    {
        if let Some(endpoint) = &g.otlp_endpoint {
            let (layer, provider) = otlp_layer(endpoint)?;
            registry.with(layer).init();
            return Ok(TracingGuard {
                provider: Some(provider),
            });
        }
        registry.init();
        Ok(TracingGuard { provider: None })
    }
    #[cfg(not(feature = "otlp"))]
    {
        if g.otlp_endpoint.is_some() {
            anyhow::bail!(
                "--otlp-endpoint needs a lastcall built with the `otlp` cargo feature (cargo build --features otlp)"
            );
        }
        registry.init();
        Ok(TracingGuard {})
    }
}

/// The OpenTelemetry layer: job spans (at info level and above) exported over OTLP/HTTP.
#[cfg(feature = "otlp")]
fn otlp_layer<S>(
    endpoint: &str,
) -> Result<(
    impl tracing_subscriber::Layer<S>,
    opentelemetry_sdk::trace::SdkTracerProvider,
)>
where
    S: tracing::Subscriber + for<'a> tracing_subscriber::registry::LookupSpan<'a>,
{
    use opentelemetry::trace::TracerProvider as _;
    use opentelemetry_otlp::{Protocol, WithExportConfig};
    use tracing_subscriber::Layer;
    let base = endpoint.trim_end_matches('/');
    let url = if base.ends_with("/v1/traces") {
        base.to_owned()
    } else {
        format!("{base}/v1/traces")
    };
    let exporter = opentelemetry_otlp::SpanExporter::builder()
        .with_http()
        .with_endpoint(url)
        .with_protocol(Protocol::HttpBinary)
        .build()
        .context("cannot build the OTLP exporter")?;
    let provider = opentelemetry_sdk::trace::SdkTracerProvider::builder()
        .with_batch_exporter(exporter)
        .with_resource(
            opentelemetry_sdk::Resource::builder()
                .with_service_name("lastcall")
                .build(),
        )
        .build();
    let tracer = provider.tracer("lastcall");
    let layer = tracing_opentelemetry::layer()
        .with_tracer(tracer)
        .with_filter(tracing_subscriber::filter::LevelFilter::INFO);
    Ok((layer, provider))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::FromArgMatches;

    fn loaded(toml_text: &str) -> Result<Loaded> {
        let file: FileConfig = toml::from_str(toml_text)?;
        let command = apply_file(crate::command(), &file, "test.toml")?;
        Ok(Loaded {
            path: Some("test.toml".into()),
            file,
            command,
        })
    }

    fn argv(args: &[&str]) -> Vec<OsString> {
        std::iter::once("lastcall")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect()
    }

    fn worker(l: &Loaded, args: &[&str]) -> (crate::cli::WorkerArgs, ArgMatches) {
        let m = l.parse(&argv(args)).expect("parses");
        let cli = crate::cli::Cli::from_arg_matches(&m).expect("fits the structs");
        let crate::cli::Command::Worker(w) = cli.command else {
            panic!("not a worker command")
        };
        let sub = m.subcommand_matches("worker").unwrap().clone();
        (*w, sub)
    }

    fn source(l: &Loaded, sub_m: &ArgMatches, key: &str) -> Source {
        let sub = l.command.find_subcommand("worker").unwrap();
        let arg = sub
            .get_arguments()
            .find(|a| key_of(a).as_deref() == Some(key))
            .unwrap();
        l.source("worker", arg, sub_m)
    }

    const FALLBACK_ROUTING: &str = r#"
        [routing]
        default = "sim"

        [routing.backends.vllm]
        base_url = "http://127.0.0.1:8000/v1"
        model = "Qwen/Qwen2.5-1.5B-Instruct"

        [routing.backends.hosted]
        base_url = "https://api.example.com/v1"
        model = "m"
        max_tokens_limit = 1024

        [[routing.routes]]
        kind = "summarize"
        backend = ["vllm", "hosted"]

        [[routing.routes]]
        kind = "code.*"
        backend = "openai"
    "#;

    fn settings_of(toml_text: &str) -> Settings {
        let file: FileConfig = toml::from_str(toml_text).expect("parses");
        Settings {
            amqp_url: DEFAULT_AMQP_URL.into(),
            store_url: DEFAULT_STORE_URL.into(),
            prefix: DEFAULT_PREFIX.into(),
            routing: file.routing,
        }
    }

    #[tokio::test]
    async fn a_fallback_route_over_named_backends_builds_a_router() {
        let s = settings_of(FALLBACK_ROUTING);
        let r = s.routing.as_ref().unwrap();
        assert_eq!(r.backends.len(), 2);
        let l = loaded("").unwrap();
        let (w, _) = worker(&l, &["worker", "--backend", "routed"]);
        let backend = crate::cmd::worker::backend(&s, &w).await.expect("builds");
        assert_eq!(backend.routes_of("summarize"), ["vllm", "hosted"]);
        assert_eq!(backend.routes_of("code.lint"), ["openai"]);
        assert_eq!(backend.routes_of("other"), ["sim"]);
        assert_eq!(backend.serving_names(), ["hosted", "openai", "sim", "vllm"]);
    }

    #[tokio::test]
    async fn bad_fallback_routes_fail_naming_what_is_wrong() {
        let l = loaded("").unwrap();
        let (w, _) = worker(&l, &["worker", "--backend", "routed"]);
        let err = |toml_text: &str| {
            let s = settings_of(toml_text);
            let w = &w;
            async move {
                let e = crate::cmd::worker::backend(&s, w)
                    .await
                    .err()
                    .expect("refused");
                format!("{e:#}")
            }
        };
        let typo = FALLBACK_ROUTING.replace(r#"["vllm", "hosted"]"#, r#"["vllm", "hostd"]"#);
        let e = err(&typo).await;
        assert!(
            e.contains("\"summarize\"") && e.contains("\"hostd\""),
            "{e}"
        );
        let twice = FALLBACK_ROUTING.replace(r#"["vllm", "hosted"]"#, r#"["vllm", "vllm"]"#);
        let e = err(&twice).await;
        assert!(e.contains("\"summarize\"") && e.contains("twice"), "{e}");
        let empty = FALLBACK_ROUTING.replace(r#"["vllm", "hosted"]"#, "[]");
        let e = err(&empty).await;
        assert!(e.contains("\"summarize\"") && e.contains("empty"), "{e}");
        let built_in =
            FALLBACK_ROUTING.replace("[routing.backends.vllm]", "[routing.backends.sim]");
        let e = err(&built_in).await;
        assert!(
            e.contains("[routing.backends.sim]") && e.contains("built-in"),
            "{e}"
        );
        let misspelt =
            FALLBACK_ROUTING.replace("base_url = \"http://127", "base_ulr = \"http://127");
        assert!(
            toml::from_str::<FileConfig>(&misspelt).is_err(),
            "an unknown key of a named backend"
        );
        let e = err(&FALLBACK_ROUTING.replace("default = ", "defualt = ")).await;
        assert!(e.contains("\"defualt\"") && e.contains("[routing]"), "{e}");
    }

    #[test]
    fn a_flag_beats_the_file_and_the_file_beats_the_default() {
        use lastcall_core::concurrency::SlotCount;
        let l = loaded(
            "[worker]\nslots = 7\nbuffer_order = \"fifo\"\nno_wait_refusal = true\n\
             retry_delays_ms = [2000, 9000]\n",
        )
        .unwrap();
        let (w, m) = worker(&l, &["worker", "--backend", "sim"]);
        assert_eq!(w.slots, Some(SlotCount::Fixed(7)));
        assert_eq!(w.buffer_order, crate::cli::BufferOrderArg::Fifo);
        assert!(w.no_wait_refusal);
        assert_eq!(w.topology.retry_delays_ms, vec![2000, 9000]);
        assert_eq!(
            w.max_starts, 3,
            "a key the file leaves out keeps its default"
        );
        assert_eq!(source(&l, &m, "slots"), Source::File);
        assert_eq!(source(&l, &m, "max_starts"), Source::Default);
        assert_eq!(source(&l, &m, "backend"), Source::Flag);

        let (w, m) = worker(&l, &["worker", "--slots", "3", "--retry-delays-ms", "500"]);
        assert_eq!(w.slots, Some(SlotCount::Fixed(3)));
        assert_eq!(w.topology.retry_delays_ms, vec![500]);
        assert_eq!(source(&l, &m, "slots"), Source::Flag);

        // Without the file: the built-in defaults.
        let (w, m) = worker(&loaded("").unwrap(), &["worker"]);
        assert_eq!(w.slots, None);
        assert_eq!(w.slot_count(), SlotCount::Fixed(2), "not openai: fixed");
        let (w, _) = worker(&loaded("").unwrap(), &["worker", "--backend", "openai"]);
        assert_eq!(w.slot_count(), SlotCount::Auto, "openai: auto");
        let (w, _) = worker(&loaded("").unwrap(), &["worker"]);
        assert_eq!(w.buffer_order, crate::cli::BufferOrderArg::Edf);
        assert_eq!(source(&loaded("").unwrap(), &m, "slots"), Source::Default);
    }

    #[test]
    fn a_delimited_string_and_optional_values_come_from_the_file() {
        let l = loaded(
            "[worker]\nretry_delays_ms = \"100,200\"\nprefetch = 9\nname = \"w-1\"\n\
             metrics_addr = \"127.0.0.1:9999\"\n",
        )
        .unwrap();
        let (w, _) = worker(&l, &["worker"]);
        assert_eq!(w.topology.retry_delays_ms, vec![100, 200]);
        assert_eq!(w.prefetch, Some(9));
        assert_eq!(w.name.as_deref(), Some("w-1"));
        assert_eq!(w.metrics_addr, Some("127.0.0.1:9999".parse().unwrap()));
    }

    #[test]
    fn every_section_sets_its_commands_flags() {
        let l = loaded(
            "[serve]\naddr = \"127.0.0.1:9000\"\nmodel = [\"a=k1\", \"b=k2\"]\n\
             [dlq]\nidle_exit_ms = 250\npark = true\n\
             [submit]\nkind = \"incident.summary\"\ndeadline_ms = 60000\n",
        )
        .unwrap();
        let m = l.parse(&argv(&["serve"])).unwrap();
        let crate::cli::Command::Serve(s) = crate::cli::Cli::from_arg_matches(&m).unwrap().command
        else {
            panic!()
        };
        assert_eq!(s.addr, "127.0.0.1:9000".parse().unwrap());
        assert_eq!(s.models, vec!["a=k1", "b=k2"]);
        let m = l.parse(&argv(&["dlq"])).unwrap();
        let crate::cli::Command::Dlq(d) = crate::cli::Cli::from_arg_matches(&m).unwrap().command
        else {
            panic!()
        };
        assert_eq!(d.idle_exit_ms, Some(250));
        assert!(d.park);
        // The file's kind and deadline satisfy submit's required flags.
        let m = l.parse(&argv(&["submit", "--prompt", "hi"])).unwrap();
        let crate::cli::Command::Submit(s) = crate::cli::Cli::from_arg_matches(&m).unwrap().command
        else {
            panic!()
        };
        assert_eq!(s.kind, "incident.summary");
        assert_eq!(s.deadline_ms, Some(60_000));
        // Without the file they are still required.
        let plain = loaded("").unwrap();
        assert!(plain.parse(&argv(&["submit", "--prompt", "hi"])).is_err());
    }

    #[test]
    fn the_ledger_section_sets_the_flags_of_ledger_prune() {
        use crate::cli::{Command, Keep, LedgerCommand};
        let l =
            loaded("[ledger]\nretention = \"14d\"\narchive_dir = \"/var/lib/lastcall/archive\"\n")
                .unwrap();
        let m = l.parse(&argv(&["ledger", "prune"])).unwrap();
        let Command::Ledger(LedgerCommand::Prune(p)) =
            crate::cli::Cli::from_arg_matches(&m).unwrap().command
        else {
            panic!()
        };
        assert_eq!(p.retention.retention, Keep(Some(14 * 86_400_000)));
        assert_eq!(p.retention.text_retention, Keep(Some(7 * 86_400_000)));
        assert_eq!(
            p.retention.archive_dir.as_deref(),
            Some(Path::new("/var/lib/lastcall/archive"))
        );
        // A flag still wins.
        let m = l
            .parse(&argv(&["ledger", "prune", "--retention", "off"]))
            .unwrap();
        let Command::Ledger(LedgerCommand::Prune(p)) =
            crate::cli::Cli::from_arg_matches(&m).unwrap().command
        else {
            panic!()
        };
        assert_eq!(p.retention.retention, Keep(None));
        let e = loaded("[ledger]\nkeep = 1\n").err().unwrap().to_string();
        assert!(
            e.contains("unknown key `keep` in section [ledger]") && e.contains("text_retention"),
            "{e}"
        );
    }

    #[test]
    fn a_flag_displaces_a_file_value_it_conflicts_with() {
        let l = loaded("[submit]\nkind = \"k\"\ndeadline_ms = 1000\npayload = \"{}\"\n").unwrap();
        let m = l
            .parse(&argv(&[
                "submit",
                "--prompt",
                "hi",
                "--expires-at-ms",
                "99",
            ]))
            .unwrap();
        let crate::cli::Command::Submit(s) = crate::cli::Cli::from_arg_matches(&m).unwrap().command
        else {
            panic!()
        };
        assert_eq!(s.prompt.as_deref(), Some("hi"));
        assert_eq!(s.payload, None);
        assert_eq!(s.expires_at_ms, Some(99));
        assert_eq!(s.deadline_ms, None);
    }

    #[test]
    fn unknown_keys_name_the_key_the_section_and_the_file() {
        let e = loaded("[worker]\nslot = 4\n").err().unwrap().to_string();
        assert!(
            e.contains("unknown key `slot` in section [worker] of test.toml"),
            "{e}"
        );
        assert!(e.contains("slots"), "lists the known keys: {e}");
        // Hidden test-only flags are not settable from the file.
        let e = loaded("[worker]\nfault = \"pause-after-store\"\n")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("unknown key `fault` in section [worker]"), "{e}");
        let e = loaded("[worker]\nclock_offset_ms = 5000\n")
            .err()
            .unwrap()
            .to_string();
        assert!(
            e.contains("unknown key `clock_offset_ms` in section [worker]"),
            "{e}"
        );
        let e = loaded("[dlq]\namqp_url = \"amqp://x\"\n")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("top level"), "{e}");
        // An unknown section is refused by the file's own schema.
        let e = format!("{:#}", loaded("[wroker]\nslots = 1\n").err().unwrap());
        assert!(e.contains("wroker"), "{e}");
    }

    #[test]
    fn allowed_models_come_from_flags_or_the_file() {
        let l =
            loaded("[worker]\nallow_model = [\"gpt-4o-mini\", \"Qwen/Qwen2.5-1.5B\"]\n").unwrap();
        let (w, _) = worker(&l, &["worker", "--backend", "sim"]);
        assert_eq!(w.allow_model, vec!["gpt-4o-mini", "Qwen/Qwen2.5-1.5B"]);
        let (w, _) = worker(&l, &["worker", "--backend", "sim", "--allow-model", "x"]);
        assert_eq!(w.allow_model, vec!["x"]);
        let e = loaded("[worker]\nallow_model = [\"two words\"]\n")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("allow_model") && e.contains("no spaces"), "{e}");
    }

    #[test]
    fn tenant_weights_come_from_flags_or_the_file() {
        let l = loaded("[worker]\ntenant_weight = [\"team-a=3\", \"team-b=1\"]\n").unwrap();
        let (w, _) = worker(&l, &["worker", "--backend", "sim"]);
        assert_eq!(
            w.tenant_weight,
            vec![("team-a".to_owned(), 3), ("team-b".to_owned(), 1)]
        );
        let (w, _) = worker(
            &l,
            &["worker", "--backend", "sim", "--tenant-weight", "x=7"],
        );
        assert_eq!(w.tenant_weight, vec![("x".to_owned(), 7)]);
        // serve's tokens file gives the weights; a flag wins for its tenant.
        let file =
            std::env::temp_dir().join(format!("lastcall-weights-{}.toml", std::process::id()));
        let entry = |token: &str, tenant: &str, weight: u32| {
            format!(
                "[[token]]\nsha256 = \"{}\"\ntenant = \"{tenant}\"\nweight = {weight}\n",
                lastcall_http::tokens::hash_token(token)
            )
        };
        let text = entry("token-of-a", "team-a", 3) + &entry("token-of-b", "team-b", 2);
        std::fs::write(&file, text).unwrap();
        let path = file.to_str().unwrap();
        let (w, _) = worker(
            &l,
            &[
                "worker",
                "--tokens-file",
                path,
                "--tenant-weight",
                "team-b=5",
            ],
        );
        let weights = crate::cmd::worker::tenant_weights(&w).unwrap();
        assert!(weights.contains(&("team-a".to_owned(), 3)), "{weights:?}");
        assert!(weights.contains(&("team-b".to_owned(), 5)), "{weights:?}");
        let (w, _) = worker(&l, &["worker", "--tokens-file", "/no/such/file"]);
        let e = crate::cmd::worker::tenant_weights(&w)
            .unwrap_err()
            .to_string();
        assert!(e.contains("/no/such/file"), "{e}");
        let _ = std::fs::remove_file(&file);
    }

    #[test]
    fn bad_values_are_refused_with_the_flags_own_rule() {
        for (text, expect) in [
            (
                "[worker]\nslots = \"many\"\n",
                "`slots` in section [worker]",
            ),
            ("[worker]\nbuffer_order = \"lifo\"\n", "`buffer_order`"),
            ("[worker]\nqueue_type = \"stream\"\n", "`queue_type`"),
            (
                "[serve]\nmax_wait_ms = 0\n",
                "`max_wait_ms` in section [serve]",
            ),
            ("[dlq]\npark = \"maybe\"\n", "`park` in section [dlq]"),
            ("[worker]\nslots = [1, 2]\n", "found an array"),
            ("[worker]\nslots = { a = 1 }\n", "found table"),
            (
                "[worker]\ntenant_weight = [\"team-a\"]\n",
                "expected TENANT=WEIGHT",
            ),
            (
                "[worker]\ntenant_weight = [\"team a=2\"]\n",
                "tenant `team a`",
            ),
            (
                "[worker]\ntenant_weight = [\"team-a=0\"]\n",
                "from 1 to 1000",
            ),
        ] {
            let e = loaded(text).err().unwrap().to_string();
            assert!(e.contains(expect), "{text}: {e}");
            assert!(e.contains("test.toml"), "{text}: {e}");
        }
        let e = loaded("[submit]\npayload = \"{}\"\nprompt = \"x\"\n")
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains("exclude each other"), "{e}");
    }

    #[test]
    fn connection_settings_keep_their_order() {
        let f: FileConfig = toml::from_str("prefix = \"from-file\"\n").unwrap();
        let g = |prefix: Option<&str>| Global {
            amqp_url: None,
            store_url: None,
            prefix: prefix.map(str::to_owned),
            config: None,
            log_format: "text".into(),
            otlp_endpoint: None,
            verbose: false,
        };
        assert_eq!(settings(&g(None), &f).prefix, "from-file");
        assert_eq!(settings(&g(Some("flag")), &f).prefix, "flag");
        assert_eq!(settings(&g(None), &f).store_url, DEFAULT_STORE_URL);
    }
}
