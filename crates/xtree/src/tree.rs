//! The memory node's side of XTree: structural operations on the tree in a
//! registered region, run by RPC handler threads.
//!
//! Concurrency (docs/xtree.md, *Concurrency on the memory node*): a tree-wide
//! reader-writer lock, `structure`, orders structural changes. Operations
//! that stay inside one leaf (get, scan, update, delete, insert into a leaf
//! with room) hold it shared and lock only their leaf (`V_0`, by the version
//! protocol), so handler threads working on different leaves run in
//! parallel. An insert into a full leaf retries holding it exclusively and
//! splits, up to the root; inner nodes therefore change only under the
//! exclusive lock and are stable for anyone holding it shared. Readers on
//! the node validate leaf images by the version protocol, exactly as
//! one-sided readers do.

use crate::config::XTreeConfig;
use crate::layout::{
    ChildPtr, FatPtr, Geometry, Header, INCARNATION_MASK, INLINE_VALUE_LEN, LINE_BYTES, LOCK_BIT,
    MAX_SLOTS, MAX_VALUE_LEN, Meta, NO_NODE, RootWord, SUPERBLOCK_FORMAT_OFFSET,
    SUPERBLOCK_ROOT_OFFSET, WORDS_PER_LINE, block_bytes, format_word, next_incarnation,
};
use crate::protocol::{NodeWords, commit, lock, unlock_unchanged};
use crate::view::{
    NodeImage, NodeView, SlotValue, ViewError, block_value, check_head_words, check_node_image,
    encode_block,
};
use dmkv_memnode::{AllocError, NodeRuntime, Region, SizeClassAllocator, SlabAllocator};
use dmkv_transport::{RegionMem, RemoteRegion, ServiceError};
use parking_lot::RwLock;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use thiserror::Error;

/// Work the tree declares to `sim`'s instruction term when it runs on a
/// memory node ([`dmkv_transport::sim::work`], a no-op elsewhere;
/// docs/simulation.md, "An instruction term for memory-node jobs (branch
/// i49)" and "A lean xtree (branch i53)"). Instructions counted with
/// callgrind on the `local` transport, branch i53's binary b72b7b2 (the
/// lean paths, these constants not yet changed: the constants do not
/// change what runs on `local`): `DMKV=/tmp/i53/dmkv-b72b7b2
/// KEEP=/tmp/i53/cg-b72b7b2-rpc-btree scripts/instructions-per-op.sh
/// rpc-btree` (ycsb-c, 50,000 keys, height 5, 1 thread x 8 tasks,
/// differenced over 50,000 GETs), the handler thread's call tree
/// (inclusive, per operation). Each constant gives the figure it replaces
/// (main's a1dce1e, before the lean paths); the tables are in
/// docs/rpc-btree.md and docs/simulation.md, "A lean xtree (branch i53)".
pub mod cost {
    /// One inner node of a descent ([`XTree::walk`]: the node's words in
    /// place, its meta word, the search over its keys (a linear scan since
    /// branch i68, a binary search before), the child
    /// pointer): `descend_to_leaf` 724.8 per GET over 4 inner levels (the
    /// leaf's bounds check and meta word spread over them): 181. Branch
    /// i58's walk, which reports the lines it reads one at a time
    /// (`NodeLines`), counted on `local` (where it reports none: the
    /// bookkeeping is the simulator's, not the code's) with 0ed65fb,
    /// `DMKV=/tmp/i58/dmkv-wip4 KEEP=/tmp/i58/cg-wip4-rpc-btree
    /// scripts/instructions-per-op.sh rpc-btree`. (Was 170: 678.4 on
    /// b72b7b2 and on main's fac3bce, the whole-node touch; 267 before the
    /// lean paths.) Branch i68's walk, the artifact's linear scan with its
    /// key lines touched as one access: `descend_to_leaf` 742.3 per GET
    /// (head17's binary search: 724.8 on the same command), over 4 inner
    /// levels 185.6: 186. Counted on `local` with fba3b49,
    /// `DMKV=/tmp/i68/dmkv-fba3b49 KEEP=/tmp/i68/cg-fba3b49-rpc-btree
    /// scripts/instructions-per-op.sh rpc-btree`, differenced over the two
    /// runs' 50,000 GETs (inclusive call edge `get_with` ->
    /// `descend_to_leaf`).
    pub const INNER_LEVEL: u64 = 186;
    /// A leaf split (`split_leaf`: the locked leaf's copy and parse, the
    /// N + 1 pairs collected and sorted, the new right sibling and the
    /// rewritten leaf written through `NodeMem`, the parent's update and
    /// any split above it, the allocations), per split, beyond the
    /// `LEAF_WRITE` and descent of the attempts before it. Until branch
    /// i89 a split was not declared. `split_leaf` 17,168.4 per call
    /// (61,153,653 instructions over 3,562 splits of 50,000 inserts, the
    /// inner splits they caused included on average), callgrind on
    /// `local` with branch i89's binary: `DMKV=/tmp/i89/dmkv-split0
    /// KEEP=/tmp/i89/cg-split0 KINDS=insert
    /// scripts/instructions-per-kind.sh xstore` (50,000 keys, 1 thread x 8
    /// tasks, seed 1; the two runs differenced, inclusive call edges).
    pub const LEAF_SPLIT: u64 = 17_168;
    /// One attempt at a consistent image of a leaf
    /// (`read_consistent_image`: the copy into the stack buffer and its
    /// checks, [`crate::view::NodeImage`]): 513.0 per GET. (Was 1,336: the
    /// copy, its check and a parse into two `Vec`s.)
    /// (Since branch i93 GET reads its leaf in place, `LEAF_READ_IN_PLACE`;
    /// this copy is `find_leaf`'s, whose code is unchanged.)
    pub const LEAF_READ: u64 = 513;
    /// One attempt at `key`'s slot in a leaf read in place
    /// (`XTree::read_leaf_slot`: the node's words bounds-checked and
    /// touched, `V_0`, header and meta, the key words up to `key`, its
    /// slot word, the closing version words and their checks): 366.3 per
    /// GET. Branch i93, callgrind on `local` with its binary:
    /// `DMKV=/tmp/i93/dmkv-a1 KEEP=/tmp/i93/cg-a1-rb
    /// scripts/instructions-per-op.sh rpc-btree` (ycsb-c, 50,000 keys),
    /// differenced over the two runs' 50,000 GETs, inclusive call edge
    /// `get_with` -> `read_leaf_slot`. (Was `LEAF_READ`, 513: the copy into
    /// a zeroed stack buffer and its checks.)
    pub const LEAF_READ_IN_PLACE: u64 = 366;
    /// One attempt at a consistent image of a leaf parsed into a
    /// [`crate::view::NodeView`] (`read_consistent`: the copy, its check
    /// and the parse into two `Vec`s), which scans and leaf iteration
    /// still use (`leaves_covering` until branch i106): the figure
    /// `LEAF_READ` had before the lean paths, measured on that code (main's
    /// a1dce1e, 1,336.0 per GET), which is unchanged.
    pub const LEAF_READ_PARSED: u64 = 1_336;
    /// `XTree::get_with`'s own part (the lock, the value, the caller's
    /// closure: for rpc-btree the reply's encoding): 1,506.2 less the two
    /// above, 315 (with the stack buffer's zeroing and the key's search in
    /// the copy). (Was 250 for `get`, whose value copy and frees the
    /// handler paid.) Branch i93 (the leaf read in place, the key's search
    /// in `LEAF_READ_IN_PLACE`): `get_with` 1,172.6 per GET less
    /// `descend_to_leaf` 692.3 and `read_leaf_slot` 366.3: 114, the run
    /// given for `LEAF_READ_IN_PLACE`.
    pub const GET: u64 = 114;
    /// A write's attempt on its leaf in place (`leaf_apply`: the leaf's
    /// words, its lock, its copy and checks, the change, the commit of the
    /// changed words) plus `modify`'s own part: on ycsb-a
    /// (`scripts/instructions-per-op.sh rpc-btree ycsb-a`, same binary) per
    /// update `modify` 1,621.2, of it the descent 676.2 (declared per level
    /// above): 945. (Was 2,583.) A write that must split
    /// (`apply_exclusive`, about one insert in eight) is not declared
    /// beyond this: not measured apart. Branch i89 (the leaf read in
    /// place under its lock, not copied to a zeroed stack buffer and
    /// parsed; the commit's write reports made one per commit): per update
    /// `modify` 1,380.1, of it the descent 699.0: 681, callgrind on
    /// `local` with its binary, `DMKV=/tmp/i89/dmkv-lean2
    /// KEEP=/tmp/i89/cg-lean2-rb scripts/instructions-per-op.sh rpc-btree
    /// ycsb-a`, 24,916 updates differenced, inclusive call edges. Main's
    /// head 57a2337 on the same command: 1,994.2 less 699.0, 1,295 (the
    /// 945 was counted before the commit reported each store to `sim`'s
    /// private caches, about 26 instructions a store on `local`).
    pub const LEAF_WRITE: u64 = 681;
    /// An update with a position hint, its own part
    /// ([`XTree::update_hinted_leaves`] less its leaf attempts and its
    /// fallback `update`: the hint's checks, the counters, the tree lock):
    /// 1,269.8 per update less `try_hinted_leaf` 1,138.1 per update
    /// (34,194 calls for 24,916 updates, 2.01 leaves named per hint),
    /// 132. Branch i63, callgrind on `local` with its binary 73c8f85:
    /// `DMKV=/tmp/i63/dmkv-wip1 KEEP=/tmp/i63/cg-wip1-xstore
    /// scripts/instructions-per-op.sh xstore ycsb-a`, differenced over the
    /// two runs' 24,916 updates (every one hinted and used), inclusive call
    /// edges. (These three replace `HINTED_ATTEMPT`, 880 per update
    /// whatever it tried, measured again with main's binary on the same
    /// command: `update_hinted` 1,466.2 per update less its fallback
    /// `modify` 583.5, 882.7.)
    pub const HINTED_BASE: u64 = 132;
    /// One leaf of a position hint tried (`try_hinted_leaf` without the
    /// write: the leaf's words bounds-checked, its lock, its header and
    /// meta read in place and checked, the key words searched in place, the
    /// unlock when the leaf lacks the key): 509.6 per call less the write
    /// below per call (24,916 of 34,194 calls wrote), 303. Branch i65,
    /// callgrind on `local` with its binary 87f62d6:
    /// `DMKV=/tmp/i65/dmkv-87f62d6 KEEP=/tmp/i65/cg-xstore
    /// scripts/instructions-per-op.sh xstore ycsb-a`, differenced as for
    /// `HINTED_BASE` (which the same run gives again: 831.1 less 699.4
    /// per update, 132). (Was 656 on branch i63 (829.3 per call), when
    /// the attempt copied the whole leaf into a zeroed stack buffer: the
    /// copy and its checks 331.0, the memset 77.0 per call.) The slot
    /// word's load on a hit is in this figure, not split. Branch i68 (the
    /// key words' scan stepping over version words, its lines touched as
    /// one access): `try_hinted_leaf` 477.0 per call (head17: 510.4 on the
    /// same command) less the write per call (`replace_value` 238.0 +
    /// `node_slice` 46.0 per write, 24,916 of 34,194 calls), 270;
    /// `DMKV=/tmp/i68/dmkv-fba3b49 KEEP=/tmp/i68/cg-fba3b49-xstore
    /// scripts/instructions-per-op.sh xstore ycsb-a`, differenced as above
    /// (`HINTED_BASE` again 786.4 less 654.6 per update, 132). Branch
    /// i89, the same command with its binary (`DMKV=/tmp/i89/dmkv-lean2
    /// KEEP=/tmp/i89/cg-lean2-a`): `try_hinted_leaf` 774.5 per update less
    /// the write per update (`HINTED_WRITE`'s 319.0), over 1.372 calls
    /// per update (34,194 calls, 24,916 updates): 332 (`HINTED_BASE`
    /// again 906.2 less 774.5, 132). The attempt's
    /// code is i68's; the figure grew with the lock's and the unlock's
    /// write reports to `sim`'s private caches (`NodeSlice::cas`, 33 per
    /// call on `local`), added after i68's count.
    pub const HINTED_LEAF: u64 = 332;
    /// The hinted leaf held the key: `replace_value` (the value and the
    /// commit) 238.0 and `node_slice` (the leaf's every line, which the
    /// commit writes) 45.0 per write from `try_hinted_leaf`: 283 (branch
    /// i65's run above; 238 on branch i63, whose `node_slice` came before
    /// the lock on every leaf tried and counted in `HINTED_LEAF`). Branch
    /// i89 (one write report per commit): `replace_value` 264.0 and
    /// `node_slice` 55.0 per write, the run given for `HINTED_LEAF`: 319. (Main's head 57a2337 on that command: 567.0 + 55.0, the
    /// commit reporting each of its ~10 stores.)
    pub const HINTED_WRITE: u64 = 319;
    /// [`XTree::leaves_covering`] (XStore's training and retraining walk),
    /// per inner node it visits: the node's keys and children loaded in
    /// place and checked (`inner_in_place`, 540.8 per call) and the loop over
    /// its children in `cover` (97.2): 638. Twenty-seventh session,
    /// callgrind on `local`: `valgrind --tool=callgrind dmkv bench --engine
    /// xstore --workload insert --keys 50000 --ops 30000 --threads 1 --tasks
    /// 8 --seed 1` (2,202 walks, 13,527 inner nodes, 36,730 leaf reads),
    /// `inner_in_place` and `read_leaf_keys` built `#[inline(never)]` for
    /// the count (inclusive 7,315,285 over 13,527 calls; the loop's lines of
    /// `cover` 1,314,875 self). Before, the node was copied and parsed
    /// (`read_locked`, 1,239 per call on that run with main 08e1a0c; 1,391
    /// with the loop, branch i58's count).
    pub const COVER_INNER: u64 = 638;
    /// [`XTree::leaves_covering`], per leaf and per attempt at its read
    /// (branch i106: the keys read in place under the version check,
    /// `read_leaf_keys`, into the reported `Vec`, then sorted and pushed;
    /// before, a copy parsed into a `NodeView`, `LEAF_READ_PARSED` per
    /// attempt, plus 533 for the keys' clone and sort and the image's
    /// drop). The walk's total less its inner nodes at `COVER_INNER`, over
    /// its leaves: inclusive `leaves_covering` 41,699,901 (the run given
    /// for `COVER_INNER`, the build as shipped) - 13,527 x 638, over 36,730
    /// leaves: 900. (Branch i106 derived 782 from its run's 50,913,522 with
    /// 15,949 inner nodes; main's binaries before and after this change,
    /// and branch i58's, visit 13,527 on that command, which gives 874 by
    /// its split.) A retry declares the whole figure again (the sort and
    /// push, about a third of it, are then over-declared; retries need a
    /// writer in the leaf during the read).
    pub const COVER_LEAF: u64 = 900;
}

/// Why a tree operation failed. Expected outcomes (absent, present) are
/// results, not errors.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum XTreeError {
    /// The node or value region is full. Nothing was changed.
    #[error("exhausted: {0}")]
    Exhausted(String),
    /// A request named a node, length or value the tree cannot accept.
    #[error("bad request: {0}")]
    BadRequest(String),
    #[error("bad configuration: {0}")]
    Config(String),
    /// The tree's own memory failed validation: a bug, never expected.
    #[error("corrupt tree: {0}")]
    Corrupt(String),
}

impl From<XTreeError> for ServiceError {
    fn from(e: XTreeError) -> ServiceError {
        match e {
            XTreeError::Exhausted(m) => ServiceError::exhausted(m),
            XTreeError::BadRequest(m) => ServiceError::malformed(m),
            e => ServiceError::failed(e.to_string()),
        }
    }
}

fn exhausted(e: AllocError) -> XTreeError {
    XTreeError::Exhausted(e.to_string())
}

/// Most leaves a position hint may name ([`XTree::update_hinted_leaves`]
/// refuses more): the width of XStore's default `max_leaves`, beyond which
/// its GET does not read the predicted leaves either.
pub const MAX_HINT_LEAVES: usize = 16;

/// A leaf named by number and the incarnation it had (a position hint, a
/// lookup result).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeafRef {
    pub node: u32,
    pub incarnation: u32,
}

/// One leaf as iteration reports it (XStore trains its models on these).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafInfo {
    pub node: u32,
    pub incarnation: u32,
    pub count: u8,
    /// The leaf's keys, sorted.
    pub keys: Vec<u64>,
}

/// A leaf with its exact key range, `[lower, upper)` (`upper` `None`: the
/// rightmost leaf), as [`XTree::leaves_covering`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CoveredLeaf {
    pub info: LeafInfo,
    pub lower: u64,
    pub upper: Option<u64>,
}

