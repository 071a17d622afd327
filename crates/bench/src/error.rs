use thiserror::Error;

/// Why a benchmark could not run. Failed checks are not errors: they are
/// results, reported and turned into a non-zero exit by the caller.
#[derive(Debug, Error)]
pub enum BenchError {
    /// Bad input: flags, files, settings an engine refuses (exit code 2).
    #[error("{0}")]
    Input(String),
    /// Something failed while running (exit code 1).
    #[error("{0}")]
    Run(String),
}

impl BenchError {
    pub fn input(msg: impl Into<String>) -> BenchError {
        BenchError::Input(msg.into())
    }
    pub fn run(msg: impl Into<String>) -> BenchError {
        BenchError::Run(msg.into())
    }
}

impl From<dmkv_api::KvError> for BenchError {
    fn from(e: dmkv_api::KvError) -> BenchError {
        match e {
            dmkv_api::KvError::Config(m) => BenchError::Input(m),
            other => BenchError::Run(other.to_string()),
        }
    }
}
