//! The tasks that run beside a worker's generations for its whole life: the lease, the
//! `/readyz` mirrors of the ledger's health and of the retry publisher's connection, and
//! the cancellation follower. Each takes what it uses, not the worker's `Ctx`.

use crate::ctx::Ctx;
use crate::held::Held;
use lastcall_backend::CancellationToken;
use lastcall_broker::Broker;
use lastcall_store::Ledger;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::task::JoinHandle;

/// The tasks that run beside the generations for the whole life of a worker.
pub(crate) struct Sidecars {
    stop: CancellationToken,
    lease: JoinHandle<()>,
    mirror: JoinHandle<()>,
    /// Mirrors the retry publisher's connection into the stats.
    publisher: JoinHandle<()>,
    control: JoinHandle<()>,
    checker: JoinHandle<()>,
    /// Writes the breakers' openings and closings to the ledger, for the door.
    breakers: JoinHandle<()>,
}

/// Cancellation broadcasts waiting for their ledger check, at most.
const CONTROL_QUEUE: usize = 1_024;

/// How often the cancellation checker also reads the ledger for every job held here: the
/// backstop for a broadcast that never arrived (the follower was reconnecting, or not yet
/// subscribed when the request came).
const CANCEL_SWEEP: std::time::Duration = std::time::Duration::from_secs(2);

/// Check each cancellation broadcast against the ledger, in the order they came: a job held
/// here (waiting for a slot or running) is stopped only if its ledger row has
/// `cancel_requested`. A broadcast for a job not held here costs nothing; a forged one for a
/// job held here costs one ledger read and changes nothing. A ledger that cannot answer
/// leaves the job running (as a lost broadcast would): its outcome stands.
///
/// Every [`CANCEL_SWEEP`] it also reads the flags of all the jobs held here in one query,
/// so a request whose broadcast was lost still stops its job within that period.
async fn check_cancels(
    ledger: Arc<Ledger>,
    held: Arc<Held>,
    mut requests: tokio::sync::mpsc::Receiver<String>,
) {
    let mut sweep = tokio::time::interval(CANCEL_SWEEP);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            next = requests.recv() => {
                let Some(job_id) = next else { return };
                check_one(&ledger, &held, &job_id).await;
            }
            _ = sweep.tick() => sweep_held(&ledger, &held).await,
        }
    }
}

async fn check_one(ledger: &Ledger, held: &Held, job_id: &str) {
    if !held.holds(job_id) {
        return;
    }
    match ledger.get(job_id).await {
        Ok(Some(rec)) if rec.cancel_requested => held.cancel_local(job_id),
        Ok(_) => tracing::warn!(
            job_id = %job_id.escape_debug(),
            "a cancellation broadcast for a job the ledger holds no cancellation request for: ignored"
        ),
        Err(e) => tracing::warn!(
            job_id = %job_id.escape_debug(),
            error = %e,
            "cannot read the ledger to check a cancellation broadcast: the job goes on"
        ),
    }
}

async fn sweep_held(ledger: &Ledger, held: &Held) {
    let ids = held.held_ids();
    if ids.is_empty() {
        return;
    }
    match ledger.receipt_info_many(&ids).await {
        Ok(found) => {
            for (job_id, info) in found {
                if info.cancel_requested {
                    held.cancel_local(&job_id);
                } else if info.already_recorded {
                    // Recorded while held here: cancelled before its start (the receipt
                    // flags hide a terminal row's request), so it must leave the buffer
                    // now, not run at its slot. Rare: one more read.
                    if let Ok(Some(rec)) = ledger.get(&job_id).await
                        && rec.cancel_requested
                    {
                        held.cancel_local(&job_id);
                    }
                }
            }
        }
        Err(e) => {
            tracing::debug!(error = %e, "cannot read the ledger's cancellation flags; next sweep")
        }
    }
}

impl Sidecars {
    /// The lease, the `/readyz` ledger mirror, the cancellation follower and the breakers'
    /// ledger writer.
    pub(crate) fn start(ctx: &Arc<Ctx>, broker: &Broker) -> Self {
        let stop = CancellationToken::new();
        let lease = tokio::spawn(crate::lease::renew(
            ctx.ledger.clone(),
            ctx.cfg.name.clone(),
            ctx.clock.clone(),
            ctx.stats.clone(),
            {
                let ctx = ctx.clone();
                move |kinds: &[String], now| ctx.times.call_models(kinds.iter(), now)
            },
            stop.clone(),
        ));
        // The retry publisher's connection (replaced on reconnect), for `/readyz`.
        let publisher = {
            let (publisher, stats, stop) = (ctx.publisher.clone(), ctx.stats.clone(), stop.clone());
            tokio::spawn(async move {
                loop {
                    let connected = publisher.get().is_connected().await;
                    (stats.retry_publisher_connected).store(connected, Ordering::Relaxed);
                    tokio::select! {
                        _ = tokio::time::sleep(crate::lease::LEASE_RENEW) => {}
                        _ = stop.cancelled() => return,
                    }
                }
            })
        };
        // `/readyz`'s ledger check follows every write's result at once, also while the
        // receive loop waits for a delivery (a full buffer of jobs whose writes fail).
        let mirror = {
            let (mut health, stats) = (ctx.health.subscribe(), ctx.stats.clone());
            tokio::spawn(async move {
                while health.changed().await.is_ok() {
                    let healthy = *health.borrow_and_update();
                    stats.ledger_healthy.store(healthy, Ordering::Relaxed);
                }
            })
        };
        // Cancellation broadcasts (`{prefix}.control`), on a connection of their own. A
        // broadcast is only a wake-up: anyone who may publish there could send one, so a
        // cancellation takes effect only when the ledger says it was requested
        // (`Ledger::cancel` sets `cancel_requested`, and only the authenticated paths call
        // it: `DELETE /v1/jobs/{id}`, `lastcall cancel`). One task checks them in order.
        let (wake, requests) = tokio::sync::mpsc::channel(CONTROL_QUEUE);
        let checker = tokio::spawn(check_cancels(
            ctx.ledger.clone(),
            ctx.held.clone(),
            requests,
        ));
        let control = tokio::spawn(lastcall_broker::events::follow_control(
            broker.clone(),
            ctx.cfg.topology.names.control_exchange.clone(),
            stop.clone(),
            move |_, body| {
                if let Some(m) = lastcall_core::event::ControlMessage::from_json(body)
                    && wake.try_send(m.cancel).is_err()
                {
                    tracing::warn!(
                        "{CONTROL_QUEUE} cancellation broadcasts wait for their ledger check; one is dropped"
                    );
                }
            },
            |_| {},
        ));
        let breakers = tokio::spawn(crate::breakers::record(
            ctx.breakers.clone(),
            ctx.ledger.clone(),
            ctx.cfg.name.clone(),
        ));
        Self {
            stop,
            lease,
            mirror,
            publisher,
            control,
            checker,
            breakers,
        }
    }

    /// The worker could not start: stop at once.
    pub(crate) fn abort(self) {
        self.stop.cancel();
        self.mirror.abort();
        self.publisher.abort();
        self.checker.abort();
        self.breakers.abort();
    }

    pub(crate) async fn stop(self) {
        self.stop.cancel();
        self.mirror.abort();
        self.publisher.abort();
        let _ = self.lease.await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.control).await;
        self.checker.abort();
        self.breakers.abort();
    }
}
