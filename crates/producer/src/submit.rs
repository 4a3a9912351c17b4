//! The publisher library API: validate, stamp the deadline, refuse stale work before it is
//! published, publish with confirm, and record `accepted` in the ledger.

use crate::shed::{Place, ShedEstimate, Shedder, Verdict};
use lastcall_broker::{Names, PublishError, PublishProps, Publisher, ReplyChannel};
use lastcall_clock::{Clock, SystemClock};
use lastcall_core::admission::{Admission, AdmissionPolicy, Stage};
use lastcall_core::signature::{KeyError, sign_envelope};
use lastcall_core::{Deadline, Envelope, EnvelopeLimits, JobId, Kind, RejectError, SigningKey};
use lastcall_store::{AcceptedJob, JobRecord, Ledger, StoreError};
use serde_json::{Map, Value};
use std::sync::Arc;
use std::time::Duration;

/// How the caller sets the deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DeadlineSpec {
    /// A budget relative to now; the submitter stamps `created_at_ms = now`.
    RelativeMs(u64),
    /// An absolute `expires_at_ms`, ms since the epoch.
    AbsoluteMs(i64),
}

/// A job to submit.
#[derive(Debug, Clone)]
pub struct NewJob {
    /// Generated when absent.
    pub job_id: Option<String>,
    pub kind: String,
    pub payload: Map<String, Value>,
    pub deadline: DeadlineSpec,
    pub min_runtime_ms: Option<u64>,
    pub trace_id: Option<String>,
}

/// The result of an accepted submission.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Submitted {
    pub job_id: String,
    pub created_at_ms: i64,
    pub expires_at_ms: i64,
    /// The `expiration` the message was published with.
    pub ttl_ms: u64,
}

/// Why a job was not accepted. Nothing was published unless the error says so.
#[derive(Debug, thiserror::Error)]
pub enum SubmitError {
    #[error("invalid job: {0}")]
    Invalid(#[from] RejectError),
    #[error(
        "refused before publishing: the deadline leaves {remaining_ms} ms after the {uncertainty_ms} ms clock margin ({reason}); give the job a later deadline"
    )]
    Expired {
        reason: String,
        remaining_ms: i64,
        uncertainty_ms: u64,
    },
    #[error("not accepted: {0}")]
    Publish(#[from] PublishError),
    /// Shedding at the door ([`crate::shed`]): the queue wait alone would make the job miss
    /// its deadline. Nothing was published or recorded.
    #[error("not accepted: {0}")]
    WouldExpireInQueue(ShedEstimate),
    /// Shedding at the door: every live worker's circuit breaker for the model server of
    /// this kind is open (recorded in the ledger), so nothing would call it before the
    /// breakers' next trial. Nothing was published or recorded.
    #[error(
        "not accepted: the model server of kind `{kind}` is unavailable (the workers' circuit breaker is open); nothing was published. Retry after {retry_after_s} s"
    )]
    UpstreamUnavailable { kind: String, retry_after_s: u64 },
    #[error(
        "published and confirmed, but recording `accepted` in the ledger failed: {0}; the job will still run, but reconciliation cannot see it"
    )]
    Ledger(StoreError),
    #[error("not accepted: the ledger is unavailable, nothing was published: {0}")]
    Unrecorded(StoreError),
    #[error(
        "job `{job_id}` was already accepted with a different payload; use a new job id for new work"
    )]
    Conflict { job_id: String },
    #[error(
        "not accepted yet: another request with job id `{job_id}` is still being published; retry with the same job id"
    )]
    InFlight { job_id: String },
    #[error(
        "not accepted: job `{job_id}` already has an outcome ({state}); nothing was published. Use a new job id for new work (`lastcall jobs show {job_id}` shows the record)"
    )]
    AlreadyFinished { job_id: String, state: String },
}

