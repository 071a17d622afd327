//! What a `local` memory node's handler thread charges for each RPC it
//! serves: its CPU from the moment it finds the request to the moment the
//! reply has been sent and the caller woken, measured with the time-stamp
//! counter, no system call per RPC, with any stretch in which the thread
//! was off its CPU left out (docs/performance.md, "Tenth pass (branch
//! i33)"; docs/transport.md, "What an RPC is charged").
//!
//! **The chain.** A handler thread reads the counter once where a busy
//! stretch starts (just before the poll that finds the first request), once
//! just before each reply is sent and once just after. Request `i`'s own
//! work `w_i` is from the previous reading (the end of request `i-1`'s send,
//! or the stretch's start) to the reading before its send: reading the
//! request (its line comes from the caller's core), finding the handler, the
//! handler, building the reply. Its send `c_i` (publishing the reply and
//! waking the caller) is from the reading before the send to the one after.
//! The reply carries its charge, so it cannot include its own send: reply
//! `i` carries `w_i + c_{i-1}`, the send measured last on this thread (the
//! previous RPC's, of the same kind in every engine here: an inline reply
//! and a wake-up). Readings are shared between neighbouring intervals, so
//! consecutive intervals tile the stretch.
//!
//! Invariants (checked by `tests`):
//! - C1: the charges handed out so far, plus the carried send and the
//!   carried fraction of a nanosecond, are exactly the measured intervals'
//!   ticks converted at the calibrated rate: nothing is lost or counted
//!   twice to rounding (a 32.32 fixed-point remainder is carried).
//! - C2: an interval in which the thread was descheduled (preempted,
//!   blocked, migrated or signalled: the kernel cleared the thread's
//!   `rseq_cs` word, see [`Preempt`]) is charged 0 and counted as dropped;
//!   where the detector is unavailable every interval is charged and the
//!   elapsed time is scaled by [`crate::BusyClock`]'s on-CPU fraction as
//!   before this pass.
//! - C3: time between busy stretches (polling, yielding, sleeping) is never
//!   charged; the stretch ends at the last send's end and the next begins at
//!   the poll that finds a request.
//! - C4: outside a stretch (a thread that is not a `local` handler, the UCX
//!   backend, `sim`) nothing here runs: `ServiceTable` falls back to its own
//!   stopwatch, and under `sim` to virtual CPU, unchanged.
//!
//! Each interval has one reading's own cost (calibrated once per process
//! as the least back-to-back difference) taken off: the measurement is not
//! the handler's work.
//!
//! Why plain `rdtsc` without a fence: a reading that the core executes a few
//! instructions early or late moves cost from one interval to its neighbour
//! (they share the reading), not in or out of the chain; only a stretch's
//! two ends can be off, by at most the reorder window (tens of cycles), once
//! per stretch. A serialising `lfence; rdtsc` would cost more than that
//! error on every reading (the bench `charge parts` measures both).

use std::cell::{Cell, UnsafeCell};

/// The time-stamp counter (nanoseconds elsewhere).
#[inline]
pub fn ticks() -> u64 {
    crate::cputime::ticks()
}

/// What one reading of the counter adds to the time of the code around it:
/// the least, over 8 trials, of the mean over 256 dependent readings in a
/// row, measured once per process. (The least difference of two
/// back-to-back readings, ~24 ticks on this guest, is only how far apart
/// their sampling points are; a reading occupies the core for ~65 ticks,
/// ~26 ns: docs/performance.md, "Tenth pass".)
pub fn reading_overhead_ticks() -> u64 {
    static OVERHEAD: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *OVERHEAD.get_or_init(|| {
        (0..8)
            .map(|_| {
                let start = ticks();
                let mut last = start;
                for _ in 0..256 {
                    // Each reading waits for the previous one's result.
                    last = std::hint::black_box(last) ^ ticks();
                }
                let _ = last;
                ticks().saturating_sub(start) / 257
            })
            .min()
            .unwrap_or(0)
    })
}

