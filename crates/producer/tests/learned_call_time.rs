//! The door's call time: the shedder reads, per kind, the longest of the newest measured
//! completed calls (their `latency_ms`; a client-chosen `min_runtime_ms` never counts), from
//! a real SQLite ledger.

use lastcall_broker::management::Management;
use lastcall_core::request_size::RequestSize;
use lastcall_core::{Decision, State};
use lastcall_producer::shed::{LEARNED_WINDOW_MS, Shedder};
use lastcall_store::{Ledger, OutcomeRecord};
use std::sync::Arc;

const NOW: i64 = 1_800_000_000_000;

/// A shedder whose management API is unreachable (port 9): the call time needs only the
/// ledger.
fn shedder(ledger: Option<Arc<Ledger>>) -> Shedder {
    Shedder::new(
        Management::from_amqp_url(
            "amqp://guest:guest@127.0.0.1:5672/%2f",
            "http://127.0.0.1:9",
        ),
        "q",
    )
    .with_ledger(ledger)
}

/// An outcome whose call took `ms` (`None`: no measured call); its `min_runtime_ms` is a
/// client's choice, large, and must not count.
async fn record(ledger: &Ledger, id: &str, kind: &str, state: State, ms: Option<i64>, at: i64) {
    let rec = OutcomeRecord {
        attempt_key: format!("{id}:a"),
        latency_ms: ms,
        min_runtime_ms: Some(60_000),
        ..OutcomeRecord::new(id, kind, state, Decision::Ack, at)
    };
    assert!(ledger.record_outcome(&rec).await.unwrap(), "{id} recorded");
}

