//! llama.cpp's C++ `llama-server` serving SmolLM2-135M, started by
//! `scripts/llama-server.sh` on a free port for one test and stopped when the guard drops.

use std::process::{Command, Stdio};

fn script() -> std::path::PathBuf {
    std::path::PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/llama-server.sh")
}

/// `scripts/test.sh` runs the tests that need llama-server after the others, once its
/// build (beside the Rust build and the other tests) is done: it finds them by name, so the
/// name of every such test contains `real_llama`.
pub fn assert_named_real_llama() {
    let thread = std::thread::current();
    let name = thread.name().unwrap_or_default();
    assert!(
        name.contains("real_llama") || name == "main",
        "the test `{name}` starts llama-server, so its name must contain `real_llama`: \
         scripts/test.sh runs those tests after llama-server is built"
    );
}

/// A running server (its port); `scripts/llama-server.sh stop PORT` when dropped.
pub struct LlamaServer(pub u16);

impl LlamaServer {
    /// `scripts/llama-server.sh start PORT` on a free port with `env` (LLAMA_SERVER_*); the
    /// server and its base URL (`http://127.0.0.1:PORT/v1`).
    pub fn start(env: &[(&str, &str)]) -> (LlamaServer, String) {
        assert_named_real_llama();
        let port = super::private_rabbit::free_port();
        let out = Command::new("bash")
            .arg(script())
            .args(["start", &port.to_string()])
            .envs(env.iter().copied())
            .stdin(Stdio::null())
            .stderr(Stdio::inherit())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "could not start the llama.cpp server: run `scripts/llama-server.sh start 8080` to \
             see why (and `scripts/llama-server.sh stop 8080` after)"
        );
        let base_url = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (LlamaServer(port), base_url)
    }

    /// The server's log as `scripts/llama-server.sh` keeps it:
    /// `${LASTCALL_CACHE:-$HOME/.cache/lastcall}/llama-server-PORT.log`.
    pub fn log(&self) -> String {
        let cache = std::env::var_os("LASTCALL_CACHE")
            .filter(|c| !c.is_empty())
            .map(std::path::PathBuf::from)
            .unwrap_or_else(|| {
                std::path::PathBuf::from(std::env::var_os("HOME").expect("HOME"))
                    .join(".cache/lastcall")
            });
        let path = cache.join(format!("llama-server-{}.log", self.0));
        std::fs::read_to_string(&path).unwrap_or_else(|e| {
            panic!(
                "{}: {e}; scripts/llama-server.sh logs elsewhere now? update LlamaServer::log",
                path.display()
            )
        })
    }
}

impl Drop for LlamaServer {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(script())
            .args(["stop", &self.0.to_string()])
            .stdin(Stdio::null())
            .status();
    }
}
