//! Least privilege on the broker (issue #14, item 8; issue #48, item 8;
//! `docs/broker-permissions.md`).
//!
//! A fresh vhost with one RabbitMQ user per role — deployer, producer, follower, worker,
//! dead-letter processor — each holding exactly the `configure`/`write`/`read` regexes the
//! document gives (copied here verbatim, for the default prefix `lastcall`). The real
//! binary runs each role's command as that user: before the deployer, the producer is
//! told to run it; the deployer declares the topology, the producer submits (checking the
//! topology with passive declares: it may configure nothing), a worker completes one job
//! and retries another until it is dead-lettered, and `lastcall dlq` records an expiry.
//! Then the refusals that matter: the producer cannot consume the work queue or bypass the
//! jobs exchange, the worker cannot forge dead letters or publish to other exchanges, the
//! dead-letter processor cannot republish to the jobs exchange or consume work; and no role
//! but the deployer can bind a queue of any name it may touch to the jobs or lanes
//! exchange (under the earlier regexes a producer declared a *queue* `lastcall.jobs`,
//! bound it to the exchange of that name and read every job), nor consume a queue that is
//! not its own.
//!
//! The broker is shared with other tests: only this test's own vhost and users are created,
//! and a drop guard deletes them (and stops the worker) even when an assertion fails.

use crate::common;

use lastcall_broker::topology::queue_depth;
use lastcall_broker::{Broker, IncomingStream, PublishProps, Publisher};
use lastcall_store::Ledger;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A role's permissions in the vhost (`rabbitmqctl set_permissions -p VHOST USER CONF WRITE READ`).
struct Role {
    name: &'static str,
    configure: &'static str,
    write: &'static str,
    read: &'static str,
}

// The table of docs/broker-permissions.md for the prefix `lastcall`. Keep them identical.

/// `lastcall topology apply` / `topology delete`.
const DEPLOYER: Role = Role {
    name: "deployer",
    configure: r"^lastcall\.(jobs|dlx|lanes|work(\.lane[1-7])?|dead|events|control|parked|retry\..+|dead\..+)$",
    write: r"^(lastcall\.(work(\.lane[1-7])?|dead|dlx)|amq\.default)$",
    read: r"^lastcall\.(jobs|dlx|lanes|work(\.lane[1-7])?|retry\..+)$",
};

/// `lastcall submit` / `lastcall serve` / `lastcall cancel`: publishing, nothing else. It
/// neither configures nor reads anything (it checks the topology with passive declares,
/// which need no permission), so it can route no job to a queue it reads (issue #48).
const PRODUCER: Role = Role {
    name: "producer",
    configure: "^$",
    write: r"^lastcall\.(jobs|lanes|events|control)$",
    read: "^$",
};

/// The outcome-events follower of `serve` and `submit --wait` (`--events-amqp-url`): its
/// own exclusive queue bound to `lastcall.events`, and nothing it could bind to the jobs.
const FOLLOWER: Role = Role {
    name: "follower",
    configure: r"^lastcall\.events\.follow\..+$",
    write: r"^lastcall\.events\.follow\..+$",
    read: r"^lastcall\.(events|events\.follow\..+)$",
};

/// `lastcall worker`: reads the work it consumes, configures only its control queue.
const WORKER: Role = Role {
    name: "worker",
    configure: r"^lastcall\.control\.follow\..+$",
    write: r"^(lastcall\.(jobs|lanes|events|control\.follow\..+)|amq\.default)$",
    read: r"^lastcall\.(work(\.lane[1-7])?|retry\.ready|control|control\.follow\..+)$",
};

/// `lastcall dlq --park --split-by-reason`.
const DLQ: Role = Role {
    name: "dlq",
    configure: r"^lastcall\.(parked|dead\..+)$",
    write: r"^(lastcall\.events|amq\.default)$",
    read: r"^lastcall\.dead$",
};

