//! The `scalestore` engine: every node serves (message handler, re-poll
//! thread, page provider) and issues (the compute threads the harness
//! places on it); the KvStore API is served by the B-tree over the guards.
//!
//! Elasticity (§6.6) in a run: `scalestore.join=N@OPS` keeps node `N` out
//! of the cluster until the clients have started `OPS` operations, then it
//! joins; `scalestore.leave=N@OPS` makes node `N` leave after `OPS`
//! operations (a comma-separated list makes several nodes leave, at once
//! if their counts are equal: leaves may overlap, invariant 13). A compute thread whose node is not (or no longer) a member
//! issues through another member of this process (its own endpoint there).

use crate::btree::{self, BTree, MAX_VALUE_LEN, WriteKind};
use crate::frames::Possession;
use crate::membership::{region_name, service_name};
use crate::msg::KINDS;
use crate::node::{AllocPolicy, NodeConfig, NodeState, Protocol, ScaleNode};
use crate::page::PAGE_SIZE;
use crate::pid::Pid;
use crate::worker::Worker;
use crate::{provider, repoll};
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvError, KvStore, Result,
    ServeArgs, Topology,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, Responder, RpcContext};
use parking_lot::Mutex;
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

const KNOBS: &[KnobSpec] = &[
    KnobSpec {
        name: "protocol",
        default: "chaining",
        help: "conflict handling: chaining (anticipatory chaining, §3.4.3) or fifo (directory FIFO queue, §3.4.2)",
    },
    KnobSpec {
        name: "fifo_ack",
        default: "post",
        help: "fifo only: post (the grantee posts its acknowledgement and uses the page at once, \
               awaiting the answer before its next message to the directory) or await (it waits \
               for the answer first, a round trip before the page is used; for comparison)",
    },
    KnobSpec {
        name: "alloc",
        default: "round-robin",
        help: "directory of new pages: round-robin over the nodes (remote allocation) or local",
    },
    KnobSpec {
        name: "load",
        default: "one",
        help: "who loads the data before a run: one (the harness's node inserts every key) or \
               ranges (as the paper's YCSB driver: node i of K inserts the i-th of K key-ordered \
               ranges with its own worker, so its pages start cached there)",
    },
    KnobSpec {
        name: "worker_lines",
        default: "flat",
        help: "simulated cluster only: what a worker's lines in its own node's memory cost: flat \
               (each the profile's line_ns, an LLC hit) or llc (through the node's LLC model, \
               shared with its handler cores: a miss costs dram_miss_ns; with --llc-keys the \
               paper's data size)",
    },
    KnobSpec {
        name: "free_percent",
        default: "10",
        help: "free cache slots the page provider keeps, percent of the cache",
    },
    KnobSpec {
        name: "evict_percent",
        default: "10",
        help: "coldest share of sampled frames that the page provider evicts, percent",
    },
    KnobSpec {
        name: "cache_pages",
        default: "0",
        help: "page slots of each node's cache, 64..=2^28; 0 derives them from --cache-mb \
               (and --cache-mb 0, the default, sizes every node's cache to hold the expected keys)",
    },
    KnobSpec {
        name: "slot_wait_ms",
        default: "30000",
        help: "how long a worker waits for a free cache slot before failing the operation, ms (1..=3600000)",
    },
    KnobSpec {
        name: "join",
        default: "none",
        help: "NODE@OPS: node NODE starts outside the cluster and joins once clients started OPS operations",
    },
    KnobSpec {
        name: "leave",
        default: "none",
        help: "NODE@OPS[,NODE@OPS...]: node NODE leaves (handing over its pages and directory) once clients started OPS operations; several may leave at once",
    },
];

const CAPS: Capabilities = Capabilities {
    scan: true,
    max_value_len: MAX_VALUE_LEN,
    reserved_keys: &[],
    reserved_why: "",
};

/// The spec of `scalestore`.
pub struct ScaleStoreSpec;

/// The engine spec registered as `scalestore`.
pub static SCALESTORE: ScaleStoreSpec = ScaleStoreSpec;

fn config_error(e: impl std::fmt::Display) -> KvError {
    KvError::Config(e.to_string())
}

/// A membership event of a run: node and operation count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChurnEvent {
    pub node: u8,
    pub at_ops: u64,
}

fn parse_event(knob: &str, raw: &str, nodes: usize) -> Result<Option<ChurnEvent>> {
    if raw == "none" {
        return Ok(None);
    }
    let bad = || {
        KvError::Config(format!(
            "scalestore.{knob}={raw:?}: use none or NODE@OPS with NODE < {nodes}"
        ))
    };
    let (n, o) = raw.split_once('@').ok_or_else(bad)?;
    let node: u8 = n.parse().map_err(|_| bad())?;
    let at_ops: u64 = o.parse().map_err(|_| bad())?;
    if node as usize >= nodes {
        return Err(bad());
    }
    Ok(Some(ChurnEvent { node, at_ops }))
}

