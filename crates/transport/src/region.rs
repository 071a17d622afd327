//! Registered memory: the bytes behind a region, accessed only atomically.
//!
//! One-sided verbs from other nodes and the serving node's own code access
//! the same bytes at the same time, as with RDMA. To keep that sound in Rust
//! every access goes through `AtomicU64` words: 8-byte aligned words are
//! single-copy atomic, reads load words in increasing address order with
//! acquire ordering, and writes store them in increasing address order with
//! release ordering. A read that races a write may therefore see some words
//! old and some new (a torn read), exactly as the transport contract allows,
//! but never a torn word. Partial words at the edges of a write are merged in
//! by compare-and-swap so neighbouring bytes are never clobbered.
//!
//! This module holds the crate's only `unsafe` code: the allocation of the
//! word array, the view of externally owned memory (UCX pools), and the word
//! copy of a read (`copy_words_to`: one atomic load and one plain store per
//! word, unrolled, into the reader's buffer or its spare capacity, so a read
//! costs no zero-filling and no per-byte bookkeeping).

use std::alloc::Layout;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use thiserror::Error;

/// Regions are allocated in multiples of this (one cache line).
pub const REGION_ALIGN: usize = 64;

/// An access outside the region or a misaligned atomic.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum RegionAccessError {
    #[error("offset {offset} + length {len} is outside the region of {size} bytes")]
    OutOfBounds { offset: u64, len: u64, size: u64 },
    #[error("offset {offset} is not 8-byte aligned")]
    Misaligned { offset: u64 },
}

impl RegionAccessError {
    /// The transport error for this access to `addr` (every backend reports
    /// refused accesses alike).
    pub fn at(self, addr: &crate::addr::RemoteAddr) -> crate::error::TransportError {
        use crate::error::TransportError;
        match self {
            RegionAccessError::OutOfBounds { offset, len, size } => TransportError::OutOfBounds {
                node: addr.node,
                region: addr.region,
                offset,
                len,
                size,
            },
            RegionAccessError::Misaligned { offset } => TransportError::Misaligned { offset },
        }
    }
}

/// A region a backend registered in this process: its access key and memory.
pub(crate) struct RegionEntry {
    pub(crate) key: crate::addr::AccessKey,
    pub(crate) mem: std::sync::Arc<RegionMem>,
}

/// Registers `len` zeroed bytes on `node` in a backend's region table (the
/// `local` and `sim` backends share it): a fresh random key, the next id.
pub(crate) fn register_zeroed(
    regions: &parking_lot::RwLock<Vec<Option<RegionEntry>>>,
    node: crate::addr::NodeId,
    len: usize,
) -> crate::error::Result<(crate::addr::RemoteRegion, std::sync::Arc<RegionMem>)> {
    use crate::addr::{AccessKey, RegionId, RemoteRegion};
    let key = AccessKey(rand::random());
    let mut regions = regions.write();
    let id = RegionId(u32::try_from(regions.len()).expect("fewer than 2^32 regions"));
    let mut mem = RegionMem::zeroed(len).ok_or_else(|| {
        crate::error::TransportError::Backend(format!("cannot allocate a region of {len} bytes"))
    })?;
    // Deterministic (registration order), so `sim`'s cache model replays.
    mem.sim_tag = crate::sim::region_tag(node.0, id.0);
    let mem = std::sync::Arc::new(mem);
    let remote = RemoteRegion {
        node,
        id,
        key,
        len: mem.len() as u64,
    };
    regions.push(Some(RegionEntry {
        key,
        mem: mem.clone(),
    }));
    Ok((remote, mem))
}

enum Backing {
    /// Allocated here with this layout; freed on drop.
    Heap(Layout),
    /// Owned by someone else (e.g. a UCX memory handle) and kept alive by
    /// this value until the region drops.
    External(#[allow(dead_code)] Box<dyn Send + Sync>),
}

/// The memory of one registered region.
pub struct RegionMem {
    words: NonNull<AtomicU64>,
    len_words: usize,
    backing: Backing,
    /// Which node and region this is, for `sim`'s memory-node cache model
    /// (`sim::cache`); untagged if no backend registered it.
    sim_tag: u64,
}

// SAFETY: the memory is only ever accessed through `&AtomicU64`, which is
// `Sync`; the pointer is owned (or kept alive by `backing`) for the lifetime
// of the value.
unsafe impl Send for RegionMem {}
// SAFETY: as above.
unsafe impl Sync for RegionMem {}

impl RegionMem {
    /// Allocates `len` bytes (rounded up to a cache line), zeroed. Large
    /// regions are mapped lazily by the OS, so reserving generously is cheap.
    /// A region of at least [`HUGE_PAGE`] bytes is aligned to it and asks
    /// for transparent huge pages ([`advise_huge_pages`]), as the papers'
    /// artifacts register huge-page memory with their NICs.
    pub fn zeroed(len: usize) -> Option<RegionMem> {
        let len = len.max(REGION_ALIGN).div_ceil(REGION_ALIGN) * REGION_ALIGN;
        let align = if len >= HUGE_PAGE {
            HUGE_PAGE
        } else {
            REGION_ALIGN
        };
        let layout = Layout::from_size_align(len, align).ok()?;
        // SAFETY: `layout` has non-zero size.
        let ptr = unsafe { std::alloc::alloc_zeroed(layout) };
        let words = NonNull::new(ptr.cast::<AtomicU64>())?;
        if len >= HUGE_PAGE {
            advise_huge_pages(ptr, len);
        }
        Some(RegionMem {
            words,
            len_words: len / 8,
            backing: Backing::Heap(layout),
            sim_tag: crate::sim::UNTAGGED,
        })
    }

