#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! The shared suites (oracle, races with and without torn reads, bad input)
//! on tiny subtables so that resizing happens under load, concurrent inserts
//! of one key, a full pool, and the per-operation costs.

use dmkv_api::Knobs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::{check_value, make_value};
use dmkv_race::SPEC;
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs, check_knobs_refused};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_testkit::oracle::{check_multi, check_single, op_strategy};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
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

/// Two bucket groups (42 slots) per subtable, one subtable at start: a few
/// dozen keys force several splits and directory doublings.
const TINY: &[(&str, &str)] = &[("groups", "2"), ("initial_depth", "0"), ("chunk_kb", "16")];

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(ops in prop::collection::vec(op_strategy(150, 4096, false), 1..250)) {
        let d = deploy_with(1, 1, TINY);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client_on_two_memory_nodes() {
    let d = deploy_with(2, 2, TINY);
    check_multi(&d, 2, 3, 300, 31).unwrap();
}

#[test]
fn writers_race_readers_with_and_without_torn_reads() {
    for torn in [false, true] {
        for value_len in [8, 100] {
            let d = deploy_with(1, 2, &[("groups", "4"), ("initial_depth", "1")]);
            let r = race(
                &d,
                &RaceConfig {
                    torn_reads: torn,
                    scans: false,
                    value_len,
                    ..Default::default()
                },
            )
            .unwrap();
            assert!(r.writes > 0 && r.reads > 0, "{r:?}");
        }
    }
}

/// Readers race writers while the table keeps splitting.
#[test]
fn race_while_the_table_resizes() {
    let d = deploy_with(2, 2, TINY);
    let r = race(
        &d,
        &RaceConfig {
            keys: 500,
            loaded: 10,
            writes_per_writer: 400,
            reads_per_reader: 500,
            scans: false,
            torn_reads: true,
            ..Default::default()
        },
    )
    .unwrap();
    assert!(r.writes > 0, "{r:?}");
    let ep = d.endpoint(0);
    let stats = block_on(d.engine.stats(&ep)).unwrap();
    assert!(stats["resizes"].as_u64().unwrap() >= 4, "{stats}");
    assert!(stats["global_depth"].as_u64().unwrap() >= 2, "{stats}");
}

/// Invariant 3: of concurrent inserts of one key exactly one succeeds, and
/// the key then holds its value.
#[test]
fn concurrent_inserts_of_one_key_have_one_winner() {
    let d = deploy_with(
        1,
        2,
        &[("groups", "2"), ("initial_depth", "0"), ("chunk_kb", "16")],
    );
    for round in 0..30u64 {
        let key = 1000 + round;
        let wins: Vec<Vec<(u32, bool)>> = std::thread::scope(|s| {
            let hs: Vec<_> = (0..2u32)
                .map(|t| {
                    let d = &d;
                    s.spawn(move || {
                        let (_ep, store) = d.client(t as usize).unwrap();
                        let store = &*store;
                        let tasks: Vec<LocalTask<'_, (u32, bool)>> = (0..3u32)
                            .map(|i| {
                                let who = t * 10 + i + 1;
                                Box::pin(async move {
                                    let v = make_value(key, who, 8);
                                    (who, store.insert(key, &v).await.unwrap())
                                }) as LocalTask<'_, _>
                            })
                            .collect();
                        run_tasks(tasks)
                    })
                })
                .collect();
            hs.into_iter().map(|h| h.join().unwrap()).collect()
        });
        let winners: Vec<u32> = wins.iter().flatten().filter(|w| w.1).map(|w| w.0).collect();
        assert_eq!(winners.len(), 1, "round {round}: {wins:?}");
        let (_ep, store) = d.client(0).unwrap();
        let v = block_on(store.get(key)).unwrap().unwrap();
        assert_eq!(check_value(key, &v), Ok(winners[0]));
    }
}

#[test]
fn bad_input_is_refused() {
    let d = deploy_with(1, 1, TINY);
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 200, 13).unwrap();
}

#[test]
fn bad_knobs_are_config_errors() {
    check_knobs_refused(
        &SPEC,
        &DeployOptions::default(),
        &[
            ("groups", "0"),
            ("initial_depth", "99"),
            ("initial_depth", "x"),
            ("chunk_kb", "1"),
            ("chunk_kb", "1000000"),
            ("pool_mb", "5000"),
            ("pool_max_mb", "999999999"),
        ],
    )
    .unwrap();
}

