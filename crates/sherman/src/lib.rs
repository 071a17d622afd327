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
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvClient, KvError, KvStore,
    Result, ServeArgs,
};
use dmkv_memnode::{GrowingPool, NodeRuntime, RemoteSegments, SegmentShape};
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, RpcContext};
use layout::{
    EMPTY_KEY, GAddr, MAX_MEMNODES, MAX_NODE_BYTES, MAX_VALUE_LEN, MIN_NODE_BYTES, NodeImage,
};
use lock::{LOCK_WORDS, LocalLocks};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use tree::{Ctx, POOL_RESERVED, ROOT_WORD, TreeShared, WriteOp};

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
        help: "index cache of level-1 nodes per compute process, MiB of whole nodes (0 = no cache)",
    },
    KnobSpec {
        name: "lock_read",
        default: "separate",
        help: "how a writer takes a node's lock and reads it: separate (a CAS, retried until it \
               succeeds, then a READ: two round trips, as Sherman's released code, which ROLEX ran) \
               or combined (CAS and READ in one batch: one round trip)",
    },
    KnobSpec {
        name: "chunk_kb",
        default: "256",
        help: "KiB a client takes from a memory node per allocation RPC, 8..=65536 and at least a node",
    },
    KnobSpec {
        name: "pool_mb",
        default: "0",
        help: "first pool segment per memory node, MiB, up to 4096 (0 = sized for the expected keys); \
               the pool grows by further segments, each twice the one before, when it is full",
    },
    KnobSpec {
        name: "pool_max_mb",
        default: "0",
        help: "most memory the pool may register per memory node, MiB (0 = the 32 GiB a value pointer reaches)",
    },
    KnobSpec {
        name: "load_fill",
        default: "80",
        help: "percent of a node's entries a bulk load fills, 10..=100",
    },
];

/// The pool's offset space: segments of up to 4 GiB, as many as a fat
/// pointer's 32-bit word offset reaches (32 GiB per memory node).
pub const POOL_SHAPE: SegmentShape = SegmentShape {
    span: 1 << 32,
    max_segments: 8,
};
/// What a fat pointer reaches: 2^32 words.
const POOL_LIMIT: u64 = 8 << 32;
const _: () = assert!(POOL_SHAPE.span * POOL_SHAPE.max_segments <= POOL_LIMIT);

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
    /// Bytes of the pool's first segment per memory node.
    pub pool_bytes: u64,
    /// Most bytes the pool registers per memory node.
    pub pool_limit: u64,
    pub load_fill_percent: usize,
    /// `lock_read=combined`: the lock's CAS and the node's READ in one
    /// batch; else the CAS first, the READ once it succeeded.
    pub combined_lock_read: bool,
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
        let chunk_bytes = k.get_in::<u64>(NAME, KNOBS, "chunk_kb", 8..=65536)? << 10;
        if chunk_bytes < (node_bytes as u64).max(8192) {
            return Err(KvError::Config(format!(
                "{NAME}.chunk_kb is too small for a node or the largest value block"
            )));
        }
        let fill: usize = k.get_in(NAME, KNOBS, "load_fill", 10..=100)?;
        let combined_lock_read = match k.get::<String>(NAME, KNOBS, "lock_read")?.as_str() {
            "separate" => false,
            "combined" => true,
            other => {
                return Err(KvError::Config(format!(
                    "{NAME}.lock_read={other}: must be separate or combined"
                )));
            }
        };
        let memnodes = args.nodes.len().max(1) as u64;
        if memnodes as usize > MAX_MEMNODES {
            return Err(KvError::Config(format!(
                "{NAME} addresses at most {MAX_MEMNODES} memory nodes"
            )));
        }
        let pool_mb: u64 = k.get_in(NAME, KNOBS, "pool_mb", 0..=POOL_SHAPE.span >> 20)?;
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
            (POOL_RESERVED + nodes * node_bytes as u64 + blocks + 64 * chunk_bytes)
                .min(POOL_SHAPE.span)
        };
        let max_mb: u64 = k.get_in(NAME, KNOBS, "pool_max_mb", 0..=POOL_LIMIT >> 20)?;
        let pool_limit = if max_mb == 0 {
            POOL_LIMIT
        } else {
            max_mb << 20
        };
        let pool_bytes = pool_bytes.min(pool_limit);
        if pool_bytes < POOL_RESERVED + node_bytes as u64 + chunk_bytes {
            return Err(KvError::Config(format!(
                "{NAME}: a pool of {pool_bytes} bytes (pool_mb={pool_mb}, pool_max_mb={max_mb}) \
                 cannot hold the superblock, the root and one chunk"
            )));
        }
        Ok(Config {
            node_bytes,
            cache_bytes: k.get_in::<u64>(NAME, KNOBS, "cache_mb", 0..=1 << 20)? << 20,
            chunk_bytes,
            pool_bytes,
            pool_limit,
            load_fill_percent: fill,
            combined_lock_read,
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
        let mut reserved = POOL_RESERVED;
        if args.node_index == 0 {
            reserved += cfg.node_bytes as u64;
        }
        let pool = GrowingPool::new(
            rt,
            &args.name("pool"),
            POOL_SHAPE,
            cfg.pool_bytes,
            reserved,
            cfg.pool_limit,
        )
        .map_err(|e| KvError::Config(format!("{NAME} pool: {e}")))?;
        rt.register_region(&args.name("locks"), (LOCK_WORDS * 8) as usize)?;
        if args.node_index == 0 {
            // The initial tree: one empty leaf, the root.
            let seg0 = pool.first_segment();
            let root = GAddr::new(0, POOL_RESERVED);
            let mut leaf = NodeImage::new(cfg.node_bytes, 0, 0, EMPTY_KEY, GAddr::NULL);
            leaf.seal();
            seg0.mem
                .write(root.offset(), leaf.bytes())
                .map_err(|e| KvError::Config(format!("initial root: {e}")))?;
            seg0.mem
                .store_u64(ROOT_WORD, root.0)
                .map_err(|e| KvError::Config(format!("root word: {e}")))?;
        }
        let bump = Arc::new(pool);
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
            let name = args.serve.name("pool");
            let first = block_on(ep.lookup_region(node, &name))?;
            pools.push(RemoteSegments::new(node, &name, POOL_SHAPE, first));
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
        // Another compute process of a simulated cluster: its counters
        // (only those) are compute node 0's.
        let (stats, cache_counts) = match args.counting_into::<ShermanEngine>() {
            Some(first) => (
                first.shared.stats.clone(),
                first.shared.cache.counts.clone(),
            ),
            None => Default::default(),
        };
        Ok(Arc::new(ShermanEngine {
            cfg,
            compute: args.compute_node,
            shared: Arc::new(TreeShared {
                node_bytes: cfg.node_bytes,
                pools,
                lock_tables,
                chunks,
                local_locks: LocalLocks::new(memnodes),
                cache: IndexCache::counting_into(cfg.cache_bytes, cfg.node_bytes, cache_counts),
                root_hint: Default::default(),
                lock_tag: u64::from(args.compute_node.0) + 1,
                combined_lock_read: cfg.combined_lock_read,
                roots_grown: Default::default(),
                stats,
            }),
            load_alloc: parking_lot::Mutex::new(Vec::new()),
            load_spread: AtomicUsize::new(0),
        }))
    }
}

