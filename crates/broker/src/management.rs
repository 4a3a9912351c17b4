//! RabbitMQ's management HTTP API, for policies: operators see and change dead-lettering,
//! overflow and delivery limits in the broker's own tools instead of hard-coded queue
//! arguments. Used by `lastcall topology apply --policies` where the plugin is enabled.

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

    /// Credentials and vhost taken from the AMQP URL (`amqp://user:pass@host:port/vhost`).
    pub fn from_amqp_url(amqp_url: &str, management_url: &str) -> Self {
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
            format!("^{}$", escape(&n.work_queue)),
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

#[cfg(test)]
mod tests {
    use super::*;

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
    }

    #[test]
    fn quorum_policies_carry_the_at_least_once_settings() {
        let mut t = Topology::new("lc");
        let p = Management::policies(&t);
        assert_eq!(p[0].1, "^lc\\.work$");
        assert!(p[0].2.get("dead-letter-strategy").is_none());
        t.queue_type = QueueType::Quorum;
        let d = &Management::policies(&t)[0].2;
        assert_eq!(d["dead-letter-strategy"], "at-least-once");
        assert_eq!(d["overflow"], "reject-publish");
        assert_eq!(d["delivery-limit"], 5);
    }
}
