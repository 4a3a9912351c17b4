//! `lastcall worker`.

use crate::cli::{BackendKind, ExpiredActionArg, OpenAiArgs, SimArgs, WorkerArgs};
use crate::config::Settings;
use anyhow::{Context, Result, bail};
use lastcall_backend::Backend;
use lastcall_backend::route::RoutedBackend;
use lastcall_backend::sim::{SimBackend, SimConfig};
use lastcall_clock::{ClockSyncMode, SystemClock};
use lastcall_core::concurrency::SlotCount;
use lastcall_core::{ExpiredAction, RetryPolicy, WorkerPolicy};
use lastcall_openai::{OpenAiBackend, OpenAiConfig};
use lastcall_worker::{Worker, WorkerConfig, WorkerStats};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// `retention`: the `[ledger]` section's settings, for the background pruning
/// (`--prune-every`).
pub async fn run(
    s: &Settings,
    a: WorkerArgs,
    #[allow(unused_mut)] mut retention: super::ledger::Policy,
) -> Result<ExitCode> {
    let cfg = config(s, &a)?;
    lastcall_worker::with_test_hooks!({
        if let Some(ms) = a.hooks.test_retention {
            retention.retention_ms = Some(ms);
        }
        if let Some(ms) = a.hooks.test_text_retention {
            retention.text_retention_ms = Some(ms);
        }
    } else {});
    let backend = backend(s, &a).await?;
    let stop = CancellationToken::new();
    let stop2 = stop.clone();
    tokio::spawn(async move {
        super::shutdown_signal().await;
        tracing::info!("shutdown signal received: draining");
        eprintln!("lastcall worker: shutting down (in-flight work gets the grace period)");
        stop2.cancel();
    });
    // The metrics address answers (not ready) while the worker waits for its broker.
    let metrics = match a.metrics_addr {
        Some(addr) => Some(super::serve::listen_worker_metrics(addr).await?),
        None => None,
    };
    // A broker or a ledger that is down at startup is waited for (with backoff), like one
    // that goes away later; --connect-timeout bounds each wait.
    let connect_timeout = a.connect_timeout_ms.map(Duration::from_millis);
    let Some((broker, ledger)) =
        super::connect_waiting(s, &stop, connect_timeout, metrics.as_deref()).await?
    else {
        return Ok(ExitCode::SUCCESS);
    };
    let clock = Arc::new(SystemClock {
        offset_ms: lastcall_worker::with_test_hooks!({ a.hooks.clock_offset_ms } else { 0 }),
    });
    let stats = Arc::new(WorkerStats::default());
    let gauges = Arc::new(super::ledger::LedgerGauges::default());
    if let Some(startup) = &metrics {
        let management = (a.management_url.as_str(), a.management_user.as_str());
        super::serve::install_worker_metrics(
            startup,
            s,
            &cfg.topology,
            stats.clone(),
            management,
            super::ledger::LedgerCollector(gauges.clone()),
        )
        .await?;
    }
    // The background pruning (and the ledger's size for /metrics): it stops with the worker.
    let pruner_stop = stop.child_token();
    let pruner = super::ledger::spawn_background(
        ledger.clone(),
        retention,
        a.prune_every
            .0
            .map(|ms| Duration::from_millis(ms.unsigned_abs())),
        clock.clone(),
        gauges,
        pruner_stop.clone(),
    );
    let worker = Worker::build(cfg, broker, ledger.clone(), backend, clock, stats).await;
    let ran = match worker {
        Ok(w) => w.run(stop).await.map_err(anyhow::Error::from),
        Err(e) => Err(e.into()),
    };
    pruner_stop.cancel();
    let _ = pruner.await;
    ran?;
    ledger.close().await;
    Ok(ExitCode::SUCCESS)
}

