//! Which waiting job gets the next model slot: the worker's wait queue, pure.
//!
//! A [`Schedule`] holds the jobs waiting for a slot in a worker's local buffer, each with a
//! [`Ticket`] (receipt number, deadline, expected call time, tenant, priority). A
//! [`Policy`] orders them; the schedule pops the first, and answers
//! [`Schedule::ahead_of`]: the jobs and the expected work that would be served before a job
//! received now, for the expected wait at receipt ([`crate::wait`]). The policy's
//! [`Policy::order`] is the whole service order if nothing else arrives, so `ahead_of` is
//! exact until the next arrival (property-tested).
//!
//! Policies:
//! - [`Edf`]: earliest deadline first (ties: received first).
//! - [`Fifo`]: received first.
//! - [`FairShare`] (the worker's default): strict priority tiers ([`Priority`]); within a
//!   tier, the model time is shared among the tenants that have waiting work in proportion
//!   to their weights (start-time fair queueing: each tenant's next job carries a virtual
//!   start tag, `max(the tenant's finish tag, the tier's virtual time)`, and a grant adds
//!   `call time ÷ weight` to the tenant's finish tag); within a tenant, EDF or FIFO. It is
//!   work-conserving (a tenant with nothing waiting leaves its share to the others) and
//!   with one tenant and one tier it is exactly [`Edf`] (or [`Fifo`]). A tenant that has
//!   been idle starts at the tier's virtual time: it cannot bank credit while idle.
//!
//! Nothing here decides *whether* a job may start: the admission rule
//! ([`crate::WorkerPolicy`]) still refuses any job that cannot finish in time, so a fair
//! order never starts doomed work; it only chooses among the jobs that can.

use crate::tenant::Priority;
use std::collections::HashMap;

/// What the schedule knows of one waiting job.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Ticket {
    /// The order of receipt at this worker (FIFO; EDF's tie-break).
    pub receipt: u64,
    /// The job's absolute deadline.
    pub deadline_ms: i64,
    /// The job's expected model time (the learned mean of its kind, or its own prediction).
    pub work_ms: u64,
    pub tenant: String,
    pub priority: Priority,
}

/// An order over waiting jobs (tower's `Service` is the model: one small trait, several
/// implementations, the reference ones in the bench).
pub trait Policy: Send + std::fmt::Debug {
    /// A short name for logs and tables.
    fn name(&self) -> &'static str;
    /// The order of service of `waiting` if nothing else arrives: a permutation of
    /// `0..waiting.len()`, first served first.
    fn order(&self, waiting: &[&Ticket]) -> Vec<usize>;
    /// `ticket`'s job got a slot (a policy with memory accounts for it here).
    fn granted(&mut self, ticket: &Ticket);
}

/// A policy chosen at run time (the worker's `--order`, the bench's references).
impl Policy for Box<dyn Policy> {
    fn name(&self) -> &'static str {
        (**self).name()
    }
    fn order(&self, waiting: &[&Ticket]) -> Vec<usize> {
        (**self).order(waiting)
    }
    fn granted(&mut self, t: &Ticket) {
        (**self).granted(t);
    }
}

/// Earliest deadline first; ties: the job received first.
#[derive(Debug, Clone, Copy, Default)]
pub struct Edf;

/// The job received first.
#[derive(Debug, Clone, Copy, Default)]
pub struct Fifo;

fn sorted_by<K: Ord>(waiting: &[&Ticket], key: impl Fn(&Ticket) -> K) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..waiting.len()).collect();
    idx.sort_by_key(|&i| key(waiting[i]));
    idx
}

impl Policy for Edf {
    fn name(&self) -> &'static str {
        "edf"
    }
    fn order(&self, waiting: &[&Ticket]) -> Vec<usize> {
        sorted_by(waiting, |t| (t.deadline_ms, t.receipt))
    }
    fn granted(&mut self, _: &Ticket) {}
}

impl Policy for Fifo {
    fn name(&self) -> &'static str {
        "fifo"
    }
    fn order(&self, waiting: &[&Ticket]) -> Vec<usize> {
        sorted_by(waiting, |t| t.receipt)
    }
    fn granted(&mut self, _: &Ticket) {}
}

/// The order within one tenant's jobs of one tier under [`FairShare`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Within {
    #[default]
    Edf,
    Fifo,
}

/// Virtual time units per ms of model time at weight 1 (integer arithmetic: weights up
/// to 1,000 divide it exactly enough).
const VT_PER_MS: u64 = 1_000_000;

/// Finish tags kept at most (tenants × tiers that were served ahead of the virtual time);
/// beyond it the oldest are forgotten (they restart at the virtual time, as an idle tenant
/// does).
pub const MAX_TRACKED: usize = 65_536;

