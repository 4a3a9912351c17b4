//! Webhooks: a job submitted with `callback_url` gets its outcome event POSTed there.
//!
//! - **Allow-list.** Only URLs under a prefix the operator allowed (`serve --webhook-allow
//!   URL`, same scheme, host and port, and a path under the prefix's) are taken: checked at
//!   the ingress (`422 callback_not_allowed`) and again before every attempt. Without an
//!   allow-list webhooks are off and `callback_url` is refused.
//! - **Registration before publishing.** The ingress writes the URL to the ledger
//!   (`webhooks`) before the job is published, so no outcome can come first.
//! - **Delivery.** Each `serve` follows `{prefix}.events` once; an event only names a job
//!   that ended (anyone allowed to publish there could send one). For each it takes a
//!   delivery slot (waiting while all are busy), reads the job's record (not terminal: no
//!   delivery), claims the job's webhook in the ledger (`Ledger::claim_webhook`: one
//!   claimer wins, so several `serve` processes never deliver twice), then POSTs the
//!   ledger's outcome as the event JSON (never the event's own body), signed
//!   with HMAC-SHA256 when a key is set (`x-lastcall-webhook-signature: v1=<hex>` over the
//!   body), retried with exponential backoff (1 s doubling, at most 30 s between attempts)
//!   up to `--webhook-attempts` times. Every attempt is recorded (`webhook_attempts`); a 2xx
//!   marks it delivered, and the last failed attempt marks it given up
//!   (`Ledger::record_webhook_given_up`): from then on it no longer holds its job against
//!   the ledger's retention.
//! - **The sweep.** Events are best-effort: one that no `serve` saw (it was down or
//!   disconnected) would deliver nothing, and a delivery cut by a stop would never end.
//!   So every `WebhookConfig::sweep_every` (30 s) each `serve` reads the ledger for the
//!   webhooks that no one delivers (`Ledger::webhooks_to_sweep`): of a job that ended more
//!   than `WebhookConfig::settle` (60 s) ago, neither delivered nor given up, and never
//!   claimed or claimed with no attempt for 10 minutes (`WEBHOOK_CLAIM_STALE_MS`: its
//!   claimer stopped). Each goes the events' way (slot, claim, attempts). A webhook is
//!   therefore delivered at least once, or given up, even across restarts; one cut
//!   mid-attempt by a stop may arrive twice (receivers deduplicate by `job_id`).
//! - **Limits.** At most 32 deliveries run at once (`WebhookConfig::concurrency`) and
//!   1,024 events wait for a slot; more are dropped, unclaimed, and counted (the sweep
//!   picks them up later).

use lastcall_clock::Clock;
use lastcall_core::{OutcomeEvent, SigningKey};
use lastcall_store::{Ledger, WebhookAttempt};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;
use tokio::sync::{Semaphore, mpsc};

/// The header carrying a webhook body's signature.
pub const SIGNATURE_HEADER: &str = "x-lastcall-webhook-signature";

/// What `serve` was told about webhooks.
#[derive(Debug, Clone)]
pub struct WebhookConfig {
    /// URL prefixes callbacks may go to; empty: webhooks are off.
    pub allow: Vec<reqwest::Url>,
    pub key: Option<SigningKey>,
    /// Attempts per webhook at most (≥ 1).
    pub attempts: u32,
    /// The wait before the second attempt; it doubles, up to 30 s.
    pub first_backoff: Duration,
    /// How long one attempt may take.
    pub timeout: Duration,
    /// Deliveries at most at once (≥ 1; 32 by default).
    pub concurrency: usize,
    /// How often the ledger is swept for webhooks that no process delivers (30 s).
    pub sweep_every: Duration,
    /// How long after its job ended a webhook is left to the events before the sweep
    /// takes it (60 s).
    pub settle: Duration,
}

