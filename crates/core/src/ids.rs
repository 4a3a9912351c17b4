//! Identifier newtypes: a value of these types has passed the contract's character rules.

use std::fmt;

/// A job id: 1–128 chars of `[A-Za-z0-9._:-]`, stable for the job's whole life.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct JobId(String);

/// A job kind: 1–64 chars of `[a-z0-9._-]`; selects the model route.
#[derive(Debug, Clone, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Kind(String);

/// Why an identifier was refused; the message is shown to the caller as-is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct IdError(pub &'static str);

impl JobId {
    /// The longest job id the contract allows.
    pub const MAX_LEN: usize = 128;

    pub fn parse(s: &str) -> Result<Self, IdError> {
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err(IdError("must be 1-128 characters long"));
        }
        if !s
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-'))
        {
            return Err(IdError("may only contain the characters [A-Za-z0-9._:-]"));
        }
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Kind {
    /// The longest kind the contract allows.
    pub const MAX_LEN: usize = 64;

    pub fn parse(s: &str) -> Result<Self, IdError> {
        if s.is_empty() || s.len() > Self::MAX_LEN {
            return Err(IdError("must be 1-64 characters long"));
        }
        if !s.bytes().all(|b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || matches!(b, b'.' | b'_' | b'-')
        }) {
            return Err(IdError("may only contain the characters [a-z0-9._-]"));
        }
        Ok(Self(s.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for JobId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {

    #[test]
    fn request_hash_is_sha256_of_length_prefixed_parts() {
        let h = request_hash(&[b"a", b"bc"]);
        assert_eq!(h.len(), 7 + 64);
        assert!(h.starts_with("sha256:"));
        assert_ne!(h, request_hash(&[b"ab", b"c"]), "parts are length-prefixed");
        assert_ne!(h, request_hash(&[b"abc"]));
        assert_eq!(h, request_hash(&[b"a", b"bc"]));
        // sha256 of the empty list is sha256 of no bytes.
        assert_eq!(
            request_hash(&[]),
            "sha256:e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855"
        );
    }

    use super::*;
    use proptest::prelude::*;

    #[test]
    fn job_id_rules() {
        assert!(JobId::parse("a").is_ok());
        assert!(JobId::parse("inc-2026:11.30_x").is_ok());
        assert!(JobId::parse("").is_err());
        assert!(JobId::parse(&"a".repeat(129)).is_err());
        assert!(JobId::parse(&"a".repeat(128)).is_ok());
        assert!(JobId::parse("a b").is_err());
        assert!(JobId::parse("ä").is_err());
    }

    #[test]
    fn kind_rules() {
        assert!(Kind::parse("incident.summary").is_ok());
        assert!(Kind::parse("Incident").is_err());
        assert!(Kind::parse("a:b").is_err());
        assert!(Kind::parse(&"k".repeat(65)).is_err());
    }

    proptest! {
        #[test]
        fn valid_job_ids_round_trip(s in "[A-Za-z0-9._:-]{1,128}") {
            let id = JobId::parse(&s).unwrap();
            prop_assert_eq!(id.as_str(), s.as_str());
        }

        #[test]
        fn job_ids_with_other_chars_are_refused(a in "[A-Za-z0-9]{0,10}", c in "[^A-Za-z0-9._:-]", b in "[A-Za-z0-9]{0,10}") {
            let s = format!("{a}{c}{b}");
            prop_assert!(JobId::parse(&s).is_err());
        }
    }
}

/// FNV-1a-64 of `bytes` as 16 hex digits: a stable, cheap fingerprint (not a security hash).
pub fn fingerprint(bytes: &[u8]) -> String {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    format!("{h:016x}")
}

/// SHA-256 of `parts`, each length-prefixed (8 bytes, big-endian) so that no two lists
/// of parts hash the same input, as `sha256:` and 64 lowercase hex digits. The ingress's
/// idempotency fingerprint of a request (everything that defines it: who sent it, the
/// route and model, the kind, the payload, the minimum runtime), where a collision would
/// hand one request another's answer.
pub fn request_hash(parts: &[&[u8]]) -> String {
    use sha2::Digest;
    let mut h = sha2::Sha256::new();
    for p in parts {
        h.update((p.len() as u64).to_be_bytes());
        h.update(p);
    }
    let mut out = String::with_capacity(7 + 64);
    out.push_str("sha256:");
    for b in h.finalize() {
        out.push_str(&format!("{b:02x}"));
    }
    out
}

/// A stable id for a message that carries no valid `job_id` (broken JSON, no envelope):
/// `invalid-` + [`fingerprint`] of the body + its length, so the same bytes always map to
/// the same record and redeliveries of a malformed message are recorded once.
pub fn synthetic_job_id(body: &[u8]) -> JobId {
    JobId(format!("invalid-{}-{}", fingerprint(body), body.len()))
}

/// The ledger key of a delivery: the envelope's id; else the `message_id` property the
/// publisher set; else a synthetic id derived from the body, so nothing goes unrecorded.
///
/// A badly signed message is always recorded under a synthetic id, and so is *any*
/// invalid message while signatures are required (`signing`): the id it claims is not to
/// be trusted, and writing `rejected` under it would let anyone who can publish block a
/// real pending job with that id (outcomes are write-once). Its error names the claimed id.
pub fn job_id_for(
    parsed: &Result<crate::Envelope, crate::RejectError>,
    message_id: Option<&str>,
    body: &[u8],
    signing: bool,
) -> JobId {
    match parsed {
        Ok(e) => e.job_id().clone(),
        Err(_) if signing => synthetic_job_id(body),
        Err(e) if e.reason == crate::RejectReason::BadSignature => synthetic_job_id(body),
        Err(e) => e
            .job_id
            .clone()
            .or_else(|| message_id.and_then(|m| JobId::parse(m).ok()))
            .unwrap_or_else(|| synthetic_job_id(body)),
    }
}

#[cfg(test)]
mod synthetic_tests {
    use super::*;

    #[test]
    fn synthetic_ids_are_stable_and_valid() {
        let a = synthetic_job_id(b"{broken");
        assert_eq!(a, synthetic_job_id(b"{broken"));
        assert_ne!(a, synthetic_job_id(b"{broken2"));
        assert!(JobId::parse(a.as_str()).is_ok());
    }

    fn body_with(id: &str) -> Vec<u8> {
        format!(
            r#"{{"schema_version":1,"job_id":"{id}","kind":"chat","created_at_ms":1000,"expires_at_ms":60000,"payload":{{}}}}"#
        )
        .into_bytes()
    }

    #[test]
    fn a_valid_envelope_is_recorded_under_its_own_id() {
        let body = body_with("job-1");
        let parsed = crate::Envelope::parse(&body, &crate::EnvelopeLimits::default(), 2_000);
        assert!(parsed.is_ok(), "{parsed:?}");
        for signing in [false, true] {
            let id = job_id_for(&parsed, Some("other"), &body, signing);
            assert_eq!(id.as_str(), "job-1");
        }
    }

    #[test]
    fn an_invalid_message_gets_a_synthetic_id_unless_its_claim_can_be_trusted() {
        let body = b"{\"job_id\":\"victim\",\"kind\":\"chat\"}".to_vec();
        let parsed = crate::Envelope::parse(&body, &crate::EnvelopeLimits::default(), 2_000);
        let e = parsed.as_ref().expect_err("not a whole envelope");
        // Unsigned deployments: the claimed id (or the message_id) names the rejection.
        let id = job_id_for(&parsed, Some("from-props"), &body, false);
        assert_eq!(
            id.as_str(),
            e.job_id.as_ref().map_or("from-props", JobId::as_str)
        );
        // While signatures are required, no claim is trusted: a synthetic id.
        assert_eq!(
            job_id_for(&parsed, Some("from-props"), &body, true),
            synthetic_job_id(&body)
        );
        // Nothing to go by: a synthetic id either way.
        let junk = b"{broken".to_vec();
        let parsed = crate::Envelope::parse(&junk, &crate::EnvelopeLimits::default(), 2_000);
        assert_eq!(
            job_id_for(&parsed, None, &junk, false),
            synthetic_job_id(&junk)
        );
        assert_eq!(
            job_id_for(&parsed, Some("props-id"), &junk, false).as_str(),
            "props-id"
        );
    }
}
