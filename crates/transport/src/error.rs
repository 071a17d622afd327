//! Errors of the transport contract.
//!
//! Expected outcomes of key-value operations are never transport errors; these
//! are for bad addresses, refused access, unreachable nodes and failed RPCs.

use crate::addr::{NodeId, RegionId};
use thiserror::Error;

/// What a service handler returns when it refuses or fails a request. It
/// travels back to the caller inside the RPC reply.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
#[error("{code}: {message}")]
pub struct ServiceError {
    pub code: ErrorCode,
    pub message: String,
}

impl ServiceError {
    pub fn new(code: ErrorCode, message: impl Into<String>) -> Self {
        ServiceError {
            code,
            message: message.into(),
        }
    }
    /// The request bytes could not be decoded or hold out-of-range fields.
    pub fn malformed(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Malformed, message)
    }
    /// A resource on the serving node (memory, a table) is exhausted.
    pub fn exhausted(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Exhausted, message)
    }
    /// Any other refusal by the service.
    pub fn failed(message: impl Into<String>) -> Self {
        Self::new(ErrorCode::Failed, message)
    }
}

/// Error classes carried in RPC replies, encoded as one byte on the wire.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum ErrorCode {
    /// No service with the requested id or name is registered on the node.
    UnknownService = 1,
    /// The payload could not be parsed, or holds out-of-range values.
    Malformed = 2,
    /// A resource on the serving node is exhausted.
    Exhausted = 3,
    /// The service does not offer this operation.
    Unsupported = 4,
    /// The service failed for another reason; the message says why.
    Failed = 5,
}

impl ErrorCode {
    pub fn from_u8(v: u8) -> Option<ErrorCode> {
        Some(match v {
            1 => ErrorCode::UnknownService,
            2 => ErrorCode::Malformed,
            3 => ErrorCode::Exhausted,
            4 => ErrorCode::Unsupported,
            5 => ErrorCode::Failed,
            _ => return None,
        })
    }
}

impl std::fmt::Display for ErrorCode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = match self {
            ErrorCode::UnknownService => "unknown service",
            ErrorCode::Malformed => "malformed request",
            ErrorCode::Exhausted => "resource exhausted",
            ErrorCode::Unsupported => "unsupported",
            ErrorCode::Failed => "failed",
        };
        f.write_str(s)
    }
}

/// A failed transport operation.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum TransportError {
    #[error("node {0} is unknown")]
    UnknownNode(NodeId),
    #[error("node {0} is down")]
    NodeDown(NodeId),
    #[error("region {region} on node {node} does not exist")]
    NoSuchRegion { node: NodeId, region: RegionId },
    #[error("access to region {region} on node {node} refused: wrong access key")]
    AccessDenied { node: NodeId, region: RegionId },
    #[error(
        "out of bounds: offset {offset} + length {len} exceeds region {region} on node {node} of {size} bytes"
    )]
    OutOfBounds {
        node: NodeId,
        region: RegionId,
        offset: u64,
        len: u64,
        size: u64,
    },
    #[error("atomic verb at offset {offset} is not 8-byte aligned")]
    Misaligned { offset: u64 },
    #[error("RPC to node {node} timed out")]
    Timeout { node: NodeId },
    #[error("RPC to node {node} failed: {error}")]
    Remote { node: NodeId, error: ServiceError },
    #[error("malformed message: {0}")]
    Malformed(String),
    #[error("transport failure: {0}")]
    Backend(String),
}

impl TransportError {
    /// The service error inside a failed RPC, if this is one.
    pub fn service_error(&self) -> Option<&ServiceError> {
        match self {
            TransportError::Remote { error, .. } => Some(error),
            _ => None,
        }
    }
}

pub type Result<T, E = TransportError> = std::result::Result<T, E>;
