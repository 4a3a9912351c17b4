//! Command-line arguments.

use clap::{Args, Parser, Subcommand, ValueEnum};
use lastcall_core::concurrency::SlotCount;
use std::path::PathBuf;

/// lastcall — a job dispatcher for AI inference on RabbitMQ that never starts work whose
/// deadline has passed.
///
/// Every job carries an immutable absolute deadline. The broker TTL is recomputed from the
/// remaining budget on every publish, and the worker checks the deadline one last time
/// right before the model call. Jobs refused there end as `expired_not_started` with zero
/// model calls. Every accepted job ends in exactly one recorded outcome in the ledger.
///
/// Quick start: `lastcall demo` runs the whole pipeline on the local defaults.
#[derive(Debug, Parser)]
#[command(
    name = "lastcall",
    version,
    propagate_version = true,
    max_term_width = 100
)]
pub struct Cli {
    #[command(flatten)]
    pub global: Global,
    #[command(subcommand)]
    pub command: Command,
}

/// Options every command shares.
#[derive(Debug, Args)]
pub struct Global {
    /// RabbitMQ URL [default: amqp://guest:guest@127.0.0.1:5672/%2f]
    #[arg(long, env = "LASTCALL_AMQP_URL", global = true, hide_env_values = true)]
    pub amqp_url: Option<String>,
    /// Ledger URL: `sqlite://FILE` or `postgres://…` [default: sqlite://lastcall.db]
    #[arg(
        long,
        env = "LASTCALL_STORE_URL",
        global = true,
        hide_env_values = true
    )]
    pub store_url: Option<String>,
    /// Prefix of every exchange and queue name [default: lastcall]
    #[arg(long, env = "LASTCALL_PREFIX", global = true, hide_env_values = true)]
    pub prefix: Option<String>,
    /// Config file: the keys amqp_url, store_url and prefix, and a section per command
    /// ([worker], [serve], [dlq], [submit], [ledger] for `ledger prune` and the workers'
    /// pruning) whose keys are its flags; `lastcall config show`
    /// prints what is in effect [default: ./lastcall.toml if present]
    #[arg(long, env = "LASTCALL_CONFIG", global = true)]
    pub config: Option<PathBuf>,
    /// Log format on stderr: `text` or `json`
    #[arg(long, default_value = "text", global = true, value_parser = ["text", "json"])]
    pub log_format: String,
    /// Export traces (one span per job, with job_id, attempt and deadline fields) over
    /// OTLP/HTTP to this collector, e.g. http://127.0.0.1:4318. Needs a build with the
    /// `otlp` cargo feature; off by default
    #[arg(long, env = "LASTCALL_OTLP_ENDPOINT", global = true)]
    pub otlp_endpoint: Option<String>,
    /// Log at info level (set LASTCALL_LOG for finer control, e.g. `lastcall=debug`)
    #[arg(long, short, global = true)]
    pub verbose: bool,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Validate, stamp and publish one job (waits for the broker's confirm); prints its id.
    /// With --wait, then waits for its outcome and prints it with the result text
    Submit(SubmitArgs),
    /// Cancel a job: before its start it ends `cancelled` with no model call; while it
    /// runs, its worker aborts the call and records `cancelled`
    ///
    /// Writes the ledger first, then broadcasts to the workers on `{prefix}.control` (and
    /// announces a job cancelled before its start on `{prefix}.events`). A job that has
    /// already ended is left as it is.
    ///
    /// Exit codes: 0 cancelled (or, for a running job, requested); 3 the job had already
    /// ended (nothing changed); 1 no such job or an error.
    Cancel(CancelArgs),
    /// Run a worker: bounded buffer, model slots, last admission check, store-then-ack
    ///
    /// Right before each model call the worker checks the job's remaining budget (its
    /// deadline − now − --clock-uncertainty-ms) against the minimum useful runtime: the
    /// job's own `min_runtime_ms`; else the call time it has learned for the job's kind
    /// (the p99 of its last 128 calls, from the ledger's recent calls of this backend when it
    /// starts); else --min-runtime-ms. A job that fails the check is recorded
    /// `expired_not_started` without a model call; a call still running at the deadline is
    /// cancelled and recorded `deadline_exceeded`. Every outcome is written to the ledger
    /// before the delivery is acked.
    Worker(Box<WorkerArgs>),
    /// Look at job records in the ledger
    #[command(subcommand)]
    Jobs(JobsCommand),
    /// Declare (apply) or delete the exchanges, queues and bindings of a prefix
    #[command(subcommand)]
    Topology(TopologyCommand),
    /// Run the whole pipeline end to end on the local defaults and print the outcomes
    ///
    /// Declares its own queues (`lastcall-demo.*`, purged first), keeps its outcomes in a
    /// fresh ledger of its own (`./lastcall-demo.db`, or --demo-store-url; never the one of
    /// --store-url), and runs a worker and the dead-letter processor in this process.
    Demo(DemoArgs),
    /// Run the dead-letter processor: record an outcome for every dead letter, then ack
    ///
    /// Consumes `{prefix}.dead` with manual acks and records one outcome per dead letter,
    /// classified by its `x-death` reason: `expired` → `expired_before_receive`; `maxlen` and
    /// `delivery_limit` → `failed` with that reason; `rejected` keeps the worker's recorded
    /// outcome. A job that already has an outcome keeps it; the ack follows the ledger
    /// write. Malformed dead letters are recorded under a synthetic id. Dead letters are
    /// never republished to the work queue, and their deadline is not touched.
    Dlq(DlqArgs),
    /// Compare accepted jobs with recorded outcomes; mark the overdue ones `unknown`
    ///
    /// Every job the ingress recorded as accepted must end in exactly one terminal outcome.
    /// A job still `accepted` or `running` after `expires_at_ms + grace` is marked `unknown`
    /// (reason `no_outcome_after_deadline`): named, not guessed. Outcomes that arrive later
    /// never overwrite it. Running it again changes nothing.
    ///
    /// Exit codes: 0 when the ledger holds no `unknown` job (or with --allow-unknown); 3 when
    /// it holds any, found now or earlier; 1 on errors.
    Reconcile(ReconcileArgs),
    /// Outcome and failure statistics over a time window (the daily export)
    ///
    /// Over the outcomes recorded in the window: counts by state, kind, `state/reason` and
    /// error class (deadline, invalid_input, poison, retries_exhausted, overflow, broker,
    /// backend_terminal, unaccounted), the most frequent error messages, and the time from
    /// `created_at` to the recorded outcome per state as p50/p90/p99/max (nearest rank).
    Report(ReportArgs),
    /// HTTP ingress, Prometheus metrics and the live dashboard
    ///
    /// `POST /v1/jobs` validates, stamps the deadline, publishes with confirm and records
    /// `accepted`; `GET /v1/jobs/{id}` and `GET /v1/jobs?state=…&kind=…` read the ledger;
    /// `/metrics` (Prometheus), `/` (dashboard), `/openapi.json`, `/healthz`, `/readyz`.
    /// Every route but `/healthz` and `/readyz` needs the token: `Authorization: Bearer
    /// <token>`, or HTTP Basic with any user name and the token as password (a browser
    /// prompts for it on the dashboard);
    /// the token comes from LASTCALL_HTTP_TOKEN or --token-file, never from a flag. With a
    /// signing key (--signing-key-file or LASTCALL_SIGNING_KEY) every job is published with
    /// x-lastcall-signature.
    ///
    /// It listens at once, then connects: while its broker or ledger is not reachable
    /// (at startup, or PostgreSQL still starting) it waits for them with backoff, /healthz
    /// answers 200, /readyz 503 naming what it waits for, and every other request 503
    /// `starting` with Retry-After. Send work once /readyz answers 200.
    Serve(ServeArgs),
    /// Benchmarks on the real broker and ledgers: goodput under overload, ack modes, ledger writes
    ///
    /// Runs `lastcall-bench`, the benchmark binary built beside `lastcall`
    /// (`cargo build -p lastcall-bench`; `scripts/install.sh` installs both), with this
    /// command's broker URL, prefix and config file, and ends with its exit code. Everything after `bench`
    /// goes to it, `--help` too: `lastcall bench --help` lists its commands, `bench goodput`
    /// (useful work under overload), `bench ack-modes`, `bench ledger`, `bench front-door`
    /// and `bench sim`.
    #[command(disable_help_flag = true)]
    Bench(BenchArgs),
    /// Look at the configuration: `config show [worker|serve|dlq|submit|ledger]`
    #[command(subcommand)]
    Config(ConfigCommand),
    /// Keep the ledger from growing without end: prune old jobs, export them, copy the
    /// ledger to PostgreSQL
    ///
    /// The ledger keeps every job's row, attempts and result text until retention removes
    /// them: `[ledger] retention` (default 30d) deletes terminal jobs with their attempt and
    /// webhook rows, `[ledger] text_retention` (default 7d) clears only their result text.
    /// Jobs that have not ended and jobs whose webhook is not delivered are never pruned.
    /// Every worker prunes in the background (`worker --prune-every`, default 10m; one at a
    /// time on PostgreSQL); `ledger prune` does the same by hand. `ledger export` writes
    /// jobs as JSON lines, `ledger copy` moves a SQLite ledger to PostgreSQL.
    #[command(subcommand)]
    Ledger(LedgerCommand),
    /// API tokens of `serve --tokens-file`: `tokens hash` prints a token's SHA-256 for the file
    #[command(subcommand)]
    Tokens(TokensCommand),
    /// Batches of jobs due within a window, through a running `lastcall serve`
    ///
    /// The client side of the OpenAI-compatible Files and Batch APIs (docs/batches.md):
    /// `batch create FILE --window 24h` uploads a JSON-lines file of requests and starts a
    /// batch whose lines each run as a `batch`-tier job due at the batch's creation + the
    /// window; `batch show`, `batch list`, `batch cancel`, and `batch results` (the output
    /// file, or `--errors` the error file). The token comes from LASTCALL_HTTP_TOKEN or
    /// --token-file, never from a flag:
    ///
    ///   lastcall batch create requests.jsonl --window 2h
    ///
    ///   lastcall batch show batch_… --wait
    ///
    ///   lastcall batch results batch_… > answers.jsonl
    Batch(BatchArgs),
}

