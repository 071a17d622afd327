use crate::error::Result;
use async_trait::async_trait;
use dmkv_transport::{Endpoint, FutureSlot, SlotFuture};

/// Keys are 8-byte unsigned integers, as in all four papers.
pub type Key = u64;

/// What a scan returns: pairs in key order.
pub type ScanPairs = Vec<(Key, Vec<u8>)>;

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

    /// Hands back a value [`KvStore::get`] returned, once its caller has
    /// read it, so the engine may reuse its allocation for a later
    /// operation (rpc-hash keeps it as its endpoint's spare buffer: the
    /// next request then allocates nothing). Optional for both sides:
    /// the default gives the value to [`KvStore::recycles_to`]'s endpoint
    /// if there is one, else drops it, and a caller that keeps or drops a
    /// value instead is always correct.
    #[inline]
    fn recycle(&self, value: Vec<u8>) {
        if let Some(ep) = self.recycles_to() {
            ep.recycle(value)
        }
    }
    /// Whether [`KvStore::recycle`] does more than drop the value: a
    /// caller asks once and, if not, drops its values itself (no call per
    /// value through the engine's `dyn` handle). The default: whether
    /// [`KvStore::recycles_to`] names an endpoint.
    #[inline]
    fn recycles_values(&self) -> bool {
        self.recycles_to().is_some()
    }
    /// The endpoint a recycled value goes to, if [`KvStore::recycle`] is
    /// exactly `Endpoint::recycle` on it (rpc-hash's: a GET's value is its
    /// reply's buffer): a caller may then hand values to that endpoint
    /// itself, asked once, instead of through the engine's `dyn` handle
    /// (and `Checked`'s, and the blanket impl's) on every value. The
    /// default is `None`; [`KvStore::recycle`] is always correct.
    #[inline]
    fn recycles_to(&self) -> Option<&Endpoint> {
        None
    }

    // The same six operations with their future put in a caller's
    // [`FutureSlot`] (reused from one operation to the next) instead of a
    // fresh box: what the harness calls, one slot per task. An engine that
    // implements [`KvClient`] gets these without any allocation per
    // operation (its future is written into the slot); the defaults, for
    // engines implementing `KvStore` directly, put the boxed future in the
    // slot. Same answers either way.

    /// [`KvStore::get`], run in `slot`.
    fn get_in<'a>(
        &'a self,
        key: Key,
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<Option<Vec<u8>>>>
    where
        Self: 'a,
    {
        slot.put(self.get(key))
    }
    /// [`KvStore::insert`], run in `slot`.
    fn insert_in<'a>(
        &'a self,
        key: Key,
        value: &'a [u8],
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        slot.put(self.insert(key, value))
    }
    /// [`KvStore::update`], run in `slot`.
    fn update_in<'a>(
        &'a self,
        key: Key,
        value: &'a [u8],
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        slot.put(self.update(key, value))
    }
    /// [`KvStore::upsert`], run in `slot`.
    fn upsert_in<'a>(
        &'a self,
        key: Key,
        value: &'a [u8],
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        slot.put(self.upsert(key, value))
    }
    /// [`KvStore::delete`], run in `slot`.
    fn delete_in<'a>(&'a self, key: Key, slot: &'a mut FutureSlot) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        slot.put(self.delete(key))
    }
    /// [`KvStore::scan`], run in `slot`.
    fn scan_in<'a>(
        &'a self,
        start: Key,
        n: usize,
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<ScanPairs>>
    where
        Self: 'a,
    {
        slot.put(self.scan(start, n))
    }
}

/// What an engine's client implements: the six [`KvStore`] operations as
/// plain `async fn`s (their futures are the compiler's own types, not
/// boxed). Every `KvClient` is a [`KvStore`] (the impl below): its boxed
/// methods box these futures, and its `*_in` methods write them into the
/// caller's [`FutureSlot`] with no allocation, which is how the harness runs
/// every operation. The contract of each method is [`KvStore`]'s.
#[allow(async_fn_in_trait)] // compute-thread handles: never sent between threads
pub trait KvClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>>;
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool>;
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool>;
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool>;
    async fn delete(&self, key: Key) -> Result<bool>;
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>>;
    /// [`KvStore::recycle`]: the default gives the value to
    /// [`KvClient::recycles_to`]'s endpoint if there is one, else drops it.
    #[inline]
    fn recycle(&self, value: Vec<u8>) {
        if let Some(ep) = self.recycles_to() {
            ep.recycle(value)
        }
    }
    /// [`KvStore::recycles_values`]: the default is whether
    /// [`KvClient::recycles_to`] names an endpoint; a client with a
    /// `recycle` of its own says true here.
    #[inline]
    fn recycles_values(&self) -> bool {
        self.recycles_to().is_some()
    }
    /// [`KvStore::recycles_to`]: `Some` only if `recycle` is that
    /// endpoint's `recycle` and nothing else. A client whose GET values are
    /// its replies' buffers (rpc-hash, rpc-btree) names its endpoint here
    /// and needs neither `recycle` nor `recycles_values` of its own.
    #[inline]
    fn recycles_to(&self) -> Option<&Endpoint> {
        None
    }
}

#[async_trait(?Send)]
impl<T: KvClient> KvStore for T {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        KvClient::get(self, key).await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        KvClient::insert(self, key, value).await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        KvClient::update(self, key, value).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        KvClient::upsert(self, key, value).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        KvClient::delete(self, key).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        KvClient::scan(self, start, n).await
    }
    #[inline]
    fn recycle(&self, value: Vec<u8>) {
        KvClient::recycle(self, value)
    }
    #[inline]
    fn recycles_values(&self) -> bool {
        KvClient::recycles_values(self)
    }
    #[inline]
    fn recycles_to(&self) -> Option<&Endpoint> {
        KvClient::recycles_to(self)
    }

    #[inline]
    fn get_in<'a>(
        &'a self,
        key: Key,
        slot: &'a mut FutureSlot,
    ) -> SlotFuture<'a, Result<Option<Vec<u8>>>>
    where
        Self: 'a,
    {
        slot.put_with(|| KvClient::get(self, key))
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
        slot.put_with(|| KvClient::insert(self, key, value))
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
        slot.put_with(|| KvClient::update(self, key, value))
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
        slot.put_with(|| KvClient::upsert(self, key, value))
    }
    #[inline]
    fn delete_in<'a>(&'a self, key: Key, slot: &'a mut FutureSlot) -> SlotFuture<'a, Result<bool>>
    where
        Self: 'a,
    {
        slot.put_with(|| KvClient::delete(self, key))
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
        slot.put_with(|| KvClient::scan(self, start, n))
    }
}
