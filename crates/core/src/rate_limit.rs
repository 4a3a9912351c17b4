//! Per-backend rate limits: requests per minute and tokens per minute, as token buckets.
//! Pure: every instant is an argument.
//!
//! A [`RateLimiter`] holds two buckets, one for requests and one for tokens. Each bucket's
//! capacity is its limit per minute and it refills continuously at that limit per minute
//! (the way OpenAI describes its own limits), so over any interval of `t` ms it grants at
//! most `limit + limit · t / 60 000`. The limit is the configured one, or the one the
//! server states in its `x-ratelimit-limit-*` headers ([`RateLimiter::observe`]), the
//! smaller of the two when both are known.
//!
//! The server's `x-ratelimit-remaining-*` and `x-ratelimit-reset-*` only ever tighten:
//! until the reset instant, no more than `remaining` permits are granted (each grant
//! counts it down), and the local level is lowered to `remaining` if it was higher (other
//! clients of the same server used the rest). A header never raises the level.
//!
//! The worker asks [`RateLimiter::permit_at`] when a call could go out and compares it
//! with the job's latest useful start: it waits for a permit that comes in time, and
//! refuses the job at once (`admission:rate_limited`) otherwise.
//!
//! **Headers are advice, not orders**: a server's word never holds the backend
//! for long.
//! - A reset (and a 429's `Retry-After`) further out than [`RateLimiter::new`]'s
//!   `max_hold_ms` (the worker's `--breaker-max-cool-down-ms`) ends at `max_hold_ms`.
//! - A learned limit expires [`LEARNED_TTL_MS`] after the server last stated it, and is
//!   never below [`MIN_LEARNED_REQUESTS`] / [`MIN_LEARNED_TOKENS`] per minute.
//! - A trial call is always possible: a request larger than a learned (not configured)
//!   limit goes when the bucket is full, instead of never.
//! - A bucket's debt (a call that reported more tokens than it reserved) is at most one
//!   minute's worth.

/// The window the limits are stated in: one minute.
pub const WINDOW_MS: u64 = 60_000;

/// Output tokens a request is assumed to ask for when its payload sets no `max_tokens`
/// (for the tokens bucket; the call's reported usage corrects it afterwards).
pub const DEFAULT_OUTPUT_TOKENS: u64 = 256;

/// How long a limit learned from the headers holds after the server last stated it.
pub const LEARNED_TTL_MS: i64 = 10 * WINDOW_MS as i64;

/// The lowest learned requests per minute: a header stating less is taken as this.
pub const MIN_LEARNED_REQUESTS: u64 = 1;

/// The lowest learned tokens per minute: a header stating less is taken as this.
pub const MIN_LEARNED_TOKENS: u64 = 1_000;

/// Configured limits of one backend; `None`: no configured limit (a server's headers may
/// still set one).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Limits {
    pub requests_per_minute: Option<u64>,
    pub tokens_per_minute: Option<u64>,
}

impl Limits {
    /// Parse `rpm=N,tpm=N` (either part may be left out; at least one must be there).
    pub fn parse(s: &str) -> Result<Self, String> {
        let mut out = Limits::default();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("`{part}`: expected rpm=N or tpm=N"))?;
            let n: u64 = value
                .trim()
                .parse()
                .ok()
                .filter(|n| *n > 0)
                .ok_or_else(|| format!("`{value}`: expected a whole number above 0"))?;
            match key.trim() {
                "rpm" => out.requests_per_minute = Some(n),
                "tpm" => out.tokens_per_minute = Some(n),
                other => return Err(format!("`{other}`: expected rpm or tpm")),
            }
        }
        if out == Limits::default() {
            return Err(format!("`{s}`: expected rpm=N, tpm=N or both"));
        }
        Ok(out)
    }
}

/// One server-stated window: `x-ratelimit-limit-*`, `-remaining-*` and `-reset-*`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Window {
    /// The limit per minute, when the server says it (0 is ignored).
    pub limit: Option<u64>,
    /// What is left until the reset.
    pub remaining: u64,
    /// How long until the limit is back to its full value, in ms.
    pub reset_ms: u64,
}

/// What one response's headers said (either part may be missing).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Observed {
    pub requests: Option<Window>,
    pub tokens: Option<Window>,
}

