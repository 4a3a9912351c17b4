//! Shedding at the door: refuse, before publishing, a job that would expire in the queue.
//!
//! `POST /v1/jobs` and `lastcall submit` estimate how long a new job would wait in the work
//! queue — the messages ready in the broker divided by the queue's recent ack rate, both
//! from RabbitMQ's management API — and refuse the job (`429 would_expire_in_queue`, or
//! exit 75 for the CLI) when that wait plus its minimum runtime exceeds the budget it has
//! left. The caller learns at once instead of at the deadline, and the job costs the
//! broker and the workers nothing. Shed jobs are never published and never recorded.
//!
//! # The call time at the door
//!
//! `ready / ack_rate` is the time until the jobs ahead of this one have left the queue —
//! the moment a worker takes it. It still needs its own call after that. The worker learns
//! the call time per kind (`lastcall_core::service_time`, p99) and records, with every
//! outcome, the minimum runtime it held the job to (`min_runtime_ms`: the job's own, else
//! the learned call time, else the worker's floor). The door reads it back from the ledger:
//! the newest `completed` job of the same kind in the last 10 minutes
//! ([`LEARNED_WINDOW_MS`]; cached per kind for [`Shedder::FRESH_FOR`]), so a job is shed
//! when `queue wait + that call time` exceeds its budget, with no hint from the user. A
//! job's own `min_runtime_ms` wins; without a ledger or a recent completion the call time
//! is 0 and the estimate is a lower bound (shedding errs towards admitting; the worker
//! still refuses at receipt or at the last admission check what cannot finish, before any
//! model call). Without the call time, a queue under heavy overload filled to the full
//! budget: every job reached a worker with less budget left than its call needs and was
//! refused there, after its broker and ledger costs.
//!
//! # When it does not shed
//!
//! It never sheds on a guess. It admits when:
//! - nothing is ready (`ready == 0`): nothing waits ahead of the job;
//! - there is no recent ack rate (no consumer, the queue idle, the first calls still
//!   running, or statistics not sampled yet — RabbitMQ samples every
//!   `collect_statistics_interval`, 5 s by default). This includes a backlog with **no
//!   consumer at all**: workers may be starting or scaling from zero, and a user may submit
//!   before starting one; if none comes, the broker TTL (the remaining budget) expires the
//!   job in the queue and the dead-letter processor records `expired_before_receive`, still
//!   without any model time spent;
//! - the management API does not answer (down, plugin disabled, wrong credentials, queue
//!   missing): fail open, logged once per outage (and once when it answers again);
//! - it is turned off (`--no-shed`; `serve --no-management` also turns it off).
//!
//! The ack rate is a sample of the last few seconds: at the start of a burst after an
//! idle period it still reflects the idle arrivals and overstates the wait; a queue whose
//! jobs are refused at receipt (acked without a call) acks faster than it computes and
//! understates it. Only `ready` counts: jobs already delivered to a worker (unacked) are
//! ahead too, which again errs towards admitting.
//!
//! The reading is cached ([`Shedder::FRESH_FOR`], 1 s; a failure for
//! [`Shedder::RETRY_FAILED_AFTER`]) and fetched by one request at a time, so a burst of
//! requests costs the management API one query per second at most.

use lastcall_broker::management::{Management, QueueStats};
use lastcall_store::Ledger;
use std::collections::HashMap;
use std::time::Duration;
use tokio::time::Instant;

/// How far back the door looks for a kind's call time in the ledger (as the worker's own
/// learning window).
pub const LEARNED_WINDOW_MS: i64 = 10 * 60 * 1_000;

/// At most this many kinds' call times are cached (kinds come from producers: bounded).
const MAX_CACHED_KINDS: usize = 256;

/// Longest `Retry-After` ever suggested: the rate is a sample of a few seconds, not a
/// forecast.
pub const MAX_RETRY_AFTER_S: u64 = 3_600;

/// Why a job was shed: the numbers behind the estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShedEstimate {
    /// `ready / ack_rate`, in ms (rounded up).
    pub queue_wait_ms: u64,
    /// Messages ready in the work queue.
    pub ready: u64,
    /// The queue's recent acks per second.
    pub ack_rate_per_s: f64,
    /// The call time set aside after the queue wait: the job's own minimum runtime, else
    /// the one the workers recently held its kind to (0 when neither is known).
    pub min_runtime_ms: u64,
    /// The budget the job had left when it was estimated.
    pub remaining_ms: i64,
    /// Seconds until the queue, draining at this rate, would leave room for the same
    /// budget (at least 1, at most [`MAX_RETRY_AFTER_S`]).
    pub retry_after_s: u64,
}

