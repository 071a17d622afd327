//! Set-up shared by the simulated-cluster tests (`*_sim.rs`): a cluster of
//! ScaleStore nodes on `--transport sim` with the `scalestore-cx5` profile,
//! workers with a simulated core of their own, and the few page helpers
//! several files use. Each test file uses part of it.
#![allow(dead_code)]

use dmkv_api::Knobs;
use dmkv_api::deploy::DeployOptions;
use dmkv_api::sim_deploy::{SimDeployment, SimOptions};
use dmkv_scalestore::SCALESTORE;
use dmkv_scalestore::engine::served_nodes;
use dmkv_scalestore::guard::{ExclusiveGuard, SharedGuard};
use dmkv_scalestore::node::ScaleNode;
use dmkv_scalestore::pid::Pid;
use dmkv_scalestore::provider::Provider;
use dmkv_scalestore::worker::Worker;
use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimConfig};
use std::rc::Rc;
use std::sync::Arc;

/// The hardware profile of every simulated ScaleStore test.
pub const PROFILE: &str = "scalestore-cx5";

pub fn profile() -> Profile {
    Profile::load(PROFILE).unwrap()
}

/// A simulated cluster's shape: `nodes` ScaleStore nodes, `threads`
/// compute threads (all on one compute node), `knobs`, and either
/// `cache_mb` per node or the knobs' `cache_pages`; seeded `jitter_ns`.
pub struct Cluster<'a> {
    pub nodes: usize,
    pub threads: usize,
    pub cache_mb: Option<u64>,
    pub knobs: &'a [(&'a str, &'a str)],
    pub seed: u64,
    pub jitter_ns: u64,
    /// `None`: [`profile`].
    pub profile: Option<Profile>,
}

impl Cluster<'_> {
    /// `nodes` nodes, one compute thread each, 4 MiB caches, no jitter.
    pub fn new(nodes: usize, seed: u64) -> Cluster<'static> {
        Cluster {
            nodes,
            threads: nodes,
            cache_mb: Some(4),
            knobs: &[],
            seed,
            jitter_ns: 0,
            profile: None,
        }
    }

    pub fn deploy(&self) -> SimDeployment {
        let mut knobs = Knobs::new();
        for (k, v) in self.knobs {
            knobs.set(k, v);
        }
        let mut opts = DeployOptions {
            nodes: self.nodes,
            threads: self.threads,
            knobs,
            ..Default::default()
        };
        if let Some(mb) = self.cache_mb {
            opts.cache_mb = mb;
        }
        let sim = SimOptions {
            config: SimConfig {
                profile: self.profile.clone().unwrap_or_else(profile),
                seed: self.seed,
                jitter_ns: self.jitter_ns,
                delays: Default::default(),
            },
            compute_nodes: 1,
            threads_per_node: self.threads,
        };
        SimDeployment::deploy(&SCALESTORE, &opts, &sim).unwrap()
    }
}

pub fn nodes_of(d: &SimDeployment) -> Vec<Arc<ScaleNode>> {
    served_nodes(&d.runtimes, &d.args)
}

/// A worker with a simulated core of its own on `node`.
pub fn worker(node: &Arc<ScaleNode>) -> Worker {
    Worker::new(
        node.clone(),
        Rc::new(node.fabric.endpoint(node.id).unwrap()),
    )
}

/// A page allocated by `w` (directed by its node) with word 0 = `value`.
pub fn allocate(w: &Worker, value: u64) -> Pid {
    block_on(async {
        let g = ExclusiveGuard::allocate(w).await.unwrap();
        g.page().set_word(0, value);
        g.pid()
    })
}

/// Node 1 holds the only (dirty) copy of a page node 0 directs: node 0's
/// worker allocates it with word 0 = 7, node 1's worker fixes it
/// exclusively and sets word 0 = 42. Returns the page and both workers
/// (kept by the caller for the rest of its run, as before this helper).
pub fn node1_dirties_a_page_of_node0(nodes: &[Arc<ScaleNode>]) -> (Pid, Worker, Worker) {
    let (w0, w1) = (worker(&nodes[0]), worker(&nodes[1]));
    let pid = allocate(&w0, 7);
    assert_eq!(pid.shard(), 0);
    block_on(async {
        let g = ExclusiveGuard::fix(&w1, pid).await.unwrap();
        g.page().set_word(0, 42);
        drop(g);
        w1.settle_acks().await.unwrap();
    });
    (pid, w0, w1)
}

/// Word 0 of `pid`, fixed shared by `w`.
pub fn read_shared(w: &Worker, pid: Pid) -> u64 {
    block_on(async {
        SharedGuard::fix(w, pid)
            .await
            .unwrap()
            .page()
            .word(0)
            .unwrap()
    })
}

/// Word 0 of `pid`, fixed exclusively by `w`.
pub fn read_exclusive(w: &Worker, pid: Pid) -> u64 {
    block_on(async {
        ExclusiveGuard::fix(w, pid)
            .await
            .unwrap()
            .page()
            .word(0)
            .unwrap()
    })
}

/// Evicts `pids` from `node` as a task; returns how many it still holds.
pub async fn evict(node: &ScaleNode, pids: &[Pid]) -> usize {
    let ep = node.fabric.endpoint(node.id).unwrap();
    Provider::new()
        .evict_everything(node, &ep, |p| pids.contains(&p))
        .await
        .unwrap()
}

/// `n` pages directed by node 0, word 0 of page i set to `100 + i`, then
/// evicted by node 0 (its dirty pages go to its SSD and their entries say
/// "only on the SSD").
pub fn pages_on_node0_ssd(nodes: &[Arc<ScaleNode>], n: u64) -> Vec<Pid> {
    let w0 = worker(&nodes[0]);
    let pids: Vec<Pid> = (0..n).map(|i| allocate(&w0, 100 + i)).collect();
    assert!(pids.iter().all(|p| p.shard() == 0));
    let held = block_on(evict(&nodes[0], &pids));
    assert_eq!(held, 0, "node 0 evicted the pages");
    pids
}
