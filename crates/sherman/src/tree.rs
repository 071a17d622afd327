//! The tree operations, all by one-sided verbs from the compute side.
//!
//! - Reads (get, scan, traversal) are optimistic: one READ of a whole node,
//!   accepted only if the node's checksum matches (invariant 1), retried
//!   otherwise. They never lock.
//! - Writes lock the leaf (HOCL: local lock, then a CAS on the global lock
//!   word posted in one batch with the READ of the node), change the image,
//!   and post the changed bytes and the unlock in one batch (invariant 2).
//! - A full leaf splits: the upper half moves to a new right sibling written
//!   in the same ordered batch before the old node links it (invariant 3);
//!   the separator then goes into the parent, which is locked only after the
//!   leaf is released. A root split installs a new root by CAS on the root
//!   word (invariant 4).

use crate::alloc::{ChunkFetch, ChunkSource, LocalAlloc, WaitForFetch};
use crate::cache::IndexCache;
use crate::layout::{
    EMPTY_KEY, FatPtr, GAddr, LEAF_HEADER_WRITE, NodeImage, ValueRef, block_bytes, decode_block,
    encode_block,
};
use crate::lock::{LocalGuard, LocalLocks, lock_index};
use dmkv_api::{Key, KvError, Result};
use dmkv_memnode::RemoteSegments;
use dmkv_transport::exec::yield_now;
use dmkv_transport::{Endpoint, RemoteRegion};
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};

/// Offset of the root word in memory node 0's pool.
pub const ROOT_WORD: u64 = 0;
/// Bytes at the start of every pool kept out of allocation (superblock).
pub const POOL_RESERVED: u64 = 4096;
/// Optimistic reads give up after this many failed validations in a row.
const MAX_VALIDATION_RETRIES: u32 = 100_000;

/// Counters of one compute process.
#[derive(Default)]
pub struct TreeStats {
    pub splits: AtomicU64,
    pub nodes_created: AtomicU64,
    pub lock_retries: AtomicU64,
    pub handovers: AtomicU64,
    pub torn_retries: AtomicU64,
    pub value_retries: AtomicU64,
    pub move_rights: AtomicU64,
    pub root_grows: AtomicU64,
    /// Root installs that lost their CAS to another client's and linked
    /// into the winner's root instead (the race behind the original
    /// Sherman's small-tree root bug).
    pub root_races: AtomicU64,
    /// Descents that started at the root hint, found the key outside that
    /// node (the root had grown since) and read the root word again.
    pub root_refreshes: AtomicU64,
    pub chunks: AtomicU64,
}

/// What every client of a compute process shares.
pub struct TreeShared {
    pub node_bytes: usize,
    /// Each memory node's pool segments.
    pub pools: Vec<RemoteSegments>,
    pub lock_tables: Vec<RemoteRegion>,
    pub chunks: Vec<ChunkSource>,
    pub local_locks: LocalLocks,
    pub cache: IndexCache,
    /// The root's address as this compute process last saw it (0: not
    /// read yet): where a descent that misses the cache starts, as the
    /// artifact's `g_root_ptr` (which a new root's broadcast updates; here
    /// a descent that finds the key outside the hinted node reads the root
    /// word again).
    pub root_hint: std::sync::atomic::AtomicU64,
    /// Nonzero tag this process writes into global lock words.
    pub lock_tag: u64,
    /// Whether a writer posts the lock's CAS and the node's READ in one
    /// batch (`lock_read=combined`) or reads only once the CAS succeeded.
    pub combined_lock_read: bool,
    /// Roots this process installed: where its next root goes (memory node
    /// `(roots_grown + 1) % nodes`). Its own, unlike `stats.root_grows`.
    pub roots_grown: std::sync::atomic::AtomicU64,
    /// Counted into by every compute process of a simulated cluster
    /// (`ConnectArgs::counters_from`).
    pub stats: Arc<TreeStats>,
}

