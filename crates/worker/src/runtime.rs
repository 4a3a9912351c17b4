//! The worker: receive → validate → wait for a slot → last admission check → model call
//! → durable outcome → ack.
//!
//! This module builds a worker and runs its connections; each connection is a
//! [`crate::generation`], each delivery a task driven by [`crate::job`] through the core's
//! state machine ([`lastcall_core::delivery`]), settled through one door
//! ([`crate::settle`]).
//!
//! **Invariant:** the ack (or reject) of a delivery happens only after its outcome is in
//! the ledger. **Invariant:** no model call starts unless [`lastcall_core::WorkerPolicy::on_slot`]
//! returned `Run` immediately before it. **Invariant:** local buffering is bounded: at
//! most `prefetch` deliveries (broker-enforced) and at most `max_buffer_bytes` of bodies.

use crate::clock::Clock;
use crate::ctx::{Ctx, RetryPublisher};
use crate::generation::{End, Generation, bounded, log_task_end};
use crate::settle::Door;
use crate::sidecars::Sidecars;
use crate::slots::Slots;
use crate::stats::WorkerStats;
use crate::store_retry::StoreHealth;
use crate::times::CallTimes;
use lastcall_backend::{Backend, CancellationToken};
use lastcall_broker::{Broker, Publisher};
use lastcall_store::Ledger;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio::task::JoinSet;

pub use crate::config::{WorkerConfig, default_worker_name};
pub use crate::generation::WorkerError;

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
        let setup = |e: String| WorkerError::Setup(e);
        cfg.topology
            .ensure(&broker)
            .await
            .map_err(|e| setup(e.to_string()))?;
        // Retries are published on a connection of their own: under a resource alarm the
        // broker blocks publishing connections, and acks must never wait behind that.
        let publish_broker = broker.another().await.map_err(|e| setup(e.to_string()))?;
        let publisher = Publisher::new(&publish_broker, Duration::from_secs(5))
            .await
            .map_err(|e| setup(e.to_string()))?;
        let nonce = format!("{:x}", clock.now_ms() ^ (std::process::id() as i64) << 20);
        let (health, shutdown) = (StoreHealth::default(), CancellationToken::new());
        let door = Door::spawn(
            ledger.clone(),
            health.clone(),
            shutdown.clone(),
            stats.clone(),
            clock.clone(),
        );
        let names_events = cfg.topology.names.events_exchange.clone();
        let breakers = Arc::new(crate::breakers::Breakers::new(cfg.breaker, stats.clone()));
        let limits = Arc::new(crate::limits::Limiters::new(
            cfg.rate_limits.clone(),
            cfg.breaker.max_cool_down_ms.max(cfg.breaker.cool_down_ms),
            stats.clone(),
        ));
        let slots = Arc::new(match cfg.auto_slots {
            Some(limit) => Slots::adaptive(limit, cfg.buffer_order, cfg.tenant_weights.clone()),
            None => Slots::new(
                cfg.slots.max(1),
                cfg.buffer_order,
                cfg.tenant_weights.clone(),
            ),
        });
        let times = CallTimes::new(
            cfg.service_time,
            backend.clone(),
            slots.clone(),
            clock.clone(),
            stats.clone(),
        );
        let ctx = Ctx {
            breakers,
            limits,
            door,
            times,
            held: Default::default(),
            slots,
            cfg,
            ledger,
            backend,
            clock,
            stats,
            publisher: Arc::new(RetryPublisher::new(publisher)),
            health,
            shutdown,
            nonce,
            events: lastcall_broker::EventSink::spawn(&broker, &names_events),
            deltas: lastcall_broker::DeltaSink::spawn(&broker),
        };
        (ctx.stats.metrics).attach(ctx.slots.clone(), ctx.cfg.prefetch);
        // The backend (or default route) shows in /readyz and /metrics before its first call.
        ctx.breakers.register(ctx.backend.first_route(""));
        ctx.times.learn_from_ledger(&ctx.ledger).await;
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
        let mut broker = self.broker;
        let mut tasks = JoinSet::new();
        ctx.stats.ledger_healthy.store(true, Ordering::Relaxed);
        let sidecars = Sidecars::start(&ctx, &broker);
        let (cfg, names) = (&ctx.cfg, &ctx.cfg.topology.names);
        tracing::info!(worker = %cfg.name, slots = cfg.slots, auto_slots = cfg.auto_slots.is_some(), prefetch = cfg.prefetch, queue = %names.work_queue, node = %broker.node(), "worker started");
        let last = match connections(&ctx, &mut broker, &stop, &mut tasks).await {
            Ok(last) => last,
            Err(e) => {
                sidecars.abort();
                return Err(e);
            }
        };
        // Graceful shutdown: no new deliveries; waiting jobs go back; running ones get the grace period.
        if let Some(g) = &last {
            bounded("cancelling the consumer", g.stream.cancel()).await;
            g.stop_relay();
        }
        ctx.shutdown.cancel();
        drain(&ctx, &mut tasks).await;
        // Ack what finished, then close the channel (unsettled deliveries go back).
        if let Some(g) = last {
            g.close().await;
        }
        sidecars.stop().await;
        // The events of the last outcomes (best-effort, bounded like every shutdown step).
        ctx.events.close(Duration::from_secs(2)).await;
        ctx.door.close().await;
        bounded("closing the connection", broker.close()).await;
        ctx.stats.broker_connected.store(false, Ordering::Relaxed);
        tracing::info!(worker = %ctx.cfg.name, "worker stopped");
        Ok(())
    }
}