    /// Views memory owned elsewhere as a region.
    ///
    /// # Safety
    /// `ptr` must be 8-byte aligned and valid for reads and writes of `len`
    /// bytes for as long as `owner` lives, and while this region exists that
    /// memory must be accessed only atomically (through regions or by
    /// hardware that performs 8-byte-atomic accesses, such as an RDMA NIC).
    pub unsafe fn from_raw(ptr: *mut u8, len: usize, owner: Box<dyn Send + Sync>) -> RegionMem {
        assert_eq!(ptr as usize % 8, 0, "region memory must be 8-byte aligned");
        let words = NonNull::new(ptr.cast::<AtomicU64>()).expect("non-null region memory");
        RegionMem {
            words,
            len_words: len / 8,
            backing: Backing::External(owner),
            sim_tag: crate::sim::UNTAGGED,
        }
    }

    #[inline]
    fn words(&self) -> &[AtomicU64] {
        // SAFETY: `words` points to `len_words` initialised 8-byte words that
        // live as long as `self` (see `zeroed` and `from_raw`); `AtomicU64`
        // has the size and alignment of `u64`, and zero is a valid value.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr(), self.len_words) }
    }

    /// The `n` words from word `first` on, which the caller has checked
    /// lie inside the region (`check` passed for `8 * first` and `8 * n`):
    /// the slice without a second bounds check (debug builds assert it).
    #[inline(always)]
    #[allow(unsafe_code)]
    fn words_checked(&self, first: usize, n: usize) -> &[AtomicU64] {
        debug_assert!(first.checked_add(n).is_some_and(|e| e <= self.len_words));
        // SAFETY: the caller guarantees `first + n <= len_words` (its
        // `check` of the byte span passed), so the `n` words from `first`
        // lie in the `len_words` initialised words `words` points to, which
        // live as long as `self` (as in `words`).
        unsafe { std::slice::from_raw_parts(self.words.as_ptr().add(first), n) }
    }

    /// Size in bytes.
    #[inline]
    pub fn len(&self) -> usize {
        self.len_words * 8
    }

    pub fn is_empty(&self) -> bool {
        self.len_words == 0
    }

    /// The base address, for backends that must hand it to hardware.
    pub fn base_ptr(&self) -> *mut u8 {
        self.words.as_ptr().cast()
    }

    /// Checks that `[offset, offset + len)` lies inside the region.
    #[inline]
    pub fn check(&self, offset: u64, len: u64) -> Result<(), RegionAccessError> {
        let size = self.len() as u64;
        match offset.checked_add(len) {
            Some(end) if end <= size => Ok(()),
            _ => Err(RegionAccessError::OutOfBounds { offset, len, size }),
        }
    }

    /// The 8-byte word at `offset`, which must be aligned.
    #[inline]
    pub fn word(&self, offset: u64) -> Result<&AtomicU64, RegionAccessError> {
        crate::sim::touch(self.sim_tag, self.words.as_ptr() as u64, offset, 8);
        self.word_untouched(offset)
    }

    /// The aligned words of `[offset, offset + len)`, for code on the node
    /// that reads a structure in place (a tree walk) instead of copying it:
    /// one bounds check and one `sim` touch for the whole span (as a
    /// [`RegionMem::read`] of it would cost), then plain atomic loads.
    /// Always inlined: handlers call it on every request (Outback's GET
    /// twice), and the call's register saves cost more than its checks
    /// (plain `#[inline]` was measured not to be taken there).
    #[inline(always)]
    pub fn words_in(&self, offset: u64, len: usize) -> Result<&[AtomicU64], RegionAccessError> {
        let words = self.words_in_untouched(offset, len)?;
        self.touch_span(offset, len as u64);
        Ok(words)
    }

    /// [`RegionMem::words_in`] without the `sim` touch, for code that
    /// reports what it reads of the span itself, a line at a time
    /// ([`RegionMem::touch_span`]): xtree's walk, which reads two to four of
    /// an inner node's five lines (docs/xtree.md, invariant 10).
    #[inline(always)]
    pub fn words_in_untouched(
        &self,
        offset: u64,
        len: usize,
    ) -> Result<&[AtomicU64], RegionAccessError> {
        if !offset.is_multiple_of(8) || !len.is_multiple_of(8) {
            return Err(RegionAccessError::Misaligned { offset });
        }
        self.check(offset, len as u64)?;
        let first = (offset / 8) as usize;
        Ok(&self.words()[first..first + len / 8])
    }

