//! The allocator against its contract: every block aligned as asked, zeroed
//! when asked, and `realloc` keeping the contents across the plain/aligned
//! boundary (the model the data path relies on is in the crate doc).

use super::*;
use std::vec::Vec;

/// Alignments 1, 2, 4, ..., 4096.
fn alignments() -> impl Iterator<Item = usize> {
    (0..=12).map(|s| 1usize << s)
}

/// Every size up to 80 (mimalloc's small classes, 8 and the 16-byte
/// multiples), sizes either side of larger class and page boundaries, and a
/// few in mimalloc's large and huge ranges.
fn sizes() -> Vec<usize> {
    let mut v: Vec<usize> = (1..=80).collect();
    for b in [96, 127, 128, 129, 1000, 1023, 1024, 1025, 4095, 4096, 4097] {
        v.push(b);
    }
    for b in [65_537, 600_000, 5 << 20] {
        v.push(b);
    }
    v
}

/// A byte pattern that differs per position and per block.
fn pattern(seed: usize, i: usize) -> u8 {
    (i.wrapping_mul(31) ^ seed.wrapping_mul(7)) as u8
}

/// Allocates, checks alignment, fills with a pattern; returns the block.
fn fill(layout: Layout, seed: usize) -> *mut u8 {
    // SAFETY: sizes() has no zero size; the block is released by the caller.
    let p = unsafe { MiMalloc.alloc(layout) };
    assert!(!p.is_null(), "alloc({layout:?}) returned null");
    assert_eq!(
        p as usize % layout.align(),
        0,
        "alloc({layout:?}) misaligned: {p:p}"
    );
    for i in 0..layout.size() {
        // SAFETY: `p` holds `layout.size()` bytes.
        unsafe { p.add(i).write(pattern(seed, i)) };
    }
    p
}

fn check(p: *const u8, len: usize, seed: usize, what: &str) {
    for i in 0..len {
        // SAFETY: the caller passes a live block of at least `len` bytes.
        let b = unsafe { p.add(i).read() };
        assert_eq!(b, pattern(seed, i), "{what}: byte {i} changed");
    }
}

#[test]
fn blocks_are_aligned_and_hold_their_bytes_for_alignments_1_to_4096() {
    for align in alignments() {
        // Allocate all sizes at once (so blocks share pages and neighbours
        // would be overwritten by a too-small block), then check them all.
        let blocks: Vec<(Layout, *mut u8)> = sizes()
            .into_iter()
            .enumerate()
            .map(|(seed, size)| {
                let l = Layout::from_size_align(size, align).unwrap();
                (l, fill(l, seed))
            })
            .collect();
        for (seed, (l, p)) in blocks.iter().enumerate() {
            check(*p, l.size(), seed, &format!("{l:?}"));
        }
        for (l, p) in blocks {
            // SAFETY: allocated above with this layout, freed once.
            unsafe { MiMalloc.dealloc(p, l) };
        }
    }
}

#[test]
fn a_block_freed_and_allocated_again_stays_aligned() {
    // The data path's pattern (a boxed future freed and allocated again
    // each GET): the block comes back from the page's `local_free` list.
    for align in alignments() {
        for size in [8, 16, 24, 40, 48, 200, 864, 1000, 4096] {
            let l = Layout::from_size_align(size, align).unwrap();
            let keep = fill(l, 1);
            for round in 0..64 {
                let p = fill(l, round);
                check(p, size, round, "reused block");
                // SAFETY: allocated just above with `l`.
                unsafe { MiMalloc.dealloc(p, l) };
            }
            check(keep, size, 1, "block kept across the reuse");
            // SAFETY: allocated above with `l`.
            unsafe { MiMalloc.dealloc(keep, l) };
        }
    }
}

#[test]
fn alloc_zeroed_is_zero_and_aligned() {
    for align in alignments() {
        for size in sizes() {
            let l = Layout::from_size_align(size, align).unwrap();
            // Dirty a block of the same class first, so a zeroed block that
            // reuses it must really be cleared.
            let dirty = fill(l, 3);
            // SAFETY: allocated above with `l`.
            unsafe { MiMalloc.dealloc(dirty, l) };
            // SAFETY: nonzero size.
            let p = unsafe { MiMalloc.alloc_zeroed(l) };
            assert!(!p.is_null());
            assert_eq!(p as usize % align, 0, "alloc_zeroed({l:?}) misaligned");
            // SAFETY: `p` holds `size` bytes.
            let bytes = unsafe { std::slice::from_raw_parts(p, size) };
            assert!(
                bytes.iter().all(|&b| b == 0),
                "alloc_zeroed({l:?}) not zero"
            );
            // SAFETY: allocated above with `l`.
            unsafe { MiMalloc.dealloc(p, l) };
        }
    }
}

#[test]
fn realloc_keeps_contents_and_alignment_across_sizes_and_alignments() {
    // Grow and shrink through sizes that switch between the plain and the
    // aligned entry points (size below and above the alignment, alignment
    // below and above 16), checking the preserved prefix at every step.
    let steps = [
        1, 8, 15, 16, 24, 33, 100, 4095, 4096, 9000, 70_000, 40, 3, 2048, 17,
    ];
    for align in alignments() {
        let mut l = Layout::from_size_align(steps[0], align).unwrap();
        let mut p = fill(l, 0);
        for (k, &new_size) in steps.iter().enumerate().skip(1) {
            let keep = l.size().min(new_size);
            // SAFETY: `p` is live with layout `l`; `new_size` is nonzero and,
            // rounded up to `align`, far below isize::MAX.
            let q = unsafe { MiMalloc.realloc(p, l, new_size) };
            assert!(!q.is_null());
            assert_eq!(
                q as usize % align,
                0,
                "realloc {l:?} -> {new_size} misaligned"
            );
            check(q, keep, k - 1, &format!("realloc {l:?} -> {new_size}"));
            l = Layout::from_size_align(new_size, align).unwrap();
            // Refill with this step's pattern for the next check.
            for i in 0..new_size {
                // SAFETY: `q` holds `new_size` bytes.
                unsafe { q.add(i).write(pattern(k, i)) };
            }
            p = q;
        }
        // SAFETY: the last block, with its layout.
        unsafe { MiMalloc.dealloc(p, l) };
    }
}

#[test]
fn the_plain_path_is_taken_only_where_mimalloc_guarantees_the_alignment() {
    assert!(plain_fits(1, 1));
    assert!(plain_fits(8, 8));
    assert!(plain_fits(16, 24));
    assert!(!plain_fits(16, 8), "a block of 8 bytes is only 8-aligned");
    assert!(
        !plain_fits(32, 64),
        "alignments above 16 take the aligned path"
    );
    assert!(!plain_fits(4096, 4096));
}
