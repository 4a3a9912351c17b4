//! A circuit breaker per model server (per backend, or per route when the worker routes
//! kinds to several backends), pure: `now_ms` is an argument, the worker holds one
//! [`Breaker`] per backend and only reports what happened.
//!
//! - **Closed**: calls go out. [`BreakerPolicy::failures_to_open`] consecutive server-side
//!   failures ([`Verdict::Failure`]: connect errors, 5xx, 408, a 429 without a usable
//!   `Retry-After`, a call cut at the deadline although its budget was at least
//!   [`BreakerPolicy::hang_factor`] × the kind's learned p99 — a hung call) open it.
//! - **Open**: no call goes out until `open_until_ms`: the cool-down (starting at
//!   [`BreakerPolicy::cool_down_ms`], doubled after each failed trial up to
//!   [`BreakerPolicy::max_cool_down_ms`]), and never before a server's `Retry-After`
//!   up to that maximum (a header is advice: a `Retry-After` of a day holds it for
//!   `max_cool_down_ms`, then the trial call goes).
//! - **Demand trials**: the doubled cool-down spares a server that is still down, but it
//!   must not refuse the jobs that ask meanwhile. A job whose latest useful start comes
//!   before the cool-down's end (it would be refused `upstream_unavailable`) takes the
//!   trial at once, provided no trial runs and [`BreakerPolicy::cool_down_ms`] (the
//!   first, undoubled cool-down) has passed since the last trial started (or the breaker
//!   opened): trials start at most one per first cool-down, and early only while jobs
//!   would otherwise be lost. A server's own `Retry-After` is not shortened this way.
//! - **Half-open**: the first job to ask after the cool-down gets the one trial call
//!   ([`Permit::Trial`]); everyone else waits. The trial's success closes the breaker (and
//!   resets the cool-down), its failure opens it again with the doubled cool-down; a trial
//!   that ended without a verdict (cancelled, the job settled otherwise) lets the next job
//!   try.
//!
//! A result of a call that started before the breaker opened (not a trial) does not move
//! an open or half-open breaker: only the trial decides.

use crate::disposition::CallResult;
use crate::reason::Reason;

/// The breaker's settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BreakerPolicy {
    /// Consecutive server-side failures that open a closed breaker.
    pub failures_to_open: u32,
    /// The first cool-down after opening (ms).
    pub cool_down_ms: u64,
    /// The longest cool-down after repeated failed trials (ms).
    pub max_cool_down_ms: u64,
    /// A call cut at the deadline counts as a failure (hung server) when its budget was at
    /// least this many times the learned p99 of the kind's completed calls.
    pub hang_factor: u64,
}

impl Default for BreakerPolicy {
    fn default() -> Self {
        Self {
            failures_to_open: 5,
            cool_down_ms: 1_000,
            max_cool_down_ms: 30_000,
            hang_factor: 4,
        }
    }
}

/// The breaker's state, as the metrics gauge shows it (0, 1, 2).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum BreakerState {
    Closed,
    HalfOpen,
    Open,
}

impl BreakerState {
    pub const fn gauge(self) -> i64 {
        match self {
            BreakerState::Closed => 0,
            BreakerState::HalfOpen => 1,
            BreakerState::Open => 2,
        }
    }

    pub const fn as_str(self) -> &'static str {
        match self {
            BreakerState::Closed => "closed",
            BreakerState::HalfOpen => "half_open",
            BreakerState::Open => "open",
        }
    }
}

/// What a job about to call may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Permit {
    /// Closed: call.
    Call,
    /// Half-open: this call is the one trial; report its verdict with `trial = true`.
    Trial,
    /// Open, or half-open with the trial running: no call before `next_call_at_ms` (the
    /// earliest instant a call of this job could go out: the end of the cool-down, or, while
    /// a trial runs, the instant it becomes overdue).
    Wait { next_call_at_ms: i64 },
}

/// What a call's end says about the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// The server answered (a completion, or a 4xx about the request itself).
    Success,
    /// A server-side failure; `retry_after_ms`: the server's `Retry-After`.
    Failure { retry_after_ms: Option<u64> },
    /// Says nothing about the server (cancelled, a 429 with a usable `Retry-After`, a cut
    /// call that was not far past the learned time, the broker's ack window).
    Neutral,
}

