//! The compute-side index cache, as Sherman's released code keeps it
//! (`thustorage/Sherman` `include/IndexCache.h`, `src/Tree.cpp`): copies of
//! level-1 inner nodes (the leaves' parents) only, shared by every thread
//! of a compute process, a budget of whole nodes (`cache_mb` MiB of
//! `node_bytes` pages, the artifact's `memory_size / sizeof(InternalPage)`),
//! and eviction by two random samples, the less used of the two leaving
//! (the artifact's `evict_one`). A lookup that misses walks the tree from
//! the root (`Tree::search`'s `p = root`), reading every level.
//!
//! A cached node may be stale: its children's ranges only shrink by splits
//! to the right (invariant 3 of the design note), so a pointer from a stale
//! copy still leads to a node whose low fence is at most the key, and the
//! reader moves right along sibling links; the stale copy is then dropped.

use crate::layout::{GAddr, NodeImage};
use parking_lot::RwLock;
use rand::Rng;
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

struct Cached {
    high: u64,
    addr: GAddr,
    children: Vec<(u64, GAddr)>,
    /// Lookups this copy answered (the artifact's `index_cache_freq`),
    /// which eviction compares.
    uses: AtomicU64,
}

/// Cached level-1 nodes by low fence.
pub struct IndexCache {
    /// How many nodes the budget holds.
    capacity: usize,
    node_bytes: u64,
    inner: RwLock<BTreeMap<u64, Cached>>,
    /// Counted into by every compute process of a simulated cluster
    /// (`ConnectArgs::counters_from`); the cache itself is this process's.
    pub counts: Arc<CacheCounts>,
}

/// What [`IndexCache`] counts.
#[derive(Default)]
pub struct CacheCounts {
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
}

/// Where a cached level-1 node sends a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    /// The cached node itself (to drop it if it proves stale).
    pub node: GAddr,
    pub low: u64,
    /// The leaf for the key.
    pub child: GAddr,
}

impl IndexCache {
    /// A cache of `budget` bytes of `node_bytes` nodes (0: no cache).
    pub fn new(budget: u64, node_bytes: usize) -> IndexCache {
        IndexCache::counting_into(budget, node_bytes, Arc::default())
    }

    /// [`IndexCache::new`], counting into `counts`.
    pub fn counting_into(budget: u64, node_bytes: usize, counts: Arc<CacheCounts>) -> IndexCache {
        IndexCache {
            capacity: usize::try_from(budget / node_bytes as u64).unwrap_or(usize::MAX),
            node_bytes: node_bytes as u64,
            inner: RwLock::new(BTreeMap::new()),
            counts,
        }
    }

