//! How the `local` backend carries an RPC between a compute thread and a
//! handler thread, with as few cache lines crossing between their cores as
//! possible, and how a caller that gets no reply times out.
//!
//! Each endpoint has one [`Lane`] per node it calls: a single-producer ring
//! of request slots (the endpoint's thread writes, the node's handler
//! threads read) and a pool of reply slots (a handler writes, the
//! endpoint's thread reads). Requests and replies up to 64 bytes travel
//! inline in their slots, so no `Vec` allocated on one thread is freed on
//! the other (a cross-thread free moves the allocator's lines too); larger
//! ones travel as a moved `Vec`/boxed reply. Every slot is 128 bytes,
//! aligned, with its ready word, header and the first 40 bytes of payload
//! in its first line, so a small request is one line from caller to
//! handler and a small reply one line back.
//!
//! Lines one small RPC moves between the two cores (docs/performance.md,
//! "Ninth pass"): the request slot's first line (caller to handler), the
//! reply slot's first line (handler to caller), and the waking of the
//! caller's task (its executor's ready flags and parker, one line each,
//! shared by every task of the thread, so a batch of replies moves them
//! once when the caller is busy). Nothing else is written by both sides per
//! RPC: the ring's head is read by the caller only when its cached copy
//! says the ring is full, the handler's sleep word only on the caller's
//! side of the doorbell check, and the waker stays in its reply slot across
//! RPCs (no reference count changes hands).
//!
//! Invariants (the reply slot's own, S1-S4, are in `reply_state`):
//! 1. A request slot `i` holds request `t` (`t % RING == i`) once its `seq`
//!    reads `t + 1`; it is the consumer's from then until the consumer's
//!    head passes `t`, and the producer writes slot `i` again (request
//!    `t + RING`) only after seeing the head past `t` (its cached head is
//!    refreshed only when the ring looks full). Release on `seq` and on the
//!    head, acquire on their loads, order the slot's contents.
//! 2. Consumers of one lane (a node's handler threads, a crash drain) take
//!    requests one at a time under the lane's consumer lock, so several
//!    handler threads may serve one lane, and a slow handler holds only its
//!    own request (the lock is released before the handler runs).
//! 3. A reply slot is reused only when `reply_state` says so (S3); a wait
//!    dropped before its reply (a timeout, a caller giving up) leaves its
//!    slot aside until the answerer is done with it, so a late reply never
//!    reaches a later RPC.
//! 4. No lost wake-up of a sleeping handler (H1): a handler about to block
//!    counts itself in its node's [`Doorbell`] and then, after a sequentially
//!    consistent fence, looks at its lanes (and their list) once more; a
//!    producer publishes its request, fences, and rings only if it then
//!    sees a sleeper. One of the two sees the other's write; the ring takes
//!    the doorbell's lock, which the sleeper holds from counting itself until
//!    its condition-variable wait releases it.
//! 5. Ticks are at least `period` apart, and the first tick after an RPC
//!    was sent comes after it was sent, so an RPC that times out waited at
//!    least `TICKS * period = rpc_timeout` (a tick that finds the caller
//!    replacing its waker skips it, so a timeout can come one period late).
//! 6. A request dropped without a reply (its node crashed and its lanes were
//!    drained) answers the caller with `NodeDown`.
//! 7. A caller that finds its lane's ring or reply slots full waits for room
//!    at most `rpc_timeout` (counted in watchdog ticks as in invariant 5)
//!    and then fails with `Timeout`; a crash of the node ends the wait at
//!    once with `NodeDown` (`send_when_room` in `local` checks the node on
//!    every try), and its drained lanes free the slots.
//! 8. A lane added to an endpoint's [`RpcSlots`] stays in it (its `Arc`
//!    held, never replaced: `add_lane` refuses a second lane to a node)
//!    until the `RpcSlots` is dropped, so a [`ReplyWait`], which borrows
//!    the `RpcSlots`, holds a plain reference to its reply slot instead of
//!    looking its lane up on every poll.

use crate::addr::{NodeId, ServiceId};
use crate::error::{Result, TransportError};
use crate::reply_state::{Registered, ReplyState};
use crate::service::Reply;
use parking_lot::{Condvar, Mutex};
use std::cell::{Cell, RefCell, UnsafeCell};
use std::future::Future;
use std::mem::MaybeUninit;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering, fence};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Watchdog ticks per `rpc_timeout`: an RPC times out after `TICKS + 1`
/// ticks, i.e. after between 1 and `1 + 1 / TICKS` timeouts.
pub(crate) const TICKS: u64 = 4;
/// Request slots per lane.
pub(crate) const RING: u64 = 64;
/// Reply slots per lane: the most RPCs one endpoint has in flight to one
/// node (more wait for a slot).
pub(crate) const REPLIES: usize = 256;
/// Payload bytes a request slot carries inline.
pub(crate) const REQ_INLINE: usize = 64;
/// Payload bytes a reply slot carries inline.
pub(crate) const REPLY_INLINE: usize = 64;
/// The largest allocation kept for the next request
/// ([`RpcSlots::request_buffer`]).
const SPARE_MAX: usize = 4 * REQ_INLINE;
/// The smallest allocation kept (and what a new request or reply buffer
/// is given): room for any inline request or reply, so a kept buffer
/// takes a small reply with the fixed-size copy of [`ReplyWait::take`].
const SPARE_MIN: usize = if REQ_INLINE > REPLY_INLINE {
    REQ_INLINE
} else {
    REPLY_INLINE
};
/// `len` of a slot whose payload is not inline.
const NOT_INLINE: u16 = u16::MAX;

/// One request in flight from producer to consumer.
///
/// Layout (branch i75): everything the producer writes for every request
/// (the word, the header, `deliver_at` and the first
/// [`LINE0_INLINE`] payload bytes) is in the slot's first 64-byte line, so
/// a small request moves one line from the caller's core to the
/// handler's. The second line (the payload's tail, `big`) changes only for
/// a longer request, so the handler's fixed-size copy of the whole inline
/// array finds it in its own cache; and the handler only reads the slot
/// (`deliver_at` is copied, not taken), so the producer's next write to it
/// does not pull the line back from the handler's core first. Before,
/// `deliver_at` sat in the second line and the handler cleared it: two
/// lines crossed per request, one of them twice.
#[repr(C, align(128))]
struct ReqSlot {
    /// `t + 1` once request `t` is in the slot (invariant 1).
    seq: AtomicU64,
    body: UnsafeCell<ReqBody>,
}

#[repr(C)]
struct ReqBody {
    service: u32,
    from: u16,
    /// Inline payload length, or [`NOT_INLINE`].
    len: u16,
    /// The reply slot's index.
    reply: u32,
    _pad: u32,
    /// Written for every request (before the payload: first line).
    deliver_at: Option<Instant>,
    /// The payload's first `len` bytes; the rest may be uninitialised
    /// (P1, [`put_inline`]).
    inline: [MaybeUninit<u8>; REQ_INLINE],
    big: Option<Vec<u8>>,
}

/// Payload bytes of a request or reply slot that share the slot's first
/// cache line with its word and header (the layout notes on [`ReqSlot`]
/// and [`ReplySlot`]; checked by a test).
const LINE0_INLINE: usize = 24;

/// One RPC's reply, on its way back.
///
/// Layout (branch i75): the state word, the waker and the body's header
/// and first [`LINE0_INLINE`] payload bytes share the first 64-byte line:
/// the answerer writes the body, sets the word and reads the waker there,
/// one line taken from the caller's core (which wrote the word and the
/// waker when it registered) instead of two (the waker sat in the second
/// line, after the body). The caller writes the second line only when a
/// discarded large reply left a box in `big`.
#[repr(C, align(128))]
struct ReplySlot {
    state: ReplyState,
    /// The caller's task waker (S2 in `reply_state`).
    waker: UnsafeCell<Option<Waker>>,
    body: UnsafeCell<ReplyBody>,
}

#[repr(C)]
struct ReplyBody {
    server_cpu_ns: u64,
    /// Inline payload length, or [`NOT_INLINE`].
    len: u16,
    _pad: [u8; 6],
    /// The reply's first `len` bytes; the rest may be uninitialised (P1,
    /// [`put_inline`]).
    inline: [MaybeUninit<u8>; REPLY_INLINE],
    big: Option<Box<Reply>>,
}

// SAFETY: a slot's cells are accessed only by the party that owns them under
// invariant 1 (request slots) or S1/S2 (reply slots), ownership passing
// through release/acquire operations on the slot's atomic word; the contents
// (bytes, `Vec`, `Box<Reply>`, `Instant`, `Waker`) are `Send`.
#[allow(unsafe_code)]
unsafe impl Sync for ReqSlot {}
// SAFETY: as above.
#[allow(unsafe_code)]
unsafe impl Sync for ReplySlot {}

/// The consumer side of a lane, in lines of its own: the caller reads
/// `head_pub` only when its cached head says the ring is full.
#[repr(C, align(128))]
struct Consumer {
    /// The next request to take (invariant 2).
    head: Mutex<u64>,
    /// `head`, published for the producer.
    head_pub: AtomicU64,
}

