//! Manual-ack consuming. Nothing here requeues: settling is ack, or reject without requeue
//! (to the queue's dead-letter exchange).

use crate::publish::{ATTEMPT_HEADER, SIGNATURE_HEADER};
use crate::{Broker, BrokerError};
use futures_util::Stream;
use lapin::Acker;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicNackOptions, BasicQosOptions, BasicRejectOptions,
};
use lapin::types::{AMQPValue, FieldTable};
use lapin::{Channel, Consumer};

/// One entry of a message's `x-death` history.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct XDeath {
    /// `expired`, `rejected`, `maxlen` or `delivery_limit`.
    pub reason: String,
    pub queue: String,
    pub count: i64,
    /// Seconds since the epoch.
    pub time_s: Option<u64>,
    pub exchange: Option<String>,
    pub original_expiration: Option<String>,
}

/// A received delivery, with the fields lastcall uses.
#[derive(Debug)]
pub struct Incoming {
    pub body: Vec<u8>,
    pub delivery_tag: u64,
    /// The [`IncomingStream`] (consumer channel) of this process that delivered it:
    /// delivery tags start again at 1 on every channel, so only `(stream, delivery_tag)`
    /// names a delivery once a consumer has reconnected.
    pub stream: u64,
    pub redelivered: bool,
    pub routing_key: String,
    /// The `message_id` property (lastcall sets it to the job id).
    pub message_id: Option<String>,
    /// `x-lastcall-attempt`, 0 when absent.
    pub attempt: u32,
    pub signature: Option<String>,
    /// The `expiration` property as delivered (RabbitMQ strips it when dead-lettering).
    pub expiration: Option<String>,
    /// Publish time from the `timestamp` property, in seconds.
    pub timestamp_s: Option<u64>,
    /// `x-death`, most recent first, as RabbitMQ orders it.
    pub x_death: Vec<XDeath>,
    /// `x-delivery-count` (quorum queues).
    pub delivery_count: Option<i64>,
    /// The `reply_to` property: where a streaming call's token deltas go (set by the
    /// front door through direct reply-to, see [`crate::deltas`]).
    pub reply_to: Option<String>,
    pub settler: Settler,
}

/// Settles one delivery with the broker.
#[derive(Debug)]
pub struct Settler {
    acker: Acker,
}

impl Settler {
    /// Acknowledge: the broker forgets the message. Call only after the durable write.
    pub async fn ack(&self) -> Result<(), BrokerError> {
        self.acker
            .ack(BasicAckOptions::default())
            .await
            .map(|_| ())
            .map_err(|source| BrokerError::Amqp {
                doing: "acking",
                source,
            })
    }

    /// Acknowledge this delivery **and every earlier unsettled delivery on its channel**
    /// (`multiple`). The caller must know that each of them is durably recorded, and that
    /// none of them is settled later by another way (the broker would close the channel
    /// on an unknown delivery tag).
    pub async fn ack_multiple(&self) -> Result<(), BrokerError> {
        self.acker
            .ack(BasicAckOptions { multiple: true })
            .await
            .map(|_| ())
            .map_err(|source| BrokerError::Amqp {
                doing: "acking (multiple)",
                source,
            })
    }

    /// Reject without requeue: the queue's dead-letter exchange takes it.
    pub async fn dead_letter(&self) -> Result<(), BrokerError> {
        self.acker
            .reject(BasicRejectOptions { requeue: false })
            .await
            .map(|_| ())
            .map_err(|source| BrokerError::Amqp {
                doing: "rejecting to the dead-letter exchange",
                source,
            })
    }

    /// Hand the delivery back to the queue (graceful shutdown of a job that never started,
    /// and test fixtures). The deadline in the body is unchanged; a stale redelivery is
    /// refused by the next worker's checks.
    pub async fn requeue(&self) -> Result<(), BrokerError> {
        self.acker
            .nack(BasicNackOptions {
                multiple: false,
                requeue: true,
            })
            .await
            .map(|_| ())
            .map_err(|source| BrokerError::Amqp {
                doing: "requeueing",
                source,
            })
    }
}

