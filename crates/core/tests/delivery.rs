//! Table tests of the delivery state machine (`lastcall_core::delivery`), with a manual
//! clock: each row is a script of events (time moves only by `At`) and the steps the
//! machine must ask for, down to how the delivery ends with the broker.

use lastcall_core::Reason;
use lastcall_core::delivery::{Action, ClockState, Delivery, Event, FinishKind};
use lastcall_core::disposition::{Dispatch, Receipt, Slot, UNBOUNDED_BUDGET_MS};
use lastcall_core::service_time::{Estimate, EstimateSource};
use lastcall_core::{
    AdmissionPolicy, CallResult, Deadline, Envelope, EnvelopeLimits, ExpiredAction, JobId, Kind,
    ReceiptFacts, RejectError, WorkerPolicy,
};
use std::sync::Arc;

/// One event from the outside, as the worker's driver feeds it.
#[derive(Debug, Clone)]
enum Ev {
    /// The manual clock moves to this instant.
    At(i64),
    Looked(ReceiptFacts),
    Slot(ClockState),
    LatestStart,
    ClockTick,
    ClockTrusted,
    /// A redelivery of the same job already runs here.
    RunningHere,
    StartDurable {
        cancel: bool,
    },
    CallEnded(CallResult),
    Published,
    PublishFailed,
    Durable,
    Cancel,
    Shutdown,
    Lost,
}

/// The test's driver: it feeds the events to the real [`Delivery`] and writes down each
/// step the delivery asks for ([`Delivery::poll_action`]) when it changes.
struct Run {
    policy: WorkerPolicy,
    now: i64,
    delivery: Delivery,
    steps: Vec<String>,
}

impl Run {
    fn new(policy: WorkerPolicy, delivery: Delivery) -> Self {
        let mut run = Run {
            policy,
            now: 1_000,
            delivery,
            steps: Vec::new(),
        };
        run.steps.push(run.step());
        run
    }

    /// The step the delivery asks for, as the tables write it.
    fn step(&self) -> String {
        let d = &self.delivery;
        match d.poll_action() {
            Action::LookUp => "look_up".into(),
            Action::AwaitSlot => "await_slot".into(),
            Action::AwaitClock => "clock_wait".into(),
            Action::WriteStart => "write_start".into(),
            Action::Call { budget_ms } => format!("call({budget_ms} ms)"),
            Action::PublishRetry(r) => format!("publish_retry(attempt {})", r.next_attempt),
            Action::Record => {
                let t = d.terminal();
                let state = t.map_or("running", |t| t.state.as_str());
                let reason = (t.and_then(|t| t.reason.as_ref()))
                    .map(ToString::to_string)
                    .unwrap_or_default();
                format!(
                    "record({state},{reason},{},called={})",
                    d.decision().expect("recording").as_str(),
                    d.facts().expect("recording").started_at_ms.is_some()
                )
            }
            Action::Finish(f) => format!("{:?}", f.kind()).to_lowercase(),
        }
    }

    fn apply(&mut self, ev: Ev) {
        let event = match ev {
            Ev::At(t) => {
                self.now = t;
                return;
            }
            Ev::Looked(facts) => Event::Looked {
                facts,
                learned: None,
            },
            Ev::Slot(clock) => Event::SlotGranted {
                clock,
                learned: None,
            },
            Ev::LatestStart => {
                let at = self.delivery.poll_timeout(&self.policy);
                self.steps.push(format!("latest_start({at:?})"));
                Event::Timeout { learned: None }
            }
            Ev::ClockTick => Event::Timeout { learned: None },
            Ev::ClockTrusted => Event::ClockTrusted,
            Ev::RunningHere => Event::AlreadyRunningHere,
            Ev::StartDurable { cancel } => Event::StartDurable {
                learned: None,
                cancel_requested: cancel,
            },
            Ev::CallEnded(result) => Event::CallEnded {
                result,
                learned: None,
                jitter: 0.5,
            },
            Ev::Published => Event::Published,
            Ev::PublishFailed => Event::PublishFailed,
            Ev::Durable => Event::Durable,
            Ev::Cancel => Event::Cancel,
            Ev::Shutdown => Event::Shutdown,
            Ev::Lost => Event::ChannelLost,
        };
        let before = self.delivery.poll_action();
        let was_calling = matches!(before, Action::Call { .. });
        self.delivery.handle(&self.policy, event, self.now);
        let after = self.delivery.poll_action();
        if was_calling && let Some(n) = self.delivery.note() {
            self.steps
                .push(format!("note({})", &n[..n.find(':').unwrap_or(n.len())]));
        }
        if self.delivery.is_duplicate() && matches!(after, Action::Finish(_)) {
            self.steps.push("duplicate".into());
        }
        // A step is written when the delivery moves on.
        if before != after {
            self.steps.push(self.step());
        }
    }
}

