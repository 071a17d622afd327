//! One DMPH table on the memory node: its buckets and latest seeds (in a
//! registered region), its overflow cache, and the buffer of inserts and
//! deletes that arrive while it is being rebuilt.
//!
//! Concurrency (invariants 3–5 of `docs/outback.md`): every writer of a
//! bucket holds the lock bit of the bucket's control word and leaves the
//! word with a new version; a GET reads the control word, the slot and the
//! KV block, and the control word again, and retries unless both reads saw
//! the same unlocked word (a seqlock). Blocks are only written, recycled or
//! killed by a writer that holds the lock of the bucket pointing at them, so
//! a GET that validates saw a slot and a block that belonged together.

use crate::hash::slot;
use crate::layout::{BLOCK_TAIL_WORDS, BUCKET_SLOTS_AT, ControlWord, SlotWord, TableLayout};
use crate::server::heap::Heap;
use crate::server::seqlock;

/// Bytes of a reply's head (status, flags, seed).
const REPLY_HEAD: usize = 3;
use crate::ludo::SLOTS;
use crate::othello::Othello;
use dmkv_memnode::Region;
use dmkv_transport::ServiceError;
use dmkv_transport::time::Instant;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Table states (`Table::state`).
pub mod state {
    pub const NORMAL: u8 = 0;
    /// Over s_slow: compute nodes are being told PRE_RESIZE.
    pub const PRE_RESIZE: u8 = 1;
    /// Being rebuilt: inserts and deletes are buffered.
    pub const REBUILDING: u8 = 2;
}

/// A write that can be buffered during a rebuild.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum WriteOp {
    Insert {
        key: u64,
        value: Vec<u8>,
        upsert: bool,
    },
    Update {
        key: u64,
        value: Vec<u8>,
    },
    Delete {
        key: u64,
    },
}

impl WriteOp {
    pub fn key(&self) -> u64 {
        match self {
            WriteOp::Insert { key, .. } | WriteOp::Update { key, .. } | WriteOp::Delete { key } => {
                *key
            }
        }
    }
}

/// A key's state written while its table is being rebuilt (paper §4.4,
/// invariant 17): the write was applied to the heap (block written or
/// killed, mirrored first, its session recorded) and answered at once;
/// the table's slots stay frozen and the key joins or leaves the index at
/// the switch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Pend {
    /// The key's block now; `None`: deleted.
    pub entry: Option<SlotWord>,
    /// The frozen table's entry for the key, killed on the mirrors by a
    /// buffered delete but still referenced by the frozen slot, so not yet
    /// recycled locally (invariant 5); recycled when the pending state is
    /// merged. `None` if the key was not in the table when first written.
    pub stale: Option<SlotWord>,
}

/// Inserts and deletes that arrived while the table is rebuilt (paper
/// §4.4), by (bucket, key): the bucket is the one the client named, so a
/// GET or MAKEUP GET of the bucket finds them.
#[derive(Default)]
pub struct Buffer {
    /// Ordered, so that merging them at the switch is deterministic.
    pub pend: std::collections::BTreeMap<(u32, u64), Pend>,
    /// Set while pending writes are merged into a table; later writers
    /// must retry (they are answered STALE).
    pub drained: bool,
}

impl Buffer {
    pub fn get(&self, b: u32, key: u64) -> Option<Pend> {
        self.pend.get(&(b, key)).copied()
    }
    /// Some key of bucket `b` has a pending write.
    pub fn has_bucket(&self, b: u32) -> bool {
        self.pend.range((b, 0)..=(b, u64::MAX)).next().is_some()
    }
    /// Takes the pending writes of bucket `b`.
    pub fn take_bucket(&mut self, b: u32) -> Vec<(u64, Pend)> {
        let keys: Vec<(u32, u64)> = self
            .pend
            .range((b, 0)..=(b, u64::MAX))
            .map(|(k, _)| *k)
            .collect();
        keys.into_iter()
            .filter_map(|k| self.pend.remove(&k).map(|p| (k.1, p)))
            .collect()
    }
}

/// Keys that did not fit their bucket, with their slot entries.
#[derive(Default)]
pub struct Overflow {
    by_key: HashMap<u64, (u32, SlotWord)>,
    by_bucket: HashMap<u32, Vec<u64>>,
}

