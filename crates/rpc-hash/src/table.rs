//! The memory node's chained hash table with fingerprints (Cluster hashing,
//! DrTM+H / Outback's RPC-Cluster baseline).
//!
//! Everything here runs on the memory node's handler threads. The table lives
//! in a registered region (so its bytes are accounted like every engine's),
//! accessed through the region's atomic words by the node's own CPU; no
//! client ever reads it one-sided.
//!
//! Layout (all words little-endian u64), in two regions:
//!
//! ```text
//! buckets region:
//!   [0, B*64)                 main buckets: 7 slots + link word each
//!   [B*64, B*64 + I*64)       indirect buckets (slab), same format
//! kv region:
//!   [64, end)                 KV blocks: key u64 | value bytes (padded to 8)
//! ```
//!
//! A slot is `fp:14 | len:13 | kv:37` (see [`Slot`]); 0 is empty. The link
//! word holds the byte offset of the next indirect bucket, 0 for none.
//! A bucket and its indirect chain are guarded by the lock stripe of the main
//! bucket's index.

use dmkv_memnode::{AllocError, Region, SizeClassAllocator, SlabAllocator};
use dmkv_transport::RegionMem;
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

pub const BUCKET_BYTES: u64 = 64;
pub const SLOTS_PER_BUCKET: u64 = 7;
/// Byte offset of the link word in a bucket.
const LINK_OFFSET: u64 = 56;
const LOCK_STRIPES: usize = 1024;

/// Work the table declares to `sim`'s instruction term
/// ([`dmkv_transport::sim::work`]; docs/simulation.md, "An instruction term
/// for memory-node jobs (branch i49)"): instructions counted with callgrind
/// on the `local` transport, main's binary a1dce1e, `DMKV=... KEEP=...
/// scripts/instructions-per-op.sh rpc-hash` (ycsb-c, 50,000 keys, 1 thread
/// x 8 tasks, differenced over 50,000 GETs), the handler thread's call tree
/// below `ServiceTable::run`.
pub(crate) mod cost {
    /// `find`: a base and a price per slot probed (a bucket's visit and the
    /// key compare spread over its slots), fitted to two runs: 182.3
    /// instructions at 2.527 slots probed per lookup (16,384 main buckets)
    /// and 405.4 at 13.235 (`EXTRA="--set rpc-hash.buckets=2048"`; probes
    /// per lookup from the sim run's `slots_probed_per_lookup`):
    /// (405.4 - 182.3) / (13.235 - 2.527) = 20.8 per slot, 182.3 - 2.527 x
    /// 20.8 = 129.7 base.
    pub const FIND_BASE: u64 = 130;
    pub const FIND_PER_SLOT: u64 = 21;
    /// `get_into`'s own (hashing, the stripe lock, the lookup counter,
    /// copying the value out): 107.0 per GET.
    pub const GET: u64 = 107;
    /// `put`'s own, `find` apart (the stripe lock, the block's allocation
    /// and write, the slot's store, the old block's free): 352.9 per
    /// operation on ycsb-a (`scripts/instructions-per-op.sh rpc-hash
    /// ycsb-a`), 705.8 per update, less its `find`'s 196.6: 509.
    /// An insert of a new key adds [`INSERT_EXTRA`]; a delete is
    /// [`DELETE`] instead.
    pub const PUT: u64 = 509;
    /// Inserts and deletes measured apart (branch i55): `DMKV=/tmp/keep/dmkv-head14
    /// KINDS="update insert delete" scripts/instructions-per-kind.sh
    /// rpc-hash` (main's binary 751ec1c; 50,000 keys, 1 thread x 8 tasks),
    /// differenced inclusive counts per operation: `put` 863.9 per insert
    /// (732.3 per update) with `find` 199.2 (213.3): its own 664.7 per
    /// insert against 519.0 per update, 145.7 more (the free slot's
    /// search, the key count); rounded to the update's 509 + 156.
    pub const INSERT_EXTRA: u64 = 156;
    /// A delete's own, `find` apart (the stripe lock, the slot's clear,
    /// the block's free): `delete` 411.5 per delete less its `find`'s
    /// 210.8.
    pub const DELETE: u64 = 201;
}
/// KV blocks start here so that no slot packs to 0.
const KV_START: u64 = 64;

