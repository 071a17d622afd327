//! A one-sided scan's walk along the chain of leaves: which pairs of each
//! leaf image it takes, whether the image may follow the one before it,
//! and where the scan resumes when it stops. Kept apart from the reads
//! (`client.rs`) so the resume point can be tested on made-up images.
//!
//! Invariant (the resume point): whenever the walk stops, `At(q, k)` or
//! `Fallback(q, k, _)` names the first key not yet in the result, in the
//! partition that holds it: every key of the store in `[start, k)` that
//! the walk saw is in the result. The caller may drop pairs from the
//! result afterwards (a deleted out-of-line value, `resolve_blocks`) and go
//! on from the resume point, so the walk must never move it past a key it
//! did not take. (DST seed 201 of xstore found the walk moving it to the
//! next partition's first key while the result was already full, so a
//! pair dropped later was replaced by keys of the next partition and the
//! rest of the first partition was skipped.)

use crate::stats::FallbackCause;
use dmkv_api::Key;
use dmkv_xtree::{FatPtr, SlotValue};

/// An out-of-line value a scan still has to read: its place in the
/// result, its partition, key and block.
pub(crate) struct Pending {
    pub at: usize,
    pub part: usize,
    pub key: Key,
    pub fat: FatPtr,
}

/// Where a one-sided scan stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ScanStop {
    /// Go on in partition `.0` from key `.1` with a fresh one-sided lookup
    /// (`.0` = the number of partitions: nothing is left).
    At(usize, Key),
    /// Go on in partition `.0` from key `.1` by the server.
    Fallback(usize, Key, FallbackCause),
}

/// What the walk needs of one leaf image besides its pairs.
pub(crate) struct LeafFacts {
    /// The partition the leaf was planned in.
    pub part: usize,
    /// Its node number.
    pub node: u32,
    /// Its incarnation is the one its TT entry was trained with.
    pub as_trained: bool,
    /// Its right link (0: the partition's rightmost leaf).
    pub next: u32,
}

/// What [`Chain::absorb`] did with a leaf.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Absorbed {
    /// Its pairs from the start are in the result (until it is full).
    Taken,
    /// The same, and it was the head of the next partition.
    Crossed,
    /// The walk stops here.
    Stop(ScanStop),
}

/// Where the chain of leaves processed so far stands.
pub(crate) struct Chain {
    /// The partition of the last leaf taken.
    pub at: usize,
    /// The first key not yet covered in `at` (`None`: past the largest key).
    pub next: Option<Key>,
    /// The last leaf's right link (`None`: no leaf taken yet).
    pub prev_next: Option<u32>,
    /// Each partition's first key.
    pub parts: Vec<Key>,
}

impl Chain {
    /// Stop and go on one-sided from the first key not yet taken.
    pub fn resume(&self) -> ScanStop {
        match self.next {
            Some(k) => ScanStop::At(self.at, k),
            None => ScanStop::At(self.parts.len(), 0),
        }
    }

    /// Stop and go on by the server from the first key not yet taken.
    pub fn fall_back(&self) -> ScanStop {
        match self.next {
            Some(k) => ScanStop::Fallback(self.at, k, FallbackCause::ScanChain),
            None => ScanStop::At(self.parts.len(), 0),
        }
    }

    /// Stop and go on one-sided from the first key of partition `q` (only
    /// when every key of the partitions before it is taken).
    pub fn part_start(&self, q: usize) -> ScanStop {
        ScanStop::At(q, self.parts.get(q).copied().unwrap_or(0))
    }