fn env(expires_at_ms: i64, min_runtime_ms: Option<u64>) -> Envelope {
    Envelope::new(
        JobId::parse("job-1").unwrap(),
        Kind::parse("echo").unwrap(),
        Deadline::new(0, expires_at_ms),
        min_runtime_ms,
        None,
        serde_json::Map::new(),
    )
}

fn policy() -> WorkerPolicy {
    WorkerPolicy {
        admission: AdmissionPolicy {
            clock_uncertainty_ms: 100,
            default_min_runtime_ms: 0,
        },
        ..WorkerPolicy::default()
    }
}

struct Row {
    name: &'static str,
    policy: WorkerPolicy,
    parsed: Result<Envelope, RejectError>,
    consumer_timeout_ms: Option<u64>,
    events: Vec<Ev>,
    steps: &'static [&'static str],
}

fn row(name: &'static str, events: Vec<Ev>, steps: &'static [&'static str]) -> Row {
    Row {
        name,
        policy: policy(),
        parsed: Ok(env(10_000, None)),
        consumer_timeout_ms: None,
        events,
        steps,
    }
}

fn fresh() -> Ev {
    Ev::Looked(ReceiptFacts::default())
}

fn start() -> Ev {
    Ev::StartDurable { cancel: false }
}

fn retryable() -> CallResult {
    CallResult::Failed {
        retryable: true,
        reason: Reason::Backend("http_503".into()),
        retry_after_ms: None,
    }
}

fn run(r: Row) {
    let delivery = Delivery::new(r.parsed, 0, 1_000, r.consumer_timeout_ms);
    let mut run = Run::new(r.policy, delivery);
    for ev in r.events {
        run.apply(ev);
    }
    assert!(
        matches!(run.delivery.poll_action(), Action::Finish(_)),
        "{}: the script leaves the delivery unfinished after {:?}",
        r.name,
        run.steps
    );
    assert_eq!(run.steps, r.steps, "{}", r.name);
}

#[test]
fn the_happy_paths() {
    let rows = vec![
        row(
            "completed",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::CallEnded(CallResult::Completed),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(8900 ms)",
                "record(completed,,ack,called=true)",
                "ack",
            ],
        ),
        row(
            "cut at the deadline",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                Ev::At(2_000),
                start(),
                Ev::CallEnded(CallResult::DeadlineExceeded),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(7900 ms)",
                "record(deadline_exceeded,cancelled_at_deadline,ack,called=true)",
                "ack",
            ],
        ),
        row(
            "a terminal failure is dead-lettered",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::CallEnded(CallResult::Failed {
                    retryable: false,
                    reason: Reason::Backend("http_400".into()),
                    retry_after_ms: None,
                }),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(8900 ms)",
                "record(failed,http_400,dead_letter,called=true)",
                "deadletter",
            ],
        ),
        row(
            "a retryable failure publishes a retry, records the attempt, acks",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::CallEnded(retryable()),
                Ev::Published,
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(8900 ms)",
                "publish_retry(attempt 1)",
                "record(running,,retry,called=true)",
                "ack",
            ],
        ),
        row(
            "an unconfirmed retry fails the job",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::CallEnded(retryable()),
                Ev::PublishFailed,
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(8900 ms)",
                "publish_retry(attempt 1)",
                "record(failed,retry_publish_failed,dead_letter,called=true)",
                "deadletter",
            ],
        ),
        row(
            "a redelivery racing its first delivery starts over from the receipt",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                Ev::RunningHere,
                Ev::Looked(ReceiptFacts {
                    already_recorded: true,
                    ..ReceiptFacts::default()
                }),
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "look_up",
                "duplicate",
                "ack",
            ],
        ),
    ];
    for r in rows {
        run(r);
    }
}

