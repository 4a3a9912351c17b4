//! Driving the real binaries over HTTP from a test: child processes that die with the test,
//! and `curl` for requests (what a user would type).

use std::process::{Child, Command};

/// Child processes killed on drop, also when the test fails.
pub struct Children(pub Vec<Child>);

impl Drop for Children {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Run `curl -s` with `args` (30 s at most); returns the HTTP status (0 when no answer)
/// and the body.
pub fn curl(args: &[&str]) -> (u16, String) {
    let out = Command::new("curl")
        .args(["-s", "--max-time", "30", "-o", "-", "-w", "\n%{http_code}"])
        .args(args)
        .output()
        .expect("curl");
    let text = String::from_utf8_lossy(&out.stdout).into_owned();
    let (body, code) = text.rsplit_once('\n').unwrap_or(("", "0"));
    (code.trim().parse().unwrap_or(0), body.to_owned())
}

/// `POST {base}/v1/jobs` of a chat job `id` with a budget of `deadline_ms`, as `token`.
pub fn post_job(base: &str, token: &str, id: &str, deadline_ms: u64) -> (u16, String) {
    post_job_with(base, token, id, deadline_ms, r#"{"messages":[]}"#)
}

/// [`post_job`] with the given JSON `payload` (e.g. `{"sim_latency_ms": 30000}` for the
/// sim backend).
pub fn post_job_with(
    base: &str,
    token: &str,
    id: &str,
    deadline_ms: u64,
    payload: &str,
) -> (u16, String) {
    let body = format!(
        r#"{{"job_id":"{id}","kind":"incident.summary","deadline_ms":{deadline_ms},"payload":{payload}}}"#
    );
    curl(&[
        "-X",
        "POST",
        &format!("{base}/v1/jobs"),
        "-H",
        &format!("Authorization: Bearer {token}"),
        "-H",
        "Content-Type: application/json",
        "--data",
        &body,
    ])
}
