//! How long model calls take, learned per key, for the admission rule.
//!
//! The admission rule refuses a job whose remaining budget is below the minimum useful
//! runtime. A configured floor is a guess the user has to make and keep up to date; the
//! worker instead records the duration of every model call under a key the caller builds
//! (e.g. `"<kind>|<backend label>"`) and asks for a high quantile of the recent ones.
//!
//! # Design
//! - **An exact quantile over a small sliding window**, not a streaming sketch: sketches
//!   such as CKMS or t-digest summarize the whole stream and never forget, but a model
//!   gets slower or faster (load, a bigger model behind the same label, a restart) and the
//!   estimate has to follow it. An exact quantile over at most `window` samples (128 by
//!   default) is a sort of 128 numbers per estimate (about a microsecond), needs no
//!   dependency, and is easy to reason about.
//! - **p99 by default**: a call that takes longer than the budget it was admitted with is
//!   cancelled at the deadline, and its model time is wasted. Admitting with the p90 left
//!   one call in ten to be cancelled — the *longest* ones, so 10–18% of all model time with
//!   lognormal call times (σ = 0.6, `lastcall bench goodput`); the p99 (the second longest
//!   of the last 128 calls) wastes 1–8%, and under overload there is always a job with
//!   enough budget to take the place of one refused. BENCHMARKS.md has the measurements.
//! - **A lognormal fit beside it** (`fit`, on by default): the p99 of at most 128 samples
//!   is their largest or second largest, a noisy figure that sits near the p98 on average.
//!   Under overload every job starts with just the estimate left, so each call longer than
//!   the estimate is cut at the deadline, and its time (three times a mean call and more)
//!   is wasted: in `bench goodput` with lognormal calls (σ 0.6) the nearest rank alone cut
//!   1.3% of the calls and wasted 0–11% of the model time from run to run. So the
//!   estimator also fits a lognormal to the window (the mean and standard deviation of the
//!   log durations: every sample counts, so the fit is steadier) and reports the larger of
//!   the two quantiles. The fit never lowers the estimate, a constant stays exactly
//!   itself, and the fitted value is capped at [`FIT_CAP`] × the largest sample, since a
//!   window that is not lognormal at all (two kinds of call behind one key) or a few
//!   cold-start samples may extrapolate far.
//! - **Nearest rank**: the quantile is the `r(n) = ⌈q·n⌉`-th smallest of the `n` samples
//!   (1-based), so without the fit the estimate is always a duration that was observed.
//!   (`q·n` is taken with a 1e-9 tolerance so that `0.7 × 10`, which is
//!   `7.000000000000001` in floating point, gives rank 7.)
//! - **Following a change**: after `window` observations of a constant `v` the estimate
//!   is exactly `v`, whatever came before. A slowdown shows sooner: once the window is
//!   full, `k = W − r(W) + 1` (`= ⌊(1−q)·W⌋ + 1`) observations of a slower `b` bring the
//!   quantile to at least `b`, and `k − 1` do not
//!   ([`ServiceTimeConfig::slowdown_observations`]; 2 with the defaults `W = 128`,
//!   `q = 0.99`). With fewer samples in the window, `k` observations are still enough,
//!   because `n − r(n)` never decreases with `n`. (That is the nearest rank; the fit never
//!   lowers it, so it can only show a slowdown sooner.)
//! - **An age limit** (`max_age_ms`): a key not seen for ten minutes may run on a different
//!   backend now, and an estimate from then is no better than the configured floor.
//!   Samples older than the limit are ignored, and dropped at the next observation.
//! - **History can be replayed**: every observation carries its own time, so recorded
//!   calls fed in the order they happened give the estimate live observation would have
//!   given (the worker replays the ledger's recent calls when it starts, so a restart does
//!   not fall back to the floor); samples older than the age limit count for nothing.
//! - **A fallback over all keys**: a key with too few fresh samples (a new kind, a new
//!   backend) borrows the last `window` fresh observations of any key, which is a better
//!   guess than nothing. When even those are too few, [`ServiceTimes::estimate`] returns
//!   `None` and the caller uses its configured floor.
//! - **Bounded memory**: keys come from producers, so their number is bounded by
//!   `max_keys`; a new key beyond it evicts the key observed least recently. Each key
//!   holds at most `window` samples.
//! - **It cannot lock itself out.** A call cut at the deadline is a censored
//!   observation ([`ServiceTimes::observe_cut`]): counted at its duration, the lower
//!   bound. After a hang those cut calls lift the p99 above every budget, and then nothing
//!   runs, so nothing new is learned. So a job that the cut calls alone refuse (the
//!   completed ones would admit it) may run as a *probe* while a slot is free
//!   ([`ServiceTimes::try_probe`]); a probe that completes divides the weight of the cut
//!   calls it contradicts by 8 and takes them out of the fit, and wasted probes are paced
//!   to at most `probe_waste_share` (5%) of the time that passes beyond a burst of
//!   `probe_burst_ms` (8 s). A refusal that completed
//!   calls justify is never probed. Failed calls are never observed.
//! - **Recent calls weigh more**: a sample's weight halves every `half_life_ms` (60 s)
//!   of its age; the quantile is the weighted nearest rank, and the fit is weighted too.
//!   With equal weights (`half_life_ms = 0`) it is the plain nearest rank.
//! - **Cold start**: with fewer than `min_samples` calls of a key, its longest fresh call,
//!   ended or still running ([`ServiceTimes::call_started`]), is a lower bound
//!   ([`EstimateSource::LowerBound`]); with a fixed call time, at most one call per slot
//!   is cut before the estimate holds (property-tested). Until the request-aware fit holds,
//!   a request larger than every completed call is held to the estimate scaled by its size
//!   ([`Predictor::estimate`]), and a probe of it needs room for the line through the
//!   completed calls' sizes and times.
//! - **No clock**: like the rest of the crate, every function takes `now_ms`.

use crate::request_size::RequestSize;
use serde::{Deserialize, Serialize};
use std::collections::{HashMap, VecDeque};

/// The largest `window` accepted: beyond it the per-estimate sort stops being trivially
/// cheap, and a window that long follows a change of speed too slowly to be useful.
pub const MAX_WINDOW: usize = 1024;

/// The estimator's settings. [`ServiceTimes::new`] brings every value into its sane range
/// ([`ServiceTimeConfig::clamped`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ServiceTimeConfig {
    /// Samples kept per key (and in the all-keys fallback), in `1..=MAX_WINDOW`. It bounds
    /// memory and sets how fast the estimate follows a change of speed.
    pub window: usize,
    /// The quantile reported as the minimum useful runtime, in `(0, 1]`.
    pub quantile: f64,
    /// Fresh samples needed before a window's estimate is used, in `1..=window`.
    pub min_samples: usize,
    /// Samples older than this (`now_ms − observed_at > max_age_ms`) are ignored; at least 1.
    pub max_age_ms: i64,
    /// The most distinct keys kept; a new key beyond it evicts the key observed least
    /// recently. At least 1.
    pub max_keys: usize,
    /// Also fit a lognormal to the window and report the larger of the two quantiles (the
    /// fitted one at most [`FIT_CAP`] × the largest sample); see the module doc.
    pub fit: bool,
    /// A sample's weight halves every `half_life_ms` of its age (recent calls weigh
    /// more); 0: every fresh sample weighs the same.
    pub half_life_ms: i64,
    /// The share of one slot's time that probe calls which were cut or failed may take,
    /// in `(0, 1)`, beyond [`Self::probe_burst_ms`]: a key's probe credit grows by
    /// `share / (1 − share)` ms per ms that passes, up to the burst, and a wasted probe of
    /// `d` ms spends `d`; a probe needs credit left.
    pub probe_waste_share: f64,
    /// The probe credit a key holds at most (and starts with), in ms of wasted probe time:
    /// after a quiet spell, a few probes may be wasted at once on a server still hung (the
    /// first probes after a hang often are), so that the ones after them still find it
    /// recovered; over a long run the share bounds the waste.
    pub probe_burst_ms: u64,
    /// Probe calls of one key in flight at once; at least 1 (a worker has no more than
    /// its free slots).
    pub max_probes: u32,
    /// Keep each call's request size and estimate per request ([`ServiceTimes::estimate_for`],
    /// the default); `false`: ignore sizes, one estimate per key whatever the request (the
    /// estimator without the request's size, kept as the benchmark's reference).
    pub request_aware: bool,
}

/// The fitted quantile is never above this multiple of the largest sample: a fit to a
/// few samples, or to a window that is not lognormal at all, may extrapolate far.
pub const FIT_CAP: f64 = 2.0;

impl Default for ServiceTimeConfig {
    fn default() -> Self {
        Self {
            window: 128,
            quantile: 0.99,
            min_samples: 3,
            max_age_ms: 600_000,
            max_keys: 256,
            fit: true,
            half_life_ms: 60_000,
            probe_waste_share: 0.05,
            probe_burst_ms: 8_000,
            max_probes: 4,
            request_aware: true,
        }
    }
}

impl ServiceTimeConfig {
    /// The same settings brought into range: `window` in `1..=MAX_WINDOW`, `quantile` in
    /// `(0, 1]` (a NaN becomes the default 0.99), `min_samples` in `1..=window`,
    /// `max_age_ms ≥ 1`, `max_keys ≥ 1`, `half_life_ms ≥ 0`, `probe_waste_share` in
    /// `[0.001, 0.5]` (a NaN becomes the default), `max_probes ≥ 1`.
    pub fn clamped(self) -> Self {
        let d = Self::default();
        let window = self.window.clamp(1, MAX_WINDOW);
        let quantile = if self.quantile.is_nan() {
            d.quantile
        } else {
            self.quantile.clamp(f64::MIN_POSITIVE, 1.0)
        };
        let probe_waste_share = if self.probe_waste_share.is_nan() {
            d.probe_waste_share
        } else {
            self.probe_waste_share.clamp(0.001, 0.5)
        };
        Self {
            window,
            quantile,
            min_samples: self.min_samples.clamp(1, window),
            max_age_ms: self.max_age_ms.max(1),
            max_keys: self.max_keys.max(1),
            fit: self.fit,
            half_life_ms: self.half_life_ms.max(0),
            probe_waste_share,
            probe_burst_ms: self.probe_burst_ms,
            max_probes: self.max_probes.max(1),
            request_aware: self.request_aware,
        }
    }

    /// How many observations of a slower duration, arriving into a full window, bring the
    /// quantile up to it: `W − ⌈q·W⌉ + 1` (nearest rank, equal weights). One fewer does not.
    pub fn slowdown_observations(&self) -> usize {
        let c = self.clamped();
        c.window - nearest_rank(c.quantile, c.window) + 1
    }

    fn is_fresh(&self, observed_at_ms: i64, now_ms: i64) -> bool {
        now_ms.saturating_sub(observed_at_ms) <= self.max_age_ms
    }

    /// The recency weight of a sample observed at `at_ms`, at `now_ms`.
    fn recency(&self, at_ms: i64, now_ms: i64) -> f64 {
        if self.half_life_ms == 0 {
            return 1.0;
        }
        let age = now_ms.saturating_sub(at_ms).max(0) as f64;
        (-age / self.half_life_ms as f64).exp2()
    }
}

/// Which samples an [`Estimate`] was computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum EstimateSource {
    /// The key's own window.
    Key,
    /// The fallback: the last `window` observations of any key.
    AllKeys,
    /// Cold start: too few calls of the key ended to estimate, but one that ended, or one
    /// still running, took at least this long: a lower bound on the call time.
    LowerBound,
}

/// What is known about a key's call durations at some `now_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Estimate {
    /// The configured high quantile (p99 by default): the minimum useful runtime. The
    /// weighted nearest-rank quantile of the samples, or (with `fit`) the fitted
    /// lognormal's when that is larger; at cold start the lower bound.
    pub quantile_ms: u64,
    /// The weighted mean of the same samples, rounded to the nearest ms: for
    /// expected-wait computations ([`crate::wait::expected_wait_ms`]), which want a mean,
    /// not a bound.
    pub mean_ms: u64,
    /// How many fresh samples the estimate is over (at least `min_samples`, except for a
    /// lower bound).
    pub samples: usize,
    /// Whether the key's own window, the all-keys fallback or a cold-start bound was used.
    pub source: EstimateSource,
}

impl Estimate {
    /// This estimate for a call `k` times slower (the predicted slowdown at the adaptive
    /// limit's level): the quantile and the mean scaled, rounded up; unchanged at `k ≤ 1`.
    pub fn inflated(self, k: f64) -> Estimate {
        if k <= 1.0 {
            return self;
        }
        Estimate {
            quantile_ms: (self.quantile_ms as f64 * k).ceil() as u64,
            mean_ms: (self.mean_ms as f64 * k).ceil() as u64,
            ..self
        }
    }

    /// The ledger note of a refusal that this estimate decided (a reason for which
    /// [`crate::Reason::is_learned_refusal`] holds): which estimate it was, so that an operator
    /// can see why a job with budget left was not started. `None` for any other outcome.
    pub fn refusal_note(&self, reason: Option<&crate::Reason>) -> Option<String> {
        reason
            .is_some_and(crate::Reason::is_learned_refusal)
            .then(|| {
                format!(
                    "learned call duration for this kind: p99 {} ms, mean {} ms over {} calls ({})",
                    self.quantile_ms,
                    self.mean_ms,
                    self.samples,
                    match self.source {
                        EstimateSource::Key => "this kind",
                        EstimateSource::AllKeys => "all kinds, none yet of this one",
                        EstimateSource::LowerBound =>
                            "too few calls yet: the longest so far, ended or running",
                    }
                )
            })
    }
}

/// The request-aware estimate of one key at one instant ([`ServiceTimes::predictor`]).
/// A worker publishes its predictor of each kind in its lease
/// ([`crate::live::WorkerLive::call_models`]), so that a peer can tell how long a request
/// of a given size would take there.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Predictor {
    base: Option<Estimate>,
    fit: Option<SizedFit>,
    /// Before the fit holds: the largest request (the sum of its features) among the
    /// key's fresh calls, when every one of them has a known size.
    cold_largest: Option<f64>,
    /// The key's calibration ([`ServiceTimes::calibration`]): what puts a request's
    /// measured prompt tokens in the fit's unit (`None`: the measure is that unit).
    k: Option<Calibration>,
}

#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct SizedFit {
    model: CallModel,
    /// The quantile and the weighted mean of observed ÷ predicted.
    q: f64,
    mean: f64,
    samples: usize,
    /// The largest of each feature, and of their sum, among the completed calls.
    seen: [f64; 2],
    largest: f64,
}

/// How long a caller may keep a [`Predictor`] whose key's [`ServiceTimes::revision`] has not
/// changed: the recency weights and the age limit move little in that time.
pub const PREDICTOR_REUSE_MS: i64 = 100;

impl Predictor {
    /// Where the key's estimate comes from (`None`: nothing is known).
    pub fn base_source(&self) -> Option<EstimateSource> {
        self.base.map(|e| e.source)
    }

    /// Whether the request-aware fit holds ([`MIN_SIZED`] completed calls of known size):
    /// [`Self::estimate`] then depends on the request's size.
    pub fn is_request_aware(&self) -> bool {
        self.fit.is_some()
    }

    /// The estimate for a request of `size` ([`ServiceTimes::estimate_for`]).
    pub fn estimate(&self, size: Option<RequestSize>) -> Option<Estimate> {
        let Some(size) = size else {
            return self.base;
        };
        let job = Calibration::measured(self.k, size.features());
        let Some(f) = self.fit else {
            // Before the fit holds, a request larger than every call the estimate rests
            // on is held to their time scaled in proportion to its size (through the
            // origin from the largest: an overestimate when there is a fixed cost, as
            // below). Without it, at a cold start a prompt of 1,819 tokens was admitted
            // at the 2.6 s that one of 474 tokens took, and cut at 6.5 s.
            return match (self.base, self.cold_largest) {
                (Some(b), Some(largest)) if job[0] + job[1] > largest => {
                    let scale = (job[0] + job[1] + 1.0) / (largest + 1.0);
                    Some(Estimate {
                        quantile_ms: (b.quantile_ms as f64 * scale).ceil() as u64,
                        mean_ms: (b.mean_ms as f64 * scale).round() as u64,
                        ..b
                    })
                }
                (b, _) => b,
            };
        };
        let predicted = f.model.predict(job);
        let e = Estimate {
            quantile_ms: (predicted * f.q - 1e-6).ceil().max(0.0) as u64,
            mean_ms: (predicted * f.mean).round().max(0.0) as u64,
            samples: f.samples,
            source: EstimateSource::Key,
        };
        // Larger than every completed call the fit saw: the fit cannot tell, so the
        // estimate is at least the kind's, scaled in proportion to the size (a call time
        // through the origin from the largest size seen: an overestimate when there is a
        // fixed cost). A refusal that rests on it may be probed.
        if job[0] > f.seen[0] || job[1] > f.seen[1] {
            let scale = ((job[0] + job[1] + 1.0) / (f.largest + 1.0)).max(1.0);
            return Some(self.base.map_or(e, |b| {
                Estimate {
                    quantile_ms: e
                        .quantile_ms
                        .max((b.quantile_ms as f64 * scale).ceil() as u64),
                    mean_ms: e.mean_ms.max((b.mean_ms as f64 * scale).round() as u64),
                    ..e
                }
            }));
        }
        Some(e)
    }
}

