//! # dmkv-race: RACE hashing (Zuo et al., ATC'21)
//!
//! Outback's main one-sided competitor: an extendible hash table on memory
//! nodes that compute nodes drive entirely with one-sided verbs. Subtables
//! of bucket groups `[main | overflow | main]`; each key has two hash
//! choices, each naming a *combined bucket* (a main bucket plus the overflow
//! bucket it shares), and both are read in one doorbell batch. Slots are
//! 8-byte words `{fingerprint, length, KV pointer}` changed only by CAS; KV
//! blocks are written out of place before the CAS that publishes them.
//! Clients cache the directory (global depth, per-subtable local depth) and
//! refresh it when a bucket header disagrees. Full subtables split one at a
//! time under a lock without blocking readers.
//!
//! - [`layout`]: slots, directory entries, bucket headers, KV blocks;
//! - [`alloc`]: chunks and subtables from the memory node, KV blocks carved
//!   by clients;
//! - [`ops`]: get / insert / update / upsert / delete;
//! - [`resize`]: splitting a subtable.
//!
//! A GET costs two round trips and no memory-node CPU. Departures from the
//! paper (tentative insert claims, retiring split subtables) are argued in
//! `docs/race.md`.

#![forbid(unsafe_code)]

pub mod alloc;
pub mod layout;
pub mod ops;
pub mod resize;

use alloc::{AllocSizes, AllocSource, serve_alloc};
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvClient, KvError, KvStore,
    Result, ServeArgs,
};
use dmkv_memnode::{GrowingPool, NodeRuntime, RemoteSegments, SegmentShape};
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, RpcContext};
use layout::{
    DIR_DEPTH, DIR_ENTRIES, DIR_RESIZES, DirEntry, GAddr, GROUP_BYTES, MAX_DEPTH, MAX_MEMNODES,
    MAX_VALUE_LEN, SLOTS_PER_BUCKET, Slot, dir_bytes, kv_units,
};
use ops::{Ctx, DirCache, KINDS, Kind, PerThread, PutMode, RaceShared, subtable_image};
use parking_lot::RwLock;
use std::cell::Cell;
use std::collections::BTreeSet;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// The engine spec; register it as `race`.
pub struct RaceSpec;

/// The spec of `race`.
pub static SPEC: RaceSpec = RaceSpec;

const NAME: &str = "race";

/// Bytes at the start of every pool kept out of allocation (so that no
/// directory entry or slot points at offset 0).
const POOL_RESERVED: u64 = 4096;

const KNOBS: &[KnobSpec] = &[
    KnobSpec {
        name: "groups",
        default: "256",
        help: "bucket groups per subtable (3 buckets of 7 slots each)",
    },
    KnobSpec {
        name: "initial_depth",
        default: "auto",
        help: "global depth at start (2^depth subtables), or auto: sized for the expected keys at half load",
    },
    KnobSpec {
        name: "chunk_kb",
        default: "256",
        help: "KiB of KV blocks a client takes from a memory node per allocation RPC, 8..=65536",
    },
    KnobSpec {
        name: "pool_mb",
        default: "0",
        help: "first pool segment per memory node, MiB, up to 4096 (0 = sized for the expected keys, loaded plus inserted); \
               the pool grows by further segments, each twice the one before, when it is full",
    },
    KnobSpec {
        name: "pool_max_mb",
        default: "0",
        help: "most memory the pool may register per memory node, MiB (0 = 256 GiB: 64 segments of 4 GiB)",
    },
];

/// The pool's offset space: segments of up to 4 GiB; 64 of them stay well
/// inside what a slot (36 bits of 64-byte units: 4 TiB) and a directory
/// entry (40 bits of 64-byte units) address.
pub const POOL_SHAPE: SegmentShape = SegmentShape {
    span: 1 << 32,
    max_segments: 64,
};
const POOL_LIMIT: u64 = POOL_SHAPE.span * POOL_SHAPE.max_segments;
const _: () = assert!(POOL_LIMIT / 64 <= 1 << 36);

/// Keys live in KV blocks and empty slots are the zero word: no key is
/// reserved.
pub const CAPS: Capabilities = Capabilities {
    scan: false,
    max_value_len: MAX_VALUE_LEN,
    reserved_keys: &[],
    reserved_why: "race reserves no keys",
};

