//! RabbitMQ's management HTTP API, for policies: operators see and change dead-lettering,
//! overflow and delivery limits in the broker's own tools instead of hard-coded queue
//! arguments. Used by `lastcall topology apply --policies` where the plugin is enabled.
//! Also one queue's sampled numbers ([`Management::queue_stats`]: ready, consumers, recent
//! ack rate), for the queue-wait estimate of shedding at the door.

use crate::topology::{QueueType, Topology};
use serde_json::{Value, json};

/// Where the management API is and how to log in.
#[derive(Clone)]
pub struct Management {
    base_url: String,
    user: String,
    password: String,
    vhost: String,
    client: reqwest::Client,
}

impl std::fmt::Debug for Management {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Management")
            .field("base_url", &self.base_url)
            .field("user", &self.user)
            .finish_non_exhaustive()
    }
}

/// Errors of the management API.
#[derive(Debug, thiserror::Error)]
pub enum ManagementError {
    #[error(
        "the RabbitMQ management API at {url} is not reachable ({message}); enable it with `rabbitmq-plugins enable rabbitmq_management` or pass --management-url"
    )]
    Unreachable { url: String, message: String },
    #[error("the management API refused {what}: HTTP {status}: {body}")]
    Refused {
        what: String,
        status: u16,
        body: String,
    },
}

impl Management {
    pub fn new(base_url: &str, user: &str, password: &str, vhost: &str) -> Self {
        Self {
            base_url: base_url.trim_end_matches('/').to_owned(),
            user: user.to_owned(),
            password: password.to_owned(),
            vhost: vhost.to_owned(),
            client: reqwest::Client::builder()
                .timeout(std::time::Duration::from_secs(5))
                .build()
                .expect("a plain HTTP client always builds"),
        }
    }

    /// The same API with other credentials (e.g. a monitoring user).
    pub fn with_login(mut self, user: &str, password: &str) -> Self {
        user.clone_into(&mut self.user);
        password.clone_into(&mut self.password);
        self
    }

    /// The same API with another request timeout (default 5 s). A caller on a request
    /// path (the shedding estimate) wants a short one.
    pub fn with_timeout(mut self, timeout: std::time::Duration) -> Self {
        self.client = reqwest::Client::builder()
            .timeout(timeout)
            .build()
            .expect("a plain HTTP client always builds");
        self
    }

    /// Credentials and vhost taken from the AMQP URL (`amqp://user:pass@host:port/vhost`).
    pub fn from_amqp_url(amqp_url: &str, management_url: &str) -> Self {
        // A cluster's node list (`amqp://a,amqp://b`): the first node names the login.
        let amqp_url = amqp_url.split(',').next().unwrap_or(amqp_url).trim();
        // The query (`?cacertfile=/path/ca.pem`, `heartbeat=…`) is neither login nor vhost.
        let amqp_url = amqp_url.split('?').next().unwrap_or(amqp_url);
        let rest = amqp_url
            .split_once("://")
            .map(|(_, r)| r)
            .unwrap_or(amqp_url);
        let (creds, host_path) = rest.rsplit_once('@').unwrap_or(("guest:guest", rest));
        let (user, password) = creds.split_once(':').unwrap_or((creds, ""));
        let vhost = match host_path.split_once('/') {
            Some((_, v)) if !v.is_empty() => v.replace("%2f", "/").replace("%2F", "/"),
            _ => "/".to_owned(),
        };
        Self::new(management_url, user, password, &vhost)
    }

    fn url(&self, path: &str) -> String {
        let vhost = self.vhost.replace('%', "%25").replace('/', "%2F");
        format!("{}/api/{path}/{vhost}", self.base_url)
    }

    async fn send(
        &self,
        what: &str,
        req: reqwest::RequestBuilder,
    ) -> Result<Option<Value>, ManagementError> {
        let resp = req
            .basic_auth(&self.user, Some(&self.password))
            .send()
            .await
            .map_err(|e| ManagementError::Unreachable {
                url: self.base_url.clone(),
                message: e.to_string(),
            })?;
        let status = resp.status();
        if status.as_u16() == 404 {
            return Ok(None);
        }
        let body = resp.text().await.unwrap_or_default();
        if !status.is_success() {
            return Err(ManagementError::Refused {
                what: what.to_owned(),
                status: status.as_u16(),
                body,
            });
        }
        Ok(Some(serde_json::from_str(&body).unwrap_or(Value::Null)))
    }

    /// `queue`'s numbers as the management API last sampled them (`GET
    /// /api/queues/{vhost}/{name}`); `Ok(None)` if the queue does not exist. The broker
    /// refreshes them every `collect_statistics_interval` (5 s by default).
    pub async fn queue_stats(&self, queue: &str) -> Result<Option<QueueStats>, ManagementError> {
        let url = format!(
            "{}/{}?columns=messages_ready,messages_unacknowledged,consumers,message_stats",
            self.url("queues"),
            encode_segment(queue)
        );
        Ok(self
            .send(&format!("queue {queue}"), self.client.get(url))
            .await?
            .map(|v| QueueStats::from_json(&v)))
    }

