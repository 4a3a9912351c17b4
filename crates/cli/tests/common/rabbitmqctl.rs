//! `rabbitmqctl list_queues`, parsed once for the tests that read queues through the CLI
//! tool: a private node has no management plugin, and a queue's type is listed there.

use std::process::{Command, Output, Stdio};

/// `rabbitmqctl` of the shared node (the one on `PATH`).
pub fn shared_ctl(args: &[&str]) -> Output {
    Command::new("rabbitmqctl")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("rabbitmqctl")
}

/// The rows of `list_queues name <columns…>` run through `ctl` (e.g. [`shared_ctl`] or a
/// private node's `ctl`): each queue's name and its values of `columns`, in order.
pub fn list_queues(
    ctl: impl FnOnce(&[&str]) -> Output,
    columns: &[&str],
) -> Vec<(String, Vec<String>)> {
    let mut args = vec!["list_queues", "--quiet", "--no-table-headers", "name"];
    args.extend_from_slice(columns);
    let out = ctl(&args);
    assert!(
        out.status.success(),
        "rabbitmqctl list_queues: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    parse_rows(&String::from_utf8_lossy(&out.stdout), columns.len())
}

/// `(messages_ready, messages_unacknowledged)` of `queue`, `None` when it is not listed.
pub fn queue_counts(ctl: impl FnOnce(&[&str]) -> Output, queue: &str) -> Option<(u64, u64)> {
    list_queues(ctl, &["messages_ready", "messages_unacknowledged"])
        .into_iter()
        .find(|(name, _)| name == queue)
        .map(|(_, v)| (v[0].parse().unwrap(), v[1].parse().unwrap()))
}

/// Whitespace-separated rows of a name and `n` values; other lines (warnings) are skipped.
fn parse_rows(stdout: &str, n: usize) -> Vec<(String, Vec<String>)> {
    stdout
        .lines()
        .filter_map(|l| {
            let f: Vec<&str> = l.split_whitespace().collect();
            (f.len() == n + 1).then(|| {
                (
                    f[0].to_owned(),
                    f[1..].iter().map(|s| (*s).to_owned()).collect(),
                )
            })
        })
        .collect()
}
