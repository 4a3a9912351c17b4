//! The RabbitMQ adapter of lastcall. This is the only crate that knows lapin.
//!
//! # Layout
//! - [`topology`]: names (CONTRACT §2) and the idempotent declaration of exchanges,
//!   queues, bindings and retry queues, with clear errors on conflicting declarations.
//! - [`publish`]: a confirm-mode publisher: persistent messages, `expiration` from the
//!   caller's remaining budget, and a confirm awaited as its own step (nack and timeout are
//!   errors, never "accepted").
//! - [`management`]: broker policies through the management HTTP API.
//! - [`consume`]: a manual-ack consumer yielding [`consume::Incoming`] deliveries with the
//!   attempt header and the parsed `x-death` history, and settle operations that never
//!   requeue.
//! - [`bench`]: raw publisher and bare consumers for `lastcall bench ack-modes` (auto-ack,
//!   manual, `multiple` acks, consumer crashes); never used by the worker.

pub mod bench;
pub mod consume;
pub mod management;
pub mod publish;
pub mod topology;

pub use consume::{Incoming, IncomingStream, Settler, XDeath};
pub use publish::{PublishError, PublishProps, Publisher};
pub use topology::{Names, QueueType, Topology, TopologyError};

use lapin::{Connection, ConnectionProperties};

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
    #[error("broker error while {doing}: {source}")]
    Amqp {
        doing: &'static str,
        #[source]
        source: lapin::Error,
    },
}

/// An open connection to the broker.
#[derive(Clone)]
pub struct Broker {
    conn: std::sync::Arc<Connection>,
}

impl std::fmt::Debug for Broker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Broker").finish_non_exhaustive()
    }
}

impl Broker {
    /// Connect; the URL's password is never logged.
    pub async fn connect(url: &str) -> Result<Self, BrokerError> {
        let conn = Connection::connect(url, ConnectionProperties::default())
            .await
            .map_err(|source| BrokerError::Connect {
                url: redact(url),
                source,
            })?;
        Ok(Self {
            conn: std::sync::Arc::new(conn),
        })
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
        let _ = self.conn.close(200, "bye".into()).await;
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
        let _ = ch.close(200, "ok".into()).await;
        Ok(n)
    }

    /// Whether the connection is still usable.
    pub fn is_connected(&self) -> bool {
        self.conn.status().connected()
    }
}

/// Hide the password of an AMQP URL for messages.
pub fn redact(url: &str) -> String {
    match (url.find("://"), url.rfind('@')) {
        (Some(s), Some(at)) if at > s + 3 => {
            let creds = &url[s + 3..at];
            match creds.find(':') {
                Some(c) => format!("{}{}:***{}", &url[..s + 3], &creds[..c], &url[at..]),
                None => url.to_owned(),
            }
        }
        _ => url.to_owned(),
    }
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
