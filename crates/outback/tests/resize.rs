#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Resizing while requests continue (paper §4.4): inserts racing splits,
//! GETs of acknowledged keys never missing during rebuilds, bulk loads that
//! force full builds, and concurrent inserts into one bucket.

mod common;

use dmkv_api::KvError;
use dmkv_api::payload::{check_value, make_value};
use dmkv_testkit::oracle::spread_key;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};

fn stats(d: &dmkv_api::deploy::LocalDeployment) -> serde_json::Value {
    let ep = d.endpoint(0);
    block_on(d.engine.stats(&ep)).unwrap()
}

/// The stats once no shard is resizing: writes are answered while a
/// resize runs (invariant 17), so the last acknowledged insert can leave
/// a resize in progress whose counters are not final yet. Bounded: a
/// shard that stays busy for 30 s fails the test.
fn settled_stats(d: &dmkv_api::deploy::LocalDeployment) -> serde_json::Value {
    let deadline = dmkv_transport::time::Instant::now() + std::time::Duration::from_secs(30);
    loop {
        let st = stats(d);
        let busy = st["per_shard"]
            .as_array()
            .is_some_and(|a| a.iter().any(|s| s["busy"].as_bool() == Some(true)));
        if !busy {
            return st;
        }
        assert!(
            dmkv_transport::time::Instant::now() < deadline,
            "a shard is still resizing after 30 s: {st}"
        );
        dmkv_transport::time::sleep_blocking(std::time::Duration::from_millis(5));
    }
}

