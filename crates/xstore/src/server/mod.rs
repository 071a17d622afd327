//! The memory node's side of XStore: one range partition's XTree, its
//! model region, the retraining workers, the durability log, and the RPC
//! service that performs writes and fallbacks.
//!
//! - Writes (INSERT, UPDATE with a position hint, UPSERT, DELETE) run on
//!   XTree by RPC (§5.3). A leaf split calls [`Server::on_split`], which
//!   queues a retraining of exactly the sub-models whose TT names the split
//!   leaf (§5.3.2) on the worker pool (`xstore.retrain_threads`).
//! - Retraining publishes the sub-model and its TT into the model region;
//!   clients fetch it on demand (one-sided, or in a fallback reply).
//! - Model expansion (§5.3.2): when keys per sub-model pass
//!   `xstore.keys_per_model`, a whole new generation with twice the
//!   sub-models is trained beside the committed one and committed by
//!   rewriting the header; after mass deletes the same path halves them.
//!   Requests keep being served from the old generation meanwhile.
//! - Bulk loads do not retrain incrementally: they mark the model stale,
//!   and the next PREPARE (a client starting) or other request schedules
//!   one full training (Fig. 6) over everything loaded.

mod models;
pub mod wal;

use crate::config::{SubModels, XStoreConfig};
use crate::layout::{LogOp, LogRecord, MAX_TT_LEN};
use crate::model::{
    Sizing, SizingGoal, TopKind, TrainedSub, interval_starts, size_submodels, train_submodel,
    train_top_kind,
};
use crate::wire::*;
use dmkv_api::{KvError, Result, ServeArgs};
use dmkv_memnode::{NodeRuntime, WorkerPool};
use dmkv_transport::time::Instant;
use dmkv_transport::{
    Answered, DeferredService, Later, NodeId, RegionMem, Responder, RpcContext, ServiceError,
    WireReader, WireWriter, thread_cpu_ns,
};
use dmkv_xtree::{Geometry, Header, LeafRef, MAX_HINT_LEAVES, MAX_VALUE_LEN, SplitEvent, XTree};
pub use models::{Generation, ModelStore, PublishError, Published};
use parking_lot::{Condvar, Mutex, RwLock};
use serde_json::json;
use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use wal::{Ticket, Wal};

/// Keys sampled for training the top model ("the top model can be trained
/// over sampled data", §5.1).
const TOP_SAMPLES: u64 = 1 << 17;
/// Leaves read per step when walking the whole partition.
const WALK_CHUNK: usize = 4096;
/// Stripes ordering writes to one key with their log versions.
const STRIPES: usize = 1024;

/// Key-value pairs of a scan.
type Pairs = Vec<(u64, Vec<u8>)>;

/// Why a full training runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FullReason {
    Initial,
    AfterLoad,
    Expansion,
    Shrink,
}

#[derive(Default)]
struct FullState {
    asked: u64,
    done: u64,
    target: Option<u32>,
    reason: Option<FullReason>,
    /// A full training was asked for and not yet taken up by the job.
    queued: bool,
    /// The one full-training job is running: a request made meanwhile is
    /// taken over by it (its loop), never a second job (docs/xstore.md, invariant 13).
    running: bool,
}

/// Figures for `engine_stats`.
#[derive(Default)]
struct Counters {
    retrains: AtomicU64,
    retrain_cpu_ns: AtomicU64,
    retrain_failures: AtomicU64,
    retrains_requeued: AtomicU64,
    retrains_superseded: AtomicU64,
    full_trainings: AtomicU64,
    full_training_cpu_ns: AtomicU64,
    last_full_training_us: AtomicU64,
    expansions: AtomicU64,
    shrinks: AtomicU64,
    splits_seen: AtomicU64,
    fallback_gets: AtomicU64,
    fallback_scans: AtomicU64,
    stale_kicks: AtomicU64,
    /// Full trainings asked for while one ran (taken over by the running
    /// job when it ends).
    full_asked_while_running: AtomicU64,
    /// Full trainings that halved a sized count the region could not hold.
    sizing_retreats: AtomicU64,
}

/// One partition on one memory node.
pub struct Server {
    cfg: XStoreConfig,
    part: usize,
    lo: u64,
    hi: u64,
    tree: Arc<XTree>,
    geo: Geometry,
    node_mem: Arc<RegionMem>,
    models: ModelStore,
    pool: Arc<WorkerPool>,
    /// This memory node (its handler cores take retraining's turns).
    node: NodeId,
    wal: Option<Wal>,
    /// Per key stripe, when logging: serializes a key's writes with their
    /// log versions, and remembers the ticket of the stripe's last record
    /// (a write that changes nothing is answered once that is durable).
    stripes: Vec<Mutex<Option<Ticket>>>,
    /// Loads (exclusive) against writes (shared), when logging.
    load_gate: RwLock<()>,
    /// Pairs were bulk-loaded since the last full training started.
    load_dirty: AtomicBool,
    full: Mutex<FullState>,
    full_done: Condvar,
    /// A full training is running (no resize checks meanwhile).
    full_active: AtomicBool,
    counters: Counters,
    /// The last sizing of a full training (with the keys it saw).
    sizing: Mutex<Option<(Sizing, u64)>>,
    /// Keys per sub-model that trigger expansion (and 1/8 of it, a
    /// shrink): `keys_per_model`, scaled down when sizing raised the count.
    kpm_effective: AtomicU64,
    /// What recovery read at start: (files, records, keys restored).
    recovered: [AtomicU64; 3],
    me: Weak<Server>,
}

fn config_err(e: impl std::fmt::Display) -> KvError {
    KvError::Config(e.to_string())
}