/// A stream of deliveries from the consumers of one channel (one queue, or several: the
/// worker's lanes), merged. It ends as soon as any of its consumers ends (the broker
/// cancelled it, or the channel closed): a stream that went on without one of its queues
/// would stop taking that queue's jobs unnoticed, so the caller reopens them all.
pub struct IncomingStream {
    consumers: Vec<Consumer>,
    /// One delivery taken from each consumer ahead of time: the stream yields the one
    /// with the lowest delivery tag, so deliveries leave in the channel's order.
    ahead: Vec<Option<lapin::message::Delivery>>,
    tags: Vec<lapin::types::ShortString>,
    channel: Channel,
    /// Unique within the process ([`Incoming::stream`]).
    stream: u64,
}

static STREAMS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

impl std::fmt::Debug for IncomingStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IncomingStream").finish_non_exhaustive()
    }
}

impl IncomingStream {
    /// Start consuming `queue` with manual acks and `prefetch` unacked deliveries at most.
    pub async fn open(
        broker: &Broker,
        queue: &str,
        prefetch: u16,
        tag: &str,
    ) -> Result<Self, BrokerError> {
        Self::open_queues(broker, &[queue.to_owned()], prefetch, tag).await
    }

    /// Consume each of `queues` on one channel (delivery tags, and so acks, are per
    /// channel), each consumer with its own window of `prefetch` unacked deliveries (the
    /// per-consumer `basic.qos`): a queue that is never empty cannot hold the window of
    /// another. Consumer tags are `tag` for the first queue and `tag-<i>` for the others.
    pub async fn open_queues(
        broker: &Broker,
        queues: &[String],
        prefetch: u16,
        tag: &str,
    ) -> Result<Self, BrokerError> {
        let channel = broker.channel().await?;
        channel
            .basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(|source| BrokerError::Amqp {
                doing: "setting prefetch",
                source,
            })?;
        let mut consumers = Vec::with_capacity(queues.len());
        let mut tags = Vec::with_capacity(queues.len());
        for (i, queue) in queues.iter().enumerate() {
            let tag = match i {
                0 => tag.to_owned(),
                i => format!("{tag}-{i}"),
            };
            let consumer = channel
                .basic_consume(
                    queue.as_str().into(),
                    tag.as_str().into(),
                    BasicConsumeOptions::default(),
                    FieldTable::default(),
                )
                .await
                .map_err(|source| BrokerError::Amqp {
                    doing: "starting the consumer",
                    source,
                })?;
            tags.push(consumer.tag());
            consumers.push(consumer);
        }
        let stream = STREAMS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Ok(Self {
            ahead: consumers.iter().map(|_| None).collect(),
            consumers,
            tags,
            channel,
            stream,
        })
    }

