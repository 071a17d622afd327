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
pub use dmkv_api::fetch_gate::{ChunkFetch, WaitForFetch};
use dmkv_api::fetch_gate::{FetchGate, HasFetchGate};
use dmkv_memnode::GrowingPool;
use dmkv_transport::{Endpoint, NodeId, ServiceError, ServiceId, WireReader, WireWriter};
use std::collections::HashMap;

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

impl HasFetchGate for LocalAlloc {
    fn fetch_gate(&mut self) -> &mut FetchGate {
        &mut self.gate
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
