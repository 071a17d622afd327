//! One-sided reads of the tree: the descent through cached and remote inner
//! nodes, GET (key lines, then the value) and SCAN (whole leaves along
//! right links). docs/cell.md gives the invariants this relies on.

use crate::cache::NodeCache;
use dmkv_api::{KvError, Result};
use dmkv_transport::exec::yield_now;
use dmkv_transport::{Endpoint, RemoteRegion};
use dmkv_xtree::layout::{MAX_LEVEL, NO_NODE, SUPERBLOCK_ROOT_OFFSET};
use dmkv_xtree::view::{parse_block, parse_slot_line};
use dmkv_xtree::{ChildPtr, FatPtr, Geometry, KeysView, NodeView, RootWord, SlotValue, ViewError};
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// Attempts (retries after torn images or stale pointers) before an
/// operation gives up and reports the remote data as corrupt. Each retry
/// follows a writer that finished, so a healthy tree never comes close.
const MAX_ATTEMPTS: u32 = 100_000;

/// Counters of one compute process (all its threads).
pub struct ReaderStats {
    pub cache_hits: AtomicU64,
    pub cache_misses: AtomicU64,
    /// Retries from the root after an incarnation mismatch or a stale root.
    pub stale_retries: AtomicU64,
    /// Re-reads after a torn or locked image or a reused value block.
    pub torn_retries: AtomicU64,
    /// Descents started.
    pub traversals: AtomicU64,
    pub superblock_reads: AtomicU64,
    /// Remote node reads per level (leaf reads at 0).
    pub level_reads: [AtomicU64; MAX_LEVEL as usize + 1],
    /// Reads of inline-value lines and value blocks.
    pub value_reads: AtomicU64,
    /// Nodes the cache dropped to make room.
    pub cache_evictions: AtomicU64,
}

impl Default for ReaderStats {
    fn default() -> Self {
        ReaderStats {
            cache_hits: AtomicU64::new(0),
            cache_misses: AtomicU64::new(0),
            stale_retries: AtomicU64::new(0),
            torn_retries: AtomicU64::new(0),
            traversals: AtomicU64::new(0),
            superblock_reads: AtomicU64::new(0),
            level_reads: std::array::from_fn(|_| AtomicU64::new(0)),
            value_reads: AtomicU64::new(0),
            cache_evictions: AtomicU64::new(0),
        }
    }
}

/// What a compute process knows about the tree, shared by its threads.
pub struct TreeReader {
    pub geo: Geometry,
    pub nodes: RemoteRegion,
    pub values: RemoteRegion,
    /// Inner nodes at least this many levels above the leaves are cached.
    pub cached_levels: u8,
    pub cache: Mutex<NodeCache>,
    /// The root word last read from the superblock (0: none yet).
    root: AtomicU64,
    /// Counted into by every compute process of a simulated cluster
    /// (`ConnectArgs::counters_from`); the cache is this process's.
    pub stats: Arc<ReaderStats>,
}

/// What the pointer that led to a node says about it.
#[derive(Debug, Clone, Copy)]
enum Expect {
    /// Named by the root word: it must have no right sibling (a node that
    /// has been the root keeps lower bound 0 and gets a right link at its
    /// first split, so `NXT = 0` means it still covers every key).
    Root,
    /// Reached through a pointer in `parent` carrying `incarnation`.
    Child { parent: u32, incarnation: u32 },
}

/// A cached or fetched node did not match its pointer: retry from the root.
struct Stale;

fn bump(c: &AtomicU64) {
    c.fetch_add(1, Ordering::Relaxed);
}

fn corrupt(what: String) -> KvError {
    KvError::Corrupt(what)
}

impl TreeReader {
    pub fn new(
        geo: Geometry,
        nodes: RemoteRegion,
        values: RemoteRegion,
        cached_levels: u8,
        cache_bytes: usize,
        stats: Arc<ReaderStats>,
    ) -> TreeReader {
        TreeReader {
            geo,
            nodes,
            values,
            cached_levels,
            cache: Mutex::new(NodeCache::new(cache_bytes)),
            root: AtomicU64::new(0),
            stats,
        }
    }

    /// Bytes cached: node images, their bookkeeping and the root word.
    pub fn cache_bytes(&self) -> u64 {
        self.cache.lock().used_bytes() as u64 + 8
    }

