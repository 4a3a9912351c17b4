//! `lastcall batch`: the client side of `serve`'s Files and Batch APIs (docs/batches.md),
//! over HTTP with the bearer token, as the OpenAI SDKs use them.

use crate::cli::{BatchArgs, BatchCommand};
use anyhow::{Context, Result, bail};
use serde_json::{Map, Value, json};
use std::process::ExitCode;
use std::time::Duration;

/// How often `batch show --wait` asks.
const POLL: Duration = Duration::from_secs(2);

/// The statuses after which a batch changes no more.
const ENDED: [&str; 4] = ["completed", "failed", "expired", "cancelled"];

struct Client {
    http: reqwest::Client,
    base: String,
    token: String,
}

impl Client {
    fn new(a: &BatchArgs) -> Result<Self> {
        let token = lastcall_http::Token::load(a.token_file.as_deref(), "LASTCALL_HTTP_TOKEN")?;
        let token = String::from_utf8(token.expose_for_lookup().to_vec())
            .context("the HTTP token is not UTF-8")?;
        let http = reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .user_agent(concat!("lastcall/", env!("CARGO_PKG_VERSION")))
            .build()?;
        Ok(Self {
            http,
            base: a.url.trim_end_matches('/').to_owned(),
            token,
        })
    }

    fn request(&self, method: reqwest::Method, path: &str) -> reqwest::RequestBuilder {
        self.http
            .request(method, format!("{}{path}", self.base))
            .bearer_auth(&self.token)
    }

    /// Send, and the JSON answer of a success; an error names the status and the API's
    /// message.
    async fn json(&self, req: reqwest::RequestBuilder, what: &str) -> Result<Value> {
        let resp = self.send(req, what).await?;
        resp.json()
            .await
            .with_context(|| format!("{what}: the answer is not JSON"))
    }

    async fn send(&self, req: reqwest::RequestBuilder, what: &str) -> Result<reqwest::Response> {
        let resp = req.send().await.with_context(|| {
            format!(
                "{what}: cannot reach {} (is `lastcall serve` running there? --url / LASTCALL_URL)",
                self.base
            )
        })?;
        let status = resp.status();
        if status.is_success() {
            return Ok(resp);
        }
        let body: Value = resp.json().await.unwrap_or_default();
        let message = body["error"]["message"]
            .as_str()
            .or(body["message"].as_str())
            .unwrap_or("");
        bail!("{what}: {status} {message}")
    }
}

