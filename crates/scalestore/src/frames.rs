//! Cache frames and the page translation table (paper §2.2, §3.2).
//!
//! A frame holds everything a node knows about one page: the hybrid latch,
//! the page id, the node's own possession (mode and the cache slot holding
//! its copy), the LRU epoch of the last access, and — on the page's
//! directory — the directory entry. Frames are allocated in chunks on
//! demand, so a directory can track far more pages than its cache holds.
//!
//! The translation table maps page ids to frames: buckets with an
//! optimistic latch each and chains through the frames (the artifact's
//! design): lookups take no lock, validate the bucket version and retry;
//! inserts and removals lock one bucket briefly.

use crate::latch::HybridLatch;
use crate::msg::{Request, Want};
use crate::pid::Pid;
use dmkv_transport::{Responder, touch_local_at};
use parking_lot::{Mutex, MutexGuard};
use std::collections::VecDeque;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};

/// "No frame" / "no slot".
pub const NONE: u32 = u32::MAX;
const FRAME_CHUNK: usize = 4096;

/// A node's possession of a page.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Possession {
    None = 0,
    Shared = 1,
    Exclusive = 2,
}

/// The packed hot-path word of a frame: possession, two flags, and the
/// cache slot of the node's copy.
///
/// ```text
/// bits 0..=1  possession (0 none, 1 shared, 2 exclusive)
/// bit  2      waiting: a remote move is parked here; workers take no new
///             latches (chaining's fairness: the page leaves in request order)
/// bit  3      parked: some remote request is parked here; whoever lets go
///             of the latch kicks the node's re-poll thread
/// bit  4      fresh: a worker just fetched the page for an optimistic
///             access; remote moves wait until a local guard let go of it
/// bits 32..63 cache slot (NONE if no copy is held or being fetched)
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Local {
    pub mode: Possession,
    pub waiting: bool,
    pub parked: bool,
    pub fresh: bool,
    pub slot: u32,
}

const MODE_MASK: u64 = 0b11;
const WAITING: u64 = 0b100;
const PARKED: u64 = 0b1000;
const FRESH: u64 = 0b1_0000;
const SLOT_SHIFT: u32 = 32;
const _: () = assert!(
    MODE_MASK & (WAITING | PARKED | FRESH) == 0
        && WAITING & (PARKED | FRESH) == 0
        && PARKED & FRESH == 0
        && FRESH < 1 << SLOT_SHIFT
);

impl Local {
    pub const EMPTY: Local = Local {
        mode: Possession::None,
        waiting: false,
        parked: false,
        fresh: false,
        slot: NONE,
    };

    fn encode(self) -> u64 {
        self.mode as u64
            | if self.waiting { WAITING } else { 0 }
            | if self.parked { PARKED } else { 0 }
            | if self.fresh { FRESH } else { 0 }
            | (self.slot as u64) << SLOT_SHIFT
    }

    fn decode(w: u64) -> Local {
        Local {
            mode: match w & MODE_MASK {
                1 => Possession::Shared,
                2 => Possession::Exclusive,
                _ => Possession::None,
            },
            waiting: w & WAITING != 0,
            parked: w & PARKED != 0,
            fresh: w & FRESH != 0,
            slot: (w >> SLOT_SHIFT) as u32,
        }
    }
}

/// Who possesses a page, as the directory sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Owners {
    /// Only on the SSD.
    None,
    Exclusive(u8),
    /// Bitmap of node indices (never empty).
    Shared(u64),
}

impl Owners {
    pub fn contains(&self, n: u8) -> bool {
        match *self {
            Owners::None => false,
            Owners::Exclusive(x) => x == n,
            Owners::Shared(s) => s & (1 << n) != 0,
        }
    }

    /// Without `n`.
    pub fn without(self, n: u8) -> Owners {
        match self {
            Owners::Exclusive(x) if x == n => Owners::None,
            Owners::Shared(s) => {
                let s = s & !(1 << n);
                if s == 0 {
                    Owners::None
                } else {
                    Owners::Shared(s)
                }
            }
            o => o,
        }
    }

