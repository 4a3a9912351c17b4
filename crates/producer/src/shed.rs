//! Shedding at the door: refuse, before publishing, a job that would expire in the queue.
//!
//! `POST /v1/jobs` and `lastcall submit` estimate how long a new job would wait in the work
//! queue — the messages ready in the broker that can still finish, divided by the rate
//! the queue drains at (live counts and RabbitMQ's management API, below) — and refuse the job (`429 would_expire_in_queue`, or
//! exit 75 for the CLI) when that wait plus its minimum runtime exceeds the budget it has
//! left. The caller learns at once instead of at the deadline, and the job costs the
//! broker and the workers nothing. Shed jobs are never published and never recorded.
//!
//! # The call time at the door
//!
//! `ready / ack_rate` is the time until the jobs ahead of this one have left the queue —
//! the moment a worker takes it. It still needs its own call after that. The worker
//! records, with every outcome, how long its model call took (`latency_ms`, measured).
//! The door reads it back from the ledger: the longest of the newest [`LONGEST_OF`] (20)
//! `completed` calls of the same kind in the last 10 minutes
//! (`Ledger::recent_completed_calls_of_kind`;
//! [`LEARNED_WINDOW_MS`]; cached per kind for [`Shedder::FRESH_FOR`]), so a job is shed
//! when `queue wait + that call time` exceeds its budget, with no hint from the user. Only
//! measured calls count, never a job's recorded `min_runtime_ms`: that may be a client's
//! own number, and one client must not set the call time the door sheds everyone's jobs
//! of the kind by. A
//! job's own `min_runtime_ms` wins; without a ledger or a recent completion the call time
//! is 0 and the estimate is a lower bound (shedding errs towards admitting; the worker
//! still refuses at receipt or at the last admission check what cannot finish, before any
//! model call). Without the call time, a queue under heavy overload filled to the full
//! budget: every job reached a worker with less budget left than its call needs and was
//! refused there, after its broker and ledger costs.
//!
//! # Each request's own call time
//!
//! A kind that mixes short and long prompts has no single call time: the longest of its
//! recent calls is a long prompt's, and a short job behind a modest queue would be shed by
//! it. So the door reads the kind's newest completed calls (at most [`LEARNED_CALLS`],
//! one query for both) with the request sizes the workers recorded, and also fits them with the workers' own estimator (`lastcall_core::service_time`, replayed
//! as a starting worker replays the ledger). When its request-aware fit holds (8 completed
//! calls of known size), a chat job (`prompt` or `messages`) is held to its own predicted
//! p99 ([`RequestSize::of_payload`]: the approximation the workers record; the prompt
//! tokens the calls used, as their server or the local model's tokenizer counted them,
//! refine it as in the workers' estimator); otherwise, and for other payloads, to the
//! longest recent call as above.
//!
//! # The live count (`serve`, `submit`, `bench goodput`)
//!
//! The management API's numbers are sampled every `collect_statistics_interval` (5 s by
//! default): longer than a typical budget. Measured under overload, a door that read only
//! them swung between shedding everything (an old, deep count) and admitting everything
//! (an old, shallow one), and the workers idled behind it. So with a
//! live source ([`Shedder::with_live_depth`]) the door:
//! - counts the ready messages live, with a passive `queue.declare` on its publisher's
//!   connection, at most every [`Shedder::LIVE_FRESH_FOR`], adding the jobs it admitted
//!   since;
//! - remembers the jobs it admitted (deadline, call time + clock margin; bounded) and, the
//!   queue being FIFO, takes the newest `ready` of them as the ones in the queue. Messages
//!   beyond what it remembers (another producer's, or from before this process) count as
//!   able to finish;
//! - measures the workers' pace from successive counts: the jobs that left the queue
//!   (`before + admitted − now`, the oldest ones) and could still finish then, per second,
//!   over the intervals of the last [`Shedder::RATE_WINDOW`] in which the queue never ran
//!   empty. Doomed jobs leave faster (refused without a call) and an idle queue's pace is
//!   the arrivals', so neither counts;
//! - **walks the queue as a worker will**: from the head, each job that can still start
//!   when reached takes 1/pace of the workers' time; one that cannot is refused at once
//!   and is no wait. The wait counts only the jobs reached in time.
//!
//! Until it has measured a pace, the management API's ack rate stands in (and the walk
//! counts every job that can start now).
//!
//! Without a live source, or when the broker does not answer the count, the management
//! API's `ready` and ack rate are used as they are. A job whose publish fails after the
//! door admitted it is still remembered; it only makes a count of the door's own jobs
//! one higher than the truth. With several producers the "newest `ready`" are not all
//! this door's; the walk is then an approximation (every unknown message counts).
//! The jobs in the workers' buffers (delivered, unacked) are not counted, and a job that
//! leaves the queue able to finish may become doomed in a buffer and still count in the
//! pace: both err towards admitting. Since the workers' default window is large (tenant
//! isolation: `lastcall_worker::default_prefetch`), an overload's backlog sits
//! in their buffers and its surplus is refused at receipt, by the job's tenant's share;
//! the door, which cannot see whose jobs are buffered, then sheds little (counting the
//! buffered jobs would shed a light tenant's job behind another tenant's flood).
//!
//! # Tiers and lanes
//!
//! The workers serve strict tiers (`critical` > `standard` > `batch`; `core::schedule`),
//! and the jobs of named tenants, `critical` and `batch` wait in lane queues
//! ([`lastcall_core::lane_of`]). [`decide_tiered`] applies the estimate by tier:
//! - **any tier**: a job whose call time plus the clock margin exceeds the budget it has
//!   left cannot finish even if a worker started it now: shed (`ready` and `queue_wait_ms`
//!   0 in the estimate, [`ShedEstimate::cannot_finish`]);
//! - **`critical`**: nothing else. The worker serves it before every other job, so no
//!   backlog of other tiers delays its start (it is not even read);
//! - **`standard`**: the wait in its own queue — the work queue as above for the `default`
//!   tenant; its lane's backlog for a named tenant;
//! - **`batch`**, shed first: its lane's wait *plus* the work queue's (every job there is
//!   `standard` and is served before it). Under strict tiers `batch` can starve
//!   completely: while the work queue's backlog alone outlasts a `batch` budget, every
//!   `batch` job is shed, however long that lasts.
//!
//! A lane is read from the management API only ([`Shedder::with_lane_queues`]: ready ÷ ack
//! rate, cached per lane like the work queue's reading): the door remembers no lane job and
//! does not walk the lanes, so a lane's doomed jobs count as a wait there (erring towards
//! shedding), and a lane shared by several tenants (hashed alike) counts all of them,
//! although the fair share may serve this tenant sooner. Not counted for a `batch` job:
//! the `critical` jobs and the named tenants' `standard` jobs in other lanes that it also
//! waits behind (erring towards admitting; the worker still refuses it at receipt).
//!
//! # A model server that is down
//!
//! Each worker records in the ledger when its circuit breaker for a model server opens
//! (per kind it sent there, with its next trial time) and when it closes. While every live
//! worker (a lease renewed in the last [`WORKER_LIVE_MS`]) has the kind's breaker open,
//! [`Shedder::upstream_open_until`] says until when, and the submitter refuses the job
//! (`503 upstream_unavailable`, `Retry-After` the seconds to that trial) before the
//! estimate. A record past its trial time, or of a worker whose lease went stale, counts
//! as closed.
//!
//! # When it does not shed
//!
//! It never sheds on a guess. Unless the job cannot finish even if started now, it admits
//! when:
//! - nothing counted is ready: nothing that can still finish waits ahead of the job;
//! - there is no rate (no consumer, the queue idle, the first calls still
//!   running, or statistics not sampled yet). This includes a backlog with **no
//!   consumer at all**: workers may be starting or scaling from zero, and a user may submit
//!   before starting one; if none comes, the broker TTL (the remaining budget) expires the
//!   job in the queue and the dead-letter processor records `expired_before_receive`, still
//!   without any model time spent;
//! - neither the broker's count nor the management API answers (down, plugin disabled,
//!   wrong credentials, queue missing): fail open, logged once per outage (and once when
//!   it answers again);
//! - it is turned off (`--no-shed`; `serve --no-management` also turns it off).
//!
//! The management reading is cached ([`Shedder::FRESH_FOR`], 1 s; a failure for
//! [`Shedder::RETRY_FAILED_AFTER`]) and the live count for [`Shedder::LIVE_FRESH_FOR`]
//! (a failed one also for [`Shedder::RETRY_FAILED_AFTER`]);
//! each is fetched by one request at a time, so a burst of requests costs the management
//! API one query per second and the broker five passive declares per second at most.

