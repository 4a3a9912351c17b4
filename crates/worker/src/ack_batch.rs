//! Coalesced acks: one `basic.ack` with `multiple` for a contiguous run of finished
//! deliveries, individual acks for finished deliveries above a gap.
//!
//! Work runs in parallel, so delivery 7 can finish before delivery 5. A `multiple` ack
//! for tag T settles *every* unsettled delivery up to T on the channel, so it may only be
//! sent when each of them is finished and durably recorded. This module keeps the set of
//! deliveries the worker holds, in tag order:
//! - [`AckBatch::register`] as a delivery arrives (the receive loop, in tag order);
//! - [`AckBatch::done`] once its outcome is durable and it only awaits its ack;
//! - [`AckBatch::forget`] after it was settled another way (rejected to the DLX, or
//!   handed back), so it no longer blocks the run.
//!
//! The flusher takes the longest prefix of finished deliveries (no unfinished one below
//! it) and acks it with one `multiple` frame on the prefix's last tag, then acks finished
//! deliveries above the first unfinished one individually. So an ack is never delayed
//! behind a long call, and never covers a delivery whose outcome is not yet durable.
//! **Invariant:** a tag reaches `done` only after its ledger write committed.

use crate::stats::WorkerStats;
use lastcall_broker::Settler;
use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

enum Slot {
    /// Held by the worker: not finished, or settled another way not yet forgotten.
    Held,
    /// Outcome durable; waiting for its ack.
    Done {
        settler: Settler,
        attempt_key: String,
    },
}

#[derive(Default)]
struct State {
    held: BTreeMap<u64, Slot>,
}

/// Shared by the receive loop, the job tasks and the flusher task.
#[derive(Clone)]
pub(crate) struct AckBatch {
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
}

impl std::fmt::Debug for AckBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AckBatch").finish_non_exhaustive()
    }
}

/// What a flush sends, computed under the lock and sent outside it.
struct Flush {
    /// The last settler of the finished prefix, and how many deliveries it covers.
    prefix: Option<(Settler, usize)>,
    single: Vec<Settler>,
    keys: Vec<String>,
}

impl AckBatch {
    pub(crate) fn new() -> Self {
        Self {
            state: Arc::default(),
            wake: Arc::new(Notify::new()),
        }
    }

    /// A delivery arrived. Must be called in delivery-tag order, before the delivery can
    /// be finished.
    pub(crate) fn register(&self, tag: u64) {
        self.lock().held.insert(tag, Slot::Held);
    }

    /// The delivery's outcome is durable: ack it (soon, possibly with others).
    pub(crate) fn done(&self, tag: u64, settler: Settler, attempt_key: String) {
        self.lock().held.insert(
            tag,
            Slot::Done {
                settler,
                attempt_key,
            },
        );
        self.wake.notify_one();
    }

    /// The delivery was settled another way (its reject or requeue frame already sent).
    pub(crate) fn forget(&self, tag: u64) {
        self.lock().held.remove(&tag);
        // A held tag may have been the gap in front of finished ones.
        self.wake.notify_one();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self) -> Flush {
        let mut st = self.lock();
        let mut flush = Flush {
            prefix: None,
            single: Vec::new(),
            keys: Vec::new(),
        };
        // (tag, in the finished prefix?) for every finished delivery, in tag order.
        let mut in_prefix = true;
        let finished: Vec<(u64, bool)> = st
            .held
            .iter()
            .filter_map(|(tag, slot)| match slot {
                Slot::Held => {
                    in_prefix = false;
                    None
                }
                Slot::Done { .. } => Some((*tag, in_prefix)),
            })
            .collect();
        let mut prefix_len = 0usize;
        let mut last = None;
        for (tag, prefix) in finished {
            let Some(Slot::Done {
                settler,
                attempt_key,
            }) = st.held.remove(&tag)
            else {
                continue;
            };
            flush.keys.push(attempt_key);
            if prefix {
                prefix_len += 1;
                last = Some(settler);
            } else {
                flush.single.push(settler);
            }
        }
        flush.prefix = last.map(|s| (s, prefix_len));
        flush
    }

    /// Start the flusher; it acks whatever is finished whenever woken, and does a last
    /// flush when `stop` fires.
    pub(crate) fn spawn_flusher(
        &self,
        stats: Arc<WorkerStats>,
        acks: crate::ack_log::AckLog,
        clock: Arc<dyn crate::clock::Clock>,
        stop: CancellationToken,
    ) -> JoinHandle<()> {
        let this = self.clone();
        tokio::spawn(async move {
            loop {
                let stopping = tokio::select! {
                    _ = this.wake.notified() => false,
                    _ = stop.cancelled() => true,
                };
                let flush = this.take();
                send(flush, &stats, &acks, clock.now_ms()).await;
                if stopping {
                    return;
                }
            }
        })
    }
}

async fn send(flush: Flush, stats: &WorkerStats, acks: &crate::ack_log::AckLog, now_ms: i64) {
    let mut settled = 0u64;
    if let Some((settler, n)) = flush.prefix {
        let r = if n > 1 {
            settler.ack_multiple().await
        } else {
            settler.ack().await
        };
        match r {
            Ok(()) => settled += n as u64,
            Err(e) => {
                tracing::warn!(error = %e, n, "acking after the durable write failed; the broker will redeliver and the duplicates are acked")
            }
        }
    }
    // Handed to the connection together rather than one round trip each.
    let singles = flush.single.iter().map(|settler| settler.ack());
    for r in futures_util::future::join_all(singles).await {
        match r {
            Ok(()) => settled += 1,
            Err(e) => {
                tracing::warn!(error = %e, "acking after the durable write failed; the broker will redeliver and the duplicate is acked")
            }
        }
    }
    stats
        .settled
        .fetch_add(settled, std::sync::atomic::Ordering::Relaxed);
    for key in flush.keys {
        acks.record(key, now_ms);
    }
}
