//! The request body: a job's payload turned into a streaming chat-completions request.
//! Pure, so every payload shape is tested without a server.

use lastcall_backend::BackendError;
use serde_json::{Map, Value, json};

/// Payload fields copied to the request unchanged when present. All are standard
/// chat-completions parameters that vLLM, llama.cpp and Ollama accept too.
const PASS_THROUGH: &[&str] = &[
    "temperature",
    "top_p",
    "stop",
    "seed",
    "presence_penalty",
    "frequency_penalty",
    "logit_bias",
];

/// Builds the body of `POST /chat/completions` from a job payload.
///
/// - `messages` (an array) is sent as is; otherwise `prompt` (a string) becomes one user
///   message; a payload with neither is a terminal `bad_payload` error.
/// - `model`: the payload's (a route may have put it there; the worker drops one that
///   `--allow-model` does not name), else `default_model`.
/// - `max_tokens`: the payload's (a positive integer), else `default_max_tokens`; at most
///   `limit` either way (a larger request is lowered to it).
/// - the fields in [`PASS_THROUGH`] are copied; everything else in the payload is ignored.
/// - always `stream: true` with `stream_options.include_usage`, so that a server that
///   counts tokens reports them in the last chunk, and so that closing the connection
///   stops the generation (servers notice a disconnect between streamed chunks; some keep
///   generating for a non-streaming request whose client went away).
pub fn chat_body(
    payload: &Map<String, Value>,
    default_model: &str,
    default_max_tokens: u32,
    limit: u32,
) -> Result<Value, BackendError> {
    let messages = match (payload.get("messages"), payload.get("prompt")) {
        (Some(Value::Array(m)), _) if !m.is_empty() => Value::Array(m.clone()),
        (Some(Value::Array(_)), _) => return Err(bad_payload("`messages` is empty")),
        (Some(_), _) => return Err(bad_payload("`messages` must be an array")),
        (None, Some(Value::String(p))) => json!([{ "role": "user", "content": p }]),
        (None, Some(_)) => return Err(bad_payload("`prompt` must be a string")),
        (None, None) => {
            return Err(bad_payload(
                "the payload has neither `messages` nor `prompt`",
            ));
        }
    };
    let model = match payload.get("model") {
        Some(Value::String(m)) if !m.is_empty() => m.clone(),
        Some(Value::String(_)) | None => default_model.to_string(),
        Some(_) => return Err(bad_payload("`model` must be a string")),
    };
    let max_tokens = match payload.get("max_tokens") {
        None | Some(Value::Null) => u64::from(default_max_tokens),
        Some(v) => match v.as_u64() {
            Some(n) if n > 0 => n,
            _ => return Err(bad_payload("`max_tokens` must be a positive integer")),
        },
    }
    .min(u64::from(limit.max(1)));

    let mut body = Map::new();
    body.insert("model".into(), Value::String(model));
    body.insert("messages".into(), messages);
    body.insert("max_tokens".into(), max_tokens.into());
    for key in PASS_THROUGH {
        if let Some(v) = payload.get(*key) {
            body.insert((*key).to_string(), v.clone());
        }
    }
    body.insert("stream".into(), Value::Bool(true));
    body.insert("stream_options".into(), json!({ "include_usage": true }));
    Ok(Value::Object(body))
}

/// The request's `priority` for a job of tier `p`, in vLLM's sense (lower is served
/// earlier; a request without one is 0): lastcall's standard tier is the server's
/// default, so its jobs share the server evenly with other clients' requests.
pub fn engine_priority(p: lastcall_backend::Priority) -> i64 {
    match p {
        lastcall_backend::Priority::Critical => -1,
        lastcall_backend::Priority::Standard => 0,
        lastcall_backend::Priority::Batch => 1,
    }
}

fn bad_payload(message: &str) -> BackendError {
    BackendError::Terminal {
        reason: "bad_payload".into(),
        message: message.into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn body(payload: Value) -> Result<Value, BackendError> {
        chat_body(payload.as_object().unwrap(), "default-model", 64, 1_000)
    }

    #[test]
    fn a_max_tokens_above_the_limit_is_lowered_to_it() {
        let b = body(json!({"prompt": "x", "max_tokens": 18_446_744_073_709_551_615u64})).unwrap();
        assert_eq!(b["max_tokens"], 1_000);
        let b = body(json!({"prompt": "x", "max_tokens": 999})).unwrap();
        assert_eq!(b["max_tokens"], 999);
        // A default above the limit is lowered too.
        let p = json!({"prompt": "x"});
        let b = chat_body(p.as_object().unwrap(), "m", 5_000, 1_000).unwrap();
        assert_eq!(b["max_tokens"], 1_000);
    }

    #[test]
    fn messages_pass_through_with_defaults() {
        let b = body(json!({"messages": [{"role": "user", "content": "hi"}], "extra": 1})).unwrap();
        assert_eq!(
            b,
            json!({
                "model": "default-model",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 64,
                "stream": true,
                "stream_options": {"include_usage": true},
            })
        );
    }

    #[test]
    fn prompt_becomes_a_user_message_and_options_are_copied() {
        let b = body(json!({
            "prompt": "summarise",
            "max_tokens": 10,
            "temperature": 0.0,
            "model": "routed",
            "logit_bias": {"2": -100}
        }))
        .unwrap();
        assert_eq!(
            b["messages"],
            json!([{"role": "user", "content": "summarise"}])
        );
        assert_eq!(b["max_tokens"], 10);
        assert_eq!(b["temperature"], 0.0);
        assert_eq!(b["model"], "routed");
        assert_eq!(b["logit_bias"], json!({"2": -100}));
    }

    #[test]
    fn malformed_payloads_are_terminal() {
        for p in [
            json!({}),
            json!({"messages": "hi"}),
            json!({"messages": []}),
            json!({"prompt": 3}),
            json!({"prompt": "x", "max_tokens": 0}),
            json!({"prompt": "x", "max_tokens": "many"}),
            json!({"prompt": "x", "model": 1}),
        ] {
            let e = body(p.clone()).unwrap_err();
            assert_eq!(e.reason(), "bad_payload", "{p}");
            assert!(!e.is_retryable());
        }
    }

    #[test]
    fn the_engine_priority_follows_the_tiers_and_a_payload_cannot_set_it() {
        use lastcall_backend::Priority;
        let order: Vec<i64> = Priority::ALL.iter().map(|p| engine_priority(*p)).collect();
        assert!(order.windows(2).all(|w| w[0] < w[1]), "{order:?}");
        assert_eq!(
            engine_priority(Priority::Standard),
            0,
            "the server's default"
        );
        // A tenant's own `priority` is not a chat parameter that is passed through.
        let b = body(json!({"prompt": "x", "priority": -100})).unwrap();
        assert!(b.get("priority").is_none(), "{b}");
    }
}