/// Where a node's handler threads sleep when they stop polling.
///
/// Its two flags are read on every RPC (callers) and every poll (handlers)
/// and written only when a handler blocks or the node stops: they have a
/// line of their own, apart from the lock and condition variable.
#[derive(Default)]
pub(crate) struct Doorbell {
    flags: BellFlags,
    /// Rings so far (each under the lock, so a sleeper whose wait timed out
    /// can tell a ring on its way from none).
    lock: Mutex<u64>,
    cv: Condvar,
}

/// Yields a sleeper whose wait timed out with work gives a producer on its
/// way to ring before it counts the wake-up as lost.
const LATE_RING_GRACE_YIELDS: u32 = 4;
/// How long a blocked handler waits before it looks at its lanes itself: a
/// safety net and the detector of a lost wake-up (a request found waiting
/// when the wait times out is counted, `Counter::TimedOutWithWork`).
const BELL_TIMEOUT: Duration = Duration::from_millis(100);

#[derive(Default)]
#[repr(align(128))]
struct BellFlags {
    /// Handler threads counted in as about to block or blocked.
    sleepers: AtomicU32,
    /// Set when the node stops: handlers return.
    stopping: AtomicBool,
}

impl Doorbell {
    /// Producer, after publishing a request (invariant 4).
    #[inline]
    pub(crate) fn ring(&self) {
        fence(Ordering::SeqCst);
        if self.flags.sleepers.load(Ordering::Relaxed) > 0 {
            let mut rings = self.lock.lock();
            *rings += 1;
            self.cv.notify_all();
        }
    }

    /// Handler: blocks unless `ready()` (checked after counting itself in)
    /// says there is something to do (invariant 4). Every [`BELL_TIMEOUT`]
    /// it looks itself; a wait that timed out with `ready()` true and no
    /// ring on its way is a lost wake-up: counted, and served.
    pub(crate) fn sleep(&self, ready: impl Fn() -> bool) {
        let mut g = self.lock.lock();
        self.flags.sleepers.fetch_add(1, Ordering::SeqCst);
        fence(Ordering::SeqCst);
        while !self.stopping() && !ready() {
            let rings = *g;
            if !self.cv.wait_for(&mut g, BELL_TIMEOUT).timed_out() {
                break; // rung (or a spurious wake-up: the caller re-checks)
            }
            if self.stopping() || !ready() {
                continue; // nothing came: wait on
            }
            // A request waits. A producer may be about to ring (it
            // published, then found a sleeper, and waits for this lock):
            // let it in before calling the wake-up lost.
            parking_lot::MutexGuard::unlocked(&mut g, || {
                for _ in 0..LATE_RING_GRACE_YIELDS {
                    std::thread::yield_now();
                }
            });
            if *g == rings {
                crate::servestats::add(
                    crate::servestats::Role::Handler,
                    crate::servestats::Counter::TimedOutWithWork,
                    1,
                );
            }
            break;
        }
        self.flags.sleepers.fetch_sub(1, Ordering::SeqCst);
    }

    /// Tells every handler to return.
    pub(crate) fn stop(&self) {
        self.flags.stopping.store(true, Ordering::SeqCst);
        let mut rings = self.lock.lock();
        *rings += 1;
        self.cv.notify_all();
    }

    pub(crate) fn stopping(&self) -> bool {
        self.flags.stopping.load(Ordering::Acquire)
    }
}

/// The request ring and reply slots between one endpoint and one node.
#[repr(C, align(128))]
pub(crate) struct Lane {
    /// First, so that an `Arc<Lane>`'s reference counts (bumped by handler
    /// threads per request) have their line to themselves.
    consumer: Consumer,
    ring: Box<[ReqSlot]>,
    replies: Box<[ReplySlot]>,
    /// The endpoint is gone: once empty, handlers forget the lane.
    closed: AtomicBool,
}

/// A request as a consumer takes it from a lane.
pub(crate) struct Incoming<'a> {
    pub(crate) from: NodeId,
    pub(crate) service: ServiceId,
    /// The payload when it was not inline (else it is in the consumer's
    /// buffer).
    pub(crate) big: Option<Vec<u8>>,
    pub(crate) deliver_at: Option<Instant>,
    pub(crate) reply: ReplyTo<'a>,
}

impl Lane {
    pub(crate) fn new() -> Arc<Lane> {
        Arc::new(Lane {
            consumer: Consumer {
                head: Mutex::new(0),
                head_pub: AtomicU64::new(0),
            },
            ring: (0..RING)
                .map(|_| ReqSlot {
                    seq: AtomicU64::new(0),
                    body: UnsafeCell::new(ReqBody {
                        service: 0,
                        from: 0,
                        len: 0,
                        reply: 0,
                        _pad: 0,
                        inline: [MaybeUninit::new(0); REQ_INLINE],
                        big: None,
                        deliver_at: None,
                    }),
                })
                .collect(),
            replies: (0..REPLIES)
                .map(|_| ReplySlot {
                    state: ReplyState::new(),
                    body: UnsafeCell::new(ReplyBody {
                        server_cpu_ns: 0,
                        len: 0,
                        _pad: [0; 6],
                        inline: [MaybeUninit::new(0); REPLY_INLINE],
                        big: None,
                    }),
                    waker: UnsafeCell::new(None),
                })
                .collect(),
            closed: AtomicBool::new(false),
        })
    }

    /// Whether a request waits at the head (a hint for polling and for the
    /// sleep check; taking it is what counts).
    #[inline]
    pub(crate) fn has_request(&self) -> bool {
        let head = self.consumer.head_pub.load(Ordering::Acquire);
        self.ring[(head % RING) as usize]
            .seq
            .load(Ordering::Acquire)
            == head + 1
    }

    /// Whether the endpoint is gone and nothing is left to serve.
    pub(crate) fn finished(&self) -> bool {
        self.closed.load(Ordering::Acquire) && !self.has_request()
    }

    /// Takes the request at the head, if any and if no other consumer holds
    /// the lane (then `None` too: it is being served). An inline payload is
    /// copied into `buf` (cleared first).
    ///
    /// An empty lane is seen without the lock (the head and the slot's
    /// word, as [`Lane::has_request`]): a handler ends every pass over its
    /// lanes with such a look, and the lock's two atomic updates were most
    /// of its cost. A request found there is taken under the lock as before
    /// (invariant 2), which looks again.
    #[inline]
    pub(crate) fn take<'a>(self: &'a Arc<Self>, buf: &mut Vec<u8>) -> Option<Incoming<'a>> {
        if !self.has_request() {
            return None;
        }
        let mut head = self.consumer.head.try_lock()?;
        self.take_locked(&mut head, buf)
    }

    #[inline]
    #[allow(unsafe_code)]
    fn take_locked<'a>(
        self: &'a Arc<Self>,
        head: &mut u64,
        buf: &mut Vec<u8>,
    ) -> Option<Incoming<'a>> {
        let slot = &self.ring[(*head % RING) as usize];
        if slot.seq.load(Ordering::Acquire) != *head + 1 {
            return None;
        }
        // SAFETY: invariant 1: the slot holds request `head` and is ours
        // until the head moves past it (below, after the last access).
        let body = unsafe { &mut *slot.body.get() };
        buf.clear();
        let big = if body.len == NOT_INLINE {
            body.big.take()
        } else {
            copy_inline(&body.inline, body.len as usize, buf);
            None
        };
        let incoming = Incoming {
            from: NodeId(body.from),
            service: ServiceId(body.service),
            big,
            // Copied, not taken: the handler only reads the slot (its
            // line stays the producer's to write; see `ReqSlot`).
            deliver_at: body.deliver_at,
            // Borrowed: no reference count per request (a deferred
            // handler's answer takes one, `ReplyTo::into_owned`).
            reply: ReplyTo {
                lane: LaneRef::Borrowed(self),
                index: body.reply,
                sent: false,
            },
        };
        *head += 1;
        self.consumer.head_pub.store(*head, Ordering::Release);
        Some(incoming)
    }

    /// Answers every queued request with `NodeDown` (the node went down);
    /// waits for a consumer that holds the lane.
    pub(crate) fn drain(self: &Arc<Self>) {
        let mut head = self.consumer.head.lock();
        let mut buf = Vec::new();
        while let Some(req) = self.take_locked(&mut head, &mut buf) {
            drop(req); // its `ReplyTo` answers `NodeDown`
        }
    }

    /// Watchdog: wakes every caller waiting on this lane (S4).
    #[allow(unsafe_code)]
    fn wake_waiting(&self) {
        for slot in self.replies.iter() {
            if slot.state.watch() {
                // SAFETY: S4: `watch` moved WAKER to WATCH, so the caller
                // does not write the field until `unwatch`.
                if let Some(w) = unsafe { &*slot.waker.get() } {
                    w.wake_by_ref();
                }
                slot.state.unwatch();
            }
        }
    }
}

/// Puts the first `len` bytes of a slot's inline payload into the empty
/// `buf`: the whole array is copied (a fixed-size copy, no `memcpy` call:
/// branch i71) into `buf`'s spare room, of which the first `len` bytes
/// become its contents (the rest stays spare capacity).
#[inline(always)]
#[allow(unsafe_code)]
fn copy_inline(inline: &[MaybeUninit<u8>; REQ_INLINE], len: usize, buf: &mut Vec<u8>) {
    assert!(len <= REQ_INLINE && buf.is_empty());
    buf.reserve(REQ_INLINE);
    // SAFETY: `buf` is empty with room for `REQ_INLINE` bytes (reserved
    // above), so its spare room does not overlap `inline` and takes all of
    // it (the copy is untyped: bytes past the payload may be uninitialised,
    // P1, and land in spare room); its first `len` (at most `REQ_INLINE`)
    // bytes are then initialised, copied from the payload's (P1).
    unsafe {
        std::ptr::copy_nonoverlapping(inline.as_ptr().cast::<u8>(), buf.as_mut_ptr(), REQ_INLINE);
        buf.set_len(len);
    }
}