#[test]
fn refusals_without_a_call() {
    let mut expired_dl = row(
        "expired at receipt, --expired-action dead-letter",
        vec![Ev::At(9_950), fresh(), Ev::Durable],
        &[
            "look_up",
            "record(expired_not_started,receipt:deadline_passed,dead_letter,called=false)",
            "deadletter",
        ],
    );
    expired_dl.policy.expired_action = ExpiredAction::DeadLetter;
    let invalid = Row {
        parsed: Envelope::parse(b"{}", &EnvelopeLimits::default(), 1_000),
        ..row(
            "an invalid envelope",
            vec![fresh(), Ev::Durable],
            &[
                "look_up",
                "record(rejected,missing_field,dead_letter,called=false)",
                "deadletter",
            ],
        )
    };
    let rows = vec![
        invalid,
        expired_dl,
        row(
            "expired at receipt",
            vec![Ev::At(9_950), fresh(), Ev::Durable],
            &[
                "look_up",
                "record(expired_not_started,receipt:deadline_passed,ack,called=false)",
                "ack",
            ],
        ),
        row(
            "a duplicate",
            vec![Ev::Looked(ReceiptFacts {
                already_recorded: true,
                ..ReceiptFacts::default()
            })],
            &["look_up", "duplicate", "ack"],
        ),
        row(
            "poison",
            vec![
                Ev::Looked(ReceiptFacts {
                    prior_starts: 5,
                    ..ReceiptFacts::default()
                }),
                Ev::Durable,
            ],
            &[
                "look_up",
                "record(failed,poison,dead_letter,called=false)",
                "deadletter",
            ],
        ),
        row(
            "cancelled before a worker had it",
            vec![
                Ev::Looked(ReceiptFacts {
                    cancel_requested: true,
                    ..ReceiptFacts::default()
                }),
                Ev::Durable,
            ],
            &[
                "look_up",
                "record(cancelled,cancel_requested,ack,called=false)",
                "ack",
            ],
        ),
        row(
            "expected wait exceeds the budget",
            vec![
                Ev::Looked(ReceiptFacts {
                    expected_wait_ms: 9_500,
                    ..ReceiptFacts::default()
                }),
                Ev::Durable,
            ],
            &[
                "look_up",
                "record(expired_not_started,receipt:expected_wait_exceeds_budget,ack,called=false)",
                "ack",
            ],
        ),
        row(
            "expired while waiting for a slot: the last admission check at the slot",
            vec![
                fresh(),
                Ev::At(9_950),
                Ev::Slot(ClockState::Trusted),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "record(expired_not_started,admission:deadline_passed,ack,called=false)",
                "ack",
            ],
        ),
        row(
            "leaves the buffer at its latest useful start",
            vec![fresh(), Ev::At(9_900), Ev::LatestStart, Ev::Durable],
            &[
                "look_up",
                "await_slot",
                "latest_start(Some(9899))",
                "record(expired_not_started,admission:deadline_passed,ack,called=false)",
                "ack",
            ],
        ),
        row(
            "the latest-start timer fired early: keeps waiting",
            vec![
                fresh(),
                Ev::At(5_000),
                Ev::LatestStart,
                Ev::Slot(ClockState::Trusted),
                Ev::Shutdown,
            ],
            &[
                "look_up",
                "await_slot",
                "latest_start(Some(9899))",
                "write_start",
                "drop",
            ],
        ),
        row(
            "cancelled while waiting for a slot",
            vec![fresh(), Ev::Cancel, Ev::Durable],
            &[
                "look_up",
                "await_slot",
                "record(cancelled,cancel_requested,ack,called=false)",
                "ack",
            ],
        ),
        row(
            "cancelled while its start was written",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                Ev::StartDurable { cancel: true },
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "record(cancelled,cancel_requested,ack,called=false)",
                "ack",
            ],
        ),
        row(
            "expired while its start was written: no call",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                Ev::At(9_950),
                start(),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "record(expired_not_started,admission:deadline_passed,ack,called=false)",
                "ack",
            ],
        ),
    ];
    for r in rows {
        run(r);
    }
}

