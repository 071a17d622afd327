//! The memory-node side. Every memory node registers a leaf region, a model
//! region and a value region and then does nothing: compute nodes reach them
//! one-sided. Memory node 0 also holds the meta region (directory, CirQ) and
//! runs the only server code: the admin service (bulk load, figures) and the
//! retraining workers (§3.5) on its limited CPU.

mod load;
#[cfg(test)]
mod load_tests;
mod publish;
mod retrain;

use crate::config::{Config, names};
use crate::io::corrupt;
use crate::layout::entry::Entry;
use crate::layout::leaf::{Leaf, write_order};
use crate::layout::meta::{
    META_MAGIC, MetaLayout, ModelRef, W_DIR_SLOT_WORDS, W_INFLIGHT, W_LEAF_BYTES, W_MAGIC, W_NODES,
    W_POLLS, W_QHEAD, W_QTAIL, W_QUEUE, W_RETRAINS, W_SLOTS, W_SLT, W_UHEAD, W_UTAIL,
};
use crate::layout::record::{ModelParams, ModelState, encode_record};
use crate::remote::{
    H_ALLOC, H_CAPACITY, H_USED, LEAF_BASE, MODEL_BASE, MODELS_MAGIC, Remote, VALUE_BASE,
};
use dmkv_api::{KvError, Result, ServeArgs};
use dmkv_memnode::{NodeRuntime, WorkerPool};
use dmkv_transport::exec::block_on;
use dmkv_transport::{
    Endpoint, NodeHost, NodeId, RegionMem, RemoteRegion, RpcContext, ServiceError, WireReader,
    WireWriter, thread_cpu_ns,
};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

pub use publish::DirState;

/// Admin service operations (node 0). Not on any request path: bulk load
/// and figures.
pub mod ops {
    pub const LOAD_BEGIN: u8 = 1;
    pub const LOAD_PART: u8 = 2;
    pub const LOAD_COMMIT: u8 = 3;
    pub const STATS: u8 = 4;
}

/// Figures of memory node 0, reported in `engine_stats`.
#[derive(Default)]
pub struct ServerStats {
    pub retrains: AtomicU64,
    pub retrain_aborts: AtomicU64,
    pub retrain_failures: AtomicU64,
    /// Retrains given up because a leaf lock stayed held longer than
    /// `retrain_lock_wait_us` (the model was queued again).
    pub retrain_lock_timeouts: AtomicU64,
    pub retrain_wall_ns: AtomicU64,
    pub retrain_cpu_ns: AtomicU64,
    pub retrain_train_ns: AtomicU64,
    pub retrain_keys: AtomicU64,
    pub retrain_leaves: AtomicU64,
    pub models_from_retrains: AtomicU64,
    pub empty_leaves_merged: AtomicU64,
    pub loads: AtomicU64,
    pub load_keys: AtomicU64,
    pub load_train_ns: AtomicU64,
    pub load_cpu_ns: AtomicU64,
    /// Leaves bulk loads took from the free list instead of the region.
    pub leaves_reused: AtomicU64,
    /// Dead leaves put on the free list (by bulk loads and retrain merges).
    pub leaves_freed: AtomicU64,
    pub polls: AtomicU64,
    pub poll_cpu_ns: AtomicU64,
}

/// Most load sessions staged at once, and bytes staged in all of them.
const MAX_SESSIONS: usize = 64;
const MAX_STAGED_BYTES: usize = 8 << 30;

#[derive(Default)]
struct Loads {
    sessions: HashMap<u64, Vec<(u64, Vec<u8>)>>,
    bytes: usize,
}

/// Memory node 0's server state.
pub struct Server {
    pub cfg: Config,
    node: NodeId,
    node_ids: Vec<NodeId>,
    /// Weak: the admin service's handler holds the server, and the host
    /// holds the handler; a strong reference would keep a dropped cluster
    /// alive.
    host: Weak<dyn NodeHost>,
    region_names: [String; 3],
    meta: Arc<RegionMem>,
    meta_layout: MetaLayout,
    own: [RemoteRegion; 4],
    remote: Mutex<Option<Arc<Remote>>>,
    /// The directory as published, and the model-region allocators. Held
    /// for every publication (retrain swaps, bulk loads).
    dir: Mutex<DirState>,
    queue: Mutex<()>,
    /// Held (asynchronously) by whoever is publishing a directory: a
    /// retrain's swap or a bulk load.
    publish_busy: AtomicBool,
    loads: Mutex<Loads>,
    /// Dead leaves that bulk loads and retrain merges may reuse, per leaf
    /// region (docs/rolex.md, invariant 14).
    free: Mutex<FreeLeaves>,
    pub stats: ServerStats,
}