impl ShedEstimate {
    /// The estimated time until the job could finish: queue wait plus minimum runtime.
    pub fn needed_ms(&self) -> u64 {
        self.queue_wait_ms.saturating_add(self.min_runtime_ms)
    }
}

impl std::fmt::Display for ShedEstimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "would expire in the queue: estimated queue wait {} ms ({} ready at {:.2} acks/s)",
            self.queue_wait_ms, self.ready, self.ack_rate_per_s
        )?;
        if self.min_runtime_ms > 0 {
            write!(f, " + call time {} ms", self.min_runtime_ms)?;
        }
        write!(
            f,
            " exceeds the {} ms budget left; nothing was published. Retry after {} s, or give the job a longer deadline",
            self.remaining_ms, self.retry_after_s
        )
    }
}

/// Why a job was admitted.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Admit {
    /// Nothing ready in the queue.
    EmptyQueue,
    /// No recent ack rate to divide by: no estimate, no shedding.
    NoAckRate,
    /// The estimate fits the budget.
    Fits { needed_ms: u64, remaining_ms: i64 },
    /// No reading (turned off, or the management API did not answer): fail open.
    NoReading,
}

/// The decision for one job.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Verdict {
    Admit(Admit),
    Shed(ShedEstimate),
}

impl Verdict {
    pub fn is_shed(&self) -> bool {
        matches!(self, Verdict::Shed(_))
    }
}

/// Shed or admit a job whose deadline is `expires_at_ms`, at `now_ms`, given `ready`
/// messages in the work queue and its recent `ack_rate_per_s`. Pure (see the module doc for
/// the reasoning).
///
/// The job fits when `ready · 1000 / ack_rate + min_runtime_ms ≤ expires_at_ms − now_ms`.
/// When it does not, `retry_after_s` is the time the queue needs, at this rate and with
/// nothing new arriving, to drain to the largest backlog that would fit the same budget.
pub fn decide(
    ready: u64,
    ack_rate_per_s: Option<f64>,
    expires_at_ms: i64,
    min_runtime_ms: Option<u64>,
    now_ms: i64,
) -> Verdict {
    if ready == 0 {
        return Verdict::Admit(Admit::EmptyQueue);
    }
    let rate = match ack_rate_per_s {
        Some(r) if r.is_finite() && r > 0.0 => r,
        _ => return Verdict::Admit(Admit::NoAckRate),
    };
    let min_runtime_ms = min_runtime_ms.unwrap_or(0);
    let remaining_ms = expires_at_ms.saturating_sub(now_ms);
    // Budget left for waiting in the queue once the minimum runtime is set aside.
    let wait_budget_ms =
        remaining_ms.saturating_sub(i64::try_from(min_runtime_ms).unwrap_or(i64::MAX));
    // `ready` fits when ready · 1000 ≤ wait_budget · rate (compared unrounded).
    let fits = |r: u64| r as f64 * 1000.0 <= wait_budget_ms as f64 * rate;
    // Float-to-int casts saturate: an absurdly low rate gives u64::MAX, not a wrap.
    let queue_wait_ms = (ready as f64 * 1000.0 / rate).ceil() as u64;
    if wait_budget_ms >= 0 && fits(ready) {
        return Verdict::Admit(Admit::Fits {
            needed_ms: queue_wait_ms.saturating_add(min_runtime_ms),
            remaining_ms,
        });
    }
    // The largest backlog that fits (0 if even an empty queue would not: then the job
    // waits for nothing but its minimum runtime, and `EmptyQueue` admits it).
    let mut fitting = if wait_budget_ms <= 0 {
        0
    } else {
        ((wait_budget_ms as f64 * rate / 1000.0).floor() as u64).min(ready)
    };
    // Correct the float rounding of the floor in either direction.
    while fitting > 0 && !fits(fitting) {
        fitting -= 1;
    }
    while fitting < ready && wait_budget_ms > 0 && fits(fitting + 1) {
        fitting += 1;
    }
    let to_drain = ready - fitting;
    let retry_after_s = (to_drain as f64 / rate).ceil();
    let retry_after_s = if retry_after_s.is_finite() {
        (retry_after_s as u64).clamp(1, MAX_RETRY_AFTER_S)
    } else {
        MAX_RETRY_AFTER_S
    };
    Verdict::Shed(ShedEstimate {
        queue_wait_ms,
        ready,
        ack_rate_per_s: rate,
        min_runtime_ms,
        remaining_ms,
        retry_after_s,
    })
}

