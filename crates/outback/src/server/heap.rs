//! A shard's KV data area: the heap region and its block allocator.
//!
//! Blocks are carved from a bump range and recycled through exact-size free
//! lists (one per block length in words, so a recycled block has the same
//! extent as before and a recovery scan can walk blocks by their headers).
//! The first time a block is carved its start bit is set in the region's
//! bitmap; mirrors get the same bit, which is how a replica finds blocks
//! after the primary is lost.

use crate::layout::{HeapLayout, MAX_BLOCK_WORDS, header_words};
use dmkv_memnode::{BumpAllocator, Region};
use dmkv_transport::ServiceError;
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// A block handed out: its address and whether it was freshly carved (its
/// start bit must then be set, locally and on mirrors).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Block {
    pub addr: u64,
    pub words: u64,
    pub fresh: bool,
}

/// What a scan of a heap (or mirror) found.
#[derive(Debug, Default)]
pub struct Scan {
    /// Complete live blocks: (key, address, words, seq).
    pub live: Vec<(u64, u64, u64, u64)>,
    /// Dead or superseded blocks that can be recycled: (address, words).
    pub dead: Vec<(u64, u64)>,
    /// End of the last block found.
    pub high_water: u64,
}

pub struct Heap {
    pub region: Region,
    pub layout: HeapLayout,
    bump: BumpAllocator,
    free: Vec<Mutex<Vec<u64>>>,
    live_words: AtomicU64,
}

impl Heap {
    /// A fresh heap over a freshly registered (zeroed) region.
    pub fn create(region: Region, layout: HeapLayout) -> Heap {
        let h = layout.header();
        for (i, w) in h.iter().enumerate() {
            region
                .mem
                .store_u64(i as u64 * 8, *w)
                .expect("the heap header fits its region");
        }
        Heap::adopt(region, layout, layout.data_start, &[])
    }

    /// A heap over a region that already holds blocks (a mirror taken
    /// over): carving resumes at `high_water` and `dead` blocks are reused.
    pub fn adopt(region: Region, layout: HeapLayout, high_water: u64, dead: &[(u64, u64)]) -> Heap {
        let end = layout.data_start + layout.data_len;
        let bump = BumpAllocator::new("outback heap", &region, high_water.min(end), end);
        let free: Vec<Mutex<Vec<u64>>> = (0..=MAX_BLOCK_WORDS)
            .map(|_| Mutex::new(Vec::new()))
            .collect();
        for &(addr, words) in dead {
            free[words as usize].lock().push(addr);
        }
        Heap {
            region,
            layout,
            bump,
            free,
            live_words: AtomicU64::new(0),
        }
    }

    /// A block of `words` words.
    pub fn alloc(&self, words: u64) -> Result<Block, ServiceError> {
        debug_assert!((1..=MAX_BLOCK_WORDS).contains(&words));
        self.live_words.fetch_add(words, Ordering::Relaxed);
        if let Some(addr) = self.free[words as usize].lock().pop() {
            return Ok(Block {
                addr,
                words,
                fresh: false,
            });
        }
        match self.bump.alloc(words * 8, 8) {
            Ok(addr) => Ok(Block {
                addr,
                words,
                fresh: true,
            }),
            Err(e) => {
                self.live_words.fetch_sub(words, Ordering::Relaxed);
                Err(ServiceError::exhausted(format!(
                    "outback: the shard's KV heap is full ({e}); raise outback.heap_mb"
                )))
            }
        }
    }

    /// Returns a block for reuse. The caller has made it dead (seq 0)
    /// locally and on mirrors, and no slot points at it any more.
    pub fn free(&self, addr: u64, words: u64) {
        self.live_words.fetch_sub(words, Ordering::Relaxed);
        self.free[words as usize].lock().push(addr);
    }

    /// Sets the start bit of a freshly carved block in this heap.
    pub fn mark_start(&self, addr: u64) {
        let (w, bit) = self.layout.start_bit(addr);
        self.region
            .mem
            .faa_u64(w, 1 << bit)
            .expect("bitmap word inside the heap");
    }

