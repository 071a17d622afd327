//! The version protocol (docs/xtree.md, *Version protocol*), written once
//! over an abstract array of atomic words so that the memory node's writers,
//! every reader, and the loom model (`tests/loom.rs`) run the same code.
//!
//! Writer: lock `V_0` by CAS; new version `Y = X + 1`; store `T = Y`; for each
//! line from the last down to 1: `V_i = Y | LOCK`, the line's changed payload
//! words, `V_i = Y`; then line 0's payload and `V_0 = Y`, which unlocks.
//!
//! Reader: one read of lines `first..first + k` (words in increasing address
//! order) plus the next version word, or `T` when the span reaches the end;
//! the image is consistent iff every version word in it is unlocked and all
//! are equal ([`check_span`]).

use crate::layout::{Geometry, LOCK_BIT, Span, VERSION_MASK, WORDS_PER_LINE};
use thiserror::Error;

/// The words of one node. Implementations must give loads acquire and
/// stores release semantics (as `RegionMem` and RDMA do).
pub trait NodeWords {
    /// Loads word `i` of the node (acquire).
    fn load(&self, i: usize) -> u64;
    /// Stores word `i` of the node (release).
    fn store(&self, i: usize, v: u64);
    /// Compare-and-swap of word `i`; the value found, as RDMA CAS returns.
    fn cas(&self, i: usize, expected: u64, new: u64) -> u64;
}

/// Why a read image is not a consistent snapshot.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
pub enum Inconsistent {
    #[error("a writer held the node while it was read")]
    Locked,
    #[error("torn read: version words differ")]
    Torn,
}

/// Tries once to lock the node: CAS `V_0` from an unlocked `X` to
/// `X | LOCK`. Returns `X` on success.
pub fn try_lock<W: NodeWords + ?Sized>(w: &W) -> Option<u64> {
    let x = w.load(0);
    if x & LOCK_BIT != 0 {
        return None;
    }
    (w.cas(0, x, x | LOCK_BIT) == x).then_some(x)
}

/// Locks the node, spinning while another writer holds it (writers hold a
/// node for the few stores of one commit).
pub fn lock<W: NodeWords + ?Sized>(w: &W) -> u64 {
    let mut spins = 0u32;
    loop {
        if let Some(x) = try_lock(w) {
            return x;
        }
        spins += 1;
        if spins < 64 {
            std::hint::spin_loop();
        } else {
            std::thread::yield_now();
        }
    }
}

/// Releases a lock taken at version `x` without changing the node.
pub fn unlock_unchanged<W: NodeWords + ?Sized>(w: &W, x: u64) {
    w.store(0, x);
}

/// Writes `changes` (pairs of logical payload word index and value) to a
/// node locked at version `x`, following the writer protocol, and unlocks
/// it at version `x + 1`. Returns the new version.
pub fn commit<W: NodeWords + ?Sized>(
    w: &W,
    geo: &Geometry,
    x: u64,
    changes: &[(usize, u64)],
) -> u64 {
    let y = (x + 1) & VERSION_MASK;
    w.store(geo.trailer_word(), y);
    for line in (1..geo.lines()).rev() {
        let v = geo.version_word(line);
        w.store(v, y | LOCK_BIT);
        for &(i, val) in changes {
            if geo.line_of(i) == line {
                w.store(geo.payload_word(i), val);
            }
        }
        w.store(v, y);
    }
    for &(i, val) in changes {
        if geo.line_of(i) == 0 {
            w.store(geo.payload_word(i), val);
        }
    }
    w.store(0, y);
    y
}

/// The little-endian word at byte `at` of `bytes`.
pub fn word_at(bytes: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
}

