//! Envelope signatures (`x-lastcall-signature`, docs/wire-format.md): an HMAC-SHA256 set by a
//! trusted ingress over the job id, the deadline and the exact body bytes, so that a worker
//! holding the same key can refuse work whose deadline an untrusted producer extended.
//!
//! Pure functions: the key arrives as a value (reading it from a file or the environment
//! happens outside the core).
//!
//! **Format:** `v1=<64 lowercase hex digits>`. The MAC input is length-prefixed, so no two
//! different `(job_id, expires_at_ms, body)` triples encode to the same bytes:
//!
//! ```text
//! "lastcall-signature-v1\0" ‖ u32-be len(job_id) ‖ job_id ‖ i64-be expires_at_ms
//!                          ‖ u64-be len(body) ‖ body
//! ```

use crate::envelope::{Envelope, RejectError, RejectReason};
use hmac::{KeyInit, Mac};
use std::fmt;

type HmacSha256 = hmac::Hmac<sha2::Sha256>;

/// The header name, for messages that name it.
pub const SIGNATURE_HEADER: &str = "x-lastcall-signature";
/// The prefix of a v1 signature.
const V1_PREFIX: &str = "v1=";
/// Domain separation: a MAC made for something else with the same key never verifies here.
const V1_DOMAIN: &[u8] = b"lastcall-signature-v1\0";

/// A shared HMAC key. `Debug` never prints it.
#[derive(Clone, PartialEq, Eq)]
pub struct SigningKey(Box<[u8]>);

impl fmt::Debug for SigningKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("SigningKey(***)")
    }
}

/// Why a key was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the signing key is empty")]
    Empty,
    #[error(
        "the signing key is {got} bytes long; at least {min} are required (e.g. `openssl rand -hex 32`)"
    )]
    TooShort { got: usize, min: usize },
}

impl SigningKey {
    /// The shortest key accepted: 32 bytes, the size of the HMAC-SHA256 output.
    pub const MIN_LEN: usize = 32;

    /// A key from its text form (a file's contents or an environment value); surrounding
    /// whitespace, such as a file's final newline, is not part of the key.
    pub fn new(secret: &str) -> Result<Self, KeyError> {
        Self::from_bytes(secret.trim().as_bytes())
    }

    /// A key from raw bytes, used as they are.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, KeyError> {
        if bytes.is_empty() {
            return Err(KeyError::Empty);
        }
        if bytes.len() < Self::MIN_LEN {
            return Err(KeyError::TooShort {
                got: bytes.len(),
                min: Self::MIN_LEN,
            });
        }
        Ok(Self(bytes.into()))
    }

    fn mac(&self, job_id: &str, expires_at_ms: i64, body: &[u8]) -> HmacSha256 {
        let mut mac =
            HmacSha256::new_from_slice(&self.0).expect("HMAC accepts a key of any length");
        mac.update(V1_DOMAIN);
        // A job id is at most 128 chars once parsed; the length prefix keeps the encoding
        // unambiguous for any input.
        mac.update(&(job_id.len() as u32).to_be_bytes());
        mac.update(job_id.as_bytes());
        mac.update(&expires_at_ms.to_be_bytes());
        mac.update(&(body.len() as u64).to_be_bytes());
        mac.update(body);
        mac
    }
}

/// Why a signature did not verify.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SignatureError {
    #[error("the message has no {SIGNATURE_HEADER} header and this worker requires one")]
    Missing,
    #[error("the {SIGNATURE_HEADER} header is malformed (expected `v1=` and 64 hex digits): {0}")]
    Malformed(&'static str),
    #[error(
        "the {SIGNATURE_HEADER} header does not match the job id, deadline and body (tampered, or signed with another key)"
    )]
    Mismatch,
}

/// The signature of `(job_id, expires_at_ms, body)`: `v1=<hex>`.
pub fn sign(key: &SigningKey, job_id: &str, expires_at_ms: i64, body: &[u8]) -> String {
    v1_hex(&key.mac(job_id, expires_at_ms, body).finalize().into_bytes())
}

const HEX: &[u8; 16] = b"0123456789abcdef";