impl Observed {
    pub fn is_empty(&self) -> bool {
        self.requests.is_none() && self.tokens.is_none()
    }
}

/// `n` permits in the bucket's units (permit·ms).
fn units(n: u64) -> i128 {
    i128::from(n) * i128::from(WINDOW_MS)
}

/// One token bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bucket {
    configured: Option<u64>,
    /// The server's limit and the instant it expires ([`LEARNED_TTL_MS`] after it was
    /// last stated).
    learned: Option<(u64, i64)>,
    /// The lowest limit a header may teach.
    floor: u64,
    /// The longest a server's window holds (ms).
    max_hold_ms: u64,
    /// Available permits at `updated_ms`, in permit·ms (a permit is [`WINDOW_MS`] units,
    /// so a refill of `limit` per minute adds exactly `limit` units a ms: integer
    /// arithmetic, no rounding). Negative: debt, after a correction.
    level: i128,
    updated_ms: i64,
    /// The server's word: at most `remaining` more until `until_ms`.
    server: Option<(u64, i64)>,
}

impl Bucket {
    fn new(configured: Option<u64>, floor: u64, max_hold_ms: u64, now_ms: i64) -> Self {
        Self {
            configured,
            learned: None,
            floor,
            max_hold_ms,
            level: units(configured.unwrap_or(0)),
            updated_ms: now_ms,
            server: None,
        }
    }

    /// The learned limit, while it holds at `now_ms`.
    fn learned(&self, now_ms: i64) -> Option<u64> {
        self.learned
            .filter(|(_, until)| now_ms < *until)
            .map(|(l, _)| l)
    }

    /// The limit per minute in force at `now_ms`: the smaller of the configured and the
    /// learned one.
    fn capacity(&self, now_ms: i64) -> Option<u64> {
        match (self.configured, self.learned(now_ms)) {
            (Some(c), Some(l)) => Some(c.min(l)),
            (c, l) => c.or(l),
        }
    }

    /// Bring the level up to `now_ms` (a clock that went back refills nothing).
    fn refill(&mut self, now_ms: i64) {
        let Some(cap) = self.capacity(now_ms) else {
            self.updated_ms = self.updated_ms.max(now_ms);
            return;
        };
        if now_ms > self.updated_ms {
            let elapsed = i128::from(now_ms - self.updated_ms);
            self.level = (self.level + i128::from(cap) * elapsed).min(units(cap));
            self.updated_ms = now_ms;
        }
    }

    fn server_remaining(&self, now_ms: i64) -> Option<(u64, i64)> {
        self.server.filter(|(_, until)| now_ms < *until)
    }

    /// The earliest instant ≥ `now_ms` at which `n` permits are available; `None`: never
    /// (`n` exceeds the configured limit). A request above a learned limit is a trial: it
    /// may go when the bucket is full.
    fn permit_at(&self, now_ms: i64, n: u64) -> Option<i64> {
        let mut at = now_ms;
        if self.configured.is_some_and(|c| n > c) {
            return None;
        }
        // A trial above the limit needs a full bucket, and the whole server window.
        let n = self.capacity(now_ms).map_or(n, |cap| n.min(cap));
        if let Some(cap) = self.capacity(now_ms) {
            let mut b = self.clone();
            b.refill(now_ms);
            let need = units(n);
            if b.level < need {
                let missing = need - b.level;
                let wait = missing.div_euclid(i128::from(cap))
                    + i128::from(missing.rem_euclid(i128::from(cap)) != 0);
                at = now_ms.saturating_add(i64::try_from(wait).unwrap_or(i64::MAX));
            }
        }
        if let Some((remaining, until)) = self.server_remaining(now_ms)
            && remaining < n
        {
            at = at.max(until);
        }
        Some(at)
    }

    /// The lowest level: one minute's worth of debt.
    fn floor_level(&self, now_ms: i64) -> i128 {
        -self.capacity(now_ms).map_or(0, units)
    }

    fn take(&mut self, now_ms: i64, n: u64) {
        self.refill(now_ms);
        self.level = (self.level - units(n)).max(self.floor_level(now_ms));
        if let Some((remaining, until)) = self.server_remaining(now_ms) {
            self.server = Some((remaining.saturating_sub(n), until));
        }
    }

