//! The distinct cache lines one compute operation touches in its own node's
//! memory (the simulated compute CPU, docs/simulation.md, "Distinct lines
//! per operation"), and the distinct lines one memory-node job touches
//! (a handler call, a worker job's slice: docs/simulation.md, "Distinct
//! lines for memory-node jobs (branch i46)", and `sim::JobLines`).
//!
//! A real core pays for the first touch of a line in an operation (it
//! brings the line into L1, or finds it in L2/L3); further touches of the
//! same line in that operation hit L1 and cost a few cycles of the
//! instructions around them, not a line. So an operation is charged the
//! number of DISTINCT lines it touched, whatever the access pattern: a
//! binary search re-reading a header line, a word-by-word walk of a page
//! and one copy of the same page cost the same lines.
//!
//! Invariants:
//! 1. Keys are exact: a region line is `address / 64` of the region's real
//!    memory, which is allocated 64-byte aligned (`RegionMem::zeroed`), so
//!    two regions never share a line and the count of distinct lines
//!    depends only on the offsets touched, never on where the allocator
//!    put the region (a seed replays). An object touched by address
//!    ([`crate::touch_local_at`]) is keyed by its exact start address with
//!    the top bit set: distinct objects are distinct keys even if they
//!    happen to share a line (their sharing would depend on the allocator's
//!    placement, which may change from run to run), and object keys never
//!    equal a region line's key (line numbers are below 2^58).
//! 2. A set holds each key at most once; `distinct()` is the number of
//!    keys inserted since the set was made or cleared, independent of
//!    insertion order and of the hash.
//! 3. Steady state allocates nothing for scopes of up to
//!    `MAX_POOLED_SLOTS / 2` lines: a set's table comes from a per-thread
//!    pool of spare tables and goes back to it, cleared, when the
//!    operation ends (`LineSet::release`); a table grows (doubling) only
//!    when a scope touches more lines than it holds. A table larger than
//!    `MAX_POOLED_SLOTS` is freed rather than pooled: clearing costs its
//!    whole size, and one huge scope (a memory node's bulk load, one job
//!    touching ~100,000 lines) must not make every later small scope on
//!    the thread clear its table (it did, in the first version of branch
//!    i46: memset was 59% of a simulated rpc-btree run's instructions).

use std::cell::RefCell;

/// Tables start with this many slots (they hold up to half as many keys
/// before doubling).
const INITIAL_SLOTS: usize = 128;
/// Spare tables a thread keeps (one per concurrently charged operation is
/// enough; more are dropped).
const MAX_SPARE: usize = 64;
/// The largest table kept in the pool (invariant 3): 2 KiB, 128 lines.
const MAX_POOLED_SLOTS: usize = 256;
/// Marks an object key (invariant 1).
const OBJECT_BIT: u64 = 1 << 63;

thread_local! {
    static SPARE: RefCell<Vec<Vec<u64>>> = const { RefCell::new(Vec::new()) };
}

/// A set of line keys: open addressing with linear probing over a
/// power-of-two table of `key + 1` (0 marks an empty slot).
#[derive(Default)]
pub(crate) struct LineSet {
    slots: Vec<u64>,
    len: u64,
    /// The last key inserted, plus 1 (0: none): a word-by-word walk touches
    /// the same line several times in a row, and this skips the probe.
    last: u64,
}

impl LineSet {
    /// An empty set with no table yet (taken from the pool at the first
    /// insert).
    pub(crate) const fn new() -> LineSet {
        LineSet {
            slots: Vec::new(),
            len: 0,
            last: 0,
        }
    }

    /// Lines `first..=last` of region memory (line numbers, `address / 64`).
    #[inline]
    pub(crate) fn insert_lines(&mut self, first: u64, last: u64) {
        for line in first..=last {
            self.insert(line);
        }
    }

    /// The object at byte address `addr` (invariant 1).
    #[inline]
    pub(crate) fn insert_object(&mut self, addr: u64) {
        self.insert(addr | OBJECT_BIT);
    }

    /// Line `line` of region memory (`address / 64`); true if the set did
    /// not hold it yet (its first touch in the scope).
    #[inline]
    pub(crate) fn insert_line(&mut self, line: u64) -> bool {
        self.insert(line)
    }

    /// Number of distinct keys inserted.
    pub(crate) fn distinct(&self) -> u64 {
        self.len
    }

    /// Inserts `key`; true if it was not in the set.
    #[inline]
    fn insert(&mut self, key: u64) -> bool {
        let k = key.wrapping_add(1);
        if k == self.last {
            return false;
        }
        self.last = k;
        if self.slots.is_empty() {
            self.slots = take_spare();
        } else if (self.len as usize + 1) * 2 > self.slots.len() {
            self.grow();
        }
        let new = place(&mut self.slots, k);
        if new {
            self.len += 1;
        }
        new
    }

    fn grow(&mut self) {
        let mut bigger = vec![0u64; self.slots.len() * 2];
        for &k in self.slots.iter().filter(|&&k| k != 0) {
            place(&mut bigger, k);
        }
        let old = std::mem::replace(&mut self.slots, bigger);
        give_spare(old);
    }

    /// Empties the set and gives its table back to the thread's pool.
    pub(crate) fn release(&mut self) {
        self.len = 0;
        self.last = 0;
        let slots = std::mem::take(&mut self.slots);
        if !slots.is_empty() {
            give_spare(slots);
        }
    }
}