/// The largest value stored.
pub const MAX_VALUE_LEN: usize = 4096;
/// Smallest and largest KV block classes (key + value, rounded up).
const MIN_CLASS: u64 = 16;
const MAX_CLASS: u64 = 8192;

/// A packed slot: `kv / 8` in bits 0..37, value length in bits 37..50,
/// fingerprint in bits 50..64. A slot is never 0 when used because KV blocks
/// never start at offset 0.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot(pub u64);

const KV_BITS: u32 = 37;
const LEN_BITS: u32 = 13;
const FP_BITS: u32 = 14;
const _: () = assert!(KV_BITS + LEN_BITS + FP_BITS == 64);
const _: () = assert!(MAX_VALUE_LEN < 1 << LEN_BITS);

impl Slot {
    pub const EMPTY: Slot = Slot(0);

    pub fn new(fp: u16, len: usize, kv: u64) -> Slot {
        debug_assert!(kv.is_multiple_of(8) && kv / 8 < 1 << KV_BITS);
        debug_assert!(len < 1 << LEN_BITS && u64::from(fp) < 1 << FP_BITS);
        Slot((kv / 8) | ((len as u64) << KV_BITS) | (u64::from(fp) << (KV_BITS + LEN_BITS)))
    }
    pub fn kv(self) -> u64 {
        (self.0 & ((1 << KV_BITS) - 1)) * 8
    }
    pub fn len(self) -> usize {
        ((self.0 >> KV_BITS) & ((1 << LEN_BITS) - 1)) as usize
    }
    pub fn fp(self) -> u16 {
        (self.0 >> (KV_BITS + LEN_BITS)) as u16
    }
    pub fn is_empty(self) -> bool {
        self.0 == 0
    }
}

/// The memory node's hash function (a 64-bit finaliser, as the C++ baselines
/// use CityHash/murmur finalisers). Its cost is part of what the baseline
/// shows: the memory node hashes every request.
pub fn hash64(key: u64) -> u64 {
    let mut x = key ^ 0x51AF_D7ED_558C_CD1F;
    x = (x ^ (x >> 33)).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x = (x ^ (x >> 33)).wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

/// 14-bit fingerprint from the top bits of the hash.
pub fn fingerprint(h: u64) -> u16 {
    (h >> (64 - FP_BITS)) as u16
}

/// Sizes of the table, from the expected key count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableConfig {
    pub main_buckets: u64,
    pub indirect_buckets: u64,
    pub kv_bytes: u64,
}

impl TableConfig {
    /// Main buckets for `keys` at about 75% slot occupancy, indirect buckets
    /// for half as many again, and room for the values twice over.
    pub fn for_keys(keys: u64, value_size: u64) -> TableConfig {
        let main_buckets = (keys * 4 / (SLOTS_PER_BUCKET * 3))
            .max(64)
            .next_power_of_two();
        let block = (8 + value_size.max(8)).max(MIN_CLASS).next_power_of_two();
        TableConfig {
            main_buckets,
            indirect_buckets: main_buckets / 2 + 64,
            kv_bytes: (keys * block * 2).max(1 << 20) + (1 << 20),
        }
    }

    pub fn bucket_region_bytes(&self) -> u64 {
        (self.main_buckets + self.indirect_buckets) * BUCKET_BYTES
    }

    pub fn kv_region_bytes(&self) -> u64 {
        KV_START + self.kv_bytes
    }
}

/// Work done by the memory node, for `engine_stats`.
#[derive(Default)]
pub struct TableCounters {
    pub lookups: AtomicU64,
    /// Buckets visited by lookups (main and indirect).
    pub buckets_visited: AtomicU64,
    /// Slots whose fingerprint was compared by lookups.
    pub slots_probed: AtomicU64,
    /// KV blocks whose key was compared by lookups (fingerprint matches).
    pub keys_compared: AtomicU64,
    pub keys: AtomicU64,
    pub indirect_allocated: AtomicU64,
}

/// Why a write could not be applied.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TableError {
    Exhausted(String),
}

impl From<AllocError> for TableError {
    fn from(e: AllocError) -> TableError {
        TableError::Exhausted(e.to_string())
    }
}

/// Where a key was found.
struct Found<'a> {
    slot_at: u64,
    slot: Slot,
    /// A lookup's KV block, borrowed in place: the key word, then the
    /// value's words (padded to 8 bytes); empty for writers.
    block: &'a [AtomicU64],
}

