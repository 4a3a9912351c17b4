//! `lastcall serve`, and the metrics endpoint of `lastcall worker --metrics-addr`.

use crate::cli::ServeArgs;
use crate::config::Settings;
use anyhow::{Context, Result};
use lastcall_broker::management::Management;
use lastcall_broker::{Publisher, Topology};
use lastcall_clock::SystemClock;
use lastcall_http::depth::DepthProbe;
use lastcall_http::starting::Startup;
use lastcall_http::{AppState, MetricsSource, Token};
use lastcall_producer::Submitter;
use lastcall_producer::shed::Shedder;
use lastcall_store::Ledger;
use lastcall_worker::WorkerStats;
use lastcall_worker::dlq::DeadLetterProcessor;
use lastcall_worker::stats::{DlqCollector, WorkerCollector};
use std::net::SocketAddr;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `retention_ms`: the `[ledger]` section's row retention (`None`: off or unreadable), for
/// the dashboard's `ledger_behind_retention` alert.
pub async fn run(s: &Settings, a: ServeArgs, retention_ms: Option<i64>) -> Result<ExitCode> {
    return_large_frees();
    // Everything a flag, a file or the environment can get wrong is read first: a usage
    // error is reported at once, before anything is bound or connected.
    let token = Token::load(a.token_file.as_deref(), "LASTCALL_HTTP_TOKEN")?;
    let tokens = match &a.tokens_file {
        Some(path) => {
            let file = lastcall_http::tokens::TokensFile::load(path)?;
            if file.lookup(token.expose_for_lookup()).is_some() {
                anyhow::bail!(
                    "the tokens file {} lists the operator's token (--token-file / LASTCALL_HTTP_TOKEN); give each tenant a token of its own",
                    path.display()
                );
            }
            tracing::info!(tokens = file.len(), tenants = ?file.weights(), "tokens file read");
            Some(Arc::new(file))
        }
        None => None,
    };
    let tls = match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Some(
            lastcall_http::tls::TlsServerConfig::from_pem_files(cert, key)
                .map_err(anyhow::Error::msg)?,
        ),
        _ => None,
    };
    let signing_key = super::submit::signing_key(a.signing_key_file.as_deref())?;
    let topo = super::topology(&s.prefix, &a.topology)?;
    let front_door = lastcall_http::front_door::FrontDoor {
        models: lastcall_http::front_door::FrontDoor::parse_models(&a.models)
            .map_err(anyhow::Error::msg)?,
        default_deadline_ms: a.default_deadline_ms,
        max_hold_ms: a.max_hold_ms,
    };
    let webhooks = lastcall_http::webhooks::WebhookConfig {
        allow: lastcall_http::webhooks::WebhookConfig::parse_allow(&a.webhook_allow)
            .map_err(anyhow::Error::msg)?,
        key: lastcall_producer::load_signing_key(
            a.webhook_key_file.as_deref(),
            "LASTCALL_WEBHOOK_KEY",
        )?,
        attempts: a.webhook_attempts,
        ..Default::default()
    };
    let stop = CancellationToken::new();
    let stop2 = stop.clone();
    tokio::spawn(async move {
        super::shutdown_signal().await;
        stop2.cancel();
    });
    // Listen first, then connect: a load balancer or a supervisor sees a live process
    // (`/healthz` 200) that is not ready yet (`/readyz` 503 naming the broker or the
    // ledger), not a refused connection, while the broker or the database starts.
    let startup = Startup::new();
    let scheme = if tls.is_some() { "https" } else { "http" };
    let cannot_serve = format!("cannot serve {} on {}", scheme.to_uppercase(), a.addr);
    let server = lastcall_http::listen_with(
        a.addr,
        startup.router(),
        stop.clone(),
        tls,
        lastcall_http::limit::Limits {
            max_connections: a.max_connections,
            header_read_timeout: std::time::Duration::from_millis(a.header_read_timeout_ms),
        },
    )
    .await
    .map_err(|e| bind_error(e, &cannot_serve, "--addr"))?;
    eprintln!(
        "lastcall serve: listening on {scheme}://{} (dashboard: open it in a browser, any user \
         name, the token as password)",
        server.addr
    );
    let parts = Parts {
        token,
        tokens,
        signing_key,
        topo,
        front_door,
        webhooks,
        retention_ms,
    };
    let max_wait = a.connect_timeout_ms.map(Duration::from_millis);
    let running = match super::connect_waiting(s, &stop, max_wait, Some(&startup)).await {
        Ok(Some((broker, ledger))) => match build(s, &a, parts, broker, ledger, &stop).await {
            Ok((state, running)) => {
                let state = Arc::new(state);
                // Batch lines become jobs a page at a time, from each batch's cursor.
                lastcall_http::batches::spawn_pump(state.clone(), stop.clone());
                startup.ready(lastcall_http::app(state));
                tracing::info!("serve is ready");
                Some(running)
            }
            Err(e) => return Err(stop_server(&stop, server, e).await),
        },
        Ok(None) => None, // a shutdown signal during the wait
        Err(e) => return Err(stop_server(&stop, server, e).await),
    };
    let result = server.task.await;
    stop.cancel();
    if let Some(r) = running {
        r.shut_down().await;
    }
    result
        .context("the HTTP server task failed")?
        .context(cannot_serve)?;
    Ok(ExitCode::SUCCESS)
}