/// Weighted fair share among tenants within strict priority tiers (see the module docs).
#[derive(Debug, Clone, Default)]
pub struct FairShare {
    within: Within,
    weights: HashMap<String, u32>,
    /// The virtual time of each tier: the start tag of its last grant.
    vtime: [u64; 3],
    /// Each (tier, tenant)'s finish tag, kept only while ahead of its tier's virtual time.
    finish: HashMap<(u8, String), u64>,
}

impl FairShare {
    pub fn new(within: Within) -> Self {
        Self {
            within,
            ..Self::default()
        }
    }

    /// Tenants' weights (absent: 1; 0 counts as 1).
    pub fn with_weights(mut self, weights: impl IntoIterator<Item = (String, u32)>) -> Self {
        self.weights = weights.into_iter().collect();
        self
    }

    pub fn weight(&self, tenant: &str) -> u64 {
        u64::from(self.weights.get(tenant).copied().unwrap_or(1).max(1))
    }

    /// The virtual cost of a job: its model time ÷ its tenant's weight (at least 1).
    fn cost(&self, t: &Ticket) -> u64 {
        (t.work_ms.max(1).saturating_mul(VT_PER_MS) / self.weight(&t.tenant)).max(1)
    }

    fn start_tag(&self, rank: u8, tenant: &str) -> u64 {
        let v = self.vtime[usize::from(rank)];
        self.finish
            .get(&(rank, tenant.to_owned()))
            .map_or(v, |&f| f.max(v))
    }

    /// Finish tags tracked now (bounded by [`MAX_TRACKED`]).
    pub fn tracked(&self) -> usize {
        self.finish.len()
    }
}

impl Policy for FairShare {
    fn name(&self) -> &'static str {
        match self.within {
            Within::Edf => "fair-edf",
            Within::Fifo => "fair-fifo",
        }
    }

    fn order(&self, waiting: &[&Ticket]) -> Vec<usize> {
        let within = |t: &Ticket| match self.within {
            Within::Edf => (t.deadline_ms, t.receipt),
            Within::Fifo => (0, t.receipt),
        };
        // Each (tier, tenant)'s jobs in their own order, each tagged with the virtual
        // start it will have when it is that tenant's next job.
        let mut groups: HashMap<(u8, &str), Vec<usize>> = HashMap::new();
        for (i, t) in waiting.iter().enumerate() {
            groups
                .entry((t.priority.rank(), t.tenant.as_str()))
                .or_default()
                .push(i);
        }
        // (tier rank, virtual start, order within the tenant) → index.
        type Key = (u8, u64, (i64, u64));
        let mut keyed: Vec<(Key, usize)> = Vec::with_capacity(waiting.len());
        for ((rank, tenant), mut members) in groups {
            members.sort_by_key(|&i| within(waiting[i]));
            let mut tag = self.start_tag(rank, tenant);
            for i in members {
                keyed.push(((rank, tag, within(waiting[i])), i));
                tag = tag.saturating_add(self.cost(waiting[i]));
            }
        }
        keyed.sort_unstable_by_key(|&(k, _)| k);
        keyed.into_iter().map(|(_, i)| i).collect()
    }

    fn granted(&mut self, t: &Ticket) {
        let rank = t.priority.rank();
        let start = self.start_tag(rank, &t.tenant);
        self.vtime[usize::from(rank)] = start;
        let finish = start.saturating_add(self.cost(t));
        self.finish.insert((rank, t.tenant.clone()), finish);
        if self.finish.len() > 1_024 {
            // A tag at or behind its tier's virtual time means the same as no tag.
            let v = self.vtime;
            self.finish.retain(|(r, _), f| *f > v[usize::from(*r)]);
            if self.finish.len() > MAX_TRACKED {
                let mut tags: Vec<u64> = self.finish.values().copied().collect();
                tags.sort_unstable();
                let cut = tags[tags.len() - MAX_TRACKED / 2];
                self.finish.retain(|_, f| *f >= cut);
            }
        }
    }
}

/// The jobs waiting for a slot, with what the caller keeps for each (`T`: a waiter's
/// channel in the worker, a job index in the simulator).
#[derive(Debug)]
pub struct Schedule<T, P: Policy = FairShare> {
    waiting: Vec<(Ticket, T)>,
    policy: P,
}

impl<T, P: Policy> Schedule<T, P> {
    pub fn new(policy: P) -> Self {
        Self {
            waiting: Vec::new(),
            policy,
        }
    }

    pub fn policy(&self) -> &P {
        &self.policy
    }

    pub fn len(&self) -> usize {
        self.waiting.len()
    }

    pub fn is_empty(&self) -> bool {
        self.waiting.is_empty()
    }

    pub fn push(&mut self, ticket: Ticket, item: T) {
        self.waiting.push((ticket, item));
    }

