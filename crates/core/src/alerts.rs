//! The dashboard's alerts: what needs the operator now, from numbers `serve`
//! has already read. Pure: the caller passes what it read and `now` as values.

use serde::Serialize;

/// How far back the kind and quota alerts look.
pub const ALERT_WINDOW_MS: i64 = 5 * 60_000;

/// A kind is "refused entirely" when every one of at least this many outcomes of it in
/// [`ALERT_WINDOW_MS`] was a refusal without a model call.
pub const KIND_REFUSED_MIN_JOBS: u64 = 3;

/// How far past its retention the ledger's oldest prunable row may be before
/// `ledger_behind_retention` fires: one day. Pruning is periodic (each worker every
/// `--prune-every`, 10 min by default, one at a time on PostgreSQL) and paced (its batches
/// take at most 5% of the time), so rows a little past the cutoff are normal between passes
/// and while a backlog is worked off; a row a whole day past it means no pass has reached
/// it for a day. Retention is at least one day, so this at most doubles a row's stay.
pub const RETENTION_GRACE_MS: i64 = 86_400_000;

/// One alert.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Alert {
    /// `dead_letters_unprocessed`, `breaker_open`, `tenant_over_quota`,
    /// `kind_refused`, `ledger_behind_retention`.
    pub alert: &'static str,
    /// What it is about (a queue, a worker/backend, a tenant, a kind).
    pub subject: String,
    pub message: String,
}

/// A breaker the ledger holds open (its worker's lease fresh).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct OpenBreaker {
    pub worker: String,
    pub backend: String,
    pub kinds: Vec<String>,
    pub open_until_ms: i64,
}

/// A kind's outcomes in the alert window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KindOutcomes {
    pub kind: String,
    pub jobs: u64,
    /// Of them, refused without a model call.
    pub refused: u64,
}

/// The ledger's rows that retention may delete (terminal, no webhook waiting) recorded
/// before a cutoff: the oldest one's `recorded_at_ms` (`None`: none), and how many there
/// are, counted up to a bound.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PrunableRows {
    pub oldest_recorded_at_ms: Option<i64>,
    /// At most the bound the caller read with ([`PrunableRows::bounded`] says if reached).
    pub rows: u64,
    /// The count stopped at its bound: there may be more.
    pub bounded: bool,
}

/// What the alerts are computed from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AlertInput {
    /// The dead-letter queue: its name, ready messages and consumers (when known).
    pub dead_queue: Option<(String, Option<u64>, Option<u64>)>,
    pub breakers: Vec<OpenBreaker>,
    /// Tenants with a refusal over quota in the window, with the count seen.
    pub over_quota: Vec<(String, u64)>,
    pub kinds: Vec<KindOutcomes>,
    /// The row retention in force (`[ledger] retention`, ms) and the ledger's prunable
    /// rows recorded before `now - retention`; `None`: retention is off or not known.
    pub retention: Option<(i64, PrunableRows)>,
}

/// `ms` in days, rounded down, for a message (`30 d`), or hours below two days.
fn days(ms: i64) -> String {
    if ms >= 2 * 86_400_000 {
        format!("{} d", ms / 86_400_000)
    } else {
        format!("{} h", ms / 3_600_000)
    }
}

