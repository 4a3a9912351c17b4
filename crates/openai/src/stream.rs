//! Assembling a completion from the `data` of streamed chat-completion chunks. Pure.

use lastcall_backend::{BackendError, Usage};
use serde_json::Value;

/// What the stream has delivered so far.
#[derive(Debug, Default)]
pub struct Assembly {
    pub text: String,
    /// Chunks that carried non-empty content. Servers send one token per chunk, so this is
    /// the completion-token estimate used when the server reports no usage.
    pub content_chunks: u64,
    /// The usage the server reported (the final chunk, with `include_usage`).
    pub usage: Option<Usage>,
    pub model: Option<String>,
    pub finish_reason: Option<String>,
    /// `[DONE]` was received.
    pub done: bool,
}

/// What one event meant.
#[derive(Debug, PartialEq, Eq)]
pub enum Step {
    /// A chunk without content (role announcement, finish reason, usage, keep-alive).
    Quiet,
    /// A chunk that added text.
    Content,
    /// `[DONE]`: the server finished the stream.
    Done,
}

impl Assembly {
    /// Takes the `data` of one event.
    pub fn on_event(&mut self, data: &str) -> Result<Step, BackendError> {
        let data = data.trim();
        if data == "[DONE]" {
            self.done = true;
            return Ok(Step::Done);
        }
        if data.is_empty() {
            return Ok(Step::Quiet);
        }
        let chunk: Value = serde_json::from_str(data).map_err(|e| BackendError::Retryable {
            reason: "bad_stream".into(),
            message: format!("a streamed chunk is not JSON: {e}"),
            retry_after: None,
        })?;
        if let Some(err) = chunk.get("error") {
            // vLLM and others report a failure after the 200 status as an error chunk.
            let message = err
                .get("message")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| err.to_string());
            return Err(BackendError::Retryable {
                reason: "stream_error".into(),
                message: crate::classify::truncate(&message, 500),
                retry_after: None,
            });
        }
        if let Some(m) = chunk.get("model").and_then(Value::as_str) {
            self.model = Some(m.to_string());
        }
        if let Some(u) = chunk.get("usage").filter(|u| u.is_object()) {
            // Clamped: the server's counts are advice, and are summed afterwards.
            let count = |k: &str| u.get(k).and_then(Value::as_u64).unwrap_or(0);
            self.usage = Some(Usage::reported(
                count("prompt_tokens"),
                count("completion_tokens"),
            ));
        }
        let mut step = Step::Quiet;
        if let Some(choice) = chunk.pointer("/choices/0") {
            if let Some(content) = choice.pointer("/delta/content").and_then(Value::as_str)
                && !content.is_empty()
            {
                self.text.push_str(content);
                self.content_chunks += 1;
                step = Step::Content;
            }
            if let Some(reason) = choice.get("finish_reason").and_then(Value::as_str) {
                self.finish_reason = Some(reason.to_string());
            }
        }
        Ok(step)
    }

    /// Checks the stream ended properly once the body is over.
    ///
    /// A stream that closes before `[DONE]` was cut (server crash, proxy timeout), and one
    /// that ends without a finish reason was stopped early by the server (llama-cpp-python
    /// with `interrupt_requests` ends a stream that way when another request queues
    /// behind it): both are retryable, never a silently truncated success.
    pub fn finish(&self) -> Result<(), BackendError> {
        if !self.done {
            return Err(BackendError::Retryable {
                reason: "stream_truncated".into(),
                message: format!(
                    "the stream closed before [DONE] after {} content chunks",
                    self.content_chunks
                ),
                retry_after: None,
            });
        }
        if self.finish_reason.is_none() {
            return Err(BackendError::Retryable {
                reason: "stream_incomplete".into(),
                message: format!(
                    "the server ended the stream without a finish reason after {} content chunks",
                    self.content_chunks
                ),
                retry_after: None,
            });
        }
        Ok(())
    }

    /// The usage to report: the server's, else an estimate.
    ///
    /// The estimate counts content chunks as completion tokens (servers stream one token
    /// per chunk) and reports `prompt_tokens` as 0, because the prompt was never
    /// tokenized here. The flag says which one it is.
    pub fn usage(&self) -> (Usage, bool) {
        match self.usage {
            Some(u) => (u, false),
            None => (
                Usage {
                    prompt_tokens: 0,
                    completion_tokens: self.content_chunks,
                },
                true,
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn chunk(content: Option<&str>, finish: Option<&str>) -> String {
        serde_json::json!({
            "model": "m",
            "choices": [{"index": 0, "delta": {"content": content}, "finish_reason": finish}]
        })
        .to_string()
    }

    #[test]
    fn text_and_estimated_usage_without_a_usage_chunk() {
        let mut a = Assembly::default();
        let role = r#"{"choices":[{"index":0,"delta":{"role":"assistant"},"finish_reason":null}]}"#;
        assert_eq!(a.on_event(role).unwrap(), Step::Quiet);
        assert_eq!(
            a.on_event(&chunk(Some("Hel"), None)).unwrap(),
            Step::Content
        );
        assert_eq!(a.on_event(&chunk(Some("lo"), None)).unwrap(), Step::Content);
        assert_eq!(a.on_event(&chunk(None, Some("stop"))).unwrap(), Step::Quiet);
        assert_eq!(a.on_event("[DONE]").unwrap(), Step::Done);
        a.finish().unwrap();
        assert_eq!(a.text, "Hello");
        assert_eq!(a.model.as_deref(), Some("m"));
        assert_eq!(
            a.usage(),
            (
                Usage {
                    prompt_tokens: 0,
                    completion_tokens: 2
                },
                true
            )
        );
    }

    #[test]
    fn reported_usage_wins() {
        let mut a = Assembly::default();
        a.on_event(&chunk(Some("x"), Some("length"))).unwrap();
        a.on_event(
            r#"{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":1,"total_tokens":6}}"#,
        )
        .unwrap();
        a.on_event("[DONE]").unwrap();
        a.finish().unwrap();
        assert_eq!(
            a.usage(),
            (
                Usage {
                    prompt_tokens: 5,
                    completion_tokens: 1
                },
                false
            )
        );
    }

    #[test]
    fn cut_interrupted_and_failed_streams_are_retryable() {
        let mut a = Assembly::default();
        a.on_event(&chunk(Some("x"), None)).unwrap();
        assert_eq!(a.finish().unwrap_err().reason(), "stream_truncated");
        a.on_event("[DONE]").unwrap();
        assert_eq!(a.finish().unwrap_err().reason(), "stream_incomplete");
        let e = Assembly::default()
            .on_event(r#"{"error":{"message":"engine died"}}"#)
            .unwrap_err();
        assert_eq!(e.reason(), "stream_error");
        assert!(e.to_string().contains("engine died"));
        let e = Assembly::default().on_event("{not json").unwrap_err();
        assert_eq!(e.reason(), "bad_stream");
    }
}