    /// The job served next, taken out of the queue. Call [`Schedule::granted`] when it
    /// really got the slot (a waiter may have gone meanwhile).
    pub fn pop(&mut self) -> Option<(Ticket, T)> {
        let first = {
            let refs: Vec<&Ticket> = self.waiting.iter().map(|(t, _)| t).collect();
            *self.policy.order(&refs).first()?
        };
        Some(self.waiting.swap_remove(first))
    }

    /// `ticket`'s job got its slot.
    pub fn granted(&mut self, ticket: &Ticket) {
        self.policy.granted(ticket);
    }

    /// Keep only the entries `keep` accepts (waiters that gave up leave).
    pub fn retain(&mut self, mut keep: impl FnMut(&Ticket, &T) -> bool) {
        self.waiting.retain(|(t, x)| keep(t, x));
    }

    /// The waiting entries, in no particular order.
    pub fn iter(&self) -> impl Iterator<Item = (&Ticket, &T)> {
        self.waiting.iter().map(|(t, x)| (t, x))
    }

    /// Take every entry out (a crash hands them back), in no particular order.
    pub fn drain(&mut self) -> Vec<(Ticket, T)> {
        std::mem::take(&mut self.waiting)
    }

    /// Take out the entry with receipt number `receipt`.
    pub fn remove(&mut self, receipt: u64) -> Option<(Ticket, T)> {
        let i = self
            .waiting
            .iter()
            .position(|(t, _)| t.receipt == receipt)?;
        Some(self.waiting.swap_remove(i))
    }

    /// The waiting jobs that would be served before `candidate` if it were pushed now
    /// (and `live` accepts them), and the sum of their expected model times.
    pub fn ahead_of(&self, candidate: &Ticket, live: impl Fn(&T) -> bool) -> (usize, u64) {
        let mut refs: Vec<&Ticket> = self
            .waiting
            .iter()
            .filter(|(_, x)| live(x))
            .map(|(t, _)| t)
            .collect();
        refs.push(candidate);
        let me = refs.len() - 1;
        let order = self.policy.order(&refs);
        order
            .iter()
            .take_while(|&&i| i != me)
            .fold((0, 0), |(n, ms), &i| (n + 1, ms + refs[i].work_ms))
    }

