//! `lastcall-bench`: measured numbers against the real broker and ledgers. Its own binary
//! (`src/main.rs`, built by the same workspace; `lastcall bench …` runs it), so that the
//! `lastcall` binary links none of it; nothing in the worker, the broker adapter or the
//! ingress depends on this crate. The binary parses the command line (the clap types here),
//! resolves the broker URL and prefix ([`settings`]) and calls [`run`].
//!
//! # Layout
//! - [`goodput`]: the headline: useful work under overload for the deadline policy and
//!   two reference policies (naive, receipt-only), with an SVG chart ([`chart`]).
//! - [`ack_modes`]: PerfTest-style runs of acknowledgement modes and prefetch, a consumer
//!   crash, and the worker pipeline as a fraction of a bare consumer, on the raw lapin
//!   loops of [`raw`].
//! - [`raw`]: a publisher and bare consumers on lapin itself, bypassing lastcall's broker
//!   adapter on purpose: they measure the broker's ceiling. With `lastcall-broker`, the
//!   only crate that knows lapin.
//! - [`ledger`]: outcome writes per second on SQLite and PostgreSQL.
//! - [`front_door`]: what the OpenAI-compatible front door adds to a model call.
//! - [`sim`]: a deterministic simulation of the scheduling rules (the core's decisions
//!   against a simulated broker, model server and clock), for fast, noise-free tuning.
//! - [`chart`]: the goodput line chart (`plotters`, SVG backend only).
//! - `celery`: `bench goodput --celery`, Celery 5.x through the same scenario
//!   (`bench/celery/run.sh`), in the same table and chart.
//! - [`settings`]: the binary's global options (broker URL, prefix, config file, logging),
//!   resolved as `lastcall` resolves them: flag > environment > `lastcall.toml` > default.
//!
//! Every bench command prints a table at the end, `--json` prints one JSON object instead,
//! and `--smoke` shrinks the run to a few seconds (for CI; numbers from it mean nothing).
//! Wall-clock instants come from the [`Env`]'s [`Clock`]; durations are measured with
//! [`std::time::Instant`].

pub mod ack_modes;
mod celery;
pub mod chart;
pub mod front_door;
pub mod goodput;
pub mod ledger;
pub mod raw;
pub mod reference;
pub mod settings;
pub mod sim;

use anyhow::{Context, Result};
use clap::{Args, Subcommand, ValueEnum};
use hdrhistogram::Histogram;
use indicatif::{ProgressBar, ProgressStyle};
use lastcall_backend::Backend;
use lastcall_clock::Clock;
use lastcall_core::concurrency::SlotCount;
use lastcall_store::Ledger;
use serde::Serialize;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;

/// What a run needs from the binary that starts it: where the broker is and the clock.
pub struct Env {
    /// The broker URL (one node, or a comma-separated list).
    pub amqp_url: String,
    /// The queue prefix; every run declares its own queues under it.
    pub prefix: String,
    /// Every wall-clock instant of a run (deadlines, job ids, outcome polls) comes from here.
    pub clock: Arc<dyn Clock>,
}

impl std::fmt::Debug for Env {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Env")
            .field("amqp_url", &lastcall_broker::redact(&self.amqp_url))
            .field("prefix", &self.prefix)
            .finish_non_exhaustive()
    }
}

/// The embedded model (`--service smollm2`) from a GGUF file (`None`: the one
/// `scripts/setup-model.sh` installed), one instance per slot on one copy of the weights,
/// as `lastcall worker --backend local` loads it.
#[cfg(feature = "local-model")]
pub(crate) fn local_model(path: Option<&Path>, slots: usize) -> Result<Arc<dyn Backend>> {
    let pool = lastcall_local::LocalPool::load_or_find(path, slots).map_err(anyhow::Error::msg)?;
    Ok(Arc::new(pool))
}

#[cfg(not(feature = "local-model"))]
pub(crate) fn local_model(_: Option<&Path>, _: usize) -> Result<Arc<dyn Backend>> {
    anyhow::bail!(
        "this lastcall-bench was built without the `local-model` feature; rebuild it with default features (or use --openai-url)"
    )
}

