//! What a benchmark run is told: typed, validated, no globals.

use crate::deployment::{Deployer, LocalDeployer};
use crate::error::BenchError;
use crate::keyset::KeysetSpec;
use crate::workload::{Dist, Workload};
use dmkv_api::deploy::DeployOptions;
use dmkv_api::payload::MIN_LEN;
use dmkv_api::{EngineSpec, Knobs};
use dmkv_transport::local::LocalConfig;
use std::path::PathBuf;
use std::sync::Arc;

/// Defaults of `dmkv bench`, chosen so that comparing about ten engines on
/// YCSB C finishes well under a minute on a 2-core machine. Change them here.
pub mod defaults {
    pub const KEYS: u64 = 50_000;
    /// A million: at 2-3.5 M ops/s in process, 100,000 operations were a
    /// 30-50 ms window, and one hiccup of a shared host moved an RPC
    /// engine's throughput by up to 28% between identical runs; over a
    /// million the same runs stay within 8% (docs/bench.md, "Defaults").
    pub const OPS: u64 = 1_000_000;
    pub const VALUE_SIZE: usize = 8;
    /// One compute thread: the other core serves the memory node.
    pub const THREADS: usize = 1;
    pub const TASKS: usize = 8;
    pub const MEMNODE_THREADS: usize = 1;
    pub const MEMNODES: usize = 1;
    pub const NODES: usize = 1;
    pub const CACHE_MB: u64 = 64;
    pub const SEED: u64 = 1;
    /// Pairs per `Engine::load` call.
    pub const LOAD_CHUNK: usize = 4096;
}

/// One engine of a run, with its `--set` knobs.
#[derive(Clone)]
pub struct EngineChoice {
    pub spec: &'static dyn EngineSpec,
    pub knobs: Knobs,
}

impl std::fmt::Debug for EngineChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EngineChoice")
            .field("spec", &self.spec.name())
            .field("knobs", &self.knobs)
            .finish()
    }
}

/// `--crash-memnode NODE@FRACTION`: crash memory node NODE (0-based, as
/// numbered by `--memnodes`) once FRACTION of the run's operations have
/// completed, to see how an engine fails over: the run goes on, every error
/// a client sees is counted, and `--verify` reads every key back after it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct CrashPlan {
    pub node: usize,
    /// In (0, 1): the share of the run's operations completed first.
    pub at_fraction: f64,
}

impl CrashPlan {
    /// The operation count (1-based, over all threads) whose completion
    /// triggers the crash.
    pub fn at_op(&self, total_ops: u64) -> u64 {
        ((total_ops as f64 * self.at_fraction).ceil() as u64).clamp(1, total_ops.max(1))
    }
}

impl std::str::FromStr for CrashPlan {
    type Err = String;
    fn from_str(s: &str) -> Result<CrashPlan, String> {
        let bad = || {
            format!(
                "--crash-memnode takes NODE@FRACTION, e.g. 1@0.5 (crash memory node 1 when half the operations have completed); got {s:?}"
            )
        };
        let (node, frac) = s.split_once('@').ok_or_else(bad)?;
        let node: usize = node.trim().parse().map_err(|_| bad())?;
        let at_fraction: f64 = frac.trim().parse().map_err(|_| bad())?;
        if !(at_fraction > 0.0 && at_fraction < 1.0) {
            return Err(format!(
                "--crash-memnode {s}: the fraction of operations must be strictly between 0 and 1"
            ));
        }
        Ok(CrashPlan { node, at_fraction })
    }
}

/// Where the operations come from.
#[derive(Debug, Clone, PartialEq)]
pub enum WorkloadSource {
    Synthetic(Workload),
    /// A YCSB trace to replay (`--trace`).
    Trace(PathBuf),
}