/// Typed settings.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Config {
    pub groups: u64,
    pub initial_depth: u8,
    pub chunk_bytes: u64,
    /// Bytes of the pool's first segment per memory node.
    pub pool_bytes: u64,
    /// Most bytes the pool registers per memory node.
    pub pool_limit: u64,
    pub memnodes: usize,
}

impl Config {
    pub fn subtable_bytes(&self) -> u64 {
        self.groups * GROUP_BYTES
    }

    pub fn from_args(args: &ServeArgs) -> Result<Config> {
        let k = &args.knobs;
        let groups: u64 = k.get(NAME, KNOBS, "groups")?;
        if !(1..=1 << 20).contains(&groups) {
            return Err(KvError::Config(format!(
                "{NAME}.groups={groups}: must be in 1..=2^20"
            )));
        }
        let memnodes = args.nodes.len().max(1);
        if memnodes > MAX_MEMNODES {
            return Err(KvError::Config(format!(
                "{NAME} addresses at most {MAX_MEMNODES} memory nodes"
            )));
        }
        let slots = groups * 3 * SLOTS_PER_BUCKET as u64;
        let keys = args.expected_keys.max(1);
        let depth_raw: String = k.get(NAME, KNOBS, "initial_depth")?;
        let initial_depth = if depth_raw == "auto" {
            let subtables = keys.div_ceil(slots / 2).next_power_of_two();
            (subtables.trailing_zeros() as u8).min(MAX_DEPTH - 4)
        } else {
            match depth_raw.parse::<u8>() {
                Ok(d) if d < MAX_DEPTH => d,
                _ => {
                    return Err(KvError::Config(format!(
                        "{NAME}.initial_depth={depth_raw}: must be auto or below {MAX_DEPTH}"
                    )));
                }
            }
        };
        let chunk_bytes = k.get_in::<u64>(NAME, KNOBS, "chunk_kb", 8..=65536)? << 10;
        let st_bytes = groups * GROUP_BYTES;
        let pool_mb: u64 = k.get_in(NAME, KNOBS, "pool_mb", 0..=POOL_SHAPE.span >> 20)?;
        let pool_bytes = if pool_mb != 0 {
            pool_mb << 20
        } else {
            // Live subtables at 40% load, as many retired ones again, the
            // initial ones; KV blocks twice over; many clients' chunks.
            let needed = keys.div_ceil(slots * 2 / 5).max(1 << initial_depth);
            let subtables = (needed * 2 + (1 << initial_depth) + 2).div_ceil(memnodes as u64);
            let kv = keys.div_ceil(memnodes as u64)
                * u64::from(kv_units(args.value_size as usize))
                * 64
                * 2;
            (POOL_RESERVED + subtables * st_bytes + kv + 64 * chunk_bytes).min(POOL_SHAPE.span)
        };
        let max_mb: u64 = k.get_in(NAME, KNOBS, "pool_max_mb", 0..=POOL_LIMIT >> 20)?;
        let pool_limit = if max_mb == 0 {
            POOL_LIMIT
        } else {
            max_mb << 20
        };
        let pool_bytes = pool_bytes.min(pool_limit);
        if chunk_bytes.max(st_bytes) > POOL_SHAPE.span {
            return Err(KvError::Config(format!(
                "{NAME}: chunks and subtables must fit a {} GiB pool segment",
                POOL_SHAPE.span >> 30
            )));
        }
        Ok(Config {
            groups,
            initial_depth,
            chunk_bytes,
            pool_bytes,
            pool_limit,
            memnodes,
        })
    }

    /// Where initial subtable `j` lives: memory node `j % K`, packed after
    /// the reserved bytes.
    fn initial_subtable(&self, j: u64) -> GAddr {
        let k = self.memnodes as u64;
        GAddr {
            mn: (j % k) as usize,
            offset: POOL_RESERVED + (j / k) * self.subtable_bytes(),
        }
    }
}

