//! Long-polls (`GET /v1/jobs/{id}?wait_ms=N`) woken by outcome events, not by polling the
//! ledger.
//!
//! One follower per `serve` process consumes `{prefix}.events`
//! (`lastcall_broker::events::follow`) and calls [`Waiters::notify`] with each event's job
//! id; every waiter of that id wakes and reads the ledger once. While they wait, waiters
//! cost no ledger query. When the follower (re)connects it may have missed events, so it
//! calls [`Waiters::gap`] and every waiter reads the ledger once more.

use lastcall_core::OutcomeEvent;
use lastcall_store::JobRecord;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// The registry of waiting requests, by job id.
#[derive(Debug)]
pub struct Waiters {
    by_job: Mutex<HashMap<String, watch::Sender<u64>>>,
    gaps: watch::Sender<u64>,
    /// A follower was started ([`Waiters::follow`]).
    followed: AtomicBool,
    /// The follower's subscription is live now.
    following: AtomicBool,
    /// Events received (any job).
    pub events: AtomicU64,
}

impl Default for Waiters {
    fn default() -> Self {
        Self {
            by_job: Mutex::new(HashMap::new()),
            gaps: watch::Sender::new(0),
            followed: AtomicBool::new(false),
            following: AtomicBool::new(false),
            events: AtomicU64::new(0),
        }
    }
}

impl Waiters {
    /// Register interest in `id` *before* reading the ledger, so an outcome recorded
    /// between the read and the wait still wakes it.
    pub fn subscribe(self: &Arc<Self>, id: &str) -> Waiter {
        let mut map = self.by_job.lock().unwrap_or_else(|e| e.into_inner());
        let rx = map
            .entry(id.to_owned())
            .or_insert_with(|| watch::Sender::new(0))
            .subscribe();
        drop(map);
        Waiter {
            hub: self.clone(),
            id: id.to_owned(),
            rx,
            gaps: self.gaps.subscribe(),
        }
    }

    /// An outcome of `id` is durable: wake its waiters.
    pub fn notify(&self, id: &str) {
        let map = self.by_job.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(tx) = map.get(id) {
            tx.send_modify(|n| *n += 1);
        }
    }

    /// Handle one event body from the follower.
    pub fn on_event(&self, body: &[u8]) {
        self.events.fetch_add(1, Ordering::Relaxed);
        if let Some(e) = OutcomeEvent::from_json(body) {
            self.notify(&e.job_id);
        }
    }

    /// Events may have been missed (the follower subscribed again, `following`, or lost
    /// its subscription): wake every waiter. The waiters woken are those that arrived
    /// before this call; the follower counts as live only after it.
    pub fn gap(&self, following: bool) {
        self.gaps.send_modify(|n| *n += 1);
        self.following.store(following, Ordering::SeqCst);
    }

    /// `None` when no follower was started (this registry is woken by hand); else whether
    /// its subscription is live, so that a waiter arriving now misses no event. `serve`'s
    /// `/readyz` reports it as `events_follower`.
    pub fn following(&self) -> Option<bool> {
        self.followed
            .load(Ordering::SeqCst)
            .then(|| self.following.load(Ordering::SeqCst))
    }

    /// Feed this registry from the events exchange until `stop`: one follower
    /// (`lastcall_broker::events::follow`); `also` sees every event body too (`serve`'s
    /// webhooks).
    pub fn follow(
        self: &Arc<Self>,
        broker: lastcall_broker::Broker,
        exchange: String,
        stop: tokio_util::sync::CancellationToken,
        mut also: impl FnMut(&[u8]) + Send + 'static,
    ) -> tokio::task::JoinHandle<()> {
        let (on_event, on_gap) = (self.clone(), self.clone());
        self.followed.store(true, Ordering::SeqCst);
        tokio::spawn(lastcall_broker::events::follow(
            broker,
            exchange,
            stop,
            move |_, body| {
                on_event.on_event(body);
                also(body);
            },
            move |following| on_gap.gap(following),
        ))
    }

    /// Job ids with at least one waiter now.
    pub fn len(&self) -> usize {
        self.by_job.lock().unwrap_or_else(|e| e.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// One waiting request. Dropping it unregisters it.
#[derive(Debug)]
pub struct Waiter {
    hub: Arc<Waiters>,
    id: String,
    rx: watch::Receiver<u64>,
    gaps: watch::Receiver<u64>,
}

impl Waiter {
    /// Wait until the job's outcome event (or a gap) arrives, or until `until`. `true`:
    /// woken, read the ledger again; `false`: the time is up.
    pub async fn wait(&mut self, until: tokio::time::Instant) -> bool {
        tokio::select! {
            r = self.rx.changed() => r.is_ok(),
            r = self.gaps.changed() => r.is_ok(),
            () = tokio::time::sleep_until(until) => false,
        }
    }
}

impl Waiter {
    /// Read the job with `read` now and after every wake until its record is terminal or
    /// `until` passes (then once more: an event may have been lost); the last record read.
    /// No read happens while it waits.
    pub async fn until_terminal<E, Fut>(
        &mut self,
        until: tokio::time::Instant,
        mut read: impl FnMut() -> Fut,
    ) -> Result<Option<JobRecord>, E>
    where
        Fut: std::future::Future<Output = Result<Option<JobRecord>, E>>,
    {
        let mut rec = read().await?;
        while !rec.as_ref().is_some_and(JobRecord::is_terminal) {
            if !self.wait(until).await {
                return read().await;
            }
            rec = read().await?;
        }
        Ok(rec)
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        let mut map = self.hub.by_job.lock().unwrap_or_else(|e| e.into_inner());
        // Our own receiver still counts here; the entry goes with the last waiter.
        if map.get(&self.id).is_some_and(|tx| tx.receiver_count() <= 1) {
            map.remove(&self.id);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[tokio::test]
    async fn an_event_wakes_only_its_job_and_the_last_waiter_unregisters() {
        let hub = Arc::new(Waiters::default());
        let mut a = hub.subscribe("a");
        let mut a2 = hub.subscribe("a");
        let mut b = hub.subscribe("b");
        assert_eq!(hub.len(), 2);
        hub.notify("a");
        let soon = tokio::time::Instant::now() + Duration::from_millis(50);
        assert!(a.wait(soon).await);
        assert!(a2.wait(soon).await);
        assert!(!b.wait(soon).await, "b had no event");
        drop(a);
        assert_eq!(hub.len(), 2, "a2 still waits");
        drop(a2);
        assert_eq!(hub.len(), 1);
        hub.gap(true);
        assert!(
            b.wait(tokio::time::Instant::now() + Duration::from_secs(5))
                .await
        );
        drop(b);
        assert!(hub.is_empty());
    }

    #[tokio::test]
    async fn an_event_between_subscribe_and_wait_is_not_missed() {
        let hub = Arc::new(Waiters::default());
        let mut w = hub.subscribe("j");
        hub.notify("j"); // e.g. while the handler reads the ledger
        assert!(
            w.wait(tokio::time::Instant::now() + Duration::from_secs(5))
                .await
        );
    }
}