/// The counter after an `lfence` (for the bench's comparison only).
#[inline]
pub fn ticks_fenced() -> u64 {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: LFENCE and RDTSC exist on every x86-64 CPU and have no
    // preconditions.
    unsafe {
        core::arch::x86_64::_mm_lfence();
        core::arch::x86_64::_rdtsc()
    }
    #[cfg(not(target_arch = "x86_64"))]
    ticks()
}

/// Ticks to nanoseconds as a 32.32 fixed-point factor (calibrated once).
#[inline]
pub fn ns_per_tick_32() -> u64 {
    crate::cputime::ns_per_tick_32()
}

/// The chain's arithmetic, in ticks, free of clocks and thread-locals: its
/// caller passes each reading and whether the thread was off its CPU since
/// the previous one.
#[derive(Debug, Default, Clone)]
pub(crate) struct Chain {
    /// A busy stretch is open.
    active: bool,
    /// The last reading: the previous send's end or the stretch's start.
    mark: u64,
    /// The reading before the current send.
    pre_send: u64,
    /// Ticks of the last send, not charged yet (C1).
    carry: u64,
    /// Low 32 bits of the fixed-point nanoseconds not charged yet (C1).
    frac: u64,
    /// Ticks one reading adds to the interval it ends (the least of many
    /// back-to-back readings, [`reading_overhead_ticks`]), subtracted from
    /// every interval: the measurement's own cost is not the handler's.
    overhead: u64,
    pub(crate) totals: Totals,
}

/// What a thread's chain measured, for the report and the tests.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Totals {
    /// Nanoseconds handed out in replies.
    pub charged_ns: u64,
    /// Ticks of requests' own work and of sends that were charged.
    pub work_ticks: u64,
    pub send_ticks: u64,
    /// Replies charged, and intervals dropped (C2).
    pub replies: u64,
    pub dropped: u64,
    /// Ticks left out by [`Chain::skip`] (the loop's own measurement).
    pub skipped_ticks: u64,
}

impl Chain {
    /// A chain whose intervals each lose `overhead` ticks (a reading's cost).
    pub(crate) fn with_overhead(overhead: u64) -> Chain {
        Chain {
            overhead,
            ..Chain::default()
        }
    }

    /// A stretch starts at reading `now` (no-op if one is open).
    pub(crate) fn begin(&mut self, now: u64) {
        if !self.active {
            self.active = true;
            self.mark = now;
        }
    }

    /// The stretch ends (C3): what follows the last mark is not charged;
    /// the last send stays carried.
    pub(crate) fn end(&mut self) {
        self.active = false;
    }

    /// Restarts the current request's interval at `now` (after a deliberate
    /// delay, such as an injected message delay, that is not work).
    pub(crate) fn restart(&mut self, now: u64) {
        if self.active {
            self.mark = now;
        }
    }

    /// Leaves `ticks` spent since the last reading out of the current
    /// request's interval (the serving loop's own measurement, such as
    /// [`crate::BusyClock`]'s sampled thread-CPU read, is not the
    /// handler's work). No-op outside a stretch. The caller measured them
    /// between the last reading and the next, so the interval stays
    /// non-negative (it saturates at 0 regardless).
    pub(crate) fn skip(&mut self, ticks: u64) {
        if self.active {
            self.mark = self.mark.saturating_add(ticks);
            self.totals.skipped_ticks += ticks;
        }
    }

    #[cfg(test)]
    pub(crate) fn active(&self) -> bool {
        self.active
    }

    /// The reading before a send: returns the nanoseconds the reply carries
    /// (its own work and the carried send).
    pub(crate) fn before_send(&mut self, now: u64, interrupted: bool, ns_per_tick_32: u64) -> u64 {
        let work = if interrupted {
            self.totals.dropped += 1;
            0
        } else {
            now.saturating_sub(self.mark).saturating_sub(self.overhead)
        };
        self.totals.work_ticks += work;
        self.pre_send = now;
        let ticks = work + std::mem::take(&mut self.carry);
        let fixed = ticks as u128 * ns_per_tick_32 as u128 + self.frac as u128;
        self.frac = (fixed & 0xffff_ffff) as u64;
        let ns = (fixed >> 32) as u64;
        self.totals.charged_ns += ns;
        self.totals.replies += 1;
        ns
    }