    /// The tickets in their order of service (for tests and tables).
    pub fn in_order(&self) -> Vec<&Ticket> {
        let refs: Vec<&Ticket> = self.waiting.iter().map(|(t, _)| t).collect();
        self.policy
            .order(&refs)
            .into_iter()
            .map(|i| refs[i])
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn t(receipt: u64, deadline_ms: i64, work_ms: u64, tenant: &str, p: Priority) -> Ticket {
        Ticket {
            receipt,
            deadline_ms,
            work_ms,
            tenant: tenant.into(),
            priority: p,
        }
    }

    /// Pop everything, granting each, and return the receipts in order.
    fn drain<P: Policy>(s: &mut Schedule<(), P>) -> Vec<u64> {
        let mut out = Vec::new();
        while let Some((tk, ())) = s.pop() {
            s.granted(&tk);
            out.push(tk.receipt);
        }
        out
    }

    #[test]
    fn a_light_tenant_goes_before_a_flood() {
        let mut s = Schedule::new(FairShare::default());
        for r in 0..20 {
            s.push(t(r, 1_000 + r as i64, 100, "flood", Priority::Standard), ());
        }
        // Serve five of the flood's jobs; then a light tenant's job arrives, later deadline.
        for _ in 0..5 {
            let (tk, ()) = s.pop().unwrap();
            s.granted(&tk);
        }
        let light = t(99, 5_000, 100, "light", Priority::Standard);
        assert_eq!(s.ahead_of(&light, |_| true), (0, 0));
        s.push(light, ());
        assert_eq!(s.pop().unwrap().0.tenant, "light");
    }

    #[test]
    fn weights_split_the_model_time() {
        let mut s = Schedule::new(FairShare::default().with_weights([("a".into(), 3)]));
        for r in 0..400 {
            let tenant = if r % 2 == 0 { "a" } else { "b" };
            s.push(t(r, 10_000, 50, tenant, Priority::Standard), ());
        }
        let first: Vec<u64> = drain(&mut s).into_iter().take(200).collect();
        let a = first.iter().filter(|r| *r % 2 == 0).count();
        assert!((148..=152).contains(&a), "a got {a} of 200");
    }

    #[test]
    fn a_higher_tier_always_goes_first() {
        let mut s = Schedule::new(FairShare::default());
        s.push(t(0, 100, 10, "x", Priority::Batch), ());
        s.push(t(1, 900, 10, "y", Priority::Standard), ());
        s.push(t(2, 5_000, 10, "z", Priority::Critical), ());
        assert_eq!(drain(&mut s), vec![2, 1, 0]);
    }

    fn arb_ticket() -> impl Strategy<Value = Ticket> {
        (0i64..50, 1u64..500, 0usize..4, 0usize..3).prop_map(|(d, w, tenant, p)| Ticket {
            receipt: 0,
            deadline_ms: d,
            work_ms: w,
            tenant: ["a", "b", "c", "d"][tenant].into(),
            priority: Priority::ALL[p],
        })
    }

    proptest! {
        /// With one tenant and one tier, fair share is exactly EDF (and FIFO within FIFO),
        /// whatever was granted before.
        #[test]
        fn one_tenant_is_edf(jobs in proptest::collection::vec((0i64..50, 1u64..500), 1..40), served in 0usize..10) {
            for (within, reference) in [(Within::Edf, true), (Within::Fifo, false)] {
                let mut fair = Schedule::new(FairShare::new(within));
                let mut plain: Schedule<(), Box<dyn Policy>> =
                    Schedule::new(if reference { Box::new(Edf) } else { Box::new(Fifo) });
                for (r, &(d, w)) in jobs.iter().enumerate() {
                    fair.push(t(r as u64, d, w, "default", Priority::Standard), ());
                    plain.push(t(r as u64, d, w, "default", Priority::Standard), ());
                }
                for _ in 0..served.min(jobs.len()) {
                    let (a, ()) = fair.pop().unwrap();
                    fair.granted(&a);
                    let (b, ()) = plain.pop().unwrap();
                    prop_assert_eq!(a.receipt, b.receipt);
                }
                prop_assert_eq!(drain(&mut fair), drain(&mut plain));
            }
        }

        /// The order is the pop sequence: popping (and granting) without new arrivals
        /// serves the jobs exactly in `in_order`'s order, so `ahead_of` is exact.
        #[test]
        fn the_order_is_the_sequence_of_service(
            before in proptest::collection::vec(arb_ticket(), 0..30),
            jobs in proptest::collection::vec(arb_ticket(), 1..40),
        ) {
            let mut s = Schedule::new(FairShare::default().with_weights([("a".into(), 2), ("c".into(), 5)]));
            // Some history first.
            for (r, mut tk) in before.into_iter().enumerate() {
                tk.receipt = r as u64;
                s.push(tk, ());
            }
            drain(&mut s);
            for (r, mut tk) in jobs.into_iter().enumerate() {
                tk.receipt = 1_000 + r as u64;
                let (ahead, _) = s.ahead_of(&tk, |_| true);
                s.push(tk.clone(), ());
                let order: Vec<u64> = s.in_order().iter().map(|t| t.receipt).collect();
                prop_assert_eq!(order.iter().position(|&x| x == tk.receipt), Some(ahead));
            }
            let predicted: Vec<u64> = s.in_order().iter().map(|t| t.receipt).collect();
            prop_assert_eq!(drain(&mut s), predicted);
        }

        /// No lower-tier job is served while a higher-tier one waits.
        #[test]
        fn tiers_are_strict(jobs in proptest::collection::vec(arb_ticket(), 1..40)) {
            let mut s = Schedule::new(FairShare::default());
            for (r, mut tk) in jobs.into_iter().enumerate() {
                tk.receipt = r as u64;
                s.push(tk, ());
            }
            let mut last = 0u8;
            while let Some((tk, ())) = s.pop() {
                prop_assert!(tk.priority.rank() >= last);
                last = tk.priority.rank();
                s.granted(&tk);
            }
        }

        /// Backlogged tenants share model time by weight: after many grants, each tenant's
        /// served time ÷ weight differs from any other's by at most one job's cost.
        #[test]
        fn backlogged_tenants_share_by_weight(
            works in proptest::collection::vec(1u64..300, 4),
            weights in proptest::collection::vec(1u32..5, 4),
        ) {
            let names = ["a", "b", "c", "d"];
            let mut s = Schedule::new(FairShare::default().with_weights(
                names.iter().zip(&weights).map(|(n, w)| ((*n).to_owned(), *w)),
            ));
            let mut r = 0u64;
            for (i, n) in names.iter().enumerate() {
                for _ in 0..80 {
                    s.push(t(r, 0, works[i], n, Priority::Standard), ());
                    r += 1;
                }
            }
            let mut served = [0u64; 4];
            for _ in 0..60 {
                let (tk, ()) = s.pop().unwrap();
                s.granted(&tk);
                let i = names.iter().position(|n| *n == tk.tenant).unwrap();
                served[i] += tk.work_ms;
            }
            let norm: Vec<f64> = (0..4).map(|i| served[i] as f64 / f64::from(weights[i])).collect();
            let slack = (0..4).map(|i| works[i] as f64 / f64::from(weights[i])).fold(0.0, f64::max);
            for i in 0..4 {
                for j in 0..4 {
                    prop_assert!((norm[i] - norm[j]).abs() <= slack + 1e-6, "{norm:?} {works:?} {weights:?}");
                }
            }
        }
    }
}
