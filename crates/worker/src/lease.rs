//! The holds that keep a redelivered job from running twice: its call still runs in this
//! process (after a reconnect), or on another live worker (whose lease is fresh).
//!
//! The rule is the core's ([`lastcall_core::lease`]): each worker renews a lease row
//! (`workers`, one per worker) every `LEASE_RENEW_MS`; a redelivery whose job has a
//! `running` attempt under another worker with a fresh lease waits, without a slot, until
//! that attempt settles. A worker whose lease expired is presumed dead.

use crate::clock::Clock;
use crate::ctx::Ctx;
use crate::stats::WorkerStats;
use lastcall_backend::CancellationToken;
use lastcall_core::service_time::Predictor;
use lastcall_store::Ledger;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

/// How often a worker renews its lease in the ledger.
pub(crate) const LEASE_RENEW: Duration =
    Duration::from_millis(lastcall_core::lease::LEASE_RENEW_MS);

/// Why a hold ended early.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Interrupted {
    Shutdown,
    ChannelLost,
}

/// Renew the lease of the worker `name` until `stop` fires (one row per worker, not per
/// job), with its live numbers ([`WorkerStats::live`]) and its call models of the kinds it
/// publishes a call time of (`models`, [`crate::times::CallTimes::call_models`]).
pub(crate) async fn renew(
    ledger: Arc<Ledger>,
    name: String,
    clock: Arc<dyn Clock>,
    stats: Arc<WorkerStats>,
    models: impl Fn(&[String], i64) -> BTreeMap<String, Predictor> + Send + 'static,
    stop: CancellationToken,
) {
    let mut failing = false;
    loop {
        // The live numbers ride along: `serve`'s dashboard reads them here, the peers
        // the call models.
        let now = clock.now_ms();
        let mut live = stats.live();
        let kinds: Vec<String> = live.learned_call_ms.keys().cloned().collect();
        live.call_models = models(&kinds, now);
        let live = live.to_json();
        // The fleet's leases: where a job this worker cannot start in time could go (a job
        // refused for this worker's backlog alone is then handed back, once).
        let peers = (ledger
            .worker_leases(lastcall_core::lease::fresh_since(now))
            .await)
            .unwrap_or_default();
        *stats.peers.lock().unwrap_or_else(|e| e.into_inner()) = peers;
        match ledger.heartbeat_live(&name, now, &live).await {
            Ok(()) if failing => {
                failing = false;
                tracing::info!("worker lease renewed again");
            }
            Ok(()) => {}
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "cannot renew the worker lease; other workers may run this worker's jobs again once it expires");
            }
            Err(_) => {}
        }
        tokio::select! {
            _ = tokio::time::sleep(LEASE_RENEW) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// While another live worker runs a call of `id`, wait (polling the ledger). `Ok(true)`:
/// it did and has settled now (read the ledger again); `Ok(false)`: nothing ran elsewhere.
pub(crate) async fn hold_while_running_elsewhere(
    ctx: &Ctx,
    id: &str,
    lost: &CancellationToken,
) -> Result<bool, Interrupted> {
    let mut waited = false;
    loop {
        let fresh_since = lastcall_core::lease::fresh_since(ctx.clock.now_ms());
        let live = match (ctx.ledger)
            .live_attempt_elsewhere(id, &ctx.cfg.name, fresh_since)
            .await
        {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read worker leases; not holding the job");
                None
            }
        };
        let Some(worker) = live else {
            return Ok(waited);
        };
        if !waited {
            tracing::info!(%worker, "a call of this job still runs on another live worker: holding the redelivery until it settles");
            waited = true;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = ctx.shutdown.cancelled() => return Err(Interrupted::Shutdown),
            _ = lost.cancelled() => return Err(Interrupted::ChannelLost),
        }
    }
}

/// Wait until no call of `id` runs in this process (a redelivery of a job whose call
/// still runs here: its first delivery's channel was lost).
pub(crate) async fn hold_while_running_here(
    ctx: &Ctx,
    id: &str,
    lost: &CancellationToken,
) -> Result<(), Interrupted> {
    while let Some(mut rx) = ctx.held.running(id) {
        tracing::info!(
            "redelivery of a job whose model call still runs here: holding it until that call settles"
        );
        tokio::select! {
            _ = rx.changed() => {} // the sender is dropped when the call has settled
            _ = ctx.shutdown.cancelled() => return Err(Interrupted::Shutdown),
            _ = lost.cancelled() => return Err(Interrupted::ChannelLost),
        }
    }
    Ok(())
}
