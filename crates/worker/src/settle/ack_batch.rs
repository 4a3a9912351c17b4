//! Coalesced acks: the async shell over [`lastcall_core::ack_plan`].
//!
//! One [`AckBatch`] per channel generation holds that channel's [`AckPlan`] (which tags
//! are safe to ack, pure and property-tested) and the [`Settler`]s of the finished
//! deliveries; a flusher task sends what [`AckPlan::take`] allows whenever woken: one
//! `multiple` ack for the finished prefix, single acks above the first unfinished tag.
//!
//! Each delivery is a [`Ticket`], made when it arrives (in tag order) and consumed by
//! exactly one way out: [`Ticket::done`] after its durable write (the flusher acks it),
//! [`Ticket::dead_letter`] or [`Ticket::requeue`] (the frame is sent by the task, and only
//! then is the tag released, so a `multiple` ack never overtakes it). A ticket dropped
//! unsettled (a shutdown before its write) keeps its tag held: nothing above it is acked
//! with `multiple`, and the closing channel returns the delivery.

use crate::stats::WorkerStats;
use lastcall_broker::{BrokerError, Settler};
use lastcall_core::ack_plan::{AckPlan, Tag};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::Notify;
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

#[derive(Default)]
struct State {
    plan: AckPlan,
    /// The finished deliveries' settlers and attempt keys, until their ack is sent.
    done: HashMap<u64, (Settler, String)>,
}

/// The deliveries of one channel generation; shared by the receive loop, the job tasks
/// and the flusher task.
#[derive(Clone)]
pub(crate) struct AckBatch {
    state: Arc<Mutex<State>>,
    wake: Arc<Notify>,
    /// Fires when the generation's connection is lost: nothing can be sent on it any more.
    lost: CancellationToken,
}

impl std::fmt::Debug for AckBatch {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AckBatch").finish_non_exhaustive()
    }
}

/// One delivery held by the worker, on its channel generation.
#[derive(Debug)]
pub(crate) struct Ticket {
    batch: AckBatch,
    tag: Tag,
    settler: Settler,
    attempt_key: String,
}

/// What a flush sends, computed under the lock and sent outside it.
struct Flush {
    /// The last settler of the finished prefix, and how many deliveries it covers.
    prefix: Option<(Settler, usize)>,
    single: Vec<Settler>,
    keys: Vec<String>,
}

impl AckBatch {
    /// The batch of channel generation `generation` (the consumer's stream number).
    pub(crate) fn new(generation: u64, lost: CancellationToken) -> Self {
        Self {
            state: Arc::new(Mutex::new(State {
                plan: AckPlan::new(generation),
                done: HashMap::new(),
            })),
            wake: Arc::new(Notify::new()),
            lost,
        }
    }

    /// A delivery arrived. Must be called in delivery-tag order, on its own generation.
    pub(crate) fn register(&self, tag: u64, settler: Settler, attempt_key: String) -> Ticket {
        let tag = match self.lock().plan.register(tag) {
            Ok(t) => t,
            Err(e) => {
                // Cannot happen with one consumer per channel; the tag stays unknown and
                // its `done` is refused (not acked), so the broker redelivers it.
                tracing::error!(error = %e, tag, "delivery tag out of order");
                Tag {
                    generation: u64::MAX,
                    tag,
                }
            }
        };
        Ticket {
            batch: self.clone(),
            tag,
            settler,
            attempt_key,
        }
    }

    /// The generation's connection is gone.
    pub(crate) fn is_lost(&self) -> bool {
        self.lost.is_cancelled()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn take(&self) -> Flush {
        let mut st = self.lock();
        let acks = st.plan.take();
        let mut flush = Flush {
            prefix: None,
            single: Vec::with_capacity(acks.single.len()),
            keys: Vec::with_capacity(acks.count()),
        };
        if let Some(p) = acks.prefix {
            // Only the last settler of the prefix sends (its ack covers the rest).
            let below: Vec<u64> = st.done.keys().copied().filter(|t| *t < p.last).collect();
            for t in below {
                if let Some((_, key)) = st.done.remove(&t) {
                    flush.keys.push(key);
                }
            }
            if let Some((settler, key)) = st.done.remove(&p.last) {
                flush.keys.push(key);
                flush.prefix = Some((settler, p.count));
            }
        }
        for t in acks.single {
            if let Some((settler, key)) = st.done.remove(&t) {
                flush.keys.push(key);
                flush.single.push(settler);
            }
        }
        flush
    }

    /// Start the flusher; it acks whatever is finished whenever woken, and does a last
    /// flush when `stop` fires. With `marks`, each ack's time is noted there.
    pub(crate) fn spawn_flusher(
        &self,
        stats: Arc<WorkerStats>,
        marks: Option<(super::ack_log::AckLog, Arc<dyn crate::clock::Clock>)>,
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
                send(flush, &stats, marks.as_ref()).await;
                if stopping {
                    return;
                }
            }
        })
    }
}

impl Ticket {
    /// The attempt key of this delivery (worker, process, channel and tag).
    pub(crate) fn attempt_key(&self) -> &str {
        &self.attempt_key
    }

    /// Its channel is gone: an ack, reject or requeue can no longer be sent.
    pub(crate) fn channel_lost(&self) -> bool {
        self.batch.is_lost()
    }

    /// The delivery's outcome is durable: ack it (soon, possibly with others).
    pub(crate) fn done(self) {
        let Ticket {
            batch,
            tag,
            settler,
            attempt_key,
        } = self;
        let mut st = batch.lock();
        if st.plan.done(tag).is_ok() {
            st.done.insert(tag.tag, (settler, attempt_key));
            drop(st);
            batch.wake.notify_one();
        }
    }

    /// Reject without requeue (to the dead-letter exchange); only then release the tag.
    pub(crate) async fn dead_letter(self) -> Result<(), BrokerError> {
        let r = self.settler.dead_letter().await;
        self.release();
        r
    }

    /// Requeue (hand back) unless the channel is gone; then release the tag.
    pub(crate) async fn requeue(self) {
        if !self.channel_lost() {
            let _ = self.settler.requeue().await;
        }
        self.release();
    }

    fn release(self) {
        let _ = self.batch.lock().plan.release(self.tag);
        // A held tag may have been the gap in front of finished ones.
        self.batch.wake.notify_one();
    }
}

async fn send(
    flush: Flush,
    stats: &WorkerStats,
    marks: Option<&(super::ack_log::AckLog, Arc<dyn crate::clock::Clock>)>,
) {
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
    if let Some((log, clock)) = marks {
        let now_ms = clock.now_ms();
        for key in flush.keys {
            log.record(key, now_ms);
        }
    }
}