    /// The next delivery, in delivery-tag order across the channel's consumers; `None`
    /// when a consumer was cancelled or the channel closed.
    ///
    /// The order matters: the worker's ack plan takes deliveries in tag order, and a
    /// `multiple` ack settles every delivery up to its tag on the channel — taking the
    /// consumers in rotation once let a higher tag of one lane be registered before a
    /// lower one still waiting in another lane's consumer, which a `multiple` ack could
    /// then settle before its job was recorded. lapin hands each consumer its deliveries
    /// as the channel's frames arrive, in order, so once every consumer without a
    /// delivery taken ahead has been polled empty, the lowest tag taken ahead is the
    /// lowest not yet yielded.
    pub async fn next(&mut self) -> Option<Result<Incoming, BrokerError>> {
        let item = std::future::poll_fn(|cx| {
            for (consumer, ahead) in self.consumers.iter_mut().zip(self.ahead.iter_mut()) {
                if ahead.is_some() {
                    continue;
                }
                match std::pin::Pin::new(consumer).poll_next(cx) {
                    std::task::Poll::Ready(Some(Ok(d))) => *ahead = Some(d),
                    std::task::Poll::Ready(Some(Err(e))) => {
                        return std::task::Poll::Ready(Some(Err(e)));
                    }
                    std::task::Poll::Ready(None) => return std::task::Poll::Ready(None),
                    std::task::Poll::Pending => {}
                }
            }
            let lowest = (self.ahead.iter().enumerate())
                .filter_map(|(i, d)| d.as_ref().map(|d| (d.delivery_tag, i)))
                .min();
            match lowest {
                Some((_, i)) => std::task::Poll::Ready(self.ahead[i].take().map(Ok)),
                None => std::task::Poll::Pending,
            }
        })
        .await?;
        let stream = self.stream;
        Some(
            item.map(|d| convert(d, stream))
                .map_err(|source| BrokerError::Amqp {
                    doing: "consuming",
                    source,
                }),
        )
    }

    /// Stop receiving new deliveries; unsettled ones stay with this channel until settled
    /// or until the channel closes (then the broker requeues them).
    pub async fn cancel(&self) {
        for tag in &self.tags {
            let cancel = self
                .channel
                .basic_cancel(tag.clone(), lapin::options::BasicCancelOptions::default());
            crate::goodbye("cancelling the consumer", cancel).await;
        }
    }

    /// Close the channel; the broker requeues every unsettled delivery.
    pub async fn close(&self) {
        crate::goodbye("closing the channel", self.channel.close(200, "bye".into())).await;
    }
}

/// How an [`IncomingStream::for_each`] loop ended.
#[derive(Debug)]
pub enum Ended {
    /// `stop` fired, or the handler stopped before it could settle a delivery. The
    /// consumer is cancelled and its channel closed (the broker requeues what is unsettled).
    Stopped,
    /// No delivery arrived for the idle time; cancelled and closed as for `Stopped`.
    Idle,
    /// The stream ended: the broker cancelled the consumer or the channel closed.
    Closed,
    /// Consuming failed, e.g. the connection was lost.
    Failed(BrokerError),
}

impl IncomingStream {
    /// The consume loop of the queues lastcall drains itself (dead letters, due retries):
    /// hand each delivery to `handle` until `stop` fires, no delivery arrives for `idle`
    /// (never without it), `handle` returns `false` (stopping before it could settle the
    /// delivery: it stays unacked), or the consumer is lost. Settling is `handle`'s: it
    /// acks only after its durable write. After [`Ended::Closed`] and [`Ended::Failed`]
    /// the caller decides between reconnecting and giving up.
    pub async fn for_each<F, Fut>(
        &mut self,
        stop: &tokio_util::sync::CancellationToken,
        idle: Option<std::time::Duration>,
        mut handle: F,
    ) -> Ended
    where
        F: FnMut(Incoming) -> Fut,
        Fut: std::future::Future<Output = bool>,
    {
        let idle = idle.unwrap_or(std::time::Duration::from_secs(u64::MAX / 4));
        let ended = loop {
            let next = tokio::select! {
                _ = stop.cancelled() => break Ended::Stopped,
                _ = tokio::time::sleep(idle) => break Ended::Idle,
                n = self.next() => n,
            };
            match next {
                None => return Ended::Closed,
                Some(Err(e)) => return Ended::Failed(e),
                Some(Ok(m)) => {
                    if !handle(m).await {
                        break Ended::Stopped;
                    }
                }
            }
        };
        self.cancel().await;
        self.close().await;
        ended
    }
}

