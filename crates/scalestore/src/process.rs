//! One ScaleStore node per process (`dmkv node`), and the compute side
//! that drives such nodes from another process (`dmkv bench --node-addr`).
//!
//! Transport-independent: the node side runs on any [`NodeRuntime`] (UCX in
//! `dmkv node`, the local backend in tests); whatever is specific to a
//! transport (connecting to a peer by address) comes in as a [`Linker`].
//!
//! - [`NodeProcess`] serves one node (`ScaleStoreSpec::serve`), connects to
//!   it (`ScaleStoreSpec::connect`, which introduces a founding node to the
//!   other founders) or joins a running cluster ([`ScaleNode::join`]), and
//!   serves the **control service** [`CTL_SERVICE`]: key-value operations
//!   run by the node's own workers (a pool of `workers` threads, each with
//!   its own endpoint and B-tree client), the node's `engine_stats`, the
//!   members it knows with their addresses, linking a new peer, and leaving
//!   ([`ScaleNode::leave`]: hand everything over, then refuse work).
//! - [`RemoteEngine`] is an [`Engine`] whose clients send each operation to
//!   one node's control service: compute thread `t` uses node `t % K` of
//!   the listed nodes, so every node's workers run a share of the workload
//!   (in the paper every node is also a client). A node that answers "not
//!   a member" (it left or is leaving) is skipped for good and the
//!   operation goes to the next; so is a node that cannot be reached if
//!   another node says it departed. A node that cannot be reached and was
//!   not seen to leave (killed) is an error: ScaleStore does not replicate,
//!   so its pages are gone (docs/scalestore.md, "Nodes as processes").
//!
//! Membership changes must happen one at a time across the cluster (the
//! in-process engine takes a lock for that; processes cannot): start a
//! joiner or ask a node to leave only after the previous change returned.

use crate::engine::SCALESTORE;
use crate::node::{NodeState, ScaleNode};
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KvError, KvStore, Result, ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::exec::block_on;
use dmkv_transport::{
    Endpoint, Fabric, NodeId, Responder, RpcContext, ServiceError, ServiceId, TransportError,
    WireReader, WireWriter,
};
use parking_lot::Mutex;
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Weak};

/// The control service of a node process.
pub const CTL_SERVICE: &str = "scalestore-node/ctl";

/// Operation codes of the control service.
mod op {
    pub const GET: u8 = 1;
    pub const INSERT: u8 = 2;
    pub const UPDATE: u8 = 3;
    pub const UPSERT: u8 = 4;
    pub const DELETE: u8 = 5;
    pub const SCAN: u8 = 6;
    /// count u32, then (key u64, value bytes) x count: upserts.
    pub const LOAD: u8 = 7;
    /// Reply: the node's `engine_stats` as JSON text.
    pub const STATS: u8 = 8;
    /// Reply: instance str, count u32, (index u8, node u16, addr str, left u8) x count.
    pub const MEMBERS: u8 = 9;
    /// node u16, addr str: make `node` reachable from this process.
    pub const LINK: u8 = 10;
    /// Reply: successor index u8, once the handover is done.
    pub const LEAVE: u8 = 11;
}

/// Reply status bytes.
const OK: u8 = 0;
/// This node is not (or no longer) a member: nothing was done; ask another.
const NOT_MEMBER: u8 = 1;
/// The operation failed: error kind u8, message str.
const FAILED: u8 = 2;

/// How long a founder waits for the other founders to be served.
const FOUNDER_WAIT_MS: u64 = 120_000;

/// Largest scan a control request may ask for.
const MAX_SCAN: u32 = 1 << 20;

/// Connects this process to node `node` serving at `addr` (UCX: a control
/// connection; in-process backends: nothing to do).
pub type Linker = Arc<dyn Fn(NodeId, &str) -> std::result::Result<(), String> + Send + Sync>;

/// How a node process starts.
#[derive(Clone)]
pub struct NodeOptions {
    /// Instance name shared by every node of the cluster.
    pub instance: String,
    /// This node's member index (also its shard and its transport node id).
    pub index: u8,
    /// Worker threads that run key-value operations sent to this node.
    pub workers: usize,
    /// The address other processes reach this node at (told to peers).
    pub advertise: String,
    /// Addresses of other nodes this process already reaches (founders),
    /// told to joiners that ask for the members.
    pub known_addrs: Vec<(NodeId, String)>,
    /// `serve` arguments: knobs, cache size, data directory.
    pub knobs: dmkv_api::Knobs,
    pub cache_mb: u64,
    pub data_dir: Option<std::path::PathBuf>,
}

/// Who the node starts with.
#[derive(Clone, Debug)]
pub enum Start {
    /// A founding node: the founders are nodes `0..count`, all started
    /// together (node 0 creates the tree).
    Found { count: u8 },
    /// Joins a running cluster whose members (index, node, address) were
    /// learnt from a seed node's control service ([`members_of`]).
    Join { members: Vec<PeerInfo> },
}

