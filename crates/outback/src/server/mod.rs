//! Outback's memory-node side: one [`NodeServer`] per memory node serves
//! the node's own shard (and shards it has taken over) and holds mirrors of
//! the KV data of the shards it replicates.
//!
//! - [`ctx`]: what every part shares (settings, regions, worker, endpoint);
//! - [`heap`]: KV blocks and their allocator; [`replica`]: forwarding to
//!   mirrors;
//! - [`table`]: a DMPH table (buckets, seeds, overflow cache, buffer);
//! - [`shard`]: the data operations;
//! - [`rebuild`]: splits and full builds (resizing, bulk loads);
//! - [`recover`]: taking over the shard of a failed node from a mirror;
//! - [`retire`]: withdrawing retired tables after the countdown, off the worker;
//! - [`session`]: at-most-once writes across a takeover (mirrored session table).

pub mod ctx;
pub mod heap;
pub mod rebuild;
pub mod recover;
pub mod replica;
pub(crate) mod retire;
pub mod seqlock;
pub mod session;
pub mod shard;
pub mod table;

#[cfg(test)]
mod tests;

use crate::config::Config;
use crate::layout::{HeapLayout, block_words, ctl};
use crate::proto::{self, DataReq, ReplyHead, Status, op};
use crate::publish::ctl_name;
use crate::ring::{mirrored_by, replicas_of};
use crate::server::ctx::NodeCtx;
use crate::server::heap::Heap;
use crate::server::shard::{Directory, ShardServer, status_reply};
use crate::server::table::WriteOp;
use dmkv_api::{KvError, ServeArgs};
use dmkv_memnode::{NodeRuntime, Region, WorkerPool};
use dmkv_transport::Service;
use dmkv_transport::exec::block_on;
use dmkv_transport::{NodeId, RpcContext, ServiceError, TransportError, WireReader, WireWriter};
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

/// The name of every node's RPC service.
pub const SERVICE: &str = "op";

/// Name of the mirror of shard `p`'s heap, generation `g` (a takeover
/// fences a mirror by re-registering it under the next generation).
pub fn mirror_name(p: u16, g: u32) -> String {
    format!("s{p}/m{g}/mirror")
}
fn mirror_prefix(p: u16, g: u32) -> String {
    format!("s{p}/m{g}/")
}

/// A mirror this node holds.
pub(crate) struct MirrorImage {
    pub region: Region,
    pub generation: u32,
}

const INIT_NONE: u8 = 0;
const INIT_RUNNING: u8 = 1;
const INIT_READY: u8 = 2;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Takeover {
    Running,
    Refused,
}

pub struct NodeServer {
    pub(crate) ctx: Arc<NodeCtx>,
    /// Kept here so the worker lives as long as the service.
    _pool: Arc<WorkerPool>,
    /// This node's own shard.
    pub(crate) own: u16,
    pub(crate) layout: HeapLayout,
    /// The shards this node serves, one write-once slot per shard
    /// (invariant 19 of docs/outback.md): filled at start (its own) or by
    /// a takeover, never emptied or replaced, so a request finds its shard
    /// with one acquire load and no lock or reference count.
    pub(crate) shards: Box<[OnceLock<Arc<ShardServer>>]>,
    pub(crate) mirrors: Mutex<Vec<Option<MirrorImage>>>,
    pub(crate) takeovers: Mutex<HashMap<u16, Takeover>>,
    init: AtomicU8,
}

/// The heap geometry every node derives alike from the serve arguments.
pub fn heap_layout(args: &ServeArgs, cfg: &Config) -> HeapLayout {
    let bytes = if cfg.heap_mb > 0 {
        cfg.heap_mb << 20
    } else {
        let per_shard = args.expected_keys / args.nodes.len().max(1) as u64 + 1;
        let block = block_words(args.value_size as usize) * 8;
        // Room for the keys three times over (updates recycle blocks of the
        // same size; inserts and loads add), and never below 16 MiB.
        (per_shard * block * 3).max(16 << 20)
    };
    HeapLayout::for_data(bytes, cfg.sessions)
}

/// Installs Outback on one memory node.
pub fn serve(rt: &Arc<NodeRuntime>, args: &ServeArgs) -> dmkv_api::Result<()> {
    serve_node(rt, args).map(|_| ())
}

