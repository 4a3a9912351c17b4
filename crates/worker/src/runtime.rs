//! The worker: receive → validate → wait for a slot → last admission check → model call
//! → durable outcome → ack.
//!
//! **Invariant:** the ack (or reject) of a delivery happens only after its outcome is in
//! the ledger. **Invariant:** no model call starts unless [`WorkerPolicy::on_slot`]
//! returned `Run` immediately before it. **Invariant:** local buffering is bounded: at
//! most `prefetch` deliveries (broker-enforced) and at most `max_buffer_bytes` of bodies.

use crate::clock::{Clock, ClockSyncMode};
use crate::settle::{AckBatch, Door, Ticket};
use crate::slots::{BufferOrder, SlotPermit, Slots};
use crate::stats::WorkerStats;
use crate::store_retry::StoreHealth;
use lastcall_backend::{Backend, BackendError, CallOutput, CallRequest, CancellationToken};
use lastcall_broker::{
    Broker, Incoming, IncomingStream, PublishProps, Publisher, Settler, Topology,
};
use lastcall_core::ack_window::{self, CallTimeout};
use lastcall_core::disposition::ReceiptFacts;
use lastcall_core::disposition::{Receipt, Slot};
use lastcall_core::service_time::{Estimate, ServiceTimeConfig, ServiceTimes};
use lastcall_core::{
    CallResult, Disposition, Envelope, JobId, RejectError, Terminal, WorkerPolicy, synthetic_job_id,
};
use lastcall_store::{AttemptStart, Ledger, LedgerWrite, OutcomeRecord};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};
use tokio::sync::Semaphore;
use tokio::task::JoinSet;
use tracing::Instrument;

/// Fault injection for crash tests. Never set in production.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// Stop forever right after an outcome is stored, before the ack, logging
    /// `fault: paused after store`, so a test can SIGKILL the process at exactly that point.
    PauseAfterStore,
}

/// Which deadline checks the worker runs. **A benchmark reference only** (`lastcall bench
/// goodput` compares the policies): production workers always use [`DispatchPolicy::Deadline`],
/// and the CLI's `worker` command has no flag for the others.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DispatchPolicy {
    /// lastcall's rule: check at receipt and again immediately before the model call.
    #[default]
    Deadline,
    /// Check at receipt only, as Celery does with `expires`; a job that waited for a slot
    /// past its deadline still runs, and its call runs to the end (no deadline timeout).
    ReceiptOnly,
    /// No deadline check at all: every valid job runs to the end.
    Naive,
}

/// The call budget of the reference policies, which have no deadline timeout.
const UNBOUNDED_BUDGET_MS: u64 = 3_600_000;

/// Everything a worker needs besides its adapters.
#[derive(Debug, Clone)]
pub struct WorkerConfig {
    pub topology: Topology,
    /// Worker name recorded in the ledger.
    pub name: String,
    /// Model slots: concurrent model calls.
    pub slots: usize,
    /// Unacked deliveries the broker may push to this worker (default 2 × slots).
    pub prefetch: u16,
    /// Cap on the bytes of bodies held locally; prefetch only bounds the count.
    pub max_buffer_bytes: usize,
    pub policy: WorkerPolicy,
    pub clock_sync: ClockSyncMode,
    /// How long shutdown waits for in-flight work before handing it back.
    pub shutdown_grace: Duration,
    /// How long to wait for a backend to confirm a cancellation at the deadline.
    pub cancel_grace: Duration,
    pub fault: Option<Fault>,
    /// Deliberate local wait between getting a slot and the admission check. Zero in
    /// production; used to reproduce the seed's experiment (work delivered in time that
    /// waits locally past its deadline).
    pub hold_before_admission: Duration,
    /// Benchmark reference only: which deadline checks run (default: all of them).
    pub dispatch_policy: DispatchPolicy,
    /// Which waiting job gets a free model slot ([`crate::slots`]).
    pub buffer_order: BufferOrder,
    /// When set, a valid envelope whose `x-lastcall-signature` is missing or wrong is
    /// `rejected`/`bad_signature` (never run), so a producer cannot extend its deadline.
    pub signing_key: Option<lastcall_core::SigningKey>,
    /// The broker's consumer timeout (RabbitMQ `consumer_timeout`), when known: each model
    /// call is capped to end inside the delivery's ack window
    /// ([`lastcall_core::ack_window`]). `None`: unknown, the job's budget alone decides and a
    /// broker that closes the channel is survived like any lost channel.
    pub consumer_timeout: Option<Duration>,
}

impl WorkerConfig {
    pub fn new(prefix: &str, slots: usize) -> Self {
        Self {
            topology: Topology::new(prefix),
            name: default_worker_name(),
            slots,
            prefetch: (slots * 2).clamp(1, u16::MAX as usize) as u16,
            max_buffer_bytes: 64 * 1024 * 1024,
            policy: WorkerPolicy::default(),
            clock_sync: ClockSyncMode::Ignore,
            shutdown_grace: Duration::from_secs(10),
            cancel_grace: Duration::from_millis(500),
            fault: None,
            hold_before_admission: Duration::ZERO,
            dispatch_policy: DispatchPolicy::Deadline,
            buffer_order: BufferOrder::default(),
            signing_key: None,
            consumer_timeout: None,
        }
    }
}

/// `host:pid`.
pub fn default_worker_name() -> String {
    let host = std::fs::read_to_string("/etc/hostname")
        .map(|s| s.trim().to_owned())
        .unwrap_or_else(|_| "host".into());
    format!("{host}:{}", std::process::id())
}

/// Shared state of one running worker.
struct Ctx {
    cfg: WorkerConfig,
    ledger: Arc<Ledger>,
    backend: Arc<dyn Backend>,
    clock: Arc<dyn Clock>,
    stats: Arc<WorkerStats>,
    slots: Arc<Slots>,
    /// The retry publisher of the current broker connection (replaced on reconnect).
    publisher: std::sync::RwLock<Publisher>,
    health: StoreHealth,
    /// Fires on shutdown: waiting jobs are handed back, store retries stop.
    shutdown: CancellationToken,
    nonce: String,
    /// The settlement door: group commit of the starts and outcomes that must be durable
    /// before a call or an ack, and every ack, reject and requeue.
    door: Door,
    /// Jobs whose model call runs in this process now, by job id: a redelivery of one of
    /// them (after a reconnect) waits for that call to settle instead of calling again.
    in_flight:
        std::sync::Mutex<std::collections::HashMap<String, tokio::sync::watch::Receiver<()>>>,
    /// Learned model call durations per `kind|backend` ([`ServiceTimes`]): the admission
    /// rule's minimum useful runtime when a job sets none, and the expected wait.
    service: std::sync::Mutex<ServiceTimes>,
    /// Outcome events, published after each durable terminal outcome (best-effort).
    events: lastcall_broker::EventSink,
    /// Token deltas of streaming calls, to each job's `reply_to` (best-effort, bounded).
    deltas: lastcall_broker::DeltaSink,
    /// Jobs in this process (waiting for a slot or running), by job id: a cancellation
    /// broadcast (`{prefix}.control`) fires the token, which ends the wait or aborts the
    /// call. The count is the deliveries sharing it.
    cancels: std::sync::Mutex<std::collections::HashMap<String, (CancellationToken, usize)>>,
}

impl Ctx {
    /// The estimator key of a kind: one backend per worker (or per kind when routed).
    fn service_key(&self, kind: &str) -> String {
        format!("{kind}|{}", self.backend.name())
    }

    /// What is learned about `kind`'s calls at `now_ms`.
    fn learned(&self, kind: &str, now_ms: i64) -> Option<Estimate> {
        let key = self.service_key(kind);
        let service = self.service.lock().unwrap_or_else(|e| e.into_inner());
        service.estimate(&key, now_ms)
    }