    /// Bitmap of every owner.
    pub fn bitmap(self) -> u64 {
        match self {
            Owners::None => 0,
            Owners::Exclusive(x) => 1 << x,
            Owners::Shared(s) => s,
        }
    }
}

/// An ownership request held at the directory until it can be decided (a
/// FIFO queue position, or an entry busy with an eviction).
pub struct HeldRequest {
    pub from: u8,
    pub want: Want,
    pub retry: bool,
    pub offset: u64,
    pub responder: Responder,
}

/// The directory entry of a page (kept in the frame on its directory).
pub struct Dir {
    pub owners: Owners,
    /// The conflict epoch (§3.4.3): bumped whenever a grant conflicts with
    /// current owners; evictions carrying an older one are declined.
    pub epoch: u64,
    /// Some cached copy may be newer than the SSD.
    pub dirty: bool,
    /// `dirty` just before the latest conflict grant (for `SsdFetch`).
    pub prev_dirty: bool,
    /// Copies the directory told requesters to take from each sharer
    /// during that sharer's current possession (owner stability for copy
    /// sources: its eviction is declined until it served that many).
    pub copy_grants: Vec<(u8, u32)>,
    /// A dirty last copy is being pulled by an eviction: requests wait.
    pub evicting: bool,
    /// Requests waiting for the eviction pull to finish.
    pub held: Vec<HeldRequest>,
    /// FIFO variant: the requester whose transfer is not acknowledged yet.
    pub transfer: Option<u8>,
    /// FIFO variant: requesters waiting for their turn, answered in order.
    pub queue: VecDeque<HeldRequest>,
    /// FIFO variant: a worker of the directory's own node found a transfer
    /// in flight and asks again; it goes before the queue (§3.4.2: local
    /// workers bypass it), so the next acknowledgement leaves the page to
    /// it instead of granting the queue's head.
    pub local_waiting: bool,
    /// The page is on its way from this directory's SSD to the requester
    /// the entry names (a grant's base case served by the SSD completer,
    /// `ssdio`): other requests wait in `held`, evictions are declined
    /// (invariant 16 in docs/scalestore.md).
    pub reading: bool,
    /// The page is on its way from this directory's own copy to the
    /// requester the entry names, a one-sided WRITE posted to the node's
    /// completer on the real backends (the grant is recorded; our copy, if
    /// the grant takes or downgrades it, stays latched exclusively until
    /// the write ends): other requests wait in `held`, evictions are
    /// declined (invariant 22 in docs/scalestore.md).
    pub delivering: bool,
}

impl Dir {
    pub fn new(epoch: u64) -> Dir {
        Dir {
            owners: Owners::None,
            epoch,
            dirty: false,
            prev_dirty: false,
            copy_grants: Vec::new(),
            evicting: false,
            held: Vec::new(),
            transfer: None,
            queue: VecDeque::new(),
            local_waiting: false,
            reading: false,
            delivering: false,
        }
    }

    /// Whether the entry carries nothing worth a frame.
    pub fn idle(&self) -> bool {
        self.owners == Owners::None
            && !self.dirty
            && self.transfer.is_none()
            && self.queue.is_empty()
            && self.held.is_empty()
            && !self.evicting
            && !self.reading
            && !self.delivering
    }

    /// A page of this entry is on its way (an eviction pull, a read from
    /// our SSD, or a delivery from our own copy): nothing is granted and
    /// other requests are held until it arrives.
    pub fn in_flight(&self) -> bool {
        self.evicting || self.reading || self.delivering
    }

    /// Copies granted from `n` and not yet known to be served.
    pub fn copies_granted(&self, n: u8) -> u32 {
        self.copy_grants
            .iter()
            .find(|(s, _)| *s == n)
            .map_or(0, |(_, c)| *c)
    }

