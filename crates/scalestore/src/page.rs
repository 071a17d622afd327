//! Pages: 4 KiB of registered memory accessed through bounds-checked views.
//!
//! Page bytes live in a [`RegionMem`] (so that other nodes can write pages
//! into it one-sided) and are therefore read and written as atomic 8-byte
//! words; a reader racing a writer may see a mix, which the latch protocol
//! detects. [`PageRef`] is a view of one page, which a writer holding the
//! exclusive latch also changes in place (`set_word`, `move_words`,
//! `put_bytes`); [`PageBuf`] is a private copy that code modifies before
//! storing it back (new pages, splits, compactions).

use dmkv_transport::RegionMem;
use std::sync::atomic::{AtomicU64, Ordering};

/// Bytes per page (paper default).
pub const PAGE_SIZE: usize = 4096;
/// Words per page.
pub const PAGE_WORDS: usize = PAGE_SIZE / 8;

const _: () = assert!(PAGE_SIZE.is_power_of_two() && PAGE_SIZE.is_multiple_of(8));

/// An access outside the page; from an optimistic read it means "restart".
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutOfPage;

/// A view of one page in region memory.
#[derive(Clone, Copy)]
pub struct PageRef<'a> {
    mem: &'a RegionMem,
    base: u64,
}

impl<'a> PageRef<'a> {
    /// The page at byte `base` of `mem` (checked against the region).
    pub fn new(mem: &'a RegionMem, base: u64) -> PageRef<'a> {
        assert!(
            base.is_multiple_of(PAGE_SIZE as u64) && mem.check(base, PAGE_SIZE as u64).is_ok(),
            "page at {base} outside its region"
        );
        PageRef { mem, base }
    }

    /// Word `i` (0..512).
    pub fn word(&self, i: usize) -> Result<u64, OutOfPage> {
        if i >= PAGE_WORDS {
            return Err(OutOfPage);
        }
        self.mem
            .load_u64(self.base + 8 * i as u64)
            .map_err(|_| OutOfPage)
    }

    pub fn set_word(&self, i: usize, v: u64) {
        assert!(i < PAGE_WORDS, "word {i} outside the page");
        self.mem
            .store_u64(self.base + 8 * i as u64, v)
            .expect("checked page");
    }

    /// `len` bytes at byte `off` of the page.
    pub fn bytes(&self, off: usize, len: usize) -> Result<Vec<u8>, OutOfPage> {
        if off.checked_add(len).is_none_or(|e| e > PAGE_SIZE) {
            return Err(OutOfPage);
        }
        self.mem
            .read_vec(self.base + off as u64, len)
            .map_err(|_| OutOfPage)
    }

    /// Copies the whole page into `buf`: one region access (the span's
    /// words taken by `RegionMem::words_in`, one bounds check and one `sim`
    /// touch of the 4 KiB, as `RegionMem::read` of it costs), then one
    /// acquire load per word in increasing address order straight into
    /// `buf` (no byte buffer in between: no zeroing, no second copy).
    pub fn load(&self, buf: &mut PageBuf) {
        let words = self.span(0, PAGE_WORDS);
        for (w, a) in buf.words.iter_mut().zip(words) {
            *w = a.load(Ordering::Acquire);
        }
    }

    /// A new private copy of the page, loaded as [`Self::load`] loads (the
    /// same touch and loads), into a buffer that is never zeroed first.
    pub fn copy(&self) -> PageBuf {
        let words: Vec<u64> = self
            .span(0, PAGE_WORDS)
            .iter()
            .map(|a| a.load(Ordering::Acquire))
            .collect();
        PageBuf {
            words: words
                .into_boxed_slice()
                .try_into()
                .expect("a page of words"),
        }
    }

    /// Words `from..to` of the page as atomics, after one `sim` touch of
    /// their span (what `RegionMem::read`/`write` of it report first).
    fn span(&self, from: usize, to: usize) -> &'a [AtomicU64] {
        self.mem
            .words_in(self.base + 8 * from as u64, 8 * (to - from))
            .expect("checked page")
    }

