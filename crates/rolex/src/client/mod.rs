//! The compute side: the engine a compute process connects (shared by its
//! threads) and the per-thread clients.

mod cache;
mod locks;
mod ops;
#[cfg(test)]
mod retired_tests;

use crate::config::{Config, ENGINE, KNOBS, names};
use crate::io::{corrupt, decode_tables, read_params, tables_span};
use crate::layout::leaf::words_of;
use crate::layout::meta::{
    Directory, W_INFLIGHT, W_LEAF_BYTES, W_NODES, W_QHEAD, W_QTAIL, W_ROOT, W_SLOTS, W_SLT,
    W_UHEAD, W_UTAIL, decode_root,
};
use crate::layout::record::ModelState;
use crate::layout::value::MAX_VALUE_LEN;
use crate::remote::{H_ALLOC, Remote};
use crate::server::ops as admin;
use async_trait::async_trait;
use cache::{Caches, ModelCache};
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvError, KvStore, Result,
    ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::exec::{block_on, sleep};
use dmkv_transport::{Endpoint, NodeId, ServiceId, WireReader, WireWriter};
use locks::LockTable;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

pub use ops::RolexClient;

pub const CAPS: Capabilities = Capabilities {
    scan: true,
    max_value_len: MAX_VALUE_LEN,
    reserved_keys: &[u64::MAX],
    reserved_why: "u64::MAX is the exclusive upper fence of the last leaf",
};

/// The ROLEX design.
pub struct RolexSpec;

impl EngineSpec for RolexSpec {
    fn name(&self) -> &'static str {
        ENGINE
    }
    fn about(&self) -> &'static str {
        "learned index over sorted fixed-size leaves; every operation one-sided (CAS leaf locks, FAA leaf allocation, synonym leaves); retraining on the memory node"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        KNOBS
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        crate::server::serve(rt, args)
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let cfg = Config::from_args(&args.serve)?;
        let ep = args.fabric.endpoint(args.compute_node)?;
        let mut shared = block_on(Shared::connect(&ep, cfg, &args.serve))?;
        // Another compute process of a simulated cluster counts into
        // compute node 0's counters (only those).
        if let Some(first) = args.counting_into::<RolexEngine>() {
            shared.stats = first.sh.stats.clone();
        }
        Ok(Arc::new(RolexEngine {
            sh: Arc::new(shared),
            compute: args.compute_node,
        }))
    }
}

/// Counters of one compute process, reported in `engine_stats`.
#[derive(Default)]
pub struct ClientStats {
    pub ops: [AtomicU64; 6],
    pub leaves_read: [AtomicU64; 6],
    pub lock_retries: AtomicU64,
    pub lock_handovers: AtomicU64,
    pub torn_leaves: AtomicU64,
    pub coverage_misses: AtomicU64,
    pub table_refreshes: AtomicU64,
    pub dir_refreshes: AtomicU64,
    pub retired_noticed: AtomicU64,
    /// Writes that found a RETIRED word in their cached LT (stale tables
    /// read during a freeze) and retried (invariant 13).
    pub retired_cached: AtomicU64,
    pub slot_use_changes_noticed: AtomicU64,
    pub splits: AtomicU64,
    pub unlinks: AtomicU64,
    pub slt_full_waits: AtomicU64,
    pub enqueued: AtomicU64,
    pub urgent_enqueued: AtomicU64,
    pub answered_without_lock: AtomicU64,
}

pub(crate) fn bump(a: &AtomicU64) {
    a.fetch_add(1, Ordering::Relaxed);
}

/// What the threads of a compute process share.
pub struct Shared {
    pub cfg: Config,
    pub remote: Remote,
    pub caches: Caches,
    pub locks: LockTable,
    /// Counted into by every compute process of a simulated cluster
    /// (`ConnectArgs::counters_from`).
    pub stats: Arc<ClientStats>,
    node0: NodeId,
    admin: ServiceId,
}