    /// Whether a touch on the calling thread counts now (under `sim`, on a
    /// metered memory-node core or in a counted compute operation): code
    /// that reports a run of touches itself ([`RegionMem::touch_span`]),
    /// with nothing in between that could switch metering on or off, reads
    /// it once and skips them while false (always off `sim`).
    #[inline(always)]
    pub fn touches_counted() -> bool {
        crate::sim::lines_metered()
    }

    /// Reports `[offset, offset + len)` as touched, as an access to it
    /// through [`RegionMem::words_in`] would (one `sim` touch; nothing off
    /// `sim`). For spans taken by [`RegionMem::words_in_untouched`]: it
    /// checks no bounds itself.
    #[inline(always)]
    pub fn touch_span(&self, offset: u64, len: u64) {
        crate::sim::touch(self.sim_tag, self.words.as_ptr() as u64, offset, len);
    }

    /// Hints the CPU to start loading the lines of `[offset, offset + len)`
    /// into its caches (at most the first [`PREFETCH_MAX_LINES`]), the way a
    /// posted RDMA verb starts its DMA while the CPU goes on: nothing is
    /// read, no byte changes, and lines outside the region are not hinted
    /// (the verb's own execution refuses such a span). A hint only: the verb later loads
    /// the words as every access does. A no-op off x86_64.
    #[inline(always)]
    pub(crate) fn prefetch(&self, offset: u64, len: u64) {
        let first = offset & !(REGION_ALIGN as u64 - 1);
        // Clipped to the region: every hinted line starts inside it.
        let end = offset
            .saturating_add(len)
            .min(first.saturating_add((PREFETCH_MAX_LINES * REGION_ALIGN) as u64))
            .min(self.len() as u64);
        let base = self.words.as_ptr().cast::<u8>();
        let mut at = first;
        while at < end {
            prefetch_line(base.wrapping_add(at as usize));
            at += REGION_ALIGN as u64;
        }
    }

    /// Copies `out.len()` bytes starting at `offset` into `out`, loading words
    /// in increasing address order.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), RegionAccessError> {
        self.check(offset, out.len() as u64)?;
        crate::sim::touch(
            self.sim_tag,
            self.words.as_ptr() as u64,
            offset,
            out.len() as u64,
        );
        let words = self.words();
        let mut pos = offset as usize;
        let mut out = out;
        // A leading partial word.
        if !pos.is_multiple_of(8) && !out.is_empty() {
            let in_word = pos % 8;
            let n = (8 - in_word).min(out.len());
            let w = words[pos / 8].load(Ordering::Acquire).to_le_bytes();
            out[..n].copy_from_slice(&w[in_word..in_word + n]);
            out = &mut out[n..];
            pos += n;
        }
        // Whole words: one 8-byte load and one 8-byte store each (the common
        // case, since engines read aligned slots and nodes).
        let whole = out.len() / 8;
        let first = pos / 8;
        let (body, tail) = out.split_at_mut(whole * 8);
        copy_words(&words[first..first + whole], body);
        // A trailing partial word.
        if !tail.is_empty() {
            let w = words[first + whole].load(Ordering::Acquire).to_le_bytes();
            let n = tail.len();
            tail.copy_from_slice(&w[..n]);
        }
        Ok(())
    }

    /// Reads `len` bytes into a new vector.
    pub fn read_vec(&self, offset: u64, len: usize) -> Result<Vec<u8>, RegionAccessError> {
        let mut v = Vec::new();
        self.read_to_vec(offset, len, &mut v)?;
        Ok(v)
    }

    /// [`RegionMem::read_vec`] reported to no `sim` cache: a read that no
    /// core makes, such as a NIC's DMA read of registered memory
    /// (ScaleStore's page delivery, `PageRef::dma_bytes`). The same checks,
    /// word loads and bytes as `read_vec`.
    pub fn read_vec_untouched(
        &self,
        offset: u64,
        len: usize,
    ) -> Result<Vec<u8>, RegionAccessError> {
        let mut v = Vec::new();
        self.read_into(offset, len, &mut v, false)?;
        Ok(v)
    }

    /// Replaces the contents of `out` with the `len` bytes at `offset`
    /// (keeping its capacity, so a reused buffer allocates nothing). Loads
    /// words in increasing address order, like [`RegionMem::read`]; on an
    /// error `out` is left empty. Inlined: it is every read verb's copy, and
    /// a call costs the read more than its checks.
    #[inline]
    pub fn read_to_vec(
        &self,
        offset: u64,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), RegionAccessError> {
        self.read_into(offset, len, out, crate::sim::lines_metered())
    }

