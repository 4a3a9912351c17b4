//! The RabbitMQ adapter of lastcall. This is the only crate that knows lapin.
//!
//! # Layout
//! - [`topology`]: names (docs/wire-format.md) and the idempotent declaration of exchanges,
//!   queues, bindings and retry queues, with clear errors on conflicting declarations.
//! - [`publish`]: a confirm-mode publisher: persistent messages, `expiration` from the
//!   caller's remaining budget, and a confirm awaited as its own step (nack and timeout are
//!   errors, never "accepted").
//! - [`management`]: broker policies through the management HTTP API.
//! - [`consume`]: a manual-ack consumer yielding [`consume::Incoming`] deliveries with the
//!   attempt header and the parsed `x-death` history, and settle operations that never
//!   requeue.
//! - [`deltas`]: a worker's token deltas to a job's `reply_to` (bounded, best-effort);
//!   [`publish::ReplyChannel`] is the receiving side (direct reply-to).
//! - [`tls`]: the URL as lapin gets it: `amqps://` with `cacertfile` (a private CA),
//!   `certfile`/`keyfile` (a client certificate) read from the URL's query.

pub mod consume;
pub mod deltas;
pub mod events;
pub mod management;
mod own_channel;
pub mod publish;
pub mod tls;
pub mod topology;

pub use consume::{Incoming, IncomingStream, Settler, XDeath};
pub use deltas::{DeltaSink, DeltaTarget};
pub use events::EventSink;
pub use publish::{PublishError, PublishProps, Publisher, ReplyChannel};
pub use topology::{Names, QueueType, Topology, TopologyError};

use lapin::{Connection, ConnectionProperties};

/// The broker of every command that names none (`--amqp-url`, LASTCALL_AMQP_URL,
/// `amqp_url` in lastcall.toml): a local RabbitMQ with its default user. One definition for
/// `lastcall` and `lastcall-bench`.
pub const DEFAULT_AMQP_URL: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";

/// The prefix of every exchange and queue name when none is named (`--prefix`,
/// LASTCALL_PREFIX, `prefix` in lastcall.toml).
pub const DEFAULT_PREFIX: &str = "lastcall";

/// The cap every lastcall binary puts on its log filter: lapin's trace level logs the
/// AMQP login frame, password included, so `lapin::io_loop` never goes below debug,
/// whatever `LASTCALL_LOG` asks for; sqlx warns of a PostgreSQL URL parameter it does not
/// know with its value (`sslpassword=…`), so that target logs errors only. Combine it with the filter (`FilterExt::and`), rather
/// than adding a directive to it, which would instead raise that target to debug by default.
pub fn log_cap() -> tracing_subscriber::filter::Targets {
    use tracing_subscriber::filter::{LevelFilter, Targets};
    Targets::new()
        .with_default(LevelFilter::TRACE)
        .with_target("lapin::io_loop", LevelFilter::DEBUG)
        .with_target("sqlx_postgres::options::parse", LevelFilter::ERROR)
}

/// How long a polite goodbye (`basic.cancel`, `channel.close`, `connection.close`) may wait
/// for the broker's reply. lapin can miss that reply when a cancel and a close cross (seen:
/// `lastcall dlq --idle-exit-ms` hanging at exit on a loaded machine, after "invalid channel
/// state: Closing"). Going on without it is safe: the broker requeues whatever a closed
/// channel or connection left unsettled.
pub const GOODBYE_LIMIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Wait for a goodbye step at most [`GOODBYE_LIMIT`]; one warning if it does not finish.
pub(crate) async fn goodbye<F: std::future::Future>(what: &'static str, step: F) {
    if tokio::time::timeout(GOODBYE_LIMIT, step).await.is_err() {
        tracing::warn!(
            step = what,
            "the broker did not answer within {} s; going on without it",
            GOODBYE_LIMIT.as_secs()
        );
    }
}

/// How long one node may take to finish the AMQP handshake before the attempt counts as
/// failed (RabbitMQ's own `handshake_timeout` is 10 s; TLS and a busy node get the rest).
pub const HANDSHAKE_LIMIT: std::time::Duration = std::time::Duration::from_secs(30);