#[derive(Debug, Default)]
struct Cache {
    read_at: Option<Instant>,
    /// `None` after a failed read (fail open until the next attempt).
    reading: Option<QueueStats>,
    /// An outage has been logged and not yet its end.
    failing: bool,
}

/// Reads the work queue's numbers from the management API (cached) and decides with
/// [`decide`]. Shared by all requests of a `serve` process.
#[derive(Debug)]
pub struct Shedder {
    management: Management,
    queue: String,
    cache: tokio::sync::Mutex<Cache>,
    /// Where the workers' recorded call times are read (none: only a job's own minimum
    /// runtime is set aside).
    ledger: Option<std::sync::Arc<Ledger>>,
    /// Per kind: when the call time was read from the ledger, and what it was.
    learned: tokio::sync::Mutex<HashMap<String, (Instant, Option<u64>)>>,
}

impl Shedder {
    /// How long a reading is reused. The broker itself refreshes its numbers only every
    /// `collect_statistics_interval` (5 s by default).
    pub const FRESH_FOR: Duration = Duration::from_secs(1);
    /// How long a failed read is remembered (all jobs admitted meanwhile) before the next
    /// attempt, so that an unreachable API does not slow every request.
    pub const RETRY_FAILED_AFTER: Duration = Duration::from_secs(5);
    /// Timeout of one management query.
    pub const TIMEOUT: Duration = Duration::from_secs(1);

    /// Estimate the wait in `queue` (the work queue) through `management`.
    pub fn new(management: Management, queue: impl Into<String>) -> Self {
        Self {
            management: management.with_timeout(Self::TIMEOUT),
            queue: queue.into(),
            cache: tokio::sync::Mutex::new(Cache::default()),
            ledger: None,
            learned: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Read each kind's call time from `ledger` (the one the workers record to), to set
    /// it aside after the queue wait for a job without its own minimum runtime.
    pub fn with_ledger(mut self, ledger: Option<std::sync::Arc<Ledger>>) -> Self {
        self.ledger = ledger;
        self
    }

    /// The call time the workers recently held `kind` to, from the ledger (module doc),
    /// cached for [`Self::FRESH_FOR`]; `None` without a ledger, when unknown, or when the
    /// ledger does not answer.
    pub async fn learned_call_ms(&self, kind: &str, now_ms: i64) -> Option<u64> {
        let ledger = self.ledger.as_ref()?;
        let mut cache = self.learned.lock().await;
        if let Some((at, v)) = cache.get(kind)
            && at.elapsed() < Self::FRESH_FOR
        {
            return *v;
        }
        let v = match ledger
            .recent_min_runtime_ms(kind, now_ms.saturating_sub(LEARNED_WINDOW_MS))
            .await
        {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "the door could not read the learned call time; none used");
                None
            }
        };
        if cache.len() >= MAX_CACHED_KINDS && !cache.contains_key(kind) {
            cache.clear();
        }
        cache.insert(kind.to_owned(), (Instant::now(), v));
        v
    }

    /// The work queue's numbers, at most [`Self::FRESH_FOR`] old; `None` when the
    /// management API did not answer (fail open). One request at a time refreshes them;
    /// the others wait for that reading instead of querying too.
    pub async fn reading(&self) -> Option<QueueStats> {
        let mut c = self.cache.lock().await;
        let keep = if c.reading.is_some() {
            Self::FRESH_FOR
        } else {
            Self::RETRY_FAILED_AFTER
        };
        if c.read_at.is_some_and(|t| t.elapsed() < keep) {
            return c.reading;
        }
        let result = self.management.queue_stats(&self.queue).await;
        c.read_at = Some(Instant::now());
        c.reading = match result {
            Ok(Some(stats)) => {
                if std::mem::take(&mut c.failing) {
                    tracing::info!(queue = %self.queue, "the management API answers again: shedding at the door resumes");
                }
                Some(stats)
            }
            Ok(None) | Err(_) => {
                if !std::mem::replace(&mut c.failing, true) {
                    let why = match result {
                        Err(e) => e.to_string(),
                        _ => format!("the queue {} does not exist", self.queue),
                    };
                    tracing::warn!(queue = %self.queue, error = %why, "cannot estimate the queue wait: admitting every job (fail open) until the management API answers");
                }
                None
            }
        };
        c.reading
    }