    /// [`RegionMem::read_to_vec`] for a caller that read
    /// [`crate::sim::lines_metered`] once for several reads in a row (a
    /// batch's reads: nothing between them can switch the metering on or
    /// off): with `metered` false the `sim` touch, which would return at its
    /// first check, is skipped. Always inlined into the batch's loop, so an
    /// aligned read is its checks, the capacity check and the word copy.
    #[inline(always)]
    pub(crate) fn read_into(
        &self,
        offset: u64,
        len: usize,
        out: &mut Vec<u8>,
        metered: bool,
    ) -> Result<(), RegionAccessError> {
        out.clear();
        self.check(offset, len as u64)?;
        if !(offset | len as u64).is_multiple_of(8) {
            return self.read_unaligned_into(offset, len, out);
        }
        if metered {
            crate::sim::touch(self.sim_tag, self.words.as_ptr() as u64, offset, len as u64);
        }
        let first = (offset / 8) as usize;
        // In bounds: `check` passed and `offset` and `len` are whole words
        // (so the slice is taken without checking it again).
        let src = self.words_checked(first, len / 8);
        // No zero-filling first: the words are stored straight into the
        // vector's spare capacity.
        // Exactly: a buffer's capacity is then the largest read it served
        // or what it had in the pool, never a doubling beyond both (the
        // pool's bound B1 then holds for a batch's list without looking at
        // its entries, `BatchResult`'s `oversized`).
        if out.capacity() < len {
            out.reserve_exact(len);
        }
        // SAFETY: `out` is empty with capacity for at least `len` bytes, so
        // its first `len` bytes are writable; `copy_words_to` stores exactly
        // `8 * src.len() == len` bytes there (it cannot panic part-way), so
        // all of them are initialised when the length is set.
        unsafe {
            copy_words_to(src, out.as_mut_ptr());
            out.set_len(len);
        }
        Ok(())
    }

    /// A read that starts or ends inside a word, into `out` (empty): zeroed
    /// and then read through [`RegionMem::read`] (which touches for `sim`
    /// itself). Out of line: engines read whole words.
    #[inline(never)]
    #[cold]
    fn read_unaligned_into(
        &self,
        offset: u64,
        len: usize,
        out: &mut Vec<u8>,
    ) -> Result<(), RegionAccessError> {
        // Exactly, as in `read_into`.
        out.reserve_exact(len);
        out.resize(len, 0);
        let r = self.read(offset, out);
        if r.is_err() {
            out.clear();
        }
        r
    }
    /// A write verb's store of `data` at `offset` for a caller that read
    /// [`crate::sim::lines_metered`] once for a batch (as
    /// [`RegionMem::read_into`]): the same checks, `sim` touch (skipped
    /// while `metered` is false, where it would return at its first check)
    /// and word stores, in the same order, as [`RegionMem::write`], which
    /// it calls for an unaligned write. Always inlined into the batch's
    /// loop, so an aligned write is its checks and one release store per
    /// word (eight at a time, like [`copy_words_to`]'s loads).
    #[inline(always)]
    pub(crate) fn write_from(
        &self,
        offset: u64,
        data: &[u8],
        metered: bool,
    ) -> Result<(), RegionAccessError> {
        if !(offset | data.len() as u64).is_multiple_of(8) {
            return self.write_unaligned(offset, data);
        }
        self.check(offset, data.len() as u64)?;
        if metered {
            crate::sim::touch(
                self.sim_tag,
                self.words.as_ptr() as u64,
                offset,
                data.len() as u64,
            );
        }
        let first = (offset / 8) as usize;
        // In bounds: `check` passed and `offset` and the length are whole
        // words.
        store_words(self.words_checked(first, data.len() / 8), data);
        Ok(())
    }

    /// [`RegionMem::write`] out of line, for [`RegionMem::write_from`]'s
    /// rare unaligned case.
    #[inline(never)]
    #[cold]
    fn write_unaligned(&self, offset: u64, data: &[u8]) -> Result<(), RegionAccessError> {
        self.write(offset, data)
    }

    /// The word at `offset` for an atomic verb of a batch, with the checks
    /// and `sim` touch of [`RegionMem::word`] in its order (the touch
    /// first, skipped while `metered` is false as in
    /// [`RegionMem::write_from`]). Always inlined into the batch's loop.
    #[inline(always)]
    pub(crate) fn word_for_verb(
        &self,
        offset: u64,
        metered: bool,
    ) -> Result<&AtomicU64, RegionAccessError> {
        if metered {
            crate::sim::touch(self.sim_tag, self.words.as_ptr() as u64, offset, 8);
        }
        self.word_untouched(offset)
    }

    /// The aligned word at `offset`, checked, without a `sim` touch.
    #[inline(always)]
    fn word_untouched(&self, offset: u64) -> Result<&AtomicU64, RegionAccessError> {
        if !offset.is_multiple_of(8) {
            return Err(RegionAccessError::Misaligned { offset });
        }
        self.check(offset, 8)?;
        Ok(&self.words()[(offset / 8) as usize])
    }

