//! RACE operations from the compute side, all one-sided.
//!
//! - get: READ both combined buckets (one batch), READ the KV blocks whose
//!   fingerprints match (one batch): two round trips.
//! - insert / update / upsert / delete: the new KV block is written out of
//!   place in the same batch as the bucket READs, the matching KV blocks are
//!   read, then one CAS on the slot publishes the change. Inserts claim an
//!   empty slot *tentatively* and re-read the buckets to settle concurrent
//!   inserts of the same key before a second CAS makes the slot visible
//!   (invariant 3 in `docs/race.md`).
//! - A stale directory cache is noticed by the bucket headers (local depth
//!   and suffix) and refreshed; a subtable being split has frozen slots:
//!   readers may use them until the directory moves, writers wait.

use crate::POOL_SHAPE;
use crate::alloc::{ALLOC_CHUNK, AllocSource, ChunkFetch, LocalAlloc, WaitForFetch};
use crate::layout::{
    BucketHeader, COMBINED_BYTES, Combined, DIR_DEPTH, DIR_ENTRIES, DirEntry, GAddr, KeyHash,
    MAX_DEPTH, SLOTS_PER_BUCKET, Slot, combined_offset, decode_kv, decode_kv_ref, encode_kv,
    kv_units,
};
use dmkv_api::{Key, KvError, Result};
use dmkv_memnode::RemoteSegments;
use dmkv_transport::exec::yield_now;
use dmkv_transport::{Batch, BatchRun, Endpoint, RemoteAddr, RemoteRegion};
use parking_lot::RwLock;
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::sync::atomic::{AtomicU64, Ordering};

/// Give up after this many consecutive retries of one operation.
const MAX_RETRIES: u32 = 1_000_000;

/// The client's copy of the directory.
#[derive(Debug, Clone, Default)]
pub struct DirCache {
    pub depth: u8,
    pub entries: Vec<DirEntry>,
}

impl DirCache {
    pub fn entry(&self, h: &KeyHash) -> DirEntry {
        self.entries[(h.dir & ((1u64 << self.depth) - 1)) as usize]
    }
}

/// Operation kinds counted in `engine_stats`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Get = 0,
    Insert,
    Update,
    Upsert,
    Delete,
}

pub const KINDS: [(&str, Kind); 5] = [
    ("get", Kind::Get),
    ("insert", Kind::Insert),
    ("update", Kind::Update),
    ("upsert", Kind::Upsert),
    ("delete", Kind::Delete),
];

/// Counters of one compute process.
#[derive(Default)]
pub struct RaceStats {
    pub cas_retries: AtomicU64,
    pub frozen_waits: AtomicU64,
    pub dir_refreshes: AtomicU64,
    pub header_mismatches: AtomicU64,
    pub kv_retries: AtomicU64,
    pub insert_conflicts: AtomicU64,
    pub resizes: AtomicU64,
    pub resize_lock_waits: AtomicU64,
    /// Splits that failed after freezing their subtable and thawed it.
    pub split_aborts: AtomicU64,
    pub ops: [AtomicU64; 5],
    pub round_trips: [AtomicU64; 5],
}

/// What every client of a compute process shares.
pub struct RaceShared {
    pub groups: u64,
    pub subtable_bytes: u64,
    /// Each memory node's pool segments.
    pub pools: Vec<RemoteSegments>,
    pub dir: RemoteRegion,
    pub allocs: Vec<AllocSource>,
    pub cache: RwLock<DirCache>,
    pub lock_tag: u64,
    /// Counted into by every compute process of a simulated cluster
    /// (`ConnectArgs::counters_from`).
    pub stats: std::sync::Arc<RaceStats>,
}

/// How a put treats an existing or missing key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutMode {
    Insert,
    Update,
    Upsert,
}

/// The candidate buckets of a key as read.
pub struct Buckets {
    pub entry: DirEntry,
    pub combined: [Combined; 2],
}

impl Buckets {
    /// Every slot of the (up to four distinct) buckets: (offset in the
    /// subtable, slot), without duplicates.
    ///
    /// Bucket offsets are multiples of `BUCKET_BYTES`, so two slots share an
    /// offset exactly when they are the same slot of the same bucket: a
    /// bucket already listed (the two combined buckets may share one) is
    /// skipped whole, which gives what comparing every slot's offset with
    /// every earlier one gave, in the same order (test
    /// `slots_skip_a_shared_bucket`), without the quadratic scan.
    pub fn slots(&self) -> Vec<(u64, Slot)> {
        let mut v: Vec<(u64, Slot)> = Vec::with_capacity(4 * SLOTS_PER_BUCKET);
        self.for_each_slot(|off, s| v.push((off, s)));
        v
    }

