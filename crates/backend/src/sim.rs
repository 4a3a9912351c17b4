//! The simulated backend: a load generator for tests and benchmarks, never a stand-in for
//! a real model in production. It counts every call it receives, which is how tests prove
//! that expired jobs cause zero model calls.
//!
//! Behaviour per call, from the flags and, for tests, from the job itself:
//! - latency `latency_ms ± jitter_ms`, or the payload's `sim_latency_ms` when set;
//! - failure with probability `fail_rate` (retryable `sim_503`);
//! - only with [`SimConfig::faults`] on (`lastcall worker --backend sim --sim-faults`):
//!   kind `sim.fail-terminal` fails with terminal `sim_400`, kind `sim.fail-retryable`
//!   with retryable `sim_503`, and kind `sim.crash` aborts the whole process (a poison
//!   job, for crash-loop tests). Off, these kinds are simulated like any other, so a
//!   producer cannot crash a worker by naming a kind.

use crate::{
    Backend, BackendError, CallFuture, CallOutput, CallRequest, CancellationToken, Deltas, Usage,
};
use rand::Rng;
use std::collections::HashMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// Settings of the simulated backend.
#[derive(Debug, Clone, Default)]
pub struct SimConfig {
    pub latency_ms: u64,
    pub jitter_ms: u64,
    /// Probability in `[0, 1]` that a call fails with a retryable error.
    pub fail_rate: f64,
    /// Append one line per call (`job_id attempt`) to this file, flushed before the call
    /// proceeds, so a test can count calls across worker crashes.
    pub call_log: Option<PathBuf>,
    /// Honour the fault kinds (`sim.crash`, `sim.fail-terminal`, `sim.fail-retryable`).
    /// Off by default: only a test or drill that asks for them gets them.
    pub faults: bool,
}

/// The simulated backend.
#[derive(Debug)]
pub struct SimBackend {
    cfg: SimConfig,
    calls: AtomicU64,
    per_job: Mutex<HashMap<String, u64>>,
    log: Option<Mutex<std::fs::File>>,
}

impl SimBackend {
    pub fn new(cfg: SimConfig) -> std::io::Result<Self> {
        let log = match &cfg.call_log {
            Some(p) => Some(Mutex::new(
                std::fs::OpenOptions::new()
                    .create(true)
                    .append(true)
                    .open(p)?,
            )),
            None => None,
        };
        Ok(Self {
            cfg,
            calls: AtomicU64::new(0),
            per_job: Mutex::new(HashMap::new()),
            log,
        })
    }

    /// Calls received so far, over all jobs.
    pub fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    /// Calls received so far for one job.
    pub fn calls_for(&self, job_id: &str) -> u64 {
        self.per_job
            .lock()
            .expect("poisoned")
            .get(job_id)
            .copied()
            .unwrap_or(0)
    }

    fn count(&self, req: &CallRequest) {
        self.calls.fetch_add(1, Ordering::SeqCst);
        *self
            .per_job
            .lock()
            .expect("poisoned")
            .entry(req.job_id.clone())
            .or_default() += 1;
        if let Some(log) = &self.log {
            let mut f = log.lock().expect("poisoned");
            let _ = writeln!(f, "{} {}", req.job_id, req.attempt);
            let _ = f.flush();
            let _ = f.sync_data();
        }
    }

    fn latency(&self, req: &CallRequest) -> Duration {
        if let Some(ms) = req.payload.get("sim_latency_ms").and_then(|v| v.as_u64()) {
            return Duration::from_millis(ms);
        }
        let jitter = if self.cfg.jitter_ms > 0 {
            rand::rng().random_range(0..=2 * self.cfg.jitter_ms) as i64 - self.cfg.jitter_ms as i64
        } else {
            0
        };
        Duration::from_millis((self.cfg.latency_ms as i64 + jitter).max(0) as u64)
    }
}

impl Backend for SimBackend {
    fn name(&self) -> &str {
        "sim"
    }

    fn call(&self, req: CallRequest, cancel: CancellationToken) -> CallFuture<'_> {
        Box::pin(self.run(req, cancel, None))
    }

    /// The text in a few word-sized deltas spread evenly over the latency.
    fn call_streaming(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Deltas,
    ) -> CallFuture<'_> {
        Box::pin(self.run(req, cancel, Some(deltas)))
    }
}

