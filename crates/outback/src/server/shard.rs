//! One shard on the memory node that serves it: its tables and directory,
//! heap and mirrors, and the data operations of paper §4.3.
//!
//! - GET reads the slot the client named and returns the KV block's front,
//!   the bucket's latest seed and the slot's cache bit (O(1): no hashing,
//!   no key comparison).
//! - MAKEUP GET searches the overflow cache, then the bucket's blocks.
//! - INSERT takes the bucket lock, computes the slot with the latest seed
//!   and resolves the three cases (empty slot; re-seed; overflow cache).
//! - UPDATE / DELETE verify the full key at the slot the client named (the
//!   fingerprint first), falling back to the slot under the latest seed and
//!   the overflow cache.
//!
//! Every change of the heap is forwarded to the mirrors before it is
//! applied locally and before the reply (invariant 9).

use crate::hash::{fingerprint, slot};
use crate::layout::{
    BLOCK_TAIL_WORDS, MAX_VALUE_LEN, SlotWord, block_words, ctl, encode_block, seq_offset,
};
use crate::ludo::{SLOTS, find_seed};
use crate::proto::{FLAG_BUFFERED, FLAG_CACHE, FLAG_PRE_RESIZE, ReplyHead, Status, Target};
use crate::publish::{TableDesc, ViewDesc};
use crate::server::ctx::NodeCtx;
use crate::server::heap::Heap;
use crate::server::replica::{MirrorOp, ReplicaSet};
use crate::server::session::{self, Check, Record, Session, Sessions};
use crate::server::table::{BucketGuard, Pend, ShardStats, Table, WriteOp, state};
use dmkv_memnode::Region;
use dmkv_transport::{ServiceError, WireWriter};
use parking_lot::{Mutex, RwLock};
use std::collections::HashSet;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, Ordering};

pub const REBUILD_NONE: u8 = 0;
pub const REBUILD_FULL: u8 = 1;
pub const REBUILD_SPLIT: u8 = 2;
use dmkv_transport::time::Instant;
use std::time::Duration;

/// Result of a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Inserted,
    Updated,
    Exists,
    NotFound,
    Deleted,
}

impl Outcome {
    pub fn status(self) -> Status {
        match self {
            Outcome::Inserted | Outcome::Updated | Outcome::Deleted => Status::Ok,
            Outcome::Exists => Status::Exists,
            Outcome::NotFound => Status::NotFound,
        }
    }
    /// The status an upsert reports: Ok if it inserted, Exists if it updated.
    pub fn upsert_status(self) -> Status {
        match self {
            Outcome::Updated => Status::Exists,
            o => o.status(),
        }
    }
}

/// Where a key is in its bucket.
#[derive(Debug, Clone, Copy)]
enum Loc {
    Slot(usize, SlotWord),
    Overflow(SlotWord),
}

/// The extendible-hashing directory (memory-node copy).
#[derive(Debug, Clone)]
pub struct Directory {
    pub global_depth: u8,
    pub entries: Vec<u32>,
}

impl Directory {
    pub fn route(&self, key: u64) -> u32 {
        let mask = (1u64 << self.global_depth) - 1;
        self.entries[(crate::hash::dir(key) & mask) as usize]
    }
}

#[derive(Default)]
struct Computes {
    registered: HashSet<u32>,
    next: u32,
    /// Compute nodes that have seen PRE_RESIZE since the current resize
    /// began.
    acks: HashSet<u32>,
}

/// Most compute nodes one shard tracks.
const MAX_COMPUTES: usize = 4096;

/// Shard identities for [`TABLE_SNAPSHOTS`].
static NEXT_SHARD_UID: AtomicU64 = AtomicU64::new(1);

/// Most shards' table lists one thread keeps a snapshot of (a thread
/// serving more shards than this takes a snapshot under the lock more
/// often; the oldest is dropped first).
const MAX_TABLE_SNAPSHOTS: usize = 16;

/// One shard's table list as this thread last copied it (invariant 20).
/// It holds the tables' `Arc`s: a table retired since stays allocated (with
/// its regions' memory) until the thread's next GET of that shard replaces
/// the copy, so a GET may read it after `retire`; the generation check
/// decides whether such a read counts.
struct TableSnapshot {
    shard: u64,
    /// The shard itself, to drop the snapshots of shards that are gone
    /// (checked only when a snapshot is added, not per GET).
    owner: std::sync::Weak<ShardServer>,
    generation: u64,
    /// Shared with the GETs using it (an `Rc`: its count is a plain
    /// increment, no locked operation), so a GET holds its copy outside
    /// the thread-local's closure and a refresh replaces it whole.
    tables: std::rc::Rc<Vec<Option<Arc<Table>>>>,
}

thread_local! {
    static TABLE_SNAPSHOTS: std::cell::RefCell<Vec<TableSnapshot>> =
        const { std::cell::RefCell::new(Vec::new()) };
    /// The snapshot this thread's last GET used (one shard's list at one
    /// generation, shared with that shard's entry in `TABLE_SNAPSHOTS`):
    /// moved out for a GET and back after it, so the common GET (the same
    /// shard at the same generation) takes no borrow of the list, searches
    /// nothing and changes no reference count. Empty after a GET that
    /// unwound (the next GET takes the list's path).
    static LATEST_SNAPSHOT: std::cell::Cell<Option<LatestSnapshot>> =
        const { std::cell::Cell::new(None) };
}

/// See `LATEST_SNAPSHOT`.
struct LatestSnapshot {
    shard: u64,
    generation: u64,
    tables: std::rc::Rc<Vec<Option<Arc<Table>>>>,
}

pub struct ShardServer {
    pub id: u16,
    pub ctx: Arc<NodeCtx>,
    pub heap: Heap,
    pub replicas: ReplicaSet,
    pub ctl: Region,
    pub(crate) tables: RwLock<Vec<Option<Arc<Table>>>>,
    /// The table list's generation: bumped under `tables`' write lock
    /// before every change of it (invariant 20). A GET reads the list
    /// from its handler thread's snapshot of that generation and checks
    /// the generation again after its reads.
    tables_gen: AtomicU64,
    /// This shard's identity for the handler threads' snapshots (unique in
    /// the process, never reused, unlike an address).
    uid: u64,
    pub(crate) dir: Mutex<Directory>,
    seq: AtomicU64,
    computes: Mutex<Computes>,
    /// A table is in PRE_RESIZE or being rebuilt: replies carry PRE_RESIZE.
    pub(crate) resize_pending: AtomicBool,
    /// Which rebuild is running: [`REBUILD_NONE`], [`REBUILD_FULL`] or
    /// [`REBUILD_SPLIT`] (for the figures of requests served meanwhile).
    pub(crate) rebuilding: AtomicU8,
    /// The last applied write of every session (invariant 16).
    pub(crate) sessions: Sessions,
    /// Bulk-loaded keys waiting for the next full build: (key, entry, seq).
    pub(crate) loaded: Mutex<Vec<(u64, SlotWord)>>,
    pub(crate) build_requested: AtomicU64,
    pub(crate) build_done: AtomicU64,
    /// The next full build was asked for by a bulk load (BUILD): it is
    /// paced under sim (docs/outback.md, "Resizes in virtual time"); a
    /// takeover's is not.
    pub(crate) pace_full: AtomicBool,
    /// Rebuilds completed (their buffered writes applied).
    pub(crate) applied: AtomicU64,
    pub(crate) job_active: AtomicBool,
    pub(crate) next_table: AtomicU32,
    publish_version: AtomicU64,
    /// Writes are accepted (mirrors resolved).
    pub ready: AtomicBool,
    /// The last rebuild failure, for `engine_stats`.
    pub(crate) last_error: Mutex<Option<String>>,
    /// Retired tables waiting for the countdown (`retire`).
    pub(crate) retiring: Mutex<crate::server::retire::Retiring>,
    pub stats: ShardStats,
}