impl Shared {
    async fn connect(ep: &Endpoint, cfg: Config, args: &ServeArgs) -> Result<Shared> {
        let nodes = args.node_ids();
        let node0 = nodes[0];
        let admin = ep.lookup_service(node0, &args.name(names::SERVICE)).await?;
        let meta = ep.lookup_region(node0, &args.name(names::META)).await?;
        let mut leaves = Vec::new();
        let mut models = Vec::new();
        let mut values = Vec::new();
        for n in &nodes {
            leaves.push(ep.lookup_region(*n, &args.name(names::LEAVES)).await?);
            models.push(ep.lookup_region(*n, &args.name(names::MODELS)).await?);
            values.push(ep.lookup_region(*n, &args.name(names::VALUES)).await?);
        }
        let remote = Remote::new(&cfg, meta, leaves, models, values);
        let head = words_of(&ep.read(remote.meta_word(0), 8 * 8).await?);
        for (w, want) in [
            (W_SLOTS, cfg.slots() as u64),
            (W_SLT, cfg.slt_slots as u64),
            (W_NODES, cfg.nodes as u64),
            (W_LEAF_BYTES, cfg.leaf.bytes() as u64),
        ] {
            if head[w] != want {
                return Err(KvError::Config(format!(
                    "rolex instance was served with different settings (meta word {w} is {}, this process expects {want})",
                    head[w]
                )));
            }
        }
        let dir = read_directory(ep, &remote).await?;
        let sh = Shared {
            locks: LockTable::new(cfg.lock_sharing, cfg.max_handover),
            caches: Caches::new(dir),
            remote,
            stats: Arc::default(),
            node0,
            admin,
            cfg,
        };
        sh.prefetch(ep).await?;
        Ok(sh)
    }

    /// Fetches every listed model that is not cached yet: headers in one
    /// batch, tables in another (chunked).
    pub(crate) async fn prefetch(&self, ep: &Endpoint) -> Result<()> {
        let missing = self.caches.missing();
        for chunk in missing.chunks(256) {
            let mut b = ep.batch();
            for m in chunk {
                let a = self
                    .remote
                    .record(*m, 0)
                    .ok_or_else(|| corrupt("bad model reference"))?;
                b.read(a, crate::layout::record::RecordLayout::header_words() * 8);
            }
            let mut res = b.run().await?;
            let params: Vec<_> = (0..chunk.len())
                .map(|i| {
                    crate::layout::record::decode_header(&res.take_read(i), self.cfg.slt_slots)
                        .map_err(corrupt)
                })
                .collect::<Result<_>>()?;
            let mut b = ep.batch();
            for (m, p) in chunk.iter().zip(&params) {
                let (word, words) = tables_span(p);
                let a = self
                    .remote
                    .record(*m, word)
                    .ok_or_else(|| corrupt("bad model reference"))?;
                b.read(a, words * 8);
            }
            let mut res = b.run().await?;
            for (i, (m, p)) in chunk.iter().zip(params).enumerate() {
                let t = decode_tables(&p, &res.take_read(i));
                self.caches.insert(ModelCache::new(*m, p, &t));
            }
        }
        Ok(())
    }

    /// Reads the root and, if it moved, the new directory image; then
    /// prefetches new models. Returns whether the directory changed.
    pub(crate) async fn refresh_dir(&self, ep: &Endpoint) -> Result<bool> {
        bump(&self.stats.dir_refreshes);
        let root = u64::from_le_bytes(
            ep.read(self.remote.meta_word(W_ROOT), 8)
                .await?
                .try_into()
                .expect("8"),
        );
        let (version, _) = decode_root(root);
        if version == self.caches.dir().version as u32 {
            return Ok(false);
        }
        let d = read_directory(ep, &self.remote).await?;
        let changed = self.caches.set_dir(d);
        self.prefetch(ep).await?;
        Ok(changed)
    }

    /// Re-reads a model's tables.
    pub(crate) async fn refresh_tables(&self, ep: &Endpoint, mc: &ModelCache) -> Result<()> {
        bump(&self.stats.table_refreshes);
        let t = crate::io::read_tables(ep, &self.remote, mc.m, &mc.p).await?;
        mc.install(&t);
        Ok(())
    }

    /// The model for `key`, fetching it if needed. With `fresh`, a model
    /// known to be retired is not returned: the directory is re-read until
    /// it no longer lists it (a swap or bulk load is being published).
    /// What [`Shared::model_for`] answers without a round trip: the cached
    /// model for `key` if it is in service (its first step, with no side
    /// effect). A GET tries this first and awaits `model_for`, boxed so that
    /// its large state is not part of every GET's future, only when it gives
    /// nothing.
    pub(crate) fn cached_model(&self, key: Key) -> Option<Arc<ModelCache>> {
        let d = self.caches.dir();
        let m = d.refs[d.model_for(key)];
        self.caches
            .model(m)
            .filter(|mc| !mc.retired.load(Ordering::Acquire))
    }

