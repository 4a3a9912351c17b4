//! OpenAI-compatible files: `POST /v1/files` (multipart, `purpose=batch`),
//! `GET /v1/files/{id}`, `GET /v1/files/{id}/content`, `DELETE /v1/files/{id}`.
//!
//! An upload is read as it arrives and written to the ledger a page of lines at a time
//! (`file_lines`; 500 lines or 4 MiB), so at most one page and one line are held: never the
//! whole file. Content is read back a page of 500 lines at a time. The
//! limits are OpenAI's for a batch input: [`MAX_FILE_BYTES`] and [`MAX_FILE_LINES`]; a line
//! longer than this server's body limit (`serve --max-body-bytes`: the most a job may
//! carry) is refused too, each with a `400` that names the limit. Content is streamed back
//! a page at a time. A batch's output and error files (`file-<batch id>-output`,
//! `-errors`) are computed from its jobs' outcomes (`crate::batches`).
//!
//! A file belongs to the tenant of the token that uploaded it (`default` for the
//! operator's): another tenant's token finds no such file (`404`, as for a missing one).

use crate::AppState;
use crate::auth::Caller;
use crate::error::ApiError;
use crate::front_door::from_api_error;
use crate::params::PathParam;
use axum::Extension;
use axum::Json;
use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use lastcall_store::FileRow;
use serde_json::{Value, json};
use std::sync::Arc;

/// The largest input file, in bytes (OpenAI's limit for a batch input file).
pub const MAX_FILE_BYTES: u64 = 200 * 1024 * 1024;
/// The most lines in an input file (OpenAI's limit: requests per batch).
pub const MAX_FILE_LINES: i64 = 50_000;
/// Lines written to the ledger per transaction while an upload arrives, and the bytes
/// after which a page is written sooner: an upload holds at most about this much (and one
/// line) in memory.
const PAGE_LINES: usize = 500;
const PAGE_BYTES: usize = 4 * 1024 * 1024;
/// Lines read from the ledger per page while content is sent.
pub(crate) const READ_PAGE: i64 = 500;

/// Splits arriving bytes into lines within the limits, holding at most one partial line.
#[derive(Debug)]
pub(crate) struct LineSplitter {
    partial: Vec<u8>,
    bytes: u64,
    lines: i64,
    max_bytes: u64,
    max_lines: i64,
    max_line: usize,
}

/// Why an upload is refused: the limit it broke, for a `400` that names it.
#[derive(Debug, PartialEq, Eq)]
pub(crate) struct Refused {
    pub code: &'static str,
    pub message: String,
}

impl LineSplitter {
    pub(crate) fn new(max_bytes: u64, max_lines: i64, max_line: usize) -> Self {
        Self {
            partial: Vec::new(),
            bytes: 0,
            lines: 0,
            max_bytes,
            max_lines,
            max_line,
        }
    }

    /// Feed a chunk; complete non-blank lines are pushed to `out`.
    pub(crate) fn feed(&mut self, chunk: &[u8], out: &mut Vec<String>) -> Result<(), Refused> {
        self.bytes += chunk.len() as u64;
        if self.bytes > self.max_bytes {
            return Err(Refused {
                code: "file_too_large",
                message: format!(
                    "the file is larger than {} bytes, the most a batch input file may hold",
                    self.max_bytes
                ),
            });
        }
        let mut rest = chunk;
        while let Some(i) = rest.iter().position(|&b| b == b'\n') {
            self.partial.extend_from_slice(&rest[..i]);
            rest = &rest[i + 1..];
            self.line(out)?;
        }
        self.partial.extend_from_slice(rest);
        self.check_line_len()
    }

    /// The end of the upload: the last line, if it had no newline.
    pub(crate) fn finish(&mut self, out: &mut Vec<String>) -> Result<(), Refused> {
        self.line(out)
    }

    pub(crate) fn bytes(&self) -> u64 {
        self.bytes
    }

