//! The state word of a `local` RPC's reply slot (see `local_rpc`), kept
//! apart so that loom can check its protocol with the real code.
//!
//! Three parties touch a slot: the caller's thread (it sends the request,
//! polls for the reply, registers its task's waker and reuses the slot),
//! the thread that answers (a handler thread, or any thread for a deferred
//! service or a crash drain) and the cluster's watchdog thread (it wakes a
//! waiting caller once per tick so it can time out). The slot's other
//! fields are plain memory; the word says who owns them:
//!
//! - **S1 (body).** The reply body belongs to the answerer while `SENT` is
//!   set and neither `REPLY` nor `DROPPED` is; it belongs to the caller
//!   otherwise. The answerer writes it and then sets `REPLY` with release
//!   ordering; the caller reads it after seeing `REPLY` with acquire
//!   ordering.
//! - **S2 (waker).** The waker field is written only by the caller, and only
//!   while `WAKER` and `WATCH` are clear; with `WAKER` set it is read-only,
//!   and the answerer wakes it only if its own update (the one that sets
//!   `REPLY`) found `WAKER` set. So a waker is registered with one
//!   compare-exchange that fails if the reply came first (the caller then
//!   takes the reply), and a reply never misses a registered waker: no lost
//!   wake-up. The waker stays in the slot across RPCs (re-registered only if
//!   the task's waker changed: `register` looks at it also when `WAKER` is
//!   clear, as it is at the start of every RPC, branch i91), so waking it
//!   costs no reference count, and registering it none either.
//! - **S3 (reuse).** The answerer sets `HDONE` when it no longer touches the
//!   slot (at once if there was no waker to wake, else after waking it); the
//!   watchdog clears `WATCH` when it no longer does. The caller reuses a slot
//!   only with `HDONE` set and `WATCH` clear, and nobody else changes the
//!   word then, so reuse is a plain store.
//! - **S4 (watchdog).** The watchdog wakes a waiting caller only after
//!   moving `WAKER` to `WATCH` with a compare-exchange (so the caller cannot
//!   replace the waker meanwhile, and the answerer, finding `WAKER` clear,
//!   does not wake it too).

#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, Ordering};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, Ordering};

/// A request is out and not answered yet.
pub(crate) const SENT: u64 = 1;
/// The caller registered a waker (S2).
pub(crate) const WAKER: u64 = 2;
/// The reply is in the body.
pub(crate) const REPLY: u64 = 4;
/// The request was dropped unanswered (its node went down).
pub(crate) const DROPPED: u64 = 8;
/// The answerer is done with the slot (S3).
pub(crate) const HDONE: u64 = 16;
/// The watchdog is waking the caller (S4).
pub(crate) const WATCH: u64 = 32;
/// Bits below the sequence number.
const SEQ_SHIFT: u32 = 8;

/// The state word of one reply slot.
pub(crate) struct ReplyState(AtomicU64);

/// What [`ReplyState::register`] found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Registered {
    /// The waker is registered (or the registered one still fits): wait.
    Waiting,
    /// The reply (or drop notice) is there: take it.
    Answered,
    /// The watchdog is waking the task right now: poll again later.
    Busy,
}

impl ReplyState {
    /// A never-used slot: free for its first RPC.
    pub(crate) fn new() -> ReplyState {
        ReplyState(AtomicU64::new(HDONE))
    }

    /// Whether the caller may reuse the slot (S3).
    pub(crate) fn reusable(&self) -> bool {
        let s = self.0.load(Ordering::Acquire);
        s & HDONE != 0 && s & WATCH == 0
    }

    /// Caller: starts the next RPC on a [`ReplyState::reusable`] slot; its
    /// sequence number. The request carrying the slot's index is published
    /// afterwards with release ordering, which orders this store before the
    /// answerer's first look.
    pub(crate) fn begin(&self) -> u64 {
        let seq = (self.0.load(Ordering::Relaxed) >> SEQ_SHIFT) + 1;
        self.0.store(seq << SEQ_SHIFT | SENT, Ordering::Relaxed);
        seq
    }

