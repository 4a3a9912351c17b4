//! Tenant isolation whatever the tenants are called and however the producer routes
//! (issue #48): a light tenant beside a 10× flood gets its jobs done on time when the two
//! names hash to the same lane, and when every job is published to `{prefix}.jobs` by its
//! kind (one broker FIFO for all tenants). Default worker settings (2 slots, the default
//! window); real RabbitMQ and ledger.

use crate::common;

use common::*;
use lastcall_broker::{PublishProps, Publisher};
use lastcall_core::{Priority, Tenant};
use lastcall_worker::clock::now_ms;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How the producer routes every job (both tenants').
#[derive(Debug, Clone, Copy)]
enum Route {
    /// The producer computes the lane (docs/wire-format.md §1).
    Lanes,
    /// The producer publishes to the jobs exchange by kind, without computing lanes.
    ByKind,
}

const FLOOD: &str = "flood";
/// A tenant whose lane is the flood's.
fn colliding_light() -> String {
    let lane = lastcall_core::lane_of(FLOOD, Priority::Standard);
    (0..)
        .map(|i| format!("light-{i}"))
        .find(|t| lastcall_core::lane_of(t, Priority::Standard) == lane)
        .unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_in_the_floods_lane_finishes_on_time() {
    let light = colliding_light();
    assert_eq!(
        lastcall_core::lane_of(FLOOD, Priority::Standard),
        lastcall_core::lane_of(&light, Priority::Standard)
    );
    flood_and_light("isolation-lane", &light, Route::Lanes, 1).await;
}

/// The same across two workers on one PostgreSQL ledger, each consuming every queue.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_in_the_floods_lane_finishes_on_time_across_two_workers() {
    flood_and_light("isolation-lane-2", &colliding_light(), Route::Lanes, 2).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenant_finishes_on_time_when_every_job_is_published_by_kind() {
    flood_and_light("isolation-kind", "light", Route::ByKind, 1).await;
}

/// Call times that grow with the prompt: the flood's prompts are short (100 ms calls), the
/// light tenant's are 600 tokens (300 ms), larger than any call the worker completed
/// before them. Their estimate is then the through-origin extrapolation from the short
/// calls (seconds, past the budget), and under the flood no slot is free at receipt.
/// They wait judged without the estimate and the first runs as a probe at its slot
/// (refused at receipt instead, none would ever run or be learned: 0 of 11).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_light_tenants_longer_prompts_in_the_floods_lane_are_learned_and_finish_on_time() {
    let prompt = "x".repeat(2_400);
    let payload = serde_json::json!({
        "messages": [{"role": "user", "content": prompt}],
        "sim_latency_ms": 300,
    });
    flood_and_light_with(
        "isolation-long",
        &colliding_light(),
        Route::Lanes,
        1,
        Some(payload),
    )
    .await;
}

/// Worker defaults: 2 slots each; calls of 100 ms × the number of workers, so that the
/// workers together do 20 jobs/s whatever their number (one test process publishes for
/// them all). `flood` sends 10× that for 6 s, `light` 2 jobs/s, 2 s budgets both. The light tenant must get ≥ 95% of its
/// jobs done on time, and all jobs together ≥ 40% of the bound (what 2 slots can complete
/// in the flood's span plus one budget; BENCHMARKS.md quotes the measured figure).
async fn flood_and_light(name: &str, light: &str, route: Route, workers: usize) {
    flood_and_light_with(name, light, route, workers, None).await;
}

/// [`flood_and_light`], the light tenant's jobs with `light_payload` when given.
async fn flood_and_light_with(
    name: &str,
    light: &str,
    route: Route,
    workers: usize,
    light_payload: Option<serde_json::Value>,
) {
    const BUDGET_MS: u64 = 2_000;
    const SPAN_MS: u64 = 6_000;
    const SLOTS: usize = 2;
    let call_ms = 100 * workers as u64;
    let env = if workers == 1 {
        Env::sqlite(name).await
    } else {
        Env::postgres(name).await
    };
    let mut ws = Vec::new();
    for i in 0..workers {
        let mut cfg = lastcall_worker::WorkerConfig::new(&env.prefix, SLOTS);
        cfg.topology = env.topo.clone();
        cfg.name = format!("{name}-worker-{i}");
        ws.push(env.start_worker(cfg, sim(call_ms), system_clock()).await);
    }
    let s = Arc::new(env.submitter(100, false).await);
    let publisher = Arc::new(
        Publisher::new(&env.broker, Duration::from_secs(5))
            .await
            .unwrap(),
    );
    let names = env.topo.names.clone();
    let submit = {
        let (s, publisher, names) = (s.clone(), publisher.clone(), names.clone());
        move |id: String, tenant: String, payload: Option<serde_json::Value>| {
            let (s, publisher, names) = (s.clone(), publisher.clone(), names.clone());
            async move {
                let new_job = match payload {
                    Some(p) => job_with(&id, BUDGET_MS, p),
                    None => job(&id, BUDGET_MS),
                };
                let e = s
                    .envelope(&new_job, now_ms())
                    .unwrap()
                    .with_tenant(Tenant::parse(&tenant).unwrap());
                match route {
                    Route::Lanes => {
                        s.submit_envelope(&e, None, now_ms()).await.unwrap();
                    }
                    Route::ByKind => {
                        let props = PublishProps {
                            job_id: id.clone(),
                            ttl_ms: e.deadline().broker_ttl_ms(now_ms()),
                            attempt: 0,
                            timestamp_s: (now_ms() / 1000) as u64,
                            signature: None,
                        };
                        publisher
                            .publish(
                                &names.jobs_exchange,
                                e.kind().as_str(),
                                &e.to_bytes(),
                                &props,
                            )
                            .await
                            .unwrap();
                    }
                };
            }
        }
    };
    let t0 = Instant::now();
    let mut flooders = Vec::new();
    let per_task = (SPAN_MS / 20) as usize;
    for t in 0..4 {
        let submit = submit.clone();
        flooders.push(tokio::spawn(async move {
            let mut tick = tokio::time::interval(Duration::from_millis(20));
            for i in 0..per_task {
                tick.tick().await;
                submit(format!("flood-{t}-{i}"), FLOOD.to_owned(), None).await;
            }
        }));
    }
    let mut light_ids = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(500));
    tick.tick().await;
    for i in 0..(SPAN_MS / 500 - 1) {
        tick.tick().await;
        let id = format!("light-job-{i}");
        submit(id.clone(), light.to_owned(), light_payload.clone()).await;
        light_ids.push(id);
    }
    for f in flooders {
        f.await.unwrap();
    }
    let span_ms = t0.elapsed().as_millis() as u64;
    let flood_ids: Vec<String> = (0..4)
        .flat_map(|t| (0..per_task).map(move |i| format!("flood-{t}-{i}")))
        .collect();
    // Every job ends: run by the worker, refused at receipt, or expired in the broker and
    // recorded by the dead-letter processor.
    let all: Vec<String> = light_ids.iter().chain(&flood_ids).cloned().collect();
    env.wait_terminal_draining(&all, Duration::from_secs(60))
        .await;
    let ledger = &env.ledger;
    let on_time = async |ids: &[String]| {
        let mut n = 0;
        for id in ids {
            let r = ledger.get(id).await.unwrap().unwrap();
            if r.state == "completed" && r.finished_at_ms.unwrap() <= r.expires_at_ms.unwrap() {
                n += 1;
            }
        }
        n
    };
    let mut outcomes = std::collections::BTreeMap::new();
    for id in &all {
        let r = ledger.get(id).await.unwrap().unwrap();
        *outcomes
            .entry(format!("{}/{}", r.state, r.reason.unwrap_or_default()))
            .or_insert(0) += 1;
    }
    eprintln!("outcomes: {outcomes:?}");
    for id in &light_ids {
        let r = ledger.get(id).await.unwrap().unwrap();
        eprintln!(
            "{id}: {} {} started {:?} finished {:?} expires {:?}",
            r.state,
            r.reason.unwrap_or_default(),
            r.started_at_ms,
            r.finished_at_ms,
            r.expires_at_ms
        );
    }
    let light_on_time = on_time(&light_ids).await;
    let flood_on_time = on_time(&flood_ids).await;
    let bound = ((span_ms + BUDGET_MS) * (SLOTS * workers) as u64 / call_ms).min(all.len() as u64);
    let total = (light_on_time + flood_on_time) as f64 / bound as f64;
    eprintln!(
        "{route:?}: light {light_on_time}/{} on time; all {}/{} = {total:.3} of the bound {bound}",
        light_ids.len(),
        light_on_time + flood_on_time,
        all.len()
    );
    assert!(
        light_on_time as f64 >= 0.95 * light_ids.len() as f64,
        "light tenant: {light_on_time} of {} on time",
        light_ids.len()
    );
    // How much of the bound is done on time is a speed: BENCHMARKS §14 measures it with
    // `bench goodput` (90.9% in the shape). Here only a floor against a stalled
    // worker (0.86–0.89 alone, 0.54–0.61 beside the rest of the suite on 2 cores, 0.39
    // beside it and a llama.cpp build).
    assert!(total >= 0.25, "all jobs: {total:.3} of the bound on time");
    // The flood did overload the workers (most of it refused without a call), and no call
    // started after its job's deadline.
    let refused = outcomes
        .iter()
        .filter(|(k, _)| k.starts_with("expired_not_started/"))
        .map(|(_, n)| *n)
        .sum::<usize>();
    assert!(
        refused * 2 > flood_ids.len(),
        "the flood did not overload the workers: {outcomes:?}"
    );
    for id in &all {
        let r = ledger.get(id).await.unwrap().unwrap();
        if let (Some(start), Some(exp)) = (r.started_at_ms, r.expires_at_ms) {
            assert!(start <= exp, "{id} started after its deadline: {r:?}");
        }
    }
    for w in ws {
        w.stop().await;
    }
    env.cleanup().await;
}

