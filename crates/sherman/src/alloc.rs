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
pub use dmkv_api::fetch_gate::{ChunkFetch, WaitForFetch};
use dmkv_api::fetch_gate::{FetchGate, HasFetchGate};
use dmkv_memnode::GrowingPool;
use dmkv_transport::{Endpoint, NodeId, ServiceError, ServiceId, WireReader, WireWriter};
use std::collections::HashMap;

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
    /// The one chunk fetch in flight and the tasks parked on it
    /// (dmkv_api::fetch_gate, invariants G1-G2).
    gate: FetchGate,
}

impl LocalAlloc {
    /// Claims the one chunk fetch of this allocator: `true` if the caller
    /// is now the fetcher (it must hold a [`ChunkFetch`] until the fetch
    /// ends), `false` if another task's fetch is in flight.
    pub fn claim_fetch(&mut self) -> bool {
        self.gate.claim()
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

impl HasFetchGate for LocalAlloc {
    fn fetch_gate(&mut self) -> &mut FetchGate {
        &mut self.gate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
