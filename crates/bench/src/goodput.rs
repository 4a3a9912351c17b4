//! `lastcall bench goodput`: useful work under overload, per dispatch policy.
//!
//! Everything is measured from the ledger: a job counts as on time when its state is
//! `completed` and its `finished_at_ms` is not after `expires_at_ms`; a model call started
//! after the deadline is one whose `started_at_ms` is after `expires_at_ms`. The sim
//! backend's own call counter cross-checks the ledger's `backend_calls`.
//!
//! With `--celery`, Celery runs the same scenario after lastcall's runs at each overload
//! (`crate::celery`); its rows join the same table, chart and JSON.

use crate::Env;
use crate::celery::{self, CeleryResult};
use crate::chart::{Chart, line_chart};
use crate::{EstimateArg, GoodputArgs, Percentiles, PolicyArg, ServiceDist, f1};
use anyhow::{Context, Result, bail};
use lastcall_backend::Backend;
use lastcall_backend::sim::{SimBackend, SimConfig};
use lastcall_broker::management::Management;
use lastcall_broker::{Broker, Publisher};

use crate::reference::{Naive, ReceiptOnly};
use lastcall_core::concurrency::{LimitConfig, SlotCount};
use lastcall_core::disposition::{DeadlineChecks, Dispatch};
use lastcall_core::table::render;
use lastcall_core::{AdmissionPolicy, EnvelopeLimits, State};
use lastcall_producer::shed::Shedder;
use lastcall_producer::{DeadlineSpec, NewJob, SubmitError, Submitter};
use lastcall_store::{JobRecord, ListFilter};
use lastcall_worker::{BufferOrder, Worker, WorkerConfig, WorkerStats};
use serde::Serialize;
use serde_json::json;
use std::collections::BTreeMap;
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;
use tokio::task::JoinSet;
use tokio_util::sync::CancellationToken;

/// One tenant's figures in a run with `--tenants`.
#[derive(Debug, Clone, Default, Serialize)]
struct TenantRow {
    name: String,
    /// Jobs offered (published, shed at the door, or refused by the publisher).
    offered: u64,
    shed_at_door: u64,
    on_time: u64,
    /// `on_time ÷ offered`.
    on_time_share: f64,
}

/// The run's fixed settings, printed and serialised with the results.
#[derive(Debug, Clone, Serialize)]
struct Setup {
    slots: usize,
    /// Workers, each with `slots`.
    workers: usize,
    /// `--tenants`, as given.
    tenants: Option<String>,
    /// Call durations, drawn per job (`fixed:200`, `lognormal:200,0.6`).
    service: String,
    mean_service_ms: f64,
    capacity_per_s: f64,
    overload: f64,
    arrival_per_s: f64,
    /// Each job draws one of these deadlines (ms after its submission), uniformly.
    deadline_ms: Vec<u64>,
    duration_s: f64,
    /// `true`: the worker and the jobs are told the call time (`min_runtime_ms`); `false`:
    /// the worker's defaults, no hint anywhere (it learns the call time).
    oracle: bool,
    /// The oracle's minimum runtime (only with `oracle`).
    min_runtime_ms: Option<u64>,
    clock_uncertainty_ms: u64,
    prefetch: u16,
    ledger: String,
    /// The producer sheds at the door (the default of `lastcall submit` and `serve`).
    shed: bool,
    /// With `--openai-url`: the server's measured ceiling, which is the capacity.
    ceiling: Option<Ceiling>,
}

/// A model server's ceiling: the most completions per second a client with no deadlines
/// gets from it, at the best of the concurrency levels tried.
#[derive(Debug, Clone, Serialize)]
struct Ceiling {
    /// Completions per second at the best level.
    per_s: f64,
    /// Calls in flight at the best level.
    concurrency: usize,
    /// The mean call there, in ms.
    mean_ms: f64,
    /// Every level tried: (calls in flight, completions per second, mean call ms).
    levels: Vec<(usize, f64, f64)>,
}

/// One run of lastcall's worker: a policy with its buffer order, slots and estimator.
#[derive(Debug, Clone)]
struct RunSpec {
    name: String,
    policy: Arc<dyn Dispatch>,
    order: BufferOrder,
    slots: SlotCount,
    estimate: EstimateArg,
}

/// One policy's results.
#[derive(Debug, Clone, Default, Serialize)]
struct PolicyResult {
    /// The dispatch policy, with its buffer order when several were run (`deadline-fifo`),
    /// and its slots and estimator when several were run (`deadline auto per-kind`).
    policy: String,
    /// The worker's `--slots` (`4`, `auto`).
    slots: String,
    /// How the worker learned call times (`request`, `per-kind`, `split-kinds`).
    estimate: String,
    overload: f64,
    submitted: u64,
    /// Submissions the publisher refused (nack, timeout); not counted as submitted.
    submit_errors: u64,
    /// Jobs the producer refused at the door (`would_expire_in_queue`): never published.
    shed_at_door: u64,
    /// Terminal outcomes by state.
    outcomes: BTreeMap<String, u64>,
    /// Submitted jobs without a terminal outcome when the run ended.
    no_outcome: u64,
    /// `completed` with `finished_at_ms <= expires_at_ms`.
    on_time: u64,
    /// `completed`, but finished after the deadline (a useless answer).
    completed_late: u64,
    /// Capacity × window: the most on-time completions any policy could reach.
    capacity_bound: f64,
    /// From the first submission to the last deadline, in s.
    window_s: f64,
    /// `on_time / capacity_bound`.
    goodput: f64,
    /// `on_time` ÷ every job offered (published, shed at the door, or refused by the
    /// publisher): refusals count as misses.
    on_time_of_arrivals: f64,
    /// Model time ÷ the window: the calls in flight on average.
    mean_in_flight: f64,
    /// Model calls the sim backend received.
    model_calls: u64,
    /// Model calls recorded in the ledger (`backend_calls`), must equal `model_calls`.
    model_calls_ledger: u64,
    /// Model calls whose `started_at_ms` is after the job's `expires_at_ms`.
    started_after_deadline: u64,
    /// Model calls whose `finished_at_ms` is after the job's `expires_at_ms`.
    finished_after_deadline: u64,
    /// Model calls that produced no on-time result (late, cancelled or failed).
    wasted_calls: u64,
    /// Time spent in model calls, in s (the ledger's `latency_ms`).
    model_time_s: f64,
    /// The mean of this run's model calls, in ms (`model_time_s / model_calls`): the
    /// drawn call times average a little above or below the nominal mean.
    mean_call_ms: f64,
    /// The share of the slots' time (slots × window) spent in model calls.
    slots_busy: f64,
    /// `on_time` ÷ the bound at this run's own mean call (slots × window ÷
    /// `mean_call_ms`): goodput without the luck of the draw.
    goodput_at_mean_call: f64,
    /// The share of model time spent in calls cancelled at the deadline
    /// (`deadline_exceeded`): work started that could not finish.
    wasted_model_time: f64,
    /// Receive → model call start, in ms (ledger timestamps, ms resolution; includes the
    /// wait for a slot).
    dispatch: Percentiles,
    /// On-time completions per second of the run (by `finished_at_ms`).
    on_time_per_s: Vec<u64>,
    /// With `--tenants`: each tenant's figures, in the order given.
    tenants: Vec<TenantRow>,
    /// With two or more tenants: Jain's index over on-time ÷ max-min fair share (demand:
    /// the jobs offered, shed at the door or not).
    jain: Option<f64>,
}

