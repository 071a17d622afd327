//! Spare read buffers, per thread.
//!
//! A one-sided read hands its bytes back in a `Vec<u8>`. Callers that only
//! look at the bytes ([`BatchResult::read`], [`Endpoint::read_buf`]) give the
//! buffer back when they are done, and the next read on the thread fills it
//! instead of allocating: with the local backend a GET then allocates no read
//! buffer at all once the thread has a few spares. A buffer given back on
//! another thread than the one that took it simply joins that thread's
//! spares. Only the contents' allocation is reused; every read still copies
//! its bytes (as a NIC would).
//!
//! [`BatchResult::read`]: crate::BatchResult::read
//! [`Endpoint::read_buf`]: crate::Endpoint::read_buf

use crate::backend::{VerbResult, VerbResults};
use std::cell::{Cell, RefCell};
use std::mem::ManuallyDrop;

/// Spare buffers a thread keeps at most (more given back are freed).
const MAX_SPARES: usize = 64;
/// Buffers with more capacity than this are freed when given back, so one
/// large read (a scan) does not stay pinned to the thread.
pub(crate) const MAX_SPARE_BYTES: usize = 64 * 1024;

/// Result lists a thread keeps at most (more given back are freed).
const MAX_RESULT_LISTS: usize = 64;

/// A batch's results in a box from the thread's pool ([`Spares::take_results`]):
/// a `BatchResult` holds one, so handing results out of a batch future moves
/// a pointer, not the inline list.
pub type PooledResults = Box<VerbResults>;

/// One thread's spares: read buffers and result lists.
struct Pool {
    bufs: Vec<Vec<u8>>,
    /// Result lists given back with their read buffers still in them
    /// (invariant B1: every `Read` entry of a pooled list holds a buffer of
    /// at most `MAX_SPARE_BYTES` capacity, and no list is spilled to the
    /// heap beyond its inline four), so the next batch's reads fill those
    /// buffers in place. A list may hold more entries than the next batch
    /// that takes it has verbs: that batch's results are its first entries
    /// (`BatchResult` keeps the count) and the rest stay in it, buffers and
    /// all, for later batches (nothing is given back and taken again when
    /// batches of two lengths alternate, as an engine's GET makes them).
    /// B1 is kept where a list is filled: a read grows its buffer to exactly
    /// its length, so a list is looked at when given back only if its batch
    /// read more than `MAX_SPARE_BYTES` in all or a backend filled it
    /// (`Spares::give_results`' `oversized`).
    results: Vec<PooledResults>,
}

thread_local! {
    static SPARES: RefCell<Pool> = const {
        RefCell::new(Pool {
            bufs: Vec::new(),
            results: Vec::new(),
        })
    };
    /// One result list in front of the pool's (B2): the list the thread's
    /// last batch gave back, or null. A plain cell with no destructor, so
    /// taking and giving it is a load and a store (the pool's cell has a
    /// destructor, whose registration every access checks, and a borrow
    /// flag).
    static FAST_RESULTS: Cell<*mut VerbResults> = const { Cell::new(std::ptr::null_mut()) };
    /// One spare buffer in front of the pool's (B3): the buffer the thread
    /// gave back last, or an empty vector (no allocation) when the slot is
    /// free. As `FAST_RESULTS`, a plain cell without a destructor (the
    /// `ManuallyDrop` has no drop glue), so [`take`] and [`give`] are a few
    /// loads and stores when it serves them, instead of the pool's
    /// registration check and borrow flag (~35-45 instructions each).
    static FAST_BUF: Cell<ManuallyDrop<Vec<u8>>> = const { Cell::new(ManuallyDrop::new(Vec::new())) };
    /// Whether this thread's `SPARES` is alive and will free the fast
    /// list when the thread ends (set when the pool is first used, cleared
    /// by its destructor): a list is put in the fast slot only then, so
    /// none is left behind when the thread ends.
    static FAST_ARMED: Cell<bool> = const { Cell::new(false) };
}

