//! Model slots, granted to the jobs waiting in the local buffer in the buffer's order.
//!
//! A worker runs at most `slots` model calls at once. Jobs received while every slot is
//! busy wait in the bounded local buffer (at most `prefetch` deliveries). When a call ends
//! its slot goes to the waiting job that comes first in the [`BufferOrder`]:
//! - [`BufferOrder::Fifo`]: the job received first;
//! - [`BufferOrder::Edf`]: the job whose deadline is earliest (ties: received first).
//!
//! "Received first" is the order of receipt ([`Slots::receipt`], taken as the consumer
//! registers each delivery, one after the other), not the order in which the jobs' tasks
//! reach [`Slots::acquire`]: those run in parallel and the first to arrive may be the later
//! delivery.
//!
//! `lastcall bench goodput --order` measures the two against each other (BENCHMARKS.md
//! §1); the default is the one that completed more jobs on time.
//!
//! A waiter that gives up (its job left the buffer: it can no longer finish, it was
//! cancelled, the connection was lost) simply drops its [`Slots::acquire`] future; a slot
//! granted to it in the same instant goes back to the next waiter. Memory is bounded by
//! the buffer: one entry per waiting delivery, and entries of waiters that gave up are
//! swept as the heap grows.

use std::cmp::Ordering as CmpOrdering;
use std::collections::BinaryHeap;
use std::sync::{Arc, Mutex};
use tokio::sync::oneshot;

/// The order in which waiting jobs get a free model slot.
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
    total: usize,
    order: BufferOrder,
    /// The next receipt number ([`Slots::receipt`]).
    receipts: std::sync::atomic::AtomicU64,
    state: Mutex<State>,
}

#[derive(Debug)]
struct State {
    free: usize,
    waiters: BinaryHeap<Waiter>,
}

/// One job waiting for a slot. Invariant: `free > 0` only while no waiter is in the heap
/// that has not given up (a release hands its slot to a waiter before counting it free).
#[derive(Debug)]
struct Waiter {
    /// `(deadline, receipt)` for EDF, `(0, receipt)` for FIFO: the smallest comes first.
    key: (i64, u64),
    /// The learned mean call time of the job (for the expected wait of later jobs).
    work_ms: u64,
    tx: oneshot::Sender<SlotPermit>,
}

impl PartialEq for Waiter {
    fn eq(&self, other: &Self) -> bool {
        self.key == other.key
    }
}
impl Eq for Waiter {}
impl PartialOrd for Waiter {
    fn partial_cmp(&self, other: &Self) -> Option<CmpOrdering> {
        Some(self.cmp(other))
    }
}
impl Ord for Waiter {
    /// Reversed: `BinaryHeap` pops the greatest, and the smallest key comes first.
    fn cmp(&self, other: &Self) -> CmpOrdering {
        other.key.cmp(&self.key)
    }
}

/// A held model slot; dropping it hands the slot to the next waiter.
#[derive(Debug)]
pub struct SlotPermit {
    inner: Option<Arc<Inner>>,
}

impl Drop for SlotPermit {
    fn drop(&mut self) {
        let Some(inner) = self.inner.take() else {
            return;
        };
        loop {
            let next = {
                let mut s = inner.lock();
                match s.waiters.pop() {
                    Some(w) => w,
                    None => {
                        s.free += 1;
                        return;
                    }
                }
            };
            let permit = SlotPermit {
                inner: Some(inner.clone()),
            };
            match next.tx.send(permit) {
                Ok(()) => return,
                // That waiter gave up: disarm the returned permit and try the next one.
                Err(mut p) => p.inner = None,
            }
        }
    }
}

impl Inner {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

impl Slots {
    pub fn new(total: usize, order: BufferOrder) -> Self {
        let total = total.max(1);
        Self {
            inner: Arc::new(Inner {
                total,
                order,
                receipts: std::sync::atomic::AtomicU64::new(0),
                state: Mutex::new(State {
                    free: total,
                    waiters: BinaryHeap::new(),
                }),
            }),
        }
    }

    pub fn total(&self) -> usize {
        self.inner.total
    }

    /// Slots free now.
    pub fn available(&self) -> usize {
        self.inner.lock().free
    }

