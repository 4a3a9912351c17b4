//! Fuzz target (property-based, stable Rust) for the AMQP side of a delivery: arbitrary
//! properties and header tables (any value type, nested tables and arrays, hostile
//! `message_id` text) and arbitrary or signed bodies go through what the worker and the
//! dead-letter processor do with them — `lastcall_broker::consume::delivery_meta`, the
//! envelope parser, `require_signature` and the job id the outcome is recorded under.
//! Nothing may panic; a refusal always names a reason and a message on one line; a job
//! runs only when the signature header is the producer's.
//!
//! `LASTCALL_FUZZ_CASES` sets the cases (default 2,000), e.g.
//! `LASTCALL_FUZZ_CASES=1000000 cargo test -p lastcall-worker --release fuzz_`.

use lapin::BasicProperties;
use lapin::types::{AMQPValue, FieldArray, FieldTable, LongString, ShortString};
use lastcall_broker::consume::delivery_meta;
use lastcall_core::envelope::{Envelope, EnvelopeLimits};
use lastcall_core::job_id_for;
use lastcall_core::signature::{SIGNATURE_HEADER, SigningKey, require_signature, sign_envelope};
use proptest::prelude::*;
use std::collections::BTreeMap;

const NOW: i64 = 1_700_000_000_000;
const ATTEMPT: &str = "x-lastcall-attempt";

fn fuzz_config() -> ProptestConfig {
    ProptestConfig {
        cases: std::env::var("LASTCALL_FUZZ_CASES")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(2_000),
        failure_persistence: None,
        ..ProptestConfig::default()
    }
}

fn short(s: String) -> ShortString {
    // A short string is at most 255 bytes (cut on a char boundary).
    let mut s = s;
    while s.len() > 255 {
        s.pop();
    }
    ShortString::from(s)
}

fn value() -> impl Strategy<Value = AMQPValue> {
    let leaf = prop_oneof![
        any::<bool>().prop_map(AMQPValue::Boolean),
        any::<i8>().prop_map(AMQPValue::ShortShortInt),
        any::<u8>().prop_map(AMQPValue::ShortShortUInt),
        any::<i16>().prop_map(AMQPValue::ShortInt),
        any::<u16>().prop_map(AMQPValue::ShortUInt),
        any::<i32>().prop_map(AMQPValue::LongInt),
        any::<u32>().prop_map(AMQPValue::LongUInt),
        any::<i64>().prop_map(AMQPValue::LongLongInt),
        any::<u64>().prop_map(AMQPValue::Timestamp),
        any::<f64>().prop_map(AMQPValue::Double),
        any::<String>().prop_map(|s| AMQPValue::ShortString(short(s))),
        proptest::collection::vec(any::<u8>(), 0..80)
            .prop_map(|b| AMQPValue::LongString(LongString::from(b))),
        Just(AMQPValue::Void),
    ];
    leaf.prop_recursive(3, 32, 6, |inner| {
        prop_oneof![
            proptest::collection::vec(inner.clone(), 0..6)
                .prop_map(|v| AMQPValue::FieldArray(FieldArray::from(v))),
            proptest::collection::btree_map(key(), inner, 0..6).prop_map(|m| {
                AMQPValue::FieldTable(FieldTable::from(
                    m.into_iter()
                        .map(|(k, v)| (short(k), v))
                        .collect::<BTreeMap<_, _>>(),
                ))
            }),
        ]
    })
}

fn key() -> impl Strategy<Value = String> {
    prop_oneof![
        Just(ATTEMPT.to_owned()),
        Just(SIGNATURE_HEADER.to_owned()),
        Just("x-death".to_owned()),
        Just("x-delivery-count".to_owned()),
        Just("reason".to_owned()),
        Just("count".to_owned()),
        Just("time".to_owned()),
        Just("queue".to_owned()),
        any::<String>(),
    ]
}

