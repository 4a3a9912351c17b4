//! `lastcall topology delete`: remove a prefix's exchanges and queues.

use crate::cli::TopologyDeleteArgs;
use crate::config::Settings;
use anyhow::{Result, bail};
use lastcall_broker::Topology;
use lastcall_broker::topology::queue_depth;
use std::io::{BufRead, IsTerminal, Write};
use std::process::ExitCode;

/// Every queue `Topology::delete` removes, in the order shown to the user.
fn queue_names(topo: &Topology) -> Vec<String> {
    let n = &topo.names;
    let mut q = n.lane_queues();
    q.extend(topo.retry_delays_ms.iter().map(|d| n.retry_queue(*d)));
    q.push(n.retry_ready_queue());
    q.push(n.dead_queue.clone());
    for reason in ["expired", "rejected", "maxlen", "delivery_limit", "other"] {
        q.push(format!("{}.dead.{reason}", n.prefix));
    }
    q.push(format!("{}.parked", n.prefix));
    q
}

pub async fn delete(s: &Settings, a: TopologyDeleteArgs) -> Result<ExitCode> {
    let broker = super::connect_broker(s).await?;
    let mut topo = Topology::new(&s.prefix);
    topo.retry_delays_ms = a.retry_delays_ms.clone();
    let names = queue_names(&topo);
    // Passive declares: which of the queues exist, and what they still hold.
    let mut existing = Vec::new();
    for q in &names {
        if let Some((ready, consumers)) = queue_depth(&broker, q).await? {
            existing.push((q.clone(), ready, consumers));
        }
    }
    let n = &topo.names;
    let mut plan = format!(
        "prefix `{}` on {}: exchanges {}, {} and {}; ",
        s.prefix,
        lastcall_broker::redact(&s.amqp_url),
        n.jobs_exchange,
        n.lanes_exchange,
        n.dlx
    );
    if existing.is_empty() {
        plan.push_str("no queue of this prefix exists");
    } else {
        let messages: u64 = existing.iter().map(|(_, m, _)| u64::from(*m)).sum();
        plan.push_str(&format!(
            "{} queue(s) holding {messages} message(s):",
            existing.len()
        ));
        for (q, ready, consumers) in &existing {
            plan.push_str(&format!("\n  {q}: {ready} ready"));
            if *consumers > 0 {
                plan.push_str(&format!(", {consumers} consumer(s) attached"));
            }
        }
    }
    if !a.yes {
        if !std::io::stdin().is_terminal() {
            broker.close().await;
            bail!(
                "not deleting {plan}\nstdin is not a terminal, so there is no one to confirm: pass --yes to delete"
            );
        }
        eprint!(
            "delete {plan}\n(jobs still in these queues are lost; the ledger is not touched) [y/N] "
        );
        std::io::stderr().flush()?;
        let mut answer = String::new();
        std::io::stdin().lock().read_line(&mut answer)?;
        if !matches!(answer.trim(), "y" | "Y" | "yes" | "YES" | "Yes") {
            broker.close().await;
            eprintln!("nothing deleted");
            return Ok(ExitCode::FAILURE);
        }
    }
    topo.delete(&broker).await?;
    // `Topology::delete` ignores individual failures: check that the queues are gone.
    let mut left = Vec::new();
    for (q, _, _) in &existing {
        if queue_depth(&broker, q).await?.is_some() {
            left.push(q.as_str());
        }
    }
    if a.policies {
        let m =
            lastcall_broker::management::Management::from_amqp_url(&s.amqp_url, &a.management_url);
        m.delete_policies(&topo).await?;
        println!("policies of prefix `{}` deleted", s.prefix);
    }
    broker.close().await;
    if !left.is_empty() {
        bail!(
            "these queues still exist after deleting them: {} (exclusive to another connection, or the user lacks the `configure` permission?)",
            left.join(", ")
        );
    }
    println!(
        "deleted {} queue(s) and the exchanges {}, {} and {} of prefix `{}`",
        existing.len(),
        n.jobs_exchange,
        n.lanes_exchange,
        n.dlx,
        s.prefix
    );
    Ok(ExitCode::SUCCESS)
}
