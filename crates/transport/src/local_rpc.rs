//! Where the `local` backend's RPC replies land, and how a caller that gets
//! none times out, at a fixed small cost per RPC.
//!
//! Each RPC in flight owns a [`ReplySlot`] of its endpoint: the handler
//! thread leaves the reply there and wakes the calling task. Slots are
//! pooled per endpoint and reused, so an RPC allocates no channel (a
//! `oneshot` per RPC cost an allocation and two lock-protected hand-offs).
//!
//! Timeouts need no clock read and no timer entry per RPC (a timer-heap
//! entry per RPC cost ~580 instructions and stayed in the heap for the whole
//! timeout, 30 s by default). Instead one watchdog thread per cluster ticks
//! every endpoint's [`Watchdog`] once per `rpc_timeout / TICKS`; an RPC
//! records the tick count when it is sent and fails with a timeout once
//! `TICKS + 1` ticks have passed.
//!
//! Invariants:
//! 1. A slot answers one RPC at a time: its sequence number changes whenever
//!    it is handed to a new RPC, and a reply (or a drop notice) whose
//!    sequence number is not the slot's current one is discarded, so a late
//!    reply to an RPC that timed out never reaches a later RPC.
//! 2. The reply, the state and the waker of a slot change only under the
//!    slot's lock; the handler takes the waker out under the lock and wakes
//!    it after releasing it, so once the caller sees the reply the handler
//!    no longer touches the slot's contents and the slot can be reused at
//!    once.
//! 3. Ticks are at least `period` apart (the watchdog thread waits a full
//!    period between ticks), and the first tick after an RPC was sent comes
//!    after it was sent, so an RPC that times out waited at least
//!    `TICKS * period = rpc_timeout` and, ticks being at most a period plus
//!    scheduling delay apart, about `(TICKS + 1) / TICKS * rpc_timeout` at
//!    most.
//! 4. A request dropped without a reply (its node crashed and its queue was
//!    drained) answers the caller with `NodeDown`, as a dropped channel did.

use crate::addr::NodeId;
use crate::error::{Result, TransportError};
use crate::service::Reply;
use parking_lot::{Condvar, Mutex};
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::task::{Context, Poll, Waker};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Watchdog ticks per `rpc_timeout`: an RPC times out after `TICKS + 1`
/// ticks, i.e. after between 1 and `1 + 1 / TICKS` timeouts.
pub(crate) const TICKS: u64 = 4;

enum SlotState {
    /// No RPC uses the slot.
    Idle,
    /// The RPC with the slot's sequence number waits for its reply.
    Waiting,
    Done(Reply),
    /// The request was dropped unanswered (its node went down).
    Dropped,
}

struct SlotInner {
    seq: u64,
    state: SlotState,
    waker: Option<Waker>,
}

/// One RPC's reply, on its way from a handler thread to the calling task.
pub(crate) struct ReplySlot {
    inner: Mutex<SlotInner>,
}

impl ReplySlot {
    fn new() -> ReplySlot {
        ReplySlot {
            inner: Mutex::new(SlotInner {
                seq: 0,
                state: SlotState::Idle,
                waker: None,
            }),
        }
    }

    /// Ends RPC `seq` with `state` (a reply or a drop), if it still waits.
    fn complete(&self, seq: u64, state: SlotState) {
        let waker = {
            let mut g = self.inner.lock();
            if g.seq != seq || !matches!(g.state, SlotState::Waiting) {
                return; // invariant 1: a stale reply
            }
            g.state = state;
            g.waker.take()
        };
        if let Some(w) = waker {
            w.wake();
        }
    }

    /// Wakes the task waiting on this slot, if any (a watchdog tick).
    fn wake_waiting(&self) {
        let waker = {
            let mut g = self.inner.lock();
            match g.state {
                SlotState::Waiting => g.waker.take(),
                _ => None,
            }
        };
        if let Some(w) = waker {
            w.wake();
        }
    }
}