impl Drop for Pool {
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        FAST_ARMED.with(|a| a.set(false));
        let p = FAST_RESULTS.with(|f| f.replace(std::ptr::null_mut()));
        if !p.is_null() {
            // SAFETY: a non-null fast list is a `Box` given up by
            // `give_fast_results`, owned by the slot alone (B2).
            drop(unsafe { Box::from_raw(p) });
        }
        // B3: the fast buffer, if any, is freed with the pool.
        drop(ManuallyDrop::into_inner(take_fast_buf()));
    }
}

/// Empties the fast buffer slot (B3), returning what it held (an empty
/// vector if it was free).
#[inline(always)]
fn take_fast_buf() -> ManuallyDrop<Vec<u8>> {
    FAST_BUF.with(|f| f.replace(ManuallyDrop::new(Vec::new())))
}

/// The result list in the fast slot, if there is one (B2).
#[inline]
#[allow(unsafe_code)]
pub(crate) fn take_fast_results() -> Option<PooledResults> {
    let p = FAST_RESULTS.with(|f| f.replace(std::ptr::null_mut()));
    // SAFETY: a non-null pointer in the slot came from `Box::into_raw` in
    // `give_fast_results` and was replaced by null as it was taken, so this
    // is its only owner.
    (!p.is_null()).then(|| unsafe { Box::from_raw(p) })
}

/// Puts `r` in the fast slot if it is free, the thread's pool is alive and
/// `r` may go there without being looked at (B1 holds for it: not
/// `oversized`, not spilled); else gives it back to `r` as
/// [`Spares::give_results`] does. (B2: the slot holds at most one list,
/// owned by it alone, with B1's bounds.)
#[inline]
#[allow(unsafe_code)]
pub(crate) fn give_results(r: PooledResults, oversized: bool) {
    if !oversized
        && !r.spilled()
        && FAST_ARMED.with(Cell::get)
        && FAST_RESULTS.with(|f| f.get().is_null())
    {
        FAST_RESULTS.with(|f| f.set(Box::into_raw(r)));
        return;
    }
    give_results_to_pool(r, oversized);
}

/// [`give_results`]' path through the pool, out of line so that the fast
/// slot's path (inlined into a `BatchResult`'s drop) saves no registers.
#[cold]
#[inline(never)]
fn give_results_to_pool(r: PooledResults, oversized: bool) {
    with_spares(|spares| {
        if let Some(spares) = spares {
            spares.give_results(r, oversized);
        }
    });
}

/// An empty buffer: a spare of this thread if there is one, else a new
/// (unallocated) vector.
#[inline]
pub fn take() -> Vec<u8> {
    // The fast slot's buffer first (B3), then the pool's.
    let fast = ManuallyDrop::into_inner(take_fast_buf());
    if fast.capacity() != 0 {
        return fast;
    }
    take_from_pool()
}

