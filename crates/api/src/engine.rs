use crate::error::Result;
use crate::knobs::{KnobSpec, Knobs};
use crate::store::{Capabilities, Key, KvStore};
use async_trait::async_trait;
use dmkv_memnode::NodeRuntime;
use dmkv_transport::{Endpoint, Fabric, NodeId};
use serde::{Deserialize, Serialize};
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;

/// How a design uses its nodes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Topology {
    /// Compute nodes issue, memory nodes (`--memnodes K`) serve.
    Disaggregated,
    /// Every node (`--nodes K`) both serves and issues (ScaleStore).
    Symmetric,
}

/// What an engine's server side is told on each node it is installed on.
/// It crosses process boundaries (the UCX admin service), so it is plain data.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ServeArgs {
    /// Prefix for every region and service name of this engine instance, so
    /// that several instances can share a node.
    pub instance: String,
    pub knobs: Knobs,
    /// This node's position in `nodes`.
    pub node_index: usize,
    /// Every node this instance is installed on, in order.
    pub nodes: Vec<u16>,
    /// Keys expected (loaded plus inserted): a sizing hint.
    pub expected_keys: u64,
    /// Typical value size: a sizing hint.
    pub value_size: u32,
    /// Local cache per node in MiB (symmetric designs).
    pub cache_mb: u64,
    /// Where nodes keep on-disk data (symmetric designs, durability logs).
    pub data_dir: Option<PathBuf>,
}

impl ServeArgs {
    /// `instance/name`: the name of one region or service of this instance.
    pub fn name(&self, name: &str) -> String {
        format!("{}/{name}", self.instance)
    }

    pub fn node_ids(&self) -> Vec<NodeId> {
        self.nodes.iter().map(|&n| NodeId(n)).collect()
    }
}

/// What a compute process is told when it connects to an installed engine.
pub struct ConnectArgs {
    pub fabric: Arc<dyn Fabric>,
    /// The node this process issues from.
    pub compute_node: NodeId,
    /// The same data every node was served with (`node_index` is 0).
    pub serve: ServeArgs,
    /// How many compute threads will ask for clients.
    pub threads: usize,
    /// Runtimes of the nodes served in this process (empty for a process
    /// that only issues). Symmetric designs run their compute threads on
    /// their nodes' own state, which they find here (`NodeRuntime::attachment`).
    pub hosted: Vec<Arc<NodeRuntime>>,
    /// Another compute process of the same deployment whose event counters
    /// this one adds to, so that that process's `Engine::stats` counts the
    /// events of every compute process: under `sim` with several compute
    /// nodes, compute node 0's engine (`SimDeployment`). Only counters are
    /// shared (lock retries, cache hits, fallbacks), never what a design
    /// keeps per compute process (caches, local lock tables, locators): an
    /// engine finds the other with [`ConnectArgs::counting_into`]. `None`
    /// (every other deployment): counters of its own.
    pub counters_from: Option<Arc<dyn Engine>>,
}

impl ConnectArgs {
    /// The compute process this one counts into (`counters_from`), if it is
    /// an engine of type `T`.
    pub fn counting_into<T: Engine>(&self) -> Option<&T> {
        let first: &dyn Engine = self.counters_from.as_deref()?;
        first.as_any().downcast_ref::<T>()
    }
}

/// `Engine::as_any`, for every engine type (`ConnectArgs::counting_into`).
pub trait AsAny: std::any::Any {
    fn as_any(&self) -> &dyn std::any::Any;
}

impl<T: std::any::Any> AsAny for T {
    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

/// An engine connected from one compute process; shared by its threads.
#[async_trait(?Send)]
pub trait Engine: AsAny + Send + Sync {
    fn name(&self) -> &'static str;
    fn capabilities(&self) -> Capabilities;

    /// The node compute thread `thread` issues from (symmetric designs spread
    /// threads over nodes; others use the compute node).
    fn home_node(&self, thread: usize) -> NodeId;

    /// A handle for compute thread `thread`, which issues through `ep`.
    async fn client(&self, ep: Rc<Endpoint>, thread: usize) -> Result<Rc<dyn KvStore>>;

    /// Loads distinct new pairs before a run, by the design's bulk path.
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()>;

    /// The design's own figures for the report's `engine_stats`.
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value>;

    /// Bytes this compute process caches (models, tables, inner nodes).
    fn client_cache_bytes(&self) -> u64;

    /// Running totals of this compute process's client-side figures (e.g.
    /// XStore's fallbacks), read from memory without I/O: the harness
    /// samples them at `--timeline-ms` interval boundaries only (never per
    /// operation) and reports them per interval; a counter named `gets`
    /// becomes the denominator of per-GET rates. Default: none.
    fn client_counters(&self) -> Vec<(&'static str, u64)> {
        Vec::new()
    }

    /// Waits until background work started so far (retraining, resizing) is
    /// done. Tests use it to reach a quiet state; runs never need it.
    async fn settle(&self, _ep: &Endpoint) -> Result<()> {
        Ok(())
    }
}

/// A design: how to install it on nodes and connect to it.
pub trait EngineSpec: Send + Sync {
    fn name(&self) -> &'static str;
    /// One line on what the design is.
    fn about(&self) -> &'static str;
    fn knobs(&self) -> &'static [KnobSpec];
    /// What the design accepts (scans, value sizes, reserved keys), known
    /// before anything is deployed so that key sets can avoid reserved keys.
    /// `Engine::capabilities` of a connected engine returns the same.
    fn capabilities(&self) -> Capabilities;
    fn topology(&self) -> Topology {
        Topology::Disaggregated
    }
    /// Installs the server side on one node: regions, services, workers.
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()>;
    /// Connects this process to an instance installed on `args.serve.nodes`.
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>>;
}