const PREFIX: &str = "lastcall";
/// Retry queues of the topology (every command is given the same list).
const DELAYS: &str = "1000,5000";

/// A vhost and users of this test only; deleted on drop, also after a panic.
struct Sandbox {
    id: String,
    vhost: String,
    users: Vec<String>,
    dir: PathBuf,
    store_url: String,
    children: Vec<Child>,
    runs: usize,
}

impl Sandbox {
    fn new() -> Sandbox {
        let id = common::unique("lp");
        let dir = std::env::temp_dir().join(format!("least-privilege-{id}"));
        std::fs::create_dir_all(&dir).unwrap();
        let sandbox = Sandbox {
            vhost: format!("lc-{id}"),
            store_url: format!("sqlite://{}", dir.join("ledger.db").display()),
            id,
            users: Vec::new(),
            dir,
            children: Vec::new(),
            runs: 0,
        };
        // The guard exists before the vhost does: a failure from here on still cleans up.
        rabbitmqctl(&["add_vhost", &sandbox.vhost]);
        sandbox
    }

    /// Create the role's user with its permissions in the vhost; its AMQP URL.
    fn user(&mut self, role: &Role) -> String {
        let user = format!("lc-{}-{}", role.name, self.id);
        let password = format!("pw-{}-{}", role.name, std::process::id());
        self.users.push(user.clone());
        rabbitmqctl(&["add_user", &user, &password]);
        rabbitmqctl(&[
            "set_permissions",
            "-p",
            &self.vhost,
            &user,
            role.configure,
            role.write,
            role.read,
        ]);
        format!("amqp://{user}:{password}@127.0.0.1:5672/{}", self.vhost)
    }

    /// The binary as the user of `url`, with this sandbox's ledger and the prefix.
    fn lastcall(&self, url: &str, args: &[&str]) -> Command {
        let mut c = Command::new(env!("CARGO_BIN_EXE_lastcall"));
        c.args(["--amqp-url", url, "--store-url", &self.store_url])
            .args(["--prefix", PREFIX])
            .args(args);
        c
    }

    /// Run to completion (at most `timeout`); (success, stdout, stderr).
    fn run(&mut self, url: &str, args: &[&str], timeout: Duration) -> (bool, String, String) {
        self.runs += 1;
        let name = format!("{}-{}", args[0], self.runs);
        let (out, err) = (
            self.dir.join(format!("{name}.out")),
            self.dir.join(format!("{name}.err")),
        );
        let mut child = self
            .lastcall(url, args)
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&out).unwrap())
            .stderr(std::fs::File::create(&err).unwrap())
            .spawn()
            .expect("run the lastcall binary");
        let status = wait_exit(&mut child, timeout, &format!("lastcall {}", args.join(" ")));
        let read = |p: &Path| std::fs::read_to_string(p).unwrap_or_default();
        (status.success(), read(&out), read(&err))
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
        for u in &self.users {
            let _ = Command::new("timeout")
                .args(["60", "rabbitmqctl", "-q", "delete_user", u])
                .output();
        }
        match Command::new("timeout")
            .args(["60", "rabbitmqctl", "-q", "delete_vhost", &self.vhost])
            .output()
        {
            Ok(o) if o.status.success() => {}
            other => eprintln!("could not delete the test vhost {}: {other:?}", self.vhost),
        }
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// `rabbitmqctl -q ARGS`, which must succeed. Each try is bounded (`timeout 60`): the CLI
/// is an Erlang node of its own, which can stall while other nodes start and stop on the
/// machine; a try that timed out is made again, and an "already exists" answer to a retry
/// counts as done (the timed-out try got through).
fn rabbitmqctl(args: &[&str]) {
    let mut last = String::new();
    for attempt in 0..3 {
        let out = Command::new("timeout")
            .args(["60", "rabbitmqctl", "-q"])
            .args(args)
            .output()
            .expect(
                "this test creates its own vhost and users with `rabbitmqctl` (run it as root)",
            );
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        if out.status.success() || (attempt > 0 && text.contains("already exists")) {
            return;
        }
        // `timeout` exits 124 when it stopped the command; anything else is the answer.
        if out.status.code() != Some(124) {
            panic!("rabbitmqctl {}: {text}", args.join(" "));
        }
        last = text;
    }
    panic!("rabbitmqctl {} timed out 3 times: {last}", args.join(" "));
}

