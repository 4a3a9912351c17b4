//! A GPT-2-style byte-level BPE tokenizer built from a GGUF file's metadata.
//!
//! It reproduces llama.cpp's tokenization for `tokenizer.ggml.model = "gpt2"` vocabularies
//! with the `smollm` pre-tokenizer (SmolLM, SmolLM2): no prefix space, every numeric
//! character its own pre-token, then the GPT-2 split
//! `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`.
//! `tests/tokenizer.rs` checks the ids against llama.cpp's on a fixture.
//!
//! Special tokens (control and user-defined entries of `tokenizer.ggml.token_type`) are cut
//! out of the text first, longest first as llama.cpp does, and map to their single ids.

use crate::LocalError;
use candle_core::quantized::gguf_file::{Content, Value};
use regex::Regex;
use std::collections::HashMap;
use std::path::Path;

/// `tokenizer.ggml.token_type` values (llama.cpp's `llama_token_type`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
}

impl TokenType {
    fn from_gguf(v: i32) -> Self {
        match v {
            2 => TokenType::Unknown,
            3 => TokenType::Control,
            4 => TokenType::UserDefined,
            5 => TokenType::Unused,
            6 => TokenType::Byte,
            _ => TokenType::Normal,
        }
    }
}

/// The pre-tokenizers this implementation knows (`tokenizer.ggml.pre`).
const SUPPORTED_PRE: &[&str] = &["smollm"];

/// The GPT-2 split without its `\s+(?!\S)` lookahead, which [`Tokenizer::split_gpt2`]
/// applies by hand (the `regex` crate has no lookaround).
const GPT2_SPLIT: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+";

/// A byte-level BPE tokenizer read from GGUF metadata.
#[derive(Debug, Clone)]
pub struct Tokenizer {
    /// Token text by id, in the byte-to-unicode alphabet of GPT-2 for normal tokens.
    tokens: Vec<String>,
    types: Vec<TokenType>,
    ids: HashMap<String, u32>,
    /// `"left right"` -> merge rank (lower merges first), as stored in `tokenizer.ggml.merges`.
    merge_ranks: HashMap<String, usize>,
    /// Control, unknown and user-defined tokens, longest first: the partition order.
    specials: Vec<u32>,
    bos: Option<u32>,
    eos: u32,
    /// `\p{N}`: the smollm pre-tokenizer's first split.
    digit: Regex,
    gpt2: Regex,
    byte_to_char: [char; 256],
    char_to_byte: HashMap<char, u8>,
}

impl Tokenizer {
    /// Read only the metadata of a GGUF file (fast: no tensor data) and build the tokenizer.
    pub fn from_gguf_file(path: impl AsRef<Path>) -> Result<Self, LocalError> {
        let path = path.as_ref();
        let mut file = std::fs::File::open(path).map_err(|source| LocalError::Open {
            path: path.to_owned(),
            source,
        })?;
        let content = Content::read(&mut file).map_err(LocalError::Gguf)?;
        Self::from_gguf(&content)
    }