/// The error a late duplicate of an old write gets (its session has
/// applied a later write since; the client no longer waits for it).
pub(crate) fn old_write(s: Session, last: u64) -> ServiceError {
    ServiceError::failed(format!(
        "outback: write {} of session {:#x} is older than its last applied write {last} \
         (a late duplicate); not applied",
        s.seq, s.id
    ))
}

/// The reply of a refused or redirected data request.
pub fn status_reply(status: Status) -> Vec<u8> {
    let mut w = WireWriter::with_capacity(3);
    ReplyHead::new(status).write(&mut w);
    w.finish()
}

impl ShardServer {
    pub fn new(
        id: u16,
        ctx: Arc<NodeCtx>,
        heap: Heap,
        ctl: Region,
        first_seq: u64,
        first_table: u32,
        sessions: Sessions,
    ) -> ShardServer {
        ShardServer {
            id,
            ctx,
            heap,
            replicas: ReplicaSet::default(),
            ctl,
            tables: RwLock::new(Vec::new()),
            tables_gen: AtomicU64::new(0),
            uid: NEXT_SHARD_UID.fetch_add(1, Ordering::Relaxed),
            dir: Mutex::new(Directory {
                global_depth: 0,
                entries: vec![],
            }),
            seq: AtomicU64::new(first_seq),
            computes: Mutex::new(Computes::default()),
            resize_pending: AtomicBool::new(false),
            rebuilding: AtomicU8::new(REBUILD_NONE),
            sessions,
            loaded: Mutex::new(Vec::new()),
            build_requested: AtomicU64::new(0),
            build_done: AtomicU64::new(0),
            pace_full: AtomicBool::new(false),
            applied: AtomicU64::new(0),
            job_active: AtomicBool::new(false),
            next_table: AtomicU32::new(first_table),
            publish_version: AtomicU64::new(0),
            ready: AtomicBool::new(false),
            last_error: Mutex::new(None),
            retiring: Mutex::new(Default::default()),
            stats: ShardStats::default(),
        }
    }

    // ------------------------------------------------------------ lookup

    pub fn live_tables(&self) -> Vec<Arc<Table>> {
        self.tables.read().iter().flatten().cloned().collect()
    }

    pub fn table(&self, id: u32) -> Option<Arc<Table>> {
        self.tables.read().get(id as usize).cloned().flatten()
    }

    pub(crate) fn install(&self, t: Arc<Table>) {
        let mut v = self.tables.write();
        self.bump_tables_gen();
        let i = t.id as usize;
        if v.len() <= i {
            v.resize(i + 1, None);
        }
        v[i] = Some(t);
    }

    pub(crate) fn retire(&self, id: u32) {
        let mut v = self.tables.write();
        self.bump_tables_gen();
        if let Some(slot) = v.get_mut(id as usize) {
            *slot = None;
        }
    }

    /// Invariant 20: called with `tables`' write lock held, before the list
    /// changes. The SeqCst read-modify-write orders the bump before
    /// everything this thread does after it (the change, and whatever
    /// follows `retire`: the full build's block frees, the hand-over of
    /// the regions to the countdown), so a GET whose reads saw any of that
    /// sees the new generation when it checks after them.
    fn bump_tables_gen(&self) {
        self.tables_gen.fetch_add(1, Ordering::SeqCst);
    }

    /// The table a request names, or the reply it gets instead: STALE for a
    /// retired table, an error for one that never existed.
    fn target(&self, t: &Target) -> Result<Result<Arc<Table>, Vec<u8>>, ServiceError> {
        self.count_request();
        let tables = self.tables.read();
        match tables.get(t.table as usize) {
            Some(Some(tb)) => {
                if t.bucket >= tb.buckets {
                    return Err(ServiceError::malformed(format!(
                        "outback: bucket {} out of range (table {} has {})",
                        t.bucket, t.table, tb.buckets
                    )));
                }
                Ok(Ok(tb.clone()))
            }
            Some(None) => Ok(Err(self.stale())),
            None if t.table < self.next_table.load(Ordering::Acquire) => Ok(Err(self.stale())),
            None => Err(ServiceError::malformed(format!(
                "outback: shard {} has no table {}",
                self.id, t.table
            ))),
        }
    }

    fn count_request(&self) {
        match self.rebuilding.load(Ordering::Relaxed) {
            REBUILD_SPLIT => &self.stats.requests_during_split,
            REBUILD_FULL => &self.stats.requests_during_full,
            _ => &self.stats.requests,
        }
        .fetch_add(1, Ordering::Relaxed);
    }

    fn stale(&self) -> Vec<u8> {
        self.stats.stale_replies.fetch_add(1, Ordering::Relaxed);
        status_reply(Status::Stale)
    }

    fn flags(&self) -> u8 {
        if self.resize_pending.load(Ordering::Relaxed) {
            FLAG_PRE_RESIZE
        } else {
            0
        }
    }

    fn head(&self, status: Status, seed: u8, extra: u8) -> WireWriter {
        let mut w = WireWriter::with_capacity(48);
        ReplyHead {
            status,
            flags: self.flags() | extra,
            seed,
        }
        .write(&mut w);
        w
    }

    // ---------------------------------------------------------------- GET

    /// GET (paper §4.3.1): the slot the client computed, and the front of
    /// the block it points at. Nothing is hashed or compared here.
    ///
    /// The lean path (invariant 18 of docs/outback.md): the table from the
    /// thread's snapshot of the list, no lock (invariant 20), one range
    /// check per field, the request counter, the seqlock'd read of the
    /// bucket line and the block straight into the reply (`get_into`: the
    /// handler thread's reply buffer, no allocation; `get` allocates it),
    /// the epoch and state checks, and one load of `resize_pending` for
    /// both the flag and the PRE_RESIZE bookkeeping. No session, no
    /// hashing, no decoding beyond the fixed 20 bytes.
    pub fn get(self: &Arc<Self>, t: &Target, s: u8) -> Result<Vec<u8>, ServiceError> {
        let mut out = Vec::with_capacity(64);
        self.get_into(t, s, &mut out)?;
        Ok(out)
    }

    /// [`ShardServer::get`] building the reply in `out` (the handler
    /// thread's reply buffer, `Service::handle_into`: the lean GET
    /// allocates nothing once the buffer has grown to a reply's size).
    /// `out`'s contents on entry are replaced.
    #[inline]
    pub fn get_into(
        self: &Arc<Self>,
        t: &Target,
        s: u8,
        out: &mut Vec<u8>,
    ) -> Result<(), ServiceError> {
        if s as usize >= SLOTS {
            return Err(ServiceError::malformed(format!(
                "outback: slot {s} out of range"
            )));
        }
        // Invariant 20: the table from this thread's snapshot of the list
        // at generation `gen` (no lock, no reference count), the reads,
        // then the generation again: unchanged, the list was not changed
        // while we read, so nothing `retire` precedes (block frees, the
        // withdrawal) had started; changed, the GET is redone under the
        // list's read lock, as before.
        let generation = self.tables_gen.load(Ordering::Acquire);
        // The common case inline: the thread's last GET used this shard's
        // snapshot at this generation (moved out, used, moved back).
        let latest = match LATEST_SNAPSHOT.take() {
            Some(l) if l.shard == self.uid && l.generation == generation => l,
            _ => self.latest_snapshot(generation),
        };
        let r = match latest.tables.get(t.table as usize) {
            Some(Some(table)) if t.bucket < table.buckets => {
                self.get_from(table, latest.generation, t, s, out)
            }
            _ => self.get_into_locked(t, s, out, false),
        };
        LATEST_SNAPSHOT.set(Some(latest));
        r
    }