impl Overflow {
    pub fn get(&self, key: u64) -> Option<(u32, SlotWord)> {
        self.by_key.get(&key).copied()
    }
    pub fn insert(&mut self, key: u64, bucket: u32, entry: SlotWord) {
        if self.by_key.insert(key, (bucket, entry)).is_none() {
            self.by_bucket.entry(bucket).or_default().push(key);
        }
    }
    pub fn remove(&mut self, key: u64) -> Option<(u32, SlotWord)> {
        let (b, e) = self.by_key.remove(&key)?;
        if let Some(v) = self.by_bucket.get_mut(&b) {
            v.retain(|k| *k != key);
            if v.is_empty() {
                self.by_bucket.remove(&b);
            }
        }
        Some((b, e))
    }
    pub fn keys_of(&self, bucket: u32) -> &[u64] {
        self.by_bucket.get(&bucket).map_or(&[], |v| v.as_slice())
    }
    pub fn len(&self) -> usize {
        self.by_key.len()
    }
    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }
    pub fn buckets(&self) -> Vec<u32> {
        self.by_bucket.keys().copied().collect()
    }
}

pub struct Table {
    pub id: u32,
    pub buckets: u32,
    pub layout: TableLayout,
    /// The seeds array and the bucket lines (`TableLayout`).
    pub region: Region,
    /// The published Othello (compute nodes read it one-sided).
    pub locator: Region,
    pub bucket_seed: u64,
    pub othello: Othello,
    /// Bumped when the table's keys or directory position change; requests
    /// naming an older epoch are answered STALE.
    pub epoch: AtomicU32,
    pub local_depth: AtomicU8,
    pub state: AtomicU8,
    pub pre_resize_since: Mutex<Option<Instant>>,
    pub overflow: Mutex<Overflow>,
    pub overflow_len: AtomicUsize,
    pub overflow_cap: usize,
    /// Keys held in slots.
    pub slot_keys: AtomicU64,
    pub buffer: Mutex<Buffer>,
}

/// The lock on one bucket; dropping it publishes the (possibly new) seed
/// with a new version.
pub struct BucketGuard<'a> {
    table: &'a Table,
    bucket: u32,
    prev: ControlWord,
    seed: u8,
}

impl BucketGuard<'_> {
    pub fn seed(&self) -> u8 {
        self.seed
    }
    pub fn set_seed(&mut self, seed: u8) {
        self.seed = seed;
    }
}

impl Drop for BucketGuard<'_> {
    fn drop(&mut self) {
        let t = self.table;
        // The seeds array (read one-sided by compute nodes) first, still
        // under the lock, then the control word that publishes the seed to
        // GETs and releases the lock.
        if self.seed != self.prev.seed() {
            t.region
                .mem
                .write(t.layout.seed(self.bucket), &[self.seed])
                .expect("seed byte inside the table region");
        }
        seqlock::unlock(
            &Mem(&t.region.mem),
            t.layout.control(self.bucket),
            self.prev,
            self.seed,
        );
    }
}

/// A region's words for [`seqlock`]. Offsets come from the table layout and
/// are inside the region by construction.
pub(crate) struct Mem<'a>(pub &'a dmkv_transport::RegionMem);

impl seqlock::Words for Mem<'_> {
    fn load(&self, at: u64) -> u64 {
        self.0.load_u64(at).expect("word inside its region")
    }
    fn store(&self, at: u64, v: u64) {
        self.0.store_u64(at, v).expect("word inside its region")
    }
    fn cas(&self, at: u64, expected: u64, new: u64) -> u64 {
        self.0
            .cas_u64(at, expected, new)
            .expect("word inside its region")
    }
    fn pause(&self, spins: &mut u32) {
        pause(spins)
    }
}

/// A waiting seqlock reader or lock taker: spins, then yields.
fn pause(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// The words a GET reads of one bucket line, control word and four slots
/// ([`LINE_READ_BYTES`]), borrowed in place after one bounds check (and, on
/// `sim`, one access of the line): the GET's [`seqlock`] runs over them, the
/// same code as [`Mem`]'s and the loom model's (offsets relative to the
/// line's start, acquire loads). Readers only: GETs never store or lock.
struct Line<'a>(&'a [AtomicU64]);

/// Bytes of a bucket line a GET reads: the control word and the four slots.
const LINE_READ_BYTES: usize = BUCKET_SLOTS_AT as usize + SLOTS * 8;