    pub(crate) fn lines(&self) -> i64 {
        self.lines
    }

    fn check_line_len(&self) -> Result<(), Refused> {
        if self.partial.len() > self.max_line {
            return Err(Refused {
                code: "line_too_large",
                message: format!(
                    "line {} is longer than {} bytes, the most one request may carry (serve --max-body-bytes)",
                    self.lines + 1,
                    self.max_line
                ),
            });
        }
        Ok(())
    }

    fn line(&mut self, out: &mut Vec<String>) -> Result<(), Refused> {
        self.check_line_len()?;
        let raw = std::mem::take(&mut self.partial);
        let text = String::from_utf8(raw).map_err(|_| Refused {
            code: "invalid_file",
            message: format!("line {} is not UTF-8 text", self.lines + 1),
        })?;
        let text = text.trim_end_matches('\r');
        if text.trim().is_empty() {
            return Ok(());
        }
        self.lines += 1;
        if self.lines > self.max_lines {
            return Err(Refused {
                code: "too_many_lines",
                message: format!(
                    "the file has more than {} lines, the most requests a batch may hold",
                    self.max_lines
                ),
            });
        }
        out.push(text.to_owned());
        Ok(())
    }
}

/// OpenAI's file object.
pub(crate) fn file_object(f: &FileRow) -> Value {
    json!({
        "id": f.file_id,
        "object": "file",
        "bytes": f.bytes,
        "created_at": f.created_at_ms / 1000,
        "filename": f.filename,
        "purpose": f.purpose,
        "status": "processed",
        "expires_at": null,
        "status_details": null,
    })
}

pub(crate) fn not_found(what: &str, id: &str) -> ApiError {
    ApiError::Http {
        status: StatusCode::NOT_FOUND,
        code: "not_found",
        message: format!("no {what} `{}`", crate::params::shorten(id)),
    }
}

fn bad(field: &str, code: &str, message: impl Into<String>) -> ApiError {
    ApiError::bad(field, code, message)
}

/// The tenant a caller's files and batches belong to.
pub(crate) fn owner(caller: &Caller) -> String {
    caller
        .tenant()
        .unwrap_or(lastcall_core::Tenant::DEFAULT)
        .to_owned()
}

/// Whether `caller` may see what `tenant` owns (the operator sees every tenant's).
pub(crate) fn sees(caller: &Caller, tenant: &str) -> bool {
    caller.tenant().is_none_or(|t| t == tenant)
}

/// A stored input file the caller may see.
pub(crate) async fn visible_file(
    state: &AppState,
    caller: &Caller,
    id: &str,
) -> Result<FileRow, ApiError> {
    let f = state
        .ledger
        .get_file(id)
        .await
        .map_err(|e| ApiError::Internal(e.to_string()))?;
    f.filter(|f| sees(caller, &f.tenant))
        .ok_or_else(|| not_found("file", id))
}

/// `POST /v1/files`.
#[utoipa::path(
    post,
    path = "/v1/files",
    operation_id = "createFile",
    summary = "Upload a batch input file (OpenAI-compatible, multipart)",
    description = "A `multipart/form-data` body with `purpose` (`batch`) and `file`: JSON lines, one request each (`custom_id`, `method`, `url`, `body`). At most 200 MB and 50,000 lines, and no line longer than this server's body limit; the file is written to the ledger as it arrives. Answers OpenAI's file object. The file belongs to the token's tenant.",
    request_body(content = inline(crate::batch_schemas::FileUpload), content_type = "multipart/form-data"),
    responses(
        (status = 200, description = "The file object", body = inline(crate::batch_schemas::FileObject)),
        (status = 400, description = "Not multipart, `purpose` missing or not `batch`, `file` missing or empty, or over a limit (`file_too_large`, `too_many_lines`, `line_too_large`: the message names it), or a line not UTF-8 (`invalid_file`)", body = crate::openapi::OpenAiError),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 403, response = crate::openapi::Forbidden),
        (status = 500, response = crate::openapi::OpenAiServerError),
        (status = 503, response = crate::openapi::OpenAiServerError),
    ),
)]
pub async fn create(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    match upload(&state, &caller, &headers, body).await {
        Ok(f) => Json(file_object(&f)).into_response(),
        Err(e) => from_api_error(e),
    }
}

