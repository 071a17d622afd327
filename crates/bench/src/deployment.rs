//! Where the runner deploys engines: [`LocalDeployer`] (in process, the
//! default) or another [`Deployer`] (the UCX backend's, across processes and
//! hosts, supplied by the CLI when it is built with the `ucx` feature). The
//! runner only sees a [`Deployment`]: the engine, per-thread endpoints and
//! clients, and the serving nodes' stats.

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::sim_deploy::{SimDeployment, SimOptions};
use dmkv_api::{Engine, EngineSpec, KvError, KvStore};
use dmkv_memnode::NodeStats;
use dmkv_transport::Endpoint;
use dmkv_transport::sim::Simulation;
use std::rc::Rc;
use std::sync::Arc;

/// An engine deployed for one run. Shared by the run's threads.
pub trait Deployment: Sync {
    fn engine(&self) -> &Arc<dyn Engine>;
    /// An endpoint for compute thread `thread`, on the node the engine wants.
    fn endpoint(&self, thread: usize) -> Rc<Endpoint>;
    /// A validated client for compute thread `thread`, with its endpoint.
    fn client(&self, thread: usize) -> Result<(Rc<Endpoint>, Rc<dyn KvStore>), KvError>;
    /// Figures of every node the engine is installed on.
    fn node_stats(&self) -> Vec<NodeStats>;
    /// The simulation this deployment runs in (`--transport sim`): then the
    /// whole run happens on the calling thread, in virtual time.
    fn sim(&self) -> Option<&Simulation> {
        None
    }
    /// Crashes serving node `index` (in deployment order: memory node
    /// `index`) now: its memory is gone and every later request to it fails
    /// with `NodeDown` (`--crash-memnode`).
    fn crash_node(&self, index: usize) -> Result<(), String> {
        let _ = index;
        Err("this transport cannot crash a node".into())
    }
}

/// Makes a fresh deployment of an engine for each run.
pub trait Deployer: Send + Sync + std::fmt::Debug {
    /// The transport's name in reports (`local`, `ucx`).
    fn transport(&self) -> &'static str;
    fn deploy(
        &self,
        spec: &'static dyn EngineSpec,
        opts: &DeployOptions,
    ) -> Result<Box<dyn Deployment>, KvError>;
}

/// Every node in this process ([`LocalDeployment`]).
#[derive(Debug, Clone, Copy, Default)]
pub struct LocalDeployer;

impl Deployer for LocalDeployer {
    fn transport(&self) -> &'static str {
        "local"
    }
    fn deploy(
        &self,
        spec: &'static dyn EngineSpec,
        opts: &DeployOptions,
    ) -> Result<Box<dyn Deployment>, KvError> {
        Ok(Box::new(LocalDeployment::deploy(spec, opts)?))
    }
}

impl Deployment for LocalDeployment {
    fn engine(&self) -> &Arc<dyn Engine> {
        &self.engine
    }
    fn endpoint(&self, thread: usize) -> Rc<Endpoint> {
        LocalDeployment::endpoint(self, thread)
    }
    fn client(&self, thread: usize) -> Result<(Rc<Endpoint>, Rc<dyn KvStore>), KvError> {
        LocalDeployment::client(self, thread)
    }
    fn node_stats(&self) -> Vec<NodeStats> {
        LocalDeployment::node_stats(self)
    }
    fn crash_node(&self, index: usize) -> Result<(), String> {
        let rt = self
            .runtimes
            .get(index)
            .ok_or_else(|| format!("there is no serving node {index}"))?;
        self.cluster.crash(rt.id());
        Ok(())
    }
}

/// A simulated cluster in virtual time on the calling thread
/// ([`SimDeployment`]); `--transport sim`.
#[derive(Debug, Clone)]
pub struct SimDeployer {
    pub options: SimOptions,
}

impl Deployer for SimDeployer {
    fn transport(&self) -> &'static str {
        "sim"
    }
    fn deploy(
        &self,
        spec: &'static dyn EngineSpec,
        opts: &DeployOptions,
    ) -> Result<Box<dyn Deployment>, KvError> {
        Ok(Box::new(SimDeployment::deploy(spec, opts, &self.options)?))
    }
}

impl Deployment for SimDeployment {
    fn engine(&self) -> &Arc<dyn Engine> {
        &self.engine
    }
    fn endpoint(&self, thread: usize) -> Rc<Endpoint> {
        SimDeployment::endpoint(self, thread)
    }
    fn client(&self, thread: usize) -> Result<(Rc<Endpoint>, Rc<dyn KvStore>), KvError> {
        SimDeployment::client(self, thread)
    }
    fn node_stats(&self) -> Vec<NodeStats> {
        SimDeployment::node_stats(self)
    }
    fn sim(&self) -> Option<&Simulation> {
        Some(&self.sim)
    }
    fn crash_node(&self, index: usize) -> Result<(), String> {
        let rt = self
            .runtimes
            .get(index)
            .ok_or_else(|| format!("there is no serving node {index}"))?;
        self.sim.crash_at(rt.id(), self.sim.now_ns());
        Ok(())
    }
}
