//! cell against the shared suites, plus its own claims: GET and SCAN are
//! one-sided (0 RPCs) with exact round trips per GET, stale cached nodes are
//! caught by incarnations and retried from the root, the cache stays within
//! its byte capacity, and a full region gives `Exhausted`.

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::{Knobs, KvError};
use dmkv_cell::SPEC;
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_testkit::oracle::{check_multi, check_single, op_strategy, range_bounds};
use dmkv_transport::exec::block_on;
use dmkv_transport::{OpKind, labeled};
use proptest::prelude::*;

fn opts(slots: usize, cached_levels: u8, handler_threads: usize, threads: usize) -> DeployOptions {
    let mut knobs = Knobs::new();
    knobs.set("slots", &slots.to_string());
    knobs.set("cached_levels", &cached_levels.to_string());
    DeployOptions {
        knobs,
        handler_threads,
        threads,
        expected_keys: 10_000,
        ..Default::default()
    }
}

fn deploy(slots: usize, cached_levels: u8) -> LocalDeployment {
    LocalDeployment::deploy(&SPEC, &opts(slots, cached_levels, 1, 1)).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(cached in prop_oneof![Just(1u8), Just(4)],
                            ops in prop::collection::vec(op_strategy(60, 200, true), 1..200)) {
        let d = deploy(4, cached);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client() {
    for handlers in [1, 2] {
        let d = LocalDeployment::deploy(&SPEC, &opts(4, 1, handlers, 2)).unwrap();
        check_multi(&d, 2, 4, 150, 13).unwrap();
    }
}

#[test]
fn races_with_and_without_torn_reads() {
    // N = 4 with many keys: splits race one-sided lookups, cached inner
    // nodes and scans along right links.
    for (torn, slots, keys, handlers, value_len) in [
        (false, 16, 64, 1, 8),
        (true, 16, 64, 1, 8),
        (true, 4, 400, 2, 8),
        (false, 4, 400, 2, 24),
        (true, 4, 400, 1, 24),
    ] {
        let d = LocalDeployment::deploy(&SPEC, &opts(slots, 1, handlers, 2)).unwrap();
        let cfg = RaceConfig {
            torn_reads: torn,
            keys,
            loaded: keys / 2,
            value_len,
            writes_per_writer: 200,
            reads_per_reader: 300,
            ..Default::default()
        };
        let r = race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn} N={slots}: {e}"));
        assert!(r.writes > 0 && r.reads > 0 && r.scans > 0, "{r:?}");
        if torn {
            let stats = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
            assert!(
                stats["torn_retries"].as_u64().unwrap() > 0,
                "torn reads were injected but none detected: {stats}"
            );
        }
    }
}

#[test]
fn bad_input_is_refused() {
    let d = deploy(16, 4);
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 200, 5).unwrap();
}

#[test]
fn a_full_node_region_gives_exhausted() {
    let mut o = opts(4, 1, 1, 1);
    o.knobs.set("nodes", "8");
    let d = LocalDeployment::deploy(&SPEC, &o).unwrap();
    let (_ep, s) = d.client(0).unwrap();
    block_on(async {
        let mut stored = Vec::new();
        let err = loop {
            let k = stored.len() as u64;
            match s.insert(k, &k.to_le_bytes()).await {
                Ok(true) => stored.push(k),
                Ok(false) => panic!("key {k} was new"),
                Err(e) => break e,
            }
            assert!(stored.len() < 1000, "eight nodes held 1000 keys");
        };
        assert!(matches!(err, KvError::Exhausted(_)), "{err}");
        for k in &stored {
            assert_eq!(s.get(*k).await.unwrap(), Some(k.to_le_bytes().to_vec()));
        }
        assert_eq!(s.scan(0, 10_000).await.unwrap().len(), stored.len());
    });
}

/// Loads `n` keys with values of `len` bytes and returns the tree height.
fn load(d: &LocalDeployment, n: u64, len: usize) -> u64 {
    let ep = d.endpoint(0);
    let pairs: Vec<(u64, Vec<u8>)> = (0..n).map(|k| (k * 10, vec![k as u8; len])).collect();
    block_on(d.engine.load(&ep, &pairs)).unwrap();
    block_on(d.engine.stats(&ep)).unwrap()["height"]
        .as_u64()
        .unwrap()
}

/// Per-GET counters over `gets` lookups after one warm-up pass.
fn per_get(d: &LocalDeployment, keys: u64, gets: u64) -> (f64, f64, f64) {
    let (ep, s) = d.client(0).unwrap();
    block_on(async {
        for k in 0..keys {
            assert!(s.get(k * 10).await.unwrap().is_some());
        }
    });
    ep.reset_counters();
    block_on(async {
        for i in 0..gets {
            let k = (i * 7919) % keys * 10;
            let v = labeled(OpKind::Get, s.get(k)).await.unwrap();
            assert_eq!(v.unwrap()[0], (k / 10) as u8);
        }
    });
    let c = *ep.counters().get(OpKind::Get);
    let g = gets as f64;
    (
        c.rpcs as f64 / g,
        c.round_trips as f64 / g,
        c.bytes_read as f64 / g,
    )
}