/// The commands of `lastcall-bench` (and of `lastcall bench`, which runs it).
#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// Useful work under overload: deadline policy vs naive vs receipt-only (the headline)
    ///
    /// An in-process worker with S model slots and the simulated backend at a fixed
    /// service time (capacity = S × 1000 / service_ms jobs/s) receives jobs at a multiple of
    /// that capacity, each with a deadline of D ms, for T seconds. For each policy it
    /// reports, from the ledger's timestamps:
    ///
    /// - goodput: jobs completed before their deadline, as a fraction of the capacity bound
    ///   (capacity × the run window, from the first submission to the last deadline);
    /// - model calls started after the job's deadline (lastcall's rule: always 0);
    /// - model calls that finished after the deadline (wasted work);
    /// - counts per outcome, which must add up to the jobs submitted.
    ///
    /// Policies: `deadline` (lastcall: check at receipt and right before the call),
    /// `receipt-only` (check at receipt only, as Celery does with `expires`), `naive` (no
    /// check). All publish the same way (broker TTL = remaining budget, a dead-letter
    /// processor records broker expiries); they differ only inside the worker. The
    /// reference policies exist for this benchmark only.
    ///
    /// Example: `lastcall bench goodput` (all three, about 45 s) writes bench-goodput.svg.
    Goodput(GoodputArgs),
    /// Acknowledgement modes and prefetch, a consumer crash, and the pipeline's share of the broker ceiling
    ///
    /// PerfTest-style runs against the real broker: one publisher with a confirm window and
    /// C bare consumers on one fresh queue; message size, queue type, durability, confirm
    /// window and consumer count are fixed and printed with the results. Modes: auto-ack;
    /// manual ack with prefetch 1, 4, 16, 64, 256, 1024; manual ack with prefetch N and one
    /// `multiple` ack every k deliveries. Reports consume throughput and publish→consume
    /// latency percentiles (HDR histogram).
    ///
    /// Crash variant: a slow consumer is killed mid-run (its connection drops without
    /// settling); with auto-ack the deliveries it held are lost, with manual ack the broker
    /// redelivers them. Baseline: N lastcall envelopes are submitted to the worker's own
    /// queue and drained by a bare consumer that only acks, once with `multiple` acks (the
    /// broker ceiling; the worker coalesces its acks too) and once with one ack per
    /// delivery; then lastcall's worker (sim backend at 0 ms, ledger writes included)
    /// drains N more, and its throughput is reported as a fraction of both. On Linux it
    /// also reports CPU from /proc: the broker's (the rest of the machine's) per message in
    /// the ceiling run, the worker's per job, and the most the worker may use per job for
    /// 80% of the ceiling to fit on this machine's cores.
    AckModes(ack_modes::AckModesArgs),
    /// Ledger throughput: outcome writes per second on SQLite and PostgreSQL
    ///
    /// Writes N terminal outcomes (the worker's last durable write before an ack) with W
    /// concurrent writers, and separately N full worker sequences (receipt lookup, the
    /// `running` row, the outcome, the ack mark). Every write is its own committed
    /// transaction, as "durable before ack" requires. SQLite uses a fresh file;
    /// PostgreSQL runs when --postgres-url is given (rows go to fresh job ids there).
    Ledger(ledger::LedgerArgs),
    /// The OpenAI-compatible front door's overhead over calling the model directly
    ///
    /// An in-process worker (sim backend) and `serve` on a real socket; requests to
    /// `POST /v1/chat/completions` one at a time (low load), each through the whole path
    /// (claim and confirmed publish, the worker's reads and writes, the outcome event, the
    /// waiter's read), against the same simulated model called directly. Prints both
    /// latency distributions and the overhead (their difference) at p50, p90 and p99.
    FrontDoor(front_door::FrontDoorArgs),
    /// A deterministic simulation of the scheduling rules: no broker, no clock, seconds
    ///
    /// The core's real decisions (receipt check with the expected wait, the buffer's latest
    /// useful start, the last check at a slot, the learned call time with its probes and
    /// request-aware fit) against a simulated broker queue (TTL, prefetch), model server
    /// (fixed, lognormal, length- and load-dependent, an optional hang) and clock, with
    /// one or more workers. The same seed gives the same outcomes; every run checks that
    /// no call starts after its deadline and that every job has exactly one outcome. It
    /// does not model the door's shedding, ledger or broker latency, redeliveries or
    /// retries, so its goodput is an upper bound of `bench goodput`'s.
    ///
    /// Example: `lastcall bench sim --service lognormal:200,0.6 --overload 10 --jobs 1000000`
    Sim(sim::SimArgs),
}