    /// The verdict for a job of `kind` with this deadline and minimum runtime at `now_ms`.
    /// Without its own minimum runtime, the call time the workers recently held its kind to
    /// is read from the ledger ([`Self::with_ledger`]) and set aside after the queue wait.
    pub async fn check(
        &self,
        kind: &str,
        expires_at_ms: i64,
        min_runtime_ms: Option<u64>,
        now_ms: i64,
    ) -> Verdict {
        let Some(q) = self.reading().await else {
            return Verdict::Admit(Admit::NoReading);
        };
        let call_ms = match min_runtime_ms {
            Some(own) => Some(own),
            None if q.ready > 0 => self.learned_call_ms(kind, now_ms).await,
            None => None,
        };
        decide(q.ready, q.ack_rate_per_s, expires_at_ms, call_ms, now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: i64 = 1_700_000_000_000;

    fn shed(v: Verdict) -> ShedEstimate {
        match v {
            Verdict::Shed(e) => e,
            other => panic!("expected a shed, got {other:?}"),
        }
    }

    #[test]
    fn worked_example() {
        // 100 ready at 10 acks/s: 10 s of queue. A 5 s budget is shed; after 5 s of
        // draining (50 left, 5 s of queue) the same budget fits.
        let e = shed(decide(100, Some(10.0), NOW + 5_000, None, NOW));
        assert_eq!(
            (e.queue_wait_ms, e.ready, e.remaining_ms, e.retry_after_s),
            (10_000, 100, 5_000, 5)
        );
        assert!(!decide(50, Some(10.0), NOW + 5_000, None, NOW).is_shed());
        let msg = e.to_string();
        for part in ["10000 ms", "100 ready", "10.00 acks/s", "5000 ms", "5 s"] {
            assert!(msg.contains(part), "{msg} names {part}");
        }
        // The call time (the job's own minimum runtime, or its kind's learned one) counts.
        let e = shed(decide(40, Some(10.0), NOW + 5_000, Some(2_000), NOW));
        assert_eq!((e.needed_ms(), e.retry_after_s), (6_000, 1));
        assert!(e.to_string().contains("call time 2000 ms"));
        assert_eq!(
            decide(30, Some(10.0), NOW + 5_000, Some(2_000), NOW),
            Verdict::Admit(Admit::Fits {
                needed_ms: 5_000,
                remaining_ms: 5_000
            })
        );
    }

    #[test]
    fn no_estimate_no_shedding() {
        let far = NOW + 10;
        assert_eq!(
            decide(0, Some(0.01), far, Some(1_000_000), NOW),
            Verdict::Admit(Admit::EmptyQueue)
        );
        for rate in [
            None,
            Some(0.0),
            Some(-1.0),
            Some(f64::NAN),
            Some(f64::INFINITY),
        ] {
            assert_eq!(
                decide(1_000_000, rate, far, None, NOW),
                Verdict::Admit(Admit::NoAckRate),
                "{rate:?}"
            );
        }
    }

    #[test]
    fn extremes_saturate() {
        let e = shed(decide(u64::MAX, Some(1e-300), NOW + 1, Some(u64::MAX), NOW));
        assert_eq!(e.queue_wait_ms, u64::MAX);
        assert_eq!(e.needed_ms(), u64::MAX);
        assert_eq!(e.retry_after_s, MAX_RETRY_AFTER_S);
        let e = shed(decide(1, Some(1e300), i64::MIN, None, i64::MAX));
        assert_eq!(e.retry_after_s, 1);
    }

    /// A small deterministic generator (xorshift64*): property tests without a new
    /// dependency.
    struct Gen(u64);
    impl Gen {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
        }
        fn upto(&mut self, n: u64) -> u64 {
            self.next() % (n + 1)
        }
        fn rate(&mut self) -> f64 {
            // 0.01 … 1000 acks/s, log-uniform-ish.
            10f64.powf(self.upto(5_000) as f64 / 1_000.0 - 2.0)
        }
    }

    struct Case {
        ready: u64,
        rate: f64,
        budget: i64,
        min: Option<u64>,
    }

    fn cases(n: usize) -> impl Iterator<Item = Case> {
        let mut g = Gen(0x9e37_79b9_7f4a_7c15);
        (0..n).map(move |_| Case {
            ready: g.upto(100_000),
            rate: g.rate(),
            budget: g.upto(600_000) as i64 - 1_000,
            min: (g.upto(1) == 1).then(|| g.upto(30_000)),
        })
    }

    #[test]
    fn property_shed_exactly_when_the_estimate_exceeds_the_budget() {
        let (mut sheds, mut fits) = (0, 0);
        for c in cases(20_000) {
            let v = decide(c.ready, Some(c.rate), NOW + c.budget, c.min, NOW);
            let need = c.ready as f64 * 1000.0 / c.rate + c.min.unwrap_or(0) as f64;
            match v {
                Verdict::Shed(e) => {
                    assert!(need > c.budget as f64, "shed although it fits: {e:?}");
                    assert!(e.needed_ms() as i64 > c.budget, "{e:?}");
                    assert!((1..=MAX_RETRY_AFTER_S).contains(&e.retry_after_s));
                    assert_eq!((e.ready, e.remaining_ms), (c.ready, c.budget));
                    sheds += 1;
                }
                Verdict::Admit(Admit::Fits {
                    needed_ms,
                    remaining_ms,
                }) => {
                    assert!(need <= c.budget as f64 + 1e-6);
                    assert!(needed_ms as i64 <= remaining_ms + 1, "rounded up by < 1 ms");
                    fits += 1;
                }
                Verdict::Admit(Admit::EmptyQueue) => assert_eq!(c.ready, 0),
                other => panic!("{other:?}"),
            }
        }
        assert!(
            sheds > 1_000 && fits > 1_000,
            "both sides exercised: {sheds} / {fits}"
        );
    }

    #[test]
    fn property_monotone() {
        // More ready, a lower rate, less budget or a longer minimum runtime never turn a
        // shed into an admission.
        for c in cases(10_000) {
            if !decide(c.ready, Some(c.rate), NOW + c.budget, c.min, NOW).is_shed() {
                continue;
            }
            let min = c.min.unwrap_or(0);
            assert!(decide(c.ready + 1, Some(c.rate), NOW + c.budget, c.min, NOW).is_shed());
            assert!(decide(c.ready, Some(c.rate / 2.0), NOW + c.budget, c.min, NOW).is_shed());
            assert!(decide(c.ready, Some(c.rate), NOW + c.budget - 1, c.min, NOW).is_shed());
            assert!(decide(c.ready, Some(c.rate), NOW + c.budget, Some(min + 1), NOW).is_shed());
            // Time passing without draining only makes it worse.
            assert!(decide(c.ready, Some(c.rate), NOW + c.budget, c.min, NOW + 1).is_shed());
        }
    }

    #[test]
    fn property_retry_after_is_when_the_same_budget_fits() {
        // After `retry_after_s` of draining at the rate (whole messages, nothing new
        // arriving), a job with the same relative budget is admitted; one second earlier
        // it would still have been shed (unless capped or already at the 1 s minimum).
        let mut checked = 0;
        for c in cases(20_000) {
            let Verdict::Shed(e) = decide(c.ready, Some(c.rate), NOW + c.budget, c.min, NOW) else {
                continue;
            };
            if e.retry_after_s == MAX_RETRY_AFTER_S {
                continue;
            }
            checked += 1;
            let left = |t: u64| c.ready.saturating_sub((c.rate * t as f64).floor() as u64);
            let later = NOW + e.retry_after_s as i64 * 1000;
            assert!(
                !decide(
                    left(e.retry_after_s),
                    Some(c.rate),
                    later + c.budget,
                    c.min,
                    later
                )
                .is_shed(),
                "still shed after {e:?}"
            );
            if e.retry_after_s > 1 {
                let t = e.retry_after_s - 1;
                let earlier = NOW + t as i64 * 1000;
                assert!(
                    decide(left(t), Some(c.rate), earlier + c.budget, c.min, earlier).is_shed(),
                    "Retry-After {e:?} is later than needed"
                );
            }
        }
        assert!(checked > 1_000, "{checked}");
    }
}