impl SimBackend {
    async fn run(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        mut deltas: Option<Deltas>,
    ) -> Result<CallOutput, BackendError> {
        self.count(&req);
        let fault_kind = if self.cfg.faults {
            req.kind.as_str()
        } else {
            ""
        };
        match fault_kind {
            "sim.crash" => {
                tracing::error!(job_id = %req.job_id, "sim.crash job: aborting the worker process");
                std::process::abort();
            }
            "sim.fail-terminal" => {
                return Err(BackendError::Terminal {
                    reason: "sim_400".into(),
                    message: "simulated bad request".into(),
                });
            }
            "sim.fail-retryable" => {
                return Err(BackendError::Retryable {
                    reason: "sim_503".into(),
                    message: "simulated overload".into(),
                    retry_after: None,
                });
            }
            _ => {}
        }
        let latency = self.latency(&req);
        let text = format!(
            "sim output for {} after {} ms",
            req.job_id,
            latency.as_millis()
        );
        let pieces: Vec<&str> = if deltas.is_some() {
            text.split_inclusive(' ').collect()
        } else {
            vec![text.as_str()]
        };
        let step = latency / pieces.len() as u32;
        for piece in &pieces {
            tokio::select! {
                _ = cancel.cancelled() => return Err(BackendError::Cancelled { confirmed: true }),
                _ = tokio::time::sleep(step) => {}
            }
            if let Some(d) = &deltas
                && !d.send(piece)
            {
                deltas = None;
            }
        }
        if self.cfg.fail_rate > 0.0 && rand::rng().random_bool(self.cfg.fail_rate.clamp(0.0, 1.0)) {
            return Err(BackendError::Retryable {
                reason: "sim_503".into(),
                message: "simulated failure".into(),
                retry_after: None,
            });
        }
        Ok(CallOutput {
            text,
            // No tokenizer here: the prompt counted by the documented approximation, as a
            // worker measures it (a fixed count would tell the estimator every prompt is
            // the same size).
            usage: Some(Usage {
                prompt_tokens: crate::RequestSize::of_payload(&req.payload)
                    .map_or(0, |s| s.prompt_tokens),
                completion_tokens: 8,
            }),
            model: Some("sim".into()),
            tokens_per_second: None,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::{Map, json};

    fn req(kind: &str, payload: serde_json::Value) -> CallRequest {
        CallRequest {
            job_id: "j1".into(),
            kind: kind.into(),
            attempt: 0,
            payload: payload.as_object().cloned().unwrap_or_else(Map::new),
            timeout: Duration::from_secs(5),
            priority: lastcall_core::Priority::Standard,
        }
    }

    #[tokio::test]
    async fn counts_calls_and_honours_cancellation() {
        let dir = std::env::temp_dir().join(format!("lastcall-sim-{}", std::process::id()));
        let b = SimBackend::new(SimConfig {
            latency_ms: 10_000,
            call_log: Some(dir.clone()),
            faults: true,
            ..SimConfig::default()
        })
        .unwrap();
        let cancel = CancellationToken::new();
        let c2 = cancel.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(20)).await;
            c2.cancel();
        });
        let r = b.call(req("chat", json!({})), cancel).await;
        assert_eq!(r, Err(BackendError::Cancelled { confirmed: true }));
        let ok = b
            .call(
                req("chat", json!({"sim_latency_ms": 1})),
                CancellationToken::new(),
            )
            .await
            .unwrap();
        assert!(ok.text.contains("j1"));
        assert!(
            b.call(
                req("sim.fail-terminal", json!({})),
                CancellationToken::new()
            )
            .await
            .unwrap_err()
            .reason()
                == "sim_400"
        );
        assert!(
            b.call(
                req("sim.fail-retryable", json!({})),
                CancellationToken::new()
            )
            .await
            .unwrap_err()
            .is_retryable()
        );
        assert_eq!(b.calls(), 4);
        assert_eq!(b.calls_for("j1"), 4);
        // Without `faults`, a fault kind is simulated like any other kind.
        let plain = SimBackend::new(SimConfig::default()).unwrap();
        for kind in ["sim.fail-terminal", "sim.fail-retryable", "sim.crash"] {
            let out = plain
                .call(req(kind, json!({})), CancellationToken::new())
                .await
                .unwrap();
            assert!(out.text.contains("j1"), "{kind}");
        }
        assert_eq!(std::fs::read_to_string(&dir).unwrap().lines().count(), 4);
        let _ = std::fs::remove_file(dir);
    }

    #[tokio::test]
    async fn streams_its_text_in_a_few_deltas() {
        let b = SimBackend::new(SimConfig::default()).unwrap();
        let got = std::sync::Arc::new(Mutex::new(Vec::<String>::new()));
        let g = got.clone();
        let deltas = Deltas::new(move |t| {
            g.lock().unwrap().push(t.to_owned());
            true
        });
        let out = b
            .call_streaming(
                req("chat", json!({"sim_latency_ms": 20})),
                CancellationToken::new(),
                deltas,
            )
            .await
            .unwrap();
        let got = got.lock().unwrap();
        assert!(got.len() > 3, "{got:?}");
        assert_eq!(got.concat(), out.text);
    }
}
