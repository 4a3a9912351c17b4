//! The operator's first question: of the jobs that arrived in a window, how
//! many finished on time, how many were refused without a model call, how much model time
//! was wasted, and how long the slowest jobs waited in the queue.
//!
//! One computation serves the dashboard (`GET /v1/dashboard`, its headline row) and
//! `lastcall report`: the ledger groups the window's jobs (`Ledger::headline`, a bounded
//! `GROUP BY`) and [`headline`] folds the groups. Pure: the window is a value.
//!
//! - **Arrivals**: jobs created in `[since, until)`, whatever their state now (a job still
//!   waiting or running is an arrival not on time *yet*: [`Figures::pending`]).
//! - **On time**: those `completed` (the call finished before the deadline).
//! - **Refused**: ended without a model call: `expired_not_started`,
//!   `expired_before_receive`, `rejected` (as [`crate::report::TenantAccount::refused`]).
//! - **Wasted model time**: model time of their calls that did not complete.
//! - **p99 queue dwell**: publish → receipt by a worker, as the upper bound of the
//!   dwell-histogram bucket that holds the 99th percentile (nearest rank).
//!
//! The trend is the same figures over [`HEADLINE_SLICES`] equal slices of the window, by
//! arrival time.

use crate::outcome::State;
use serde::Serialize;

/// How many slices the trend has.
pub const HEADLINE_SLICES: i64 = 12;

/// One group of arrivals: the jobs of one slice in one state.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ArrivalGroup {
    pub slice: i64,
    pub state: String,
    pub jobs: u64,
    pub wasted_model_ms: u64,
}

/// One group of queue dwells: the arrivals of one slice in one histogram bucket (index
/// into the bounds, `bounds.len()` for the overflow bucket).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DwellGroup {
    pub slice: i64,
    pub bucket: usize,
    pub jobs: u64,
}

/// The headline figures of a window or of one slice of it.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Figures {
    pub since_ms: i64,
    pub until_ms: i64,
    pub arrivals: u64,
    pub on_time: u64,
    /// `on_time` ÷ `arrivals`, in percent (one decimal); `None` without arrivals.
    pub on_time_pct: Option<f64>,
    pub refused: u64,
    /// Arrivals with no outcome yet (accepted or running).
    pub pending: u64,
    pub wasted_model_ms: u64,
    /// The 99th percentile of the queue dwell, as its bucket's upper bound (ms); with
    /// `queue_dwell_p99_over`, it lies beyond the last bound. `None`: no job received.
    pub queue_dwell_p99_ms: Option<u64>,
    pub queue_dwell_p99_over: bool,
}

/// The window's figures and their trend.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct Headline {
    #[serde(flatten)]
    pub total: Figures,
    /// The same figures per slice, oldest first.
    pub trend: Vec<Figures>,
}

/// The slice of `[since, until)` that `created_at_ms` falls in (what the ledger's query
/// computes), clamped to the slices.
pub fn slice_of(created_at_ms: i64, since_ms: i64, until_ms: i64, slices: i64) -> i64 {
    let span = (until_ms - since_ms).max(1);
    ((created_at_ms - since_ms).max(0) * slices / span).clamp(0, slices - 1)
}

/// The start of slice `i`: the first instant [`slice_of`] puts in it (rounded up).
pub fn slice_start(i: i64, since_ms: i64, until_ms: i64, slices: i64) -> i64 {
    let span = (until_ms - since_ms).max(1);
    since_ms + (span * i + slices - 1) / slices
}

fn is_refused(state: &str) -> bool {
    [
        State::ExpiredNotStarted,
        State::ExpiredBeforeReceive,
        State::Rejected,
    ]
    .iter()
    .any(|s| s.as_str() == state)
}

fn is_pending(state: &str) -> bool {
    !State::ALL
        .iter()
        .any(|s| s.is_terminal() && s.as_str() == state)
}

/// Nearest-rank `q` quantile of a histogram: `(bucket upper bound, beyond the last)`.
pub fn histogram_quantile(bounds: &[u64], counts: &[u64], q: f64) -> Option<(u64, bool)> {
    let n: u64 = counts.iter().sum();
    if n == 0 {
        return None;
    }
    let rank = ((q * n as f64).ceil() as u64).clamp(1, n);
    let mut seen = 0;
    for (i, c) in counts.iter().enumerate() {
        seen += c;
        if seen >= rank {
            return Some(match bounds.get(i) {
                Some(b) => (*b, false),
                None => (bounds.last().copied().unwrap_or(0), true),
            });
        }
    }
    None
}

fn figures<'a>(
    since_ms: i64,
    until_ms: i64,
    arrivals: impl Iterator<Item = &'a ArrivalGroup>,
    dwell: impl Iterator<Item = &'a DwellGroup>,
    bounds: &[u64],
) -> Figures {
    let mut f = Figures {
        since_ms,
        until_ms,
        ..Default::default()
    };
    for g in arrivals {
        f.arrivals += g.jobs;
        f.wasted_model_ms += g.wasted_model_ms;
        if g.state == State::Completed.as_str() {
            f.on_time += g.jobs;
        } else if is_refused(&g.state) {
            f.refused += g.jobs;
        } else if is_pending(&g.state) {
            f.pending += g.jobs;
        }
    }
    f.on_time_pct =
        (f.arrivals > 0).then(|| (1000.0 * f.on_time as f64 / f.arrivals as f64).round() / 10.0);
    let mut counts = vec![0u64; bounds.len() + 1];
    for g in dwell {
        if let Some(c) = counts.get_mut(g.bucket) {
            *c += g.jobs;
        }
    }
    if let Some((ms, over)) = histogram_quantile(bounds, &counts, 0.99) {
        f.queue_dwell_p99_ms = Some(ms);
        f.queue_dwell_p99_over = over;
    }
    f
}