impl Default for WebhookConfig {
    fn default() -> Self {
        Self {
            allow: Vec::new(),
            key: None,
            attempts: 5,
            first_backoff: Duration::from_secs(1),
            timeout: Duration::from_secs(10),
            concurrency: 32,
            sweep_every: Duration::from_secs(30),
            settle: Duration::from_secs(60),
        }
    }
}

impl WebhookConfig {
    /// Parse `--webhook-allow` prefixes (http or https URLs).
    pub fn parse_allow(prefixes: &[String]) -> Result<Vec<reqwest::Url>, String> {
        prefixes
            .iter()
            .map(|p| {
                let u = reqwest::Url::parse(p)
                    .map_err(|e| format!("--webhook-allow `{p}` is not a URL: {e}"))?;
                if !matches!(u.scheme(), "http" | "https") || u.host_str().is_none() {
                    return Err(format!(
                        "--webhook-allow `{p}` must be an http:// or https:// URL with a host"
                    ));
                }
                Ok(u)
            })
            .collect()
    }

    pub fn enabled(&self) -> bool {
        !self.allow.is_empty()
    }

    /// Whether callbacks may go to `url`; the refusal says why.
    pub fn check(&self, url: &str) -> Result<reqwest::Url, String> {
        if !self.enabled() {
            return Err(
                "webhooks are off on this server (start `lastcall serve` with --webhook-allow URL_PREFIX)"
                    .into(),
            );
        }
        let u =
            reqwest::Url::parse(url).map_err(|e| format!("`callback_url` is not a URL: {e}"))?;
        let allowed = self.allow.iter().any(|a| {
            a.scheme() == u.scheme()
                && a.host_str() == u.host_str()
                && a.port_or_known_default() == u.port_or_known_default()
                && path_under(u.path(), a.path())
        });
        if allowed {
            Ok(u)
        } else {
            Err(format!(
                "`callback_url` is not under an allowed prefix (serve --webhook-allow): {}",
                crate::params::shorten(url)
            ))
        }
    }
}

/// Whether `path` is `prefix` or below it, on a segment boundary: `/hooks` admits
/// `/hooks` and `/hooks/a`, never `/hooks-admin`; `/hooks/` admits what starts with it.
fn path_under(path: &str, prefix: &str) -> bool {
    match path.strip_prefix(prefix) {
        None => false,
        Some(rest) => prefix.ends_with('/') || rest.is_empty() || rest.starts_with('/'),
    }
}

/// Counters for `/metrics` and tests.
#[derive(Debug, Default)]
pub struct WebhookStats {
    pub delivered: AtomicU64,
    pub failed: AtomicU64,
    pub attempts: AtomicU64,
    /// Events dropped because the claim queue or the delivery slots were full.
    pub dropped: AtomicU64,
    /// Webhooks the sweep found undelivered and unclaimed (or claimed by a process that
    /// stopped) and handed to delivery.
    pub swept: AtomicU64,
}

/// The webhooks swept at most per sweep (the rest wait for the next one).
const SWEEP_BATCH: i64 = 256;

/// The delivery side: fed with event bodies by `serve`'s events follower, and by the
/// sweep of the ledger.
#[derive(Debug)]
pub struct Webhooks {
    tx: mpsc::Sender<String>,
    pub stats: Arc<WebhookStats>,
}

impl Webhooks {
    /// Start the claim-and-deliver task; `me` names this process in the ledger's claims.
    pub fn spawn(
        cfg: WebhookConfig,
        ledger: Arc<Ledger>,
        clock: Arc<dyn Clock>,
        me: String,
    ) -> Arc<Self> {
        let (tx, rx) = mpsc::channel(1024);
        let stats = Arc::new(WebhookStats::default());
        let (every, settle) = (cfg.sweep_every, cfg.settle);
        let client = reqwest::Client::builder()
            .timeout(cfg.timeout)
            .redirect(reqwest::redirect::Policy::none())
            .build()
            .unwrap_or_default();
        let ctx = Arc::new(Ctx {
            cfg,
            ledger,
            clock,
            me,
            client,
            stats: stats.clone(),
        });
        tokio::spawn(sweep(ctx.clone(), tx.downgrade(), every, settle));
        tokio::spawn(dispatch(ctx, rx));
        Arc::new(Self { tx, stats })
    }