/// `lastcall bench goodput` options.
#[derive(Debug, Args)]
pub struct GoodputArgs {
    /// Model slots of the worker: `N`, or `auto` (as `lastcall worker --slots auto`: the
    /// calls in flight adapt in [1, --max-slots] to the model server; only with
    /// --openai-url). A comma-separated list runs lastcall's policy once per value, e.g.
    /// `auto,1,2,4,8` (a sweep: every run sees the same arrivals) [default: `auto` with
    /// --openai-url, as `lastcall worker --backend openai`; else 4]
    #[arg(long, value_delimiter = ',')]
    pub slots: Vec<SlotCount>,
    /// The most calls `--slots auto` runs at once (`lastcall worker --max-slots`)
    #[arg(long, default_value_t = 16)]
    pub max_slots: usize,
    /// Model call durations, drawn per job: `fixed:MS` or `lognormal:MEAN_MS,SIGMA` (the
    /// sim backend; a lognormal with that mean and shape σ), or a real model: `smollm2`,
    /// one of a few short prompts and a drawn `max_tokens` (4–24) per job, or
    /// `smollm2-mixed`, prompts of 30 to 2,000 tokens (log-uniform) and `max_tokens` 4–64
    /// (a mixed-length workload). A real model is the embedded SmolLM2 (needs
    /// `scripts/setup-model.sh`) or, with --openai-url, a model server; its capacity is
    /// measured first (the embedded model with every slot busy; a server's ceiling with a
    /// saturating client)
    #[arg(long, default_value = "fixed:200")]
    pub service: ServiceDist,
    /// How the worker learns call times: `request` (the worker's: an estimate per
    /// request, from its prompt and output tokens), `per-kind` (one estimate per kind,
    /// without the request's size; reference only), or `split-kinds` (one estimate per
    /// kind, with the jobs split by hand into the kinds `short` and `long` by prompt
    /// length, as a user who knew the model would do; `smollm2-mixed` only). A
    /// comma-separated list runs each, at the first --slots value
    #[arg(long, value_enum, value_delimiter = ',', default_value = "request")]
    pub estimate: Vec<EstimateArg>,
    /// With --openai-url: seconds per concurrency level (1, 2, 4, … until the throughput
    /// stops rising) of the server's ceiling, measured before the runs with a client that
    /// keeps that many calls in flight, no deadlines. The ceiling is the capacity that
    /// sets the arrival rates and the bound
    #[arg(long, default_value_t = 20.0)]
    pub ceiling_s: f64,
    /// The embedded model's GGUF file for `--service smollm2` [default: the one
    /// `scripts/setup-model.sh` installed]
    #[arg(long, env = "LASTCALL_MODEL_PATH")]
    pub model_path: Option<PathBuf>,
    /// With `--service smollm2`: send the jobs to this OpenAI-compatible server (streamed
    /// chat completions, the worker's `openai` backend) instead of the embedded model, e.g.
    /// llama.cpp's `llama-server` that `scripts/llama-server.sh start 8080` runs with
    /// SmolLM2-135M and continuous batching: `http://127.0.0.1:8080/v1`. Its capacity is
    /// measured first with every slot busy, as the embedded model's
    #[arg(long, value_name = "URL")]
    pub openai_url: Option<String>,
    /// The model name sent to --openai-url
    #[arg(long, default_value = "smollm2", value_name = "NAME")]
    pub openai_model: String,
    /// Arrival rates as multiples of capacity (slots × 1000 / mean call ms jobs/s); a
    /// comma-separated list runs each, e.g. `2,5,10`
    #[arg(long, value_delimiter = ',', default_value = "5")]
    pub overload: Vec<f64>,
    /// Each job's deadline, in ms after its submission; a comma-separated list draws one
    /// of them per job, uniformly (mixed deadlines, e.g. `500,2000,8000`)
    #[arg(long, value_delimiter = ',', default_value = "2000")]
    pub deadline_ms: Vec<u64>,
    /// The worker's local buffer order (`lastcall worker --buffer-order`); a
    /// comma-separated list runs lastcall's policy once per order, e.g. `edf,fifo`
    #[arg(long, value_enum, value_delimiter = ',', default_value = "edf")]
    pub order: Vec<BufferOrderArg>,
    /// How long jobs arrive, in seconds
    #[arg(long, default_value_t = 10.0)]
    pub duration_s: f64,
    /// Which policy to run; `all` runs the three one after another
    #[arg(long, value_enum, default_value = "all")]
    pub policy: PolicyArg,
    /// Tell the worker and every job the true call time (min runtime = the mean call
    /// time + 20 ms, in the flags and in each job): an oracle a user does not have, kept
    /// for comparison. By default the worker runs with its defaults and the jobs carry no
    /// hint: it learns the call time itself
    #[arg(long)]
    pub oracle: bool,
    /// The oracle's minimum runtime, in ms [default: mean call time + 20; only with --oracle]
    #[arg(long, requires = "oracle")]
    pub min_runtime_ms: Option<u64>,
    /// Clock uncertainty margin of the admission rule, in ms (the worker's default)
    #[arg(long, default_value_t = 100)]
    pub clock_uncertainty_ms: u64,
    /// Unacked deliveries the broker may push to the worker per queue [default: the
    /// worker's, 32 × slots and at least 128]
    #[arg(long)]
    pub prefetch: Option<u16>,
    /// The run's queues: `classic`, or `quorum` as `lastcall worker --queue-type quorum`
    /// declares them (for a RabbitMQ cluster: list its nodes in --amqp-url)
    #[arg(long, default_value = "classic", value_parser = ["classic", "quorum"])]
    pub queue_type: String,
    /// Ledger for the runs [default: a fresh SQLite file per policy in a temp directory].
    /// One ledger for every run: each run's worker starts from the call times the earlier
    /// runs recorded (a worker seeds its estimate from the ledger), not from nothing
    #[arg(long)]
    pub ledger_url: Option<String>,
    /// Publish every job, as `lastcall submit --no-shed` does. By default the producer
    /// sheds at the door like `lastcall submit` and `serve`: a job whose estimated queue
    /// wait (management API) plus its kind's call time (from the ledger) exceeds its budget
    /// is refused before it is published, and counted as shed
    #[arg(long)]
    pub no_shed: bool,
    /// The broker's management API, for shedding at the door
    #[arg(long, default_value = "http://127.0.0.1:15672")]
    pub management_url: String,
    /// Where to write the SVG chart (all policies on one chart)
    #[arg(long, default_value = "bench-goodput.svg")]
    pub svg: PathBuf,
    /// Do not write the SVG chart
    #[arg(long)]
    pub no_svg: bool,
    /// Tenants and their arrival rates, as `bench sim --tenants`:
    /// `NAME:RATE[:WEIGHT[:PRIORITY]],…` (rates as multiples of the capacity; their sum
    /// replaces --overload), or `zipf:N` for N tenants with Zipf-distributed rates summing
    /// to each --overload. Each job names its tenant (and tier) and waits in its lane; the
    /// workers get the weights. Per-tenant figures and Jain's index follow the table
    #[arg(long, value_name = "SPEC")]
    pub tenants: Option<String>,
    /// Workers sharing the queues, each with --slots (in this process, one ledger)
    #[arg(long, default_value_t = 1)]
    pub workers: usize,
    /// Print one JSON object instead of the table
    #[arg(long)]
    pub json: bool,
    /// A few seconds per policy (CI smoke test: 2 s of arrivals, 1 s deadlines, 100 ms calls;
    /// a real model keeps its deadlines and calls, and its server's ceiling takes 1 s a level)
    #[arg(long)]
    pub smoke: bool,
    /// Also run Celery 5.x (PyPI) through the same scenario with its deadline feature,
    /// `apply_async(expires=…)`: after lastcall's runs at each overload, run
    /// `bench/celery/run.sh --json` with the same service, duration, deadlines, slots and
    /// prefetch, and add its run (policy `celery-expires`) to the table, the chart and
    /// --json. About 17 s more per overload; the first run creates the script's venv
    /// (needs python3 and pip access to PyPI). What cannot be carried over (shedding at
    /// the door, the buffer order, the oracle) is printed with the results
    #[arg(long)]
    pub celery: bool,
    /// The script --celery runs [default: bench/celery/run.sh in the current directory
    /// or any above it, else in the source tree this binary was built from]
    #[arg(long, requires = "celery")]
    pub celery_script: Option<PathBuf>,
}