/// A node split, reported to the split hook after the tree lock is released.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitEvent {
    /// 0 for a leaf split.
    pub level: u8,
    /// The split node, which kept the lower half, with its new incarnation.
    pub left: LeafRef,
    pub old_incarnation: u32,
    /// The new right sibling (incarnation 0).
    pub right: u32,
    /// The lowest key of the right sibling's range.
    pub separator: u64,
}

/// Called once per split (XStore queues retraining). Runs on the handler
/// thread that split, after the tree lock is released; keep it short.
pub type SplitHook = Arc<dyn Fn(&SplitEvent) + Send + Sync>;

/// Result of an update with a position hint.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HintedUpdate {
    /// The key existed and now has the new value.
    pub updated: bool,
    /// The hinted leaf (with its incarnation) held the key, so no traversal
    /// was needed.
    pub hint_used: bool,
}

/// Figures for `engine_stats`.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct TreeStats {
    pub slots: u64,
    pub height: u64,
    pub leaves: u64,
    pub inner_nodes: u64,
    pub keys: u64,
    pub leaf_splits: u64,
    pub inner_splits: u64,
    pub max_nodes: u64,
    pub value_bytes_live: u64,
    pub value_region_bytes: u64,
    pub hinted_updates: u64,
    pub hinted_updates_used: u64,
}

impl TreeStats {
    /// Keys per leaf slot.
    pub fn fill_factor(&self) -> f64 {
        if self.leaves == 0 {
            0.0
        } else {
            self.keys as f64 / (self.leaves * self.slots) as f64
        }
    }
}

/// What a write does to a key.
#[derive(Debug, Clone, Copy)]
enum WriteOp<'a> {
    Insert(&'a [u8]),
    Update(&'a [u8]),
    Upsert(&'a [u8]),
    Delete,
}

enum LeafOutcome {
    Done(bool),
    /// An insert of a new key into a full leaf: needs a split.
    Full,
}

/// Retries of a validated read before the tree reports itself corrupt. A
/// writer holds a node for a handful of stores, so this is never reached
/// in a healthy tree.
const MAX_READ_RETRIES: u32 = 1_000_000;

/// The pause after a torn or locked node image before the next attempt:
/// spin for the first 64 attempts, then yield the thread.
#[inline]
fn back_off(attempt: u32) {
    if attempt > 64 {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
}

/// The stack buffer a node is copied into: at least the largest node
/// (`MAX_SLOTS`; checked by `tests::the_largest_node_fits_a_snapshot`).
const MAX_NODE_BYTES: usize = 1024;

#[derive(Default)]
struct Counters {
    leaves: AtomicU64,
    inner_nodes: AtomicU64,
    keys: AtomicU64,
    leaf_splits: AtomicU64,
    inner_splits: AtomicU64,
    hinted: AtomicU64,
    hinted_used: AtomicU64,
    /// Leaves tried by hinted updates (`try_hinted_leaf` calls).
    hinted_leaves: AtomicU64,
}

/// The words of one node in the node region.
struct NodeMem<'a> {
    mem: &'a RegionMem,
    base: u64,
}

impl NodeWords for NodeMem<'_> {
    fn load(&self, i: usize) -> u64 {
        self.mem
            .load_u64(self.base + 8 * i as u64)
            .expect("node numbers are checked against the region")
    }
    fn store(&self, i: usize, v: u64) {
        self.mem
            .store_u64(self.base + 8 * i as u64, v)
            .expect("node numbers are checked against the region")
    }
    fn cas(&self, i: usize, expected: u64, new: u64) -> u64 {
        self.mem
            .cas_u64(self.base + 8 * i as u64, expected, new)
            .expect("node numbers are checked against the region")
    }
}

/// The words of one node in place: one bounds check and one `sim` touch
/// of all its lines when made ([`XTree::node_slice`]), then plain atomic
/// loads, stores and CASes with [`NodeMem`]'s orderings. The lean write
/// paths lock, read and commit a leaf through it (a [`NodeMem`] access is
/// a bounds-checked call per word).
///
/// Its stores and CASes are reported to the region
/// ([`RegionMem::note_stored`]), so `sim`'s private core caches drop other
/// cores' copies of a line this one wrote, as they do for
/// [`NodeMem`]'s stores (docs/xtree.md, invariant 12).
struct NodeSlice<'a> {
    words: &'a [AtomicU64],
    mem: &'a RegionMem,
    /// The node's byte offset in `mem`.
    base: u64,
}

/// The atomics are [`QuietWords`]'s; a store or CAS is then reported.
impl NodeWords for NodeSlice<'_> {
    fn load(&self, i: usize) -> u64 {
        QuietWords(self.words).load(i)
    }
    fn store(&self, i: usize, v: u64) {
        QuietWords(self.words).store(i, v);
        self.mem.note_stored(self.base + 8 * i as u64, 8);
    }
    fn cas(&self, i: usize, expected: u64, new: u64) -> u64 {
        let found = QuietWords(self.words).cas(i, expected, new);
        // Also when it fails, as `RegionMem::cas_u64`: a locked
        // compare-exchange takes the line exclusively either way.
        self.mem.note_stored(self.base + 8 * i as u64, 8);
        found
    }
}

impl NodeSlice<'_> {
    /// [`commit`] of `changes` to this node, locked at `x`, with one write
    /// report of the node's every line after it ([`RegionMem::note_stored`]
    /// of the node's bytes) in place of one per store: the protocol stores
    /// every line's version word, so the same lines are reported, and a
    /// `sim` job runs alone, so no core's access falls between the stores
    /// and the report. The stores themselves are the protocol's, in its
    /// order ([`QuietWords`]). Returns the new version.
    fn commit(&self, geo: &Geometry, x: u64, changes: &[(usize, u64)]) -> u64 {
        let y = commit(&QuietWords(self.words), geo, x, changes);
        self.mem.note_stored(self.base, commit_span(geo));
        y
    }
}

/// The bytes, from a node's start, that [`NodeSlice::commit`] reports as
/// written: the whole node, since [`commit`] stores every line's version
/// word whatever it changes (checked against the protocol's stores by
/// `tests::a_commit_reports_every_line_it_stores`).
fn commit_span(geo: &Geometry) -> u64 {
    geo.node_bytes() as u64
}

/// A node's words with [`NodeMem`]'s orderings and no write report:
/// [`NodeSlice`]'s atomics, and what [`NodeSlice::commit`] stores
/// through (it reports the node's lines itself).
struct QuietWords<'a>(&'a [AtomicU64]);

impl NodeWords for QuietWords<'_> {
    fn load(&self, i: usize) -> u64 {
        self.0[i].load(Ordering::Acquire)
    }
    fn store(&self, i: usize, v: u64) {
        self.0[i].store(v, Ordering::Release);
    }
    fn cas(&self, i: usize, expected: u64, new: u64) -> u64 {
        match self.0[i].compare_exchange(expected, new, Ordering::AcqRel, Ordering::Acquire) {
            Ok(v) | Err(v) => v,
        }
    }
}

/// An inner node's keys and children, loaded in place and checked by
/// [`XTree::inner_in_place`]: `count` of each, in slot order, on the
/// stack (no allocation; the node itself is not copied).
struct InnerInPlace {
    count: usize,
    keys: [u64; MAX_SLOTS],
    children: [u32; MAX_SLOTS],
}

impl InnerInPlace {
    /// Key `j` (`j < count`): child `j`'s lower bound.
    #[inline(always)]
    fn key(&self, j: usize) -> u64 {
        self.keys[j]
    }

    /// Child `j`'s node (`j < count`).
    #[inline(always)]
    fn child(&self, j: usize) -> u32 {
        self.children[j]
    }
}

/// A node's words in place, reported one 64-byte line at a time: the
/// node's words are bounds-checked once ([`RegionMem::words_in_untouched`])
/// and a line is `sim`-touched ([`RegionMem::touch_span`] of its 64 bytes)
/// at the first load of one of its words; later loads of its words are
/// plain atomic loads. So a reader that loads a few words of a node (the
/// walk: the meta word, the header, the keys its linear scan reads, the
/// child pointer it follows) touches, and is charged, the lines holding
/// those words and no other (docs/xtree.md, invariant 10), where a
/// [`NodeSlice`] touches every line of the node when it is made.
struct NodeLines<'a> {
    mem: &'a RegionMem,
    base: u64,
    words: &'a [AtomicU64],
    /// Whether touches count ([`RegionMem::touches_counted`], read once
    /// per walk): off `sim` no line is reported and no bitmap kept.
    counted: bool,
    /// Bit `l`: line `l` was touched.
    taken: u64,
}

impl<'a> NodeLines<'a> {
    /// The node of `bytes` bytes at byte `base` of `mem`; no line touched.
    /// `counted`: [`RegionMem::touches_counted`], read by the caller once.
    #[inline(always)]
    fn new(mem: &'a RegionMem, base: u64, bytes: usize, counted: bool) -> Self {
        NodeLines {
            mem,
            base,
            words: mem
                .words_in_untouched(base, bytes)
                .expect("node numbers are checked against the region"),
            counted,
            taken: 0,
        }
    }

    /// Word `i` of the node (versions included, as [`NodeWords::load`]),
    /// touching its line first if no word of it was loaded yet. Always
    /// inlined: the walk loads about seven words per inner node.
    #[inline(always)]
    fn load(&mut self, i: usize) -> u64 {
        let l = i / WORDS_PER_LINE;
        // (Tests keep the bitmap off `sim` too: `taken`.)
        if (self.counted || cfg!(test)) && self.taken & 1 << l == 0 {
            self.taken |= 1 << l;
            self.mem
                .touch_span(self.base + (l * LINE_BYTES) as u64, LINE_BYTES as u64);
        }
        self.words[i].load(Ordering::Acquire)
    }

    /// Word `i` of the node without touching its line: for a scan whose
    /// lines the caller reports together, as one access
    /// ([`Self::touch_words`]).
    #[inline(always)]
    fn peek(&self, i: usize) -> u64 {
        self.words[i].load(Ordering::Acquire)
    }

    /// Reports the lines holding words `first..=last` as ONE access (one
    /// [`RegionMem::touch_span`] from `first`'s line to `last`'s), unless
    /// every one of them was taken already: a linear scan over words whose
    /// addresses are known together (an inner node's keys, a leaf's key
    /// words once its count is read), whose loads a core issues together so
    /// that their misses overlap (docs/xtree.md, invariants 10 and 11; under
    /// `sim` only the access's first line, if new to the job and missing,
    /// is charged the DRAM latency). Lines in the span taken before are
    /// free, as a job's lines are charged once.
    #[inline(always)]
    fn touch_words(&mut self, first: usize, last: usize) {
        let (l0, l1) = (first / WORDS_PER_LINE, last / WORDS_PER_LINE);
        debug_assert!(l0 <= l1 && l1 < 63);
        let span = ((1u64 << (l1 + 1)) - 1) & !((1u64 << l0) - 1);
        // (Tests keep the bitmap off `sim` too: `taken`.)
        if (self.counted || cfg!(test)) && self.taken & span != span {
            self.taken |= span;
            self.mem.touch_span(
                self.base + (l0 * LINE_BYTES) as u64,
                ((l1 - l0 + 1) * LINE_BYTES) as u64,
            );
        }
    }

    /// The lines touched so far, as a bitmap (bit `l`: line `l`); for tests.
    #[cfg(test)]
    fn taken(&self) -> u64 {
        self.taken
    }
}

/// The slot of `key` among a leaf's first `count` key words, read in place
/// in slot order up to `key` (a linear search, as `NodeImage::find`), their
/// lines reported as one access after the header's
/// ([`NodeLines::touch_words`], from `K_0`'s line to the last key read:
/// the key words' addresses are known together once the count is read;
/// docs/xtree.md, invariant 11). Nothing is touched when `count` is 0.
#[inline(always)]
fn scan_leaf_keys(
    geo: &Geometry,
    words: &mut NodeLines<'_>,
    count: usize,
    key: u64,
) -> Option<usize> {
    let (found, last) = find_key_word(geo, count, key, |w| words.peek(w));
    if count > 0 {
        words.touch_words(geo.payload_word(geo.key(0)), last);
    }
    found
}

/// The linear search of a leaf's first `count` key words for `key`, in
/// slot order, each word loaded by `load` (given its index in the node's
/// words) and the search stopping at the first match: the slot found, and
/// the index of the last key word loaded (`K_0`'s when `count` is 0). The
/// key words are stepped to in turn, over each line's version word, as
/// `payload_offsets` steps (no division per word). Shared by the leaf's
/// searches in place: `scan_leaf_keys` (the hinted write, which touches
/// the lines it read), `XTree::leaf_slot_in_place` (GET) and
/// `XTree::leaf_apply` (writes under the leaf's lock).
#[inline(always)]
fn find_key_word(
    geo: &Geometry,
    count: usize,
    key: u64,
    mut load: impl FnMut(usize) -> u64,
) -> (Option<usize>, usize) {
    let first = geo.payload_word(geo.key(0));
    let (mut w, mut last) = (first, first);
    for j in 0..count {
        last = w;
        if load(w) == key {
            return (Some(j), last);
        }
        w += 1;
        if w.is_multiple_of(WORDS_PER_LINE) {
            w += 1; // the next line's version word
        }
    }
    (None, last)
}

/// An XTree on one memory node.
pub struct XTree {
    geo: Geometry,
    cfg: XTreeConfig,
    nodes: Region,
    values: Region,
    node_alloc: SlabAllocator,
    value_alloc: SizeClassAllocator,
    /// Shared: operations inside one leaf. Exclusive: splits.
    structure: RwLock<()>,
    /// Highest node number handed out; hints above it are refused.
    high_node: AtomicU32,
    counters: Counters,
    split_hook: RwLock<Option<SplitHook>>,
}

impl XTree {
    /// Registers the node region `node_region` and the value region
    /// `value_region` on `rt` and builds an empty tree (one empty leaf).
    pub fn create(
        rt: &NodeRuntime,
        node_region: &str,
        value_region: &str,
        cfg: XTreeConfig,
    ) -> Result<Arc<XTree>, XTreeError> {
        let geo = Geometry::new(cfg.slots).map_err(|e| XTreeError::Config(e.to_string()))?;
        if cfg.max_nodes == 0 || cfg.max_nodes >= u32::MAX as u64 {
            return Err(XTreeError::Config(format!(
                "max_nodes {} must be between 1 and 2^32 - 2",
                cfg.max_nodes
            )));
        }
        let nb = geo.node_bytes() as u64;
        let node_len = (cfg.max_nodes + 1)
            .checked_mul(nb)
            .and_then(|l| usize::try_from(l).ok())
            .ok_or_else(|| XTreeError::Config("node region too large".into()))?;
        if cfg.value_region_bytes > crate::layout::FAT_OFFSET_MASK {
            return Err(XTreeError::Config(
                "value region exceeds the 40-bit offsets of fat pointers".into(),
            ));
        }
        let value_len = cfg.value_region_bytes.max(4096) as usize;
        let reg = |name: &str, len: usize| {
            rt.register_region(name, len)
                .map_err(|e| XTreeError::Config(format!("region {name}: {e}")))
        };
        let nodes = reg(node_region, node_len)?;
        let values = reg(value_region, value_len)?;
        let node_alloc = SlabAllocator::new(node_region, &nodes, nb, nb, nodes.len());
        let max_class = (block_bytes(MAX_VALUE_LEN) as u64).next_power_of_two();
        let value_alloc =
            SizeClassAllocator::new(value_region, &values, 0, values.len(), 32, max_class);
        let tree = XTree {
            geo,
            cfg,
            nodes,
            values,
            node_alloc,
            value_alloc,
            structure: RwLock::new(()),
            high_node: AtomicU32::new(0),
            counters: Counters::default(),
            split_hook: RwLock::new(None),
        };
        let root = tree.alloc_node()?;
        tree.write_node(root, Header::default(), Meta::default(), &[], &[]);
        tree.counters.leaves.store(1, Ordering::Relaxed);
        let mem = &tree.nodes.mem;
        mem.store_u64(SUPERBLOCK_FORMAT_OFFSET, format_word(geo.slots()))
            .expect("superblock inside the region");
        mem.store_u64(
            SUPERBLOCK_ROOT_OFFSET,
            RootWord {
                node: root,
                height: 1,
            }
            .pack(),
        )
        .expect("superblock inside the region");
        Ok(Arc::new(tree))
    }

    pub fn geometry(&self) -> Geometry {
        self.geo
    }

    pub fn config(&self) -> XTreeConfig {
        self.cfg
    }

    /// The node region as clients address it.
    pub fn node_region(&self) -> RemoteRegion {
        self.nodes.remote
    }

    /// The value region as clients address it.
    pub fn value_region(&self) -> RemoteRegion {
        self.values.remote
    }

    /// Installs (or removes) the split hook.
    pub fn set_split_hook(&self, hook: Option<SplitHook>) {
        *self.split_hook.write() = hook;
    }

