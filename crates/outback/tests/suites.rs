//! The testkit suites every engine passes: oracle (single and multi-client),
//! writers racing readers with and without torn reads, bad input and
//! garbage RPCs. Tables start tiny, so these runs also go through many
//! splits (resizes) with writes buffered and applied afterwards.

mod common;

use dmkv_api::Knobs;
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_testkit::oracle::{check_multi, check_single, op_strategy};
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(ops in prop::collection::vec(op_strategy(60, dmkv_outback::CAPS.max_value_len, false), 1..200)) {
        let d = common::deploy();
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_single_client_on_three_replicated_shards() {
    let d = common::deploy_with(common::small_tables(), 3, 1);
    let mut rng = 7u64;
    let ops: Vec<_> = (0..400)
        .map(|_| {
            rng = dmkv_outback::hash::mix64(rng);
            let k = dmkv_testkit::oracle::spread_key(rng % 90);
            match rng >> 60 {
                0..=5 => dmkv_testkit::oracle::Op::Insert(k, rng.to_le_bytes().to_vec()),
                6..=8 => dmkv_testkit::oracle::Op::Get(k),
                9..=10 => dmkv_testkit::oracle::Op::Update(k, vec![1; 20]),
                11..=12 => dmkv_testkit::oracle::Op::Upsert(k, vec![2; 3]),
                _ => dmkv_testkit::oracle::Op::Delete(k),
            }
        })
        .collect();
    check_single(&d, &ops).unwrap();
}

#[test]
fn oracle_multi_client() {
    for memnodes in [1, 3] {
        let d = common::deploy_with(common::small_tables(), memnodes, 2);
        check_multi(&d, 2, 3, 200, 11).unwrap();
    }
}

#[test]
fn oracle_multi_client_with_default_tables() {
    let d = common::deploy_with(Knobs::new(), 1, 2);
    check_multi(&d, 2, 2, 300, 5).unwrap();
}

#[test]
fn race_with_and_without_torn_reads() {
    for torn in [false, true] {
        for memnodes in [1, 3] {
            let d = common::deploy_with(common::small_tables(), memnodes, 2);
            let r = race(
                &d,
                &RaceConfig {
                    torn_reads: torn,
                    scans: false,
                    ..Default::default()
                },
            )
            .unwrap();
            assert!(r.writes > 0 && r.reads > 0, "{r:?}");
        }
    }
}

#[test]
fn bad_input_is_refused() {
    let d = common::deploy();
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 80, 3).unwrap();
    let d = common::deploy_with(common::small_tables(), 3, 1);
    check_garbage_rpcs(&d, 60, 4).unwrap();
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for (knobs, memnodes, torn) in [
        (Knobs::new(), 1, false),
        (common::small_tables(), 1, false),
        (common::small_tables(), 1, true),
        (common::small_tables(), 3, true),
    ] {
        let d = common::deploy_with(knobs, memnodes, 3);
        let cfg = InsertRaceConfig {
            torn_reads: torn,
            ..Default::default()
        };
        let r = insert_race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn}: {e}"));
        assert_eq!(r.keys, (cfg.rounds * cfg.keys_per_round) as u64);
    }
}
