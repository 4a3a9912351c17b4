//! Outcome and failure statistics over plain records (`lastcall report`).
//!
//! Pure aggregation: the caller reads the ledger and passes one [`ReportRow`] per job; the
//! window bounds are values, not clock reads. Percentiles use the nearest-rank method, so
//! every reported value is one that was actually observed.
//!
//! A *late outcome* (late truth) is a job that reconciliation marked `unknown` and whose
//! real outcome arrived afterwards and replaced it: it has a `reconciled_at_ms` and a state
//! other than `unknown`. It is counted under its real state like any job, and again in
//! [`Report::late_outcomes`].

use crate::outcome::State;
use serde::Serialize;
use std::collections::BTreeMap;

/// The fields of one job record that the report reads.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ReportRow {
    pub state: String,
    pub kind: String,
    pub reason: Option<String>,
    pub error: Option<String>,
    pub created_at_ms: Option<i64>,
    pub recorded_at_ms: Option<i64>,
    /// When reconciliation marked the job `unknown`, if it did (kept after a late outcome).
    pub reconciled_at_ms: Option<i64>,
}

impl ReportRow {
    /// Marked `unknown` by reconciliation, then given its real outcome (see the module doc).
    pub fn is_late_outcome(&self) -> bool {
        self.reconciled_at_ms.is_some() && self.state != State::Unknown.as_str()
    }
}

/// One counted key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Count {
    pub key: String,
    pub count: u64,
}

/// Time from `created_at_ms` to `recorded_at_ms` for the jobs of one state, in ms.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Latency {
    pub state: String,
    /// Jobs with both timestamps (the percentiles are over these).
    pub count: u64,
    pub p50_ms: i64,
    pub p90_ms: i64,
    pub p99_ms: i64,
    pub max_ms: i64,
}

/// The whole report.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Report {
    pub since_ms: i64,
    pub until_ms: i64,
    pub total: u64,
    /// In [`State::ALL`] order; other names (should not occur) after them.
    pub by_state: Vec<Count>,
    /// Most frequent first, then by name.
    pub by_kind: Vec<Count>,
    /// Keys are `state/reason` (reasons are only meaningful with their state).
    pub by_reason: Vec<Count>,
    /// See [`error_class`]; completed jobs have no class and are not counted here.
    pub by_error_class: Vec<Count>,
    /// The most frequent error messages (first line, clipped), most frequent first.
    pub top_errors: Vec<Count>,
    pub latency: Vec<Latency>,
    /// Late outcomes in the window: jobs marked `unknown` whose real outcome arrived later.
    pub late_outcomes: u64,
    /// The late outcomes by their real state, in [`State::ALL`] order.
    pub late_by_state: Vec<Count>,
}

/// How many error messages [`build`] lists.
pub const TOP_ERRORS: usize = 10;
/// Error messages are compared by their first line, clipped to this many characters.
const ERROR_CHARS: usize = 120;

/// A bounded classification of why a job did not complete, derived from state and reason:
/// `deadline`, `invalid_input`, `poison`, `retries_exhausted`, `overflow`, `broker`,
/// `backend_terminal`, `unaccounted`, `cancelled`. `None` for completed and non-terminal jobs.
pub fn error_class(state: &str, reason: Option<&str>) -> Option<&'static str> {
    let reason = reason.unwrap_or("");
    let class = match state.parse::<State>().ok()? {
        State::Completed | State::Accepted | State::Running => return None,
        State::ExpiredNotStarted | State::ExpiredBeforeReceive | State::DeadlineExceeded => {
            "deadline"
        }
        State::Rejected => "invalid_input",
        State::Unknown => "unaccounted",
        State::Cancelled => "cancelled",
        State::Failed => match reason {
            "poison" | "delivery_limit" => "poison",
            "retries_exhausted" => "retries_exhausted",
            "maxlen" => "overflow",
            "retry_publish_failed" => "broker",
            r if r.starts_with("dead_lettered:") || r == "rejected_without_outcome" => "broker",
            _ => "backend_terminal",
        },
    };
    Some(class)
}

/// The nearest-rank percentile of sorted values (`q` in `(0, 1]`).
pub fn percentile(sorted: &[i64], q: f64) -> Option<i64> {
    if sorted.is_empty() {
        return None;
    }
    let rank = (q * sorted.len() as f64).ceil().max(1.0) as usize;
    Some(sorted[rank.min(sorted.len()) - 1])
}

fn counted(map: BTreeMap<String, u64>) -> Vec<Count> {
    let mut v: Vec<Count> = map
        .into_iter()
        .map(|(key, count)| Count { key, count })
        .collect();
    v.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.key.cmp(&b.key)));
    v
}

fn state_rank(s: &str) -> usize {
    State::ALL
        .iter()
        .position(|st| st.as_str() == s)
        .unwrap_or(usize::MAX)
}

