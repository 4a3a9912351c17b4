//! Names and declarations of the broker topology (docs/wire-format.md).

use crate::{Broker, BrokerError};
use lapin::ExchangeKind;
use lapin::options::{ExchangeDeclareOptions, QueueBindOptions, QueueDeclareOptions};
use lapin::types::{AMQPValue, FieldTable, LongString, ShortString};

/// The work queue's type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum QueueType {
    /// Classic queue. Dead-lettering is at-most-once: a dead letter can be lost if the
    /// target cannot take it.
    #[default]
    Classic,
    /// Quorum queues, for a RabbitMQ cluster: the work queue with `dead-letter-strategy =
    /// at-least-once`, `overflow = reject-publish` and a delivery limit, and every other
    /// queue of the topology (dead letters, retry delays, retry-ready, parked, the
    /// dead-letter copies) quorum too, so that no queue is homed on one node (a classic
    /// queue homed on a dead node makes every declaration of the topology fail).
    Quorum,
}

impl std::str::FromStr for QueueType {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "classic" => Ok(Self::Classic),
            "quorum" => Ok(Self::Quorum),
            _ => Err(format!(
                "unknown queue type `{s}`; expected `classic` or `quorum`"
            )),
        }
    }
}

/// All broker names, derived from one prefix.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Names {
    pub prefix: String,
    /// Topic exchange producers publish to; routing key = kind.
    pub jobs_exchange: String,
    /// The queue workers consume.
    pub work_queue: String,
    /// Dead-letter exchange of the work and retry queues.
    pub dlx: String,
    /// Where every dead letter lands.
    pub dead_queue: String,
    /// Topic exchange of outcome events (routing key `<state>.<kind>`), published after
    /// each durable terminal outcome; nothing is bound to it by the topology.
    pub events_exchange: String,
    /// Fanout exchange of control broadcasts to every worker (cancellations); each worker
    /// follows it through a queue of its own.
    pub control_exchange: String,
    /// Direct exchange of the named tenants' jobs: routing key = the lane number
    /// ([`lastcall_core::lane_of`]), bound to the lane queues `1..LANES`.
    pub lanes_exchange: String,
}

impl Names {
    pub fn new(prefix: &str) -> Self {
        Self {
            prefix: prefix.to_owned(),
            jobs_exchange: format!("{prefix}.jobs"),
            work_queue: format!("{prefix}.work"),
            dlx: format!("{prefix}.dlx"),
            dead_queue: format!("{prefix}.dead"),
            events_exchange: format!("{prefix}.events"),
            control_exchange: format!("{prefix}.control"),
            lanes_exchange: format!("{prefix}.lanes"),
        }
    }

    /// The queue of `lane`: the work queue for lane 0, `{prefix}.work.lane<N>` else.
    pub fn lane_queue(&self, lane: u8) -> String {
        match lane {
            0 => self.work_queue.clone(),
            n => format!("{}.lane{n}", self.work_queue),
        }
    }

    /// Every queue workers consume jobs from: the work queue, then lanes `1..LANES`.
    pub fn lane_queues(&self) -> Vec<String> {
        (0..lastcall_core::LANES)
            .map(|l| self.lane_queue(l))
            .collect()
    }

    /// Where a job of `tenant`, `priority` and `kind` is published: the jobs exchange with
    /// the kind as the routing key for the `default` tenant's `standard` jobs (lane 0, as
    /// before lanes), the lanes exchange with the lane number for the others.
    pub fn job_route(
        &self,
        tenant: &str,
        priority: lastcall_core::Priority,
        kind: &str,
    ) -> (&str, String) {
        match lastcall_core::lane_of(tenant, priority) {
            0 => (&self.jobs_exchange, kind.to_owned()),
            lane => (&self.lanes_exchange, lane.to_string()),
        }
    }

    /// Where retries wait after their delay for the relay to republish them with the
    /// remaining budget: `lastcall.retry.ready`.
    pub fn retry_ready_queue(&self) -> String {
        format!("{}.retry.ready", self.prefix)
    }

    /// The fixed-delay retry queue for `delay_ms`, e.g. `lastcall.retry.5s`.
    pub fn retry_queue(&self, delay_ms: u64) -> String {
        let label = if delay_ms.is_multiple_of(1000) {
            format!("{}s", delay_ms / 1000)
        } else {
            format!("{delay_ms}ms")
        };
        format!("{}.retry.{label}", self.prefix)
    }
}