#[test]
fn the_clock_wait() {
    let rows = vec![
        row(
            "untrusted at the slot, trusted again: waits for a slot again and runs",
            vec![
                fresh(),
                Ev::Slot(ClockState::Untrusted),
                Ev::ClockTick,
                Ev::ClockTrusted,
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::CallEnded(CallResult::Completed),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "clock_wait",
                "await_slot",
                "write_start",
                "call(8900 ms)",
                "record(completed,,ack,called=true)",
                "ack",
            ],
        ),
        row(
            "the deadline passes during the clock wait",
            vec![
                fresh(),
                Ev::Slot(ClockState::Untrusted),
                Ev::At(9_950),
                Ev::ClockTick,
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "clock_wait",
                "record(expired_not_started,admission:deadline_passed,ack,called=false)",
                "ack",
            ],
        ),
        row(
            "shutdown during the clock wait hands the job back",
            vec![
                fresh(),
                Ev::Slot(ClockState::Untrusted),
                Ev::ClockTick,
                Ev::Shutdown,
            ],
            &["look_up", "await_slot", "clock_wait", "handback"],
        ),
        row(
            "the channel is lost during the clock wait",
            vec![fresh(), Ev::Slot(ClockState::Untrusted), Ev::Lost],
            &["look_up", "await_slot", "clock_wait", "drop"],
        ),
    ];
    for r in rows {
        run(r);
    }
}

#[test]
fn the_channel_lost_at_each_step() {
    let rows = vec![
        row("while looked up", vec![Ev::Lost], &["look_up", "drop"]),
        row(
            "while waiting for a slot",
            vec![fresh(), Ev::Lost],
            &["look_up", "await_slot", "drop"],
        ),
        row(
            "while the start is written: the call runs, its ack is dropped",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                Ev::Lost,
                start(),
                Ev::CallEnded(CallResult::Completed),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(8900 ms)",
                "record(completed,,ack,called=true)",
                "drop",
            ],
        ),
        row(
            "during the call: the outcome is recorded, the ack dropped",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::Lost,
                Ev::CallEnded(CallResult::Failed {
                    retryable: false,
                    reason: Reason::Backend("http_400".into()),
                    retry_after_ms: None,
                }),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(8900 ms)",
                "record(failed,http_400,dead_letter,called=true)",
                "drop",
            ],
        ),
        row(
            "while the retry is published: nothing recorded, the redelivery is the retry",
            vec![
                fresh(),
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::CallEnded(retryable()),
                Ev::Lost,
                Ev::PublishFailed,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(8900 ms)",
                "publish_retry(attempt 1)",
                "drop",
            ],
        ),
        row(
            "while the outcome is written",
            vec![fresh(), Ev::Cancel, Ev::Lost, Ev::Durable],
            &[
                "look_up",
                "await_slot",
                "record(cancelled,cancel_requested,ack,called=false)",
                "drop",
            ],
        ),
    ];
    for r in rows {
        run(r);
    }
}

#[test]
fn shutdown_at_each_step() {
    let rows = vec![
        row(
            "while looked up",
            vec![Ev::Shutdown],
            &["look_up", "handback"],
        ),
        row(
            "while waiting for a slot",
            vec![fresh(), Ev::Shutdown],
            &["look_up", "await_slot", "handback"],
        ),
        row(
            "before the start is durable: nothing is sent",
            vec![fresh(), Ev::Slot(ClockState::Trusted), Ev::Shutdown],
            &["look_up", "await_slot", "write_start", "drop"],
        ),
        row(
            "before the outcome is durable: no ack",
            vec![fresh(), Ev::Cancel, Ev::Shutdown],
            &[
                "look_up",
                "await_slot",
                "record(cancelled,cancel_requested,ack,called=false)",
                "drop",
            ],
        ),
    ];
    for r in rows {
        run(r);
    }
}

