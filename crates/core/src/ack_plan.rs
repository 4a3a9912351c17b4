//! Which acks are safe to send now, over plain delivery tags.
//!
//! Deliveries finish out of order (delivery 7 before delivery 5), and a `basic.ack` with
//! `multiple` for tag T settles *every* unsettled delivery up to T on its channel. So the
//! worker keeps the tags it holds, per channel *generation* (each broker connection is
//! one; tags start again at 1 on a new channel), in tag order:
//! - [`AckPlan::register`] as a delivery arrives (the receive loop, in tag order);
//! - [`AckPlan::done`] once its outcome is durable and it only awaits its ack;
//! - [`AckPlan::release`] once it was settled another way (its reject or requeue frame
//!   was sent): until then it stays held and blocks every `multiple` ack above it, so a
//!   `multiple` ack can never overtake a reject.
//!
//! [`AckPlan::take`] returns the longest finished prefix (one `multiple` ack on its last
//! tag) and the finished tags above the first unfinished one (single acks), so an ack is
//! never delayed behind a long call and never covers a delivery that is not durable.
//! A tag of another generation is refused: an ack never crosses a channel generation.

use std::collections::BTreeMap;

/// A delivery tag of one channel generation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Tag {
    pub generation: u64,
    pub tag: u64,
}

/// What to send now, all on the plan's generation.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Acks {
    pub generation: u64,
    /// The finished prefix: one ack on `last` (with `multiple` when `count > 1`) settles
    /// `count` deliveries.
    pub prefix: Option<Prefix>,
    /// Finished deliveries above the first unfinished one, acked one by one.
    pub single: Vec<u64>,
}

impl Acks {
    pub fn is_empty(&self) -> bool {
        self.prefix.is_none() && self.single.is_empty()
    }

    /// Every delivery these acks settle.
    pub fn count(&self) -> usize {
        self.prefix.map_or(0, |p| p.count) + self.single.len()
    }
}

/// A run of finished deliveries with no unfinished one below it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Prefix {
    pub last: u64,
    pub count: usize,
}

/// Why a tag was not taken.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum Refused {
    /// The tag belongs to an older (or other) channel generation: its channel is gone.
    #[error("delivery tag of another channel generation")]
    OtherGeneration,
    /// Tags must be registered in increasing order, each once.
    #[error("delivery tag registered out of order")]
    OutOfOrder,
    /// The tag is not held (never registered, already acked or released).
    #[error("delivery tag not held")]
    NotHeld,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// Held by the worker: not finished, or its own reject/requeue not yet sent.
    Held,
    /// Outcome durable: waiting for its ack.
    Done,
}

/// The tag bookkeeping of one channel generation at a time.
#[derive(Debug, Clone, Default)]
pub struct AckPlan {
    generation: u64,
    last_registered: u64,
    marks: BTreeMap<u64, Mark>,
}

impl AckPlan {
    /// The plan of channel generation `generation`.
    pub fn new(generation: u64) -> Self {
        Self {
            generation,
            ..Self::default()
        }
    }

    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// Tags held (unfinished, or done and not yet taken).
    pub fn held(&self) -> usize {
        self.marks.len()
    }

    /// The channel is gone; a new one starts: every tag of the old one is forgotten
    /// unacked (the broker redelivers those deliveries). Returns the new generation.
    pub fn next_generation(&mut self) -> u64 {
        self.generation += 1;
        self.last_registered = 0;
        self.marks.clear();
        self.generation
    }

    /// A delivery arrived on the current generation.
    pub fn register(&mut self, tag: u64) -> Result<Tag, Refused> {
        if tag <= self.last_registered {
            return Err(Refused::OutOfOrder);
        }
        self.last_registered = tag;
        self.marks.insert(tag, Mark::Held);
        Ok(Tag {
            generation: self.generation,
            tag,
        })
    }

    /// Its outcome is durable: ack it (soon, possibly with others).
    pub fn done(&mut self, tag: Tag) -> Result<(), Refused> {
        *self.held_mark(tag)? = Mark::Done;
        Ok(())
    }

    /// It was settled another way (its reject or requeue frame is sent): it no longer
    /// blocks the finished run above it.
    pub fn release(&mut self, tag: Tag) -> Result<(), Refused> {
        self.held_mark(tag)?;
        self.marks.remove(&tag.tag);
        Ok(())
    }

    fn held_mark(&mut self, tag: Tag) -> Result<&mut Mark, Refused> {
        if tag.generation != self.generation {
            return Err(Refused::OtherGeneration);
        }
        self.marks.get_mut(&tag.tag).ok_or(Refused::NotHeld)
    }

