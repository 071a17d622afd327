//! The discrete-event scheduler: one OS thread, virtual time, seeded ties.
//!
//! Invariants:
//! 1. Virtual time never goes backwards: an event is never scheduled before
//!    `now`, and events run in (time, tie, sequence) order.
//! 2. `tie` is drawn from the seeded RNG, so events at the same virtual
//!    instant run in an order the seed chooses; the same seed replays it.
//! 3. Everything runs on the thread that entered the simulation.
//! 4. A task is polled by one frame at a time; see `run_tasks`.
//!
//! This module holds the backend's one `unsafe` block: the stack of running
//! frames keeps lifetime-erased pointers to them (see `FrameRegistration`).

use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};
use std::cell::{Cell, RefCell};
use std::collections::VecDeque;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll, Wake, Waker};

/// What an event does when its instant comes. Wakes, the most common
/// kind, carry their waker, and the network's per-verb events their
/// state, inline; anything else is a boxed closure.
pub(crate) enum Event {
    Wake(Waker),
    Net(super::net::NetEvent),
    Run(Box<dyn FnOnce()>),
    /// A watchdog's check ([`Sched::quiet_at`]): not counted as an event.
    Quiet(Box<dyn FnOnce()>),
}

/// A pending event's place in the queue: ordered by (time, tie, seq), the
/// event itself in node `slot` of the queue (so that the heap
/// moves 32 bytes per step, not the event). `seq` is unique, in scheduling
/// order, and settles equal (time, tie) pairs; the order is exactly what
/// invariants 1 and 2 require. Time and tie are packed into one `u128`
/// (`at << 64 | tie`) so that the usual comparison is a single one.
#[derive(Clone, Copy)]
struct Entry {
    key: u128,
    seq: u64,
    slot: u32,
}

impl Entry {
    fn new(at: u64, tie: u64, seq: u64, slot: u32) -> Entry {
        Entry {
            key: ((at as u128) << 64) | tie as u128,
            seq,
            slot,
        }
    }

    fn at(&self) -> u64 {
        (self.key >> 64) as u64
    }

    /// Whether this entry runs before `o`: (time, tie, seq) order.
    #[inline]
    fn before(&self, o: &Entry) -> bool {
        self.key < o.key || (self.key == o.key && self.seq < o.seq)
    }
}

/// Entries as a 4-ary min-heap on [`Entry::before`] (the event queue's
/// events beyond its wheel, see [`EventQueue`]).
/// Every entry's order is unique (its `seq`), so any correct priority
/// queue pops exactly the same sequence; four children per node halve the
/// depth of a binary heap, and a pop moves the hole down instead of
/// swapping (the queue is popped once per event, its largest cost).
#[derive(Default)]
struct FarHeap {
    heap: Vec<Entry>,
}

const ARITY: usize = 4;

impl FarHeap {
    fn push(&mut self, e: Entry) {
        let mut i = self.heap.len();
        self.heap.push(e);
        while i > 0 {
            let parent = (i - 1) / ARITY;
            if !e.before(&self.heap[parent]) {
                break;
            }
            self.heap[i] = self.heap[parent];
            i = parent;
        }
        self.heap[i] = e;
    }

    fn pop(&mut self) -> Option<Entry> {
        let last = self.heap.pop()?;
        let n = self.heap.len();
        if n == 0 {
            return Some(last);
        }
        let top = self.heap[0];
        // Sift `last` down from the root: the hole moves to the earliest
        // child while that child runs before `last`.
        let heap = &mut self.heap[..n];
        let mut i = 0;
        loop {
            let first = ARITY * i + 1;
            if first >= n {
                break;
            }
            // The children as one slice: one bounds check per level.
            let kids = &heap[first..(first + ARITY).min(n)];
            let mut min = 0;
            let mut best = kids[0];
            for (c, k) in kids.iter().enumerate().skip(1) {
                if k.before(&best) {
                    best = *k;
                    min = c;
                }
            }
            if !best.before(&last) {
                break;
            }
            heap[i] = best;
            i = first + min;
        }
        heap[i] = last;
        Some(top)
    }

    fn peek(&self) -> Option<&Entry> {
        self.heap.first()
    }

    fn clear(&mut self) {
        self.heap.clear();
    }
}

/// Buckets of the event queue's wheel: one per nanosecond of the near
/// future (a power of two).
const WHEEL: usize = 8192;
const WHEEL_WORDS: usize = WHEEL / 64;
/// Words of the wheel's summary: bit `w` set exactly when word `w` of
/// `bits` is not zero (branch i54: the pop scanned up to 128 words for
/// the next non-empty bucket, ~29 instructions per event on average).
const SUMMARY_WORDS: usize = WHEEL_WORDS / 64;
/// No entry (an empty bucket, the end of a bucket's list).
const NONE: u32 = u32::MAX;

/// A pending entry of the event queue: its order, its bucket's next link,
/// and what it carries (the event), in one place (branch i50: the events
/// were in a slab of their own beside the links).
struct Node<T> {
    entry: Entry,
    next: u32,
    item: Option<T>,
}

