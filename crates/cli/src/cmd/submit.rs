//! `lastcall submit`.

use crate::cli::SubmitArgs;
use crate::config::Settings;
use anyhow::{Context, Result, bail};
use lastcall_broker::Publisher;
use lastcall_clock::Clock;
use lastcall_producer::shed::Shedder;
use lastcall_producer::{DeadlineSpec, NewJob, SubmitError, Submitter, load_signing_key};
use serde_json::{Map, Value, json};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// Exit status of a job shed at the door (`EX_TEMPFAIL`: try again later).
pub const EXIT_SHED: u8 = 75;

pub async fn run(s: &Settings, a: SubmitArgs, clock: &dyn Clock) -> Result<ExitCode> {
    let payload = payload(a.payload.as_deref(), a.prompt.as_deref())?;
    let deadline = match (a.deadline_ms, a.expires_at_ms) {
        (Some(ms), None) => DeadlineSpec::RelativeMs(ms),
        (None, Some(at)) => DeadlineSpec::AbsoluteMs(at),
        _ => bail!("give exactly one of --deadline-ms (relative) or --expires-at-ms (absolute)"),
    };
    let mut job = NewJob {
        job_id: a.job_id.clone(),
        kind: a.kind,
        payload,
        deadline,
        min_runtime_ms: a.job_min_runtime_ms,
        trace_id: a.trace_id,
    };
    let (admission, limits) = super::admission(&a.admission);
    let broker = super::connect_broker(s).await?;
    let topo = super::topology(&s.prefix, &a.topology)?;
    topo.ensure(&broker).await?;
    let ledger = if a.no_ledger {
        None
    } else {
        Some(super::open_ledger(&s.store_url).await?)
    };
    let publisher = Publisher::new(&broker, Duration::from_millis(a.confirm_timeout_ms)).await?;
    let live = publisher.clone();
    let submitter = Submitter::new(
        publisher,
        topo.names.clone(),
        ledger.clone(),
        admission,
        limits,
    )
    .with_signing_key(signing_key(a.signing_key_file.as_deref())?)
    .with_shedder((!a.no_shed).then(|| {
        // Credentials and vhost from the AMQP URL; an unreachable API admits the job.
        let m =
            lastcall_broker::management::Management::from_amqp_url(&s.amqp_url, &a.management_url);
        // Each kind's call time from the ledger the workers record to (when one is open).
        // The live count of the queue through the publisher's connection.
        Arc::new(
            Shedder::new(m, topo.names.work_queue.clone())
                .with_ledger(ledger.clone())
                .with_lane_queues(topo.names.lane_queues())
                .with_live_depth(live),
        )
    }));
    // --wait: follow the outcome events *before* publishing, so none can be missed.
    let waiting = if a.wait {
        let id = job
            .job_id
            .get_or_insert_with(lastcall_producer::new_job_id)
            .clone();
        let follower = match &a.events_amqp_url {
            Some(url) => super::connect_events_broker(url).await?,
            None => broker.clone(),
        };
        Some(OutcomeWait::start(&follower, &topo.names.events_exchange, &id).await)
    } else {
        None
    };
    let now = clock.now_ms();
    // Only what was asked for goes into the body (absent: `default`, `standard`).
    let mut env = submitter.envelope(&job, now)?;
    if let Some(p) = &a.priority {
        let p: lastcall_core::Priority = p
            .parse()
            .map_err(|e: lastcall_core::ids::IdError| anyhow::anyhow!("--priority {}", e.0))?;
        env = env.with_priority(p);
    }
    if let Some(t) = a.tenant {
        env = env.with_tenant(t);
    }
    let submitted = match submitter.submit_envelope(&env, None, now).await {
        Ok(submitted) => submitted,
        Err(SubmitError::WouldExpireInQueue(estimate)) => {
            eprintln!("error: not accepted: {estimate} (--no-shed publishes it anyway)");
            eprintln!(
                "refused: would_expire_in_queue — a budget of at least {} ms would be admitted now",
                estimate.min_feasible_budget_ms
            );
            broker.close().await;
            return Ok(ExitCode::from(EXIT_SHED));
        }
        Err(e @ SubmitError::UpstreamUnavailable { .. }) => {
            eprintln!("error: {e} (--no-shed publishes it anyway)");
            broker.close().await;
            return Ok(ExitCode::from(EXIT_SHED));
        }
        Err(e) => return Err(e.into()),
    };
    println!("{}", submitted.job_id);
    eprintln!(
        "accepted: expires_at_ms={} (published with expiration {} ms)",
        submitted.expires_at_ms, submitted.ttl_ms
    );
    let code = match (waiting, ledger.as_deref()) {
        (Some(w), Some(ledger)) => {
            let until_ms = submitted
                .expires_at_ms
                .saturating_add(i64::try_from(a.wait_grace_ms).unwrap_or(i64::MAX));
            w.outcome(ledger, &submitted.job_id, until_ms, clock)
                .await?
        }
        _ => ExitCode::SUCCESS,
    };
    broker.close().await;
    Ok(code)
}