fn clip_error(e: &str) -> String {
    let first = e.lines().next().unwrap_or("").trim();
    first.chars().take(ERROR_CHARS).collect()
}

/// Aggregate `rows` for the window `[since_ms, until_ms]`.
pub fn build(rows: &[ReportRow], since_ms: i64, until_ms: i64) -> Report {
    let mut state = BTreeMap::<String, u64>::new();
    let mut kind = BTreeMap::<String, u64>::new();
    let mut reason = BTreeMap::<String, u64>::new();
    let mut class = BTreeMap::<String, u64>::new();
    let mut errors = BTreeMap::<String, u64>::new();
    let mut times = BTreeMap::<String, Vec<i64>>::new();
    let mut late = BTreeMap::<String, u64>::new();
    for r in rows {
        *state.entry(r.state.clone()).or_default() += 1;
        if r.is_late_outcome() {
            *late.entry(r.state.clone()).or_default() += 1;
        }
        *kind.entry(r.kind.clone()).or_default() += 1;
        if let Some(reas) = &r.reason {
            *reason.entry(format!("{}/{reas}", r.state)).or_default() += 1;
        }
        if let Some(c) = error_class(&r.state, r.reason.as_deref()) {
            *class.entry(c.to_owned()).or_default() += 1;
            if let Some(e) = r.error.as_deref().filter(|e| !e.trim().is_empty()) {
                *errors.entry(clip_error(e)).or_default() += 1;
            }
        }
        if let (Some(c), Some(rec)) = (r.created_at_ms, r.recorded_at_ms) {
            times
                .entry(r.state.clone())
                .or_default()
                .push(rec.saturating_sub(c));
        }
    }
    let by_state = in_state_order(state);
    let late_by_state = in_state_order(late);
    let mut latency: Vec<Latency> = times
        .into_iter()
        .map(|(state, mut v)| {
            v.sort_unstable();
            let p = |q| percentile(&v, q).unwrap_or(0);
            Latency {
                count: v.len() as u64,
                p50_ms: p(0.50),
                p90_ms: p(0.90),
                p99_ms: p(0.99),
                max_ms: *v.last().unwrap_or(&0),
                state,
            }
        })
        .collect();
    latency.sort_by(|a, b| {
        state_rank(&a.state)
            .cmp(&state_rank(&b.state))
            .then_with(|| a.state.cmp(&b.state))
    });
    let mut top_errors = counted(errors);
    top_errors.truncate(TOP_ERRORS);
    Report {
        since_ms,
        until_ms,
        total: rows.len() as u64,
        by_state,
        by_kind: counted(kind),
        by_reason: counted(reason),
        by_error_class: counted(class),
        top_errors,
        latency,
        late_outcomes: late_by_state.iter().map(|c| c.count).sum(),
        late_by_state,
    }
}

