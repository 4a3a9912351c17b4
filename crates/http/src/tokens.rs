//! Tenants at the door: the tokens file that maps each API token to the tenant
//! it acts for, and the per-tenant quotas checked before anything is published.
//!
//! The file (`serve --tokens-file FILE`, TOML) holds one `[[token]]` table per token:
//!
//! ```toml
//! [[token]]
//! sha256 = "9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"
//! tenant = "team-a"
//! weight = 3                 # share of the model slots under overload (default 1)
//! jobs_per_second = 20       # quota (optional): jobs accepted per second
//! tokens_per_minute = 60000  # quota (optional): estimated prompt tokens per minute
//! kinds = ["chat"]           # optional: the only job kinds this token may submit
//! max_priority = "standard"  # the highest tier this token may submit (default standard)
//! max_waiting = 1024         # long-polls, held chat requests and streams at once
//! max_streams = 256          # streaming chat requests at once (each holds a broker channel)
//! max_requests = 2048        # requests in flight at once (each holds a connection)
//! ```
//!
//! `sha256` is the hex SHA-256 of the token (`lastcall tokens hash`, or `printf %s TOKEN |
//! sha256sum`): the file never holds a usable secret. A presented token is hashed and looked
//! up; a lookup keyed by a SHA-256 digest tells a timing observer nothing about the token.
//! Weight, quotas and the `max_*` caps belong to the tenant: two tokens of one tenant must
//! agree on them (the allowed kinds and `max_priority` may differ per token). The caps
//! default to a quarter of the server's own ([`TenantLimits::default`]), so no tenant can
//! hold all of a shared resource. A tenant's name may not contain `:`: its
//! tokens' job ids are `<tenant>:<id>` ([`crate::auth::Caller::job_id`]).
//!
//! Quotas are token buckets ([`Bucket`], pure: `now_ms` is an argument): `jobs_per_second`
//! holds one second's worth (at least 1 job), `tokens_per_minute` one minute's. A request
//! is refused while a bucket holds less than it needs (a request larger than a whole
//! bucket waits for a full one and then overdraws it, so it is delayed, never refused for
//! good), with how long until it would fit.

use lastcall_core::Tenant;
use serde::Deserialize;
use std::collections::{BTreeMap, BTreeSet, HashMap};
use std::sync::{Arc, Mutex};

/// One token of the file: the tenant it acts for and the kinds it may submit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TokenEntry {
    pub tenant: Tenant,
    /// `None`: every kind.
    pub kinds: Option<BTreeSet<String>>,
    /// The highest tier this token may submit (`max_priority`, default `standard`): a
    /// higher one is `403 priority_not_allowed`. A request naming no tier gets the lower
    /// of `standard` and this.
    pub max_priority: lastcall_core::Priority,
}

impl TokenEntry {
    /// Whether this token may submit jobs of `kind`.
    pub fn allows(&self, kind: &str) -> bool {
        self.kinds.as_ref().is_none_or(|k| k.contains(kind))
    }
}

/// A tenant's quotas; `None`: unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Quota {
    pub jobs_per_second: Option<f64>,
    pub tokens_per_minute: Option<u64>,
}

/// How much of the server's shared resources one tenant may hold at once (the tokens
/// file's `max_waiting`, `max_streams`, `max_requests`). Each defaults to a quarter of
/// the server's own default bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TenantLimits {
    /// Requests waiting for an outcome (long-polls, held chat requests, streams).
    pub max_waiting: usize,
    /// Streaming chat requests (each holds a broker channel for its deltas).
    pub max_streams: usize,
    /// Requests in flight, from the headers to the last byte of the answer.
    pub max_requests: usize,
}

impl Default for TenantLimits {
    fn default() -> Self {
        Self {
            max_waiting: crate::MAX_WAITING / 4,
            max_streams: crate::MAX_STREAMS / 4,
            max_requests: crate::limit::MAX_CONNECTIONS / 4,
        }
    }
}

