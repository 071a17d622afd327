//! `dmkv node` (one ScaleStore node per process, over UCX), `dmkv node-ctl`
//! (ask a node process to leave, list its members, print its figures) and
//! the deployer behind `dmkv bench --transport ucx --node-addr A,B,C`.
//! The node itself is `dmkv_scalestore::process`; this file turns command
//! lines into its options and connects processes through UCX. Without the
//! `ucx` feature only the argument structs exist (the commands say so).

use clap::{Args, Subcommand};
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct NodeArgs {
    /// Address to listen on (port 0 picks one; it is printed).
    #[arg(long, value_name = "ADDR")]
    pub listen: String,
    /// This node's index in the cluster (also its shard and transport id),
    /// 0..64; node 0 founds the cluster (it creates the tree).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub node_id: u8,
    /// Founding nodes' addresses in node-id order, this node's own included
    /// (all founders are started with the same list).
    #[arg(
        long,
        value_name = "ADDR[,ADDR...]",
        value_delimiter = ',',
        conflicts_with = "join"
    )]
    pub peers: Vec<String>,
    /// Join a running cluster through this member (a seed).
    #[arg(long, value_name = "ADDR")]
    pub join: Option<String>,
    /// The address other processes reach this node at (default: the
    /// listening address; needed when listening on 0.0.0.0).
    #[arg(long, value_name = "ADDR")]
    pub advertise: Option<String>,
    /// Where this node keeps its page files.
    #[arg(long, value_name = "PATH")]
    pub data_dir: Option<PathBuf>,
    /// This node's page cache, MiB.
    #[arg(long, value_name = "MB", default_value_t = dmkv_bench::defaults::CACHE_MB)]
    pub cache_mb: u64,
    /// Worker threads that run the key-value operations sent to this node.
    #[arg(long, value_name = "W", default_value_t = 2)]
    pub workers: usize,
    /// Message handler threads.
    #[arg(long, value_name = "M", default_value_t = dmkv_bench::defaults::MEMNODE_THREADS)]
    pub threads: usize,
    /// A file holding the cluster secret (else the DMKV_SECRET environment variable).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Name shared by every node of one cluster.
    #[arg(long, value_name = "NAME", default_value = "dmkv-node")]
    pub instance: String,
    /// A ScaleStore setting, e.g. --set scalestore.protocol=fifo (the same on every node).
    #[arg(long = "set", value_name = "scalestore.KNOB=VALUE")]
    pub set: Vec<String>,
    /// Exit when standard input closes.
    #[arg(long)]
    pub exit_on_stdin_eof: bool,
}

#[derive(Debug, Args)]
pub struct NodeCtlArgs {
    /// The node process to talk to.
    #[arg(long, value_name = "ADDR")]
    pub addr: String,
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    #[command(subcommand)]
    pub action: NodeCtlAction,
}

#[derive(Debug, Clone, Subcommand)]
pub enum NodeCtlAction {
    /// Hand this node's pages and directory over to another member and leave.
    Leave,
    /// The members this node knows.
    Members,
    /// This node's engine_stats (JSON).
    Stats,
}

/// The per-node figures of a run against node processes (`engine_stats`
/// of `--node-addr` runs: `per_node` rows with `*_per_op` figures), as a
/// table after the main report; nothing for other runs.
pub fn print_per_node(
    out: &mut dyn std::io::Write,
    reports: &[dmkv_bench::EngineReport],
) -> std::io::Result<()> {
    for r in reports {
        let Some(rows) = r.engine_stats["per_node"].as_array() else {
            continue;
        };
        if !rows
            .iter()
            .any(|n| n.get("messages_total_per_op").is_some() || n.get("unreachable").is_some())
        {
            continue;
        }
        writeln!(out)?;
        writeln!(
            out,
            "{}: per node (figures of the run; per op = per operation that node's workers ran)",
            r.engine
        )?;
        writeln!(
            out,
            "  {:>5} {:>9} {:>9} {:>13} {:>11} {:>10}  state",
            "node", "ops", "msgs/op", "remote pg/op", "ssd pg/op", "evictions"
        )?;
        for n in rows {
            let id = n["node"].as_u64().unwrap_or(0);
            if let Some(e) = n["unreachable"].as_str() {
                let why = if n["left"].as_bool() == Some(true) {
                    "left during the run".to_string()
                } else {
                    format!("unreachable: {e}")
                };
                writeln!(out, "  {id:>5} {why}")?;
                continue;
            }
            let per_op = |k: &str| {
                n[format!("{k}_per_op")]
                    .as_f64()
                    .map_or_else(|| "-".to_string(), |x| format!("{x:.3}"))
            };
            writeln!(
                out,
                "  {id:>5} {:>9} {:>9} {:>13} {:>11} {:>10}  {}",
                n["ops"].as_u64().unwrap_or(0),
                per_op("messages_total"),
                per_op("pages_from_remote_memory"),
                per_op("pages_from_ssd"),
                n["evictions"].as_u64().unwrap_or(0),
                n["state"].as_str().unwrap_or("?"),
            )?;
        }
    }
    Ok(())
}