use lastcall_broker::management::{Management, QueueStats};
use lastcall_broker::publish::Publisher;
use lastcall_core::Priority;
use lastcall_core::request_size::RequestSize;
use lastcall_core::schedule::{QueuedJob, walk_fifo};
use lastcall_core::service_time::{EstimateSource, Predictor, ServiceTimeConfig, ServiceTimes};
use lastcall_store::Ledger;
use std::collections::{HashMap, VecDeque};
use std::time::Duration;
use tokio::time::Instant;

/// How far back the door looks for a kind's call time in the ledger (as the worker's own
/// learning window).
pub const LEARNED_WINDOW_MS: i64 = 10 * 60 * 1_000;

/// A worker whose lease (`Ledger::heartbeat`) is older than this is dead for the door:
/// its open breakers no longer count. The worker's own lease TTL, one rule
/// ([`lastcall_core::lease`]).
pub const WORKER_LIVE_MS: i64 = lastcall_core::lease::LEASE_TTL_MS;

/// At most this many kinds' call times are cached (kinds come from producers: bounded).
const MAX_CACHED_KINDS: usize = 256;

/// How many of a kind's newest completed calls the door fits its request-aware call time
/// to: the workers' estimator window.
pub const LEARNED_CALLS: u32 = 128;

/// The door's call time for a job without a size, or before the fit holds: the longest of
/// the kind's newest this many completed calls.
pub const LONGEST_OF: usize = 20;

/// What the door knows of a kind's call time: the longest of its newest completed calls,
/// and the request-aware fit of its recent ones when that holds.
#[derive(Debug, Clone, Copy, Default)]
struct Learned {
    longest: Option<u64>,
    sized: Option<Predictor>,
}

impl Learned {
    /// From the kind's newest completed calls, oldest first: the longest of the newest
    /// [`LONGEST_OF`], and their fit.
    fn of(calls: &[lastcall_store::RecordedCall], now_ms: i64) -> Self {
        let longest = (calls.iter().rev().take(LONGEST_OF))
            .map(|c| c.latency_ms)
            .max();
        Self {
            longest,
            sized: longest.and_then(|_| Self::fit(calls, now_ms)),
        }
    }

    /// The workers' request-aware estimate over `calls` (the same estimator, fed the same
    /// way as a starting worker replays the ledger), when its fit holds.
    fn fit(calls: &[lastcall_store::RecordedCall], now_ms: i64) -> Option<Predictor> {
        let mut times = ServiceTimes::new(ServiceTimeConfig::default());
        for c in calls {
            // The recorded approximation is the door's measure too (it has no tokenizer);
            // the call's count, where recorded, refines it.
            let (size, used) = c.replayed(false);
            times.observe_counted("k", c.latency_ms, false, size, used, c.recorded_at_ms);
        }
        let p = times.predictor("k", now_ms);
        (p.is_request_aware() && p.base_source() == Some(EstimateSource::Key)).then_some(p)
    }

    /// A job of `size`'s call time: its own high quantile when the fit holds and the size
    /// is known, else the longest recent call.
    fn call_ms(&self, size: Option<RequestSize>) -> Option<u64> {
        match (self.sized, size) {
            (Some(p), Some(size)) => p.estimate(Some(size)).map(|e| e.quantile_ms),
            _ => self.longest,
        }
    }
}

/// Longest `Retry-After` ever suggested: the rate is a sample of a few seconds, not a
/// forecast.
pub const MAX_RETRY_AFTER_S: u64 = 3_600;

/// Why a job was shed: the numbers behind the estimate.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ShedEstimate {
    /// `ready / ack_rate`, in ms (rounded up).
    pub queue_wait_ms: u64,
    /// Messages ready in the work queue that can still finish: the wait counts these.
    pub ready: u64,
    /// Messages ready in the work queue that can no longer finish (not counted: the
    /// worker refuses them without a call). Known only with the live count.
    pub doomed: u64,
    /// Messages leaving the queue per second, recently.
    pub ack_rate_per_s: f64,
    /// The call time set aside after the queue wait: the job's own minimum runtime, else
    /// the one the workers recently held its kind to (0 when neither is known).
    pub min_runtime_ms: u64,
    /// The budget the job had left when it was estimated.
    pub remaining_ms: i64,
    /// Seconds until the queue, draining at this rate, would leave room for the same
    /// budget (at least 1, at most [`MAX_RETRY_AFTER_S`]).
    pub retry_after_s: u64,
    /// The smallest budget the same decision admits at the same instant, with the same
    /// readings: queue wait + call time + clock margin, rounded up to a multiple of
    /// [`BUDGET_STEP_MS`]. What a client can resend with now instead of guessing.
    pub min_feasible_budget_ms: u64,
}

/// [`ShedEstimate::min_feasible_budget_ms`] is rounded up to a multiple of this: a number
/// a client can read, and a little room for the jobs the door admits meanwhile.
pub const BUDGET_STEP_MS: u64 = 100;

