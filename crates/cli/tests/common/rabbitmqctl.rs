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

/// A queue's counts as the shared node's queue itself holds them: `rabbitmqctl` asks the
/// queue, where the management API serves samples up to 5 s old.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueCounts {
    pub ready: u64,
    pub unacked: u64,
    pub consumers: u64,
}

/// The counts of each of `queues` on the shared node (`None`: not listed).
pub fn counts_of(queues: &[String]) -> Vec<Option<QueueCounts>> {
    let rows = list_queues(
        shared_ctl,
        &["messages_ready", "messages_unacknowledged", "consumers"],
    );
    (queues.iter())
        .map(|q| {
            let (_, v) = rows.iter().find(|(name, _)| name == q)?;
            Some(QueueCounts {
                ready: v[0].parse().ok()?,
                unacked: v[1].parse().ok()?,
                consumers: v[2].parse().ok()?,
            })
        })
        .collect()
}

/// Poll the shared node until every one of `queues` exists and its counts satisfy `done`
/// (`what` says what that means); panics after `within` with the counts last seen. Each
/// look takes a few seconds (`rabbitmqctl` starts a VM): give `within` ≥ 30 s.
pub async fn wait_queues(
    queues: &[String],
    what: &str,
    within: std::time::Duration,
    done: impl Fn(&QueueCounts) -> bool,
) -> Vec<QueueCounts> {
    let until = std::time::Instant::now() + within;
    loop {
        let qs = queues.to_vec();
        let seen = tokio::task::spawn_blocking(move || counts_of(&qs))
            .await
            .unwrap();
        if seen.iter().all(|c| c.as_ref().is_some_and(&done)) {
            return seen.into_iter().map(Option::unwrap).collect();
        }
        assert!(
            std::time::Instant::now() < until,
            "timed out waiting for {what}: {:?}",
            queues.iter().zip(&seen).collect::<Vec<_>>()
        );
        tokio::time::sleep(std::time::Duration::from_millis(200)).await;
    }
}
