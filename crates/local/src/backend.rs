//! [`LocalBackend`]: the [`Backend`] that decodes with an in-process quantized llama model.

use crate::LocalError;
use crate::chat::{ChatRequest, ChatTemplate, Segment};
use crate::tokenizer::Tokenizer;
use candle_core::quantized::gguf_file::Content;
use candle_core::{Device, Tensor};
use candle_transformers::generation::LogitsProcessor;
use candle_transformers::models::quantized_llama::ModelWeights;
use lastcall_backend::{
    Backend, BackendError, CallFuture, CallOutput, CallRequest, CancellationToken, Deltas,
    RequestSize, Usage,
};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Prompt tokens fed per forward pass during prefill; cancellation is checked between chunks.
/// Candle's quantized CPU matmul costs about the same per row whatever the batch, so small
/// chunks cost little throughput and bound the cancellation lag during prefill to about
/// this many token times.
const PREFILL_CHUNK: usize = 4;
/// How many recent tokens the repeat penalty looks at.
const REPEAT_LAST_N: usize = 64;
/// The seed of temperature sampling, fixed so that a retried job samples the same way.
const SEED: u64 = 299_792_458;

/// An in-process chat backend running a GGUF llama-architecture model on the CPU.
///
/// **Concurrency**: an instance holds one KV cache and decodes through `&mut` access to its
/// model, so it serves one call at a time: calls on the same instance queue on an async
/// mutex, and waiting for it honours the call's cancellation token and timeout like decoding
/// does. ([`Clone`] gives another handle to the *same* instance.) For calls at the same time,
/// make more instances with [`LocalBackend::new_instance`] ([`crate::LocalPool`] makes one
/// per worker slot): they share this one's weights and tokenizer, loaded once, and each has
/// only its own KV cache and sampling state, so they decode independently and concurrently.
/// Candle spreads each matmul over its thread pool (`RAYON_NUM_THREADS`, default: the
/// physical cores), so instances on a small machine share the same cores.
#[derive(Clone)]
pub struct LocalBackend {
    /// This instance's model: the shared weights and its own KV cache.
    model: Arc<tokio::sync::Mutex<ModelWeights>>,
    /// What every instance of the loaded model shares.
    shared: Arc<Shared>,
}

/// The loaded model, shared by all its instances.
struct Shared {
    /// The weights as loaded, never run: its KV caches stay empty. Each instance runs a
    /// clone, and cloning `ModelWeights` copies only reference-counted handles to the weight
    /// tensors (see [`LocalBackend::new_instance`]), not the tensors.
    weights: ModelWeights,
    tokenizer: Arc<Tokenizer>,
    template: ChatTemplate,
    /// `<|im_start|>`, `<|im_end|>`: the ids of the template's control tokens.
    im_start: u32,
    im_end: u32,
    /// The model's context length: prompt plus generated tokens must fit.
    context_len: usize,
    /// The name reported in [`CallOutput::model`], from the file name.
    model_name: String,
}

impl std::fmt::Debug for LocalBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LocalBackend")
            .field("model_name", &self.shared.model_name)
            .field("context_len", &self.shared.context_len)
            .field("vocab_size", &self.shared.tokenizer.vocab_size())
            .finish_non_exhaustive()
    }
}

impl LocalBackend {
    /// Load a GGUF chat model (llama architecture, byte-level BPE vocabulary with the
    /// `smollm` pre-tokenizer, ChatML template) onto the CPU.
    pub fn load(path: impl AsRef<Path>) -> Result<Self, LocalError> {
        let path = path.as_ref();
        let started = Instant::now();
        let mut file = std::fs::File::open(path).map_err(|source| LocalError::Open {
            path: path.to_owned(),
            source,
        })?;
        let content = Content::read(&mut file).map_err(LocalError::Gguf)?;
        let tokenizer = Tokenizer::from_gguf(&content)?;
        let template_src = content
            .metadata
            .get("tokenizer.chat_template")
            .and_then(|v| v.to_string().ok())
            .ok_or(LocalError::BadMetadata {
                key: "tokenizer.chat_template",
                message: "missing".into(),
            })?;
        let template = ChatTemplate::from_template(template_src)
            .ok_or_else(|| LocalError::Unsupported("a chat template other than ChatML".into()))?;
        let control = |text: &str| {
            tokenizer
                .token_id(text)
                .ok_or_else(|| LocalError::Unsupported(format!("a vocabulary without {text}")))
        };
        let (im_start, im_end) = (control("<|im_start|>")?, control("<|im_end|>")?);
        let context_len = content
            .metadata
            .get("llama.context_length")
            .and_then(|v| v.to_u32().ok())
            .unwrap_or(2048) as usize;
        let model =
            ModelWeights::from_gguf(content, &mut file, &Device::Cpu).map_err(LocalError::Gguf)?;
        let model_name = model_name_from_path(path);
        tracing::info!(
            model = %model_name,
            load_ms = started.elapsed().as_millis() as u64,
            "local model loaded"
        );
        let shared = Arc::new(Shared {
            weights: model,
            tokenizer: Arc::new(tokenizer),
            template,
            im_start,
            im_end,
            context_len,
            model_name,
        });
        Ok(LocalBackend::instance_of(shared))
    }

