//! A SQLite ledger on a disk that fills up (#12.5): a real tmpfs of a few MiB, filled to
//! its last byte while jobs arrive. The worker must stop taking work, call no model for a
//! job whose start it cannot record, ack nothing, and carry on by itself once space is
//! back: every job completed exactly once, one model call each.
//!
//! Mounting a tmpfs needs root (as on CI here); without it the test fails and says so.

use crate::common;

use common::*;
use lastcall_worker::clock::now_ms;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;
use std::time::{Duration, Instant};

/// A private tmpfs, unmounted on drop (even when the test fails).
struct Tmpfs(PathBuf);

impl Tmpfs {
    fn mount(size: &str) -> Self {
        let dir = std::env::temp_dir().join(unique("sqlite-full-fs"));
        std::fs::create_dir_all(&dir).unwrap();
        let out = std::process::Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&dir)
            .output()
            .expect("run mount");
        assert!(
            out.status.success(),
            "mounting a {size} tmpfs at {} failed (this test needs root): {}",
            dir.display(),
            String::from_utf8_lossy(&out.stderr)
        );
        Self(dir)
    }
}

impl Drop for Tmpfs {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount")
            .arg("-l")
            .arg(&self.0)
            .status();
        let _ = std::fs::remove_dir(&self.0);
    }
}

/// Write `path` until the filesystem has no byte left; returns the bytes written.
fn fill(path: &Path) -> u64 {
    let mut f = std::fs::File::create(path).unwrap();
    let chunk = vec![0xa5u8; 4096];
    let mut n = 0u64;
    loop {
        match f.write(&chunk) {
            Ok(0) => break,
            Ok(k) => n += k as u64,
            Err(e) if e.raw_os_error() == Some(libc_enospc()) => break,
            Err(e) => panic!("filling {}: {e}", path.display()),
        }
    }
    let _ = f.sync_all();
    n
}

/// ENOSPC on Linux.
fn libc_enospc() -> i32 {
    28
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_disk_pauses_the_worker_and_it_resumes_by_itself_when_space_returns() {
    let fs = Tmpfs::mount("4m");
    let env = Env::with_store_url(
        "sqlite-full",
        &format!("sqlite://{}", fs.0.join("ledger.db").display()),
    )
    .await;
    let sim = sim(20);
    let w = env
        .start_worker(env.worker_config(2, 4), sim.clone(), system_clock())
        .await;
    // The producer records nothing here: the ledger on the full disk is the worker's.
    let s = env.submitter(0, false).await;
    s.submit(&job("warm", 120_000), now_ms()).await.unwrap();
    env.wait_terminal(&["warm".into()], Duration::from_secs(30))
        .await;

    let filler = fs.0.join("filler");
    let filled = fill(&filler);
    println!("disk full after {filled} bytes of filler");
    // SQLite goes on writing into space it already holds (its write-ahead log is reused
    // from the start after a checkpoint), so the disk is full for the ledger only once its
    // files must grow: keep submitting until the worker sees a write fail.
    let mut ids: Vec<String> = Vec::new();
    let until = Instant::now() + Duration::from_secs(120);
    while w.stats.ledger_healthy.load(Relaxed) {
        assert!(
            Instant::now() < until && ids.len() < 20_000,
            "the ledger never failed on a full disk ({} jobs)",
            ids.len()
        );
        for _ in 0..20 {
            let id = format!("full-{}", ids.len());
            s.submit(&job(&id, 300_000), now_ms()).await.unwrap();
            ids.push(id);
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    println!(
        "the ledger failed after {} jobs on the full disk",
        ids.len()
    );
    // While the disk is full, no model call runs for a job whose start row could not be
    // written (the start is durable before the call).
    let mut unrecorded = 0;
    for id in &ids {
        if env.ledger.get(id).await.unwrap().is_none() {
            unrecorded += 1;
            assert_eq!(sim.calls_for(id), 0, "{id}: a call without its start row");
        }
    }
    println!("{unrecorded} jobs without a record while the disk was full");

    std::fs::remove_file(&filler).unwrap();
    let recs = env.wait_terminal(&ids, Duration::from_secs(90)).await;
    for r in &recs {
        assert_eq!(r.state, "completed", "{r:?}");
        assert_eq!(sim.calls_for(&r.job_id), 1, "{}: one model call", r.job_id);
    }
    assert!(w.stats.ledger_healthy.load(Relaxed), "healthy again");
    w.stop().await;
    // Nothing left in the queue: every delivery was acked once its outcome was durable.
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await,
        0,
        "no message left behind"
    );
    env.cleanup().await;
    drop(fs);
}
