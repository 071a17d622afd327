//! Othello: the bucket locator of Ludo hashing (paper §2.2, §4.2).
//!
//! Two bit arrays A (`ma` bits) and B (`mb` bits) and a hash that maps a key
//! to one cell in each. The key's 1-bit value is `A[a] ^ B[b]`. Building
//! treats every key as an edge `(a, b)` of a bipartite graph; if the graph
//! is acyclic (a forest), every tree can be 2-coloured so that each edge
//! gets its value: root a tree at 0 and walk it setting `cell(v) = cell(u) ^
//! value(edge)`. A cycle makes some assignment impossible, so the build
//! retries with another hash seed. With `ma = 1.33 n` and `mb = n` the
//! expected number of cycles is below one and the arrays cost 2.33 bits per
//! key. A key that was not in the build set looks up an arbitrary but fixed
//! bit: Outback uses that to pick the bucket of keys inserted later.

use crate::hash::othello_cells;
use rand::{Rng, SeedableRng, rngs::SmallRng};

/// Ratio of A's cells to keys (Othello's `ma = 1.33 n`).
const A_PER_KEY: f64 = 1.333_34;
/// Smallest array, so that tiny tables still spread.
const MIN_CELLS: u32 = 64;
/// Seeds tried at one size before both arrays grow by 1/16.
const TRIES_PER_SIZE: u32 = 16;

/// A built Othello: immutable, looked up by compute nodes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Othello {
    seed: u64,
    ma: u32,
    mb: u32,
    /// A's bits (cells `0..ma`) then B's (cells `ma..ma+mb`), packed.
    bits: Vec<u64>,
}

impl Othello {
    /// An Othello of no keys: every key looks up 0.
    pub fn empty() -> Othello {
        Othello::with_bits(
            0,
            MIN_CELLS,
            MIN_CELLS,
            vec![0; words(MIN_CELLS, MIN_CELLS)],
        )
    }

    fn with_bits(seed: u64, ma: u32, mb: u32, bits: Vec<u64>) -> Othello {
        debug_assert_eq!(bits.len(), words(ma, mb));
        Othello { seed, ma, mb, bits }
    }

    /// Rebuilds from parts read back from a locator region; `None` if they
    /// are inconsistent.
    pub fn from_parts(seed: u64, ma: u32, mb: u32, bits: Vec<u64>) -> Option<Othello> {
        (ma > 0 && mb > 0 && bits.len() == words(ma, mb))
            .then(|| Othello::with_bits(seed, ma, mb, bits))
    }

    pub fn seed(&self) -> u64 {
        self.seed
    }
    pub fn ma(&self) -> u32 {
        self.ma
    }
    pub fn mb(&self) -> u32 {
        self.mb
    }
    pub fn bits(&self) -> &[u64] {
        &self.bits
    }

    /// Bytes the two arrays take.
    pub fn bytes(&self) -> u64 {
        (self.bits.len() * 8) as u64
    }

    #[inline]
    fn bit(&self, cell: u64) -> bool {
        self.bits[(cell / 64) as usize] >> (cell % 64) & 1 == 1
    }

    /// The key's value: which of its two candidate buckets it lives in.
    #[inline]
    pub fn lookup(&self, key: u64) -> bool {
        let (a, b) = othello_cells(key, self.seed, self.ma, self.mb);
        self.bit(a as u64) ^ self.bit(self.ma as u64 + b as u64)
    }

    /// Bytes of an Othello of `n` keys built at the first size tried (a
    /// build that needs retries at larger sizes takes a few percent more).
    pub fn expected_bytes(n: usize) -> u64 {
        let mb = (n as u32).max(MIN_CELLS);
        let ma = ((n as f64 * A_PER_KEY).ceil() as u32).max(MIN_CELLS);
        words(ma, mb) as u64 * 8
    }

    /// Builds an Othello that returns `values[i]` for `keys[i]`. Keys must be
    /// distinct (a duplicate is a cycle of length two that no seed avoids).
    pub fn build(keys: &[u64], values: &[bool], rng_seed: u64) -> Othello {
        Othello::build_counted(keys, values, rng_seed, &mut 0)
    }

    /// [`Othello::build`], adding to `lines` the cache lines of its working
    /// arrays it touches (random accesses one line each, sequential passes
    /// one per 64 bytes): the simulated memory node charges a rebuild by
    /// them (docs/outback.md, "Resizes in virtual time").
    pub fn build_counted(keys: &[u64], values: &[bool], rng_seed: u64, lines: &mut u64) -> Othello {
        assert_eq!(keys.len(), values.len());
        let n = keys.len() as u64;
        let mut mb = (n as u32).max(MIN_CELLS);
        let mut ma = ((n as f64 * A_PER_KEY).ceil() as u32).max(MIN_CELLS);
        let mut rng = SmallRng::seed_from_u64(rng_seed);
        let mut tries = 0;
        loop {
            let seed: u64 = rng.r#gen();
            if let Some(bits) = try_build(keys, values, seed, ma, mb, lines) {
                return Othello::with_bits(seed, ma, mb, bits);
            }
            tries += 1;
            if tries % TRIES_PER_SIZE == 0 {
                ma += ma / 16 + 1;
                mb += mb / 16 + 1;
            }
        }
    }
}

