//! The client's cache of inner nodes: an LRU bounded in bytes.

use dmkv_xtree::NodeView;
use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

/// Bookkeeping bytes per entry on top of the node image: the hash map's
/// slot (node number, pointer, stamp, size) and the LRU order's B-tree
/// entry (stamp, node number), rounded up. An estimate, stated so that
/// `client_cache_bytes` counts what the cache really holds.
pub const ENTRY_OVERHEAD: usize = 64;

struct Entry {
    node: Arc<NodeView>,
    stamp: u64,
    bytes: usize,
}

/// Inner-node images by node number, least recently used evicted first.
pub struct NodeCache {
    capacity: usize,
    used: usize,
    next_stamp: u64,
    map: HashMap<u32, Entry>,
    /// stamp -> node number, oldest first.
    lru: BTreeMap<u64, u32>,
}

/// Bytes an entry for `v` costs.
pub fn entry_bytes(v: &NodeView) -> usize {
    std::mem::size_of::<NodeView>()
        + 8 * (v.keys.keys.capacity() + v.slots.capacity())
        + ENTRY_OVERHEAD
}

impl NodeCache {
    pub fn new(capacity: usize) -> NodeCache {
        NodeCache {
            capacity,
            used: 0,
            next_stamp: 0,
            map: HashMap::new(),
            lru: BTreeMap::new(),
        }
    }

    fn stamp(&mut self) -> u64 {
        self.next_stamp += 1;
        self.next_stamp
    }

    /// The cached image of `node`, marked most recently used.
    pub fn get(&mut self, node: u32) -> Option<Arc<NodeView>> {
        self.with(node, |v| v.clone())
    }

    /// `f` of the cached image of `node`, marked most recently used; no
    /// reference count is taken.
    pub fn with<T>(&mut self, node: u32, f: impl FnOnce(&Arc<NodeView>) -> T) -> Option<T> {
        let last = self.next_stamp;
        let e = self.map.get_mut(&node)?;
        // An entry holding the last stamp issued is already the most recent
        // one: re-stamping it would not change the order (the root, hit by
        // every descent, is usually that entry).
        if e.stamp != last {
            self.next_stamp += 1;
            let stamp = self.next_stamp;
            self.lru.remove(&e.stamp);
            e.stamp = stamp;
            self.lru.insert(stamp, node);
        }
        Some(f(&e.node))
    }

    /// Caches `v` as the image of `node`, evicting the least recently used
    /// entries to stay within capacity (an image larger than the whole
    /// capacity is not cached). Returns how many entries it evicted (the
    /// reader counts them in its `ReaderStats`).
    pub fn insert(&mut self, node: u32, v: Arc<NodeView>) -> u64 {
        self.remove(node);
        let bytes = entry_bytes(&v);
        if bytes > self.capacity {
            return 0;
        }
        let mut evicted = 0;
        while self.used + bytes > self.capacity {
            let (_, victim) = self.lru.pop_first().expect("used bytes imply entries");
            let e = self.map.remove(&victim).expect("lru and map agree");
            self.used -= e.bytes;
            evicted += 1;
        }
        let stamp = self.stamp();
        self.lru.insert(stamp, node);
        self.map.insert(
            node,
            Entry {
                node: v,
                stamp,
                bytes,
            },
        );
        self.used += bytes;
        evicted
    }

    /// Drops `node`'s image (found stale).
    pub fn remove(&mut self, node: u32) {
        if let Some(e) = self.map.remove(&node) {
            self.lru.remove(&e.stamp);
            self.used -= e.bytes;
        }
    }

    /// Bytes held: images plus bookkeeping.
    pub fn used_bytes(&self) -> usize {
        self.used
    }

    pub fn len(&self) -> usize {
        self.map.len()
    }

    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_xtree::{Header, KeysView, Meta};

    fn img(n: usize) -> Arc<NodeView> {
        Arc::new(NodeView {
            keys: KeysView {
                version: 1,
                header: Header::default(),
                meta: Meta {
                    level: 1,
                    out_of_line: 0,
                },
                keys: (0..n as u64).collect(),
            },
            slots: vec![1; n],
        })
    }

    #[test]
    fn evicts_least_recently_used_within_capacity() {
        let one = entry_bytes(&img(4));
        let mut c = NodeCache::new(3 * one);
        let mut evictions = 0;
        for n in 1..=3 {
            evictions += c.insert(n, img(4));
        }
        assert_eq!(c.used_bytes(), 3 * one);
        assert!(c.get(1).is_some(), "1 is now the most recent");
        evictions += c.insert(4, img(4));
        assert!(c.get(2).is_none(), "2 was the least recently used");
        assert!(c.get(1).is_some() && c.get(3).is_some() && c.get(4).is_some());
        assert_eq!((c.len(), evictions), (3, 1));
        c.remove(3);
        assert_eq!(c.used_bytes(), 2 * one);
        c.insert(1, img(4));
        assert_eq!(c.len(), 2, "re-inserting replaces");
        // A hit on the most recent entry keeps it most recent without a
        // new stamp; the others keep their order.
        assert_eq!(c.with(4, |v| v.level()), Some(1));
        assert_eq!(c.with(4, |v| v.level()), Some(1));
        c.insert(5, img(4));
        c.insert(6, img(4));
        assert!(c.get(4).is_some(), "4 was the most recent");
        assert!(c.get(1).is_none() && c.get(5).is_some() && c.get(6).is_some());
        let mut tiny = NodeCache::new(10);
        tiny.insert(1, img(4));
        assert!(
            tiny.is_empty(),
            "an image larger than the cache is not cached"
        );
    }
}