/// What to declare.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Topology {
    pub names: Names,
    pub queue_type: QueueType,
    /// Fixed retry delays; one queue each.
    pub retry_delays_ms: Vec<u64>,
    /// Quorum only: deliveries after which the broker dead-letters a message.
    pub delivery_limit: u32,
    /// Optional cap on the work queue length (`x-max-length`), dead-lettering on overflow.
    pub max_length: Option<u32>,
}

impl Topology {
    pub fn new(prefix: &str) -> Self {
        Self {
            names: Names::new(prefix),
            queue_type: QueueType::Classic,
            retry_delays_ms: vec![1_000, 5_000, 30_000],
            delivery_limit: 5,
            max_length: None,
        }
    }

    fn work_args(&self) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("x-dead-letter-exchange".into(), long(&self.names.dlx));
        if let Some(m) = self.max_length {
            t.insert("x-max-length".into(), AMQPValue::LongLongInt(i64::from(m)));
        }
        if self.queue_type == QueueType::Quorum {
            t.insert("x-queue-type".into(), long("quorum"));
            t.insert("x-dead-letter-strategy".into(), long("at-least-once"));
            t.insert("x-overflow".into(), long("reject-publish"));
            t.insert(
                "x-delivery-limit".into(),
                AMQPValue::LongLongInt(i64::from(self.delivery_limit)),
            );
        }
        t
    }

    /// Quorum mode: `x-queue-type = quorum` for a queue other than the work queue, with
    /// at-least-once dead-lettering where it dead-letters (`dead_letters`), which needs
    /// `overflow = reject-publish`.
    fn quorum_args(&self, t: &mut FieldTable, dead_letters: bool) {
        if self.queue_type == QueueType::Quorum {
            t.insert("x-queue-type".into(), long("quorum"));
            if dead_letters {
                t.insert("x-dead-letter-strategy".into(), long("at-least-once"));
                t.insert("x-overflow".into(), long("reject-publish"));
            }
        }
    }

    /// The arguments of a queue that only holds messages (dead letters, parked bodies,
    /// the per-reason copies): none, or the quorum type in quorum mode.
    fn holding_args(&self) -> FieldTable {
        let mut t = FieldTable::default();
        self.quorum_args(&mut t, false);
        t
    }

    fn retry_ready_args(&self) -> FieldTable {
        let mut t = FieldTable::default();
        t.insert("x-dead-letter-exchange".into(), long(&self.names.dlx));
        self.quorum_args(&mut t, true);
        t
    }

    fn retry_args(&self, delay_ms: u64) -> FieldTable {
        let mut t = FieldTable::default();
        self.quorum_args(&mut t, true);
        t.insert(
            "x-message-ttl".into(),
            AMQPValue::LongLongInt(delay_ms as i64),
        );
        // When the delay is over the message moves to the retry-ready queue. RabbitMQ strips
        // `expiration` when it dead-letters, so it is not routed straight back to the jobs
        // exchange: the worker's retry relay republishes it with the remaining budget.
        t.insert("x-dead-letter-exchange".into(), long(""));
        t.insert(
            "x-dead-letter-routing-key".into(),
            long(&self.names.retry_ready_queue()),
        );
        t
    }

    /// Declare everything. Idempotent; a conflicting existing declaration fails with a
    /// message that says what differs.
    pub async fn apply(&self, broker: &Broker) -> Result<(), TopologyError> {
        let n = &self.names;
        self.exchange(broker, &n.jobs_exchange).await?;
        self.exchange(broker, &n.dlx).await?;
        self.exchange(broker, &n.events_exchange).await?;
        self.exchange_of(broker, &n.control_exchange, ExchangeKind::Fanout)
            .await?;
        self.side_queue(broker, &n.dead_queue, self.holding_args())
            .await?;
        self.bind(broker, &n.dead_queue, &n.dlx, "#").await?;
        self.queue(broker, &n.work_queue, self.work_args()).await?;
        self.bind(broker, &n.work_queue, &n.jobs_exchange, "#")
            .await?;
        // The named tenants' lanes: queues like the work queue, one routing key each.
        self.exchange_of(broker, &n.lanes_exchange, ExchangeKind::Direct)
            .await?;
        for lane in 1..lastcall_core::LANES {
            let q = n.lane_queue(lane);
            self.queue(broker, &q, self.work_args()).await?;
            self.bind(broker, &q, &n.lanes_exchange, &lane.to_string())
                .await?;
        }
        self.side_queue(broker, &n.retry_ready_queue(), self.retry_ready_args())
            .await?;
        for d in &self.retry_delays_ms {
            self.side_queue(broker, &n.retry_queue(*d), self.retry_args(*d))
                .await?;
        }
        Ok(())
    }

    /// Make sure the topology exists, for a process that uses it (`submit`, `serve`,
    /// `worker`, `dlq`): declare it as [`apply`](Self::apply) does; if the broker refuses
    /// that (`ACCESS_REFUSED`: a least-privilege user, which may not configure the
    /// topology, see docs/broker-permissions.md), check with passive declares, which need
    /// no permission, that every exchange and queue of it exists. A missing one is an
    /// error that says to run `lastcall topology apply` as the deployer. Bindings cannot
    /// be checked passively: the deployer's.
    ///
    /// The refused declare is tried once per process: lapin logs the broker's refusal as an
    /// error line (`Channel closed … ACCESS_REFUSED`), and after a reconnect the same user
    /// is refused again, so later calls go straight to the passive check.
    pub async fn ensure(&self, broker: &Broker) -> Result<(), TopologyError> {
        static REFUSED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
        if let Some(refused) = REFUSED.get() {
            return self.verify(broker, refused).await;
        }
        match self.apply(broker).await {
            Err(TopologyError::Broker(e)) if is_refused(&e) => {
                let refused = e.to_string();
                self.verify(broker, &refused).await?;
                tracing::info!(error = %refused, "this user may not declare the topology (least privilege): checked with passive declares that it exists");
                let _ = REFUSED.set(refused);
                Ok(())
            }
            r => r,
        }
    }

    /// Passive declares of every exchange and queue of the topology.
    async fn verify(&self, broker: &Broker, refused: &str) -> Result<(), TopologyError> {
        let n = &self.names;
        for e in [
            &n.jobs_exchange,
            &n.dlx,
            &n.events_exchange,
            &n.control_exchange,
            &n.lanes_exchange,
        ] {
            exists(broker, "exchange", e, refused).await?;
        }
        let mut queues = n.lane_queues();
        queues.push(n.dead_queue.clone());
        queues.push(n.retry_ready_queue());
        queues.extend(self.retry_delays_ms.iter().map(|d| n.retry_queue(*d)));
        for q in &queues {
            exists(broker, "queue", q, refused).await?;
        }
        Ok(())
    }

    /// Declare a queue other than the work queue. In quorum mode a deployment made before
    /// these queues became quorum queues holds them as classic queues: redeclaring them as
    /// quorum fails (`inequivalent arg 'x-queue-type'`), so the classic declaration is
    /// accepted then, with a warning that the queue is homed on one node (delete it when
    /// it is empty and apply the topology again to make it a quorum queue).
    async fn side_queue(
        &self,
        broker: &Broker,
        name: &str,
        args: FieldTable,
    ) -> Result<(), TopologyError> {
        match self.queue(broker, name, args.clone()).await {
            Err(TopologyError::Conflict { detail, .. })
                if self.queue_type == QueueType::Quorum && detail.contains("x-queue-type") =>
            {
                const QUORUM_ONLY: [&str; 3] =
                    ["x-queue-type", "x-dead-letter-strategy", "x-overflow"];
                let classic: FieldTable = args
                    .inner()
                    .iter()
                    .filter(|(k, _)| !QUORUM_ONLY.contains(&k.as_str()))
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<std::collections::BTreeMap<_, _>>()
                    .into();
                self.queue(broker, name, classic).await?;
                tracing::warn!(
                    queue = name,
                    "a classic queue from an earlier version in quorum mode: it lives on one node, and while that node is down the topology cannot be declared; delete it when it is empty (rabbitmqctl delete_queue {name} --if-empty) and apply the topology again to make it a quorum queue"
                );
                Ok(())
            }
            r => r,
        }
    }

    /// Delete every queue and exchange of this topology (tests and demo clean-up).
    pub async fn delete(&self, broker: &Broker) -> Result<(), BrokerError> {
        let ch = broker.channel().await?;
        let n = &self.names;
        let mut queues = n.lane_queues();
        queues.extend([
            n.dead_queue.clone(),
            format!("{}.parked", n.prefix),
            n.retry_ready_queue(),
        ]);
        // The per-class copy queues of `lastcall dlq --split-by-reason` (and the names of
        // earlier versions: `rejected`, `delivery_limit`).
        queues.extend(
            lastcall_core::deadletter::SPLIT_LABELS
                .iter()
                .chain(&["rejected", "delivery_limit"])
                .map(|l| format!("{}.dead.{l}", n.prefix)),
        );
        queues.extend(self.retry_delays_ms.iter().map(|d| n.retry_queue(*d)));
        for q in queues {
            let _ = ch
                .queue_delete(
                    q.as_str().into(),
                    lapin::options::QueueDeleteOptions::default(),
                )
                .await;
        }
        for e in [
            &n.jobs_exchange,
            &n.dlx,
            &n.events_exchange,
            &n.control_exchange,
            &n.lanes_exchange,
        ] {
            let _ = ch
                .exchange_delete(
                    e.as_str().into(),
                    lapin::options::ExchangeDeleteOptions::default(),
                )
                .await;
        }
        crate::goodbye("closing a channel", ch.close(200, "ok".into())).await;
        Ok(())
    }

    /// Declare a durable queue that only holds messages (the parked queue, the
    /// dead-letter copies): no arguments, a quorum queue in quorum mode.
    pub async fn declare_plain_queue(
        &self,
        broker: &Broker,
        name: &str,
    ) -> Result<(), TopologyError> {
        self.side_queue(broker, name, self.holding_args()).await
    }

    async fn exchange(&self, broker: &Broker, name: &str) -> Result<(), TopologyError> {
        self.exchange_of(broker, name, ExchangeKind::Topic).await
    }

    async fn exchange_of(
        &self,
        broker: &Broker,
        name: &str,
        kind: ExchangeKind,
    ) -> Result<(), TopologyError> {
        declare_exchange(broker, name, kind).await
    }

    async fn queue(
        &self,
        broker: &Broker,
        name: &str,
        args: FieldTable,
    ) -> Result<(), TopologyError> {
        let ch = broker.channel().await?;
        let r = ch
            .queue_declare(name.into(), QueueDeclareOptions::durable(), args)
            .await
            .map(|_| ());
        finish(ch, r, "queue", name).await
    }

    async fn bind(
        &self,
        broker: &Broker,
        queue: &str,
        exchange: &str,
        key: &str,
    ) -> Result<(), TopologyError> {
        let ch = broker.channel().await?;
        let r = ch
            .queue_bind(
                queue.into(),
                exchange.into(),
                key.into(),
                QueueBindOptions::default(),
                FieldTable::default(),
            )
            .await;
        finish(ch, r, "binding of", queue).await
    }
}

