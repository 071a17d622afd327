//! Memory allocation: coarse chunks handed out by the memory node's CPU over
//! RPC (rarely; the pool grows by segments when full, see
//! [`dmkv_memnode::GrowingPool`]), fine-grained nodes and value blocks carved from them by the
//! client (Sherman's two-level allocator).
//!
//! The `alloc` service takes exactly one byte, [`ALLOC_CHUNK`], and replies
//! with the chunk's offset (u64). It trusts nothing else: any other payload
//! is refused. Tree nodes are never freed (B+link trees do not merge);
//! value blocks are freed to the freeing client's lists and reused with the
//! next tag (see [`crate::layout::FatPtr`]).

use crate::layout::block_bytes;
use dmkv_api::Result;
use dmkv_memnode::GrowingPool;
use dmkv_transport::{Endpoint, NodeId, ServiceError, ServiceId, WireReader, WireWriter};
use std::cell::RefCell;
use std::collections::HashMap;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

/// The one request of the `alloc` service.
pub const ALLOC_CHUNK: u8 = 1;

/// Instructions a chunk request declares to the simulated cluster's
/// instruction term ([`dmkv_transport::sim::work`], a no-op off a metered
/// memory-node core; docs/simulation.md, "Declared work, the rest (branch
/// i60)"): [`serve_chunk`] inclusive, 1,902 over 6 calls (317 each: the
/// decoding, the pool's bump, the reply's encoding), counted with
/// callgrind on the `local` transport, main's binary fac3bce
/// (`/tmp/keep/dmkv-head15`): `valgrind --tool=callgrind dmkv bench
/// --engine sherman --workload insert --keys 20000 --ops 30000 --threads 1
/// --tasks 8 --seed 1`.
pub const SERVE_CHUNK_WORK: u64 = 317;

/// Serves one chunk request.
pub fn serve_chunk(
    pool: &GrowingPool,
    chunk: u64,
    req: &[u8],
) -> std::result::Result<Vec<u8>, ServiceError> {
    dmkv_transport::sim::work(SERVE_CHUNK_WORK);
    let mut r = WireReader::new(req);
    let op = r.u8()?;
    r.end()?;
    if op != ALLOC_CHUNK {
        return Err(ServiceError::malformed(format!("unknown alloc op {op}")));
    }
    let off = pool
        .alloc(chunk, 64)
        .map_err(|e| ServiceError::exhausted(format!("sherman memory pool: {e}")))?;
    let mut w = WireWriter::new();
    w.u64(off);
    Ok(w.finish())
}

/// A memory node's allocation service, as a client sees it.
#[derive(Debug, Clone, Copy)]
pub struct ChunkSource {
    pub node: NodeId,
    pub service: ServiceId,
    pub chunk: u64,
}

impl ChunkSource {
    /// Asks the memory node for a chunk; returns its offset.
    pub async fn fetch(&self, ep: &Endpoint) -> Result<u64> {
        let mut w = WireWriter::new();
        w.u8(ALLOC_CHUNK);
        let reply = ep.call(self.node, self.service, w.finish()).await?;
        let mut r = WireReader::new(&reply);
        let off = r.u64().map_err(dmkv_transport::TransportError::from)?;
        r.end().map_err(dmkv_transport::TransportError::from)?;
        Ok(off)
    }
}

/// Value-block size class of `len` value bytes: the block size rounded up to
/// a power of two.
fn class_of(len: usize) -> u64 {
    (block_bytes(len) as u64).next_power_of_two().max(32)
}

/// A client's allocator on one memory node. Its methods never wait: when
/// the current chunk runs out they return `None` and the caller fetches a
/// chunk ([`ChunkSource::fetch`]) and hands it over with [`LocalAlloc::add_chunk`],
/// so no borrow of it is held across a network wait.
#[derive(Debug, Default)]
pub struct LocalAlloc {
    next: u64,
    end: u64,
    /// Freed value blocks by class: (offset, tag they were freed with).
    free: HashMap<u64, Vec<(u64, u8)>>,
    pub chunks: u64,
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

    fn bump(&mut self, size: u64) -> Option<u64> {
        // Nodes (multiples of 64) are cache-line aligned, blocks (powers of
        // two) aligned to their size up to a line; chunks are line aligned.
        let align = size.min(64).next_power_of_two();
        let at = self.next.div_ceil(align) * align;
        if self.end == 0 || at + size > self.end {
            return None;
        }
        self.next = at + size;
        Some(at)
    }

    /// Starts carving from a fresh chunk (the rest of the old one is left).
    pub fn add_chunk(&mut self, offset: u64, len: u64) {
        self.next = offset;
        self.end = offset + len;
        self.chunks += 1;
    }

    /// A new tree node's offset.
    pub fn node(&mut self, node_bytes: u64) -> Option<u64> {
        self.bump(node_bytes)
    }

    /// A value block for `len` bytes: (offset, tag to write it with).
    pub fn block(&mut self, len: usize) -> Option<(u64, u8)> {
        let class = class_of(len);
        if let Some((off, tag)) = self.free.get_mut(&class).and_then(|l| l.pop()) {
            return Some((off, tag.wrapping_add(1)));
        }
        Some((self.bump(class)?, 0))
    }

    /// Gives back a block no leaf points to any more.
    pub fn free_block(&mut self, off: u64, len: usize, tag: u8) {
        self.free.entry(class_of(len)).or_default().push((off, tag));
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
/// ends; the caller then looks for a node or block again.
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
    fn carves_chunks_and_reuses_blocks_with_the_next_tag() {
        let mut a = LocalAlloc::default();
        assert_eq!(a.node(1024), None, "no chunk yet");
        a.add_chunk(4096, 4096);
        assert_eq!(a.node(1024), Some(4096));
        let (b, tag) = a.block(100).unwrap();
        assert_eq!((b % 64, tag), (0, 0));
        a.free_block(b, 100, 255);
        assert_eq!(a.block(90), Some((b, 0)), "same class, tag wraps to 0");
        assert_eq!(a.node(4096), None, "does not fit");
    }
}
