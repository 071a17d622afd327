//! Ludo hashing's control plane (paper §2.2, §4.2): a (2,4)-cuckoo table
//! decides which of its two candidate buckets each key lives in, every
//! bucket gets an 8-bit seed found by brute force that sends its keys to
//! distinct slots, and an [`Othello`] records each key's bucket choice.
//!
//! The result is the index of one DMPH table: the compute-heavy half
//! (Othello + seeds) goes to compute nodes, the placement of every key
//! (bucket, slot) fills the memory node's buckets. A key the cuckoo search
//! cannot place, or one in a bucket no seed separates, goes to the overflow
//! cache under its first candidate bucket (the paper's fallback table).

use crate::hash::{candidates, slot};
use crate::othello::Othello;
use std::collections::VecDeque;

pub const SLOTS: usize = 4;
/// Longest cuckoo path, as in Ludo's control plane.
const MAX_PATH: u8 = 5;
/// Buckets a single cuckoo search may visit.
const MAX_VISITS: usize = 2_000;
const EMPTY: u32 = u32::MAX;

/// Where the build put one key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Placement {
    pub bucket: u32,
    /// `None`: the key is in the overflow cache under `bucket`.
    pub slot: Option<u8>,
}

/// One built DMPH table.
#[derive(Debug, Clone)]
pub struct LudoBuild {
    pub buckets: u32,
    pub bucket_seed: u64,
    pub seeds: Vec<u8>,
    pub othello: Othello,
    /// Per input key, in input order.
    pub placement: Vec<Placement>,
    /// Keys that went to the overflow cache (cuckoo or seed failures).
    pub fallback: usize,
    /// Cache lines of its working arrays the build touched (random
    /// accesses one line each, sequential passes one per 64 bytes),
    /// Othello included: what the simulated memory node charges for it.
    pub lines: u64,
}

/// A seed under which `keys` (at most four) go to distinct slots, trying
/// 0..=255 in order.
pub fn find_seed(keys: &[u64]) -> Option<u8> {
    debug_assert!(keys.len() <= SLOTS);
    (0..=255u8).find(|&s| {
        let mut used = 0u8;
        keys.iter().all(|&k| {
            let bit = 1 << slot(k, s);
            let free = used & bit == 0;
            used |= bit;
            free
        })
    })
}

/// Builds a table of `buckets` buckets holding `keys` (distinct).
pub fn build(keys: &[u64], buckets: u32, bucket_seed: u64, othello_seed: u64) -> LudoBuild {
    assert!(buckets > 0);
    let mut lines = 0u64;
    let mut table = vec![[EMPTY; SLOTS]; buckets as usize];
    let mut home: Vec<u32> = vec![EMPTY; keys.len()];
    let mut overflow: Vec<u32> = Vec::new();
    let cand = |i: u32| candidates(keys[i as usize], bucket_seed, buckets);
    for i in 0..keys.len() as u32 {
        if !cuckoo_insert(&mut table, &mut home, i, &cand, &mut lines) {
            overflow.push(i);
        }
    }
    // A seed per bucket; a bucket no seed separates sheds keys to overflow.
    let mut seeds = vec![0u8; buckets as usize];
    let mut placement = vec![
        Placement {
            bucket: 0,
            slot: None
        };
        keys.len()
    ];
    // The seed pass reads the table in order (16 bytes a bucket) and, per
    // member, its key and its placement entry.
    lines += (buckets as u64 * 16).div_ceil(64);
    for (b, bucket) in table.iter_mut().enumerate() {
        let mut members: Vec<u32> = bucket.iter().copied().filter(|&i| i != EMPTY).collect();
        let seed = loop {
            let ks: Vec<u64> = members.iter().map(|&i| keys[i as usize]).collect();
            if let Some(s) = find_seed(&ks) {
                break s;
            }
            let shed = members.pop().expect("an empty bucket always has a seed");
            overflow.push(shed);
        };
        seeds[b] = seed;
        lines += 2 * members.len() as u64;
        for &i in &members {
            placement[i as usize] = Placement {
                bucket: b as u32,
                slot: Some(slot(keys[i as usize], seed) as u8),
            };
        }
    }
    lines += 2 * overflow.len() as u64;
    for &i in &overflow {
        // Overflowed keys stay under their first candidate (or the bucket
        // they were in when their bucket shed them).
        let b = if home[i as usize] != EMPTY {
            home[i as usize]
        } else {
            cand(i)[0]
        };
        home[i as usize] = b;
        placement[i as usize] = Placement {
            bucket: b,
            slot: None,
        };
    }
    let values: Vec<bool> = (0..keys.len() as u32)
        .map(|i| {
            let [c0, c1] = cand(i);
            c0 != c1 && placement[i as usize].bucket == c1
        })
        .collect();
    // The values pass: keys and placements in order (8 bytes each).
    lines += (keys.len() as u64 * 16).div_ceil(64);
    let othello = Othello::build_counted(keys, &values, othello_seed, &mut lines);
    LudoBuild {
        buckets,
        bucket_seed,
        seeds,
        othello,
        placement,
        fallback: overflow.len(),
        lines,
    }
}

