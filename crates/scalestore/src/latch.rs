//! The hybrid latch of a cache frame (paper §3.2, after LeanStore's): one
//! 64-bit word that supports exclusive, shared and optimistic
//! (version-validated) access.
//!
//! Word layout (little-endian bit numbers):
//!
//! ```text
//! bits  0..=15  shared holders
//! bit   16      exclusive
//! bits 17..=63  version (bumped whenever an exclusive holder lets go)
//! ```
//!
//! Every operation is a non-blocking *try*: compute threads run several
//! tasks, and a task that waited on a latch held by a sibling task of the
//! same thread would deadlock it. Tasks that must wait register on the
//! latch's waiter list and are woken by the release
//! ([`HybridLatch::wait_until`], invariant 15 of docs/scalestore.md);
//! message handlers retry a bounded number of times and then park the
//! request for the re-poll thread.
//!
//! Optimistic readers follow the seqlock pattern: read the version, read the
//! data (atomic word loads), then [`HybridLatch::validate`], which issues an
//! acquire fence before re-reading the word. Writers take the exclusive bit
//! with an acquire CAS and release it with a release store of the next
//! version, so a reader that saw any word of a write also sees the latch
//! taken or the version changed.

#[cfg(loom)]
use loom::sync::Mutex;
#[cfg(loom)]
use loom::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
#[cfg(not(loom))]
use std::sync::Mutex;
#[cfg(not(loom))]
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering, fence};
use std::task::{Poll, Waker};

const SHARED_BITS: u32 = 16;
/// Mask of the shared-holder count.
pub const SHARED_MASK: u64 = (1 << SHARED_BITS) - 1;
/// The exclusive bit.
pub const EXCLUSIVE: u64 = 1 << SHARED_BITS;
/// First bit of the version.
pub const VERSION_SHIFT: u32 = SHARED_BITS + 1;

const _: () = assert!(SHARED_MASK & EXCLUSIVE == 0);
const _: () = assert!(EXCLUSIVE << 1 == 1 << VERSION_SHIFT);
const _: () = assert!(VERSION_SHIFT == 17 && SHARED_MASK == 0xFFFF);

#[cfg(not(loom))]
const _: () = assert!(std::mem::offset_of!(HybridLatch, word) == 0);

/// Attempts of [`HybridLatch::wait_until`] before it registers.
#[cfg(not(loom))]
const WAIT_SPINS: u32 = 16;

/// A version observed by an optimistic reader.
pub type Version = u64;

/// See the module documentation.
///
/// `repr(C)` with the word first: a frame (`frames::Frame`) puts its latch
/// at offset 0, so the word is the first word of the frame's first cache
/// line, and the simulated compute CPU counts the word and the frame's
/// other line-0 words as that one line (docs/scalestore.md, "Frame
/// layout").
#[derive(Debug)]
#[repr(C)]
pub struct HybridLatch {
    word: AtomicU64,
    /// Tasks waiting for the latch (or for a flag of its frame) to change;
    /// see [`HybridLatch::wait_until`].
    waiters: WaitList,
}

/// The tasks waiting on one latch. `count` mirrors `list.len()` so that a
/// releaser with nobody waiting pays one load, not a mutex.
///
/// No lost wake-up (docs/scalestore.md, invariant 15): a waiter pushes its
/// waker and bumps `count` (SeqCst, under the mutex), issues a SeqCst
/// fence and then evaluates its condition again; a releaser changes the
/// latch word (or the frame flag), issues a SeqCst fence and then reads
/// `count`. Of two such sequences at least one sees the other's write:
/// either the waiter's re-check sees the release, or the releaser sees the
/// waiter and wakes it (loom test `latch_waiters_are_never_missed`, unit
/// test `a_release_between_check_and_registration_is_not_lost`).
struct WaitList {
    count: AtomicUsize,
    list: Mutex<Vec<Waker>>,
}

impl WaitList {
    fn new() -> WaitList {
        WaitList {
            count: AtomicUsize::new(0),
            list: Mutex::new(Vec::new()),
        }
    }
}

impl std::fmt::Debug for WaitList {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WaitList")
            .field("count", &self.count.load(Ordering::Relaxed))
            .finish()
    }
}

impl Default for HybridLatch {
    fn default() -> Self {
        Self::new()
    }
}

