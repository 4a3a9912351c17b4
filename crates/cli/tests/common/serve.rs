//! `lastcall serve` of a test's [`Env`], started the way the HTTP tests start it.

use super::Env;
use std::process::{Child, Stdio};
use std::time::{Duration, Instant};

/// A running `lastcall serve`: on a free port, with the test topology's
/// `--retry-delays-ms 1000,5000`, its token in `LASTCALL_HTTP_TOKEN`, output discarded.
/// Killed on drop, also when the test fails.
pub struct Serve {
    /// `http://127.0.0.1:{port}`.
    pub base: String,
    pub child: Child,
}

impl Serve {
    /// Started with `extra` flags after the defaults; returns once `/readyz` answers 200
    /// (panics after 30 s, or at once if the process exits first).
    pub async fn start(env: &Env, token: &str, extra: &[&str]) -> Serve {
        Self::start_with(env, token, extra, &[]).await
    }

    /// [`Serve::start`] with more environment variables.
    pub async fn start_with(
        env: &Env,
        token: &str,
        extra: &[&str],
        vars: &[(&str, &str)],
    ) -> Serve {
        let port = super::private_rabbit::free_port();
        let child = env
            .command()
            .args([
                "serve",
                "--addr",
                &format!("127.0.0.1:{port}"),
                "--retry-delays-ms",
                "1000,5000",
            ])
            .args(extra)
            .envs(vars.iter().copied())
            .env("LASTCALL_HTTP_TOKEN", token)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        let mut serve = Serve {
            base: format!("http://127.0.0.1:{port}"),
            child,
        };
        let http = reqwest::Client::new();
        let until = Instant::now() + Duration::from_secs(30);
        loop {
            let up = http.get(format!("{}/readyz", serve.base)).send().await;
            if up.is_ok_and(|r| r.status() == 200) {
                return serve;
            }
            if let Some(status) = serve.child.try_wait().unwrap() {
                panic!("serve {extra:?} exited before it was ready: {status}");
            }
            assert!(Instant::now() < until, "serve {extra:?} did not come up");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