pub async fn run(env: &Env, mut a: GoodputArgs) -> Result<ExitCode> {
    if a.smoke {
        a.duration_s = a.duration_s.min(2.0);
        // A real model's calls take what they take: its deadlines stay.
        if !a.service.is_model() {
            a.deadline_ms.iter_mut().for_each(|d| *d = (*d).min(1_000));
        }
        a.service = a.service.smoke();
    }
    let slot_list = a.slot_list();
    let nominal = a.nominal_slots();
    if a.workers == 0
        || a.duration_s <= 0.0
        || a.max_slots == 0
        || a.overload.iter().any(|o| *o <= 0.0)
        || a.deadline_ms.contains(&0)
    {
        bail!(
            "--workers, --max-slots, --overload, --deadline-ms and --duration-s must be positive"
        );
    }
    if a.openai_url.is_some() && !a.service.is_model() {
        bail!(
            "--openai-url sends SmolLM2 jobs to a model server: use it with --service smollm2 \
             or smollm2-mixed (e.g. scripts/llama-server.sh start 8080, then --service \
             smollm2-mixed --openai-url http://127.0.0.1:8080/v1)"
        );
    }
    if a.openai_url.is_none() && slot_list.contains(&SlotCount::Auto) {
        bail!(
            "--slots auto adapts to a model server: use it with --openai-url (the sim backend \
             and the embedded model run a fixed count)"
        );
    }
    if a.estimate.contains(&EstimateArg::SplitKinds) && a.service != ServiceDist::SmolLm2Mixed {
        bail!(
            "--estimate split-kinds splits the jobs by prompt length: use it with --service smollm2-mixed"
        );
    }
    // Celery's prefetch (a multiple of its slots: 2 × unless --prefetch), recorded as the
    // setup's `prefetch`; lastcall's worker takes its own default unless --prefetch.
    let prefetch = a
        .prefetch
        .unwrap_or((nominal * 2).clamp(1, u16::MAX as usize) as u16);
    // Checked first, so that a missing script fails in a second, not after minutes.
    let celery_plan = if a.celery {
        Some(celery::plan(
            a.celery_script.as_deref(),
            &env.amqp_url,
            &celery::Scenario {
                service: a.service,
                slots: nominal,
                deadline_ms: &a.deadline_ms,
                duration_s: a.duration_s,
                prefetch,
                shed: !a.no_shed,
                edf: a.order.contains(&crate::BufferOrderArg::Edf),
                oracle: a.oracle,
                openai: a
                    .openai_url
                    .as_deref()
                    .map(|u| (u, a.openai_model.as_str())),
            },
        )?)
    } else {
        None
    };
    // The model is loaded (or its server measured) once for every run; its mean call
    // time (with every slot busy) or the server's ceiling sets the capacity and so the
    // arrival rates.
    let model = if a.service.is_model() {
        Some(smollm2(&a, nominal).await?)
    } else {
        None
    };
    let mean_ms = match (&model, a.service.mean_ms()) {
        (Some(m), _) => m.mean_ms,
        (None, Some(m)) => m,
        (None, None) => bail!("no mean call time for {}", a.service),
    };
    let ceiling = model.as_ref().and_then(|m| m.ceiling.clone());
    let capacity = match &ceiling {
        Some(c) => c.per_s,
        None => (a.workers * nominal) as f64 * 1000.0 / mean_ms,
    };
    let mut orders = a.order.clone();
    orders.dedup();
    let mut estimates = a.estimate.clone();
    estimates.dedup();
    let mut deadline_runs = Vec::new();
    for &o in &orders {
        let order = BufferOrder::from(o);
        let mut name = "deadline".to_owned();
        if orders.len() > 1 {
            name = format!("{name}-{}", order.as_str());
        }
        let spec = |slots: SlotCount, estimate: EstimateArg| {
            let mut name = name.clone();
            if slot_list.len() > 1 {
                name = format!("{name} slots={slots}");
            }
            if estimates.len() > 1 {
                name = format!("{name} {}", estimate.as_str());
            }
            RunSpec {
                name,
                policy: Arc::new(DeadlineChecks),
                order,
                slots,
                estimate,
            }
        };
        // Every slot count with the first estimator, then the other estimators at the
        // first slot count.
        deadline_runs.extend(slot_list.iter().map(|&n| spec(n, estimates[0])));
        deadline_runs.extend(estimates[1..].iter().map(|&e| spec(slot_list[0], e)));
    }
    let first_order = BufferOrder::from(orders[0]);
    let reference = |name: &str, policy: Arc<dyn Dispatch>| RunSpec {
        name: name.to_owned(),
        policy,
        order: first_order,
        slots: slot_list[0],
        estimate: estimates[0],
    };
    let policies: Vec<RunSpec> = match a.policy {
        PolicyArg::All => deadline_runs
            .into_iter()
            .chain([
                reference("receipt-only", Arc::new(ReceiptOnly)),
                reference("naive", Arc::new(Naive)),
            ])
            .collect(),
        PolicyArg::Deadline => deadline_runs,
        PolicyArg::ReceiptOnly => vec![reference("receipt-only", Arc::new(ReceiptOnly))],
        PolicyArg::Naive => vec![reference("naive", Arc::new(Naive))],
    };
    let mut results = Vec::new();
    let mut setups = Vec::new();
    let mut celery_results = Vec::new();
    let (mut celery_system, mut celery_prefetch) = (String::new(), 0);
    for &overload in &a.overload {
        let tenants = match &a.tenants {
            Some(spec) => crate::sim::parse_tenants(spec, overload)?,
            None => Vec::new(),
        };
        // Named tenants' rates are their own; `zipf:N` sums to this overload.
        let overload = if tenants.is_empty() {
            overload
        } else {
            tenants.iter().map(|t| t.rate).sum()
        };
        let setup = Setup {
            slots: nominal,
            workers: a.workers,
            tenants: a.tenants.clone(),
            service: match &a.openai_url {
                Some(url) => format!("{} at {url}", a.service),
                None => a.service.to_string(),
            },
            mean_service_ms: mean_ms,
            capacity_per_s: capacity,
            overload,
            arrival_per_s: capacity * overload,
            deadline_ms: a.deadline_ms.clone(),
            duration_s: a.duration_s,
            oracle: a.oracle,
            min_runtime_ms: a
                .oracle
                .then(|| a.min_runtime_ms.unwrap_or(mean_ms.round() as u64 + 20)),
            clock_uncertainty_ms: a.clock_uncertainty_ms,
            prefetch,
            ledger: a
                .ledger_url
                .clone()
                .unwrap_or_else(|| "fresh SQLite file per policy".into()),
            shed: !a.no_shed,
            ceiling: ceiling.clone(),
        };
        if !a.json {
            let workers = |joint: &str| match setup.workers {
                1 => String::new(),
                n => format!("{n} workers {joint} "),
            };
            println!(
                "bench goodput: {} = capacity {:.2} jobs/s; arrivals {:.2}/s ({}×{}) for {} s; deadline {} ms; {}; clock margin {} ms; prefetch {}; {} queues; buffer order {}; {}",
                match &setup.ceiling {
                    Some(c) => format!(
                        "{}{} at its ceiling ({} calls in flight, mean {:.0} ms); worker slots {}",
                        workers("at"),
                        setup.service,
                        c.concurrency,
                        c.mean_ms,
                        slot_list
                            .iter()
                            .map(SlotCount::to_string)
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    None => format!(
                        "{}{} slots × {} calls (mean {:.0} ms)",
                        workers("×"),
                        setup.slots,
                        setup.service,
                        mean_ms
                    ),
                },
                capacity,
                setup.arrival_per_s,
                setup.overload,
                match &setup.tenants {
                    Some(t) => format!(", tenants {t}"),
                    None => String::new(),
                },
                setup.duration_s,
                deadlines_label(&setup.deadline_ms),
                match setup.min_runtime_ms {
                    Some(m) => format!("ORACLE: min runtime {m} ms in the flags and every job"),
                    None => "worker defaults, no hint in the jobs (learned call time)".into(),
                },
                setup.clock_uncertainty_ms,
                match a.prefetch {
                    Some(p) => p.to_string(),
                    None => format!(
                        "the worker's default ({} with auto)",
                        lastcall_worker::default_prefetch(a.max_slots)
                    ),
                },
                a.queue_type,
                orders
                    .iter()
                    .map(|&o| BufferOrder::from(o).as_str())
                    .collect::<Vec<_>>()
                    .join(", "),
                if setup.shed {
                    "the producer sheds at the door (as lastcall submit does)"
                } else {
                    "no shedding at the door (--no-shed)"
                }
            );
        }
        for spec in &policies {
            let backend = model.as_ref().map(|m| m.backend.clone());
            results.push(run_policy(env, &a, &setup, &tenants, spec, backend).await?);
        }
        if let Some(plan) = &celery_plan {
            if !a.json {
                eprintln!(
                    "bench goodput: {} at {overload}×: {} (Celery's worker, {} s of arrivals, then its outcomes)",
                    celery::POLICY,
                    plan.script.display(),
                    a.duration_s
                );
            }
            let out = celery::run(plan, overload, ceiling.as_ref().map(|c| c.per_s)).await?;
            (celery_system, celery_prefetch) = (out.system, out.prefetch);
            celery_results.extend(out.results);
        }
        setups.push(setup);
    }
    let runs = runs_in_order(&results, policies.len(), &celery_results);
    let setup = setups[0].clone();
    let mut chart = None;
    if !a.no_svg {
        let series = runs.iter().map(Run::series).collect();
        let doc = line_chart(&Chart {
            title: format!(
                "On-time completions per second: {}{}, {} ms deadlines{}",
                match setup.ceiling {
                    Some(_) => String::new(),
                    None => format!("{} slots × ", setup.slots),
                },
                setup.service,
                deadlines_label(&setup.deadline_ms),
                if setup.oracle { " (oracle)" } else { "" }
            ),
            x_label: "seconds since the first submission".into(),
            y_label: "jobs completed before their deadline / s".into(),
            series,
            reference: Some(("capacity".into(), capacity)),
        })?;
        std::fs::write(&a.svg, doc)
            .with_context(|| format!("writing the chart to {}", a.svg.display()))?;
        chart = Some(a.svg.display().to_string());
    }

    if a.json {
        println!(
            "{}",
            serde_json::to_string_pretty(&json!({
                "bench": "goodput",
                "smoke": a.smoke,
                "setup": setup,
                "setups": setups,
                "machine": crate::machine(),
                "policies": results,
                "celery": celery_plan.as_ref().map(|p| json!({
                    "system": celery_system,
                    "script": p.script,
                    "prefetch": celery_prefetch,
                    "differs": p.differs,
                    "results": celery_results,
                })),
                "chart": chart,
            }))?
        );
        return Ok(ExitCode::SUCCESS);
    }
    println!();
    let rows: Vec<Vec<String>> = runs.iter().map(Run::table_row).collect();
    print!("{}", render(&COLUMNS, &rows));
    println!();
    for r in &runs {
        println!("{}", r.summary());
    }
    for r in &results {
        if r.tenants.len() < 2 {
            continue;
        }
        println!();
        println!(
            "{} at {}×, per tenant (the first 20):",
            r.policy, r.overload
        );
        let rows: Vec<Vec<String>> = (r.tenants.iter().take(20))
            .map(|t| {
                vec![
                    t.name.clone(),
                    t.offered.to_string(),
                    t.shed_at_door.to_string(),
                    t.on_time.to_string(),
                    format!("{:.1}%", t.on_time_share * 100.0),
                ]
            })
            .collect();
        print!(
            "{}",
            render(
                &["tenant", "offered", "shed", "on_time", "of_its_offered"],
                &rows
            )
        );
        if let Some(j) = r.jain {
            println!("Jain's fairness index (on time ÷ max-min fair share): {j:.3}");
        }
    }
    if let Some(p) = &celery_plan {
        println!(
            "{}: {celery_system} via {} with the same service, overloads, duration, deadlines and slots; differs: {}",
            celery::POLICY,
            p.script.display(),
            p.differs.join("; ")
        );
    }
    if let Some(c) = chart {
        println!("chart: {c}");
    }
    Ok(ExitCode::SUCCESS)
}

/// The table's columns, for lastcall's rows and Celery's alike.
const COLUMNS: [&str; 18] = [
    "policy",
    "overload",
    "submitted",
    "shed",
    "on_time",
    "goodput",
    "of_arrivals",
    "late_done",
    "started_late",
    "finished_late",
    "wasted_calls",
    "wasted_time",
    "exp_not_started",
    "exp_before_recv",
    "deadline_exc",
    "other",
    "no_outcome",
    "dispatch_p99_ms",
];

/// One row of the table and one series of the chart.
#[derive(Debug, Clone, Copy)]
enum Run<'a> {
    Lastcall(&'a PolicyResult),
    Celery(&'a CeleryResult),
}

/// The runs as they ran: at each overload, lastcall's policies (`per_overload` results,
/// pushed overload by overload), then Celery's run when there is one.
fn runs_in_order<'a>(
    results: &'a [PolicyResult],
    per_overload: usize,
    celery: &'a [CeleryResult],
) -> Vec<Run<'a>> {
    let mut celery = celery.iter();
    let mut runs = Vec::new();
    for chunk in results.chunks(per_overload.max(1)) {
        runs.extend(chunk.iter().map(Run::Lastcall));
        runs.extend(celery.next().map(Run::Celery));
    }
    runs.extend(celery.map(Run::Celery));
    runs
}