    /// The receipt number of a delivery received now: increasing in the order of the
    /// calls, it places the job in the FIFO order (and breaks EDF's ties).
    pub fn receipt(&self) -> u64 {
        (self.inner.receipts).fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    /// Wait for a slot. `deadline_ms` orders the job under EDF, and `receipt` (from
    /// [`Slots::receipt`] at its receipt) under FIFO and among equal deadlines; `work_ms`
    /// is its expected call time, counted in [`Slots::ahead_of`] for jobs behind it.
    /// Dropping the future gives up the place (and a slot granted meanwhile goes to the
    /// next waiter). The future owns what it needs (it does not borrow `self`).
    pub fn acquire(
        &self,
        deadline_ms: i64,
        receipt: u64,
        work_ms: u64,
    ) -> impl std::future::Future<Output = SlotPermit> + Send + 'static {
        let inner = self.inner.clone();
        async move { Self::acquire_in(inner, deadline_ms, receipt, work_ms).await }
    }

    async fn acquire_in(
        inner: Arc<Inner>,
        deadline_ms: i64,
        receipt: u64,
        work_ms: u64,
    ) -> SlotPermit {
        let rx = {
            let mut s = inner.lock();
            if s.free > 0 {
                s.free -= 1;
                drop(s);
                return SlotPermit { inner: Some(inner) };
            }
            let key = match inner.order {
                BufferOrder::Edf => (deadline_ms, receipt),
                BufferOrder::Fifo => (0, receipt),
            };
            // Sweep the entries of waiters that gave up once the heap is larger than the
            // buffer can explain (amortised: at each doubling).
            let n = s.waiters.len();
            if n >= 64 && n.is_power_of_two() {
                s.waiters.retain(|w| !w.tx.is_closed());
            }
            let (tx, rx) = oneshot::channel();
            s.waiters.push(Waiter { key, work_ms, tx });
            rx
        };
        rx.await
            .expect("a waiter's sender lives in the heap until it is sent to")
    }

    /// The jobs that would get a slot before a job with `deadline_ms` received now, and
    /// the sum of their expected call times: under FIFO every waiter, under EDF those with
    /// a deadline not after it.
    pub fn ahead_of(&self, deadline_ms: i64) -> (usize, u64) {
        let s = self.inner.lock();
        s.waiters
            .iter()
            .filter(|w| !w.tx.is_closed())
            .filter(|w| self.inner.order == BufferOrder::Fifo || w.key.0 <= deadline_ms)
            .fold((0, 0), |(n, ms), w| (n + 1, ms + w.work_ms))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::time::Duration;

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
        let slots = Arc::new(Slots::new(1, order));
        let first = slots.acquire(0, slots.receipt(), 0).await;
        let receipts: Vec<u64> = deadlines.iter().map(|_| slots.receipt()).collect();
        let (tx, mut rx) = tokio::sync::mpsc::unbounded_channel();
        let mut tasks: Vec<Option<tokio::task::JoinHandle<()>>> =
            deadlines.iter().map(|_| None).collect();
        for (i, &d) in deadlines.iter().enumerate().rev() {
            let (slots, tx, receipt) = (slots.clone(), tx.clone(), receipts[i]);
            tasks[i] = Some(tokio::spawn(async move {
                let p = slots.acquire(d, receipt, 10).await;
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
            let slots = Arc::new(Slots::new(1, order));
            let held = slots.acquire(0, slots.receipt(), 0).await;
            let mut waiting = Vec::new();
            for (d, w) in [(100, 10), (300, 30)] {
                let (s, r) = (slots.clone(), slots.receipt());
                waiting.push(tokio::spawn(async move { drop(s.acquire(d, r, w).await) }));
                settle().await;
            }
            let expect = match order {
                BufferOrder::Edf => (1, 10),
                BufferOrder::Fifo => (2, 40),
            };
            assert_eq!(slots.ahead_of(200), expect, "{order:?}");
            assert_eq!(slots.ahead_of(1_000), (2, 40), "{order:?}");
            drop(held);
            for t in waiting {
                t.await.unwrap();
            }
            assert_eq!(slots.ahead_of(1_000), (0, 0));
        }
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
