//! The dead-letter processor: consumes `{prefix}.dead`, records an outcome for every dead
//! letter (keeping the worker's outcome when one exists), and acks only after the write.
//!
//! **Invariant:** dead letters are never republished to the work queue; the deadline in
//! the body is never touched. Malformed messages are recorded under a synthetic id and,
//! with `park`, copied to `{prefix}.parked` for a human before the ack.

use crate::clock::Clock;
use crate::settle::Door;
use lastcall_broker::consume::Ended;
use lastcall_broker::{Broker, Incoming, IncomingStream, PublishProps, Publisher, Topology};
use lastcall_core::deadletter::{DeadLetterOutcome, DeathReason, classify};
use lastcall_core::{Decision, Envelope, EnvelopeLimits, JobId, RejectError, RejectReason};
use lastcall_store::{Ledger, LedgerWrite, OutcomeRecord};
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

pub use crate::stats::DlqStats;

/// The dead-letter processor.
pub struct DeadLetterProcessor {
    broker: Broker,
    ledger: Arc<Ledger>,
    topology: Topology,
    clock: Arc<dyn Clock>,
    publisher: Publisher,
    /// Copy malformed dead letters to `{prefix}.parked` before acking them.
    park: bool,
    /// Copy every dead letter to `{prefix}.dead.{reason}` before acking it.
    split_by_reason: bool,
    /// The workers' signing key, when they check signatures.
    signing_key: Option<lastcall_core::SigningKey>,
    name: String,
    pub stats: Arc<DlqStats>,
    /// Outcome events, after each outcome this processor records.
    events: lastcall_broker::EventSink,
}

impl std::fmt::Debug for DeadLetterProcessor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeadLetterProcessor")
            .field("park", &self.park)
            .finish_non_exhaustive()
    }
}

/// The per-reason copy queue for a dead-letter reason label, e.g. `lastcall.dead.expired`.
pub fn reason_queue(prefix: &str, label: &str) -> String {
    format!("{prefix}.dead.{label}")
}

/// The classes that get a queue of their own with `split_by_reason`
/// ([`lastcall_core::deadletter::split_label`]).
pub const REASON_LABELS: [&str; 7] = lastcall_core::deadletter::SPLIT_LABELS;

/// The parked queue's name.
pub fn parked_queue(prefix: &str) -> String {
    format!("{prefix}.parked")
}

impl DeadLetterProcessor {
    pub async fn build(
        broker: Broker,
        ledger: Arc<Ledger>,
        topology: Topology,
        clock: Arc<dyn Clock>,
        park: bool,
    ) -> Result<Self, String> {
        topology.ensure(&broker).await.map_err(|e| e.to_string())?;
        if park {
            topology
                .declare_plain_queue(&broker, &parked_queue(&topology.names.prefix))
                .await
                .map_err(|e| e.to_string())?;
        }
        let publisher = Publisher::new(&broker, Duration::from_secs(5))
            .await
            .map_err(|e| e.to_string())?;
        Ok(Self {
            ledger,
            clock,
            publisher,
            park,
            split_by_reason: false,
            signing_key: None,
            name: format!("dlq:{}", crate::runtime::default_worker_name()),
            stats: Arc::new(DlqStats::default()),
            // Opened now: its first event may come only at the first outage (hours later).
            events: lastcall_broker::EventSink::spawn(&broker, &topology.names.events_exchange)
                .open(),
            broker,
            topology,
        })
    }

    /// The sink its outcome events go to (opened when the processor is built).
    pub fn event_sink(&self) -> &lastcall_broker::EventSink {
        &self.events
    }

    /// Check signatures like the workers do: a dead letter whose `x-lastcall-signature`
    /// is missing or wrong is recorded `rejected`/`bad_signature` under a synthetic id,
    /// never under the job id it claims. Give the processor the workers' key whenever they
    /// have one; without it, a forged dead letter (an unsigned message with a short TTL,
    /// say) would be recorded under the id it claims and could block that real job.
    pub fn with_signing_key(mut self, key: Option<lastcall_core::SigningKey>) -> Self {
        self.signing_key = key;
        self
    }

