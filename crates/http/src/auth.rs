//! Token authentication. The token comes from the environment or a file, never from a
//! flag; it is compared in constant time. Two spellings are accepted on every protected
//! route:
//! - `Authorization: Bearer <token>` — scripts, Prometheus, `curl`;
//! - `Authorization: Basic <base64(user:token)>` with any user name — browsers: the `401`
//!   carries a `Basic` challenge, so a browser asks once and then sends the cached
//!   credentials with the dashboard page and its same-origin fetches. Basic credentials
//!   are taken for reads only (`GET`, `HEAD`): a browser attaches them by itself, also to
//!   a request another site's page makes, so they may not change anything.
//!
//! The token never appears in a URL, a query string or a server log. A request that
//! changes something (`POST`, `DELETE`) from another origin (`Origin` not this server's
//! `Host`, or `Sec-Fetch-Site: cross-site`/`same-site`) is refused with `403` before its
//! credentials are looked at.
//!
//! Two kinds of token: the operator's one token (`--token-file` /
//! `LASTCALL_HTTP_TOKEN`), which may do everything and submit for any tenant, and the
//! tokens of the tokens file (`serve --tokens-file`, [`crate::tokens`]), each acting for one
//! tenant: its jobs are stamped with that tenant, it lists and reads only that tenant's
//! jobs, and the dashboard and `/metrics` (every tenant's numbers) are not its to read
//! (`403 operator_only`). The middleware puts the [`Caller`] in the request's extensions.

use crate::AppState;
use crate::error::ApiError;
use crate::tokens::TokenEntry;
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

    /// Who presents this token, as idempotency keys are scoped by it: a SHA-256
    /// fingerprint of the token (it reveals nothing of it). A request under another token
    /// (another deployment, a rotated token) never gets this one's answer for a key.
    pub fn tenant(&self) -> String {
        lastcall_core::request_hash(&[b"lastcall-token", &self.0])
    }

    /// The token's bytes, to check that the tokens file does not list it too.
    pub fn expose_for_lookup(&self) -> &[u8] {
        &self.0
    }

    /// Constant-time comparison (the length is not secret).
    pub fn matches(&self, candidate: &[u8]) -> bool {
        ct_eq(&self.0, candidate)
    }
}

/// Who a request is from (see the module doc).
#[derive(Debug, Clone)]
pub enum Caller {
    /// The operator's token: every route, any tenant.
    Operator,
    /// A token of the tokens file: its tenant only.
    Tenant(Arc<TokenEntry>),
}

impl Caller {
    /// The tenant this caller is bound to (`None`: the operator, who may name any).
    pub fn tenant(&self) -> Option<&str> {
        match self {
            Caller::Operator => None,
            Caller::Tenant(e) => Some(e.tenant.as_str()),
        }
    }

    /// The idempotency scope of this caller's requests for a job of `tenant`: the
    /// operator token's fingerprint (with the tenant when it is not `default`, so the
    /// same job id for another tenant is a conflict, never the first one's answer), or the
    /// token's tenant (its tokens share one scope; another tenant's never matches).
    pub fn scope(&self, operator: &Token, tenant: &str) -> String {
        match self {
            Caller::Operator if tenant == lastcall_core::Tenant::DEFAULT => operator.tenant(),
            Caller::Operator => format!("{}|tenant:{tenant}", operator.tenant()),
            Caller::Tenant(e) => format!("tenant:{}", e.tenant),
        }
    }

    /// The job tenant for a request that names `named` in `field` (a body field, a header,
    /// a query parameter): a tenant token's own, refusing another (`403 tenant_mismatch`);
    /// for the operator, the named one, else `default`.
    pub fn job_tenant(
        &self,
        named: Option<&str>,
        field: &'static str,
    ) -> Result<lastcall_core::Tenant, ApiError> {
        let parsed = match named {
            Some(n) => Some(lastcall_core::Tenant::parse(n).map_err(|e| {
                ApiError::bad(field, "invalid_field", format!("`{field}` {}", e.0))
            })?),
            None => None,
        };
        match (self, parsed) {
            (Caller::Tenant(e), Some(t)) if t != e.tenant => Err(ApiError::NotAllowed {
                field,
                code: "tenant_mismatch",
                message: format!(
                    "this token acts for tenant `{}`, and `{field}` names `{t}`: leave `{field}` out or name `{}`",
                    e.tenant, e.tenant
                ),
            }),
            (Caller::Tenant(e), _) => Ok(e.tenant.clone()),
            (Caller::Operator, Some(t)) => Ok(t),
            (Caller::Operator, None) => Ok(lastcall_core::Tenant::default_tenant()),
        }
    }