/// A change of state, for the log line and the open counter.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    pub from: BreakerState,
    pub to: BreakerState,
    /// When `to` is `Open`: until when.
    pub open_until_ms: Option<i64>,
}

impl Verdict {
    /// The verdict of a call's end. `budget_ms`: the call's timeout; `completed_p99_ms`:
    /// the learned p99 of the kind's calls, if any.
    pub fn of(
        policy: &BreakerPolicy,
        result: &CallResult,
        budget_ms: u64,
        completed_p99_ms: Option<u64>,
    ) -> Verdict {
        match result {
            CallResult::Completed => Verdict::Success,
            CallResult::Cancelled => Verdict::Neutral,
            CallResult::DeadlineExceeded => match completed_p99_ms {
                Some(p99) if budget_ms >= p99.max(1).saturating_mul(policy.hang_factor) => {
                    Verdict::Failure {
                        retry_after_ms: None,
                    }
                }
                _ => Verdict::Neutral,
            },
            CallResult::Failed {
                retryable: false,
                reason,
                ..
            } => match reason {
                Reason::Backend(_) => Verdict::Success,
                _ => Verdict::Neutral,
            },
            CallResult::Failed {
                retryable: true,
                reason,
                retry_after_ms,
            } => match (reason, retry_after_ms) {
                // Rate limited, with a usable Retry-After: the server is up and said when
                // to come back; the retry honours it (`retry.rs`), the breaker stays.
                (Reason::Backend(code), Some(_)) if code == "http_429" => Verdict::Neutral,
                (Reason::Backend(_), _) => Verdict::Failure {
                    retry_after_ms: *retry_after_ms,
                },
                _ => Verdict::Neutral,
            },
        }
    }
}

/// One server's breaker.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Breaker {
    state: BreakerState,
    consecutive: u32,
    open_until_ms: i64,
    cool_down_ms: u64,
    trial_started_ms: Option<i64>,
    opens: u64,
    /// When its last trial started, or when it opened if no trial led to the opening:
    /// demand trials start at least the first cool-down after it.
    last_trial_ms: i64,
    /// The server set the open period (`Retry-After`): no demand trial before its end.
    server_hold: bool,
}

impl Breaker {
    pub fn new(policy: &BreakerPolicy) -> Self {
        Self {
            state: BreakerState::Closed,
            consecutive: 0,
            open_until_ms: 0,
            cool_down_ms: policy.cool_down_ms,
            trial_started_ms: None,
            opens: 0,
            last_trial_ms: 0,
            server_hold: false,
        }
    }

    /// The state as of the last event (an open breaker whose cool-down has passed still
    /// says `Open` until a job asks).
    pub fn state(&self) -> BreakerState {
        self.state
    }

    /// How many times it opened.
    pub fn opens(&self) -> u64 {
        self.opens
    }

    /// Until when it is open (meaningful in `Open`).
    pub fn open_until_ms(&self) -> i64 {
        self.open_until_ms
    }

    /// The earliest instant a job that cannot wait for the cool-down's end may take a
    /// demand trial (meaningful in `Open`): what the door is told, so that it lets such
    /// jobs through to the worker from then on.
    pub fn trial_from_ms(&self, policy: &BreakerPolicy) -> i64 {
        if self.server_hold {
            return self.open_until_ms;
        }
        let first = i64::try_from(policy.cool_down_ms).unwrap_or(i64::MAX);
        (self.last_trial_ms.saturating_add(first)).min(self.open_until_ms)
    }

