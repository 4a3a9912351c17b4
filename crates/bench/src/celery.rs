//! `lastcall bench goodput --celery`: Celery 5.x through the same overload scenario, run by
//! `bench/celery/run.sh` (a venv with Celery from PyPI around `goodput.py`) and parsed
//! from its `--json` output, so that both systems land in one table and one chart.
//!
//! Celery is driven as a subprocess rather than re-implemented: its deadline behaviour
//! (`apply_async(expires=…)`, checked at receipt and at the pool) is what is measured, and
//! only Celery's own worker shows it.

use crate::ServiceDist;
use anyhow::{Context, Result, bail};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};
use std::process::Stdio;

/// The policy column of Celery's rows.
pub(crate) const POLICY: &str = "celery-expires";

/// Where the script lives in the repository.
const SCRIPT: &str = "bench/celery/run.sh";

/// One Celery run, one element of `results` in `goodput.py --json`. The fields the table
/// and the chart read are typed; the rest is kept as it came, for `--json`.
#[derive(Debug, Clone, Deserialize, Serialize)]
pub(crate) struct CeleryResult {
    pub overload: f64,
    pub submitted: u64,
    /// Publishes refused (not counted in `submitted`): arrivals all the same.
    #[serde(default)]
    pub submit_errors: u64,
    pub on_time: u64,
    pub goodput: f64,
    pub completed_late: u64,
    pub started_after_deadline: u64,
    pub model_calls: u64,
    /// All time in task bodies that finished late (Celery cancels nothing), not lastcall's
    /// time in calls cancelled at the deadline.
    pub wasted_model_time: f64,
    pub expired_in_broker: u64,
    pub expired_at_receipt: u64,
    pub expired_at_pool: u64,
    pub no_outcome: i64,
    pub dispatch_p99_ms: f64,
    pub capacity_bound: f64,
    pub window_s: f64,
    /// On-time completions per second since the first submission, as lastcall's.
    pub on_time_per_s: Vec<u64>,
    #[serde(flatten)]
    pub rest: serde_json::Map<String, serde_json::Value>,
}

/// The parts of `goodput.py --json` that are read (one invocation, one overload here).
#[derive(Debug, Deserialize)]
pub(crate) struct CeleryOutput {
    /// `celery 5.7.0`.
    pub system: String,
    /// Unacked deliveries per worker (multiplier × slots).
    pub prefetch: u64,
    pub results: Vec<CeleryResult>,
}

pub(crate) fn parse(stdout: &str) -> Result<CeleryOutput> {
    serde_json::from_str(stdout).context("the Celery benchmark's --json output is not as expected")
}

/// The scenario in goodput.py's terms, and what of lastcall's could not be carried over.
#[derive(Debug, Clone)]
pub(crate) struct Plan {
    pub script: PathBuf,
    /// Everything but `--overload` (one invocation per overload, after lastcall's runs).
    pub args: Vec<String>,
    /// The broker, passed in the environment (`LCB_AMQP_URL`): no password in `ps`.
    pub amqp_url: String,
    /// How Celery's run differs from lastcall's, printed and in `--json`.
    pub differs: Vec<String>,
}

/// What lastcall's run uses, for [`plan`].
pub(crate) struct Scenario<'a> {
    pub service: ServiceDist,
    pub slots: usize,
    pub deadline_ms: &'a [u64],
    pub duration_s: f64,
    pub prefetch: u16,
    pub shed: bool,
    pub edf: bool,
    pub oracle: bool,
    /// `--openai-url` and `--openai-model`: Celery's task calls the same server.
    pub openai: Option<(&'a str, &'a str)>,
}