    /// Build the tokenizer from parsed GGUF metadata.
    pub fn from_gguf(content: &Content) -> Result<Self, LocalError> {
        let md = &content.metadata;
        let model = md_string(md, "tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(LocalError::Unsupported(format!(
                "tokenizer model {model:?} (only byte-level BPE \"gpt2\")"
            )));
        }
        let pre = md_string(md, "tokenizer.ggml.pre")?;
        if !SUPPORTED_PRE.contains(&pre) {
            return Err(LocalError::Unsupported(format!(
                "pre-tokenizer {pre:?} (supported: {SUPPORTED_PRE:?})"
            )));
        }
        let tokens = md_array(md, "tokenizer.ggml.tokens")?
            .iter()
            .map(|v| v.to_string().cloned())
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| LocalError::metadata("tokenizer.ggml.tokens", e))?;
        let types = match md.get("tokenizer.ggml.token_type") {
            Some(v) => v
                .to_vec()
                .and_then(|vs| vs.iter().map(Value::to_i32).collect::<Result<Vec<_>, _>>())
                .map_err(|e| LocalError::metadata("tokenizer.ggml.token_type", e))?
                .into_iter()
                .map(TokenType::from_gguf)
                .collect(),
            None => vec![TokenType::Normal; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(LocalError::BadMetadata {
                key: "tokenizer.ggml.token_type",
                message: format!("{} types for {} tokens", types.len(), tokens.len()),
            });
        }
        let merges = md_array(md, "tokenizer.ggml.merges")?;
        let mut merge_ranks = HashMap::with_capacity(merges.len());
        for (rank, m) in merges.iter().enumerate() {
            let m = m
                .to_string()
                .map_err(|e| LocalError::metadata("tokenizer.ggml.merges", e))?;
            merge_ranks.entry(m.clone()).or_insert(rank);
        }
        let ids: HashMap<String, u32> = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let id_of = |key: &'static str| -> Result<Option<u32>, LocalError> {
            md.get(key)
                .map(|v| v.to_u32().map_err(|e| LocalError::metadata(key, e)))
                .transpose()
        };
        let bos = id_of("tokenizer.ggml.bos_token_id")?;
        let eos = id_of("tokenizer.ggml.eos_token_id")?.ok_or(LocalError::BadMetadata {
            key: "tokenizer.ggml.eos_token_id",
            message: "missing".into(),
        })?;
        let mut specials: Vec<u32> = (0..tokens.len() as u32)
            .filter(|&i| {
                matches!(
                    types[i as usize],
                    TokenType::Control | TokenType::UserDefined | TokenType::Unknown
                ) && !tokens[i as usize].is_empty()
            })
            .collect();
        specials.sort_by_key(|&i| std::cmp::Reverse(tokens[i as usize].len()));
        let byte_to_char = bytes_to_unicode();
        let char_to_byte = byte_to_char
            .iter()
            .enumerate()
            .map(|(b, &c)| (c, b as u8))
            .collect();
        Ok(Tokenizer {
            tokens,
            types,
            ids,
            merge_ranks,
            specials,
            bos,
            eos,
            digit: Regex::new(r"\p{N}").expect("valid regex"),
            gpt2: Regex::new(GPT2_SPLIT).expect("valid regex"),
            byte_to_char,
            char_to_byte,
        })
    }

    /// The number of tokens in the vocabulary.
    pub fn vocab_size(&self) -> usize {
        self.tokens.len()
    }

    /// The beginning-of-sequence id, if the model declares one.
    pub fn bos_id(&self) -> Option<u32> {
        self.bos
    }

    /// The end-of-sequence id (`<|im_end|>` for SmolLM2-Instruct).
    pub fn eos_id(&self) -> u32 {
        self.eos
    }

    /// The id of a token by its exact text (e.g. `"<|im_start|>"`).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.ids.get(text).copied()
    }

    /// Whether `id` is a control token (`<|im_end|>`, `<|endoftext|>`, ...), which ends a
    /// generated answer and never appears in decoded text.
    pub fn is_control(&self, id: u32) -> bool {
        self.types.get(id as usize) == Some(&TokenType::Control)
    }

    /// Tokenize `text` without adding BOS, as llama.cpp's
    /// `llama_tokenize(text, add_special = false, parse_special)` does.
    ///
    /// With `parse_special`, control tokens written in the text (`<|im_start|>`) become their
    /// single ids; without it they are tokenized as plain text (user-defined tokens are
    /// always matched, as in llama.cpp).
    pub fn encode(&self, text: &str, parse_special: bool) -> Vec<u32> {
        let mut out = Vec::new();
        for frag in self.partition(text, parse_special) {
            match frag {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(s) => {
                    for word in self.pre_tokenize(s) {
                        self.bpe(word, &mut out);
                    }
                }
            }
        }
        out
    }

    /// Turn ids back into text. Control tokens are skipped; invalid UTF-8 (an id sequence
    /// cut inside a character) becomes U+FFFD.
    pub fn decode(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            let Some(tok) = self.tokens.get(id as usize) else {
                continue;
            };
            match self.types[id as usize] {
                TokenType::Control | TokenType::Unknown | TokenType::Unused => {}
                TokenType::UserDefined => bytes.extend_from_slice(tok.as_bytes()),
                TokenType::Normal | TokenType::Byte => {
                    for c in tok.chars() {
                        match self.char_to_byte.get(&c) {
                            Some(&b) => bytes.push(b),
                            None => {
                                let mut buf = [0u8; 4];
                                bytes.extend_from_slice(c.encode_utf8(&mut buf).as_bytes());
                            }
                        }
                    }
                }
            }
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }

    /// Cut special tokens out of `text`, longest token first (llama.cpp's
    /// `tokenizer_st_partition`).
    fn partition<'t>(&self, text: &'t str, parse_special: bool) -> Vec<Fragment<'t>> {
        let mut frags = vec![Fragment::Text(text)];
        for &id in &self.specials {
            if !parse_special && self.types[id as usize] != TokenType::UserDefined {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            if !text.contains(needle) {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                let Fragment::Text(mut rest) = frag else {
                    next.push(frag);
                    continue;
                };
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }

    /// The smollm pre-tokenizer: each `\p{N}` character alone, then the GPT-2 split on the
    /// text between them.
    fn pre_tokenize<'t>(&self, text: &'t str) -> Vec<&'t str> {
        let mut words = Vec::new();
        let mut last = 0;
        for m in self.digit.find_iter(text) {
            if m.start() > last {
                self.split_gpt2(&text[last..m.start()], &mut words);
            }
            words.push(m.as_str());
            last = m.end();
        }
        if last < text.len() {
            self.split_gpt2(&text[last..], &mut words);
        }
        words
    }

    /// The GPT-2 split of one segment. `\s+(?!\S)`: a whitespace run of two or more
    /// characters followed by a non-space gives its last character to the next word.
    fn split_gpt2<'t>(&self, seg: &'t str, words: &mut Vec<&'t str>) {
        let mut pos = 0;
        while pos < seg.len() {
            let Some(m) = self.gpt2.find_at(seg, pos) else {
                words.push(&seg[pos..]);
                return;
            };
            if m.start() > pos {
                // Unreachable with this pattern (every character matches some branch), kept
                // so that no text is ever dropped.
                words.push(&seg[pos..m.start()]);
            }
            let mut end = m.end();
            let s = m.as_str();
            if end < seg.len() && s.chars().all(char::is_whitespace) && s.chars().nth(1).is_some() {
                let last_len = s.chars().next_back().map_or(0, char::len_utf8);
                end -= last_len;
            }
            words.push(&seg[m.start()..end]);
            pos = end;
        }
    }

    /// Byte-level BPE of one pre-token, appending ids to `out`.
    fn bpe(&self, word: &str, out: &mut Vec<u32>) {
        let mapped: String = word
            .bytes()
            .map(|b| self.byte_to_char[b as usize])
            .collect();
        // Symbols as byte ranges of `mapped`, one per character to start with.
        let mut syms: Vec<(usize, usize)> = mapped
            .char_indices()
            .map(|(i, c)| (i, i + c.len_utf8()))
            .collect();
        let mut key = String::new();
        loop {
            // The lowest-ranked adjacent pair, leftmost on ties.
            let mut best: Option<(usize, usize)> = None;
            for i in 0..syms.len().saturating_sub(1) {
                key.clear();
                key.push_str(&mapped[syms[i].0..syms[i].1]);
                key.push(' ');
                key.push_str(&mapped[syms[i + 1].0..syms[i + 1].1]);
                if let Some(&rank) = self.merge_ranks.get(key.as_str())
                    && best.is_none_or(|(r, _)| rank < r)
                {
                    best = Some((rank, i));
                }
            }
            let Some((_, i)) = best else { break };
            syms[i].1 = syms[i + 1].1;
            syms.remove(i + 1);
        }
        for (a, b) in syms {
            let sym = &mapped[a..b];
            if let Some(&id) = self.ids.get(sym) {
                out.push(id);
            } else {
                // Not in the vocabulary: fall back to one token per byte-character, skipping
                // any the vocabulary lacks (as llama.cpp does).
                let mut buf = [0u8; 4];
                out.extend(
                    sym.chars()
                        .filter_map(|c| self.ids.get(&*c.encode_utf8(&mut buf)).copied()),
                );
            }
        }
    }
}

