//! Group commit of the worker's durable writes.
//!
//! Every attempt start and every outcome a job task needs before it may call the model or
//! settle its delivery goes through one writer task, which takes whatever has queued up
//! while the previous transaction committed and writes it as **one** transaction
//! ([`Ledger::write_batch`]). A task resumes (and only then calls the model or acks) when
//! the transaction holding its write has committed, so "durable before ack" holds per
//! delivery, while the fsync is shared by everything that finished meanwhile. There is no
//! added delay: a lone write commits at once; batches form only under load.
//!
//! The queue is bounded (the number of writers is bounded by prefetch anyway). A failed
//! transaction fails every write in it; each task retries its own write
//! ([`crate::store_retry::until_stored`]) and none of them acks meanwhile.

use lastcall_store::{Ledger, LedgerWrite, StoreError};
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Most writes queued for the writer task.
const CAPACITY: usize = 1_024;

struct Pending {
    write: LedgerWrite,
    done: oneshot::Sender<Result<bool, StoreError>>,
}

/// The sending side, held by the worker's job tasks. The writer task ends when the last
/// clone is dropped, after writing what was queued.
#[derive(Clone)]
pub(crate) struct Committer {
    tx: mpsc::Sender<Pending>,
}

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committer").finish_non_exhaustive()
    }
}

impl Committer {
    /// Start the writer task; `max_batch` bounds the writes in one transaction.
    pub(crate) fn spawn(ledger: Arc<Ledger>, max_batch: usize) -> (Self, JoinHandle<()>) {
        let max_batch = max_batch.max(1);
        let (tx, mut rx) = mpsc::channel::<Pending>(CAPACITY);
        let task = tokio::spawn(async move {
            let mut batch: Vec<Pending> = Vec::with_capacity(max_batch);
            while let Some(first) = rx.recv().await {
                batch.push(first);
                while batch.len() < max_batch {
                    match rx.try_recv() {
                        Ok(p) => batch.push(p),
                        Err(_) => break,
                    }
                }
                commit(&ledger, &mut batch).await;
            }
        });
        (Self { tx }, task)
    }

    /// Write one start or outcome; returns once the transaction holding it has committed
    /// (`Ok(true)`: it wrote the job's terminal outcome), or with the error that rolled
    /// the transaction back. An invalid write fails alone, before it is queued.
    pub(crate) async fn write(&self, write: LedgerWrite) -> Result<bool, StoreError> {
        write.validate()?;
        let (done, rx) = oneshot::channel();
        self.tx
            .send(Pending { write, done })
            .await
            .map_err(|_| StoreError::Unavailable("the ledger writer task has stopped".into()))?;
        rx.await.map_err(|_| {
            StoreError::Unavailable("the ledger writer task stopped before committing".into())
        })?
    }
}

async fn commit(ledger: &Ledger, batch: &mut Vec<Pending>) {
    let (writes, dones): (Vec<LedgerWrite>, Vec<_>) =
        batch.drain(..).map(|p| (p.write, p.done)).unzip();
    match ledger.write_batch(&writes).await {
        Ok(wrote) => {
            for (done, w) in dones.into_iter().zip(wrote) {
                let _ = done.send(Ok(w));
            }
        }
        Err(e) => {
            tracing::debug!(error = %e, n = writes.len(), "group commit failed; every write in it is retried by its task");
            for done in dones {
                let _ = done.send(Err(same_kind(&e)));
            }
        }
    }
}

/// The batch's error for each of its writers, keeping whether a retry can help.
fn same_kind(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
        StoreError::Fatal(m) => StoreError::Fatal(m.clone()),
    }
}
