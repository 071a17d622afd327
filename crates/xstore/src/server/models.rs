//! The model region of one memory node: generations of XMODEL and their
//! translation tables, published so that clients read them one-sided.
//!
//! A [`Generation`] is one full training: a top model, the key interval of
//! each of its M sub-models, a table of M records and one TT block per
//! sub-model. Sub-models are republished one at a time by retraining; a
//! whole new generation is built beside the committed one (model expansion)
//! and committed by rewriting the header. The memory node keeps a mirror of
//! what it published (clients get it in fallback replies) and, per
//! generation, which sub-models each leaf appears in (so that a split
//! queues exactly the sub-models it made stale).
//!
//! Write protocols (docs/xstore.md, invariants 2-4):
//! - a TT block is written in full before the record naming its tag is
//!   written, and is immutable while that record is published; a block is
//!   freed only after the record stops naming it, and a reused block is
//!   written tail first, then lines from last to first, entries before the
//!   line's tag;
//! - records and the header are rewritten in place and checksummed;
//! - tags are unique for the region's lifetime.

use crate::layout::{
    ARENA_START, HEADER_OFFSET, MAX_TT_LEN, ModelHeader, RECORD_BYTES, SubRecord, TopModel, TtBlock,
};
use crate::model::TrainedSub;
use dmkv_memnode::{NodeRuntime, Region, SizeClassAllocator};
use parking_lot::{Mutex, RwLock};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};

/// An allocation in the model region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub offset: u64,
    pub bytes: u64,
}

/// One published sub-model, as the memory node remembers it.
#[derive(Debug, Clone)]
pub struct Published {
    pub record: SubRecord,
    /// Packed TT entries (what the block holds).
    pub entries: Vec<u64>,
    pub block: Option<Block>,
    pub trained_keys: u64,
    pub mean_abs_err: f64,
}

/// The order of one sub-model's retrainings: each read of its leaves takes
/// the next number, and a publication goes ahead only if no later read was
/// published before it (two jobs of one sub-model may overlap while their
/// CPU passes; the later read is the fresher picture).
#[derive(Debug, Default)]
pub struct RetrainOrder {
    /// Reads taken so far.
    reads: u64,
    /// The read number of the retraining published last (0: none).
    published: u64,
}

impl RetrainOrder {
    /// A new read of the sub-model's leaves: its number.
    pub fn next_read(&mut self) -> u64 {
        self.reads += 1;
        self.reads
    }

    /// Whether the retraining that made read `read` may publish (no later
    /// read was published); if so, records it as the last published.
    pub fn claim(&mut self, read: u64) -> bool {
        if read <= self.published {
            return false;
        }
        self.published = read;
        true
    }
}

/// `leaf_subs` value for a leaf in no TT of the generation.
const NO_SUBS: u64 = u64::MAX;

/// One generation of XMODEL.
pub struct Generation {
    pub header: ModelHeader,
    /// `first[i]`: first key of sub-model `i`'s interval; `first[M]` is the
    /// partition's end (+1).
    pub first: Vec<u128>,
    pub subs: Vec<RwLock<Arc<Published>>>,
    /// Serialises the leaf reads and the publications of one sub-model's
    /// retrainings, and orders them (a retraining reads, lets its CPU pass
    /// with no lock held, then publishes: docs/xstore.md, invariant 9).
    pub locks: Vec<Mutex<RetrainOrder>>,
    /// A retraining job for the sub-model is queued and not yet started.
    pub queued: Vec<AtomicBool>,
    /// Per leaf (node number): the sub-models whose TT names it, as an
    /// inclusive range `first << 32 | last` (contiguous: intervals and leaf
    /// ranges both tile the key space). It only grows within a generation,
    /// so it over-approximates after splits, which costs a spare retrain.
    leaf_subs: Vec<AtomicU64>,
    table: Block,
}

impl Generation {
    pub fn generation(&self) -> u32 {
        self.header.generation
    }

    pub fn submodels(&self) -> u32 {
        self.header.submodels
    }

    /// Sub-model `i`'s interval `[a, b]`, or `None` if no key routes to it.
    pub fn interval(&self, i: u32) -> Option<(u64, u64)> {
        let (a, b) = (self.first[i as usize], self.first[i as usize + 1]);
        (a < b).then(|| (a as u64, (b - 1) as u64))
    }

    pub fn sub(&self, i: u32) -> Arc<Published> {
        self.subs[i as usize].read().clone()
    }

    /// The sub-models whose TT names `leaf`.
    pub fn subs_of_leaf(&self, leaf: u32) -> Option<(u32, u32)> {
        let w = self.leaf_subs.get(leaf as usize)?.load(Ordering::Acquire);
        (w != NO_SUBS).then_some(((w >> 32) as u32, w as u32))
    }