#[derive(Debug, Clone, Copy)]
enum Fragment<'t> {
    Text(&'t str),
    Token(u32),
}

/// GPT-2's reversible map from bytes to printable characters.
fn bytes_to_unicode() -> [char; 256] {
    let mut map = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        map[b as usize] = if printable {
            char::from(b)
        } else {
            let c = char::from_u32(256 + n).expect("valid code point");
            n += 1;
            c
        };
    }
    map
}

fn md_string<'a>(md: &'a HashMap<String, Value>, key: &'static str) -> Result<&'a str, LocalError> {
    md.get(key)
        .ok_or(LocalError::BadMetadata {
            key,
            message: "missing".into(),
        })?
        .to_string()
        .map(String::as_str)
        .map_err(|e| LocalError::metadata(key, e))
}

fn md_array<'a>(
    md: &'a HashMap<String, Value>,
    key: &'static str,
) -> Result<&'a Vec<Value>, LocalError> {
    md.get(key)
        .ok_or(LocalError::BadMetadata {
            key,
            message: "missing".into(),
        })?
        .to_vec()
        .map_err(|e| LocalError::metadata(key, e))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny vocabulary exercising the pre-tokenizer and merges without the model file.
    fn toy() -> Tokenizer {
        let b2u = bytes_to_unicode();
        let mut tokens: Vec<String> = vec!["<|im_start|>".into(), "<|im_end|>".into()];
        let mut types = vec![TokenType::Control, TokenType::Control];
        for b in 0..=255u8 {
            tokens.push(b2u[b as usize].to_string());
            types.push(TokenType::Normal);
        }
        let merges = ["h e", "l l", "he ll", "hell o", "Ġ w"];
        for m in merges {
            tokens.push(m.replace(' ', ""));
            types.push(TokenType::Normal);
        }
        let ids = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let byte_to_char = bytes_to_unicode();
        Tokenizer {
            merge_ranks: merges
                .iter()
                .enumerate()
                .map(|(r, m)| (m.to_string(), r))
                .collect(),
            specials: vec![0, 1],
            types,
            tokens,
            ids,
            bos: Some(0),
            eos: 1,
            digit: Regex::new(r"\p{N}").unwrap(),
            gpt2: Regex::new(GPT2_SPLIT).unwrap(),
            char_to_byte: byte_to_char
                .iter()
                .enumerate()
                .map(|(b, &c)| (c, b as u8))
                .collect(),
            byte_to_char,
        }
    }

    #[test]
    fn bytes_to_unicode_is_a_bijection_with_gpt2_space() {
        let m = bytes_to_unicode();
        let set: std::collections::HashSet<char> = m.iter().copied().collect();
        assert_eq!(set.len(), 256);
        assert_eq!(m[b' ' as usize], 'Ġ');
        assert_eq!(m[b'\n' as usize], 'Ċ');
        assert_eq!(m[b'a' as usize], 'a');
    }

    #[test]
    fn pre_tokenizer_splits_digits_and_keeps_no_prefix_space() {
        let t = toy();
        assert_eq!(
            t.pre_tokenize("12345 and 3.14"),
            ["1", "2", "3", "4", "5", " and", " ", "3", ".", "1", "4"]
        );
        assert_eq!(t.pre_tokenize("Hello world"), ["Hello", " world"]);
        assert_eq!(t.pre_tokenize("a    b"), ["a", "   ", " b"]);
        assert_eq!(t.pre_tokenize("x  "), ["x", "  "]);
        assert_eq!(t.pre_tokenize("a\t\tb"), ["a", "\t", "\t", "b"]);
        assert_eq!(t.pre_tokenize("don't"), ["don", "'t"]);
        assert_eq!(t.pre_tokenize("Grüße, 你好"), ["Grüße", ",", " 你好"]);
        assert_eq!(t.pre_tokenize("x=1_0;"), ["x", "=", "1", "_", "0", ";"]);
    }

    #[test]
    fn specials_map_to_single_ids_only_when_parsed() {
        let t = toy();
        let ids = t.encode("<|im_start|>hello<|im_end|>", true);
        assert_eq!(ids.first(), Some(&0));
        assert_eq!(ids.last(), Some(&1));
        assert_eq!(ids.len(), 3, "hello is one merged token: {ids:?}");
        let plain = t.encode("<|im_start|>", false);
        assert!(plain.len() > 1 && !plain.contains(&0));
    }

    #[test]
    fn decode_inverts_encode_and_skips_control_tokens() {
        let t = toy();
        for s in ["hello world", "Grüße, 你好 🙂", "  a\n\n b\t", ""] {
            assert_eq!(t.decode(&t.encode(s, false)), s);
        }
        assert_eq!(t.decode(&t.encode("<|im_start|>hi<|im_end|>", true)), "hi");
    }
}