/// A member as a control service describes it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PeerInfo {
    pub index: u8,
    pub node: NodeId,
    pub addr: String,
}

/// A job for the node's workers.
struct Job {
    req: Vec<u8>,
    responder: Responder,
}

/// What the control service and the workers share.
struct Inner {
    node: Arc<ScaleNode>,
    engine: Arc<dyn Engine>,
    instance: String,
    linker: Linker,
    /// Addresses of nodes this process knows (its own included).
    addrs: Mutex<BTreeMap<u16, String>>,
    jobs: Mutex<Option<mpsc::Sender<Job>>>,
    /// Set once the node left: the process may exit.
    left: AtomicBool,
    leaving: AtomicBool,
    /// Set when a member was found down (killed): this node then refuses
    /// every operation (fail-stop; see the module doc).
    dead: Mutex<Option<String>>,
}

impl Inner {
    fn mark_dead(&self, index: u8, node: NodeId, why: &str) {
        let mut d = self.dead.lock();
        if d.is_none() {
            *d = Some(format!(
                "scalestore member {index} ({node}) is down ({why}): ScaleStore keeps no replicas, \
                 so the pages it cached and the directory it held are lost; node {} refuses \
                 operations from now on",
                self.node.index
            ));
        }
    }
}

/// One ScaleStore node served by this process; see the module doc.
pub struct NodeProcess {
    inner: Arc<Inner>,
    rt: Arc<NodeRuntime>,
    done: Mutex<Option<mpsc::Receiver<()>>>,
    done_tx: Arc<Mutex<Option<mpsc::Sender<()>>>>,
}

fn ctl_err(e: impl std::fmt::Display) -> KvError {
    KvError::Config(e.to_string())
}

fn serve_args(opts: &NodeOptions, count: usize) -> ServeArgs {
    ServeArgs {
        instance: opts.instance.clone(),
        knobs: opts.knobs.clone(),
        node_index: opts.index as usize,
        nodes: (0..count as u16).collect(),
        expected_keys: 0,
        value_size: 8,
        cache_mb: opts.cache_mb,
        data_dir: opts.data_dir.clone(),
    }
}

