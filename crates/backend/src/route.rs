//! Routing jobs to backends by kind.
//!
//! A [`RouteTable`] is configuration (it deserializes from the `lastcall.toml` shape
//! below); a [`RoutedBackend`] is a [`Backend`] that sends each call to the backend its
//! kind routes to.
//!
//! ```toml
//! default = "sim"                # kinds no route matches; leave out to refuse them
//!
//! [[routes]]
//! kind = "incident.summary"      # exact kind
//! backend = "openai"
//! model = "smollm2"              # optional: the model this route asks the backend for
//!
//! [[routes]]
//! kind = "code.*"                # every kind that starts with `code.`
//! backend = "openai"
//!
//! [[routes]]
//! kind = "summarize"
//! backend = ["vllm", "hosted"]   # a fallback route: the first that can take the job
//! ```
//!
//! Lookup order: the exact kind, then the longest matching `prefix.*` pattern, then
//! `default`. A kind that matches nothing without a default fails the call with the
//! terminal reason `no_route` (retrying cannot help; the configuration must change).
//!
//! A route (or the default) may name an ordered list of backends. Which one serves a job is
//! the worker's choice ([`lastcall_core::fallback`]): it calls that one with
//! [`Backend::call_on`]; a plain [`Backend::call`] goes to the first.

use crate::{Backend, BackendError, CallFuture, CallRequest, CancellationToken};
use serde::Deserialize;
use serde_json::Value;
use std::collections::HashMap;
use std::sync::Arc;

/// Which backend (and model) serves which job kinds.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct RouteTable {
    /// The backend for kinds that no route matches. `None`: such kinds fail with
    /// `no_route`.
    #[serde(default)]
    pub default: Option<Backends>,
    #[serde(default)]
    pub routes: Vec<Route>,
}

/// The backends of a route, in the order they are tried: one name (`backend = "openai"`)
/// or a fallback list (`backend = ["vllm", "hosted"]`).
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(from = "OneOrMany")]
pub struct Backends(Vec<String>);

#[derive(Deserialize)]
#[serde(untagged)]
enum OneOrMany {
    One(String),
    Many(Vec<String>),
}

impl From<OneOrMany> for Backends {
    fn from(v: OneOrMany) -> Self {
        match v {
            OneOrMany::One(s) => Self(vec![s]),
            OneOrMany::Many(v) => Self(v),
        }
    }
}

impl From<&str> for Backends {
    fn from(s: &str) -> Self {
        Self(vec![s.to_owned()])
    }
}

impl<S: Into<String>> FromIterator<S> for Backends {
    fn from_iter<I: IntoIterator<Item = S>>(iter: I) -> Self {
        Self(iter.into_iter().map(Into::into).collect())
    }
}

impl Backends {
    /// The names in order (a validated table has at least one).
    pub fn names(&self) -> &[String] {
        &self.0
    }

    /// The first backend: the one a job goes to while it can take it.
    pub fn first(&self) -> Option<&str> {
        self.0.first().map(String::as_str)
    }

    /// Whether `name` is one of them.
    pub fn contains(&self, name: &str) -> bool {
        self.0.iter().any(|b| b == name)
    }

    /// Empty, a blank name, or a name twice: `Err` says which.
    fn check(&self) -> Result<(), String> {
        if self.0.is_empty() {
            return Err("an empty backend list".into());
        }
        for (i, b) in self.0.iter().enumerate() {
            if b.trim().is_empty() {
                return Err("an empty backend name".into());
            }
            if self.0[..i].contains(b) {
                return Err(format!("backend {b:?} twice"));
            }
        }
        Ok(())
    }
}

/// One `[[routes]]` entry.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Route {
    /// An exact kind (`incident.summary`) or a prefix pattern (`code.*`, matching every
    /// kind that starts with `code.`).
    pub kind: String,
    /// The names backends are registered under in the [`RoutedBackend`]: one, or an ordered
    /// fallback list.
    pub backend: Backends,
    /// The model to ask for. It replaces the payload's `model`: which model serves a kind
    /// is the operator's choice, not the producer's.
    #[serde(default)]
    pub model: Option<String>,
    /// The most `max_tokens` a job of this route may ask for: a larger (or absent) value
    /// in the payload becomes this one before the call.
    #[serde(default)]
    pub max_tokens: Option<u32>,
}