#[derive(Debug, Args)]
pub struct BatchArgs {
    /// The `lastcall serve` to talk to
    #[arg(
        long,
        env = "LASTCALL_URL",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub url: String,
    /// File holding the bearer token (else the environment variable LASTCALL_HTTP_TOKEN)
    #[arg(long, value_name = "FILE", global = true)]
    pub token_file: Option<PathBuf>,
    #[command(subcommand)]
    pub command: BatchCommand,
}

#[derive(Debug, Subcommand)]
pub enum BatchCommand {
    /// Upload a JSON-lines file (one `{"custom_id", "method", "url", "body"}` request per
    /// line, OpenAI's batch input format) and create a batch from it; prints the batch's id
    Create {
        /// The input file
        file: PathBuf,
        /// The completion window: every line must be done within it (`30m`, `2h`, `24h`,
        /// `7d`, …); a line not started by then ends `expired`, never run late
        #[arg(long, default_value = "24h")]
        window: String,
        /// The endpoint every line calls
        #[arg(long, default_value = "/v1/chat/completions")]
        endpoint: String,
        /// Metadata to keep with the batch, `KEY=VALUE` (repeatable)
        #[arg(long = "metadata", value_name = "KEY=VALUE")]
        metadata: Vec<String>,
    },
    /// A batch's status and its lines' counts
    Show {
        id: String,
        /// Poll until the batch has ended (completed, failed, expired or cancelled),
        /// printing its counts as they change
        #[arg(long)]
        wait: bool,
        /// Print the API's JSON object instead of a summary
        #[arg(long)]
        json: bool,
    },
    /// The most recent batches, newest first
    List {
        #[arg(long, default_value_t = 20)]
        limit: u32,
    },
    /// Cancel a batch: lines not yet started never run
    Cancel { id: String },
    /// Write a batch's output file (one JSON line per answered request) to stdout
    Results {
        id: String,
        /// The error file instead: the lines that failed, expired or were malformed
        #[arg(long)]
        errors: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum TokensCommand {
    /// Print the SHA-256 of the token read from stdin, as the tokens file's `sha256` wants it
    ///
    /// Reads the token from standard input (surrounding whitespace and the newline are
    /// removed, as `serve` does with a presented token), so it never appears in a command
    /// line or a shell history, and prints a `[[token]]` entry to fill in:
    ///
    ///   openssl rand -hex 24 > team-a.token
    ///
    ///   lastcall tokens hash --tenant team-a < team-a.token >> tokens.toml
    ///
    /// A token shorter than 16 characters is refused.
    Hash {
        /// The tenant to put in the printed entry
        #[arg(long, value_parser = parse_tenant, default_value = "default")]
        tenant: lastcall_core::Tenant,
        /// Print the hash alone (no entry)
        #[arg(long)]
        bare: bool,
    },
}

/// A tenant name for clap, its rule in the error.
pub fn parse_tenant(s: &str) -> Result<lastcall_core::Tenant, String> {
    lastcall_core::Tenant::parse(s).map_err(|e| format!("a tenant {}", e.0))
}

#[derive(Debug, Subcommand)]
pub enum LedgerCommand {
    /// Delete old terminal jobs and clear old result texts now, in small batches; prints counts
    ///
    /// Deletes the terminal jobs (completed, failed, expired_*, deadline_exceeded,
    /// rejected, unknown, cancelled) recorded more than --retention ago, with their attempt
    /// rows, webhook and webhook attempts, and clears the result text of those recorded
    /// more than --text-retention ago (the row stays: state, reason, timings, tokens).
    /// Never pruned: jobs still `accepted` or `running`, and jobs whose webhook is not
    /// delivered yet (counted as "held by webhooks"). Worker leases not renewed for
    /// --retention go too. With --archive-dir the deleted jobs are first appended, as JSON
    /// lines, to DIR/ledger-YYYY-MM-DD.jsonl and synced to disk before their deletion
    /// commits.
    ///
    /// Each batch of --batch-rows jobs is one short transaction, followed by a pause of
    /// --batch-pause-ms, so running workers are never held up for long. On PostgreSQL one
    /// pruner runs at a time (an advisory lock): if a worker is pruning, this waits for
    /// nothing and says so (exit 3).
    ///
    /// The flags can be set in lastcall.toml's [ledger] section (e.g. `retention = "14d"`),
    /// which the workers' background pruning reads too.
    ///
    /// Exit codes: 0 pruned (or would, with --dry-run); 3 another process is pruning; 1 errors.
    Prune(PruneArgs),
    /// Write the terminal jobs recorded in a time window as JSON lines (one object per job)
    ///
    /// Each line is one job's record as `jobs show --json` prints it (state, reason,
    /// timings, tokens, result text, attempt and model-call counts), oldest first. Rows are
    /// streamed: any number of them runs in constant memory. --since and --until take a
    /// duration before now (`24h`, `7d`), a date (`2026-12-01`, midnight UTC) or epoch
    /// milliseconds; the window is [since, until).
    Export(ExportArgs),
    /// Copy the whole ledger to another database (SQLite → PostgreSQL), then check the copy
    ///
    /// Copies every table (jobs, attempts, webhooks, webhook_attempts, workers) in
    /// primary-key order, in batches, with `INSERT … ON CONFLICT DO NOTHING`: rows the
    /// destination already has are skipped, so an interrupted copy is resumed by running
    /// the same command again, and a second run copies nothing. The destination's schema
    /// is created (migrated) first. At the end each table's row count and checksum are
    /// compared on both sides; a difference fails the command (exit 1).
    ///
    /// Stop the workers, `serve` and `dlq` first (a row that changes during the copy is
    /// not copied again), then point --store-url at the destination. README: "Outgrowing
    /// one machine".
    Copy(CopyArgs),
}

/// What retention keeps, shared by `ledger prune` and the workers' background pruning
/// (lastcall.toml's `[ledger]` section sets these).
#[derive(Debug, Args, Clone)]
pub struct RetentionArgs {
    /// Delete terminal jobs (and their attempt and webhook rows) recorded longer ago than
    /// this: a number with a unit, `s`, `m`, `h` or `d` (e.g. 30d, 720h), at least 1d (a
    /// deadline may lie up to 24 h ahead with the default --horizon-ms, and a duplicate still
    /// queued must find its job's row), or `off` to keep every row
    #[arg(
        long,
        env = "LASTCALL_LEDGER_RETENTION",
        default_value = "30d",
        value_name = "DURATION",
        value_parser = parse_retention
    )]
    pub retention: Keep,
    /// Clear the result text of terminal jobs recorded longer ago than this; their rows
    /// stay (state, reason, timings, tokens). A number with a unit, `s`, `m`, `h` or `d`
    /// (e.g. 7d, 24h), at least 1h, or `off` (longer than --retention: the rows go first)
    #[arg(
        long,
        env = "LASTCALL_LEDGER_TEXT_RETENTION",
        default_value = "7d",
        value_name = "DURATION",
        value_parser = parse_text_retention
    )]
    pub text_retention: Keep,
    /// Before deleting, append the pruned jobs as JSON lines (the `ledger export` format)
    /// to DIR/ledger-YYYY-MM-DD.jsonl (the UTC day of the prune), synced to disk before the
    /// deletion commits
    #[arg(long, env = "LASTCALL_LEDGER_ARCHIVE_DIR", value_name = "DIR")]
    pub archive_dir: Option<PathBuf>,
    /// Jobs per prune transaction (1–100000): a writer waits at most one batch
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    pub batch_rows: u32,
    /// Least pause between two prune batches, in ms, so that the writers get the database
    /// (the pause is also at least 19 times the batch's own time: pruning holds the write
    /// lock at most 5% of the time)
    #[arg(long, default_value_t = 50, value_name = "MS")]
    pub batch_pause_ms: u64,
}