    /// Calls `f` with what [`Buckets::slots`] lists, in the same order,
    /// without collecting it.
    pub fn for_each_slot(&self, mut f: impl FnMut(u64, Slot)) {
        let mut seen = [u64::MAX; 4];
        let mut n = 0;
        for c in &self.combined {
            for bucket in 0..2 {
                let first = bucket * SLOTS_PER_BUCKET;
                let base = c.slot_offset(first);
                if seen[..n].contains(&base) {
                    continue;
                }
                seen[n] = base;
                n += 1;
                // Slots of a bucket are consecutive words: slot_offset(first
                // + j) = base + 8 j (no division per slot).
                for (j, s) in c.slots[first..first + SLOTS_PER_BUCKET].iter().enumerate() {
                    f(base + 8 * j as u64, *s);
                }
            }
        }
    }
    fn any_frozen(&self) -> bool {
        self.combined
            .iter()
            .any(|c| c.slots.iter().any(|s| s.is_frozen()))
    }
}

/// What GET, update, upsert, insert and delete use of a key's buckets,
/// taken where they were read ([`Ctx::read_buckets_with`]) instead of the
/// whole ~280-byte [`Buckets`].
pub struct BucketView {
    pub entry: DirEntry,
    /// Whether any slot is frozen ([`Buckets::any_frozen`]).
    pub frozen: bool,
    /// The visible slots with the key's fingerprint, in
    /// [`Buckets::slots`] order, on the stack (a key rarely has more than
    /// one).
    pub cands: SmallVec<[(u64, Slot); 4]>,
    /// Where an insert would claim a slot ([`pick_empty`]); `None` also
    /// when not asked for.
    pub empty: Option<u64>,
}

impl BucketView {
    /// The view of `b` for key hash `h`; `empty` only if `want_empty`.
    pub fn of(b: &Buckets, h: &KeyHash, want_empty: bool) -> BucketView {
        let mut cands = SmallVec::new();
        b.for_each_slot(|off, s| {
            if s.is_visible() && s.fp() == h.fp {
                cands.push((off, s));
            }
        });
        BucketView {
            entry: b.entry,
            frozen: b.any_frozen(),
            cands,
            empty: if want_empty { pick_empty(b) } else { None },
        }
    }
}

enum Resolved {
    Won,
    Lost,
    Retry,
}

/// What one compute thread keeps for itself: its KV-block allocators and
/// the pool segments it has found, per memory node.
pub struct PerThread {
    pub alloc: RefCell<Vec<LocalAlloc>>,
    /// Where each pool segment starts (`[mn][segment]`), copied from
    /// `RaceShared::pools` the first time this thread uses it, so that the
    /// GET path finds its addresses without `RemoteSegments`' lock (a
    /// segment, once registered, keeps its region for the pool's life, as
    /// `RemoteSegments` itself assumes).
    segs: RefCell<Vec<Vec<Option<RemoteAddr>>>>,
}

impl PerThread {
    pub fn new(memory_nodes: usize) -> PerThread {
        PerThread {
            alloc: RefCell::new((0..memory_nodes).map(|_| LocalAlloc::default()).collect()),
            segs: RefCell::new(vec![Vec::new(); memory_nodes]),
        }
    }
}

/// One operation's view: shared state, this thread's endpoint and
/// allocators, and its round-trip count.
pub struct Ctx<'a> {
    pub t: &'a RaceShared,
    pub ep: &'a Endpoint,
    pub local: &'a PerThread,
    pub rtts: Cell<u64>,
}