/// A fresh SQLite ledger in a temp directory named by `tag` (removed by the caller).
async fn sqlite_ledger(tag: &str) -> (std::path::PathBuf, Arc<Ledger>) {
    let dir = std::env::temp_dir().join(format!("lastcall-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ledger = Ledger::connect(&format!("sqlite://{}/l.db", dir.display()))
        .await
        .unwrap();
    (dir, Arc::new(ledger))
}

/// A request of `n` prompt tokens, no `max_tokens`.
fn tokens(n: u64) -> Option<RequestSize> {
    Some(RequestSize {
        prompt_tokens: n,
        max_tokens: None,
    })
}

/// A completed call `id` of `kind` that took `ms`, recorded `at_s` seconds into the minute
/// before `NOW`.
fn completed(id: String, kind: &str, ms: u64, at_s: u64) -> OutcomeRecord {
    OutcomeRecord {
        attempt_key: format!("{id}:a"),
        latency_ms: Some(ms as i64),
        ..OutcomeRecord::new(
            id,
            kind,
            State::Completed,
            Decision::Ack,
            NOW - 60_000 + 1_000 * at_s as i64,
        )
    }
}

#[tokio::test]
async fn the_door_uses_the_longest_recent_measured_call_of_the_same_kind() {
    let (dir, ledger) = sqlite_ledger("learned").await;
    assert_eq!(
        shedder(Some(ledger.clone()))
            .learned_call_ms("summary", None, NOW)
            .await,
        None,
        "nothing recorded yet"
    );

    let too_old = NOW - LEARNED_WINDOW_MS - 1;
    record(
        &ledger,
        "old",
        "summary",
        State::Completed,
        Some(7_000),
        too_old,
    )
    .await;
    record(
        &ledger,
        "a",
        "summary",
        State::Completed,
        Some(900),
        NOW - 5_000,
    )
    .await;
    record(
        &ledger,
        "b",
        "summary",
        State::Completed,
        Some(400),
        NOW - 1_000,
    )
    .await;
    // Newer, but not a completion.
    record(
        &ledger,
        "c",
        "summary",
        State::ExpiredNotStarted,
        Some(5_000),
        NOW - 500,
    )
    .await;
    record(&ledger, "d", "code", State::Completed, Some(50), NOW - 200).await;
    record(&ledger, "e", "code", State::Completed, None, NOW - 100).await;
    record(
        &ledger,
        "f",
        "lonely",
        State::Completed,
        Some(3_000),
        too_old,
    )
    .await;

    let door = shedder(Some(ledger.clone()));
    assert_eq!(
        door.learned_call_ms("summary", None, NOW).await,
        Some(900),
        "the longest of the recent completed calls"
    );
    assert_eq!(
        door.learned_call_ms("code", None, NOW).await,
        Some(50),
        "a completion without a measured call is skipped"
    );
    assert_eq!(door.learned_call_ms("other", None, NOW).await, None);
    assert_eq!(
        door.learned_call_ms("lonely", None, NOW).await,
        None,
        "only the last 10 minutes count"
    );
    // A reading is reused for a second (the same answer at a later `now`).
    assert_eq!(
        door.learned_call_ms("summary", None, NOW + LEARNED_WINDOW_MS)
            .await,
        Some(900)
    );
    assert_eq!(
        shedder(None).learned_call_ms("summary", None, NOW).await,
        None,
        "no ledger, no call time"
    );
    ledger.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// Calls recorded before ledger version 12 carry the server's prompt count but not the
/// payload's measure; newer ones carry both (here the server counts twice the
/// approximation). The door puts them in one unit: 6 newer calls alone are too few for a
/// fit, the 20 older ones make it hold, and a short job is held to a short call's time.
#[tokio::test]
async fn the_door_fits_older_calls_by_the_servers_count() {
    let (dir, ledger) = sqlite_ledger("counted").await;
    for i in 0..26u64 {
        let counted = if i % 10 < 7 { 20 } else { 1_200 };
        let newer = i >= 20;
        let rec = OutcomeRecord {
            prompt_tokens: Some(counted as i64),
            request_size: if newer { tokens(counted / 2) } else { None },
            ..completed(
                format!("c{i}"),
                "counted",
                50 + counted + (i * 7919) % 13,
                i,
            )
        };
        assert!(ledger.record_outcome(&rec).await.unwrap());
    }
    let door = shedder(Some(ledger.clone()));
    let short = door
        .learned_call_ms("counted", tokens(10), NOW)
        .await
        .unwrap();
    let long = door
        .learned_call_ms("counted", tokens(600), NOW)
        .await
        .unwrap();
    assert!(short < 120, "a short prompt: {short} ms");
    assert!((1_250..1_400).contains(&long), "a long prompt: {long} ms");
    ledger.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}

/// A kind that mixes short and long prompts (issue #31's server: ~70 ms and ~1.25 s): once
/// 8 completed calls of known size are in the ledger, a short job is held to a short call's
/// time and a long one to a long one's, not every job to the longest call.
#[tokio::test]
async fn the_door_holds_each_request_to_its_own_call_time() {
    let (dir, ledger) = sqlite_ledger("sized").await;
    for i in 0..30u64 {
        let p = if i % 10 < 7 { 10 } else { 600 };
        let rec = OutcomeRecord {
            request_size: tokens(p),
            ..completed(format!("m{i}"), "mixed", 50 + 2 * p + (i * 7919) % 13, i)
        };
        assert!(ledger.record_outcome(&rec).await.unwrap());
    }
    let door = shedder(Some(ledger.clone()));
    let short = door
        .learned_call_ms("mixed", tokens(10), NOW)
        .await
        .unwrap();
    let long = door
        .learned_call_ms("mixed", tokens(600), NOW)
        .await
        .unwrap();
    let unsized_job = door.learned_call_ms("mixed", None, NOW).await.unwrap();
    assert!(short < 120, "a short prompt: {short} ms");
    assert!((1_250..1_400).contains(&long), "a long prompt: {long} ms");
    assert!(
        unsized_job >= 1_250,
        "the longest recent call: {unsized_job} ms"
    );
    ledger.close().await;
    let _ = std::fs::remove_dir_all(&dir);
}
