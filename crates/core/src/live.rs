//! What a worker publishes about itself through its lease, and what `serve`'s
//! dashboard makes of the fleet's leases.
//!
//! Each worker writes a [`WorkerLive`] (JSON) into its lease row at every renewal: its
//! jobs waiting for a slot, its model calls running, its concurrency limit and its learned
//! call times. `serve` reads every lease renewed in the last [`FLEET_WINDOW_MS`] and folds
//! them with [`fleet`]: a worker whose lease is fresh ([`crate::lease::is_fresh`]) counts
//! in the totals; an older one is shown as stale and counts nowhere. No address has to be
//! given to `serve`: the ledger both already share is the channel.

use crate::disposition::PeerOffer;
use crate::lease;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How far back `serve` looks for leases: a worker gone longer is no longer listed.
pub const FLEET_WINDOW_MS: i64 = 3_600_000;

/// At most this many leases are read (the most recently renewed first).
pub const FLEET_MAX_WORKERS: usize = 200;

/// A worker's live numbers at its last lease renewal.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WorkerLive {
    /// Jobs received and waiting locally for a model slot.
    pub waiting: i64,
    /// Jobs waiting, without a slot, for their backend's next rate-limit permit.
    #[serde(default)]
    pub waiting_for_rate_limit: i64,
    /// Model calls in progress.
    pub running: i64,
    /// Model calls it may run at once now (`--slots N`, or the adaptive limit).
    pub limit: i64,
    /// The learned call duration (the admission quantile) by kind, ms (bounded kinds).
    #[serde(default)]
    pub learned_call_ms: BTreeMap<String, u64>,
}

impl WorkerLive {
    /// The lease column's text.
    pub fn to_json(&self) -> String {
        serde_json::to_string(self).unwrap_or_default()
    }

    /// `None` for a lease without live numbers (a worker of an older version) or text
    /// that does not parse.
    pub fn from_json(text: Option<&str>) -> Option<Self> {
        text.and_then(|t| serde_json::from_str(t).ok())
    }
}

/// One lease as the ledger holds it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lease {
    pub worker: String,
    pub renewed_at_ms: i64,
    pub live: Option<WorkerLive>,
}

/// One worker on the dashboard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct FleetWorker {
    pub worker: String,
    /// How long ago its lease was renewed, ms.
    pub age_ms: i64,
    /// Its lease expired: presumed dead, its numbers are old and count nowhere.
    pub stale: bool,
    /// `None`: the lease carries no live numbers (an older worker).
    pub live: Option<WorkerLive>,
}

/// The fleet's live numbers: the sums over the fresh workers that published them.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct Fleet {
    pub workers: Vec<FleetWorker>,
    /// Workers with a fresh lease.
    pub fresh: usize,
    pub stale: usize,
    /// Sums over the fresh workers with live numbers; `None` when there is none.
    pub waiting: Option<i64>,
    pub waiting_for_rate_limit: Option<i64>,
    pub running: Option<i64>,
    pub limit: Option<i64>,
    /// Per kind, the longest learned call time of the fresh workers, ms.
    pub learned_call_ms: BTreeMap<String, u64>,
}

/// Fold the leases read at `now_ms`: fresh workers first, then stale ones, each by name.
pub fn fleet(leases: &[Lease], now_ms: i64) -> Fleet {
    let mut out = Fleet::default();
    let mut workers: Vec<FleetWorker> = leases
        .iter()
        .map(|l| FleetWorker {
            worker: l.worker.clone(),
            age_ms: (now_ms - l.renewed_at_ms).max(0),
            stale: !lease::is_fresh(l.renewed_at_ms, now_ms),
            live: l.live.clone(),
        })
        .collect();
    workers.sort_by(|a, b| a.stale.cmp(&b.stale).then_with(|| a.worker.cmp(&b.worker)));
    let mut sums: Option<(i64, i64, i64, i64)> = None;
    for w in &workers {
        if w.stale {
            out.stale += 1;
            continue;
        }
        out.fresh += 1;
        let Some(live) = &w.live else { continue };
        let s = sums.get_or_insert((0, 0, 0, 0));
        s.0 += live.waiting;
        s.1 += live.waiting_for_rate_limit;
        s.2 += live.running;
        s.3 += live.limit;
        for (kind, ms) in &live.learned_call_ms {
            let e = out.learned_call_ms.entry(kind.clone()).or_default();
            *e = (*e).max(*ms);
        }
    }
    if let Some((w, r, run, lim)) = sums {
        out.waiting = Some(w);
        out.waiting_for_rate_limit = Some(r);
        out.running = Some(run);
        out.limit = Some(lim);
    }
    out.workers = workers;
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn live(waiting: i64, running: i64, limit: i64, kind: &str, ms: u64) -> WorkerLive {
        WorkerLive {
            waiting,
            running,
            limit,
            learned_call_ms: [(kind.to_owned(), ms)].into(),
            ..Default::default()
        }
    }

    #[test]
    fn fresh_workers_sum_and_stale_ones_are_only_listed() {
        let now = 100_000;
        let leases = vec![
            Lease {
                worker: "b".into(),
                renewed_at_ms: now - 1_000,
                live: Some(live(2, 3, 4, "chat", 800)),
            },
            Lease {
                worker: "a".into(),
                renewed_at_ms: now - lease::LEASE_TTL_MS - 1,
                live: Some(live(50, 50, 50, "chat", 9_000)),
            },
            Lease {
                worker: "c".into(),
                renewed_at_ms: now,
                live: Some(live(1, 1, 2, "chat", 1_200)),
            },
            Lease {
                worker: "d".into(),
                renewed_at_ms: now,
                live: None,
            },
        ];
        let f = fleet(&leases, now);
        assert_eq!((f.fresh, f.stale), (3, 1));
        assert_eq!((f.waiting, f.running, f.limit), (Some(3), Some(4), Some(6)));
        assert_eq!(f.learned_call_ms["chat"], 1_200);
        let names: Vec<_> = f.workers.iter().map(|w| w.worker.as_str()).collect();
        assert_eq!(names, ["b", "c", "d", "a"]);
        assert!(f.workers[3].stale);
    }

    #[test]
    fn no_live_numbers_is_none_not_zero() {
        let f = fleet(
            &[Lease {
                worker: "old".into(),
                renewed_at_ms: 0,
                live: None,
            }],
            0,
        );
        assert_eq!((f.fresh, f.waiting, f.limit), (1, None, None));
        assert_eq!(fleet(&[], 0).running, None);
    }

    #[test]
    fn the_lease_text_round_trips_and_bad_text_is_none() {
        let l = live(1, 2, 3, "k", 4);
        assert_eq!(WorkerLive::from_json(Some(&l.to_json())), Some(l));
        assert_eq!(WorkerLive::from_json(Some("{nope")), None);
        assert_eq!(WorkerLive::from_json(None), None);
    }
}

