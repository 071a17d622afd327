#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Writers racing readers (with and without torn reads), many clients
//! inserting into the same leaf, inserts racing retraining and model swaps,
//! deletes emptying synonym leaves, and no lost keys anywhere.

mod common;

use common::{deploy_with, knobs, small};
use dmkv_api::Knobs;
use dmkv_api::deploy::LocalDeployment;
use dmkv_api::payload::{check_value, make_value};
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use std::collections::BTreeSet;

fn stats(d: &LocalDeployment) -> serde_json::Value {
    let ep = d.endpoint(0);
    block_on(d.engine.stats(&ep)).unwrap()
}

fn n(v: &serde_json::Value, k: &str) -> u64 {
    v[k].as_u64().unwrap_or_else(|| panic!("{k} in {v}"))
}

#[test]
fn races_with_and_without_torn_reads() {
    for (knobs, memnodes) in [(Knobs::new(), 1), (small(), 1), (small(), 2)] {
        for torn in [false, true] {
            let d = deploy_with(knobs.clone(), 2, memnodes);
            let r = race(
                &d,
                &RaceConfig {
                    torn_reads: torn,
                    keys: 96,
                    loaded: 64,
                    ..Default::default()
                },
            )
            .unwrap_or_else(|e| panic!("torn={torn} memnodes={memnodes}: {e}"));
            assert!(r.writes > 0 && r.reads > 0 && r.scans > 0, "{r:?}");
        }
    }
}

#[test]
fn torn_reads_are_detected_and_retried() {
    let d = deploy_with(small(), 2, 1);
    race(
        &d,
        &RaceConfig {
            torn_reads: true,
            keys: 32,
            loaded: 32,
            writes_per_writer: 600,
            reads_per_reader: 1200,
            ..Default::default()
        },
    )
    .unwrap();
    let s = stats(&d);
    assert!(
        n(&s, "torn_leaf_reads") > 0,
        "no torn read was ever seen: {s}"
    );
}

#[test]
fn bad_input_is_refused() {
    let d = deploy_with(Knobs::new(), 1, 1);
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 200, 7).unwrap();
}

/// Many tasks on several threads insert distinct keys that all fall into
/// one leaf's range at first (consecutive keys), so every insert contends
/// for the same LT lock, splits the same leaf and fills the same SLT.
#[test]
fn many_clients_insert_into_the_same_leaf() {
    for sharing in ["true", "false"] {
        let d = deploy_with(
            knobs(&[
                ("leaf_slots", "8"),
                ("slt_slots", "32"),
                ("lock_sharing", sharing),
                ("poll_us", "50"),
            ]),
            3,
            1,
        );
        let threads = 3;
        let tasks = 4;
        let per_task = 150u64;
        std::thread::scope(|s| {
            for t in 0..threads {
                let d = &d;
                s.spawn(move || {
                    let (_ep, store) = d.client(t).unwrap();
                    let store = &*store;
                    let futs: Vec<LocalTask<'_, ()>> = (0..tasks)
                        .map(|j| {
                            Box::pin(async move {
                                let me = (t * tasks + j) as u64;
                                for i in 0..per_task {
                                    let k = 1_000 + i * (threads * tasks) as u64 + me;
                                    let v = make_value(k, 1, 8);
                                    assert!(store.insert(k, &v).await.unwrap(), "insert {k}");
                                }
                            }) as LocalTask<'_, ()>
                        })
                        .collect();
                    run_tasks(futs);
                });
            }
        });
        let total = per_task * (threads * tasks) as u64;
        let (_ep, store) = d.client(0).unwrap();
        block_on(async {
            for k in 1_000..1_000 + total {
                let v = store
                    .get(k)
                    .await
                    .unwrap()
                    .unwrap_or_else(|| panic!("lost key {k}"));
                assert_eq!(check_value(k, &v), Ok(1));
            }
            let all = store.scan(0, total as usize + 5).await.unwrap();
            assert_eq!(all.len() as u64, total);
        });
        let s = stats(&d);
        assert!(n(&s, "splits") > 0, "{s}");
        if sharing == "true" {
            assert!(n(&s, "lock_handovers") > 0, "no lock was ever shared: {s}");
        }
    }
}

