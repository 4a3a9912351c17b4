//! PostgreSQL goes away mid-run and comes back (`pg_ctl stop -m immediate`, then start): the
//! worker pauses intake, retries its writes, acks nothing whose outcome is not durable, and
//! resumes by itself. The database is a private cluster this test creates in a temporary
//! directory on its own port (initdb + pg_ctl as user postgres), never the shared one.

mod common;

use common::*;
use lastcall_worker::WorkerStats;
use lastcall_worker::clock::now_ms;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

const PG_BIN: &str = "/usr/lib/postgresql/15/bin";

/// A throwaway PostgreSQL cluster; stopped and removed on drop.
struct PrivatePg {
    dir: PathBuf,
    port: u16,
}

fn as_postgres(args: &[&str]) -> std::process::Output {
    Command::new("runuser")
        .args(["-u", "postgres", "--"])
        .args(args)
        .output()
        .expect("runuser (the test runs as root; PostgreSQL refuses to run as root)")
}

impl PrivatePg {
    fn start() -> Self {
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap()
            .port();
        let dir = std::env::temp_dir().join(format!("lastcall-pg-{}-{port}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        Command::new("chown")
            .args(["postgres:postgres", dir.to_str().unwrap()])
            .status()
            .unwrap();
        let data = dir.join("data");
        let out = as_postgres(&[
            &format!("{PG_BIN}/initdb"),
            "-D",
            data.to_str().unwrap(),
            "-U",
            "postgres",
            "--auth=trust",
            "--no-sync",
        ]);
        assert!(
            out.status.success(),
            "initdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        let pg = Self { dir, port };
        pg.ctl_start();
        let out = as_postgres(&[
            &format!("{PG_BIN}/createdb"),
            "-h",
            "127.0.0.1",
            "-p",
            &port.to_string(),
            "-U",
            "postgres",
            "lastcall",
        ]);
        assert!(
            out.status.success(),
            "createdb: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        pg
    }

    fn data(&self) -> PathBuf {
        self.dir.join("data")
    }

    fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/lastcall", self.port)
    }

    fn ctl_start(&self) {
        let opts = format!(
            "-p {} -k {} -c listen_addresses=127.0.0.1 -c fsync=off",
            self.port,
            self.dir.display()
        );
        let log = self.dir.join("pg.log");
        let out = as_postgres(&[
            &format!("{PG_BIN}/pg_ctl"),
            "-D",
            self.data().to_str().unwrap(),
            "-o",
            &opts,
            "-l",
            log.to_str().unwrap(),
            "-w",
            "start",
        ]);
        assert!(
            out.status.success(),
            "pg_ctl start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    fn stop_immediate(&self) {
        let _ = as_postgres(&[
            &format!("{PG_BIN}/pg_ctl"),
            "-D",
            self.data().to_str().unwrap(),
            "-m",
            "immediate",
            "-w",
            "stop",
        ]);
    }
}

impl Drop for PrivatePg {
    fn drop(&mut self) {
        self.stop_immediate();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

fn is_up(dir: &Path, port: u16) -> bool {
    Command::new(format!("{PG_BIN}/pg_isready"))
        .args(["-h", "127.0.0.1", "-p", &port.to_string(), "-q"])
        .current_dir(dir)
        .status()
        .is_ok_and(|s| s.success())
}

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
    assert!(!is_up(&pg.dir, pg.port));
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