/// Places key `i` by breadth-first cuckoo search; false if no path of at
/// most [`MAX_PATH`] buckets ends at a free slot.
fn cuckoo_insert(
    table: &mut [[u32; SLOTS]],
    home: &mut [u32],
    i: u32,
    cand: &impl Fn(u32) -> [u32; 2],
    lines: &mut u64,
) -> bool {
    // The key, its two candidate buckets and its home entry.
    *lines += 4;
    let [c0, c1] = cand(i);
    let free = |t: &[[u32; SLOTS]], b: u32| t[b as usize].iter().position(|&x| x == EMPTY);
    let load = |t: &[[u32; SLOTS]], b: u32| t[b as usize].iter().filter(|&&x| x != EMPTY).count();
    // The less loaded candidate first (balanced (2,4)-cuckoo).
    let order = if load(table, c1) < load(table, c0) {
        [c1, c0]
    } else {
        [c0, c1]
    };
    for b in order {
        if let Some(s) = free(table, b) {
            table[b as usize][s] = i;
            home[i as usize] = b;
            return true;
        }
    }
    // Breadth-first search over evictions.
    struct Node {
        bucket: u32,
        depth: u8,
        parent: usize,
        parent_slot: usize,
    }
    let mut nodes: Vec<Node> = Vec::new();
    let mut queue: VecDeque<usize> = VecDeque::new();
    for b in order {
        nodes.push(Node {
            bucket: b,
            depth: 1,
            parent: usize::MAX,
            parent_slot: 0,
        });
        queue.push_back(nodes.len() - 1);
    }
    while let Some(n) = queue.pop_front() {
        // The visited bucket's row.
        *lines += 1;
        let b = nodes[n].bucket;
        if let Some(mut hole) = free(table, b) {
            // Shift keys back along the path, from the free end.
            let mut cur = n;
            while nodes[cur].parent != usize::MAX {
                let p = nodes[cur].parent;
                let from = nodes[p].bucket;
                // The row moved from and the moved key's home entry.
                *lines += 2;
                let moved = table[from as usize][nodes[cur].parent_slot];
                table[nodes[cur].bucket as usize][hole] = moved;
                home[moved as usize] = nodes[cur].bucket;
                hole = nodes[cur].parent_slot;
                cur = p;
            }
            table[nodes[cur].bucket as usize][hole] = i;
            home[i as usize] = nodes[cur].bucket;
            return true;
        }
        if nodes[n].depth >= MAX_PATH || nodes.len() >= MAX_VISITS {
            continue;
        }
        let row = table[b as usize];
        for (s, &k) in row.iter().enumerate() {
            // The resident key, to hash its other candidate.
            *lines += 1;
            let [a0, a1] = cand(k);
            let alt = if a0 == b { a1 } else { a0 };
            if alt == b {
                continue;
            }
            nodes.push(Node {
                bucket: alt,
                depth: nodes[n].depth + 1,
                parent: n,
                parent_slot: s,
            });
            queue.push_back(nodes.len() - 1);
        }
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::mix64;

    fn check(keys: &[u64], b: &LudoBuild) {
        let mut used = std::collections::HashSet::new();
        for (i, &k) in keys.iter().enumerate() {
            let p = b.placement[i];
            let [c0, c1] = candidates(k, b.bucket_seed, b.buckets);
            let pick = if b.othello.lookup(k) { c1 } else { c0 };
            assert_eq!(pick, p.bucket, "the locator finds key {k}'s bucket");
            if let Some(s) = p.slot {
                assert_eq!(slot(k, b.seeds[p.bucket as usize]), s as usize);
                assert!(used.insert((p.bucket, s)), "two keys in one slot");
            }
        }
    }

    #[test]
    fn builds_at_high_load_with_few_fallbacks() {
        let n = 40_000u64;
        let keys: Vec<u64> = (0..n).map(|i| mix64(i ^ 0xABC)).collect();
        let buckets = (n as f64 / (4.0 * 0.95)).ceil() as u32;
        let b = build(&keys, buckets, 77, 78);
        check(&keys, &b);
        assert!(b.fallback < 20, "{} fallbacks", b.fallback);
    }

    #[test]
    fn overfull_tables_overflow_instead_of_failing() {
        let keys: Vec<u64> = (0..40u64).map(mix64).collect();
        let b = build(&keys, 4, 1, 2);
        check(&keys, &b);
        assert_eq!(b.fallback, 40 - 16);
    }

    #[test]
    fn seeds_separate_any_four_keys() {
        for base in 0..200u64 {
            let ks = [base * 4, base * 4 + 1, base * 4 + 2, base * 4 + 3].map(mix64);
            let s = find_seed(&ks).expect("a seed separates four keys");
            let slots: std::collections::HashSet<_> = ks.iter().map(|&k| slot(k, s)).collect();
            assert_eq!(slots.len(), 4);
        }
    }
}