    /// The cluster's active resource alarms (`GET /api/nodes`): one line per alarm, e.g.
    /// `memory alarm on rabbit@host`; empty when none is on. While one is on, RabbitMQ
    /// blocks every connection that publishes (3.10 sends `connection.blocked` only at a
    /// connection's first publish, so a publisher cannot see the alarm before it tries).
    pub async fn alarms(&self) -> Result<Vec<String>, ManagementError> {
        let url = format!(
            "{}/api/nodes?columns=name,mem_alarm,disk_free_alarm",
            self.base_url
        );
        let nodes = self.send("the node list", self.client.get(url)).await?;
        Ok(alarms_of(nodes.as_ref().unwrap_or(&Value::Null)))
    }

    /// The policies lastcall wants for `topo`: name → (pattern, definition).
    pub fn policies(topo: &Topology) -> Vec<(String, String, Value)> {
        let n = &topo.names;
        let escape = |s: &str| s.replace('.', "\\.");
        let mut work = json!({ "dead-letter-exchange": n.dlx });
        if topo.queue_type == QueueType::Quorum {
            work["dead-letter-strategy"] = json!("at-least-once");
            work["overflow"] = json!("reject-publish");
            work["delivery-limit"] = json!(topo.delivery_limit);
        }
        if let Some(m) = topo.max_length {
            work["max-length"] = json!(m);
        }
        vec![(
            format!("{}-work", n.prefix),
            // The work queue and its lanes (`P.work.lane1` …).
            format!("^{}(\\.lane[0-9]+)?$", escape(&n.work_queue)),
            work,
        )]
    }

    /// Create or update lastcall's policies (idempotent).
    pub async fn apply_policies(&self, topo: &Topology) -> Result<Vec<String>, ManagementError> {
        let mut names = Vec::new();
        for (name, pattern, definition) in Self::policies(topo) {
            let body = json!({ "pattern": pattern, "definition": definition, "priority": 0, "apply-to": "queues" });
            let url = format!("{}/{name}", self.url("policies"));
            self.send(&format!("policy {name}"), self.client.put(url).json(&body))
                .await?;
            names.push(name);
        }
        Ok(names)
    }

    /// One policy's definition, if it exists.
    pub async fn policy(&self, name: &str) -> Result<Option<Value>, ManagementError> {
        let url = format!("{}/{name}", self.url("policies"));
        self.send(&format!("policy {name}"), self.client.get(url))
            .await
    }

    /// Remove lastcall's policies (tests and clean-up).
    pub async fn delete_policies(&self, topo: &Topology) -> Result<(), ManagementError> {
        for (name, _, _) in Self::policies(topo) {
            let url = format!("{}/{name}", self.url("policies"));
            self.send(&format!("policy {name}"), self.client.delete(url))
                .await?;
        }
        Ok(())
    }
}

/// The cluster's resource alarms as last read from the management API, refreshed in the
/// background every `every` (`serve`'s `/readyz` reports `broker_alarm` while one is on,
/// before any publish has been blocked). An unreachable API leaves the last answer and
/// logs once; the task ends when the last clone of the watch is dropped.
#[derive(Debug, Clone, Default)]
pub struct AlarmWatch {
    alarms: std::sync::Arc<std::sync::Mutex<Vec<String>>>,
}

impl AlarmWatch {
    pub fn spawn(management: Management, every: std::time::Duration) -> Self {
        let me = Self::default();
        let weak = std::sync::Arc::downgrade(&me.alarms);
        let management = management.with_timeout(every.max(std::time::Duration::from_secs(1)));
        tokio::spawn(async move {
            let mut reachable = true;
            loop {
                let read = management.alarms().await;
                let Some(alarms) = weak.upgrade() else { return };
                match read {
                    Ok(now) => {
                        reachable = true;
                        let mut held = alarms.lock().unwrap_or_else(|p| p.into_inner());
                        if *held != now {
                            if now.is_empty() {
                                tracing::info!("the broker's resource alarms cleared");
                            } else {
                                tracing::warn!(alarms = ?now, "the broker has a resource alarm: it blocks publishers");
                            }
                            *held = now;
                        }
                    }
                    Err(e) if reachable => {
                        reachable = false;
                        tracing::warn!(error = %e, "cannot read the broker's resource alarms");
                    }
                    Err(_) => {}
                }
                drop(alarms);
                tokio::time::sleep(every).await;
            }
        });
        me
    }

