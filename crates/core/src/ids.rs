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
}
