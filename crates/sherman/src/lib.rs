//! # dmkv-sherman: a one-sided B+link tree (Sherman, SIGMOD'22)
//!
//! The tree-based baseline ROLEX (FAST'23) compares against. Tree nodes live
//! in memory nodes' registered memory; compute nodes do everything with
//! one-sided verbs: optimistic node reads validated by a checksum, node locks
//! taken by CAS (hierarchical: a local lock per compute process first, with
//! handover), one-entry write-back with the unlock in the same batch, B-link
//! splits safe for concurrent readers, and a client-side cache of inner
//! nodes so that a lookup usually costs one READ of the leaf.
//!
//! - [`layout`]: node, value-block and pointer layouts (bounds-checked
//!   views, packed words pinned by `const` assertions);
//! - [`lock`]: the hierarchical on-chip lock (global lock table + local
//!   locks with handover);
//! - [`cache`]: the index cache of inner nodes;
//! - [`alloc`]: chunks from the memory node (RPC, rare), nodes and value
//!   blocks carved by the client;
//! - [`tree`]: the operations.
//!
//! Departures from Sherman (checksums instead of front/rear versions,
//! ordinary memory for the lock table) are argued in `docs/sherman.md`.

#![forbid(unsafe_code)]

pub mod alloc;
pub mod cache;
pub mod layout;
pub mod lock;
pub mod tree;

use alloc::{ChunkSource, LocalAlloc, serve_chunk};
use async_trait::async_trait;
use cache::IndexCache;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvError, KvStore, Result,
    ServeArgs,
};
use dmkv_memnode::{BumpAllocator, NodeRuntime};
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, RpcContext};
use layout::{
    EMPTY_KEY, GAddr, MAX_MEMNODES, MAX_NODE_BYTES, MAX_VALUE_LEN, MIN_NODE_BYTES, NodeImage,
};
use lock::{LOCK_WORDS, LocalLocks};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use tree::{Ctx, POOL_RESERVED, ROOT_WORD, TreeShared, TreeStats, WriteOp};

/// The engine spec; register it as `sherman`.
pub struct ShermanSpec;

/// The spec of `sherman`.
pub static SPEC: ShermanSpec = ShermanSpec;

const NAME: &str = "sherman";

const KNOBS: &[KnobSpec] = &[
    KnobSpec {
        name: "node_bytes",
        default: "1024",
        help: "bytes per tree node, a multiple of 64 in 256..=1088 (Sherman uses 1 KiB)",
    },
    KnobSpec {
        name: "cache_mb",
        default: "64",
        help: "index cache of inner nodes per compute process, MiB (0 = no cache)",
    },
    KnobSpec {
        name: "chunk_kb",
        default: "256",
        help: "KiB a client takes from a memory node per allocation RPC",
    },
    KnobSpec {
        name: "pool_mb",
        default: "0",
        help: "memory pool per memory node, MiB (0 = sized for the expected keys)",
    },
    KnobSpec {
        name: "load_fill",
        default: "80",
        help: "percent of a node's entries a bulk load fills",
    },
];

/// `u64::MAX` is the +infinity fence and the empty-entry marker.
pub const CAPS: Capabilities = Capabilities {
    scan: true,
    max_value_len: MAX_VALUE_LEN,
    reserved_keys: &[EMPTY_KEY],
    reserved_why: "u64::MAX is the B+link tree's +infinity fence and marks empty leaf entries",
};

/// Typed settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    pub node_bytes: usize,
    pub cache_bytes: u64,
    pub chunk_bytes: u64,
    pub pool_bytes: u64,
    pub load_fill_percent: usize,
}