impl NodeProcess {
    /// Serves node `opts.index` on `rt` and makes it a member (founding
    /// with the other founders, which must be served too, or joining
    /// through `members`). `rt`'s node id must equal the index.
    pub fn start(
        rt: &Arc<NodeRuntime>,
        opts: &NodeOptions,
        start: &Start,
        linker: Linker,
    ) -> Result<NodeProcess> {
        if rt.id() != NodeId(u16::from(opts.index)) {
            return Err(ctl_err(format!(
                "node index {} must be served as transport node {}",
                opts.index, opts.index
            )));
        }
        if opts.cache_mb == 0 && opts.knobs.iter().all(|(k, _)| k != "cache_pages") {
            return Err(ctl_err(
                "a node process needs a cache size: --cache-mb 1 or more",
            ));
        }
        if opts.workers == 0 {
            return Err(ctl_err("a node needs at least one worker thread"));
        }
        let mut knobs = opts.knobs.clone();
        for (k, _) in knobs.iter() {
            if k == "join" || k == "leave" {
                return Err(ctl_err(format!(
                    "scalestore.{k} is for in-process runs; node processes join with --join and leave on request"
                )));
            }
        }
        let args = match start {
            Start::Found { count } => {
                if opts.index >= *count {
                    return Err(ctl_err(format!(
                        "founding node {} of {count}: founders are nodes 0..{count}",
                        opts.index
                    )));
                }
                serve_args(opts, *count as usize)
            }
            Start::Join { members } => {
                if opts.index == 0 {
                    return Err(ctl_err("node 0 founds the cluster and cannot join it"));
                }
                if members.iter().any(|m| m.index == opts.index) {
                    return Err(ctl_err(format!(
                        "the cluster already has a member {}",
                        opts.index
                    )));
                }
                // Served dormant: `join` (never fired by operation counts)
                // keeps it out of the cluster until `ScaleNode::join`.
                knobs.set("join", &format!("{}@{}", opts.index, u64::MAX));
                let mut a = serve_args(opts, opts.index as usize + 1);
                a.knobs = knobs.clone();
                a
            }
        };
        SCALESTORE.serve(rt, &args)?;
        let node: Arc<ScaleNode> = rt
            .attachment::<ScaleNode>(&args.name("node"))
            .ok_or_else(|| ctl_err("the served node is not attached"))?;
        let mut addrs = BTreeMap::new();
        addrs.insert(u16::from(opts.index), opts.advertise.clone());
        for (n, a) in &opts.known_addrs {
            addrs.insert(n.0, a.clone());
        }
        if let Start::Join { members } = start {
            // Everybody must reach us before we introduce ourselves.
            for m in members {
                linker(m.node, &m.addr).map_err(ctl_err)?;
                addrs.insert(m.node.0, m.addr.clone());
            }
            let ep = rt.host().fabric().endpoint(rt.id())?;
            for m in members {
                let mut w = WireWriter::new();
                w.u8(op::LINK).u16(rt.id().0).str(&opts.advertise);
                block_on(call_ctl(&ep, m.node, w.finish()))
                    .map_err(|e| ctl_err(format!("node {} cannot link to us: {e}", m.index)))?;
            }
        }
        if let Start::Found { count } = start {
            // The founders start together: each introduces itself to the
            // others once their message services exist.
            let ep = rt.host().fabric().endpoint(rt.id())?;
            let name = crate::membership::service_name(&opts.instance);
            for i in 0..*count {
                let mut waited = 0u64;
                while block_on(ep.lookup_service(NodeId(u16::from(i)), &name)).is_err() {
                    if waited >= FOUNDER_WAIT_MS {
                        return Err(ctl_err(format!(
                            "founding node {i} did not come up within {} s",
                            FOUNDER_WAIT_MS / 1000
                        )));
                    }
                    dmkv_transport::time::sleep_blocking(std::time::Duration::from_millis(20));
                    waited += 20;
                }
            }
        }
        let engine = SCALESTORE.connect(ConnectArgs {
            fabric: rt.host().fabric(),
            compute_node: rt.id(),
            serve: ServeArgs {
                node_index: 0,
                ..args.clone()
            },
            threads: opts.workers,
            hosted: vec![rt.clone()],
            counters_from: None,
        })?;
        if let Start::Join { members } = start {
            let peers: Vec<(u8, NodeId)> = members.iter().map(|m| (m.index, m.node)).collect();
            let n = node.clone();
            let instance = opts.instance.clone();
            // `join` blocks on the network; it runs on a thread of its own.
            let (tx, rx) = mpsc::channel();
            let h = dmkv_transport::exec::spawn_background("scalestore-join", async move {
                let _ = tx.send(n.join(&instance, &peers));
            });
            h.join();
            rx.recv().map_err(|_| ctl_err("the join panicked"))??;
        }
        let (tx, rx) = mpsc::channel::<Job>();
        let rx = Arc::new(Mutex::new(rx));
        let inner = Arc::new(Inner {
            node: node.clone(),
            engine,
            instance: opts.instance.clone(),
            linker,
            addrs: Mutex::new(addrs),
            jobs: Mutex::new(Some(tx)),
            left: AtomicBool::new(false),
            leaving: AtomicBool::new(false),
            dead: Mutex::new(None),
        });
        drop(dmkv_transport::exec::spawn_background(
            "scalestore-monitor",
            {
                let weak = Arc::downgrade(&inner);
                async move { monitor(weak) }
            },
        ));
        let pool = rt.worker_pool(&format!("{}-ctl-workers", opts.instance), opts.workers);
        for t in 0..opts.workers {
            let weak = Arc::downgrade(&inner);
            let rx = rx.clone();
            pool.submit(move || worker_loop(weak, rx, t));
        }
        let (done_tx, done_rx) = mpsc::channel();
        let done_tx = Arc::new(Mutex::new(Some(done_tx)));
        let weak = Arc::downgrade(&inner);
        let done = done_tx.clone();
        // Held by the service (the pool lives as long as the service).
        let pool_keep = pool.clone();
        rt.register_deferred_service(
            CTL_SERVICE,
            Arc::new(move |_: &RpcContext, req: &[u8], r: Responder| {
                let _ = &pool_keep;
                match weak.upgrade() {
                    Some(inner) => ctl(&inner, &done, req, r),
                    None => r.reply(Err(ServiceError::failed("the node is shutting down"))),
                }
            }),
        )
        .map_err(ctl_err)?;
        Ok(NodeProcess {
            inner,
            rt: rt.clone(),
            done: Mutex::new(Some(done_rx)),
            done_tx,
        })
    }

    /// The node served here.
    pub fn node(&self) -> &Arc<ScaleNode> {
        &self.inner.node
    }

    /// Blocks until the node left the cluster (a `LEAVE` request).
    pub fn wait_left(&self) {
        if let Some(rx) = self.done.lock().take() {
            let _ = rx.recv();
        }
    }

    /// Whether the node left.
    pub fn left(&self) -> bool {
        self.inner.left.load(Ordering::SeqCst)
    }

    /// Leaves the cluster from this process (what `LEAVE` does); returns
    /// the successor's index.
    pub fn leave(&self) -> Result<u8> {
        leave(&self.inner, &self.done_tx)
    }
}

impl Drop for NodeProcess {
    fn drop(&mut self) {
        // Workers stop when their channel closes.
        self.inner.jobs.lock().take();
        self.rt.remove_prefixed(CTL_SERVICE);
    }
}

