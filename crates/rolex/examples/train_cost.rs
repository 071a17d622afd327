#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Training cost per key (paper §4.6: 0.28 µs per key "to obtain the
//! trained models and store the data in the leaves").
//!
//! Measures, on one core, for N sorted keys: OptimalPLR segmentation with
//! error ε, the measured-error pass, packing the pairs δ per leaf and
//! encoding every leaf image into a buffer (what a bulk load writes), and
//! separately retraining from leaves (`train_leaves`, what the memory node
//! does). Usage: `cargo run --release -p dmkv-rolex --example train_cost --
//! [keys] [epsilon] [slots] [uniform|lognormal|sequential]`.

use dmkv_rolex::layout::leaf::{Leaf, LeafLayout, Slot};
use dmkv_rolex::train::{LeafKeys, train_keys, train_leaves};
use rand::{Rng, SeedableRng};
use std::time::Instant;

fn keys(n: usize, dist: &str) -> Vec<u64> {
    let mut rng = rand::rngs::SmallRng::seed_from_u64(42);
    let mut k: Vec<u64> = match dist {
        "sequential" => (1..=n as u64).collect(),
        "lognormal" => {
            use rand_distr::Distribution;
            let d = rand_distr::LogNormal::new(0.0, 2.0).expect("lognormal");
            (0..n).map(|_| (d.sample(&mut rng) * 1e9) as u64).collect()
        }
        _ => (0..n).map(|_| rng.r#gen::<u64>() >> 1).collect(),
    };
    k.sort_unstable();
    k.dedup();
    k
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = args
        .get(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(10_000_000);
    let eps: u64 = args.get(2).and_then(|s| s.parse().ok()).unwrap_or(16);
    let slots: usize = args.get(3).and_then(|s| s.parse().ok()).unwrap_or(16);
    let dist = args.get(4).map_or("uniform", |s| s.as_str());
    let keys = keys(n, dist);
    let layout = LeafLayout::new(slots);

    // Bulk: train models over the keys and store the pairs in leaves.
    let t = Instant::now();
    let segs = train_keys(&keys, eps);
    let trained = t.elapsed();
    let mut buf: Vec<u64> = Vec::with_capacity(keys.len() / slots * layout.words() + 1024);
    let mut leaves = 0usize;
    for s in &segs {
        for chunk in keys[s.start..s.end].chunks(slots) {
            let mut leaf = Leaf::empty(chunk[0], u64::MAX);
            leaf.pairs = chunk
                .iter()
                .map(|k| Slot {
                    key: *k,
                    word: *k,
                    out_of_line: false,
                })
                .collect();
            buf.extend_from_slice(&leaf.encode(&layout, 1));
            leaves += 1;
        }
    }
    let total = t.elapsed();
    std::hint::black_box(&buf);
    let per = |d: std::time::Duration| d.as_nanos() as f64 / keys.len() as f64 / 1000.0;
    let avg_err = segs.iter().map(|s| s.err as f64).sum::<f64>() / segs.len() as f64;
    println!(
        "keys {} ({dist}), epsilon {eps}, leaf slots {slots}: {} models ({:.0} keys/model, mean err {:.1}), {} leaves",
        keys.len(),
        segs.len(),
        keys.len() as f64 / segs.len() as f64,
        avg_err,
        leaves
    );
    println!(
        "bulk training: {:.3} us/key to train models, {:.3} us/key to train and store in leaves",
        per(trained),
        per(total)
    );

    // Retraining: from leaves in key order (half-full leaves, as after
    // splits), no data moved.
    let groups: Vec<LeafKeys> = keys
        .chunks(slots / 2)
        .map(|c| LeafKeys {
            low: c[0],
            keys: c.to_vec(),
        })
        .collect();
    let t = Instant::now();
    let segs = train_leaves(&groups, slots, eps);
    let re = t.elapsed();
    println!(
        "retraining from {} half-full leaves: {} models, {:.3} us/key",
        groups.len(),
        segs.len(),
        per(re)
    );
}
