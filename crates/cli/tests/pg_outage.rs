//! PostgreSQL goes away mid-run and comes back (`pg_ctl stop -m immediate`, then start): the
//! worker pauses intake, retries its writes, acks nothing whose outcome is not durable, and
//! resumes by itself. The database is a private cluster this test creates in a temporary
//! directory on its own port (`common::private_pg`: initdb + pg_ctl as user postgres), never
//! the shared one.

use crate::common;

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
    // Its metrics address answers meanwhile: alive, not ready, waiting for the ledger.
    let metrics = format!("127.0.0.1:{}", common::private_rabbit::free_port());
    let readyz = format!("http://{metrics}/readyz");
    let args = ["worker", "--backend", "sim", "--slots", "1"];
    let args = [&args[..], &["--metrics-addr", &metrics]].concat();
    let mut late = Late::start_checked(&env, &pg, &args, |late| {
        let (code, body) = common::http::curl(&[&readyz]);
        assert_eq!(code, 503, "{body}: {}", late.said());
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["down"], serde_json::json!(["ledger"]), "{v}");
        assert_eq!(
            common::http::curl(&[&format!("http://{metrics}/healthz")]).0,
            200
        );
    })
    .await;
    let s = env.submitter(100, false).await;
    s.submit(&job("late-db", 60_000), now_ms()).await.unwrap();
    assert_eq!(late.outcome(&pg, "late-db").await.state, "completed");
    let until = Instant::now() + Duration::from_secs(30);
    while common::http::curl(&[&readyz]).0 != 200 {
        assert!(Instant::now() < until, "the worker did not report ready");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    late.stop();
    env.cleanup().await;
}

/// The same for `lastcall dlq`: started while its PostgreSQL is down, it waits, then
/// records the dead letter of a job that expired in the broker meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_letter_processor_started_while_postgres_is_down_waits_for_it() {
    let pg = PrivatePg::start();
    let env = Env::with_store_url("pg-late-dlq", &pg.url()).await;
    // No worker: the job's broker TTL runs out in the queue and it is dead-lettered.
    let s = env.submitter(100, false).await;
    s.submit(&job("late-dl", 300), now_ms()).await.unwrap();
    let mut late = Late::start(&env, &pg, &["dlq"]).await;
    let r = late.outcome(&pg, "late-dl").await;
    assert_eq!(r.state, "expired_before_receive", "{r:?}");
    assert_eq!(r.reason.as_deref(), Some("broker_ttl_expired"), "{r:?}");
    late.stop();
    env.cleanup().await;
}

const TOKEN: &str = "pg-outage-serve-token-0123456789";