/// The pending events, popped in (time, tie, seq) order
/// ([`Entry::before`]), each with its payload `T` (the scheduler's
/// [`Event`]): a timing wheel with one bucket per nanosecond for the
/// entries due within [`WHEEL`] ns of the last pop, and a 4-ary heap
/// ([`FarHeap`]) for those further ahead (branch i47: the heap alone cost
/// about 235 instructions per event, a third of it in comparisons).
///
/// Invariants:
/// 1. Every entry in the wheel is due in `[cur, cur + WHEEL)`, where `cur`
///    is the time of the last entry popped (no entry is ever pushed for an
///    earlier instant than that, scheduler invariant 1): so bucket
///    `at % WHEEL` holds exactly the entries due at `at`, and the first
///    non-empty bucket from `cur % WHEEL` on (circularly) holds the
///    earliest entries of the wheel. (An entry pushed for an instant before
///    `cur` would go to the heap, which orders anything correctly.)
/// 2. A bucket is a list of entries due at one instant; the pop takes its
///    first in (tie, seq) order. `bits` has bit `b` set exactly when bucket
///    `b` is not empty, `summary` bit `w` exactly when word `w` of `bits`
///    is not zero, and `in_wheel` counts the wheel's entries.
/// 3. Entries stay where they were pushed (the wheel or the heap); a pop
///    compares the wheel's first entry with the heap's and takes the one
///    that runs first, so the order is exactly (time, tie, seq), whichever
///    structure holds what (`the_event_queue_pops_in_time_tie_seq_order`
///    checks it against `BinaryHeap`, entries due far ahead included).
/// 4. Every pending entry has a node of its own (`Entry::slot`, unique
///    among pending entries) holding its payload; a popped entry's node is
///    free for reuse (`free`), its payload moved out.
struct EventQueue<T> {
    /// Per bucket: the slot of its first entry's node, or [`NONE`].
    heads: Box<[u32; WHEEL]>,
    bits: Box<[u64; WHEEL_WORDS]>,
    /// Which words of `bits` are not zero (invariant 2).
    summary: [u64; SUMMARY_WORDS],
    /// Per slot: a pending entry's node (or a free one, `item` None).
    nodes: Vec<Node<T>>,
    /// Free slots.
    free: Vec<u32>,
    in_wheel: usize,
    cur: u64,
    far: FarHeap,
}

impl<T> Default for EventQueue<T> {
    fn default() -> EventQueue<T> {
        EventQueue {
            heads: Box::new([NONE; WHEEL]),
            bits: Box::new([0; WHEEL_WORDS]),
            summary: [0; SUMMARY_WORDS],
            nodes: Vec::new(),
            free: Vec::new(),
            in_wheel: 0,
            cur: 0,
            far: FarHeap::default(),
        }
    }
}

impl<T> EventQueue<T> {
    /// Queues `item` due at `at` with order (`tie`, `seq`).
    #[inline]
    fn push(&mut self, at: u64, tie: u64, seq: u64, item: T) {
        let slot = match self.free.pop() {
            Some(slot) => slot,
            None => {
                let slot = u32::try_from(self.nodes.len())
                    .ok()
                    .filter(|&s| s != NONE)
                    .expect("fewer than 2^32 - 1 pending events");
                self.nodes.push(Node {
                    entry: Entry::new(0, 0, 0, slot),
                    next: NONE,
                    item: None,
                });
                slot
            }
        };
        let e = Entry::new(at, tie, seq, slot);
        // `at < cur` wraps to a large difference: the heap takes it.
        let in_wheel = at.wrapping_sub(self.cur) < WHEEL as u64;
        let b = at as usize & (WHEEL - 1);
        let node = &mut self.nodes[slot as usize];
        node.entry = e;
        // A free node holds no payload (invariant 4): nothing to drop.
        debug_assert!(node.item.is_none(), "a free node holds no payload");
        std::mem::forget(node.item.replace(item));
        if !in_wheel {
            node.next = NONE;
            self.far.push(e);
            return;
        }
        node.next = self.heads[b];
        self.heads[b] = slot;
        let w = b / 64;
        self.bits[w] |= 1 << (b % 64);
        self.summary[w / 64] |= 1 << (w % 64);
        self.in_wheel += 1;
    }

    /// The first non-empty bucket from `cur` on, circularly (there is one:
    /// `in_wheel > 0`).
    #[inline]
    fn first_bucket(&self) -> usize {
        let start = self.cur as usize & (WHEEL - 1);
        let w = start / 64;
        let word = self.bits[w] & (!0u64 << (start % 64));
        if word != 0 {
            return w * 64 + word.trailing_zeros() as usize;
        }
        // The first non-zero word after `w`, circularly, from the summary
        // (word `w` itself comes last: only its buckets before `start`
        // are left, which are the furthest ahead).
        let next = w + 1;
        let mut s = next / 64;
        let mut sw = if next < WHEEL_WORDS {
            self.summary[s] & (!0u64 << (next % 64))
        } else {
            s = 0;
            self.summary[0]
        };
        for _ in 0..=SUMMARY_WORDS {
            if sw != 0 {
                let w = s * 64 + sw.trailing_zeros() as usize;
                return w * 64 + self.bits[w].trailing_zeros() as usize;
            }
            s = (s + 1) % SUMMARY_WORDS;
            sw = self.summary[s];
        }
        unreachable!("the wheel holds an entry")
    }

    /// The first entry in (time, tie, seq) order and its payload.
    #[inline]
    fn pop(&mut self) -> Option<(Entry, T)> {
        let e = self.pop_entry()?;
        let item = self.nodes[e.slot as usize]
            .item
            .take()
            .expect("a pending entry's node holds its payload");
        self.free.push(e.slot);
        Some((e, item))
    }