    /// Stores `data` at `offset`, storing words in increasing address order.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionAccessError> {
        self.check(offset, data.len() as u64)?;
        crate::sim::touch(
            self.sim_tag,
            self.words.as_ptr() as u64,
            offset,
            data.len() as u64,
        );
        crate::sim::touch_write(self.sim_tag, offset, data.len() as u64);
        let words = self.words();
        let mut pos = offset as usize;
        let mut data = data;
        // A leading partial word.
        if !pos.is_multiple_of(8) && !data.is_empty() {
            let in_word = pos % 8;
            let n = (8 - in_word).min(data.len());
            merge_into_word(&words[pos / 8], in_word, &data[..n]);
            data = &data[n..];
            pos += n;
        }
        // Whole words: one 8-byte load and one 8-byte store each.
        let whole = data.len() / 8;
        let first = pos / 8;
        let (body, tail) = data.split_at(whole * 8);
        for (src, w) in body.chunks_exact(8).zip(&words[first..first + whole]) {
            let v = u64::from_le_bytes(src.try_into().expect("chunks of 8 bytes"));
            w.store(v, Ordering::Release);
        }
        // A trailing partial word.
        if !tail.is_empty() {
            merge_into_word(&words[first + whole], 0, tail);
        }
        Ok(())
    }

    /// Loads the aligned word at `offset`.
    #[inline]
    pub fn load_u64(&self, offset: u64) -> Result<u64, RegionAccessError> {
        Ok(self.word(offset)?.load(Ordering::Acquire))
    }

    /// Reports `len` bytes at `offset` as stored through references taken
    /// with [`RegionMem::word`] or [`RegionMem::words_in`] (whose stores
    /// the region cannot see): under `sim` with private core caches, the
    /// other cores' copies of those lines are dropped, as a store through
    /// [`RegionMem::store_u64`] drops them. Does nothing else, and nothing
    /// off `sim` or with the private caches off.
    #[inline]
    pub fn note_stored(&self, offset: u64, len: u64) {
        crate::sim::touch_write(self.sim_tag, offset, len);
    }

    /// Stores the aligned word at `offset`.
    #[inline]
    pub fn store_u64(&self, offset: u64, v: u64) -> Result<(), RegionAccessError> {
        self.word(offset)?.store(v, Ordering::Release);
        crate::sim::touch_write(self.sim_tag, offset, 8);
        Ok(())
    }

    /// Compare-and-swap on the aligned word at `offset`; returns the value
    /// found (equal to `expected` iff the swap happened), like RDMA CAS.
    #[inline]
    pub fn cas_u64(&self, offset: u64, expected: u64, new: u64) -> Result<u64, RegionAccessError> {
        let w = self.word(offset)?;
        // Also when it fails: a locked compare-exchange takes the line
        // exclusively either way.
        crate::sim::touch_write(self.sim_tag, offset, 8);
        Ok(
            match w.compare_exchange(expected, new, Ordering::AcqRel, Ordering::Acquire) {
                Ok(v) | Err(v) => v,
            },
        )
    }

    /// Fetch-and-add (wrapping) on the aligned word at `offset`; returns the
    /// previous value, like RDMA FAA.
    #[inline]
    pub fn faa_u64(&self, offset: u64, add: u64) -> Result<u64, RegionAccessError> {
        let w = self.word(offset)?;
        crate::sim::touch_write(self.sim_tag, offset, 8);
        Ok(w.fetch_add(add, Ordering::AcqRel))
    }
}

/// The size of a transparent huge page on x86_64 and most aarch64 kernels.
pub const HUGE_PAGE: usize = 1 << 21;

/// Asks the kernel to back `[ptr, ptr + len)` with transparent huge pages
/// (`madvise(MADV_HUGEPAGE)`; Linux only): at 1M keys a one-sided read's
/// line is also a TLB miss on 4 KiB pages. Advice only: the bytes do not
/// change, and a kernel without THP (or with it off, or a refusal) leaves
/// the region on normal pages; the result is ignored.
#[allow(unsafe_code)]
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    #[cfg(target_os = "linux")]
    // SAFETY: `[ptr, ptr + len)` is one live allocation of ours, aligned
    // to a huge page (so to a page, as madvise needs); MADV_HUGEPAGE only
    // sets a flag on the mapping and never changes or frees its contents.
    unsafe {
        libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE);
    }
    #[cfg(not(target_os = "linux"))]
    let _ = (ptr, len);
}

/// How many lines of a verb [`RegionMem::prefetch`] hints at most (a
/// larger read's later lines are streamed by the hardware prefetcher once
/// the copy walks them in order).
pub(crate) const PREFETCH_MAX_LINES: usize = 8;

/// A prefetch hint for the line holding `p` (into every cache level).
#[inline(always)]
#[allow(unsafe_code)]
fn prefetch_line(p: *const u8) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: a prefetch is a hint: it reads nothing the program sees,
    // writes nothing and never faults, whatever the address (the caller
    // passes addresses inside a live region anyway). SSE, which the
    // intrinsic needs, is part of the x86_64 baseline.
    unsafe {
        std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(p.cast());
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = p;
}

/// Copies `src` into `dst` (8 bytes per word, `dst.len() == 8 * src.len()`),
/// loading the words in increasing address order with acquire ordering.
#[inline]
fn copy_words(src: &[AtomicU64], dst: &mut [u8]) {
    assert_eq!(dst.len(), src.len() * 8);
    // SAFETY: `dst` is a valid, exclusively borrowed buffer of exactly
    // `8 * src.len()` bytes (checked above).
    unsafe { copy_words_to(src, dst.as_mut_ptr()) }
}