    /// The thread's snapshot of this shard's list at `generation` from its
    /// list of snapshots (taken under the lock if it has none of it), for
    /// `LATEST_SNAPSHOT`.
    #[cold]
    #[inline(never)]
    fn latest_snapshot(self: &Arc<Self>, generation: u64) -> LatestSnapshot {
        let (generation, tables) =
            TABLE_SNAPSHOTS.with(|cell| self.snapshot(&mut cell.borrow_mut(), generation));
        LatestSnapshot {
            shard: self.uid,
            generation,
            tables,
        }
    }

    /// The GET's reads of `table`, found in the thread's snapshot at
    /// `generation` (invariant 20), and the generation checked after them.
    #[inline(always)]
    fn get_from(
        self: &Arc<Self>,
        table: &Table,
        generation: u64,
        t: &Target,
        s: u8,
        out: &mut Vec<u8>,
    ) -> Result<(), ServiceError> {
        self.count_request();
        #[cfg(test)]
        tests_hook::mid_get();
        let read = table.read_slot_and_block(t.bucket, s as usize, &self.heap, out);
        let epoch = table.epoch.load(Ordering::Acquire);
        if self.tables_gen.load(Ordering::Acquire) != generation {
            return self.get_into_locked(t, s, out, true);
        }
        self.answer_get(table, epoch, read?, t, s, out)
    }

    /// A GET's answer once its reads of `table` are done (`epoch` loaded
    /// after them; `out` holds what they read), on either path: STALE if a
    /// rebuild moved the bucket's keys, the buffered state if the bucket
    /// has writes answered during a rebuild, else OK with the read.
    #[inline(always)]
    fn answer_get(
        self: &Arc<Self>,
        table: &Table,
        epoch: u32,
        (seed, w): (u8, SlotWord),
        t: &Target,
        s: u8,
        out: &mut Vec<u8>,
    ) -> Result<(), ServiceError> {
        // After the snapshot: a rebuild that moved this bucket's keys bumped
        // the epoch before touching them (invariant 7).
        if epoch != t.epoch {
            *out = self.stale();
            return Ok(());
        }
        // A bucket with writes answered during a rebuild is read under its
        // lock with them (invariant 17); the snapshot above is discarded.
        if table.state.load(Ordering::Acquire) == state::REBUILDING
            && table.buffer.lock().has_bucket(t.bucket)
        {
            *out = self.get_pending(table, t, s)?;
            return Ok(());
        }
        let pending = self.resize_pending.load(Ordering::Relaxed);
        out[0] = Status::Ok as u8;
        out[1] = if pending { FLAG_PRE_RESIZE } else { 0 } | if w.cache() { FLAG_CACHE } else { 0 };
        out[2] = seed;
        if pending {
            self.noticed_pending(t.compute);
        }
        Ok(())
    }

    /// This thread's snapshot of the table list at `generation`, taken
    /// under the list's read lock if the thread has none of it (the
    /// generation is read again under the lock: writers bump it under the
    /// write lock, so the copy is exactly that generation's list).
    fn snapshot(
        self: &Arc<Self>,
        snaps: &mut Vec<TableSnapshot>,
        generation: u64,
    ) -> (u64, std::rc::Rc<Vec<Option<Arc<Table>>>>) {
        let at = match snaps.iter().position(|x| x.shard == self.uid) {
            // Made the latest, which `get_into` checks inline (a thread
            // serving two shards alternately pays this search, not a lock).
            Some(at) => {
                let latest = snaps.remove(at);
                snaps.push(latest);
                snaps.len() - 1
            }
            None => {
                // Shards that are gone (an earlier run in this process, a
                // node shut down) keep no tables alive here.
                snaps.retain(|x| x.owner.strong_count() > 0);
                if snaps.len() >= MAX_TABLE_SNAPSHOTS {
                    snaps.remove(0);
                }
                snaps.push(TableSnapshot {
                    shard: self.uid,
                    owner: Arc::downgrade(self),
                    generation: u64::MAX,
                    tables: Default::default(),
                });
                snaps.len() - 1
            }
        };
        let snap = &mut snaps[at];
        if snap.generation != generation {
            let tables = self.tables.read();
            snap.generation = self.tables_gen.load(Ordering::Acquire);
            snap.tables = std::rc::Rc::new(tables.clone());
        }
        (snap.generation, snap.tables.clone())
    }

    /// The GET under the table list's read lock: the path before
    /// invariant 20, taken when this thread's snapshot does not name the
    /// table or the list changed during the snapshot's read. `counted`:
    /// the snapshot's read already counted the request.
    #[cold]
    #[inline(never)]
    fn get_into_locked(
        self: &Arc<Self>,
        t: &Target,
        s: u8,
        out: &mut Vec<u8>,
        counted: bool,
    ) -> Result<(), ServiceError> {
        let tables = self.tables.read();
        let table = match tables.get(t.table as usize) {
            Some(Some(table)) if t.bucket < table.buckets => table,
            _ => {
                drop(tables);
                *out = if counted {
                    self.stale()
                } else {
                    self.target(t)
                        .map(|r| r.err().unwrap_or_else(|| self.stale()))?
                };
                return Ok(());
            }
        };
        if !counted {
            self.count_request();
        }
        // The reads and the epoch under the list's lock (the table cannot
        // be retired meanwhile); the answer after it, as the snapshot
        // path gives it.
        let read = table.read_slot_and_block(t.bucket, s as usize, &self.heap, out)?;
        let epoch = table.epoch.load(Ordering::Acquire);
        let table = table.clone();
        drop(tables);
        self.answer_get(&table, epoch, read, t, s, out)
    }

    /// GET of a bucket that has pending writes (a rebuild is under way,
    /// invariant 17), under the bucket's lock: if the key in the slot has a
    /// pending state, that state answers (its new block, or an empty slot
    /// if it was deleted); flag BUFFERED tells the client that its own key
    /// may be pending in this bucket, so on a mismatch it asks MAKEUP GET
    /// (which looks the key up).
    fn get_pending(
        self: &Arc<Self>,
        table: &Table,
        t: &Target,
        s: u8,
    ) -> Result<Vec<u8>, ServiceError> {
        self.stats.pending_gets.fetch_add(1, Ordering::Relaxed);
        let g = table.lock(t.bucket);
        if table.epoch.load(Ordering::Acquire) != t.epoch {
            drop(g);
            return Ok(self.stale());
        }
        let w = table.slot(t.bucket, s as usize);
        let buf = table.buffer.lock();
        let entry = if w.is_empty() {
            None
        } else {
            match buf.get(t.bucket, self.heap.key_at(w.addr())?) {
                Some(p) => p.entry,
                None => Some(w.entry()),
            }
        };
        let flags = if w.cache() { FLAG_CACHE } else { 0 }
            | if buf.has_bucket(t.bucket) {
                FLAG_BUFFERED
            } else {
                0
            };
        drop(buf);
        let mut out = self.head(Status::Ok, g.seed(), flags);
        if let Some(e) = entry {
            out.raw(
                &self
                    .heap
                    .read(e.addr(), ((e.len_words() - BLOCK_TAIL_WORDS) * 8) as usize)?,
            );
        }
        drop(g);
        self.noticed(t.compute);
        Ok(out.finish())
    }

