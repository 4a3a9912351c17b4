//! Confirmed publishing.

use crate::{Broker, BrokerError};
use futures_util::StreamExt;
use lapin::Confirmation;
use lapin::options::{BasicConsumeOptions, BasicPublishOptions, ConfirmSelectOptions};
use lapin::types::{AMQPValue, FieldTable, LongString};
use lapin::{BasicProperties, Channel};
use std::time::Duration;

/// Header carrying the 0-based attempt number.
pub const ATTEMPT_HEADER: &str = "x-lastcall-attempt";
/// Header carrying the ingress signature (docs/wire-format.md).
pub const SIGNATURE_HEADER: &str = "x-lastcall-signature";

/// RabbitMQ's direct reply-to pseudo-queue: a consumer on it (no-ack) gets what is
/// published to the `reply_to` address of the messages its channel published.
pub const DIRECT_REPLY_TO: &str = lastcall_core::delta::DIRECT_REPLY_TO;

/// Per-message properties set by lastcall.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PublishProps {
    pub job_id: String,
    /// `expiration`: the remaining budget in ms at this publish. `None` only for copies
    /// kept for humans (the parked queue), never for work.
    pub ttl_ms: Option<u64>,
    pub attempt: u32,
    /// `timestamp`, in seconds since the epoch.
    pub timestamp_s: u64,
    pub signature: Option<String>,
}

/// Why a publish was not accepted. None of these may be reported as "accepted".
#[derive(Debug, thiserror::Error)]
pub enum PublishError {
    #[error(
        "the broker refused the message (publisher nack); the queue may be full (overflow = reject-publish) or unavailable"
    )]
    Nacked,
    #[error("the broker did not confirm the publish within {0:?}")]
    ConfirmTimeout(Duration),
    #[error(
        "the message was returned as unroutable: no queue is bound for routing key `{0}` (run `lastcall topology apply`)"
    )]
    Unroutable(String),
    #[error(
        "the broker is blocking publishers (a memory or disk alarm: connection.blocked); nothing was published, retry later"
    )]
    Blocked,
    /// The broker began blocking this connection while the publish awaited its confirm:
    /// RabbitMQ blocks a connection only at its first publish during an alarm, so that
    /// publish is neither confirmed nor known to be lost (as with a confirm timeout).
    #[error(
        "the broker began blocking publishers (a memory or disk alarm: connection.blocked) during this publish; it is not confirmed and may still reach the queue once the alarm clears"
    )]
    BlockedInFlight,
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

impl PublishError {
    /// Whether the caller may try again (a confirm timeout or nack may be transient).
    pub fn is_retryable(&self) -> bool {
        !matches!(self, PublishError::Unroutable(_))
    }
}

/// A channel in confirm mode. One publish awaits its own confirm.
///
/// It heals itself: when its channel or connection is found closed at a publish, it
/// reconnects (one pass over the broker's node list, no waiting) and opens a new confirm
/// channel; if that fails the publish fails at once with the connection error, so a
/// caller (the HTTP ingress) answers `503` promptly instead of hanging, and the next
/// publish tries again. A message is only ever published on a channel whose confirm it
/// then awaits: nothing is reported as accepted across a reconnect.
#[derive(Clone)]
pub struct Publisher {
    inner: std::sync::Arc<tokio::sync::Mutex<Conn>>,
    confirm_timeout: Duration,
}

struct Conn {
    broker: Broker,
    channel: Channel,
    /// The channel saw a nack or a lost confirm: the next publish opens a new one.
    retired: bool,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("confirm_timeout", &self.confirm_timeout)
            .finish()
    }
}

impl Publisher {
    pub async fn new(broker: &Broker, confirm_timeout: Duration) -> Result<Self, BrokerError> {
        let channel = confirm_channel(broker).await?;
        Ok(Self {
            inner: std::sync::Arc::new(tokio::sync::Mutex::new(Conn {
                broker: broker.clone(),
                channel,
                retired: false,
            })),
            confirm_timeout,
        })
    }

    /// Whether the publisher's connection is up now (for readiness checks).
    pub async fn is_connected(&self) -> bool {
        let c = self.inner.lock().await;
        c.broker.is_connected() && c.channel.status().connected()
    }

    /// Whether the broker blocks this publisher's connection now (a resource alarm).
    pub async fn is_blocked(&self) -> bool {
        self.inner.lock().await.broker.is_blocked()
    }