    pub(crate) async fn model_for(
        &self,
        ep: &Endpoint,
        key: Key,
        fresh: bool,
    ) -> Result<Arc<ModelCache>> {
        let mut waits = 0u32;
        loop {
            let d = self.caches.dir();
            let m = d.refs[d.model_for(key)];
            let mc = match self.caches.model(m) {
                Some(mc) => mc,
                None => {
                    let p = read_params(ep, &self.remote, m, self.cfg.slt_slots).await?;
                    let t = crate::io::read_tables(ep, &self.remote, m, &p).await?;
                    self.caches.insert(ModelCache::new(m, p, &t))
                }
            };
            if !mc.retired.load(Ordering::Acquire) {
                return Ok(mc);
            }
            if self.refresh_dir(ep).await? {
                continue;
            }
            if !fresh {
                // Its leaves still answer reads; the new directory is not
                // out yet.
                return Ok(mc);
            }
            if waits % 16 == 15 {
                // A retrain that failed puts the model back in service.
                let a = self
                    .remote
                    .record(m, crate::layout::record::W_STATE)
                    .ok_or_else(|| corrupt("bad model reference"))?;
                let st = u64::from_le_bytes(ep.read(a, 8).await?.try_into().expect("8"));
                if st != ModelState::Retired as u64 && st != ModelState::Freezing as u64 {
                    mc.retired.store(false, Ordering::Release);
                    return Ok(mc);
                }
            }
            waits += 1;
            sleep(Duration::from_micros((20 * waits as u64).min(1000))).await;
        }
    }

    async fn server_figures(&self, ep: &Endpoint) -> Result<Vec<(String, u64)>> {
        let mut w = WireWriter::new();
        w.u8(admin::STATS);
        let reply = ep.call(self.node0, self.admin, w.finish()).await?;
        let mut r = WireReader::new(&reply);
        let parse = |r: &mut WireReader<'_>| -> std::result::Result<Vec<(String, u64)>, dmkv_transport::WireError> {
            let n = r.count(12)?;
            (0..n).map(|_| Ok((r.str()?.to_string(), r.u64()?))).collect()
        };
        Ok(parse(&mut r).map_err(dmkv_transport::TransportError::from)?)
    }
}

/// Reads the current directory image (root, then the image it names).
async fn read_directory(ep: &Endpoint, r: &Remote) -> Result<Directory> {
    for _ in 0..crate::io::TORN_RETRIES {
        let root = u64::from_le_bytes(
            ep.read(r.meta_word(W_ROOT), 8)
                .await?
                .try_into()
                .expect("8"),
        );
        let (version, len) = decode_root(root);
        if len == 0 || len as usize > r.meta_layout.dir_slot_words {
            return Err(corrupt(format!(
                "directory root names an image of {len} words"
            )));
        }
        let at = r.meta_layout.dir_slot(version as u64);
        let img = ep.read(r.meta_word(at), len as usize * 8).await?;
        if let Some(d) = Directory::decode(&img, version).map_err(corrupt)? {
            return Ok(d);
        }
        sleep(Duration::from_micros(10)).await;
    }
    Err(corrupt("directory image stayed torn"))
}

/// ROLEX connected from one compute process.
pub struct RolexEngine {
    sh: Arc<Shared>,
    compute: NodeId,
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 { 0.0 } else { a as f64 / b as f64 }
}

