//! The fault suite (#12): one test per scenario, each on services of its own (a private
//! RabbitMQ node or cluster, a private PostgreSQL cluster when the ledger is faulted; never
//! the shared broker or database), the real binaries (`lastcall serve --dlq` taking POSTs,
//! `lastcall worker --backend sim`), a steady load while one fault is injected, and one
//! accounting row per scenario computed from the ledger, the sim's call log, the outcome
//! events and the producer's confirmed publishes (`common::chaos`). Every scenario asserts
//! lost = 0, duplicate outcomes = 0, model calls started after the deadline = 0, and
//! duplicate model calls within the at-least-once bound; the row is printed.
//!
//! Short tier (every run, CI): `cargo nextest run -p lastcall --features test-hooks --test suite -E 'test(/^chaos::/)' --no-capture`.
//! Slow tier (the 3-node cluster): `cargo nextest run -p lastcall --features test-hooks --test suite -E 'test(/^chaos::/)'
//! --run-ignored all --no-capture`. `LASTCALL_CHAOS_ROWS=FILE` appends each row to FILE.
//! RELIABILITY.md has the results.

use crate::common;

use common::chaos::{Run, Spec};
use common::private_pg::PrivatePg;
use common::private_rabbit::PrivateRabbit;
use common::proxy::FreezableProxy;
use std::path::Path;
use std::time::Duration;

/// Load before the fault, the fault, load after it.
const BEFORE: Duration = Duration::from_secs(3);
const FAULT: Duration = Duration::from_secs(5);
const AFTER: Duration = Duration::from_secs(5);

fn sqlite(dir: &Path) -> String {
    format!("sqlite://{}", dir.join("ledger.db").display())
}

fn node() -> PrivateRabbit {
    PrivateRabbit::start(|port| format!("listeners.tcp.default = 127.0.0.1:{port}\n"))
}

fn ctl_ok(rabbit: &PrivateRabbit, args: &[&str]) {
    let out = rabbit.ctl(args);
    assert!(
        out.status.success(),
        "rabbitmqctl {args:?}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Runs the restoring command on drop unless [`done`](Restore::done) was called: a failing
/// assertion never leaves the fault in place.
struct Restore<'r> {
    rabbit: &'r PrivateRabbit,
    args: &'static [&'static str],
    armed: bool,
}

impl<'r> Restore<'r> {
    /// Inject the fault (`fault`), arming the restore (`restore`).
    fn inject(rabbit: &'r PrivateRabbit, fault: &[&str], restore: &'static [&'static str]) -> Self {
        let me = Self {
            rabbit,
            args: restore,
            armed: true,
        };
        ctl_ok(rabbit, fault);
        me
    }

    fn done(mut self) {
        self.armed = false;
        ctl_ok(self.rabbit, self.args);
    }
}

impl Drop for Restore<'_> {
    fn drop(&mut self) {
        if self.armed {
            let _ = self.rabbit.ctl(self.args);
        }
    }
}

/// A run (serve on `serve_url`, the workers on `worker_url`, the ledger `store`), loaded
/// for a while and flowing.
async fn loaded(
    scenario: &str,
    serve_url: &str,
    worker_url: &str,
    store: impl FnOnce(&Path) -> String,
    spec: Spec,
) -> Run {
    let mut run = Run::start(scenario, serve_url, worker_url, store, spec).await;
    run.start_load();
    run.run_for(BEFORE).await;
    run.wait_completed(5, Duration::from_secs(60)).await;
    run
}

/// The fault is over: load for a while more, then account (duplicate model calls within
/// `bound`).
async fn after_fault(mut run: Run, bound: usize) {
    run.fault_ended();
    run.run_for(AFTER).await;
    run.finish(bound).await;
}

