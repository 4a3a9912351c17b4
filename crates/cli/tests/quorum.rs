//! The quorum mode against the real broker: `x-queue-type=quorum` with
//! `x-dead-letter-strategy=at-least-once`, `x-overflow=reject-publish` and a delivery
//! limit. Jobs flow through, expired jobs are dead-lettered (at least once) and recorded,
//! and a full queue refuses publishes with a publisher nack that reaches the caller.

use crate::common;

use common::*;
use lastcall_broker::PublishError;
use lastcall_broker::topology::QueueType;
use lastcall_worker::SubmitError;
use lastcall_worker::clock::now_ms;
use std::time::Duration;

async fn quorum_flow(postgres: bool) {
    let env = Env::with_topology("quorum", postgres, |t| {
        t.queue_type = QueueType::Quorum;
    })
    .await;
    // Every queue of the topology is a quorum queue, not only the work queue: none is
    // homed on one node of a cluster.
    let types = queue_types(&env.topo.names.prefix);
    let n = &env.topo.names;
    for q in [
        n.work_queue.clone(),
        n.dead_queue.clone(),
        n.retry_ready_queue(),
    ]
    .into_iter()
    .chain(env.topo.retry_delays_ms.iter().map(|d| n.retry_queue(*d)))
    {
        assert_eq!(
            types.get(&q).map(String::as_str),
            Some("quorum"),
            "{q}: {types:?}"
        );
    }
    let sim = sim(0);
    let s = env.submitter(0, true).await;
    // Expires in the quorum work queue before any worker runs.
    let exp = s.submit(&job("q-exp", 400), now_ms()).await.unwrap();
    env.wait_ready(&env.topo.names.dead_queue, 1).await;
    assert_eq!(env.ready(&env.topo.names.work_queue).await, 0);
    let mut cfg = env.worker_config(1, 2);
    cfg.topology = env.topo.clone();
    let w = env.start_worker(cfg, sim.clone(), system_clock()).await;
    s.submit(&job("q-ok", 60_000), now_ms()).await.unwrap();
    let recs = env
        .wait_terminal(&["q-ok".into()], Duration::from_secs(10))
        .await;
    assert_eq!(recs[0].state, "completed");
    w.stop().await;
    env.drain_dead_letters(false).await;
    let rec = env.ledger.get("q-exp").await.unwrap().unwrap();
    assert_eq!(
        (rec.state.as_str(), rec.reason.as_deref()),
        ("expired_before_receive", Some("broker_ttl_expired"))
    );
    assert_eq!(rec.expires_at_ms, Some(exp.expires_at_ms));
    assert!(
        rec.error
            .as_deref()
            .unwrap_or("")
            .contains("reason=expired"),
        "{rec:?}"
    );
    assert_eq!(sim.calls_for("q-exp"), 0);
    assert_eq!(sim.calls_for("q-ok"), 1);
    env.cleanup().await;
}

/// name → type (`classic`, `quorum`) of the shared broker's queues whose name starts with
/// `prefix.` (read-only: `rabbitmqctl list_queues`).
fn queue_types(prefix: &str) -> std::collections::HashMap<String, String> {
    rabbitmqctl::list_queues(rabbitmqctl::shared_ctl, &["type"])
        .into_iter()
        .filter(|(name, _)| name.starts_with(&format!("{prefix}.")))
        .map(|(name, mut ty)| (name, ty.remove(0)))
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_at_least_once_mode_runs_and_dead_letters_sqlite() {
    quorum_flow(false).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn quorum_at_least_once_mode_runs_and_dead_letters_postgres() {
    quorum_flow(true).await;
}

/// `reject-publish` on a full quorum queue: the publish is nacked, the submitter reports
/// it as not accepted with a message about the full queue, and nothing is recorded as
/// accepted.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_quorum_queue_nacks_and_the_caller_sees_it() {
    let env = Env::with_topology("qfull", false, |t| {
        t.queue_type = QueueType::Quorum;
        t.max_length = Some(1);
    })
    .await;
    let s = env.submitter(0, true).await;
    // A quorum queue applies its length limit as it processes commands, so the publish
    // that reaches the limit may still be confirmed; the ones after it are nacked.
    let mut accepted = Vec::new();
    let mut refused = None;
    for i in 1..=5 {
        let id = format!("f-{i}");
        match s.submit(&job(&id, 60_000), now_ms()).await {
            Ok(_) => accepted.push(id),
            Err(e) => {
                refused = Some((id, e));
                break;
            }
        }
    }
    let (id, err) = refused.expect("a full queue must refuse a publish");
    assert!(
        accepted.len() <= 2,
        "max_length 1 (+1 in flight): {accepted:?}"
    );
    assert!(
        matches!(err, SubmitError::Publish(PublishError::Nacked)),
        "{err:?}"
    );
    let msg = err.to_string();
    assert!(
        msg.contains("not accepted") && msg.contains("full"),
        "the message says why: {msg}"
    );
    assert!(
        env.ledger.get(&id).await.unwrap().is_none(),
        "not in the inventory"
    );
    for a in &accepted {
        assert_eq!(env.ledger.get(a).await.unwrap().unwrap().state, "accepted");
    }
    assert_eq!(
        env.ready(&env.topo.names.work_queue).await as usize,
        accepted.len()
    );
    // The CLI's submit exits non-zero with the same explanation.
    let mut args = vec![
        "submit",
        "--kind",
        "incident.summary",
        "--deadline-ms",
        "60000",
        "--prompt",
        "x",
        "--queue-type",
        "quorum",
    ];
    args.extend(["--job-id", "f-3"]);
    let out = env.cli(&args);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(stderr.contains("full"), "{stderr}");
    env.cleanup().await;
}

/// `lastcall topology apply --policies` sets the work queue's at-least-once
/// dead-lettering, overflow and delivery limit as a broker policy through the real
/// management API; applying twice is harmless.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn topology_apply_sets_broker_policies_through_the_management_api() {
    let env = Env::with_topology("policies", false, |t| {
        t.queue_type = lastcall_broker::QueueType::Quorum;
    })
    .await;
    for _ in 0..2 {
        let out = env.cli(&[
            "topology",
            "apply",
            "--queue-type",
            "quorum",
            "--retry-delays-ms",
            "1000,5000",
            "--policies",
        ]);
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(String::from_utf8_lossy(&out.stdout).contains("policies applied"));
    }
    let m = lastcall_broker::management::Management::from_amqp_url(AMQP, "http://127.0.0.1:15672");
    let p = m
        .policy(&format!("{}-work", env.prefix))
        .await
        .unwrap()
        .expect("the policy exists");
    assert_eq!(p["definition"]["dead-letter-strategy"], "at-least-once");
    assert_eq!(p["definition"]["overflow"], "reject-publish");
    assert_eq!(
        p["definition"]["dead-letter-exchange"],
        env.topo.names.dlx.as_str()
    );
    assert_eq!(p["apply-to"], "queues");
    m.delete_policies(&env.topo).await.unwrap();
    assert!(
        m.policy(&format!("{}-work", env.prefix))
            .await
            .unwrap()
            .is_none()
    );
    env.cleanup().await;
}
