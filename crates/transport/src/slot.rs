//! A reusable place for one future at a time: what lets a caller run a
//! type-erased operation (`dyn Future`) without a heap allocation per
//! operation.
//!
//! The client API's methods return boxed futures (`Pin<Box<dyn Future>>`,
//! the shape `async_trait` gives them), so every operation allocated and
//! freed its future (~100 instructions per GET with mimalloc,
//! docs/performance.md, "Eleventh pass"). A [`FutureSlot`] is a heap block a
//! caller keeps (the harness: one per task) and hands to each operation:
//! the operation's future is written into it ([`FutureSlot::put`]), polled
//! there through a [`SlotFuture`], and dropped in place when that is
//! dropped. The block grows to the largest future put in it and is then
//! reused without allocating.
//!
//! Invariants (checked by the tests below):
//! - S1: while a [`SlotFuture`] lives, the slot is mutably borrowed by it,
//!   so nothing else can write into or free the block holding its future,
//!   and the future never moves (it is pinned in the block).
//! - S2: a future put in the slot is dropped in place exactly once, by its
//!   [`SlotFuture`]'s drop (also when unwinding). If a `SlotFuture` is
//!   leaked (`mem::forget`), its future is never dropped; the slot then
//!   notices (`busy` still set) and abandons that block (leaks it: neither
//!   reused nor freed), so the pinned future's memory stays valid forever,
//!   as `Pin` requires.

use std::alloc::Layout;
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll};

/// The smallest block a slot allocates, and its smallest alignment: most
/// operation futures fit after the first growth.
const MIN_BYTES: usize = 256;
const MIN_ALIGN: usize = 16;

/// A reusable heap block for one future at a time (see the module doc).
pub struct FutureSlot {
    /// The block, or dangling while `layout` has size zero.
    block: NonNull<u8>,
    /// The block's layout (size zero: nothing allocated).
    layout: Layout,
    /// Whether a future put in the block has not been dropped yet (S2).
    busy: bool,
}

impl Default for FutureSlot {
    fn default() -> Self {
        FutureSlot::new()
    }
}

impl FutureSlot {
    /// An empty slot; it allocates on its first [`FutureSlot::put`].
    pub const fn new() -> FutureSlot {
        FutureSlot {
            block: NonNull::dangling(),
            layout: match Layout::from_size_align(0, 1) {
                Ok(l) => l,
                Err(_) => panic!("a zero layout"),
            },
            busy: false,
        }
    }

    /// Bytes the slot's block holds (zero before its first use).
    pub fn capacity(&self) -> usize {
        self.layout.size()
    }

