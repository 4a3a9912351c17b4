//! Shared set-up: a real RabbitMQ with a fresh prefix per test and a fresh SQLite ledger;
//! the router called without a socket (`tower::ServiceExt::oneshot`) or served for real.
#![allow(dead_code)]

use axum::Router;
use axum::body::Body;
use axum::http::{Request, StatusCode};
use lastcall_broker::{Broker, Publisher, Topology};
use lastcall_clock::{SystemClock, now_ms};
use lastcall_core::{AdmissionPolicy, EnvelopeLimits};
use lastcall_http::{AppState, Token};
use lastcall_producer::Submitter;
use lastcall_store::Ledger;
use serde_json::Value;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::Mutex;
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

    /// Ready messages in `queue` (0 if it does not exist).
    pub async fn ready(&self, queue: &str) -> u32 {
        lastcall_broker::topology::queue_depth(&self.broker, queue)
            .await
            .unwrap()
            .map(|(m, _)| m)
            .unwrap_or(0)
    }

    /// The messages ready in the work queue and every lane.
    pub async fn ready_all(&self) -> u32 {
        let mut n = 0;
        for q in self.topo.names.lane_queues() {
            n += self.ready(&q).await;
        }
        n
    }

    /// A plain consumer of the work queue (no worker, no ledger writes) that acks one
    /// delivery every `pace`: the sleep paces it on purpose, so the broker measures an ack
    /// rate of about `1 / pace`. Stop it with the token.
    pub async fn paced_consumer(&self, pace: Duration) -> PacedConsumer {
        let mut stream = lastcall_broker::IncomingStream::open(
            &self.broker,
            &self.topo.names.work_queue,
            1,
            "paced-consumer",
        )
        .await
        .unwrap();
        let stop = CancellationToken::new();
        let seen = Arc::new(Mutex::new(Vec::new()));
        let handle = tokio::spawn({
            let (stop, seen) = (stop.clone(), seen.clone());
            async move {
                loop {
                    let msg = tokio::select! {
                        () = stop.cancelled() => break,
                        msg = stream.next() => msg,
                    };
                    let msg = msg.expect("the consumer was cancelled").unwrap();
                    tokio::time::sleep(pace).await;
                    msg.settler.ack().await.unwrap();
                    seen.lock()
                        .unwrap()
                        .push(msg.message_id.unwrap_or_default());
                }
                stream.close().await;
            }
        });
        PacedConsumer { stop, handle, seen }
    }

    /// Take the next message off the work queue with a plain consumer and ack it (the
    /// space a worker would make); returns its job id.
    pub async fn take_one(&self) -> String {
        let mut stream = lastcall_broker::IncomingStream::open(
            &self.broker,
            &self.topo.names.work_queue,
            1,
            "take-one",
        )
        .await
        .unwrap();
        let msg = tokio::time::timeout(Duration::from_secs(10), stream.next())
            .await
            .expect("a message in the work queue")
            .unwrap()
            .unwrap();
        msg.settler.ack().await.unwrap();
        stream.close().await;
        msg.message_id.unwrap_or_default()
    }

    pub async fn cleanup(self) {
        self.topo.delete(&self.broker).await.unwrap();
        self.broker.close().await;
        self.ledger.close().await;
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A running [`Env::paced_consumer`].
pub struct PacedConsumer {
    pub stop: CancellationToken,
    pub handle: tokio::task::JoinHandle<()>,
    /// The job ids (`message_id`) it acked, in order.
    pub seen: Arc<Mutex<Vec<String>>>,
}

impl PacedConsumer {
    /// Whether it has acked `id`.
    pub fn has_seen(&self, id: &str) -> bool {
        self.seen.lock().unwrap().iter().any(|s| s == id)
    }

    pub async fn stop(self) -> Vec<String> {
        self.stop.cancel();
        self.handle.await.unwrap();
        Arc::try_unwrap(self.seen).unwrap().into_inner().unwrap()
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