    /// The tier of a job this caller submits naming `named` in `field`: `403
    /// priority_not_allowed` above a tenant token's `max_priority`; none named: the lower
    /// of `standard` and that (the operator's token: any tier, `None` for the default).
    pub fn job_priority(
        &self,
        named: Option<lastcall_core::Priority>,
        field: &'static str,
    ) -> Result<Option<lastcall_core::Priority>, ApiError> {
        let Caller::Tenant(e) = self else {
            return Ok(named);
        };
        match named {
            // `Priority` orders the highest tier first.
            Some(p) if p < e.max_priority => Err(ApiError::NotAllowed {
                field,
                code: "priority_not_allowed",
                message: format!(
                    "this token may submit at most tier `{}` (`max_priority` of its tokens-file entry), and `{field}` asks for `{}`",
                    e.max_priority.as_str(),
                    p.as_str()
                ),
            }),
            Some(p) => Ok(Some(p)),
            None if e.max_priority > lastcall_core::Priority::Standard => Ok(Some(e.max_priority)),
            None => Ok(None),
        }
    }

    /// The ledger id of a job this caller names `named` (a tenant never reaches
    /// another tenant's job, not even its existence). The operator's ids are global; a
    /// tenant token's are scoped by its tenant: `<tenant>:<named>`, unless `named` already
    /// starts with `<tenant>:` (the id the answers carry). Every id a tenant token can
    /// name therefore lies in its own namespace: another tenant's job is a missing one, in
    /// status and timing. (The tokens file refuses a tenant with `:`, so no namespace holds
    /// another.)
    pub fn job_id(&self, named: &str) -> String {
        match self {
            Caller::Operator => named.to_owned(),
            Caller::Tenant(e) => {
                let prefix = format!("{}:", e.tenant);
                if named.starts_with(&prefix) {
                    named.to_owned()
                } else {
                    prefix + named
                }
            }
        }
    }

    /// [`Caller::job_id`] for a job to submit: `None` (the request names none) gets a new
    /// random id ([`lastcall_producer::new_job_id`]) in the caller's namespace; an id that
    /// is too long once scoped is `400` naming `field`.
    pub fn new_job_id(&self, named: Option<&str>, field: &'static str) -> Result<String, ApiError> {
        let id = self.job_id(&named.map_or_else(lastcall_producer::new_job_id, str::to_owned));
        if let (Caller::Tenant(e), Some(n)) = (self, named)
            && id.len() > lastcall_core::JobId::MAX_LEN
        {
            return Err(ApiError::bad(
                field,
                "invalid_field",
                format!(
                    "`{field}` `{}` is too long for this token: its job ids are `{}:<id>`, at most {} characters in all",
                    crate::params::shorten(n),
                    e.tenant,
                    lastcall_core::JobId::MAX_LEN
                ),
            ));
        }
        Ok(id)
    }

    /// `403 kind_not_allowed` unless this caller may submit jobs of `kind`.
    pub fn check_kind(&self, kind: &str) -> Result<(), ApiError> {
        match self {
            Caller::Tenant(e) if !e.allows(kind) => Err(ApiError::NotAllowed {
                field: "kind",
                code: "kind_not_allowed",
                message: format!(
                    "this token may not submit jobs of kind `{}`; its tokens-file entry allows {}",
                    crate::params::shorten(kind),
                    e.kinds
                        .iter()
                        .flatten()
                        .map(|k| format!("`{k}`"))
                        .collect::<Vec<_>>()
                        .join(", ")
                ),
            }),
            _ => Ok(()),
        }
    }
}

/// Routes only the operator's token may read: they show every tenant's numbers.
pub(crate) const OPERATOR_ONLY: [&str; 3] = ["/", "/v1/dashboard", "/metrics"];