async fn upload(
    state: &AppState,
    caller: &Caller,
    headers: &HeaderMap,
    body: Body,
) -> Result<FileRow, ApiError> {
    let content_type = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let boundary = multer::parse_boundary(content_type).map_err(|_| {
        bad(
            "Content-Type",
            "invalid_request",
            "the body must be `multipart/form-data` with a boundary, holding `purpose` and `file`",
        )
    })?;
    // The whole stream within the file limit and some room for the other fields.
    let constraints = multer::Constraints::new().size_limit(
        multer::SizeLimit::new()
            .whole_stream(MAX_FILE_BYTES + 1024 * 1024)
            .for_field("purpose", 1024),
    );
    let mut form =
        multer::Multipart::with_constraints(body.into_data_stream(), boundary, constraints);
    let mut purpose: Option<String> = None;
    let mut stored: Option<FileRow> = None;
    let result = async {
        while let Some(mut field) = form.next_field().await.map_err(multipart_error)? {
            match field.name() {
                Some("purpose") => {
                    purpose = Some(
                        field
                            .text()
                            .await
                            .map_err(multipart_error)?
                            .trim()
                            .to_owned(),
                    )
                }
                Some("file") if stored.is_none() => {
                    let filename = field.file_name().unwrap_or("input.jsonl").to_owned();
                    let f = FileRow {
                        file_id: format!("file-{}", &lastcall_producer::new_job_id()[4..]),
                        tenant: owner(caller),
                        purpose: "batch".into(),
                        filename: crate::params::shorten(&filename),
                        bytes: 0,
                        line_count: 0,
                        created_at_ms: state.clock.now_ms(),
                    };
                    state.ledger.create_file(&f).await.map_err(ledger_error)?;
                    stored = Some(f.clone());
                    let mut split =
                        LineSplitter::new(MAX_FILE_BYTES, MAX_FILE_LINES, state.max_body_bytes);
                    let mut page = Vec::new();
                    let mut next_line = 1;
                    while let Some(chunk) = field.chunk().await.map_err(multipart_error)? {
                        split.feed(&chunk, &mut page).map_err(refused)?;
                        if page.len() >= PAGE_LINES
                            || page.iter().map(String::len).sum::<usize>() >= PAGE_BYTES
                        {
                            write_page(state, &f.file_id, &mut next_line, &mut page).await?;
                        }
                    }
                    split.finish(&mut page).map_err(refused)?;
                    write_page(state, &f.file_id, &mut next_line, &mut page).await?;
                    if split.lines() == 0 {
                        return Err(bad("file", "invalid_file", "the file holds no lines"));
                    }
                    stored = Some(FileRow {
                        bytes: split.bytes() as i64,
                        line_count: split.lines(),
                        ..f
                    });
                }
                _ => {
                    // Another field (or a second file): read and dropped, within the
                    // stream's limit.
                    while field.chunk().await.map_err(multipart_error)?.is_some() {}
                }
            }
        }
        match purpose.as_deref() {
            Some("batch") => {}
            Some(p) => {
                return Err(bad(
                    "purpose",
                    "invalid_request",
                    format!(
                        "`purpose` `{}` is not taken here: only `batch`",
                        crate::params::shorten(p)
                    ),
                ));
            }
            None => {
                return Err(bad(
                    "purpose",
                    "invalid_request",
                    "`purpose` is required (`batch`)",
                ));
            }
        }
        let Some(f) = &stored else {
            return Err(bad("file", "invalid_request", "`file` is required"));
        };
        state
            .ledger
            .finish_file(&f.file_id, f.bytes, f.line_count)
            .await
            .map_err(ledger_error)?;
        Ok(f.clone())
    }
    .await;
    if result.is_err()
        && let Some(f) = &stored
        && let Err(e) = state.ledger.delete_file(&f.file_id).await
    {
        tracing::warn!(file_id = %f.file_id, error = %e, "cannot remove a refused upload");
    }
    result
}