/// How long retention keeps something: `None` keeps it forever (`off`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Keep(pub Option<i64>);

impl std::fmt::Display for Keep {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self.0 {
            None => f.write_str("off"),
            Some(ms) => f.write_str(&show_duration(ms)),
        }
    }
}

/// `ms` in the largest unit that divides it (`30d`, `36h`, `90s`, `250ms`).
pub fn show_duration(ms: i64) -> String {
    for (unit, n) in [
        ("d", 86_400_000),
        ("h", 3_600_000),
        ("m", 60_000),
        ("s", 1_000),
    ] {
        if ms != 0 && ms % n == 0 {
            return format!("{}{unit}", ms / n);
        }
    }
    format!("{ms}ms")
}

/// A duration as the project writes them (`report --since`, retention): a number with a
/// unit `ms`, `s`, `m`, `h` or `d`. The error says what is accepted, without a flag name.
pub fn duration_ms(s: &str) -> Result<i64, String> {
    let s = s.trim();
    let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let Ok(n) = num.parse::<i64>() else {
        return Err(format!(
            "must be a number with a unit (ms, s, m, h, d), e.g. 24h; got `{s}`"
        ));
    };
    let factor = match unit {
        "ms" => 1,
        "s" => 1_000,
        "m" => 60_000,
        "h" => 3_600_000,
        "d" => 86_400_000,
        "" => {
            return Err(format!(
                "needs a unit (ms, s, m, h, d), e.g. `{n}s`; got `{s}`"
            ));
        }
        other => {
            return Err(format!(
                "has an unknown unit `{other}` in `{s}`; use ms, s, m, h or d"
            ));
        }
    };
    n.checked_mul(factor)
        .ok_or_else(|| format!("is too large: `{s}`"))
}

fn keep(s: &str, min_ms: i64, min: &str) -> Result<Keep, String> {
    if s.trim().eq_ignore_ascii_case("off") {
        return Ok(Keep(None));
    }
    let ms = duration_ms(s).map_err(|e| {
        format!("{e}; accepted: a number with a unit s, m, h or d (e.g. 30d, 24h), or `off`")
    })?;
    if ms < min_ms {
        return Err(format!("`{s}` is shorter than the minimum, {min}"));
    }
    Ok(Keep(Some(ms)))
}

fn parse_prune_every(s: &str) -> Result<Keep, String> {
    keep(s, 1_000, "1s")
}

fn parse_retention(s: &str) -> Result<Keep, String> {
    keep(s, 86_400_000, "1d")
}

fn parse_text_retention(s: &str) -> Result<Keep, String> {
    keep(s, 3_600_000, "1h")
}

/// `lastcall ledger prune` (see the subcommand's help).
#[derive(Debug, Args)]
pub struct PruneArgs {
    #[command(flatten)]
    pub retention: RetentionArgs,
    /// Count what would be pruned; change nothing
    #[arg(long)]
    pub dry_run: bool,
    /// Print one JSON object with the counts
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExportFormat {
    /// One JSON object per line
    Jsonl,
}

/// `lastcall ledger export` (see the subcommand's help).
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// Start of the window (inclusive): a duration before now (`7d`), a date
    /// (`2026-12-01`, UTC) or epoch ms [default: the beginning]
    #[arg(long, value_name = "WHEN")]
    pub since: Option<String>,
    /// End of the window (exclusive), in the same forms [default: now]
    #[arg(long, value_name = "WHEN")]
    pub until: Option<String>,
    /// Output format
    #[arg(long, value_enum, default_value = "jsonl")]
    pub format: ExportFormat,
    /// Write to this file (created or truncated) instead of stdout
    #[arg(long, value_name = "FILE")]
    pub out: Option<PathBuf>,
}

/// `lastcall ledger copy` (see the subcommand's help).
#[derive(Debug, Args)]
pub struct CopyArgs {
    /// The ledger to copy [default: the configured ledger, --store-url]
    #[arg(long, value_name = "STORE_URL")]
    pub from: Option<String>,
    /// The destination, e.g. postgres://lastcall@db.internal/lastcall (its schema is
    /// created if missing)
    #[arg(long, value_name = "STORE_URL")]
    pub to: String,
    /// Rows per batch (1–10000)
    #[arg(long, default_value_t = 1_000, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    pub batch_rows: u32,
    /// No progress bar (it is drawn only on a terminal anyway)
    #[arg(long)]
    pub no_progress: bool,
}

#[derive(Debug, Subcommand)]
pub enum ConfigCommand {
    /// Print the effective settings of a command, each with its source (flag, env, file,
    /// default); passwords in URLs and secrets are masked
    ///
    /// Without a command: the connection settings every command shares and the config file
    /// in use. With one, also each of its flags; that command's flags may follow (e.g.
    /// `lastcall config show worker --slots 8`) and show as `flag`. Nothing is connected to.
    Show(ConfigShowArgs),
}

#[derive(Debug, Args)]
pub struct ConfigShowArgs {
    /// The command whose settings to show
    #[arg(value_enum)]
    pub command: Option<ConfigTarget>,
    /// That command's flags, as they would be given to it
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        requires = "command",
        value_name = "FLAGS"
    )]
    pub flags: Vec<std::ffi::OsString>,
}

/// The commands whose flags `lastcall.toml` may set.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ConfigTarget {
    Worker,
    Serve,
    Dlq,
    Submit,
    /// The retention settings (`ledger prune`'s flags, the `[ledger]` section)
    Ledger,
}

impl ConfigTarget {
    /// The command's (and the file section's) name.
    pub fn name(self) -> &'static str {
        match self {
            ConfigTarget::Worker => "worker",
            ConfigTarget::Serve => "serve",
            ConfigTarget::Dlq => "dlq",
            ConfigTarget::Submit => "submit",
            ConfigTarget::Ledger => "ledger",
        }
    }
}

/// Admission rule options shared by `submit`, `worker` and `demo`.
#[derive(Debug, Args, Clone)]
pub struct AdmissionArgs {
    /// Allowance for clock differences between ingress and worker, in ms. A rule to set
    /// from your measured clock sync, not a measured bound.
    #[arg(long, default_value_t = 100)]
    pub clock_uncertainty_ms: u64,
    /// Minimum useful runtime when the job does not set one, in ms: work is not started
    /// with less budget left than this. A worker uses it only until it has learned how long
    /// calls take (`lastcall worker --help`).
    #[arg(long, default_value_t = 0)]
    pub min_runtime_ms: u64,
    /// Farthest a deadline may lie ahead, in ms (default 24 h).
    #[arg(long, default_value_t = 86_400_000)]
    pub horizon_ms: i64,
    /// Largest accepted message body, in bytes.
    #[arg(long, default_value_t = 1_048_576)]
    pub max_message_bytes: usize,
}