    /// When a job that is refused now could call at the earliest; `trial_limit_ms`: how
    /// long a trial may run before it counts as failed (hung); `latest_start_ms`: the job's
    /// latest useful start, if known — one that cannot wait for the cool-down's end may
    /// come back for a demand trial ([`Self::trial_from_ms`]).
    pub fn next_call_at_ms(
        &self,
        policy: &BreakerPolicy,
        now_ms: i64,
        trial_limit_ms: u64,
        latest_start_ms: Option<i64>,
    ) -> i64 {
        match (self.state, self.trial_started_ms) {
            (BreakerState::Closed, _) => now_ms,
            (BreakerState::Open, _) if latest_start_ms.is_some_and(|l| l < self.open_until_ms) => {
                self.trial_from_ms(policy).max(now_ms)
            }
            (BreakerState::Open, _) => self.open_until_ms.max(now_ms),
            // A running trial is expected to answer within the kind's p99 (its hang limit
            // ÷ the hang factor): a job waits for that answer, looking again every p99,
            // rather than being judged by the instant the trial would count as hung. A
            // trial that is merely late must not refuse the jobs that could still use its
            // success.
            (BreakerState::HalfOpen, Some(t)) => {
                let step = i64::try_from((trial_limit_ms / policy.hang_factor.max(1)).max(1))
                    .unwrap_or(i64::MAX);
                let overdue = t
                    .saturating_add(i64::try_from(trial_limit_ms).unwrap_or(i64::MAX))
                    .saturating_add(1);
                let expected_end = t.saturating_add(step);
                if now_ms < expected_end {
                    expected_end
                } else {
                    now_ms.saturating_add(step).min(overdue).max(now_ms)
                }
            }
            (BreakerState::HalfOpen, None) => now_ms,
        }
    }

    /// A job is about to call at `now_ms`. A `Trial` (and the transition to half-open,
    /// returned for the log) must be answered by [`Self::ended`] or [`Self::trial_abandoned`].
    /// A trial that has run longer than `trial_limit_ms` (the kind's hang limit: a
    /// hang's verdict, known before its call ends) has failed: the breaker opens again.
    /// `latest_start_ms`: the job's latest useful start, if known; a job that cannot wait
    /// for the cool-down's end may take a demand trial (module doc).
    pub fn permit(
        &mut self,
        policy: &BreakerPolicy,
        trial_limit_ms: u64,
        latest_start_ms: Option<i64>,
        now_ms: i64,
    ) -> (Permit, Option<Transition>) {
        if self.state == BreakerState::HalfOpen
            && let Some(t) = self.trial_started_ms
            && now_ms.saturating_sub(t) > i64::try_from(trial_limit_ms).unwrap_or(i64::MAX)
        {
            let fail = Verdict::Failure {
                retry_after_ms: None,
            };
            let opened = self.ended(policy, true, fail, now_ms);
            let next_call_at_ms =
                self.next_call_at_ms(policy, now_ms, trial_limit_ms, latest_start_ms);
            return (Permit::Wait { next_call_at_ms }, opened);
        }
        let demand = latest_start_ms.is_some_and(|l| l < self.open_until_ms)
            && now_ms >= self.trial_from_ms(policy);
        match self.state {
            BreakerState::Closed => (Permit::Call, None),
            BreakerState::Open if now_ms >= self.open_until_ms || demand => {
                self.state = BreakerState::HalfOpen;
                self.trial_started_ms = Some(now_ms);
                let t = Transition {
                    from: BreakerState::Open,
                    to: BreakerState::HalfOpen,
                    open_until_ms: None,
                };
                (Permit::Trial, Some(t))
            }
            BreakerState::HalfOpen if self.trial_started_ms.is_none() => {
                self.trial_started_ms = Some(now_ms);
                (Permit::Trial, None)
            }
            BreakerState::Open | BreakerState::HalfOpen => (
                Permit::Wait {
                    next_call_at_ms: self.next_call_at_ms(
                        policy,
                        now_ms,
                        trial_limit_ms,
                        latest_start_ms,
                    ),
                },
                None,
            ),
        }
    }

    /// The running trial, named by the instant it started (no two trials start at the
    /// same instant: a new one comes a cool-down after the last one failed). A trial's
    /// caller keeps it and reports with [`Self::trial_is_current`]: a trial that was
    /// declared hung and whose call ends later must not decide its successor.
    pub fn trial_started_ms(&self) -> Option<i64> {
        self.trial_started_ms
    }

    /// Whether the trial that started at `started_ms` is the running one.
    pub fn trial_is_current(&self, started_ms: i64) -> bool {
        self.state == BreakerState::HalfOpen && self.trial_started_ms == Some(started_ms)
    }

    /// The trial that started at `started_ms` ended without a verdict: the next job may
    /// try (nothing changes when a later trial has replaced it).
    pub fn trial_abandoned(&mut self, started_ms: i64) {
        if self.trial_is_current(started_ms) {
            self.trial_started_ms = None;
        }
    }