/// Stores the words of `src` at `dst` as little-endian bytes, loading them
/// one by one in increasing address order with acquire ordering, exactly as
/// a word-by-word copy would (each load is single-copy atomic; a concurrent
/// writer can tear the read between words, never inside one, which is what
/// the layouts' torn-read checks rely on). Unrolled by eight, then steps
/// of four, two and one word as the count's low bits say: a load and a
/// store per word, the loop's bookkeeping once per eight words (a ROLEX GET
/// copies 116 words in one read; eight-word steps took its copy from ~2.9
/// to ~2.4 instructions a word).
///
/// # Safety
/// `dst` must be valid for writes of `8 * src.len()` bytes (any alignment)
/// and must not overlap the region's memory.
#[inline(always)]
unsafe fn copy_words_to(src: &[AtomicU64], dst: *mut u8) {
    let mut d = dst;
    let mut octs = src.chunks_exact(8);
    for o in &mut octs {
        let (a, b, c, e) = (
            o[0].load(Ordering::Acquire),
            o[1].load(Ordering::Acquire),
            o[2].load(Ordering::Acquire),
            o[3].load(Ordering::Acquire),
        );
        let (f, g, h, i) = (
            o[4].load(Ordering::Acquire),
            o[5].load(Ordering::Acquire),
            o[6].load(Ordering::Acquire),
            o[7].load(Ordering::Acquire),
        );
        // SAFETY: the caller guarantees room for all of `src`'s words; these
        // eight are the next 64 bytes of it. Unaligned stores: `dst` is a
        // byte buffer.
        unsafe {
            d.cast::<u64>().write_unaligned(a.to_le());
            d.add(8).cast::<u64>().write_unaligned(b.to_le());
            d.add(16).cast::<u64>().write_unaligned(c.to_le());
            d.add(24).cast::<u64>().write_unaligned(e.to_le());
            d.add(32).cast::<u64>().write_unaligned(f.to_le());
            d.add(40).cast::<u64>().write_unaligned(g.to_le());
            d.add(48).cast::<u64>().write_unaligned(h.to_le());
            d.add(56).cast::<u64>().write_unaligned(i.to_le());
            d = d.add(64);
        }
    }
    // The last zero to seven words: a step of four, one of two and a
    // single word, each taken if that many words are left, in that order
    // (increasing addresses). Straight-line code: a loop over the last
    // words cost ~17 instructions of set-up per read (a ROLEX GET's 16-byte
    // state read is nothing but this tail).
    let mut rest = octs.remainder();
    if let [a, b, c, e, more @ ..] = rest {
        let (a, b, c, e) = (
            a.load(Ordering::Acquire),
            b.load(Ordering::Acquire),
            c.load(Ordering::Acquire),
            e.load(Ordering::Acquire),
        );
        // SAFETY: the caller guarantees room for all of `src`'s words; these
        // four are the next 32 bytes of it. Unaligned stores: `dst` is a
        // byte buffer.
        unsafe {
            d.cast::<u64>().write_unaligned(a.to_le());
            d.add(8).cast::<u64>().write_unaligned(b.to_le());
            d.add(16).cast::<u64>().write_unaligned(c.to_le());
            d.add(24).cast::<u64>().write_unaligned(e.to_le());
            d = d.add(32);
        }
        rest = more;
    }
    if let [a, b, more @ ..] = rest {
        let (a, b) = (a.load(Ordering::Acquire), b.load(Ordering::Acquire));
        // SAFETY: as above, the next 16 bytes of the destination.
        unsafe {
            d.cast::<u64>().write_unaligned(a.to_le());
            d.add(8).cast::<u64>().write_unaligned(b.to_le());
            d = d.add(16);
        }
        rest = more;
    }
    if let [w] = rest {
        let v = w.load(Ordering::Acquire);
        // SAFETY: as above, the next 8 bytes of the destination.
        unsafe { d.cast::<u64>().write_unaligned(v.to_le()) };
    }
}