/// The [`Predictor`] of each key, kept while the estimator's [`ServiceTimes::revision`]
/// holds and for at most [`PREDICTOR_REUSE_MS`]: a worker asks for a job's learned time at
/// each of its gates, and a fit sorts and fits the key's window. A cold-start bound
/// (`LowerBound`: it follows the running calls' elapsed time) is never kept. Bounded: it
/// forgets everything when `max_keys` would be passed.
#[derive(Debug, Clone, Default)]
pub struct PredictorCache {
    kept: HashMap<String, (u64, i64, Predictor)>,
}

impl PredictorCache {
    /// The predictor of `key` at `now_ms`: the kept one when still valid, else a fresh one.
    pub fn get(&mut self, service: &ServiceTimes, key: &str, now_ms: i64) -> Predictor {
        let revision = service.revision();
        if let Some(&(r, at, p)) = self.kept.get(key)
            && r == revision
            && (at..at + PREDICTOR_REUSE_MS).contains(&now_ms)
        {
            return p;
        }
        let p = service.predictor(key, now_ms);
        if p.base_source() == Some(EstimateSource::LowerBound) {
            self.kept.remove(key);
        } else {
            if self.kept.len() >= service.cfg.max_keys {
                self.kept.clear();
            }
            self.kept.insert(key.to_owned(), (revision, now_ms, p));
        }
        p
    }
}

/// How a probe call ([`ServiceTimes::try_probe`]) ended, for [`ServiceTimes::probe_ended`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProbeEnd {
    /// It finished within `budget_ms`, the budget it was started with (one the learned
    /// estimate refused).
    Completed { budget_ms: u64 },
    /// It was cut at the deadline, or failed, after `duration_ms` of model time.
    Wasted { duration_ms: u64 },
    /// It never reached the model (refused for another reason, cancelled, shut down).
    Released,
}

impl ProbeEnd {
    /// How a probe call that was started with `budget_ms` and ended with `result` after
    /// `duration_ms` of model time ended: completed (within its budget: the learned time
    /// that refused it was stale), wasted (cut at the deadline or failed: model time spent
    /// for nothing), or released (cancelled: it says nothing of the estimate).
    pub fn of(result: &crate::CallResult, budget_ms: u64, duration_ms: u64) -> Self {
        match result {
            crate::CallResult::Completed => ProbeEnd::Completed { budget_ms },
            crate::CallResult::DeadlineExceeded | crate::CallResult::Failed { .. } => {
                ProbeEnd::Wasted { duration_ms }
            }
            crate::CallResult::Cancelled => ProbeEnd::Released,
        }
    }
}

/// A call in flight ([`ServiceTimes::call_started`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct CallToken(u64);

#[derive(Debug, Clone, Copy)]
struct Sample {
    at_ms: i64,
    duration_ms: u64,
    /// Cut at the deadline: the call time is at least `duration_ms` (censored).
    cut: bool,
    /// The request's size as measured before the call ([`RequestSize::features`]), when
    /// known.
    size: Option<[f64; 2]>,
    /// The prompt tokens the call used as counted after it (the server's `usage`, or the
    /// model's tokenizer), when known: the unit the fit takes ([`Sample::x`]).
    used: Option<f64>,
    /// How many completed probes showed since that calls fit in less: the weight is
    /// multiplied by `2^-halvings`.
    halvings: u8,
}

impl Sample {
    /// The features the fit takes for this call under the key's calibration `k`
    /// ([`ServiceTimes::calibration`]): the prompt tokens it used when they were counted,
    /// else its measure before the call × `k`; its measure alone when the key's counts are
    /// not used (`k` is `None`).
    fn x(&self, k: Option<Calibration>) -> Option<[f64; 2]> {
        match (k, self.used, self.size) {
            (None, _, s) => s,
            (Some(_), Some(u), s) => Some([u, s.map_or(0.0, |s| s[1])]),
            (Some(k), None, Some(s)) => Some(k.apply(s)),
            (Some(_), None, None) => None,
        }
    }

    /// The features a prediction before the call had: its measure under `k` (as for
    /// [`Self::x`]), else (a call known only by the tokens it used) [`Self::x`].
    fn x_before(&self, k: Option<Calibration>) -> Option<[f64; 2]> {
        (self.size.map(|s| Calibration::measured(k, s))).or_else(|| self.x(k))
    }
}

/// How closely the counted tokens must follow the measure (their weighted correlation,
/// when the measure varies) to be used: a server whose count does not grow with the
/// prompt (a fixed or a missing count) says nothing of the request's size.
const MIN_COUNT_CORRELATION: f64 = 0.5;

/// The calibration's bounds on its scale: a measure before the call that is off by more
/// than this factor from the counted tokens is not an approximation of them.
const CALIBRATION_BOUNDS: (f64, f64) = (1.0 / 16.0, 16.0);

/// The counted prompt tokens as a function of the measure before the call
/// ([`ServiceTimes::calibration`]): `offset + scale × measure`, at least 0. An offset,
/// because a server's count includes what its chat template adds (a default system prompt:
/// 30 tokens for SmolLM2's), which the measure does not see.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub(crate) struct Calibration {
    offset: f64,
    scale: f64,
}

impl Calibration {
    /// `features` measured before a call in the fit's unit under a key's calibration `k`
    /// (`None`: the measure is that unit).
    fn measured(k: Option<Calibration>, features: [f64; 2]) -> [f64; 2] {
        k.unwrap_or(Calibration::IDENTITY).apply(features)
    }

    /// The measure is the count.
    const IDENTITY: Calibration = Calibration {
        offset: 0.0,
        scale: 1.0,
    };

    /// `features` measured before a call, in the count's unit.
    fn apply(&self, features: [f64; 2]) -> [f64; 2] {
        [
            (self.offset + self.scale * features[0]).max(0.0),
            features[1],
        ]
    }
}

/// A completed probe halves the weight of each cut call it contradicts this many times
/// (divides it by 8).
const PROBE_HALVINGS: u8 = 3;

/// A weight below this no longer counts (2^-40): the sample is as good as forgotten.
const FORGOTTEN: f64 = 1e-12;

#[derive(Debug, Clone)]
struct KeyWindow {
    samples: VecDeque<Sample>,
    /// The estimator's observation counter at this key's last observation: a counter, not
    /// `now_ms`, so that least-recently-observed is well defined even if the clock steps back.
    last_seen: u64,
    /// Calls in flight: token → started at.
    running: HashMap<u64, i64>,
    probes: u32,
    /// Probe credit, ms of wasted probe time, as of `credit_at_ms` (`None`: full).
    credit: Option<(f64, i64)>,
}

impl KeyWindow {
    fn new(last_seen: u64, window: usize) -> Self {
        Self {
            samples: VecDeque::with_capacity(window),
            last_seen,
            running: HashMap::new(),
            probes: 0,
            credit: None,
        }
    }
}

/// Learned call durations per key, with a fallback over all keys. Pure: no IO, no clock.
#[derive(Debug, Clone)]
pub struct ServiceTimes {
    cfg: ServiceTimeConfig,
    keys: HashMap<String, KeyWindow>,
    all: VecDeque<Sample>,
    observations: u64,
    tokens: u64,
    /// Bumped by every change to what [`Self::predictor`] computes from (a call recorded,
    /// cut calls reweighted by a probe): [`Self::revision`].
    revision: u64,
}

impl ServiceTimes {
    /// An estimator that knows nothing yet; `cfg` is clamped ([`ServiceTimeConfig::clamped`]).
    pub fn new(cfg: ServiceTimeConfig) -> Self {
        let cfg = cfg.clamped();
        Self {
            cfg,
            keys: HashMap::new(),
            all: VecDeque::with_capacity(cfg.window),
            observations: 0,
            tokens: 0,
            revision: 0,
        }
    }

    /// A number that changes whenever the recorded calls do: a [`Predictor`] made at one
    /// revision stays the one [`Self::predictor`] would make, but for the time that passed
    /// (the calls' recency weights and age limit, which move slowly) and for the running
    /// calls of a cold-start bound ([`Predictor::base_source`] `LowerBound`). A caller that
    /// estimates many requests keeps one per key while the revision holds, as the worker
    /// does for up to [`PREDICTOR_REUSE_MS`].
    pub fn revision(&self) -> u64 {
        self.revision
    }

    /// The settings in use, after clamping.
    pub fn config(&self) -> ServiceTimeConfig {
        self.cfg
    }

    /// Record one completed call of `duration_ms` under `key`, observed at `now_ms`.
    ///
    /// A call cut at the deadline goes to [`Self::observe_cut`]. A call that failed on the
    /// server's side (connect error, 5xx, 429, reset) says nothing about how long a useful
    /// call takes: do not record it.
    pub fn observe(&mut self, key: &str, duration_ms: u64, now_ms: i64) {
        self.push_sample(key, duration_ms, false, None, None, now_ms);
    }

    /// Record one call of a request of `size` (completed, or `cut` at the deadline), for
    /// the request-aware estimate ([`Self::estimate_for`]); it counts in the per-key
    /// estimate as [`Self::observe`] / [`Self::observe_cut`] do.
    pub fn observe_request(
        &mut self,
        key: &str,
        duration_ms: u64,
        cut: bool,
        size: Option<RequestSize>,
        now_ms: i64,
    ) {
        self.observe_counted(key, duration_ms, cut, size, None, now_ms);
    }

    /// [`Self::observe_request`], with the prompt tokens the call used as counted after it
    /// (`used_prompt_tokens`: the server's `usage`, or the model's tokenizer), when known.
    /// The request-aware fit then takes the counted tokens, and predicts a new request from
    /// its measure (`size`, read before the call) put in the count's unit by the key's
    /// calibration: the counted tokens as a line in the measure over its recent calls
    /// ([`Self::calibration`]). The error quantile stays the one of predictions from the
    /// measure, so the measure's own error is in it. When every call's count equals its
    /// measure (a tokenizer's count), or is any constant multiple of it, the estimate is
    /// [`Self::observe_request`]'s.
    pub fn observe_counted(
        &mut self,
        key: &str,
        duration_ms: u64,
        cut: bool,
        size: Option<RequestSize>,
        used_prompt_tokens: Option<u64>,
        now_ms: i64,
    ) {
        let size = size.map(|s| s.features());
        // A count of 0 is no count (a streamed reply without usage).
        let used = used_prompt_tokens.filter(|&u| u > 0).map(|u| u as f64);
        self.push_sample(key, duration_ms, cut, size, used, now_ms);
    }

    /// Record one call under `key` that was cut at the deadline after `duration_ms`: a
    /// *censored* observation, the call time is at least that. It counts in the quantile at
    /// that duration (the lower bound: leaving it out would hide a model that got slower
    /// than every budget); a refusal that rests on such observations alone may be probed
    /// ([`Self::try_probe`]), and a probe that completes contradicts them.
    pub fn observe_cut(&mut self, key: &str, duration_ms: u64, now_ms: i64) {
        self.push_sample(key, duration_ms, true, None, None, now_ms);
    }

    fn push_sample(
        &mut self,
        key: &str,
        duration_ms: u64,
        cut: bool,
        size: Option<[f64; 2]>,
        used: Option<f64>,
        now_ms: i64,
    ) {
        let size = size.filter(|_| self.cfg.request_aware);
        let used = used.filter(|_| self.cfg.request_aware);
        self.observations += 1;
        self.revision += 1;
        let sample = Sample {
            at_ms: now_ms,
            duration_ms,
            cut,
            size,
            used,
            halvings: 0,
        };
        push(&mut self.all, sample, &self.cfg);
        let (seen, cfg) = (self.observations, self.cfg);
        let w = self.window_mut(key, seen);
        push(&mut w.samples, sample, &cfg);
        w.last_seen = seen;
    }

    /// The window of `key`, made (evicting the key observed least recently when full).
    fn window_mut(&mut self, key: &str, seen: u64) -> &mut KeyWindow {
        if !self.keys.contains_key(key) {
            if self.keys.len() >= self.cfg.max_keys {
                let oldest = self
                    .keys
                    .iter()
                    .min_by_key(|(_, w)| w.last_seen)
                    .map(|(k, _)| k.clone());
                if let Some(oldest) = oldest {
                    self.keys.remove(&oldest);
                }
            }
            self.keys
                .insert(key.to_owned(), KeyWindow::new(seen, self.cfg.window));
        }
        self.keys.get_mut(key).expect("inserted above")
    }

    /// A call of `key` starts at `now_ms`: while it runs, its elapsed time is a lower bound
    /// on the call time for a key with too few ended calls (cold start). End it with
    /// [`Self::call_ended`].
    pub fn call_started(&mut self, key: &str, now_ms: i64) -> CallToken {
        self.tokens += 1;
        let token = self.tokens;
        let seen = self.observations;
        self.window_mut(key, seen).running.insert(token, now_ms);
        CallToken(token)
    }

    /// The call of `token` has ended (record its duration with [`Self::observe`]).
    pub fn call_ended(&mut self, key: &str, token: CallToken) {
        if let Some(w) = self.keys.get_mut(key) {
            w.running.remove(&token.0);
        }
    }

    /// The estimate for `key` at `now_ms`: from its own window when that holds at least
    /// `min_samples` fresh samples; else the larger of the all-keys fallback (the last
    /// `window` fresh observations of any key, when at least `min_samples`) and the key's
    /// cold-start lower bound (its longest fresh call, ended or cut, and the elapsed time
    /// of its calls still running); `None` when neither exists: nothing learned, and the
    /// caller uses its configured floor.
    pub fn estimate(&self, key: &str, now_ms: i64) -> Option<Estimate> {
        let own = self.keys.get(key);
        if let Some(e) =
            own.and_then(|w| self.summarize(&w.samples, now_ms, EstimateSource::Key, true))
        {
            return Some(e);
        }
        let all = self.summarize(&self.all, now_ms, EstimateSource::AllKeys, true);
        let bound = own.and_then(|w| self.lower_bound(w, now_ms));
        match (all, bound) {
            (Some(a), Some(b)) if b.quantile_ms > a.quantile_ms => Some(Estimate {
                quantile_ms: b.quantile_ms,
                ..a
            }),
            (Some(a), _) => Some(a),
            (None, b) => b,
        }
    }

    /// The estimate for a request of `size` of `key` at `now_ms`: when the
    /// key's own window holds at least [`MIN_SIZED`] fresh completed calls of known size,
    /// the call time is fitted as `a + b·prompt_tokens + c·max_tokens` (weighted least
    /// squares over the completed calls; `b, c ≥ 0`, so the estimate never falls as the
    /// request grows; a size that never varies drops out), and the estimate is that
    /// prediction × the configured quantile of the observed ÷ predicted ratios (weighted,
    /// cut calls at their lower bound, and with the lognormal fit as for durations).
    /// With every request of one size it is the per-key [`Self::estimate`] (to a
    /// millisecond of rounding). Otherwise (no size, too few sized calls, a cold start or a
    /// fallback) it is [`Self::estimate`].
    pub fn estimate_for(
        &self,
        key: &str,
        size: Option<RequestSize>,
        now_ms: i64,
    ) -> Option<Estimate> {
        self.predictor(key, now_ms).estimate(size)
    }

