//! One chunk fetch in flight per client allocator, the other tasks parked
//! until it ends (RACE's and Sherman's client allocators: a task that
//! finds its allocator's chunk used up either fetches the next chunk or,
//! when a sibling task already does, waits for that fetch instead of
//! fetching and wasting a chunk of its own).
//!
//! Invariants:
//! - G1: the flag is set only by [`FetchGate::claim`] and cleared only by
//!   a [`ChunkFetch`]'s drop, so a fetch whose future is dropped mid-way
//!   (or that fails) cannot leave it set and its waiters parked forever.
//! - G2: a waiter parks (one waker per pending poll, no re-poll) and every
//!   waiter is woken when the fetch ends, with or without a chunk.

use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll, Waker};

/// The fetch flag and the tasks parked on it, kept in an allocator.
#[derive(Debug, Default)]
pub struct FetchGate {
    fetching: bool,
    waiters: Vec<Waker>,
}

impl FetchGate {
    /// Claims the one fetch: `true` if the caller is now the fetcher (it
    /// must hold a [`ChunkFetch`] until the fetch ends), `false` if another
    /// task's fetch is in flight.
    pub fn claim(&mut self) -> bool {
        !std::mem::replace(&mut self.fetching, true)
    }

    /// Tasks parked now (tests).
    pub fn parked(&self) -> usize {
        self.waiters.len()
    }

    /// Ends the fetch in flight and wakes every task parked on it (G2).
    fn end(&mut self) {
        self.fetching = false;
        for w in self.waiters.drain(..) {
            w.wake();
        }
    }
}

/// An allocator with a [`FetchGate`].
pub trait HasFetchGate {
    fn fetch_gate(&mut self) -> &mut FetchGate;
}

/// The fetcher's hold on allocator `mn`'s fetch: dropping it (after the
/// chunk was added, after an error, or with the fetching future dropped
/// mid-way) ends the fetch and wakes the tasks waiting for it (G1).
pub struct ChunkFetch<'a, A: HasFetchGate> {
    allocs: &'a RefCell<Vec<A>>,
    mn: usize,
}

impl<'a, A: HasFetchGate> ChunkFetch<'a, A> {
    /// The caller claimed the fetch with [`FetchGate::claim`].
    pub fn new(allocs: &'a RefCell<Vec<A>>, mn: usize) -> Self {
        Self { allocs, mn }
    }
}

impl<A: HasFetchGate> Drop for ChunkFetch<'_, A> {
    fn drop(&mut self) {
        self.allocs.borrow_mut()[self.mn].fetch_gate().end();
    }
}

/// Waits, parked (no polling), until allocator `mn`'s fetch in flight
/// ends; the caller then looks for a block or node again.
pub struct WaitForFetch<'a, A: HasFetchGate> {
    pub allocs: &'a RefCell<Vec<A>>,
    pub mn: usize,
}

impl<A: HasFetchGate> Future for WaitForFetch<'_, A> {
    type Output = ();
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let mut allocs = self.allocs.borrow_mut();
        let gate = allocs[self.mn].fetch_gate();
        if !gate.fetching {
            return Poll::Ready(());
        }
        // One entry per poll while pending: a spurious poll adds a
        // duplicate, which the fetch's end wakes harmlessly.
        gate.waiters.push(cx.waker().clone());
        Poll::Pending
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Default)]
    struct Alloc(FetchGate);
    impl HasFetchGate for Alloc {
        fn fetch_gate(&mut self) -> &mut FetchGate {
            &mut self.0
        }
    }

    /// Counts its wakes.
    struct CountWake(std::sync::atomic::AtomicUsize);
    impl std::task::Wake for CountWake {
        fn wake(self: std::sync::Arc<Self>) {
            self.0.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// A task waiting for another's chunk fetch parks (one waker, no
    /// re-poll) and is woken when the fetch ends, however it ends: here
    /// the fetcher's hold is dropped without a chunk, as when its future
    /// is dropped mid-way or the fetch fails; the fetch is free to claim
    /// again afterwards. (With a bare flag and a polling wait, a dropped
    /// fetcher left the flag set and its siblings spinning forever.)
    #[test]
    fn a_waiter_parks_and_wakes_when_the_fetch_ends_however_it_ends() {
        let allocs = RefCell::new(vec![Alloc::default(), Alloc::default()]);
        assert!(allocs.borrow_mut()[1].0.claim());
        let held = ChunkFetch::new(&allocs, 1);
        assert!(!allocs.borrow_mut()[1].0.claim(), "one fetch at a time");
        assert!(allocs.borrow_mut()[0].0.claim(), "per memory node");

        let count = std::sync::Arc::new(CountWake(0.into()));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut wait = WaitForFetch {
            allocs: &allocs,
            mn: 1,
        };
        assert!(Pin::new(&mut wait).poll(&mut cx).is_pending());
        assert_eq!(allocs.borrow()[1].0.parked(), 1);
        assert_eq!(count.0.load(std::sync::atomic::Ordering::Relaxed), 0);

        drop(held);
        assert_eq!(
            count.0.load(std::sync::atomic::Ordering::Relaxed),
            1,
            "woken once"
        );
        assert_eq!(allocs.borrow()[1].0.parked(), 0);
        assert!(Pin::new(&mut wait).poll(&mut cx).is_ready());
        assert!(allocs.borrow_mut()[1].0.claim(), "free to claim again");
    }
}