/// A pool whose limit is too small (1 MiB first segment, 1 MiB more
/// allowed): a clear error, and nothing acknowledged is lost.
#[test]
fn a_full_pool_says_so_and_keeps_what_it_acknowledged() {
    let d = deploy_with(
        1,
        1,
        &[
            ("groups", "2"),
            ("initial_depth", "0"),
            ("chunk_kb", "16"),
            ("pool_mb", "1"),
            ("pool_max_mb", "2"),
        ],
    );
    let (_ep, store) = d.client(0).unwrap();
    let mut acked = Vec::new();
    let err = block_on(async {
        for k in 1..1_000_000u64 {
            match store.insert(k, &make_value(k, 1, 100)).await {
                Ok(true) => acked.push(k),
                Ok(false) => unreachable!("new key"),
                Err(e) => return e,
            }
        }
        unreachable!("a 2 MiB pool cannot hold a million values");
    });
    assert!(matches!(err, dmkv_api::KvError::Exhausted(_)), "{err}");
    assert!(acked.len() > 500, "{}", acked.len());
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

/// A first pool segment far too small (1 MiB for 30,000 100-byte values and
/// the subtables of many resizes): the pool grows by segments, a second
/// compute process finds them (KV blocks and subtables written by the
/// first), and every value reads back.
#[test]
fn a_small_pool_grows_and_clients_find_its_segments() {
    use dmkv_api::EngineSpec;
    use dmkv_transport::NodeHost;
    let d = deploy_with(
        2,
        1,
        &[
            ("groups", "2"),
            ("initial_depth", "0"),
            ("chunk_kb", "16"),
            ("pool_mb", "1"),
        ],
    );
    let (_ep, a) = d.client(0).unwrap();
    let other = SPEC
        .connect(d.connect_args(d.cluster.add_node(0).id()))
        .unwrap();
    let ep_b = std::rc::Rc::new(d.cluster.fabric().endpoint(other.home_node(0)).unwrap());
    let b = block_on(other.client(ep_b, 0)).unwrap();
    block_on(async {
        for k in 1..=30_000u64 {
            let store = if k % 2 == 0 { &a } else { &b };
            assert!(store.insert(k, &make_value(k, 1, 100)).await.unwrap());
        }
        for k in 1..=30_000u64 {
            let store = if k % 2 == 0 { &b } else { &a };
            assert_eq!(
                store.get(k).await.unwrap(),
                Some(make_value(k, 1, 100)),
                "key {k}"
            );
        }
    });
    let used = d.node_stats().iter().map(|s| s.memory_used).sum::<u64>();
    assert!(
        used > 4 << 20,
        "the data outgrew the two first segments: {used}"
    );
}

/// RACE's costs: GET two round trips (buckets, then KV), update three
/// (KV write + buckets, KV, CAS), no memory-node CPU.
#[test]
fn per_operation_costs() {
    let d = deploy_with(1, 1, &[]);
    let pairs: Vec<_> = (1..=2000u64).map(|k| (k, make_value(k, 0, 8))).collect();
    let (ep, store) = d.client(0).unwrap();
    block_on(labeled(OpKind::Load, d.engine.load(&ep, &pairs))).unwrap();
    // The client's first write fetches its KV chunk (one RPC, then none).
    assert!(block_on(store.insert(5000, &make_value(5000, 0, 8))).unwrap());
    ep.reset_counters();
    block_on(async {
        for (k, v) in pairs.iter().take(500) {
            assert_eq!(
                labeled(OpKind::Get, store.get(*k)).await.unwrap().as_ref(),
                Some(v)
            );
            assert!(
                labeled(OpKind::Update, store.update(*k, &make_value(*k, 1, 8)))
                    .await
                    .unwrap()
            );
            assert!(
                labeled(OpKind::Insert, store.insert(10_000 + *k, v))
                    .await
                    .unwrap()
            );
        }
    });
    let c = ep.counters();
    let get = c.get(OpKind::Get);
    assert_eq!((get.round_trips, get.rpcs), (1000, 0), "{get:?}");
    let upd = c.get(OpKind::Update);
    assert_eq!(
        (upd.round_trips, upd.cas, upd.rpcs),
        (1500, 500, 0),
        "{upd:?}"
    );
    let ins = c.get(OpKind::Insert);
    // Buckets (+KV write), claim CAS, re-read, final CAS; plus KV reads
    // when fingerprints collide.
    assert!(ins.round_trips >= 2000 && ins.round_trips < 2500, "{ins:?}");
    assert_eq!(ins.cas, 1000, "{ins:?}");
    assert_eq!(c.sum(&OpKind::WORKLOAD).memnode_cpu_ns, 0);
    let stats = block_on(d.engine.stats(&ep)).unwrap();
    assert_eq!(stats["keys"], 2501, "{stats}");
    assert_eq!(stats["round_trips_per_op"]["get"], 2.0, "{stats}");
}

/// Invariant 5: a second compute process with its own directory cache keeps
/// reading after the first splits every subtable it knew; it must notice
/// (frozen slots of retired subtables) and return the new values.
#[test]
fn a_stale_directory_cache_in_another_process_sees_new_values() {
    use dmkv_api::EngineSpec;
    use dmkv_transport::NodeHost;
    let d = deploy_with(1, 1, TINY);
    let other = SPEC
        .connect(d.connect_args(d.cluster.add_node(0).id()))
        .unwrap();
    let ep_b = std::rc::Rc::new(d.cluster.fabric().endpoint(other.home_node(0)).unwrap());
    let b = block_on(other.client(ep_b.clone(), 0)).unwrap();
    let (ep_a, a) = d.client(0).unwrap();
    let keys: Vec<u64> = (1..=20).collect();
    block_on(async {
        for &k in &keys {
            assert!(a.insert(k, &make_value(k, 1, 8)).await.unwrap());
        }
        for &k in &keys {
            assert_eq!(check_value(k, &b.get(k).await.unwrap().unwrap()), Ok(1));
        }
        // Process A splits the table many times and rewrites every key.
        for k in 100..400u64 {
            assert!(a.insert(k, &make_value(k, 1, 8)).await.unwrap());
        }
        // New values of another size class, so that no old block is reused
        // and B's stale copies stay intact: only the frozen slots (and a
        // directory re-read) can tell B that its copy is stale.
        for &k in &keys {
            assert!(a.update(k, &make_value(k, 2, 100)).await.unwrap());
        }
        assert!(a.delete(keys[0]).await.unwrap());
        for &k in keys[1..].iter().rev() {
            assert_eq!(
                check_value(k, &b.get(k).await.unwrap().unwrap()),
                Ok(2),
                "key {k}"
            );
        }
        assert_eq!(b.get(keys[0]).await.unwrap(), None);
    });
    let stats = block_on(d.engine.stats(&ep_a)).unwrap();
    assert!(stats["resizes"].as_u64().unwrap() >= 4, "{stats}");
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for (torn, memnodes, knobs) in [
        (false, 1, &[][..]),
        (false, 1, TINY),
        (true, 1, TINY),
        (true, 2, TINY),
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

/// A split that fails after freezing its subtable S, because a memory node
/// holding some of S's KV blocks crashed, thaws S before it releases the
/// resize lock (invariant 10, docs/race.md). Three memory nodes: after a
/// few hundred inserts the subtables on node 0 hold slots whose blocks
/// live on node 2 (copied there by earlier splits); node 2 crashes; more
/// inserts then split subtables of node 0, whose new halves go to nodes 0
/// and 1 (alive) but whose blocks on node 2 cannot be read. Afterwards
/// every operation either succeeds with the right answer or fails with
/// the crashed node's `NodeDown`. Before the thaw, such a split left S
/// frozen for good, and every later write of one of its keys waited a
/// million retries, then failed with "never settled" (a DST seed with
/// `race.groups=4`: 4.3 s of virtual time per operation).
#[test]
fn a_split_failing_after_its_freeze_thaws_the_subtable() {
    let d = deploy_with(3, 1, TINY);
    let (_ep, store) = d.client(0).unwrap();
    let loaded: Vec<u64> = (1..=600).collect();
    block_on(async {
        for &k in &loaded {
            assert!(store.insert(k, &make_value(k, 1, 8)).await.unwrap());
        }
    });
    d.cluster.crash(d.runtimes[2].id());
    let down = |e: &dmkv_api::KvError| e.to_string().contains("is down");
    block_on(async {
        let mut inserted = 0;
        for k in 10_000..12_000u64 {
            match store.insert(k, &make_value(k, 1, 8)).await {
                Ok(true) => inserted += 1,
                Ok(false) => panic!("key {k} was not there"),
                Err(e) => assert!(down(&e), "insert of {k}: {e}"),
            }
        }
        assert!(inserted > 100, "only {inserted} inserts succeeded");
        let mut updated = 0;
        for &k in &loaded {
            match store.update(k, &make_value(k, 2, 8)).await {
                Ok(true) => updated += 1,
                Ok(false) => panic!("key {k} vanished"),
                Err(e) => assert!(down(&e), "update of {k}: {e}"),
            }
            match store.get(k).await {
                Ok(Some(v)) => assert_eq!(check_value(k, &v), Ok(2), "key {k}"),
                Ok(None) => panic!("key {k} vanished"),
                Err(e) => assert!(down(&e), "get of {k}: {e}"),
            }
        }
        assert!(updated > 200, "only {updated} of 600 updates succeeded");
    });
}