impl Drop for LineSet {
    fn drop(&mut self) {
        self.release();
    }
}

/// Puts `k` (non-zero) into `slots` (a power of two in length, with a free
/// slot); false if it was there.
#[inline]
fn place(slots: &mut [u64], k: u64) -> bool {
    let mask = slots.len() - 1;
    let mut i = (k.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) as usize & mask;
    loop {
        let s = slots[i];
        if s == k {
            return false;
        }
        if s == 0 {
            slots[i] = k;
            return true;
        }
        i = (i + 1) & mask;
    }
}

fn take_spare() -> Vec<u64> {
    SPARE
        .with(|s| s.borrow_mut().pop())
        .unwrap_or_else(|| vec![0u64; INITIAL_SLOTS])
}

/// Clears `slots` and keeps it for the next operation, unless it is larger
/// than `MAX_POOLED_SLOTS` (invariant 3).
fn give_spare(mut slots: Vec<u64>) {
    if slots.len() > MAX_POOLED_SLOTS {
        return;
    }
    slots.fill(0);
    // `try_with`: a set dropped while the thread's locals are torn down
    // just frees its table.
    let _ = SPARE.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < MAX_SPARE {
            s.push(slots);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_same_line_twice_is_one_line() {
        let mut s = LineSet::new();
        s.insert_lines(7, 7);
        s.insert_lines(7, 7);
        assert_eq!(s.distinct(), 1);
        // Not only back to back: after another line, too.
        s.insert_lines(9, 9);
        s.insert_lines(7, 7);
        assert_eq!(s.distinct(), 2);
    }

    #[test]
    fn a_span_counts_every_line_it_crosses_once() {
        let mut s = LineSet::new();
        // A 4 KiB copy starting mid-line: 65 lines.
        s.insert_lines(100, 164);
        assert_eq!(s.distinct(), 65);
        // Overlapping spans and words inside them add only new lines.
        s.insert_lines(160, 170);
        s.insert_lines(120, 120);
        assert_eq!(s.distinct(), 71);
    }

    #[test]
    fn objects_and_lines_are_different_keys() {
        let mut s = LineSet::new();
        s.insert_lines(64, 64);
        s.insert_object(64);
        s.insert_object(64);
        s.insert_object(72);
        assert_eq!(s.distinct(), 3);
    }

    #[test]
    fn release_resets_the_set_and_reuses_its_table() {
        let mut s = LineSet::new();
        s.insert_lines(0, 9);
        assert_eq!(s.distinct(), 10);
        s.release();
        assert_eq!(s.distinct(), 0);
        // The table went back to the pool cleared: the same lines count
        // again, and nothing of the last scope is left in it.
        s.insert_lines(5, 5);
        assert_eq!(s.distinct(), 1);
        s.insert_lines(0, 9);
        assert_eq!(s.distinct(), 10);
        let mut t = LineSet::new();
        t.insert_lines(3, 3);
        assert_eq!(
            t.distinct(),
            1,
            "a second set shares nothing with the first"
        );
    }

    #[test]
    fn many_lines_beyond_the_initial_table_are_all_counted() {
        let mut s = LineSet::new();
        let n = 10 * INITIAL_SLOTS as u64;
        // Scattered lines (every 3rd), each inserted twice, in two passes.
        for pass in 0..2 {
            for i in 0..n {
                s.insert_lines(3 * i, 3 * i);
            }
            assert_eq!(s.distinct(), n, "pass {pass}");
        }
        s.insert_lines(1, 1);
        assert_eq!(s.distinct(), n + 1);
        s.release();
        s.insert_lines(0, 0);
        assert_eq!(s.distinct(), 1);
    }

    #[test]
    fn insert_line_says_whether_the_line_is_new() {
        let mut s = LineSet::new();
        assert!(s.insert_line(5));
        assert!(!s.insert_line(5), "back to back: the fast path");
        assert!(s.insert_line(6));
        assert!(!s.insert_line(5), "after another line: the table");
        s.release();
        assert!(s.insert_line(5), "a released set starts empty");
        assert_eq!(s.distinct(), 1);
    }

    #[test]
    fn a_huge_table_is_not_pooled() {
        let mut s = LineSet::new();
        for l in 0..(MAX_POOLED_SLOTS as u64) {
            s.insert_lines(l, l);
        }
        assert!(s.slots.len() > MAX_POOLED_SLOTS);
        s.release();
        let pooled = SPARE.with(|p| p.borrow().iter().map(Vec::len).max().unwrap_or(0));
        assert!(
            pooled <= MAX_POOLED_SLOTS,
            "a {pooled}-slot table was pooled"
        );
        // The next scope starts small and still counts right.
        let mut t = LineSet::new();
        t.insert_lines(1, 3);
        assert_eq!(t.distinct(), 3);
        assert!(t.slots.len() <= MAX_POOLED_SLOTS);
    }

    #[test]
    fn the_count_is_the_same_in_any_order() {
        let lines: Vec<u64> = (0..500u64).map(|i| (i * 7919) % 211).collect();
        let mut a = LineSet::new();
        let mut b = LineSet::new();
        for &l in &lines {
            a.insert_lines(l, l);
        }
        for &l in lines.iter().rev() {
            b.insert_lines(l, l);
        }
        let expect = {
            let mut v = lines.clone();
            v.sort_unstable();
            v.dedup();
            v.len() as u64
        };
        assert_eq!(a.distinct(), expect);
        assert_eq!(b.distinct(), expect);
    }
}