/// `none`, or one or more `NODE@OPS` separated by commas, each node once.
fn parse_leaves(raw: &str, nodes: usize) -> Result<Vec<ChurnEvent>> {
    if raw == "none" {
        return Ok(Vec::new());
    }
    let mut v: Vec<ChurnEvent> = Vec::new();
    for part in raw.split(',') {
        let e = parse_event("leave", part, nodes)
            .map_err(|_| {
                KvError::Config(format!(
                    "scalestore.leave={raw:?}: use none or NODE@OPS[,NODE@OPS...] with NODE < {nodes}"
                ))
            })?
            .ok_or_else(|| KvError::Config(format!("scalestore.leave={raw:?}: none in a list")))?;
        if v.iter().any(|o| o.node == e.node) {
            return Err(KvError::Config(format!(
                "scalestore.leave={raw:?}: node {} leaves twice",
                e.node
            )));
        }
        v.push(e);
    }
    Ok(v)
}

/// Cache pages of one node when `--cache-mb` is 0: the whole expected data
/// set (every node may end up holding any page, as in the paper's
/// in-memory runs), with the page provider's free share on top, and at
/// least 64 MiB. Pages are estimated at 2 x (value + 24) bytes per key:
/// B-tree leaves after splits are about two-thirds full and a slot costs the
/// key, the value and its slot header (measured: 10M keys with 8-byte values
/// filled 118,589 pages, 49 bytes per key; the estimate gives 64).
pub fn pages_for(expected_keys: u64, value_size: u32, free_percent: usize) -> usize {
    let data = expected_keys.saturating_mul(2 * (u64::from(value_size) + 24));
    let pages = data.div_ceil(PAGE_SIZE as u64) * 100 / (100 - free_percent as u64).max(1) + 256;
    (pages as usize).max((64 << 20) / PAGE_SIZE)
}

/// Who inserts the keys the harness loads (`scalestore.load`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LoadPlacement {
    /// The node of the harness's loading endpoint inserts every key.
    One,
    /// The artifact's YCSB driver (`frontend/ycsb/ycsb.cpp`, "Build YCSB
    /// Table"): with K nodes, node i inserts the i-th of K key-ordered
    /// ranges of `expected_keys / K` keys (the last one takes the rest),
    /// so each node allocates its range's pages and holds them cached.
    Ranges,
}

/// The loader of the `i`-th key of `total` (ascending key order) among
/// `loaders` nodes under [`LoadPlacement::Ranges`]: the artifact's
/// `partition(id, participants, N)` cut, blocks of `total / loaders`.
fn range_loader(i: u64, total: u64, loaders: usize) -> usize {
    let block = (total / loaders.max(1) as u64).max(1);
    ((i / block) as usize).min(loaders.saturating_sub(1))
}

/// Everything the knobs say.
struct Settings {
    node: NodeConfig,
    /// `scalestore.worker_lines=llc`: the workers' lines go through their
    /// node's LLC model on the simulated cluster (invariant 27).
    worker_llc: bool,
    load: LoadPlacement,
    join: Option<ChurnEvent>,
    leave: Vec<ChurnEvent>,
}

impl ScaleStoreSpec {
    fn settings(&self, args: &ServeArgs) -> Result<Settings> {
        let k = &args.knobs;
        let protocol = match k.get::<String>("scalestore", KNOBS, "protocol")?.as_str() {
            "chaining" => Protocol::Chaining,
            "fifo" => Protocol::Fifo,
            o => {
                return Err(KvError::Config(format!(
                    "scalestore.protocol={o}: use chaining or fifo"
                )));
            }
        };
        let await_ack = match k.get::<String>("scalestore", KNOBS, "fifo_ack")?.as_str() {
            "post" => false,
            "await" => true,
            o => {
                return Err(KvError::Config(format!(
                    "scalestore.fifo_ack={o}: use post or await"
                )));
            }
        };
        let alloc = match k.get::<String>("scalestore", KNOBS, "alloc")?.as_str() {
            "round-robin" => AllocPolicy::RoundRobin,
            "local" => AllocPolicy::Local,
            o => {
                return Err(KvError::Config(format!(
                    "scalestore.alloc={o}: use round-robin or local"
                )));
            }
        };
        let load = match k.get::<String>("scalestore", KNOBS, "load")?.as_str() {
            "one" => LoadPlacement::One,
            "ranges" => LoadPlacement::Ranges,
            o => {
                return Err(KvError::Config(format!(
                    "scalestore.load={o}: use one or ranges"
                )));
            }
        };
        let worker_llc = match k
            .get::<String>("scalestore", KNOBS, "worker_lines")?
            .as_str()
        {
            "flat" => false,
            "llc" => true,
            o => {
                return Err(KvError::Config(format!(
                    "scalestore.worker_lines={o}: use flat or llc"
                )));
            }
        };
        let free_percent: usize = k.get("scalestore", KNOBS, "free_percent")?;
        let evict_percent: usize = k.get("scalestore", KNOBS, "evict_percent")?;
        if !(1..=50).contains(&free_percent) || !(1..=100).contains(&evict_percent) {
            return Err(KvError::Config(
                "scalestore.free_percent must be in 1..=50 and evict_percent in 1..=100".into(),
            ));
        }
        let n = args.nodes.len();
        let join = parse_event("join", &k.get::<String>("scalestore", KNOBS, "join")?, n)?;
        let leave = parse_leaves(&k.get::<String>("scalestore", KNOBS, "leave")?, n)?;
        if join.is_some_and(|j| j.node == 0) {
            return Err(KvError::Config(
                "scalestore.join: node 0 creates the tree and must start in the cluster".into(),
            ));
        }
        if !leave.is_empty() && n < 2 {
            return Err(KvError::Config(
                "scalestore.leave needs at least two nodes".into(),
            ));
        }
        if let Some(j) = join
            && leave
                .iter()
                .any(|l| j.node == l.node && l.at_ops <= j.at_ops)
        {
            return Err(KvError::Config(
                "scalestore: a node cannot leave before it joined".into(),
            ));
        }
        let cache_pages: usize = k.get_in("scalestore", KNOBS, "cache_pages", 0..=1 << 28)?;
        let slot_wait_ms: u64 = k.get_in("scalestore", KNOBS, "slot_wait_ms", 1..=3_600_000)?;
        let pages = match cache_pages {
            0 if args.cache_mb == 0 => pages_for(args.expected_keys, args.value_size, free_percent),
            0 => (args.cache_mb as usize * (1 << 20) / PAGE_SIZE).max(64),
            n if n < 64 => {
                return Err(KvError::Config(
                    "scalestore.cache_pages must be 0 or at least 64".into(),
                ));
            }
            n => n,
        };
        Ok(Settings {
            node: NodeConfig {
                pages,
                protocol,
                await_ack,
                alloc,
                data_dir: Default::default(),
                free_percent,
                evict_percent,
                slot_wait: std::time::Duration::from_millis(slot_wait_ms),
            },
            worker_llc,
            load,
            join,
            leave,
        })
    }
}