/// A dead leaf no live model names, and the version its next image takes
/// (one above its dead image's, so a reader whose read straddles the
/// rebirth sees the versions differ).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct FreeLeaf {
    pub leaf: u64,
    pub version: u64,
}

/// Memory node 0's free lists of leaves, one per leaf region. Only node 0
/// allocates from them (bulk loads); clients allocate synonym leaves
/// one-sided from the region's bump counter and never reuse.
#[derive(Debug, Default)]
pub(crate) struct FreeLeaves {
    pub by_region: Vec<Vec<FreeLeaf>>,
}

impl FreeLeaves {
    /// Adds leaves that are dead (their dead image written and completed)
    /// and named by no live model.
    pub fn give(&mut self, region: u8, leaves: impl IntoIterator<Item = FreeLeaf>) {
        let g = region as usize;
        if self.by_region.len() <= g {
            self.by_region.resize_with(g + 1, Vec::new);
        }
        self.by_region[g].extend(leaves);
    }

    /// Adds one dead leaf whose next image takes `version`.
    pub fn give_leaf(&mut self, id: crate::io::LeafId, version: u64) {
        self.give(
            id.region,
            [FreeLeaf {
                leaf: id.leaf,
                version,
            }],
        );
    }

    /// Takes up to `n` leaves of `region`.
    pub fn take(&mut self, region: u8, n: usize) -> Vec<FreeLeaf> {
        match self.by_region.get_mut(region as usize) {
            Some(v) => {
                let keep = v.len().saturating_sub(n);
                v.split_off(keep)
            }
            None => Vec::new(),
        }
    }

    pub fn len(&self) -> usize {
        self.by_region.iter().map(Vec::len).sum()
    }
}

/// Releases the publication lock when dropped.
pub(crate) struct Publishing<'a>(&'a AtomicBool);

impl Drop for Publishing<'_> {
    fn drop(&mut self) {
        self.0.store(false, Ordering::Release);
    }
}

/// Installs ROLEX on one memory node.
pub fn serve(rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
    let cfg = Config::from_args(args)?;
    let reg = |name: &str, len: u64| {
        rt.register_region(&args.name(name), len as usize)
            .map_err(KvError::from)
    };
    let leaves = reg(
        names::LEAVES,
        LEAF_BASE + cfg.leaves_per_node * cfg.leaf.bytes() as u64,
    )?;
    leaves.mem.store_u64(H_ALLOC, 0).expect("header");
    leaves
        .mem
        .store_u64(H_CAPACITY, cfg.leaves_per_node)
        .expect("header");
    let models = reg(names::MODELS, cfg.model_bytes)?;
    models.mem.store_u64(H_ALLOC, MODELS_MAGIC).expect("header");
    models
        .mem
        .store_u64(H_CAPACITY, cfg.model_bytes)
        .expect("header");
    let values = reg(names::VALUES, cfg.value_bytes)?;
    values.mem.store_u64(H_ALLOC, VALUE_BASE).expect("header");
    values
        .mem
        .store_u64(H_CAPACITY, cfg.value_bytes)
        .expect("header");
    models.mem.store_u64(H_USED, MODEL_BASE).expect("header");
    spawn_accountant(
        Arc::downgrade(rt),
        [leaves.clone(), models.clone(), values.clone()],
        cfg.leaf.bytes() as u64,
    );
    if args.node_index != 0 {
        return Ok(());
    }
    let meta_layout = MetaLayout {
        queue: cfg.queue_slots,
        dir_slot_words: cfg.dir_slot_words(),
    };
    let meta = reg(names::META, (meta_layout.words() * 8) as u64)?;
    let m = &meta.mem;
    for (w, v) in [
        (W_MAGIC, META_MAGIC),
        (W_SLOTS, cfg.slots() as u64),
        (W_SLT, cfg.slt_slots as u64),
        (W_NODES, cfg.nodes as u64),
        (W_QUEUE, cfg.queue_slots as u64),
        (W_DIR_SLOT_WORDS, cfg.dir_slot_words() as u64),
        (W_LEAF_BYTES, cfg.leaf.bytes() as u64),
    ] {
        m.store_u64(w as u64 * 8, v).expect("meta header");
    }
    let server = Arc::new(Server {
        node: rt.id(),
        node_ids: args.node_ids(),
        host: Arc::downgrade(rt.host()),
        region_names: [
            args.name(names::LEAVES),
            args.name(names::MODELS),
            args.name(names::VALUES),
        ],
        meta: meta.mem.clone(),
        meta_layout,
        own: [meta.remote, leaves.remote, models.remote, values.remote],
        remote: Mutex::new(None),
        dir: Mutex::new(DirState::new(cfg.nodes)),
        queue: Mutex::new(()),
        publish_busy: AtomicBool::new(false),
        loads: Mutex::new(Loads::default()),
        free: Mutex::new(FreeLeaves::default()),
        stats: ServerStats::default(),
        cfg,
    });
    server.install_initial_model(&leaves.mem, &models.mem)?;
    let svc = server.clone();
    rt.register_service(
        &args.name(names::SERVICE),
        Arc::new(move |_: &RpcContext, req: &[u8]| svc.handle(req)),
    )
    .map_err(|e| KvError::Config(e.to_string()))?;
    let pool = rt.worker_pool(&args.name("rolex-retrain"), server.cfg.retrain_threads);
    spawn_poller(Arc::downgrade(&server), Arc::downgrade(&pool));
    Ok(())
}