    fn pop_entry(&mut self) -> Option<Entry> {
        if self.in_wheel == 0 {
            let e = self.far.pop()?;
            self.cur = e.at();
            return Some(e);
        }
        let b = self.first_bucket() & (WHEEL - 1);
        // The bucket's first entry in (tie, seq) order, and the link before
        // it (NONE: it is the head).
        let head = self.heads[b];
        let node = &self.nodes[head as usize];
        let (mut best, mut next) = (node.entry, node.next);
        let mut best_prev = NONE;
        let after = if next == NONE {
            NONE
        } else {
            let mut prev = head;
            while next != NONE {
                let n = &self.nodes[next as usize];
                if n.entry.before(&best) {
                    best = n.entry;
                    best_prev = prev;
                }
                prev = next;
                next = n.next;
            }
            self.nodes[best.slot as usize].next
        };
        if let Some(f) = self.far.peek()
            && f.before(&best)
        {
            let f = self.far.pop().expect("peeked");
            self.cur = f.at();
            return Some(f);
        }
        if best_prev == NONE {
            self.heads[b] = after;
            if after == NONE {
                let w = b / 64;
                self.bits[w] &= !(1 << (b % 64));
                if self.bits[w] == 0 {
                    self.summary[w / 64] &= !(1 << (w % 64));
                }
            }
        } else {
            self.nodes[best_prev as usize].next = after;
        }
        self.in_wheel -= 1;
        self.cur = best.at();
        Some(best)
    }

    /// How many entries are pending (invariant 4: a node each).
    fn len(&self) -> usize {
        self.nodes.len() - self.free.len()
    }

    /// Drops every pending entry; returns their payloads.
    fn clear(&mut self) -> Vec<T> {
        self.heads.fill(NONE);
        self.bits.fill(0);
        self.summary = [0; SUMMARY_WORDS];
        self.free.clear();
        self.in_wheel = 0;
        self.cur = 0;
        self.far.clear();
        std::mem::take(&mut self.nodes)
            .into_iter()
            .filter_map(|n| n.item)
            .collect()
    }
}

/// A value used only on the thread that made it (scheduler invariant 3),
/// yet `Send + Sync`, so that a [`Waker`] (which must be) can hold it: every
/// access checks that it runs on that thread and panics elsewhere, and a
/// drop on another thread leaks the value instead of touching it (branch
/// i54: the ready queues were behind a mutex and two atomics, taken on
/// every wake and poll although only one thread ever uses them).
///
/// Sound because no two threads can pass the check at once: a thread is
/// known by the address of its own thread-local `MARK`, unique among the
/// threads alive at any instant; a thread that gets a dead owner's address
/// cannot meet that owner.
struct ThreadBound<T> {
    owner: usize,
    inner: std::mem::ManuallyDrop<T>,
}

thread_local! {
    static MARK: u8 = const { 0 };
}

/// The calling thread's identity for [`ThreadBound`].
#[inline]
fn thread_mark() -> usize {
    MARK.with(|m| m as *const u8 as usize)
}

// SAFETY: the value is reached only through `get` (and `drop`), which
// check that the calling thread is the one that made it (see above): it is
// never used by two threads, so it need not be `Send` or `Sync` itself.
unsafe impl<T> Send for ThreadBound<T> {}
// SAFETY: as above.
unsafe impl<T> Sync for ThreadBound<T> {}

impl<T> ThreadBound<T> {
    fn new(v: T) -> ThreadBound<T> {
        ThreadBound {
            owner: thread_mark(),
            inner: std::mem::ManuallyDrop::new(v),
        }
    }

    #[inline]
    fn get(&self) -> &T {
        assert!(
            self.owner == thread_mark(),
            "a simulated task was woken or polled outside its simulation's thread"
        );
        &self.inner
    }
}

impl<T> Drop for ThreadBound<T> {
    fn drop(&mut self) {
        if self.owner == thread_mark() {
            // SAFETY: dropped once, here; never used again.
            unsafe { std::mem::ManuallyDrop::drop(&mut self.inner) }
        }
        // Elsewhere: leaked, never touched off its thread.
    }
}

/// Tasks of one frame (a `run_tasks` call, or the background set) that are
/// ready to be polled, in the order they were woken. Used on the
/// simulation's thread only ([`ThreadBound`]): no lock.
pub(crate) struct ReadyQueue(ThreadBound<ReadyInner>);

struct ReadyInner {
    /// Which tasks are queued, and in what order, in one cell (one borrow
    /// per push or pop).
    queue: RefCell<Queued>,
    /// The frame is over: nothing polls this queue any more.
    closed: Cell<bool>,
    /// Tasks queued in every open ready queue of the scheduler together
    /// (shared by them): while it is zero, no frame and no background task
    /// has anything to poll and the scheduler goes straight to the next
    /// event. Invariant: it is exactly the sum of the open queues' lengths
    /// (pushes into a closed queue are dropped, see `close`).
    total: Rc<Cell<usize>>,
}

/// A ready queue's tasks: `queued[i]` exactly when task `i` is in
/// `order` (once at most).
struct Queued {
    queued: Vec<bool>,
    order: VecDeque<usize>,
}