/// Puts `src` (at most `N` bytes) into a slot's inline array with a
/// fixed-size copy where its allocation allows (branch i86: no `memcpy`
/// call per request or reply), read from `src`'s allocation past its
/// length: [`LINE0_INLINE`] bytes for a payload that fits the slot's first
/// line, so the second line is not written (the layout notes on
/// [`ReqSlot`] and [`ReplySlot`]); the whole array for a longer one (the
/// second line is written anyway); an exact copy only for a buffer with
/// less room than that.
///
/// P1: afterwards the array's first `src.len()` bytes are `src`'s; the
/// bytes after them are whatever `src`'s spare room held, possibly
/// uninitialised, and are only ever copied untyped into another buffer's
/// spare room ([`copy_inline`], [`ReplyWait::take_reply`]), never read as
/// bytes.
#[inline(always)]
#[allow(unsafe_code)]
fn put_inline<const N: usize>(dst: &mut [MaybeUninit<u8>; N], src: &Vec<u8>) {
    let len = src.len();
    assert!(len <= N && LINE0_INLINE <= N);
    let (from, to) = (src.as_ptr(), dst.as_mut_ptr().cast::<u8>());
    // SAFETY: every copy reads from `src`'s pointer no more bytes than its
    // capacity (`len <= capacity` in the last case), all within its
    // allocation, as `MaybeUninit` bytes (its spare room may be
    // uninitialised); `dst` takes `N` bytes and is a different object (a
    // slot), so the two do not overlap. The fixed sizes are typed array
    // copies, so that they stay fixed (a copy of a size chosen at run
    // time is a `memcpy` call).
    unsafe {
        // One branch, not two (`&`, not `&&`).
        if (len <= LINE0_INLINE) & (src.capacity() >= LINE0_INLINE) {
            type Line0 = [MaybeUninit<u8>; LINE0_INLINE];
            to.cast::<Line0>()
                .write_unaligned(from.cast::<Line0>().read_unaligned());
        } else if src.capacity() >= N {
            to.cast::<[MaybeUninit<u8>; N]>()
                .write_unaligned(from.cast::<[MaybeUninit<u8>; N]>().read_unaligned());
        } else {
            std::ptr::copy_nonoverlapping(from, to, len);
        }
    }
}

/// The handler's side of one RPC: send the reply through it. Dropping it
/// unsent answers the caller with `NodeDown` (invariant 6).
pub(crate) struct ReplyTo<'a> {
    lane: LaneRef<'a>,
    index: u32,
    sent: bool,
}

/// The lane a reply goes to: borrowed from the handler thread's lane list
/// while the request is served, owned once a deferred answer outlives it.
enum LaneRef<'a> {
    Borrowed(&'a Arc<Lane>),
    Owned(Arc<Lane>),
}

impl LaneRef<'_> {
    fn get(&self) -> &Lane {
        match self {
            LaneRef::Borrowed(l) => l,
            LaneRef::Owned(l) => l,
        }
    }
}

impl crate::service::ReplySink for ReplyTo<'_> {
    #[inline(always)]
    fn send(self, server_cpu_ns: u64, result: crate::service::LentReply<'_>) {
        // Lent from the handler thread's reply buffer (R2, R4).
        self.send_from(server_cpu_ns, result, true)
    }
    fn into_deferred(self) -> Box<dyn FnOnce(u64, crate::service::LentReply<'_>) + Send> {
        let owned = self.into_owned();
        // Lent from the deferred answer's own `Vec`, dropped after the send.
        Box::new(move |cpu, result| owned.send_from(cpu, result, false))
    }
}

impl ReplyTo<'_> {
    /// The same right to answer, holding its own reference to the lane
    /// (for an answer sent after the request's serving ends).
    pub(crate) fn into_owned(mut self) -> ReplyTo<'static> {
        let lane = match &self.lane {
            LaneRef::Borrowed(l) => Arc::clone(l),
            LaneRef::Owned(l) => Arc::clone(l),
        };
        // This one no longer answers (its drop must not say `NodeDown`).
        self.sent = true;
        ReplyTo {
            lane: LaneRef::Owned(lane),
            index: self.index,
            sent: false,
        }
    }

    #[cfg(test)]
    pub(crate) fn send(self, reply: Reply) {
        match reply.result {
            Ok(mut v) => self.send_from(reply.server_cpu_ns, Ok(&mut v), false),
            Err(e) => self.send_from(reply.server_cpu_ns, Err(e), false),
        }
    }

    /// Sends the reply built in the handler thread's buffer `result`
    /// (R2, docs/transport.md "Reply buffers"): a payload that fits the
    /// slot is copied in and the buffer stays the thread's, keeping its
    /// allocation for the next request; a larger one takes the buffer's
    /// allocation with it (no copy; the thread's buffer gets a new one,
    /// R4).
    ///
    /// `thread_buffer`: `result` is the handler thread's reply buffer, so a
    /// reply that takes its allocation leaves it a new one with room for
    /// any inline reply (R4, branch i91; [`ReplyTo::put_big`]).
    ///
    /// Inlined into the serving loop, and consuming the `ReplyTo` without
    /// its drop glue (branch i83: the glue's out-of-line call after every
    /// send only found `sent` set); an owned lane's reference is released
    /// here instead.
    #[inline(always)]
    #[allow(unsafe_code)]
    pub(crate) fn send_from(
        self,
        server_cpu_ns: u64,
        result: Result<&mut Vec<u8>, crate::error::ServiceError>,
        thread_buffer: bool,
    ) {
        let this = std::mem::ManuallyDrop::new(self);
        // SAFETY: `this` is never used or dropped again; `lane` is read out
        // once and dropped at the end of this call (a borrowed lane drops
        // nothing, an owned one its reference), which is what `ReplyTo`'s
        // drop glue would do after a send (its `Drop` does nothing once the
        // reply is sent).
        let lane = unsafe { std::ptr::read(&this.lane) };
        let slot = &lane.get().replies[this.index as usize];
        {
            // SAFETY: S1: the RPC is sent and unanswered, so the body is
            // the answerer's, and only this `ReplyTo` answers it.
            let body = unsafe { &mut *slot.body.get() };
            body.server_cpu_ns = server_cpu_ns;
            match result {
                Ok(v) if v.len() <= REPLY_INLINE => {
                    put_inline(&mut body.inline, v);
                    body.len = v.len() as u16;
                }
                result => Self::put_big(body, server_cpu_ns, result, thread_buffer),
            }
        }
        crate::charge::stamp(crate::charge::Stage::Written);
        Self::finish(slot, true);
        drop(lane);
    }

    /// A reply that does not fit the slot (or an error), boxed into it.
    /// The reply takes `result`'s allocation; the handler thread's buffer
    /// (`thread_buffer`) gets a new one with [`REPLY_INLINE`] bytes of room
    /// (R4, branch i91): left empty, the next reply regrew it in steps to
    /// less than the fixed-size copies of [`put_inline`] need, and every
    /// small reply after a large one was copied with a `memcpy` call.
    #[cold]
    #[inline(never)]
    fn put_big(
        body: &mut ReplyBody,
        server_cpu_ns: u64,
        result: Result<&mut Vec<u8>, crate::error::ServiceError>,
        thread_buffer: bool,
    ) {
        body.len = NOT_INLINE;
        body.big = Some(Box::new(Reply {
            result: result.map(|v| {
                if thread_buffer {
                    std::mem::replace(v, Vec::with_capacity(REPLY_INLINE))
                } else {
                    std::mem::take(v)
                }
            }),
            server_cpu_ns,
        }));
    }

    #[allow(unsafe_code)]
    fn finish(slot: &ReplySlot, reply: bool) {
        let wake = slot.state.answer(reply);
        crate::charge::stamp(crate::charge::Stage::Answered);
        if wake {
            // SAFETY: S2: WAKER was set when the answer went in, so the
            // field is read-only until `release`.
            if let Some(w) = unsafe { &*slot.waker.get() } {
                w.wake_by_ref();
            }
            slot.state.release();
        }
    }
}

impl Drop for ReplyTo<'_> {
    // A hint (branch i71); measured: the drop glue after a reply's send
    // stays a call.
    #[inline]
    fn drop(&mut self) {
        if !self.sent {
            Self::finish(&self.lane.get().replies[self.index as usize], false);
        }
    }
}

/// An endpoint's side of one lane (its thread only).
struct Producer {
    lane: Arc<Lane>,
    /// The next request's number.
    tail: u64,
    /// The consumer's head as last read (invariant 1).
    head_cache: u64,
    /// Reply slots free for the next RPC.
    free: Vec<u32>,
    /// Reply slots whose answerer (or watchdog) may still touch them.
    aside: Vec<u32>,
    /// Reply slots never used yet start here.
    fresh: u32,
}

