//! The v1 job envelope (docs/wire-format.md): parsing and validation.
//!
//! Validation reports a [`RejectError`] whose `reason` is a stable code for the ledger and
//! whose `field` names the offending field, so a producer can fix its input.

use crate::deadline::Deadline;
use crate::ids::{JobId, Kind};
use crate::tenant::{Priority, Tenant};
use serde_json::{Map, Value};
use std::fmt;

/// The only schema version this build understands.
pub const SCHEMA_VERSION: i64 = 1;

/// Stable reason codes of a `rejected` outcome.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectReason {
    InvalidJson,
    NotAnObject,
    MissingField,
    InvalidField,
    UnsupportedSchema,
    InvalidDeadline,
    DeadlineBeyondHorizon,
    MessageTooLarge,
    BadSignature,
}

impl RejectReason {
    pub const fn as_str(self) -> &'static str {
        match self {
            RejectReason::InvalidJson => "invalid_json",
            RejectReason::NotAnObject => "not_an_object",
            RejectReason::MissingField => "missing_field",
            RejectReason::InvalidField => "invalid_field",
            RejectReason::UnsupportedSchema => "unsupported_schema",
            RejectReason::InvalidDeadline => "invalid_deadline",
            RejectReason::DeadlineBeyondHorizon => "deadline_beyond_horizon",
            RejectReason::MessageTooLarge => "message_too_large",
            RejectReason::BadSignature => "bad_signature",
        }
    }
}

/// Why an envelope was refused: a reason code, the field it concerns, and a message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RejectError {
    pub reason: RejectReason,
    /// The envelope field at fault, when there is one.
    pub field: Option<&'static str>,
    pub message: String,
    /// The job id, when the body carried a valid one (so the ledger can key the rejection).
    pub job_id: Option<JobId>,
}

impl RejectError {
    fn new(reason: RejectReason, field: Option<&'static str>, message: impl Into<String>) -> Self {
        Self {
            reason,
            field,
            message: message.into(),
            job_id: None,
        }
    }

    /// A body larger than the worker's or ingress's limit.
    pub fn too_large(size: usize, max: usize) -> Self {
        Self::new(
            RejectReason::MessageTooLarge,
            None,
            format!("message of {size} bytes exceeds the limit of {max} bytes"),
        )
    }
}

impl fmt::Display for RejectError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.field {
            Some(field) => write!(f, "{} ({field}): {}", self.reason.as_str(), self.message),
            None => write!(f, "{}: {}", self.reason.as_str(), self.message),
        }
    }
}

impl std::error::Error for RejectError {}

/// Limits applied while parsing; the defaults match the contract.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EnvelopeLimits {
    /// The farthest `expires_at_ms` may lie after `created_at_ms` (and after `now`).
    pub horizon_ms: i64,
    /// The largest body accepted, in bytes.
    pub max_body_bytes: usize,
}

impl Default for EnvelopeLimits {
    fn default() -> Self {
        Self {
            horizon_ms: 24 * 60 * 60 * 1000,
            max_body_bytes: 1024 * 1024,
        }
    }
}

/// A validated v1 envelope. Fields are private where they carry invariants.
#[derive(Debug, Clone, PartialEq)]
pub struct Envelope {
    job_id: JobId,
    kind: Kind,
    deadline: Deadline,
    /// The producer's minimum useful runtime, if it set one.
    pub min_runtime_ms: Option<u64>,
    pub trace_id: Option<String>,
    /// The tenant the producer named (`tenant`); absent: [`Tenant::DEFAULT`].
    tenant: Option<Tenant>,
    /// The priority tier the producer named (`priority`); absent: `standard`.
    priority: Option<Priority>,
    /// Kind-specific input, always a JSON object.
    pub payload: Map<String, Value>,
    /// Unknown fields, kept so a re-serialized envelope loses nothing.
    pub extra: Map<String, Value>,
}

impl Envelope {
    /// Build a fresh envelope at a trusted ingress.
    pub fn new(
        job_id: JobId,
        kind: Kind,
        deadline: Deadline,
        min_runtime_ms: Option<u64>,
        trace_id: Option<String>,
        payload: Map<String, Value>,
    ) -> Self {
        Self {
            job_id,
            kind,
            deadline,
            min_runtime_ms,
            trace_id,
            tenant: None,
            priority: None,
            payload,
            extra: Map::new(),
        }
    }

