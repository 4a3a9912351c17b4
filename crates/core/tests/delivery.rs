//! Table tests of the delivery state machine (`lastcall_core::delivery`), with a manual
//! clock: each row is a script of events (time moves only by `At`) and the steps the
//! machine must ask for, down to how the delivery ends with the broker.

use lastcall_core::Reason;
use lastcall_core::delivery::{
    self, Admission, ClockState, ClockTick, Finish, Looked, PublishFailed, Settle, Started,
    WaitTick,
};
use lastcall_core::disposition::{Dispatch, Receipt, Slot, UNBOUNDED_BUDGET_MS};
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

/// The machine between events (the test's view of the driver).
enum Phase {
    Received(delivery::Received),
    Waiting(delivery::Waiting),
    ClockWait(delivery::ClockWait),
    Admitted(delivery::Admitted),
    Calling(delivery::Calling),
    Publishing(delivery::Publishing),
    Recording(delivery::Recording),
    Done,
}

struct Run {
    policy: WorkerPolicy,
    now: i64,
    learned: Option<u64>,
    steps: Vec<String>,
}

impl Run {
    fn settle(&mut self, s: Settle) -> Phase {
        match s {
            Settle::Record(r) => self.record(r),
            Settle::PublishRetry(p) => {
                self.steps
                    .push(format!("publish_retry(attempt {})", p.retry().next_attempt));
                Phase::Publishing(p)
            }
            Settle::Duplicate(f) => {
                self.steps.push("duplicate".into());
                self.finish(f)
            }
        }
    }

    fn record(&mut self, r: delivery::Recording) -> Phase {
        let state = r.terminal().map_or("running", |t| t.state.as_str());
        let reason = r
            .terminal()
            .and_then(|t| t.reason.as_ref())
            .map(ToString::to_string)
            .unwrap_or_default();
        self.steps.push(format!(
            "record({state},{reason},{},called={})",
            r.decision().as_str(),
            r.facts().started_at_ms.is_some()
        ));
        Phase::Recording(r)
    }

    fn finish(&mut self, f: Finish) -> Phase {
        self.steps.push(format!("{:?}", f.kind()).to_lowercase());
        Phase::Done
    }

