//! The autoscaling gauges of `serve`'s `/metrics` against a real worker, RabbitMQ and the
//! ledger: the slots the last minute's arrivals need and the share the fleet's slots can
//! serve, each checked against the ledger's own records and the worker's lease.

use crate::common;

use common::*;
use lastcall_http::MetricsSource;
use lastcall_http::metrics::sample_value;
use lastcall_worker::clock::now_ms;
use std::time::{Duration, Instant};

/// Renders `/metrics` until the fleet's slots are there (the worker's lease is renewed
/// every 2 s), then its three gauges.
async fn gauges(source: &MetricsSource) -> (f64, f64, f64) {
    let end = Instant::now() + Duration::from_secs(20);
    loop {
        let text = source.render().await;
        let get = |s: &str| sample_value(&text, s);
        if let (Some(needed), Some(slots), Some(share)) = (
            get("lastcall_autoscale_slots_needed"),
            get("lastcall_autoscale_slots"),
            get("lastcall_autoscale_predicted_on_time_share"),
        ) {
            return (needed, slots, share);
        }
        assert!(Instant::now() < end, "no autoscaling gauges:\n{text}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// The slots needed by the ledger's own records of `ids`: arrivals per second over the
/// minute × the mean model time of the completed ones.
async fn needed_by_the_ledger(env: &Env, ids: &[String]) -> f64 {
    let (mut completed, mut ms) = (0u64, 0i64);
    for id in ids {
        let r = env.ledger.get(id).await.unwrap().unwrap();
        if r.state == "completed" {
            completed += 1;
            ms += r.model_ms - r.wasted_model_ms;
        }
    }
    assert!(completed > 0);
    ids.len() as f64 / 60.0 * (ms as f64 / completed as f64) / 1000.0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_gauges_say_what_the_arrivals_need_and_what_the_fleet_can_serve() {
    let env = Env::sqlite("autoscale").await;
    let sub = env.submitter(100, true).await;
    let worker = env
        .start_worker(env.worker_config(1, 512), sim(250), system_clock())
        .await;
    let source = MetricsSource::default()
        .with_ledger(env.ledger.clone())
        .with_clock(system_clock());

    // A light minute: 8 jobs of 250 ms, all served by the one slot.
    let light: Vec<String> = (0..8).map(|i| format!("light-{i}")).collect();
    for id in &light {
        sub.submit(&job(id, 60_000), now_ms()).await.unwrap();
    }
    env.wait_terminal(&light, Duration::from_secs(30)).await;
    let (needed, slots, share) = gauges(&source).await;
    let expected = needed_by_the_ledger(&env, &light).await;
    assert_eq!(slots, 1.0, "the worker's one slot, from its lease");
    assert!(
        (needed - expected).abs() <= 0.02 * expected,
        "slots needed {needed}, by the ledger {expected}"
    );
    assert_eq!(share, 1.0, "{needed} slots needed of 1");

    // A flood: 400 jobs of 250 ms in a few seconds, more than one slot serves in the minute
    // (240): the gauges must say so, and the ledger agrees that most were not served.
    let flood: Vec<String> = (0..400).map(|i| format!("flood-{i}")).collect();
    for id in &flood {
        sub.submit(&job(id, 1_000), now_ms()).await.unwrap();
    }
    env.wait_terminal(&flood, Duration::from_secs(60)).await;
    let all: Vec<String> = light.iter().chain(&flood).cloned().collect();
    let (needed, slots, share) = gauges(&source).await;
    let expected = needed_by_the_ledger(&env, &all).await;
    assert!(
        (needed - expected).abs() <= 0.02 * expected,
        "slots needed {needed}, by the ledger {expected}"
    );
    assert!(
        needed > 1.0,
        "400 jobs of 250 ms in a minute need more than 1 slot: {needed}"
    );
    assert_eq!(slots, 1.0);
    assert!(
        (share - 1.0 / needed).abs() < 1e-9,
        "share {share} = slots ÷ needed {needed}"
    );
    let mut served = 0;
    for id in &all {
        served += usize::from(env.ledger.get(id).await.unwrap().unwrap().state == "completed");
    }
    assert!(
        served < all.len() / 2,
        "{served} of {} served; predicted share {share}",
        all.len()
    );
    worker.stop().await;
    env.cleanup().await;
}
