//! The tree service's messages (docs/rpc-btree.md, *RPCs*). Every payload
//! is little-endian, built with `WireWriter` and parsed with `WireReader`;
//! a request is `op u8` followed by the op's fields and nothing else.

use dmkv_transport::{WireError, WireReader, WireWriter};
use dmkv_xtree::TreeStats;

pub const GET: u8 = 1;
pub const INSERT: u8 = 2;
pub const UPDATE: u8 = 3;
pub const UPSERT: u8 = 4;
pub const DELETE: u8 = 5;
pub const SCAN: u8 = 6;
pub const LOAD: u8 = 7;
pub const STATS: u8 = 8;
pub const UPDATE_HINTED: u8 = 9;
pub const FIND_LEAF: u8 = 10;

/// A SCAN reply stops adding pairs once it holds this many bytes (and then
/// says `more`, so the client continues after the last key). YCSB-E scans
/// (at most 100 pairs of small values) never reach it.
pub const SCAN_REPLY_BYTES: usize = 256 * 1024;

/// Most pairs one SCAN reply can hold (each takes at least 12 bytes), so a
/// hostile `n` cannot make the node collect more than it can send.
pub const SCAN_MAX_PAIRS: usize = SCAN_REPLY_BYTES / 12;

/// Bytes of LOAD requests the client packs into one RPC.
pub const LOAD_REQUEST_BYTES: usize = 256 * 1024;

/// Name of the service under the engine instance's prefix.
pub const SERVICE: &str = "tree";
/// Names of the regions under the engine instance's prefix.
pub const NODE_REGION: &str = "nodes";
pub const VALUE_REGION: &str = "values";

pub fn encode_stats(s: &TreeStats) -> Vec<u8> {
    let mut w = WireWriter::new();
    for v in [
        s.slots,
        s.height,
        s.leaves,
        s.inner_nodes,
        s.keys,
        s.leaf_splits,
        s.inner_splits,
        s.max_nodes,
        s.value_bytes_live,
        s.value_region_bytes,
        s.hinted_updates,
        s.hinted_updates_used,
    ] {
        w.u64(v);
    }
    w.finish()
}

pub fn decode_stats(buf: &[u8]) -> Result<TreeStats, WireError> {
    let mut r = WireReader::new(buf);
    let s = TreeStats {
        slots: r.u64()?,
        height: r.u64()?,
        leaves: r.u64()?,
        inner_nodes: r.u64()?,
        keys: r.u64()?,
        leaf_splits: r.u64()?,
        inner_splits: r.u64()?,
        max_nodes: r.u64()?,
        value_bytes_live: r.u64()?,
        value_region_bytes: r.u64()?,
        hinted_updates: r.u64()?,
        hinted_updates_used: r.u64()?,
    };
    r.end()?;
    Ok(s)
}

/// The tree figures `engine_stats` reports for both baselines.
pub fn stats_json(s: &TreeStats) -> serde_json::Value {
    serde_json::json!({
        "slots": s.slots,
        "height": s.height,
        "leaves": s.leaves,
        "inner_nodes": s.inner_nodes,
        "keys": s.keys,
        "fill_factor": s.fill_factor(),
        "splits": s.leaf_splits + s.inner_splits,
        "leaf_splits": s.leaf_splits,
        "inner_splits": s.inner_splits,
        "max_nodes": s.max_nodes,
        "value_bytes_live": s.value_bytes_live,
        "value_region_bytes": s.value_region_bytes,
        "hinted_updates": s.hinted_updates,
        "hinted_updates_used": s.hinted_updates_used,
    })
}
