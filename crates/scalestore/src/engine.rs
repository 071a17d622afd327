//! The `scalestore` engine: every node serves (message handlers, page
//! provider) and issues (the compute threads the harness places on it);
//! the KvStore API is served by the B-tree over the guards.

use crate::btree::{self, BTree, MAX_VALUE_LEN, WriteKind};
use crate::frames::{Local, Possession};
use crate::msg::KINDS;
use crate::node::{AllocPolicy, Member, NodeConfig, Protocol, ScaleNode};
use crate::page::PAGE_SIZE;
use crate::pid::Pid;
use crate::worker::Worker;
use crate::{provider, registry};
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvError, KvStore, Result,
    ServeArgs, Topology,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::{Endpoint, NodeId, RpcContext, ServiceError};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;

const KNOBS: &[KnobSpec] = &[
    KnobSpec {
        name: "protocol",
        default: "chaining",
        help: "conflict handling: chaining (anticipatory chaining, §3.4.3) or fifo (directory FIFO queue, §3.4.2)",
    },
    KnobSpec {
        name: "alloc",
        default: "round-robin",
        help: "directory of new pages: round-robin over the nodes (remote allocation) or local",
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

impl ScaleStoreSpec {
    fn config(&self, args: &ServeArgs) -> Result<NodeConfig> {
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
        let alloc = match k.get::<String>("scalestore", KNOBS, "alloc")?.as_str() {
            "round-robin" => AllocPolicy::RoundRobin,
            "local" => AllocPolicy::Local,
            o => {
                return Err(KvError::Config(format!(
                    "scalestore.alloc={o}: use round-robin or local"
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
        let pages = (args.cache_mb as usize * (1 << 20) / PAGE_SIZE).max(64);
        Ok(NodeConfig {
            pages,
            protocol,
            alloc,
            data_dir: Default::default(),
            free_percent,
            evict_percent,
        })
    }
}

impl EngineSpec for ScaleStoreSpec {
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
        let mut cfg = self.config(args)?;
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
            .register_region(&args.name("cache"), cfg.pages * PAGE_SIZE)
            .map_err(KvError::from)?;
        let node = Arc::new(ScaleNode::new(
            index,
            rt.id(),
            cfg,
            region.mem.clone(),
            region.remote,
            rt.host().fabric(),
        ));
        *node.tmp.lock() = tmp;
        node.add_shard(index, 0).map_err(config_error)?;
        if index == 0 {
            create_tree(&node)?;
        }
        let weak = Arc::downgrade(&node);
        let service = rt
            .register_service(
                &args.name("msg"),
                Arc::new(
                    move |ctx: &RpcContext,
                          req: &[u8]|
                          -> std::result::Result<Vec<u8>, ServiceError> {
                        let node = weak
                            .upgrade()
                            .ok_or_else(|| ServiceError::failed("node is shutting down"))?;
                        node.handle(ctx, req)
                    },
                ),
            )
            .map_err(config_error)?;
        node.set_member(
            index,
            Member {
                node: rt.id(),
                region: region.remote,
                service,
            },
        );
        registry::register(&args.instance, rt.id(), &node);
        // The page provider holds the node; it stops when the runtime (and
        // with it the pool) goes away.
        let pool = rt.worker_pool(&format!("{}-page-provider", args.instance), 1);
        let alive = Arc::downgrade(&pool);
        let n = node.clone();
        pool.submit(move || provider::run(&n, || alive.strong_count() > 0));
        Ok(())
    }

    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let mut nodes = Vec::new();
        for &id in &args.serve.nodes {
            let n = registry::lookup(&args.serve.instance, NodeId(id)).ok_or_else(|| {
                KvError::Config(format!(
                    "scalestore node {id} of {} is not served in this process",
                    args.serve.instance
                ))
            })?;
            nodes.push(n);
        }
        // Everybody learns everybody (what the paper's connection setup
        // exchanges: where each node's frames and mailboxes are).
        for a in &nodes {
            for b in &nodes {
                if let Some(m) = b.member(b.index) {
                    a.set_member(b.index, m);
                }
            }
        }
        Ok(Arc::new(ScaleStoreEngine { nodes }))
    }
}

/// Creates the catalog (page 0 of shard 0) and the root leaf on node 0.
fn create_tree(node: &ScaleNode) -> Result<()> {
    let mut pages = Vec::new();
    for _ in 0..2 {
        let (pid, fi, epoch) = node.alloc_here(0, 0)?;
        node.frames.frame(fi).meta.lock().epoch = epoch;
        let slot = node
            .take_slot()
            .ok_or_else(|| KvError::Exhausted("no cache slot for the catalog".into()))?;
        node.frames.frame(fi).set_local(Local {
            mode: Possession::Exclusive,
            waiting: false,
            slot,
        });
        pages.push((pid, slot));
    }
    assert_eq!(pages[0].0, Pid::new(0, 0), "the catalog is the first page");
    btree::init_pages(&node.page(pages[0].1), &node.page(pages[1].1), pages[1].0);
    Ok(())
}

/// The connected engine: every node of this process.
pub struct ScaleStoreEngine {
    nodes: Vec<Arc<ScaleNode>>,
}

impl ScaleStoreEngine {
    pub fn nodes(&self) -> &[Arc<ScaleNode>] {
        &self.nodes
    }

    fn node_of(&self, id: NodeId) -> Result<Arc<ScaleNode>> {
        self.nodes
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
        self.nodes[thread % self.nodes.len()].id
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        let node = self.node_of(ep.node())?;
        Ok(Rc::new(Client {
            worker: Worker::new(node, ep),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let node = self.node_of(ep.node())?;
        let ep = Rc::new(dmkv_transport::Fabric::endpoint(&*node.fabric, node.id)?);
        let w = Worker::new(node, ep);
        let t = BTree::new(&w);
        for (k, v) in pairs {
            t.write(WriteKind::Upsert, *k, v).await?;
        }
        Ok(())
    }
    async fn stats(&self, _ep: &Endpoint) -> Result<serde_json::Value> {
        Ok(stats_json(&self.nodes))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}

/// The figures of `engine_stats`, summed over nodes, with per-node detail.
pub fn stats_json(nodes: &[Arc<ScaleNode>]) -> serde_json::Value {
    let sum = |f: &dyn Fn(&ScaleNode) -> u64| nodes.iter().map(|n| f(n)).sum::<u64>();
    let ld = |c: &std::sync::atomic::AtomicU64| c.load(Ordering::Relaxed);
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
    for n in nodes {
        for (_, s) in n.shard_list() {
            reads += s.file.reads();
            writes += s.file.writes();
            direct &= s.file.direct();
            uring &= s.file.uring();
        }
    }
    let per_node: Vec<serde_json::Value> = nodes
        .iter()
        .map(|n| {
            serde_json::json!({
                "index": n.index,
                "cache_pages": n.cfg.pages,
                "free_pages": n.free_slots(),
                "fixes": ld(&n.stats.fixes),
                "hot_path": ld(&n.stats.hot),
                "evictions": ld(&n.stats.evictions),
                "global_epoch": n.global_epoch.load(Ordering::Relaxed),
            })
        })
        .collect();
    serde_json::json!({
        "protocol": format!("{:?}", nodes.first().map(|n| n.cfg.protocol).unwrap_or(Protocol::Chaining)).to_lowercase(),
        "nodes": nodes.len(),
        "messages": serde_json::Value::Object(by_kind),
        "busy_replies": sum(&|n| ld(&n.stats.busy)),
        "queued_replies": sum(&|n| ld(&n.stats.queued)),
        "gone_replies": sum(&|n| ld(&n.stats.gone)),
        "page_fixes": fixes,
        "hot_path_share": if fixes == 0 { 0.0 } else { hot as f64 / fixes as f64 },
        "local_directory_grants": sum(&|n| ld(&n.stats.local_grants)),
        "pages_from_remote_memory": sum(&|n| ld(&n.stats.pages_remote)),
        "pages_from_ssd": sum(&|n| ld(&n.stats.pages_ssd)),
        "ssd_reads": reads,
        "ssd_writes": writes,
        "ssd_direct_io": direct,
        "ssd_io_uring": uring,
        "evictions": sum(&|n| ld(&n.stats.evictions)),
        "evictions_declined": sum(&|n| ld(&n.stats.evict_declined)),
        "eviction_batches": sum(&|n| ld(&n.stats.evict_batches)),
        "dirty_pages_pulled": sum(&|n| ld(&n.stats.pulled)),
        "restarts": sum(&|n| ld(&n.stats.restarts)),
        "protocol_retries": sum(&|n| ld(&n.stats.retries)),
        "per_node": per_node,
    })
}

struct Client {
    worker: Worker,
}

#[async_trait(?Send)]
impl KvStore for Client {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        BTree::new(&self.worker).lookup(key).await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        BTree::new(&self.worker)
            .write(WriteKind::Insert, key, value)
            .await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        BTree::new(&self.worker)
            .write(WriteKind::Update, key, value)
            .await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        BTree::new(&self.worker)
            .write(WriteKind::Upsert, key, value)
            .await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        BTree::new(&self.worker)
            .write(WriteKind::Delete, key, &[])
            .await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        BTree::new(&self.worker).scan(start, n).await
    }
}
