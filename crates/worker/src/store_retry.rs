//! Ledger writes that must succeed before an ack: retried with backoff, never skipped.
//!
//! While a write is failing, the shared [`StoreHealth`] is marked unhealthy and the
//! worker's receive loop stops taking new deliveries. Nothing is acked meanwhile.

use lastcall_store::StoreError;
use std::future::Future;
use std::time::Duration;
use tokio::sync::watch;
use tokio_util::sync::CancellationToken;

/// Shared health of the store, as the last write saw it.
#[derive(Debug, Clone)]
pub struct StoreHealth {
    tx: watch::Sender<bool>,
}

impl Default for StoreHealth {
    fn default() -> Self {
        Self {
            tx: watch::channel(true).0,
        }
    }
}

impl StoreHealth {
    pub fn is_healthy(&self) -> bool {
        *self.tx.borrow()
    }

    /// Every change of the health, as it happens.
    pub fn subscribe(&self) -> watch::Receiver<bool> {
        self.tx.subscribe()
    }

    fn set(&self, healthy: bool) {
        self.tx.send_if_modified(|h| {
            let changed = *h != healthy;
            *h = healthy;
            changed
        });
    }

    /// Wait until the store is healthy again (or `cancel` fires).
    pub async fn wait_healthy(&self, cancel: &CancellationToken) {
        let mut rx = self.tx.subscribe();
        tokio::select! {
            _ = rx.wait_for(|h| *h) => {}
            _ = cancel.cancelled() => {}
        }
    }
}

/// Run `op` until it succeeds. Returns `None` only if `cancel` fired first (the caller
/// then must not settle the delivery: the broker will redeliver it).
pub async fn until_stored<T, F, Fut>(
    health: &StoreHealth,
    cancel: &CancellationToken,
    on_retry: impl Fn(),
    mut op: F,
) -> Option<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Result<T, StoreError>>,
{
    let mut backoff = Duration::from_millis(50);
    loop {
        match op().await {
            Ok(v) => {
                health.set(true);
                return Some(v);
            }
            Err(e) => {
                on_retry();
                health.set(false);
                if e.is_retryable() {
                    tracing::warn!(error = %e, retry_in_ms = backoff.as_millis() as u64, "ledger write failed; not acking, retrying");
                } else {
                    tracing::error!(error = %e, retry_in_ms = backoff.as_millis() as u64, "ledger write failed with a non-transient error; not acking, retrying");
                }
                tokio::select! {
                    _ = tokio::time::sleep(backoff) => {}
                    _ = cancel.cancelled() => return None,
                }
                backoff = (backoff * 2).min(Duration::from_secs(2));
            }
        }
    }
}