struct ShermanEngine {
    cfg: Config,
    compute: NodeId,
    shared: Arc<TreeShared>,
    /// The loader's allocators, kept from one `load` call to the next: the
    /// harness loads in many small calls, and a fresh allocator per call
    /// would leave most of a chunk unused each time (at 4096 keys a call,
    /// a million keys wasted 60 MiB of 256 KiB chunks).
    load_alloc: parking_lot::Mutex<Vec<LocalAlloc>>,
    /// The loader's split-sibling target (`Ctx::alloc_spread_node`), kept
    /// from one `load` call to the next like its allocators.
    load_spread: AtomicUsize,
}

impl ShermanEngine {
    fn allocs(&self) -> RefCell<Vec<LocalAlloc>> {
        RefCell::new(
            (0..self.shared.pools.len())
                .map(|_| LocalAlloc::default())
                .collect(),
        )
    }

    /// One load call with the loader's allocators.
    async fn load_with(
        &self,
        ep: &Endpoint,
        pairs: &[(Key, Vec<u8>)],
        alloc: &RefCell<Vec<LocalAlloc>>,
    ) -> Result<()> {
        let ctx = Ctx {
            t: &self.shared,
            ep,
            alloc,
            spread: &self.load_spread,
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
    async fn client(&self, ep: Rc<Endpoint>, thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(ShermanClient {
            shared: self.shared.clone(),
            ep,
            alloc: self.allocs(),
            // The artifact starts a thread's chunk target at its thread id
            // (plus its node id) modulo the memory nodes.
            spread: AtomicUsize::new(thread),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        if pairs.is_empty() {
            return Ok(());
        }
        let kept = std::mem::take(&mut *self.load_alloc.lock());
        let alloc = if kept.is_empty() {
            self.allocs()
        } else {
            RefCell::new(kept)
        };
        let res = self.load_with(ep, pairs, &alloc).await;
        *self.load_alloc.lock() = alloc.into_inner();
        res
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let alloc = self.allocs();
        let spread = AtomicUsize::new(0);
        let ctx = Ctx {
            t: &self.shared,
            ep,
            alloc: &alloc,
            spread: &spread,
        };
        let s = &self.shared.stats;
        let c = &self.shared.cache;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        Ok(serde_json::json!({
            "height": ctx.height().await?,
            "nodes_created": get(&s.nodes_created) + 1,
            "splits": get(&s.splits),
            "root_grows": get(&s.root_grows),
            "root_races": get(&s.root_races),
            "root_refreshes": get(&s.root_refreshes),
            "lock_retries": get(&s.lock_retries),
            "lock_handovers": get(&s.handovers),
            "torn_retries": get(&s.torn_retries),
            "value_retries": get(&s.value_retries),
            "move_rights": get(&s.move_rights),
            "cache_hits": get(&c.counts.hits),
            "cache_misses": get(&c.counts.misses),
            "cache_evictions": get(&c.counts.evictions),
            "cache_nodes": c.len(),
            "cache_bytes": c.bytes(),
            "chunks_allocated": get(&s.chunks),
            "node_bytes": self.cfg.node_bytes,
            "lock_read": if self.cfg.combined_lock_read { "combined" } else { "separate" },
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
    spread: AtomicUsize,
}

impl ShermanClient {
    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            t: &self.shared,
            ep: &self.ep,
            alloc: &self.alloc,
            spread: &self.spread,
        }
    }
}

impl KvClient for ShermanClient {
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