impl seqlock::Words for Line<'_> {
    fn load(&self, at: u64) -> u64 {
        self.0[(at / 8) as usize].load(Ordering::Acquire)
    }
    fn store(&self, _: u64, _: u64) {
        unreachable!("a GET's bucket line is read only")
    }
    fn cas(&self, _: u64, _: u64, _: u64) -> u64 {
        unreachable!("a GET's bucket line is read only")
    }
    fn pause(&self, spins: &mut u32) {
        pause(spins)
    }
}

impl Table {
    fn control(&self, b: u32) -> &std::sync::atomic::AtomicU64 {
        self.region
            .mem
            .word(self.layout.control(b))
            .expect("control word inside the table region")
    }

    /// Locks bucket `b` (which the caller has checked is in range).
    pub fn lock(&self, b: u32) -> BucketGuard<'_> {
        let prev = seqlock::lock(&Mem(&self.region.mem), self.layout.control(b));
        BucketGuard {
            table: self,
            bucket: b,
            prev,
            seed: prev.seed(),
        }
    }

    /// The latest seed of bucket `b` (without locking).
    pub fn seed(&self, b: u32) -> u8 {
        ControlWord(self.control(b).load(Ordering::Acquire)).seed()
    }

    pub fn slot(&self, b: u32, s: usize) -> SlotWord {
        SlotWord(
            self.region
                .mem
                .load_u64(self.layout.slot(b, s))
                .expect("slot inside the table region"),
        )
    }

    /// Stores a slot; only under the bucket's lock.
    pub fn set_slot(&self, b: u32, s: usize, w: SlotWord) {
        self.region
            .mem
            .store_u64(self.layout.slot(b, s), w.0)
            .expect("slot inside the table region");
    }

    /// Writes the initial seeds of a freshly built table.
    pub fn init_seeds(&self, seeds: &[u8]) {
        self.region
            .mem
            .write(self.layout.seed(0), seeds)
            .expect("seeds array inside the table region");
        for (b, &s) in seeds.iter().enumerate() {
            self.control(b as u32)
                .store(ControlWord::initial(s).0, Ordering::Release);
        }
    }

    /// The GET read: a consistent snapshot of bucket `b`'s seed, slot `s`
    /// and the front of the block it points at (key length, value length,
    /// key, value), without locking. `out` gets three bytes of room for the
    /// reply head, then the block front. The caller has checked `b` and `s`.
    ///
    /// The lean path (docs/outback.md, invariant 18): the bucket line's
    /// control word and slots are borrowed in place after one bounds check,
    /// the block's words after one more, and copied straight into `out`; no
    /// per-word region call. Each attempt of the seqlock reads the control
    /// word, the slot, the block and the control word again (invariant 4).
    #[inline]
    pub fn read_slot_and_block(
        &self,
        b: u32,
        s: usize,
        heap: &Heap,
        out: &mut Vec<u8>,
    ) -> Result<(u8, SlotWord), ServiceError> {
        let line = self
            .region
            .mem
            .words_in(self.layout.control(b), LINE_READ_BYTES)
            .map_err(|e| ServiceError::failed(format!("outback: bucket line: {e}")))?;
        let slot = &line[(BUCKET_SLOTS_AT / 8) as usize + s];
        out.clear();
        out.extend_from_slice(&[0; REPLY_HEAD]);
        let (c, w) = seqlock::read(&Line(line), 0, || {
            let w = SlotWord(slot.load(Ordering::Acquire));
            out.truncate(REPLY_HEAD);
            if !w.is_empty() {
                let n = w.len_words().saturating_sub(BLOCK_TAIL_WORDS) as usize;
                let words = heap.words(w.addr(), n)?;
                out.reserve(n * 8);
                for from in words {
                    out.extend_from_slice(&from.load(Ordering::Acquire).to_le_bytes());
                }
            }
            Ok::<_, ServiceError>(w)
        })?;
        Ok((c.seed(), w))
    }

    /// Sets the cache bits of bucket `b` to exactly the slots the bucket's
    /// overflow keys hash to under `seed` (invariant 6).
    pub fn refresh_cache_bits(&self, b: u32, seed: u8, overflow_keys: &[u64]) {
        let mut want = [false; SLOTS];
        for &k in overflow_keys {
            want[slot(k, seed)] = true;
        }
        for (s, &on) in want.iter().enumerate() {
            let w = self.slot(b, s);
            if w.cache() != on {
                self.set_slot(b, s, w.with_cache(on));
            }
        }
    }

    /// Rewrites bucket `b` (locked by `g`) to hold `members` under `seed`.
    pub fn rearrange(
        &self,
        b: u32,
        g: &mut BucketGuard<'_>,
        members: &[(u64, SlotWord)],
        seed: u8,
        overflow_keys: &[u64],
    ) {
        let mut new = [SlotWord::default(); SLOTS];
        for &(k, e) in members {
            new[slot(k, seed)] = e.entry();
        }
        let mut cache = [false; SLOTS];
        for &k in overflow_keys {
            cache[slot(k, seed)] = true;
        }
        for s in 0..SLOTS {
            self.set_slot(b, s, new[s].with_cache(cache[s]));
        }
        g.set_seed(seed);
    }

    pub fn slots_total(&self) -> u64 {
        self.buckets as u64 * SLOTS as u64
    }

    pub fn keys(&self) -> u64 {
        self.slot_keys.load(Ordering::Relaxed) + self.overflow_len.load(Ordering::Relaxed) as u64
    }
}