/// What the file says about a tenant.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TenantPolicy {
    /// Its share of the model slots under overload, relative to the other tenants'
    /// (the scheduler reads [`TokensFile::weights`]).
    pub weight: u32,
    pub quota: Quota,
    pub limits: TenantLimits,
}

/// The parsed tokens file.
#[derive(Debug, Clone, Default)]
pub struct TokensFile {
    /// Hex SHA-256 of a token → its entry.
    by_hash: HashMap<String, Arc<TokenEntry>>,
    tenants: BTreeMap<String, TenantPolicy>,
}

/// Why a tokens file was refused; each message names the file, the entry and the field.
#[derive(Debug, thiserror::Error)]
pub enum TokensFileError {
    #[error("cannot read the tokens file {path}: {source}")]
    Read {
        path: String,
        source: std::io::Error,
    },
    #[error("the tokens file {path} is not valid: {message}")]
    Invalid { path: String, message: String },
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFile {
    #[serde(default)]
    token: Vec<RawEntry>,
}

#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawEntry {
    sha256: String,
    tenant: String,
    weight: Option<u32>,
    jobs_per_second: Option<f64>,
    tokens_per_minute: Option<u64>,
    kinds: Option<Vec<String>>,
    max_priority: Option<String>,
    max_waiting: Option<usize>,
    max_streams: Option<usize>,
    max_requests: Option<usize>,
}