/// Topology options shared by the commands that declare it.
#[derive(Debug, Args, Clone)]
pub struct TopologyArgs {
    /// Type of the work queue
    #[arg(long, default_value = "classic", value_parser = ["classic", "quorum"])]
    pub queue_type: String,
    /// Fixed delays of the retry queues, in ms, ascending (one queue each)
    #[arg(long, value_delimiter = ',', default_value = "1000,5000,30000")]
    pub retry_delays_ms: Vec<u64>,
    /// Quorum queues: deliveries after which the broker dead-letters a message
    #[arg(long, default_value_t = 5)]
    pub delivery_limit: u32,
    /// Cap on the work queue's length (`x-max-length`). Classic queues then dead-letter
    /// the oldest job (recorded `failed`/`maxlen`); quorum queues refuse new publishes
    /// (the submitter reports the publisher nack)
    #[arg(long)]
    pub max_length: Option<u32>,
}

#[derive(Debug, Args)]
#[command(group(
    clap::ArgGroup::new("deadline")
        .args(["deadline_ms", "expires_at_ms"])
        .required(true)
))]
pub struct SubmitArgs {
    /// Job kind (routes the job to a model), e.g. `incident.summary`
    #[arg(long)]
    pub kind: String,
    /// The job's payload as a JSON object, e.g. '{"messages":[{"role":"user","content":"…"}]}'
    #[arg(long, conflicts_with = "prompt")]
    pub payload: Option<String>,
    /// Shorthand for a chat payload with one user message
    #[arg(long)]
    pub prompt: Option<String>,
    /// Deadline relative to now, in ms
    #[arg(long, conflicts_with = "expires_at_ms")]
    pub deadline_ms: Option<u64>,
    /// Absolute deadline, ms since the Unix epoch
    #[arg(long)]
    pub expires_at_ms: Option<i64>,
    /// Job id (default: generated). 1–128 chars of [A-Za-z0-9._:-]
    #[arg(long)]
    pub job_id: Option<String>,
    /// Minimum useful runtime for this job, in ms
    #[arg(long = "job-min-runtime-ms")]
    pub job_min_runtime_ms: Option<u64>,
    /// Correlation id for logs and traces
    #[arg(long)]
    pub trace_id: Option<String>,
    /// Whose job it is (signed with the envelope): 1–64 characters of [A-Za-z0-9._:-];
    /// without it the job belongs to tenant `default`
    #[arg(long, value_parser = parse_tenant)]
    pub tenant: Option<lastcall_core::Tenant>,
    /// The job's priority tier: under overload `critical` is served first and `batch` last
    /// (without it: `standard`)
    #[arg(long, value_parser = ["critical", "standard", "batch"])]
    pub priority: Option<String>,
    /// How long to wait for the broker's publisher confirm, in ms
    #[arg(long, default_value_t = 5_000)]
    pub confirm_timeout_ms: u64,
    /// Do not record `accepted` in the ledger (reconciliation will not see the job)
    #[arg(long)]
    pub no_ledger: bool,
    /// Do not shed: publish even a job that the estimated queue wait (ready ÷ the work
    /// queue's recent ack rate, from the management API) would make expire. Without it
    /// such a job is refused before publishing, exit status 75
    #[arg(long)]
    pub no_shed: bool,
    /// Base URL of RabbitMQ's management API, for the queue-wait estimate (credentials and
    /// vhost come from the AMQP URL; when it does not answer, the job is admitted)
    #[arg(
        long,
        env = "LASTCALL_MANAGEMENT_URL",
        default_value = "http://127.0.0.1:15672"
    )]
    pub management_url: String,
    /// Sign every published job with this key (x-lastcall-signature, HMAC-SHA256 over job
    /// id, deadline and body), for workers started with the same key. A file holding at
    /// least 32 bytes; else the environment variable LASTCALL_SIGNING_KEY; neither: unsigned
    #[arg(long, value_name = "FILE")]
    pub signing_key_file: Option<PathBuf>,
    /// Wait for the job's outcome (woken by its event on `{prefix}.events`, then read from
    /// the ledger) and print its state, reason and result text. Exit status: 0 completed,
    /// 3 expired (expired_not_started, expired_before_receive, deadline_exceeded), 1 any
    /// other outcome, 4 no outcome by the deadline + --wait-grace-ms
    #[arg(long, conflicts_with = "no_ledger")]
    pub wait: bool,
    /// AMQP URL of the outcome-events follower of --wait, whose user needs only the `follower` role of
    /// docs/broker-permissions.md (declare and read `{prefix}.events.follow.*`, read
    /// `{prefix}.events`) [default: --amqp-url]
    #[arg(long, env = "LASTCALL_EVENTS_AMQP_URL", hide_env_values = true)]
    pub events_amqp_url: Option<String>,
    /// With --wait: how long after the job's deadline to keep waiting for its outcome, in ms
    #[arg(long, default_value_t = 30_000, requires = "wait")]
    pub wait_grace_ms: u64,
    #[command(flatten)]
    pub admission: AdmissionArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
}

/// `lastcall demo` options.
#[derive(Debug, Args)]
pub struct DemoArgs {
    /// Model backend: `local` runs the embedded SmolLM2 model (real inference, needs
    /// `scripts/setup-model.sh`), `sim` a simulated model with a fixed latency
    // The binary makes `sim` the default when it is built without the embedded model.
    #[arg(long, value_enum, default_value_t = DemoBackend::Local)]
    pub backend: DemoBackend,
    /// Jobs to submit [default: 10 local, 30 sim]
    #[arg(long)]
    pub jobs: Option<usize>,
    /// Each job's deadline, in ms from its submission [default: 10000 local, 2000 sim]
    #[arg(long)]
    pub deadline_ms: Option<u64>,
    /// The first jobs are urgent pages (kind `incident.page`) sent while the worker is still
    /// starting: they get this deadline, and expire at the broker before any worker
    /// receives them
    #[arg(long, default_value_t = 1_500)]
    pub early_deadline_ms: u64,
    /// How many of the jobs are such early, urgent pages
    #[arg(long, default_value_t = 3)]
    pub early_jobs: usize,
    /// Model slots of the demo worker [default: 1 local, 2 sim]
    #[arg(long)]
    pub slots: Option<usize>,
    /// Sim latency per call, in ms
    #[arg(long, default_value_t = 600)]
    pub sim_latency_ms: u64,
    /// Local model: tokens to generate per job
    #[arg(long, default_value_t = 24)]
    pub max_tokens: u64,
    /// Submission rate, in jobs per second [default: 1 local, 8 sim; over twice the capacity]
    #[arg(long)]
    pub rate: Option<f64>,
    /// Minimum useful runtime per job, in ms: no call starts with less budget left
    /// [default: 3000 local, the sim latency for sim]
    #[arg(long)]
    pub min_runtime_ms: Option<u64>,
    /// Start the worker this long after the first submission, in ms, as after a restart
    #[arg(long, default_value_t = 2_500)]
    pub worker_delay_ms: u64,
    /// Local backend: the GGUF file [default: the one `scripts/setup-model.sh` installed]
    #[arg(long, env = "LASTCALL_MODEL_PATH")]
    pub model_path: Option<PathBuf>,
    /// Keep the demo's ledger here instead of a fresh file
    #[arg(long)]
    pub demo_store_url: Option<String>,
}

/// The demo's model backend.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum DemoBackend {
    /// The embedded SmolLM2-135M model (real inference on the CPU)
    Local,
    /// A simulated model with a fixed latency
    Sim,
}

/// `lastcall bench …`: what goes to `lastcall-bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    /// A `lastcall-bench` command and its options, e.g. `goodput --smoke`, or `--help`
    #[arg(
        trailing_var_arg = true,
        allow_hyphen_values = true,
        value_name = "COMMAND AND OPTIONS"
    )]
    pub args: Vec<std::ffi::OsString>,
}