impl ReadyQueue {
    fn new(n: usize, all_ready: bool, total: &Rc<Cell<usize>>) -> Arc<ReadyQueue> {
        let len = if all_ready { n } else { 0 };
        total.set(total.get() + len);
        Arc::new(ReadyQueue(ThreadBound::new(ReadyInner {
            queue: RefCell::new(Queued {
                queued: vec![all_ready; n],
                order: if all_ready {
                    (0..n).collect()
                } else {
                    VecDeque::new()
                },
            }),
            closed: Cell::new(false),
            total: total.clone(),
        })))
    }
    fn push(&self, i: usize) {
        let r = self.0.get();
        if r.closed.get() {
            return;
        }
        let mut q = r.queue.borrow_mut();
        if q.queued.len() <= i {
            q.queued.resize(i + 1, false);
        }
        if !q.queued[i] {
            q.queued[i] = true;
            q.order.push_back(i);
            r.total.set(r.total.get() + 1);
        }
    }
    /// Whether no task is queued.
    #[inline]
    fn is_empty(&self) -> bool {
        self.0.get().queue.borrow().order.is_empty()
    }
    #[inline]
    fn pop(&self) -> Option<usize> {
        let r = self.0.get();
        let mut q = r.queue.borrow_mut();
        let i = q.order.pop_front()?;
        q.queued[i] = false;
        r.total.set(r.total.get() - 1);
        Some(i)
    }
    /// The frame that polled this queue is over: its queued tasks leave the
    /// scheduler's total, and later wakes (of finished tasks, by events
    /// still pending) are dropped instead of queued where no one looks.
    fn close(&self) {
        let r = self.0.get();
        if !r.closed.get() {
            r.closed.set(true);
            let mut q = r.queue.borrow_mut();
            r.total.set(r.total.get() - q.order.len());
            q.order.clear();
        }
    }
}

struct TaskWaker {
    ready: Arc<ReadyQueue>,
    index: usize,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        self.ready.push(self.index);
    }
}

fn wakers(ready: &Arc<ReadyQueue>, from: usize, to: usize) -> Vec<Waker> {
    (from..to)
        .map(|index| {
            Waker::from(Arc::new(TaskWaker {
                ready: ready.clone(),
                index,
            }))
        })
        .collect()
}

/// A background task: lives as long as the simulation or until it finishes.
type BgTask = Pin<Box<dyn Future<Output = ()>>>;

struct Background {
    /// A slot is `None` while the task is being polled (a nested frame skips
    /// it) or after it finished.
    tasks: Vec<Option<BgTask>>,
    done: Vec<bool>,
    wakers: Vec<Waker>,
}

/// The scheduler's state. Owned by one thread (see invariant 3).
pub(crate) struct Sched {
    now: Cell<u64>,
    queue: RefCell<EventQueue<Event>>,
    seq: Cell<u64>,
    rng: RefCell<SmallRng>,
    events: Cell<u64>,
    /// Virtual CPU time of whatever runs now on a simulated core (what
    /// `thread_cpu_ns` returns inside a simulation).
    pub(crate) cpu_ns: Cell<u64>,
    bg: RefCell<Background>,
    bg_ready: Arc<ReadyQueue>,
    /// Tasks ready in all ready queues (see `ReadyInner::total`).
    ready_total: Rc<Cell<usize>>,
    /// Frames (nested `run_tasks` calls) currently running, outermost first.
    frames: RefCell<Vec<FramePtr>>,
    /// Waits on the network alone in progress (`run_alone`).
    alone: Cell<usize>,
    /// Jobs held back until they are over (`hold_job`).
    held_jobs: RefCell<Vec<Box<dyn FnOnce()>>>,
    /// Frames kept from returning by a frame above them (`FramesHeld`).
    frames_held: Cell<FramesHeld>,
    /// Worker jobs suspended now (`jobco`), and the wakers of code waiting
    /// for there to be none.
    jobs_suspended: Cell<usize>,
    jobs_ended_waiters: RefCell<Vec<Waker>>,
}

/// Nested frames (the synchronous waits of simulated code that is not a
/// worker job, which suspends instead (`jobco`): RPC handlers, mostly; not
/// the outermost frame, the harness's own wait)
/// whose tasks had all completed while a frame pushed above them still ran,
/// so that the code waiting in them could resume only when that one
/// returned (docs/simulation.md, "The rule for synchronous waits"): how
/// many, and for how long in virtual time. A hold of 0 ns (the frame above
/// returned at the same instant) is not counted. The outermost frame's
/// holds are left out: its code is the harness's, which reads the end of a
/// run from its tasks' own ends (`last_end` in the bench runner).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct FramesHeld {
    /// Frames held for more than 0 ns.
    pub count: u64,
    /// Their holds, summed (ns of virtual time).
    pub total_ns: u64,
    /// The longest hold (ns of virtual time).
    pub max_ns: u64,
}

impl FramesHeld {
    fn record(&mut self, ns: u64) {
        if ns > 0 {
            self.count += 1;
            self.total_ns += ns;
            self.max_ns = self.max_ns.max(ns);
        }
    }
}

impl Sched {
    pub(crate) fn new(seed: u64) -> Sched {
        let ready_total = Rc::new(Cell::new(0));
        Sched {
            now: Cell::new(0),
            queue: RefCell::new(EventQueue::default()),
            seq: Cell::new(0),
            rng: RefCell::new(SmallRng::seed_from_u64(seed ^ 0x5eed_d3c0_de00_0001)),
            events: Cell::new(0),
            // Starts high so that differences taken with an offset (see
            // `rpc_overhead_ns`) never saturate at zero.
            cpu_ns: Cell::new(1 << 40),
            bg: RefCell::new(Background {
                tasks: Vec::new(),
                done: Vec::new(),
                wakers: Vec::new(),
            }),
            bg_ready: ReadyQueue::new(0, false, &ready_total),
            ready_total,
            frames: RefCell::new(Vec::new()),
            alone: Cell::new(0),
            held_jobs: RefCell::new(Vec::new()),
            frames_held: Cell::new(FramesHeld::default()),
            jobs_suspended: Cell::new(0),
            jobs_ended_waiters: RefCell::new(Vec::new()),
        }
    }

