//! Deploying an engine on the simulated cluster (`--transport sim`): every
//! node, compute thread and background activity in virtual time on the
//! calling thread (see `dmkv_transport::sim`).

use crate::deploy::{DeployOptions, checked_client, install, serving_nodes};
use crate::engine::{Engine, EngineSpec, ServeArgs, Topology};
use crate::error::Result;
use crate::store::KvStore;
use dmkv_memnode::{NodeRuntime, NodeStats};
use dmkv_transport::sim::{SimConfig, Simulation};
use dmkv_transport::{Endpoint, NodeHost, NodeId};
use std::rc::Rc;
use std::sync::Arc;

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
pub struct SimDeployment {
    // Declared in drop order: the engine before the nodes it talks to, the
    // simulation last.
    pub engine: Arc<dyn Engine>,
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
        spec: &dyn EngineSpec,
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
        Ok(SimDeployment {
            engine,
            runtimes,
            compute,
            args,
            topology: spec.topology(),
            threads_per_node: sim_opts.threads_per_node.max(1),
            sim,
        })
    }

    /// The node compute thread `thread` issues from: its compute node for
    /// disaggregated designs, the engine's choice for symmetric ones.
    pub fn home(&self, thread: usize) -> NodeId {
        match self.topology {
            Topology::Disaggregated => {
                self.compute[(thread / self.threads_per_node).min(self.compute.len() - 1)]
            }
            Topology::Symmetric => self.engine.home_node(thread),
        }
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
        checked_client(&self.engine, self.endpoint(thread), thread)
    }

    pub fn node_stats(&self) -> Vec<NodeStats> {
        self.runtimes.iter().map(|r| r.stats()).collect()
    }
}