    pub fn note_copy_grant(&mut self, n: u8) {
        match self.copy_grants.iter_mut().find(|(s, _)| *s == n) {
            Some((_, c)) => *c += 1,
            None => self.copy_grants.push((n, 1)),
        }
    }

    /// `n`'s possession ended: its copy grants are void.
    pub fn forget_copies(&mut self, n: u8) {
        self.copy_grants.retain(|(s, _)| *s != n);
    }
}

/// A worker is fetching the page into this frame.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Awaiting {
    #[default]
    No,
    /// The request is out; the grant's epoch is not known yet.
    Unknown,
    /// Granted at this conflict epoch.
    Known(u64),
}

/// A move, invalidation or copy request for this node's copy that could
/// not be served yet, with the right to answer it.
pub struct Parked {
    pub from: u8,
    pub request: Request,
    pub responder: Responder,
    /// When and why it was parked, if tracing is on (`trace::Park`).
    pub traced: Option<crate::trace::Park>,
}

/// Protocol state of a frame, changed under its mutex (never held across
/// an await).
#[derive(Default)]
pub struct Meta {
    /// Conflict epoch at which this node's possession was granted.
    pub epoch: u64,
    pub awaiting: Awaiting,
    /// The directory lists this node as a sharer but its copy failed: the
    /// next request says "retry" so the directory stops counting on it.
    pub phantom: bool,
    /// Copies of this possession served to other nodes.
    pub copies_served: u32,
    /// Requests for this node's copy waiting for the frame.
    pub parked: Vec<Parked>,
    pub dir: Option<Box<Dir>>,
}

impl Meta {
    /// Whether the frame can leave the translation table once it holds no
    /// copy (nothing else refers to it).
    pub fn unused(&self) -> bool {
        self.awaiting == Awaiting::No
            && !self.phantom
            && self.parked.is_empty()
            && self.dir.as_ref().is_none_or(|d| d.idle())
    }
}

/// One frame; see the module documentation.
///
/// Layout (`repr(C)`, aligned to a cache line, pinned by the `const`
/// asserts below), as the artifact keeps a frame within two lines
/// (`BufferFrame`, `static_assert(sizeof(BufferFrame) <= 128)`):
///
/// ```text
/// line 0  latch (word at byte 0, then its waiter list), pid, local
/// line 1  next, lru, meta (the protocol state behind its mutex)
/// ```
///
/// A worker's fix reads the latch word, the page id and the hot-path word
/// (line 0) and stamps the LRU epoch (line 1); a translation-table walk
/// reads each chained frame's page id (line 0) and, past it, its link
/// (line 1). For the simulated compute CPU (`touch_local_at`, counted by
/// address, once per operation) every access reports its line's first
/// word: line 0 is the frame's own address (the same key the latch
/// reports for its word), line 1 the address of `next`. So an operation
/// counts the lines it really touches, not one line per field.
#[repr(C, align(64))]
pub struct Frame {
    pub latch: HybridLatch,
    pub pid: AtomicU64,
    local: AtomicU64,
    next: AtomicU32,
    pub lru: AtomicU64,
    pub meta: Mutex<Meta>,
}

/// Bytes of a cache line.
const LINE: usize = 64;

const _: () = {
    use std::mem::{align_of, offset_of};
    assert!(align_of::<Frame>() == LINE);
    assert!(offset_of!(Frame, latch) == 0);
    assert!(offset_of!(Frame, pid) + 8 <= LINE);
    assert!(offset_of!(Frame, local) + 8 <= LINE);
    assert!(offset_of!(Frame, next) == LINE);
    assert!(offset_of!(Frame, lru) + 8 <= 2 * LINE);
};

impl Frame {
    fn new() -> Frame {
        Frame {
            latch: HybridLatch::new(),
            pid: AtomicU64::new(Pid::EMPTY.0),
            next: AtomicU32::new(NONE),
            local: AtomicU64::new(Local::EMPTY.encode()),
            lru: AtomicU64::new(0),
            meta: Mutex::new(Meta::default()),
        }
    }