/// [`serve`], returning the node's server (tests look inside it).
pub fn serve_node(rt: &Arc<NodeRuntime>, args: &ServeArgs) -> dmkv_api::Result<Arc<NodeServer>> {
    let cfg = Config::from_knobs(&args.knobs)?;
    let shards = args.nodes.len();
    if shards == 0 || shards > u16::MAX as usize {
        return Err(KvError::Config(
            "outback needs 1..65535 memory nodes".into(),
        ));
    }
    let own = args.node_index as u16;
    let pool = rt.worker_pool("outback", 1);
    let ctx = Arc::new(NodeCtx::new(
        rt.id(),
        args.node_ids(),
        args.clone(),
        cfg.clone(),
        Arc::downgrade(rt),
        Arc::downgrade(&pool),
    ));
    let cerr = |e: ServiceError| KvError::Config(e.to_string());
    let layout = heap_layout(args, &cfg);
    let heap = Heap::create(
        ctx.region(&format!("s{own}/heap"), layout.region_len())
            .map_err(cerr)?,
        layout,
    );
    let sessions = session::Sessions::new(layout);
    let shard = new_shard(&ctx, own, heap, 0, sessions).map_err(cerr)?;
    let table = rebuild::empty_table(&ctx, own, 0, &cfg).map_err(cerr)?;
    shard.install(table);
    *shard.dir.lock() = Directory {
        global_depth: 0,
        entries: vec![0],
    };
    shard.next_table.store(1, Ordering::Release);
    shard.publish().map_err(cerr)?;
    let mut mirrors: Vec<Option<MirrorImage>> = (0..shards).map(|_| None).collect();
    for p in mirrored_by(own, shards as u16, cfg.replicas) {
        let region = ctx
            .region(&mirror_name(p, 0), layout.region_len())
            .map_err(cerr)?;
        write_heap_header(&region, &layout);
        account_mirror(&region, &layout);
        mirrors[p as usize] = Some(MirrorImage {
            region,
            generation: 0,
        });
    }
    let no_mirrors = replicas_of(own, shards as u16, cfg.replicas).is_empty();
    if no_mirrors {
        shard.ready.store(true, Ordering::Release);
    }
    let all: Box<[OnceLock<Arc<ShardServer>>]> = (0..shards).map(|_| OnceLock::new()).collect();
    if all[own as usize].set(shard).is_err() {
        unreachable!("a fresh slot is empty");
    }
    let server = Arc::new(NodeServer {
        ctx: ctx.clone(),
        _pool: pool,
        own,
        layout,
        shards: all,
        mirrors: Mutex::new(mirrors),
        takeovers: Mutex::new(HashMap::new()),
        init: AtomicU8::new(if no_mirrors { INIT_READY } else { INIT_NONE }),
    });
    let handler = server.clone();
    rt.register_service(&args.name(SERVICE), Arc::new(Op(handler)))
        .map_err(cerr)?;
    Ok(server)
}

/// Work the handlers declare to `sim`'s instruction term
/// ([`dmkv_transport::sim::work`], a no-op elsewhere; docs/simulation.md,
/// "An instruction term for memory-node jobs (branch i49)"): instructions
/// counted with callgrind on the `local` transport, main's binary a1dce1e,
/// `DMKV=... KEEP=... scripts/instructions-per-op.sh outback [ycsb-a]`
/// (50,000 keys, 1 thread x 8 tasks, differenced over 50,000 operations),
/// the handler thread's call tree below `ServiceTable::run`.
pub(crate) mod cost {
    /// A GET (O(1): decode, the shard's slot, the table list's read lock,
    /// the bucket's slot and the block, the reply): `Op::handle_into`
    /// inclusive, 319.7 per GET on ycsb-c.
    pub const GET: u64 = 320;
    /// A write (decode, the shard's write: slot, seqlock, block, log):
    /// measured for UPDATE on ycsb-a, `Op::handle_into` 2,110.9 per
    /// operation, less the GETs' half (146.0 in `get_into` and 17 of the
    /// entry's own 34), over the 0.5 updates per operation: 3,896.
    pub const WRITE: u64 = 3_896;
    /// An insert and a delete, measured apart (branch i55):
    /// `DMKV=/tmp/keep/dmkv-head14 KINDS="update insert delete"
    /// scripts/instructions-per-kind.sh outback` (main's binary 751ec1c),
    /// `Op::handle_into` inclusive, differenced: 5,558.2 per insert (new
    /// keys: the bucket's seed search, overflow inserts), 2,908.3 per
    /// delete, 3,933.8 per update (1% above `WRITE`).
    pub const INSERT: u64 = 5_558;
    pub const DELETE: u64 = 2_908;
}