    /// MAKEUP GET: the key's pending state during a rebuild (invariant
    /// 17), else the overflow cache, then every block of the bucket.
    pub fn makeup_get(self: &Arc<Self>, t: &Target, key: u64) -> Result<Vec<u8>, ServiceError> {
        let table = match self.target(t)? {
            Ok(tb) => tb,
            Err(reply) => return Ok(reply),
        };
        self.stats.makeup_gets.fetch_add(1, Ordering::Relaxed);
        let g = table.lock(t.bucket);
        if table.epoch.load(Ordering::Acquire) != t.epoch {
            drop(g);
            return Ok(self.stale());
        }
        let pending = if table.state.load(Ordering::Acquire) == state::REBUILDING {
            table.buffer.lock().get(t.bucket, key)
        } else {
            None
        };
        let found = match table.overflow.lock().get(key) {
            Some((b, e)) if b == t.bucket => Some(e),
            _ => None,
        };
        let found = match (pending, found) {
            (Some(p), _) => p.entry,
            (None, Some(e)) => Some(e),
            (None, None) => (0..SLOTS)
                .map(|s| table.slot(t.bucket, s))
                .filter(|w| !w.is_empty())
                .find(|w| self.heap.key_at(w.addr()).is_ok_and(|k| k == key)),
        };
        let seed = g.seed();
        let out = match found {
            Some(e) => {
                let front = self
                    .heap
                    .read(e.addr(), ((e.len_words() - BLOCK_TAIL_WORDS) * 8) as usize)?;
                let mut out = self.head(Status::Ok, seed, 0);
                out.raw(&front);
                out
            }
            None => self.head(Status::NotFound, seed, 0),
        };
        drop(g);
        self.noticed(t.compute);
        Ok(out.finish())
    }

    // ------------------------------------------------------------- writes

    /// INSERT, UPSERT, UPDATE or DELETE; `hint` is the slot the client
    /// computed (UPDATE, DELETE).
    pub fn write(
        self: &Arc<Self>,
        t: &Target,
        op: WriteOp,
        hint: Option<u8>,
        s: Session,
    ) -> Result<Vec<u8>, ServiceError> {
        if let WriteOp::Insert { value, .. } | WriteOp::Update { value, .. } = &op
            && value.len() > MAX_VALUE_LEN
        {
            return Err(ServiceError::malformed(format!(
                "outback: a value of {} bytes exceeds {MAX_VALUE_LEN}",
                value.len()
            )));
        }
        if hint.is_some_and(|h| h as usize >= SLOTS) {
            return Err(ServiceError::malformed(format!(
                "outback: slot {} out of range",
                hint.unwrap_or_default()
            )));
        }
        if !self.ready.load(Ordering::Acquire) {
            return Ok(status_reply(Status::Recovering));
        }
        let table = match self.target(t)? {
            Ok(tb) => tb,
            Err(reply) => return Ok(reply),
        };
        let upsert = matches!(op, WriteOp::Insert { upsert: true, .. });
        let mut g = table.lock(t.bucket);
        if table.epoch.load(Ordering::Acquire) != t.epoch {
            drop(g);
            return Ok(self.stale());
        }
        // A re-sent write its session already applied (here, or on the
        // primary this node took the shard over from) gets the recorded
        // outcome and is not applied again (invariant 16).
        match self.sessions.check(s) {
            Check::New => {}
            Check::Replay(o) => {
                let seed = g.seed();
                drop(g);
                self.stats.replays.fetch_add(1, Ordering::Relaxed);
                let status = if upsert {
                    o.upsert_status()
                } else {
                    o.status()
                };
                self.noticed(t.compute);
                return Ok(self.head(status, seed, 0).finish());
            }
            Check::Old { last } => {
                drop(g);
                return Err(old_write(s, last));
            }
        }
        let rebuilding = table.state.load(Ordering::Acquire) == state::REBUILDING;
        let outcome = if rebuilding {
            match self.write_pending(&table, t.bucket, &mut g, &op, hint, s)? {
                Some(o) => o,
                None => {
                    drop(g);
                    return Ok(self.stale());
                }
            }
        } else {
            self.apply(&table, t.bucket, &mut g, &op, hint, s)?
        };
        let seed = g.seed();
        drop(g);
        if !rebuilding && matches!(outcome, Outcome::Inserted) {
            self.check_thresholds(&table);
        }
        let out = self.head(
            if upsert {
                outcome.upsert_status()
            } else {
                outcome.status()
            },
            seed,
            0,
        );
        self.noticed(t.compute);
        Ok(out.finish())
    }