/// `lastcall serve` started while its PostgreSQL is down: it listens at once and waits
/// for the database. Meanwhile `/readyz` is 503 naming the ledger (the broker is reached)
/// and a job is answered 503 `starting`; once the database is up, serve becomes ready by
/// itself and records the jobs it takes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn serve_started_while_postgres_is_down_waits_for_it_and_says_so() {
    let pg = PrivatePg::start();
    let env = Env::with_store_url("pg-late-serve", &pg.url()).await;
    let port = common::private_rabbit::free_port();
    let base = format!("http://127.0.0.1:{port}");
    let addr = format!("127.0.0.1:{port}");
    let args = ["serve", "--addr", &addr, "--no-management"];
    let mut late = Late::start_checked(&env, &pg, &args, |late| {
        let (code, body) = common::http::curl(&[&format!("{base}/readyz")]);
        assert_eq!(code, 503, "{body}: {}", late.said());
        let v: serde_json::Value = serde_json::from_str(&body).unwrap();
        assert_eq!(v["down"], serde_json::json!(["ledger"]), "{v}");
        assert_eq!(v["checks"]["broker"], true, "{v}");
        assert_eq!(common::http::curl(&[&format!("{base}/healthz")]).0, 200);
        let (code, body) = common::http::post_job(&base, TOKEN, "too-early", 60_000);
        assert_eq!(code, 503, "{body}");
        assert!(body.contains(r#""error":"starting""#), "{body}");
        assert!(body.contains("waiting for the ledger"), "{body}");
        late.assert_running();
    })
    .await;
    let until = Instant::now() + Duration::from_secs(60);
    while common::http::curl(&[&format!("{base}/readyz")]).0 != 200 {
        late.assert_running();
        assert!(
            Instant::now() < until,
            "serve did not become ready: {}",
            late.said()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let (code, body) = common::http::post_job(&base, TOKEN, "on-time", 60_000);
    assert_eq!(code, 202, "{body}");
    let ledger = lastcall_store::Ledger::connect(&pg.url()).await.unwrap();
    let rec = ledger.get("on-time").await.unwrap().expect("recorded");
    assert_eq!(rec.state, "accepted");
    assert!(ledger.get("too-early").await.unwrap().is_none());
    ledger.close().await;
    late.stop();
    env.cleanup().await;
}

/// A `lastcall` process started while the private PostgreSQL is down; the database is
/// started once the process has said that it waits for it. Killed on drop, so that a
/// failed test leaves no process behind.
struct Late {
    child: std::process::Child,
    log: std::path::PathBuf,
}

impl Drop for Late {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Late {
    async fn start(env: &Env, pg: &PrivatePg, args: &[&str]) -> Late {
        Self::start_checked(env, pg, args, |_| {}).await
    }

    /// [`start`](Self::start), running `while_down` once the process waits, before the
    /// database starts.
    async fn start_checked(
        env: &Env,
        pg: &PrivatePg,
        args: &[&str],
        while_down: impl FnOnce(&mut Late),
    ) -> Late {
        pg.stop_immediate();
        assert!(!pg.is_up());
        let log = env.dir.join(format!("{}.log", args[0]));
        let child = env
            .command()
            .args(args)
            .args(["--retry-delays-ms", "1000,5000"])
            .env("LASTCALL_HTTP_TOKEN", TOKEN)
            .stdout(Stdio::null())
            .stderr(std::fs::File::create(&log).unwrap())
            .spawn()
            .expect("spawn the lastcall binary");
        let mut late = Late { child, log };
        let until = Instant::now() + Duration::from_secs(30);
        while !late.said().contains("is not reachable") {
            late.assert_running();
            assert!(
                Instant::now() < until,
                "no word of the wait: {}",
                late.said()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        assert!(late.said().contains("waiting for it"), "{}", late.said());
        while_down(&mut late);
        pg.ctl_start();
        late
    }

    fn said(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn assert_running(&mut self) {
        assert!(
            self.child.try_wait().unwrap().is_none(),
            "the process exited instead of waiting for the database: {}",
            self.said()
        );
    }

    /// `id`'s terminal record, read through a fresh pool (the test's own connections died
    /// with the database), while the process keeps running.
    async fn outcome(&mut self, pg: &PrivatePg, id: &str) -> lastcall_store::JobRecord {
        let ledger = lastcall_store::Ledger::connect(&pg.url()).await.unwrap();
        let until = Instant::now() + Duration::from_secs(60);
        let r = loop {
            match ledger.get(id).await.unwrap() {
                Some(r) if !matches!(r.state.as_str(), "accepted" | "running") => break r,
                _ => {}
            }
            self.assert_running();
            assert!(Instant::now() < until, "{id} never ended: {}", self.said());
            tokio::time::sleep(Duration::from_millis(100)).await;
        };
        ledger.close().await;
        assert!(
            self.said().contains("the ledger is reachable"),
            "{}",
            self.said()
        );
        r
    }

    /// SIGINT, and a clean exit.
    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-INT", &self.child.id().to_string()])
            .status();
        let until = Instant::now() + Duration::from_secs(30);
        let status = loop {
            if let Some(status) = self.child.try_wait().unwrap() {
                break status;
            }
            assert!(Instant::now() < until, "no exit on SIGINT: {}", self.said());
            std::thread::sleep(Duration::from_millis(100));
        };
        assert!(status.success(), "{status}: {}", self.said());
    }
}
