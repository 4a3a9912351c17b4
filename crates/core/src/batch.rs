//! Batches (the OpenAI-compatible Batch API): the completion window and a batch's status,
//! decided from facts read from the ledger and `now` given as a value.
//!
//! Every line of a batch is a job whose deadline is `created_at + window`; the batch's
//! status follows from how many lines were published, how many ended and how, whether a
//! cancellation was asked for, and whether the window is over.

/// The longest completion window: far enough for any batch, short enough that a deadline
/// stays an `i64` of milliseconds with room to spare.
pub const MAX_WINDOW_MS: i64 = 365 * 24 * 3_600_000;

/// Why a completion window is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WindowError {
    /// Not a window at all; the message says what was expected.
    Malformed(String),
    /// A well-formed window longer than [`MAX_WINDOW_MS`].
    TooLong(String),
}

impl WindowError {
    pub fn message(&self) -> &str {
        match self {
            WindowError::Malformed(m) | WindowError::TooLong(m) => m,
        }
    }
}

/// Parse a completion window: a positive integer without leading zeros and a unit, `s`,
/// `m`, `h` or `d` (`30m`, `2h`, `24h`, `7d`), at most 365 days.
pub fn parse_window(text: &str) -> Result<i64, WindowError> {
    let t = text.trim();
    let expected = "a positive whole number and a unit: s, m, h or d (`30m`, `2h`, `24h`, `7d`)";
    let malformed =
        || WindowError::Malformed(format!("`{t}` is not a completion window; give {expected}"));
    let Some(unit) = t.chars().last() else {
        return Err(WindowError::Malformed(format!(
            "the completion window is empty; give {expected}"
        )));
    };
    let per_unit: i64 = match unit {
        's' => 1_000,
        'm' => 60_000,
        'h' => 3_600_000,
        'd' => 86_400_000,
        _ => return Err(malformed()),
    };
    let digits = &t[..t.len() - 1];
    if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(malformed());
    }
    let too_long = || {
        WindowError::TooLong(format!(
            "the completion window `{t}` is longer than the longest, 365d"
        ))
    };
    let n: i64 = digits.parse().map_err(|_| too_long())?;
    match n.checked_mul(per_unit) {
        Some(ms) if ms <= MAX_WINDOW_MS => Ok(ms),
        _ => Err(too_long()),
    }
}

/// What the ledger says of a batch at one moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct BatchFacts {
    /// Lines in the input file.
    pub total: i64,
    /// Lines handled so far, from the first: published as jobs, or found malformed.
    pub cursor: i64,
    /// Lines among those that were malformed (never published; in the error file).
    pub malformed: i64,
    /// Published lines whose job ended `completed`.
    pub completed: i64,
    /// Published lines whose job ended expired (its deadline, the window's end, passed).
    pub expired: i64,
    /// Published lines whose job ended `cancelled`.
    pub cancelled: i64,
    /// Published lines whose job ended in any other terminal state.
    pub failed: i64,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    /// When a cancellation was asked for.
    pub cancelled_at_ms: Option<i64>,
    /// Whether every published line's job has been asked to cancel.
    pub cancel_done: bool,
}

/// A batch's status, as OpenAI names them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchStatus {
    Validating,
    InProgress,
    Finalizing,
    Completed,
    Expired,
    Cancelling,
    Cancelled,
    Failed,
}

impl BatchStatus {
    pub fn as_str(self) -> &'static str {
        match self {
            BatchStatus::Validating => "validating",
            BatchStatus::InProgress => "in_progress",
            BatchStatus::Finalizing => "finalizing",
            BatchStatus::Completed => "completed",
            BatchStatus::Expired => "expired",
            BatchStatus::Cancelling => "cancelling",
            BatchStatus::Cancelled => "cancelled",
            BatchStatus::Failed => "failed",
        }
    }

    /// Whether the batch has ended: its output and error files are final.
    pub fn is_terminal(self) -> bool {
        matches!(
            self,
            BatchStatus::Completed
                | BatchStatus::Expired
                | BatchStatus::Cancelled
                | BatchStatus::Failed
        )
    }
}

/// How long after the window's end a published line without an outcome still waits for
/// one (the workers record an expiry at the deadline) before it counts as expired.
pub const OUTCOME_GRACE_MS: i64 = 5_000;

/// The counts OpenAI reports (`request_counts`) and the status.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BatchView {
    pub status: BatchStatus,
    pub total: i64,
    pub completed: i64,
    /// Every line that ended otherwise: malformed, failed, expired, cancelled, and after
    /// the window those that never ran.
    pub failed: i64,
    /// Lines that will never run: not published, or published without an outcome, once
    /// the window (plus the grace) is over or the batch was cancelled and settled.
    pub never_ran: i64,
}