    /// Takes the pairs `>= start` of one leaf image (sorted by key) into
    /// `out` (out-of-line values into `pending`) until `out` holds `n`.
    pub fn absorb(
        &mut self,
        l: &LeafFacts,
        pairs: &[(Key, SlotValue)],
        start: Key,
        n: usize,
        out: &mut Vec<(Key, Vec<u8>)>,
        pending: &mut Vec<Pending>,
    ) -> Absorbed {
        if out.len() >= n {
            // Full: the resume point stays on the first key not taken,
            // whatever leaf comes next (see the module note).
            return Absorbed::Stop(self.resume());
        }
        let mut crossed = false;
        if l.part != self.at {
            // A planned partition head: the chain before it must have
            // reached its partition's rightmost leaf, and it must be as
            // trained (then it starts at its partition's first key,
            // invariant 1 of docs/xstore.md).
            if self.prev_next != Some(0) || l.part != self.at + 1 {
                return Absorbed::Stop(self.fall_back());
            }
            if !l.as_trained {
                // Split since training: look its start up afresh.
                return Absorbed::Stop(self.part_start(l.part));
            }
            self.at = l.part;
            self.next = Some(self.parts[self.at]);
            crossed = true;
        } else if self.prev_next.is_some_and(|want| want != l.node) {
            // Each leaf after the first must be the right link of the one
            // before it (invariant 4 of docs/xtree.md: then no key is missed
            // or returned twice).
            return Absorbed::Stop(self.fall_back());
        }
        self.prev_next = Some(l.next);
        for &(k, sv) in pairs {
            if k < start {
                continue;
            }
            if out.len() >= n {
                break;
            }
            match sv {
                SlotValue::Inline(b) => out.push((k, b.to_vec())),
                SlotValue::OutOfLine(fat) => {
                    pending.push(Pending {
                        at: out.len(),
                        part: self.at,
                        key: k,
                        fat,
                    });
                    out.push((k, Vec::new()));
                }
            }
            self.next = k.checked_add(1);
        }
        if crossed {
            Absorbed::Crossed
        } else {
            Absorbed::Taken
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fat(k: Key) -> SlotValue {
        SlotValue::OutOfLine(FatPtr {
            offset: k * 64,
            len: 40,
        })
    }

    fn leaf(part: usize, node: u32, next: u32) -> LeafFacts {
        LeafFacts {
            part,
            node,
            as_trained: true,
            next,
        }
    }

    /// The mechanism of xstore DST seed 201: one batch holds the last leaf
    /// of partition 0 and the head of partition 1 (planned from TT counts
    /// that were low after inserts); the result fills inside partition 0.
    /// The resume point must stay in partition 0 after the last key taken,
    /// so that when a pair is dropped afterwards (its out-of-line value was
    /// deleted meanwhile) the scan refills from the rest of partition 0,
    /// not from partition 1's first key.
    #[test]
    fn a_full_result_keeps_the_resume_point_in_its_partition() {
        let mut c = Chain {
            at: 0,
            next: Some(10),
            prev_next: None,
            parts: vec![0, 1000],
        };
        let (mut out, mut pending) = (Vec::new(), Vec::new());
        // Leaf 3 is partition 0's rightmost (right link 0): keys 10..=50.
        let p0: Vec<(Key, SlotValue)> = (1..=5).map(|i| (i * 10, fat(i * 10))).collect();
        assert_eq!(
            c.absorb(&leaf(0, 3, 0), &p0, 10, 3, &mut out, &mut pending),
            Absorbed::Taken
        );
        let taken: Vec<Key> = out.iter().map(|p| p.0).collect();
        assert_eq!(taken, vec![10, 20, 30]);
        assert_eq!(pending.len(), 3);
        // The head of partition 1 in the same batch: nothing more taken,
        // and the walk stops where partition 0's keys are not yet taken.
        let p1 = vec![(1000, fat(1000)), (1010, fat(1010))];
        assert_eq!(
            c.absorb(&leaf(1, 7, 8), &p1, 10, 3, &mut out, &mut pending),
            Absorbed::Stop(ScanStop::At(0, 31))
        );
        assert_eq!(out.len(), 3);
        assert_eq!(c.resume(), ScanStop::At(0, 31));
    }

    /// A partition head is taken only after the previous partition's
    /// rightmost leaf, and then the resume point moves to its keys.
    #[test]
    fn crossing_needs_the_rightmost_leaf_and_then_moves_on() {
        let mk = || Chain {
            at: 0,
            next: Some(10),
            prev_next: None,
            parts: vec![0, 1000],
        };
        let p0: Vec<(Key, SlotValue)> = vec![(10, fat(10)), (20, fat(20))];
        let p1: Vec<(Key, SlotValue)> = vec![(1000, fat(1000)), (1010, fat(1010))];
        // Not the rightmost leaf (right link 4): the head is refused and the
        // server goes on from the first key not taken.
        let (mut out, mut pending) = (Vec::new(), Vec::new());
        let mut c = mk();
        c.absorb(&leaf(0, 3, 4), &p0, 10, 10, &mut out, &mut pending);
        assert_eq!(
            c.absorb(&leaf(1, 7, 8), &p1, 10, 10, &mut out, &mut pending),
            Absorbed::Stop(ScanStop::Fallback(0, 21, FallbackCause::ScanChain))
        );
        // The rightmost leaf: the head is taken and the scan fills there.
        let (mut out, mut pending) = (Vec::new(), Vec::new());
        let mut c = mk();
        c.absorb(&leaf(0, 3, 0), &p0, 10, 3, &mut out, &mut pending);
        assert_eq!(
            c.absorb(&leaf(1, 7, 8), &p1, 10, 3, &mut out, &mut pending),
            Absorbed::Crossed
        );
        let taken: Vec<Key> = out.iter().map(|p| p.0).collect();
        assert_eq!(taken, vec![10, 20, 1000]);
        assert_eq!(pending[2].part, 1);
        assert_eq!(c.resume(), ScanStop::At(1, 1001));
        // A head split since training: looked up afresh from its start.
        let mut c = mk();
        let (mut out, mut pending) = (Vec::new(), Vec::new());
        c.absorb(&leaf(0, 3, 0), &p0, 10, 3, &mut out, &mut pending);
        let mut split = leaf(1, 7, 8);
        split.as_trained = false;
        assert_eq!(
            c.absorb(&split, &p1, 10, 3, &mut out, &mut pending),
            Absorbed::Stop(ScanStop::At(1, 1000))
        );
    }
}