    /// A call ended at `now_ms` with `verdict`; `trial`: it was the running half-open
    /// trial ([`Self::trial_is_current`]).
    pub fn ended(
        &mut self,
        policy: &BreakerPolicy,
        trial: bool,
        verdict: Verdict,
        now_ms: i64,
    ) -> Option<Transition> {
        match (self.state, trial) {
            (BreakerState::Closed, _) => match verdict {
                Verdict::Success => {
                    self.consecutive = 0;
                    None
                }
                Verdict::Neutral => None,
                Verdict::Failure { retry_after_ms } => {
                    self.consecutive = self.consecutive.saturating_add(1);
                    (self.consecutive >= policy.failures_to_open.max(1)).then(|| {
                        self.cool_down_ms = policy.cool_down_ms;
                        self.open(policy, BreakerState::Closed, retry_after_ms, now_ms)
                    })
                }
            },
            (BreakerState::HalfOpen, true) => match verdict {
                Verdict::Success => {
                    self.state = BreakerState::Closed;
                    self.consecutive = 0;
                    self.trial_started_ms = None;
                    self.cool_down_ms = policy.cool_down_ms;
                    Some(Transition {
                        from: BreakerState::HalfOpen,
                        to: BreakerState::Closed,
                        open_until_ms: None,
                    })
                }
                Verdict::Neutral => {
                    self.trial_started_ms = None;
                    None
                }
                Verdict::Failure { retry_after_ms } => {
                    // The server said when to come back: that is the cool-down. Else back
                    // off: twice as long, up to the maximum.
                    if retry_after_ms.is_none() {
                        self.cool_down_ms = self
                            .cool_down_ms
                            .saturating_mul(2)
                            .min(policy.max_cool_down_ms.max(policy.cool_down_ms));
                    }
                    Some(self.open(policy, BreakerState::HalfOpen, retry_after_ms, now_ms))
                }
            },
            // A call that started before the breaker opened: only the trial decides.
            _ => None,
        }
    }

