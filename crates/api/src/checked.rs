use crate::error::{KvError, Result};
use crate::store::{Capabilities, Key, KvStore};
use async_trait::async_trait;
use std::rc::Rc;

/// Validates input before it reaches an engine: reserved keys, oversized
/// values, scans on engines without them. Every client handed to the harness
/// or to applications is wrapped in one, so engines may assume valid input.
pub struct Checked {
    engine: &'static str,
    caps: Capabilities,
    inner: Rc<dyn KvStore>,
}

impl Checked {
    pub fn new(engine: &'static str, caps: Capabilities, inner: Rc<dyn KvStore>) -> Checked {
        Checked {
            engine,
            caps,
            inner,
        }
    }

    fn key(&self, key: Key) -> Result<()> {
        if self.caps.reserved_keys.contains(&key) {
            return Err(KvError::ReservedKey {
                key,
                engine: self.engine,
                why: self.caps.reserved_why,
            });
        }
        Ok(())
    }

    fn value(&self, value: &[u8]) -> Result<()> {
        if value.len() > self.caps.max_value_len {
            return Err(KvError::ValueTooLarge {
                len: value.len(),
                max: self.caps.max_value_len,
                engine: self.engine,
            });
        }
        Ok(())
    }
}

#[async_trait(?Send)]
impl KvStore for Checked {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        self.key(key)?;
        self.inner.get(key).await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.key(key)?;
        self.value(value)?;
        self.inner.insert(key, value).await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.key(key)?;
        self.value(value)?;
        self.inner.update(key, value).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.key(key)?;
        self.value(value)?;
        self.inner.upsert(key, value).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        self.key(key)?;
        self.inner.delete(key).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        if !self.caps.scan {
            return Err(KvError::Unsupported {
                engine: self.engine,
                what: "ordered scans",
            });
        }
        if n == 0 {
            return Ok(Vec::new());
        }
        // A reserved start key is fine: scans return stored keys only.
        self.inner.scan(start, n).await
    }
}