    /// The acks that are safe now; their tags are no longer held.
    pub fn take(&mut self) -> Acks {
        let mut acks = Acks {
            generation: self.generation,
            ..Acks::default()
        };
        let mut in_prefix = true;
        let mut prefix: Option<Prefix> = None;
        self.marks.retain(|&tag, mark| match mark {
            Mark::Held => {
                in_prefix = false;
                true
            }
            Mark::Done if in_prefix => {
                let count = prefix.map_or(0, |p| p.count) + 1;
                prefix = Some(Prefix { last: tag, count });
                false
            }
            Mark::Done => {
                acks.single.push(tag);
                false
            }
        });
        acks.prefix = prefix;
        acks
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use std::collections::BTreeSet;

    #[test]
    fn a_prefix_and_singles_above_a_gap() {
        let mut p = AckPlan::new(1);
        let t: Vec<Tag> = (1..=5).map(|i| p.register(i).unwrap()).collect();
        p.done(t[0]).unwrap();
        p.done(t[1]).unwrap();
        p.done(t[3]).unwrap();
        let a = p.take();
        assert_eq!(a.prefix, Some(Prefix { last: 2, count: 2 }));
        assert_eq!(a.single, vec![4]);
        assert_eq!(p.held(), 2);
        // The reject of 3 is sent, then released: 5 done joins a new prefix.
        p.release(t[2]).unwrap();
        p.done(t[4]).unwrap();
        assert_eq!(p.take().prefix, Some(Prefix { last: 5, count: 1 }));
        assert!(p.take().is_empty());
        assert_eq!(p.done(t[0]), Err(Refused::NotHeld));
        assert_eq!(p.register(5), Err(Refused::OutOfOrder));
    }

    #[test]
    fn an_old_generation_is_never_acked_on_a_new_one() {
        let mut p = AckPlan::new(7);
        let old = p.register(1).unwrap();
        assert_eq!(p.next_generation(), 8);
        let new = p.register(1).unwrap();
        assert_eq!(p.done(old), Err(Refused::OtherGeneration));
        assert_eq!(p.release(old), Err(Refused::OtherGeneration));
        assert!(p.take().is_empty());
        p.done(new).unwrap();
        let a = p.take();
        assert_eq!((a.generation, a.prefix.map(|x| x.last)), (8, Some(1)));
    }

    #[derive(Debug, Clone)]
    enum Op {
        Arrive,
        Done(usize),
        /// The reject (or requeue) of a delivery is decided; its frame is in flight.
        RejectDecided(usize),
        /// That frame was sent.
        RejectSent(usize),
        Take,
        Reconnect,
        /// A late `done` of a delivery of an earlier generation.
        Stale(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            3 => Just(Op::Arrive),
            3 => (0..64usize).prop_map(Op::Done),
            1 => (0..64usize).prop_map(Op::RejectDecided),
            1 => (0..64usize).prop_map(Op::RejectSent),
            2 => Just(Op::Take),
            1 => Just(Op::Reconnect),
            1 => (0..64usize).prop_map(Op::Stale),
        ]
    }

    proptest! {
        /// Against a model of the broker's channel: every ack settles only deliveries
        /// that are durable and finished, never one whose reject is pending, never one
        /// of another generation; and every durable delivery is acked at the next take.
        #[test]
        fn acks_are_always_safe(ops in proptest::collection::vec(op(), 1..200)) {
            let mut plan = AckPlan::new(1);
            let mut next_tag = 1u64;
            // The broker's view of the current channel: unsettled tags.
            let mut unsettled: BTreeSet<u64> = BTreeSet::new();
            let mut durable: BTreeSet<u64> = BTreeSet::new();
            let mut rejecting: BTreeSet<u64> = BTreeSet::new();
            let mut tags: Vec<Tag> = Vec::new();
            let mut old: Vec<Tag> = Vec::new();
            for op in ops {
                match op {
                    Op::Arrive => {
                        let t = plan.register(next_tag).unwrap();
                        unsettled.insert(next_tag);
                        tags.push(t);
                        next_tag += 1;
                    }
                    Op::Done(i) => {
                        if let Some(t) = tags.get(i).copied()
                            && unsettled.contains(&t.tag)
                            && !rejecting.contains(&t.tag)
                            && durable.insert(t.tag)
                        {
                            plan.done(t).unwrap();
                        }
                    }
                    Op::RejectDecided(i) => {
                        if let Some(t) = tags.get(i)
                            && unsettled.contains(&t.tag)
                            && !durable.contains(&t.tag)
                        {
                            rejecting.insert(t.tag);
                        }
                    }
                    Op::RejectSent(i) => {
                        if let Some(t) = tags.get(i).copied()
                            && rejecting.remove(&t.tag)
                        {
                            unsettled.remove(&t.tag);
                            plan.release(t).unwrap();
                        }
                    }
                    Op::Take => {
                        let a = plan.take();
                        prop_assert_eq!(a.generation, plan.generation());
                        if let Some(p) = a.prefix {
                            let covered: Vec<u64> =
                                unsettled.range(..=p.last).copied().collect();
                            prop_assert_eq!(covered.len(), p.count);
                            for t in covered {
                                prop_assert!(durable.contains(&t), "{} covered, not durable", t);
                                prop_assert!(!rejecting.contains(&t));
                                unsettled.remove(&t);
                            }
                        }
                        for t in a.single {
                            prop_assert!(durable.contains(&t) && unsettled.remove(&t));
                        }
                        // Nothing durable is left behind.
                        prop_assert!(unsettled.iter().all(|t| !durable.contains(t)));
                    }
                    Op::Reconnect => {
                        old.append(&mut tags);
                        plan.next_generation();
                        next_tag = 1;
                        unsettled.clear();
                        durable.clear();
                        rejecting.clear();
                    }
                    Op::Stale(i) => {
                        if let Some(t) = old.get(i).copied() {
                            prop_assert_eq!(plan.done(t), Err(Refused::OtherGeneration));
                        }
                    }
                }
            }
        }
    }
}