/// Publishes jobs. Cheap to clone.
#[derive(Clone)]
pub struct Submitter {
    publisher: Publisher,
    names: Names,
    ledger: Option<Arc<Ledger>>,
    admission: AdmissionPolicy,
    limits: EnvelopeLimits,
    /// When set, every publish carries `x-lastcall-signature` (a trusted ingress).
    signing_key: Option<SigningKey>,
    /// Read right before each publish: the broker TTL is the budget left *then*, not when
    /// the request arrived (a ledger claim or a slow confirm may lie in between).
    clock: Arc<dyn Clock>,
    /// Shedding at the door (`None`: off).
    shedder: Option<Arc<Shedder>>,
}

impl std::fmt::Debug for Submitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submitter")
            .field("names", &self.names)
            .field("signs", &self.signing_key.is_some())
            .field("sheds", &self.shedder.is_some())
            .finish_non_exhaustive()
    }
}

/// A new job id: `job-` and 128 random bits in hex (from the operating system's
/// generator through `rand`'s thread-local CSPRNG). Unguessable: knowing one id (or the
/// time, the process id) tells nothing of another, so an id cannot be probed.
pub fn new_job_id() -> String {
    let bits: u128 = rand::random();
    format!("job-{bits:032x}")
}

impl Submitter {
    pub fn new(
        publisher: Publisher,
        names: Names,
        ledger: Option<Arc<Ledger>>,
        admission: AdmissionPolicy,
        limits: EnvelopeLimits,
    ) -> Self {
        Self {
            publisher,
            names,
            ledger,
            admission,
            limits,
            signing_key: None,
            clock: Arc::new(SystemClock::default()),
            shedder: None,
        }
    }

    /// Refuse, before publishing, jobs the queue wait would make expire
    /// ([`SubmitError::WouldExpireInQueue`]); `None` turns it off (the default).
    pub fn with_shedder(mut self, shedder: Option<Arc<Shedder>>) -> Self {
        self.shedder = shedder;
        self
    }