#[derive(Debug, Args)]
pub struct CancelArgs {
    /// The job's id
    pub job_id: String,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum BackendKind {
    /// Simulated model: fixed latency, counts every call (tests and benchmarks)
    Sim,
    /// An OpenAI-compatible chat-completions server (vLLM, llama.cpp, Ollama, hosted APIs), streamed
    Openai,
    /// The embedded SmolLM2-135M model, in-process on the CPU (one instance per slot)
    Local,
    /// Route each job kind to a backend by the `[routing]` table of lastcall.toml
    Routed,
}

/// Which job waiting in the local buffer gets the next free model slot (the values of
/// `worker --buffer-order`).
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

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ExpiredActionArg {
    /// Record `expired_not_started`, then ack
    Ack,
    /// Record `expired_not_started`, then reject to the dead-letter exchange (quarantine)
    DeadLetter,
}

// Test-only flags exist only in a build whose `lastcall-worker` has the `test-hooks`
// feature (the CLI's own tests); a release build has no such flag.
lastcall_worker::with_test_hooks!({
    #[derive(Debug, Args)]
    pub struct TestHookArgs {
        /// Test only: inject a fault (`pause-after-store` stops after the durable write,
        /// before the ack, for kill tests)
        #[arg(long, hide = true)]
        pub fault: Option<String>,
        /// Test only: the background pruning deletes terminal jobs recorded longer ago
        /// than this, below `[ledger] retention`'s floor of 1d (the soak test's short
        /// retention)
        #[arg(long, hide = true, value_name = "DURATION", value_parser = parse_test_retention)]
        pub test_retention: Option<i64>,
        /// Test only: the background pruning clears result texts recorded longer ago than
        /// this, below `[ledger] text_retention`'s floor of 1h
        #[arg(long, hide = true, value_name = "DURATION", value_parser = parse_test_retention)]
        pub test_text_retention: Option<i64>,
        /// Test only: shift this worker's clock by this many ms (clock-skew drills)
        #[arg(long, hide = true, default_value_t = 0, allow_hyphen_values = true)]
        pub clock_offset_ms: i64,
    }

    fn parse_test_retention(s: &str) -> Result<i64, String> {
        duration_ms(s)
    }
} else {
    #[derive(Debug, Args)]
    pub struct TestHookArgs {}
});

/// `BACKEND:rpm=N,tpm=N` of `--rate-limit`.
fn parse_rate_limit(s: &str) -> Result<(String, lastcall_core::rate_limit::Limits), String> {
    let (name, limits) = s
        .split_once(':')
        .ok_or_else(|| format!("`{s}`: expected BACKEND:rpm=N,tpm=N, e.g. openai:rpm=60"))?;
    let name = name.trim();
    if name.is_empty() {
        return Err(format!("`{s}`: the backend name is missing"));
    }
    let limits = lastcall_core::rate_limit::Limits::parse(limits)?;
    Ok((name.to_owned(), limits))
}

/// `NAME` of `--allow-model`.
fn parse_model_name(s: &str) -> Result<String, String> {
    lastcall_core::model_choice::AllowedModels::parse_name(s)
}

/// `TENANT=WEIGHT` of `--tenant-weight`.
fn parse_tenant_weight(s: &str) -> Result<(String, u32), String> {
    let (name, weight) = s
        .split_once('=')
        .ok_or_else(|| format!("`{s}`: expected TENANT=WEIGHT, e.g. team-a=3"))?;
    lastcall_core::Tenant::parse(name).map_err(|e| format!("tenant `{name}`: {e}"))?;
    let weight = weight
        .parse::<u32>()
        .ok()
        .filter(|w| (1..=1_000).contains(w))
        .ok_or_else(|| format!("weight `{weight}`: expected a whole number from 1 to 1000"))?;
    Ok((name.to_owned(), weight))
}

impl WorkerArgs {
    /// `--slots`, or its default: `auto` for the openai backend (a batching server), 2
    /// for the others.
    pub fn slot_count(&self) -> SlotCount {
        match (self.slots, self.backend) {
            (Some(s), _) => s,
            (None, Some(BackendKind::Openai)) => SlotCount::Auto,
            (None, _) => SlotCount::Fixed(2),
        }
    }
}

#[derive(Debug, Args)]
pub struct WorkerArgs {
    /// Model slots: how many model calls run at once, `N` or `auto` [default: `auto` with
    /// `--backend openai`, else 2].
    ///
    /// `auto` suits a batching server (vLLM, llama.cpp `--parallel`, a hosted API), where a
    /// call is slower the more run beside it but the server completes more per second up
    /// to a knee: the worker moves the number of calls in flight within [1, --max-slots],
    /// one at a time, keeping one more only while it adds at least half of what an average
    /// call in flight adds to the calls completed per second. It judges each call's time
    /// against the time learned for a request of its size (so long prompts are not taken
    /// for congestion), halves the limit when calls turn much slower than learned (a hang),
    /// starts at 1 (2 after its first 4 measured calls), and admits
    /// each job with its call time × the slowdown predicted at the current limit; it raises
    /// the limit only when the calls already running would still end before their
    /// deadlines. `/metrics` shows it as `lastcall_worker_concurrency_limit`. The local
    /// backend does not batch: it keeps a fixed number
    #[arg(long, value_name = "N|auto")]
    pub slots: Option<SlotCount>,
    /// The highest limit of `--slots auto` (its prefetch counts this many slots)
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u16).range(1..=1024))]
    pub max_slots: u16,
    /// Unacked deliveries the broker may push to this worker from each queue it consumes
    /// (the work queue and each of the 7 lanes) [default: 32 × slots, at least 128; with
    /// `--slots auto`, 32 × --max-slots]. Large on purpose: jobs beyond what the slots can
    /// finish in time are taken and refused at once, so no tenant's backlog stands in a
    /// broker queue ahead of another's (README, "Sharing capacity")
    #[arg(long)]
    pub prefetch: Option<u16>,
    /// Cap on the bytes of message bodies held locally (prefetch only bounds the count)
    #[arg(long, default_value_t = 64 * 1024 * 1024)]
    pub max_buffer_bytes: usize,
    /// Which job waiting in the local buffer gets the next free model slot (`lastcall bench
    /// goodput --order` compares the two). Whatever the order, a job that can no longer finish leaves the
    /// buffer as soon as that is known
    #[arg(long, value_enum, default_value = "edf")]
    pub buffer_order: BufferOrderArg,
    /// A tenant's weight in the fair share of model time, `TENANT=WEIGHT` (repeatable;
    /// `[worker] tenant_weight = ["team-a=3"]`). Under overload the tenants with jobs
    /// waiting share the slots in proportion to their weights; a tenant not named weighs 1.
    /// Give every worker the same weights
    #[arg(long = "tenant-weight", value_name = "TENANT=WEIGHT", value_parser = parse_tenant_weight, action = clap::ArgAction::Append)]
    pub tenant_weight: Vec<(String, u32)>,
    /// The tenants' weights from `serve`'s tokens file (the same file: only the `tenant`
    /// and `weight` of each entry are read). A `--tenant-weight` for a tenant wins over it.
    /// Read at startup
    #[arg(
        long = "tokens-file",
        value_name = "FILE",
        env = "LASTCALL_TOKENS_FILE"
    )]
    pub tokens_file: Option<std::path::PathBuf>,
    /// What to do with a job found expired before its model call
    #[arg(long, value_enum, default_value = "ack")]
    pub expired_action: ExpiredActionArg,
    /// `require` stops admission while the kernel does not report the clock as synchronised
    #[arg(long, default_value = "ignore", value_parser = ["ignore", "require"])]
    pub clock_sync: String,
    /// How long shutdown (SIGINT/SIGTERM) waits for running model calls, in ms
    #[arg(long, default_value_t = 10_000)]
    pub shutdown_grace_ms: u64,
    /// Model backend [default: `local`, the embedded model, when this build has it; else
    /// required]. `sim` is a load generator for tests and benchmarks, never a model
    #[arg(long, value_enum)]
    pub backend: Option<BackendKind>,
    #[command(flatten)]
    pub sim: SimArgs,
    #[command(flatten)]
    pub openai: OpenAiArgs,
    /// Local backend: the GGUF file [default: the one `scripts/setup-model.sh` installed]
    #[arg(long, env = "LASTCALL_MODEL_PATH")]
    pub model_path: Option<PathBuf>,
    /// Attempts per job, counting the first, for retryable backend errors
    #[arg(long, default_value_t = 3)]
    pub max_attempts: u32,
    /// Model calls started for one job after which it is failed as poison
    #[arg(long, default_value_t = 3)]
    pub max_starts: u32,
    /// Keep every job that passes the receipt check in the local buffer, even when its
    /// expected wait for a slot (jobs ahead × mean call time ÷ slots) would leave it too
    /// little budget. By default such a job is refused at once as `expired_not_started`
    /// (reason `receipt:expected_wait_exceeds_budget`) instead of at the last admission
    /// check, so that its prefetch place goes to a job that can still make it.
    #[arg(long)]
    pub no_wait_refusal: bool,
    /// Worker name recorded in the ledger [default: host:pid]
    #[arg(long)]
    pub name: Option<String>,
    /// Give up when the broker, or then the ledger, cannot be reached for this long at
    /// startup, in ms [default: wait forever]. A lost connection later is always retried
    /// (with backoff and jitter, failing over through the nodes of a comma-separated
    /// --amqp-url)
    #[arg(long, value_name = "MS")]
    pub connect_timeout_ms: Option<u64>,
    /// The broker's consumer timeout (RabbitMQ `consumer_timeout`, 1800000 by default), in
    /// ms: each model call is then cut before a delivery's ack window closes (recorded
    /// `failed`/`consumer_timeout`) instead of the broker closing the channel. RabbitMQ 3.10
    /// does not publish the value over its management API: state it here. Unknown: the
    /// broker closing the channel is survived like any lost channel (reconnect, no second
    /// model call)
    #[arg(long, env = "LASTCALL_CONSUMER_TIMEOUT_MS", value_name = "MS")]
    pub consumer_timeout_ms: Option<u64>,
    /// Consecutive server-side failures of a model server (connect errors, 5xx, a 429
    /// without Retry-After, hung calls) that open its circuit breaker: no call goes to it
    /// until the cool-down ends, then one trial call
    #[arg(long, env = "LASTCALL_BREAKER_FAILURES", default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..))]
    pub breaker_failures: u32,
    /// The first cool-down of an open circuit breaker (a server's longer Retry-After wins,
    /// up to --breaker-max-cool-down-ms); doubled after each failed trial up to
    /// --breaker-max-cool-down-ms; and the least time between two trials: a job that
    /// cannot wait for a longer cool-down's end takes the trial once this has passed
    #[arg(
        long,
        env = "LASTCALL_BREAKER_COOL_DOWN_MS",
        default_value_t = 1_000,
        value_name = "MS"
    )]
    pub breaker_cool_down_ms: u64,
    /// The longest cool-down of an open circuit breaker after repeated failed trials, and
    /// the longest a model server's headers hold it: a `Retry-After` or an
    /// `x-ratelimit-reset-*` further out is cut to this (then a trial call goes)
    #[arg(
        long,
        env = "LASTCALL_BREAKER_MAX_COOL_DOWN_MS",
        default_value_t = 30_000,
        value_name = "MS"
    )]
    pub breaker_max_cool_down_ms: u64,
    /// A backend's rate limits, `BACKEND:rpm=N,tpm=N` (either part; repeatable;
    /// `[worker] rate_limit = ["openai:rpm=60,tpm=90000"]`): requests and tokens per
    /// minute, shared by all slots. BACKEND is `openai`, `sim`, `local`, or a `[routing]`
    /// backend name. A server's `x-ratelimit-*` headers tighten them (and set them for a
    /// backend not named, for 10 min after the server last said so; a request above such a
    /// learned limit goes alone once the bucket is full). A call waits for its permit when the permit comes before the
    /// job's latest useful start; otherwise the job ends at once without a call,
    /// `expired_not_started` / `admission:rate_limited`
    #[arg(long = "rate-limit", value_name = "BACKEND:rpm=N,tpm=N", value_parser = parse_rate_limit, action = clap::ArgAction::Append)]
    pub rate_limit: Vec<(String, lastcall_core::rate_limit::Limits)>,
    /// A model a job's payload may ask for by its `model` field (repeatable;
    /// `[worker] allow_model = ["gpt-4o-mini"]`). The model a call asks for is the route's
    /// `model`, else --model; a payload's `model` is sent only when named here, and
    /// otherwise dropped, so a producer cannot pick a dearer model on your API key
    #[arg(long = "allow-model", value_name = "NAME", value_parser = parse_model_name, action = clap::ArgAction::Append)]
    pub allow_model: Vec<String>,
    #[command(flatten)]
    pub admission: AdmissionArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
    #[command(flatten)]
    pub hooks: TestHookArgs,
    /// Serve Prometheus metrics at http://ADDR/metrics (no auth: bind a private address),
    /// e.g. 127.0.0.1:9464
    #[arg(long, value_name = "ADDR")]
    pub metrics_addr: Option<std::net::SocketAddr>,
    /// Prune the ledger in the background this often, by the [ledger] section's retention
    /// (`lastcall ledger prune --help`): a duration (e.g. 10m, 1h), or `off` (then run
    /// `lastcall ledger prune` yourself). On PostgreSQL one worker prunes at a time
    #[arg(
        long,
        env = "LASTCALL_PRUNE_EVERY",
        default_value = "10m",
        value_name = "DURATION",
        value_parser = parse_prune_every
    )]
    pub prune_every: Keep,
    /// With --metrics-addr: RabbitMQ's management API, for the ready/unacked depth gauges
    /// (when it does not answer, ready counts come from a passive declare)
    #[arg(
        long,
        env = "LASTCALL_MANAGEMENT_URL",
        default_value = "http://127.0.0.1:15672"
    )]
    pub management_url: String,
    /// With --metrics-addr: the management API user (the password comes from
    /// LASTCALL_MANAGEMENT_PASSWORD, default guest)
    #[arg(long, default_value = "guest")]
    pub management_user: String,
    /// Require signed jobs: with this key, a job whose x-lastcall-signature is missing or
    /// does not match its id, deadline and body is recorded `rejected`/`bad_signature`,
    /// dead-lettered and never run. A file holding at least 32 bytes (the same key as the
    /// ingress); else the environment variable LASTCALL_SIGNING_KEY; neither: no check
    #[arg(long, value_name = "FILE")]
    pub signing_key_file: Option<PathBuf>,
}