impl Producer {
    /// A reply slot for a new RPC (invariant 3).
    fn reply_slot(&mut self) -> Option<u32> {
        if let Some(i) = self.free.pop() {
            return Some(i);
        }
        if let Some(k) = self
            .aside
            .iter()
            .position(|&i| self.lane.replies[i as usize].state.reusable())
        {
            return Some(self.aside.swap_remove(k));
        }
        if (self.fresh as usize) < REPLIES {
            self.fresh += 1;
            return Some(self.fresh - 1);
        }
        None
    }
}

/// Ticks once per period; shared between an endpoint and the cluster's
/// watchdog thread.
pub(crate) struct Watchdog {
    ticks: AtomicU64,
    /// The endpoint's lanes.
    lanes: Mutex<Vec<Arc<Lane>>>,
}

impl Watchdog {
    fn tick(&self) {
        self.ticks.fetch_add(1, Ordering::AcqRel);
        for l in self.lanes.lock().iter() {
            l.wake_waiting();
        }
    }
}

/// What a request carries besides its payload.
pub(crate) struct RequestHeader {
    pub(crate) from: NodeId,
    pub(crate) service: ServiceId,
    pub(crate) deliver_at: Option<Instant>,
}

/// An endpoint's lanes, by node id (used on the endpoint's thread only).
pub(crate) struct RpcSlots {
    lanes: RefCell<Vec<Option<Producer>>>,
    /// The allocation of the last request copied inline (or of a recycled
    /// reply), emptied, for the next request to be built in
    /// ([`RpcSlots::request_buffer`]) or the next small reply to be taken
    /// into ([`ReplyWait::take`]); it is freed on this thread, which
    /// allocated it. K1: it is unallocated or empty with a capacity
    /// between [`SPARE_MIN`] and [`SPARE_MAX`] ([`keepable`]).
    spare: Cell<Vec<u8>>,
    watchdog: Arc<Watchdog>,
}

impl RpcSlots {
    /// Slots for a new endpoint, ticked by `reaper`.
    pub(crate) fn new(reaper: &Reaper) -> RpcSlots {
        let watchdog = Arc::new(Watchdog {
            ticks: AtomicU64::new(0),
            lanes: Mutex::new(Vec::new()),
        });
        reaper.watch(&watchdog);
        RpcSlots {
            lanes: RefCell::new(Vec::new()),
            spare: Cell::new(Vec::new()),
            watchdog,
        }
    }

    /// An empty buffer for the next request: the kept allocation (the last
    /// inline request's, or a recycled reply's) if there is one, else a new
    /// one with room for any inline request ([`SPARE_MIN`]), so that it
    /// can be kept after the send.
    #[inline]
    pub(crate) fn request_buffer(&self) -> Vec<u8> {
        spare_or_new(self.spare.take())
    }

    /// Keeps `buf`'s allocation for the next request or reply if none is
    /// kept and its size is one the spare takes (K1 on `spare`); else
    /// drops it.
    #[inline]
    pub(crate) fn recycle(&self, mut buf: Vec<u8>) {
        if keepable(&buf) {
            let kept = self.spare.take();
            if kept.capacity() == 0 {
                buf.clear();
                self.spare.set(buf);
            } else {
                self.spare.set(kept);
            }
        }
    }

    /// The lane to `node`, if this endpoint has one.
    pub(crate) fn lane(&self, node: NodeId) -> Option<Arc<Lane>> {
        self.lanes
            .borrow()
            .get(node.0 as usize)
            .and_then(|p| p.as_ref())
            .map(|p| p.lane.clone())
    }

    /// Whether this endpoint has a lane to `node`.
    #[inline]
    pub(crate) fn has_lane(&self, node: NodeId) -> bool {
        matches!(self.lanes.borrow().get(node.0 as usize), Some(Some(_)))
    }

    /// Adds the lane to `node` (the caller registered it with the node).
    /// A lane, once added, stays until the slots are dropped (invariant 8:
    /// a [`ReplyWait`] holds a reference into it).
    pub(crate) fn add_lane(&self, node: NodeId, lane: Arc<Lane>) {
        let mut lanes = self.lanes.borrow_mut();
        let i = node.0 as usize;
        if lanes.len() <= i {
            lanes.resize_with(i + 1, || None);
        }
        assert!(lanes[i].is_none(), "a lane to {node} exists already");
        self.watchdog.lanes.lock().push(lane.clone());
        lanes[i] = Some(Producer {
            lane,
            tail: 0,
            head_cache: 0,
            free: Vec::new(),
            aside: Vec::new(),
            fresh: 0,
        });
    }

    /// The watchdog's tick count now: a caller that finds no room for its
    /// request notes it and asks [`RpcSlots::room_wait_timed_out`] while it
    /// waits (invariant 7).
    pub(crate) fn tick_now(&self) -> u64 {
        self.watchdog.ticks.load(Ordering::Acquire)
    }

    /// Whether a caller waiting for room since tick `since` has waited at
    /// least `rpc_timeout` (invariant 5's count of ticks): it then gives up
    /// with `Timeout` instead of waiting for ever behind requests a handler
    /// never answers.
    pub(crate) fn room_wait_timed_out(&self, since: u64) -> bool {
        self.tick_now().wrapping_sub(since) > TICKS
    }

    /// Queues a request to `node` (whose lane must exist) and returns its
    /// wait; gives the payload back if the ring or the reply slots are
    /// full (the caller retries later). The caller then rings the node's
    /// doorbell.
    // Always inlined (branch i71): into the fault-free call path, so that
    // the wait is built in place in the caller's future.
    #[inline(always)]
    #[allow(unsafe_code)]
    pub(crate) fn send(
        &self,
        node: NodeId,
        header: RequestHeader,
        payload: Vec<u8>,
    ) -> std::result::Result<ReplyWait<'_>, Vec<u8>> {
        let mut lanes = self.lanes.borrow_mut();
        let p = lanes[node.0 as usize]
            .as_mut()
            .expect("a lane to the node exists before sending");
        if p.tail - p.head_cache >= RING {
            p.head_cache = p.lane.consumer.head_pub.load(Ordering::Acquire);
            if p.tail - p.head_cache >= RING {
                return Err(payload);
            }
        }
        let Some(index) = p.reply_slot() else {
            return Err(payload);
        };
        let lane = &p.lane;
        let rslot = &lane.replies[index as usize];
        // SAFETY: S1/S3: the slot is reusable, so its body is the caller's.
        // Written only if a box is there (a discarded large reply): the
        // line holding `big` stays clean otherwise (see `ReplySlot`).
        unsafe {
            let body = &mut *rslot.body.get();
            if body.big.is_some() {
                body.big = None;
            }
        }
        let _seq = rslot.state.begin();
        // SAFETY: invariant 8: the slot lives in a lane that this
        // `RpcSlots` keeps (its `Arc` in `lanes`, never replaced or removed
        // while `self` lives), and the wait borrows `self`.
        let slot_ref: &ReplySlot = unsafe { &*(rslot as *const ReplySlot) };
        let t = p.tail;
        let slot = &lane.ring[(t % RING) as usize];
        {
            // SAFETY: invariant 1: the head is past `t - RING`, so the slot
            // is the producer's.
            let body = unsafe { &mut *slot.body.get() };
            body.service = header.service.0;
            body.from = header.from.0;
            body.reply = index;
            body.deliver_at = header.deliver_at;
            if payload.len() <= REQ_INLINE {
                put_inline(&mut body.inline, &payload);
                body.len = payload.len() as u16;
                // `payload` stays on the thread that allocated it: kept
                // (emptied) for the next request to be built in, unless it
                // is empty or large (then freed here).
                let mut payload = payload;
                if keepable(&payload) {
                    payload.clear();
                    self.spare.set(payload);
                }
            } else {
                body.len = NOT_INLINE;
                body.big = Some(payload);
            }
        }
        slot.seq.store(t + 1, Ordering::Release);
        p.tail = t + 1;
        Ok(ReplyWait {
            pool: self,
            slot: slot_ref,
            node,
            index,
            #[cfg(any(debug_assertions, test))]
            seq: _seq,
            sent_at_tick: self.watchdog.ticks.load(Ordering::Acquire),
            answered: false,
        })
    }
}

/// `spare` (an endpoint's spare, taken: empty by K1) if it has room for
/// any inline request or reply, else a new buffer with that room
/// ([`SPARE_MIN`]; one allocation, not `reserve`'s growth path).
#[inline(always)]
fn spare_or_new(spare: Vec<u8>) -> Vec<u8> {
    debug_assert!(spare.is_empty());
    if spare.capacity() >= SPARE_MIN {
        spare
    } else {
        Vec::with_capacity(SPARE_MIN)
    }
}

/// Whether `buf`'s allocation may be kept as an endpoint's spare (K1):
/// room for any inline request or reply, and not a large one held on to.
#[inline]
fn keepable(buf: &Vec<u8>) -> bool {
    (SPARE_MIN..=SPARE_MAX).contains(&buf.capacity())
}

impl Drop for RpcSlots {
    fn drop(&mut self) {
        for p in self.lanes.borrow().iter().flatten() {
            p.lane.closed.store(true, Ordering::Release);
        }
    }
}