    /// Credit `n` permits back (a permit taken but not used; a call that used fewer
    /// tokens than reserved), never above the capacity.
    fn give_back(&mut self, now_ms: i64, n: u64) {
        self.refill(now_ms);
        let cap = self.capacity(now_ms).map_or(i128::MAX, units);
        self.level = self.level.saturating_add(units(n)).min(cap);
    }

    /// Charge `n` more permits than were taken (a call that used more tokens), down to
    /// one minute's worth of debt.
    fn charge(&mut self, now_ms: i64, n: u64) {
        self.refill(now_ms);
        self.level = (self.level - units(n)).max(self.floor_level(now_ms));
    }

    fn observe(&mut self, now_ms: i64, w: Window) {
        self.refill(now_ms);
        if let Some(limit) = w.limit.filter(|l| *l > 0) {
            let limit = limit.max(self.floor);
            let first = self.capacity(now_ms).is_none();
            self.learned = Some((limit, now_ms.saturating_add(LEARNED_TTL_MS)));
            if first {
                // A limit learned just now: the bucket starts from what the server says.
                self.level = units(limit);
            }
            let cap = self.capacity(now_ms).unwrap_or(limit);
            self.level = self.level.clamp(self.floor_level(now_ms), units(cap));
        }
        self.level = self.level.min(units(w.remaining));
        let hold = w.reset_ms.min(self.max_hold_ms);
        let until = now_ms.saturating_add(i64::try_from(hold).unwrap_or(i64::MAX));
        self.server = Some(match self.server_remaining(now_ms) {
            // Only tighten within the window already known.
            Some((r, u)) => (r.min(w.remaining), u.max(until)),
            None => (w.remaining, until),
        });
    }
}

/// The rate limits of one backend: a requests bucket and a tokens bucket.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RateLimiter {
    requests: Bucket,
    tokens: Bucket,
}

impl RateLimiter {
    /// Full buckets at `now_ms` for the configured limits; no server window holds the
    /// backend longer than `max_hold_ms`.
    pub fn new(limits: Limits, max_hold_ms: u64, now_ms: i64) -> Self {
        Self {
            requests: Bucket::new(
                limits.requests_per_minute,
                MIN_LEARNED_REQUESTS,
                max_hold_ms,
                now_ms,
            ),
            tokens: Bucket::new(
                limits.tokens_per_minute,
                MIN_LEARNED_TOKENS,
                max_hold_ms,
                now_ms,
            ),
        }
    }

    /// The limits in force at `now_ms` (configured or learned, the smaller).
    pub fn limits(&self, now_ms: i64) -> Limits {
        Limits {
            requests_per_minute: self.requests.capacity(now_ms),
            tokens_per_minute: self.tokens.capacity(now_ms),
        }
    }

    /// The earliest instant ≥ `now_ms` at which one request of `tokens` tokens may go out;
    /// `None`: never (it asks for more tokens than the configured limit per minute).
    pub fn permit_at(&self, now_ms: i64, tokens: u64) -> Option<i64> {
        let r = self.requests.permit_at(now_ms, 1)?;
        let t = self.tokens.permit_at(now_ms, tokens)?;
        Some(r.max(t))
    }

    /// Take the permit for one request of `tokens` tokens at `now_ms` (after
    /// [`permit_at`](Self::permit_at) said `now_ms`).
    pub fn take(&mut self, now_ms: i64, tokens: u64) {
        self.requests.take(now_ms, 1);
        self.tokens.take(now_ms, tokens);
    }

    /// A taken permit whose call never went out.
    pub fn give_back(&mut self, now_ms: i64, tokens: u64) {
        self.requests.give_back(now_ms, 1);
        self.tokens.give_back(now_ms, tokens);
    }

    /// A call that reserved `reserved` tokens reported `used`: correct the tokens bucket.
    pub fn settle_tokens(&mut self, now_ms: i64, reserved: u64, used: u64) {
        if used < reserved {
            self.tokens.give_back(now_ms, reserved - used);
        } else if used > reserved {
            self.tokens.charge(now_ms, used - reserved);
        }
    }

