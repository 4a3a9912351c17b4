//! `lastcall bench sim`: a deterministic simulation of workers, a broker queue and a model
//! server on a simulated clock, for tuning the scheduling rules fast and without noise.
//!
//! It runs the core's real decisions — each delivery is the worker's own state machine
//! ([`Delivery`], driven by events as the worker drives it: the receipt check with the
//! expected wait of [`lastcall_core::wait`], the buffer's latest useful start, the last
//! check at a slot and after the start row, the outcome of the call), the buffer's order
//! ([`Schedule`]), the learned call time ([`ServiceTimes`]: request-aware, censored cut
//! calls, probes) — against:
//! - a broker queue with a per-message TTL (the job's remaining budget) and a prefetch
//!   window per worker;
//! - a simulated model server: fixed, lognormal, or length- and load-dependent call
//!   times, with an optional hang (calls started during it never answer);
//! - several workers with their own slots, buffers and estimators;
//! - tenants with their own arrival rates, weights and priority tiers, the buffer ordered
//!   by [`lastcall_core::schedule`]'s policies, and `--lanes` broker queues a tenant is
//!   hashed to ([`lastcall_core::lane_of`]'s rule).
//!
//! The same seed gives the same outcomes. Every run checks the invariants: no call starts
//! at or after its job's deadline, every job has exactly one outcome, none is lost; a
//! violation ends the run with an error.
//!
//! What it does not model (so its figures are an upper bound of the real-time bench's):
//! the door's shedding, ledger and broker latency, redeliveries and crashes, retries.