/// Every running call of every worker may run again after one fault event: the
/// at-least-once bound on duplicate model calls.
fn bound(events: usize, spec: &Spec) -> usize {
    events * spec.workers * spec.slots
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_stop_app_then_start_app() {
    let rabbit = node();
    let spec = Spec::default();
    let run = loaded(
        "stop_app",
        &rabbit.url(""),
        &rabbit.url(""),
        sqlite,
        spec.clone(),
    )
    .await;
    let fault = Restore::inject(&rabbit, &["stop_app"], &["start_app"]);
    run.run_for(FAULT).await;
    fault.done();
    ctl_ok(&rabbit, &["await_startup", "--timeout", "60"]);
    after_fault(run, bound(1, &spec)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_node_killed_then_started_again() {
    let mut rabbit = node();
    let spec = Spec::default();
    let run = loaded(
        "kill9_node",
        &rabbit.url(""),
        &rabbit.url(""),
        sqlite,
        spec.clone(),
    )
    .await;
    rabbit.kill9();
    run.run_for(Duration::from_secs(2)).await;
    rabbit.start_again();
    after_fault(run, bound(1, &spec)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn broker_closes_all_connections() {
    let rabbit = node();
    let spec = Spec::default();
    let run = loaded(
        "close_all_connections",
        &rabbit.url(""),
        &rabbit.url(""),
        sqlite,
        spec.clone(),
    )
    .await;
    // Three times, a second apart: the reconnects themselves are cut too.
    for _ in 0..3 {
        ctl_ok(&rabbit, &["close_all_connections", "chaos drill"]);
        run.run_for(Duration::from_secs(1)).await;
    }
    after_fault(run, bound(3, &spec)).await;
}

/// The workers reach the node through the in-repo fault proxy (2 s heartbeats); serve
/// reaches it directly. The proxy resets every connection (and refuses new ones for a
/// second), then delays every chunk by 300 ms both ways, then blackholes the traffic for
/// longer than two heartbeats (both sides give the connection up), then heals.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn proxy_resets_delays_and_blackholes_the_workers_traffic() {
    let rabbit = node();
    let proxy = FreezableProxy::start(format!("127.0.0.1:{}", rabbit.port).parse().unwrap()).await;
    let worker_url = format!("amqp://guest:guest@{}/%2f?heartbeat=2", proxy.addr);
    let spec = Spec::default();
    let run = loaded("proxy", &rabbit.url(""), &worker_url, sqlite, spec.clone()).await;
    proxy.refuse(true);
    proxy.reset();
    run.run_for(Duration::from_secs(1)).await;
    proxy.refuse(false);
    run.run_for(Duration::from_secs(2)).await;
    proxy.delay(300);
    run.run_for(Duration::from_secs(3)).await;
    proxy.delay(0);
    proxy.blackhole();
    run.run_for(Duration::from_secs(6)).await;
    proxy.thaw();
    after_fault(run, bound(3, &spec)).await;
}

/// The ledger is a private PostgreSQL cluster, stopped (`-m immediate`) and started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn postgres_stopped_then_started() {
    let rabbit = node();
    let pg = PrivatePg::start();
    let url = pg.url();
    let spec = Spec::default();
    let run = loaded(
        "postgres_restart",
        &rabbit.url(""),
        &rabbit.url(""),
        |_| url.clone(),
        spec.clone(),
    )
    .await;
    pg.stop_immediate();
    assert!(!pg.is_up());
    run.run_for(FAULT).await;
    pg.ctl_start();
    after_fault(run, bound(1, &spec)).await;
}

/// SIGSTOP the worker for longer than its 1 s heartbeat allows (the broker closes its
/// connection and requeues its deliveries), then SIGCONT.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_sigstop_then_sigcont() {
    let rabbit = node();
    let spec = Spec::default();
    let run = loaded(
        "sigstop",
        &rabbit.url(""),
        &rabbit.url("?heartbeat=1"),
        sqlite,
        spec.clone(),
    )
    .await;
    run.signal_worker(0, "-STOP");
    run.run_for(FAULT).await;
    run.signal_worker(0, "-CONT");
    after_fault(run, bound(1, &spec)).await;
}

/// Three workers on one PostgreSQL ledger; one after another is SIGKILLed (mid-call) and
/// started again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn worker_sigkill_loop_three_workers_one_postgres_ledger() {
    let rabbit = node();
    let pg = PrivatePg::start();
    let url = pg.url();
    let spec = Spec {
        workers: 3,
        interval_ms: 100,
        sim_latency_ms: 400,
        ..Spec::default()
    };
    let mut run = loaded(
        "sigkill_loop",
        &rabbit.url(""),
        &rabbit.url(""),
        |_| url.clone(),
        spec.clone(),
    )
    .await;
    let kills = 4;
    for k in 0..kills {
        let w = k % spec.workers;
        run.kill_worker(w);
        run.run_for(Duration::from_millis(1_500)).await;
        run.restart_worker(w);
        run.run_for(Duration::from_millis(1_500)).await;
    }
    // A kill can repeat only the calls that ran on the killed worker.
    after_fault(run, kills * spec.slots).await;
}

/// The memory alarm (`set_vm_memory_high_watermark 0.0001`, then 0.4 again) while serve
/// takes POSTs: publishers are blocked (POSTs answer 503, unconfirmed), deliveries and
/// acks go on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn memory_alarm_while_serve_takes_posts() {
    let rabbit = node();
    let spec = Spec::default();
    let run = loaded(
        "memory_alarm",
        &rabbit.url(""),
        &rabbit.url(""),
        sqlite,
        spec.clone(),
    )
    .await;
    let fault = Restore::inject(
        &rabbit,
        &["set_vm_memory_high_watermark", "0.0001"],
        &["set_vm_memory_high_watermark", "0.4"],
    );
    run.wait_for("the memory alarm", Duration::from_secs(30), async |_| {
        String::from_utf8_lossy(&rabbit.ctl(&["eval", "rabbit_alarm:get_alarms()."]).stdout)
            .contains("memory")
    })
    .await;
    run.run_for(FAULT).await;
    fault.done();
    run.wait_for("the alarm to clear", Duration::from_secs(30), async |_| {
        !String::from_utf8_lossy(&rabbit.ctl(&["eval", "rabbit_alarm:get_alarms()."]).stdout)
            .contains("memory")
    })
    .await;
    after_fault(run, bound(1, &spec)).await;
}

