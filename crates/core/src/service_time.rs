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
//! - **No clock**: like the rest of the crate, every function takes `now_ms`.

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
        }
    }
}

impl ServiceTimeConfig {
    /// The same settings brought into range: `window` in `1..=MAX_WINDOW`, `quantile` in
    /// `(0, 1]` (a NaN becomes the default 0.99), `min_samples` in `1..=window`,
    /// `max_age_ms ≥ 1`, `max_keys ≥ 1`.
    pub fn clamped(self) -> Self {
        let window = self.window.clamp(1, MAX_WINDOW);
        let quantile = if self.quantile.is_nan() {
            Self::default().quantile
        } else {
            self.quantile.clamp(f64::MIN_POSITIVE, 1.0)
        };
        Self {
            window,
            quantile,
            min_samples: self.min_samples.clamp(1, window),
            max_age_ms: self.max_age_ms.max(1),
            max_keys: self.max_keys.max(1),
            fit: self.fit,
        }
    }

    /// How many observations of a slower duration, arriving into a full window, bring the
    /// quantile up to it: `W − ⌈q·W⌉ + 1` (nearest rank). One fewer does not.
    pub fn slowdown_observations(&self) -> usize {
        let c = self.clamped();
        c.window - nearest_rank(c.quantile, c.window) + 1
    }

    fn is_fresh(&self, observed_at_ms: i64, now_ms: i64) -> bool {
        now_ms.saturating_sub(observed_at_ms) <= self.max_age_ms
    }
}

/// Which samples an [`Estimate`] was computed from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum EstimateSource {
    /// The key's own window.
    Key,
    /// The fallback: the last `window` observations of any key.
    AllKeys,
}

/// What is known about a key's call durations at some `now_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// The configured high quantile (p99 by default): the minimum useful runtime. The
    /// nearest-rank quantile of the samples, or (with `fit`) the fitted lognormal's when
    /// that is larger.
    pub quantile_ms: u64,
    /// The mean of the same samples, rounded to the nearest ms: for expected-wait
    /// computations ([`crate::wait::expected_wait_ms`]), which want a mean, not a bound.
    pub mean_ms: u64,
    /// How many fresh samples the estimate is over (at least `min_samples`).
    pub samples: usize,
    /// Whether the key's own window or the all-keys fallback was used.
    pub source: EstimateSource,
}

#[derive(Debug, Clone, Copy)]
struct Sample {
    at_ms: i64,
    duration_ms: u64,
}

#[derive(Debug, Clone)]
struct KeyWindow {
    samples: VecDeque<Sample>,
    /// The estimator's observation counter at this key's last observation: a counter, not
    /// `now_ms`, so that least-recently-observed is well defined even if the clock steps back.
    last_seen: u64,
}