    /// A write to a table being rebuilt (paper §4.4; invariant 17). Its
    /// outcome is decided and answered now, from the key's pending state
    /// or else the frozen table (whose key set does not change until the
    /// switch, invariant 8); its heap changes (a new block, a kill) and
    /// its session record are mirrored and applied now, like any write's;
    /// only the index change waits: the key's pending state is merged into
    /// the new table at the switch. An update of a key that is only in the
    /// frozen table goes to the frozen table as before (its slot is re-read
    /// at the switch). `None`: the table's pending writes are being merged
    /// (the caller answers STALE and the client retries).
    fn write_pending(
        &self,
        table: &Table,
        b: u32,
        g: &mut BucketGuard<'_>,
        op: &WriteOp,
        hint: Option<u8>,
        s: Session,
    ) -> Result<Option<Outcome>, ServiceError> {
        let key = op.key();
        let pend = {
            let buf = table.buffer.lock();
            if buf.drained {
                return Ok(None);
            }
            buf.get(b, key)
        };
        let set = |p: Option<Pend>| {
            let mut buf = table.buffer.lock();
            match p {
                Some(p) => buf.pend.insert((b, key), p),
                None => buf.pend.remove(&(b, key)),
            };
        };
        let outcome = match pend {
            Some(p) => match (op, p.entry) {
                (WriteOp::Insert { upsert: false, .. }, Some(_)) => Outcome::Exists,
                (WriteOp::Update { .. } | WriteOp::Delete { .. }, None) => Outcome::NotFound,
                (WriteOp::Insert { value, .. } | WriteOp::Update { value, .. }, Some(e)) => {
                    let rec = self.sessions.prepare(s, Outcome::Updated)?;
                    let new =
                        self.new_block(key, value, &[Self::kill_op(e)], session::tail(&rec))?;
                    // Only the pending state referenced `e` (readers of it
                    // hold this bucket's lock), so it is recycled now.
                    self.kill_local(e)?;
                    set(Some(Pend {
                        entry: Some(new),
                        ..p
                    }));
                    self.commit(&rec)?;
                    Outcome::Updated
                }
                (WriteOp::Insert { value, .. }, None) => {
                    let rec = self.sessions.prepare(s, Outcome::Inserted)?;
                    let new = self.new_block(key, value, &[], session::tail(&rec))?;
                    set(Some(Pend {
                        entry: Some(new),
                        ..p
                    }));
                    self.commit(&rec)?;
                    self.stats.buffered.fetch_add(1, Ordering::Relaxed);
                    Outcome::Inserted
                }
                (WriteOp::Delete { .. }, Some(e)) => {
                    let rec = self.sessions.prepare(s, Outcome::Deleted)?;
                    self.forward_kill(e, session::tail(&rec))?;
                    self.kill_local(e)?;
                    // A key that was not in the frozen table leaves no trace.
                    set(p.stale.map(|_| Pend { entry: None, ..p }));
                    self.commit(&rec)?;
                    self.stats.buffered.fetch_add(1, Ordering::Relaxed);
                    Outcome::Deleted
                }
            },
            None => match (op, self.locate(table, b, g.seed(), key, hint)?) {
                (WriteOp::Insert { upsert: false, .. }, Some(_)) => Outcome::Exists,
                (WriteOp::Update { .. } | WriteOp::Delete { .. }, None) => Outcome::NotFound,
                // An update (or upsert) of a key in the frozen table: applied
                // there, out of place, as outside a rebuild.
                (WriteOp::Insert { .. } | WriteOp::Update { .. }, Some(_)) => {
                    self.apply(table, b, g, op, hint, s)?
                }
                (WriteOp::Insert { value, .. }, None) => {
                    let rec = self.sessions.prepare(s, Outcome::Inserted)?;
                    let new = self.new_block(key, value, &[], session::tail(&rec))?;
                    set(Some(Pend {
                        entry: Some(new),
                        stale: None,
                    }));
                    self.commit(&rec)?;
                    self.stats.buffered.fetch_add(1, Ordering::Relaxed);
                    Outcome::Inserted
                }
                (WriteOp::Delete { .. }, Some(loc)) => {
                    let old = match loc {
                        Loc::Slot(_, w) | Loc::Overflow(w) => w.entry(),
                    };
                    let rec = self.sessions.prepare(s, Outcome::Deleted)?;
                    // Dead on the mirrors (a takeover does not bring it
                    // back); the frozen slot still points at it, so it is
                    // recycled only when the delete is merged.
                    self.forward_kill(old, session::tail(&rec))?;
                    set(Some(Pend {
                        entry: None,
                        stale: Some(old),
                    }));
                    self.commit(&rec)?;
                    self.stats.buffered.fetch_add(1, Ordering::Relaxed);
                    Outcome::Deleted
                }
            },
        };
        Ok(Some(outcome))
    }

    /// Forwards the kill of block `e` (and `tail`) to the mirrors.
    fn forward_kill(&self, e: SlotWord, tail: &[MirrorOp]) -> Result<(), ServiceError> {
        let mut ops = Vec::with_capacity(1 + tail.len());
        ops.push(Self::kill_op(e));
        ops.extend_from_slice(tail);
        self.replicas.forward(&self.ctx, &self.heap.layout, &ops)
    }

    /// Merges key `key`'s pending state `p` into bucket `b` of `t` (locked
    /// by `g`): the key's entry replaces the one `t` holds, is placed anew,
    /// or leaves `t`; then the frozen block a buffered delete killed is
    /// recycled. Nothing here goes to the mirrors: they got every change
    /// when the write was answered. Placement may exceed the overflow
    /// cache's capacity (the key is already acknowledged); the thresholds
    /// then start the next resize.
    pub(crate) fn merge_pending(
        &self,
        t: &Table,
        b: u32,
        g: &mut BucketGuard<'_>,
        key: u64,
        p: Pend,
    ) -> Result<(), ServiceError> {
        match (p.entry, self.locate(t, b, g.seed(), key, None)?) {
            (Some(e), Some(Loc::Slot(s, w))) => t.set_slot(b, s, e.with_cache(w.cache())),
            (Some(e), Some(Loc::Overflow(_))) => t.overflow.lock().insert(key, b, e),
            (Some(e), None) => self.place_with(t, b, g, key, true, || Ok(e))?,
            (None, Some(loc)) => self.unlink(t, b, g, key, loc)?,
            (None, None) => {}
        }
        if let Some(old) = p.stale {
            self.kill_local(old)?;
        }
        Ok(())
    }

    /// Applies a write to bucket `b` of `table`, locked by `g`. A write
    /// that changes something forwards its session's record with its heap
    /// changes, as the forward's last op, and commits it locally after
    /// (invariant 16).
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn apply(
        &self,
        table: &Table,
        b: u32,
        g: &mut BucketGuard<'_>,
        op: &WriteOp,
        hint: Option<u8>,
        s: Session,
    ) -> Result<Outcome, ServiceError> {
        let loc = self.locate(table, b, g.seed(), op.key(), hint)?;
        let outcome = match (op, loc) {
            (WriteOp::Insert { upsert: false, .. }, Some(_)) => Outcome::Exists,
            (WriteOp::Insert { .. } | WriteOp::Update { .. }, Some(_)) => Outcome::Updated,
            (WriteOp::Insert { .. }, None) => Outcome::Inserted,
            (WriteOp::Update { .. } | WriteOp::Delete { .. }, None) => Outcome::NotFound,
            (WriteOp::Delete { .. }, Some(_)) => Outcome::Deleted,
        };
        // Reserves the session's entry (Exhausted if the table is full)
        // before anything changes.
        let rec = self.sessions.prepare(s, outcome)?;
        let tail = session::tail(&rec);
        match (op, loc) {
            (WriteOp::Insert { key, value, .. } | WriteOp::Update { key, value }, Some(loc))
                if outcome == Outcome::Updated =>
            {
                self.replace(table, b, loc, *key, value, tail)?;
            }
            (WriteOp::Insert { key, value, .. }, None) => {
                self.place_new(table, b, g, *key, value, tail)?;
            }
            (WriteOp::Delete { key }, Some(loc)) => {
                self.remove(table, b, g, *key, loc, tail)?;
            }
            _ => {}
        }
        self.commit(&rec)?;
        Ok(outcome)
    }

    /// Commits a session record whose forward went out with its write.
    fn commit(&self, rec: &Option<Record>) -> Result<(), ServiceError> {
        match rec {
            Some(r) => self.sessions.commit(&self.heap, r),
            None => Ok(()),
        }
    }

    /// Finds `key` in bucket `b`: at the client's slot, at its slot under
    /// the latest seed, or in the overflow cache (only if that slot's cache
    /// bit says some overflow key hashes there). Fingerprints are compared
    /// before reading a block's key.
    fn locate(
        &self,
        table: &Table,
        b: u32,
        seed: u8,
        key: u64,
        hint: Option<u8>,
    ) -> Result<Option<Loc>, ServiceError> {
        let fp = fingerprint(key);
        let holds = |s: usize| -> Result<Option<Loc>, ServiceError> {
            let w = table.slot(b, s);
            Ok(
                (!w.is_empty() && w.fp() == fp && self.heap.key_at(w.addr())? == key)
                    .then_some(Loc::Slot(s, w)),
            )
        };
        let s = slot(key, seed);
        if let Some(h) = hint.map(usize::from).filter(|&h| h < SLOTS && h != s)
            && let Some(l) = holds(h)?
        {
            return Ok(Some(l));
        }
        if let Some(l) = holds(s)? {
            return Ok(Some(l));
        }
        if table.slot(b, s).cache()
            && let Some((ob, e)) = table.overflow.lock().get(key)
            && ob == b
        {
            return Ok(Some(Loc::Overflow(e)));
        }
        Ok(None)
    }