/// The hex SHA-256 of a token (surrounding whitespace removed, as the server does), as
/// the tokens file holds it.
pub fn hash_token(token: &str) -> String {
    use sha2::Digest;
    hex(&sha2::Sha256::digest(token.trim().as_bytes()))
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

impl TokensFile {
    /// Read and check `path`.
    pub fn load(path: &std::path::Path) -> Result<Self, TokensFileError> {
        let text = std::fs::read_to_string(path).map_err(|source| TokensFileError::Read {
            path: path.display().to_string(),
            source,
        })?;
        Self::parse(&text).map_err(|message| TokensFileError::Invalid {
            path: path.display().to_string(),
            message,
        })
    }

    /// Parse and check the text of a tokens file; the error names the entry and field.
    pub fn parse(text: &str) -> Result<Self, String> {
        let raw: RawFile = toml::from_str(text).map_err(|e| e.to_string())?;
        let mut out = TokensFile::default();
        for (i, e) in raw.token.into_iter().enumerate() {
            let at = format!("[[token]] #{} (tenant `{}`)", i + 1, e.tenant);
            let hash = e
                .sha256
                .trim()
                .strip_prefix("sha256:")
                .unwrap_or(e.sha256.trim())
                .to_ascii_lowercase();
            if hash.len() != 64 || !hash.bytes().all(|b| b.is_ascii_hexdigit()) {
                return Err(format!(
                    "{at}: `sha256` must be the 64 hex digits of the token's SHA-256 (`lastcall tokens hash` prints them), never the token itself"
                ));
            }
            let tenant =
                Tenant::parse(&e.tenant).map_err(|err| format!("{at}: `tenant` {}", err.0))?;
            if tenant.as_str().contains(':') {
                return Err(format!(
                    "{at}: `tenant` may not contain `:` here: a tenant token's job ids are `<tenant>:<id>`, and a `:` in the tenant would make one tenant's ids another's"
                ));
            }
            let max_priority = match e.max_priority.as_deref() {
                None => lastcall_core::Priority::Standard,
                Some(p) => p
                    .parse::<lastcall_core::Priority>()
                    .map_err(|err| format!("{at}: `max_priority` {}", err.0))?,
            };
            let defaults = TenantLimits::default();
            let mut limits = defaults;
            for (field, value, slot) in [
                ("max_waiting", e.max_waiting, &mut limits.max_waiting),
                ("max_streams", e.max_streams, &mut limits.max_streams),
                ("max_requests", e.max_requests, &mut limits.max_requests),
            ] {
                match value {
                    Some(0) => {
                        return Err(format!(
                            "{at}: `{field}` must be at least 1 (leave it out for the default)"
                        ));
                    }
                    Some(n) => *slot = n,
                    None => {}
                }
            }
            let weight = e.weight.unwrap_or(1);
            if weight == 0 {
                return Err(format!("{at}: `weight` must be at least 1"));
            }
            if let Some(j) = e.jobs_per_second
                && !(j.is_finite() && j > 0.0)
            {
                return Err(format!(
                    "{at}: `jobs_per_second` must be a positive number (leave it out for no limit)"
                ));
            }
            if e.tokens_per_minute == Some(0) {
                return Err(format!(
                    "{at}: `tokens_per_minute` must be at least 1 (leave it out for no limit)"
                ));
            }
            let kinds = match e.kinds {
                None => None,
                Some(list) => {
                    for k in &list {
                        lastcall_core::Kind::parse(k)
                            .map_err(|err| format!("{at}: `kinds` entry `{k}`: {}", err.0))?;
                    }
                    Some(list.into_iter().collect::<BTreeSet<_>>())
                }
            };
            let policy = TenantPolicy {
                weight,
                quota: Quota {
                    jobs_per_second: e.jobs_per_second,
                    tokens_per_minute: e.tokens_per_minute,
                },
                limits,
            };
            match out.tenants.get(tenant.as_str()) {
                Some(known) if *known != policy => {
                    return Err(format!(
                        "{at}: `weight` and the quotas belong to the tenant, and an earlier entry of `{tenant}` sets them differently; give every token of a tenant the same `weight`, `jobs_per_second`, `tokens_per_minute`, `max_waiting`, `max_streams` and `max_requests`"
                    ));
                }
                Some(_) => {}
                None => {
                    out.tenants.insert(tenant.as_str().to_owned(), policy);
                }
            }
            if out
                .by_hash
                .insert(
                    hash,
                    Arc::new(TokenEntry {
                        tenant,
                        kinds,
                        max_priority,
                    }),
                )
                .is_some()
            {
                return Err(format!(
                    "{at}: the same `sha256` appears twice; one token acts for one tenant"
                ));
            }
        }
        Ok(out)
    }

    /// The entry of a presented token, if the file lists it.
    pub fn lookup(&self, presented: &[u8]) -> Option<Arc<TokenEntry>> {
        let token = std::str::from_utf8(presented).ok()?;
        self.by_hash.get(&hash_token(token)).cloned()
    }

    /// Each tenant's weight (default 1): the scheduler's shares.
    pub fn weights(&self) -> BTreeMap<String, u32> {
        self.tenants
            .iter()
            .map(|(t, p)| (t.clone(), p.weight))
            .collect()
    }

    /// What the file says about `tenant`, if it names it.
    pub fn policy(&self, tenant: &str) -> Option<&TenantPolicy> {
        self.tenants.get(tenant)
    }

    /// The tenants the file names.
    pub fn tenants(&self) -> impl Iterator<Item = &str> {
        self.tenants.keys().map(String::as_str)
    }

    /// How many tokens it lists.
    pub fn len(&self) -> usize {
        self.by_hash.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_hash.is_empty()
    }
}

/// A token bucket: `level` units, refilled at `rate_per_s` up to `capacity`. Pure.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Bucket {
    level: f64,
    capacity: f64,
    rate_per_s: f64,
    at_ms: i64,
}

impl Bucket {
    /// A full bucket at `now_ms`.
    pub fn full(capacity: f64, rate_per_s: f64, now_ms: i64) -> Self {
        Self {
            level: capacity,
            capacity,
            rate_per_s,
            at_ms: now_ms,
        }
    }

    fn refill(&mut self, now_ms: i64) {
        let elapsed_s = (now_ms - self.at_ms).max(0) as f64 / 1000.0;
        self.level = (self.level + elapsed_s * self.rate_per_s).min(self.capacity);
        self.at_ms = self.at_ms.max(now_ms);
    }

