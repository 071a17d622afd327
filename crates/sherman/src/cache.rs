//! The compute-side index cache: copies of inner nodes (level >= 1), shared
//! by every thread of a compute process, bounded in bytes, with random
//! eviction (Sherman samples entries to evict).
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
use std::sync::atomic::{AtomicU64, Ordering};

#[derive(Clone)]
struct Cached {
    high: u64,
    addr: GAddr,
    children: Vec<(u64, GAddr)>,
}

impl Cached {
    fn bytes(&self) -> u64 {
        48 + 16 * self.children.len() as u64
    }
}

/// Cached inner nodes by (level, low fence).
pub struct IndexCache {
    budget: u64,
    inner: RwLock<Inner>,
    pub hits: AtomicU64,
    pub misses: AtomicU64,
    pub evictions: AtomicU64,
}

#[derive(Default)]
struct Inner {
    nodes: BTreeMap<(u8, u64), Cached>,
    bytes: u64,
}

/// Where a cached node sends a key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hit {
    /// Level of the cached node.
    pub level: u8,
    /// The cached node itself (to drop it if it proves stale).
    pub node: GAddr,
    pub low: u64,
    /// The child for the key, at `level - 1`.
    pub child: GAddr,
}

impl IndexCache {
    pub fn new(budget: u64) -> IndexCache {
        IndexCache {
            budget,
            inner: RwLock::new(Inner::default()),
            hits: AtomicU64::new(0),
            misses: AtomicU64::new(0),
            evictions: AtomicU64::new(0),
        }
    }

    /// The lowest cached node above `min_level` covering `key`.
    pub fn lookup(&self, key: u64, min_level: u8, max_level: u8) -> Option<Hit> {
        let inner = self.inner.read();
        for level in min_level..=max_level {
            let found = inner
                .nodes
                .range((Bound::Included((level, 0)), Bound::Included((level, key))))
                .next_back();
            if let Some((&(_, low), c)) = found
                && key < c.high
            {
                let i = c.children.partition_point(|e| e.0 <= key);
                if i > 0 {
                    self.hits.fetch_add(1, Ordering::Relaxed);
                    return Some(Hit {
                        level,
                        node: c.addr,
                        low,
                        child: c.children[i - 1].1,
                    });
                }
            }
        }
        self.misses.fetch_add(1, Ordering::Relaxed);
        None
    }

    /// Caches a copy of inner node `n` at `addr`, replacing older copies of
    /// the same node.
    pub fn insert(&self, addr: GAddr, n: &NodeImage) {
        if n.is_leaf() || self.budget == 0 {
            return;
        }
        let c = Cached {
            high: n.high(),
            addr,
            children: n.inner_entries(),
        };
        let mut inner = self.inner.write();
        let add = c.bytes();
        if let Some(old) = inner.nodes.insert((n.level(), n.low()), c) {
            inner.bytes -= old.bytes();
        }
        inner.bytes += add;
        let mut rng = dmkv_transport::sim::rng();
        while inner.bytes > self.budget && !inner.nodes.is_empty() {
            // Random eviction: the first node at or after a random point.
            let level = rng.gen_range(1..=n.level());
            let at = (level, rng.r#gen::<u64>());
            let victim = inner
                .nodes
                .range(at..)
                .next()
                .or_else(|| inner.nodes.iter().next())
                .map(|(k, _)| *k)
                .expect("not empty");
            if let Some(old) = inner.nodes.remove(&victim) {
                inner.bytes -= old.bytes();
                self.evictions.fetch_add(1, Ordering::Relaxed);
            }
        }
    }

    /// Drops the copy of the node at (`level`, `low`) if it is `addr`'s.
    pub fn invalidate(&self, level: u8, low: u64, addr: GAddr) {
        let mut inner = self.inner.write();
        if inner
            .nodes
            .get(&(level, low))
            .is_some_and(|c| c.addr == addr)
            && let Some(old) = inner.nodes.remove(&(level, low))
        {
            inner.bytes -= old.bytes();
        }
    }

    pub fn bytes(&self) -> u64 {
        self.inner.read().bytes
    }

    pub fn len(&self) -> usize {
        self.inner.read().nodes.len()
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
    fn finds_the_lowest_covering_level_and_respects_the_budget() {
        let c = IndexCache::new(10_000);
        c.insert(GAddr(100), &inner(2, 0, u64::MAX, &[(0, 10), (500, 20)]));
        c.insert(GAddr(10), &inner(1, 0, 500, &[(0, 1), (100, 2)]));
        let h = c.lookup(150, 1, 2).unwrap();
        assert_eq!((h.level, h.child), (1, GAddr(2)));
        let h = c.lookup(600, 1, 2).unwrap();
        assert_eq!((h.level, h.child), (2, GAddr(20)));
        c.invalidate(1, 0, GAddr(10));
        assert_eq!(c.lookup(150, 1, 2).unwrap().level, 2);
        let small = IndexCache::new(200);
        for i in 0..50u64 {
            small.insert(GAddr(i + 1), &inner(1, i * 10, i * 10 + 10, &[(i * 10, 1)]));
        }
        assert!(small.bytes() <= 200 && !small.is_empty());
        assert!(small.evictions.load(Ordering::Relaxed) > 0);
    }
}
