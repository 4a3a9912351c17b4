//! Token deltas to a job's `reply_to`: the worker's side of streaming (the front door's
//! side is [`crate::publish::ReplyChannel`]). The body format is `lastcall_core::delta`.
//!
//! Like the outcome events ([`crate::events::EventSink`]), deltas are best-effort and
//! never hold up the worker: one bounded queue ([`DELTA_SINK_CAPACITY`]) per worker,
//! drained by one task that publishes to the default exchange (routing key = the job's
//! `reply_to`) without confirms, on a connection of its own (opened at the first delta),
//! so neither a slow broker nor a resource alarm ever reaches the consume channel or its
//! acks. A delta that cannot be queued or published is dropped and its stream marked
//! gone ([`DeltaTarget::is_gone`]): the caller stops sending that job's deltas, since a
//! reader seeing a gap takes the rest from the ledger anyway.
//!
//! RabbitMQ (3.x) silently discards a publish to a direct reply-to address whose channel
//! has closed, and returns every `mandatory` one, so a departed requester is not seen
//! here; it is seen as the job's cancellation (the front door cancels the job of a client
//! that went away), which ends the call and its deltas.

use crate::Broker;
use crate::own_channel::OwnChannel;
use lapin::BasicProperties;
use lapin::options::BasicPublishOptions;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use tokio::sync::mpsc;

/// Deltas queued for publishing at most, over all of a worker's jobs.
pub const DELTA_SINK_CAPACITY: usize = 1024;

struct Item {
    reply_to: String,
    job_id: String,
    body: Vec<u8>,
    gone: Arc<AtomicBool>,
}

/// What a delta sink did, for metrics and tests.
#[derive(Debug, Default)]
pub struct DeltaCounts {
    pub published: AtomicU64,
    pub dropped: AtomicU64,
}

/// Where a worker's deltas go. Cheap to clone; [`DeltaSink::disabled`] drops everything.
#[derive(Clone, Debug)]
pub struct DeltaSink {
    tx: Option<mpsc::Sender<Item>>,
    counts: Arc<DeltaCounts>,
}

/// One job's reply address, and whether its deltas still go anywhere.
#[derive(Debug, Clone)]
pub struct DeltaTarget {
    sink: DeltaSink,
    reply_to: String,
    job_id: String,
    gone: Arc<AtomicBool>,
}

impl DeltaSink {
    /// A sink publishing on a connection of its own to `broker`'s nodes. Its task ends
    /// when every clone is dropped.
    pub fn spawn(broker: &Broker) -> Self {
        let (tx, rx) = mpsc::channel(DELTA_SINK_CAPACITY);
        let counts = Arc::new(DeltaCounts::default());
        let task = SinkTask {
            conn: OwnChannel::new(
                broker.clone(),
                "token deltas",
                "deltas until it is back (the ledger keeps every result)",
            ),
            counts: counts.clone(),
        };
        tokio::spawn(task.run(rx));
        Self {
            tx: Some(tx),
            counts,
        }
    }

    /// A sink that publishes nothing.
    pub fn disabled() -> Self {
        Self {
            tx: None,
            counts: Arc::new(DeltaCounts::default()),
        }
    }

    pub fn counts(&self) -> &DeltaCounts {
        &self.counts
    }

    /// The target of one job's deltas (`reply_to` as delivered; `job_id` is set as each
    /// delta's `correlation_id`).
    pub fn target(&self, reply_to: &str, job_id: &str) -> DeltaTarget {
        DeltaTarget {
            sink: self.clone(),
            reply_to: reply_to.to_owned(),
            job_id: job_id.to_owned(),
            gone: Arc::new(AtomicBool::new(self.tx.is_none())),
        }
    }
}

impl DeltaTarget {
    /// Queue one delta body; never waits. `false` (and gone from now on) when it could not
    /// be queued, or an earlier one of this target could not be published.
    pub fn send(&self, body: Vec<u8>) -> bool {
        if self.is_gone() {
            return false;
        }
        let Some(tx) = &self.sink.tx else {
            return false;
        };
        let item = Item {
            reply_to: self.reply_to.clone(),
            job_id: self.job_id.clone(),
            body,
            gone: self.gone.clone(),
        };
        if tx.try_send(item).is_err() {
            self.sink.counts.dropped.fetch_add(1, Ordering::Relaxed);
            self.gone.store(true, Ordering::Relaxed);
            return false;
        }
        true
    }

    /// Whether this target's deltas are being dropped.
    pub fn is_gone(&self) -> bool {
        self.gone.load(Ordering::Relaxed)
    }
}

struct SinkTask {
    conn: OwnChannel,
    counts: Arc<DeltaCounts>,
}

impl SinkTask {
    async fn run(mut self, mut rx: mpsc::Receiver<Item>) {
        while let Some(item) = rx.recv().await {
            if item.gone.load(Ordering::Relaxed) {
                self.counts.dropped.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            if self.publish(&item).await {
                self.counts.published.fetch_add(1, Ordering::Relaxed);
            } else {
                self.counts.dropped.fetch_add(1, Ordering::Relaxed);
                item.gone.store(true, Ordering::Relaxed);
            }
        }
        self.conn.close().await;
    }

    async fn publish(&mut self, item: &Item) -> bool {
        let Some(ch) = self.conn.channel().await else {
            return false;
        };
        let props = BasicProperties::default()
            .with_content_type("application/json".into())
            .with_delivery_mode(1)
            .with_correlation_id(item.job_id.as_str().into());
        match ch
            .basic_publish(
                "".into(),
                item.reply_to.as_str().into(),
                BasicPublishOptions::default(),
                &item.body,
                props,
            )
            .await
        {
            Ok(_) => true,
            Err(e) => {
                // A closed channel (a malformed address closes it, say): a new one for the
                // next job; this job's deltas stop.
                tracing::debug!(error = %e, "delta not published; reopening the channel");
                self.conn.reopen().await;
                false
            }
        }
    }
}