impl EngineSpec for ScaleStoreSpec {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        "scalestore"
    }
    fn about(&self) -> &'static str {
        "symmetric nodes form one DRAM cache over NVMe; directory-based page coherence with anticipatory chaining; epoch-based eviction; B-tree on page guards"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        KNOBS
    }
    fn topology(&self) -> Topology {
        Topology::Symmetric
    }

    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        let Settings {
            node: mut cfg,
            join,
            worker_llc,
            ..
        } = self.settings(args)?;
        let index = u8::try_from(args.node_index)
            .ok()
            .filter(|&i| (i as usize) < crate::node::MAX_MEMBERS)
            .ok_or_else(|| {
                KvError::Config(format!(
                    "scalestore has at most {} nodes",
                    crate::node::MAX_MEMBERS
                ))
            })?;
        let safe: String = args
            .instance
            .chars()
            .map(|c| if c.is_ascii_alphanumeric() { c } else { '_' })
            .collect();
        let tmp = match &args.data_dir {
            Some(base) => {
                cfg.data_dir = base.join(&safe);
                None
            }
            None => {
                let t = tempfile::Builder::new()
                    .prefix("dmkv-scalestore-")
                    .tempdir()
                    .map_err(config_error)?;
                cfg.data_dir = t.path().to_path_buf();
                Some(t)
            }
        };
        std::fs::create_dir_all(&cfg.data_dir).map_err(config_error)?;
        let region = rt
            .register_region(&region_name(&args.instance), cfg.pages * PAGE_SIZE)
            .map_err(KvError::from)?;
        // The handler needs the node, the node needs the service id: the
        // handler finds the node through a slot filled right after.
        let slot: Arc<Mutex<std::sync::Weak<ScaleNode>>> = Arc::default();
        let for_handler = slot.clone();
        let service = rt
            .register_deferred_service(
                &service_name(&args.instance),
                Arc::new(move |ctx: &RpcContext, req: &[u8], r: Responder| {
                    // Upgrade and release the slot's lock before handling: a
                    // guard in the `match` scrutinee would live through
                    // `handle`, serialising a node's handler threads, and on
                    // `sim` a handler waiting for its SSD runs the node's
                    // other handlers nested on this thread, so the second
                    // one would wait for this lock forever.
                    let node = for_handler.lock().upgrade();
                    match node {
                        Some(node) => node.handle(ctx, req, r),
                        None => r.reply(Err(dmkv_transport::ServiceError::failed(
                            "node is shutting down",
                        ))),
                    }
                }),
            )
            .map_err(config_error)?;
        // Under the simulated cluster, requests to the handler are posted
        // as the artifact's workers post them: the message, then its
        // mailbox's flag, two RDMA WRITEs (invariant 26). Replies are one
        // WRITE, a page's reply two (the page, then the message:
        // `ScaleNode::deliver`'s posted write and the reply), as the
        // artifact's `writeMsg` and `writePageAndMsg`.
        if dmkv_transport::sim::active()
            && !dmkv_transport::sim::set_mailbox_requests(rt.id(), service)
        {
            return Err(config_error(format!(
                "the simulated cluster has no node {}",
                rt.id()
            )));
        }
        // With `worker_lines=llc`, the workers' lines in this node's memory
        // (its frames and pages) go through this node's LLC model, as its
        // handler cores' do (invariant 27): the artifact's workers and
        // handlers share one socket's LLC (§6.1: all threads "pinned to
        // NUMA 0"). A profile without an LLC leaves them flat.
        if worker_llc && dmkv_transport::sim::active() {
            dmkv_transport::sim::set_compute_llc(rt.id());
        }
        let state = if join.is_some_and(|j| j.node == index) {
            NodeState::Dormant
        } else {
            NodeState::Active
        };
        let node = Arc::new(ScaleNode::new(
            index,
            rt.id(),
            cfg,
            region.mem.clone(),
            region.remote,
            service,
            rt.host().fabric(),
            state,
        ));
        *node.tmp.lock() = tmp;
        *slot.lock() = Arc::downgrade(&node);
        node.add_shard(index, 0, 1).map_err(config_error)?;
        node.set_host(index, index);
        if index == 0 {
            create_tree(&node)?;
        }
        rt.attach(&args.name("node"), node.clone());
        // The page provider and the re-poll thread hold the node; they stop
        // when the runtime (and with it the pool) goes away.
        let pool = rt.worker_pool(&format!("{}-provider-repoll", args.instance), 3);
        // Held by the node's attachments: the runtime retires pools that
        // only it holds whenever another pool is started on it (a node
        // process starts its workers' pool after this), which would stop
        // both loops. Removing the instance drops it.
        rt.attach(&args.name("provider-pool"), pool.clone());
        if dmkv_transport::sim::active() {
            // The simulated cluster runs on one thread: the two loops are
            // runtime background tasks that wait in virtual time.
            let alive = Arc::downgrade(&pool);
            let n = node.clone();
            let _provider = dmkv_transport::exec::spawn_simulated(async move {
                provider::run_async(&n, || alive.strong_count() > 0).await
            });
            let alive = Arc::downgrade(&pool);
            let n = node.clone();
            let _repoll = dmkv_transport::exec::spawn_simulated(async move {
                repoll::run_async(&n, || alive.strong_count() > 0).await
            });
            // The completer's CPU (each completion, each pull's
            // placement) is charged on a simulated core of its own, as the
            // real backends' completer is one thread (invariant 21).
            let cores = dmkv_transport::sim::SimCores::new(
                &format!("{} node{index} ssd completer core", args.instance),
                1,
            );
            let alive = Arc::downgrade(&pool);
            let n = node.clone();
            let _ssd = dmkv_transport::exec::spawn_simulated(async move {
                crate::ssdio::run_async(n, cores, || alive.strong_count() > 0).await
            });
        } else {
            let alive = Arc::downgrade(&pool);
            let n = node.clone();
            pool.submit(move || provider::run(&n, || alive.strong_count() > 0));
            let alive = Arc::downgrade(&pool);
            let n = node.clone();
            pool.submit(move || repoll::run(&n, || alive.strong_count() > 0));
            let alive = Arc::downgrade(&pool);
            let n = node.clone();
            pool.submit(move || crate::ssdio::run(&n, || alive.strong_count() > 0));
        }
        Ok(())
    }

    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let s = self.settings(&args.serve)?;
        let mut nodes = served_nodes(&args.hosted, &args.serve);
        if nodes.is_empty() {
            return Err(KvError::Config(format!(
                "no scalestore node of {} is served in this process",
                args.serve.instance
            )));
        }
        nodes.sort_by_key(|n| n.index);
        let initial: Vec<(u8, NodeId)> = args
            .serve
            .nodes
            .iter()
            .enumerate()
            .map(|(i, id)| (i as u8, NodeId(*id)))
            .collect();
        let founders: Vec<(u8, NodeId)> = initial
            .iter()
            .copied()
            .filter(|(i, _)| s.join.is_none_or(|j| j.node != *i))
            .collect();
        // Membership by messages: each founding node learns the others from
        // their transport directories and introduces itself.
        for n in nodes.iter().filter(|n| n.state() == NodeState::Active) {
            let ep = n.fabric.endpoint(n.id)?;
            block_on(n.introduce(&ep, &args.serve.instance, &founders))?;
        }
        Ok(Arc::new(ScaleStoreEngine {
            shared: Arc::new(Shared {
                nodes,
                instance: args.serve.instance.clone(),
                founders,
                join: s.join,
                load: s.load,
                expected_keys: args.serve.expected_keys,
                loaded: AtomicU64::new(0),
                left: s.leave.iter().map(|_| AtomicBool::new(false)).collect(),
                leave: s.leave,
                ops: AtomicU64::new(0),
                joined: AtomicBool::new(false),
                proxied: AtomicU64::new(0),
                churn: Mutex::new(Vec::new()),
                one_change: ChangeGate::default(),
                log: Mutex::new(Vec::new()),
            }),
        }))
    }
}