    /// One event body from the follower (never waits).
    pub fn on_event(&self, body: &[u8]) {
        // The event only says which job ended: anyone who may publish on `{prefix}.events`
        // could have sent it. What is delivered is the ledger's outcome.
        let Some(event) = OutcomeEvent::from_json(body) else {
            return;
        };
        if self.tx.try_send(event.job_id).is_err() {
            self.stats.dropped.fetch_add(1, Ordering::Relaxed);
        }
    }
}

/// Every `every`, hand the webhooks that no one delivers to [`dispatch`]
/// ([`Ledger::webhooks_to_sweep`]); ends when the [`Webhooks`] is dropped.
async fn sweep(ctx: Arc<Ctx>, tx: mpsc::WeakSender<String>, every: Duration, settle: Duration) {
    let settle_ms = i64::try_from(settle.as_millis()).unwrap_or(i64::MAX);
    loop {
        tokio::time::sleep(every).await;
        let Some(tx) = tx.upgrade() else {
            return;
        };
        let now = ctx.clock.now_ms();
        let ids = match (ctx.ledger)
            .webhooks_to_sweep(now.saturating_sub(settle_ms), now, SWEEP_BATCH)
            .await
        {
            Ok(ids) => ids,
            Err(e) => {
                tracing::warn!(error = %e, "cannot read the webhooks to sweep; trying again later");
                continue;
            }
        };
        for job_id in ids {
            // Never waits: with the queue full, the rest wait for the next sweep.
            if tx.try_send(job_id).is_err() {
                break;
            }
            ctx.stats.swept.fetch_add(1, Ordering::Relaxed);
        }
    }
}

struct Ctx {
    cfg: WebhookConfig,
    ledger: Arc<Ledger>,
    clock: Arc<dyn Clock>,
    me: String,
    client: reqwest::Client,
    stats: Arc<WebhookStats>,
}

async fn dispatch(ctx: Arc<Ctx>, mut rx: mpsc::Receiver<String>) {
    let slots = Arc::new(Semaphore::new(ctx.cfg.concurrency.max(1)));
    while let Some(job_id) = rx.recv().await {
        // A delivery slot first, then the claim: a claimed webhook always gets its
        // attempts (while every slot is busy, events wait here and, past the queue's
        // 1,024, are dropped unclaimed: another `serve` may still deliver them).
        let Ok(permit) = slots.clone().acquire_owned().await else {
            return;
        };
        let rec = match ctx.ledger.get(&job_id).await {
            Ok(Some(rec)) if rec.is_terminal() => rec,
            Ok(_) => {
                tracing::warn!(
                    job_id = %job_id.escape_debug(),
                    "an outcome event for a job the ledger holds no outcome for: no webhook"
                );
                continue;
            }
            Err(e) => {
                tracing::warn!(job_id = %job_id.escape_debug(), error = %e, "cannot read the job's outcome; webhook not delivered");
                continue;
            }
        };
        let url = match (ctx.ledger)
            .claim_webhook(&job_id, &ctx.me, ctx.clock.now_ms())
            .await
        {
            Ok(Some(url)) => url,
            Ok(None) => continue, // no webhook, or another process has it
            Err(e) => {
                tracing::warn!(job_id = %job_id.escape_debug(), error = %e, "cannot claim a webhook; not delivered");
                continue;
            }
        };
        let recorded_by = rec.worker.clone().unwrap_or_else(|| "ledger".into());
        let body =
            String::from_utf8_lossy(&lastcall_producer::job_event(&rec, &recorded_by).to_json())
                .into_owned();
        let ctx = ctx.clone();
        tokio::spawn(async move {
            deliver(&ctx, &job_id, &url, body).await;
            drop(permit);
        });
    }
}

