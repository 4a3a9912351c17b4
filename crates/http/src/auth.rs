//! Bearer-token authentication. The token comes from the environment or a file, never
//! from a flag; it is compared in constant time.

use crate::AppState;
use crate::error::ApiError;
use axum::extract::{Request, State};
use axum::middleware::Next;
use axum::response::Response;
use std::sync::Arc;

/// A secret bearer token. `Debug` never prints it.
#[derive(Clone)]
pub struct Token(Arc<[u8]>);

impl std::fmt::Debug for Token {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("Token(***)")
    }
}

/// Why a token could not be loaded.
#[derive(Debug, thiserror::Error)]
pub enum TokenError {
    #[error("cannot read the token file {path}: {source}")]
    File {
        path: String,
        source: std::io::Error,
    },
    #[error("no HTTP token: set LASTCALL_HTTP_TOKEN or pass --token-file (at least 16 characters)")]
    Missing,
    #[error("the HTTP token is shorter than 16 characters")]
    TooShort,
}

impl Token {
    pub fn new(secret: &str) -> Result<Self, TokenError> {
        let s = secret.trim();
        if s.is_empty() {
            return Err(TokenError::Missing);
        }
        if s.len() < 16 {
            return Err(TokenError::TooShort);
        }
        Ok(Self(Arc::from(s.as_bytes())))
    }

    /// From `--token-file` if given, else the environment variable `env_var`.
    pub fn load(file: Option<&std::path::Path>, env_var: &str) -> Result<Self, TokenError> {
        if let Some(path) = file {
            let s = std::fs::read_to_string(path).map_err(|source| TokenError::File {
                path: path.display().to_string(),
                source,
            })?;
            return Self::new(&s);
        }
        match std::env::var(env_var) {
            Ok(s) => Self::new(&s),
            Err(_) => Err(TokenError::Missing),
        }
    }

    /// Constant-time comparison (the length is not secret).
    pub fn matches(&self, candidate: &[u8]) -> bool {
        ct_eq(&self.0, candidate)
    }
}

/// Equal in time that depends only on the lengths.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

/// Middleware: `Authorization: Bearer <token>` or 401.
pub async fn require_token(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let given = req
        .headers()
        .get(axum::http::header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "));
    match given {
        Some(t) if state.token.matches(t) => Ok(next.run(req).await),
        _ => Err(ApiError::Unauthorized),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn compares_whole_tokens() {
        let t = Token::new("0123456789abcdef").unwrap();
        assert!(t.matches(b"0123456789abcdef"));
        assert!(!t.matches(b"0123456789abcdeX"));
        assert!(!t.matches(b"0123456789abcde"));
        assert!(!t.matches(b"0123456789abcdef0"));
        assert!(!t.matches(b""));
        assert!(matches!(Token::new("short"), Err(TokenError::TooShort)));
        assert!(matches!(Token::new("  "), Err(TokenError::Missing)));
        assert_eq!(format!("{t:?}"), "Token(***)");
    }
}