    /// [`Self::estimate_for`] without the fallback over all keys: what `key`'s own calls
    /// say (its window, else its cold-start lower bound), `None` when it has none. For the
    /// backends of a fallback route: another backend's calls of the same kind say nothing
    /// about this one (a hosted API is not as slow as a local GPU, and borrowing the slow
    /// one's calls would keep a job from the fast one).
    pub fn own_estimate_for(
        &self,
        key: &str,
        size: Option<RequestSize>,
        now_ms: i64,
    ) -> Option<Estimate> {
        let own = self.keys.get(key)?;
        match self.summarize(&own.samples, now_ms, EstimateSource::Key, true) {
            Some(_) => self.estimate_for(key, size, now_ms),
            None => self.lower_bound(own, now_ms),
        }
    }

    /// What [`Self::estimate_for`] computes for every request of `key` at `now_ms`, fitted
    /// once: [`Predictor::estimate`] then costs a few multiplications per request (a
    /// caller that estimates many requests between observations keeps it).
    pub fn predictor(&self, key: &str, now_ms: i64) -> Predictor {
        let base = self.estimate(key, now_ms);
        let k = self.keys.get(key).and_then(|w| self.calibration(w, now_ms));
        let fit = match (self.keys.get(key), base.map(|e| e.source)) {
            (Some(w), Some(EstimateSource::Key)) => self.sized(w, k, now_ms, false),
            _ => None,
        };
        let cold_largest = match (self.keys.get(key), base.map(|e| e.source)) {
            (Some(w), Some(EstimateSource::Key | EstimateSource::LowerBound))
                if fit.is_none() && self.cfg.request_aware =>
            {
                // Completed calls only: a cut call's time is a lower bound (and one a
                // probe contradicted hardly counts in the base).
                let fresh = || (w.samples.iter()).filter(|s| self.cfg.is_fresh(s.at_ms, now_ms));
                fresh()
                    .all(|s| s.x(k).is_some())
                    .then(|| {
                        fresh()
                            .filter(|s| !s.cut && s.halvings == 0)
                            .filter_map(|s| s.x_before(k).map(|f| f[0] + f[1]))
                            .fold(None, |m: Option<f64>, x| Some(m.map_or(x, |m| m.max(x))))
                    })
                    .flatten()
            }
            _ => None,
        };
        Predictor {
            base,
            fit,
            cold_largest,
            k,
        }
    }

    /// A key's calibration at `now_ms`: the prompt tokens its fresh calls used as counted
    /// after them, as a line in their measure before them (recency-weighted least
    /// squares over the calls that have both: `offset + scale × measure`; through the
    /// origin, Σ counted ÷ Σ measured, while the measure does not vary); the identity when
    /// none has both. A request's measured prompt tokens under it are in the fit's unit
    /// ([`Sample::x`]). `None` when the counts do not follow the measure (a weighted
    /// correlation below [`MIN_COUNT_CORRELATION`] while the measure varies): the key's
    /// counts are then not used, and the fit takes the measure.
    fn calibration(&self, w: &KeyWindow, now_ms: i64) -> Option<Calibration> {
        // (measure, count, weight)
        let pairs: Vec<(f64, f64, f64)> = (w.samples.iter())
            .filter(|s| self.cfg.is_fresh(s.at_ms, now_ms))
            .filter_map(|s| {
                let (u, f) = (s.used?, s.size?);
                Some((f[0], u, self.cfg.recency(s.at_ms, now_ms)))
            })
            .collect();
        let total: f64 = pairs.iter().map(|p| p.2).sum();
        let measured: f64 = pairs.iter().map(|p| p.2 * p.0).sum();
        let used: f64 = pairs.iter().map(|p| p.2 * p.1).sum();
        // Counts equal to the measure (the local model's tokenizer): exactly the identity,
        // not a fitted line a rounding error away from it.
        if pairs.is_empty() || measured <= 0.0 || used <= 0.0 || pairs.iter().all(|p| p.0 == p.1) {
            return Some(Calibration::IDENTITY);
        }
        let (mm, mu) = (measured / total, used / total);
        let var_m: f64 = pairs.iter().map(|p| p.2 * (p.0 - mm).powi(2)).sum();
        let var_u: f64 = pairs.iter().map(|p| p.2 * (p.1 - mu).powi(2)).sum();
        let cov: f64 = pairs.iter().map(|p| p.2 * (p.0 - mm) * (p.1 - mu)).sum();
        let (lo, hi) = CALIBRATION_BOUNDS;
        if var_m <= 1e-9 * total * mm * mm.max(1.0) {
            // One size measured: its count ÷ its measure.
            let scale = (used / measured).clamp(lo, hi);
            return Some(Calibration { offset: 0.0, scale });
        }
        if var_u <= 0.0 || cov / (var_m * var_u).sqrt() < MIN_COUNT_CORRELATION {
            return None;
        }
        let scale = (cov / var_m).clamp(lo, hi);
        Some(Calibration {
            offset: mu - scale * mm,
            scale,
        })
    }

    /// The request-aware fit of a key's window, when it has enough sized calls.
    /// `completed_only`: without the cut calls (their times are lower bounds; after a
    /// hang they are what a probe is to contradict).
    /// `k`: the key's [`Self::calibration`] at `now_ms`.
    fn sized(
        &self,
        w: &KeyWindow,
        k: Option<Calibration>,
        now_ms: i64,
        completed_only: bool,
    ) -> Option<SizedFit> {
        // (size, duration, weight, cut, contradicted, size as predicted before the call)
        type Row = ([f64; 2], f64, f64, bool, bool, [f64; 2]);
        let rows: Vec<Row> = (w.samples.iter())
            .filter(|s| self.cfg.is_fresh(s.at_ms, now_ms))
            .filter(|s| !(completed_only && s.cut))
            .filter_map(|s| {
                let wt = self.cfg.recency(s.at_ms, now_ms) * (-f64::from(s.halvings)).exp2();
                Some((
                    s.x(k)?,
                    s.duration_ms.max(1) as f64,
                    wt,
                    s.cut,
                    s.halvings > 0,
                    s.x_before(k)?,
                ))
            })
            .collect();
        // The fit takes the cut calls at their lower bound too: under overload the large
        // requests that run may all be cut, and without them the fit would see only
        // small ones and predict a large one small.
        let fit_rows: Vec<FitRow> = (rows.iter())
            .filter(|r| !r.4 && r.2 > FORGOTTEN)
            .map(|r| (r.0, r.1, r.2))
            .collect();
        let completed = rows.iter().filter(|r| !r.3 && !r.4).count();
        if completed < MIN_SIZED.max(self.cfg.min_samples) {
            return None;
        }
        let model = CallModel::fit(&fit_rows);
        // The range a request is compared with is in the unit it is predicted from: the
        // calls' sizes as measured before them (a noisy measure of a long prompt is
        // larger than the count of any call half the time, and would be held to the
        // kind's time as "larger than every call seen").
        let seen = |i: usize| {
            (rows.iter().filter(|r| !r.3 && !r.4))
                .map(|r| r.5[i])
                .fold(f64::MIN, f64::max)
        };
        let largest = (rows.iter().filter(|r| !r.3 && !r.4))
            .map(|r| r.5[0] + r.5[1])
            .fold(0.0, f64::max);
        // The error of the prediction made before the call (from the measure, when the fit
        // takes the counted tokens): the measure's own error is in the quantile.
        let mut ratios: Vec<(f64, f64, bool)> = (rows.iter())
            .map(|r| (r.1 / model.predict(r.5), r.2, r.4))
            .collect();
        ratios.sort_unstable_by(|a, b| a.0.total_cmp(&b.0));
        let total: f64 = ratios.iter().map(|r| r.1).sum();
        let ranked: Vec<(f64, f64)> = ratios.iter().map(|r| (r.0, r.1)).collect();
        let empirical = weighted_rank(&ranked, self.cfg.quantile, total);
        let counted: Vec<(f64, f64)> = (ratios.iter())
            .filter(|r| r.1 > FORGOTTEN && !r.2)
            .map(|r| (r.0, r.1))
            .collect();
        let q = match self
            .cfg
            .fit
            .then(|| lognormal_quantile_f(&counted, self.cfg.quantile))
        {
            Some(Some(f)) => {
                let largest = counted.iter().map(|r| r.0).fold(0.0, f64::max);
                empirical.max(f.min(largest * FIT_CAP))
            }
            _ => empirical,
        };
        let mean = ratios.iter().map(|r| r.0 * r.1).sum::<f64>() / total;
        Some(SizedFit {
            model,
            q,
            mean,
            samples: rows.len(),
            seen: [seen(0), seen(1)],
            largest,
        })
    }

    /// The cold-start bound of a key's window: its longest fresh call (ended or cut) and the
    /// longest elapsed time of its running calls.
    fn lower_bound(&self, w: &KeyWindow, now_ms: i64) -> Option<Estimate> {
        let fresh: Vec<u64> = (w.samples.iter())
            .filter(|s| self.cfg.is_fresh(s.at_ms, now_ms))
            .map(|s| s.duration_ms)
            .collect();
        let running = (w.running.values())
            .map(|&t| u64::try_from(now_ms.saturating_sub(t)).unwrap_or(0))
            .max();
        let bound = fresh.iter().copied().chain(running).max()?;
        let mean = match fresh.len() {
            0 => bound,
            n => fresh.iter().sum::<u64>() / n as u64,
        };
        Some(Estimate {
            quantile_ms: bound,
            mean_ms: mean,
            samples: fresh.len(),
            source: EstimateSource::LowerBound,
        })
    }

    /// The estimate of `key` from its completed calls alone (cut calls left out): what a
    /// call takes when the server answers. The circuit breaker ([`crate::breaker`]) calls a
    /// cut call a hang when its budget was far past this.
    pub fn completed_estimate(&self, key: &str, now_ms: i64) -> Option<Estimate> {
        (self.keys.get(key))
            .and_then(|w| self.summarize(&w.samples, now_ms, EstimateSource::Key, false))
    }

    /// A job of `key` with `room_ms` for its call is refused by the learned estimate alone
    /// although a slot is free: may it run as a *probe* (half-open), to find out whether
    /// the estimate is stale? Only when the refusal rests on calls cut at the deadline, or
    /// on calls of larger requests than this one (`size`): the completed calls no larger
    /// than it, if enough, would admit it (cut calls are censored observations), and the
    /// mean their request-aware fit predicts for this size fits in the room, when
    /// no call of the key has been running for over `FIT_CAP` × what the completed calls
    /// take (the server looks stuck now), when fewer than `max_probes` probes of the key
    /// are in flight, and when the waste pacing allows one at `now_ms`. The caller then admits the job without the learned estimate
    /// (its other checks still apply) and reports its end with [`Self::probe_ended`].
    /// Without probes, an estimate inflated by a hang refuses every job, and nothing new
    /// is ever learned. A refusal that completed calls justify is never probed: the
    /// promise not to start what cannot finish holds for it.
    pub fn try_probe(
        &mut self,
        key: &str,
        size: Option<RequestSize>,
        room_ms: u64,
        now_ms: i64,
    ) -> bool {
        if !self.may_probe(key, size, room_ms, now_ms) {
            return false;
        }
        let max = self.cfg.max_probes;
        let seen = self.observations;
        let credit = self.credit(key, now_ms);
        let w = self.window_mut(key, seen);
        if w.probes >= max || credit <= 0.0 {
            return false;
        }
        w.probes += 1;
        true
    }

    /// Whether a refusal of a job of `key` with `room_ms` for its call, by the learned
    /// estimate alone, is one a probe may question: every check of [`Self::try_probe`] but
    /// the probes in flight and the pacing, which take nothing here. A worker with no
    /// free slot at receipt keeps such a job waiting, judged without the estimate, and
    /// tries the probe when it gets a slot: under a sustained flood no slot is ever free
    /// at receipt, and a request larger than every completed one (refused on the
    /// through-origin extrapolation) would otherwise be refused for good, never learned.
    pub fn may_probe(
        &self,
        key: &str,
        size: Option<RequestSize>,
        room_ms: u64,
        now_ms: i64,
    ) -> bool {
        let completed = (self.keys.get(key))
            .and_then(|w| self.summarize(&w.samples, now_ms, EstimateSource::Key, false));
        // Only the completed calls no larger than this request can justify its refusal:
        // calls of larger requests say nothing of a smaller one's time, and before the
        // request-aware fit holds ([`MIN_SIZED`] sized calls) a kind whose first calls were
        // long would otherwise refuse its short requests for good, learning nothing.
        // Without request-awareness every request is judged as the kind's.
        let size = size.filter(|_| self.cfg.request_aware);
        let k = (self.keys.get(key)).and_then(|w| self.calibration(w, now_ms));
        let job = size.map(|s| Calibration::measured(k, s.features()));
        let justified = match job {
            None => completed,
            Some(job) => (self.keys.get(key)).and_then(|w| {
                let no_larger: VecDeque<Sample> = (w.samples.iter())
                    .filter(|s| {
                        s.x_before(k)
                            .is_none_or(|f| f[0] <= job[0] && f[1] <= job[1])
                    })
                    .copied()
                    .collect();
                self.summarize(&no_larger, now_ms, EstimateSource::Key, false)
            }),
        };
        if justified.is_some_and(|e| e.quantile_ms > room_ms) {
            return false;
        }
        // Nor when the completed calls' own fit expects this request, on average, to take
        // longer than the room: a request larger than every completed one is refused on an
        // extrapolation, but when even the fit's mean (not its high quantile) does not fit,
        // the probe would almost surely be cut, its time wasted.
        if let (Some(job), Some(w)) = (job, self.keys.get(key))
            && self
                .completed_mean_for(w, k, job, now_ms)
                .is_some_and(|m| m > room_ms as f64)
        {
            return false;
        }
        // Nor when the completed calls' request-aware fit (its high quantile, not the through-origin
        // floor for requests larger than any seen) does not fit the room, for a request
        // above some completed call (below all of them the fit only extrapolates down, and
        // says nothing). The mean alone let through probes of the longest prompts that
        // the completed calls, mostly short and fast, underestimated: in the simulator's
        // cold runs a 1,611-token probe was cut at 9.9 s after 13 s of call, one probe
        // a tenth of a short run's model time.
        if let (Some(job), Some(w)) = (job, self.keys.get(key))
            && (w.samples.iter()).any(|s| {
                !s.cut
                    && self.cfg.is_fresh(s.at_ms, now_ms)
                    && s.x_before(k)
                        .is_some_and(|f| f[0] <= job[0] && f[1] <= job[1])
            })
            && self
                .sized(w, k, now_ms, true)
                .is_some_and(|f| f.model.predict(job) * f.q > room_ms as f64)
        {
            return false;
        }
        // Nor, at a cold start (too few calls for a quantile), when a completed call says
        // this request takes longer than the room. Call time grows with the request and
        // has a fixed part that is not negative (affine, as the fit assumes), so a request
        // takes at least [`lower_share`] of a completed call's time: all of it when that
        // call's request was no larger, the share of the smallest ratio of sizes when it
        // was larger. The largest such bound stands for the quantile of the few calls
        // there are. (Without it, the job with a sliver of budget left, which EDF hands a
        // free slot first, was probed: 156 ms for a call of seconds, in the simulator; and
        // a 112-token prompt with 518 ms left, after calls of 349 and 474 tokens that took
        // 2.1 and 2.6 s, was probed and cut.)
        let longest = (self.keys.get(key).into_iter())
            .flat_map(|w| w.samples.iter())
            .filter(|s| !s.cut && self.cfg.is_fresh(s.at_ms, now_ms))
            .filter_map(|s| match (job, s.x_before(k)) {
                (Some(job), Some(f)) => Some(s.duration_ms as f64 * cold_share(job, f)),
                (Some(_), None) => None,
                (None, _) => Some(s.duration_ms as f64),
            })
            .max_by(f64::total_cmp);
        if justified.is_none() && longest.is_some_and(|d| d > room_ms as f64) {
            return false;
        }
        // A call of the key still running well past what completed calls take: the server
        // is likely stuck now, and a probe would only wait with it.
        let overdue = completed.map_or(room_ms, |e| e.quantile_ms.saturating_mul(FIT_CAP as u64));
        let stuck = (self.keys.get(key)).is_some_and(|w| {
            (w.running.values()).any(|&t| now_ms.saturating_sub(t) > overdue as i64)
        });
        !stuck
    }