/// The alerts, in a fixed order (dead letters, breakers, quotas, kinds, retention).
pub fn alerts(input: &AlertInput, now_ms: i64) -> Vec<Alert> {
    let mut out = Vec::new();
    if let Some((queue, Some(ready), Some(0))) = &input.dead_queue
        && *ready > 0
    {
        out.push(Alert {
            alert: "dead_letters_unprocessed",
            subject: queue.clone(),
            message: format!(
                "{ready} dead letters wait in {queue} and nothing processes them: \
                 run `lastcall dlq` or a worker with `--dlq`"
            ),
        });
    }
    for b in &input.breakers {
        let secs = ((b.open_until_ms - now_ms).max(0) + 999) / 1000;
        out.push(Alert {
            alert: "breaker_open",
            subject: format!("{}/{}", b.worker, b.backend),
            message: format!(
                "worker {} holds the breaker of {} open ({}), next trial in {secs} s",
                b.worker,
                b.backend,
                b.kinds.join(", ")
            ),
        });
    }
    for (tenant, n) in &input.over_quota {
        out.push(Alert {
            alert: "tenant_over_quota",
            subject: tenant.clone(),
            message: format!(
                "tenant {tenant} is over its quota: {n} jobs refused at the door in the last {} min",
                ALERT_WINDOW_MS / 60_000
            ),
        });
    }
    for k in &input.kinds {
        if k.jobs >= KIND_REFUSED_MIN_JOBS && k.refused == k.jobs {
            out.push(Alert {
                alert: "kind_refused",
                subject: k.kind.clone(),
                message: format!(
                    "every job of kind {} was refused without a model call in the last {} min ({})",
                    k.kind,
                    ALERT_WINDOW_MS / 60_000,
                    k.jobs
                ),
            });
        }
    }
    if let Some((retention_ms, p)) = &input.retention
        && let Some(oldest) = p.oldest_recorded_at_ms
        && oldest < now_ms - retention_ms - RETENTION_GRACE_MS
    {
        let plus = if p.bounded { "+" } else { "" };
        out.push(Alert {
            alert: "ledger_behind_retention",
            subject: "ledger".into(),
            message: format!(
                "the ledger holds {}{plus} ended jobs older than its retention of {}, the oldest \
                 recorded {} ago: pruning is not running or not keeping up; check that the \
                 workers run with pruning on (`worker --prune-every`, not `off`) and the same \
                 `[ledger] retention`, or run `lastcall ledger prune`",
                p.rows,
                days(*retention_ms),
                days(now_ms - oldest)
            ),
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dead_letters_alert_only_without_a_consumer() {
        let input = |ready, consumers| AlertInput {
            dead_queue: Some(("q.dead".into(), ready, consumers)),
            ..Default::default()
        };
        assert_eq!(alerts(&input(Some(6), Some(0)), 0).len(), 1);
        assert!(
            alerts(&input(Some(6), Some(0)), 0)[0]
                .message
                .contains("6 dead letters")
        );
        assert!(alerts(&input(Some(6), Some(1)), 0).is_empty());
        assert!(alerts(&input(Some(0), Some(0)), 0).is_empty());
        assert!(
            alerts(&input(Some(6), None), 0).is_empty(),
            "unknown: no claim"
        );
    }

    #[test]
    fn a_kind_alerts_when_all_of_enough_jobs_were_refused() {
        let k = |jobs, refused| AlertInput {
            kinds: vec![KindOutcomes {
                kind: "chat".into(),
                jobs,
                refused,
            }],
            ..Default::default()
        };
        assert_eq!(alerts(&k(3, 3), 0)[0].alert, "kind_refused");
        assert!(alerts(&k(3, 2), 0).is_empty());
        assert!(alerts(&k(2, 2), 0).is_empty());
    }

    #[test]
    fn the_ledger_alerts_once_its_oldest_prunable_row_is_past_retention_and_grace() {
        const DAY: i64 = 86_400_000;
        let now = 100 * DAY;
        let retention = 30 * DAY;
        let input = |oldest: Option<i64>, rows| AlertInput {
            retention: Some((
                retention,
                PrunableRows {
                    oldest_recorded_at_ms: oldest,
                    rows,
                    bounded: false,
                },
            )),
            ..Default::default()
        };
        let cut = now - retention - RETENTION_GRACE_MS;
        let a = alerts(&input(Some(cut - 1), 12), now);
        assert_eq!(a.len(), 1, "{a:?}");
        assert_eq!(
            (a[0].alert, a[0].subject.as_str()),
            ("ledger_behind_retention", "ledger")
        );
        assert!(
            a[0].message
                .contains("12 ended jobs older than its retention of 30 d")
                && a[0].message.contains("recorded 31 d ago")
                && a[0].message.contains("lastcall ledger prune"),
            "{}",
            a[0].message
        );
        // Within the grace (pruning runs periodically), or nothing prunable: no alert.
        assert!(alerts(&input(Some(cut), 12), now).is_empty());
        assert!(alerts(&input(Some(now - retention - 1), 3), now).is_empty());
        assert!(alerts(&input(None, 0), now).is_empty());
        // Retention off or not known: no claim.
        let unknown = AlertInput {
            retention: None,
            ..Default::default()
        };
        assert!(alerts(&unknown, now).is_empty());
        // A bounded count says so.
        let mut bounded = input(Some(0), 1_000);
        if let Some((_, p)) = bounded.retention.as_mut() {
            p.bounded = true;
        }
        assert!(
            alerts(&bounded, now)[0]
                .message
                .contains("1000+ ended jobs")
        );
    }

    #[test]
    fn breakers_and_quotas_each_alert() {
        let input = AlertInput {
            breakers: vec![OpenBreaker {
                worker: "w1".into(),
                backend: "vllm".into(),
                kinds: vec!["chat".into()],
                open_until_ms: 4_500,
            }],
            over_quota: vec![("acme".into(), 7)],
            ..Default::default()
        };
        let a = alerts(&input, 1_000);
        assert_eq!(a.len(), 2);
        assert!(
            a[0].message.contains("next trial in 4 s"),
            "{}",
            a[0].message
        );
        assert_eq!(
            (a[1].alert, a[1].subject.as_str()),
            ("tenant_over_quota", "acme")
        );
    }
}
