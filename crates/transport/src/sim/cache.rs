//! The memory node's last-level cache, as a deterministic model.
//!
//! Code on a simulated core (RPC handlers, background jobs) touches region
//! memory through [`super::touch`]; each 64-byte line it touches goes
//! through a set-associative LRU model of the last-level cache of the node
//! the region lives on, at its first touch in the job only (a re-touch in
//! the same handler call or worker slice hits L1 and is not looked up:
//! `sim::job_lines`, docs/simulation.md, "Distinct lines for memory-node
//! jobs (branch i46)"). The model decides only whether a line hits; what a
//! hit or a miss costs is [`super::touch`]'s rule (docs/simulation.md,
//! "Memory-node CPU").
//!
//! Invariants:
//! 1. Deterministic: a line's set comes from its region's tag (node and
//!    region id, assigned in registration order) and its line number only,
//!    never from a host address or a randomly keyed hash, so the same run
//!    hits and misses the same lines in any process on any machine.
//! 2. Regions never alias: two lines share a cache slot only if they are
//!    the same line of the same region ([`line_key`] is the region id and
//!    the line number side by side; each node has its own cache).
//! 3. Each set holds at most `ways` distinct lines, most recently used
//!    first; a miss evicts the least recently used line of its set.
//! 4. Only code on simulated cores changes the cache: one-sided verbs
//!    (the NIC's DMA) neither fill nor evict lines (see the design note for
//!    what that leaves out).
//! 5. A prefetch ([`Llc::prefetch`], the pair prefetcher of
//!    `memnode.pair_prefetch`) fills a line that is absent exactly as a
//!    demand miss does, and leaves a present line and its set's order
//!    untouched; it counts in `prefetches`, never in `hits` or `misses`.
//!
//! The same structure models each memory-node core's private cache (branch
//! i69, `memnode.core_cache_bytes`), keyed by [`core_line_key`] (the node
//! too: a core set's cores are not tied to one node's memory). There:
//! 6. [`Llc::invalidate`] removes a line (a write by another core or by the
//!    NIC, `Sim::invalidate_lines`) and keeps the order of the rest of its
//!    set; the freed way becomes the set's last, so the next fill of the
//!    set takes it before evicting anything.

/// A free way (no line key equals it: a real key's region half is below
/// 2^32).
const EMPTY: u128 = u128::MAX;

/// The key of line `line` of region `region` in its node's cache: unique
/// for every (region, line) pair (invariant 2).
#[inline]
pub(crate) fn line_key(region: u32, line: u64) -> u128 {
    ((region as u128) << 64) | line as u128
}

/// The key of line `line` of the region tagged `tag` in a core's private
/// cache: unique for every (node, region, line) (a tag is below 2^48, so no
/// key equals [`EMPTY`]).
#[inline]
pub(crate) fn core_line_key(tag: u64, line: u64) -> u128 {
    ((tag as u128) << 64) | line as u128
}

/// What a region's memory carries so its lines reach the right cache: the
/// node it lives on and its id there, packed (`node << 32 | region`);
/// [`UNTAGGED`] for memory no backend registered.
pub(crate) fn region_tag(node: u16, region: u32) -> u64 {
    ((node as u64) << 32) | region as u64
}

/// The tag of memory that no backend registered (for example an engine's
/// private scratch memory): it is charged without the cache model.
pub(crate) const UNTAGGED: u64 = u64::MAX;

/// The node and region of a tag other than [`UNTAGGED`].
#[inline]
pub(crate) fn split_tag(tag: u64) -> (u16, u32) {
    ((tag >> 32) as u16, tag as u32)
}

/// One node's last-level cache: `sets` sets of `ways` lines, true LRU
/// within a set.
pub(crate) struct Llc {
    sets: u64,
    ways: usize,
    /// `sets * ways` line keys; set `s` is `keys[s*ways .. (s+1)*ways]`,
    /// most recently used first, free ways ([`EMPTY`]) at the end.
    keys: Vec<u128>,
    pub(crate) hits: u64,
    pub(crate) misses: u64,
    /// Misses charged the DRAM latency (the first line of an access).
    pub(crate) dependent_misses: u64,
    /// Lines the pair prefetcher brought in from DRAM (invariant 5).
    pub(crate) prefetches: u64,
    /// Lines [`Llc::invalidate`] removed (invariant 6).
    pub(crate) invalidations: u64,
}

impl Llc {
    /// A cache of `bytes` (at least one set) with `ways` lines per set.
    pub(crate) fn new(bytes: u64, ways: usize) -> Llc {
        let ways = ways.max(1);
        let sets = (bytes / 64 / ways as u64).max(1);
        Llc {
            sets,
            ways,
            keys: vec![EMPTY; sets as usize * ways],
            hits: 0,
            misses: 0,
            dependent_misses: 0,
            prefetches: 0,
            invalidations: 0,
        }
    }

    /// Capacity in lines.
    #[cfg(test)]
    pub(crate) fn lines(&self) -> u64 {
        self.sets * self.ways as u64
    }

    /// Looks `key` up and makes it the most recently used line of its set
    /// (filling it on a miss, evicting the set's least recently used line).
    /// True on a hit.
    pub(crate) fn access(&mut self, key: u128) -> bool {
        let ways = self.set_of(key);
        let hit = match ways.iter().position(|&k| k == key) {
            Some(p) => {
                ways[..=p].rotate_right(1);
                true
            }
            None => {
                // The last way is free or the LRU line: it goes.
                ways.rotate_right(1);
                ways[0] = key;
                false
            }
        };
        if hit {
            self.hits += 1;
        } else {
            self.misses += 1;
        }
        hit
    }