fn wait_exit(child: &mut Child, timeout: Duration, what: &str) -> std::process::ExitStatus {
    let until = Instant::now() + timeout;
    loop {
        if let Some(s) = child.try_wait().unwrap() {
            return s;
        }
        if Instant::now() > until {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{what} did not exit within {timeout:?}");
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

/// Poll `check` every 100 ms until it holds; panics with `what` after `timeout`.
async fn wait_until(what: &str, timeout: Duration, mut check: impl AsyncFnMut() -> bool) {
    let until = Instant::now() + timeout;
    while !check().await {
        assert!(Instant::now() < until, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Nothing was refused in a process's log but the one declare it tries before checking
/// passively (`Topology::ensure`, a follower's exchange): lapin logs the broker's answer
/// to it as an error, once per process and kind.
fn assert_no_refusal(log: &str, who: &str) {
    let expected = |l: &str| {
        l.contains("lapin::channel")
            && ["'lastcall.jobs'", "'lastcall.events'", "'lastcall.control'"]
                .iter()
                .any(|e| l.contains(&format!("access to exchange {e}")))
    };
    let refused: Vec<&str> = log
        .lines()
        .filter(|l| l.contains("ACCESS_REFUSED"))
        .collect();
    let unexpected: Vec<&&str> = refused.iter().filter(|l| !expected(l)).collect();
    assert!(
        unexpected.is_empty() && refused.len() <= 2,
        "{who} was refused something (or tried to declare again):\n{log}"
    );
}

/// An error's text with all its sources.
fn chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut text = e.to_string();
    let mut cur = e.source();
    while let Some(s) = cur {
        text.push_str(": ");
        text.push_str(&s.to_string());
        cur = s.source();
    }
    text
}

/// The broker must have refused `what` with ACCESS_REFUSED on `resource`.
fn assert_refused<T, E: std::error::Error + 'static>(r: Result<T, E>, what: &str, resource: &str) {
    match r {
        Ok(_) => panic!("{what}: the broker allowed it; the role has a permission too many"),
        Err(e) => {
            let text = chain(&e);
            assert!(
                text.contains("ACCESS_REFUSED") && text.contains(&format!("'{resource}'")),
                "{what}: expected ACCESS_REFUSED on `{resource}`, got: {text}"
            );
        }
    }
}

async fn consume(broker: &Broker, queue: &str) -> Result<(), lastcall_broker::BrokerError> {
    let s = IncomingStream::open(broker, queue, 1, "least-privilege-probe").await?;
    s.close().await;
    Ok(())
}

async fn publish(
    broker: &Broker,
    exchange: &str,
    key: &str,
) -> Result<(), lastcall_broker::PublishError> {
    let p = Publisher::new(broker, Duration::from_secs(5)).await?;
    let props = PublishProps {
        job_id: "least-privilege-probe".into(),
        ttl_ms: Some(60_000),
        attempt: 1,
        timestamp_s: 0,
        signature: None,
    };
    p.publish(exchange, key, b"{}", &props).await
}

/// Declare an exclusive queue and bind it to `exchange` on a connection of its own (what
/// a user would do to copy an exchange's messages).
async fn declare_and_bind(url: &str, queue: &str, exchange: &str) -> Result<(), lapin::Error> {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
    let r = async {
        let ch = conn.create_channel().await?;
        ch.queue_declare(
            queue.into(),
            QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await?;
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            "#".into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
    }
    .await;
    let _ = conn.close(200, "done".into()).await;
    r
}

/// Every name the roles' regexes match or a role uses, as a queue name: the topology's,
/// the dead-letter copies, the followers' queues, and one of nobody's.
fn touchable_names() -> Vec<String> {
    let mut names: Vec<String> = [
        "jobs",
        "lanes",
        "dlx",
        "events",
        "control",
        "work",
        "dead",
        "parked",
        "retry.ready",
        "retry.1s",
        "retry.5s",
        "events.follow.spy",
        "control.follow.spy",
        "spy",
    ]
    .iter()
    .map(|n| format!("{PREFIX}.{n}"))
    .collect();
    names.extend((1..lastcall_core::LANES).map(|l| format!("{PREFIX}.work.lane{l}")));
    names.extend(
        lastcall_core::deadletter::SPLIT_LABELS
            .iter()
            .map(|l| format!("{PREFIX}.dead.{l}")),
    );
    names
}

/// A copy of every job the exchange routes: the queue `queue` (declared exclusive unless
/// it exists) bound to `exchange` with `key`, on a connection of its own.
async fn spy(url: &str, queue: &str, exchange: &str, key: &str) -> Result<(), lapin::Error> {
    let conn = lapin::Connection::connect(url, lapin::ConnectionProperties::default()).await?;
    let r = spy_on(&conn, queue, exchange, key).await;
    let _ = conn.close(200, "done".into()).await;
    r
}

/// [`spy`] on channels of an open connection: a refusal closes only its channel, so one
/// connection per role serves the whole sweep (hundreds of connections each opened and
/// closed made the sweep the slowest part of this test on a loaded machine). Each probe
/// is bounded: a broker that does not answer fails the test naming the probe.
async fn spy_on(
    conn: &lapin::Connection,
    queue: &str,
    exchange: &str,
    key: &str,
) -> Result<(), lapin::Error> {
    use lapin::options::{QueueBindOptions, QueueDeclareOptions};
    use lapin::types::FieldTable;
    let probe = async {
        let probe = conn.create_channel().await?;
        let passive = QueueDeclareOptions {
            passive: true,
            ..Default::default()
        };
        let exists = probe
            .queue_declare(queue.into(), passive, FieldTable::default())
            .await
            .is_ok();
        let ch = conn.create_channel().await?;
        if !exists {
            let own = QueueDeclareOptions {
                exclusive: true,
                auto_delete: true,
                ..Default::default()
            };
            ch.queue_declare(queue.into(), own, FieldTable::default())
                .await?;
        }
        ch.queue_bind(
            queue.into(),
            exchange.into(),
            key.into(),
            QueueBindOptions::default(),
            FieldTable::default(),
        )
        .await
    };
    bounded(&format!("bind {queue} to {exchange}"), probe).await
}

/// Start a consumer on `queue` on a channel of `conn` (cancelled when the channel closes).
async fn consume_on(conn: &lapin::Connection, queue: &str) -> Result<(), lapin::Error> {
    use lapin::options::BasicConsumeOptions;
    use lapin::types::FieldTable;
    let probe = async {
        let ch = conn.create_channel().await?;
        ch.basic_consume(
            queue.into(),
            "least-privilege-spy".into(),
            BasicConsumeOptions::default(),
            FieldTable::default(),
        )
        .await?;
        let _ = ch.close(200, "done".into()).await;
        Ok(())
    };
    bounded(&format!("consume {queue}"), probe).await
}

/// `fut`, which must finish within 30 s (a broker that answers nothing fails the test
/// with the step's name rather than at the test runner's timeout).
async fn bounded<T>(what: &str, fut: impl std::future::Future<Output = T>) -> T {
    tokio::time::timeout(Duration::from_secs(30), fut)
        .await
        .unwrap_or_else(|_| panic!("the broker did not answer within 30 s: {what}"))
}

async fn depth(broker: &Broker, queue: &str) -> u32 {
    queue_depth(broker, queue)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("queue {queue} does not exist"))
        .0
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_role_works_with_its_own_permissions_and_no_more() {
    let mut sb = Sandbox::new();
    let deployer = sb.user(&DEPLOYER);
    let producer = sb.user(&PRODUCER);
    let follower = sb.user(&FOLLOWER);
    let worker = sb.user(&WORKER);
    let dlq = sb.user(&DLQ);
    let long = Duration::from_secs(30);
    let topo = ["--retry-delays-ms", DELAYS];

    let submit = |id: &'static str, kind: &'static str, deadline_ms: &'static str| {
        [
            "submit",
            "--no-shed",
            "--kind",
            kind,
            "--prompt",
            "x",
            "--deadline-ms",
            deadline_ms,
            "--clock-uncertainty-ms",
            "0",
            "--job-id",
            id,
            topo[0],
            topo[1],
        ]
    };
    // Before the deployer: the producer may not declare the topology, finds it missing
    // with its passive declares, and says who must create it.
    let (ok, _, err) = sb.run(
        &producer,
        &submit("never", "incident.summary", "60000"),
        long,
    );
    assert!(
        !ok && err.contains("does not exist") && err.contains("topology apply"),
        "submit before the deployer ran: {err}"
    );

    // The deployer declares everything (once per deployment, before the others start).
    let (ok, out, err) = sb.run(&deployer, &["topology", "apply", topo[0], topo[1]], long);
    assert!(ok, "topology apply as the deployer: {err}");
    assert!(out.contains("topology applied"), "{out}");
    let inspect = Broker::connect(&deployer).await.unwrap();
    let work = "lastcall.work";
    let dead = "lastcall.dead";
    assert_eq!(depth(&inspect, work).await, 0, "nothing was published");

    // The producer submits one job that completes, and waits for its outcome event
    // (`--wait` follows `P.events` as the follower; the worker publishes the event) …
    let wait_out = sb.dir.join("submit-wait.out");
    let mut wait_args = submit("lp-ok", "incident.summary", "60000").to_vec();
    wait_args.extend(["--wait", "--events-amqp-url", &follower]);
    let waiting = sb
        .lastcall(&producer, &wait_args)
        .stdin(Stdio::null())
        .stdout(std::fs::File::create(&wait_out).unwrap())
        .stderr(std::fs::File::create(sb.dir.join("submit-wait.err")).unwrap())
        .spawn()
        .expect("spawn submit --wait");
    sb.children.push(waiting);
    wait_until("lp-ok published", long, async || {
        depth(&inspect, work).await == 1
    })
    .await;
    // … and one of a named tenant that fails until retries run out: it goes through the
    // tenant's lane (`lastcall.lanes` → `lastcall.work.lane1`), and so does its retry.
    assert_eq!(
        lastcall_core::lane_of("team-a", lastcall_core::Priority::Standard),
        1
    );
    let mut retry_args = submit("lp-retry", "sim.fail-retryable", "60000").to_vec();
    retry_args.extend(["--tenant", "team-a"]);
    let (ok, out, err) = sb.run(&producer, &retry_args, long);
    assert!(ok, "submit lp-retry as the producer: {err}");
    assert_eq!(out.trim(), "lp-retry");
    assert_eq!(depth(&inspect, work).await, 1);
    assert_eq!(depth(&inspect, "lastcall.work.lane1").await, 1);
    let ledger = Ledger::connect(&sb.store_url).await.unwrap();

    // The worker: consumes work, publishes a retry through the default exchange, relays it
    // from the retry-ready queue to the jobs exchange, and rejects the exhausted job to the DLX.
    let worker_log = sb.dir.join("worker.err");
    let child = sb
        .lastcall(
            &worker,
            &[
                "worker",
                "--backend",
                "sim",
                "--sim-faults",
                "--sim-latency-ms",
                "10",
                "--slots",
                "1",
                "--max-attempts",
                "2",
                "--shutdown-grace-ms",
                "2000",
                topo[0],
                topo[1],
            ],
        )
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&worker_log).unwrap())
        .spawn()
        .expect("spawn the worker");
    sb.children.push(child);
    let log = || std::fs::read_to_string(&worker_log).unwrap_or_default();
    let state = async |id: &str| {
        ledger
            .get(id)
            .await
            .unwrap()
            .map(|r| (r.state, r.reason.unwrap_or_default()))
    };
    let outcomes = async || {
        (
            state("lp-ok").await.map(|s| s.0),
            state("lp-retry").await.map(|s| s.0),
        )
    };
    let until = Instant::now() + long;
    loop {
        if outcomes().await == (Some("completed".into()), Some("failed".into())) {
            break;
        }
        if let Some(s) = sb.children[1].try_wait().unwrap() {
            panic!(
                "the worker exited ({s}) before the jobs finished:\n{}",
                log()
            );
        }
        assert!(
            Instant::now() < until,
            "the worker did not finish the jobs: {:?}\n{}",
            outcomes().await,
            log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        state("lp-retry").await,
        Some(("failed".into(), "retries_exhausted".into())),
        "the retry was published and relayed (not `retry_publish_failed`):\n{}",
        log()
    );
    wait_until("the exhausted job in the dead queue", long, async || {
        depth(&inspect, dead).await == 1
    })
    .await;
    let status = wait_exit(&mut sb.children[0], long, "submit --wait for lp-ok");
    let printed = std::fs::read_to_string(&wait_out).unwrap_or_default();
    let wait_err = std::fs::read_to_string(sb.dir.join("submit-wait.err")).unwrap_or_default();
    assert!(
        status.success() && printed.contains("state: completed"),
        "submit --wait as the producer: {status}\n{printed}\n{wait_err}"
    );
    assert_no_refusal(&wait_err, "submit --wait");
    let pid = sb.children[1].id().to_string();
    assert!(
        Command::new("kill")
            .args(["-TERM", &pid])
            .status()
            .unwrap()
            .success()
    );
    let status = wait_exit(&mut sb.children[1], long, "the worker after SIGTERM");
    assert!(status.success(), "worker exit {status}:\n{}", log());
    assert_no_refusal(&log(), "the worker");

    // The producer cancels a job before its start (ledger, then the broadcast on
    // `P.control` and the event on `P.events`); it was published, so the work queue holds
    // it until a worker acks it without a call.
    let (ok, _, err) = sb.run(
        &producer,
        &submit("lp-cancel", "incident.summary", "60000"),
        long,
    );
    assert!(ok, "submit lp-cancel as the producer: {err}");
    let (ok, out, err) = sb.run(&producer, &["cancel", "lp-cancel"], long);
    assert!(
        ok && out.contains("cancelled before it started"),
        "cancel as the producer: {out}\n{err}"
    );
    assert_no_refusal(&err, "lastcall");
    assert_eq!(
        state("lp-cancel").await,
        Some(("cancelled".into(), "cancelled_before_start".into()))
    );
    let inspect_purge = inspect.purge(work).await.unwrap();
    assert_eq!(
        inspect_purge, 1,
        "the cancelled job was still in the work queue"
    );

    // The producer can neither read the work nor bypass the jobs exchange …
    let as_producer = Broker::connect(&producer).await.unwrap();
    assert_refused(
        consume(&as_producer, work).await,
        "producer consumes the work queue",
        work,
    );
    assert_refused(
        consume(&as_producer, dead).await,
        "producer consumes the dead queue",
        dead,
    );
    assert_refused(
        publish(&as_producer, "", "lastcall.retry.ready").await,
        "producer publishes to a queue through the default exchange",
        "amq.default",
    );
    assert_refused(
        publish(&as_producer, "lastcall.dlx", "x").await,
        "producer publishes to the dead-letter exchange",
        "lastcall.dlx",
    );
    // … nor declare a queue of its own to bind to the jobs exchange: every job's payload
    // would be copied to it (the sweep below tries every name).
    for queue in ["lastcall.events.follow.spy", "lastcall.spy"] {
        assert_refused(
            declare_and_bind(&producer, queue, "lastcall.jobs").await,
            "producer declares a queue to bind to the jobs exchange",
            queue,
        );
    }
    // The follower declares its queue, but cannot bind it to the jobs exchange.
    assert_refused(
        declare_and_bind(&follower, "lastcall.events.follow.spy", "lastcall.jobs").await,
        "follower binds its queue to the jobs exchange",
        "lastcall.jobs",
    );
    assert_refused(
        declare_and_bind(&follower, "lastcall.events.follow.spy", "lastcall.control").await,
        "follower binds its queue to the control exchange",
        "lastcall.control",
    );
    declare_and_bind(&follower, "lastcall.events.follow.ok", "lastcall.events")
        .await
        .expect("the follower's own queue bound to the events exchange");
    assert_refused(
        consume(&Broker::connect(&follower).await.unwrap(), work).await,
        "follower consumes the work queue",
        work,
    );
    // `serve` runs as the producer with its events follower as the follower: ready
    // (`/readyz` includes `events_follower`), nothing refused.
    let port = common::private_rabbit::free_port();
    let serve_log = sb.dir.join("serve.err");
    let serve = sb
        .lastcall(
            &producer,
            &[
                "serve",
                "--addr",
                &format!("127.0.0.1:{port}"),
                "--no-management",
                "--events-amqp-url",
                &follower,
                topo[0],
                topo[1],
            ],
        )
        .env("LASTCALL_HTTP_TOKEN", "least-privilege-token-0123456789")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&serve_log).unwrap())
        .spawn()
        .expect("spawn serve");
    sb.children.push(serve);
    let readyz = format!("http://127.0.0.1:{port}/readyz");
    wait_until(
        "serve ready as the producer and the follower",
        long,
        async || {
            reqwest::get(&readyz)
                .await
                .is_ok_and(|r| r.status().as_u16() == 200)
        },
    )
    .await;
    let serve_err = std::fs::read_to_string(&serve_log).unwrap_or_default();
    assert_no_refusal(&serve_err, "serve");
    let mut serve = sb.children.pop().unwrap();
    let _ = serve.kill();
    let _ = serve.wait();
    // … but passive declares (queue depth for `topology delete` and the depth gauges)
    // need no permission at all.
    assert!(queue_depth(&as_producer, work).await.unwrap().is_some());

    // The worker cannot forge dead letters, publish elsewhere, or read the dead letters.
    let as_worker = Broker::connect(&worker).await.unwrap();
    assert_refused(
        publish(&as_worker, "lastcall.dlx", "x").await,
        "worker publishes to the dead-letter exchange",
        "lastcall.dlx",
    );
    assert_refused(
        publish(&as_worker, "amq.topic", "x").await,
        "worker publishes to an unrelated exchange",
        "amq.topic",
    );
    assert_refused(
        consume(&as_worker, dead).await,
        "worker consumes the dead queue",
        dead,
    );

    // An expiry: no worker runs, so the broker TTL dead-letters the job in the work queue.
    let (ok, _, err) = sb.run(
        &producer,
        &submit("lp-expired", "incident.summary", "300"),
        long,
    );
    assert!(ok, "submit lp-expired as the producer: {err}");
    wait_until("the expired job in the dead queue", long, async || {
        depth(&inspect, dead).await == 2
    })
    .await;

    // The dead-letter processor records it (and copies both dead letters by reason).
    let (ok, out, err) = sb.run(
        &dlq,
        &[
            "dlq",
            "--idle-exit-ms",
            "1500",
            "--park",
            "--split-by-reason",
            topo[0],
            topo[1],
        ],
        long,
    );
    assert!(ok, "lastcall dlq as the dlq user: {err}");
    assert!(
        out.contains("dead letters processed: 2 (recorded: 1, outcome already present: 1"),
        "{out}\n{err}"
    );
    assert_no_refusal(&err, "lastcall");
    assert_eq!(
        state("lp-expired").await,
        Some(("expired_before_receive".into(), "broker_ttl_expired".into()))
    );
    assert_eq!(depth(&inspect, dead).await, 0);
    assert_eq!(depth(&inspect, "lastcall.dead.expired").await, 1);
    let mut copies = 0;
    for label in lastcall_core::deadletter::SPLIT_LABELS {
        copies += depth(&inspect, &format!("lastcall.dead.{label}")).await;
    }
    assert_eq!(copies, 2, "both dead letters copied to their class queues");

    // It can never put a dead letter back into the work.
    let as_dlq = Broker::connect(&dlq).await.unwrap();
    assert_refused(
        publish(&as_dlq, "lastcall.jobs", "incident.summary").await,
        "dlq publishes to the jobs exchange",
        "lastcall.jobs",
    );
    assert_refused(
        consume(&as_dlq, work).await,
        "dlq consumes the work queue",
        work,
    );

    // No role but the deployer can get a copy of a job it did not produce or consume
    // (issue #48): under every name any role may touch, declaring a queue (or using the
    // existing one) and binding it to the jobs or the lanes exchange is refused. Under
    // the earlier regexes a producer or worker declared a *queue* `lastcall.jobs`, bound
    // it to the exchange of that name and read every payload; the dlq bound
    // `lastcall.dead` to it.
    let names = touchable_names();
    let mut holes = Vec::new();
    for (role, url) in [
        ("producer", &producer),
        ("worker", &worker),
        ("dlq", &dlq),
        ("follower", &follower),
    ] {
        let conn = bounded(
            &format!("connect as the {role}"),
            lapin::Connection::connect(url, lapin::ConnectionProperties::default()),
        )
        .await
        .unwrap();
        // It cannot read a queue that is not its own work (existing queues only: one it
        // cannot declare it cannot have bound either).
        // Checked before the binding sweep, whose exclusive queues live until `conn` closes.
        let readable: &[&str] = match role {
            "worker" => &[
                "lastcall.work",
                "lastcall.work.lane1",
                "lastcall.work.lane2",
                "lastcall.work.lane3",
                "lastcall.work.lane4",
                "lastcall.work.lane5",
                "lastcall.work.lane6",
                "lastcall.work.lane7",
                "lastcall.retry.ready",
            ],
            "dlq" => &["lastcall.dead"],
            _ => &[],
        };
        for q in names.iter().filter(|q| !readable.contains(&q.as_str())) {
            if queue_depth(&inspect, q).await.unwrap().is_none() {
                continue;
            }
            match consume_on(&conn, q).await {
                Err(e) if chain(&e).contains("ACCESS_REFUSED") => {}
                other => holes.push(format!("{role}: consumes {q}: {other:?}")),
            }
        }
        // Nor bind a queue to the exchanges the work comes from.
        for q in &names {
            for (exchange, key) in [("lastcall.jobs", "#"), ("lastcall.lanes", "1")] {
                match spy_on(&conn, q, exchange, key).await {
                    Err(e) if chain(&e).contains("ACCESS_REFUSED") => {}
                    other => {
                        holes.push(format!("{role}: queue {q} bound to {exchange}: {other:?}"))
                    }
                }
            }
        }
        let _ = bounded("close", conn.close(200, "done".into())).await;
    }
    assert!(
        holes.is_empty(),
        "a role can read jobs it neither produced nor consumed:\n{}",
        holes.join("\n")
    );
    // The sweep is not vacuous: the deployer (which must create these bindings) can.
    spy(&deployer, "lastcall.work", "lastcall.jobs", "#")
        .await
        .expect("the deployer re-declares the binding jobs → work");

    for b in [inspect, as_producer, as_worker, as_dlq] {
        b.close().await;
    }
    ledger.close().await;
    drop(sb);
}
