#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! `scalestore` against the shared suites across nodes (oracle single and
//! multi client, races with and without torn reads, bad input and garbage
//! messages), and its own: data larger than all caches, nodes joining and
//! leaving during a run, and page-level races through the guards (one page
//! under writers from every node; many pages under eviction).

use dmkv_api::Knobs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::{check_value, make_value};
use dmkv_scalestore::SCALESTORE;
use dmkv_scalestore::engine::served_nodes;
use dmkv_scalestore::guard::{ExclusiveGuard, OptimisticGuard, PageError, SharedGuard};
use dmkv_scalestore::node::ScaleNode;
use dmkv_scalestore::pid::Pid;
use dmkv_scalestore::worker::Worker;
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs, check_knobs_refused};
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_testkit::oracle::{check_multi, check_single, op_strategy};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::local::Faults;
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

fn opts(nodes: usize, threads: usize, knobs: &[(&str, &str)]) -> DeployOptions {
    let mut k = Knobs::new();
    for (n, v) in knobs {
        k.set(n, v);
    }
    DeployOptions {
        nodes,
        threads,
        cache_mb: 1,
        knobs: k,
        ..Default::default()
    }
}

/// For the page races, which must not fail on a clock: no wall-clock
/// limit below the watchdog's on an RPC reply or on a free cache slot. On
/// a loaded machine the defaults (30 s each) failed
/// `many_pages_under_eviction_and_transfers_fifo` once in 37 runs (a
/// `Transport(Timeout)`, then a worker without a slot for 30 s) where the
/// run was only stalled (earlier loops saw machine-wide stalls over 15 s);
/// a real hang still ends in the watchdog's abort.
fn untimed(mut o: DeployOptions) -> DeployOptions {
    o.local.rpc_timeout = std::time::Duration::from_secs(3600);
    o.knobs.set("slot_wait_ms", "3600000");
    o
}

fn deploy(o: DeployOptions) -> LocalDeployment {
    arm_watchdog();
    LocalDeployment::deploy(&SCALESTORE, &o).unwrap()
}

/// No test may hang CI: the first deployment arms a watchdog that aborts
/// the whole test binary (with a message) if it is still running after
/// `SCALESTORE_TEST_DEADLINE` seconds (default 300; the file normally takes
/// seconds). A hang then fails fast instead of eating CI's time limit.
fn arm_watchdog() {
    static ARMED: std::sync::Once = std::sync::Once::new();
    ARMED.call_once(|| {
        let secs: u64 = std::env::var("SCALESTORE_TEST_DEADLINE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(300);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(secs));
            // Straight to stderr: `eprintln!` would be captured by the test.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "{}: tests still running after {secs} s: aborting (a hang)",
                file!()
            );
            std::process::abort();
        });
    });
}

fn nodes_of(d: &LocalDeployment) -> Vec<Arc<ScaleNode>> {
    served_nodes(&d.runtimes, &d.args)
}

/// With `SCALESTORE_WATCH=SECS` set, prints the engine's figures and every
/// node's busy frames every SECS seconds until dropped (diagnostics).
struct Watch(
    Option<(
        Arc<std::sync::atomic::AtomicBool>,
        std::thread::JoinHandle<()>,
    )>,
);

fn watch(d: &LocalDeployment) -> Watch {
    let Some(secs): Option<u64> = std::env::var("SCALESTORE_WATCH")
        .ok()
        .and_then(|s| s.parse().ok())
    else {
        return Watch(None);
    };
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let nodes = nodes_of(d);
    let s2 = stop.clone();
    let h = std::thread::spawn(move || {
        let mut waited = 0u64;
        while !s2.load(Ordering::Relaxed) {
            std::thread::sleep(std::time::Duration::from_millis(100));
            waited += 100;
            if waited.is_multiple_of(secs * 1000) {
                for n in &nodes {
                    use std::io::Write;
                    let _ = writeln!(
                        std::io::stderr(),
                        "node {} state {:?} free {} inflight {}\n{}",
                        n.index,
                        n.state(),
                        n.free_slots(),
                        n.inflight.load(Ordering::Relaxed),
                        n.debug_dump()
                    );
                }
            }
        }
    });
    Watch(Some((stop, h)))
}

impl Drop for Watch {
    fn drop(&mut self) {
        if let Some((stop, h)) = self.0.take() {
            stop.store(true, Ordering::Relaxed);
            let _ = h.join();
        }
    }
}

fn stats(d: &LocalDeployment) -> serde_json::Value {
    block_on(d.engine.stats(&d.endpoint(0))).unwrap()
}