    /// The reading after the send: the send is carried to the next reply.
    pub(crate) fn after_send(&mut self, now: u64, interrupted: bool) {
        let send = if interrupted {
            self.totals.dropped += 1;
            0
        } else {
            now.saturating_sub(self.pre_send)
                .saturating_sub(self.overhead)
        };
        self.totals.send_ticks += send;
        self.carry = send;
        self.mark = now;
    }

    /// Ticks measured but not yet handed out (the carried send), and the
    /// carried fraction (for C1's check).
    #[cfg(test)]
    fn pending(&self) -> (u64, u64) {
        (self.carry, self.frac)
    }
}

/// Detects that the thread was descheduled between two readings, without a
/// system call: Linux's restartable sequences. glibc (2.35 and later)
/// registers an `rseq` area for every thread; whenever the kernel switches
/// the thread out (preemption, blocking, migration) or delivers a signal, on
/// the way back to user space it looks at the area's `rseq_cs` word and, if
/// it points to a critical-section descriptor the thread is not inside,
/// clears it. So: store a pointer to a descriptor of an empty section
/// ([`Preempt::arm`]); later, a zero there means the thread was off its CPU
/// meanwhile ([`Preempt::fired`]). An interrupt that returns to the thread
/// without a switch does not clear it (its time is the kernel's, charged
/// as the thread's CPU by the OS too).
///
/// The descriptor must be valid or the kernel kills the thread: version 0,
/// an empty section, and an abort address preceded by the signature glibc
/// registered (`RSEQ_SIG`, 0x53053053 on x86). The abort address is never
/// jumped to (the thread is never inside the empty section).
#[derive(Clone, Copy)]
pub(crate) struct Preempt {
    /// The calling thread's `rseq_cs` word; null if unavailable.
    word: *const std::sync::atomic::AtomicU64,
}

#[cfg(all(target_os = "linux", target_arch = "x86_64", target_env = "gnu"))]
mod rseq {
    /// The signature glibc registers on x86 (`RSEQ_SIG`).
    #[repr(C, align(8))]
    pub(super) struct Sig(pub [u32; 2]);
    pub(super) static SIG: Sig = Sig([0, 0x5305_3053]);

    /// `struct rseq_cs` (Linux uapi), 32-byte aligned.
    #[repr(C, align(32))]
    pub(super) struct Descriptor {
        pub version: u32,
        pub flags: u32,
        pub start_ip: u64,
        pub post_commit_offset: u64,
        pub abort_ip: u64,
    }

    /// glibc's `__rseq_offset` (from the thread pointer) if it registered an
    /// area big enough to hold `rseq_cs` (bytes 8..16), looked up once.
    pub(super) fn offset() -> Option<isize> {
        static OFFSET: std::sync::OnceLock<Option<isize>> = std::sync::OnceLock::new();
        *OFFSET.get_or_init(|| {
            // SAFETY: dlsym with RTLD_DEFAULT and NUL-terminated names; the
            // symbols, when present, are glibc's `const ptrdiff_t` and
            // `const unsigned int`, set before `main` and never changed.
            unsafe {
                let off = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_offset".as_ptr());
                let size = libc::dlsym(libc::RTLD_DEFAULT, c"__rseq_size".as_ptr());
                if off.is_null() || size.is_null() || *(size as *const u32) < 16 {
                    return None;
                }
                Some(*(off as *const isize))
            }
        })
    }

    /// The descriptor of an empty section whose abort address follows
    /// [`SIG`]'s signature word.
    pub(super) fn descriptor() -> &'static Descriptor {
        static D: std::sync::OnceLock<Descriptor> = std::sync::OnceLock::new();
        D.get_or_init(|| {
            let abort = std::ptr::addr_of!(SIG.0[1]) as u64 + 4;
            Descriptor {
                version: 0,
                flags: 0,
                start_ip: abort,
                post_commit_offset: 0,
                abort_ip: abort,
            }
        })
    }

    /// The thread pointer (`%fs:0` holds its own address under glibc).
    pub(super) fn thread_pointer() -> usize {
        let tp: usize;
        // SAFETY: reads the TCB's self pointer; no side effects.
        unsafe {
            std::arch::asm!("mov {}, fs:0", out(reg) tp, options(nostack, readonly, preserves_flags))
        };
        tp
    }
}