/// The best other worker than `me` for a job of `kind` that this worker refuses at
/// receipt, by the fresh leases: its expected wait for a slot
/// ([`crate::wait::expected_wait_ms`] over its jobs waiting, free slots and learned call
/// time of `kind`) and that call time, the one that would finish first
/// ([`crate::ReceiptFacts::peer`]). A lease without live numbers is left out. The leases
/// are up to a renewal old: a wrong answer costs one more delivery.
pub fn best_peer(leases: &[Lease], me: &str, kind: &str, now_ms: i64) -> Option<PeerOffer> {
    (leases.iter())
        .filter(|l| l.worker != me && lease::is_fresh(l.renewed_at_ms, now_ms))
        .filter_map(|l| {
            let v = l.live.as_ref().filter(|v| v.limit > 0)?;
            let call_ms = v.learned_call_ms.get(kind).copied();
            let free = (v.limit - v.running).max(0) as usize;
            let wait_ms = crate::wait::expected_wait_ms(
                v.waiting.max(0) as usize,
                free,
                v.limit as usize,
                call_ms.unwrap_or(0),
            );
            Some(PeerOffer { wait_ms, call_ms })
        })
        .min_by_key(|p| p.wait_ms.saturating_add(p.call_ms.unwrap_or(0)))
}

#[cfg(test)]
mod peer_tests {
    use super::*;

    fn lease(worker: &str, renewed_at_ms: i64, live: Option<(i64, i64, i64, u64)>) -> Lease {
        Lease {
            worker: worker.into(),
            renewed_at_ms,
            live: live.map(|(waiting, running, limit, call)| WorkerLive {
                waiting,
                running,
                limit,
                learned_call_ms: [("chat".to_owned(), call)].into(),
                ..WorkerLive::default()
            }),
        }
    }

    #[test]
    fn the_peer_that_would_finish_first_among_the_fresh_ones() {
        let now = 100_000;
        let best = |ls: &[Lease]| best_peer(ls, "a", "chat", now);
        let offer = |wait_ms, call| PeerOffer {
            wait_ms,
            call_ms: Some(call),
        };
        // A free slot: no wait.
        assert_eq!(
            best(&[lease("b", now, Some((0, 1, 2, 200)))]),
            Some(offer(0, 200))
        );
        // 3 waiting for 2 busy slots of 200 ms: 2 releases, the first half a call away.
        let busy = lease("b", now, Some((3, 2, 2, 200)));
        let busy_wait = wait_of(3, 0, 2, 200);
        assert!(busy_wait > 0);
        assert_eq!(
            best(std::slice::from_ref(&busy)),
            Some(offer(busy_wait, 200))
        );
        // A free but far slower peer finishes later than the busy one.
        let slow = lease("c", now, Some((0, 0, 2, 5_000)));
        assert_eq!(best(&[busy.clone(), slow]), Some(offer(busy_wait, 200)));
        // Stale, silent, or this worker itself: none.
        let stale = now - 10 * lease::LEASE_RENEW_MS as i64;
        assert_eq!(best(&[lease("b", stale, Some((0, 0, 2, 200)))]), None);
        assert_eq!(best(&[lease("b", now, None)]), None);
        assert_eq!(best(&[lease("a", now, Some((0, 0, 2, 200)))]), None);
        assert_eq!(best(&[]), None);
    }

    fn wait_of(ahead: usize, free: usize, slots: usize, mean: u64) -> u64 {
        crate::wait::expected_wait_ms(ahead, free, slots, mean)
    }
}