    /// How long from `now_ms` until `n` units may be taken (0: now). More than the whole
    /// bucket may be taken once it is full (it then runs into debt).
    pub fn wait_ms(&mut self, n: f64, now_ms: i64) -> u64 {
        self.refill(now_ms);
        let need = n.min(self.capacity);
        if self.level >= need {
            0
        } else {
            ((need - self.level) / self.rate_per_s * 1000.0).ceil() as u64
        }
    }

    /// Take `n` units (call after `wait_ms` said 0).
    pub fn take(&mut self, n: f64, now_ms: i64) {
        self.refill(now_ms);
        self.level -= n;
    }
}

/// Which quota refused a request, and when to come back.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct QuotaRefusal {
    /// `jobs_per_second` or `tokens_per_minute`.
    pub quota: &'static str,
    pub limit: f64,
    /// The tokens the request was estimated to need (for `tokens_per_minute`).
    pub tokens: u64,
    /// Whole seconds, at least 1.
    pub retry_after_s: u64,
}

impl std::fmt::Display for QuotaRefusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.quota {
            "tokens_per_minute" => write!(
                f,
                "over the tenant's quota of {} estimated prompt tokens per minute (this request: about {}); nothing was published, retry after {} s",
                self.limit, self.tokens, self.retry_after_s
            ),
            _ => write!(
                f,
                "over the tenant's quota of {} jobs per second; nothing was published, retry after {} s",
                self.limit, self.retry_after_s
            ),
        }
    }
}

/// What one tenant holds of the server's shared resources now, against its
/// [`TenantLimits`]: a semaphore per tenant and resource, made when first needed (bounded
/// by the tenants of the file).
#[derive(Debug, Default)]
pub struct TenantHolds {
    sems: Mutex<HashMap<(String, &'static str), Arc<tokio::sync::Semaphore>>>,
}

impl TenantHolds {
    /// One more of `resource` (a [`TenantLimits`] field name) for `tenant`, whose limit is
    /// `limit`; `None` when the tenant already holds `limit`. The permit gives it back.
    pub fn try_hold(
        &self,
        tenant: &str,
        resource: &'static str,
        limit: usize,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let sem = self
            .sems
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry((tenant.to_owned(), resource))
            .or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(limit)))
            .clone();
        sem.try_acquire_owned().ok()
    }
}

/// A tenant's buckets: jobs, tokens (`None`: that quota is not set).
type TenantBuckets = (Option<Bucket>, Option<Bucket>);

/// The quota buckets of the tenants the tokens file gives quotas (bounded by the file).
#[derive(Debug, Default)]
pub struct Quotas {
    buckets: Mutex<HashMap<String, TenantBuckets>>,
}