    fn node_offset(&self, node: u32) -> Result<u64> {
        let nb = self.geo.node_bytes() as u64;
        let off = node as u64 * nb;
        if node == NO_NODE || off + nb > self.nodes.len {
            return Err(corrupt(format!(
                "pointer to node {node} outside the node region"
            )));
        }
        Ok(off)
    }

    async fn root(&self, ep: &Endpoint, refresh: bool) -> Result<RootWord> {
        if !refresh && let Some(r) = RootWord::unpack(self.root.load(Ordering::Relaxed)) {
            return Ok(r);
        }
        let b = ep
            .read_buf(self.nodes.at(SUPERBLOCK_ROOT_OFFSET), 8)
            .await?;
        bump(&self.stats.superblock_reads);
        let w = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
        let r = RootWord::unpack(w).ok_or_else(|| corrupt(format!("root word {w:#x}")))?;
        self.root.store(w, Ordering::Relaxed);
        Ok(r)
    }

    /// Reads a span of `node`, retrying torn and locked images.
    async fn read_span<T>(
        &self,
        ep: &Endpoint,
        node: u32,
        level: u8,
        span: dmkv_xtree::Span,
        parse: impl Fn(&[u8]) -> std::result::Result<T, ViewError>,
    ) -> Result<T> {
        let off = self.node_offset(node)? + span.offset() as u64;
        for _ in 0..MAX_ATTEMPTS {
            let bytes = ep.read_buf(self.nodes.at(off), span.len(&self.geo)).await?;
            bump(&self.stats.level_reads[level.min(MAX_LEVEL) as usize]);
            match parse(&bytes) {
                Ok(v) => return Ok(v),
                Err(e) if e.is_transient() => {
                    bump(&self.stats.torn_retries);
                    yield_now().await;
                }
                Err(e) => return Err(corrupt(format!("node {node}: {e}"))),
            }
        }
        Err(corrupt(format!("node {node} never read consistently")))
    }

    async fn read_node(&self, ep: &Endpoint, node: u32, level: u8) -> Result<NodeView> {
        let geo = self.geo;
        self.read_span(ep, node, level, geo.node_span(), |b| {
            NodeView::parse(&geo, b)
        })
        .await
    }

    fn matches(&self, h: dmkv_xtree::Header, level: u8, want_level: u8, expect: Expect) -> bool {
        level == want_level
            && match expect {
                Expect::Root => h.next == NO_NODE,
                Expect::Child { incarnation, .. } => h.incarnation == incarnation,
            }
    }

    /// Forgets the nodes involved in a mismatch: the node and the parent
    /// whose pointer led to it (either may be the stale one).
    fn forget(&self, node: u32, expect: Expect) {
        let mut c = self.cache.lock();
        c.remove(node);
        if let Expect::Child { parent, .. } = expect {
            c.remove(parent);
        }
        bump(&self.stats.stale_retries);
    }

    /// Where the search for `key` goes from the inner node `node` at
    /// `level`: from its cached image if its level is cached and it is in
    /// the cache, else from a read of the node (cached whole if its level is
    /// high enough, searched in place where it lies if not). `Stale` if the
    /// image does not match its pointer (invariants 1 and 2) or `key` is
    /// below its lower bound.
    async fn route(
        &self,
        ep: &Endpoint,
        node: u32,
        level: u8,
        expect: Expect,
        key: u64,
    ) -> Result<std::result::Result<ChildPtr, Stale>> {
        let found = if level >= self.cached_levels {
            // Looked up under the lock: a hit needs no reference count.
            let hit = self.cache.lock().with(node, |img| {
                self.matches(img.header(), img.level(), level, expect)
                    .then(|| img.child_for(key))
            });
            match hit {
                Some(routed) => {
                    bump(&self.stats.cache_hits);
                    routed
                }
                None => {
                    bump(&self.stats.cache_misses);
                    let img = self.read_node(ep, node, level).await?;
                    let ok = self.matches(img.header(), img.level(), level, expect);
                    let routed = ok.then(|| img.child_for(key));
                    if ok {
                        let evicted = self.cache.lock().insert(node, Arc::new(img));
                        if evicted > 0 {
                            self.stats
                                .cache_evictions
                                .fetch_add(evicted, Ordering::Relaxed);
                        }
                    }
                    routed
                }
            }
        } else {
            let geo = self.geo;
            let l = self
                .read_span(ep, node, level, geo.node_span(), |b| {
                    NodeView::child_in_image(&geo, b, key)
                })
                .await?;
            self.matches(l.header, l.level, level, expect)
                .then_some(l.child)
        };
        match found {
            Some(Some((_, child))) => Ok(Ok(child)),
            // A mismatch, or below the node's lower bound (the image is not
            // current): forget it and its parent.
            Some(None) | None => {
                self.forget(node, expect);
                Ok(Err(Stale))
            }
        }
    }

