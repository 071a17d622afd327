use crate::error::{KvError, Result};
use crate::store::{Capabilities, Key, KvStore};
use std::future::Future;
use std::pin::Pin;
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

/// The future every `KvStore` method returns (the shape `async_trait`
/// gives the trait's methods).
type Fut<'a, T> = Pin<Box<dyn Future<Output = Result<T>> + 'a>>;

/// A refusal, as a future (only refused operations allocate it).
fn refuse<'a, T: 'a>(e: KvError) -> Fut<'a, T> {
    Box::pin(std::future::ready(Err(e)))
}

// Written out rather than with `#[async_trait]`: each method checks its input
// and hands back the engine's own future, so a checked operation allocates
// one future (the engine's), not a second one wrapping it.
impl KvStore for Checked {
    fn get<'s, 'f>(&'s self, key: Key) -> Fut<'f, Option<Vec<u8>>>
    where
        's: 'f,
        Self: 'f,
    {
        match self.key(key) {
            Ok(()) => self.inner.get(key),
            Err(e) => refuse(e),
        }
    }
    fn insert<'s, 'v, 'f>(&'s self, key: Key, value: &'v [u8]) -> Fut<'f, bool>
    where
        's: 'f,
        'v: 'f,
        Self: 'f,
    {
        match self.key(key).and_then(|()| self.value(value)) {
            Ok(()) => self.inner.insert(key, value),
            Err(e) => refuse(e),
        }
    }
    fn update<'s, 'v, 'f>(&'s self, key: Key, value: &'v [u8]) -> Fut<'f, bool>
    where
        's: 'f,
        'v: 'f,
        Self: 'f,
    {
        match self.key(key).and_then(|()| self.value(value)) {
            Ok(()) => self.inner.update(key, value),
            Err(e) => refuse(e),
        }
    }
    fn upsert<'s, 'v, 'f>(&'s self, key: Key, value: &'v [u8]) -> Fut<'f, bool>
    where
        's: 'f,
        'v: 'f,
        Self: 'f,
    {
        match self.key(key).and_then(|()| self.value(value)) {
            Ok(()) => self.inner.upsert(key, value),
            Err(e) => refuse(e),
        }
    }
    fn delete<'s, 'f>(&'s self, key: Key) -> Fut<'f, bool>
    where
        's: 'f,
        Self: 'f,
    {
        match self.key(key) {
            Ok(()) => self.inner.delete(key),
            Err(e) => refuse(e),
        }
    }
    fn scan<'s, 'f>(&'s self, start: Key, n: usize) -> Fut<'f, Vec<(Key, Vec<u8>)>>
    where
        's: 'f,
        Self: 'f,
    {
        if !self.caps.scan {
            return refuse(KvError::Unsupported {
                engine: self.engine,
                what: "ordered scans",
            });
        }
        if n == 0 {
            return Box::pin(std::future::ready(Ok(Vec::new())));
        }
        // A reserved start key is fine: scans return stored keys only.
        self.inner.scan(start, n)
    }
}
