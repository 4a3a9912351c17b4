//! Outcome events: what `{prefix}.events` carries after an outcome is durable.
//!
//! Every process that records a terminal outcome (the worker, the dead-letter processor,
//! the retry relay, `reconcile`) publishes one event *after* its ledger write. Events are
//! best-effort notifications: a lost event never loses an outcome (the ledger is the
//! truth), and a consumer that missed some (it was disconnected) reads the ledger again.
//! The body is small on purpose: no result text, which stays in the ledger.
//!
//! Routing key: `<state>.<kind>`, e.g. `completed.incident.summary`; bind
//! `completed.#` for one state, `*.incident.summary` for one kind (kinds may hold dots,
//! so a kind binding is `#.incident.summary` when states are not spelled out).

use serde::{Deserialize, Serialize};

/// The schema version of the event body.
pub const EVENT_VERSION: u32 = 1;

/// One terminal outcome, as published to the events exchange.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct OutcomeEvent {
    /// Always [`EVENT_VERSION`].
    pub v: u32,
    pub job_id: String,
    pub kind: String,
    /// A terminal `State` name (`completed`, `expired_not_started`, …).
    pub state: String,
    pub reason: Option<String>,
    /// The attempt (0-based) whose outcome this is.
    pub attempt: u32,
    /// Model calls made for the job over all its attempts, as far as the recorder knows.
    pub model_calls: u32,
    pub created_at_ms: Option<i64>,
    pub expires_at_ms: Option<i64>,
    pub finished_at_ms: Option<i64>,
    /// When the outcome was written to the ledger.
    pub recorded_at_ms: i64,
    /// The process that recorded it (a worker's name, `dlq`, `reconcile`, …).
    pub recorded_by: String,
    /// A worker's refusal for lack of time: the budget its check would have admitted
    /// (the job row's `min_feasible_budget_ms`). Absent from the body otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub min_feasible_budget_ms: Option<u64>,
}

impl OutcomeEvent {
    /// `<state>.<kind>`.
    pub fn routing_key(&self) -> String {
        format!("{}.{}", self.state, self.kind)
    }

    /// The JSON body.
    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    /// Parse a body; `None` for anything that is not a v1 event.
    pub fn from_json(body: &[u8]) -> Option<Self> {
        serde_json::from_slice::<Self>(body)
            .ok()
            .filter(|e| e.v == EVENT_VERSION)
    }
}

/// A control broadcast to every worker, on the fanout exchange `{prefix}.control`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ControlMessage {
    /// Always [`EVENT_VERSION`].
    pub v: u32,
    /// Abort this job's model call (or its wait for a slot) where it runs.
    pub cancel: String,
}

impl ControlMessage {
    pub fn cancel(job_id: &str) -> Self {
        Self {
            v: EVENT_VERSION,
            cancel: job_id.to_owned(),
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).unwrap_or_default()
    }

    pub fn from_json(body: &[u8]) -> Option<Self> {
        serde_json::from_slice::<Self>(body)
            .ok()
            .filter(|m| m.v == EVENT_VERSION)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ev() -> OutcomeEvent {
        OutcomeEvent {
            v: EVENT_VERSION,
            job_id: "inc-4711".into(),
            kind: "incident.summary".into(),
            state: "completed".into(),
            reason: None,
            attempt: 0,
            model_calls: 1,
            created_at_ms: Some(1),
            expires_at_ms: Some(2),
            finished_at_ms: Some(2),
            recorded_at_ms: 2,
            recorded_by: "w1".into(),
            min_feasible_budget_ms: None,
        }
    }

    #[test]
    fn routing_key_is_state_then_kind() {
        assert_eq!(ev().routing_key(), "completed.incident.summary");
    }

    #[test]
    fn round_trips_and_refuses_other_versions() {
        let e = ev();
        assert_eq!(OutcomeEvent::from_json(&e.to_json()), Some(e.clone()));
        let refused = OutcomeEvent {
            min_feasible_budget_ms: Some(4_200),
            ..ev()
        };
        assert_eq!(OutcomeEvent::from_json(&refused.to_json()), Some(refused));
        assert!(
            !String::from_utf8(e.to_json())
                .unwrap()
                .contains("min_feasible")
        );
        let mut other = e;
        other.v = 2;
        assert_eq!(OutcomeEvent::from_json(&other.to_json()), None);
        assert_eq!(OutcomeEvent::from_json(b"{}"), None);
        let c = ControlMessage::cancel("j");
        assert_eq!(ControlMessage::from_json(&c.to_json()), Some(c));
        assert_eq!(ControlMessage::from_json(&ev().to_json()), None);
    }
}