    /// The sequence number of the RPC now on the slot (a debug check's).
    #[cfg(any(debug_assertions, test))]
    pub(crate) fn seq(&self) -> u64 {
        self.0.load(Ordering::Relaxed) >> SEQ_SHIFT
    }

    /// Caller: whether the RPC is answered (the body is the caller's, S1);
    /// `Some(true)` for a reply, `Some(false)` for a drop.
    pub(crate) fn answered(&self) -> Option<bool> {
        let s = self.0.load(Ordering::Acquire);
        if s & REPLY != 0 {
            Some(true)
        } else if s & DROPPED != 0 {
            Some(false)
        } else {
            None
        }
    }

    /// Caller: registers the task's waker (S2). `fits` says whether the
    /// waker in the slot wakes the polling task (called only while the
    /// field is read-only or the caller's); `store` writes the polling
    /// task's waker into the slot (called only while the caller owns the
    /// field, and only if the waker there does not fit).
    pub(crate) fn register(&self, fits: impl Fn() -> bool, store: impl FnOnce()) -> Registered {
        let mut s = self.0.load(Ordering::Acquire);
        loop {
            if s & (REPLY | DROPPED) != 0 {
                return Registered::Answered;
            }
            if s & WATCH != 0 {
                return Registered::Busy;
            }
            if s & WAKER == 0 {
                break;
            }
            if fits() {
                return Registered::Waiting;
            }
            // Take the field back to replace the waker.
            match self
                .0
                .compare_exchange(s, s & !WAKER, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    s &= !WAKER;
                    break;
                }
                Err(now) => s = now,
            }
        }
        // WAKER and WATCH are clear: the field is the caller's. The waker
        // left in it by the slot's last RPC is kept if it still fits (branch
        // i91): `begin` clears WAKER for every RPC, so this is the common
        // case, a task getting back the slot it just gave up, and a waker
        // replaced on every RPC (a clone and a drop) was the rule before.
        if !fits() {
            store();
        }
        match self
            .0
            .compare_exchange(s, s | WAKER, Ordering::AcqRel, Ordering::Acquire)
        {
            Ok(_) => Registered::Waiting,
            // Only the answerer changes the word now (the watchdog acts on
            // WAKER alone): the reply came.
            Err(_) => Registered::Answered,
        }
    }

    /// Answerer: the body is written; publishes `REPLY` (or `DROPPED` with
    /// `reply` false). Returns whether a waker must be woken, after which
    /// the answerer calls [`ReplyState::release`]; otherwise it is done.
    pub(crate) fn answer(&self, reply: bool) -> bool {
        let bit = if reply { REPLY } else { DROPPED };
        let mut s = self.0.load(Ordering::Relaxed);
        loop {
            debug_assert!(
                s & SENT != 0 && s & (REPLY | DROPPED) == 0,
                "answered twice"
            );
            let wake = s & WAKER != 0;
            let new = if wake { s | bit } else { s | bit | HDONE };
            match self
                .0
                .compare_exchange_weak(s, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => return wake,
                Err(now) => s = now,
            }
        }
    }

    /// Answerer: done with the slot after waking its waker (S3).
    pub(crate) fn release(&self) {
        self.0.fetch_or(HDONE, Ordering::Release);
    }

    /// Watchdog: claims the waker of an RPC still waiting (S4); if true the
    /// watchdog wakes it and then calls [`ReplyState::unwatch`].
    pub(crate) fn watch(&self) -> bool {
        let s = self.0.load(Ordering::Acquire);
        s & SENT != 0
            && s & WAKER != 0
            && s & (REPLY | DROPPED) == 0
            && self
                .0
                .compare_exchange(s, (s & !WAKER) | WATCH, Ordering::AcqRel, Ordering::Relaxed)
                .is_ok()
    }

    /// Watchdog: done with the waker.
    pub(crate) fn unwatch(&self) {
        self.0.fetch_and(!WATCH, Ordering::Release);
    }
}