    /// Bytes of live blocks.
    pub fn live_bytes(&self) -> u64 {
        self.live_words.load(Ordering::Relaxed) * 8
    }

    /// Bytes carved so far (live, dead and recycled blocks).
    pub fn carved_bytes(&self) -> u64 {
        self.bump.allocated() + (self.bump_start() - self.layout.data_start)
    }

    fn bump_start(&self) -> u64 {
        self.layout.data_start + self.layout.data_len - self.bump.capacity()
    }

    /// The key of the block at `addr` (word 2 of a block).
    pub fn key_at(&self, addr: u64) -> Result<u64, ServiceError> {
        self.region
            .mem
            .load_u64(addr + 16)
            .map_err(|e| ServiceError::failed(format!("outback: bad block address: {e}")))
    }

    pub fn read(&self, addr: u64, bytes: usize) -> Result<Vec<u8>, ServiceError> {
        self.region
            .mem
            .read_vec(addr, bytes)
            .map_err(|e| ServiceError::failed(format!("outback: bad block address: {e}")))
    }

    /// The `n` words of the block front at `addr`, borrowed in place (one
    /// bounds check, and on `sim` one access of their lines, as a
    /// [`read_into`](Self::read_into) of them).
    #[inline]
    pub fn words(&self, addr: u64, n: usize) -> Result<&[AtomicU64], ServiceError> {
        self.region
            .mem
            .words_in(addr, n * 8)
            .map_err(|e| ServiceError::failed(format!("outback: bad block address: {e}")))
    }

    pub fn read_into(&self, addr: u64, out: &mut [u8]) -> Result<(), ServiceError> {
        self.region
            .mem
            .read(addr, out)
            .map_err(|e| ServiceError::failed(format!("outback: bad block address: {e}")))
    }

    pub fn write(&self, addr: u64, data: &[u8]) -> Result<(), ServiceError> {
        self.region
            .mem
            .write(addr, data)
            .map_err(|e| ServiceError::failed(format!("outback: bad block address: {e}")))
    }
}

/// Walks the blocks of a heap image through its start bitmap: each block's
/// header gives its length; complete blocks with a non-zero sequence number
/// and a valid check are live. `read` reads bytes of the image.
pub fn scan(layout: &HeapLayout, read: impl Fn(u64, usize) -> Option<Vec<u8>>) -> Scan {
    let mut out = Scan {
        high_water: layout.data_start,
        ..Default::default()
    };
    let words = layout.data_len / 8;
    let bitmap_bytes = words.div_ceil(64) * 8;
    let Some(bitmap) = read(layout.bitmap_start, bitmap_bytes as usize) else {
        return out;
    };
    for (wi, chunk) in bitmap.chunks_exact(8).enumerate() {
        let mut bits = u64::from_le_bytes(chunk.try_into().expect("8 bytes"));
        while bits != 0 {
            let b = bits.trailing_zeros() as u64;
            bits &= bits - 1;
            let addr = layout.data_start + (wi as u64 * 64 + b) * 8;
            let Some(head) = read(addr, 16) else { continue };
            let klen = u64::from_le_bytes(head[..8].try_into().expect("8 bytes"));
            let vlen = u64::from_le_bytes(head[8..].try_into().expect("8 bytes"));
            let Some(n) = header_words(klen, vlen) else {
                // A start whose header never landed: its extent is unknown,
                // so carving must resume beyond any block it could be.
                out.high_water = out.high_water.max(addr + MAX_BLOCK_WORDS * 8);
                continue;
            };
            if addr + n * 8 > layout.data_start + layout.data_len {
                continue;
            }
            out.high_water = out.high_water.max(addr + n * 8);
            match read(addr, (n * 8) as usize)
                .as_deref()
                .and_then(crate::layout::parse_live_block)
            {
                Some((key, _, seq)) => out.live.push((key, addr, n, seq)),
                None => out.dead.push((addr, n)),
            }
        }
    }
    out.high_water = out.high_water.min(layout.data_start + layout.data_len);
    out
}
