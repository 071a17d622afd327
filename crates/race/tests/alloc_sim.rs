//! The memory node's allocation RPC declares its work to the simulated
//! cluster's instruction term (docs/simulation.md, "Declared work, the
//! rest (branch i60)"): inserts that take new chunks from the memory node
//! make the report's `memnode declared instructions` a positive multiple
//! of `serve_alloc`'s constant (nothing else of this engine runs on the memory
//! node's CPU). Without the declaration (main before i60) nothing is
//! declared and the test fails.

use dmkv_api::deploy::DeployOptions;
use dmkv_api::payload::make_value;
use dmkv_api::sim_deploy::{SimDeployment, SimOptions};
use dmkv_testkit::oracle::spread_key;
use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimConfig};

#[test]
fn inserts_that_take_chunks_declare_the_allocation_rpcs() {
    let d = SimDeployment::deploy(
        &dmkv_race::SPEC,
        &DeployOptions {
            memnodes: 1,
            threads: 1,
            knobs: {
                let mut k = dmkv_api::Knobs::new();
                // The smallest chunk: a few hundred inserts need several.
                k.set("chunk_kb", "8");
                k
            },
            ..Default::default()
        },
        &SimOptions {
            config: SimConfig {
                profile: Profile::load("rolex-cx5").unwrap(),
                seed: 1,
                jitter_ns: 0,
                delays: Default::default(),
            },
            compute_nodes: 1,
            threads_per_node: 1,
        },
    )
    .unwrap();
    let declared = |d: &SimDeployment| {
        d.sim
            .resources()
            .iter()
            .find(|r| r.name == "memnode declared instructions")
            .map_or(0, |r| r.count)
    };
    let (_ep, store) = d.client(0).unwrap();
    let before = declared(&d);
    for i in 0..2_000 {
        let k = spread_key(i);
        block_on(store.insert(k, &make_value(k, 0, 64))).unwrap();
    }
    let work = declared(&d) - before;
    let per = dmkv_race::alloc::SERVE_ALLOC_WORK;
    assert!(work > 0, "no allocation RPC declared its work");
    assert_eq!(work % per, 0, "only allocation RPCs declare: {work}");
    assert!(work / per >= 2, "several chunks taken: {}", work / per);
}