impl Route {
    fn resolved(&self) -> Resolved<'_> {
        Resolved {
            backends: &self.backend,
            model: self.model.as_deref(),
            max_tokens: self.max_tokens,
            pattern: Some(&self.kind),
        }
    }
}

/// Where a kind goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resolved<'a> {
    /// The backends in the order they are tried (at least one in a validated table).
    pub backends: &'a Backends,
    pub model: Option<&'a str>,
    /// The route's cap on `max_tokens`.
    pub max_tokens: Option<u32>,
    /// The pattern that matched (`code.*`), or `None` for the default.
    pub pattern: Option<&'a str>,
}

/// A route table that cannot be used.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RouteError {
    #[error("route pattern {0:?} is invalid: use an exact kind or `prefix.*`")]
    BadPattern(String),
    #[error("kind pattern {0:?} is routed twice")]
    Duplicate(String),
    #[error(
        "route for {kind:?} lists {problem}: give one backend name or a list of distinct names"
    )]
    BadBackends { kind: String, problem: String },
    #[error("the default backend list has {0}: give one backend name or a list of distinct names")]
    BadDefault(String),
    #[error("route for {kind:?} names backend {backend:?}, which is not configured")]
    UnknownBackend { kind: String, backend: String },
    #[error("the default backend {0:?} is not configured")]
    UnknownDefault(String),
}

impl RouteTable {
    /// Checks the patterns: an exact kind, or a non-empty prefix followed by `.*`; `*`
    /// nowhere else (`default` is the catch-all); each pattern once.
    pub fn validate(&self) -> Result<(), RouteError> {
        let mut seen = std::collections::HashSet::new();
        for r in &self.routes {
            let body = r.kind.strip_suffix(".*").unwrap_or(&r.kind);
            if body.is_empty() || body.contains('*') {
                return Err(RouteError::BadPattern(r.kind.clone()));
            }
            if !seen.insert(r.kind.as_str()) {
                return Err(RouteError::Duplicate(r.kind.clone()));
            }
            r.backend
                .check()
                .map_err(|problem| RouteError::BadBackends {
                    kind: r.kind.clone(),
                    problem,
                })?;
        }
        if let Some(d) = &self.default {
            d.check().map_err(RouteError::BadDefault)?;
        }
        Ok(())
    }

    /// The route of `kind`: exact match, else the longest `prefix.*` match, else the
    /// default; `None` when nothing matches and there is no default.
    pub fn resolve(&self, kind: &str) -> Option<Resolved<'_>> {
        if let Some(r) = self.routes.iter().find(|r| r.kind == kind) {
            return Some(r.resolved());
        }
        let prefix_match = self
            .routes
            .iter()
            .filter_map(|r| {
                // `code.*` matches `code.review`: the prefix keeps its dot.
                let prefix = r.kind.strip_suffix('*')?;
                (prefix.ends_with('.') && kind.starts_with(prefix) && kind.len() > prefix.len())
                    .then_some((prefix.len(), r))
            })
            .max_by_key(|(len, _)| *len);
        if let Some((_, r)) = prefix_match {
            return Some(r.resolved());
        }
        self.default.as_ref().map(|backends| Resolved {
            backends,
            model: None,
            max_tokens: None,
            pattern: None,
        })
    }

    /// Every backend name the table refers to, with the pattern that refers to it.
    fn references(&self) -> impl Iterator<Item = (&str, &str)> {
        (self.routes.iter())
            .flat_map(|r| (r.backend.0.iter()).map(|b| (r.kind.as_str(), b.as_str())))
    }

    /// Whether any route, or the default, names `backend`.
    pub fn uses(&self, backend: &str) -> bool {
        self.references().any(|(_, b)| b == backend)
            || self.default.as_ref().is_some_and(|d| d.contains(backend))
    }
}

/// A [`Backend`] that dispatches each call by its kind to a registered backend.
pub struct RoutedBackend {
    table: RouteTable,
    backends: HashMap<String, Arc<dyn Backend>>,
}

