//! The one settlement door of the worker: every durable write a delivery needs, and every
//! ack, reject and requeue, goes through [`Door`] — or, for the consumers that settle one
//! delivery at a time on their own channel (the retry relay, the dead-letter processor),
//! through [`OwnDoor`] (`own.rs`), whose ack takes a proof of the durable step.
//!
//! The runtime calls [`Door::commit`] (retried until durable, or `None` at shutdown),
//! then exactly one of [`Door::ack`], [`Door::dead_letter`] or [`Door::hand_back`] with
//! the delivery's [`Ticket`]. Behind the door:
//! - `committer.rs`: group commit — the starts and outcomes of all job tasks go through
//!   one writer task, one transaction per batch (and batched receipt lookups);
//! - `ack_batch.rs`: coalesced acks over [`lastcall_core::ack_plan`], one per channel
//!   generation;
//! - `ack_log.rs`: the best-effort `acked_at_ms` marks, folded into the next group commit
//!   (the alarm and pipeline tests read them to prove the acks went out).
//!
//! **Invariant:** a ticket is acked only through [`Door::ack`], which the runtime calls
//! after [`Door::commit`] returned (or for a duplicate, whose outcome the ledger holds).

mod ack_batch;
mod ack_log;
mod committer;
mod own;

pub(crate) use ack_batch::{AckBatch, Ticket};
pub(crate) use own::OwnDoor;

use crate::clock::Clock;
use crate::stats::WorkerStats;
use crate::store_retry::{StoreHealth, until_stored};
use lastcall_store::{Ledger, LedgerWrite, ReceiptInfo};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Most starts and outcomes written in one group-commit transaction.
const GROUP_COMMIT_MAX: usize = 256;

/// The settlement door, shared by every job task of a worker.
pub(crate) struct Door {
    commits: committer::Committer,
    marks: ack_log::AckLog,
    health: StoreHealth,
    /// Fires on shutdown: store retries stop (nothing is acked without its write).
    shutdown: CancellationToken,
    stats: Arc<WorkerStats>,
    clock: Arc<dyn Clock>,
    /// Ends the acked-at trace writer once the last delivery is settled.
    marks_done: CancellationToken,
    marks_task: std::sync::Mutex<Option<JoinHandle<()>>>,
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Door").finish_non_exhaustive()
    }
}

impl Door {
    pub(crate) fn spawn(
        ledger: Arc<Ledger>,
        health: StoreHealth,
        shutdown: CancellationToken,
        stats: Arc<WorkerStats>,
        clock: Arc<dyn Clock>,
    ) -> Self {
        let marks = ack_log::AckLog::default();
        let marks_done = CancellationToken::new();
        let marks_task = marks.spawn_idle_writer(ledger.clone(), marks_done.clone());
        let commits = committer::Committer::spawn(ledger, GROUP_COMMIT_MAX, marks.clone());
        Self {
            commits,
            marks,
            health,
            shutdown,
            stats,
            clock,
            marks_done,
            marks_task: std::sync::Mutex::new(Some(marks_task)),
        }
    }

    /// Write one start or outcome durably (group commit), retried until it succeeds.
    /// `Some(true)`: it wrote the job's terminal outcome; `None`: the worker is shutting
    /// down and the write never committed (the delivery must not be settled).
    pub(crate) async fn commit(&self, write: LedgerWrite) -> Option<bool> {
        until_stored(
            &self.health,
            &self.shutdown,
            || WorkerStats::inc(&self.stats.store_retries),
            || self.commits.write(write.clone()),
        )
        .await
    }

    /// What the ledger knows of `job_id` (batched with other receipts), retried like a
    /// write; `None` at shutdown.
    pub(crate) async fn receipt_info(&self, job_id: &str) -> Option<ReceiptInfo> {
        until_stored(
            &self.health,
            &self.shutdown,
            || WorkerStats::inc(&self.stats.store_retries),
            || self.commits.receipt_info(job_id.to_owned()),
        )
        .await
    }

    /// The channel generation's ack batch and its flusher.
    pub(crate) fn open_generation(
        &self,
        generation: u64,
        lost: CancellationToken,
        stop: CancellationToken,
    ) -> (AckBatch, JoinHandle<()>) {
        let batch = AckBatch::new(generation, lost);
        let flusher = batch.spawn_flusher(
            self.stats.clone(),
            self.marks.clone(),
            self.clock.clone(),
            stop,
        );
        (batch, flusher)
    }

    /// Ack the delivery (coalesced). Call only after its durable write (or for a
    /// duplicate). On a lost channel the ack is dropped with its generation.
    pub(crate) fn ack(&self, ticket: Ticket) {
        ticket.done();
    }

    /// Reject the delivery to the dead-letter exchange, after its durable write.
    pub(crate) async fn dead_letter(&self, ticket: Ticket) {
        let key = ticket.attempt_key().to_owned();
        match ticket.dead_letter().await {
            Ok(()) => {
                WorkerStats::inc(&self.stats.settled);
                self.marks.record(key, self.clock.now_ms());
            }
            Err(e) => {
                tracing::warn!(error = %e, "settling failed after the durable write; the broker will redeliver and the duplicate is acked")
            }
        }
    }

    /// Hand the delivery back to the broker (requeue; nothing is sent on a lost channel).
    pub(crate) async fn hand_back(&self, ticket: Ticket) {
        ticket.requeue().await;
    }

    /// The last acked-at marks are written (bounded): call after the last ack flush.
    pub(crate) async fn close(&self) {
        self.marks_done.cancel();
        let task = self
            .marks_task
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(task) = task
            && tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
        {
            tracing::warn!("acked-at trace writes did not finish within 5 s");
        }
    }
}