/// Give every allocation of 128 KiB or more back to the system when it is freed, as glibc
/// does until its first free of such a block: that free raises glibc's mmap threshold to
/// the block's size, and later blocks below it come from the heap, whose freed pages stay
/// resident. lapin gives each connection two buffers of 32 × frame_max (4 MiB each with
/// RabbitMQ's 128 KiB frame_max): at a broker restart every connection's buffers are freed
/// and allocated again, so with the dynamic threshold `serve` kept some of them resident
/// (+4 MB at the first restart with 4 connections; RELIABILITY.md, the soak). Setting the
/// threshold explicitly turns the dynamic one off (mallopt(3)). Only here: a worker with
/// the embedded model allocates large tensors at every call, where the dynamic threshold
/// spares it an mmap each (not measured), and the workers did not show the growth.
#[allow(unsafe_code)]
fn return_large_frees() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: mallopt only sets an allocator parameter; 128 KiB is glibc's own default.
    unsafe {
        libc::mallopt(libc::M_MMAP_THRESHOLD, 128 * 1024);
    }
}

/// Stop the server that answered while `serve` started, and hand back why it gave up.
async fn stop_server(
    stop: &CancellationToken,
    server: lastcall_http::Listening,
    e: anyhow::Error,
) -> anyhow::Error {
    stop.cancel();
    let _ = server.task.await;
    e
}

/// `e` from binding the address of `flag`, under `what` failed and what to do about it.
fn bind_error(e: std::io::Error, what: &str, flag: &str) -> anyhow::Error {
    let what = match e.kind() {
        std::io::ErrorKind::AddrInUse => {
            format!("{what} (another process listens there: stop it, or pass another {flag})")
        }
        std::io::ErrorKind::PermissionDenied => {
            format!("{what} (ports below 1024 need privileges: pass a higher port to {flag})")
        }
        std::io::ErrorKind::AddrNotAvailable => {
            format!("{what} (no interface of this host has that address: check {flag})")
        }
        _ => what.to_owned(),
    };
    anyhow::Error::new(e).context(what)
}

/// What `run` read from the flags before connecting.
struct Parts {
    token: Token,
    tokens: Option<Arc<lastcall_http::tokens::TokensFile>>,
    signing_key: Option<lastcall_core::SigningKey>,
    topo: Topology,
    front_door: lastcall_http::front_door::FrontDoor,
    webhooks: lastcall_http::webhooks::WebhookConfig,
    retention_ms: Option<i64>,
}

/// What runs beside the router, to be stopped with it.
struct Running {
    broker: lastcall_broker::Broker,
    ledger: Arc<Ledger>,
    dlq_task: Option<tokio::task::JoinHandle<Result<(), String>>>,
    events_task: tokio::task::JoinHandle<()>,
}

impl Running {
    async fn shut_down(self) {
        if let Some(t) = self.dlq_task
            && let Ok(Err(e)) = t.await
        {
            tracing::warn!(error = %e, "dead-letter processor stopped with an error");
        }
        let _ = tokio::time::timeout(Duration::from_secs(2), self.events_task).await;
        self.broker.close().await;
        self.ledger.close().await;
    }
}

