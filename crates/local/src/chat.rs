//! Reading a chat job's payload and laying it out in the model's ChatML template.
//!
//! Pure functions over values: no model, no IO. The template is not run as Jinja; the crate
//! supports ChatML (`<|im_start|>role\ncontent<|im_end|>\n`, then `<|im_start|>assistant\n`)
//! and reads from the GGUF's `tokenizer.chat_template` only the default system prompt that
//! the template inserts when the conversation has none (SmolLM2 does).

use serde_json::{Map, Value};

/// The default number of tokens to generate when the payload has no `max_tokens`.
pub const DEFAULT_MAX_TOKENS: usize = 96;
/// The default penalty on recently generated tokens (llama.cpp's classic default): greedy
/// decoding of a 135M model repeats itself without one.
pub const DEFAULT_REPEAT_PENALTY: f32 = 1.1;

/// One chat message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// Generation settings read from the payload.
#[derive(Debug, Clone, PartialEq)]
pub struct ChatRequest {
    pub messages: Vec<Message>,
    /// `max_tokens`: the most tokens to generate, [`DEFAULT_MAX_TOKENS`] if absent.
    pub max_tokens: usize,
    /// `temperature`: 0 (the default) decodes greedily, which makes answers reproducible.
    pub temperature: f64,
    /// `repeat_penalty`: divides the logits of the last 64 tokens; 1 disables it.
    pub repeat_penalty: f32,
}

/// Why a payload cannot be served. Retrying the same payload cannot help.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid chat payload: {0}")]
pub struct PayloadError(pub String);

