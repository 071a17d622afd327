#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Races: writers (inserts that split small leaves, deletes, updates)
//! against one-sided readers, with and without torn reads, while the
//! memory node retrains; bad input; kill-and-recover with the log.

use dmkv_api::ConnectArgs;
use dmkv_api::KvStore;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::{check_value, make_value};
use dmkv_api::{EngineSpec, Knobs, ServeArgs};
use dmkv_memnode::NodeRuntime;
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_testkit::oracle::spread_key;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::local::{Faults, LocalCluster, LocalConfig};
use dmkv_transport::{Endpoint, NodeHost, NodeId};
use dmkv_xstore::SPEC;
use dmkv_xstore::server::Server;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

fn deploy(knobs: &[(&str, &str)], memnodes: usize, torn: bool) -> LocalDeployment {
    let mut k = Knobs::new();
    for (n, v) in knobs {
        k.set(n, v);
    }
    LocalDeployment::deploy(
        &SPEC,
        &DeployOptions {
            memnodes,
            knobs: k,
            expected_keys: 4000,
            handler_threads: 2,
            local: LocalConfig {
                faults: Faults {
                    torn_reads: torn,
                    ..Faults::default()
                },
                ..LocalConfig::default()
            },
            ..DeployOptions::default()
        },
    )
    .unwrap()
}

#[test]
fn races_with_splits_and_retraining() {
    // The race's keys are spread_key(0..200): split them over three
    // memory nodes, so that scans cross partitions.
    let bounds = format!("{},{}", spread_key(70), spread_key(140));
    for (torn, mode) in [
        (false, "full"),
        (true, "full"),
        (true, "models-only"),
        (true, "top-only"),
    ] {
        let d = deploy(
            &[
                ("slots", "4"),
                ("keys_per_model", "8"),
                ("cache", mode),
                ("bounds", &bounds),
            ],
            3,
            torn,
        );
        let cfg = RaceConfig {
            keys: 200,
            loaded: 60,
            torn_reads: torn,
            writes_per_writer: 250,
            reads_per_reader: 400,
            seed: 3,
            ..RaceConfig::default()
        };
        let r = race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn} {mode}: {e}"));
        assert!(r.writes > 0 && r.reads > 0 && r.scans > 0);
        let ep = d.endpoint(0);
        let s = block_on(d.engine.stats(&ep)).unwrap();
        assert!(s["retrains"].as_u64().unwrap() + s["full_trainings"].as_u64().unwrap() > 0);
    }
}

#[test]
fn races_with_long_values() {
    // spread_key(0..64) over two memory nodes.
    let bounds = spread_key(32).to_string();
    let d = deploy(&[("slots", "5"), ("bounds", &bounds)], 2, true);
    let cfg = RaceConfig {
        value_len: 40,
        torn_reads: true,
        seed: 9,
        ..RaceConfig::default()
    };
    race(&d, &cfg).unwrap();
}

#[test]
fn bad_input_is_refused_and_garbage_rpcs_harm_nothing() {
    let d = deploy(&[("slots", "4")], 2, false);
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 400, 5).unwrap();
}

#[test]
fn a_full_node_region_is_a_clear_error() {
    let d = deploy(&[("slots", "4"), ("nodes", "40")], 1, false);
    let (_ep, kv) = d.client(0).unwrap();
    block_on(async {
        let mut full = None;
        let mut stored = Vec::new();
        for i in 0..10_000u64 {
            let k = i * 7919 + 1;
            match kv.insert(k, &make_value(k, 1, 8)).await {
                Ok(true) => stored.push(k),
                Ok(false) => unreachable!(),
                Err(e) => {
                    full = Some(e);
                    break;
                }
            }
        }
        let e = full.expect("40 nodes fill up");
        assert!(matches!(e, dmkv_api::KvError::Exhausted(_)), "{e}");
        for k in stored {
            assert!(kv.get(k).await.unwrap().is_some(), "{k} survived");
        }
    });
}