impl Ctx<'_> {
    /// Where `a` is; the first use of a pool segment looks it up by name.
    pub async fn pool_at(&self, a: GAddr) -> Result<RemoteAddr> {
        if let Some(at) = self.known_pool_at(a)? {
            return Ok(at);
        }
        Ok(self.t.pools[a.mn].at(self.ep, a.offset).await?)
    }

    /// Where `a` is if its pool segment has been looked up already (the
    /// usual case, answered without a future); an error for an unknown
    /// memory node.
    fn known_pool_at(&self, a: GAddr) -> Result<Option<RemoteAddr>> {
        let (seg, within) = (
            (a.offset / POOL_SHAPE.span) as usize,
            a.offset % POOL_SHAPE.span,
        );
        if let Some(Some(start)) = self.local.segs.borrow().get(a.mn).and_then(|s| s.get(seg)) {
            return Ok(Some(start.offset_by(within)));
        }
        let p = self.t.pools.get(a.mn).ok_or_else(|| {
            KvError::Corrupt(format!("address {a:?} names an unknown memory node"))
        })?;
        let Some(start) = p.known_at(a.offset - within) else {
            return Ok(None);
        };
        let mut segs = self.local.segs.borrow_mut();
        if segs.len() <= a.mn {
            segs.resize(a.mn + 1, Vec::new());
        }
        let s = &mut segs[a.mn];
        if s.len() <= seg {
            s.resize(seg + 1, None);
        }
        s[seg] = Some(start);
        Ok(Some(start.offset_by(within)))
    }

    /// Counts `b`'s round trip and posts it: the batch's own future (an
    /// `async fn` here kept a second future around it, whose state the
    /// caller's future moved in and out: `memcpy` calls on every write
    /// path's round trip, docs/performance.md, "Eighteenth pass"). Counted
    /// when called, which is when the `async fn` counted it (every caller
    /// awaits it at once).
    #[inline]
    pub fn run<'b>(&self, b: Batch<'b>) -> BatchRun<'b> {
        self.count_rtt(&b);
        b.run()
    }

    /// Counts the round trip `b` will cost (none if it is empty); for the
    /// GET path, which runs its batches directly rather than through
    /// [`Ctx::run`]'s extra future.
    fn count_rtt(&self, b: &Batch<'_>) {
        if !b.is_empty() {
            self.rtts.set(self.rtts.get() + 1);
        }
    }

    /// [`Ctx::count_rtt`] for a batch built in its future
    /// ([`Endpoint::batch_run`]), before it is awaited.
    fn count_run(&self, b: &BatchRun<'_>) {
        if !b.is_unposted_empty() {
            self.rtts.set(self.rtts.get() + 1);
        }
    }

    /// Charges this operation to `kind` in the process's counters.
    pub fn finish(&self, kind: Kind) {
        self.t.stats.ops[kind as usize].fetch_add(1, Ordering::Relaxed);
        self.t.stats.round_trips[kind as usize].fetch_add(self.rtts.get(), Ordering::Relaxed);
    }

    /// Re-reads the directory (global depth and entries) into the cache.
    pub async fn refresh_dir(&self) -> Result<()> {
        self.t.stats.dir_refreshes.fetch_add(1, Ordering::Relaxed);
        let mut depth = self.t.cache.read().depth;
        for _ in 0..MAX_RETRIES {
            let mut b = self.ep.batch();
            let r = b.read(
                self.t.dir.at(0),
                (DIR_ENTRIES + 8 * (1u64 << depth)) as usize,
            );
            let bytes = self.run(b).await?.take_read(r);
            let word =
                |i: usize| u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
            let gd = word((DIR_DEPTH / 8) as usize);
            if gd > u64::from(MAX_DEPTH) {
                return Err(KvError::Corrupt(format!("global depth {gd}")));
            }
            if gd as u8 > depth {
                depth = gd as u8;
                continue;
            }
            let n = 1usize << gd;
            let entries: Vec<DirEntry> = (0..n)
                .map(|i| DirEntry(word(DIR_ENTRIES as usize / 8 + i)))
                .collect();
            // Entries being written while we read (a doubling) are retried.
            if entries.iter().all(|e| e.is_sane(self.t.pools.len())) {
                *self.t.cache.write() = DirCache {
                    depth: gd as u8,
                    entries,
                };
                return Ok(());
            }
            yield_now().await;
        }
        Err(KvError::Corrupt(
            "the directory never read consistently".into(),
        ))
    }

    /// Reads the two combined buckets of `h` (after `pre`, verbs posted in
    /// the same batch, e.g. a KV block write), refreshing the directory until
    /// the bucket headers agree with it, and hands them to `f` where they
    /// were parsed, returning what `f` makes of them: a caller needs a few
    /// words of the ~280-byte `Buckets` (its candidates, [`BucketView`]),
    /// which are not moved through the futures' outputs and states (three
    /// `memcpy` calls per GET, docs/performance.md, "Fourteenth pass"; the
    /// write paths too since the nineteenth).
    async fn read_buckets_with<T>(
        &self,
        h: &KeyHash,
        pre: Option<(GAddr, Vec<u8>)>,
        f: impl FnOnce(Buckets) -> T,
    ) -> Result<T> {
        let mut pre = pre;
        for _ in 0..MAX_RETRIES {
            let entry = self.t.cache.read().entry(h);
            let st = entry.subtable();
            // Built in its future, awaited by reference (no move of the
            // verbs or of the future, `Endpoint::batch_run`).
            let mut b = self.ep.batch_run();
            if let Some((at, data)) = pre.take() {
                // Awaited only for a segment not looked up yet.
                let at = match self.known_pool_at(at)? {
                    Some(at) => at,
                    None => self.pool_at(at).await?,
                };
                b.write(at, data);
            }
            let offs = [combined_offset(h.b1), combined_offset(h.b2)];
            // Both combined buckets lie in the subtable, which lies in one
            // pool segment (one region: pools allocate within a segment), so
            // the subtable's address is found once. Awaited only for a
            // segment not looked up yet.
            let sub = GAddr {
                mn: st.mn,
                offset: st.offset,
            };
            let base = match self.known_pool_at(sub)? {
                Some(at) => at,
                None => self.pool_at(sub).await?,
            };
            let r0 = b.read(base.offset_by(offs[0]), COMBINED_BYTES);
            let r1 = b.read(base.offset_by(offs[1]), COMBINED_BYTES);
            self.count_run(&b);
            let res = (&mut b).await?;
            // Not kept across the `refresh_dir` await below: the buckets are
            // handed to `f` or dropped before it.
            {
                let combined = [
                    Combined::parse(offs[0], res.read(r0)),
                    Combined::parse(offs[1], res.read(r1)),
                ];
                drop(res);
                let ok = combined.iter().all(|c| {
                    c.headers
                        .iter()
                        .all(|hd| hd.matches(entry.local_depth(), h.dir))
                });
                if ok {
                    return Ok(f(Buckets { entry, combined }));
                }
            }
            self.t
                .stats
                .header_mismatches
                .fetch_add(1, Ordering::Relaxed);
            self.refresh_dir().await?;
        }
        Err(KvError::Corrupt(
            "bucket headers never matched the directory".into(),
        ))
    }

    /// Reads the KV blocks of `slots` in one batch; `None` if one is not what
    /// its slot names any more (reused or torn).
    async fn read_kvs(&self, slots: &[(u64, Slot)]) -> Result<Option<Vec<(u64, Vec<u8>)>>> {
        let mut b = self.ep.batch();
        let mut idx = Vec::with_capacity(slots.len());
        for (_, s) in slots {
            idx.push(b.read(self.pool_at(s.kv()).await?, usize::from(s.units()) * 64));
        }
        let res = self.run(b).await?;
        let mut out = Vec::with_capacity(slots.len());
        for ((_, s), i) in slots.iter().zip(idx) {
            match decode_kv(res.read(i), *s) {
                Some(kv) => out.push(kv),
                None => {
                    self.t.stats.kv_retries.fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
            }
        }
        Ok(Some(out))
    }

    /// [`Ctx::read_kvs`] for one key: reads the KV blocks of `slots` in one
    /// batch and finds the first that holds `key`, keeping what `keep`
    /// makes of its value (GET: a copy; a write: nothing, so no block is
    /// copied out). `None` (counted as `read_kvs` counts it) if any block is
    /// not what its slot names any more, whichever comes first, as
    /// `read_kvs` decides.
    async fn find_kv<T>(
        &self,
        slots: &[(u64, Slot)],
        key: Key,
        keep: impl FnOnce(&[u8]) -> T,
    ) -> Result<Option<Option<(usize, T)>>> {
        // As in `read_buckets_with`: built in place, awaited by reference.
        let mut b = self.ep.batch_run();
        for (i, (_, s)) in slots.iter().enumerate() {
            let at = match self.known_pool_at(s.kv())? {
                Some(at) => at,
                None => self.pool_at(s.kv()).await?,
            };
            let r = b.read(at, usize::from(s.units()) * 64);
            debug_assert_eq!(r, i, "read i of a fresh batch has index i");
        }
        self.count_run(&b);
        let res = (&mut b).await?;
        let mut found = None;
        let mut keep = Some(keep);
        for (i, (_, s)) in slots.iter().enumerate() {
            match decode_kv_ref(res.read(i), *s) {
                Some((k, v)) => {
                    if k == key
                        && let Some(keep) = keep.take()
                    {
                        found = Some((i, keep(v)));
                    }
                }
                None => {
                    self.t.stats.kv_retries.fetch_add(1, Ordering::Relaxed);
                    return Ok(None);
                }
            }
        }
        Ok(Some(found))
    }

    /// Whether the directory no longer sends `h` to `entry` (re-read).
    async fn moved(&self, h: &KeyHash, entry: DirEntry) -> Result<bool> {
        self.refresh_dir().await?;
        Ok(self.t.cache.read().entry(h) != entry)
    }

    async fn addr_in(&self, entry: DirEntry, off: u64) -> Result<RemoteAddr> {
        let st = entry.subtable();
        self.pool_at(GAddr {
            mn: st.mn,
            offset: st.offset + off,
        })
        .await
    }

    pub async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let h = KeyHash::new(key, self.t.groups);
        for _ in 0..MAX_RETRIES {
            // What GET uses of the buckets, taken where they were parsed:
            // candidates in `Buckets::slots` order, on the stack (a key
            // rarely has more than one), whether any slot is frozen, and
            // the directory entry.
            let (cands, any_frozen, entry) = self
                .read_buckets_with(&h, None, |b| {
                    let v = BucketView::of(&b, &h, false);
                    (v.cands, v.frozen, v.entry)
                })
                .await?;
            let Some(found) = self.find_kv(&cands, key, <[u8]>::to_vec).await? else {
                // A block changed under its slot. If the slot is frozen, the
                // subtable may be retired and the block reused since: only a
                // fresh directory gets us out.
                if any_frozen {
                    self.refresh_dir().await?;
                }
                continue;
            };
            // A frozen slot is current only while the directory still sends
            // the key to this subtable (writers wait for the new ones).
            let frozen = match &found {
                Some((i, _)) => cands[*i].1.is_frozen(),
                None => any_frozen,
            };
            if frozen && self.moved(&h, entry).await? {
                continue;
            }
            return Ok(found.map(|(_, v)| v));
        }
        Err(KvError::Corrupt(format!(
            "get of key {key:#x} never settled"
        )))
    }

    /// A KV block for (`key`, `value`) on memory node `mn`: its slot (not
    /// yet tentative) and the bytes to write.
    async fn new_block(
        &self,
        mn: usize,
        h: &KeyHash,
        key: Key,
        value: &[u8],
    ) -> Result<(Slot, Vec<u8>)> {
        let units = kv_units(value.len());
        loop {
            let fetch = {
                let mut a = self.local.alloc.borrow_mut();
                let a = &mut a[mn];
                if let Some((off, tag)) = a.block(units) {
                    let at = GAddr { mn, offset: off };
                    return Ok((Slot::new(h.fp, at, units, tag), encode_kv(key, tag, value)));
                }
                a.claim_fetch()
            };
            if !fetch {
                // Another task of this client is fetching a chunk: park
                // until it ends (a polling wait would keep this thread's
                // core busy for the whole round trip).
                WaitForFetch {
                    allocs: &self.local.alloc,
                    mn,
                }
                .await;
                continue;
            }
            let held = ChunkFetch::new(&self.local.alloc, mn);
            let src = self.t.allocs[mn];
            let got = src.fetch(self.ep, ALLOC_CHUNK).await;
            if let Ok(offset) = got {
                self.local.alloc.borrow_mut()[mn].add_chunk(offset, src.sizes.chunk);
            }
            drop(held);
            got?;
        }
    }

    /// [`Ctx::new_block`]'s answer when this thread's allocator has a
    /// block at hand (the usual case), without a future; `None` (nothing
    /// changed) when a chunk must be fetched first.
    fn block_now(&self, mn: usize, h: &KeyHash, key: Key, value: &[u8]) -> Option<(Slot, Vec<u8>)> {
        let units = kv_units(value.len());
        let (off, tag) = self.local.alloc.borrow_mut()[mn].block(units)?;
        let at = GAddr { mn, offset: off };
        Some((Slot::new(h.fp, at, units, tag), encode_kv(key, tag, value)))
    }

    /// [`Ctx::addr_in`]'s answer if its pool segment has been looked up
    /// already (the usual case), without a future (as
    /// [`Ctx::known_pool_at`] for [`Ctx::pool_at`]).
    fn known_addr_in(&self, entry: DirEntry, off: u64) -> Result<Option<RemoteAddr>> {
        let st = entry.subtable();
        self.known_pool_at(GAddr {
            mn: st.mn,
            offset: st.offset + off,
        })
    }

    fn free_block(&self, s: Slot) {
        let at = s.kv();
        self.local.alloc.borrow_mut()[at.mn].free(at.offset, s.units(), s.tag());
    }

    /// Inserts, updates or upserts; returns whether the key existed.
    pub async fn put(&self, key: Key, value: &[u8], mode: PutMode) -> Result<bool> {
        let h = KeyHash::new(key, self.t.groups);
        let mn = self.t.cache.read().entry(&h).subtable().mn;
        // A write path's sub-futures are awaited only when they must wait
        // (a chunk to fetch, a segment to look up): each awaited future is
        // moved into this one's state (a `memcpy` call per await).
        let (mine, block) = match self.block_now(mn, &h, key, value) {
            Some(b) => b,
            None => self.new_block(mn, &h, key, value).await?,
        };
        let mut pre = Some((mine.kv(), block));
        let may_insert = mode != PutMode::Update;
        for _ in 0..MAX_RETRIES {
            let b = self
                .read_buckets_with(&h, pre.take(), |b| BucketView::of(&b, &h, may_insert))
                .await?;
            if b.frozen {
                // A split of this subtable is under way: wait for it.
                self.t.stats.frozen_waits.fetch_add(1, Ordering::Relaxed);
                yield_now().await;
                self.refresh_dir().await?;
                continue;
            }
            let Some(found) = self.find_kv(&b.cands, key, |_| ()).await? else {
                continue;
            };
            let existing = found.map(|(i, ())| b.cands[i]);
            match (mode, existing) {
                (PutMode::Insert, Some(_)) | (PutMode::Update, None) => {
                    self.free_block(mine);
                    return Ok(existing.is_some());
                }
                (PutMode::Update | PutMode::Upsert, Some((off, old))) => {
                    let at = match self.known_addr_in(b.entry, off)? {
                        Some(at) => at,
                        None => self.addr_in(b.entry, off).await?,
                    };
                    let mut cas = self.ep.batch_run();
                    let c = cas.cas(at, old.0, mine.0);
                    self.count_run(&cas);
                    if (&mut cas).await?.word(c) != old.0 {
                        self.t.stats.cas_retries.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    self.free_block(old);
                    return Ok(true);
                }
                (PutMode::Insert | PutMode::Upsert, None) => {
                    let Some(off) = b.empty else {
                        self.resize(&h, b.entry).await?;
                        continue;
                    };
                    let claim = mine.tentative();
                    let mut cas = self.ep.batch();
                    let c = cas.cas(self.addr_in(b.entry, off).await?, 0, claim.0);
                    if self.run(cas).await?.word(c) != 0 {
                        self.t.stats.cas_retries.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    match self.settle_insert(&h, key, b.entry, off, claim).await? {
                        Resolved::Won => return Ok(false),
                        Resolved::Lost if mode == PutMode::Insert => {
                            self.free_block(mine);
                            return Ok(true);
                        }
                        // An upsert that lost updates the winner's slot; a
                        // claim dropped by a split starts over.
                        Resolved::Lost | Resolved::Retry => continue,
                    }
                }
            }
        }
        Err(KvError::Corrupt(format!(
            "write of key {key:#x} never settled"
        )))
    }

    /// After claiming slot `off` tentatively: re-reads the buckets and
    /// decides against other claims and visible slots of the same key. The
    /// lowest claim wins unless the key is already visible; a higher claim
    /// waits for lower ones to decide, and the lowest strikes out higher
    /// ones before it turns visible (a struck claim starts its put over).
    async fn settle_insert(
        &self,
        h: &KeyHash,
        key: Key,
        entry: DirEntry,
        off: u64,
        claim: Slot,
    ) -> Result<Resolved> {
        loop {
            let mut b = self.ep.batch();
            let offs = [combined_offset(h.b1), combined_offset(h.b2)];
            let r0 = b.read(self.addr_in(entry, offs[0]).await?, COMBINED_BYTES);
            let r1 = b.read(self.addr_in(entry, offs[1]).await?, COMBINED_BYTES);
            let mut res = self.run(b).await?;
            let bk = Buckets {
                entry,
                combined: [
                    Combined::parse(offs[0], &res.take_read(r0)),
                    Combined::parse(offs[1], &res.take_read(r1)),
                ],
            };
            let slots = bk.slots();
            let me = slots.iter().find(|e| e.0 == off).map(|e| e.1);
            if me != Some(claim) {
                // Frozen by a split (which drops claims): start over.
                return Ok(Resolved::Retry);
            }
            let others: Vec<(u64, Slot)> = slots
                .into_iter()
                .filter(|(o, s)| *o != off && !s.is_empty() && s.fp() == h.fp)
                .collect();
            let Some(kvs) = self.read_kvs(&others).await? else {
                continue;
            };
            let same: Vec<(u64, Slot)> = others
                .iter()
                .zip(kvs)
                .filter(|(_, kv)| kv.0 == key)
                .map(|(o, _)| *o)
                .collect();
            let visible = same.iter().any(|(_, s)| s.is_visible());
            let lower_claim = same.iter().any(|(o, s)| s.is_tentative() && *o < off);
            if visible {
                self.t
                    .stats
                    .insert_conflicts
                    .fetch_add(1, Ordering::Relaxed);
                let mut cas = self.ep.batch();
                cas.cas(self.addr_in(entry, off).await?, claim.0, 0);
                // If a split froze the claim meanwhile it is dropped anyway.
                self.run(cas).await?;
                return Ok(Resolved::Lost);
            }
            if lower_claim {
                yield_now().await;
                continue;
            }
            // Higher claims of the same key are struck out before this one
            // becomes visible. Without this, a higher claim that decided to
            // win before this (lower) claim landed and a lower claim that
            // read the higher one while it was still tentative would both
            // become visible: two winners. A strike that fails means the
            // higher claim turned visible first; the next read sees it and
            // this claim loses.
            let higher: Vec<(u64, Slot)> = same
                .iter()
                .copied()
                .filter(|(o, s)| s.is_tentative() && *o > off)
                .collect();
            if !higher.is_empty() {
                let mut cas = self.ep.batch();
                for (o, s) in &higher {
                    cas.cas(self.addr_in(entry, *o).await?, s.0, 0);
                }
                let res = self.run(cas).await?;
                self.t
                    .stats
                    .insert_conflicts
                    .fetch_add(1, Ordering::Relaxed);
                if (0..higher.len()).any(|i| res.word(i) != higher[i].1.0) {
                    // A higher claim turned visible (or changed) first: look
                    // again; the next read decides.
                    continue;
                }
                // Every higher claim is struck: turn visible now. Re-reading
                // first would let the struck claimers re-claim faster than
                // this loop goes round (three round trips against their
                // two), a livelock the simulated cluster found with eight
                // racers. The CAS below is still the decision: a lower claim
                // that landed meanwhile strikes this one first and makes it
                // fail, or finds it visible and loses.
            }
            let mut cas = self.ep.batch();
            let c = cas.cas(self.addr_in(entry, off).await?, claim.0, claim.final_().0);
            return Ok(if self.run(cas).await?.word(c) == claim.0 {
                Resolved::Won
            } else {
                Resolved::Retry
            });
        }
    }

    pub async fn delete(&self, key: Key) -> Result<bool> {
        let h = KeyHash::new(key, self.t.groups);
        for _ in 0..MAX_RETRIES {
            let b = self
                .read_buckets_with(&h, None, |b| BucketView::of(&b, &h, false))
                .await?;
            if b.frozen {
                self.t.stats.frozen_waits.fetch_add(1, Ordering::Relaxed);
                yield_now().await;
                self.refresh_dir().await?;
                continue;
            }
            let Some(found) = self.find_kv(&b.cands, key, |_| ()).await? else {
                continue;
            };
            let Some((i, ())) = found else {
                return Ok(false);
            };
            let (off, old) = b.cands[i];
            let at = match self.known_addr_in(b.entry, off)? {
                Some(at) => at,
                None => self.addr_in(b.entry, off).await?,
            };
            let mut cas = self.ep.batch_run();
            let c = cas.cas(at, old.0, 0);
            self.count_run(&cas);
            if (&mut cas).await?.word(c) != old.0 {
                self.t.stats.cas_retries.fetch_add(1, Ordering::Relaxed);
                continue;
            }
            self.free_block(old);
            return Ok(true);
        }
        Err(KvError::Corrupt(format!(
            "delete of key {key:#x} never settled"
        )))
    }

    /// Splits the subtable `entry` names (if it still does), under the
    /// directory's resize lock; see [`crate::resize`].
    async fn resize(&self, h: &KeyHash, entry: DirEntry) -> Result<()> {
        if entry.local_depth() >= MAX_DEPTH {
            return Err(KvError::Exhausted(format!(
                "race: a subtable at the maximum depth {MAX_DEPTH} is full"
            )));
        }
        crate::resize::split(self, h, entry).await
    }
}

/// An empty slot among the buckets, preferring the emptier combined bucket
/// and main buckets over the shared overflow bucket.
fn pick_empty(b: &Buckets) -> Option<u64> {
    let empties = |c: &Combined| c.slots.iter().filter(|s| s.is_empty()).count();
    let mut order = [0usize, 1];
    if empties(&b.combined[1]) > empties(&b.combined[0]) {
        order = [1, 0];
    }
    for ci in order {
        let c = &b.combined[ci];
        // The main bucket is the first of an even pair, the second of an odd.
        let main_first = (c.offset / 64).is_multiple_of(3);
        let buckets = if main_first { [0, 1] } else { [1, 0] };
        for bucket in buckets {
            for i in 0..SLOTS_PER_BUCKET {
                let idx = bucket * SLOTS_PER_BUCKET + i;
                if c.slots[idx].is_empty() && !c.slots[idx].is_frozen() {
                    return Some(c.slot_offset(idx));
                }
            }
        }
    }
    None
}

/// Bucket headers of a subtable owning suffix `suffix` at `local_depth`.
pub fn subtable_image(groups: u64, local_depth: u8, suffix: u64) -> Vec<u8> {
    let mut img = vec![0u8; (groups * crate::layout::GROUP_BYTES) as usize];
    let hdr = BucketHeader::new(local_depth, suffix).0.to_le_bytes();
    for b in 0..groups * 3 {
        let at = (b * 64) as usize;
        img[at..at + 8].copy_from_slice(&hdr);
    }
    img
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{BucketHeader, DirEntry};

    /// The former definition of `Buckets::slots`: every slot whose offset
    /// no earlier slot had.
    fn slots_by_offset(b: &Buckets) -> Vec<(u64, Slot)> {
        let mut v: Vec<(u64, Slot)> = Vec::new();
        for c in &b.combined {
            for (i, s) in c.slots.iter().enumerate() {
                let off = c.slot_offset(i);
                if !v.iter().any(|e| e.0 == off) {
                    v.push((off, *s));
                }
            }
        }
        v
    }

    fn combined(b: u64) -> Combined {
        let offset = combined_offset(b);
        let mut slots = [Slot::EMPTY; 2 * SLOTS_PER_BUCKET];
        for (i, s) in slots.iter_mut().enumerate() {
            *s = Slot(offset * 100 + i as u64 + 1);
        }
        Combined {
            offset,
            headers: [BucketHeader(0), BucketHeader(0)],
            slots,
        }
    }

    #[test]
    fn slots_skip_a_shared_bucket() {
        // Every pair of candidate buckets over a few groups: disjoint, the
        // same, and sharing the middle (overflow) bucket of a group.
        let mut shared = 0;
        for b1 in 0..8 {
            for b2 in 0..8 {
                let b = Buckets {
                    entry: DirEntry(0),
                    combined: [combined(b1), combined(b2)],
                };
                let (new, old) = (b.slots(), slots_by_offset(&b));
                assert_eq!(new, old, "buckets {b1} and {b2}");
                let distinct = if b1 == b2 { 2 } else { 4 };
                if new.len() < distinct * SLOTS_PER_BUCKET {
                    shared += 1;
                }
            }
        }
        assert!(shared > 0, "some pairs share a bucket");
    }

    /// The writes' view of the buckets (taken where they are read) holds
    /// what put and delete computed from the whole `Buckets` before: the
    /// visible slots with the key's fingerprint in `slots()` order, whether
    /// any slot is frozen, and `pick_empty`'s slot (only when asked for).
    #[test]
    fn a_bucket_view_holds_what_the_writes_read_from_buckets() {
        let at = GAddr { mn: 0, offset: 64 };
        let mut seen_cands = 0;
        let mut seen_empty = 0;
        for seed in 0..400u64 {
            let (b1, b2) = (seed % 5, (seed / 5) % 5);
            let mut b = Buckets {
                entry: DirEntry(seed),
                combined: [combined(b1), combined(b2)],
            };
            // A deterministic mix of empty, visible, tentative and frozen
            // slots with fingerprints 1..=3.
            let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
            for c in &mut b.combined {
                for s in &mut c.slots {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    let fp = (x % 3) as u8 + 1;
                    let slot = Slot::new(fp, at, 1, 0);
                    *s = match (x >> 8) % 8 {
                        0..=2 => Slot::EMPTY,
                        3 => slot.tentative(),
                        4 if seed % 7 == 0 => slot.frozen(),
                        _ => slot,
                    };
                }
            }
            let h = KeyHash {
                dir: 0,
                fp: (seed % 3) as u8 + 1,
                b1,
                b2,
            };
            for want_empty in [false, true] {
                let v = BucketView::of(&b, &h, want_empty);
                let cands: Vec<(u64, Slot)> = b
                    .slots()
                    .into_iter()
                    .filter(|(_, s)| s.is_visible() && s.fp() == h.fp)
                    .collect();
                assert_eq!(v.cands.to_vec(), cands, "seed {seed}");
                assert_eq!(v.frozen, b.any_frozen(), "seed {seed}");
                assert_eq!(v.entry, b.entry);
                let empty = if want_empty { pick_empty(&b) } else { None };
                assert_eq!(v.empty, empty, "seed {seed}");
                seen_cands += usize::from(!cands.is_empty());
                seen_empty += usize::from(empty.is_some());
            }
        }
        assert!(seen_cands > 0 && seen_empty > 0);
    }
}
