//! The retry relay: moves retries whose delay is over from `{prefix}.retry.ready` back to
//! the jobs exchange, with `expiration` = the budget remaining at that moment.
//!
//! RabbitMQ strips a message's `expiration` when it dead-letters it, so a retry routed
//! straight from its delay queue to the work queue would sit there without a broker TTL.
//! The relay republishes it instead (with confirm, then ack), byte for byte, so the
//! deadline is unchanged. **Invariant:** stale work is never republished: the relay applies
//! the admission rule of every publish (remaining budget less the clock margin, at least
//! the minimum useful runtime); a retry that fails it is recorded as `expired_not_started`
//! (`retry:deadline_passed` / `retry:below_min_runtime`) and acked. It settles through
//! the settlement [`Door`] (its own, one write and one ack at a time): an ack only after
//! the recorded outcome or the confirmed republish.

use crate::clock::Clock;
use crate::settle::Door;
use lastcall_broker::consume::Ended;
use lastcall_broker::{Broker, Incoming, IncomingStream, Names, PublishProps, Publisher};
use lastcall_core::{
    Admission, AdmissionPolicy, Decision, Envelope, EnvelopeLimits, Reason, Refusal, Stage, State,
};
use lastcall_store::{Ledger, LedgerWrite, OutcomeRecord};
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;

/// Republishes due retries with their remaining budget.
pub struct RetryRelay {
    broker: Broker,
    ledger: Arc<Ledger>,
    names: Names,
    clock: Arc<dyn Clock>,
    publisher: Publisher,
    name: String,
    admission: AdmissionPolicy,
    events: lastcall_broker::EventSink,
}

impl std::fmt::Debug for RetryRelay {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RetryRelay")
            .field("names", &self.names)
            .finish_non_exhaustive()
    }
}

impl RetryRelay {
    /// The topology (with the retry-ready queue) must already be applied. It consumes on
    /// `broker` and republishes with `publisher` (the worker's, on its own connection, so
    /// that publisher flow control never holds back acks).
    pub async fn build(
        broker: Broker,
        publisher: Publisher,
        ledger: Arc<Ledger>,
        names: Names,
        clock: Arc<dyn Clock>,
        name: String,
        admission: AdmissionPolicy,
    ) -> Result<Self, String> {
        Ok(Self {
            broker,
            ledger,
            names,
            clock,
            publisher,
            name,
            admission,
            events: lastcall_broker::EventSink::disabled(),
        })
    }

    /// Publish an outcome event after each outcome the relay records.
    pub fn with_events(mut self, events: lastcall_broker::EventSink) -> Self {
        self.events = events;
        self
    }

    /// Relay until `stop` fires.
    pub async fn run(self, stop: CancellationToken) -> Result<(), String> {
        let queue = self.names.retry_ready_queue();
        let mut stream = IncomingStream::open(
            &self.broker,
            &queue,
            16,
            &format!("lastcall-relay-{}", std::process::id()),
        )
        .await
        .map_err(|e| e.to_string())?;
        let door = Door::direct(self.ledger.clone(), stop.clone());
        let ended = stream
            .for_each(&stop, None, |m| async {
                let m = m;
                self.handle(&m, &door).await
            })
            .await;
        match ended {
            Ended::Stopped | Ended::Idle => Ok(()),
            Ended::Closed => {
                stream.cancel().await;
                stream.close().await;
                Ok(())
            }
            Ended::Failed(e) => Err(e.to_string()),
        }
    }

    /// Returns `false` when stopping before the delivery could be settled.
    async fn handle(&self, m: &Incoming, door: &Door) -> bool {
        let now = self.clock.now_ms();
        let env = match Envelope::parse(&m.body, &RELAYED, now) {
            Ok(env) => env,
            Err(e) => {
                // Only valid envelopes are ever retried; anything else goes to the DLX.
                tracing::error!(error = %e, "invalid body in the retry-ready queue; dead-lettering it");
                door.dead_letter(m).await;
                return true;
            }
        };
        match self.useful_ttl(&env, now) {
            Ok(ttl_ms) => {
                self.republish(m, &env, ttl_ms, door, now).await;
                true
            }
            Err(refusal) => self.record_stale(m, &env, refusal, door, now).await,
        }
    }

