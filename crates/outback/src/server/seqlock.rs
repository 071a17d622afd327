//! The per-bucket lock and seqlock (invariants 3–5 of `docs/outback.md`),
//! written once over an abstract array of atomic words so that the memory
//! node's tables and the loom model (`tests/loom.rs`) run the same code.
//!
//! The word at `at` is a [`ControlWord`]: seed, version, lock bit.
//! - Writers: [`lock`] sets the lock bit by CAS (acquire-release), the writer
//!   changes slots and blocks with release stores, and [`unlock`] stores the
//!   next version with the (possibly new) seed and the lock clear.
//! - Readers: [`read`] loads the word (acquire), runs the reads (acquire
//!   loads), loads the word again, and retries unless both loads saw the same
//!   unlocked word. If any read saw a writer's store, the writer's lock CAS
//!   happened before it and so before the second load, which then sees a
//!   different word; so an accepted result saw no writer at all.

use crate::layout::ControlWord;

/// Atomic 8-byte words with the orderings of `RegionMem`: acquire loads,
/// release stores, acquire-release CAS. `at` is a byte offset.
pub trait Words {
    fn load(&self, at: u64) -> u64;
    fn store(&self, at: u64, v: u64);
    /// Returns the value found (equal to `expected` iff swapped).
    fn cas(&self, at: u64, expected: u64, new: u64) -> u64;
    /// Lets another thread run while waiting (spins, then yields).
    fn pause(&self, spins: &mut u32);
}

/// Takes the lock of the control word at `at`; returns the word it held.
pub fn lock(w: &impl Words, at: u64) -> ControlWord {
    let mut spins = 0;
    loop {
        let cur = ControlWord(w.load(at));
        if !cur.locked() && w.cas(at, cur.0, cur.with_lock().0) == cur.0 {
            return cur;
        }
        w.pause(&mut spins);
    }
}

/// Releases a lock taken by [`lock`] (which returned `prev`), publishing
/// `seed` with a new version.
pub fn unlock(w: &impl Words, at: u64, prev: ControlWord, seed: u8) {
    w.store(at, prev.next(seed).0);
}

/// Runs `f` (which reads words guarded by the control word at `at`) until
/// a run overlaps no writer; returns the control word it ran under and
/// `f`'s result. Errors of `f` end the attempt at once.
#[inline]
pub fn read<T, E>(
    w: &impl Words,
    at: u64,
    mut f: impl FnMut() -> Result<T, E>,
) -> Result<(ControlWord, T), E> {
    let mut spins = 0;
    loop {
        let v1 = w.load(at);
        if ControlWord(v1).locked() {
            w.pause(&mut spins);
            continue;
        }
        let out = f()?;
        if w.load(at) == v1 {
            return Ok((ControlWord(v1), out));
        }
        w.pause(&mut spins);
    }
}