#[cfg(feature = "ucx")]
pub use with_ucx::{node, node_ctl, node_deployer};

#[cfg(feature = "ucx")]
mod with_ucx {
    use super::{NodeArgs, NodeCtlAction, NodeCtlArgs};
    use crate::ucx::read_secret;
    use dmkv_api::deploy::{DeployOptions, checked_client};
    use dmkv_api::{Engine, EngineSpec, Knobs, KvError, KvStore};
    use dmkv_bench::{Deployer, Deployment};
    use dmkv_memnode::{NodeRuntime, NodeStats};
    use dmkv_scalestore::process::{
        Linker, NodeOptions, NodeProcess, RemoteEngine, Start, ask_to_leave, members_of, stats_of,
    };
    use dmkv_transport::exec::block_on;
    use dmkv_transport::{Endpoint, NodeId, OpKind, labeled};
    use dmkv_transport_ucx::{UcxCluster, UcxConfig};
    use std::io::Write;
    use std::net::ToSocketAddrs;
    use std::path::Path;
    use std::rc::Rc;
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    /// The line a node prints when it serves, followed by its address.
    pub const LISTENING: &str = "dmkv node listening on";
    /// How long a founder waits for the other founders' processes.
    const PEER_WAIT: Duration = Duration::from_secs(120);

    fn secret(file: Option<&Path>) -> Result<Vec<u8>, String> {
        read_secret(file)?.ok_or_else(|| {
            "the cluster secret is needed: --secret-file PATH or DMKV_SECRET".to_string()
        })
    }

    fn knobs(sets: &[String]) -> Result<Knobs, String> {
        let mut k = Knobs::new();
        for s in sets {
            let (name, value) = s
                .split_once('=')
                .ok_or_else(|| format!("--set {s:?} is not scalestore.KNOB=VALUE"))?;
            let knob = name
                .strip_prefix("scalestore.")
                .filter(|k| !k.is_empty())
                .ok_or_else(|| format!("--set {s}: a node takes scalestore.KNOB=VALUE only"))?;
            k.set(knob, value);
        }
        k.check("scalestore", dmkv_scalestore::SCALESTORE.knobs())
            .map_err(|e| e.to_string())?;
        Ok(k)
    }

