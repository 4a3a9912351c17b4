//! A refusal for lack of time names the budget that would be admitted
//! (`min_feasible_budget_ms`): at the door (`429 would_expire_in_queue`, body and
//! `X-Lastcall-Min-Budget-Ms`), and at the worker (recorded on the job's row, shown by
//! `GET /v1/jobs/{id}`, by the chat door's `504` and by `lastcall submit --wait`). Real
//! RabbitMQ, ledger, `lastcall serve` and a sim worker.

use crate::common;

use common::serve::Serve;
use common::*;
use lastcall_worker::clock::now_ms;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

const TOKEN: &str = "min-budget-test-token-0123456789";

/// `POST /v1/jobs` of job `id` with a budget of `deadline_ms`: the status, the
/// `X-Lastcall-Min-Budget-Ms` header and the body.
async fn post(
    http: &reqwest::Client,
    base: &str,
    id: &str,
    deadline_ms: u64,
) -> (u16, Option<u64>, serde_json::Value) {
    let body = serde_json::json!({
        "job_id": id,
        "kind": "incident.summary",
        "deadline_ms": deadline_ms,
        "payload": {"messages": [{"role": "user", "content": "summarize"}]},
    });
    let r = http
        .post(format!("{base}/v1/jobs"))
        .bearer_auth(TOKEN)
        .json(&body)
        .send()
        .await
        .unwrap();
    let status = r.status().as_u16();
    let header = r
        .headers()
        .get("x-lastcall-min-budget-ms")
        .map(|v| v.to_str().unwrap().parse().unwrap());
    (status, header, r.json().await.unwrap_or_default())
}

/// `POST /v1/chat/completions` to `model` with a budget of `deadline_ms`
/// (`X-Lastcall-Deadline-Ms`).
async fn chat(
    http: &reqwest::Client,
    base: &str,
    model: &str,
    deadline_ms: u64,
) -> reqwest::Response {
    http.post(format!("{base}/v1/chat/completions"))
        .bearer_auth(TOKEN)
        .header("X-Lastcall-Deadline-Ms", deadline_ms.to_string())
        .json(&serde_json::json!({
            "model": model,
            "messages": [{"role": "user", "content": "summarize"}],
        }))
        .send()
        .await
        .unwrap()
}