    fn apply(&mut self, phase: Phase, ev: Ev) -> Phase {
        let (p, now, learned) = (&self.policy.clone(), self.now, self.learned);
        match (phase, ev) {
            (phase, Ev::At(t)) => {
                self.now = t;
                phase
            }
            (Phase::Received(r), Ev::Looked(f)) => match r.looked(p, f, now) {
                Looked::AwaitSlot(w) => {
                    self.steps.push("await_slot".into());
                    Phase::Waiting(w)
                }
                Looked::Settle(s) => self.settle(s),
            },
            (Phase::Received(r), Ev::Shutdown) => self.finish(r.shutdown()),
            (Phase::Received(r), Ev::Lost) => self.finish(r.channel_lost()),
            (Phase::Waiting(w), Ev::Slot(clock)) => match w.slot_granted(clock, p, learned, now) {
                Admission::Start(a) => {
                    self.steps.push("write_start".into());
                    Phase::Admitted(a)
                }
                Admission::Settle(s) => self.settle(s),
                Admission::ClockWait(c) => {
                    self.steps.push("clock_wait".into());
                    Phase::ClockWait(c)
                }
                Admission::HandBack(f) => self.finish(f),
            },
            (Phase::Waiting(w), Ev::LatestStart) => {
                let at = w.latest_start_ms(p, learned);
                self.steps.push(format!("latest_start({at:?})"));
                match w.latest_start_reached(p, learned, now) {
                    WaitTick::Keep(w) => Phase::Waiting(w),
                    WaitTick::Settle(s) => self.settle(s),
                }
            }
            (Phase::Waiting(w), Ev::Cancel) => {
                let s = w.cancel();
                self.settle(s)
            }
            (Phase::Waiting(w), Ev::Shutdown) => self.finish(w.shutdown()),
            (Phase::Waiting(w), Ev::Lost) => self.finish(w.channel_lost()),
            (Phase::ClockWait(c), Ev::ClockTick) => match c.tick(p, learned, now) {
                ClockTick::Keep(c) => Phase::ClockWait(c),
                ClockTick::Settle(s) => self.settle(s),
            },
            (Phase::ClockWait(c), Ev::ClockTrusted) => {
                self.steps.push("await_slot".into());
                Phase::Waiting(c.trusted())
            }
            (Phase::ClockWait(c), Ev::Shutdown) => self.finish(c.shutdown()),
            (Phase::ClockWait(c), Ev::Lost) => self.finish(c.channel_lost()),
            (Phase::Admitted(a), Ev::RunningHere) => {
                self.steps.push("look_up".into());
                Phase::Received(a.already_running_here())
            }
            (Phase::Admitted(a), Ev::StartDurable { cancel }) => {
                match a.start_durable(p, learned, cancel, now) {
                    Started::Call(c) => {
                        self.steps.push(format!("call({} ms)", c.budget_ms()));
                        Phase::Calling(c)
                    }
                    Started::Settle(s) => self.settle(s),
                    Started::HandBack(r) => self.record(r),
                }
            }
            (Phase::Admitted(a), Ev::Lost) => Phase::Admitted(a.channel_lost()),
            (Phase::Admitted(a), Ev::Shutdown) => self.finish(a.shutdown()),
            (Phase::Calling(c), Ev::CallEnded(result)) => {
                let ended = c.call_ended(p, result, None, now, 0.5);
                if let Some(n) = &ended.note {
                    self.steps
                        .push(format!("note({})", &n[..n.find(':').unwrap_or(n.len())]));
                }
                self.settle(ended.settle)
            }
            (Phase::Calling(c), Ev::Lost) => Phase::Calling(c.channel_lost()),
            (Phase::Publishing(pb), Ev::Published) => {
                let r = pb.published();
                self.record(r)
            }
            (Phase::Publishing(pb), Ev::PublishFailed) => match pb.failed() {
                PublishFailed::Record(r) => self.record(r),
                PublishFailed::Drop(f) => self.finish(f),
            },
            (Phase::Publishing(pb), Ev::Lost) => Phase::Publishing(pb.channel_lost()),
            (Phase::Recording(r), Ev::Durable) => self.finish(r.durable()),
            (Phase::Recording(r), Ev::Lost) => Phase::Recording(r.channel_lost()),
            (Phase::Recording(r), Ev::Shutdown) => self.finish(r.shutdown()),
            (_, ev) => panic!("the table feeds {ev:?} to a state that has no such event"),
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
    let mut run = Run {
        policy: r.policy,
        now: 1_000,
        learned: None,
        steps: vec!["look_up".into()],
    };
    let mut phase = Phase::Received(delivery::receive(r.parsed, 0, 1_000, r.consumer_timeout_ms));
    for ev in r.events {
        phase = run.apply(phase, ev);
    }
    assert!(
        matches!(phase, Phase::Done),
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
    let received = delivery::receive(Ok(env(10_000, Some(500))), 2, 1_000, None);
    let Looked::AwaitSlot(w) = received.looked(&p, ReceiptFacts::default(), 1_000) else {
        panic!("a fresh job waits for a slot");
    };
    assert_eq!(w.facts().min_runtime_ms, Some(500));
    let Admission::Start(a) = w.slot_granted(ClockState::Trusted, &p, None, 3_000) else {
        panic!("admitted");
    };
    assert_eq!(a.facts().checked_at_ms, Some(3_000));
    assert_eq!(a.facts().started_at_ms, None);
    let Started::Call(c) = a.start_durable(&p, None, false, 3_100) else {
        panic!("called");
    };
    assert_eq!(c.budget_ms(), 6_800);
    let ended = c.call_ended(&p, CallResult::Completed, None, 4_000, 0.0);
    let Settle::Record(r) = ended.settle else {
        panic!("recorded");
    };
    let f = r.facts();
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
}

/// A job whose backend's next rate-limit permit comes after its latest useful start ends
/// without a call: `expired_not_started`, `admission:rate_limited`, checked then, acked.
#[test]
fn a_rate_limited_job_ends_unstarted_with_its_reason() {
    let p = policy();
    let received = delivery::receive(Ok(env(10_000, Some(500))), 0, 1_000, None);
    let Looked::AwaitSlot(w) = received.looked(&p, ReceiptFacts::default(), 1_000) else {
        panic!("a fresh job waits for a slot");
    };
    let Settle::Record(r) = w.rate_limited(&p, 1_200) else {
        panic!("recorded");
    };
    let t = r.terminal().expect("terminal");
    assert_eq!(t.state, lastcall_core::State::ExpiredNotStarted);
    assert_eq!(
        t.reason.as_ref().map(ToString::to_string).as_deref(),
        Some("admission:rate_limited")
    );
    assert_eq!(r.facts().checked_at_ms, Some(1_200));
    assert_eq!(r.facts().started_at_ms, None);
    assert_eq!(r.decision(), lastcall_core::Decision::Ack);
}