    /// The alarms on now (empty: none, or none known).
    pub fn current(&self) -> Vec<String> {
        self.alarms
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

/// The alarms in `GET /api/nodes`'s answer (see [`Management::alarms`]).
fn alarms_of(nodes: &Value) -> Vec<String> {
    let mut out = Vec::new();
    for node in nodes.as_array().into_iter().flatten() {
        let name = node["name"].as_str().unwrap_or("?");
        for (field, what) in [("mem_alarm", "memory"), ("disk_free_alarm", "disk")] {
            if node[field].as_bool() == Some(true) {
                out.push(format!("{what} alarm on {name}"));
            }
        }
    }
    out
}

/// One queue's numbers from the management API.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QueueStats {
    /// Messages waiting in the broker (not yet delivered).
    pub ready: u64,
    /// Messages delivered to a consumer and not yet acked.
    pub unacked: u64,
    pub consumers: u64,
    /// Acks per second over the broker's last sampling interval
    /// (`message_stats.ack_details.rate`); `None` when the queue has no ack statistics
    /// yet (nothing acked since it was declared, or the statistics are off).
    pub ack_rate_per_s: Option<f64>,
}

impl QueueStats {
    /// Parse a `GET /api/queues/{vhost}/{name}` answer. A queue the statistics collector
    /// has not sampled yet has no counts: 0.
    pub fn from_json(v: &Value) -> Self {
        Self {
            ready: v["messages_ready"].as_u64().unwrap_or(0),
            unacked: v["messages_unacknowledged"].as_u64().unwrap_or(0),
            consumers: v["consumers"].as_u64().unwrap_or(0),
            ack_rate_per_s: v["message_stats"]["ack_details"]["rate"].as_f64(),
        }
    }
}

/// Percent-encode one URL path segment (a queue name).
fn encode_segment(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alarms_name_the_kind_and_the_node() {
        let nodes = json!([
            {"name": "rabbit@a", "mem_alarm": false, "disk_free_alarm": false},
            {"name": "rabbit@b", "mem_alarm": true, "disk_free_alarm": true},
            {"name": "rabbit@c"}
        ]);
        assert_eq!(
            alarms_of(&nodes),
            ["memory alarm on rabbit@b", "disk alarm on rabbit@b"]
        );
        assert!(alarms_of(&json!([])).is_empty());
        assert!(alarms_of(&Value::Null).is_empty());
    }

    #[test]
    fn credentials_and_vhost_come_from_the_amqp_url() {
        let m = Management::from_amqp_url("amqp://bob:s3cret@h:5672/%2f", "http://h:15672/");
        assert_eq!(
            (m.user.as_str(), m.password.as_str(), m.vhost.as_str()),
            ("bob", "s3cret", "/")
        );
        assert_eq!(m.url("policies"), "http://h:15672/api/policies/%2F");
        let m = Management::from_amqp_url("amqp://u:p@h/jobs", "http://h:15672");
        assert_eq!(m.vhost, "jobs");
        assert!(!format!("{m:?}").contains("s3cret"));
        let m = Management::from_amqp_url(
            "amqps://u:p@h?cacertfile=/etc/ca/ca.pem&heartbeat=10",
            "https://h:15671",
        );
        assert_eq!((m.user.as_str(), m.vhost.as_str()), ("u", "/"));
        let m = Management::from_amqp_url("amqps://u:p@h/jobs?cacertfile=/ca.pem", "http://h");
        assert_eq!(m.vhost, "jobs");
        let m = Management::from_amqp_url("amqp://a:b@h1/%2f,amqp://a:b@h2/%2f", "http://h");
        assert_eq!((m.user.as_str(), m.vhost.as_str()), ("a", "/"));
        let m = m.with_login("mon", "pw");
        assert_eq!((m.user.as_str(), m.password.as_str()), ("mon", "pw"));
    }

    #[test]
    fn queue_stats_parse_the_sampled_numbers() {
        let v = json!({
            "messages_ready": 40, "messages_unacknowledged": 8, "consumers": 2,
            "message_stats": { "ack": 120, "ack_details": { "rate": 3.8 } }
        });
        assert_eq!(
            QueueStats::from_json(&v),
            QueueStats {
                ready: 40,
                unacked: 8,
                consumers: 2,
                ack_rate_per_s: Some(3.8)
            }
        );
        // Never acked, not sampled yet: no rate, zero counts.
        let s = QueueStats::from_json(&json!({ "consumers": 0 }));
        assert_eq!((s.ready, s.ack_rate_per_s), (0, None));
        assert_eq!(encode_segment("lc.work"), "lc.work");
        assert_eq!(encode_segment("a b/c"), "a%20b%2Fc");
    }

    #[test]
    fn quorum_policies_carry_the_at_least_once_settings() {
        let mut t = Topology::new("lc");
        let p = Management::policies(&t);
        assert_eq!(p[0].1, "^lc\\.work(\\.lane[0-9]+)?$");
        assert!(p[0].2.get("dead-letter-strategy").is_none());
        t.queue_type = QueueType::Quorum;
        let d = &Management::policies(&t)[0].2;
        assert_eq!(d["dead-letter-strategy"], "at-least-once");
        assert_eq!(d["overflow"], "reject-publish");
        assert_eq!(d["delivery-limit"], 5);
    }
}
