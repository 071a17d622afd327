//! Leaf-table entries (LT and SLT slots): one 8-byte word each, changed by
//! CAS and single-word writes only.
//!
//! ```text
//!  63   62..56        55..48          47..0
//! lock | leaf region | synonym pointer | leaf number
//! ```
//!
//! The synonym pointer is an SLT slot index (0 = none: slot 0 of an SLT is
//! its use counter, never a leaf). The leaf region is the index of the
//! memory node whose leaf region holds the leaf (§3.6: 7 bits, so at most
//! 128 leaf regions). [`RETIRED`] is a value no live entry can have (its
//! leaf number is reserved): the memory node stores it into every LT entry
//! of a model it replaces, so a writer's lock CAS fails on it for good.

/// Bit layout of an entry.
pub const LOCK_BIT: u64 = 1 << 63;
pub const REGION_SHIFT: u32 = 56;
pub const REGION_BITS: u32 = 7;
pub const SYN_SHIFT: u32 = 48;
pub const SYN_BITS: u32 = 8;
pub const LEAF_BITS: u32 = 48;
pub const LEAF_MASK: u64 = (1 << LEAF_BITS) - 1;
/// The largest usable leaf number (the all-ones one is reserved for
/// [`RETIRED`]).
pub const MAX_LEAF: u64 = LEAF_MASK - 1;
/// Most leaf regions (memory nodes) an instance can span.
pub const MAX_REGIONS: usize = 1 << REGION_BITS;
/// Most SLT slots a model can have (the synonym pointer is 8 bits).
pub const MAX_SLT_SLOTS: usize = 1 << SYN_BITS;

/// Marks an LT entry of a retired model: locked forever.
pub const RETIRED: u64 = u64::MAX;

const _: () = {
    assert!(1 + REGION_BITS + SYN_BITS + LEAF_BITS == 64);
    assert!(REGION_SHIFT == SYN_SHIFT + SYN_BITS);
    assert!(SYN_SHIFT == LEAF_BITS);
    assert!(LOCK_BIT == 1 << (REGION_SHIFT + REGION_BITS));
};

/// A decoded entry.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Entry {
    pub locked: bool,
    pub region: u8,
    pub syn: u8,
    pub leaf: u64,
}

impl Entry {
    pub fn new(region: u8, leaf: u64) -> Entry {
        Entry {
            locked: false,
            region,
            syn: 0,
            leaf,
        }
    }

    pub fn encode(self) -> u64 {
        debug_assert!((self.region as u32) < (1 << REGION_BITS));
        debug_assert!(self.leaf <= MAX_LEAF);
        (if self.locked { LOCK_BIT } else { 0 })
            | ((self.region as u64 & ((1 << REGION_BITS) - 1)) << REGION_SHIFT)
            | ((self.syn as u64) << SYN_SHIFT)
            | (self.leaf & LEAF_MASK)
    }

    /// Decodes a word; `None` for [`RETIRED`].
    pub fn decode(w: u64) -> Option<Entry> {
        if w == RETIRED {
            return None;
        }
        Some(Entry {
            locked: w & LOCK_BIT != 0,
            region: ((w >> REGION_SHIFT) & ((1 << REGION_BITS) - 1)) as u8,
            syn: ((w >> SYN_SHIFT) & ((1 << SYN_BITS) - 1)) as u8,
            leaf: w & LEAF_MASK,
        })
    }

    pub fn with_lock(self, locked: bool) -> Entry {
        Entry { locked, ..self }
    }

    pub fn with_syn(self, syn: u8) -> Entry {
        Entry { syn, ..self }
    }
}

/// The same leaf and link, ignoring the lock bit.
pub fn unlocked(w: u64) -> u64 {
    w & !LOCK_BIT
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn round_trips(locked: bool, region in 0u8..128, syn: u8, leaf in 0..=MAX_LEAF) {
            let e = Entry { locked, region, syn, leaf };
            let w = e.encode();
            prop_assert_ne!(w, RETIRED);
            prop_assert_eq!(Entry::decode(w), Some(e));
            prop_assert_eq!(w & LOCK_BIT != 0, locked);
        }
    }

    #[test]
    fn retired_is_not_an_entry() {
        assert_eq!(Entry::decode(RETIRED), None);
        const { assert!(RETIRED & LOCK_BIT != 0, "a retired entry reads as locked") };
    }
}