#[test]
fn the_ack_window() {
    // 5 s consumer timeout, 1 s margin: the window closes at 1,000 + 4,000.
    let closed_at_slot = Row {
        consumer_timeout_ms: Some(5_000),
        ..row(
            "the window closed while the job waited: handed back unrecorded",
            vec![fresh(), Ev::At(5_000), Ev::Slot(ClockState::Trusted)],
            &["look_up", "await_slot", "handback"],
        )
    };
    let closed_at_start = Row {
        consumer_timeout_ms: Some(5_000),
        ..row(
            "the start's write took the window: recorded handed back, then handed back",
            vec![
                fresh(),
                Ev::At(4_000),
                Ev::Slot(ClockState::Trusted),
                Ev::At(5_000),
                start(),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "record(running,,handed_back,called=false)",
                "handback",
            ],
        )
    };
    let cut = Row {
        consumer_timeout_ms: Some(5_000),
        ..row(
            "a call cut at the window is failed/consumer_timeout, not deadline_exceeded",
            vec![
                fresh(),
                Ev::At(1_500),
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::CallEnded(CallResult::DeadlineExceeded),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "write_start",
                "call(3500 ms)",
                "note(cut after 3500 ms, before the deadline)",
                "record(failed,consumer_timeout,dead_letter,called=true)",
                "deadletter",
            ],
        )
    };
    for r in [closed_at_slot, closed_at_start, cut] {
        run(r);
    }
}

/// A dispatch that checks no deadline (as the bench's `naive` reference, which lives in
/// `lastcall-bench`): the checks are the policy's, the state machine only orders the steps.
#[derive(Debug)]
struct NoChecks;

impl Dispatch for NoChecks {
    fn name(&self) -> &'static str {
        "no-checks"
    }
    fn on_receipt(&self, _: &WorkerPolicy, _: &Envelope, _: ReceiptFacts, _: i64) -> Receipt {
        Receipt::WaitForSlot
    }
    fn on_slot(&self, _: &WorkerPolicy, _: &Envelope, _: Option<u64>, _: i64) -> Slot {
        Slot::Run {
            budget_ms: UNBOUNDED_BUDGET_MS,
        }
    }
    fn watches_latest_start(&self) -> bool {
        false
    }
}

#[test]
fn the_deadline_checks_are_the_policys() {
    let unchecked = Row {
        policy: WorkerPolicy {
            dispatch: Arc::new(NoChecks),
            ..policy()
        },
        ..row(
            "no checks: an expired job runs, unbounded",
            vec![
                Ev::At(20_000),
                fresh(),
                Ev::LatestStart,
                Ev::Slot(ClockState::Trusted),
                start(),
                Ev::CallEnded(CallResult::Completed),
                Ev::Durable,
            ],
            &[
                "look_up",
                "await_slot",
                "latest_start(None)",
                "write_start",
                "call(3600000 ms)",
                "record(completed,,ack,called=true)",
                "ack",
            ],
        )
    };
    run(unchecked);
}

#[test]
fn the_facts_carry_the_instants_the_ledger_records() {
    let p = policy();
    let mut d = Delivery::new(Ok(env(10_000, Some(500))), 2, 1_000, None);
    d.handle(&p, looked(ReceiptFacts::default(), None), 1_000);
    assert_eq!(
        d.poll_action(),
        Action::AwaitSlot,
        "a fresh job waits for a slot"
    );
    assert_eq!(d.facts().unwrap().min_runtime_ms, Some(500));
    d.handle(&p, slot(None), 3_000);
    assert_eq!(d.poll_action(), Action::WriteStart, "admitted");
    assert_eq!(d.facts().unwrap().checked_at_ms, Some(3_000));
    assert_eq!(d.facts().unwrap().started_at_ms, None);
    d.handle(&p, started(None), 3_100);
    assert_eq!(d.poll_action(), Action::Call { budget_ms: 6_800 });
    d.handle(&p, ended(CallResult::Completed), 4_000);
    assert_eq!(d.poll_action(), Action::Record);
    let f = d.facts().unwrap();
    assert_eq!(
        (
            f.attempt,
            f.received_at_ms,
            f.checked_at_ms,
            f.started_at_ms,
            f.finished_at_ms
        ),
        (2, 1_000, Some(3_000), Some(3_100), Some(4_000))
    );
    assert_eq!(d.call_result(), Some(&CallResult::Completed));
}