    /// The current root word.
    pub fn root(&self) -> RootWord {
        let w = self
            .nodes
            .mem
            .load_u64(SUPERBLOCK_ROOT_OFFSET)
            .expect("superblock inside the region");
        RootWord::unpack(w).expect("the tree writes valid root words")
    }

    pub fn stats(&self) -> TreeStats {
        let c = &self.counters;
        TreeStats {
            slots: self.geo.slots() as u64,
            height: self.root().height as u64,
            leaves: c.leaves.load(Ordering::Relaxed),
            inner_nodes: c.inner_nodes.load(Ordering::Relaxed),
            keys: c.keys.load(Ordering::Relaxed),
            leaf_splits: c.leaf_splits.load(Ordering::Relaxed),
            inner_splits: c.inner_splits.load(Ordering::Relaxed),
            max_nodes: self.cfg.max_nodes,
            value_bytes_live: self.value_alloc.live_bytes(),
            value_region_bytes: self.values.len(),
            hinted_updates: c.hinted.load(Ordering::Relaxed),
            hinted_updates_used: c.hinted_used.load(Ordering::Relaxed),
        }
    }

    /// Keys stored: [`TreeStats::keys`] alone, without the root word's load
    /// (a superblock line on `sim`) and the other counters, for a caller
    /// that reads it on every write (XStore's model-expansion check).
    pub fn key_count(&self) -> u64 {
        self.counters.keys.load(Ordering::Relaxed)
    }

    /// Leaves tried by hinted updates so far, over all hints (kept apart
    /// from [`TreeStats`], whose fields rpc-btree's wire carries).
    pub fn hinted_leaves_tried(&self) -> u64 {
        self.counters.hinted_leaves.load(Ordering::Relaxed)
    }

    // ---- public operations -------------------------------------------------

    /// The value of `key`.
    pub fn get(&self, key: u64) -> Result<Option<Vec<u8>>, XTreeError> {
        self.get_with(key, <[u8]>::to_vec)
    }

    /// `f` of the value of `key` (the bytes where they lie: an inline value
    /// on the stack, an out-of-line one in the block read), `None` if the
    /// key is absent. The lean read path: the leaf is read in place, word
    /// by word, and validated by the version protocol with every check
    /// [`NodeView::parse`] makes of a leaf ([`Self::leaf_slot_in_place`]);
    /// nothing is copied or zeroed, nothing allocated for an inline value.
    pub fn get_with<R>(
        &self,
        key: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<Option<R>, XTreeError> {
        dmkv_transport::sim::work(cost::GET);
        let _shared = self.structure.read();
        let leaf = self.descend_to_leaf(key);
        let mut block = Vec::new();
        for _ in 0..MAX_READ_RETRIES {
            let Some(found) = self.read_leaf_slot(leaf, key)? else {
                // Not a leaf by its meta word (never, for a node the walk
                // ended on: a node's level never changes): the copy path,
                // with its inner-node checks, as before.
                return self.get_copied(leaf, key, f);
            };
            let Some(value) = found else {
                return Ok(None);
            };
            match value {
                SlotValue::Inline(b) => return Ok(Some(f(&b))),
                SlotValue::OutOfLine(fat) => {
                    if let Some(v) = self.read_block(key, fat, &mut block) {
                        return Ok(Some(f(v)));
                    }
                }
            }
            // The block was freed and reused under us: the leaf changed.
        }
        Err(XTreeError::Corrupt(format!("get {key:#x} never settled")))
    }

    /// [`Self::get_with`] on a consistent copy of `leaf` (the path before
    /// the in-place read), for a node whose meta word says it is no leaf.
    #[cold]
    #[inline(never)]
    fn get_copied<R>(
        &self,
        leaf: u32,
        key: u64,
        f: impl FnOnce(&[u8]) -> R,
    ) -> Result<Option<R>, XTreeError> {
        let mut buf = [0u8; MAX_NODE_BYTES];
        let mut block = Vec::new();
        for _ in 0..MAX_READ_RETRIES {
            let img = self.read_consistent_image(leaf, &mut buf)?;
            let Some(j) = img.find(key) else {
                return Ok(None);
            };
            match img.value(j) {
                SlotValue::Inline(b) => return Ok(Some(f(&b))),
                SlotValue::OutOfLine(fat) => {
                    if let Some(v) = self.read_block(key, fat, &mut block) {
                        return Ok(Some(f(v)));
                    }
                }
            }
            // The block was freed and reused under us: the leaf changed.
        }
        Err(XTreeError::Corrupt(format!("get {key:#x} never settled")))
    }

    /// Inserts a new pair; false (and no change) if `key` is present.
    pub fn insert(&self, key: u64, value: &[u8]) -> Result<bool, XTreeError> {
        self.modify(key, WriteOp::Insert(value))
    }

    /// Replaces the value of a present key; false if it is absent.
    pub fn update(&self, key: u64, value: &[u8]) -> Result<bool, XTreeError> {
        self.modify(key, WriteOp::Update(value))
    }

    /// Inserts or replaces; true if the key was new.
    pub fn upsert(&self, key: u64, value: &[u8]) -> Result<bool, XTreeError> {
        self.modify(key, WriteOp::Upsert(value))
    }

    /// Removes `key`; false if it was absent.
    pub fn delete(&self, key: u64) -> Result<bool, XTreeError> {
        self.modify(key, WriteOp::Delete)
    }

    /// Up to `n` pairs with key >= `start`, in key order. Not atomic across
    /// leaves (as in the paper); each leaf is read consistently.
    pub fn scan(&self, start: u64, n: usize) -> Result<Vec<(u64, Vec<u8>)>, XTreeError> {
        let _shared = self.structure.read();
        let mut leaf = self.descend_to_leaf(start);
        let mut out = Vec::new();
        while out.len() < n && leaf != NO_NODE {
            let mut settled = false;
            for _ in 0..MAX_READ_RETRIES {
                let img = self.read_consistent(leaf)?;
                let mut part = Vec::new();
                let mut complete = true;
                for (k, sv) in img.sorted_pairs() {
                    if k < start {
                        continue;
                    }
                    if out.len() + part.len() == n {
                        break;
                    }
                    match self.resolve(k, sv) {
                        Some(v) => part.push((k, v)),
                        None => {
                            complete = false;
                            break;
                        }
                    }
                }
                if complete {
                    out.extend(part);
                    leaf = img.header().next;
                    settled = true;
                    break;
                }
            }
            if !settled {
                return Err(XTreeError::Corrupt(format!(
                    "scan at leaf {leaf} never settled"
                )));
            }
        }
        Ok(out)
    }

    /// Loads pairs (upserting), holding the tree exclusively once for the
    /// batch. Sorted input fills leaves left to right, leaving them about
    /// half full after their splits, as in the paper. On `Exhausted` the
    /// pairs before the failing one stay loaded.
    pub fn bulk_load(&self, pairs: &[(u64, &[u8])]) -> Result<(), XTreeError> {
        for (k, v) in pairs {
            check_value(*k, v)?;
        }
        let mut order: Vec<usize> = (0..pairs.len()).collect();
        order.sort_unstable_by_key(|&i| pairs[i].0);
        let mut events = Vec::new();
        let res = {
            let _excl = self.structure.write();
            order.iter().try_for_each(|&i| {
                let (k, v) = pairs[i];
                self.apply_exclusive(k, WriteOp::Upsert(v), &mut events)
                    .map(|_| ())
            })
        };
        self.fire(&events);
        res
    }

    /// The leaf that holds (or would hold) `key`, with its incarnation.
    pub fn find_leaf(&self, key: u64) -> Result<LeafRef, XTreeError> {
        let _shared = self.structure.read();
        let leaf = self.descend_to_leaf(key);
        let mut buf = [0u8; MAX_NODE_BYTES];
        let img = self.read_consistent_image(leaf, &mut buf)?;
        Ok(LeafRef {
            node: leaf,
            incarnation: img.header().incarnation,
        })
    }

    /// Every leaf in key order (leftmost first, along right links), each
    /// read consistently. Concurrent writers may change leaves between
    /// reads; splits wait until the iteration ends.
    pub fn leaves(&self) -> Result<Vec<LeafInfo>, XTreeError> {
        let _shared = self.structure.read();
        let mut leaf = self.descend_to_leaf(0);
        let mut out = Vec::new();
        while leaf != NO_NODE {
            let img = self.read_consistent(leaf)?;
            let mut keys = img.keys.keys.clone();
            keys.sort_unstable();
            out.push(LeafInfo {
                node: leaf,
                incarnation: img.header().incarnation,
                count: img.header().count,
                keys,
            });
            leaf = img.header().next;
        }
        Ok(out)
    }

    /// The leaves whose key ranges intersect `[lo, hi]` (inclusive), in key
    /// order, each with its exact range, at most `max_leaves` of them. The
    /// whole walk holds the tree lock shared, so no split happens during it:
    /// the result is one consistent picture of the leaf level over that
    /// range (XStore trains a sub-model and its translation table on it).
    /// Leaves are read consistently; inserts into leaves with room may still
    /// change their keys between reads.
    pub fn leaves_covering(
        &self,
        lo: u64,
        hi: u64,
        max_leaves: usize,
    ) -> Result<Vec<CoveredLeaf>, XTreeError> {
        if lo > hi || max_leaves == 0 {
            return Ok(Vec::new());
        }
        let _shared = self.structure.read();
        let mut out = Vec::new();
        self.cover(self.root().node, 0, None, lo, hi, max_leaves, &mut out)?;
        Ok(out)
    }

    /// Depth-first part of [`Self::leaves_covering`]: `node` covers
    /// `[lower, upper)` (`None`: no upper bound).
    #[allow(clippy::too_many_arguments)]
    fn cover(
        &self,
        node: u32,
        lower: u64,
        upper: Option<u64>,
        lo: u64,
        hi: u64,
        max_leaves: usize,
        out: &mut Vec<CoveredLeaf>,
    ) -> Result<(), XTreeError> {
        let meta = self
            .node_mem(node)
            .load(self.geo.payload_word(Geometry::META));
        if meta & 0xFF == 0 {
            let mut keys = Vec::new();
            let header = self
                .read_leaf_keys(node, &mut keys)?
                .ok_or_else(|| XTreeError::Corrupt(format!("node {node}: no longer a leaf")))?;
            keys.sort_unstable();
            out.push(CoveredLeaf {
                info: LeafInfo {
                    node,
                    incarnation: header.incarnation,
                    count: header.count,
                    keys,
                },
                lower,
                upper,
            });
            return Ok(());
        }
        dmkv_transport::sim::work(cost::COVER_INNER);
        let inner = self
            .inner_in_place(node)
            .map_err(|e| XTreeError::Corrupt(format!("node {node}: {e}")))?;
        for j in 0..inner.count {
            if out.len() == max_leaves {
                break;
            }
            let child_lower = inner.key(j);
            let child_upper = if j + 1 < inner.count {
                Some(inner.key(j + 1))
            } else {
                upper
            };
            let intersects = child_lower <= hi && child_upper.is_none_or(|u| u > lo);
            if intersects {
                self.cover(
                    inner.child(j),
                    child_lower,
                    child_upper,
                    lo,
                    hi,
                    max_leaves,
                    out,
                )?;
            }
        }
        Ok(())
    }

    /// Node `node`'s words for a read in place, every line touched once
    /// ([`RegionMem::words_in`], as a copy of the node touches them).
    #[inline(always)]
    fn node_words_in_place(&self, node: u32) -> QuietWords<'_> {
        QuietWords(
            self.nodes
                .mem
                .words_in(self.node_mem(node).base, self.geo.node_bytes())
                .expect("node numbers are checked against the region"),
        )
    }

    /// Inner node `node` read in place for the covering walk (twenty-seventh
    /// session; a copy parsed by
    /// [`NodeView::parse_locked`] before): the caller holds `structure`,
    /// under which inner nodes do not change (docs/xtree.md, "Concurrency on
    /// the memory node"), so no version words are read, as [`Self::walk`]
    /// reads none. The node is checked as `parse_locked` checks it, with the
    /// same errors in the same order (the head, then strictly ascending
    /// keys, then every child pointer valid), before the caller visits any
    /// child; a node whose meta says leaf is an error too (the caller read
    /// an inner level a moment before, and levels do not change). Every
    /// line of the node is touched once, as the copy touched them
    /// ([`RegionMem::words_in`]), so `sim` charges the same lines.
    fn inner_in_place(&self, node: u32) -> Result<InnerInPlace, ViewError> {
        let geo = &self.geo;
        let words = self.node_words_in_place(node);
        let (header, meta) = check_head_words(
            geo,
            words.load(geo.payload_word(Geometry::HDR)),
            words.load(geo.payload_word(Geometry::META)),
        )?;
        if meta.level == 0 {
            return Err(ViewError::Malformed("no longer an inner node".into()));
        }
        // check_head_words bounds the count by the node's slots, and a
        // node has at most MAX_SLOTS.
        let count = header.count as usize;
        let mut inner = InnerInPlace {
            count,
            keys: [0; MAX_SLOTS],
            children: [0; MAX_SLOTS],
        };
        // One pass over the key words and the slot words, stepping over each
        // line's version word as the walk does; the copy's two checks are
        // reported in its order (keys first) whichever word failed first.
        let (mut kw, mut sw) = (geo.payload_word(geo.key(0)), geo.payload_word(geo.slot(0)));
        let (mut ascending, mut pointers) = (true, true);
        for j in 0..count {
            let key = words.load(kw);
            ascending &= j == 0 || inner.keys[j - 1] < key;
            inner.keys[j] = key;
            match ChildPtr::unpack(words.load(sw)) {
                Some(c) => inner.children[j] = c.node,
                None => pointers = false,
            }
            kw += 1;
            if kw.is_multiple_of(WORDS_PER_LINE) {
                kw += 1; // the next line's version word
            }
            sw += 1;
            if sw.is_multiple_of(WORDS_PER_LINE) {
                sw += 1;
            }
        }
        if !ascending {
            return Err(ViewError::Malformed(
                "inner keys are not strictly ascending".into(),
            ));
        }
        if !pointers {
            return Err(ViewError::Malformed(
                "an inner node with an invalid child pointer".into(),
            ));
        }
        Ok(inner)
    }

    /// UPDATE with a position hint of one leaf (XStore §5.3.1): if `hint`
    /// names a leaf of that incarnation holding `key`, update it there
    /// without a traversal; otherwise traverse. A hint that names no leaf at
    /// all is a bad request. [`Self::update_hinted_leaves`] with one leaf.
    pub fn update_hinted(
        &self,
        key: u64,
        value: &[u8],
        hint: LeafRef,
    ) -> Result<HintedUpdate, XTreeError> {
        self.update_hinted_leaves(key, value, std::slice::from_ref(&hint))
    }

    /// UPDATE with a position hint of up to [`MAX_HINT_LEAVES`] leaves
    /// (XStore §5.3.1: the leaves the client's model predicts for `key`,
    /// most likely first): each hinted leaf is tried in the order given,
    /// under the tree lock shared and the leaf's own lock, and the first
    /// whose image shows the hinted incarnation and holds `key` is updated
    /// in place, without a traversal; when none does (a stale or wrong
    /// hint), the update traverses as [`Self::update`] does. A leaf whose
    /// incarnation differs is never written (its range may have changed
    /// by a split), and a leaf that lacks the key is left unchanged.
    ///
    /// Refused as a bad request before any leaf is tried: an empty hint, a
    /// hint of more than [`MAX_HINT_LEAVES`] leaves, an entry naming no node
    /// of this tree or an incarnation wider than 24 bits, the same node
    /// twice. An entry naming an inner node is refused when it is reached
    /// (its level is read under its lock); entries after the one that held
    /// the key are not read.
    pub fn update_hinted_leaves(
        &self,
        key: u64,
        value: &[u8],
        hints: &[LeafRef],
    ) -> Result<HintedUpdate, XTreeError> {
        dmkv_transport::sim::work(cost::HINTED_BASE);
        check_value(key, value)?;
        if hints.is_empty() || hints.len() > MAX_HINT_LEAVES {
            return Err(XTreeError::BadRequest(format!(
                "a hint of {} leaves (1..={MAX_HINT_LEAVES})",
                hints.len()
            )));
        }
        let high = self.high_node.load(Ordering::Acquire);
        for (i, hint) in hints.iter().enumerate() {
            if hint.node == NO_NODE || hint.node > high {
                return Err(XTreeError::BadRequest(format!(
                    "hint names node {}, which is not a node of this tree",
                    hint.node
                )));
            }
            if hint.incarnation > INCARNATION_MASK {
                return Err(XTreeError::BadRequest(format!(
                    "hint incarnation {} exceeds 24 bits",
                    hint.incarnation
                )));
            }
            if hints[..i].iter().any(|h| h.node == hint.node) {
                return Err(XTreeError::BadRequest(format!(
                    "hint names node {} twice",
                    hint.node
                )));
            }
        }
        self.counters.hinted.fetch_add(1, Ordering::Relaxed);
        {
            let _shared = self.structure.read();
            for hint in hints {
                if self.try_hinted_leaf(key, value, *hint)? {
                    self.counters.hinted_used.fetch_add(1, Ordering::Relaxed);
                    return Ok(HintedUpdate {
                        updated: true,
                        hint_used: true,
                    });
                }
            }
        }
        Ok(HintedUpdate {
            updated: self.update(key, value)?,
            hint_used: false,
        })
    }

