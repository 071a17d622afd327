//! Engines over UCX: memory-node processes and the compute side that
//! installs engines on them.
//!
//! - [`Memnode`] is what `dmkv memnode --listen ADDR` runs: a node served
//!   over UCX with a [`NodeRuntime`] (so the stats service is there) and the
//!   **admin service** ([`ADMIN_SERVICE`]), through which a compute process
//!   installs an engine's server side by name with its [`ServeArgs`] (JSON),
//!   and removes it again. The engine is looked up in the registry the CLI
//!   uses, passed in as an [`EngineLookup`].
//! - [`UcxDeployment`] is the compute side, beside
//!   [`LocalDeployment`](dmkv_api::deploy::LocalDeployment) and with the same
//!   shape (`engine`, `endpoint`, `client`, `node_stats`): it connects to
//!   listed memory nodes, or starts them as child processes on loopback,
//!   installs the engine on each and connects to it. Symmetric designs
//!   (every node serves and issues) have their nodes served in the compute
//!   process itself, talking to each other over UCX.

use crate::cluster::{PeerLinker, UcxCluster, UcxConfig};
use crate::server::UcxNode;
use dmkv_api::deploy::{DeployOptions, checked_client};
use dmkv_api::{ConnectArgs, Engine, EngineSpec, KvError, KvStore, ServeArgs, Topology};
use dmkv_memnode::{NodeRuntime, NodeStats};
use dmkv_transport::exec::block_on;
use dmkv_transport::{
    Endpoint, NodeHost, NodeId, OpKind, RpcContext, ServiceError, WireReader, WireWriter, labeled,
};
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, ChildStdin, Command, Stdio};
use std::rc::Rc;
use std::sync::{Arc, Weak};
use std::time::{Duration, Instant};

/// The service through which engines are installed on a memory node.
pub const ADMIN_SERVICE: &str = "dmkv/admin";
const INSTALL: u8 = 1;
const UNINSTALL: u8 = 2;

/// The first line a memory node prints on stdout, followed by its address.
pub const LISTENING: &str = "dmkv memnode listening on";

/// Finds an engine's spec by name (the CLI's registry).
pub type EngineLookup = Arc<dyn Fn(&str) -> Option<&'static dyn EngineSpec> + Send + Sync>;

/// How to run a memory node.
#[derive(Debug, Clone)]
pub struct MemnodeOptions {
    pub listen: SocketAddr,
    pub node: NodeId,
    pub handler_threads: usize,
    /// Most bytes of regions the node registers (`None`: no limit).
    pub pool_bytes: Option<u64>,
    /// This node's own directory for engines' on-disk state (XStore's
    /// logs): it replaces the `data_dir` an installing compute process
    /// sends, which names a path on the compute host. `None`: the sent one
    /// is used as is (children on loopback share the host).
    pub data_dir: Option<PathBuf>,
    pub config: UcxConfig,
}

/// A memory node served by this process.
pub struct Memnode {
    pub runtime: Arc<NodeRuntime>,
    pub node: Arc<UcxNode>,
    // Last: dropping the cluster stops the node.
    pub cluster: UcxCluster,
}

impl Memnode {
    /// Starts serving; engines are installed later through the admin service.
    pub fn start(opts: &MemnodeOptions, lookup: EngineLookup) -> Result<Memnode, KvError> {
        // The node issues nothing itself; its own id is its identity.
        let cluster = UcxCluster::new(opts.config.clone(), opts.node)?;
        let node = cluster.serve(opts.node, opts.listen, opts.handler_threads)?;
        node.set_pool_limit(opts.pool_bytes);
        let runtime = NodeRuntime::new(node.clone());
        let weak: Weak<NodeRuntime> = Arc::downgrade(&runtime);
        let linker = cluster.peer_linker();
        if let Some(d) = &opts.data_dir {
            std::fs::create_dir_all(d)
                .map_err(|e| KvError::Config(format!("the data directory {}: {e}", d.display())))?;
        }
        let data_dir = opts.data_dir.clone();
        let admin = move |_: &RpcContext, req: &[u8]| -> Result<Vec<u8>, ServiceError> {
            let rt = weak
                .upgrade()
                .ok_or_else(|| ServiceError::failed("the node is shutting down"))?;
            admin(&rt, &linker, &lookup, data_dir.as_ref(), req)
        };
        runtime
            .register_service(ADMIN_SERVICE, Arc::new(admin))
            .map_err(|e| KvError::Config(format!("admin service: {e}")))?;
        Ok(Memnode {
            runtime,
            node,
            cluster,
        })
    }

    pub fn listen_addr(&self) -> SocketAddr {
        self.node.listen_addr()
    }

