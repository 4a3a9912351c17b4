//! Model slots, granted to the jobs waiting in the local buffer in the buffer's order.
//!
//! A worker runs at most `slots` model calls at once. Jobs received while every slot is
//! busy wait in the bounded local buffer (at most `prefetch` deliveries). When a call ends
//! its slot goes to the waiting job that comes first in [`lastcall_core::schedule`]'s
//! fair share: the highest priority tier first; within a tier, the tenant with the least
//! model time served for its weight; within a tenant, by [`BufferOrder`]:
//! - [`BufferOrder::Edf`]: the job whose deadline is earliest (ties: received first);
//! - [`BufferOrder::Fifo`]: the job received first.
//!
//! With one tenant and one tier (every job of an old producer) that is plain EDF or FIFO.
//! This file is a thin wrapper: the order and the expected work ahead are the core's
//! [`Schedule`]; here are only the waiters' channels and the permits.
//!
//! "Received first" is the order of receipt ([`Slots::receipt`], taken as the consumer
//! registers each delivery, one after the other), not the order in which the jobs' tasks
//! reach [`Slots::acquire`]: those run in parallel and the first to arrive may be the later
//! delivery.
//!
//! `lastcall bench goodput --order` measures the two against each other; the default is
//! the one that completed more jobs on time.
//!
//! **Adaptive slots** (`--slots auto`): the number of slots is the current limit of a
//! [`lastcall_core::concurrency::AdaptiveLimit`], fed each call's time
//! ([`SlotPermit::ended`]). A slot is granted while fewer than the limit are held; when the
//! limit falls, calls in flight finish and their slots are not handed on until the count
//! is below it; when it rises, waiters are woken at once. [`Slots::inflation`] is what the
//! admission gates multiply the learned call time by (the slowdown at the current limit).
//!
//! A waiter that gives up (its job left the buffer: it can no longer finish, it was
//! cancelled, the connection was lost) simply drops its [`Slots::acquire`] future; a slot
//! granted to it in the same instant goes back to the next waiter. Memory is bounded by
//! the buffer: one entry per waiting delivery, and entries of waiters that gave up are
//! swept as the queue grows.

use lastcall_core::concurrency::{AdaptiveLimit, LimitConfig, Running, Sample};
use lastcall_core::schedule::{FairShare, Schedule, Ticket, Within};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// The order among one tenant's waiting jobs of one priority tier.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BufferOrder {
    /// Earliest deadline first (ties: the job received first).
    #[default]
    Edf,
    /// The job received first.
    Fifo,
}

impl BufferOrder {
    pub fn as_str(self) -> &'static str {
        match self {
            BufferOrder::Edf => "edf",
            BufferOrder::Fifo => "fifo",
        }
    }

    fn within(self) -> Within {
        match self {
            BufferOrder::Edf => Within::Edf,
            BufferOrder::Fifo => Within::Fifo,
        }
    }
}

impl std::str::FromStr for BufferOrder {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "edf" => Ok(BufferOrder::Edf),
            "fifo" => Ok(BufferOrder::Fifo),
            other => Err(format!(
                "unknown buffer order {other:?}: expected `edf` (earliest deadline first) or `fifo`"
            )),
        }
    }
}

/// The model slots of one worker.
#[derive(Debug)]
pub struct Slots {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The next receipt number ([`Slots::receipt`]).
    receipts: std::sync::atomic::AtomicU64,
    state: Mutex<State>,
}

/// How many slots there are.
#[derive(Debug)]
enum Limit {
    Fixed(usize),
    Auto(AdaptiveLimit),
}

/// Invariant: `held < limit` only while no waiter is queued that has not given up (a
/// release or a raise hands slots to waiters before counting them free).
#[derive(Debug)]
struct State {
    /// Permits held now.
    held: usize,
    limit: Limit,
    queue: Schedule<oneshot::Sender<SlotPermit>, FairShare>,
    /// The calls started under held permits (by permit id): the adaptive limit checks
    /// them before a step up. At most `held` entries.
    running: HashMap<u64, Running>,
    next_id: u64,
}

impl State {
    fn limit(&self) -> usize {
        match &self.limit {
            Limit::Fixed(n) => *n,
            Limit::Auto(a) => a.limit(),
        }
    }
}

