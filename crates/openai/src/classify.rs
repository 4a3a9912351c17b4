//! HTTP outcomes classified for the retry policy. Pure: status, headers and body in,
//! [`BackendError`] out.

use lastcall_backend::BackendError;
use serde_json::Value;
use std::time::Duration;

/// Longest server message kept in an error (the ledger stores it).
const MAX_MESSAGE: usize = 500;

/// Classifies a non-success HTTP status.
///
/// - 408 (the server timed out waiting), 429 (rate limited, overloaded) and every 5xx are
///   retryable: another attempt, later or elsewhere, may succeed;
/// - every other 4xx is terminal: the request itself is wrong (400 bad request,
///   401/403 key, 404 model or path, 413 too large, 422 validation).
///
/// The reason is `http_<status>`; the message is the server's own (`error.message` of an
/// OpenAI-style error body, else the body text), truncated.
pub fn status_error(status: u16, retry_after: Option<&str>, body: &[u8]) -> BackendError {
    let reason = format!("http_{status}");
    let message = server_message(body);
    if status == 408 || status == 429 || (500..600).contains(&status) {
        BackendError::Retryable {
            reason,
            message,
            retry_after: retry_after.and_then(parse_retry_after),
        }
    } else {
        BackendError::Terminal { reason, message }
    }
}

/// `Retry-After` in its delta-seconds form (`"7"`, also `"1.5"`, which some APIs send).
/// The HTTP-date form is not honoured: the worker's own backoff applies instead.
pub fn parse_retry_after(value: &str) -> Option<Duration> {
    let secs: f64 = value.trim().parse().ok()?;
    (secs.is_finite() && secs >= 0.0).then(|| Duration::from_secs_f64(secs.min(86_400.0)))
}

/// The human part of an error body: `error.message` (OpenAI, vLLM, llama.cpp), `error`
/// as a string or `message` (Ollama and others), `detail` (FastAPI), else the raw text.
pub fn server_message(body: &[u8]) -> String {
    let text = String::from_utf8_lossy(body);
    let from_json = serde_json::from_str::<Value>(&text).ok().and_then(|v| {
        let m = v
            .pointer("/error/message")
            .or_else(|| v.get("error").filter(|e| e.is_string()))
            .or_else(|| v.get("message"))
            .or_else(|| v.get("detail"))?;
        Some(match m {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        })
    });
    let msg = from_json.unwrap_or_else(|| text.trim().to_string());
    truncate(&msg, MAX_MESSAGE)
}

/// Cuts `s` to at most `max` bytes on a character boundary, marking the cut.
pub fn truncate(s: &str, max: usize) -> String {
    if s.len() <= max {
        return s.to_string();
    }
    let mut end = max;
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &s[..end])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn statuses_are_classified() {
        for (status, retryable) in [
            (400, false),
            (401, false),
            (404, false),
            (408, true),
            (422, false),
            (429, true),
            (500, true),
            (502, true),
            (503, true),
            (504, true),
        ] {
            let e = status_error(status, None, b"");
            assert_eq!(e.is_retryable(), retryable, "{status}");
            assert_eq!(e.reason(), format!("http_{status}"));
        }
    }

    #[test]
    fn retry_after_seconds_are_kept() {
        let e = status_error(429, Some(" 7 "), br#"{"error":{"message":"slow down"}}"#);
        assert_eq!(
            e,
            BackendError::Retryable {
                reason: "http_429".into(),
                message: "slow down".into(),
                retry_after: Some(Duration::from_secs(7)),
            }
        );
        assert_eq!(parse_retry_after("1.5"), Some(Duration::from_millis(1500)));
        assert_eq!(parse_retry_after("Wed, 21 Oct 2015 07:28:00 GMT"), None);
        assert_eq!(parse_retry_after("-1"), None);
    }

    #[test]
    fn messages_come_from_the_usual_error_shapes() {
        assert_eq!(server_message(br#"{"error":{"message":"bad"}}"#), "bad");
        assert_eq!(
            server_message(br#"{"error":"model not found"}"#),
            "model not found"
        );
        assert_eq!(
            server_message(br#"{"detail":[{"msg":"x"}]}"#),
            r#"[{"msg":"x"}]"#
        );
        assert_eq!(server_message(b"  plain text \n"), "plain text");
        let long = "é".repeat(400);
        let t = server_message(long.as_bytes());
        assert!(t.len() <= MAX_MESSAGE + "…".len() && t.ends_with('…'));
    }
}