/// Counts keyed by state name, in [`State::ALL`] order (other names after, by name).
fn in_state_order(map: BTreeMap<String, u64>) -> Vec<Count> {
    let mut v: Vec<Count> = map
        .into_iter()
        .map(|(key, count)| Count { key, count })
        .collect();
    v.sort_by(|a, b| {
        state_rank(&a.key)
            .cmp(&state_rank(&b.key))
            .then_with(|| a.key.cmp(&b.key))
    });
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn row(
        state: &str,
        kind: &str,
        reason: Option<&str>,
        created: i64,
        recorded: i64,
    ) -> ReportRow {
        ReportRow {
            state: state.into(),
            kind: kind.into(),
            reason: reason.map(Into::into),
            error: None,
            created_at_ms: Some(created),
            recorded_at_ms: Some(recorded),
            reconciled_at_ms: None,
        }
    }

    #[test]
    fn percentiles_are_nearest_rank() {
        let v: Vec<i64> = (1..=100).collect();
        assert_eq!(percentile(&v, 0.5), Some(50));
        assert_eq!(percentile(&v, 0.9), Some(90));
        assert_eq!(percentile(&v, 0.99), Some(99));
        assert_eq!(percentile(&[7], 0.99), Some(7));
        assert_eq!(percentile(&[], 0.5), None);
        assert_eq!(percentile(&[1, 2], 0.5), Some(1));
    }

    #[test]
    fn counts_classes_errors_and_latency() {
        let mut rows = vec![
            row("completed", "a", None, 0, 100),
            row("completed", "a", None, 0, 300),
            row("failed", "b", Some("retries_exhausted"), 0, 5_000),
            row("failed", "b", Some("poison"), 0, 9_000),
            row(
                "expired_before_receive",
                "a",
                Some("broker_ttl_expired"),
                0,
                700,
            ),
            row("unknown", "c", Some("no_outcome_after_deadline"), 0, 60_000),
        ];
        rows[2].error = Some("simulated overload\nmore".into());
        rows[3].error = Some("simulated overload".into());
        let r = build(&rows, 0, 100_000);
        assert_eq!(r.total, 6);
        let keys: Vec<&str> = r.by_state.iter().map(|c| c.key.as_str()).collect();
        assert_eq!(
            keys,
            ["completed", "failed", "expired_before_receive", "unknown"]
        );
        assert_eq!(
            r.by_kind[0],
            Count {
                key: "a".into(),
                count: 3
            }
        );
        assert!(r.by_reason.contains(&Count {
            key: "failed/poison".into(),
            count: 1
        }));
        let class = |k: &str| {
            r.by_error_class
                .iter()
                .find(|c| c.key == k)
                .map(|c| c.count)
        };
        assert_eq!(class("deadline"), Some(1));
        assert_eq!(class("poison"), Some(1));
        assert_eq!(class("retries_exhausted"), Some(1));
        assert_eq!(class("unaccounted"), Some(1));
        assert_eq!(
            r.top_errors,
            vec![Count {
                key: "simulated overload".into(),
                count: 2
            }]
        );
        let done = &r.latency[0];
        assert_eq!(
            (done.state.as_str(), done.count, done.p50_ms, done.max_ms),
            ("completed", 2, 100, 300)
        );
    }

    #[test]
    fn late_outcomes_are_counted_once_under_their_real_state() {
        let reconciled = |r: ReportRow| ReportRow {
            reconciled_at_ms: Some(5_000),
            ..r
        };
        let rows = vec![
            // Marked unknown, then the real outcomes arrived.
            reconciled(row("completed", "a", None, 0, 9_000)),
            reconciled(row(
                "expired_before_receive",
                "a",
                Some("broker_ttl_expired"),
                0,
                7_000,
            )),
            reconciled(row(
                "expired_before_receive",
                "b",
                Some("broker_ttl_expired"),
                0,
                8_000,
            )),
            // Still unknown: not a late outcome.
            reconciled(row(
                "unknown",
                "c",
                Some("no_outcome_after_deadline"),
                0,
                5_000,
            )),
            // Never reconciled.
            row("completed", "a", None, 0, 100),
        ];
        assert!(rows[0].is_late_outcome());
        assert!(!rows[3].is_late_outcome() && !rows[4].is_late_outcome());
        let r = build(&rows, 0, 10_000);
        assert_eq!(r.late_outcomes, 3);
        let late: Vec<(&str, u64)> = r
            .late_by_state
            .iter()
            .map(|c| (c.key.as_str(), c.count))
            .collect();
        assert_eq!(late, [("completed", 1), ("expired_before_receive", 2)]);
        // Counted under their real state (once), and classed by it, not as `unaccounted`.
        let by_state: Vec<(&str, u64)> = r
            .by_state
            .iter()
            .map(|c| (c.key.as_str(), c.count))
            .collect();
        assert_eq!(
            by_state,
            [
                ("completed", 2),
                ("expired_before_receive", 2),
                ("unknown", 1)
            ]
        );
        assert_eq!(r.total, 5);
        let class = |k: &str| {
            r.by_error_class
                .iter()
                .find(|c| c.key == k)
                .map(|c| c.count)
        };
        assert_eq!(class("deadline"), Some(2));
        assert_eq!(class("unaccounted"), Some(1));
        // Nothing reconciled: zero, and an empty breakdown.
        let none = build(&rows[4..], 0, 10_000);
        assert_eq!((none.late_outcomes, none.late_by_state.len()), (0, 0));
    }

    #[test]
    fn error_classes_are_bounded() {
        assert_eq!(error_class("completed", None), None);
        assert_eq!(error_class("running", None), None);
        assert_eq!(
            error_class("failed", Some("sim_400")),
            Some("backend_terminal")
        );
        assert_eq!(
            error_class("failed", Some("delivery_limit")),
            Some("poison")
        );
        assert_eq!(error_class("failed", Some("maxlen")), Some("overflow"));
        assert_eq!(
            error_class("rejected", Some("invalid_json")),
            Some("invalid_input")
        );
        assert_eq!(error_class("no-such-state", None), None);
    }

    proptest! {
        #[test]
        fn percentiles_are_ordered_and_observed(v in proptest::collection::vec(-1_000i64..100_000, 1..200)) {
            let rows: Vec<ReportRow> = v.iter().map(|d| row("completed", "k", None, 0, *d)).collect();
            let r = build(&rows, 0, 1);
            let l = &r.latency[0];
            prop_assert!(l.p50_ms <= l.p90_ms && l.p90_ms <= l.p99_ms && l.p99_ms <= l.max_ms);
            prop_assert!(v.contains(&l.p50_ms) && v.contains(&l.p99_ms));
            prop_assert_eq!(l.count as usize, v.len());
            prop_assert_eq!(r.by_state.iter().map(|c| c.count).sum::<u64>(), v.len() as u64);
        }
    }
}