/// Keeps the node's figure of memory in use current: leaves and value
/// blocks are allocated one-sided (FAA), records by node 0, so the runtime's
/// allocators do not see them. Bookkeeping for reports only (a few loads
/// every 20 ms); it ends with the node's runtime.
fn spawn_accountant(rt: Weak<NodeRuntime>, regions: [dmkv_memnode::Region; 3], leaf_bytes: u64) {
    let _detached = dmkv_transport::exec::spawn_background("rolex-account", async move {
        while rt.upgrade().is_some() {
            let [leaves, models, values] = &regions;
            let word = |r: &dmkv_memnode::Region, off: u64| r.mem.load_u64(off).unwrap_or(0);
            leaves.set_used(LEAF_BASE + word(leaves, H_ALLOC).saturating_mul(leaf_bytes));
            models.set_used(word(models, H_USED));
            values.set_used(word(values, H_ALLOC));
            dmkv_transport::exec::sleep(Duration::from_millis(20)).await;
        }
    });
}

/// The memory node checks the CirQ every `poll_us` (a few loads of local
/// memory) and hands queued models to idle retraining workers. It holds
/// only weak references, so it ends when the node's worker pool goes away.
fn spawn_poller(server: Weak<Server>, pool: Weak<WorkerPool>) {
    let _detached = dmkv_transport::exec::spawn_background("rolex-poll", async move {
        let mut last_cpu = thread_cpu_ns();
        loop {
            let interval = match server.upgrade() {
                Some(s) => Duration::from_micros(s.cfg.poll_us),
                None => return,
            };
            dmkv_transport::exec::sleep(interval).await;
            let (Some(pool), Some(s)) = (pool.upgrade(), server.upgrade()) else {
                return;
            };
            s.stats.polls.fetch_add(1, Ordering::Relaxed);
            s.meta_faa(W_POLLS, 1);
            let idle = (s.cfg.retrain_threads as u64).saturating_sub(pool.pending());
            let queued = s.queued();
            for _ in 0..queued.min(idle) {
                let job = s.clone();
                pool.submit(move || job.retrain_next());
            }
            let now = thread_cpu_ns();
            s.stats
                .poll_cpu_ns
                .fetch_add(now.saturating_sub(last_cpu), Ordering::Relaxed);
            last_cpu = now;
        }
    });
}

impl Server {
    fn meta_load(&self, word: usize) -> u64 {
        self.meta.load_u64(word as u64 * 8).expect("meta word")
    }
    fn meta_store(&self, word: usize, v: u64) {
        self.meta.store_u64(word as u64 * 8, v).expect("meta word")
    }
    fn meta_faa(&self, word: usize, v: u64) -> u64 {
        self.meta.faa_u64(word as u64 * 8, v).expect("meta word")
    }