/// `ms` rounded up to a multiple of [`BUDGET_STEP_MS`] (saturating).
fn round_up_budget(ms: u64) -> u64 {
    ms.div_ceil(BUDGET_STEP_MS).saturating_mul(BUDGET_STEP_MS)
}

impl ShedEstimate {
    /// The estimated time until the job could finish: queue wait plus minimum runtime.
    pub fn needed_ms(&self) -> u64 {
        self.queue_wait_ms.saturating_add(self.min_runtime_ms)
    }
}

impl ShedEstimate {
    /// Shed with nothing ahead: the call time alone exceeds the budget left, so the job
    /// cannot finish even if a worker started it now ([`decide_tiered`]).
    pub fn cannot_finish(&self) -> bool {
        self.ready == 0 && self.queue_wait_ms == 0
    }
}

impl std::fmt::Display for ShedEstimate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.cannot_finish() {
            return write!(
                f,
                "cannot finish even if started now: its call time {} ms (the clock margin included) exceeds the {} ms budget left; nothing was published. A budget of at least {} ms would be admitted now",
                self.min_runtime_ms, self.remaining_ms, self.min_feasible_budget_ms
            );
        }
        write!(
            f,
            "would expire in the queue: estimated queue wait {} ms ({} ready at {:.2}/s",
            self.queue_wait_ms, self.ready, self.ack_rate_per_s
        )?;
        if self.doomed > 0 {
            write!(f, "; {} more that cannot finish not counted", self.doomed)?;
        }
        write!(f, ")")?;
        if self.min_runtime_ms > 0 {
            write!(f, " + call time {} ms", self.min_runtime_ms)?;
        }
        write!(
            f,
            " exceeds the {} ms budget left; nothing was published. Retry after {} s, or with a budget of at least {} ms (admitted now)",
            self.remaining_ms, self.retry_after_s, self.min_feasible_budget_ms
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
    // The smallest budget `ready` fits: the unrounded wait, corrected for float rounding as
    // above, plus the call time.
    // (A few steps at most: past 2^53 ms, far beyond any budget, consecutive waits are
    // the same float.)
    let wait_fits = |w: u64| ready as f64 * 1000.0 <= w as f64 * rate;
    let mut wait_ms = queue_wait_ms;
    for _ in 0..16 {
        if wait_ms == 0 || !wait_fits(wait_ms - 1) {
            break;
        }
        wait_ms -= 1;
    }
    for _ in 0..16 {
        if wait_fits(wait_ms) {
            break;
        }
        wait_ms = wait_ms.saturating_add(1);
    }
    let min_feasible_budget_ms = round_up_budget(wait_ms.saturating_add(min_runtime_ms));
    let retry_after_s = (to_drain as f64 / rate).ceil();
    let retry_after_s = if retry_after_s.is_finite() {
        (retry_after_s as u64).clamp(1, MAX_RETRY_AFTER_S)
    } else {
        MAX_RETRY_AFTER_S
    };
    Verdict::Shed(ShedEstimate {
        queue_wait_ms,
        ready,
        doomed: 0,
        ack_rate_per_s: rate,
        min_runtime_ms,
        remaining_ms,
        retry_after_s,
        min_feasible_budget_ms,
    })
}

/// Where a job waits, as the door sees it: its tier and the broker queue it is published
/// to ([`lastcall_core::lane_of`]; lane 0 is the work queue).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Place {
    pub priority: Priority,
    pub lane: u8,
}

/// The door's decision with the tiers (module doc, "Tiers and lanes"). Pure.
///
/// - Every tier: a job whose call time (`call_ms`, with the clock margin) exceeds the
///   budget it has left cannot finish even if a worker started it now: shed.
/// - `critical`: never shed because of a backlog — the worker serves it before every
///   other tier, whatever waits ahead of it in the broker.
/// - `standard`: shed when the wait in its own queue (`own`: the work queue's walk for
///   lane 0, the lane's backlog for a named tenant's lane) plus the call time exceeds the
///   budget: [`decide`].
/// - `batch`: as `standard`, with the work queue's backlog (`work`: `default` tenant,
///   `standard` tier, every job of it served first under strict tiers) added to its own
///   lane's: the higher tier's backlog that keeps it from starting.
///
/// A backlog without a pace is no wait (never shed on a guess); `None`: no reading.
pub fn decide_tiered(
    place: Place,
    own: Option<Ahead>,
    work: Option<Ahead>,
    expires_at_ms: i64,
    call_ms: Option<u64>,
    now_ms: i64,
) -> Verdict {
    let remaining_ms = expires_at_ms.saturating_sub(now_ms);
    let call = call_ms.unwrap_or(0);
    let call_i64 = i64::try_from(call).unwrap_or(i64::MAX);
    if call_i64 > remaining_ms {
        // The smallest budget admitted: the call time, or more if the queue ahead does not
        // fit beside it.
        let at_call = queue_verdict(
            place,
            own,
            work,
            now_ms.saturating_add(call_i64),
            call_ms,
            now_ms,
        );
        let min_feasible_budget_ms = match at_call {
            Verdict::Shed(e) => e.min_feasible_budget_ms,
            Verdict::Admit(_) => round_up_budget(call),
        };
        return Verdict::Shed(ShedEstimate {
            queue_wait_ms: 0,
            ready: 0,
            doomed: 0,
            ack_rate_per_s: 0.0,
            min_runtime_ms: call,
            remaining_ms,
            retry_after_s: 1,
            min_feasible_budget_ms,
        });
    }
    queue_verdict(place, own, work, expires_at_ms, call_ms, now_ms)
}

/// [`decide_tiered`] for a job whose call time fits its budget: the wait ahead of it.
fn queue_verdict(
    place: Place,
    own: Option<Ahead>,
    work: Option<Ahead>,
    expires_at_ms: i64,
    call_ms: Option<u64>,
    now_ms: i64,
) -> Verdict {
    let remaining_ms = expires_at_ms.saturating_sub(now_ms);
    let call = call_ms.unwrap_or(0);
    let segments: Vec<Ahead> = match place.priority {
        Priority::Critical => {
            return Verdict::Admit(Admit::Fits {
                needed_ms: call,
                remaining_ms,
            });
        }
        Priority::Standard => own.into_iter().collect(),
        // A batch job in the work queue does not exist (it always has a lane); were it
        // there, its queue is the higher tier's backlog already.
        Priority::Batch if place.lane == 0 => own.into_iter().collect(),
        Priority::Batch => own.into_iter().chain(work).collect(),
    };
    if segments.is_empty() {
        return Verdict::Admit(Admit::NoReading);
    }
    // The queues are drained one after the other (the higher tier first, then the lane):
    // their waits add up. Each is `counted / pace`; one without a pace adds nothing.
    let (mut ready, mut paced, mut doomed, mut wait_s) = (0u64, 0u64, 0u64, 0f64);
    for s in &segments {
        ready = ready.saturating_add(s.counted);
        doomed = doomed.saturating_add(s.doomed);
        if let Some(r) = s.rate_per_s.filter(|r| r.is_finite() && *r > 0.0)
            && s.counted > 0
        {
            wait_s += s.counted as f64 / r;
            paced = paced.saturating_add(s.counted);
        }
    }
    if ready == 0 {
        return Verdict::Admit(Admit::EmptyQueue);
    }
    if paced == 0 {
        return Verdict::Admit(Admit::NoAckRate);
    }
    // One queue with a pace: exactly `decide`. Several: `decide` at the pace that drains
    // the paced ones in their summed wait.
    let rate = match segments.as_slice() {
        [one] => one.rate_per_s,
        _ => Some(paced as f64 / wait_s),
    };
    match decide(paced, rate, expires_at_ms, call_ms, now_ms) {
        Verdict::Shed(e) => Verdict::Shed(ShedEstimate { doomed, ..e }),
        admit => admit,
    }
}