/// Under steady load (a backlog kept near 120 jobs of long budget, drained by one worker
/// slot of 20 ms calls: a queue wait of a few seconds), jobs with a 500 ms budget are shed
/// at the door; each is resent at once with the `min_feasible_budget_ms` its refusal named,
/// and at least 90% of those are admitted. The same refusal on `POST
/// /v1/chat/completions` carries the field beside `code`, and the header.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_job_resent_with_the_named_budget_is_admitted() {
    let env = Env::sqlite("min-budget-door").await;
    let submitter = Arc::new(env.submitter(100, true).await);
    const BACKLOG: u32 = 120;
    for i in 0..BACKLOG {
        submitter
            .submit(&job(&format!("fill-{i}"), 120_000), now_ms())
            .await
            .unwrap();
    }
    let worker = env
        .start_worker(env.worker_config(1, 4), sim(20), system_clock())
        .await;
    // The steady load: top the work queue up to the backlog every 50 ms.
    let stop = Arc::new(AtomicBool::new(false));
    let publisher = lastcall_broker::publish::Publisher::new(&env.broker, Duration::from_secs(5))
        .await
        .unwrap();
    let load = tokio::spawn({
        let (stop, submitter) = (stop.clone(), submitter.clone());
        let queue = env.topo.names.work_queue.clone();
        async move {
            let mut n = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let ready = publisher.queue_ready(&queue).await.unwrap().unwrap_or(0);
                for _ in ready..BACKLOG {
                    n += 1;
                    submitter
                        .submit(&job(&format!("load-{n}"), 120_000), now_ms())
                        .await
                        .unwrap();
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
    });
    let http = reqwest::Client::new();
    let serve = Serve::start(&env, TOKEN, &[]).await;
    let base = &serve.base;

    // Refusals, each resent at once with the budget it named.
    let (mut refused, mut admitted, mut seen) = (0u32, 0u32, Vec::new());
    let until = Instant::now() + Duration::from_secs(90);
    let mut i = 0;
    while refused < 30 {
        assert!(
            Instant::now() < until,
            "only {refused} refusals in 90 s: {seen:?}"
        );
        i += 1;
        let (status, header, body) = post(&http, base, &format!("probe-{i}"), 500).await;
        if status != 429 {
            // Admitted while the door had no reading yet: not a refusal to resend.
            assert_eq!(status, 202, "{body}");
            tokio::time::sleep(Duration::from_millis(100)).await;
            continue;
        }
        assert_eq!(body["error"], "would_expire_in_queue", "{body}");
        let min = body["min_feasible_budget_ms"]
            .as_u64()
            .unwrap_or_else(|| panic!("no min_feasible_budget_ms: {body}"));
        assert_eq!(header, Some(min), "the header is the body's number");
        assert_eq!(body["estimate"]["min_feasible_budget_ms"], min, "{body}");
        assert!(min > 500 && min % 100 == 0, "{body}");
        refused += 1;
        let (again, _, body) = post(&http, base, &format!("resent-{i}"), min).await;
        seen.push((min, again));
        match again {
            202 => admitted += 1,
            429 => {}
            other => panic!("{other}: {body}"),
        }
        // Spread the probes over the load (and let the admitted one join the queue).
        tokio::time::sleep(Duration::from_millis(150)).await;
    }
    let share = f64::from(admitted) / f64::from(refused);
    eprintln!(
        "resent with min_feasible_budget_ms: {admitted} of {refused} admitted ({:.0}%); (budget, status): {seen:?}",
        share * 100.0
    );
    assert!(share >= 0.9, "{admitted} of {refused} admitted: {seen:?}");

    // The OpenAI route: beside `code`, and the header.
    let r = chat(&http, base, "chat", 500).await;
    assert_eq!(r.status(), 429);
    let header: u64 = (r.headers().get("x-lastcall-min-budget-ms"))
        .expect("the header")
        .to_str()
        .unwrap()
        .parse()
        .unwrap();
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(body["error"]["code"], "would_expire_in_queue", "{body}");
    assert_eq!(body["error"]["min_feasible_budget_ms"], header, "{body}");

    stop.store(true, Ordering::Relaxed);
    load.await.unwrap();
    worker.stop().await;
    env.cleanup().await;
}

/// One slot, 400 ms calls, FIFO: with B running and C, D waiting, E arrives with 1,400 ms
/// of budget and is refused at receipt for its expected wait (as in `overload`). Its row
/// keeps the budget that check would have admitted — more than E had left, the wait
/// and a learned call included — and `GET /v1/jobs/e` shows it. `lastcall submit` names
/// the door's budget on a shed job.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workers_refusal_records_the_budget_that_would_have_been_admitted() {
    let env = Env::sqlite("min-budget-worker").await;
    let mut margin = 0;
    let (w, _, s) = two_waiting_behind_one_slot(&env, |cfg| {
        margin = cfg.policy.admission.clock_uncertainty_ms;
    })
    .await;
    s.submit(&job("e", 1_400), now_ms()).await.unwrap();
    let e = env
        .wait_terminal(&["e".to_owned()], Duration::from_secs(15))
        .await
        .remove(0);
    assert_eq!(e.state, "expired_not_started", "{e:?}");
    assert_eq!(
        e.reason.as_deref(),
        Some("receipt:expected_wait_exceeds_budget")
    );
    let min = e.min_feasible_budget_ms.expect("recorded with the refusal");
    let left = e.expires_at_ms.unwrap() - e.received_at_ms.unwrap();
    // The wait (two calls ahead at least) + a learned call + the margin: more than it had.
    assert!(min > left, "{min} ≤ the {left} ms it had left");
    assert!(
        min >= 400 + margin as i64,
        "{min}: a learned call and the margin"
    );
    // Completed jobs carry none.
    let b = env.ledger.get("b").await.unwrap().unwrap();
    assert_eq!(b.min_feasible_budget_ms, None);
    w.stop().await;

    let http = reqwest::Client::new();
    let serve = Serve::start(&env, TOKEN, &[]).await;
    let base = &serve.base;
    let rec: serde_json::Value = http
        .get(format!("{base}/v1/jobs/e"))
        .bearer_auth(TOKEN)
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert_eq!(rec["min_feasible_budget_ms"], min, "{rec}");

    // `lastcall submit` with a budget below the learned call (~400 ms) is shed before it is
    // published (exit 75) and names the budget that would be admitted; resent with it, the
    // job is accepted.
    let submit = |id: &str, budget: &str| env.submit_cli(id, budget, &[]);
    let out = submit("cli-short", "300");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(75), "{stderr}");
    let named = stderr
        .split_once("refused: would_expire_in_queue — a budget of at least ")
        .and_then(|(_, rest)| rest.split_once(" ms would be admitted now"))
        .unwrap_or_else(|| panic!("no budget named: {stderr}"))
        .0
        .to_owned();
    assert!(named.parse::<u64>().unwrap() > 300, "{stderr}");
    let out = submit("cli-enough", &named);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    env.cleanup().await;
}