/// `v1=` and the tag in lower-case hex.
fn v1_hex(tag: &[u8]) -> String {
    let mut out = String::with_capacity(V1_PREFIX.len() + 2 * tag.len());
    out.push_str(V1_PREFIX);
    for b in tag {
        out.push(char::from(HEX[usize::from(b >> 4)]));
        out.push(char::from(HEX[usize::from(b & 0x0f)]));
    }
    out
}

/// The signature of a webhook body (`x-lastcall-webhook-signature`): `v1=<hex>` of
/// HMAC-SHA256 over the body bytes alone, with the operator's webhook key.
pub fn sign_body(key: &SigningKey, body: &[u8]) -> String {
    let mut mac = HmacSha256::new_from_slice(&key.0).expect("HMAC accepts a key of any length");
    mac.update(body);
    v1_hex(&mac.finalize().into_bytes())
}

/// Check `signature` against `(job_id, expires_at_ms, body)`. The comparison of the MAC is
/// constant-time; only the format check (which reveals nothing about the key) is not.
pub fn verify(
    key: &SigningKey,
    job_id: &str,
    expires_at_ms: i64,
    body: &[u8],
    signature: Option<&str>,
) -> Result<(), SignatureError> {
    let sig = signature.ok_or(SignatureError::Missing)?;
    let hex = sig
        .trim()
        .strip_prefix(V1_PREFIX)
        .ok_or(SignatureError::Malformed(
            "unknown version or no `v1=` prefix",
        ))?;
    let tag = decode_hex_32(hex)?;
    key.mac(job_id, expires_at_ms, body)
        .verify_slice(&tag)
        .map_err(|_| SignatureError::Mismatch)
}

fn decode_hex_32(hex: &str) -> Result<[u8; 32], SignatureError> {
    let bytes = hex.as_bytes();
    if bytes.len() != 64 {
        return Err(SignatureError::Malformed("not 64 hex digits"));
    }
    let mut out = [0u8; 32];
    for (i, pair) in bytes.chunks_exact(2).enumerate() {
        let hi = nibble(pair[0])?;
        let lo = nibble(pair[1])?;
        out[i] = (hi << 4) | lo;
    }
    Ok(out)
}

fn nibble(c: u8) -> Result<u8, SignatureError> {
    match c {
        b'0'..=b'9' => Ok(c - b'0'),
        b'a'..=b'f' => Ok(c - b'a' + 10),
        b'A'..=b'F' => Ok(c - b'A' + 10),
        _ => Err(SignatureError::Malformed("not a hex digit")),
    }
}

/// The signature of an envelope as it is published (`body` must be the exact bytes sent).
pub fn sign_envelope(key: &SigningKey, env: &Envelope, body: &[u8]) -> String {
    sign(
        key,
        env.job_id().as_str(),
        env.deadline().expires_at_ms(),
        body,
    )
}

/// The worker's check: with a key, a valid envelope whose signature is missing or wrong
/// becomes a `bad_signature` rejection; an envelope that is already invalid keeps its
/// reason, but the job id it claims is dropped from the error (`job_id: None`, the claim
/// named in the message): nothing unverified may be recorded under a real job's id.
/// Without a key, `parsed` passes through unchanged.
/// `message_id` is the AMQP property, which an invalid body may use to claim an id too.
pub fn require_signature(
    key: Option<&SigningKey>,
    parsed: Result<Envelope, RejectError>,
    body: &[u8],
    signature: Option<&str>,
    message_id: Option<&str>,
) -> Result<Envelope, RejectError> {
    let (Some(key), Ok(env)) = (key, &parsed) else {
        return match (key, parsed) {
            (Some(_), Err(mut e)) => {
                // A `message_id` is any text a publisher chose: escaped (a newline in it
                // would forge a log line) and cut, before it reaches a log or the ledger.
                let claimed = (e.job_id.take().map(|j| j.to_string()))
                    .or_else(|| message_id.map(quoted_claim));
                if let Some(claimed) = claimed {
                    e.message = format!(
                        "{} (claims job id `{claimed}`, not trusted: an invalid message cannot be verified)",
                        e.message
                    );
                }
                Err(e)
            }
            (_, parsed) => parsed,
        };
    };
    match verify(
        key,
        env.job_id().as_str(),
        env.deadline().expires_at_ms(),
        body,
        signature,
    ) {
        Ok(()) => parsed,
        Err(e) => Err(RejectError {
            reason: RejectReason::BadSignature,
            field: Some(SIGNATURE_HEADER),
            message: format!("job id `{}` (not trusted): {e}", env.job_id()),
            job_id: Some(env.job_id().clone()),
        }),
    }
}

