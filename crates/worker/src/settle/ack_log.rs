//! Acked-at trace writes, folded into the group commits.
//!
//! Setting `acked_at_ms` on an attempt row happens *after* the ack and is best effort (the
//! outcome itself was written before the ack). Doing it inline would cost every job a
//! third durable commit, and even a separate batched transaction competes with the group
//! committer for SQLite's one writer connection. So the marks queue here, and the group
//! committer takes them into its next transaction
//! ([`Ledger::write_batch_marking_acked`]). Only when no group commit comes along (the
//! worker is idle) does a background task write what is left, after [`IDLE_FLUSH`]. The
//! queue is bounded: when it is full, the trace write is dropped (and logged), never the
//! job.

use lastcall_store::Ledger;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

/// Most marks queued before trace writes are dropped.
const CAPACITY: usize = 4_096;
/// Most marks written in one transaction.
const BATCH: usize = 1_024;
/// How long queued marks wait for a group commit to take them before the background task
/// writes them itself.
const IDLE_FLUSH: Duration = Duration::from_millis(50);

#[derive(Default)]
struct Inner {
    pending: Mutex<Vec<(String, i64)>>,
    wake: Notify,
}

/// The queue of `acked_at_ms` marks, shared by the ack flusher (which records them), the
/// group committer (which takes them) and the idle writer task.
#[derive(Clone, Default)]
pub(crate) struct AckLog {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for AckLog {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AckLog").finish_non_exhaustive()
    }
}

impl AckLog {
    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<(String, i64)>> {
        self.inner.pending.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queue one `acked_at_ms` write.
    pub(crate) fn record(&self, attempt_key: String, acked_at_ms: i64) {
        let mut p = self.lock();
        if p.len() >= CAPACITY {
            tracing::debug!("acked-at trace write dropped: the queue is full");
            return;
        }
        p.push((attempt_key, acked_at_ms));
        if p.len() == 1 {
            self.inner.wake.notify_one();
        }
    }

    /// Up to [`BATCH`] queued marks, oldest first, for the caller to write.
    pub(crate) fn take(&self) -> Vec<(String, i64)> {
        let mut p = self.lock();
        if p.len() <= BATCH {
            std::mem::take(&mut *p)
        } else {
            p.drain(..BATCH).collect()
        }
    }

    /// Start the idle writer: marks that no group commit took within [`IDLE_FLUSH`] are
    /// written in their own transaction. It writes what is left and ends when `done`
    /// fires.
    pub(crate) fn spawn_idle_writer(
        &self,
        ledger: Arc<Ledger>,
        done: CancellationToken,
    ) -> JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                let stopping = tokio::select! {
                    _ = this.inner.wake.notified() => {
                        tokio::select! {
                            _ = tokio::time::sleep(IDLE_FLUSH) => false,
                            _ = done.cancelled() => true,
                        }
                    }
                    _ = done.cancelled() => true,
                };
                if stopping {
                    loop {
                        let batch = this.take();
                        if batch.is_empty() {
                            return;
                        }
                        write(&ledger, &batch).await;
                    }
                }
                let batch = this.take();
                if !batch.is_empty() {
                    write(&ledger, &batch).await;
                }
                if !this.lock().is_empty() {
                    // More than one batch was queued: come back for the rest.
                    this.inner.wake.notify_one();
                }
            }
        })
    }
}

async fn write(ledger: &Ledger, batch: &[(String, i64)]) {
    if let Err(e) = ledger.mark_acked_many(batch).await {
        tracing::warn!(error = %e, n = batch.len(), "acked-at trace writes failed (outcomes are unaffected)");
    }
}