use anyhow::{Result, bail};
use clap::Args;
use lastcall_core::concurrency::{AdaptiveLimit, LimitConfig, Running, Sample, SlotCount};
use lastcall_core::delivery::{Action, ClockState, Delivery, Event};
use lastcall_core::live::{Lease, WorkerLive, best_peer};
use lastcall_core::request_size::RequestSize;
use lastcall_core::schedule::{Edf, FairShare, Fifo, Policy, Schedule, Ticket, Within};
use lastcall_core::service_time::{
    Estimate, Predictor, PredictorCache, ProbeEnd, ServiceTimeConfig, ServiceTimes,
};
use lastcall_core::table::render;
use lastcall_core::{
    CallResult, Deadline, Envelope, JobId, Kind, Priority, ReceiptFacts, State, Tenant,
    WorkerPolicy, disposition::Slot, wait,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;
use std::cmp::Reverse;
use std::collections::{BinaryHeap, VecDeque};
use std::process::ExitCode;

/// `lastcall bench sim`.
#[derive(Debug, Args, Clone)]
pub struct SimArgs {
    /// Jobs to simulate
    #[arg(long, default_value_t = 100_000)]
    pub jobs: u64,
    /// Seed of every random draw: the same seed gives the same outcomes
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Workers, each with its own slots, buffer and learned call times
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Model slots per worker: a number, or `auto` (the adaptive limit of
    /// `lastcall_core::concurrency`, in [1, --max-slots], as the worker's `--slots auto`)
    #[arg(long, default_value = "4")]
    pub slots: SlotCount,
    /// The highest limit of `--slots auto`
    #[arg(long, default_value_t = 16)]
    pub max_slots: usize,
    /// Unacked deliveries per worker and queue [default: the worker's, 32 × slots and at
    /// least 128; with auto, of --max-slots]
    #[arg(long)]
    pub prefetch: Option<usize>,
    /// Workers of unequal speed: each worker's call times × this, one per worker (e.g.
    /// `1,4` with `--workers 2`: the second runs every call four times slower) [default: 1
    /// each]. The capacity counts each worker at its own speed
    #[arg(long, value_delimiter = ',', value_name = "X,…")]
    pub worker_slowdown: Vec<f64>,
    /// Call times: `fixed:MS`, `lognormal:MEAN_MS,SIGMA`, or
    /// `length:BASE_MS,MS_PER_TOKEN,LONG_SHARE[,SLOWDOWN[,KNEE]]` — a batching server: prompts
    /// of 10 or 600 tokens, the long ones a share of the jobs; a call started with n calls
    /// at the server (itself included) takes its time alone × (1 + SLOWDOWN × (min(n, KNEE)
    /// − 1)) × max(1, n ÷ KNEE): SLOWDOWN per other call in the batch (default 0.15), and
    /// past KNEE calls (the server's batch places; default none) they share the batch, so
    /// the server's throughput rises up to the knee and is flat after it
    #[arg(long, default_value = "fixed:200")]
    pub service: String,
    /// Arrivals as a multiple of the capacity: workers × slots ÷ the mean call time; with a
    /// KNEE in `--service length:…`, the server's peak throughput (the same for every
    /// `--slots`, so the rows of a sweep see the same arrivals)
    #[arg(long, default_value_t = 5.0)]
    pub overload: f64,
    /// Each job's budget from its arrival, in ms
    #[arg(long, default_value_t = 2_000)]
    pub deadline_ms: u64,
    /// A hang of the server, `START_S:SECONDS`: calls started in it never answer
    #[arg(long)]
    pub hang: Option<String>,
    /// Crash each worker at random, on average every this many simulated seconds: what it
    /// held is redelivered, its calls in flight are lost
    #[arg(long)]
    pub crash_every_s: Option<f64>,
    /// Tenants and their arrival rates (multiples of the capacity; replaces --overload):
    /// `NAME:RATE[:WEIGHT[:PRIORITY]],…` (e.g. `flood:10,light:0.1`), or `zipf:N` for N
    /// tenants with Zipf-distributed rates summing to --overload
    #[arg(long)]
    pub tenants: Option<String>,
    /// The buffer's order: `fair` (the worker's default: priority tiers, fair share among
    /// tenants, EDF within one), `edf` or `fifo`
    #[arg(long, default_value = "fair")]
    pub order: String,
    /// Broker queues (lanes) a tenant is hashed to (the product has 8: the work queue for
    /// `default` and 7 for the named tenants); a worker takes from each with a prefetch
    /// window of its own
    #[arg(long, default_value_t = 8)]
    pub lanes: usize,
    /// Experimental: while two or more tenants were received in the last 10 s, refuse at
    /// receipt a job whose tenant already has its weighted share of the buffer's waiting
    /// places (one place kept free, so the worker keeps taking from the queue)
    #[arg(long)]
    pub share_cap: bool,
    /// Reference only: never hand a job back at receipt. By default, as the worker does, a
    /// job refused for its expected wait at this worker alone (not its deadline) while
    /// another worker has room is handed back once, unrecorded (the simulator sees the
    /// peers at once; the worker, through their leases, every 2 s)
    #[arg(long)]
    pub no_pass_on: bool,
    /// Run the same scenario with `--slots 1`, 2, … N and `--slots auto`, one row each
    #[arg(long, value_name = "N")]
    pub sweep: Option<usize>,
    /// How the workers learn call times: `request` (the worker's, per request size) or
    /// `per-kind` (one estimate per kind, without the request's size; reference only)
    #[arg(long, value_enum, default_value = "request")]
    pub estimate: crate::EstimateArg,
    /// `length:`/`mixed:` services: how far the workers' measure of a prompt (4 characters
    /// a token) is from the server's count. Each prompt has `4 × (1 ± x)` characters a
    /// token, drawn uniformly (0: exactly 4, the measure is the count)
    #[arg(long, default_value_t = 0.0, value_name = "X")]
    pub measure_error: f64,
    /// The server reports no prompt count (`usage`): the estimator learns on the workers'
    /// measure alone, never calibrated to the server's count (reference only)
    #[arg(long)]
    pub no_usage: bool,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
}

/// One tenant of `--tenants`.
#[derive(Debug, Clone)]
pub(crate) struct TenantSpec {
    pub(crate) name: String,
    /// Arrivals as a multiple of the capacity.
    pub(crate) rate: f64,
    pub(crate) weight: u32,
    pub(crate) priority: Priority,
}

pub(crate) fn parse_tenants(spec: &str, overload: f64) -> Result<Vec<TenantSpec>> {
    if let Some(n) = spec.strip_prefix("zipf:") {
        let n: usize = n
            .trim()
            .parse()
            .ok()
            .filter(|n| *n > 0)
            .ok_or_else(|| anyhow::anyhow!("--tenants {spec}: expected zipf:N with N ≥ 1"))?;
        let h: f64 = (1..=n).map(|k| 1.0 / k as f64).sum();
        return Ok((1..=n)
            .map(|k| TenantSpec {
                name: format!("t{k}"),
                rate: overload / (k as f64 * h),
                weight: 1,
                priority: Priority::Standard,
            })
            .collect());
    }
    spec.split(',')
        .map(|part| {
            let f: Vec<&str> = part.trim().split(':').collect();
            let bad = || {
                anyhow::anyhow!(
                    "--tenants {spec}: `{part}` is not NAME:RATE[:WEIGHT[:PRIORITY]] (RATE > 0, WEIGHT ≥ 1, PRIORITY critical|standard|batch)"
                )
            };
            if f.len() < 2 || f.len() > 4 {
                return Err(bad());
            }
            Tenant::parse(f[0]).map_err(|_| bad())?;
            let rate: f64 = f[1].parse().map_err(|_| bad())?;
            if rate.is_nan() || rate <= 0.0 {
                return Err(bad());
            }
            let weight: u32 = match f.get(2) {
                Some(w) => w.parse().ok().filter(|w| *w >= 1).ok_or_else(bad)?,
                None => 1,
            };
            let priority = match f.get(3) {
                Some(p) => p.parse().map_err(|_| bad())?,
                None => Priority::Standard,
            };
            Ok(TenantSpec {
                name: f[0].to_owned(),
                rate,
                weight,
                priority,
            })
        })
        .collect()
}

/// The buffer's policy for `--order`.
fn policy_for(order: &str, tenants: &[TenantSpec]) -> Result<Box<dyn Policy>> {
    Ok(match order {
        "fair" => Box::new(
            FairShare::new(Within::Edf)
                .with_weights(tenants.iter().map(|t| (t.name.clone(), t.weight))),
        ),
        "edf" => Box::new(Edf),
        "fifo" => Box::new(Fifo),
        other => bail!("--order {other}: expected fair, edf or fifo"),
    })
}

/// Max-min fair shares of `capacity` among `demands` (water-filling).
pub(crate) fn max_min_shares(demands: &[f64], capacity: f64) -> Vec<f64> {
    let mut order: Vec<usize> = (0..demands.len()).collect();
    order.sort_by(|&a, &b| demands[a].total_cmp(&demands[b]));
    let mut out = vec![0.0; demands.len()];
    let mut left = capacity;
    for (k, &i) in order.iter().enumerate() {
        let fair = left / (order.len() - k) as f64;
        out[i] = demands[i].min(fair);
        left -= out[i];
    }
    out
}

/// Jain's fairness index of `x` (1 = all equal).
pub(crate) fn jain(x: &[f64]) -> f64 {
    let (sum, sq) = x.iter().fold((0.0, 0.0), |(s, q), v| (s + v, q + v * v));
    if sq == 0.0 {
        1.0
    } else {
        sum * sum / (x.len() as f64 * sq)
    }
}

#[derive(Debug, Clone, Copy)]
enum Service {
    Fixed(f64),
    Lognormal {
        mean: f64,
        sigma: f64,
    },
    Length {
        base: f64,
        per_token: f64,
        long_share: f64,
        /// Slower by this per other call in the batch.
        slowdown: f64,
        /// The server's batch places: past them the calls share the batch.
        knee: Option<f64>,
        /// `mixed:…`: prompts of [`MIXED_TOKENS`] (log-uniform) instead of short or long.
        mixed: bool,
    },
}

impl Service {
    fn parse(s: &str) -> Result<Self> {
        let (name, rest) = s.split_once(':').unwrap_or((s, ""));
        let nums: Vec<f64> = rest
            .split(',')
            .map(|x| x.trim().parse::<f64>())
            .collect::<Result<_, _>>()
            .map_err(|_| {
                anyhow::anyhow!("--service {s}: the numbers after `{name}:` do not parse")
            })?;
        match (name, nums.as_slice()) {
            ("fixed", [ms]) if *ms > 0.0 => Some(Self::Fixed(*ms)),
            ("lognormal", [mean, sigma]) if *mean > 0.0 && *sigma >= 0.0 => Some(Self::Lognormal {
                mean: *mean,
                sigma: *sigma,
            }),
            ("length", [base, per, share, more @ ..]) if (0.0..=1.0).contains(share) => {
                Self::length(*base, *per, more, Some(*share))
            }
            ("mixed", [base, per, more @ ..]) => Self::length(*base, *per, more, None),
            _ => None,
        }
        .ok_or_else(|| {
            anyhow::anyhow!(
                "--service {s}: expected fixed:MS, lognormal:MEAN_MS,SIGMA, length:BASE_MS,MS_PER_TOKEN,LONG_SHARE[,SLOWDOWN[,KNEE]] or mixed:BASE_MS,MS_PER_TOKEN[,SLOWDOWN[,KNEE]]"
            )
        })
    }

    /// `length:` (`long_share` given: short or long prompts) and `mixed:` (none: prompts of
    /// [`MIXED_TOKENS`]): `BASE,PER_TOKEN,…[,SLOWDOWN[,KNEE]]`, `more` the optional tail.
    fn length(base: f64, per_token: f64, more: &[f64], long_share: Option<f64>) -> Option<Self> {
        let valid = base > 0.0
            && per_token >= 0.0
            && more.len() <= 2
            && more.first().is_none_or(|s| *s >= 0.0)
            && more.get(1).is_none_or(|k| *k >= 1.0);
        valid.then(|| Self::Length {
            base,
            per_token,
            long_share: long_share.unwrap_or(0.0),
            slowdown: more.first().copied().unwrap_or(0.15),
            knee: more.get(1).copied(),
            mixed: long_share.is_none(),
        })
    }

    /// The mean call time alone (no batch slowdown), for the capacity.
    fn mean_ms(&self) -> f64 {
        match *self {
            Self::Fixed(ms) => ms,
            Self::Lognormal { mean, .. } => mean,
            Self::Length {
                base,
                per_token,
                mixed: true,
                ..
            } => {
                // The mean of a log-uniform draw in [lo, hi]: (hi − lo) ÷ ln(hi ÷ lo).
                let (lo, hi) = (MIXED_TOKENS.0 as f64, MIXED_TOKENS.1 as f64);
                base + per_token * (hi - lo) / (hi / lo).ln()
            }
            Self::Length {
                base,
                per_token,
                long_share,
                ..
            } => {
                base + per_token
                    * (SHORT_TOKENS as f64 * (1.0 - long_share) + LONG_TOKENS as f64 * long_share)
            }
        }
    }

    /// The server's peak throughput in calls per second, when it has a knee (a batching
    /// server's: the same whatever the clients' slots).
    fn peak_per_s(&self) -> Option<f64> {
        match *self {
            Self::Length {
                slowdown,
                knee: Some(k),
                ..
            } => Some(k * 1000.0 / (self.mean_ms() * (1.0 + slowdown * (k - 1.0)))),
            _ => None,
        }
    }
}

const SHORT_TOKENS: u64 = 10;
const LONG_TOKENS: u64 = 600;
/// `mixed:…`: prompt tokens, drawn log-uniform in this range (as `bench goodput --service
/// smollm2-mixed`).
const MIXED_TOKENS: (u64, u64) = (30, 2_000);

/// One standard normal draw (Box–Muller).
fn normal(rng: &mut StdRng) -> f64 {
    let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
    let u2: f64 = rng.random();
    (-2.0 * u1.ln()).sqrt() * (2.0 * std::f64::consts::PI * u2).cos()
}

struct Job {
    env: Envelope,
    tenant: usize,
    size: Option<RequestSize>,
    tokens: u64,
    outcome: Option<&'static str>,
    on_time: bool,
    /// A probe granted at receipt (the room its refusal left), as the worker grants one
    /// when the learned estimate alone refuses a job while a slot is free.
    probe: Option<u64>,
    /// Waiting for a slot to try a probe (as the worker's): judged without the estimate.
    probe_candidate: bool,
    /// Handed back once at receipt (its redelivery is not handed back again).
    handed_back: bool,
    /// Its delivery at a worker: the core's state machine, driven as the worker drives it
    /// (boxed: a million jobs wait mostly without one).
    delivery: Option<Box<Delivery>>,
}

struct Worker {
    est: ServiceTimes,
    /// Fixed slots, or the adaptive limit of `--slots auto`.
    slots: usize,
    limit: Option<AdaptiveLimit>,
    /// The estimator's fit per key, as the worker keeps it ([`PredictorCache`]).
    fits: PredictorCache,
    /// The jobs in the buffer, in the policy's order.
    buffer: Schedule<usize, Box<dyn Policy>>,
    /// Deliveries held (buffered or running), per lane.
    held: Vec<usize>,
    running: usize,
    /// The jobs whose calls run here, with what the adaptive limit needs of them.
    running_jobs: Vec<(usize, Running)>,
    /// Bumped by a crash: the calls of an earlier generation were lost with it.
    generation: u64,
    /// The tenants received lately (tenant → last receipt), for --share-cap.
    seen: std::collections::HashMap<usize, i64>,
}

impl Worker {
    /// The learned call time of a request of `size` at `now` at the concurrency a call
    /// started now runs at (the worker's `Ctx::learned`: `ServiceTimes::estimate_for`,
    /// with the fit kept between observations, × the adaptive limit's inflation).
    fn learned(&mut self, key: &str, size: Option<RequestSize>, now: i64) -> Option<Estimate> {
        let k = self.limit.as_ref().map_or(1.0, AdaptiveLimit::inflation);
        self.raw(key, size, now).map(|e| e.inflated(k))
    }

    /// The request-aware estimator of `key` (kept between observations), as a lease
    /// publishes it.
    fn predictor(&mut self, key: &str, now: i64) -> Predictor {
        self.fits.get(&self.est, key, now)
    }

    /// The learned call time without inflation (the adaptive limit's reference).
    fn raw(&mut self, key: &str, size: Option<RequestSize>, now: i64) -> Option<Estimate> {
        self.fits.get(&self.est, key, now).estimate(size)
    }

    /// As the worker does: may a job refused by the learned time with `room` ms run as a
    /// probe? Judged against the room ÷ the adaptive limit's predicted slowdown.
    fn try_probe(&mut self, key: &str, size: Option<RequestSize>, room: u64, now: i64) -> bool {
        let room = self.probe_room(room);
        self.est.try_probe(key, size, room, now)
    }

    /// As the worker does: may a refusal by the learned time with `room` ms be probed once
    /// the job has a slot ([`ServiceTimes::may_probe`], judged as [`Self::try_probe`])?
    fn may_probe(&self, key: &str, size: Option<RequestSize>, room: u64, now: i64) -> bool {
        self.est.may_probe(key, size, self.probe_room(room), now)
    }

    /// The room ÷ the adaptive limit's predicted slowdown, as the worker judges a probe.
    fn probe_room(&self, room: u64) -> u64 {
        let k = self.limit.as_ref().map_or(1.0, AdaptiveLimit::inflation);
        (room as f64 / k.max(1.0)) as u64
    }

    /// A job was refused while a slot was free: as the worker does, tell the adaptive
    /// limit when its inflation did it (the learned time alone admits the job).
    fn refused_with_room(&mut self, key: &str, policy: &WorkerPolicy, job: &Job, now: i64) {
        if self.limit.as_ref().is_none_or(|l| l.inflation() <= 1.0) {
            return;
        }
        let alone = self.raw(key, job.size, now).map(|e| e.quantile_ms);
        if matches!(policy.on_slot(&job.env, alone, now), Slot::Run { .. })
            && let Some(limit) = self.limit.as_mut()
        {
            limit.refused_by_inflation(now);
        }
    }

    /// The calls that may be in flight now.
    fn cap(&self) -> usize {
        self.limit.as_ref().map_or(self.slots, AdaptiveLimit::limit)
    }

    fn free(&self) -> usize {
        self.cap().saturating_sub(self.running)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Ev {
    /// A job arrives at the broker.
    Arrive(usize),
    /// A call ends (worker, its generation, job, duration, cut, probe budget if a probe,
    /// calls in flight at the worker when it started, itself included).
    CallEnd(usize, u64, usize, u64, bool, Option<u64>, usize),
    /// A worker crashes and restarts at once: what it held is redelivered.
    Crash(usize),
    /// A buffered job's latest useful start (worker, job).
    Latest(usize, usize),
}

/// The figures of one run.
#[derive(Debug, Serialize)]
pub struct SimReport {
    pub jobs: u64,
    pub seed: u64,
    pub service: String,
    pub overload: f64,
    pub workers: usize,
    pub slots: String,
    /// The adaptive limit's mean over the calls started (`--slots auto`), and its range.
    pub mean_limit: Option<f64>,
    pub limit_range: Option<(usize, usize)>,
    pub on_time: u64,
    /// On-time completions ÷ the capacity bound (capacity × the window).
    pub goodput: f64,
    /// On-time completions ÷ all arrivals.
    pub on_time_of_arrivals: f64,
    pub started_late: u64,
    pub wasted_calls: u64,
    /// Model time of calls cut at the deadline ÷ all model time.
    pub wasted_time: f64,
    pub expired_not_started: u64,
    pub expired_before_receive: u64,
    pub deadline_exceeded: u64,
    pub probes: u64,
    /// Per tenant (the first 20 of --tenants).
    pub tenants: Vec<TenantReport>,
    /// Jain's index over the tenants' on-time completions ÷ their max-min fair shares of
    /// all on-time completions (1 = perfectly fair); absent with one tenant.
    pub jain: Option<f64>,
    /// The lowest tenant's on-time completions ÷ its max-min fair share; absent with one.
    pub min_share: Option<f64>,
    /// The tenants below half their max-min fair share; absent with one tenant.
    pub below_half_share: Option<u64>,
    pub crashes: u64,
    /// Deliveries requeued by crashes.
    pub redelivered: u64,
    /// Jobs handed back at receipt for another worker.
    pub passed_on: u64,
    pub lost: u64,
    pub sim_seconds: f64,
    pub wall_ms: u128,
}

/// One tenant's figures.
#[derive(Debug, Serialize)]
pub struct TenantReport {
    pub name: String,
    pub arrivals: u64,
    pub on_time: u64,
    /// On-time completions ÷ its arrivals.
    pub on_time_share: f64,
}

/// Run one simulation.
pub fn simulate(a: &SimArgs) -> Result<SimReport> {
    let t0 = std::time::Instant::now();
    let service = Service::parse(&a.service)?;
    if a.workers == 0 || a.jobs == 0 || a.overload.is_nan() || a.overload <= 0.0 {
        bail!("--workers, --jobs and --overload must be positive");
    }
    if a.max_slots == 0 {
        bail!("--max-slots must be at least 1");
    }
    if a.estimate == crate::EstimateArg::SplitKinds {
        bail!(
            "--estimate split-kinds is `bench goodput`'s (the simulator has one kind): use request or per-kind"
        );
    }
    // The fixed slots, or the most calls `auto` may run.
    let slots = match a.slots {
        SlotCount::Fixed(n) => n.max(1),
        SlotCount::Auto => a.max_slots,
    };
    let hang = match &a.hang {
        None => None,
        Some(h) => {
            let (s, d) = h
                .split_once(':')
                .ok_or_else(|| anyhow::anyhow!("--hang {h}: expected START_S:SECONDS"))?;
            let (s, d): (f64, f64) = (s.trim().parse()?, d.trim().parse()?);
            Some(((s * 1000.0) as i64, ((s + d) * 1000.0) as i64))
        }
    };
    let prefetch = a
        .prefetch
        .unwrap_or(usize::from(lastcall_worker::default_prefetch(slots)))
        .max(1);
    let lanes = a.lanes.max(1);
    let tenants = match &a.tenants {
        Some(spec) => parse_tenants(spec, a.overload)?,
        None => vec![TenantSpec {
            name: Tenant::DEFAULT.into(),
            rate: a.overload,
            weight: 1,
            priority: Priority::Standard,
        }],
    };
    policy_for(&a.order, &tenants)?;
    let overload: f64 = tenants.iter().map(|t| t.rate).sum();
    let lane: Vec<usize> = tenants
        .iter()
        .map(|t| lastcall_core::tenant::lane_in(&t.name, t.priority, lanes))
        .collect();
    // Cumulative rates, to draw each arrival's tenant.
    let cumulative: Vec<f64> = tenants
        .iter()
        .scan(0.0, |acc, t| {
            *acc += t.rate / overload;
            Some(*acc)
        })
        .collect();
    let policy = WorkerPolicy::default();
    let mut rng = StdRng::seed_from_u64(a.seed);
    // jobs/s: the server's peak when it has one, else what the workers' slots can run.
    let slowdown: Vec<f64> = match a.worker_slowdown.as_slice() {
        [] => vec![1.0; a.workers],
        s if s.len() == a.workers && s.iter().all(|x| x.is_finite() && *x > 0.0) => s.to_vec(),
        s => bail!(
            "--worker-slowdown: {} values for {} workers; give one positive factor per worker",
            s.len(),
            a.workers
        ),
    };
    let capacity = service.peak_per_s().unwrap_or(
        slowdown
            .iter()
            .map(|x| slots as f64 * 1000.0 / (service.mean_ms() * x))
            .sum(),
    );
    let gap_ms = 1000.0 / (capacity * overload);
    let kind = Kind::parse("sim").expect("a valid kind");

    let mut jobs: Vec<Job> = Vec::with_capacity(a.jobs as usize);
    let mut events: BinaryHeap<Reverse<(i64, u64, Ev)>> = BinaryHeap::new();
    let mut seq = 0u64;
    let mut push = |events: &mut BinaryHeap<Reverse<(i64, u64, Ev)>>, at: i64, ev: Ev| {
        seq += 1;
        events.push(Reverse((at, seq, ev)));
    };
    // Arrivals: Poisson at overload × capacity, each of a tenant drawn by its rate.
    let mut t = 0.0f64;
    for i in 0..a.jobs as usize {
        t += -gap_ms * rng.random::<f64>().max(f64::MIN_POSITIVE).ln();
        let at = t as i64;
        let tenant = if tenants.len() == 1 {
            0
        } else {
            let u: f64 = rng.random();
            cumulative
                .partition_point(|&c| c < u)
                .min(tenants.len() - 1)
        };
        let (payload, size, tokens) = match service {
            Service::Length {
                long_share, mixed, ..
            } => {
                let tokens = if mixed {
                    let (lo, hi) = ((MIXED_TOKENS.0 as f64).ln(), (MIXED_TOKENS.1 as f64).ln());
                    (lo + rng.random::<f64>() * (hi - lo)).exp().round() as u64
                } else if rng.random::<f64>() < long_share {
                    LONG_TOKENS
                } else {
                    SHORT_TOKENS
                };
                let mut p = serde_json::Map::new();
                // CHARS_PER_TOKEN characters a token (± the measure's error), less the
                // per-message allowance.
                let per_token = if a.measure_error > 0.0 {
                    4.0 * (1.0 + a.measure_error.min(0.9) * (2.0 * rng.random::<f64>() - 1.0))
                } else {
                    4.0
                };
                let chars = (tokens.saturating_sub(4) as f64 * per_token).round() as u64;
                p.insert("prompt".into(), "x".repeat(chars as usize).into());
                let size = RequestSize::of_payload(&p);
                (serde_json::Map::new(), size, tokens)
            }
            _ => (serde_json::Map::new(), None, 0),
        };
        let mut env = Envelope::new(
            JobId::parse(&format!("sim-{i}")).expect("a valid id"),
            kind.clone(),
            Deadline::from_budget(at, a.deadline_ms),
            None,
            None,
            payload,
        );
        if a.tenants.is_some() {
            env = env
                .with_tenant(Tenant::parse(&tenants[tenant].name).expect("checked"))
                .with_priority(tenants[tenant].priority);
        }
        jobs.push(Job {
            env,
            tenant,
            size,
            tokens,
            outcome: None,
            on_time: false,
            probe: None,
            probe_candidate: false,
            handed_back: false,
            delivery: None,
        });
        push(&mut events, at, Ev::Arrive(i));
    }
    let first_arrival = jobs.first().map_or(0, |j| j.env.deadline().created_at_ms());
    let last_deadline = jobs
        .iter()
        .map(|j| j.env.deadline().expires_at_ms())
        .max()
        .unwrap_or(0);

    let mut workers: Vec<Worker> = (0..a.workers)
        .map(|_| Worker {
            est: ServiceTimes::new(ServiceTimeConfig {
                request_aware: a.estimate == crate::EstimateArg::Request,
                ..ServiceTimeConfig::default()
            }),
            fits: PredictorCache::default(),
            slots,
            limit: (a.slots == SlotCount::Auto)
                .then(|| AdaptiveLimit::new(LimitConfig::new(a.max_slots))),
            buffer: Schedule::new(policy_for(&a.order, &tenants).expect("checked")),
            held: vec![0; lanes],
            seen: std::collections::HashMap::new(),
            running: 0,
            running_jobs: Vec::new(),
            generation: 0,
        })
        .collect();
    let mut queues: Vec<VecDeque<usize>> = vec![VecDeque::new(); lanes];
    // Each lane's next consumer in the broker's rotation.
    let mut next_consumer = vec![0usize; lanes];
    let mut receipts = 0u64;
    let (mut started_late, mut wasted_calls, mut probes) = (0u64, 0u64, 0u64);
    let (mut crashes, mut redelivered) = (0u64, 0u64);
    let mut passed_on = 0u64;
    if let Some(every) = a.crash_every_s {
        if every.is_nan() || every <= 0.0 {
            bail!("--crash-every-s must be positive");
        }
        for w in 0..a.workers {
            let gap = -every * 1000.0 * rng.random::<f64>().max(f64::MIN_POSITIVE).ln();
            push(&mut events, gap as i64, Ev::Crash(w));
        }
    }
    let (mut model_ms, mut wasted_ms) = (0u128, 0u128);
    let mut server_in_flight = 0usize;
    // The limit at each call's start: sum, calls, lowest, highest.
    let mut caps = (0usize, 0usize, usize::MAX, 0usize);
    let key = "sim|sim";
    let mut now;

    let settle =
        |jobs: &mut Vec<Job>, j: usize, outcome: &'static str, on_time: bool| -> Result<()> {
            if jobs[j].outcome.is_some() {
                bail!("invariant: job {j} got a second outcome ({outcome})");
            }
            jobs[j].outcome = Some(outcome);
            jobs[j].on_time = on_time;
            Ok(())
        };
    // A delivery the core settled: record its outcome (the ledger write is instant here),
    // then it must finish with the broker.
    let record = |jobs: &mut Vec<Job>, j: usize, d: &mut Delivery, now: i64| -> Result<()> {
        let Some(t) = d.terminal() else {
            bail!("invariant: job {j} was settled without an outcome");
        };
        let state = t.state.as_str();
        let on_time = t.state == State::Completed && now <= jobs[j].env.deadline().expires_at_ms();
        d.handle(&policy, Event::Durable, now);
        if !matches!(d.poll_action(), Action::Finish(_)) {
            bail!("invariant: job {j} did not finish after its outcome was durable");
        }
        settle(jobs, j, state, on_time)
    };

    while let Some(Reverse((at, _, ev))) = events.pop() {
        now = at;
        match ev {
            Ev::Arrive(j) => queues[lane[jobs[j].tenant]].push_back(j),
            Ev::Latest(w, j) => {
                // Still buffered? (It may have started or left since.)
                let buffered = workers[w].buffer.iter().find(|(_, x)| **x == j);
                if let (None, Some((tk, _))) = (jobs[j].outcome, buffered) {
                    let receipt = tk.receipt;
                    let learned = match jobs[j].probe.is_some() || jobs[j].probe_candidate {
                        true => None,
                        false => workers[w].learned(key, jobs[j].size, now),
                    };
                    let Some(mut d) = jobs[j].delivery.take() else {
                        bail!("invariant: buffered job {j} has no delivery");
                    };
                    d.handle(&policy, Event::Timeout { learned }, now);
                    if d.poll_action() == Action::AwaitSlot {
                        // Still admissible (the estimate changed): look again after its
                        // latest useful start.
                        let latest = d.poll_timeout(&policy).unwrap_or(now);
                        jobs[j].delivery = Some(d);
                        push(&mut events, latest.max(now) + 1, Ev::Latest(w, j));
                    } else {
                        workers[w].buffer.remove(receipt);
                        workers[w].held[lane[jobs[j].tenant]] -= 1;
                        if jobs[j].probe.take().is_some() {
                            workers[w].est.probe_ended(key, ProbeEnd::Released, now);
                        }
                        record(&mut jobs, j, &mut d, now)?;
                    }
                }
            }
            Ev::Crash(w) => {
                // Its connection is gone: the broker requeues every delivery it held, at
                // the head of the queue; calls in flight are lost (the redelivery may run
                // the job again: at least once for calls, exactly once for outcomes). The
                // restarted worker learns again from the ledger's calls: its estimator
                // is kept.
                crashes += 1;
                let wk = &mut workers[w];
                let mut back: Vec<usize> = wk.buffer.drain().into_iter().map(|(_, j)| j).collect();
                back.extend(wk.running_jobs.drain(..).map(|(j, _)| j));
                for &j in &back {
                    // The worker's process is gone, and its deliveries with it.
                    jobs[j].delivery = None;
                    jobs[j].probe_candidate = false;
                    if jobs[j].probe.take().is_some() {
                        wk.est.probe_ended(key, ProbeEnd::Released, now);
                    }
                }
                back.sort_unstable();
                server_in_flight -= wk.running;
                redelivered += back.len() as u64;
                for j in back.into_iter().rev() {
                    queues[lane[jobs[j].tenant]].push_front(j);
                }
                wk.generation += 1;
                wk.running = 0;
                wk.held = vec![0; lanes];
                wk.fits = PredictorCache::default();
                // The next crash, while work remains (else the run would never end).
                let open = jobs.iter().any(|j| j.outcome.is_none());
                if let (Some(every), true) = (a.crash_every_s, open) {
                    let gap = -every * 1000.0 * rng.random::<f64>().max(f64::MIN_POSITIVE).ln();
                    push(&mut events, now + gap as i64, Ev::Crash(w));
                }
            }
            Ev::CallEnd(w, generation, ..) if generation != workers[w].generation => {}
            Ev::CallEnd(w, _, j, d, cut, probe, in_flight) => {
                let wk = &mut workers[w];
                wk.running_jobs.retain(|&(r, _)| r != j);
                // The adaptive limit learns from the call before the estimator does: the
                // reference is what was expected of it (its size, uninflated).
                let expected = wk.raw(key, jobs[j].size, now).map_or(0, |e| e.mean_ms);
                if let Some(limit) = wk.limit.as_mut() {
                    let running: Vec<Running> = wk.running_jobs.iter().map(|(_, r)| *r).collect();
                    limit.observe(
                        Sample {
                            started_ms: now - d as i64,
                            in_flight,
                            observed_ms: d,
                            expected_ms: expected,
                        },
                        &running,
                        now,
                    );
                }
                wk.running -= 1;
                wk.held[lane[jobs[j].tenant]] -= 1;
                server_in_flight -= 1;
                model_ms += u128::from(d);
                let Some(mut delivery) = jobs[j].delivery.take() else {
                    bail!("invariant: running job {j} has no delivery");
                };
                if cut {
                    wasted_calls += 1;
                    wasted_ms += u128::from(d);
                }
                let ended = Event::CallEnded {
                    result: if cut {
                        CallResult::DeadlineExceeded
                    } else {
                        CallResult::Completed
                    },
                    learned: wk.learned(key, jobs[j].size, now),
                    jitter: 0.0,
                };
                delivery.handle(&policy, ended, now);
                // The call's result as the core records it.
                let result = delivery.call_result().cloned();
                if let Some(cut) = result.as_ref().and_then(CallResult::teaches_call_time) {
                    // The server's count of the prompt: the true tokens.
                    let used = (!a.no_usage && jobs[j].size.is_some()).then_some(jobs[j].tokens);
                    (wk.est).observe_counted(key, d, cut, jobs[j].size, used, now);
                }
                record(&mut jobs, j, &mut delivery, now)?;
                if let Some(budget_ms) = probe {
                    let end = (result.as_ref())
                        .map_or(ProbeEnd::Released, |r| ProbeEnd::of(r, budget_ms, d));
                    wk.est.probe_ended(key, end, now);
                }
            }
        }
        // Deliver from the lanes to workers with room in that lane's prefetch window. The
        // broker rotates over a queue's consumers message by message, whichever event
        // came: each lane's rotation goes on where it stopped (`next_consumer`), so one
        // worker with a wide window does not take every arrival.
        let mut progress = true;
        while progress && queues.iter().any(|q| !q.is_empty()) {
            progress = false;
            for l in 0..lanes {
                if queues[l].is_empty() {
                    continue;
                }
                let Some(w) = (0..a.workers)
                    .map(|k| (next_consumer[l] + k) % a.workers)
                    .find(|&w| workers[w].held[l] < prefetch)
                else {
                    continue;
                };
                next_consumer[l] = (w + 1) % a.workers;
                // What the peers' leases tell the worker (here without their 2 s delay).
                let peer = if a.workers > 1 && !a.no_pass_on && !jobs[queues[l][0]].handed_back {
                    let mut leases = Vec::with_capacity(a.workers);
                    for o in 0..a.workers {
                        // The kind's learned call time and its request-aware estimator,
                        // as a lease publishes them (the predictor kept between
                        // observations).
                        let model = workers[o].predictor(key, now);
                        let call = model.estimate(None).map(|e| e.quantile_ms);
                        let p = &workers[o];
                        leases.push(Lease {
                            worker: o.to_string(),
                            renewed_at_ms: now,
                            live: Some(WorkerLive {
                                waiting: p.buffer.len() as i64,
                                running: p.running as i64,
                                limit: p.cap() as i64,
                                learned_call_ms: call
                                    .map(|c| ("sim".to_owned(), c))
                                    .into_iter()
                                    .collect(),
                                call_models: call
                                    .map(|_| ("sim".to_owned(), model))
                                    .into_iter()
                                    .collect(),
                                ..WorkerLive::default()
                            }),
                        });
                    }
                    best_peer(&leases, &w.to_string(), "sim", jobs[queues[l][0]].size, now)
                } else {
                    None
                };
                let wk = &mut workers[w];
                {
                    let Some(j) = queues[l].pop_front() else {
                        continue;
                    };
                    progress = true;
                    if jobs[j].env.deadline().expires_at_ms() <= now {
                        // The broker's TTL expired it in the queue.
                        settle(&mut jobs, j, "expired_before_receive", false)?;
                        continue;
                    }
                    let mut learned = wk.learned(key, jobs[j].size, now);
                    // As the worker does: refused by the learned estimate alone while a slot
                    // is free, the job may run as a probe (without the estimate); with no
                    // slot free, it waits judged without the estimate if a probe may
                    // question the refusal, and tries the probe at its slot.
                    if let Some(room) =
                        policy.refused_by_learned(&jobs[j].env, learned.map(|e| e.quantile_ms), now)
                    {
                        if wk.free() > 0 {
                            if wk.try_probe(key, jobs[j].size, room, now) {
                                jobs[j].probe = Some(room);
                                probes += 1;
                                learned = None;
                            }
                        } else if wk.may_probe(key, jobs[j].size, room, now) {
                            jobs[j].probe_candidate = true;
                            learned = None;
                        }
                    }
                    let own_mean = learned.map_or(0, |e| e.mean_ms);
                    receipts += 1;
                    let ticket = Ticket {
                        receipt: receipts,
                        deadline_ms: jobs[j].env.deadline().expires_at_ms(),
                        work_ms: own_mean,
                        tenant: jobs[j].env.tenant().to_owned(),
                        priority: jobs[j].env.priority(),
                    };
                    let (ahead, work) = wk.buffer.ahead_of(&ticket, |_| true);
                    let mean = if ahead == 0 || work == 0 {
                        own_mean
                    } else {
                        work / ahead as u64
                    };
                    let facts = ReceiptFacts {
                        expected_wait_ms: wait::expected_wait_ms(ahead, wk.free(), wk.cap(), mean),
                        learned_runtime_ms: learned.map(|e| e.quantile_ms),
                        peer,
                        ..ReceiptFacts::default()
                    };
                    let over_share = a.share_cap && {
                        wk.seen.insert(jobs[j].tenant, now);
                        wk.seen.retain(|_, at| now - *at < 10_000);
                        let active: Vec<usize> = wk.seen.keys().copied().collect();
                        active.len() >= 2 && {
                            let total_w: u32 = active.iter().map(|&t| tenants[t].weight).sum();
                            let room = prefetch.saturating_sub(wk.cap() + 1) as f64;
                            let cap = ((room * f64::from(tenants[jobs[j].tenant].weight)
                                / f64::from(total_w))
                            .floor() as usize)
                                .max(1);
                            let mine = wk
                                .buffer
                                .iter()
                                .filter(|(t, _)| t.tenant == ticket.tenant)
                                .count();
                            mine >= cap
                        }
                    };
                    if over_share {
                        if jobs[j].probe.take().is_some() {
                            wk.est.probe_ended(key, ProbeEnd::Released, now);
                        }
                        settle(&mut jobs, j, "expired_not_started", false)?;
                        continue;
                    }
                    let mut d = Delivery::new(Ok(jobs[j].env.clone()), 0, now, None);
                    d.handle(&policy, Event::Looked { facts, learned }, now);
                    if d.poll_action() == Action::AwaitSlot {
                        wk.held[l] += 1;
                        wk.buffer.push(ticket, j);
                        let latest = d.poll_timeout(&policy).unwrap_or(now);
                        jobs[j].delivery = Some(Box::new(d));
                        // Due once its latest useful start has passed.
                        push(&mut events, latest.max(now) + 1, Ev::Latest(w, j));
                    } else {
                        if wk.free() > 0 {
                            wk.refused_with_room(key, &policy, &jobs[j], now);
                        }
                        if jobs[j].probe.take().is_some() {
                            wk.est.probe_ended(key, ProbeEnd::Released, now);
                        }
                        if d.is_passed_on() {
                            // Handed back unrecorded, at the queue's head; its redelivery
                            // is not passed on again.
                            if !matches!(d.poll_action(), Action::Finish(_)) {
                                bail!("invariant: job {j} was passed on without a hand-back");
                            }
                            jobs[j].handed_back = true;
                            passed_on += 1;
                            queues[l].push_front(j);
                            continue;
                        }
                        record(&mut jobs, j, &mut d, now)?;
                    }
                }
            }
        }
        // Start calls on free slots, earliest deadline first.
        for (w, wk) in workers.iter_mut().enumerate() {
            while wk.free() > 0 {
                let Some((ticket, j)) = wk.buffer.pop() else {
                    break;
                };
                // A job kept waiting for a probe is judged by the estimate again here.
                jobs[j].probe_candidate = false;
                let mut learned = wk.learned(key, jobs[j].size, now);
                let mut learned_ms = learned.map(|e| e.quantile_ms);
                let mut probe = jobs[j].probe.take();
                if probe.is_some() {
                    (learned, learned_ms) = (None, None);
                } else if let Some(room) = policy.refused_by_learned(&jobs[j].env, learned_ms, now)
                    && wk.try_probe(key, jobs[j].size, room, now)
                {
                    probe = Some(room);
                    probes += 1;
                    (learned, learned_ms) = (None, None);
                }
                let Some(mut d) = jobs[j].delivery.take() else {
                    bail!("invariant: buffered job {j} has no delivery");
                };
                // The slot, then the `running` row (instant here): the last check twice.
                let clock = ClockState::Trusted;
                d.handle(&policy, Event::SlotGranted { clock, learned }, now);
                let cancel_requested = false;
                d.handle(
                    &policy,
                    Event::StartDurable {
                        learned,
                        cancel_requested,
                    },
                    now,
                );
                match d.poll_action() {
                    Action::Record => {
                        match probe {
                            Some(_) => wk.est.probe_ended(key, ProbeEnd::Released, now),
                            None => wk.refused_with_room(key, &policy, &jobs[j], now),
                        }
                        wk.held[lane[jobs[j].tenant]] -= 1;
                        record(&mut jobs, j, &mut d, now)?;
                    }
                    Action::Call { budget_ms } => {
                        jobs[j].delivery = Some(d);
                        wk.buffer.granted(&ticket);
                        if now >= jobs[j].env.deadline().expires_at_ms() {
                            started_late += 1;
                        }
                        let hung = hang.is_some_and(|(s, e)| now >= s && now < e);
                        let d = if hung {
                            u64::MAX
                        } else {
                            match service {
                                Service::Fixed(ms) => ms.round() as u64,
                                Service::Lognormal { mean, sigma } => {
                                    let mu = mean.ln() - sigma * sigma / 2.0;
                                    (mu + sigma * normal(&mut rng)).exp().round() as u64
                                }
                                Service::Length {
                                    base,
                                    per_token,
                                    slowdown,
                                    knee,
                                    ..
                                } => {
                                    let alone = base + per_token * jobs[j].tokens as f64;
                                    // n calls at the server, this one included.
                                    let n = (server_in_flight + 1) as f64;
                                    let k = knee.unwrap_or(f64::INFINITY);
                                    let batch = 1.0 + slowdown * (n.min(k) - 1.0);
                                    (alone * batch * (n / k).max(1.0)).round() as u64
                                }
                            }
                        };
                        let d = match d {
                            u64::MAX => d,
                            d => (d as f64 * slowdown[w]).round() as u64,
                        };
                        let cut = d > budget_ms;
                        let d = d.min(budget_ms);
                        wk.running += 1;
                        let in_flight = wk.running;
                        let cap = wk.cap();
                        caps = (caps.0 + cap, caps.1 + 1, caps.2.min(cap), caps.3.max(cap));
                        wk.running_jobs.push((
                            j,
                            Running {
                                started_ms: now,
                                expected_ms: learned_ms.unwrap_or(0),
                                deadline_ms: jobs[j].env.deadline().expires_at_ms(),
                            },
                        ));
                        server_in_flight += 1;
                        let g = wk.generation;
                        push(
                            &mut events,
                            now + d as i64,
                            Ev::CallEnd(w, g, j, d, cut, probe, in_flight),
                        );
                    }
                    other => bail!("invariant: job {j} asked for {other:?} at its slot"),
                }
            }
        }
    }
    if started_late > 0 {
        bail!("invariant: {started_late} calls started at or after their job's deadline");
    }
    let count = |o: &str| jobs.iter().filter(|j| j.outcome == Some(o)).count() as u64;
    let lost = jobs.iter().filter(|j| j.outcome.is_none()).count() as u64;
    if lost > 0 {
        bail!("invariant: {lost} jobs ended without an outcome");
    }
    let on_time = jobs.iter().filter(|j| j.on_time).count() as u64;
    let mut per = vec![(0u64, 0u64); tenants.len()];
    for j in &jobs {
        per[j.tenant].0 += 1;
        per[j.tenant].1 += u64::from(j.on_time);
    }
    // Each tenant's on-time completions ÷ its max-min fair share of all of them.
    let shares: Option<Vec<f64>> = (tenants.len() > 1).then(|| {
        let demands: Vec<f64> = per.iter().map(|p| p.0 as f64).collect();
        let fair = max_min_shares(&demands, on_time as f64);
        per.iter()
            .zip(&fair)
            .filter(|(_, f)| **f > 0.0)
            .map(|(p, f)| p.1 as f64 / f)
            .collect()
    });
    let jain_index = shares.as_deref().map(jain);
    let below_half_share = shares
        .as_deref()
        .map(|x| x.iter().filter(|&&r| r < 0.5).count() as u64);
    let min_share = shares
        .as_deref()
        .and_then(|x| x.iter().copied().reduce(f64::min));
    let tenant_reports = tenants
        .iter()
        .zip(&per)
        .take(20)
        .map(|(t, p)| TenantReport {
            name: t.name.clone(),
            arrivals: p.0,
            on_time: p.1,
            on_time_share: if p.0 == 0 {
                0.0
            } else {
                p.1 as f64 / p.0 as f64
            },
        })
        .collect();
    let window_s = (last_deadline - first_arrival) as f64 / 1000.0;
    let bound = capacity * window_s;
    Ok(SimReport {
        jobs: a.jobs,
        seed: a.seed,
        service: a.service.clone(),
        overload,
        workers: a.workers,
        slots: a.slots.to_string(),
        mean_limit: (a.slots == SlotCount::Auto && caps.1 > 0)
            .then(|| caps.0 as f64 / caps.1 as f64),
        limit_range: (a.slots == SlotCount::Auto && caps.1 > 0).then_some((caps.2, caps.3)),
        on_time,
        goodput: on_time as f64 / bound.min(a.jobs as f64).max(1.0),
        on_time_of_arrivals: on_time as f64 / a.jobs as f64,
        started_late,
        wasted_calls,
        wasted_time: if model_ms == 0 {
            0.0
        } else {
            wasted_ms as f64 / model_ms as f64
        },
        expired_not_started: count("expired_not_started"),
        expired_before_receive: count("expired_before_receive"),
        deadline_exceeded: count("deadline_exceeded"),
        probes,
        tenants: tenant_reports,
        jain: jain_index,
        min_share,
        below_half_share,
        crashes,
        redelivered,
        passed_on,
        lost,
        sim_seconds: window_s,
        wall_ms: t0.elapsed().as_millis(),
    })
}

/// `lastcall bench sim`: run, print the table (or JSON).
pub fn run(a: SimArgs) -> Result<ExitCode> {
    if let Some(n) = a.sweep {
        return sweep(a, n);
    }
    let r = simulate(&a)?;
    if a.json {
        println!("{}", serde_json::to_string(&r)?);
        return Ok(ExitCode::SUCCESS);
    }
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    let head = [
        "service",
        "overload",
        "jobs",
        "on_time",
        "goodput",
        "of_arrivals",
        "started_late",
        "wasted_calls",
        "wasted_time",
        "exp_not_started",
        "exp_before_recv",
        "deadline_exc",
        "probes",
        "lost",
        "wall_ms",
    ];
    let row = vec![
        r.service.clone(),
        format!("{}×", r.overload),
        r.jobs.to_string(),
        r.on_time.to_string(),
        pct(r.goodput),
        pct(r.on_time_of_arrivals),
        r.started_late.to_string(),
        r.wasted_calls.to_string(),
        pct(r.wasted_time),
        r.expired_not_started.to_string(),
        r.expired_before_receive.to_string(),
        r.deadline_exceeded.to_string(),
        r.probes.to_string(),
        r.lost.to_string(),
        r.wall_ms.to_string(),
    ];
    println!(
        "bench sim: seed {}, {} worker(s) × {} slots, {} calls, {}× the capacity, {} ms budgets, {:.1} s simulated",
        r.seed, r.workers, r.slots, r.service, r.overload, a.deadline_ms, r.sim_seconds
    );
    if let (Some(mean), Some((lo, hi))) = (r.mean_limit, r.limit_range) {
        println!("adaptive limit: {mean:.1} on average at a call's start, {lo}–{hi}");
    }
    print!("{}", render(&head, &[row]));
    if r.tenants.len() > 1 {
        let rows: Vec<Vec<String>> = r
            .tenants
            .iter()
            .map(|t| {
                vec![
                    t.name.clone(),
                    t.arrivals.to_string(),
                    t.on_time.to_string(),
                    pct(t.on_time_share),
                ]
            })
            .collect();
        print!(
            "{}",
            render(&["tenant", "arrivals", "on_time", "of_its_arrivals"], &rows)
        );
        if let Some(j) = r.jain {
            println!("Jain's fairness index (on time ÷ max-min fair share): {j:.3}");
        }
        if let (Some(m), Some(n)) = (r.min_share, r.below_half_share) {
            println!(
                "lowest tenant: {m:.3} of its max-min fair share; {n} tenants below half of theirs"
            );
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `--sweep N`: fixed 1..=N and auto on the same arrivals.
fn sweep(a: SimArgs, n: usize) -> Result<ExitCode> {
    let pct = |x: f64| format!("{:.1}%", 100.0 * x);
    let mut runs = Vec::new();
    for slots in (1..=n.max(1))
        .map(SlotCount::Fixed)
        .chain([SlotCount::Auto])
    {
        let r = simulate(&SimArgs {
            slots,
            sweep: None,
            ..a.clone()
        })?;
        runs.push(r);
    }
    if a.json {
        println!("{}", serde_json::to_string(&runs)?);
        return Ok(ExitCode::SUCCESS);
    }
    let best = runs
        .iter()
        .filter(|r| r.mean_limit.is_none())
        .map(|r| r.on_time)
        .max()
        .unwrap_or(0)
        .max(1);
    let rows: Vec<Vec<String>> = runs
        .iter()
        .map(|r| {
            vec![
                match (r.mean_limit, r.limit_range) {
                    (Some(m), Some((lo, hi))) => format!("auto (mean {m:.1}, {lo}–{hi})"),
                    _ => r.slots.clone(),
                },
                r.on_time.to_string(),
                pct(r.on_time_of_arrivals),
                pct(r.goodput),
                pct(r.on_time as f64 / best as f64),
                pct(r.wasted_time),
                r.started_late.to_string(),
            ]
        })
        .collect();
    println!(
        "bench sim --sweep {n}: seed {}, {} worker(s), {} calls, {}× the capacity, {} ms budgets, {} jobs",
        a.seed, a.workers, a.service, a.overload, a.deadline_ms, a.jobs
    );
    print!(
        "{}",
        render(
            &[
                "slots",
                "on_time",
                "of_arrivals",
                "of_capacity",
                "of_best_fixed",
                "wasted_time",
                "started_late",
            ],
            &rows
        )
    );
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(service: &str, jobs: u64, seed: u64) -> SimArgs {
        SimArgs {
            jobs,
            seed,
            workers: 1,
            slots: SlotCount::Fixed(4),
            max_slots: 16,
            prefetch: None,
            worker_slowdown: Vec::new(),
            service: service.into(),
            overload: 5.0,
            deadline_ms: 2_000,
            hang: None,
            crash_every_s: None,
            tenants: None,
            order: "fair".into(),
            lanes: 8,
            share_cap: false,
            no_pass_on: false,
            sweep: None,
            estimate: crate::EstimateArg::Request,
            measure_error: 0.0,
            no_usage: false,
            json: false,
        }
    }

    #[test]
    fn the_same_seed_gives_the_same_outcomes() {
        for service in ["fixed:200", "lognormal:200,0.6", "length:50,2,0.3"] {
            let a = simulate(&args(service, 3_000, 7)).unwrap();
            let b = simulate(&args(service, 3_000, 7)).unwrap();
            assert_eq!(
                (a.on_time, a.wasted_calls, a.expired_not_started, a.probes),
                (b.on_time, b.wasted_calls, b.expired_not_started, b.probes),
                "{service}"
            );
            assert_eq!(a.lost, 0);
            assert_eq!(a.started_late, 0);
        }
    }

    #[test]
    fn overload_keeps_the_slots_busy_with_work_that_finishes() {
        let r = simulate(&args("fixed:200", 5_000, 1)).unwrap();
        assert!(r.goodput > 0.9, "{r:?}");
        assert_eq!(r.wasted_calls, 0, "{r:?}");
    }

    #[test]
    fn a_hang_is_followed_by_recovery() {
        let mut a = args("fixed:150", 3_000, 3);
        a.overload = 2.0;
        a.deadline_ms = 3_000;
        a.hang = Some("4:2".into());
        let r = simulate(&a).unwrap();
        assert!(r.deadline_exceeded > 0, "the hang cut calls: {r:?}");
        assert!(r.goodput > 0.8, "{r:?}");
    }

    #[test]
    fn crashes_redeliver_and_every_job_still_has_one_outcome() {
        let mut a = args("lognormal:200,0.6", 5_000, 11);
        a.workers = 3;
        a.crash_every_s = Some(5.0);
        let r = simulate(&a).unwrap();
        assert!(r.crashes > 0 && r.redelivered > 0, "{r:?}");
        // simulate() fails on a second outcome, a lost job or a late start.
        assert_eq!((r.lost, r.started_late), (0, 0));
        let again = simulate(&a).unwrap();
        assert_eq!(
            (r.on_time, r.redelivered),
            (again.on_time, again.redelivered)
        );
    }

    /// The broker's rotation over consumers goes on across arrivals: with windows wider
    /// than the buffer a worker keeps, three workers still share the arrivals (before the
    /// fix the first worker took every arrival and goodput fell to 35%).
    #[test]
    fn workers_with_wide_windows_share_the_arrivals() {
        let mut a = args("fixed:200", 6_000, 1);
        a.workers = 3;
        a.slots = SlotCount::Fixed(2);
        a.prefetch = Some(32);
        a.deadline_ms = 3_000;
        let r = simulate(&a).unwrap();
        assert!(r.goodput > 0.95, "{r:?}");
    }

    /// A flood beside a light tenant through the product's lanes and fair share: the light
    /// tenant's jobs all finish; with one queue and plain EDF most of them do not.
    #[test]
    fn a_light_tenant_beside_a_flood_in_the_simulator() {
        let mut a = args("fixed:200", 10_000, 1);
        a.slots = SlotCount::Fixed(2);
        a.deadline_ms = 3_000;
        a.tenants = Some("flood:10,light:0.1".into());
        let light = |r: &SimReport| {
            r.tenants
                .iter()
                .find(|t| t.name == "light")
                .unwrap()
                .on_time_share
        };
        let now = simulate(&a).unwrap();
        assert!(light(&now) > 0.95, "{now:?}");
        a.lanes = 1;
        a.order = "edf".into();
        let before = simulate(&a).unwrap();
        assert!(light(&before) < 0.5, "{before:?}");
    }

    /// A kind whose first completed calls were long prompts must not refuse its short
    /// requests for good (with these seeds a lock-out gives about 12 of 20,000 on time).
    #[test]
    fn long_first_calls_do_not_lock_short_requests_out() {
        for (seed, slots) in [(2, 1), (2, 2), (1, 2)] {
            let mut a = args("length:50,2,0.3", 5_000, seed);
            a.slots = SlotCount::Fixed(slots);
            a.overload = 7.0;
            a.deadline_ms = 2_500;
            let r = simulate(&a).unwrap();
            assert!(r.on_time as f64 > 0.5 * a.jobs as f64, "{r:?}");
            assert!(r.wasted_time < 0.05, "{r:?}");
        }
    }

    /// A light tenant in the flood's one queue, against call times that grow with the
    /// prompt: its long prompts (600 tokens, a third of its jobs) are larger than any call
    /// the worker had completed when the flood began, and no slot is ever free at
    /// receipt. They wait judged without the extrapolated estimate and the first runs as a
    /// probe at its slot: the light tenant ≥ 95% on time on every seed (refused at receipt
    /// instead, every long prompt of seeds 1 and 4 is lost: about 70%), with no wasted
    /// call.
    #[test]
    fn longer_prompts_than_any_completed_are_learned_under_a_flood() {
        for seed in 1..=4 {
            let mut a = args("length:50,2,0.3", 20_000, seed);
            a.slots = SlotCount::Fixed(2);
            a.deadline_ms = 2_500;
            a.lanes = 1;
            a.tenants = Some("flood:10,light-5:0.1".into());
            let r = simulate(&a).unwrap();
            let light = r.tenants.iter().find(|t| t.name == "light-5").unwrap();
            assert!(light.on_time_share >= 0.95, "seed {seed}: {r:?}");
            assert!(r.wasted_time < 0.01, "seed {seed}: {r:?}");
        }
    }

    /// Workers of unequal speed (one 4× slower) at the capacity's load: with the default
    /// window the slow worker takes its share of deliveries and refuses at receipt what
    /// its own backlog cannot serve while the fast one idles; handing such a job back once
    /// while a peer has room (the default; `--no-pass-on` before) lets the fast one take it. Each job still has exactly
    /// one outcome (`simulate` fails otherwise) and no call starts late.
    #[test]
    fn unequal_workers_pass_refused_jobs_on() {
        let mut a = args("fixed:200", 20_000, 1);
        a.workers = 2;
        a.worker_slowdown = vec![1.0, 4.0];
        a.slots = SlotCount::Fixed(2);
        a.overload = 1.0;
        a.no_pass_on = true;
        let kept = simulate(&a).unwrap();
        a.no_pass_on = false;
        let passed = simulate(&a).unwrap();
        assert!(passed.passed_on > 0, "{passed:?}");
        assert!(passed.goodput >= 0.9, "{passed:?}");
        assert!(
            passed.goodput > kept.goodput + 0.1,
            "{kept:?} vs {passed:?}"
        );
        assert_eq!(kept.passed_on, 0);
    }

    /// Fairness in the simulator: 1,000 Zipf tenants over 3 workers at
    /// 5×, Jain's index over on-time ÷ max-min fair share ≥ 0.9 (0.82 with start-time
    /// fair queueing, whose rounds never ended while dropped jobs kept tenants behind).
    #[test]
    fn many_zipf_tenants_share_fairly() {
        let mut a = args("fixed:200", 60_000, 1);
        a.workers = 3;
        a.slots = SlotCount::Fixed(2);
        a.deadline_ms = 3_000;
        a.tenants = Some("zipf:1000".into());
        let r = simulate(&a).unwrap();
        assert!(r.jain.unwrap() >= 0.9, "{:?}", r.jain);
        assert!(r.goodput > 0.95, "{r:?}");
    }

    /// The most on-time completions of `a` with a fixed slot count of 1 to `max` (the
    /// reference `--slots auto` is held to); leaves `a.slots` at the last count tried.
    fn best_fixed(a: &mut SimArgs, max: usize) -> u64 {
        (1..=max)
            .map(|n| {
                a.slots = SlotCount::Fixed(n);
                simulate(a).unwrap().on_time
            })
            .max()
            .unwrap()
    }

    /// Against a batching server (throughput flat past 6 calls at the
    /// server), `--slots auto` is within 10% of the best fixed slot count at 2× and 5×, with
    /// ≤ 5% wasted model time and no late start.
    #[test]
    fn auto_slots_come_within_ten_percent_of_the_best_fixed_count() {
        for overload in [2.0, 5.0] {
            let mut a = args("length:50,2,0.3,0.15,6", 8_000, 1);
            a.overload = overload;
            a.deadline_ms = 2_500;
            let best = best_fixed(&mut a, 8);
            a.slots = SlotCount::Auto;
            let r = simulate(&a).unwrap();
            assert!(
                r.on_time as f64 >= 0.9 * best as f64,
                "{overload}×: {r:?} vs {best}"
            );
            assert!(r.wasted_time <= 0.05, "{r:?}");
            assert_eq!(r.started_late, 0);
            let (lo, hi) = r.limit_range.unwrap();
            assert!(lo >= 1 && hi <= 16 && hi > 2, "{r:?}");
        }
    }

    /// A server whose calls share one core (knee 1: `n` calls in flight each take `n`
    /// times as long) under mixed prompt lengths at 5×: a step up's predicted slowdown can
    /// refuse every job, and then no call ends to correct it; the refusals must end such a
    /// level, so auto stays within 10% of the best fixed count.
    #[test]
    fn auto_slots_are_not_locked_out_by_their_predicted_slowdown() {
        let mut a = args("mixed:900,3.5,0,1", 3_000, 3);
        a.deadline_ms = 10_000;
        let best = best_fixed(&mut a, 4);
        a.slots = SlotCount::Auto;
        let r = simulate(&a).unwrap();
        assert!(r.on_time as f64 >= 0.9 * best as f64, "{r:?} vs {best}");
        assert!(r.wasted_time <= 0.05, "{r:?}");
        assert_eq!(r.started_late, 0);
    }

    /// A short cold run (about 90 s of arrivals at 5×) on the time-sharing server with
    /// mixed prompt lengths: until the completed calls are enough for a quantile, a job
    /// with a few hundred ms of budget left (EDF hands it a free slot first) must not run
    /// as a probe of a call of seconds, to be cut at its deadline.
    #[test]
    fn cold_start_probes_need_room_for_what_smaller_calls_took() {
        let mut a = args("mixed:900,3.5,0,1", 180, 11);
        a.deadline_ms = 10_000;
        a.slots = SlotCount::Auto;
        let r = simulate(&a).unwrap();
        assert!(r.on_time >= 40, "{r:?}");
        assert!(r.wasted_time <= 0.25, "{r:?}");
        assert_eq!(r.started_late, 0);
    }

    /// Short cold runs (72 jobs at 2×, 180 at 5×: about 90 s) on the time-sharing server
    /// with mixed prompt lengths, the two seeds that wasted most: a 1,819-token prompt
    /// admitted at what one of 474 tokens took, probes of the longest prompts on a
    /// completed calls' mean, and the first step up admitted at a time-sharing slowdown
    /// measured against a size-blind first estimate (15.6% and 13.9% of the model time
    /// wasted before 2026-12-06).
    #[test]
    fn short_cold_runs_waste_little() {
        for (overload, jobs, seed) in [(2.0, 72, 4), (5.0, 180, 8)] {
            let mut a = args("mixed:900,3.5,0,1", jobs, seed);
            a.overload = overload;
            a.deadline_ms = 10_000;
            a.slots = SlotCount::Auto;
            let r = simulate(&a).unwrap();
            assert!(r.wasted_time <= 0.05, "{overload}×: {r:?}");
            assert!(r.on_time as f64 >= 0.25 * jobs as f64, "{overload}×: {r:?}");
            assert_eq!(r.started_late, 0);
        }
    }

    /// A server that does not slow down with concurrency: the limit climbs to the most.
    #[test]
    fn auto_slots_climb_against_a_server_that_does_not_slow_down() {
        let mut a = args("length:50,2,0.3,0", 8_000, 1);
        a.slots = SlotCount::Auto;
        a.max_slots = 8;
        a.deadline_ms = 2_500;
        let r = simulate(&a).unwrap();
        assert_eq!(r.limit_range.unwrap().1, 8, "{r:?}");
        assert!(r.mean_limit.unwrap() > 6.0, "{r:?}");
    }

    #[test]
    fn bad_arguments_name_the_flag() {
        let e = simulate(&args("gamma:1", 10, 1)).unwrap_err().to_string();
        assert!(e.contains("--service"), "{e}");
    }
}
