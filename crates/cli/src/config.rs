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
    // lapin's trace level logs the AMQP login frame, password included: never below debug,
    // whatever LASTCALL_LOG asks for. A cap, combined with the filter above (a directive
    // `lapin::io_loop=debug` in it would instead raise that target to debug by default).
    let filter = tracing_subscriber::filter::FilterExt::and(
        filter,
        tracing_subscriber::filter::Targets::new()
            .with_default(tracing_subscriber::filter::LevelFilter::TRACE)
            .with_target(
                "lapin::io_loop",
                tracing_subscriber::filter::LevelFilter::DEBUG,
            ),
    );
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