pub(crate) fn plan(script: Option<&Path>, amqp_url: &str, s: &Scenario) -> Result<Plan> {
    match (s.service, s.openai) {
        (ServiceDist::SmolLm2Mixed, Some(_)) => {}
        (ServiceDist::SmolLm2 | ServiceDist::SmolLm2Mixed, _) => bail!(
            "--celery needs --service fixed:MS or lognormal:MEAN_MS,SIGMA (Celery's task is a sleep of the drawn call time, it has no embedded model), or --service smollm2-mixed with --openai-url (its task then calls the same server)"
        ),
        _ => {}
    }
    let script = locate(script)?;
    // Celery's prefetch is a multiple of the slots (`--prefetch-multiplier`).
    let multiplier = (f64::from(s.prefetch) / s.slots as f64).round().max(1.0) as usize;
    let mut differs = Vec::new();
    if multiplier * s.slots != usize::from(s.prefetch) {
        differs.push(format!(
            "prefetch {} (Celery's is a multiple of the slots) instead of {}",
            multiplier * s.slots,
            s.prefetch
        ));
    }
    if s.shed {
        differs.push("publishes every job (no shedding at the door)".into());
    }
    if s.edf {
        differs.push("its prefetch buffer is FIFO (no --order edf)".into());
    }
    if s.oracle {
        differs.push("no oracle: Celery has no min runtime".into());
    }
    differs.push(
        "wasted_time: all time in calls that finished late (it cancels none); late_done = finished_late; exp_not_started = expired at receipt + at the pool".into(),
    );
    let deadlines: Vec<String> = s.deadline_ms.iter().map(u64::to_string).collect();
    let mut args: Vec<String> = [
        "--json".to_owned(),
        format!("--service={}", s.service),
        format!("--slots={}", s.slots),
        format!("--deadline-ms={}", deadlines.join(",")),
        format!("--duration-s={}", s.duration_s),
        format!("--prefetch-multiplier={multiplier}"),
    ]
    .into();
    if let Some((url, model)) = s.openai {
        args.push(format!("--openai-url={url}"));
        args.push(format!("--openai-model={model}"));
        differs.push(format!(
            "its task calls the server unstreamed and cannot cancel a call (worker -c {})",
            s.slots
        ));
    }
    Ok(Plan {
        script,
        args,
        // goodput.py speaks to one node; lastcall's URL may list several.
        amqp_url: amqp_url
            .split(',')
            .next()
            .unwrap_or(amqp_url)
            .trim()
            .to_owned(),
        differs,
    })
}

/// `--celery-script`, else `bench/celery/run.sh` in the current directory or any above
/// it (the checkout, from any subdirectory), else in the source tree of this build.
fn locate(given: Option<&Path>) -> Result<PathBuf> {
    if let Some(p) = given {
        if !p.is_file() {
            bail!("--celery-script {}: no such file", p.display());
        }
        return Ok(p.to_owned());
    }
    let cwd = std::env::current_dir().unwrap_or_default();
    let built_from = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    cwd.ancestors()
        .chain([built_from.as_path()])
        .map(|d| d.join(SCRIPT))
        .find(|p| p.is_file())
        .map(|p| p.canonicalize().unwrap_or(p))
        .with_context(|| {
            format!(
                "--celery: {SCRIPT} not found in {} or above it, nor in {}; run from a lastcall checkout or pass --celery-script PATH",
                cwd.display(),
                built_from.display()
            )
        })
}

/// Run Celery at one overload; its progress and errors go to stderr as they come.
/// `capacity_per_s`: the capacity lastcall's runs used when it is not the slots × the
/// mean call (a model server's ceiling), so that Celery sees the same arrivals.
pub(crate) async fn run(
    plan: &Plan,
    overload: f64,
    capacity_per_s: Option<f64>,
) -> Result<CeleryOutput> {
    let out = tokio::process::Command::new(&plan.script)
        .args(&plan.args)
        .arg(format!("--overload={overload}"))
        .args(capacity_per_s.map(|c| format!("--capacity-per-s={c}")))
        .env("LCB_AMQP_URL", &plan.amqp_url)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .output()
        .await
        .with_context(|| format!("--celery: cannot run {}", plan.script.display()))?;
    if !out.status.success() {
        bail!(
            "--celery: {} failed ({}; its errors are above). It needs python3 with venv, pip access to PyPI the first time (it installs Celery into a venv under ~/.cache/lastcall) and RabbitMQ at {}; see bench/celery/README.md, or run without --celery",
            plan.script.display(),
            out.status,
            lastcall_broker::redact(&plan.amqp_url)
        );
    }
    let stdout = String::from_utf8_lossy(&out.stdout);
    let parsed = parse(&stdout).with_context(|| format!("from {}", plan.script.display()))?;
    if parsed.results.len() != 1 {
        bail!(
            "--celery: expected one result for {overload}×, got {}",
            parsed.results.len()
        );
    }
    Ok(parsed)
}