    /// The mean call time of a request of size `job` predicted from a window's fresh
    /// completed calls of known size alone (no cut call, no call a probe contradicted), or
    /// `None` with fewer than [`MIN_SIZED`] of them or none no larger than `job`.
    fn completed_mean_for(
        &self,
        w: &KeyWindow,
        k: Option<Calibration>,
        job: [f64; 2],
        now_ms: i64,
    ) -> Option<f64> {
        // In the unit the request is predicted from (the calls' measures, calibrated): a
        // mean from the measure is the line fitted on it.
        let rows: Vec<FitRow> = (w.samples.iter())
            .filter(|s| !s.cut && s.halvings == 0 && self.cfg.is_fresh(s.at_ms, now_ms))
            .filter_map(|s| {
                let wt = self.cfg.recency(s.at_ms, now_ms);
                Some((s.x_before(k)?, s.duration_ms.max(1) as f64, wt))
            })
            .filter(|r| r.2 > FORGOTTEN)
            .collect();
        // Below every completed request the fit would only extrapolate down (and with one
        // size seen, not at all): it says nothing there.
        let covered = rows.iter().any(|r| r.0[0] <= job[0] && r.0[1] <= job[1]);
        // Fewer calls than a fit needs still say, from two sizes on, how the time grows
        // with the size: above every one of them (where a probe would extrapolate
        // anyway), their line is the cold start's best guess of the request's mean.
        let above_all = rows.iter().all(|r| r.0[0] <= job[0] && r.0[1] <= job[1]);
        let sizes = |i: usize| rows.iter().map(move |r| r.0[i]);
        let spread =
            |i: usize| sizes(i).fold(f64::MIN, f64::max) > sizes(i).fold(f64::MAX, f64::min);
        let few = rows.len() >= 2 && above_all && (spread(0) || spread(1));
        if (rows.len() < MIN_SIZED.max(self.cfg.min_samples) && !few) || !covered {
            return None;
        }
        let model = CallModel::fit(&rows);
        let total: f64 = rows.iter().map(|r| r.2).sum();
        let ratio = rows
            .iter()
            .map(|r| r.1 / model.predict(r.0) * r.2)
            .sum::<f64>()
            / total;
        Some(model.predict(job) * ratio)
    }

    /// A key's probe credit at `now_ms` ([`ServiceTimeConfig::probe_burst_ms`]).
    fn credit(&self, key: &str, now_ms: i64) -> f64 {
        let burst = self.cfg.probe_burst_ms as f64;
        let share = self.cfg.probe_waste_share;
        match self.keys.get(key).and_then(|w| w.credit) {
            None => burst,
            Some((c, at)) => {
                let grown = now_ms.saturating_sub(at).max(0) as f64 * share / (1.0 - share);
                (c + grown).min(burst)
            }
        }
    }

    /// A probe of `key` has ended at `now_ms` (its call, if it completed or was cut, is
    /// recorded separately with [`Self::observe`] / [`Self::observe_cut`]). A completed
    /// probe divides by 8 the weight of the key's cut calls that could
    /// lift the estimate above the budget it was started with (at least
    /// `budget / FIT_CAP`): it showed that a call now fits in less, and those cut calls no
    /// longer shape the fitted tail. A wasted one (cut, or failed) spends its duration of
    /// the key's probe credit, so that wasted probe time stays within `probe_waste_share`
    /// of the time that passes, plus the burst (`probe_burst_ms`) and one probe.
    pub fn probe_ended(&mut self, key: &str, end: ProbeEnd, now_ms: i64) {
        let credit = self.credit(key, now_ms);
        let Some(w) = self.keys.get_mut(key) else {
            return;
        };
        w.probes = w.probes.saturating_sub(1);
        match end {
            ProbeEnd::Completed { budget_ms } => {
                // The cut calls that could lift the estimate above that budget: the fit is
                // capped at FIT_CAP × the largest sample.
                let suspect = (budget_ms as f64 / FIT_CAP).floor() as u64;
                let contradicted =
                    (w.samples.iter_mut()).filter(|s| s.cut && s.duration_ms >= suspect);
                for s in contradicted {
                    s.halvings = s.halvings.saturating_add(PROBE_HALVINGS).min(64);
                }
                self.revision += 1;
            }
            ProbeEnd::Wasted { duration_ms } => {
                w.credit = Some((credit - duration_ms as f64, now_ms));
            }
            ProbeEnd::Released => {}
        }
    }

    /// The number of distinct keys held (at most `max_keys`).
    pub fn keys(&self) -> usize {
        self.keys.len()
    }

    /// The estimate over `window`'s fresh samples; without the cut calls unless
    /// `with_cut`.
    fn summarize(
        &self,
        window: &VecDeque<Sample>,
        now_ms: i64,
        source: EstimateSource,
        with_cut: bool,
    ) -> Option<Estimate> {
        // (duration, weight, contradicted by a probe)
        let mut samples: Vec<(u64, f64, bool)> = window
            .iter()
            .filter(|s| self.cfg.is_fresh(s.at_ms, now_ms) && (with_cut || !s.cut))
            .map(|s| {
                let w = self.cfg.recency(s.at_ms, now_ms) * (-f64::from(s.halvings)).exp2();
                (s.duration_ms, w, s.halvings > 0)
            })
            .collect();
        let n = samples.len();
        if n < self.cfg.min_samples {
            return None;
        }
        samples.sort_unstable_by_key(|&(d, _, _)| d);
        let total: f64 = samples.iter().map(|&(_, w, _)| w).sum();
        let mean = samples.iter().map(|&(d, w, _)| d as f64 * w).sum::<f64>() / total;
        let ranked: Vec<(u64, f64)> = samples.iter().map(|&(d, w, _)| (d, w)).collect();
        let empirical = weighted_rank(&ranked, self.cfg.quantile, total);
        // A sample a probe contradicted counts in the rank with its halved weight, but no
        // longer shapes the fitted tail.
        let counted: Vec<(u64, f64)> = (samples.iter())
            .filter(|&&(_, w, contradicted)| w > FORGOTTEN && !contradicted)
            .map(|&(d, w, _)| (d, w))
            .collect();
        let fitted = if self.cfg.fit {
            lognormal_quantile(&counted, self.cfg.quantile)
        } else {
            None
        };
        let quantile_ms = match fitted {
            Some(f) => {
                let largest = counted.last().map_or(0, |&(d, _)| d);
                let cap = largest as f64 * FIT_CAP;
                // Rounded up, with a tolerance for the float error of a constant window's
                // zero spread; float-to-int casts saturate.
                empirical.max((f.min(cap) - 1e-6).ceil() as u64)
            }
            None => empirical,
        };
        Some(Estimate {
            quantile_ms,
            mean_ms: (mean.round() as u64).min(samples[n - 1].0),
            samples: n,
            source,
        })
    }
}

/// The fewest completed calls of known size the request-aware fit needs
/// ([`ServiceTimes::estimate_for`]).
pub const MIN_SIZED: usize = 8;

/// One call for the fit: (size, duration, weight).
type FitRow = ([f64; 2], f64, f64);

/// A call time linear in the request's size: `a + b·x₀ + c·x₁`, with `b, c ≥ 0`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
struct CallModel {
    intercept: f64,
    slopes: [f64; 2],
}

impl CallModel {
    /// Weighted least squares over `(size, duration, weight)`; a feature whose weighted
    /// variance is (near) zero, or whose slope comes out negative, is dropped and the rest
    /// refitted.
    fn fit(rows: &[FitRow]) -> Self {
        let w: f64 = rows.iter().map(|r| r.2).sum();
        let mean = |f: &dyn Fn(&FitRow) -> f64| rows.iter().map(|r| r.2 * f(r)).sum::<f64>() / w;
        let xm = [mean(&|r| r.0[0]), mean(&|r| r.0[1])];
        let dm = mean(&|r| r.1);
        let cov = |i: usize, j: usize| {
            rows.iter()
                .map(|r| r.2 * (r.0[i] - xm[i]) * (r.0[j] - xm[j]))
                .sum::<f64>()
        };
        let cxd = |i: usize| {
            rows.iter()
                .map(|r| r.2 * (r.0[i] - xm[i]) * (r.1 - dm))
                .sum::<f64>()
        };
        let mut active = [cov(0, 0) > 1e-9 * w, cov(1, 1) > 1e-9 * w];
        let mut slopes = [0.0; 2];
        for _ in 0..3 {
            slopes = match active {
                [true, true] => {
                    let (a, b, c) = (cov(0, 0), cov(0, 1), cov(1, 1));
                    let det = a * c - b * b;
                    if det.abs() <= 1e-12 * a * c {
                        // Collinear: keep the prompt.
                        active[1] = false;
                        continue;
                    }
                    let (y0, y1) = (cxd(0), cxd(1));
                    [(c * y0 - b * y1) / det, (a * y1 - b * y0) / det]
                }
                [true, false] => [cxd(0) / cov(0, 0), 0.0],
                [false, true] => [0.0, cxd(1) / cov(1, 1)],
                [false, false] => [0.0, 0.0],
            };
            let negative = [slopes[0] < 0.0, slopes[1] < 0.0];
            if !negative[0] && !negative[1] {
                break;
            }
            active = [active[0] && !negative[0], active[1] && !negative[1]];
            slopes = [0.0, 0.0];
        }
        let slopes = [slopes[0].max(0.0), slopes[1].max(0.0)];
        Self {
            intercept: dm - slopes[0] * xm[0] - slopes[1] * xm[1],
            slopes,
        }
    }

    /// The predicted call time of a request of `size`, at least 1 ms.
    fn predict(&self, size: [f64; 2]) -> f64 {
        (self.intercept + self.slopes[0] * size[0] + self.slopes[1] * size[1]).max(1.0)
    }
}

/// The weighted nearest rank: the smallest value (a duration, or a ratio) whose cumulative
/// weight reaches `q × total` (`samples` sorted by value). With equal weights it is the
/// `⌈q·n⌉`-th smallest, with the same tolerance as [`nearest_rank`].
fn weighted_rank<T: Copy + Default>(samples: &[(T, f64)], q: f64, total: f64) -> T {
    let target = q * total - 1e-9 * total.max(1.0) / samples.len().max(1) as f64;
    let mut cum = 0.0;
    for &(d, w) in samples {
        cum += w;
        if cum >= target {
            return d;
        }
    }
    samples.last().map_or_else(T::default, |&(d, _)| d)
}

/// Append `sample` to a window: stale samples go first, then the oldest while full.
///
/// A full window drops its oldest sample, except that it keeps the last
/// [`KEEP_PER_SIZE`] of each size class (a power of two of the request's size): when
/// small requests crowd out the large ones, the fit would otherwise forget what a large
/// one costs, hold the next large job to a small job's time, and cut it at its deadline.
fn push(window: &mut VecDeque<Sample>, sample: Sample, cfg: &ServiceTimeConfig) {
    window.retain(|s| cfg.is_fresh(s.at_ms, sample.at_ms));
    while window.len() >= cfg.window {
        let victim = sized_victim(window).unwrap_or(0);
        window.remove(victim);
    }
    window.push_back(sample);
}

/// Samples of each size class a full window keeps ([`push`]).
pub const KEEP_PER_SIZE: usize = 16;

/// The size class of a sample: `⌊log₂(size + 1)⌋`, `None` when its size is unknown.
fn size_class(s: &Sample) -> Option<u32> {
    s.x(Some(Calibration::IDENTITY))
        .map(|f| ((f[0] + f[1] + 1.0).log2().floor()) as u32)
}

/// The oldest sample that is not among the last [`KEEP_PER_SIZE`] of its size class;
/// `None` when there is none (then the oldest goes).
fn sized_victim(window: &VecDeque<Sample>) -> Option<usize> {
    if window
        .iter()
        .all(|s| s.x(Some(Calibration::IDENTITY)).is_none())
    {
        return None;
    }
    let mut newer: HashMap<Option<u32>, usize> = HashMap::new();
    let mut victim = None;
    // From the newest back: a sample with KEEP_PER_SIZE newer ones of its class may go.
    for (i, s) in window.iter().enumerate().rev() {
        let c = size_class(s);
        let n = newer.entry(c).or_insert(0);
        if *n >= KEEP_PER_SIZE || c.is_none() {
            victim = Some(i);
        }
        *n += 1;
    }
    victim
}

/// The `q`-quantile of the lognormal fitted to the weighted `samples` (the weighted mean
/// and the unbiased weighted standard deviation of their logarithms; a 0 ms sample counts
/// as 1 ms): `None` with fewer than two samples or for `q` outside `(0.5, 1)`.
fn lognormal_quantile(samples: &[(u64, f64)], q: f64) -> Option<f64> {
    let ms: Vec<(f64, f64)> = samples.iter().map(|&(d, w)| (d.max(1) as f64, w)).collect();
    lognormal_quantile_f(&ms, q)
}

/// [`lognormal_quantile`] over positive reals (weighted).
fn lognormal_quantile_f(samples: &[(f64, f64)], q: f64) -> Option<f64> {
    if samples.len() < 2 || !(q > 0.5 && q < 1.0) {
        return None;
    }
    let ln = |d: f64| d.max(1e-9).ln();
    let w: f64 = samples.iter().map(|&(_, w)| w).sum();
    let w2: f64 = samples.iter().map(|&(_, w)| w * w).sum();
    let mean = samples.iter().map(|&(d, x)| x * ln(d)).sum::<f64>() / w;
    let denom = w - w2 / w;
    if denom <= 0.0 {
        return None;
    }
    let var = samples
        .iter()
        .map(|&(d, x)| x * (ln(d) - mean) * (ln(d) - mean))
        .sum::<f64>()
        / denom;
    let f = (mean + standard_normal_quantile(q) * var.sqrt()).exp();
    f.is_finite().then_some(f)
}

/// The standard normal quantile `Φ⁻¹(p)` for `p` in `[0.5, 1)`, by Acklam's rational
/// approximation (relative error below 1.2e-9). Written out rather than taken from a
/// statistics crate: the one function does not justify statrs and its linear-algebra
/// dependencies in the pure core.
#[allow(clippy::excessive_precision)] // Acklam's published coefficients, as given
fn standard_normal_quantile(p: f64) -> f64 {
    const A: [f64; 6] = [
        -3.969683028665376e+01,
        2.209460984245205e+02,
        -2.759285104469687e+02,
        1.383577518672690e+02,
        -3.066479806614716e+01,
        2.506628277459239e+00,
    ];
    const B: [f64; 5] = [
        -5.447609879822406e+01,
        1.615858368580409e+02,
        -1.556989798598866e+02,
        6.680131188771972e+01,
        -1.328068155288572e+01,
    ];
    const C: [f64; 6] = [
        -7.784894002430293e-03,
        -3.223964580411365e-01,
        -2.400758277161838e+00,
        -2.549732539343734e+00,
        4.374664141464968e+00,
        2.938163982698783e+00,
    ];
    const D: [f64; 4] = [
        7.784695709041462e-03,
        3.224671290700398e-01,
        2.445134137142996e+00,
        3.754408661907416e+00,
    ];
    const P_HIGH: f64 = 1.0 - 0.02425;
    if p <= P_HIGH {
        let q = p - 0.5;
        let r = q * q;
        (((((A[0] * r + A[1]) * r + A[2]) * r + A[3]) * r + A[4]) * r + A[5]) * q
            / (((((B[0] * r + B[1]) * r + B[2]) * r + B[3]) * r + B[4]) * r + 1.0)
    } else {
        let q = (-2.0 * (1.0 - p).ln()).sqrt();
        -(((((C[0] * q + C[1]) * q + C[2]) * q + C[3]) * q + C[4]) * q + C[5])
            / ((((D[0] * q + D[1]) * q + D[2]) * q + D[3]) * q + 1.0)
    }
}

/// The 1-based nearest rank `⌈q·n⌉`, in `1..=n` (`n ≥ 1`); see the module doc for the
/// tolerance.
fn nearest_rank(q: f64, n: usize) -> usize {
    let r = (q * n as f64 - 1e-9).ceil();
    (r as usize).clamp(1, n)
}

/// The share of a completed call's time (its request of features `call`) that a cold
/// start's probe of a request of features `job` needs room for: [`lower_share`], except
/// when the request is larger in one feature and smaller in the other. The bound then
/// rests on the smaller feature alone (a prompt longer than the call's, with fewer
/// `max_tokens`, could in principle take 9/42 of its time), and a probe it let through on
/// the real llama-server (1,039 prompt tokens and 9 `max_tokens`, after a call of 918 and
/// 42 that took 5.5 s, with 5.3 s left) ran past its deadline. There it is the size's
/// share of the call (the sum of the features, as [`Predictor::estimate`] scales a
/// request larger than every call before the fit holds), at most 1: a guess, not a bound.
fn cold_share(job: [f64; 2], call: [f64; 2]) -> f64 {
    let strict = lower_share(job, call);
    let larger = (0..2).any(|i| job[i] > call[i]);
    let smaller = (0..2).any(|i| job[i] < call[i]);
    if larger && smaller {
        let by_size = (job[0] + job[1] + 1.0) / (call[0] + call[1] + 1.0);
        strict.max(by_size.min(1.0))
    } else {
        strict
    }
}