/// Equal in time that depends only on the lengths.
fn ct_eq(a: &[u8], b: &[u8]) -> bool {
    let mut diff = (a.len() ^ b.len()) as u8 | u8::from(a.len() != b.len());
    for (i, x) in a.iter().enumerate() {
        diff |= x ^ b.get(i).copied().unwrap_or(0);
    }
    std::hint::black_box(diff) == 0
}

/// Middleware: a valid `Bearer` or `Basic` credential (see the module doc), or 401; and no
/// cross-site writes (see [`cross_origin`]): a request that changes something (any method
/// but `GET`, `HEAD`, `OPTIONS`) sent from another origin is `403 cross_origin`, and one
/// that presents Basic credentials (which a browser attaches by itself) is
/// `403 basic_credentials_read_only`: Basic is for the dashboard's reads.
pub async fn require_token(
    State(state): State<Arc<AppState>>,
    req: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let writes = !matches!(
        *req.method(),
        axum::http::Method::GET | axum::http::Method::HEAD | axum::http::Method::OPTIONS
    );
    if writes && let Some(why) = cross_origin(req.headers()) {
        return Err(ApiError::Forbidden {
            code: "cross_origin",
            message: why,
        });
    }
    let header = req.headers().get(axum::http::header::AUTHORIZATION);
    let Some((scheme, t)) = header.and_then(|v| presented(v.as_bytes())) else {
        return Err(ApiError::Unauthorized);
    };
    let caller = if state.token.matches(&t) {
        Caller::Operator
    } else {
        match state.tokens.as_ref().and_then(|f| f.lookup(&t)) {
            Some(entry) => Caller::Tenant(entry),
            None => return Err(ApiError::Unauthorized),
        }
    };
    if writes && scheme == Scheme::Basic {
        return Err(ApiError::Forbidden {
            code: "basic_credentials_read_only",
            message: "Basic credentials are accepted for reads only (the dashboard); send `Authorization: Bearer <token>` to change anything".into(),
        });
    }
    if let Caller::Tenant(e) = &caller
        && let Some(path) = req.extensions().get::<axum::extract::MatchedPath>()
        && OPERATOR_ONLY.contains(&path.as_str())
    {
        return Err(ApiError::Forbidden {
            code: "operator_only",
            message: format!(
                "`{}` shows every tenant's numbers: only the operator's token may read it, and this token acts for tenant `{}`",
                path.as_str(),
                e.tenant
            ),
        });
    }
    // A tenant's requests in flight, to the last byte of the answer (`max_requests`).
    let held = state.tenant_hold(&caller, "max_requests", "requests in flight", |l| {
        l.max_requests
    })?;
    let mut req = req;
    req.extensions_mut().insert(caller);
    let resp = next.run(req).await;
    Ok(resp.map(|body| axum::body::Body::new(HoldingBody { body, _held: held })))
}

/// A response body that keeps its request's permits ([`crate::Held`]) until it is sent or
/// dropped.
struct HoldingBody {
    body: axum::body::Body,
    _held: crate::Held,
}

