//! ROLEX behaves exactly like a BTreeMap: single client (proptest) and
//! several clients on several threads, with default and small tables (the
//! latter force splits, unlinks, retraining and model swaps), on one and on
//! several memory nodes.

mod common;

use common::{deploy_with, knobs, small};
use dmkv_api::Knobs;
use dmkv_testkit::oracle::{check_multi, check_single, op_strategy};
use dmkv_transport::exec::block_on;
use proptest::prelude::*;

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]

    #[test]
    fn oracle_single_client_defaults(ops in prop::collection::vec(op_strategy(60, 300, true), 1..200)) {
        let d = deploy_with(Knobs::new(), 1, 1);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }

    #[test]
    fn oracle_single_client_small_tables(ops in prop::collection::vec(op_strategy(120, 40, true), 1..400)) {
        let d = deploy_with(small(), 1, 1);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client_small_tables() {
    for memnodes in [1, 3] {
        let d = deploy_with(small(), 2, memnodes);
        check_multi(&d, 2, 3, 300, 11).unwrap();
    }
}

/// Bulk loads (twice, overlapping: the second merges with what is stored),
/// then random operations checked against a model that starts with the
/// loaded pairs.
#[test]
fn oracle_after_bulk_loads() {
    use dmkv_testkit::oracle::{Op, apply, check_contents};
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;
    for memnodes in [1, 2] {
        let d = deploy_with(
            knobs(&[("leaf_slots", "8"), ("slt_slots", "32")]),
            1,
            memnodes,
        );
        let ep = d.endpoint(0);
        let mut model = BTreeMap::new();
        let mut rng = rand::rngs::SmallRng::seed_from_u64(9);
        for round in 0..2u64 {
            let pairs: Vec<(u64, Vec<u8>)> = (0..2000u64)
                .map(|i| {
                    let k = 1000 + (i * 3 + round) * 1_000_003;
                    let len = [8, 8, 8, 0, 3, 20][(i % 6) as usize];
                    (k, (0..len).map(|_| rng.r#gen()).collect())
                })
                .collect();
            block_on(d.engine.load(&ep, &pairs)).unwrap();
            model.extend(pairs);
        }
        let (_ep, store) = d.client(0).unwrap();
        let caps = d.engine.capabilities();
        let keys: Vec<u64> = model.keys().copied().collect();
        block_on(async {
            check_contents(&*store, &model, &caps).await?;
            for _ in 0..1500 {
                let k = if rng.gen_bool(0.7) {
                    keys[rng.gen_range(0..keys.len())]
                } else {
                    rng.gen_range(0..7_000_000_000u64)
                };
                let v: Vec<u8> = (0..[8, 8, 0, 12][rng.gen_range(0..4)])
                    .map(|_| rng.r#gen())
                    .collect();
                let op = match rng.gen_range(0..6) {
                    0 => Op::Get(k),
                    1 => Op::Insert(k, v),
                    2 => Op::Update(k, v),
                    3 => Op::Upsert(k, v),
                    4 => Op::Delete(k),
                    _ => Op::Scan(k, rng.gen_range(1..40)),
                };
                apply(&*store, &mut model, &caps, &op).await?;
            }
            check_contents(&*store, &model, &caps).await
        })
        .unwrap();
    }
}
