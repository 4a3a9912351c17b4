//! Settings of the OpenAI-compatible backend, and the API key that never leaves them.

use std::fmt;
use std::path::Path;
use std::time::Duration;

/// A secret bearer token. It has no `Display`, its `Debug` is redacted, and it is only ever
/// read from the environment or a file, never from a command-line flag (flags show up in
/// `ps` output and shell history).
#[derive(Clone, PartialEq, Eq)]
pub struct ApiKey(String);

impl ApiKey {
    /// Reads the key from the environment variable `var`. Missing, empty or not UTF-8 is an
    /// error; the error names the variable, never the value.
    pub fn from_env(var: &str) -> Result<Self, ConfigError> {
        match std::env::var(var) {
            Ok(v) => Self::parse(v).ok_or_else(|| ConfigError::EmptyKey {
                source_name: format!("environment variable {var}"),
            }),
            Err(_) => Err(ConfigError::MissingEnv {
                var: var.to_string(),
            }),
        }
    }

    /// Reads the key from a file holding only the key (surrounding whitespace and a trailing
    /// newline are ignored), e.g. a mounted secret.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::KeyFile {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        Self::parse(text).ok_or_else(|| ConfigError::EmptyKey {
            source_name: format!("file {}", path.display()),
        })
    }

    fn parse(raw: String) -> Option<Self> {
        let key = raw.trim();
        (!key.is_empty()).then(|| Self(key.to_string()))
    }

    /// The secret itself, for the `Authorization` header only.
    pub(crate) fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ApiKey(<redacted>)")
    }
}

/// Settings of [`crate::OpenAiBackend`].
///
/// The request timeout is not here: every call gets its own, the job's remaining budget
/// (`CallRequest::timeout`).
#[derive(Clone)]
pub struct OpenAiConfig {
    /// Up to and including the API version, e.g. `http://127.0.0.1:8080/v1`; the backend
    /// posts to `{base_url}/chat/completions`.
    pub base_url: String,
    /// The model name sent when neither the payload nor the route names one.
    pub model: String,
    /// Sent as `Authorization: Bearer …` when set. Local servers need none.
    api_key: Option<ApiKey>,
    /// How long to wait for the TCP (and TLS) connection. Kept short and separate from the
    /// call's budget so that a server that is down fails fast as a retryable
    /// `connect_error`, leaving budget for a retry elsewhere.
    pub connect_timeout: Duration,
    /// `max_tokens` sent when the payload has none: an open-ended generation would run
    /// into the deadline and be thrown away.
    pub max_tokens: u32,
    /// The most `max_tokens` a job may ask for: a payload's larger value is lowered to it
    /// (a producer does not decide how long the model server works for it).
    pub max_tokens_limit: u32,
    /// Send the job's tier as the request's `priority` (vLLM's priority scheduling,
    /// `--scheduling-policy priority`: lower is served earlier): critical -1, standard 0
    /// (what vLLM gives a request without one), batch 1. Off by default: a server that
    /// does not know the field may refuse the request.
    pub send_priority: bool,
    /// Send the budget left when the request goes out, in whole ms, in this header (for
    /// a gateway or server that reads one). `None`: no header.
    pub budget_header: Option<String>,
}

impl OpenAiConfig {
    pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
    pub const DEFAULT_MAX_TOKENS: u32 = 256;
    pub const DEFAULT_MAX_TOKENS_LIMIT: u32 = 4_096;

    /// A config without an API key, with the default connect timeout and `max_tokens`.
    pub fn new(base_url: impl Into<String>, model: impl Into<String>) -> Self {
        Self {
            base_url: base_url.into().trim_end_matches('/').to_string(),
            model: model.into(),
            api_key: None,
            connect_timeout: Self::DEFAULT_CONNECT_TIMEOUT,
            max_tokens: Self::DEFAULT_MAX_TOKENS,
            max_tokens_limit: Self::DEFAULT_MAX_TOKENS_LIMIT,
            send_priority: false,
            budget_header: None,
        }
    }

    /// Takes the API key from the environment variable `var` (see [`ApiKey::from_env`]).
    pub fn api_key_from_env(self, var: &str) -> Result<Self, ConfigError> {
        Ok(self.with_api_key(ApiKey::from_env(var)?))
    }

    /// Takes the API key from a file holding only the key (see [`ApiKey::from_file`]).
    pub fn api_key_from_file(self, path: impl AsRef<Path>) -> Result<Self, ConfigError> {
        Ok(self.with_api_key(ApiKey::from_file(path)?))
    }

    pub fn with_api_key(mut self, key: ApiKey) -> Self {
        self.api_key = Some(key);
        self
    }