fn leave(inner: &Arc<Inner>, done: &Arc<Mutex<Option<mpsc::Sender<()>>>>) -> Result<u8> {
    if inner.leaving.swap(true, Ordering::SeqCst) {
        return Err(ctl_err("this node is already leaving"));
    }
    let node = inner.node.clone();
    let (tx, rx) = mpsc::channel();
    let h = dmkv_transport::exec::spawn_background("scalestore-leave", async move {
        let _ = tx.send(node.leave());
    });
    h.join();
    let r = rx
        .recv()
        .map_err(|_| KvError::Corrupt("the leave panicked".into()))?;
    match r {
        Ok(succ) => {
            inner.left.store(true, Ordering::SeqCst);
            if let Some(tx) = done.lock().take() {
                let _ = tx.send(());
            }
            Ok(succ)
        }
        Err(e) => {
            inner.leaving.store(false, Ordering::SeqCst);
            Err(e)
        }
    }
}

/// The control service's dispatch (a handler thread: nothing here waits).
fn ctl(inner: &Arc<Inner>, done: &Arc<Mutex<Option<mpsc::Sender<()>>>>, req: &[u8], r: Responder) {
    let Some(&code) = req.first() else {
        return r.reply(Err(ServiceError::malformed("empty control request")));
    };
    match code {
        op::MEMBERS => {
            let r2 = members_reply(inner);
            r.reply(Ok(r2));
        }
        op::LEAVE => {
            if req.len() != 1 {
                return r.reply(Err(ServiceError::malformed("LEAVE takes nothing")));
            }
            let inner = inner.clone();
            let done = done.clone();
            // The handover sends messages and waits: off the handler thread.
            drop(dmkv_transport::exec::spawn_background(
                "scalestore-ctl-leave",
                async move {
                    let out = match leave(&inner, &done) {
                        Ok(succ) => {
                            let mut w = WireWriter::new();
                            w.u8(OK).u8(succ);
                            w.finish()
                        }
                        Err(e) => failed(&e),
                    };
                    r.reply(Ok(out));
                },
            ));
        }
        op::GET..=op::STATS | op::LINK => {
            let jobs = inner.jobs.lock().clone();
            match jobs {
                Some(tx) => {
                    if let Err(mpsc::SendError(job)) = tx.send(Job {
                        req: req.to_vec(),
                        responder: r,
                    }) {
                        job.responder
                            .reply(Err(ServiceError::failed("the node's workers stopped")));
                    }
                }
                None => r.reply(Err(ServiceError::failed("the node is shutting down"))),
            }
        }
        c => r.reply(Err(ServiceError::malformed(format!(
            "unknown control operation {c}"
        )))),
    }
}

fn members_reply(inner: &Inner) -> Vec<u8> {
    let node = &inner.node;
    let addrs = inner.addrs.lock();
    let mut list: Vec<(u8, NodeId)> = node
        .members()
        .into_iter()
        .map(|(i, m)| (i, m.node))
        .collect();
    let me_member = node.state() == NodeState::Active;
    if me_member {
        list.push((node.index, node.id));
    }
    list.sort();
    let mut w = WireWriter::new();
    w.u8(OK).str(&inner.instance).u32(list.len() as u32);
    for (i, n) in list {
        w.u8(i)
            .u16(n.0)
            .str(addrs.get(&n.0).map_or("", String::as_str));
    }
    w.finish()
}

fn failed(e: &KvError) -> Vec<u8> {
    let kind = match e {
        KvError::Config(_) => 0,
        KvError::Exhausted(_) => 1,
        KvError::Corrupt(_) => 2,
        _ => 3,
    };
    let msg = match e {
        KvError::Config(m) | KvError::Exhausted(m) | KvError::Corrupt(m) => m.clone(),
        e => e.to_string(),
    };
    let mut w = WireWriter::new();
    w.u8(FAILED).u8(kind).str(&msg);
    w.finish()
}

fn not_member() -> Vec<u8> {
    vec![NOT_MEMBER]
}

/// One worker thread: its own endpoint and B-tree client; runs jobs one at
/// a time until the channel closes.
fn worker_loop(weak: Weak<Inner>, rx: Arc<Mutex<mpsc::Receiver<Job>>>, thread: usize) {
    let client: Option<Rc<dyn KvStore>> = weak.upgrade().and_then(|inner| {
        let ep = Rc::new(inner.node.fabric.endpoint(inner.node.id).ok()?);
        block_on(inner.engine.client(ep, thread)).ok()
    });
    loop {
        let job = match rx.lock().recv() {
            Ok(j) => j,
            Err(_) => return,
        };
        let Some(inner) = weak.upgrade() else {
            job.responder
                .reply(Err(ServiceError::failed("the node is shutting down")));
            return;
        };
        let out = match &client {
            Some(c) => run_job(&inner, c, &job.req),
            None => Err(ServiceError::failed("the node's worker has no client")),
        };
        job.responder.reply(out);
    }
}

