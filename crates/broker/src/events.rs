//! Outcome events on `{prefix}.events`: a best-effort publishing sink for the processes
//! that record outcomes, and a follower for the ones that wait for them (`serve`'s
//! long-polls, `submit --wait`).
//!
//! Events are notifications, not records: the ledger is the truth. So the sink never
//! holds up its caller (a bounded queue, dropped and counted when full or while the broker
//! is unreachable), publishes without confirms on a connection of its own (so a resource
//! alarm that blocks it never blocks a consumer's acks), and heals itself at the next event.
//! A follower that was disconnected may have missed events: it says so (`on_gap`) after
//! every (re)connect, and its user reads the ledger again.

use crate::own_channel::OwnChannel;
use crate::{Broker, BrokerError};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions, QueueBindOptions,
    QueueDeclareOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, ExchangeKind};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{mpsc, oneshot};
use tokio_util::sync::CancellationToken;

/// Events queued for publishing at most (then new ones are dropped and counted).
pub const SINK_CAPACITY: usize = 4096;

enum Item {
    Event {
        routing_key: String,
        body: Vec<u8>,
    },
    /// Answered once every event queued before it was handed to the broker (or dropped);
    /// with `close`, after closing the connection politely too (which flushes it).
    Flush {
        done: oneshot::Sender<()>,
        close: bool,
    },
    /// Open the connection now rather than at the first event.
    Open,
}

/// Where outcome events go. Cheap to clone; [`EventSink::disabled`] drops everything
/// (a process configured without events).
#[derive(Clone, Debug)]
pub struct EventSink {
    tx: Option<mpsc::Sender<Item>>,
    counts: Arc<SinkCounts>,
}

/// What a sink did, for metrics and tests.
#[derive(Debug, Default)]
pub struct SinkCounts {
    pub published: AtomicU64,
    pub dropped: AtomicU64,
    /// Whether the sink's last attempt to get a channel found one (false before the first).
    pub connected: AtomicBool,
}

impl EventSink {
    /// A sink publishing to `exchange` on a connection of its own to `broker`'s nodes
    /// (opened at the first event). Its task ends when every clone is dropped.
    pub fn spawn(broker: &Broker, exchange: &str) -> Self {
        let (tx, rx) = mpsc::channel(SINK_CAPACITY);
        let counts = Arc::new(SinkCounts::default());
        let task = SinkTask {
            conn: OwnChannel::new(
                broker.clone(),
                "outcome events",
                "events until it is back (the ledger keeps every outcome)",
            ),
            exchange: exchange.to_owned(),
            counts: counts.clone(),
        };
        tokio::spawn(task.run(rx));
        Self {
            tx: Some(tx),
            counts,
        }
    }

    /// Open the sink's connection now instead of at the first event: for a long-running
    /// process whose first event may come hours later (the dead-letter processor's), so
    /// that the connection is part of its start-up footprint rather than a step in its
    /// memory at the first outage. Never waits; a failure is only logged, and the next
    /// event tries again.
    pub fn open(self) -> Self {
        if let Some(tx) = &self.tx {
            let _ = tx.try_send(Item::Open);
        }
        self
    }

    /// A sink that publishes nothing.
    pub fn disabled() -> Self {
        Self {
            tx: None,
            counts: Arc::new(SinkCounts::default()),
        }
    }

