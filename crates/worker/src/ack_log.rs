//! Acked-at trace writes, batched off the hot path.
//!
//! Setting `acked_at_ms` on an attempt row happens *after* the ack and is best effort (the
//! outcome itself was written before the ack). Doing it inline costs every job a third
//! durable commit; here a background task writes whatever has queued up in one
//! transaction. The queue is bounded: when it is full, the trace write is dropped (and
//! logged), never the job.

use lastcall_store::Ledger;
use std::sync::Arc;
use tokio::sync::mpsc;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Most acks queued before trace writes are dropped.
const CAPACITY: usize = 4_096;
/// Most acks written in one transaction.
const BATCH: usize = 512;

/// The sending side, held by the worker's job tasks.
#[derive(Debug, Clone)]
pub(crate) struct AckLog {
    tx: mpsc::Sender<(String, i64)>,
}

impl AckLog {
    /// Start the writer task; it flushes what is queued and ends when `done` fires.
    pub(crate) fn spawn(ledger: Arc<Ledger>, done: CancellationToken) -> (Self, JoinHandle<()>) {
        let (tx, mut rx) = mpsc::channel::<(String, i64)>(CAPACITY);
        let task = tokio::spawn(async move {
            let mut batch = Vec::with_capacity(BATCH);
            loop {
                let first = tokio::select! {
                    m = rx.recv() => m,
                    _ = done.cancelled() => None,
                };
                match first {
                    Some(m) => batch.push(m),
                    None => {
                        while let Ok(m) = rx.try_recv() {
                            batch.push(m);
                        }
                        write(&ledger, &mut batch).await;
                        return;
                    }
                }
                while batch.len() < BATCH {
                    match rx.try_recv() {
                        Ok(m) => batch.push(m),
                        Err(_) => break,
                    }
                }
                write(&ledger, &mut batch).await;
            }
        });
        (Self { tx }, task)
    }

    /// Queue one `acked_at_ms` write.
    pub(crate) fn record(&self, attempt_key: String, acked_at_ms: i64) {
        if self.tx.try_send((attempt_key, acked_at_ms)).is_err() {
            tracing::debug!("acked-at trace write dropped: the queue is full");
        }
    }
}

async fn write(ledger: &Ledger, batch: &mut Vec<(String, i64)>) {
    if let Err(e) = ledger.mark_acked_many(batch).await {
        tracing::warn!(error = %e, n = batch.len(), "acked-at trace writes failed (outcomes are unaffected)");
    }
    batch.clear();
}
