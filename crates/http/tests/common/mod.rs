//! Shared set-up: a real RabbitMQ with a fresh prefix per test and a fresh SQLite ledger;
//! the router called without a socket (`tower::ServiceExt::oneshot`) or served for real.
#![allow(dead_code)]

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use lastcall_backend::sim::{SimBackend, SimConfig};
use lastcall_broker::{Broker, Publisher, Topology};
use lastcall_clock::{SystemClock, now_ms};
use lastcall_core::{AdmissionPolicy, EnvelopeLimits};
use lastcall_http::{AppState, Token};
use lastcall_producer::Submitter;
use lastcall_store::Ledger;
use lastcall_worker::{Worker, WorkerConfig, WorkerStats};
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;
use tokio_util::sync::CancellationToken;
use tower::ServiceExt;

pub const AMQP: &str = "amqp://guest:guest@127.0.0.1:5672/%2f";
pub const TOKEN: &str = "test-token-0123456789";

pub fn unique(name: &str) -> String {
    static N: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    format!(
        "t-http-{name}-{}-{}-{n}",
        std::process::id(),
        now_ms() % 1_000_000
    )
}

pub struct Env {
    pub prefix: String,
    pub topo: Topology,
    pub broker: Broker,
    pub ledger: Arc<Ledger>,
    pub dir: PathBuf,
}

impl Env {
    pub async fn new(name: &str) -> Env {
        Self::with_topology(name, |_| {}).await
    }

    /// A fresh environment whose topology `edit` changes before it is declared.
    pub async fn with_topology(name: &str, edit: impl FnOnce(&mut Topology)) -> Env {
        let prefix = unique(name);
        let dir = std::env::temp_dir().join(&prefix);
        std::fs::create_dir_all(&dir).unwrap();
        let store_url = format!("sqlite://{}", dir.join("ledger.db").display());
        let broker = Broker::connect(AMQP)
            .await
            .expect("RabbitMQ must be running on 127.0.0.1:5672 (guest/guest)");
        let mut topo = Topology::new(&prefix);
        topo.retry_delays_ms = vec![1_000];
        edit(&mut topo);
        topo.apply(&broker).await.unwrap();
        let ledger = Arc::new(Ledger::connect(&store_url).await.unwrap());
        Env {
            prefix,
            topo,
            broker,
            ledger,
            dir,
        }
    }

    pub async fn submitter(&self, confirm_timeout: Duration) -> Submitter {
        let publisher = Publisher::new(&self.broker, confirm_timeout).await.unwrap();
        Submitter::new(
            publisher,
            self.topo.names.clone(),
            Some(self.ledger.clone()),
            AdmissionPolicy {
                clock_uncertainty_ms: 100,
                default_min_runtime_ms: 0,
            },
            EnvelopeLimits::default(),
        )
    }

    pub async fn state_with(&self, confirm_timeout: Duration) -> AppState {
        AppState::new(
            self.submitter(confirm_timeout).await,
            self.ledger.clone(),
            Arc::new(SystemClock::default()),
            Token::new(TOKEN).unwrap(),
            self.topo.names.clone(),
        )
    }

    pub async fn app(&self) -> Router {
        lastcall_http::app(Arc::new(self.state_with(Duration::from_secs(5)).await))
    }

    /// A worker in this process with the sim backend; stop it with the token.
    pub async fn start_worker(
        &self,
        slots: usize,
        latency_ms: u64,
    ) -> (
        CancellationToken,
        tokio::task::JoinHandle<()>,
        Arc<WorkerStats>,
    ) {
        let mut cfg = WorkerConfig::new(&self.prefix, slots);
        cfg.topology = self.topo.clone();
        cfg.prefetch = (slots * 4) as u16;
        cfg.name = "http-test-worker".into();
        cfg.shutdown_grace = Duration::from_secs(3);
        let stats = Arc::new(WorkerStats::default());
        let sim = Arc::new(
            SimBackend::new(SimConfig {
                latency_ms,
                faults: true,
                ..SimConfig::default()
            })
            .unwrap(),
        );
        let w = Worker::build(
            cfg,
            Broker::connect(AMQP).await.unwrap(),
            self.ledger.clone(),
            sim,
            Arc::new(SystemClock::default()),
            stats.clone(),
        )
        .await
        .unwrap();
        let stop = CancellationToken::new();
        let s2 = stop.clone();
        let h = tokio::spawn(async move { w.run(s2).await.unwrap() });
        (stop, h, stats)
    }

    /// Run the dead-letter processor until the dead queue was idle for 1.5 s.
    pub async fn drain_dead_letters(&self) -> Arc<lastcall_worker::dlq::DlqStats> {
        let broker = Broker::connect(AMQP).await.unwrap();
        let dlq = lastcall_worker::dlq::DeadLetterProcessor::build(
            broker.clone(),
            self.ledger.clone(),
            self.topo.clone(),
            Arc::new(SystemClock::default()),
            false,
        )
        .await
        .unwrap();
        let stats = dlq.stats.clone();
        dlq.run(CancellationToken::new(), Some(Duration::from_millis(1_500)))
            .await
            .unwrap();
        broker.close().await;
        stats
    }

    /// Wait until the ledger holds no `accepted`/`running` job.
    pub async fn wait_settled(&self, timeout: Duration) {
        let until = std::time::Instant::now() + timeout;
        loop {
            let counts = self.ledger.counts_by_state().await.unwrap();
            if !counts
                .iter()
                .any(|(s, n)| (s == "accepted" || s == "running") && *n > 0)
            {
                return;
            }
            assert!(
                std::time::Instant::now() < until,
                "jobs still open: {counts:?}"
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Ready messages in `queue` (0 if it does not exist).
    /// Poll the ready count of `queue` until it is `n` (e.g. messages the broker expired
    /// into the dead-letter queue); panics after 30 s with the count last seen.
    pub async fn wait_ready(&self, queue: &str, n: u32) {
        let until = std::time::Instant::now() + Duration::from_secs(30);
        loop {
            let got = self.ready(queue).await;
            if got == n {
                return;
            }
            assert!(
                std::time::Instant::now() < until,
                "queue {queue} holds {got} ready messages, expected {n}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    pub async fn ready(&self, queue: &str) -> u32 {
        lastcall_broker::topology::queue_depth(&self.broker, queue)
            .await
            .unwrap()
            .map(|(m, _)| m)
            .unwrap_or(0)
    }

    pub async fn cleanup(self) {
        self.topo.delete(&self.broker).await.unwrap();
        self.broker.close().await;
        self.ledger.close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One request through the router, without a socket. Returns the status and the body
/// (JSON if it parses, else a JSON string).
pub async fn call(
    app: &Router,
    method: &str,
    uri: &str,
    token: Option<&str>,
    body: Option<Vec<u8>>,
) -> (StatusCode, Value) {
    let mut req = Request::builder().method(method).uri(uri);
    if let Some(t) = token {
        req = req.header("authorization", format!("Bearer {t}"));
    }
    if body.is_some() {
        req = req.header("content-type", "application/json");
    }
    let req = req.body(Body::from(body.unwrap_or_default())).unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    let status = resp.status();
    let bytes = axum::body::to_bytes(resp.into_body(), usize::MAX)
        .await
        .unwrap();
    let v = serde_json::from_slice(&bytes)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&bytes).into_owned()));
    (status, v)
}

pub async fn post(app: &Router, body: &Value) -> (StatusCode, Value) {
    call(
        app,
        "POST",
        "/v1/jobs",
        Some(TOKEN),
        Some(serde_json::to_vec(body).unwrap()),
    )
    .await
}
