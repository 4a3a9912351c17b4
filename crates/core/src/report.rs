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
//!
//! Per tenant, [`tenant_accounts`] folds outcome groups into one
//! [`TenantAccount`] each: on time, refused and every other outcome by reason, model time
//! (and the share of it wasted on calls that did not complete), tokens. The same fold
//! serves `lastcall report` (one group per job), the dashboard and `/metrics` (one group
//! per row of the ledger's `GROUP BY tenant, state, reason`), and bounds the tenants shown:
//! the busiest `top`, the rest summed as [`OTHER_TENANTS`].

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
    /// Whose job it was (`default` when it named none).
    pub tenant: String,
    /// Model time of every call the job made (every attempt that called the model), ms.
    pub model_ms: i64,
    /// The part of `model_ms` no one could use: every call but the one that completed
    /// (calls that failed and were retried, cut at the deadline, cancelled).
    pub wasted_model_ms: i64,
    pub prompt_tokens: Option<i64>,
    pub completion_tokens: Option<i64>,
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
    /// Per tenant, the busiest [`REPORT_TENANTS`] first, the rest as [`OTHER_TENANTS`].
    pub by_tenant: Vec<TenantAccount>,
}

/// How many tenants [`build`] accounts for one by one (the rest: [`OTHER_TENANTS`]).
pub const REPORT_TENANTS: usize = 50;

/// The account that sums the tenants beyond the busiest ones ([`tenant_accounts`]).
pub const OTHER_TENANTS: &str = "other";

/// One group of a tenant's outcomes: one job (`lastcall report`), or one row of the
/// ledger's `GROUP BY tenant, state, reason` (the dashboard, `/metrics`).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct TenantSample {
    pub tenant: String,
    pub state: String,
    pub reason: Option<String>,
    pub jobs: u64,
    /// Summed duration of every model call of these jobs (each attempt's), ms.
    pub model_ms: u64,
    /// The part of `model_ms` spent on calls that did not complete on time: every call of
    /// a job that did not complete, and the earlier calls (failed, retried) of one that did.
    pub wasted_model_ms: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl TenantSample {
    /// One job's sample from its record's fields (negative counts as 0).
    pub fn of_job(
        tenant: &str,
        state: &str,
        reason: Option<&str>,
        model_ms: i64,
        wasted_model_ms: i64,
        prompt_tokens: Option<i64>,
        completion_tokens: Option<i64>,
    ) -> Self {
        let n = |v: Option<i64>| v.map_or(0, |v| v.max(0) as u64);
        let model_ms = n(Some(model_ms));
        Self {
            tenant: tenant.to_owned(),
            state: state.to_owned(),
            reason: reason.map(str::to_owned),
            jobs: 1,
            model_ms,
            wasted_model_ms: n(Some(wasted_model_ms)).min(model_ms),
            prompt_tokens: n(prompt_tokens),
            completion_tokens: n(completion_tokens),
        }
    }
}

/// What one tenant got from the shared capacity in a window.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Default)]
pub struct TenantAccount {
    pub tenant: String,
    /// Terminal outcomes.
    pub jobs: u64,
    /// `completed`: the call finished before the deadline.
    pub on_time: u64,
    /// Refused without a model call: `expired_not_started`, `expired_before_receive`,
    /// `rejected`. (Refusals at the door, shedding and quotas, write no ledger row: they are
    /// counted by `serve`'s `/metrics`.)
    pub refused: u64,
    /// Every outcome but `completed`, keyed `state/reason` (`state` alone without a
    /// reason), most frequent first.
    pub not_on_time: Vec<Count>,
    /// Model time of the recorded calls, ms.
    pub model_ms: u64,
    /// The part of `model_ms` spent on calls that did not complete (cut at the deadline,
    /// failed and retried or not, cancelled): work nobody could use.
    pub wasted_model_ms: u64,
    pub prompt_tokens: u64,
    pub completion_tokens: u64,
}

