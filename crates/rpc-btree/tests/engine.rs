//! rpc-btree against the shared suites, plus its own cost and capacity
//! claims: one RPC and one round trip per operation, `Exhausted` on a full
//! region, and correct operation with two handler threads.

use dmkv_api::EngineSpec;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::{Knobs, KvError};
use dmkv_rpc_btree::{RpcTreeClient, SPEC, connect_services};
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_testkit::oracle::{check_multi, check_single, op_strategy, range_bounds};
use dmkv_transport::exec::block_on;
use dmkv_transport::{OpKind, labeled};
use proptest::prelude::*;
use std::rc::Rc;

fn opts(slots: usize, handler_threads: usize, threads: usize) -> DeployOptions {
    let mut knobs = Knobs::new();
    knobs.set("slots", &slots.to_string());
    DeployOptions {
        knobs,
        handler_threads,
        threads,
        expected_keys: 10_000,
        ..Default::default()
    }
}

fn deploy(slots: usize) -> LocalDeployment {
    LocalDeployment::deploy(&SPEC, &opts(slots, 1, 1)).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(ops in prop::collection::vec(op_strategy(60, 200, true), 1..200)) {
        let d = deploy(4);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client() {
    for handlers in [1, 2] {
        let d = LocalDeployment::deploy(&SPEC, &opts(4, handlers, 2)).unwrap();
        check_multi(&d, 2, 4, 150, 11).unwrap();
    }
}

#[test]
fn races_with_and_without_torn_reads() {
    for (torn, slots, keys, handlers) in [
        (false, 16, 64, 1),
        (true, 16, 64, 1),
        (true, 4, 400, 2),
        (false, 4, 400, 2),
    ] {
        let d = LocalDeployment::deploy(&SPEC, &opts(slots, handlers, 2)).unwrap();
        let cfg = RaceConfig {
            torn_reads: torn,
            keys,
            loaded: keys / 2,
            writes_per_writer: 200,
            reads_per_reader: 300,
            ..Default::default()
        };
        let r = race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn} N={slots}: {e}"));
        assert!(r.writes > 0 && r.reads > 0 && r.scans > 0, "{r:?}");
    }
}

#[test]
fn bad_input_is_refused() {
    let d = deploy(16);
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 200, 5).unwrap();
}

#[test]
fn a_full_node_region_gives_exhausted() {
    let mut o = opts(4, 1, 1);
    o.knobs.set("nodes", "8");
    let d = LocalDeployment::deploy(&SPEC, &o).unwrap();
    let (_ep, s) = d.client(0).unwrap();
    let mut stored = Vec::new();
    let err = block_on(async {
        for k in 0..1000u64 {
            match s.insert(k, &k.to_le_bytes()).await {
                Ok(true) => stored.push(k),
                Ok(false) => panic!("key {k} was new"),
                Err(e) => return e,
            }
        }
        panic!("eight nodes held 1000 keys");
    });
    assert!(matches!(err, KvError::Exhausted(_)), "{err}");
    block_on(async {
        for k in &stored {
            assert_eq!(s.get(*k).await.unwrap(), Some(k.to_le_bytes().to_vec()));
        }
        assert_eq!(s.scan(0, 10_000).await.unwrap().len(), stored.len());
    });
}

#[test]
fn every_operation_is_one_rpc_and_one_round_trip() {
    let d = deploy(16);
    let ep0 = d.endpoint(0);
    let pairs: Vec<(u64, Vec<u8>)> = (0..3000u64).map(|k| (k * 5, vec![7; 8])).collect();
    block_on(d.engine.load(&ep0, &pairs)).unwrap();
    let (ep, s) = d.client(0).unwrap();
    ep.reset_counters();
    block_on(async {
        for k in 0..100u64 {
            labeled(OpKind::Get, s.get(k * 50)).await.unwrap();
            labeled(OpKind::Update, s.update(k * 50, &[8; 8]))
                .await
                .unwrap();
            labeled(OpKind::Insert, s.insert(k * 50 + 1, &[9; 30]))
                .await
                .unwrap();
            labeled(OpKind::Scan, s.scan(k * 50, 100)).await.unwrap();
        }
    });
    let c = ep.counters();
    for kind in [OpKind::Get, OpKind::Update, OpKind::Insert, OpKind::Scan] {
        let k = c.get(kind);
        assert_eq!((k.rpcs, k.round_trips, k.verbs), (100, 100, 0), "{kind:?}");
    }
    let stats = block_on(d.engine.stats(&ep0)).unwrap();
    assert_eq!(stats["keys"], 3100);
    assert!(stats["height"].as_u64().unwrap() >= 3, "{stats}");
    assert!(stats["fill_factor"].as_f64().unwrap() > 0.4, "{stats}");
}

