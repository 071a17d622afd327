//! Repeated bulk loads reuse the leaves they kill (docs/rolex.md,
//! invariant 14): loading in many calls fits a leaf region that only the
//! live leaves plus one rewrite fit, and readers whose caches still name a
//! reused leaf, during and after the loads, never get a wrong answer.

mod common;

use common::{deploy_with, knobs};
use dmkv_api::deploy::LocalDeployment;
use dmkv_testkit::oracle::check_contents;
use dmkv_transport::exec::block_on;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// The value every load gives `k`: 8 bytes inline for most keys, 20 bytes
/// out of line for every fifth (a reborn leaf keeps stored value pointers).
fn value_of(k: u64) -> Vec<u8> {
    let w = k.wrapping_mul(0x9E37_79B9_7F4A_7C15).to_le_bytes();
    if k.is_multiple_of(5) {
        w.iter().chain(&w).chain(&w[..4]).copied().collect()
    } else {
        w.to_vec()
    }
}

fn engine_stats(d: &LocalDeployment) -> serde_json::Value {
    block_on(d.engine.stats(&d.endpoint(0))).unwrap()
}

fn figure(s: &serde_json::Value, name: &str) -> u64 {
    s[name]
        .as_u64()
        .or_else(|| s["memnode"][name].as_u64())
        .unwrap_or_else(|| panic!("no figure {name} in {s}"))
}

/// Sequential keys loaded in 40 ascending calls: each call rewrites the
/// last model, which holds the whole store (one PLR segment), so without
/// reuse the calls need ~10,250 leaves (sum over calls of the keys stored
/// by then over 8 per leaf) against 1,500 per node here. A client whose
/// cache dates from the first call reads after every call and names
/// leaves that died and were reborn meanwhile.
#[test]
fn chunked_loads_fit_a_region_sized_for_the_live_leaves() {
    for memnodes in [1, 2] {
        let d = deploy_with(
            knobs(&[("leaf_slots", "8"), ("slt_slots", "32"), ("leaves", "1500")]),
            1,
            memnodes,
        );
        let ep = d.endpoint(0);
        let keys: Vec<u64> = (0..4000u64).map(|i| 1000 + 7 * i).collect();
        let (_sep, stale) = d.client(0).unwrap();
        let mut model = BTreeMap::new();
        for (c, chunk) in keys.chunks(100).enumerate() {
            let pairs: Vec<(u64, Vec<u8>)> = chunk.iter().map(|&k| (k, value_of(k))).collect();
            block_on(d.engine.load(&ep, &pairs))
                .unwrap_or_else(|e| panic!("load {c} on {memnodes} node(s): {e}"));
            model.extend(pairs);
            block_on(async {
                // Every loaded key so far (step 13 over them), and keys
                // between them and past the end, which are absent.
                for &k in model.keys().step_by(13) {
                    assert_eq!(
                        stale.get(k).await.unwrap(),
                        Some(value_of(k)),
                        "key {k} after load {c}"
                    );
                    assert_eq!(
                        stale.get(k + 1).await.unwrap(),
                        None,
                        "key {} after load {c}",
                        k + 1
                    );
                }
                let last = *model.keys().next_back().unwrap();
                assert_eq!(stale.get(last + 7).await.unwrap(), None);
                let from = keys[c * 50];
                let got = stale.scan(from, 60).await.unwrap();
                let want: Vec<(u64, Vec<u8>)> = model
                    .range(from..)
                    .take(60)
                    .map(|(k, v)| (*k, v.clone()))
                    .collect();
                assert_eq!(got, want, "scan from {from} after load {c}");
            });
        }
        let caps = d.engine.capabilities();
        block_on(check_contents(&*stale, &model, &caps)).unwrap();
        let s = engine_stats(&d);
        assert!(figure(&s, "leaves_reused") > 1000, "{s}");
        assert!(
            figure(&s, "leaves_allocated") <= 1500 * memnodes as u64,
            "{s}"
        );
        assert_eq!(
            figure(&s, "leaves_freed"),
            figure(&s, "leaves_reused") + figure(&s, "leaves_free"),
            "{s}"
        );
    }
}

/// Loads whose keys spread over the whole key range (each call rewrites
/// every model, on two memory nodes) while two reader threads get random
/// keys: a key found has its one value, a key whose load ended before the
/// get began is found, and a key a reader found it finds again. Readers keep their caches across loads, so they
/// name dead and reborn leaves throughout.
#[test]
fn readers_during_loads_that_reuse_leaves_are_never_wrong() {
    let d = deploy_with(
        knobs(&[("leaf_slots", "8"), ("slt_slots", "32"), ("leaves", "2500")]),
        3,
        2,
    );
    let calls = 16u64;
    let universe = 3200u64;
    let key = |i: u64| 5_000 + 11 * i;
    // Call c loads the keys i with i % calls == c.
    let loaded_calls = AtomicUsize::new(0);
    let done = AtomicBool::new(false);
    let checked = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for t in 1..3 {
            let (d, loaded_calls, done, checked) = (&d, &loaded_calls, &done, &checked);
            s.spawn(move || {
                let (_ep, store) = d.client(t).unwrap();
                let mut x = 0x2545_F491_4F6C_DD1Du64 ^ t as u64;
                let mut seen = std::collections::HashSet::new();
                block_on(async {
                    while !done.load(Ordering::Acquire) {
                        x ^= x << 13;
                        x ^= x >> 7;
                        x ^= x << 17;
                        let i = x % universe;
                        let k = key(i);
                        let before = loaded_calls.load(Ordering::Acquire) as u64;
                        match store.get(k).await.unwrap() {
                            Some(v) => {
                                assert_eq!(v, value_of(k), "key {k}");
                                seen.insert(k);
                            }
                            None => {
                                assert!(
                                    i % calls >= before,
                                    "key {k} (load {}) missing though {before} loads ended",
                                    i % calls
                                );
                                // Nothing deletes: once this thread saw a
                                // key, a later get that misses it would
                                // not be linearizable.
                                assert!(!seen.contains(&k), "key {k} seen, then missing");
                            }
                        }
                        checked.fetch_add(1, Ordering::Relaxed);
                    }
                });
            });
        }
        // Stops the readers however the loads end (a failed load panics
        // here, and the scope would otherwise wait for them for good).
        struct StopReaders<'a>(&'a AtomicBool);
        impl Drop for StopReaders<'_> {
            fn drop(&mut self) {
                self.0.store(true, Ordering::Release);
            }
        }
        let _stop = StopReaders(&done);
        let ep = d.endpoint(0);
        for c in 0..calls {
            let pairs: Vec<(u64, Vec<u8>)> = (0..universe)
                .filter(|i| i % calls == c)
                .map(|i| (key(i), value_of(key(i))))
                .collect();
            block_on(d.engine.load(&ep, &pairs)).unwrap();
            loaded_calls.store(c as usize + 1, Ordering::Release);
        }
        // Let the readers see the final store too.
        let seen = checked.load(Ordering::Relaxed);
        while checked.load(Ordering::Relaxed) < seen + 2000 {
            std::thread::yield_now();
        }
    });
    let s = engine_stats(&d);
    assert!(figure(&s, "leaves_reused") > 0, "{s}");
    let model: BTreeMap<u64, Vec<u8>> = (0..universe).map(|i| (key(i), value_of(key(i)))).collect();
    let (_ep, store) = d.client(0).unwrap();
    block_on(check_contents(&*store, &model, &d.engine.capabilities())).unwrap();
}
