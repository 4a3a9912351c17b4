//! The jobs this process holds, by job id: those waiting for a slot or running (each
//! delivery's [`CancelGuard`], whose token a confirmed cancellation fires) and the model
//! calls running here ([`InFlight`], which a redelivery after a reconnect waits for).
//!
//! Its own value, shared by the job tasks, the cancellation checker and the lease's hold:
//! none of them needs the rest of the worker's state for it.

use lastcall_backend::CancellationToken;
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use tokio::sync::watch;

/// The jobs held and the calls running in this process.
#[derive(Debug, Default)]
pub(crate) struct Held {
    /// Jobs whose model call runs in this process now: a redelivery of one of them (after
    /// a reconnect) waits for that call to settle instead of calling again.
    in_flight: Mutex<HashMap<String, watch::Receiver<()>>>,
    /// Jobs in this process (waiting for a slot or running): a cancellation broadcast
    /// (`{prefix}.control`) fires the token, which ends the wait or aborts the call. The
    /// count is the deliveries sharing it.
    cancels: Mutex<HashMap<String, (CancellationToken, usize)>>,
}

impl Held {
    /// Whether `job_id` waits for a slot or runs in this process.
    pub(crate) fn holds(&self, job_id: &str) -> bool {
        let map = self.cancels.lock().unwrap_or_else(|e| e.into_inner());
        map.contains_key(job_id)
    }

    /// The ids of the jobs held here (waiting for a slot or running), for the cancellation
    /// sweep.
    pub(crate) fn held_ids(&self) -> Vec<String> {
        let map = self.cancels.lock().unwrap_or_else(|e| e.into_inner());
        map.keys().cloned().collect()
    }

    /// A cancellation the ledger confirmed for `job_id`: end its wait or abort its call here.
    pub(crate) fn cancel_local(&self, job_id: &str) {
        let map = self.cancels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some((token, _)) = map.get(job_id)
            && !token.is_cancelled()
        {
            tracing::info!(job_id, "cancellation requested: stopping the job here");
            token.cancel();
        }
    }

    /// The running call of `id` here, if any: its receiver changes (closes) when it settled.
    pub(crate) fn running(&self, id: &str) -> Option<watch::Receiver<()>> {
        let map = self.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        map.get(id).cloned()
    }
}

/// A model call running in this process, registered by job id until it has settled.
pub(crate) struct InFlight {
    held: Arc<Held>,
    id: String,
    _done: watch::Sender<()>,
}

impl InFlight {
    /// Register `id`'s call; `None` when one is already registered.
    pub(crate) fn claim(held: &Arc<Held>, id: &str) -> Option<Self> {
        let mut map = held.in_flight.lock().unwrap_or_else(|e| e.into_inner());
        if map.contains_key(id) {
            return None;
        }
        let (tx, rx) = watch::channel(());
        map.insert(id.to_owned(), rx);
        Some(Self {
            held: held.clone(),
            id: id.to_owned(),
            _done: tx,
        })
    }
}

impl Drop for InFlight {
    fn drop(&mut self) {
        let mut map = self
            .held
            .in_flight
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        map.remove(&self.id);
    }
}

/// This delivery's entry in [`Held`]'s cancellation tokens; dropping it unregisters it.
pub(crate) struct CancelGuard {
    held: Arc<Held>,
    id: String,
    pub(crate) token: CancellationToken,
}

impl CancelGuard {
    pub(crate) fn register(held: &Arc<Held>, id: &str) -> Self {
        let mut map = held.cancels.lock().unwrap_or_else(|e| e.into_inner());
        let entry = map
            .entry(id.to_owned())
            .or_insert_with(|| (CancellationToken::new(), 0));
        entry.1 += 1;
        let token = entry.0.clone();
        drop(map);
        Self {
            held: held.clone(),
            id: id.to_owned(),
            token,
        }
    }
}

impl Drop for CancelGuard {
    fn drop(&mut self) {
        let mut map = self.held.cancels.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = map.get_mut(&self.id) {
            entry.1 -= 1;
            if entry.1 == 0 {
                map.remove(&self.id);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_job_is_held_while_any_of_its_deliveries_is_and_a_call_is_claimed_once() {
        let held = Arc::new(Held::default());
        let a = CancelGuard::register(&held, "j");
        let b = CancelGuard::register(&held, "j");
        assert!(held.holds("j"));
        assert_eq!(held.held_ids(), ["j"]);
        held.cancel_local("j");
        assert!(
            a.token.is_cancelled() && b.token.is_cancelled(),
            "one token per job"
        );
        drop(a);
        assert!(held.holds("j"), "still held by the second delivery");
        drop(b);
        assert!(!held.holds("j") && held.held_ids().is_empty());
        held.cancel_local("j"); // not held: nothing to do

        let call = InFlight::claim(&held, "j").expect("first claim");
        assert!(InFlight::claim(&held, "j").is_none(), "claimed once");
        let rx = held.running("j").expect("running here");
        drop(call);
        assert!(held.running("j").is_none());
        assert!(rx.has_changed().is_err(), "the waiter sees the call settle");
    }
}