/// Each node's membership state from the engine's stats, in node order.
fn node_states(st: &serde_json::Value) -> Vec<String> {
    st["per_node"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["state"].as_str().unwrap().to_string())
        .collect()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(ops in prop::collection::vec(op_strategy(400, 1024, true), 1..300)) {
        let d = deploy(opts(3, 3, &[]));
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client_across_nodes() {
    for protocol in ["chaining", "fifo"] {
        let d = deploy(opts(3, 3, &[("protocol", protocol)]));
        check_multi(&d, 3, 2, 300, 5).unwrap_or_else(|e| panic!("{protocol}: {e}"));
    }
}

#[test]
fn races_with_and_without_torn_reads() {
    for (protocol, torn) in [("chaining", false), ("chaining", true), ("fifo", true)] {
        let d = deploy(opts(3, 3, &[("protocol", protocol)]));
        let r = race(
            &d,
            &RaceConfig {
                torn_reads: torn,
                threads: 3,
                keys: 300,
                loaded: 200,
                value_len: 128,
                ..Default::default()
            },
        )
        .unwrap_or_else(|e| panic!("{protocol} torn={torn}: {e}"));
        assert!(r.writes > 0 && r.reads > 0 && r.scans > 0, "{r:?}");
    }
}

#[test]
fn bad_input_and_garbage_messages_are_refused() {
    let d = deploy(opts(2, 2, &[]));
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 200, 9).unwrap();
}

#[test]
fn bad_knobs_are_refused() {
    check_knobs_refused(
        &SCALESTORE,
        &opts(3, 1, &[]),
        &[
            ("protocol", "lifo"),
            ("fifo_ack", "later"),
            ("cache_pages", "10"),
            ("join", "0@5"),
            ("join", "7@5"),
            ("leave", "1"),
            ("leave", "0@5,0@9"),
            ("leave", "0@5,none"),
            ("leave", "0@5,3@5"),
            ("leave", "0@5,"),
            ("free_percent", "0"),
            ("load", "everywhere"),
        ],
    )
    .unwrap();
    // A list of leaves is accepted.
    LocalDeployment::deploy(&SCALESTORE, &opts(3, 1, &[("leave", "0@5,2@5")])).unwrap();
}

/// Values of `n` keys, written once from node 0 and read back from every
/// node, with data four times the sum of the caches: pages go to the SSDs
/// (every node's page file under `--data-dir`) and come back.
#[test]
fn data_larger_than_all_caches() {
    let dir = tempfile::tempdir().unwrap();
    let d = deploy(DeployOptions {
        data_dir: Some(dir.path().to_path_buf()),
        ..opts(3, 3, &[("cache_pages", "64")])
    });
    // 3 x 64 pages of cache; leaves of 1000-byte values hold 2 to 4 pairs,
    // so 3000 pairs fill over 4 x 192 pages (checked below).
    let _w = watch(&d);
    let n = 3_000u64;
    let key = |i: u64| i.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 8;
    let pairs: Vec<(u64, Vec<u8>)> = (0..n)
        .map(|i| (key(i), make_value(key(i), 1, 1000)))
        .collect();
    block_on(d.engine.load(&d.endpoint(0), &pairs)).unwrap();
    // Bytes each client's endpoint charged to its reads.
    let read_bytes: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..3)
            .map(|t| {
                let d = &d;
                s.spawn(move || {
                    let (ep, store) = d.client(t).unwrap();
                    let tasks: Vec<LocalTask<'_, ()>> = (0..2u64)
                        .map(|task| {
                            let store = store.clone();
                            Box::pin(async move {
                                // Every key is read from every node.
                                for i in (task..n).step_by(2) {
                                    let k = key(i);
                                    let v = store
                                        .get(k)
                                        .await
                                        .unwrap()
                                        .unwrap_or_else(|| panic!("key {k} missing"));
                                    assert_eq!(check_value(k, &v), Ok(1), "key {k}");
                                }
                            }) as LocalTask<'_, ()>
                        })
                        .collect();
                    run_tasks(tasks);
                    ep.total_counters().bytes_read
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let st = stats(&d);
    let pages: u64 = nodes_of(&d)
        .iter()
        .map(|n| {
            n.shard_list()
                .iter()
                .map(|(_, s)| s.next_slot.load(Ordering::Relaxed))
                .sum::<u64>()
        })
        .sum();
    assert!(
        pages >= 4 * 3 * 64,
        "only {pages} pages for 4x the caches: {st}"
    );
    // Remote allocation is round-robin over every node, the loading one
    // included (§6.5): each shard holds about a third of the pages.
    for n in nodes_of(&d) {
        for (shard, s) in n.shard_list() {
            let here = s.next_slot.load(Ordering::Relaxed);
            assert!(
                here * 6 >= pages,
                "shard {shard} has {here} of {pages} pages: allocation skipped it"
            );
        }
    }
    assert!(st["ssd_writes"].as_u64().unwrap() > 0, "{st}");
    assert!(st["ssd_reads"].as_u64().unwrap() > 0, "{st}");
    assert!(st["pages_from_ssd"].as_u64().unwrap() > 0, "{st}");
    assert!(st["evictions"].as_u64().unwrap() > 0, "{st}");
    // SSD reads go through io_uring where the kernel allows it, several at
    // once (workers and handler threads of three nodes read concurrently).
    if st["ssd_io_uring"] == true {
        let through = st["ssd_reads_through_ring"].as_u64().unwrap();
        assert!(
            through > 0 && through <= st["ssd_reads"].as_u64().unwrap(),
            "{st}"
        );
        assert!(st["ssd_read_depth_max"].as_u64().unwrap() >= 1, "{st}");
        assert!(st["ssd_read_depth_mean"].as_f64().unwrap() >= 1.0, "{st}");
    } else {
        eprintln!("io_uring unavailable here: SSD reads took the pread fallback");
    }
    // The pages written into a client's cache by other nodes (one-sided,
    // 4 KiB each) are charged to that client's operations: every client
    // reads every key with caches of a quarter of the data, so it receives
    // most leaves, two thirds of which another node directs.
    for (t, b) in read_bytes.iter().enumerate() {
        assert!(
            *b >= 4096 * pages / 3,
            "client {t} was charged {b} bytes read for {pages} pages: {st}"
        );
    }
    let files = walk(dir.path());
    assert_eq!(
        files.iter().filter(|f| f.ends_with(".pages")).count(),
        3,
        "{files:?}"
    );
}

fn walk(p: &std::path::Path) -> Vec<String> {
    let mut out = Vec::new();
    for e in std::fs::read_dir(p).unwrap() {
        let e = e.unwrap();
        if e.path().is_dir() {
            out.extend(walk(&e.path()));
        } else {
            out.push(e.path().display().to_string());
        }
    }
    out
}

/// Nodes 0 and 2 leave at the same operation count while every node's
/// clients write and read (leaves may overlap: invariant 13); afterwards
/// node 1 serves every key with its last value, from every client.
#[test]
fn two_leaves_at_once_during_a_run_keep_every_value() {
    for protocol in ["chaining", "fifo"] {
        let d = deploy(opts(
            3,
            3,
            &[
                ("protocol", protocol),
                ("cache_pages", "64"),
                ("leave", "0@700,2@700"),
            ],
        ));
        let _w = watch(&d);
        let (threads, keys, rounds) = (3usize, 120u64, 6u32);
        let key = |t: usize, i: u64| (t as u64) << 32 | i;
        std::thread::scope(|s| {
            for t in 0..threads {
                let d = &d;
                s.spawn(move || {
                    let (_ep, store) = d.client(t).unwrap();
                    block_on(async {
                        for round in 1..=rounds {
                            for i in 0..keys {
                                let k = key(t, i);
                                store.upsert(k, &make_value(k, round, 100)).await.unwrap();
                            }
                        }
                    });
                });
            }
        });
        block_on(d.engine.settle(&d.endpoint(0))).unwrap_or_else(|e| panic!("{protocol}: {e}"));
        let st = stats(&d);
        let events: Vec<String> = serde_json::from_value(st["membership_events"].clone()).unwrap();
        for n in [0, 2] {
            assert!(
                events.iter().any(|e| e.contains(&format!("node {n} left"))),
                "{protocol}: {events:?}"
            );
        }
        let states = node_states(&st);
        assert_eq!(states, ["left", "active", "left"], "{st}");
        for t in 0..threads {
            let (_ep, store) = d.client(t).unwrap();
            block_on(async {
                for tt in 0..threads {
                    for i in 0..keys {
                        let k = key(tt, i);
                        let v = store
                            .get(k)
                            .await
                            .unwrap()
                            .unwrap_or_else(|| panic!("{protocol}: key {k:#x} lost"));
                        assert_eq!(check_value(k, &v), Ok(rounds), "{protocol}: {k:#x} stale");
                    }
                }
                let all = store.scan(0, 10_000).await.unwrap();
                assert_eq!(all.len(), threads * keys as usize, "{protocol}");
            });
        }
    }
}

/// Node 2 joins and node 1 leaves while every node's clients write and
/// read; afterwards every key has its last written value, read from every
/// client (those of node 1 through another node).
#[test]
fn join_and_leave_keep_every_value() {
    for protocol in ["chaining", "fifo"] {
        let d = deploy(opts(
            3,
            3,
            &[
                ("protocol", protocol),
                ("cache_pages", "64"),
                ("join", "2@300"),
                ("leave", "1@1100"),
            ],
        ));
        let _w = watch(&d);
        let (threads, tasks, keys_per_task, rounds) = (3usize, 2usize, 60u64, 6u32);
        let key = |t: usize, j: usize, i: u64| ((t * tasks + j) as u64) << 32 | i;
        std::thread::scope(|s| {
            for t in 0..threads {
                let d = &d;
                s.spawn(move || {
                    let (_ep, store) = d.client(t).unwrap();
                    let futs: Vec<LocalTask<'_, ()>> = (0..tasks)
                        .map(|j| {
                            let store = store.clone();
                            Box::pin(async move {
                                for round in 1..=rounds {
                                    for i in 0..keys_per_task {
                                        let k = key(t, j, i);
                                        store.upsert(k, &make_value(k, round, 100)).await.unwrap();
                                        let v = store.get(k).await.unwrap().expect("just written");
                                        assert_eq!(
                                            check_value(k, &v),
                                            Ok(round),
                                            "{protocol} key {k:#x}"
                                        );
                                    }
                                }
                            }) as LocalTask<'_, ()>
                        })
                        .collect();
                    run_tasks(futs);
                });
            }
        });
        block_on(d.engine.settle(&d.endpoint(0))).unwrap_or_else(|e| panic!("{protocol}: {e}"));
        let st = stats(&d);
        let events: Vec<String> = serde_json::from_value(st["membership_events"].clone()).unwrap();
        assert_eq!(events.len(), 2, "{protocol}: {st}");
        assert!(
            events.iter().any(|e| e.contains("node 2 joined")),
            "{events:?}"
        );
        assert!(
            events.iter().any(|e| e.contains("node 1 left")),
            "{events:?}"
        );
        let states = node_states(&st);
        assert_eq!(states, ["active", "left", "active"], "{st}");
        for t in 0..threads {
            let (_ep, store) = d.client(t).unwrap();
            block_on(async {
                for tt in 0..threads {
                    for j in 0..tasks {
                        for i in 0..keys_per_task {
                            let k = key(tt, j, i);
                            let v = store
                                .get(k)
                                .await
                                .unwrap()
                                .unwrap_or_else(|| panic!("{protocol}: key {k:#x} lost"));
                            assert_eq!(
                                check_value(k, &v),
                                Ok(rounds),
                                "{protocol}: key {k:#x} stale"
                            );
                        }
                    }
                }
                let all = store.scan(0, 10_000).await.unwrap();
                assert_eq!(
                    all.len(),
                    threads * tasks * keys_per_task as usize,
                    "{protocol}"
                );
            });
        }
    }
}

/// The cause of the CI failure of `join_and_leave_keep_every_value`
/// (`Corrupt("page p1:0 is not a tree node")`): the successor installed a
/// handed-over directory entry into a frame that one of its own workers,
/// told "retry" for that page during the handover, removed between the
/// handler's lookup and its taking the frame's mutex. The entry was lost
/// with the frame, the successor later took the page for "only on the
/// SSD, clean", and served the never-written slot: zeroes. Here node 0
/// adopts shard 1 and receives one entry for p1:0 over and over while
/// another thread does what that worker did (find or insert the frame,
/// latch it, remove it while it carries no entry and no copy). After
/// every handover the page's frame must be in the table with the entry
/// just sent. Before the fix (`FrameTable::lock_or_insert`) this failed
/// in 12 of 12 runs on this machine, after 1 231 to 61 295 rounds.
#[test]
fn handed_over_entries_survive_a_worker_dropping_the_frame() {
    use dmkv_scalestore::frames::{Owners, Possession};
    use dmkv_scalestore::msg::{EntryState, WireOwners};
    use std::sync::atomic::AtomicBool;
    let d = deploy(opts(3, 1, &[]));
    let nodes = nodes_of(&d);
    let n = nodes.iter().find(|n| n.index == 0).unwrap().clone();
    let pid = Pid::new(1, 0);
    n.handle_adopt(1, 1, 1, 1_000).unwrap();
    let stop = AtomicBool::new(false);
    let removed = AtomicU64::new(0);
    let rounds = 200_000u64;
    std::thread::scope(|s| {
        s.spawn(|| {
            // A worker whose fetch of `pid` was refused: its frame goes.
            while !stop.load(Ordering::Relaxed) {
                let fi = n.frames.find_or_insert(pid).unwrap();
                let f = n.frames.frame(fi);
                if !f.latch.try_exclusive() {
                    continue;
                }
                let mut m = f.meta.lock();
                if f.pid() == pid && f.local().mode == Possession::None {
                    // The worker's own work under the mutex (giving its
                    // slot back): the handler may look the frame up now.
                    for _ in 0..200 {
                        std::hint::spin_loop();
                    }
                    n.maybe_remove(fi, &mut m);
                    if f.pid() != pid {
                        removed.fetch_add(1, Ordering::Relaxed);
                    }
                }
                drop(m);
                f.latch.unlock_exclusive();
            }
        });
        for round in 0..rounds {
            let epoch = 2_000 + round;
            let e = EntryState {
                pid,
                owners: WireOwners::Exclusive(2),
                epoch,
                dirty: true,
                prev_dirty: false,
                copy_grants: Vec::new(),
            };
            let res = n.handle_entries(1, 1, &[e]);
            // An installed entry keeps its frame in the table (it is not
            // idle), so looking it up and then locking it is safe here.
            let found = n.frames.find(pid).map(|fi| {
                let mut m = n.frames.frame(fi).meta.lock();
                let got = m.dir.as_ref().map(|d| (d.epoch, d.owners, d.dirty));
                // Idle again, so that the other thread can remove it.
                m.dir = None;
                got
            });
            if res.is_err() || found != Some(Some((epoch, Owners::Exclusive(2), true))) {
                stop.store(true, Ordering::Relaxed);
                panic!(
                    "round {round}: handover {res:?}, the page's frame holds {found:?} \
                     (frames removed meanwhile: {})",
                    removed.load(Ordering::Relaxed)
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    // The race was exercised, not only the quiet path.
    assert!(removed.load(Ordering::Relaxed) > 0, "no frame was removed");
}

/// Invariant 18: an eviction decided by a directory whose shard is being
/// handed over is in the entries the leaver hands over. The leaver freezes
/// the shard, then reads every entry under its mutex (`hand_over`); a
/// handler that had looked at `frozen` before the freeze and took the
/// entry's mutex after the leaver's pass accepted the eviction anyway: the
/// successor was handed an entry naming the evicter as an owner it no
/// longer is (a stale owner set: its next request is granted "keep yours"
/// for a copy it dropped), and a dirty last copy was pulled into the
/// leaver's page file after that file was handed over (a lost update).
/// Here the test thread plays the leaver: it holds the entry's mutex while
/// a handler thread runs `handle_evict`, freezes the shard, reads the
/// entry, and lets go. Deterministic up to the handler reaching the mutex
/// within the spin; before the fix it failed in the first round.
#[test]
fn an_eviction_reaching_a_freezing_directory_is_in_the_handed_over_entry() {
    use dmkv_scalestore::directory::Evicted;
    use dmkv_scalestore::frames::Owners;
    use dmkv_scalestore::msg::{EvictEntry, EvictReply};
    use std::sync::atomic::AtomicBool;
    let d = deploy(opts(3, 1, &[]));
    let nodes = nodes_of(&d);
    let n = nodes.iter().find(|n| n.index == 0).unwrap().clone();
    // A page node 0 directs, held by nodes 1 and 2 (clean), so that an
    // accepted eviction from node 2 only changes the owner set.
    let (pid, fi, epoch) = n.alloc_here(1).unwrap();
    let shard = n.shard(0).unwrap();
    let entry = EvictEntry {
        pid,
        epoch,
        offset: 0,
        copies: 0,
    };
    let rounds = 200u64;
    let go = AtomicU64::new(0);
    let started = AtomicU64::new(0);
    let done = AtomicU64::new(0);
    let accepted = AtomicBool::new(false);
    let mut stale = Vec::new();
    std::thread::scope(|s| {
        s.spawn(|| {
            for round in 1..=rounds {
                while go.load(Ordering::SeqCst) != round {
                    std::hint::spin_loop();
                }
                started.store(round, Ordering::SeqCst);
                let r = n.handle_evict(2, &[entry]).unwrap();
                let Evicted::Reply(EvictReply::Decided(v)) = r else {
                    panic!("the shard is here and nothing is pulled")
                };
                accepted.store(v[0], Ordering::SeqCst);
                done.store(round, Ordering::SeqCst);
            }
        });
        for round in 1..=rounds {
            shard.frozen.store(false, Ordering::SeqCst);
            let f = n.frames.frame(fi);
            let mut m = f.meta.lock();
            {
                let dir = m.dir.as_mut().expect("allocated here");
                dir.owners = Owners::Shared(1 << 1 | 1 << 2);
                dir.dirty = false;
                dir.copy_grants.clear();
            }
            go.store(round, Ordering::SeqCst);
            while started.load(Ordering::SeqCst) != round {
                std::hint::spin_loop();
            }
            // Time for the handler to look at the shard and wait for the
            // mutex we hold.
            for _ in 0..200_000 {
                std::hint::spin_loop();
            }
            // The leave: freeze, then read the entry under its mutex.
            shard.frozen.store(true, Ordering::SeqCst);
            let handed = m.dir.as_ref().map(|d| d.owners);
            drop(m);
            while done.load(Ordering::SeqCst) != round {
                std::hint::spin_loop();
            }
            if accepted.load(Ordering::SeqCst) && handed.is_some_and(|o| o.contains(2)) {
                stale.push(round);
            }
        }
    });
    shard.frozen.store(false, Ordering::SeqCst);
    assert!(
        stale.is_empty(),
        "evictions accepted after the leaver read the entry (it hands over node 2 as an owner) in rounds {stale:?}"
    );
}

// ---- page-level races through the guards ---------------------------------

/// Word 0 of a test page counts increments; word `1 + w` counts those of
/// writer `w`: a consistent snapshot has word 0 equal to the sum.
const WRITERS: usize = 9;

fn consistent(words: &[u64]) -> Result<u64, String> {
    let sum: u64 = words[1..=WRITERS].iter().sum();
    if words[0] == sum {
        Ok(sum)
    } else {
        Err(format!(
            "torn page: counter {} but writers sum to {sum} ({words:?})",
            words[0]
        ))
    }
}

fn read_words(p: &dmkv_scalestore::page::PageRef<'_>) -> Result<Vec<u64>, PageError> {
    (0..=WRITERS)
        .map(|i| p.word(i).map_err(PageError::from))
        .collect()
}

/// Every node's tasks increment, read shared and read optimistically random
/// pages of `pages` test pages. Checks: every snapshot is consistent; a
/// task never sees a page's counter go back (its own sequence is ordered);
/// no read started after a completed write misses it (writes are visible
/// cluster-wide once done); at the end every counter equals the
/// increments made.
fn page_race(d: &LocalDeployment, pages: usize, ops: usize, seed: u64) -> serde_json::Value {
    let _w = watch(d);
    let nodes = nodes_of(d);
    let k = nodes.len();
    let tasks = WRITERS / k;
    assert_eq!(tasks * k, WRITERS);
    // Allocate the pages from node 0 (round-robin over the directories).
    let pids: Vec<Pid> = {
        let w = Worker::new(
            nodes[0].clone(),
            Rc::new(nodes[0].fabric.endpoint(nodes[0].id).unwrap()),
        );
        block_on(async {
            let mut v = Vec::new();
            for _ in 0..pages {
                let g = ExclusiveGuard::allocate(&w).await.unwrap();
                v.push(g.pid());
            }
            v
        })
    };
    let incs: Vec<AtomicU64> = (0..pages).map(|_| AtomicU64::new(0)).collect();
    let done: Vec<AtomicU64> = (0..pages).map(|_| AtomicU64::new(0)).collect();
    std::thread::scope(|s| {
        for (ni, node) in nodes.iter().enumerate() {
            let (pids, incs, done) = (&pids, &incs, &done);
            s.spawn(move || {
                let w = Worker::new(node.clone(), Rc::new(node.fabric.endpoint(node.id).unwrap()));
                let w = &w;
                let futs: Vec<LocalTask<'_, ()>> = (0..tasks)
                    .map(|t| {
                        let me = ni * tasks + t;
                        Box::pin(async move {
                            let mut rng = SmallRng::seed_from_u64(seed ^ (me as u64) << 20);
                            let mut last = vec![0u64; pids.len()];
                            for _ in 0..ops {
                                let i = rng.gen_range(0..pids.len());
                                let pid = pids[i];
                                let floor = done[i].load(Ordering::SeqCst);
                                let seen = match rng.gen_range(0..10) {
                                    0..=3 => {
                                        let g = ExclusiveGuard::fix(w, pid).await.unwrap();
                                        let p = g.page();
                                        let words = read_words(&p).unwrap();
                                        consistent(&words).unwrap();
                                        p.set_word(0, words[0] + 1);
                                        p.set_word(1 + me, words[1 + me] + 1);
                                        incs[i].fetch_add(1, Ordering::SeqCst);
                                        drop(g);
                                        done[i].fetch_max(words[0] + 1, Ordering::SeqCst);
                                        words[0] + 1
                                    }
                                    4..=6 => {
                                        let g = SharedGuard::fix(w, pid).await.unwrap();
                                        consistent(&read_words(&g.page()).unwrap()).unwrap()
                                    }
                                    _ => loop {
                                        let g = OptimisticGuard::fix(w, pid).await.unwrap();
                                        let words = read_words(&g.page());
                                        if g.check().is_ok() {
                                            break consistent(&words.unwrap()).unwrap();
                                        }
                                    },
                                };
                                assert!(seen >= last[i], "{pid}: task {me} saw {seen} after {}", last[i]);
                                assert!(seen >= floor, "{pid}: task {me} read {seen} after a write of {floor} completed");
                                last[i] = seen;
                            }
                        }) as LocalTask<'_, ()>
                    })
                    .collect();
                run_tasks(futs);
            });
        }
    });
    // Every node reads every page: counters equal the increments made.
    for node in &nodes {
        let w = Worker::new(
            node.clone(),
            Rc::new(node.fabric.endpoint(node.id).unwrap()),
        );
        block_on(async {
            for (i, pid) in pids.iter().enumerate() {
                let g = SharedGuard::fix(&w, *pid).await.unwrap();
                let n = consistent(&read_words(&g.page()).unwrap()).unwrap();
                assert_eq!(
                    n,
                    incs[i].load(Ordering::SeqCst),
                    "{pid} on node {}",
                    node.index
                );
            }
        });
    }
    stats(d)
}

/// All nodes' writers and readers on one page: sequential consistency of a
/// single page under anticipatory chaining and under the FIFO queue, with
/// and without torn reads (the page moves by one-sided writes; evictions
/// pull dirty pages by one-sided reads).
#[test]
fn one_page_under_writers_from_every_node() {
    for (protocol, torn) in [("chaining", false), ("chaining", true), ("fifo", false)] {
        let d = deploy(untimed(opts(3, 3, &[("protocol", protocol)])));
        d.cluster.set_faults(Faults {
            torn_reads: torn,
            ..Default::default()
        });
        let st = page_race(&d, 1, 300, 7);
        assert!(
            st["messages"]["move"].as_u64().unwrap_or(0) > 0,
            "{protocol}: {st}"
        );
    }
}

/// Many pages, caches of 64 pages: transfers race evictions (owner
/// stability, dirty pulls), upgrades race copies, optimistic readers race
/// moves.
fn many_pages(protocol: &str, torn: bool) {
    let d = deploy(untimed(opts(
        3,
        3,
        &[("protocol", protocol), ("cache_pages", "64")],
    )));
    d.cluster.set_faults(Faults {
        torn_reads: torn,
        ..Default::default()
    });
    let st = page_race(&d, 150, 400, 11);
    assert!(st["evictions"].as_u64().unwrap() > 0, "{protocol}: {st}");
    assert_eq!(st["stale_requests"], 0, "{protocol}: {st}");
}

#[test]
fn many_pages_under_eviction_and_transfers_chaining() {
    many_pages("chaining", false);
}

#[test]
fn many_pages_under_eviction_and_transfers_chaining_torn_reads() {
    many_pages("chaining", true);
}

#[test]
fn many_pages_under_eviction_and_transfers_fifo() {
    many_pages("fifo", false);
}

/// `--cache-mb 0` sizes every node's cache for the expected keys (at least
/// 64 MiB), so that the data set stays in memory; an explicit size is kept,
/// and `cache_pages` out of range is refused.
#[test]
fn a_zero_cache_size_is_sized_for_the_expected_keys() {
    use dmkv_scalestore::engine::pages_for;
    let reserved = |cache_mb: u64, keys: u64| {
        let mut o = opts(1, 1, &[]);
        o.cache_mb = cache_mb;
        o.expected_keys = keys;
        let d = deploy(o);
        d.node_stats()[0].memory_reserved
    };
    assert_eq!(pages_for(1000, 8, 10), (64 << 20) / 4096, "at least 64 MiB");
    let big = pages_for(10_000_000, 8, 10);
    assert!(
        big * 4096 > 10_000_000 * 49,
        "holds the measured 49 bytes a key"
    );
    assert!(
        pages_for(10_000_000, 1000, 10) > big * 20,
        "grows with the value size"
    );
    assert!(reserved(0, 2_000_000) >= pages_for(2_000_000, 8, 10) as u64 * 4096);
    assert!(
        reserved(1, 2_000_000) < 2 << 20,
        "an explicit 1 MiB cache stays small"
    );
    let mut o = opts(1, 1, &[("cache_pages", "32")]);
    o.cache_mb = 0;
    assert!(LocalDeployment::deploy(&SCALESTORE, &o).is_err());
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for (nodes, torn) in [(1, false), (2, false), (2, true)] {
        let d = deploy(opts(nodes, 3, &[]));
        let cfg = InsertRaceConfig {
            torn_reads: torn,
            ..Default::default()
        };
        let r = insert_race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn}: {e}"));
        assert_eq!(r.keys, (cfg.rounds * cfg.keys_per_round) as u64);
    }
}

/// Fig. 6's FIFO shape (§3.4.2): one page directed by node 0, one worker
/// per node updating it until 3000 updates are made in all. Under the FIFO
/// queue the directory's own worker bypasses the queue (an acknowledgement
/// leaves the page to it when it waits), so it makes more updates than the
/// remote nodes on average; before, it backed off while any remote request
/// was queued and was starved. Every update is in the page.
#[test]
fn fifo_favours_the_directorys_own_worker() {
    let d = deploy(opts(3, 3, &[("protocol", "fifo"), ("alloc", "local")]));
    let nodes = nodes_of(&d);
    let w0 = Worker::new(
        nodes[0].clone(),
        Rc::new(nodes[0].fabric.endpoint(nodes[0].id).unwrap()),
    );
    let pid = block_on(async { ExclusiveGuard::allocate(&w0).await.unwrap().pid() });
    assert_eq!(pid.shard(), 0, "allocated on node 0's own shard");
    const TOTAL: u64 = 3000;
    let made = AtomicU64::new(0);
    let counts: Vec<u64> = std::thread::scope(|s| {
        let handles: Vec<_> = nodes
            .iter()
            .map(|node| {
                let made = &made;
                s.spawn(move || {
                    let w = Worker::new(
                        node.clone(),
                        Rc::new(node.fabric.endpoint(node.id).unwrap()),
                    );
                    let mut mine = 0u64;
                    block_on(async {
                        while made.load(Ordering::SeqCst) < TOTAL {
                            let g = ExclusiveGuard::fix(&w, pid).await.unwrap();
                            let p = g.page();
                            p.set_word(0, p.word(0).unwrap() + 1);
                            drop(g);
                            made.fetch_add(1, Ordering::SeqCst);
                            mine += 1;
                            // Give the core away between updates, as on
                            // dedicated cores (see examples/fairness.rs).
                            std::thread::sleep(std::time::Duration::from_micros(20));
                        }
                    });
                    mine
                })
            })
            .collect();
        handles.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let total: u64 = counts.iter().sum();
    let in_page = block_on(async {
        ExclusiveGuard::fix(&w0, pid)
            .await
            .unwrap()
            .page()
            .word(0)
            .unwrap()
    });
    assert_eq!(in_page, total, "every update is in the page: {counts:?}");
    // The mechanism: the directory's worker was granted the page while
    // remote requests waited in the queue (never, before).
    let st = stats(&d);
    assert!(st["fifo_queued"].as_u64().unwrap() > 0, "{st}");
    assert!(st["fifo_bypassed"].as_u64().unwrap() > 0, "{st}");
    // Its effect, with a wide margin for this machine's scheduling (a
    // remote worker on its hot path can streak, see examples/fairness.rs;
    // seen: [532, 1356, 1112] under load): the directory's node is not
    // starved (before: 13 against ~1 900 updates/s, docs/scalestore.md).
    // Whether it is favoured is measured by examples/fairness, not here.
    let least_other = counts[1].min(counts[2]);
    assert!(
        counts[0] * 4 >= least_other,
        "the directory's worker is starved under FIFO: {counts:?}, {st}"
    );
}

/// `scalestore.slot_wait_ms` takes 1..=3 600 000 ms; anything else is
/// refused when the engine is deployed.
#[test]
fn slot_wait_out_of_range_is_refused() {
    for bad in ["0", "3600001", "soon"] {
        let r = LocalDeployment::deploy(&SCALESTORE, &opts(1, 1, &[("slot_wait_ms", bad)]));
        let e = r
            .err()
            .unwrap_or_else(|| panic!("slot_wait_ms={bad} was accepted"));
        assert!(e.to_string().contains("slot_wait_ms"), "{bad}: {e}");
    }
    for good in ["1", "3600000"] {
        LocalDeployment::deploy(&SCALESTORE, &opts(1, 1, &[("slot_wait_ms", good)]))
            .unwrap_or_else(|e| panic!("slot_wait_ms={good}: {e}"));
    }
}

/// An update fixes its leaf exclusively once (§3.3: one directory request
/// that also invalidates the other copies): from a node that holds the
/// tree's catalog and root but not the leaf, the update sends exactly one
/// ownership request. Before, the optimistic descent fetched the leaf in
/// shared mode and the write then upgraded it: two requests.
#[test]
fn an_update_of_a_remote_leaf_asks_its_directory_once() {
    use dmkv_scalestore::msg::Kind;
    let d = deploy(opts(2, 2, &[("alloc", "local")]));
    let nodes = nodes_of(&d);
    let n1 = nodes.iter().find(|n| n.index == 1).unwrap().clone();
    let (_, kv0) = d.client(0).unwrap();
    let (_, kv1) = d.client(1).unwrap();
    let requests = || n1.stats.sent[Kind::Request as usize].load(Ordering::Relaxed);
    block_on(async {
        // Thread 0 runs on node 0, which allocates (and directs) every
        // page: about 70 leaves under one inner root.
        for k in 0..2000u64 {
            assert!(kv0.insert(k, &[7u8; 100]).await.unwrap());
        }
        // Node 1 fetches the catalog, the root and key 0's leaf.
        assert_eq!(kv1.get(0).await.unwrap(), Some(vec![7u8; 100]));
        let warm = requests();
        assert!(warm >= 3, "node 1 fetched the path to key 0: {warm}");
        assert!(kv1.update(1999, &[9u8; 100]).await.unwrap());
        let sent = requests() - warm;
        assert_eq!(
            sent, 1,
            "an update of a leaf node 1 does not hold sent {sent} ownership requests"
        );
        assert_eq!(kv0.get(1999).await.unwrap(), Some(vec![9u8; 100]));
        assert_eq!(kv1.get(1998).await.unwrap(), Some(vec![7u8; 100]));
    });
}

/// `scalestore.load=ranges` loads as the paper's YCSB driver does (the
/// artifact's `frontend/ycsb/ycsb.cpp`: node i of K inserts the i-th of K
/// key-ordered ranges): after the load each node holds its own range's
/// pages in its cache, where `load=one` (the harness's node inserts every
/// key) leaves every page on node 0. Either way every key reads back with
/// its value from every node.
#[test]
fn a_ranges_load_leaves_each_nodes_range_cached_on_that_node() {
    let n = 3_000u64;
    for (load, spread) in [("ranges", true), ("one", false)] {
        let d = deploy(DeployOptions {
            expected_keys: n,
            ..opts(
                3,
                3,
                &[("load", load), ("alloc", "local"), ("cache_pages", "1024")],
            )
        });
        // Ascending key order, as the harness loads; several chunks, so
        // the range cut must hold across calls.
        let pairs: Vec<(u64, Vec<u8>)> = (0..n).map(|k| (k, make_value(k, 1, 100))).collect();
        for chunk in pairs.chunks(700) {
            block_on(d.engine.load(&d.endpoint(0), chunk)).unwrap();
        }
        let cached: Vec<usize> = nodes_of(&d)
            .iter()
            .map(|node| node.cfg.pages - node.free_slots())
            .collect();
        let total: usize = cached.iter().sum();
        if spread {
            // 3000 pairs of 100 bytes fill ~100 leaves: each node caches
            // at least a quarter of the pages (its third of the leaves).
            for (i, c) in cached.iter().enumerate() {
                assert!(
                    c * 4 >= total,
                    "{load}: node {i} caches {c} of {total} pages"
                );
            }
        } else {
            assert!(
                cached[1] + cached[2] <= 2,
                "{load}: nodes 1 and 2 cache {cached:?} pages after a load through node 0"
            );
        }
        // Every key from every node.
        for t in 0..3 {
            let (_ep, store) = d.client(t).unwrap();
            block_on(async {
                for k in 0..n {
                    let v = store
                        .get(k)
                        .await
                        .unwrap()
                        .unwrap_or_else(|| panic!("{load}: key {k} missing from node {t}"));
                    assert_eq!(check_value(k, &v), Ok(1), "{load}: key {k} from node {t}");
                }
            });
        }
    }
}

/// Invariant 19 on the local transport: a worker reading a page its own
/// node directs from that node's SSD does so without the page's entry
/// mutex (the entry is marked `reading`). Node 0's read of such a page is
/// held by a slow device (the page file's read hook, until the test lets
/// it go); meanwhile node 1 asks node 0 for the page: node 0's one handler
/// thread holds the request at the directory (`parked_directory`) and goes
/// on, answering an allocation from node 2 while the read is still held.
/// Before, the worker read under the mutex: the handler thread blocked on
/// it for the whole read, so nothing was held and the allocation was not
/// answered until the read ended. Both increments are in the page.
#[test]
fn a_handler_is_not_blocked_by_its_nodes_worker_reading_from_the_ssd() {
    use dmkv_scalestore::msg::{Reply, Request};
    use dmkv_scalestore::provider::Provider;
    use std::sync::mpsc;
    use std::time::{Duration, Instant};
    let d = deploy(untimed(opts(3, 3, &[("alloc", "local")])));
    let nodes = nodes_of(&d);
    let node = |i: u8| nodes.iter().find(|n| n.index == i).unwrap().clone();
    let (n0, n1, n2) = (node(0), node(1), node(2));
    let worker =
        |n: &Arc<ScaleNode>| Worker::new(n.clone(), Rc::new(n.fabric.endpoint(n.id).unwrap()));
    let increment = |n: &Arc<ScaleNode>, pid: Pid| {
        let w = worker(n);
        block_on(async {
            let g = ExclusiveGuard::fix(&w, pid).await.unwrap();
            let p = g.page();
            p.set_word(0, p.word(0).unwrap() + 1);
            drop(g);
            w.settle_acks().await.unwrap();
        })
    };
    // A page node 0 directs, word 0 = 1, only on node 0's SSD.
    let w0 = worker(&n0);
    let pid = block_on(async {
        let g = ExclusiveGuard::allocate(&w0).await.unwrap();
        g.page().set_word(0, 1);
        g.pid()
    });
    assert_eq!(pid.shard(), 0);
    let ep0 = n0.fabric.endpoint(n0.id).unwrap();
    let held = block_on(Provider::new().evict_everything(&n0, &ep0, |p| p == pid)).unwrap();
    assert_eq!(held, 0, "node 0 evicted the page");
    // Node 0's next read of the page waits until the test lets it go.
    let (started_tx, started_rx) = mpsc::channel::<()>();
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let gate = std::sync::Mutex::new(Some((started_tx, go_rx)));
    let slot = pid.slot();
    let shard0 = n0.shard(0).unwrap();
    let file = &shard0.file;
    file.set_read_hook(Some(Arc::new(move |s| {
        if s != slot {
            return;
        }
        let g = gate.lock().unwrap().take();
        if let Some((started, go)) = g {
            started.send(()).unwrap();
            let _ = go.recv();
        }
    })));
    let parked = || n0.stats.parked_directory.load(Ordering::Relaxed);
    let parked_before = parked();
    let wait = Duration::from_secs(5);
    let (held_request, answered) = std::thread::scope(|s| {
        let a = s.spawn(|| increment(&n0, pid));
        started_rx
            .recv_timeout(Duration::from_secs(60))
            .expect("node 0's worker reads the page from its SSD");
        let b = s.spawn(|| increment(&n1, pid));
        let t = Instant::now();
        while parked() == parked_before && t.elapsed() < wait {
            std::thread::sleep(Duration::from_millis(1));
        }
        let held_request = parked() > parked_before;
        let (tx, rx) = mpsc::channel();
        let n2 = n2.clone();
        s.spawn(move || {
            let ep = n2.fabric.endpoint(n2.id).unwrap();
            let m0 = n2.member(0).unwrap();
            let _ = tx.send(block_on(ep.call(
                m0.node,
                m0.service,
                Request::Alloc.encode(),
            )));
        });
        let answered = rx.recv_timeout(wait);
        // Let the read end whatever happened, so that nothing hangs.
        go_tx.send(()).unwrap();
        a.join().unwrap();
        b.join().unwrap();
        (held_request, answered)
    });
    file.set_read_hook(None);
    assert!(
        held_request,
        "node 1's request for the page was not held at node 0's directory while \
         node 0's worker read it: the handler thread waited for the read"
    );
    let r = answered.expect(
        "node 0's handler did not answer an allocation while its worker read a page \
         from the SSD: its one thread was blocked",
    );
    assert!(matches!(
        Reply::decode(&r.unwrap()),
        Ok(Reply::Allocated(..))
    ));
    let w2 = worker(&n2);
    let back = block_on(async {
        SharedGuard::fix(&w2, pid)
            .await
            .unwrap()
            .page()
            .word(0)
            .unwrap()
    });
    assert_eq!(back, 3, "both increments are in the page");
}

/// A worker of `n` with an endpoint of its own.
fn worker_on(n: &Arc<ScaleNode>) -> Worker {
    Worker::new(n.clone(), Rc::new(n.fabric.endpoint(n.id).unwrap()))
}

/// Word 0 of `pid`, fixed shared by a new worker of `n`.
fn read_word(n: &Arc<ScaleNode>, pid: Pid) -> u64 {
    let w = worker_on(n);
    block_on(async {
        SharedGuard::fix(&w, pid)
            .await
            .unwrap()
            .page()
            .word(0)
            .unwrap()
    })
}

/// Adds 1 to word 0 of `pid`, fixed exclusive by a new worker of `n`, and
/// waits until the worker's acknowledgements are settled.
fn increment_word(n: &Arc<ScaleNode>, pid: Pid) {
    let w = worker_on(n);
    block_on(async {
        let g = ExclusiveGuard::fix(&w, pid).await.unwrap();
        let pg = g.page();
        pg.set_word(0, pg.word(0).unwrap() + 1);
        drop(g);
        w.settle_acks().await.unwrap();
    })
}

/// Pages node 0 directs and holds (exclusive, dirty), word 0 = `values`.
fn pages_on_node0(n0: &Arc<ScaleNode>, values: &[u64]) -> Vec<Pid> {
    let w0 = worker_on(n0);
    values
        .iter()
        .map(|&v| {
            block_on(async {
                let g = ExclusiveGuard::allocate(&w0).await.unwrap();
                g.page().set_word(0, v);
                assert_eq!(g.pid().shard(), 0);
                g.pid()
            })
        })
        .collect()
}

/// A deployment, its three nodes and pages.
type NodesAndPages = (LocalDeployment, [Arc<ScaleNode>; 3], Vec<Pid>);

/// Three nodes on the local transport (one handler thread each,
/// allocations local), with pages node 0 directs and holds, word 0 =
/// `values` (see [`pages_on_node0`]).
fn three_nodes_with_pages_on_node0(values: &[u64]) -> NodesAndPages {
    let d = deploy(untimed(opts(3, 3, &[("alloc", "local")])));
    let nodes = nodes_of(&d);
    let node = |i: u8| nodes.iter().find(|n| n.index == i).unwrap().clone();
    let n = [node(0), node(1), node(2)];
    let pages = pages_on_node0(&n[0], values);
    (d, n, pages)
}

/// Waits up to 60 s for `cond`.
fn wait_for(mut cond: impl FnMut() -> bool) -> bool {
    let t = std::time::Instant::now();
    while !cond() {
        if t.elapsed() > std::time::Duration::from_secs(60) {
            return false;
        }
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    true
}

/// Invariant 20 on the real backends (branch i42): the SSD completer posts
/// an eviction pull's one-sided READ and goes on with its other work. Node
/// 1 evicts the only (dirty) copy of page P that node 0 directs; node 0's
/// completer posts the pull's READ, which a test gate on node 0
/// (`NetGate`, a slow network: the verb waits without blocking the
/// completer's thread) holds. Meanwhile node 2 reads page Q, only on node
/// 0's SSD: the completer reads Q, delivers it and answers while the
/// pull's READ is still outstanding. Before, the completer's thread waited
/// for the pull's round trip (`exec::block_on`): with the same gate in
/// that wait (checked by patching the pull back to it), Q's read was not
/// finished within 5 s. Then the gate opens, the eviction is accepted
/// (node 0 pulled P) and P reads back with node 1's update.
#[test]
fn the_completer_finishes_an_ssd_read_while_a_pulls_read_is_outstanding() {
    use dmkv_scalestore::provider::Provider;
    use dmkv_scalestore::ssdio::{NetGate, NetKind};
    use std::sync::mpsc;
    use std::time::Duration;
    let (_d, [n0, n1, n2], pq) = three_nodes_with_pages_on_node0(&[7, 9]);
    let (p, q) = (pq[0], pq[1]);
    // P: node 1 holds its only copy, dirty, word 0 = 42.
    let w1 = worker_on(&n1);
    block_on(async {
        let g = ExclusiveGuard::fix(&w1, p).await.unwrap();
        g.page().set_word(0, 42);
        drop(g);
        w1.settle_acks().await.unwrap();
    });
    // Q: only on node 0's SSD.
    let ep0 = n0.fabric.endpoint(n0.id).unwrap();
    let held = block_on(Provider::new().evict_everything(&n0, &ep0, |x| x == q)).unwrap();
    assert_eq!(held, 0, "node 0 evicted Q");
    let gate = NetGate::new(&[NetKind::Pull], 1);
    n0.set_net_gate(Some(gate.clone()));
    let pulled = n0.stats.pulled.load(Ordering::Relaxed);
    let (posted, got, still_out, evicted) = std::thread::scope(|s| {
        let evicter = s.spawn(|| {
            let ep1 = n1.fabric.endpoint(n1.id).unwrap();
            block_on(Provider::new().evict_everything(&n1, &ep1, |x| x == p)).unwrap()
        });
        let posted = wait_for(|| gate.held() == 1);
        let (tx, rx) = mpsc::channel();
        let n2c = n2.clone();
        s.spawn(move || {
            let _ = tx.send(read_word(&n2c, q));
        });
        let got = rx.recv_timeout(Duration::from_secs(5));
        let still_out = gate.held();
        // Let the pull go whatever happened, so that nothing hangs.
        gate.open();
        (posted, got, still_out, evicter.join().unwrap())
    });
    n0.set_net_gate(None);
    assert!(posted, "node 0's completer never posted the pull's read");
    assert_eq!(
        got,
        Ok(9),
        "node 0's completer did not finish a read from its SSD while an eviction \
         pull's read was outstanding: it waited for the pull"
    );
    assert_eq!(still_out, 1, "the pull's read was outstanding throughout");
    assert_eq!(evicted, 0, "node 1 evicted P");
    assert_eq!(n0.stats.pulled.load(Ordering::Relaxed) - pulled, 1);
    assert_eq!(read_word(&n2, p), 42, "P has node 1's update");
}

/// Invariant 22 (branch i42): a directory's page delivery from its own
/// copy is posted to its node's completer, the entry marked `delivering`.
/// Node 0 directs and holds pages P and Q; node 1 asks for P exclusively,
/// and node 0's handler grants it from its own copy: a test gate on node 0
/// (`NetGate`) holds that one WRITE. While it is outstanding, node 0's one
/// handler thread serves node 2's request for Q (its delivery passes the
/// gate), and node 2's request for P is held at node 0's directory
/// (`parked_directory`), unanswered. Once the gate opens node 1's
/// increment completes and node 2's read of P, answered after it, sees it.
/// Before, the handler wrote the page under the entry's mutex and waited
/// (`block_on_network`): with the same gate in that wait (checked by
/// patching `posts_deliveries` to false and the gate into `deliver`), Q
/// was not served within 5 s.
#[test]
fn a_delivery_in_flight_holds_its_page_and_not_the_handler() {
    use dmkv_scalestore::ssdio::{NetGate, NetKind};
    use std::sync::mpsc;
    use std::time::Duration;
    let (_d, [n0, n1, n2], pq) = three_nodes_with_pages_on_node0(&[1, 5]);
    let (p, q) = (pq[0], pq[1]);
    let gate = NetGate::new(&[NetKind::Deliver], 1);
    n0.set_net_gate(Some(gate.clone()));
    let parked = || n0.stats.parked_directory.load(Ordering::Relaxed);
    let parked_before = parked();
    let out = std::thread::scope(|s| {
        let a = s.spawn(|| increment_word(&n1, p));
        let posted = wait_for(|| gate.held() == 1);
        // Another page of node 0: served while P's write is outstanding.
        let (tx, rx) = mpsc::channel();
        let n2c = n2.clone();
        s.spawn(move || {
            let _ = tx.send(read_word(&n2c, q));
        });
        let got_q = rx.recv_timeout(Duration::from_secs(5));
        // The same page: held at the directory, not answered yet.
        let (tx, rx_p) = mpsc::channel();
        let n2c = n2.clone();
        s.spawn(move || {
            let _ = tx.send(read_word(&n2c, p));
        });
        let t = std::time::Instant::now();
        while parked() == parked_before && t.elapsed() < Duration::from_secs(5) {
            std::thread::sleep(Duration::from_millis(1));
        }
        let held_p = parked() > parked_before;
        let early = rx_p.try_recv().ok();
        let still_out = gate.held();
        gate.open();
        a.join().unwrap();
        let p_after = rx_p.recv_timeout(Duration::from_secs(60));
        (posted, got_q, held_p, early, still_out, p_after)
    });
    n0.set_net_gate(None);
    let (posted, got_q, held_p, early, still_out, p_after) = out;
    assert!(posted, "node 0 never posted the delivery of P");
    assert_eq!(
        got_q,
        Ok(5),
        "node 0's handler did not serve a request for another page while a \
         delivery's write was outstanding"
    );
    assert!(
        held_p,
        "node 2's request for P was not held at node 0's directory while P's \
         delivery was outstanding"
    );
    assert_eq!(
        early, None,
        "node 2's read of P was answered before P arrived"
    );
    assert_eq!(still_out, 1, "P's write was outstanding throughout");
    assert_eq!(
        p_after,
        Ok(2),
        "node 2's read of P, answered after the write, sees node 1's increment"
    );
    assert_eq!(read_word(&n0, p), 2);
}

/// Invariant 23 (branch i52): the real backends' completer, asleep while
/// an SSD read is in flight, is woken by a delivery a handler hands it and
/// posts it at once, not when the read completes. Node 0 directs pages P
/// and Q; Q is only on node 0's SSD. Node 2 reads Q: node 0's completer
/// submits Q's read to the ring, which a test hook holds (it reads a pipe
/// until released). The completer's longest sleep is raised to an hour,
/// so only a wake-up ends it before the read does. Node 1 then asks for P
/// exclusively: node 0's handler grants it from its own copy and hands the
/// WRITE to the completer, which must post it while Q's read is still
/// held: node 1's increment completes and node 2 has no answer for Q yet.
/// Then the read is released, Q arrives, and P reads back incremented.
/// Without the eventfd signal in `SsdQueue::enqueue` (checked by taking it
/// out) node 1's increment did not complete within 5 s. Before this branch
/// the completer polled its ring every 100 us instead of sleeping, so the
/// hand-off waited at most that long; there was no long sleep to end.
#[test]
fn a_delivery_wakes_the_completer_while_an_ssd_read_is_in_flight() {
    use dmkv_scalestore::provider::Provider;
    use std::sync::mpsc;
    use std::time::Duration;
    let (_d, [n0, n1, n2], pq) = three_nodes_with_pages_on_node0(&[1, 5]);
    let (p, q) = (pq[0], pq[1]);
    let ep0 = n0.fabric.endpoint(n0.id).unwrap();
    let held = block_on(Provider::new().evict_everything(&n0, &ep0, |x| x == q)).unwrap();
    assert_eq!(held, 0, "node 0 evicted Q");
    let shard0 = n0.shard(q.shard()).unwrap();
    let Some(hold) = shard0.file.hold_next_ring_read().unwrap() else {
        eprintln!("skipped: no io_uring read ring here (the completer reads synchronously)");
        return;
    };
    n0.ssd_jobs.set_read_wait(Duration::from_secs(3600));
    let out = std::thread::scope(|s| {
        let (tx_q, rx_q) = mpsc::channel();
        let n2c = n2.clone();
        s.spawn(move || {
            let _ = tx_q.send(read_word(&n2c, q));
        });
        let submitted = wait_for(|| hold.submitted());
        let (tx_p, rx_p) = mpsc::channel();
        let n1c = n1.clone();
        s.spawn(move || {
            increment_word(&n1c, p);
            let _ = tx_p.send(());
        });
        let got_p = rx_p.recv_timeout(Duration::from_secs(5));
        let early_q = rx_q.try_recv().ok();
        // Let the read complete whatever happened, so that nothing hangs.
        hold.release();
        let got_q = rx_q.recv_timeout(Duration::from_secs(60));
        if got_p.is_err() {
            let _ = rx_p.recv_timeout(Duration::from_secs(60));
        }
        (submitted, got_p, early_q, got_q)
    });
    n0.ssd_jobs.set_read_wait(Duration::ZERO);
    let (submitted, got_p, early_q, got_q) = out;
    assert!(submitted, "node 0's completer never submitted Q's read");
    assert_eq!(
        got_p,
        Ok(()),
        "node 0's completer did not post a delivery handed to it while an SSD \
         read was in flight: it slept until the read completed"
    );
    assert_eq!(early_q, None, "Q was answered while its read was held");
    assert_eq!(got_q, Ok(5), "Q's read, released, delivers Q");
    assert_eq!(read_word(&n2, p), 2, "P has node 1's increment");
}