/// The OpenAI-compatible backend. The API key is read from an environment variable or a
/// file, never from a flag, and never logged.
#[derive(Debug, Args, Clone)]
pub struct OpenAiArgs {
    /// OpenAI backend: base URL of the API, e.g. http://127.0.0.1:8080/v1 (llama.cpp),
    /// http://127.0.0.1:11434/v1 (Ollama), http://127.0.0.1:8000/v1 (vLLM)
    #[arg(
        long,
        env = "LASTCALL_OPENAI_BASE_URL",
        default_value = "http://127.0.0.1:8080/v1"
    )]
    pub base_url: String,
    /// OpenAI backend: model name sent with each request (a route's model overrides it; a
    /// job's payload `model` only when --allow-model names it)
    #[arg(long, env = "LASTCALL_OPENAI_MODEL", default_value = "default")]
    pub model: String,
    /// OpenAI backend: name of the environment variable holding the API key (used if set)
    #[arg(long, default_value = "LASTCALL_API_KEY")]
    pub api_key_env: String,
    /// OpenAI backend: file holding the API key (e.g. a mounted secret)
    #[arg(long)]
    pub api_key_file: Option<PathBuf>,
    /// OpenAI backend: default max_tokens when the job does not set one
    #[arg(long, default_value_t = 256)]
    pub max_tokens: u32,
    /// OpenAI backend: the most max_tokens a job may ask for; a larger request is lowered
    /// to it (a `[[routes]]` entry's `max_tokens` caps its kinds lower still)
    #[arg(long, default_value_t = 4_096, value_parser = clap::value_parser!(u32).range(1..))]
    pub max_tokens_limit: u32,
    /// OpenAI backend: send the job's tier as the request's `priority` for vLLM's
    /// `--scheduling-policy priority` (lower is served earlier: critical -1, standard 0,
    /// batch 1). Off by default: a server that does not know the field may refuse it
    #[arg(long)]
    pub send_priority: bool,
    /// OpenAI backend: send the job's budget left when the request goes out, in whole ms,
    /// in this header (e.g. X-Request-Budget-Ms), for a gateway or server that reads one
    #[arg(long, value_name = "NAME")]
    pub budget_header: Option<String>,
}

