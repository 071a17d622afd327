//! Memory allocation: the memory node's CPU hands out coarse pieces by RPC
//! (KV chunks to clients, subtables to resizers: rare; the pool grows by
//! segments when full, see [`dmkv_memnode::GrowingPool`]), clients carve KV
//! blocks from their chunks locally and reuse freed blocks with the next
//! tag (RACE's two-level allocation).
//!
//! The `alloc` service takes exactly one byte, [`ALLOC_CHUNK`] or
//! [`ALLOC_SUBTABLE`], and replies with an offset (u64); anything else is
//! refused.

use crate::layout::{KV_UNIT, TAG_MOD};
use dmkv_api::Result;
use dmkv_memnode::GrowingPool;
use dmkv_transport::{Endpoint, NodeId, ServiceError, ServiceId, WireReader, WireWriter};
use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

pub const ALLOC_CHUNK: u8 = 1;
pub const ALLOC_SUBTABLE: u8 = 2;

/// Instructions an allocation request declares to the simulated cluster's
/// instruction term ([`dmkv_transport::sim::work`], a no-op off a metered
/// memory-node core; docs/simulation.md, "Declared work, the rest (branch
/// i60)"): [`serve_alloc`] inclusive, 4,134 over 13 calls (318 each: the
/// decoding, the pool's bump, the reply's encoding), counted with
/// callgrind on the `local` transport, main's binary fac3bce
/// (`/tmp/keep/dmkv-head15`): `valgrind --tool=callgrind dmkv bench
/// --engine race --workload insert --keys 20000 --ops 30000 --threads 1
/// --tasks 8 --seed 1` (KV chunks; a subtable's request takes the same
/// path with another size).
pub const SERVE_ALLOC_WORK: u64 = 318;

/// Sizes the service hands out.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AllocSizes {
    pub chunk: u64,
    pub subtable: u64,
}

pub fn serve_alloc(
    pool: &GrowingPool,
    sizes: AllocSizes,
    req: &[u8],
) -> std::result::Result<Vec<u8>, ServiceError> {
    dmkv_transport::sim::work(SERVE_ALLOC_WORK);
    let mut r = WireReader::new(req);
    let op = r.u8()?;
    r.end()?;
    let size = match op {
        ALLOC_CHUNK => sizes.chunk,
        ALLOC_SUBTABLE => sizes.subtable,
        op => return Err(ServiceError::malformed(format!("unknown alloc op {op}"))),
    };
    let off = pool
        .alloc(size, 64)
        .map_err(|e| ServiceError::exhausted(format!("race memory pool: {e}")))?;
    let mut w = WireWriter::new();
    w.u64(off);
    Ok(w.finish())
}

/// A memory node's allocation service, as a client sees it.
#[derive(Debug, Clone, Copy)]
pub struct AllocSource {
    pub node: NodeId,
    pub service: ServiceId,
    pub sizes: AllocSizes,
}

impl AllocSource {
    /// Asks for a KV chunk or a subtable; returns its offset. A subtable
    /// comes zeroed (fresh memory is never reused).
    pub async fn fetch(&self, ep: &Endpoint, op: u8) -> Result<u64> {
        let mut w = WireWriter::new();
        w.u8(op);
        let reply = ep.call(self.node, self.service, w.finish()).await?;
        let mut r = WireReader::new(&reply);
        let off = r.u64().map_err(dmkv_transport::TransportError::from)?;
        r.end().map_err(dmkv_transport::TransportError::from)?;
        Ok(off)
    }
}

/// A client's KV-block allocator on one memory node; never waits (the
/// caller fetches chunks, so no borrow is held across a network wait).
#[derive(Debug, Default)]
pub struct LocalAlloc {
    next: u64,
    end: u64,
    /// Freed blocks by size in units: (offset, tag they were freed with).
    free: HashMap<u8, Vec<(u64, u8)>>,
    /// A task of this client is fetching a chunk: others wait for it
    /// instead of fetching (and wasting) chunks of their own. Set and
    /// cleared only through [`ChunkFetch`], whose drop clears it, so a
    /// fetch whose future is dropped mid-way cannot leave it set.
    fetching: bool,
    /// Tasks parked until the fetch in flight ends ([`WaitForFetch`]);
    /// woken all at once when it does (with or without a chunk).
    waiters: Vec<Waker>,
}

impl LocalAlloc {
    /// Claims the one chunk fetch of this allocator: `true` if the caller
    /// is now the fetcher (it must hold a [`ChunkFetch`] until the fetch
    /// ends), `false` if another task's fetch is in flight.
    pub fn claim_fetch(&mut self) -> bool {
        !std::mem::replace(&mut self.fetching, true)
    }