#[derive(Debug, Default)]
struct Cache {
    read_at: Option<Instant>,
    /// `None` after a failed read (fail open until the next attempt).
    reading: Option<QueueStats>,
    /// An outage has been logged and not yet its end.
    failing: bool,
}

/// One job this door admitted: what it needs to tell, later, whether it can still finish.
#[derive(Debug, Clone, Copy)]
struct Sent {
    expires_at_ms: i64,
    /// Its call time and the clock margin: it can start while this much budget is left.
    need_ms: u64,
}

impl Sent {
    /// As the core's queue walk sees it.
    fn queued(&self) -> QueuedJob {
        QueuedJob {
            latest_start_ms: self.expires_at_ms.saturating_sub_unsigned(self.need_ms),
        }
    }
}

/// The broker's live count of the work queue, as this door last read it, and what it
/// makes of the jobs in it.
#[derive(Debug, Clone, Copy)]
struct Live {
    at: Instant,
    /// Messages ready in the queue (passive `queue.declare`).
    ready: u64,
    /// Of those, the ones a worker will get to in time, at [`Door::rate_per_s`] (all of
    /// them when there is no rate yet).
    served: u64,
    /// The others: this door's own jobs that will have too little budget left by the
    /// time a worker gets to them. The worker refuses them at once; they cost no slot time.
    doomed: u64,
    /// The rate the counts were judged at.
    rate_per_s: Option<f64>,
    /// [`Door::sent_total`] when it was read.
    sent_total: u64,
}

/// The door's live view ([`Shedder::with_live_depth`]): the jobs it admitted, in order,
/// and its recent readings of the queue.
#[derive(Debug, Default)]
struct Door {
    /// The jobs this door admitted, oldest first (bounded: [`MAX_REMEMBERED`], and none
    /// kept [`FORGET_AFTER_MS`] past its deadline). `sent[i]` is job number
    /// `sent_total − sent.len() + i`.
    sent: VecDeque<Sent>,
    /// How many jobs this door ever admitted.
    sent_total: u64,
    last: Option<Live>,
    /// Per interval between two counts with a backlog at both ends (the workers kept
    /// busy): when it ended, how long it was, and how many jobs that could still finish
    /// left the queue in it. Only the last [`Shedder::RATE_WINDOW`].
    busy: VecDeque<(Instant, Duration, u64)>,
    /// When the last live read failed: `Some` from the first failure (logged) until the
    /// next good read (its recovery logged). The next read is tried only
    /// [`Shedder::RETRY_FAILED_AFTER`] after it, so that a broker that does not answer
    /// does not cost every request a read of up to [`Shedder::TIMEOUT`].
    failed_at: Option<Instant>,
}

/// At most this many admitted jobs are remembered (a queue deeper than that counts its
/// oldest messages as able to finish, which errs towards shedding).
const MAX_REMEMBERED: usize = 100_000;
/// How long after its deadline an admitted job is still remembered: until then, a message
/// of it still in the queue is known to be doomed.
const FORGET_AFTER_MS: i64 = 60_000;

impl Door {
    /// The pace at which the workers take jobs that can still finish: such jobs leaving
    /// the queue per second, over the intervals of the last [`Shedder::RATE_WINDOW`] in
    /// which the queue never ran empty (at least [`Shedder::RATE_MIN_SPAN`] of them).
    /// Doomed jobs leave faster (refused without a call) and are not counted, nor is an
    /// idle queue's pace, which is the arrivals'.
    fn rate_per_s(&self) -> Option<f64> {
        let span: Duration = self.busy.iter().map(|b| b.1).sum();
        let left: u64 = self.busy.iter().map(|b| b.2).sum();
        (span >= Shedder::RATE_MIN_SPAN && left > 0).then(|| left as f64 / span.as_secs_f64())
    }

    /// The remembered job number `seq`, if remembered.
    fn get(&self, seq: i64) -> Option<&Sent> {
        let first = self.sent_total as i64 - self.sent.len() as i64;
        usize::try_from(seq - first)
            .ok()
            .and_then(|i| self.sent.get(i))
    }

    /// Take a new live count of `ready` messages at `at` (`now_ms`): which jobs left the
    /// queue since the last count and how many of those could still finish (the pace),
    /// then which of the jobs now in it a worker will get to in time.
    fn observe(&mut self, ready: u64, at: Instant, now_ms: i64) {
        if let Some(last) = self.last {
            // The queue is FIFO and holds the newest `ready` jobs published: those that
            // left are the oldest of the last count's. Jobs this door does not remember
            // (another producer's, or from before this process) count as able to finish.
            let head = last.sent_total as i64 - last.ready as i64;
            let sent_between = self.sent_total - last.sent_total;
            let left = (last.ready + sent_between).saturating_sub(ready);
            let left = (head..head + left as i64).map(|seq| self.get(seq).map(Sent::queued));
            let useful = walk_fifo(left, 0.0, now_ms).served;
            if last.ready > 0 && ready > 0 {
                self.busy
                    .push_back((at, at.duration_since(last.at), useful));
            }
        }
        while self
            .busy
            .front()
            .is_some_and(|b| at.duration_since(b.0) > Shedder::RATE_WINDOW)
        {
            self.busy.pop_front();
        }
        while self.sent.front().is_some_and(|s| {
            self.sent.len() > MAX_REMEMBERED
                || s.expires_at_ms.saturating_add(FORGET_AFTER_MS) < now_ms
        }) {
            self.sent.pop_front();
        }
        // Walk the queue from its head as a worker will (`core::schedule::walk_fifo`):
        // each job that can still start when reached takes 1/rate of the workers' time;
        // one that cannot is refused at once. Without a rate, every job that can start now
        // counts. The messages before the first it remembers are unknown: able to finish.
        let rate = self.rate_per_s();
        let per_job_ms = rate.map_or(0.0, |r| 1000.0 / r);
        let head = self.sent_total as i64 - ready as i64;
        let first = self.sent_total as i64 - self.sent.len() as i64;
        let unknown = (first - head).clamp(0, ready as i64) as usize;
        let queue = std::iter::repeat_n(None, unknown).chain(
            (head.max(first)..self.sent_total as i64).map(|seq| self.get(seq).map(Sent::queued)),
        );
        let served = walk_fifo(queue, per_job_ms, now_ms).served;
        self.last = Some(Live {
            at,
            ready,
            served,
            doomed: ready - served,
            rate_per_s: rate,
            sent_total: self.sent_total,
        });
    }