    /// Moves `fut` into the slot and returns the future that polls it in
    /// place and drops it when itself dropped ([`FutureSlot::put_with`] of
    /// a future already made: it is moved into the block once).
    #[inline]
    pub fn put<'a, F>(&'a mut self, fut: F) -> SlotFuture<'a, F::Output>
    where
        F: Future + 'a,
    {
        self.put_with(move || fut)
    }

    /// [`FutureSlot::put`] for the future `make` returns, made where it
    /// will live: the room is checked first (from `F`'s layout alone) and
    /// `make` is called only then, its result written straight into the
    /// block. An `async fn`'s future is the size of its whole state
    /// machine (hundreds of bytes for an engine's `get`); built by the
    /// caller and passed to `put`, it was built on the stack and copied
    /// into the block, a `memcpy` of its full size per operation (branch
    /// i75: 76 instructions per Outback GET, 29 per rpc-hash GET).
    #[inline(always)]
    pub fn put_with<'a, F, M>(&'a mut self, make: M) -> SlotFuture<'a, F::Output>
    where
        F: Future + 'a,
        M: FnOnce() -> F,
    {
        let need = Layout::new::<F>();
        if self.busy || need.size() > self.layout.size() || need.align() > self.layout.align() {
            // Not generic and out of line: the future is not passed to a
            // cold path, which would make the compiler build it on the
            // stack and copy it into the block (measured: +88 instructions
            // per ROLEX GET).
            self.make_room(need);
        }
        let at = self.block.as_ptr().cast::<F>();
        // SAFETY: the block fits `F` and holds no live future (made so
        // just above); nothing else refers to it while `self` is mutably
        // borrowed (S1). If `make` panics nothing was written and `busy`
        // stays false.
        unsafe { at.write(make()) };
        self.busy = true;
        let fut: *mut (dyn Future<Output = F::Output> + 'a) = at;
        SlotFuture {
            // SAFETY: `at` is non-null (it points into the block).
            fut: unsafe { NonNull::new_unchecked(fut) },
            busy: &mut self.busy,
        }
    }

    /// Makes the block fit `need` and free: abandons it if a future may
    /// still be pinned in it (S2), grows it if it is too small.
    #[cold]
    #[inline(never)]
    fn make_room(&mut self, need: Layout) {
        if self.busy {
            // S2: a `SlotFuture` was leaked and its future may still be
            // pinned in the block: abandon the block.
            self.block = NonNull::dangling();
            self.layout = Layout::from_size_align(0, 1).expect("a zero layout");
            self.busy = false;
        }
        if need.size() > self.layout.size() || need.align() > self.layout.align() {
            self.grow(need);
        }
    }

    /// Replaces the block by one that fits `need` (the old one holds no
    /// live future: `put_with` checked `busy`).
    #[cold]
    fn grow(&mut self, need: Layout) {
        self.free();
        let size = need.size().max(self.layout.size() * 2).max(MIN_BYTES);
        let align = need.align().max(MIN_ALIGN);
        let layout = Layout::from_size_align(size, align).expect("a future's layout");
        // SAFETY: `layout` has a non-zero size.
        let block = unsafe { std::alloc::alloc(layout) };
        let Some(block) = NonNull::new(block) else {
            std::alloc::handle_alloc_error(layout)
        };
        self.block = block;
        self.layout = layout;
    }

    /// Frees the block, if any.
    fn free(&mut self) {
        if self.layout.size() > 0 {
            // SAFETY: allocated by `grow` with exactly this layout, and not
            // freed since (`layout` is reset to size zero below).
            unsafe { std::alloc::dealloc(self.block.as_ptr(), self.layout) };
            self.block = NonNull::dangling();
            self.layout = Layout::from_size_align(0, 1).expect("a zero layout");
        }
    }
}

impl Drop for FutureSlot {
    fn drop(&mut self) {
        // A leaked `SlotFuture`'s future may be pinned in the block (S2):
        // then the block is leaked with it.
        if !self.busy {
            self.free();
        }
    }
}

/// A future living in a [`FutureSlot`]: polls it in place, drops it in
/// place (S2).
#[must_use = "futures do nothing unless polled"]
pub struct SlotFuture<'a, T> {
    fut: NonNull<dyn Future<Output = T> + 'a>,
    /// The slot's `busy` flag, cleared once the future is dropped; holding
    /// the slot's borrow (S1).
    busy: &'a mut bool,
}

impl<T> Future for SlotFuture<'_, T> {
    type Output = T;
    #[inline]
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        // SAFETY: the future lives in the slot's block, which does not move
        // or get reused or freed while this value lives (S1), and is dropped
        // in place before the block is used again (S2): it is pinned.
        // `self.fut` is valid and not aliased (this value is its only
        // reference).
        unsafe { Pin::new_unchecked(self.fut.as_mut()) }.poll(cx)
    }
}

impl<T> Drop for SlotFuture<'_, T> {
    #[inline]
    fn drop(&mut self) {
        // SAFETY: the future was written by `put` and not dropped since (S2:
        // only this drop drops it, once).
        unsafe { std::ptr::drop_in_place(self.fut.as_ptr()) };
        *self.busy = false;
    }
}