impl Config {
    pub fn from_args(args: &ServeArgs) -> Result<Config> {
        let k = &args.knobs;
        let node_bytes: usize = k.get(NAME, KNOBS, "node_bytes")?;
        if !(MIN_NODE_BYTES..=MAX_NODE_BYTES).contains(&node_bytes)
            || !node_bytes.is_multiple_of(64)
        {
            return Err(KvError::Config(format!(
                "{NAME}.node_bytes={node_bytes}: must be a multiple of 64 in {MIN_NODE_BYTES}..={MAX_NODE_BYTES}"
            )));
        }
        let chunk_bytes = k.get::<u64>(NAME, KNOBS, "chunk_kb")? << 10;
        if chunk_bytes < (node_bytes as u64).max(8192) {
            return Err(KvError::Config(format!(
                "{NAME}.chunk_kb is too small for a node or the largest value block"
            )));
        }
        let fill: usize = k.get(NAME, KNOBS, "load_fill")?;
        if !(10..=100).contains(&fill) {
            return Err(KvError::Config(format!(
                "{NAME}.load_fill={fill}: must be in 10..=100"
            )));
        }
        let memnodes = args.nodes.len().max(1) as u64;
        if memnodes as usize > MAX_MEMNODES {
            return Err(KvError::Config(format!(
                "{NAME} addresses at most {MAX_MEMNODES} memory nodes"
            )));
        }
        let pool_mb: u64 = k.get(NAME, KNOBS, "pool_mb")?;
        let pool_bytes = if pool_mb != 0 {
            pool_mb << 20
        } else {
            // Half-full nodes after splits, inner nodes, value blocks twice
            // over, and room for many clients' partly used chunks.
            let keys = args.expected_keys.div_ceil(memnodes) + 1024;
            let per_node = ((node_bytes - 64) / 16 / 2) as u64;
            let nodes = keys.div_ceil(per_node) * 5 / 4 + 16;
            let value = u64::from(args.value_size);
            let blocks = if value == 8 {
                0
            } else {
                keys * (layout::block_bytes(value as usize) as u64).next_power_of_two() * 2
            };
            POOL_RESERVED + nodes * node_bytes as u64 + blocks + 64 * chunk_bytes
        };
        Ok(Config {
            node_bytes,
            cache_bytes: k.get::<u64>(NAME, KNOBS, "cache_mb")? << 20,
            chunk_bytes,
            pool_bytes,
            load_fill_percent: fill,
        })
    }
}

impl EngineSpec for ShermanSpec {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        NAME
    }
    fn about(&self) -> &'static str {
        "Sherman-style one-sided B+link tree: CAS node locks (hierarchical), checksum-validated reads, cached inner nodes"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        KNOBS
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        let cfg = Config::from_args(args)?;
        let pool = rt.register_region(&args.name("pool"), cfg.pool_bytes as usize)?;
        rt.register_region(&args.name("locks"), (LOCK_WORDS * 8) as usize)?;
        let mut start = POOL_RESERVED;
        if args.node_index == 0 {
            // The initial tree: one empty leaf, the root.
            let root = GAddr::new(0, POOL_RESERVED);
            let mut leaf = NodeImage::new(cfg.node_bytes, 0, 0, EMPTY_KEY, GAddr::NULL);
            leaf.seal();
            pool.mem
                .write(root.offset(), leaf.bytes())
                .map_err(|e| KvError::Config(format!("initial root: {e}")))?;
            pool.mem
                .store_u64(ROOT_WORD, root.0)
                .map_err(|e| KvError::Config(format!("root word: {e}")))?;
            start += cfg.node_bytes as u64;
        }
        let bump = Arc::new(BumpAllocator::new("sherman pool", &pool, start, pool.len()));
        let chunk = cfg.chunk_bytes;
        rt.register_service(
            &args.name("alloc"),
            Arc::new(move |_: &RpcContext, req: &[u8]| serve_chunk(&bump, chunk, req)),
        )
        .map_err(|e| KvError::Config(e.to_string()))?;
        Ok(())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let cfg = Config::from_args(&args.serve)?;
        let ep = args.fabric.endpoint(args.compute_node)?;
        let mut pools = Vec::new();
        let mut lock_tables = Vec::new();
        let mut chunks = Vec::new();
        for node in args.serve.node_ids() {
            pools.push(block_on(ep.lookup_region(node, &args.serve.name("pool")))?);
            lock_tables.push(block_on(ep.lookup_region(node, &args.serve.name("locks")))?);
            chunks.push(ChunkSource {
                node,
                service: block_on(ep.lookup_service(node, &args.serve.name("alloc")))?,
                chunk: cfg.chunk_bytes,
            });
        }
        if pools.is_empty() {
            return Err(KvError::Config(format!("{NAME} needs a memory node")));
        }
        let memnodes = pools.len();
        Ok(Arc::new(ShermanEngine {
            cfg,
            compute: args.compute_node,
            shared: Arc::new(TreeShared {
                node_bytes: cfg.node_bytes,
                pools,
                lock_tables,
                chunks,
                local_locks: LocalLocks::new(memnodes),
                cache: IndexCache::new(cfg.cache_bytes),
                lock_tag: u64::from(args.compute_node.0) + 1,
                stats: TreeStats::default(),
            }),
        }))
    }
}