    /// One leaf of a position hint (the caller holds `structure` shared):
    /// true if the leaf showed the hinted incarnation and held `key`, now
    /// updated; false (the leaf unchanged) otherwise. Not inlined, so that
    /// callgrind counts its calls (its declared work, `cost::HINTED_LEAF`).
    ///
    /// Under the leaf's lock no other writer changes the leaf (splits hold
    /// `structure` exclusive), so the leaf is read in place, word by word
    /// through [`NodeLines`], not copied: the header and meta (checked as
    /// `NodeImage::parse_locked` checks them), then, if the incarnation is
    /// the hinted one, the key words in slot order until `key` is found,
    /// then its slot word. Only the lines holding those words are touched
    /// (docs/xtree.md, invariant 11): a stale incarnation reads line 0, a
    /// leaf without the key its key lines; a write touches every line
    /// first ([`Self::node_slice`]), as its commit stores every line's
    /// version word. The change itself is the one `replace_value` commits
    /// for every write (the version protocol unchanged).
    #[inline(never)]
    fn try_hinted_leaf(&self, key: u64, value: &[u8], hint: LeafRef) -> Result<bool, XTreeError> {
        dmkv_transport::sim::work(cost::HINTED_LEAF);
        self.counters.hinted_leaves.fetch_add(1, Ordering::Relaxed);
        let geo = &self.geo;
        let mut words = NodeLines::new(
            &self.nodes.mem,
            self.node_mem(hint.node).base,
            geo.node_bytes(),
            RegionMem::touches_counted(),
        );
        // Line 0 first: the lock's word.
        words.load(geo.version_word(0));
        let nm = NodeSlice {
            words: words.words,
            mem: words.mem,
            base: words.base,
        };
        let x = lock(&nm);
        let head = check_head_words(
            geo,
            words.load(geo.payload_word(Geometry::HDR)),
            words.load(geo.payload_word(Geometry::META)),
        );
        let (header, meta) = match head {
            Ok(h) => h,
            Err(e) => {
                unlock_unchanged(&nm, x);
                return Err(XTreeError::Corrupt(format!("node {}: {e}", hint.node)));
            }
        };
        if meta.level != 0 {
            unlock_unchanged(&nm, x);
            return Err(XTreeError::BadRequest(format!(
                "hint names node {}, an inner node",
                hint.node
            )));
        }
        if header.incarnation == hint.incarnation
            && let Some(j) = scan_leaf_keys(geo, &mut words, header.count as usize, key)
        {
            dmkv_transport::sim::work(cost::HINTED_WRITE);
            let old = SlotValue::decode(&meta, j, words.load(geo.payload_word(geo.slot(j))));
            self.replace_value(&self.node_slice(hint.node), x, meta, j, old, key, value)?;
            return Ok(true);
        }
        unlock_unchanged(&nm, x);
        Ok(false)
    }

    /// Checks every structural invariant of docs/xtree.md on a quiescent
    /// tree (it holds the tree exclusively): key ranges nest, inner keys are
    /// sorted with `K_0` the node's lower bound, child pointers carry their
    /// children's incarnations and levels step down by one, leaf keys are
    /// distinct and inside their ranges, out-of-line blocks validate, the
    /// right links chain the leaves in key order, the root has no right
    /// sibling, and the counters match. Tests call it after every phase.
    pub fn check_structure(&self) -> Result<(), String> {
        let _excl = self.structure.write();
        let root = self.root();
        let img = self.read_locked(root.node).map_err(|e| e.to_string())?;
        if img.header().next != NO_NODE {
            return Err(format!("root {} has a right sibling", root.node));
        }
        if img.level() != root.root_level() {
            return Err(format!(
                "root level {} but height {}",
                img.level(),
                root.height
            ));
        }
        let mut walk = Walk::default();
        self.check_node(root.node, img, 0, None, &mut walk)?;
        for (i, &leaf) in walk.leaves.iter().enumerate() {
            let next = self
                .read_locked(leaf)
                .map_err(|e| e.to_string())?
                .header()
                .next;
            let want = walk.leaves.get(i + 1).copied().unwrap_or(NO_NODE);
            if next != want {
                return Err(format!(
                    "leaf {leaf} links to {next}, the next leaf is {want}"
                ));
            }
        }
        let c = &self.counters;
        let figures = [
            (
                "leaves",
                walk.leaves.len() as u64,
                c.leaves.load(Ordering::Relaxed),
            ),
            (
                "inner nodes",
                walk.inner,
                c.inner_nodes.load(Ordering::Relaxed),
            ),
            ("keys", walk.keys, c.keys.load(Ordering::Relaxed)),
        ];
        for (what, found, counted) in figures {
            if found != counted {
                return Err(format!("{found} {what} in the tree, {counted} counted"));
            }
        }
        Ok(())
    }

    fn check_node(
        &self,
        node: u32,
        img: NodeView,
        lo: u64,
        hi: Option<u64>,
        walk: &mut Walk,
    ) -> Result<(), String> {
        let inside = |k: u64| k >= lo && hi.is_none_or(|h| k < h);
        let keys = &img.keys.keys;
        if img.level() == 0 {
            let mut sorted = keys.clone();
            sorted.sort_unstable();
            if sorted.windows(2).any(|w| w[0] == w[1]) {
                return Err(format!("leaf {node} holds a key twice"));
            }
            if let Some(k) = keys.iter().find(|&&k| !inside(k)) {
                return Err(format!(
                    "leaf {node} holds {k:#x} outside [{lo:#x}, {hi:?})"
                ));
            }
            for (j, &k) in keys.iter().enumerate() {
                if self.resolve(k, img.value(j)).is_none() {
                    return Err(format!("leaf {node} slot {j}: its value block is invalid"));
                }
            }
            walk.leaves.push(node);
            walk.keys += keys.len() as u64;
            return Ok(());
        }
        walk.inner += 1;
        if keys[0] != lo {
            return Err(format!(
                "inner {node}: K_0 {:#x} is not its lower bound {lo:#x}",
                keys[0]
            ));
        }
        if let Some(k) = keys.iter().find(|&&k| !inside(k)) {
            return Err(format!(
                "inner {node}: key {k:#x} outside [{lo:#x}, {hi:?})"
            ));
        }
        for j in 0..keys.len() {
            let c = img.child(j);
            let child = self.read_locked(c.node).map_err(|e| e.to_string())?;
            if child.header().incarnation != c.incarnation {
                return Err(format!(
                    "inner {node} points to {} with incarnation {}, it has {}",
                    c.node,
                    c.incarnation,
                    child.header().incarnation
                ));
            }
            if child.level() + 1 != img.level() {
                return Err(format!(
                    "inner {node} at level {} has child {} at level {}",
                    img.level(),
                    c.node,
                    child.level()
                ));
            }
            let child_hi = keys.get(j + 1).copied().or(hi);
            self.check_node(c.node, child, keys[j], child_hi, walk)?;
        }
        Ok(())
    }

    // ---- writes --------------------------------------------------------------

    fn modify(&self, key: u64, op: WriteOp<'_>) -> Result<bool, XTreeError> {
        if let WriteOp::Insert(v) | WriteOp::Update(v) | WriteOp::Upsert(v) = op {
            check_value(key, v)?;
        }
        {
            let _shared = self.structure.read();
            let leaf = self.descend_to_leaf(key);
            if let LeafOutcome::Done(b) = self.leaf_apply(leaf, key, op)? {
                return Ok(b);
            }
        }
        let mut events = Vec::new();
        let res = {
            let _excl = self.structure.write();
            self.apply_exclusive(key, op, &mut events)
        };
        self.fire(&events);
        res
    }

    fn fire(&self, events: &[SplitEvent]) {
        if events.is_empty() {
            return;
        }
        let hook = self.split_hook.read().clone();
        if let Some(h) = hook {
            events.iter().for_each(|e| h(e));
        }
    }

    /// Applies `op` to `key` in `leaf` under the leaf's lock, unless it
    /// needs a split. The caller holds `structure` (so `leaf` covers `key`).
    fn leaf_apply(&self, leaf: u32, key: u64, op: WriteOp<'_>) -> Result<LeafOutcome, XTreeError> {
        dmkv_transport::sim::work(cost::LEAF_WRITE);
        let nm = self.node_slice(leaf);
        let x = lock(&nm);
        // The leaf is ours while locked (no other writer; splits hold
        // `structure` exclusive): read in place, word by word, its header
        // and meta checked as `NodeImage::parse_locked` checks a leaf's
        // (`check_head_words`), searched and changed in place (only the
        // words that change are written, by the protocol). `node_slice`
        // touched every line already, as the copy it replaces touched them
        // again (a re-touch within a job is free on `sim`).
        let geo = &self.geo;
        let word = |i: usize| nm.load(geo.payload_word(i));
        let (hdr, meta) = match check_head_words(geo, word(Geometry::HDR), word(Geometry::META)) {
            Ok((h, m)) if m.level == 0 => (h, m),
            Ok(_) => {
                unlock_unchanged(&nm, x);
                return Err(XTreeError::Corrupt(format!(
                    "node {leaf}: an inner node where the descent ends"
                )));
            }
            Err(e) => {
                unlock_unchanged(&nm, x);
                return Err(XTreeError::Corrupt(format!("node {leaf}: {e}")));
            }
        };
        let count = hdr.count as usize;
        let value = |j: usize| SlotValue::decode(&meta, j, word(geo.slot(j)));
        let (found, _) = find_key_word(geo, count, key, |i| nm.load(i));
        match (found, op) {
            (Some(_), WriteOp::Insert(_)) | (None, WriteOp::Update(_) | WriteOp::Delete) => {
                unlock_unchanged(&nm, x);
                Ok(LeafOutcome::Done(false))
            }
            (Some(j), WriteOp::Update(v) | WriteOp::Upsert(v)) => {
                self.replace_value(&nm, x, meta, j, value(j), key, v)?;
                Ok(LeafOutcome::Done(matches!(op, WriteOp::Update(_))))
            }
            (Some(j), WriteOp::Delete) => {
                // Move the last pair into the hole (XStore §5.3.2).
                let last = count - 1;
                let mut m = meta;
                let mut ch = [(0, 0); 4];
                let mut n = 0;
                if j != last {
                    ch[0] = (geo.key(j), word(geo.key(last)));
                    ch[1] = (geo.slot(j), word(geo.slot(last)));
                    n = 2;
                    set_bit(&mut m.out_of_line, j, meta.is_out_of_line(last));
                }
                set_bit(&mut m.out_of_line, last, false);
                ch[n] = (Geometry::META, m.pack());
                ch[n + 1] = (
                    Geometry::HDR,
                    Header {
                        count: last as u8,
                        ..hdr
                    }
                    .pack(),
                );
                let old = value(j);
                nm.commit(&self.geo, x, &ch[..n + 2]);
                self.counters.keys.fetch_sub(1, Ordering::Relaxed);
                self.free_value(old);
                Ok(LeafOutcome::Done(true))
            }
            (None, WriteOp::Insert(v) | WriteOp::Upsert(v)) => {
                if count == self.geo.slots() {
                    unlock_unchanged(&nm, x);
                    return Ok(LeafOutcome::Full);
                }
                let (word, oob) = match self.put_value(key, v) {
                    Ok(p) => p,
                    Err(e) => {
                        unlock_unchanged(&nm, x);
                        return Err(e);
                    }
                };
                // Append (leaves are unsorted).
                let mut m = meta;
                set_bit(&mut m.out_of_line, count, oob);
                let ch = [
                    (Geometry::HDR, {
                        Header {
                            count: count as u8 + 1,
                            ..hdr
                        }
                        .pack()
                    }),
                    (Geometry::META, m.pack()),
                    (self.geo.key(count), key),
                    (self.geo.slot(count), word),
                ];
                nm.commit(&self.geo, x, &ch);
                self.counters.keys.fetch_add(1, Ordering::Relaxed);
                Ok(LeafOutcome::Done(true))
            }
        }
    }

    /// Replaces the value in slot `j` of a leaf locked at `x` and unlocks
    /// it; frees the old block after the new one is linked.
    #[allow(clippy::too_many_arguments)]
    fn replace_value(
        &self,
        nm: &NodeSlice<'_>,
        x: u64,
        meta: Meta,
        j: usize,
        old: SlotValue,
        key: u64,
        value: &[u8],
    ) -> Result<(), XTreeError> {
        let (word, oob) = match self.put_value(key, value) {
            Ok(p) => p,
            Err(e) => {
                unlock_unchanged(nm, x);
                return Err(e);
            }
        };
        let mut m = meta;
        set_bit(&mut m.out_of_line, j, oob);
        let ch = [(self.geo.slot(j), word), (Geometry::META, m.pack())];
        let n = if m != meta { 2 } else { 1 };
        nm.commit(&self.geo, x, &ch[..n]);
        self.free_value(old);
        Ok(())
    }

    /// `op` under the exclusive lock: like [`Self::leaf_apply`], splitting
    /// a full leaf (and its ancestors) as needed.
    fn apply_exclusive(
        &self,
        key: u64,
        op: WriteOp<'_>,
        events: &mut Vec<SplitEvent>,
    ) -> Result<bool, XTreeError> {
        let (leaf, path) = self.descend(key);
        if let LeafOutcome::Done(b) = self.leaf_apply(leaf, key, op)? {
            return Ok(b);
        }
        let (WriteOp::Insert(value) | WriteOp::Upsert(value)) = op else {
            unreachable!("only inserts of new keys need room");
        };
        // A split takes at most one new node per level plus a new root;
        // check first so that a full region changes nothing.
        let needed = path.len() as u64 + 2;
        let free = self.node_alloc.capacity_blocks() - self.node_alloc.live();
        if free < needed {
            return Err(XTreeError::Exhausted(format!(
                "node region full: {} of {} nodes in use, a split may need {needed}",
                self.node_alloc.live(),
                self.node_alloc.capacity_blocks()
            )));
        }
        let (word, oob) = self.put_value(key, value)?;
        self.split_leaf(leaf, &path, (key, word, oob), events)?;
        self.counters.keys.fetch_add(1, Ordering::Relaxed);
        Ok(true)
    }

    /// Splits the full `leaf`, adding the pair `new`: the sorted pairs'
    /// upper half goes to a new right sibling, written in full before it
    /// is linked (invariant 3); the leaf keeps the lower half under a new
    /// incarnation (invariant 1); then the parent learns both. Declares
    /// `cost::LEAF_SPLIT`; not inlined, so that callgrind counts its calls.
    #[inline(never)]
    fn split_leaf(
        &self,
        leaf: u32,
        path: &[(u32, usize)],
        new: (u64, u64, bool),
        events: &mut Vec<SplitEvent>,
    ) -> Result<(), XTreeError> {
        dmkv_transport::sim::work(cost::LEAF_SPLIT);
        let img = self.read_locked(leaf)?;
        let meta = img.keys.meta;
        let mut pairs: Vec<(u64, u64, bool)> = (0..img.keys.keys.len())
            .map(|j| (img.keys.keys[j], img.slots[j], meta.is_out_of_line(j)))
            .chain(std::iter::once(new))
            .collect();
        pairs.sort_unstable_by_key(|p| p.0);
        let keep = pairs.len() / 2;
        let (lower, upper) = pairs.split_at(keep);
        let separator = upper[0].0;
        let hdr = img.header();
        let right = self.alloc_node()?;
        self.write_leaf(right, 0, hdr.next, upper);
        let inca = next_incarnation(hdr.incarnation);
        self.write_leaf(leaf, inca, right, lower);
        self.counters.leaves.fetch_add(1, Ordering::Relaxed);
        self.counters.leaf_splits.fetch_add(1, Ordering::Relaxed);
        events.push(SplitEvent {
            level: 0,
            left: LeafRef {
                node: leaf,
                incarnation: inca,
            },
            old_incarnation: hdr.incarnation,
            right,
            separator,
        });
        self.insert_into_parent(
            path,
            0,
            ChildPtr {
                node: leaf,
                incarnation: inca,
            },
            separator,
            ChildPtr {
                node: right,
                incarnation: 0,
            },
            events,
        )
    }

    fn write_leaf(&self, node: u32, incarnation: u32, next: u32, pairs: &[(u64, u64, bool)]) {
        let mut meta = Meta::default();
        for (j, p) in pairs.iter().enumerate() {
            set_bit(&mut meta.out_of_line, j, p.2);
        }
        let keys: Vec<u64> = pairs.iter().map(|p| p.0).collect();
        let slots: Vec<u64> = pairs.iter().map(|p| p.1).collect();
        self.write_node(
            node,
            Header {
                incarnation,
                count: pairs.len() as u8,
                next,
            },
            meta,
            &keys,
            &slots,
        );
    }