#[cfg(all(test, loom))]
#[allow(unsafe_code)]
mod loom_tests {
    //! `RUSTFLAGS="--cfg loom" cargo test -p dmkv-transport --release --lib loom`
    //!
    //! SAFETY (every `unsafe` block below): loom's cells are accessed under
    //! the protocol being checked; an access that breaks it is what loom
    //! reports, as a data race, instead of undefined behaviour.
    use super::*;
    use loom::cell::UnsafeCell;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicUsize;

    /// A slot as `local_rpc` has it: the word, a body and a waker field
    /// (loom's cells report any access that breaks S1 or S2 as a race).
    struct Slot {
        state: ReplyState,
        body: UnsafeCell<u64>,
        /// Which waker is registered (an id; 0: none).
        waker: UnsafeCell<usize>,
        /// Wake-ups delivered, per waker id.
        woken: [AtomicUsize; 3],
    }

    fn slot() -> Arc<Slot> {
        Arc::new(Slot {
            state: ReplyState::new(),
            body: UnsafeCell::new(0),
            waker: UnsafeCell::new(0),
            woken: Default::default(),
        })
    }

    fn answer(s: &Slot, value: u64) {
        s.body.with_mut(|b| unsafe { *b = value });
        if s.state.answer(true) {
            let w = s.waker.with(|w| unsafe { *w });
            s.woken[w].fetch_add(1, Ordering::SeqCst);
            s.state.release();
        }
    }

    /// The caller registers waker `id`; true if the reply is already there.
    fn register(s: &Slot, id: usize) -> bool {
        let fits = || s.waker.with(|w| unsafe { *w }) == id;
        let store = || s.waker.with_mut(|w| unsafe { *w = id });
        match s.state.register(fits, store) {
            Registered::Answered => true,
            Registered::Waiting | Registered::Busy => false,
        }
    }

    /// A reply racing the caller's registration is never lost: either the
    /// caller sees it, or the answerer wakes the registered waker; the body
    /// is never read while written (loom's cell checks it).
    #[test]
    fn a_reply_racing_registration_is_never_lost() {
        loom::model(|| {
            let s = slot();
            s.state.begin();
            let a = s.clone();
            let answerer = loom::thread::spawn(move || answer(&a, 7));
            let answered = register(&s, 1);
            answerer.join().unwrap();
            if !answered {
                assert_eq!(s.woken[1].load(Ordering::SeqCst), 1, "lost wake-up");
            }
            assert_eq!(s.state.answered(), Some(true));
            assert_eq!(s.body.with(|b| unsafe { *b }), 7);
            assert!(s.state.reusable());
        });
    }

    /// The watchdog, a waker change and the reply all at once: the waker is
    /// never written while read, a registered caller is woken by the
    /// answerer or the watchdog, and the slot becomes reusable.
    #[test]
    fn watchdog_and_waker_change_race_the_reply() {
        loom::model(|| {
            let s = slot();
            s.state.begin();
            assert!(!register(&s, 1));
            let a = s.clone();
            let answerer = loom::thread::spawn(move || answer(&a, 9));
            let w = s.clone();
            let watchdog = loom::thread::spawn(move || {
                if w.state.watch() {
                    let id = w.waker.with(|x| unsafe { *x });
                    w.woken[id].fetch_add(1, Ordering::SeqCst);
                    w.state.unwatch();
                }
            });
            // The task is polled with another waker.
            let answered = register(&s, 2);
            answerer.join().unwrap();
            watchdog.join().unwrap();
            let woken: usize = s.woken.iter().map(|w| w.load(Ordering::SeqCst)).sum();
            assert!(answered || woken >= 1, "nobody woke the caller");
            assert_eq!(s.state.answered(), Some(true));
            assert!(s.state.reusable());
        });
    }
}