fn words(ma: u32, mb: u32) -> usize {
    (ma as u64 + mb as u64).div_ceil(64) as usize
}

/// One attempt: `None` if the key graph has a cycle under `seed`.
fn try_build(
    keys: &[u64],
    values: &[bool],
    seed: u64,
    ma: u32,
    mb: u32,
    lines: &mut u64,
) -> Option<Vec<u64>> {
    let cells = ma as usize + mb as usize;
    // Sequential passes: keys and edges (8 bytes each), parent, start,
    // fill and done arrays (4, 4, 4 and 1 byte per cell).
    *lines += (keys.len() as u64 * 16 + cells as u64 * 13).div_ceil(64);
    let edges: Vec<(u32, u32)> = keys
        .iter()
        .map(|&k| {
            let (a, b) = othello_cells(k, seed, ma, mb);
            (a, ma + b)
        })
        .collect();
    // Acyclicity by union-find: an edge inside one component closes a cycle.
    let mut parent: Vec<u32> = (0..cells as u32).collect();
    fn find(parent: &mut [u32], mut x: u32, lines: &mut u64) -> u32 {
        *lines += 1;
        while parent[x as usize] != x {
            *lines += 1;
            let up = parent[parent[x as usize] as usize];
            parent[x as usize] = up;
            x = up;
        }
        x
    }
    for &(a, b) in &edges {
        let (ra, rb) = (find(&mut parent, a, lines), find(&mut parent, b, lines));
        if ra == rb {
            return None;
        }
        parent[ra as usize] = rb;
    }
    // Adjacency in compressed form: for each cell, the edges touching it.
    let mut start = vec![0u32; cells + 1];
    // Per edge: two counters, then two fill cursors and two adjacency slots.
    *lines += edges.len() as u64 * 6;
    for &(a, b) in &edges {
        start[a as usize + 1] += 1;
        start[b as usize + 1] += 1;
    }
    for i in 0..cells {
        start[i + 1] += start[i];
    }
    let mut fill = start.clone();
    let mut adj = vec![0u32; edges.len() * 2];
    for (e, &(a, b)) in edges.iter().enumerate() {
        adj[fill[a as usize] as usize] = e as u32;
        fill[a as usize] += 1;
        adj[fill[b as usize] as usize] = e as u32;
        fill[b as usize] += 1;
    }
    // Colour every tree from an arbitrary root.
    let mut bits = vec![0u64; words(ma, mb)];
    let mut done = vec![false; cells];
    let mut stack = Vec::new();
    for root in 0..cells {
        if done[root] || start[root] == start[root + 1] {
            continue;
        }
        done[root] = true;
        stack.push(root as u32);
        while let Some(u) = stack.pop() {
            // The cell's bit and its adjacency range.
            *lines += 2;
            let u_bit = bits[u as usize / 64] >> (u % 64) & 1;
            for &e in &adj[start[u as usize] as usize..start[u as usize + 1] as usize] {
                // The edge, its value and the far cell's done flag.
                *lines += 3;
                let (a, b) = edges[e as usize];
                let v = if a == u { b } else { a };
                if done[v as usize] {
                    continue;
                }
                done[v as usize] = true;
                if u_bit ^ values[e as usize] as u64 == 1 {
                    bits[v as usize / 64] |= 1 << (v % 64);
                }
                stack.push(v);
            }
        }
    }
    Some(bits)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::mix64;

    #[test]
    fn every_key_looks_up_its_value() {
        for n in [0usize, 1, 5, 100, 20_000] {
            let keys: Vec<u64> = (0..n as u64).map(|i| mix64(i) | 1).collect();
            let values: Vec<bool> = keys.iter().map(|k| k % 3 == 0).collect();
            let o = Othello::build(&keys, &values, n as u64);
            for (k, v) in keys.iter().zip(&values) {
                assert_eq!(o.lookup(*k), *v, "key {k} of {n}");
            }
            if n >= 20_000 {
                let bits_per_key = o.bytes() as f64 * 8.0 / n as f64;
                assert!(bits_per_key < 2.6, "{bits_per_key} bits per key");
            }
        }
    }

    #[test]
    fn parts_round_trip() {
        let keys = [3u64, 9, 27];
        let o = Othello::build(&keys, &[true, false, true], 1);
        let p = Othello::from_parts(o.seed(), o.ma(), o.mb(), o.bits().to_vec()).unwrap();
        assert_eq!(p, o);
        assert!(Othello::from_parts(1, 64, 64, vec![0; 1]).is_none());
    }
}