/// A held model slot; dropping it hands the slot to the next waiter.
#[derive(Debug)]
pub struct SlotPermit {
    inner: Option<Arc<Inner>>,
    id: u64,
    /// Set by [`SlotPermit::started`]: when its call started, and with how many in flight.
    started: Option<(i64, usize)>,
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        let mut s = inner.lock();
        s.running.remove(&self.id);
        s.held -= 1;
        grant(&inner, &mut s);
    }
}

/// Hand free slots (held < limit) to the waiters, in the order.
fn grant(inner: &Arc<Inner>, s: &mut State) {
    while s.held < s.limit() {
        let Some((ticket, tx)) = s.queue.pop() else {
            return;
        };
        s.next_id += 1;
        let permit = SlotPermit {
            inner: Some(inner.clone()),
            id: s.next_id,
            started: None,
        };
        match tx.send(permit) {
            Ok(()) => {
                s.held += 1;
                s.queue.granted(&ticket);
            }
            // That waiter gave up: disarm the returned permit and try the next one.
            Err(mut p) => p.inner = None,
        }
    }
}

impl SlotPermit {
    /// Its model call starts now (`now_ms`), admitted with `expected_ms` (the inflated
    /// learned time), for a job whose deadline is `deadline_ms`.
    pub fn started(&mut self, expected_ms: u64, deadline_ms: i64, now_ms: i64) {
        let Some(inner) = &self.inner else {
            return;
        };
        let mut s = inner.lock();
        s.running.insert(
            self.id,
            Running {
                started_ms: now_ms,
                expected_ms,
                deadline_ms,
            },
        );
        self.started = Some((now_ms, s.running.len()));
    }