/// A worker whose floor (`default_min_runtime_ms`, 1,000 ms: nothing learned yet) is more
/// than a job's budget refuses it at receipt for lack of time; the door (`--no-shed`, so the
/// worker decides) and `lastcall submit --no-shed --wait` both wait for that outcome and
/// name the budget the worker's check would have admitted — its clock margin + the floor.
/// The chat door answers `504 deadline_expired` with it beside `code`, and as the header;
/// `submit --wait` prints it on its `refused:` line and exits 3.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn waiting_for_a_workers_refusal_names_the_budget_that_would_have_been_admitted() {
    const FLOOR: u64 = 1_000;
    let env = Env::sqlite("min-budget-wait").await;
    let mut cfg = env.worker_config(1, 4);
    cfg.policy.admission.default_min_runtime_ms = FLOOR;
    let expected = cfg.policy.admission.clock_uncertainty_ms + FLOOR;
    let w = env.start_worker(cfg, sim(20), system_clock()).await;
    let http = reqwest::Client::new();
    let serve = Serve::start(&env, TOKEN, &["--no-shed", "--model", "m=incident.summary"]).await;
    let base = &serve.base;

    // The chat door, holding the request until the job's outcome.
    let r = chat(&http, base, "m", 600).await;
    let status = r.status().as_u16();
    let header = |name: &str| {
        r.headers()
            .get(name)
            .map(|v| v.to_str().unwrap().to_owned())
    };
    let (budget_header, retry, job_id) = (
        header("x-lastcall-min-budget-ms"),
        header("x-should-retry"),
        header("x-lastcall-job-id").expect("the job's id"),
    );
    let body: serde_json::Value = r.json().await.unwrap();
    assert_eq!(status, 504, "{body}");
    assert_eq!(body["error"]["type"], "deadline_expired", "{body}");
    assert_eq!(body["error"]["code"], "receipt:below_min_runtime", "{body}");
    assert_eq!(body["error"]["min_feasible_budget_ms"], expected, "{body}");
    assert_eq!(budget_header, Some(expected.to_string()), "{body}");
    assert_eq!(retry.as_deref(), Some("false"));
    let rec = env.ledger.get(&job_id).await.unwrap().unwrap();
    assert_eq!(rec.state, "expired_not_started", "{rec:?}");
    assert_eq!(rec.min_feasible_budget_ms, Some(expected as i64), "{rec:?}");

    // `lastcall submit --wait`, published past the door's shedding as well.
    let out = env.submit_cli("cli-wait", "600", &["--no-shed", "--wait"]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(3), "{stdout}{stderr}");
    assert!(stdout.contains("state: expired_not_started"), "{stdout}");
    let line = format!(
        "refused: receipt:below_min_runtime — a budget of at least {expected} ms left when the worker refused it would have been admitted"
    );
    assert!(stdout.contains(&line), "no `{line}` in:\n{stdout}{stderr}");
    let rec = env.ledger.get("cli-wait").await.unwrap().unwrap();
    assert_eq!(rec.min_feasible_budget_ms, Some(expected as i64), "{rec:?}");

    w.stop().await;
    env.cleanup().await;
}