    /// Stores words `from..to` of `buf` into the page: one region access
    /// (one `sim` touch of the span, one release store per word in
    /// increasing address order, then the span reported as stored: what
    /// `RegionMem::write` of the same bytes does, without a byte buffer).
    pub fn store(&self, buf: &PageBuf, from: usize, to: usize) {
        assert!(from <= to && to <= PAGE_WORDS);
        if from == to {
            return;
        }
        for (a, w) in self.span(from, to).iter().zip(&buf.words[from..to]) {
            a.store(*w, Ordering::Release);
        }
        self.mem
            .note_stored(self.base + 8 * from as u64, 8 * (to - from) as u64);
    }

    /// Moves words `from..from + n` of the page to `to..to + n` (the spans
    /// may overlap, as a slot shift's do), for a writer that holds the
    /// page's exclusive latch (docs/scalestore.md, invariant 29): one `sim`
    /// touch of the span both cover, one acquire load and one release store
    /// per word, in the order that reads every word before it is
    /// overwritten, then the destination reported as stored.
    pub fn move_words(&self, from: usize, to: usize, n: usize) {
        if n == 0 || from == to {
            return;
        }
        let (lo, hi) = (from.min(to), from.max(to) + n);
        assert!(hi <= PAGE_WORDS, "words {lo}..{hi} outside the page");
        let w = self.span(lo, hi);
        let (src, dst) = (from - lo, to - lo);
        let step =
            |i: usize| w[dst + i].store(w[src + i].load(Ordering::Acquire), Ordering::Release);
        if dst > src {
            (0..n).rev().for_each(step);
        } else {
            (0..n).for_each(step);
        }
        self.mem
            .note_stored(self.base + 8 * to as u64, 8 * n as u64);
    }

    /// Writes `data` at byte `off` of the page, for a writer that holds the
    /// page's exclusive latch: `RegionMem::write` of the span (one `sim`
    /// touch, the words stored in increasing address order, a partial word
    /// at either end merged with its other bytes, the span reported stored).
    pub fn put_bytes(&self, off: usize, data: &[u8]) {
        assert!(
            off.checked_add(data.len()).is_some_and(|e| e <= PAGE_SIZE),
            "bytes outside the page"
        );
        self.mem
            .write(self.base + off as u64, data)
            .expect("checked page");
    }

    /// The bytes `from..to` of the page rounded out to whole words, as one
    /// span for an optimistic reader that copies several values out of it
    /// (a scan's leaf): one bounds check against the page and one `sim`
    /// touch of the span, then [`PageSpan::copy`] per value.
    pub fn span_of(&self, from: usize, to: usize) -> Result<PageSpan<'a>, OutOfPage> {
        let s = self.span_of_untouched(from, to)?;
        self.mem
            .touch_span(self.base + s.from as u64, 8 * s.words.len() as u64);
        Ok(s)
    }

    /// [`Self::span_of`] without the `sim` touch, for a reader that reports
    /// the parts of the span it reads itself ([`PageSpan::touch`]).
    pub fn span_of_untouched(&self, from: usize, to: usize) -> Result<PageSpan<'a>, OutOfPage> {
        if from > to || to > PAGE_SIZE {
            return Err(OutOfPage);
        }
        let (first, last) = (from / 8, to.div_ceil(8));
        let words = self
            .mem
            .words_in_untouched(self.base + 8 * first as u64, 8 * (last - first))
            .expect("checked page");
        Ok(PageSpan {
            page: *self,
            words,
            from: 8 * first,
        })
    }

    /// Stores all of `buf`.
    pub fn store_all(&self, buf: &PageBuf) {
        self.store(buf, 0, PAGE_WORDS)
    }

    /// The page as bytes (for transfers and I/O).
    pub fn to_bytes(&self) -> Vec<u8> {
        self.mem
            .read_vec(self.base, PAGE_SIZE)
            .expect("checked page")
    }

    /// The page as another node's NIC takes it for a delivery: the DMA read
    /// of the frame that the artifact's handler posts its RDMA WRITE from
    /// (`MessageHandler::writePageAndMsg`, `RDMABatchElement{.memAddr =
    /// page, ...}`), so no core reads its lines: the same bytes as
    /// [`Self::to_bytes`] (the same read, `RegionMem::read_vec_untouched`),
    /// but reported to no `sim` cache (the NIC's bytes and
    /// message are `sim::write_posted`'s). For deliveries to other nodes
    /// only ([`crate::node::ScaleNode::frame_bytes`]); off `sim` the two are
    /// the same copy (on `local` the CPU is the NIC, on `ucx` the WRITE is
    /// posted from this copy).
    pub fn dma_bytes(&self) -> Vec<u8> {
        self.mem
            .read_vec_untouched(self.base, PAGE_SIZE)
            .expect("checked page")
    }

    /// Overwrites the page with `bytes` (exactly one page).
    pub fn fill(&self, bytes: &[u8]) {
        assert_eq!(bytes.len(), PAGE_SIZE);
        self.mem.write(self.base, bytes).expect("checked page");
    }
}

