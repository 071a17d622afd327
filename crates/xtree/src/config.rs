//! How big an XTree's regions are.

use crate::layout::{DEFAULT_SLOTS, Geometry, MAX_VALUE_LEN, block_bytes};
use crate::tree::XTreeError;

/// Sizes of one tree. Regions are reserved up front (the OS maps them
/// lazily); running out of either gives [`XTreeError::Exhausted`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct XTreeConfig {
    /// N: slots per node.
    pub slots: usize,
    /// Nodes the node region holds (leaves and inner nodes; node 0, the
    /// superblock, is extra).
    pub max_nodes: u64,
    /// Bytes of the value region (out-of-line values).
    pub value_region_bytes: u64,
}

/// Smallest value region: room for a few hundred odd-sized values even when
/// the workload's values are all inline.
const MIN_VALUE_REGION: u64 = 1 << 20;

impl XTreeConfig {
    /// Sizes for `expected_keys` keys of typically `value_size` bytes.
    ///
    /// Nodes: leaves split into halves, so a leaf holds at least N/2 keys
    /// (deletes aside); as many inner nodes again bound every level above
    /// (fanout at least 2); plus slack for small trees.
    /// Values: inline 8-byte values need no blocks; others need one block of
    /// their size class per key, twice over so that updates of a full store
    /// still find blocks while old ones are being freed.
    pub fn sized_for(
        expected_keys: u64,
        value_size: u32,
        slots: usize,
    ) -> Result<XTreeConfig, XTreeError> {
        Geometry::new(slots).map_err(|e| XTreeError::Config(e.to_string()))?;
        let per_leaf = (slots as u64 / 2).max(1);
        let leaves = expected_keys.div_ceil(per_leaf) + 8;
        let max_nodes = 2 * leaves + 64;
        let value_region_bytes = if value_size as usize == crate::layout::INLINE_VALUE_LEN {
            MIN_VALUE_REGION
        } else {
            let block = block_bytes((value_size as usize).min(MAX_VALUE_LEN))
                .next_power_of_two()
                .max(32) as u64;
            (2 * expected_keys * block).max(MIN_VALUE_REGION)
        };
        Ok(XTreeConfig {
            slots,
            max_nodes,
            value_region_bytes,
        })
    }
}

impl Default for XTreeConfig {
    fn default() -> Self {
        XTreeConfig::sized_for(100_000, 8, DEFAULT_SLOTS).expect("default slots are valid")
    }
}