    /// Queue one event; never waits. Dropped (and counted) when the queue is full.
    pub fn emit(&self, routing_key: String, body: Vec<u8>) {
        let Some(tx) = &self.tx else { return };
        if tx.try_send(Item::Event { routing_key, body }).is_err() {
            self.counts.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Wait (at most `timeout`) until every event emitted so far was handed to the broker
    /// or dropped: for a short-lived command before it exits.
    pub async fn flush(&self, timeout: Duration) {
        self.flush_then(timeout, false).await;
    }

    /// [`flush`](Self::flush), then close the sink's connection (a command about to exit).
    /// Events emitted later open a new one.
    pub async fn close(&self, timeout: Duration) {
        self.flush_then(timeout, true).await;
    }

    async fn flush_then(&self, timeout: Duration, close: bool) {
        let Some(tx) = &self.tx else { return };
        let (done, wait) = oneshot::channel();
        let _ = tokio::time::timeout(timeout, async {
            if tx.send(Item::Flush { done, close }).await.is_ok() {
                let _ = wait.await;
            }
        })
        .await;
    }

    /// Whether events go anywhere (a caller may skip work that only feeds them).
    pub fn is_enabled(&self) -> bool {
        self.tx.is_some()
    }

    pub fn counts(&self) -> &SinkCounts {
        &self.counts
    }
}

struct SinkTask {
    conn: OwnChannel,
    exchange: String,
    counts: Arc<SinkCounts>,
}

impl SinkTask {
    async fn run(mut self, mut rx: mpsc::Receiver<Item>) {
        while let Some(item) = rx.recv().await {
            match item {
                Item::Flush { done, close } => {
                    if close {
                        self.conn.close().await;
                    }
                    let _ = done.send(());
                }
                Item::Open => {
                    let ch = self.conn.channel().await;
                    self.counts.connected.store(ch.is_some(), Ordering::Relaxed);
                }
                Item::Event { routing_key, body } => {
                    let counter = if self.publish(&routing_key, &body).await {
                        &self.counts.published
                    } else {
                        &self.counts.dropped
                    };
                    counter.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        self.conn.close().await;
    }

    /// One try, and one more on a fresh channel if the first finds it closed.
    async fn publish(&mut self, routing_key: &str, body: &[u8]) -> bool {
        for _ in 0..2 {
            let ch = self.conn.channel().await;
            self.counts.connected.store(ch.is_some(), Ordering::Relaxed);
            let Some(ch) = ch else {
                return false;
            };
            let props = BasicProperties::default()
                .with_content_type("application/json".into())
                .with_delivery_mode(1);
            let sent = ch
                .basic_publish(
                    self.exchange.as_str().into(),
                    routing_key.into(),
                    BasicPublishOptions::default(),
                    body,
                    props,
                )
                .await;
            match sent {
                Ok(_) => return true,
                Err(e) => {
                    tracing::debug!(error = %e, "outcome event not published; reopening the channel");
                    self.conn.forget();
                }
            }
        }
        false
    }
}

/// Follow `exchange` until `stop`: an exclusive, auto-delete queue
/// `{exchange}.follow.{nonce}` bound with `#` (capped at 10,000 messages, oldest dropped;
/// named under the prefix so that least-privilege users can be given it, see
/// docs/broker-permissions.md), declared again after every reconnect (exponential
/// backoff, as the worker's). `on_event` gets each routing key and body; `on_gap(true)` is
/// called after every (re)subscribe, since events published meanwhile were missed, and
/// `on_gap(false)` when the subscription is lost.
pub async fn follow(
    broker: Broker,
    exchange: String,
    stop: CancellationToken,
    on_event: impl FnMut(&str, &[u8]),
    on_gap: impl FnMut(bool),
) {
    follow_exchange(
        broker,
        exchange,
        ExchangeKind::Topic,
        stop,
        on_event,
        on_gap,
    )
    .await;
}

/// [`follow`] for the fanout exchange `{prefix}.control` (a worker's control broadcasts:
/// cancellations). Its queue is `{prefix}.control.follow.{nonce}`.
pub async fn follow_control(
    broker: Broker,
    exchange: String,
    stop: CancellationToken,
    on_message: impl FnMut(&str, &[u8]),
    on_gap: impl FnMut(bool),
) {
    follow_exchange(
        broker,
        exchange,
        ExchangeKind::Fanout,
        stop,
        on_message,
        on_gap,
    )
    .await;
}

async fn follow_exchange(
    broker: Broker,
    exchange: String,
    kind: ExchangeKind,
    stop: CancellationToken,
    mut on_event: impl FnMut(&str, &[u8]),
    mut on_gap: impl FnMut(bool),
) {
    let mut conn = match broker.another().await {
        Ok(b) => Some(b),
        Err(e) => {
            tracing::warn!(error = %e, "outcome events: cannot connect; retrying");
            None
        }
    };
    let mut announced_loss = false;
    let mut backoff = Duration::from_millis(200);
    loop {
        let b = match conn.take() {
            Some(b) => b,
            None => match broker.reconnect(&stop, None).await {
                Some(b) => b,
                None => return,
            },
        };
        // A fresh name at every subscribe: the exclusive queue of the lost connection may
        // still be registered, locked, while the node that held it is down (a cluster
        // node killed): declaring it again would fail with RESOURCE_LOCKED until that
        // node returns.
        let queue = follow_queue_name(&exchange);
        match subscribe(&b, &exchange, kind.clone(), &queue).await {
            Ok((ch, mut consumer)) => {
                backoff = Duration::from_millis(200);
                if announced_loss {
                    tracing::warn!(node = %b.node(), "outcome events: following again");
                }
                announced_loss = false;
                on_gap(true);
                loop {
                    let next = tokio::select! {
                        () = stop.cancelled() => {
                            b.close().await;
                            return;
                        }
                        n = consumer.next() => n,
                    };
                    let Some(Ok(d)) = next else { break };
                    on_event(d.routing_key.as_str(), &d.data);
                    let _ = ch
                        .basic_ack(d.delivery_tag, BasicAckOptions::default())
                        .await;
                }
            }
            Err(e) => {
                // Connected but refused (permissions, say): retry, but not in a tight loop.
                tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "outcome events: cannot follow");
                tokio::select! {
                    () = stop.cancelled() => return,
                    () = tokio::time::sleep(backoff) => {}
                }
                backoff = (backoff * 2).min(Duration::from_secs(10));
            }
        }
        if !announced_loss {
            tracing::warn!(
                "outcome events: connection lost; reconnecting (waiters read the ledger again when it is back)"
            );
            announced_loss = true;
        }
        on_gap(false);
        if stop.is_cancelled() {
            return;
        }
        // Reconnect from this connection's node list (failover to the next node).
        conn = b.reconnect(&stop, None).await;
        if conn.is_none() {
            return;
        }
    }
}

/// `{exchange}.follow.{nonce}`: unique per process and call.
fn follow_queue_name(exchange: &str) -> String {
    static N: AtomicU64 = AtomicU64::new(0);
    let n = N.fetch_add(1, Ordering::Relaxed);
    format!(
        "{exchange}.follow.{:x}{:x}{n:x}",
        std::process::id(),
        rand::random::<u32>()
    )
}

async fn subscribe(
    b: &Broker,
    exchange: &str,
    kind: ExchangeKind,
    queue: &str,
) -> Result<(Channel, lapin::Consumer), String> {
    let amqp = |doing: &'static str| move |source| BrokerError::Amqp { doing, source }.to_string();
    // Declared if this user may (idempotent), else only checked: a follower needs no
    // `configure` on the exchange it follows.
    crate::topology::declare_or_verify_exchange(b, exchange, kind)
        .await
        .map_err(|e| e.to_string())?;
    let ch = b.channel().await.map_err(|e| e.to_string())?;
    let mut args = FieldTable::default();
    args.insert("x-max-length".into(), AMQPValue::LongLongInt(10_000));
    args.insert(
        "x-overflow".into(),
        AMQPValue::LongString(LongString::from(b"drop-head".to_vec())),
    );
    ch.queue_declare(
        queue.into(),
        QueueDeclareOptions {
            exclusive: true,
            auto_delete: true,
            ..Default::default()
        },
        args,
    )
    .await
    .map_err(amqp("declaring an events queue"))?;
    ch.queue_bind(
        queue.into(),
        exchange.into(),
        "#".into(),
        QueueBindOptions::default(),
        FieldTable::default(),
    )
    .await
    .map_err(amqp("binding the events queue"))?;
    ch.basic_qos(500, BasicQosOptions::default())
        .await
        .map_err(amqp("setting the events prefetch"))?;
    let consumer = ch
        .basic_consume(
            queue.into(),
            "lastcall-events".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await
        .map_err(amqp("following events"))?;
    Ok((ch, consumer))
}