    /// Links `right` (separator `sep`) after `left` in the parent at the
    /// end of `path`, whose pointer to `left` gets `left`'s new incarnation
    /// in the same write (invariant 2). Splits the parent if full; makes a
    /// new root if `left` was the root.
    fn insert_into_parent(
        &self,
        path: &[(u32, usize)],
        child_level: u8,
        left: ChildPtr,
        sep: u64,
        right: ChildPtr,
        events: &mut Vec<SplitEvent>,
    ) -> Result<(), XTreeError> {
        let Some((&(parent, idx), rest)) = path.split_last() else {
            // `left` was the root: its lower bound is 0.
            let root = self.alloc_node()?;
            self.write_node(
                root,
                Header {
                    incarnation: 0,
                    count: 2,
                    next: NO_NODE,
                },
                Meta {
                    level: child_level + 1,
                    out_of_line: 0,
                },
                &[0, sep],
                &[left.pack(), right.pack()],
            );
            self.counters.inner_nodes.fetch_add(1, Ordering::Relaxed);
            self.nodes
                .mem
                .store_u64(
                    SUPERBLOCK_ROOT_OFFSET,
                    RootWord {
                        node: root,
                        height: child_level as u32 + 2,
                    }
                    .pack(),
                )
                .expect("superblock inside the region");
            return Ok(());
        };
        let img = self.read_locked(parent)?;
        let mut keys = img.keys.keys.clone();
        let mut slots = img.slots.clone();
        if img.child(idx).node != left.node {
            return Err(XTreeError::Corrupt(format!(
                "parent {parent} slot {idx} does not point to {}",
                left.node
            )));
        }
        slots[idx] = left.pack();
        keys.insert(idx + 1, sep);
        slots.insert(idx + 1, right.pack());
        let hdr = img.header();
        let meta = img.keys.meta;
        if keys.len() <= self.geo.slots() {
            self.write_node(
                parent,
                Header {
                    count: keys.len() as u8,
                    ..hdr
                },
                meta,
                &keys,
                &slots,
            );
            return Ok(());
        }
        let keep = keys.len() / 2;
        let sibling = self.alloc_node()?;
        self.write_node(
            sibling,
            Header {
                incarnation: 0,
                count: (keys.len() - keep) as u8,
                next: hdr.next,
            },
            meta,
            &keys[keep..],
            &slots[keep..],
        );
        let inca = next_incarnation(hdr.incarnation);
        self.write_node(
            parent,
            Header {
                incarnation: inca,
                count: keep as u8,
                next: sibling,
            },
            meta,
            &keys[..keep],
            &slots[..keep],
        );
        self.counters.inner_nodes.fetch_add(1, Ordering::Relaxed);
        self.counters.inner_splits.fetch_add(1, Ordering::Relaxed);
        events.push(SplitEvent {
            level: meta.level,
            left: LeafRef {
                node: parent,
                incarnation: inca,
            },
            old_incarnation: hdr.incarnation,
            right: sibling,
            separator: keys[keep],
        });
        self.insert_into_parent(
            rest,
            meta.level,
            ChildPtr {
                node: parent,
                incarnation: inca,
            },
            keys[keep],
            ChildPtr {
                node: sibling,
                incarnation: 0,
            },
            events,
        )
    }

    /// Writes a node's header, meta, keys and slots through the protocol.
    fn write_node(&self, node: u32, hdr: Header, meta: Meta, keys: &[u64], slots: &[u64]) {
        debug_assert_eq!(keys.len(), slots.len());
        let nm = self.node_mem(node);
        let x = lock(&nm);
        let mut ch = Vec::with_capacity(2 + 2 * keys.len());
        ch.push((Geometry::HDR, hdr.pack()));
        ch.push((Geometry::META, meta.pack()));
        ch.extend(keys.iter().enumerate().map(|(j, &k)| (self.geo.key(j), k)));
        ch.extend(
            slots
                .iter()
                .enumerate()
                .map(|(j, &s)| (self.geo.slot(j), s)),
        );
        commit(&nm, &self.geo, x, &ch);
    }

    // ---- nodes -------------------------------------------------------------

    /// A node's words in place: one bounds check and one `sim` touch of all
    /// its lines ([`RegionMem::words_in`]). The walk reads inner nodes
    /// through it; a write that reads the whole leaf next touches the
    /// leaf's lines here first, in the order the copy after the lock
    /// touched them (the lock's CAS, line 0, then lines 1 on), so a job's
    /// distinct lines come in the same order as through [`NodeMem`].
    fn node_slice(&self, node: u32) -> NodeSlice<'_> {
        let base = self.node_mem(node).base;
        NodeSlice {
            words: self
                .nodes
                .mem
                .words_in(base, self.geo.node_bytes())
                .expect("node numbers are checked against the region"),
            mem: &self.nodes.mem,
            base,
        }
    }

    fn node_mem(&self, node: u32) -> NodeMem<'_> {
        NodeMem {
            mem: &self.nodes.mem,
            base: node as u64 * self.geo.node_bytes() as u64,
        }
    }

    fn alloc_node(&self) -> Result<u32, XTreeError> {
        let off = self.node_alloc.alloc().map_err(exhausted)?;
        let node = (off / self.geo.node_bytes() as u64) as u32;
        self.high_node.fetch_max(node, Ordering::AcqRel);
        Ok(node)
    }

    /// Copies a node's bytes into `img` (its first `node_bytes`: the
    /// caller's stack buffer; no allocation per node read).
    fn copy_node(&self, node: u32, img: &mut [u8]) {
        self.nodes
            .mem
            .read(self.node_mem(node).base, img)
            .expect("node numbers are checked against the region");
    }

    /// Runs `f` on a copy of a node's bytes taken into a stack buffer.
    fn with_snapshot<R>(&self, node: u32, f: impl FnOnce(&[u8]) -> R) -> R {
        let mut buf = [0u8; MAX_NODE_BYTES];
        let img = &mut buf[..self.geo.node_bytes()];
        self.copy_node(node, img);
        f(img)
    }

    /// A node that cannot change under the caller (locked by it, or an
    /// inner node while `structure` is held), parsed without versions.
    fn read_locked(&self, node: u32) -> Result<NodeView, XTreeError> {
        self.with_snapshot(node, |img| NodeView::parse_locked(&self.geo, img))
            .map_err(|e| XTreeError::Corrupt(format!("node {node}: {e}")))
    }

    /// A consistent image of a node that writers may be changing.
    fn read_consistent(&self, node: u32) -> Result<NodeView, XTreeError> {
        for attempt in 0..MAX_READ_RETRIES {
            dmkv_transport::sim::work(cost::LEAF_READ_PARSED);
            match self.with_snapshot(node, |img| NodeView::parse(&self.geo, img)) {
                Ok(v) => return Ok(v),
                Err(e) if e.is_transient() => back_off(attempt),
                Err(e) => return Err(XTreeError::Corrupt(format!("node {node}: {e}"))),
            }
        }
        Err(XTreeError::Corrupt(format!("node {node} never settled")))
    }

    /// [`Self::read_consistent`] without collecting the node: a consistent
    /// copy in `buf`, checked as `NodeView::parse` checks it (the same
    /// errors, retried alike), per attempt the same `sim` charge.
    fn read_consistent_image<'b>(
        &self,
        node: u32,
        buf: &'b mut [u8; MAX_NODE_BYTES],
    ) -> Result<NodeImage<'b>, XTreeError> {
        let nb = self.geo.node_bytes();
        for attempt in 0..MAX_READ_RETRIES {
            dmkv_transport::sim::work(cost::LEAF_READ);
            self.copy_node(node, &mut buf[..nb]);
            match check_node_image(&self.geo, &buf[..nb], true) {
                Ok(head) => return Ok(NodeImage::from_checked(&self.geo, &buf[..nb], head)),
                Err(e) if e.is_transient() => back_off(attempt),
                Err(e) => return Err(XTreeError::Corrupt(format!("node {node}: {e}"))),
            }
        }
        Err(XTreeError::Corrupt(format!("node {node} never settled")))
    }

    /// `key`'s value in `leaf`, read in place and validated by the version
    /// protocol ([`Self::leaf_slot_in_place`]), retried as
    /// [`Self::read_consistent_image`] retries its copy (per attempt a
    /// `sim` charge, [`cost::LEAF_READ_IN_PLACE`], and the same touch of
    /// the node's every line): `Some(None)` when the leaf lacks the key,
    /// `None` when the node's meta word says it is no leaf (the caller
    /// then takes the copy path, whose checks cover inner nodes).
    fn read_leaf_slot(&self, leaf: u32, key: u64) -> Result<Option<Option<SlotValue>>, XTreeError> {
        self.retry_in_place(leaf, cost::LEAF_READ_IN_PLACE, || {
            self.leaf_slot_in_place(leaf, key)
        })
    }

    /// A leaf's header and its keys (into `keys`, in slot order), read in
    /// place ([`Self::leaf_keys_in_place`]) and retried alike (per attempt
    /// a `sim` charge, [`cost::COVER_LEAF`], and the same touch of the
    /// node's every line): the retraining walk's leaf read (branch i106; a
    /// copy parsed into a [`NodeView`] and its keys cloned before). `None`
    /// when the node's meta word says it is no leaf.
    fn read_leaf_keys(&self, leaf: u32, keys: &mut Vec<u64>) -> Result<Option<Header>, XTreeError> {
        self.retry_in_place(leaf, cost::COVER_LEAF, || {
            self.leaf_keys_in_place(leaf, keys)
        })
    }

    /// Runs `attempt`, an in-place read of node `node`, until it is not
    /// refused as transient (locked or torn), backing off as the copy path
    /// does ([`Self::read_consistent_image`]); `work` is declared to `sim`
    /// per attempt. A malformed node is corrupt at once.
    #[inline(always)]
    fn retry_in_place<R>(
        &self,
        node: u32,
        work: u64,
        mut attempt: impl FnMut() -> Result<R, ViewError>,
    ) -> Result<R, XTreeError> {
        for n in 0..MAX_READ_RETRIES {
            dmkv_transport::sim::work(work);
            match attempt() {
                Ok(r) => return Ok(r),
                Err(e) if e.is_transient() => back_off(n),
                Err(e) => return Err(XTreeError::Corrupt(format!("node {node}: {e}"))),
            }
        }
        Err(XTreeError::Corrupt(format!("node {node} never settled")))
    }

    /// One attempt at `key`'s slot in `node`, read in place
    /// ([`Self::leaf_in_place`]): the key words in slot order up to `key`
    /// and its slot word. `Ok(None)` for an inner node.
    #[inline(always)]
    fn leaf_slot_in_place(
        &self,
        node: u32,
        key: u64,
    ) -> Result<Option<Option<SlotValue>>, ViewError> {
        let geo = &self.geo;
        self.leaf_in_place(node, |w, header, meta| {
            // The count is checked against the slots: the loads stay in
            // the node even when the words are torn.
            let (j, _) = find_key_word(geo, header.count as usize, key, |i| w.load(i));
            j.map(|j| SlotValue::decode(meta, j, w.load(geo.payload_word(geo.slot(j)))))
        })
    }

    /// One attempt at a leaf's header and its `count` keys (into `keys`,
    /// cleared first), read in place ([`Self::leaf_in_place`]). On an
    /// error `keys` may hold a partial read the caller must not use (the
    /// retry clears it). `Ok(None)` for an inner node.
    #[inline(always)]
    fn leaf_keys_in_place(
        &self,
        node: u32,
        keys: &mut Vec<u64>,
    ) -> Result<Option<Header>, ViewError> {
        let geo = &self.geo;
        keys.clear();
        self.leaf_in_place(node, |w, header, _| {
            // The count is checked against the slots: the loads stay in
            // the node even when the words are torn.
            keys.reserve(header.count as usize);
            let mut i = geo.payload_word(geo.key(0));
            for _ in 0..header.count {
                keys.push(w.load(i));
                i += 1;
                if i.is_multiple_of(WORDS_PER_LINE) {
                    i += 1; // the next line's version word
                }
            }
            *header
        })
    }

    /// One in-place read of leaf `node`: its words loaded in place (quiet
    /// atomic loads, [`QuietWords`]) instead of copied: `V_0` first, then
    /// the header and meta, then `read`'s loads (run only when the header
    /// and meta are well-formed and the meta says leaf), then every other
    /// version word, `T` last. The attempt is accepted exactly when a copy
    /// of the whole node would be by [`check_node_image`]: every version
    /// word unlocked and equal (else [`ViewError::Locked`] /
    /// [`ViewError::Torn`], transient; any lock wins over a tear), then
    /// the header and meta checked ([`check_head_words`], the same
    /// malformed errors). A leaf has no further checks; a node whose meta
    /// says it is inner returns `Ok(None)` (inner nodes' checks are the
    /// copy path's).
    ///
    /// Why the words loaded between `V_0` and `T` are version `X`'s when
    /// both read `X` (docs/xtree.md, invariant 13): every load is an
    /// acquire and every store of the writer protocol a release
    /// ([`crate::protocol::commit`]). `V_0 = X` unlocked was stored by the
    /// commit that made `X`, after all its payload stores, so no later
    /// load sees an older payload word. A payload word stored by any later
    /// commit was stored after that commit's `T = X + 1`, so a load that
    /// sees it makes the closing load of `T` see `X + 1` or later: torn.
    ///
    /// The node's every line is touched once, as the copy touched them
    /// ([`RegionMem::words_in`]), so `sim` charges the same lines.
    #[inline(always)]
    fn leaf_in_place<R>(
        &self,
        node: u32,
        read: impl FnOnce(&QuietWords<'_>, &Header, &Meta) -> R,
    ) -> Result<Option<R>, ViewError> {
        let geo = &self.geo;
        let w = self.node_words_in_place(node);
        let first = w.load(geo.version_word(0));
        if first & LOCK_BIT != 0 {
            // A copy would fail the same way, whatever else it read.
            return Err(ViewError::Locked);
        }
        let head = check_head_words(
            geo,
            w.load(geo.payload_word(Geometry::HDR)),
            w.load(geo.payload_word(Geometry::META)),
        );
        let mut found = None;
        if let Ok((header, meta)) = &head
            && meta.level == 0
        {
            found = Some(read(&w, header, meta));
        }
        // The closing version words, as `check_span` reads them: any lock
        // wins over a tear.
        let mut torn = false;
        for i in (1..geo.lines())
            .map(|l| geo.version_word(l))
            .chain(std::iter::once(geo.trailer_word()))
        {
            let v = w.load(i);
            if v & LOCK_BIT != 0 {
                return Err(ViewError::Locked);
            }
            torn |= v != first;
        }
        if torn {
            return Err(ViewError::Torn);
        }
        // A malformed head is reported only after the version words: a
        // tear or a lock explains it and is retried. `read` ran exactly
        // when the head is well-formed and a leaf's.
        head?;
        Ok(found)
    }

    /// The leaf covering `key` and the path to it (inner node, child index),
    /// root first. The caller holds `structure`, so inner nodes are stable.
    fn descend(&self, key: u64) -> (u32, Vec<(u32, usize)>) {
        let mut path = Vec::new();
        let leaf = self.walk(key, |node, j| path.push((node, j)));
        (leaf, path)
    }

    /// The leaf covering `key`, without the path (lookups and scans).
    fn descend_to_leaf(&self, key: u64) -> u32 {
        self.walk(key, |_, _| {})
    }

    /// Walks from the root to the leaf covering `key`, calling `step` with
    /// each inner node passed and the child index taken. Inner nodes are read
    /// in place, word by word (the XStore artifact's linear scan over their
    /// key words, since branch i68; a binary search before), not
    /// copied and parsed: the caller holds `structure`, under which inner
    /// nodes do not change (docs/xtree.md, "Concurrency on the memory node":
    /// inner nodes change only under `structure` held exclusive), and every
    /// inner node was written whole by this code. `walk_parsed` below is the
    /// parsing walk the tests compare it with.
    ///
    /// Each node's words are loaded through [`NodeLines`]: a line is
    /// bounds-checked and `sim`-touched at the first load of a word of it,
    /// so the walk touches exactly the lines holding the words it loads
    /// (docs/xtree.md, invariant 10): of an inner node the meta word and the
    /// header (line 0), the keys its linear scan reads (one access, from
    /// `K_0`'s line: [`NodeLines::touch_words`]) and the child pointer it
    /// follows (for N = 16 two to four of the five lines); of the
    /// leaf only the meta word (line 0: a node's level never changes, so it
    /// tells a leaf even while another handler writes that leaf, whose
    /// other words must not be read unvalidated). Every caller copies or
    /// takes the whole leaf next (`read_consistent*`, `node_slice` and
    /// `read_locked*`), touching line 0 again (free: a job's lines are
    /// charged once) and then lines 1 on, so the leaf's lines are charged
    /// as when the walk touched the whole leaf.
    fn walk(&self, key: u64, mut step: impl FnMut(u32, usize)) -> u32 {
        self.walk_lines(key, |node, j, _| step(node, j))
    }

    /// [`Self::walk`], also giving `step` the lines it took of each inner
    /// node passed (a bitmap, bit `l` for line `l`; tests read it).
    #[inline(always)]
    fn walk_lines(&self, key: u64, mut step: impl FnMut(u32, usize, &NodeLines<'_>)) -> u32 {
        let geo = &self.geo;
        let meta_word = geo.payload_word(Geometry::META);
        let mut node = self.root().node;
        // Nothing in the walk can switch metering on or off (it neither
        // waits nor yields).
        let counted = RegionMem::touches_counted();
        #[cfg(test)]
        tests::DESCENTS.with(|d| d.set(d.get() + 1));
        loop {
            let mut words = NodeLines::new(
                &self.nodes.mem,
                self.node_mem(node).base,
                geo.node_bytes(),
                counted,
            );
            if words.load(meta_word) & 0xFF == 0 {
                return node;
            }
            dmkv_transport::sim::work(cost::INNER_LEVEL);
            let count = Header::unpack(words.load(geo.payload_word(Geometry::HDR))).count as usize;
            assert!(
                (1..=geo.slots()).contains(&count),
                "inner node {node} has count {count}"
            );
            // The artifact's linear scan (SJTU-IPADS/xstore `legacy`,
            // `NaiveTree::find_leaf_page`): the first key above `key`, the
            // child before it covers `key`. Key words in slot order, stepping
            // over each line's version word (`payload_offsets`' stepping).
            let first = geo.payload_word(geo.key(0));
            let (mut lo, mut w, mut last) = (0, first, first);
            while lo < count {
                last = w;
                if key < words.peek(w) {
                    break;
                }
                lo += 1;
                w += 1;
                if w.is_multiple_of(WORDS_PER_LINE) {
                    w += 1; // the next line's version word
                }
            }
            // The scan's loads, K_0 to the last key it read, as one access:
            // their addresses are known together (invariant 10).
            words.touch_words(first, last);
            let j = lo
                .checked_sub(1)
                .expect("inner nodes on a descent from the root cover the key");
            let child = ChildPtr::unpack(words.load(geo.payload_word(geo.slot(j))))
                .expect("inner nodes are valid while the tree lock is held");
            step(node, j, &words);
            node = child.node;
        }
    }

    /// The same walk as [`XTree::walk`] by copying and parsing every inner
    /// node (what it replaced); tests check both agree.
    #[cfg(test)]
    fn walk_parsed(&self, key: u64) -> (u32, Vec<(u32, usize)>) {
        let mut node = self.root().node;
        let mut path = Vec::new();
        loop {
            let meta = self
                .node_mem(node)
                .load(self.geo.payload_word(Geometry::META));
            if meta & 0xFF == 0 {
                return (node, path);
            }
            let img = self
                .read_locked(node)
                .expect("inner nodes are valid while the tree lock is held");
            let (j, child) = img
                .child_for(key)
                .expect("inner nodes on a descent from the root cover the key");
            path.push((node, j));
            node = child.node;
        }
    }

    /// What [`XTree::get`] answered before the lean path: the leaf copied
    /// and parsed into a [`NodeView`], searched, its value resolved; tests
    /// check both agree.
    #[cfg(test)]
    fn get_parsed(&self, key: u64) -> Result<Option<Vec<u8>>, XTreeError> {
        let _shared = self.structure.read();
        let leaf = self.descend_to_leaf(key);
        loop {
            let img = self.read_consistent(leaf)?;
            let Some(j) = img.keys.find(key) else {
                return Ok(None);
            };
            if let Some(v) = self.resolve(key, img.value(j)) {
                return Ok(Some(v));
            }
        }
    }

    // ---- values ------------------------------------------------------------

    /// The slot word for `value`: the bytes themselves if 8 long, else a fat
    /// pointer to a new block, written before it is linked.
    fn put_value(&self, key: u64, value: &[u8]) -> Result<(u64, bool), XTreeError> {
        if value.len() == INLINE_VALUE_LEN {
            return Ok((
                u64::from_le_bytes(value.try_into().expect("8 bytes")),
                false,
            ));
        }
        let block = encode_block(key, value);
        let off = self
            .value_alloc
            .alloc(block.len() as u64)
            .map_err(exhausted)?;
        self.values
            .mem
            .write(off, &block)
            .expect("allocated blocks lie inside the region");
        Ok((
            FatPtr {
                offset: off,
                len: value.len() as u32,
            }
            .pack(),
            true,
        ))
    }

    /// Frees the block of an unlinked out-of-line value. Readers holding its
    /// fat pointer detect reuse by the block's key, length and checksum.
    fn free_value(&self, v: SlotValue) {
        if let SlotValue::OutOfLine(f) = v {
            let r = self
                .value_alloc
                .free(f.offset, block_bytes(f.len as usize) as u64);
            debug_assert!(r.is_ok(), "freeing a linked block: {r:?}");
        }
    }

    /// The bytes of a slot value, or `None` if its block no longer holds
    /// this key's value (freed and reused): the caller re-reads the leaf.
    fn resolve(&self, key: u64, v: SlotValue) -> Option<Vec<u8>> {
        match v {
            SlotValue::Inline(b) => Some(b.to_vec()),
            SlotValue::OutOfLine(f) => self.read_block(key, f, &mut Vec::new()).map(<[u8]>::to_vec),
        }
    }

    /// The value of an out-of-line slot, read into `buf` and validated
    /// there, or `None` as for [`Self::resolve`].
    fn read_block<'b>(&self, key: u64, f: FatPtr, buf: &'b mut Vec<u8>) -> Option<&'b [u8]> {
        self.values
            .mem
            .read_to_vec(f.offset, f.block_len(), buf)
            .ok()?;
        block_value(key, f, buf).ok()
    }
}

