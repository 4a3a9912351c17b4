//! Query strings and path parameters, read so that every refusal is the documented JSON
//! error naming the parameter (axum's own `Query`/`Path` rejections are plain text).

use crate::error::ApiError;
use axum::extract::{FromRequestParts, Path, Query};
use axum::http::request::Parts;
use std::ops::RangeInclusive;

/// The query string as name/value pairs, in order. Parameters a route does not know are
/// ignored (cache-busting suffixes stay harmless); a known one given twice is refused.
#[derive(Debug, Default)]
pub struct QueryParams(Vec<(String, String)>);

impl<S: Send + Sync> FromRequestParts<S> for QueryParams {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Query::<Vec<(String, String)>>::from_request_parts(parts, state).await {
            Ok(Query(pairs)) => Ok(Self(pairs)),
            Err(e) => Err(ApiError::bad(
                "query",
                "invalid_query",
                format!("the query string cannot be read: {}", e.body_text()),
            )),
        }
    }
}

impl QueryParams {
    /// The value of `name`, which may be given at most once.
    pub fn single(&self, name: &str) -> Result<Option<&str>, ApiError> {
        let mut values = self
            .0
            .iter()
            .filter(|(k, _)| k == name)
            .map(|(_, v)| v.as_str());
        let first = values.next();
        match values.count() {
            0 => Ok(first),
            more => Err(ApiError::bad(
                name,
                "invalid_field",
                format!("`{name}` is given {} times; give it at most once", more + 1),
            )),
        }
    }

    /// An integer parameter within `range`, at most once.
    pub fn integer(&self, name: &str, range: RangeInclusive<i64>) -> Result<Option<i64>, ApiError> {
        let Some(text) = self.single(name)? else {
            return Ok(None);
        };
        match text.parse::<i64>() {
            Ok(n) if range.contains(&n) => Ok(Some(n)),
            _ => Err(ApiError::bad(
                name,
                "invalid_field",
                format!(
                    "`{name}` must be an integer from {} to {}, not `{}`",
                    range.start(),
                    range.end(),
                    shorten(text)
                ),
            )),
        }
    }
}

/// The one path parameter of a route (`/v1/jobs/{id}`), as text.
#[derive(Debug)]
pub struct PathParam(pub String);

impl<S: Send + Sync> FromRequestParts<S> for PathParam {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, state: &S) -> Result<Self, ApiError> {
        match Path::<String>::from_request_parts(parts, state).await {
            Ok(Path(v)) => Ok(Self(v)),
            Err(e) => Err(ApiError::bad(
                "id",
                "invalid_field",
                format!("`id` in the path cannot be read: {}", e.body_text()),
            )),
        }
    }
}

/// A value quoted in an error message, cut to 64 characters.
pub fn shorten(text: &str) -> String {
    let mut chars = text.chars();
    let head: String = chars.by_ref().take(64).collect();
    if chars.next().is_some() {
        format!("{head}…")
    } else {
        head
    }
}