    fn note_leaves(&self, i: u32, entries: &[u64]) {
        for &e in entries {
            let leaf = crate::layout::TtEntry::unpack(e).leaf as usize;
            let Some(slot) = self.leaf_subs.get(leaf) else {
                continue;
            };
            let _ = slot.fetch_update(Ordering::AcqRel, Ordering::Acquire, |w| {
                Some(if w == NO_SUBS {
                    (i as u64) << 32 | i as u64
                } else {
                    let (a, b) = ((w >> 32) as u32, w as u32);
                    (a.min(i) as u64) << 32 | b.max(i) as u64
                })
            });
        }
    }
}

/// Why a publication did not happen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PublishError {
    /// The region has no room (more generations or TTs than it was sized
    /// for); the previous model stays published and clients fall back.
    Full(String),
    /// The generation is no longer the committed one.
    Superseded,
    /// The sub-model spans more leaves than a TT can name.
    TooLarge(usize),
}

/// The model region of one memory node and what is published in it.
pub struct ModelStore {
    region: Region,
    alloc: SizeClassAllocator,
    slots: u32,
    lo: u64,
    hi: u64,
    leaf_capacity: usize,
    next_tag: AtomicU64,
    current: RwLock<Arc<Generation>>,
    /// `current`'s sub-model count, stored with it under its write lock:
    /// read on every write (the expansion check) without the lock and the
    /// `Arc`'s two reference-count updates.
    submodels: AtomicU32,
    /// Publications into the committed generation hold it shared; a commit
    /// holds it exclusively, so nothing is published into a generation
    /// whose blocks are being freed.
    commit_lock: RwLock<()>,
    /// Bytes of blocks that could not be allocated, for stats.
    pub full_events: AtomicU64,
}

/// Largest block class: TT blocks and tables up to this.
const MAX_CLASS: u64 = 1 << 34;

impl ModelStore {
    /// Registers the region `name` of `bytes` on `rt` and publishes an
    /// initial generation `first_gen` built by `build` (its records are
    /// published into it before the header is written).
    #[allow(clippy::too_many_arguments)]
    pub fn create(
        rt: &NodeRuntime,
        name: &str,
        bytes: u64,
        slots: u32,
        lo: u64,
        hi: u64,
        leaf_capacity: usize,
    ) -> Result<ModelStore, String> {
        let len = usize::try_from(bytes.max(1 << 16)).map_err(|_| "model region too large")?;
        let region = rt
            .register_region(name, len)
            .map_err(|e| format!("region {name}: {e}"))?;
        let alloc = SizeClassAllocator::new(
            name,
            &region,
            ARENA_START,
            region.len(),
            128,
            MAX_CLASS.min((region.len()).next_power_of_two()),
        );
        let placeholder = Arc::new(Generation {
            header: ModelHeader {
                generation: 0,
                submodels: 1,
                slots,
                table_offset: 0,
                top: TopModel {
                    slope: 0.0,
                    intercept: 0.0,
                },
                lo,
                hi,
                trained_keys: 0,
            },
            first: vec![lo as u128, hi as u128 + 1],
            subs: Vec::new(),
            locks: Vec::new(),
            queued: Vec::new(),
            leaf_subs: Vec::new(),
            table: Block {
                offset: 0,
                bytes: 0,
            },
        });
        Ok(ModelStore {
            region,
            alloc,
            slots,
            lo,
            hi,
            leaf_capacity,
            next_tag: AtomicU64::new(1),
            submodels: AtomicU32::new(placeholder.submodels()),
            current: RwLock::new(placeholder),
            commit_lock: RwLock::new(()),
            full_events: AtomicU64::new(0),
        })
    }

    pub fn region(&self) -> &Region {
        &self.region
    }

    pub fn current(&self) -> Arc<Generation> {
        self.current.read().clone()
    }

    /// The committed generation's sub-model count
    /// (`current().submodels()`).
    pub fn committed_submodels(&self) -> u32 {
        self.submodels.load(Ordering::Relaxed)
    }

    pub fn partition(&self) -> (u64, u64) {
        (self.lo, self.hi)
    }

    /// Bytes in use in the arena (tables and TT blocks).
    pub fn bytes_in_use(&self) -> u64 {
        self.alloc.live_bytes()
    }

    fn alloc(&self, bytes: u64, what: &str) -> Result<Block, PublishError> {
        match self.alloc.alloc(bytes) {
            Ok(offset) => Ok(Block { offset, bytes }),
            Err(e) => {
                self.full_events.fetch_add(1, Ordering::Relaxed);
                Err(PublishError::Full(format!("model region: {what}: {e}")))
            }
        }
    }

    fn free(&self, b: Block) {
        let r = self.alloc.free(b.offset, b.bytes);
        debug_assert!(r.is_ok(), "freeing a model block: {r:?}");
    }