impl std::fmt::Debug for RoutedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut names: Vec<_> = self.backends.keys().collect();
        names.sort();
        f.debug_struct("RoutedBackend")
            .field("table", &self.table)
            .field("backends", &names)
            .finish()
    }
}

impl RoutedBackend {
    /// Builds the router from a validated table and the backends by name. Every backend
    /// the table names must be among them (a typo fails at startup, not on the first job
    /// of that kind); backends the table never names are allowed.
    pub fn new(
        table: RouteTable,
        backends: impl IntoIterator<Item = (String, Arc<dyn Backend>)>,
    ) -> Result<Self, RouteError> {
        table.validate()?;
        let backends: HashMap<_, _> = backends.into_iter().collect();
        if let Some((kind, backend)) = table.references().find(|(_, b)| !backends.contains_key(*b))
        {
            return Err(RouteError::UnknownBackend {
                kind: kind.to_string(),
                backend: backend.to_string(),
            });
        }
        if let Some(d) = &table.default
            && let Some(missing) = d.0.iter().find(|b| !backends.contains_key(*b))
        {
            return Err(RouteError::UnknownDefault(missing.clone()));
        }
        Ok(Self { table, backends })
    }

    pub fn table(&self) -> &RouteTable {
        &self.table
    }

    /// The (first) backend that calls of `kind` go to, by its registered name.
    pub fn backend_for(&self, kind: &str) -> Option<&str> {
        self.table.resolve(kind).and_then(|r| r.backends.first())
    }
}

impl Backend for RoutedBackend {
    fn name(&self) -> &str {
        "routed"
    }

    fn route_of(&self, kind: &str) -> Option<&str> {
        self.backend_for(kind)
    }

    fn routes_of(&self, kind: &str) -> Vec<&str> {
        match self.table.resolve(kind) {
            Some(r) => r.backends.0.iter().map(String::as_str).collect(),
            None => vec![self.name()],
        }
    }

    fn request_size(
        &self,
        kind: &str,
        payload: &serde_json::Map<String, serde_json::Value>,
    ) -> Option<lastcall_core::request_size::RequestSize> {
        match self.route_of(kind).and_then(|name| self.backends.get(name)) {
            Some(b) => b.request_size(kind, payload),
            None => lastcall_core::request_size::RequestSize::of_payload(payload),
        }
    }

    fn counts_prompt_tokens(&self, kind: &str) -> bool {
        (self.route_of(kind).and_then(|name| self.backends.get(name)))
            .is_some_and(|b| b.counts_prompt_tokens(kind))
    }

    fn serving_names(&self) -> Vec<&str> {
        let mut names: Vec<&str> = self.backends.keys().map(String::as_str).collect();
        names.sort_unstable();
        names
    }

    fn call(&self, req: CallRequest, cancel: CancellationToken) -> CallFuture<'_> {
        self.routed(None, req, cancel, None, None)
    }

    fn call_streaming(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: crate::Deltas,
    ) -> CallFuture<'_> {
        self.routed(None, req, cancel, Some(deltas), None)
    }

    fn call_with(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<crate::Deltas>,
        limits: Option<crate::LimitSink>,
    ) -> CallFuture<'_> {
        self.routed(None, req, cancel, deltas, limits)
    }

    fn call_on(
        &self,
        backend: &str,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<crate::Deltas>,
        limits: Option<crate::LimitSink>,
    ) -> CallFuture<'_> {
        self.routed(Some(backend), req, cancel, deltas, limits)
    }
}