    /// Line 0 (latch word, page id, hot-path word) was read.
    #[inline]
    fn touched_line0(&self) {
        touch_local_at(self);
    }

    /// Line 1 (link, LRU epoch) was read.
    #[inline]
    fn touched_line1(&self) {
        touch_local_at(&self.next);
    }

    pub fn pid(&self) -> Pid {
        self.touched_line0();
        Pid(self.pid.load(Ordering::Acquire))
    }

    pub fn local(&self) -> Local {
        self.touched_line0();
        Local::decode(self.local.load(Ordering::SeqCst))
    }

    /// Changes the hot-path word (under the frame's mutex, and with the
    /// latch held exclusively unless the frame's worker is awaiting). The
    /// store is sequentially consistent: a handler that sets `parked` and
    /// then re-tries the latch, and a worker that lets go of the latch and
    /// then reads `parked`, cannot both miss each other.
    pub fn set_local(&self, l: Local) {
        self.local.store(l.encode(), Ordering::SeqCst);
    }

    /// Sets the possession and slot, keeping the flags.
    pub fn set_possession(&self, mode: Possession, slot: u32) {
        let l = self.local();
        self.set_local(Local { mode, slot, ..l });
    }

    pub fn set_fresh(&self, fresh: bool) {
        let l = self.local();
        self.set_local(Local { fresh, ..l });
    }

    /// Sets the two flags from the parked requests (`waiting` only if some
    /// parked move asks for fairness).
    pub fn set_flags(&self, waiting: bool, parked: bool) {
        let l = self.local();
        self.set_local(Local {
            waiting,
            parked,
            ..l
        });
        if l.waiting && !waiting {
            // Workers wait for `waiting` to clear on the latch's waiter
            // list (`Worker::latch_cold`, `Worker::fix`): the serving of a
            // parked move need not let go of the latch (a stale move is
            // served without it, invariant 4), so wake them here too.
            self.latch.wake_waiters();
        }
    }

    /// Records an access in the current global epoch (§4.1): a plain check
    /// first, so hot frames are not written on every access.
    pub fn touch(&self, epoch: u64) {
        self.touched_line1();
        if self.lru.load(Ordering::Relaxed) < epoch {
            self.lru.store(epoch, Ordering::Relaxed);
        }
    }
}

/// A translation-table bucket: 16 bytes aligned to 16, so its two words
/// always share one cache line (counted once, by the bucket's address).
#[repr(C, align(16))]
struct Bucket {
    /// Bit 0: locked; the rest a version bumped by every change.
    lock: AtomicU64,
    head: AtomicU32,
}

/// Frames and the translation table.
pub struct FrameTable {
    chunks: Box<[OnceLock<Box<[Frame]>>]>,
    fresh: AtomicU32,
    capacity: u32,
    free: Mutex<Vec<u32>>,
    buckets: Box<[Bucket]>,
    mask: u64,
}

/// The table is full (more pages tracked than frames).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableFull;

impl FrameTable {
    /// Room for `capacity` frames and about `expected` live ones.
    pub fn new(capacity: usize, expected: usize) -> FrameTable {
        let capacity = capacity.min(NONE as usize - 1);
        let chunks = capacity.div_ceil(FRAME_CHUNK);
        let buckets = (expected * 2).next_power_of_two().max(1024);
        FrameTable {
            chunks: (0..chunks).map(|_| OnceLock::new()).collect(),
            fresh: AtomicU32::new(0),
            capacity: capacity as u32,
            free: Mutex::new(Vec::new()),
            buckets: (0..buckets)
                .map(|_| Bucket {
                    lock: AtomicU64::new(0),
                    head: AtomicU32::new(NONE),
                })
                .collect(),
            mask: buckets as u64 - 1,
        }
    }

