//! The per-operation wait trace (`trace`, docs/scalestore.md "Tracing an
//! operation's waits") is a debugging aid: switched on, it must not change
//! a simulated run (invariant 1 of `trace.rs`), and it must account for
//! the run's operations with causes that never exceed their latency.
//!
//! One test in this file only: the switch is per process.

mod common;

use common::Cluster;
use dmkv_api::payload::{check_value, make_value};
use dmkv_scalestore::trace;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};

const THREADS: usize = 3;
const TASKS: usize = 2;
const KEYS_PER_TASK: u64 = 60;
const ROUNDS: u32 = 3;
const VALUE_SIZE: usize = 100;

/// Three nodes with 64-page caches (evictions and page moves happen);
/// every task upserts and reads back its keys, round after round, then
/// reads its neighbour's. Returns the virtual end time, the engine's
/// stats, and the number of client operations run.
fn run(seed: u64) -> (u64, serde_json::Value, u64) {
    let d = Cluster {
        threads: THREADS,
        cache_mb: None,
        knobs: &[("cache_pages", "64")],
        jitter_ns: 500,
        ..Cluster::new(3, seed)
    }
    .deploy();
    let clients: Vec<_> = (0..THREADS).map(|t| d.client(t).unwrap().1).collect();
    let key = |t: usize, j: usize, i: u64| ((t * TASKS + j) as u64) << 32 | i;
    let tasks: Vec<LocalTask<'_, ()>> = (0..THREADS)
        .flat_map(|t| (0..TASKS).map(move |j| (t, j)))
        .map(|(t, j)| {
            let store = clients[t].clone();
            Box::pin(async move {
                for round in 1..=ROUNDS {
                    for i in 0..KEYS_PER_TASK {
                        let k = key(t, j, i);
                        store
                            .upsert(k, &make_value(k, round, VALUE_SIZE))
                            .await
                            .unwrap();
                        let v = store.get(k).await.unwrap().expect("just written");
                        assert_eq!(check_value(k, &v), Ok(round));
                    }
                }
                let (t2, j2) = ((t + 1) % THREADS, j);
                for i in 0..KEYS_PER_TASK {
                    // Written by another task: present, with some round.
                    let k = key(t2, j2, i);
                    if let Some(v) = store.get(k).await.unwrap() {
                        assert!(check_value(k, &v).is_ok());
                    }
                }
            }) as LocalTask<'_, ()>
        })
        .collect();
    run_tasks(tasks);
    block_on(d.engine.settle(&d.endpoint(0))).unwrap();
    let st = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
    let ops = (THREADS * TASKS) as u64 * KEYS_PER_TASK * (2 * ROUNDS as u64 + 1);
    (d.sim.now_ns(), st, ops)
}

#[test]
fn tracing_leaves_a_simulated_run_unchanged() {
    trace::set_enabled(false);
    let (t_off, mut st_off, ops) = run(5);
    assert!(
        st_off.get("op_trace").is_none(),
        "off by default: no report"
    );
    trace::set_enabled(true);
    let (t_on, mut st_on, _) = run(5);
    trace::set_enabled(false);
    let tr = st_on
        .as_object_mut()
        .unwrap()
        .remove("op_trace")
        .expect("a traced run reports op_trace");
    // Same virtual end time and the same engine figures (messages,
    // evictions, restarts, latch waits, per node).
    assert_eq!(t_off, t_on, "virtual time moved");
    st_off.as_object_mut().unwrap().remove("op_trace");
    assert_eq!(st_off, st_on);
    // Every client operation recorded, and its causes within its latency.
    assert_eq!(tr["ops"].as_u64(), Some(ops), "{tr}");
    for part in ["all", "tail_p99"] {
        let by = tr[part]["by_cause"].as_object().unwrap();
        let share: f64 = by.values().map(|c| c["share"].as_f64().unwrap()).sum();
        assert!(
            (share - 1.0).abs() < 0.01,
            "{part}: shares sum to {share}: {tr}"
        );
        for (name, c) in by {
            assert!(c["share"].as_f64().unwrap() >= 0.0, "{part} {name}: {tr}");
        }
    }
    // This run moves pages between nodes: some waits were protocol
    // messages, and the tail is no faster than the median.
    let by = tr["all"]["by_cause"].as_object().unwrap();
    assert!(
        by.keys().any(|k| k.starts_with("own_")),
        "no ownership request traced: {tr}"
    );
    assert!(tr["p99_us"].as_f64().unwrap() >= tr["p50_us"].as_f64().unwrap());
    assert_eq!(
        tr["tail_starts_by_tenth_of_run"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap())
            .sum::<u64>(),
        tr["tail_p99"]["ops"].as_u64().unwrap()
    );
}
