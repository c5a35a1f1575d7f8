//! The service's error: an HTTP status and a message naming the argument or
//! field at fault, answered as `{"error": "..."}`.

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};

/// An error with the HTTP status it answers with. Client errors (4xx) name
/// the request field at fault; server errors (5xx) say what failed.
#[derive(Clone, Debug, PartialEq)]
pub struct Error {
    /// The HTTP status code.
    pub status: u16,
    /// What went wrong, starting with the field or argument at fault.
    pub message: String,
}

/// This crate's result.
pub type Result<T> = std::result::Result<T, Error>;

impl Error {
    /// 400: the request cannot be read (malformed JSON, a bad filter).
    pub fn bad_request(message: impl Into<String>) -> Self {
        Self { status: 400, message: message.into() }
    }

    /// 422: the request reads but its values are not acceptable (dims, limits).
    pub fn unprocessable(message: impl Into<String>) -> Self {
        Self { status: 422, message: message.into() }
    }

    /// 500: the service failed.
    pub fn internal(message: impl Into<String>) -> Self {
        Self { status: 500, message: message.into() }
    }

    /// Whether this is the client's fault (4xx).
    pub fn is_client_error(&self) -> bool {
        (400..500).contains(&self.status)
    }
}

impl std::fmt::Display for Error {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} ({})", self.message, self.status)
    }
}

impl std::error::Error for Error {}

impl From<rusqlite::Error> for Error {
    fn from(e: rusqlite::Error) -> Self {
        Self::internal(format!("metadata: {e}"))
    }
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        Self::internal(format!("index: {e}"))
    }
}

impl IntoResponse for Error {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
        let body = serde_json::json!({ "error": self.message }).to_string();
        (status, [(axum::http::header::CONTENT_TYPE, "application/json")], body).into_response()
    }
}