impl RoutedBackend {
    /// Call `req` on `on` (one of its route's backends) or on the route's first backend.
    fn routed(
        &self,
        on: Option<&str>,
        mut req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<crate::Deltas>,
        limits: Option<crate::LimitSink>,
    ) -> CallFuture<'_> {
        let Some(route) = self.table.resolve(&req.kind) else {
            let kind = req.kind.clone();
            return Box::pin(async move {
                Err(BackendError::Terminal {
                    reason: "no_route".into(),
                    message: format!("no route for kind {kind:?} and no default backend"),
                })
            });
        };
        let name = match on {
            None => route.backends.first().unwrap_or_default(),
            Some(name) if route.backends.contains(name) => name,
            Some(name) => {
                let (kind, name) = (req.kind.clone(), name.to_owned());
                return Box::pin(async move {
                    Err(BackendError::Terminal {
                        reason: "no_route".into(),
                        message: format!("backend {name:?} is not on the route of kind {kind:?}"),
                    })
                });
            }
        };
        // `new` checked that every routed name is registered, and a validated table has
        // no empty list.
        let Some(backend) = self.backends.get(name) else {
            let name = name.to_owned();
            return Box::pin(async move {
                Err(BackendError::Terminal {
                    reason: "no_route".into(),
                    message: format!("backend {name:?} is not configured"),
                })
            });
        };
        tracing::debug!(
            job_id = %req.job_id,
            kind = %req.kind,
            backend = name,
            pattern = route.pattern,
            model = route.model,
            "routing call"
        );
        if let Some(model) = route.model {
            req.payload
                .insert("model".into(), Value::String(model.to_string()));
        }
        if let Some(cap) = route.max_tokens {
            // A larger or absent `max_tokens` becomes the cap; a malformed one is left for
            // the backend to refuse (`bad_payload`).
            let asked = req.payload.get("max_tokens");
            if asked.is_none_or(|v| v.is_null() || v.as_u64().is_some_and(|n| n > u64::from(cap))) {
                req.payload.insert("max_tokens".into(), cap.into());
            }
        }
        backend.call_with(req, cancel, deltas, limits)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{SimBackend, SimConfig};
    use serde_json::{Map, json};
    use std::time::Duration;

    const TOML: &str = r#"
        default = "general"

        [[routes]]
        kind = "incident.summary"
        backend = "openai"
        model = "smollm2"
        max_tokens = 100

        [[routes]]
        kind = "code.*"
        backend = "code"

        [[routes]]
        kind = "code.review"
        backend = "openai"

        [[routes]]
        kind = "code.gen.*"
        backend = "openai"
        model = "coder"
    "#;

    fn table() -> RouteTable {
        toml::from_str(TOML).expect("the documented shape parses")
    }

    fn req(kind: &str, job_id: &str) -> CallRequest {
        CallRequest {
            job_id: job_id.into(),
            kind: kind.into(),
            attempt: 0,
            payload: Map::new(),
            timeout: Duration::from_secs(5),
            priority: lastcall_core::Priority::Standard,
        }
    }

    /// A backend that records the model and `max_tokens` each call asked for.
    struct Recorder {
        models: std::sync::Mutex<Vec<Option<String>>>,
        max_tokens: std::sync::Mutex<Vec<Option<Value>>>,
    }

