//! Deploying an engine on the simulated cluster (`--transport sim`): every
//! node, compute thread and background activity in virtual time on the
//! calling thread (see `dmkv_transport::sim`).

use crate::deploy::{DeployOptions, checked_client, install, serving_nodes};
use crate::engine::{ConnectArgs, Engine, EngineSpec, ServeArgs, Topology};
use crate::error::Result;
use crate::store::KvStore;
use dmkv_memnode::{NodeRuntime, NodeStats};
use dmkv_transport::sim::{SimConfig, Simulation};
use dmkv_transport::{Endpoint, NodeHost, NodeId};
use std::rc::Rc;
use std::sync::{Arc, OnceLock};

/// How to simulate.
#[derive(Debug, Clone)]
pub struct SimOptions {
    pub config: SimConfig,
    /// Compute nodes (each with its own NIC); the compute threads are spread
    /// over them in blocks of `threads_per_node`.
    pub compute_nodes: usize,
    pub threads_per_node: usize,
}

/// An engine deployed on a fresh simulated cluster, entered on the calling
/// thread. Dropping it tears it all down and leaves the simulation.
///
/// Each simulated compute node of a disaggregated design is its own compute
/// process: the engine is connected once per node (`Engine` = one compute
/// process, shared by its threads), node 0 at deployment (it loads) and
/// every other node when its first client is made, so after the load, as a
/// compute node joins a loaded store (ROLEX §3: new compute nodes read the
/// models from the memory pool; Outback's and XStore's clients fetch their
/// locator and models from the loaded server). So what a design keeps per
/// compute process (Sherman's and ROLEX's local lock tables and hand-overs,
/// index and model caches, Outback's locator and its registration with each
/// shard, a lock word's owner tag) is per node, as on the papers' clusters.
/// Until the thirty-fourth session every node shared compute node 0's
/// engine, so a lock was handed over between threads of different nodes and
/// one node's cache fills served them all (docs/simulation.md, "One compute
/// process per simulated compute node").
pub struct SimDeployment {
    // Declared in drop order: the engines before the nodes they talk to,
    // the simulation last.
    /// Compute node 0's engine: the one that loads and reports.
    pub engine: Arc<dyn Engine>,
    /// The engines of compute nodes 1.. (disaggregated designs; empty for
    /// one compute node and for symmetric designs, whose compute threads
    /// run on their nodes' own state), each connected by [`Self::engine_of`]
    /// for the node's first client.
    peers: Vec<OnceLock<Arc<dyn Engine>>>,
    spec: &'static dyn EngineSpec,
    pub runtimes: Vec<Arc<NodeRuntime>>,
    /// Compute nodes of disaggregated designs.
    pub compute: Vec<NodeId>,
    pub args: ServeArgs,
    pub topology: Topology,
    threads_per_node: usize,
    pub sim: Simulation,
}

impl SimDeployment {
    /// Starts the simulation and its nodes, installs `spec` on them and
    /// connects to it.
    pub fn deploy(
        spec: &'static dyn EngineSpec,
        opts: &DeployOptions,
        sim_opts: &SimOptions,
    ) -> Result<SimDeployment> {
        opts.knobs.check(spec.name(), spec.knobs())?;
        let count = serving_nodes(spec, opts)?;
        let sim = Simulation::new(sim_opts.config.clone());
        let runtimes: Vec<Arc<NodeRuntime>> = (0..count)
            .map(|_| NodeRuntime::new(sim.add_node(opts.handler_threads)))
            .collect();
        let compute: Vec<NodeId> = (0..sim_opts.compute_nodes.max(1))
            .map(|_| sim.add_node(0).id())
            .collect();
        let (engine, args) = install(spec, opts, &runtimes, sim.fabric(), compute[0])?;
        let threads_per_node = sim_opts.threads_per_node.max(1);
        let peers = match spec.topology() {
            Topology::Disaggregated => compute[1..].iter().map(|_| OnceLock::new()).collect(),
            Topology::Symmetric => Vec::new(),
        };
        Ok(SimDeployment {
            engine,
            peers,
            spec,
            runtimes,
            compute,
            args,
            topology: spec.topology(),
            threads_per_node,
            sim,
        })
    }

    /// The compute node (index into `compute`) thread `thread` runs on, for
    /// disaggregated designs: threads are spread in blocks of
    /// `threads_per_node`.
    fn compute_index(&self, thread: usize) -> usize {
        (thread / self.threads_per_node).min(self.compute.len() - 1)
    }

    /// The node compute thread `thread` issues from: its compute node for
    /// disaggregated designs, the engine's choice for symmetric ones.
    pub fn home(&self, thread: usize) -> NodeId {
        match self.topology {
            Topology::Disaggregated => self.compute[self.compute_index(thread)],
            Topology::Symmetric => self.engine.home_node(thread),
        }
    }

    /// The engine (compute process) compute thread `thread` belongs to,
    /// connected now if it is the first of its node to ask.
    pub fn engine_of(&self, thread: usize) -> Result<&Arc<dyn Engine>> {
        let i = match self.topology {
            Topology::Disaggregated => self.compute_index(thread),
            Topology::Symmetric => 0,
        };
        if i == 0 {
            return Ok(&self.engine);
        }
        // `peers` has one engine per compute node after the first.
        let peer = &self.peers[i - 1];
        if let Some(e) = peer.get() {
            return Ok(e);
        }
        let e = self.spec.connect(ConnectArgs {
            fabric: self.sim.fabric(),
            compute_node: self.compute[i],
            serve: self.args.clone(),
            threads: self.threads_per_node,
            hosted: self.runtimes.clone(),
            counters_from: Some(self.engine.clone()),
        })?;
        Ok(peer.get_or_init(|| e))
    }

    /// An endpoint for compute thread `thread`: a simulated core of its node.
    pub fn endpoint(&self, thread: usize) -> Rc<Endpoint> {
        Rc::new(
            self.sim
                .fabric()
                .endpoint(self.home(thread))
                .expect("the thread's home node exists"),
        )
    }

    /// A validated client for compute thread `thread`, with its endpoint.
    pub fn client(&self, thread: usize) -> Result<(Rc<Endpoint>, Rc<dyn KvStore>)> {
        checked_client(self.engine_of(thread)?, self.endpoint(thread), thread)
    }

    pub fn node_stats(&self) -> Vec<NodeStats> {
        self.runtimes.iter().map(|r| r.stats()).collect()
    }
}