impl GoodputArgs {
    /// `--slots` as given, or its default (`auto` against a model server, else 4).
    pub fn slot_list(&self) -> Vec<SlotCount> {
        if !self.slots.is_empty() {
            return self.slots.clone();
        }
        vec![match self.openai_url {
            Some(_) => SlotCount::Auto,
            None => SlotCount::Fixed(4),
        }]
    }

    /// The slot count for what needs one number (the capacity of the sim backend, the
    /// embedded model's instances, Celery's concurrency): the first fixed `--slots`
    /// value, else 4.
    pub fn nominal_slots(&self) -> usize {
        (self.slot_list().into_iter())
            .find_map(|s| match s {
                SlotCount::Fixed(n) => Some(n),
                SlotCount::Auto => None,
            })
            .unwrap_or(4)
    }
}

/// How long each simulated model call takes, drawn per job.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub enum ServiceDist {
    /// Every call takes this many ms.
    Fixed { ms: u64 },
    /// Lognormal with this mean (ms) and shape σ.
    Lognormal { mean_ms: u64, sigma: f64 },
    /// The embedded SmolLM2 model: call times follow from the prompt and the output
    /// length; the mean is measured before the run.
    SmolLm2,
    /// SmolLM2 with prompts of 30–2,000 tokens and `max_tokens` 4–64.
    SmolLm2Mixed,
}