fn run_job(
    inner: &Inner,
    c: &Rc<dyn KvStore>,
    req: &[u8],
) -> std::result::Result<Vec<u8>, ServiceError> {
    let mut r = WireReader::new(req);
    let code = r.u8()?;
    let node = &inner.node;
    let kv = (op::GET..=op::LOAD).contains(&code);
    if kv && node.state() != NodeState::Active {
        return Ok(not_member());
    }
    if let Some(why) = inner.dead.lock().clone()
        && code != op::STATS
    {
        return Ok(failed(&KvError::Transport(TransportError::Backend(why))));
    }
    let mut w = WireWriter::new();
    let res: Result<()> = (|| -> std::result::Result<Result<()>, ServiceError> {
        Ok(match code {
            op::GET => {
                let key = r.u64()?;
                r.end()?;
                block_on(c.get(key)).map(|v| {
                    w.u8(OK);
                    match v {
                        Some(v) => w.u8(1).bytes(&v),
                        None => w.u8(0),
                    };
                })
            }
            op::INSERT | op::UPDATE | op::UPSERT => {
                let key = r.u64()?;
                let value = r.bytes()?.to_vec();
                r.end()?;
                let f = match code {
                    op::INSERT => block_on(c.insert(key, &value)),
                    op::UPDATE => block_on(c.update(key, &value)),
                    _ => block_on(c.upsert(key, &value)),
                };
                f.map(|b| {
                    w.u8(OK).u8(b as u8);
                })
            }
            op::DELETE => {
                let key = r.u64()?;
                r.end()?;
                block_on(c.delete(key)).map(|b| {
                    w.u8(OK).u8(b as u8);
                })
            }
            op::SCAN => {
                let key = r.u64()?;
                let n = r.u32()?;
                r.end()?;
                if n > MAX_SCAN {
                    return Err(ServiceError::malformed(format!("scan of {n} pairs")));
                }
                block_on(c.scan(key, n as usize)).map(|pairs| {
                    w.u8(OK).u32(pairs.len() as u32);
                    for (k, v) in pairs {
                        w.u64(k).bytes(&v);
                    }
                })
            }
            op::LOAD => {
                let n = r.u32()?;
                let mut pairs = Vec::with_capacity((n as usize).min(1 << 16));
                for _ in 0..n {
                    let k = r.u64()?;
                    pairs.push((k, r.bytes()?.to_vec()));
                }
                r.end()?;
                let mut res = Ok(());
                for (k, v) in &pairs {
                    if let Err(e) = block_on(c.upsert(*k, v)) {
                        res = Err(e);
                        break;
                    }
                }
                res.map(|()| {
                    w.u8(OK);
                })
            }
            op::STATS => {
                r.end()?;
                let ep = inner
                    .node
                    .thread_ep()
                    .map_err(|e| ServiceError::failed(e.to_string()))?;
                block_on(inner.engine.stats(&ep)).map(|v| {
                    let mut v = v;
                    v["state"] = format!("{:?}", node.state()).to_lowercase().into();
                    v["index"] = node.index.into();
                    w.u8(OK).str(&v.to_string());
                })
            }
            op::LINK => {
                let id = NodeId(r.u16()?);
                let addr = r.str()?.to_string();
                r.end()?;
                (inner.linker)(id, &addr).map_err(ServiceError::failed)?;
                inner.addrs.lock().insert(id.0, addr);
                w.u8(OK);
                Ok(())
            }
            c => return Err(ServiceError::malformed(format!("unknown operation {c}"))),
        })
    })()?;
    match res {
        Ok(()) => Ok(w.finish()),
        // Refused at the door (the node stopped being a member meanwhile):
        // nothing was done.
        Err(KvError::Config(m))
            if kv && node.state() != NodeState::Active && m.contains("member") =>
        {
            Ok(not_member())
        }
        Err(e) => {
            if let KvError::Transport(TransportError::NodeDown(n)) = &e
                && let Some((i, _)) = node.members().into_iter().find(|(_, m)| m.node == *n)
            {
                inner.mark_dead(i, *n, "a message to it failed");
            }
            Ok(failed(&e))
        }
    }
}

/// How often a node probes its members.
const PROBE_MS: u64 = 100;