    /// Frame `i` (which must have been handed out).
    pub fn frame(&self, i: u32) -> &Frame {
        let c = self.chunks[i as usize / FRAME_CHUNK]
            .get()
            .expect("a frame handed out lives in an allocated chunk");
        &c[i as usize % FRAME_CHUNK]
    }

    /// Frames handed out so far (live or free): iteration bound.
    pub fn high_water(&self) -> u32 {
        self.fresh.load(Ordering::Acquire).min(self.capacity)
    }

    fn bucket(&self, pid: Pid) -> &Bucket {
        let h = pid.0.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 20;
        &self.buckets[(h & self.mask) as usize]
    }

    /// The frame of `pid`, without locking.
    ///
    /// Simulated compute CPU (`touch_local_at`, docs/simulation.md): each
    /// line the walk reads is a line of the operation (the bucket's, each
    /// chained frame's line 0 for its page id and, if the walk goes on, its
    /// line 1 for its link; see [`Frame`]), counted once per operation
    /// however often it is read again.
    pub fn find(&self, pid: Pid) -> Option<u32> {
        let b = self.bucket(pid);
        loop {
            touch_local_at(b);
            let v = b.lock.load(Ordering::Acquire);
            if v & 1 != 0 {
                std::hint::spin_loop();
                continue;
            }
            let mut found = None;
            let mut i = b.head.load(Ordering::Acquire);
            let mut steps = 0;
            while i != NONE && steps <= self.capacity {
                let f = self.frame(i);
                f.touched_line0();
                if f.pid.load(Ordering::Acquire) == pid.0 {
                    found = Some(i);
                    break;
                }
                f.touched_line1();
                i = f.next.load(Ordering::Acquire);
                steps += 1;
            }
            fence(Ordering::Acquire);
            if b.lock.load(Ordering::Acquire) == v {
                return found;
            }
        }
    }

    fn lock_bucket(b: &Bucket) -> u64 {
        loop {
            let v = b.lock.load(Ordering::Relaxed);
            if v & 1 == 0
                && b.lock
                    .compare_exchange_weak(v, v | 1, Ordering::Acquire, Ordering::Relaxed)
                    .is_ok()
            {
                return v;
            }
            std::hint::spin_loop();
        }
    }

    fn new_frame(&self) -> Result<u32, TableFull> {
        if let Some(i) = self.free.lock().pop() {
            return Ok(i);
        }
        let i = self.fresh.fetch_add(1, Ordering::AcqRel);
        if i >= self.capacity {
            self.fresh.fetch_sub(1, Ordering::AcqRel);
            return Err(TableFull);
        }
        self.chunks[i as usize / FRAME_CHUNK]
            .get_or_init(|| (0..FRAME_CHUNK).map(|_| Frame::new()).collect());
        Ok(i)
    }

    /// The frame of `pid`, inserting an empty one if there is none.
    pub fn find_or_insert(&self, pid: Pid) -> Result<u32, TableFull> {
        if let Some(i) = self.find(pid) {
            return Ok(i);
        }
        // Prepare a frame before locking the bucket: its mutex may still be
        // held by whoever just freed it, and that holder may need buckets.
        let n = self.new_frame()?;
        let f = self.frame(n);
        *f.meta.lock() = Meta::default();
        f.set_local(Local::EMPTY);
        let b = self.bucket(pid);
        let v = Self::lock_bucket(b);
        let mut i = b.head.load(Ordering::Relaxed);
        while i != NONE {
            let g = self.frame(i);
            if g.pid.load(Ordering::Relaxed) == pid.0 {
                b.lock.store(v, Ordering::Release);
                self.free.lock().push(n);
                return Ok(i);
            }
            i = g.next.load(Ordering::Relaxed);
        }
        f.next
            .store(b.head.load(Ordering::Relaxed), Ordering::Relaxed);
        f.pid.store(pid.0, Ordering::Release);
        b.head.store(n, Ordering::Release);
        b.lock.store(v + 2, Ordering::Release);
        Ok(n)
    }