impl Run<'_> {
    /// The cells under [`COLUMNS`]; `—` where Celery has no such thing (it sheds nothing
    /// at the door, cancels no call, records no other outcome).
    fn table_row(&self) -> Vec<String> {
        let pct = |x: f64| format!("{:.1}%", x * 100.0);
        match *self {
            Run::Lastcall(r) => {
                let n = |k: &str| r.outcomes.get(k).copied().unwrap_or(0);
                let named = [
                    "completed",
                    "expired_not_started",
                    "expired_before_receive",
                    "deadline_exceeded",
                ];
                let other =
                    r.outcomes.values().sum::<u64>() - named.iter().map(|k| n(k)).sum::<u64>();
                vec![
                    r.policy.clone(),
                    format!("{}×", r.overload),
                    r.submitted.to_string(),
                    r.shed_at_door.to_string(),
                    r.on_time.to_string(),
                    pct(r.goodput),
                    pct(r.on_time_of_arrivals),
                    r.completed_late.to_string(),
                    r.started_after_deadline.to_string(),
                    r.finished_after_deadline.to_string(),
                    r.wasted_calls.to_string(),
                    pct(r.wasted_model_time),
                    n("expired_not_started").to_string(),
                    n("expired_before_receive").to_string(),
                    n("deadline_exceeded").to_string(),
                    other.to_string(),
                    r.no_outcome.to_string(),
                    f1(r.dispatch.p99_ms),
                ]
            }
            // Celery never cancels a call: every late one ran to the end, so it finished
            // late and is the only wasted call.
            Run::Celery(c) => vec![
                celery::POLICY.to_owned(),
                format!("{}×", c.overload),
                c.submitted.to_string(),
                "—".into(),
                c.on_time.to_string(),
                pct(c.goodput),
                pct(c.on_time as f64 / (c.submitted + c.submit_errors).max(1) as f64),
                c.completed_late.to_string(),
                c.started_after_deadline.to_string(),
                c.completed_late.to_string(),
                c.model_calls.saturating_sub(c.on_time).to_string(),
                pct(c.wasted_model_time),
                (c.expired_at_receipt + c.expired_at_pool).to_string(),
                c.expired_in_broker.to_string(),
                "—".into(),
                "—".into(),
                c.no_outcome.to_string(),
                f1(c.dispatch_p99_ms),
            ],
        }
    }

    /// The chart's series: on-time completions per second, labelled with the goodput.
    fn series(&self) -> (String, Vec<f64>) {
        let (name, overload, goodput, per_s) = match *self {
            Run::Lastcall(r) => (r.policy.as_str(), r.overload, r.goodput, &r.on_time_per_s),
            Run::Celery(c) => (celery::POLICY, c.overload, c.goodput, &c.on_time_per_s),
        };
        (
            format!("{name} at {overload}× ({:.0}% goodput)", goodput * 100.0),
            per_s.iter().map(|n| *n as f64).collect(),
        )
    }

    /// The line under the table.
    fn summary(&self) -> String {
        match *self {
            Run::Lastcall(r) => format!(
                "{} at {}×: capacity bound {:.0} jobs over a {:.1} s window; model calls {} (ledger {}), {:.0} ms on average, {:.1} in flight on average (slots busy {:.1}%), on time {:.1}% of the bound at that mean; outcomes {}",
                r.policy,
                r.overload,
                r.capacity_bound,
                r.window_s,
                r.model_calls,
                r.model_calls_ledger,
                r.mean_call_ms,
                r.mean_in_flight,
                r.slots_busy * 100.0,
                r.goodput_at_mean_call * 100.0,
                r.outcomes
                    .iter()
                    .map(|(k, v)| format!("{k}={v}"))
                    .collect::<Vec<_>>()
                    .join(" ")
            ),
            Run::Celery(c) => format!(
                "{} at {}×: capacity bound {:.0} jobs over a {:.1} s window; model calls {}; expired in the broker {}, at receipt {}, at the pool {}",
                celery::POLICY,
                c.overload,
                c.capacity_bound,
                c.window_s,
                c.model_calls,
                c.expired_in_broker,
                c.expired_at_receipt,
                c.expired_at_pool
            ),
        }
    }
}

