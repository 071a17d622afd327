//! Pages: 4 KiB of registered memory accessed through bounds-checked views.
//!
//! Page bytes live in a [`RegionMem`] (so that other nodes can write pages
//! into it one-sided) and are therefore read and written as atomic 8-byte
//! words; a reader racing a writer may see a mix, which the latch protocol
//! detects. [`PageRef`] is a view of one page; [`PageBuf`] is a private copy
//! that code modifies before storing it back.

use dmkv_transport::RegionMem;

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

    /// Copies the whole page into `buf`: one region access (`RegionMem::read`
    /// loads the words in increasing address order, each an atomic 8-byte
    /// load, exactly as a loop of `load_u64` would), so the simulator's cost
    /// model sees one 4 KiB copy (64 lines), not 512 separate accesses.
    pub fn load(&self, buf: &mut PageBuf) {
        let mut bytes = [0u8; PAGE_SIZE];
        self.mem.read(self.base, &mut bytes).expect("checked page");
        for (w, b) in buf.words.iter_mut().zip(bytes.chunks_exact(8)) {
            *w = u64::from_le_bytes(b.try_into().expect("chunks of 8 bytes"));
        }
    }

    /// Stores words `from..to` of `buf` into the page: one region access
    /// (`RegionMem::write` stores whole words in increasing address order,
    /// each an atomic 8-byte store, as a loop of `store_u64` would).
    pub fn store(&self, buf: &PageBuf, from: usize, to: usize) {
        assert!(from <= to && to <= PAGE_WORDS);
        if from == to {
            return;
        }
        let mut bytes = [0u8; PAGE_SIZE];
        let out = &mut bytes[..8 * (to - from)];
        for (b, w) in out.chunks_exact_mut(8).zip(&buf.words[from..to]) {
            b.copy_from_slice(&w.to_le_bytes());
        }
        self.mem
            .write(self.base + 8 * from as u64, out)
            .expect("checked page");
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