    /// A cancellation broadcast for `job_id`: end its wait or abort its call here.
    fn cancel_local(&self, job_id: &str) {
        let map = self.cancels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((token, _)) = map.get(job_id) {
            tracing::info!(job_id, "cancellation requested: stopping the job here");
            token.cancel();
        }
    }

    /// One call of `kind` took `ms` (completed, or cut at the deadline: a lower bound).
    fn observe_call(&self, kind: &str, ms: i64, now_ms: i64) {
        let key = self.service_key(kind);
        let estimate = {
            let mut service = self.service.lock().unwrap_or_else(|e| e.into_inner());
            service.observe(&key, ms.max(0) as u64, now_ms);
            service.estimate(&key, now_ms)
        };
        if let Some(e) = estimate {
            self.stats.metrics.set_learned(kind, e.quantile_ms);
        }
    }
}

/// A worker, built and ready to run.
pub struct Worker {
    ctx: Arc<Ctx>,
    broker: Broker,
}

impl std::fmt::Debug for Worker {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Worker")
            .field("name", &self.ctx.cfg.name)
            .finish_non_exhaustive()
    }
}

impl Worker {
    /// Connect, apply the topology (idempotent) and prepare the retry publisher.
    pub async fn build(
        cfg: WorkerConfig,
        broker: Broker,
        ledger: Arc<Ledger>,
        backend: Arc<dyn Backend>,
        clock: Arc<dyn Clock>,
        stats: Arc<WorkerStats>,
    ) -> Result<Self, WorkerError> {
        cfg.topology
            .apply(&broker)
            .await
            .map_err(|e| WorkerError::Setup(e.to_string()))?;
        // Retries are published on a connection of their own: under a resource alarm the
        // broker blocks publishing connections, and acks must never wait behind that.
        let publish_broker = broker
            .another()
            .await
            .map_err(|e| WorkerError::Setup(e.to_string()))?;
        let publisher = Publisher::new(&publish_broker, Duration::from_secs(5))
            .await
            .map_err(|e| WorkerError::Setup(e.to_string()))?;
        let nonce = format!(
            "{:x}",
            crate::clock::now_ms() ^ (std::process::id() as i64) << 20
        );
        let names_events = cfg.topology.names.events_exchange.clone();
        let (health, shutdown) = (StoreHealth::default(), CancellationToken::new());
        let door = Door::spawn(
            ledger.clone(),
            health.clone(),
            shutdown.clone(),
            stats.clone(),
            clock.clone(),
        );
        let ctx = Ctx {
            door,
            service: std::sync::Mutex::new(ServiceTimes::new(ServiceTimeConfig::default())),
            in_flight: std::sync::Mutex::new(std::collections::HashMap::new()),
            slots: Arc::new(Slots::new(cfg.slots.max(1), cfg.buffer_order)),
            cfg,
            ledger,
            backend,
            clock,
            stats,
            publisher: std::sync::RwLock::new(publisher),
            health,
            shutdown,
            nonce,
            events: lastcall_broker::EventSink::spawn(&broker, &names_events),
            deltas: lastcall_broker::DeltaSink::spawn(&broker),
            cancels: std::sync::Mutex::new(std::collections::HashMap::new()),
        };
        ctx.stats
            .metrics
            .attach(ctx.slots.clone(), ctx.cfg.prefetch);
        Ok(Self {
            ctx: Arc::new(ctx),
            broker,
        })
    }

    /// Consume until `stop` fires; then stop consuming, let in-flight work finish within
    /// the grace period, hand back what is left, and close.
    ///
    /// A lost broker connection does not end the worker: running model calls go on and
    /// record their outcomes (their acks belonged to the dead channel and are dropped; the
    /// broker redelivers those jobs and they are acked as duplicates), jobs waiting for a
    /// slot are dropped locally (redelivered, checked again), and the worker reconnects
    /// with backoff, declares its topology again and resumes — each connection is a
    /// *generation* with its own channel, delivery tags and ack bookkeeping, so an ack
    /// never crosses generations. Only `stop` (or a setup error) ends `run`.
    pub async fn run(self, stop: CancellationToken) -> Result<(), WorkerError> {
        let ctx = self.ctx;
        let cfg = &ctx.cfg;
        let mut broker = self.broker;
        let mut tasks = JoinSet::new();
        ctx.stats.ledger_healthy.store(true, Ordering::Relaxed);
        let lease_stop = CancellationToken::new();
        let lease = tokio::spawn(renew_lease(ctx.clone(), lease_stop.clone()));
        // `/readyz`'s ledger check follows every write's result at once, also while the
        // receive loop waits for a delivery (a full buffer of jobs whose writes fail).
        let mirror = {
            let (mut health, stats) = (ctx.health.subscribe(), ctx.stats.clone());
            tokio::spawn(async move {
                while health.changed().await.is_ok() {
                    let healthy = *health.borrow_and_update();
                    stats.ledger_healthy.store(healthy, Ordering::Relaxed);
                }
            })
        };
        // Cancellation broadcasts (`{prefix}.control`), on a connection of their own.
        let control = {
            let ctx2 = ctx.clone();
            tokio::spawn(lastcall_broker::events::follow_control(
                broker.clone(),
                cfg.topology.names.control_exchange.clone(),
                lease_stop.clone(),
                move |_, body| {
                    if let Some(m) = lastcall_core::event::ControlMessage::from_json(body) {
                        ctx2.cancel_local(&m.cancel);
                    }
                },
                |_| {},
            ))
        };
        tracing::info!(worker = %cfg.name, slots = cfg.slots, prefetch = cfg.prefetch, queue = %cfg.topology.names.work_queue, node = %broker.node(), "worker started");
        let mut first = true;
        let mut number = 0;
        let last = loop {
            number += 1;
            let generation = match Generation::open(&ctx, &broker, number).await {
                Ok(g) => g,
                Err(e) if first => {
                    lease_stop.cancel();
                    mirror.abort();
                    return Err(e);
                }
                Err(e) => {
                    tracing::warn!(error = %e, "could not resume on the new connection");
                    match reconnect(&ctx, &broker, &stop).await {
                        Some(b) => {
                            broker = b;
                            continue;
                        }
                        None => break None,
                    }
                }
            };
            first = false;
            ctx.stats.broker_connected.store(true, Ordering::Relaxed);
            let mut generation = generation;
            match receive(&ctx, &mut generation, &stop, &mut tasks).await {
                End::Stop => break Some(generation),
                End::Lost(why) => {
                    ctx.stats.broker_connected.store(false, Ordering::Relaxed);
                    WorkerStats::inc(&ctx.stats.reconnects);
                    tracing::warn!(reason = %why, "broker connection lost: running calls go on, waiting jobs are dropped (the broker redelivers them); reconnecting");
                    generation.abandon().await;
                    broker.close().await;
                    match reconnect(&ctx, &broker, &stop).await {
                        Some(b) => broker = b,
                        None => break None,
                    }
                }
            }
        };
        // Graceful shutdown: no new deliveries; waiting jobs go back; running ones get the grace period.
        if let Some(g) = &last {
            bounded("cancelling the consumer", g.stream.cancel()).await;
            g.stop_relay().await;
        }
        ctx.shutdown.cancel();
        let grace = tokio::time::sleep(cfg.shutdown_grace);
        tokio::pin!(grace);
        loop {
            tokio::select! {
                r = tasks.join_next() => match r {
                    Some(done) => log_task_end(&ctx.stats, done),
                    None => break,
                },
                _ = &mut grace => {
                    tracing::warn!(left = tasks.len(), "shutdown grace period over; handing unfinished deliveries back to the broker");
                    tasks.abort_all();
                    break;
                }
            }
        }
        // Ack what finished, then close the channel (unsettled deliveries go back).
        if let Some(g) = last {
            g.flush_stop.cancel();
            if let Some(Err(e)) = bounded("the last ack flush", g.flusher).await {
                tracing::warn!(error = %e, "the ack flusher task failed");
            }
            bounded("closing the channel", g.stream.close()).await;
        }
        lease_stop.cancel();
        mirror.abort();
        let _ = lease.await;
        let _ = tokio::time::timeout(Duration::from_secs(2), control).await;
        // The events of the last outcomes (best-effort, bounded like every shutdown step).
        ctx.events.close(Duration::from_secs(2)).await;
        ctx.door.close().await;
        bounded("closing the connection", broker.close()).await;
        ctx.stats.broker_connected.store(false, Ordering::Relaxed);
        tracing::info!(worker = %cfg.name, "worker stopped");
        Ok(())
    }
}