#[allow(clippy::too_many_arguments)]
async fn run_policy(
    env: &Env,
    a: &GoodputArgs,
    setup: &Setup,
    tenants: &[crate::sim::TenantSpec],
    spec: &RunSpec,
    model: Option<Arc<dyn Backend>>,
) -> Result<PolicyResult> {
    let (name, policy, order) = (spec.name.as_str(), spec.policy.clone(), spec.order);
    // Job ids and queue names carry no spaces.
    let tag = name.replace([' ', '='], "-");
    let name = tag.as_str();
    let label = spec.name.as_str();
    let nonce = format!("{:x}", env.clock.now_ms());
    let name_o = format!("{label} at {}×", setup.overload);
    let prefix = format!("{}-bench-{name}-{nonce}", env.prefix);
    let broker = Broker::connect(&env.amqp_url).await?;
    let (ledger_url, dir) = match &a.ledger_url {
        Some(u) => (u.clone(), None),
        None => {
            let d = crate::temp_dir(name, &*env.clock)?;
            (
                format!("sqlite://{}", d.join("ledger.db").display()),
                Some(d),
            )
        }
    };
    let ledger = crate::open_ledger(&ledger_url).await?;
    // The fixed slots, or the most calls `auto` may run.
    let slots = match spec.slots {
        SlotCount::Fixed(n) => n,
        SlotCount::Auto => a.max_slots,
    };
    let mut cfg = WorkerConfig::new(&prefix, slots);
    cfg.name = format!("bench-{name}");
    if spec.slots == SlotCount::Auto {
        cfg.auto_slots = Some(LimitConfig::new(a.max_slots));
    }
    cfg.service_time.request_aware = spec.estimate == EstimateArg::Request;
    cfg.tenant_weights = (tenants.iter())
        .filter(|t| t.weight != 1)
        .map(|t| (t.name.clone(), t.weight))
        .collect();
    // The worker's default (with auto, of the most slots).
    cfg.prefetch = a
        .prefetch
        .unwrap_or(lastcall_worker::default_prefetch(slots));
    cfg.topology.queue_type = a.queue_type.parse().map_err(anyhow::Error::msg)?;
    cfg.shutdown_grace = Duration::from_secs(5);
    cfg.policy.dispatch = policy;
    cfg.buffer_order = order;
    // The worker's defaults (what `lastcall worker` runs with), unless the oracle tells
    // it the call time.
    cfg.policy.admission = AdmissionPolicy {
        clock_uncertainty_ms: setup.clock_uncertainty_ms,
        default_min_runtime_ms: setup.min_runtime_ms.unwrap_or(0),
    };
    let topo = cfg.topology.clone();
    let clock = env.clock.clone();
    // Each job carries its drawn call time for the sim backend (`sim_latency_ms`); the
    // worker never reads it.
    let sim = Arc::new(SimBackend::new(SimConfig {
        latency_ms: setup.mean_service_ms.round() as u64,
        ..SimConfig::default()
    })?);
    let dist = a.service;
    let backend: Arc<dyn Backend> = match &model {
        Some(m) => m.clone(),
        None => sim.clone(),
    };
    let stop = CancellationToken::new();
    let mut worker_tasks = Vec::new();
    for k in 0..setup.workers {
        let mut cfg = cfg.clone();
        if setup.workers > 1 {
            cfg.name = format!("bench-{name}-{k}");
        }
        let worker = Worker::build(
            cfg,
            Broker::connect(&env.amqp_url).await?,
            ledger.clone(),
            backend.clone(),
            clock.clone(),
            Arc::new(WorkerStats::default()),
        )
        .await?;
        worker_tasks.push(tokio::spawn(worker.run(stop.clone())));
    }
    let dlq_task = crate::spawn_dead_letters(
        Broker::connect(&env.amqp_url).await?,
        ledger.clone(),
        topo.clone(),
        clock.clone(),
        stop.clone(),
    )
    .await?;

    // The submitter records nothing in the ledger: the ledger load is the worker's (and
    // the dead-letter processor's) alone; the submitted count comes from the confirms.
    let publisher = Publisher::new(&broker, Duration::from_secs(5)).await?;
    let submitter = Submitter::new(
        publisher.clone(),
        topo.names.clone(),
        None,
        AdmissionPolicy {
            clock_uncertainty_ms: setup.clock_uncertainty_ms,
            default_min_runtime_ms: 0,
        },
        EnvelopeLimits::default(),
    )
    .with_shedder(setup.shed.then(|| {
        Arc::new(
            Shedder::new(
                Management::from_amqp_url(&env.amqp_url, &a.management_url),
                topo.names.work_queue.clone(),
            )
            .with_ledger(Some(ledger.clone()))
            .with_live_depth(publisher),
        )
    }));
    let total = (setup.arrival_per_s * setup.duration_s).round().max(1.0) as u64;
    let bar = crate::bar(total, &format!("{name_o}: submitting"));
    if a.json {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let gap = Duration::from_secs_f64(1.0 / setup.arrival_per_s);
    let mut tick = tokio::time::interval(gap);
    let mut pubs = JoinSet::new();
    let first_ms = env.clock.now_ms();
    // The last deadline of any job offered, shed at the door or not: the window (and so
    // the capacity bound) covers the whole offered load.
    let mut offered_until = first_ms;
    // Each job's tenant, drawn by rate.
    let cum: Vec<f64> = (tenants.iter())
        .scan(0.0, |s, t| {
            *s += t.rate;
            Some(*s)
        })
        .collect();
    let mut who = Vec::with_capacity(total as usize);
    for i in 0..total {
        tick.tick().await;
        let deadline_ms = setup.deadline_ms[rand::random_range(0..setup.deadline_ms.len())];
        let (payload, prompt_tokens) = match dist {
            ServiceDist::SmolLm2 => (model_payload(), 0),
            ServiceDist::SmolLm2Mixed => mixed_payload(&mut rand::rng()),
            _ => {
                let call_ms = dist.draw(1.0 - rand::random::<f64>(), rand::random::<f64>());
                let p = json!({"messages": [{"role": "user", "content": "bench"}], "sim_latency_ms": call_ms});
                (p, 0)
            }
        };
        let kind = match spec.estimate {
            EstimateArg::SplitKinds if prompt_tokens < SPLIT_TOKENS => "bench.goodput.short",
            EstimateArg::SplitKinds => "bench.goodput.long",
            _ => "bench.goodput",
        };
        let job = NewJob {
            job_id: Some(format!("b-{name}-{nonce}-{i}")),
            kind: kind.into(),
            payload: payload.as_object().cloned().expect("object"),
            deadline: DeadlineSpec::RelativeMs(deadline_ms),
            min_runtime_ms: setup.min_runtime_ms,
            trace_id: None,
        };
        let sub = submitter.clone();
        let now = env.clock.now_ms();
        offered_until = offered_until.max(now + deadline_ms as i64);
        let tenant = (!tenants.is_empty()).then(|| {
            let x = rand::random::<f64>() * cum[cum.len() - 1];
            cum.partition_point(|c| *c <= x).min(tenants.len() - 1)
        });
        who.push(tenant.unwrap_or(0));
        let named = tenant.map(|k| {
            let t = &tenants[k];
            let tenant = lastcall_core::Tenant::parse(&t.name).expect("parse_tenants checked it");
            (tenant, t.priority)
        });
        pubs.spawn(async move {
            let t0 = std::time::Instant::now();
            let r = match named {
                None => sub.submit(&job, now).await,
                Some((tenant, priority)) => match sub.envelope(&job, now) {
                    Ok(e) => {
                        let e = e.with_tenant(tenant).with_priority(priority);
                        sub.submit_envelope(&e, None, now).await
                    }
                    Err(e) => Err(e),
                },
            };
            (
                i,
                r.is_ok(),
                matches!(r, Err(SubmitError::WouldExpireInQueue(_))),
                t0.elapsed().as_micros() as u64,
            )
        });
        bar.inc(1);
    }
    // Wait for every confirm; a refused publish is an error of the run, not a job.
    let mut failed = std::collections::HashSet::new();
    let mut shed_at_door = 0u64;
    let mut rows: Vec<TenantRow> = (tenants.iter())
        .map(|t| TenantRow {
            name: t.name.clone(),
            ..TenantRow::default()
        })
        .collect();
    for &k in &who {
        if let Some(row) = rows.get_mut(k) {
            row.offered += 1;
        }
    }
    // How long the door took for each published job: the shed check and the publish
    // until its confirm.
    let mut door_us = Vec::with_capacity(total as usize);
    while let Some(r) = pubs.join_next().await {
        let (i, ok, shed, us) = r?;
        if ok {
            door_us.push(us);
        }
        if !ok {
            failed.insert(i);
            shed_at_door += u64::from(shed);
            if let (true, Some(row)) = (shed, rows.get_mut(who[i as usize])) {
                row.shed_at_door += 1;
            }
        }
    }
    let submit_errors = failed.len() as u64 - shed_at_door;
    if !a.json {
        let door = Percentiles::from_us(door_us);
        bar.suspend(|| {
            println!(
                "{name_o}: the door (shed check, publish, confirm) for {} published jobs: p50 {:.1} ms, p99 {:.1} ms, max {:.1} ms",
                door.count, door.p50_ms, door.p99_ms, door.max_ms
            )
        });
    }
    let submitted: Vec<String> = (0..total)
        .filter(|i| !failed.contains(i))
        .map(|i| format!("b-{name}-{nonce}-{i}"))
        .collect();
    let last_deadline =
        env.clock.now_ms() + setup.deadline_ms.iter().max().copied().unwrap_or(0) as i64;

    bar.set_message(format!("{name_o}: outcomes"));
    bar.set_position(0);
    let give_up = last_deadline + 3_000 + (setup.mean_service_ms * 10.0) as i64;
    let mut recs: Vec<JobRecord>;
    loop {
        recs = ledger
            .list(&ListFilter {
                limit: Some(total as i64 * 2 + 1_000),
                ..ListFilter::default()
            })
            .await?
            .into_iter()
            .filter(|r| r.job_id.starts_with(&format!("b-{name}-{nonce}-")))
            .collect();
        let done = recs.iter().filter(|r| is_terminal(&r.state)).count() as u64;
        bar.set_position(done);
        if done >= submitted.len() as u64 || env.clock.now_ms() > give_up {
            break;
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    bar.finish_and_clear();
    stop.cancel();
    for t in worker_tasks {
        let _ = t.await;
    }
    let _ = dlq_task.await;
    let _ = topo.delete(&broker).await;
    broker.close().await;
    ledger.close().await;
    if let Some(d) = dir {
        let _ = std::fs::remove_dir_all(d);
    }

    // Jobs whose publish failed have no record at all and were never in the queue.
    let recorded: std::collections::HashSet<&str> =
        recs.iter().map(|r| r.job_id.as_str()).collect();
    let missing = submitted
        .iter()
        .filter(|id| !recorded.contains(id.as_str()))
        .count() as u64;
    let mut outcomes = BTreeMap::new();
    let (mut on_time, mut late, mut started_late, mut finished_late, mut wasted) = (0, 0, 0, 0, 0);
    let mut calls_ledger = 0u64;
    let (mut model_ms, mut wasted_ms) = (0i64, 0i64);
    let mut dispatch_us = Vec::new();
    let window_end = recs
        .iter()
        .filter_map(|r| r.expires_at_ms)
        .max()
        .unwrap_or(last_deadline)
        .max(offered_until);
    let window_s = ((window_end - first_ms) as f64 / 1000.0).max(0.001);
    let mut per_s = vec![0u64; window_s.ceil() as usize + 1];
    let mut no_outcome = missing;
    for r in &recs {
        if !is_terminal(&r.state) {
            no_outcome += 1;
            continue;
        }
        *outcomes.entry(r.state.clone()).or_insert(0u64) += 1;
        calls_ledger += r.backend_calls.max(0) as u64;
        let exp = r.expires_at_ms.unwrap_or(i64::MAX);
        let in_time = r.finished_at_ms.is_some_and(|f| f <= exp);
        if r.state == "completed" {
            if in_time {
                on_time += 1;
                let i = (r.job_id.rsplit('-').next()).and_then(|i| i.parse::<usize>().ok());
                if let Some(row) = i.and_then(|i| who.get(i)).and_then(|&k| rows.get_mut(k)) {
                    row.on_time += 1;
                }
                let f = r.finished_at_ms.unwrap_or(first_ms);
                let b = (((f - first_ms).max(0)) / 1000) as usize;
                if b < per_s.len() {
                    per_s[b] += 1;
                }
            } else {
                late += 1;
            }
        }
        if r.backend_calls > 0 {
            let ms = r.latency_ms.unwrap_or(0).max(0);
            model_ms += ms;
            if r.state == "deadline_exceeded" {
                wasted_ms += ms;
            }
            if r.started_at_ms.is_some_and(|st| st > exp) {
                started_late += 1;
            }
            if r.finished_at_ms.is_some_and(|f| f > exp) {
                finished_late += 1;
            }
            if !(r.state == "completed" && in_time) {
                wasted += r.backend_calls.max(0) as u64;
            }
            if let (Some(rc), Some(st)) = (r.received_at_ms, r.started_at_ms) {
                dispatch_us.push(((st - rc).max(0) as u64) * 1000);
            }
        }
    }
    for row in &mut rows {
        row.on_time_share = row.on_time as f64 / row.offered.max(1) as f64;
    }
    let jain = (rows.len() > 1).then(|| {
        let demands: Vec<f64> = rows.iter().map(|r| r.offered as f64).collect();
        let fair = crate::sim::max_min_shares(&demands, on_time as f64);
        let x: Vec<f64> = (rows.iter().zip(&fair))
            .filter(|(_, f)| **f > 0.0)
            .map(|(r, f)| r.on_time as f64 / f)
            .collect();
        crate::sim::jain(&x)
    });
    // Shed jobs were offered too: they count towards the bound like published ones.
    let bound =
        (setup.capacity_per_s * window_s).min((submitted.len() as u64 + shed_at_door) as f64);
    let mean_call_ms = model_ms as f64 / calls_ledger.max(1) as f64;
    let slot_ms = (setup.workers * slots) as f64 * window_s * 1000.0;
    let offered = (submitted.len() as u64 + shed_at_door) as f64;
    // At this run's own mean call: the slots kept busy with calls of that length, or the
    // server's ceiling scaled by how this run's calls compare with the ceiling's.
    let bound_at_mean = match &setup.ceiling {
        Some(c) => setup.capacity_per_s * window_s * c.mean_ms / mean_call_ms.max(1.0),
        None => slot_ms / mean_call_ms.max(1.0),
    }
    .min(offered);
    Ok(PolicyResult {
        slots: spec.slots.to_string(),
        estimate: spec.estimate.as_str().to_owned(),
        on_time_of_arrivals: on_time as f64 / (offered + submit_errors as f64).max(1.0),
        mean_in_flight: model_ms as f64 / (window_s * 1000.0),
        mean_call_ms,
        slots_busy: model_ms as f64 / slot_ms.max(1.0),
        goodput_at_mean_call: if model_ms > 0 {
            on_time as f64 / bound_at_mean.max(1.0)
        } else {
            0.0
        },
        policy: label.to_owned(),
        overload: setup.overload,
        model_time_s: model_ms as f64 / 1000.0,
        wasted_model_time: wasted_ms as f64 / (model_ms.max(1) as f64),
        submitted: submitted.len() as u64,
        submit_errors,
        shed_at_door,
        outcomes,
        no_outcome,
        on_time,
        completed_late: late,
        capacity_bound: bound,
        window_s,
        goodput: on_time as f64 / bound.max(1.0),
        // The embedded model counts no calls of its own: the ledger's count stands.
        model_calls: if model.is_some() {
            calls_ledger
        } else {
            sim.calls()
        },
        model_calls_ledger: calls_ledger,
        started_after_deadline: started_late,
        finished_after_deadline: finished_late,
        wasted_calls: wasted,
        dispatch: Percentiles::from_us(dispatch_us),
        on_time_per_s: per_s,
        tenants: rows,
        jain,
    })
}

/// The prompts of `--service smollm2`: different lengths and tasks.
const PROMPTS: &[&str] = &[
    "Summarize: the database primary failed over to the replica at 03:12 and writes resumed after 40 seconds.",
    "Write a haiku about a queue.",
    "List three causes of high latency in a web service.",
    "Explain in one sentence what a deadline is.",
    "Translate to French: the job finished on time.",
    "What is 17 times 23? Answer briefly.",
];

/// One job for the embedded model: a drawn prompt and output length (4–24 tokens).
fn model_payload() -> serde_json::Value {
    let prompt = PROMPTS[rand::random_range(0..PROMPTS.len())];
    let max_tokens = rand::random_range(4..=24u32);
    json!({"messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens})
}

/// `--service smollm2-mixed`: prompts of this many tokens at least …
const MIXED_MIN_TOKENS: f64 = 30.0;
/// … and at most (log-uniform in between: as many prompts under 250 tokens as over).
const MIXED_MAX_TOKENS: f64 = 2_000.0;
/// `--estimate split-kinds`: prompts of fewer tokens are the kind `short`, the others
/// `long` (the geometric middle of the range).
const SPLIT_TOKENS: u64 = 245;
/// The text the mixed prompts are cut from (English prose: about 4 characters a token,
/// the approximation the worker's request size uses). `bench/celery/goodput.py` has the
/// same text and draws.
const FILLER: &str = "The on-call engineer was paged at night because the checkout service \
returned errors for a growing share of requests. The dashboards showed the database primary \
at full CPU while the replicas were idle, and the connection pool of every web server was \
exhausted. A deploy earlier that evening had added a query without an index on the orders \
table, and each retry of a failed request made the load worse. The team rolled the deploy \
back, added the index during a quiet period, and raised the alert threshold for the pool. \
Customers saw slow pages for about forty minutes and some payments had to be retried by \
hand. ";

/// One job of the mixed-length workload: a prompt of a drawn length (log-uniform in
/// [`MIXED_MIN_TOKENS`, `MIXED_MAX_TOKENS`], at 4 characters a token) and a drawn
/// `max_tokens` (4–64), and the prompt's length in tokens. Each prompt starts with its own
/// ticket number and at its own place in the text, so a server's prompt cache cannot reuse
/// an earlier prompt's prefix.
fn mixed_payload(rng: &mut impl rand::Rng) -> (serde_json::Value, u64) {
    let lo = MIXED_MIN_TOKENS.ln();
    let tokens = (lo + rng.random::<f64>() * (MIXED_MAX_TOKENS.ln() - lo))
        .exp()
        .round() as u64;
    let max_tokens = rng.random_range(4..=64u32);
    let ticket = rng.random_range(10_000..100_000u32);
    let offset = rng.random_range(0..FILLER.len());
    let head = format!("Ticket {ticket}. Summarize these incident notes in one sentence.\n\n");
    let want = (tokens as usize * 4).saturating_sub(head.len()).max(1);
    let mut body = String::with_capacity(want + FILLER.len());
    // From a char boundary at or after `offset` (the text is ASCII: every byte is one).
    body.push_str(&FILLER[offset..]);
    while body.len() < want {
        body.push_str(FILLER);
    }
    body.truncate(want);
    let content = format!("{head}{body}");
    (
        json!({"messages": [{"role": "user", "content": content}], "max_tokens": max_tokens}),
        tokens,
    )
}

/// A job of `service` for the model (`smollm2` or `smollm2-mixed`).
fn payload_of(service: ServiceDist) -> serde_json::Value {
    match service {
        ServiceDist::SmolLm2Mixed => mixed_payload(&mut rand::rng()).0,
        _ => model_payload(),
    }
}

/// The model, loaded once (or its server, measured once), and its mean call time: with
/// every slot busy for the embedded model; at the server's ceiling for a server.
struct Model {
    backend: Arc<dyn Backend>,
    mean_ms: f64,
    /// With `--openai-url`.
    ceiling: Option<Ceiling>,
}

/// Load SmolLM2 with one instance per slot and measure its mean call time: every slot
/// runs one warm-up call, then four measured calls with drawn jobs. With `--openai-url`,
/// reach the server that serves it and measure its ceiling ([`ceiling`]).
async fn smollm2(a: &GoodputArgs, slots: usize) -> Result<Model> {
    if let Some(url) = &a.openai_url {
        let backend: Arc<dyn Backend> = Arc::new(
            lastcall_openai::OpenAiBackend::new(lastcall_openai::OpenAiConfig::new(
                url,
                &a.openai_model,
            ))
            .with_context(|| format!("--openai-url {url}"))?,
        );
        // The smoke run: 1 s at 1 and 2 calls in flight (a long prompt on a loaded machine
        // takes tens of seconds at 4).
        let (secs, most) = if a.smoke {
            (1.0, 2)
        } else {
            (a.ceiling_s.max(1.0), 16)
        };
        let c = ceiling(&backend, a.service, secs, most, a.json).await?;
        eprintln!(
            "bench goodput: {} at {url}: ceiling {:.2} completions/s with {} calls in flight (mean call {:.0} ms); levels {}",
            a.service,
            c.per_s,
            c.concurrency,
            c.mean_ms,
            (c.levels.iter())
                .map(|(n, r, m)| format!("{n}: {r:.2}/s at {m:.0} ms"))
                .collect::<Vec<_>>()
                .join(", ")
        );
        return Ok(Model {
            backend,
            mean_ms: c.mean_ms,
            ceiling: Some(c),
        });
    }
    let backend = crate::local_model(a.model_path.as_deref(), slots)?;
    let service = a.service;
    let lanes = (0..slots).map(|lane| {
        let b = backend.clone();
        async move {
            let mut ms = Vec::new();
            for n in 0..5 {
                let req = lastcall_backend::CallRequest {
                    job_id: format!("calibrate-{lane}-{n}"),
                    kind: "bench.goodput".into(),
                    attempt: 0,
                    payload: payload_of(service).as_object().cloned().expect("object"),
                    timeout: Duration::from_secs(300),
                    priority: lastcall_core::Priority::Standard,
                };
                let t = std::time::Instant::now();
                b.call(req, CancellationToken::new())
                    .await
                    .context("a calibration call of the model failed")?;
                if n > 0 {
                    ms.push(t.elapsed().as_secs_f64() * 1000.0);
                }
            }
            anyhow::Ok(ms)
        }
    });
    let mut all = Vec::new();
    for r in futures_util::future::join_all(lanes).await {
        all.extend(r?);
    }
    let mean_ms = all.iter().sum::<f64>() / all.len().max(1) as f64;
    eprintln!(
        "bench goodput: {service} (embedded), {slots} slots: mean call {mean_ms:.0} ms over {} calls with every slot busy",
        all.len(),
    );
    Ok(Model {
        backend,
        mean_ms: mean_ms.max(1.0),
        ceiling: None,
    })
}

/// A model server's ceiling: `n` = 1, 2, 4, … calls kept in flight for `secs` each, with
/// no deadlines (a saturating client), until the completions per second stop rising
/// (below the best so far, or `most` in flight). A call still running at the end of its
/// period counts for the share of it that fell inside.
async fn ceiling(
    backend: &Arc<dyn Backend>,
    service: ServiceDist,
    secs: f64,
    most: usize,
    quiet: bool,
) -> Result<Ceiling> {
    let call = |b: Arc<dyn Backend>, id: String| async move {
        let req = lastcall_backend::CallRequest {
            job_id: id,
            kind: "bench.goodput".into(),
            attempt: 0,
            payload: payload_of(service).as_object().cloned().expect("object"),
            timeout: Duration::from_secs(300),
            priority: lastcall_core::Priority::Standard,
        };
        b.call(req, CancellationToken::new())
            .await
            .context("a call of the server's ceiling failed")
    };
    // One warm-up call: the first may load the model's weights.
    call(backend.clone(), "ceiling-warm-up".into()).await?;
    let mut levels: Vec<(usize, f64, f64)> = Vec::new();
    let mut n = 1;
    loop {
        let bar = crate::bar(secs.ceil() as u64, &format!("ceiling: {n} in flight"));
        if quiet {
            bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
        }
        let t0 = std::time::Instant::now();
        let period = Duration::from_secs_f64(secs);
        let lanes = (0..n).map(|lane| {
            let b = backend.clone();
            async move {
                // (completions inside the period, incl. shares, sum of call ms, calls)
                let (mut done, mut ms, mut calls) = (0.0f64, 0.0f64, 0u64);
                let mut k = 0;
                while t0.elapsed() < period {
                    let start = t0.elapsed();
                    call(b.clone(), format!("ceiling-{n}-{lane}-{k}")).await?;
                    let end = t0.elapsed();
                    let took = (end - start).as_secs_f64();
                    ms += took * 1000.0;
                    calls += 1;
                    done += if end <= period {
                        1.0
                    } else {
                        (period - start).as_secs_f64() / took.max(1e-9)
                    };
                    k += 1;
                }
                anyhow::Ok((done, ms, calls))
            }
        });
        let ticker = {
            let bar = bar.clone();
            tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(500)).await;
                    bar.set_position(t0.elapsed().as_secs());
                }
            })
        };
        let results = futures_util::future::join_all(lanes).await;
        ticker.abort();
        bar.finish_and_clear();
        let (mut done, mut ms, mut calls) = (0.0, 0.0, 0u64);
        for r in results {
            let (d, m, c) = r?;
            (done, ms, calls) = (done + d, ms + m, calls + c);
        }
        let rate = done / secs;
        levels.push((n, rate, ms / calls.max(1) as f64));
        let best = levels.iter().map(|l| l.1).fold(0.0, f64::max);
        if rate < best || n >= most {
            break;
        }
        n *= 2;
    }
    let &(concurrency, per_s, mean_ms) = levels
        .iter()
        .max_by(|x, y| x.1.total_cmp(&y.1))
        .expect("one level at least");
    if per_s <= 0.0 {
        bail!("the server completed no call while its ceiling was measured");
    }
    Ok(Ceiling {
        per_s,
        concurrency,
        mean_ms: mean_ms.max(1.0),
        levels,
    })
}

/// `2000`, or `500|2000|8000` for a mix.
fn deadlines_label(d: &[u64]) -> String {
    d.iter().map(u64::to_string).collect::<Vec<_>>().join("|")
}

fn is_terminal(state: &str) -> bool {
    state.parse::<State>().is_ok_and(State::is_terminal)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `run.sh --json --service fixed:100 --duration-s 2 --deadline-ms 500,1000 --overload
    /// 2,5`: the 2× run as goodput.py printed it (fewer line breaks), the 5× run made up.
    const CELERY_JSON: &str = r#"{
  "bench": "goodput",
  "system": "celery 5.7.0",
  "slots": 4,
  "deadline_ms": [500, 1000],
  "duration_s": 2.0,
  "prefetch": 8,
  "results": [
    {
      "service": "fixed:100", "pool": "prefork", "overload": 2.0, "arrival_per_s": 80.0,
      "submit_s": 1.990117850000388, "submitted": 160, "submit_errors": 0, "on_time": 98,
      "capacity_bound": 119.04606445312498, "window_s": 2.976151611328125,
      "goodput": 0.8232107499747546, "completed_late": 4, "started_after_deadline": 0,
      "model_calls": 102, "model_time_s": 10.257009765625,
      "wasted_model_time": 0.039272732500582205, "expired_in_broker": 24,
      "expired_at_receipt": 2, "expired_at_pool": 32, "no_outcome": 0,
      "dispatch_p99_ms": 210.66357421875,
      "on_time_per_s": [29, 39, 30, 0]
    },
    {
      "service": "fixed:100", "pool": "prefork", "overload": 5.0, "arrival_per_s": 200.0,
      "submit_s": 2.01, "submitted": 400, "submit_errors": 0, "on_time": 60,
      "capacity_bound": 119.0, "window_s": 2.98, "goodput": 0.504, "completed_late": 40,
      "started_after_deadline": 2, "model_calls": 100, "model_time_s": 10.1,
      "wasted_model_time": 0.4, "expired_in_broker": 200, "expired_at_receipt": 60,
      "expired_at_pool": 40, "no_outcome": 0, "dispatch_p99_ms": 250.0,
      "on_time_per_s": [20, 25, 15, 0]
    }
  ]
}"#;

    fn policy(name: &str, overload: f64) -> PolicyResult {
        PolicyResult {
            policy: name.into(),
            overload,
            submitted: 10,
            on_time: 7,
            goodput: 0.5,
            on_time_per_s: vec![3, 4],
            ..PolicyResult::default()
        }
    }

    #[test]
    fn celery_runs_join_the_table_and_the_chart_after_lastcalls_at_each_overload() {
        let out = celery::parse(CELERY_JSON).unwrap();
        assert_eq!((out.system.as_str(), out.prefetch), ("celery 5.7.0", 8));
        let lastcall = [
            policy("deadline", 2.0),
            policy("naive", 2.0),
            policy("deadline", 5.0),
            policy("naive", 5.0),
        ];
        let runs = runs_in_order(&lastcall, 2, &out.results);
        let rows: Vec<Vec<String>> = runs.iter().map(Run::table_row).collect();
        let first: Vec<(&str, &str)> = rows
            .iter()
            .map(|r| (r[0].as_str(), r[1].as_str()))
            .collect();
        assert_eq!(
            first,
            [
                ("deadline", "2×"),
                ("naive", "2×"),
                ("celery-expires", "2×"),
                ("deadline", "5×"),
                ("naive", "5×"),
                ("celery-expires", "5×"),
            ]
        );
        assert!(rows.iter().all(|r| r.len() == COLUMNS.len()), "{rows:?}");
        // Filled where Celery has the same thing, `—` where it has none (shedding,
        // cancelling at the deadline, other outcomes).
        let cells: BTreeMap<&str, &str> = COLUMNS
            .iter()
            .copied()
            .zip(rows[2].iter().map(String::as_str))
            .collect();
        let expected = [
            ("submitted", "160"),
            ("shed", "—"),
            ("on_time", "98"),
            ("goodput", "82.3%"),
            ("late_done", "4"),
            ("started_late", "0"),
            ("finished_late", "4"),
            ("wasted_calls", "4"),
            ("wasted_time", "3.9%"),
            ("exp_not_started", "34"),
            ("exp_before_recv", "24"),
            ("deadline_exc", "—"),
            ("other", "—"),
            ("no_outcome", "0"),
            ("dispatch_p99_ms", "210.7"),
        ];
        for (column, value) in expected {
            assert_eq!(cells[column], value, "{column}: {cells:?}");
        }
        // One chart series per run, Celery's from its per-second on-time counts.
        let series: Vec<(String, Vec<f64>)> = runs.iter().map(Run::series).collect();
        assert_eq!(series.len(), 6);
        assert_eq!(series[2].0, "celery-expires at 2× (82% goodput)");
        assert_eq!(series[2].1, [29.0, 39.0, 30.0, 0.0]);
        assert_eq!(series[5].0, "celery-expires at 5× (50% goodput)");
        assert!(runs[5].summary().contains("at receipt 60, at the pool 40"));
        // --json carries Celery's results whole, fields the table does not read included.
        let j = serde_json::to_value(&out.results[0]).unwrap();
        assert_eq!(j["pool"], "prefork");
        assert_eq!(j["submit_s"], 1.990117850000388);
        assert_eq!(j["on_time_per_s"], json!([29, 39, 30, 0]));
    }

    #[test]
    fn celery_output_without_per_second_counts_is_refused() {
        let old = CELERY_JSON.replace(r#""on_time_per_s": [20, 25, 15, 0]"#, r#""x": 1"#);
        let e = celery::parse(&old).unwrap_err();
        assert!(format!("{e:#}").contains("on_time_per_s"), "{e:#}");
    }

    #[test]
    fn celery_runs_with_lastcalls_parameters_and_says_what_differs() {
        let scenario = |service, prefetch| celery::Scenario {
            service,
            slots: 4,
            deadline_ms: &[500, 2000],
            duration_s: 2.5,
            prefetch,
            shed: false,
            edf: false,
            oracle: false,
            openai: None,
        };
        let url = "amqp://guest:guest@127.0.0.1:5672/%2f,amqp://b:5672";
        // Found from the current directory (the crate's, in a test) upwards.
        let same = celery::plan(
            None,
            url,
            &scenario("lognormal:200,0.6".parse().unwrap(), 8),
        )
        .unwrap();
        assert!(same.script.ends_with("bench/celery/run.sh"), "{same:?}");
        assert_eq!(
            same.args,
            [
                "--json",
                "--service=lognormal:200,0.6",
                "--slots=4",
                "--deadline-ms=500,2000",
                "--duration-s=2.5",
                "--prefetch-multiplier=2",
            ]
        );
        assert_eq!(same.amqp_url, "amqp://guest:guest@127.0.0.1:5672/%2f");
        assert!(
            !same.differs.iter().any(|d| d.contains("prefetch")),
            "{same:?}"
        );
        let odd = celery::plan(None, url, &scenario(ServiceDist::Fixed { ms: 200 }, 6)).unwrap();
        assert!(odd.args.contains(&"--prefetch-multiplier=2".to_owned()));
        assert!(
            odd.differs.iter().any(|d| d.contains("prefetch 8")),
            "{odd:?}"
        );
        let e = celery::plan(None, url, &scenario(ServiceDist::SmolLm2, 8)).unwrap_err();
        assert!(e.to_string().contains("--service fixed"), "{e}");
        let missing = std::path::Path::new("/nonexistent/run.sh");
        let e = celery::plan(
            Some(missing),
            url,
            &scenario(ServiceDist::Fixed { ms: 200 }, 8),
        )
        .unwrap_err();
        assert!(e.to_string().contains("--celery-script"), "{e}");
    }
}