    /// `dmkv node`: serves one ScaleStore node until it is asked to leave
    /// (then exits 0), killed, or (with --exit-on-stdin-eof) stdin closes.
    pub fn node(a: NodeArgs, out: &mut dyn Write) -> Result<i32, String> {
        let secret = secret(a.secret_file.as_deref())?;
        let knobs = knobs(&a.set)?;
        if a.node_id as usize >= dmkv_scalestore::node::MAX_MEMBERS {
            return Err(format!(
                "--node-id must be below {}",
                dmkv_scalestore::node::MAX_MEMBERS
            ));
        }
        if a.threads == 0 || a.workers == 0 || a.cache_mb == 0 {
            return Err("--threads, --workers and --cache-mb must be at least 1".into());
        }
        let listen = a
            .listen
            .to_socket_addrs()
            .map_err(|e| format!("--listen {}: {e}", a.listen))?
            .next()
            .ok_or_else(|| format!("--listen {} resolves to nothing", a.listen))?;
        let id = NodeId(u16::from(a.node_id));
        let cluster = UcxCluster::new(UcxConfig::new(secret), id)
            .map_err(|e| format!("cannot start UCX: {e}"))?;
        let served = cluster
            .serve(id, listen, a.threads)
            .map_err(|e| format!("cannot listen on {listen}: {e}"))?;
        let advertise = match &a.advertise {
            Some(x) => x.clone(),
            None if served.listen_addr().ip().is_unspecified() => {
                return Err(format!(
                    "listening on {}: say with --advertise ADDR where peers reach this node",
                    served.listen_addr()
                ));
            }
            None => served.listen_addr().to_string(),
        };
        let rt = NodeRuntime::new(served);
        let link = cluster.peer_linker();
        let linker: Linker = Arc::new(move |n: NodeId, addr: &str| {
            link.link(n, addr).map_err(|e| format!("{addr}: {e}"))
        });
        let mut known = Vec::new();
        let start = match (&a.join, a.peers.is_empty()) {
            (Some(seed), _) => {
                let seed_id = cluster
                    .connect(seed.as_str())
                    .map_err(|e| format!("the seed {seed}: {e}"))?;
                let ep = cluster.fabric().endpoint(id).map_err(|e| e.to_string())?;
                let (instance, members) = block_on(members_of(&ep, seed_id))
                    .map_err(|e| format!("asking {seed} for its members: {e}"))?;
                if instance != a.instance {
                    return Err(format!(
                        "{seed} serves cluster {instance:?}, not {:?} (--instance)",
                        a.instance
                    ));
                }
                if let Some(m) = members.iter().find(|m| m.addr.is_empty()) {
                    return Err(format!(
                        "{seed} does not know the address of member {}",
                        m.index
                    ));
                }
                Start::Join { members }
            }
            (None, false) => {
                let count = u8::try_from(a.peers.len())
                    .ok()
                    .filter(|&c| (c as usize) <= dmkv_scalestore::node::MAX_MEMBERS)
                    .ok_or("too many --peers")?;
                if a.node_id >= count {
                    return Err(format!(
                        "--node-id {} is not among the {count} --peers (founders are 0..{count})",
                        a.node_id
                    ));
                }
                let deadline = Instant::now() + PEER_WAIT;
                for (i, addr) in a.peers.iter().enumerate() {
                    if i == a.node_id as usize {
                        continue;
                    }
                    let n = NodeId(i as u16);
                    // The other founders start at about the same time.
                    loop {
                        match linker(n, addr) {
                            Ok(()) => break,
                            Err(e) if Instant::now() > deadline => {
                                return Err(format!("founding node {i}: {e}"));
                            }
                            Err(_) => std::thread::sleep(Duration::from_millis(100)),
                        }
                    }
                    known.push((n, addr.clone()));
                }
                Start::Found { count }
            }
            (None, true) => {
                if a.node_id != 0 {
                    return Err("a node without --peers or --join founds a one-node cluster and must be --node-id 0".into());
                }
                Start::Found { count: 1 }
            }
        };
        let opts = NodeOptions {
            instance: a.instance.clone(),
            index: a.node_id,
            workers: a.workers,
            advertise: advertise.clone(),
            known_addrs: known,
            knobs,
            cache_mb: a.cache_mb,
            data_dir: a.data_dir.clone(),
        };
        let proc = Arc::new(
            NodeProcess::start(&rt, &opts, &start, linker)
                .map_err(|e| format!("cannot start node {}: {e}", a.node_id))?,
        );
        leave_on_signal(&proc, a.node_id)?;
        writeln!(out, "{LISTENING} {advertise}").map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
        if a.exit_on_stdin_eof {
            let stdin = crate::ucx::ParentStdin::open()?;
            std::thread::spawn(move || {
                stdin.wait_for_eof();
                std::process::exit(crate::cli::EXIT_OK);
            });
        }
        proc.wait_left();
        writeln!(out, "dmkv node {} left the cluster", a.node_id).map_err(|e| e.to_string())?;
        out.flush().map_err(|e| e.to_string())?;
        // Clients still sending here are told "not a member" for a moment
        // (they move on to another node) before the process goes.
        std::thread::sleep(Duration::from_secs(1));
        drop(proc);
        drop(rt);
        drop(cluster);
        Ok(crate::cli::EXIT_OK)
    }

    /// SIGTERM (or SIGINT) makes the node leave as `dmkv node-ctl leave`
    /// does: hand its pages and directory share to another member, after
    /// which `wait_left` returns and the process exits 0. A leave that is
    /// refused (the last member has nobody to hand over to; every other
    /// member is leaving too; it still adopts a leaver's shard) keeps the
    /// node serving, so nothing is lost: the last member never exits on a
    /// signal, since it holds the only copy of the data. Another signal
    /// tries again, and SIGKILL stops it without a handover.
    fn leave_on_signal(proc: &Arc<NodeProcess>, index: u8) -> Result<(), String> {
        use signal_hook::consts::{SIGINT, SIGTERM};
        let mut signals = signal_hook::iterator::Signals::new([SIGTERM, SIGINT])
            .map_err(|e| format!("cannot handle SIGTERM: {e}"))?;
        let proc = Arc::downgrade(proc);
        std::thread::spawn(move || {
            for sig in signals.forever() {
                let Some(p) = proc.upgrade() else { return };
                eprintln!("dmkv node {index}: signal {sig}: leaving the cluster");
                match p.leave() {
                    Ok(succ) => {
                        eprintln!("dmkv node {index}: handed over to node {succ}");
                        return;
                    }
                    Err(e) => eprintln!(
                        "dmkv node {index}: leave refused: {e}; still serving, not exiting (signal again to retry; SIGKILL stops it without a handover, losing the pages and directory entries it holds)"
                    ),
                }
            }
        });
        Ok(())
    }

    /// A UCX cluster view for a process that only issues.
    fn client_cluster(secret_file: Option<&Path>, id: u16) -> Result<UcxCluster, String> {
        UcxCluster::new(UcxConfig::new(secret(secret_file)?), NodeId(id))
            .map_err(|e| format!("cannot start UCX: {e}"))
    }