    /// Models queued for retraining (both queues).
    fn queued(&self) -> u64 {
        let n = self
            .meta_load(W_QTAIL)
            .saturating_sub(self.meta_load(W_QHEAD));
        n + self
            .meta_load(W_UTAIL)
            .saturating_sub(self.meta_load(W_UHEAD))
    }

    /// Takes the next queued model, urgent ones first; counts it in flight.
    fn pop(&self) -> Option<ModelRef> {
        let _g = self.queue.lock();
        for (urgent, head, tail) in [(true, W_UHEAD, W_UTAIL), (false, W_QHEAD, W_QTAIL)] {
            let h = self.meta_load(head);
            if h >= self.meta_load(tail) {
                continue;
            }
            let slot = self.meta_layout.queue_slot(urgent, h);
            let w = self.meta_load(slot);
            if w == 0 {
                // The producer took the slot by FAA but has not written it.
                continue;
            }
            self.meta_store(slot, 0);
            self.meta_store(head, h + 1);
            self.meta_faa(W_INFLIGHT, 1);
            match ModelRef::decode(w) {
                Some(m) => return Some(m),
                None => {
                    self.meta_faa(W_INFLIGHT, u64::MAX);
                    continue;
                }
            }
        }
        None
    }

    /// Queues a model from the memory node itself (a fresh model that
    /// inherited many synonym leaves).
    fn push(&self, m: ModelRef) {
        let t = self.meta_faa(W_QTAIL, 1);
        let slot = self.meta_layout.queue_slot(false, t);
        while self
            .meta
            .cas_u64(slot as u64 * 8, 0, m.encode())
            .expect("queue slot")
            != 0
        {
            dmkv_transport::time::sleep_blocking(Duration::from_micros(50));
        }
    }

    /// A retraining worker's job: retrain the next queued model, if any.
    fn retrain_next(self: Arc<Self>) {
        let Some(m) = self.pop() else { return };
        let start_cpu = thread_cpu_ns();
        let res = match self.endpoint() {
            Ok(ep) => block_on(self.retrain(&ep, m)),
            Err(e) => Err(e),
        };
        if res.is_err() {
            self.stats.retrain_aborts.fetch_add(1, Ordering::Relaxed);
        }
        self.stats
            .retrain_cpu_ns
            .fetch_add(thread_cpu_ns().saturating_sub(start_cpu), Ordering::Relaxed);
        self.meta_faa(W_INFLIGHT, u64::MAX);
        self.meta_faa(W_RETRAINS, 1);
    }

    /// Records each model region's bytes in use in its header (for the
    /// nodes' memory figures).
    pub(crate) async fn note_model_usage(&self, ep: &Endpoint, r: &Remote) -> Result<()> {
        let bump = self.dir.lock().bump.clone();
        let mut b = ep.batch();
        for (i, used) in bump.iter().enumerate() {
            b.write(r.models[i].at(H_USED), used.to_le_bytes().to_vec());
        }
        b.run().await?;
        Ok(())
    }

