//! Broker queue depths: ready and unacked per queue from RabbitMQ's management API, or,
//! when that is not reachable, the ready count from a passive queue declare (unacked is
//! then unknown). The management API refreshes its numbers every few seconds.

use lastcall_broker::Broker;
use serde_json::Value;
use std::time::Duration;

/// One queue's depth. `None` where the source cannot tell.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct QueueDepth {
    pub queue: String,
    pub ready: Option<u64>,
    pub unacked: Option<u64>,
    pub consumers: Option<u64>,
    /// `management` or `passive_declare`.
    pub source: &'static str,
}

/// Where the management API is.
#[derive(Debug, Clone)]
pub struct Management {
    /// e.g. `http://127.0.0.1:15672`
    pub base_url: String,
    pub user: String,
    pub password: String,
    /// The vhost, percent-encoded (`%2f` for `/`).
    pub vhost: String,
}

/// Reads the depths of a fixed list of queues (the topology's: bounded).
#[derive(Debug, Clone)]
pub struct DepthProbe {
    pub queues: Vec<String>,
    pub management: Option<Management>,
    pub broker: Option<Broker>,
    client: reqwest::Client,
}

impl DepthProbe {
    pub fn new(
        queues: Vec<String>,
        management: Option<Management>,
        broker: Option<Broker>,
    ) -> Self {
        let client = reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .build()
            .unwrap_or_default();
        Self {
            queues,
            management,
            broker,
            client,
        }
    }

    pub async fn depths(&self) -> Vec<QueueDepth> {
        let mut out = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            let mut d = None;
            if let Some(m) = &self.management {
                d = self.query_management(m, q).await;
            }
            if d.is_none()
                && let Some(b) = &self.broker
            {
                d = match lastcall_broker::topology::queue_depth(b, q).await {
                    Ok(Some((ready, consumers))) => Some(QueueDepth {
                        queue: q.clone(),
                        ready: Some(u64::from(ready)),
                        unacked: None,
                        consumers: Some(u64::from(consumers)),
                        source: "passive_declare",
                    }),
                    _ => None,
                };
            }
            if let Some(d) = d {
                out.push(d);
            }
        }
        out
    }

    async fn query_management(&self, m: &Management, queue: &str) -> Option<QueueDepth> {
        let url = format!(
            "{}/api/queues/{}/{}",
            m.base_url.trim_end_matches('/'),
            m.vhost,
            encode(queue)
        );
        let resp = self
            .client
            .get(url)
            .basic_auth(&m.user, Some(&m.password))
            .send()
            .await
            .ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let v: Value = serde_json::from_slice(&resp.bytes().await.ok()?).ok()?;
        Some(QueueDepth {
            queue: queue.to_owned(),
            // A queue the stats collector has not sampled yet has no counts: report 0.
            ready: Some(v["messages_ready"].as_u64().unwrap_or(0)),
            unacked: Some(v["messages_unacknowledged"].as_u64().unwrap_or(0)),
            consumers: v["consumers"].as_u64(),
            source: "management",
        })
    }
}

/// Percent-encode a queue name for a URL path segment.
fn encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// The vhost of an AMQP URL, percent-encoded as the management API wants it.
pub fn vhost_of(amqp_url: &str) -> String {
    let after_host = amqp_url
        .split_once("://")
        .map(|(_, r)| r)
        .unwrap_or(amqp_url);
    match after_host.split_once('/') {
        Some((_, v)) if !v.is_empty() => v.split('?').next().unwrap_or("%2f").to_owned(),
        _ => "%2f".to_owned(),
    }
}