/// One write operation.
#[derive(Debug, Clone, Copy)]
pub enum WriteOp<'v> {
    Insert(&'v [u8]),
    Update(&'v [u8]),
    Upsert(&'v [u8]),
    Delete,
}

/// Bytes to write at a global address.
type Write = (GAddr, Vec<u8>);

/// An operation's view: the shared state, this thread's endpoint and
/// allocators.
pub struct Ctx<'a> {
    pub t: &'a TreeShared,
    pub ep: &'a Endpoint,
    pub alloc: &'a RefCell<Vec<LocalAlloc>>,
    /// The memory node this client's split siblings go to
    /// ([`Ctx::alloc_spread_node`]); taken modulo the memory nodes.
    pub spread: &'a AtomicUsize,
}

impl Ctx<'_> {
    /// Where `a` is; the first use of a pool segment looks it up by name.
    async fn pool_at(&self, a: GAddr) -> Result<dmkv_transport::RemoteAddr> {
        let pool = self.t.pools.get(a.mn()).ok_or_else(|| {
            KvError::Corrupt(format!("address {a:?} names an unknown memory node"))
        })?;
        if let Some(at) = pool.known_at(a.offset()) {
            return Ok(at);
        }
        Ok(pool.at(self.ep, a.offset()).await?)
    }

    fn lock_at(&self, a: GAddr) -> dmkv_transport::RemoteAddr {
        self.t.lock_tables[a.mn()].at(lock_index(a.offset()) * 8)
    }

    /// Reads the root word (and keeps it as the root hint).
    pub async fn root(&self) -> Result<GAddr> {
        let w = self
            .ep
            .read(self.t.pools[0].first().at(ROOT_WORD), 8)
            .await?;
        let root = GAddr(u64::from_le_bytes(w.try_into().expect("8 bytes")));
        self.t.root_hint.store(root.0, Ordering::Relaxed);
        Ok(root)
    }

    /// Where a descent starts: the root hint, or the root word if there is
    /// none yet. A stale hint (the root grew) names the old root, a node
    /// that still exists and whose range starts at 0: a descent from it
    /// either covers the key, or reads the root word again ([`Self::locate`]).
    async fn start(&self) -> Result<(GAddr, bool)> {
        match self.t.root_hint.load(Ordering::Relaxed) {
            0 => Ok((self.root().await?, false)),
            hint => Ok((GAddr(hint), true)),
        }
    }

    /// Reads the node at `a` until its checksum validates.
    pub async fn read_node(&self, a: GAddr) -> Result<NodeImage> {
        let at = self.pool_at(a).await?;
        for _ in 0..MAX_VALIDATION_RETRIES {
            let bytes = self.ep.read(at, self.t.node_bytes).await?;
            if let Some(n) = NodeImage::validated(bytes, self.t.node_bytes) {
                return Ok(n);
            }
            self.t.stats.torn_retries.fetch_add(1, Ordering::Relaxed);
            yield_now().await;
        }
        Err(KvError::Corrupt(format!(
            "node {a:?} failed validation {MAX_VALIDATION_RETRIES} times"
        )))
    }

    /// The node at `level` whose range holds `key`, with a validated image,
    /// or `None` if the tree is not that tall. A leaf (`level` 0) starts
    /// from its parent in the cache if it is there; anything else from the
    /// root (the hint, [`Self::start`]).
    pub async fn locate(&self, key: Key, level: u8) -> Result<Option<(GAddr, NodeImage)>> {
        let hit = if level == 0 {
            self.t.cache.lookup(key)
        } else {
            None
        };
        let (mut addr, mut from_hint) = match hit {
            Some(h) => (h.child, false),
            None => self.start().await?,
        };
        let mut via_cache = hit;
        let mut restarts = 0u32;
        loop {
            let n = self.read_node(addr).await?;
            if !n.covers(key) {
                if let Some(h) = via_cache.take() {
                    // The cached parent is stale: its child split.
                    self.t.cache.invalidate(h.low, h.node);
                }
                if std::mem::take(&mut from_hint) {
                    // The hinted root is an old root that split since.
                    self.t.stats.root_refreshes.fetch_add(1, Ordering::Relaxed);
                    addr = self.root().await?;
                    continue;
                }
                if key >= n.high() && !n.sibling().is_null() {
                    self.t.stats.move_rights.fetch_add(1, Ordering::Relaxed);
                    addr = n.sibling();
                    continue;
                }
                restarts += 1;
                if restarts > MAX_VALIDATION_RETRIES {
                    return Err(KvError::Corrupt(format!("no node covers key {key:#x}")));
                }
                addr = self.root().await?;
                continue;
            }
            via_cache = None;
            from_hint = false;
            // Every level-1 node a search reads is cached, the one it ends
            // at too (a writer's `locate_addr` ends at the leaf's parent),
            // as the artifact's `page_search` adds each level-1 page it
            // reads, for reads and writes alike. Until the thirty-fourth
            // session only nodes passed on the way down were cached, so a
            // compute process that only wrote never filled its cache: it
            // showed once each simulated compute node had its own.
            self.t.cache.insert(addr, &n);
            if n.level() == level {
                return Ok(Some((addr, n)));
            }
            if n.level() < level {
                // From a stale root hint this may be an old root below a
                // taller tree; both callers cope: `locate_addr` then
                // locates the leaf itself (the old root covers the key, so
                // it finds the right node), and `insert_into_parent` reads
                // the root word before it tries again.
                return Ok(None);
            }
            addr = n.inner_child(key).ok_or_else(|| {
                KvError::Corrupt(format!("inner node {addr:?} has no child for {key:#x}"))
            })?;
        }
    }

    /// The address of the node at `level` that should hold `key`, without
    /// reading that node (writers lock and read it next, and move right if
    /// it has split): a leaf's from its cached parent at no cost, else by
    /// traversal.
    pub async fn locate_addr(&self, key: Key, level: u8) -> Result<GAddr> {
        if level == 0
            && let Some(h) = self.t.cache.lookup(key)
        {
            return Ok(h.child);
        }
        if let Some((a, n)) = self.locate(key, level + 1).await? {
            return n.inner_child(key).ok_or_else(|| {
                KvError::Corrupt(format!("inner node {a:?} has no child for {key:#x}"))
            });
        }
        match self.locate(key, level).await? {
            Some((a, _)) => Ok(a),
            None => Err(KvError::Corrupt(format!("the tree has no level {level}"))),
        }
    }

    /// Takes the lock of the node at `a` and reads it: local lock, then CAS
    /// on the global word (retried while another process holds it) and a
    /// READ of the node, after the CAS succeeded or, with
    /// `lock_read=combined`, in the same batch.
    async fn lock_and_read(&self, a: GAddr) -> Result<(LocalGuard, NodeImage)> {
        let g = self
            .t
            .local_locks
            .acquire(a.mn(), lock_index(a.offset()))
            .await;
        match self.lock_and_read_global(a, g).await {
            Ok(n) => Ok((g, n)),
            Err(e) => {
                self.t.local_locks.release(g);
                Err(e)
            }
        }
    }

    async fn lock_and_read_global(&self, a: GAddr, g: LocalGuard) -> Result<NodeImage> {
        if g.has_global {
            self.t.stats.handovers.fetch_add(1, Ordering::Relaxed);
            return self.read_node(a).await;
        }
        if !self.t.combined_lock_read {
            // Sherman's released code (`Tree::lock_and_read_page`: a
            // synchronous `try_lock_addr`, retried, then `read_sync`): the
            // READ is posted only once the CAS has taken the lock.
            loop {
                if self.ep.cas(self.lock_at(a), 0, self.t.lock_tag).await? == 0 {
                    return self.read_holding_global(a).await;
                }
                self.t.stats.lock_retries.fetch_add(1, Ordering::Relaxed);
                yield_now().await;
            }
        }
        let node_at = self.pool_at(a).await?;
        loop {
            let mut b = self.ep.batch();
            let c = b.cas(self.lock_at(a), 0, self.t.lock_tag);
            let r = b.read(node_at, self.t.node_bytes);
            let mut res = b.run().await?;
            if res.word(c) == 0 {
                // Under the lock nobody writes, but torn-read injection can
                // still split the read: validate, re-read if needed.
                return match NodeImage::validated(res.take_read(r), self.t.node_bytes) {
                    Some(n) => Ok(n),
                    None => {
                        self.t.stats.torn_retries.fetch_add(1, Ordering::Relaxed);
                        self.read_holding_global(a).await
                    }
                };
            }
            self.t.stats.lock_retries.fetch_add(1, Ordering::Relaxed);
            yield_now().await;
        }
    }

    /// Reads the node at `a` while this process holds its global lock (its
    /// CAS just succeeded). If the read fails, the lock word is cleared
    /// (best effort: the memory node may be the one that failed) before the
    /// error is returned, so that a later writer of the node is not left
    /// spinning on a lock nobody will release; the caller then releases the
    /// local lock without a handover.
    async fn read_holding_global(&self, a: GAddr) -> Result<NodeImage> {
        let read = self.read_node(a).await;
        if read.is_err() {
            let _ = self.ep.write(self.lock_at(a), &0u64.to_le_bytes()).await;
        }
        read
    }

    /// Posts `writes` and then (unless the lock is handed over locally) the
    /// unlock of `a`, all in one batch: same memory node, so in order.
    async fn write_and_unlock(&self, a: GAddr, g: LocalGuard, writes: Vec<Write>) -> Result<()> {
        let hand = self.t.local_locks.hand_over(g);
        let mut b = self.ep.batch();
        let mut res = Ok(());
        for (at, data) in writes {
            debug_assert_eq!(at.mn(), a.mn(), "a write batch stays on one memory node");
            match self.pool_at(at).await {
                Ok(addr) => {
                    b.write(addr, data);
                }
                Err(e) => res = Err(e),
            }
        }
        if !hand {
            b.write(self.lock_at(a), 0u64.to_le_bytes().to_vec());
        }
        let ran = b.run().await;
        if ran.is_err() {
            self.t.local_locks.forget_global(g);
        }
        self.t.local_locks.release(g);
        ran?;
        res
    }

    /// Gets a new chunk on `mn` for this client, or waits, parked, while
    /// another of its tasks gets one (a polling wait would keep this
    /// thread's core busy for the whole round trip); the caller then looks
    /// for a node or block again.
    async fn fetch_chunk(&self, mn: usize) -> Result<()> {
        if !self.alloc.borrow_mut()[mn].claim_fetch() {
            WaitForFetch {
                allocs: self.alloc,
                mn,
            }
            .await;
            return Ok(());
        }
        let held = ChunkFetch::new(self.alloc, mn);
        let src = self.t.chunks[mn];
        let got = src.fetch(self.ep).await;
        if let Ok(offset) = got {
            self.alloc.borrow_mut()[mn].add_chunk(offset, src.chunk);
            self.t.stats.chunks.fetch_add(1, Ordering::Relaxed);
        }
        drop(held);
        got.map(|_| ())
    }

    /// A new node on memory node `mn`.
    pub async fn alloc_node(&self, mn: usize) -> Result<GAddr> {
        loop {
            if let Some(off) = self.alloc.borrow_mut()[mn].node(self.t.node_bytes as u64) {
                self.t.stats.nodes_created.fetch_add(1, Ordering::Relaxed);
                return Ok(GAddr::new(mn, off));
            }
            self.fetch_chunk(mn).await?;
        }
    }

    /// A new node for a split's right sibling: on the memory node this
    /// client's siblings currently go to, which moves on round-robin each
    /// time its chunk there runs out. This is the artifact's `DSM::alloc`
    /// (a thread takes each new chunk from `next_target_node`, then advances
    /// it), so a tree grown by splits spreads over the memory nodes. Before
    /// the twenty-eighth session a sibling went to its left node's memory
    /// node, so a tree loaded in ascending key order (the harness's load
    /// after its first call) and every leaf split off from it stayed on one
    /// memory node, whose NIC then served every operation (invariant 2).
    pub async fn alloc_spread_node(&self) -> Result<GAddr> {
        let mns = self.t.pools.len();
        let mn = self.spread.load(Ordering::Relaxed) % mns;
        if let Some(off) = self.alloc.borrow_mut()[mn].node(self.t.node_bytes as u64) {
            self.t.stats.nodes_created.fetch_add(1, Ordering::Relaxed);
            return Ok(GAddr::new(mn, off));
        }
        let next = (mn + 1) % mns;
        self.spread.store(next, Ordering::Relaxed);
        self.alloc_node(next).await
    }

    /// Makes a split's new sibling `right` complete before the batch of the
    /// node `a` being split (locked as `g`) links it (invariant 3): on
    /// `a`'s memory node it joins `writes`, which must then get `a`'s image
    /// after it; on another one it is written alone and acknowledged first
    /// (the artifact's `write_sync` of the sibling before its
    /// `write_page_and_unlock`), and on an error `a` is unlocked unchanged.
    async fn stage_sibling(
        &self,
        a: GAddr,
        g: LocalGuard,
        right: GAddr,
        bytes: &[u8],
        writes: &mut Vec<Write>,
    ) -> Result<()> {
        if right.mn() == a.mn() {
            writes.push((right, bytes.to_vec()));
            return Ok(());
        }
        let written = match self.pool_at(right).await {
            Ok(at) => self.ep.write(at, bytes).await.map_err(KvError::from),
            Err(e) => Err(e),
        };
        if let Err(e) = written {
            self.write_and_unlock(a, g, Vec::new()).await?;
            return Err(e);
        }
        Ok(())
    }

    /// The value word for `value` and, for an out-of-line value, the block
    /// to write first (on memory node `mn`).
    async fn make_value(
        &self,
        mn: usize,
        key: Key,
        value: &[u8],
    ) -> Result<(ValueRef, Option<Write>)> {
        if value.len() == 8 {
            return Ok((
                ValueRef::Inline(u64::from_le_bytes(value.try_into().expect("8 bytes"))),
                None,
            ));
        }
        loop {
            let got = self.alloc.borrow_mut()[mn].block(value.len());
            if let Some((off, tag)) = got {
                let p = FatPtr::new(mn, off, value.len(), tag);
                return Ok((
                    ValueRef::OutOfLine(p),
                    Some((GAddr::new(mn, off), encode_block(key, tag, value))),
                ));
            }
            self.fetch_chunk(mn).await?;
        }
    }

    fn free_value(&self, v: ValueRef) {
        if let ValueRef::OutOfLine(p) = v {
            self.alloc.borrow_mut()[p.mn()].free_block(p.offset(), p.len(), p.tag());
        }
    }

    /// Reads out-of-line values of `entries` in one batch; `None` if some
    /// block no longer is what the leaf said (the leaf changed: re-read).
    async fn resolve(&self, entries: &[(Key, ValueRef)]) -> Result<Option<Vec<Vec<u8>>>> {
        let mut b = self.ep.batch();
        let mut idx = Vec::with_capacity(entries.len());
        for (_, v) in entries {
            idx.push(match v {
                ValueRef::Inline(_) => None,
                ValueRef::OutOfLine(p) => {
                    let at = self.pool_at(GAddr::new(p.mn(), p.offset())).await?;
                    Some(b.read(at, block_bytes(p.len())))
                }
            });
        }
        let mut res = b.run().await?;
        let mut out = Vec::with_capacity(entries.len());
        for ((k, v), i) in entries.iter().zip(idx) {
            match (v, i) {
                (ValueRef::Inline(w), _) => out.push(w.to_le_bytes().to_vec()),
                (ValueRef::OutOfLine(p), Some(i)) => {
                    match decode_block(&res.take_read(i), *k, *p) {
                        Some(v) => out.push(v),
                        None => {
                            self.t.stats.value_retries.fetch_add(1, Ordering::Relaxed);
                            return Ok(None);
                        }
                    }
                }
                (ValueRef::OutOfLine(_), None) => unreachable!("every out-of-line value was read"),
            }
        }
        Ok(Some(out))
    }

    pub async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let (mut addr, mut leaf) = self.leaf_for(key).await?;
        for _ in 0..MAX_VALIDATION_RETRIES {
            let Some(i) = leaf.leaf_find(key) else {
                return Ok(None);
            };
            let value = leaf.leaf_value(i);
            if let ValueRef::Inline(w) = value {
                // What `resolve` returns for an inline value, without its
                // (empty) batch and lists.
                return Ok(Some(w.to_le_bytes().to_vec()));
            }
            if let Some(mut v) = self.resolve(&[(key, value)]).await? {
                return Ok(v.pop());
            }
            (addr, leaf) = self.refresh_leaf(addr, key).await?;
        }
        Err(KvError::Corrupt(format!(
            "value of key {key:#x} never validated"
        )))
    }

    async fn leaf_for(&self, key: Key) -> Result<(GAddr, NodeImage)> {
        self.locate(key, 0)
            .await?
            .ok_or_else(|| KvError::Corrupt("the tree has no leaf level".into()))
    }

    /// Re-reads the leaf for `key` starting at `addr`, moving right.
    async fn refresh_leaf(&self, mut addr: GAddr, key: Key) -> Result<(GAddr, NodeImage)> {
        loop {
            let n = self.read_node(addr).await?;
            if n.covers(key) && n.is_leaf() {
                return Ok((addr, n));
            }
            if n.is_leaf() && key >= n.high() && !n.sibling().is_null() {
                addr = n.sibling();
                continue;
            }
            return self.leaf_for(key).await;
        }
    }

    /// Applies `op` to `key`; returns whether the key existed before.
    pub async fn modify(&self, key: Key, op: WriteOp<'_>) -> Result<bool> {
        let mut addr = self.locate_addr(key, 0).await?;
        loop {
            let (g, leaf) = self.lock_and_read(addr).await?;
            if !leaf.is_leaf() || !leaf.covers(key) {
                self.write_and_unlock(addr, g, Vec::new()).await?;
                if leaf.is_leaf() && key >= leaf.high() && !leaf.sibling().is_null() {
                    self.t.stats.move_rights.fetch_add(1, Ordering::Relaxed);
                    addr = leaf.sibling();
                } else {
                    addr = self.locate_addr(key, 0).await?;
                }
                continue;
            }
            let slot = leaf.leaf_find(key);
            let value = match (op, slot) {
                (WriteOp::Insert(_), Some(_)) | (WriteOp::Update(_) | WriteOp::Delete, None) => {
                    self.write_and_unlock(addr, g, Vec::new()).await?;
                    return Ok(slot.is_some());
                }
                (WriteOp::Delete, Some(_)) => None,
                (WriteOp::Insert(v) | WriteOp::Update(v) | WriteOp::Upsert(v), _) => Some(v),
            };
            let result = self.apply(addr, g, leaf, key, slot, value).await;
            return result.map(|()| slot.is_some());
        }
    }

    /// Writes the change under the lock `g` of leaf `addr` (image `leaf`):
    /// `value` None deletes entry `slot`.
    async fn apply(
        &self,
        addr: GAddr,
        g: LocalGuard,
        leaf: NodeImage,
        key: Key,
        slot: Option<usize>,
        value: Option<&[u8]>,
    ) -> Result<()> {
        let mut writes = Vec::new();
        let vref = match value {
            Some(v) => match self.make_value(addr.mn(), key, v).await {
                Ok((r, block)) => {
                    writes.extend(block);
                    Some(r)
                }
                Err(e) => {
                    self.write_and_unlock(addr, g, Vec::new()).await?;
                    return Err(e);
                }
            },
            None => None,
        };
        let old = slot.map(|i| leaf.leaf_value(i));
        let target = slot.or_else(|| leaf.leaf_free());
        let Some(i) = target else {
            let vref = vref.expect("only inserts need a free entry");
            return self.split_leaf(addr, g, leaf, key, vref, writes).await;
        };
        let mut new = leaf;
        match vref {
            Some(r) => new.set_leaf_entry(i, key, r),
            None => new.set_leaf_entry(i, EMPTY_KEY, ValueRef::Inline(0)),
        }
        new.seal();
        // Sherman's one-entry write: the header words (checksum .. bitmap)
        // and the entry, not the whole node.
        writes.push((addr, new.bytes()[..LEAF_HEADER_WRITE].to_vec()));
        let r = new.entry_range(i);
        writes.push((
            GAddr::new(addr.mn(), addr.offset() + r.start as u64),
            new.bytes()[r].to_vec(),
        ));
        self.write_and_unlock(addr, g, writes).await?;
        if let Some(old) = old {
            self.free_value(old);
        }
        Ok(())
    }

    async fn split_leaf(
        &self,
        addr: GAddr,
        g: LocalGuard,
        leaf: NodeImage,
        key: Key,
        vref: ValueRef,
        mut writes: Vec<Write>,
    ) -> Result<()> {
        let right_addr = match self.alloc_spread_node().await {
            Ok(a) => a,
            Err(e) => {
                self.write_and_unlock(addr, g, Vec::new()).await?;
                return Err(e);
            }
        };
        let mut entries = leaf.leaf_sorted();
        let at = entries.partition_point(|e| e.0 < key);
        entries.insert(at, (key, vref));
        let mid_idx = entries.len() / 2;
        let mid = entries[mid_idx].0;
        let nb = self.t.node_bytes;
        let mut right = NodeImage::new(nb, 0, mid, leaf.high(), leaf.sibling());
        for (i, (k, v)) in entries[mid_idx..].iter().enumerate() {
            right.set_leaf_entry(i, *k, *v);
        }
        right.seal();
        let mut left = NodeImage::new(nb, 0, leaf.low(), mid, right_addr);
        for (i, (k, v)) in entries[..mid_idx].iter().enumerate() {
            left.set_leaf_entry(i, *k, *v);
        }
        left.seal();
        // The new sibling is complete before the old node links it
        // (invariant 3): on the same memory node in the same batch, posted
        // first; on another one written alone before the batch.
        self.stage_sibling(addr, g, right_addr, right.bytes(), &mut writes)
            .await?;
        writes.push((addr, left.bytes().to_vec()));
        self.write_and_unlock(addr, g, writes).await?;
        self.t.stats.splits.fetch_add(1, Ordering::Relaxed);
        self.insert_into_parent(1, mid, right_addr, addr).await
    }

    /// Links `child` (whose range starts at `sep`, split off `left`) into
    /// the level-`level` node covering `sep`, splitting upwards as needed.
    async fn insert_into_parent(
        &self,
        mut level: u8,
        mut sep: Key,
        mut child: GAddr,
        mut left: GAddr,
    ) -> Result<()> {
        loop {
            let root = self.root().await?;
            let root_node = self.read_node(root).await?;
            if root_node.level() < level {
                if root == left {
                    self.grow_root(level, sep, child, left).await?;
                    return Ok(());
                }
                // Another client is installing the new root above `left`.
                yield_now().await;
                continue;
            }
            let Some((mut paddr, _)) = self.locate(sep, level).await? else {
                yield_now().await;
                continue;
            };
            loop {
                let (g, p) = self.lock_and_read(paddr).await?;
                if p.level() != level || !p.covers(sep) {
                    self.write_and_unlock(paddr, g, Vec::new()).await?;
                    if p.level() == level && sep >= p.high() && !p.sibling().is_null() {
                        paddr = p.sibling();
                        continue;
                    }
                    paddr = match self.locate(sep, level).await? {
                        Some((a, _)) => a,
                        None => return Err(KvError::Corrupt(format!("level {level} vanished"))),
                    };
                    continue;
                }
                let mut entries = p.inner_entries();
                let at = entries.partition_point(|e| e.0 < sep);
                if entries.get(at).is_some_and(|e| e.0 == sep) {
                    // Already linked (cannot happen: one splitter per split).
                    self.write_and_unlock(paddr, g, Vec::new()).await?;
                    return Err(KvError::Corrupt(format!("separator {sep:#x} linked twice")));
                }
                entries.insert(at, (sep, child));
                let nb = self.t.node_bytes;
                if entries.len() <= p.capacity() {
                    let mut n = NodeImage::new(nb, level, p.low(), p.high(), p.sibling());
                    n.set_inner_entries(&entries);
                    n.seal();
                    self.write_and_unlock(paddr, g, vec![(paddr, n.bytes().to_vec())])
                        .await?;
                    self.t.cache.insert(paddr, &n);
                    return Ok(());
                }
                let right_addr = match self.alloc_spread_node().await {
                    Ok(a) => a,
                    Err(e) => {
                        self.write_and_unlock(paddr, g, Vec::new()).await?;
                        return Err(e);
                    }
                };
                let mid_idx = entries.len() / 2;
                let mid = entries[mid_idx].0;
                let mut right = NodeImage::new(nb, level, mid, p.high(), p.sibling());
                right.set_inner_entries(&entries[mid_idx..]);
                right.seal();
                let mut l = NodeImage::new(nb, level, p.low(), mid, right_addr);
                l.set_inner_entries(&entries[..mid_idx]);
                l.seal();
                let mut writes = Vec::with_capacity(2);
                self.stage_sibling(paddr, g, right_addr, right.bytes(), &mut writes)
                    .await?;
                writes.push((paddr, l.bytes().to_vec()));
                self.write_and_unlock(paddr, g, writes).await?;
                self.t.stats.splits.fetch_add(1, Ordering::Relaxed);
                self.t.cache.insert(paddr, &l);
                self.t.cache.insert(right_addr, &right);
                (level, sep, child, left) = (level + 1, mid, right_addr, paddr);
                break;
            }
        }
    }

    /// Installs a new root above the old root `left` and its new sibling.
    async fn grow_root(&self, level: u8, sep: Key, child: GAddr, left: GAddr) -> Result<()> {
        let mn = (self.t.roots_grown.load(Ordering::Relaxed) as usize + 1) % self.t.pools.len();
        let raddr = self.alloc_node(mn).await?;
        let mut r = NodeImage::new(self.t.node_bytes, level, 0, EMPTY_KEY, GAddr::NULL);
        // The old root covered everything, so its low fence is 0.
        r.set_inner_entries(&[(0, left), (sep, child)]);
        r.seal();
        self.ep.write(self.pool_at(raddr).await?, r.bytes()).await?;
        let found = self
            .ep
            .cas(self.t.pools[0].first().at(ROOT_WORD), left.0, raddr.0)
            .await?;
        if found == left.0 {
            self.t.stats.root_grows.fetch_add(1, Ordering::Relaxed);
            self.t.roots_grown.fetch_add(1, Ordering::Relaxed);
            self.t.cache.insert(raddr, &r);
            self.t.root_hint.store(raddr.0, Ordering::Relaxed);
            return Ok(());
        }
        // Someone else grew the tree first: link into their root instead
        // (the unused node stays allocated; nodes are never freed).
        self.t.stats.root_races.fetch_add(1, Ordering::Relaxed);
        Box::pin(self.insert_into_parent(level, sep, child, left)).await
    }

    /// Up to `n` pairs with key >= `start`, walking leaves by sibling links.
    pub async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        let mut out = Vec::new();
        let (mut addr, mut leaf) = self.leaf_for(start).await?;
        let mut from = start;
        loop {
            let entries: Vec<(Key, ValueRef)> = leaf
                .leaf_sorted()
                .into_iter()
                .filter(|e| e.0 >= from && e.0 < leaf.high())
                .take(n - out.len())
                .collect();
            let Some(values) = self.resolve(&entries).await? else {
                (addr, leaf) = self.refresh_leaf(addr, from).await?;
                continue;
            };
            out.extend(entries.iter().map(|e| e.0).zip(values));
            if out.len() >= n || leaf.high() == EMPTY_KEY || leaf.sibling().is_null() {
                return Ok(out);
            }
            from = leaf.high();
            (addr, leaf) = self.refresh_leaf(leaf.sibling(), from).await?;
        }
    }

    /// Builds the tree bottom-up from sorted distinct `pairs` into an empty
    /// tree whose root is the leaf `root` (locked by the caller as `g`).
    pub async fn bulk_build(
        &self,
        root: GAddr,
        g: LocalGuard,
        pairs: &[(Key, &[u8])],
        fill: usize,
    ) -> Result<()> {
        let nb = self.t.node_bytes;
        let mns = self.t.pools.len();
        // Leaves: the first reuses the root's node, the rest are new.
        let groups: Vec<&[(Key, &[u8])]> = pairs.chunks(fill).collect();
        let mut addrs = vec![root];
        for i in 1..groups.len() {
            addrs.push(self.alloc_node(i % mns).await?);
        }
        let mut pending: Vec<Write> = Vec::new();
        let mut level_nodes: Vec<(Key, GAddr)> = Vec::new();
        let mut first_leaf = None;
        for (i, group) in groups.iter().enumerate() {
            let low = if i == 0 { 0 } else { group[0].0 };
            let high = groups.get(i + 1).map_or(EMPTY_KEY, |g| g[0].0);
            let sibling = addrs.get(i + 1).copied().unwrap_or(GAddr::NULL);
            let mut leaf = NodeImage::new(nb, 0, low, high, sibling);
            for (j, (k, v)) in group.iter().enumerate() {
                let (r, block) = self.make_value(addrs[i].mn(), *k, v).await?;
                pending.extend(block);
                leaf.set_leaf_entry(j, *k, r);
            }
            leaf.seal();
            if i == 0 {
                first_leaf = Some(leaf);
            } else {
                pending.push((addrs[i], leaf.bytes().to_vec()));
            }
            level_nodes.push((low, addrs[i]));
            if pending.len() >= 64 {
                self.write_all(std::mem::take(&mut pending)).await?;
            }
        }
        // Inner levels, bottom-up, until one node remains: the new root.
        let mut level = 0u8;
        while level_nodes.len() > 1 {
            level += 1;
            let groups: Vec<&[(Key, GAddr)]> = level_nodes.chunks(fill).collect();
            let mut addrs = Vec::new();
            for i in 0..groups.len() {
                addrs.push(self.alloc_node(i % mns).await?);
            }
            let mut next = Vec::new();
            for (i, group) in groups.iter().enumerate() {
                let low = if i == 0 { 0 } else { group[0].0 };
                let high = groups.get(i + 1).map_or(EMPTY_KEY, |g| g[0].0);
                let sibling = addrs.get(i + 1).copied().unwrap_or(GAddr::NULL);
                let mut node = NodeImage::new(nb, level, low, high, sibling);
                let mut entries = group.to_vec();
                entries[0].0 = low;
                node.set_inner_entries(&entries);
                node.seal();
                self.t.cache.insert(addrs[i], &node);
                pending.push((addrs[i], node.bytes().to_vec()));
                next.push((low, addrs[i]));
            }
            level_nodes = next;
        }
        self.write_all(pending).await?;
        let first = first_leaf.expect("at least one pair");
        self.write_and_unlock(root, g, vec![(root, first.bytes().to_vec())])
            .await?;
        let new_root = level_nodes[0].1;
        if new_root != root {
            let found = self
                .ep
                .cas(self.t.pools[0].first().at(ROOT_WORD), root.0, new_root.0)
                .await?;
            if found != root.0 {
                return Err(KvError::Corrupt("the root moved during a bulk load".into()));
            }
            self.t.root_hint.store(new_root.0, Ordering::Relaxed);
        }
        Ok(())
    }

    async fn write_all(&self, writes: Vec<Write>) -> Result<()> {
        for chunk in writes.chunks(64) {
            let mut b = self.ep.batch();
            for (a, d) in chunk {
                b.write(self.pool_at(*a).await?, d.clone());
            }
            b.run().await?;
        }
        Ok(())
    }

    /// Locks the root for a bulk load if the tree is empty (a single leaf
    /// without entries).
    pub async fn lock_empty_root(&self) -> Result<Option<(GAddr, LocalGuard)>> {
        let root = self.root().await?;
        let (g, n) = self.lock_and_read(root).await?;
        if n.is_leaf()
            && n.sibling().is_null()
            && n.leaf_sorted().is_empty()
            && self.root().await? == root
        {
            return Ok(Some((root, g)));
        }
        self.write_and_unlock(root, g, Vec::new()).await?;
        Ok(None)
    }

    /// Height of the tree (levels, leaves included).
    pub async fn height(&self) -> Result<u8> {
        let root = self.root().await?;
        Ok(self.read_node(root).await?.level() + 1)
    }
}
