//! A retraining publishes after its CPU (branch i98; docs/xstore.md,
//! invariant 9) and an expansion takes turns on the handler cores
//! (`xstore.retrain_share_handlers`), on a simulated cluster.
//!
//! - `a_get_during_the_retraining_sees_the_old_model`: a split queues the
//!   retraining of its sub-model; GETs while its CPU passes still find the
//!   old model (a fallback on the split leaf, whose reply hands back the
//!   old sub-model, so the next GET falls back again); after it, one
//!   fallback fetches the new model and the next GET needs none. Checked
//!   to fail with the old ordering (the sub-model published at the job's
//!   start instant, its CPU passing after: `Server::retrain` with the
//!   pace moved after the publication): the second GET then hits.
//! - `an_expansion_takes_turns_on_the_handler_cores`: with the knob on,
//!   the CPU of an expansion (a full training) passes on the handler
//!   cores, not on the worker core. Checked to fail without the progress
//!   points (`Pacer::point`/`finish` doing nothing): the worker core then
//!   holds the expansion's CPU.
//! - `a_load_during_an_expansion_is_taken_over_by_the_running_job`: bulk
//!   loads while inserts expand the model; the after-load training asked
//!   for during a paced expansion is run by the running job when it ends
//!   (`full_job`'s loop), not by a second job. Checked to hang with a
//!   second job that waits on the first (the code before: the second
//!   job's lock blocked the simulation's one OS thread).

use dmkv_api::payload::make_value;
use dmkv_api::sim_deploy::SimDeployment;
use dmkv_testkit::declared::deploy_on_sim;
use dmkv_testkit::oracle::spread_key;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::sim::Profile;
use std::cell::{Cell, RefCell};
use std::time::Duration;

fn loaded(knobs: &[(&str, &str)], keys: u64) -> SimDeployment {
    let d = deploy_on_sim(
        &dmkv_xstore::SPEC,
        1,
        knobs,
        Profile::load("rolex-cx5").unwrap(),
    );
    let ep = d.endpoint(0);
    let pairs: Vec<(u64, Vec<u8>)> = (0..keys)
        .map(|i| spread_key(2 * i))
        .map(|k| (k, make_value(k, 0, 8)))
        .collect();
    block_on(d.engine.load(&ep, &pairs)).unwrap();
    block_on(d.engine.settle(&ep)).unwrap();
    d
}

fn counter(d: &SimDeployment, name: &str) -> u64 {
    d.engine
        .client_counters()
        .into_iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v)
        .expect("a client counter")
}

fn partition(d: &SimDeployment, field: &str) -> u64 {
    let stats = block_on(d.engine.stats(&d.endpoint(0))).unwrap();
    stats["partitions"][0][field]
        .as_u64()
        .unwrap_or_else(|| panic!("{field}"))
}

