//! Addresses of an instance's regions and the region headers.
//!
//! Every memory node `i` (its index in `ServeArgs::nodes`, which is also its
//! 7-bit leaf-region number) has three regions:
//!
//! - leaves: `alloc_num u64 | capacity u64 | ... ` then leaf `n` at byte
//!   `LEAF_BASE + n * leaf_bytes` (Eq. 3). A leaf is allocated by FAA on
//!   `alloc_num` (§3.3).
//! - models: `magic u64 | capacity u64 | used u64 | ...` then model
//!   records, allocated by memory node 0 (the only node that trains).
//! - values: `bump u64 | capacity u64 | ...` then out-of-line value blocks,
//!   allocated by FAA on `bump` (bytes).
//!
//! Node 0 also has the meta region (`layout::meta`).

use crate::config::Config;
use crate::layout::meta::{MetaLayout, ModelRef};
use dmkv_transport::{RemoteAddr, RemoteRegion};

/// Where leaves, records and blocks start in their regions.
pub const LEAF_BASE: u64 = 64;
pub const MODEL_BASE: u64 = 64;
pub const VALUE_BASE: u64 = 64;
/// Header words of leaf, model and value regions.
pub const H_ALLOC: u64 = 0;
pub const H_CAPACITY: u64 = 8;
/// Model regions: bytes in use (written by node 0 after it writes records).
pub const H_USED: u64 = 16;
pub const MODELS_MAGIC: u64 = 0x534C_4544_4F4D_5852; // "RXMODELS"

/// The regions of one instance, as seen by a client or by memory node 0.
#[derive(Debug, Clone)]
pub struct Remote {
    pub meta: RemoteRegion,
    pub meta_layout: MetaLayout,
    pub leaves: Vec<RemoteRegion>,
    pub models: Vec<RemoteRegion>,
    pub values: Vec<RemoteRegion>,
    pub leaf_bytes: u64,
}

impl Remote {
    pub fn new(
        cfg: &Config,
        meta: RemoteRegion,
        leaves: Vec<RemoteRegion>,
        models: Vec<RemoteRegion>,
        values: Vec<RemoteRegion>,
    ) -> Remote {
        Remote {
            meta,
            meta_layout: MetaLayout {
                queue: cfg.queue_slots,
                dir_slot_words: cfg.dir_slot_words(),
            },
            leaves,
            models,
            values,
            leaf_bytes: cfg.leaf.bytes() as u64,
        }
    }

    pub fn nodes(&self) -> usize {
        self.leaves.len()
    }

    /// Leaf `leaf` of leaf region `region`, if such a region exists.
    pub fn leaf(&self, region: u8, leaf: u64) -> Option<RemoteAddr> {
        let r = self.leaves.get(region as usize)?;
        let off = leaf.checked_mul(self.leaf_bytes)?.checked_add(LEAF_BASE)?;
        (off + self.leaf_bytes <= r.len).then(|| r.at(off))
    }

    /// Word `word` of the model record `m`.
    pub fn record(&self, m: ModelRef, word: usize) -> Option<RemoteAddr> {
        let r = self.models.get(m.node as usize)?;
        let off = m.offset.checked_add(word as u64 * 8)?;
        (off + 8 <= r.len).then(|| r.at(off))
    }

    pub fn value(&self, region: u8, offset: u64) -> Option<RemoteAddr> {
        let r = self.values.get(region as usize)?;
        (offset >= VALUE_BASE && offset < r.len).then(|| r.at(offset))
    }

    pub fn meta_word(&self, word: usize) -> RemoteAddr {
        self.meta.at(word as u64 * 8)
    }
}