    /// Ends the fetch in flight and wakes every task parked on it.
    fn end_fetch(&mut self) {
        self.fetching = false;
        for w in self.waiters.drain(..) {
            w.wake();
        }
    }

    pub fn add_chunk(&mut self, offset: u64, len: u64) {
        self.next = offset;
        self.end = offset + len;
    }

    /// A block of `units` 64-byte units: (offset, tag to write it with).
    pub fn block(&mut self, units: u8) -> Option<(u64, u8)> {
        if let Some((off, tag)) = self.free.get_mut(&units).and_then(|l| l.pop()) {
            return Some((off, (tag + 1) % TAG_MOD));
        }
        let size = u64::from(units) * KV_UNIT as u64;
        if self.end == 0 || self.next + size > self.end {
            return None;
        }
        let at = self.next;
        self.next += size;
        Some((at, 0))
    }

    /// Gives back a block no slot points to any more.
    pub fn free(&mut self, offset: u64, units: u8, tag: u8) {
        self.free.entry(units).or_default().push((offset, tag));
    }
}

/// The fetcher's hold on allocator `mn`'s fetch: dropping it (after the
/// chunk was added, after an error, or with the fetching future dropped
/// mid-way) ends the fetch and wakes the tasks waiting for it.
pub struct ChunkFetch<'a> {
    allocs: &'a RefCell<Vec<LocalAlloc>>,
    mn: usize,
}

impl<'a> ChunkFetch<'a> {
    /// The caller claimed the fetch with [`LocalAlloc::claim_fetch`].
    pub fn new(allocs: &'a RefCell<Vec<LocalAlloc>>, mn: usize) -> Self {
        Self { allocs, mn }
    }
}

impl Drop for ChunkFetch<'_> {
    fn drop(&mut self) {
        self.allocs.borrow_mut()[self.mn].end_fetch();
    }
}

/// Waits, parked (no polling), until allocator `mn`'s fetch in flight
/// ends; the caller then looks for a block again.
pub struct WaitForFetch<'a> {
    pub allocs: &'a RefCell<Vec<LocalAlloc>>,
    pub mn: usize,
}

impl Future for WaitForFetch<'_> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut allocs = self.allocs.borrow_mut();
        let a = &mut allocs[self.mn];
        if !a.fetching {
            return Poll::Ready(());
        }
        // One entry per poll while pending: a spurious poll adds a
        // duplicate, which the fetch's end wakes harmlessly.
        a.waiters.push(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Counts its wakes.
    struct CountWake(std::sync::atomic::AtomicUsize);
    impl std::task::Wake for CountWake {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A task waiting for another's chunk fetch parks (one waker, no
    /// re-poll) and is woken when the fetch ends, however it ends: here
    /// the fetcher's hold is dropped without a chunk, as when its future
    /// is dropped mid-way or the fetch fails; the fetch is free to claim
    /// again afterwards. (With the old flag and a polling wait, a dropped
    /// fetcher left `fetching` set and its siblings spinning forever.)
    #[test]
    fn a_waiter_parks_and_wakes_when_the_fetch_ends_however_it_ends() {
        let allocs = RefCell::new(vec![LocalAlloc::default(), LocalAlloc::default()]);
        assert!(allocs.borrow_mut()[1].claim_fetch());
        let held = ChunkFetch::new(&allocs, 1);
        assert!(!allocs.borrow_mut()[1].claim_fetch(), "one fetch at a time");
        assert!(allocs.borrow_mut()[0].claim_fetch(), "per memory node");

        let count = std::sync::Arc::new(CountWake(0.into()));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut wait = WaitForFetch {
            allocs: &allocs,
            mn: 1,
        };
        assert!(Pin::new(&mut wait).poll(&mut cx).is_pending());
        assert_eq!(allocs.borrow()[1].waiters.len(), 1);
        assert_eq!(count.0.load(std::sync::atomic::Ordering::Relaxed), 0);

        drop(held);
        assert_eq!(
            count.0.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "woken once"
        );
        assert!(allocs.borrow()[1].waiters.is_empty());
        assert!(Pin::new(&mut wait).poll(&mut cx).is_ready());
        assert!(allocs.borrow_mut()[1].claim_fetch(), "free to claim again");
    }

    #[test]
    fn carves_and_reuses_with_the_next_tag() {
        let mut a = LocalAlloc::default();
        assert_eq!(a.block(1), None);
        a.add_chunk(4096, 256);
        assert_eq!(a.block(2), Some((4096, 0)));
        assert_eq!(a.block(2), Some((4224, 0)));
        assert_eq!(a.block(1), None, "full");
        a.free(4096, 2, TAG_MOD - 1);
        assert_eq!(a.block(2), Some((4096, 0)), "tag wraps");
    }
}