impl<T> Unpin for SlotFuture<'_, T> {}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;
    use std::rc::Rc;

    /// Counts its drops.
    struct Dropped(Rc<Cell<u32>>);
    impl Drop for Dropped {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }

    #[test]
    fn futures_run_in_place_are_dropped_once_and_the_block_is_reused() {
        let drops = Rc::new(Cell::new(0));
        let mut slot = FutureSlot::new();
        assert_eq!(slot.capacity(), 0);
        for i in 0..10u64 {
            let d = Dropped(drops.clone());
            let out = crate::exec::block_on(slot.put(async move {
                let _d = d;
                crate::exec::yield_now().await;
                i * 2
            }));
            assert_eq!(out, i * 2);
            assert_eq!(drops.get(), i as u32 + 1, "dropped once, in place");
        }
        let cap = slot.capacity();
        assert!(cap >= MIN_BYTES);
        // A larger future grows the block; a smaller one reuses it.
        let big = [7u8; 4000];
        let n = crate::exec::block_on(
            slot.put(async move { big.iter().map(|&b| b as u32).sum::<u32>() }),
        );
        assert_eq!(n, 7 * 4000);
        assert!(slot.capacity() >= 4000);
        let grown = slot.capacity();
        assert_eq!(crate::exec::block_on(slot.put(async { 5 })), 5);
        assert_eq!(slot.capacity(), grown, "reused, not reallocated");
        // Over-aligned futures are aligned.
        #[repr(align(256))]
        struct Aligned(u8);
        let a = Aligned(3);
        let mut f = slot.put(async move {
            let r = &a;
            assert_eq!(r as *const Aligned as usize % 256, 0);
            r.0
        });
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert_eq!(Pin::new(&mut f).poll(&mut cx), Poll::Ready(3));
    }

    /// `put_with` makes the future only once the block has room for it,
    /// runs and drops it in place like `put`'s, reuses the block, and a
    /// `make` that panics leaves the slot free (nothing written, `busy`
    /// not set): the next future goes into the same block. Fails if
    /// `busy` is set before `make` runs (the block is then abandoned) or
    /// if the future is made before the room (a grown block's first
    /// future would be written into the old one).
    #[test]
    fn a_future_made_in_its_slot_runs_there_once_and_a_panicking_make_leaves_it_free() {
        let drops = Rc::new(Cell::new(0));
        let mut slot = FutureSlot::new();
        for i in 0..4u64 {
            let d = Dropped(drops.clone());
            let out = crate::exec::block_on(slot.put_with(|| async move {
                let _d = d;
                crate::exec::yield_now().await;
                i + 1
            }));
            assert_eq!(out, i + 1);
            assert_eq!(drops.get(), i as u32 + 1, "dropped once, in place");
        }
        let block = slot.block.as_ptr() as usize;
        // A larger future grows the block before it is made.
        let big = [3u8; 2000];
        let n = crate::exec::block_on(
            slot.put_with(|| async move { big.iter().map(|&b| b as u32).sum::<u32>() }),
        );
        assert_eq!(n, 3 * 2000);
        assert!(slot.capacity() >= 2000);
        let grown = slot.block.as_ptr() as usize;
        assert_ne!(grown, block);
        // A panicking `make`: nothing is written and the block stays free.
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let _f = slot.put_with(|| -> std::future::Ready<u32> { panic!("in make") });
        }));
        assert!(caught.is_err());
        assert!(!slot.busy, "a panicking make leaves the slot free");
        assert_eq!(crate::exec::block_on(slot.put_with(|| async { 9 })), 9);
        assert_eq!(
            slot.block.as_ptr() as usize,
            grown,
            "the same block, reused"
        );
    }

    #[test]
    fn a_future_dropped_unfinished_is_dropped_and_a_leaked_one_keeps_its_block() {
        let drops = Rc::new(Cell::new(0));
        let mut slot = FutureSlot::new();
        let d = Dropped(drops.clone());
        let mut f = slot.put(async move {
            let _d = d;
            std::future::pending::<()>().await;
        });
        let mut cx = Context::from_waker(std::task::Waker::noop());
        assert!(Pin::new(&mut f).poll(&mut cx).is_pending());
        drop(f);
        assert_eq!(drops.get(), 1, "an unfinished future is dropped too");
        // A leaked one: never dropped, and its block is not reused (S2).
        let d = Dropped(drops.clone());
        let f = slot.put(async move {
            let _d = d;
            std::future::pending::<()>().await;
        });
        let mut f = std::mem::ManuallyDrop::new(f);
        assert!(Pin::new(&mut *f).poll(&mut cx).is_pending());
        let leaked_at = slot.block.as_ptr() as usize;
        assert_eq!(crate::exec::block_on(slot.put(async { 1 })), 1);
        assert_ne!(slot.block.as_ptr() as usize, leaked_at, "a new block");
        assert_eq!(drops.get(), 1, "the leaked future was not dropped");
        // A panicking poll still drops the future (on unwinding).
        let d = Dropped(drops.clone());
        let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            crate::exec::block_on(slot.put(async move {
                let _d = d;
                panic!("inside the future");
            }))
        }));
        assert!(caught.is_err());
        assert_eq!(drops.get(), 2);
        assert_eq!(crate::exec::block_on(slot.put(async { 2 })), 2);
    }
}