/// Probes every member's control service; a member that is down and still
/// a member afterwards (a node that left is forgotten before it stops:
/// `Depart` reaches everybody before `leave` returns) is dead.
fn monitor(weak: Weak<Inner>) {
    let ep = match weak.upgrade() {
        Some(i) => match i.node.fabric.endpoint(i.node.id) {
            Ok(ep) => ep,
            Err(_) => return,
        },
        None => return,
    };
    loop {
        dmkv_transport::time::sleep_blocking(std::time::Duration::from_millis(PROBE_MS));
        let Some(inner) = weak.upgrade() else { return };
        if inner.dead.lock().is_some() || inner.left.load(Ordering::SeqCst) {
            return;
        }
        for (i, m) in inner.node.members() {
            let r = block_on(async {
                let svc = ep.lookup_service(m.node, CTL_SERVICE).await?;
                ep.call(m.node, svc, vec![op::MEMBERS]).await.map(drop)
            });
            if let Err(TransportError::NodeDown(_) | TransportError::Timeout { .. }) = r
                && inner.node.member(i).is_some_and(|x| x.node == m.node)
            {
                inner.mark_dead(i, m.node, "found by the liveness probe");
            }
        }
    }
}

impl NodeProcess {
    /// Why this node refuses operations, once a member was found dead.
    pub fn dead(&self) -> Option<String> {
        self.inner.dead.lock().clone()
    }
}

/// Sends a control request to `node` and returns the reply after its
/// status byte (errors turned into `KvError`s; "not a member" is
/// `Ok(None)`).
async fn call_ctl(ep: &Endpoint, node: NodeId, req: Vec<u8>) -> Result<Option<Vec<u8>>> {
    let svc = ep.lookup_service(node, CTL_SERVICE).await?;
    let reply = ep.call(node, svc, req).await?;
    decode_status(node, reply)
}

fn decode_status(node: NodeId, reply: Vec<u8>) -> Result<Option<Vec<u8>>> {
    match reply.first() {
        Some(&OK) => Ok(Some(reply[1..].to_vec())),
        Some(&NOT_MEMBER) => Ok(None),
        Some(&FAILED) => {
            let mut r = WireReader::new(&reply[1..]);
            let kind = r.u8().map_err(TransportError::from)?;
            let msg = format!("node {node}: {}", r.str().map_err(TransportError::from)?);
            Err(match kind {
                0 => KvError::Config(msg),
                1 => KvError::Exhausted(msg),
                2 => KvError::Corrupt(msg),
                _ => KvError::Transport(TransportError::Backend(msg)),
            })
        }
        _ => Err(KvError::Corrupt(format!(
            "node {node} sent a malformed control reply"
        ))),
    }
}

/// The members node `node` knows (and the instance), through its control
/// service: how a joiner learns the cluster from a seed.
pub async fn members_of(ep: &Endpoint, node: NodeId) -> Result<(String, Vec<PeerInfo>)> {
    let body = call_ctl(ep, node, vec![op::MEMBERS])
        .await?
        .ok_or_else(|| ctl_err("MEMBERS answered 'not a member'"))?;
    let mut r = WireReader::new(&body);
    let parse = |r: &mut WireReader| -> std::result::Result<_, dmkv_transport::WireError> {
        let instance = r.str()?.to_string();
        let n = r.u32()?;
        let mut out = Vec::new();
        for _ in 0..n.min(256) {
            out.push(PeerInfo {
                index: r.u8()?,
                node: NodeId(r.u16()?),
                addr: r.str()?.to_string(),
            });
        }
        r.end()?;
        Ok((instance, out))
    };
    parse(&mut r).map_err(|e| KvError::Transport(e.into()))
}

/// Asks `node` to leave the cluster; returns its successor's index once the
/// handover is done.
pub async fn ask_to_leave(ep: &Endpoint, node: NodeId) -> Result<u8> {
    let body = call_ctl(ep, node, vec![op::LEAVE])
        .await?
        .ok_or_else(|| ctl_err("the node is no member"))?;
    body.first()
        .copied()
        .ok_or_else(|| KvError::Corrupt("empty LEAVE reply".into()))
}

/// `node`'s `engine_stats` (JSON).
pub async fn stats_of(ep: &Endpoint, node: NodeId) -> Result<serde_json::Value> {
    let body = call_ctl(ep, node, vec![op::STATS])
        .await?
        .ok_or_else(|| ctl_err("the node is no member"))?;
    let mut r = WireReader::new(&body);
    let text = r.str().map_err(|e| KvError::Transport(e.into()))?;
    serde_json::from_str(text).map_err(|e| KvError::Corrupt(format!("stats of {node}: {e}")))
}

// ---- the compute side -------------------------------------------------------

/// Figures of one node that the report shows per node.
const PER_NODE: &[&str] = &[
    "messages_total",
    "pages_from_remote_memory",
    "pages_from_ssd",
    "evictions",
    "page_fixes",
    "ssd_reads",
    "ssd_writes",
];

struct Remote {
    fabric: Arc<dyn Fabric>,
    compute: NodeId,
    nodes: Vec<NodeId>,
    /// Nodes that left (skipped by every client).
    gone: Vec<AtomicBool>,
    /// Figures at the end of the load, per node.
    baseline: Mutex<HashMap<NodeId, serde_json::Value>>,
    /// Operations a client re-sent to another node after its node left.
    failovers: AtomicU64,
}