/// Connection-level errors.
#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    #[error(
        "cannot connect to RabbitMQ at {url}: {source}; is the broker running? (start it with `rabbitmq-server -detached`, or set LASTCALL_AMQP_URL)"
    )]
    Connect {
        url: String,
        #[source]
        source: lapin::Error,
    },
    /// The TCP connection opened but the AMQP handshake (TLS, login, vhost) did not finish
    /// within [`HANDSHAKE_LIMIT`]: a broker that accepts and never answers, or a client
    /// that missed the broker's refusal. Without this bound the command would hang.
    #[error(
        "cannot connect to RabbitMQ at {url}: no answer to the AMQP handshake within {} s; is it a RabbitMQ port, and is the node overloaded or blocked?",
        HANDSHAKE_LIMIT.as_secs()
    )]
    HandshakeTimeout { url: String },
    #[error(
        "no broker URL given: set LASTCALL_AMQP_URL or --amqp-url (a comma-separated list for a cluster)"
    )]
    NoUrl,
    /// A URL that cannot be used as given (bad syntax, a TLS setting on `amqp://`, a CA
    /// file that cannot be read): retrying would not help.
    #[error("invalid broker URL {url}: {message}")]
    Url { url: String, message: String },
    #[error("broker error while {doing}: {source}")]
    Amqp {
        doing: &'static str,
        #[source]
        source: lapin::Error,
    },
}

/// An open connection to the broker, and the node list it came from (for reconnecting).
#[derive(Clone)]
pub struct Broker {
    conn: std::sync::Arc<Connection>,
    urls: std::sync::Arc<Vec<String>>,
    /// Which of `urls` this connection went to.
    node: usize,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").finish_non_exhaustive()
    }
}

impl Broker {
    /// Connect to the first node that answers. `urls` is one AMQP URL or a comma-separated
    /// list (the nodes of a cluster), tried in order; the error names the last failure.
    /// Passwords are never logged.
    pub async fn connect(urls: &str) -> Result<Self, BrokerError> {
        let list: Vec<String> = urls
            .split(',')
            .map(str::trim)
            .filter(|u| !u.is_empty())
            .map(str::to_owned)
            .collect();
        Self::connect_list(std::sync::Arc::new(list), 0).await
    }

    /// Try the nodes starting at `first`, wrapping around, once each.
    async fn connect_list(
        urls: std::sync::Arc<Vec<String>>,
        first: usize,
    ) -> Result<Self, BrokerError> {
        let mut last = None;
        for i in 0..urls.len() {
            let node = (first + i) % urls.len();
            let url = &urls[node];
            match tls::connect(url, ConnectionProperties::default()).await {
                Ok(conn) => {
                    return Ok(Self {
                        conn: std::sync::Arc::new(conn),
                        urls,
                        node,
                    });
                }
                Err(e @ BrokerError::Url { .. }) => return Err(e),
                Err(e) => last = Some(e),
            }
        }
        Err(last.unwrap_or(BrokerError::NoUrl))
    }

    /// A new connection to the same node list, starting with the node after this one
    /// (failover), retried with exponential backoff and jitter (0.2 s doubling to 10 s)
    /// until it succeeds or `stop` fires (`None`). One log line when the wait starts
    /// failing, one when it succeeds; `max_wait` bounds the whole wait (`None`: unbounded).
    pub async fn reconnect(
        &self,
        stop: &tokio_util::sync::CancellationToken,
        max_wait: Option<std::time::Duration>,
    ) -> Option<Self> {
        Self::connect_with_backoff(self.urls.clone(), self.node + 1, stop, max_wait).await
    }

    /// One pass over the node list, starting after this node, without waiting: for a
    /// caller that must answer now (the publisher under a request).
    pub async fn reconnect_once(&self) -> Result<Self, BrokerError> {
        Self::connect_list(self.urls.clone(), self.node + 1).await
    }