/// A job whose backend's next rate-limit permit comes after its latest useful start ends
/// without a call: `expired_not_started`, `admission:rate_limited`, checked then, acked;
/// one whose permit comes in time waits for it.
#[test]
fn a_rate_limited_job_ends_unstarted_with_its_reason() {
    let p = policy();
    let mut d = Delivery::new(Ok(env(10_000, Some(500))), 0, 1_000, None);
    d.handle(&p, looked(ReceiptFacts::default(), None), 1_000);
    // A permit before its latest useful start (10 000 − 100 − 500): it keeps waiting.
    let permit_at_ms = Some(9_400);
    d.handle(
        &p,
        Event::NoRatePermit {
            permit_at_ms,
            learned: None,
        },
        1_100,
    );
    assert_eq!(d.poll_action(), Action::AwaitSlot);
    // One after it: it ends now.
    let permit_at_ms = Some(9_401);
    d.handle(
        &p,
        Event::NoRatePermit {
            permit_at_ms,
            learned: None,
        },
        1_200,
    );
    assert_eq!(d.poll_action(), Action::Record);
    let t = d.terminal().expect("terminal");
    assert_eq!(t.state, lastcall_core::State::ExpiredNotStarted);
    assert_eq!(
        t.reason.as_ref().map(ToString::to_string).as_deref(),
        Some("admission:rate_limited")
    );
    assert_eq!(d.facts().unwrap().checked_at_ms, Some(1_200));
    assert_eq!(d.facts().unwrap().started_at_ms, None);
    assert_eq!(d.decision(), Some(lastcall_core::Decision::Ack));
    d.handle(&p, Event::Durable, 1_300);
    assert!(matches!(d.poll_action(), Action::Finish(f) if f.kind() == FinishKind::Ack));
}

fn estimate(quantile_ms: u64) -> Estimate {
    Estimate {
        quantile_ms,
        mean_ms: quantile_ms / 2,
        samples: 40,
        source: EstimateSource::Key,
    }
}

fn looked(facts: ReceiptFacts, learned: Option<Estimate>) -> Event {
    Event::Looked { facts, learned }
}

fn slot(learned: Option<Estimate>) -> Event {
    Event::SlotGranted {
        clock: ClockState::Trusted,
        learned,
    }
}

fn started(learned: Option<Estimate>) -> Event {
    Event::StartDurable {
        learned,
        cancel_requested: false,
    }
}

fn ended(result: CallResult) -> Event {
    Event::CallEnded {
        result,
        learned: None,
        jitter: 0.0,
    }
}

/// The timeout a waiting job asks for is its latest useful start with the learned call
/// time it was last given; a newer estimate moves it, and the timeout then either keeps
/// the job waiting or settles it without a call.
#[test]
fn the_latest_start_follows_the_learned_estimate() {
    let p = policy();
    let mut d = Delivery::new(Ok(env(10_000, None)), 0, 1_000, None);
    d.handle(
        &p,
        looked(ReceiptFacts::default(), Some(estimate(2_000))),
        1_000,
    );
    assert_eq!(d.poll_action(), Action::AwaitSlot);
    // 10 000 − 100 (clock margin) − 2 000.
    assert_eq!(d.poll_timeout(&p), Some(7_900));
    d.handle(&p, Event::Estimate(Some(estimate(4_000))), 2_000);
    assert_eq!(d.poll_timeout(&p), Some(5_900));
    // The estimate fell again before the timer fired: still admissible, keep waiting.
    d.handle(
        &p,
        Event::Timeout {
            learned: Some(estimate(1_000)),
        },
        5_901,
    );
    assert_eq!(d.poll_action(), Action::AwaitSlot);
    assert_eq!(d.poll_timeout(&p), Some(8_900));
    d.handle(
        &p,
        Event::Timeout {
            learned: Some(estimate(1_000)),
        },
        8_901,
    );
    assert_eq!(d.poll_action(), Action::Record);
    let t = d.terminal().expect("terminal");
    assert_eq!(t.state, lastcall_core::State::ExpiredNotStarted);
    assert_eq!(d.poll_timeout(&p), None, "only a waiting job has a timeout");
    // The ledger's note says which learned time refused it.
    let note = d.note().expect("a learned refusal explains itself");
    assert!(note.contains("p99 1000 ms"), "{note}");
}