    fn remember(&mut self, sent: Sent) {
        self.sent.push_back(sent);
        self.sent_total += 1;
    }
}

/// What the door counts for a decision: jobs ahead that can still finish, those that
/// cannot, and the rate the queue drains at.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Ahead {
    pub counted: u64,
    pub doomed: u64,
    pub rate_per_s: Option<f64>,
}

/// Reads the work queue's numbers (live from the broker, and from the management API;
/// cached) and decides with [`decide`]. Shared by all requests of a `serve` process.
#[derive(Debug)]
pub struct Shedder {
    management: Management,
    queue: String,
    cache: tokio::sync::Mutex<Cache>,
    /// Where the live count is read ([`Self::with_live_depth`]); none: the management
    /// API's sampled count only.
    live: Option<Publisher>,
    door: tokio::sync::Mutex<Door>,
    /// Where the workers' recorded call times are read (none: only a job's own minimum
    /// runtime is set aside).
    ledger: Option<std::sync::Arc<Ledger>>,
    /// Per kind: when the call time was read from the ledger, and what it was.
    learned: tokio::sync::Mutex<HashMap<String, (Instant, Learned)>>,
    /// The lanes' queues, by lane number (`lane_queues[0]` is the work queue);
    /// empty: a lane job's backlog is not read ([`Self::with_lane_queues`]).
    lane_queues: Vec<String>,
    /// Per lane: when its management reading was taken, and what it was (`None`: failed).
    lanes: tokio::sync::Mutex<HashMap<u8, (Instant, Option<QueueStats>)>>,
    /// The workers' open breakers, read from the ledger: per kind, when read and until
    /// when the kind's model server takes no call (`None`: not open).
    upstream: tokio::sync::Mutex<HashMap<String, (Instant, Option<i64>)>>,
}

impl Shedder {
    /// How long a management reading is reused. The broker itself refreshes those numbers
    /// only every `collect_statistics_interval` (5 s by default).
    pub const FRESH_FOR: Duration = Duration::from_secs(1);
    /// How long a live count is reused: a small fraction of a typical budget.
    pub const LIVE_FRESH_FOR: Duration = Duration::from_millis(200);
    /// The live counts of this long are the rate's window.
    pub const RATE_WINDOW: Duration = Duration::from_secs(3);
    /// The shortest span of live counts a rate is taken from.
    pub const RATE_MIN_SPAN: Duration = Duration::from_millis(500);
    /// How long a failed read is remembered (all jobs admitted meanwhile) before the next
    /// attempt, so that an unreachable API does not slow every request.
    pub const RETRY_FAILED_AFTER: Duration = Duration::from_secs(5);
    /// Timeout of one management query or live count.
    pub const TIMEOUT: Duration = Duration::from_secs(1);

    /// Estimate the wait in `queue` (the work queue) through `management`.
    pub fn new(management: Management, queue: impl Into<String>) -> Self {
        Self {
            management: management.with_timeout(Self::TIMEOUT),
            queue: queue.into(),
            cache: tokio::sync::Mutex::new(Cache::default()),
            live: None,
            door: tokio::sync::Mutex::new(Door::default()),
            ledger: None,
            learned: tokio::sync::Mutex::new(HashMap::new()),
            lane_queues: Vec::new(),
            lanes: tokio::sync::Mutex::new(HashMap::new()),
            upstream: tokio::sync::Mutex::new(HashMap::new()),
        }
    }

    /// Read a lane job's backlog from its lane's queue (`queues[n]` is lane `n`'s; the
    /// topology's `lane_queues()`): its ready messages and ack rate from the management API
    /// (module doc, "Tiers and lanes"). Without it, a lane job is held only to the call
    /// time and, for `batch`, to the work queue's backlog.
    pub fn with_lane_queues(mut self, queues: Vec<String>) -> Self {
        self.lane_queues = queues;
        self
    }

    /// The backlog of `lane` (not the work queue): its ready messages, every one counted
    /// (the door remembers no lane job), and the management API's ack rate, cached per lane
    /// for [`Self::FRESH_FOR`] (a failure for [`Self::RETRY_FAILED_AFTER`]). `None`: no
    /// queue name for it, or no answer.
    pub async fn lane_ahead(&self, lane: u8) -> Option<Ahead> {
        let queue = self
            .lane_queues
            .get(usize::from(lane))
            .filter(|_| lane > 0)?;
        let cached = self.lanes.lock().await.get(&lane).copied();
        let stats = match cached {
            Some((at, r))
                if at.elapsed()
                    < if r.is_some() {
                        Self::FRESH_FOR
                    } else {
                        Self::RETRY_FAILED_AFTER
                    } =>
            {
                r
            }
            _ => {
                // Not under the lock: other lanes' requests do not wait for this query.
                let r = match self.management.queue_stats(queue).await {
                    Ok(r) => r,
                    Err(e) => {
                        tracing::debug!(queue = %queue, error = %e, "cannot read a lane's backlog; not counted");
                        None
                    }
                };
                self.lanes.lock().await.insert(lane, (Instant::now(), r));
                r
            }
        }?;
        Some(Ahead {
            counted: stats.ready,
            doomed: 0,
            rate_per_s: stats.ack_rate_per_s,
        })
    }

    /// Whether the model server of `kind` is known to be down: every live worker recorded
    /// its breaker for the kind open ([`Ledger::upstream_open_until`]). `Some(until)`: the
    /// earliest instant one of them lets a trial call through. Cached per kind for
    /// [`Self::FRESH_FOR`]; `None` without a ledger or when it does not answer.
    pub async fn upstream_open_until(&self, kind: &str, now_ms: i64) -> Option<i64> {
        let ledger = self.ledger.as_ref()?;
        if let Some((at, v)) = self.upstream.lock().await.get(kind)
            && at.elapsed() < Self::FRESH_FOR
        {
            return v.filter(|until| *until > now_ms);
        }
        let v = match ledger
            .upstream_open_until(kind, now_ms, lastcall_core::lease::fresh_since(now_ms))
            .await
        {
            Ok(v) => v,
            Err(e) => {
                tracing::debug!(error = %e, "the door could not read the workers' breakers; none counted");
                None
            }
        };
        let mut cache = self.upstream.lock().await;
        if cache.len() >= MAX_CACHED_KINDS && !cache.contains_key(kind) {
            cache.clear();
        }
        cache.insert(kind.to_owned(), (Instant::now(), v));
        v
    }

