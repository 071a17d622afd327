#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! The shared suites (oracle, races with and without torn reads, bad input)
//! on small nodes so that splits, root growth and stale caches happen, and
//! the per-operation costs of the design.

use dmkv_api::Knobs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::make_value;
use dmkv_sherman::SPEC;
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs, check_knobs_refused};
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
            expected_keys: 2000,
            ..Default::default()
        },
    )
    .unwrap()
}

/// 256-byte nodes: 12 entries, so a few dozen keys make a 3-level tree.
const SMALL: &[(&str, &str)] = &[("node_bytes", "256"), ("chunk_kb", "16")];

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(ops in prop::collection::vec(op_strategy(120, 4096, true), 1..250)) {
        let d = deploy_with(1, 1, SMALL);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client_on_two_memory_nodes() {
    let d = deploy_with(2, 2, SMALL);
    check_multi(&d, 2, 3, 300, 21).unwrap();
}

/// The other way to take a lock and read (`lock_read=combined`, CAS and
/// READ in one batch) against the oracle, with torn reads among writers.
#[test]
fn oracle_and_race_with_the_lock_and_read_combined() {
    let knobs = [
        ("node_bytes", "256"),
        ("chunk_kb", "16"),
        ("lock_read", "combined"),
    ];
    let d = deploy_with(2, 2, &knobs);
    check_multi(&d, 2, 3, 300, 22).unwrap();
    let d = deploy_with(1, 2, &knobs);
    let r = race(
        &d,
        &RaceConfig {
            torn_reads: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.writes > 0 && r.reads > 0, "{r:?}");
}

#[test]
fn oracle_multi_client_without_cache() {
    let d = deploy_with(1, 2, &[("node_bytes", "256"), ("cache_mb", "0")]);
    check_multi(&d, 2, 2, 200, 5).unwrap();
}

#[test]
fn writers_race_readers_with_and_without_torn_reads() {
    for torn in [false, true] {
        for value_len in [8, 40] {
            let d = deploy_with(1, 2, SMALL);
            let r = race(
                &d,
                &RaceConfig {
                    torn_reads: torn,
                    value_len,
                    ..Default::default()
                },
            )
            .unwrap();
            assert!(r.writes > 0 && r.reads > 0 && r.scans > 0, "{r:?}");
        }
    }
}

/// Many keys, all writers inserting: splits propagate while readers read.
#[test]
fn race_while_the_tree_grows() {
    let d = deploy_with(2, 2, SMALL);
    let r = race(
        &d,
        &RaceConfig {
            keys: 600,
            loaded: 20,
            writes_per_writer: 400,
            reads_per_reader: 500,
            torn_reads: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.writes > 0, "{r:?}");
    let ep = d.endpoint(0);
    let stats = block_on(d.engine.stats(&ep)).unwrap();
    assert!(stats["splits"].as_u64().unwrap() > 10, "{stats}");
    assert!(stats["height"].as_u64().unwrap() >= 3, "{stats}");
}

#[test]
fn bad_input_is_refused() {
    let d = deploy_with(1, 1, SMALL);
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 200, 9).unwrap();
}

#[test]
fn bad_knobs_are_config_errors() {
    check_knobs_refused(
        &SPEC,
        &DeployOptions::default(),
        &[
            ("node_bytes", "100"),
            ("node_bytes", "2048"),
            ("chunk_kb", "1"),
            ("load_fill", "0"),
            ("load_fill", "101"),
            ("chunk_kb", "1000000"),
            ("pool_mb", "5000"),
            ("pool_max_mb", "99999999"),
            ("cache_mb", "99999999"),
            ("lock_read", "both"),
        ],
    )
    .unwrap();
}

/// A pool whose limit is too small for the data (1 MiB first segment, one
/// more of 1 MiB allowed): a clear error, and nothing acknowledged is lost.
#[test]
fn a_full_pool_says_so_and_keeps_what_it_acknowledged() {
    let d = deploy_with(
        1,
        1,
        &[
            ("node_bytes", "256"),
            ("chunk_kb", "16"),
            ("pool_mb", "1"),
            ("pool_max_mb", "2"),
        ],
    );
    let (_ep, store) = d.client(0).unwrap();
    let mut acked = Vec::new();
    let err = block_on(async {
        for k in 1..1_000_000u64 {
            let v = make_value(k, 1, 100);
            match store.insert(k, &v).await {
                Ok(true) => acked.push(k),
                Ok(false) => unreachable!("new key"),
                Err(e) => return e,
            }
        }
        unreachable!("a 2 MiB pool cannot hold a million values");
    });
    assert!(matches!(err, dmkv_api::KvError::Exhausted(_)), "{err}");
    assert!(acked.len() > 1000);
    let stats = block_on(d.engine.stats(&d.client(0).unwrap().0)).unwrap();
    assert!(stats["chunks_allocated"].as_u64().unwrap() > 64, "{stats}");
    block_on(async {
        for k in acked {
            assert_eq!(
                store.get(k).await.unwrap(),
                Some(make_value(k, 1, 100)),
                "key {k}"
            );
        }
    });
}

/// A first pool segment far too small (1 MiB for 60,000 100-byte values,
/// about 12 MiB): the pool grows by segments, clients on two processes find
/// the new segments, and every value stays readable; a bulk load into a
/// small pool grows it too.
#[test]
fn a_small_pool_grows_and_clients_find_its_segments() {
    let d = deploy_with(
        2,
        2,
        &[("node_bytes", "256"), ("chunk_kb", "16"), ("pool_mb", "1")],
    );
    let (ep, store) = d.client(0).unwrap();
    let pairs: Vec<_> = (0..20_000u64)
        .map(|i| (i * 3 + 1, make_value(i * 3 + 1, 0, 100)))
        .collect();
    block_on(labeled(OpKind::Load, d.engine.load(&ep, &pairs))).unwrap();
    // Another process, whose clients have seen no segment but the first.
    let other = {
        use dmkv_api::EngineSpec;
        use dmkv_transport::NodeHost;
        SPEC.connect(d.connect_args(d.cluster.add_node(0).id()))
            .unwrap()
    };
    let ep2 = std::rc::Rc::new(d.cluster.fabric().endpoint(other.home_node(0)).unwrap());
    let store2 = block_on(other.client(ep2, 0)).unwrap();
    block_on(async {
        for i in 0..20_000u64 {
            let k = i * 3 + 2;
            assert!(store.insert(k, &make_value(k, 1, 100)).await.unwrap());
            let k = i * 3;
            assert!(store2.insert(k, &make_value(k, 1, 100)).await.unwrap());
        }
        for i in 0..20_000u64 {
            let k = i * 3 + 1;
            assert_eq!(store2.get(k).await.unwrap(), Some(make_value(k, 0, 100)));
            let k = i * 3 + 2;
            assert_eq!(store2.get(k).await.unwrap(), Some(make_value(k, 1, 100)));
            let k = i * 3;
            assert_eq!(store.get(k).await.unwrap(), Some(make_value(k, 1, 100)));
        }
    });
    let used = d.node_stats().iter().map(|s| s.memory_used).sum::<u64>();
    assert!(
        used > 4 << 20,
        "the data outgrew the two first segments: {used}"
    );
}

/// Every tenth key from 1, 5,000 of them, with 8-byte values (inline):
/// a tree of height 3 with 1 KiB nodes (105 leaves, 3 level-1 nodes).
fn five_thousand_pairs() -> Vec<(u64, Vec<u8>)> {
    (0..5000u64)
        .map(|i| (i * 10 + 1, make_value(i * 10 + 1, 0, 8)))
        .collect()
}

/// Bulk load builds the tree bottom-up; then a cached GET costs one READ,
/// an update three round trips as in Sherman's released code (the lock's
/// CAS; the READ once it is taken; WRITE+unlock) or two with
/// `lock_read=combined` (CAS+READ in one batch, then WRITE+unlock), a scan
/// one READ per leaf; no operation uses the memory node's CPU.
#[test]
fn per_operation_costs() {
    for (lock_read, update_round_trips) in [("separate", 3000), ("combined", 2000)] {
        let d = deploy_with(1, 1, &[("lock_read", lock_read)]);
        let pairs = five_thousand_pairs();
        let (ep, store) = d.client(0).unwrap();
        block_on(labeled(OpKind::Load, d.engine.load(&ep, &pairs))).unwrap();
        block_on(async {
            for (k, _) in &pairs {
                store.get(*k).await.unwrap().unwrap();
            }
        });
        ep.reset_counters();
        block_on(async {
            for (k, v) in pairs.iter().take(1000) {
                assert_eq!(
                    labeled(OpKind::Get, store.get(*k)).await.unwrap().as_ref(),
                    Some(v)
                );
                assert!(
                    labeled(OpKind::Update, store.update(*k, &make_value(*k, 1, 8)))
                        .await
                        .unwrap()
                );
            }
            labeled(OpKind::Scan, store.scan(1, 100)).await.unwrap();
        });
        let c = ep.counters();
        let get = c.get(OpKind::Get);
        assert_eq!((get.round_trips, get.reads, get.rpcs), (1000, 1000, 0));
        let upd = c.get(OpKind::Update);
        assert_eq!(
            (upd.round_trips, upd.cas, upd.reads, upd.rpcs),
            (update_round_trips, 1000, 1000, 0),
            "lock_read={lock_read}"
        );
        let scan = c.get(OpKind::Scan);
        assert!(scan.round_trips >= 2 && scan.round_trips <= 4, "{scan:?}");
        assert_eq!(c.sum(&OpKind::WORKLOAD).memnode_cpu_ns, 0);
        let stats = block_on(d.engine.stats(&ep)).unwrap();
        // 5000 keys, 48 per leaf: 105 leaves, 3 level-1 nodes, a root.
        assert_eq!(stats["height"], 3, "{stats}");
        assert_eq!(stats["lock_read"], lock_read, "{stats}");
        // The cache holds the level-1 nodes only, as whole 1 KiB nodes.
        assert_eq!(
            (stats["cache_nodes"].as_u64(), stats["cache_bytes"].as_u64()),
            (Some(3), Some(3 * 1024)),
            "{stats}"
        );
        assert_eq!(d.engine.client_cache_bytes(), 3 * 1024);
    }
}

/// Without an index cache every lookup walks the tree from the root, as
/// Sherman's released code does on a miss (`Tree::search`: `p = root`,
/// the root's address known locally as `g_root_ptr`): one READ per level,
/// and no read of the root word once its address is known.
#[test]
fn a_lookup_without_the_cache_walks_from_the_root() {
    let d = deploy_with(1, 1, &[("cache_mb", "0")]);
    let pairs = five_thousand_pairs();
    let (ep, store) = d.client(0).unwrap();
    block_on(d.engine.load(&ep, &pairs)).unwrap();
    // The first lookup learns the root's address.
    assert!(block_on(store.get(pairs[0].0)).unwrap().is_some());
    ep.reset_counters();
    block_on(async {
        for (k, v) in pairs.iter().take(1000) {
            assert_eq!(
                labeled(OpKind::Get, store.get(*k)).await.unwrap().as_ref(),
                Some(v)
            );
        }
    });
    let c = ep.counters();
    let get = c.get(OpKind::Get);
    // Height 3: the root, a level-1 node, the leaf.
    assert_eq!(
        (get.round_trips, get.reads, get.bytes_read),
        (3000, 3000, 3000 * 1024)
    );
    let stats = block_on(d.engine.stats(&ep)).unwrap();
    assert_eq!(
        (stats["height"].as_u64(), stats["cache_nodes"].as_u64()),
        (Some(3), Some(0)),
        "{stats}"
    );
}

/// A writer whose node READ fails after its lock CAS succeeded clears the
/// lock word before it gives up (`read_holding_global`), in both
/// `lock_read` modes: with every node image after the superblock
/// overwritten (so no READ validates) and the leaf address cached, an
/// update takes the lock, fails with `Corrupt`, and leaves no lock word
/// set. Without the clearing, the lock word of that leaf stays held.
#[test]
fn a_failed_read_under_the_lock_leaves_no_lock_word_set() {
    for lock_read in ["separate", "combined"] {
        let d = deploy_with(1, 1, &[("lock_read", lock_read)]);
        let (ep, store) = d.client(0).unwrap();
        let pairs: Vec<_> = (0..500u64)
            .map(|i| (i * 7 + 3, make_value(i * 7 + 3, 0, 8)))
            .collect();
        block_on(d.engine.load(&ep, &pairs)).unwrap();
        // Warm the index cache: the update below goes straight to the leaf.
        assert!(block_on(store.get(pairs[100].0)).unwrap().is_some());
        let node = d.runtimes[0].id();
        let pool = block_on(ep.lookup_region(node, &d.args.name("pool"))).unwrap();
        let locks = block_on(ep.lookup_region(node, &d.args.name("locks"))).unwrap();
        let garbage = vec![0xA5u8; 64 << 10];
        let mut at = 4096;
        while at < pool.len {
            let n = (pool.len - at).min(garbage.len() as u64) as usize;
            block_on(ep.write(pool.at(at), &garbage[..n])).unwrap();
            at += n as u64;
        }
        let k = pairs[100].0;
        let err = block_on(store.update(k, &make_value(k, 1, 8))).unwrap_err();
        assert!(err.to_string().contains("validation"), "{lock_read}: {err}");
        let table = block_on(ep.read(locks.at(0), locks.len as usize)).unwrap();
        assert!(
            table.iter().all(|&b| b == 0),
            "lock_read={lock_read}: a lock word is still set after the failed update"
        );
    }
}

/// Invariants 3 and 5: a second compute process whose index cache predates
/// many splits still finds every key (moving right along sibling links) and
/// sees the new values.
#[test]
fn a_stale_index_cache_in_another_process_sees_new_values() {
    use dmkv_api::EngineSpec;
    use dmkv_transport::NodeHost;
    let d = deploy_with(1, 1, SMALL);
    let other = SPEC
        .connect(d.connect_args(d.cluster.add_node(0).id()))
        .unwrap();
    let ep_b = std::rc::Rc::new(d.cluster.fabric().endpoint(other.home_node(0)).unwrap());
    let b = block_on(other.client(ep_b, 0)).unwrap();
    let (_ep, a) = d.client(0).unwrap();
    let keys: Vec<u64> = (1..=200).map(|i| i * 1000).collect();
    block_on(async {
        for &k in &keys {
            assert!(a.insert(k, &make_value(k, 1, 8)).await.unwrap());
        }
        for &k in &keys {
            assert!(b.get(k).await.unwrap().is_some());
        }
        // Process A splits every leaf many times over.
        for &k in &keys {
            for j in 1..8 {
                assert!(a.insert(k + j, &make_value(k + j, 1, 8)).await.unwrap());
            }
            assert!(a.update(k, &make_value(k, 2, 24)).await.unwrap());
        }
        for &k in &keys {
            assert_eq!(
                b.get(k).await.unwrap(),
                Some(make_value(k, 2, 24)),
                "key {k}"
            );
            assert_eq!(b.get(k + 3).await.unwrap(), Some(make_value(k + 3, 1, 8)));
        }
        let all = b.scan(0, 10_000).await.unwrap();
        assert_eq!(all.len(), keys.len() * 8);
    });
    let s = block_on(other.stats(&d.endpoint(0))).unwrap();
    assert!(s["move_rights"].as_u64().unwrap() > 0, "{s}");
    // B's root hint named a root that A's inserts grew past: B read the
    // root word again where the old root did not cover a key.
    assert!(s["root_refreshes"].as_u64().unwrap() > 0, "{s}");
}

/// Invariant 2 under contention: two compute processes (separate local lock
/// tables), three tasks each, all writing keys of the same few leaves with
/// latency injected so that lock holders wait on the network. Local
/// handovers and global CAS retries both happen, and every key ends with its
/// owner's last value.
#[test]
fn hierarchical_locks_under_contention_from_two_processes() {
    use dmkv_api::{EngineSpec, KvStore};
    use dmkv_transport::NodeHost;
    use dmkv_transport::exec::{LocalTask, run_tasks};
    use dmkv_transport::local::Faults;
    use std::time::Duration;
    let d = deploy_with(1, 1, &[]);
    let other = SPEC
        .connect(d.connect_args(d.cluster.add_node(0).id()))
        .unwrap();
    d.cluster.set_faults(Faults {
        round_trip_latency: Duration::from_micros(50),
        ..Faults::default()
    });
    let engines = [d.engine.clone(), other];
    std::thread::scope(|s| {
        for (p, engine) in engines.iter().enumerate() {
            let d = &d;
            s.spawn(move || {
                let ep =
                    std::rc::Rc::new(d.cluster.fabric().endpoint(engine.home_node(0)).unwrap());
                let store = block_on(engine.client(ep, 0)).unwrap();
                let store: &dyn KvStore = &*store;
                let tasks: Vec<LocalTask<'_, ()>> = (0..3u64)
                    .map(|t| {
                        Box::pin(async move {
                            // 6 writers share 24 keys in one or two leaves.
                            let me = p as u64 * 3 + t;
                            for round in 1..=40u32 {
                                for j in 0..4u64 {
                                    let k = 100 + j * 6 + me;
                                    store.upsert(k, &make_value(k, round, 8)).await.unwrap();
                                }
                            }
                        }) as LocalTask<'_, ()>
                    })
                    .collect();
                run_tasks(tasks);
            });
        }
    });
    d.cluster.set_faults(Faults::default());
    let (ep, store) = d.client(0).unwrap();
    block_on(async {
        for k in 100..124u64 {
            assert_eq!(
                store.get(k).await.unwrap(),
                Some(make_value(k, 40, 8)),
                "key {k}"
            );
        }
    });
    let a = block_on(engines[0].stats(&ep)).unwrap();
    let b = block_on(engines[1].stats(&ep)).unwrap();
    let sum = |f: &str| a[f].as_u64().unwrap() + b[f].as_u64().unwrap();
    assert!(sum("lock_handovers") > 0, "{a} {b}");
    assert!(sum("lock_retries") > 0, "{a} {b}");
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for (torn, memnodes, knobs) in [
        (false, 1, &[][..]),
        (false, 1, SMALL),
        (true, 1, SMALL),
        (true, 2, SMALL),
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
