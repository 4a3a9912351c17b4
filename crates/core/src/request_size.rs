//! The size of a request, for a call-time estimate that depends on it
//! ([`crate::service_time::ServiceTimes::estimate_for`]).
//!
//! Prefill grows with the prompt's tokens and decode with the output's, so a kind that
//! mixes short and long prompts has no single call time. The worker reads the size from
//! the job's payload before the call:
//! - **prompt tokens**: the characters of `prompt`, or of every `content` string in
//!   `messages`, divided by [`CHARS_PER_TOKEN`] (4, the usual rule of thumb for English
//!   with BPE tokenizers), rounded up; plus [`TOKENS_PER_MESSAGE`] per message (the
//!   chat template's role markers). It is an approximation, for a worker without the
//!   model's tokenizer (the `local` backend counts with its own, through
//!   `Backend::request_size`) and for the door. The tokens a call used, as its server
//!   counted them (`usage`), refine it: the estimator fits the counts and predicts from
//!   this measure × the kind's calibration, the counted ÷ measured tokens of its recent
//!   calls (`ServiceTimes::observe_counted`), so a constant factor off costs nothing, and
//!   only its noise shows in the error quantile.
//! - **output tokens**: the payload's `max_tokens`, when it sets one (the cap; the
//!   learned fit absorbs how much of it is used).
//!
//! Pure: no IO.

use serde_json::{Map, Value};

/// Characters per token of the approximation.
pub const CHARS_PER_TOKEN: u64 = 4;
/// Tokens counted per chat message for its template (role markers, separators).
pub const TOKENS_PER_MESSAGE: u64 = 4;

/// What is known of a request's size before its call.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RequestSize {
    /// The approximate prompt tokens (see the module doc).
    pub prompt_tokens: u64,
    /// The payload's `max_tokens`, if it sets one.
    pub max_tokens: Option<u64>,
}

impl RequestSize {
    /// The size of a job's payload; `None` when it has neither a `prompt` string nor a
    /// `messages` array (a kind whose payload is not a chat request: its estimate is the
    /// per-kind one).
    pub fn of_payload(payload: &Map<String, Value>) -> Option<Self> {
        let (chars, messages) = match (payload.get("messages"), payload.get("prompt")) {
            (Some(Value::Array(m)), _) => {
                let chars = m.iter().map(content_chars).sum::<u64>();
                (chars, m.len() as u64)
            }
            (None, Some(Value::String(p))) => (p.chars().count() as u64, 1),
            _ => return None,
        };
        let prompt_tokens = chars.div_ceil(CHARS_PER_TOKEN) + TOKENS_PER_MESSAGE * messages;
        let max_tokens = payload.get("max_tokens").and_then(Value::as_u64);
        Some(Self {
            prompt_tokens,
            max_tokens,
        })
    }

    /// The regressors of the call-time fit: prompt tokens and output tokens (0 when the
    /// payload sets no cap: the backend's default, the same for every such job).
    pub(crate) fn features(&self) -> [f64; 2] {
        [
            self.prompt_tokens as f64,
            self.max_tokens.unwrap_or(0) as f64,
        ]
    }
}

/// The characters of a message's `content`: a string, or the `text` of its parts.
fn content_chars(message: &Value) -> u64 {
    match message.get("content") {
        Some(Value::String(s)) => s.chars().count() as u64,
        Some(Value::Array(parts)) => (parts.iter())
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(|t| t.chars().count() as u64)
            .sum(),
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn size(v: Value) -> Option<RequestSize> {
        RequestSize::of_payload(v.as_object().unwrap())
    }

    #[test]
    fn prompts_and_messages_are_measured() {
        let s = size(json!({"prompt": "x".repeat(40), "max_tokens": 64})).unwrap();
        assert_eq!(s.prompt_tokens, 10 + TOKENS_PER_MESSAGE);
        assert_eq!(s.max_tokens, Some(64));
        let s = size(json!({"messages": [
            {"role": "system", "content": "abcd"},
            {"role": "user", "content": [{"type": "text", "text": "abcdefgh"}]}
        ]}))
        .unwrap();
        assert_eq!(s.prompt_tokens, 3 + 2 * TOKENS_PER_MESSAGE);
        assert_eq!(s.max_tokens, None);
        assert_eq!(size(json!({"text": "not a chat request"})), None);
    }
}