impl Preempt {
    /// The detector for the calling thread (to be used on it only).
    pub(crate) fn for_this_thread() -> Preempt {
        #[cfg(all(target_os = "linux", target_arch = "x86_64", target_env = "gnu"))]
        if let Some(off) = rseq::offset() {
            let area = (rseq::thread_pointer() as isize + off) as usize;
            return Preempt {
                word: (area + 8) as *const std::sync::atomic::AtomicU64,
            };
        }
        Preempt {
            word: std::ptr::null(),
        }
    }

    pub(crate) fn available(&self) -> bool {
        !self.word.is_null()
    }

    #[cfg(all(target_os = "linux", target_arch = "x86_64", target_env = "gnu"))]
    #[inline]
    fn word(&self) -> Option<&std::sync::atomic::AtomicU64> {
        // SAFETY: `word` is this thread's `rseq_cs` field (8-byte aligned
        // in the 32-byte aligned area glibc keeps for the thread's life),
        // and a `Preempt` is used only on the thread that made it (it
        // lives in that thread's thread-local `STATE`).
        (!self.word.is_null()).then(|| unsafe { &*self.word })
    }

    /// Points `rseq_cs` at the empty section's descriptor.
    #[inline]
    pub(crate) fn arm(&self) {
        #[cfg(all(target_os = "linux", target_arch = "x86_64", target_env = "gnu"))]
        if let Some(w) = self.word() {
            let d = rseq::descriptor() as *const rseq::Descriptor as u64;
            w.store(d, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Whether the thread was switched out (or signalled) since
    /// [`Preempt::arm`]; re-arms. Always false where unavailable.
    #[inline]
    pub(crate) fn fired(&self) -> bool {
        #[cfg(all(target_os = "linux", target_arch = "x86_64", target_env = "gnu"))]
        if let Some(w) = self.word() {
            let fired = w.load(std::sync::atomic::Ordering::Relaxed) == 0;
            if fired {
                self.arm();
            }
            return fired;
        }
        false
    }
}

/// Points of one RPC on the handler thread, for the `charge-breakdown`
/// feature's split of the charged interval (the bench `empty handler`
/// prints it). Without the feature [`stamp`] compiles to nothing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Stage {
    /// The request was taken from its lane (its payload copied).
    Taken = 1,
    /// `ServiceTable::dispatch` found the handler.
    Found = 2,
    /// The handler returned.
    Handled = 3,
    // 4: the reading before the send.
    /// The reply's body is written into its slot (local backend).
    Written = 5,
    /// The reply slot's state word says answered (local backend).
    Answered = 6,
    // 7: the reading after the send.
}

/// Names of the breakdown's parts, in order: from the previous reading to
/// `Taken`, then between consecutive stages, `Handled` to the reading
/// before the send (the charge bookkeeping), that reading to `Written`,
/// `Written` to `Answered`, `Answered` to the reading after the send.
pub const PARTS: [&str; 7] = [
    "poll + take (request line)",
    "dispatch (find handler)",
    "handler",
    "charge bookkeeping",
    "write reply body",
    "answer (state word)",
    "wake caller",
];

struct State {
    chain: Chain,
    preempt: Preempt,
    /// A poll's reading not yet used as a stretch start.
    poll_mark: Option<u64>,
    /// Stamps of the current RPC (index 0: the previous reading).
    #[cfg(feature = "charge-breakdown")]
    stamps: [u64; 8],
    #[cfg(feature = "charge-breakdown")]
    parts: [u64; 7],
    #[cfg(feature = "charge-breakdown")]
    samples: u64,
    /// This thread's totals as [`summary`] reads them.
    published: &'static Published,
}

/// Slots of a thread's published totals: charged ns, work ticks, send
/// ticks, replies, dropped, the seven parts' ticks, part samples.
const SLOTS: usize = 13;

/// One handler thread's totals, written by it alone (plain stores at the
/// end of each stretch, no lock) and summed by [`summary`].
#[derive(Default)]
struct Published([std::sync::atomic::AtomicU64; SLOTS]);

/// Every thread that ever served a stretch.
/// Each is leaked, once per thread (kept after the thread ends, as the
/// report sums it), so a thread's `State` holds a plain reference and has
/// no destructor: its thread-local needs no registration check per access.
static REGISTRY: parking_lot::Mutex<Vec<&'static Published>> = parking_lot::Mutex::new(Vec::new());

thread_local! {
    /// The thread's chain. No destructor (`State` owns nothing to drop) and
    /// no borrow flag: [`with_state`] is its only access, and no closure
    /// passed to it calls it again.
    static STATE: UnsafeCell<Option<State>> = const { UnsafeCell::new(None) };
    /// Whether this thread has a stretch open (kept apart so the check on
    /// every dispatch is one cell read).
    static ACTIVE: Cell<bool> = const { Cell::new(false) };
}

// Two readings per RPC come through here (before and after the reply's
// send): a thread-local without a destructor, no `RefCell` borrow.
// The thread-local's address is taken with a closure small enough to be
// inlined, and `f` runs outside `LocalKey::with` (branch i71: with `f`
// inside it, the reply's reading before its send was an out-of-line
// `LocalKey::with` call per RPC).
#[inline(always)]
#[allow(unsafe_code)]
fn with_state<R>(f: impl FnOnce(&mut State) -> R) -> R {
    let s: *mut Option<State> = STATE.with(UnsafeCell::get);
    // SAFETY: `STATE` is this thread's alone (the pointer is used on this
    // thread, within this call, and a const-initialised thread-local
    // without destructor lives as long as its thread), and the only
    // reference to its contents is this one: every closure given to
    // `with_state` (here, in this module) reads clocks, the preemption
    // word and the chain, and none calls `with_state` again, so this
    // `&mut` is never aliased.
    let s = unsafe { &mut *s };
    let s = s.get_or_insert_with(new_state);
    f(s)
}

#[cold]
fn new_state() -> State {
    State {
        chain: Chain::with_overhead(reading_overhead_ticks()),
        preempt: Preempt::for_this_thread(),
        poll_mark: None,
        #[cfg(feature = "charge-breakdown")]
        stamps: [0; 8],
        #[cfg(feature = "charge-breakdown")]
        parts: [0; 7],
        #[cfg(feature = "charge-breakdown")]
        samples: 0,
        published: {
            let p: &'static Published = Box::leak(Box::default());
            REGISTRY.lock().push(p);
            p
        },
    }
}

/// Whether the preemption detector works in this process (C2).
pub fn preemption_detected() -> bool {
    with_state(|s| s.preempt.available())
}

/// A handler thread is about to poll its lanes: the reading that starts a
/// stretch if this poll finds a request (C3).
#[inline]
pub fn note_poll() {
    with_state(|s| {
        s.preempt.arm();
        s.poll_mark = Some(ticks());
    })
}

/// A handler thread starts serving (no-op if a stretch is open): from here
/// on, `ServiceTable` charges its replies through the chain. The stretch
/// starts at the last [`note_poll`] unless the thread was switched out
/// since (then now).
///
/// Called on every pass of the serving loop: the check for an open stretch
/// is inlined there, the start out of line.
#[inline]
pub fn begin_stretch() {
    if !ACTIVE.with(Cell::get) {
        open_stretch();
    }
}

/// [`begin_stretch`] when no stretch is open.
#[inline(never)]
fn open_stretch() {
    with_state(|s| {
        let start = match s.poll_mark.take() {
            Some(t) if !s.preempt.fired() => t,
            _ => {
                s.preempt.arm();
                ticks()
            }
        };
        s.chain.begin(start);
        #[cfg(feature = "charge-breakdown")]
        {
            s.stamps = [0; 8];
            s.stamps[0] = start;
        }
    });
    ACTIVE.with(|a| a.set(true));
}

/// The handler thread found every lane empty: the stretch ends (C3), and
/// its totals are published for [`summary`].
pub fn end_stretch() {
    if !ACTIVE.with(|a| a.replace(false)) {
        return;
    }
    with_state(|s| {
        s.chain.end();
        s.poll_mark = None;
        let t = s.chain.totals;
        let slot = |i: usize| &s.published.0[i];
        let before = slot(4).load(std::sync::atomic::Ordering::Relaxed);
        if t.dropped > before {
            use crate::servestats::{Counter, Role};
            crate::servestats::add(Role::Handler, Counter::ChargeDropped, t.dropped - before);
        }
        #[allow(unused_mut)]
        let mut vals = [0u64; SLOTS];
        vals[..5].copy_from_slice(&[
            t.charged_ns,
            t.work_ticks,
            t.send_ticks,
            t.replies,
            t.dropped,
        ]);
        #[cfg(feature = "charge-breakdown")]
        {
            vals[5..12].copy_from_slice(&s.parts);
            vals[12] = s.samples;
        }
        // Single writer: plain stores (the reader sums what it sees).
        for (i, v) in vals.into_iter().enumerate() {
            slot(i).store(v, std::sync::atomic::Ordering::Relaxed);
        }
    });
}

/// `ticks`, measured by the caller since the last reading of the stretch,
/// were the serving loop's own measurement, not the request's work: left
/// out of its interval (no-op outside a stretch; see [`Chain::skip`]).
#[inline]
pub(crate) fn skip(ticks: u64) {
    if !ACTIVE.with(Cell::get) {
        return;
    }
    with_state(|s| s.chain.skip(ticks))
}

/// The current request's interval restarts now (an injected delivery delay
/// was slept through; it is not the handler's work).
pub fn restart() {
    if !ACTIVE.with(Cell::get) {
        return;
    }
    with_state(|s| {
        s.preempt.arm();
        s.chain.restart(ticks());
    })
}

/// Whether the calling thread is inside a stretch (so replies are charged
/// through the chain).
#[inline]
pub(crate) fn active() -> bool {
    ACTIVE.with(Cell::get)
}

/// The reading before a reply's send: the nanoseconds it carries.
#[inline]
pub(crate) fn before_send() -> u64 {
    with_state(|s| {
        let now = ticks();
        let fired = s.preempt.fired();
        #[cfg(feature = "charge-breakdown")]
        {
            s.stamps[4] = now;
            if fired {
                s.stamps[0] = 0; // this RPC is not sampled
            }
        }
        let ns = s.chain.before_send(now, fired, ns_per_tick_32());
        if s.preempt.available() {
            ns
        } else {
            // C2's fallback: no detector, scale by the sampled on-CPU share.
            crate::cputime::on_cpu_scaled(ns)
        }
    })
}

/// The reading after a reply's send (the caller has been woken).
#[inline]
pub(crate) fn after_send() {
    with_state(|s| {
        let now = ticks();
        let fired = s.preempt.fired();
        s.chain.after_send(now, fired);
        #[cfg(feature = "charge-breakdown")]
        {
            s.stamps[7] = now;
            if !fired && s.stamps.iter().all(|&t| t != 0) {
                // Parts in order: 0->1, 1->2, 2->3, 3->4, 4->5, 5->6, 6->7.
                let st = s.stamps;
                for (i, p) in s.parts.iter_mut().enumerate() {
                    *p += st[i + 1].saturating_sub(st[i]);
                }
                s.samples += 1;
            }
            s.stamps = [0; 8];
            s.stamps[0] = now;
        }
    })
}

/// Records `stage` of the current RPC (only with the `charge-breakdown`
/// feature, and only inside a stretch).
#[inline]
pub fn stamp(stage: Stage) {
    #[cfg(feature = "charge-breakdown")]
    if ACTIVE.with(Cell::get) {
        with_state(|s| s.stamps[stage as usize] = ticks());
    }
    let _ = stage;
}

/// Process-wide sums over every handler thread's finished stretches.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Summary {
    /// Replies charged through the chain and the nanoseconds they carried.
    pub replies: u64,
    pub charged_ns: u64,
    /// Nanoseconds of requests' own work and of sends measured (dropped
    /// intervals excluded).
    pub work_ns: f64,
    pub send_ns: f64,
    /// Intervals dropped because the thread was off its CPU (C2).
    pub dropped: u64,
    /// With the `charge-breakdown` feature: nanoseconds in each of
    /// [`PARTS`] summed over the RPCs whose every stage was stamped and not
    /// interrupted, and how many those were.
    pub parts_ns: [f64; 7],
    pub part_samples: u64,
}

impl Summary {
    /// What happened between `earlier` and `self`.
    pub fn since(&self, earlier: &Summary) -> Summary {
        let mut parts_ns = self.parts_ns;
        for (p, e) in parts_ns.iter_mut().zip(earlier.parts_ns) {
            *p -= e;
        }
        Summary {
            replies: self.replies - earlier.replies,
            charged_ns: self.charged_ns - earlier.charged_ns,
            work_ns: self.work_ns - earlier.work_ns,
            send_ns: self.send_ns - earlier.send_ns,
            dropped: self.dropped - earlier.dropped,
            parts_ns,
            part_samples: self.part_samples - earlier.part_samples,
        }
    }
}

/// What every handler thread's chain has charged so far (finished
/// stretches only).
pub fn summary() -> Summary {
    let mut v = [0u64; SLOTS];
    for p in REGISTRY.lock().iter() {
        for (o, a) in v.iter_mut().zip(&p.0) {
            *o += a.load(std::sync::atomic::Ordering::Relaxed);
        }
    }
    let ns = |ticks: u64| ((ticks as u128 * ns_per_tick_32() as u128) >> 32) as f64;
    let mut parts_ns = [0.0; 7];
    for (o, &x) in parts_ns.iter_mut().zip(&v[5..12]) {
        *o = ns(x);
    }
    Summary {
        charged_ns: v[0],
        work_ns: ns(v[1]),
        send_ns: ns(v[2]),
        replies: v[3],
        dropped: v[4],
        parts_ns,
        part_samples: v[12],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// 1 ns per 2 ticks plus a bit, so rounding happens on every reply.
    const F: u64 = (1 << 31) + 12_345;

    fn fixed(ticks: u64) -> u128 {
        ticks as u128 * F as u128
    }

    #[test]
    fn replies_carry_their_work_and_the_previous_send_exactly() {
        let mut c = Chain::default();
        c.begin(1_000);
        assert!(c.active());
        c.begin(5_000); // already open: no-op
        // Request 1: work 1_000..1_300, send 1_300..1_420.
        let a = c.before_send(1_300, false, F);
        assert_eq!(a as u128, fixed(300) >> 32);
        c.after_send(1_420, false);
        // Request 2: work 1_420..1_500, plus request 1's send (120).
        let b = c.before_send(1_500, false, F);
        c.after_send(1_560, false);
        // C1: charged + carried == every tick measured, converted.
        let total = fixed(300 + 120 + 80 + 60);
        let (carry, frac) = c.pending();
        assert_eq!(carry, 60);
        assert_eq!(((a + b) as u128) << 32, total - fixed(carry) - frac as u128);
        assert_eq!(c.totals.replies, 2);
        assert_eq!(c.totals.work_ticks, 380);
        assert_eq!(c.totals.send_ticks, 180);
        assert_eq!(c.totals.dropped, 0);
    }

    /// Skipped ticks leave the current request's work, not its send nor
    /// the next request's, and do nothing outside a stretch. Fails if
    /// `skip` is a no-op (the first reply would carry 300).
    #[test]
    fn skipped_ticks_are_left_out_of_the_current_interval_only() {
        let mut c = Chain::default();
        c.skip(50); // no stretch open: nothing
        c.begin(1_000);
        // Request 1: 1_000..1_300, of which 120 were the loop's sample.
        c.skip(120);
        assert_eq!(c.before_send(1_300, false, 1 << 32), 180);
        c.after_send(1_340, false);
        // Request 2: its own 60 and request 1's whole send (40).
        assert_eq!(c.before_send(1_400, false, 1 << 32), 100);
        assert_eq!(c.totals.work_ticks, 180 + 60);
        assert_eq!(c.totals.skipped_ticks, 120);
        c.end();
        c.skip(70);
        assert_eq!(c.totals.skipped_ticks, 120, "outside a stretch");
    }

    #[test]
    fn rounding_never_loses_or_adds_a_nanosecond() {
        // Many replies of odd tick counts: the sum of the charges equals the
        // converted sum of the ticks to the last carried fraction (C1).
        let mut c = Chain::default();
        let mut now = 7u64;
        c.begin(now);
        let mut charged = 0u64;
        let mut ticks = 0u64;
        for i in 0..10_000u64 {
            let work = 1 + i * 7 % 13;
            let send = 3 + i * 5 % 11;
            now += work;
            charged += c.before_send(now, false, F);
            now += send;
            c.after_send(now, false);
            ticks += work + send;
        }
        let (carry, frac) = c.pending();
        assert_eq!(
            ((charged as u128) << 32) + frac as u128,
            fixed(ticks - carry)
        );
        assert_eq!(c.totals.charged_ns, charged);
    }

    #[test]
    fn interrupted_intervals_are_dropped_and_counted() {
        let mut c = Chain::default();
        c.begin(0);
        // Work interrupted: only the (clean) send of the previous reply,
        // none here yet, is charged.
        assert_eq!(c.before_send(1_000_000, true, 1 << 32), 0);
        // Its send is clean: 40 ticks, carried.
        c.after_send(1_000_040, false);
        // Next: clean work 10, plus the carried 40.
        assert_eq!(c.before_send(1_000_050, false, 1 << 32), 50);
        // Interrupted send: nothing carried.
        c.after_send(9_000_000, true);
        assert_eq!(c.before_send(9_000_005, false, 1 << 32), 5);
        assert_eq!(c.totals.dropped, 2);
        assert_eq!(c.totals.charged_ns, 55);
    }

    #[test]
    fn each_interval_loses_one_reading_and_never_goes_negative() {
        let mut c = Chain::with_overhead(4);
        c.begin(100);
        // Work 10 - 4; no send carried yet.
        assert_eq!(c.before_send(110, false, 1 << 32), 6);
        // A send shorter than a reading counts 0.
        c.after_send(113, false);
        assert_eq!(c.before_send(123, false, 1 << 32), 6);
        c.after_send(133, false);
        assert_eq!(c.before_send(134, false, 1 << 32), 6);
        assert_eq!(c.totals.work_ticks, 12);
        assert_eq!(c.totals.send_ticks, 6);
    }

    #[test]
    fn time_between_stretches_is_not_charged_but_the_last_send_is() {
        let mut c = Chain::default();
        c.begin(100);
        assert_eq!(c.before_send(110, false, 1 << 32), 10);
        c.after_send(130, false); // send of 20, carried
        c.end();
        assert!(!c.active());
        c.restart(500); // outside a stretch: no effect
        // Idle from 130 to 10_000 (C3), then a request of 5 ticks.
        c.begin(10_000);
        assert_eq!(c.before_send(10_005, false, 1 << 32), 5 + 20);
        // A restart inside the stretch moves the interval's start.
        c.after_send(10_006, false);
        c.restart(20_000);
        assert_eq!(c.before_send(20_003, false, 1 << 32), 3 + 1);
    }

    #[test]
    fn the_preemption_detector_sees_a_sleep() {
        // A voluntary switch (sleeping) always clears the word; a thread
        // that never leaves its CPU mostly does not (some of 100 short
        // intervals must come out clean even on a loaded host).
        std::thread::spawn(|| {
            let p = Preempt::for_this_thread();
            if !p.available() {
                eprintln!("rseq not registered here: nothing to check");
                assert!(!p.fired());
                return;
            }
            p.arm();
            std::thread::sleep(std::time::Duration::from_millis(1));
            assert!(p.fired(), "a sleep went unnoticed");
            let clean = (0..100)
                .filter(|_| {
                    p.arm();
                    std::hint::black_box((0..100u64).sum::<u64>());
                    !p.fired()
                })
                .count();
            assert!(clean > 0, "every short interval fired");
        })
        .join()
        .unwrap();
    }
}