    impl Backend for Recorder {
        fn name(&self) -> &str {
            "recorder"
        }
        fn call(&self, req: CallRequest, _cancel: CancellationToken) -> CallFuture<'_> {
            let model = req
                .payload
                .get("model")
                .and_then(Value::as_str)
                .map(str::to_string);
            self.models.lock().unwrap().push(model);
            let max_tokens = req.payload.get("max_tokens").cloned();
            self.max_tokens.lock().unwrap().push(max_tokens);
            Box::pin(async { Ok(crate::CallOutput::default()) })
        }
    }

    /// A backend whose responses carry rate-limit headers: it hands them to the sink.
    struct Limited;

    impl Backend for Limited {
        fn name(&self) -> &str {
            "limited"
        }
        fn call(&self, req: CallRequest, cancel: CancellationToken) -> CallFuture<'_> {
            self.call_with(req, cancel, None, None)
        }
        fn call_with(
            &self,
            _req: CallRequest,
            _cancel: CancellationToken,
            _deltas: Option<crate::Deltas>,
            limits: Option<crate::LimitSink>,
        ) -> CallFuture<'_> {
            if let Some(sink) = limits {
                sink.send(crate::Observed {
                    requests: Some(crate::rate_limit::Window {
                        limit: Some(3),
                        remaining: 2,
                        reset_ms: 20_000,
                    }),
                    tokens: None,
                });
            }
            Box::pin(async { Ok(crate::CallOutput::default()) })
        }
    }

    #[tokio::test]
    async fn the_router_passes_each_calls_limit_sink_to_its_backend() {
        let limited: Arc<dyn Backend> = Arc::new(Limited);
        let router = RoutedBackend::new(
            table(),
            [
                ("general".to_string(), limited.clone()),
                ("code".into(), limited.clone()),
                ("openai".into(), limited),
            ],
        )
        .unwrap();
        let seen = Arc::new(std::sync::Mutex::new(Vec::new()));
        let sink = {
            let seen = seen.clone();
            crate::LimitSink::new(move |o| seen.lock().unwrap().push(o))
        };
        let req = req("code.lint", "j");
        let cancel = CancellationToken::new();
        router
            .call_with(req, cancel, None, Some(sink))
            .await
            .unwrap();
        let seen = seen.lock().unwrap();
        assert_eq!(seen.len(), 1);
        assert_eq!(seen[0].requests.map(|w| w.remaining), Some(2));
    }

    #[test]
    fn resolution_order_is_exact_then_longest_prefix_then_default() {
        let t = table();
        let backend = |k: &str| t.resolve(k).and_then(|r| r.backends.first());
        assert_eq!(backend("incident.summary"), Some("openai"));
        assert_eq!(backend("code.review"), Some("openai"), "exact beats prefix");
        assert_eq!(backend("code.lint"), Some("code"));
        assert_eq!(
            backend("code.gen.fast"),
            Some("openai"),
            "longest prefix wins"
        );
        assert_eq!(t.resolve("code.gen.fast").unwrap().model, Some("coder"));
        assert_eq!(
            backend("code"),
            Some("general"),
            "`code.*` needs something after the dot"
        );
        assert_eq!(backend("codex.run"), Some("general"));
        assert_eq!(backend("incident.summary.v2"), Some("general"));
        let no_default = RouteTable {
            default: None,
            ..t.clone()
        };
        assert_eq!(no_default.resolve("other"), None);
    }

    #[test]
    fn bad_tables_are_refused() {
        for kind in ["", "*", ".*", "code*", "co*de.x", "a.*.*"] {
            let t = RouteTable {
                default: None,
                routes: vec![Route {
                    kind: kind.into(),
                    backend: "b".into(),
                    model: None,
                    max_tokens: None,
                }],
            };
            assert_eq!(
                t.validate(),
                Err(RouteError::BadPattern(kind.into())),
                "{kind}"
            );
        }
        let mut t = table();
        t.routes.push(t.routes[0].clone());
        assert!(matches!(t.validate(), Err(RouteError::Duplicate(_))));
        assert!(
            toml::from_str::<RouteTable>(
                "[[routes]]\nkind = \"a\"\nbackend = \"b\"\nmodle = \"x\""
            )
            .is_err(),
            "a misspelt route field is an error"
        );
    }

    #[test]
    fn unknown_backend_names_fail_at_build_time() {
        let sim: Arc<dyn Backend> = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let err = RoutedBackend::new(
            table(),
            [
                ("general".to_string(), sim.clone()),
                ("code".into(), sim.clone()),
            ],
        )
        .unwrap_err();
        assert!(
            matches!(err, RouteError::UnknownBackend { ref backend, .. } if backend == "openai")
        );
        let err = RoutedBackend::new(
            RouteTable {
                default: Some(Backends::from("nope")),
                routes: vec![],
            },
            [("general".to_string(), sim)],
        )
        .unwrap_err();
        assert_eq!(err, RouteError::UnknownDefault("nope".into()));
    }

    #[tokio::test]
    async fn calls_reach_the_routed_backend_only() {
        let openai = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let code = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let general = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let router = RoutedBackend::new(
            table(),
            [
                ("openai".to_string(), openai.clone() as Arc<dyn Backend>),
                ("code".into(), code.clone() as Arc<dyn Backend>),
                ("general".into(), general.clone() as Arc<dyn Backend>),
            ],
        )
        .unwrap();

        let calls = [
            ("incident.summary", "j1"),
            ("code.review", "j2"),
            ("code.gen.fast", "j3"),
            ("code.lint", "j4"),
            ("code.fmt", "j5"),
            ("chat", "j6"),
        ];
        for (kind, job) in calls {
            router
                .call(req(kind, job), CancellationToken::new())
                .await
                .unwrap_or_else(|e| panic!("{kind}: {e}"));
        }
        assert_eq!(openai.calls(), 3);
        assert_eq!(["j1", "j2", "j3"].map(|j| openai.calls_for(j)), [1, 1, 1]);
        assert_eq!(code.calls(), 2);
        assert_eq!(["j4", "j5"].map(|j| code.calls_for(j)), [1, 1]);
        assert_eq!(general.calls(), 1);
        assert_eq!(general.calls_for("j6"), 1);
        assert_eq!(router.backend_for("code.lint"), Some("code"));
    }

    #[tokio::test]
    async fn no_route_is_terminal_and_calls_nothing() {
        let sim = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let router = RoutedBackend::new(
            RouteTable {
                default: None,
                routes: vec![Route {
                    kind: "chat".into(),
                    backend: "sim".into(),
                    model: None,
                    max_tokens: None,
                }],
            },
            [("sim".to_string(), sim.clone() as Arc<dyn Backend>)],
        )
        .unwrap();
        let e = router
            .call(req("other.kind", "j1"), CancellationToken::new())
            .await
            .unwrap_err();
        assert_eq!(e.reason(), "no_route");
        assert!(!e.is_retryable());
        assert!(e.to_string().contains("other.kind"));
        assert_eq!(sim.calls(), 0);
    }

    /// The documented table with one [`Recorder`] behind every backend name.
    fn recording_router() -> (Arc<Recorder>, RoutedBackend) {
        let rec = Arc::new(Recorder {
            models: Default::default(),
            max_tokens: Default::default(),
        });
        let r: Arc<dyn Backend> = rec.clone();
        let router = RoutedBackend::new(
            table(),
            [
                ("openai".to_string(), r.clone()),
                ("code".into(), r.clone()),
                ("general".into(), r),
            ],
        )
        .unwrap();
        (rec, router)
    }

    #[tokio::test]
    async fn the_routes_model_replaces_the_payloads() {
        let (rec, router) = recording_router();
        let mut with_model = req("incident.summary", "j1");
        with_model
            .payload
            .insert("model".into(), json!("producer-choice"));
        router
            .call(with_model, CancellationToken::new())
            .await
            .unwrap();
        let mut unrouted_model = req("code.lint", "j2");
        unrouted_model
            .payload
            .insert("model".into(), json!("producer-choice"));
        router
            .call(unrouted_model, CancellationToken::new())
            .await
            .unwrap();
        assert_eq!(
            *rec.models.lock().unwrap(),
            vec![Some("smollm2".into()), Some("producer-choice".into())]
        );
    }

    /// A route's `max_tokens` caps what a job asks for: a larger or absent value becomes
    /// the cap, a smaller one stays, and a route without a cap passes it on.
    #[tokio::test]
    async fn the_routes_max_tokens_caps_the_payloads() {
        let (rec, router) = recording_router();
        for (kind, asked) in [
            ("incident.summary", Some(json!(1_000_000))),
            ("incident.summary", None),
            ("incident.summary", Some(json!(20))),
            ("code.lint", Some(json!(1_000_000))),
        ] {
            let mut call = req(kind, "j");
            if let Some(a) = asked {
                call.payload.insert("max_tokens".into(), a);
            }
            router.call(call, CancellationToken::new()).await.unwrap();
        }
        assert_eq!(
            *rec.max_tokens.lock().unwrap(),
            vec![
                Some(json!(100)),
                Some(json!(100)),
                Some(json!(20)),
                Some(json!(1_000_000))
            ]
        );
    }

    #[test]
    fn a_route_may_list_fallback_backends() {
        let t: RouteTable = toml::from_str(
            r#"
            default = ["general", "spare"]
            [[routes]]
            kind = "summarize"
            backend = ["vllm", "hosted"]
            [[routes]]
            kind = "code.*"
            backend = "code"
            "#,
        )
        .expect("the list form parses");
        t.validate().unwrap();
        let names = |k: &str| t.resolve(k).unwrap().backends.names().to_vec();
        assert_eq!(names("summarize"), ["vllm", "hosted"]);
        assert_eq!(
            names("code.lint"),
            ["code"],
            "the single string still works"
        );
        assert_eq!(names("other"), ["general", "spare"]);
        assert!(t.uses("hosted") && t.uses("spare") && !t.uses("local"));
    }

    #[test]
    fn bad_backend_lists_are_refused_naming_the_route() {
        for (list, problem) in [
            ("[]", "an empty backend list"),
            ("[\"a\", \"\"]", "an empty backend name"),
            ("\"\"", "an empty backend name"),
            ("[\"a\", \"b\", \"a\"]", "backend \"a\" twice"),
        ] {
            let t: RouteTable = toml::from_str(&format!(
                "[[routes]]\nkind = \"summarize\"\nbackend = {list}"
            ))
            .unwrap();
            let err = t.validate().unwrap_err();
            assert_eq!(
                err,
                RouteError::BadBackends {
                    kind: "summarize".into(),
                    problem: problem.into()
                },
                "{list}"
            );
            assert!(err.to_string().contains("\"summarize\""), "{err}");
        }
        let t: RouteTable = toml::from_str("default = []").unwrap();
        assert_eq!(
            t.validate(),
            Err(RouteError::BadDefault("an empty backend list".into()))
        );
        assert!(
            toml::from_str::<RouteTable>("[[routes]]\nkind = \"a\"\nbackend = [1]").is_err(),
            "names are strings"
        );
        // Every listed name must be registered.
        let sim: Arc<dyn Backend> = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let t: RouteTable =
            toml::from_str("[[routes]]\nkind = \"s\"\nbackend = [\"a\", \"b\"]").unwrap();
        let err = RoutedBackend::new(t, [("a".to_string(), sim)]).unwrap_err();
        assert_eq!(
            err,
            RouteError::UnknownBackend {
                kind: "s".into(),
                backend: "b".into()
            }
        );
    }

    #[tokio::test]
    async fn call_on_reaches_the_chosen_backend_of_the_route_only() {
        let first = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let second = Arc::new(SimBackend::new(SimConfig::default()).unwrap());
        let t: RouteTable =
            toml::from_str("[[routes]]\nkind = \"s\"\nbackend = [\"first\", \"second\"]").unwrap();
        let router = RoutedBackend::new(
            t,
            [
                ("first".to_string(), first.clone() as Arc<dyn Backend>),
                ("second".into(), second.clone() as Arc<dyn Backend>),
            ],
        )
        .unwrap();
        assert_eq!(router.routes_of("s"), ["first", "second"]);
        assert_eq!(router.routes_of("other"), ["routed"], "no route");
        let on = |b: &'static str, job: &'static str| {
            router.call_on(b, req("s", job), CancellationToken::new(), None, None)
        };
        on("second", "j1").await.unwrap();
        router
            .call(req("s", "j2"), CancellationToken::new())
            .await
            .unwrap();
        let e = on("elsewhere", "j3").await.unwrap_err();
        assert_eq!(e.reason(), "no_route");
        assert_eq!((first.calls_for("j1"), second.calls_for("j1")), (0, 1));
        assert_eq!((first.calls_for("j2"), second.calls_for("j2")), (1, 0));
        assert_eq!(first.calls() + second.calls(), 2);
    }

    #[tokio::test]
    async fn cancellation_reaches_the_routed_backend() {
        let sim = Arc::new(
            SimBackend::new(SimConfig {
                latency_ms: 10_000,
                ..SimConfig::default()
            })
            .unwrap(),
        );
        let router = RoutedBackend::new(
            RouteTable {
                default: Some("sim".into()),
                routes: vec![],
            },
            [("sim".to_string(), sim.clone() as Arc<dyn Backend>)],
        )
        .unwrap();
        let cancel = CancellationToken::new();
        cancel.cancel();
        let r = router.call(req("anything", "j1"), cancel).await;
        assert_eq!(r, Err(BackendError::Cancelled { confirmed: true }));
        assert_eq!(sim.calls(), 1);
    }
}