/// The generations, one per connection, until `stop`: the last one (to close), `None` if
/// stopped while reconnecting; `Err` only when the first cannot be opened.
async fn connections(
    ctx: &Arc<Ctx>,
    broker: &mut Broker,
    stop: &CancellationToken,
    tasks: &mut JoinSet<()>,
) -> Result<Option<Generation>, WorkerError> {
    for number in 1.. {
        let mut generation = match Generation::open(ctx, broker, number).await {
            Ok(g) => g,
            Err(e) if number == 1 => return Err(e),
            Err(e) => {
                tracing::warn!(error = %e, "could not resume on the new connection");
                match reconnect(ctx, broker, stop).await {
                    Some(b) => *broker = b,
                    None => return Ok(None),
                }
                continue;
            }
        };
        ctx.stats.broker_connected.store(true, Ordering::Relaxed);
        match generation.receive(ctx, stop, tasks).await {
            End::Stop => return Ok(Some(generation)),
            End::Lost(why) => {
                ctx.stats.broker_connected.store(false, Ordering::Relaxed);
                WorkerStats::inc(&ctx.stats.reconnects);
                tracing::warn!(reason = %why, "broker connection lost: running calls go on, waiting jobs are dropped (the broker redelivers them); reconnecting");
                generation.abandon().await;
                broker.close().await;
                match reconnect(ctx, broker, stop).await {
                    Some(b) => *broker = b,
                    None => return Ok(None),
                }
            }
        }
    }
    Ok(None)
}

/// Let the job tasks finish within the grace period; abort what is left (unsettled
/// deliveries go back to the broker when the channel closes).
async fn drain(ctx: &Ctx, tasks: &mut JoinSet<()>) {
    let grace = tokio::time::sleep(ctx.cfg.shutdown_grace);
    tokio::pin!(grace);
    loop {
        tokio::select! {
            r = tasks.join_next() => match r {
                Some(done) => log_task_end(&ctx.stats, done),
                None => return,
            },
            _ = &mut grace => {
                tracing::warn!(left = tasks.len(), "shutdown grace period over; handing unfinished deliveries back to the broker");
                tasks.abort_all();
                return;
            }
        }
    }
}

/// Reconnect with backoff (bounded by nothing but `stop`), declare the topology again and
/// make a new retry publisher. `None`: stopping.
async fn reconnect(ctx: &Ctx, old: &Broker, stop: &CancellationToken) -> Option<Broker> {
    loop {
        let broker = old.reconnect(stop, None).await?;
        let ready = async {
            let topology = &ctx.cfg.topology;
            topology.ensure(&broker).await.map_err(|e| e.to_string())?;
            let publish_broker = broker.another().await.map_err(|e| e.to_string())?;
            Publisher::new(&publish_broker, Duration::from_secs(5))
                .await
                .map_err(|e| e.to_string())
        };
        match ready.await {
            Ok(p) => {
                ctx.publisher.replace(p);
                tracing::warn!(node = %broker.node(), "broker connection restored: topology declared, consuming again");
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