/// Creates the catalog (page 0 of shard 0) and the root leaf on node 0.
fn create_tree(node: &ScaleNode) -> Result<()> {
    let mut pages = Vec::new();
    for _ in 0..2 {
        let (pid, fi, epoch) = node.alloc_here(0)?;
        let f = node.frames.frame(fi);
        let slot = node
            .take_slot()
            .ok_or_else(|| KvError::Exhausted("no cache slot for the catalog".into()))?;
        let mut m = f.meta.lock();
        m.epoch = epoch;
        f.set_possession(Possession::Exclusive, slot);
        drop(m);
        pages.push((pid, slot));
    }
    assert_eq!(pages[0].0, Pid::new(0, 0), "the catalog is the first page");
    btree::init_pages(&node.page(pages[0].1), &node.page(pages[1].1), pages[1].0);
    Ok(())
}

/// What the engine and its clients share.
struct Shared {
    /// The nodes served in this process, by index.
    nodes: Vec<Arc<ScaleNode>>,
    instance: String,
    /// The nodes that start in the cluster.
    founders: Vec<(u8, NodeId)>,
    join: Option<ChurnEvent>,
    leave: Vec<ChurnEvent>,
    /// Who inserts loaded keys, the keys the harness said it would load,
    /// and how many it loaded so far (the load comes in ascending key
    /// order, in chunks).
    load: LoadPlacement,
    expected_keys: u64,
    loaded: AtomicU64,
    /// Client operations started.
    ops: AtomicU64,
    joined: AtomicBool,
    /// Per leave event: fired.
    left: Vec<AtomicBool>,
    /// Clients that issued through another node than their own.
    proxied: AtomicU64,
    /// Membership changes under way and their outcomes.
    churn: Mutex<Vec<(dmkv_transport::exec::BackgroundHandle, ChangeOutcome)>>,
    /// Entered by a join or leave while it runs: a joiner's introduction
    /// must not overlap a departure (`docs/scalestore.md`, invariant 10).
    /// Joins enter it alone, leaves together: leaves may overlap each
    /// other (invariant 13), a join overlaps nothing.
    one_change: ChangeGate,
    log: Mutex<Vec<String>>,
}