    /// Another instance of this model, for another call at the same time: it shares this
    /// instance's weights and tokenizer (nothing is read from the file or copied) and has its
    /// own, empty KV cache, so the two decode independently and concurrently. An instance
    /// costs the model's small per-instance state plus, while it serves a call, its KV cache
    /// (46 KB per token of context for SmolLM2-135M).
    ///
    /// The weights are shared because candle's `ModelWeights` (quantized_llama.rs, 0.11)
    /// is `#[derive(Clone)]` over reference-counted parts: each quantized matrix is a
    /// `QMatMul::QTensor(Arc<QTensor>)`, and the embedding table, norms and RoPE tables are
    /// `Tensor`s, which are `Arc<Tensor_>` handles. Cloning bumps those counts; the only
    /// per-clone state that matters is the KV cache (`kv_cache: Option<(Tensor, Tensor)>`
    /// per layer), which [`ModelWeights::clear_kv_cache`] empties and which `forward`
    /// replaces (`Tensor::cat` into a new tensor) rather than writes in place, and the
    /// attention-mask cache, a `HashMap` each clone owns. Forward passes only read the
    /// weights, so instances can run them at the same time.
    pub fn new_instance(&self) -> LocalBackend {
        LocalBackend::instance_of(self.shared.clone())
    }

    fn instance_of(shared: Arc<Shared>) -> LocalBackend {
        let mut model = shared.weights.clone();
        model.clear_kv_cache();
        LocalBackend {
            model: Arc::new(tokio::sync::Mutex::new(model)),
            shared,
        }
    }

    /// Whether `other` runs on the same loaded weights as this instance (made by
    /// [`LocalBackend::new_instance`] from it, or from the same [`LocalBackend::load`]).
    pub fn shares_weights_with(&self, other: &LocalBackend) -> bool {
        Arc::ptr_eq(&self.shared, &other.shared)
    }

    /// Whether `other` is a handle to this same instance (a [`Clone`]), whose calls queue
    /// behind this one's.
    pub fn is_same_instance(&self, other: &LocalBackend) -> bool {
        Arc::ptr_eq(&self.model, &other.model)
    }

