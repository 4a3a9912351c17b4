//! The deadline carried into the model server: a backend may send the job's tier as the
//! request's `priority` (vLLM's priority scheduling) and the budget left in a header the
//! operator names. Against the fault-injecting chat-completions server of
//! `common::upstream` over real HTTP, with real RabbitMQ and the ledger.
//!
//! - Off by default: the request has no `priority` and no budget header.
//! - On: critical, standard and batch jobs reach the server as -1, 0 and 1, and the header
//!   holds a budget no larger than what was left of the job's deadline when it was sent.
//! - The `lastcall worker` flags and a `[routing.backends.NAME]` entry switch them on.

use crate::common;

use common::upstream::{Upstream, until};
use common::*;
use lastcall_core::{Priority, Tenant};
use lastcall_openai::{OpenAiBackend, OpenAiConfig};
use lastcall_worker::clock::now_ms;
use std::process::Stdio;
use std::sync::Arc;
use std::time::Duration;

const HEADER: &str = "x-request-budget-ms";

/// What the server saw for job `id` (its first message's content): the budget header's
/// value and the body's `priority`.
fn hints_for(up: &Upstream, id: &str) -> (Option<u64>, Option<i64>) {
    let seen = up.seen.lock().unwrap();
    let requests = up.requests_seen.lock().unwrap();
    let i = seen.iter().position(|(c, _)| c == id).expect("a request");
    let (head, body) = &requests[i];
    let budget = head.lines().find_map(|l| {
        let (name, value) = l.split_once(':')?;
        (name.trim() == HEADER).then(|| value.trim().parse().expect("whole ms"))
    });
    (budget, body.get("priority").and_then(|p| p.as_i64()))
}

/// A job `id` of tier `p` with `budget_ms`, its id as the message; submitted, and its
/// deadline (ms since the epoch).
async fn submit(s: &lastcall_worker::Submitter, id: &str, p: Priority, budget_ms: u64) -> i64 {
    let job = job_with(
        id,
        budget_ms,
        serde_json::json!({"messages": [{"role": "user", "content": id}]}),
    );
    let env = (s.envelope(&job, now_ms()).unwrap())
        .with_tenant(Tenant::parse("team-e").unwrap())
        .with_priority(p);
    s.submit_envelope(&env, None, now_ms()).await.unwrap();
    env.deadline().expires_at_ms()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_tier_and_the_budget_left_reach_the_server_only_when_switched_on() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("engine-hints").await;
    let s = env.submitter(100, true).await;

    // The defaults: neither.
    let plain: Arc<dyn lastcall_backend::Backend> =
        Arc::new(OpenAiBackend::new(OpenAiConfig::new(&base, "m")).unwrap());
    let w = env
        .start_worker(env.worker_config(2, 16), plain, system_clock())
        .await;
    submit(&s, "plain-crit", Priority::Critical, 10_000).await;
    let recs = env
        .wait_terminal(&["plain-crit".to_owned()], Duration::from_secs(20))
        .await;
    assert_eq!(recs[0].state, "completed", "{recs:#?}");
    assert_eq!(hints_for(&up, "plain-crit"), (None, None));
    w.stop().await;

    // Switched on: each tier's value, and the budget left.
    let cfg = OpenAiConfig::new(&base, "m")
        .with_send_priority(true)
        .with_budget_header(Some("X-Request-Budget-Ms".into()));
    let hinted: Arc<dyn lastcall_backend::Backend> = Arc::new(OpenAiBackend::new(cfg).unwrap());
    let w = env
        .start_worker(env.worker_config(2, 16), hinted, system_clock())
        .await;
    let mut sent = Vec::new();
    for (id, p) in [
        ("on-crit", Priority::Critical),
        ("on-std", Priority::Standard),
        ("on-batch", Priority::Batch),
    ] {
        let submitted_ms = now_ms();
        let deadline = submit(&s, id, p, 10_000).await;
        sent.push((id, p, submitted_ms, deadline));
    }
    let ids: Vec<String> = sent.iter().map(|(id, ..)| id.to_string()).collect();
    let recs = env.wait_terminal(&ids, Duration::from_secs(20)).await;
    assert!(recs.iter().all(|r| r.state == "completed"), "{recs:#?}");
    for (id, p, submitted_ms, deadline) in sent {
        let (budget, priority) = hints_for(&up, id);
        assert_eq!(
            priority,
            Some(lastcall_openai::request::engine_priority(p)),
            "{id}"
        );
        let budget = budget.unwrap_or_else(|| panic!("{id}: no {HEADER} header"));
        // Sent after the submission: never more than the deadline left then, and some of
        // the 10 s left (a call starts within a fraction of it on an idle worker).
        assert!(
            (budget as i64) <= deadline - submitted_ms && budget > 0,
            "{id}: {budget} ms, {} ms left at submission",
            deadline - submitted_ms
        );
    }
    w.stop().await;
    server.abort();
    env.cleanup().await;
}

/// `lastcall worker --send-priority --budget-header NAME`, and a `[routing.backends.NAME]`
/// entry with `send_priority` and `budget_header`, reach the server.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_worker_flags_and_a_named_backend_switch_them_on() {
    let up = Arc::new(Upstream::default());
    let (base, server) = up.start().await;
    let env = Env::sqlite("engine-hints-cli").await;
    let s = env.submitter(100, true).await;

    let config = env.dir.join("lastcall.toml");
    std::fs::write(
        &config,
        format!(
            "[routing]\ndefault = \"vllm\"\n\n[routing.backends.vllm]\nbase_url = \"{base}\"\nmodel = \"m\"\nsend_priority = true\nbudget_header = \"X-Request-Budget-Ms\"\n"
        ),
    )
    .unwrap();
    let runs: [(&str, Vec<String>); 2] = [
        (
            "flags",
            ["--backend", "openai", "--base-url", &base, "--model", "m"]
                .into_iter()
                .chain(["--send-priority", "--budget-header", "X-Request-Budget-Ms"])
                .map(String::from)
                .collect(),
        ),
        (
            "named",
            vec![
                "--config".into(),
                config.display().to_string(),
                "--backend".into(),
                "routed".into(),
            ],
        ),
    ];
    for (tag, args) in runs {
        let mut worker = env
            .command()
            .arg("worker")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn the worker");
        let id = format!("{tag}-crit");
        submit(&s, &id, Priority::Critical, 20_000).await;
        let recs = env
            .wait_terminal(std::slice::from_ref(&id), Duration::from_secs(30))
            .await;
        let _ = worker.kill();
        let _ = worker.wait();
        assert_eq!(recs[0].state, "completed", "{tag}: {recs:#?}");
        let (budget, priority) = hints_for(&up, &id);
        assert_eq!(priority, Some(-1), "{tag}");
        assert!(
            budget.is_some_and(|b| b > 0 && b <= 20_000),
            "{tag}: {budget:?}"
        );
    }
    until("both requests seen", Duration::from_secs(1), || {
        up.requests_seen.lock().unwrap().len() >= 2
    })
    .await;
    server.abort();
    env.cleanup().await;
}