    /// Read `clock` for the TTL of each publish (default: the system clock).
    pub fn with_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.clock = clock;
        self
    }

    /// Whether the publisher's broker connection is up and not blocked by a resource
    /// alarm (for readiness checks).
    pub async fn broker_ready(&self) -> bool {
        self.publisher.is_connected().await && !self.publisher.is_blocked().await
    }

    /// Sign every envelope this submitter publishes with `key` (`None`: unsigned).
    pub fn with_signing_key(mut self, key: Option<SigningKey>) -> Self {
        self.signing_key = key;
        self
    }

    /// Build the envelope for `job` at `now_ms` (validated like any received body).
    pub fn envelope(&self, job: &NewJob, now_ms: i64) -> Result<Envelope, SubmitError> {
        let job_id = job.job_id.clone().unwrap_or_else(new_job_id);
        let deadline = match job.deadline {
            DeadlineSpec::RelativeMs(ms) => Deadline::from_budget(now_ms, ms),
            DeadlineSpec::AbsoluteMs(at) => Deadline::new(now_ms.min(at), at),
        };
        let env = Envelope::new(
            JobId::parse(&job_id).map_err(|e| invalid_field("job_id", e.0))?,
            Kind::parse(&job.kind).map_err(|e| invalid_field("kind", e.0))?,
            deadline,
            job.min_runtime_ms,
            job.trace_id.clone(),
            job.payload.clone(),
        );
        // One validation path: what we publish must pass the worker's own parser.
        Ok(Envelope::parse(&env.to_bytes(), &self.limits, now_ms)?)
    }

    /// Validate, stamp and publish one job; wait for the broker's confirm.
    pub async fn submit(&self, job: &NewJob, now_ms: i64) -> Result<Submitted, SubmitError> {
        let env = self.envelope(job, now_ms)?;
        self.submit_envelope(&env, None, now_ms).await
    }

    /// Publish an already-built envelope, then record `accepted` (`lastcall submit`).
    /// `signature` overrides the one this submitter would compute with its key.
    pub async fn submit_envelope(
        &self,
        env: &Envelope,
        signature: Option<String>,
        now_ms: i64,
    ) -> Result<Submitted, SubmitError> {
        if let Some(ledger) = &self.ledger {
            // An id that already has an outcome is never published again: it would be
            // acked as a duplicate without running, and "accepted" would be a lie.
            if let Some(rec) = ledger
                .get(env.job_id().as_str())
                .await
                .map_err(SubmitError::Unrecorded)?
                && rec
                    .state
                    .parse::<lastcall_core::State>()
                    .is_ok_and(|s| s.is_terminal())
            {
                return Err(SubmitError::AlreadyFinished {
                    job_id: rec.job_id,
                    state: rec.state,
                });
            }
        }
        self.shed(env, now_ms).await?;
        let submitted = self.publish_envelope(env, signature, now_ms, None).await?;
        if let Some(ledger) = &self.ledger {
            // The job is published: a passing ledger fault (a busy SQLite writer, a
            // PostgreSQL restart) must not leave it without its inventory row.
            let job = accepted_job(env, now_ms, "");
            retry_transient(RECORD_RETRY_FOR, || ledger.record_accepted(&job))
                .await
                .map_err(SubmitError::Ledger)?;
        }
        Ok(submitted)
    }

    /// The ingress's exactly-one-publish path: refuse stale work, **claim** the job id in
    /// the ledger (`accepted`, not yet stamped), publish with confirm, then stamp the claim
    /// (`accepted_at_ms`) — or release it if the publish failed, so that the `503` the
    /// caller reports is true (nothing accepted) and a retry with the same id can succeed.
    ///
    /// Another request for an id that exists gets [`Submission::Duplicate`] (same payload),
    /// [`SubmitError::Conflict`] (different payload), or — while the other request's publish
    /// is still pending — waits up to `claim_wait` for it to be stamped or released, then
    /// [`SubmitError::InFlight`]. Concurrent requests for one id therefore publish at most
    /// once, across processes: the ledger's primary key decides who publishes.
    ///
    /// Needs a ledger (the claim is the lock); without one it publishes like
    /// [`submit_envelope`](Self::submit_envelope).
    pub async fn submit_once(
        &self,
        env: &Envelope,
        now_ms: i64,
        claim_wait: Duration,
    ) -> Result<Submission, SubmitError> {
        self.submit_once_via(env, now_ms, claim_wait, "", None, async || Ok(()))
            .await
    }

    /// [`submit_once`](Self::submit_once) in `scope` (part of the idempotency fingerprint,
    /// [`request_fingerprint`]: the same job id from another scope is a conflict), running
    /// `claimed` once this request holds the claim, before the publish (the ingress
    /// registers a job's webhook there: only the request that publishes the job may set
    /// it, so a refused one — a conflict, a duplicate, a concurrent request's pending
    /// publish, shedding — changes nothing). If `claimed` fails, the claim is released and
    /// nothing is published ([`SubmitError::Unrecorded`]).
    pub async fn submit_once_scoped(
        &self,
        env: &Envelope,
        now_ms: i64,
        claim_wait: Duration,
        scope: &str,
        claimed: impl AsyncFnOnce() -> Result<(), StoreError>,
    ) -> Result<Submission, SubmitError> {
        self.submit_once_via(env, now_ms, claim_wait, scope, None, claimed)
            .await
    }

    /// A channel of its own for one streaming request ([`Publisher::reply_channel`]):
    /// the job published through [`submit_once_replying`](Self::submit_once_replying)
    /// carries its direct reply-to address, and the worker's token deltas come back on it.
    pub async fn reply_channel(&self) -> Result<ReplyChannel, SubmitError> {
        Ok(self.publisher.reply_channel().await?)
    }

    /// [`submit_once`](Self::submit_once) in `scope` (as
    /// [`submit_once_scoped`](Self::submit_once_scoped)), publishing on `reply` (with
    /// `reply_to` set).
    /// A duplicate (the id was claimed by an earlier request) is not published again, so
    /// no deltas come back for it.
    pub async fn submit_once_replying(
        &self,
        env: &Envelope,
        now_ms: i64,
        claim_wait: Duration,
        scope: &str,
        reply: &ReplyChannel,
    ) -> Result<Submission, SubmitError> {
        self.submit_once_via(env, now_ms, claim_wait, scope, Some(reply), async || Ok(()))
            .await
    }

    async fn submit_once_via(
        &self,
        env: &Envelope,
        now_ms: i64,
        claim_wait: Duration,
        scope: &str,
        reply: Option<&ReplyChannel>,
        claimed: impl AsyncFnOnce() -> Result<(), StoreError>,
    ) -> Result<Submission, SubmitError> {
        let Some(ledger) = &self.ledger else {
            claimed().await.map_err(SubmitError::Unrecorded)?;
            if let Some(reply) = reply {
                self.shed(env, now_ms).await?;
                return Ok(Submission::Published(
                    self.publish_envelope(env, None, now_ms, Some(reply))
                        .await?,
                ));
            }
            return Ok(Submission::Published(
                self.submit_envelope(env, None, now_ms).await?,
            ));
        };
        self.admit(env, now_ms)?;
        if let Err(e) = self.shed(env, now_ms).await {
            // An id the ledger already holds is answered as before (duplicate, conflict,
            // outcome): its message is queued already, a 429 for it would be wrong.
            if ledger
                .get(env.job_id().as_str())
                .await
                .map_err(SubmitError::Unrecorded)?
                .is_none()
            {
                return Err(e);
            }
        }
        let claim = accepted_job(env, now_ms, scope);
        let job_id = claim.job_id.clone();
        let waited_since = tokio::time::Instant::now();
        loop {
            if ledger
                .claim_accepted(&claim)
                .await
                .map_err(SubmitError::Unrecorded)?
            {
                break;
            }
            let existing = ledger
                .payload_hash(&job_id)
                .await
                .map_err(SubmitError::Unrecorded)?;
            let rec = ledger.get(&job_id).await.map_err(SubmitError::Unrecorded)?;
            let Some(rec) = rec else {
                continue; // released between our claim and the read: claim again
            };
            // A row a worker wrote first has no payload hash; it is the same job id, and
            // the worker has it: answer as a duplicate rather than publish again — but
            // only to its own tenant: another tenant's job is never this request's answer.
            if existing.as_ref().is_some_and(|h| *h != claim.payload_hash)
                || rec.tenant != claim.tenant.as_str()
            {
                return Err(SubmitError::Conflict { job_id });
            }
            let pending = rec.state == "accepted" && rec.accepted_at_ms.is_none();
            if !pending {
                return Ok(Submission::Duplicate(Box::new(rec)));
            }
            if waited_since.elapsed() >= claim_wait {
                return Err(SubmitError::InFlight { job_id });
            }
            tokio::time::sleep(CLAIM_POLL).await;
        }
        if let Err(e) = claimed().await {
            if let Err(le) = ledger.release_claim(&job_id, &claim.payload_hash).await {
                tracing::error!(job_id = %job_id, error = %le, "releasing a claim failed: the id stays claimed until reconciliation marks it unknown");
            }
            return Err(SubmitError::Unrecorded(e));
        }
        match self.publish_envelope(env, None, now_ms, reply).await {
            Ok(submitted) => {
                // The claim row already is the inventory record; the stamp only marks the
                // publish as confirmed. If it fails, the job is still accepted (and seen by
                // reconciliation); a repeat of the request waits for the worker to pick it
                // up or answers `InFlight`.
                if let Err(e) =
                    retry_transient(RECORD_RETRY_FOR, || ledger.record_accepted(&claim)).await
                {
                    tracing::error!(job_id = %job_id, error = %e, "published and confirmed, but stamping the claim failed");
                }
                Ok(Submission::Published(submitted))
            }
            Err(e) => {
                match ledger.release_claim(&job_id, &claim.payload_hash).await {
                    Ok(true) => {}
                    Ok(false) => tracing::warn!(
                        job_id = %job_id,
                        "publish failed, but a worker already holds the job: the claim stays"
                    ),
                    Err(le) => tracing::error!(
                        job_id = %job_id,
                        error = %le,
                        "publish failed and releasing the claim failed: the id stays claimed until reconciliation marks it unknown"
                    ),
                }
                Err(e)
            }
        }
    }

    /// Shedding at the door: refuse the job while its kind's model server is down for
    /// every live worker (their breakers, from the ledger), or when the estimated wait for
    /// its tier plus its call time (its own minimum runtime, else its kind's from the
    /// ledger) exceeds its remaining budget ([`crate::shed`]; admits without an estimate).
    async fn shed(&self, env: &Envelope, now_ms: i64) -> Result<(), SubmitError> {
        let Some(shedder) = &self.shedder else {
            return Ok(());
        };
        let now_ms = self.clock.now_ms().max(now_ms);
        // The deadline alone first (no IO, and its refusal says the exact reason: the
        // clock margin leaves no budget); the publish checks it again.
        self.admit(env, now_ms)?;
        let kind = env.kind().as_str();
        // The kind's model server is down for every live worker: nothing would call it
        // before the breakers' next trial.
        if let Some(until_ms) = shedder.upstream_open_until(kind, now_ms).await {
            return Err(SubmitError::UpstreamUnavailable {
                kind: kind.to_owned(),
                retry_after_s: retry_after_until(until_ms, now_ms),
            });
        }
        let place = Place {
            priority: env.priority(),
            lane: lastcall_core::lane_of(env.tenant(), env.priority()),
        };
        match shedder
            .check(
                kind,
                lastcall_core::request_size::RequestSize::of_payload(&env.payload),
                place,
                env.deadline().expires_at_ms(),
                env.min_runtime_ms,
                self.admission.clock_uncertainty_ms,
                now_ms,
            )
            .await
        {
            Verdict::Shed(estimate) => Err(SubmitError::WouldExpireInQueue(estimate)),
            Verdict::Admit(_) => Ok(()),
        }
    }

    /// Refuse work that is already too late to publish (after the clock margin).
    fn admit(&self, env: &Envelope, now_ms: i64) -> Result<u64, SubmitError> {
        let deadline = env.deadline();
        if let Admission::Refuse {
            refusal,
            remaining_ms,
        } = self.admission.check(deadline, env.min_runtime_ms, now_ms)
        {
            return Err(SubmitError::Expired {
                reason: refusal.reason(Stage::Publish),
                remaining_ms,
                uncertainty_ms: self.admission.clock_uncertainty_ms,
            });
        }
        Ok(deadline
            .broker_ttl_ms(now_ms)
            .expect("admitted work has budget left"))
    }

    /// Check the deadline, publish with the remaining budget as TTL, wait for the confirm.
    /// Touches no ledger. The budget is taken from the clock now, at the publish, never
    /// from the caller's earlier `now_ms` (which only stamps a relative deadline).
    async fn publish_envelope(
        &self,
        env: &Envelope,
        signature: Option<String>,
        now_ms: i64,
        via: Option<&ReplyChannel>,
    ) -> Result<Submitted, SubmitError> {
        let now_ms = self.clock.now_ms().max(now_ms);
        let ttl_ms = self.admit(env, now_ms)?;
        let deadline = env.deadline();
        let body = env.to_bytes();
        let signature = signature
            .or_else(|| (self.signing_key.as_ref()).map(|key| sign_envelope(key, env, &body)));
        let props = PublishProps {
            job_id: env.job_id().to_string(),
            ttl_ms: Some(ttl_ms),
            attempt: 0,
            timestamp_s: (now_ms / 1000).max(0) as u64,
            signature,
        };
        // A named tenant's lane, or the jobs exchange (the `default` tenant).
        let (exchange, key) =
            self.names
                .job_route(env.tenant(), env.priority(), env.kind().as_str());
        match via {
            Some(reply) => reply.publish(exchange, &key, &body, &props).await?,
            None => {
                self.publisher
                    .publish(exchange, &key, &body, &props)
                    .await?
            }
        }
        Ok(Submitted {
            job_id: env.job_id().to_string(),
            created_at_ms: deadline.created_at_ms(),
            expires_at_ms: deadline.expires_at_ms(),
            ttl_ms,
        })
    }
}

