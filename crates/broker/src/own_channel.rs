//! A channel on a connection of its own, for the best-effort sinks (outcome events,
//! token deltas): opened at the first use, reopened after a loss, and given up on for
//! [`RETRY_AFTER`] after a failed reconnect, so that a sink drops what it cannot publish
//! instead of waiting for the broker.

use crate::{Broker, BrokerError};
use lapin::Channel;
use std::time::Duration;
use tokio::time::Instant;

/// After a failed reconnect, nothing is published (the sink drops) for this long.
const RETRY_AFTER: Duration = Duration::from_secs(1);

pub(crate) struct OwnChannel {
    /// The node list to connect to (the connection is opened from it).
    seed: Broker,
    conn: Option<(Broker, Channel)>,
    failed_at: Option<Instant>,
    /// What publishes here, for the logs ("outcome events").
    what: &'static str,
    /// What is dropped meanwhile and where it is kept all the same, for the warning.
    dropping: &'static str,
}

impl OwnChannel {
    pub(crate) fn new(seed: Broker, what: &'static str, dropping: &'static str) -> Self {
        Self {
            seed,
            conn: None,
            failed_at: None,
            what,
            dropping,
        }
    }

    /// The channel to publish on: the open one; else a new one on the connection (or on
    /// a new connection to the next node), unless a reconnect failed in the last
    /// [`RETRY_AFTER`]. `None` while the connection is blocked by a resource alarm: drop
    /// rather than queue up inside lapin.
    pub(crate) async fn channel(&mut self) -> Option<Channel> {
        if let Some((b, ch)) = &self.conn {
            if b.is_connected() && b.is_blocked() {
                return None;
            }
            if ch.status().connected() {
                return Some(ch.clone());
            }
        }
        if self.failed_at.is_some_and(|t| t.elapsed() < RETRY_AFTER) {
            return None;
        }
        let opened = async {
            let b = match self.conn.take() {
                Some((b, _)) if b.is_connected() => b,
                Some((b, _)) => b.reconnect_once().await?,
                None => self.seed.another().await?,
            };
            let ch = b.channel().await?;
            Ok::<_, BrokerError>((b, ch))
        }
        .await;
        match opened {
            Ok((b, ch)) => {
                if self.failed_at.take().is_some() {
                    tracing::info!(node = %b.node(), "{}: publishing again", self.what);
                }
                self.conn = Some((b, ch.clone()));
                Some(ch)
            }
            Err(e) => {
                if self.failed_at.is_none() {
                    tracing::warn!(error = %e, "{}: broker unreachable; dropping {}", self.what, self.dropping);
                }
                self.failed_at = Some(Instant::now());
                None
            }
        }
    }

    /// A publish failed: start from a new connection next time.
    pub(crate) fn forget(&mut self) {
        self.conn = None;
    }

    /// A publish failed on the channel (a malformed address closes it, say): open a new
    /// channel on the same connection now, or a new connection next time.
    pub(crate) async fn reopen(&mut self) {
        self.conn = self.conn.take().filter(|(b, _)| b.is_connected());
        if let Some((b, _)) = &self.conn {
            match b.channel().await {
                Ok(c) => self.conn = Some((b.clone(), c)),
                Err(_) => self.conn = None,
            }
        }
    }

    /// Close the connection politely (which flushes it); a later use opens a new one.
    pub(crate) async fn close(&mut self) {
        if let Some((b, _)) = self.conn.take() {
            b.close().await;
        }
    }
}