/// Stores `src` (8 bytes per word, `src.len() == 8 * dst.len()`) into the
/// words of `dst` in increasing address order with release ordering: one
/// unaligned load from `src` and one atomic store per word, as
/// [`RegionMem::write`]'s whole-word loop does. Shaped like
/// [`copy_words_to`] (i90): eight words a step with the loop's bookkeeping
/// once per step, then straight-line steps of four, two and one word as
/// the count's low bits say. The loads from `src` go through a raw
/// pointer, since the length is asserted once; the slice-indexed version
/// before it paid an iterator pair and two index checks per word
/// (docs/performance.md, twenty-fourth pass).
#[inline(always)]
#[allow(unsafe_code)]
fn store_words(dst: &[AtomicU64], src: &[u8]) {
    assert_eq!(src.len(), dst.len() * 8);
    let mut s = src.as_ptr();
    // The `i`-th word from `s` on, which lies inside `src` wherever it is
    // called below.
    let word = |s: *const u8, i: usize| {
        // SAFETY: `s` points at the source bytes of the words being stored
        // next and `i` is below their count; `src` holds exactly 8 bytes
        // per word of `dst` (asserted above) and `s` advances 8 bytes per
        // word stored, so the 8-byte unaligned load lies inside `src`.
        u64::from_le(unsafe { s.add(8 * i).cast::<u64>().read_unaligned() })
    };
    let mut octs = dst.chunks_exact(8);
    for o in &mut octs {
        let o: &[AtomicU64; 8] = o.try_into().expect("chunks of 8 words");
        for (i, w) in o.iter().enumerate() {
            w.store(word(s, i), Ordering::Release);
        }
        // SAFETY: still inside `src` or one past its end (8 words stored).
        s = unsafe { s.add(64) };
    }
    let mut rest = octs.remainder();
    // Whole steps of eight (a 64-byte KV block, a line) skip the tail
    // with this one branch.
    if rest.is_empty() {
        return;
    }
    if let [a, b, c, e, more @ ..] = rest {
        a.store(word(s, 0), Ordering::Release);
        b.store(word(s, 1), Ordering::Release);
        c.store(word(s, 2), Ordering::Release);
        e.store(word(s, 3), Ordering::Release);
        // SAFETY: as above (4 words stored).
        s = unsafe { s.add(32) };
        rest = more;
    }
    if let [a, b, more @ ..] = rest {
        a.store(word(s, 0), Ordering::Release);
        b.store(word(s, 1), Ordering::Release);
        // SAFETY: as above (2 words stored).
        s = unsafe { s.add(16) };
        rest = more;
    }
    if let [w] = rest {
        w.store(word(s, 0), Ordering::Release);
    }
}

/// Stores `bytes` at byte `at` of `word` without clobbering its other bytes
/// (compare-and-swap, so a concurrent writer of the neighbours is not lost).
fn merge_into_word(word: &AtomicU64, at: usize, bytes: &[u8]) {
    let mut cur = word.load(Ordering::Acquire);
    loop {
        let mut b = cur.to_le_bytes();
        b[at..at + bytes.len()].copy_from_slice(bytes);
        match word.compare_exchange_weak(
            cur,
            u64::from_le_bytes(b),
            Ordering::AcqRel,
            Ordering::Acquire,
        ) {
            Ok(_) => return,
            Err(actual) => cur = actual,
        }
    }
}

impl Drop for RegionMem {
    fn drop(&mut self) {
        if let Backing::Heap(layout) = self.backing {
            // SAFETY: allocated in `zeroed` with exactly this layout, and no
            // reference into it outlives `self`.
            unsafe { std::alloc::dealloc(self.words.as_ptr().cast(), layout) };
        }
    }
}

impl std::fmt::Debug for RegionMem {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegionMem")
            .field("len", &self.len())
            .finish()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn rounds_up_and_zeroes() {
        let r = RegionMem::zeroed(100).unwrap();
        assert_eq!(r.len(), 128);
        assert_eq!(r.read_vec(0, 128).unwrap(), vec![0; 128]);
    }

    #[test]
    fn atomics_check_alignment_and_bounds() {
        let r = RegionMem::zeroed(64).unwrap();
        assert_eq!(
            r.cas_u64(3, 0, 1),
            Err(RegionAccessError::Misaligned { offset: 3 })
        );
        assert!(matches!(
            r.faa_u64(64, 1),
            Err(RegionAccessError::OutOfBounds { .. })
        ));
        assert_eq!(r.cas_u64(8, 0, 5).unwrap(), 0);
        assert_eq!(
            r.cas_u64(8, 0, 6).unwrap(),
            5,
            "failed CAS returns the value found"
        );
        assert_eq!(r.faa_u64(8, 2).unwrap(), 5);
        assert_eq!(r.load_u64(8).unwrap(), 7);
    }

    /// The word copy (eight-word steps, then steps of four, two and one
    /// word) stores every word in place for every count of words, and an aligned
    /// read of any whole-word length through the batch path gives the
    /// region's bytes.
    #[test]
    fn every_word_count_is_copied_exactly() {
        let r = RegionMem::zeroed(512).unwrap();
        let bytes: Vec<u8> = (0..512u32).map(|i| (i * 29 + 11) as u8).collect();
        r.write(0, &bytes).unwrap();
        for words in 0..=40usize {
            let mut out = vec![0xEE; words * 8];
            copy_words(&r.words()[1..1 + words], &mut out);
            assert_eq!(out, bytes[8..8 + words * 8], "{words} words");
            let mut buf = Vec::new();
            r.read_into(8, words * 8, &mut buf, false).unwrap();
            assert_eq!(buf, bytes[8..8 + words * 8], "{words} words, read_into");
        }
    }