/// Workers of unequal speed on one queue: calls of 100 ms on one, 400 ms on the other, 2
/// slots each, jobs at 0.8× their joint capacity (20 of 25 jobs/s) for 8 s, 2 s budgets,
/// on one PostgreSQL ledger. The broker deals the deliveries round robin, and the slow
/// worker's window holds more than it can start in time. It hands those back, once,
/// when the fast one's lease offers a shorter wait (the simulator: 97.2% on time;
/// refusing them at receipt while the fast one idles: 74.7%).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_worker_hands_back_what_a_faster_peer_can_start_in_time() {
    const BUDGET_MS: u64 = 2_000;
    const JOBS: usize = 160;
    let env = Env::postgres("unequal-workers").await;
    let mut ws = Vec::new();
    for (i, call_ms) in [(0, 100), (1, 400)] {
        let mut cfg = lastcall_worker::WorkerConfig::new(&env.prefix, 2);
        cfg.topology = env.topo.clone();
        cfg.name = format!("unequal-{i}");
        ws.push(env.start_worker(cfg, sim(call_ms), system_clock()).await);
    }
    // Each worker has read the other's lease, with its live numbers.
    let until = Instant::now() + Duration::from_secs(30);
    while !ws.iter().enumerate().all(|(i, w)| {
        let peers = w.stats.peers.lock().unwrap();
        let other = format!("unequal-{}", 1 - i);
        peers.iter().any(|l| l.worker == other && l.live.is_some())
    }) {
        assert!(
            Instant::now() < until,
            "the workers never saw each other's lease"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let s = env.submitter(100, false).await;
    let mut ids = Vec::new();
    let mut tick = tokio::time::interval(Duration::from_millis(50));
    for i in 0..JOBS {
        tick.tick().await;
        let id = format!("unequal-job-{i}");
        s.submit(&job(&id, BUDGET_MS), now_ms()).await.unwrap();
        ids.push(id);
    }
    env.wait_terminal_draining(&ids, Duration::from_secs(60))
        .await;
    let mut on_time = 0;
    let mut by_fast = 0;
    let mut outcomes = std::collections::BTreeMap::new();
    for id in &ids {
        let r = env.ledger.get(id).await.unwrap().unwrap();
        if let (Some(start), Some(exp)) = (r.started_at_ms, r.expires_at_ms) {
            assert!(start <= exp, "{id} started after its deadline: {r:?}");
        }
        if r.state == "completed" && r.finished_at_ms.unwrap() <= r.expires_at_ms.unwrap() {
            on_time += 1;
            by_fast += usize::from(r.worker.as_deref() == Some("unequal-0"));
        }
        *outcomes
            .entry(format!("{}/{}", r.state, r.reason.unwrap_or_default()))
            .or_insert(0) += 1;
    }
    let passed_on: u64 = ws
        .iter()
        .map(|w| lastcall_worker::WorkerStats::get(&w.stats.passed_on))
        .sum();
    eprintln!(
        "unequal workers: {on_time}/{JOBS} on time ({by_fast} by the fast one), {passed_on} handed back; {outcomes:?}"
    );
    assert!(passed_on > 0, "nothing was handed back: {outcomes:?}");
    // The broker deals each worker about half the deliveries: the fast one finishes more
    // than its half only with what the slow one handed back.
    assert!(
        by_fast > JOBS / 2 + JOBS / 16,
        "the fast worker finished {by_fast} of {JOBS}: {outcomes:?}"
    );
    // How many make it is a speed (measured: 154 of 160, and 126 without the hand-back;
    // BENCHMARKS.md); here only a floor against a stalled worker.
    assert!(
        on_time as f64 >= 0.75 * JOBS as f64,
        "{on_time} of {JOBS} on time: {outcomes:?}"
    );
    for w in ws {
        w.stop().await;
    }
    env.cleanup().await;
}
