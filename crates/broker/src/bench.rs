//! Raw broker loops for `lastcall bench ack-modes`: a PerfTest-style publisher and bare
//! consumers that do nothing but settle. They live here because this is the only crate
//! that knows lapin; the CLI only sees plain numbers.
//!
//! Every message body starts with its publish time (µs since the epoch, 8 bytes
//! little-endian) and is padded to the configured size, so a consumer can measure
//! publish→consume latency without a header.

use crate::topology::QueueType;
use crate::{Broker, BrokerError};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Confirmation};
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

fn amqp(doing: &'static str) -> impl Fn(lapin::Error) -> BrokerError {
    move |source| BrokerError::Amqp { doing, source }
}

/// How a bench consumer acknowledges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AckMode {
    /// `no_ack = true`: the broker forgets a message as soon as it is sent.
    Auto,
    /// One `basic.ack` per delivery, at most `prefetch` unacked.
    Manual { prefetch: u16 },
    /// One `basic.ack` with `multiple = true` every `every` deliveries (the consumer
    /// settles in order, so the covered range is exactly the deliveries it has finished).
    Multiple { prefetch: u16, every: u16 },
}

impl std::fmt::Display for AckMode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AckMode::Auto => write!(f, "auto-ack"),
            AckMode::Manual { prefetch } => write!(f, "manual prefetch={prefetch}"),
            AckMode::Multiple { prefetch, every } => {
                write!(f, "manual prefetch={prefetch} multiple every {every}")
            }
        }
    }
}

/// The fixed levers of a run (printed with the results so that runs are comparable).
#[derive(Debug, Clone)]
pub struct RunConfig {
    pub queue: String,
    pub queue_type: QueueType,
    /// Durable queue and persistent messages (delivery mode 2).
    pub durable: bool,
    pub message_bytes: usize,
    /// Unconfirmed publishes in flight at most.
    pub confirm_window: usize,
    pub consumers: usize,
    pub messages: u64,
}