/// A whole `dmkv bench` invocation.
#[derive(Debug, Clone)]
pub struct BenchConfig {
    /// Run in this order; ratios are relative to the first.
    pub engines: Vec<EngineChoice>,
    pub workload: WorkloadSource,
    /// With a trace: YCSB's load phase, whose keys are loaded before the
    /// replay (`--trace-load`).
    pub trace_load: Option<PathBuf>,
    /// None: the workload's natural distribution (latest for D, else uniform).
    pub dist: Option<Dist>,
    pub keyset: KeysetSpec,
    pub keys: u64,
    pub ops: u64,
    /// `--warmup-ops`: operations run before the measured `ops`, from the
    /// same streams, and left out of every figure of the run (their errors
    /// and wrong answers are still reported).
    pub warmup_ops: u64,
    pub value_size: usize,
    pub threads: usize,
    pub tasks: usize,
    pub memnode_threads: usize,
    pub memnodes: usize,
    pub nodes: usize,
    /// Compute nodes, each running `threads` threads (`--transport sim`
    /// only; 1 otherwise).
    pub compute_nodes: usize,
    pub cache_mb: u64,
    pub data_dir: Option<PathBuf>,
    pub verify: bool,
    pub seed: u64,
    /// Draw progress bars on stderr (indicatif hides them anyway when stderr
    /// is not a terminal).
    pub progress: bool,
    /// The local backend's settings, including injected faults (tests).
    pub local: LocalConfig,
    pub load_chunk: usize,
    /// Where engines are deployed (in process unless told otherwise).
    pub deployer: Arc<dyn Deployer>,
    /// Crash a memory node during the run (`--crash-memnode`).
    pub crash: Option<CrashPlan>,
    /// Report throughput per interval of this many nanoseconds of the run
    /// (`--timeline-ms`; 0: no timeline).
    pub timeline_ns: u64,
    /// Under `--transport sim`: an operation still running after this much
    /// virtual time fails the run and stops it (`--op-limit-ms`; a livelock
    /// or a wait that never ends, which would otherwise run until some outer
    /// limit). None: no limit.
    pub op_limit: Option<std::time::Duration>,
    /// `--partitioned`: each node's threads draw keys from their node's
    /// partition of the loaded keys ([`crate::partition`]).
    pub partitioned: bool,
    /// `--shift-every-ms`: with `partitioned`, reassign partitions (node i
    /// takes partition (i + k) mod N after the k-th shift) every this many
    /// nanoseconds of the run (0: never).
    pub shift_every_ns: u64,
    /// `--value-gen`: how updates and inserts make their values
    /// ([`crate::valuegen`]).
    pub value_gen: crate::valuegen::ValueGen,
}

impl BenchConfig {
    /// The defaults, for `engines`.
    pub fn new(engines: Vec<EngineChoice>) -> BenchConfig {
        BenchConfig {
            engines,
            workload: WorkloadSource::Synthetic(Workload::YcsbC),
            trace_load: None,
            dist: None,
            keyset: KeysetSpec::Uniform,
            keys: defaults::KEYS,
            ops: defaults::OPS,
            warmup_ops: 0,
            value_size: defaults::VALUE_SIZE,
            threads: defaults::THREADS,
            tasks: defaults::TASKS,
            memnode_threads: defaults::MEMNODE_THREADS,
            memnodes: defaults::MEMNODES,
            nodes: defaults::NODES,
            compute_nodes: 1,
            cache_mb: defaults::CACHE_MB,
            data_dir: None,
            verify: false,
            seed: defaults::SEED,
            progress: false,
            local: LocalConfig::default(),
            load_chunk: defaults::LOAD_CHUNK,
            deployer: Arc::new(LocalDeployer),
            crash: None,
            timeline_ns: 0,
            op_limit: None,
            partitioned: false,
            shift_every_ns: 0,
            value_gen: Default::default(),
        }
    }

    /// Compute threads of the whole run: `threads` on each compute node.
    pub fn total_threads(&self) -> usize {
        self.threads * self.compute_nodes
    }

    /// The distribution in force.
    pub fn effective_dist(&self) -> Dist {
        match (&self.dist, &self.workload) {
            (Some(d), _) => *d,
            (None, WorkloadSource::Synthetic(w)) => w.natural_dist(),
            (None, WorkloadSource::Trace(_)) => Dist::Uniform,
        }
    }