/// Attempt until a 2xx, or until the attempts are used up; record each one, and the
/// giving up. A URL no longer allowed (the allow-list changed) is recorded once and not
/// tried.
async fn deliver(ctx: &Ctx, job_id: &str, url: &str, body: String) {
    let cfg = &ctx.cfg;
    let signature = cfg
        .key
        .as_ref()
        .map(|k| lastcall_core::signature::sign_body(k, body.as_bytes()));
    let attempts = cfg.attempts.max(1);
    let mut backoff = cfg.first_backoff;
    for attempt in 1..=attempts {
        ctx.stats.attempts.fetch_add(1, Ordering::Relaxed);
        let (status, error, retry) = match cfg.check(url) {
            Err(why) => (None, Some(why), false),
            Ok(u) => {
                let mut req = ctx
                    .client
                    .post(u)
                    .header(reqwest::header::CONTENT_TYPE, "application/json")
                    .body(body.clone());
                if let Some(sig) = &signature {
                    req = req.header(SIGNATURE_HEADER, sig);
                }
                match req.send().await {
                    Ok(r) if r.status().is_success() => {
                        (Some(i64::from(r.status().as_u16())), None, false)
                    }
                    Ok(r) => (
                        Some(i64::from(r.status().as_u16())),
                        Some(format!("the receiver answered {}", r.status())),
                        true,
                    ),
                    Err(e) => (None, Some(format!("no answer: {e}")), true),
                }
            }
        };
        let rec = WebhookAttempt {
            job_id: job_id.to_owned(),
            attempt: i64::from(attempt),
            at_ms: ctx.clock.now_ms(),
            status,
            error: error.clone(),
        };
        if let Err(e) = ctx.ledger.record_webhook_attempt(&rec).await {
            tracing::warn!(job_id, error = %e, "cannot record a webhook attempt");
        }
        let Some(error) = error else {
            ctx.stats.delivered.fetch_add(1, Ordering::Relaxed);
            tracing::info!(job_id, attempt, "webhook delivered");
            return;
        };
        tracing::warn!(job_id, attempt, error = %error, "webhook attempt failed");
        if !retry || attempt == attempts {
            break;
        }
        tokio::time::sleep(backoff).await;
        backoff = (backoff * 2).min(Duration::from_secs(30));
    }
    ctx.stats.failed.fetch_add(1, Ordering::Relaxed);
    // Nothing will try again: the job's row no longer waits for this webhook (retention).
    if let Err(e) = (ctx.ledger)
        .record_webhook_given_up(job_id, ctx.clock.now_ms())
        .await
    {
        tracing::warn!(job_id, error = %e, "cannot record a webhook given up");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn allowing(prefixes: &[&str]) -> WebhookConfig {
        let p: Vec<String> = prefixes.iter().map(|s| (*s).to_owned()).collect();
        WebhookConfig {
            allow: WebhookConfig::parse_allow(&p).unwrap(),
            ..WebhookConfig::default()
        }
    }

    /// An allow-list entry admits its own path and what lies below it on a segment
    /// boundary: `/hooks` is not a prefix of `/hooks-admin`.
    #[test]
    fn an_allowed_prefix_ends_on_a_path_segment() {
        let c = allowing(&["https://h.example/hooks", "https://h.example/cb/"]);
        for ok in [
            "https://h.example/hooks",
            "https://h.example/hooks/",
            "https://h.example/hooks/a/b?x=1",
            "https://h.example/cb/",
            "https://h.example/cb/x",
        ] {
            assert!(c.check(ok).is_ok(), "{ok}");
        }
        for refused in [
            "https://h.example/hooks-admin",
            "https://h.example/hooksx/a",
            "https://h.example/hook",
            "https://h.example/cb",
            "https://h.example/cbx",
            "https://h.example/hooks/../admin",
            "https://h.example/hooks/%2e%2e/admin",
            "http://h.example/hooks/a",
            "https://h.example:8443/hooks/a",
            "https://other.example/hooks/a",
        ] {
            assert!(c.check(refused).is_err(), "{refused}");
        }
    }
}
