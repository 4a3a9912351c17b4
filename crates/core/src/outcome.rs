//! Outcome states of the ledger (docs/concepts.md).

use std::fmt;
use std::str::FromStr;

/// Every state a job's record can show. Terminal states are written once per `job_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum State {
    /// Non-terminal: confirmed by the broker at publish time (the producer's inventory).
    Accepted,
    /// Non-terminal: a model call was started for the job.
    Running,
    Completed,
    Failed,
    ExpiredNotStarted,
    ExpiredBeforeReceive,
    DeadlineExceeded,
    Rejected,
    Unknown,
    /// Cancelled on request (`DELETE /v1/jobs/{id}`, `lastcall cancel`): before its start
    /// (no model call), or while running (the call aborted through the backend's cancellation).
    Cancelled,
}

impl State {
    /// All states, in the order reports print them.
    pub const ALL: [State; 10] = [
        State::Accepted,
        State::Running,
        State::Completed,
        State::Failed,
        State::ExpiredNotStarted,
        State::ExpiredBeforeReceive,
        State::DeadlineExceeded,
        State::Rejected,
        State::Unknown,
        State::Cancelled,
    ];

    pub const fn as_str(self) -> &'static str {
        match self {
            State::Accepted => "accepted",
            State::Running => "running",
            State::Completed => "completed",
            State::Failed => "failed",
            State::ExpiredNotStarted => "expired_not_started",
            State::ExpiredBeforeReceive => "expired_before_receive",
            State::DeadlineExceeded => "deadline_exceeded",
            State::Rejected => "rejected",
            State::Unknown => "unknown",
            State::Cancelled => "cancelled",
        }
    }

    /// Whether this state ends the job. Only terminal states are written exactly once.
    pub const fn is_terminal(self) -> bool {
        !matches!(self, State::Accepted | State::Running)
    }
}

impl fmt::Display for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// An unknown state name; lists the valid ones so the caller can fix the input.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "unknown state `{0}`; expected one of: accepted, running, completed, failed, expired_not_started, expired_before_receive, deadline_exceeded, rejected, unknown, cancelled"
)]
pub struct UnknownState(pub String);

impl FromStr for State {
    type Err = UnknownState;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        State::ALL
            .into_iter()
            .find(|st| st.as_str() == s)
            .ok_or_else(|| UnknownState(s.to_owned()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip_and_terminality() {
        for s in State::ALL {
            assert_eq!(s.as_str().parse::<State>().unwrap(), s);
        }
        assert!(!State::Accepted.is_terminal());
        assert!(!State::Running.is_terminal());
        assert!(State::ExpiredNotStarted.is_terminal());
        assert!(
            "done"
                .parse::<State>()
                .unwrap_err()
                .to_string()
                .contains("expired_not_started")
        );
    }
}
