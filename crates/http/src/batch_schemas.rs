//! The OpenAPI schemas of the files and batches endpoints (`files.rs`, `batches.rs`):
//! OpenAI's file and batch objects, as the document describes them.

#![allow(dead_code)]

use utoipa::ToSchema;

/// `POST /v1/files`: the multipart form.
#[derive(ToSchema)]
pub(crate) struct FileUpload {
    /// `batch`.
    #[schema(pattern = "^batch$")]
    purpose: String,
    /// JSON lines: `{custom_id, method: POST, url: /v1/chat/completions, body}` each.
    #[schema(value_type = String, format = Binary)]
    file: (),
}

/// OpenAI's file object.
#[derive(ToSchema)]
pub(crate) struct FileObject {
    id: String,
    /// `file`.
    object: String,
    bytes: i64,
    /// Seconds since the epoch.
    created_at: i64,
    filename: String,
    /// `batch` (uploaded), `batch_output` (a batch's output or error file).
    purpose: String,
    /// `processed`.
    status: String,
}

/// `DELETE /v1/files/{id}`.
#[derive(ToSchema)]
pub(crate) struct FileDeleted {
    id: String,
    object: String,
    deleted: bool,
}

/// `POST /v1/batches`.
#[derive(ToSchema)]
pub(crate) struct BatchCreate {
    input_file_id: String,
    /// `/v1/chat/completions`.
    #[schema(pattern = "^/v1/chat/completions$")]
    endpoint: String,
    /// A positive whole number and `s`, `m`, `h` or `d`: `30m`, `2h`, `24h`, `7d`; at most
    /// 365 days (longer: `422 window_too_long`).
    #[schema(pattern = "^[1-9][0-9]*[smhd]$")]
    completion_window: String,
    /// String values (the whole body within `serve --max-body-bytes`).
    metadata: Option<std::collections::BTreeMap<String, String>>,
}

/// `request_counts` of a batch.
#[derive(ToSchema)]
pub(crate) struct RequestCounts {
    total: i64,
    completed: i64,
    failed: i64,
}

/// OpenAI's batch object. Times in seconds since the epoch.
#[derive(ToSchema)]
pub(crate) struct BatchObject {
    id: String,
    /// `batch`.
    object: String,
    endpoint: String,
    input_file_id: String,
    completion_window: String,
    /// `validating`, `in_progress`, `finalizing`, `completed`, `expired`, `cancelling`,
    /// `cancelled` or `failed`.
    status: String,
    /// Once the batch has ended.
    output_file_id: Option<String>,
    error_file_id: Option<String>,
    created_at: i64,
    in_progress_at: Option<i64>,
    expires_at: i64,
    finalizing_at: Option<i64>,
    completed_at: Option<i64>,
    failed_at: Option<i64>,
    expired_at: Option<i64>,
    cancelling_at: Option<i64>,
    cancelled_at: Option<i64>,
    #[schema(inline)]
    request_counts: RequestCounts,
    #[schema(value_type = Option<Object>)]
    metadata: Option<()>,
}

/// `GET /v1/batches`.
#[derive(ToSchema)]
pub(crate) struct BatchList {
    /// `list`.
    object: String,
    #[schema(inline)]
    data: Vec<BatchObject>,
    first_id: Option<String>,
    last_id: Option<String>,
    has_more: bool,
}