/// An untrusted id as an error message may quote it: control characters, quotes and
/// backslashes escaped (`escape_debug`), at most [`crate::JobId::MAX_LEN`] characters of it.
fn quoted_claim(raw: &str) -> String {
    let max = crate::JobId::MAX_LEN;
    let mut out: String = raw.escape_debug().take(max).collect();
    if raw.escape_debug().nth(max).is_some() {
        out.push('…');
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::envelope::EnvelopeLimits;
    use proptest::prelude::*;

    const KEY: &str = "0123456789abcdef0123456789abcdef";

    fn key() -> SigningKey {
        SigningKey::new(KEY).unwrap()
    }

    #[test]
    fn keys_are_validated_and_never_printed() {
        assert_eq!(SigningKey::new("  \n"), Err(KeyError::Empty));
        assert_eq!(
            SigningKey::new("short"),
            Err(KeyError::TooShort { got: 5, min: 32 })
        );
        let k = SigningKey::new(&format!("{KEY}\n")).unwrap();
        assert_eq!(k, key(), "a file's trailing newline is not part of the key");
        assert_eq!(format!("{k:?}"), "SigningKey(***)");
        assert!(!format!("{k:?}").contains("0123"));
        let msg = KeyError::TooShort { got: 5, min: 32 }.to_string();
        assert!(msg.contains("at least 32"), "{msg}");
    }

    #[test]
    fn known_answer_and_format() {
        let s = sign(&key(), "job-1", 1_000, b"{}");
        assert!(s.starts_with("v1="), "{s}");
        assert_eq!(s.len(), 3 + 64);
        assert!(s[3..].bytes().all(|c| HEX.contains(&c)), "{s}");
        // Pinned (computed independently with Python's hmac over the documented encoding):
        // a changed encoding would break every deployment that signs with an older build.
        assert_eq!(
            s,
            "v1=7e40d0043f22028af7610160d8279d468d74c3cf4eb8d59c1039da73ea4d8082"
        );
        assert_eq!(verify(&key(), "job-1", 1_000, b"{}", Some(&s)), Ok(()));
        assert_eq!(
            verify(
                &key(),
                "job-1",
                1_000,
                b"{}",
                Some(&s.to_uppercase().replace("V1", "v1"))
            ),
            Ok(()),
            "hex digits are case-insensitive"
        );
    }

    #[test]
    fn missing_and_malformed_signatures_name_the_problem() {
        let k = key();
        assert_eq!(verify(&k, "j", 1, b"", None), Err(SignatureError::Missing));
        for bad in [
            "",
            "v2=00",
            "00",
            "v1=zz",
            "v1=00",
            &format!("v1={}", "g".repeat(64)),
        ] {
            let e = verify(&k, "j", 1, b"", Some(bad)).unwrap_err();
            assert!(matches!(e, SignatureError::Malformed(_)), "{bad}: {e:?}");
            assert!(e.to_string().contains(SIGNATURE_HEADER));
        }
        let other = SigningKey::new("another-key-another-key-another-key").unwrap();
        assert_eq!(
            verify(&k, "j", 1, b"", Some(&sign(&other, "j", 1, b""))),
            Err(SignatureError::Mismatch),
            "signed with another key"
        );
    }

    #[test]
    fn length_prefixes_keep_fields_apart() {
        let k = key();
        // Moving bytes between the id and the body must change the MAC.
        assert_ne!(sign(&k, "ab", 1, b"c"), sign(&k, "a", 1, b"bc"));
        assert_ne!(sign(&k, "a", 1, b""), sign(&k, "a", 1, b"\0"));
    }

    fn envelope(expires_at_ms: i64) -> (Envelope, Vec<u8>) {
        let body = format!(
            r#"{{"schema_version":1,"job_id":"sig-1","kind":"chat","created_at_ms":1000,"expires_at_ms":{expires_at_ms},"payload":{{}}}}"#
        )
        .into_bytes();
        let env = Envelope::parse(&body, &EnvelopeLimits::default(), 1_000).unwrap();
        (env, body)
    }

    #[test]
    fn the_worker_check_rejects_missing_and_extended_deadlines() {
        let k = key();
        let (env, body) = envelope(61_000);
        let sig = sign_envelope(&k, &env, &body);
        assert!(require_signature(Some(&k), Ok(env.clone()), &body, Some(&sig), None).is_ok());
        assert!(
            require_signature(None, Ok(env.clone()), &body, None, None).is_ok(),
            "no key: signatures are not required"
        );
        let e = require_signature(Some(&k), Ok(env.clone()), &body, None, None).unwrap_err();
        assert_eq!(e.reason, RejectReason::BadSignature);
        assert_eq!(e.field, Some(SIGNATURE_HEADER));
        assert_eq!(e.job_id.as_ref().map(|j| j.as_str()), Some("sig-1"));
        // The producer re-publishes with a later deadline and the old signature.
        let (later, later_body) = envelope(3_600_000);
        let e = require_signature(Some(&k), Ok(later), &later_body, Some(&sig), None).unwrap_err();
        assert_eq!(e.reason, RejectReason::BadSignature);
        assert!(e.message.contains("does not match"), "{}", e.message);
        // An already invalid envelope keeps its own reason.
        let invalid = Envelope::parse(b"[]", &EnvelopeLimits::default(), 0);
        let e = require_signature(Some(&k), invalid, b"[]", None, Some("victim")).unwrap_err();
        assert_eq!(e.reason, RejectReason::NotAnObject);
        // … and the id it claims (here by its `message_id`) is named, never kept.
        assert_eq!(e.job_id, None);
        assert!(e.message.contains("`victim`"), "{}", e.message);
    }

    /// A `message_id` that carries a newline (to forge a log line) or an escape sequence
    /// reaches the error text, and so the ledger and the log, escaped and cut.
    #[test]
    fn a_claimed_message_id_is_escaped() {
        let k = key();
        let invalid = || Envelope::parse(b"[]", &EnvelopeLimits::default(), 0);
        let forged = "x\nINFO lastcall: job completed job_id=victim\r\u{1b}[2J";
        let e = require_signature(Some(&k), invalid(), b"[]", None, Some(forged)).unwrap_err();
        assert!(!e.message.chars().any(char::is_control), "{:?}", e.message);
        assert!(e.message.contains(r"x\nINFO"), "{}", e.message);
        let long = "a".repeat(10_000);
        let e = require_signature(Some(&k), invalid(), b"[]", None, Some(&long)).unwrap_err();
        assert!(e.message.len() < 400, "{}", e.message.len());
    }

    proptest! {
        #[test]
        fn roundtrip_verifies(id in "[A-Za-z0-9._:-]{1,128}", exp in any::<i64>(), body in proptest::collection::vec(any::<u8>(), 0..256)) {
            let k = key();
            let s = sign(&k, &id, exp, &body);
            prop_assert_eq!(verify(&k, &id, exp, &body, Some(&s)), Ok(()));
        }

        #[test]
        fn any_tampering_fails(
            id in "[A-Za-z0-9._:-]{1,64}",
            exp in any::<i64>(),
            body in proptest::collection::vec(any::<u8>(), 0..128),
            which in 0..4u8,
            flip in 0..64usize,
        ) {
            let k = key();
            let s = sign(&k, &id, exp, &body);
            let (mut id2, mut exp2, mut body2, mut s2) = (id.clone(), exp, body.clone(), s.clone());
            match which {
                0 => id2.push('x'),
                1 => exp2 = exp.wrapping_add(1 + (flip as i64)),
                2 => {
                    if body2.is_empty() { body2.push(0) } else { let i = flip % body2.len(); body2[i] ^= 0x01 }
                }
                _ => {
                    // Change one hex digit of the tag.
                    let i = 3 + flip;
                    let c = s2.as_bytes()[i];
                    let r = if c == b'0' { "1" } else { "0" };
                    s2.replace_range(i..=i, r);
                }
            }
            prop_assert_eq!(
                verify(&k, &id2, exp2, &body2, Some(&s2)),
                Err(SignatureError::Mismatch)
            );
        }
    }
}