/// Build the backend the flags ask for.
pub async fn backend(s: &Settings, a: &WorkerArgs) -> Result<Arc<dyn Backend>> {
    let kind = match a.backend {
        Some(k) => k,
        None if cfg!(feature = "local-model") => BackendKind::Local,
        None => bail!(
            "no model backend: give --backend local (the embedded SmolLM2; this build lacks the \
             `local-model` feature), openai (an OpenAI-compatible server: --base-url), routed \
             (the [routing] table of lastcall.toml) or sim (a simulated model for tests and \
             benchmarks)"
        ),
    };
    let (model, detail) = match kind {
        BackendKind::Sim => (
            "simulated".to_owned(),
            "load generator, not a model".to_owned(),
        ),
        BackendKind::Openai => (a.openai.model.clone(), a.openai.base_url.clone()),
        BackendKind::Local => ("SmolLM2-135M".to_owned(), "embedded, CPU".to_owned()),
        BackendKind::Routed => ("per kind".to_owned(), "[routing] table".to_owned()),
    };
    tracing::info!(backend = ?kind, model = %model, detail = %detail, "model backend");
    // Said without -v too: which model answers is the first thing to know about a worker.
    eprintln!("lastcall worker: backend {kind:?} · model {model} ({detail})");
    Ok(match kind {
        BackendKind::Sim => Arc::new(sim(&a.sim)?),
        BackendKind::Openai => Arc::new(openai(&a.openai)?),
        BackendKind::Local => local(a.model_path.as_deref(), local_slots(a))?,
        BackendKind::Routed => {
            let Some(routing) = s.routing.clone() else {
                bail!(
                    "--backend routed needs a [routing] table in lastcall.toml (see the README's backend section)"
                );
            };
            routing
                .check_names()
                .map_err(anyhow::Error::msg)
                .context("invalid [routing] table in lastcall.toml")?;
            let table = routing.table;
            let mut backends: Vec<(String, Arc<dyn Backend>)> = vec![
                ("sim".into(), Arc::new(sim(&a.sim)?)),
                ("openai".into(), Arc::new(openai(&a.openai)?)),
            ];
            for (name, b) in &routing.backends {
                let backend = named_openai(b)
                    .with_context(|| format!("[routing.backends.{name}] in lastcall.toml"))?;
                backends.push((name.clone(), Arc::new(backend)));
            }
            if table.uses("local") {
                backends.push((
                    "local".into(),
                    local(a.model_path.as_deref(), local_slots(a))?,
                ));
            }
            Arc::new(
                RoutedBackend::new(table, backends)
                    .context("invalid [routing] table in lastcall.toml")?,
            )
        }
    })
}

/// The embedded model: one instance per slot so that no call queues after admission, all on
/// one copy of the weights (an extra slot costs its KV cache, not another model).
#[cfg(feature = "local-model")]
pub fn local(path: Option<&std::path::Path>, slots: usize) -> Result<Arc<dyn Backend>> {
    let pool = lastcall_local::LocalPool::load_or_find(path, slots).map_err(anyhow::Error::msg)?;
    Ok(Arc::new(pool))
}

#[cfg(not(feature = "local-model"))]
pub fn local(_: Option<&std::path::Path>, _: usize) -> Result<Arc<dyn Backend>> {
    bail!(
        "this lastcall was built without the `local-model` feature; rebuild with default features"
    )
}

/// The OpenAI-compatible backend from its flags; the key comes from the environment or a file.
pub fn openai(a: &OpenAiArgs) -> Result<OpenAiBackend> {
    let mut cfg = OpenAiConfig::new(a.base_url.clone(), a.model.clone())
        .with_max_tokens(a.max_tokens)
        .with_max_tokens_limit(a.max_tokens_limit)
        .with_send_priority(a.send_priority)
        .with_budget_header(a.budget_header.clone());
    if let Some(path) = &a.api_key_file {
        cfg = cfg.api_key_from_file(path)?;
    } else if std::env::var_os(&a.api_key_env).is_some() {
        cfg = cfg.api_key_from_env(&a.api_key_env)?;
    }
    Ok(OpenAiBackend::new(cfg)?)
}