async fn write_page(
    state: &AppState,
    file_id: &str,
    next_line: &mut i64,
    page: &mut Vec<String>,
) -> Result<(), ApiError> {
    state
        .ledger
        .append_file_lines(file_id, *next_line, page)
        .await
        .map_err(ledger_error)?;
    *next_line += page.len() as i64;
    page.clear();
    Ok(())
}

fn refused(r: Refused) -> ApiError {
    bad("file", r.code, r.message)
}

fn multipart_error(e: multer::Error) -> ApiError {
    match e {
        multer::Error::StreamSizeExceeded { .. } | multer::Error::FieldSizeExceeded { .. } => bad(
            "file",
            "file_too_large",
            format!(
                "the upload is larger than {MAX_FILE_BYTES} bytes, the most a batch input file may hold"
            ),
        ),
        e => bad(
            "body",
            "invalid_request",
            format!("the multipart body cannot be read: {e}"),
        ),
    }
}

pub(crate) fn ledger_error(e: lastcall_store::StoreError) -> ApiError {
    tracing::error!(error = %e, "ledger");
    if e.is_retryable() {
        ApiError::LedgerUnavailable
    } else {
        ApiError::Internal(e.to_string())
    }
}

/// `GET /v1/files/{id}`.
#[utoipa::path(
    get,
    path = "/v1/files/{id}",
    operation_id = "getFile",
    summary = "A file object (OpenAI-compatible)",
    description = "",
    params(("id" = String, Path)),
    responses(
        (status = 200, description = "The file object", body = inline(crate::batch_schemas::FileObject)),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 404, description = "No such file, or another tenant's", body = crate::openapi::OpenAiError),
        (status = 500, response = crate::openapi::OpenAiServerError),
        (status = 503, response = crate::openapi::OpenAiServerError),
    ),
)]
pub async fn show(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
) -> Response {
    let found = match crate::batches::result_file(&state, &caller, &id).await {
        Ok(Some((f, _))) => Ok(f),
        Ok(None) => visible_file(&state, &caller, &id).await,
        Err(e) => Err(e),
    };
    match found {
        Ok(f) => Json(file_object(&f)).into_response(),
        Err(e) => from_api_error(e),
    }
}

/// `GET /v1/files/{id}/content`.
#[utoipa::path(
    get,
    path = "/v1/files/{id}/content",
    operation_id = "getFileContent",
    summary = "A file's content: JSON lines (OpenAI-compatible)",
    description = "An input file as uploaded (blank lines left out), or a batch's output or error file, sent a page at a time.",
    params(("id" = String, Path)),
    responses(
        (status = 200, description = "JSON lines", body = String, content_type = "application/jsonl"),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 404, description = "No such file, or another tenant's", body = crate::openapi::OpenAiError),
        (status = 500, response = crate::openapi::OpenAiServerError),
        (status = 503, response = crate::openapi::OpenAiServerError),
    ),
)]
pub async fn content(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
) -> Response {
    let stream = match crate::batches::result_file(&state, &caller, &id).await {
        Ok(Some((_, which))) => which.stream(state.clone()),
        Ok(None) => match visible_file(&state, &caller, &id).await {
            Ok(f) => input_stream(state.clone(), f.file_id),
            Err(e) => return from_api_error(e),
        },
        Err(e) => return from_api_error(e),
    };
    (
        [(header::CONTENT_TYPE, "application/jsonl")],
        Body::from_stream(stream),
    )
        .into_response()
}