impl TenantAccount {
    fn add(&mut self, s: &TenantSample, reasons: &mut BTreeMap<String, u64>) {
        self.jobs = self.jobs.saturating_add(s.jobs);
        self.model_ms = self.model_ms.saturating_add(s.model_ms);
        self.prompt_tokens = self.prompt_tokens.saturating_add(s.prompt_tokens);
        self.completion_tokens = self.completion_tokens.saturating_add(s.completion_tokens);
        self.wasted_model_ms = self.wasted_model_ms.saturating_add(s.wasted_model_ms);
        if s.state == State::Completed.as_str() {
            self.on_time += s.jobs;
            return;
        }
        let refused = [
            State::ExpiredNotStarted,
            State::ExpiredBeforeReceive,
            State::Rejected,
        ];
        if refused.iter().any(|r| r.as_str() == s.state) {
            self.refused += s.jobs;
        }
        let key = match &s.reason {
            Some(r) if !r.is_empty() => format!("{}/{r}", s.state),
            _ => s.state.clone(),
        };
        *reasons.entry(key).or_default() += s.jobs;
    }
}

/// Fold `samples` into one account per tenant: the `top` tenants with the most jobs (ties
/// by name) in that order, then, if any is left, one [`OTHER_TENANTS`] account summing
/// the rest. Pure; the caller decides the window.
pub fn tenant_accounts(samples: &[TenantSample], top: usize) -> Vec<TenantAccount> {
    let mut per = BTreeMap::<&str, (TenantAccount, BTreeMap<String, u64>)>::new();
    for s in samples {
        let (acc, reasons) = per.entry(s.tenant.as_str()).or_insert_with(|| {
            (
                TenantAccount {
                    tenant: s.tenant.clone(),
                    ..Default::default()
                },
                BTreeMap::new(),
            )
        });
        acc.add(s, reasons);
    }
    let mut ranked: Vec<(TenantAccount, BTreeMap<String, u64>)> = per.into_values().collect();
    ranked.sort_by(|a, b| {
        b.0.jobs
            .cmp(&a.0.jobs)
            .then_with(|| a.0.tenant.cmp(&b.0.tenant))
    });
    let rest = ranked.split_off(top.min(ranked.len()));
    let mut out: Vec<TenantAccount> = ranked
        .into_iter()
        .map(|(mut acc, reasons)| {
            acc.not_on_time = counted(reasons);
            acc
        })
        .collect();
    if !rest.is_empty() {
        let mut other = TenantAccount {
            tenant: OTHER_TENANTS.to_owned(),
            ..Default::default()
        };
        let mut reasons = BTreeMap::<String, u64>::new();
        for (acc, r) in rest {
            other.jobs = other.jobs.saturating_add(acc.jobs);
            other.on_time = other.on_time.saturating_add(acc.on_time);
            other.refused = other.refused.saturating_add(acc.refused);
            other.model_ms = other.model_ms.saturating_add(acc.model_ms);
            other.wasted_model_ms = other.wasted_model_ms.saturating_add(acc.wasted_model_ms);
            other.prompt_tokens = other.prompt_tokens.saturating_add(acc.prompt_tokens);
            other.completion_tokens = other
                .completion_tokens
                .saturating_add(acc.completion_tokens);
            for (k, n) in r {
                *reasons.entry(k).or_default() += n;
            }
        }
        other.not_on_time = counted(reasons);
        out.push(other);
    }
    out
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
    let mut tenants = Vec::with_capacity(rows.len());
    for r in rows {
        tenants.push(TenantSample::of_job(
            &r.tenant,
            &r.state,
            r.reason.as_deref(),
            r.model_ms,
            r.wasted_model_ms,
            r.prompt_tokens,
            r.completion_tokens,
        ));
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
        by_tenant: tenant_accounts(&tenants, REPORT_TENANTS),
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
            tenant: "default".into(),
            ..Default::default()
        }
    }

    fn sample(tenant: &str, state: &str, reason: Option<&str>, jobs: u64, ms: u64) -> TenantSample {
        TenantSample {
            tenant: tenant.into(),
            state: state.into(),
            reason: reason.map(Into::into),
            jobs,
            model_ms: ms,
            wasted_model_ms: if state == "completed" { 0 } else { ms },
            prompt_tokens: jobs * 10,
            completion_tokens: jobs,
        }
    }

    #[test]
    fn tenant_accounts_split_on_time_refused_and_wasted_model_time() {
        let samples = [
            sample("a", "completed", None, 8, 800),
            sample(
                "a",
                "deadline_exceeded",
                Some("cancelled_at_deadline"),
                2,
                300,
            ),
            sample(
                "a",
                "expired_not_started",
                Some("admission:deadline_passed"),
                3,
                0,
            ),
            sample("b", "completed", None, 1, 100),
            sample(
                "b",
                "expired_before_receive",
                Some("broker_ttl_expired"),
                1,
                0,
            ),
            sample("c", "rejected", Some("missing_field"), 1, 0),
            sample("d", "failed", None, 1, 50),
        ];
        let all = tenant_accounts(&samples, usize::MAX);
        let names: Vec<&str> = all.iter().map(|a| a.tenant.as_str()).collect();
        assert_eq!(names, ["a", "b", "c", "d"], "busiest first, ties by name");
        let a = &all[0];
        assert_eq!((a.jobs, a.on_time, a.refused), (13, 8, 3));
        assert_eq!((a.model_ms, a.wasted_model_ms), (1100, 300));
        assert_eq!((a.prompt_tokens, a.completion_tokens), (130, 13));
        assert_eq!(
            a.not_on_time,
            vec![
                Count {
                    key: "expired_not_started/admission:deadline_passed".into(),
                    count: 3
                },
                Count {
                    key: "deadline_exceeded/cancelled_at_deadline".into(),
                    count: 2
                },
            ]
        );
        assert_eq!(all[3].not_on_time[0].key, "failed");
        assert_eq!(all[3].wasted_model_ms, 50);

        // Bounded: the busiest one alone, the rest summed as `other`.
        let top = tenant_accounts(&samples, 1);
        assert_eq!(top.len(), 2);
        assert_eq!(top[0], all[0]);
        let other = &top[1];
        assert_eq!(other.tenant, OTHER_TENANTS);
        assert_eq!((other.jobs, other.on_time, other.refused), (4, 1, 2));
        assert_eq!((other.model_ms, other.wasted_model_ms), (150, 50));
        assert_eq!(other.not_on_time.iter().map(|c| c.count).sum::<u64>(), 3);
        // Nothing left over: no `other`.
        assert_eq!(tenant_accounts(&samples, 4), all);
        assert!(tenant_accounts(&[], 3).is_empty());
    }

    /// A job that completed after a failed, retried call: both calls count as model time,
    /// the failed one as wasted, and the job as on time.
    #[test]
    fn a_retried_call_is_wasted_model_time_of_a_job_that_completed() {
        let mut rows = vec![row("completed", "k", None, 0, 10)];
        rows[0].tenant = "team-a".into();
        (rows[0].model_ms, rows[0].wasted_model_ms) = (140, 100);
        let a = &build(&rows, 0, 1).by_tenant[0];
        assert_eq!(
            (a.jobs, a.on_time, a.model_ms, a.wasted_model_ms),
            (1, 1, 140, 100)
        );
        // A record can never say more was wasted than was spent.
        let s = TenantSample::of_job("t", "failed", None, 30, 99, None, None);
        assert_eq!((s.model_ms, s.wasted_model_ms), (30, 30));
    }

    #[test]
    fn the_report_accounts_per_tenant() {
        let mut rows = vec![
            row("completed", "k", None, 0, 10),
            row(
                "expired_not_started",
                "k",
                Some("receipt:below_min_runtime"),
                0,
                10,
            ),
        ];
        rows[0].tenant = "team-a".into();
        rows[0].model_ms = 40;
        rows[0].prompt_tokens = Some(7);
        let rep = build(&rows, 0, 1);
        assert_eq!(rep.by_tenant.len(), 2);
        let a = rep.by_tenant.iter().find(|t| t.tenant == "team-a").unwrap();
        assert_eq!(
            (a.jobs, a.on_time, a.model_ms, a.prompt_tokens),
            (1, 1, 40, 7)
        );
        let d = rep
            .by_tenant
            .iter()
            .find(|t| t.tenant == "default")
            .unwrap();
        assert_eq!((d.jobs, d.on_time, d.refused), (1, 0, 1));
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