/// `submit --wait`: an events follower subscribed before the publish, and the wait.
struct OutcomeWait {
    waiter: lastcall_http::waiters::Waiter,
    stop: tokio_util::sync::CancellationToken,
}

impl OutcomeWait {
    async fn start(broker: &lastcall_broker::Broker, exchange: &str, job_id: &str) -> Self {
        let hub = Arc::new(lastcall_http::waiters::Waiters::default());
        let mut waiter = hub.subscribe(job_id);
        let stop = tokio_util::sync::CancellationToken::new();
        hub.follow(broker.clone(), exchange.to_owned(), stop.clone(), |_| {});
        // The follower's first `gap` comes once its queue is bound: from then on no event
        // of this job can be missed. Without it, the wait still ends at the deadline.
        let bound = tokio::time::Instant::now() + Duration::from_secs(10);
        if !waiter.wait(bound).await {
            tracing::warn!(
                "could not follow outcome events within 10 s; --wait reads the ledger only at the deadline"
            );
        }
        Self { waiter, stop }
    }

    /// Read the ledger now and after every event of the job (no polling) until it holds
    /// a terminal outcome or `until_ms` passes; print it; the exit status.
    async fn outcome(
        mut self,
        ledger: &lastcall_store::Ledger,
        job_id: &str,
        until_ms: i64,
        clock: &dyn Clock,
    ) -> Result<ExitCode> {
        // The wall-clock deadline as a span on the monotonic clock the wait runs on.
        let left = Duration::from_millis(until_ms.saturating_sub(clock.now_ms()).max(0) as u64);
        let until = tokio::time::Instant::now() + left;
        let rec = self
            .waiter
            .until_terminal(until, || ledger.get(job_id))
            .await?;
        self.stop.cancel();
        let Some(rec) = rec.filter(lastcall_store::JobRecord::is_terminal) else {
            eprintln!(
                "no outcome yet at the deadline + grace; `lastcall jobs show {job_id}` shows it later"
            );
            return Ok(ExitCode::from(EXIT_NO_OUTCOME));
        };
        println!("state: {}", rec.state);
        if let Some(r) = &rec.reason {
            println!("reason: {r}");
        }
        if let Some(ms) = rec.min_feasible_budget_ms {
            let why = rec.reason.as_deref().unwrap_or(&rec.state);
            println!(
                "refused: {why} — a budget of at least {ms} ms left when the worker refused it would have been admitted"
            );
        }
        println!("model calls: {}", rec.backend_calls);
        if let Some(text) = &rec.result {
            println!("\n{text}");
        }
        if let Some(e) = &rec.error {
            eprintln!("error: {e}");
        }
        Ok(ExitCode::from(exit_code_of(&rec.state)))
    }
}

/// `submit --wait` when no outcome arrived by the deadline + grace.
pub const EXIT_NO_OUTCOME: u8 = 4;

/// `submit --wait`'s exit status for an outcome: 0 completed, 3 expired, 1 otherwise.
fn exit_code_of(state: &str) -> u8 {
    use lastcall_core::State;
    match state.parse::<State>() {
        Ok(State::Completed) => 0,
        Ok(State::ExpiredNotStarted | State::ExpiredBeforeReceive | State::DeadlineExceeded) => 3,
        _ => 1,
    }
}

/// The signing key from `--signing-key-file` or `LASTCALL_SIGNING_KEY` (`None`: unsigned).
pub fn signing_key(file: Option<&std::path::Path>) -> Result<Option<lastcall_core::SigningKey>> {
    Ok(load_signing_key(file, "LASTCALL_SIGNING_KEY")?)
}

/// The payload from `--payload` JSON or `--prompt` text.
pub fn payload(payload: Option<&str>, prompt: Option<&str>) -> Result<Map<String, Value>> {
    match (payload, prompt) {
        (Some(p), _) => {
            match serde_json::from_str::<Value>(p).context("--payload is not valid JSON")? {
                Value::Object(m) => Ok(m),
                _ => bail!(
                    "--payload must be a JSON object, e.g. '{{\"messages\":[{{\"role\":\"user\",\"content\":\"hi\"}}]}}'"
                ),
            }
        }
        (None, Some(text)) => Ok(json!({"messages": [{"role": "user", "content": text}]})
            .as_object()
            .cloned()
            .expect("object literal")),
        (None, None) => bail!("give the job's input with --payload JSON or --prompt TEXT"),
    }
}
