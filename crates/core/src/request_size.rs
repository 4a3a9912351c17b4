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
//! - **forwarded tokens** ([`forwarded_tokens`]), what the door's `tokens_per_minute`
//!   quota counts: the same rule over everything the payload forwards to the model (the
//!   backends send the whole payload: `tool_calls` arguments, `tools`, names, not only the
//!   `content` strings), its JSON's characters ÷ [`CHARS_PER_TOKEN`], never less than the
//!   prompt tokens. A client cannot pass a large request under a quota in fields the
//!   prompt measure skips.
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

/// The tokens a quota counts for `payload`: the characters of its JSON (everything the
/// backends forward to the model) ÷ [`CHARS_PER_TOKEN`], rounded up, and at least the
/// prompt tokens of [`RequestSize::of_payload`]. See the module doc.
pub fn forwarded_tokens(payload: &Map<String, Value>) -> u64 {
    let chars = serde_json::to_string(payload)
        .map_or(0, |s| s.chars().count() as u64)
        .div_ceil(CHARS_PER_TOKEN);
    let prompt = RequestSize::of_payload(payload).map_or(0, |s| s.prompt_tokens);
    chars.max(prompt)
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

    /// What the quota counts: every forwarded field, not only `content`.
    #[test]
    fn forwarded_tokens_count_everything_forwarded() {
        let tokens = |v: Value| forwarded_tokens(v.as_object().unwrap());
        let call = json!({"messages": [{"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function",
             "function": {"name": "f", "arguments": "x".repeat(40_000)}}]}]});
        assert_eq!(
            size(call.clone()).unwrap().prompt_tokens,
            TOKENS_PER_MESSAGE
        );
        assert!(tokens(call) >= 10_000);
        let tools = json!({"messages": [{"role": "user", "content": "hi"}],
                           "tools": [{"description": "y".repeat(4_000)}]});
        assert!(tokens(tools) >= 1_000);
        // Never less than the prompt measure (one short message: its template tokens).
        let short = json!({"messages": [{"role": "user", "content": "abcd"}]});
        assert!(tokens(short.clone()) >= size(short).unwrap().prompt_tokens);
        assert_eq!(tokens(json!({})), 1, "two characters: an empty object");
    }
}
