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
//!   to their weights: each tenant has an account of the model time it was served ÷ its
//!   weight, in which a grant's weight halves every [`HALF_LIFE_GRANTS`] grants (recent
//!   service counts, old service fades), and the tenant whose account is lowest goes
//!   next; a tenant's later jobs are keyed by its account plus the jobs ahead of them.
//!   Within a tenant, EDF or FIFO. It is work-conserving (a tenant with nothing waiting
//!   leaves its share to the others) and with one tenant and one tier it is exactly
//!   [`Edf`] (or [`Fifo`]). **Banking is bounded:** an account never starts more than
//!   [`MAX_LAG_MS`] of model time behind the tier's virtual time (the largest account a
//!   grant started from), so a tenant back from idling goes first for at most that much
//!   model time, then shares.
//!
//!   Why not start-time fair queueing (what this was first): with more tenants than the
//!   buffer holds, SFQ serves in rounds — every tenant once before anyone twice — and a
//!   tenant whose jobs are refused at their deadline is never served, so it stays in the
//!   current round and the round never ends. A light tenant served once waited behind
//!   hundreds of such tenants for the next round: 1,000 Zipf tenants got Jain's index 0.82
//!   in the simulator. With decayed accounts, who was served *lately* decides: 0.96.
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
    /// The job [`Policy::order`] serves first, without ordering the rest (`pop` asks this
    /// once per grant; the policies here answer in one pass).
    fn first(&self, waiting: &[&Ticket]) -> Option<usize> {
        self.order(waiting).first().copied()
    }
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
    fn first(&self, waiting: &[&Ticket]) -> Option<usize> {
        (**self).first(waiting)
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
    fn first(&self, waiting: &[&Ticket]) -> Option<usize> {
        (0..waiting.len()).min_by_key(|&i| (waiting[i].deadline_ms, waiting[i].receipt))
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
    fn first(&self, waiting: &[&Ticket]) -> Option<usize> {
        (0..waiting.len()).min_by_key(|&i| waiting[i].receipt)
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

/// How many grants it takes for a served job's weight in its tenant's account to halve
/// ([`FairShare`]'s default memory: the worker's last ~1,000 calls weigh most).
pub const HALF_LIFE_GRANTS: u32 = 1_000;

/// How far behind the last grant an idle tenant's account may be when it comes back, in
/// ms of model time at weight 1 ([`FairShare`]'s default): the credit a tenant can bank.
pub const MAX_LAG_MS: u64 = 2_000;

/// Accounts tracked at most (tenants × tiers); beyond it the smallest are forgotten (they
/// count as at the lag limit, as an idle tenant does).
pub const MAX_TRACKED: usize = 65_536;

/// The account scale is renormalised by this power of two when it passes it (f64 stays
/// exact: only exponents change).
const RENORM_EXP: i32 = 256;

/// Weighted fair share among tenants within strict priority tiers (see the module docs).
#[derive(Debug, Clone)]
pub struct FairShare {
    within: Within,
    weights: HashMap<String, u32>,
    /// Each (tier, tenant)'s account: the model time it was served ÷ its weight, each
    /// grant counted at the scale of its time (so older grants weigh less).
    served: HashMap<(u8, String), f64>,
    /// The scale a grant is counted at now: it grows by 2^(1/half-life) per grant.
    scale: f64,
    /// `2^(1/half-life)`, or 1 without decay.
    growth: f64,
    /// Each tier's virtual time: the account its last grant started from.
    vtime: [f64; 3],
    lag_ms: f64,
}

impl Default for FairShare {
    fn default() -> Self {
        Self::new(Within::Edf)
    }
}

impl FairShare {
    pub fn new(within: Within) -> Self {
        Self {
            within,
            weights: HashMap::new(),
            served: HashMap::new(),
            scale: 1.0,
            growth: (1.0 / f64::from(HALF_LIFE_GRANTS)).exp2(),
            vtime: [0.0; 3],
            lag_ms: MAX_LAG_MS as f64,
        }
    }

    /// Tenants' weights (absent: 1; 0 counts as 1).
    pub fn with_weights(mut self, weights: impl IntoIterator<Item = (String, u32)>) -> Self {
        self.weights = weights.into_iter().collect();
        self
    }

    /// The memory of past service: its half-life in grants (`None`: never forgotten, the
    /// classic start-time fair queueing when the lag is 0).
    pub fn with_half_life(mut self, grants: Option<u32>) -> Self {
        self.growth = grants.map_or(1.0, |g| (1.0 / f64::from(g.max(1))).exp2());
        self
    }

    /// The credit an idle tenant may bank, in ms of model time at weight 1.
    pub fn with_max_lag_ms(mut self, lag_ms: u64) -> Self {
        self.lag_ms = lag_ms as f64;
        self
    }

    pub fn weight(&self, tenant: &str) -> u64 {
        u64::from(self.weights.get(tenant).copied().unwrap_or(1).max(1))
    }

    /// A job's cost at today's scale: its model time ÷ its tenant's weight (≥ 1 ms).
    fn cost(&self, t: &Ticket) -> f64 {
        t.work_ms.max(1) as f64 / self.weight(&t.tenant) as f64 * self.scale
    }

    /// Where a tenant's next job starts: its account, but never more than the lag behind
    /// its tier's virtual time.
    fn start(&self, rank: u8, tenant: &str) -> f64 {
        let floor = (self.vtime[usize::from(rank)] - self.lag_ms * self.scale).max(0.0);
        (self.served.get(&(rank, tenant.to_owned())).copied()).map_or(floor, |a| a.max(floor))
    }

    /// Accounts tracked now (bounded by [`MAX_TRACKED`]).
    pub fn tracked(&self) -> usize {
        self.served.len()
    }

    /// Keep the scale and the accounts within f64's range, and the map bounded.
    fn tidy(&mut self) {
        if self.scale > f64::from(RENORM_EXP).exp2() {
            let down = f64::from(-RENORM_EXP).exp2();
            self.scale *= down;
            self.served.values_mut().for_each(|a| *a *= down);
            self.vtime.iter_mut().for_each(|v| *v *= down);
        }
        if self.served.len() > 1_024 {
            // An account at or behind its floor means the same as none.
            let floors = self.vtime.map(|v| (v - self.lag_ms * self.scale).max(0.0));
            self.served.retain(|(r, _), a| *a > floors[usize::from(*r)]);
            if self.served.len() > MAX_TRACKED {
                let mut all: Vec<f64> = self.served.values().copied().collect();
                all.sort_unstable_by(f64::total_cmp);
                let cut = all[all.len() - MAX_TRACKED / 2];
                self.served.retain(|_, a| *a >= cut);
            }
        }
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
        // Each (tier, tenant)'s jobs in their own order, each keyed by the account its
        // tenant will start it from.
        let mut groups: HashMap<(u8, &str), Vec<usize>> = HashMap::new();
        for (i, t) in waiting.iter().enumerate() {
            groups
                .entry((t.priority.rank(), t.tenant.as_str()))
                .or_default()
                .push(i);
        }
        // (tier rank, account at start, order within the tenant) → index.
        type Key = (u8, f64, (i64, u64));
        let mut keyed: Vec<(Key, usize)> = Vec::with_capacity(waiting.len());
        for ((rank, tenant), mut members) in groups {
            members.sort_by_key(|&i| within(waiting[i]));
            let mut at = self.start(rank, tenant);
            for i in members {
                keyed.push(((rank, at, within(waiting[i])), i));
                at += self.cost(waiting[i]);
            }
        }
        keyed.sort_unstable_by(|(a, _), (b, _)| {
            (a.0.cmp(&b.0))
                .then(a.1.total_cmp(&b.1))
                .then(a.2.cmp(&b.2))
        });
        keyed.into_iter().map(|(_, i)| i).collect()
    }

    fn first(&self, waiting: &[&Ticket]) -> Option<usize> {
        let within = |t: &Ticket| match self.within {
            Within::Edf => (t.deadline_ms, t.receipt),
            Within::Fifo => (0, t.receipt),
        };
        // Each (tier, tenant)'s first job in its own order starts at the tenant's account;
        // the first of those is the first served.
        let mut heads: HashMap<(u8, &str), usize> = HashMap::new();
        for (i, t) in waiting.iter().enumerate() {
            heads
                .entry((t.priority.rank(), t.tenant.as_str()))
                .and_modify(|h| {
                    if within(t) < within(waiting[*h]) {
                        *h = i;
                    }
                })
                .or_insert(i);
        }
        (heads.into_iter())
            .map(|((rank, tenant), i)| ((rank, self.start(rank, tenant), within(waiting[i])), i))
            .min_by(|(a, _), (b, _)| {
                (a.0.cmp(&b.0))
                    .then(a.1.total_cmp(&b.1))
                    .then(a.2.cmp(&b.2))
            })
            .map(|(_, i)| i)
    }

    fn granted(&mut self, t: &Ticket) {
        let rank = t.priority.rank();
        let start = self.start(rank, &t.tenant);
        let v = &mut self.vtime[usize::from(rank)];
        *v = v.max(start);
        let account = start + self.cost(t);
        self.served.insert((rank, t.tenant.clone()), account);
        self.scale *= self.growth;
        self.tidy();
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
            self.policy.first(&refs)?
        };
        Some(self.waiting.swap_remove(first))
    }

    /// Pop the job served next and grant it at once (tests, and callers whose pop is the
    /// grant).
    pub fn pop_granted(&mut self) -> Option<Ticket> {
        let (t, _) = self.pop()?;
        self.granted(&t);
        Some(t)
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

/// A job in a FIFO broker queue, as the door models it for [`walk_fifo`]: `None` for a
/// message the door knows nothing about (another producer's), which counts as able to
/// finish; else the last instant it can start ([`QueuedJob::latest_start_ms`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueuedJob {
    /// Its deadline minus the clock margin and its call time: a worker that reaches it
    /// later refuses it without a call.
    pub latest_start_ms: i64,
}

/// What [`walk_fifo`] makes of a queue: the jobs a worker will reach in time (`served`),
/// the others (`doomed`, refused without a call when reached), and the workers' time the
/// served ones take before the next arrival is reached (`wait_ms`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Walk {
    pub served: u64,
    pub doomed: u64,
    pub wait_ms: f64,
}

/// Walk a FIFO queue from its head as the workers will: each job that can still start
/// when it is reached takes `per_job_ms` of the workers' time; one that cannot is refused
/// at once and costs no wait. `per_job_ms` 0 (no measured pace): every job that can start
/// at `now_ms` counts. The door's shedding (`lastcall-producer`'s `shed.rs`) sheds a new
/// job by this walk; the same rule as the worker's: a job is started only at or before its
/// latest start.
pub fn walk_fifo(
    queue: impl IntoIterator<Item = Option<QueuedJob>>,
    per_job_ms: f64,
    now_ms: i64,
) -> Walk {
    let mut walk = Walk {
        served: 0,
        doomed: 0,
        wait_ms: 0.0,
    };
    for job in queue {
        let reachable = job.is_none_or(|j| (j.latest_start_ms - now_ms) as f64 >= walk.wait_ms);
        if reachable {
            walk.served += 1;
            walk.wait_ms += per_job_ms;
        } else {
            walk.doomed += 1;
        }
    }
    walk
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn the_walk_serves_what_it_reaches_in_time_and_skips_the_rest() {
        let at = |ms| {
            Some(QueuedJob {
                latest_start_ms: ms,
            })
        };
        // 100 ms per job: starts at 0, 100, 200, …; a job due to start by 150 is reached
        // at 200 when the two before it are served.
        let w = walk_fifo([at(1_000), None, at(150), at(200)], 100.0, 0);
        assert_eq!((w.served, w.doomed), (3, 1));
        assert_eq!(w.wait_ms, 300.0);
        // No pace: every job that can start now.
        let w = walk_fifo([at(-1), at(0), None], 0.0, 0);
        assert_eq!((w.served, w.doomed), (2, 1));
    }

    proptest! {
        #[test]
        fn the_walk_accounts_for_every_job_and_a_slower_pace_serves_no_more(
            starts in proptest::collection::vec(proptest::option::of(-500i64..5_000), 0..60),
            pace in 0.0f64..400.0,
            slower in 0.0f64..400.0,
        ) {
            let queue: Vec<_> = starts.iter().map(|s| s.map(|ms| QueuedJob { latest_start_ms: ms })).collect();
            let w = walk_fifo(queue.iter().copied(), pace, 0);
            prop_assert_eq!(w.served + w.doomed, queue.len() as u64);
            prop_assert!((w.wait_ms - w.served as f64 * pace).abs() < 1e-6);
            let s = walk_fifo(queue.iter().copied(), pace + slower, 0);
            prop_assert!(s.served <= w.served);
            // Unknown messages are always served; a job is served only if reached in time.
            let unknown = queue.iter().filter(|q| q.is_none()).count() as u64;
            prop_assert!(w.served >= unknown);
        }
    }

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

    /// A tenant back from idling banks at most [`MAX_LAG_MS`] of credit: after a flood
    /// served alone, a newcomer's jobs go first for about that much model time, then the
    /// two alternate (without the bound, the decayed account of the flood's whole history
    /// would be the newcomer's credit).
    #[test]
    fn an_idle_tenant_banks_at_most_the_lag() {
        let mut s = Schedule::new(FairShare::default());
        for r in 0..500 {
            s.push(
                t(r, 10_000 + r as i64, 100, "flood", Priority::Standard),
                (),
            );
            let (tk, ()) = s.pop().unwrap();
            s.granted(&tk);
        }
        for r in 0..100 {
            s.push(t(1_000 + r, 50_000, 100, "flood", Priority::Standard), ());
            s.push(t(2_000 + r, 50_000, 100, "back", Priority::Standard), ());
        }
        let mut run = 0;
        while s.pop_granted().unwrap().tenant == "back" {
            run += 1;
        }
        let most = (MAX_LAG_MS / 100) as usize + 1;
        assert!(
            (most - 2..=most).contains(&run),
            "{run} jobs of `back` first"
        );
        // Then they alternate.
        let next: Vec<String> = (0..10).map(|_| s.pop_granted().unwrap().tenant).collect();
        let back = next.iter().filter(|n| *n == "back").count();
        assert!((4..=6).contains(&back), "{next:?}");
    }

    /// Fairness among many tenants: recent service counts, not rounds. A tenant served
    /// once lately yields to one served less lately, even when the rest keep arriving
    /// (start-time fair queueing made every tenant wait for a round of all of them).
    #[test]
    fn the_tenant_served_least_lately_goes_first() {
        let mut s = Schedule::new(FairShare::default());
        let mut r = 0;
        // 50 tenants served once each, in turn; then `h0` twice more.
        for k in 0..50 {
            s.push(t(r, 0, 100, &format!("h{k}"), Priority::Standard), ());
            r += 1;
            s.pop_granted().unwrap();
        }
        for _ in 0..2 {
            s.push(t(r, 0, 100, "h0", Priority::Standard), ());
            r += 1;
            s.pop_granted().unwrap();
        }
        // `light` was served once, before them all; `h0` most lately.
        s.push(t(r, 0, 100, "h0", Priority::Standard), ());
        s.push(t(r + 1, 9, 100, "h25", Priority::Standard), ());
        s.push(t(r + 2, 5, 100, "h49", Priority::Standard), ());
        let order: Vec<String> = (0..3).map(|_| s.pop_granted().unwrap().tenant).collect();
        assert_eq!(order, ["h25", "h49", "h0"]);
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
            // Exact without decay (with it, a tenant's third and later jobs may move back by
            // the decay of the grants between).
            let mut s = Schedule::new(
                FairShare::default()
                    .with_half_life(None)
                    .with_weights([("a".into(), 2), ("c".into(), 5)]),
            );
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

        /// `first` is `order`'s first, for every policy, after any history.
        #[test]
        fn first_is_the_orders_first(
            before in proptest::collection::vec(arb_ticket(), 0..30),
            jobs in proptest::collection::vec(arb_ticket(), 1..40),
        ) {
            let mut fair = FairShare::default().with_weights([("b".into(), 3)]);
            for tk in &before {
                fair.granted(tk);
            }
            let jobs: Vec<Ticket> = (jobs.into_iter().enumerate())
                .map(|(r, mut t)| {
                    t.receipt = r as u64;
                    t
                })
                .collect();
            let refs: Vec<&Ticket> = jobs.iter().collect();
            let policies: [Box<dyn Policy>; 4] = [
                Box::new(fair),
                Box::new(FairShare::new(Within::Fifo)),
                Box::new(Edf),
                Box::new(Fifo),
            ];
            for p in &policies {
                prop_assert_eq!(p.first(&refs), p.order(&refs).first().copied(), "{}", p.name());
            }
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
            decay in proptest::bool::ANY,
        ) {
            let names = ["a", "b", "c", "d"];
            // With decay, 60 grants shift the weights of past service by ≤ 4%: the slack
            // grows by as much.
            let half_life = decay.then_some(HALF_LIFE_GRANTS);
            let mut s = Schedule::new(FairShare::default().with_half_life(half_life).with_weights(
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
            let slack = if decay { slack + 0.05 * norm.iter().fold(0.0, |a: f64, b| a.max(*b)) } else { slack };
            for i in 0..4 {
                for j in 0..4 {
                    prop_assert!((norm[i] - norm[j]).abs() <= slack + 1e-6, "{norm:?} {works:?} {weights:?}");
                }
            }
        }
    }
}