    /// Read each kind's call time from `ledger` (the one the workers record to), to set
    /// it aside after the queue wait for a job without its own minimum runtime.
    pub fn with_ledger(mut self, ledger: Option<std::sync::Arc<Ledger>>) -> Self {
        self.ledger = ledger;
        self
    }

    /// Count the queue live through `publisher`'s connection (module doc, "The live
    /// count"): what the door publishes is remembered, so that the jobs in the queue that
    /// can no longer finish are not counted as a wait, and the rate the queue drains at is
    /// measured from the counts.
    pub fn with_live_depth(mut self, publisher: Publisher) -> Self {
        self.live = Some(publisher);
        self
    }

    /// The call time the workers recently held `kind` to, from the ledger (module doc),
    /// for a request of `size` when known (module doc, "Each request's own call time"),
    /// cached per kind for [`Self::FRESH_FOR`]; `None` without a ledger, when unknown, or
    /// when the ledger does not answer.
    pub async fn learned_call_ms(
        &self,
        kind: &str,
        size: Option<RequestSize>,
        now_ms: i64,
    ) -> Option<u64> {
        let ledger = self.ledger.as_ref()?;
        if let Some((at, v)) = self.learned.lock().await.get(kind)
            && at.elapsed() < Self::FRESH_FOR
        {
            return v.call_ms(size);
        }
        // Not under the lock: requests of other kinds do not wait for these queries.
        let since = now_ms.saturating_sub(LEARNED_WINDOW_MS);
        let v = match ledger
            .recent_completed_calls_of_kind(kind, since, LEARNED_CALLS)
            .await
        {
            Ok(calls) => Learned::of(&calls, now_ms),
            Err(e) => {
                tracing::debug!(error = %e, "the door could not read the learned call time; none used");
                Learned::default()
            }
        };
        let mut cache = self.learned.lock().await;
        if cache.len() >= MAX_CACHED_KINDS && !cache.contains_key(kind) {
            cache.clear();
        }
        cache.insert(kind.to_owned(), (Instant::now(), v));
        v.call_ms(size)
    }

