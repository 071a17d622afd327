#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Time of one Ludo build (cuckoo placement, seeds, Othello) of N keys.
//! `cargo run --release -p dmkv-outback --example build_time -- [keys]`
fn main() {
    let n: u64 = std::env::args()
        .nth(1)
        .map_or(1_000_000, |a| a.parse().unwrap());
    let keys: Vec<u64> = (0..n).map(|i| dmkv_outback::hash::mix64(i ^ 77)).collect();
    let buckets = (n as f64 / (4.0 * 0.95)).ceil() as u32;
    let t = std::time::Instant::now();
    let b = dmkv_outback::ludo::build(&keys, buckets, 1, 2);
    let total = t.elapsed();
    let t = std::time::Instant::now();
    let values: Vec<bool> = keys.iter().map(|k| k & 1 == 1).collect();
    let o = dmkv_outback::othello::Othello::build(&keys, &values, 3);
    println!(
        "{n} keys: ludo build {:.3}s (fallback {}), othello alone {:.3}s ({} bytes)",
        total.as_secs_f64(),
        b.fallback,
        t.elapsed().as_secs_f64(),
        o.bytes()
    );
}
