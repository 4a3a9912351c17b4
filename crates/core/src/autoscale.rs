//! What an autoscaler is told: the model slots the current arrivals need, and the share of
//! them the fleet's slots can serve in the next minute if the last minute goes on.
//!
//! A capacity model, not a queueing simulation (Little's law): arrivals per second times
//! the mean call time is the number of calls that must run at once to serve every arrival.
//! Arrivals are the outcomes recorded in the window (refusals included: each was a job
//! that wanted a slot); the call time is the mean of the window's completed calls, else
//! the longest call time the fleet has learned. It is the minimum at full use: slots
//! only just that many would leave no room for bursts, so an autoscaler's target should
//! sit below a worker's slots (docs/operations.md).

/// The window's numbers, from the ledger.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Demand {
    /// Terminal outcomes recorded in the window.
    pub outcomes: u64,
    /// Of them `completed`.
    pub completed: u64,
    /// Model time of the completed calls, ms.
    pub useful_model_ms: u64,
    pub window_ms: u64,
}

/// What `serve`'s `/metrics` reports.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Plan {
    /// Model slots that the arrivals keep busy: arrivals/s × mean call time, s.
    pub slots_needed: f64,
    /// The fleet's slots (its fresh workers' concurrency limits); `None`: no worker
    /// publishes live numbers.
    pub slots: Option<i64>,
    /// The share of the arrivals those slots can serve, `slots ÷ slots_needed` at most 1;
    /// `None` without the fleet's slots.
    pub on_time_share: Option<f64>,
}

/// The plan for `d`, with the fleet's slots and its longest learned call time (ms) for
/// a window without a completed call. `None`: arrivals but no call time to go by.
pub fn plan(d: &Demand, slots: Option<i64>, learned_call_ms: Option<u64>) -> Option<Plan> {
    let call_ms = if d.completed > 0 {
        d.useful_model_ms as f64 / d.completed as f64
    } else if d.outcomes == 0 {
        0.0
    } else {
        learned_call_ms? as f64
    };
    let per_s = d.outcomes as f64 * 1000.0 / d.window_ms.max(1) as f64;
    let slots_needed = per_s * call_ms / 1000.0;
    let on_time_share = slots.map(|s| {
        if slots_needed <= 0.0 {
            1.0
        } else {
            (s.max(0) as f64 / slots_needed).min(1.0)
        }
    });
    Some(Plan {
        slots_needed,
        slots,
        on_time_share,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn demand(outcomes: u64, completed: u64, useful_model_ms: u64) -> Demand {
        Demand {
            outcomes,
            completed,
            useful_model_ms,
            window_ms: 60_000,
        }
    }

    #[test]
    fn twenty_jobs_a_second_of_200_ms_need_four_slots() {
        // 1,200 arrivals in a minute, 600 completed at 200 ms each.
        let p = plan(&demand(1_200, 600, 120_000), Some(2), None).unwrap();
        assert!((p.slots_needed - 4.0).abs() < 1e-9, "{p:?}");
        assert_eq!(p.on_time_share, Some(0.5));
        let p = plan(&demand(1_200, 600, 120_000), Some(6), None).unwrap();
        assert_eq!(p.on_time_share, Some(1.0));
    }

    #[test]
    fn no_completion_goes_by_the_learned_call_time_and_nothing_by_none() {
        let p = plan(&demand(60, 0, 0), Some(1), Some(2_000)).unwrap();
        assert!((p.slots_needed - 2.0).abs() < 1e-9, "{p:?}");
        assert_eq!(p.on_time_share, Some(0.5));
        assert_eq!(plan(&demand(60, 0, 0), Some(1), None), None);
        // No arrivals: nothing needed, everything served; no fleet: no share.
        let idle = plan(&demand(0, 0, 0), None, None).unwrap();
        assert_eq!((idle.slots_needed, idle.on_time_share), (0.0, None));
        assert_eq!(
            plan(&demand(0, 0, 0), Some(0), None).unwrap().on_time_share,
            Some(1.0)
        );
    }

    proptest! {
        #[test]
        fn more_arrivals_need_more_slots_and_the_share_is_a_share(
            outcomes in 1u64..100_000,
            extra in 1u64..1_000,
            completed_of in 1u64..=100,
            call_ms in 1u64..60_000,
            slots in 0i64..10_000,
        ) {
            let completed = (outcomes * completed_of / 100).max(1).min(outcomes);
            let d = demand(outcomes, completed, completed * call_ms);
            let more = Demand { outcomes: outcomes + extra, ..d };
            let p = plan(&d, Some(slots), None).unwrap();
            let q = plan(&more, Some(slots), None).unwrap();
            prop_assert!(q.slots_needed > p.slots_needed);
            let share = p.on_time_share.unwrap();
            prop_assert!((0.0..=1.0).contains(&share));
            prop_assert!(q.on_time_share.unwrap() <= share);
            // Every arrival served exactly when the slots cover the need.
            prop_assert_eq!(share >= 1.0, slots as f64 >= p.slots_needed);
        }
    }
}