    /// The same envelope for `tenant` (written as `tenant` on the wire).
    pub fn with_tenant(mut self, tenant: Tenant) -> Self {
        self.tenant = Some(tenant);
        self
    }

    /// The same envelope at `priority` (written as `priority` on the wire).
    pub fn with_priority(mut self, priority: Priority) -> Self {
        self.priority = Some(priority);
        self
    }

    /// The job's tenant: the envelope's `tenant`, else [`Tenant::DEFAULT`].
    pub fn tenant(&self) -> &str {
        self.tenant.as_ref().map_or(Tenant::DEFAULT, Tenant::as_str)
    }

    /// The job's priority tier: the envelope's `priority`, else `standard`.
    pub fn priority(&self) -> Priority {
        self.priority.unwrap_or_default()
    }

    pub fn job_id(&self) -> &JobId {
        &self.job_id
    }

    pub fn kind(&self) -> &Kind {
        &self.kind
    }

    pub fn deadline(&self) -> Deadline {
        self.deadline
    }

    /// Parse and validate a message body. `now_ms` is used for the horizon rule only; the
    /// "already expired" decision belongs to [`crate::admission`].
    pub fn parse(body: &[u8], limits: &EnvelopeLimits, now_ms: i64) -> Result<Self, RejectError> {
        if body.len() > limits.max_body_bytes {
            return Err(RejectError::too_large(body.len(), limits.max_body_bytes));
        }
        let value: Value = serde_json::from_slice(body).map_err(|e| {
            RejectError::new(
                RejectReason::InvalidJson,
                None,
                format!("body is not valid JSON: {e}"),
            )
        })?;
        let Value::Object(mut obj) = value else {
            return Err(RejectError::new(
                RejectReason::NotAnObject,
                None,
                "body must be a JSON object",
            ));
        };
        // The job id first, so every later rejection can be keyed by it.
        let job_id = match obj.remove("job_id") {
            None => return Err(missing("job_id")),
            Some(Value::String(s)) => JobId::parse(&s)
                .map_err(|e| RejectError::new(RejectReason::InvalidField, Some("job_id"), e.0))?,
            Some(_) => return Err(invalid("job_id", "must be a string")),
        };
        let with_id = |mut e: RejectError| {
            e.job_id = Some(job_id.clone());
            e
        };
        Self::parse_rest(job_id.clone(), obj, limits, now_ms).map_err(with_id)
    }