    /// The frame of `pid` (inserted if there is none) with its mutex held,
    /// checked to be `pid`'s frame *under* the mutex.
    ///
    /// A frame index found without the mutex can be stale by the time the
    /// mutex is ours: whoever held it may have removed the frame (a worker
    /// giving up a fetch, `release_empty`), and the frame may even be in
    /// use again, for `pid` or for another page. Writing state into it
    /// then loses that state (the frame is reset when it is reused) or
    /// gives it to the wrong page. Removal clears the page id under the
    /// mutex, and reuse publishes the new id only after resetting the
    /// meta under the mutex, so a frame that holds `pid` while we hold its
    /// mutex is in the table for `pid` and stays there until we let go.
    /// (The lost directory entry behind `join_and_leave_keep_every_value`'s
    /// `page p1:0 is not a tree node`: `docs/scalestore.md`, invariant 12.)
    pub fn lock_or_insert(&self, pid: Pid) -> Result<(u32, MutexGuard<'_, Meta>), TableFull> {
        loop {
            let i = self.find_or_insert(pid)?;
            let f = self.frame(i);
            let m = f.meta.lock();
            if f.pid() == pid {
                return Ok((i, m));
            }
        }
    }

    /// Unlinks frame `i` (held exclusively, its mutex held by the caller)
    /// and frees it. Optimistic readers of it fail validation because the
    /// caller's exclusive unlatch bumps the version.
    pub fn remove(&self, i: u32) {
        let f = self.frame(i);
        let pid = f.pid();
        let b = self.bucket(pid);
        let v = Self::lock_bucket(b);
        let mut prev: Option<u32> = None;
        let mut cur = b.head.load(Ordering::Relaxed);
        while cur != NONE && cur != i {
            prev = Some(cur);
            cur = self.frame(cur).next.load(Ordering::Relaxed);
        }
        if cur == i {
            let next = f.next.load(Ordering::Relaxed);
            match prev {
                None => b.head.store(next, Ordering::Release),
                Some(p) => self.frame(p).next.store(next, Ordering::Release),
            }
        }
        f.pid.store(Pid::EMPTY.0, Ordering::Release);
        f.set_local(Local::EMPTY);
        b.lock.store(v + 2, Ordering::Release);
        if cur == i {
            self.free.lock().push(i);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn local_word_round_trips() {
        for l in [
            Local::EMPTY,
            Local {
                mode: Possession::Exclusive,
                waiting: true,
                parked: false,
                fresh: true,
                slot: 7,
            },
            Local {
                mode: Possession::Shared,
                waiting: false,
                parked: true,
                fresh: false,
                slot: NONE - 1,
            },
        ] {
            assert_eq!(Local::decode(l.encode()), l);
        }
    }

    #[test]
    fn table_finds_inserts_and_removes() {
        let t = FrameTable::new(10_000, 100);
        let pids: Vec<Pid> = (0..5000).map(|i| Pid::new((i % 3) as u8, i)).collect();
        let frames: Vec<u32> = pids.iter().map(|&p| t.find_or_insert(p).unwrap()).collect();
        for (p, f) in pids.iter().zip(&frames) {
            assert_eq!(t.find(*p), Some(*f));
            assert_eq!(t.frame(*f).pid(), *p);
            assert_eq!(t.find_or_insert(*p).unwrap(), *f);
        }
        for (p, f) in pids.iter().zip(&frames).step_by(2) {
            t.remove(*f);
            assert_eq!(t.find(*p), None);
        }
        for (p, f) in pids.iter().zip(&frames).skip(1).step_by(2) {
            assert_eq!(t.find(*p), Some(*f));
        }
        let small = FrameTable::new(2, 2);
        small.find_or_insert(Pid::new(0, 1)).unwrap();
        small.find_or_insert(Pid::new(0, 2)).unwrap();
        assert_eq!(small.find_or_insert(Pid::new(0, 3)), Err(TableFull));
    }
}