impl EngineSpec for RaceSpec {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        NAME
    }
    fn about(&self) -> &'static str {
        "RACE hashing: one-sided extendible hashing, combined buckets read in one batch, lock-free CAS on slots, cached directory"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        KNOBS
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        let cfg = Config::from_args(args)?;
        let me = args.node_index;
        let n0 = 1u64 << cfg.initial_depth;
        let mine = (0..n0)
            .filter(|j| cfg.initial_subtable(*j).mn == me)
            .count() as u64;
        let start = POOL_RESERVED + mine * cfg.subtable_bytes();
        if start > cfg.pool_bytes {
            return Err(KvError::Config(format!(
                "{NAME}: a first pool segment of {} bytes cannot hold the initial subtables \
                 ({start} bytes): set {NAME}.pool_mb to 0 (sized) or at least {} MiB",
                cfg.pool_bytes,
                start.div_ceil(1 << 20)
            )));
        }
        let pool = GrowingPool::new(
            rt,
            &args.name("pool"),
            POOL_SHAPE,
            cfg.pool_bytes,
            start,
            cfg.pool_limit,
        )
        .map_err(|e| KvError::Config(format!("{NAME} pool: {e}")))?;
        let seg0 = pool.first_segment();
        let init = |e: dmkv_api::Result<(), dmkv_transport::region::RegionAccessError>| {
            e.map_err(|e| KvError::Config(format!("initialising {NAME}: {e}")))
        };
        for j in (0..n0).filter(|j| cfg.initial_subtable(*j).mn == me) {
            let at = cfg.initial_subtable(j);
            init(
                seg0.mem
                    .write(at.offset, &subtable_image(cfg.groups, cfg.initial_depth, j)),
            )?;
        }
        if me == 0 {
            let dir = rt.register_region(&args.name("dir"), dir_bytes() as usize)?;
            init(dir.mem.store_u64(DIR_DEPTH, u64::from(cfg.initial_depth)))?;
            for j in 0..n0 {
                let e = DirEntry::new(cfg.initial_subtable(j), cfg.initial_depth);
                init(dir.mem.store_u64(DIR_ENTRIES + 8 * j, e.0))?;
            }
        }
        let bump = Arc::new(pool);
        let sizes = AllocSizes {
            chunk: cfg.chunk_bytes,
            subtable: cfg.subtable_bytes(),
        };
        rt.register_service(
            &args.name("alloc"),
            Arc::new(move |_: &RpcContext, req: &[u8]| serve_alloc(&bump, sizes, req)),
        )
        .map_err(|e| KvError::Config(e.to_string()))?;
        Ok(())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let cfg = Config::from_args(&args.serve)?;
        let ep = args.fabric.endpoint(args.compute_node)?;
        let nodes = args.serve.node_ids();
        let mut pools = Vec::new();
        let mut allocs = Vec::new();
        for &node in &nodes {
            let name = args.serve.name("pool");
            let first = block_on(ep.lookup_region(node, &name))?;
            pools.push(RemoteSegments::new(node, &name, POOL_SHAPE, first));
            allocs.push(AllocSource {
                node,
                service: block_on(ep.lookup_service(node, &args.serve.name("alloc")))?,
                sizes: AllocSizes {
                    chunk: cfg.chunk_bytes,
                    subtable: cfg.subtable_bytes(),
                },
            });
        }
        let Some(&first) = nodes.first() else {
            return Err(KvError::Config(format!("{NAME} needs a memory node")));
        };
        let dir = block_on(ep.lookup_region(first, &args.serve.name("dir")))?;
        // Another compute process of a simulated cluster counts into
        // compute node 0's counters (only those; its cache is its own).
        let stats = match args.counting_into::<RaceEngine>() {
            Some(first) => first.shared.stats.clone(),
            None => Arc::default(),
        };
        let engine = RaceEngine {
            cfg,
            compute: args.compute_node,
            shared: Arc::new(RaceShared {
                groups: cfg.groups,
                subtable_bytes: cfg.subtable_bytes(),
                pools,
                dir,
                allocs,
                cache: RwLock::new(DirCache::default()),
                lock_tag: u64::from(args.compute_node.0) + 1,
                stats,
            }),
        };
        let alloc = engine.allocs();
        block_on(dmkv_transport::labeled(
            dmkv_transport::OpKind::Setup,
            engine.ctx(&ep, &alloc).refresh_dir(),
        ))?;
        Ok(Arc::new(engine))
    }
}

struct RaceEngine {
    cfg: Config,
    compute: NodeId,
    shared: Arc<RaceShared>,
}

impl RaceEngine {
    fn allocs(&self) -> PerThread {
        PerThread::new(self.shared.pools.len())
    }
    fn ctx<'a>(&'a self, ep: &'a Endpoint, local: &'a PerThread) -> Ctx<'a> {
        Ctx {
            t: &self.shared,
            ep,
            local,
            rtts: Cell::new(0),
        }
    }
}

