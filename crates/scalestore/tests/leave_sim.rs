//! Overlapping leaves on the simulated cluster (§6.6; invariants 10 and 13
//! of `docs/scalestore.md`): a leave is an asynchronous task there
//! (`ScaleNode::leave_async`, spawned by `exec::spawn_background_local`),
//! so two leaves interleave in virtual time instead of one waiting inside
//! the other's wait on the simulator's one thread, which never ended
//! before (`scalestore.leave=0@1500,2@1600`, seed 100).

mod common;

use common::{Cluster, nodes_of};
use dmkv_api::payload::{check_value, make_value};
use dmkv_api::sim_deploy::SimDeployment;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks, yield_now};
use std::collections::BTreeMap;

const THREADS: usize = 3;
const TASKS: usize = 2;
const KEYS_PER_TASK: u64 = 40;
const ROUNDS: u32 = 5;
const VALUE_SIZE: usize = 100;

fn deploy(protocol: &str, leave: &str, seed: u64) -> SimDeployment {
    // 64 pages a node: evictions and page moves happen during the leaves.
    let knobs = [
        ("protocol", protocol),
        ("leave", leave),
        ("cache_pages", "64"),
    ];
    Cluster {
        threads: THREADS,
        cache_mb: None,
        knobs: &knobs,
        // Seeded jitter: each seed another interleaving.
        jitter_ns: 500,
        ..Cluster::new(3, seed)
    }
    .deploy()
}

fn key(t: usize, j: usize, i: u64) -> u64 {
    ((t * TASKS + j) as u64) << 32 | i
}

/// What one run ends with, for comparing two runs of one seed.
#[derive(Debug, PartialEq)]
struct Outcome {
    virtual_ns: u64,
    events: Vec<String>,
    messages: serde_json::Value,
}

/// Every client of every node upserts its keys round after round (each
/// write read back at once) while the two leaves of `leave` happen; then
/// both leaves are done, node 1 alone hosts every shard and the leavers
/// cache nothing, and every key has its last value, read by every client
/// (those of nodes 0 and 2 through node 1) and by a full scan.
fn two_leaves(protocol: &str, leave: &str, seed: u64) -> Outcome {
    let d = deploy(protocol, leave, seed);
    let ctx = format!("{protocol} {leave} seed {seed}");
    let clients: Vec<_> = (0..THREADS).map(|t| d.client(t).unwrap().1).collect();
    let tasks: Vec<LocalTask<'_, ()>> = (0..THREADS)
        .flat_map(|t| (0..TASKS).map(move |j| (t, j)))
        .map(|(t, j)| {
            let store = clients[t].clone();
            let ctx = &ctx;
            Box::pin(async move {
                for round in 1..=ROUNDS {
                    for i in 0..KEYS_PER_TASK {
                        let k = key(t, j, i);
                        store
                            .upsert(k, &make_value(k, round, VALUE_SIZE))
                            .await
                            .unwrap_or_else(|e| panic!("{ctx}: upsert {k:#x}: {e}"));
                        let v = store
                            .get(k)
                            .await
                            .unwrap_or_else(|e| panic!("{ctx}: get {k:#x}: {e}"))
                            .unwrap_or_else(|| panic!("{ctx}: {k:#x} just written, missing"));
                        assert_eq!(check_value(k, &v), Ok(round), "{ctx}: key {k:#x}");
                        // An operation on a page in the node's cache never
                        // waits: let the other tasks (the leaves among
                        // them) run between operations, as a compute
                        // thread's CPU time would.
                        yield_now().await;
                    }
                }
            }) as LocalTask<'_, ()>
        })
        .collect();
    run_tasks(tasks);
    block_on(d.engine.settle(&d.endpoint(0))).unwrap_or_else(|e| panic!("{ctx}: {e}"));
    let st = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
    let events: Vec<String> = serde_json::from_value(st["membership_events"].clone()).unwrap();
    for n in [0, 2] {
        assert!(
            events
                .iter()
                .any(|e| e.starts_with(&format!("node {n} left at op"))),
            "{ctx}: {events:?}"
        );
    }
    let states: Vec<&str> = st["per_node"]
        .as_array()
        .unwrap()
        .iter()
        .map(|n| n["state"].as_str().unwrap())
        .collect();
    assert_eq!(states, ["left", "active", "left"], "{ctx}: {st}");
    // The survivor hosts every shard; the leavers host none and cache
    // nothing (invariant 10: holders are never departed nodes).
    let nodes = nodes_of(&d);
    let mut hosted: Vec<u8> = nodes[1].shard_list().iter().map(|(s, _)| *s).collect();
    hosted.sort_unstable();
    assert_eq!(hosted, [0, 1, 2], "{ctx}");
    for s in 0..3u8 {
        assert_eq!(nodes[1].host_of(s), Some(1), "{ctx}: shard {s}");
    }
    for n in [0, 2] {
        assert!(nodes[n].shard_list().is_empty(), "{ctx}: node {n} hosts");
        assert_eq!(
            nodes[n].free_slots(),
            nodes[n].cfg.pages,
            "{ctx}: node {n} still caches pages"
        );
    }
    // The oracle: every key's last round, from every client.
    let oracle: BTreeMap<u64, u32> = (0..THREADS)
        .flat_map(|t| (0..TASKS).map(move |j| (t, j)))
        .flat_map(|(t, j)| (0..KEYS_PER_TASK).map(move |i| (key(t, j, i), ROUNDS)))
        .collect();
    for (t, store) in clients.iter().enumerate() {
        block_on(async {
            for (&k, &round) in &oracle {
                let v = store
                    .get(k)
                    .await
                    .unwrap_or_else(|e| panic!("{ctx}: client {t}: {k:#x}: {e}"))
                    .unwrap_or_else(|| panic!("{ctx}: client {t}: {k:#x} lost"));
                assert_eq!(check_value(k, &v), Ok(round), "{ctx}: client {t}: {k:#x}");
            }
            let all = store.scan(0, 10_000).await.unwrap();
            let keys: Vec<u64> = all.iter().map(|(k, _)| *k).collect();
            assert_eq!(
                keys,
                oracle.keys().copied().collect::<Vec<_>>(),
                "{ctx}: client {t}: scan"
            );
        });
    }
    eprintln!("{ctx}: {events:?} at {} ns", d.sim.now_ns());
    Outcome {
        virtual_ns: d.sim.now_ns(),
        events,
        messages: st["messages"].clone(),
    }
}

/// Two leaves a few operations apart and two at the same count, chaining
/// and FIFO, over seeds: nothing lost, both leaves done.
#[test]
fn two_overlapping_leaves_keep_every_value_on_sim() {
    for protocol in ["chaining", "fifo"] {
        for leave in ["0@700,2@800", "0@700,2@700"] {
            for seed in 1..=3 {
                two_leaves(protocol, leave, seed);
            }
        }
    }
}

/// The same seed replays the same run: virtual time, membership events
/// (with each leave's duration) and message counts.
#[test]
fn two_overlapping_leaves_replay_by_seed() {
    let a = two_leaves("chaining", "0@700,2@750", 9);
    let b = two_leaves("chaining", "0@700,2@750", 9);
    assert_eq!(a, b);
}