/// Reconnect with backoff (bounded by nothing but `stop`), declare the topology again and
/// make a new retry publisher. `None`: stopping.
async fn reconnect(ctx: &Ctx, old: &Broker, stop: &CancellationToken) -> Option<Broker> {
    loop {
        let broker = old.reconnect(stop, None).await?;
        let ready = async {
            ctx.cfg
                .topology
                .apply(&broker)
                .await
                .map_err(|e| e.to_string())?;
            let publish_broker = broker.another().await.map_err(|e| e.to_string())?;
            Publisher::new(&publish_broker, Duration::from_secs(5))
                .await
                .map_err(|e| e.to_string())
        };
        match ready.await {
            Ok(p) => {
                *ctx.publisher.write().unwrap_or_else(|e| e.into_inner()) = p;
                tracing::info!(node = %broker.node(), "broker connection restored: topology declared, consuming again");
                return Some(broker);
            }
            Err(e) => {
                tracing::warn!(error = %e, "reconnected, but declaring the topology failed; retrying");
                broker.close().await;
                tokio::select! {
                    _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                    _ = stop.cancelled() => return None,
                }
            }
        }
    }
}

/// One broker connection's consumer and the tasks tied to its channel.
struct Generation {
    stream: IncomingStream,
    /// The deliveries of this channel, for coalesced acks; tags are per channel.
    acks: AckBatch,
    flusher: tokio::task::JoinHandle<()>,
    flush_stop: CancellationToken,
    relay_task: tokio::task::JoinHandle<Result<(), String>>,
    relay_stop: CancellationToken,
    /// Fires when the connection is lost: jobs of this generation still waiting for a
    /// slot are dropped (their deliveries cannot be settled any more).
    lost: CancellationToken,
}

/// Why the receive loop ended.
enum End {
    Stop,
    Lost(String),
}

impl Generation {
    async fn open(ctx: &Arc<Ctx>, broker: &Broker, number: u64) -> Result<Self, WorkerError> {
        let cfg = &ctx.cfg;
        let stream = IncomingStream::open(
            broker,
            &cfg.topology.names.work_queue,
            cfg.prefetch,
            &format!("lastcall-worker-{}", ctx.nonce),
        )
        .await
        .map_err(|e| WorkerError::Setup(e.to_string()))?;
        // Due retries come back through the relay, with the remaining budget as their TTL.
        let publisher = ctx
            .publisher
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        let relay = crate::relay::RetryRelay::build(
            broker.clone(),
            publisher,
            ctx.ledger.clone(),
            cfg.topology.names.clone(),
            ctx.clock.clone(),
            cfg.name.clone(),
            cfg.policy.admission,
        )
        .await
        .map_err(WorkerError::Setup)?
        .with_events(ctx.events.clone());
        let relay_stop = CancellationToken::new();
        let relay_task = tokio::spawn(relay.run(relay_stop.clone()));
        let (lost, flush_stop) = (CancellationToken::new(), CancellationToken::new());
        let (acks, flusher) = ctx
            .door
            .open_generation(number, lost.clone(), flush_stop.clone());
        Ok(Self {
            stream,
            acks,
            flusher,
            flush_stop,
            relay_task,
            relay_stop,
            lost,
        })
    }

    async fn stop_relay(&self) {
        self.relay_stop.cancel();
    }

    /// The connection is gone: drop waiting jobs, stop the relay and the flusher (acks on
    /// a dead channel cannot succeed; running calls of this generation still record their
    /// outcomes, and their redeliveries are acked as duplicates).
    async fn abandon(self) {
        self.lost.cancel();
        self.relay_stop.cancel();
        self.flush_stop.cancel();
        let _ = bounded("stopping the retry relay", self.relay_task).await;
        self.flusher.abort();
    }
}

