//! The text the model produces for fixed prompts, pinned (issue #19: sharing the weights
//! between slots must not change any answer). The expected strings were recorded with the
//! code that loaded one full model per slot, before the weights were shared (48 and 40
//! tokens). The calls now ask for their first 12 tokens, which must be the beginning of the
//! pinned text: decoding is the whole cost of these tests (55 CPU-seconds with the full
//! texts, 2026-12-06), and a slot that read another's state, or its own from an earlier
//! call, goes astray from the first tokens on.

mod common;

use lastcall_backend::{Backend, BackendError, CallRequest, CancellationToken};
use lastcall_local::LocalPool;
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn request(payload: Value) -> CallRequest {
    CallRequest {
        job_id: "pinned".into(),
        kind: "chat".into(),
        attempt: 0,
        payload: payload.as_object().unwrap().clone(),
        timeout: Duration::from_secs(600),
        priority: lastcall_backend::Priority::Standard,
    }
}

/// Greedy decoding (the default temperature 0).
fn greedy() -> Value {
    json!({"messages": [{"role": "user", "content": "What is the capital of France?"}],
           "max_tokens": PINNED_TOKENS})
}
const GREEDY: &str = "L'Étoile: Paris, la Ciampère de l'Amour (The City of Love) in French.";

/// Temperature sampling with the backend's fixed seed.
fn sampled() -> Value {
    json!({"prompt": "Write a short poem about the sea.", "max_tokens": PINNED_TOKENS, "temperature": 0.8})
}
const SAMPLED: &str = "The ethereal depths of the ocean, where bioluminescent wonders reside, \n\n\
    Where myth and legend entwine, and shadows dance in time \nIn this haunting refrain, I've crafted";

/// Tokens asked of each pinned call: the pinned texts' first ones.
const PINNED_TOKENS: u64 = 12;

/// `got` is the beginning of the pinned text `want`, and not a trivially short one.
#[track_caller]
fn assert_begins(got: &str, want: &str) {
    assert!(
        got.chars().count() >= 20 && want.starts_with(got),
        "{got:?} is not the beginning of the pinned {want:?}"
    );
}

async fn text(b: &dyn Backend, payload: Value) -> String {
    b.call(request(payload), CancellationToken::new())
        .await
        .expect("generation succeeds")
        .text
}

/// Two slots on one copy of the weights (the loaded instance and a new one) decode two
/// prompts at the same time, then swap prompts: each gives the pinned text, so neither reads
/// the other's KV cache or sampling state, nor its own from its previous call.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slots_sharing_the_weights_give_the_pinned_text_at_the_same_time() {
    let pool = Arc::new(LocalPool::load(common::model_path(), 2).expect("model loads"));
    let [a, b] = pool.instances() else {
        panic!("two instances")
    };
    assert!(a.shares_weights_with(b), "one copy of the weights");
    assert!(!a.is_same_instance(b), "each slot its own instance");
    let (greedy, sampled) = ((greedy(), GREEDY), (sampled(), SAMPLED));
    for ((prompt_a, want_a), (prompt_b, want_b)) in
        [(greedy.clone(), sampled.clone()), (sampled, greedy)]
    {
        let (pa, pb) = (pool.clone(), pool.clone());
        let ta = tokio::spawn(async move { text(&pa.instances()[0], prompt_a).await });
        let tb = tokio::spawn(async move { text(&pb.instances()[1], prompt_b).await });
        assert_begins(&ta.await.unwrap(), want_a);
        assert_begins(&tb.await.unwrap(), want_b);
    }
}

/// While one slot decodes a long answer, a call on the other slot runs to completion (it
/// does not wait behind the first), and the long call still stops when cancelled.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slot_does_not_wait_for_the_other_and_cancellation_still_stops_it() {
    let pool = Arc::new(LocalPool::load(common::model_path(), 2).expect("model loads"));
    let cancel = CancellationToken::new();
    let long = {
        let (pool, cancel) = (pool.clone(), cancel.clone());
        tokio::spawn(async move {
            let story = json!({"prompt": "Write a long story about a dragon and a knight.",
                               "max_tokens": 4000});
            pool.call(request(story), cancel).await
        })
    };
    common::wait_until("the long call holds an instance", || pool.available() == 1).await;
    let out = pool
        .call(request(greedy()), CancellationToken::new())
        .await
        .expect("the second slot serves a call while the first decodes");
    assert_begins(&out.text, GREEDY);
    assert!(!long.is_finished(), "the long call was still decoding");
    let fired = Instant::now();
    cancel.cancel();
    let r = long.await.unwrap();
    let lag = fired.elapsed();
    assert_eq!(r, Err(BackendError::Cancelled { confirmed: true }));
    // Within a few tokens at the speed this machine decodes now (measured by the second
    // call, which ran beside the long one), not a fixed wall time: a loaded machine decodes
    // slowly.
    let tps = out.tokens_per_second.expect("a decode speed");
    let bound = Duration::from_secs_f64(4.0 / tps) + Duration::from_millis(250);
    assert!(
        lag <= bound,
        "stopped {lag:?} after the cancel, at {tps:.1} tok/s"
    );
}