    /// The cached level-1 node covering `key` and its child for it.
    pub fn lookup(&self, key: u64) -> Option<Hit> {
        let inner = self.inner.read();
        if let Some((&low, c)) = inner.range(..=key).next_back()
            && key < c.high
        {
            let i = c.children.partition_point(|e| e.0 <= key);
            if i > 0 {
                c.uses.fetch_add(1, Ordering::Relaxed);
                self.counts.hits.fetch_add(1, Ordering::Relaxed);
                return Some(Hit {
                    node: c.addr,
                    low,
                    child: c.children[i - 1].1,
                });
            }
        }
        self.counts.misses.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Caches a copy of `n` at `addr` if it is a level-1 node (the
    /// artifact adds pages at level 1 only), replacing an older copy of
    /// the same node; evicts while the budget is exceeded.
    pub fn insert(&self, addr: GAddr, n: &NodeImage) {
        if n.level() != 1 || self.capacity == 0 {
            return;
        }
        let c = Cached {
            high: n.high(),
            addr,
            children: n.inner_entries(),
            uses: AtomicU64::new(0),
        };
        let mut inner = self.inner.write();
        inner.insert(n.low(), c);
        if inner.len() <= self.capacity {
            return;
        }
        let mut rng = dmkv_transport::sim::rng();
        while inner.len() > self.capacity {
            // Two samples: the node covering (or, before the first, the
            // first) a random key each, the second another node than the
            // first (the next one, if it drew the same); the less used
            // leaves, the second on a tie (`freq1 < freq2 ? e1 : e2`).
            // The node found, else (past either end) the first one.
            let or_first = |found: Option<(&u64, &Cached)>| {
                found
                    .or_else(|| inner.iter().next())
                    .map(|(&low, _)| low)
                    .expect("not empty")
            };
            let cover = |key: u64| or_first(inner.range(..=key).next_back());
            let first = cover(rng.r#gen::<u64>());
            let mut second = cover(rng.r#gen::<u64>());
            if second == first {
                second = or_first(
                    inner
                        .range((Bound::Excluded(first), Bound::Unbounded))
                        .next(),
                );
            }
            let uses = |low: u64| inner[&low].uses.load(Ordering::Relaxed);
            let victim = if uses(first) < uses(second) {
                first
            } else {
                second
            };
            inner.remove(&victim);
            self.counts.evictions.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// Drops the copy of the node with low fence `low` if it is `addr`'s.
    pub fn invalidate(&self, low: u64, addr: GAddr) {
        let mut inner = self.inner.write();
        if inner.get(&low).is_some_and(|c| c.addr == addr) {
            inner.remove(&low);
        }
    }

    /// What the cached copies take: whole nodes, as the artifact keeps them.
    pub fn bytes(&self) -> u64 {
        self.len() as u64 * self.node_bytes
    }

    pub fn len(&self) -> usize {
        self.inner.read().len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn inner(level: u8, low: u64, high: u64, children: &[(u64, u64)]) -> NodeImage {
        let mut n = NodeImage::new(256, level, low, high, GAddr::NULL);
        let e: Vec<_> = children.iter().map(|&(k, a)| (k, GAddr(a))).collect();
        n.set_inner_entries(&e);
        n
    }

    #[test]
    fn keeps_level_one_nodes_within_a_budget_of_whole_nodes() {
        let c = IndexCache::new(10 * 256, 256);
        // Only level 1 is kept.
        c.insert(GAddr(100), &inner(2, 0, u64::MAX, &[(0, 10), (500, 20)]));
        assert_eq!(c.lookup(600), None);
        c.insert(GAddr(10), &inner(1, 0, 500, &[(0, 1), (100, 2)]));
        let h = c.lookup(150).unwrap();
        assert_eq!((h.node, h.low, h.child), (GAddr(10), 0, GAddr(2)));
        assert_eq!(c.lookup(600), None, "beyond the cached node's high fence");
        c.invalidate(0, GAddr(11));
        assert!(
            c.lookup(150).is_some(),
            "another node's address invalidates nothing"
        );
        c.invalidate(0, GAddr(10));
        assert_eq!(c.lookup(150), None);
        // Ten nodes of 256 bytes fit; the eleventh evicts one.
        for i in 0..11u64 {
            c.insert(GAddr(i + 1), &inner(1, i * 10, i * 10 + 10, &[(i * 10, 1)]));
        }
        assert_eq!((c.len(), c.bytes()), (10, 2560));
        assert_eq!(c.counts.evictions.load(Ordering::Relaxed), 1);
        assert_eq!(
            IndexCache::new(255, 256).capacity,
            0,
            "a budget under one node caches none"
        );
    }

    #[test]
    fn eviction_keeps_the_more_used_of_two_samples() {
        // Two nodes cached, the first used often: whichever two samples
        // are drawn, a third node's arrival evicts a node used less than
        // the first (the new node itself, unused, or the second).
        for round in 0..50u64 {
            let c = IndexCache::new(2 * 256, 256);
            c.insert(GAddr(1), &inner(1, 0, 1 << 62, &[(0, 7)]));
            c.insert(GAddr(2), &inner(1, 1 << 62, 1 << 63, &[(1 << 62, 8)]));
            for _ in 0..5 {
                c.lookup(5).unwrap();
            }
            c.insert(
                GAddr(3),
                &inner(1, 1 << 63, u64::MAX, &[(1 << 63, 9 + round)]),
            );
            assert_eq!(c.len(), 2);
            assert_eq!(c.lookup(5).map(|h| h.node), Some(GAddr(1)), "round {round}");
        }
    }
}