/// Whole words of a page taken by [`PageRef::span_of`], starting at byte
/// `from` of the page.
pub struct PageSpan<'a> {
    page: PageRef<'a>,
    words: &'a [AtomicU64],
    from: usize,
}

impl PageSpan<'_> {
    /// Reports the `len` bytes at byte `off` of the page as read (one
    /// `sim` touch, as `RegionMem::read` of them reports; nothing off
    /// `sim`). Checks no bounds: for bytes [`Self::copy`] took.
    pub fn touch(&self, off: usize, len: usize) {
        self.page
            .mem
            .touch_span(self.page.base + off as u64, len as u64);
    }

    /// Word `i` of the page (not of the span), if the span holds it.
    pub fn word(&self, i: usize) -> Result<u64, OutOfPage> {
        let rel = i.checked_sub(self.from / 8).ok_or(OutOfPage)?;
        let w = self.words.get(rel).ok_or(OutOfPage)?;
        Ok(w.load(Ordering::Acquire))
    }

    /// The `len` bytes at byte `off` of the page (not of the span), loaded
    /// word by word (acquire, increasing address) into a vector of exactly
    /// `len` bytes; out of the span means a torn optimistic read.
    pub fn copy(&self, off: usize, len: usize) -> Result<Vec<u8>, OutOfPage> {
        let end = off.checked_add(len).ok_or(OutOfPage)?;
        if off < self.from || end > self.from + 8 * self.words.len() {
            return Err(OutOfPage);
        }
        let mut out = Vec::with_capacity(len);
        let (rel, rel_end) = (off - self.from, end - self.from);
        let mut pos = rel;
        while pos < rel_end {
            let w = self.words[pos / 8].load(Ordering::Acquire).to_le_bytes();
            let (a, b) = (pos % 8, (rel_end - (pos - pos % 8)).min(8));
            out.extend_from_slice(&w[a..b]);
            pos += b - a;
        }
        Ok(out)
    }
}

/// A private copy of a page, as words.
#[derive(Clone)]
pub struct PageBuf {
    pub words: Box<[u64; PAGE_WORDS]>,
}

impl Default for PageBuf {
    fn default() -> Self {
        PageBuf {
            words: Box::new([0; PAGE_WORDS]),
        }
    }
}

impl PageBuf {
    pub fn word(&self, i: usize) -> u64 {
        self.words[i]
    }
    pub fn set_word(&mut self, i: usize, v: u64) {
        self.words[i] = v;
    }

    /// `len` bytes at byte `off`, if inside the page.
    pub fn bytes(&self, off: usize, len: usize) -> Option<Vec<u8>> {
        let end = off.checked_add(len).filter(|&e| e <= PAGE_SIZE)?;
        let mut out = Vec::with_capacity(len);
        for pos in off..end {
            out.push(self.words[pos / 8].to_le_bytes()[pos % 8]);
        }
        Some(out)
    }

    /// Writes `data` at byte `off` (must fit).
    pub fn put_bytes(&mut self, off: usize, data: &[u8]) {
        assert!(off + data.len() <= PAGE_SIZE, "bytes outside the page");
        for (i, b) in data.iter().enumerate() {
            let pos = off + i;
            let mut w = self.words[pos / 8].to_le_bytes();
            w[pos % 8] = *b;
            self.words[pos / 8] = u64::from_le_bytes(w);
        }
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_le_bytes()).collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region() -> RegionMem {
        RegionMem::zeroed(2 * PAGE_SIZE).expect("region")
    }