impl Shared {
    fn node(&self, index: u8) -> Option<Arc<ScaleNode>> {
        self.nodes.iter().find(|n| n.index == index).cloned()
    }

    /// Counts a client operation and fires membership events when due.
    fn tick(self: &Arc<Self>) {
        let n = self.ops.fetch_add(1, Ordering::Relaxed) + 1;
        if let Some(j) = self.join
            && n >= j.at_ops
            && !self.joined.swap(true, Ordering::SeqCst)
        {
            self.fire(j.node, true, n);
        }
        for (l, fired) in self.leave.iter().zip(&self.left) {
            if n >= l.at_ops && !fired.swap(true, Ordering::SeqCst) {
                self.fire(l.node, false, n);
            }
        }
    }

    /// Starts node `index`'s join (or leave), due at client operation `at`.
    fn fire(self: &Arc<Self>, index: u8, join: bool, at: u64) {
        let me = self.clone();
        let outcome: ChangeOutcome = Arc::default();
        let out = outcome.clone();
        // A runtime background activity: its own thread on real backends, a
        // task in virtual time under `sim` (every wait of the change is an
        // await of that task, so overlapping leaves interleave there).
        let h =
            dmkv_transport::exec::spawn_background_local("scalestore-churn", move || async move {
                let r = me.change(index, join, at).await;
                *out.lock() = Some(r);
            });
        self.churn.lock().push((h, outcome));
    }

    /// Waits (an await, not a blocked thread: on the simulated cluster
    /// the changes are tasks of this OS thread) until every membership
    /// change fired so far has ended.
    async fn changes_done(&self) {
        let step = if dmkv_transport::sim::active() {
            std::time::Duration::from_micros(10)
        } else {
            std::time::Duration::from_millis(1)
        };
        while self.churn.lock().iter().any(|(h, _)| !h.is_finished()) {
            dmkv_transport::exec::sleep(step).await;
        }
    }

    /// Node `index` joins (or leaves), logged in `membership_events`.
    async fn change(&self, index: u8, join: bool, at: u64) -> Result<()> {
        let node = self.node(index).ok_or_else(|| {
            KvError::Config(format!("scalestore node {index} is not served here"))
        })?;
        let start = dmkv_transport::time::Instant::now();
        // How long the change took (virtual time under `sim`).
        let took = || format!("{} us", start.elapsed().as_micros());
        if !join {
            // A node that was to join first must have joined (before we
            // enter the gate its join needs).
            while node.state() == NodeState::Dormant {
                dmkv_transport::exec::sleep(std::time::Duration::from_millis(1)).await;
            }
        }
        // A join overlaps no other membership change: a node that joins
        // while another leaves could learn the leaver's shard hosts from a
        // welcome sent before the departure, or introduce itself to the
        // leaver after it sent its departures, and keep addressing a node
        // that is gone. Leaves may overlap each other (invariant 13).
        let res = {
            let _one = self.one_change.enter(join).await;
            if join {
                node.join_async(&self.instance, &self.founders)
                    .await
                    .map(|()| format!("node {index} joined at op {at} (took {})", took()))
            } else {
                node.leave_async().await.map(|succ| {
                    format!(
                        "node {index} left at op {at}, handing over to node {succ} (took {})",
                        took()
                    )
                })
            }
        };
        match res {
            Ok(line) => {
                self.log.lock().push(line);
                Ok(())
            }
            Err(e) => {
                self.log.lock().push(format!("node {index}: {e}"));
                Err(e)
            }
        }
    }
}