    /// A worker job suspended (`jobco`).
    pub(crate) fn job_suspended(&self) {
        self.jobs_suspended.set(self.jobs_suspended.get() + 1);
    }

    /// A suspended worker job ended (or was dropped): wakes the waiters of
    /// [`Sched::poll_jobs_ended`] when it was the last.
    pub(crate) fn job_ended(&self) {
        let left = self.jobs_suspended.get() - 1;
        self.jobs_suspended.set(left);
        if left == 0 {
            for w in self.jobs_ended_waiters.take() {
                w.wake();
            }
        }
    }

    /// Worker jobs suspended now.
    pub(crate) fn jobs_suspended(&self) -> usize {
        self.jobs_suspended.get()
    }

    /// Ready when no worker job is suspended.
    pub(crate) fn poll_jobs_ended(&self, cx: &mut Context<'_>) -> Poll<()> {
        if self.jobs_suspended.get() == 0 {
            Poll::Ready(())
        } else {
            self.jobs_ended_waiters
                .borrow_mut()
                .push(cx.waker().clone());
            Poll::Pending
        }
    }

    /// Frames held so far (see [`FramesHeld`]).
    pub(crate) fn frames_held(&self) -> FramesHeld {
        self.frames_held.get()
    }

    pub(crate) fn now(&self) -> u64 {
        self.now.get()
    }

    pub(crate) fn events(&self) -> u64 {
        self.events.get()
    }

    /// Events scheduled and not yet run (quiet ones included).
    pub(crate) fn pending_events(&self) -> usize {
        self.queue.borrow().len()
    }

    /// A seeded random number (jitter, fault choices). Inline: every
    /// message calls it for its jitter, and the usual case (none
    /// configured) is a short loop; the general case is out of line
    /// ([`Sched::random_range`]; branch i70).
    #[inline]
    pub(crate) fn random(&self, below: u64) -> u64 {
        match below {
            0 => 0,
            // The common case (every message draws its jitter, mostly with
            // none configured): `gen_range(0..1)` done the way rand 0.8
            // does it, without its general arithmetic, so that the
            // generator advances exactly as it did (checked against
            // `gen_range` by `random_below_one_draws_as_gen_range_does`).
            1 => {
                let mut rng = self.rng.borrow_mut();
                // For a range of one value, rand's rejection zone is the
                // draws below 2^63: it draws until one falls in it.
                while rng.next_u64() >> 63 != 0 {}
                0
            }
            _ => self.random_range(below),
        }
    }

    /// [`Sched::random`] for `below` of at least 2.
    #[inline(never)]
    fn random_range(&self, below: u64) -> u64 {
        self.rng.borrow_mut().gen_range(0..below)
    }

    /// Runs `ev` at virtual time `at` (not before now).
    pub(crate) fn at(&self, at: u64, ev: impl FnOnce() + 'static) {
        self.schedule(at, Event::Run(Box::new(ev)));
    }

    /// Runs `f` at virtual time `at` (not before now), after every other
    /// event of that instant, as an event the run cannot see: it draws no
    /// tie from the generator and the event count leaves it out. For a
    /// watchdog (the livelock limit, `super::Watch`) whose checks must not
    /// change the run they watch: runs with and without it, or with
    /// another limit, schedule every other event identically, and `f` wakes
    /// nobody unless the limit has passed.
    pub(crate) fn quiet_at(&self, at: u64, f: impl FnOnce() + 'static) {
        let at = at.max(self.now.get());
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        self.queue
            .borrow_mut()
            .push(at, u64::MAX, seq, Event::Quiet(Box::new(f)));
    }

    /// Wakes `waker` at virtual time `at`.
    #[inline]
    pub(crate) fn wake_at(&self, at: u64, waker: Waker) {
        self.schedule(at, Event::Wake(waker));
    }

    /// Runs the network event `ev` at virtual time `at` (not before now).
    #[inline]
    pub(crate) fn net_at(&self, at: u64, ev: super::net::NetEvent) {
        self.schedule(at, Event::Net(ev));
    }

    /// Queues `ev` at `at` (not before now) with the next tie and sequence
    /// number; every event draws one tie, in scheduling order.
    #[inline]
    fn schedule(&self, at: u64, ev: Event) {
        let at = at.max(self.now.get());
        let seq = self.seq.get();
        self.seq.set(seq + 1);
        let tie = self.rng.borrow_mut().r#gen::<u64>();
        self.queue.borrow_mut().push(at, tie, seq, ev);
    }

    /// Drops every pending event and background task (the simulation ends).
    pub(crate) fn clear(&self) {
        let events = self.queue.borrow_mut().clear();
        let tasks = std::mem::take(&mut self.bg.borrow_mut().tasks);
        drop(events);
        drop(tasks);
    }

    /// Runs the next event; false if there is none. `sim` is the
    /// simulation this scheduler belongs to (the network's events run on
    /// it: they do not each hold a reference to it).
    fn step(&self, sim: &Rc<super::Sim>) -> bool {
        let Some((e, ev)) = self.queue.borrow_mut().pop() else {
            return false;
        };
        debug_assert!(e.at() >= self.now.get(), "time went backwards");
        self.now.set(e.at());
        let ev = match ev {
            Event::Quiet(f) => {
                f();
                return true;
            }
            ev => ev,
        };
        self.events.set(self.events.get() + 1);
        match ev {
            Event::Wake(w) => w.wake(),
            Event::Net(n) => n.run(sim),
            Event::Run(f) | Event::Quiet(f) => f(),
        }
        true
    }