    /// `dmkv node-ctl --addr A leave|members|stats`.
    pub fn node_ctl(a: NodeCtlArgs, out: &mut dyn Write) -> Result<i32, String> {
        // An issuing id distinct from the bench's (60000).
        let cluster = client_cluster(a.secret_file.as_deref(), 61000)?;
        let n = cluster
            .connect(a.addr.as_str())
            .map_err(|e| format!("{}: {e}", a.addr))?;
        let ep = cluster
            .fabric()
            .endpoint(NodeId(61000))
            .map_err(|e| e.to_string())?;
        match a.action {
            NodeCtlAction::Leave => {
                let succ = block_on(ask_to_leave(&ep, n)).map_err(|e| format!("leave: {e}"))?;
                writeln!(out, "node {n} left, handing over to node {succ}")
            }
            NodeCtlAction::Members => {
                let (instance, members) =
                    block_on(members_of(&ep, n)).map_err(|e| format!("members: {e}"))?;
                writeln!(out, "cluster {instance}").and_then(|()| {
                    members
                        .iter()
                        .try_for_each(|m| writeln!(out, "{} {} {}", m.index, m.node, m.addr))
                })
            }
            NodeCtlAction::Stats => {
                let s = block_on(stats_of(&ep, n)).map_err(|e| format!("stats: {e}"))?;
                writeln!(out, "{s}")
            }
        }
        .map_err(|e| e.to_string())?;
        Ok(crate::cli::EXIT_OK)
    }

    /// `dmkv bench --transport ucx --node-addr ...`: drives running node
    /// processes (they outlive the run; every run loads its keys again).
    #[derive(Debug)]
    struct NodeDeployer {
        addrs: Vec<String>,
        secret: Vec<u8>,
    }

    struct NodeDeployment {
        engine: Arc<dyn Engine>,
        nodes: Vec<NodeId>,
        compute: NodeId,
        // Last: closes the connections.
        cluster: UcxCluster,
    }

    impl Deployment for NodeDeployment {
        fn engine(&self) -> &Arc<dyn Engine> {
            &self.engine
        }
        fn endpoint(&self, _thread: usize) -> Rc<Endpoint> {
            Rc::new(
                self.cluster
                    .fabric()
                    .endpoint(self.compute)
                    .expect("this process's own node"),
            )
        }
        fn client(&self, thread: usize) -> Result<(Rc<Endpoint>, Rc<dyn KvStore>), KvError> {
            checked_client(&self.engine, self.endpoint(thread), thread)
        }
        fn node_stats(&self) -> Vec<NodeStats> {
            let Ok(ep) = self.cluster.fabric().endpoint(self.compute) else {
                return self.nodes.iter().map(|_| NodeStats::default()).collect();
            };
            self.nodes
                .iter()
                .map(|&n| {
                    block_on(labeled(OpKind::Setup, async {
                        let svc = ep.lookup_service(n, NodeRuntime::STATS_SERVICE).await?;
                        let reply = ep.call(n, svc, Vec::new()).await?;
                        Ok::<_, dmkv_transport::TransportError>(NodeStats::decode(&reply)?)
                    }))
                    .unwrap_or_default()
                })
                .collect()
        }
    }

    impl Deployer for NodeDeployer {
        fn transport(&self) -> &'static str {
            "ucx"
        }
        fn deploy(
            &self,
            spec: &'static dyn EngineSpec,
            opts: &DeployOptions,
        ) -> Result<Box<dyn Deployment>, KvError> {
            if spec.name() != "scalestore" {
                return Err(KvError::Config(format!(
                    "--node-addr drives ScaleStore node processes (dmkv node); {} runs on memory nodes (--memnode-addr)",
                    spec.name()
                )));
            }
            if !opts.knobs.is_empty() {
                return Err(KvError::Config(
                    "scalestore settings belong to the node processes (dmkv node --set ...)".into(),
                ));
            }
            let compute = NodeId(60000);
            let cluster = UcxCluster::new(UcxConfig::new(self.secret.clone()), compute)?;
            let mut nodes = Vec::new();
            for a in &self.addrs {
                nodes.push(
                    cluster
                        .connect(a.as_str())
                        .map_err(|e| KvError::Config(format!("node {a}: {e}")))?,
                );
            }
            let engine = RemoteEngine::new(cluster.fabric(), compute, nodes.clone())?;
            Ok(Box::new(NodeDeployment {
                engine: Arc::new(engine),
                nodes,
                compute,
                cluster,
            }))
        }
    }

    pub fn node_deployer(
        addrs: &[String],
        secret_file: Option<&Path>,
    ) -> Result<Arc<dyn Deployer>, String> {
        Ok(Arc::new(NodeDeployer {
            addrs: addrs.to_vec(),
            secret: secret(secret_file)?,
        }))
    }
}