/// Learned call durations per key, with a fallback over all keys. Pure: no IO, no clock.
#[derive(Debug, Clone)]
pub struct ServiceTimes {
    cfg: ServiceTimeConfig,
    keys: HashMap<String, KeyWindow>,
    all: VecDeque<Sample>,
    observations: u64,
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
        }
    }

    /// The settings in use, after clamping.
    pub fn config(&self) -> ServiceTimeConfig {
        self.cfg
    }

    /// Record one call duration under `key`, observed at `now_ms`.
    ///
    /// Record completed calls, and also calls cut at the deadline, whose duration is only a
    /// lower bound: leaving those out would hide a model that got slower than every budget,
    /// because only the calls fast enough to finish would be seen.
    pub fn observe(&mut self, key: &str, duration_ms: u64, now_ms: i64) {
        self.observations += 1;
        let sample = Sample {
            at_ms: now_ms,
            duration_ms,
        };
        push(&mut self.all, sample, &self.cfg);
        if let Some(w) = self.keys.get_mut(key) {
            push(&mut w.samples, sample, &self.cfg);
            w.last_seen = self.observations;
            return;
        }
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
        let mut samples = VecDeque::with_capacity(self.cfg.window);
        samples.push_back(sample);
        self.keys.insert(
            key.to_owned(),
            KeyWindow {
                samples,
                last_seen: self.observations,
            },
        );
    }

    /// The estimate for `key` at `now_ms`: from its own window when that holds at least
    /// `min_samples` fresh samples; else from the last `window` observations of any key
    /// (the fresh ones) when those are at least `min_samples`; else `None`: nothing learned,
    /// and the caller uses its configured floor.
    pub fn estimate(&self, key: &str, now_ms: i64) -> Option<Estimate> {
        self.keys
            .get(key)
            .and_then(|w| self.summarize(&w.samples, now_ms, EstimateSource::Key))
            .or_else(|| self.summarize(&self.all, now_ms, EstimateSource::AllKeys))
    }

    /// The number of distinct keys held (at most `max_keys`).
    pub fn keys(&self) -> usize {
        self.keys.len()
    }

    fn summarize(
        &self,
        window: &VecDeque<Sample>,
        now_ms: i64,
        source: EstimateSource,
    ) -> Option<Estimate> {
        let mut durations: Vec<u64> = window
            .iter()
            .filter(|s| self.cfg.is_fresh(s.at_ms, now_ms))
            .map(|s| s.duration_ms)
            .collect();
        let n = durations.len();
        if n < self.cfg.min_samples {
            return None;
        }
        durations.sort_unstable();
        let sum: u128 = durations.iter().map(|&d| u128::from(d)).sum();
        // Rounded to nearest; never above the largest sample, so it fits.
        let mean = (sum + n as u128 / 2) / n as u128;
        let empirical = durations[nearest_rank(self.cfg.quantile, n) - 1];
        let fitted = if self.cfg.fit {
            lognormal_quantile(&durations, self.cfg.quantile)
        } else {
            None
        };
        let quantile_ms = match fitted {
            Some(f) => {
                let cap = durations[n - 1] as f64 * FIT_CAP;
                // Rounded up, with a tolerance for the float error of a constant window's
                // zero spread; float-to-int casts saturate.
                empirical.max((f.min(cap) - 1e-6).ceil() as u64)
            }
            None => empirical,
        };
        Some(Estimate {
            quantile_ms,
            mean_ms: u64::try_from(mean).unwrap_or(u64::MAX),
            samples: n,
            source,
        })
    }
}

/// Append `sample` to a window: stale samples go first, then the oldest while full.
fn push(window: &mut VecDeque<Sample>, sample: Sample, cfg: &ServiceTimeConfig) {
    window.retain(|s| cfg.is_fresh(s.at_ms, sample.at_ms));
    while window.len() >= cfg.window {
        window.pop_front();
    }
    window.push_back(sample);
}

/// The `q`-quantile of the lognormal fitted to `durations` (the mean and the sample
/// standard deviation of their logarithms; a 0 ms sample counts as 1 ms): `None` with fewer
/// than two samples or for `q` outside `(0.5, 1)`.
fn lognormal_quantile(durations: &[u64], q: f64) -> Option<f64> {
    let n = durations.len();
    if n < 2 || !(q > 0.5 && q < 1.0) {
        return None;
    }
    let logs = || durations.iter().map(|&d| (d.max(1) as f64).ln());
    let mean = logs().sum::<f64>() / n as f64;
    let var = logs().map(|x| (x - mean) * (x - mean)).sum::<f64>() / (n - 1) as f64;
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

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

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
            // The nearest-rank properties below; the fit has its own tests.
            fit: false,
            ..ServiceTimeConfig::default()
        }
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
        assert_eq!(d.clamped(), d);
        let c = ServiceTimeConfig {
            window: 0,
            quantile: 0.0,
            min_samples: 5,
            max_age_ms: -3,
            max_keys: 0,
            fit: false,
        }
        .clamped();
        assert_eq!(
            (c.window, c.min_samples, c.max_age_ms, c.max_keys),
            (1, 1, 1, 1)
        );
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
        assert_eq!(st.estimate("summarize|a", 2), None);
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
                Some((EstimateSource::AllKeys, all))
            } else {
                None
            };
            let got = st.estimate(KEYS[key], now);
            prop_assert_eq!(got.is_some(), expected.is_some());
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
    }
}
