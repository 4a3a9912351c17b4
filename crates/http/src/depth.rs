//! Broker queue depths: ready and unacked per queue from RabbitMQ's management API, or,
//! when that is not reachable, the ready count from a passive queue declare (unacked is
//! then unknown). The management API refreshes its numbers every few seconds.

use lastcall_broker::Broker;
use lastcall_broker::management::Management;
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

/// Reads the depths of a fixed list of queues (the topology's: bounded).
#[derive(Debug, Clone)]
pub struct DepthProbe {
    pub queues: Vec<String>,
    pub management: Option<Management>,
    pub broker: Option<Broker>,
}

impl DepthProbe {
    /// `management` is asked first (with a 2 s request timeout: a scrape must not wait
    /// longer); a queue it cannot answer for falls back to a passive declare on `broker`.
    pub fn new(
        queues: Vec<String>,
        management: Option<Management>,
        broker: Option<Broker>,
    ) -> Self {
        Self {
            queues,
            management: management.map(|m| m.with_timeout(Duration::from_secs(2))),
            broker,
        }
    }

    pub async fn depths(&self) -> Vec<QueueDepth> {
        let mut out = Vec::with_capacity(self.queues.len());
        for q in &self.queues {
            let mut d = None;
            if let Some(m) = &self.management {
                d = match m.queue_stats(q).await {
                    Ok(Some(st)) => Some(QueueDepth {
                        queue: q.clone(),
                        ready: Some(st.ready),
                        unacked: Some(st.unacked),
                        consumers: Some(st.consumers),
                        source: "management",
                    }),
                    _ => None,
                };
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
}
