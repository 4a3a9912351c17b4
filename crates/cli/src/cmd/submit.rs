//! `lastcall submit`.

use crate::cli::SubmitArgs;
use crate::config::Settings;
use anyhow::{Context, Result, bail};
use lastcall_broker::Publisher;
use lastcall_worker::clock::now_ms;
use lastcall_worker::shed::Shedder;
use lastcall_worker::submit::load_signing_key;
use lastcall_worker::{DeadlineSpec, NewJob, SubmitError, Submitter};
use serde_json::{Map, Value, json};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

/// Exit status of a job shed at the door (`EX_TEMPFAIL`: try again later).
pub const EXIT_SHED: u8 = 75;

pub async fn run(s: &Settings, a: SubmitArgs) -> Result<ExitCode> {
    let payload = payload(a.payload.as_deref(), a.prompt.as_deref())?;
    let deadline = match (a.deadline_ms, a.expires_at_ms) {
        (Some(ms), None) => DeadlineSpec::RelativeMs(ms),
        (None, Some(at)) => DeadlineSpec::AbsoluteMs(at),
        _ => bail!("give exactly one of --deadline-ms (relative) or --expires-at-ms (absolute)"),
    };
    let job = NewJob {
        job_id: a.job_id,
        kind: a.kind,
        payload,
        deadline,
        min_runtime_ms: a.job_min_runtime_ms,
        trace_id: a.trace_id,
    };
    let (admission, limits) = super::admission(&a.admission);
    let broker = super::connect_broker(s).await?;
    let topo = super::topology(&s.prefix, &a.topology)?;
    topo.apply(&broker).await?;
    let ledger = if a.no_ledger {
        None
    } else {
        Some(super::open_ledger(&s.store_url).await?)
    };
    let publisher = Publisher::new(&broker, Duration::from_millis(a.confirm_timeout_ms)).await?;
    let submitter = Submitter::new(publisher, topo.names.clone(), ledger, admission, limits)
        .with_signing_key(signing_key(a.signing_key_file.as_deref())?)
        .with_shedder((!a.no_shed).then(|| {
            // Credentials and vhost from the AMQP URL; an unreachable API admits the job.
            let m = lastcall_broker::management::Management::from_amqp_url(
                &s.amqp_url,
                &a.management_url,
            );
            Arc::new(Shedder::new(m, topo.names.work_queue.clone()))
        }));
    let submitted = match submitter.submit(&job, now_ms()).await {
        Ok(submitted) => submitted,
        Err(SubmitError::WouldExpireInQueue(estimate)) => {
            eprintln!("error: not accepted: {estimate} (--no-shed publishes it anyway)");
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
    broker.close().await;
    Ok(ExitCode::SUCCESS)
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
