//! Allocators over a region's bytes, run by the node's own CPU.
//!
//! Offsets handed out are region offsets. Freed blocks are reused, so a
//! one-sided reader holding an old offset may read a block that now holds
//! something else: layouts read one-sided must let readers detect that (a key
//! and checksum in the block header, an incarnation in a node header).

use crate::runtime::Region;
use parking_lot::Mutex;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use thiserror::Error;

/// Why an allocation or free failed.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum AllocError {
    #[error("{what} is full: {capacity} bytes in use, {requested} more requested")]
    Exhausted {
        what: String,
        capacity: u64,
        requested: u64,
    },
    #[error("bad free of offset {offset}: {why}")]
    BadFree { offset: u64, why: &'static str },
    #[error("bad allocation request: {0}")]
    BadRequest(String),
}

/// Hands out increasing offsets in `[start, end)`; never frees.
pub struct BumpAllocator {
    name: String,
    next: AtomicU64,
    start: u64,
    end: u64,
    used: Arc<AtomicU64>,
}

impl BumpAllocator {
    /// Allocates from `[start, end)` of `region`; the region's accounted use
    /// becomes what this allocator has handed out (plus `start`).
    pub fn new(name: &str, region: &Region, start: u64, end: u64) -> BumpAllocator {
        assert!(
            start <= end && end <= region.len(),
            "bump range inside the region"
        );
        region.used.store(start, Ordering::Relaxed);
        BumpAllocator {
            name: name.to_string(),
            next: AtomicU64::new(start),
            start,
            end,
            used: region.used.clone(),
        }
    }

    /// `size` bytes aligned to `align` (a power of two).
    pub fn alloc(&self, size: u64, align: u64) -> Result<u64, AllocError> {
        if !align.is_power_of_two() {
            return Err(AllocError::BadRequest(format!(
                "alignment {align} is not a power of two"
            )));
        }
        let mut cur = self.next.load(Ordering::Relaxed);
        loop {
            let at = cur.div_ceil(align) * align;
            let new = at
                .checked_add(size)
                .filter(|&n| n <= self.end)
                .ok_or_else(|| AllocError::Exhausted {
                    what: self.name.clone(),
                    capacity: self.end - self.start,
                    requested: size,
                })?;
            match self
                .next
                .compare_exchange_weak(cur, new, Ordering::AcqRel, Ordering::Relaxed)
            {
                Ok(_) => {
                    self.used.fetch_add(new - cur, Ordering::Relaxed);
                    return Ok(at);
                }
                Err(actual) => cur = actual,
            }
        }
    }

    /// Bytes handed out so far.
    pub fn allocated(&self) -> u64 {
        self.next.load(Ordering::Relaxed) - self.start
    }

    pub fn capacity(&self) -> u64 {
        self.end - self.start
    }
}

/// Fixed-size blocks with a free list over `[start, end)`. A bitmap of live
/// blocks catches double frees and frees of offsets never handed out.
pub struct SlabAllocator {
    name: String,
    block: u64,
    start: u64,
    end: u64,
    state: Mutex<SlabState>,
    used: Arc<AtomicU64>,
}

struct SlabState {
    /// Next never-used block.
    next: u64,
    free: Vec<u64>,
    live: Vec<u64>,
    live_count: u64,
}

impl SlabAllocator {
    /// Blocks of `block` bytes (a multiple of 8) from `[start, end)` of
    /// `region`.
    pub fn new(name: &str, region: &Region, block: u64, start: u64, end: u64) -> SlabAllocator {
        assert!(
            block > 0 && block.is_multiple_of(8),
            "blocks are whole words"
        );
        assert!(
            start <= end && end <= region.len(),
            "slab range inside the region"
        );
        let blocks = (end - start) / block;
        region.used.store(start, Ordering::Relaxed);
        SlabAllocator {
            name: name.to_string(),
            block,
            start,
            end: start + blocks * block,
            state: Mutex::new(SlabState {
                next: start,
                free: Vec::new(),
                live: vec![0; blocks.div_ceil(64) as usize],
                live_count: 0,
            }),
            used: region.used.clone(),
        }
    }

    pub fn block_size(&self) -> u64 {
        self.block
    }

    /// Index of the block at `offset`, if it is a block boundary of this slab.
    pub fn index_of(&self, offset: u64) -> Option<u64> {
        (offset >= self.start
            && offset < self.end
            && (offset - self.start).is_multiple_of(self.block))
        .then(|| (offset - self.start) / self.block)
    }

    /// Offset of block `index`.
    pub fn offset_of(&self, index: u64) -> u64 {
        self.start + index * self.block
    }

    pub fn alloc(&self) -> Result<u64, AllocError> {
        let mut s = self.state.lock();
        let off = match s.free.pop() {
            Some(off) => off,
            None if s.next + self.block <= self.end => {
                let off = s.next;
                s.next += self.block;
                off
            }
            None => {
                return Err(AllocError::Exhausted {
                    what: self.name.clone(),
                    capacity: self.end - self.start,
                    requested: self.block,
                });
            }
        };
        let i = (off - self.start) / self.block;
        s.live[(i / 64) as usize] |= 1 << (i % 64);
        s.live_count += 1;
        self.used.fetch_add(self.block, Ordering::Relaxed);
        Ok(off)
    }

    pub fn free(&self, offset: u64) -> Result<(), AllocError> {
        let i = self.index_of(offset).ok_or(AllocError::BadFree {
            offset,
            why: "not a block of this slab",
        })?;
        let mut s = self.state.lock();
        let (w, bit) = ((i / 64) as usize, 1u64 << (i % 64));
        if s.live[w] & bit == 0 {
            return Err(AllocError::BadFree {
                offset,
                why: "block is not allocated",
            });
        }
        s.live[w] &= !bit;
        s.live_count -= 1;
        s.free.push(offset);
        self.used.fetch_sub(self.block, Ordering::Relaxed);
        Ok(())
    }

