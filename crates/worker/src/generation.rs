//! One broker connection of a worker: a *generation*. Its consumer, its ack batch
//! (delivery tags are per channel), its ack flusher and its retry relay live and die
//! together; an ack never crosses generations.

use crate::ctx::Ctx;
use crate::job::{self, Msg};
use crate::settle::AckBatch;
use crate::stats::WorkerStats;
use lastcall_backend::CancellationToken;
use lastcall_broker::{Broker, Incoming, IncomingStream};
use std::sync::Arc;
use std::time::Duration;
use tokio::sync::Semaphore;
use tokio::task::{JoinHandle, JoinSet};

/// One broker connection's consumer and the tasks tied to its channel.
pub(crate) struct Generation {
    pub(crate) stream: IncomingStream,
    /// The deliveries of this channel, for coalesced acks; tags are per channel.
    acks: AckBatch,
    flusher: JoinHandle<()>,
    flush_stop: CancellationToken,
    relay_task: JoinHandle<Result<(), String>>,
    relay_stop: CancellationToken,
    /// Fires when the connection is lost: jobs of this generation still waiting for a
    /// slot are dropped (their deliveries cannot be settled any more).
    lost: CancellationToken,
}

/// Why the receive loop ended.
pub(crate) enum End {
    Stop,
    Lost(String),
}

impl Generation {
    /// Consume on `broker`'s connection as generation `number`, with its own retry relay.
    pub(crate) async fn open(
        ctx: &Arc<Ctx>,
        broker: &Broker,
        number: u64,
    ) -> Result<Self, WorkerError> {
        let cfg = &ctx.cfg;
        let setup = |e: String| WorkerError::Setup(e);
        // The work queue and the named tenants' lanes, each with its own prefetch window.
        let stream = IncomingStream::open_queues(
            broker,
            &cfg.topology.names.lane_queues(),
            cfg.prefetch,
            &format!("lastcall-worker-{}", ctx.nonce),
        )
        .await
        .map_err(|e| setup(e.to_string()))?;
        // Due retries come back through the relay, with the remaining budget as their TTL.
        let relay = crate::relay::RetryRelay::build(
            broker.clone(),
            ctx.publisher.get(),
            ctx.ledger.clone(),
            cfg.topology.names.clone(),
            ctx.clock.clone(),
            cfg.name.clone(),
            cfg.policy.admission,
        )
        .await
        .map_err(setup)?
        .with_events(ctx.events.clone());
        let relay_stop = CancellationToken::new();
        let relay_task = tokio::spawn(relay.run(relay_stop.clone()));
        let (lost, flush_stop) = (CancellationToken::new(), CancellationToken::new());
        let (acks, flusher) = (ctx.door).open_generation(number, lost.clone(), flush_stop.clone());
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

    pub(crate) fn stop_relay(&self) {
        self.relay_stop.cancel();
    }

    /// The connection is gone: drop waiting jobs, stop the relay and the flusher (acks on
    /// a dead channel cannot succeed; running calls of this generation still record their
    /// outcomes, and their redeliveries are acked as duplicates).
    pub(crate) async fn abandon(self) {
        self.lost.cancel();
        self.relay_stop.cancel();
        self.flush_stop.cancel();
        let _ = bounded("stopping the retry relay", self.relay_task).await;
        self.flusher.abort();
    }

    /// Shutdown: ack what finished (a last flush), then close the channel (unsettled
    /// deliveries go back).
    pub(crate) async fn close(self) {
        self.flush_stop.cancel();
        if let Some(Err(e)) = bounded("the last ack flush", self.flusher).await {
            tracing::warn!(error = %e, "the ack flusher task failed");
        }
        bounded("closing the channel", self.stream.close()).await;
    }

    /// The receive loop: until `stop` or the connection is lost. Each delivery takes a
    /// byte permit (bounded buffer) and runs in a task of its own in `tasks`.
    pub(crate) async fn receive(
        &mut self,
        ctx: &Arc<Ctx>,
        stop: &CancellationToken,
        tasks: &mut JoinSet<()>,
    ) -> End {
        let bytes = Arc::new(Semaphore::new(ctx.cfg.max_buffer_bytes.max(1)));
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
                n = self.stream.next() => n,
            };
            let incoming = match next {
                None => {
                    return End::Lost("the consumer was cancelled or the channel closed".into());
                }
                Some(Err(e)) => return End::Lost(e.to_string()),
                Some(Ok(i)) => i,
            };
            if !self.accept(ctx, incoming, &bytes, stop, tasks).await {
                return End::Stop;
            }
        }
    }

    /// Register one delivery (in tag order), bound its bytes and spawn its task. `false`:
    /// stopped while waiting for buffer room (the delivery was handed back).
    async fn accept(
        &self,
        ctx: &Arc<Ctx>,
        incoming: Incoming,
        bytes: &Arc<Semaphore>,
        stop: &CancellationToken,
        tasks: &mut JoinSet<()>,
    ) -> bool {
        let cfg = &ctx.cfg;
        let received_at_ms = ctx.clock.now_ms();
        WorkerStats::inc(&ctx.stats.received);
        // The stream too: delivery tags start again at 1 after a reconnect.
        let attempt_key = format!(
            "{}:{}-{}:{}",
            cfg.name, ctx.nonce, incoming.stream, incoming.delivery_tag
        );
        let (msg, tag, settler) = split(incoming, ctx.slots.receipt());
        let ticket = self.acks.register(tag, settler, attempt_key);
        // Bound local memory by bytes; a body over the limit is rejected without buffering.
        let size = msg.body.len();
        let permit = if size > cfg.policy.limits.max_body_bytes {
            None
        } else {
            let n = size.clamp(1, cfg.max_buffer_bytes.max(1)) as u32;
            tokio::select! {
                p = bytes.clone().acquire_many_owned(n) => Some(p.expect("semaphore never closed")),
                _ = stop.cancelled() => {
                    ctx.door.hand_back(ticket).await;
                    return false;
                }
            }
        };
        WorkerStats::add(&ctx.stats.buffered_bytes, size as i64);
        let (ctx2, lost) = (ctx.clone(), self.lost.clone());
        tasks.spawn(async move {
            let _permit = permit;
            job::handle(ctx2.clone(), msg, ticket, lost, received_at_ms).await;
            WorkerStats::add(&ctx2.stats.buffered_bytes, -(size as i64));
        });
        true
    }
}

/// A delivery's properties (with its receipt number), its tag and its settler (which goes
/// into its ticket).
fn split(i: Incoming, receipt: u64) -> (Msg, u64, lastcall_broker::Settler) {
    let msg = Msg {
        body: i.body,
        redelivered: i.redelivered,
        message_id: i.message_id,
        attempt: i.attempt,
        signature: i.signature,
        timestamp_s: i.timestamp_s,
        reply_to: i.reply_to,
        receipt,
    };
    (msg, i.delivery_tag, i.settler)
}

/// Longest wait for one broker step of the shutdown.
const SHUTDOWN_STEP: Duration = Duration::from_secs(10);

/// One shutdown step, bounded: a broker that stops answering must not hang the worker's
/// exit (unsettled deliveries go back to the queue when the connection drops anyway).
pub(crate) async fn bounded<F: std::future::Future>(what: &str, step: F) -> Option<F::Output> {
    let r = tokio::time::timeout(SHUTDOWN_STEP, step).await.ok();
    if r.is_none() {
        tracing::warn!(
            step = what,
            "shutdown step did not finish within 10 s; going on"
        );
    }
    r
}

pub(crate) fn log_task_end(stats: &WorkerStats, r: Result<(), tokio::task::JoinError>) {
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
