use crate::error::{KvError, Result};
use crate::store::{Capabilities, Key, KvStore, ScanPairs};
use dmkv_transport::{FutureSlot, SlotFuture};
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

/// A refusal, as a future in `slot` (out of line: the checked methods'
/// common path then saves no registers for it).
#[cold]
#[inline(never)]
fn refuse_in<T: 'static>(slot: &mut FutureSlot, e: KvError) -> SlotFuture<'_, Result<T>> {
    slot.put(std::future::ready(Err(e)))
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

    #[inline]
    fn recycle(&self, value: Vec<u8>) {
        self.inner.recycle(value)
    }
    #[inline]
    fn recycles_values(&self) -> bool {
        self.inner.recycles_values()
    }
    #[inline]
    fn recycles_to(&self) -> Option<&dmkv_transport::Endpoint> {
        self.inner.recycles_to()
    }

    // The slot forms: the same checks, then the engine's own slot form (a
    // refusal is a ready future in the slot).
    #[inline]
    fn get_in<'a>(
        &'a self,
        key: Key,
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<Option<Vec<u8>>>>
    where
        Self: 'a,
    {
        match self.key(key) {
            Ok(()) => self.inner.get_in(key, slot),
            Err(e) => refuse_in(slot, e),
        }
    }
    #[inline]
    fn insert_in<'a>(
        &'a self,
        key: Key,
        value: &'a [u8],
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        match self.key(key).and_then(|()| self.value(value)) {
            Ok(()) => self.inner.insert_in(key, value, slot),
            Err(e) => refuse_in(slot, e),
        }
    }
    #[inline]
    fn update_in<'a>(
        &'a self,
        key: Key,
        value: &'a [u8],
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        match self.key(key).and_then(|()| self.value(value)) {
            Ok(()) => self.inner.update_in(key, value, slot),
            Err(e) => refuse_in(slot, e),
        }
    }
    #[inline]
    fn upsert_in<'a>(
        &'a self,
        key: Key,
        value: &'a [u8],
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        match self.key(key).and_then(|()| self.value(value)) {
            Ok(()) => self.inner.upsert_in(key, value, slot),
            Err(e) => refuse_in(slot, e),
        }
    }
    #[inline]
    fn delete_in<'a>(&'a self, key: Key, slot: &'a mut FutureSlot) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        match self.key(key) {
            Ok(()) => self.inner.delete_in(key, slot),
            Err(e) => refuse_in(slot, e),
        }
    }
    #[inline]
    fn scan_in<'a>(
        &'a self,
        start: Key,
        n: usize,
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<ScanPairs>>
    where
        Self: 'a,
    {
        if !self.caps.scan {
            return refuse_in(
                slot,
                KvError::Unsupported {
                    engine: self.engine,
                    what: "ordered scans",
                },
            );
        }
        if n == 0 {
            return slot.put(std::future::ready(Ok(Vec::new())));
        }
        self.inner.scan_in(start, n, slot)
    }
}
