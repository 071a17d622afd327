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

use std::cell::RefCell;

/// Spare buffers a thread keeps at most (more given back are freed).
const MAX_SPARES: usize = 64;
/// Buffers with more capacity than this are freed when given back, so one
/// large read (a scan) does not stay pinned to the thread.
const MAX_SPARE_BYTES: usize = 64 * 1024;

thread_local! {
    static SPARES: RefCell<Vec<Vec<u8>>> = const { RefCell::new(Vec::new()) };
}

/// An empty buffer: a spare of this thread if there is one, else a new
/// (unallocated) vector.
#[inline]
pub fn take() -> Vec<u8> {
    SPARES
        .try_with(|s| s.borrow_mut().pop())
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
    // During thread teardown the spares may be gone; the buffer is freed.
    let _ = SPARES.try_with(|s| {
        let mut s = s.borrow_mut();
        if s.len() < MAX_SPARES {
            s.push(buf);
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
        f(Some(&mut Spares(&mut s.borrow_mut())))
    });
    match r {
        Ok(r) => r,
        Err(_) => (f.take().expect("not called when the spares are gone"))(None),
    }
}

/// This thread's spare buffers, borrowed by [`with_spares`].
pub struct Spares<'a>(&'a mut Vec<Vec<u8>>);

impl Spares<'_> {
    /// As [`take`].
    #[inline]
    pub fn take(&mut self) -> Vec<u8> {
        self.0.pop().unwrap_or_default()
    }

    /// As [`give`].
    #[inline]
    pub fn give(&mut self, mut buf: Vec<u8>) {
        if buf.capacity() == 0 || buf.capacity() > MAX_SPARE_BYTES || self.0.len() >= MAX_SPARES {
            return;
        }
        buf.clear();
        self.0.push(buf);
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
}