/// The table on one memory node.
pub struct ClusterTable {
    mem: Arc<RegionMem>,
    kv_mem: Arc<RegionMem>,
    main_buckets: u64,
    indirect: SlabAllocator,
    kv: SizeClassAllocator,
    locks: Vec<Mutex<()>>,
    pub counters: TableCounters,
}

impl ClusterTable {
    /// A table over `buckets` (at least `cfg.bucket_region_bytes()`) and
    /// `kv` (at least `cfg.kv_region_bytes()`).
    pub fn new(buckets: &Region, kv: &Region, cfg: TableConfig) -> ClusterTable {
        let main_end = cfg.main_buckets * BUCKET_BYTES;
        let indirect = SlabAllocator::new(
            "rpc-hash indirect buckets",
            buckets,
            BUCKET_BYTES,
            main_end,
            buckets.len(),
        );
        let kv_alloc = SizeClassAllocator::new(
            "rpc-hash KV blocks",
            kv,
            KV_START,
            kv.len(),
            MIN_CLASS,
            MAX_CLASS,
        );
        ClusterTable {
            mem: buckets.mem.clone(),
            kv_mem: kv.mem.clone(),
            main_buckets: cfg.main_buckets,
            indirect,
            kv: kv_alloc,
            locks: (0..LOCK_STRIPES).map(|_| Mutex::new(())).collect(),
            counters: TableCounters::default(),
        }
    }

    fn load(&self, off: u64) -> u64 {
        self.mem
            .load_u64(off)
            .expect("table offsets are inside the region")
    }
    fn store(&self, off: u64, v: u64) {
        self.mem
            .store_u64(off, v)
            .expect("table offsets are inside the region")
    }

    fn main_bucket(&self, h: u64) -> u64 {
        h & (self.main_buckets - 1)
    }