    /// A write verb's store (`write_from`: aligned words in steps of eight,
    /// the unaligned case through `write`) leaves the region as `write`
    /// does, for every offset and length around the word and step
    /// boundaries, and refuses what `write` refuses with the same error;
    /// the atomic verbs' word (`word_for_verb`) is `word`'s.
    #[test]
    fn a_write_verbs_store_is_write() {
        let data: Vec<u8> = (0..200u32).map(|i| (i * 37 + 5) as u8).collect();
        for off in [0u64, 3, 8, 16, 61, 64, 120] {
            for len in [0usize, 1, 7, 8, 9, 16, 56, 64, 72, 120, 128, 136] {
                let (a, b) = (
                    RegionMem::zeroed(256).unwrap(),
                    RegionMem::zeroed(256).unwrap(),
                );
                a.write(0, &[0xA5; 256]).unwrap();
                b.write(0, &[0xA5; 256]).unwrap();
                let ra = a.write(off, &data[..len]);
                let rb = b.write_from(off, &data[..len], false);
                assert_eq!(ra, rb, "offset {off}, {len} bytes");
                assert_eq!(
                    a.read_vec(0, 256).unwrap(),
                    b.read_vec(0, 256).unwrap(),
                    "offset {off}, {len} bytes"
                );
            }
        }
        let r = RegionMem::zeroed(64).unwrap();
        for off in [0u64, 3, 56, 60, 64, u64::MAX - 7] {
            assert_eq!(
                r.word(off).map(|w| w as *const AtomicU64),
                r.word_for_verb(off, false).map(|w| w as *const AtomicU64),
                "offset {off}"
            );
            assert_eq!(r.write(off, &[1; 8]), r.write_from(off, &[1; 8], false));
        }
    }

    #[test]
    fn out_of_bounds_and_overflowing_ranges_are_refused() {
        let r = RegionMem::zeroed(64).unwrap();
        let mut b = [0u8; 8];
        assert!(r.read(60, &mut b).is_err());
        assert!(r.read(u64::MAX - 2, &mut b).is_err());
        assert!(r.write(57, &b).is_err());
    }

    #[test]
    fn a_huge_region_is_aligned_zeroed_and_whole() {
        let len = 3 * HUGE_PAGE + 64;
        let r = RegionMem::zeroed(len).unwrap();
        assert_eq!(r.base_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(r.len(), len);
        assert!(r.read_vec(0, len).unwrap().iter().all(|&b| b == 0));
        for offset in [
            0,
            HUGE_PAGE as u64 - 8,
            2 * HUGE_PAGE as u64,
            len as u64 - 8,
        ] {
            r.store_u64(offset, offset + 1).unwrap();
        }
        for offset in [
            0,
            HUGE_PAGE as u64 - 8,
            2 * HUGE_PAGE as u64,
            len as u64 - 8,
        ] {
            assert_eq!(r.load_u64(offset).unwrap(), offset + 1);
        }
    }

    #[test]
    fn a_prefetch_changes_nothing_and_ignores_bad_spans() {
        let r = RegionMem::zeroed(4096).unwrap();
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7) as u8).collect();
        r.write(0, &bytes).unwrap();
        for (offset, len) in [
            (0, 4096),
            (3, 13),
            (4000, 96),
            (4090, 16),
            (u64::MAX - 2, 8),
            (0, u64::MAX),
        ] {
            r.prefetch(offset, len);
        }
        assert_eq!(r.read_vec(0, 4096).unwrap(), bytes);
    }

    proptest! {
        // Reads and writes at any offset and length behave like a byte array.
        #[test]
        fn behaves_like_a_byte_array(ops in prop::collection::vec((0u64..200, prop::collection::vec(any::<u8>(), 0..40)), 1..30)) {
            let r = RegionMem::zeroed(256).unwrap();
            let mut model = vec![0u8; 256];
            for (off, data) in ops {
                let end = off as usize + data.len();
                let res = r.write(off, &data);
                if end <= 256 {
                    prop_assert!(res.is_ok());
                    model[off as usize..end].copy_from_slice(&data);
                } else {
                    prop_assert!(res.is_err());
                }
            }
            prop_assert_eq!(r.read_vec(0, 256).unwrap(), model.clone());
            // Every way of reading a range agrees with the model, aligned or not.
            for (off, len) in [(0usize, 256usize), (8, 64), (3, 61), (5, 3), (16, 0), (200, 56)] {
                let want = &model[off..off + len];
                prop_assert_eq!(&r.read_vec(off as u64, len).unwrap()[..], want);
                let mut buf = vec![0xAA; len];
                r.read(off as u64, &mut buf).unwrap();
                prop_assert_eq!(&buf[..], want);
            }
            prop_assert!(r.read_vec(256, 8).is_err());
            // A reused buffer holds exactly the bytes of the last read.
            let mut reused = vec![0x55; 300];
            for (off, len) in [(0usize, 256usize), (8, 16), (3, 61), (40, 0)] {
                r.read_to_vec(off as u64, len, &mut reused).unwrap();
                prop_assert_eq!(&reused[..], &model[off..off + len]);
            }
            prop_assert!(r.read_to_vec(250, 8, &mut reused).is_err());
            prop_assert!(reused.is_empty(), "a refused read leaves the buffer empty");
        }
    }
}