    /// `copy` and `load` read the page's words in order, into a buffer that
    /// holds exactly them (the copy's buffer is never zeroed first, so a
    /// word it skipped would show garbage or a wrong length).
    #[test]
    fn copy_and_load_read_every_word() {
        let mem = region();
        let p = PageRef::new(&mem, PAGE_SIZE as u64);
        for i in 0..PAGE_WORDS {
            p.set_word(i, (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
        }
        let c = p.copy();
        let mut l = PageBuf::default();
        p.load(&mut l);
        for i in 0..PAGE_WORDS {
            assert_eq!(c.word(i), p.word(i).unwrap(), "copy, word {i}");
            assert_eq!(l.word(i), p.word(i).unwrap(), "load, word {i}");
        }
        assert_eq!(c.to_bytes(), p.to_bytes());
    }

    /// `store(buf, from, to)` writes exactly words `from..to` at their own
    /// offsets of this page: the words around them and the other page keep
    /// their bytes.
    #[test]
    fn store_writes_only_its_range() {
        let mem = region();
        let (a, b) = (PageRef::new(&mem, 0), PageRef::new(&mem, PAGE_SIZE as u64));
        let mut buf = PageBuf::default();
        for i in 0..PAGE_WORDS {
            buf.set_word(i, 1000 + i as u64);
            a.set_word(i, 7);
            b.set_word(i, 9);
        }
        b.store(&buf, 5, 300);
        for i in 0..PAGE_WORDS {
            let want = if (5..300).contains(&i) {
                1000 + i as u64
            } else {
                9
            };
            assert_eq!(b.word(i).unwrap(), want, "word {i}");
            assert_eq!(a.word(i).unwrap(), 7, "other page, word {i}");
        }
        b.store_all(&buf);
        assert_eq!(b.copy().to_bytes(), buf.to_bytes());
    }

    /// The optimistic read of a page in place (docs/scalestore.md,
    /// invariant 28): a reader that read some words before a writer took
    /// the exclusive latch and the rest while it was mid-update has a torn
    /// page (half old, half new: the check below shows the mix), and the
    /// version's validation refuses it; while the writer is inside no
    /// optimistic version is handed out; after its release a new read
    /// validates and sees only the new page. Without the validation the
    /// torn page would be accepted (the `assert_ne!` proves it is torn).
    #[test]
    fn a_read_across_an_exclusive_update_does_not_validate() {
        use crate::latch::HybridLatch;
        let mem = region();
        let p = PageRef::new(&mem, 0);
        let latch = HybridLatch::new();
        let (old, new) = (PageBuf::default(), {
            let mut b = PageBuf::default();
            for i in 0..PAGE_WORDS {
                b.set_word(i, 0xA000 + i as u64);
            }
            b
        });
        p.store_all(&old);
        let v = latch.optimistic().expect("free latch");
        let first: Vec<u64> = (0..PAGE_WORDS / 2).map(|i| p.word(i).unwrap()).collect();
        assert!(latch.try_exclusive());
        p.store(&new, 0, PAGE_WORDS / 2 + 10); // mid-update
        assert!(latch.optimistic().is_none(), "no version while latched");
        let second: Vec<u64> = (PAGE_WORDS / 2..PAGE_WORDS)
            .map(|i| p.word(i).unwrap())
            .collect();
        let torn: Vec<u64> = first.iter().chain(&second).copied().collect();
        assert_ne!(torn, old.words.to_vec(), "the read is not the old page");
        assert_ne!(torn, new.words.to_vec(), "the read is not the new page");
        assert!(!latch.validate(v), "a torn read validated");
        p.store_all(&new);
        latch.unlock_exclusive();
        assert!(
            !latch.validate(v),
            "a read from before the update validated"
        );
        let v2 = latch.optimistic().expect("released");
        let again = p.copy();
        assert!(latch.validate(v2));
        assert_eq!(again.words.to_vec(), new.words.to_vec());
    }
}
