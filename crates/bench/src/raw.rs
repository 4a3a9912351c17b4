//! Raw broker loops for `lastcall bench ack-modes`: a PerfTest-style publisher and bare
//! consumers that do nothing but settle, on lapin itself. They bypass lastcall's broker
//! adapter (`lastcall-broker`) on purpose: what they measure is the broker's ceiling, the
//! baseline the worker's pipeline is compared with. Besides the adapter, this is the one
//! place that knows lapin; it reads the URL as the adapter does
//! (`lastcall_broker::tls::Target`: TLS settings, IP hosts).
//!
//! Every message body starts with its publish time (µs since the run's `origin`, a
//! monotonic instant the publisher and the consumers of this process share; 8 bytes
//! little-endian) and is padded to the configured size, so a consumer can measure
//! publish→consume latency without a header.

use anyhow::{Context, Result, anyhow};
use futures_util::StreamExt;
use lapin::options::{
    BasicAckOptions, BasicConsumeOptions, BasicPublishOptions, BasicQosOptions,
    ConfirmSelectOptions, QueueDeclareOptions, QueueDeleteOptions,
};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel, Confirmation, Connection, ConnectionProperties};
use lastcall_broker::QueueType;
use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// A raw connection to the first node of `urls` (one URL or a comma-separated list) that
/// answers.
pub async fn connect(urls: &str) -> Result<Connection> {
    let mut last = None;
    for url in urls.split(',').map(str::trim).filter(|u| !u.is_empty()) {
        let target = lastcall_broker::tls::Target::parse(url)
            .map_err(|m| anyhow!("invalid broker URL {}: {m}", lastcall_broker::redact(url)))?;
        let runtime = lapin::runtime::default_runtime()?;
        match Connection::connect_uri_with_config(
            target.uri,
            ConnectionProperties::default(),
            target.tls,
            runtime,
        )
        .await
        {
            Ok(c) => return Ok(c),
            Err(e) => {
                last = Some(anyhow::Error::new(e).context(format!(
                    "cannot connect to RabbitMQ at {}",
                    lastcall_broker::redact(url)
                )))
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow!("no broker URL given")))
}

async fn channel(conn: &Connection) -> Result<Channel> {
    conn.create_channel().await.context("opening a channel")
}

/// Microseconds from `origin` to now (monotonic).
fn micros_since(origin: Instant) -> u64 {
    origin.elapsed().as_micros() as u64
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
    /// The instant the bodies' publish stamps count from.
    pub origin: Instant,
}

/// Declare the bench queue fresh (deleted first).
pub async fn declare_queue(conn: &Connection, cfg: &RunConfig) -> Result<()> {
    let ch = channel(conn).await?;
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
    .context("declaring the bench queue")?;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
}

/// Delete the bench queue.
pub async fn delete_queue(conn: &Connection, queue: &str) -> Result<()> {
    let ch = channel(conn).await?;
    let _ = ch
        .queue_delete(queue.into(), QueueDeleteOptions::default())
        .await;
    let _ = ch.close(200, "ok".into()).await;
    Ok(())
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
    conn: &Connection,
    cfg: &RunConfig,
    body: Option<&[u8]>,
    progress: Arc<AtomicU64>,
) -> Result<Published> {
    let ch = channel(conn).await?;
    ch.confirm_select(ConfirmSelectOptions::default())
        .await
        .context("enabling publisher confirms")?;
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
            template[..8].copy_from_slice(&micros_since(cfg.origin).to_le_bytes());
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
            .context("publishing")?;
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

async fn wait_confirm(c: lapin::PublisherConfirm, nacked: &mut u64) -> Result<()> {
    if let Confirmation::Nack(_) = c.await.context("waiting for a confirm")? {
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
    /// The instant the publisher's stamps count from (its `RunConfig::origin`).
    pub origin: Instant,
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
) -> Result<ConsumeResult> {
    let ConsumeSpec {
        mode,
        stop_after,
        crash_after,
        work,
        record_latency,
        origin,
    } = spec;
    let conn = connect(url).await?;
    let ch = channel(&conn).await?;
    let (no_ack, prefetch) = match mode {
        AckMode::Auto => (true, 0),
        AckMode::Manual { prefetch } | AckMode::Multiple { prefetch, .. } => (false, prefetch),
    };
    if !no_ack {
        ch.basic_qos(prefetch, BasicQosOptions::default())
            .await
            .context("setting prefetch")?;
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
        .context("starting a bench consumer")?;
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
            Ok(Some(d)) => d.context("consuming")?,
        };
        first.get_or_insert_with(Instant::now);
        if record_latency && d.data.len() >= 8 {
            let sent = u64::from_le_bytes(d.data[..8].try_into().expect("8 bytes"));
            out.latencies_us
                .push(micros_since(origin).saturating_sub(sent));
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
                    .context("acking")?;
            }
            AckMode::Multiple { every, .. } => {
                since_ack += 1;
                if since_ack >= every.max(1) {
                    d.acker
                        .ack(BasicAckOptions { multiple: true })
                        .await
                        .context("acking")?;
                    since_ack = 0;
                } else if shared.load(Ordering::Relaxed) + 1 >= stop_after {
                    // The last delivery of the run settles everything before it.
                    d.acker
                        .ack(BasicAckOptions { multiple: true })
                        .await
                        .context("acking")?;
                    since_ack = 0;
                }
            }
        }
        out.processed += 1;
        shared.fetch_add(1, Ordering::Relaxed);
    }
    out.elapsed = first.map(|t| t.elapsed()).unwrap_or_default();
    let _ = conn.close(200, "ok".into()).await;
    Ok(out)
}

/// Messages ready in `queue` (passive declare; 0 if it does not exist).
pub async fn ready(conn: &Connection, queue: &str) -> Result<u64> {
    let ch = channel(conn).await?;
    let declared = ch
        .queue_declare(
            queue.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    let _ = ch.close(200, "ok".into()).await;
    Ok(declared.map(|q| u64::from(q.message_count())).unwrap_or(0))
}