/// The caller's side of one RPC: resolves to the reply, `NodeDown` if the
/// request was dropped, or `Timeout`. Dropping it early (the caller gave up)
/// discards a later reply (invariant 3).
pub(crate) struct ReplyWait<'a> {
    pool: &'a RpcSlots,
    /// The reply slot, in its lane (invariant 8): no lane lookup per poll.
    slot: &'a ReplySlot,
    node: NodeId,
    index: u32,
    /// The RPC's number on its slot (checked in debug builds only).
    #[cfg(any(debug_assertions, test))]
    seq: u64,
    sent_at_tick: u64,
    /// The reply (or drop notice) was taken and the slot given back
    /// ([`ReplyWait::give_back`]): dropping the wait then does nothing.
    answered: bool,
}

impl ReplyWait<'_> {
    /// Takes the answer out of the slot (S1: it is the caller's now) and
    /// gives the slot back, so that the wait's drop has nothing left to do
    /// (branch i83: `RpcCall` then skips the drop's out-of-line glue, see
    /// [`ReplyWait::is_spent`]).
    #[inline]
    fn take(&mut self, replied: bool) -> Result<Reply> {
        let answer = if replied {
            self.take_reply()
        } else {
            Err(TransportError::NodeDown(self.node))
        };
        self.give_back();
        answer
    }

    /// Whether the answer was taken and the slot given back: the wait owns
    /// nothing any more, and dropping it does nothing.
    #[inline]
    pub(crate) fn is_spent(&self) -> bool {
        self.answered
    }

    /// Gives the answered slot back to the lane (invariant 3): reused at
    /// once only if nobody touches it any more, else set aside.
    #[inline]
    fn give_back(&mut self) {
        self.answered = true;
        self.return_slot(self.slot.state.reusable());
    }

    /// Puts the slot on its lane's free list (`reuse`) or sets it aside
    /// until the answerer is done with it (invariant 3).
    #[inline]
    fn return_slot(&self, reuse: bool) {
        let mut lanes = self.pool.lanes.borrow_mut();
        let p = lanes[self.node.0 as usize]
            .as_mut()
            .expect("the lane outlives its RPCs");
        if reuse {
            p.free.push(self.index);
        } else {
            p.aside.push(self.index);
        }
    }

    /// The reply in the answered slot's body (S1: the caller's now).
    #[inline]
    #[allow(unsafe_code)]
    fn take_reply(&mut self) -> Result<Reply> {
        // SAFETY: S1: the slot is answered, so its body is the caller's.
        let body = unsafe { &mut *self.slot.body.get() };
        if body.len == NOT_INLINE {
            return Ok(*body
                .big
                .take()
                .expect("a reply that is not inline is boxed"));
        }
        let len = body.len as usize;
        assert!(len <= REPLY_INLINE);
        // The endpoint's spare allocation (K1: unallocated, or room for
        // `REPLY_INLINE` bytes; a new one gets that room), so that a reply
        // given back by `Endpoint::recycle` is taken into again, and the
        // whole inline array copied with one fixed-size copy (no `memcpy`
        // call), of which the first `len` bytes become the reply.
        let mut v = spare_or_new(self.pool.spare.take());
        // SAFETY: `v` is empty (K1) with room for `REPLY_INLINE` bytes
        // (`spare_or_new`), so its spare room does not overlap the slot and
        // takes the whole array (an untyped copy: bytes past the reply may
        // be uninitialised, P1, and land in spare room); its first `len`
        // (at most `REPLY_INLINE`, asserted) bytes are then the reply's (P1).
        unsafe {
            std::ptr::copy_nonoverlapping(
                body.inline.as_ptr().cast::<u8>(),
                v.as_mut_ptr(),
                REPLY_INLINE,
            );
            v.set_len(len);
        }
        Ok(Reply {
            result: Ok(v),
            server_cpu_ns: body.server_cpu_ns,
        })
    }

    /// No answer yet: times out, or registers the task's waker (S2). Out of
    /// line, so that the poll that finds the answer (inlined into the
    /// caller's future) is a load, a branch and the take.
    #[inline(never)]
    #[allow(unsafe_code)]
    fn wait(&mut self, cx: &mut Context<'_>) -> Poll<Result<Reply>> {
        let slot = self.slot;
        let ticks = self.pool.watchdog.ticks.load(Ordering::Acquire);
        if ticks.wrapping_sub(self.sent_at_tick) > TICKS {
            // Invariant 5: at least `rpc_timeout` since the send.
            return Poll::Ready(Err(TransportError::Timeout { node: self.node }));
        }
        let waker = cx.waker();
        // SAFETY (both closures): S2: `register` calls `fits` while the
        // field is read-only or the caller's, `store` only while it is the
        // caller's.
        let fits = || {
            unsafe { &*slot.waker.get() }
                .as_ref()
                .is_some_and(|w| w.will_wake(waker))
        };
        let store = || unsafe { *slot.waker.get() = Some(waker.clone()) };
        match slot.state.register(fits, store) {
            Registered::Waiting => Poll::Pending,
            Registered::Answered => {
                let replied = slot.state.answered().expect("answered");
                Poll::Ready(self.take(replied))
            }
            Registered::Busy => {
                // The watchdog is waking this task right now; look again.
                waker.wake_by_ref();
                Poll::Pending
            }
        }
    }
}

impl Future for ReplyWait<'_> {
    type Output = Result<Reply>;
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Reply>> {
        let this = self.get_mut();
        #[cfg(any(debug_assertions, test))]
        debug_assert_eq!(
            this.slot.state.seq(),
            this.seq,
            "a slot serves one RPC at a time"
        );
        if let Some(replied) = this.slot.state.answered() {
            return Poll::Ready(this.take(replied));
        }
        this.wait(cx)
    }
}

impl Drop for ReplyWait<'_> {
    #[inline]
    fn drop(&mut self) {
        if !self.answered {
            self.abandon();
        }
    }
}

impl ReplyWait<'_> {
    /// Dropped before its answer was taken (a timeout, a caller giving
    /// up): the slot is set aside until the answerer is done with it
    /// (invariant 3), so a late reply never reaches a later RPC.
    #[cold]
    #[inline(never)]
    fn abandon(&mut self) {
        self.return_slot(false);
    }
}

/// The cluster's watchdog thread: ticks every endpoint's [`Watchdog`] once
/// per period.
pub(crate) struct Reaper {
    watchdogs: Mutex<Vec<Weak<Watchdog>>>,
    stop: Mutex<bool>,
    stopped: Condvar,
}

impl Reaper {
    /// Starts the thread; ticks come every `rpc_timeout / TICKS`.
    pub(crate) fn start(rpc_timeout: Duration) -> (Arc<Reaper>, JoinHandle<()>) {
        let reaper = Arc::new(Reaper {
            watchdogs: Mutex::new(Vec::new()),
            stop: Mutex::new(false),
            stopped: Condvar::new(),
        });
        let period = (rpc_timeout / TICKS as u32).max(Duration::from_micros(1));
        let r = reaper.clone();
        let handle = std::thread::Builder::new()
            .name("dmkv-rpc-watchdog".into())
            .spawn(move || r.run(period))
            .expect("spawn the RPC watchdog thread");
        (reaper, handle)
    }

    fn watch(&self, w: &Arc<Watchdog>) {
        let mut v = self.watchdogs.lock();
        v.retain(|w| w.strong_count() > 0);
        v.push(Arc::downgrade(w));
    }

    /// Ends the thread (it then ticks no more).
    pub(crate) fn shut_down(&self) {
        *self.stop.lock() = true;
        self.stopped.notify_all();
    }