impl HybridLatch {
    pub fn new() -> HybridLatch {
        HybridLatch {
            word: AtomicU64::new(0),
            waiters: WaitList::new(),
        }
    }

    /// Wakes every task waiting in [`HybridLatch::wait_until`]. Called by
    /// every operation that lets go of the latch (so that waiters need no
    /// polling) and by whoever clears a frame flag a waiter's condition
    /// reads (`Frame::set_flags`). The fence pairs with the one in
    /// [`HybridLatch::register`].
    pub fn wake_waiters(&self) {
        fence(Ordering::SeqCst);
        if self.waiters.count.load(Ordering::SeqCst) == 0 {
            return;
        }
        let woken = {
            let mut l = self.waiters.list.lock().unwrap();
            self.waiters.count.store(0, Ordering::SeqCst);
            std::mem::take(&mut *l)
        };
        for w in woken {
            w.wake();
        }
    }

    /// Adds `w` to the waiters (then the caller fences and re-checks).
    fn register(&self, w: &Waker) {
        let mut l = self.waiters.list.lock().unwrap();
        if !l.iter().any(|x| x.will_wake(w)) {
            l.push(w.clone());
        }
        self.waiters.count.store(l.len(), Ordering::SeqCst);
        drop(l);
        fence(Ordering::SeqCst);
    }

    /// Tasks registered right now (for tests).
    pub fn waiter_count(&self) -> usize {
        self.waiters.count.load(Ordering::SeqCst)
    }

    /// Waits (as a task) until `cond` holds, without polling: `cond` is
    /// evaluated, and if it fails the task registers on the latch, evaluates
    /// it once more (the re-check that makes a release between the first
    /// evaluation and the registration visible, see [`WaitList`]) and
    /// sleeps until a release or a flag change wakes it. `cond` may take the
    /// latch (`|| l.try_exclusive()`); it is not called again once it
    /// returned true. `cond` must only become true through an operation that
    /// calls [`HybridLatch::wake_waiters`] afterwards.
    pub async fn wait_until(&self, mut cond: impl FnMut() -> bool) {
        // Brief spin first: a latch held for a few instructions (a
        // handler's page copy on another thread) is let go before a
        // registration would pay off. Not on the simulated cluster, where
        // nothing else runs while a task spins (it would only be charged
        // the latch's lines again).
        #[cfg(not(loom))]
        let spins = if dmkv_transport::sim::active() {
            0
        } else {
            WAIT_SPINS
        };
        #[cfg(loom)]
        let spins = 0;
        for _ in 0..spins {
            if cond() {
                return;
            }
            std::hint::spin_loop();
        }
        std::future::poll_fn(|cx| self.poll_wait(cx.waker(), &mut cond)).await
    }