/// Who is changing the membership: one join alone, or any number of
/// leaves. Entered by awaiting, never by blocking a thread: on the
/// simulated cluster every change is a task of the one OS thread, where a
/// blocking lock (the `RwLock` this replaces) held by one task and wanted
/// by another would stop the whole simulation. Waiters are woken, in the
/// order they came, when a change ends.
#[derive(Default)]
struct ChangeGate {
    state: Mutex<GateState>,
}

#[derive(Default)]
struct GateState {
    joining: bool,
    leaving: usize,
    waiters: Vec<std::task::Waker>,
}

impl ChangeGate {
    /// Waits until a join (`join`) or a leave may start, and enters.
    async fn enter(&self, join: bool) -> GatePass<'_> {
        std::future::poll_fn(|cx| {
            let mut g = self.state.lock();
            let free = !g.joining && (!join || g.leaving == 0);
            if !free {
                g.waiters.push(cx.waker().clone());
                return std::task::Poll::Pending;
            }
            if join {
                g.joining = true;
            } else {
                g.leaving += 1;
            }
            std::task::Poll::Ready(())
        })
        .await;
        GatePass { gate: self, join }
    }
}

/// A change in the gate; leaves it when dropped.
struct GatePass<'a> {
    gate: &'a ChangeGate,
    join: bool,
}

impl Drop for GatePass<'_> {
    fn drop(&mut self) {
        let waiters = {
            let mut g = self.gate.state.lock();
            if self.join {
                g.joining = false;
            } else {
                g.leaving -= 1;
            }
            std::mem::take(&mut g.waiters)
        };
        for w in waiters {
            w.wake();
        }
    }
}

/// A membership change's result once it ran (None: it panicked).
type ChangeOutcome = Arc<Mutex<Option<Result<()>>>>;

/// The connected engine: every node of this process.
pub struct ScaleStoreEngine {
    shared: Arc<Shared>,
}

impl ScaleStoreEngine {
    pub fn nodes(&self) -> &[Arc<ScaleNode>] {
        &self.shared.nodes
    }

    fn node_of(&self, id: NodeId) -> Result<Arc<ScaleNode>> {
        self.shared
            .nodes
            .iter()
            .find(|n| n.id == id)
            .cloned()
            .ok_or_else(|| KvError::Config(format!("{id} is not a scalestore node")))
    }
}