/// The compute-heavy half of a shard (what a compute node caches for it:
/// Othello arrays, one seed byte per bucket, the directory) measured when
/// a resize completes, against the keys the shard then holds.
#[derive(Debug, Default, Clone, Copy)]
pub struct AfterResize {
    pub resizes: u64,
    /// The largest bytes-per-key ratio seen, with its bytes and keys.
    pub max_bytes: u64,
    pub max_keys: u64,
    pub last_bytes: u64,
    pub last_keys: u64,
}

impl AfterResize {
    pub fn record(&mut self, bytes: u64, keys: u64) {
        self.resizes += 1;
        self.last_bytes = bytes;
        self.last_keys = keys;
        // bytes/keys > max_bytes/max_keys, without division.
        if self.max_keys == 0
            || keys > 0
                && bytes as u128 * self.max_keys as u128 > self.max_bytes as u128 * keys as u128
        {
            self.max_bytes = bytes;
            self.max_keys = keys;
        }
    }
}

/// Counts kept per shard (all relaxed; they are statistics).
#[derive(Default)]
pub struct ShardStats {
    pub makeup_gets: AtomicU64,
    /// GETs of a bucket with pending writes, read under its lock.
    pub pending_gets: AtomicU64,
    pub stale_replies: AtomicU64,
    pub reseeds: AtomicU64,
    pub overflow_inserts: AtomicU64,
    pub promotions: AtomicU64,
    pub buffered: AtomicU64,
    /// Re-sent writes answered from the session table (not applied again).
    pub replays: AtomicU64,
    /// Resizes that split a table in two (extendible hashing) and resizes
    /// that rebuilt a table alone, larger (it held at most `table_keys`).
    pub splits: AtomicU64,
    pub grows: AtomicU64,
    /// Why tables entered PRE_RESIZE (s_slow: overflow fill, or load) and
    /// how often a table reached s_stop (overflow fill that stops inserts).
    pub trigger_slow_fill: AtomicU64,
    pub trigger_slow_load: AtomicU64,
    pub trigger_stop_fill: AtomicU64,
    /// What let each resize start: every compute node had seen PRE_RESIZE,
    /// the PRE_RESIZE wait timed out, or the table was stopped at s_stop.
    pub start_all_told: AtomicU64,
    pub start_timeout: AtomicU64,
    pub start_stop_fill: AtomicU64,
    /// Compute-node index size of this shard after each completed resize.
    pub after_resize: parking_lot::Mutex<AfterResize>,
    pub full_builds: AtomicU64,
    pub fallback_keys: AtomicU64,
    /// Sum and max over splits (resizes) of the time from REBUILDING until
    /// the buffered writes were applied (ns).
    pub split_ns: AtomicU64,
    pub split_max_ns: AtomicU64,
    /// Sum over splits of the time until every compute node fetched.
    pub resize_total_ns: AtomicU64,
    pub full_build_ns: AtomicU64,
    /// Requests served while a split / a full build was running.
    pub requests_during_split: AtomicU64,
    pub requests_during_full: AtomicU64,
    pub requests: AtomicU64,
    pub takeovers: AtomicU64,
    pub takeover_ns: AtomicU64,
    pub recovered_keys: AtomicU64,
}