/// The node's RPC service: [`NodeServer::handle_into`], so a GET's reply is
/// built in the handler thread's reply buffer.
struct Op(Arc<NodeServer>);

impl Service for Op {
    fn handle(&self, _: &RpcContext, req: &[u8]) -> Result<Vec<u8>, ServiceError> {
        self.0.handle(req)
    }

    #[inline]
    fn handle_into(
        &self,
        _: &RpcContext,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), ServiceError> {
        self.0.handle_into(req, out)
    }
}

/// The reply to a data request for shard `p`, which this node does not
/// serve: NOT_OWNER if `p` exists (`known`), else an error.
#[cold]
fn no_shard(p: u16, known: bool, shards: usize) -> Result<Vec<u8>, ServiceError> {
    if known {
        Ok(status_reply(Status::NotOwner))
    } else {
        Err(ServiceError::malformed(format!(
            "outback: shard {p} out of range ({shards} shards)"
        )))
    }
}

/// Sets a mirror's accounted use (the node's `memory_used`) to the part of
/// it that holds blocks: the primary writes it one-sided, so only a look at
/// its start bitmap tells how far it goes. The allocator made here hands
/// out nothing; making it is how a region's use is declared.
pub(crate) fn account_mirror(region: &Region, layout: &HeapLayout) {
    let end = layout.data_start + layout.data_len;
    let used = recover::extent(layout, region);
    let _ = dmkv_memnode::BumpAllocator::new("outback mirror", region, used, end);
}

pub(crate) fn write_heap_header(region: &Region, layout: &HeapLayout) {
    for (i, w) in layout.header().iter().enumerate() {
        region
            .mem
            .store_u64(i as u64 * 8, *w)
            .expect("the heap header fits its region");
    }
}

/// A shard server over `heap` with its control region.
pub(crate) fn new_shard(
    ctx: &Arc<NodeCtx>,
    p: u16,
    heap: Heap,
    first_seq: u64,
    sessions: session::Sessions,
) -> Result<Arc<ShardServer>, ServiceError> {
    let ctl_region = ctx.region(&ctl_name(p), ctl::HEADER_BYTES + ctx.cfg.ctl_body_max())?;
    Ok(Arc::new(ShardServer::new(
        p,
        ctx.clone(),
        heap,
        ctl_region,
        first_seq,
        0,
        sessions,
    )))
}

impl NodeServer {
    /// The shard `p` if this node serves it.
    pub fn shard(&self, p: u16) -> Result<Option<Arc<ShardServer>>, ServiceError> {
        match self.shards.get(p as usize) {
            Some(s) => Ok(s.get().cloned()),
            None => Err(ServiceError::malformed(format!(
                "outback: shard {p} out of range ({} shards)",
                self.shards.len()
            ))),
        }
    }

    /// Serves shard `p` from now on (a takeover's end): fills its empty
    /// slot (invariant 19). The caller is the one takeover job of `p`,
    /// which runs only while the slot is empty (`recover::takeover`).
    pub(crate) fn install_shard(&self, p: u16, shard: Arc<ShardServer>) {
        if self.shards[p as usize].set(shard).is_err() {
            panic!("outback: shard {p} installed twice (invariant 19)");
        }
    }

    /// [`NodeServer::handle`] into the handler thread's reply buffer `out`:
    /// a well-formed GET builds its reply there (no allocation); anything
    /// else replaces `out` with its reply.
    #[inline]
    pub fn handle_into(
        self: &Arc<Self>,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), ServiceError> {
        if let Some((t, slot)) = proto::decode_get(req) {
            dmkv_transport::sim::work(cost::GET);
            return self.get_into(&t, slot, out);
        }
        *out = self.handle_other(req)?;
        Ok(())
    }