/// Inserts keep going while models are retrained and swapped under them;
/// every acknowledged key is present afterwards and retraining happened.
#[test]
fn inserts_race_retraining_and_model_swaps() {
    let d = deploy_with(
        knobs(&[
            ("leaf_slots", "4"),
            ("epsilon", "2"),
            ("slt_slots", "8"),
            ("poll_us", "20"),
        ]),
        2,
        2,
    );
    let threads = 2;
    let tasks = 3;
    let per_task = 400u64;
    let written: Vec<Vec<u64>> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..threads)
            .map(|t| {
                let d = &d;
                s.spawn(move || {
                    let (_ep, store) = d.client(t).unwrap();
                    let store = &*store;
                    let futs: Vec<LocalTask<'_, Vec<u64>>> = (0..tasks)
                        .map(|j| {
                            Box::pin(async move {
                                let me = (t * tasks + j) as u64;
                                let mut mine = Vec::new();
                                for i in 0..per_task {
                                    // Interleaved across tasks, scattered over the key space.
                                    let k = (i * 6 + me).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 2;
                                    let v = make_value(k, 1, 8);
                                    if store.insert(k, &v).await.unwrap() {
                                        mine.push(k);
                                    }
                                    // Reads of earlier keys run against swapping models.
                                    if i % 3 == 0 && !mine.is_empty() {
                                        let old = mine[(i as usize * 7) % mine.len()];
                                        assert!(
                                            store.get(old).await.unwrap().is_some(),
                                            "lost {old}"
                                        );
                                    }
                                }
                                mine
                            }) as LocalTask<'_, Vec<u64>>
                        })
                        .collect();
                    run_tasks(futs).into_iter().flatten().collect()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let ep = d.endpoint(0);
    block_on(d.engine.settle(&ep)).unwrap();
    let keys: BTreeSet<u64> = written.into_iter().flatten().collect();
    let (_ep, store) = d.client(0).unwrap();
    block_on(async {
        for k in &keys {
            let v = store
                .get(*k)
                .await
                .unwrap()
                .unwrap_or_else(|| panic!("lost key {k}"));
            assert_eq!(check_value(*k, &v), Ok(1));
        }
        let all = store.scan(0, keys.len() + 5).await.unwrap();
        let got: Vec<u64> = all.iter().map(|p| p.0).collect();
        assert_eq!(got, keys.iter().copied().collect::<Vec<_>>());
    });
    let s = stats(&d);
    assert!(n(&s, "retrains") > 0, "no retraining happened: {s}");
    assert!(n(&s["memnode"], "retrain_cpu_ns") > 0, "{s}");
}

/// Deletes empty synonym leaves, which get unlinked (and, at the next
/// retraining, left out); keys around them stay reachable.
#[test]
fn deletes_empty_synonym_leaves() {
    // No retraining in this test (the threshold is above the synonym leaves
    // created), so every emptied synonym leaf is unlinked at once.
    let d = deploy_with(
        knobs(&[
            ("leaf_slots", "4"),
            ("slt_slots", "256"),
            ("retrain_threshold", "255"),
        ]),
        1,
        1,
    );
    let (_ep, store) = d.client(0).unwrap();
    let keys: Vec<u64> = (0..400u64).map(|i| 10 + i * 10).collect();
    block_on(async {
        for k in &keys {
            assert!(store.insert(*k, &make_value(*k, 1, 8)).await.unwrap());
        }
        // Delete runs of keys so whole synonym leaves empty out.
        for (i, k) in keys.iter().enumerate() {
            if (i / 8) % 2 == 1 {
                assert!(store.delete(*k).await.unwrap());
            }
        }
        for (i, k) in keys.iter().enumerate() {
            let got = store.get(*k).await.unwrap();
            assert_eq!(got.is_some(), (i / 8) % 2 == 0, "key {k}");
            assert_eq!(store.get(k + 5).await.unwrap(), None);
        }
        let all = store.scan(0, 1000).await.unwrap();
        assert_eq!(all.len(), keys.len() / 2 + keys.len() % 16 / 2);
        // Deleted ranges take inserts again.
        for (i, k) in keys.iter().enumerate() {
            if (i / 8) % 2 == 1 {
                assert!(store.insert(*k, &make_value(*k, 2, 8)).await.unwrap());
            }
        }
        for k in &keys {
            assert!(store.get(*k).await.unwrap().is_some());
        }
    });
    let ep = d.endpoint(0);
    block_on(d.engine.settle(&ep)).unwrap();
    let s = stats(&d);
    assert!(
        n(&s, "synonym_unlinks") > 0,
        "no synonym leaf was unlinked: {s}"
    );
}

/// Leaves emptied by deletes are left out of the next retraining and merged
/// into their predecessor; nothing is lost on the way.
#[test]
fn empty_leaves_are_merged_at_retraining() {
    use rand::{Rng, SeedableRng};
    use std::collections::BTreeMap;
    let d = deploy_with(small(), 1, 1);
    let (_ep, store) = d.client(0).unwrap();
    let ep = d.endpoint(0);
    let mut rng = rand::rngs::SmallRng::seed_from_u64(3);
    let mut model = BTreeMap::new();
    block_on(async {
        for _ in 0..2000 {
            let k = rng.gen_range(1..1u64 << 40);
            let v = make_value(k, 1, 8);
            if store.insert(k, &v).await.unwrap() {
                model.insert(k, v);
            }
        }
        d.engine.settle(&ep).await.unwrap();
        let keys: Vec<u64> = model.keys().copied().collect();
        for (i, k) in keys.iter().enumerate() {
            if i % 10 < 8 {
                assert!(store.delete(*k).await.unwrap());
                model.remove(k);
            }
        }
        for _ in 0..2000 {
            let k = rng.gen_range(1..1u64 << 40);
            let v = make_value(k, 2, 8);
            if store.insert(k, &v).await.unwrap() {
                model.insert(k, v);
            }
        }
        d.engine.settle(&ep).await.unwrap();
        for (k, v) in &model {
            assert_eq!(store.get(*k).await.unwrap().as_ref(), Some(v), "key {k}");
        }
        let all = store.scan(0, model.len() + 1).await.unwrap();
        assert_eq!(all.len(), model.len());
    });
    let s = stats(&d);
    assert!(n(&s, "retrains") > 0, "{s}");
    assert!(n(&s["memnode"], "empty_leaves_merged") > 0, "{s}");
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    // Small tables under torn reads are slow here (long synonym chains,
    // every piece of every torn read yields): fewer, smaller rounds there.
    for (knobs, memnodes, torn, rounds, keys_per_round) in [
        (Knobs::new(), 1, false, 12, 32),
        (small(), 1, false, 12, 32),
        (Knobs::new(), 2, true, 12, 32),
        (small(), 1, true, 4, 16),
    ] {
        let d = deploy_with(knobs, 3, memnodes);
        let cfg = InsertRaceConfig {
            torn_reads: torn,
            rounds,
            keys_per_round,
            ..Default::default()
        };
        let r = insert_race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn}: {e}"));
        assert_eq!(r.keys, (cfg.rounds * cfg.keys_per_round) as u64);
    }
}
