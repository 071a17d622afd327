//! Retraining on the memory node's handler cores (branch i93,
//! `xstore.retrain_share_handlers`; docs/xstore.md, "Retraining on the
//! handler cores"): on a simulated cluster, inserts that split leaves
//! queue retrainings; with the knob on their CPU passes on the node's
//! handler cores, in turns with the RPCs, not on a worker core of its
//! own. Checked to fail without the progress point at a retraining's end
//! (`Server::pace_retrain` doing nothing): the two runs are then the same
//! run, worker and handler busy times equal.

use dmkv_api::payload::make_value;
use dmkv_testkit::declared::deploy_on_sim;
use dmkv_testkit::oracle::spread_key;
use dmkv_transport::exec::block_on;
use dmkv_transport::sim::Profile;

/// Loads 2,000 keys on one memory node (N = 4), inserts 2,000 more by RPC
/// and settles; returns the node's worker cores' and handler cores' busy
/// time and the retrainings run.
fn run(share: &str) -> (u64, u64, u64) {
    let d = deploy_on_sim(
        &dmkv_xstore::SPEC,
        1,
        &[("slots", "4"), ("retrain_share_handlers", share)],
        Profile::load("rolex-cx5").unwrap(),
    );
    let ep = d.endpoint(0);
    let pairs: Vec<(u64, Vec<u8>)> = (0..2_000)
        .map(|i| spread_key(2 * i))
        .map(|k| (k, make_value(k, 0, 8)))
        .collect();
    block_on(d.engine.load(&ep, &pairs)).unwrap();
    block_on(d.engine.settle(&ep)).unwrap();
    let (_ep, store) = d.client(0).unwrap();
    for i in 0..2_000 {
        let k = spread_key(2 * i + 1);
        block_on(store.insert(k, &make_value(k, 0, 8))).unwrap();
    }
    block_on(d.engine.settle(&ep)).unwrap();
    let stats = block_on(d.engine.stats(&ep)).unwrap();
    let retrains = stats["partitions"][0]["retrains"]
        .as_u64()
        .expect("retrains");
    let busy = |what: &str| {
        d.sim
            .resources()
            .iter()
            .filter(|r| r.name.ends_with(what))
            .map(|r| r.busy_ns)
            .sum::<u64>()
    };
    (
        busy("xstore-p0 worker cores"),
        busy("node0 handler cores"),
        retrains,
    )
}

#[test]
fn retraining_takes_turns_with_the_rpcs_on_the_handler_cores() {
    let (worker_off, handler_off, retrains_off) = run("off");
    let (worker_on, handler_on, retrains_on) = run("on");
    assert!(
        retrains_off > 0 && retrains_on > 0,
        "{retrains_off}, {retrains_on} retrainings"
    );
    // Off: the retrainings ran on the worker core (beside the load's full
    // training, which stays there either way).
    assert!(
        worker_on < worker_off,
        "the retrainings left the worker core: {worker_on} against {worker_off} ns"
    );
    assert!(
        handler_on > handler_off,
        "the handler cores took their CPU: {handler_on} against {handler_off} ns"
    );
    // What the worker core lost the handler cores gained, give or take the
    // runs' different retrainings (the interleaving moves with the turns).
    let moved = worker_off - worker_on;
    let gained = handler_on - handler_off;
    assert!(
        gained * 2 > moved && gained < moved * 2,
        "moved {moved} ns, gained {gained} ns"
    );
}