/// The handler's side of one RPC: send the reply through it. Dropping it
/// unsent answers the caller with `NodeDown` (invariant 4).
pub(crate) struct ReplyTo {
    slot: Arc<ReplySlot>,
    seq: u64,
    sent: bool,
}

impl ReplyTo {
    pub(crate) fn send(mut self, reply: Reply) {
        self.sent = true;
        self.slot.complete(self.seq, SlotState::Done(reply));
    }
}

impl Drop for ReplyTo {
    fn drop(&mut self) {
        if !self.sent {
            self.slot.complete(self.seq, SlotState::Dropped);
        }
    }
}

/// Ticks once per period; shared between an endpoint and the cluster's
/// watchdog thread.
pub(crate) struct Watchdog {
    ticks: AtomicU64,
    /// Every slot of the endpoint (it only grows, to the endpoint's most
    /// RPCs in flight at once).
    slots: Mutex<Vec<Arc<ReplySlot>>>,
}

impl Watchdog {
    fn tick(&self) {
        self.ticks.fetch_add(1, Ordering::AcqRel);
        for s in self.slots.lock().iter() {
            s.wake_waiting();
        }
    }
}

/// An endpoint's reply slots (used on the endpoint's thread only).
pub(crate) struct RpcSlots {
    slots: RefCell<Vec<Arc<ReplySlot>>>,
    free: RefCell<Vec<usize>>,
    watchdog: Arc<Watchdog>,
}

impl RpcSlots {
    /// Slots for a new endpoint, ticked by `reaper`.
    pub(crate) fn new(reaper: &Reaper) -> RpcSlots {
        let watchdog = Arc::new(Watchdog {
            ticks: AtomicU64::new(0),
            slots: Mutex::new(Vec::new()),
        });
        reaper.watch(&watchdog);
        RpcSlots {
            slots: RefCell::new(Vec::new()),
            free: RefCell::new(Vec::new()),
            watchdog,
        }
    }

    /// Takes a slot for a new RPC to `node`: the handler's side to put in
    /// the request, and the caller's future.
    pub(crate) fn begin(&self, node: NodeId) -> (ReplyTo, ReplyWait<'_>) {
        let index = match self.free.borrow_mut().pop() {
            Some(i) => i,
            None => {
                let slot = Arc::new(ReplySlot::new());
                self.watchdog.slots.lock().push(slot.clone());
                let mut slots = self.slots.borrow_mut();
                slots.push(slot);
                slots.len() - 1
            }
        };
        let slot = self.slots.borrow()[index].clone();
        let seq = {
            let mut g = slot.inner.lock();
            g.seq += 1;
            g.state = SlotState::Waiting;
            g.waker = None;
            g.seq
        };
        let wait = ReplyWait {
            pool: self,
            index,
            seq,
            sent_at_tick: self.watchdog.ticks.load(Ordering::Acquire),
            node,
            answered: false,
        };
        (
            ReplyTo {
                slot,
                seq,
                sent: false,
            },
            wait,
        )
    }
}

/// The caller's side of one RPC: resolves to the reply, `NodeDown` if the
/// request was dropped, or `Timeout`. Dropping it early (the caller gave up)
/// discards a later reply.
pub(crate) struct ReplyWait<'a> {
    pool: &'a RpcSlots,
    index: usize,
    seq: u64,
    sent_at_tick: u64,
    node: NodeId,
    /// The reply (or drop notice) was taken: the slot is idle and holds no
    /// waker (the handler took it out), so dropping need not lock it.
    answered: bool,
}