    /// Finds `key` in the chain of bucket `b`. Caller holds the stripe.
    ///
    /// Each bucket is read in place, its whole line borrowed with one
    /// [`RegionMem::words_in`] (one bounds check, one `sim` access of the
    /// line, as Outback's GET reads its bucket), then its seven slots and
    /// link word loaded from it. A `lookup` (a GET) is counted (the
    /// counters get the same totals as one bump per bucket, slot and key
    /// compared would give, added once at the end) and borrows each
    /// candidate's whole KV block in one access, key and value words
    /// together ([`Found::block`]); writers compare the key word alone.
    ///
    /// The `sim` touches are reported here, not by `words_in`: whether
    /// touches count is read once per walk ([`RegionMem::touches_counted`];
    /// nothing in the walk can switch `sim` metering on or off), and each
    /// span is then touched in the same order `words_in` would touch it,
    /// so `sim` is charged as before; off `sim` the walk makes no call
    /// into the touch path (`sim::touch` is out of line: two calls per GET).
    fn find(&self, b: u64, key: u64, fp: u16, lookup: bool) -> Option<Found<'_>> {
        let mut bucket = b * BUCKET_BYTES;
        let (mut visited, mut probed, mut compared) = (0u64, 0u64, 0u64);
        let counted = RegionMem::touches_counted();
        let found = 'chain: loop {
            let words = self
                .mem
                .words_in_untouched(bucket, BUCKET_BYTES as usize)
                .expect("buckets are inside the region");
            if counted {
                self.mem.touch_span(bucket, BUCKET_BYTES);
            }
            visited += 1;
            for (i, word) in words[..SLOTS_PER_BUCKET as usize].iter().enumerate() {
                let slot = Slot(word.load(Ordering::Acquire));
                probed += 1;
                if slot.is_empty() || slot.fp() != fp {
                    continue;
                }
                compared += 1;
                let slot_at = bucket + i as u64 * 8;
                if lookup {
                    let block_len = 8 + slot.len().next_multiple_of(8);
                    let block = self
                        .kv_mem
                        .words_in_untouched(slot.kv(), block_len)
                        .expect("KV blocks are inside the region");
                    if counted {
                        self.kv_mem.touch_span(slot.kv(), block_len as u64);
                    }
                    if block[0].load(Ordering::Acquire) == key {
                        break 'chain Some(Found {
                            slot_at,
                            slot,
                            block,
                        });
                    }
                } else if self
                    .kv_mem
                    .load_u64(slot.kv())
                    .expect("KV blocks are inside the region")
                    == key
                {
                    break 'chain Some(Found {
                        slot_at,
                        slot,
                        block: &[],
                    });
                }
            }
            match words[(LINK_OFFSET / 8) as usize].load(Ordering::Acquire) {
                0 => break None,
                next => bucket = next,
            }
        };
        dmkv_transport::sim::work(cost::FIND_BASE + cost::FIND_PER_SLOT * probed);
        if lookup {
            let c = &self.counters;
            c.buckets_visited.fetch_add(visited, Ordering::Relaxed);
            c.slots_probed.fetch_add(probed, Ordering::Relaxed);
            if compared > 0 {
                c.keys_compared.fetch_add(compared, Ordering::Relaxed);
            }
        }
        found
    }

    /// A free slot in the chain of bucket `b`, linking a new indirect bucket
    /// if every slot is used. Caller holds the stripe.
    fn free_slot(&self, b: u64) -> Result<u64, TableError> {
        let mut bucket = b * BUCKET_BYTES;
        loop {
            for i in 0..SLOTS_PER_BUCKET {
                if self.load(bucket + i * 8) == 0 {
                    return Ok(bucket + i * 8);
                }
            }
            match self.load(bucket + LINK_OFFSET) {
                0 => {
                    let new = self.indirect.alloc()?;
                    for w in 0..BUCKET_BYTES / 8 {
                        self.store(new + w * 8, 0);
                    }
                    self.store(bucket + LINK_OFFSET, new);
                    self.counters
                        .indirect_allocated
                        .fetch_add(1, Ordering::Relaxed);
                    return Ok(new);
                }
                next => bucket = next,
            }
        }
    }

    /// Appends the value held in `block` (a lookup's [`Found::block`]: the
    /// key word, then the value's words) to `out`: its words in increasing
    /// address order, as [`RegionMem::read`] would copy them, cut to `len`.
    fn append_value(block: &[AtomicU64], len: usize, out: &mut Vec<u8>) {
        let at = out.len();
        out.reserve(len.next_multiple_of(8));
        for w in &block[1..] {
            out.extend_from_slice(&w.load(Ordering::Acquire).to_le_bytes());
        }
        out.truncate(at + len);
    }

    fn write_block(&self, key: u64, value: &[u8]) -> Result<u64, TableError> {
        let off = self.kv.alloc(8 + value.len() as u64)?;
        self.kv_mem
            .store_u64(off, key)
            .expect("KV blocks are inside the region");
        self.kv_mem
            .write(off + 8, value)
            .expect("KV blocks are inside the region");
        Ok(off)
    }

    fn free_block(&self, slot: Slot) {
        self.kv
            .free(slot.kv(), 8 + slot.len() as u64)
            .expect("a block this table allocated");
    }

    pub fn get(&self, key: u64) -> Option<Vec<u8>> {
        let mut v = Vec::new();
        self.get_into(key, &mut v).then_some(v)
    }

    /// [`get`](Self::get) appending the value to `out` (the handler reads it
    /// straight into its reply); returns whether the key was found.
    pub fn get_into(&self, key: u64, out: &mut Vec<u8>) -> bool {
        let h = hash64(key);
        let b = self.main_bucket(h);
        let _g = self.locks[b as usize % LOCK_STRIPES].lock();
        dmkv_transport::sim::work(cost::GET);
        self.counters.lookups.fetch_add(1, Ordering::Relaxed);
        match self.find(b, key, fingerprint(h), true) {
            Some(f) => {
                Self::append_value(f.block, f.slot.len(), out);
                true
            }
            None => false,
        }
    }

    /// Inserts or replaces as `mode` says; returns whether the key existed
    /// before. Nothing changes when `mode` refuses.
    pub fn put(&self, key: u64, value: &[u8], mode: PutMode) -> Result<bool, TableError> {
        assert!(value.len() <= MAX_VALUE_LEN, "checked by the handler");
        let h = hash64(key);
        let fp = fingerprint(h);
        let b = self.main_bucket(h);
        let _g = self.locks[b as usize % LOCK_STRIPES].lock();
        dmkv_transport::sim::work(cost::PUT);
        match self.find(b, key, fp, false) {
            Some(found) => {
                if mode == PutMode::Insert {
                    return Ok(true);
                }
                let kv = self.write_block(key, value)?;
                self.store(found.slot_at, Slot::new(fp, value.len(), kv).0);
                self.free_block(found.slot);
                Ok(true)
            }
            None => {
                if mode == PutMode::Update {
                    return Ok(false);
                }
                dmkv_transport::sim::work(cost::INSERT_EXTRA);
                // Allocate the block first so a failure leaves nothing.
                let kv = self.write_block(key, value)?;
                let at = match self.free_slot(b) {
                    Ok(at) => at,
                    Err(e) => {
                        self.kv
                            .free(kv, 8 + value.len() as u64)
                            .expect("just allocated");
                        return Err(e);
                    }
                };
                self.store(at, Slot::new(fp, value.len(), kv).0);
                self.counters.keys.fetch_add(1, Ordering::Relaxed);
                Ok(false)
            }
        }
    }

    pub fn delete(&self, key: u64) -> bool {
        let h = hash64(key);
        let b = self.main_bucket(h);
        let _g = self.locks[b as usize % LOCK_STRIPES].lock();
        dmkv_transport::sim::work(cost::DELETE);
        match self.find(b, key, fingerprint(h), false) {
            Some(found) => {
                self.store(found.slot_at, 0);
                self.free_block(found.slot);
                self.counters.keys.fetch_sub(1, Ordering::Relaxed);
                true
            }
            None => false,
        }
    }

    /// Chain lengths in buckets (1 = the main bucket only): (mean, max).
    pub fn chain_lengths(&self) -> (f64, u64) {
        let mut total = 0;
        let mut max = 0;
        for b in 0..self.main_buckets {
            let _g = self.locks[b as usize % LOCK_STRIPES].lock();
            let mut len = 1;
            let mut bucket = b * BUCKET_BYTES;
            while let next @ 1.. = self.load(bucket + LINK_OFFSET) {
                len += 1;
                bucket = next;
            }
            total += len;
            max = max.max(len);
        }
        (total as f64 / self.main_buckets as f64, max)
    }

    pub fn main_buckets(&self) -> u64 {
        self.main_buckets
    }

    /// Slots in main and allocated indirect buckets.
    pub fn slots(&self) -> u64 {
        (self.main_buckets + self.counters.indirect_allocated.load(Ordering::Relaxed))
            * SLOTS_PER_BUCKET
    }
}

