//! A worker whose kinds are routed to several backends: each call is recorded and learned
//! under the backend that served it (the ledger's `backend`), not under the router.

use crate::common;

use common::*;
use lastcall_backend::Backend;
use lastcall_backend::route::{Route, RouteTable, RoutedBackend};
use lastcall_worker::clock::now_ms;
use std::sync::Arc;
use std::time::Duration;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_call_is_recorded_under_the_backend_that_served_it() {
    let env = Env::sqlite("routing-backend").await;
    let table = RouteTable {
        default: Some("general".into()),
        routes: vec![Route {
            kind: "code.*".into(),
            backend: "code".into(),
            model: None,
            max_tokens: None,
        }],
    };
    let router = RoutedBackend::new(
        table,
        [
            ("general".to_string(), sim(10) as Arc<dyn Backend>),
            ("code".to_string(), sim(10) as Arc<dyn Backend>),
        ],
    )
    .unwrap();
    let w = env
        .start_worker(env.worker_config(2, 4), Arc::new(router), system_clock())
        .await;
    let s = env.submitter(100, true).await;
    let mut code = job("to-code", 30_000);
    code.kind = "code.review".into();
    s.submit(&code, now_ms()).await.unwrap();
    s.submit(&job("to-general", 30_000), now_ms())
        .await
        .unwrap();
    let recs = env
        .wait_terminal(
            &["to-code".into(), "to-general".into()],
            Duration::from_secs(30),
        )
        .await;
    let backend = |id: &str| {
        let r = recs.iter().find(|r| r.job_id == id).unwrap();
        assert_eq!(r.state, "completed", "{r:?}");
        r.backend.clone()
    };
    assert_eq!(backend("to-code").as_deref(), Some("code"));
    assert_eq!(backend("to-general").as_deref(), Some("general"));
    // A worker started now learns each kind from its own backend's calls.
    let calls = env.ledger.recent_calls("code", 0, 100).await.unwrap();
    assert_eq!(calls.len(), 1, "{calls:?}");
    assert_eq!(calls[0].kind, "code.review");
    w.stop().await;
    env.cleanup().await;
}
