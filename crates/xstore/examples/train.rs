#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Training micro-benchmark (§5.1, §7.5): time to train one sub-model of
//! about 200 keys from an XTree (the paper reports 8 µs), the same from
//! keys already in memory, and the time of a full training (top model,
//! intervals, every sub-model and its TT) over N keys.
//!
//! `cargo run --release -p dmkv-xstore --example train -- [KEYS]`
//! (KEYS defaults to 10,000,000; the tree is bulk-loaded in sorted order,
//! so leaves are about half full, as in the paper).

use dmkv_memnode::NodeRuntime;
use dmkv_transport::local::{LocalCluster, LocalConfig};
use dmkv_xstore::layout::TopModel;
use dmkv_xstore::model::{interval_starts, train_submodel, train_top};
use dmkv_xtree::{XTree, XTreeConfig};
use std::time::Instant;

fn main() {
    let keys: u64 = std::env::args()
        .nth(1)
        .map(|s| s.replace(['_', ','], "").parse().expect("KEYS is a number"))
        .unwrap_or(10_000_000);
    let cluster = LocalCluster::new(LocalConfig::default());
    let rt = NodeRuntime::new(cluster.add_node(1));
    let cfg = XTreeConfig::sized_for(keys, 8, 16).expect("N = 16");
    let tree = XTree::create(&rt, "b/nodes", "b/values", cfg).expect("tree");
    // Uniform random keys, loaded sorted.
    let mut x = 0x1234_5678_9ABC_DEF1u64;
    let mut ks: Vec<u64> = (0..keys)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x
        })
        .collect();
    ks.sort_unstable();
    ks.dedup();
    let t = Instant::now();
    let v = [7u8; 8];
    for chunk in ks.chunks(1 << 16) {
        let pairs: Vec<(u64, &[u8])> = chunk.iter().map(|&k| (k, &v[..])).collect();
        tree.bulk_load(&pairs).expect("load");
    }
    let st = tree.stats();
    println!(
        "loaded {} keys in {:.2} s: {} leaves, fill {:.2}",
        st.keys,
        t.elapsed().as_secs_f64(),
        st.leaves,
        st.fill_factor()
    );

    // One sub-model of ~200 keys: its interval's leaves from the tree, then
    // the regression, errors and TT.
    let m = (ks.len() as u64 / 200).max(1) as u32;
    let top = TopModel {
        slope: m as f64 / (u64::MAX as f64 + 1.0),
        intercept: 0.0,
    };
    let first = interval_starts(&top, 0, u64::MAX, m);
    let reps = m.min(20_000);
    let step = (m / reps).max(1);
    let mut total_keys = 0u64;
    let t = Instant::now();
    let mut leaves_kept = Vec::new();
    for i in (0..m).step_by(step as usize).take(reps as usize) {
        let (a, b) = (first[i as usize] as u64, (first[i as usize + 1] - 1) as u64);
        let leaves = tree.leaves_covering(a, b, usize::MAX).expect("walk");
        let s = train_submodel(&leaves, a, b, 16);
        total_keys += s.keys;
        if leaves_kept.len() < 2000 {
            leaves_kept.push((leaves, a, b));
        }
    }
    let per = t.elapsed().as_secs_f64() / reps as f64 * 1e6;
    println!(
        "train one sub-model from the tree: {per:.2} us ({:.0} keys each, {reps} sub-models)",
        total_keys as f64 / reps as f64
    );
    let t = Instant::now();
    let mut n = 0;
    for _ in 0..10 {
        for (leaves, a, b) in &leaves_kept {
            std::hint::black_box(train_submodel(leaves, *a, *b, 16));
            n += 1;
        }
    }
    println!(
        "train one sub-model from leaves in memory: {:.2} us",
        t.elapsed().as_secs_f64() / n as f64 * 1e6
    );

    // A full training, as the memory node runs it: sampled top model,
    // intervals, then every sub-model from the tree.
    let t = Instant::now();
    let stride = (ks.len() as u64 / (1 << 17)).max(1);
    let samples: Vec<(u64, u64)> = ks
        .iter()
        .enumerate()
        .step_by(stride as usize)
        .map(|(r, &k)| (k, r as u64))
        .collect();
    let top = train_top(&samples, ks.len() as u64, 0, u64::MAX, m);
    let t_top = t.elapsed();
    let first = interval_starts(&top, 0, u64::MAX, m);
    let t_int = t.elapsed();
    let mut tt = 0usize;
    for i in 0..m as usize {
        if first[i] < first[i + 1] {
            let (a, b) = (first[i] as u64, (first[i + 1] - 1) as u64);
            let leaves = tree.leaves_covering(a, b, usize::MAX).expect("walk");
            tt += train_submodel(&leaves, a, b, 16).entries.len();
        }
    }
    println!(
        "full training over {} keys, {m} sub-models, {tt} TT entries: {:.3} s (top model {:.3} s, intervals {:.3} s)",
        ks.len(),
        t.elapsed().as_secs_f64(),
        t_top.as_secs_f64(),
        (t_int - t_top).as_secs_f64(),
    );
}
