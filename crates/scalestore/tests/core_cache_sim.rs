//! ScaleStore's stores into its page frames are seen by the simulated
//! memory-node cores' private caches (docs/simulation.md, "A private cache
//! per core (branch i69)"; docs/scalestore.md invariant 24): a handler core
//! that copied a page for a delivery and copies it again after a worker of
//! its node changed the page pays for the changed lines again, instead of
//! pricing its stale copy as private hits. Every store ScaleStore makes
//! into a frame goes through `RegionMem::write`/`store_u64` (`PageRef`),
//! which report it (`sim::touch_write`); a store through `RegionMem::word`
//! or `words_in` references would not be reported, the second copy would
//! hit every line, and `a_workers_store_makes_the_handler_copy_miss` fails.

mod common;

use common::{Cluster, allocate, nodes_of, read_shared, worker};
use dmkv_api::sim_deploy::SimDeployment;
use dmkv_scalestore::guard::ExclusiveGuard;
use dmkv_transport::exec::block_on;

/// Node `node`'s handler cores' private (hits, misses) so far.
fn private(d: &SimDeployment, node: u16) -> (u64, u64) {
    let count = |what: &str| -> u64 {
        d.sim
            .resources()
            .iter()
            .filter(|r| r.name == format!("node{node} handler cores private {what}"))
            .map(|r| r.count)
            .sum()
    };
    (count("hits"), count("misses"))
}

/// Node 1 fixes (shared) a page node 0 allocated and directs, twice; in
/// between node 0's worker fixes it exclusively (which takes node 1's copy
/// away, so the second fix asks node 0 again) and, if `store`, stores
/// words 0 and 100 (two different lines). Node 0 has one handler core, so
/// both copies run on it. Returns its private (hits, misses) during the
/// second fix.
fn second_copy(store: bool) -> (u64, u64) {
    let d = Cluster::new(2, 5).deploy();
    let nodes = nodes_of(&d);
    let id0 = nodes[0].id.0;
    let (w0, w1) = (worker(&nodes[0]), worker(&nodes[1]));
    let pid = allocate(&w0, 11);
    assert_eq!(pid.shard(), 0);
    assert_eq!(read_shared(&w1, pid), 11);
    block_on(async {
        let g = ExclusiveGuard::fix(&w0, pid).await.unwrap();
        if store {
            g.page().set_word(0, 12);
            g.page().set_word(100, 13);
        }
        drop(g);
        w0.settle_acks().await.unwrap();
    });
    let before = private(&d, id0);
    assert_eq!(read_shared(&w1, pid), if store { 12 } else { 11 });
    let after = private(&d, id0);
    (after.0 - before.0, after.1 - before.1)
}

#[test]
fn a_workers_store_makes_the_handler_copy_miss() {
    let profile = common::profile();
    assert!(
        profile.memnode.core_cache_bytes > 0,
        "the shipped profile models private caches"
    );
    let (hits, misses) = second_copy(false);
    let (hits_after_store, misses_after_store) = second_copy(true);
    // Unchanged page: the second copy finds the first's lines in the core.
    assert!(hits >= 64, "unchanged page: {hits} hits, {misses} misses");
    // The two stored lines were dropped from the handler core's cache: they
    // miss again (each miss's pair buddy is still there), and the rest of
    // the copy still hits.
    assert_eq!(
        (hits_after_store, misses_after_store),
        (hits - 2, misses + 2),
        "after the worker's stores (unchanged: {hits} hits, {misses} misses)"
    );
}