    /// Adds a background task, polled by whichever frame runs; returns its
    /// index.
    pub(crate) fn spawn_background(&self, fut: BgTask) -> usize {
        let mut bg = self.bg.borrow_mut();
        let index = bg.tasks.len();
        bg.tasks.push(Some(fut));
        bg.done.push(false);
        bg.wakers.push(Waker::from(Arc::new(TaskWaker {
            ready: self.bg_ready.clone(),
            index,
        })));
        self.bg_ready.push(index);
        index
    }

    /// Whether background task `index` finished.
    pub(crate) fn background_done(&self, index: usize) -> bool {
        self.bg.borrow().done.get(index).copied().unwrap_or(true)
    }

    pub(crate) fn background_count(&self) -> usize {
        self.bg.borrow().tasks.len()
    }

    /// Polls the background tasks that are ready; true if any was polled.
    /// The check for none, the usual case, is inline at the caller (the
    /// call and its frame cost ~28 instructions per frame poll).
    #[inline]
    fn poll_background(&self) -> bool {
        !self.bg_ready.is_empty() && self.poll_background_ready()
    }

    /// [`Sched::poll_background`] with tasks queued.
    #[inline(never)]
    fn poll_background_ready(&self) -> bool {
        let mut polled = false;
        let mut busy = Vec::new();
        while let Some(i) = self.bg_ready.pop() {
            let (task, waker) = {
                let mut bg = self.bg.borrow_mut();
                if bg.done[i] {
                    continue;
                }
                match bg.tasks[i].take() {
                    Some(t) => (t, bg.wakers[i].clone()),
                    // Being polled up the stack: it runs again there.
                    None => {
                        busy.push(i);
                        continue;
                    }
                }
            };
            polled = true;
            let mut task = task;
            let mut cx = Context::from_waker(&waker);
            let done = task.as_mut().poll(&mut cx).is_ready();
            let mut bg = self.bg.borrow_mut();
            if done {
                bg.done[i] = true;
            } else {
                bg.tasks[i] = Some(task);
            }
        }
        for i in busy {
            self.bg_ready.push(i);
        }
        polled
    }

    /// Runs `tasks` to completion in virtual time, with every event and
    /// background task the simulation has, and returns their outputs.
    ///
    /// Frames nest: synchronous code that waits (a worker job calling
    /// `block_on`) runs a frame inside the event or task that called it.
    /// Every frame on the stack is polled, not just the innermost, so that a
    /// compute task of an outer frame can release what the inner wait is for
    /// (invariant 4: a task is polled by one frame at a time; the one being
    /// polled up the stack is skipped and stays ready for its own frame).
    pub(crate) fn run_tasks<'a, T>(
        &self,
        sim: &Rc<super::Sim>,
        tasks: Vec<LocalTask<'a, T>>,
    ) -> Vec<T> {
        self.run_frame(sim, tasks, false)
    }

    /// [`Sched::run_tasks`] for a wait that only the network and timers can
    /// end (a handler's own one-sided verbs): events run, but no task of
    /// this or any other frame and no background task is polled, and no job
    /// starts on a simulated core (`hold_job`), until it is over. Code that
    /// holds a lock across such a wait then cannot meet code that wants the
    /// same lock on this one OS thread, which would never return. The frame
    /// is not registered: nothing else ever polls it.
    pub(crate) fn run_alone<'a, T>(&self, sim: &Rc<super::Sim>, task: LocalTask<'a, T>) -> T {
        self.alone.set(self.alone.get() + 1);
        let out = self
            .run_frame(sim, vec![task], true)
            .pop()
            .expect("one task");
        self.alone.set(self.alone.get() - 1);
        if self.alone.get() == 0 {
            let now = self.now.get();
            for job in self.held_jobs.take() {
                self.at(now, job);
            }
        }
        out
    }

    /// Whether a job about to start on a simulated core must wait for a
    /// wait on the network alone to end (see [`Sched::hold_job`]).
    pub(crate) fn holding_jobs(&self) -> bool {
        self.alone.get() > 0
    }

    /// Keeps a job that was due to start during a wait on the network alone
    /// until that wait is over. The waiting code may hold a lock the job
    /// would take (ScaleStore's re-poll task serves a parked request under
    /// a page's entry mutex and delivers the page; a handler of the same
    /// node then wants that mutex), and on one OS thread the job could not
    /// block until it is released. Its core stays reserved; it starts, a
    /// little late, at the instant the wait ends.
    pub(crate) fn hold_job(&self, job: Box<dyn FnOnce()>) {
        self.held_jobs.borrow_mut().push(job);
    }

    fn run_frame<'a, T>(
        &self,
        sim: &Rc<super::Sim>,
        tasks: Vec<LocalTask<'a, T>>,
        alone: bool,
    ) -> Vec<T> {
        super::without_local_count(|| self.run_frame_inner(sim, tasks, alone))
    }

    fn run_frame_inner<'a, T>(
        &self,
        sim: &Rc<super::Sim>,
        tasks: Vec<LocalTask<'a, T>>,
        alone: bool,
    ) -> Vec<T> {
        let n = tasks.len();
        let ready = ReadyQueue::new(n, true, &self.ready_total);
        let frame = Frame {
            wakers: wakers(&ready, 0, n),
            ready,
            tasks: RefCell::new(tasks.into_iter().map(Some).collect()),
            results: RefCell::new((0..n).map(|_| None).collect()),
            remaining: Cell::new(n),
            done_at: Cell::new(None),
        };
        // A frame pushed above another (the wait of a job, handler or other
        // simulated code) may be held; the outermost one is the harness's.
        let nested = !self.frames.borrow().is_empty();
        let _registered = (!alone).then(|| FrameRegistration::new(self, &frame));
        // Only the frame's own tasks are charged to the core of the code
        // that blocks here (if it runs on one).
        let mut own = super::OwnCoreOnly::enter(self);
        while frame.remaining.get() > 0 {
            let mut polled = false;
            if alone {
                if super::OwnCoreOnly::poll_own(&mut own, || frame.poll_ready()) {
                    continue;
                }
                if !self.step(sim) {
                    panic!(
                        "simulation deadlock at virtual time {} ns: a wait on the network \
                         alone has no event left to end it",
                        self.now.get()
                    );
                }
                continue;
            }
            // Nothing ready anywhere (the usual case between events): no
            // frame or background task would poll anything, so go straight
            // to the next event.
            if self.ready_total.get() > 0 {
                // Innermost first. Frames below this one stay registered
                // while it runs (nested frames push and pop above it), so
                // the indices stay valid across the polls.
                let depth = self.frames.borrow().len();
                for k in (0..depth).rev() {
                    let f = self.frames.borrow()[k];
                    // SAFETY: every registered frame lives on the stack below
                    // or at this call and unregisters itself (the
                    // registration guard) before it is dropped; frames are
                    // used on this thread only.
                    let f = unsafe { &*f };
                    // Ours is the innermost (registered last).
                    polled |= if k + 1 == depth {
                        super::OwnCoreOnly::poll_own(&mut own, || f.poll_ready())
                    } else {
                        // An outer frame whose last task completes here
                        // cannot return before this one does: held from now.
                        let any = f.poll_ready();
                        if any {
                            f.note_done(self.now.get());
                        }
                        any
                    };
                }
                polled |= self.poll_background();
                if frame.remaining.get() == 0 {
                    break;
                }
                if polled {
                    continue;
                }
            }
            if !self.step(sim) {
                panic!(
                    "simulation deadlock at virtual time {} ns: {} of {n} tasks wait and no \
                     event is scheduled (a task waits for something nothing will do)",
                    self.now.get(),
                    frame.remaining.get()
                );
            }
        }
        frame.ready.close();
        if let Some(at) = frame.done_at.get().filter(|_| nested) {
            let mut held = self.frames_held.get();
            held.record(self.now.get() - at);
            self.frames_held.set(held);
        }
        frame
            .results
            .into_inner()
            .into_iter()
            .map(|r| r.expect("every task completed"))
            .collect()
    }
}

