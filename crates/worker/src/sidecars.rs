//! The tasks that run beside a worker's generations for its whole life: the lease, the
//! `/readyz` ledger mirror and the cancellation follower.

use crate::ctx::Ctx;
use lastcall_backend::CancellationToken;
use lastcall_broker::Broker;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::task::JoinHandle;

/// The tasks that run beside the generations for the whole life of a worker.
pub(crate) struct Sidecars {
    stop: CancellationToken,
    lease: JoinHandle<()>,
    mirror: JoinHandle<()>,
    control: JoinHandle<()>,
}

impl Sidecars {
    /// The lease, the `/readyz` ledger mirror and the cancellation follower.
    pub(crate) fn start(ctx: &Arc<Ctx>, broker: &Broker) -> Self {
        let stop = CancellationToken::new();
        let lease = tokio::spawn(crate::lease::renew(ctx.clone(), stop.clone()));
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
        // Cancellation broadcasts (`{prefix}.control`), on a connection of their own.
        let ctx2 = ctx.clone();
        let control = tokio::spawn(lastcall_broker::events::follow_control(
            broker.clone(),
            ctx.cfg.topology.names.control_exchange.clone(),
            stop.clone(),
            move |_, body| {
                if let Some(m) = lastcall_core::event::ControlMessage::from_json(body) {
                    ctx2.cancel_local(&m.cancel);
                }
            },
            |_| {},
        ));
        Self {
            stop,
            lease,
            mirror,
            control,
        }
    }

    /// The worker could not start: stop at once.
    pub(crate) fn abort(self) {
        self.stop.cancel();
        self.mirror.abort();
    }

    pub(crate) async fn stop(self) {
        self.stop.cancel();
        self.mirror.abort();
        let _ = self.lease.await;
        let _ = tokio::time::timeout(Duration::from_secs(2), self.control).await;
    }
}
