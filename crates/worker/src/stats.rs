//! Live counters and gauges of a worker. Read by the CLI (progress, summaries) and by the
//! metrics endpoint. No job ids here: only bounded, aggregate numbers.

use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Counters and gauges of one worker process.
#[derive(Debug, Default)]
pub struct WorkerStats {
    /// Deliveries received from the broker.
    pub received: AtomicU64,
    /// Jobs waiting locally for a model slot (gauge).
    pub waiting: AtomicI64,
    /// Model calls in progress (gauge).
    pub running: AtomicI64,
    /// Bytes of message bodies held locally (gauge).
    pub buffered_bytes: AtomicI64,
    /// Model calls started.
    pub backend_calls: AtomicU64,
    /// Terminal outcomes recorded by this worker, by state.
    pub completed: AtomicU64,
    pub failed: AtomicU64,
    pub expired_not_started: AtomicU64,
    pub deadline_exceeded: AtomicU64,
    pub rejected: AtomicU64,
    /// Redeliveries acked without running because the outcome already existed.
    pub duplicates: AtomicU64,
    /// Retries published.
    pub retries: AtomicU64,
    /// Ledger write attempts that failed and were retried.
    pub store_retries: AtomicU64,
    /// Deliveries settled with the broker (ack or reject).
    pub settled: AtomicU64,
}

impl WorkerStats {
    pub fn get(c: &AtomicU64) -> u64 {
        c.load(Ordering::Relaxed)
    }

    pub(crate) fn inc(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn add(g: &AtomicI64, d: i64) {
        g.fetch_add(d, Ordering::Relaxed);
    }

    pub(crate) fn count_state(&self, state: &str) {
        let c = match state {
            "completed" => &self.completed,
            "failed" => &self.failed,
            "expired_not_started" => &self.expired_not_started,
            "deadline_exceeded" => &self.deadline_exceeded,
            "rejected" => &self.rejected,
            _ => return,
        };
        Self::inc(c);
    }
}
