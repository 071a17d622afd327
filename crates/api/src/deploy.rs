//! Deploying an engine on the in-process `local` backend: what the benchmark
//! harness does by default and what every engine's tests do.

use crate::checked::Checked;
use crate::engine::{ConnectArgs, Engine, EngineSpec, ServeArgs, Topology};
use crate::error::{KvError, Result};
use crate::knobs::Knobs;
use crate::store::KvStore;
use dmkv_memnode::{NodeRuntime, NodeStats};
use dmkv_transport::exec::block_on;
use dmkv_transport::local::{LocalCluster, LocalConfig};
use dmkv_transport::{Endpoint, NodeHost, NodeId, OpKind, labeled};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

/// How to deploy.
#[derive(Debug, Clone)]
pub struct DeployOptions {
    /// Memory nodes, for disaggregated designs.
    pub memnodes: usize,
    /// Symmetric nodes, for designs like ScaleStore.
    pub nodes: usize,
    /// RPC handler threads per serving node.
    pub handler_threads: usize,
    pub knobs: Knobs,
    pub expected_keys: u64,
    pub value_size: u32,
    pub cache_mb: u64,
    pub data_dir: Option<PathBuf>,
    /// Compute threads that will ask for clients.
    pub threads: usize,
    pub local: LocalConfig,
    /// Name prefix of the instance.
    pub instance: String,
}

impl Default for DeployOptions {
    fn default() -> Self {
        DeployOptions {
            memnodes: 1,
            nodes: 1,
            handler_threads: 1,
            knobs: Knobs::new(),
            expected_keys: 100_000,
            value_size: 8,
            cache_mb: 64,
            data_dir: None,
            threads: 1,
            local: LocalConfig::default(),
            instance: "i0".into(),
        }
    }
}

/// An engine deployed on a fresh local cluster. Dropping it tears it all down.
pub struct LocalDeployment {
    // Declared in drop order: the engine before the nodes it talks to.
    pub engine: Arc<dyn Engine>,
    pub runtimes: Vec<Arc<NodeRuntime>>,
    /// The node compute threads issue from (disaggregated designs).
    pub compute: NodeId,
    pub args: ServeArgs,
    pub cluster: LocalCluster,
}

impl LocalDeployment {
    /// Starts the nodes, installs `spec` on them and connects to it.
    pub fn deploy(spec: &dyn EngineSpec, opts: &DeployOptions) -> Result<LocalDeployment> {
        opts.knobs.check(spec.name(), spec.knobs())?;
        let cluster = LocalCluster::new(opts.local.clone());
        let runtimes: Vec<Arc<NodeRuntime>> = (0..serving_nodes(spec, opts)?)
            .map(|_| NodeRuntime::new(cluster.add_node(opts.handler_threads)))
            .collect();
        let compute = cluster.add_node(0).id();
        let (engine, args) = install(spec, opts, &runtimes, cluster.fabric(), compute)?;
        Ok(LocalDeployment {
            engine,
            runtimes,
            compute,
            args,
            cluster,
        })
    }

    /// An endpoint for compute thread `thread`, on the node the engine wants.
    pub fn endpoint(&self, thread: usize) -> Rc<Endpoint> {
        let node = self.engine.home_node(thread);
        Rc::new(
            self.cluster
                .fabric()
                .endpoint(node)
                .expect("the engine's home node exists"),
        )
    }

    /// A validated client for compute thread `thread`, with its endpoint.
    pub fn client(&self, thread: usize) -> Result<(Rc<Endpoint>, Rc<dyn KvStore>)> {
        checked_client(&self.engine, self.endpoint(thread), thread)
    }

    /// What a compute process issuing from `compute_node` of this cluster
    /// connects with: the deployment's serve data, one compute thread, no
    /// hosted nodes (a second compute process beside the deployment's own,
    /// or a test's client of a service).
    pub fn connect_args(&self, compute_node: NodeId) -> ConnectArgs {
        ConnectArgs {
            fabric: self.cluster.fabric(),
            compute_node,
            serve: self.args.clone(),
            threads: 1,
            hosted: Vec::new(),
            counters_from: None,
        }
    }

    /// Figures of every node the engine is installed on.
    pub fn node_stats(&self) -> Vec<NodeStats> {
        self.runtimes.iter().map(|r| r.stats()).collect()
    }

    pub fn host(&self, i: usize) -> &Arc<dyn NodeHost> {
        self.runtimes[i].host()
    }
}

/// How many nodes `spec` is served on.
pub(crate) fn serving_nodes(spec: &dyn EngineSpec, opts: &DeployOptions) -> Result<usize> {
    let count = match spec.topology() {
        Topology::Disaggregated => opts.memnodes,
        Topology::Symmetric => opts.nodes,
    };
    if count == 0 {
        return Err(KvError::Config(format!(
            "{} needs at least one node",
            spec.name()
        )));
    }
    Ok(count)
}

/// Installs `spec` on `runtimes` and connects to it from `compute`.
pub(crate) fn install(
    spec: &dyn EngineSpec,
    opts: &DeployOptions,
    runtimes: &[Arc<NodeRuntime>],
    fabric: Arc<dyn dmkv_transport::Fabric>,
    compute: NodeId,
) -> Result<(Arc<dyn Engine>, ServeArgs)> {
    let mut args = ServeArgs {
        instance: format!("{}/{}", opts.instance, spec.name()),
        knobs: opts.knobs.clone(),
        node_index: 0,
        nodes: runtimes.iter().map(|r| r.id().0).collect(),
        expected_keys: opts.expected_keys,
        value_size: opts.value_size,
        cache_mb: opts.cache_mb,
        data_dir: opts.data_dir.clone(),
    };
    for (i, rt) in runtimes.iter().enumerate() {
        args.node_index = i;
        spec.serve(rt, &args)?;
    }
    args.node_index = 0;
    let engine = spec.connect(ConnectArgs {
        fabric,
        compute_node: compute,
        serve: args.clone(),
        threads: opts.threads,
        hosted: runtimes.to_vec(),
        counters_from: None,
    })?;
    Ok((engine, args))
}

/// The engine's client for compute thread `thread` on `ep` (made under the
/// `setup` label), behind the API's input checks.
pub fn checked_client(
    engine: &Arc<dyn Engine>,
    ep: Rc<Endpoint>,
    thread: usize,
) -> Result<(Rc<Endpoint>, Rc<dyn KvStore>)> {
    let inner = block_on(labeled(OpKind::Setup, engine.client(ep.clone(), thread)))?;
    let checked = Checked::new(engine.name(), engine.capabilities(), inner);
    Ok((ep, Rc::new(checked)))
}