/// Checks the version words of a span image (`bytes` starts at the span's
/// first line and is exactly `span.len(geo)` long); returns the version.
pub fn check_span(geo: &Geometry, span: Span, bytes: &[u8]) -> Result<u64, Inconsistent> {
    debug_assert_eq!(bytes.len(), span.len(geo));
    let first = word_at(bytes, 0);
    let closing = if span.reaches_end(geo) {
        bytes.len() - 8
    } else {
        span.lines * WORDS_PER_LINE * 8
    };
    let versions = (0..span.lines)
        .map(|l| l * WORDS_PER_LINE * 8)
        .chain(std::iter::once(closing));
    let mut torn = false;
    for at in versions {
        let v = word_at(bytes, at);
        if v & LOCK_BIT != 0 {
            return Err(Inconsistent::Locked);
        }
        torn |= v != first;
    }
    if torn {
        Err(Inconsistent::Torn)
    } else {
        Ok(first)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::RefCell;

    /// A node in plain memory that records every store, to check the order
    /// the protocol prescribes.
    struct Recorder {
        words: RefCell<Vec<u64>>,
        log: RefCell<Vec<(usize, u64)>>,
    }

    impl NodeWords for Recorder {
        fn load(&self, i: usize) -> u64 {
            self.words.borrow()[i]
        }
        fn store(&self, i: usize, v: u64) {
            self.words.borrow_mut()[i] = v;
            self.log.borrow_mut().push((i, v));
        }
        fn cas(&self, i: usize, e: u64, n: u64) -> u64 {
            let cur = self.words.borrow()[i];
            if cur == e {
                self.words.borrow_mut()[i] = n;
            }
            cur
        }
    }

    #[test]
    fn commit_stores_in_protocol_order() {
        let g = Geometry::new(16).unwrap();
        let r = Recorder {
            words: RefCell::new(vec![0; g.node_words()]),
            log: RefCell::new(Vec::new()),
        };
        let x = lock(&r);
        assert_eq!(x, 0);
        assert!(try_lock(&r).is_none(), "a locked node cannot be locked");
        let y = commit(&r, &g, x, &[(g.key(0), 11), (g.slot(15), 22)]);
        assert_eq!(y, 1);
        let log = r.log.borrow().clone();
        // T first, then lines 4..1 each locked, written, unlocked, then line 0.
        assert_eq!(log[0], (g.trailer_word(), 1));
        assert_eq!(log[1], (g.version_word(4), 1 | LOCK_BIT));
        assert_eq!(log[2], (g.payload_word(g.slot(15)), 22));
        assert_eq!(log[3], (g.version_word(4), 1));
        assert_eq!(log[log.len() - 2], (g.payload_word(g.key(0)), 11));
        assert_eq!(*log.last().unwrap(), (0, 1));
        // every line got the new version
        for l in 0..g.lines() {
            assert_eq!(r.load(g.version_word(l)), 1);
        }
        let bytes: Vec<u8> = r
            .words
            .borrow()
            .iter()
            .flat_map(|w| w.to_le_bytes())
            .collect();
        assert_eq!(check_span(&g, g.node_span(), &bytes), Ok(1));
        let ks = g.key_span();
        assert_eq!(check_span(&g, ks, &bytes[..ks.len(&g)]), Ok(1));
    }

    #[test]
    fn check_span_reports_locks_and_tears() {
        let g = Geometry::new(16).unwrap();
        let mut words = vec![0u64; g.node_words()];
        for l in 0..g.lines() {
            words[g.version_word(l)] = 5;
        }
        words[g.trailer_word()] = 5;
        let bytes = |w: &[u64]| w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>();
        assert_eq!(check_span(&g, g.node_span(), &bytes(&words)), Ok(5));
        // a lock on any version word, including the closing one
        for at in (0..g.lines())
            .map(|l| g.version_word(l))
            .chain([g.trailer_word()])
        {
            let mut w = words.clone();
            w[at] |= LOCK_BIT;
            assert_eq!(
                check_span(&g, g.node_span(), &bytes(&w)),
                Err(Inconsistent::Locked)
            );
            let mut w = words.clone();
            w[at] = 6;
            assert_eq!(
                check_span(&g, g.node_span(), &bytes(&w)),
                Err(Inconsistent::Torn)
            );
        }
        // a prefix read is closed by the next line's version word
        let ks = g.key_span();
        let mut w = words.clone();
        w[g.version_word(ks.lines)] = 6;
        assert_eq!(
            check_span(&g, ks, &bytes(&w)[..ks.len(&g)]),
            Err(Inconsistent::Torn)
        );
        // a single-line value read, closed by the next version or by T
        let s = g.slot_span(0);
        let off = s.offset();
        assert_eq!(
            check_span(&g, s, &bytes(&words)[off..off + s.len(&g)]),
            Ok(5)
        );
        let mut w = words.clone();
        w[g.trailer_word()] = 4;
        let s = g.slot_span(15);
        let off = s.offset();
        assert_eq!(
            check_span(&g, s, &bytes(&w)[off..off + s.len(&g)]),
            Err(Inconsistent::Torn)
        );
    }
}
