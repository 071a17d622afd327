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

/// Per-key state of a run.
pub struct KeyStates {
    words: Vec<AtomicU64>,
    versions: Vec<AtomicU32>,
    clock: AtomicU64,
}

impl KeyStates {
    /// `universe` keys, of which indices `0..loaded` exist at version
    /// [`LOAD_VERSION`].
    pub fn new(universe: usize, loaded: usize) -> KeyStates {
        KeyStates {
            words: (0..universe)
                .map(|i| AtomicU64::new(if i < loaded { EXISTS } else { 0 }))
                .collect(),
            versions: (0..universe)
                .map(|i| AtomicU32::new(if i < loaded { LOAD_VERSION } else { 0 }))
                .collect(),
            // Starts at 1 so that the initial stamp 0 is below every reading.
            clock: AtomicU64::new(1),
        }
    }

    pub fn len(&self) -> usize {
        self.words.len()
    }

    pub fn is_empty(&self) -> bool {
        self.words.is_empty()
    }

    /// Reads the clock; call before the operation.
    pub fn stamp(&self) -> Stamp {
        Stamp(self.clock.load(Ordering::SeqCst))
    }

    /// Whether key `i` existed throughout an operation that began at `t0`
    /// and has just completed: Some(exists) if that is certain, None if its
    /// existence changed or may have changed meanwhile.
    pub fn stable_existence(&self, i: u32, t0: Stamp) -> Option<bool> {
        let w = self.words[i as usize].load(Ordering::SeqCst);
        if w & (CHANGING | UNKNOWN) != 0 || (w >> STAMP_SHIFT) >= t0.0 {
            return None;
        }
        Some(w & EXISTS != 0)
    }

    /// Whether key `i` exists, as its owner (or anyone, once the run is
    /// quiescent) knows it; None if an error left it unknown.
    pub fn settled_existence(&self, i: u32) -> Option<bool> {
        let w = self.words[i as usize].load(Ordering::SeqCst);
        debug_assert!(w & CHANGING == 0, "asked about a key being changed");
        if w & UNKNOWN != 0 {
            None
        } else {
            Some(w & EXISTS != 0)
        }
    }

    /// The owner starts an insert or delete of key `i`.
    pub fn begin_change(&self, i: u32) {
        self.words[i as usize].fetch_or(CHANGING, Ordering::SeqCst);
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
        self.words[i as usize].store((tick << STAMP_SHIFT) | flags, Ordering::SeqCst);
    }

    /// A fresh version for a write of key `i`.
    pub fn next_version(&self, i: u32) -> u32 {
        self.versions[i as usize].fetch_add(1, Ordering::SeqCst) + 1
    }

    /// The highest version handed out for key `i` so far.
    pub fn max_version(&self, i: u32) -> u32 {
        self.versions[i as usize].load(Ordering::SeqCst)
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
    fn versions_increase_from_the_load_version() {
        let s = KeyStates::new(2, 1);
        assert_eq!(s.max_version(0), LOAD_VERSION);
        assert_eq!(s.next_version(0), LOAD_VERSION + 1);
        assert_eq!(s.max_version(1), 0);
        assert_eq!(s.next_version(1), 1);
    }
}