    /// One line on what serving cost this node outside its services so
    /// far: the serving loops' CPU (`progress_cpu_ns` in its stats), the
    /// part of it spent polling with nothing to do, and the RPCs served.
    pub fn serving_summary(&self) -> String {
        let total = self.node.progress_cpu_ns();
        let idle = self.node.progress_idle_ns();
        let node: &dyn NodeHost = &*self.node;
        let (served, _) = node.services().served();
        format!(
            "dmkv memnode {}: serving loops used {:.1} ms of CPU outside services \
             ({:.1} ms of it polling idle, {:.1} ms busy) for {served} RPCs",
            node.id(),
            total as f64 / 1e6,
            idle as f64 / 1e6,
            (total - idle) as f64 / 1e6,
        )
    }
}

fn admin(
    rt: &Arc<NodeRuntime>,
    linker: &PeerLinker,
    lookup: &EngineLookup,
    data_dir: Option<&PathBuf>,
    req: &[u8],
) -> Result<Vec<u8>, ServiceError> {
    let mut r = WireReader::new(req);
    let op = r.u8()?;
    let engine = r.str()?;
    let mut args: ServeArgs = serde_json::from_str(r.str()?)
        .map_err(|e| ServiceError::malformed(format!("serve arguments: {e}")))?;
    if let Some(d) = data_dir {
        args.data_dir = Some(d.clone());
    }
    // The other memory nodes of the instance and their addresses, so that
    // engines whose memory nodes talk to each other (Outback's replicas)
    // can reach them.
    let count = r.u32()?;
    if count as usize > args.nodes.len() {
        return Err(ServiceError::malformed("more peers than nodes"));
    }
    let mut peers = Vec::with_capacity(count as usize);
    for _ in 0..count {
        let id = r.u16()?;
        let addr = r.str()?.to_string();
        peers.push((NodeId(id), addr));
    }
    r.end()?;
    match op {
        INSTALL => {
            let spec = lookup(engine).ok_or_else(|| {
                ServiceError::failed(format!("this memory node has no engine named {engine:?}"))
            })?;
            if args.nodes.get(args.node_index) != Some(&rt.id().0) {
                return Err(ServiceError::failed(format!(
                    "asked to serve as node index {} of {:?}, but this is node {}",
                    args.node_index,
                    args.nodes,
                    rt.id()
                )));
            }
            for (id, addr) in &peers {
                if *id != rt.id() {
                    linker.link(*id, addr).map_err(|e| {
                        ServiceError::failed(format!("reaching peer node {id} at {addr}: {e}"))
                    })?;
                }
            }
            spec.serve(rt, &args)
                .map_err(|e| ServiceError::failed(format!("installing {engine}: {e}")))?;
            Ok(Vec::new())
        }
        UNINSTALL => {
            rt.remove_prefixed(&format!("{}/", args.instance));
            Ok(Vec::new())
        }
        op => Err(ServiceError::malformed(format!("unknown admin op {op}"))),
    }
}

fn admin_request(op: u8, engine: &str, args: &ServeArgs, peers: &[(NodeId, String)]) -> Vec<u8> {
    let json = serde_json::to_string(args).expect("serve arguments serialise");
    let mut w = WireWriter::new();
    w.u8(op).str(engine).str(&json).u32(peers.len() as u32);
    for (id, addr) in peers {
        w.u16(id.0).str(addr);
    }
    w.finish()
}

/// How to start a memory-node child process: given its node id, the
/// cluster secret and its number of handler threads, a command that runs `dmkv memnode` on loopback with
/// `--exit-on-stdin-eof` and prints [`LISTENING`] and its address.
pub type SpawnMemnode = Arc<dyn Fn(NodeId, &[u8], usize) -> Command + Send + Sync>;

/// Where the memory nodes of a UCX deployment come from.
#[derive(Clone)]
pub struct UcxDeployOptions {
    pub config: UcxConfig,
    /// Addresses of running memory nodes (`dmkv memnode --listen`), in the
    /// order the engine spreads over them. Empty: start `memnodes` children.
    pub memnodes: Vec<String>,
    /// How to start children when no address is listed.
    pub spawn: Option<SpawnMemnode>,
    /// The node id this compute process issues as.
    pub compute_node: NodeId,
}

impl UcxDeployOptions {
    pub fn new(config: UcxConfig) -> Self {
        UcxDeployOptions {
            config,
            memnodes: Vec::new(),
            spawn: None,
            compute_node: NodeId(60000),
        }
    }
}

/// A memory-node child process; stopped (and reaped) on drop. Its stdin is
/// a pipe from us, so it also exits if this process dies.
struct ChildNode {
    child: Child,
    _stdin: Option<ChildStdin>,
}

/// How long a child memory node gets to exit by itself (and print its
/// serving summary) once its stdin closes, before it is killed.
const CHILD_EXIT_GRACE: Duration = Duration::from_secs(1);

