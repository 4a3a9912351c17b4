//! docs/wire-format.md is what producers in other languages are written from: its example
//! body must parse as the worker parses it, and its example signature must verify.

use lastcall_core::signature::{sign, verify};
use lastcall_core::{Envelope, EnvelopeLimits, SigningKey};

const DOC: &str = include_str!("../../../docs/wire-format.md");

/// The first fenced block after the HTML comment `marker`.
fn block_after(marker: &str) -> &'static str {
    let at = DOC
        .find(marker)
        .unwrap_or_else(|| panic!("docs/wire-format.md has no {marker}"));
    let rest = &DOC[at..];
    let open = rest.find("```").expect("a fenced block after the marker");
    let body = &rest[open..];
    let start = body.find('\n').expect("a fence line") + 1;
    let end = body[start..].find("```").expect("a closing fence");
    body[start..start + end].trim_end_matches('\n')
}

#[test]
fn the_documented_example_parses_and_its_signature_verifies() {
    let body = block_after("<!-- wire-format-example-body -->");
    let signature = block_after("<!-- wire-format-example-signature -->");
    // The example's own clock: its creation time.
    let env = Envelope::parse(
        body.as_bytes(),
        &EnvelopeLimits::default(),
        1_800_000_000_000,
    )
    .expect("the documented example is a valid envelope");
    assert_eq!(env.job_id().as_str(), "inc-4711");
    assert_eq!(env.kind().as_str(), "incident.summary");
    assert_eq!(env.deadline().expires_at_ms(), 1_800_000_030_000);
    assert_eq!(env.min_runtime_ms, Some(2_000));

    let key = SigningKey::new("0123456789abcdef0123456789abcdef").unwrap();
    assert_eq!(
        sign(&key, "inc-4711", 1_800_000_030_000, body.as_bytes()),
        signature,
        "the documented signature is what the Rust signer computes"
    );
    verify(
        &key,
        "inc-4711",
        1_800_000_030_000,
        body.as_bytes(),
        Some(signature),
    )
    .expect("the documented signature verifies");
    // One byte of the body changed: it no longer verifies.
    let tampered = body.replace("30000,", "90000,");
    assert!(
        verify(
            &key,
            "inc-4711",
            1_800_000_030_000,
            tampered.as_bytes(),
            Some(signature)
        )
        .is_err()
    );
}

/// The example with `tenant` and `priority` parses, and the signature covers them: the same
/// job for another tenant or tier no longer verifies.
#[test]
fn the_documented_tenant_and_priority_parse_and_are_signed() {
    let body = block_after("<!-- wire-format-example-tenant -->");
    let env = Envelope::parse(
        body.as_bytes(),
        &EnvelopeLimits::default(),
        1_800_000_000_000,
    )
    .expect("the documented example is a valid envelope");
    assert_eq!(env.tenant(), "team-a");
    assert_eq!(env.priority(), lastcall_core::Priority::Critical);
    let key = SigningKey::new("0123456789abcdef0123456789abcdef").unwrap();
    let signature = sign(&key, "inc-4712", 1_800_000_030_000, body.as_bytes());
    for forged in [
        body.replace("\"team-a\"", "\"team-b\""),
        body.replace("\"critical\"", "\"standard\""),
        body.replace(",\"tenant\":\"team-a\"", ""),
    ] {
        assert_ne!(forged, body);
        assert!(
            verify(
                &key,
                "inc-4712",
                1_800_000_030_000,
                forged.as_bytes(),
                Some(signature.as_str())
            )
            .is_err(),
            "{forged}"
        );
    }
    // Absent: tenant `default`, tier `standard` (the first example names neither).
    let plain = Envelope::parse(
        block_after("<!-- wire-format-example-body -->").as_bytes(),
        &EnvelopeLimits::default(),
        1_800_000_000_000,
    )
    .unwrap();
    assert_eq!(
        (plain.tenant(), plain.priority()),
        ("default", lastcall_core::Priority::Standard)
    );
}

#[test]
fn the_documented_event_is_what_the_code_writes() {
    let body = block_after("<!-- wire-format-example-event -->");
    let e = lastcall_core::OutcomeEvent::from_json(body.as_bytes())
        .expect("the documented event parses as a v1 event");
    assert_eq!(e.routing_key(), "completed.incident.summary");
    assert_eq!(e.model_calls, 1);
    // Field for field and in order: the page shows exactly what is published.
    assert_eq!(String::from_utf8(e.to_json()).unwrap(), body);
}

#[test]
fn the_documented_delta_is_what_a_worker_sends() {
    let body = block_after("<!-- wire-format-example-delta -->");
    let d = lastcall_core::delta::Delta::from_json(body.as_bytes())
        .expect("the documented delta parses as a v1 delta");
    assert_eq!((d.seq, d.end), (0, false));
    assert_eq!(String::from_utf8(d.to_json()).unwrap(), body);
}