impl hyper::body::Body for HoldingBody {
    type Data = axum::body::Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Result<hyper::body::Frame<Self::Data>, Self::Error>>> {
        std::pin::Pin::new(&mut self.body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> hyper::body::SizeHint {
        self.body.size_hint()
    }
}

/// Why a request comes from another origin than this server's, if it does: its
/// `Sec-Fetch-Site` is `cross-site` or `same-site` (a browser's own statement), or its
/// `Origin` is not this server's (`null`, or a host and port other than `Host`'s). A request
/// with neither header (curl, the SDKs, scripts) is not cross-origin.
pub fn cross_origin(headers: &axum::http::HeaderMap) -> Option<String> {
    if let Some(site) = headers.get("sec-fetch-site")
        && matches!(site.as_bytes(), b"cross-site" | b"same-site")
    {
        return Some(format!(
            "refused: a request from another site (`Sec-Fetch-Site: {}`) may not change anything here",
            String::from_utf8_lossy(site.as_bytes())
        ));
    }
    let origin = headers.get(axum::http::header::ORIGIN)?;
    let host = headers
        .get(axum::http::header::HOST)
        .and_then(|h| h.to_str().ok())
        .unwrap_or("");
    let same = origin
        .to_str()
        .ok()
        .and_then(|o| o.split_once("://"))
        .is_some_and(|(scheme, authority)| {
            let default = match scheme {
                "http" => ":80",
                "https" => ":443",
                _ => return false,
            };
            let norm = |a: &str| {
                let a = a.to_ascii_lowercase();
                if a.ends_with(default) {
                    a[..a.len() - default.len()].to_owned()
                } else {
                    a
                }
            };
            !host.is_empty() && norm(authority) == norm(host)
        });
    (!same).then(|| {
        format!(
            "refused: the request's `Origin` ({}) is not this server (`Host: {}`); a page of another origin may not change anything here",
            crate::params::shorten(&String::from_utf8_lossy(origin.as_bytes())),
            crate::params::shorten(host)
        )
    })
}

/// How a credential was presented.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Scheme {
    Bearer,
    Basic,
}

/// The token an `Authorization` header value presents: the Bearer token, or the password
/// of Basic credentials (the user name is ignored). Scheme names are case-insensitive.
pub fn presented_token(value: &[u8]) -> Option<Vec<u8>> {
    presented(value).map(|(_, t)| t)
}

/// [`presented_token`] with the scheme it came in.
pub fn presented(value: &[u8]) -> Option<(Scheme, Vec<u8>)> {
    let split = value.iter().position(|b| *b == b' ')?;
    let (scheme, rest) = value.split_at(split);
    let rest = rest.trim_ascii();
    if scheme.eq_ignore_ascii_case(b"bearer") {
        Some((Scheme::Bearer, rest.to_vec()))
    } else if scheme.eq_ignore_ascii_case(b"basic") {
        let decoded = base64_decode(rest)?;
        let colon = decoded.iter().position(|b| *b == b':')?;
        Some((Scheme::Basic, decoded[colon + 1..].to_vec()))
    } else {
        None
    }
}

/// Standard base64 with padding (RFC 4648 §4), as browsers send Basic credentials.
fn base64_decode(text: &[u8]) -> Option<Vec<u8>> {
    fn val(c: u8) -> Option<u32> {
        Some(match c {
            b'A'..=b'Z' => c - b'A',
            b'a'..=b'z' => c - b'a' + 26,
            b'0'..=b'9' => c - b'0' + 52,
            b'+' => 62,
            b'/' => 63,
            _ => return None,
        } as u32)
    }
    if text.is_empty() || !text.len().is_multiple_of(4) {
        return None;
    }
    let mut out = Vec::with_capacity(text.len() / 4 * 3);
    let last = text.len() / 4 - 1;
    for (i, quad) in text.chunks_exact(4).enumerate() {
        let pad = quad.iter().rev().take_while(|c| **c == b'=').count();
        if pad > 2 || (pad > 0 && i != last) {
            return None;
        }
        let mut n = 0u32;
        for c in &quad[..4 - pad] {
            n = (n << 6) | val(*c)?;
        }
        n <<= 6 * pad as u32;
        let bytes = n.to_be_bytes();
        out.extend_from_slice(&bytes[1..4 - pad]);
    }
    Some(out)
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

    #[test]
    fn bearer_and_basic_present_the_token() {
        assert_eq!(presented_token(b"Bearer abc").as_deref(), Some(&b"abc"[..]));
        assert_eq!(
            presented_token(b"bearer  abc ").as_deref(),
            Some(&b"abc"[..])
        );
        // base64("lastcall:s3cret") and base64(":tok:en") (a colon in the password).
        assert_eq!(
            presented_token(b"Basic bGFzdGNhbGw6czNjcmV0").as_deref(),
            Some(&b"s3cret"[..])
        );
        assert_eq!(
            presented_token(b"Basic OnRvazplbg==").as_deref(),
            Some(&b"tok:en"[..])
        );
        assert_eq!(base64_decode(b"YQ==").as_deref(), Some(&b"a"[..]));
        assert_eq!(base64_decode(b"YWI=").as_deref(), Some(&b"ab"[..]));
        assert_eq!(base64_decode(b"YWJj").as_deref(), Some(&b"abc"[..]));
        for bad in [
            &b"Basic"[..],
            b"Basic !!!!",
            b"Basic YQ=",
            b"Basic YQ==YQ==",
            b"Basic bm9jb2xvbg==",
            b"Digest x",
            b"abc",
        ] {
            assert_eq!(
                presented_token(bad),
                None,
                "{}",
                String::from_utf8_lossy(bad)
            );
        }
    }
}