/// A `[routing.backends.NAME]` server: its key only from its own variable or file.
fn named_openai(b: &crate::config::NamedBackend) -> Result<OpenAiBackend> {
    let mut cfg = OpenAiConfig::new(b.base_url.clone(), b.model.clone())
        .with_send_priority(b.send_priority)
        .with_budget_header(b.budget_header.clone());
    if let Some(n) = b.max_tokens {
        cfg = cfg.with_max_tokens(n);
    }
    if let Some(n) = b.max_tokens_limit {
        cfg = cfg.with_max_tokens_limit(n);
    }
    if let Some(path) = &b.api_key_file {
        cfg = cfg.api_key_from_file(path)?;
    } else if let Some(var) = &b.api_key_env {
        cfg = cfg.api_key_from_env(var)?;
    }
    Ok(OpenAiBackend::new(cfg)?)
}

pub fn sim(a: &SimArgs) -> Result<SimBackend> {
    if !(0.0..=1.0).contains(&a.sim_fail_rate) {
        bail!(
            "--sim-fail-rate must be between 0 and 1, got {}",
            a.sim_fail_rate
        );
    }
    Ok(SimBackend::new(SimConfig {
        latency_ms: a.sim_latency_ms,
        jitter_ms: a.sim_jitter_ms,
        fail_rate: a.sim_fail_rate,
        call_log: a.sim_call_log.clone(),
        faults: a.sim_faults,
    })?)
}

/// The broker's consumer timeout as the operator stated it (`0`: off), with a warning when
/// the horizon (the longest deadline accepted) exceeds it.
fn consumer_timeout(stated_ms: Option<u64>, horizon_ms: i64) -> Option<Duration> {
    match stated_ms.filter(|&ms| ms > 0) {
        Some(ct) => {
            let cap = ct - lastcall_core::ack_window::margin_ms(ct).min(ct);
            if horizon_ms > ct as i64 {
                tracing::warn!(
                    horizon_ms,
                    consumer_timeout_ms = ct,
                    "--horizon-ms exceeds the broker's consumer_timeout"
                );
                eprintln!(
                    "lastcall worker: warning: --horizon-ms {horizon_ms} exceeds the broker's consumer_timeout ({ct} ms): model calls are cut {cap} ms after delivery at the latest (recorded failed/consumer_timeout)"
                );
            }
            tracing::info!(
                consumer_timeout_ms = ct,
                call_cap_ms = cap,
                "broker consumer_timeout known: model calls end inside the ack window"
            );
            Some(Duration::from_millis(ct))
        }
        None => {
            tracing::info!(
                "broker consumer_timeout unknown (RabbitMQ's default is 30 min; --consumer-timeout-ms states it): a call that outlives it makes the broker close the channel, which the worker survives like any lost channel"
            );
            None
        }
    }
}