/// What lastcall reads from a delivery's properties and headers (the AMQP side of the
/// wire format): any property or header may be missing, of another type or hostile;
/// nothing here fails or panics (the worker's fuzz target checks with arbitrary tables).
#[derive(Debug, Clone, PartialEq, Default)]
pub struct DeliveryMeta {
    /// The `message_id` property as sent (any text: escape it before logging).
    pub message_id: Option<String>,
    /// `x-lastcall-attempt` if it is an integer, clamped to `0..=u32::MAX`; else 0.
    pub attempt: u32,
    /// `x-lastcall-signature` if it is a string.
    pub signature: Option<String>,
    pub expiration: Option<String>,
    pub timestamp_s: Option<u64>,
    pub x_death: Vec<XDeath>,
    pub delivery_count: Option<i64>,
    pub reply_to: Option<String>,
}

/// Read a delivery's properties and headers.
pub fn delivery_meta(props: &lapin::BasicProperties) -> DeliveryMeta {
    let empty = FieldTable::default();
    let h = props.headers().as_ref().unwrap_or(&empty).inner();
    let attempt = h
        .get(ATTEMPT_HEADER)
        .and_then(as_i64)
        .map(|n| n.clamp(0, u32::MAX as i64) as u32)
        .unwrap_or(0);
    let signature = h.get(SIGNATURE_HEADER).and_then(as_string);
    let delivery_count = h.get("x-delivery-count").and_then(as_i64);
    let x_death = match h.get("x-death") {
        Some(AMQPValue::FieldArray(arr)) => arr
            .as_slice()
            .iter()
            .filter_map(|v| match v {
                AMQPValue::FieldTable(t) => Some(parse_x_death(t)),
                _ => None,
            })
            .collect(),
        _ => Vec::new(),
    };
    DeliveryMeta {
        message_id: props.message_id().as_ref().map(|s| s.as_str().to_owned()),
        attempt,
        signature,
        expiration: props.expiration().as_ref().map(|s| s.as_str().to_owned()),
        timestamp_s: *props.timestamp(),
        x_death,
        delivery_count,
        reply_to: props.reply_to().as_ref().map(|s| s.as_str().to_owned()),
    }
}

fn convert(d: lapin::message::Delivery, stream: u64) -> Incoming {
    let m = delivery_meta(&d.properties);
    Incoming {
        delivery_tag: d.delivery_tag,
        stream,
        redelivered: d.redelivered,
        routing_key: d.routing_key.as_str().to_owned(),
        message_id: m.message_id,
        attempt: m.attempt,
        signature: m.signature,
        expiration: m.expiration,
        timestamp_s: m.timestamp_s,
        x_death: m.x_death,
        delivery_count: m.delivery_count,
        reply_to: m.reply_to,
        body: d.data,
        settler: Settler { acker: d.acker },
    }
}

fn parse_x_death(t: &FieldTable) -> XDeath {
    let m = t.inner();
    XDeath {
        reason: m.get("reason").and_then(as_string).unwrap_or_default(),
        queue: m.get("queue").and_then(as_string).unwrap_or_default(),
        count: m.get("count").and_then(as_i64).unwrap_or(0),
        time_s: match m.get("time") {
            Some(AMQPValue::Timestamp(ts)) => Some(*ts),
            _ => None,
        },
        exchange: m.get("exchange").and_then(as_string),
        original_expiration: m.get("original-expiration").and_then(as_string),
    }
}

fn as_i64(v: &AMQPValue) -> Option<i64> {
    match v {
        AMQPValue::ShortShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortInt(n) => Some(i64::from(*n)),
        AMQPValue::ShortUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongInt(n) => Some(i64::from(*n)),
        AMQPValue::LongUInt(n) => Some(i64::from(*n)),
        AMQPValue::LongLongInt(n) => Some(*n),
        AMQPValue::Timestamp(n) => i64::try_from(*n).ok(),
        _ => None,
    }
}

fn as_string(v: &AMQPValue) -> Option<String> {
    match v {
        AMQPValue::LongString(s) => Some(String::from_utf8_lossy(s.as_bytes()).into_owned()),
        AMQPValue::ShortString(s) => Some(s.as_str().to_owned()),
        _ => None,
    }
}