/// A stream of pages of text, each a `Result` for the body.
pub(crate) type Pages =
    std::pin::Pin<Box<dyn futures_util::Stream<Item = Result<String, std::io::Error>> + Send>>;

fn input_stream(state: Arc<AppState>, file_id: String) -> Pages {
    Box::pin(futures_util::stream::unfold(Some(1i64), move |from| {
        let (state, file_id) = (state.clone(), file_id.clone());
        async move {
            let from = from?;
            match state.ledger.file_lines(&file_id, from, READ_PAGE).await {
                Ok(lines) if lines.is_empty() => None,
                Ok(lines) => {
                    let next = lines.last().map(|(n, _)| n + 1);
                    let mut text = String::new();
                    for (_, l) in &lines {
                        text.push_str(l);
                        text.push('\n');
                    }
                    Some((Ok(text), next))
                }
                Err(e) => Some((Err(std::io::Error::other(e.to_string())), None)),
            }
        }
    }))
}

/// `DELETE /v1/files/{id}`.
#[utoipa::path(
    delete,
    path = "/v1/files/{id}",
    operation_id = "deleteFile",
    summary = "Delete an input file (OpenAI-compatible)",
    description = "A batch's output and error files are computed from its jobs and cannot be deleted.",
    params(("id" = String, Path)),
    responses(
        (status = 200, description = "`{id, object: file, deleted: true}`", body = inline(crate::batch_schemas::FileDeleted)),
        (status = 401, response = crate::openapi::Unauthorized),
        (status = 403, response = crate::openapi::Forbidden),
        (status = 404, description = "No such file, or another tenant's", body = crate::openapi::OpenAiError),
        (status = 500, response = crate::openapi::OpenAiServerError),
        (status = 503, response = crate::openapi::OpenAiServerError),
    ),
)]
pub async fn delete(
    State(state): State<Arc<AppState>>,
    Extension(caller): Extension<Caller>,
    PathParam(id): PathParam,
) -> Response {
    let run = async {
        let f = visible_file(&state, &caller, &id).await?;
        state
            .ledger
            .delete_file(&f.file_id)
            .await
            .map_err(ledger_error)?;
        Ok::<_, ApiError>(Json(
            json!({"id": f.file_id, "object": "file", "deleted": true}),
        ))
    };
    match run.await {
        Ok(r) => r.into_response(),
        Err(e) => from_api_error(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn split(
        chunks: &[&[u8]],
        max_bytes: u64,
        max_lines: i64,
        max_line: usize,
    ) -> Result<Vec<String>, Refused> {
        let mut s = LineSplitter::new(max_bytes, max_lines, max_line);
        let mut out = Vec::new();
        for c in chunks {
            s.feed(c, &mut out)?;
        }
        s.finish(&mut out)?;
        Ok(out)
    }

    #[test]
    fn lines_across_chunks() {
        let out = split(
            &[b"{\"a\"", b":1}\r\n\n{\"b\":2", b"}\n", b"{\"c\":3}"],
            1000,
            10,
            100,
        )
        .unwrap();
        assert_eq!(out, vec!["{\"a\":1}", "{\"b\":2}", "{\"c\":3}"]);
    }

    #[test]
    fn limits_are_named() {
        let e = split(&[b"1\n2\n3\n"], 1000, 2, 100).unwrap_err();
        assert_eq!(e.code, "too_many_lines");
        assert!(e.message.contains('2'));
        let e = split(&[b"12345\n", b"6789"], 8, 10, 100).unwrap_err();
        assert_eq!(e.code, "file_too_large");
        assert!(e.message.contains("8 bytes"));
        // A line too long is refused before its end arrives: nothing unbounded is held.
        let e = split(&[b"ok\n", b"0123456789"], 1000, 10, 5).unwrap_err();
        assert_eq!(e.code, "line_too_large");
        assert!(e.message.contains("line 2"));
        let e = split(&[b"\xff\n"], 1000, 10, 5).unwrap_err();
        assert_eq!(e.code, "invalid_file");
    }
}