/// The share of a completed call's time that a request of features `job` takes at least,
/// given that call's request had features `call`: with call time affine in the features,
/// `t = a + Σ bᵢ·xᵢ` and `a, bᵢ ≥ 0`, `t(job) ≥ r·t(call)` for `r = min(1, minᵢ jobᵢ ÷ callᵢ)`
/// over the features the call had (1 when the call was no larger in every feature).
fn lower_share(job: [f64; 2], call: [f64; 2]) -> f64 {
    job.iter()
        .zip(call)
        .filter(|&(_, c)| c > 0.0)
        .map(|(&j, c)| j / c)
        .fold(1.0, f64::min)
        .max(0.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn a_probes_end_follows_its_calls_result() {
        use crate::{CallResult, Reason};
        assert_eq!(
            ProbeEnd::of(&CallResult::Completed, 900, 400),
            ProbeEnd::Completed { budget_ms: 900 }
        );
        assert_eq!(
            ProbeEnd::of(&CallResult::DeadlineExceeded, 900, 900),
            ProbeEnd::Wasted { duration_ms: 900 }
        );
        let failed = CallResult::Failed {
            retryable: true,
            reason: Reason::Backend("http_503".into()),
            retry_after_ms: None,
        };
        assert_eq!(
            ProbeEnd::of(&failed, 900, 30),
            ProbeEnd::Wasted { duration_ms: 30 }
        );
        assert_eq!(
            ProbeEnd::of(&CallResult::Cancelled, 900, 200),
            ProbeEnd::Released
        );
    }

    #[test]
    fn a_refusal_note_names_the_estimate_only_for_a_refusal_it_decided() {
        use crate::admission::Stage;
        use crate::reason::{Reason, RefusalCause};
        let e = Estimate {
            quantile_ms: 1_200,
            mean_ms: 400,
            samples: 37,
            source: EstimateSource::Key,
        };
        let learned = Reason::Refused(Stage::Admission, RefusalCause::BelowLearnedRuntime);
        let note = e.refusal_note(Some(&learned)).expect("a learned refusal");
        assert_eq!(
            note,
            "learned call duration for this kind: p99 1200 ms, mean 400 ms over 37 calls (this kind)"
        );
        let wait = Reason::Refused(Stage::Receipt, RefusalCause::ExpectedWaitExceedsBudget);
        assert!(e.refusal_note(Some(&wait)).is_some());
        let cold = Estimate {
            source: EstimateSource::LowerBound,
            ..e
        };
        assert!(
            cold.refusal_note(Some(&learned))
                .unwrap()
                .contains("too few calls yet")
        );
        let passed = Reason::Refused(Stage::Admission, RefusalCause::DeadlinePassed);
        assert_eq!(e.refusal_note(Some(&passed)), None);
        assert_eq!(e.refusal_note(None), None);
    }

    const KEYS: [&str; 5] = [
        "summarize|a",
        "summarize|b",
        "embed|a",
        "embed|b",
        "unseen|z",
    ];

    fn cfg(window: usize, quantile: f64, min_samples: usize, max_age_ms: i64) -> ServiceTimeConfig {
        ServiceTimeConfig {
            window,
            quantile,
            min_samples,
            max_age_ms,
            // The nearest-rank properties below, with equal weights; the fit and the
            // recency weights have their own tests.
            fit: false,
            half_life_ms: 0,
            ..ServiceTimeConfig::default()
        }
    }

    #[test]
    fn the_own_estimate_never_borrows_another_keys_calls() {
        let mut t = ServiceTimes::new(cfg(16, 0.99, 3, 600_000));
        for i in 0..5 {
            t.observe("summarize|slow", 1_500, i);
        }
        let now = 10;
        assert_eq!(
            t.estimate("summarize|fast", now).map(|e| e.quantile_ms),
            Some(1_500)
        );
        assert_eq!(t.own_estimate_for("summarize|fast", None, now), None);
        t.observe("summarize|fast", 100, now);
        // Too few of its own: the cold-start bound (its longest call), not the others'.
        let own = t.own_estimate_for("summarize|fast", None, now).unwrap();
        assert_eq!(own.quantile_ms, 100);
        for _ in 0..3 {
            t.observe("summarize|fast", 120, now);
        }
        assert_eq!(
            t.own_estimate_for("summarize|fast", None, now),
            t.estimate_for("summarize|fast", None, now),
            "with enough calls of its own it is the estimate"
        );
        let slow = t.own_estimate_for("summarize|slow", None, now).unwrap();
        assert_eq!(slow.quantile_ms, 1_500);
    }

    #[test]
    fn normal_quantiles() {
        for (p, z) in [
            (0.5, 0.0),
            (0.9, 1.281_551_565_5),
            (0.975, 1.959_963_985),
            (0.99, 2.326_347_874),
            (0.999, 3.090_232_306),
        ] {
            let got = standard_normal_quantile(p);
            assert!((got - z).abs() < 1e-6, "{p}: {got} vs {z}");
        }
    }

    #[test]
    fn the_fit_raises_a_heavy_tail_and_leaves_a_constant_alone() {
        let fit = ServiceTimeConfig::default();
        let nr = ServiceTimeConfig { fit: false, ..fit };
        // 128 draws of a lognormal (median 167 ms, sigma 0.6: p99 about 675 ms), as
        // quantiles of evenly spaced probabilities: the nearest rank's p99 is the second
        // largest of them; the fit reaches the distribution's own.
        let draws: Vec<u64> = (1..=128)
            .map(|i| {
                let p = (i as f64 - 0.5) / 128.0;
                let z = if p >= 0.5 {
                    standard_normal_quantile(p)
                } else {
                    -standard_normal_quantile(1.0 - p)
                };
                (167.0 * (0.6 * z).exp()).round() as u64
            })
            .collect();
        let (mut a, mut b) = (ServiceTimes::new(fit), ServiceTimes::new(nr));
        for (i, d) in draws.iter().enumerate() {
            a.observe("k", *d, i as i64);
            b.observe("k", *d, i as i64);
        }
        let (fa, fb) = (a.estimate("k", 200).unwrap(), b.estimate("k", 200).unwrap());
        assert!(fb.quantile_ms <= 650, "nearest rank {}", fb.quantile_ms);
        assert!(
            (660..=700).contains(&fa.quantile_ms),
            "fitted {}",
            fa.quantile_ms
        );
        assert_eq!(fa.mean_ms, fb.mean_ms);
        // A constant stays exactly itself; the cap holds for a wild window.
        let mut c = ServiceTimes::new(fit);
        for i in 0..10 {
            c.observe("k", 200, i);
        }
        assert_eq!(c.estimate("k", 10).unwrap().quantile_ms, 200);
        let mut w = ServiceTimes::new(fit);
        for (i, d) in [1u64, 1, 1, 1, 10_000].iter().enumerate() {
            w.observe("k", *d, i as i64);
        }
        assert_eq!(w.estimate("k", 10).unwrap().quantile_ms, 20_000);
    }

    /// Observe `(key index, duration, gap)` triples at increasing times from `t`; returns
    /// the time of the last observation and the log `(key index, duration, at)`.
    fn play(
        st: &mut ServiceTimes,
        ops: &[(usize, u64, i64)],
        mut t: i64,
    ) -> (i64, Vec<(usize, u64, i64)>) {
        let mut log = Vec::new();
        for &(k, d, gap) in ops {
            t += gap;
            st.observe(KEYS[k], d, t);
            log.push((k, d, t));
        }
        (t, log)
    }

    #[test]
    fn defaults_and_clamping() {
        let d = ServiceTimeConfig::default();
        assert_eq!(
            (
                d.window,
                d.quantile,
                d.min_samples,
                d.max_age_ms,
                d.max_keys
            ),
            (128, 0.99, 3, 600_000, 256)
        );
        assert!(d.fit, "the lognormal fit is on by default");
        assert!(
            d.request_aware,
            "the request-aware estimate is on by default"
        );
        assert_eq!(d.clamped(), d);
        let c = ServiceTimeConfig {
            window: 0,
            quantile: 0.0,
            min_samples: 5,
            max_age_ms: -3,
            max_keys: 0,
            fit: false,
            half_life_ms: -1,
            probe_waste_share: f64::NAN,
            probe_burst_ms: 0,
            max_probes: 0,
            request_aware: false,
        }
        .clamped();
        assert_eq!(
            (c.window, c.min_samples, c.max_age_ms, c.max_keys),
            (1, 1, 1, 1)
        );
        assert_eq!((c.half_life_ms, c.max_probes), (0, 1));
        assert_eq!(c.probe_waste_share, 0.05);
        assert!(c.quantile > 0.0);
        assert_eq!(cfg(5000, 1.5, 0, 1).clamped().window, MAX_WINDOW);
        assert_eq!(cfg(5000, 1.5, 0, 1).clamped().quantile, 1.0);
        assert_eq!(cfg(5000, 1.5, 0, 1).clamped().min_samples, 1);
        assert_eq!(cfg(8, f64::NAN, 20, 1).clamped().quantile, 0.99);
        assert_eq!(cfg(8, f64::NAN, 20, 1).clamped().min_samples, 8);
        assert_eq!(ServiceTimes::new(cfg(0, 0.9, 3, 1)).config().window, 1);
    }

    #[test]
    fn nearest_rank_cases() {
        assert_eq!(nearest_rank(0.9, 10), 9);
        assert_eq!(nearest_rank(0.9, 32), 29);
        assert_eq!(nearest_rank(0.9, 1), 1);
        assert_eq!(nearest_rank(0.7, 10), 7); // 0.7 × 10 = 7.000000000000001 in f64
        assert_eq!(nearest_rank(0.5, 4), 2);
        assert_eq!(nearest_rank(0.5, 5), 3);
        assert_eq!(nearest_rank(1.0, 7), 7);
        assert_eq!(nearest_rank(f64::MIN_POSITIVE, 7), 1);
        assert_eq!(ServiceTimeConfig::default().slowdown_observations(), 2);
        assert_eq!(nearest_rank(0.99, 128), 127);
        assert_eq!(cfg(10, 1.0, 1, 1).slowdown_observations(), 1);
    }

    #[test]
    fn cold_start_is_none_then_own_estimate_after_min_samples() {
        let mut st = ServiceTimes::new(ServiceTimeConfig {
            fit: false,
            ..ServiceTimeConfig::default()
        });
        assert_eq!(st.estimate("summarize|a", 0), None);
        st.observe("summarize|a", 100, 0);
        st.observe("summarize|a", 300, 1);
        // Too few calls to estimate, but one took 300 ms: a lower bound.
        assert_eq!(
            st.estimate("summarize|a", 2),
            Some(Estimate {
                quantile_ms: 300,
                mean_ms: 200,
                samples: 2,
                source: EstimateSource::LowerBound
            })
        );
        st.observe("summarize|a", 200, 2);
        assert_eq!(
            st.estimate("summarize|a", 2),
            Some(Estimate {
                quantile_ms: 300,
                mean_ms: 200,
                samples: 3,
                source: EstimateSource::Key
            })
        );
    }

    #[test]
    fn unseen_or_unlearned_key_falls_back_to_all_keys() {
        let mut st = ServiceTimes::new(ServiceTimeConfig {
            fit: false,
            ..ServiceTimeConfig::default()
        });
        for d in [100, 200, 300] {
            st.observe("summarize|a", d, 0);
        }
        let all = st.estimate("embed|a", 0).unwrap();
        assert_eq!(all.source, EstimateSource::AllKeys);
        assert_eq!((all.quantile_ms, all.samples), (300, 3));
        // A key with too few samples of its own also borrows, and its own sample counts.
        st.observe("embed|a", 1000, 0);
        let e = st.estimate("embed|a", 0).unwrap();
        assert_eq!(
            (e.source, e.quantile_ms, e.samples),
            (EstimateSource::AllKeys, 1000, 4)
        );
        assert_eq!(
            st.estimate("summarize|a", 0).unwrap().source,
            EstimateSource::Key
        );
    }

    #[test]
    fn nearest_rank_p90_of_one_to_ten_is_nine() {
        let mut st = ServiceTimes::new(cfg(10, 0.9, 3, 600_000));
        for d in [7, 3, 10, 1, 9, 2, 8, 4, 6, 5] {
            st.observe("k", d, 0);
        }
        let e = st.estimate("k", 0).unwrap();
        assert_eq!((e.quantile_ms, e.mean_ms, e.samples), (9, 6, 10)); // mean 5.5 rounds up
        // The window keeps only the last 10: one more sample evicts the 7.
        st.observe("k", 100, 0);
        let e = st.estimate("k", 0).unwrap();
        assert_eq!((e.quantile_ms, e.samples), (10, 10));
    }

    #[test]
    fn samples_age_out_at_max_age() {
        let mut st = ServiceTimes::new(cfg(32, 0.9, 1, 1000));
        st.observe("k", 50, 10_000);
        assert!(st.estimate("k", 11_000).is_some()); // age == max_age: still fresh
        assert_eq!(st.estimate("k", 11_001), None);
        assert_eq!(st.estimate("other", 11_001), None);
        // A new observation drops the stale one for good.
        st.observe("k", 70, 20_000);
        let e = st.estimate("k", 20_000).unwrap();
        assert_eq!((e.quantile_ms, e.samples), (70, 1));
        assert_eq!(st.keys.get("k").unwrap().samples.len(), 1);
    }

    #[test]
    fn evicts_the_key_observed_least_recently() {
        let mut st = ServiceTimes::new(ServiceTimeConfig {
            max_keys: 2,
            min_samples: 1,
            ..ServiceTimeConfig::default()
        });
        st.observe("a", 1, 0);
        st.observe("b", 2, 0);
        st.observe("a", 3, 0);
        st.observe("c", 4, 0);
        assert_eq!(st.keys(), 2);
        assert!(st.keys.contains_key("a") && st.keys.contains_key("c"));
        // The evicted key still gets the fallback.
        assert_eq!(st.estimate("b", 0).unwrap().source, EstimateSource::AllKeys);
    }

    fn ops(max_gap: i64) -> impl Strategy<Value = Vec<(usize, u64, i64)>> {
        prop::collection::vec((0usize..4, 0u64..10_000, 0i64..=max_gap), 0..120)
    }

    proptest! {
        #[test]
        fn estimate_lies_within_the_fresh_samples_of_its_source(
            ops in ops(200_000),
            window in 1usize..40,
            quantile in 0.55f64..=1.0,
            min_samples in 1usize..6,
            max_age in 1i64..400_000,
            later in 0i64..700_000,
            key in 0usize..5,
        ) {
            let c = cfg(window, quantile, min_samples, max_age);
            let mut st = ServiceTimes::new(c);
            let (t, log) = play(&mut st, &ops, 0);
            let now = t + later;
            let c = c.clamped();
            // Reference: the last `window` observations (of the key, or of any key), fresh at `now`.
            let fresh = |of_key: bool| -> Vec<u64> {
                let mut v: Vec<u64> = log.iter().rev()
                    .filter(|(k, _, _)| !of_key || *k == key)
                    .take(c.window)
                    .filter(|(_, _, at)| now - at <= c.max_age_ms)
                    .map(|&(_, d, _)| d)
                    .collect();
                v.sort_unstable();
                v
            };
            let (own, all) = (fresh(true), fresh(false));
            let expected = if own.len() >= c.min_samples {
                Some((EstimateSource::Key, own))
            } else if all.len() >= c.min_samples {
                // The key's own longest call raises the fallback (cold-start bound).
                let got = st.estimate(KEYS[key], now);
                prop_assert_eq!(got.map(|e| e.source), Some(EstimateSource::AllKeys));
                if let Some(&longest) = own.last() {
                    prop_assert!(got.unwrap().quantile_ms >= longest);
                }
                let mut s = all.clone();
                s.extend(own.iter().copied());
                s.sort_unstable();
                prop_assert!(s.contains(&got.unwrap().quantile_ms));
                None
            } else if let Some(&longest) = own.last() {
                // Cold start: the key's longest fresh call is a lower bound.
                let got = st.estimate(KEYS[key], now);
                prop_assert_eq!(got.map(|e| (e.source, e.quantile_ms)), Some((EstimateSource::LowerBound, longest)));
                None
            } else {
                prop_assert_eq!(st.estimate(KEYS[key], now), None);
                None
            };
            let got = st.estimate(KEYS[key], now);
            if let (Some(e), Some((source, s))) = (got, expected) {
                prop_assert_eq!(e.source, source);
                prop_assert_eq!(e.samples, s.len());
                let (min, max) = (s[0], s[s.len() - 1]);
                prop_assert!(min <= e.quantile_ms && e.quantile_ms <= max);
                prop_assert!(min <= e.mean_ms && e.mean_ms <= max);
                prop_assert!(s.contains(&e.quantile_ms));
                let n = s.len();
                let median2 = s[(n - 1) / 2] + s[n / 2]; // twice the median
                prop_assert!(2 * e.quantile_ms >= median2);
            }
        }

        #[test]
        fn follows_a_change_of_speed(
            before in ops(100_000),
            window in 1usize..40,
            quantile in 0.01f64..=1.0,
            v in 0u64..100_000,
            gap in 0i64..1000,
        ) {
            let c = cfg(window, quantile, 3, 600_000);
            let mut st = ServiceTimes::new(c);
            let (mut t, _) = play(&mut st, &before, 0);
            for _ in 0..c.clamped().window {
                t += gap;
                st.observe(KEYS[0], v, t);
            }
            let e = st.estimate(KEYS[0], t).unwrap();
            prop_assert_eq!((e.quantile_ms, e.mean_ms, e.source), (v, v, EstimateSource::Key));
            prop_assert_eq!(e.samples, c.clamped().window);
        }

        #[test]
        fn a_slowdown_is_seen_within_k_observations(
            window in 1usize..64,
            quantile in 0.01f64..=1.0,
            run in 0usize..128,
            a in 0u64..10_000,
            extra in 1u64..10_000,
        ) {
            let c = cfg(window, quantile, 1, 600_000);
            let w = c.clamped().window;
            let k = c.slowdown_observations();
            let b = a + extra;
            let mut st = ServiceTimes::new(c);
            for _ in 0..run {
                st.observe("k", a, 0);
            }
            for i in 0..k {
                if run >= w && i == k - 1 {
                    // Exactness: with a full window of `a`, k − 1 observations of b are not enough.
                    prop_assert_eq!(st.estimate("k", 0).unwrap().quantile_ms, a);
                }
                st.observe("k", b, 0);
            }
            prop_assert!(st.estimate("k", 0).unwrap().quantile_ms >= b);
        }

        #[test]
        fn samples_older_than_max_age_are_ignored(
            ops in ops(100_000),
            max_age in 1i64..400_000,
            after in 1i64..1_000_000,
            key in 0usize..5,
        ) {
            let mut st = ServiceTimes::new(cfg(32, 0.9, 1, max_age));
            let (t, _) = play(&mut st, &ops, 0);
            prop_assert_eq!(st.estimate(KEYS[key], t + max_age + after), None);
            if !ops.is_empty() {
                prop_assert!(st.estimate(KEYS[key], t).is_some());
            }
        }

        #[test]
        fn keys_and_windows_stay_bounded(
            ops in prop::collection::vec((0usize..64, 0u64..10_000, 0i64..100_000), 0..300),
            window in 0usize..20,
            max_keys in 0usize..10,
            max_age in 1i64..400_000,
        ) {
            let mut st = ServiceTimes::new(ServiceTimeConfig {
                max_keys,
                ..cfg(window, 0.9, 3, max_age)
            });
            let c = st.config();
            let mut t = 0;
            for (k, d, gap) in ops {
                t += gap;
                let key = format!("kind{k}|backend");
                st.observe(&key, d, t);
                prop_assert!(st.keys() <= c.max_keys);
                prop_assert!(st.keys.contains_key(&key));
                prop_assert!(st.all.len() <= c.window);
                for w in st.keys.values() {
                    prop_assert!(w.samples.len() <= c.window);
                }
            }
        }

        #[test]
        fn a_sample_at_or_above_the_quantile_never_lowers_it(
            ops in ops(100_000),
            window in 1usize..40,
            quantile in 0.01f64..=1.0,
            min_samples in 1usize..6,
            later in 0i64..400_000,
            key in 0usize..5,
            above in 0u64..10_000,
        ) {
            let mut st = ServiceTimes::new(cfg(window, quantile, min_samples, 300_000));
            let (t, _) = play(&mut st, &ops, 0);
            let now = t + later;
            let Some(before) = st.estimate(KEYS[key], now) else { return Ok(()); };
            st.observe(KEYS[key], before.quantile_ms + above, now);
            let after = st.estimate(KEYS[key], now).unwrap();
            if before.source == EstimateSource::Key {
                prop_assert_eq!(after.source, EstimateSource::Key);
            }
            // AllKeys → Key switches to other samples: no claim across sources.
            if before.source == after.source {
                prop_assert!(after.quantile_ms >= before.quantile_ms);
            }
        }

        #[test]
        fn the_fit_only_raises_the_nearest_rank_and_within_its_cap(
            ops in ops(200_000),
            window in 1usize..40,
            quantile in 0.55f64..=1.0,
            min_samples in 1usize..6,
            later in 0i64..300_000,
            key in 0usize..5,
        ) {
            let plain = cfg(window, quantile, min_samples, 400_000);
            let fitted = ServiceTimeConfig { fit: true, ..plain };
            let (mut a, mut b) = (ServiceTimes::new(plain), ServiceTimes::new(fitted));
            let (t, _) = play(&mut a, &ops, 0);
            play(&mut b, &ops, 0);
            let largest = ops.iter().map(|o| o.1).max().unwrap_or(0);
            match (a.estimate(KEYS[key], t + later), b.estimate(KEYS[key], t + later)) {
                (None, None) => {}
                (Some(p), Some(f)) => {
                    prop_assert!(f.quantile_ms >= p.quantile_ms);
                    let cap = (largest as f64 * FIT_CAP).ceil() as u64;
                    prop_assert!(f.quantile_ms <= p.quantile_ms.max(cap));
                    prop_assert_eq!((f.mean_ms, f.samples, f.source), (p.mean_ms, p.samples, p.source));
                }
                (p, f) => prop_assert!(false, "one has an estimate: {:?} / {:?}", p, f),
            }
        }

        /// The request-aware estimate never falls as the prompt grows.
        #[test]
        fn the_request_aware_estimate_is_monotone_in_prompt_tokens(
            calls in proptest::collection::vec((1u64..2_000, 1u64..5_000, proptest::option::of(1u64..512), any::<bool>()), 8..150),
            p1 in 0u64..3_000,
            extra in 0u64..3_000,
            max_tokens in proptest::option::of(1u64..512),
        ) {
            let mut st = ServiceTimes::new(ServiceTimeConfig::default());
            for (i, &(p, d, m, cut)) in calls.iter().enumerate() {
                let size = RequestSize { prompt_tokens: p, max_tokens: m };
                st.observe_request("k", d, cut, Some(size), i as i64 * 10);
            }
            let now = calls.len() as i64 * 10;
            let at = |p| st.estimate_for("k", Some(RequestSize { prompt_tokens: p, max_tokens }), now);
            let (small, large) = (at(p1), at(p1 + extra));
            prop_assert_eq!(small.is_some(), large.is_some());
            if let (Some(s), Some(l)) = (small, large) {
                prop_assert!(s.quantile_ms <= l.quantile_ms, "{:?} > {:?}", s, l);
            }
        }

        /// A probe is granted only where [`ServiceTimes::may_probe`] said one may question
        /// the refusal, and asking `may_probe` changes nothing.
        #[test]
        fn a_granted_probe_is_one_may_probe_allowed(
            calls in proptest::collection::vec((1u64..5_000, any::<bool>(), 1u64..2_000), 0..120),
            asks in proptest::collection::vec((1u64..4_000, 1u64..6_000), 1..20),
        ) {
            let mut st = ServiceTimes::new(ServiceTimeConfig::default());
            let size = |t: u64| Some(RequestSize { prompt_tokens: t, max_tokens: None });
            for (i, &(d, cut, t)) in calls.iter().enumerate() {
                st.observe_request("k", d, cut, size(t), i as i64 * 10);
            }
            let mut now = calls.len() as i64 * 10;
            for &(t, room) in &asks {
                now += 5;
                let may = st.may_probe("k", size(t), room, now);
                prop_assert_eq!(may, st.may_probe("k", size(t), room, now));
                let took = st.try_probe("k", size(t), room, now);
                prop_assert!(!took || may, "probe granted at {} tokens, {} ms room, that may_probe refused", t, room);
            }
        }

        /// With every request of one size, the request-aware estimate is the per-key one.
        #[test]
        fn one_size_for_all_gives_the_per_key_estimate(
            durations in proptest::collection::vec((1u64..5_000, any::<bool>()), 8..150),
            p in 0u64..3_000,
            m in proptest::option::of(1u64..512),
        ) {
            let mut st = ServiceTimes::new(ServiceTimeConfig::default());
            let size = RequestSize { prompt_tokens: p, max_tokens: m };
            for (i, &(d, cut)) in durations.iter().enumerate() {
                st.observe_request("k", d, cut, Some(size), i as i64 * 10);
            }
            let now = durations.len() as i64 * 10;
            let (sized, plain) = (st.estimate_for("k", Some(size), now), st.estimate("k", now));
            match (sized, plain) {
                (Some(a), Some(b)) => {
                    prop_assert!(a.quantile_ms.abs_diff(b.quantile_ms) <= 1, "{:?} vs {:?}", a, b);
                    prop_assert!(a.mean_ms.abs_diff(b.mean_ms) <= 1, "{:?} vs {:?}", a, b);
                }
                (a, b) => prop_assert_eq!(a, b),
            }
        }

        /// A hang, then recovery, on a manual clock: healthy calls, then calls
        /// cut at the deadline that lift the estimate above every budget, then a healthy
        /// server again. Jobs refused by the estimate alone run as probes; within 20
        /// healthy calls the estimate is back within 20% of what the healthy calls alone
        /// give, and jobs are admitted again.
        #[test]
        fn a_hang_then_recovery_unlocks_within_a_few_probes(
            base in 20u64..400,
            healthy in proptest::collection::vec(0u64..30, 3..150),
            cuts in 1usize..9,
            budget in 1_000u64..5_000,
            gap in 0i64..200,
        ) {
            let mut st = ServiceTimes::new(ServiceTimeConfig::default());
            let mut clean = ServiceTimes::new(ServiceTimeConfig::default());
            let key = "summarize|a";
            let mut now = 0i64;
            let call = |j: u64| base + base * j / 100; // base .. 1.3 × base
            for &j in &healthy {
                now += call(j) as i64 + gap;
                st.observe(key, call(j), now);
                clean.observe(key, call(j), now);
            }
            // The hang: every call in flight is cut at its deadline.
            for _ in 0..cuts {
                now += 10;
                st.observe_cut(key, budget, now);
            }
            let locked = st.estimate(key, now).unwrap().quantile_ms;
            // Recovery: a job with the full budget arrives after every call; the clock
            // margin leaves it `room` for the call, less than the cut calls took.
            let room = budget - 50;
            let mut admitted_normally = 0;
            for (i, &j) in healthy.iter().cycle().take(20).enumerate() {
                let d = call(j);
                let refused = st.estimate(key, now).is_some_and(|e| e.quantile_ms > room);
                if refused {
                    prop_assert!(st.try_probe(key, None, room, now), "a probe is granted while none runs (call {})", i);
                } else {
                    admitted_normally += 1;
                }
                now += d as i64;
                st.observe(key, d, now);
                clean.observe(key, d, now);
                if refused {
                    st.probe_ended(key, ProbeEnd::Completed { budget_ms: room }, now);
                }
            }
            let back = st.estimate(key, now).unwrap().quantile_ms;
            let healthy_value = clean.estimate(key, now).unwrap().quantile_ms;
            prop_assert!(back <= room, "still refusing: {} ms", back);
            prop_assert!(admitted_normally > 0);
            // A hang that locked the estimate out (it refused every job) leaves no trace
            // once probes contradicted it. (One that did not lock it out is a tail the
            // estimate keeps, as it keeps any: nothing refused a job with the room.)
            if locked > room {
                prop_assert!(back as f64 <= healthy_value as f64 * 1.2,
                    "estimate {} ms after recovery, healthy {} ms (locked at {} ms)", back, healthy_value, locked);
            }
        }

        /// Probes on a server that stays hung: each is cut, and the pacing keeps the model
        /// time they waste within `probe_waste_share` of the time that passes (plus one
        /// probe).
        #[test]
        fn probes_on_a_server_that_stays_hung_waste_a_bounded_share(
            budgets in proptest::collection::vec(100u64..5_000, 1..200),
            tick in 1i64..500,
        ) {
            let mut st = ServiceTimes::new(ServiceTimeConfig::default());
            let share = st.config().probe_waste_share;
            let key = "summarize|a";
            let (mut now, mut wasted, mut longest) = (0i64, 0u64, 0u64);
            for &b in budgets.iter().cycle().take(2_000) {
                now += tick;
                if st.try_probe(key, None, b, now) {
                    longest = longest.max(b);
                    now += b as i64; // cut at the deadline
                    st.observe_cut(key, b, now);
                    st.probe_ended(key, ProbeEnd::Wasted { duration_ms: b }, now);
                    wasted += b;
                }
            }
            // The share of the time that passed (credit grows by share / (1 − share) per
            // ms not spent in a probe), the burst, and the last probe's overdraft.
            let burst = st.config().probe_burst_ms as f64;
            let allowed = share / (1.0 - share) * now as f64 + burst + longest as f64;
            prop_assert!(wasted as f64 <= allowed, "wasted {} ms of {} ms", wasted, now);
        }

        /// Cold start: no history, a fixed call time `t`, `slots` slots, jobs
        /// that arrive with enough budget for a call but may wait for a slot. The elapsed
        /// time of a running call and the longest ended call count as a lower bound, so no
        /// call is cut at the deadline (at most one per slot is allowed).
        #[test]
        fn cold_start_cuts_at_most_one_call_per_slot(
            t in 50u64..2_000,
            slots in 1usize..5,
            jobs in proptest::collection::vec((0i64..500, 0u64..3_000), 1..60),
        ) {
            let mut st = ServiceTimes::new(ServiceTimeConfig::default());
            let key = "k";
            let mut free = vec![0i64; slots];
            let mut running: Vec<(i64, CallToken, u64)> = Vec::new(); // (ends at, token, duration)
            let (mut arrival, mut cuts) = (0i64, 0usize);
            for &(gap, extra) in &jobs {
                arrival += gap;
                let expires = arrival + (t + extra) as i64;
                let (i, &at) = free.iter().enumerate().min_by_key(|&(_, f)| *f).unwrap();
                let start = at.max(arrival);
                running.sort_by_key(|r| r.0);
                while running.first().is_some_and(|r| r.0 <= start) {
                    let (end, token, d) = running.remove(0);
                    st.call_ended(key, token);
                    st.observe(key, d, end);
                }
                let left = expires - start;
                let need = st.estimate(key, start).map_or(0, |e| e.quantile_ms as i64);
                if left <= 0 || left < need {
                    continue; // refused: the slot stays free
                }
                let token = st.call_started(key, start);
                let d = t.min(left as u64);
                if d < t {
                    cuts += 1;
                }
                running.push((start + d as i64, token, d));
                free[i] = start + d as i64;
            }
            prop_assert!(cuts <= slots, "{} cuts with {} slots", cuts, slots);
        }
    }

    #[test]
    fn short_prompts_get_a_short_estimate_when_the_kind_mixes_sizes() {
        // A length-dependent server: 50 ms + 2 ms per prompt token; 70% short prompts (10
        // tokens), 30% long (600). The per-kind p99 is a long call's.
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..100u64 {
            let p = if i % 10 < 7 { 10 } else { 600 };
            let d = 50 + 2 * p + (i * 7919) % 13; // a little noise
            let size = RequestSize {
                prompt_tokens: p,
                max_tokens: None,
            };
            st.observe_request("k", d, false, Some(size), i as i64);
        }
        let kind = st.estimate("k", 100).unwrap().quantile_ms;
        let at = |p| {
            let size = RequestSize {
                prompt_tokens: p,
                max_tokens: None,
            };
            st.estimate_for("k", Some(size), 100).unwrap().quantile_ms
        };
        assert!(kind >= 1_250, "the per-kind p99: {kind}");
        assert!(at(10) < 120, "a short prompt: {}", at(10));
        assert!(
            (1_250..1_400).contains(&at(600)),
            "a long prompt: {}",
            at(600)
        );
        // Without a size, the per-kind estimate.
        assert_eq!(st.estimate_for("k", None, 100).unwrap().quantile_ms, kind);
    }

    /// A kept predictor is the one a fresh fit gives until a call is recorded, a probe
    /// reweighs the cut calls, or [`PREDICTOR_REUSE_MS`] pass; a cold-start bound is not
    /// kept (it follows the running calls).
    #[test]
    fn the_predictor_cache_follows_every_recorded_call() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        let mut cache = PredictorCache::default();
        let est =
            |c: &mut PredictorCache, st: &ServiceTimes, now| c.get(st, "k", now).estimate(None);
        st.observe("k", 100, 0);
        let token = st.call_started("k", 0);
        assert_eq!(
            est(&mut cache, &st, 10).map(|e| e.source),
            Some(EstimateSource::LowerBound)
        );
        // The running call's elapsed time lifts the bound at once: nothing was kept.
        assert_eq!(est(&mut cache, &st, 500), st.estimate_for("k", None, 500));
        st.call_ended("k", token);
        for t in 1..=3 {
            st.observe("k", 100, t);
        }
        let before = st.revision();
        let first = est(&mut cache, &st, 10);
        assert_eq!(first, st.estimate_for("k", None, 10));
        assert_eq!(st.revision(), before, "estimating changes nothing");
        st.observe("k", 5_000, 20);
        assert_ne!(st.revision(), before);
        assert_eq!(est(&mut cache, &st, 30), st.estimate_for("k", None, 30));
        assert_ne!(
            est(&mut cache, &st, 30),
            first,
            "the new call counts at once"
        );
        // A probe that completes reweighs cut calls: a new revision.
        let r = st.revision();
        st.probe_ended("k", ProbeEnd::Completed { budget_ms: 1_000 }, 40);
        assert_ne!(st.revision(), r);
        // Within the reuse window the kept fit answers; past it, a fresh one.
        let kept = cache.get(&st, "k", 50);
        assert_eq!(
            cache
                .get(&st, "k", 50 + PREDICTOR_REUSE_MS - 1)
                .estimate(None),
            kept.estimate(None)
        );
        let later = 50 + PREDICTOR_REUSE_MS;
        assert_eq!(
            cache.get(&st, "k", later).estimate(None),
            st.estimate_for("k", None, later)
        );
    }

    #[test]
    fn without_request_awareness_every_request_gets_the_kinds_estimate() {
        // The estimator without request sizes, the benchmark's reference: the same calls as
        // above, and a short prompt is held to a long one's time.
        let mut st = ServiceTimes::new(ServiceTimeConfig {
            request_aware: false,
            ..ServiceTimeConfig::default()
        });
        for i in 0..100u64 {
            let p = if i % 10 < 7 { 10 } else { 600 };
            let size = RequestSize {
                prompt_tokens: p,
                max_tokens: None,
            };
            st.observe_request(
                "k",
                50 + 2 * p + (i * 7919) % 13,
                false,
                Some(size),
                i as i64,
            );
        }
        let kind = st.estimate("k", 100).unwrap();
        assert!(kind.quantile_ms >= 1_250, "the per-kind p99: {kind:?}");
        for p in [1, 10, 600, 5_000] {
            let size = RequestSize {
                prompt_tokens: p,
                max_tokens: Some(64),
            };
            assert_eq!(
                st.estimate_for("k", Some(size), 100),
                Some(kind),
                "{p} tokens"
            );
        }
    }

    #[test]
    fn calls_replayed_with_their_size_do_not_lock_a_short_request_out() {
        // A worker that starts replays the kind's recent calls from the ledger under the
        // prompt size their server reported: here long prompts' calls of ~1.25 s. A short
        // request, refused by them, may still be probed (they are all larger), and once
        // short calls complete the request-aware fit admits short requests on its own.
        // Replayed without a size, the same calls held every request to the kind's p99
        // and justified every refusal: a restarted worker refused the whole kind.
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        let long = Some(RequestSize {
            prompt_tokens: 600,
            max_tokens: None,
        });
        for i in 0..50u64 {
            st.observe_request("k", 1_250 + i % 7, false, long, i as i64);
        }
        let short = Some(RequestSize {
            prompt_tokens: 10,
            max_tokens: None,
        });
        let e = st.estimate_for("k", short, 100).unwrap();
        assert!(e.quantile_ms >= 1_250, "{e:?}");
        assert!(
            st.try_probe("k", short, 500, 100),
            "probed: every call was larger"
        );
        st.probe_ended("k", ProbeEnd::Completed { budget_ms: 500 }, 170);
        for i in 0..12u64 {
            let (p, d) = if i % 2 == 0 { (10, 70) } else { (600, 1_250) };
            let size = RequestSize {
                prompt_tokens: p,
                max_tokens: None,
            };
            st.observe_request("k", d + i % 3, false, Some(size), 200 + i as i64);
        }
        let e = st.estimate_for("k", short, 300).unwrap();
        assert!(
            e.quantile_ms < 500,
            "the fit now holds for short requests: {e:?}"
        );
        // Replayed without sizes: justified, never probed (the lock-out).
        let mut plain = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..50u64 {
            plain.observe("k", 1_250 + i % 7, i as i64);
        }
        assert!(!plain.try_probe("k", short, 500, 100));
    }

    /// The simulator's worst cold start: calls of 474 and 349 tokens took 2.6 and 2.1 s;
    /// then a prompt of 1,819 tokens came with 6.5 s of room. Before the fit holds it is
    /// held to their time scaled by its size (about 9.8 s): refused, and not probed (the
    /// two calls' line, 900 ms + 3.5 ms a token, expects 7.3 s).
    #[test]
    fn before_the_fit_a_larger_request_is_scaled_and_not_probed_past_the_calls_line() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        st.observe_request("k", 2_559, false, tokens(474), 800);
        st.observe_request("k", 2_122, false, tokens(349), 3_400);
        let at = |st: &ServiceTimes, n| st.estimate_for("k", tokens(n), 5_480).unwrap();
        assert_eq!(at(&st, 400).quantile_ms, 2_559, "no larger: the bound");
        let big = at(&st, 1_819);
        assert!((9_700..=9_900).contains(&big.quantile_ms), "{big:?}");
        assert!(!st.try_probe("k", tokens(1_819), 6_529, 5_480));
        // Room for the line's 7.3 s: probed.
        assert!(st.try_probe("k", tokens(1_819), 7_500, 5_480));
        // A call of unknown size in the window: no scaling (its size is not known).
        st.observe("k", 1_000, 5_500);
        assert_eq!(Some(at(&st, 1_819)), st.estimate("k", 5_480));
    }

    /// A probe of a request whose completed calls' fit puts its mean within the room but
    /// its high quantile past it is not run: those are the long prompts that a window of
    /// mostly short calls underestimates.
    #[test]
    fn no_probe_when_the_completed_calls_quantile_does_not_fit() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..40u64 {
            // 1 s + 3 ms a token, ±30%.
            let n = 50 + (i * 37) % 400;
            let d = ((1_000 + 3 * n) as f64 * (0.7 + 0.6 * ((i * 7) % 10) as f64 / 9.0)) as u64;
            st.observe_request("k", d, false, tokens(n), i as i64 * 100);
        }
        let now = 4_000;
        let e = st.estimate_for("k", tokens(1_500), now).unwrap();
        let mean = e.mean_ms;
        let fitted = st
            .predictor("k", now)
            .fit
            .map(|f| f.model.predict([1_500.0, 0.0]) * f.q)
            .unwrap();
        assert!(fitted > mean as f64 * 1.1, "{fitted} vs {mean}");
        let room = ((mean as f64 + fitted) / 2.0) as u64;
        assert!(room < e.quantile_ms, "the estimate refuses it");
        assert!(!st.try_probe("k", tokens(1_500), room, now));
        assert!(st.try_probe("k", tokens(1_500), fitted as u64 + 1, now));
    }

    fn tokens(n: u64) -> Option<RequestSize> {
        Some(RequestSize {
            prompt_tokens: n,
            max_tokens: None,
        })
    }

    #[test]
    fn no_probe_when_the_completed_calls_fit_expects_the_request_to_overrun() {
        // 50 ms + 2 ms per token, 10 to 600 tokens: a 2,000-token request is larger than
        // every completed call, and its refusal rests on an extrapolation; but the fit of
        // the completed calls expects ~4 s, so a probe with 3 s of room would be cut.
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..30u64 {
            let n = 10 + i * 20;
            st.observe_request("k", 50 + 2 * n, false, tokens(n), i as i64);
        }
        assert!(!st.try_probe("k", tokens(2_000), 3_000, 100));
        assert!(st.try_probe("k", tokens(2_000), 5_000, 100));
    }

    #[test]
    fn at_a_cold_start_a_probe_needs_room_for_the_longest_smaller_call() {
        // Two completed calls (too few for a quantile): a request at least as large as
        // both takes at least the longer one's time.
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        st.observe_request("k", 1_000, false, tokens(100), 0);
        st.observe_request("k", 800, false, tokens(50), 1);
        st.observe_request("k", 9_000, true, tokens(1_000), 2);
        assert!(
            !st.try_probe("k", tokens(200), 500, 10),
            "156 ms for a call of seconds"
        );
        assert!(st.try_probe("k", tokens(200), 2_000, 10));
        // Smaller than every completed call: it takes at least its share of each (call
        // time is affine with a fixed part ≥ 0): 10/50 of 800 ms = 160 ms.
        assert!(st.try_probe("k", tokens(10), 500, 10));
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        st.observe_request("k", 1_000, false, tokens(100), 0);
        st.observe_request("k", 800, false, tokens(50), 1);
        assert!(!st.try_probe("k", tokens(10), 150, 10), "160 ms at least");
    }

    #[test]
    fn at_a_cold_start_a_probe_needs_room_for_its_share_of_larger_calls() {
        // The simulator's cold run (seed 4 at 2×): after calls of 474 and 349 tokens that
        // took 2.6 and 2.1 s, a 112-token prompt with 518 ms left was probed and cut (it
        // took 1.3 s). 112/349 of 2,122 ms is 681 ms: no probe.
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        st.observe_request("k", 2_559, false, tokens(474), 0);
        st.observe_request("k", 2_122, false, tokens(349), 1);
        assert!(!st.try_probe("k", tokens(112), 518, 10));
        assert!(st.try_probe("k", tokens(112), 700, 10));
    }

    #[test]
    fn the_lower_share_is_the_smallest_ratio_of_sizes_at_most_one() {
        assert_eq!(lower_share([10.0, 0.0], [50.0, 0.0]), 0.2);
        assert_eq!(lower_share([100.0, 0.0], [50.0, 0.0]), 1.0);
        // Both features: the smaller ratio; a feature the call did not have says nothing.
        assert_eq!(lower_share([100.0, 8.0], [200.0, 64.0]), 0.125);
        assert_eq!(lower_share([100.0, 8.0], [200.0, 0.0]), 0.5);
        assert_eq!(lower_share([0.0, 0.0], [0.0, 0.0]), 1.0);
    }

    #[test]
    fn small_requests_do_not_crowd_the_large_ones_out_of_the_window() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        let small = RequestSize {
            prompt_tokens: 10,
            max_tokens: None,
        };
        let large = RequestSize {
            prompt_tokens: 600,
            max_tokens: None,
        };
        for i in 0..20 {
            st.observe_request("k", 1_250, false, Some(large), i);
        }
        // A thousand small calls: the last 16 large ones stay, and a large job is still
        // held to a large call's time.
        for i in 0..1_000 {
            st.observe_request("k", 70, false, Some(small), 100 + i);
        }
        let e = st.estimate_for("k", Some(large), 1_200).unwrap();
        assert!((1_250..1_500).contains(&e.quantile_ms), "{e:?}");
        assert!(
            st.estimate_for("k", Some(small), 1_200)
                .unwrap()
                .quantile_ms
                < 100
        );
    }

    #[test]
    fn a_request_larger_than_any_seen_is_not_held_to_a_small_ones_time() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        let small = RequestSize {
            prompt_tokens: 10,
            max_tokens: None,
        };
        for i in 0..50 {
            st.observe_request("k", 70 + i % 3, false, Some(small), i as i64);
        }
        // Nothing of 600 tokens was seen: at least the kind's p99 × 600 / 10.
        let large = RequestSize {
            prompt_tokens: 600,
            max_tokens: None,
        };
        let kind = st.estimate("k", 60).unwrap().quantile_ms;
        let e = st.estimate_for("k", Some(large), 60).unwrap();
        assert!(e.quantile_ms >= kind * 50, "{e:?} (kind {kind})");
    }

    #[test]
    fn without_probes_a_hang_locks_the_estimate_out() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..40 {
            st.observe("k", 150, i * 100);
        }
        for i in 0..4 {
            st.observe_cut("k", 3_000, 8_000 + i);
        }
        // Healthy again, but nothing runs: the estimate stays above a 3 s budget.
        assert!(st.estimate("k", 20_000).unwrap().quantile_ms >= 3_000);
        // The refusal rests on the cut calls alone: a probe may run. Each one that
        // completes within 2.9 s divides the cut calls' weight by 8; two bring the
        // estimate back to the healthy calls.
        for i in 0..2 {
            assert!(st.try_probe("k", None, 2_900, 20_000 + i * 200));
            st.observe("k", 150, 20_150 + i * 200);
            st.probe_ended(
                "k",
                ProbeEnd::Completed { budget_ms: 2_900 },
                20_150 + i * 200,
            );
        }
        let e = st.estimate("k", 21_500).unwrap();
        assert_eq!(e.quantile_ms, 150, "{e:?}");
    }

    #[test]
    fn no_probe_while_a_call_runs_far_longer_than_completed_calls_take() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..10 {
            st.observe("k", 100, i * 100);
        }
        st.observe_cut("k", 3_000, 2_000);
        let hung = st.call_started("k", 2_000);
        assert!(
            !st.try_probe("k", None, 2_900, 2_500),
            "a call has run 500 ms, calls take 100"
        );
        st.call_ended("k", hung);
        assert!(st.try_probe("k", None, 2_900, 2_500));
    }

    #[test]
    fn a_refusal_that_completed_calls_justify_is_never_probed() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..10 {
            st.observe("k", 1_000, i * 1_000);
        }
        // 600 ms of room for calls that complete in 1 s: no probe, whatever the wait.
        assert!(!st.try_probe("k", None, 600, 10_000));
        assert!(!st.try_probe("k", None, 600, 500_000));
        // With room for them it is not a refusal; the estimator grants, the caller asks
        // only when refused.
        assert!(st.try_probe("k", None, 1_000, 10_000));
    }

    /// A kind whose first completed calls were all long prompts: before the request-aware
    /// fit holds, a short request is held to the kind's estimate and refused. The refusal
    /// rests on larger requests only, so it may run as a probe; a short request of the same
    /// refusal is never probed once calls of its own size justify it.
    #[test]
    fn a_refusal_resting_on_larger_requests_only_is_probed_until_the_fit_holds() {
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        let long = |t: u64| RequestSize {
            prompt_tokens: t,
            max_tokens: None,
        };
        for i in 0..5 {
            st.observe_request("k", 2_800, false, Some(long(1_200)), i * 100);
        }
        let short = Some(long(10));
        let e = st.estimate_for("k", short, 1_000).unwrap();
        assert!(e.quantile_ms >= 2_800, "held to the kind's estimate: {e:?}");
        // Without a size, or as large as the calls it rests on, no probe: they justify it.
        assert!(!st.try_probe("k", None, 2_400, 1_000));
        assert!(!st.try_probe("k", Some(long(1_200)), 2_400, 1_000));
        // A short request: probes run, and their completions train the fit.
        let mut now = 1_000;
        for _ in 0..MIN_SIZED {
            assert!(st.try_probe("k", short, 2_400, now), "at {now}");
            now += 70;
            st.observe_request("k", 70, false, short, now);
            st.probe_ended("k", ProbeEnd::Completed { budget_ms: 2_400 }, now);
        }
        // Calls of its own size now justify or admit a short request by themselves.
        let e = st.estimate_for("k", short, now).unwrap();
        assert!(
            e.quantile_ms < 2_400,
            "the fit admits a short request: {e:?}"
        );
        let slow = |st: &mut ServiceTimes, now| {
            for i in 0..10 {
                st.observe_request("k", 2_600, false, Some(long(5)), now + i);
            }
        };
        slow(&mut st, now);
        assert!(!st.try_probe("k", short, 2_400, now + 20));
    }

    #[test]
    fn a_request_larger_than_every_completed_one_may_be_probed_without_taking_a_probe() {
        // Only short prompts completed (70 ms at 10 tokens): a 600-token one is held to the
        // through-origin extrapolation, seconds, and refused with 2.4 s of room.
        let c = ServiceTimeConfig::default();
        let mut st = ServiceTimes::new(c);
        let size = |t: u64| {
            Some(RequestSize {
                prompt_tokens: t,
                max_tokens: None,
            })
        };
        for i in 0..40 {
            st.observe_request("k", 70, false, size(10), i * 10);
        }
        let e = st.estimate_for("k", size(600), 500).unwrap();
        assert!(e.quantile_ms > 2_400, "extrapolated: {e:?}");
        // The refusal rests on smaller requests only: a probe may question it, and asking
        // takes nothing — as often as asked, while every probe place is taken.
        for _ in 0..c.max_probes {
            assert!(st.try_probe("k", size(600), 2_400, 500));
        }
        assert!(!st.try_probe("k", size(600), 2_400, 500), "places taken");
        assert!(st.may_probe("k", size(600), 2_400, 500));
        assert!(st.may_probe("k", size(600), 2_400, 500));
        // Completed calls of its own size justify the refusal: neither.
        for i in 0..40 {
            st.observe_request("k", 3_000, false, size(600), 1_000 + i);
        }
        assert!(!st.may_probe("k", size(600), 2_400, 1_100));
        assert!(!st.try_probe("k", size(600), 2_400, 1_100));
    }

    #[test]
    fn probes_are_bounded_in_flight_and_paced_after_waste() {
        let c = ServiceTimeConfig::default();
        let mut st = ServiceTimes::new(c);
        st.observe_cut("k", 3_000, 0);
        for _ in 0..c.max_probes {
            assert!(st.try_probe("k", None, 2_900, 10));
        }
        assert!(
            !st.try_probe("k", None, 2_900, 10),
            "at most max_probes in flight"
        );
        st.probe_ended("k", ProbeEnd::Released, 20);
        assert!(
            st.try_probe("k", None, 2_900, 20),
            "a released probe frees its place"
        );
        // Probes cut after 2 s each: the first four spend the 8 s burst, and a fifth,
        // started on what credit had grown back, leaves 2 s owed: 38 s to earn back at a
        // 5% share.
        for _ in 0..4 {
            st.probe_ended("k", ProbeEnd::Wasted { duration_ms: 2_000 }, 2_020);
        }
        st.probe_ended("k", ProbeEnd::Released, 2_020);
        assert!(!st.try_probe("k", None, 2_900, 2_020), "the burst is spent");
        assert!(
            st.try_probe("k", None, 2_900, 2_021),
            "credit grew back a little"
        );
        st.probe_ended("k", ProbeEnd::Wasted { duration_ms: 2_000 }, 4_021);
        assert!(!st.try_probe("k", None, 2_900, 4_022));
        assert!(!st.try_probe("k", None, 2_900, 38_900));
        assert!(st.try_probe("k", None, 2_900, 40_200));
    }

    #[test]
    fn a_cold_start_counts_the_running_call_and_the_first_ended_one() {
        // One slot, calls of 1.5 s: B waited for A and has 1 s left when A ends.
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        assert_eq!(st.estimate("k", 0), None);
        let a = st.call_started("k", 0);
        assert_eq!(st.estimate("k", 1_000).map(|e| e.quantile_ms), Some(1_000));
        st.call_ended("k", a);
        st.observe("k", 1_500, 1_500);
        let e = st.estimate("k", 1_500).unwrap();
        assert_eq!(
            (e.quantile_ms, e.source),
            (1_500, EstimateSource::LowerBound)
        );
    }

    #[test]
    fn recent_calls_weigh_more() {
        let c = ServiceTimeConfig {
            fit: false,
            half_life_ms: 1_000,
            ..ServiceTimeConfig::default()
        };
        let mut st = ServiceTimes::new(c);
        // Ten slow calls long ago, then healthy ones: the slow ones' weight has halved
        // ten times, so the p99 is the healthy calls'.
        for i in 0..10 {
            st.observe("k", 2_000, i);
        }
        for i in 0..90 {
            st.observe("k", 100, 10_000 + i);
        }
        assert_eq!(st.estimate("k", 10_100).unwrap().quantile_ms, 100);
        // With equal weights the slow ones would hold the p99.
        let mut flat = ServiceTimes::new(ServiceTimeConfig {
            half_life_ms: 0,
            ..c
        });
        for i in 0..10 {
            flat.observe("k", 2_000, i);
        }
        for i in 0..90 {
            flat.observe("k", 100, 10_000 + i);
        }
        assert_eq!(flat.estimate("k", 10_100).unwrap().quantile_ms, 2_000);
    }

    /// A deterministic stream of uniform numbers in `[0, 1)` (xorshift64).
    fn uniform(seed: u64) -> impl FnMut() -> f64 {
        let mut x = seed.max(1);
        move || {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 11) as f64 / (1u64 << 53) as f64
        }
    }

    /// `n` calls of a server taking 50 ms + 2 ms per prompt token (counted), with prompts
    /// of 20 to 2,000 tokens (log-uniform), whose measure before the call is the count ×
    /// a factor drawn from `[1 - noise, 1 + noise]`, ÷ `scale`: (measure, count, ms).
    fn noisy_calls(n: usize, noise: f64, scale: f64, seed: u64) -> Vec<(u64, u64, u64)> {
        let mut u = uniform(seed);
        (0..n)
            .map(|_| {
                let tokens = (20f64.ln() + u() * (2_000f64.ln() - 20f64.ln()))
                    .exp()
                    .round();
                let measure = (tokens * (1.0 + noise * (2.0 * u() - 1.0)) / scale).round();
                (
                    measure.max(1.0) as u64,
                    tokens as u64,
                    50 + 2 * tokens as u64,
                )
            })
            .collect()
    }

    proptest! {
        /// Counted tokens equal to the measure, or a constant multiple of it, change no
        /// estimate: the calibration and the fit's slope absorb the factor.
        #[test]
        fn counts_proportional_to_the_measure_change_no_estimate(
            calls in proptest::collection::vec((1u64..3_000, 1u64..20_000, any::<bool>()), 8..60),
            factor in prop_oneof![Just(1.0f64), 0.5f64..3.0],
            asked in proptest::collection::vec(1u64..4_000, 1..8),
        ) {
            let mut plain = ServiceTimes::new(ServiceTimeConfig::default());
            let mut counted = ServiceTimes::new(ServiceTimeConfig::default());
            for (i, &(m, d, cut)) in calls.iter().enumerate() {
                plain.observe_request("k", d, cut, tokens(m), i as i64);
                let used = (m as f64 * factor).round() as u64;
                counted.observe_counted("k", d, cut, tokens(m), Some(used), i as i64);
            }
            let now = calls.len() as i64;
            for &a in &asked {
                let (p, c) = (
                    plain.estimate_for("k", tokens(a), now).map(|e| e.quantile_ms),
                    counted.estimate_for("k", tokens(a), now).map(|e| e.quantile_ms),
                );
                if factor == 1.0 {
                    prop_assert_eq!(p, c);
                } else {
                    // The counts are rounded to whole tokens: a call's time moves by its
                    // slope × half a token at most.
                    let (p, c) = (p.unwrap_or(0) as f64, c.unwrap_or(0) as f64);
                    prop_assert!((p - c).abs() <= 0.02 * p.max(c) + 2.0, "{} vs {}", p, c);
                }
            }
        }
    }

    #[test]
    fn the_fit_on_counted_tokens_is_not_flattened_by_the_measures_error() {
        // The measure is off by up to ±50% per request: fitted on it, the slope is
        // attenuated (errors in the regressor); fitted on the counted tokens, it is the
        // server's 2 ms a token.
        let calls = noisy_calls(120, 0.5, 1.0, 7);
        let (mut plain, mut counted) = (
            ServiceTimes::new(ServiceTimeConfig::default()),
            ServiceTimes::new(ServiceTimeConfig::default()),
        );
        for &(m, t, d) in &calls {
            plain.observe_request("k", d, false, tokens(m), 0);
            counted.observe_counted("k", d, false, tokens(m), Some(t), 0);
        }
        let slope = |st: &ServiceTimes| {
            let w = st.keys.get("k").unwrap();
            st.sized(w, st.calibration(w, 0), 0, false)
                .unwrap()
                .model
                .slopes[0]
        };
        let (p, c) = (slope(&plain), slope(&counted));
        assert!(p < 1.9, "fitted on the measure: {p}");
        assert!((1.98..2.02).contains(&c), "fitted on the counts: {c}");
    }

    #[test]
    fn with_counted_tokens_the_quantile_still_covers_the_measures_error() {
        // The server is exact (50 ms + 2 ms a token): every call's error is the measure's.
        // A p99 fitted on the counts but judged on them would be the line itself, and cut
        // half the calls; judged on the predictions from the measure, it covers them.
        let (mut st, learned) = (
            ServiceTimes::new(ServiceTimeConfig::default()),
            noisy_calls(128, 0.3, 1.0, 11),
        );
        for &(m, t, d) in &learned {
            st.observe_counted("k", d, false, tokens(m), Some(t), 0);
        }
        let fresh = noisy_calls(2_000, 0.3, 1.0, 12);
        let over = (fresh.iter())
            .filter(|&&(m, _, d)| d > st.estimate_for("k", tokens(m), 0).unwrap().quantile_ms)
            .count();
        assert!(over <= 60, "{over} of 2,000 calls over their p99");
    }

    #[test]
    fn calls_known_only_by_their_count_are_in_the_calibrated_unit() {
        // A worker measures a prompt at 1.5 counted tokens a unit... the other way: the
        // measure is ⅔ of the count. Calls replayed from an older ledger know only the
        // count; live ones know both. A request measured at 400 (600 counted tokens) takes
        // 50 + 1,200 ms: the calibration puts the measure in the count's unit.
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for (i, &(_, t, d)) in noisy_calls(40, 0.0, 1.5, 3).iter().enumerate() {
            st.observe_counted("k", d, false, None, Some(t), i as i64);
        }
        for (i, &(m, t, d)) in noisy_calls(12, 0.0, 1.5, 4).iter().enumerate() {
            st.observe_counted("k", d, false, tokens(m), Some(t), 40 + i as i64);
        }
        let e = st.estimate_for("k", tokens(400), 52).unwrap();
        assert!(
            (1_220..1_300).contains(&e.mean_ms),
            "mean {} for 600 counted tokens",
            e.mean_ms
        );
        // Without the counts of the live calls (their measure only), the replayed ones'
        // count and the live ones' measure would be mixed as one unit.
        let mut mixed = ServiceTimes::new(ServiceTimeConfig::default());
        for (i, &(_, t, d)) in noisy_calls(40, 0.0, 1.5, 3).iter().enumerate() {
            mixed.observe_counted("k", d, false, None, Some(t), i as i64);
        }
        for (i, &(m, _, d)) in noisy_calls(12, 0.0, 1.5, 4).iter().enumerate() {
            mixed.observe_request("k", d, false, tokens(m), 40 + i as i64);
        }
        let e = mixed.estimate_for("k", tokens(400), 52).unwrap();
        assert!(e.mean_ms < 1_150, "mixed units: mean {}", e.mean_ms);
    }

    #[test]
    fn counts_that_do_not_follow_the_measure_are_not_used() {
        // A server that reports the same prompt count for every request (a fake, or a
        // proxy's) would leave the fit no size to go by: the short prompts would be held
        // to the long ones' time again. Its counts are ignored.
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..100u64 {
            let p = if i % 10 < 7 { 10 } else { 600 };
            let d = 50 + 2 * p + (i * 7919) % 13;
            st.observe_counted("k", d, false, tokens(p), Some(5), i as i64);
        }
        let short = st.estimate_for("k", tokens(10), 100).unwrap().quantile_ms;
        assert!(short < 120, "a short prompt: {short}");
    }

    #[test]
    fn a_count_with_the_templates_tokens_is_calibrated_with_an_offset() {
        // llama-server's count of a SmolLM2 prompt includes its default system prompt:
        // about 30 tokens + 0.85 × the measure, as measured. Through the origin,
        // a short prompt's count would be put at a third of its real 60, its calls would
        // look 2–3× slower than predicted, and that ratio would inflate every estimate.
        let mut u = uniform(5);
        let (mut plain, mut counted) = (
            ServiceTimes::new(ServiceTimeConfig::default()),
            ServiceTimes::new(ServiceTimeConfig::default()),
        );
        for i in 0..120 {
            let m = (30f64.ln() + u() * (600f64.ln() - 30f64.ln()))
                .exp()
                .round();
            let t = (30.0 + 0.85 * m).round();
            let d = ((100.0 + 6.0 * t) * (1.0 + 0.2 * u())) as u64;
            plain.observe_request("k", d, false, tokens(m as u64), i);
            counted.observe_counted("k", d, false, tokens(m as u64), Some(t as u64), i);
        }
        for m in [35, 150, 580] {
            let (p, c) = (
                plain.estimate_for("k", tokens(m), 120).unwrap().quantile_ms as f64,
                counted
                    .estimate_for("k", tokens(m), 120)
                    .unwrap()
                    .quantile_ms as f64,
            );
            assert!(
                (c / p - 1.0).abs() < 0.05,
                "measure {m}: {c} ms, on the measure {p} ms"
            );
        }
    }

    #[test]
    fn a_request_is_compared_with_the_calls_as_they_were_measured() {
        // Two prompt sizes, 10 and 600 counted tokens, measured ±30%: a long prompt
        // measured at 700 is one of the long ones, not larger than every call seen (the
        // largest count), which would hold it to the kind's time scaled up.
        let mut u = uniform(9);
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        for i in 0..100 {
            let t = if i % 10 < 7 { 10.0 } else { 600.0 };
            let m = (t * (1.0 + 0.3 * (2.0 * u() - 1.0))).round() as u64;
            let d = (50.0 + 2.0 * t) as u64 + (i * 7919) % 13;
            st.observe_counted("k", d, false, tokens(m), Some(t as u64), i as i64);
        }
        let w = st.keys.get("k").unwrap();
        let f = st.sized(w, st.calibration(w, 100), 100, false).unwrap();
        assert!(
            f.seen[0] > 700.0,
            "the range in measured units: {}",
            f.seen[0]
        );
        let k = st.calibration(w, 100).unwrap();
        let e = st.estimate_for("k", tokens(700), 100).unwrap();
        let fitted = (f.model.predict(k.apply([700.0, 0.0])) * f.q - 1e-6).ceil() as u64;
        assert_eq!(e.quantile_ms, fitted);
    }

    #[test]
    fn at_a_cold_start_a_longer_prompt_with_fewer_output_tokens_is_not_probed_on_the_smaller_one() {
        // Seen on the real llama-server: after one call of 918 prompt tokens
        // and 42 `max_tokens` that took 5,526 ms, a request of 1,039 and 9 with 5,322 ms
        // left was probed (the bound on its smaller feature: 9/42 of the call, 1.2 s) and
        // ran past its deadline.
        let sized = |p, m| {
            Some(RequestSize {
                prompt_tokens: p,
                max_tokens: Some(m),
            })
        };
        let mut st = ServiceTimes::new(ServiceTimeConfig::default());
        st.observe_request("k", 5_526, false, sized(918, 42), 0);
        assert!(!st.try_probe("k", sized(1_039, 9), 5_322, 10));
        assert!(st.try_probe("k", sized(1_039, 9), 5_600, 10));
        // Smaller in both: the bound as before (100/918 of the call, 602 ms).
        assert!(st.try_probe("k", sized(100, 9), 700, 10));
        assert_eq!(cold_share([1_039.0, 9.0], [918.0, 42.0]), 1.0);
        assert_eq!(cold_share([100.0, 8.0], [200.0, 64.0]), 0.125);
    }
}