struct ShermanEngine {
    cfg: Config,
    compute: NodeId,
    shared: Arc<TreeShared>,
}

impl ShermanEngine {
    fn allocs(&self) -> RefCell<Vec<LocalAlloc>> {
        RefCell::new(
            (0..self.shared.pools.len())
                .map(|_| LocalAlloc::default())
                .collect(),
        )
    }
}

#[async_trait(?Send)]
impl Engine for ShermanEngine {
    fn name(&self) -> &'static str {
        NAME
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(ShermanClient {
            shared: self.shared.clone(),
            ep,
            alloc: self.allocs(),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let alloc = self.allocs();
        let ctx = Ctx {
            t: &self.shared,
            ep,
            alloc: &alloc,
        };
        if let Some((root, g)) = ctx.lock_empty_root().await? {
            let mut sorted: Vec<(Key, &[u8])> =
                pairs.iter().map(|(k, v)| (*k, v.as_slice())).collect();
            sorted.sort_unstable_by_key(|p| p.0);
            if sorted.windows(2).any(|w| w[0].0 == w[1].0) {
                return Err(KvError::Config("bulk load of duplicate keys".into()));
            }
            let cap = (self.cfg.node_bytes - layout::NODE_HEADER_BYTES) / layout::ENTRY_BYTES;
            let fill = (cap * self.cfg.load_fill_percent / 100).clamp(2, cap);
            return ctx.bulk_build(root, g, &sorted, fill).await;
        }
        // Not empty: the ordinary insert path.
        for (k, v) in pairs {
            ctx.modify(*k, WriteOp::Upsert(v)).await?;
        }
        Ok(())
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let alloc = self.allocs();
        let ctx = Ctx {
            t: &self.shared,
            ep,
            alloc: &alloc,
        };
        let s = &self.shared.stats;
        let c = &self.shared.cache;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        Ok(serde_json::json!({
            "height": ctx.height().await?,
            "nodes_created": get(&s.nodes_created) + 1,
            "splits": get(&s.splits),
            "root_grows": get(&s.root_grows),
            "lock_retries": get(&s.lock_retries),
            "lock_handovers": get(&s.handovers),
            "torn_retries": get(&s.torn_retries),
            "value_retries": get(&s.value_retries),
            "move_rights": get(&s.move_rights),
            "cache_hits": get(&c.hits),
            "cache_misses": get(&c.misses),
            "cache_evictions": get(&c.evictions),
            "cache_nodes": c.len(),
            "cache_bytes": c.bytes(),
            "chunks_allocated": get(&s.chunks),
            "node_bytes": self.cfg.node_bytes,
        }))
    }
    fn client_cache_bytes(&self) -> u64 {
        self.shared.cache.bytes()
    }
}

struct ShermanClient {
    shared: Arc<TreeShared>,
    ep: Rc<Endpoint>,
    alloc: RefCell<Vec<LocalAlloc>>,
}

impl ShermanClient {
    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            t: &self.shared,
            ep: &self.ep,
            alloc: &self.alloc,
        }
    }
}

#[async_trait(?Send)]
impl KvStore for ShermanClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        self.ctx().get(key).await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        Ok(!self.ctx().modify(key, WriteOp::Insert(value)).await?)
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.ctx().modify(key, WriteOp::Update(value)).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        Ok(!self.ctx().modify(key, WriteOp::Upsert(value)).await?)
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        self.ctx().modify(key, WriteOp::Delete).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        self.ctx().scan(start, n).await
    }
}