    fn parse_rest(
        job_id: JobId,
        mut obj: Map<String, Value>,
        limits: &EnvelopeLimits,
        now_ms: i64,
    ) -> Result<Self, RejectError> {
        match obj.remove("schema_version") {
            None => return Err(missing("schema_version")),
            Some(v) if v.as_i64() == Some(SCHEMA_VERSION) => {}
            Some(v) => {
                return Err(RejectError::new(
                    RejectReason::UnsupportedSchema,
                    Some("schema_version"),
                    format!(
                        "schema_version {v} is not supported; this build understands {SCHEMA_VERSION}"
                    ),
                ));
            }
        }
        let kind = match obj.remove("kind") {
            None => return Err(missing("kind")),
            Some(Value::String(s)) => Kind::parse(&s)
                .map_err(|e| RejectError::new(RejectReason::InvalidField, Some("kind"), e.0))?,
            Some(_) => return Err(invalid("kind", "must be a string")),
        };
        let created_at_ms = match obj.remove("created_at_ms") {
            None => return Err(missing("created_at_ms")),
            Some(v) => v.as_i64().filter(|n| *n >= 0).ok_or_else(|| {
                invalid(
                    "created_at_ms",
                    "must be a non-negative integer (ms since the Unix epoch)",
                )
            })?,
        };
        let expires_at_ms = match obj.remove("expires_at_ms") {
            None => {
                return Err(RejectError::new(
                    RejectReason::InvalidDeadline,
                    Some("expires_at_ms"),
                    "missing required field",
                ));
            }
            Some(v) => v.as_i64().filter(|n| *n >= 0).ok_or_else(|| {
                RejectError::new(
                    RejectReason::InvalidDeadline,
                    Some("expires_at_ms"),
                    "must be a non-negative integer (ms since the Unix epoch)",
                )
            })?,
        };
        if expires_at_ms < created_at_ms {
            return Err(RejectError::new(
                RejectReason::InvalidDeadline,
                Some("expires_at_ms"),
                format!("deadline {expires_at_ms} lies before created_at_ms {created_at_ms}"),
            ));
        }
        let horizon = limits.horizon_ms;
        if expires_at_ms - created_at_ms > horizon || expires_at_ms.saturating_sub(now_ms) > horizon
        {
            return Err(RejectError::new(
                RejectReason::DeadlineBeyondHorizon,
                Some("expires_at_ms"),
                format!("deadline lies more than the horizon of {horizon} ms ahead"),
            ));
        }
        let min_runtime_ms = match obj.remove("min_runtime_ms") {
            None | Some(Value::Null) => None,
            // Compared as a u64: `u64::MAX as i64` is −1, which would pass any bound.
            Some(v) => Some(
                v.as_u64()
                    .filter(|n| i64::try_from(*n).is_ok_and(|n| n <= horizon))
                    .ok_or_else(|| {
                        invalid(
                            "min_runtime_ms",
                            "must be a non-negative integer no larger than the horizon",
                        )
                    })?,
            ),
        };
        let trace_id = match obj.remove("trace_id") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) if s.len() <= 256 => Some(s),
            Some(_) => return Err(invalid("trace_id", "must be a string of at most 256 bytes")),
        };
        let tenant =
            match obj.remove("tenant") {
                None | Some(Value::Null) => None,
                Some(Value::String(s)) => Some(Tenant::parse(&s).map_err(|e| {
                    RejectError::new(RejectReason::InvalidField, Some("tenant"), e.0)
                })?),
                Some(_) => return Err(invalid("tenant", "must be a string")),
            };
        let priority = match obj.remove("priority") {
            None | Some(Value::Null) => None,
            Some(Value::String(s)) => Some(s.parse::<Priority>().map_err(|e| {
                RejectError::new(RejectReason::InvalidField, Some("priority"), e.0)
            })?),
            Some(_) => return Err(invalid("priority", "must be a string")),
        };
        let payload = match obj.remove("payload") {
            None => return Err(missing("payload")),
            Some(Value::Object(p)) => p,
            Some(_) => return Err(invalid("payload", "must be a JSON object")),
        };
        Ok(Self {
            job_id,
            kind,
            deadline: Deadline::new(created_at_ms, expires_at_ms),
            min_runtime_ms,
            trace_id,
            tenant,
            priority,
            payload,
            extra: obj,
        })
    }

    /// Serialize to the wire format. Unknown fields are written back unchanged.
    pub fn to_json(&self) -> Value {
        let mut obj = self.extra.clone();
        obj.insert("schema_version".into(), SCHEMA_VERSION.into());
        obj.insert("job_id".into(), self.job_id.as_str().into());
        obj.insert("kind".into(), self.kind.as_str().into());
        obj.insert("created_at_ms".into(), self.deadline.created_at_ms().into());
        obj.insert("expires_at_ms".into(), self.deadline.expires_at_ms().into());
        if let Some(m) = self.min_runtime_ms {
            obj.insert("min_runtime_ms".into(), m.into());
        }
        if let Some(t) = &self.trace_id {
            obj.insert("trace_id".into(), t.clone().into());
        }
        if let Some(t) = &self.tenant {
            obj.insert("tenant".into(), t.as_str().into());
        }
        if let Some(p) = self.priority {
            obj.insert("priority".into(), p.as_str().into());
        }
        obj.insert("payload".into(), Value::Object(self.payload.clone()));
        Value::Object(obj)
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        serde_json::to_vec(&self.to_json()).expect("a JSON value always serializes")
    }
}

fn missing(field: &'static str) -> RejectError {
    RejectError::new(
        RejectReason::MissingField,
        Some(field),
        "missing required field",
    )
}