pub fn config(s: &Settings, a: &WorkerArgs) -> Result<WorkerConfig> {
    let (admission, limits) = super::admission(&a.admission);
    let mut cfg = match a.slot_count() {
        SlotCount::Fixed(n) => WorkerConfig::new(&s.prefix, n),
        SlotCount::Auto => {
            if matches!(
                a.backend,
                None | Some(BackendKind::Local | BackendKind::Routed)
            ) {
                bail!(
                    "--slots auto needs a batching model server (--backend openai or sim): the \
                     local backend runs a fixed number of model copies; give --slots N"
                );
            }
            let max = usize::from(a.max_slots);
            let mut cfg = WorkerConfig::new(&s.prefix, max);
            cfg.auto_slots = Some(lastcall_core::concurrency::LimitConfig::new(max));
            cfg
        }
    };
    cfg.topology = super::topology(&s.prefix, &a.topology)?;
    if let Some(p) = a.prefetch {
        if p == 0 {
            bail!("--prefetch must be at least 1 (0 would mean unlimited at the broker)");
        }
        cfg.prefetch = p;
    }
    if let Some(n) = &a.name {
        cfg.name = n.clone();
    }
    cfg.max_buffer_bytes = a.max_buffer_bytes;
    cfg.buffer_order = a.buffer_order.into();
    cfg.tenant_weights = tenant_weights(a)?;
    cfg.signing_key = super::submit::signing_key(a.signing_key_file.as_deref())?;
    if cfg.signing_key.is_some() {
        tracing::info!(
            "signed jobs required: a missing or wrong x-lastcall-signature is rejected (bad_signature)"
        );
    }
    cfg.shutdown_grace = Duration::from_millis(a.shutdown_grace_ms);
    cfg.consumer_timeout = consumer_timeout(a.consumer_timeout_ms, limits.horizon_ms);
    cfg.breaker = lastcall_core::breaker::BreakerPolicy {
        failures_to_open: a.breaker_failures,
        cool_down_ms: a.breaker_cool_down_ms,
        max_cool_down_ms: a.breaker_max_cool_down_ms.max(a.breaker_cool_down_ms),
        ..Default::default()
    };
    cfg.rate_limits = a.rate_limit.iter().cloned().collect();
    cfg.allowed_models =
        lastcall_core::model_choice::AllowedModels::new(a.allow_model.iter().cloned())
            .map_err(|e| anyhow::anyhow!("--allow-model: {e}"))?;
    if !cfg.allowed_models.is_empty() {
        let names: Vec<&str> = cfg.allowed_models.names().collect();
        tracing::info!(models = ?names, "a payload's `model` may name these models");
    }
    for (backend, l) in &cfg.rate_limits {
        tracing::info!(backend = %backend, rpm = l.requests_per_minute, tpm = l.tokens_per_minute, "rate limits configured");
    }
    cfg.clock_sync = a
        .clock_sync
        .parse::<ClockSyncMode>()
        .map_err(anyhow::Error::msg)?;
    lastcall_worker::with_test_hooks!({
        cfg.fault = match a.hooks.fault.as_deref() {
            None => None,
            Some("pause-after-store") => Some(lastcall_worker::Fault::PauseAfterStore),
            Some(other) => bail!("unknown --fault `{other}`"),
        };
    } else {
        let _ = &a.hooks;
    });
    let retry = RetryPolicy::new(
        a.max_attempts,
        cfg.topology.retry_delays_ms[0],
        cfg.topology.retry_delays_ms.clone(),
    )?;
    cfg.policy = WorkerPolicy {
        admission,
        limits,
        expired_action: match a.expired_action {
            ExpiredActionArg::Ack => ExpiredAction::Ack,
            ExpiredActionArg::DeadLetter => ExpiredAction::DeadLetter,
        },
        retry,
        max_starts: a.max_starts,
        refuse_on_expected_wait: !a.no_wait_refusal,
        // lastcall's deadline checks: the only ones a production worker runs.
        dispatch: Arc::new(lastcall_core::DeadlineChecks),
    };
    Ok(cfg)
}

/// The fair share's weights: the tokens file's, then `--tenant-weight` over them.
pub(crate) fn tenant_weights(a: &WorkerArgs) -> Result<Vec<(String, u32)>> {
    let mut weights = match &a.tokens_file {
        Some(path) => lastcall_http::tokens::TokensFile::load(path)?.weights(),
        None => std::collections::BTreeMap::new(),
    };
    for (tenant, w) in &a.tenant_weight {
        weights.insert(tenant.clone(), *w);
    }
    Ok(weights.into_iter().collect())
}

/// The local backend's model copies: its fixed slots (`--slots auto` is refused with it).
fn local_slots(a: &WorkerArgs) -> usize {
    match a.slot_count() {
        SlotCount::Fixed(n) => n,
        SlotCount::Auto => 2,
    }
}