    /// Also copy every dead letter, after recording it, to `{prefix}.dead.{class}`
    /// (`expired`, `format`, `signature`, `model_failed`, `poison`, `maxlen`, `other`), so
    /// operators can watch format errors, signature errors and model failures apart: a
    /// rejection is classed by the parser's reason and the outcome the ledger holds, not
    /// by `x-death` alone (which only says `rejected`). Declares those queues.
    pub async fn split_by_reason(mut self) -> Result<Self, String> {
        for label in REASON_LABELS {
            self.topology
                .declare_plain_queue(
                    &self.broker,
                    &reason_queue(&self.topology.names.prefix, label),
                )
                .await
                .map_err(|e| e.to_string())?;
        }
        self.split_by_reason = true;
        Ok(self)
    }

    /// Copy a dead letter to `queue` with confirm (no expiration: it is kept for people).
    async fn copy_to(
        &self,
        door: &Door,
        queue: &str,
        m: &Incoming,
        job_id: &str,
        now: i64,
    ) -> Result<(), String> {
        let props = PublishProps {
            job_id: job_id.to_owned(),
            ttl_ms: None,
            attempt: m.attempt,
            timestamp_s: (now / 1000) as u64,
            signature: None,
        };
        door.publish(&self.publisher, "", queue, &m.body, &props)
            .await
            .map(drop)
            .map_err(|e| e.to_string())
    }

    /// [`run`](Self::run) in a task of its own until `stop` fires; an error it stops with
    /// is logged. For a process that runs the processor beside its own work (`lastcall
    /// demo`, the benches).
    pub fn spawn(self, stop: CancellationToken) -> tokio::task::JoinHandle<()> {
        tokio::spawn(async move {
            if let Err(e) = self.run(stop, None).await {
                tracing::warn!(error = %e, "the dead-letter processor stopped with an error");
            }
        })
    }

    /// Process dead letters until `stop` fires, or, with `idle_exit`, until no dead letter
    /// arrived for that long. A lost broker connection is not the end: it reconnects with
    /// backoff (unacked dead letters are redelivered; recording them again keeps the first
    /// outcome), declares the topology again and resumes.
    pub async fn run(
        mut self,
        stop: CancellationToken,
        idle_exit: Option<Duration>,
    ) -> Result<(), String> {
        let door = Door::direct(self.ledger.clone(), stop.clone());
        loop {
            let mut stream = match IncomingStream::open(
                &self.broker,
                &self.topology.names.dead_queue,
                32,
                &format!("lastcall-dlq-{}", std::process::id()),
            )
            .await
            {
                Ok(s) => s,
                Err(e) if self.broker.is_connected() => return Err(e.to_string()),
                Err(e) => {
                    if !self.reconnect(&e.to_string(), &stop).await {
                        return Ok(());
                    }
                    continue;
                }
            };
            self.stats.connected.store(true, Ordering::Relaxed);
            let ended = stream
                .for_each(&stop, idle_exit, |m| async {
                    let m = m;
                    self.handle(&m, &door).await
                })
                .await;
            let why = match ended {
                // Stopping (a delivery not yet written stays unacked), or idle.
                Ended::Stopped | Ended::Idle => {
                    self.events.flush(Duration::from_secs(2)).await;
                    return Ok(());
                }
                Ended::Closed => {
                    "the dead-letter consumer was cancelled or its channel closed".to_owned()
                }
                Ended::Failed(e) => e.to_string(),
            };
            self.stats.connected.store(false, Ordering::Relaxed);
            if !self.reconnect(&why, &stop).await {
                return Ok(());
            }
        }
    }