/// A 3-node cluster on this host (own node names and ports, join_cluster), a quorum work
/// queue, serve given the node list A,B,C and the workers the list starting at node
/// `kill`; node `kill` is killed (`kill -9` of its VM) mid-run and stays down.
async fn cluster_one_node_killed(scenario: &str, kill: usize) {
    let mut nodes = PrivateRabbit::cluster(3);
    let url = |i: usize| nodes[i % 3].url("?heartbeat=2");
    // The events are read on the last node of serve's list (C), never the killed one.
    let serve_urls = (0..3).map(url).collect::<Vec<_>>().join(",");
    let worker_urls = (kill..kill + 3).map(url).collect::<Vec<_>>().join(",");
    let spec = Spec {
        workers: 2,
        queue_type: "quorum",
        deadline_ms: 15_000,
        ..Spec::default()
    };
    let mut run = loaded(scenario, &serve_urls, &worker_urls, sqlite, spec.clone()).await;
    nodes[kill].kill9();
    run.fault_ended();
    run.run_for(Duration::from_secs(10)).await;
    run.finish(bound(1, &spec)).await;
}

/// Slow tier: the node the workers are connected to (B; serve is on A) is killed; the workers fail over to the next node of their list.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: a 3-node RabbitMQ cluster (run with --run-ignored all)"]
async fn cluster_of_three_the_workers_node_killed() {
    cluster_one_node_killed("cluster_kill_workers_node", 1).await;
}

/// Slow tier: the node that declared the topology (A: serve and the workers are connected
/// to it, and it leads every quorum queue) is killed. Every process fails over to B; the
/// publisher's first publish after the failover can be nacked by the quorum queue while its
/// new leader is being elected, and the publisher then opens a fresh channel (a channel
/// that saw that nack went on nacking every publish: RELIABILITY.md, finding 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: a 3-node RabbitMQ cluster (run with --run-ignored all)"]
async fn cluster_of_three_the_topology_home_node_killed() {
    cluster_one_node_killed("cluster_kill_home_node", 0).await;
}