/// Fold the window's groups (see the module doc) into the headline and its trend of
/// `slices` slices. `bounds` are the dwell histogram's upper bounds (ms).
pub fn headline(
    since_ms: i64,
    until_ms: i64,
    slices: i64,
    arrivals: &[ArrivalGroup],
    dwell: &[DwellGroup],
    bounds: &[u64],
) -> Headline {
    let total = figures(since_ms, until_ms, arrivals.iter(), dwell.iter(), bounds);
    let trend = (0..slices.max(1))
        .map(|i| {
            figures(
                slice_start(i, since_ms, until_ms, slices),
                slice_start(i + 1, since_ms, until_ms, slices),
                arrivals.iter().filter(|g| g.slice == i),
                dwell.iter().filter(|g| g.slice == i),
                bounds,
            )
        })
        .collect();
    Headline { total, trend }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const B: &[u64] = &[10, 100, 1_000];

    fn g(slice: i64, state: &str, jobs: u64, wasted: u64) -> ArrivalGroup {
        ArrivalGroup {
            slice,
            state: state.into(),
            jobs,
            wasted_model_ms: wasted,
        }
    }

    #[test]
    fn the_figures_of_a_window() {
        let arrivals = [
            g(0, "completed", 6, 100),
            g(0, "expired_not_started", 2, 0),
            g(1, "rejected", 1, 0),
            g(1, "deadline_exceeded", 1, 900),
            g(1, "running", 2, 0),
            g(1, "accepted", 1, 0),
            g(1, "completed", 1, 0),
        ];
        let dwell = [
            DwellGroup {
                slice: 0,
                bucket: 0,
                jobs: 98,
            },
            DwellGroup {
                slice: 1,
                bucket: 2,
                jobs: 2,
            },
        ];
        let h = headline(0, 1_000, 2, &arrivals, &dwell, B);
        let t = &h.total;
        assert_eq!((t.arrivals, t.on_time, t.refused, t.pending), (14, 7, 3, 3));
        assert_eq!(t.on_time_pct, Some(50.0));
        assert_eq!(t.wasted_model_ms, 1_000);
        // 100 dwells, rank 99 falls in the third bucket.
        assert_eq!(
            (t.queue_dwell_p99_ms, t.queue_dwell_p99_over),
            (Some(1_000), false)
        );
        assert_eq!(h.trend.len(), 2);
        assert_eq!((h.trend[0].since_ms, h.trend[0].until_ms), (0, 500));
        assert_eq!(h.trend[0].on_time_pct, Some(75.0));
        assert_eq!(h.trend[0].queue_dwell_p99_ms, Some(10));
        assert_eq!(h.trend[1].arrivals, 6);
    }

    #[test]
    fn an_empty_window_has_no_share_and_no_dwell() {
        let h = headline(0, 60_000, HEADLINE_SLICES, &[], &[], B);
        assert_eq!(h.total.on_time_pct, None);
        assert_eq!(h.total.queue_dwell_p99_ms, None);
        assert_eq!(h.trend.len(), HEADLINE_SLICES as usize);
    }

    #[test]
    fn a_p99_past_the_last_bound_says_so() {
        assert_eq!(
            histogram_quantile(B, &[0, 0, 0, 3], 0.99),
            Some((1_000, true))
        );
        assert_eq!(
            histogram_quantile(B, &[1, 0, 0, 0], 0.99),
            Some((10, false))
        );
    }

    proptest! {
        /// Every arrival lands in one slice, the slices tile the window, and the trend
        /// sums to the total.
        #[test]
        fn slices_tile_the_window_and_sum_to_the_total(
            since in -1_000_000i64..1_000_000,
            span in 1i64..10_000_000,
            slices in 1i64..30,
            jobs in proptest::collection::vec((0i64..10_000_000, 0usize..10, 0u64..1000), 0..60),
        ) {
            let until = since + span;
            let states = ["completed", "failed", "expired_not_started", "rejected",
                "accepted", "running", "deadline_exceeded", "expired_before_receive",
                "unknown", "cancelled"];
            let arrivals: Vec<ArrivalGroup> = jobs.iter().map(|(at, s, w)| {
                let created = since + at % span;
                let i = slice_of(created, since, until, slices);
                prop_assert!(slice_start(i, since, until, slices) <= created);
                prop_assert!(created < slice_start(i + 1, since, until, slices));
                Ok(g(i, states[*s], 1, *w))
            }).collect::<Result<_, _>>()?;
            let h = headline(since, until, slices, &arrivals, &[], B);
            let sum = |f: fn(&Figures) -> u64| h.trend.iter().map(f).sum::<u64>();
            prop_assert_eq!(sum(|f| f.arrivals), h.total.arrivals);
            prop_assert_eq!(sum(|f| f.on_time), h.total.on_time);
            prop_assert_eq!(sum(|f| f.refused), h.total.refused);
            prop_assert_eq!(sum(|f| f.wasted_model_ms), h.total.wasted_model_ms);
            prop_assert_eq!(h.total.arrivals, jobs.len() as u64);
            prop_assert_eq!(h.trend[0].since_ms, since);
            prop_assert_eq!(h.trend.last().unwrap().until_ms, until);
        }
    }
}