/// The simulated backend's behaviour.
#[derive(Debug, Args, Clone)]
pub struct SimArgs {
    /// Sim backend: latency of every call, in ms
    #[arg(long, default_value_t = 200)]
    pub sim_latency_ms: u64,
    /// Sim backend: ± random jitter on the latency, in ms
    #[arg(long, default_value_t = 0)]
    pub sim_jitter_ms: u64,
    /// Sim backend: probability (0–1) of a retryable failure
    #[arg(long, default_value_t = 0.0)]
    pub sim_fail_rate: f64,
    /// Sim backend: append `job_id attempt` per call to this file (call counting across crashes)
    #[arg(long)]
    pub sim_call_log: Option<PathBuf>,
    /// Sim backend: honour the fault kinds — `sim.crash` aborts the worker,
    /// `sim.fail-terminal` / `sim.fail-retryable` fail the call (crash and retry drills).
    /// Off, those kinds are simulated like any other
    #[arg(long)]
    pub sim_faults: bool,
}

#[derive(Debug, Subcommand)]
pub enum JobsCommand {
    /// Show one job's record (and its attempt rows with --attempts)
    Show {
        job_id: String,
        /// Print JSON
        #[arg(long)]
        json: bool,
        /// Also list the per-delivery attempt rows
        #[arg(long)]
        attempts: bool,
    },
    /// List job records
    List {
        /// Only this state (completed, failed, expired_not_started, expired_before_receive,
        /// deadline_exceeded, rejected, unknown, cancelled, accepted, running)
        #[arg(long)]
        state: Option<String>,
        /// Only this kind
        #[arg(long)]
        kind: Option<String>,
        /// Only this tenant's jobs (`default`: the jobs that named no tenant)
        #[arg(long, value_parser = parse_tenant)]
        tenant: Option<lastcall_core::Tenant>,
        /// At most this many records
        #[arg(long, default_value_t = 1000)]
        limit: i64,
        /// Print one JSON array
        #[arg(long)]
        json: bool,
    },
}

#[derive(Debug, Subcommand)]
pub enum TopologyCommand {
    /// Declare exchanges, queues and bindings; harmless to repeat
    Apply(TopologyApplyArgs),
    /// Delete the prefix's exchanges and queues, with the jobs still in them
    ///
    /// Removes `{prefix}.jobs`, `{prefix}.dlx`, the work, dead-letter, parked, per-reason
    /// and retry queues (one per --retry-delays-ms) of the prefix. Asks for confirmation on
    /// a terminal and shows how many messages each queue still holds; without a terminal it
    /// refuses unless --yes is given. The ledger is not touched.
    Delete(TopologyDeleteArgs),
}

#[derive(Debug, Args)]
pub struct TopologyDeleteArgs {
    /// Delete without asking
    #[arg(long, short)]
    pub yes: bool,
    /// Delays of the retry queues to delete, in ms (as given to `topology apply`)
    #[arg(long, value_delimiter = ',', default_value = "1000,5000,30000")]
    pub retry_delays_ms: Vec<u64>,
    /// Also delete the broker policies `topology apply --policies` set, through the
    /// management HTTP API (credentials and vhost come from the AMQP URL)
    #[arg(long)]
    pub policies: bool,
    /// Base URL of RabbitMQ's management API
    #[arg(
        long,
        env = "LASTCALL_MANAGEMENT_URL",
        default_value = "http://127.0.0.1:15672"
    )]
    pub management_url: String,
}

#[derive(Debug, Args)]
pub struct TopologyApplyArgs {
    #[command(flatten)]
    pub topology: TopologyArgs,
    /// Also set the work queue's dead-lettering, overflow and delivery limit as broker
    /// policies through the management HTTP API, so operators see and change them in
    /// RabbitMQ's own tools (credentials and vhost come from the AMQP URL)
    #[arg(long)]
    pub policies: bool,
    /// Base URL of RabbitMQ's management API
    #[arg(
        long,
        env = "LASTCALL_MANAGEMENT_URL",
        default_value = "http://127.0.0.1:15672"
    )]
    pub management_url: String,
}

/// `lastcall dlq` (see the subcommand's help).
#[derive(Debug, Args)]
pub struct DlqArgs {
    /// Copy malformed dead letters (no valid envelope) to `{prefix}.parked` for a human
    /// before acking them; they are recorded under a synthetic id either way
    #[arg(long)]
    pub park: bool,
    /// Also copy every dead letter to `{prefix}.dead.<reason>` (expired, rejected, maxlen,
    /// delivery_limit, other), so format errors can be watched apart from expiries
    #[arg(long)]
    pub split_by_reason: bool,
    /// Exit after no dead letter arrived for this many ms (default: run until SIGINT/SIGTERM)
    #[arg(long, value_name = "N")]
    pub idle_exit_ms: Option<u64>,
    /// Give up when the broker, or then the ledger, cannot be reached for this long at
    /// startup, in ms [default: wait forever]
    #[arg(long, value_name = "N")]
    pub connect_timeout_ms: Option<u64>,
    /// The workers' signing key: a dead letter whose x-lastcall-signature is missing or
    /// wrong is recorded rejected/bad_signature under a synthetic id, never under the job
    /// id it claims. A file holding at least 32 bytes; else the environment variable
    /// LASTCALL_SIGNING_KEY; neither: no check. Use it whenever the workers have a key
    #[arg(long, value_name = "FILE")]
    pub signing_key_file: Option<PathBuf>,
    #[command(flatten)]
    pub topology: TopologyArgs,
}