    /// The broker TTL of the republish when the retry still passes the admission rule of
    /// every publish, else why not.
    fn useful_ttl(&self, env: &Envelope, now: i64) -> Result<u64, Refusal> {
        if let Admission::Refuse { refusal, .. } =
            self.admission
                .check(env.deadline(), env.min_runtime_ms, now)
        {
            return Err(refusal);
        }
        env.deadline()
            .broker_ttl_ms(now)
            .ok_or(Refusal::DeadlinePassed)
    }

    /// A retry that can no longer be useful: record `expired_not_started`
    /// (`retry:<refusal>`), then ack. `false`: stopping before the write.
    async fn record_stale(
        &self,
        m: &Incoming,
        env: &Envelope,
        refusal: Refusal,
        door: &Door,
        now: i64,
    ) -> bool {
        let reason = Reason::Refused(Stage::Retry, refusal.into());
        let rec = OutcomeRecord {
            attempt_key: format!("relay:{}:{}", env.job_id(), m.attempt),
            reason: Some(reason.clone()),
            attempt: m.attempt,
            created_at_ms: Some(env.deadline().created_at_ms()),
            expires_at_ms: Some(env.deadline().expires_at_ms()),
            received_at_ms: Some(now),
            checked_at_ms: Some(now),
            worker: self.name.clone(),
            redelivered: m.redelivered,
            tenant: lastcall_core::Tenant::parse(env.tenant())
                .unwrap_or_else(|_| lastcall_core::Tenant::default_tenant()),
            priority: env.priority(),
            ..OutcomeRecord::new(
                env.job_id().to_string(),
                env.kind().to_string(),
                State::ExpiredNotStarted,
                Decision::Ack,
                now,
            )
        };
        let Some((written, _)) = door.commit(LedgerWrite::outcome(rec.clone())).await else {
            return false;
        };
        crate::events::emit_counting(&self.events, &self.ledger, &rec).await;
        door.ack(m, written).await;
        tracing::info!(job_id = %env.job_id(), %reason, "retry can no longer be useful after its delay: recorded, not republished");
        true
    }

    /// Republish the retry byte for byte with `ttl_ms` (with confirm), then ack; a publish
    /// that is not confirmed hands the retry back.
    async fn republish(&self, m: &Incoming, env: &Envelope, ttl_ms: u64, door: &Door, now: i64) {
        let props = PublishProps {
            job_id: env.job_id().to_string(),
            ttl_ms: Some(ttl_ms),
            attempt: m.attempt,
            timestamp_s: (now / 1000).max(0) as u64,
            signature: m.signature.clone(),
        };
        // Back to its tenant's lane (the jobs exchange for the `default` tenant).
        let (exchange, key) =
            self.names
                .job_route(env.tenant(), env.priority(), env.kind().as_str());
        match door
            .publish(&self.publisher, exchange, &key, &m.body, &props)
            .await
        {
            Ok(confirmed) => {
                door.ack(m, confirmed).await;
                tracing::info!(job_id = %env.job_id(), attempt = m.attempt, ttl_ms, "retry relayed to the jobs exchange");
            }
            Err(e) => {
                tracing::warn!(error = %e, "relaying a retry was not confirmed; handing it back");
                tokio::time::sleep(Duration::from_millis(200)).await;
                door.hand_back(m).await;
            }
        }
    }
}

/// A relayed retry was checked at its first publish: no horizon or size limit again.
const RELAYED: EnvelopeLimits = EnvelopeLimits {
    horizon_ms: i64::MAX / 4,
    max_body_bytes: usize::MAX,
};