    /// Every request: decode, dispatch, never trust a field.
    pub fn handle(self: &Arc<Self>, req: &[u8]) -> Result<Vec<u8>, ServiceError> {
        // A well-formed GET, decoded in one step; anything else (a malformed
        // GET included) goes through the general decoder.
        if let Some((t, slot)) = proto::decode_get(req) {
            dmkv_transport::sim::work(cost::GET);
            return self.get(&t, slot);
        }
        self.handle_other(req)
    }

    /// Every request but a well-formed GET (writes too: not cold).
    fn handle_other(self: &Arc<Self>, req: &[u8]) -> Result<Vec<u8>, ServiceError> {
        let mut r = WireReader::new(req);
        let opcode = r.u8()?;
        match opcode {
            op::GET..=op::DELETE => self.data(DataReq::decode(opcode, &mut r)?),
            _ => self.control(opcode, r),
        }
    }

    /// A GET (decoded by the fast path or the general decoder): straight to
    /// its shard, without a [`DataReq`].
    fn get(&self, t: &proto::Target, slot: u8) -> Result<Vec<u8>, ServiceError> {
        let mut out = Vec::with_capacity(64);
        self.get_into(t, slot, &mut out)?;
        Ok(out)
    }

    /// [`NodeServer::get`] into `out`: the shard's write-once slot read
    /// with one acquire load (invariant 19: no lock, no reference count).
    #[inline]
    fn get_into(&self, t: &proto::Target, slot: u8, out: &mut Vec<u8>) -> Result<(), ServiceError> {
        match self.shards.get(t.shard as usize).map(OnceLock::get) {
            Some(Some(s)) => s.get_into(t, slot, out),
            other => {
                *out = no_shard(t.shard, other.is_some(), self.shards.len())?;
                Ok(())
            }
        }
    }

    /// A data request, decoded.
    fn data(&self, d: DataReq<'_>) -> Result<Vec<u8>, ServiceError> {
        let t = *d.target();
        // Invariant 19: a filled slot stays filled; no lock, no reference
        // count.
        let shard = match self.shards.get(t.shard as usize).map(OnceLock::get) {
            Some(Some(s)) => s,
            other => return no_shard(t.shard, other.is_some(), self.shards.len()),
        };
        // Declared work (`cost`): each write kind as measured apart; the
        // rest as a GET.
        dmkv_transport::sim::work(match d {
            DataReq::Update { .. } => cost::WRITE,
            DataReq::Insert { .. } => cost::INSERT,
            DataReq::Delete { .. } => cost::DELETE,
            DataReq::Get { .. } | DataReq::MakeupGet { .. } => cost::GET,
        });
        match d {
            DataReq::Get { t, slot } => shard.get(&t, slot),
            DataReq::MakeupGet { t, key } => shard.makeup_get(&t, key),
            DataReq::Insert {
                t,
                key,
                s,
                value,
                upsert,
            } => shard.write(
                &t,
                WriteOp::Insert {
                    key,
                    value: value.to_vec(),
                    upsert,
                },
                None,
                s,
            ),
            DataReq::Update {
                t,
                slot,
                key,
                s,
                value,
            } => shard.write(
                &t,
                WriteOp::Update {
                    key,
                    value: value.to_vec(),
                },
                Some(slot),
                s,
            ),
            DataReq::Delete { t, slot, key, s } => {
                shard.write(&t, WriteOp::Delete { key }, Some(slot), s)
            }
        }
    }