/// `lastcall reconcile` (see the subcommand's help).
#[derive(Debug, Args)]
pub struct ReconcileArgs {
    /// Time after a job's deadline during which a missing outcome is still expected, in ms
    /// (the dead-letter processor and in-flight writes need a moment)
    #[arg(long, default_value_t = 5_000, value_name = "N")]
    pub grace_ms: u64,
    /// Exit 0 even when `unknown` jobs exist
    #[arg(long)]
    pub allow_unknown: bool,
    /// Print one JSON object: {"marked_unknown": [ids], "counts": {state: n}, "unknown": n,
    /// "pending": n, "total": n}
    #[arg(long)]
    pub json: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum ReportFormat {
    /// Aligned text tables
    Table,
    /// One JSON object
    Json,
    /// `section,key,count,p50_ms,p90_ms,p99_ms,max_ms` rows
    Csv,
}

/// `lastcall report` (see the subcommand's help).
#[derive(Debug, Args)]
pub struct ReportArgs {
    /// Window ending now: a number with a unit, `ms`, `s`, `m`, `h` or `d` (e.g. 24h, 90m, 3600s)
    #[arg(long, default_value = "24h", value_name = "DURATION")]
    pub since: String,
    /// Output format
    #[arg(long, value_enum, default_value = "table")]
    pub format: ReportFormat,
    /// Only this tenant's jobs (the per-tenant table then has its one row)
    #[arg(long, value_parser = parse_tenant)]
    pub tenant: Option<lastcall_core::Tenant>,
}

/// `lastcall serve` (see the subcommand's help).
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// Address to listen on
    #[arg(long, default_value = "127.0.0.1:8080")]
    pub addr: std::net::SocketAddr,
    /// Serve HTTPS with this certificate chain (PEM: the server certificate first, then any
    /// intermediates); needs --tls-key. Without both: plain HTTP (docs/tls.md)
    #[arg(
        long,
        value_name = "FILE",
        env = "LASTCALL_TLS_CERT",
        hide_env_values = true,
        requires = "tls_key"
    )]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM: PKCS#8, PKCS#1 or SEC1, unencrypted)
    #[arg(
        long,
        value_name = "FILE",
        env = "LASTCALL_TLS_KEY",
        hide_env_values = true,
        requires = "tls_cert"
    )]
    pub tls_key: Option<PathBuf>,
    /// File holding the bearer token (else the environment variable LASTCALL_HTTP_TOKEN):
    /// the operator's token, which may use every route and submit for any tenant
    #[arg(long)]
    pub token_file: Option<PathBuf>,
    /// Tokens file (TOML): one `[[token]]` per API token with its SHA-256 (`sha256`, from
    /// `lastcall tokens hash`; never the token), the `tenant` it acts for, the tenant's
    /// `weight` (default 1), quotas `jobs_per_second` and `tokens_per_minute` (optional)
    /// and the `kinds` it may submit (optional). A request with such a token is stamped with
    /// its tenant and reads only that tenant's jobs; over a quota it is answered 429
    /// over_quota with Retry-After, nothing published. Read at startup
    #[arg(long, value_name = "FILE", env = "LASTCALL_TOKENS_FILE")]
    pub tokens_file: Option<PathBuf>,
    /// How long to wait for the broker's publisher confirm before answering 503, in ms
    #[arg(long, default_value_t = 5_000)]
    pub confirm_timeout_ms: u64,
    /// Sign every published job with this key (x-lastcall-signature, HMAC-SHA256 over job
    /// id, deadline and body), for workers started with the same key. A file holding at
    /// least 32 bytes; else the environment variable LASTCALL_SIGNING_KEY; neither: unsigned
    #[arg(long, value_name = "FILE")]
    pub signing_key_file: Option<PathBuf>,
    /// Largest accepted request body, in bytes (413 above it)
    #[arg(long, default_value_t = 1_048_576)]
    pub max_body_bytes: usize,
    /// Longest long-poll `GET /v1/jobs/{id}?wait_ms=N` may ask for, in ms (1–60000); the
    /// served OpenAPI document states it
    #[arg(long, default_value_t = 60_000, value_parser = clap::value_parser!(i64).range(1..=60_000))]
    pub max_wait_ms: i64,
    /// Requests that may wait for an outcome at once (long-polls with wait_ms, chat
    /// completions, streams); more are answered 503 too_many_waiting with Retry-After
    #[arg(long, default_value_t = lastcall_http::MAX_WAITING, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_waiting: usize,
    /// Streaming chat requests at once (each holds a broker channel for its token deltas;
    /// RabbitMQ allows 2,047 per connection); more are answered 503 too_many_waiting
    #[arg(long, default_value_t = lastcall_http::MAX_STREAMS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=2_000))]
    pub max_streams: usize,
    /// How long a request body may take to arrive, in ms; past it 408 body_read_timeout
    /// and the connection is closed
    #[arg(long, default_value_t = 10_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub body_read_timeout_ms: u64,
    /// Connections held at once at most; the next one is accepted when one closes
    #[arg(long, default_value_t = lastcall_http::limit::MAX_CONNECTIONS, value_parser = clap::builder::RangedU64ValueParser::<usize>::new().range(1..=1_000_000))]
    pub max_connections: usize,
    /// How long a request's headers may take to arrive, in ms; a slower client's connection
    /// is closed
    #[arg(long, default_value_t = 30_000, value_parser = clap::value_parser!(u64).range(100..=600_000))]
    pub header_read_timeout_ms: u64,
    /// Allow webhooks (`callback_url` of POST /v1/jobs) to URLs under this prefix (same
    /// scheme, host and port; a path under its path), e.g. https://hooks.example.com/lastcall/.
    /// Repeatable, or comma-separated in LASTCALL_WEBHOOK_ALLOW. Without it, a job with a
    /// `callback_url` is refused (422 callback_not_allowed)
    #[arg(
        long,
        value_name = "URL",
        env = "LASTCALL_WEBHOOK_ALLOW",
        value_delimiter = ','
    )]
    pub webhook_allow: Vec<String>,
    /// Sign every webhook body with this key (x-lastcall-webhook-signature: v1=<hex> of
    /// HMAC-SHA256 over the body). A file holding at least 32 bytes; else the environment
    /// variable LASTCALL_WEBHOOK_KEY; neither: unsigned
    #[arg(long, value_name = "FILE")]
    pub webhook_key_file: Option<PathBuf>,
    /// Delivery attempts per webhook at most (backoff 1 s, doubling, at most 30 s apart)
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=20))]
    pub webhook_attempts: u32,
    /// The OpenAI-compatible front door (`POST /v1/chat/completions`): map the request's
    /// `model` to a job kind, NAME=KIND (repeatable, e.g. --model gpt-4o-mini=incident.summary).
    /// Without any, every model maps to the kind `chat`; with some, other models get 404
    #[arg(long = "model", value_name = "NAME=KIND")]
    pub models: Vec<String>,
    /// The front door's budget for a request that states none (no X-Lastcall-Deadline-Ms,
    /// no SDK timeout header), in ms
    #[arg(long, default_value_t = 60_000)]
    pub default_deadline_ms: u64,
    /// The longest a /v1/chat/completions request is held waiting for its outcome, in ms,
    /// however far its deadline; past it the answer is 504 hold_exceeded and the job goes on
    #[arg(long, default_value_t = lastcall_http::front_door::FrontDoor::MAX_HOLD_MS, value_parser = clap::value_parser!(u64).range(1_000..=86_400_000))]
    pub max_hold_ms: u64,
    /// AMQP URL of the outcome-events follower (long-polls, webhooks), whose user needs only the `follower` role of
    /// docs/broker-permissions.md (declare and read `{prefix}.events.follow.*`, read
    /// `{prefix}.events`) [default: --amqp-url]
    #[arg(long, env = "LASTCALL_EVENTS_AMQP_URL", hide_env_values = true)]
    pub events_amqp_url: Option<String>,
    /// RabbitMQ management API for ready/unacked counts (else a passive declare: ready only)
    #[arg(long, default_value = "http://127.0.0.1:15672")]
    pub management_url: String,
    /// Management API user (the password comes from LASTCALL_MANAGEMENT_PASSWORD, default guest)
    #[arg(long, default_value = "guest")]
    pub management_user: String,
    /// Do not use the management API (also turns shedding off)
    #[arg(long)]
    pub no_management: bool,
    /// Do not shed: accept even a job that the estimated queue wait (ready ÷ the work
    /// queue's recent ack rate, from the management API) would make expire. Without it
    /// such a job is answered 429 would_expire_in_queue with Retry-After, never published
    #[arg(long)]
    pub no_shed: bool,
    /// Override (repeatable): a worker's metrics URL, e.g. http://127.0.0.1:9464/metrics,
    /// whose gauges the dashboard sums instead of the live numbers every worker publishes
    /// through its lease in the ledger (found without wiring)
    #[arg(long, value_name = "URL")]
    pub worker_metrics: Vec<String>,
    /// Also run the dead-letter processor in this process (its counters go to /metrics)
    #[arg(long)]
    pub dlq: bool,
    /// Give up when the broker, or then the ledger, cannot be reached for this long at
    /// startup, in ms [default: wait forever]. Meanwhile the address answers: /healthz 200,
    /// /readyz 503 naming what is awaited, everything else 503 `starting` with Retry-After
    #[arg(long, value_name = "N")]
    pub connect_timeout_ms: Option<u64>,
    #[command(flatten)]
    pub admission: AdmissionArgs,
    #[command(flatten)]
    pub topology: TopologyArgs,
}

#[cfg(test)]
mod tests {
    use super::*;
    use lastcall_core::rate_limit::Limits;

    #[test]
    fn rate_limits_name_a_backend_and_its_limits() {
        assert_eq!(
            parse_rate_limit("openai:rpm=60,tpm=90000"),
            Ok((
                "openai".to_owned(),
                Limits {
                    requests_per_minute: Some(60),
                    tokens_per_minute: Some(90_000),
                }
            ))
        );
        assert_eq!(
            parse_rate_limit("code:tpm=1000").map(|(_, l)| l.requests_per_minute),
            Ok(None)
        );
        for bad in [
            "openai",
            ":rpm=1",
            "openai:",
            "openai:rpm=0",
            "openai:qps=3",
        ] {
            assert!(parse_rate_limit(bad).is_err(), "{bad}");
        }
    }
}