impl Future for ReplyWait<'_> {
    type Output = Result<Reply>;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Reply>> {
        let this = self.get_mut();
        let slots = this.pool.slots.borrow();
        let mut g = slots[this.index].inner.lock();
        debug_assert_eq!(g.seq, this.seq, "a slot serves one RPC at a time");
        match std::mem::replace(&mut g.state, SlotState::Idle) {
            SlotState::Done(reply) => {
                this.answered = true;
                Poll::Ready(Ok(reply))
            }
            SlotState::Dropped => {
                this.answered = true;
                Poll::Ready(Err(TransportError::NodeDown(this.node)))
            }
            SlotState::Idle => unreachable!("a waiting RPC's slot is not idle"),
            SlotState::Waiting => {
                let ticks = this.pool.watchdog.ticks.load(Ordering::Acquire);
                if ticks.wrapping_sub(this.sent_at_tick) > TICKS {
                    // Invariant 3: at least `rpc_timeout` since the send.
                    return Poll::Ready(Err(TransportError::Timeout { node: this.node }));
                }
                g.state = SlotState::Waiting;
                match &mut g.waker {
                    Some(w) if w.will_wake(cx.waker()) => {}
                    w => *w = Some(cx.waker().clone()),
                }
                Poll::Pending
            }
        }
    }
}

impl Drop for ReplyWait<'_> {
    fn drop(&mut self) {
        // Answered: `complete` took the waker out and the poll left the slot
        // idle (invariant 2), so there is nothing to reset.
        if !self.answered {
            let slots = self.pool.slots.borrow();
            let mut g = slots[self.index].inner.lock();
            if g.seq == self.seq {
                // Given up or finished: a reply arriving now is stale.
                g.state = SlotState::Idle;
                g.waker = None;
            }
        }
        self.pool.free.borrow_mut().push(self.index);
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
    use crate::exec::block_on;

    fn reply(byte: u8) -> Reply {
        Reply {
            result: Ok(vec![byte]),
            server_cpu_ns: 1,
        }
    }

    #[test]
    fn replies_reach_their_own_rpc_and_slots_are_reused() {
        let (reaper, h) = Reaper::start(Duration::from_secs(30));
        let slots = RpcSlots::new(&reaper);
        let (to, wait) = slots.begin(NodeId(1));
        std::thread::spawn(move || to.send(reply(7)))
            .join()
            .unwrap();
        assert_eq!(block_on(wait).unwrap(), reply(7));
        // The next RPC reuses the slot; a reply for the old one is stale.
        let (to2, wait2) = slots.begin(NodeId(1));
        assert_eq!(slots.slots.borrow().len(), 1, "the slot was reused");
        let stale = ReplyTo {
            slot: slots.slots.borrow()[0].clone(),
            seq: to2.seq - 1,
            sent: false,
        };
        stale.send(reply(1));
        to2.send(reply(2));
        assert_eq!(block_on(wait2).unwrap(), reply(2));
        // Two RPCs in flight at once take two slots.
        let (a, wa) = slots.begin(NodeId(1));
        let (b, wb) = slots.begin(NodeId(1));
        b.send(reply(4));
        a.send(reply(3));
        assert_eq!(block_on(wb).unwrap(), reply(4));
        assert_eq!(block_on(wa).unwrap(), reply(3));
        reaper.shut_down();
        h.join().unwrap();
    }

    #[test]
    fn a_dropped_request_is_node_down() {
        let (reaper, h) = Reaper::start(Duration::from_secs(30));
        let slots = RpcSlots::new(&reaper);
        let (to, wait) = slots.begin(NodeId(3));
        drop(to);
        assert!(matches!(
            block_on(wait),
            Err(TransportError::NodeDown(NodeId(3)))
        ));
        reaper.shut_down();
        h.join().unwrap();
    }

    #[test]
    fn an_unanswered_rpc_times_out_after_the_timeout_and_a_late_reply_is_discarded() {
        let timeout = Duration::from_millis(40);
        let (reaper, h) = Reaper::start(timeout);
        let slots = RpcSlots::new(&reaper);
        let (to, wait) = slots.begin(NodeId(2));
        let start = Instant::now();
        assert!(matches!(
            block_on(wait),
            Err(TransportError::Timeout { node: NodeId(2) })
        ));
        assert!(start.elapsed() >= timeout, "waited {:?}", start.elapsed());
        // The late reply lands nowhere: the next RPC gets its own.
        let (to2, wait2) = slots.begin(NodeId(2));
        to.send(reply(9));
        to2.send(reply(5));
        assert_eq!(block_on(wait2).unwrap(), reply(5));
        reaper.shut_down();
        h.join().unwrap();
    }
}