impl Quotas {
    /// Admit one job of `tenant` needing `tokens` at `now_ms` under `quota`, taking from
    /// both buckets, or refuse it (taking nothing) naming the quota that waits longest.
    pub fn admit(
        &self,
        tenant: &str,
        quota: &Quota,
        tokens: u64,
        now_ms: i64,
    ) -> Result<(), QuotaRefusal> {
        if quota.jobs_per_second.is_none() && quota.tokens_per_minute.is_none() {
            return Ok(());
        }
        let mut all = self.buckets.lock().unwrap_or_else(|p| p.into_inner());
        let (jobs, toks) = all.entry(tenant.to_owned()).or_insert_with(|| {
            (
                quota
                    .jobs_per_second
                    .map(|r| Bucket::full(r.max(1.0), r, now_ms)),
                quota
                    .tokens_per_minute
                    .map(|t| Bucket::full(t as f64, t as f64 / 60.0, now_ms)),
            )
        });
        let secs = |ms: u64| ms.div_ceil(1000).max(1);
        let mut refusal: Option<QuotaRefusal> = None;
        if let (Some(b), Some(limit)) = (jobs.as_mut(), quota.jobs_per_second) {
            let wait = b.wait_ms(1.0, now_ms);
            if wait > 0 {
                refusal = Some(QuotaRefusal {
                    quota: "jobs_per_second",
                    limit,
                    tokens,
                    retry_after_s: secs(wait),
                });
            }
        }
        if let (Some(b), Some(limit)) = (toks.as_mut(), quota.tokens_per_minute) {
            let wait = b.wait_ms(tokens as f64, now_ms);
            if wait > 0 && refusal.is_none_or(|r| secs(wait) > r.retry_after_s) {
                refusal = Some(QuotaRefusal {
                    quota: "tokens_per_minute",
                    limit: limit as f64,
                    tokens,
                    retry_after_s: secs(wait),
                });
            }
        }
        if let Some(r) = refusal {
            return Err(r);
        }
        if let Some(b) = jobs.as_mut() {
            b.take(1.0, now_ms);
        }
        if let Some(b) = toks.as_mut() {
            b.take(tokens as f64, now_ms);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FILE: &str = r#"
[[token]]
sha256 = "HASH_A"
tenant = "team-a"
weight = 3
jobs_per_second = 2
tokens_per_minute = 600
kinds = ["chat"]

[[token]]
sha256 = "sha256:HASH_B"
tenant = "team-b"
"#;

    fn file() -> TokensFile {
        let text = FILE
            .replace("HASH_A", &hash_token("token-of-team-a-0001"))
            .replace("HASH_B", &hash_token("token-of-team-b-0001"));
        TokensFile::parse(&text).unwrap()
    }

    #[test]
    fn hashes_are_plain_hex_sha256_of_the_trimmed_token() {
        // printf %s abc | sha256sum
        assert_eq!(
            hash_token("abc\n"),
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
    }

    #[test]
    fn a_token_maps_to_its_tenant_kinds_and_weight() {
        let f = file();
        assert_eq!(f.len(), 2);
        let a = f.lookup(b"token-of-team-a-0001").unwrap();
        assert_eq!(a.tenant.as_str(), "team-a");
        assert!(a.allows("chat") && !a.allows("code.review"));
        let b = f.lookup(b"token-of-team-b-0001").unwrap();
        assert!(b.allows("anything"));
        assert!(f.lookup(b"token-of-team-a-0002").is_none());
        let w = f.weights();
        assert_eq!(w.get("team-a"), Some(&3));
        assert_eq!(w.get("team-b"), Some(&1), "weight defaults to 1");
        let q = f.policy("team-a").unwrap().quota;
        assert_eq!(q.jobs_per_second, Some(2.0));
        assert_eq!(q.tokens_per_minute, Some(600));
        assert_eq!(f.policy("team-b").unwrap().quota, Quota::default());
        assert_eq!(
            a.max_priority,
            lastcall_core::Priority::Standard,
            "the default"
        );
        assert_eq!(
            f.policy("team-b").unwrap().limits,
            TenantLimits::default(),
            "a quarter of the server's bounds"
        );
    }

    #[test]
    fn a_bad_file_is_refused_naming_the_entry_and_field() {
        let h = hash_token("token-of-team-a-0001");
        let cases = [
            (
                "[[token]]\nsha256 = \"plain-token-here\"\ntenant = \"a\"\n",
                "`sha256`",
            ),
            (
                &format!("[[token]]\nsha256 = \"{h}\"\ntenant = \"a b\"\n"),
                "`tenant`",
            ),
            (
                &format!("[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\nweight = 0\n"),
                "`weight`",
            ),
            (
                &format!("[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\njobs_per_second = -1\n"),
                "`jobs_per_second`",
            ),
            (
                &format!("[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\ntokens_per_minute = 0\n"),
                "`tokens_per_minute`",
            ),
            (
                &format!("[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\nkinds = [\"no spaces\"]\n"),
                "`kinds`",
            ),
            (
                &format!("[[token]]\nsha256 = \"{h}\"\ntenant = \"a:b\"\n"),
                "`tenant` may not contain `:`",
            ),
            (
                &format!(
                    "[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\nmax_priority = \"urgent\"\n"
                ),
                "`max_priority`",
            ),
            (
                &format!("[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\nmax_streams = 0\n"),
                "`max_streams`",
            ),
            (
                &format!("[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\ntoken = \"x\"\n"),
                "unknown field",
            ),
            (
                &format!(
                    "[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\n[[token]]\nsha256 = \"{h}\"\ntenant = \"b\"\n"
                ),
                "twice",
            ),
            (
                &format!(
                    "[[token]]\nsha256 = \"{h}\"\ntenant = \"a\"\nweight = 2\n[[token]]\nsha256 = \"{}\"\ntenant = \"a\"\n",
                    hash_token("another-token-0001")
                ),
                "#2",
            ),
        ];
        for (text, names) in cases {
            let e = TokensFile::parse(text).unwrap_err();
            assert!(e.contains(names), "{text}: {e}");
        }
        assert!(TokensFile::parse("").unwrap().is_empty());
    }

    #[test]
    fn a_tenant_holds_at_most_its_limit_and_gets_them_back() {
        let holds = TenantHolds::default();
        let a1 = holds.try_hold("a", "max_streams", 2).unwrap();
        let _a2 = holds.try_hold("a", "max_streams", 2).unwrap();
        assert!(holds.try_hold("a", "max_streams", 2).is_none());
        assert!(
            holds.try_hold("b", "max_streams", 2).is_some(),
            "per tenant"
        );
        assert!(
            holds.try_hold("a", "max_waiting", 2).is_some(),
            "per resource"
        );
        drop(a1);
        assert!(holds.try_hold("a", "max_streams", 2).is_some());
    }

    #[test]
    fn a_bucket_refills_at_its_rate_and_says_how_long_to_wait() {
        let mut b = Bucket::full(2.0, 2.0, 0);
        assert_eq!(b.wait_ms(1.0, 0), 0);
        b.take(1.0, 0);
        b.take(1.0, 0);
        assert_eq!(b.wait_ms(1.0, 0), 500);
        assert_eq!(b.wait_ms(1.0, 250), 250);
        assert_eq!(b.wait_ms(1.0, 500), 0);
        // Never more than the capacity.
        assert_eq!(b.wait_ms(2.0, 60_000), 0);
        b.take(2.0, 60_000);
        assert_eq!(b.wait_ms(1.0, 60_000), 500);
        // A request larger than the bucket waits for a full one, then overdraws it.
        let mut t = Bucket::full(100.0, 10.0, 0);
        assert_eq!(t.wait_ms(500.0, 0), 0);
        t.take(500.0, 0);
        assert_eq!(t.wait_ms(1.0, 0), 40_100);
    }

    #[test]
    fn quotas_refuse_without_taking_and_name_the_binding_quota() {
        let q = Quotas::default();
        let quota = Quota {
            jobs_per_second: Some(2.0),
            tokens_per_minute: Some(600),
        };
        assert!(q.admit("a", &quota, 100, 0).is_ok());
        assert!(q.admit("a", &quota, 100, 0).is_ok());
        let r = q.admit("a", &quota, 100, 0).unwrap_err();
        assert_eq!((r.quota, r.retry_after_s), ("jobs_per_second", 1));
        assert!(r.to_string().contains("2 jobs per second"), "{r}");
        // Another tenant has buckets of its own.
        assert!(q.admit("b", &quota, 100, 0).is_ok());
        // A second later: a job fits again, but 500 tokens do not (400 left + 10/s).
        let r = q.admit("a", &quota, 500, 1_000).unwrap_err();
        assert_eq!(r.quota, "tokens_per_minute");
        assert_eq!(r.retry_after_s, 9, "(500 - 410) tokens at 10/s");
        assert!(r.to_string().contains("about 500"), "{r}");
        // The refusal took nothing: the job bucket still holds its token.
        assert!(q.admit("a", &quota, 10, 1_000).is_ok());
        // No quota: always admitted.
        for _ in 0..100 {
            assert!(q.admit("c", &Quota::default(), 1_000_000, 0).is_ok());
        }
    }
}
