//! Fallback routes: which backend of a kind's ordered route takes a job now.
//!
//! A `[routing]` route may list several backends, e.g. a local vLLM, then a hosted API. A
//! job goes to the **first** backend of the list that can take its call now: its circuit
//! breaker lets the call through, its rate-limit permit is there, and the call time learned
//! for the job's kind *on that backend* fits the job's room (its latest useful start has not
//! passed). When none can, the job waits (without a slot) for the backend whose breaker or
//! permit comes first, if that comes before the job's latest useful start on it; else it
//! ends with the reason the first backend gives (`admission:upstream_unavailable`, or
//! `admission:rate_limited`).
//!
//! Pure: the worker describes each backend as a [`Candidate`] at `now_ms` and carries out
//! the [`Choice`]; its gates (breaker permit, rate-limit permit, the admission check) then
//! run on the chosen backend as they do for a kind with one backend.
//!
//! **Invariant**: [`Choice::Call`] never names a backend whose breaker is open (or whose
//! half-open trial runs), whose permit is not there, or whose predicted call time exceeds
//! the room. With a single backend the choice is that backend and what follows is exactly
//! the single-backend path: breaker, then rate limit, then the admission rule.

/// One backend of a route, as it stands for one job at `now_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    /// The earliest instant its circuit breaker lets this job's call through
    /// ([`crate::breaker::Breaker::next_call_at_ms`]): `now_ms` or earlier when it is closed
    /// or its half-open trial is free.
    pub breaker_at_ms: i64,
    /// When its rate-limit permit for this call comes
    /// ([`crate::rate_limit::RateLimiter::permit_at`]); `None`: never (the request is larger
    /// than its tokens per minute).
    pub permit_at_ms: Option<i64>,
    /// The job's latest useful start on this backend: its deadline less the clock
    /// uncertainty and the call time learned for its kind on this backend (or its own
    /// minimum runtime). `None`: the policy does not watch deadlines.
    pub latest_start_ms: Option<i64>,
}

/// Why a backend cannot take the job within its budget.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Blocked {
    /// Its breaker lets no call through before the job's latest useful start.
    UpstreamUnavailable,
    /// Its rate-limit permit comes after the job's latest useful start, or never.
    RateLimited,
}

/// What to do with a job holding a slot, by the index of a backend in the route.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Choice {
    /// Call this backend now: breaker and permit let the call through, and the call time
    /// learned for it fits the room.
    Call(usize),
    /// No backend can take the job now or later within its budget, but this one (the
    /// first whose breaker and permit let a call through now) is held back only by its
    /// learned call time: the admission rule decides, as for a single backend (it refuses
    /// the job `below_learned_runtime`, or runs it as a probe when the refusal rests on
    /// stale calls).
    Admission(usize),
    /// No backend can take the job now; this one can at `at_ms` (its breaker's next trial,
    /// or its permit), before the job's latest useful start on it: wait without the slot,
    /// then choose again. The earliest such instant; the earlier backend on a tie.
    Wait { backend: usize, at_ms: i64 },
    /// No backend can take the job within its budget: it ends without a call, for the
    /// reason the first backend gives.
    Refuse { backend: usize, why: Blocked },
}

impl Choice {
    /// The backend the job goes on with.
    pub fn backend(&self) -> usize {
        match *self {
            Choice::Call(i) | Choice::Admission(i) => i,
            Choice::Wait { backend, .. } | Choice::Refuse { backend, .. } => backend,
        }
    }
}

/// Where one backend stands: ready now, or blocked until an instant (or for good).
enum Stand {
    Ready {
        fits: bool,
    },
    Later {
        at_ms: i64,
        in_time: bool,
        why: Blocked,
    },
}

fn stand(c: &Candidate, now_ms: i64) -> Stand {
    let before_latest = |at: i64| c.latest_start_ms.is_none_or(|l| at <= l);
    // The breaker first, then the permit: the order of the worker's gates.
    if c.breaker_at_ms > now_ms {
        return Stand::Later {
            at_ms: c.breaker_at_ms,
            in_time: before_latest(c.breaker_at_ms),
            why: Blocked::UpstreamUnavailable,
        };
    }
    match c.permit_at_ms {
        Some(at) if at <= now_ms => Stand::Ready {
            fits: before_latest(now_ms),
        },
        Some(at) => Stand::Later {
            at_ms: at,
            in_time: before_latest(at),
            why: Blocked::RateLimited,
        },
        None => Stand::Later {
            at_ms: i64::MAX,
            in_time: false,
            why: Blocked::RateLimited,
        },
    }
}