fn invalid(field: &'static str, msg: &str) -> RejectError {
    RejectError::new(RejectReason::InvalidField, Some(field), msg)
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    const NOW: i64 = 1_800_000_000_000;

    fn good() -> Value {
        json!({
            "schema_version": 1,
            "job_id": "job-1",
            "kind": "incident.summary",
            "created_at_ms": NOW,
            "expires_at_ms": NOW + 5_000,
            "payload": {"messages": [{"role": "user", "content": "hi"}]},
            "extra_field": {"kept": true}
        })
    }

    fn parse(v: &Value) -> Result<Envelope, RejectError> {
        Envelope::parse(
            &serde_json::to_vec(v).unwrap(),
            &EnvelopeLimits::default(),
            NOW,
        )
    }

    fn with(field: &str, value: Value) -> Value {
        let mut v = good();
        v[field] = value;
        v
    }

    fn without(field: &str) -> Value {
        let mut v = good();
        v.as_object_mut().unwrap().remove(field);
        v
    }

    #[test]
    fn parses_a_good_envelope_and_keeps_extra_fields() {
        let e = parse(&good()).unwrap();
        assert_eq!(e.job_id().as_str(), "job-1");
        assert_eq!(e.deadline().expires_at_ms(), NOW + 5_000);
        assert_eq!(e.extra["extra_field"], json!({"kept": true}));
        let again = Envelope::parse(&e.to_bytes(), &EnvelopeLimits::default(), NOW).unwrap();
        assert_eq!(again, e);
    }

    #[test]
    fn tenant_and_priority_are_optional_and_round_trip() {
        let plain = parse(&good()).unwrap();
        assert_eq!(
            (plain.tenant(), plain.priority()),
            ("default", Priority::Standard)
        );
        assert!(plain.to_json().get("tenant").is_none());
        let mut v = good();
        v["tenant"] = json!("team-b");
        v["priority"] = json!("critical");
        let e = parse(&v).unwrap();
        assert_eq!((e.tenant(), e.priority()), ("team-b", Priority::Critical));
        assert!(e.extra.get("tenant").is_none());
        let again = Envelope::parse(&e.to_bytes(), &EnvelopeLimits::default(), NOW).unwrap();
        assert_eq!(again, e);
    }

    #[test]
    fn every_reason_names_its_field() {
        let cases: Vec<(Value, RejectReason, Option<&str>)> = vec![
            (
                without("job_id"),
                RejectReason::MissingField,
                Some("job_id"),
            ),
            (
                with("job_id", json!("a b")),
                RejectReason::InvalidField,
                Some("job_id"),
            ),
            (
                with("job_id", json!(7)),
                RejectReason::InvalidField,
                Some("job_id"),
            ),
            (
                without("schema_version"),
                RejectReason::MissingField,
                Some("schema_version"),
            ),
            (
                with("schema_version", json!(2)),
                RejectReason::UnsupportedSchema,
                Some("schema_version"),
            ),
            (without("kind"), RejectReason::MissingField, Some("kind")),
            (
                with("kind", json!("Upper")),
                RejectReason::InvalidField,
                Some("kind"),
            ),
            (
                without("created_at_ms"),
                RejectReason::MissingField,
                Some("created_at_ms"),
            ),
            (
                with("created_at_ms", json!("soon")),
                RejectReason::InvalidField,
                Some("created_at_ms"),
            ),
            (
                without("expires_at_ms"),
                RejectReason::InvalidDeadline,
                Some("expires_at_ms"),
            ),
            (
                with("expires_at_ms", json!(-5)),
                RejectReason::InvalidDeadline,
                Some("expires_at_ms"),
            ),
            (
                with("expires_at_ms", json!(1.5)),
                RejectReason::InvalidDeadline,
                Some("expires_at_ms"),
            ),
            (
                with("expires_at_ms", json!(NOW - 1)),
                RejectReason::InvalidDeadline,
                Some("expires_at_ms"),
            ),
            (
                with("expires_at_ms", json!(NOW + 25 * 3_600_000)),
                RejectReason::DeadlineBeyondHorizon,
                Some("expires_at_ms"),
            ),
            (
                with("min_runtime_ms", json!(-1)),
                RejectReason::InvalidField,
                Some("min_runtime_ms"),
            ),
            // 2^64 − 1 is −1 as an i64: it must not pass the horizon bound.
            (
                with("min_runtime_ms", json!(u64::MAX)),
                RejectReason::InvalidField,
                Some("min_runtime_ms"),
            ),
            (
                with("min_runtime_ms", json!(1u64 << 63)),
                RejectReason::InvalidField,
                Some("min_runtime_ms"),
            ),
            (
                with("trace_id", json!(5)),
                RejectReason::InvalidField,
                Some("trace_id"),
            ),
            (
                with("tenant", json!("team a")),
                RejectReason::InvalidField,
                Some("tenant"),
            ),
            (
                with("tenant", json!(7)),
                RejectReason::InvalidField,
                Some("tenant"),
            ),
            (
                with("priority", json!("urgent")),
                RejectReason::InvalidField,
                Some("priority"),
            ),
            (
                without("payload"),
                RejectReason::MissingField,
                Some("payload"),
            ),
            (
                with("payload", json!("text")),
                RejectReason::InvalidField,
                Some("payload"),
            ),
        ];
        for (v, reason, field) in cases {
            let err = parse(&v).unwrap_err();
            assert_eq!((err.reason, err.field), (reason, field), "{v}");
            if let Some(f) = field {
                assert!(err.to_string().contains(f), "{err}");
            }
        }
    }

    #[test]
    fn rejections_after_the_id_carry_the_id() {
        let err = parse(&without("payload")).unwrap_err();
        assert_eq!(err.job_id.unwrap().as_str(), "job-1");
        assert!(parse(&without("job_id")).unwrap_err().job_id.is_none());
    }

    #[test]
    fn non_json_and_non_objects() {
        let l = EnvelopeLimits::default();
        assert_eq!(
            Envelope::parse(b"{oops", &l, NOW).unwrap_err().reason,
            RejectReason::InvalidJson
        );
        assert_eq!(
            Envelope::parse(b"[1]", &l, NOW).unwrap_err().reason,
            RejectReason::NotAnObject
        );
        let small = EnvelopeLimits {
            max_body_bytes: 10,
            ..l
        };
        assert_eq!(
            Envelope::parse(&serde_json::to_vec(&good()).unwrap(), &small, NOW)
                .unwrap_err()
                .reason,
            RejectReason::MessageTooLarge
        );
    }

    #[test]
    fn horizon_also_applies_against_now() {
        // A producer cannot extend its horizon by lying about created_at_ms.
        let v = json!({
            "schema_version": 1, "job_id": "x", "kind": "k",
            "created_at_ms": NOW + 30 * 3_600_000,
            "expires_at_ms": NOW + 30 * 3_600_000 + 1_000,
            "payload": {}
        });
        assert_eq!(
            parse(&v).unwrap_err().reason,
            RejectReason::DeadlineBeyondHorizon
        );
    }

    /// The parser's fuzz contract: whatever the bytes, `parse` returns (never panics), and
    /// every refusal names a reason and says something.
    fn check_parse(bytes: &[u8]) -> Result<(), TestCaseError> {
        match Envelope::parse(bytes, &EnvelopeLimits::default(), NOW) {
            Ok(e) => {
                // What parses survives its own round trip.
                let again = Envelope::parse(&e.to_bytes(), &EnvelopeLimits::default(), NOW);
                prop_assert!(again.is_ok(), "{:?}", again);
            }
            Err(e) => {
                prop_assert!(!e.reason.as_str().is_empty());
                prop_assert!(!e.message.is_empty(), "a refusal without a message: {e:?}");
                prop_assert!(!e.to_string().is_empty());
            }
        }
        Ok(())
    }

    /// Cases per fuzz property: a short run by default (CI), `LASTCALL_FUZZ_CASES=1000000`
    /// for the slow tier (`cargo test -p lastcall-core --release envelope::tests::fuzz`).
    fn fuzz_config() -> ProptestConfig {
        let cases = std::env::var("LASTCALL_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2_000);
        ProptestConfig {
            cases,
            failure_persistence: None,
            ..ProptestConfig::default()
        }
    }

    /// A structural mutation of a valid envelope.
    #[derive(Debug, Clone)]
    enum Mutation {
        Remove(usize),
        Replace(usize, Value),
        Add(String, Value),
        Truncate(usize),
        FlipByte(usize, u8),
    }

    fn any_json() -> impl Strategy<Value = Value> {
        let leaf = prop_oneof![
            Just(Value::Null),
            any::<bool>().prop_map(Value::Bool),
            any::<i64>().prop_map(|n| json!(n)),
            any::<f64>()
                .prop_map(|f| serde_json::Number::from_f64(f).map_or(Value::Null, Value::Number)),
            Just(json!(u64::MAX)),
            Just(json!(-1)),
            "[ -~]{0,40}".prop_map(Value::String),
            "\\PC{0,20}".prop_map(Value::String),
        ];
        leaf.prop_recursive(3, 24, 4, |inner| {
            prop_oneof![
                proptest::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                proptest::collection::btree_map("[a-z_]{1,12}", inner, 0..4)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
            ]
        })
    }

    fn mutation() -> impl Strategy<Value = Mutation> {
        prop_oneof![
            (0usize..8).prop_map(Mutation::Remove),
            (0usize..8, any_json()).prop_map(|(i, v)| Mutation::Replace(i, v)),
            ("[a-z_]{1,16}", any_json()).prop_map(|(k, v)| Mutation::Add(k, v)),
            (0usize..400).prop_map(Mutation::Truncate),
            (0usize..400, any::<u8>()).prop_map(|(i, b)| Mutation::FlipByte(i, b)),
        ]
    }

    fn mutate(mutations: &[Mutation]) -> Vec<u8> {
        let mut v = good();
        let mut bytes = None;
        for m in mutations {
            let obj = v.as_object_mut().expect("good() is an object");
            let keys: Vec<String> = obj.keys().cloned().collect();
            match m {
                Mutation::Remove(i) => {
                    obj.remove(&keys[i % keys.len().max(1)]);
                }
                Mutation::Replace(i, val) if !keys.is_empty() => {
                    obj.insert(keys[i % keys.len()].clone(), val.clone());
                }
                Mutation::Replace(..) => {}
                Mutation::Add(k, val) => {
                    obj.insert(k.clone(), val.clone());
                }
                Mutation::Truncate(n) => {
                    let b = bytes.get_or_insert_with(|| serde_json::to_vec(&v).unwrap());
                    b.truncate(*n);
                }
                Mutation::FlipByte(i, x) => {
                    let b = bytes.get_or_insert_with(|| serde_json::to_vec(&v).unwrap());
                    if !b.is_empty() {
                        let at = i % b.len();
                        b[at] ^= x;
                    }
                }
            }
        }
        bytes.unwrap_or_else(|| serde_json::to_vec(&v).unwrap())
    }

    proptest! {
        #![proptest_config(fuzz_config())]

        #[test]
        fn fuzz_arbitrary_bytes(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
            check_parse(&bytes)?;
        }

        #[test]
        fn fuzz_mutated_envelopes(mutations in proptest::collection::vec(mutation(), 1..6)) {
            check_parse(&mutate(&mutations))?;
        }
    }

    proptest! {
        #[test]
        fn round_trip_keeps_the_deadline(budget in 1i64..86_400_000, created in 0i64..NOW) {
            let mut v = good();
            v["created_at_ms"] = json!(created);
            v["expires_at_ms"] = json!(created + budget);
            let e = Envelope::parse(&serde_json::to_vec(&v).unwrap(), &EnvelopeLimits::default(), created);
            // Every budget inside the horizon parses: the property is not vacuous.
            prop_assert!(e.is_ok(), "{:?}", e);
            let e = e.unwrap();
            let again = Envelope::parse(&e.to_bytes(), &EnvelopeLimits::default(), created).unwrap();
            prop_assert_eq!(again.deadline(), e.deadline());
            prop_assert_eq!(again.deadline().expires_at_ms(), created + budget);
        }
    }
}
