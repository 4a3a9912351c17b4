//! The publisher library API: validate, stamp the deadline, refuse stale work before it is
//! published, publish with confirm, and record `accepted` in the ledger.

use lastcall_broker::{Names, PublishError, PublishProps, Publisher};
use lastcall_core::admission::{Admission, AdmissionPolicy, Stage};
use lastcall_core::signature::{KeyError, sign_envelope};
use lastcall_core::{Deadline, Envelope, EnvelopeLimits, JobId, Kind, RejectError, SigningKey};
use lastcall_store::{AcceptedJob, Ledger, StoreError};
use serde_json::{Map, Value};
use std::sync::Arc;

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
    #[error(
        "published and confirmed, but recording `accepted` in the ledger failed: {0}; the job will still run, but reconciliation cannot see it"
    )]
    Ledger(StoreError),
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
}

impl std::fmt::Debug for Submitter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Submitter")
            .field("names", &self.names)
            .field("signs", &self.signing_key.is_some())
            .finish_non_exhaustive()
    }
}

static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

/// A new job id: time, process and a sequence number; unique enough without a UUID crate.
pub fn new_job_id(now_ms: i64) -> String {
    let n = SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!("job-{now_ms:x}-{:x}-{n}", std::process::id())
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
        }
    }

    /// Sign every envelope this submitter publishes with `key` (`None`: unsigned).
    pub fn with_signing_key(mut self, key: Option<SigningKey>) -> Self {
        self.signing_key = key;
        self
    }

    /// Build the envelope for `job` at `now_ms` (validated like any received body).
    pub fn envelope(&self, job: &NewJob, now_ms: i64) -> Result<Envelope, SubmitError> {
        let job_id = job.job_id.clone().unwrap_or_else(|| new_job_id(now_ms));
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

    /// Publish an already-built envelope (e.g. from the HTTP ingress). `signature`
    /// overrides the one this submitter would compute with its key.
    pub async fn submit_envelope(
        &self,
        env: &Envelope,
        signature: Option<String>,
        now_ms: i64,
    ) -> Result<Submitted, SubmitError> {
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
        let ttl_ms = deadline
            .broker_ttl_ms(now_ms)
            .expect("admitted work has budget left");
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
        self.publisher
            .publish(
                &self.names.jobs_exchange,
                env.kind().as_str(),
                &body,
                &props,
            )
            .await?;
        if let Some(ledger) = &self.ledger {
            let accepted = AcceptedJob {
                job_id: env.job_id().to_string(),
                kind: env.kind().to_string(),
                created_at_ms: deadline.created_at_ms(),
                expires_at_ms: deadline.expires_at_ms(),
                accepted_at_ms: now_ms,
                trace_id: env.trace_id.clone(),
                payload_hash: payload_hash(&env.payload),
            };
            ledger
                .record_accepted(&accepted)
                .await
                .map_err(SubmitError::Ledger)?;
        }
        Ok(Submitted {
            job_id: env.job_id().to_string(),
            created_at_ms: deadline.created_at_ms(),
            expires_at_ms: deadline.expires_at_ms(),
            ttl_ms,
        })
    }
}

/// A stable fingerprint of a payload (FNV-1a of its canonical JSON).
pub fn payload_hash(payload: &Map<String, Value>) -> String {
    lastcall_core::fingerprint(&serde_json::to_vec(payload).unwrap_or_default())
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