    pub fn with_connect_timeout(mut self, timeout: Duration) -> Self {
        self.connect_timeout = timeout;
        self
    }

    pub fn with_max_tokens(mut self, max_tokens: u32) -> Self {
        self.max_tokens = max_tokens;
        self
    }

    /// The most `max_tokens` a job may ask for (at least 1).
    pub fn with_max_tokens_limit(mut self, limit: u32) -> Self {
        self.max_tokens_limit = limit.max(1);
        self
    }

    /// Send the job's tier as the request's `priority` ([`Self::send_priority`]).
    pub fn with_send_priority(mut self, on: bool) -> Self {
        self.send_priority = on;
        self
    }

    /// Send the budget left in header `name` ([`Self::budget_header`]); an invalid header
    /// name is refused when the backend is built.
    pub fn with_budget_header(mut self, name: Option<String>) -> Self {
        self.budget_header = name;
        self
    }

    pub fn api_key(&self) -> Option<&ApiKey> {
        self.api_key.as_ref()
    }

    /// `{base_url}/chat/completions`.
    pub fn chat_completions_url(&self) -> String {
        format!("{}/chat/completions", self.base_url)
    }
}

impl fmt::Debug for OpenAiConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpenAiConfig")
            .field("base_url", &self.base_url)
            .field("model", &self.model)
            .field("api_key", &self.api_key.as_ref().map(|_| "<redacted>"))
            .field("connect_timeout", &self.connect_timeout)
            .field("max_tokens", &self.max_tokens)
            .field("max_tokens_limit", &self.max_tokens_limit)
            .field("send_priority", &self.send_priority)
            .field("budget_header", &self.budget_header)
            .finish()
    }
}

/// A config that cannot be used. Messages name where a key was looked for, never the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("environment variable {var} with the API key is not set")]
    MissingEnv { var: String },
    #[error("the API key from {source_name} is empty")]
    EmptyKey { source_name: String },
    #[error("cannot read the API key file {path}: {message}")]
    KeyFile { path: String, message: String },
    #[error("invalid base url {url:?}: {message}")]
    BaseUrl { url: String, message: String },
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    #[error(
        "budget header {name:?} is not a valid HTTP header name (letters, digits and `-`, e.g. X-Request-Budget-Ms)"
    )]
    BudgetHeader { name: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn debug_never_shows_the_key() {
        let cfg = OpenAiConfig::new("http://127.0.0.1:8080/v1/", "m")
            .with_api_key(ApiKey("sk-very-secret".into()));
        let shown = format!("{cfg:?} {:?}", cfg.api_key());
        assert!(!shown.contains("sk-very-secret"), "{shown}");
        assert!(shown.contains("<redacted>"));
        assert_eq!(
            cfg.chat_completions_url(),
            "http://127.0.0.1:8080/v1/chat/completions"
        );
    }

    #[test]
    fn key_from_file_is_trimmed_and_empty_is_an_error() {
        let dir = std::env::temp_dir().join(format!("lastcall-openai-key-{}", std::process::id()));
        std::fs::write(&dir, "  sk-abc\n").unwrap();
        let key = ApiKey::from_file(&dir).unwrap();
        assert_eq!(key.expose(), "sk-abc");
        std::fs::write(&dir, "\n").unwrap();
        let err = ApiKey::from_file(&dir).unwrap_err();
        assert!(matches!(err, ConfigError::EmptyKey { .. }));
        let _ = std::fs::remove_file(&dir);
        assert!(matches!(
            ApiKey::from_file(&dir),
            Err(ConfigError::KeyFile { .. })
        ));
    }

    #[test]
    fn a_budget_header_that_is_no_header_name_is_refused_naming_it() {
        let cfg = OpenAiConfig::new("http://127.0.0.1:8080/v1", "m")
            .with_budget_header(Some("budget ms".into()));
        let err = crate::OpenAiBackend::new(cfg).unwrap_err();
        assert!(matches!(err, ConfigError::BudgetHeader { .. }), "{err}");
        assert!(err.to_string().contains("\"budget ms\""), "{err}");
        let ok = OpenAiConfig::new("http://127.0.0.1:8080/v1", "m")
            .with_budget_header(Some("X-Request-Budget-Ms".into()));
        assert!(crate::OpenAiBackend::new(ok).is_ok());
    }

    #[test]
    fn missing_env_names_the_variable() {
        let err = ApiKey::from_env("LASTCALL_TEST_SURELY_UNSET_KEY_VAR").unwrap_err();
        assert!(
            err.to_string()
                .contains("LASTCALL_TEST_SURELY_UNSET_KEY_VAR")
        );
    }
}