    /// [`connect`](Self::connect), retried like [`reconnect`](Self::reconnect): for a
    /// process that starts while the broker is down.
    pub async fn connect_retrying(
        urls: &str,
        stop: &tokio_util::sync::CancellationToken,
        max_wait: Option<std::time::Duration>,
    ) -> Result<Self, BrokerError> {
        match Self::connect(urls).await {
            Ok(b) => Ok(b),
            Err(e @ (BrokerError::NoUrl | BrokerError::Url { .. })) => Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "broker not reachable; retrying with backoff");
                let list = std::sync::Arc::new(
                    urls.split(',')
                        .map(str::trim)
                        .filter(|u| !u.is_empty())
                        .map(str::to_owned)
                        .collect::<Vec<_>>(),
                );
                Self::connect_with_backoff(list, 0, stop, max_wait)
                    .await
                    .ok_or(e)
            }
        }
    }

    async fn connect_with_backoff(
        urls: std::sync::Arc<Vec<String>>,
        first: usize,
        stop: &tokio_util::sync::CancellationToken,
        max_wait: Option<std::time::Duration>,
    ) -> Option<Self> {
        let started = tokio::time::Instant::now();
        let mut delay = std::time::Duration::from_millis(200);
        let mut attempts = 0u32;
        let mut first = first;
        loop {
            match Self::connect_list(urls.clone(), first).await {
                Ok(b) => {
                    // At warn, like the loss it answers: a default log shows both.
                    tracing::warn!(
                        node = %redact(&b.urls[b.node]),
                        attempts,
                        after_ms = started.elapsed().as_millis() as u64,
                        "broker connection established"
                    );
                    return Some(b);
                }
                Err(e) => {
                    if attempts == 0 {
                        tracing::warn!(error = %e, "broker unreachable; reconnecting with backoff");
                    }
                    attempts += 1;
                    first = 0;
                }
            }
            if max_wait.is_some_and(|m| started.elapsed() >= m) {
                tracing::error!(
                    attempts,
                    "gave up reconnecting to the broker (--connect-timeout)"
                );
                return None;
            }
            // Full jitter on an exponential backoff: nodes do not all retry in step.
            let jittered = delay.mul_f64(0.5 + rand::random::<f64>() / 2.0);
            tokio::select! {
                _ = tokio::time::sleep(jittered) => {}
                _ = stop.cancelled() => return None,
            }
            delay = (delay * 2).min(std::time::Duration::from_secs(10));
        }
    }

    /// The node this connection went to (password hidden).
    pub fn node(&self) -> String {
        redact(&self.urls[self.node])
    }

    /// Resolves when the connection is no longer usable (closed or failed). Polls the
    /// connection state; lapin reports a lost connection there.
    pub async fn closed(&self) {
        while self.is_connected() {
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    }

    pub(crate) async fn channel(&self) -> Result<lapin::Channel, BrokerError> {
        self.conn
            .create_channel()
            .await
            .map_err(|source| BrokerError::Amqp {
                doing: "opening a channel",
                source,
            })
    }

    /// Close the connection politely (in-flight unacked deliveries go back to the queue).
    pub async fn close(&self) {
        goodbye("closing the connection", self.conn.close(200, "bye".into())).await;
    }

    /// Remove every ready message from a queue (demo and test set-up); returns the count.
    pub async fn purge(&self, queue: &str) -> Result<u32, BrokerError> {
        let ch = self.channel().await?;
        let n = ch
            .queue_purge(queue.into(), lapin::options::QueuePurgeOptions::default())
            .await
            .map_err(|source| BrokerError::Amqp {
                doing: "purging a queue",
                source,
            })?;
        goodbye("closing a channel", ch.close(200, "ok".into())).await;
        Ok(n)
    }

    /// Whether the connection is still usable.
    pub fn is_connected(&self) -> bool {
        self.conn.status().connected()
    }

    /// Whether the broker has blocked this connection (`connection.blocked`: a memory or
    /// disk alarm). Publishes would wait until the alarm clears.
    pub fn is_blocked(&self) -> bool {
        self.conn.status().blocked()
    }

    /// A second connection to the same node (same node list): for publishing apart from
    /// consuming, so that flow control on publishes never holds back a consumer's acks.
    pub async fn another(&self) -> Result<Self, BrokerError> {
        Self::connect_list(self.urls.clone(), self.node).await
    }
}

/// Hide the passwords of a URL (AMQP, the ledger's, the management API's) for messages:
/// `user:***@` and secret query parameters (`?password=***`); see
/// [`lastcall_core::redact::url`].
pub fn redact(url: &str) -> String {
    lastcall_core::redact::url(url)
}

#[cfg(test)]
mod tests {
    #[test]
    fn redacts_passwords() {
        assert_eq!(
            super::redact("amqp://guest:secret@h:5672/%2f"),
            "amqp://guest:***@h:5672/%2f"
        );
        assert_eq!(super::redact("amqp://h:5672"), "amqp://h:5672");
    }
}