#[async_trait(?Send)]
impl Engine for RolexEngine {
    fn name(&self) -> &'static str {
        ENGINE
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        self.sh.refresh_dir(&ep).await?;
        Ok(Rc::new(RolexClient::new(ep, self.sh.clone())))
    }

    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let call = |w: WireWriter| ep.call(self.sh.node0, self.sh.admin, w.finish());
        let mut w = WireWriter::new();
        w.u8(admin::LOAD_BEGIN);
        let reply = call(w).await?;
        let id = WireReader::new(&reply)
            .u64()
            .map_err(dmkv_transport::TransportError::from)?;
        let mut i = 0;
        while i < pairs.len() {
            let mut w = WireWriter::new();
            let mut n = 0;
            let mut bytes = 0;
            let start = i;
            while i < pairs.len() && bytes < (4 << 20) && n < 1 << 20 {
                bytes += 12 + pairs[i].1.len();
                n += 1;
                i += 1;
            }
            w.u8(admin::LOAD_PART).u64(id).u32(n as u32);
            for (k, v) in &pairs[start..i] {
                if *k == u64::MAX {
                    return Err(KvError::ReservedKey {
                        key: *k,
                        engine: ENGINE,
                        why: CAPS.reserved_why,
                    });
                }
                if v.len() > MAX_VALUE_LEN {
                    return Err(KvError::ValueTooLarge {
                        len: v.len(),
                        max: MAX_VALUE_LEN,
                        engine: ENGINE,
                    });
                }
                w.u64(*k).bytes(v);
            }
            call(w).await?;
        }
        let mut w = WireWriter::new();
        w.u8(admin::LOAD_COMMIT).u64(id);
        call(w).await?;
        self.sh.refresh_dir(ep).await?;
        Ok(())
    }

    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let s = &self.sh.stats;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let server: serde_json::Map<String, serde_json::Value> = self
            .sh
            .server_figures(ep)
            .await?
            .into_iter()
            .map(|(k, v)| (k, v.into()))
            .collect();
        let fig = |k: &str| server.get(k).and_then(|v| v.as_u64()).unwrap_or(0);
        let mut leaves_allocated = 0;
        for r in &self.sh.remote.leaves {
            leaves_allocated +=
                u64::from_le_bytes(ep.read(r.at(H_ALLOC), 8).await?.try_into().expect("8"));
        }
        let kinds = ["get", "insert", "update", "upsert", "delete", "scan"];
        let mut per_op = serde_json::Map::new();
        for (i, k) in kinds.iter().enumerate() {
            let ops = l(&s.ops[i]);
            if ops > 0 {
                per_op.insert(
                    k.to_string(),
                    serde_json::json!({"ops": ops, "leaves_read_per_op": ratio(l(&s.leaves_read[i]), ops)}),
                );
            }
        }
        let trained_keys = fig("load_keys") + fig("retrain_keys");
        let train_ns = fig("load_train_ns") + fig("retrain_train_ns");
        Ok(serde_json::json!({
            "models": fig("models"),
            "leaves_allocated": leaves_allocated,
            "leaves_reused": fig("leaves_reused"),
            "trained_leaves": fig("trained_leaves"),
            "synonym_leaves": fig("synonym_leaves"),
            "leaves_read": per_op,
            "lock_retries": l(&s.lock_retries),
            "lock_handovers": l(&s.lock_handovers),
            "torn_leaf_reads": l(&s.torn_leaves),
            "coverage_misses": l(&s.coverage_misses),
            "table_refreshes": l(&s.table_refreshes),
            "directory_refreshes": l(&s.dir_refreshes),
            "retired_models_noticed": l(&s.retired_noticed),
            "retired_entries_cached": l(&s.retired_cached),
            "slot_use_changes_noticed": l(&s.slot_use_changes_noticed),
            "splits": l(&s.splits),
            "synonym_unlinks": l(&s.unlinks),
            "slt_full_waits": l(&s.slt_full_waits),
            "retrain_enqueued": l(&s.enqueued),
            "retrain_urgent_enqueued": l(&s.urgent_enqueued),
            "answered_without_lock": l(&s.answered_without_lock),
            "retrains": fig("retrains"),
            "retrain_ms_avg": ratio(fig("retrain_wall_ns"), fig("retrains") * 1_000_000),
            "retrain_wall_ms": fig("retrain_wall_ns") as f64 / 1e6,
            "retrain_memnode_cpu_ms": fig("retrain_cpu_ns") as f64 / 1e6,
            "training_ns_per_key": ratio(train_ns, trained_keys),
            "memnode": server,
        }))
    }

    fn client_cache_bytes(&self) -> u64 {
        self.sh.caches.bytes()
    }

    async fn settle(&self, ep: &Endpoint) -> Result<()> {
        loop {
            let w = words_of(&ep.read(self.sh.remote.meta_word(W_QTAIL), 5 * 8).await?);
            let at = |word: usize| w[word - W_QTAIL];
            let pending = at(W_QTAIL).saturating_sub(at(W_QHEAD))
                + at(W_UTAIL).saturating_sub(at(W_UHEAD))
                + at(W_INFLIGHT);
            if pending == 0 {
                self.sh.refresh_dir(ep).await?;
                return Ok(());
            }
            sleep(Duration::from_millis(1)).await;
        }
    }
}