impl ChatRequest {
    /// Read `messages` (`[{"role", "content"}]`) or a `prompt` string (one user message),
    /// `max_tokens`, `temperature` and `repeat_penalty`.
    pub fn from_payload(payload: &Map<String, Value>) -> Result<Self, PayloadError> {
        let messages = match (payload.get("messages"), payload.get("prompt")) {
            (Some(Value::Array(items)), _) => items
                .iter()
                .enumerate()
                .map(|(i, m)| {
                    let field = |name: &str| {
                        m.get(name)
                            .and_then(Value::as_str)
                            .map(str::to_owned)
                            .ok_or_else(|| {
                                PayloadError(format!("messages[{i}].{name} must be a string"))
                            })
                    };
                    Ok(Message {
                        role: field("role")?,
                        content: field("content")?,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?,
            (Some(_), _) => return Err(PayloadError("messages must be an array".into())),
            (None, Some(Value::String(p))) => vec![Message {
                role: "user".into(),
                content: p.clone(),
            }],
            (None, Some(_)) => return Err(PayloadError("prompt must be a string".into())),
            (None, None) => {
                return Err(PayloadError(
                    "needs \"messages\" or a \"prompt\" string".into(),
                ));
            }
        };
        if messages.is_empty() {
            return Err(PayloadError("messages is empty".into()));
        }
        if let Some(m) = messages.iter().find(|m| !valid_role(&m.role)) {
            return Err(PayloadError(format!("invalid role {:?}", m.role)));
        }
        let max_tokens = match payload.get("max_tokens") {
            None | Some(Value::Null) => DEFAULT_MAX_TOKENS,
            Some(v) => v
                .as_u64()
                .filter(|&n| n > 0)
                .ok_or_else(|| PayloadError("max_tokens must be a positive integer".into()))?
                as usize,
        };
        let temperature = match payload.get("temperature") {
            None | Some(Value::Null) => 0.0,
            Some(v) => v
                .as_f64()
                .filter(|t| t.is_finite() && *t >= 0.0)
                .ok_or_else(|| PayloadError("temperature must be a number >= 0".into()))?,
        };
        let repeat_penalty = match payload.get("repeat_penalty") {
            None | Some(Value::Null) => DEFAULT_REPEAT_PENALTY,
            Some(v) => v
                .as_f64()
                .filter(|p| p.is_finite() && (1.0..=10.0).contains(p))
                .ok_or_else(|| PayloadError("repeat_penalty must be a number in [1, 10]".into()))?
                as f32,
        };
        Ok(ChatRequest {
            messages,
            max_tokens,
            temperature,
            repeat_penalty,
        })
    }
}

/// A role is a short name; it must not smuggle template syntax into the prompt.
fn valid_role(role: &str) -> bool {
    !role.is_empty()
        && role.len() <= 32
        && role
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-')
}

/// One piece of a rendered prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Segment {
    /// A control token written by the template (`<|im_start|>`, `<|im_end|>`).
    Control(&'static str),
    /// Text to tokenize as plain text: control-token syntax in it stays text, so message
    /// content cannot open or close turns.
    Text(String),
}

/// The ChatML layout of a model.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct ChatTemplate {
    /// The system prompt the template inserts when the first message is not `system`.
    pub default_system: Option<String>,
}

const IM_START: &str = "<|im_start|>";
const IM_END: &str = "<|im_end|>";

impl ChatTemplate {
    /// Recognise a ChatML template (`tokenizer.chat_template`) and read its default system
    /// prompt. `None` if the template is not ChatML.
    pub fn from_template(template: &str) -> Option<Self> {
        if !template.contains(IM_START) || !template.contains(IM_END) {
            return None;
        }
        let marker = "<|im_start|>system\n";
        let default_system = template.find(marker).and_then(|at| {
            let rest = &template[at + marker.len()..];
            let end = rest.find(IM_END)?;
            let text = &rest[..end];
            // Only a literal prompt counts, not a `{{ message['content'] }}` expression.
            (!text.contains("{{") && !text.contains("'") && !text.is_empty())
                .then(|| text.to_owned())
        });
        Some(ChatTemplate { default_system })
    }

    /// Lay out a conversation and the opening of the assistant's turn.
    pub fn render(&self, messages: &[Message]) -> Vec<Segment> {
        let mut out = Vec::new();
        let mut turn = |role: &str, content: &str| {
            out.push(Segment::Control(IM_START));
            out.push(Segment::Text(format!("{role}\n{content}")));
            out.push(Segment::Control(IM_END));
            out.push(Segment::Text("\n".into()));
        };
        if let Some(system) = &self.default_system
            && messages.first().is_some_and(|m| m.role != "system")
        {
            turn("system", system);
        }
        for m in messages {
            turn(&m.role, &m.content);
        }
        out.push(Segment::Control(IM_START));
        out.push(Segment::Text("assistant\n".into()));
        out
    }
}

/// The rendered prompt as one string, for logs and for comparing with other tokenizers.
pub fn to_text(segments: &[Segment]) -> String {
    segments
        .iter()
        .map(|s| match s {
            Segment::Control(t) => *t,
            Segment::Text(t) => t.as_str(),
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    const SMOLLM2_TEMPLATE: &str = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

    fn payload(v: Value) -> Map<String, Value> {
        v.as_object().unwrap().clone()
    }

    #[test]
    fn reads_the_default_system_prompt_of_smollm2() {
        let t = ChatTemplate::from_template(SMOLLM2_TEMPLATE).unwrap();
        assert_eq!(
            t.default_system.as_deref(),
            Some("You are a helpful AI assistant named SmolLM, trained by Hugging Face")
        );
        assert_eq!(ChatTemplate::from_template("{{ bos_token }}[INST]"), None);
    }

    #[test]
    fn renders_chatml_with_the_default_system_prompt() {
        let t = ChatTemplate::from_template(SMOLLM2_TEMPLATE).unwrap();
        let req = ChatRequest::from_payload(&payload(json!({"prompt": "Hi"}))).unwrap();
        assert_eq!(
            to_text(&t.render(&req.messages)),
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by \
             Hugging Face<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        let own_system = [
            Message {
                role: "system".into(),
                content: "Be brief.".into(),
            },
            Message {
                role: "user".into(),
                content: "Hi".into(),
            },
        ];
        assert_eq!(
            to_text(&t.render(&own_system)),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n\
             <|im_start|>assistant\n"
        );
    }

    #[test]
    fn reads_messages_and_options() {
        let req = ChatRequest::from_payload(&payload(json!({
            "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
            "max_tokens": 7,
            "temperature": 0.5
        })))
        .unwrap();
        assert_eq!(req.messages.len(), 2);
        assert_eq!(req.max_tokens, 7);
        assert_eq!(req.temperature, 0.5);
        let d = ChatRequest::from_payload(&payload(json!({"prompt": "x"}))).unwrap();
        assert_eq!(
            (d.max_tokens, d.temperature, d.repeat_penalty),
            (DEFAULT_MAX_TOKENS, 0.0, DEFAULT_REPEAT_PENALTY)
        );
    }

    #[test]
    fn rejects_bad_payloads() {
        for bad in [
            json!({}),
            json!({"messages": []}),
            json!({"messages": "hi"}),
            json!({"messages": [{"role": "user"}]}),
            json!({"messages": [{"role": "user<|im_end|>", "content": "x"}]}),
            json!({"prompt": 3}),
            json!({"prompt": "x", "max_tokens": 0}),
            json!({"prompt": "x", "max_tokens": -1}),
            json!({"prompt": "x", "temperature": -0.1}),
            json!({"prompt": "x", "repeat_penalty": 0.5}),
        ] {
            assert!(
                ChatRequest::from_payload(&payload(bad.clone())).is_err(),
                "{bad}"
            );
        }
    }
}
