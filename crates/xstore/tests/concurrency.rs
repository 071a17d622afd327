//! Races: writers (inserts that split small leaves, deletes, updates)
//! against one-sided readers, with and without torn reads, while the
//! memory node retrains; bad input; kill-and-recover with the log.

use dmkv_api::ConnectArgs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::{check_value, make_value};
use dmkv_api::{EngineSpec, Knobs, ServeArgs};
use dmkv_memnode::NodeRuntime;
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::local::{Faults, LocalConfig};
use dmkv_xstore::SPEC;
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::rc::Rc;

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
    for (torn, mode) in [
        (false, "full"),
        (true, "full"),
        (true, "models-only"),
        (true, "top-only"),
    ] {
        let d = deploy(
            &[("slots", "4"), ("keys_per_model", "8"), ("cache", mode)],
            2,
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
    let d = deploy(&[("slots", "5")], 1, true);
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

/// Writers upsert and delete their own keys (versions 1, 2, ...) while the
/// node crashes; a fresh node recovers from the same data_dir. Every
/// acknowledged write must be there: a key's recovered state is its last
/// acknowledged write or a later (unacknowledged) attempt.
#[test]
fn kill_and_recover_keeps_every_acknowledged_write() {
    for sync in ["fsync", "none"] {
        let dir =
            std::env::temp_dir().join(format!("xstore-recover-{}-{sync}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let mut k = Knobs::new();
        k.set("durability", "on");
        k.set("log_sync", sync);
        k.set("slots", "4");
        let opts = DeployOptions {
            knobs: k,
            expected_keys: 4000,
            handler_threads: 2,
            data_dir: Some(dir.clone()),
            ..DeployOptions::default()
        };
        let d = LocalDeployment::deploy(&SPEC, &opts).unwrap();
        // Loaded keys are logged too.
        let ep0 = d.endpoint(0);
        let loaded: Vec<(u64, Vec<u8>)> = (0..300u64)
            .map(|i| (i * 1000 + 7, make_value(i * 1000 + 7, 1, 8)))
            .collect();
        block_on(d.engine.load(&ep0, &loaded)).unwrap();
        // Per writer: key -> (last acknowledged state, last attempted).
        type Log = BTreeMap<u64, (Option<u32>, Option<u32>)>;
        let node = d.runtimes[0].id();
        let logs: Vec<Log> = std::thread::scope(|s| {
            let writers: Vec<_> = (0..2usize)
                .map(|t| {
                    let d = &d;
                    s.spawn(move || {
                        let (_ep, kv) = d.client(t).unwrap();
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
                                                let e = log.borrow_mut();
                                                let mut e = e;
                                                let ent = e.get_mut(&key).unwrap();
                                                ent.0 = state.or(Some(0));
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
            std::thread::sleep(std::time::Duration::from_millis(30));
            d.cluster.crash(node);
            writers.into_iter().map(|h| h.join().unwrap()).collect()
        });
        // A fresh memory node serving from the same directory.
        let rt = NodeRuntime::new(d.cluster.add_node(1));
        let mut args: ServeArgs = d.args.clone();
        args.nodes = vec![rt.id().0];
        args.node_index = 0;
        SPEC.serve(&rt, &args).unwrap();
        let engine = SPEC
            .connect(ConnectArgs {
                fabric: d.cluster.fabric(),
                compute_node: d.compute,
                serve: args.clone(),
                threads: 1,
            })
            .unwrap();
        let ep = Rc::new(d.cluster.fabric().endpoint(d.compute).unwrap());
        let kv = block_on(engine.client(ep.clone(), 0)).unwrap();
        block_on(async {
            for (k, v) in &loaded {
                if k % 1000 == 7 {
                    assert_eq!(kv.get(*k).await.unwrap().as_ref(), Some(v), "loaded {k}");
                }
            }
            let mut acked = 0;
            for log in &logs {
                for (&key, &(ack, tried)) in log {
                    let got = kv.get(key).await.unwrap();
                    let got_v = got.as_ref().map(|v| check_value(key, v).unwrap());
                    let Some(ack) = ack else { continue };
                    acked += 1;
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
            assert!(acked > 0, "some writes were acknowledged before the crash");
        });
        drop(engine);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