    /// Its call ended at `now_ms`, taking `observed_ms`; the learned mean for its request
    /// was `expected_ms` (uninflated; 0 when nothing is learned): the adaptive limit learns
    /// from it, and waiters get the slots a raise made.
    pub fn ended(&mut self, observed_ms: u64, expected_ms: u64, now_ms: i64) {
        let (Some(inner), Some((started_ms, in_flight))) = (&self.inner, self.started.take())
        else {
            return;
        };
        let inner = inner.clone();
        let mut s = inner.lock();
        s.running.remove(&self.id);
        let running: Vec<Running> = s.running.values().copied().collect();
        if let Limit::Auto(a) = &mut s.limit {
            let sample = Sample {
                started_ms,
                in_flight,
                observed_ms,
                expected_ms,
            };
            let before = a.limit();
            let after = a.observe(sample, &running, now_ms);
            if after != before {
                tracing::info!(
                    from = before,
                    to = after,
                    "model slots: the adaptive limit moved"
                );
            }
        }
        grant(&inner, &mut s);
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Slots {
    /// `total` slots; waiting jobs in `order` within each tenant, tenants weighted by
    /// `weights` (absent: 1).
    pub fn new(
        total: usize,
        order: BufferOrder,
        weights: impl IntoIterator<Item = (String, u32)>,
    ) -> Self {
        Self::with_limit(Limit::Fixed(total.max(1)), order, weights)
    }

    /// Adaptive slots (`--slots auto`): the limit of an [`AdaptiveLimit`] with `cfg`.
    pub fn adaptive(
        cfg: LimitConfig,
        order: BufferOrder,
        weights: impl IntoIterator<Item = (String, u32)>,
    ) -> Self {
        Self::with_limit(Limit::Auto(AdaptiveLimit::new(cfg)), order, weights)
    }

    fn with_limit(
        limit: Limit,
        order: BufferOrder,
        weights: impl IntoIterator<Item = (String, u32)>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                receipts: std::sync::atomic::AtomicU64::new(0),
                state: Mutex::new(State {
                    held: 0,
                    limit,
                    queue: Schedule::new(FairShare::new(order.within()).with_weights(weights)),
                    running: HashMap::new(),
                    next_id: 0,
                }),
            }),
        }
    }

    /// The number of slots now: the fixed count, or the adaptive limit.
    pub fn total(&self) -> usize {
        self.inner.lock().limit()
    }

    /// Whether the number of slots adapts (`--slots auto`).
    pub fn is_adaptive(&self) -> bool {
        matches!(self.inner.lock().limit, Limit::Auto(_))
    }

    /// What the learned call time is multiplied by for admission: the predicted slowdown
    /// of a call started now at the current limit (1 with fixed slots).
    pub fn inflation(&self) -> f64 {
        match &self.inner.lock().limit {
            Limit::Fixed(_) => 1.0,
            Limit::Auto(a) => a.inflation(),
        }
    }

    /// A job was refused at `now_ms` while a slot was free, by the learned time × the
    /// inflation, where the learned time alone would have admitted it
    /// ([`AdaptiveLimit::refused_by_inflation`]: such refusals end a level the prediction
    /// keeps from being filled). Nothing with fixed slots.
    pub fn refused_by_inflation(&self, now_ms: i64) {
        let mut s = self.inner.lock();
        if let Limit::Auto(a) = &mut s.limit {
            let before = a.limit();
            let after = a.refused_by_inflation(now_ms);
            if after != before {
                tracing::info!(
                    from = before,
                    to = after,
                    "model slots: the adaptive limit moved (its predicted slowdown refused jobs while slots were free)"
                );
            }
        }
    }

    /// Slots free now.
    pub fn available(&self) -> usize {
        let s = self.inner.lock();
        s.limit().saturating_sub(s.held)
    }

    /// The receipt number of a delivery received now: increasing in the order of the
    /// calls, it places the job in the FIFO order (and breaks EDF's ties).
    pub fn receipt(&self) -> u64 {
        (self.inner.receipts).fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Wait for a slot. The ticket places the job in the order (its receipt number from
    /// [`Slots::receipt`], deadline, tenant, priority) and says its expected call time,
    /// counted in [`Slots::ahead_of`] for the jobs behind it. Dropping the future gives up
    /// the place (and a slot granted meanwhile goes to the next waiter). The future owns
    /// what it needs (it does not borrow `self`).
    pub fn acquire(
        &self,
        ticket: Ticket,
    ) -> impl std::future::Future<Output = SlotPermit> + Send + 'static {
        let inner = self.inner.clone();
        async move { Self::acquire_in(inner, ticket).await }
    }

    async fn acquire_in(inner: Arc<Inner>, ticket: Ticket) -> SlotPermit {
        let rx = {
            let mut s = inner.lock();
            if s.held < s.limit() {
                s.held += 1;
                s.next_id += 1;
                let id = s.next_id;
                s.queue.granted(&ticket);
                drop(s);
                return SlotPermit {
                    inner: Some(inner),
                    id,
                    started: None,
                };
            }
            // Sweep the entries of waiters that gave up once the queue is larger than the
            // buffer can explain (amortised: at each doubling).
            let n = s.queue.len();
            if n >= 64 && n.is_power_of_two() {
                s.queue.retain(|_, tx| !tx.is_closed());
            }
            let (tx, rx) = oneshot::channel();
            s.queue.push(ticket, tx);
            rx
        };
        rx.await
            .expect("a waiter's sender lives in the queue until it is sent to")
    }

    /// The jobs that would get a slot before `candidate` if it were received now, and the
    /// sum of their expected call times.
    pub fn ahead_of(&self, candidate: &Ticket) -> (usize, u64) {
        let s = self.inner.lock();
        s.queue.ahead_of(candidate, |tx| !tx.is_closed())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use lastcall_core::Priority;
    use proptest::prelude::*;
    use std::time::Duration;

    fn tk(deadline_ms: i64, receipt: u64, work_ms: u64) -> Ticket {
        of(deadline_ms, receipt, work_ms, "default")
    }

    fn of(deadline_ms: i64, receipt: u64, work_ms: u64, tenant: &str) -> Ticket {
        Ticket {
            receipt,
            deadline_ms,
            work_ms,
            tenant: tenant.into(),
            priority: Priority::Standard,
        }
    }

    /// Let spawned tasks run until they block again.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    /// Hold every slot, receive `deadlines` in that order, queue them for a slot in the
    /// reverse order (a later delivery's task may reach the slots first), then release
    /// one slot at a time and return the order (indices into `deadlines`) in which the
    /// waiters got one.
    async fn grant_order(order: BufferOrder, deadlines: &[i64], gave_up: &[usize]) -> Vec<usize> {
        let slots = Arc::new(Slots::new(1, order, []));
        let first = slots.acquire(tk(0, slots.receipt(), 0)).await;
        let receipts: Vec<u64> = deadlines.iter().map(|_| slots.receipt()).collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks: Vec<Option<tokio::task::JoinHandle<()>>> =
            deadlines.iter().map(|_| None).collect();
        for (i, &d) in deadlines.iter().enumerate().rev() {
            let (slots, tx, receipt) = (slots.clone(), tx.clone(), receipts[i]);
            tasks[i] = Some(tokio::spawn(async move {
                let p = slots.acquire(tk(d, receipt, 10)).await;
                tx.send((i, p)).unwrap();
            }));
            settle().await; // queued in the reverse order
        }
        let tasks: Vec<_> = tasks.into_iter().map(Option::unwrap).collect();
        for &i in gave_up {
            tasks[i].abort();
        }
        settle().await;
        drop(first);
        let mut got = Vec::new();
        while got.len() < deadlines.len() - gave_up.len() {
            let (i, p) = tokio::time::timeout(Duration::from_secs(5), rx.recv())
                .await
                .expect("a waiter got the released slot")
                .unwrap();
            got.push(i);
            drop(p);
        }
        assert_eq!(slots.available(), 1, "every slot back when nobody waits");
        got
    }

    #[tokio::test]
    async fn edf_grants_the_earliest_deadline_first_and_fifo_the_first_received() {
        let d = [500, 100, 300, 100, 200];
        assert_eq!(
            grant_order(BufferOrder::Edf, &d, &[]).await,
            vec![1, 3, 4, 2, 0]
        );
        assert_eq!(
            grant_order(BufferOrder::Fifo, &d, &[]).await,
            vec![0, 1, 2, 3, 4]
        );
    }

    #[tokio::test]
    async fn a_waiter_that_gave_up_is_skipped_and_its_slot_not_lost() {
        let d = [100, 200, 300];
        assert_eq!(grant_order(BufferOrder::Edf, &d, &[0]).await, vec![1, 2]);
        assert_eq!(grant_order(BufferOrder::Fifo, &d, &[0, 2]).await, vec![1]);
    }

    #[tokio::test]
    async fn ahead_of_counts_the_waiters_served_first() {
        for order in [BufferOrder::Edf, BufferOrder::Fifo] {
            let slots = Arc::new(Slots::new(1, order, []));
            let held = slots.acquire(tk(0, slots.receipt(), 0)).await;
            let mut waiting = Vec::new();
            for (d, w) in [(100, 10), (300, 30)] {
                let (s, r) = (slots.clone(), slots.receipt());
                waiting.push(tokio::spawn(
                    async move { drop(s.acquire(tk(d, r, w)).await) },
                ));
                settle().await;
            }
            let expect = match order {
                BufferOrder::Edf => (1, 10),
                BufferOrder::Fifo => (2, 40),
            };
            assert_eq!(slots.ahead_of(&tk(200, u64::MAX, 0)), expect, "{order:?}");
            assert_eq!(
                slots.ahead_of(&tk(1_000, u64::MAX, 0)),
                (2, 40),
                "{order:?}"
            );
            drop(held);
            for t in waiting {
                t.await.unwrap();
            }
            assert_eq!(slots.ahead_of(&tk(1_000, u64::MAX, 0)), (0, 0));
        }
    }

    /// A light tenant's job waits behind none of a flooding tenant's: the next free slot
    /// is its own, though its deadline is the latest.
    #[tokio::test]
    async fn a_light_tenants_job_gets_the_next_slot_before_a_flood() {
        let slots = Arc::new(Slots::new(1, BufferOrder::Edf, []));
        let held = slots.acquire(of(0, slots.receipt(), 100, "flood")).await;
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for (d, tenant) in [
            (100, "flood"),
            (200, "flood"),
            (300, "flood"),
            (900, "light"),
        ] {
            let (s, r, tx) = (slots.clone(), slots.receipt(), tx.clone());
            tokio::spawn(async move {
                let p = s.acquire(of(d, r, 100, tenant)).await;
                tx.send((tenant, p)).unwrap();
            });
            settle().await;
        }
        assert_eq!(slots.ahead_of(&of(950, u64::MAX, 100, "light2")), (1, 100));
        drop(held);
        let (first, p) = rx.recv().await.unwrap();
        assert_eq!(first, "light");
        drop(p);
    }

    /// With adaptive slots, calls whose time does not grow with concurrency raise the
    /// limit, and a raise hands the new slots to waiters at once; a slowdown lowers it and
    /// the calls in flight finish (no slot is handed on until fewer than the limit run).
    #[tokio::test]
    async fn an_adaptive_limit_wakes_waiters_when_it_rises_and_drains_when_it_falls() {
        let cfg = LimitConfig {
            samples_per_step: 2,
            initial: 2,
            ..LimitConfig::new(8)
        };
        let slots = Arc::new(Slots::adaptive(cfg, BufferOrder::Edf, []));
        assert_eq!((slots.total(), slots.available()), (2, 2));
        let mut held = Vec::new();
        for _ in 0..2 {
            held.push(slots.acquire(tk(0, slots.receipt(), 0)).await);
        }
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        for i in 0..6 {
            let (s, r, tx) = (slots.clone(), slots.receipt(), tx.clone());
            tokio::spawn(async move {
                let p = s.acquire(tk(i, r, 100)).await;
                tx.send(p).unwrap();
            });
            settle().await;
        }
        // Calls of 100 ms, as expected, at the current limit: it climbs.
        let mut now = 0;
        for _ in 0..40 {
            let mut p = match held.pop() {
                Some(p) => p,
                None => rx.recv().await.unwrap(),
            };
            while let Ok(q) = rx.try_recv() {
                held.push(q);
            }
            let n = slots.total();
            p.started(100, now + 10_000, now);
            now += 100 / n as i64;
            // Every call starts at the full limit in this drive.
            p.started = Some((now - 100, n));
            p.ended(100, 100, now);
            drop(p);
            settle().await;
            if slots.total() > 2 {
                break;
            }
        }
        assert!(slots.total() > 2, "the limit rose: {}", slots.total());
        settle().await;
        let before = held.len();
        while let Ok(q) = rx.try_recv() {
            held.push(q);
        }
        assert!(held.len() > before, "a raise woke waiters");
        let limit = slots.total();
        assert!(held.len() <= limit, "{} ≤ {limit}", held.len());
        // Calls 10× slower than learned: the limit halves, the calls in flight go on, and
        // no slot is free while more than the limit are held.
        let mut p = held.pop().unwrap();
        for _ in 0..3 {
            p.started = Some((now, limit));
            p.ended(1_000, 100, now + 1_000);
        }
        let lowered = slots.total();
        assert!(lowered < limit, "{lowered} < {limit}");
        let holding = held.len() + 1;
        assert_eq!(slots.available(), lowered.saturating_sub(holding));
        drop(p);
        drop(held);
        settle().await;
        assert!(slots.available() <= lowered);
    }

    proptest! {
        /// Whatever the waiters and whoever gives up, the waiters that stay get slots in
        /// the order's sequence, never more than `total` at once, and no slot is lost.
        #[test]
        fn grants_follow_the_order_and_no_slot_is_lost(
            deadlines in proptest::collection::vec(0i64..50, 1..24),
            gave_up in proptest::collection::vec(any::<bool>(), 24),
            edf in any::<bool>(),
        ) {
            let order = if edf { BufferOrder::Edf } else { BufferOrder::Fifo };
            let gave_up: Vec<usize> = (0..deadlines.len()).filter(|&i| gave_up[i]).collect();
            let rt = tokio::runtime::Builder::new_current_thread().enable_all().build().unwrap();
            let got = rt.block_on(grant_order(order, &deadlines, &gave_up));
            let mut expect: Vec<usize> = (0..deadlines.len()).filter(|i| !gave_up.contains(i)).collect();
            if edf {
                expect.sort_by_key(|&i| (deadlines[i], i));
            }
            prop_assert_eq!(got, expect);
        }
    }
}