    fn open(
        &mut self,
        policy: &BreakerPolicy,
        from: BreakerState,
        retry_after_ms: Option<u64>,
        now_ms: i64,
    ) -> Transition {
        // The server's Retry-After is advice: never longer than the longest cool-down.
        let max = policy.max_cool_down_ms.max(policy.cool_down_ms);
        let hold = retry_after_ms.map_or(self.cool_down_ms, |ra| ra.min(max));
        self.server_hold = retry_after_ms.is_some();
        self.last_trial_ms = match from {
            BreakerState::HalfOpen => self.trial_started_ms.unwrap_or(now_ms),
            _ => now_ms,
        };
        self.state = BreakerState::Open;
        self.trial_started_ms = None;
        self.open_until_ms = now_ms.saturating_add(i64::try_from(hold).unwrap_or(i64::MAX));
        self.opens += 1;
        Transition {
            from,
            to: BreakerState::Open,
            open_until_ms: Some(self.open_until_ms),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn fail() -> Verdict {
        Verdict::Failure {
            retry_after_ms: None,
        }
    }

    fn policy() -> BreakerPolicy {
        BreakerPolicy {
            failures_to_open: 3,
            cool_down_ms: 1_000,
            max_cool_down_ms: 8_000,
            hang_factor: 4,
        }
    }

    #[test]
    fn opens_after_n_failures_then_one_trial_closes_it() {
        let p = policy();
        let mut b = Breaker::new(&p);
        assert_eq!(b.ended(&p, false, fail(), 0), None);
        assert_eq!(b.ended(&p, false, fail(), 1), None);
        let t = b.ended(&p, false, fail(), 2).unwrap();
        assert_eq!((t.to, t.open_until_ms), (BreakerState::Open, Some(1_002)));
        assert_eq!(
            b.permit(&p, 10_000, None, 500).0,
            Permit::Wait {
                next_call_at_ms: 1_002
            }
        );
        assert_eq!(b.permit(&p, 10_000, None, 1_002).0, Permit::Trial);
        assert_eq!(b.state(), BreakerState::HalfOpen);
        // Everyone else waits while the trial runs.
        assert!(matches!(
            b.permit(&p, 10_000, None, 1_003).0,
            Permit::Wait { .. }
        ));
        // The trial fails: open again for twice as long.
        let t = b.ended(&p, true, fail(), 1_100).unwrap();
        assert_eq!(t.open_until_ms, Some(3_100));
        assert_eq!(b.permit(&p, 10_000, None, 3_100).0, Permit::Trial);
        let t = b.ended(&p, true, Verdict::Success, 3_200).unwrap();
        assert_eq!(t.to, BreakerState::Closed);
        assert_eq!(b.permit(&p, 10_000, None, 3_201).0, Permit::Call);
        assert_eq!(b.opens(), 2);
    }

    #[test]
    fn a_hung_trial_fails_once_it_is_overdue() {
        let p = policy();
        let mut b = Breaker::new(&p);
        for _ in 0..3 {
            b.ended(&p, false, fail(), 0);
        }
        assert_eq!(b.permit(&p, 600, None, 1_000).0, Permit::Trial);
        // Others wait for the trial's answer, expected within the kind's p99 (600 ÷ 4) …
        assert_eq!(
            b.permit(&p, 600, None, 1_100).0,
            Permit::Wait {
                next_call_at_ms: 1_150
            }
        );
        // … and once it is late, again a p99 later, until the trial would be overdue.
        assert_eq!(
            b.permit(&p, 600, None, 1_200).0,
            Permit::Wait {
                next_call_at_ms: 1_350
            }
        );
        assert_eq!(
            b.permit(&p, 600, None, 1_500).0,
            Permit::Wait {
                next_call_at_ms: 1_601
            }
        );
        // Overdue: the trial failed, open again for the doubled cool-down.
        let (permit, t) = b.permit(&p, 600, None, 1_601);
        assert_eq!(t.unwrap().open_until_ms, Some(3_601));
        assert_eq!(
            permit,
            Permit::Wait {
                next_call_at_ms: 3_601
            }
        );
        // Its late end does not move the breaker.
        assert!(!b.trial_is_current(1_000));
        assert_eq!(b.ended(&p, false, Verdict::Success, 2_000), None);
        assert_eq!(b.state(), BreakerState::Open);
        // Nor that of a successor: the next trial runs, the hung one's call ends (cut at
        // its deadline, a failure) or is dropped; the successor alone decides.
        assert_eq!(b.permit(&p, 600, None, 3_601).0, Permit::Trial);
        assert_eq!(b.trial_started_ms(), Some(3_601));
        assert!(!b.trial_is_current(1_000));
        b.trial_abandoned(1_000);
        assert!(matches!(
            b.permit(&p, 600, None, 3_650).0,
            Permit::Wait { .. }
        ));
        let t = b.ended(&p, b.trial_is_current(3_601), Verdict::Success, 3_700);
        assert_eq!(t.unwrap().to, BreakerState::Closed);
    }

    #[test]
    fn retry_after_holds_it_open_longer_and_a_success_resets_the_count() {
        let p = policy();
        let mut b = Breaker::new(&p);
        b.ended(&p, false, fail(), 0);
        b.ended(&p, false, fail(), 0);
        b.ended(&p, false, Verdict::Success, 0);
        b.ended(&p, false, fail(), 0);
        b.ended(&p, false, fail(), 0);
        assert_eq!(b.state(), BreakerState::Closed);
        let t = b.ended(
            &p,
            false,
            Verdict::Failure {
                retry_after_ms: Some(5_000),
            },
            10,
        );
        assert_eq!(t.unwrap().open_until_ms, Some(5_010));
    }

    /// A `Retry-After` of a day holds the breaker for the longest cool-down, then the
    /// trial call goes.
    #[test]
    fn a_retry_after_longer_than_the_longest_cool_down_is_cut_to_it() {
        let p = policy();
        let mut b = Breaker::new(&p);
        let day = Verdict::Failure {
            retry_after_ms: Some(86_400_000),
        };
        for _ in 0..3 {
            b.ended(&p, false, day, 0);
        }
        assert_eq!(b.open_until_ms(), 8_000);
        assert_eq!(b.permit(&p, 10_000, None, 8_000).0, Permit::Trial);
        let t = b.ended(&p, true, day, 8_100).unwrap();
        assert_eq!(t.open_until_ms, Some(16_100));
    }

    /// After failed trials the cool-down has doubled to 4 s; a job that can wait for its
    /// end waits, one that cannot takes a trial once the first cool-down (1 s) has passed
    /// since the opening — not before, not while a trial runs, and not against a server's
    /// own Retry-After.
    #[test]
    fn a_job_that_cannot_wait_for_the_backoff_takes_a_demand_trial() {
        let p = policy();
        let mut b = Breaker::new(&p);
        for _ in 0..3 {
            b.ended(&p, false, fail(), 0);
        }
        assert_eq!(b.permit(&p, 10_000, None, 1_000).0, Permit::Trial);
        b.ended(&p, true, fail(), 1_000);
        assert_eq!(b.permit(&p, 10_000, None, 3_000).0, Permit::Trial);
        b.ended(&p, true, fail(), 3_000);
        // Open from 3 000 until 7 000 (4 s).
        assert_eq!(b.open_until_ms(), 7_000);
        assert_eq!(b.trial_from_ms(&p), 4_000);
        let wait = Permit::Wait {
            next_call_at_ms: 7_000,
        };
        // Too early for a demand trial: a job that cannot wait for the end comes back for
        // one; a job that can wait for the end waits.
        assert_eq!(
            b.permit(&p, 10_000, Some(6_000), 3_500).0,
            Permit::Wait {
                next_call_at_ms: 4_000
            }
        );
        assert_eq!(b.permit(&p, 10_000, Some(7_500), 4_200).0, wait);
        assert_eq!(b.permit(&p, 10_000, None, 4_200).0, wait);
        // One that cannot: the trial, and the others wait for it.
        let (permit, t) = b.permit(&p, 10_000, Some(6_000), 4_200);
        assert_eq!(permit, Permit::Trial);
        assert_eq!(t.unwrap().to, BreakerState::HalfOpen);
        assert!(matches!(
            b.permit(&p, 10_000, Some(6_000), 4_300).0,
            Permit::Wait { .. }
        ));
        // It succeeds: closed at once.
        b.ended(&p, true, Verdict::Success, 4_400);
        assert_eq!(b.permit(&p, 10_000, Some(6_000), 4_401).0, Permit::Call);
        // A server's Retry-After holds its whole period.
        let mut b = Breaker::new(&p);
        let later = Verdict::Failure {
            retry_after_ms: Some(5_000),
        };
        for _ in 0..3 {
            b.ended(&p, false, later, 0);
        }
        assert_eq!(b.trial_from_ms(&p), 5_000);
        assert_eq!(
            b.permit(&p, 10_000, Some(2_000), 1_500).0,
            Permit::Wait {
                next_call_at_ms: 5_000
            }
        );
    }

    #[test]
    fn verdicts() {
        let p = policy();
        let failed = |code: &str, retryable, ra| CallResult::Failed {
            retryable,
            reason: Reason::Backend(code.into()),
            retry_after_ms: ra,
        };
        assert_eq!(
            Verdict::of(&p, &CallResult::Completed, 1, None),
            Verdict::Success
        );
        assert_eq!(
            Verdict::of(&p, &failed("http_503", true, None), 1, None),
            fail()
        );
        assert_eq!(
            Verdict::of(&p, &failed("http_429", true, Some(2_000)), 1, None),
            Verdict::Neutral
        );
        assert_eq!(
            Verdict::of(&p, &failed("http_429", true, None), 1, None),
            fail()
        );
        assert_eq!(
            Verdict::of(&p, &failed("http_400", false, None), 1, None),
            Verdict::Success
        );
        // Cut at the deadline: a hang only when the budget was far past the learned p99.
        let cut = CallResult::DeadlineExceeded;
        assert_eq!(Verdict::of(&p, &cut, 2_000, Some(100)), fail());
        assert_eq!(Verdict::of(&p, &cut, 300, Some(100)), Verdict::Neutral);
        assert_eq!(Verdict::of(&p, &cut, 2_000, None), Verdict::Neutral);
        let ack = CallResult::Failed {
            retryable: false,
            reason: Reason::ConsumerTimeout,
            retry_after_ms: None,
        };
        assert_eq!(Verdict::of(&p, &ack, 1, None), Verdict::Neutral);
    }

    #[derive(Debug, Clone)]
    enum Ev {
        /// A job asks after `.0` ms; `.1`: its latest start, `.1` ms on (none if 0).
        Ask(u16, u16),
        End(u8, u16),
        Abandon(u16),
    }

    fn ev() -> impl Strategy<Value = Ev> {
        prop_oneof![
            (0u16..2_000, 0u16..12_000).prop_map(|(d, l)| Ev::Ask(d, l)),
            (0u8..4, 0u16..2_000).prop_map(|(v, d)| Ev::End(v, d)),
            (0u16..2_000).prop_map(Ev::Abandon),
        ]
    }

    proptest! {
        /// On a manual clock, any sequence of asks and call ends: no call is permitted
        /// while open before the cool-down (nor before a Retry-After), except a demand
        /// trial of a job that cannot wait for it, at least the first cool-down after the
        /// opening; at most one trial runs at a time, only a trial's success closes an open
        /// breaker, and the opens counter counts the transitions to open.
        #[test]
        fn no_call_while_open_and_one_trial_at_a_time(evs in proptest::collection::vec(ev(), 1..200)) {
            let p = policy();
            let mut b = Breaker::new(&p);
            let mut now = 0i64;
            let mut trial_running = false;
            let mut opens = 0u64;
            let mut closed_once_open = 0u64;
            for e in evs {
                match e {
                    Ev::Ask(dt, l) => {
                        now += dt as i64;
                        let latest = (l > 0).then_some(now + l as i64);
                        let before = b.clone();
                        let (permit, t) = b.permit(&p, 3_000, latest, now);
                        if let Some(t) = t.filter(|t| t.to == BreakerState::Open) {
                            // The running trial was overdue (hung): it failed.
                            prop_assert!(trial_running);
                            prop_assert_eq!(before.state(), BreakerState::HalfOpen);
                            trial_running = false;
                            opens += 1;
                            prop_assert!(t.open_until_ms.unwrap() >= now + p.cool_down_ms as i64);
                        }
                        match permit {
                            Permit::Call => prop_assert_eq!(before.state(), BreakerState::Closed),
                            Permit::Trial => {
                                prop_assert!(!trial_running, "two trials at once");
                                prop_assert!(before.state() != BreakerState::Closed);
                                if before.state() == BreakerState::Open && now < before.open_until_ms() {
                                    // A demand trial: this job could not wait, no
                                    // Retry-After holds the server, and the first
                                    // cool-down has passed since the opening.
                                    prop_assert!(latest.is_some_and(|l| l < before.open_until_ms()));
                                    prop_assert!(!before.server_hold);
                                    prop_assert!(now >= before.last_trial_ms + p.cool_down_ms as i64);
                                }
                                trial_running = true;
                            }
                            Permit::Wait { next_call_at_ms } => {
                                prop_assert!(before.state() != BreakerState::Closed);
                                prop_assert!(next_call_at_ms >= now);
                            }
                        }
                    }
                    Ev::End(v, dt) => {
                        now += dt as i64;
                        let verdict = match v {
                            0 => Verdict::Success,
                            1 => Verdict::Neutral,
                            2 => Verdict::Failure { retry_after_ms: None },
                            _ => Verdict::Failure { retry_after_ms: Some(dt as u64 * 9) },
                        };
                        let trial = trial_running;
                        trial_running = false;
                        let before = b.state();
                        let t = b.ended(&p, trial, verdict, now);
                        if let Some(t) = t {
                            prop_assert_eq!(t.from, before);
                            if t.to == BreakerState::Open {
                                opens += 1;
                                let until = t.open_until_ms.unwrap();
                                match verdict {
                                    // The server's Retry-After is the cool-down, up to
                                    // the longest one.
                                    Verdict::Failure { retry_after_ms: Some(ra) } => {
                                        prop_assert_eq!(until, now + ra.min(p.max_cool_down_ms) as i64)
                                    }
                                    _ => {
                                        prop_assert!(until >= now + p.cool_down_ms as i64);
                                        prop_assert!(until - now <= p.max_cool_down_ms as i64);
                                    }
                                }
                            }
                            if t.to == BreakerState::Closed {
                                prop_assert!(trial && verdict == Verdict::Success);
                                closed_once_open += 1;
                            }
                        }
                    }
                    Ev::Abandon(dt) => {
                        now += dt as i64;
                        if trial_running {
                            b.trial_abandoned(b.trial_started_ms().unwrap());
                            trial_running = false;
                        }
                    }
                }
                prop_assert_eq!(b.opens(), opens);
                prop_assert!(closed_once_open <= opens);
            }
        }
    }
}