    pub(crate) async fn publishing(&self) -> Publishing<'_> {
        while self
            .publish_busy
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            dmkv_transport::exec::sleep(Duration::from_micros(50)).await;
        }
        Publishing(&self.publish_busy)
    }

    fn endpoint(&self) -> Result<Endpoint> {
        let host = self
            .host
            .upgrade()
            .ok_or_else(|| KvError::Config("memory node 0 is shutting down".into()))?;
        Ok(host.fabric().endpoint(self.node)?)
    }

    /// The regions of every node (resolved through the directories of the
    /// other nodes once).
    async fn remote(&self, ep: &Endpoint) -> Result<Arc<Remote>> {
        if let Some(r) = self.remote.lock().clone() {
            return Ok(r);
        }
        let [meta, l0, m0, v0] = self.own;
        let (mut leaves, mut models, mut values) = (vec![l0], vec![m0], vec![v0]);
        for node in &self.node_ids[1..] {
            leaves.push(ep.lookup_region(*node, &self.region_names[0]).await?);
            models.push(ep.lookup_region(*node, &self.region_names[1]).await?);
            values.push(ep.lookup_region(*node, &self.region_names[2]).await?);
        }
        let r = Arc::new(Remote::new(&self.cfg, meta, leaves, models, values));
        *self.remote.lock() = Some(r.clone());
        Ok(r)
    }

    /// The empty store: one model with one empty leaf covering every key.
    fn install_initial_model(&self, leaves: &RegionMem, models: &RegionMem) -> Result<()> {
        let leaf = leaves.faa_u64(H_ALLOC, 1).expect("leaf header");
        let words = Leaf::empty(0, u64::MAX).encode(&self.cfg.leaf, 1);
        let base = LEAF_BASE + leaf * self.cfg.leaf.bytes() as u64;
        for (off, bytes) in write_order(&words, base) {
            leaves.write(off, &bytes).expect("initial leaf");
        }
        let p = ModelParams {
            low: 0,
            high: u64::MAX,
            kmin: 0,
            kmax: 0,
            slope: 0.0,
            intercept: 0.0,
            err: 1,
            leaves: 1,
            slt_slots: self.cfg.slt_slots as u32,
            region: 0,
        };
        let mut slt = vec![0u64; self.cfg.slt_slots];
        slt[0] = 1;
        let lt = [Entry::new(0, leaf).encode()];
        let rec = encode_record(&p, ModelState::Active, &slt, &lt);
        let mut st = self.dir.lock();
        let off = st
            .alloc_record(0, rec.len(), self.cfg.model_bytes)
            .ok_or_else(|| KvError::Exhausted("model region too small".into()))?;
        debug_assert_eq!(off, MODEL_BASE);
        let bytes: Vec<u8> = rec.iter().flat_map(|w| w.to_le_bytes()).collect();
        models.write(off, &bytes).expect("initial record");
        self.publish(
            &mut st,
            vec![0],
            vec![ModelRef {
                node: 0,
                offset: off,
            }],
        )
        .map_err(KvError::Exhausted)
    }

    fn handle(self: &Arc<Self>, req: &[u8]) -> Result<Vec<u8>, ServiceError> {
        let mut r = WireReader::new(req);
        let op = r.u8()?;
        let mut w = WireWriter::new();
        match op {
            ops::LOAD_BEGIN => {
                r.end()?;
                let mut loads = self.loads.lock();
                if loads.sessions.len() >= MAX_SESSIONS {
                    return Err(ServiceError::exhausted("too many bulk loads in progress"));
                }
                let id = dmkv_transport::sim::random_u64() | 1;
                loads.sessions.insert(id, Vec::new());
                w.u64(id);
            }
            ops::LOAD_PART => {
                let id = r.u64()?;
                let n = r.count(12)?;
                let mut pairs = Vec::with_capacity(n);
                let mut bytes = 0;
                for _ in 0..n {
                    let k = r.u64()?;
                    let v = r.bytes()?;
                    if k == u64::MAX {
                        return Err(ServiceError::malformed("key u64::MAX is reserved"));
                    }
                    if v.len() > crate::layout::value::MAX_VALUE_LEN {
                        return Err(ServiceError::malformed(format!(
                            "a {}-byte value exceeds the limit",
                            v.len()
                        )));
                    }
                    bytes += 16 + v.len();
                    pairs.push((k, v.to_vec()));
                }
                r.end()?;
                let mut loads = self.loads.lock();
                if loads.bytes + bytes > MAX_STAGED_BYTES {
                    return Err(ServiceError::exhausted(
                        "too many bytes staged for bulk loads",
                    ));
                }
                loads.bytes += bytes;
                let s = loads
                    .sessions
                    .get_mut(&id)
                    .ok_or_else(|| ServiceError::malformed("no such bulk load"))?;
                s.extend(pairs);
            }
            ops::LOAD_COMMIT => {
                let id = r.u64()?;
                r.end()?;
                let pairs = {
                    let mut loads = self.loads.lock();
                    let p = loads
                        .sessions
                        .remove(&id)
                        .ok_or_else(|| ServiceError::malformed("no such bulk load"))?;
                    let b: usize = p.iter().map(|(_, v)| 16 + v.len()).sum();
                    loads.bytes = loads.bytes.saturating_sub(b);
                    p
                };
                let ep = self
                    .endpoint()
                    .map_err(|e| ServiceError::failed(e.to_string()))?;
                let start = thread_cpu_ns();
                let res = block_on(self.bulk_load(&ep, pairs));
                self.stats
                    .load_cpu_ns
                    .fetch_add(thread_cpu_ns().saturating_sub(start), Ordering::Relaxed);
                res.map_err(|e| match e {
                    KvError::Exhausted(m) => ServiceError::exhausted(m),
                    e => ServiceError::failed(e.to_string()),
                })?;
            }
            ops::STATS => {
                r.end()?;
                let mut figures = self.figures();
                let ep = self
                    .endpoint()
                    .map_err(|e| ServiceError::failed(e.to_string()))?;
                let (trained, synonyms) = block_on(self.table_figures(&ep))
                    .map_err(|e| ServiceError::failed(e.to_string()))?;
                figures.push(("trained_leaves", trained));
                figures.push(("synonym_leaves", synonyms));
                w.u32(figures.len() as u32);
                for (name, v) in figures {
                    w.str(name).u64(v);
                }
            }
            op => return Err(ServiceError::malformed(format!("unknown op {op}"))),
        }
        Ok(w.finish())
    }

    /// Trained leaves (LT entries) and synonym leaves (used SLT slots) of the
    /// published models.
    async fn table_figures(&self, ep: &Endpoint) -> Result<(u64, u64)> {
        let r = self.remote(ep).await?;
        let refs = self.dir.lock().refs.clone();
        let (mut trained, mut synonyms) = (0, 0);
        for chunk in refs.chunks(256) {
            let mut b = ep.batch();
            for m in chunk {
                let a = r
                    .record(*m, crate::layout::record::W_ERR_LEAVES)
                    .ok_or_else(|| corrupt("record outside its region"))?;
                b.read(a, 8);
                let a = r
                    .record(*m, crate::layout::record::W_SLT)
                    .ok_or_else(|| corrupt("record outside its region"))?;
                b.read(a, 8);
            }
            let mut res = b.run().await?;
            for i in 0..chunk.len() {
                let w = |b: Vec<u8>| u64::from_le_bytes(b[..8].try_into().expect("8"));
                trained += w(res.take_read(2 * i)) >> 32;
                synonyms += w(res.take_read(2 * i + 1)).saturating_sub(1);
            }
        }
        Ok((trained, synonyms))
    }

    fn figures(&self) -> Vec<(&'static str, u64)> {
        let s = &self.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let free = self.free.lock().len() as u64;
        let st = self.dir.lock();
        vec![
            ("models", st.refs.len() as u64),
            ("directory_version", st.version),
            ("retrains", l(&s.retrains)),
            ("retrain_aborts", l(&s.retrain_aborts)),
            ("retrain_failures", l(&s.retrain_failures)),
            ("retrain_lock_timeouts", l(&s.retrain_lock_timeouts)),
            ("retrain_wall_ns", l(&s.retrain_wall_ns)),
            ("retrain_cpu_ns", l(&s.retrain_cpu_ns)),
            ("retrain_train_ns", l(&s.retrain_train_ns)),
            ("retrain_keys", l(&s.retrain_keys)),
            ("retrain_leaves", l(&s.retrain_leaves)),
            ("models_from_retrains", l(&s.models_from_retrains)),
            ("empty_leaves_merged", l(&s.empty_leaves_merged)),
            ("loads", l(&s.loads)),
            ("load_keys", l(&s.load_keys)),
            ("load_train_ns", l(&s.load_train_ns)),
            ("load_cpu_ns", l(&s.load_cpu_ns)),
            ("leaves_freed", l(&s.leaves_freed)),
            ("leaves_reused", l(&s.leaves_reused)),
            ("leaves_free", free),
            ("polls", l(&s.polls)),
            ("poll_cpu_ns", l(&s.poll_cpu_ns)),
            ("queue_enqueued", self.meta_load(W_QTAIL)),
            ("queue_urgent_enqueued", self.meta_load(W_UTAIL)),
            ("model_region_bytes", st.bump.iter().sum()),
        ]
    }
}

/// Pushes the three writes that store `leaf` with `version` at `id`.
pub(crate) fn push_leaf_write(
    b: &mut dmkv_transport::Batch<'_>,
    r: &Remote,
    cfg: &Config,
    id: crate::io::LeafId,
    leaf: &Leaf,
    version: u64,
) -> Result<()> {
    let addr = r
        .leaf(id.region, id.leaf)
        .ok_or_else(|| corrupt(format!("leaf {id:?} outside its region")))?;
    for (off, bytes) in write_order(&leaf.encode(&cfg.leaf, version), addr.offset) {
        b.write(
            dmkv_transport::RemoteAddr {
                offset: off,
                ..addr
            },
            bytes,
        );
    }
    Ok(())
}
