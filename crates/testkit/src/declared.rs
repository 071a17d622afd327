//! Tests of the work engines declare to the simulated cluster's instruction
//! term (`dmkv_transport::sim::work`; docs/simulation.md, "An instruction
//! term for memory-node jobs (branch i49)" and the declared-work sections
//! after it): a small simulated cluster to run them on, and the suite for
//! a memory node's allocation RPC.

use crate::oracle::spread_key;
use dmkv_api::EngineSpec;
use dmkv_api::deploy::DeployOptions;
use dmkv_api::payload::make_value;
use dmkv_api::sim_deploy::{SimDeployment, SimOptions};
use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimConfig};

/// `spec` deployed on `memnodes` memory nodes of a simulated cluster with
/// `profile`, one compute node with one thread, seed 1 and no jitter, so a
/// test's counts are exact; `knobs` are set as on the command line.
pub fn deploy_on_sim(
    spec: &'static dyn EngineSpec,
    memnodes: usize,
    knobs: &[(&str, &str)],
    profile: Profile,
) -> SimDeployment {
    let mut k = dmkv_api::Knobs::new();
    for (name, value) in knobs {
        k.set(name, value);
    }
    SimDeployment::deploy(
        spec,
        &DeployOptions {
            memnodes,
            threads: 1,
            knobs: k,
            ..Default::default()
        },
        &SimOptions {
            config: SimConfig {
                profile,
                seed: 1,
                jitter_ns: 0,
                delays: Default::default(),
            },
            compute_nodes: 1,
            threads_per_node: 1,
        },
    )
    .unwrap_or_else(|e| panic!("deploying {} on the simulated cluster: {e}", spec.name()))
}

/// An engine whose memory node's only CPU work in an insert run is its
/// allocation RPC (RACE's `serve_alloc`, Sherman's `serve_chunk`): 2,000
/// inserts with chunks of `chunk_kb` take several chunks, and the run's
/// declared instructions are a positive multiple of `per_call`, at least
/// two calls. Without the declaration nothing is declared and this fails.
pub fn inserts_declare_allocation_rpcs(
    spec: &'static dyn EngineSpec,
    chunk_kb: &str,
    per_call: u64,
) {
    let d = deploy_on_sim(
        spec,
        1,
        &[("chunk_kb", chunk_kb)],
        Profile::load("rolex-cx5").unwrap(),
    );
    let (_ep, store) = d.client(0).unwrap();
    let before = d.sim.declared_instructions();
    for i in 0..2_000 {
        let k = spread_key(i);
        block_on(store.insert(k, &make_value(k, 0, 64))).unwrap();
    }
    let work = d.sim.declared_instructions() - before;
    assert!(work > 0, "no allocation RPC declared its work");
    assert_eq!(work % per_call, 0, "only allocation RPCs declare: {work}");
    assert!(
        work / per_call >= 2,
        "several chunks taken: {}",
        work / per_call
    );
}
