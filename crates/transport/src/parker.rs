//! The wake-up handshake between an executor thread and the wakers of its
//! tasks, kept apart so that loom can check it.
//!
//! The executor clears the flag, polls ready tasks, and when none was ready
//! calls [`Parker::park`]. A waker on any thread calls [`Parker::notify`].
//! Invariant: a notify that happens after the executor cleared the flag is
//! never lost — either `park` sees it and returns at once, or `notify` sees
//! the thread parked and unparks it.

#[cfg(loom)]
use loom::sync::atomic::{AtomicU8, Ordering};
#[cfg(loom)]
use loom::thread::{self, Thread};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU8, Ordering};
#[cfg(not(loom))]
use std::thread::{self, Thread};

const EMPTY: u8 = 0;
const NOTIFIED: u8 = 1;
const PARKED: u8 = 2;

/// One state word changed only by read-modify-write operations, which are
/// totally ordered, so no interleaving of `notify` and `park` loses a wake-up
/// (two flags with separate loads and stores would need sequentially
/// consistent fences to rule out both sides reading stale values).
pub(crate) struct Parker {
    state: AtomicU8,
    thread: Thread,
}

impl Parker {
    /// A parker for the calling thread, initially notified.
    pub(crate) fn new() -> Parker {
        Parker {
            state: AtomicU8::new(NOTIFIED),
            thread: thread::current(),
        }
    }

    /// Marks work as available and wakes the thread if it is parked.
    pub(crate) fn notify(&self) {
        if self.state.swap(NOTIFIED, Ordering::AcqRel) == PARKED {
            self.thread.unpark();
        }
    }

    /// Clears the flag before a round of polling; returns whether it was set.
    pub(crate) fn take(&self) -> bool {
        self.state.swap(EMPTY, Ordering::AcqRel) == NOTIFIED
    }

    /// Whether a notify happened since the last `take`.
    pub(crate) fn is_notified(&self) -> bool {
        self.state.load(Ordering::Acquire) == NOTIFIED
    }

    /// Parks until notified. Outside loom it also returns after a safety
    /// timeout (the caller re-checks its tasks either way). Returns whether
    /// the thread parked and no notify came while it was parked (it ended
    /// by its timeout, or spuriously).
    pub(crate) fn park(&self) -> bool {
        self.park_at_most(std::time::Duration::from_millis(10))
    }

    /// [`Parker::park`], returning after `timeout` at the latest outside
    /// loom (the executor parks until its earliest short sleep is due).
    pub(crate) fn park_at_most(&self, timeout: std::time::Duration) -> bool {
        if self
            .state
            .compare_exchange(EMPTY, PARKED, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return false; // notified meanwhile
        }
        #[cfg(loom)]
        while self.state.load(Ordering::Acquire) == PARKED {
            thread::park();
        }
        #[cfg(not(loom))]
        thread::park_timeout(timeout);
        #[cfg(loom)]
        let _ = timeout;
        // Back to EMPTY unless a notify arrived (then keep NOTIFIED). Still
        // PARKED: nobody notified during the park.
        self.state
            .compare_exchange(PARKED, EMPTY, Ordering::AcqRel, Ordering::Acquire)
            .is_ok()
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::Parker;
    use loom::sync::Arc;

    /// A notify racing the executor's take/park is never lost: if it were,
    /// `park` would block forever and loom would report a deadlock.
    #[test]
    fn notify_is_never_lost() {
        loom::model(|| {
            let p = Arc::new(Parker::new());
            p.take();
            let q = p.clone();
            let waker = loom::thread::spawn(move || q.notify());
            // The executor found nothing ready and goes to sleep.
            while !p.is_notified() {
                p.park();
            }
            waker.join().unwrap();
        });
    }

    /// The executor's loop as `exec::run_tasks` runs it for one task,
    /// with the task's ready flag and its waker on another thread: the
    /// parker starts notified and not taken (as `Parker::new` makes it);
    /// the executor takes the flag, swaps the task's ready flag, and parks
    /// when it found nothing ready; the waker sets the ready flag and
    /// notifies. Passing proves that no interleaving leaves the executor
    /// parked with the task ready (loom explores every interleaving and
    /// reports a thread parked for ever as a deadlock; outside loom the
    /// 10 ms safety timeout would hide such a loss, here `park` has none).
    ///
    /// The waker sets its ready flag with a swap, as `exec::TaskWaker`
    /// does, not with a plain store. With a plain store this model deadlocks
    /// under loom 0.7 although the code is correct: loom does not apply
    /// read-modify-write atomicity against a concurrent plain store
    /// (tokio-rs/loom#254 and #389, fix proposed in PR #391, unmerged), so
    /// it lets the executor's second `swap` read the `false` its own first
    /// `swap` wrote even after the waker's `true`, an execution C11 forbids
    /// (the first swap read the initial `false`, so the store is after it
    /// in modification order and the next swap must read `true`). That is
    /// why the ninth pass's model (branch i25, commit ab8a4e4) deadlocked
    /// with main's `notify` too: its trace shows the waker's notify seeing
    /// `PARKED` and unparking, the executor waking, taking, and then
    /// swapping `false` out of a flag set to `true` before.
    #[test]
    fn the_executor_loop_never_parks_with_a_task_ready() {
        use loom::sync::atomic::{AtomicBool, Ordering};
        loom::model(|| {
            let p = Arc::new(Parker::new()); // NOTIFIED, not taken yet
            let ready = Arc::new(AtomicBool::new(false));
            let (q, r) = (p.clone(), ready.clone());
            let waker = loom::thread::spawn(move || {
                r.swap(true, Ordering::SeqCst);
                q.notify();
            });
            loop {
                p.take();
                if ready.swap(false, Ordering::SeqCst) {
                    break;
                }
                p.park();
            }
            waker.join().unwrap();
        });
    }
}