#[async_trait(?Send)]
impl Engine for ScaleStoreEngine {
    fn name(&self) -> &'static str {
        "scalestore"
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, thread: usize) -> NodeId {
        let n = &self.shared.nodes;
        n[thread % n.len()].id
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        let node = self.node_of(ep.node())?;
        Ok(Rc::new(Client {
            shared: self.shared.clone(),
            home: Rc::new(Worker::new(node, ep)),
            proxy: RefCell::new(None),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let sh = &self.shared;
        let loaders: Vec<Arc<ScaleNode>> = match sh.load {
            LoadPlacement::One => vec![self.node_of(ep.node())?],
            // Founders only: a node that joins later holds nothing at first.
            LoadPlacement::Ranges => sh
                .nodes
                .iter()
                .filter(|n| n.state() == NodeState::Active)
                .cloned()
                .collect(),
        };
        if loaders.is_empty() {
            return Err(KvError::Config("no scalestore node to load through".into()));
        }
        let mut clients = Vec::with_capacity(loaders.len());
        for node in loaders {
            let ep = Rc::new(dmkv_transport::Fabric::endpoint(&*node.fabric, node.id)?);
            clients.push(Client {
                shared: sh.clone(),
                home: Rc::new(Worker::new(node, ep)),
                proxy: RefCell::new(None),
            });
        }
        for (k, v) in pairs {
            let i = sh.loaded.fetch_add(1, Ordering::Relaxed);
            let c = &clients[range_loader(i, sh.expected_keys, clients.len())];
            let (w, _g) = c.enter(false)?;
            BTree::new(&*w).write(WriteKind::Upsert, *k, v).await?;
        }
        Ok(())
    }
    async fn stats(&self, _ep: &Endpoint) -> Result<serde_json::Value> {
        // Membership changes still under way (a leave fired late in a run
        // may outlast it: on the simulated cluster it is a task that the
        // clients' end does not wait for) end first, so that the figures
        // say how each ended.
        self.shared.changes_done().await;
        Ok(stats_json(&self.shared))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
    async fn settle(&self, _ep: &Endpoint) -> Result<()> {
        self.shared.changes_done().await;
        let handles = std::mem::take(&mut *self.shared.churn.lock());
        for (h, outcome) in handles {
            h.join();
            outcome
                .lock()
                .take()
                .ok_or_else(|| KvError::Corrupt("a membership change panicked".into()))??;
        }
        Ok(())
    }
}

/// The figures of `engine_stats`, summed over nodes, with per-node detail.
fn stats_json(shared: &Shared) -> serde_json::Value {
    let nodes = &shared.nodes;
    let sum = |f: &dyn Fn(&ScaleNode) -> u64| nodes.iter().map(|n| f(n)).sum::<u64>();
    let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let mut by_kind = serde_json::Map::new();
    for k in KINDS {
        let v = sum(&|n| ld(&n.stats.sent[k as usize]));
        if v > 0 {
            by_kind.insert(k.name().into(), v.into());
        }
    }
    let fixes = sum(&|n| ld(&n.stats.fixes));
    let hot = sum(&|n| ld(&n.stats.hot));
    let (mut reads, mut writes, mut direct, mut uring) = (0, 0, true, true);
    let (mut submitted, mut depth_sum, mut depth_max) = (0, 0, 0);
    for n in nodes {
        for (_, s) in n.shard_list() {
            reads += s.file.reads();
            writes += s.file.writes();
            direct &= s.file.direct();
            uring &= s.file.uring();
            let d = s.file.read_depth();
            submitted += ld(&d.submitted);
            depth_sum += ld(&d.sum);
            depth_max = depth_max.max(ld(&d.max));
        }
    }
    // Per client operation of the whole run (load, run and verify alike:
    // the nodes' counters are not split by phase; the report's per-op
    // figures are the run phase's).
    let client_ops = shared.ops.load(Ordering::Relaxed);
    let per_op = |v: u64| {
        if client_ops == 0 {
            0.0
        } else {
            v as f64 / client_ops as f64
        }
    };
    let mut by_kind_per_op = serde_json::Map::new();
    for (k, v) in &by_kind {
        by_kind_per_op.insert(k.clone(), per_op(v.as_u64().unwrap_or(0)).into());
    }
    let pages_moved = sum(&|n| ld(&n.stats.pages_remote)) + sum(&|n| ld(&n.stats.pages_ssd));
    let per_node: Vec<serde_json::Value> = nodes
        .iter()
        .map(|n| {
            serde_json::json!({
                "index": n.index,
                "state": format!("{:?}", n.state()).to_lowercase(),
                "ops": ld(&n.stats.ops),
                "cache_pages": n.cfg.pages,
                "free_pages": n.free_slots(),
                "fixes": ld(&n.stats.fixes),
                "hot_path": ld(&n.stats.hot),
                "evictions": ld(&n.stats.evictions),
                "shards": n.shard_list().iter().map(|(s, _)| *s).collect::<Vec<u8>>(),
                "global_epoch": n.global_epoch.load(Ordering::Relaxed),
            })
        })
        .collect();
    let protocol = nodes.first().map_or(Protocol::Chaining, |n| n.cfg.protocol);
    let mut v = serde_json::json!({
        "protocol": format!("{protocol:?}").to_lowercase(),
        "nodes": nodes.len(),
        "messages": serde_json::Value::Object(by_kind),
        "messages_per_client_op": serde_json::Value::Object(by_kind_per_op),
        "messages_total": sum(&|n| n.stats.sent.iter().map(ld).sum()),
        "parked_at_holder": sum(&|n| ld(&n.stats.parked_holder)),
        "parked_at_directory": sum(&|n| ld(&n.stats.parked_directory)),
        "handover_retries": sum(&|n| ld(&n.stats.handover_retries)),
        "fifo_queued": sum(&|n| ld(&n.stats.fifo_queued)),
        "fifo_bypassed": sum(&|n| ld(&n.stats.fifo_bypassed)),
        "fifo_before_ack": sum(&|n| ld(&n.stats.fifo_before_ack)),
        "gone_replies": sum(&|n| ld(&n.stats.gone)),
        "copy_failures": sum(&|n| ld(&n.stats.copy_failures)),
        "stale_requests": sum(&|n| ld(&n.stats.stale)),
        "page_fixes": fixes,
        "hot_path_share": if fixes == 0 { 0.0 } else { hot as f64 / fixes as f64 },
        "local_directory_grants": sum(&|n| ld(&n.stats.local_grants)),
        "pages_from_remote_memory": sum(&|n| ld(&n.stats.pages_remote)),
        "pages_from_ssd": sum(&|n| ld(&n.stats.pages_ssd)),
        "ssd_reads": reads,
        "ssd_writes": writes,
        "ssd_direct_io": direct,
        "ssd_io_uring": uring,
        "ssd_reads_through_ring": submitted,
        "ssd_read_depth_max": depth_max,
        "ssd_read_depth_mean": if submitted == 0 { 0.0 } else { depth_sum as f64 / submitted as f64 },
        "page_bytes_moved": pages_moved * crate::page::PAGE_SIZE as u64,
        "page_bytes_per_client_op": per_op(pages_moved * crate::page::PAGE_SIZE as u64),
        "evictions": sum(&|n| ld(&n.stats.evictions)),
        "evictions_declined": sum(&|n| ld(&n.stats.evict_declined)),
        "eviction_batches": sum(&|n| ld(&n.stats.evict_batches)),
        "evict_writes_kept_dirty": sum(&|n| ld(&n.stats.evict_writes_kept_dirty)),
        "dirty_pages_pulled": sum(&|n| ld(&n.stats.pulled)),
        "restarts": sum(&|n| ld(&n.stats.restarts)),
        "latch_waits": sum(&|n| ld(&n.stats.latch_waits)),
        "client_ops": shared.ops.load(Ordering::Relaxed),
        "clients_proxied": shared.proxied.load(Ordering::Relaxed),
        "membership_events": shared.log.lock().clone(),
        "per_node": per_node,
    });
    // Only with DMKV_SCALESTORE_TRACE set (a debugging aid, `trace`).
    if let Some(t) = crate::trace::report() {
        v["op_trace"] = t;
    }
    v
}

/// Counts an operation of a node's worker while it runs.
struct Inflight(Arc<ScaleNode>);

impl Drop for Inflight {
    fn drop(&mut self) {
        self.0.inflight.fetch_sub(1, Ordering::SeqCst);
    }
}

/// Admits an operation on `node` if it is a member now.
fn admit(node: &Arc<ScaleNode>) -> Option<Inflight> {
    node.inflight.fetch_add(1, Ordering::SeqCst);
    // A leaving node sets its state, then waits for `inflight` to drain:
    // either it sees our increment, or we see its state.
    if node.state() == NodeState::Active {
        crate::node::Counters::add(&node.stats.ops, 1);
        Some(Inflight(node.clone()))
    } else {
        node.inflight.fetch_sub(1, Ordering::SeqCst);
        None
    }
}

struct Client {
    shared: Arc<Shared>,
    home: Rc<Worker>,
    /// A worker on another member, while the home node is not one.
    proxy: RefCell<Option<Rc<Worker>>>,
}

impl Client {
    /// The worker for one operation: the home node's while it is a member,
    /// else one on another member of this process.
    fn enter(&self, count: bool) -> Result<(Rc<Worker>, Inflight)> {
        if count {
            self.shared.tick();
        }
        if let Some(g) = admit(&self.home.node) {
            return Ok((self.home.clone(), g));
        }
        let mut proxy = self.proxy.borrow_mut();
        for _ in 0..1000 {
            if let Some(w) = proxy.as_ref()
                && let Some(g) = admit(&w.node)
            {
                return Ok((w.clone(), g));
            }
            let node = self
                .shared
                .nodes
                .iter()
                .find(|n| n.state() == NodeState::Active)
                .cloned()
                .ok_or_else(|| {
                    KvError::Config("no scalestore node of this process is a member".into())
                })?;
            let ep = Rc::new(node.fabric.endpoint(node.id)?);
            self.shared.proxied.fetch_add(1, Ordering::Relaxed);
            *proxy = Some(Rc::new(Worker::new(node, ep)));
        }
        Err(KvError::Config("membership keeps changing".into()))
    }
}

#[async_trait(?Send)]
impl KvStore for Client {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let (w, _g) = self.enter(true)?;
        crate::trace::op(w.node.index, false, async {
            let r = w.ep.charged(BTree::new(&*w).lookup(key)).await;
            w.settle_acks().await?;
            r
        })
        .await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        let (w, _g) = self.enter(true)?;
        crate::trace::op(w.node.index, true, async {
            let r =
                w.ep.charged(BTree::new(&*w).write(WriteKind::Insert, key, value))
                    .await;
            w.settle_acks().await?;
            r
        })
        .await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        let (w, _g) = self.enter(true)?;
        crate::trace::op(w.node.index, true, async {
            let r =
                w.ep.charged(BTree::new(&*w).write(WriteKind::Update, key, value))
                    .await;
            w.settle_acks().await?;
            r
        })
        .await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        let (w, _g) = self.enter(true)?;
        crate::trace::op(w.node.index, true, async {
            let r =
                w.ep.charged(BTree::new(&*w).write(WriteKind::Upsert, key, value))
                    .await;
            w.settle_acks().await?;
            r
        })
        .await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        let (w, _g) = self.enter(true)?;
        crate::trace::op(w.node.index, true, async {
            let r =
                w.ep.charged(BTree::new(&*w).write(WriteKind::Delete, key, &[]))
                    .await;
            w.settle_acks().await?;
            r
        })
        .await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        let (w, _g) = self.enter(true)?;
        crate::trace::op(w.node.index, false, async {
            let r = w.ep.charged(BTree::new(&*w).scan(start, n)).await;
            w.settle_acks().await?;
            r
        })
        .await
    }
}

/// The ScaleStore nodes that `runtimes` serve for the engine instance
/// `args` names (each runtime's `node` attachment), in runtime order: what
/// `connect` attaches to, and what tests and examples inspect.
pub fn served_nodes(runtimes: &[Arc<NodeRuntime>], args: &ServeArgs) -> Vec<Arc<ScaleNode>> {
    runtimes
        .iter()
        .filter_map(|rt| rt.attachment::<ScaleNode>(&args.name("node")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::range_loader;

    /// The artifact's `partition(id, participants, N)`: blocks of
    /// `N / participants` in key order, the last one takes the rest.
    #[test]
    fn range_loaders_cut_the_keys_as_the_artifacts_driver() {
        let owners: Vec<usize> = (0..10).map(|i| range_loader(i, 10, 3)).collect();
        assert_eq!(owners, [0, 0, 0, 1, 1, 1, 2, 2, 2, 2]);
        assert!((0..50_000).all(|i| range_loader(i, 50_000, 5) == (i / 10_000) as usize));
        // More keys than announced stay on the last loader; one loader takes all.
        assert_eq!(range_loader(99, 10, 3), 2);
        assert!((0..20).all(|i| range_loader(i, 10, 1) == 0));
        // Fewer keys than loaders, and no announced keys at all.
        assert_eq!(range_loader(1, 2, 5), 1);
        assert_eq!(range_loader(7, 0, 4), 3);
    }
}