async fn finish(
    ch: lapin::Channel,
    r: Result<(), lapin::Error>,
    what: &'static str,
    name: &str,
) -> Result<(), TopologyError> {
    match r {
        Ok(()) => {
            crate::goodbye("closing a channel", ch.close(200, "ok".into())).await;
            Ok(())
        }
        Err(e) => {
            let msg = e.to_string();
            if msg.contains("PRECONDITION_FAILED") || msg.contains("inequivalent") {
                Err(TopologyError::Conflict {
                    what,
                    name: name.to_owned(),
                    detail: msg,
                })
            } else {
                Err(TopologyError::Broker(BrokerError::Amqp {
                    doing: "declaring the topology",
                    source: e,
                }))
            }
        }
    }
}

/// Whether the broker refused an operation for want of a permission.
pub(crate) fn is_refused(e: &BrokerError) -> bool {
    e.to_string().contains("ACCESS_REFUSED")
}

/// Declare the exchange `name` of `kind`, or, when this user may not
/// (`ACCESS_REFUSED`), check passively that it exists: the followers of the events and
/// control exchanges, which need no `configure` on them then.
pub(crate) async fn declare_or_verify_exchange(
    broker: &Broker,
    name: &str,
    kind: ExchangeKind,
) -> Result<(), TopologyError> {
    // As in `Topology::ensure`: refused once, checked passively from then on.
    static REFUSED: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    if let Some(refused) = REFUSED.get() {
        return exists(broker, "exchange", name, refused).await;
    }
    match declare_exchange(broker, name, kind).await {
        Err(TopologyError::Broker(e)) if is_refused(&e) => {
            let refused = e.to_string();
            exists(broker, "exchange", name, &refused).await?;
            let _ = REFUSED.set(refused);
            Ok(())
        }
        r => r,
    }
}