/// The full router of `serve` and its background tasks, once the broker and the ledger
/// answer.
async fn build(
    s: &Settings,
    a: &ServeArgs,
    p: Parts,
    broker: lastcall_broker::Broker,
    ledger: Arc<Ledger>,
    stop: &CancellationToken,
) -> Result<(AppState, Running)> {
    let Parts {
        token,
        tokens,
        signing_key,
        topo,
        front_door,
        webhooks,
        retention_ms,
    } = p;
    topo.ensure(&broker).await?;
    let (admission, limits) = super::admission(&a.admission);
    let horizon_ms = limits.horizon_ms;
    let publisher = Publisher::new(&broker, Duration::from_millis(a.confirm_timeout_ms)).await?;
    let shedder = shedder(s, a, &topo, &ledger, &publisher);
    let submitter = Submitter::new(
        publisher,
        topo.names.clone(),
        Some(ledger.clone()),
        admission,
        limits,
    )
    .with_signing_key(signing_key.clone())
    .with_shedder(shedder);
    let clock = Arc::new(SystemClock::default());
    let mut state = AppState::new(
        submitter,
        ledger.clone(),
        clock.clone(),
        token,
        topo.names.clone(),
    );
    state.max_body_bytes = a.max_body_bytes;
    state.max_wait_ms = a.max_wait_ms;
    state.waiting = std::sync::Arc::new(tokio::sync::Semaphore::new(a.max_waiting));
    state.streams = std::sync::Arc::new(tokio::sync::Semaphore::new(a.max_streams));
    state.body_read_timeout = std::time::Duration::from_millis(a.body_read_timeout_ms);
    state.front_door = front_door;
    state.webhooks = webhooks;
    state.tokens = tokens;
    state.retention_ms = retention_ms;
    // The served OpenAPI document states this server's own horizon.
    state.horizon_ms = horizon_ms;
    state.claim_wait = Duration::from_millis(a.confirm_timeout_ms.saturating_add(1_000));
    state.worker_metrics = a.worker_metrics.clone();
    let management = (!a.no_management).then(|| management_api(s, a));
    // The broker's resource alarms, read every 2 s: `/readyz` reports one before any
    // publish is blocked (RabbitMQ 3.10 tells a connection only when it publishes).
    state.alarms = management
        .clone()
        .map(|m| lastcall_broker::management::AlarmWatch::spawn(m, Duration::from_secs(2)));
    state.depth = Some(DepthProbe::new(
        queues(&topo),
        management,
        Some(broker.clone()),
    ));
    // The ledger's size on /metrics, read every minute (the workers prune, serve does not).
    let gauges = Arc::new(super::ledger::LedgerGauges::size_only());
    state.metrics = std::mem::take(&mut state.metrics)
        .with_collector(super::ledger::LedgerCollector(gauges.clone()));
    super::ledger::spawn_size_gauges(ledger.clone(), gauges, stop.clone());
    let mut dlq_task = None;
    if a.dlq {
        let dlq = DeadLetterProcessor::build(
            super::connect_broker(s).await?,
            ledger.clone(),
            topo.clone(),
            clock.clone(),
            false,
        )
        .await
        .map_err(anyhow::Error::msg)?
        .with_signing_key(signing_key);
        let dlq_metrics = DlqCollector(dlq.stats.clone());
        state.metrics = std::mem::take(&mut state.metrics)
            .with_ready({
                let m = dlq_metrics.clone();
                move || m.readiness()
            })
            .with_collector(dlq_metrics);
        let stop2 = stop.clone();
        dlq_task = Some(tokio::spawn(async move { dlq.run(stop2, None).await }));
    }
    // `DELETE /v1/jobs/{id}` announces cancellations (best-effort, own connections).
    state.events = lastcall_broker::EventSink::spawn(&broker, &topo.names.events_exchange);
    state.control = lastcall_broker::EventSink::spawn(&broker, &topo.names.control_exchange);
    // Long-polls wake on the outcome events of `{prefix}.events`: one follower per process.
    // Webhooks are delivered from the same events.
    let waiters = state.waiters.clone();
    let webhooks = state.webhooks.enabled().then(|| {
        lastcall_http::webhooks::Webhooks::spawn(
            state.webhooks.clone(),
            ledger.clone(),
            clock.clone(),
            format!("serve:{}", lastcall_worker::runtime::default_worker_name()),
        )
    });
    let follower = match &a.events_amqp_url {
        Some(url) => super::connect_events_broker(url).await?,
        None => broker.clone(),
    };
    let events_task = waiters.follow(
        follower,
        topo.names.events_exchange.clone(),
        stop.clone(),
        move |body| {
            if let Some(w) = &webhooks {
                w.on_event(body);
            }
        },
    );
    Ok((
        state,
        Running {
            broker,
            ledger,
            dlq_task,
            events_task,
        },
    ))
}