/// The receive loop of one generation: until `stop` or the connection is lost.
async fn receive(
    ctx: &Arc<Ctx>,
    g: &mut Generation,
    stop: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> End {
    let cfg = &ctx.cfg;
    let bytes = Arc::new(Semaphore::new(cfg.max_buffer_bytes.max(1)));
    loop {
        // Stop taking new work while the ledger is failing.
        if !ctx.health.is_healthy() {
            tracing::warn!("ledger unavailable: pausing intake until it recovers");
            ctx.health.wait_healthy(stop).await;
            if stop.is_cancelled() {
                return End::Stop;
            }
            tracing::info!("ledger available again: intake resumed");
        }
        while let Some(done) = tasks.try_join_next() {
            log_task_end(&ctx.stats, done);
        }
        let next = tokio::select! {
            _ = stop.cancelled() => return End::Stop,
            n = g.stream.next() => n,
        };
        let incoming = match next {
            None => return End::Lost("the consumer was cancelled or the channel closed".into()),
            Some(Err(e)) => return End::Lost(e.to_string()),
            Some(Ok(i)) => i,
        };
        let received_at_ms = ctx.clock.now_ms();
        WorkerStats::inc(&ctx.stats.received);
        // The stream too: delivery tags start again at 1 after a reconnect.
        let attempt_key = format!(
            "{}:{}-{}:{}",
            ctx.cfg.name, ctx.nonce, incoming.stream, incoming.delivery_tag
        );
        let (incoming, settler) = Msg::split(incoming);
        let ticket = g.acks.register(incoming.delivery_tag, settler, attempt_key);
        // Bound local memory by bytes; a body over the limit is rejected without buffering.
        let size = incoming.body.len();
        let permit = if size > cfg.policy.limits.max_body_bytes {
            None
        } else {
            let n = size.clamp(1, cfg.max_buffer_bytes.max(1)) as u32;
            tokio::select! {
                p = bytes.clone().acquire_many_owned(n) => Some(p.expect("semaphore never closed")),
                _ = stop.cancelled() => {
                    ctx.door.hand_back(ticket).await;
                    return End::Stop;
                }
            }
        };
        WorkerStats::add(&ctx.stats.buffered_bytes, size as i64);
        let ctx2 = ctx.clone();
        let link = Link {
            lost: g.lost.clone(),
        };
        tasks.spawn(async move {
            let _permit = permit;
            handle(ctx2.clone(), incoming, ticket, link, received_at_ms).await;
            WorkerStats::add(&ctx2.stats.buffered_bytes, -(size as i64));
        });
    }
}

/// What ties a job to the generation (channel) its delivery came on.
struct Link {
    lost: CancellationToken,
}

/// A delivery's properties; its [`Settler`] goes into its [`Ticket`].
struct Msg {
    body: Vec<u8>,
    delivery_tag: u64,
    redelivered: bool,
    message_id: Option<String>,
    attempt: u32,
    signature: Option<String>,
    timestamp_s: Option<u64>,
    reply_to: Option<String>,
}

impl Msg {
    fn split(i: Incoming) -> (Self, Settler) {
        let msg = Msg {
            body: i.body,
            delivery_tag: i.delivery_tag,
            redelivered: i.redelivered,
            message_id: i.message_id,
            attempt: i.attempt,
            signature: i.signature,
            timestamp_s: i.timestamp_s,
            reply_to: i.reply_to,
        };
        (msg, i.settler)
    }
}

/// Longest wait for one broker step of the shutdown.
const SHUTDOWN_STEP: Duration = Duration::from_secs(10);

/// One shutdown step, bounded: a broker that stops answering must not hang the worker's
/// exit (unsettled deliveries go back to the queue when the connection drops anyway).
async fn bounded<F: std::future::Future>(what: &str, step: F) -> Option<F::Output> {
    let r = tokio::time::timeout(SHUTDOWN_STEP, step).await.ok();
    if r.is_none() {
        tracing::warn!(
            step = what,
            "shutdown step did not finish within 10 s; going on"
        );
    }
    r
}

fn log_task_end(stats: &WorkerStats, r: Result<(), tokio::task::JoinError>) {
    if let Err(e) = r
        && e.is_panic()
    {
        WorkerStats::inc(&stats.task_panics);
        tracing::error!(error = %e, "a job task panicked; its delivery stays unacked and will be redelivered");
    }
}

/// Errors that stop a worker.
#[derive(Debug, thiserror::Error)]
pub enum WorkerError {
    #[error("worker setup failed: {0}")]
    Setup(String),
    #[error("broker connection lost: {0}")]
    Broker(String),
}

/// Facts gathered about one delivery, carried into the ledger record.
struct Job {
    incoming: Msg,
    /// The delivery's place in its channel's ack bookkeeping; consumed by its settlement.
    ticket: Ticket,
    /// The generation (channel) the delivery came on.
    link: Link,
    parsed: Result<Envelope, RejectError>,
    job_id: JobId,
    received_at_ms: i64,
    checked_at_ms: Option<i64>,
    started_at_ms: Option<i64>,
    finished_at_ms: Option<i64>,
    /// Why the admission rule decided as it did, when a number explains it (the learned
    /// call duration); recorded as the outcome's error text.
    note: Option<String>,
    /// The minimum useful runtime of the last admission decision (own, learned or floor).
    min_runtime_ms: Option<u64>,
    /// Model calls of earlier deliveries of this job (the ledger's count at receipt).
    prior_starts: u32,
}

/// The ledger key of a delivery: the envelope's id; else the `message_id` property the
/// publisher set; else a synthetic id derived from the body, so nothing goes unrecorded.
///
/// A badly signed message is always recorded under a synthetic id, and so is *any*
/// invalid message while signatures are required (`signing`): the id it claims is not to
/// be trusted, and writing `rejected` under it would let anyone who can publish block a
/// real pending job with that id (outcomes are write-once). Its error names the claimed id.
pub(crate) fn job_id_for(
    parsed: &Result<Envelope, RejectError>,
    message_id: Option<&str>,
    body: &[u8],
    signing: bool,
) -> JobId {
    match parsed {
        Ok(e) => e.job_id().clone(),
        Err(_) if signing => synthetic_job_id(body),
        Err(e) if e.reason == lastcall_core::RejectReason::BadSignature => synthetic_job_id(body),
        Err(e) => e
            .job_id
            .clone()
            .or_else(|| message_id.and_then(|m| JobId::parse(m).ok()))
            .unwrap_or_else(|| synthetic_job_id(body)),
    }
}

async fn handle(ctx: Arc<Ctx>, incoming: Msg, ticket: Ticket, link: Link, received_at_ms: i64) {
    let parsed = Envelope::parse(&incoming.body, &ctx.cfg.policy.limits, received_at_ms);
    let parsed = lastcall_core::signature::require_signature(
        ctx.cfg.signing_key.as_ref(),
        parsed,
        &incoming.body,
        incoming.signature.as_deref(),
        incoming.message_id.as_deref(),
    );
    let job_id = job_id_for(
        &parsed,
        incoming.message_id.as_deref(),
        &incoming.body,
        ctx.cfg.signing_key.is_some(),
    );
    let span = tracing::info_span!(
        "job",
        job_id = %job_id,
        attempt = incoming.attempt,
        received_at_ms,
        checked_at_ms = tracing::field::Empty,
        expires_at_ms = tracing::field::Empty,
        redelivered = incoming.redelivered,
    );
    if let Ok(e) = &parsed {
        span.record("expires_at_ms", e.deadline().expires_at_ms());
    }
    ctx.stats.metrics.observe_receipt(
        parsed.as_ref().ok().map(|e| e.deadline().created_at_ms()),
        incoming.attempt,
        incoming.timestamp_s,
        received_at_ms,
    );
    let job = Job {
        incoming,
        ticket,
        link,
        parsed,
        job_id,
        received_at_ms,
        checked_at_ms: None,
        started_at_ms: None,
        finished_at_ms: None,
        note: None,
        min_runtime_ms: None,
        prior_starts: 0,
    };
    process(ctx, job).instrument(span).await;
}

async fn process(ctx: Arc<Ctx>, mut job: Job) {
    // Receipt: validation, a first deadline check, duplicate and poison detection.
    let id = job.job_id.to_string();
    // A redelivery of a job whose call still runs here (its first delivery's channel was
    // lost): hold it, without a slot, until that call has settled; the ledger then says
    // it is recorded and it is acked as a duplicate — no second model call.
    if job.parsed.is_ok() && !wait_for_running_call(&ctx, &job, &id).await {
        return hand_back(job).await;
    }
    let Some(info) = ctx.door.receipt_info(&id).await else {
        return; // shutting down: leave unacked, the broker redelivers
    };
    // A call of this job may still run on another worker (whose connection was lost, so
    // the broker redelivered the job here): hold it, without a slot, while that worker's
    // lease is fresh and its attempt unsettled; then read the ledger again.
    let info = if info.prior_starts > 0 && !info.already_recorded && job.parsed.is_ok() {
        match wait_for_live_attempt_elsewhere(&ctx, &job, &id).await {
            None => return hand_back(job).await,
            Some(true) => {
                let Some(again) = ctx.door.receipt_info(&id).await else {
                    return;
                };
                again
            }
            Some(false) => info,
        }
    } else {
        info
    };
    job.prior_starts = info.prior_starts;
    let learned =
        (job.parsed.as_ref().ok()).and_then(|e| ctx.learned(e.kind().as_str(), job.received_at_ms));
    if let Ok(env) = &job.parsed {
        job.min_runtime_ms = Some(effective_min_runtime(
            &ctx,
            env,
            learned.map(|e| e.quantile_ms),
        ));
    }
    let facts = ReceiptFacts {
        already_recorded: info.already_recorded,
        prior_starts: info.prior_starts,
        cancel_requested: info.cancel_requested,
        expected_wait_ms: job.parsed.as_ref().map_or(0, |env| {
            expected_wait_ms(
                &ctx,
                env.deadline().expires_at_ms(),
                learned.map(|e| e.mean_ms).unwrap_or(0),
            )
        }),
        learned_runtime_ms: learned.map(|e| e.quantile_ms),
    };
    let receipt = ctx
        .cfg
        .policy
        .on_receipt(&job.parsed, facts, job.received_at_ms);
    let receipt = match receipt {
        // Benchmark reference: no receipt check.
        Receipt::Settle(d) if ctx.cfg.dispatch_policy == DispatchPolicy::Naive && is_expiry(&d) => {
            Receipt::WaitForSlot
        }
        r => r,
    };
    let (Receipt::WaitForSlot, Ok(env)) = (receipt.clone(), job.parsed.clone()) else {
        if let Err(e) = &job.parsed {
            tracing::warn!(reason = e.reason.as_str(), error = %e, "rejecting invalid envelope");
        }
        job.note = learned_note(learned, &receipt);
        let disposition = match receipt {
            Receipt::Settle(d) => d,
            // The core keeps only valid envelopes waiting.
            Receipt::WaitForSlot => unreachable_rejection(),
        };
        return settle(&ctx, job, disposition, None).await;
    };

    // Wait for a model slot, in the bounded local buffer (in `--buffer-order`: earliest
    // deadline first or FIFO, `crate::slots`). A job that can no longer finish in time
    // leaves the buffer as soon as that is known, not when it reaches a slot: it is settled
    // at its latest useful start, which frees its prefetch place for a job that can still
    // make it.
    let kind = env.kind().as_str().to_owned();
    let cancel = CancelGuard::register(&ctx, &id);
    let mean_ms = learned.map(|e| e.mean_ms).unwrap_or(0);
    WorkerStats::add(&ctx.stats.waiting, 1);
    let leave_buffer = || WorkerStats::add(&ctx.stats.waiting, -1);
    let acquire = ctx.slots.acquire(env.deadline().expires_at_ms(), mean_ms);
    tokio::pin!(acquire);
    let lost = job.link.lost.clone();
    let permit = loop {
        let now = ctx.clock.now_ms();
        let latest = ctx
            .cfg
            .policy
            .latest_start_ms(&env, ctx.learned(&kind, now).map(|e| e.quantile_ms));
        let until_latest = Duration::from_millis((latest - now).max(0) as u64 + 1);
        let watch_expiry = ctx.cfg.dispatch_policy == DispatchPolicy::Deadline;
        tokio::select! {
            p = &mut acquire => break p,
            _ = ctx.shutdown.cancelled() => {
                leave_buffer();
                return hand_back(job).await;
            }
            _ = lost.cancelled() => {
                leave_buffer();
                return hand_back(job).await;
            }
            _ = cancel.token.cancelled() => {
                leave_buffer();
                return settle(&ctx, job, cancelled_disposition(), None).await;
            }
            _ = tokio::time::sleep(until_latest), if watch_expiry => {
                let now = ctx.clock.now_ms();
                if let Slot::Settle(d) = last_check(&ctx, &env, now) {
                    leave_buffer();
                    // This is the job's last admission check: it counts as one, like the
                    // check at a slot (the dwell histogram matches the ledger's checks).
                    job.checked_at_ms = Some(now);
                    (ctx.stats.metrics.consumer_dwell).observe_ms(now - job.received_at_ms);
                    job.note = learned_note(ctx.learned(&kind, now), &Receipt::Settle(d.clone()));
                    return settle(&ctx, job, d, None).await;
                }
                // Still admissible (the estimate changed): keep waiting.
            }
        }
    };
    leave_buffer();
    if !ctx.cfg.hold_before_admission.is_zero() {
        tokio::time::sleep(ctx.cfg.hold_before_admission).await;
    }

    // Fail closed while the clock's sync state forbids admission: the job keeps waiting
    // (without holding a slot) until sync returns or its deadline passes.
    let permit = match wait_for_clock(&ctx, &env, &job.link.lost, permit).await {
        ClockWait::Ready(p) => p,
        ClockWait::Settle(d) => return settle(&ctx, job, d, None).await,
        ClockWait::Shutdown => return hand_back(job).await,
    };

    // The last admission check, immediately before the model call.
    let checked_at_ms = ctx.clock.now_ms();
    job.checked_at_ms = Some(checked_at_ms);
    tracing::Span::current().record("checked_at_ms", checked_at_ms);
    (ctx.stats.metrics.consumer_dwell).observe_ms(checked_at_ms - job.received_at_ms);
    job.min_runtime_ms = Some(effective_min_runtime(
        &ctx,
        &env,
        ctx.learned(&kind, checked_at_ms).map(|e| e.quantile_ms),
    ));
    let budget_ms = match last_check(&ctx, &env, checked_at_ms) {
        Slot::Run { budget_ms } => budget_ms,
        Slot::Settle(d) => {
            drop(permit);
            job.note = learned_note(
                ctx.learned(&kind, checked_at_ms),
                &Receipt::Settle(d.clone()),
            );
            return settle(&ctx, job, d, None).await;
        }
    };
    (ctx.stats.metrics.remaining_budget).observe_ms(budget_ms as i64);
    // The broker's ack window (its consumer timeout, when known) closed while the job
    // waited for a slot: not started, handed back; the redelivery has a fresh window and
    // the admission rule applies again.
    if ack_window::call_timeout(
        budget_ms,
        job.received_at_ms,
        checked_at_ms,
        ctx.cfg.consumer_timeout.map(|d| d.as_millis() as u64),
        job.min_runtime_ms.unwrap_or(0),
    ) == CallTimeout::AckWindowClosed
    {
        drop(permit);
        tracing::info!(job_id = %id, "the broker's ack window (consumer_timeout) closed while the job waited for a slot: handing it back for redelivery");
        return ctx.door.hand_back(job.ticket).await;
    }

    // From here the call is this process's: a redelivery of the job waits for it.
    let Some(_running) = InFlight::claim(&ctx, &id) else {
        // Another delivery of the same job got here first (a redelivery raced its first
        // delivery): start over from the receipt, which waits for that call.
        drop(permit);
        drop(cancel);
        return Box::pin(process(ctx, job)).await;
    };
    // Durable "started" row first: makes crash loops countable (poison detection).
    let start = AttemptStart {
        attempt_key: job.ticket.attempt_key().to_owned(),
        job_id: id.clone(),
        kind: env.kind().to_string(),
        attempt: job.incoming.attempt,
        created_at_ms: env.deadline().created_at_ms(),
        expires_at_ms: env.deadline().expires_at_ms(),
        worker: ctx.cfg.name.clone(),
        redelivered: job.incoming.redelivered,
        received_at_ms: job.received_at_ms,
        checked_at_ms,
        started_at_ms: checked_at_ms,
    };
    if ctx.door.commit(LedgerWrite::Start(start)).await.is_none() {
        return;
    }
    // The store write took time: re-check so that the call truly starts in time.
    let started_at_ms = ctx.clock.now_ms();
    let budget_ms = match last_check(&ctx, &env, started_at_ms) {
        Slot::Run { budget_ms: b } => b.min(budget_ms),
        Slot::Settle(d) => {
            drop(permit);
            return settle(&ctx, job, d, None).await;
        }
    };
    // The broker's ack window, when its consumer timeout is known: our own timeout fires
    // before the broker would close the channel.
    let (budget_ms, cut_by_ack_window) = match ack_window::call_timeout(
        budget_ms,
        job.received_at_ms,
        started_at_ms,
        ctx.cfg.consumer_timeout.map(|d| d.as_millis() as u64),
        0,
    ) {
        CallTimeout::Run { timeout_ms, capped } => (timeout_ms, capped),
        CallTimeout::AckWindowClosed => {
            // The `running` row's write took the rest of the window (a loaded store). Not
            // started: the attempt is recorded as handed back without a model call (so it
            // counts toward no poison bound and holds no redelivery), and the job goes back
            // to the broker with its deadline; the redelivery has a fresh window.
            drop(permit);
            tracing::info!(job_id = %id, "the broker's ack window (consumer_timeout) closed while the start was written: handing the job back unstarted");
            let rec = outcome_record(&ctx, &job, None, "handed_back", None);
            if ctx.door.commit(LedgerWrite::outcome(rec)).await.is_none() {
                return;
            }
            return ctx.door.hand_back(job.ticket).await;
        }
    };
    if cancel.token.is_cancelled() {
        drop(permit);
        return settle(&ctx, job, cancelled_disposition(), None).await;
    }
    job.started_at_ms = Some(started_at_ms);
    WorkerStats::inc(&ctx.stats.backend_calls);
    WorkerStats::add(&ctx.stats.running, 1);
    let stream = (job.incoming.reply_to.as_deref()).map(|to| {
        crate::stream::CallStream::new(&ctx.deltas, to, id.as_str(), job.incoming.attempt)
    });
    let mut call = call_backend(
        &ctx,
        &env,
        job.incoming.attempt,
        budget_ms,
        &cancel.token,
        stream.as_ref(),
    )
    .await;
    if let Some(s) = &stream {
        s.end();
    }
    if cut_by_ack_window && call.result == CallResult::DeadlineExceeded {
        // Cut at the ack window, before the job's deadline: not `deadline_exceeded`.
        call.result = CallResult::Failed {
            retryable: false,
            reason: ack_window::REASON.to_owned(),
            retry_after_ms: None,
        };
        call.error = Some(ack_window_note(&ctx, budget_ms));
    }
    WorkerStats::add(&ctx.stats.running, -1);
    (ctx.stats.metrics.model_call).observe_ms(call.latency_ms);
    if matches!(
        call.result,
        CallResult::Completed | CallResult::DeadlineExceeded
    ) {
        // A failed call says nothing about how long a useful one takes.
        ctx.observe_call(&kind, call.latency_ms, ctx.clock.now_ms());
    }
    if let Some(u) = call.output.as_ref().and_then(|o| o.usage) {
        let m = &ctx.stats.metrics;
        m.prompt_tokens
            .fetch_add(u.prompt_tokens, std::sync::atomic::Ordering::Relaxed);
        m.completion_tokens
            .fetch_add(u.completion_tokens, std::sync::atomic::Ordering::Relaxed);
    }
    drop(permit);
    let finished_at_ms = ctx.clock.now_ms();
    job.finished_at_ms = Some(finished_at_ms);
    let disposition = ctx.cfg.policy.on_call_result(
        &env,
        job.incoming.attempt,
        &call.result,
        finished_at_ms,
        rand_jitter(),
    );
    settle(&ctx, job, disposition, Some(call)).await;
}

fn ack_window_note(ctx: &Ctx, ran_ms: u64) -> String {
    let ct = ctx.cfg.consumer_timeout.unwrap_or_default().as_millis() as u64;
    format!(
        "cut after {ran_ms} ms, before the deadline: the broker's consumer_timeout ({ct} ms, margin {} ms) would have closed the channel before the ack",
        ack_window::margin_ms(ct)
    )
}

/// The admission check before the call; the benchmark reference policies skip it.
fn last_check(ctx: &Ctx, env: &Envelope, now_ms: i64) -> Slot {
    match ctx.cfg.dispatch_policy {
        DispatchPolicy::Deadline => {
            let learned = ctx.learned(env.kind().as_str(), now_ms);
            ctx.cfg
                .policy
                .on_slot(env, learned.map(|e| e.quantile_ms), now_ms)
        }
        DispatchPolicy::ReceiptOnly | DispatchPolicy::Naive => Slot::Run {
            budget_ms: UNBOUNDED_BUDGET_MS,
        },
    }
}

/// The minimum useful runtime the admission rule applies to `env` now: its own, else the
/// learned call time, else the configured floor.
fn effective_min_runtime(ctx: &Ctx, env: &Envelope, learned_ms: Option<u64>) -> u64 {
    let policy = &ctx.cfg.policy;
    policy
        .min_runtime(env, learned_ms)
        .0
        .unwrap_or(policy.admission.default_min_runtime_ms)
}

/// Shutdown (or a lost connection) while the job waits (for a slot or for clock sync): it
/// never started, so it goes back to the broker unrecorded and is checked again when it is
/// delivered next. On a lost channel the requeue cannot be sent; the broker requeues the
/// delivery itself.
async fn hand_back(job: Job) {
    if job.link.lost.is_cancelled() {
        tracing::info!(
            "connection lost: dropping a waiting job locally (the broker redelivers it)"
        );
    } else {
        tracing::info!("shutdown: handing a waiting job back to the broker");
    }
    job.ticket.requeue().await;
}

/// How often a worker renews its lease in the ledger, and how old a lease may be before
/// the worker is presumed dead (its `running` attempts no longer hold redeliveries back).
const LEASE_RENEW: Duration = Duration::from_secs(2);
const LEASE_TTL_MS: i64 = 10_000;

/// Renew this worker's lease until `stop` fires (one row per worker, not per job).
async fn renew_lease(ctx: Arc<Ctx>, stop: CancellationToken) {
    let mut failing = false;
    loop {
        match ctx
            .ledger
            .heartbeat(&ctx.cfg.name, ctx.clock.now_ms())
            .await
        {
            Ok(()) if failing => {
                failing = false;
                tracing::info!("worker lease renewed again");
            }
            Ok(()) => {}
            Err(e) if !failing => {
                failing = true;
                tracing::warn!(error = %e, "cannot renew the worker lease; other workers may run this worker's jobs again once it expires");
            }
            Err(_) => {}
        }
        let publisher = ctx
            .publisher
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        (ctx.stats.retry_publisher_connected)
            .store(publisher.is_connected().await, Ordering::Relaxed);
        tokio::select! {
            _ = tokio::time::sleep(LEASE_RENEW) => {}
            _ = stop.cancelled() => return,
        }
    }
}

/// While another live worker runs a call of `id`, wait (polling the ledger). `Some(true)`:
/// it did and has settled now (read the ledger again); `Some(false)`: nothing ran
/// elsewhere; `None`: shutdown or this job's connection was lost meanwhile.
async fn wait_for_live_attempt_elsewhere(ctx: &Ctx, job: &Job, id: &str) -> Option<bool> {
    let mut waited = false;
    loop {
        let fresh_since = ctx.clock.now_ms() - LEASE_TTL_MS;
        let live = match ctx
            .ledger
            .live_attempt_elsewhere(id, &ctx.cfg.name, fresh_since)
            .await
        {
            Ok(w) => w,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read worker leases; not holding the job");
                None
            }
        };
        let Some(worker) = live else {
            return Some(waited);
        };
        if !waited {
            tracing::info!(%worker, "a call of this job still runs on another live worker: holding the redelivery until it settles");
            waited = true;
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(500)) => {}
            _ = ctx.shutdown.cancelled() => return None,
            _ = job.link.lost.cancelled() => return None,
        }
    }
}

