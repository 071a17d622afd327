//! Page identifiers (paper §3.3): the directory node in the top 8 bits, the
//! page's slot on that node's SSD in the low 56.

use std::fmt;

/// Bits of the SSD slot.
pub const SLOT_BITS: u32 = 56;
/// Mask of the SSD slot.
pub const SLOT_MASK: u64 = (1 << SLOT_BITS) - 1;
/// The most directory shards (node indices) a cluster can have.
pub const MAX_SHARDS: usize = 256;

const _: () = assert!(SLOT_BITS + 8 == 64);
const _: () = assert!(MAX_SHARDS == 1 << (64 - SLOT_BITS));

/// A page id. `Pid::EMPTY` (all ones) is never a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Pid(pub u64);

impl Pid {
    pub const EMPTY: Pid = Pid(u64::MAX);

    pub fn new(shard: u8, slot: u64) -> Pid {
        assert!(slot <= SLOT_MASK, "SSD slot {slot} does not fit in 56 bits");
        let p = Pid(((shard as u64) << SLOT_BITS) | slot);
        assert!(p != Pid::EMPTY, "the all-ones page id is reserved");
        p
    }

    /// The directory shard (the node index that created the page).
    pub fn shard(self) -> u8 {
        (self.0 >> SLOT_BITS) as u8
    }

    /// The page's slot on its directory's SSD.
    pub fn slot(self) -> u64 {
        self.0 & SLOT_MASK
    }
}

impl fmt::Display for Pid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "p{}:{}", self.shard(), self.slot())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_paper_example_decodes() {
        // 0x0100000000000F: directory node 1, SSD slot 15.
        let p = Pid(0x0100_0000_0000_000F);
        assert_eq!(p.shard(), 1);
        assert_eq!(p.slot(), 15);
        assert_eq!(Pid::new(1, 15), p);
        assert_eq!(Pid::new(255, SLOT_MASK - 1).shard(), 255);
    }
}