fn envelope_body(id: &str) -> Vec<u8> {
    serde_json::to_vec(&serde_json::json!({
        "schema_version": 1,
        "job_id": id,
        "kind": "incident.summary",
        "created_at_ms": NOW,
        "expires_at_ms": NOW + 5_000,
        "payload": {"messages": [{"role": "user", "content": "hi"}]},
    }))
    .unwrap()
}

/// The body: arbitrary bytes, or a valid envelope (under a valid or a hostile job id).
fn body() -> impl Strategy<Value = (Vec<u8>, bool)> {
    prop_oneof![
        proptest::collection::vec(any::<u8>(), 0..256).prop_map(|b| (b, false)),
        "[A-Za-z0-9._:-]{1,40}".prop_map(|id| (envelope_body(&id), true)),
    ]
}

proptest! {
    #![proptest_config(fuzz_config())]

    #[test]
    fn fuzz_delivery_headers(
        headers in proptest::collection::btree_map(key(), value(), 0..8),
        message_id in proptest::option::of(any::<String>()),
        (body, valid) in body(),
        sign in 0u8..3,
    ) {
        let key = SigningKey::new("fuzz-key-0123456789abcdef0123456789").unwrap();
        let limits = EnvelopeLimits::default();
        let mut table: BTreeMap<ShortString, AMQPValue> =
            headers.into_iter().map(|(k, v)| (short(k), v)).collect();
        // A third of the valid envelopes carry their real signature.
        let parsed_first = Envelope::parse(&body, &limits, NOW);
        let signed = valid && sign == 0 && parsed_first.is_ok();
        if signed {
            let env = parsed_first.as_ref().unwrap();
            table.insert(
                short(SIGNATURE_HEADER.to_owned()),
                AMQPValue::LongString(LongString::from(sign_envelope(&key, env, &body).into_bytes())),
            );
        }
        let attempt_in = table.get(&short(ATTEMPT.to_owned())).cloned();
        let mut props = BasicProperties::default().with_headers(FieldTable::from(table));
        if let Some(m) = &message_id {
            props = props.with_message_id(short(m.clone()));
        }

        let meta = delivery_meta(&props);
        // The attempt header: an integer clamped to u32, anything else 0.
        let expected_attempt = match attempt_in {
            Some(AMQPValue::ShortShortInt(n)) => i64::from(n).max(0) as u32,
            Some(AMQPValue::ShortShortUInt(n)) => u32::from(n),
            Some(AMQPValue::ShortInt(n)) => i64::from(n).max(0) as u32,
            Some(AMQPValue::ShortUInt(n)) => u32::from(n),
            Some(AMQPValue::LongInt(n)) => i64::from(n).max(0) as u32,
            Some(AMQPValue::LongUInt(n)) => n,
            Some(AMQPValue::LongLongInt(n)) => n.clamp(0, u32::MAX as i64) as u32,
            Some(AMQPValue::Timestamp(n)) => i64::try_from(n).map_or(0, |n| n.min(u32::MAX as i64) as u32),
            _ => 0,
        };
        prop_assert_eq!(meta.attempt, expected_attempt);

        for signing in [true, false] {
            let k = signing.then_some(&key);
            let parsed = require_signature(
                k,
                Envelope::parse(&body, &limits, NOW),
                &body,
                meta.signature.as_deref(),
                meta.message_id.as_deref(),
            );
            match &parsed {
                Ok(_) => prop_assert!(!signing || signed, "an unsigned job was accepted"),
                Err(e) => {
                    prop_assert!(!e.reason.as_str().is_empty());
                    prop_assert!(!e.message.is_empty());
                    prop_assert!(!e.message.contains('\n') && !e.message.contains('\r'),
                        "a refusal's message spans lines (a forged log line?): {:?}", e.message);
                }
            }
            if signing && signed {
                prop_assert!(parsed.is_ok(), "a signed job was refused: {:?}", parsed);
            }
            let id = job_id_for(&parsed, meta.message_id.as_deref(), &body, signing);
            prop_assert!(!id.as_str().is_empty());
            prop_assert!(id.as_str().len() <= 128);
        }
    }
}