    /// The tokenizer read from the model file.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.shared.tokenizer
    }

    /// The model name reported in each [`CallOutput`].
    pub fn model_name(&self) -> &str {
        &self.shared.model_name
    }

    /// The prompt ids for a conversation: template control tokens by id, message text
    /// tokenized as plain text.
    pub fn prompt_ids(&self, chat: &ChatRequest) -> Vec<u32> {
        let shared = &*self.shared;
        let mut ids = Vec::new();
        for seg in shared.template.render(&chat.messages) {
            match seg {
                Segment::Control("<|im_start|>") => ids.push(shared.im_start),
                Segment::Control(_) => ids.push(shared.im_end),
                Segment::Text(t) => ids.extend(shared.tokenizer.encode(&t, false)),
            }
        }
        ids
    }

    async fn run(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Option<Deltas>,
    ) -> Result<CallOutput, BackendError> {
        let deadline = Instant::now() + req.timeout;
        let chat = ChatRequest::from_payload(&req.payload).map_err(|e| BackendError::Terminal {
            reason: "invalid_payload".into(),
            message: e.to_string(),
        })?;
        let prompt = self.prompt_ids(&chat);
        let context_len = self.shared.context_len;
        if prompt.len() >= context_len {
            return Err(BackendError::Terminal {
                reason: "prompt_too_long".into(),
                message: format!(
                    "prompt of {} tokens does not fit the context of {}",
                    prompt.len(),
                    context_len
                ),
            });
        }
        let max_tokens = chat.max_tokens.min(context_len - prompt.len());

        // `stop` also fires when this future is dropped, so an abandoned call's decode loop
        // ends at its next token instead of running to max_tokens.
        let stop = cancel.child_token();
        let _stop_on_drop = stop.clone().drop_guard();
        let model = tokio::select! {
            m = self.model.clone().lock_owned() => m,
            _ = stop.cancelled() => return Err(BackendError::Cancelled { confirmed: true }),
            _ = tokio::time::sleep_until(deadline.into()) => {
                return Err(BackendError::Cancelled { confirmed: true });
            }
        };
        let tokenizer = self.shared.tokenizer.clone();
        let job_id = req.job_id.clone();
        let params = Params {
            max_tokens,
            temperature: chat.temperature,
            repeat_penalty: chat.repeat_penalty,
        };
        let should_stop = move || stop.is_cancelled() || Instant::now() >= deadline;
        let mut streamer = deltas.map(|d| TextStreamer::new(d, tokenizer.clone()));
        let task = tokio::task::spawn_blocking(move || {
            let mut model = model;
            let mut on_token = |ids: &[u32]| {
                if let Some(s) = &mut streamer {
                    s.on_tokens(ids);
                }
            };
            let out = generate(
                &mut model,
                &tokenizer,
                &prompt,
                &params,
                &should_stop,
                &mut on_token,
            );
            if let (Ok(g), Some(s)) = (&out, &mut streamer) {
                s.finish(&g.completion); // the rest, whatever it ends with
            }
            // The next call starts at position 0, which ignores the cache anyway: dropping it
            // now keeps an idle instance from holding its last conversation's KV tensors.
            model.clear_kv_cache();
            out
        });
        let out = match task.await {
            Ok(Ok(out)) => out,
            Ok(Err(GenError::Stopped)) => return Err(BackendError::Cancelled { confirmed: true }),
            Ok(Err(GenError::Model(e))) => {
                return Err(BackendError::Terminal {
                    reason: "local_model_error".into(),
                    message: e.to_string(),
                });
            }
            Err(e) => {
                return Err(BackendError::Terminal {
                    reason: "local_panic".into(),
                    message: e.to_string(),
                });
            }
        };
        let text = self.shared.tokenizer.decode(&out.completion);
        let tokens_per_second = out.tokens_per_second();
        tracing::debug!(
            job_id = %job_id,
            prompt_tokens = out.prompt_tokens,
            completion_tokens = out.completion.len(),
            prefill_ms = out.prefill.as_millis() as u64,
            decode_ms = out.decode.as_millis() as u64,
            "local generation finished"
        );
        Ok(CallOutput {
            text,
            usage: Some(Usage {
                prompt_tokens: out.prompt_tokens as u64,
                completion_tokens: out.completion.len() as u64,
            }),
            model: Some(self.shared.model_name.clone()),
            tokens_per_second,
        })
    }
}

impl LocalBackend {
    /// The size of a chat payload with the prompt's tokens counted exactly: the ids this
    /// backend would feed the model (the template's included, [`Self::prompt_ids`]), the
    /// count its calls report. A payload that is not a chat request keeps the
    /// approximation's answer (its call fails anyway).
    pub fn counted_size(
        &self,
        payload: &serde_json::Map<String, serde_json::Value>,
    ) -> Option<RequestSize> {
        let approx = RequestSize::of_payload(payload)?;
        match ChatRequest::from_payload(payload) {
            Ok(chat) => Some(RequestSize {
                prompt_tokens: self.prompt_ids(&chat).len() as u64,
                ..approx
            }),
            Err(_) => Some(approx),
        }
    }
}

impl Backend for LocalBackend {
    fn name(&self) -> &str {
        "local"
    }

    fn request_size(
        &self,
        _kind: &str,
        payload: &serde_json::Map<String, serde_json::Value>,
    ) -> Option<RequestSize> {
        self.counted_size(payload)
    }

    fn counts_prompt_tokens(&self, _kind: &str) -> bool {
        true
    }

    fn call(&self, req: CallRequest, cancel: CancellationToken) -> CallFuture<'_> {
        Box::pin(self.run(req, cancel, None))
    }

    /// The text as it is decoded, a delta per token (held back while a token ends inside
    /// a UTF-8 character).
    fn call_streaming(
        &self,
        req: CallRequest,
        cancel: CancellationToken,
        deltas: Deltas,
    ) -> CallFuture<'_> {
        Box::pin(self.run(req, cancel, Some(deltas)))
    }
}

/// Turns the growing list of generated ids into text deltas: the decoded text beyond what
/// was sent, once it does not end in a partial character.
struct TextStreamer {
    deltas: Option<Deltas>,
    tokenizer: Arc<Tokenizer>,
    sent: String,
}

impl TextStreamer {
    fn new(deltas: Deltas, tokenizer: Arc<Tokenizer>) -> Self {
        Self {
            deltas: Some(deltas),
            tokenizer,
            sent: String::new(),
        }
    }