    /// Writes a new block for (key, value) to the mirrors and then locally;
    /// `extra` ops (kills) and then `tail` (a session record) ride along in
    /// the same forwarding round trip.
    fn new_block(
        &self,
        key: u64,
        value: &[u8],
        extra: &[MirrorOp],
        tail: &[MirrorOp],
    ) -> Result<SlotWord, ServiceError> {
        let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
        let bytes = encode_block(key, value, seq);
        let blk = self.heap.alloc(block_words(value.len()))?;
        let mut ops = Vec::with_capacity(2 + extra.len() + tail.len());
        ops.push(MirrorOp::Write {
            addr: blk.addr,
            data: bytes.clone(),
        });
        if blk.fresh {
            ops.push(MirrorOp::Start { addr: blk.addr });
        }
        ops.extend_from_slice(extra);
        ops.extend_from_slice(tail);
        self.replicas.forward(&self.ctx, &self.heap.layout, &ops)?;
        self.heap.write(blk.addr, &bytes)?;
        if blk.fresh {
            self.heap.mark_start(blk.addr);
        }
        Ok(SlotWord::new(fingerprint(key), blk.words, blk.addr))
    }

    /// Marks a block dead locally and recycles it (mirrors already have the
    /// kill).
    fn kill_local(&self, e: SlotWord) -> Result<(), ServiceError> {
        self.heap
            .write(e.addr() + seq_offset(e.len_words()), &[0; 8])?;
        self.heap.free(e.addr(), e.len_words());
        Ok(())
    }

    fn kill_op(e: SlotWord) -> MirrorOp {
        MirrorOp::Kill {
            addr: e.addr(),
            words: e.len_words(),
        }
    }

    /// A new value for a present key, out of place: the new block and the
    /// old block's kill go to the mirrors first.
    fn replace(
        &self,
        table: &Table,
        b: u32,
        loc: Loc,
        key: u64,
        value: &[u8],
        tail: &[MirrorOp],
    ) -> Result<(), ServiceError> {
        let old = match loc {
            Loc::Slot(_, w) | Loc::Overflow(w) => w.entry(),
        };
        let new = self.new_block(key, value, &[Self::kill_op(old)], tail)?;
        match loc {
            Loc::Slot(s, w) => table.set_slot(b, s, new.with_cache(w.cache())),
            Loc::Overflow(_) => table.overflow.lock().insert(key, b, new),
        }
        self.kill_local(old)
    }

    /// The insert cases of paper §4.3.2.
    fn place_new(
        &self,
        table: &Table,
        b: u32,
        g: &mut BucketGuard<'_>,
        key: u64,
        value: &[u8],
        tail: &[MirrorOp],
    ) -> Result<(), ServiceError> {
        self.place_with(table, b, g, key, false, || {
            self.new_block(key, value, &[], tail)
        })
    }

