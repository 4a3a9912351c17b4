//! `lastcall dlq`: run the dead-letter processor.

use crate::cli::DlqArgs;
use crate::config::Settings;
use anyhow::{Context, Result, anyhow};
use lastcall_clock::SystemClock;
use lastcall_worker::dlq::DeadLetterProcessor;
use std::process::ExitCode;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub async fn run(s: &Settings, a: DlqArgs) -> Result<ExitCode> {
    let topology = super::topology(&s.prefix, &a.topology)?;
    let dead_queue = topology.names.dead_queue.clone();
    let stop = CancellationToken::new();
    let stop2 = stop.clone();
    tokio::spawn(async move {
        super::shutdown_signal().await;
        tracing::info!("shutdown signal received: stopping the dead-letter processor");
        stop2.cancel();
    });
    // Like a worker: a broker or ledger that is down at startup is waited for.
    let connect_timeout = a.connect_timeout_ms.map(Duration::from_millis);
    let Some((broker, ledger)) = super::connect_waiting(s, &stop, connect_timeout, None).await?
    else {
        return Ok(ExitCode::SUCCESS);
    };
    let dlq = DeadLetterProcessor::build(
        broker.clone(),
        ledger.clone(),
        topology,
        Arc::new(SystemClock::default()),
        a.park,
    )
    .await
    .map_err(|e| anyhow!(e))
    .context("cannot start the dead-letter processor")?
    .with_signing_key(super::submit::signing_key(a.signing_key_file.as_deref())?);
    let dlq = if a.split_by_reason {
        dlq.split_by_reason()
            .await
            .map_err(|e| anyhow!(e))
            .context("cannot declare the per-reason queues")?
    } else {
        dlq
    };
    let stats = dlq.stats.clone();
    tracing::info!(queue = %dead_queue, park = a.park, "dead-letter processor started");
    let result = dlq
        .run(stop, a.idle_exit_ms.map(Duration::from_millis))
        .await
        .map_err(|e| anyhow!(e))
        .with_context(|| format!("dead-letter processing of {dead_queue} stopped"));
    broker.close().await;
    ledger.close().await;
    result?;
    println!(
        "dead letters processed: {} (recorded: {}, outcome already present: {}, parked: {})",
        stats.processed.load(Ordering::Relaxed),
        stats.recorded.load(Ordering::Relaxed),
        stats.kept_existing.load(Ordering::Relaxed),
        stats.parked.load(Ordering::Relaxed),
    );
    Ok(ExitCode::SUCCESS)
}