/// Slow tier: the workers' URL list starts with a node that refuses connections (its port
/// is closed) and goes on with B, then C. They connect to B past the closed one; B is then
/// killed (`kill -9`) mid-run and stays down, and they fail over to C. `serve` is on C,
/// then A. Nothing lost, no duplicate, no late start; the workers complete jobs again
/// after the failover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: a 3-node RabbitMQ cluster (run with --run-ignored all)"]
async fn cluster_url_list_first_closed_then_the_second_node_killed() {
    let mut nodes = PrivateRabbit::cluster(3);
    let closed = format!(
        "amqp://guest:guest@127.0.0.1:{}/%2f?heartbeat=2",
        common::private_rabbit::free_port()
    );
    let url = |i: usize| nodes[i].url("?heartbeat=2");
    let serve_urls = [url(2), url(0)].join(",");
    let worker_urls = [closed, url(1), url(2)].join(",");
    let spec = Spec {
        workers: 2,
        queue_type: "quorum",
        deadline_ms: 15_000,
        ..Spec::default()
    };
    let mut run = loaded(
        "cluster_first_closed_second_killed",
        &serve_urls,
        &worker_urls,
        sqlite,
        spec.clone(),
    )
    .await;
    nodes[1].kill9();
    run.fault_ended();
    run.run_for(Duration::from_secs(10)).await;
    run.finish(bound(1, &spec)).await;
}

/// Slow tier: the soak under faults (`common/soak.rs`), `LASTCALL_SOAK_MINUTES` long
/// (default 5; `scripts/soak.sh --minutes N` sets it): 1.5× overload through serve and a
/// pika producer, three workers on one private PostgreSQL ledger with a short retention,
/// broker restarts, worker SIGKILLs and a PostgreSQL restart; samples every 30 s; fails
/// on a lost job, a duplicate outcome, a late start, memory growth over the plan's limit
/// or a ledger larger than retention allows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "slow tier: a soak of LASTCALL_SOAK_MINUTES (default 5) minutes (run with --run-ignored all, or scripts/soak.sh)"]
async fn soak_under_faults() {
    common::soak::soak(common::soak::Plan::from_env()).await;
}

/// The soak's schedule (no services): each fault at least once in the shortest run, none
/// in its last tenth, and the 60-minute run as the issue has it.
#[test]
fn soak_plan_has_every_fault_in_a_short_run_and_the_issues_in_an_hour() {
    use common::soak::{Fault, Plan};
    let count = |p: &Plan, f: fn(&Fault) -> bool| p.faults.iter().filter(|(_, x)| f(x)).count();
    for minutes in [3.0, 5.0, 15.0, 60.0] {
        let p = Plan::new(minutes, "unused".into());
        assert!(count(&p, |f| *f == Fault::BrokerRestart) >= 1, "{p:?}");
        assert!(
            count(&p, |f| matches!(f, Fault::KillWorker(_))) >= 1,
            "{p:?}"
        );
        assert_eq!(count(&p, |f| *f == Fault::PostgresRestart), 1, "{p:?}");
        assert!(
            p.faults
                .iter()
                .all(|(t, _)| t.as_secs_f64() < minutes * 54.0),
            "{p:?}"
        );
        assert!(p.faults.windows(2).all(|w| w[0].0 <= w[1].0), "{p:?}");
        // Worker 0 is never killed: it is the memory witness of the whole run.
        assert!(
            !p.faults.iter().any(|(_, f)| *f == Fault::KillWorker(0)),
            "{p:?}"
        );
    }
    let hour = Plan::new(60.0, "unused".into());
    let at = |f: fn(&Fault) -> bool| -> Vec<u64> {
        hour.faults
            .iter()
            .filter(|(_, x)| f(x))
            .map(|(t, _)| t.as_secs() / 60)
            .collect()
    };
    assert_eq!(at(|f| *f == Fault::BrokerRestart), [10, 20, 30, 40, 50]);
    assert_eq!(
        at(|f| matches!(f, Fault::KillWorker(_))),
        [7, 14, 21, 28, 35, 42, 49]
    );
    assert_eq!(hour.baseline_at.as_secs(), 600);
    assert_eq!(hour.memory_limit, 0.10);
}