/// Writers insert fresh keys while readers GET keys already acknowledged:
/// a GET of an acknowledged key must find its value, through every split.
fn inserts_racing_resizes(memnodes: usize) {
    let d = common::deploy_with(common::small_tables(), memnodes, 2);
    let acked: Mutex<Vec<u64>> = Mutex::new(Vec::new());
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let next = AtomicU64::new(0);
    const KEYS: u64 = 1500;
    std::thread::scope(|s| {
        for t in 0..2 {
            let (d, acked, errors, next) = (&d, &acked, &errors, &next);
            s.spawn(move || {
                let (_ep, store) = d.client(t).unwrap();
                let store = &*store;
                let mut tasks: Vec<LocalTask<'_, ()>> = Vec::new();
                for _ in 0..3 {
                    tasks.push(Box::pin(async move {
                        loop {
                            let i = next.fetch_add(1, Ordering::Relaxed);
                            if i >= KEYS {
                                return;
                            }
                            let k = spread_key(i);
                            match store.insert(k, &make_value(k, 1, 8)).await {
                                Ok(true) => acked.lock().push(k),
                                other => errors.lock().push(format!("insert {k:#x}: {other:?}")),
                            }
                        }
                    }));
                }
                for r in 0..2u64 {
                    tasks.push(Box::pin(async move {
                        let mut x = r + 1;
                        while next.load(Ordering::Relaxed) < KEYS {
                            let k = {
                                let a = acked.lock();
                                if a.is_empty() {
                                    None
                                } else {
                                    x = dmkv_outback::hash::mix64(x);
                                    Some(a[(x % a.len() as u64) as usize])
                                }
                            };
                            let Some(k) = k else {
                                dmkv_transport::exec::yield_now().await;
                                continue;
                            };
                            match store.get(k).await {
                                Ok(Some(v)) if check_value(k, &v) == Ok(1) => {}
                                other => errors
                                    .lock()
                                    .push(format!("get of acknowledged {k:#x}: {other:?}")),
                            }
                        }
                    }));
                }
                run_tasks(tasks);
            });
        }
    });
    let errors = errors.into_inner();
    assert!(
        errors.is_empty(),
        "{} errors, first: {}",
        errors.len(),
        errors[0]
    );
    let (_ep, store) = d.client(0).unwrap();
    block_on(async {
        for i in 0..KEYS {
            let k = spread_key(i);
            assert_eq!(
                store.get(k).await.unwrap().map(|v| check_value(k, &v)),
                Some(Ok(1)),
                "key {k:#x} after the run"
            );
        }
    });
    let st = settled_stats(&d);
    assert!(st["resizes"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(st["keys"].as_u64().unwrap(), KEYS, "{st}");
    println!(
        "memnodes {memnodes}: resizes {}, buffered {}, stale {}, makeups {}",
        st["resizes"],
        st["per_shard"]
            .as_array()
            .unwrap()
            .iter()
            .map(|s| s["buffered_writes"].as_u64().unwrap())
            .sum::<u64>(),
        st["stale_retries"],
        st["makeup_gets"]
    );
}

#[test]
fn inserts_race_resizes_on_one_shard() {
    inserts_racing_resizes(1);
}

#[test]
fn inserts_race_resizes_on_three_shards() {
    inserts_racing_resizes(3);
}

#[test]
fn concurrent_inserts_into_one_bucket() {
    // One bucket, no splits: four slots and an overflow cache of eight.
    let mut k = common::small_tables();
    k.set("initial_buckets", "1");
    k.set("max_global_depth", "0");
    let d = common::deploy_with(k, 1, 2);
    let keys: Vec<u64> = (0..12).map(spread_key).collect();
    std::thread::scope(|s| {
        for t in 0..2usize {
            let (d, keys) = (&d, &keys);
            s.spawn(move || {
                let (_ep, store) = d.client(t).unwrap();
                let store = &*store;
                let tasks: Vec<LocalTask<'_, ()>> = (0..3usize)
                    .map(|j| {
                        Box::pin(async move {
                            for (i, &k) in keys.iter().enumerate() {
                                if i % 6 == t * 3 + j {
                                    assert!(store.insert(k, &make_value(k, 1, 8)).await.unwrap());
                                }
                                // Everybody reads everybody's keys meanwhile.
                                let got = store.get(keys[(i * 5) % keys.len()]).await.unwrap();
                                if let Some(v) = got {
                                    check_value(keys[(i * 5) % keys.len()], &v).unwrap();
                                }
                            }
                        }) as LocalTask<'_, ()>
                    })
                    .collect();
                run_tasks(tasks);
            });
        }
    });
    let (_ep, store) = d.client(0).unwrap();
    block_on(async {
        for &k in &keys {
            assert_eq!(
                store.get(k).await.unwrap().map(|v| check_value(k, &v)),
                Some(Ok(1))
            );
        }
        // The bucket and its overflow cache are full and cannot split.
        let more = store
            .insert(spread_key(99), &make_value(spread_key(99), 1, 8))
            .await;
        assert!(matches!(more, Err(KvError::Exhausted(_))), "{more:?}");
        // Deleting makes room again (an overflow key moves into the slot).
        assert!(store.delete(keys[0]).await.unwrap());
        assert!(
            store
                .insert(spread_key(99), &make_value(spread_key(99), 1, 8))
                .await
                .unwrap()
        );
        for &k in &keys[1..] {
            assert!(store.get(k).await.unwrap().is_some(), "{k:#x}");
        }
    });
    let st = stats(&d);
    assert_eq!(st["overflow_keys"].as_u64().unwrap(), 8, "{st}");
    assert!(st["makeup_gets"].as_u64().unwrap() > 0, "{st}");
    // Whether a reseed happens depends on how the concurrent inserts
    // interleave (a fresh clone's CI run saw none), so it is not asserted:
    // what matters above is that every key is kept and a full bucket says so.
}

#[test]
fn bulk_loads_build_then_inserts_split_and_nothing_is_lost() {
    let mut knobs = common::small_tables();
    // 4000 loaded keys: a full build makes four tables of about 1000.
    knobs.set("table_keys", "1000");
    let d = common::deploy_with(knobs, 1, 1);
    let ep = d.endpoint(0);
    // Two load calls with disjoint chunks, as the harness may do.
    let mut model: HashMap<u64, Vec<u8>> = HashMap::new();
    for chunk in 0..2u64 {
        let pairs: Vec<(u64, Vec<u8>)> = (chunk * 2000..(chunk + 1) * 2000)
            .map(|i| {
                (
                    spread_key(i),
                    make_value(spread_key(i), 0, 8 + (i % 40) as usize),
                )
            })
            .collect();
        model.extend(pairs.iter().cloned());
        block_on(d.engine.load(&ep, &pairs)).unwrap();
    }
    // Both loads are indexed by one full build, at first use.
    let st = stats(&d);
    assert_eq!(st["full_builds"].as_u64().unwrap(), 1, "{st}");
    let shard = &st["per_shard"][0];
    assert_eq!(
        (shard["tables"].as_u64(), shard["global_depth"].as_u64()),
        (Some(4), Some(2)),
        "{st}"
    );
    let lf = st["load_factor"].as_f64().unwrap();
    assert!(
        (0.85..=0.951).contains(&lf),
        "load factor {lf} after a build at 0.95"
    );
    let (_ep, store) = d.client(0).unwrap();
    block_on(async {
        for i in 4000..7000u64 {
            let k = spread_key(i);
            let v = make_value(k, 2, 8);
            assert!(store.insert(k, &v).await.unwrap());
            model.insert(k, v);
        }
        for (k, v) in &model {
            assert_eq!(store.get(*k).await.unwrap().as_ref(), Some(v), "{k:#x}");
        }
    });
    let st = settled_stats(&d);
    assert!(st["resizes"].as_u64().unwrap() > 0, "{st}");
    assert_eq!(st["keys"].as_u64().unwrap(), model.len() as u64);
}

#[test]
fn growth_keeps_the_compute_node_index_small() {
    // Default thresholds and load factors; tables of about 2000 keys so
    // that tripling 4000 keys takes both kinds of resize.
    let mut knobs = dmkv_api::Knobs::new();
    knobs.set("table_keys", "2000");
    knobs.set("countdown_timeout_ms", "200");
    // One shard: one ring point (64 points would add 2 bits per key at
    // 4000 keys, a fixed cost that vanishes at the bench's scale).
    knobs.set("vnodes", "1");
    let d = common::deploy_with(knobs, 1, 1);
    let ep = d.endpoint(0);
    let pairs: Vec<(u64, Vec<u8>)> = (0..4000u64)
        .map(|i| (spread_key(i), make_value(spread_key(i), 0, 8)))
        .collect();
    block_on(d.engine.load(&ep, &pairs)).unwrap();
    let st = stats(&d);
    let built = st["client_bits_per_key"].as_f64().unwrap();
    assert!(built < 4.7, "{built} bits per key after a build at 0.95");
    let (_ep, store) = d.client(0).unwrap();
    block_on(async {
        for i in 4000..12_000u64 {
            let k = spread_key(i);
            assert!(store.insert(k, &make_value(k, 1, 8)).await.unwrap());
        }
        for i in (0..12_000u64).step_by(7) {
            let k = spread_key(i);
            assert!(store.get(k).await.unwrap().is_some(), "{k:#x}");
        }
    });
    let st = settled_stats(&d);
    assert_eq!(st["keys"].as_u64(), Some(12_000), "{st}");
    let (splits, grows) = (
        st["resize_splits"].as_u64().unwrap(),
        st["resize_grows"].as_u64().unwrap(),
    );
    assert!(splits > 0 && grows > 0, "{st}");
    assert_eq!(st["resizes"].as_u64(), Some(splits + grows));
    // Every resize was triggered and started for a counted reason.
    let t = &st["resize_triggers"];
    let s = &st["resize_starts"];
    let n = |v: &serde_json::Value, k: &str| v[k].as_u64().unwrap();
    assert_eq!(
        n(s, "all_told") + n(s, "pre_resize_timeout") + n(s, "stop_fill"),
        splits + grows,
        "{st}"
    );
    assert!(n(t, "slow_fill") + n(t, "slow_load") + n(t, "stop_fill") >= splits + grows);
    // Resized tables are built for their keys within growth_bits_per_key
    // (5.2), so the compute node's share stays near the paper's ~5 bits
    // per key after every resize (keeping the old table for the half of
    // its keys that stay gave 6.3-7.1 at load factors 0.45-0.52).
    let worst = st["client_bits_per_key_after_resize_max"].as_f64().unwrap();
    assert!(worst > 0.0 && worst <= 5.5, "{worst} bits per key: {st}");
    let lf = st["load_factor"].as_f64().unwrap();
    assert!(lf >= 0.6, "load factor {lf} after growth: {st}");
}
