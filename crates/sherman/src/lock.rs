//! Sherman's hierarchical on-chip lock (HOCL), over our transport.
//!
//! Global locks: a table of 8-byte lock words in a separate small region on
//! every memory node (Sherman keeps it in the NIC's on-chip memory; here it
//! is ordinary registered memory, see the design note). The lock of a tree
//! node is the word at `hash(node offset) % LOCK_WORDS` on the node's
//! memory node; 0 is free, otherwise it holds the owning compute process's
//! tag. It is taken by CAS and released by an 8-byte WRITE of 0 posted in the
//! same batch as, and after, the node's data writes: verbs of one batch to
//! one node execute in posting order (RC ordering on one QP), so the unlock
//! can never be seen before the data.
//!
//! Local locks: every compute process has one local lock per global lock
//! word. A task first takes the local lock (threads and tasks of the process
//! queue there instead of hammering the memory node with CASes), then the
//! global one. On release, if other local tasks wait and fewer than
//! [`MAX_HANDOVER`] handovers happened in a row, the global lock is handed
//! over: it stays held and the next local holder skips the CAS.
//!
//! A holder takes at most one lock at a time (splits release the child
//! before locking the parent), so lock-word collisions cannot deadlock.

use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, Ordering};
use std::task::{Poll, Waker};

/// Global lock words per memory node (256 KiB, Sherman's on-chip budget).
pub const LOCK_WORDS: u64 = 32 * 1024;
/// Consecutive local handovers before the global lock is released anyway
/// (fairness towards other compute processes).
pub const MAX_HANDOVER: u32 = 4;

/// Index of the lock word guarding the node at `offset`.
pub fn lock_index(offset: u64) -> u64 {
    let x = offset.wrapping_mul(0x9E37_79B9_7F4A_7C15);
    (x >> 32) % LOCK_WORDS
}

#[derive(Default)]
struct LocalLock {
    held: AtomicBool,
    waiters: AtomicU32,
    /// The global lock is held by this process and handed to the next holder.
    handed_over: AtomicBool,
    handovers: AtomicU32,
}

/// The local lock table of one compute process, for every memory node.
pub struct LocalLocks {
    locks: Vec<LocalLock>,
    /// Tasks waiting for a local lock, by lock index. A waiter registers
    /// under this mutex after its failed attempt, and a release clears
    /// `held` before taking the mutex, so no wake-up is lost; every release
    /// wakes all of that lock's waiters (one may have been dropped). They
    /// wait without polling: a lock held for long (its holder waits for a
    /// global lock a dead process holds) costs no scheduler events.
    wakers: Mutex<BTreeMap<usize, Vec<Waker>>>,
}

/// A task waiting in [`LocalLocks::acquire`]: counted in `waiters` until it
/// gets the lock or is dropped (its operation abandoned), so that holders
/// do not hand the global lock over to a waiter that is gone.
struct Waiting<'a>(&'a LocalLock);

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        self.0.waiters.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A taken local lock: whether the global lock came with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LocalGuard {
    pub index: usize,
    /// The previous holder handed over the global lock: no CAS needed.
    pub has_global: bool,
}

impl LocalLocks {
    pub fn new(memnodes: usize) -> LocalLocks {
        LocalLocks {
            locks: (0..memnodes as u64 * LOCK_WORDS)
                .map(|_| LocalLock::default())
                .collect(),
            wakers: Mutex::new(BTreeMap::new()),
        }
    }

    /// Takes the local lock of word `word` on memory node `mn`, yielding to
    /// other tasks while it is held.
    pub async fn acquire(&self, mn: usize, word: u64) -> LocalGuard {
        let index = mn * LOCK_WORDS as usize + word as usize;
        let l = &self.locks[index];
        l.waiters.fetch_add(1, Ordering::AcqRel);
        let waiting = Waiting(l);
        let take = || {
            l.held
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
        };
        std::future::poll_fn(|cx| {
            if take() {
                return Poll::Ready(());
            }
            let mut w = self.wakers.lock();
            if take() {
                return Poll::Ready(());
            }
            w.entry(index).or_default().push(cx.waker().clone());
            Poll::Pending
        })
        .await;
        drop(waiting);
        LocalGuard {
            index,
            has_global: l.handed_over.load(Ordering::Acquire),
        }
    }

    /// Decides how the holder releases: `true` = hand the global lock over
    /// (do not write the unlock), `false` = release it globally.
    pub fn hand_over(&self, g: LocalGuard) -> bool {
        let l = &self.locks[g.index];
        let hand = l.waiters.load(Ordering::Acquire) > 0
            && l.handovers.load(Ordering::Acquire) < MAX_HANDOVER;
        if hand {
            l.handovers.fetch_add(1, Ordering::AcqRel);
        } else {
            l.handovers.store(0, Ordering::Release);
        }
        l.handed_over.store(hand, Ordering::Release);
        hand
    }

    /// Releases the local lock after the global release (or handover) has
    /// completed.
    pub fn release(&self, g: LocalGuard) {
        self.locks[g.index].held.store(false, Ordering::Release);
        let woken = self.wakers.lock().remove(&g.index);
        woken.into_iter().flatten().for_each(Waker::wake);
    }

    /// Marks the global lock as not held by this process (after a failure
    /// that released it, or never took it).
    pub fn forget_global(&self, g: LocalGuard) {
        let l = &self.locks[g.index];
        l.handed_over.store(false, Ordering::Release);
        l.handovers.store(0, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::exec::{LocalTask, run_tasks, yield_now};
    use std::cell::Cell;

    /// Local locks exclude each other across tasks, and handover happens only
    /// when someone waits, at most MAX_HANDOVER times in a row.
    #[test]
    fn local_locks_exclude_and_hand_over() {
        let locks = LocalLocks::new(1);
        let inside = Cell::new(false);
        let handed = Cell::new(0u32);
        let releases = Cell::new(0u32);
        let tasks: Vec<LocalTask<'_, ()>> = (0..4)
            .map(|_| {
                let (locks, inside, handed, releases) = (&locks, &inside, &handed, &releases);
                Box::pin(async move {
                    for _ in 0..20 {
                        let g = locks.acquire(0, 7).await;
                        assert!(!inside.replace(true), "two holders");
                        yield_now().await;
                        inside.set(false);
                        if locks.hand_over(g) {
                            handed.set(handed.get() + 1);
                        } else {
                            releases.set(releases.get() + 1);
                        }
                        locks.release(g);
                        yield_now().await;
                    }
                }) as LocalTask<'_, ()>
            })
            .collect();
        run_tasks(tasks);
        assert_eq!(handed.get() + releases.get(), 80);
        assert!(handed.get() > 0, "tasks waited, so some handovers happened");
        assert!(
            releases.get() >= 80 / (MAX_HANDOVER + 1),
            "handovers are bounded"
        );
        let g = block(&locks);
        assert!(!locks.hand_over(g), "nobody waits: release globally");
    }

    fn block(locks: &LocalLocks) -> LocalGuard {
        dmkv_transport::exec::block_on(locks.acquire(0, 1))
    }
}