type LocalTask<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// The tasks of one `run_tasks` call.
struct Frame<'a, T> {
    ready: Arc<ReadyQueue>,
    wakers: Vec<Waker>,
    /// A slot is `None` while its task is being polled (up the stack).
    tasks: RefCell<Vec<Option<LocalTask<'a, T>>>>,
    results: RefCell<Vec<Option<T>>>,
    remaining: Cell<usize>,
    /// The instant its last task completed in a poll made by a frame above
    /// it (which it must wait for before it can return; `FramesHeld`).
    done_at: Cell<Option<u64>>,
}

/// What the scheduler needs of a frame, whatever its output type.
trait PollFrame {
    /// Polls the frame's ready tasks; true if any was polled.
    fn poll_ready(&self) -> bool;
    /// Records `now` as the instant the frame's tasks were all done, if
    /// they are and none was recorded yet.
    fn note_done(&self, now: u64);
}

impl<T> PollFrame for Frame<'_, T> {
    fn poll_ready(&self) -> bool {
        let mut polled = false;
        let mut busy = Vec::new();
        while let Some(i) = self.ready.pop() {
            if self.results.borrow()[i].is_some() {
                continue;
            }
            let Some(mut task) = self.tasks.borrow_mut()[i].take() else {
                // Being polled further up the stack: its own frame polls it
                // again when that poll returns.
                busy.push(i);
                continue;
            };
            polled = true;
            let mut cx = Context::from_waker(&self.wakers[i]);
            match task.as_mut().poll(&mut cx) {
                Poll::Ready(v) => {
                    self.results.borrow_mut()[i] = Some(v);
                    self.remaining.set(self.remaining.get() - 1);
                }
                Poll::Pending => self.tasks.borrow_mut()[i] = Some(task),
            }
        }
        for i in busy {
            self.ready.push(i);
        }
        polled
    }

    fn note_done(&self, now: u64) {
        if self.remaining.get() == 0 && self.done_at.get().is_none() {
            self.done_at.set(Some(now));
        }
    }
}

/// A registered frame, its lifetime erased (see `FrameRegistration`).
type FramePtr = *const (dyn PollFrame + 'static);

/// Keeps a frame in the scheduler's stack of frames while it runs.
struct FrameRegistration<'s> {
    sched: &'s Sched,
}