/// Declare the bench queue fresh (deleted first).
pub async fn declare_queue(broker: &Broker, cfg: &RunConfig) -> Result<(), BrokerError> {
    let ch = broker.channel().await?;
    let _ = ch
        .queue_delete(cfg.queue.as_str().into(), QueueDeleteOptions::default())
        .await;
    let mut args = FieldTable::default();
    if cfg.queue_type == QueueType::Quorum {
        args.insert(
            "x-queue-type".into(),
            AMQPValue::LongString(LongString::from(b"quorum".to_vec())),
        );
    }
    ch.queue_declare(
        cfg.queue.as_str().into(),
        QueueDeclareOptions {
            durable: cfg.durable || cfg.queue_type == QueueType::Quorum,
            ..Default::default()
        },
        args,
    )
    .await
    .map_err(amqp("declaring the bench queue"))?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// Delete the bench queue.
pub async fn delete_queue(broker: &Broker, queue: &str) -> Result<(), BrokerError> {
    let ch = broker.channel().await?;
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// Microseconds since the epoch.
pub fn now_us() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .as_micros() as u64
}

/// The publisher's side of a run.
#[derive(Debug, Clone, Copy, Default)]
pub struct Published {
    pub elapsed: Duration,
    /// Publishes the broker refused (should be zero).
    pub nacked: u64,
}

/// Publish `messages` bodies of `message_bytes` to `queue` (default exchange) with at
/// most `confirm_window` unconfirmed; `body` gives a template (the first 8 bytes are
/// overwritten with the publish time unless a template is given). `progress` counts
/// confirmed publishes.
pub async fn publish(
    broker: &Broker,
    cfg: &RunConfig,
    body: Option<&[u8]>,
    progress: Arc<AtomicU64>,
) -> Result<Published, BrokerError> {
    let ch = broker.channel().await?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(amqp("enabling publisher confirms"))?;
    let mut template = body
        .map(<[u8]>::to_vec)
        .unwrap_or_else(|| vec![b'x'; cfg.message_bytes.max(8)]);
    if template.len() < 8 {
        template.resize(8, b' ');
    }
    let stamp = body.is_none();
    let props = if cfg.durable {
        BasicProperties::default().with_delivery_mode(2)
    } else {
        BasicProperties::default()
    };
    let t0 = Instant::now();
    let mut pending = VecDeque::new();
    let mut nacked = 0u64;
    for _ in 0..cfg.messages {
        if stamp {
            template[..8].copy_from_slice(&now_us().to_le_bytes());
        }
        let c = ch
            .basic_publish(
                "".into(),
                cfg.queue.as_str().into(),
                BasicPublishOptions::default(),
                &template,
                props.clone(),
            )
            .await
            .map_err(amqp("publishing"))?;
        pending.push_back(c);
        while pending.len() >= cfg.confirm_window.max(1) {
            wait_confirm(pending.pop_front().expect("non-empty"), &mut nacked).await?;
            progress.fetch_add(1, Ordering::Relaxed);
        }
    }
    while let Some(c) = pending.pop_front() {
        wait_confirm(c, &mut nacked).await?;
        progress.fetch_add(1, Ordering::Relaxed);
    }
    let elapsed = t0.elapsed();
    let _ = ch.close(200, "ok".into()).await;
    Ok(Published { elapsed, nacked })
}

async fn wait_confirm(c: lapin::PublisherConfirm, nacked: &mut u64) -> Result<(), BrokerError> {
    if let Confirmation::Nack(_) = c.await.map_err(amqp("waiting for a confirm"))? {
        *nacked += 1;
    }
    Ok(())
}

/// What one bare consumer saw.
#[derive(Debug, Default, Clone)]
pub struct ConsumeResult {
    /// Deliveries received and "processed" (settled, for manual modes).
    pub processed: u64,
    /// Deliveries flagged `redelivered` by the broker.
    pub redelivered: u64,
    /// Publish→consume latency per delivery, in µs (only for stamped bodies).
    pub latencies_us: Vec<u64>,
    /// From the first delivery to the last.
    pub elapsed: Duration,
}

/// What a bare consumer does.
#[derive(Debug, Clone, Copy)]
pub struct ConsumeSpec {
    pub mode: AckMode,
    /// Stop when all consumers together processed this many.
    pub stop_after: u64,
    /// Crash (drop the connection without settling) after this many.
    pub crash_after: Option<u64>,
    /// Simulated processing time per delivery.
    pub work: Duration,
    /// Record publish→consume latency from the body's timestamp.
    pub record_latency: bool,
}

/// A bare consumer: take deliveries and settle them per `mode` until `stop_after`
/// deliveries were processed (all consumers together count into `shared`), or, with
/// `crash_after`, drop the connection without settling after that many (a consumer
/// crash as the broker sees it). `work` is spent per delivery before it is settled
/// (simulated processing; zero for the throughput runs).
pub async fn consume(
    url: &str,
    queue: &str,
    spec: ConsumeSpec,
    shared: Arc<AtomicU64>,
) -> Result<ConsumeResult, BrokerError> {
    let ConsumeSpec {
        mode,
        stop_after,
        crash_after,
        work,
        record_latency,
    } = spec;
    let broker = Broker::connect(url).await?;
    let ch = broker.channel().await?;
    let (no_ack, prefetch) = match mode {
        AckMode::Auto => (true, 0),
        AckMode::Manual { prefetch } | AckMode::Multiple { prefetch, .. } => (false, prefetch),
    };
    if !no_ack {
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .map_err(amqp("setting prefetch"))?;
    }
    let mut consumer = ch
        .basic_consume(
            queue.into(),
            "lastcall-bench".into(),
            BasicConsumeOptions {
                no_ack,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map_err(amqp("starting a bench consumer"))?;
    let mut out = ConsumeResult::default();
    let mut first: Option<Instant> = None;
    let mut since_ack = 0u16;
    loop {
        if shared.load(Ordering::Relaxed) >= stop_after {
            break;
        }
        let next = tokio::time::timeout(Duration::from_millis(500), consumer.next()).await;
        let d = match next {
            Err(_) => continue, // idle: re-check the shared counter
            Ok(None) => break,
            Ok(Some(d)) => d.map_err(amqp("consuming"))?,
        };
        first.get_or_insert_with(Instant::now);
        if record_latency && d.data.len() >= 8 {
            let sent = u64::from_le_bytes(d.data[..8].try_into().expect("8 bytes"));
            out.latencies_us.push(now_us().saturating_sub(sent));
        }
        if d.redelivered {
            out.redelivered += 1;
        }
        if !work.is_zero() {
            tokio::time::sleep(work).await;
        }
        if crash_after.is_some_and(|n| out.processed >= n) {
            // Crash: no further settling; the broker sees the connection go away.
            break;
        }
        match mode {
            AckMode::Auto => {}
            AckMode::Manual { .. } => {
                d.acker
                    .ack(BasicAckOptions::default())
                    .await
                    .map_err(amqp("acking"))?;
            }
            AckMode::Multiple { every, .. } => {
                since_ack += 1;
                if since_ack >= every.max(1) {
                    d.acker
                        .ack(BasicAckOptions { multiple: true })
                        .await
                        .map_err(amqp("acking"))?;
                    since_ack = 0;
                } else if shared.load(Ordering::Relaxed) + 1 >= stop_after {
                    // The last delivery of the run settles everything before it.
                    d.acker
                        .ack(BasicAckOptions { multiple: true })
                        .await
                        .map_err(amqp("acking"))?;
                    since_ack = 0;
                }
            }
        }
        out.processed += 1;
        shared.fetch_add(1, Ordering::Relaxed);
    }
    out.elapsed = first.map(|t| t.elapsed()).unwrap_or_default();
    broker.close().await;
    Ok(out)
}

/// Messages ready in `queue` (passive declare).
pub async fn ready(broker: &Broker, queue: &str) -> Result<u64, BrokerError> {
    Ok(crate::topology::queue_depth(broker, queue)
        .await?
        .map(|(m, _)| u64::from(m))
        .unwrap_or(0))
}