/// What a structure check has seen so far.
#[derive(Default)]
struct Walk {
    /// Leaves in key order.
    leaves: Vec<u32>,
    inner: u64,
    keys: u64,
}

fn set_bit(bits: &mut u64, j: usize, on: bool) {
    if on {
        *bits |= 1 << j;
    } else {
        *bits &= !(1 << j);
    }
}

fn check_value(key: u64, value: &[u8]) -> Result<(), XTreeError> {
    if value.len() > MAX_VALUE_LEN {
        return Err(XTreeError::BadRequest(format!(
            "value of {} bytes for key {key:#x} exceeds the limit of {MAX_VALUE_LEN}",
            value.len()
        )));
    }
    Ok(())
}

impl From<ViewError> for XTreeError {
    fn from(e: ViewError) -> XTreeError {
        XTreeError::Corrupt(e.to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::MAX_SLOTS;
    use dmkv_transport::local::{LocalCluster, LocalConfig};

    thread_local! {
        /// Descents from the root (`walk_lines` calls) on this thread: the
        /// tests' traversal counter.
        pub(super) static DESCENTS: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
    }

    fn descents() -> u64 {
        DESCENTS.with(|d| d.get())
    }

    fn leaf_ref(l: &LeafInfo) -> LeafRef {
        LeafRef {
            node: l.node,
            incarnation: l.incarnation,
        }
    }

    /// The in-place leaf read (`leaf_slot_in_place`, GET's path since
    /// branch i93) accepts and refuses exactly the images a copy of the
    /// whole node is accepted and refused by (`check_node_image`): on a
    /// leaf with every version word in turn locked or torn (locked wins),
    /// and with a malformed meta word, the same error; on the intact leaf
    /// every key's value and an absent key as the copy's `NodeImage` finds
    /// them; an inner node is sent to the copy path. Checked to fail with
    /// the closing version words' loop removed (the torn images of lines 1
    /// on and of `T` were then accepted).
    #[test]
    fn the_in_place_leaf_read_refuses_what_a_copy_refuses() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = XTreeConfig::sized_for(1_000, 16, 16).unwrap();
        let t = XTree::create(&rt, "t/nodes", "t/values", cfg).unwrap();
        for k in 0..12u64 {
            let v = if k % 3 == 0 {
                vec![k as u8; 20]
            } else {
                vec![k as u8; 8]
            };
            t.insert(k * 10 + 1, &v).unwrap();
        }
        let leaf = t.root().node;
        let geo = t.geo;
        let base = t.node_mem(leaf).base;
        let mem = &t.nodes.mem;
        let copied = |key: u64| {
            let mut buf = [0u8; MAX_NODE_BYTES];
            let img = &mut buf[..geo.node_bytes()];
            t.copy_node(leaf, img);
            check_node_image(&geo, img, true).map(|head| {
                let img = NodeImage::from_checked(&geo, img, head);
                img.find(key).map(|j| img.value(j))
            })
        };
        // Intact: every key and an absent one, as the copy finds them.
        for key in (0..12u64).map(|k| k * 10 + 1).chain([5]) {
            let want = copied(key).unwrap();
            assert_eq!(t.leaf_slot_in_place(leaf, key), Ok(Some(want)), "key {key}");
        }
        assert_eq!(t.get(31).unwrap(), Some(vec![3; 20]));
        assert_eq!(t.get(41).unwrap(), Some(vec![4; 8]));
        let versions: Vec<usize> = (0..geo.lines())
            .map(|l| geo.version_word(l))
            .chain([geo.trailer_word()])
            .collect();
        let at = |i: usize| base + 8 * i as u64;
        for &i in &versions {
            let v = mem.load_u64(at(i)).unwrap();
            for (bad, want) in [(v | LOCK_BIT, ViewError::Locked), (v + 1, ViewError::Torn)] {
                mem.store_u64(at(i), bad).unwrap();
                assert_eq!(copied(41), Err(want.clone()), "word {i}");
                assert_eq!(t.leaf_slot_in_place(leaf, 41), Err(want), "word {i}");
                // A lock anywhere wins over a tear anywhere else.
                let other =
                    versions[(versions.iter().position(|&w| w == i).unwrap() + 1) % versions.len()];
                let o = mem.load_u64(at(other)).unwrap();
                mem.store_u64(at(other), o | LOCK_BIT).unwrap();
                assert_eq!(copied(41), Err(ViewError::Locked), "words {i}, {other}");
                assert_eq!(t.leaf_slot_in_place(leaf, 41), Err(ViewError::Locked));
                mem.store_u64(at(other), o).unwrap();
            }
            mem.store_u64(at(i), v).unwrap();
        }
        // A malformed meta word (reserved bits): the same non-transient error.
        let meta_at = at(geo.payload_word(Geometry::META));
        let meta = mem.load_u64(meta_at).unwrap();
        mem.store_u64(meta_at, meta | 1 << 60).unwrap();
        let want = copied(41).unwrap_err();
        assert!(!want.is_transient());
        assert_eq!(t.leaf_slot_in_place(leaf, 41), Err(want));
        mem.store_u64(meta_at, meta).unwrap();
        assert_eq!(
            t.leaf_slot_in_place(leaf, 41),
            Ok(Some(copied(41).unwrap()))
        );
        // An inner node: the copy path's.
        for k in 12..200u64 {
            t.insert(k * 10 + 1, &[1; 8]).unwrap();
        }
        let root = t.root().node;
        assert!(t.read_locked(root).unwrap().level() > 0);
        assert_eq!(t.leaf_slot_in_place(root, 41), Ok(None));
        assert_eq!(t.get(41).unwrap(), Some(vec![4; 8]));
    }

    /// The covering walk's in-place inner read (`inner_in_place`,
    /// twenty-seventh session) gives every inner node's keys and children
    /// as the parsed copy it replaced (`read_locked`), refuses a malformed
    /// inner node with the copy's error (a child pointer naming no node,
    /// keys out of order), and `leaves_covering` then
    /// reports the node corrupt instead of following a bad pointer.
    /// Checked to fail with the key-order and child-pointer checks removed.
    #[test]
    fn the_covering_walks_in_place_inner_read_matches_the_copy() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = XTreeConfig::sized_for(20_000, 16, 16).unwrap();
        let t = XTree::create(&rt, "t/nodes", "t/values", cfg).unwrap();
        // A three-level tree at least (fan-out 16), keys in a scrambled order.
        let mut inserted = 0;
        for i in 0..3_000u64 {
            let k = i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20;
            inserted += usize::from(t.insert(k, &[1; 8]).unwrap());
        }
        let mut inner_nodes = Vec::new();
        let mut todo = vec![t.root().node];
        while let Some(n) = todo.pop() {
            let img = t.read_locked(n).unwrap();
            if img.level() == 0 {
                continue;
            }
            inner_nodes.push(n);
            let inner = t.inner_in_place(n).unwrap();
            assert_eq!(inner.count, img.keys.keys.len());
            for j in 0..inner.count {
                assert_eq!(inner.key(j), img.keys.keys[j], "node {n} key {j}");
                assert_eq!(inner.child(j), img.child(j).node, "node {n} child {j}");
                todo.push(img.child(j).node);
            }
        }
        assert!(inner_nodes.len() > 16, "a tree of several inner levels");
        let all = t.leaves_covering(0, u64::MAX, usize::MAX).unwrap();
        assert_eq!(
            all.iter().map(|l| l.info.keys.len()).sum::<usize>(),
            inserted
        );
        // Malformed inner nodes: the copy's error, and the walk stops.
        let geo = t.geo;
        let node = *inner_nodes.last().unwrap();
        let mem = &t.nodes.mem;
        let at = |i: usize| t.node_mem(node).base + 8 * i as u64;
        let count = t.inner_in_place(node).unwrap().count;
        assert!(count >= 2);
        let corruptions = [
            (geo.payload_word(geo.slot(count - 1)), 0u64), // node 0: the superblock
            (geo.payload_word(geo.key(1)), 0),             // below key 0: not ascending
        ];
        for (word, bad) in corruptions {
            let good = mem.load_u64(at(word)).unwrap();
            mem.store_u64(at(word), bad).unwrap();
            let want = t.read_locked(node).unwrap_err();
            let got = t.inner_in_place(node).map(|_| ()).unwrap_err();
            assert_eq!(XTreeError::Corrupt(format!("node {node}: {got}")), want);
            assert!(
                matches!(
                    t.leaves_covering(0, u64::MAX, usize::MAX),
                    Err(XTreeError::Corrupt(_))
                ),
                "word {word}"
            );
            mem.store_u64(at(word), good).unwrap();
        }
        assert_eq!(t.leaves_covering(0, u64::MAX, usize::MAX).unwrap(), all);
    }