    /// Blocks in use.
    pub fn live(&self) -> u64 {
        self.state.lock().live_count
    }

    /// Blocks this slab can hold.
    pub fn capacity_blocks(&self) -> u64 {
        (self.end - self.start) / self.block
    }
}

/// Variable-size blocks rounded up to power-of-two classes, each class with
/// its own free list, all carved from one bump range. Callers free a block
/// once, with the size they allocated it with.
pub struct SizeClassAllocator {
    bump: BumpAllocator,
    min_class: u64,
    max_class: u64,
    free: Vec<Mutex<Vec<u64>>>,
    live_bytes: AtomicU64,
}

impl SizeClassAllocator {
    /// Classes from `min_class` to `max_class` bytes (powers of two, at least
    /// 8), in `[start, end)` of `region`.
    pub fn new(
        name: &str,
        region: &Region,
        start: u64,
        end: u64,
        min_class: u64,
        max_class: u64,
    ) -> Self {
        assert!(
            min_class.is_power_of_two()
                && max_class.is_power_of_two()
                && 8 <= min_class
                && min_class <= max_class
        );
        let classes = (max_class.trailing_zeros() - min_class.trailing_zeros() + 1) as usize;
        SizeClassAllocator {
            bump: BumpAllocator::new(name, region, start, end),
            min_class,
            max_class,
            free: (0..classes).map(|_| Mutex::new(Vec::new())).collect(),
            live_bytes: AtomicU64::new(0),
        }
    }

    /// The size a request of `size` bytes is rounded up to.
    pub fn class_size(&self, size: u64) -> Result<u64, AllocError> {
        if size > self.max_class {
            return Err(AllocError::BadRequest(format!(
                "{size} bytes exceed the largest block class of {} bytes",
                self.max_class
            )));
        }
        Ok(size.max(self.min_class).next_power_of_two())
    }

    fn class_index(&self, class: u64) -> usize {
        (class.trailing_zeros() - self.min_class.trailing_zeros()) as usize
    }

    pub fn alloc(&self, size: u64) -> Result<u64, AllocError> {
        let class = self.class_size(size)?;
        let off = match self.free[self.class_index(class)].lock().pop() {
            Some(off) => off,
            None => self.bump.alloc(class, class.min(64))?,
        };
        self.live_bytes.fetch_add(class, Ordering::Relaxed);
        Ok(off)
    }

    pub fn free(&self, offset: u64, size: u64) -> Result<(), AllocError> {
        let class = self.class_size(size)?;
        if !offset.is_multiple_of(class.min(64))
            || offset < self.bump.start
            || offset + class > self.bump.end
        {
            return Err(AllocError::BadFree {
                offset,
                why: "not a block of this allocator",
            });
        }
        self.free[self.class_index(class)].lock().push(offset);
        self.live_bytes.fetch_sub(class, Ordering::Relaxed);
        Ok(())
    }

    /// Bytes in live blocks (after rounding to classes).
    pub fn live_bytes(&self) -> u64 {
        self.live_bytes.load(Ordering::Relaxed)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::runtime::NodeRuntime;
    use dmkv_transport::local::{LocalCluster, LocalConfig};

    fn region(len: usize) -> (LocalCluster, Arc<NodeRuntime>, Region) {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let r = rt.register_region("r", len).unwrap();
        (c, rt, r)
    }

    #[test]
    fn bump_aligns_and_runs_out() {
        let (_c, rt, r) = region(1024);
        let b = BumpAllocator::new("b", &r, 8, 1024);
        assert_eq!(b.alloc(3, 1).unwrap(), 8);
        assert_eq!(b.alloc(8, 64).unwrap(), 64);
        assert!(matches!(
            b.alloc(2000, 8),
            Err(AllocError::Exhausted { .. })
        ));
        assert!(b.alloc(8, 3).is_err());
        assert_eq!(rt.stats().memory_used, 72);
    }

    #[test]
    fn slab_reuses_and_catches_bad_frees() {
        let (_c, rt, r) = region(4096);
        let s = SlabAllocator::new("s", &r, 320, 64, 4096);
        assert_eq!(s.capacity_blocks(), 12);
        let blocks: Vec<u64> = (0..12).map(|_| s.alloc().unwrap()).collect();
        assert!(matches!(s.alloc(), Err(AllocError::Exhausted { .. })));
        assert_eq!(rt.stats().memory_used, 64 + 12 * 320);
        s.free(blocks[3]).unwrap();
        assert!(
            matches!(s.free(blocks[3]), Err(AllocError::BadFree { .. })),
            "double free"
        );
        assert!(
            matches!(s.free(blocks[3] + 8), Err(AllocError::BadFree { .. })),
            "not a boundary"
        );
        assert_eq!(s.alloc().unwrap(), blocks[3]);
        assert_eq!(s.live(), 12);
    }

    #[test]
    fn size_classes_round_up_and_reuse() {
        let (_c, _rt, r) = region(1 << 16);
        let a = SizeClassAllocator::new("v", &r, 0, 1 << 16, 16, 1024);
        let x = a.alloc(100).unwrap();
        assert_eq!(a.live_bytes(), 128);
        a.free(x, 100).unwrap();
        assert_eq!(a.alloc(120).unwrap(), x, "same class reuses the block");
        assert!(a.alloc(2000).is_err());
    }
}