    /// Brings `key` in as a demand miss would if it is absent (most
    /// recently used, evicting its set's least recently used line);
    /// leaves the set as it is if `key` is there (a prefetch that finds
    /// its line drops: invariant 5). True if it filled the line.
    pub(crate) fn prefetch(&mut self, key: u128) -> bool {
        let ways = self.set_of(key);
        if ways.contains(&key) {
            return false;
        }
        ways.rotate_right(1);
        ways[0] = key;
        self.prefetches += 1;
        true
    }

    /// Removes `key` if present (invariant 6); true if it was.
    pub(crate) fn invalidate(&mut self, key: u128) -> bool {
        let ways = self.set_of(key);
        let Some(p) = ways.iter().position(|&k| k == key) else {
            return false;
        };
        ways[p..].rotate_left(1);
        *ways.last_mut().expect("a set has a way") = EMPTY;
        self.invalidations += 1;
        true
    }

    /// The ways of `key`'s set, most recently used first.
    #[inline]
    fn set_of(&mut self, key: u128) -> &mut [u128] {
        // Fibonacci hashing of the key: fixed multiplier, so deterministic
        // (invariant 1); spreads a region's consecutive lines and different
        // regions' lines over the sets like a real LLC's slice hash does.
        let h =
            ((key >> 64) as u64 ^ (key as u64).rotate_left(17)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
        let set = ((h >> 20) % self.sets) as usize;
        &mut self.keys[set * self.ways..(set + 1) * self.ways]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_working_set_that_fits_hits_after_the_first_pass() {
        // 64 KiB, 8 ways: 1024 lines. 512 lines of one region, twice.
        let mut c = Llc::new(64 << 10, 8);
        assert_eq!(c.lines(), 1024);
        let tag = 3;
        for l in 0..512 {
            assert!(!c.access(line_key(tag, l)), "line {l} is cold");
        }
        // Half the capacity spread by the hash: a set may still overflow,
        // but nearly every line stays.
        let hits = (0..512).filter(|&l| c.access(line_key(tag, l))).count();
        assert!(hits >= 480, "{hits} of 512 hit");
    }

    #[test]
    fn a_working_set_far_larger_than_the_cache_mostly_misses() {
        let mut c = Llc::new(64 << 10, 8);
        let tag = 0;
        // 16x the capacity, cyclically: LRU keeps none of it.
        for _ in 0..2 {
            for l in 0..16 * 1024 {
                c.access(line_key(tag, l));
            }
        }
        let rate = c.hits as f64 / (c.hits + c.misses) as f64;
        assert!(rate < 0.05, "hit rate {rate}");
    }

    #[test]
    fn lru_evicts_the_least_recently_used_line_of_a_set() {
        // One set of 4 ways: every key lands in it.
        let mut c = Llc::new(4 * 64, 4);
        let k = |l| line_key(0, l);
        for l in 0..4 {
            c.access(k(l));
        }
        assert!(c.access(k(0))); // 0 becomes most recent; 1 is now LRU
        assert!(!c.access(k(4))); // evicts 1
        assert!(c.access(k(0)) && c.access(k(2)) && c.access(k(3)) && c.access(k(4)));
        assert!(!c.access(k(1)), "line 1 was evicted");
    }

    #[test]
    fn a_prefetch_fills_an_absent_line_and_leaves_a_present_one() {
        // One set of 4 ways: every key lands in it.
        let mut c = Llc::new(4 * 64, 4);
        let k = |l| line_key(0, l);
        for l in 0..3 {
            c.access(k(l));
        }
        // Present: nothing moves (0 stays least recently used).
        assert!(!c.prefetch(k(0)));
        assert_eq!(c.prefetches, 0);
        // Absent: filled into the free way, as a miss would.
        assert!(c.prefetch(k(3)));
        assert_eq!((c.hits, c.misses, c.prefetches), (0, 3, 1));
        assert!(c.access(k(3)), "the prefetched line hits");
        // The set is full: the next fill evicts the LRU line, 0 (had the
        // prefetch of 0 refreshed it, 1 would go).
        assert!(c.prefetch(k(4)));
        assert!(!c.access(k(0)), "0 was the least recently used");
        assert!(c.access(k(4)));
    }

    #[test]
    fn an_invalidated_line_misses_and_its_way_is_filled_first() {
        // One set of 4 ways: every key lands in it.
        let mut c = Llc::new(4 * 64, 4);
        let k = |l| core_line_key(region_tag(1, 2), l);
        for l in 0..4 {
            c.access(k(l));
        }
        assert!(c.invalidate(k(2)));
        assert!(!c.invalidate(k(2)), "gone already");
        assert_eq!(c.invalidations, 1);
        // The free way takes the next fill: 0, the LRU line, stays.
        assert!(!c.access(k(2)), "an invalidated line misses");
        assert!(c.access(k(0)) && c.access(k(1)) && c.access(k(3)));
        // Another node's same region and line is another key.
        assert_ne!(k(1), core_line_key(region_tag(0, 2), 1));
    }

    #[test]
    fn regions_do_not_alias() {
        let mut c = Llc::new(4 * 64, 4);
        assert!(!c.access(line_key(0, 7)));
        assert!(!c.access(line_key(1, 7)), "other region, same line");
        assert!(!c.access(line_key(0, 7 + (1 << 40))), "far line");
        assert!(c.access(line_key(0, 7)));
        assert_eq!(split_tag(region_tag(3, 9)), (3, 9));
        assert_ne!(region_tag(u16::MAX, u32::MAX), UNTAGGED);
    }
}