    /// The retraining walk's in-place key read (`leaf_keys_in_place`,
    /// branch i106) refuses a leaf a writer is changing: with any version
    /// word locked or torn (as an insert or split between the read's first
    /// and last load leaves it) the attempt fails and its partial key set
    /// is not used; intact, it reads the keys a copy parses, and
    /// `leaves_covering` reports them sorted. Checked to fail with the
    /// closing version words' loop removed (torn images were accepted).
    #[test]
    fn the_in_place_key_read_refuses_a_changing_leaf() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = XTreeConfig::sized_for(1_000, 16, 16).unwrap();
        let t = XTree::create(&rt, "t/nodes", "t/values", cfg).unwrap();
        for k in (0..12u64).rev() {
            t.insert(k * 10 + 1, &[k as u8; 8]).unwrap();
        }
        let leaf = t.root().node;
        let geo = t.geo;
        let base = t.node_mem(leaf).base;
        let mem = &t.nodes.mem;
        let parsed = t.read_consistent(leaf).unwrap();
        let mut keys = Vec::new();
        let header = t.leaf_keys_in_place(leaf, &mut keys).unwrap().unwrap();
        assert_eq!(keys, parsed.keys.keys);
        assert_eq!(header, parsed.header());
        let at = |i: usize| base + 8 * i as u64;
        for i in (0..geo.lines())
            .map(|l| geo.version_word(l))
            .chain([geo.trailer_word()])
        {
            let v = mem.load_u64(at(i)).unwrap();
            for (bad, want) in [(v | LOCK_BIT, ViewError::Locked), (v + 1, ViewError::Torn)] {
                mem.store_u64(at(i), bad).unwrap();
                assert_eq!(t.leaf_keys_in_place(leaf, &mut keys), Err(want), "word {i}");
            }
            mem.store_u64(at(i), v).unwrap();
        }
        let covered = t.leaves_covering(0, u64::MAX, usize::MAX).unwrap();
        let want: Vec<u64> = (0..12u64).map(|k| k * 10 + 1).collect();
        assert_eq!(covered.len(), 1);
        assert_eq!(covered[0].info.keys, want);
        // An inner node is no leaf.
        for k in 12..200u64 {
            t.insert(k * 10 + 1, &[1; 8]).unwrap();
        }
        let root = t.root().node;
        assert_eq!(t.leaf_keys_in_place(root, &mut keys), Ok(None));
    }

    /// A position hint of several leaves (XStore §5.3.1, branch i63): the
    /// leaves are tried in the order given and the one holding the key is
    /// written without a descent from the root (counted); a key in none of
    /// them, or a leaf whose incarnation is stale, costs one descent (the
    /// fallback) and the stale leaf is not written; malformed hints are
    /// refused before any leaf is tried (an inner node when it is reached),
    /// changing nothing. Checked to fail with `update_hinted_leaves` trying
    /// only the first leaf (the one-leaf hint before this branch): the key
    /// in the second leaf then took a descent.
    #[test]
    fn a_hint_of_several_leaves_is_served_without_a_traversal() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = XTreeConfig::sized_for(1_000, 16, 4).unwrap();
        let t = XTree::create(&rt, "t/nodes", "t/values", cfg).unwrap();
        for k in 0..40u64 {
            t.insert(k * 10, &[1; 8]).unwrap();
        }
        let leaves = t.leaves().unwrap();
        assert!(leaves.len() >= 5, "{}", leaves.len());
        let (a, b) = (leaf_ref(&leaves[1]), leaf_ref(&leaves[2]));
        let in_b = leaves[2].keys[0];
        // The key in the second leaf: two leaves tried, no descent.
        let d0 = descents();
        let u = t.update_hinted_leaves(in_b, &[2; 8], &[a, b]).unwrap();
        assert_eq!(
            (u.updated, u.hint_used, descents() - d0),
            (true, true, 0),
            "{u:?}"
        );
        assert_eq!(t.hinted_leaves_tried(), 2);
        assert_eq!(t.get(in_b).unwrap(), Some(vec![2; 8]));
        // In the first: one leaf tried, the second not read.
        let in_a = leaves[1].keys[1];
        let d0 = descents();
        let u = t.update_hinted_leaves(in_a, &[2; 8], &[a, b]).unwrap();
        assert_eq!((u.hint_used, descents() - d0), (true, 0));
        assert_eq!(t.hinted_leaves_tried(), 3);
        // In neither (present elsewhere, and absent): both tried, then one
        // descent.
        for (k, present) in [(leaves[0].keys[0], true), (in_b + 1, false)] {
            let d0 = descents();
            let u = t.update_hinted_leaves(k, &[3; 8], &[a, b]).unwrap();
            assert_eq!((u.updated, u.hint_used), (present, false), "key {k}");
            assert_eq!(descents() - d0, 1, "key {k}");
        }
        assert_eq!(t.get(leaves[0].keys[0]).unwrap(), Some(vec![3; 8]));
        assert_eq!(t.get(in_b + 1).unwrap(), None);
        // Split the second leaf: its incarnation moves on, so the hint is
        // stale; the update traverses and lands in the key's leaf now.
        let mut k = in_b + 1;
        while t.find_leaf(in_b).unwrap() == b {
            t.insert(k, &[1; 8]).unwrap();
            k += 1;
        }
        let d0 = descents();
        let u = t.update_hinted_leaves(in_b, &[4; 8], &[a, b]).unwrap();
        assert_eq!((u.updated, u.hint_used, descents() - d0), (true, false, 1));
        assert_eq!(t.get(in_b).unwrap(), Some(vec![4; 8]));
        t.check_structure().unwrap();
        // Malformed hints: refused before any leaf is tried, nothing written.
        let tried = t.hinted_leaves_tried();
        let stats = t.stats();
        let many: Vec<LeafRef> = (1..=MAX_HINT_LEAVES as u32 + 1)
            .map(|node| LeafRef {
                node,
                incarnation: 0,
            })
            .collect();
        let bad: [&[LeafRef]; 6] = [
            &[],
            &many,
            &[a, a],
            &[
                a,
                LeafRef {
                    node: 0,
                    incarnation: 0,
                },
            ],
            &[
                a,
                LeafRef {
                    node: 1_000_000,
                    incarnation: 0,
                },
            ],
            &[
                a,
                LeafRef {
                    node: b.node,
                    incarnation: 1 << 24,
                },
            ],
        ];
        for h in bad {
            let e = t.update_hinted_leaves(in_a, &[9; 8], h);
            assert!(matches!(e, Err(XTreeError::BadRequest(_))), "{h:?}: {e:?}");
        }
        assert_eq!(t.hinted_leaves_tried(), tried);
        assert_eq!(t.stats(), stats);
        // An inner node is refused when it is reached (after a leaf that
        // lacks the key), and nothing is written.
        let root = LeafRef {
            node: t.root().node,
            incarnation: 0,
        };
        let e = t.update_hinted_leaves(leaves[0].keys[0], &[9; 8], &[a, root]);
        assert!(matches!(e, Err(XTreeError::BadRequest(m)) if m.contains("inner node")));
        assert_eq!(t.get(leaves[0].keys[0]).unwrap(), Some(vec![3; 8]));
        assert_eq!(t.get(in_a).unwrap(), Some(vec![2; 8]));
        t.check_structure().unwrap();
    }

    /// `NodeSlice::commit` reports one span (`commit_span`) for all of a
    /// commit's stores: for N = 4, 5, 16, 48 and change sets of one word
    /// in each line, of every word, and of none, the lines the protocol's
    /// stores fall in are exactly the span's lines. (Checked to fail with
    /// the span cut to line 0's 64 bytes, the lock's line.)
    #[test]
    fn a_commit_reports_every_line_it_stores() {
        use std::cell::RefCell;
        struct Recorded(RefCell<Vec<usize>>);
        impl NodeWords for Recorded {
            fn load(&self, _: usize) -> u64 {
                0
            }
            fn store(&self, i: usize, _: u64) {
                self.0.borrow_mut().push(i);
            }
            fn cas(&self, _: usize, _: u64, _: u64) -> u64 {
                0
            }
        }
        for n in [4, 5, 16, 48] {
            let geo = Geometry::new(n).unwrap();
            let all: Vec<(usize, u64)> = (0..geo.payload_words()).map(|i| (i, 1)).collect();
            let one_per_line: Vec<(usize, u64)> = (0..geo.payload_words())
                .step_by(crate::layout::PAYLOAD_WORDS_PER_LINE)
                .map(|i| (i, 1))
                .collect();
            for changes in [vec![(geo.slot(0), 1)], one_per_line, all, vec![]] {
                let w = Recorded(RefCell::new(Vec::new()));
                commit(&w, &geo, 0, &changes);
                let stored: std::collections::BTreeSet<usize> =
                    w.0.borrow().iter().map(|i| i / WORDS_PER_LINE).collect();
                let reported: std::collections::BTreeSet<usize> =
                    (0..commit_span(&geo) as usize / LINE_BYTES).collect();
                assert_eq!(stored, reported, "N = {n}, {} changes", changes.len());
            }
        }
    }

    #[test]
    fn the_largest_node_fits_a_snapshot() {
        let geo = Geometry::new(MAX_SLOTS).unwrap();
        assert!(geo.node_bytes() <= MAX_NODE_BYTES, "{}", geo.node_bytes());
    }

    /// The lean paths (leaf images checked and searched in place, writes
    /// changing only their words) give what parsing every leaf gives: after
    /// inserts, updates of every value length (inline and out of line,
    /// changing between the two), deletes and hinted updates, every key
    /// stored, deleted or never stored reads the same through `get` and
    /// the parsing `get_parsed`, and the tree passes its structure check.
    #[test]
    fn lean_leaf_paths_answer_as_parsed_leaves() {
        for slots in [4, 16, MAX_SLOTS] {
            let c = LocalCluster::new(LocalConfig::default());
            let rt = NodeRuntime::new(c.add_node(1));
            let cfg = XTreeConfig::sized_for(2_000, 24, slots).unwrap();
            let t = XTree::create(&rt, "t/nodes", "t/values", cfg).unwrap();
            let key = |i: u64| (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 24) | 1;
            let val = |i: u64, round: u64| -> Vec<u8> {
                let len = ((i + round) % 4) as usize * 8 + (round as usize % 2) * 3;
                (0..len).map(|b| (b as u64 ^ i ^ round) as u8).collect()
            };
            for i in 0..1_500u64 {
                assert!(t.insert(key(i), &val(i, 0)).unwrap());
            }
            for i in (0..1_500u64).step_by(3) {
                assert!(t.update(key(i), &val(i, 1)).unwrap());
            }
            for i in (1..1_500u64).step_by(5) {
                assert!(t.delete(key(i)).unwrap());
                assert!(!t.delete(key(i)).unwrap());
            }
            for i in (2..1_500u64).step_by(7) {
                let hint = t.find_leaf(key(i)).unwrap();
                let r = t.update_hinted(key(i), &val(i, 2), hint).unwrap();
                assert_eq!(r.updated, i % 5 != 1, "key {i}");
            }
            for i in 0..1_600u64 {
                let k = key(i);
                assert_eq!(
                    t.get(k).unwrap(),
                    t.get_parsed(k).unwrap(),
                    "slots {slots}, key {i}"
                );
                assert_eq!(t.get(k + 1).unwrap(), t.get_parsed(k + 1).unwrap());
            }
            t.check_structure().unwrap();
        }
    }

    /// Where the walk's linear scan of an inner node with sorted `keys`
    /// stops for `key` (invariant 10): the last line of its key span (from
    /// `K_0`'s line, line 0, to the line of the last key it reads: the
    /// first key above `key`, or the last key) and the line of the child
    /// pointer it follows.
    fn scan_lines(geo: &Geometry, keys: &[u64], key: u64) -> (usize, usize) {
        let above = keys.iter().position(|&k| key < k).unwrap_or(keys.len());
        let last_read = above.min(keys.len() - 1);
        (
            geo.line_of(geo.key(last_read)),
            geo.line_of(geo.slot(above - 1)),
        )
    }

    /// The lines a walk is to take of an inner node with sorted `keys`
    /// (invariant 10): the lines of the meta word and the header (line 0),
    /// of every key the linear scan for `key` reads (lines 0 to that of the
    /// first key above it) and of the child pointer it follows; a bitmap,
    /// bit `l` for line `l`.
    fn lines_a_scan_reads(geo: &Geometry, keys: &[u64], key: u64) -> u64 {
        let head = 1 << geo.line_of(Geometry::META) | 1 << geo.line_of(Geometry::HDR);
        let (span_last, child) = scan_lines(geo, keys, key);
        head | ((1u64 << (span_last + 1)) - 1) | 1 << child
    }

    fn scrambled(i: u64) -> u64 {
        (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20) | 1
    }

    /// A tree of `slots` per node on `rt` holding 3,000 keys inserted in a
    /// scrambled order, so that splits happen everywhere and there are
    /// inner levels to walk.
    fn scrambled_tree(rt: &NodeRuntime, slots: usize) -> Arc<XTree> {
        let cfg = XTreeConfig::sized_for(4_000, 8, slots).unwrap();
        let t = XTree::create(rt, "t/nodes", "t/values", cfg).unwrap();
        for i in 0..3_000u64 {
            let k = scrambled(i);
            t.insert(k, &k.to_le_bytes()).unwrap();
        }
        t
    }

    /// A simulation with a scrambled N = 16 tree on a memory node and an
    /// endpoint of a compute node, for the tests that read `sim`'s line
    /// charges as that compute node's client-core busy time: work run
    /// under `ep.charged` is charged there (`line_ns` per line).
    struct ChargedTree {
        sim: dmkv_transport::sim::Simulation,
        _rt: Arc<NodeRuntime>,
        tree: Arc<XTree>,
        ep: dmkv_transport::Endpoint,
        client: u16,
        line_ns: u64,
    }

    impl ChargedTree {
        fn new() -> Self {
            use dmkv_transport::NodeHost;
            use dmkv_transport::sim::{Profile, SimConfig, Simulation};
            let sim = Simulation::new(SimConfig {
                profile: Profile::default_profile(),
                seed: 7,
                jitter_ns: 0,
                delays: Default::default(),
            });
            let line_ns = sim.profile().memnode.line_ns;
            assert!(line_ns > 0);
            let rt = NodeRuntime::new(sim.add_node(1));
            let tree = scrambled_tree(&rt, 16);
            let compute = sim.add_node(0);
            let ep = sim.fabric().endpoint(compute.id()).unwrap();
            let client = compute.id().0;
            ChargedTree {
                sim,
                _rt: rt,
                tree,
                ep,
                client,
                line_ns,
            }
        }

        /// The compute node's client cores' busy time so far, ns.
        fn client_busy(&self) -> u64 {
            let prefix = format!("node{} client core", self.client);
            self.sim
                .resources()
                .iter()
                .filter(|r| r.name.starts_with(&prefix))
                .map(|r| r.busy_ns)
                .sum()
        }
    }

    /// A simulation with the first shipped profile (xstore-cx4: an LLC
    /// model and an instruction term), a scrambled N = 16 tree on its
    /// memory node, whose building touched no modelled cache line (it ran
    /// outside any job), and one memory-node worker core: for the tests that
    /// read what memory-node jobs declare (instructions) and are charged
    /// (the LLC's counts). `pair_prefetch` false switches the profile's
    /// adjacent-line prefetcher off, so that a cold cache misses on every
    /// line and each access's dependent miss is countable by hand.
    struct ShippedTree {
        sim: dmkv_transport::sim::Simulation,
        _rt: Arc<NodeRuntime>,
        tree: Arc<XTree>,
        cores: dmkv_transport::sim::SimCores,
    }

    /// What one memory-node job was charged: instructions declared, and of
    /// the node's LLC, lines looked up (hits and misses) and dependent
    /// misses (misses that started an access: `dram_miss_ns` each).
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    struct JobCharge {
        declared: u64,
        lines: u64,
        dependent: u64,
    }

    impl ShippedTree {
        fn new(pair_prefetch: bool) -> Self {
            use dmkv_transport::sim::{Profile, SimConfig, SimCores, Simulation};
            let mut profile = Profile::parse(dmkv_transport::sim::profile::SHIPPED[0].1).unwrap();
            assert!(profile.memnode.llc_bytes > 0, "an LLC model");
            profile.memnode.pair_prefetch = pair_prefetch;
            let sim = Simulation::new(SimConfig {
                profile,
                seed: 7,
                jitter_ns: 0,
                delays: Default::default(),
            });
            let rt = NodeRuntime::new(sim.add_node(1));
            let tree = scrambled_tree(&rt, 16);
            let cores = SimCores::new("worker", 1).unwrap();
            ShippedTree {
                sim,
                _rt: rt,
                tree,
                cores,
            }
        }

        /// The sum of the resource rows whose names end with `what`.
        fn count(&self, what: &str) -> u64 {
            self.sim
                .resources()
                .iter()
                .filter(|r| r.name.ends_with(what))
                .map(|r| r.count)
                .sum()
        }

        fn charged(&self) -> JobCharge {
            JobCharge {
                declared: self.sim.declared_instructions(),
                lines: self.count(" llc hits") + self.count(" llc misses"),
                dependent: self.count(" llc dependent misses"),
            }
        }

        /// Runs `f` on the tree as one memory-node worker job; its result
        /// and what the job was charged.
        fn job<R: 'static>(&self, f: impl FnOnce(&XTree) -> R + 'static) -> (R, JobCharge) {
            use dmkv_transport::exec::block_on;
            use std::cell::RefCell;
            use std::rc::Rc;
            let before = self.charged();
            let out = Rc::new(RefCell::new(None));
            let (o, tree) = (out.clone(), self.tree.clone());
            self.cores.submit(
                Box::new(move || *o.borrow_mut() = Some(f(&tree))),
                Box::new(|_| {}),
            );
            block_on(async {
                while out.borrow().is_none() {
                    dmkv_transport::exec::sleep(std::time::Duration::from_micros(1)).await;
                }
            });
            let after = self.charged();
            let r = out.borrow_mut().take().unwrap();
            (
                r,
                JobCharge {
                    declared: after.declared - before.declared,
                    lines: after.lines - before.lines,
                    dependent: after.dependent - before.dependent,
                },
            )
        }
    }

    /// Invariant 10 priced: on a cold cache (a fresh simulation per key,
    /// the prefetcher off, so every line misses), a lookup of the leaf
    /// (`find_leaf`) run as a memory-node job is charged one dependent
    /// miss for the root word, per inner node one for line 0 (meta,
    /// header) and one for the child pointer's line when the scan's key
    /// span did not cover it (its address depends on the scan's result),
    /// none for the scan's further key lines (one access after line 0's),
    /// and one for the leaf's line 0 (its copy's other lines overlap). The
    /// lines looked up are the superblock's, the walk's and the leaf's five.
    /// Checked to fail with the binary search put back (each probed key
    /// line an access of its own, as before branch i68): key 0 then takes
    /// 14 lines and 10 dependent misses, against 12 and 8.
    #[test]
    fn a_walk_pays_one_dependent_miss_per_scan() {
        // Keys below, inside and beyond the stored ones (which are below
        // 2^44).
        let keys: Vec<u64> = (0..12u64)
            .map(|i| i.wrapping_mul(0x2545_F491_4F6C_DD1D))
            .chain((0..12u64).map(|i| scrambled(i * 211) + 1))
            .collect();
        // Per key, from the parsed path (one simulation per thread: this
        // one is dropped before the cold ones are made): the leaf, the
        // inner levels, and the lines and dependent misses a cold cache
        // must show, and those a binary search would have paid.
        let want: Vec<_> = {
            let shape = ShippedTree::new(false);
            let t = &shape.tree;
            assert!(t.root().height >= 3, "two inner levels at least");
            let geo = t.geometry();
            let want: Vec<_> = keys
                .iter()
                .map(|&k| {
                    let (leaf, path) = {
                        let _shared = t.structure.read();
                        t.walk_parsed(k)
                    };
                    let (mut lines, mut dependent, mut binary) = (1 + geo.lines() as u64, 2, 2);
                    for &(node, _) in &path {
                        let img = t.read_locked(node).unwrap();
                        let keys = &img.keys.keys;
                        let (span_last, child) = scan_lines(&geo, keys, k);
                        lines += u64::from(lines_a_scan_reads(&geo, keys, k).count_ones());
                        dependent += 1 + u64::from(child > span_last);
                        // A binary search: line 0, then each probe's new
                        // line and the child's, each an access.
                        binary += 1;
                        let (mut lo, mut hi, mut probed) = (0, keys.len(), 1u64);
                        while lo < hi {
                            let mid = (lo + hi) / 2;
                            let l = geo.line_of(geo.key(mid));
                            binary += u64::from(probed & 1 << l == 0);
                            probed |= 1 << l;
                            if keys[mid] <= k {
                                lo = mid + 1;
                            } else {
                                hi = mid;
                            }
                        }
                        binary += u64::from(probed & 1 << geo.line_of(geo.slot(lo - 1)) == 0);
                    }
                    (leaf, path.len() as u64, lines, dependent, binary)
                })
                .collect();
            want
        };
        let mut below_binary = 0;
        for (&k, &(leaf, inner, lines, dependent, binary)) in keys.iter().zip(&want) {
            below_binary += u64::from(dependent < binary);
            let cold = ShippedTree::new(false);
            let (found, charge) = cold.job(move |t| t.find_leaf(k).unwrap());
            assert_eq!(found.node, leaf, "key {k:#x}");
            assert_eq!(
                (charge.lines, charge.dependent),
                (lines, dependent),
                "key {k:#x}"
            );
            assert_eq!(charge.declared, inner * cost::INNER_LEVEL + cost::LEAF_READ);
        }
        assert!(
            below_binary > 0,
            "some walk pays fewer dependent misses than a binary search's"
        );
    }

    /// Invariant 11 priced: a hinted leaf attempt run as a memory-node job
    /// on a cold cache (a fresh simulation per attempt, the prefetcher off)
    /// pays one dependent miss for line 0 (the lock's word, header, meta)
    /// and none for the key lines its scan reads (one access after line
    /// 0's): a stale incarnation 1 line, a key the leaf lacks its key lines
    /// (the whole scan) for 1 dependent miss, a hit on the leaf's last key
    /// a second one only when the slot word's line is past the key lines
    /// (its address depends on the scan's result), 5 lines in all. Every
    /// 7th leaf of the scrambled tree. Checked to fail with each key line
    /// touched as its own access (the code before branch i68): a key the
    /// leaf lacks then pays a dependent miss per key line (leaf 1: 3
    /// against 1).
    #[test]
    fn a_hinted_leaf_scan_pays_one_dependent_miss() {
        // The leaves, from a tree dropped before the cold ones are made (one
        // simulation per thread; the scrambled tree is the same each time).
        let (geo, leaves) = {
            let shape = ShippedTree::new(false);
            (shape.tree.geometry(), shape.tree.leaves().unwrap())
        };
        let attempt = |hint: LeafRef, key: u64| -> (bool, u64, u64) {
            let cold = ShippedTree::new(false);
            let (hit, c) = cold.job(move |t| {
                let _shared = t.structure.read();
                t.try_hinted_leaf(key, &[7; 8], hint).unwrap()
            });
            (hit, c.lines, c.dependent)
        };
        let mut multi_line = 0;
        for l in leaves.iter().step_by(7) {
            let hint = leaf_ref(l);
            let c = l.keys.len();
            let key_lines = (geo.line_of(geo.key(c - 1)) + 1) as u64;
            multi_line += u64::from(key_lines > 1);
            let stale = LeafRef {
                incarnation: next_incarnation(hint.incarnation),
                ..hint
            };
            assert_eq!(attempt(stale, l.keys[0]), (false, 1, 1), "leaf {}", l.node);
            let absent = (0..)
                .map(|i| l.keys[0] ^ (1 + i))
                .find(|k| !l.keys.contains(k))
                .unwrap();
            assert_eq!(
                attempt(hint, absent),
                (false, key_lines, 1),
                "leaf {}",
                l.node
            );
            let slot_past = geo.line_of(geo.slot(c - 1)) as u64 >= key_lines;
            assert_eq!(
                attempt(hint, l.keys[c - 1]),
                (true, geo.lines() as u64, 1 + u64::from(slot_past)),
                "leaf {}",
                l.node
            );
        }
        assert!(multi_line > 0, "some leaf's keys span several lines");
    }

    /// Invariant 10: the walk takes, of each inner node it passes, exactly
    /// the lines holding the words it reads (meta, header, the keys its
    /// linear scan reads, the child pointer), for N = 4, 5, 16, 48; for
    /// N = 16 that is fewer than the node's five lines on every descent.
    #[test]
    fn the_walk_takes_only_the_lines_it_reads() {
        for slots in [4, 5, 16, MAX_SLOTS] {
            let c = LocalCluster::new(LocalConfig::default());
            let rt = NodeRuntime::new(c.add_node(1));
            let t = scrambled_tree(&rt, slots);
            let geo = t.geometry();
            let _shared = t.structure.read();
            for k in (0..1_000u64).map(|i| i.wrapping_mul(0x2545_F491_4F6C_DD1D)) {
                let mut taken = Vec::new();
                t.walk_lines(k, |node, _, lines| taken.push((node, lines.taken())));
                assert!(!taken.is_empty());
                for &(node, lines) in &taken {
                    let img = t.read_locked(node).unwrap();
                    let want = lines_a_scan_reads(&geo, &img.keys.keys, k);
                    assert_eq!(lines, want, "slots {slots}, node {node}, key {k:#x}");
                }
                if slots == 16 {
                    let all = taken.len() as u32 * geo.lines() as u32;
                    let read: u32 = taken.iter().map(|(_, l)| l.count_ones()).sum();
                    assert!(read < all, "key {k:#x}: {read} of {all} lines");
                }
            }
        }
    }

    /// End to end through `sim`'s line count: a lookup of the leaf
    /// (`find_leaf`: the root word, the walk, then the leaf's whole image)
    /// touches the superblock's line, the lines the walk reads of each
    /// inner node and every line of the leaf, no more. With the walk taking every inner node whole (main before
    /// branch i58) it touched `lines()` lines per inner node and this fails.
    #[test]
    fn a_lookup_is_charged_the_lines_it_reads() {
        use dmkv_transport::exec::block_on;
        let sim = ChargedTree::new();
        let (t, ep, line_ns) = (&sim.tree, &sim.ep, sim.line_ns);
        assert!(t.root().height >= 3, "two inner levels at least");
        let geo = t.geometry();
        let busy = || sim.client_busy();
        let (mut fewer, mut probes) = (0, 0);
        for k in (0..200u64).map(|i| i.wrapping_mul(0x2545_F491_4F6C_DD1D)) {
            let (leaf, path) = {
                let _shared = t.structure.read();
                t.walk_parsed(k)
            };
            let inner: u64 = path
                .iter()
                .map(|&(node, _)| {
                    let img = t.read_locked(node).unwrap();
                    u64::from(lines_a_scan_reads(&geo, &img.keys.keys, k).count_ones())
                })
                .sum();
            // The root word (the superblock's line), the inner nodes' lines
            // read, the whole leaf.
            let want = 1 + inner + geo.lines() as u64;
            let before = busy();
            let found = block_on(ep.charged(async { t.find_leaf(k).unwrap() }));
            assert_eq!(found.node, leaf);
            assert_eq!(busy() - before, want * line_ns, "key {k:#x}");
            probes += 1;
            fewer += u64::from(inner < (path.len() * geo.lines()) as u64);
        }
        assert_eq!(
            fewer, probes,
            "every descent reads fewer lines than its nodes have"
        );
    }

    /// Invariant 11: a hinted leaf attempt (`try_hinted_leaf`) is charged
    /// the lines holding the words it reads under the leaf's lock and no
    /// more: a stale incarnation line 0 only, a leaf lacking the key line 0
    /// and its key lines (three of five for N = 16 when the leaf is full
    /// enough), a write every line (its commit stores every line's version
    /// word). Checked to fail with the attempt copying the whole leaf
    /// (`read_locked_image`, before branch i65): every attempt then took
    /// all five lines.
    #[test]
    fn a_hinted_leaf_attempt_is_charged_the_lines_it_reads() {
        use dmkv_transport::exec::block_on;
        let sim = ChargedTree::new();
        let (t, ep, line_ns) = (&sim.tree, &sim.ep, sim.line_ns);
        let geo = t.geometry();
        let busy = || sim.client_busy();
        let lines_of = |hint: LeafRef, key: u64| -> (bool, u64) {
            let before = busy();
            let hit = block_on(ep.charged(async {
                let _shared = t.structure.read();
                t.try_hinted_leaf(key, &[7; 8], hint).unwrap()
            }));
            (hit, (busy() - before) / line_ns)
        };
        let leaves = t.leaves().unwrap();
        let mut fewer = 0;
        for l in leaves.iter().step_by(7) {
            let hint = leaf_ref(l);
            let c = l.keys.len();
            assert!(c > 0);
            let key_lines = (geo.line_of(geo.key(c - 1)) + 1) as u64;
            let stale = LeafRef {
                incarnation: next_incarnation(hint.incarnation),
                ..hint
            };
            assert_eq!(lines_of(stale, l.keys[0]), (false, 1), "leaf {}", l.node);
            let absent = (0..)
                .map(|i| l.keys[0] ^ (1 + i))
                .find(|k| !l.keys.contains(k));
            let absent = absent.unwrap();
            assert_eq!(
                lines_of(hint, absent),
                (false, key_lines),
                "leaf {}",
                l.node
            );
            fewer += u64::from(key_lines < geo.lines() as u64);
            let last = l.keys[c - 1];
            assert_eq!(
                lines_of(hint, last),
                (true, geo.lines() as u64),
                "leaf {}",
                l.node
            );
            assert_eq!(t.get(last).unwrap(), Some(vec![7; 8]));
        }
        assert!(fewer > 0, "some leaf's miss reads fewer lines than it has");
        t.check_structure().unwrap();
    }

    /// `leaves_covering` declares its work to `sim` per inner node and per
    /// leaf it visits (`COVER_INNER`; `COVER_LEAF`, which since branch
    /// i106 covers the leaf's in-place read too): run as a memory-node worker job over the whole
    /// key range, it declares exactly that for every node of the tree.
    /// Before branch i58 only the leaves' reads declared (this fails:
    /// leaves x `LEAF_READ_PARSED` alone).
    #[test]
    fn the_covering_walk_declares_its_nodes() {
        let shape = ShippedTree::new(true);
        assert!(
            shape.sim.profile().memnode.instructions_per_us() > 0,
            "an instruction term"
        );
        let stats = shape.tree.stats();
        assert!(stats.inner_nodes > 1 && stats.leaves > 100);
        let (found, charge) =
            shape.job(|t| t.leaves_covering(0, u64::MAX, usize::MAX).unwrap().len());
        assert_eq!(found as u64, stats.leaves);
        assert_eq!(
            charge.declared,
            stats.inner_nodes * cost::COVER_INNER + stats.leaves * cost::COVER_LEAF
        );
    }

    /// A hinted update declares its own part, each leaf it tries and, at
    /// the leaf that holds the key, the write (`HINTED_BASE`,
    /// `HINTED_LEAF`, `HINTED_WRITE`); one whose leaves all miss declares
    /// the leaves tried and then what a plain update declares. Run as
    /// memory-node worker jobs. Before branch i63 every hinted update
    /// declared one `HINTED_ATTEMPT` (880) however many leaves it tried:
    /// this fails on that code.
    #[test]
    fn a_hinted_update_declares_each_leaf_it_tries() {
        let shape = ShippedTree::new(true);
        let leaves = shape.tree.leaves().unwrap();
        let (a, b) = (leaf_ref(&leaves[3]), leaf_ref(&leaves[4]));
        let (in_b, elsewhere) = (leaves[4].keys[0], leaves[9].keys[0]);
        // The instructions one job declares; the job must return true.
        let job = |f: Box<dyn FnOnce(&XTree) -> bool>| -> u64 {
            let (ok, charge) = shape.job(f);
            assert!(ok);
            charge.declared
        };
        let hit_second = job(Box::new(move |t| {
            t.update_hinted_leaves(in_b, &[2; 8], &[a, b])
                .unwrap()
                .hint_used
        }));
        assert_eq!(
            hit_second,
            cost::HINTED_BASE + 2 * cost::HINTED_LEAF + cost::HINTED_WRITE
        );
        let plain = job(Box::new(move |t| t.update(elsewhere, &[3; 8]).unwrap()));
        let missed = job(Box::new(move |t| {
            let u = t.update_hinted_leaves(elsewhere, &[4; 8], &[a, b]).unwrap();
            u.updated && !u.hint_used
        }));
        assert_eq!(missed, cost::HINTED_BASE + 2 * cost::HINTED_LEAF + plain);
    }

    /// An insert that splits its leaf declares, beyond a plain insert's
    /// work (descent and `LEAF_WRITE`), the exclusive retry's descent and
    /// `LEAF_WRITE` and one `LEAF_SPLIT`, run as `sim` worker jobs: keys
    /// are inserted into one leaf until it is full, then one more (fails
    /// without the split's declaration: one `LEAF_SPLIT` short).
    #[test]
    fn a_split_declares_its_work() {
        let shape = ShippedTree::new(true);
        let leaves = shape.tree.leaves().unwrap();
        let leaf = &leaves[5];
        let base = leaf.keys[0];
        let height = shape.tree.root().height as u64;
        let room = shape.tree.geometry().slots() - leaf.keys.len();
        // Keys just above the leaf's first, absent from the tree: they fall
        // into this leaf (its range runs to the next leaf's first key).
        let next = leaves[6].keys[0];
        let fresh: Vec<u64> = (1..)
            .map(|d| base + d)
            .filter(|k| !leaf.keys.contains(k))
            .take(room + 1)
            .collect();
        assert!(
            fresh.iter().all(|&k| k < next),
            "the leaf's range is too narrow"
        );
        let job = |k: u64| -> u64 {
            let (ok, charge) = shape.job(move |t| t.insert(k, &[1; 8]).unwrap());
            assert!(ok);
            charge.declared
        };
        let plain: Vec<u64> = fresh[..room].iter().map(|&k| job(k)).collect();
        assert!(plain.iter().all(|&d| d == plain[0]), "{plain:?}");
        assert_eq!(
            plain[0],
            (height - 1) * cost::INNER_LEVEL + cost::LEAF_WRITE
        );
        let split = job(fresh[room]);
        assert_eq!(shape.tree.root().height as u64, height, "no new level");
        assert_eq!(
            split,
            2 * plain[0] + cost::LEAF_SPLIT,
            "plain insert {}, split {split}",
            plain[0]
        );
    }

    /// The in-place walk takes the same path as parsing every inner node,
    /// for keys inside, between and beyond the stored ones, in trees of one
    /// to several inner levels.
    #[test]
    fn the_in_place_walk_matches_the_parsing_walk() {
        for slots in [4, 5, 16, MAX_SLOTS] {
            let c = LocalCluster::new(LocalConfig::default());
            let rt = NodeRuntime::new(c.add_node(1));
            let t = scrambled_tree(&rt, slots);
            assert!(t.stats().inner_nodes > 0, "slots {slots}: no inner level");
            let mut probes: Vec<u64> = vec![0, 1, u64::MAX - 1];
            probes.extend((0..2_000u64).map(|i| i.wrapping_mul(0x2545_F491_4F6C_DD1D)));
            probes.extend((0..500u64).map(scrambled));
            let _shared = t.structure.read();
            for k in probes {
                assert_eq!(t.descend(k), t.walk_parsed(k), "slots {slots}, key {k:#x}");
                assert_eq!(t.descend_to_leaf(k), t.walk_parsed(k).0);
            }
        }
    }
}