/// A model call running in this process, registered by job id until it has settled.
struct InFlight {
    ctx: Arc<Ctx>,
    id: String,
    _done: tokio::sync::watch::Sender<()>,
}

impl InFlight {
    /// Register `id`'s call; `None` when one is already registered.
    fn claim(ctx: &Arc<Ctx>, id: &str) -> Option<Self> {
        let mut map = ctx.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if map.contains_key(id) {
            return None;
        }
        let (tx, rx) = tokio::sync::watch::channel(());
        map.insert(id.to_owned(), rx);
        Some(Self {
            ctx: ctx.clone(),
            id: id.to_owned(),
            _done: tx,
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut map = self.ctx.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        map.remove(&self.id);
    }
}

/// Wait until no call of `id` runs in this process. `false`: shutdown or the job's
/// connection was lost meanwhile (hand it back).
/// This delivery's entry in [`Ctx::cancels`]; dropping it unregisters it.
struct CancelGuard {
    ctx: Arc<Ctx>,
    id: String,
    token: CancellationToken,
}

impl CancelGuard {
    fn register(ctx: &Arc<Ctx>, id: &str) -> Self {
        let mut map = ctx.cancels.lock().unwrap_or_else(|e| e.into_inner());
        let entry = map
            .entry(id.to_owned())
            .or_insert_with(|| (CancellationToken::new(), 0));
        entry.1 += 1;
        let token = entry.0.clone();
        drop(map);
        Self {
            ctx: ctx.clone(),
            id: id.to_owned(),
            token,
        }
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let mut map = self.ctx.cancels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = map.get_mut(&self.id) {
            entry.1 -= 1;
            if entry.1 == 0 {
                map.remove(&self.id);
            }
        }
    }
}

/// The disposition of a job cancelled on request before its call.
fn cancelled_disposition() -> Disposition {
    Disposition::RecordThenAck(Terminal {
        state: lastcall_core::State::Cancelled,
        reason: Some(lastcall_core::disposition::CANCEL_REASON.to_owned()),
    })
}

async fn wait_for_running_call(ctx: &Ctx, job: &Job, id: &str) -> bool {
    loop {
        let rx = {
            let map = ctx.in_flight.lock().unwrap_or_else(|e| e.into_inner());
            match map.get(id) {
                None => return true,
                Some(rx) => rx.clone(),
            }
        };
        tracing::info!(
            "redelivery of a job whose model call still runs here: holding it until that call settles"
        );
        let mut rx = rx;
        tokio::select! {
            _ = rx.changed() => {} // the sender is dropped when the call has settled
            _ = ctx.shutdown.cancelled() => return false,
            _ = job.link.lost.cancelled() => return false,
        }
    }
}

/// The core only keeps valid envelopes waiting; should that ever change, the delivery is
/// rejected rather than run.
fn unreachable_rejection() -> Disposition {
    Disposition::RecordThenDeadLetter(Terminal {
        state: lastcall_core::State::Rejected,
        reason: Some("invalid_envelope".into()),
    })
}

/// The expected wait for a slot of a job received now with deadline `expires_at_ms`: the
/// jobs waiting that the buffer order serves first (all of them under FIFO, those with an
/// earlier deadline under EDF) are ahead of it, each with the learned mean duration of its
/// own kind; `own_mean_ms` (this job's kind) stands in when none wait. Zero for the
/// benchmark reference policies, and while nothing is learned.
fn expected_wait_ms(ctx: &Ctx, expires_at_ms: i64, own_mean_ms: u64) -> u64 {
    if ctx.cfg.dispatch_policy != DispatchPolicy::Deadline {
        return 0;
    }
    let (ahead, work_ms) = ctx.slots.ahead_of(expires_at_ms);
    let mean_ms = match (ahead, work_ms) {
        (0, _) | (_, 0) => own_mean_ms,
        (n, w) => w / n as u64,
    };
    lastcall_core::wait::expected_wait_ms(ahead, ctx.slots.available(), ctx.cfg.slots, mean_ms)
}

/// The ledger note of a refusal decided by the learned call duration: which estimate it
/// was, so an operator can see why a job with budget left was not started.
fn learned_note(learned: Option<Estimate>, receipt: &Receipt) -> Option<String> {
    let (
        Some(e),
        Receipt::Settle(Disposition::RecordThenAck(t) | Disposition::RecordThenDeadLetter(t)),
    ) = (learned, receipt)
    else {
        return None;
    };
    let reason = t.reason.as_deref().unwrap_or_default();
    (reason.ends_with(lastcall_core::disposition::BELOW_LEARNED_REASON)
        || reason.ends_with(lastcall_core::disposition::EXPECTED_WAIT_REASON))
    .then(|| {
        format!(
            "learned call duration for this kind: p99 {} ms, mean {} ms over {} calls ({})",
            e.quantile_ms,
            e.mean_ms,
            e.samples,
            match e.source {
                lastcall_core::service_time::EstimateSource::Key => "this kind",
                lastcall_core::service_time::EstimateSource::AllKeys =>
                    "all kinds, none yet of this one",
            }
        )
    })
}

/// Whether the core refused a job as expired (what the naive reference policy ignores).
fn is_expiry(d: &Disposition) -> bool {
    matches!(d, Disposition::RecordThenAck(t) | Disposition::RecordThenDeadLetter(t)
        if t.state == lastcall_core::State::ExpiredNotStarted)
}

/// How the wait for a trusted clock ended.
enum ClockWait {
    /// The clock may be trusted and the job holds a slot again.
    Ready(SlotPermit),
    /// The job can no longer pass the admission check: settle it without a call.
    Settle(Disposition),
    /// The worker is shutting down: hand the job back.
    Shutdown,
}

/// Hold the job until the clock may be trusted, without holding a slot meanwhile.
async fn wait_for_clock(
    ctx: &Ctx,
    env: &Envelope,
    lost: &CancellationToken,
    permit: SlotPermit,
) -> ClockWait {
    if ctx.cfg.clock_sync.admits(ctx.clock.as_ref()) {
        return ClockWait::Ready(permit);
    }
    drop(permit);
    tracing::warn!(state = ?ctx.clock.sync_state(), "clock not known to be synchronised: admission stopped (--clock-sync require)");
    WorkerStats::add(&ctx.stats.waiting, 1);
    let end = loop {
        if let Slot::Settle(d) = last_check(ctx, env, ctx.clock.now_ms()) {
            break ClockWait::Settle(d);
        }
        tokio::select! {
            _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            _ = ctx.shutdown.cancelled() => break ClockWait::Shutdown,
            _ = lost.cancelled() => break ClockWait::Shutdown,
        }
        if ctx.cfg.clock_sync.admits(ctx.clock.as_ref()) {
            break tokio::select! {
                p = ctx.slots.acquire(env.deadline().expires_at_ms(), 0) => ClockWait::Ready(p),
                _ = ctx.shutdown.cancelled() => ClockWait::Shutdown,
            };
        }
    };
    WorkerStats::add(&ctx.stats.waiting, -1);
    end
}

/// What a model call produced, for the ledger.
struct Call {
    result: CallResult,
    output: Option<CallOutput>,
    error: Option<String>,
    cancel_requested: bool,
    cancel_confirmed: Option<bool>,
    latency_ms: i64,
}

async fn call_backend(
    ctx: &Ctx,
    env: &Envelope,
    attempt: u32,
    budget_ms: u64,
    requested: &CancellationToken,
    stream: Option<&crate::stream::CallStream>,
) -> Call {
    let cancel = CancellationToken::new();
    let req = CallRequest {
        job_id: env.job_id().to_string(),
        kind: env.kind().to_string(),
        attempt,
        payload: env.payload.clone(),
        timeout: Duration::from_millis(budget_ms),
    };
    let t0 = Instant::now();
    let fut = match stream {
        Some(s) => ctx.backend.call_streaming(req, cancel.clone(), s.deltas()),
        None => ctx.backend.call(req, cancel.clone()),
    };
    tokio::pin!(fut);
    let deadline = tokio::time::sleep(Duration::from_millis(budget_ms));
    let outcome = tokio::select! {
        r = &mut fut => Some(r),
        _ = deadline => None,
        _ = requested.cancelled() => {
            // Cancelled on request: abort through the backend's cancellation, as at the
            // deadline, and wait briefly for it to confirm.
            cancel.cancel();
            let confirmed = match tokio::time::timeout(ctx.cfg.cancel_grace, &mut fut).await {
                Ok(Err(BackendError::Cancelled { confirmed })) => confirmed,
                Ok(_) => true,
                Err(_) => false,
            };
            let latency_ms = t0.elapsed().as_millis() as i64;
            return Call {
                result: CallResult::Cancelled,
                output: None,
                error: Some(format!("cancelled on request after {latency_ms} ms")),
                cancel_requested: true,
                cancel_confirmed: Some(confirmed),
                latency_ms,
            };
        }
    };
    let mut call = Call {
        result: CallResult::Completed,
        output: None,
        error: None,
        cancel_requested: false,
        cancel_confirmed: None,
        latency_ms: 0,
    };
    match outcome {
        Some(Ok(out)) => call.output = Some(out),
        Some(Err(BackendError::Cancelled { confirmed })) => {
            // The backend stopped at its own timeout (derived from the same budget).
            call.result = CallResult::DeadlineExceeded;
            call.cancel_requested = true;
            call.cancel_confirmed = Some(confirmed);
            call.error = Some("backend stopped at the deadline".into());
        }
        Some(Err(e)) => {
            call.error = Some(e.to_string());
            let retry_after_ms = match &e {
                BackendError::Retryable { retry_after, .. } => {
                    retry_after.map(|d| d.as_millis() as u64)
                }
                _ => None,
            };
            call.result = CallResult::Failed {
                retryable: e.is_retryable(),
                reason: e.reason().to_owned(),
                retry_after_ms,
            };
        }
        None => {
            // Still running at the deadline: request cancellation and wait briefly for
            // the backend to confirm. Work that goes on remotely is not "not started".
            cancel.cancel();
            let confirmed = match tokio::time::timeout(ctx.cfg.cancel_grace, &mut fut).await {
                Ok(Err(BackendError::Cancelled { confirmed })) => confirmed,
                Ok(_) => true,
                Err(_) => false,
            };
            call.result = CallResult::DeadlineExceeded;
            call.cancel_requested = true;
            call.cancel_confirmed = Some(confirmed);
            call.error = Some(format!(
                "still running at the deadline after {budget_ms} ms; cancellation requested"
            ));
        }
    }
    call.latency_ms = t0.elapsed().as_millis() as i64;
    call
}

fn rand_jitter() -> f64 {
    // Cheap jitter without a RNG dependency in this crate: sub-millisecond clock noise.
    let n = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap_or_default()
        .subsec_nanos();
    f64::from(n % 1_000_000) / 1_000_000.0
}

/// Execute a terminal or retry disposition: durable write first, then the broker.
async fn settle(ctx: &Ctx, job: Job, disposition: Disposition, call: Option<Call>) {
    let (terminal, decision) = match &disposition {
        Disposition::RecordThenAck(t) => (Some(t.clone()), "ack"),
        Disposition::RecordThenDeadLetter(t) => (Some(t.clone()), "dead_letter"),
        Disposition::AckDuplicate => (None, "duplicate"),
        Disposition::Retry { .. } => (None, "retry"),
    };
    if let Disposition::Retry {
        next_attempt,
        queue_index,
        delay_ms,
        ttl_ms,
    } = &disposition
    {
        let queue = ctx
            .cfg
            .topology
            .names
            .retry_queue(ctx.cfg.policy.retry.queue_delays_ms[*queue_index]);
        let props = PublishProps {
            job_id: job.job_id.to_string(),
            ttl_ms: Some(*ttl_ms),
            attempt: *next_attempt,
            timestamp_s: (ctx.clock.now_ms() / 1000) as u64,
            signature: job.incoming.signature.clone(),
        };
        // The body is republished byte for byte: the deadline cannot change.
        let publisher = ctx
            .publisher
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        if let Err(e) = publisher
            .publish("", &queue, &job.incoming.body, &props)
            .await
        {
            if job.link.lost.is_cancelled() {
                // The connection is gone: this delivery cannot be settled anyway. Record
                // nothing; the broker redelivers it, which is the retry.
                tracing::warn!(error = %e, "retry publish failed with the connection lost; the broker redelivers the job");
                return;
            }
            tracing::error!(error = %e, "retry publish not confirmed; failing the job");
            let t = Terminal {
                state: lastcall_core::State::Failed,
                reason: Some("retry_publish_failed".into()),
            };
            return Box::pin(settle(ctx, job, Disposition::RecordThenDeadLetter(t), call)).await;
        }
        tracing::info!(queue = %queue, delay_ms, next_attempt, "retry published");
        WorkerStats::inc(&ctx.stats.retries);
    }
    let rec = outcome_record(ctx, &job, terminal.as_ref(), decision, call.as_ref());
    if disposition != Disposition::AckDuplicate {
        let stored = ctx.door.commit(LedgerWrite::outcome(rec.clone())).await;
        match stored {
            None => return, // shutting down before the write succeeded: no ack
            Some(true) => {
                if let Some(t) = &terminal {
                    ctx.stats.count_state(t.state.as_str());
                    (ctx.stats.metrics).count_outcome(
                        t.state.as_str(),
                        &rec.kind,
                        t.reason.as_deref(),
                    );
                    tracing::info!(
                        state = t.state.as_str(),
                        reason = t.reason.as_deref().unwrap_or(""),
                        "outcome recorded"
                    );
                }
                if ctx.cfg.fault == Some(Fault::PauseAfterStore) {
                    tracing::error!(
                        "fault: paused after store (outcome is durable, event and ack withheld)"
                    );
                    std::future::pending::<()>().await;
                }
                if terminal.is_some() {
                    let calls = job.prior_starts + u32::from(rec.model_called);
                    crate::events::emit(&ctx.events, &rec, calls);
                }
            }
            Some(false) => tracing::info!("outcome already recorded earlier; keeping the first"),
        }
    } else {
        WorkerStats::inc(&ctx.stats.duplicates);
        tracing::info!("redelivery of a job with a recorded outcome: acking without running");
    }
    if let Disposition::RecordThenDeadLetter(_) = &disposition {
        // The reject is sent before its tag is released: no `multiple` ack overtakes it.
        ctx.door.dead_letter(job.ticket).await;
    } else {
        // Acked by the flusher, possibly together with other finished deliveries.
        ctx.door.ack(job.ticket);
    }
}

fn outcome_record(
    ctx: &Ctx,
    job: &Job,
    terminal: Option<&Terminal>,
    decision: &str,
    call: Option<&Call>,
) -> OutcomeRecord {
    let env = job.parsed.as_ref().ok();
    let (kind, created, expires) = match env {
        Some(e) => (
            e.kind().to_string(),
            Some(e.deadline().created_at_ms()),
            Some(e.deadline().expires_at_ms()),
        ),
        None => ("invalid".to_owned(), None, None),
    };
    let error = match (&job.parsed, call) {
        (Err(e), _) => Some(e.to_string()),
        (_, Some(c)) => c.error.clone(),
        _ => job.note.clone(),
    };
    let output = call.and_then(|c| c.output.as_ref());
    OutcomeRecord {
        attempt_key: job.ticket.attempt_key().to_owned(),
        job_id: job.job_id.to_string(),
        kind,
        state: terminal
            .map(|t| t.state.as_str().to_owned())
            .unwrap_or_else(|| "running".into()),
        reason: terminal.and_then(|t| t.reason.clone()),
        decision: decision.to_owned(),
        attempt: job.incoming.attempt,
        created_at_ms: created,
        expires_at_ms: expires,
        received_at_ms: Some(job.received_at_ms),
        checked_at_ms: job.checked_at_ms,
        started_at_ms: job.started_at_ms,
        finished_at_ms: job.finished_at_ms,
        recorded_at_ms: ctx.clock.now_ms(),
        worker: ctx.cfg.name.clone(),
        redelivered: job.incoming.redelivered,
        model_called: job.started_at_ms.is_some(),
        result: output.map(|o| o.text.clone()),
        error,
        prompt_tokens: output.and_then(|o| o.usage).map(|u| u.prompt_tokens as i64),
        completion_tokens: output
            .and_then(|o| o.usage)
            .map(|u| u.completion_tokens as i64),
        latency_ms: call.map(|c| c.latency_ms),
        cancel_requested: call.is_some_and(|c| c.cancel_requested),
        cancel_confirmed: call.and_then(|c| c.cancel_confirmed),
        backend: Some(ctx.backend.name().to_owned()),
        model: output.and_then(|o| o.model.clone()),
        min_runtime_ms: job
            .min_runtime_ms
            .map(|m| i64::try_from(m).unwrap_or(i64::MAX)),
    }
}