    /// The work queue's numbers from the management API, at most [`Self::FRESH_FOR`] old;
    /// `None` when the API did not answer (fail open). One request at a time refreshes
    /// them; the others wait for that reading instead of querying too.
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
                    tracing::warn!(queue = %self.queue, error = %why, "cannot estimate the queue wait from the management API");
                }
                None
            }
        };
        c.reading
    }

    /// The jobs ahead by the live count, and the rate measured from the counts: `None`
    /// without a live source or when the broker did not answer. A count at most
    /// [`Self::LIVE_FRESH_FOR`] old is reused, plus the jobs admitted since (each of
    /// which could finish when admitted).
    async fn live_ahead(&self, now_ms: i64) -> Option<Ahead> {
        let publisher = self.live.as_ref()?;
        let mut door = self.door.lock().await;
        if door
            .failed_at
            .is_some_and(|t| t.elapsed() < Self::RETRY_FAILED_AFTER)
        {
            return None;
        }
        let fresh = door
            .last
            .is_some_and(|l| l.at.elapsed() < Self::LIVE_FRESH_FOR);
        if !fresh {
            let read =
                tokio::time::timeout(Self::TIMEOUT, publisher.queue_ready(&self.queue)).await;
            match read {
                Ok(Ok(Some(ready))) => {
                    if door.failed_at.take().is_some() {
                        tracing::info!(queue = %self.queue, "the broker answers the live queue count again");
                    }
                    door.observe(u64::from(ready), Instant::now(), now_ms);
                }
                other => {
                    if door.failed_at.is_none() {
                        let why = match other {
                            Ok(Err(e)) => e.to_string(),
                            Err(_) => format!("no answer within {:?}", Self::TIMEOUT),
                            _ => format!("the queue {} does not exist", self.queue),
                        };
                        tracing::warn!(queue = %self.queue, error = %why, "cannot count the queue live; using the management API's sampled count");
                    }
                    door.last = None;
                    door.failed_at = Some(Instant::now());
                    return None;
                }
            }
        }
        let last = door.last?;
        // Each job admitted since was judged able to finish.
        let since = door.sent_total - last.sent_total;
        Some(Ahead {
            counted: last.served + since,
            doomed: last.doomed,
            rate_per_s: last.rate_per_s,
        })
    }

    /// The jobs ahead of a new one that a worker will get to in time, and the pace the
    /// workers take them at: from the live count when it can (the management API's ack
    /// rate stands in while the door has measured no pace yet), else from the management
    /// API alone; `None` (fail open) when neither answers.
    pub async fn ahead(&self, now_ms: i64) -> Option<Ahead> {
        let live = self.live_ahead(now_ms).await;
        if let Some(l) = live
            && l.rate_per_s.is_some()
        {
            return live;
        }
        let managed = self.reading().await;
        match (live, managed) {
            (Some(l), m) => Some(Ahead {
                rate_per_s: m.and_then(|m| m.ack_rate_per_s),
                ..l
            }),
            (None, Some(m)) => Some(Ahead {
                counted: m.ready,
                doomed: 0,
                rate_per_s: m.ack_rate_per_s,
            }),
            (None, None) => None,
        }
    }

    /// The verdict for a job of `kind` at `place` (tier and lane) with this deadline and
    /// minimum runtime at `now_ms` ([`decide_tiered`]). Without its own minimum runtime,
    /// the call time the workers recently held its kind to is read from the ledger
    /// ([`Self::with_ledger`]) and set aside after the queue wait. An admitted job of the
    /// work queue is remembered (with a live source) as one the queue now holds.
    /// `margin_ms` (the producer's clock margin, which a worker also keeps) is added to
    /// the call time.
    #[allow(clippy::too_many_arguments)]
    pub async fn check(
        &self,
        kind: &str,
        size: Option<RequestSize>,
        place: Place,
        expires_at_ms: i64,
        min_runtime_ms: Option<u64>,
        margin_ms: u64,
        now_ms: i64,
    ) -> Verdict {
        // The work queue's backlog counts for its own jobs, and for `batch` as the higher
        // tier's; a lane job's own backlog is its lane's.
        let work = if place.priority != Priority::Critical
            && (place.lane == 0 || place.priority == Priority::Batch)
        {
            self.ahead(now_ms).await
        } else {
            None
        };
        let own = match place.lane {
            0 => work,
            _ if place.priority == Priority::Critical => None,
            lane => self.lane_ahead(lane).await,
        };
        let call_ms = match min_runtime_ms {
            Some(own) => Some(own),
            None => self.learned_call_ms(kind, size, now_ms).await,
        }
        .map(|c| c.saturating_add(margin_ms))
        .or((margin_ms > 0).then_some(margin_ms));
        let verdict = decide_tiered(place, own, work, expires_at_ms, call_ms, now_ms);
        tracing::trace!(
            kind,
            priority = place.priority.as_str(),
            lane = place.lane,
            remaining_ms = expires_at_ms - now_ms,
            ?call_ms,
            ?own,
            ?work,
            shed = verdict.is_shed(),
            "shedding at the door"
        );
        if !verdict.is_shed() && place.lane == 0 && self.live.is_some() {
            self.door.lock().await.remember(Sent {
                expires_at_ms,
                need_ms: call_ms.unwrap_or(0),
            });
        }
        verdict
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(n: u64) -> Option<RequestSize> {
        Some(RequestSize {
            prompt_tokens: n,
            max_tokens: None,
        })
    }

    /// A length-dependent server behind the door: 70% short prompts (~70 ms), 30% long (~1.25 s).
    /// A short job is held to a short call's time, a long one to a long one's; an unsized
    /// one, or a kind whose fit does not hold, to the longest recent call.
    #[test]
    fn the_door_holds_each_request_to_its_own_call_time() {
        let calls: Vec<lastcall_store::RecordedCall> = (0..40u64)
            .map(|i| {
                let p = if i % 10 < 7 { 10 } else { 600 };
                lastcall_store::RecordedCall {
                    kind: "chat".into(),
                    latency_ms: 50 + 2 * p + (i * 7919) % 13,
                    recorded_at_ms: 1_000 * i as i64,
                    cut: false,
                    size: tokens(p),
                    prompt_tokens: None,
                }
            })
            .collect();
        let longest = calls.iter().map(|c| c.latency_ms).max();
        let learned = Learned {
            longest,
            sized: Learned::fit(&calls, 40_000),
        };
        let short = learned.call_ms(tokens(10)).unwrap();
        let long = learned.call_ms(tokens(600)).unwrap();
        assert!(short < 120, "{short}");
        assert!((1_250..1_400).contains(&long), "{long}");
        assert_eq!(learned.call_ms(None), longest);
        // Too few calls of known size for the fit: the longest call, whatever the size.
        let few = Learned {
            longest,
            sized: Learned::fit(&calls[..5], 40_000),
        };
        assert!(few.sized.is_none());
        assert_eq!(few.call_ms(tokens(10)), longest);
        // Calls recorded without a size (before ledger version 12): the same.
        let sizeless: Vec<_> = (calls.iter().cloned())
            .map(|c| lastcall_store::RecordedCall { size: None, ..c })
            .collect();
        assert!(Learned::fit(&sizeless, 40_000).is_none());
    }

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
        // 10 s of queue: a 10 s budget would be admitted now.
        assert_eq!(e.min_feasible_budget_ms, 10_000);
        let msg = e.to_string();
        for part in ["10000 ms", "100 ready", "10.00/s", "5000 ms", "5 s"] {
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

    fn sent(expires_at_ms: i64, need_ms: u64) -> Sent {
        Sent {
            expires_at_ms,
            need_ms,
        }
    }

    #[test]
    fn without_a_pace_the_live_count_skips_what_cannot_start_now() {
        let t0 = Instant::now();
        let mut door = Door::default();
        // Ten jobs: the first two (100 and 150 ms left) can no longer fit a 200 ms need.
        for i in 0..10 {
            door.remember(sent(NOW + 100 + i * 50, 200));
        }
        door.observe(10, t0, NOW);
        let l = door.last.unwrap();
        assert_eq!(
            (l.ready, l.served, l.doomed, l.rate_per_s),
            (10, 8, 2, None)
        );
    }

    #[test]
    fn the_pace_counts_only_jobs_that_could_still_finish_while_the_queue_was_busy() {
        let t0 = Instant::now();
        let mut door = Door::default();
        for _ in 0..5 {
            door.remember(sent(NOW + 50, 200)); // doomed
        }
        for _ in 0..15 {
            door.remember(sent(NOW + 10_000, 200));
        }
        door.observe(20, t0, NOW);
        assert_eq!(door.rate_per_s(), None, "one count is no pace");
        // Ten left in 500 ms: the five doomed ones do not count.
        door.observe(10, t0 + Duration::from_millis(500), NOW);
        assert_eq!(door.rate_per_s(), Some(10.0));
        let l = door.last.unwrap();
        assert_eq!((l.served, l.doomed), (10, 0));
        // The queue ran empty: that interval is the arrivals' pace, not the workers'.
        door.observe(0, t0 + Duration::from_millis(1_500), NOW);
        door.remember(sent(NOW + 10_000, 200));
        door.observe(1, t0 + Duration::from_millis(2_000), NOW);
        assert_eq!(door.busy.len(), 1);
        assert_eq!(door.rate_per_s(), Some(10.0));
        // Intervals older than the window are dropped.
        door.observe(1, t0 + Duration::from_millis(3_600), NOW);
        assert_eq!(door.busy.len(), 1);
        assert_eq!(door.rate_per_s(), None, "1.6 s, nothing left");
    }

    #[test]
    fn the_walk_skips_jobs_that_will_be_too_late_when_reached() {
        let t0 = Instant::now();
        let mut door = Door::default();
        // A measured pace of 10 jobs/s: 100 ms of the workers' time per job.
        door.busy.push_back((t0, Duration::from_secs(1), 10));
        // Twelve of the door's jobs with 1000 ms left and a 200 ms need, behind two it does
        // not remember (counted, 200 ms): its jobs start at 200, 300, … ms; those reached
        // after 800 ms cannot finish.
        for _ in 0..12 {
            door.remember(sent(NOW + 1_000, 200));
        }
        door.observe(14, t0, NOW);
        let l = door.last.unwrap();
        assert_eq!((l.ready, l.served, l.doomed), (14, 2 + 7, 5));
        assert_eq!(l.rate_per_s, Some(10.0));
    }

    #[test]
    fn the_door_forgets_a_minute_after_the_deadline() {
        let mut door = Door::default();
        door.remember(sent(NOW, 0));
        door.remember(sent(NOW + FORGET_AFTER_MS, 0));
        door.observe(0, Instant::now(), NOW + FORGET_AFTER_MS + 1);
        assert_eq!(door.sent.len(), 1);
        assert_eq!(door.sent_total, 2);
        assert!(door.get(0).is_none() && door.get(1).is_some() && door.get(2).is_none());
    }

    fn at(priority: Priority, lane: u8) -> Place {
        Place { priority, lane }
    }

    fn backlog(counted: u64, rate: f64) -> Option<Ahead> {
        Some(Ahead {
            counted,
            doomed: 0,
            rate_per_s: Some(rate),
        })
    }

    #[test]
    fn tiers_at_the_door() {
        let deep = backlog(1_000, 10.0); // 100 s of queue
        let budget = NOW + 5_000;
        // Critical: never shed behind a backlog, in any queue; only when the call alone
        // does not fit.
        for lane in [0, 3] {
            let v = decide_tiered(
                at(Priority::Critical, lane),
                deep,
                deep,
                budget,
                Some(800),
                NOW,
            );
            assert!(!v.is_shed(), "{v:?}");
        }
        let e = shed(decide_tiered(
            at(Priority::Critical, 3),
            None,
            None,
            budget,
            Some(5_001),
            NOW,
        ));
        assert!(e.cannot_finish(), "{e:?}");
        assert!(
            e.to_string().contains("cannot finish even if started now"),
            "{e}"
        );
        // Standard in the work queue: today's estimate, exactly.
        for own in [deep, backlog(30, 10.0), None] {
            let v = decide_tiered(at(Priority::Standard, 0), own, own, budget, Some(500), NOW);
            let today = match own {
                Some(a) => decide(a.counted, a.rate_per_s, budget, Some(500), NOW),
                None => Verdict::Admit(Admit::NoReading),
            };
            assert_eq!(v, today);
        }
        // Standard in a lane: its lane's backlog only, not the work queue's.
        assert!(
            !decide_tiered(
                at(Priority::Standard, 2),
                backlog(10, 10.0),
                deep,
                budget,
                None,
                NOW
            )
            .is_shed()
        );
        assert!(decide_tiered(at(Priority::Standard, 2), deep, None, budget, None, NOW).is_shed());
        // Batch: the higher tier's backlog in the work queue keeps it from starting.
        let e = shed(decide_tiered(
            at(Priority::Batch, 5),
            None,
            deep,
            budget,
            None,
            NOW,
        ));
        assert_eq!((e.ready, e.queue_wait_ms), (1_000, 100_000));
        // Its own lane and the work queue add up: 3 s + 3 s of queue do not fit 5 s.
        let three_s = backlog(30, 10.0);
        assert!(!decide_tiered(at(Priority::Batch, 5), three_s, None, budget, None, NOW).is_shed());
        let e = shed(decide_tiered(
            at(Priority::Batch, 5),
            three_s,
            three_s,
            budget,
            None,
            NOW,
        ));
        assert_eq!((e.ready, e.queue_wait_ms), (60, 6_000));
        // A backlog without a pace is no wait.
        let unpaced = Some(Ahead {
            counted: 1_000,
            doomed: 0,
            rate_per_s: None,
        });
        assert_eq!(
            decide_tiered(at(Priority::Batch, 5), unpaced, unpaced, budget, None, NOW),
            Verdict::Admit(Admit::NoAckRate)
        );
        assert!(
            !decide_tiered(at(Priority::Batch, 5), unpaced, three_s, budget, None, NOW).is_shed()
        );
    }

    /// The readings a tiered decision is made from, drawn at random by [`for_readings`].
    struct Readings {
        own: Option<Ahead>,
        work: Option<Ahead>,
        budget: i64,
        call: Option<u64>,
    }

    /// `check` on 20,000 random readings from the generator seeded with `seed` (which it is
    /// handed, to draw the rest of each case): the job's own queue and the work queue each
    /// absent one time in five (up to 2,000 counted, 10 doomed, unpaced one time in six), a
    /// budget from −1 s to 119 s, and a call time up to 20 s, unknown one time in four.
    fn for_readings(seed: u64, mut check: impl FnMut(&mut Gen, Readings)) {
        let mut g = Gen(seed);
        for _ in 0..20_000 {
            let mut ahead = || {
                (g.upto(4) > 0).then(|| Ahead {
                    counted: g.upto(2_000),
                    doomed: g.upto(10),
                    rate_per_s: (g.upto(5) > 0).then(|| g.rate()),
                })
            };
            let (own, work) = (ahead(), ahead());
            let budget = g.upto(120_000) as i64 - 1_000;
            let call = (g.upto(3) > 0).then(|| g.upto(20_000));
            let r = Readings {
                own,
                work,
                budget,
                call,
            };
            check(&mut g, r);
        }
    }

    #[test]
    fn property_tiers_shed_in_order() {
        // Whatever the backlogs: critical is shed only when the call alone exceeds the
        // budget; whenever a job is shed, the same job at a lower tier in the same queue is
        // too (batch is shed first); and nothing that cannot finish if started now is
        // admitted.
        let (mut batch_only, mut sheds) = (0, 0);
        for_readings(0x51_7cc1_b727_220a, |g, r| {
            let lane = 1 + g.upto(6) as u8;
            let v = |p: Priority| {
                decide_tiered(at(p, lane), r.own, r.work, NOW + r.budget, r.call, NOW)
            };
            let (c, s, b) = (
                v(Priority::Critical),
                v(Priority::Standard),
                v(Priority::Batch),
            );
            let too_long = r.call.unwrap_or(0) as i64 > r.budget;
            assert_eq!(c.is_shed(), too_long, "{c:?}");
            if too_long {
                assert!(s.is_shed() && b.is_shed());
            }
            if s.is_shed() {
                assert!(b.is_shed(), "standard shed, batch admitted: {s:?} {b:?}");
                sheds += 1;
            }
            if b.is_shed() && !s.is_shed() {
                batch_only += 1;
            }
            if let Verdict::Shed(e) = b
                && !e.cannot_finish()
            {
                assert!(e.needed_ms() as i64 > r.budget, "{e:?}");
                assert!((1..=MAX_RETRY_AFTER_S).contains(&e.retry_after_s));
            }
        });
        assert!(batch_only > 500 && sheds > 500, "{batch_only} / {sheds}");
    }

    #[test]
    fn property_the_min_feasible_budget_is_admitted_at_the_same_instant() {
        // Whatever the tier and the readings: a shed job resent with the budget its refusal
        // names is admitted by the same decision at the same instant, and one step less
        // would still be shed (the number is the smallest, to the step).
        let (mut sheds, mut behind_a_queue) = (0, 0);
        for_readings(0x6d1f_2b3a_99c4_0e17, |g, r| {
            let priority =
                [Priority::Critical, Priority::Standard, Priority::Batch][g.upto(2) as usize];
            let place = at(priority, g.upto(6) as u8);
            let v = |b: i64| decide_tiered(place, r.own, r.work, NOW + b, r.call, NOW);
            let Verdict::Shed(e) = v(r.budget) else {
                return;
            };
            sheds += 1;
            if !e.cannot_finish() {
                behind_a_queue += 1;
            }
            let min = e.min_feasible_budget_ms;
            assert_eq!(min % BUDGET_STEP_MS, 0, "{e:?}");
            assert!(min as i64 > r.budget, "{e:?}");
            assert!(
                !v(min as i64).is_shed(),
                "{e:?} at {min}: {:?}",
                v(min as i64)
            );
            if min >= BUDGET_STEP_MS {
                let less = (min - BUDGET_STEP_MS) as i64;
                assert!(v(less).is_shed(), "{e:?}: {less} is admitted too");
            }
        });
        assert!(
            sheds > 2_000 && behind_a_queue > 1_000,
            "{sheds} / {behind_a_queue}"
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
