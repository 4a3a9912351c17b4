//! Group commit of the worker's durable writes, and batched receipt lookups.
//!
//! Every attempt start and every outcome a job task needs before it may call the model or
//! settle its delivery goes through one writer task, which takes whatever has queued up
//! while the previous transaction committed and writes it as **one** transaction
//! ([`Ledger::write_batch`]). A task resumes (and only then calls the model or acks) when
//! the transaction holding its write has committed, so "durable before ack" holds per
//! delivery, while the fsync is shared by everything that finished meanwhile. There is no
//! added delay: a lone write commits at once; batches form only under load.
//!
//! The best-effort `acked_at_ms` marks of earlier deliveries ride along in the same
//! transactions ([`AckLog`]), so they cost no commit of their own.
//!
//! Receipt lookups (has this job an outcome, how many calls were started) are batched the
//! same way into one `IN (…)` read ([`Ledger::receipt_info_many`]).
//!
//! The queues are bounded (the number of callers is bounded by prefetch anyway). A failed
//! batch fails every request in it; each task retries its own request
//! ([`crate::store_retry::until_stored`]) and none of them acks meanwhile.

use super::ack_log::AckLog;
use lastcall_store::{Ledger, LedgerWrite, ReceiptInfo, StoreError};
use std::future::Future;
use std::sync::Arc;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

/// Most requests queued for a batcher task.
const CAPACITY: usize = 1_024;

type Reply<R> = oneshot::Sender<Result<R, StoreError>>;

/// One task that serves queued requests in batches: whatever queued up while the previous
/// batch ran goes into the next (at most `max_batch`).
struct Batcher<Q, R> {
    tx: mpsc::Sender<(Q, Reply<R>)>,
}

impl<Q, R> Clone for Batcher<Q, R> {
    fn clone(&self) -> Self {
        Self {
            tx: self.tx.clone(),
        }
    }
}

impl<Q: Send + 'static, R: Send + 'static> Batcher<Q, R> {
    /// `run` answers a batch with one result per request, in order, or fails it whole.
    fn spawn<F, Fut>(max_batch: usize, run: F) -> (Self, JoinHandle<()>)
    where
        F: Fn(Vec<Q>) -> Fut + Send + 'static,
        Fut: Future<Output = Result<Vec<R>, StoreError>> + Send,
    {
        let max_batch = max_batch.max(1);
        let (tx, mut rx) = mpsc::channel::<(Q, Reply<R>)>(CAPACITY);
        let task = tokio::spawn(async move {
            let mut batch = Vec::with_capacity(max_batch);
            while let Some(first) = rx.recv().await {
                batch.push(first);
                while batch.len() < max_batch {
                    match rx.try_recv() {
                        Ok(p) => batch.push(p),
                        Err(_) => break,
                    }
                }
                let (reqs, replies): (Vec<Q>, Vec<Reply<R>>) = batch.drain(..).unzip();
                match run(reqs).await {
                    Ok(results) => {
                        for (reply, r) in replies.into_iter().zip(results) {
                            let _ = reply.send(Ok(r));
                        }
                    }
                    Err(e) => {
                        tracing::debug!(error = %e, n = replies.len(), "ledger batch failed; every request in it is retried by its task");
                        for reply in replies {
                            let _ = reply.send(Err(same_kind(&e)));
                        }
                    }
                }
            }
        });
        (Self { tx }, task)
    }

    async fn call(&self, q: Q) -> Result<R, StoreError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send((q, reply))
            .await
            .map_err(|_| StoreError::Unavailable("the ledger batch task has stopped".into()))?;
        rx.await.map_err(|_| {
            StoreError::Unavailable("the ledger batch task stopped before answering".into())
        })?
    }
}

/// The group committer, held by the worker's job tasks. Its task ends when the last clone
/// is dropped, after writing what was queued.
#[derive(Clone)]
pub(crate) struct Committer {
    writes: Batcher<LedgerWrite, bool>,
    receipts: Batcher<String, ReceiptInfo>,
}

impl std::fmt::Debug for Committer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Committer").finish_non_exhaustive()
    }
}

impl Committer {
    /// Start the writer and reader tasks; `max_batch` bounds the requests in one batch.
    /// Each write transaction also takes the `acked_at_ms` marks queued in `acks`.
    pub(crate) fn spawn(ledger: Arc<Ledger>, max_batch: usize, acks: AckLog) -> Self {
        let l = ledger.clone();
        let (writes, _) = Batcher::spawn(max_batch, move |w: Vec<LedgerWrite>| {
            let l = l.clone();
            let marks = acks.take();
            async move {
                let r = l.write_batch_marking_acked(&w, &marks).await;
                if r.is_err() && !marks.is_empty() {
                    tracing::debug!(
                        n = marks.len(),
                        "acked-at trace writes lost with a failed group commit (outcomes are retried)"
                    );
                }
                r
            }
        });
        let (receipts, _) = Batcher::spawn(max_batch, move |ids: Vec<String>| {
            let l = ledger.clone();
            async move {
                let found = l.receipt_info_many(&ids).await?;
                Ok(ids
                    .iter()
                    .map(|id| found.get(id).copied().unwrap_or_default())
                    .collect())
            }
        });
        Self { writes, receipts }
    }

    /// Write one start or outcome; returns once the transaction holding it has committed
    /// (`Ok(true)`: it wrote the job's terminal outcome), or with the error that rolled
    /// the transaction back. An invalid write fails alone, before it is queued.
    pub(crate) async fn write(&self, write: LedgerWrite) -> Result<bool, StoreError> {
        write.validate()?;
        self.writes.call(write).await
    }

    /// [`Ledger::receipt_info`], batched with the other deliveries arriving meanwhile.
    pub(crate) async fn receipt_info(&self, job_id: String) -> Result<ReceiptInfo, StoreError> {
        self.receipts.call(job_id).await
    }
}

/// The batch's error for each of its requests, keeping whether a retry can help.
fn same_kind(e: &StoreError) -> StoreError {
    match e {
        StoreError::Unavailable(m) => StoreError::Unavailable(m.clone()),
        StoreError::Fatal(m) => StoreError::Fatal(m.clone()),
    }
}