impl<'s> FrameRegistration<'s> {
    fn new<'f>(sched: &'s Sched, frame: &'f (dyn PollFrame + 'f)) -> FrameRegistration<'s> {
        let ptr: *const (dyn PollFrame + 'f) = frame;
        // SAFETY: only the lifetime is changed. The pointer is removed from
        // the stack when this registration drops, which happens before the
        // frame it points to (declared earlier in `run_tasks`) is dropped,
        // also when unwinding; it is never dereferenced after that.
        let ptr: FramePtr =
            unsafe { std::mem::transmute::<*const (dyn PollFrame + 'f), FramePtr>(ptr) };
        sched.frames.borrow_mut().push(ptr);
        FrameRegistration { sched }
    }
}

impl Drop for FrameRegistration<'_> {
    fn drop(&mut self) {
        self.sched.frames.borrow_mut().pop();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BinaryHeap;

    /// `random(1)`'s shortcut leaves the generator where `gen_range(0..1)`
    /// leaves it (the oracle), so that every later draw is the same.
    #[test]
    fn random_below_one_draws_as_gen_range_does() {
        for seed in 0..200 {
            let sched = Sched::new(seed);
            let mut oracle = SmallRng::seed_from_u64(seed ^ 0x5eed_d3c0_de00_0001);
            for k in 0..50u64 {
                assert_eq!(sched.random(1), 0);
                assert_eq!(oracle.gen_range(0..1u64), 0);
                // Interleave other draws, as the simulation does.
                let below = 2 + k * 977;
                assert_eq!(sched.random(below), oracle.gen_range(0..below));
            }
            assert_eq!(sched.rng.borrow_mut().next_u64(), oracle.next_u64());
        }
    }

    /// A ready queue (no lock, [`ThreadBound`]) is used on its own thread
    /// only: a wake from another thread panics there before it touches the
    /// queue, and the queue's last reference dropped on another thread
    /// leaves its contents alone (leaked) instead of dropping them there.
    #[test]
    fn a_ready_queue_is_used_on_its_own_thread_only() {
        let total = Rc::new(Cell::new(0));
        let q = ReadyQueue::new(3, false, &total);
        q.push(2);
        q.push(2);
        q.push(0);
        assert_eq!(total.get(), 2);
        let waker = Waker::from(Arc::new(TaskWaker {
            ready: q.clone(),
            index: 1,
        }));
        let woken = std::thread::spawn(move || waker.wake()).join();
        assert!(woken.is_err(), "a wake from another thread panics");
        // Nothing was queued by it.
        assert_eq!(total.get(), 2);
        assert_eq!((q.pop(), q.pop(), q.pop()), (Some(2), Some(0), None));
        assert_eq!(total.get(), 0);
        // The same wake on this thread queues the task.
        let waker = Waker::from(Arc::new(TaskWaker {
            ready: q.clone(),
            index: 1,
        }));
        waker.wake_by_ref();
        assert_eq!((total.get(), q.pop()), (1, Some(1)));
        // The total's count of references shows whether the queue's
        // contents were dropped: another thread drops the last reference
        // to the queue (through the waker) and leaves them alone.
        q.close();
        drop(q);
        assert_eq!(Rc::strong_count(&total), 2);
        std::thread::spawn(move || drop(waker))
            .join()
            .expect("no panic on drop");
        assert_eq!(
            Rc::strong_count(&total),
            2,
            "leaked, not dropped off its thread"
        );
        // On its own thread the last reference drops the contents.
        let q = ReadyQueue::new(1, true, &total);
        assert_eq!(Rc::strong_count(&total), 3);
        drop(q);
        assert_eq!(Rc::strong_count(&total), 2);
    }

    /// The event queue (wheel and heap) pops exactly what a standard binary
    /// heap on the (time, tie, seq) order pops (the oracle), across
    /// interleaved pushes and pops with many equal times and some equal
    /// ties, as the scheduler's queue sees them, with entries due within
    /// the wheel, beyond it and both.
    #[test]
    fn the_event_queue_pops_in_time_tie_seq_order() {
        let mut rng = SmallRng::seed_from_u64(42);
        for round in 0..60 {
            let mut q: EventQueue<u32> = EventQueue::default();
            let mut oracle = BinaryHeap::new();
            let mut seq = 0u64;
            let mut now = 0u64;
            // Each entry carries a unique payload (its id), so that the
            // oracle also checks that every pop returns the payload pushed
            // with its entry.
            let mut next_id = 0u32;
            for _ in 0..2000 {
                if rng.gen_range(0..3) > 0 || oracle.is_empty() {
                    // Spreads within the wheel, across its end and far
                    // beyond it (the heap), and a mix of near and far.
                    let spread = [4, 50, 1000, 20_000, 100_000, 0][round % 6];
                    let spread = if spread == 0 {
                        if rng.gen_range(0..4) == 0 {
                            50_000
                        } else {
                            100
                        }
                    } else {
                        spread
                    };
                    let at = now + rng.gen_range(0..spread);
                    // Few distinct ties, so that equal (time, tie) pairs
                    // occur and `seq` must settle them.
                    let tie = if (round / 6) % 2 == 0 {
                        rng.gen_range(0..3)
                    } else {
                        rng.r#gen::<u64>()
                    };
                    let id = next_id;
                    next_id += 1;
                    q.push(at, tie, seq, id);
                    oracle.push(std::cmp::Reverse((at, tie, seq, id)));
                    seq += 1;
                } else {
                    let (e, id) = q.pop().expect("not empty");
                    let std::cmp::Reverse(o) = oracle.pop().expect("not empty");
                    assert_eq!((e.at(), e.key as u64, e.seq, id), o);
                    now = e.at();
                }
            }
            while let Some(std::cmp::Reverse(o)) = oracle.pop() {
                let (e, id) = q.pop().expect("as many entries as the oracle");
                assert_eq!((e.at(), e.key as u64, e.seq, id), o);
            }
            assert!(q.pop().is_none());
        }
    }
}
