//! PostgreSQL goes away mid-run and comes back (`pg_ctl stop -m immediate`, then start): the
//! worker pauses intake, retries its writes, acks nothing whose outcome is not durable, and
//! resumes by itself. The database is a private cluster this test creates in a temporary
//! directory on its own port (`common::private_pg`: initdb + pg_ctl as user postgres), never
//! the shared one.

mod common;

use common::private_pg::PrivatePg;
use common::*;
use lastcall_worker::WorkerStats;
use lastcall_worker::clock::now_ms;
use std::time::{Duration, Instant};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_rides_through_a_postgres_restart() {
    let pg = PrivatePg::start();
    let env = Env::with_store_url("pg-outage", &pg.url()).await;
    let sim = sim(200);
    let w = env
        .start_worker(env.worker_config(2, 8), sim.clone(), system_clock())
        .await;
    let s = env.submitter(100, false).await;
    let ids: Vec<String> = (0..20).map(|i| format!("pgo-{i}")).collect();
    for id in &ids[..10] {
        s.submit(&job(id, 120_000), now_ms()).await.unwrap();
    }
    // Some calls done, then the database dies (no clean shutdown) for a few seconds while
    // more jobs arrive.
    let until = Instant::now() + Duration::from_secs(20);
    while WorkerStats::get(&w.stats.settled) < 2 {
        assert!(Instant::now() < until, "no job settled before the outage");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    pg.stop_immediate();
    assert!(!pg.is_up());
    for id in &ids[10..] {
        s.submit(&job(id, 120_000), now_ms()).await.unwrap();
    }
    // The worker notices (its writes fail and are retried) and stops taking work.
    let until = Instant::now() + Duration::from_secs(20);
    while WorkerStats::get(&w.stats.store_retries) == 0 {
        assert!(Instant::now() < until, "the worker never retried a write");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let settled_during = WorkerStats::get(&w.stats.settled);
    pg.ctl_start();

    // Every job ends with exactly one outcome and one model call; nothing is left in the
    // queue, so every delivery was acked — after its write, or it would have been redelivered
    // and run again.
    let recs = env.wait_terminal(&ids, Duration::from_secs(60)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
        assert_eq!(r.backend_calls, 1, "{r:?}");
        assert_eq!(sim.calls_for(&r.job_id), 1, "{}", r.job_id);
    }
    assert!(WorkerStats::get(&w.stats.settled) > settled_during);
    let until = Instant::now() + Duration::from_secs(20);
    while env.ready(&env.topo.names.work_queue).await != 0 {
        assert!(Instant::now() < until, "jobs left in the queue");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_eq!(WorkerStats::get(&w.stats.task_panics), 0);
    w.stop().await;
    env.cleanup().await;
}
