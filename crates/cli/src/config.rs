//! Configuration: flags override environment variables, which override `lastcall.toml`,
//! which overrides the built-in defaults.

use crate::cli::Global;
use anyhow::{Context, Result};
use serde::Deserialize;
use std::path::Path;

pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const DEFAULT_STORE_URL: &str = "sqlite://lastcall.db";
pub const DEFAULT_PREFIX: &str = "lastcall";

/// Keys `lastcall.toml` may set (the same as the environment variables).
#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FileConfig {
    pub amqp_url: Option<String>,
    pub store_url: Option<String>,
    pub prefix: Option<String>,
    /// Kind → backend routes for `worker --backend routed` (see the README).
    pub routing: Option<lastcall_backend::route::RouteTable>,
}

/// The resolved connection settings.
#[derive(Debug, Clone)]
pub struct Settings {
    pub amqp_url: String,
    pub store_url: String,
    pub prefix: String,
    /// The `[routing]` table of the config file, if any.
    pub routing: Option<lastcall_backend::route::RouteTable>,
}

pub fn load_file(g: &Global) -> Result<FileConfig> {
    let path = match &g.config {
        Some(p) => p.clone(),
        None if Path::new("lastcall.toml").exists() => "lastcall.toml".into(),
        None => return Ok(FileConfig::default()),
    };
    let text = std::fs::read_to_string(&path)
        .with_context(|| format!("cannot read config file {}", path.display()))?;
    toml::from_str(&text).with_context(|| format!("invalid config file {}", path.display()))
}

pub fn settings(g: &Global) -> Result<Settings> {
    let f = load_file(g)?;
    Ok(Settings {
        amqp_url: g
            .amqp_url
            .clone()
            .or(f.amqp_url)
            .unwrap_or_else(|| DEFAULT_AMQP_URL.into()),
        store_url: g
            .store_url
            .clone()
            .or(f.store_url)
            .unwrap_or_else(|| DEFAULT_STORE_URL.into()),
        prefix: g
            .prefix
            .clone()
            .or(f.prefix)
            .unwrap_or_else(|| DEFAULT_PREFIX.into()),
        routing: f.routing,
    })
}

pub fn init_tracing(g: &Global) {
    use tracing_subscriber::EnvFilter;
    let default = if g.verbose { "info" } else { "warn" };
    let filter =
        EnvFilter::try_from_env("LASTCALL_LOG").unwrap_or_else(|_| EnvFilter::new(default));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr);
    if g.log_format == "json" {
        builder.json().init();
    } else {
        builder.init();
    }
}