    /// After a lost connection: reconnect with backoff, declare the topology again and
    /// open a new publisher. `false`: stopping.
    async fn reconnect(&mut self, why: &str, stop: &CancellationToken) -> bool {
        tracing::warn!(reason = %why, "dead-letter processor lost the broker connection; reconnecting");
        self.stats.connected.store(false, Ordering::Relaxed);
        loop {
            let Some(broker) = self.broker.reconnect(stop, None).await else {
                return false;
            };
            let ready = async {
                self.topology
                    .ensure(&broker)
                    .await
                    .map_err(|e| e.to_string())?;
                Publisher::new(&broker, Duration::from_secs(5))
                    .await
                    .map_err(|e| e.to_string())
            };
            match ready.await {
                Ok(p) => {
                    self.publisher = p;
                    self.broker = broker;
                    self.stats.reconnects.fetch_add(1, Ordering::Relaxed);
                    tracing::warn!("dead-letter processor reconnected; consuming again");
                    return true;
                }
                Err(e) => {
                    tracing::warn!(error = %e, "reconnected, but declaring the topology failed; retrying");
                    tokio::select! {
                        _ = tokio::time::sleep(Duration::from_secs(1)) => {}
                        _ = stop.cancelled() => return false,
                    }
                }
            }
        }
    }

    /// One dead letter: read it, record its outcome (the first one wins), count it, copy
    /// it where it is to be kept, then ack. `false`: stopping before the write.
    async fn handle(&self, m: &Incoming, door: &Door) -> bool {
        let now = self.clock.now_ms();
        let letter = self.read(m, now);
        let rec = letter.record(m, &self.name, now);
        let Some((durable, written)) = door.commit(LedgerWrite::terminal(rec.clone())).await else {
            return false;
        };
        self.count(&letter, &rec, written).await;
        let Some(copies) = self.copies(&letter).await else {
            door.hand_back(m).await;
            return true;
        };
        for queue in &copies {
            if let Err(e) = self
                .copy_to(door, queue, m, letter.job_id.as_str(), now)
                .await
            {
                tracing::error!(error = %e, queue = %queue, "copying a dead letter failed; leaving it in the dead-letter queue");
                door.hand_back(m).await;
                return true;
            }
        }
        if self.park && letter.parsed.is_err() {
            self.stats.parked.fetch_add(1, Ordering::Relaxed);
        }
        door.ack(m, durable).await;
        tracing::info!(job_id = %letter.job_id, reason = letter.death.label(), state = letter.outcome.state.as_str(), written, "dead letter processed");
        true
    }

    /// Parse the body (checking its signature with a key), name the job and classify the
    /// death.
    fn read(&self, m: &Incoming, now: i64) -> Letter {
        let limits = EnvelopeLimits {
            horizon_ms: i64::MAX / 4,
            max_body_bytes: usize::MAX,
        };
        let parsed = lastcall_core::signature::require_signature(
            self.signing_key.as_ref(),
            Envelope::parse(&m.body, &limits, now),
            &m.body,
            m.signature.as_deref(),
            m.message_id.as_deref(),
        );
        let job_id = lastcall_core::job_id_for(
            &parsed,
            m.message_id.as_deref(),
            &m.body,
            self.signing_key.is_some(),
        );
        let death = m.x_death.first();
        let reason = DeathReason::parse(death.map(|d| d.reason.as_str()).unwrap_or("none"));
        let reject = parsed.as_ref().err().map(|e| e.reason);
        let outcome = classify(&reason, parsed.is_ok(), reject);
        Letter {
            parsed,
            job_id,
            death: reason,
            reject,
            outcome,
        }
    }

