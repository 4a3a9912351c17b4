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
use crate::request_size::RequestSize;
use crate::service_time::Predictor;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;

/// How far back `serve` looks for leases: a worker gone longer is no longer listed.
pub const FLEET_WINDOW_MS: i64 = 3_600_000;

/// At most this many leases are read (the most recently renewed first).
pub const FLEET_MAX_WORKERS: usize = 200;

/// A worker's live numbers at its last lease renewal.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
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
    /// Its request-aware estimator by kind (bounded kinds): what a request of a given size
    /// would take there ([`best_peer`]). Absent from an older worker's lease; a lease
    /// whose models do not parse keeps its other numbers.
    #[serde(
        default,
        skip_serializing_if = "BTreeMap::is_empty",
        deserialize_with = "lenient_models"
    )]
    pub call_models: BTreeMap<String, Predictor>,
}

/// The call models of a lease, or none when they do not parse (a later worker's format,
/// or a value JSON cannot carry): the rest of the lease still counts.
fn lenient_models<'de, D>(d: D) -> Result<BTreeMap<String, Predictor>, D::Error>
where
    D: serde::Deserializer<'de>,
{
    let value = serde_json::Value::deserialize(d)?;
    Ok(serde_json::from_value(value).unwrap_or_default())
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
#[derive(Debug, Clone, PartialEq)]
pub struct Lease {
    pub worker: String,
    pub renewed_at_ms: i64,
    pub live: Option<WorkerLive>,
}

/// One worker on the dashboard.
#[derive(Debug, Clone, PartialEq, Serialize)]
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
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
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
            // The call models are for the peers' hand-back, not for the dashboard.
            live: l.live.clone().map(|v| WorkerLive {
                call_models: BTreeMap::new(),
                ..v
            }),
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
        let empty_model =
            crate::service_time::ServiceTimes::new(Default::default()).predictor("chat", now);
        let with_models = Lease {
            live: Some(WorkerLive {
                call_models: [("chat".to_owned(), empty_model)].into(),
                ..live(0, 0, 1, "chat", 1)
            }),
            ..leases[0].clone()
        };
        let shown = fleet(&[with_models], now).workers[0].live.clone().unwrap();
        assert!(
            shown.call_models.is_empty(),
            "the dashboard leaves them out"
        );
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
/// time of `kind`) and its call time for this request, the one that would finish first
/// ([`crate::ReceiptFacts::peer`]). The call time is the peer's own estimate for a request
/// of `size` by the model its lease publishes ([`WorkerLive::call_models`]), so a long
/// prompt is not offered to a peer that would refuse it too, nor a short one kept from a
/// peer that would take it; without a model (an older worker) or a size, its learned call
/// time for the kind. A lease without live numbers is left out. The leases are up to a
/// renewal old: a wrong answer costs one more delivery.
pub fn best_peer(
    leases: &[Lease],
    me: &str,
    kind: &str,
    size: Option<RequestSize>,
    now_ms: i64,
) -> Option<PeerOffer> {
    (leases.iter())
        .filter(|l| l.worker != me && lease::is_fresh(l.renewed_at_ms, now_ms))
        .filter_map(|l| {
            let v = l.live.as_ref().filter(|v| v.limit > 0)?;
            let kind_ms = v.learned_call_ms.get(kind).copied();
            let free = (v.limit - v.running).max(0) as usize;
            // The jobs ahead are of any size: the wait is over the kind's call time.
            let wait_ms = crate::wait::expected_wait_ms(
                v.waiting.max(0) as usize,
                free,
                v.limit as usize,
                kind_ms.unwrap_or(0),
            );
            let for_request = size
                .and_then(|s| v.call_models.get(kind)?.estimate(Some(s)))
                .map(|e| e.quantile_ms);
            let call_ms = for_request.or(kind_ms);
            Some(PeerOffer { wait_ms, call_ms })
        })
        .min_by_key(|p| p.wait_ms.saturating_add(p.call_ms.unwrap_or(0)))
}

#[cfg(test)]
mod peer_tests {
    use super::*;
    use crate::disposition::{Disposition, Receipt};

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
        let best = |ls: &[Lease]| best_peer(ls, "a", "chat", None, now);
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

    /// A worker's estimator of "chat" whose calls take `ms_per_token` per prompt token
    /// and 50 ms more, learned from 40 calls of 30 to 2,000 tokens, as its lease publishes it.
    fn model(ms_per_token: u64, now: i64) -> Predictor {
        let mut st = crate::service_time::ServiceTimes::new(Default::default());
        for i in 0..40u64 {
            let tokens = 30 + i * 50;
            let size = Some(RequestSize {
                prompt_tokens: tokens,
                max_tokens: None,
            });
            st.observe_request(
                "chat",
                50 + ms_per_token * tokens,
                false,
                size,
                now - 1_000 + i as i64,
            );
        }
        st.predictor("chat", now)
    }

    fn tokens(t: u64) -> Option<RequestSize> {
        Some(RequestSize {
            prompt_tokens: t,
            max_tokens: None,
        })
    }

    /// A peer's lease: `waiting` jobs for 2 slots, `running` of them busy, `kind_ms` its
    /// learned call time of "chat", `call_model` its estimator.
    fn peer(
        now: i64,
        waiting: i64,
        running: i64,
        kind_ms: u64,
        call_model: Option<Predictor>,
    ) -> Lease {
        Lease {
            worker: "b".into(),
            renewed_at_ms: now,
            live: Some(WorkerLive {
                waiting,
                running,
                limit: 2,
                learned_call_ms: [("chat".to_owned(), kind_ms)].into(),
                call_models: call_model
                    .map(|m| ("chat".to_owned(), m))
                    .into_iter()
                    .collect(),
                ..WorkerLive::default()
            }),
        }
    }

    fn policy() -> crate::WorkerPolicy {
        crate::WorkerPolicy {
            admission: crate::AdmissionPolicy {
                clock_uncertainty_ms: 100,
                default_min_runtime_ms: 0,
            },
            ..crate::WorkerPolicy::default()
        }
    }

    fn job(expires: i64) -> crate::Envelope {
        crate::Envelope::new(
            crate::JobId::parse("j").unwrap(),
            crate::Kind::parse("chat").unwrap(),
            crate::Deadline::new(0, expires),
            None,
            None,
            serde_json::Map::new(),
        )
    }

    /// The receipt of a "chat" job of `size` due at `expires` that this worker expects to
    /// take `learned_ms` and to wait `wait_here` for a slot, with the best of `peers`.
    fn decide(
        expires: i64,
        size: Option<RequestSize>,
        learned_ms: u64,
        wait_here: u64,
        peers: &[Lease],
        now: i64,
    ) -> Receipt {
        let facts = crate::ReceiptFacts {
            expected_wait_ms: wait_here,
            learned_runtime_ms: Some(learned_ms),
            peer: best_peer(peers, "a", "chat", size, now),
            ..crate::ReceiptFacts::default()
        };
        policy().on_receipt(&Ok(job(expires)), facts, now)
    }

    const PASS: Receipt = Receipt::Settle(Disposition::PassOn);

    #[test]
    fn a_long_prompt_is_not_offered_to_a_peer_that_would_refuse_it() {
        let now = 100_000;
        // A free peer, 2 ms a token; its learned call time of the kind is 2,000 ms (the
        // p99 of what it admits). This worker, three times slower, refuses a prompt of
        // 1,900 tokens (11,550 ms); the peer's own estimate for it is about 3,850 ms,
        // more than the 3,500 ms left.
        let fast = model(2, now);
        let for_it = fast.estimate(tokens(1_900)).unwrap().quantile_ms;
        assert!((3_800..=4_000).contains(&for_it), "{for_it}");
        let peers = [peer(now, 0, 0, 2_000, Some(fast))];
        assert!(matches!(
            decide(now + 3_500, tokens(1_900), 11_550, 0, &peers, now),
            Receipt::Settle(Disposition::RecordThenAck(_))
        ));
        // By the kind's call time alone (no size known, or a lease without a model) it
        // would be handed back, to be refused there too.
        assert_eq!(decide(now + 3_500, None, 11_550, 0, &peers, now), PASS);
        let old = [peer(now, 0, 0, 2_000, None)];
        assert_eq!(
            decide(now + 3_500, tokens(1_900), 11_550, 0, &old, now),
            PASS
        );
        // A prompt of 1,000 tokens (about 2,050 ms there) is handed back.
        assert_eq!(
            decide(now + 3_500, tokens(1_000), 6_150, 0, &peers, now),
            PASS
        );
    }

    #[test]
    fn a_short_prompt_is_offered_where_the_peer_admits_it() {
        let now = 100_000;
        // A busy peer: 3 waiting for 2 busy slots, 2,000 ms for the kind.
        let fast = model(2, now);
        let peers = [peer(now, 3, 2, 2_000, Some(fast))];
        let wait = wait_of(3, 0, 2, 2_000);
        let short = fast.estimate(tokens(100)).unwrap().quantile_ms;
        // Its wait and the kind's call time leave no room in 4,000 ms; its wait and its
        // estimate of a prompt of 100 tokens do.
        assert!(wait + 2_000 + 100 > 4_000, "{wait}");
        assert!(wait + short + 100 <= 4_000, "{wait} {short}");
        // This worker's backlog (3,900 ms) refuses it.
        assert_eq!(
            decide(now + 4_000, tokens(100), 750, 3_900, &peers, now),
            PASS
        );
        assert!(matches!(
            decide(now + 4_000, None, 750, 3_900, &peers, now),
            Receipt::Settle(Disposition::RecordThenAck(_))
        ));
    }

    #[test]
    fn leases_without_models_or_with_models_that_do_not_parse_still_count() {
        let now = 100_000;
        // A lease of an older worker: no models, its kind's call time stands.
        let live = WorkerLive::from_json(Some(
            r#"{"waiting":0,"running":0,"limit":2,"learned_call_ms":{"chat":700}}"#,
        ));
        let old = Lease {
            worker: "b".into(),
            renewed_at_ms: now,
            live: live.clone(),
        };
        assert!(live.unwrap().call_models.is_empty());
        let offer = best_peer(&[old], "a", "chat", tokens(1_000), now).unwrap();
        assert_eq!(offer.call_ms, Some(700));
        // Models in a form this version does not know: the rest of the lease holds.
        let odd = WorkerLive::from_json(Some(
            r#"{"waiting":1,"running":0,"limit":2,"call_models":{"chat":{"base":"?"}}}"#,
        ))
        .expect("the lease parses");
        assert_eq!((odd.waiting, odd.limit, odd.call_models.len()), (1, 2, 0));
        // Models go through the lease's text (the last digit of a float aside): the same
        // estimates come back.
        let m = model(2, now);
        let with = WorkerLive {
            limit: 2,
            call_models: [("chat".to_owned(), m)].into(),
            ..WorkerLive::default()
        };
        let back = WorkerLive::from_json(Some(&with.to_json())).expect("parses");
        for size in [None, tokens(30), tokens(700), tokens(1_980), tokens(5_000)] {
            assert_eq!(back.call_models["chat"].estimate(size), m.estimate(size));
        }
    }

    proptest::proptest! {
        /// A job is handed back exactly when this worker refuses it at receipt for its
        /// own backlog or call time and the peer's wait and the peer's own estimate for
        /// this request admit it.
        #[test]
        fn handed_back_when_the_peer_would_admit_this_request(
            t in 30u64..2_500,
            per_here in 1u64..8,
            per_peer in 1u64..8,
            waiting in 0i64..6,
            wait_here in 0u64..6_000,
            budget in 0i64..12_000,
        ) {
            let now = 100_000;
            let m = model(per_peer, now);
            let peers = [peer(now, waiting, 2, 1_000 * per_peer, Some(m))];
            let learned = 50 + per_here * t;
            let got = decide(now + budget, tokens(t), learned, wait_here, &peers, now);
            let p = policy();
            let env = job(now + budget);
            let stage = crate::Stage::Receipt;
            let here = p.check(&env, Some(learned), stage, now).is_ok()
                && p.check(&env, Some(learned), stage, now + wait_here as i64).is_ok();
            let peer_wait = wait_of(waiting as usize, 0, 2, 1_000 * per_peer);
            let there = m.estimate(tokens(t)).map(|e| e.quantile_ms);
            let peer_admits = p.check(&env, there, stage, now + peer_wait as i64).is_ok();
            let deadline_passed = budget <= 100;
            proptest::prop_assert_eq!(got == PASS, !here && peer_admits && !deadline_passed);
        }
    }

    fn wait_of(ahead: usize, free: usize, slots: usize, mean: u64) -> u64 {
        crate::wait::expected_wait_ms(ahead, free, slots, mean)
    }
}