    /// The confirm channel to publish on (and its connection), healed first if it is
    /// closed.
    async fn channel(&self) -> Result<(Channel, Broker), PublishError> {
        let mut c = self.inner.lock().await;
        // Fail fast under a resource alarm: a publish would only wait for the confirm
        // timeout, and the caller should hear "not accepted" now.
        if c.broker.is_connected() && c.broker.is_blocked() {
            return Err(PublishError::Blocked);
        }
        if c.channel.status().connected() && !c.retired {
            return Ok((c.channel.clone(), c.broker.clone()));
        }
        if !c.broker.is_connected() {
            let fresh = c.broker.reconnect_once().await?;
            tracing::warn!(node = %fresh.node(), "publisher reconnected to the broker");
            c.broker = fresh;
        }
        c.channel = confirm_channel(&c.broker).await?;
        c.retired = false;
        Ok((c.channel.clone(), c.broker.clone()))
    }

    /// Publish a persistent message and wait for the broker's confirm.
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: &PublishProps,
    ) -> Result<(), PublishError> {
        let (channel, broker) = self.channel().await?;
        let r = publish_confirmed(
            &channel,
            &broker,
            self.confirm_timeout,
            exchange,
            routing_key,
            body,
            props,
            None,
        )
        .await;
        if matches!(
            r,
            Err(PublishError::Nacked | PublishError::ConfirmTimeout(_))
        ) {
            self.retire(&channel).await;
        }
        r
    }

    /// Close `channel` if it is still the one publishes go to, so that the next publish
    /// opens a fresh one. After a nack or a lost confirm the channel's own view of a queue
    /// may be stale: on a cluster whose quorum-queue leader died, a channel opened before
    /// the new leader was known went on nacking every publish while a new channel on the
    /// same connection was confirmed (RELIABILITY.md, finding 2).
    async fn retire(&self, channel: &Channel) {
        let mut c = self.inner.lock().await;
        if c.channel.id() == channel.id() && !c.retired {
            tracing::info!(
                channel = channel.id(),
                "publisher: a publish was nacked or not confirmed; the next one uses a new channel"
            );
            c.retired = true;
            // Not awaited here: after a lost confirm the broker may not answer the close
            // either, and the caller must hear its error now.
            let old = c.channel.clone();
            tokio::spawn(async move {
                let _ = tokio::time::timeout(
                    Duration::from_secs(5),
                    old.close(200, "renewing after a nack".into()),
                )
                .await;
            });
        }
    }

    /// The messages ready in `queue` now (not yet delivered to a consumer), read with a
    /// passive `queue.declare` on a short-lived channel of the publisher's connection
    /// (healed first): the broker's live count, unlike the management API's, which is
    /// sampled every few seconds. `None` when the queue does not exist.
    pub async fn queue_ready(&self, queue: &str) -> Result<Option<u32>, PublishError> {
        let (_, broker) = self.channel().await?;
        Ok(crate::topology::queue_depth(&broker, queue)
            .await?
            .map(|(ready, _consumers)| ready))
    }

    /// A channel of its own on the publisher's connection (healed first, refused under a
    /// resource alarm), in confirm mode and consuming [`DIRECT_REPLY_TO`]: what it
    /// publishes carries that `reply_to`, and whatever the consumer of such a message
    /// publishes to the address RabbitMQ put there arrives on this channel. Closed when
    /// dropped (later replies are then discarded by the broker).
    pub async fn reply_channel(&self) -> Result<ReplyChannel, PublishError> {
        let (_, broker) = self.channel().await?;
        let channel = confirm_channel(&broker).await?;
        let consumer = channel
            .basic_consume(
                DIRECT_REPLY_TO.into(),
                "lastcall-reply".into(),
                BasicConsumeOptions {
                    no_ack: true,
                    ..Default::default()
                },
                FieldTable::default(),
            )
            .await
            .map_err(|source| BrokerError::Amqp {
                doing: "consuming direct reply-to",
                source,
            })?;
        Ok(ReplyChannel {
            channel,
            broker,
            consumer,
            confirm_timeout: self.confirm_timeout,
        })
    }
}

/// A per-request channel that publishes a job with `reply_to` set and receives what the
/// worker sends back there ([`Publisher::reply_channel`]). The broker pushes replies
/// without acks; they stay in this process until [`ReplyChannel::next`] takes them, which
/// a caller does as it forwards them (a reply stream is bounded by its job's output).
pub struct ReplyChannel {
    channel: Channel,
    broker: Broker,
    consumer: lapin::Consumer,
    confirm_timeout: Duration,
}