    /// The processor's counters and, when this record was the one written, its event.
    async fn count(&self, letter: &Letter, rec: &OutcomeRecord, written: bool) {
        self.stats.processed.fetch_add(1, Ordering::Relaxed);
        (self.stats.by_reason).inc(vec![letter.death.label().to_owned()]);
        if written {
            crate::events::emit_counting(&self.events, &self.ledger, rec).await;
            self.stats.recorded.fetch_add(1, Ordering::Relaxed);
        } else {
            self.stats.kept_existing.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// The queues the dead letter is copied to before its ack: the parked queue (an
    /// invalid body, with `park`) and its class queue (with `split_by_reason`, classed by
    /// the outcome the ledger keeps). `None`: the ledger could not be read.
    async fn copies(&self, letter: &Letter) -> Option<Vec<String>> {
        let prefix = &self.topology.names.prefix;
        let mut copies = Vec::new();
        if self.park && letter.parsed.is_err() {
            copies.push(parked_queue(prefix));
        }
        if self.split_by_reason {
            // The outcome the ledger keeps (the worker's, when it wrote one first).
            let kept = match self.ledger.get(letter.job_id.as_str()).await {
                Ok(r) => r,
                Err(e) => {
                    tracing::warn!(error = %e, "reading the outcome to class a dead letter failed; leaving it in the dead-letter queue");
                    return None;
                }
            };
            let label = lastcall_core::deadletter::split_label(
                &letter.death,
                letter.reject,
                kept.as_ref()
                    .map(|r| (r.state.as_str(), r.reason.as_deref())),
            );
            copies.push(reason_queue(prefix, label));
        }
        Some(copies)
    }
}

/// A dead letter as the processor reads it.
struct Letter {
    parsed: Result<Envelope, RejectError>,
    /// The id its outcome is recorded under (synthetic for an unverified body).
    job_id: JobId,
    /// The broker's reason of its most recent death.
    death: DeathReason,
    /// The parser's code when the body is not a valid envelope.
    reject: Option<RejectReason>,
    outcome: DeadLetterOutcome,
}

impl Letter {
    /// Its ledger record: the classified outcome, the `x-death` facts in `error`, and an
    /// attempt key per death (a redelivery of the same dead letter writes the same row).
    fn record(&self, m: &Incoming, worker: &str, now: i64) -> OutcomeRecord {
        let death = m.x_death.first();
        let detail = match death {
            Some(d) => format!(
                "dead-lettered: reason={} queue={} count={} original-expiration={}",
                d.reason,
                d.queue,
                d.count,
                d.original_expiration.as_deref().unwrap_or("-")
            ),
            None => "dead letter without x-death".to_owned(),
        };
        let (kind, created, expires) = match &self.parsed {
            Ok(e) => (
                e.kind().to_string(),
                Some(e.deadline().created_at_ms()),
                Some(e.deadline().expires_at_ms()),
            ),
            Err(_) => ("invalid".into(), None, None),
        };
        // An unparsed letter writes the defaults, which never replace a known tenant.
        let tenant = self.parsed.as_ref().ok().map(|e| {
            lastcall_core::Tenant::parse(e.tenant())
                .unwrap_or_else(|_| lastcall_core::Tenant::default_tenant())
        });
        let priority = self
            .parsed
            .as_ref()
            .map(|e| e.priority())
            .unwrap_or_default();
        OutcomeRecord {
            attempt_key: format!(
                "dlq:{}:{}:{}",
                self.job_id,
                death.map(|d| d.count).unwrap_or(0),
                death.and_then(|d| d.time_s).unwrap_or(0)
            ),
            reason: Some(self.outcome.reason.clone()),
            attempt: m.attempt,
            created_at_ms: created,
            expires_at_ms: expires,
            received_at_ms: Some(now),
            worker: worker.to_owned(),
            redelivered: m.redelivered,
            error: Some(match &self.parsed {
                Err(e) => format!("{detail}; {e}"),
                Ok(_) => detail,
            }),
            tenant: tenant.unwrap_or_else(lastcall_core::Tenant::default_tenant),
            priority,
            ..OutcomeRecord::new(
                self.job_id.to_string(),
                kind,
                self.outcome.state,
                Decision::DeadLetterProcessed,
                now,
            )
        }
    }
}
