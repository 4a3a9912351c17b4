//! One module per subcommand.

mod batch;
pub(crate) mod bench;
mod cancel;
mod config;
mod demo;
mod dlq;
mod jobs;
mod ledger;
mod reconcile;
mod report;
mod serve;
mod submit;
mod tokens;
mod topology;
pub(crate) mod worker;

use crate::cli::{AdmissionArgs, Cli, Command, ConfigCommand, TopologyArgs, TopologyCommand};
use crate::config::{Loaded, Settings};
use anyhow::{Context, Result, bail};
use lastcall_broker::{Broker, QueueType, Topology};
use lastcall_core::{AdmissionPolicy, EnvelopeLimits};
use lastcall_store::Ledger;
use std::process::ExitCode;
use std::sync::Arc;

/// Run the parsed command. `loaded` is the config file in effect and `matches` the
/// parsed command line (`config show` reports the sources of values from them).
pub async fn run(cli: Cli, loaded: &Loaded, matches: &clap::ArgMatches) -> Result<ExitCode> {
    let settings = crate::config::settings(&cli.global, &loaded.file);
    // The wall clock of the one-shot commands (the worker, serve and dlq build their own).
    let clock = lastcall_worker::SystemClock::default();
    match cli.command {
        Command::Submit(a) => submit::run(&settings, a, &clock).await,
        Command::Worker(a) => {
            let retention = ledger::retention_settings(loaded)?;
            worker::run(&settings, *a, retention).await
        }
        Command::Jobs(c) => jobs::run(&settings, c).await,
        Command::Topology(TopologyCommand::Apply(t)) => {
            let broker = connect_broker(&settings).await?;
            let topo = topology(&settings.prefix, &t.topology)?;
            topo.apply(&broker).await?;
            println!(
                "topology applied: exchange {} → queue {} (dead letters: {} → {}; retry queues: {})",
                topo.names.jobs_exchange,
                topo.names.work_queue,
                topo.names.dlx,
                topo.names.dead_queue,
                topo.retry_delays_ms
                    .iter()
                    .map(|d| topo.names.retry_queue(*d))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
            println!(
                "named tenants' lanes: exchange {} → queues {}.lane1 … {}.lane{}",
                topo.names.lanes_exchange,
                topo.names.work_queue,
                topo.names.work_queue,
                lastcall_core::LANES - 1
            );
            if t.policies {
                let m = lastcall_broker::management::Management::from_amqp_url(
                    &settings.amqp_url,
                    &t.management_url,
                );
                let names = m.apply_policies(&topo).await?;
                println!("policies applied: {}", names.join(", "));
            }
            broker.close().await;
            Ok(ExitCode::SUCCESS)
        }
        Command::Topology(TopologyCommand::Delete(d)) => topology::delete(&settings, d).await,
        Command::Demo(a) => demo::run(&settings, a).await,
        Command::Dlq(a) => dlq::run(&settings, a).await,
        Command::Reconcile(a) => reconcile::run(&settings, a, &clock).await,
        Command::Cancel(a) => cancel::run(&settings, a, &clock).await,
        Command::Report(a) => report::run(&settings, a, &clock).await,
        Command::Serve(a) => {
            // `serve` never prunes, but its dashboard judges the ledger by the retention
            // the workers prune with: the same `[ledger]` settings. Unreadable ones (which
            // stop a worker) only turn that alert off here.
            let retention = match ledger::retention_settings(loaded) {
                Ok(p) => p.retention_ms,
                Err(e) => {
                    tracing::warn!(error = %e, "the dashboard's retention alert is off");
                    None
                }
            };
            serve::run(&settings, a, retention).await
        }
        // main.rs runs it before logging and the runtime start; the same call here.
        Command::Bench(a) => bench::run(&cli.global, a),
        Command::Config(ConfigCommand::Show(a)) => config::show(loaded, matches, a),
        Command::Ledger(c) => ledger::run(&settings, c, &clock).await,
        Command::Tokens(c) => tokens::run(c),
        Command::Batch(a) => batch::run(a).await,
    }
}

pub async fn connect_broker(s: &Settings) -> Result<Broker> {
    Broker::connect(&s.amqp_url).await.map_err(|e| match e {
        lastcall_broker::BrokerError::Connect { url, source } => {
            anyhow::anyhow!(connect_error(&url, &source))
        }
        e => e.into(),
    })
}

/// The connection of an outcome-events follower given its own URL (`--events-amqp-url`,
/// the `follower` role of docs/broker-permissions.md). It declares no topology: only
/// `{prefix}.events`, its own `{prefix}.events.follow.*` queue and their binding.
pub async fn connect_events_broker(url: &str) -> Result<Broker> {
    Broker::connect(url).await.map_err(|e| match e {
        lastcall_broker::BrokerError::Connect { url, source } => {
            anyhow::anyhow!("--events-amqp-url: {}", connect_error(&url, &source))
        }
        e => anyhow::anyhow!("--events-amqp-url: {e}"),
    })
}

/// A broker connection for best-effort publishing (events, broadcasts) by a command that
/// works without one: within 5 s, else `None` after one line saying what is lost (`without`).
pub async fn connect_best_effort(s: &Settings, without: &str) -> Option<Broker> {
    match tokio::time::timeout(
        std::time::Duration::from_secs(5),
        Broker::connect(&s.amqp_url),
    )
    .await
    {
        Ok(Ok(b)) => Some(b),
        Ok(Err(e)) => {
            eprintln!("warning: the broker is not reachable ({e}); {without}");
            None
        }
        Err(_) => {
            eprintln!("warning: connecting to the broker timed out; {without}");
            None
        }
    }
}

/// One line for a failed connection, without repeating the cause as a source: the URL
/// (password masked), why, and what to check.
fn connect_error(url: &str, e: &(dyn std::error::Error + 'static)) -> String {
    let mut cur = Some(e);
    while let Some(err) = cur {
        if let Some(io) = err.downcast_ref::<std::io::Error>() {
            // "connection refused" rather than "IO error: Connection refused (os error 111)".
            let text = io.to_string();
            let text = text.rfind(" (os error ").map_or(&text[..], |i| &text[..i]);
            let mut chars = text.chars();
            let cause: String = match chars.next() {
                Some(first) => first.to_lowercase().chain(chars).collect(),
                None => io.kind().to_string(),
            };
            if io.kind() == std::io::ErrorKind::InvalidData && cause.contains("certificate") {
                // rustls refused the broker's certificate: it answered, TLS is the problem.
                return format!(
                    "cannot connect to RabbitMQ at {url}: TLS: {cause}; for a private CA add \
                     cacertfile=/path/ca.pem to the amqps:// URL, and use the host name the \
                     certificate names (docs/tls.md)"
                );
            }
            return format!(
                "cannot connect to RabbitMQ at {url}: {cause}; is it running? (scripts/services.sh \
                 starts a local one); set LASTCALL_AMQP_URL or --amqp-url to use another broker"
            );
        }
        cur = err.source();
    }
    let text = e.to_string();
    if text.contains("ACCESS_REFUSED") || text.contains("ACCESS-REFUSED") {
        format!(
            "RabbitMQ at {url} refused the login (ACCESS_REFUSED): check the user and password \
             in LASTCALL_AMQP_URL or --amqp-url"
        )
    } else {
        format!(
            "cannot connect to RabbitMQ at {url}: {text}; check LASTCALL_AMQP_URL or --amqp-url"
        )
    }
}

pub async fn open_ledger(url: &str) -> Result<Arc<Ledger>> {
    let l = Ledger::connect(url).await.with_context(|| {
        format!(
            "cannot open the ledger at {} (set --store-url or LASTCALL_STORE_URL)",
            lastcall_broker::redact(url)
        )
    })?;
    Ok(Arc::new(l))
}

/// [`open_ledger`] for a command that reads what others wrote (`report`, `reconcile`): a
/// SQLite file that did not exist is created by opening it, so a mistyped path would read
/// as an empty ledger (and `reconcile` as one with nothing wrong). Say so, on stderr, so
/// that JSON and CSV outputs stay as they are.
pub async fn open_ledger_to_read(url: &str) -> Result<Arc<Ledger>> {
    let new_file = jobs::sqlite_path(url).is_some_and(|p| !p.exists());
    let ledger = open_ledger(url).await?;
    if new_file {
        eprintln!(
            "note: the ledger at {} did not exist: a new, empty one was created; set \
             --store-url or LASTCALL_STORE_URL to read another",
            lastcall_broker::redact(url)
        );
    }
    Ok(ledger)
}

/// The broker and the ledger of a long-running process (`worker`, `dlq`, `serve`) that
/// may start before them: each that is down at startup is waited for with backoff, as it
/// would be if it went away later; `max_wait` (`--connect-timeout-ms`) bounds each wait,
/// and `stop` (a shutdown signal) ends it with `Ok(None)`. `startup`, the router of an
/// address already listening, learns when the broker is reached.
pub async fn connect_waiting(
    s: &Settings,
    stop: &tokio_util::sync::CancellationToken,
    max_wait: Option<std::time::Duration>,
    startup: Option<&lastcall_http::starting::Startup>,
) -> Result<Option<(Broker, Arc<Ledger>)>> {
    let Some(broker) = connect_broker_waiting(s, stop, max_wait).await? else {
        return Ok(None);
    };
    if let Some(startup) = startup {
        startup.reached("broker"); // `/readyz` now names the ledger alone
    }
    let Some(ledger) = open_ledger_waiting(&s.store_url, stop, max_wait).await? else {
        broker.close().await;
        return Ok(None);
    };
    Ok(Some((broker, ledger)))
}

/// The broker half of [`connect_waiting`]: `Ok(None)` when `stop` ended the wait. A
/// broker that does not answer the first time is said once on stderr (why, and that the
/// process waits), as the ledger's wait is.
pub async fn connect_broker_waiting(
    s: &Settings,
    stop: &tokio_util::sync::CancellationToken,
    max_wait: Option<std::time::Duration>,
) -> Result<Option<Broker>> {
    match Broker::connect(&s.amqp_url).await {
        Ok(b) => return Ok(Some(b)),
        Err(
            e @ (lastcall_broker::BrokerError::NoUrl | lastcall_broker::BrokerError::Url { .. }),
        ) => {
            return Err(e.into());
        }
        Err(e) => {
            let why = match &e {
                lastcall_broker::BrokerError::Connect { url, source } => connect_error(url, source),
                e => e.to_string(),
            };
            eprintln!(
                "lastcall: waiting for the broker (--connect-timeout-ms bounds the wait): {why}"
            );
        }
    }
    match Broker::connect_retrying(&s.amqp_url, stop, max_wait).await {
        Ok(b) => Ok(Some(b)),
        Err(_) if stop.is_cancelled() => Ok(None),
        Err(_) => connect_broker(s).await.map(Some), // one more try, for its clear error
    }
}

/// [`open_ledger`] for a long-running process that may start before its database (a host
/// booting, the database restarting): an unreachable database is waited for with backoff,
/// as a worker waits for a broker that is down at startup. `max_wait` bounds the wait
/// (then the error says why); `stop` ends it early (`Ok(None)`). An error that waiting
/// cannot mend (a bad URL, a failed migration) is returned at once.
pub async fn open_ledger_waiting(
    url: &str,
    stop: &tokio_util::sync::CancellationToken,
    max_wait: Option<std::time::Duration>,
) -> Result<Option<Arc<Ledger>>> {
    let started = tokio::time::Instant::now();
    let mut delay = std::time::Duration::from_millis(200);
    let mut attempts = 0u32;
    loop {
        match Ledger::connect(url).await {
            Ok(l) => {
                if attempts > 0 {
                    tracing::warn!(
                        attempts,
                        after_ms = started.elapsed().as_millis() as u64,
                        "ledger reachable: starting"
                    );
                    eprintln!("lastcall: the ledger is reachable; starting");
                }
                return Ok(Some(Arc::new(l)));
            }
            Err(e) if e.is_retryable() => {
                if attempts == 0 {
                    tracing::warn!(error = %e, "ledger unreachable at startup; waiting for it with backoff");
                    eprintln!(
                        "lastcall: the ledger at {} is not reachable ({e}); waiting for it \
                         (--connect-timeout-ms bounds the wait)",
                        lastcall_broker::redact(url)
                    );
                }
                attempts += 1;
                if max_wait.is_some_and(|m| started.elapsed() >= m) {
                    return Err(anyhow::anyhow!(e)).with_context(|| {
                        format!(
                            "cannot open the ledger at {} within --connect-timeout-ms \
                             ({attempts} attempts); is the database running? (set --store-url \
                             or LASTCALL_STORE_URL)",
                            lastcall_broker::redact(url)
                        )
                    });
                }
            }
            Err(e) => {
                return Err(anyhow::anyhow!(e)).with_context(|| {
                    format!(
                        "cannot open the ledger at {} (set --store-url or LASTCALL_STORE_URL)",
                        lastcall_broker::redact(url)
                    )
                });
            }
        }
        // Jittered, so that workers restarted together do not knock in step.
        let jittered = delay.mul_f64(0.5 + rand::random::<f64>() / 2.0);
        tokio::select! {
            _ = tokio::time::sleep(jittered) => {}
            _ = stop.cancelled() => return Ok(None),
        }
        delay = (delay * 2).min(std::time::Duration::from_secs(10));
    }
}

pub fn topology(prefix: &str, t: &TopologyArgs) -> Result<Topology> {
    let mut topo = Topology::new(prefix);
    topo.queue_type = t
        .queue_type
        .parse::<QueueType>()
        .map_err(anyhow::Error::msg)?;
    if t.retry_delays_ms.is_empty()
        || t.retry_delays_ms.windows(2).any(|w| w[0] >= w[1])
        || t.retry_delays_ms[0] == 0
    {
        bail!(
            "--retry-delays-ms must be positive and strictly ascending, got {:?}",
            t.retry_delays_ms
        );
    }
    topo.retry_delays_ms = t.retry_delays_ms.clone();
    topo.delivery_limit = t.delivery_limit;
    topo.max_length = t.max_length;
    Ok(topo)
}

pub fn admission(a: &AdmissionArgs) -> (AdmissionPolicy, EnvelopeLimits) {
    (
        AdmissionPolicy {
            clock_uncertainty_ms: a.clock_uncertainty_ms,
            default_min_runtime_ms: a.min_runtime_ms,
        },
        EnvelopeLimits {
            horizon_ms: a.horizon_ms,
            max_body_bytes: a.max_message_bytes,
        },
    )
}

/// Resolve on the first SIGINT or SIGTERM.
pub async fn shutdown_signal() {
    let ctrl_c = tokio::signal::ctrl_c();
    #[cfg(unix)]
    {
        let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
            .expect("install SIGTERM handler");
        tokio::select! {
            _ = ctrl_c => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    {
        let _ = ctrl_c.await;
    }
}