/// A refusal by the floor, not by the learned call time, has no learned note; a call cut
/// at the ack window has its own, and its result is recorded as the ack window's.
#[test]
fn the_ledger_note_is_the_cores() {
    let p = policy();
    let mut d = Delivery::new(Ok(env(1_050, None)), 0, 1_000, None);
    d.handle(
        &p,
        looked(ReceiptFacts::default(), Some(estimate(10))),
        1_000,
    );
    assert_eq!(d.poll_action(), Action::Record, "past its clock margin");
    assert_eq!(d.note(), None);

    let mut d = Delivery::new(Ok(env(100_000, None)), 0, 1_000, Some(30_000));
    d.handle(&p, looked(ReceiptFacts::default(), None), 1_000);
    d.handle(&p, slot(None), 1_000);
    d.handle(&p, started(None), 1_000);
    let Action::Call { budget_ms } = d.poll_action() else {
        panic!("called");
    };
    assert!(budget_ms < 30_000, "cut inside the ack window: {budget_ms}");
    d.handle(
        &p,
        ended(CallResult::DeadlineExceeded),
        1_000 + budget_ms as i64,
    );
    assert!(matches!(
        d.call_result(),
        Some(CallResult::Failed {
            retryable: false,
            ..
        })
    ));
    assert!(d.note().expect("cut note").contains("consumer_timeout"));
}

/// Events a state has no use for leave it as it is: a cancellation while the call runs
/// (the driver aborts the call, which ends as `Cancelled`), a stale timer, a slot for a
/// job that is no longer waiting.
#[test]
fn an_event_a_state_has_no_use_for_changes_nothing() {
    let p = policy();
    let mut d = Delivery::new(Ok(env(10_000, None)), 0, 1_000, None);
    for ev in [Event::Durable, slot(None), Event::Published] {
        d.handle(&p, ev, 1_000);
        assert_eq!(d.poll_action(), Action::LookUp);
    }
    d.handle(&p, looked(ReceiptFacts::default(), None), 1_000);
    d.handle(&p, slot(None), 1_000);
    d.handle(&p, started(None), 1_000);
    let calling = d.poll_action();
    for ev in [
        Event::Cancel,
        Event::Timeout { learned: None },
        slot(None),
        Event::Shutdown,
    ] {
        d.handle(&p, ev, 2_000);
        assert_eq!(d.poll_action(), calling);
    }
    d.handle(&p, ended(CallResult::Cancelled), 2_000);
    assert_eq!(
        d.terminal().map(|t| t.state),
        Some(lastcall_core::State::Cancelled)
    );
}

/// The breaker's gate is the core's: a job whose model server's breaker opens again before
/// its latest useful start keeps waiting (without a slot); past it, or never admissible
/// with the learned time, it ends without a call, `admission:upstream_unavailable`. A
/// policy that does not watch the latest start waits for the breaker.
#[test]
fn an_open_breaker_past_the_latest_start_ends_the_job_unstarted() {
    let p = policy();
    let mut d = Delivery::new(Ok(env(10_000, None)), 0, 1_000, None);
    d.handle(&p, looked(ReceiptFacts::default(), None), 1_000);
    let open = |next_call_at_ms, learned| Event::BreakerOpen {
        next_call_at_ms,
        learned,
    };
    // Latest start with a learned 2 s: 10 000 − 100 − 2 000.
    d.handle(&p, open(7_900, Some(estimate(2_000))), 1_200);
    assert_eq!(d.poll_action(), Action::AwaitSlot);
    d.handle(&p, open(7_901, Some(estimate(2_000))), 1_300);
    assert_eq!(d.poll_action(), Action::Record);
    let t = d.terminal().expect("terminal");
    assert_eq!(
        t.reason.as_ref().map(ToString::to_string).as_deref(),
        Some("admission:upstream_unavailable")
    );
    assert_eq!(d.facts().unwrap().checked_at_ms, Some(1_300));

    let unwatched = WorkerPolicy {
        dispatch: Arc::new(NoChecks),
        ..policy()
    };
    let mut d = Delivery::new(Ok(env(10_000, None)), 0, 1_000, None);
    d.handle(&unwatched, looked(ReceiptFacts::default(), None), 1_000);
    d.handle(&unwatched, open(60_000, None), 1_200);
    assert_eq!(d.poll_action(), Action::AwaitSlot);
    // Without a latest start to hold it to, a rate limit that never comes refuses it.
    let never = Event::NoRatePermit {
        permit_at_ms: None,
        learned: None,
    };
    d.handle(&unwatched, never, 1_300);
    assert_eq!(d.poll_action(), Action::Record);
}