    /// A new, uncommitted generation: its table is allocated, its records
    /// not yet written. `first` comes from [`crate::model::interval_starts`].
    pub fn new_generation(
        &self,
        generation: u32,
        top: TopModel,
        first: Vec<u128>,
        trained_keys: u64,
    ) -> Result<Generation, PublishError> {
        let m = (first.len() - 1) as u32;
        let table = self.alloc(m as u64 * RECORD_BYTES as u64, "record table")?;
        let empty = Arc::new(Published {
            record: SubRecord {
                generation,
                index: 0,
                tag: 0,
                slope: 0.0,
                intercept: 0.0,
                base: 0,
                min_err: 0,
                max_err: 0,
                tt_offset: 0,
                tt_len: 0,
            },
            entries: Vec::new(),
            block: None,
            trained_keys: 0,
            mean_abs_err: 0.0,
        });
        Ok(Generation {
            header: ModelHeader {
                generation,
                submodels: m,
                slots: self.slots,
                table_offset: table.offset,
                top,
                lo: self.lo,
                hi: self.hi,
                trained_keys,
            },
            first,
            subs: (0..m).map(|_| RwLock::new(empty.clone())).collect(),
            locks: (0..m)
                .map(|_| Mutex::new(RetrainOrder::default()))
                .collect(),
            queued: (0..m).map(|_| AtomicBool::new(false)).collect(),
            leaf_subs: (0..self.leaf_capacity)
                .map(|_| AtomicU64::new(NO_SUBS))
                .collect(),
            table,
        })
    }

    /// Publishes sub-model `i` of `generation`: writes its TT block and then
    /// its record, swaps the mirror, frees the previous block. With
    /// `committed`, refuses (and changes nothing) unless `generation` is the
    /// committed one; without, the caller is building `generation`.
    pub fn publish(
        &self,
        generation: &Generation,
        i: u32,
        trained: TrainedSub,
        committed: bool,
    ) -> Result<(), PublishError> {
        if trained.entries.len() > MAX_TT_LEN as usize {
            return Err(PublishError::TooLarge(trained.entries.len()));
        }
        dmkv_transport::sim::work(crate::model::cost::PUBLISH);
        let _shared = self.commit_lock.read();
        if committed && !std::ptr::eq(Arc::as_ptr(&self.current.read()), generation) {
            return Err(PublishError::Superseded);
        }
        let tag = self.next_tag.fetch_add(1, Ordering::Relaxed);
        let mem = &self.region.mem;
        let block = if trained.entries.is_empty() {
            None
        } else {
            let bytes = TtBlock::encode(tag, &trained.entries);
            let b = self.alloc(bytes.len() as u64, "translation table")?;
            write_tt_block(mem, b.offset, &bytes);
            Some(b)
        };
        let record = SubRecord {
            generation: generation.generation(),
            index: i,
            tag,
            slope: trained.slope,
            intercept: trained.intercept,
            base: trained.base,
            min_err: trained.min_err,
            max_err: trained.max_err,
            tt_offset: block.map_or(0, |b| b.offset),
            tt_len: trained.entries.len() as u32,
        };
        mem.write(generation.header.record_offset(i), &record.encode())
            .expect("records lie inside the table");
        generation.note_leaves(i, &trained.entries);
        let new = Arc::new(Published {
            record,
            entries: trained.entries,
            block,
            trained_keys: trained.keys,
            mean_abs_err: trained.mean_abs_err,
        });
        let old = std::mem::replace(&mut *generation.subs[i as usize].write(), new);
        if let Some(b) = old.block {
            self.free(b);
        }
        Ok(())
    }

    /// Makes `generation` (every sub-model published) the committed one:
    /// writes its header, then frees the previous generation's table and
    /// blocks. Clients still holding the old generation keep using their
    /// copies; one-sided reads of freed blocks fail their tags or
    /// checksums.
    pub fn commit(&self, generation: Arc<Generation>) {
        let _excl = self.commit_lock.write();
        self.region
            .mem
            .write(HEADER_OFFSET, &generation.header.encode())
            .expect("the header lies inside the region");
        let old = {
            let mut current = self.current.write();
            self.submodels
                .store(generation.submodels(), Ordering::Relaxed);
            std::mem::replace(&mut *current, generation)
        };
        for s in &old.subs {
            if let Some(b) = s.read().block {
                self.free(b);
            }
        }
        if old.table.bytes > 0 {
            self.free(old.table);
        }
    }

    /// Frees an uncommitted generation that will never be committed.
    pub fn discard(&self, generation: Generation) {
        for s in &generation.subs {
            if let Some(b) = s.read().block {
                self.free(b);
            }
        }
        self.free(generation.table);
    }
}

/// Writes a TT block so that a reader holding an older tag of the same
/// bytes sees a foreign tag in anything it might have read torn: the tail
/// first, then lines from last to first, each line's entries before its
/// tag.
fn write_tt_block(mem: &dmkv_transport::RegionMem, offset: u64, bytes: &[u8]) {
    let lines = (bytes.len() - 8) / 64;
    let tail = lines * 64;
    mem.write(offset + tail as u64, &bytes[tail..])
        .expect("blocks lie inside the region");
    for l in (0..lines).rev() {
        let at = l * 64;
        mem.write(offset + at as u64 + 8, &bytes[at + 8..at + 64])
            .expect("blocks lie inside the region");
        mem.write(offset + at as u64, &bytes[at..at + 8])
            .expect("blocks lie inside the region");
    }
}