    /// Descends to the leaf whose range holds `key`.
    async fn descend(
        &self,
        ep: &Endpoint,
        key: u64,
        refresh_root: bool,
    ) -> Result<std::result::Result<(u32, Expect), Stale>> {
        bump(&self.stats.traversals);
        let root = self.root(ep, refresh_root).await?;
        let mut node = root.node;
        let mut level = root.root_level();
        let mut expect = Expect::Root;
        while level > 0 {
            let child = match self.route(ep, node, level, expect, key).await? {
                Ok(c) => c,
                Err(stale) => return Ok(Err(stale)),
            };
            expect = Expect::Child {
                parent: node,
                incarnation: child.incarnation,
            };
            node = child.node;
            level -= 1;
        }
        Ok(Ok((node, expect)))
    }

    /// GET: descend, read the leaf's key lines, then the value.
    pub async fn get(&self, ep: &Endpoint, key: u64) -> Result<Option<Vec<u8>>> {
        let geo = self.geo;
        let mut refresh = false;
        for _ in 0..MAX_ATTEMPTS {
            let (leaf, expect) = match self.descend(ep, key, refresh).await? {
                Ok(t) => t,
                Err(Stale) => {
                    refresh = true;
                    continue;
                }
            };
            // The keys are searched where they lie in the read, not
            // collected (same checks as `KeysView::parse`).
            let keys = self
                .read_span(ep, leaf, 0, geo.key_span(), |b| {
                    KeysView::find_in_image(&geo, geo.key_span(), b, key)
                })
                .await?;
            if !self.matches(keys.header, keys.meta.level, 0, expect) {
                self.forget(leaf, expect);
                refresh = true;
                continue;
            }
            let Some(j) = keys.slot else {
                return Ok(None);
            };
            let span = geo.slot_span(j);
            let off = self.node_offset(leaf)? + span.offset() as u64;
            let line = ep.read_buf(self.nodes.at(off), span.len(&geo)).await?;
            bump(&self.stats.value_reads);
            let word = match parse_slot_line(&geo, j, keys.version, &line) {
                Ok(w) => w,
                Err(e) if e.is_transient() => {
                    // The leaf changed since its keys were read.
                    bump(&self.stats.torn_retries);
                    refresh = false;
                    continue;
                }
                Err(e) => return Err(corrupt(format!("leaf {leaf}: {e}"))),
            };
            match SlotValue::decode(&keys.meta, j, word) {
                SlotValue::Inline(b) => return Ok(Some(b.to_vec())),
                SlotValue::OutOfLine(f) => {
                    if let Some(v) = self.read_block(ep, key, f).await? {
                        return Ok(Some(v));
                    }
                    bump(&self.stats.torn_retries);
                }
            }
            refresh = false;
        }
        Err(corrupt(format!("get {key:#x} never settled")))
    }

    fn check_fat(&self, f: FatPtr) -> Result<()> {
        if f.offset + f.block_len() as u64 > self.values.len {
            return Err(corrupt(format!(
                "fat pointer {f:?} outside the value region"
            )));
        }
        Ok(())
    }

    /// The value in block `f`, or `None` if the block no longer holds it
    /// (freed and reused since the leaf was read).
    async fn read_block(&self, ep: &Endpoint, key: u64, f: FatPtr) -> Result<Option<Vec<u8>>> {
        self.check_fat(f)?;
        let b = ep.read_buf(self.values.at(f.offset), f.block_len()).await?;
        bump(&self.stats.value_reads);
        Ok(parse_block(key, f, &b).ok())
    }

