use crate::error::Result;
use async_trait::async_trait;

/// Keys are 8-byte unsigned integers, as in all four papers.
pub type Key = u64;

/// What an engine offers and refuses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Capabilities {
    /// Whether `scan` is offered (hash designs do not order keys).
    pub scan: bool,
    /// The largest value accepted, in bytes.
    pub max_value_len: usize,
    /// Keys the engine reserves (empty-slot markers, fences); the API
    /// refuses them with [`KvError::ReservedKey`](crate::KvError).
    pub reserved_keys: &'static [Key],
    /// Why those keys are reserved, for the error message.
    pub reserved_why: &'static str,
}

/// A compute thread's handle on a store. Its tasks share it; methods take
/// `&self` and may run concurrently as interleaved tasks.
#[async_trait(?Send)]
pub trait KvStore {
    /// The value of `key`, if present.
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>>;
    /// Inserts a new pair; returns false (and changes nothing) if `key` exists.
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool>;
    /// Replaces the value of an existing key; returns false if it is missing.
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool>;
    /// Inserts or replaces; returns true if the key was new.
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool>;
    /// Removes `key`; returns false if it was missing.
    async fn delete(&self, key: Key) -> Result<bool>;
    /// Up to `n` pairs with key >= `start`, in key order. Engines without
    /// ordered scans return [`KvError::Unsupported`](crate::KvError).
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>>;
}