/// Choose the backend of `route` (in its order, non-empty) for a job at `now_ms`.
///
/// # Panics
/// If `route` is empty: a route names at least one backend.
pub fn choose(route: &[Candidate], now_ms: i64) -> Choice {
    assert!(!route.is_empty(), "a route names at least one backend");
    let stands: Vec<Stand> = route.iter().map(|c| stand(c, now_ms)).collect();
    if let Some(i) = (stands.iter()).position(|s| matches!(s, Stand::Ready { fits: true })) {
        return Choice::Call(i);
    }
    let later = stands.iter().enumerate().filter_map(|(i, s)| match s {
        Stand::Later {
            at_ms,
            in_time: true,
            ..
        } => Some((*at_ms, i)),
        _ => None,
    });
    if let Some((at_ms, backend)) = later.min() {
        return Choice::Wait { backend, at_ms };
    }
    if let Some(i) = (stands.iter()).position(|s| matches!(s, Stand::Ready { .. })) {
        return Choice::Admission(i);
    }
    // No backend is ready now, so the first is blocked until later (or for good).
    let Stand::Later { why, .. } = stands[0] else {
        return Choice::Admission(0);
    };
    Choice::Refuse { backend: 0, why }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    const NOW: i64 = 10_000;

    fn candidate() -> impl Strategy<Value = Candidate> {
        (
            prop_oneof![Just(0i64), Just(NOW), NOW - 500..NOW + 3_000],
            prop_oneof![
                Just(None),
                Just(Some(NOW)),
                (NOW - 500..NOW + 3_000).prop_map(Some)
            ],
            prop_oneof![Just(None), (NOW - 1_000..NOW + 3_000).prop_map(Some)],
        )
            .prop_map(|(breaker_at_ms, permit_at_ms, latest_start_ms)| Candidate {
                breaker_at_ms,
                permit_at_ms,
                latest_start_ms,
            })
    }

    fn breaker_lets_through(c: &Candidate) -> bool {
        c.breaker_at_ms <= NOW
    }
    fn permit_now(c: &Candidate) -> bool {
        c.permit_at_ms.is_some_and(|a| a <= NOW)
    }
    fn fits(c: &Candidate) -> bool {
        c.latest_start_ms.is_none_or(|l| NOW <= l)
    }

    /// Today's single-backend gates: the breaker (wait for its next trial when it comes
    /// before the latest start, else upstream_unavailable), then the permit (likewise,
    /// rate_limited), then the admission rule at the slot.
    fn single_backend_gates(c: &Candidate) -> Choice {
        let latest_ok = |at: i64| c.latest_start_ms.is_none_or(|l| at <= l);
        if c.breaker_at_ms > NOW {
            return match latest_ok(c.breaker_at_ms) {
                true => Choice::Wait {
                    backend: 0,
                    at_ms: c.breaker_at_ms,
                },
                false => Choice::Refuse {
                    backend: 0,
                    why: Blocked::UpstreamUnavailable,
                },
            };
        }
        match c.permit_at_ms {
            Some(at) if at <= NOW => match fits(c) {
                true => Choice::Call(0),
                false => Choice::Admission(0),
            },
            Some(at) if latest_ok(at) => Choice::Wait {
                backend: 0,
                at_ms: at,
            },
            _ => Choice::Refuse {
                backend: 0,
                why: Blocked::RateLimited,
            },
        }
    }

    proptest! {
        #[test]
        fn a_call_goes_only_to_a_backend_that_can_take_it_now(
            route in prop::collection::vec(candidate(), 1..5)
        ) {
            let choice = choose(&route, NOW);
            let i = choice.backend();
            prop_assert!(i < route.len());
            if let Choice::Call(i) = choice {
                let c = &route[i];
                prop_assert!(breaker_lets_through(c), "breaker open: {c:?}");
                prop_assert!(permit_now(c), "no permit: {c:?}");
                prop_assert!(fits(c), "predicted time exceeds the room: {c:?}");
            }
        }

        #[test]
        fn earlier_backends_are_preferred(route in prop::collection::vec(candidate(), 1..5)) {
            let choice = choose(&route, NOW);
            let can_now = |c: &Candidate| breaker_lets_through(c) && permit_now(c) && fits(c);
            match route.iter().position(can_now) {
                Some(first) => prop_assert_eq!(choice, Choice::Call(first)),
                None => prop_assert!(!matches!(choice, Choice::Call(_))),
            }
        }

        #[test]
        fn a_wait_is_for_the_earliest_backend_in_time_and_ends_before_its_latest_start(
            route in prop::collection::vec(candidate(), 1..5)
        ) {
            if let Choice::Wait { backend, at_ms } = choose(&route, NOW) {
                let c = &route[backend];
                prop_assert!(at_ms > NOW);
                prop_assert!(c.latest_start_ms.is_none_or(|l| at_ms <= l));
                prop_assert!(at_ms == c.breaker_at_ms || Some(at_ms) == c.permit_at_ms);
                prop_assert!(!route.iter().any(|c| breaker_lets_through(c) && permit_now(c) && fits(c)));
            }
        }

        #[test]
        fn admission_decides_only_when_nothing_else_can_take_the_job(
            route in prop::collection::vec(candidate(), 1..5)
        ) {
            if let Choice::Admission(i) = choose(&route, NOW) {
                let c = &route[i];
                prop_assert!(breaker_lets_through(c) && permit_now(c) && !fits(c));
                // An earlier backend ready now would have been chosen.
                prop_assert!(!route[..i].iter().any(|c| breaker_lets_through(c) && permit_now(c)));
            }
            if let Choice::Refuse { backend, .. } = choose(&route, NOW) {
                prop_assert_eq!(backend, 0);
                prop_assert!(!route.iter().any(|c| breaker_lets_through(c) && permit_now(c)));
            }
        }

        #[test]
        fn a_single_backend_goes_through_todays_gates(c in candidate()) {
            prop_assert_eq!(choose(&[c], NOW), single_backend_gates(&c));
        }
    }

    #[test]
    fn an_open_breaker_sends_the_job_to_the_next_backend() {
        let open = Candidate {
            breaker_at_ms: NOW + 1_000,
            permit_at_ms: Some(NOW),
            latest_start_ms: Some(NOW + 5_000),
        };
        let up = Candidate {
            breaker_at_ms: NOW,
            ..open
        };
        assert_eq!(choose(&[open, up], NOW), Choice::Call(1));
        // Both open: wait for the one that comes back first.
        let later = Candidate {
            breaker_at_ms: NOW + 500,
            ..open
        };
        assert_eq!(
            choose(&[open, later], NOW),
            Choice::Wait {
                backend: 1,
                at_ms: NOW + 500
            }
        );
    }

    #[test]
    fn a_slow_first_backend_sends_the_job_to_a_fast_second() {
        let slow = Candidate {
            breaker_at_ms: NOW,
            permit_at_ms: Some(NOW),
            latest_start_ms: Some(NOW - 1),
        };
        let fast = Candidate {
            latest_start_ms: Some(NOW + 100),
            ..slow
        };
        assert_eq!(choose(&[slow, fast], NOW), Choice::Call(1));
        // Neither fits: the first decides by the admission rule (a refusal, or a probe).
        assert_eq!(choose(&[slow, slow], NOW), Choice::Admission(0));
    }

    #[test]
    fn none_in_time_ends_with_the_first_backends_reason() {
        let open = Candidate {
            breaker_at_ms: NOW + 10_000,
            permit_at_ms: Some(NOW),
            latest_start_ms: Some(NOW + 1_000),
        };
        let limited = Candidate {
            breaker_at_ms: NOW,
            permit_at_ms: None,
            ..open
        };
        assert_eq!(
            choose(&[open, limited], NOW),
            Choice::Refuse {
                backend: 0,
                why: Blocked::UpstreamUnavailable
            }
        );
        assert_eq!(
            choose(&[limited, open], NOW),
            Choice::Refuse {
                backend: 0,
                why: Blocked::RateLimited
            }
        );
    }
}
