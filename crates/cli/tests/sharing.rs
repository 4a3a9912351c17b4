//! Sharing capacity (issue #33) through a real worker, RabbitMQ and ledger: the buffer
//! serves a higher priority tier first, then the tenant that has had the least model time
//! for its weight, then the earliest deadline.

mod common;

use common::*;
use lastcall_core::{Priority, Tenant};
use lastcall_worker::clock::now_ms;
use std::time::{Duration, Instant};

/// One slot, held by `flood`'s first job. Then, in this order: three more of `flood`'s,
/// one of `light`'s with the latest deadline of the standard tier, a `batch` job with the
/// earliest deadline of all, and a `critical` one of `flood`'s. They start: critical, the
/// light tenant's, flood's three by deadline, batch last.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tiers_first_then_the_tenant_served_least_then_the_deadline() {
    let env = Env::sqlite("sharing-order").await;
    let w = env
        .start_worker(env.worker_config(1, 16), sim(20), system_clock())
        .await;
    let s = env.submitter(100, true).await;
    let submit = async |id: &str, budget_ms: u64, tenant: &str, p: Priority, latency: u64| {
        let job = job_with(
            id,
            budget_ms,
            serde_json::json!({"sim_latency_ms": latency}),
        );
        let e = s
            .envelope(&job, now_ms())
            .unwrap()
            .with_tenant(Tenant::parse(tenant).unwrap())
            .with_priority(p);
        s.submit_envelope(&e, None, now_ms()).await.unwrap();
    };
    submit("hold", 60_000, "flood", Priority::Standard, 3_000).await;
    let t0 = Instant::now();
    while env.ledger.get("hold").await.unwrap().map(|r| r.state) != Some("running".into()) {
        assert!(t0.elapsed() < Duration::from_secs(20), "hold never started");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    submit("flood-1", 40_000, "flood", Priority::Standard, 20).await;
    submit("flood-2", 41_000, "flood", Priority::Standard, 20).await;
    submit("flood-3", 42_000, "flood", Priority::Standard, 20).await;
    submit("light-1", 50_000, "light", Priority::Standard, 20).await;
    submit("batch-1", 30_000, "light", Priority::Batch, 20).await;
    submit("page-1", 55_000, "flood", Priority::Critical, 20).await;
    // All six wait behind the held slot before it is released.
    let t0 = Instant::now();
    while w.stats.waiting.load(std::sync::atomic::Ordering::Relaxed) < 6 {
        let hold = env.ledger.get("hold").await.unwrap().unwrap().state;
        assert_eq!(
            hold, "running",
            "hold ended before the six waited (machine too slow for this check)"
        );
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the six never waited"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    let ids: Vec<String> = [
        "hold", "flood-1", "flood-2", "flood-3", "light-1", "batch-1", "page-1",
    ]
    .map(String::from)
    .to_vec();
    let mut recs = env.wait_terminal(&ids, Duration::from_secs(30)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
    }
    recs.sort_by_key(|r| r.started_at_ms.unwrap());
    let order: Vec<&str> = recs.iter().map(|r| r.job_id.as_str()).collect();
    assert_eq!(
        order,
        [
            "hold", "page-1", "light-1", "flood-1", "flood-2", "flood-3", "batch-1"
        ]
    );
    w.stop().await;
    env.cleanup().await;
}