    /// A response's `x-ratelimit-*` headers, seen at `now_ms`.
    pub fn observe(&mut self, now_ms: i64, o: &Observed) {
        if let Some(w) = o.requests {
            self.requests.observe(now_ms, w);
        }
        if let Some(w) = o.tokens {
            self.tokens.observe(now_ms, w);
        }
    }
}

/// The tokens a request reserves before its call: its prompt estimate plus its
/// `max_tokens` (or [`DEFAULT_OUTPUT_TOKENS`]); 0 for a payload of unknown size.
pub fn reserved_tokens(size: Option<crate::request_size::RequestSize>) -> u64 {
    size.map_or(0, |s| {
        s.prompt_tokens
            .saturating_add(s.max_tokens.unwrap_or(DEFAULT_OUTPUT_TOKENS))
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// The longest a server window holds in these tests (the worker's default).
    const HOLD: u64 = 30_000;

    fn rpm(n: u64) -> Limits {
        Limits {
            requests_per_minute: Some(n),
            tokens_per_minute: None,
        }
    }

    #[test]
    fn limits_parse() {
        assert_eq!(Limits::parse("rpm=60").unwrap(), rpm(60));
        assert_eq!(
            Limits::parse("rpm=60, tpm=90000").unwrap(),
            Limits {
                requests_per_minute: Some(60),
                tokens_per_minute: Some(90_000)
            }
        );
        for bad in ["", "rpm", "rpm=0", "rpm=x", "qps=3"] {
            assert!(Limits::parse(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn a_full_bucket_then_one_request_per_refill() {
        let mut l = RateLimiter::new(rpm(2), HOLD, 0);
        assert_eq!(l.permit_at(0, 0), Some(0));
        l.take(0, 0);
        l.take(0, 0);
        // Two per minute: the next one in 30 s.
        assert_eq!(l.permit_at(0, 0), Some(30_000));
        assert_eq!(l.permit_at(10_000, 0), Some(30_000));
        l.give_back(10_000, 0);
        assert_eq!(l.permit_at(10_000, 0), Some(10_000));
    }

    #[test]
    fn no_limit_means_no_wait_and_oversize_means_never() {
        let l = RateLimiter::new(Limits::default(), HOLD, 0);
        assert_eq!(l.permit_at(5, 1_000_000), Some(5));
        let l = RateLimiter::new(
            Limits {
                requests_per_minute: None,
                tokens_per_minute: Some(1_000),
            },
            HOLD,
            0,
        );
        assert_eq!(l.permit_at(0, 1_001), None);
        assert_eq!(l.permit_at(0, 1_000), Some(0));
    }

    #[test]
    fn headers_teach_a_limit_and_hold_until_their_reset() {
        let mut l = RateLimiter::new(Limits::default(), HOLD, 0);
        l.observe(
            0,
            &Observed {
                requests: Some(Window {
                    limit: Some(3),
                    remaining: 0,
                    reset_ms: 5_000,
                }),
                tokens: None,
            },
        );
        assert_eq!(l.limits(0), rpm(3));
        // Nothing before the reset (and the bucket refills at 3/min: one in 20 s).
        assert_eq!(l.permit_at(0, 0), Some(20_000));
        assert_eq!(l.permit_at(19_999, 0), Some(20_000));
        assert_eq!(l.permit_at(20_000, 0), Some(20_000));
        // A configured lower limit wins over the learned one.
        let mut l = RateLimiter::new(rpm(2), HOLD, 0);
        l.observe(
            0,
            &Observed {
                requests: Some(Window {
                    limit: Some(100),
                    remaining: 99,
                    reset_ms: 600,
                }),
                tokens: None,
            },
        );
        assert_eq!(l.limits(0), rpm(2));
    }

    #[test]
    fn used_tokens_correct_the_reservation() {
        let tpm = Limits {
            requests_per_minute: None,
            tokens_per_minute: Some(600),
        };
        let mut l = RateLimiter::new(tpm, HOLD, 0);
        l.take(0, 600);
        assert_eq!(l.permit_at(0, 100), Some(10_000));
        l.settle_tokens(0, 600, 500);
        assert_eq!(l.permit_at(0, 100), Some(0));
        l.settle_tokens(0, 0, 100);
        assert_eq!(l.permit_at(0, 100), Some(10_000));
    }

    #[test]
    fn a_reset_or_retry_after_holds_no_longer_than_the_maximum() {
        let mut l = RateLimiter::new(Limits::default(), HOLD, 0);
        let day = Window {
            limit: None,
            remaining: 0,
            reset_ms: 86_400_000,
        };
        l.observe(
            1_000,
            &Observed {
                requests: Some(day),
                tokens: Some(day),
            },
        );
        assert_eq!(l.permit_at(1_000, 0), Some(1_000 + HOLD as i64));
        assert_eq!(
            l.permit_at(1_000 + HOLD as i64, 500),
            Some(1_000 + HOLD as i64)
        );
    }

    #[test]
    fn learned_limits_have_a_floor_and_expire() {
        let mut l = RateLimiter::new(Limits::default(), HOLD, 0);
        let tiny = Window {
            limit: Some(1),
            remaining: 1,
            reset_ms: 1_000,
        };
        l.observe(
            0,
            &Observed {
                requests: None,
                tokens: Some(tiny),
            },
        );
        assert_eq!(l.limits(0).tokens_per_minute, Some(MIN_LEARNED_TOKENS));
        assert_eq!(
            l.limits(LEARNED_TTL_MS - 1).tokens_per_minute,
            Some(MIN_LEARNED_TOKENS)
        );
        // Not stated again: forgotten, and a request of any size goes at once.
        assert_eq!(l.limits(LEARNED_TTL_MS), Limits::default());
        assert_eq!(l.permit_at(LEARNED_TTL_MS, 1_000_000), Some(LEARNED_TTL_MS));
    }

    #[test]
    fn a_request_above_a_learned_limit_goes_as_a_trial_when_the_bucket_is_full() {
        let learned = Window {
            limit: Some(2_000),
            remaining: 2_000,
            reset_ms: 1_000,
        };
        let mut l = RateLimiter::new(Limits::default(), HOLD, 0);
        l.observe(
            0,
            &Observed {
                requests: None,
                tokens: Some(learned),
            },
        );
        assert_eq!(l.permit_at(0, 50_000), Some(0));
        l.take(0, 50_000);
        // One minute's worth of debt at most: full again two minutes later.
        assert_eq!(l.permit_at(0, 50_000), Some(2 * WINDOW_MS as i64));
        // Above a configured limit it is never (the operator's word).
        let conf = Limits {
            requests_per_minute: None,
            tokens_per_minute: Some(100_000),
        };
        let mut l = RateLimiter::new(conf, HOLD, 0);
        l.observe(
            0,
            &Observed {
                requests: None,
                tokens: Some(learned),
            },
        );
        assert_eq!(l.permit_at(0, 50_000), Some(0));
        assert_eq!(l.permit_at(0, 100_001), None);
    }

    #[test]
    fn a_huge_reported_usage_is_at_most_a_minute_of_debt() {
        let tpm = Limits {
            requests_per_minute: None,
            tokens_per_minute: Some(600),
        };
        let mut l = RateLimiter::new(tpm, HOLD, 0);
        l.take(0, 100);
        l.settle_tokens(0, 100, u64::MAX);
        assert_eq!(l.permit_at(0, 600), Some(2 * WINDOW_MS as i64));
    }

    /// `None` (never) sorts after every instant.
    fn key(p: Option<i64>) -> i64 {
        p.unwrap_or(i64::MAX)
    }

    fn window() -> impl Strategy<Value = Window> {
        (prop::option::of(1u64..50), 0u64..50, 0u64..120_000).prop_map(
            |(limit, remaining, reset_ms)| Window {
                limit,
                remaining,
                reset_ms,
            },
        )
    }

    proptest! {
        /// Whatever the arrivals and headers: over any interval of `t` ms the grants are
        /// at most `limit + limit · t / 60 s` (the configured limit; headers only lower it).
        #[test]
        fn never_grants_more_than_the_limit_per_window(
            limit in 1u64..20,
            steps in prop::collection::vec((0i64..10_000, prop::option::of(window())), 1..200),
        ) {
            let mut l = RateLimiter::new(rpm(limit), HOLD, 0);
            let mut now = 0i64;
            let mut grants: Vec<i64> = Vec::new();
            for (dt, obs) in steps {
                now += dt;
                if let Some(w) = obs {
                    l.observe(now, &Observed { requests: Some(w), tokens: None });
                }
                if l.permit_at(now, 0) == Some(now) {
                    l.take(now, 0);
                    grants.push(now);
                }
            }
            for i in 0..grants.len() {
                for j in i..grants.len() {
                    let n = (j - i + 1) as f64;
                    let t = (grants[j] - grants[i]) as f64;
                    let bound = limit as f64 + limit as f64 * t / WINDOW_MS as f64;
                    prop_assert!(n <= bound + 1e-6, "{n} grants in {t} ms, limit {limit}");
                }
            }
        }

        /// More tokens never get an earlier permit; a permit is never in the past.
        #[test]
        fn permit_time_is_monotone_in_tokens(
            tpm in 1u64..10_000, taken in 0u64..20_000, now in 0i64..200_000,
            a in 0u64..12_000, b in 0u64..12_000,
        ) {
            let mut l = RateLimiter::new(Limits { requests_per_minute: Some(100), tokens_per_minute: Some(tpm) }, HOLD, 0);
            l.take(0, taken);
            let (a, b) = (a.min(b), a.max(b));
            prop_assert!(key(l.permit_at(now, a)) <= key(l.permit_at(now, b)));
            if let Some(at) = l.permit_at(now, a) {
                prop_assert!(at >= now);
                // At that instant the permit is there.
                prop_assert_eq!(l.permit_at(at, a), Some(at));
            }
        }

        /// Within its reset window, an observation that does not raise the limit never
        /// makes any permit earlier.
        #[test]
        fn headers_only_tighten_within_their_reset_window(
            configured in prop::option::of(1u64..50),
            before in prop::collection::vec((0i64..5_000, window()), 0..5),
            w in window(),
            later in 0i64..120_000,
        ) {
            let limits = Limits { requests_per_minute: configured, tokens_per_minute: None };
            let mut l = RateLimiter::new(limits, HOLD, 0);
            let mut now = 0;
            for (dt, b) in before {
                now += dt;
                l.observe(now, &Observed { requests: Some(b), tokens: None });
                if l.permit_at(now, 0) == Some(now) { l.take(now, 0); }
            }
            // An observation that keeps the limit in force.
            let w = Window { limit: l.limits(now).requests_per_minute.or(w.limit), ..w };
            let mut after = l.clone();
            after.observe(now, &Observed { requests: Some(w), tokens: None });
            let t = now + later.min(w.reset_ms as i64);
            prop_assert!(key(after.permit_at(t, 0)) >= key(l.permit_at(t, 0)),
                "before {:?}, after {:?}", l.permit_at(t, 0), after.permit_at(t, 0));
        }

        /// Headers are advice: without a configured limit, whatever the servers said
        /// (resets up to a day, tiny limits, huge reported usage), a request of any size
        /// gets a permit, no later than the longest hold or two minutes (a full bucket
        /// after one minute's worth of debt).
        #[test]
        fn a_trial_is_always_possible_without_a_configured_limit(
            steps in prop::collection::vec(
                (0i64..30_000, prop::option::of((window(), 0u64..86_400_000)), 0u64..5_000, prop::option::of(0u64..=u64::MAX)),
                1..60,
            ),
            hold in 1u64..120_000,
            n in 0u64..1_000_000,
        ) {
            let mut l = RateLimiter::new(Limits::default(), hold, 0);
            let mut now = 0i64;
            for (dt, obs, tokens, used) in steps {
                now += dt;
                if let Some((w, reset_ms)) = obs {
                    let w = Window { reset_ms, ..w };
                    l.observe(now, &Observed { requests: Some(w), tokens: Some(w) });
                }
                if l.permit_at(now, tokens) == Some(now) {
                    l.take(now, tokens);
                    if let Some(used) = used {
                        l.settle_tokens(now, tokens, used);
                    }
                }
                let bound = now + (hold as i64).max(2 * WINDOW_MS as i64);
                let at = l.permit_at(now, n);
                prop_assert!(at.is_some_and(|at| at <= bound), "{at:?} > {bound}");
            }
        }
    }
}