/// Shedding at the door (`429 would_expire_in_queue`) from the work queue's numbers in the
/// management API; off with `--no-shed` or `--no-management`. An unreachable API admits.
/// Each kind's call time comes from the ledger the workers record to.
fn shedder(
    s: &Settings,
    a: &ServeArgs,
    topo: &Topology,
    ledger: &Arc<Ledger>,
    publisher: &Publisher,
) -> Option<Arc<Shedder>> {
    if a.no_shed || a.no_management {
        tracing::info!("shedding at the door is off");
        return None;
    }
    Some(Arc::new(
        Shedder::new(management_api(s, a), topo.names.work_queue.clone())
            .with_ledger(Some(ledger.clone()))
            .with_lane_queues(topo.names.lane_queues())
            .with_live_depth(publisher.clone()),
    ))
}

/// The broker's management API as `serve --management-url/--management-user` name it
/// (password: `LASTCALL_MANAGEMENT_PASSWORD`, default guest).
fn management_api(s: &Settings, a: &ServeArgs) -> Management {
    management_at(s, &a.management_url, &a.management_user)
}

/// The management API at `base_url`, logged in as `user` (password:
/// `LASTCALL_MANAGEMENT_PASSWORD`, default guest), for the AMQP URL's vhost.
fn management_at(s: &Settings, base_url: &str, user: &str) -> Management {
    let password = std::env::var("LASTCALL_MANAGEMENT_PASSWORD").unwrap_or_else(|_| "guest".into());
    Management::from_amqp_url(&s.amqp_url, base_url).with_login(user, &password)
}

/// The topology's queues (a fixed, bounded list for the depth gauges).
fn queues(topo: &Topology) -> Vec<String> {
    let n = &topo.names;
    let mut q = vec![n.work_queue.clone(), n.dead_queue.clone()];
    q.extend(topo.retry_delays_ms.iter().map(|d| n.retry_queue(*d)));
    q
}

/// `lastcall worker --metrics-addr`, bound before the worker connects (a taken port is an
/// error at once): until [`install_worker_metrics`], it answers as a starting `serve` does
/// (`/healthz` 200, `/readyz` 503 naming the broker or the ledger it waits for).
pub async fn listen_worker_metrics(addr: SocketAddr) -> Result<Arc<Startup>> {
    let startup = Startup::new();
    let server = lastcall_http::listen(addr, startup.router(), CancellationToken::new(), None)
        .await
        .map_err(|e| {
            bind_error(
                e,
                &format!("cannot listen on --metrics-addr {addr}"),
                "--metrics-addr",
            )
        })?;
    tokio::spawn(async move {
        if let Ok(Err(e)) = server.task.await {
            tracing::error!(error = %e, "metrics endpoint stopped");
        }
    });
    eprintln!("lastcall worker: metrics on http://{addr}/metrics");
    Ok(startup)
}

/// `/metrics` with the worker's counters, gauges and histograms plus the depth of the
/// topology's queues, served from now on at the address [`listen_worker_metrics`] bound.
pub async fn install_worker_metrics(
    startup: &Startup,
    s: &Settings,
    topo: &Topology,
    stats: Arc<WorkerStats>,
    management: (&str, &str),
    ledger: super::ledger::LedgerCollector,
) -> Result<()> {
    let probe_broker = super::connect_broker(s).await?;
    let (base_url, user) = management;
    let management = management_at(s, base_url, user);
    let source = MetricsSource::default()
        .with_ready({
            let stats = stats.clone();
            move || stats.readiness()
        })
        .with_backends({
            let stats = stats.clone();
            move || stats.backends()
        })
        .with_collector(WorkerCollector(stats))
        .with_collector(ledger)
        .with_depth(DepthProbe::new(
            queues(topo),
            Some(management),
            Some(probe_broker),
        ));
    startup.ready(lastcall_http::metrics_app(source));
    Ok(())
}