/// Drives ScaleStore node processes from this process; see the module doc.
pub struct RemoteEngine {
    shared: Arc<Remote>,
}

impl RemoteEngine {
    /// `nodes` serve [`CTL_SERVICE`] and are reachable through `fabric`;
    /// this process issues as `compute`.
    pub fn new(fabric: Arc<dyn Fabric>, compute: NodeId, nodes: Vec<NodeId>) -> Result<Self> {
        if nodes.is_empty() {
            return Err(ctl_err("no scalestore node to drive"));
        }
        let ep = fabric.endpoint(compute)?;
        for &n in &nodes {
            block_on(ep.lookup_service(n, CTL_SERVICE)).map_err(|e| {
                ctl_err(format!(
                    "{n} is not a scalestore node process (dmkv node): {e}"
                ))
            })?;
        }
        Ok(RemoteEngine {
            shared: Arc::new(Remote {
                gone: nodes.iter().map(|_| AtomicBool::new(false)).collect(),
                fabric,
                compute,
                nodes,
                baseline: Mutex::new(HashMap::new()),
                failovers: AtomicU64::new(0),
            }),
        })
    }
}

impl Remote {
    /// Whether `node` departed (another live node no longer lists it).
    async fn departed(&self, ep: &Endpoint, node: NodeId) -> bool {
        for (i, &other) in self.nodes.iter().enumerate() {
            if other == node || self.gone[i].load(Ordering::SeqCst) {
                continue;
            }
            if let Ok((_, members)) = members_of(ep, other).await {
                return !members.iter().any(|m| m.node == node);
            }
        }
        false
    }
}

struct RemoteClient {
    shared: Arc<Remote>,
    ep: Rc<Endpoint>,
    /// Position in `nodes` this client sends to.
    at: Cell<usize>,
    services: RefCell<HashMap<NodeId, ServiceId>>,
}

impl RemoteClient {
    async fn service(&self, node: NodeId) -> std::result::Result<ServiceId, TransportError> {
        if let Some(s) = self.services.borrow().get(&node) {
            return Ok(*s);
        }
        let s = self.ep.lookup_service(node, CTL_SERVICE).await?;
        self.services.borrow_mut().insert(node, s);
        Ok(s)
    }

    /// Sends `req` to this client's node, moving on to the next member
    /// when its node left; returns the reply after the status byte.
    async fn send(&self, req: Vec<u8>) -> Result<Vec<u8>> {
        let sh = &self.shared;
        let k = sh.nodes.len();
        for _ in 0..=k {
            let i = self.at.get();
            if sh.gone[i].load(Ordering::SeqCst) {
                self.at.set((i + 1) % k);
                continue;
            }
            let node = sh.nodes[i];
            let reply = match self.service(node).await {
                Ok(svc) => self.ep.call(node, svc, req.clone()).await,
                Err(e) => Err(e),
            };
            let moved_on = match reply {
                Ok(bytes) => match decode_status(node, bytes)? {
                    Some(body) => return Ok(body),
                    None => true,
                },
                Err(e) => {
                    if sh.departed(&self.ep, node).await {
                        true
                    } else {
                        return Err(KvError::Transport(e));
                    }
                }
            };
            if moved_on {
                sh.gone[i].store(true, Ordering::SeqCst);
                sh.failovers.fetch_add(1, Ordering::Relaxed);
                self.at.set((i + 1) % k);
            }
        }
        Err(ctl_err("no listed scalestore node is a member any more"))
    }
}

fn bad_reply(e: dmkv_transport::WireError) -> KvError {
    KvError::Transport(e.into())
}

fn kv_req(code: u8, key: Key, value: Option<&[u8]>) -> Vec<u8> {
    let mut w = WireWriter::new();
    w.u8(code).u64(key);
    if let Some(v) = value {
        w.bytes(v);
    }
    w.finish()
}

async fn bool_op(c: &RemoteClient, req: Vec<u8>) -> Result<bool> {
    let body = c.send(req).await?;
    let mut r = WireReader::new(&body);
    let b = r.u8().map_err(bad_reply)?;
    r.end().map_err(bad_reply)?;
    Ok(b == 1)
}

