//! A streaming call's token deltas, from the backend to the job's `reply_to`: the glue
//! between [`lastcall_backend::Deltas`] (what a backend sends), the v1 body
//! ([`lastcall_core::delta::Delta`]) and the worker's bounded, best-effort
//! [`lastcall_broker::DeltaSink`]. Nothing here waits: a delta that cannot be queued is
//! dropped and the job's remaining deltas with it (the reader takes the rest from the
//! ledger).

use lastcall_backend::Deltas;
use lastcall_broker::{DeltaSink, DeltaTarget};
use lastcall_core::delta::{DELTA_VERSION, Delta};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// One call's stream: numbers the deltas of one attempt and ends them.
#[derive(Debug, Clone)]
pub struct CallStream {
    target: DeltaTarget,
    job_id: String,
    attempt: u32,
    seq: Arc<AtomicU64>,
}

impl CallStream {
    pub fn new(sink: &DeltaSink, reply_to: &str, job_id: &str, attempt: u32) -> Self {
        Self {
            target: sink.target(reply_to, job_id),
            job_id: job_id.to_owned(),
            attempt,
            seq: Arc::new(AtomicU64::new(0)),
        }
    }

    fn send(&self, text: &str, end: bool) -> bool {
        if self.target.is_gone() {
            return false;
        }
        let d = Delta {
            v: DELTA_VERSION,
            job_id: self.job_id.clone(),
            attempt: self.attempt,
            seq: self.seq.fetch_add(1, Ordering::Relaxed),
            text: text.to_owned(),
            end,
        };
        self.target.send(d.to_json())
    }

    /// What the backend sends to.
    pub fn deltas(&self) -> Deltas {
        let me = self.clone();
        Deltas::new(move |text| me.send(text, false))
    }

    /// The call is over (whatever its outcome): the end marker, so that the reader knows
    /// it has every delta that was sent.
    pub fn end(&self) {
        self.send("", true);
    }
}