    /// Places `key` in bucket `b` (the three cases of §4.3.2) with the
    /// entry `make` returns, called once the case is known (so a full
    /// overflow cache fails before anything is written). With `force` the
    /// overflow cache may exceed its capacity (a pending write being
    /// merged: it was acknowledged already).
    fn place_with(
        &self,
        table: &Table,
        b: u32,
        g: &mut BucketGuard<'_>,
        key: u64,
        force: bool,
        make: impl FnOnce() -> Result<SlotWord, ServiceError>,
    ) -> Result<(), ServiceError> {
        let s = slot(key, g.seed());
        let at = table.slot(b, s);
        // Case 1: the slot is empty.
        if at.is_empty() {
            let e = make()?;
            table.set_slot(b, s, e.with_cache(at.cache()));
            table.slot_keys.fetch_add(1, Ordering::Relaxed);
            return Ok(());
        }
        // Case 2: another slot is free: find a seed for all the keys.
        let members = self.members(table, b)?;
        if members.len() < SLOTS {
            let mut keys: Vec<u64> = members.iter().map(|m| m.0).collect();
            keys.push(key);
            if let Some(seed) = find_seed(&keys) {
                let e = make()?;
                let mut all = members;
                all.push((key, e));
                let overflow = table.overflow.lock();
                table.rearrange(b, g, &all, seed, overflow.keys_of(b));
                drop(overflow);
                table.slot_keys.fetch_add(1, Ordering::Relaxed);
                self.stats.reseeds.fetch_add(1, Ordering::Relaxed);
                return Ok(());
            }
        }
        // Case 3: the overflow cache, with the slot's cache bit set.
        if !force && table.overflow_len.load(Ordering::Relaxed) >= table.overflow_cap {
            return Err(ServiceError::exhausted(format!(
                "outback: the overflow cache of table {} in shard {} is full ({} keys) and the \
                 table cannot be split further (outback.max_global_depth)",
                table.id, self.id, table.overflow_cap
            )));
        }
        let e = make()?;
        table.overflow.lock().insert(key, b, e);
        table.overflow_len.fetch_add(1, Ordering::Relaxed);
        table.set_slot(b, s, table.slot(b, s).with_cache(true));
        self.stats.overflow_inserts.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// The keys and entries in bucket `b`'s slots.
    fn members(&self, table: &Table, b: u32) -> Result<Vec<(u64, SlotWord)>, ServiceError> {
        let mut m = Vec::with_capacity(SLOTS);
        for s in 0..SLOTS {
            let w = table.slot(b, s);
            if !w.is_empty() {
                m.push((self.heap.key_at(w.addr())?, w.entry()));
            }
        }
        Ok(m)
    }

    /// DELETE: the kill goes to the mirrors first; then, if overflow keys
    /// wait on this bucket, as many as fit move into it under a new seed.
    fn remove(
        &self,
        table: &Table,
        b: u32,
        g: &mut BucketGuard<'_>,
        key: u64,
        loc: Loc,
        tail: &[MirrorOp],
    ) -> Result<(), ServiceError> {
        let old = match loc {
            Loc::Slot(_, w) | Loc::Overflow(w) => w.entry(),
        };
        self.forward_kill(old, tail)?;
        self.unlink(table, b, g, key, loc)?;
        self.kill_local(old)
    }

    /// Takes `key` out of bucket `b`'s slot or overflow entry (locally),
    /// then promotes overflow keys into the freed room.
    fn unlink(
        &self,
        table: &Table,
        b: u32,
        g: &mut BucketGuard<'_>,
        key: u64,
        loc: Loc,
    ) -> Result<(), ServiceError> {
        match loc {
            Loc::Slot(s, w) => {
                table.set_slot(b, s, w.cleared());
                table.slot_keys.fetch_sub(1, Ordering::Relaxed);
            }
            Loc::Overflow(_) => {
                let mut o = table.overflow.lock();
                o.remove(key);
                table.overflow_len.fetch_sub(1, Ordering::Relaxed);
                table.refresh_cache_bits(b, g.seed(), o.keys_of(b));
            }
        }
        self.promote(table, b, g)
    }

    /// Moves overflow keys of bucket `b` into its free slots when a seed
    /// separates them from the bucket's keys.
    pub(crate) fn promote(
        &self,
        table: &Table,
        b: u32,
        g: &mut BucketGuard<'_>,
    ) -> Result<(), ServiceError> {
        let mut o = table.overflow.lock();
        loop {
            let waiting: Vec<u64> = o.keys_of(b).to_vec();
            if waiting.is_empty() {
                return Ok(());
            }
            let members = self.members(table, b)?;
            if members.len() >= SLOTS {
                return Ok(());
            }
            let mut moved = false;
            for k in waiting {
                let mut keys: Vec<u64> = members.iter().map(|m| m.0).collect();
                keys.push(k);
                if let Some(seed) = find_seed(&keys) {
                    let (_, e) = o.remove(k).expect("listed overflow key");
                    table.overflow_len.fetch_sub(1, Ordering::Relaxed);
                    let mut all = members.clone();
                    all.push((k, e));
                    table.rearrange(b, g, &all, seed, o.keys_of(b));
                    table.slot_keys.fetch_add(1, Ordering::Relaxed);
                    self.stats.promotions.fetch_add(1, Ordering::Relaxed);
                    moved = true;
                    break;
                }
            }
            if !moved {
                return Ok(());
            }
        }
    }

    // ----------------------------------------------------- bulk loading

    /// LOAD: writes blocks (mirrors first, all in one round trip per
    /// mirror); they join the index at the next full build.
    pub fn load(&self, pairs: &[(u64, &[u8])]) -> Result<(), ServiceError> {
        if !self.ready.load(Ordering::Acquire) {
            return Err(ServiceError::failed(
                "outback: the shard is not ready for loads",
            ));
        }
        let mut ops = Vec::with_capacity(pairs.len() * 2);
        let mut local = Vec::with_capacity(pairs.len());
        for &(key, value) in pairs {
            if value.len() > MAX_VALUE_LEN {
                return Err(ServiceError::malformed(format!(
                    "outback: a value of {} bytes exceeds {MAX_VALUE_LEN}",
                    value.len()
                )));
            }
            let seq = self.seq.fetch_add(1, Ordering::Relaxed) + 1;
            let bytes = encode_block(key, value, seq);
            let blk = self.heap.alloc(block_words(value.len()))?;
            ops.push(MirrorOp::Write {
                addr: blk.addr,
                data: bytes.clone(),
            });
            if blk.fresh {
                ops.push(MirrorOp::Start { addr: blk.addr });
            }
            local.push((key, blk, bytes));
        }
        self.replicas.forward(&self.ctx, &self.heap.layout, &ops)?;
        let mut loaded = self.loaded.lock();
        for (key, blk, bytes) in local {
            self.heap.write(blk.addr, &bytes)?;
            if blk.fresh {
                self.heap.mark_start(blk.addr);
            }
            loaded.push((key, SlotWord::new(fingerprint(key), blk.words, blk.addr)));
        }
        Ok(())
    }

    /// BUILD: asks for a full rebuild that includes every key loaded so
    /// far; returns the build number to wait for in the control region.
    pub fn request_build(self: &Arc<Self>) -> u64 {
        self.pace_full.store(true, Ordering::Release);
        let n = self.build_requested.fetch_add(1, Ordering::AcqRel) + 1;
        self.kick();
        n
    }

    // ------------------------------------------- compute nodes, PRE_RESIZE

    pub fn register(&self) -> Result<u32, ServiceError> {
        let mut c = self.computes.lock();
        if c.registered.len() >= MAX_COMPUTES {
            return Err(ServiceError::exhausted(format!(
                "outback: shard {} already tracks {MAX_COMPUTES} compute nodes",
                self.id
            )));
        }
        c.next += 1;
        let id = c.next;
        c.registered.insert(id);
        Ok(id)
    }

    pub fn deregister(&self, id: u32) {
        self.computes.lock().registered.remove(&id);
    }

    pub fn registered(&self) -> usize {
        self.computes.lock().registered.len()
    }

    /// Called after every data request: while a resize is pending, counts
    /// the compute nodes that have now been told (paper Fig. 8 ①②).
    fn noticed(self: &Arc<Self>, compute: u32) {
        if self.resize_pending.load(Ordering::Relaxed) {
            self.noticed_pending(compute);
        }
    }

    /// [`noticed`](Self::noticed) once a resize is known to be pending
    /// (a GET has loaded the flag already for its reply).
    #[cold]
    fn noticed_pending(self: &Arc<Self>, compute: u32) {
        {
            let mut c = self.computes.lock();
            if c.registered.contains(&compute) {
                c.acks.insert(compute);
            }
        }
        if self.split_ready() {
            self.kick();
        }
    }

    /// Whether a table in PRE_RESIZE may start its rebuild: every compute
    /// node has seen PRE_RESIZE, or the wait timed out, or a table is
    /// already stopped at s_stop.
    pub(crate) fn split_ready(&self) -> bool {
        let all_told = self.all_told();
        let timeout = Duration::from_millis(self.ctx.cfg.pre_resize_timeout_ms);
        self.live_tables()
            .iter()
            .any(|t| match t.state.load(Ordering::Acquire) {
                state::REBUILDING => true,
                state::PRE_RESIZE => {
                    all_told
                        || t.pre_resize_since
                            .lock()
                            .is_some_and(|s| s.elapsed() >= timeout)
                }
                _ => false,
            })
    }

    /// Every registered compute node has seen PRE_RESIZE.
    pub(crate) fn all_told(&self) -> bool {
        let c = self.computes.lock();
        c.registered.iter().all(|id| c.acks.contains(id))
    }

    /// What a compute node caches for this shard now (Othello arrays, a
    /// seed byte per bucket, the directory: `ShardView::bytes`), and the
    /// keys the shard holds.
    pub(crate) fn index_size(&self) -> (u64, u64) {
        let tables = self.live_tables();
        let bytes = tables
            .iter()
            .map(|t| t.othello.bytes() + t.buckets as u64)
            .sum::<u64>()
            + self.dir.lock().entries.len() as u64 * 4;
        (bytes, tables.iter().map(|t| t.keys()).sum())
    }

    /// After an insert: s_slow starts PRE_RESIZE, s_stop stops inserts
    /// (paper §4.4).
    pub(crate) fn check_thresholds(self: &Arc<Self>, table: &Table) {
        let cfg = &self.ctx.cfg;
        if table.local_depth.load(Ordering::Relaxed) >= cfg.max_global_depth {
            return;
        }
        let over = table.overflow_len.load(Ordering::Relaxed) as f64;
        let cap = table.overflow_cap as f64;
        let load = table.slot_keys.load(Ordering::Relaxed) as f64 / table.slots_total() as f64;
        if over >= cfg.stop_fill * cap {
            let prev = table.state.swap(state::REBUILDING, Ordering::AcqRel);
            if prev != state::REBUILDING {
                self.stats.trigger_stop_fill.fetch_add(1, Ordering::Relaxed);
                self.resize_pending.store(true, Ordering::Release);
                self.kick();
            }
        } else if (over >= cfg.slow_fill * cap || load >= cfg.slow_load)
            && table
                .state
                .compare_exchange(
                    state::NORMAL,
                    state::PRE_RESIZE,
                    Ordering::AcqRel,
                    Ordering::Acquire,
                )
                .is_ok()
        {
            if over >= cfg.slow_fill * cap {
                &self.stats.trigger_slow_fill
            } else {
                &self.stats.trigger_slow_load
            }
            .fetch_add(1, Ordering::Relaxed);
            *table.pre_resize_since.lock() = Some(Instant::now());
            if !self.resize_pending.swap(true, Ordering::AcqRel) {
                self.computes.lock().acks.clear();
            }
            if self.split_ready() {
                self.kick();
            }
        }
    }

    /// Starts the background rebuild job unless it is running.
    pub fn kick(self: &Arc<Self>) {
        if self
            .job_active
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
        {
            let me = self.clone();
            if self
                .ctx
                .submit(move || crate::server::rebuild::run(me))
                .is_err()
            {
                self.job_active.store(false, Ordering::Release);
            }
        }
    }

    // --------------------------------------------------------- publishing

    pub(crate) fn desc(t: &Table) -> TableDesc {
        TableDesc {
            id: t.id,
            epoch: t.epoch.load(Ordering::Acquire),
            buckets: t.buckets,
            local_depth: t.local_depth.load(Ordering::Acquire),
            bucket_seed: t.bucket_seed,
            othello_seed: t.othello.seed(),
            ma: t.othello.ma(),
            mb: t.othello.mb(),
        }
    }

    /// Writes the current directory and tables into the control region for
    /// compute nodes to fetch (paper Fig. 8 ③), with the countdown set to
    /// the number of compute nodes.
    pub(crate) fn publish(&self) -> Result<u64, ServiceError> {
        let version = self.publish_version.fetch_add(1, Ordering::AcqRel) + 1;
        let dir = self.dir.lock().clone();
        let view = ViewDesc {
            version,
            global_depth: dir.global_depth,
            dir: dir.entries,
            tables: self.live_tables().iter().map(|t| Self::desc(t)).collect(),
        };
        let body = view.encode();
        let mem = &self.ctl.mem;
        if ctl::BODY + body.len() as u64 > self.ctl.len() {
            return Err(ServiceError::exhausted(
                "outback: the control region is too small",
            ));
        }
        let w = |off: u64, v: u64| mem.store_u64(off, v).expect("control header");
        mem.write(ctl::BODY, &body).expect("body fits");
        w(ctl::BODY_LEN, body.len() as u64);
        w(ctl::BODY_CHECK, dmkv_api::checksum64(&body));
        w(ctl::COUNTDOWN, self.registered() as u64);
        w(ctl::VERSION, version);
        Ok(version)
    }

    /// Publishes the count of completed rebuilds and full builds.
    pub(crate) fn publish_progress(&self) {
        let mem = &self.ctl.mem;
        mem.store_u64(ctl::BUILT, self.build_done.load(Ordering::Acquire))
            .expect("control header");
        mem.store_u64(ctl::APPLIED, self.applied.load(Ordering::Acquire))
            .expect("control header");
    }

    /// Figures for `engine_stats`.
    pub fn stats_json(&self) -> serde_json::Value {
        let tables = self.live_tables();
        let slots: u64 = tables.iter().map(|t| t.slots_total()).sum();
        let in_slots: u64 = tables
            .iter()
            .map(|t| t.slot_keys.load(Ordering::Relaxed))
            .sum();
        let overflow: u64 = tables
            .iter()
            .map(|t| t.overflow_len.load(Ordering::Relaxed) as u64)
            .sum();
        // Writes answered during a rebuild (invariant 17) change the key
        // count before they reach the index: a new key pending in the
        // buffer is a key, a table key with a pending delete is not.
        let (pending_new, pending_gone) = tables.iter().fold((0u64, 0u64), |(n, g), t| {
            let buf = t.buffer.lock();
            buf.pend.values().fold((n, g), |(n, g), p| {
                match (p.entry.is_some(), p.stale.is_some()) {
                    (true, false) => (n + 1, g),
                    (false, true) => (n, g + 1),
                    _ => (n, g),
                }
            })
        });
        let s = &self.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let a = *s.after_resize.lock();
        let after_resize = serde_json::json!({
            "resizes": a.resizes,
            "max_bytes": a.max_bytes,
            "max_keys": a.max_keys,
            "last_bytes": a.last_bytes,
            "last_keys": a.last_keys,
        });
        serde_json::json!({
            "shard": self.id,
            "tables": tables.len(),
            "global_depth": self.dir.lock().global_depth,
            "buckets": tables.iter().map(|t| t.buckets as u64).sum::<u64>(),
            "slots": slots,
            "keys_in_slots": in_slots,
            "overflow_keys": overflow,
            "keys": (in_slots + overflow + pending_new).saturating_sub(pending_gone),
            "pending_keys": pending_new,
            "pending_deletes": pending_gone,
            "locator_bytes": tables.iter().map(|t| t.othello.bytes() + t.buckets as u64).sum::<u64>(),
            "heap_live_bytes": self.heap.live_bytes(),
            "heap_carved_bytes": self.heap.carved_bytes(),
            "requests_outside_rebuilds": l(&s.requests),
            "makeup_gets": l(&s.makeup_gets),
            "stale_replies": l(&s.stale_replies),
            "reseeds": l(&s.reseeds),
            "overflow_inserts": l(&s.overflow_inserts),
            "promotions": l(&s.promotions),
            "buffered_writes": l(&s.buffered),
            "pending_gets": l(&s.pending_gets),
            "write_replays": l(&s.replays),
            "sessions": self.sessions.len(),
            "splits": l(&s.splits),
            "grows": l(&s.grows),
            "trigger_slow_fill": l(&s.trigger_slow_fill),
            "trigger_slow_load": l(&s.trigger_slow_load),
            "trigger_stop_fill": l(&s.trigger_stop_fill),
            "start_all_told": l(&s.start_all_told),
            "start_timeout": l(&s.start_timeout),
            "start_stop_fill": l(&s.start_stop_fill),
            "after_resize": after_resize,
            "full_builds": l(&s.full_builds),
            "fallback_keys": l(&s.fallback_keys),
            "split_ns": l(&s.split_ns),
            "split_max_ns": l(&s.split_max_ns),
            "resize_total_ns": l(&s.resize_total_ns),
            "full_build_ns": l(&s.full_build_ns),
            "requests_during_split": l(&s.requests_during_split),
            "requests_during_full": l(&s.requests_during_full),
            "takeovers": l(&s.takeovers),
            "takeover_ns": l(&s.takeover_ns),
            "recovered_keys": l(&s.recovered_keys),
            "mirrors": self.replicas.configured(),
            "live_mirrors": self.replicas.live().len(),
            "replica_verbs": l(&self.replicas.verbs),
            "replica_bytes": l(&self.replicas.bytes),
            "replica_round_trips": l(&self.replicas.round_trips),
            "registered_compute_nodes": self.registered(),
            "last_rebuild_error": self.last_error.lock().clone(),
            "busy": self.job_active.load(Ordering::Acquire)
                || self.resize_pending.load(Ordering::Acquire),
        })
    }
}

/// A test's hook inside a GET, between finding the table in the thread's
/// snapshot and reading it (invariant 20's race test).
#[cfg(test)]
pub(crate) mod tests_hook {
    use std::cell::RefCell;
    thread_local! {
        static HOOK: RefCell<Option<Box<dyn FnMut()>>> = const { RefCell::new(None) };
    }
    /// Runs `f` inside the next GETs of this thread, at the hook.
    pub(crate) fn set(f: Option<Box<dyn FnMut()>>) {
        HOOK.with(|h| *h.borrow_mut() = f);
    }
    pub(super) fn mid_get() {
        let f = HOOK.with(|h| h.borrow_mut().take());
        if let Some(mut f) = f {
            f();
            HOOK.with(|h| {
                let mut h = h.borrow_mut();
                if h.is_none() {
                    *h = Some(f);
                }
            });
        }
    }
}