impl ServiceDist {
    /// The mean call time, when the distribution states it (not for a real model).
    pub fn mean_ms(&self) -> Option<f64> {
        match *self {
            ServiceDist::Fixed { ms } => Some(ms as f64),
            ServiceDist::Lognormal { mean_ms, .. } => Some(mean_ms as f64),
            ServiceDist::SmolLm2 | ServiceDist::SmolLm2Mixed => None,
        }
    }

    /// A real model (`smollm2`, `smollm2-mixed`), not the sim backend.
    pub fn is_model(&self) -> bool {
        matches!(self, ServiceDist::SmolLm2 | ServiceDist::SmolLm2Mixed)
    }

    /// One call duration; `u1`, `u2` uniform in (0, 1] (Box–Muller for the lognormal).
    pub fn draw(&self, u1: f64, u2: f64) -> u64 {
        match *self {
            ServiceDist::Fixed { ms } => ms,
            ServiceDist::SmolLm2 | ServiceDist::SmolLm2Mixed => 0,
            ServiceDist::Lognormal { mean_ms, sigma } => {
                let z = (-2.0 * u1.max(f64::MIN_POSITIVE).ln()).sqrt()
                    * (2.0 * std::f64::consts::PI * u2).cos();
                let mu = (mean_ms.max(1) as f64).ln() - sigma * sigma / 2.0;
                (mu + sigma * z).exp().round().max(1.0) as u64
            }
        }
    }

