//! dmkv's global allocator: mimalloc, called so that its fast path is taken.
//!
//! The `mimalloc` crate (0.1.52, `src/lib.rs`) implements `GlobalAlloc` by
//! sending every request to the aligned entry points, whatever the layout:
//! `alloc` -> `mi_malloc_aligned(size, align)`, `alloc_zeroed` ->
//! `mi_zalloc_aligned`, `realloc` -> `mi_realloc_aligned`, `dealloc` ->
//! `mi_free`. mimalloc's aligned fast path (v3 `src/alloc-aligned.c`,
//! `mi_theap_malloc_zero_aligned_at`) only pops a page's `free` list; when
//! that list is empty it goes to the generic aligned path, which does not
//! look at the page's `local_free` list first and may over-allocate. A box
//! freed and allocated again on every GET (the API's boxed op future) always
//! sits on `local_free`, so each GET paid the generic path, ~150
//! instructions (docs/performance.md, "Seventh pass"). `mi_malloc`'s fast
//! path collects `local_free` when `free` is empty and stays cheap.
//!
//! So [`MiMalloc`] calls the plain entry points (`mi_malloc`, `mi_zalloc`,
//! `mi_realloc`) whenever their alignment guarantee covers the layout, and
//! the aligned ones otherwise; `mi_free` frees both kinds.
//!
//! The guarantee relied on (invariant 1): a block returned by `mi_malloc(n)`
//! is aligned to `min(MI_MAX_ALIGN_SIZE, a)` for every power of two `a <= n`,
//! with `MI_MAX_ALIGN_SIZE` = 16 on x86-64 and aarch64. It is C's guarantee
//! for `malloc` (memory suitably aligned for any object of that size with
//! fundamental alignment, `_Alignof(max_align_t)` = 16), which mimalloc
//! keeps as a drop-in `malloc`: its size classes are whole multiples of 16
//! bytes from 16 up (v3 `src/page-queue.c`, `MI_ALIGN2W`), every page's
//! first block starts at `MI_PAGE_MIN_START_BLOCK_ALIGN` = `MI_MAX_ALIGN_SIZE`
//! (`include/mimalloc/types.h`), and `_mi_page_malloc_zero` asserts exactly
//! this (`src/alloc.c`: `block_size < MI_MAX_ALIGN_SIZE ||
//! _mi_is_aligned(block, MI_MAX_ALIGN_SIZE)`). It is the same rule Rust's own
//! `System` allocator uses on Unix (`align <= MIN_ALIGN && align <= size`
//! -> plain `malloc`). The unit tests below check it for every alignment
//! from 1 to 4096 and sizes around each size class boundary.

#![cfg_attr(not(test), no_std)]

use core::alloc::{GlobalAlloc, Layout};
use core::ffi::c_void;

use libmimalloc_sys as ffi;

/// The alignment `mi_malloc` guarantees for a block of at least this many
/// bytes (mimalloc's `MI_MAX_ALIGN_SIZE`, `sizeof(max_align_t)` on the
/// 64-bit targets dmkv builds for).
pub const MI_MAX_ALIGN_SIZE: usize = 16;

/// Whether a block of `size` bytes from the plain (unaligned) entry points
/// is aligned to `align` (invariant 1 in the crate doc).
#[inline(always)]
fn plain_fits(align: usize, size: usize) -> bool {
    align <= MI_MAX_ALIGN_SIZE && align <= size
}

/// mimalloc as Rust's global allocator, entered through `mi_malloc` where
/// its alignment suffices (see the crate documentation).
pub struct MiMalloc;

// SAFETY: every method returns either null (mimalloc's out-of-memory answer,
// which `GlobalAlloc` allows) or a block of at least `layout.size()` bytes
// aligned to `layout.align()`: from the plain entry points only when
// `plain_fits` holds (invariant 1), otherwise from the aligned entry points,
// whose documented contract is a block aligned to the requested power of
// two (`Layout` guarantees `align` is a nonzero power of two). Blocks from
// either family are freed and resized by `mi_free`/`mi_realloc*`, which
// mimalloc documents as accepting any pointer its allocation functions
// returned (aligned blocks included: `mi_free` finds the block's page from
// the pointer and undoes the alignment offset). mimalloc is thread-safe and
// allows a block to be freed by another thread than the one that allocated
// it, as `GlobalAlloc` requires.
unsafe impl GlobalAlloc for MiMalloc {
    #[inline]
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        if plain_fits(layout.align(), layout.size()) {
            // SAFETY: `mi_malloc` accepts any size; the block is aligned to
            // `layout.align()` by invariant 1, since `plain_fits` holds.
            unsafe { ffi::mi_malloc(layout.size()) as *mut u8 }
        } else {
            // SAFETY: `layout.align()` is a power of two, as
            // `mi_malloc_aligned` requires.
            unsafe { ffi::mi_malloc_aligned(layout.size(), layout.align()) as *mut u8 }
        }
    }

    #[inline]
    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        if plain_fits(layout.align(), layout.size()) {
            // SAFETY: as in `alloc`; `mi_zalloc` is `mi_malloc` plus zeroing.
            unsafe { ffi::mi_zalloc(layout.size()) as *mut u8 }
        } else {
            // SAFETY: as in `alloc`.
            unsafe { ffi::mi_zalloc_aligned(layout.size(), layout.align()) as *mut u8 }
        }
    }

    #[inline]
    unsafe fn dealloc(&self, ptr: *mut u8, _layout: Layout) {
        // SAFETY: the caller passes a block this allocator returned, i.e.
        // one from mimalloc's plain or aligned entry points, which `mi_free`
        // accepts alike.
        unsafe { ffi::mi_free(ptr as *mut c_void) }
    }

    #[inline]
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        if plain_fits(layout.align(), new_size) {
            // SAFETY: `ptr` came from this allocator (caller's contract).
            // `mi_realloc` either keeps the block in place (then its address
            // already satisfied `layout.align()`) or returns a fresh
            // `mi_malloc(new_size)` block, aligned by invariant 1; it copies
            // the first `min(old, new)` bytes and frees the old block.
            unsafe { ffi::mi_realloc(ptr as *mut c_void, new_size) as *mut u8 }
        } else {
            // SAFETY: as above; `mi_realloc_aligned` keeps or returns a block
            // aligned to `layout.align()`, a power of two.
            unsafe {
                ffi::mi_realloc_aligned(ptr as *mut c_void, new_size, layout.align()) as *mut u8
            }
        }
    }
}

#[cfg(test)]
mod tests;
