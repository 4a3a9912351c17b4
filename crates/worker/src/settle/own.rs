//! The door of the consumers that settle each delivery on their own channel, one at a
//! time: the retry relay ([`crate::relay`]) and the dead-letter processor
//! ([`crate::dlq`]). They share the job tasks' rule — **an ack comes after the durable
//! step** — but not their batching: their traffic is a trickle, and the dead-letter
//! processor runs in processes without a worker (`lastcall dlq`, `serve`).
//!
//! The rule is in the types: [`OwnDoor::ack`] takes a [`Durable`] proof, and only this
//! door makes one — a [`Written`] when the ledger write committed (retried until it does,
//! as [`crate::store_retry::until_stored`]), a [`Confirmed`] when the broker confirmed a
//! republish. A delivery without either can only be handed back or dead-lettered.

use crate::store_retry::{StoreHealth, until_stored};
use lastcall_broker::{Incoming, PublishError, PublishProps, Publisher};
use lastcall_store::{Ledger, OutcomeRecord};
use std::sync::Arc;
use tokio_util::sync::CancellationToken;

/// The delivery's ledger write committed.
#[derive(Debug)]
pub(crate) struct Written(());

/// The broker confirmed the delivery's republish.
#[derive(Debug)]
pub(crate) struct Confirmed(());

/// What an ack needs first: [`Written`] or [`Confirmed`], made only by [`OwnDoor`].
pub(crate) trait Durable: sealed::Sealed {}
impl Durable for Written {}
impl Durable for Confirmed {}
mod sealed {
    pub trait Sealed {}
    impl Sealed for super::Written {}
    impl Sealed for super::Confirmed {}
}

/// One consumer's door: its ledger writes (retried until durable, or until `stop`) and
/// its settlements.
#[derive(Debug)]
pub(crate) struct OwnDoor {
    ledger: Arc<Ledger>,
    health: StoreHealth,
    stop: CancellationToken,
}

impl OwnDoor {
    pub(crate) fn new(ledger: Arc<Ledger>, stop: CancellationToken) -> Self {
        Self {
            ledger,
            health: StoreHealth::default(),
            stop,
        }
    }

    /// [`Ledger::record_outcome`], retried until it commits: the proof and whether it
    /// wrote the job's terminal outcome. `None` when stopping first (the delivery must
    /// not be settled: the broker redelivers it).
    pub(crate) async fn record_outcome(&self, rec: &OutcomeRecord) -> Option<(Written, bool)> {
        self.written(|| self.ledger.record_outcome(rec)).await
    }

    /// [`Ledger::record_terminal`] (no attempt row needed; the first outcome wins),
    /// retried as [`Self::record_outcome`].
    pub(crate) async fn record_terminal(&self, rec: &OutcomeRecord) -> Option<(Written, bool)> {
        self.written(|| self.ledger.record_terminal(rec)).await
    }

    /// `write`, retried until it commits (or `stop`), with its proof.
    async fn written<F, Fut>(&self, write: F) -> Option<(Written, bool)>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<bool, lastcall_store::StoreError>>,
    {
        until_stored(&self.health, &self.stop, || {}, write)
            .await
            .map(|wrote| (Written(()), wrote))
    }

    /// Publish with confirm: the proof when the broker confirmed it.
    pub(crate) async fn publish(
        &self,
        publisher: &Publisher,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: &PublishProps,
    ) -> Result<Confirmed, PublishError> {
        publisher
            .publish(exchange, routing_key, body, props)
            .await
            .map(|()| Confirmed(()))
    }

    /// Ack the delivery after its durable step. A failed ack is logged: the broker
    /// redelivers the message, and its write is idempotent (the first outcome stays).
    pub(crate) async fn ack(&self, m: &Incoming, _after: impl Durable) {
        if let Err(e) = m.settler.ack().await {
            tracing::warn!(error = %e, "an ack failed after the durable step; the message will be seen again and recorded once");
        }
    }

    /// Hand the delivery back to its queue (requeue): nothing of it was made durable, or
    /// a step after the write failed.
    pub(crate) async fn hand_back(&self, m: &Incoming) {
        if let Err(e) = m.settler.requeue().await {
            tracing::warn!(error = %e, "handing a delivery back failed; the broker redelivers it when the channel closes");
        }
    }

    /// Reject the delivery to its queue's dead-letter exchange (a body that cannot be
    /// handled here; the dead-letter processor records it).
    pub(crate) async fn dead_letter(&self, m: &Incoming) {
        if let Err(e) = m.settler.dead_letter().await {
            tracing::warn!(error = %e, "dead-lettering a delivery failed; the broker redelivers it when the channel closes");
        }
    }
}
