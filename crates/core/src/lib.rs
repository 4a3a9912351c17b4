//! The pure deadline core of lastcall.
//!
//! Nothing in this crate performs IO or reads a clock: every function that needs the
//! current time takes `now_ms` as an argument. This is what makes the deadline rules
//! property-testable, and what lets the worker, the publisher, the dead-letter processor
//! and the benchmarks share exactly one definition of "too late".
//!
//! # Layout
//! - [`ids`]: `JobId` and `Kind`, parsed once at the edge.
//! - [`envelope`]: the v1 job envelope (docs/wire-format.md) with validation reasons that name the field.
//! - [`deadline`]: the immutable absolute deadline, the remaining budget and the broker TTL.
//! - [`admission`]: the last admission check before a model call.
//! - [`breaker`]: the circuit breaker per model server (closed, open, half-open).
//! - [`concurrency`]: the adaptive limit of model calls in flight (`--slots auto`).
//! - [`fallback`]: which backend of a kind's ordered route (a fallback route) takes a job now.
//! - [`retry`]: exponential backoff with jitter, clipped to the deadline.
//! - [`disposition`]: what the worker does with each delivery, as an enum naming every case.
//! - [`delivery`]: the life of one delivery as a state machine over those decisions.
//! - [`ack_plan`]: which coalesced acks are safe now, over plain delivery tags.
//! - [`model_choice`]: which model the upstream is asked for (a payload's only when allowed).
//! - [`outcome`]: the ledger's outcome states (docs/concepts.md).
//! - [`rate_limit`]: per-backend requests and tokens per minute (token buckets), tightened
//!   by the server's `x-ratelimit-*` headers.
//! - [`reason`]: the ledger's outcome reasons and attempt decisions, typed up to the store.
//! - [`deadletter`]: classifying dead letters by their `x-death` reason.
//! - [`report`]: outcome and failure statistics over plain records (`lastcall report`).
//! - [`schedule`]: the wait queue for model slots and its policies (EDF, fair share, tiers).
//! - [`wait`]: the expected wait for a model slot, for the refusal at receipt.
//! - [`service_time`]: model-call durations learned per key (windowed p90 and mean), for admission.
//! - [`signature`]: the `x-lastcall-signature` HMAC over job id, deadline and body.
//! - [`ack_window`]: the model call's timeout capped inside the broker's consumer timeout.
//! - [`event`]: the outcome event published to `{prefix}.events` after a durable outcome.
//! - [`delta`]: token deltas of a streaming call, sent to the job's `reply_to`.
//! - [`tenant`]: the envelope's optional `tenant` and `priority` tier.
//! - [`table`]: plain-text tables for terminal output (every table `lastcall` and
//!   `lastcall-bench` print), pure string formatting.

pub mod ack_plan;
pub mod ack_window;
pub mod admission;
pub mod alerts;
pub mod autoscale;
pub mod batch;
pub mod breaker;
pub mod concurrency;
pub mod deadletter;
pub mod deadline;
pub mod delivery;
pub mod delta;
pub mod disposition;
pub mod envelope;
pub mod event;
pub mod fallback;
pub mod headline;
pub mod ids;
pub mod lease;
pub mod live;
pub mod model_choice;
pub mod outcome;
pub mod rate_limit;
pub mod reason;
pub mod redact;
pub mod report;
pub mod request_size;
pub mod retry;
pub mod schedule;
pub mod service_time;
pub mod signature;
pub mod table;
pub mod tenant;
pub mod wait;

pub use admission::{Admission, AdmissionPolicy, Refusal, Stage};
pub use deadline::Deadline;
pub use disposition::{
    CallResult, DeadlineChecks, Dispatch, Disposition, ExpiredAction, PeerOffer, ReceiptFacts,
    Terminal, WorkerPolicy,
};
pub use envelope::{Envelope, EnvelopeLimits, RejectError, RejectReason};
pub use event::OutcomeEvent;
pub use ids::{JobId, Kind, fingerprint, job_id_for, request_hash, synthetic_job_id};
pub use outcome::State;
pub use reason::{Decision, Reason, RefusalCause};
pub use retry::{RetryDecision, RetryPolicy};
pub use service_time::{
    CallToken, Estimate, EstimateSource, Predictor, ProbeEnd, ServiceTimeConfig, ServiceTimes,
};
pub use signature::SigningKey;
pub use tenant::{LANES, Priority, Tenant, lane_of};