    /// Checks what can be checked without engines or files.
    pub fn validate(&self) -> Result<(), BenchError> {
        if self.engines.is_empty() {
            return Err(BenchError::input("no engine to run"));
        }
        for (i, e) in self.engines.iter().enumerate() {
            if self.engines[..i]
                .iter()
                .any(|o| o.spec.name() == e.spec.name())
            {
                return Err(BenchError::input(format!(
                    "engine {} is listed twice",
                    e.spec.name()
                )));
            }
            e.knobs.check(e.spec.name(), e.spec.knobs())?;
        }
        if self.value_size < MIN_LEN {
            return Err(BenchError::input(format!(
                "--value-size {} is too small: values carry their key's checksum and version, so they have at least {MIN_LEN} bytes",
                self.value_size
            )));
        }
        if u32::try_from(self.value_size).is_err() {
            return Err(BenchError::input(format!(
                "--value-size {} is too large",
                self.value_size
            )));
        }
        for (flag, v) in [
            ("--threads", self.threads),
            ("--tasks", self.tasks),
            ("--memnode-threads", self.memnode_threads),
            ("--memnodes", self.memnodes),
            ("--nodes", self.nodes),
            ("--compute-nodes", self.compute_nodes),
        ] {
            if v == 0 {
                return Err(BenchError::input(format!("{flag} must be at least 1")));
            }
        }
        if self.compute_nodes > 1 && self.deployer.transport() != "sim" {
            return Err(BenchError::input(
                "--compute-nodes needs --transport sim: other transports run the compute threads of this process only",
            ));
        }
        if self.load_chunk == 0 {
            return Err(BenchError::input(
                "--load-chunk must be at least 1: the load chunk must hold at least one pair",
            ));
        }
        if self.trace_load.is_some() && !matches!(self.workload, WorkloadSource::Trace(_)) {
            return Err(BenchError::input(
                "--trace-load needs --trace: it is the load phase of the run replayed",
            ));
        }
        if let Some(c) = &self.crash {
            if self.memnodes < 2 {
                return Err(BenchError::input(
                    "--crash-memnode needs --memnodes 2 or more: with one memory node there is nothing to fail over to",
                ));
            }
            if c.node >= self.memnodes {
                return Err(BenchError::input(format!(
                    "--crash-memnode {}: there are memory nodes 0..{} (--memnodes {})",
                    c.node,
                    self.memnodes - 1,
                    self.memnodes
                )));
            }
            if !(c.at_fraction > 0.0 && c.at_fraction < 1.0) {
                return Err(BenchError::input(
                    "--crash-memnode: the fraction of operations must be strictly between 0 and 1",
                ));
            }
            if !matches!(self.deployer.transport(), "local" | "sim") {
                return Err(BenchError::input(format!(
                    "--crash-memnode needs --transport local or sim (transport {} cannot crash a node)",
                    self.deployer.transport()
                )));
            }
            if matches!(self.workload, WorkloadSource::Synthetic(w) if !w.has_run_phase()) {
                return Err(BenchError::input(
                    "--crash-memnode crashes a node during the run phase; this workload only loads",
                ));
            }
        }
        if self.shift_every_ns > 0 && !self.partitioned {
            return Err(BenchError::input(
                "--shift-every-ms reassigns the partitions of --partitioned; give --partitioned too",
            ));
        }
        if self.partitioned && matches!(self.workload, WorkloadSource::Trace(_)) {
            return Err(BenchError::input(
                "--partitioned draws synthetic keys; a --trace replays its own",
            ));
        }
        if self.dist.is_some() && matches!(self.workload, WorkloadSource::Trace(_)) {
            return Err(BenchError::input(
                "--dist does not apply to a --trace replay",
            ));
        }
        Ok(())
    }

    /// `--partitioned`: how this run's compute threads map to nodes, given
    /// the engines' topologies (one map for the whole run, as the plan is
    /// shared). Symmetric engines: thread t on node t mod `--nodes`;
    /// disaggregated ones: thread t on compute node t / `--threads`.
    pub fn partition_spec(
        &self,
        topologies: &[(&str, dmkv_api::Topology)],
    ) -> Result<Option<crate::partition::PartitionSpec>, BenchError> {
        use crate::partition::{NodeMap, PartitionSpec};
        use dmkv_api::Topology;
        if !self.partitioned {
            return Ok(None);
        }
        let symmetric = |t: &Topology| *t == Topology::Symmetric;
        let map = match topologies.first() {
            None => return Ok(None),
            Some((_, t)) if symmetric(t) => {
                if self.total_threads() < self.nodes {
                    return Err(BenchError::input(format!(
                        "--partitioned over --nodes {} needs a worker on every node: --threads is the total over the nodes and is {}",
                        self.nodes,
                        self.total_threads()
                    )));
                }
                NodeMap::Modulo { nodes: self.nodes }
            }
            Some(_) => NodeMap::Block {
                nodes: self.compute_nodes,
                per_node: self.threads,
            },
        };
        if let Some((name, _)) = topologies
            .iter()
            .find(|(_, t)| symmetric(t) != matches!(map, NodeMap::Modulo { .. }))
        {
            return Err(BenchError::input(format!(
                "--partitioned: engine {name} maps threads to nodes differently from engine {} (symmetric nodes vs compute nodes); run them separately",
                topologies[0].0
            )));
        }
        Ok(Some(PartitionSpec { map }))
    }

    /// How to deploy `engine` for a run over `expected_keys` keys.
    pub fn deploy_options(&self, engine: &EngineChoice, expected_keys: u64) -> DeployOptions {
        DeployOptions {
            memnodes: self.memnodes,
            nodes: self.nodes,
            handler_threads: self.memnode_threads,
            knobs: engine.knobs.clone(),
            expected_keys,
            value_size: self.value_size as u32,
            cache_mb: self.cache_mb,
            data_dir: self.data_dir.clone(),
            threads: self.total_threads(),
            local: self.local.clone(),
            instance: "bench".into(),
        }
    }
}