/// [`take`]'s path through the pool, out of line (as [`give_to_pool`]).
#[inline(never)]
fn take_from_pool() -> Vec<u8> {
    SPARES
        .try_with(|s| s.borrow_mut().bufs.pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Gives `buf` back for a later [`take`] on this thread (its contents are
/// dropped, its allocation kept).
#[inline]
pub fn give(mut buf: Vec<u8>) {
    if buf.capacity() == 0 || buf.capacity() > MAX_SPARE_BYTES {
        return;
    }
    buf.clear();
    // B3: into the fast slot while the pool is alive to free it (so none
    // is left behind when the thread ends); the buffer it held, if any,
    // goes on to the pool. A buffer is never in both.
    let buf = if FAST_ARMED.with(Cell::get) {
        let old = FAST_BUF.with(|f| f.replace(ManuallyDrop::new(buf)));
        if old.capacity() == 0 {
            return;
        }
        ManuallyDrop::into_inner(old)
    } else {
        buf
    };
    give_to_pool(buf);
}

/// [`give`]'s path through the pool (`buf` cleared, within the bounds), out
/// of line so that the fast slot's path saves no registers.
#[inline(never)]
fn give_to_pool(buf: Vec<u8>) {
    // During thread teardown the spares may be gone; the buffer is freed.
    let _ = SPARES.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.bufs.len() < MAX_SPARES {
            s.bufs.push(buf);
        }
    });
}

/// Runs `f` with this thread's spare buffers borrowed once, for code that
/// takes or gives several buffers in a row (a batch's reads, a batch
/// result's drop): one thread-local access instead of one per buffer. `f`
/// gets `None` during thread teardown, when the spares are gone.
#[inline]
pub fn with_spares<R>(f: impl FnOnce(Option<&mut Spares<'_>>) -> R) -> R {
    let mut f = Some(f);
    let r = SPARES.try_with(|s| {
        let f = f.take().expect("called once");
        let mut pool = s.borrow_mut();
        // The pool is alive and will free the fast list (B2).
        FAST_ARMED.with(|a| a.set(true));
        f(Some(&mut Spares(&mut pool)))
    });
    match r {
        Ok(r) => r,
        Err(_) => (f.take().expect("not called when the spares are gone"))(None),
    }
}

/// `results` in a list of the thread's pool (a backend's results handed
/// out by a batch future): the pooled list's old read buffers go to the
/// spares.
pub fn pooled(results: VerbResults) -> PooledResults {
    with_spares(|spares| match spares {
        Some(s) => {
            let mut list = s.take_results();
            s.truncate_results(&mut list, 0);
            *list = results;
            list
        }
        None => Box::new(results),
    })
}

/// This thread's spare buffers, borrowed by [`with_spares`].
pub struct Spares<'a>(&'a mut Pool);

impl Spares<'_> {
    /// As [`take`].
    #[inline]
    pub fn take(&mut self) -> Vec<u8> {
        self.0.bufs.pop().unwrap_or_default()
    }

    /// As [`give`].
    #[inline]
    pub fn give(&mut self, mut buf: Vec<u8>) {
        if buf.capacity() == 0
            || buf.capacity() > MAX_SPARE_BYTES
            || self.0.bufs.len() >= MAX_SPARES
        {
            return;
        }
        buf.clear();
        self.0.bufs.push(buf);
    }

    /// A result list for a batch: a pooled one (its entries, the results of
    /// an earlier batch, hold read buffers the next reads fill in place:
    /// `LocalEndpoint::run_verbs`), else a new empty one.
    #[inline]
    pub fn take_results(&mut self) -> PooledResults {
        self.0.results.pop().unwrap_or_default()
    }

    /// Gives a result list back with the read buffers still in it (B1:
    /// oversized buffers are freed and a spilled list is dropped).
    /// `oversized`: whether an entry may hold a buffer of more than
    /// `MAX_SPARE_BYTES` capacity; when false (the caller knows every
    /// buffer in it is within the bound: `BatchResult`'s flag) the entries
    /// are not looked at. A wrong `false` would keep a large buffer pooled
    /// (memory, never a wrong result); the test
    /// `no_pooled_list_keeps_a_buffer_beyond_the_bound` checks the flag.
    #[inline]
    pub fn give_results(&mut self, mut r: PooledResults, oversized: bool) {
        if r.spilled() || self.0.results.len() >= MAX_RESULT_LISTS {
            for e in r.drain(..) {
                if let VerbResult::Read(b) = e {
                    self.give(b);
                }
            }
            return;
        }
        if oversized {
            for e in r.iter_mut() {
                if let VerbResult::Read(b) = e
                    && b.capacity() > MAX_SPARE_BYTES
                {
                    *b = Vec::new();
                }
            }
        }
        self.0.results.push(r);
    }

    /// Gives back the buffers of entries `len..` of `out` (left from an
    /// earlier, longer batch) and drops those entries.
    #[inline]
    pub fn truncate_results(&mut self, out: &mut VerbResults, len: usize) {
        if out.len() > len {
            for e in out.drain(len..) {
                if let VerbResult::Read(b) = e {
                    self.give(b);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_given_buffer_is_taken_again_empty_and_the_pool_is_bounded() {
        let mut b = Vec::with_capacity(100);
        b.extend_from_slice(&[1, 2, 3]);
        let ptr = b.as_ptr();
        give(b);
        let again = take();
        assert!(again.is_empty());
        assert_eq!(again.as_ptr(), ptr, "the same allocation comes back");
        assert!(again.capacity() >= 100);
        // Too large or unallocated buffers are not kept.
        give(Vec::with_capacity(MAX_SPARE_BYTES + 1));
        give(Vec::new());
        assert_eq!(take().capacity(), 0);
        for _ in 0..MAX_SPARES + 10 {
            give(Vec::with_capacity(8));
        }
        let kept = std::iter::from_fn(|| Some(take()))
            .take_while(|v| v.capacity() > 0)
            .count();
        assert_eq!(kept, MAX_SPARES);
    }

    #[test]
    fn spares_borrowed_once_take_and_give_like_the_single_calls() {
        // Drain whatever earlier tests on this thread left.
        while take().capacity() > 0 {}
        let a = Vec::<u8>::with_capacity(32);
        let pa = a.as_ptr();
        with_spares(|s| {
            let s = s.expect("spares exist on a live thread");
            s.give(a);
            s.give(Vec::new()); // unallocated: not kept
            s.give(Vec::with_capacity(MAX_SPARE_BYTES + 1)); // too large: freed
            let again = s.take();
            assert_eq!(again.as_ptr(), pa);
            assert_eq!(s.take().capacity(), 0, "nothing else was kept");
            for _ in 0..MAX_SPARES + 3 {
                s.give(Vec::with_capacity(8));
            }
        });
        let kept = std::iter::from_fn(|| Some(take()))
            .take_while(|v| v.capacity() > 0)
            .count();
        assert_eq!(kept, MAX_SPARES, "the bound holds for batch gives too");
    }

    #[test]
    fn the_fast_buffer_slot_holds_the_last_buffer_given_and_take_finds_it_first() {
        // The pool is in use on this thread (armed, B3), and empty.
        with_spares(|s| assert!(s.is_some()));
        while take().capacity() > 0 {}
        let a = Vec::<u8>::with_capacity(24);
        let pa = a.as_ptr();
        give(a);
        // In the slot, not in the pool: the pool's own take does not see it.
        let from_pool = with_spares(|s| s.expect("alive").take());
        assert_eq!(from_pool.capacity(), 0, "the buffer went to the fast slot");
        // A second buffer takes the slot; the first goes on to the pool.
        let b = vec![7u8; 40];
        let pb = b.as_ptr();
        give(b);
        let again = take();
        assert_eq!(again.as_ptr(), pb, "the slot's buffer comes back first");
        assert!(again.is_empty(), "given back cleared");
        let second = take();
        assert_eq!(second.as_ptr(), pa, "then the pool's");
        drop((again, second));
        assert_eq!(take().capacity(), 0);
        // Too large or unallocated buffers stay out of the slot too.
        give(Vec::with_capacity(MAX_SPARE_BYTES + 1));
        give(Vec::new());
        assert_eq!(take().capacity(), 0);
        // The slot holds one buffer beside the pool's bound.
        for _ in 0..MAX_SPARES + 10 {
            give(Vec::with_capacity(8));
        }
        let kept = std::iter::from_fn(|| Some(take()))
            .take_while(|v| v.capacity() > 0)
            .count();
        assert_eq!(kept, MAX_SPARES + 1);
    }
}

/// Pooled result lists on the `local` backend: reused with their buffers,
/// results exact whatever an earlier batch left in the list.
#[cfg(test)]
mod pooled_tests {
    use super::*;
    use crate::NodeHost;
    use crate::exec::block_on;
    use crate::local::{LocalCluster, LocalConfig};

    /// What the pool holds now, its fast slot's list included (B2):
    /// (lists, read buffers in them, largest capacity of those buffers).
    #[allow(unsafe_code)]
    fn pooled_lists() -> (usize, usize, usize) {
        let fast = FAST_RESULTS.with(Cell::get);
        SPARES.with(|s| {
            let s = s.borrow();
            // SAFETY: the slot's list is owned by the slot and nothing
            // takes it while this test thread looks at it.
            let fast = (!fast.is_null()).then(|| unsafe { &*fast });
            let lists = s.results.iter().map(|r| &**r).chain(fast);
            let count = s.results.len() + usize::from(fast.is_some());
            let bufs = lists.flat_map(|r| r.iter()).filter_map(|e| match e {
                VerbResult::Read(b) if b.capacity() > 0 => Some(b.capacity()),
                _ => None,
            });
            let (n, max) = bufs.fold((0, 0), |(n, m), c| (n + 1, m.max(c)));
            (count, n, max)
        })
    }

    #[test]
    fn result_lists_are_reused_with_their_buffers_and_results_stay_exact() {
        let cluster = LocalCluster::new(LocalConfig::default());
        let mem = cluster.add_node(0);
        let (region, _) = mem.register_region(1 << 18).unwrap();
        let ep = cluster.fabric().endpoint(mem.id()).unwrap();
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
        block_on(ep.write(region.at(0), &bytes)).unwrap();
        // The oracle: the bytes written, and the words the atomics find.
        let word = |o: usize| u64::from_le_bytes(bytes[o..o + 8].try_into().unwrap());

        let mut b = ep.batch();
        let r0 = b.read(region.at(0), 64);
        let c = b.cas(region.at(512), word(512), 99);
        let r1 = b.read(region.at(128), 40);
        let f = b.faa(region.at(520), 5);
        let r = block_on(b.run()).unwrap();
        assert_eq!(r.len(), 4);
        assert_eq!(r.read(r0), &bytes[..64]);
        assert_eq!(r.word(c), word(512));
        assert_eq!(r.read(r1), &bytes[128..168]);
        assert_eq!(r.word(f), word(520));
        let first_buf = r.read(r0).as_ptr();
        drop(r);
        let (lists, bufs, _) = pooled_lists();
        assert!(
            lists >= 1 && bufs >= 2,
            "the list came back with its two buffers"
        );

        // A shorter batch in the same list: entry 0's buffer is filled in
        // place, and nothing of the earlier batch shows.
        let mut b = ep.batch();
        let r0 = b.read(region.at(1024), 16);
        let r = block_on(b.run()).unwrap();
        assert_eq!(r.len(), 1);
        assert_eq!(r.read(r0), &bytes[1024..1040]);
        assert_eq!(
            r.read(r0).as_ptr(),
            first_buf,
            "the pooled buffer was reused"
        );
        drop(r);

        // A write where a read was, then a read where an atomic was.
        let mut b = ep.batch();
        let w = b.write(region.at(2048), vec![0xAB; 16]);
        let r1 = b.read(region.at(2040), 32);
        let mut r = block_on(b.run()).unwrap();
        assert_eq!(r.len(), 2);
        let mut expect = bytes[2040..2072].to_vec();
        expect[8..24].fill(0xAB);
        assert_eq!(r.read(r1), &expect[..]);
        assert_eq!(r.take_read(r1), expect);
        let _ = w;
        drop(r);

        // One-read helpers hand out the bytes exactly and give the list back.
        let rb = block_on(ep.read_buf(region.at(64), 24)).unwrap();
        assert_eq!(&rb[..], &bytes[64..88]);
        assert_eq!(rb.into_vec(), bytes[64..88].to_vec());
        assert_eq!(block_on(ep.read(region.at(8), 8)).unwrap(), bytes[8..16]);

        // A large read's buffer is not kept in the pool (B1).
        let big = block_on(ep.read_buf(region.at(0), MAX_SPARE_BYTES + 8)).unwrap();
        // (Bytes 512.. were changed by the atomics and the write above.)
        assert_eq!(big.len(), MAX_SPARE_BYTES + 8);
        assert_eq!(&big[..512], &bytes[..512]);
        drop(big);
        let (_, _, largest) = pooled_lists();
        assert!(
            largest <= MAX_SPARE_BYTES,
            "largest pooled buffer {largest}"
        );

        // An empty batch has no list.
        let r = block_on(ep.batch().run()).unwrap();
        assert!(r.is_empty());
    }

    /// B1 without a scan of every list given back: a buffer that grows in
    /// place grows to exactly the read (a doubling would take a 40,000-byte
    /// buffer to 80,000 for a 50,000-byte read, a batch whose reads total
    /// under the bound), and a batch reading more than the bound in all
    /// has its list's entries looked at. (Fails with `reserve` in place of
    /// `reserve_exact` in `RegionMem::read_into`: largest pooled buffer
    /// 80000.)
    #[test]
    fn no_pooled_list_keeps_a_buffer_beyond_the_bound() {
        let cluster = LocalCluster::new(LocalConfig::default());
        let mem = cluster.add_node(0);
        let (region, _) = mem.register_region(1 << 18).unwrap();
        let ep = cluster.fabric().endpoint(mem.id()).unwrap();
        let bytes: Vec<u8> = (0..(1u32 << 17)).map(|i| (i * 31 + 5) as u8).collect();
        block_on(ep.write(region.at(0), &bytes)).unwrap();
        let clear = || {
            drop(take_fast_results());
            SPARES.with(|s| {
                let mut s = s.borrow_mut();
                s.results.clear();
                s.bufs.clear();
            })
        };
        let largest = || pooled_lists().2;
        for unaligned in [0u64, 4] {
            clear();
            let r = block_on(ep.read_buf(region.at(unaligned), 40_000)).unwrap();
            assert_eq!(
                &r[..],
                &bytes[unaligned as usize..unaligned as usize + 40_000]
            );
            drop(r);
            assert_eq!(pooled_lists().0, 1);
            let r = block_on(ep.read_buf(region.at(unaligned), 50_000)).unwrap();
            assert_eq!(
                &r[..],
                &bytes[unaligned as usize..unaligned as usize + 50_000]
            );
            drop(r);
            assert!(
                largest() <= MAX_SPARE_BYTES,
                "largest pooled buffer {}",
                largest()
            );
        }
        // Two reads under the bound each, over it together: the list is
        // looked at (and keeps both, each within the bound).
        clear();
        let mut b = ep.batch();
        let a = b.read(region.at(0), 40_000);
        let c = b.read(region.at(40_000), 40_000);
        let r = block_on(b.run()).unwrap();
        assert_eq!(r.read(a), &bytes[..40_000]);
        assert_eq!(r.read(c), &bytes[40_000..80_000]);
        drop(r);
        assert_eq!(pooled_lists().1, 2);
        assert!(largest() <= MAX_SPARE_BYTES);
        // One read over the bound, in a list that held small buffers.
        let r = block_on(ep.read_buf(region.at(8), MAX_SPARE_BYTES + 8)).unwrap();
        assert_eq!(&r[..], &bytes[8..MAX_SPARE_BYTES + 16]);
        drop(r);
        assert!(
            largest() <= MAX_SPARE_BYTES,
            "largest pooled buffer {}",
            largest()
        );
    }

    /// A batch shorter than the pooled list it runs in leaves the list's
    /// further entries (and their buffers) in it, not among the results:
    /// no buffer goes back to the spares and none is taken, and the results
    /// are exactly the batch's. (Fails where a batch truncated its list:
    /// the second buffer then left the list for the spares.)
    #[test]
    fn a_shorter_batch_keeps_the_lists_further_buffers_out_of_its_results() {
        let cluster = LocalCluster::new(LocalConfig::default());
        let mem = cluster.add_node(0);
        let (region, _) = mem.register_region(1 << 16).unwrap();
        let ep = cluster.fabric().endpoint(mem.id()).unwrap();
        let bytes: Vec<u8> = (0..4096u32).map(|i| (i * 13 + 1) as u8).collect();
        block_on(ep.write(region.at(0), &bytes)).unwrap();
        // Start from an empty pool on this thread.
        SPARES.with(|s| {
            let mut s = s.borrow_mut();
            s.results.clear();
            s.bufs.clear();
        });
        let mut b = ep.batch();
        b.read(region.at(0), 64);
        b.read(region.at(256), 64);
        drop(block_on(b.run()).unwrap());
        assert_eq!(pooled_lists().0, 1, "one list, back in the pool");
        let spare_bufs = || SPARES.with(|s| s.borrow().bufs.len());
        let spares_before = spare_bufs();
        // One read in the two-entry list.
        let r = block_on(ep.read_buf(region.at(512), 24)).unwrap();
        assert_eq!(&r[..], &bytes[512..536]);
        assert_eq!(spare_bufs(), spares_before, "no buffer left the list");
        drop(r);
        let (lists, bufs, _) = pooled_lists();
        assert_eq!((lists, bufs), (1, 2), "the list keeps both buffers");
        // A batch's results are only its own, whatever the list holds.
        let mut b = ep.batch();
        let only = b.cas(region.at(1024), 0, 0);
        let r = block_on(b.run()).unwrap();
        assert_eq!(r.len(), 1);
        let found = u64::from_le_bytes(bytes[1024..1032].try_into().unwrap());
        assert_eq!(r.word(only), found);
        assert!(
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| r.read(1).len())).is_err(),
            "an entry beyond the batch is not a result"
        );
    }

    /// B2: a batch's list given back goes to the thread's fast slot when it
    /// is free (the pool's lists stay as they are), the next batch takes it
    /// and fills its read buffer in place; a list given back while the slot
    /// holds one goes to the pool; a list of a batch that read more than the
    /// bound in all never goes to the slot.
    #[test]
    fn the_fast_slot_holds_one_list_within_the_bound() {
        let cluster = LocalCluster::new(LocalConfig::default());
        let mem = cluster.add_node(0);
        let (region, _) = mem.register_region(1 << 18).unwrap();
        let ep = cluster.fabric().endpoint(mem.id()).unwrap();
        let bytes: Vec<u8> = (0..(1u32 << 17)).map(|i| (i * 13 + 1) as u8).collect();
        block_on(ep.write(region.at(0), &bytes)).unwrap();
        let fast = || FAST_RESULTS.with(Cell::get);
        let pool_len = || SPARES.with(|s| s.borrow().results.len());
        drop(take_fast_results());
        let r = block_on(ep.read_buf(region.at(0), 64)).unwrap();
        let buf = r.as_ptr();
        drop(r);
        let slot = fast();
        assert!(!slot.is_null(), "the list went to the fast slot");
        let r = block_on(ep.read_buf(region.at(64), 64)).unwrap();
        assert_eq!(&r[..], &bytes[64..128]);
        assert_eq!(r.as_ptr(), buf, "the slot's list and buffer were reused");
        assert!(fast().is_null(), "taken out of the slot");
        // Two lists out at once: the second given back goes to the pool
        // (it came from the pool, or was new if the pool had none).
        let before = pool_len();
        let r2 = block_on(ep.read_buf(region.at(128), 64)).unwrap();
        drop(r);
        assert_eq!(fast(), slot);
        drop(r2);
        assert_eq!(fast(), slot);
        assert_eq!(pool_len(), before.max(1));
        // A batch reading more than the bound in all: never the slot.
        drop(take_fast_results());
        let big = block_on(ep.read_buf(region.at(0), MAX_SPARE_BYTES + 8)).unwrap();
        assert_eq!(&big[..], &bytes[..MAX_SPARE_BYTES + 8]);
        drop(big);
        assert!(fast().is_null(), "an oversized list went to the slot");
        assert!(pooled_lists().2 <= MAX_SPARE_BYTES);
    }
}