#[test]
fn a_get_during_the_retraining_sees_the_old_model() {
    // Two sub-models of 2,000 keys each: a retraining long enough (its
    // training alone is 340,000 declared instructions) for GETs meanwhile.
    let d = loaded(
        &[
            ("slots", "4"),
            ("submodels", "1"),
            ("expansion", "off"),
            ("speculation", "off"),
            ("retrain_share_handlers", "off"),
        ],
        4_000,
    );
    let (_ep, store) = d.client(0).unwrap();
    let k = spread_key(0);
    // A key the split moves to the new right sibling: its predicted leaf
    // (the split one) no longer holds it.
    let moved = spread_key(2);
    let get = || async {
        let before = counter(&d, "fallbacks");
        let v = store.get(moved).await.unwrap();
        assert_eq!(v.as_deref(), Some(&make_value(moved, 0, 8)[..]));
        counter(&d, "fallbacks") - before
    };
    assert_eq!(block_on(get()), 0, "the loaded model finds the key");
    // Bulk-loaded leaves are half full (2 of 4): the third key between
    // `k` and `moved` splits the first leaf, which holds both. One task
    // inserts them; another GETs once the split is in. The retraining's
    // CPU passes in a frame nested in the job's event: tasks keep being
    // polled there, but plain code between two `block_on`s would run only
    // once that frame unwinds, after the pace.
    let inserted = Cell::new(0);
    let during = RefCell::new(Vec::new());
    let insert = async {
        for j in 1..=3 {
            store.insert(k + j, &make_value(k + j, 0, 8)).await.unwrap();
            inserted.set(j);
        }
    };
    let read = async {
        // Two inserts in, the third on its way: a few round trips later
        // the split is in.
        while inserted.get() < 2 {
            dmkv_transport::exec::sleep(Duration::from_micros(1)).await;
        }
        dmkv_transport::exec::sleep(Duration::from_micros(50)).await;
        for _ in 0..2 {
            let fallbacks = get().await;
            during.borrow_mut().push(fallbacks);
        }
    };
    let splits = partition(&d, "splits_seen");
    run_tasks(vec![Box::pin(insert) as LocalTask<'_, ()>, Box::pin(read)]);
    assert_eq!(inserted.get(), 3);
    assert!(partition(&d, "splits_seen") > splits, "a leaf split");
    // While the retraining's CPU passed: the old model, twice (the
    // fallback handed it back: nothing was published yet).
    assert_eq!(
        *during.borrow(),
        vec![1, 1],
        "fallbacks per GET during the retraining"
    );
    block_on(d.engine.settle(&d.endpoint(0))).unwrap();
    assert!(partition(&d, "retrains") > 0, "retrained");
    // After it: one fallback fetches the new model, then none.
    assert!(block_on(get()) <= 1);
    assert_eq!(
        block_on(get()),
        0,
        "the new model names the split leaf afresh"
    );
}

/// Loads 2,000 keys (N = 4, 4 sub-models, expansion above 256 keys per
/// sub-model), inserts 2,000 more; returns the worker core's busy time over the inserts, the
/// full trainings' CPU over them and the expansions.
fn expand(share: &str) -> (u64, u64, u64) {
    let d = loaded(
        &[
            ("slots", "4"),
            ("submodels", "4"),
            ("keys_per_model", "256"),
            ("retrain_share_handlers", share),
        ],
        2_000,
    );
    let worker = |d: &SimDeployment| {
        d.sim
            .resources()
            .iter()
            .filter(|r| r.name.ends_with("xstore-p0 worker cores"))
            .map(|r| r.busy_ns)
            .sum::<u64>()
    };
    let (busy0, cpu0) = (worker(&d), partition(&d, "full_training_cpu_ns"));
    let (_ep, store) = d.client(0).unwrap();
    for i in 0..2_000 {
        let k = spread_key(2 * i + 1);
        block_on(store.insert(k, &make_value(k, 0, 8))).unwrap();
    }
    block_on(d.engine.settle(&d.endpoint(0))).unwrap();
    (
        worker(&d) - busy0,
        partition(&d, "full_training_cpu_ns") - cpu0,
        partition(&d, "expansions"),
    )
}

#[test]
fn an_expansion_takes_turns_on_the_handler_cores() {
    let (busy_off, cpu_off, exp_off) = expand("off");
    let (busy_on, cpu_on, exp_on) = expand("on");
    assert!(exp_off > 0 && exp_on > 0, "{exp_off}, {exp_on} expansions");
    // Off: the expansions' CPU holds the worker core.
    assert!(busy_off >= cpu_off, "{busy_off} against {cpu_off} ns");
    // On: it passed on the handler cores; the worker core keeps the jobs'
    // base cost and what a retraining or expansion runs after its last
    // progress point (its publication).
    assert!(
        busy_on * 4 < cpu_on,
        "the worker core held {busy_on} ns of {cpu_on} ns of expansion CPU"
    );
}

#[test]
fn a_load_during_an_expansion_is_taken_over_by_the_running_job() {
    let d = loaded(
        &[
            ("slots", "4"),
            ("submodels", "4"),
            ("keys_per_model", "256"),
            ("retrain_share_handlers", "on"),
        ],
        2_000,
    );
    let ep = d.endpoint(0);
    let (_ep, store) = d.client(0).unwrap();
    let inserting = Cell::new(true);
    let loaded_keys = RefCell::new(Vec::new());
    let insert = async {
        for i in 0..2_000 {
            let k = spread_key(2 * i + 1);
            store.insert(k, &make_value(k, 0, 8)).await.unwrap();
        }
        inserting.set(false);
    };
    // A one-key bulk load every 200 µs of virtual time while the inserts
    // run, each followed by an insert (a write asks for the after-load
    // training); some land while an expansion paces on the handler core.
    let load = async {
        let mut j = 0u64;
        while inserting.get() {
            dmkv_transport::exec::sleep(Duration::from_micros(200)).await;
            let k = spread_key(10_000 + 2 * j);
            d.engine
                .load(&ep, &[(k, make_value(k, 1, 8))])
                .await
                .unwrap();
            let w = spread_key(10_001 + 2 * j);
            store.insert(w, &make_value(w, 1, 8)).await.unwrap();
            loaded_keys.borrow_mut().extend([k, w]);
            j += 1;
        }
    };
    run_tasks(vec![Box::pin(insert) as LocalTask<'_, ()>, Box::pin(load)]);
    block_on(d.engine.settle(&ep)).unwrap();
    assert!(partition(&d, "expansions") > 0, "the inserts expanded");
    assert!(
        partition(&d, "full_asked_while_running") > 0,
        "no full training was asked for while one ran"
    );
    // Nothing lost: every key of the run and of the loads reads back.
    let check = |k: u64, version: u32| {
        let v = block_on(store.get(k)).unwrap();
        assert_eq!(v.as_deref(), Some(&make_value(k, version, 8)[..]), "{k:#x}");
    };
    for i in 0..2_000 {
        check(spread_key(2 * i), 0);
        check(spread_key(2 * i + 1), 0);
    }
    let extra = loaded_keys.borrow();
    assert!(!extra.is_empty());
    for &k in extra.iter() {
        check(k, 1);
    }
}