    fn on_tokens(&mut self, completion: &[u32]) {
        let text = self.tokenizer.decode(completion);
        if !text.ends_with('\u{FFFD}') {
            self.send_rest(&text);
        }
    }

    /// The final text: whatever was held back.
    fn finish(&mut self, completion: &[u32]) {
        let text = self.tokenizer.decode(completion);
        self.send_rest(&text);
    }

    fn send_rest(&mut self, text: &str) {
        let Some(d) = &self.deltas else { return };
        let Some(rest) = text.strip_prefix(self.sent.as_str()) else {
            return; // cannot happen with byte-level decoding; the reader completes the text
        };
        if rest.is_empty() {
            return;
        }
        if d.send(rest) {
            self.sent.push_str(rest);
        } else {
            self.deltas = None;
        }
    }
}

/// `SmolLM2-135M-Instruct.Q4_1.gguf` -> `SmolLM2-135M-Instruct-Q4_1`.
fn model_name_from_path(path: &Path) -> String {
    path.file_stem()
        .map(|s| s.to_string_lossy().replace('.', "-"))
        .unwrap_or_else(|| "local".into())
}

#[derive(Debug, Clone)]
struct Params {
    max_tokens: usize,
    temperature: f64,
    repeat_penalty: f32,
}

#[derive(Debug)]
enum GenError {
    /// The call was cancelled or reached its timeout; the loop has exited.
    Stopped,
    Model(candle_core::Error),
}

impl From<candle_core::Error> for GenError {
    fn from(e: candle_core::Error) -> Self {
        GenError::Model(e)
    }
}

#[derive(Debug)]
struct Generation {
    prompt_tokens: usize,
    /// Generated ids, without the closing control token.
    completion: Vec<u32>,
    prefill: Duration,
    /// Time spent in one-token forward passes.
    decode: Duration,
    decode_steps: usize,
}

impl Generation {
    /// Decode speed: one-token forward passes per second (prefill excluded).
    fn tokens_per_second(&self) -> Option<f64> {
        let secs = self.decode.as_secs_f64();
        (self.decode_steps > 0 && secs > 0.0).then(|| self.decode_steps as f64 / secs)
    }
}

/// The decode loop. `should_stop` is polled between prefill chunks and before every token.
fn generate(
    model: &mut ModelWeights,
    tokenizer: &Tokenizer,
    prompt: &[u32],
    params: &Params,
    should_stop: &dyn Fn() -> bool,
    on_token: &mut dyn FnMut(&[u32]),
) -> Result<Generation, GenError> {
    let device = Device::Cpu;
    let mut sampler = LogitsProcessor::new(SEED, Some(params.temperature), None);
    let started = Instant::now();

    // Prefill. `index_pos == 0` on the first chunk resets the KV cache of the last call.
    let mut logits = None;
    for (i, chunk) in prompt.chunks(PREFILL_CHUNK).enumerate() {
        if should_stop() {
            return Err(GenError::Stopped);
        }
        let input = Tensor::new(chunk, &device)?.unsqueeze(0)?;
        logits = Some(model.forward(&input, i * PREFILL_CHUNK)?);
    }
    let mut logits = logits.ok_or_else(|| candle_core::Error::Msg("empty prompt".into()))?;
    let prefill = started.elapsed();

    let mut all: Vec<u32> = prompt.to_vec();
    let mut completion = Vec::new();
    let mut decode = Duration::ZERO;
    let mut decode_steps = 0;
    loop {
        let logits_1d = logits.squeeze(0)?;
        let recent = &all[all.len().saturating_sub(REPEAT_LAST_N)..];
        let logits_1d = candle_transformers::utils::apply_repeat_penalty(
            &logits_1d,
            params.repeat_penalty,
            recent,
        )?;
        let next = sampler.sample(&logits_1d)?;
        if next == tokenizer.eos_id() || tokenizer.is_control(next) {
            break;
        }
        completion.push(next);
        all.push(next);
        on_token(&completion);
        if completion.len() >= params.max_tokens {
            break;
        }
        if should_stop() {
            return Err(GenError::Stopped);
        }
        let step = Instant::now();
        let input = Tensor::new(&[next], &device)?.unsqueeze(0)?;
        logits = model.forward(&input, all.len() - 1)?;
        decode += step.elapsed();
        decode_steps += 1;
    }
    Ok(Generation {
        prompt_tokens: prompt.len(),
        completion,
        prefill,
        decode,
        decode_steps,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn model_name_comes_from_the_file_name() {
        assert_eq!(
            model_name_from_path(Path::new("/x/SmolLM2-135M-Instruct.Q4_1.gguf")),
            "SmolLM2-135M-Instruct-Q4_1"
        );
    }
}
