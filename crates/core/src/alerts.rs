//! The dashboard's alerts: what needs the operator now, from numbers `serve`
//! has already read. Pure: the caller passes what it read and `now` as values.

use serde::Serialize;

/// How far back the kind and quota alerts look.
pub const ALERT_WINDOW_MS: i64 = 5 * 60_000;

/// A kind is "refused entirely" when every one of at least this many outcomes of it in
/// [`ALERT_WINDOW_MS`] was a refusal without a model call.
pub const KIND_REFUSED_MIN_JOBS: u64 = 3;

/// One alert.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Alert {
    /// `dead_letters_unprocessed`, `breaker_open`, `tenant_over_quota`,
    /// `kind_refused`.
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

/// What the alerts are computed from.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AlertInput {
    /// The dead-letter queue: its name, ready messages and consumers (when known).
    pub dead_queue: Option<(String, Option<u64>, Option<u64>)>,
    pub breakers: Vec<OpenBreaker>,
    /// Tenants with a refusal over quota in the window, with the count seen.
    pub over_quota: Vec<(String, u64)>,
    pub kinds: Vec<KindOutcomes>,
}

/// The alerts, in a fixed order (dead letters, breakers, quotas, kinds).
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