#[test]
fn gets_are_one_sided_with_exact_round_trips() {
    // Every inner node cached: the leaf's key lines and its value line.
    let d = deploy(16, 1);
    let h = load(&d, 2000, 8);
    assert!(h >= 3, "height {h}");
    let (rpcs, rts, bytes) = per_get(&d, 2000, 300);
    assert_eq!((rpcs, rts), (0.0, 2.0));
    // 200 bytes of key lines, then a 72-byte line or the 64-byte last line.
    assert!((264.0..=272.0).contains(&bytes), "{bytes} bytes per GET");
    // Nothing cached: one read per inner level as well.
    let d = deploy(16, 100);
    let h = load(&d, 2000, 8);
    let (rpcs, rts, _) = per_get(&d, 2000, 300);
    assert_eq!((rpcs, rts), (0.0, (h - 1) as f64 + 2.0));
    // Out-of-line values: the value line holds a fat pointer, then the block.
    let d = deploy(16, 1);
    load(&d, 2000, 30);
    let (rpcs, rts, _) = per_get(&d, 2000, 300);
    assert_eq!((rpcs, rts), (0.0, 3.0));
    let stats = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
    assert!(stats["cache_hits"].as_u64().unwrap() > 0, "{stats}");
    assert!(d.engine.client_cache_bytes() > 0);
}

#[test]
fn get_bytes_match_layout() {
    // A key in slot 0 of a single-leaf tree: the key lines (lines 0..2 and
    // V_3, 200 bytes), then slot 0's line and the next version (72 bytes).
    let d = deploy(16, 1);
    let (ep, s) = d.client(0).unwrap();
    block_on(s.insert(5, &[1; 8])).unwrap();
    block_on(s.get(5)).unwrap();
    ep.reset_counters();
    assert_eq!(
        block_on(labeled(OpKind::Get, s.get(5))).unwrap(),
        Some(vec![1; 8])
    );
    let c = *ep.counters().get(OpKind::Get);
    assert_eq!((c.rpcs, c.round_trips, c.bytes_read), (0, 2, 200 + 72));
}

#[test]
fn stale_cached_nodes_are_detected_and_retried() {
    let d = LocalDeployment::deploy(&SPEC, &opts(4, 1, 1, 2)).unwrap();
    load(&d, 300, 8);
    let (_ea, a) = d.client(0).unwrap();
    let (_eb, b) = d.client(1).unwrap();
    block_on(async {
        // A caches every inner node.
        for k in 0..300u64 {
            assert!(a.get(k * 10).await.unwrap().is_some());
        }
        // B's inserts split leaves and inner nodes under A's cached copies.
        for k in 0..1500u64 {
            assert!(b.insert(k * 10 + 5, &[2; 8]).await.unwrap());
        }
        for k in 0..300u64 {
            assert_eq!(a.get(k * 10).await.unwrap(), Some(vec![k as u8; 8]));
        }
        for k in 0..1500u64 {
            assert_eq!(a.get(k * 10 + 5).await.unwrap(), Some(vec![2; 8]));
            assert_eq!(a.get(k * 10 + 6).await.unwrap(), None);
        }
        assert_eq!(a.scan(0, 5000).await.unwrap().len(), 1800);
    });
    let stats = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
    assert!(stats["stale_retries"].as_u64().unwrap() > 0, "{stats}");
    assert!(stats["superblock_reads"].as_u64().unwrap() > 1, "{stats}");
}

#[test]
fn the_cache_stays_within_its_capacity() {
    let mut o = opts(4, 1, 1, 1);
    o.knobs.set("cache_bytes", "2000");
    let d = LocalDeployment::deploy(&SPEC, &o).unwrap();
    load(&d, 2000, 8);
    let (_ep, s) = d.client(0).unwrap();
    block_on(async {
        for k in 0..2000u64 {
            assert_eq!(s.get(k * 10).await.unwrap(), Some(vec![k as u8; 8]));
        }
    });
    assert!(d.engine.client_cache_bytes() <= 2000 + 8);
    let stats = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
    assert!(stats["cache_evictions"].as_u64().unwrap() > 0, "{stats}");
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for (torn, slots, cached) in [(false, 4, 1), (true, 4, 4), (true, 16, 1)] {
        let d = LocalDeployment::deploy(&SPEC, &opts(slots, cached, 1, 3)).unwrap();
        let cfg = InsertRaceConfig {
            torn_reads: torn,
            ..Default::default()
        };
        let r = insert_race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn}: {e}"));
        assert_eq!(r.keys, (cfg.rounds * cfg.keys_per_round) as u64);
    }
}

// ---- range partitioning over several memory nodes ----------------------

/// Three memory nodes whose split keys cut the oracle's keys
/// (`spread_key(0..key_space)`) into three ranges: one-sided reads, scans
/// and RPC writes all cross ranges. Each range has its own node cache.
fn deploy_ranges(key_space: u64, cached_levels: u8, threads: usize) -> LocalDeployment {
    let mut o = opts(4, cached_levels, 1, threads);
    o.memnodes = 3;
    o.knobs.set("bounds", &range_bounds(key_space, 3));
    LocalDeployment::deploy(&SPEC, &o).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client_over_three_ranges(cached in prop_oneof![Just(1u8), Just(4)],
                                              ops in prop::collection::vec(op_strategy(60, 200, true), 1..200)) {
        let d = deploy_ranges(60, cached, 1);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client_over_three_ranges_and_each_range_holds_its_keys() {
    let d = deploy_ranges(2 * 4 * 24, 1, 2);
    check_multi(&d, 2, 4, 150, 19).unwrap();
    let stats = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
    let parts = stats["partitions"].as_array().expect("three ranges report");
    assert_eq!(parts.len(), 3);
    for p in parts {
        assert!(p["keys"].as_u64().unwrap() > 0, "{p}");
        assert!(
            p["traversals"].as_u64().unwrap() > 0,
            "one-sided reads in every range: {p}"
        );
    }
    let traversals: u64 = parts
        .iter()
        .map(|p| p["traversals"].as_u64().unwrap())
        .sum();
    assert_eq!(stats["traversals"].as_u64().unwrap(), traversals);
}