    fn run(&self, period: Duration) {
        loop {
            // Invariant 3: a full period between ticks, however the wait
            // ends early.
            #[allow(clippy::disallowed_methods)]
            let until = Instant::now() + period;
            {
                let mut stop = self.stop.lock();
                loop {
                    if *stop {
                        return;
                    }
                    #[allow(clippy::disallowed_methods)]
                    if Instant::now() >= until {
                        break;
                    }
                    self.stopped.wait_until(&mut stop, until);
                }
            }
            let live: Vec<Arc<Watchdog>> = {
                let mut v = self.watchdogs.lock();
                v.retain(|w| w.strong_count() > 0);
                v.iter().filter_map(Weak::upgrade).collect()
            };
            for w in live {
                w.tick();
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::exec::{LocalTask, block_on, run_tasks};

    /// The handler side of the lost-wake-up detector: a sleeper whose wait
    /// times out ([`BELL_TIMEOUT`]) with work and no ring counts it and
    /// returns; a ring wakes it uncounted. The "producer" here publishes
    /// without ringing. Fails without the timed wait (the first sleep
    /// would block for ever).
    #[test]
    fn a_sleep_timed_out_with_a_request_waiting_is_counted() {
        use crate::servestats::{Counter, own};
        std::thread::spawn(|| {
            let bell = Arc::new(Doorbell::default());
            let work = Arc::new(AtomicBool::new(false));
            let w = work.clone();
            let quiet = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                w.store(true, Ordering::SeqCst); // and no ring
            });
            bell.sleep(|| work.load(Ordering::SeqCst));
            quiet.join().unwrap();
            assert_eq!(own(Counter::TimedOutWithWork), 1);
            // A producer that rings: not counted.
            work.store(false, Ordering::SeqCst);
            let (b, w) = (bell.clone(), work.clone());
            let ringer = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(5));
                w.store(true, Ordering::SeqCst);
                b.ring();
            });
            bell.sleep(|| work.load(Ordering::SeqCst));
            ringer.join().unwrap();
            assert!(work.load(Ordering::SeqCst));
            assert_eq!(own(Counter::TimedOutWithWork), 1);
        })
        .join()
        .unwrap();
    }

    const NODE: NodeId = NodeId(1);

    fn reply(bytes: &[u8]) -> Reply {
        Reply {
            result: Ok(bytes.to_vec()),
            server_cpu_ns: bytes.len() as u64 + 1,
        }
    }

    /// An endpoint's slots with one lane to `NODE`, and that lane.
    fn setup(timeout: Duration) -> (Arc<Reaper>, JoinHandle<()>, RpcSlots, Arc<Lane>) {
        let (reaper, h) = Reaper::start(timeout);
        let slots = RpcSlots::new(&reaper);
        let lane = Lane::new();
        slots.add_lane(NODE, lane.clone());
        (reaper, h, slots, lane)
    }

    fn header(service: u32) -> RequestHeader {
        RequestHeader {
            from: NodeId(0),
            service: ServiceId(service),
            deliver_at: None,
        }
    }

    fn payload(i: u64, len: usize) -> Vec<u8> {
        (0..len).map(|k| (i as usize * 31 + k) as u8).collect()
    }

    /// Takes one request and answers it with its own payload.
    fn echo_one(lane: &Arc<Lane>, buf: &mut Vec<u8>) -> bool {
        match lane.take(buf) {
            Some(req) => {
                let p = req.big.clone().unwrap_or_else(|| buf.clone());
                req.reply.send(reply(&p));
                true
            }
            None => false,
        }
    }

    /// Invariant 8 and the kept request allocation (K1): a small request's
    /// `Vec` is kept (emptied, same allocation) for the next request, once;
    /// with nothing kept, a new buffer has room for any inline request or
    /// reply; a request too large to travel inline, or whose allocation is
    /// smaller than `SPARE_MIN` or larger than `SPARE_MAX`, leaves nothing
    /// kept; a second lane to a node is refused (a wait's reference into
    /// the first stays valid). Fails without the kept allocation (every
    /// `request_buffer` a new one) and without `add_lane`'s check (the
    /// second lane replaces the first).
    #[test]
    fn a_small_requests_allocation_is_kept_and_a_lane_is_never_replaced() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let mut buf = Vec::new();
        let first = slots.request_buffer();
        assert_eq!((first.len(), first.capacity()), (0, SPARE_MIN), "a new one");
        let mut v = first;
        v.extend_from_slice(b"hello");
        let at = v.as_ptr();
        let wait = slots.send(NODE, header(5), v).ok().unwrap();
        let kept = slots.request_buffer();
        assert_eq!(
            (kept.len(), kept.capacity(), kept.as_ptr()),
            (0, SPARE_MIN, at)
        );
        let again = slots.request_buffer();
        assert_ne!(again.as_ptr(), at, "kept once");
        assert!(echo_one(&lane, &mut buf));
        assert_eq!(block_on(wait).unwrap(), reply(b"hello"));
        // Too large to travel inline: it moves to the handler.
        let wait = slots.send(NODE, header(5), payload(1, REQ_INLINE + 1));
        assert!(slots.spare.take().capacity() == 0, "nothing kept");
        assert!(echo_one(&lane, &mut buf));
        assert_eq!(
            block_on(wait.ok().unwrap()).unwrap(),
            reply(&payload(1, REQ_INLINE + 1))
        );
        // Inline, but its allocation too small to take a reply, or too
        // large to keep.
        for cap in [SPARE_MIN - 1, SPARE_MAX + 1] {
            let mut odd = Vec::with_capacity(cap);
            odd.extend_from_slice(b"xyz");
            let wait = slots.send(NODE, header(5), odd).ok().unwrap();
            assert!(slots.spare.take().capacity() == 0, "nothing kept");
            assert!(echo_one(&lane, &mut buf));
            assert_eq!(block_on(wait).unwrap(), reply(b"xyz"));
        }
        let mut big = Vec::with_capacity(SPARE_MAX + 1);
        big.extend_from_slice(b"abc");
        let wait = slots.send(NODE, header(5), big).ok().unwrap();
        // A second lane to the node is refused; the wait still gets its
        // reply through the first.
        let second = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            slots.add_lane(NODE, Lane::new())
        }));
        assert!(second.is_err(), "a second lane to a node was added");
        assert!(echo_one(&lane, &mut buf));
        assert_eq!(block_on(wait).unwrap(), reply(b"abc"));
        reaper.shut_down();
        h.join().unwrap();
    }

    /// A small reply is taken into the endpoint's kept allocation (the
    /// request's, kept at its send), and a buffer given back by `recycle`
    /// is kept for the next request or reply (K1: once, and only of a size
    /// the spare takes); a reply's bytes are exactly its own for every
    /// inline length (the fixed-size copy takes the whole slot). Fails
    /// with the reply copied into a new allocation (`to_vec`, before
    /// branch i83) and with `recycle` dropping what it is given.
    #[test]
    fn a_small_reply_is_taken_into_the_kept_allocation_and_recycled() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let mut buf = Vec::new();
        for len in 0..=REPLY_INLINE {
            let mut v = slots.request_buffer();
            v.extend_from_slice(&payload(len as u64, len));
            let at = v.as_ptr();
            let wait = slots.send(NODE, header(5), v).ok().unwrap();
            assert!(echo_one(&lane, &mut buf));
            let got = block_on(wait).unwrap().result.unwrap();
            assert_eq!(got, payload(len as u64, len), "length {len}");
            assert_eq!(got.as_ptr(), at, "taken into the request's allocation");
            // Given back: kept (emptied), for the next request to be
            // built in (looked at in place: a dropped buffer's address
            // could be handed out again).
            slots.recycle(got);
            let next = slots.spare.take();
            assert_eq!(
                (next.len(), next.capacity(), next.as_ptr()),
                (0, SPARE_MIN, at)
            );
            slots.spare.set(next);
        }
        // One kept at a time; sizes the spare does not take are dropped.
        let kept = slots.spare.take();
        let at = kept.as_ptr();
        slots.recycle(kept);
        let other = Vec::with_capacity(SPARE_MIN);
        let other_at = other.as_ptr();
        slots.recycle(other);
        slots.recycle(Vec::with_capacity(SPARE_MIN - 1));
        slots.recycle(Vec::with_capacity(SPARE_MAX + 1));
        let kept = slots.spare.take();
        assert_eq!(kept.as_ptr(), at);
        assert_ne!(kept.as_ptr(), other_at);
        assert_eq!(slots.spare.take().capacity(), 0);
        slots.recycle(Vec::with_capacity(SPARE_MIN - 1));
        assert_eq!(slots.spare.take().capacity(), 0, "too small");
        slots.recycle(Vec::with_capacity(SPARE_MAX + 1));
        assert_eq!(slots.spare.take().capacity(), 0, "too large");
        reaper.shut_down();
        h.join().unwrap();
    }

    /// A wait gives its reply slot back when its answer is taken (so that
    /// `RpcCall` may skip its drop): spent, with the slot free for the next
    /// RPC before the wait is dropped; a wait dropped unanswered sets its
    /// slot aside. Fails with the slot given back only by the drop (before
    /// branch i83): the free list is empty until then.
    #[test]
    fn a_wait_gives_its_slot_back_when_its_answer_is_taken() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let mut buf = Vec::new();
        let mut wait = slots.send(NODE, header(5), payload(1, 8)).ok().unwrap();
        assert!(!wait.is_spent());
        assert!(echo_one(&lane, &mut buf));
        let index = wait.index;
        let got = block_on(&mut wait).unwrap();
        assert_eq!(got, reply(&payload(1, 8)));
        assert!(wait.is_spent());
        let free = |slots: &RpcSlots| {
            slots.lanes.borrow()[NODE.0 as usize]
                .as_ref()
                .unwrap()
                .free
                .clone()
        };
        let aside = |slots: &RpcSlots| {
            slots.lanes.borrow()[NODE.0 as usize]
                .as_ref()
                .unwrap()
                .aside
                .clone()
        };
        assert_eq!(free(&slots), vec![index], "given back before the drop");
        drop(wait);
        assert_eq!(free(&slots), vec![index], "once");
        // Unanswered, dropped: set aside, not freed.
        let wait = slots.send(NODE, header(5), payload(2, 8)).ok().unwrap();
        let index = wait.index;
        drop(wait);
        assert_eq!(aside(&slots), vec![index]);
        assert!(free(&slots).is_empty());
        assert!(echo_one(&lane, &mut buf));
        reaper.shut_down();
        h.join().unwrap();
    }

    /// A task whose next RPC gets back the reply slot it just gave up keeps
    /// its waker there (S2): no clone and no drop of the waker per RPC.
    /// Fails with the waker stored whenever `WAKER` is clear (before branch
    /// i91: `begin` clears it, so every RPC cloned the waker anew).
    #[test]
    fn a_task_reusing_its_reply_slot_keeps_its_waker_there() {
        use std::sync::atomic::AtomicUsize;
        use std::task::{RawWaker, RawWakerVTable};
        static CLONES: AtomicUsize = AtomicUsize::new(0);
        static DROPS: AtomicUsize = AtomicUsize::new(0);
        fn raw() -> RawWaker {
            RawWaker::new(std::ptr::null(), &VTABLE)
        }
        static VTABLE: RawWakerVTable = RawWakerVTable::new(
            |_| {
                CLONES.fetch_add(1, Ordering::Relaxed);
                raw()
            },
            |_| {},
            |_| {},
            |_| {
                DROPS.fetch_add(1, Ordering::Relaxed);
            },
        );
        // SAFETY: the vtable's functions ignore the (null) data pointer.
        #[allow(unsafe_code)]
        let waker = std::mem::ManuallyDrop::new(unsafe { Waker::from_raw(raw()) });
        let mut cx = Context::from_waker(&waker);
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let mut buf = Vec::new();
        let mut index = None;
        for i in 0..4 {
            let mut wait = slots.send(NODE, header(5), payload(i, 8)).ok().unwrap();
            assert_eq!(
                *index.get_or_insert(wait.index),
                wait.index,
                "the same slot"
            );
            assert!(Pin::new(&mut wait).poll(&mut cx).is_pending());
            assert!(echo_one(&lane, &mut buf));
            match Pin::new(&mut wait).poll(&mut cx) {
                Poll::Ready(r) => assert_eq!(r.unwrap(), reply(&payload(i, 8))),
                Poll::Pending => panic!("answered"),
            }
        }
        assert_eq!(
            (
                CLONES.load(Ordering::Relaxed),
                DROPS.load(Ordering::Relaxed)
            ),
            (1, 0),
            "the waker is cloned into the slot once and kept"
        );
        reaper.shut_down();
        h.join().unwrap();
    }

    /// A reply sent through a `ReplyTo` that owns its lane reference (a
    /// deferred answer) releases that reference (the send consumes the
    /// `ReplyTo` without its drop glue since branch i83, and drops the lane
    /// itself); a borrowed one takes none. Fails with the lane forgotten
    /// with the `ReplyTo` (the count stays one higher).
    #[test]
    fn a_sent_reply_releases_an_owned_lane_reference() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let mut buf = Vec::new();
        let before = Arc::strong_count(&lane);
        let wait = slots.send(NODE, header(5), payload(3, 8)).ok().unwrap();
        let owned = lane.take(&mut buf).unwrap().reply.into_owned();
        assert_eq!(Arc::strong_count(&lane), before + 1);
        owned.send(reply(b"late"));
        assert_eq!(Arc::strong_count(&lane), before, "released by the send");
        assert_eq!(block_on(wait).unwrap(), reply(b"late"));
        let wait = slots.send(NODE, header(5), payload(4, 8)).ok().unwrap();
        assert!(echo_one(&lane, &mut buf));
        assert_eq!(Arc::strong_count(&lane), before);
        assert_eq!(block_on(wait).unwrap(), reply(&payload(4, 8)));
        reaper.shut_down();
        h.join().unwrap();
    }

    /// What the producer writes for every small request (the word, the
    /// header, `deliver_at`, the payload's first `LINE0_INLINE` bytes) and
    /// what the answerer touches for every reply (the word, the waker, the
    /// body's header and first bytes) are in their slot's first 64-byte
    /// line; `big` and the payload's tail are in the second (see
    /// `ReqSlot` and `ReplySlot`). Fails with the layout before branch
    /// i75 (`deliver_at` after the payload, the waker after the body).
    #[test]
    fn what_every_rpc_writes_is_in_its_slots_first_line() {
        use std::mem::{offset_of, size_of};
        const LINE: usize = 64;
        let req = offset_of!(ReqSlot, body);
        let req_inline = req + offset_of!(ReqBody, inline);
        assert!(req + offset_of!(ReqBody, deliver_at) + size_of::<Option<Instant>>() <= req_inline);
        assert_eq!(req_inline + LINE0_INLINE, LINE);
        assert!(req + offset_of!(ReqBody, big) >= LINE);
        let rep = offset_of!(ReplySlot, body);
        let rep_inline = rep + offset_of!(ReplyBody, inline);
        assert!(offset_of!(ReplySlot, waker) + size_of::<Option<Waker>>() <= rep);
        assert_eq!(offset_of!(ReplySlot, state), 0);
        assert_eq!(rep_inline + LINE0_INLINE, LINE);
        assert!(rep + offset_of!(ReplyBody, big) >= LINE);
        assert!(size_of::<ReqSlot>() <= 2 * LINE && size_of::<ReplySlot>() <= 2 * LINE);
    }

    /// `put_inline` (branch i86) copies a short payload from a buffer with
    /// room with one fixed-size copy of the slot's first-line bytes (the
    /// buffer's spare room comes along) and leaves the second line as it
    /// was; a longer payload with room copies the whole array; a buffer
    /// without room is copied exactly. The payload's bytes are always the
    /// array's first bytes. Fails with the exact copy for every payload
    /// (checked: "spare room copied, length 0") and with the whole array
    /// copied for a short one (checked: "second line untouched, length 0
    /// room 64").
    #[test]
    #[allow(unsafe_code)]
    fn a_payload_is_put_inline_with_a_fixed_size_copy_that_spares_the_second_line() {
        const MARK: u8 = 0xA5;
        let bytes = |a: &[MaybeUninit<u8>; REQ_INLINE]| -> Vec<u8> {
            // SAFETY: every byte of `a` is initialised in this test (MARK,
            // then bytes of buffers whose whole room was written).
            a.iter().map(|b| unsafe { b.assume_init() }).collect()
        };
        for len in 0..=REQ_INLINE {
            for room in [REQ_INLINE, LINE0_INLINE.max(len), len] {
                // A buffer whose spare room holds known bytes.
                let mut src: Vec<u8> = Vec::with_capacity(room);
                src.extend((0..room).map(|i| 100 + i as u8));
                src.truncate(len);
                if src.capacity() != room {
                    continue; // the allocator gave more room than asked
                }
                let mut dst = [MaybeUninit::new(MARK); REQ_INLINE];
                put_inline(&mut dst, &src);
                let got = bytes(&dst);
                assert_eq!(&got[..len], &src[..], "payload, length {len} room {room}");
                let copied = if len <= LINE0_INLINE && room >= LINE0_INLINE {
                    LINE0_INLINE
                } else if room >= REQ_INLINE {
                    REQ_INLINE
                } else {
                    len
                };
                let spare: Vec<u8> = (len..copied).map(|i| 100 + i as u8).collect();
                assert_eq!(
                    &got[len..copied],
                    &spare[..],
                    "spare room copied, length {len}"
                );
                assert!(
                    got[copied..].iter().all(|&b| b == MARK),
                    "second line untouched, length {len} room {room}"
                );
            }
        }
    }

    /// The request take's fixed-size copy (`copy_inline`, branch i71): a
    /// handler's buffer holds exactly the request's bytes for every inline
    /// length, also after a longer request left its bytes in the buffer's
    /// spare room, and an empty lane is seen as empty. Fails with the
    /// buffer's length set wrong (checked with `buf.set_len(REQ_INLINE)`:
    /// "length 63").
    #[test]
    fn a_taken_request_is_exactly_its_bytes_for_every_inline_length() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let mut buf = Vec::new();
        assert!(lane.take(&mut buf).is_none(), "an empty lane");
        let lengths = (0..=REQ_INLINE).rev().chain(0..=REQ_INLINE + 1);
        for (i, len) in lengths.enumerate() {
            let p = payload(i as u64, len);
            let wait = slots.send(NODE, header(3), p.clone()).ok().unwrap();
            let req = lane.take(&mut buf).expect("a request");
            match &req.big {
                Some(big) => assert_eq!((len, &big[..]), (len, &p[..]), "length {len}"),
                None => assert_eq!((len, &buf[..]), (len, &p[..]), "length {len}"),
            }
            req.reply.send(reply(b"ok"));
            assert_eq!(block_on(wait).unwrap(), reply(b"ok"));
            assert!(lane.take(&mut buf).is_none(), "taken once");
        }
        reaper.shut_down();
        h.join().unwrap();
    }

    #[test]
    fn replies_reach_their_own_rpc_and_slots_are_reused() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let wait = slots.send(NODE, header(5), b"abc".to_vec()).ok().unwrap();
        let l = lane.clone();
        std::thread::spawn(move || {
            let mut buf = Vec::new();
            let req = l.take(&mut buf).expect("a request");
            assert_eq!(
                (req.service, req.from, &buf[..]),
                (ServiceId(5), NodeId(0), &b"abc"[..])
            );
            req.reply.send(reply(b"7"));
        })
        .join()
        .unwrap();
        assert_eq!(block_on(wait).unwrap(), reply(b"7"));
        // The next RPC reuses the slot.
        let wait2 = slots.send(NODE, header(5), Vec::new()).ok().unwrap();
        assert_eq!(wait2.index, 0, "the slot was reused");
        assert_eq!(wait2.seq, 2);
        let mut buf = Vec::new();
        assert!(echo_one(&lane, &mut buf));
        assert_eq!(block_on(wait2).unwrap(), reply(b""));
        // Two RPCs in flight at once take two slots and may finish out of
        // order.
        let wa = slots.send(NODE, header(1), b"a".to_vec()).ok().unwrap();
        let wb = slots.send(NODE, header(1), b"b".to_vec()).ok().unwrap();
        assert_ne!(wa.index, wb.index);
        let ra = lane.take(&mut buf).unwrap();
        let rb = lane.take(&mut buf).unwrap();
        rb.reply.send(reply(b"4"));
        ra.reply.send(reply(b"3"));
        assert_eq!(block_on(wb).unwrap(), reply(b"4"));
        assert_eq!(block_on(wa).unwrap(), reply(b"3"));
        reaper.shut_down();
        h.join().unwrap();
    }

    #[test]
    fn a_dropped_request_or_a_drained_lane_is_node_down() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let wait = slots.send(NODE, header(1), Vec::new()).ok().unwrap();
        drop(lane.take(&mut Vec::new()).unwrap());
        assert!(matches!(
            block_on(wait),
            Err(TransportError::NodeDown(NODE))
        ));
        let w1 = slots.send(NODE, header(1), vec![1; 100]).ok().unwrap();
        let w2 = slots.send(NODE, header(1), vec![2]).ok().unwrap();
        lane.drain();
        assert!(!lane.has_request());
        assert!(matches!(block_on(w1), Err(TransportError::NodeDown(NODE))));
        assert!(matches!(block_on(w2), Err(TransportError::NodeDown(NODE))));
        reaper.shut_down();
        h.join().unwrap();
    }

    #[test]
    fn an_unanswered_rpc_times_out_after_the_timeout_and_a_late_reply_is_discarded() {
        let timeout = Duration::from_millis(40);
        let (reaper, h, slots, lane) = setup(timeout);
        let wait = slots.send(NODE, header(1), b"x".to_vec()).ok().unwrap();
        let first = wait.index;
        let start = Instant::now();
        assert!(matches!(
            block_on(wait),
            Err(TransportError::Timeout { node: NODE })
        ));
        assert!(start.elapsed() >= timeout, "waited {:?}", start.elapsed());
        // The timed-out RPC's slot is kept aside: the next RPC gets another
        // one, and the late reply lands in the old slot only.
        let wait2 = slots.send(NODE, header(1), b"y".to_vec()).ok().unwrap();
        assert_ne!(wait2.index, first);
        let mut buf = Vec::new();
        let late = lane.take(&mut buf).unwrap();
        let now = lane.take(&mut buf).unwrap();
        late.reply.send(reply(b"late"));
        now.reply.send(reply(b"5"));
        assert_eq!(block_on(wait2).unwrap(), reply(b"5"));
        // Answered, the old slot is reused again (before fresh ones).
        let wait3 = slots.send(NODE, header(1), Vec::new()).ok().unwrap();
        assert!(wait3.index == first || wait3.index == 1);
        assert!(echo_one(&lane, &mut buf));
        assert_eq!(block_on(wait3).unwrap(), reply(b""));
        reaper.shut_down();
        h.join().unwrap();
    }

    /// Requests of every size class (empty, inline up to the limit, one
    /// byte over, large) through the ring many times around, one at a time
    /// and in batches that straddle its end: each reply matches its
    /// request.
    #[test]
    fn the_ring_wraps_around_with_every_payload_size() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let sizes = [0, 1, REQ_INLINE, REQ_INLINE + 1, REPLY_INLINE + 1, 300];
        let mut buf = Vec::new();
        let mut i = 0u64;
        for batch in [1usize, 5, 40, 63, 64] {
            for _ in 0..4 {
                let waits: Vec<_> = (0..batch)
                    .map(|k| {
                        let p = payload(i + k as u64, sizes[(i as usize + k) % sizes.len()]);
                        (p.clone(), slots.send(NODE, header(2), p).ok().unwrap())
                    })
                    .collect();
                i += batch as u64;
                for _ in 0..batch {
                    assert!(echo_one(&lane, &mut buf));
                }
                assert!(!lane.has_request());
                for (p, w) in waits {
                    assert_eq!(block_on(w).unwrap(), reply(&p));
                }
            }
        }
        assert!(i > 3 * RING, "went around the ring {} times", i / RING);
        reaper.shut_down();
        h.join().unwrap();
    }

    /// A full ring gives the payload back until the handler takes a
    /// request; so do exhausted reply slots until an RPC ends.
    #[test]
    fn a_full_ring_or_reply_pool_pushes_back() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(30));
        let mut waits: Vec<_> = (0..RING)
            .map(|i| slots.send(NODE, header(1), payload(i, 3)).ok().unwrap())
            .collect();
        let refused = slots.send(NODE, header(1), payload(99, 3));
        assert_eq!(refused.err(), Some(payload(99, 3)), "the ring is full");
        let mut buf = Vec::new();
        let mut held = Vec::new();
        held.push(lane.take(&mut buf).unwrap());
        waits.push(slots.send(NODE, header(1), payload(99, 3)).ok().unwrap());
        // Keep taking requests without answering until the reply slots run
        // out (REPLIES RPCs in flight).
        while (waits.len() as u64) < REPLIES as u64 {
            held.push(lane.take(&mut buf).unwrap());
            let i = waits.len() as u64;
            waits.push(slots.send(NODE, header(1), payload(i, 3)).ok().unwrap());
        }
        while let Some(r) = lane.take(&mut buf) {
            held.push(r);
        }
        assert!(
            slots.send(NODE, header(1), Vec::new()).is_err(),
            "no reply slot left"
        );
        // One answer frees one slot.
        let r = held.remove(0);
        r.reply.send(reply(b"1"));
        let first = waits.remove(0);
        assert_eq!(block_on(first).unwrap(), reply(b"1"));
        let w = slots.send(NODE, header(1), Vec::new()).ok().unwrap();
        held.push(lane.take(&mut buf).unwrap());
        drop(held); // every held request answers NodeDown
        drop(w);
        drop(waits);
        reaper.shut_down();
        h.join().unwrap();
    }

    /// Invariant 7: a caller whose reply slots are all held by requests
    /// a handler never answers stops waiting for room after the RPC
    /// timeout, counted in watchdog ticks (no wall-clock assertion): the
    /// check says "not yet" until more than `TICKS` ticks have passed since
    /// the caller first found no room, and "timed out" from then on.
    #[test]
    fn a_wait_for_a_reply_slot_times_out_after_the_rpc_timeout() {
        let (reaper, h, slots, lane) = setup(Duration::from_millis(8));
        let mut buf = Vec::new();
        let mut held = Vec::new();
        let mut waits = Vec::new();
        while waits.len() < REPLIES {
            while let Some(r) = lane.take(&mut buf) {
                held.push(r);
            }
            waits.push(slots.send(NODE, header(1), vec![1]).ok().unwrap());
        }
        while let Some(r) = lane.take(&mut buf) {
            held.push(r);
        }
        // The 257th call finds no room.
        assert!(slots.send(NODE, header(1), vec![2]).is_err());
        let since = slots.tick_now();
        assert!(!slots.room_wait_timed_out(since), "no time has passed");
        let mut tries = 0u64;
        while !slots.room_wait_timed_out(since) {
            // Still no room: nothing was answered.
            assert!(slots.send(NODE, header(1), vec![2]).is_err());
            tries += 1;
            std::thread::yield_now();
        }
        let waited = slots.tick_now().wrapping_sub(since);
        assert!(waited > TICKS, "gave up after {waited} ticks");
        assert!(tries > 0);
        drop(held); // NodeDown for every held request
        for w in waits {
            assert!(matches!(block_on(w), Err(TransportError::NodeDown(NODE))));
        }
        // Answered, the slots are free again.
        assert!(slots.send(NODE, header(1), vec![3]).is_ok());
        reaper.shut_down();
        h.join().unwrap();
    }

    /// Two consumer threads serve one lane (invariant 2) while the
    /// producer keeps 8 RPCs in flight from 8 tasks: every RPC gets its own
    /// reply, none is lost or answered twice (each consumer echoes the
    /// payload with the request's position appended; positions must be
    /// seen once each).
    #[test]
    fn no_request_is_lost_with_two_consumers() {
        let (reaper, h, slots, lane) = setup(Duration::from_secs(10));
        let stop = Arc::new(AtomicBool::new(false));
        let seen = Arc::new(Mutex::new(Vec::new()));
        let consumers: Vec<_> = (0..2)
            .map(|_| {
                let (lane, stop, seen) = (lane.clone(), stop.clone(), seen.clone());
                std::thread::spawn(move || {
                    let mut buf = Vec::new();
                    while !stop.load(Ordering::Acquire) {
                        match lane.take(&mut buf) {
                            Some(req) => {
                                let p = req.big.clone().unwrap_or_else(|| buf.clone());
                                seen.lock().push(p.clone());
                                req.reply.send(reply(&p));
                            }
                            None => std::thread::yield_now(),
                        }
                    }
                })
            })
            .collect();
        const PER_TASK: u64 = 2_000;
        let slots_ref = &slots;
        let tasks: Vec<LocalTask<'_, ()>> = (0..8u64)
            .map(|t| {
                Box::pin(async move {
                    for i in 0..PER_TASK {
                        let n = t * PER_TASK + i;
                        let p = payload(n, (n % 90) as usize);
                        let w = loop {
                            match slots_ref.send(NODE, header(3), p.clone()) {
                                Ok(w) => break w,
                                Err(_) => crate::exec::yield_now().await,
                            }
                        };
                        assert_eq!(w.await.unwrap(), reply(&p), "RPC {n}");
                    }
                }) as LocalTask<'_, ()>
            })
            .collect();
        run_tasks(tasks);
        stop.store(true, Ordering::Release);
        for c in consumers {
            c.join().unwrap();
        }
        assert_eq!(
            seen.lock().len() as u64,
            8 * PER_TASK,
            "each request served once"
        );
        reaper.shut_down();
        h.join().unwrap();
    }
}