/// A memory node served directly, so that the test holds its `Server` (and
/// the log's fault injection), and an engine connected to it.
struct Owned {
    engine: Arc<dyn dmkv_api::Engine>,
    server: Arc<Server>,
    compute: NodeId,
    args: ServeArgs,
    cluster: LocalCluster,
}

fn serve_owned(knobs: &[(&str, &str)], handler_threads: usize, dir: &std::path::Path) -> Owned {
    let mut k = Knobs::new();
    for (n, v) in knobs {
        k.set(n, v);
    }
    let cluster = LocalCluster::new(LocalConfig::default());
    let rt = NodeRuntime::new(cluster.add_node(handler_threads));
    let compute = cluster.add_node(0).id();
    let args = ServeArgs {
        instance: "t/xstore".into(),
        knobs: k,
        node_index: 0,
        nodes: vec![rt.id().0],
        expected_keys: 4000,
        value_size: 8,
        cache_mb: 0,
        data_dir: Some(dir.to_path_buf()),
    };
    let server = dmkv_xstore::server::serve(&rt, &args).unwrap();
    let engine = SPEC
        .connect(ConnectArgs {
            fabric: cluster.fabric(),
            compute_node: compute,
            serve: args.clone(),
            threads: 1,
            hosted: Vec::new(),
            counters_from: None,
        })
        .unwrap();
    Owned {
        engine,
        server,
        compute,
        args,
        cluster,
    }
}

impl Owned {
    fn client(&self) -> (Rc<Endpoint>, Rc<dyn KvStore>) {
        let ep = Rc::new(self.cluster.fabric().endpoint(self.compute).unwrap());
        let kv = block_on(self.engine.client(ep.clone(), 0)).unwrap();
        (ep, kv)
    }
}