/// Whole seconds from `now_ms` until `until_ms`, rounded up, at least 1 and at most
/// [`crate::shed::MAX_RETRY_AFTER_S`]: a `Retry-After`.
pub fn retry_after_until(until_ms: i64, now_ms: i64) -> u64 {
    let ms = u64::try_from(until_ms.saturating_sub(now_ms)).unwrap_or(0);
    ms.div_ceil(1_000).clamp(1, crate::shed::MAX_RETRY_AFTER_S)
}

/// How often a request polls a same-id claim whose publish is pending.
const CLAIM_POLL: Duration = Duration::from_millis(20);

/// How long a ledger write after a confirmed publish is retried while the ledger answers
/// `Unavailable` (the message is in the broker already; giving up loses its inventory row).
const RECORD_RETRY_FOR: Duration = Duration::from_secs(30);

/// Run `op` again with backoff (50 ms doubling to 1 s) while it fails with a retryable
/// error, for at most `bound`; the last error is returned after that, and a non-retryable
/// error at once.
async fn retry_transient<T, F, Fut>(bound: Duration, mut op: F) -> Result<T, StoreError>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = Result<T, StoreError>>,
{
    let started = tokio::time::Instant::now();
    let mut backoff = Duration::from_millis(50);
    loop {
        match op().await {
            Err(e) if e.is_retryable() && started.elapsed() + backoff < bound => {
                tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "ledger write failed after the publish; retrying");
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(Duration::from_secs(1));
            }
            other => return other,
        }
    }
}

