use dmkv_transport::{ErrorCode, TransportError};
use thiserror::Error;

/// Why a key-value operation failed. "Not found" and "already exists" are
/// not errors: they are the operations' results.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum KvError {
    #[error("key {key:#x} is reserved by {engine}: {why}")]
    ReservedKey {
        key: u64,
        engine: &'static str,
        why: &'static str,
    },
    #[error("a value of {len} bytes exceeds {engine}'s limit of {max} bytes")]
    ValueTooLarge {
        len: usize,
        max: usize,
        engine: &'static str,
    },
    #[error("{engine} does not support {what}")]
    Unsupported {
        engine: &'static str,
        what: &'static str,
    },
    #[error("out of resources: {0}")]
    Exhausted(String),
    #[error("bad configuration: {0}")]
    Config(String),
    /// Remote data failed validation even after retries.
    #[error("corrupt or inconsistent remote data: {0}")]
    Corrupt(String),
    #[error("transport: {0}")]
    Transport(TransportError),
}

impl From<TransportError> for KvError {
    fn from(e: TransportError) -> KvError {
        match &e {
            TransportError::Remote { error, .. } if error.code == ErrorCode::Exhausted => {
                KvError::Exhausted(error.message.clone())
            }
            _ => KvError::Transport(e),
        }
    }
}

pub type Result<T, E = KvError> = std::result::Result<T, E>;