impl std::fmt::Debug for ReplyChannel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ReplyChannel").finish_non_exhaustive()
    }
}

impl ReplyChannel {
    /// [`Publisher::publish`] on this channel, with `reply_to` = [`DIRECT_REPLY_TO`].
    pub async fn publish(
        &self,
        exchange: &str,
        routing_key: &str,
        body: &[u8],
        props: &PublishProps,
    ) -> Result<(), PublishError> {
        publish_confirmed(
            &self.channel,
            &self.broker,
            self.confirm_timeout,
            exchange,
            routing_key,
            body,
            props,
            Some(DIRECT_REPLY_TO),
        )
        .await
    }

    /// The next reply's body; `None` once the channel or its connection is gone.
    pub async fn next(&mut self) -> Option<Vec<u8>> {
        match self.consumer.next().await? {
            Ok(d) => Some(d.data),
            Err(_) => None,
        }
    }
}

impl Drop for ReplyChannel {
    fn drop(&mut self) {
        let ch = self.channel.clone();
        if let Ok(rt) = tokio::runtime::Handle::try_current() {
            rt.spawn(async move {
                crate::goodbye("closing a channel", ch.close(200, "bye".into())).await;
            });
        }
    }
}

/// Publish on `channel` (confirm mode) and wait for its confirm, or for the broker to
/// block `broker`'s connection.
#[allow(clippy::too_many_arguments)]
async fn publish_confirmed(
    channel: &Channel,
    broker: &Broker,
    confirm_timeout: Duration,
    exchange: &str,
    routing_key: &str,
    body: &[u8],
    props: &PublishProps,
    reply_to: Option<&str>,
) -> Result<(), PublishError> {
    let mut headers = FieldTable::default();
    headers.insert(
        ATTEMPT_HEADER.into(),
        AMQPValue::LongLongInt(i64::from(props.attempt)),
    );
    if let Some(sig) = &props.signature {
        headers.insert(
            SIGNATURE_HEADER.into(),
            AMQPValue::LongString(LongString::from(sig.as_bytes().to_vec())),
        );
    }
    let mut properties = BasicProperties::default()
        .with_delivery_mode(2)
        .with_content_type("application/json".into())
        .with_message_id(props.job_id.as_str().into())
        .with_timestamp(props.timestamp_s)
        .with_headers(headers);
    if let Some(ttl) = props.ttl_ms {
        properties = properties.with_expiration(ttl.to_string().into());
    }
    if let Some(r) = reply_to {
        properties = properties.with_reply_to(r.into());
    }
    let confirmed = async {
        let confirm = channel
            .basic_publish(
                exchange.into(),
                routing_key.into(),
                BasicPublishOptions {
                    mandatory: true,
                    ..Default::default()
                },
                body,
                properties,
            )
            .await
            .map_err(|source| BrokerError::Amqp {
                doing: "publishing",
                source,
            })?;
        tokio::time::timeout(confirm_timeout, confirm)
            .await
            .map_err(|_| PublishError::ConfirmTimeout(confirm_timeout))?
            .map_err(|source| {
                PublishError::from(BrokerError::Amqp {
                    doing: "waiting for the publisher confirm",
                    source,
                })
            })
    };
    // RabbitMQ blocks a connection at its first publish under an alarm and stops reading
    // from it: that publish would wait for the whole confirm timeout. Answer as soon as
    // the broker says `connection.blocked` instead.
    let confirmation = tokio::select! {
        c = confirmed => c?,
        () = became_blocked(broker) => return Err(PublishError::BlockedInFlight),
    };
    match confirmation {
        Confirmation::Ack(None) => Ok(()),
        Confirmation::Ack(Some(_)) => Err(PublishError::Unroutable(routing_key.to_owned())),
        Confirmation::Nack(_) => Err(PublishError::Nacked),
        Confirmation::NotRequested => unreachable!("confirm mode is enabled in Publisher::new"),
    }
}

/// Resolves once the broker has blocked `broker`'s connection (polled: lapin keeps the flag).
async fn became_blocked(broker: &Broker) {
    while !broker.is_blocked() {
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// A new channel in confirm mode.
async fn confirm_channel(broker: &Broker) -> Result<Channel, BrokerError> {
    let channel = broker.channel().await?;
    channel
        .confirm_select(ConfirmSelectOptions::default())
        .await
        .map_err(|source| BrokerError::Amqp {
            doing: "enabling publisher confirms",
            source,
        })?;
    Ok(channel)
}