/// Declare the durable exchange `name` of `kind` (the one declaration of an exchange, for
/// the topology and the followers alike).
async fn declare_exchange(
    broker: &Broker,
    name: &str,
    kind: ExchangeKind,
) -> Result<(), TopologyError> {
    let ch = broker.channel().await?;
    let r = ch
        .exchange_declare(
            name.into(),
            kind,
            ExchangeDeclareOptions {
                durable: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    finish(ch, r, "exchange", name).await
}

/// Passive declare of an exchange or queue (no permission needed); `refused` is why it
/// was not declared, for the error when it does not exist.
async fn exists(
    broker: &Broker,
    what: &'static str,
    name: &str,
    refused: &str,
) -> Result<(), TopologyError> {
    let ch = broker.channel().await?;
    let r = if what == "exchange" {
        ch.exchange_declare(
            name.into(),
            ExchangeKind::Topic,
            ExchangeDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
    } else {
        ch.queue_declare(
            name.into(),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await
        .map(|_| ())
    };
    match r {
        Ok(()) => {
            crate::goodbye("closing a channel", ch.close(200, "ok".into())).await;
            Ok(())
        }
        Err(e) if e.to_string().contains("NOT_FOUND") => Err(TopologyError::Missing {
            what,
            name: name.to_owned(),
            refused: refused.to_owned(),
        }),
        Err(source) => Err(TopologyError::Broker(BrokerError::Amqp {
            doing: "checking the topology",
            source,
        })),
    }
}

fn long(s: &str) -> AMQPValue {
    AMQPValue::LongString(LongString::from(s.as_bytes().to_vec()))
}

/// Errors of [`Topology::apply`].
#[derive(Debug, thiserror::Error)]
pub enum TopologyError {
    #[error(
        "{what} `{name}` already exists with a different declaration: {detail}. Delete it (e.g. `rabbitmqctl delete_queue {name}`), or use another --prefix, or pass the matching --queue-type"
    )]
    Conflict {
        what: &'static str,
        name: String,
        detail: String,
    },
    /// A user that may not declare the topology found part of it missing.
    #[error(
        "{what} `{name}` does not exist, and this user may not declare it ({refused}): run `lastcall topology apply` as the deployer first, with the same --prefix and topology flags (docs/broker-permissions.md)"
    )]
    Missing {
        what: &'static str,
        name: String,
        refused: String,
    },
    #[error(transparent)]
    Broker(#[from] BrokerError),
}

/// Passive declare: (ready messages, consumers) of a queue, or None if it does not exist.
pub async fn queue_depth(broker: &Broker, name: &str) -> Result<Option<(u32, u32)>, BrokerError> {
    let ch = broker.channel().await?;
    let r = ch
        .queue_declare(
            ShortString::from(name),
            QueueDeclareOptions {
                passive: true,
                ..Default::default()
            },
            FieldTable::default(),
        )
        .await;
    match r {
        Ok(q) => {
            crate::goodbye("closing a channel", ch.close(200, "ok".into())).await;
            Ok(Some((q.message_count(), q.consumer_count())))
        }
        Err(e) if e.to_string().contains("NOT_FOUND") => Ok(None),
        Err(source) => Err(BrokerError::Amqp {
            doing: "inspecting a queue",
            source,
        }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_the_contract() {
        let n = Names::new("lastcall");
        assert_eq!(n.jobs_exchange, "lastcall.jobs");
        assert_eq!(n.work_queue, "lastcall.work");
        assert_eq!(n.dlx, "lastcall.dlx");
        assert_eq!(n.dead_queue, "lastcall.dead");
        assert_eq!(n.retry_queue(1_000), "lastcall.retry.1s");
        assert_eq!(n.retry_queue(30_000), "lastcall.retry.30s");
        assert_eq!(n.retry_queue(250), "lastcall.retry.250ms");
        assert_eq!("quorum".parse::<QueueType>(), Ok(QueueType::Quorum));
        assert!("fifo".parse::<QueueType>().unwrap_err().contains("classic"));
    }
}
