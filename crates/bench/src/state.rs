//! What the harness knows about every key during a run, shared by all
//! threads: whether it exists, and the highest value version handed out.
//!
//! Existence: only a key's owner task inserts or deletes it (see
//! [`crate::plan`]), so the owner always knows it exactly. Other tasks learn
//! whether existence was *stable* during their operation: the owner marks a
//! key `changing` before its insert or delete and, once it completes, stamps
//! the key with a tick of a global clock. A reader reads the clock (`t0`)
//! before its operation and the key's word after it; if the key is not
//! changing and its last change completed at a tick below `t0`, no change
//! overlapped the operation and the reader's expectation is exact. Any
//! change overlapping the operation either is still marked or ticked the
//! clock after `t0` was read, so the test is conservative, never wrong.
//!
//! Versions: every write allocates a fresh version with an atomic add before
//! it is issued, so a version read back can never exceed the allocator; a
//! greater one is a value from the future (or garbage that happens to
//! parse).
//!
//! Layout: a key's existence word and its version share one 16-byte slot
//! (four to a cache line), so that checking an operation's answer touches
//! one line of this table, not one in each of two tables; at 1M keys those
//! are DRAM misses that every operation paid (docs/performance.md, sixth
//! pass). [`KeyStates::touch`] brings the slot in early, alongside the
//! plan's key, so that its miss overlaps the key's instead of following the
//! operation.

use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const EXISTS: u64 = 1;
const CHANGING: u64 = 2;
/// An insert or delete failed with an error: whether it applied is unknown,
/// and the key is no longer checked.
const UNKNOWN: u64 = 4;
const STAMP_SHIFT: u32 = 3;

/// The version loaded values carry. Version 0 is never written.
pub const LOAD_VERSION: u32 = 1;

/// A clock reading taken before an operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Stamp(u64);

/// One key's state: its existence word and the highest version handed out.
#[repr(align(16))]
struct Slot {
    word: AtomicU64,
    version: AtomicU32,
}

/// Per-key state of a run.
pub struct KeyStates {
    slots: Vec<Slot>,
    clock: AtomicU64,
}

impl KeyStates {
    /// `universe` keys, of which indices `0..loaded` exist at version
    /// [`LOAD_VERSION`].
    pub fn new(universe: usize, loaded: usize) -> KeyStates {
        KeyStates {
            slots: (0..universe)
                .map(|i| Slot {
                    word: AtomicU64::new(if i < loaded { EXISTS } else { 0 }),
                    version: AtomicU32::new(if i < loaded { LOAD_VERSION } else { 0 }),
                })
                .collect(),
            // Starts at 1 so that the initial stamp 0 is below every reading.
            clock: AtomicU64::new(1),
        }
    }

    pub fn len(&self) -> usize {
        self.slots.len()
    }

    pub fn is_empty(&self) -> bool {
        self.slots.is_empty()
    }

    /// Reads key `i`'s slot and discards what it read: called as an
    /// operation begins, next to reading the key itself, so that the two
    /// cache misses overlap (the checks after the operation then find the
    /// slot in cache). It decides nothing: the checks read the slot again,
    /// after the operation, as their correctness requires.
    #[inline]
    pub fn touch(&self, i: u32) {
        std::hint::black_box(self.slots[i as usize].word.load(Ordering::Relaxed));
    }

    /// Reads the clock; call before the operation.
    pub fn stamp(&self) -> Stamp {
        Stamp(self.clock.load(Ordering::SeqCst))
    }

    /// Whether key `i` existed throughout an operation that began at `t0`
    /// and has just completed: Some(exists) if that is certain, None if its
    /// existence changed or may have changed meanwhile.
    pub fn stable_existence(&self, i: u32, t0: Stamp) -> Option<bool> {
        let w = self.slots[i as usize].word.load(Ordering::SeqCst);
        if w & (CHANGING | UNKNOWN) != 0 || (w >> STAMP_SHIFT) >= t0.0 {
            return None;
        }
        Some(w & EXISTS != 0)
    }

    /// Whether key `i` exists, as its owner (or anyone, once the run is
    /// quiescent) knows it; None if an error left it unknown.
    pub fn settled_existence(&self, i: u32) -> Option<bool> {
        let w = self.slots[i as usize].word.load(Ordering::SeqCst);
        debug_assert!(w & CHANGING == 0, "asked about a key being changed");
        if w & UNKNOWN != 0 {
            None
        } else {
            Some(w & EXISTS != 0)
        }
    }

    /// The owner starts an insert or delete of key `i`.
    pub fn begin_change(&self, i: u32) {
        self.slots[i as usize]
            .word
            .fetch_or(CHANGING, Ordering::SeqCst);
    }

    /// The owner's insert or delete of key `i` completed; the key now exists
    /// or not, or is unknown (None) after an error.
    pub fn end_change(&self, i: u32, exists: Option<bool>) {
        let tick = self.clock.fetch_add(1, Ordering::SeqCst);
        let flags = match exists {
            Some(true) => EXISTS,
            Some(false) => 0,
            None => UNKNOWN,
        };
        self.slots[i as usize]
            .word
            .store((tick << STAMP_SHIFT) | flags, Ordering::SeqCst);
    }

    /// A fresh version for a write of key `i`.
    pub fn next_version(&self, i: u32) -> u32 {
        self.slots[i as usize]
            .version
            .fetch_add(1, Ordering::SeqCst)
            + 1
    }

    /// The highest version handed out for key `i` so far.
    pub fn max_version(&self, i: u32) -> u32 {
        self.slots[i as usize].version.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_overlapping_an_operation_make_it_unstable() {
        let s = KeyStates::new(3, 2);
        let t0 = s.stamp();
        assert_eq!(s.stable_existence(0, t0), Some(true));
        assert_eq!(s.stable_existence(2, t0), Some(false));
        // A change that begins during the operation.
        s.begin_change(2);
        assert_eq!(s.stable_existence(2, t0), None);
        s.end_change(2, Some(true));
        assert_eq!(s.stable_existence(2, t0), None, "completed after t0");
        assert_eq!(s.stable_existence(2, s.stamp()), Some(true));
        assert_eq!(s.settled_existence(2), Some(true));
        s.begin_change(1);
        s.end_change(1, None);
        assert_eq!(s.stable_existence(1, s.stamp()), None);
        assert_eq!(s.settled_existence(1), None);
    }

    #[test]
    fn a_keys_word_and_version_share_a_cache_line() {
        // Four slots to a 64-byte line, none straddling two.
        assert_eq!(std::mem::size_of::<Slot>(), 16);
        assert_eq!(std::mem::align_of::<Slot>(), 16);
        let s = KeyStates::new(5, 5);
        s.touch(4);
        assert_eq!(s.max_version(4), LOAD_VERSION);
    }

    #[test]
    fn versions_increase_from_the_load_version() {
        let s = KeyStates::new(2, 1);
        assert_eq!(s.max_version(0), LOAD_VERSION);
        assert_eq!(s.next_version(0), LOAD_VERSION + 1);
        assert_eq!(s.max_version(1), 0);
        assert_eq!(s.next_version(1), 1);
    }
}