/// Installs XStore's server side on the node of `args.node_index`.
pub fn serve(rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<Arc<Server>> {
    let cfg = XStoreConfig::from_args(args)?;
    let part = args.node_index;
    if part >= cfg.parts.count() {
        return Err(config_err(format!(
            "node index {part} beyond {} partitions",
            cfg.parts.count()
        )));
    }
    let (lo, hi) = cfg.parts.range(part);
    let tree = XTree::create(
        rt,
        &args.name(NODE_REGION),
        &args.name(VALUE_REGION),
        cfg.tree,
    )
    .map_err(config_err)?;
    let node_mem = rt
        .region(&args.name(NODE_REGION))
        .ok_or_else(|| config_err("the node region vanished"))?
        .mem;
    let geo = tree.geometry();
    let models = ModelStore::create(
        rt,
        &args.name(MODEL_REGION),
        cfg.model_region_bytes(),
        geo.slots() as u32,
        lo,
        hi,
        cfg.tree.max_nodes as usize + 1,
    )
    .map_err(config_err)?;
    let pool = rt.worker_pool(&format!("xstore-p{part}"), cfg.retrain_threads);
    let keys_per_model = cfg.keys_per_model;
    let (wal, recovered) = if cfg.durability {
        // `<data_dir>/xstore/p<partition>`: not named after the instance
        // (unique per run over UCX), so that a memory node restarted on
        // its data directory recovers whichever run installs XStore next.
        let dir = args
            .data_dir
            .as_ref()
            .map(|d| d.join("xstore").join(format!("p{part}")));
        let (w, r) = Wal::open(dir, cfg.log_sync).map_err(KvError::Config)?;
        (Some(w), Some(r))
    } else {
        (None, None)
    };
    let server = Arc::new_cyclic(|me| Server {
        cfg,
        part,
        lo,
        hi,
        tree: tree.clone(),
        geo,
        node_mem,
        models,
        pool,
        node: rt.id(),
        wal,
        stripes: (0..STRIPES).map(|_| Mutex::new(None)).collect(),
        load_gate: RwLock::new(()),
        load_dirty: AtomicBool::new(false),
        full: Mutex::new(FullState::default()),
        full_done: Condvar::new(),
        full_active: AtomicBool::new(false),
        counters: Counters::default(),
        sizing: Mutex::new(None),
        kpm_effective: AtomicU64::new(keys_per_model),
        recovered: Default::default(),
        me: me.clone(),
    });
    if let Some(r) = recovered {
        // Replay: the latest version of every key, then a full training.
        if let Some((k, _)) = r.pairs.iter().find(|(k, _)| *k < lo || *k > hi) {
            return Err(config_err(format!(
                "the log in {} holds key {k:#x}, outside partition {part} [{lo:#x}, {hi:#x}]: \
                 it was written with other xstore.bounds or --memnodes",
                server.wal_dir().unwrap_or_default().display()
            )));
        }
        for (a, v) in server
            .recovered
            .iter()
            .zip([r.files, r.records, r.pairs.len() as u64])
        {
            a.store(v, Ordering::Relaxed);
        }
        for chunk in r.pairs.chunks(4096) {
            let refs: Vec<(u64, &[u8])> = chunk.iter().map(|(k, v)| (*k, &v[..])).collect();
            tree.bulk_load(&refs).map_err(config_err)?;
        }
    }
    server
        .full_train(None, FullReason::Initial)
        .map_err(|e| config_err(format!("initial training: {e:?}")))?;
    let weak = Arc::downgrade(&server);
    tree.set_split_hook(Some(Arc::new(move |ev: &SplitEvent| {
        if let Some(s) = weak.upgrade() {
            s.on_split(ev);
        }
    })));
    rt.register_deferred_service(&args.name(SERVICE), Arc::new(Served(server.clone())))
        .map_err(config_err)?;
    Ok(server)
}

/// The node's service: a request answered at once (every request without
/// durability, except PREPARE and SETTLE) is encoded straight into the
/// handler thread's reply buffer and sent from there
/// ([`DeferredService::handle_into`]: no responder, no shared state, no
/// boxed sink); one that waits for the log or for training takes its
/// responder and its reply with it.
struct Served(Arc<Server>);

impl DeferredService for Served {
    fn handle(&self, _: &RpcContext, req: &[u8], responder: Responder) {
        self.0.handle(req, responder)
    }

    fn handle_into(
        &self,
        _: &RpcContext,
        req: &[u8],
        out: &mut Vec<u8>,
        later: Later<'_>,
    ) -> Answered {
        // Room for a write's reply (one or two flags): the thread's buffer
        // keeps its capacity across requests, so this reserves nothing
        // after the first.
        let mut w = WireWriter::append_to(std::mem::take(out), 8);
        let served = self.0.serve_request(req, &mut w);
        *out = w.finish();
        match served {
            Ok(Answer::Now) => Answered::Now(Ok(())),
            Ok(answer) => {
                self.0
                    .answer_later(std::mem::take(out), answer, later.responder());
                Answered::Later
            }
            Err(e) => Answered::Now(Err(e)),
        }
    }
}

/// When a request's reply may leave.
enum Answer {
    Now,
    /// Once this log record is durable.
    AfterLog(Ticket),
    /// Once the committed model covers every loaded key (and, `settle`,
    /// the retraining workers are idle).
    AfterTraining {
        settle: bool,
    },
}

/// Declared instructions per request for the handler's own part
/// (`Server::serve_request`, the counts beside its use).
const HANDLER: u64 = 335;

/// Declared instructions per write for `Server::write`'s own part (the
/// counts beside its use).
const WRITE: u64 = 116;

/// Declared instructions per position-hint entry beyond the first (the
/// UPDATE arm of `serve_request` says how it was counted).
const HINT_ENTRY: u64 = 10;

/// One write operation.
enum Write<'a> {
    Insert(&'a [u8]),
    /// The value and the position hint's leaves (empty: no hint).
    Update(&'a [u8], &'a [LeafRef]),
    Upsert(&'a [u8]),
    Delete,
}

impl Server {
    pub fn tree(&self) -> &Arc<XTree> {
        &self.tree
    }

    pub fn models(&self) -> &ModelStore {
        &self.models
    }

    pub fn wal_dir(&self) -> Option<std::path::PathBuf> {
        self.wal.as_ref().map(|w| w.dir().to_path_buf())
    }

    /// The durability log, when `xstore.durability=on` (tests use its
    /// fault injection: [`Wal::hold`], [`Wal::crash`]).
    pub fn wal(&self) -> Option<&Wal> {
        self.wal.as_ref()
    }

    // ---- the service -----------------------------------------------------

    /// Serves one request (on an RPC handler thread). Nothing in it is
    /// trusted. A write that must be durable first is answered by the
    /// logger thread once its batch is synced (group commit); everything
    /// else is answered at once.
    pub fn handle(&self, req: &[u8], responder: Responder) {
        // Room for a write's reply (one or two flags) from the start: a
        // `Vec` grown from nothing pays `grow_one`'s reallocation path.
        let mut w = WireWriter::with_capacity(8);
        match self.serve_request(req, &mut w) {
            Ok(answer) => self.answer_later(w.finish(), answer, responder),
            Err(e) => responder.reply(Err(e)),
        }
    }

    /// Sends `reply` through `responder` when `answer` says it may leave.
    fn answer_later(&self, reply: Vec<u8>, answer: Answer, responder: Responder) {
        match answer {
            Answer::Now => responder.reply(Ok(reply)),
            Answer::AfterTraining { settle } => {
                // Training (and settling) may take seconds: wait on a
                // thread of its own, not on a handler thread.
                let Some(me) = self.me.upgrade() else {
                    return responder.reply(Err(ServiceError::failed("the server is going away")));
                };
                // A background activity of the runtime: a thread of its own
                // on real backends, a task in virtual time under `sim`.
                let _detached =
                    dmkv_transport::exec::spawn_background("xstore-prepare", async move {
                        me.prepare();
                        if settle {
                            me.pool.wait_idle();
                        }
                        responder.reply(Ok(reply));
                    });
            }
            Answer::AfterLog(ticket) => {
                let wal = self.wal.as_ref().expect("tickets come from the log");
                wal.when_durable(
                    &ticket,
                    Box::new(move |durable| {
                        responder.reply(
                            durable
                                .map(|()| reply)
                                .map_err(|e| ServiceError::failed(format!("log: {e}"))),
                        )
                    }),
                );
            }
        }
    }

    /// Performs one request, its reply appended to `w`: when the reply
    /// may be sent. (After an error, what `w` holds is not a reply.)
    fn serve_request(
        &self,
        req: &[u8],
        w: &mut WireWriter,
    ) -> std::result::Result<Answer, ServiceError> {
        // The handler's own part of a request (decoding, the reply, the
        // responder), declared to `sim`'s instruction term (the tree
        // declares its own work, `dmkv_xtree::tree::cost`): per update on
        // ycsb-a, `Server::handle` 2,301.1 less `Server::write` 1,718.0:
        // 583 (callgrind on `local`, main's binary fac3bce after the lean
        // xtree, `DMKV=/tmp/keep/dmkv-head15 scripts/instructions-per-op.sh
        // xstore ycsb-a`, 25,000 updates differenced; branch i58,
        // docs/simulation.md "Tree rows (branch i58)"). Was 572 (4,331 less
        // 3,759 on a1dce1e, before the lean xtree). Other requests are
        // priced alike (not measured apart). Branch i89: per update
        // `Served::handle_into` 1,367.1 less `Server::write` 1,022.2, 344.9
        // (callgrind on `local` with its binary, `DMKV=/tmp/i89/dmkv-lean2
        // KEEP=/tmp/i89/cg-lean2-a scripts/instructions-per-op.sh xstore
        // ycsb-a`, 24,916 updates differenced, inclusive call edges), of it
        // 1.03 hint entries beyond the first (`HINT_ENTRY` each): 335 for a
        // request with a one-entry hint or none. Main's head 57a2337 gives
        // 343.8 on that command (1,788.0 less 1,444.2): the handler's own
        // code had become leaner with the deferred service's
        // answer-at-once path (450608c), which kept the 583.
        dmkv_transport::sim::work(HANDLER);
        let mut r = WireReader::new(req);
        let op = r.u8()?;
        let mut ticket = None;
        let mut answer = Answer::Now;
        match op {
            OP_GET => {
                let key = r.u64()?;
                let generation = r.u32()?;
                let want = want(r.u8()?)?;
                r.end()?;
                self.check_key(key)?;
                self.counters.fallback_gets.fetch_add(1, Ordering::Relaxed);
                self.catch_up_after_load();
                let v = self.tree.get(key)?;
                w.bool(v.is_some());
                if let Some(v) = v {
                    w.bytes(&v);
                }
                self.model_update(generation, key, want).encode(w);
            }
            OP_SCAN => {
                let start = r.u64()?;
                let n = r.u32()?;
                let generation = r.u32()?;
                let want = want(r.u8()?)?;
                r.end()?;
                self.check_key(start)?;
                if n == 0 || n > MAX_SCAN {
                    return Err(ServiceError::malformed(format!(
                        "scan of {n} pairs (1..={MAX_SCAN})"
                    )));
                }
                self.counters.fallback_scans.fetch_add(1, Ordering::Relaxed);
                self.catch_up_after_load();
                let (pairs, complete) = self.scan(start, n as usize)?;
                w.u32(pairs.len() as u32);
                for (k, v) in &pairs {
                    w.u64(*k).bytes(v);
                }
                w.bool(complete);
                self.model_update(generation, start, want).encode(w);
            }
            OP_INSERT | OP_UPSERT => {
                let key = r.u64()?;
                let v = value(&mut r)?;
                r.end()?;
                let op = if op == OP_INSERT {
                    Write::Insert(v)
                } else {
                    Write::Upsert(v)
                };
                let (done, _, t) = self.write(key, op)?;
                ticket = t;
                w.bool(done);
            }
            OP_UPDATE => {
                let key = r.u64()?;
                let v = value(&mut r)?;
                // The position hint: `count u8 | (leaf u32 | incarnation
                // u32) * count`, at most MAX_HINT_LEAVES (wire.rs).
                let n = r.u8()? as usize;
                if n > MAX_HINT_LEAVES {
                    return Err(ServiceError::malformed(format!(
                        "a position hint of {n} leaves (at most {MAX_HINT_LEAVES})"
                    )));
                }
                let mut hint = [LeafRef {
                    node: 0,
                    incarnation: 0,
                }; MAX_HINT_LEAVES];
                for h in &mut hint[..n] {
                    *h = LeafRef {
                        node: r.u32()?,
                        incarnation: r.u32()?,
                    };
                }
                r.end()?;
                // Each hint entry beyond the first (its parse; the tree
                // declares its own checks): `Server::handle`'s own part per
                // update was 585.3 with main's one-entry hint and 696.0
                // with 2.01 entries per hint (branch i63, callgrind on
                // `local`: `DMKV=<binary> scripts/instructions-per-op.sh
                // xstore ycsb-a` with /tmp/keep/dmkv-head16 and with
                // 73c8f85, per update, `handle` less `write`): 110 per
                // further entry. A fit of two points, not a count of these
                // lines; the 583 above stayed the one-entry figure. Branch
                // i89 counted these lines (the loop over the entries,
                // `callgrind_annotate --auto=yes` on the two runs of
                // `KEEP=/tmp/i89/cg-lean1-a`, the same command with the
                // same handler code as `HANDLER`'s): 498,320 instructions
                // for 50,580 entries (2.03 per update), 9.9 per entry: 10.
                dmkv_transport::sim::work(HINT_ENTRY * n.saturating_sub(1) as u64);
                let (done, used, t) = self.write(key, Write::Update(v, &hint[..n]))?;
                ticket = t;
                w.bool(done).bool(used);
            }
            OP_DELETE => {
                let key = r.u64()?;
                r.end()?;
                let (done, _, t) = self.write(key, Write::Delete)?;
                ticket = t;
                w.bool(done);
            }
            OP_LOAD => {
                let n = r.count(12)?;
                let mut pairs = Vec::with_capacity(n);
                for _ in 0..n {
                    let k = r.u64()?;
                    self.check_key(k)?;
                    pairs.push((k, value(&mut r)?));
                }
                r.end()?;
                ticket = self.load(&pairs)?;
            }
            OP_PREPARE => {
                r.end()?;
                if self.load_dirty.load(Ordering::SeqCst) {
                    answer = Answer::AfterTraining { settle: false };
                }
            }
            OP_SETTLE => {
                r.end()?;
                answer = Answer::AfterTraining { settle: true };
            }
            OP_STATS => {
                r.end()?;
                w.raw(self.stats().to_string().as_bytes());
            }
            op => return Err(ServiceError::malformed(format!("unknown opcode {op}"))),
        }
        if let Some(t) = ticket {
            answer = Answer::AfterLog(t);
        }
        Ok(answer)
    }

    fn check_key(&self, key: u64) -> std::result::Result<(), ServiceError> {
        if key < self.lo || key > self.hi {
            return Err(ServiceError::malformed(format!(
                "key {key:#x} is outside partition {} [{:#x}, {:#x}]",
                self.part, self.lo, self.hi
            )));
        }
        Ok(())
    }

    /// What a fallback returns with its answer: the current sub-model for
    /// `key` (and the header, if the client's generation is not current).
    fn model_update(&self, client_generation: u32, key: u64, want: u8) -> ModelUpdate {
        let g = self.models.current();
        let i = g.header.route(key);
        let p = g.sub(i);
        self.kick_if_stale(&g, i, &p);
        let sub = (want != WANT_NOTHING).then(|| SubUpdate {
            record: p.record,
            entries: (want == WANT_RECORD_AND_TT).then(|| p.entries.clone()),
        });
        if g.generation() != client_generation {
            ModelUpdate::Generation(g.header, sub)
        } else {
            sub.map_or(ModelUpdate::None, ModelUpdate::Sub)
        }
    }

    /// Up to `n` pairs from `start`, stopping early (incomplete) when the
    /// reply would grow past [`MAX_REPLY_BYTES`].
    fn scan(&self, start: u64, n: usize) -> std::result::Result<(Pairs, bool), ServiceError> {
        let mut out = Vec::new();
        let mut bytes = 64;
        let mut cursor = start;
        loop {
            let want = (n - out.len()).min(256);
            let part = self.tree.scan(cursor, want)?;
            let got = part.len();
            for (k, v) in part {
                if bytes + 12 + v.len() > MAX_REPLY_BYTES {
                    return Ok((out, false));
                }
                bytes += 12 + v.len();
                cursor = k;
                out.push((k, v));
            }
            if out.len() == n || got < want || cursor == u64::MAX {
                return Ok((out, true));
            }
            cursor += 1;
        }
    }

    // ---- writes and durability --------------------------------------------

    /// Applies a write; with durability, appends its record to the worker's
    /// log. Returns (done, hint used, the record the reply must wait for):
    /// the write's own record, or, for a write that changed nothing, the
    /// last record of its key's stripe if that is not durable yet (the
    /// answer "exists" or "missing" may rest on it).
    fn write(
        &self,
        key: u64,
        op: Write<'_>,
    ) -> std::result::Result<(bool, bool, Option<Ticket>), ServiceError> {
        // `write`'s own part (the stripe, the log record, the checks, the
        // tree's `stats`): 1,718.0 per update less `update_hinted`'s 1,444.9
        // (the count above): 273. (Was 267: 3,759 less 3,492 on a1dce1e.)
        // Branch i89: 116, per update 1,022.2 less `update_hinted_leaves`
        // 906.2 (the run beside `HANDLER`), after the expansion check
        // stopped calling `XTree::stats` (its root word's load) and
        // cloning the committed generation's `Arc` (233.0 on main's head
        // 57a2337: 1,444.2 less 1,211.2).
        dmkv_transport::sim::work(WRITE);
        self.check_key(key)?;
        let logged = self.wal.as_ref();
        let (done, hint_used, ticket) = {
            let _gate = logged.map(|_| self.load_gate.read());
            let mut stripe = logged.map(|_| self.stripes[stripe(key)].lock());
            // (answer, hint used, whether the store changed)
            let (done, used, changed) = match op {
                Write::Insert(v) => {
                    let d = self.tree.insert(key, v)?;
                    (d, false, d)
                }
                Write::Upsert(v) => (self.tree.upsert(key, v)?, false, true),
                Write::Update(v, h) if self.cfg.hints && !h.is_empty() => {
                    let r = self.tree.update_hinted_leaves(key, v, h)?;
                    (r.updated, r.hint_used, r.updated)
                }
                Write::Update(v, _) => {
                    let d = self.tree.update(key, v)?;
                    (d, false, d)
                }
                Write::Delete => {
                    let d = self.tree.delete(key)?;
                    (d, false, d)
                }
            };
            let ticket = match (logged, stripe.as_deref_mut()) {
                (Some(wal), Some(last)) if changed => {
                    let record = LogRecord {
                        version: wal.next_version(),
                        key,
                        op: match op {
                            Write::Insert(v) | Write::Upsert(v) | Write::Update(v, _) => {
                                LogOp::Put(v.to_vec())
                            }
                            Write::Delete => LogOp::Delete,
                        },
                    };
                    let t = wal
                        .append(&[record], false)
                        .map_err(|e| ServiceError::failed(format!("log: {e}")))?;
                    last.clone_from(&t);
                    t
                }
                (Some(_), Some(last)) => last.clone().filter(|t| !t.is_durable()),
                _ => None,
            };
            (done, used, ticket)
        };
        self.catch_up_after_load();
        self.maybe_resize();
        Ok((done, hint_used, ticket))
    }

    /// Bulk-loads `pairs`; with durability, logs them as one run of records
    /// and returns the ticket of the last.
    fn load(&self, pairs: &[(u64, &[u8])]) -> std::result::Result<Option<Ticket>, ServiceError> {
        // Before the tree changes, so that its splits queue no retraining.
        self.load_dirty.store(true, Ordering::SeqCst);
        let Some(wal) = &self.wal else {
            self.tree.bulk_load(pairs)?;
            return Ok(None);
        };
        // No write runs meanwhile (they hold the gate shared), so the
        // stripes are free and versions follow the load's order.
        let _excl = self.load_gate.write();
        self.tree.bulk_load(pairs)?;
        let mut sorted: Vec<&(u64, &[u8])> = pairs.iter().collect();
        // Duplicates within a load: the last one wins, as in bulk_load's
        // upserts of sorted pairs.
        sorted.sort_by_key(|p| p.0);
        let records: Vec<LogRecord> = sorted
            .iter()
            .map(|(k, v)| LogRecord {
                version: wal.next_version(),
                key: *k,
                op: LogOp::Put(v.to_vec()),
            })
            .collect();
        let ticket = wal
            .append(&records, true)
            .map_err(|e| ServiceError::failed(format!("log: {e}")))?;
        for (k, _) in pairs {
            self.stripes[stripe(*k)].lock().clone_from(&ticket);
        }
        Ok(ticket)
    }

    // ---- retraining --------------------------------------------------------

    /// The split hook: queue the sub-models whose TT names the split leaf.
    fn on_split(&self, ev: &SplitEvent) {
        if ev.level != 0 {
            return;
        }
        self.counters.splits_seen.fetch_add(1, Ordering::Relaxed);
        if self.load_dirty.load(Ordering::SeqCst) {
            return;
        }
        let g = self.models.current();
        if let Some((a, b)) = g.subs_of_leaf(ev.left.node) {
            for i in a..=b.min(g.submodels() - 1) {
                self.schedule(&g, i);
            }
        }
    }

    fn schedule(&self, g: &Arc<Generation>, i: u32) {
        if g.queued[i as usize].swap(true, Ordering::AcqRel) {
            return;
        }
        let me = self.me.clone();
        let g = g.clone();
        self.pool.submit(move || {
            if let Some(s) = me.upgrade() {
                s.retrain(&g, i);
            }
        });
    }

    fn is_current(&self, g: &Arc<Generation>) -> bool {
        Arc::ptr_eq(&self.models.current(), g)
    }

    /// A progress point of a retraining job under `sim` (docs/xstore.md,
    /// "Retraining on the handler cores"): the CPU it was charged since
    /// its start or its last progress point passes in virtual time now,
    /// before what follows (a retrained sub-model's publication, a
    /// generation's commit). With `xstore.retrain_share_handlers` (ROLEX's
    /// XStore-D on one memory-node core) it passes on this memory node's
    /// handler cores in turns with the requests queued there; without, on
    /// the job's own worker core. Called with no lock held that a handler
    /// may take. Nothing off `sim`.
    fn pace_retrain(&self) {
        let share = self.cfg.retrain_share_handlers.then_some(self.node);
        dmkv_transport::sim::job_progress(share, self.cfg.retrain_slice_us * 1000);
    }

    /// Retrains sub-model `i` of `g` (a worker-pool job) in three steps
    /// (invariant 9): reads its leaves and trains, under the sub-model's
    /// lock; lets the job's CPU pass (no lock held); publishes, under the
    /// lock again, unless a later read of the same sub-model was published
    /// meanwhile. A split during the pace leaves the new model stale on
    /// the split leaf: it is published all the same (every leaf it names
    /// was read after the old model's, so it is no staler) and the
    /// sub-model is queued again, so the last split is always followed by
    /// a read after it.
    fn retrain(&self, g: &Arc<Generation>, i: u32) {
        if !self.is_current(g) {
            return;
        }
        g.queued[i as usize].store(false, Ordering::SeqCst);
        // The job's CPU, counted around the read and the publication but
        // not the pace (other cores' work is counted meanwhile).
        let cpu = thread_cpu_ns();
        let (read, trained) = {
            let mut order = g.locks[i as usize].lock();
            (order.next_read(), self.read_sub(g, i))
        };
        let mut spent = thread_cpu_ns().saturating_sub(cpu);
        self.pace_retrain();
        let cpu = thread_cpu_ns();
        let published = trained.and_then(|t| {
            let mut order = g.locks[i as usize].lock();
            if !order.claim(read) {
                return Err(PublishError::Superseded);
            }
            self.models.publish(g, i, t, true)
        });
        match published {
            Ok(()) => {
                self.counters.retrains.fetch_add(1, Ordering::Relaxed);
            }
            Err(PublishError::Superseded) => {
                self.counters
                    .retrains_superseded
                    .fetch_add(1, Ordering::Relaxed);
            }
            Err(_) => {
                self.counters
                    .retrain_failures
                    .fetch_add(1, Ordering::Relaxed);
            }
        }
        spent += thread_cpu_ns().saturating_sub(cpu);
        self.counters
            .retrain_cpu_ns
            .fetch_add(spent, Ordering::Relaxed);
        // The re-check: a split between our read of the leaves and the
        // publication (during the pace, most often) left an entry of the
        // new TT stale, and the split hook may not have found the leaf (a
        // leaf first named by this TT): look again.
        if self.is_current(g) && self.is_stale(&g.sub(i)) {
            self.counters
                .retrains_requeued
                .fetch_add(1, Ordering::Relaxed);
            self.schedule(g, i);
        }
    }

    /// Reads the leaves covering sub-model `i` of `g` and trains it
    /// (TRAIN_SUBMODEL); the TT names each leaf with the incarnation read.
    fn read_sub(&self, g: &Generation, i: u32) -> std::result::Result<TrainedSub, PublishError> {
        Ok(match g.interval(i) {
            None => TrainedSub {
                slope: 0.0,
                intercept: 0.0,
                base: g.first[i as usize].min(u64::MAX as u128) as u64,
                min_err: 0,
                max_err: 0,
                entries: Vec::new(),
                keys: 0,
                mean_abs_err: 0.0,
            },
            Some((a, b)) => {
                let leaves = self
                    .tree
                    .leaves_covering(a, b, MAX_TT_LEN as usize + 1)
                    .map_err(|e| PublishError::Full(e.to_string()))?;
                if leaves.len() > MAX_TT_LEN as usize {
                    return Err(PublishError::TooLarge(leaves.len()));
                }
                train_submodel(&leaves, a, b, self.geo.slots() as u32)
            }
        })
    }

    /// Whether any TT entry of `p` names a leaf whose incarnation changed.
    fn is_stale(&self, p: &Published) -> bool {
        let nb = self.geo.node_bytes() as u64;
        let hdr = self.geo.payload_offset(Geometry::HDR) as u64;
        p.entries.iter().any(|&e| {
            let e = crate::layout::TtEntry::unpack(e);
            match self.node_mem.load_u64(e.leaf as u64 * nb + hdr) {
                Ok(w) => Header::unpack(w).incarnation != e.incarnation,
                Err(_) => true,
            }
        })
    }

    /// A fallback on a stale sub-model that no job is retraining (a split
    /// raced a publication, or the hook was skipped during a load) queues
    /// one, so that fallbacks always lead to a fresh model.
    fn kick_if_stale(&self, g: &Arc<Generation>, i: u32, p: &Published) {
        if !self.load_dirty.load(Ordering::SeqCst)
            && !g.queued[i as usize].load(Ordering::Acquire)
            && self.is_stale(p)
        {
            self.counters.stale_kicks.fetch_add(1, Ordering::Relaxed);
            self.schedule(g, i);
        }
    }

    /// After a bulk load, the first other request schedules the full
    /// training.
    fn catch_up_after_load(&self) {
        if self.load_dirty.load(Ordering::SeqCst) {
            self.request_full(None, FullReason::AfterLoad, false);
        }
    }

    /// Waits until the committed model covers every loaded key.
    fn prepare(&self) {
        if self.load_dirty.load(Ordering::SeqCst) {
            self.request_full(None, FullReason::AfterLoad, true);
        }
    }

    /// Model expansion and shrinking (§5.3.2).
    fn maybe_resize(&self) {
        if !self.cfg.expansion
            || self.load_dirty.load(Ordering::SeqCst)
            || self.full_active.load(Ordering::SeqCst)
        {
            return;
        }
        let m = self.models.committed_submodels() as u64;
        let keys = self.tree.key_count();
        let kpm = self.kpm_effective.load(Ordering::Relaxed);
        if keys > m * kpm && m * 2 <= crate::layout::MAX_SUBMODELS as u64 {
            self.request_full(Some((m * 2) as u32), FullReason::Expansion, false);
        } else if m > self.cfg.min_submodels() as u64 && keys * 8 < m * kpm {
            let target = (m / 2).max(self.cfg.min_submodels() as u64) as u32;
            self.request_full(Some(target), FullReason::Shrink, false);
        }
    }

    fn request_full(&self, target: Option<u32>, reason: FullReason, wait: bool) {
        let mut st = self.full.lock();
        if !wait && st.queued {
            return;
        }
        st.asked += 1;
        let ticket = st.asked;
        if target.is_some() {
            st.target = target;
        }
        st.reason = Some(reason);
        st.queued = true;
        if self.full_active.load(Ordering::SeqCst) {
            self.counters
                .full_asked_while_running
                .fetch_add(1, Ordering::Relaxed);
        }
        // One job at a time: a running job takes this request over when
        // its current training ends (`full_job`'s loop), so nothing waits
        // on another job (under `sim` a second job blocking on the first
        // would stop the simulation's one OS thread).
        if !st.running {
            st.running = true;
            let me = self.me.clone();
            self.pool.submit(move || {
                if let Some(s) = me.upgrade() {
                    s.full_job();
                }
            });
        }
        if wait {
            while st.done < ticket {
                if dmkv_transport::sim::active() {
                    // One OS thread runs the simulated cluster: blocking
                    // here would stop the pool's job too. Waiting for the
                    // pool lets virtual time (and the training) run.
                    parking_lot::MutexGuard::unlocked(&mut st, || self.pool.wait_idle());
                } else {
                    self.full_done.wait(&mut st);
                }
            }
        }
    }

    /// The full-training job (a worker-pool job): runs every full training
    /// asked for until none is queued, then ends. At most one runs
    /// (`FullState::running`).
    fn full_job(&self) {
        loop {
            let (ticket, target, reason) = {
                let mut st = self.full.lock();
                if !st.queued {
                    st.running = false;
                    return;
                }
                st.queued = false;
                (st.asked, st.target.take(), st.reason.take())
            };
            self.load_dirty.store(false, Ordering::SeqCst);
            let reason = reason.unwrap_or(FullReason::AfterLoad);
            let m = self.models.current().submodels();
            // A resize asked for before the previous one committed may be moot.
            let moot = match (reason, target) {
                (FullReason::Expansion, Some(t)) => t <= m,
                (FullReason::Shrink, Some(t)) => t >= m,
                _ => false,
            };
            if !moot {
                self.full_active.store(true, Ordering::SeqCst);
                let _ = self.full_train(target, reason);
                self.full_active.store(false, Ordering::SeqCst);
            }
            let mut st = self.full.lock();
            st.done = st.done.max(ticket);
            self.full_done.notify_all();
        }
    }

    /// TRAIN_XMODEL (Fig. 6): a new generation with `target` sub-models
    /// (or as many as the keys call for), trained beside the committed one
    /// and then committed.
    fn full_train(
        &self,
        target: Option<u32>,
        reason: FullReason,
    ) -> std::result::Result<(), PublishError> {
        let wall = Instant::now();
        let pacer = Pacer::new(
            self,
            matches!(reason, FullReason::Expansion | FullReason::Shrink),
        );
        let estimate = self.tree.stats().keys;
        // The top model, over sampled keys in order.
        let stride = (estimate / TOP_SAMPLES).max(1);
        let mut samples = Vec::new();
        let mut rank = 0u64;
        let mut leaves = 0u64;
        let mut cursor = Some(self.lo);
        while let Some(c) = cursor {
            let chunk = self
                .tree
                .leaves_covering(c, self.hi, WALK_CHUNK)
                .map_err(|e| PublishError::Full(e.to_string()))?;
            leaves += chunk.len() as u64;
            for l in &chunk {
                for &k in &l.info.keys {
                    if rank.is_multiple_of(stride) {
                        samples.push((k, rank));
                    }
                    rank += 1;
                }
            }
            cursor = match chunk.last() {
                Some(l) if chunk.len() == WALK_CHUNK => l.upper,
                _ => None,
            };
            pacer.point();
        }
        let start = target
            .unwrap_or_else(|| self.cfg.submodels_for(rank))
            .max(self.cfg.min_submodels())
            .min(crate::layout::MAX_SUBMODELS);
        let mut m = start;
        let mut kind = TopKind::LeastSquares;
        if self.cfg.submodels == SubModels::Auto && rank > 0 {
            let goal = SizingGoal {
                slots: self.geo.slots() as u32,
                target_leaves: self.cfg.target_leaves,
                max_leaves: self.cfg.max_leaves,
                leaves,
                cache_budget: self.cfg.cache_budget_bytes,
                // Two generations live side by side during a full training.
                region_budget: self.models.region().len() / 2,
            };
            let sizing = size_submodels(&samples, rank, self.lo, self.hi, start, &goal, |a, b| {
                pacer.point();
                self.tree.leaves_covering(a, b, MAX_TT_LEN as usize + 1)
            })
            .map_err(|e| PublishError::Full(e.to_string()))?;
            m = sizing.chosen;
            kind = sizing.tried.last().map_or(kind, |c| c.top);
            *self.sizing.lock() = Some((sizing, rank));
        }
        loop {
            match self.train_generation(kind, m, &samples, rank, &pacer) {
                Ok(g) => {
                    // The generation is committed after its CPU passed.
                    pacer.finish();
                    self.finish_full(g, m, rank, wall, &pacer, reason);
                    return Ok(());
                }
                // A count raised by sizing that the region cannot hold
                // after all: halve it, not below where sizing started.
                Err(PublishError::Full(_)) if m / 2 >= start && m > start => {
                    self.counters
                        .sizing_retreats
                        .fetch_add(1, Ordering::Relaxed);
                    m /= 2;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Trains and publishes a whole generation of `m` sub-models (not yet
    /// committed).
    fn train_generation(
        &self,
        kind: TopKind,
        m: u32,
        samples: &[(u64, u64)],
        rank: u64,
        pacer: &Pacer<'_>,
    ) -> std::result::Result<Generation, PublishError> {
        let top = train_top_kind(kind, samples, rank, self.lo, self.hi, m);
        let first = interval_starts(&top, self.lo, self.hi, m);
        let generation = self.models.current().generation() + 1;
        let g = self.models.new_generation(generation, top, first, rank)?;
        for i in 0..m {
            let published = self
                .read_sub(&g, i)
                .and_then(|t| self.models.publish(&g, i, t, false));
            if let Err(e) = published {
                self.models.discard(g);
                return Err(e);
            }
            pacer.point();
        }
        Ok(g)
    }

    /// Commits a trained generation, sweeps it for splits that raced it and
    /// updates the figures.
    fn finish_full(
        &self,
        g: Generation,
        m: u32,
        keys: u64,
        wall: Instant,
        pacer: &Pacer<'_>,
        reason: FullReason,
    ) {
        let g = Arc::new(g);
        self.models.commit(g.clone());
        // Splits while the generation was built left stale entries that no
        // hook could queue: sweep.
        for i in 0..m {
            if self.is_stale(&g.sub(i)) {
                self.schedule(&g, i);
            }
        }
        let c = &self.counters;
        c.full_trainings.fetch_add(1, Ordering::Relaxed);
        c.full_training_cpu_ns
            .fetch_add(pacer.spent(), Ordering::Relaxed);
        c.last_full_training_us
            .store(wall.elapsed().as_micros() as u64, Ordering::Relaxed);
        match reason {
            FullReason::Expansion => {
                c.expansions.fetch_add(1, Ordering::Relaxed);
            }
            FullReason::Shrink => {
                c.shrinks.fetch_add(1, Ordering::Relaxed);
            }
            _ => {}
        }
        // Resizing thresholds: a count raised by sizing above the
        // keys-per-model count scales the threshold down by as much, so
        // that neither expansion nor shrinking undoes it at once.
        let auto = self.cfg.submodels_for(keys);
        let kpm = if self.cfg.submodels == SubModels::Auto && m > auto && keys > 0 {
            (2 * keys / m as u64).clamp(2, self.cfg.keys_per_model)
        } else {
            self.cfg.keys_per_model
        };
        self.kpm_effective.store(kpm, Ordering::Relaxed);
    }

    // ---- stats -------------------------------------------------------------

    /// What the last sized full training decided.
    fn sizing_json(&self) -> serde_json::Value {
        let c = &self.counters;
        match &*self.sizing.lock() {
            None => json!({
                "mode": match self.cfg.submodels {
                    SubModels::Auto => "auto",
                    SubModels::Fixed(_) => "fixed",
                },
            }),
            Some((s, keys)) => json!({
                "mode": "auto",
                "keys": keys,
                "start": s.start,
                "chosen": s.chosen,
                "limited_by": s.limit.name(),
                "top_model": s.tried.last().map_or("least_squares", |c| c.top.name()),
                "target_leaves": self.cfg.target_leaves,
                "max_leaves": self.cfg.max_leaves,
                "cache_budget_bytes": self.cfg.cache_budget_bytes,
                "retreats": c.sizing_retreats.load(Ordering::Relaxed),
                "tried": s.tried.iter().map(|t| json!({
                    "submodels": t.submodels,
                    "top_model": t.top.name(),
                    "mean_leaves": t.mean_leaves,
                    "wide_probes": t.wide,
                    "probes": t.probes,
                })).collect::<Vec<_>>(),
            }),
        }
    }

    /// This partition's figures for `engine_stats`.
    pub fn stats(&self) -> serde_json::Value {
        let g = self.models.current();
        let m = g.submodels();
        let (mut tt, mut keys, mut abs) = (0u64, 0u64, 0f64);
        let (mut min_lo, mut min_hi, mut min_sum) = (u32::MAX, 0u32, 0u64);
        let (mut max_lo, mut max_hi, mut max_sum) = (u32::MAX, 0u32, 0u64);
        let mut live = 0u64;
        let mut stale = 0u64;
        for i in 0..m {
            let p = g.sub(i);
            if p.record.tt_len == 0 {
                continue;
            }
            live += 1;
            tt += p.entries.len() as u64;
            keys += p.trained_keys;
            abs += p.mean_abs_err * p.trained_keys as f64;
            let (a, b) = (p.record.min_err, p.record.max_err);
            min_lo = min_lo.min(a);
            min_hi = min_hi.max(a);
            min_sum += a as u64;
            max_lo = max_lo.min(b);
            max_hi = max_hi.max(b);
            max_sum += b as u64;
            if self.is_stale(&p) {
                stale += 1;
            }
        }
        let avg = |s: u64| {
            if live == 0 {
                0.0
            } else {
                s as f64 / live as f64
            }
        };
        let c = &self.counters;
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let retrains = ld(&c.retrains);
        let t = self.tree.stats();
        let mut v = json!({
            "partition": self.part,
            "key_range": [self.lo, self.hi],
            "generation": g.generation(),
            "submodels": m,
            // What the write path's expansion check reads (`maybe_resize`):
            // the committed generation's count, kept beside it.
            "expansion_check_submodels": self.models.committed_submodels(),
            "submodels_reachable": live,
            "submodels_stale": stale,
            "keys": t.keys,
            "keys_per_submodel": if m == 0 { 0.0 } else { t.keys as f64 / m as f64 },
            "tt_entries": tt,
            "model_bytes": {
                "sub_model_records": m as u64 * crate::layout::RECORD_BYTES as u64,
                "tt_bytes": tt * 8,
                "top_model": 16,
                "region_in_use": self.models.bytes_in_use(),
            },
            "prediction_error": {
                "min_err_slots": {"min": if live == 0 { 0 } else { min_lo }, "max": min_hi, "avg": avg(min_sum)},
                "max_err_slots": {"min": if live == 0 { 0 } else { max_lo }, "max": max_hi, "avg": avg(max_sum)},
                "mean_abs_slots": if keys == 0 { 0.0 } else { abs / keys as f64 },
            },
            "retrains": retrains,
            "retrain_cpu_ns": ld(&c.retrain_cpu_ns),
            "retrain_us_avg": if retrains == 0 { 0.0 } else { ld(&c.retrain_cpu_ns) as f64 / retrains as f64 / 1000.0 },
            "retrain_failures": ld(&c.retrain_failures),
            "retrains_requeued": ld(&c.retrains_requeued),
            "retrains_superseded": ld(&c.retrains_superseded),
            "retrain_queue": self.pool.pending(),
            "full_trainings": ld(&c.full_trainings),
            "full_training_cpu_ns": ld(&c.full_training_cpu_ns),
            "last_full_training_us": ld(&c.last_full_training_us),
            "expansions": ld(&c.expansions),
            "shrinks": ld(&c.shrinks),
            "model_region_full_events": self.models.full_events.load(Ordering::Relaxed),
            "leaf_splits": t.leaf_splits,
            "splits_seen": ld(&c.splits_seen),
            "fallbacks_served": {"get": ld(&c.fallback_gets), "scan": ld(&c.fallback_scans)},
            "stale_kicks": ld(&c.stale_kicks),
            "full_asked_while_running": ld(&c.full_asked_while_running),
            "sizing": self.sizing_json(),
            "keys_per_model_effective": self.kpm_effective.load(Ordering::Relaxed),
            "tree": {
                "height": t.height, "leaves": t.leaves, "inner_nodes": t.inner_nodes,
                "fill_factor": t.fill_factor(),
                "hinted_updates": t.hinted_updates, "hinted_updates_used": t.hinted_updates_used,
                "hinted_leaves_tried": self.tree.hinted_leaves_tried(),
            },
        });
        if let Some(w) = &self.wal {
            let wc = &w.counters;
            let batches = ld(&wc.batches);
            let (writes, write_batches) = (ld(&wc.write_records), ld(&wc.write_batches));
            v["durability"] = json!({
                "dir": w.dir().display().to_string(),
                "log_sync": format!("{:?}", self.cfg.log_sync),
                "records": ld(&wc.records),
                "bytes": ld(&wc.bytes),
                "batches": batches,
                "syncs": ld(&wc.syncs),
                "write_records": writes,
                "write_batches": write_batches,
                "writes_per_batch": if write_batches == 0 { 0.0 } else { writes as f64 / write_batches as f64 },
                "max_batch_writes": ld(&wc.max_batch_writes),
                "io_us_per_batch": if batches == 0 { 0.0 } else { ld(&wc.io_ns) as f64 / batches as f64 / 1000.0 },
                "logger_cpu_ns": ld(&wc.logger_cpu_ns),
                "recovered": {
                    "files": ld(&self.recovered[0]),
                    "records": ld(&self.recovered[1]),
                    "keys": ld(&self.recovered[2]),
                },
            });
        }
        v
    }
}

fn stripe(key: u64) -> usize {
    (key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 54) as usize % STRIPES
}

fn want(b: u8) -> std::result::Result<u8, ServiceError> {
    if b > WANT_RECORD_AND_TT {
        return Err(ServiceError::malformed(format!("model request {b}")));
    }
    Ok(b)
}

fn value<'a>(r: &mut WireReader<'a>) -> std::result::Result<&'a [u8], ServiceError> {
    let v = r.bytes()?;
    if v.len() > MAX_VALUE_LEN {
        return Err(ServiceError::malformed(format!(
            "value of {} bytes exceeds {MAX_VALUE_LEN}",
            v.len()
        )));
    }
    Ok(v)
}

/// Progress points of a full training (invariant 9): at each, once the job
/// has been charged `retrain_slice_us` of CPU since the last, that CPU
/// passes (`Server::pace_retrain`: on the handler cores with
/// `retrain_share_handlers`, else on the job's worker core) before the job
/// goes on. Placed where the job holds no lock a handler or a retraining
/// takes: between chunks of the leaf walk, before each of sizing's leaf
/// reads, after each sub-model of the new generation. Only expansions and
/// shrinks pace: the initial and after-load trainings run before any
/// measured request, on the worker core, as before. It also counts the
/// job's own CPU, the pauses (other cores' work) left out.
///
/// A full training asked for while one paces is taken over by the
/// running job when it ends (`full_job`'s loop), never started beside it.
struct Pacer<'a> {
    server: &'a Server,
    on: bool,
    /// The CPU clock where the job's current stretch began.
    mark: Cell<u64>,
    /// The job's CPU in stretches before the current one.
    spent: Cell<u64>,
}

impl<'a> Pacer<'a> {
    fn new(server: &'a Server, on: bool) -> Pacer<'a> {
        Pacer {
            server,
            on,
            mark: Cell::new(thread_cpu_ns()),
            spent: Cell::new(0),
        }
    }

    /// A progress point: the stretch's CPU passes if it is a slice or more.
    fn point(&self) {
        let run = thread_cpu_ns().saturating_sub(self.mark.get());
        if self.on && run >= self.server.cfg.retrain_slice_us * 1000 {
            self.pass(run);
        }
    }

    /// The last progress point: whatever CPU is left passes.
    fn finish(&self) {
        let run = thread_cpu_ns().saturating_sub(self.mark.get());
        if self.on && run > 0 {
            self.pass(run);
        }
    }

    fn pass(&self, run: u64) {
        self.spent.set(self.spent.get() + run);
        self.server.pace_retrain();
        self.mark.set(thread_cpu_ns());
    }

    /// The job's CPU so far, pauses left out.
    fn spent(&self) -> u64 {
        self.spent.get() + thread_cpu_ns().saturating_sub(self.mark.get())
    }
}