    /// One poll of [`HybridLatch::wait_until`] after its spins: check,
    /// register, fence, check again.
    fn poll_wait(&self, w: &Waker, cond: &mut impl FnMut() -> bool) -> Poll<()> {
        if cond() {
            return Poll::Ready(());
        }
        self.register(w);
        // The re-check (invariant 15): a release that came after the check
        // above but before the registration found nobody to wake.
        if cond() {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    }

    /// One access of the latch word, for the simulated compute CPU: the
    /// word's line under `Endpoint::charged` on `sim`, counted once per
    /// operation however often the operation reads it (the optimistic read
    /// and its validation hit the same line), nothing elsewhere
    /// (docs/simulation.md, "Distinct lines per operation").
    #[inline]
    fn touched(&self) {
        #[cfg(not(loom))]
        dmkv_transport::touch_local_at(&self.word);
    }

    fn version_of(w: u64) -> Version {
        w >> VERSION_SHIFT
    }

    /// The version to validate against later, or `None` while an exclusive
    /// holder is inside.
    pub fn optimistic(&self) -> Option<Version> {
        self.touched();
        let w = self.word.load(Ordering::Acquire);
        (w & EXCLUSIVE == 0).then(|| Self::version_of(w))
    }

    /// Whether nothing was modified since [`HybridLatch::optimistic`]
    /// returned `v` (no exclusive holder is inside and none has left).
    pub fn validate(&self, v: Version) -> bool {
        self.touched();
        fence(Ordering::Acquire);
        let w = self.word.load(Ordering::Acquire);
        w & EXCLUSIVE == 0 && Self::version_of(w) == v
    }

    /// Takes the latch exclusively if nobody holds it.
    pub fn try_exclusive(&self) -> bool {
        self.touched();
        let w = self.word.load(Ordering::Relaxed);
        if w & (EXCLUSIVE | SHARED_MASK) != 0 {
            return false;
        }
        self.word
            .compare_exchange(w, w | EXCLUSIVE, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// Takes the latch shared unless an exclusive holder is inside.
    pub fn try_shared(&self) -> bool {
        self.touched();
        let mut w = self.word.load(Ordering::Relaxed);
        loop {
            if w & EXCLUSIVE != 0 || w & SHARED_MASK == SHARED_MASK {
                return false;
            }
            match self
                .word
                .compare_exchange_weak(w, w + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => w = actual,
            }
        }
    }

    /// Turns an optimistic read at `v` into exclusive access, if nothing
    /// changed and nobody holds the latch.
    pub fn try_upgrade_optimistic_to_exclusive(&self, v: Version) -> bool {
        self.touched();
        let expect = v << VERSION_SHIFT;
        self.word
            .compare_exchange(
                expect,
                expect | EXCLUSIVE,
                Ordering::Acquire,
                Ordering::Relaxed,
            )
            .is_ok()
    }

    /// Turns an optimistic read at `v` into shared access, if nothing changed.
    pub fn try_upgrade_optimistic_to_shared(&self, v: Version) -> bool {
        self.touched();
        let mut w = self.word.load(Ordering::Relaxed);
        loop {
            if w & EXCLUSIVE != 0 || Self::version_of(w) != v || w & SHARED_MASK == SHARED_MASK {
                return false;
            }
            match self
                .word
                .compare_exchange_weak(w, w + 1, Ordering::Acquire, Ordering::Relaxed)
            {
                Ok(_) => return true,
                Err(actual) => w = actual,
            }
        }
    }

    /// Turns the only shared hold into an exclusive one.
    pub fn try_upgrade_shared_to_exclusive(&self) -> bool {
        self.touched();
        let w = self.word.load(Ordering::Relaxed);
        if w & EXCLUSIVE != 0 || w & SHARED_MASK != 1 {
            return false;
        }
        self.word
            .compare_exchange(w, (w - 1) | EXCLUSIVE, Ordering::Acquire, Ordering::Relaxed)
            .is_ok()
    }

    /// Leaves exclusive mode; optimistic readers of the old version fail.
    pub fn unlock_exclusive(&self) {
        self.touched();
        let w = self.word.load(Ordering::Relaxed);
        debug_assert!(w & EXCLUSIVE != 0, "unlock of a latch not held exclusively");
        self.word.store(
            (Self::version_of(w) + 1) << VERSION_SHIFT,
            Ordering::Release,
        );
        self.wake_waiters();
    }

    /// Leaves exclusive mode keeping a shared hold (the version still moves,
    /// as the holder may have written).
    pub fn downgrade_exclusive_to_shared(&self) {
        self.touched();
        let w = self.word.load(Ordering::Relaxed);
        debug_assert!(
            w & EXCLUSIVE != 0,
            "downgrade of a latch not held exclusively"
        );
        self.word.store(
            ((Self::version_of(w) + 1) << VERSION_SHIFT) | 1,
            Ordering::Release,
        );
        self.wake_waiters();
    }

    /// Leaves exclusive mode and returns the version an optimistic reader
    /// may continue from.
    pub fn downgrade_exclusive_to_optimistic(&self) -> Version {
        self.touched();
        let w = self.word.load(Ordering::Relaxed);
        debug_assert!(w & EXCLUSIVE != 0);
        let v = Self::version_of(w) + 1;
        self.word.store(v << VERSION_SHIFT, Ordering::Release);
        self.wake_waiters();
        v
    }

    pub fn unlock_shared(&self) {
        self.touched();
        let prev = self.word.fetch_sub(1, Ordering::Release);
        debug_assert!(prev & SHARED_MASK != 0, "unlock of a latch not held shared");
        if prev & SHARED_MASK == 1 {
            // The last shared holder left: an exclusive waiter may go.
            self.wake_waiters();
        }
    }

    /// Whether anyone holds the latch exclusively right now (a hint).
    pub fn is_exclusive(&self) -> bool {
        self.touched();
        self.word.load(Ordering::Relaxed) & EXCLUSIVE != 0
    }

    /// Whether anyone holds the latch at all right now (a hint).
    pub fn is_latched(&self) -> bool {
        self.touched();
        self.word.load(Ordering::Relaxed) & (EXCLUSIVE | SHARED_MASK) != 0
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn modes_exclude_each_other() {
        let l = HybridLatch::new();
        let v = l.optimistic().unwrap();
        assert!(l.try_shared());
        assert!(l.try_shared());
        assert!(!l.try_exclusive(), "shared holders block exclusive");
        assert!(l.validate(v), "shared holders do not invalidate readers");
        l.unlock_shared();
        assert!(
            !l.try_upgrade_optimistic_to_exclusive(v),
            "one shared holder left"
        );
        assert!(l.try_upgrade_shared_to_exclusive());
        assert!(l.optimistic().is_none());
        assert!(!l.try_shared());
        assert!(!l.validate(v));
        l.unlock_exclusive();
        assert!(!l.validate(v), "an exclusive holder bumps the version");
        let v2 = l.optimistic().unwrap();
        assert_eq!(v2, v + 1);
        assert!(l.try_upgrade_optimistic_to_exclusive(v2));
        l.downgrade_exclusive_to_shared();
        assert!(!l.validate(v2));
        assert!(l.try_upgrade_optimistic_to_shared(v2 + 1));
        l.unlock_shared();
        l.unlock_shared();
        assert!(!l.is_latched());
    }

    /// A waker that records whether it was woken.
    fn flag_waker() -> (Waker, std::sync::Arc<std::sync::atomic::AtomicBool>) {
        struct Flag(std::sync::Arc<std::sync::atomic::AtomicBool>);
        impl std::task::Wake for Flag {
            fn wake(self: std::sync::Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let b = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        (Waker::from(std::sync::Arc::new(Flag(b.clone()))), b)
    }

    /// Invariant 14: the holder lets go right after the waiter's first
    /// check failed and before it registered (the release finds nobody to
    /// wake). Only the re-check after the registration sees it; without it
    /// the waiter would sleep with nobody left to wake it.
    #[test]
    fn a_release_between_check_and_registration_is_not_lost() {
        let l = HybridLatch::new();
        assert!(l.try_exclusive());
        let (w, woken) = flag_waker();
        let mut calls = 0;
        let r = l.poll_wait(&w, &mut || {
            calls += 1;
            if calls == 1 {
                // The release lands between the check and the registration.
                l.unlock_exclusive();
                false
            } else {
                l.try_exclusive()
            }
        });
        assert!(
            r.is_ready() || woken.load(Ordering::SeqCst),
            "the waiter missed the release and nobody will wake it"
        );
        assert!(r.is_ready() && calls == 2 && l.is_exclusive());
    }

    /// Every kind of release wakes registered waiters; a release with
    /// nobody registered wakes nobody; a shared release wakes only when
    /// the last shared holder leaves.
    #[test]
    fn releases_wake_registered_waiters() {
        let l = HybridLatch::new();
        assert!(l.try_exclusive());
        let (w, woken) = flag_waker();
        assert!(l.poll_wait(&w, &mut || l.try_shared()).is_pending());
        assert_eq!(l.waiter_count(), 1);
        // Registering the same task twice keeps one entry.
        assert!(l.poll_wait(&w, &mut || l.try_shared()).is_pending());
        assert_eq!(l.waiter_count(), 1);
        assert!(!woken.load(Ordering::SeqCst));
        l.downgrade_exclusive_to_shared();
        assert!(woken.load(Ordering::SeqCst), "downgrade woke nobody");
        assert_eq!(l.waiter_count(), 0);
        assert!(l.try_shared());
        let (w2, woken2) = flag_waker();
        assert!(l.poll_wait(&w2, &mut || l.try_exclusive()).is_pending());
        l.unlock_shared();
        assert!(!woken2.load(Ordering::SeqCst), "a shared holder is left");
        l.unlock_shared();
        assert!(
            woken2.load(Ordering::SeqCst),
            "last shared release woke nobody"
        );
        assert!(l.try_exclusive());
        let (w3, woken3) = flag_waker();
        assert!(
            l.poll_wait(&w3, &mut || l.optimistic().is_some())
                .is_pending()
        );
        let _ = l.downgrade_exclusive_to_optimistic();
        assert!(woken3.load(Ordering::SeqCst));
        assert!(l.try_exclusive());
        let (w4, woken4) = flag_waker();
        assert!(l.poll_wait(&w4, &mut || !l.is_latched()).is_pending());
        l.unlock_exclusive();
        assert!(woken4.load(Ordering::SeqCst));
    }

    #[test]
    fn stale_upgrades_fail() {
        let l = HybridLatch::new();
        let v = l.optimistic().unwrap();
        assert!(l.try_exclusive());
        l.unlock_exclusive();
        assert!(!l.try_upgrade_optimistic_to_exclusive(v));
        assert!(!l.try_upgrade_optimistic_to_shared(v));
    }
}

#[cfg(all(test, loom))]
mod loom_tests {
    use super::*;
    use loom::sync::Arc;
    use loom::sync::atomic::AtomicU64 as Data;

    fn spin_exclusive(l: &HybridLatch) {
        while !l.try_exclusive() {
            loom::thread::yield_now();
        }
    }

    /// Two writers each write both data words under the exclusive latch; an
    /// optimistic reader that validates never sees a mix.
    #[test]
    fn optimistic_readers_never_accept_torn_writes() {
        loom::model(|| {
            let l = Arc::new(HybridLatch::new());
            let a = Arc::new(Data::new(0));
            let b = Arc::new(Data::new(0));
            let w = {
                let (l, a, b) = (l.clone(), a.clone(), b.clone());
                loom::thread::spawn(move || {
                    spin_exclusive(&l);
                    a.store(1, Ordering::Release);
                    b.store(1, Ordering::Release);
                    l.unlock_exclusive();
                })
            };
            if let Some(v) = l.optimistic() {
                let x = a.load(Ordering::Acquire);
                let y = b.load(Ordering::Acquire);
                if l.validate(v) {
                    assert_eq!(x, y, "validated read saw a torn write");
                }
            }
            w.join().unwrap();
        });
    }

    /// Exclusive holders exclude each other and shared holders.
    #[test]
    fn exclusive_is_exclusive() {
        loom::model(|| {
            let l = Arc::new(HybridLatch::new());
            let inside = Arc::new(Data::new(0));
            let threads: Vec<_> = (0..2)
                .map(|i| {
                    let (l, inside) = (l.clone(), inside.clone());
                    loom::thread::spawn(move || {
                        if i == 0 {
                            spin_exclusive(&l);
                            assert_eq!(inside.fetch_add(10, Ordering::Relaxed), 0);
                            inside.fetch_sub(10, Ordering::Relaxed);
                            l.unlock_exclusive();
                        } else {
                            while !l.try_shared() {
                                loom::thread::yield_now();
                            }
                            assert!(inside.fetch_add(1, Ordering::Relaxed) < 10);
                            inside.fetch_sub(1, Ordering::Relaxed);
                            l.unlock_shared();
                        }
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert!(!l.is_latched());
        });
    }

    /// The parking handshake of `holder` and `ScaleNode::released`: a
    /// handler that could not latch a frame raises its `parked` flag, issues
    /// a SeqCst fence and looks at the latch again; a worker lets go of the
    /// latch, issues a SeqCst fence and looks at the flag. At least one of
    /// them sees the other, so a parked request is always kicked (no
    /// request waits for the periodic sweep).
    #[test]
    fn parked_requests_are_never_missed() {
        loom::model(|| {
            let l = Arc::new(HybridLatch::new());
            assert!(l.try_exclusive());
            let parked = Arc::new(Data::new(0));
            let worker = {
                let (l, parked) = (l.clone(), parked.clone());
                loom::thread::spawn(move || {
                    l.unlock_exclusive();
                    fence(Ordering::SeqCst);
                    parked.load(Ordering::SeqCst) == 1
                })
            };
            parked.store(1, Ordering::SeqCst);
            fence(Ordering::SeqCst);
            let handler_saw_free = !l.is_latched();
            let worker_saw_parked = worker.join().unwrap();
            assert!(
                handler_saw_free || worker_saw_parked,
                "both missed each other: the parked request is never kicked"
            );
        });
    }

    /// Invariant 14 under every interleaving: a task waits for the latch
    /// (`poll_wait`: check, register, fence, check again) while its holder
    /// lets go (`unlock_exclusive`: store, fence, wake the registered).
    /// The waiter either gets the latch in its poll or is woken.
    #[test]
    fn latch_waiters_are_never_missed() {
        loom::model(|| {
            struct Flag(Data);
            impl std::task::Wake for Flag {
                fn wake(self: std::sync::Arc<Self>) {
                    self.0.store(1, Ordering::SeqCst);
                }
            }
            let l = Arc::new(HybridLatch::new());
            assert!(l.try_exclusive());
            let holder = {
                let l = l.clone();
                loom::thread::spawn(move || l.unlock_exclusive())
            };
            let flag = std::sync::Arc::new(Flag(Data::new(0)));
            let w = std::task::Waker::from(flag.clone());
            let got = l.poll_wait(&w, &mut || l.try_exclusive()).is_ready();
            holder.join().unwrap();
            assert!(
                got || flag.0.load(Ordering::SeqCst) == 1,
                "the waiter neither took the latch nor was woken"
            );
        });
    }

    /// Two shared holders race to upgrade: at most one becomes exclusive,
    /// and only once the other let go.
    #[test]
    fn shared_upgrades_exclude_each_other() {
        loom::model(|| {
            let l = Arc::new(HybridLatch::new());
            let inside = Arc::new(Data::new(0));
            let threads: Vec<_> = (0..2)
                .map(|_| {
                    let (l, inside) = (l.clone(), inside.clone());
                    loom::thread::spawn(move || {
                        while !l.try_shared() {
                            loom::thread::yield_now();
                        }
                        if l.try_upgrade_shared_to_exclusive() {
                            assert_eq!(inside.fetch_add(1, Ordering::Relaxed), 0);
                            inside.fetch_sub(1, Ordering::Relaxed);
                            l.downgrade_exclusive_to_shared();
                        }
                        l.unlock_shared();
                    })
                })
                .collect();
            for t in threads {
                t.join().unwrap();
            }
            assert!(!l.is_latched());
        });
    }

    /// An optimistic upgrade races a writer: at most one wins, and the
    /// loser's version is stale afterwards.
    #[test]
    fn upgrades_race_writers() {
        loom::model(|| {
            let l = Arc::new(HybridLatch::new());
            let v = l.optimistic().unwrap();
            let l2 = l.clone();
            let t = loom::thread::spawn(move || {
                if l2.try_exclusive() {
                    l2.unlock_exclusive();
                    true
                } else {
                    false
                }
            });
            let upgraded = l.try_upgrade_optimistic_to_exclusive(v);
            if upgraded {
                l.unlock_exclusive();
            }
            let other = t.join().unwrap();
            assert!(upgraded || other);
            assert!(!l.validate(v));
        });
    }
}

/// Escalating waits for a task that cannot proceed yet and has no event to
/// wait for (latch waits use [`HybridLatch::wait_until`]): a few spins, then
/// yields to the thread's other tasks (and other threads), then short
/// sleeps, so that a thread whose every task waits parks instead of burning
/// a core the message handlers and page providers need.
#[derive(Default)]
pub struct Backoff {
    round: u32,
}

impl Backoff {
    /// Spins while waiting is likely to be short.
    const SPINS: u32 = 16;
    /// Then yields.
    const YIELDS: u32 = 64;
    /// Then sleeps this long (longer than the executor's timer spin
    /// threshold, so the thread really parks when every task sleeps).
    const SLEEP: std::time::Duration = std::time::Duration::from_micros(250);

    /// [`Backoff::pause`] for a wait that an event of another thread ends
    /// and that should see it soon: never sleeps longer than `SHORT`
    /// (a FIFO directory's own worker waiting for an acknowledgement, after
    /// which the page is left to it: a long sleep would leave the page idle).
    pub async fn pause_short(&mut self) {
        const SHORT: std::time::Duration = std::time::Duration::from_micros(5);
        if self.round < Self::SPINS + Self::YIELDS {
            self.pause().await;
        } else {
            dmkv_transport::exec::sleep(SHORT).await;
        }
    }

    pub async fn pause(&mut self) {
        self.round += 1;
        if self.round <= Self::SPINS {
            std::hint::spin_loop();
        } else if self.round <= Self::SPINS + Self::YIELDS {
            if self.round.is_multiple_of(16) {
                std::thread::yield_now();
            }
            dmkv_transport::exec::yield_now().await;
        } else {
            dmkv_transport::exec::sleep(Self::SLEEP).await;
        }
    }
}