#[async_trait(?Send)]
impl KvStore for RemoteClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let body = self.send(kv_req(op::GET, key, None)).await?;
        let mut r = WireReader::new(&body);
        let out = match r.u8().map_err(bad_reply)? {
            0 => None,
            _ => Some(r.bytes().map_err(bad_reply)?.to_vec()),
        };
        r.end().map_err(bad_reply)?;
        Ok(out)
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        bool_op(self, kv_req(op::INSERT, key, Some(value))).await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        bool_op(self, kv_req(op::UPDATE, key, Some(value))).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        bool_op(self, kv_req(op::UPSERT, key, Some(value))).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        bool_op(self, kv_req(op::DELETE, key, None)).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        let n = u32::try_from(n).unwrap_or(u32::MAX).min(MAX_SCAN);
        let mut w = WireWriter::new();
        w.u8(op::SCAN).u64(start).u32(n);
        let body = self.send(w.finish()).await?;
        let mut r = WireReader::new(&body);
        let count = r.u32().map_err(bad_reply)?;
        let mut out = Vec::with_capacity(count.min(n) as usize);
        for _ in 0..count {
            let k = r.u64().map_err(bad_reply)?;
            out.push((k, r.bytes().map_err(bad_reply)?.to_vec()));
        }
        r.end().map_err(bad_reply)?;
        Ok(out)
    }
}

/// Bytes of pairs per `LOAD` request.
const LOAD_BYTES: usize = 64 << 10;

fn u(v: &serde_json::Value, k: &str) -> u64 {
    v.get(k).and_then(serde_json::Value::as_u64).unwrap_or(0)
}

#[async_trait(?Send)]
impl Engine for RemoteEngine {
    fn name(&self) -> &'static str {
        "scalestore"
    }
    fn capabilities(&self) -> Capabilities {
        SCALESTORE.capabilities()
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.shared.compute
    }
    async fn client(&self, ep: Rc<Endpoint>, thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(RemoteClient {
            shared: self.shared.clone(),
            at: Cell::new(thread % self.shared.nodes.len()),
            ep,
            services: RefCell::default(),
        }))
    }
    /// Loads in batches, round-robin over the nodes (each node's workers
    /// insert what they get, so pages start spread as in a shared load).
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let k = self.shared.nodes.len();
        let mut batch = 0usize;
        let mut start = 0;
        while start < pairs.len() {
            let mut end = start;
            let mut bytes = 0;
            while end < pairs.len() && (end == start || bytes < LOAD_BYTES) {
                bytes += 16 + pairs[end].1.len();
                end += 1;
            }
            let mut w = WireWriter::new();
            w.u8(op::LOAD).u32((end - start) as u32);
            for (key, v) in &pairs[start..end] {
                w.u64(*key).bytes(v);
            }
            let c = RemoteClient {
                shared: self.shared.clone(),
                ep: Rc::new(self.shared.fabric.endpoint(ep.node())?),
                at: Cell::new(batch % k),
                services: RefCell::default(),
            };
            c.send(w.finish()).await?;
            batch += 1;
            start = end;
        }
        Ok(())
    }
    /// Per node: its figures since the end of the load (`settle`), per
    /// operation its workers ran, beside its own full `engine_stats`.
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let base = self.shared.baseline.lock().clone();
        let mut per_node = Vec::new();
        let mut totals: BTreeMap<&str, u64> = BTreeMap::new();
        for (i, &n) in self.shared.nodes.iter().enumerate() {
            let s = match stats_of(ep, n).await {
                Ok(s) => s,
                Err(e) => {
                    per_node.push(serde_json::json!({
                        "node": n.0,
                        "unreachable": e.to_string(),
                        "left": self.shared.gone[i].load(Ordering::SeqCst),
                    }));
                    continue;
                }
            };
            let b = base.get(&n).cloned().unwrap_or_default();
            let ops = node_ops(&s).saturating_sub(node_ops(&b));
            let mut row = serde_json::json!({
                "node": n.0,
                "index": s["index"],
                "state": s["state"],
                "ops": ops,
            });
            for &k in PER_NODE {
                let d = u(&s, k).saturating_sub(u(&b, k));
                *totals.entry(k).or_default() += d;
                row[k] = d.into();
                row[format!("{k}_per_op")] = if ops == 0 {
                    serde_json::Value::Null
                } else {
                    (d as f64 / ops as f64).into()
                };
            }
            row["engine_stats"] = s;
            per_node.push(row);
        }
        let mut out = serde_json::json!({
            "deployment": "node processes (dmkv node), operations sent to their workers",
            "nodes": self.shared.nodes.len(),
            "failovers": self.shared.failovers.load(Ordering::Relaxed),
            "per_node": per_node,
        });
        for (k, v) in totals {
            out[k] = v.into();
        }
        Ok(out)
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
    /// Records every node's figures, so that `stats` reports the run alone.
    async fn settle(&self, ep: &Endpoint) -> Result<()> {
        let mut base = HashMap::new();
        for &n in &self.shared.nodes {
            if let Ok(s) = stats_of(ep, n).await {
                base.insert(n, s);
            }
        }
        *self.shared.baseline.lock() = base;
        Ok(())
    }
}

/// Operations a node's workers ran (its `engine_stats.per_node[0].ops`).
fn node_ops(s: &serde_json::Value) -> u64 {
    s["per_node"]
        .as_array()
        .and_then(|a| a.first())
        .map_or(0, |p| u(p, "ops"))
}