/// The batch's status at `now_ms`.
pub fn view(f: &BatchFacts, now_ms: i64) -> BatchView {
    let ended = f.completed + f.expired + f.cancelled + f.failed;
    let published = f.cursor - f.malformed;
    let pending = (published - ended).max(0);
    let unpublished = (f.total - f.cursor).max(0);
    let window_over = now_ms >= f.expires_at_ms.saturating_add(OUTCOME_GRACE_MS);
    let base_failed = f.malformed + f.expired + f.cancelled + f.failed;
    let settled = |status, never_ran: i64| BatchView {
        status,
        total: f.total,
        completed: f.completed,
        failed: base_failed + never_ran,
        never_ran,
    };
    if f.cancelled_at_ms.is_some() {
        // Cancelled: the lines never published never run; those published end as the
        // cancellation finds them (cancelled before their start, or their outcome).
        if f.cancel_done && (pending == 0 || window_over) {
            return settled(BatchStatus::Cancelled, unpublished + pending);
        }
        return BatchView {
            status: BatchStatus::Cancelling,
            ..settled(BatchStatus::Cancelling, 0)
        };
    }
    if f.total > 0 && f.malformed == f.total {
        return settled(BatchStatus::Failed, 0);
    }
    if unpublished == 0 && pending == 0 {
        let status = if f.expired > 0 {
            BatchStatus::Expired
        } else {
            BatchStatus::Completed
        };
        return settled(status, 0);
    }
    if window_over {
        return settled(BatchStatus::Expired, unpublished + pending);
    }
    settled(BatchStatus::InProgress, 0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn windows() {
        assert_eq!(parse_window("30m"), Ok(1_800_000));
        assert_eq!(parse_window("2h"), Ok(7_200_000));
        assert_eq!(parse_window("24h"), Ok(86_400_000));
        assert_eq!(parse_window("7d"), Ok(604_800_000));
        assert_eq!(parse_window("45s"), Ok(45_000));
        for bad in [
            "",
            "h",
            "0h",
            "-1h",
            "+1h",
            "1.5h",
            "24",
            "1w",
            "1 h",
            "366d",
            "99999999999999999d",
        ] {
            assert!(parse_window(bad).is_err(), "{bad}");
        }
    }

    fn facts() -> BatchFacts {
        BatchFacts {
            total: 3,
            created_at_ms: 0,
            expires_at_ms: 60_000,
            ..Default::default()
        }
    }

    #[test]
    fn statuses() {
        let f = facts();
        assert_eq!(view(&f, 0).status, BatchStatus::InProgress);
        let done = BatchFacts {
            cursor: 3,
            malformed: 1,
            completed: 2,
            ..f
        };
        let v = view(&done, 1);
        assert_eq!(v.status, BatchStatus::Completed);
        assert_eq!((v.completed, v.failed), (2, 1));
        // Published, no outcome, window over: expired, and the line counts as failed.
        let late = BatchFacts {
            cursor: 3,
            completed: 2,
            ..f
        };
        assert_eq!(view(&late, 60_000).status, BatchStatus::InProgress);
        let v = view(&late, 60_000 + OUTCOME_GRACE_MS);
        assert_eq!(
            (v.status, v.failed, v.never_ran),
            (BatchStatus::Expired, 1, 1)
        );
        let all_bad = BatchFacts {
            cursor: 3,
            malformed: 3,
            ..f
        };
        assert_eq!(view(&all_bad, 1).status, BatchStatus::Failed);
        let cancelling = BatchFacts {
            cursor: 2,
            completed: 1,
            cancelled_at_ms: Some(10),
            ..f
        };
        assert_eq!(view(&cancelling, 11).status, BatchStatus::Cancelling);
        let cancelled = BatchFacts {
            cancelled: 1,
            cancel_done: true,
            ..cancelling
        };
        let v = view(&cancelled, 12);
        assert_eq!(
            (v.status, v.completed, v.failed),
            (BatchStatus::Cancelled, 1, 2)
        );
    }

    proptest! {
        /// Whatever the facts, the counts add up: a settled batch accounts for every line
        /// once, and nothing counts more lines than the file holds.
        #[test]
        fn counts_add_up(total in 0i64..50, cursor_frac in 0.0f64..=1.0, parts in proptest::collection::vec(0u8..5, 0..50),
                         now in 0i64..200_000, cancelled in proptest::option::of(0i64..100_000), cancel_done: bool) {
            let cursor = ((total as f64) * cursor_frac) as i64;
            let mut f = BatchFacts { total, cursor, expires_at_ms: 60_000, cancelled_at_ms: cancelled, cancel_done, ..Default::default() };
            for p in parts.iter().take(cursor as usize) {
                match p { 0 => f.malformed += 1, 1 => f.completed += 1, 2 => f.expired += 1, 3 => f.cancelled += 1, _ => f.failed += 1 }
            }
            let v = view(&f, now);
            prop_assert!(v.completed + v.failed <= v.total);
            if v.status.is_terminal() {
                prop_assert_eq!(v.completed + v.failed, v.total);
            }
        }
    }
}