/// What a put may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PutMode {
    /// Only if the key is missing.
    Insert,
    /// Only if the key exists.
    Update,
    /// Either.
    Upsert,
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_memnode::NodeRuntime;
    use dmkv_transport::local::{LocalCluster, LocalConfig};
    use std::collections::HashMap;

    fn table(rt: &NodeRuntime, cfg: TableConfig) -> ClusterTable {
        let b = rt
            .register_region("b", cfg.bucket_region_bytes() as usize)
            .unwrap();
        let kv = rt
            .register_region("kv", cfg.kv_region_bytes() as usize)
            .unwrap();
        ClusterTable::new(&b, &kv, cfg)
    }

    #[test]
    fn slot_fields_round_trip() {
        let s = Slot::new((1 << FP_BITS) - 1, MAX_VALUE_LEN, ((1 << KV_BITS) - 1) * 8);
        assert_eq!(s.fp(), (1 << FP_BITS) - 1);
        assert_eq!(s.len(), MAX_VALUE_LEN);
        assert_eq!(s.kv(), ((1 << KV_BITS) - 1) * 8);
        let t = Slot::new(3, 0, 64);
        assert_eq!((t.fp(), t.len(), t.kv()), (3, 0, 64));
        assert!(!t.is_empty());
    }

    /// Few buckets force long chains; the table must still behave like a map.
    #[test]
    fn chains_grow_and_behave_like_a_map() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = TableConfig {
            main_buckets: 4,
            indirect_buckets: 400,
            kv_bytes: 1 << 20,
        };
        let t = table(&rt, cfg);
        let mut model = HashMap::new();
        for k in 0..1000u64 {
            let v = vec![k as u8; (k % 20) as usize];
            assert!(!t.put(k, &v, PutMode::Insert).unwrap());
            model.insert(k, v);
        }
        assert!(t.put(5, b"x", PutMode::Insert).unwrap(), "exists");
        assert!(!t.put(5000, b"x", PutMode::Update).unwrap(), "missing");
        for k in (0..1000u64).step_by(3) {
            assert!(t.delete(k));
            model.remove(&k);
        }
        for k in (1..1000u64).step_by(3) {
            t.put(k, b"updated", PutMode::Upsert).unwrap();
            model.insert(k, b"updated".to_vec());
        }
        for k in 0..1100u64 {
            assert_eq!(t.get(k), model.get(&k).cloned(), "key {k}");
        }
        let (mean, max) = t.chain_lengths();
        assert!(mean > 10.0 && max >= mean as u64, "{mean} {max}");
        assert_eq!(t.counters.keys.load(Ordering::Relaxed), model.len() as u64);
    }

    /// The lookup reads its buckets and the found block in place: same
    /// values as the word-by-word reads (every value length up to a word
    /// past a few lines, long chains, misses), and the lookup counters get
    /// exactly what one bump per bucket, slot and key compared gives
    /// (counted here by a reference walk with `load_u64`).
    #[test]
    fn in_place_lookups_answer_and_count_as_word_reads() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = TableConfig {
            main_buckets: 8,
            indirect_buckets: 400,
            kv_bytes: 1 << 20,
        };
        let t = table(&rt, cfg);
        let value = |k: u64| -> Vec<u8> {
            (0..(k % 203) as usize)
                .map(|i| (i as u64 ^ k) as u8)
                .collect()
        };
        for k in 0..700u64 {
            t.put(k, &value(k), PutMode::Insert).unwrap();
        }
        t.put(
            MAX_VALUE_LEN as u64,
            &vec![9; MAX_VALUE_LEN],
            PutMode::Upsert,
        )
        .unwrap();
        // The reference walk: the old code's reads and bumps.
        let reference = |key: u64| -> (Option<Vec<u8>>, [u64; 3]) {
            let h = hash64(key);
            let mut bucket = t.main_bucket(h) * BUCKET_BYTES;
            let mut n = [0u64; 3];
            loop {
                n[0] += 1;
                for i in 0..SLOTS_PER_BUCKET {
                    let slot = Slot(t.load(bucket + i * 8));
                    n[1] += 1;
                    if slot.is_empty() || slot.fp() != fingerprint(h) {
                        continue;
                    }
                    n[2] += 1;
                    if t.kv_mem.load_u64(slot.kv()).unwrap() == key {
                        let mut v = vec![0; slot.len()];
                        t.kv_mem.read(slot.kv() + 8, &mut v).unwrap();
                        return (Some(v), n);
                    }
                }
                match t.load(bucket + LINK_OFFSET) {
                    0 => return (None, n),
                    next => bucket = next,
                }
            }
        };
        let counts = || {
            let c = &t.counters;
            [
                c.buckets_visited.load(Ordering::Relaxed),
                c.slots_probed.load(Ordering::Relaxed),
                c.keys_compared.load(Ordering::Relaxed),
            ]
        };
        let mut compared = 0;
        for k in (0..800u64).chain([MAX_VALUE_LEN as u64]) {
            let (want, n) = reference(k);
            let before = counts();
            let got = t.get(k);
            let after = counts();
            assert_eq!(got, want, "key {k}");
            if k < 700 {
                assert_eq!(got, Some(value(k)), "key {k}");
            }
            let delta = [
                after[0] - before[0],
                after[1] - before[1],
                after[2] - before[2],
            ];
            assert_eq!(delta, n, "key {k}: counters");
            compared += n[2];
        }
        assert!(compared > 700, "{compared}");
        assert_eq!(t.get(MAX_VALUE_LEN as u64), Some(vec![9; MAX_VALUE_LEN]));
    }

    #[test]
    fn a_full_table_says_so_and_keeps_its_contents() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = TableConfig {
            main_buckets: 2,
            indirect_buckets: 2,
            kv_bytes: 1 << 16,
        };
        let t = table(&rt, cfg);
        let mut stored = Vec::new();
        let err = loop {
            let k = stored.len() as u64;
            match t.put(k, &k.to_le_bytes(), PutMode::Insert) {
                Ok(false) => stored.push(k),
                Ok(true) => unreachable!("distinct keys"),
                Err(e) => break e,
            }
        };
        assert!(matches!(err, TableError::Exhausted(_)));
        assert!(stored.len() >= 14);
        for k in stored {
            assert_eq!(t.get(k), Some(k.to_le_bytes().to_vec()));
        }
    }
}