    /// A control request (not a data request): `r` is past its op byte.
    fn control(
        self: &Arc<Self>,
        opcode: u8,
        mut r: WireReader<'_>,
    ) -> Result<Vec<u8>, ServiceError> {
        match opcode {
            op::LOAD => {
                let p = r.u16()?;
                let n = r.count(12)?;
                let mut pairs = Vec::with_capacity(n);
                for _ in 0..n {
                    pairs.push((r.u64()?, r.bytes()?));
                }
                r.end()?;
                match self.shard(p)? {
                    Some(s) => {
                        s.load(&pairs)?;
                        Ok(status_reply(Status::Ok))
                    }
                    None => Ok(status_reply(Status::NotOwner)),
                }
            }
            op::BUILD => {
                let p = r.u16()?;
                r.end()?;
                match self.shard(p)? {
                    Some(s) => {
                        let mut w = WireWriter::new();
                        ReplyHead::new(Status::Ok).write(&mut w);
                        w.u64(s.request_build());
                        Ok(w.finish())
                    }
                    None => Ok(status_reply(Status::NotOwner)),
                }
            }
            op::REGISTER => {
                let p = r.u16()?;
                r.end()?;
                match self.shard(p)? {
                    Some(s) => {
                        let mut w = WireWriter::new();
                        ReplyHead::new(Status::Ok).write(&mut w);
                        w.u32(s.register()?);
                        Ok(w.finish())
                    }
                    None => Ok(status_reply(Status::NotOwner)),
                }
            }
            op::DEREGISTER => {
                let (p, id) = (r.u16()?, r.u32()?);
                r.end()?;
                if let Some(s) = self.shard(p)? {
                    s.deregister(id);
                }
                Ok(status_reply(Status::Ok))
            }
            op::INIT => {
                r.end()?;
                Ok(status_reply(self.init()))
            }
            op::TAKEOVER => {
                let p = r.u16()?;
                r.end()?;
                self.shard(p)?;
                Ok(status_reply(recover::takeover(self, p)))
            }
            op::FENCE => {
                let (p, by) = (r.u16()?, r.u16()?);
                r.end()?;
                self.shard(p)?;
                recover::fence(self, p, by)
            }
            op::STATS => {
                r.end()?;
                let served: Vec<Arc<ShardServer>> = self
                    .shards
                    .iter()
                    .filter_map(|s| s.get().cloned())
                    .collect();
                // A resize waiting only for its PRE_RESIZE timeout starts
                // here too, so a quiet store still settles.
                for s in &served {
                    if s.split_ready() {
                        s.kick();
                    }
                }
                let shards: Vec<serde_json::Value> =
                    served.iter().map(|s| s.stats_json()).collect();
                for m in self.mirrors.lock().iter().flatten() {
                    account_mirror(&m.region, &self.layout);
                }
                let mut w = WireWriter::new();
                ReplyHead::new(Status::Ok).write(&mut w);
                w.str(&serde_json::Value::Array(shards).to_string());
                Ok(w.finish())
            }
            other => Err(ServiceError::malformed(format!(
                "outback: unknown op {other}"
            ))),
        }
    }

    /// INIT: resolves the mirrors of this node's shard on the worker (it
    /// asks other nodes' directories, which a handler must not wait on).
    fn init(self: &Arc<Self>) -> Status {
        match self.init.load(Ordering::Acquire) {
            INIT_READY => return Status::Ok,
            INIT_RUNNING => return Status::Recovering,
            _ => {}
        }
        if self
            .init
            .compare_exchange(INIT_NONE, INIT_RUNNING, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Status::Recovering;
        }
        let me = self.clone();
        let submitted = self.ctx.submit(move || {
            let ok = me.resolve_mirrors();
            me.init
                .store(if ok { INIT_READY } else { INIT_NONE }, Ordering::Release);
        });
        if submitted.is_err() {
            self.init.store(INIT_NONE, Ordering::Release);
        }
        Status::Recovering
    }

    /// Finds the mirror regions of this node's shard; nodes that are down
    /// are left out. True when done.
    fn resolve_mirrors(&self) -> bool {
        let p = self.own;
        let Ok(Some(shard)) = self.shard(p) else {
            return false;
        };
        let mut found = Vec::new();
        for q in replicas_of(p, self.ctx.shards(), self.ctx.cfg.replicas) {
            let node = self.ctx.nodes[q as usize];
            let name = self.ctx.name(&mirror_name(p, 0));
            let mut tries = 0;
            loop {
                let r = self
                    .ctx
                    .with_endpoint(|ep| block_on(ep.lookup_region(node, &name)));
                match r {
                    Ok(Ok(region)) => {
                        found.push((node, region));
                        break;
                    }
                    Ok(Err(TransportError::NodeDown(_))) => break,
                    _ if tries < 100 => {
                        tries += 1;
                        dmkv_transport::time::sleep_blocking(Duration::from_millis(2));
                    }
                    _ => return false,
                }
            }
        }
        shard.replicas.set(found);
        shard.ready.store(true, Ordering::Release);
        true
    }

    pub(crate) fn node_of(&self, shard: u16) -> NodeId {
        self.ctx.nodes[shard as usize]
    }
}
