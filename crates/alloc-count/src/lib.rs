//! A global allocator that counts the allocations made on each thread, for
//! test binaries that assert a warm path allocates nothing (api's
//! `slot_alloc`, rpc-btree's `get_alloc`, rpc-hash's `recycle`).
//!
//! It has no dmkv dependency of its own, so any crate's tests can use it
//! (the api crate included: `dmkv-testkit` depends on the api, so a
//! counter kept there would be a dependency cycle). A test binary installs
//! it with
//!
//! ```ignore
//! #[global_allocator]
//! static GLOBAL: dmkv_alloc_count::Counting = dmkv_alloc_count::Counting;
//! ```
//!
//! and reads [`allocs`] before and after the path. Other threads'
//! allocations (a handler thread's) are not counted on the test's thread.

use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;

/// Forwards to [`System`], counting each allocation on its thread.
pub struct Counting;

thread_local! {
    static ALLOCS: Cell<u64> = const { Cell::new(0) };
}

// SAFETY: every call is forwarded to `System` unchanged; the counter is a
// const-initialised thread-local without a destructor (no allocation).
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        let _ = ALLOCS.try_with(|n| n.set(n.get() + 1));
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded; `ptr` came from `System` with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

/// Allocations made so far on this thread (counted only where [`Counting`]
/// is the global allocator).
pub fn allocs() -> u64 {
    ALLOCS.with(|n| n.get())
}
