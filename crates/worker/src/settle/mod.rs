//! The one settlement door of the worker: every durable write a delivery needs, every
//! confirmed publish a settlement rests on, and every ack, reject and requeue, goes through
//! [`Door`] — the job tasks' and the consumers' that settle one delivery at a time on their
//! own channel (the retry relay, the dead-letter processor).
//!
//! **Invariant, in the types:** [`Door::ack`] takes a [`Durable`] proof, and only the door
//! makes one: from a ledger write that committed ([`Door::commit`], retried until durable,
//! or `None` at shutdown), from a receipt that found the job's outcome already recorded
//! ([`Door::receipt_info`], a duplicate), or from a publish the broker confirmed
//! ([`Door::publish`]). A delivery without one can only be handed back
//! ([`Door::hand_back`]), dead-lettered ([`Door::dead_letter`]) or left to the broker.
//!
//! Two ways to write, one rule:
//! - [`Door::spawn`], the job tasks': `committer.rs`, group commit — the starts and
//!   outcomes of all job tasks go through one writer task, one transaction per batch (and
//!   batched receipt lookups); `ack_batch.rs`, coalesced acks over
//!   [`lastcall_core::ack_plan`], one per channel generation; `ack_log.rs`, the
//!   best-effort `acked_at_ms` marks, folded into the next group commit (the alarm and
//!   pipeline tests read them to prove the acks went out).
//! - [`Door::direct`], the relay's and the dead-letter processor's: their traffic is a
//!   trickle, and the dead-letter processor runs in processes without a worker (`lastcall
//!   dlq`, `serve`), so each write is its own transaction and each ack its own frame.

mod ack_batch;
mod ack_log;
mod committer;

pub(crate) use ack_batch::{AckBatch, Ticket};

use crate::clock::Clock;
use crate::stats::WorkerStats;
use crate::store_retry::{StoreHealth, until_stored};
use lastcall_broker::{Incoming, PublishError, PublishProps, Publisher};
use lastcall_store::{Ledger, LedgerWrite, ReceiptInfo, StoreError};
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Most starts and outcomes written in one group-commit transaction.
const GROUP_COMMIT_MAX: usize = 256;

/// What an ack needs first, made only by the [`Door`]: the delivery's ledger write
/// committed, its outcome was already recorded (a duplicate), or the broker confirmed its
/// republish.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Durable(());

/// A delivery to settle: a job task's [`Ticket`] (acked by its generation's flusher,
/// coalesced) or a delivery a consumer settles on its own (one frame each).
#[derive(Debug)]
pub(crate) enum Held<'a> {
    Job(Ticket),
    Own(&'a Incoming),
}

impl From<Ticket> for Held<'static> {
    fn from(t: Ticket) -> Self {
        Held::Job(t)
    }
}

impl<'a> From<&'a Incoming> for Held<'a> {
    fn from(m: &'a Incoming) -> Self {
        Held::Own(m)
    }
}

/// What the ledger knows of a job at its receipt, and the proof an ack of a duplicate
/// needs (its outcome is already durable).
#[derive(Debug)]
pub(crate) struct Receipt {
    pub(crate) info: ReceiptInfo,
    pub(crate) recorded: Option<Durable>,
}

/// The settlement door: shared by every job task of a worker ([`Door::spawn`]), or owned
/// by one consumer ([`Door::direct`]).
pub(crate) struct Door {
    writer: Writer,
    health: StoreHealth,
    /// Fires on shutdown: store retries stop (nothing is acked without its write).
    shutdown: CancellationToken,
    stats: Arc<WorkerStats>,
}

enum Writer {
    /// Group commit, coalesced acks and their acked-at marks.
    Group {
        commits: committer::Committer,
        marks: ack_log::AckLog,
        clock: Arc<dyn Clock>,
        /// Ends the acked-at trace writer once the last delivery is settled.
        marks_done: CancellationToken,
        marks_task: std::sync::Mutex<Option<JoinHandle<()>>>,
    },
    /// Each write its own transaction.
    Direct(Arc<Ledger>),
}

impl std::fmt::Debug for Door {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Door").finish_non_exhaustive()
    }
}