impl Drop for ChildNode {
    fn drop(&mut self) {
        // Closing stdin asks it to exit (`--exit-on-stdin-eof`).
        drop(self._stdin.take());
        let deadline = Instant::now() + CHILD_EXIT_GRACE;
        while Instant::now() < deadline {
            if matches!(self.child.try_wait(), Ok(Some(_))) {
                return;
            }
            std::thread::sleep(Duration::from_millis(5));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// An engine deployed over UCX. Dropping it uninstalls the engine from
/// listed memory nodes and stops the ones it started.
pub struct UcxDeployment {
    // Declared in drop order: the engine before the nodes it talks to.
    pub engine: Arc<dyn Engine>,
    /// The node compute threads issue from (disaggregated designs).
    pub compute: NodeId,
    pub args: ServeArgs,
    /// Nodes served in this process (symmetric designs).
    runtimes: Vec<Arc<NodeRuntime>>,
    /// Memory nodes served elsewhere.
    remote: Vec<NodeId>,
    cluster: UcxCluster,
    children: Vec<ChildNode>,
}

fn err(e: impl std::fmt::Display) -> KvError {
    KvError::Config(e.to_string())
}

impl UcxDeployment {
    /// Starts or reaches the nodes, installs `spec` on them and connects.
    pub fn deploy(
        spec: &dyn EngineSpec,
        opts: &DeployOptions,
        ucx: &UcxDeployOptions,
    ) -> Result<UcxDeployment, KvError> {
        opts.knobs.check(spec.name(), spec.knobs())?;
        let cluster = UcxCluster::new(ucx.config.clone(), ucx.compute_node)?;
        // Unique per run, so that runs can share long-lived memory nodes.
        let instance = format!(
            "{}-{}-{}/{}",
            opts.instance,
            std::process::id(),
            rand::random::<u32>(),
            spec.name()
        );
        let mut args = ServeArgs {
            instance,
            knobs: opts.knobs.clone(),
            node_index: 0,
            nodes: Vec::new(),
            expected_keys: opts.expected_keys,
            value_size: opts.value_size,
            cache_mb: opts.cache_mb,
            data_dir: opts.data_dir.clone(),
        };
        let mut children = Vec::new();
        let mut runtimes = Vec::new();
        let mut remote = Vec::new();
        match spec.topology() {
            Topology::Symmetric => {
                if !ucx.memnodes.is_empty() {
                    return Err(KvError::Config(format!(
                        "{} is symmetric: its nodes run the workload too, so they are served \
                         in this process (over UCX among themselves); memory-node addresses \
                         do not apply",
                        spec.name()
                    )));
                }
                if opts.nodes == 0 {
                    return Err(err(format!("{} needs at least one node", spec.name())));
                }
                for i in 0..opts.nodes {
                    let node = cluster.serve(
                        NodeId(i as u16),
                        "127.0.0.1:0".parse().expect("an address"),
                        opts.handler_threads,
                    )?;
                    runtimes.push(NodeRuntime::new(node));
                }
                args.nodes = runtimes.iter().map(|r| r.id().0).collect();
                for (i, rt) in runtimes.iter().enumerate() {
                    args.node_index = i;
                    spec.serve(rt, &args)?;
                }
            }
            Topology::Disaggregated => {
                let addrs: Vec<String> = if ucx.memnodes.is_empty() {
                    if opts.memnodes == 0 {
                        return Err(err(format!("{} needs at least one node", spec.name())));
                    }
                    let spawn = ucx.spawn.as_ref().ok_or_else(|| {
                        err("no memory-node addresses and no way to start memory nodes")
                    })?;
                    let mut addrs = Vec::new();
                    for i in 0..opts.memnodes {
                        let (child, addr) = start_child(
                            spawn,
                            NodeId(i as u16),
                            &ucx.config.secret,
                            opts.handler_threads,
                        )?;
                        children.push(child);
                        addrs.push(addr);
                    }
                    addrs
                } else {
                    ucx.memnodes.clone()
                };
                for a in &addrs {
                    remote.push(
                        cluster
                            .connect(a.as_str())
                            .map_err(|e| err(format!("memory node {a}: {e}")))?,
                    );
                }
                args.nodes = remote.iter().map(|n| n.0).collect();
                let ep = cluster.fabric().endpoint(ucx.compute_node)?;
                for (i, &n) in remote.iter().enumerate() {
                    args.node_index = i;
                    let peers: Vec<(NodeId, String)> =
                        remote.iter().copied().zip(addrs.iter().cloned()).collect();
                    let req = admin_request(INSTALL, spec.name(), &args, &peers);
                    block_on(labeled(OpKind::Setup, async {
                        let svc = ep.lookup_service(n, ADMIN_SERVICE).await?;
                        ep.call(n, svc, req).await
                    }))
                    .map_err(|e| err(format!("installing {} on node {n}: {e}", spec.name())))?;
                }
            }
        }
        args.node_index = 0;
        let compute = ucx.compute_node;
        let engine = spec.connect(ConnectArgs {
            fabric: cluster.fabric(),
            compute_node: compute,
            serve: args.clone(),
            threads: opts.threads,
            hosted: runtimes.clone(),
            counters_from: None,
        })?;
        Ok(UcxDeployment {
            engine,
            compute,
            args,
            runtimes,
            remote,
            cluster,
            children,
        })
    }

    /// An endpoint for compute thread `thread`, on the node the engine wants.
    pub fn endpoint(&self, thread: usize) -> Rc<Endpoint> {
        let node = self.engine.home_node(thread);
        Rc::new(
            self.cluster
                .fabric()
                .endpoint(node)
                .expect("the engine's home node is this process's"),
        )
    }

    /// A validated client for compute thread `thread`, with its endpoint.
    pub fn client(&self, thread: usize) -> Result<(Rc<Endpoint>, Rc<dyn KvStore>), KvError> {
        checked_client(&self.engine, self.endpoint(thread), thread)
    }

    /// Figures of every node the engine is installed on (remote ones through
    /// their stats service). A node that cannot answer reports zeros.
    pub fn node_stats(&self) -> Vec<NodeStats> {
        let mut out: Vec<NodeStats> = self.runtimes.iter().map(|r| r.stats()).collect();
        if self.remote.is_empty() {
            return out;
        }
        let Ok(ep) = self.cluster.fabric().endpoint(self.compute) else {
            out.extend(self.remote.iter().map(|_| NodeStats::default()));
            return out;
        };
        for &n in &self.remote {
            let s = block_on(labeled(OpKind::Setup, async {
                let svc = ep.lookup_service(n, NodeRuntime::STATS_SERVICE).await?;
                let reply = ep.call(n, svc, Vec::new()).await?;
                Ok::<_, dmkv_transport::TransportError>(NodeStats::decode(&reply)?)
            }));
            out.push(s.unwrap_or_default());
        }
        out
    }

    /// The cluster this deployment runs on.
    pub fn cluster(&self) -> &UcxCluster {
        &self.cluster
    }

    /// Nodes served in this process (symmetric designs).
    pub fn host(&self, i: usize) -> &Arc<dyn NodeHost> {
        self.runtimes[i].host()
    }
}

impl Drop for UcxDeployment {
    fn drop(&mut self) {
        // Remove the instance from memory nodes that outlive us; children
        // are stopped anyway.
        if self.children.is_empty()
            && !self.remote.is_empty()
            && let Ok(ep) = self.cluster.fabric().endpoint(self.compute)
        {
            for &n in &self.remote {
                let req = admin_request(UNINSTALL, self.engine.name(), &self.args, &[]);
                let _ = block_on(async {
                    let svc = ep.lookup_service(n, ADMIN_SERVICE).await?;
                    ep.call(n, svc, req).await
                });
            }
        }
    }
}

/// A fresh random cluster secret (hex), for memory nodes started as
/// children of this process.
pub fn fresh_secret() -> Vec<u8> {
    use rand::RngCore;
    let mut b = [0u8; 32];
    rand::rngs::OsRng.fill_bytes(&mut b);
    b.iter()
        .map(|x| format!("{x:02x}"))
        .collect::<String>()
        .into_bytes()
}

/// Starts one memory-node child and reads the address it listens on.
fn start_child(
    spawn: &SpawnMemnode,
    id: NodeId,
    secret: &[u8],
    handler_threads: usize,
) -> Result<(ChildNode, String), KvError> {
    let mut cmd = spawn(id, secret, handler_threads);
    cmd.stdin(Stdio::piped()).stdout(Stdio::piped());
    let mut child = cmd
        .spawn()
        .map_err(|e| err(format!("starting memory node {id}: {e}")))?;
    let stdin = child.stdin.take();
    let stdout = child.stdout.take().expect("piped stdout");
    let mut node = ChildNode {
        child,
        _stdin: stdin,
    };
    // Read the first line on a helper thread so that a child that never
    // answers cannot hang us.
    let (tx, rx) = crossbeam_channel::bounded(1);
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        let first = lines.next();
        let _ = tx.send(first);
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let line = match rx.recv_timeout(Duration::from_secs(30)) {
        Ok(Some(Ok(l))) => l,
        _ => {
            let status = node.child.try_wait().ok().flatten();
            return Err(err(format!(
                "memory node {id} did not report its address{}",
                status.map(|s| format!(" ({s})")).unwrap_or_default()
            )));
        }
    };
    let addr = line
        .strip_prefix(LISTENING)
        .map(|a| a.trim().to_string())
        .ok_or_else(|| err(format!("memory node {id} said {line:?}")))?;
    Ok((node, addr))
}