    /// A shorter version for the smoke run (mean at most 100 ms).
    pub fn smoke(self) -> Self {
        match self {
            ServiceDist::Fixed { ms } => ServiceDist::Fixed { ms: ms.min(100) },
            ServiceDist::Lognormal { mean_ms, sigma } => ServiceDist::Lognormal {
                mean_ms: mean_ms.min(100),
                sigma,
            },
            m @ (ServiceDist::SmolLm2 | ServiceDist::SmolLm2Mixed) => m,
        }
    }
}

impl std::fmt::Display for ServiceDist {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServiceDist::Fixed { ms } => write!(f, "fixed:{ms}"),
            ServiceDist::Lognormal { mean_ms, sigma } => write!(f, "lognormal:{mean_ms},{sigma}"),
            ServiceDist::SmolLm2 => write!(f, "smollm2"),
            ServiceDist::SmolLm2Mixed => write!(f, "smollm2-mixed"),
        }
    }
}

impl std::str::FromStr for ServiceDist {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let bad = || {
            format!(
                "`{s}`: expected fixed:MS, lognormal:MEAN_MS,SIGMA (e.g. lognormal:200,0.6), smollm2 or smollm2-mixed"
            )
        };
        match s {
            "smollm2" => return Ok(ServiceDist::SmolLm2),
            "smollm2-mixed" => return Ok(ServiceDist::SmolLm2Mixed),
            _ => {}
        }
        let (name, args) = s.split_once(':').ok_or_else(bad)?;
        match name {
            "fixed" => {
                let ms: u64 = args.trim().parse().map_err(|_| bad())?;
                if ms == 0 {
                    return Err(bad());
                }
                Ok(ServiceDist::Fixed { ms })
            }
            "lognormal" => {
                let (m, sg) = args.split_once(',').ok_or_else(bad)?;
                let mean_ms: u64 = m.trim().parse().map_err(|_| bad())?;
                let sigma: f64 = sg.trim().parse().map_err(|_| bad())?;
                if mean_ms == 0 || !(0.0..=3.0).contains(&sigma) {
                    return Err(bad());
                }
                Ok(ServiceDist::Lognormal { mean_ms, sigma })
            }
            _ => Err(bad()),
        }
    }
}

/// Worker dispatch policy to benchmark.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PolicyArg {
    /// Deadline, receipt-only and naive, one after another
    All,
    /// lastcall: deadline checked at receipt and immediately before the model call
    Deadline,
    /// Checked at receipt only (as Celery's `expires`); calls run to the end
    ReceiptOnly,
    /// No deadline check at all; calls run to the end
    Naive,
}

/// `bench goodput --estimate`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum EstimateArg {
    /// Per request (the worker's).
    Request,
    /// One per kind, without the request's size (reference only).
    PerKind,
    /// One per kind, the jobs split by prompt length into `short` and `long` kinds.
    SplitKinds,
}

impl EstimateArg {
    pub fn as_str(self) -> &'static str {
        match self {
            EstimateArg::Request => "request",
            EstimateArg::PerKind => "per-kind",
            EstimateArg::SplitKinds => "split-kinds",
        }
    }
}

/// Which job waiting in the worker's local buffer gets the next free model slot (the
/// values of `lastcall worker --buffer-order`, whose enum is the CLI's own: `lastcall` does
/// not depend on this crate, and the worker crate knows no clap).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BufferOrderArg {
    /// Earliest deadline first (ties: received first)
    Edf,
    /// Received first
    Fifo,
}

impl From<BufferOrderArg> for lastcall_worker::BufferOrder {
    fn from(a: BufferOrderArg) -> Self {
        match a {
            BufferOrderArg::Edf => Self::Edf,
            BufferOrderArg::Fifo => Self::Fifo,
        }
    }
}