#[test]
fn hinted_updates_over_rpc() {
    let d = deploy(4);
    let (_e, svc) =
        connect_services(&d.connect_args(d.compute), SPEC.name(), SPEC.knobs()).unwrap();
    let c = RpcTreeClient::new(d.endpoint(0), svc.svcs[0]);
    let c = Rc::new(c);
    block_on(async {
        use dmkv_api::KvStore;
        for k in 0..20u64 {
            c.insert(k, &[1; 8]).await.unwrap();
        }
        let hint = c.find_leaf(7).await.unwrap();
        let r = c.update_hinted(7, b"via hint", hint).await.unwrap();
        assert!(r.updated && r.hint_used);
        assert_eq!(c.get(7).await.unwrap(), Some(b"via hint".to_vec()));
        let bad = dmkv_xtree::LeafRef {
            node: u32::MAX,
            incarnation: 0,
        };
        assert!(c.update_hinted(7, b"x", bad).await.is_err());
    });
}

#[test]
fn long_scans_continue_past_the_reply_limit() {
    let mut o = opts(16, 1, 1);
    o.knobs.set("value_bytes", &(4 << 20).to_string());
    let d = LocalDeployment::deploy(&SPEC, &o).unwrap();
    let (ep, s) = d.client(0).unwrap();
    let big = vec![3u8; dmkv_xtree::MAX_VALUE_LEN];
    block_on(async {
        for k in 0..40u64 {
            assert!(s.insert(k, &big).await.unwrap());
        }
        ep.reset_counters();
        let got = labeled(OpKind::Scan, s.scan(0, 100)).await.unwrap();
        assert_eq!(got.len(), 40);
        assert!(got.iter().all(|(_, v)| *v == big));
        let got = labeled(OpKind::Scan, s.scan(5, 20)).await.unwrap();
        assert_eq!(got.first().map(|p| p.0), Some(5));
        assert_eq!(got.len(), 20);
    });
    // 256 KiB replies hold 15 values of 16 KiB: 40 pairs take 3 RPCs, 20 take 2.
    assert_eq!(ep.counters().get(OpKind::Scan).rpcs, 5);
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for (torn, slots, handlers) in [(false, 4, 1), (true, 4, 2), (true, 16, 1)] {
        let d = LocalDeployment::deploy(&SPEC, &opts(slots, handlers, 3)).unwrap();
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
/// (`spread_key(0..key_space)`) into three ranges, so that reads, writes
/// and scans cross ranges.
fn deploy_ranges(key_space: u64, threads: usize) -> LocalDeployment {
    let mut o = opts(4, 1, threads);
    o.memnodes = 3;
    o.knobs.set("bounds", &range_bounds(key_space, 3));
    LocalDeployment::deploy(&SPEC, &o).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 8, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client_over_three_ranges(ops in prop::collection::vec(op_strategy(60, 200, true), 1..200)) {
        let d = deploy_ranges(60, 1);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client_over_three_ranges_and_each_range_holds_its_keys() {
    // check_multi's key space: threads x tasks x 24 keys.
    let d = deploy_ranges(2 * 4 * 24, 2);
    check_multi(&d, 2, 4, 150, 17).unwrap();
    let stats = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
    let parts = stats["partitions"].as_array().expect("three ranges report");
    assert_eq!(parts.len(), 3);
    let keys: Vec<u64> = parts.iter().map(|p| p["keys"].as_u64().unwrap()).collect();
    assert!(keys.iter().all(|&k| k > 0), "{keys:?}");
    assert_eq!(keys.iter().sum::<u64>(), stats["keys"].as_u64().unwrap());
}

#[test]
fn bad_bounds_are_config_errors() {
    for (bounds, needle) in [
        ("5", "has 1 split keys; 3 memory nodes need 2"),
        ("9,3", "ascending"),
    ] {
        let mut o = opts(4, 1, 1);
        o.memnodes = 3;
        o.knobs.set("bounds", bounds);
        let e = LocalDeployment::deploy(&SPEC, &o)
            .err()
            .expect("refused")
            .to_string();
        assert!(e.contains(needle), "{bounds}: {e}");
    }
}