impl Door {
    /// The job tasks' door: group commit and coalesced acks.
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
            writer: Writer::Group {
                commits,
                marks,
                clock,
                marks_done,
                marks_task: std::sync::Mutex::new(Some(marks_task)),
            },
            health,
            shutdown,
            stats,
        }
    }

    /// A consumer's own door (the retry relay, the dead-letter processor): each write its
    /// own transaction, retried until it commits or `stop` fires.
    pub(crate) fn direct(ledger: Arc<Ledger>, stop: CancellationToken) -> Self {
        Self {
            writer: Writer::Direct(ledger),
            health: StoreHealth::default(),
            shutdown: stop,
            stats: Arc::default(),
        }
    }

    /// Write one start or outcome durably, retried until it succeeds: the proof, and
    /// whether it wrote the job's terminal outcome. `None`: the worker is shutting down
    /// and the write never committed (the delivery must not be settled: the broker
    /// redelivers it).
    pub(crate) async fn commit(&self, write: LedgerWrite) -> Option<(Durable, bool)> {
        self.until_stored(|| async {
            match &self.writer {
                Writer::Group { commits, .. } => commits.write(write.clone()).await,
                Writer::Direct(ledger) => ledger
                    .write_batch(std::slice::from_ref(&write))
                    .await
                    .map(|w| w[0]),
            }
        })
        .await
        .map(|wrote| (Durable(()), wrote))
    }

    /// What the ledger knows of `job_id` (batched with other receipts), retried like a
    /// write; `None` at shutdown. A job whose outcome is recorded comes with the proof
    /// that acks its duplicate delivery.
    pub(crate) async fn receipt_info(&self, job_id: &str) -> Option<Receipt> {
        let info = self
            .until_stored(|| async {
                match &self.writer {
                    Writer::Group { commits, .. } => commits.receipt_info(job_id.to_owned()).await,
                    Writer::Direct(ledger) => ledger.receipt_info(job_id).await,
                }
            })
            .await?;
        let recorded = info.already_recorded.then_some(Durable(()));
        Some(Receipt { info, recorded })
    }

    async fn until_stored<T, F, Fut>(&self, op: F) -> Option<T>
    where
        F: FnMut() -> Fut,
        Fut: std::future::Future<Output = Result<T, StoreError>>,
    {
        until_stored(
            &self.health,
            &self.shutdown,
            || WorkerStats::inc(&self.stats.store_retries),
            op,
        )
        .await
    }

    /// Publish with confirm: the proof when the broker confirmed it.
    pub(crate) async fn publish(
        &self,
        publisher: &Publisher,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: &PublishProps,
    ) -> Result<Durable, PublishError> {
        publisher
            .publish(exchange, routing_key, body, props)
            .await
            .map(|()| Durable(()))
    }

    /// The channel generation's ack batch and its flusher (the job tasks' door).
    pub(crate) fn open_generation(
        &self,
        generation: u64,
        lost: CancellationToken,
        stop: CancellationToken,
    ) -> (AckBatch, JoinHandle<()>) {
        let batch = AckBatch::new(generation, lost);
        let marks = match &self.writer {
            Writer::Group { marks, clock, .. } => Some((marks.clone(), clock.clone())),
            Writer::Direct(_) => None,
        };
        let flusher = batch.spawn_flusher(self.stats.clone(), marks, stop);
        (batch, flusher)
    }

    /// Ack the delivery, after its durable step: a job task's coalesced with others by
    /// its generation's flusher (dropped with its generation on a lost channel), a
    /// consumer's own at once. A failed ack is logged: the broker redelivers the message,
    /// and its write is idempotent (the first outcome stays).
    pub(crate) async fn ack<'a>(&self, held: impl Into<Held<'a>>, _after: Durable) {
        match held.into() {
            Held::Job(ticket) => ticket.done(),
            Held::Own(m) => {
                if let Err(e) = m.settler.ack().await {
                    tracing::warn!(error = %e, "an ack failed after the durable step; the message will be seen again and recorded once");
                } else {
                    WorkerStats::inc(&self.stats.settled);
                }
            }
        }
    }

    /// Reject the delivery to its queue's dead-letter exchange: a job task's after its
    /// durable write, a consumer's for a body it cannot handle (the dead-letter processor
    /// records it).
    pub(crate) async fn dead_letter<'a>(&self, held: impl Into<Held<'a>>) {
        let (key, r) = match held.into() {
            Held::Job(ticket) => {
                let key = ticket.attempt_key().to_owned();
                (Some(key), ticket.dead_letter().await)
            }
            Held::Own(m) => (None, m.settler.dead_letter().await),
        };
        match r {
            Ok(()) => {
                WorkerStats::inc(&self.stats.settled);
                if let (Some(key), Writer::Group { marks, clock, .. }) = (key, &self.writer) {
                    marks.record(key, clock.now_ms());
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "dead-lettering failed; the broker redelivers the message (its outcome, if written, stays)")
            }
        }
    }

    /// Hand the delivery back to the broker (requeue; nothing is sent on a lost channel):
    /// nothing of it was made durable, or a step after the write failed.
    pub(crate) async fn hand_back<'a>(&self, held: impl Into<Held<'a>>) {
        match held.into() {
            Held::Job(ticket) => ticket.requeue().await,
            Held::Own(m) => {
                if let Err(e) = m.settler.requeue().await {
                    tracing::warn!(error = %e, "handing a delivery back failed; the broker redelivers it when the channel closes");
                }
            }
        }
    }

    /// The last acked-at marks are written (bounded): call after the last ack flush.
    pub(crate) async fn close(&self) {
        let Writer::Group {
            marks_done,
            marks_task,
            ..
        } = &self.writer
        else {
            return;
        };
        marks_done.cancel();
        let task = marks_task.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(task) = task
            && tokio::time::timeout(Duration::from_secs(5), task)
                .await
                .is_err()
        {
            tracing::warn!("acked-at trace writes did not finish within 5 s");
        }
    }
}
