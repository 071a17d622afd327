//! The shared suites (oracle, races with and without torn reads, bad input)
//! and the per-operation costs the baseline stands for.

use dmkv_api::Knobs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::make_value;
use dmkv_rpc_hash::SPEC;
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_testkit::oracle::{check_multi, check_single, op_strategy};
use dmkv_transport::exec::block_on;
use dmkv_transport::{OpKind, labeled};
use proptest::prelude::*;

fn deploy_with(memnodes: usize, threads: usize, knobs: &[(&str, &str)]) -> LocalDeployment {
    let mut k = Knobs::new();
    for (n, v) in knobs {
        k.set(n, v);
    }
    LocalDeployment::deploy(
        &SPEC,
        &DeployOptions {
            memnodes,
            threads,
            knobs: k,
            expected_keys: 1000,
            ..Default::default()
        },
    )
    .unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(ops in prop::collection::vec(op_strategy(60, 4096, false), 1..200)) {
        // One main bucket: every key lands in one chain of indirect buckets.
        let d = deploy_with(1, 1, &[("buckets", "1")]);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client_on_two_memory_nodes() {
    let d = deploy_with(2, 2, &[]);
    check_multi(&d, 2, 3, 300, 11).unwrap();
}

#[test]
fn writers_race_readers_with_and_without_torn_reads() {
    for torn in [false, true] {
        let d = deploy_with(1, 2, &[("buckets", "4")]);
        let r = race(
            &d,
            &RaceConfig {
                torn_reads: torn,
                scans: false,
                value_len: 24,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(r.writes > 0 && r.reads > 0, "{r:?}");
    }
}

#[test]
fn bad_input_is_refused() {
    let d = deploy_with(1, 1, &[]);
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 200, 5).unwrap();
}

#[test]
fn a_bad_knob_is_a_config_error() {
    let mut k = Knobs::new();
    k.set("buckets", "3");
    let e = LocalDeployment::deploy(
        &SPEC,
        &DeployOptions {
            knobs: k,
            ..Default::default()
        },
    );
    assert!(e.is_err());
}

/// One RPC and nothing else per operation; the memory node reports its work.
#[test]
fn every_operation_is_one_rpc() {
    let d = deploy_with(1, 1, &[]);
    let pairs: Vec<_> = (1..=200u64).map(|k| (k, make_value(k, 0, 8))).collect();
    let (ep, store) = d.client(0).unwrap();
    block_on(d.engine.load(&ep, &pairs)).unwrap();
    ep.reset_counters();
    block_on(async {
        for k in 1..=100u64 {
            labeled(OpKind::Get, store.get(k)).await.unwrap().unwrap();
            labeled(OpKind::Update, store.update(k, &make_value(k, 1, 8)))
                .await
                .unwrap();
            labeled(OpKind::Insert, store.insert(1000 + k, &make_value(k, 1, 8)))
                .await
                .unwrap();
            labeled(OpKind::Delete, store.delete(k)).await.unwrap();
        }
    });
    let c = ep.counters();
    for kind in [OpKind::Get, OpKind::Update, OpKind::Insert, OpKind::Delete] {
        let k = c.get(kind);
        assert_eq!((k.round_trips, k.rpcs, k.verbs), (100, 100, 0), "{kind:?}");
    }
    let stats = block_on(d.engine.stats(&ep)).unwrap();
    assert_eq!(stats["keys"], 200);
    assert!(
        stats["slots_probed_per_lookup"].as_f64().unwrap() >= 1.0,
        "{stats}"
    );
    assert!(
        stats["keys_compared_per_lookup"].as_f64().unwrap() >= 1.0,
        "{stats}"
    );
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for (torn, memnodes, knobs) in [
        (false, 1, &[][..]),
        (false, 1, &[("buckets", "1")][..]),
        (true, 1, &[("buckets", "1")][..]),
        (true, 2, &[][..]),
    ] {
        let d = deploy_with(memnodes, 3, knobs);
        let cfg = InsertRaceConfig {
            torn_reads: torn,
            ..Default::default()
        };
        let r = insert_race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn}: {e}"));
        assert_eq!(r.keys, (cfg.rounds * cfg.keys_per_round) as u64);
    }
}
