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
use std::process::{Command, Stdio};
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

/// A `lastcall worker` started while its PostgreSQL is down waits for it — as it waits for
/// a broker that is down at startup — and serves once the database is up, instead of
/// exiting (a host that boots the worker before the database, a database restarting).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_worker_started_while_postgres_is_down_waits_for_it() {
    let pg = PrivatePg::start();
    let env = Env::with_store_url("pg-late", &pg.url()).await;
    pg.stop_immediate();
    assert!(!pg.is_up());
    let log = env.dir.join("worker.log");
    let mut worker = env
        .command()
        .args(["worker", "--backend", "sim", "--slots", "1"])
        .args(["--sim-latency-ms", "50", "--retry-delays-ms", "1000,5000"])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .expect("spawn the lastcall binary");
    let said = || std::fs::read_to_string(&log).unwrap_or_default();
    let until = Instant::now() + Duration::from_secs(30);
    while !said().contains("is not reachable") {
        assert!(
            worker.try_wait().unwrap().is_none(),
            "the worker exited instead of waiting for the database: {}",
            said()
        );
        assert!(Instant::now() < until, "no word of the wait: {}", said());
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        said().contains("waiting for it"),
        "it says that it waits: {}",
        said()
    );
    pg.ctl_start();
    let s = env.submitter(100, false).await;
    s.submit(&job("late-db", 60_000), now_ms()).await.unwrap();
    // A fresh pool: the test's own connections died with the database.
    let ledger = lastcall_store::Ledger::connect(&pg.url()).await.unwrap();
    let until = Instant::now() + Duration::from_secs(60);
    let r = loop {
        match ledger.get("late-db").await.unwrap() {
            Some(r) if !matches!(r.state.as_str(), "accepted" | "running") => break r,
            _ => {}
        }
        assert!(
            worker.try_wait().unwrap().is_none(),
            "the worker exited: {}",
            said()
        );
        assert!(Instant::now() < until, "late-db never ended: {}", said());
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    ledger.close().await;
    assert_eq!(r.state, "completed", "{r:?}");
    assert!(said().contains("the ledger is reachable"), "{}", said());
    let _ = Command::new("kill")
        .args(["-INT", &worker.id().to_string()])
        .status();
    let until = Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = worker.try_wait().unwrap() {
            break status;
        }
        assert!(Instant::now() < until, "the worker did not stop on SIGINT");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(status.success(), "{status}: {}", said());
    env.cleanup().await;
}