/// The `accepted` inventory row of an envelope submitted at `now_ms` in `scope`.
fn accepted_job(env: &Envelope, now_ms: i64, scope: &str) -> AcceptedJob {
    let deadline = env.deadline();
    AcceptedJob {
        job_id: env.job_id().to_string(),
        kind: env.kind().to_string(),
        created_at_ms: deadline.created_at_ms(),
        expires_at_ms: deadline.expires_at_ms(),
        accepted_at_ms: now_ms,
        trace_id: env.trace_id.clone(),
        payload_hash: request_fingerprint(scope, env),
        tenant: lastcall_core::Tenant::parse(env.tenant())
            .unwrap_or_else(|_| lastcall_core::Tenant::default_tenant()),
        priority: env.priority(),
    }
}

/// What [`Submitter::submit_once`] did.
#[derive(Debug, Clone)]
pub enum Submission {
    /// This call claimed the id, published with confirm and recorded `accepted`.
    Published(Submitted),
    /// The id was already accepted with the same payload: nothing was published. The
    /// record as the ledger has it now.
    Duplicate(Box<JobRecord>),
}

/// The idempotency fingerprint of a submission (the ledger's `payload_hash`): SHA-256
/// ([`lastcall_core::request_hash`]) over everything that defines the request — `scope`
/// (who sent it and through which route and model, as the ingress names it), the kind, the
/// minimum runtime and the payload's canonical JSON (keys sorted). The same job id with
/// another fingerprint is a conflict, never the first request's answer. The deadline is
/// left out: a client's retry stamps a new one.
pub fn request_fingerprint(scope: &str, env: &Envelope) -> String {
    let min_runtime = env
        .min_runtime_ms
        .map(|m| m.to_string())
        .unwrap_or_default();
    lastcall_core::request_hash(&[
        b"lastcall-request-v2",
        scope.as_bytes(),
        env.kind().as_str().as_bytes(),
        min_runtime.as_bytes(),
        &serde_json::to_vec(&env.payload).unwrap_or_default(),
    ])
}