fn temp_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("xstore-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

/// Group commit (§5.4): writes of concurrent clients that arrive while the
/// logger is busy (here: held) are applied at once, wait unacknowledged,
/// and are all acknowledged after one fdatasync. A reader may see such a
/// write before it is acknowledged (docs/xstore.md, durability guarantee);
/// a write that changes nothing is answered only once the record it rests
/// on is durable.
#[test]
fn group_commit_acknowledges_a_batch_after_one_sync() {
    let dir = temp_dir("group");
    let o = serve_owned(&[("durability", "on"), ("slots", "4")], 1, &dir);
    let wal = o.server.wal().expect("durability is on");
    const WRITERS: u64 = 8;
    let acked = AtomicU64::new(0);
    let hold = wal.hold();
    let ready = std::sync::Barrier::new(2);
    let ready = &ready;
    let oref = &o;
    std::thread::scope(|s| {
        let o = oref;
        let writer = s.spawn(|| {
            let (_ep, kv) = o.client();
            let tasks: Vec<LocalTask<'_, ()>> = (0..WRITERS)
                .map(|k| {
                    let kv = kv.clone();
                    let acked = &acked;
                    Box::pin(async move {
                        assert!(
                            kv.insert(k * 10 + 1, &make_value(k * 10 + 1, 1, 8))
                                .await
                                .unwrap()
                        );
                        acked.fetch_add(1, Ordering::SeqCst);
                    }) as LocalTask<'_, ()>
                })
                .collect();
            run_tasks(tasks);
        });
        // Every write is applied and logged, none acknowledged. A handler
        // appends its record (`write_records`) before it queues its reply
        // behind the log (`waiting`), so wait for both; with the log held
        // nothing leaves the queue, so `waiting` only grows.
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while wal.counters.write_records.load(Ordering::SeqCst) < WRITERS
            || (wal.waiting() as u64) < WRITERS
        {
            assert!(
                std::time::Instant::now() < deadline,
                "every reply waits for the log: {} records, {} waiting",
                wal.counters.write_records.load(Ordering::SeqCst),
                wal.waiting()
            );
            std::thread::yield_now();
        }
        assert_eq!(
            acked.load(Ordering::SeqCst),
            0,
            "acknowledged before durable"
        );
        assert_eq!(
            wal.waiting() as u64,
            WRITERS,
            "every reply waits for the log"
        );
        let (_ep, kv) = o.client();
        block_on(async {
            // Readers are not held back (one-sided GETs never touch the log).
            let v = kv.get(11).await.unwrap().expect("applied before durable");
            assert_eq!(check_value(11, &v), Ok(1));
        });
        // A second insert of a key whose first insert is not durable yet
        // changes nothing; its "exists" waits for that record too.
        let dup = s.spawn(move || {
            let (_ep, kv) = o.client();
            ready.wait();
            block_on(kv.insert(1, &make_value(1, 2, 8))).unwrap()
        });
        ready.wait();
        // Its reply must queue behind the log, not arrive.
        while (wal.waiting() as u64) < WRITERS + 1 {
            assert!(
                !dup.is_finished(),
                "\"exists\" was answered before the record it rests on was durable"
            );
            std::thread::yield_now();
        }
        drop(hold);
        writer.join().unwrap();
        assert!(!dup.join().unwrap(), "key 1 exists");
    });
    assert_eq!(acked.load(Ordering::SeqCst), WRITERS);
    let ep = Rc::new(o.cluster.fabric().endpoint(o.compute).unwrap());
    let st = block_on(o.engine.stats(&ep)).unwrap();
    let dur = &st["partitions"][0]["durability"];
    assert_eq!(dur["write_records"], WRITERS, "{dur}");
    assert_eq!(dur["write_batches"], 1, "{dur}");
    assert_eq!(dur["syncs"], 1, "{dur}");
    assert_eq!(dur["writes_per_batch"], WRITERS as f64, "{dur}");
    drop(o);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Writers upsert and delete their own keys (versions 1, 2, ...) on two
/// handler threads (two worker logs) while the memory node loses power: the
/// log drops what it had not written and the node stops. A fresh node
/// recovers from the same data_dir. Every acknowledged write must be there:
/// a key's recovered state is its last acknowledged write or a later
/// (unacknowledged) attempt.
#[test]
fn kill_and_recover_keeps_every_acknowledged_write() {
    for sync in ["fsync", "none"] {
        let dir = temp_dir(&format!("recover-{sync}"));
        let o = serve_owned(
            &[("durability", "on"), ("log_sync", sync), ("slots", "4")],
            2,
            &dir,
        );
        // Loaded keys are logged too.
        let ep0 = Rc::new(o.cluster.fabric().endpoint(o.compute).unwrap());
        let loaded: Vec<(u64, Vec<u8>)> = (0..300u64)
            .map(|i| (i * 1000 + 7, make_value(i * 1000 + 7, 1, 8)))
            .collect();
        block_on(o.engine.load(&ep0, &loaded)).unwrap();
        // Per writer: key -> (last acknowledged state, last attempted).
        type Log = BTreeMap<u64, (Option<u32>, Option<u32>)>;
        let node = NodeId(o.args.nodes[0]);
        let acked = AtomicU64::new(0);
        // Both clients exist before anyone writes (the crash comes after
        // 300 acknowledged writes).
        let started = std::sync::Barrier::new(2);
        let logs: Vec<Log> = std::thread::scope(|s| {
            let writers: Vec<_> = (0..2usize)
                .map(|t| {
                    let o = &o;
                    let acked = &acked;
                    let started = &started;
                    s.spawn(move || {
                        let (_ep, kv) = o.client();
                        started.wait();
                        let log: RefCell<Log> = RefCell::default();
                        let tasks: Vec<LocalTask<'_, ()>> = (0..3usize)
                            .map(|j| {
                                let kv = kv.clone();
                                let log = &log;
                                Box::pin(async move {
                                    let me = (t * 3 + j) as u64;
                                    for step in 0..400u32 {
                                        let key = (step as u64 % 50) * 1000 + me * 10 + 3;
                                        let version = step + 2;
                                        let delete = step % 7 == 6;
                                        let state = (!delete).then_some(version);
                                        log.borrow_mut().entry(key).or_insert((None, None)).1 =
                                            Some(version);
                                        let res = if delete {
                                            kv.delete(key).await.map(|_| ())
                                        } else {
                                            kv.upsert(key, &make_value(key, version, 8))
                                                .await
                                                .map(|_| ())
                                        };
                                        match res {
                                            Ok(()) => {
                                                let mut e = log.borrow_mut();
                                                let ent = e.get_mut(&key).unwrap();
                                                ent.0 = state.or(Some(0));
                                                acked.fetch_add(1, Ordering::SeqCst);
                                            }
                                            Err(_) => return,
                                        }
                                    }
                                }) as LocalTask<'_, ()>
                            })
                            .collect();
                        run_tasks(tasks);
                        log.into_inner()
                    })
                })
                .collect();
            // Crash in the middle of the writes (not at a fixed time).
            while acked.load(Ordering::SeqCst) < 300 {
                std::thread::yield_now();
            }
            o.server.wal().unwrap().crash();
            o.cluster.crash(node);
            writers.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // A fresh memory node serving from the same directory.
        let rt = NodeRuntime::new(o.cluster.add_node(1));
        let mut args: ServeArgs = o.args.clone();
        args.nodes = vec![rt.id().0];
        args.node_index = 0;
        SPEC.serve(&rt, &args).unwrap();
        let engine = SPEC
            .connect(ConnectArgs {
                fabric: o.cluster.fabric(),
                compute_node: o.compute,
                serve: args.clone(),
                threads: 1,
                hosted: Vec::new(),
                counters_from: None,
            })
            .unwrap();
        let ep = Rc::new(o.cluster.fabric().endpoint(o.compute).unwrap());
        let kv = block_on(engine.client(ep.clone(), 0)).unwrap();
        block_on(async {
            for (k, v) in &loaded {
                if k % 1000 == 7 {
                    assert_eq!(kv.get(*k).await.unwrap().as_ref(), Some(v), "loaded {k}");
                }
            }
            let mut checked = 0;
            for log in &logs {
                for (&key, &(ack, tried)) in log {
                    let got = kv.get(key).await.unwrap();
                    let got_v = got.as_ref().map(|v| check_value(key, v).unwrap());
                    let Some(ack) = ack else { continue };
                    checked += 1;
                    // 0 = acknowledged delete.
                    let tried = tried.unwrap();
                    match got_v {
                        Some(v) => assert!(
                            v >= ack && v <= tried,
                            "{sync}: key {key}: recovered v{v}, acked {ack}, tried {tried}"
                        ),
                        None => assert!(
                            ack == 0 || tried > ack,
                            "{sync}: key {key}: lost acknowledged v{ack}"
                        ),
                    }
                }
            }
            assert!(
                checked > 0,
                "some writes were acknowledged before the crash"
            );
        });
        drop(engine);
        drop(o);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for (torn, slots) in [(false, "4"), (true, "4"), (true, "32")] {
        let d = LocalDeployment::deploy(
            &SPEC,
            &DeployOptions {
                knobs: {
                    let mut k = Knobs::new();
                    k.set("slots", slots);
                    k
                },
                expected_keys: 4000,
                threads: 3,
                handler_threads: 2,
                ..DeployOptions::default()
            },
        )
        .unwrap();
        let cfg = InsertRaceConfig {
            torn_reads: torn,
            ..Default::default()
        };
        let r = insert_race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn}: {e}"));
        assert_eq!(r.keys, (cfg.rounds * cfg.keys_per_round) as u64);
    }
}

/// The UPDATE RPC's position hint on the wire (docs/xstore.md, *Layouts*):
/// `count u8 | (leaf u32 | incarnation u32) * count`. A two-leaf hint with
/// the key in the second leaf is used (no traversal: the tree counts it
/// used, two leaves tried); one whose incarnations are stale falls back to
/// the traversal and still updates; a hint longer than MAX_HINT_LEAVES, a
/// count with too few entries, and entries the tree refuses are malformed,
/// and change nothing. Checked to fail on the code before branch i63,
/// whose server read the count byte as a flag and refused 2 ("hint flag
/// 2").
#[test]
fn a_hint_of_several_leaves_on_the_wire() {
    use dmkv_transport::{ErrorCode, OpKind, TransportError, WireWriter, labeled};
    use dmkv_xstore::wire::{OP_UPDATE, SERVICE};
    use dmkv_xtree::{LeafRef, MAX_HINT_LEAVES};
    let dir = temp_dir("hint-wire");
    let o = serve_owned(&[("slots", "4")], 1, &dir);
    let (ep, kv) = o.client();
    let keys: Vec<(u64, Vec<u8>)> = (0..400u64)
        .map(|i| (i * 10 + 1, make_value(i * 10 + 1, 1, 8)))
        .collect();
    block_on(labeled(OpKind::Load, o.engine.load(&ep, &keys))).unwrap();
    let tree = o.server.tree().clone();
    let leaves = tree.leaves().unwrap();
    let r = |i: usize| LeafRef {
        node: leaves[i].node,
        incarnation: leaves[i].incarnation,
    };
    let node = NodeId(o.args.nodes[0]);
    let svc = block_on(ep.lookup_service(node, &o.args.name(SERVICE))).unwrap();
    let update = |key: u64, version: u32, hint: &[LeafRef], extra: usize| {
        let mut w = WireWriter::new();
        w.u8(OP_UPDATE).u64(key).bytes(&make_value(key, version, 8));
        w.u8((hint.len() + extra) as u8);
        for h in hint {
            w.u32(h.node).u32(h.incarnation);
        }
        block_on(ep.call(node, svc, w.finish())).map(|reply| (reply[0] == 1, reply[1] == 1))
    };
    let in_second = leaves[6].keys[0];
    let before = tree.stats();
    assert_eq!(
        update(in_second, 2, &[r(5), r(6)], 0).unwrap(),
        (true, true)
    );
    assert_eq!(
        tree.stats().hinted_updates_used,
        before.hinted_updates_used + 1
    );
    assert_eq!(tree.hinted_leaves_tried(), 2);
    // Stale incarnations: the traversal, the value still lands.
    let stale = |i: usize| LeafRef {
        incarnation: (r(i).incarnation + 1) & 0xFF_FFFF,
        ..r(i)
    };
    assert_eq!(
        update(in_second, 3, &[stale(5), stale(6)], 0).unwrap(),
        (true, false)
    );
    // Malformed: too long, fewer entries than the count, refused entries.
    let many: Vec<LeafRef> = (0..=MAX_HINT_LEAVES).map(r).collect();
    let dup = [r(5), r(5)];
    let inc = [LeafRef {
        incarnation: 1 << 24,
        ..r(5)
    }];
    for (hint, extra, what) in [
        (&many[..], 0, "of 17 leaves (at most 16)"),
        (&many[..2], 1, ""),
        (&dup[..], 0, "twice"),
        (&inc[..], 0, "24 bits"),
    ] {
        match update(in_second, 9, hint, extra) {
            Err(TransportError::Remote { error, .. }) => {
                assert_eq!(error.code, ErrorCode::Malformed, "{error:?}");
                assert!(error.message.contains(what), "{error:?}");
            }
            other => panic!("{hint:?} + {extra}: {other:?}"),
        }
    }
    block_on(async {
        let v = kv.get(in_second).await.unwrap().unwrap();
        assert_eq!(check_value(in_second, &v), Ok(3));
    });
    tree.check_structure().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