/// Run one `lastcall-bench` command.
pub async fn run(env: &Env, c: BenchCommand) -> Result<ExitCode> {
    match c {
        BenchCommand::Goodput(a) => goodput::run(env, a).await,
        BenchCommand::AckModes(a) => ack_modes::run(env, a).await,
        BenchCommand::Ledger(a) => ledger::run(env, a).await,
        BenchCommand::FrontDoor(a) => front_door::run(env, a).await,
        BenchCommand::Sim(a) => sim::run(a),
    }
}

/// Open a ledger, with the message every command gives for one that cannot be opened.
pub(crate) async fn open_ledger(url: &str) -> Result<Arc<Ledger>> {
    let l = Ledger::connect(url).await.with_context(|| {
        format!(
            "cannot open the ledger at {} (set --store-url or LASTCALL_STORE_URL)",
            lastcall_broker::redact(url)
        )
    })?;
    Ok(Arc::new(l))
}

/// Start a dead-letter processor on `topo` (as `lastcall dlq` runs it: broker expiries are
/// recorded `expired_before_receive`) until `stop` fires.
pub(crate) async fn spawn_dead_letters(
    broker: lastcall_broker::Broker,
    ledger: Arc<Ledger>,
    topo: lastcall_broker::topology::Topology,
    clock: Arc<dyn Clock>,
    stop: tokio_util::sync::CancellationToken,
) -> Result<tokio::task::JoinHandle<()>> {
    let dlq = lastcall_worker::dlq::DeadLetterProcessor::build(broker, ledger, topo, clock, false)
        .await
        .map_err(anyhow::Error::msg)?;
    Ok(dlq.spawn(stop))
}

/// A progress bar on stderr (hidden when stderr is not a terminal, e.g. under `--json`
/// in a pipe).
pub(crate) fn bar(len: u64, msg: &str) -> ProgressBar {
    let b = ProgressBar::new(len);
    b.set_style(
        ProgressStyle::with_template("{msg:>28} [{bar:40}] {pos}/{len} {elapsed}")
            .expect("valid template")
            .progress_chars("=> "),
    );
    b.set_message(msg.to_owned());
    b
}

/// Latency percentiles in ms from an HDR histogram of µs values.
#[derive(Debug, Clone, Copy, Default, Serialize)]
pub(crate) struct Percentiles {
    pub count: u64,
    pub p50_ms: f64,
    pub p90_ms: f64,
    pub p99_ms: f64,
    pub p999_ms: f64,
    pub max_ms: f64,
}

impl Percentiles {
    pub fn from_us(values: impl IntoIterator<Item = u64>) -> Self {
        let mut h =
            Histogram::<u64>::new_with_bounds(1, 3_600_000_000, 3).expect("valid histogram bounds");
        for v in values {
            h.saturating_record(v.max(1));
        }
        if h.is_empty() {
            return Self::default();
        }
        let ms = |q: f64| h.value_at_quantile(q) as f64 / 1000.0;
        Self {
            count: h.len(),
            p50_ms: ms(0.5),
            p90_ms: ms(0.9),
            p99_ms: ms(0.99),
            p999_ms: ms(0.999),
            max_ms: h.max() as f64 / 1000.0,
        }
    }
}

/// The machine and broker a run was measured on.
#[derive(Debug, Clone, Serialize)]
pub(crate) struct Machine {
    pub cores: usize,
    pub build: &'static str,
}

pub(crate) fn machine() -> Machine {
    Machine {
        cores: std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1),
        build: if cfg!(debug_assertions) {
            "debug (numbers are not representative; use --release)"
        } else {
            "release"
        },
    }
}

/// A fresh temporary directory for bench ledgers.
pub(crate) fn temp_dir(tag: &str, clock: &dyn Clock) -> Result<PathBuf> {
    let d = std::env::temp_dir().join(format!(
        "lastcall-bench-{tag}-{}-{}",
        std::process::id(),
        clock.now_ms()
    ));
    std::fs::create_dir_all(&d)?;
    Ok(d)
}

pub(crate) fn f1(x: f64) -> String {
    format!("{x:.1}")
}