pub async fn run(a: BatchArgs) -> Result<ExitCode> {
    let c = Client::new(&a)?;
    match a.command {
        BatchCommand::Create {
            file,
            window,
            endpoint,
            metadata,
        } => {
            let metadata = parse_metadata(&metadata)?;
            let f = tokio::fs::File::open(&file)
                .await
                .with_context(|| format!("cannot open {}", file.display()))?;
            let len = f.metadata().await?.len();
            let name = file.file_name().map_or_else(
                || "input.jsonl".into(),
                |n| n.to_string_lossy().into_owned(),
            );
            // Streamed from the file: a 200 MB upload is never held in memory.
            let body = reqwest::Body::wrap_stream(tokio_util::io::ReaderStream::new(f));
            let part = reqwest::multipart::Part::stream_with_length(body, len).file_name(name);
            let form = reqwest::multipart::Form::new()
                .text("purpose", "batch")
                .part("file", part);
            let uploaded = c
                .json(
                    c.request(reqwest::Method::POST, "/v1/files")
                        .multipart(form),
                    "uploading the file",
                )
                .await?;
            let file_id = uploaded["id"].as_str().unwrap_or_default().to_owned();
            let mut req = json!({
                "input_file_id": file_id,
                "endpoint": endpoint,
                "completion_window": window,
            });
            if !metadata.is_empty() {
                req["metadata"] = Value::Object(metadata);
            }
            let b = c
                .json(
                    c.request(reqwest::Method::POST, "/v1/batches").json(&req),
                    "creating the batch",
                )
                .await?;
            eprintln!(
                "uploaded {} ({} bytes) as {file_id}",
                file.display(),
                uploaded["bytes"]
            );
            println!("{}", b["id"].as_str().unwrap_or_default());
            eprintln!("{}", summary(&b));
        }
        BatchCommand::Show { id, wait, json } => {
            let path = format!("/v1/batches/{id}");
            let mut last = String::new();
            loop {
                let b = c
                    .json(c.request(reqwest::Method::GET, &path), "reading the batch")
                    .await?;
                let line = summary(&b);
                let ended = ENDED.contains(&b["status"].as_str().unwrap_or_default());
                if !wait || ended {
                    if json {
                        println!("{}", serde_json::to_string_pretty(&b)?);
                    } else {
                        println!("{line}");
                    }
                    break;
                }
                if line != last {
                    eprintln!("{line}");
                    last = line;
                }
                tokio::time::sleep(POLL).await;
            }
        }
        BatchCommand::List { limit } => {
            let list = c
                .json(
                    c.request(reqwest::Method::GET, &format!("/v1/batches?limit={limit}")),
                    "listing the batches",
                )
                .await?;
            for b in list["data"].as_array().into_iter().flatten() {
                println!("{}", summary(b));
            }
        }
        BatchCommand::Cancel { id } => {
            let b = c
                .json(
                    c.request(reqwest::Method::POST, &format!("/v1/batches/{id}/cancel")),
                    "cancelling the batch",
                )
                .await?;
            println!("{}", summary(&b));
        }
        BatchCommand::Results { id, errors } => {
            let b = c
                .json(
                    c.request(reqwest::Method::GET, &format!("/v1/batches/{id}")),
                    "reading the batch",
                )
                .await?;
            let field = if errors {
                "error_file_id"
            } else {
                "output_file_id"
            };
            let Some(file_id) = b[field].as_str() else {
                bail!(
                    "batch {id} has no {} file yet ({}); `lastcall batch show {id} --wait` waits for it",
                    if errors { "error" } else { "output" },
                    summary(&b)
                );
            };
            let resp = c
                .send(
                    c.request(
                        reqwest::Method::GET,
                        &format!("/v1/files/{file_id}/content"),
                    ),
                    "reading the file",
                )
                .await?;
            // Streamed to stdout a chunk at a time.
            let mut stream = resp.bytes_stream();
            let mut out = std::io::stdout().lock();
            use futures_util::StreamExt;
            use std::io::Write;
            while let Some(chunk) = stream.next().await {
                out.write_all(&chunk.context("reading the file")?)?;
            }
            out.flush()?;
        }
    }
    Ok(ExitCode::SUCCESS)
}

/// `KEY=VALUE` pairs as the API's `metadata` object.
fn parse_metadata(pairs: &[String]) -> Result<Map<String, Value>> {
    let mut m = Map::new();
    for p in pairs {
        let Some((k, v)) = p.split_once('=').filter(|(k, _)| !k.is_empty()) else {
            bail!("--metadata {p:?}: expected KEY=VALUE");
        };
        m.insert(k.to_owned(), Value::String(v.to_owned()));
    }
    Ok(m)
}

/// One line: id, status, window and the lines' counts.
fn summary(b: &Value) -> String {
    let n = |k: &str| b["request_counts"][k].as_u64().unwrap_or(0);
    format!(
        "{}  {}  window {}  {} of {} completed, {} failed",
        b["id"].as_str().unwrap_or("?"),
        b["status"].as_str().unwrap_or("?"),
        b["completion_window"].as_str().unwrap_or("?"),
        n("completed"),
        n("total"),
        n("failed"),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn metadata_pairs_and_a_bad_one_named() {
        let m = parse_metadata(&["team=ops".into(), "note=a=b".into()]).unwrap();
        assert_eq!(Value::Object(m), json!({"team": "ops", "note": "a=b"}));
        let e = parse_metadata(&["=x".into()]).unwrap_err().to_string();
        assert!(e.contains("\"=x\"") && e.contains("KEY=VALUE"), "{e}");
    }
}