#[async_trait(?Send)]
impl Engine for RaceEngine {
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
        Ok(Rc::new(RaceClient {
            shared: self.shared.clone(),
            ep,
            local: self.allocs(),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let alloc = self.allocs();
        for (k, v) in pairs {
            self.ctx(ep, &alloc).put(*k, v, PutMode::Upsert).await?;
        }
        Ok(())
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let alloc = self.allocs();
        let ctx = self.ctx(ep, &alloc);
        ctx.refresh_dir().await?;
        let (depth, entries) = {
            let c = self.shared.cache.read();
            (c.depth, c.entries.clone())
        };
        let live: BTreeSet<(usize, u64, u8)> = entries
            .iter()
            .map(|e| (e.subtable().mn, e.subtable().offset, e.local_depth()))
            .collect();
        // Load factor: visible slots over all slots of live subtables.
        let mut used = 0u64;
        let mut local_depths = Vec::new();
        for &(mn, offset, ld) in &live {
            local_depths.push(ld);
            let img = ep
                .read(
                    ctx.pool_at(GAddr { mn, offset }).await?,
                    self.cfg.subtable_bytes() as usize,
                )
                .await?;
            for bucket in img.chunks_exact(64) {
                for w in bucket[8..].chunks_exact(8) {
                    let s = Slot(u64::from_le_bytes(w.try_into().expect("8 bytes")));
                    used += u64::from(s.is_visible() && !s.is_frozen());
                }
            }
        }
        let slots = live.len() as u64 * self.cfg.groups * 3 * SLOTS_PER_BUCKET as u64;
        let resizes = u64::from_le_bytes(
            ep.read(self.shared.dir.at(DIR_RESIZES), 8)
                .await?
                .try_into()
                .expect("8 bytes"),
        );
        let s = &self.shared.stats;
        let get = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        let mut rtts = serde_json::Map::new();
        for (name, kind) in KINDS {
            let ops = get(&s.ops[kind as usize]);
            if ops > 0 {
                rtts.insert(
                    name.into(),
                    serde_json::json!(get(&s.round_trips[kind as usize]) as f64 / ops as f64),
                );
            }
        }
        Ok(serde_json::json!({
            "global_depth": depth,
            "subtables": live.len(),
            "local_depth_min": local_depths.iter().min(),
            "local_depth_max": local_depths.iter().max(),
            "keys": used,
            "load_factor": if slots == 0 { 0.0 } else { used as f64 / slots as f64 },
            "resizes": resizes,
            "resizes_by_this_process": get(&s.resizes),
            "cas_retries": get(&s.cas_retries),
            "insert_conflicts": get(&s.insert_conflicts),
            "frozen_waits": get(&s.frozen_waits),
            "resize_lock_waits": get(&s.resize_lock_waits),
            "split_aborts": get(&s.split_aborts),
            "dir_refreshes": get(&s.dir_refreshes),
            "header_mismatches": get(&s.header_mismatches),
            "kv_retries": get(&s.kv_retries),
            "round_trips_per_op": rtts,
        }))
    }
    fn client_cache_bytes(&self) -> u64 {
        8 * self.shared.cache.read().entries.len() as u64 + 8
    }
}

struct RaceClient {
    shared: Arc<RaceShared>,
    ep: Rc<Endpoint>,
    local: PerThread,
}

impl RaceClient {
    fn ctx(&self) -> Ctx<'_> {
        Ctx {
            t: &self.shared,
            ep: &self.ep,
            local: &self.local,
            rtts: Cell::new(0),
        }
    }
}

impl KvClient for RaceClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let c = self.ctx();
        let r = c.get(key).await;
        c.finish(Kind::Get);
        r
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        let c = self.ctx();
        let r = c
            .put(key, value, PutMode::Insert)
            .await
            .map(|existed| !existed);
        c.finish(Kind::Insert);
        r
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        let c = self.ctx();
        let r = c.put(key, value, PutMode::Update).await;
        c.finish(Kind::Update);
        r
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        let c = self.ctx();
        let r = c
            .put(key, value, PutMode::Upsert)
            .await
            .map(|existed| !existed);
        c.finish(Kind::Upsert);
        r
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        let c = self.ctx();
        let r = c.delete(key).await;
        c.finish(Kind::Delete);
        r
    }
    async fn scan(&self, _start: Key, _n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        Err(KvError::Unsupported {
            engine: NAME,
            what: "ordered scans",
        })
    }
}