fn invalid_field(field: &'static str, msg: &str) -> SubmitError {
    SubmitError::Invalid(RejectError {
        reason: lastcall_core::RejectReason::InvalidField,
        field: Some(field),
        message: msg.to_owned(),
        job_id: None,
    })
}

/// Why the signing key could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum SigningKeyError {
    #[error("cannot read the signing key file {path}: {source}")]
    File {
        path: String,
        source: std::io::Error,
    },
    #[error("invalid signing key from {from}: {source}")]
    Invalid { from: String, source: KeyError },
}

/// The `x-lastcall-signature` key from `file` if given, else the environment variable
/// `env_var`; `Ok(None)` when neither is set (signing off). A key that is set but empty or
/// shorter than [`SigningKey::MIN_LEN`] bytes is an error, never silently "off".
pub fn load_signing_key(
    file: Option<&std::path::Path>,
    env_var: &str,
) -> Result<Option<SigningKey>, SigningKeyError> {
    let (text, from) = match file {
        Some(path) => (
            std::fs::read_to_string(path).map_err(|source| SigningKeyError::File {
                path: path.display().to_string(),
                source,
            })?,
            format!("--signing-key-file {}", path.display()),
        ),
        None => match std::env::var(env_var) {
            Ok(v) => (v, env_var.to_owned()),
            Err(_) => return Ok(None),
        },
    };
    SigningKey::new(&text)
        .map(Some)
        .map_err(|source| SigningKeyError::Invalid { from, source })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn retry_after_is_whole_seconds_rounded_up_between_1_and_the_cap() {
        assert_eq!(retry_after_until(10_000, 10_000), 1);
        assert_eq!(retry_after_until(9_000, 10_000), 1, "already past");
        assert_eq!(retry_after_until(10_001, 10_000), 1);
        assert_eq!(retry_after_until(12_001, 10_000), 3);
        assert_eq!(
            retry_after_until(i64::MAX, i64::MIN),
            crate::shed::MAX_RETRY_AFTER_S
        );
    }

    #[tokio::test]
    async fn a_transient_ledger_error_after_the_publish_is_retried_until_it_passes() {
        let calls = AtomicU32::new(0);
        let r = retry_transient(Duration::from_secs(30), || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 2 {
                    Err(StoreError::Unavailable("pool timed out".into()))
                } else {
                    Ok(n)
                }
            }
        })
        .await;
        assert_eq!(r.unwrap(), 2);
        assert_eq!(calls.load(Ordering::SeqCst), 3);
    }

    #[tokio::test]
    async fn a_fatal_ledger_error_is_not_retried_and_a_transient_one_only_within_the_bound() {
        let calls = AtomicU32::new(0);
        let r: Result<(), _> = retry_transient(Duration::from_secs(30), || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err(StoreError::Fatal("constraint".into())) }
        })
        .await;
        assert!(matches!(r, Err(StoreError::Fatal(_))));
        assert_eq!(calls.load(Ordering::SeqCst), 1);

        let calls = AtomicU32::new(0);
        let r: Result<(), _> = retry_transient(Duration::from_millis(300), || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err(StoreError::Unavailable("down".into())) }
        })
        .await;
        assert!(matches!(r, Err(StoreError::Unavailable(_))));
        let n = calls.load(Ordering::SeqCst);
        assert!(
            (2..=4).contains(&n),
            "{n} tries in 300 ms of 50/100/200 ms backoff"
        );
    }

    #[test]
    fn signing_key_loading_names_the_source() {
        let dir = std::env::temp_dir().join(format!("lastcall-key-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let unset = "LASTCALL_TEST_UNSET_SIGNING_KEY_VAR";
        assert!(load_signing_key(None, unset).unwrap().is_none(), "off");
        let good = dir.join("good");
        std::fs::write(&good, "0123456789abcdef0123456789abcdef\n").unwrap();
        let k = load_signing_key(Some(&good), unset).unwrap().unwrap();
        assert_eq!(
            k,
            SigningKey::new("0123456789abcdef0123456789abcdef").unwrap()
        );
        let short = dir.join("short");
        std::fs::write(&short, "tooshort\n").unwrap();
        let e = load_signing_key(Some(&short), unset)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("--signing-key-file") && e.contains("at least 32"),
            "{e}"
        );
        let e = load_signing_key(Some(&dir.join("missing")), unset)
            .unwrap_err()
            .to_string();
        assert!(e.contains("cannot read the signing key file"), "{e}");
        let _ = std::fs::remove_dir_all(&dir);
    }
}