    /// Up to `limit` pairs of a whole-leaf image with key >= `start`, in
    /// key order, with out-of-line values fetched in one batch; `None` if a
    /// block was reused meanwhile (the caller re-reads the leaf).
    async fn leaf_pairs(
        &self,
        ep: &Endpoint,
        img: &NodeView,
        start: u64,
        limit: usize,
    ) -> Result<Option<Vec<(u64, Vec<u8>)>>> {
        let pairs: Vec<(u64, SlotValue)> = img
            .sorted_pairs()
            .into_iter()
            .filter(|p| p.0 >= start)
            .take(limit)
            .collect();
        let mut batch = ep.batch();
        let mut blocks = Vec::new();
        for (k, v) in &pairs {
            if let SlotValue::OutOfLine(f) = v {
                self.check_fat(*f)?;
                blocks.push((batch.read(self.values.at(f.offset), f.block_len()), *k, *f));
            }
        }
        let mut fetched = std::collections::HashMap::new();
        if !batch.is_empty() {
            let res = batch.run().await?;
            bump(&self.stats.value_reads);
            for (i, k, f) in blocks {
                match parse_block(k, f, res.read(i)) {
                    Ok(v) => {
                        fetched.insert(k, v);
                    }
                    Err(_) => return Ok(None),
                }
            }
        }
        Ok(Some(
            pairs
                .into_iter()
                .map(|(k, v)| match v {
                    SlotValue::Inline(b) => (k, b.to_vec()),
                    SlotValue::OutOfLine(_) => (k, fetched.remove(&k).expect("fetched above")),
                })
                .collect(),
        ))
    }

    /// SCAN: descend to the leaf holding `start`, then read whole leaves
    /// along right links. A leaf reached by a right link needs no
    /// incarnation check: lower bounds never change, so it starts where the
    /// image that linked it ended.
    pub async fn scan(&self, ep: &Endpoint, start: u64, n: usize) -> Result<Vec<(u64, Vec<u8>)>> {
        let mut refresh = false;
        let mut attempts = 0;
        let (mut out, mut next) = loop {
            attempts += 1;
            if attempts > MAX_ATTEMPTS {
                return Err(corrupt(format!("scan from {start:#x} never settled")));
            }
            let (leaf, expect) = match self.descend(ep, start, refresh).await? {
                Ok(t) => t,
                Err(Stale) => {
                    refresh = true;
                    continue;
                }
            };
            let img = self.read_node(ep, leaf, 0).await?;
            if !self.matches(img.header(), img.level(), 0, expect) {
                self.forget(leaf, expect);
                refresh = true;
                continue;
            }
            refresh = false;
            match self.leaf_pairs(ep, &img, start, n).await? {
                Some(p) => break (p, img.header().next),
                None => bump(&self.stats.torn_retries),
            }
        };
        while out.len() < n && next != NO_NODE {
            let mut tries = 0;
            loop {
                tries += 1;
                if tries > MAX_ATTEMPTS {
                    return Err(corrupt(format!("leaf {next} never settled")));
                }
                let img = self.read_node(ep, next, 0).await?;
                if img.level() != 0 {
                    return Err(corrupt(format!("right link to inner node {next}")));
                }
                match self.leaf_pairs(ep, &img, start, n - out.len()).await? {
                    Some(p) => {
                        out.extend(p);
                        next = img.header().next;
                        break;
                    }
                    None => bump(&self.stats.torn_retries),
                }
            }
        }
        Ok(out)
    }

    /// Counters for `engine_stats`.
    pub fn stats_json(&self) -> serde_json::Value {
        let s = &self.stats;
        let get = |c: &AtomicU64| c.load(Ordering::Relaxed);
        let traversals = get(&s.traversals).max(1) as f64;
        let mut per_level = serde_json::Map::new();
        for (level, c) in s.level_reads.iter().enumerate() {
            let reads = get(c);
            if reads > 0 {
                per_level.insert(
                    format!("level_{level}"),
                    serde_json::json!(reads as f64 / traversals),
                );
            }
        }
        let cache = self.cache.lock();
        serde_json::json!({
            "cached_levels": self.cached_levels,
            "cache_hits": get(&s.cache_hits),
            "cache_misses": get(&s.cache_misses),
            "cache_entries": cache.len(),
            "cache_bytes": cache.used_bytes(),
            "cache_evictions": get(&s.cache_evictions),
            "stale_retries": get(&s.stale_retries),
            "torn_retries": get(&s.torn_retries),
            "traversals": get(&s.traversals),
            "superblock_reads": get(&s.superblock_reads),
            "value_reads": get(&s.value_reads),
            "round_trips_per_traversal_level": per_level,
        })
    }
}
