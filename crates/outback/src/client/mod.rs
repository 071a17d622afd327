//! Outback's compute-node side: the [`Engine`] a compute process connects
//! (it holds every shard's locator, shared by the process's threads) and
//! the per-thread [`KvStore`] client.
//!
//! A GET computes (table, bucket, slot) locally and sends them in one RPC;
//! the reply carries the KV block, the bucket's latest seed and the slot's
//! cache bit. The client checks the full key; on a mismatch with the cache
//! bit set, or when the seed it used is not the latest (a key may have
//! moved), it sends the MAKEUP GET. Writes go by RPC; replies bring new
//! seeds, STALE (fetch the new locator, one-sided, and retry), BUFFERED
//! (wait for the rebuild, polling the control region one-sided, then ask
//! for the outcome) or PRE_RESIZE (poll the control region for the coming
//! locator). A memory node that is down makes the client ask the shard's
//! mirrors, in order, to take over.

pub mod view;

use crate::config::Config;
use crate::layout::{BlockFront, TableLayout, ctl};
use crate::othello::Othello;
use crate::proto::{self, DataReq, REPLY_HEAD_LEN, ReplyHead, Status, Target, op};
use crate::publish::{
    TableDesc, ViewDesc, ctl_name, decode_locator, locator_len, locator_name, table_name,
};
use crate::ring::{Ring, replicas_of};
use crate::server::SERVICE;
use crate::server::session::Session;
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, Engine, Key, KvClient, KvError, KvStore, Result, ServeArgs, checksum64,
};
use dmkv_transport::exec::{block_on, sleep};
use dmkv_transport::time::Instant;
use dmkv_transport::{
    Endpoint, Fabric, NodeId, OpKind, RemoteRegion, ServiceId, TransportError, WireReader,
    WireWriter, labeled,
};
use parking_lot::{Mutex, RwLock};
use std::cell::{Cell, RefCell};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, Ordering};
use std::time::Duration;
use view::{ShardView, TableView};

pub const CAPS: Capabilities = Capabilities {
    scan: false,
    max_value_len: crate::layout::MAX_VALUE_LEN,
    reserved_keys: &[],
    reserved_why: "outback reserves no keys: an empty slot is marked by its length field",
};

/// How long one operation keeps retrying through rebuilds and failovers.
pub(crate) const OP_DEADLINE: Duration = Duration::from_secs(60);
/// Pairs per LOAD message, and bytes.
const LOAD_PAIRS: usize = 2048;

/// How often a client waiting for a full build (after a bulk load) looks
/// at the control region, or at the task that asked for the build.
///
/// On real backends 1 ms: the runtime spins through waits shorter than
/// 200 us (`exec`), so a shorter poll kept a core busy for the whole build
/// (seconds at millions of keys); 1 ms goes through the timer thread and
/// costs nothing meanwhile, and a build lasts far longer than that. Under
/// `sim` a wait costs the host nothing and the cadence is part of the
/// virtual run: it stays 200 us, so that every recorded seed replays as
/// before.
fn load_poll() -> Duration {
    if dmkv_transport::sim::active() {
        Duration::from_micros(200)
    } else {
        Duration::from_millis(1)
    }
}
const LOAD_BYTES: usize = 1 << 20;
/// Bytes per one-sided read when fetching locators and seeds.
const READ_CHUNK: usize = 4 << 20;

#[derive(Default)]
struct ClientCounters {
    gets: AtomicU64,
    makeup_gets: AtomicU64,
    stale_retries: AtomicU64,
    locator_fetches: AtomicU64,
    locator_bytes: AtomicU64,
    polls: AtomicU64,
    failovers: AtomicU64,
}

struct ShardSlot {
    owner: Mutex<NodeId>,
    view: RwLock<Option<Arc<ShardView>>>,
    /// Bumped on every install, so threads notice a new view cheaply.
    installs: AtomicU64,
    fetching: AtomicBool,
    /// PRE_RESIZE seen: poll the control region.
    watch: AtomicBool,
    last_poll_us: AtomicU64,
    /// The last publication this compute node counted down.
    counted: AtomicU64,
    /// This compute node's id at each node that served the shard.
    computes: Mutex<HashMap<NodeId, u32>>,
    /// Blocks were bulk-loaded and no build has been asked for yet.
    unbuilt: AtomicBool,
    /// A thread is asking for the build and waiting for it.
    building: AtomicBool,
}

/// State shared by a compute process's threads.
pub struct Shared {
    cfg: Config,
    args: ServeArgs,
    ring: Ring,
    nodes: Vec<NodeId>,
    compute_node: NodeId,
    fabric: Arc<dyn Fabric>,
    slots: Vec<ShardSlot>,
    services: Mutex<HashMap<NodeId, ServiceId>>,
    regions: Mutex<HashMap<(NodeId, String), RemoteRegion>>,
    dead: Mutex<HashSet<NodeId>>,
    /// Counted into by every compute process of a simulated cluster
    /// (`ConnectArgs::counters_from`).
    counters: Arc<ClientCounters>,
    started: Instant,
    /// This process's sessions: the high bits of every session id (random,
    /// top bit set, so never 0), the lane in the low [`LANE_BITS`].
    incarnation: u64,
    lanes: Mutex<Lanes>,
}

/// Bits of a session id that name the lane.
const LANE_BITS: u32 = 20;

/// Write lanes (docs/outback.md, invariant 16): a write operation holds one
/// for its whole life, re-sends included, and numbers itself with the
/// lane's next sequence number; so each session (lane) has one write in
/// flight at a time and its sequence numbers only grow.
#[derive(Default)]
struct Lanes {
    /// Idle lanes and the last sequence number each used (LIFO: a run
    /// reuses lanes in a fixed order).
    free: Vec<(u32, u64)>,
    next: u32,
}

/// A write lane held by one operation.
struct Lease<'a> {
    sh: &'a Shared,
    lane: u32,
    seq: u64,
}

impl Lease<'_> {
    fn session(&self) -> Session {
        Session {
            id: self.sh.incarnation | self.lane as u64,
            seq: self.seq,
        }
    }
}

impl Drop for Lease<'_> {
    fn drop(&mut self) {
        self.sh.lanes.lock().free.push((self.lane, self.seq));
    }
}

impl Shared {
    /// A write lane for one operation, with its next sequence number.
    fn lease(&self) -> Result<Lease<'_>> {
        let mut l = self.lanes.lock();
        let (lane, last) = match l.free.pop() {
            Some(idle) => idle,
            None if l.next < 1 << LANE_BITS => {
                l.next += 1;
                (l.next - 1, 0)
            }
            None => {
                return Err(KvError::Exhausted(format!(
                    "outback: more than {} writes in flight in one compute process",
                    1u32 << LANE_BITS
                )));
            }
        };
        Ok(Lease {
            sh: self,
            lane,
            seq: last + 1,
        })
    }
}

fn malformed(e: impl std::fmt::Display) -> KvError {
    KvError::Transport(TransportError::Malformed(e.to_string()))
}

fn node_down(e: &KvError) -> Option<NodeId> {
    match e {
        KvError::Transport(TransportError::NodeDown(n)) => Some(*n),
        _ => None,
    }
}

/// Parsed reply of a data request: its head, and the whole reply (the
/// body is read in place, never copied out).
struct Reply {
    head: ReplyHead,
    bytes: Vec<u8>,
}

impl Reply {
    fn parse(bytes: Vec<u8>) -> Result<Reply> {
        let head = ReplyHead::parse(&bytes).map_err(malformed)?;
        Ok(Reply { head, bytes })
    }

    /// What follows the head.
    fn rest(&self) -> &[u8] {
        &self.bytes[REPLY_HEAD_LEN..]
    }

    /// The value of the KV block a GET reply carries, in the reply's own
    /// buffer (moved to its front, no allocation), if the block is `key`'s.
    /// `Ok(None)`: an empty slot or another key's block.
    fn into_value_of(mut self, key: Key) -> Result<Option<Vec<u8>>> {
        let rest = self.rest();
        if rest.is_empty() {
            return Ok(None);
        }
        let f = BlockFront::parse(rest)
            .ok_or_else(|| KvError::Corrupt("malformed KV block in a GET reply".into()))?;
        if f.key != key {
            return Ok(None);
        }
        let at = REPLY_HEAD_LEN + BlockFront::VALUE_AT;
        let len = f.value.len();
        self.bytes.copy_within(at..at + len, 0);
        self.bytes.truncate(len);
        Ok(Some(self.bytes))
    }
}

/// An operation's deadline, started lazily: the clock is read the first
/// time the operation needs it (a retry, a wait, a slow path), so an
/// operation answered at the first try reads no clock. An operation thus
/// gives up [`OP_DEADLINE`] after its first retry or wait rather than after
/// its start (invariant 15 in docs/outback.md).
struct Deadline(Cell<Option<Instant>>);

impl Deadline {
    fn new() -> Deadline {
        Deadline(Cell::new(None))
    }

    /// The deadline, starting it now if it has not started.
    fn at(&self) -> Instant {
        match self.0.get() {
            Some(at) => at,
            None => {
                let at = Instant::now() + OP_DEADLINE;
                self.0.set(Some(at));
                at
            }
        }
    }

    /// Whether the deadline has passed (starting it if it has not started).
    fn passed(&self) -> bool {
        let at = self.at();
        Instant::now() > at
    }
}

impl Shared {
    fn now_us(&self) -> u64 {
        self.started.elapsed().as_micros() as u64
    }

    fn owner(&self, p: u16) -> NodeId {
        *self.slots[p as usize].owner.lock()
    }

    async fn service(&self, ep: &Endpoint, node: NodeId) -> Result<ServiceId> {
        if let Some(s) = self.services.lock().get(&node) {
            return Ok(*s);
        }
        let s = ep.lookup_service(node, &self.args.name(SERVICE)).await?;
        self.services.lock().insert(node, s);
        Ok(s)
    }

    async fn call(&self, ep: &Endpoint, node: NodeId, payload: Vec<u8>) -> Result<Vec<u8>> {
        let svc = self.service(ep, node).await?;
        Ok(ep.call(node, svc, payload).await?)
    }

    async fn region(&self, ep: &Endpoint, node: NodeId, name: &str) -> Result<RemoteRegion> {
        let key = (node, name.to_string());
        if let Some(r) = self.regions.lock().get(&key) {
            return Ok(*r);
        }
        let r = ep.lookup_region(node, &self.args.name(name)).await?;
        self.regions.lock().insert(key, r);
        Ok(r)
    }

    fn forget_regions(&self, node: NodeId) {
        self.regions.lock().retain(|(n, _), _| *n != node);
    }

    fn current(&self, p: u16) -> Option<Arc<ShardView>> {
        self.slots[p as usize].view.read().clone()
    }

    /// This compute node's id at `node` for shard `p` (registering once).
    async fn compute_id(&self, ep: &Endpoint, p: u16, node: NodeId) -> Result<u32> {
        if let Some(id) = self.slots[p as usize].computes.lock().get(&node) {
            return Ok(*id);
        }
        let mut w = WireWriter::new();
        w.u8(op::REGISTER).u16(p);
        let r = Reply::parse(self.call(ep, node, w.finish()).await?)?;
        if r.head.status != Status::Ok {
            return Err(KvError::Transport(TransportError::Backend(format!(
                "outback: node {node} does not serve shard {p} yet ({:?})",
                r.head.status
            ))));
        }
        let id = WireReader::new(r.rest()).u32().map_err(malformed)?;
        self.slots[p as usize].computes.lock().insert(node, id);
        Ok(id)
    }

    /// Reads `len` bytes of a region in chunks (one round trip each).
    async fn read_all(
        &self,
        ep: &Endpoint,
        r: RemoteRegion,
        at: u64,
        len: usize,
    ) -> Result<Vec<u8>> {
        let mut out = Vec::with_capacity(len);
        while out.len() < len {
            let n = (len - out.len()).min(READ_CHUNK);
            out.extend(ep.read(r.at(at + out.len() as u64), n).await?);
        }
        self.counters
            .locator_bytes
            .fetch_add(len as u64, Ordering::Relaxed);
        Ok(out)
    }

    /// Reads the control region's header: (version, body_len, body_check,
    /// applied, built).
    async fn ctl_header(&self, ep: &Endpoint, r: RemoteRegion) -> Result<[u64; 6]> {
        let b = ep.read(r.at(0), ctl::POLL_BYTES).await?;
        let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        Ok([w(0), w(1), w(2), w(3), w(4), w(5)])
    }

    /// Fetches shard `p`'s published view from its owner and installs it.
    /// Returns whether a newer view was installed. One fetch per shard runs
    /// at a time; others wait for it.
    async fn fetch(&self, ep: &Endpoint, p: u16) -> Result<bool> {
        let slot = &self.slots[p as usize];
        if slot
            .fetching
            .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            let before = slot.installs.load(Ordering::Acquire);
            while slot.fetching.load(Ordering::Acquire) {
                sleep(Duration::from_micros(20)).await;
            }
            return Ok(slot.installs.load(Ordering::Acquire) != before);
        }
        struct Release<'a>(&'a AtomicBool);
        impl Drop for Release<'_> {
            fn drop(&mut self) {
                self.0.store(false, Ordering::Release);
            }
        }
        let _release = Release(&slot.fetching);
        self.fetch_locked(ep, p).await
    }

    async fn fetch_locked(&self, ep: &Endpoint, p: u16) -> Result<bool> {
        let slot = &self.slots[p as usize];
        let owner = self.owner(p);
        let compute = self.compute_id(ep, p, owner).await?;
        let ctl_r = self.region(ep, owner, &ctl_name(p)).await?;
        let old = self.current(p).filter(|v| v.owner == owner);
        let desc = loop {
            let h = self.ctl_header(ep, ctl_r).await?;
            let (version, len, check) = (h[1], h[3] as usize, h[4]);
            if version == 0 {
                return Ok(false);
            }
            if old.as_ref().is_some_and(|v| v.version >= version) {
                return Ok(false);
            }
            let body = self.read_all(ep, ctl_r, ctl::BODY, len).await?;
            if checksum64(&body) != check {
                // Torn by a publication in progress: read again.
                sleep(Duration::from_micros(50)).await;
                continue;
            }
            break ViewDesc::decode(&body).map_err(malformed)?;
        };
        let mut tables = Vec::with_capacity(desc.tables.len());
        for t in &desc.tables {
            let tv = match old.as_ref().and_then(|v| v.table(t.id)) {
                Some(known) if same_locator(&known.desc, t) => TableView {
                    desc: *t,
                    othello: known.othello.clone(),
                    seeds: known.seeds.clone(),
                },
                _ => self.fetch_table(ep, owner, p, t).await?,
            };
            tables.push((t.id, Arc::new(tv)));
        }
        let view = ShardView {
            shard: p,
            owner,
            version: desc.version,
            compute,
            global_depth: desc.global_depth,
            dir: desc.dir,
            tables: ShardView::sort_tables(tables),
        };
        *slot.view.write() = Some(Arc::new(view));
        slot.installs.fetch_add(1, Ordering::AcqRel);
        self.counters
            .locator_fetches
            .fetch_add(1, Ordering::Relaxed);
        // Count down once per publication (paper Fig. 8: FAA on N_cNode).
        if slot.counted.fetch_max(desc.version, Ordering::AcqRel) < desc.version {
            ep.faa(ctl_r.at(ctl::COUNTDOWN), u64::MAX).await?;
        }
        Ok(true)
    }

    /// One table's Othello (locator region) and latest seeds (the seeds
    /// array at the front of its table region), one-sided.
    async fn fetch_table(
        &self,
        ep: &Endpoint,
        owner: NodeId,
        p: u16,
        t: &TableDesc,
    ) -> Result<TableView> {
        let loc = self.region(ep, owner, &locator_name(p, t.id)).await?;
        let bytes = self
            .read_all(ep, loc, 0, locator_len(t.ma, t.mb) as usize)
            .await?;
        let othello: Othello = decode_locator(&bytes, t).map_err(malformed)?;
        let bkt = self.region(ep, owner, &table_name(p, t.id)).await?;
        let layout = TableLayout::new(t.buckets);
        let bytes = self
            .read_all(ep, bkt, layout.seed(0), layout.seeds_read_len())
            .await?;
        let seeds = bytes[..t.buckets as usize]
            .iter()
            .map(|&s| AtomicU8::new(s))
            .collect();
        Ok(TableView {
            desc: *t,
            othello: Arc::new(othello),
            seeds: Arc::new(seeds),
        })
    }

    /// Asks the shard's mirrors, in takeover order, to take over from
    /// `dead`; returns once a node serves the shard.
    async fn failover(&self, ep: &Endpoint, p: u16, dead: NodeId) -> Result<()> {
        self.dead.lock().insert(dead);
        self.forget_regions(dead);
        let deadline = Instant::now() + OP_DEADLINE;
        let mut order = vec![p];
        order.extend(replicas_of(p, self.nodes.len() as u16, self.cfg.replicas));
        loop {
            if self.owner(p) != dead && !self.dead.lock().contains(&self.owner(p)) {
                return Ok(());
            }
            let mut any = false;
            for &s in &order {
                let node = self.nodes[s as usize];
                if self.dead.lock().contains(&node) {
                    continue;
                }
                any = true;
                let mut w = WireWriter::new();
                w.u8(op::TAKEOVER).u16(p);
                match self.call(ep, node, w.finish()).await {
                    Err(e) if node_down(&e).is_some() => {
                        self.dead.lock().insert(node);
                        continue;
                    }
                    Err(e) => return Err(e),
                    Ok(reply) => match Reply::parse(reply)?.head.status {
                        Status::Ok => {
                            let slot = &self.slots[p as usize];
                            *slot.owner.lock() = node;
                            *slot.view.write() = None;
                            slot.installs.fetch_add(1, Ordering::AcqRel);
                            self.counters.failovers.fetch_add(1, Ordering::Relaxed);
                            return Ok(());
                        }
                        // Taking over, or an earlier holder still lives.
                        Status::Recovering | Status::Refused => break,
                        _ => continue,
                    },
                }
            }
            if !any {
                return Err(KvError::Transport(TransportError::NodeDown(dead)));
            }
            if Instant::now() > deadline {
                return Err(KvError::Transport(TransportError::Timeout { node: dead }));
            }
            sleep(Duration::from_millis(1)).await;
        }
    }

    /// A view of shard `p` from its current owner, fetching one if needed.
    async fn ensure_view(
        &self,
        ep: &Endpoint,
        p: u16,
        deadline: Instant,
    ) -> Result<Arc<ShardView>> {
        loop {
            let owner = self.owner(p);
            if let Some(v) = self.current(p)
                && v.owner == owner
            {
                return Ok(v);
            }
            match labeled(OpKind::Other, self.fetch(ep, p)).await {
                Ok(_) => {}
                Err(e) => match node_down(&e) {
                    Some(n) => self.failover(ep, p, n).await?,
                    // The new owner has not published yet.
                    None if Instant::now() < deadline => {}
                    None => return Err(e),
                },
            }
            if self.current(p).is_none_or(|v| v.owner != self.owner(p)) {
                if Instant::now() > deadline {
                    return Err(KvError::Transport(TransportError::Timeout { node: owner }));
                }
                sleep(Duration::from_micros(200)).await;
            }
        }
    }

    /// Completes a bulk load of shard `p`: asks for the full build that
    /// indexes every block loaded so far, waits for it (polling the control
    /// region one-sided) and fetches the new locator. Loads only ship
    /// blocks, so several load calls cost one build, done when the store is
    /// first used (a client is made, an operation, stats, settle).
    async fn complete_load(&self, ep: &Endpoint, p: u16) -> Result<()> {
        let slot = &self.slots[p as usize];
        let deadline = Instant::now() + OP_DEADLINE;
        loop {
            if !slot.unbuilt.load(Ordering::Acquire) && !slot.building.load(Ordering::Acquire) {
                return Ok(());
            }
            if slot
                .building
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
            {
                // Under sim 100 us as before (see `load_poll`).
                let d = if dmkv_transport::sim::active() {
                    Duration::from_micros(100)
                } else {
                    load_poll()
                };
                sleep(d).await;
                continue;
            }
            let r = if slot.unbuilt.swap(false, Ordering::AcqRel) {
                self.build(ep, p, deadline).await
            } else {
                Ok(())
            };
            slot.building.store(false, Ordering::Release);
            match r {
                Ok(()) => return Ok(()),
                Err(e) => {
                    slot.unbuilt.store(true, Ordering::Release);
                    match node_down(&e) {
                        Some(n) => self.failover(ep, p, n).await?,
                        None => return Err(e),
                    }
                }
            }
        }
    }

    async fn build(&self, ep: &Endpoint, p: u16, deadline: Instant) -> Result<()> {
        let owner = self.ensure_view(ep, p, deadline).await?.owner;
        let mut w = WireWriter::new();
        w.u8(op::BUILD).u16(p);
        let r = Reply::parse(self.call(ep, owner, w.finish()).await?)?;
        if r.head.status != Status::Ok {
            return Err(KvError::Transport(TransportError::Backend(format!(
                "outback: build refused by node {owner}: {:?}",
                r.head.status
            ))));
        }
        let ticket = WireReader::new(r.rest()).u64().map_err(malformed)?;
        let ctl_r = self.region(ep, owner, &ctl_name(p)).await?;
        let mut deadline = deadline;
        loop {
            let h = self.ctl_header(ep, ctl_r).await?;
            if h[5] >= ticket {
                break;
            }
            if Instant::now() > deadline {
                // A full build of millions of keys can outlast one
                // operation's deadline on a busy machine: wait on while the
                // memory node says it is still working on it.
                let (busy, error) = self.shard_status(ep, owner, p).await?;
                if self.ctl_header(ep, ctl_r).await?[5] >= ticket {
                    break;
                }
                if !busy {
                    return Err(KvError::Transport(TransportError::Backend(format!(
                        "outback: the full build of shard {p} on node {owner} stopped without completing: {}",
                        error.as_deref().unwrap_or("no error recorded")
                    ))));
                }
                deadline = Instant::now() + OP_DEADLINE;
            }
            sleep(load_poll()).await;
        }
        self.fetch(ep, p).await?;
        Ok(())
    }

    /// Whether shard `p`'s memory node is rebuilding or about to (STATS
    /// `busy`), and its last rebuild error.
    async fn shard_status(
        &self,
        ep: &Endpoint,
        owner: NodeId,
        p: u16,
    ) -> Result<(bool, Option<String>)> {
        let mut w = WireWriter::new();
        w.u8(op::STATS);
        let r = Reply::parse(self.call(ep, owner, w.finish()).await?)?;
        let text = WireReader::new(r.rest()).str().map_err(malformed)?;
        let v: serde_json::Value = serde_json::from_str(text).map_err(malformed)?;
        let s = v
            .as_array()
            .into_iter()
            .flatten()
            .find(|s| s["shard"].as_u64() == Some(p as u64));
        Ok((
            s.is_some_and(|s| s["busy"] == true),
            s.and_then(|s| s["last_rebuild_error"].as_str().map(str::to_string)),
        ))
    }

    async fn complete_loads(&self, ep: &Endpoint) -> Result<()> {
        for p in 0..self.nodes.len() as u16 {
            self.complete_load(ep, p).await?;
        }
        Ok(())
    }

    /// While a shard is resizing, polls its control region (one-sided, at
    /// most every `poll_us`) and fetches a newly published locator.
    async fn maybe_poll(&self, ep: &Endpoint, p: u16, v: &ShardView) -> Result<()> {
        let slot = &self.slots[p as usize];
        if !slot.watch.load(Ordering::Relaxed) {
            return Ok(());
        }
        let now = self.now_us();
        let last = slot.last_poll_us.load(Ordering::Relaxed);
        if now < last + self.cfg.poll_us
            || slot
                .last_poll_us
                .compare_exchange(last, now, Ordering::AcqRel, Ordering::Relaxed)
                .is_err()
        {
            return Ok(());
        }
        labeled(OpKind::Other, async {
            self.counters.polls.fetch_add(1, Ordering::Relaxed);
            let r = self.region(ep, v.owner, &ctl_name(p)).await?;
            let h = self.ctl_header(ep, r).await?;
            if h[1] > v.version {
                self.fetch(ep, p).await?;
            }
            Ok(())
        })
        .await
    }
}

fn same_locator(a: &TableDesc, b: &TableDesc) -> bool {
    a.id == b.id
        && a.othello_seed == b.othello_seed
        && a.bucket_seed == b.bucket_seed
        && a.buckets == b.buckets
        && a.ma == b.ma
        && a.mb == b.mb
}

/// The engine one compute process connects.
pub struct OutbackEngine {
    sh: Arc<Shared>,
}

/// Connects to an Outback instance: waits for every node to resolve its
/// mirrors, registers with every shard and fetches every locator.
pub fn connect(args: dmkv_api::ConnectArgs) -> Result<Arc<dyn Engine>> {
    let cfg = Config::from_knobs(&args.serve.knobs)?;
    let nodes = args.serve.node_ids();
    let shards = nodes.len() as u16;
    let sh = Arc::new(Shared {
        ring: Ring::new(shards, cfg.vnodes),
        slots: nodes
            .iter()
            .map(|&n| ShardSlot {
                owner: Mutex::new(n),
                view: RwLock::new(None),
                installs: AtomicU64::new(0),
                fetching: AtomicBool::new(false),
                watch: AtomicBool::new(false),
                last_poll_us: AtomicU64::new(0),
                counted: AtomicU64::new(0),
                computes: Mutex::new(HashMap::new()),
                unbuilt: AtomicBool::new(false),
                building: AtomicBool::new(false),
            })
            .collect(),
        cfg,
        args: args.serve.clone(),
        nodes,
        compute_node: args.compute_node,
        fabric: args.fabric.clone(),
        services: Mutex::new(HashMap::new()),
        regions: Mutex::new(HashMap::new()),
        dead: Mutex::new(HashSet::new()),
        // Another compute process of a simulated cluster counts into
        // compute node 0's counters (only those).
        counters: match args.counting_into::<OutbackEngine>() {
            Some(first) => first.sh.counters.clone(),
            None => Arc::default(),
        },
        started: Instant::now(),
        // Seeded under sim (a run replays), from the OS elsewhere; 44
        // random bits make two processes' sessions collide with negligible
        // odds (docs/outback.md, invariant 16).
        incarnation: (dmkv_transport::sim::random_u64() << LANE_BITS) | 1 << 63,
        lanes: Mutex::new(Lanes::default()),
    });
    let ep = args.fabric.endpoint(args.compute_node)?;
    block_on(labeled(OpKind::Setup, async {
        let deadline = Instant::now() + OP_DEADLINE;
        for &n in &sh.nodes {
            loop {
                let mut w = WireWriter::new();
                w.u8(op::INIT);
                let r = Reply::parse(sh.call(&ep, n, w.finish()).await?)?;
                if r.head.status == Status::Ok {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(KvError::Transport(TransportError::Timeout { node: n }));
                }
                sleep(Duration::from_millis(1)).await;
            }
        }
        for p in 0..shards {
            sh.ensure_view(&ep, p, deadline).await?;
        }
        Ok(())
    }))?;
    Ok(Arc::new(OutbackEngine { sh }))
}

impl Drop for OutbackEngine {
    fn drop(&mut self) {
        // Best effort: stop counting in resize countdowns.
        let Ok(ep) = self.sh.fabric.endpoint(self.sh.compute_node) else {
            return;
        };
        let sh = &self.sh;
        let _ = block_on(async {
            for p in 0..sh.nodes.len() as u16 {
                let owner = sh.owner(p);
                let id = sh.slots[p as usize].computes.lock().get(&owner).copied();
                if let Some(id) = id {
                    let mut w = WireWriter::new();
                    w.u8(op::DEREGISTER).u16(p).u32(id);
                    let _ = sh.call(&ep, owner, w.finish()).await;
                }
            }
            Ok::<(), KvError>(())
        });
    }
}

#[async_trait(?Send)]
impl Engine for OutbackEngine {
    fn name(&self) -> &'static str {
        "outback"
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.sh.compute_node
    }

    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        self.sh.complete_loads(&ep).await?;
        Ok(Rc::new(Client {
            views: RefCell::new(vec![None; self.sh.nodes.len()]),
            services: RefCell::new(Vec::new()),
            sh: self.sh.clone(),
            ep,
        }))
    }

    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let sh = &self.sh;
        // Ordered by shard, so that a simulation replays the same messages
        // (a HashMap's iteration order differs from run to run).
        let mut by_shard: BTreeMap<u16, Vec<&(Key, Vec<u8>)>> = BTreeMap::new();
        for kv in pairs {
            if kv.1.len() > CAPS.max_value_len {
                return Err(KvError::ValueTooLarge {
                    len: kv.1.len(),
                    max: CAPS.max_value_len,
                    engine: "outback",
                });
            }
            by_shard.entry(sh.ring.shard_of(kv.0)).or_default().push(kv);
        }
        let deadline = Instant::now() + OP_DEADLINE;
        for (p, kvs) in by_shard {
            loop {
                match self.load_shard(ep, p, &kvs, deadline).await {
                    Ok(()) => break,
                    Err(e) => match node_down(&e) {
                        // Blocks sent so far are on the mirrors; the new
                        // owner recovers them and the reload supersedes them.
                        Some(n) => sh.failover(ep, p, n).await?,
                        None => return Err(e),
                    },
                }
            }
        }
        Ok(())
    }

    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let sh = &self.sh;
        sh.complete_loads(ep).await?;
        let mut per_shard = Vec::new();
        let mut asked: HashMap<NodeId, Vec<serde_json::Value>> = HashMap::new();
        for p in 0..sh.nodes.len() as u16 {
            let owner = sh.owner(p);
            if let std::collections::hash_map::Entry::Vacant(slot) = asked.entry(owner) {
                let mut w = WireWriter::new();
                w.u8(op::STATS);
                let r = Reply::parse(sh.call(ep, owner, w.finish()).await?)?;
                let text = WireReader::new(r.rest())
                    .str()
                    .map_err(malformed)?
                    .to_string();
                let v: serde_json::Value = serde_json::from_str(&text).map_err(malformed)?;
                slot.insert(v.as_array().cloned().unwrap_or_default());
            }
            if let Some(s) = asked[&owner]
                .iter()
                .find(|s| s["shard"].as_u64() == Some(p as u64))
            {
                per_shard.push(s.clone());
            }
        }
        let sum = |k: &str| -> u64 { per_shard.iter().map(|s| s[k].as_u64().unwrap_or(0)).sum() };
        let max = |k: &str| -> u64 {
            per_shard
                .iter()
                .map(|s| s[k].as_u64().unwrap_or(0))
                .max()
                .unwrap_or(0)
        };
        let keys = sum("keys");
        let slots = sum("slots");
        let cache = self.client_cache_bytes();
        let split_ns = sum("split_ns");
        let full_ns = sum("full_build_ns");
        let per_s = |n: u64, ns: u64| {
            if ns > 0 {
                n as f64 / (ns as f64 / 1e9)
            } else {
                0.0
            }
        };
        // Per shard, its locator bytes after each completed resize plus its
        // share of the ring, per key it then held: the largest such ratio
        // over shards and resizes, and the latest resize's (largest over
        // shards); 0 if nothing resized.
        let ring_share = sh.ring.bytes() as f64 / sh.nodes.len().max(1) as f64;
        let ratio = |s: &serde_json::Value, b: &str, k: &str| -> f64 {
            let a = &s["after_resize"];
            match (a[b].as_u64(), a[k].as_u64()) {
                (Some(bytes), Some(keys)) if keys > 0 => {
                    (bytes as f64 + ring_share) * 8.0 / keys as f64
                }
                _ => 0.0,
            }
        };
        let after_resize_max = per_shard
            .iter()
            .map(|s| ratio(s, "max_bytes", "max_keys"))
            .fold(0.0, f64::max);
        let after_resize_last = per_shard
            .iter()
            .map(|s| ratio(s, "last_bytes", "last_keys"))
            .fold(0.0, f64::max);
        // Why tables entered PRE_RESIZE or stopped (s_slow by overflow fill
        // or by load, s_stop), and what let each resize start.
        let triggers = serde_json::json!({
            "slow_fill": sum("trigger_slow_fill"),
            "slow_load": sum("trigger_slow_load"),
            "stop_fill": sum("trigger_stop_fill"),
        });
        let starts = serde_json::json!({
            "all_told": sum("start_all_told"),
            "pre_resize_timeout": sum("start_timeout"),
            "stop_fill": sum("start_stop_fill"),
        });
        let c = &sh.counters;
        let l = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let mut v = serde_json::json!({
            "shards": sh.nodes.len(),
            "replicas_per_shard": replicas_of(0, sh.nodes.len() as u16, sh.cfg.replicas).len(),
            "keys": keys,
            "slots": slots,
            "load_factor": if slots > 0 { sum("keys_in_slots") as f64 / slots as f64 } else { 0.0 },
            "overflow_keys": sum("overflow_keys"),
            "client_cache_bytes": cache,
            "client_bits_per_key": if keys > 0 { cache as f64 * 8.0 / keys as f64 } else { 0.0 },
            "paper_bits_per_key": 2.33 + 2.0 / sh.cfg.load_factor,
            "makeup_gets": l(&c.makeup_gets),
            "makeup_gets_served": sum("makeup_gets"),
            "stale_retries": l(&c.stale_retries),
            // Writes answered during resizes (invariant 17) and GETs of
            // buckets that had such writes.
            "buffered_writes": sum("buffered_writes"),
            "pending_gets": sum("pending_gets"),
            "locator_fetches": l(&c.locator_fetches),
            "locator_bytes_fetched": l(&c.locator_bytes),
            "control_polls": l(&c.polls),
            "failovers": l(&c.failovers),
            "reseeds": sum("reseeds"),
            "overflow_inserts": sum("overflow_inserts"),
            "promotions": sum("promotions"),
            "fallback_keys": sum("fallback_keys"),
            "resizes": sum("splits") + sum("grows"),
            "resize_ms_total": split_ns as f64 / 1e6,
            "resize_ms_max": max("split_max_ns") as f64 / 1e6,
            "resize_until_fetched_ms_total": sum("resize_total_ns") as f64 / 1e6,
            "requests_during_resize": sum("requests_during_split"),
            "requests_per_s_during_resize": per_s(sum("requests_during_split"), split_ns),
            "full_builds": sum("full_builds"),
            "full_build_ms_total": full_ns as f64 / 1e6,
            "requests_per_s_during_full_build": per_s(sum("requests_during_full"), full_ns),
            "takeovers": sum("takeovers"),
            "takeover_ms": sum("takeover_ns") as f64 / 1e6,
            "recovered_keys": sum("recovered_keys"),
            "replica_verbs": sum("replica_verbs"),
            "replica_bytes": sum("replica_bytes"),
            "replica_round_trips": sum("replica_round_trips"),
            "memnode_heap_live_bytes": sum("heap_live_bytes"),
            "per_shard": per_shard,
        });
        // Added apart: one json! of them all exceeds the macro recursion limit.
        if let Some(o) = v.as_object_mut() {
            o.insert("write_replays".into(), sum("write_replays").into());
            o.insert("resize_splits".into(), sum("splits").into());
            o.insert("resize_grows".into(), sum("grows").into());
            o.insert("resize_triggers".into(), triggers);
            o.insert("resize_starts".into(), starts);
            o.insert(
                "client_bits_per_key_after_resize_max".into(),
                after_resize_max.into(),
            );
            o.insert(
                "client_bits_per_key_after_resize_last".into(),
                after_resize_last.into(),
            );
        }
        Ok(v)
    }

    fn client_cache_bytes(&self) -> u64 {
        let sh = &self.sh;
        sh.ring.bytes()
            + (0..sh.nodes.len() as u16)
                .filter_map(|p| sh.current(p))
                .map(|v| v.bytes())
                .sum::<u64>()
    }

    async fn settle(&self, ep: &Endpoint) -> Result<()> {
        let sh = &self.sh;
        sh.complete_loads(ep).await?;
        let deadline = Instant::now() + OP_DEADLINE;
        for p in 0..sh.nodes.len() as u16 {
            loop {
                let owner = sh.owner(p);
                let mut w = WireWriter::new();
                w.u8(op::STATS);
                let r = Reply::parse(sh.call(ep, owner, w.finish()).await?)?;
                let text = WireReader::new(r.rest())
                    .str()
                    .map_err(malformed)?
                    .to_string();
                let v: serde_json::Value = serde_json::from_str(&text).map_err(malformed)?;
                let busy = v
                    .as_array()
                    .into_iter()
                    .flatten()
                    .any(|s| s["shard"].as_u64() == Some(p as u64) && s["busy"] == true);
                if !busy {
                    break;
                }
                if Instant::now() > deadline {
                    return Err(KvError::Transport(TransportError::Timeout { node: owner }));
                }
                sleep(Duration::from_millis(1)).await;
            }
            sh.ensure_view(ep, p, deadline).await?;
            sh.fetch(ep, p).await?;
        }
        Ok(())
    }
}

impl OutbackEngine {
    /// LOAD every pair of shard `p` (the build comes with first use).
    async fn load_shard(
        &self,
        ep: &Endpoint,
        p: u16,
        kvs: &[&(Key, Vec<u8>)],
        deadline: Instant,
    ) -> Result<()> {
        let sh = &self.sh;
        let view = sh.ensure_view(ep, p, deadline).await?;
        let owner = view.owner;
        let mut i = 0;
        while i < kvs.len() {
            let mut w = WireWriter::new();
            let mut n = 0;
            let mut bytes = 0;
            while i + n < kvs.len() && n < LOAD_PAIRS && bytes < LOAD_BYTES {
                bytes += 12 + kvs[i + n].1.len();
                n += 1;
            }
            w.u8(op::LOAD).u16(p).u32(n as u32);
            for kv in &kvs[i..i + n] {
                w.u64(kv.0).bytes(&kv.1);
            }
            let r = Reply::parse(sh.call(ep, owner, w.finish()).await?)?;
            if r.head.status != Status::Ok {
                return Err(KvError::Transport(TransportError::Backend(format!(
                    "outback: load refused by node {owner}: {:?}",
                    r.head.status
                ))));
            }
            i += n;
        }
        sh.slots[p as usize].unbuilt.store(true, Ordering::Release);
        Ok(())
    }
}

/// A view and the install count it was current at.
type CachedView = (u64, Arc<ShardView>);

/// A compute thread's handle.
pub struct Client {
    sh: Arc<Shared>,
    ep: Rc<Endpoint>,
    /// Per shard, the view this thread last used and the install count it
    /// was current at (so the hot path takes no shared lock).
    views: RefCell<Vec<Option<CachedView>>>,
    /// The service id at each node asked so far (a handful of nodes: a
    /// linear search, no hashing on the GET path).
    services: RefCell<Vec<(NodeId, ServiceId)>>,
}

/// What one exchange produced.
struct Exchange {
    table: Arc<TableView>,
    bucket: u32,
    used_seed: u8,
    reply: Reply,
}

impl Client {
    /// The current view of shard `p`, from this thread's cache when no new
    /// one was installed since.
    async fn view(&self, p: u16, deadline: &Deadline) -> Result<Arc<ShardView>> {
        if let Some(v) = self.cached_view(p) {
            return Ok(v);
        }
        let installs = self.sh.slots[p as usize].installs.load(Ordering::Acquire);
        let v = self.sh.ensure_view(&self.ep, p, deadline.at()).await?;
        self.views.borrow_mut()[p as usize] = Some((installs, v.clone()));
        Ok(v)
    }

    /// This thread's view of shard `p` if no newer one was installed since
    /// (the GET path's case: no future to poll).
    #[inline]
    fn cached_view(&self, p: u16) -> Option<Arc<ShardView>> {
        let installs = self.sh.slots[p as usize].installs.load(Ordering::Acquire);
        match &self.views.borrow()[p as usize] {
            Some((i, v)) if *i == installs => Some(v.clone()),
            _ => None,
        }
    }

    async fn call(&self, node: NodeId, payload: Vec<u8>) -> Result<Vec<u8>> {
        let cached = self
            .services
            .borrow()
            .iter()
            .find(|(n, _)| *n == node)
            .map(|(_, s)| *s);
        let svc = match cached {
            Some(s) => s,
            None => {
                let s = Box::pin(self.sh.service(&self.ep, node)).await?;
                self.services.borrow_mut().push((node, s));
                s
            }
        };
        Ok(self.ep.call(node, svc, payload).await?)
    }

    /// Sends the request `make` builds for `key` (from the current view) and
    /// handles everything that is not an answer: a node down (failover),
    /// STALE (fetch, retry), NOT_OWNER / RECOVERING (wait, retry).
    ///
    /// The slow paths' futures (loading, fetching, failover, polling) are
    /// boxed: inline they made every operation's future kilobytes large, and
    /// the API's boxing of it a ~250-instruction copy per GET.
    async fn exchange(
        &self,
        key: u64,
        deadline: &Deadline,
        make: impl Fn(&ShardView, &TableView) -> (Vec<u8>, u32, u8),
    ) -> Result<Exchange> {
        let sh = &self.sh;
        let ep = &*self.ep;
        let p = sh.ring.shard_of(key);
        let mut first = true;
        loop {
            // The first try needs no deadline (nothing has waited yet).
            if !std::mem::take(&mut first) && deadline.passed() {
                return Err(KvError::Transport(TransportError::Timeout {
                    node: sh.owner(p),
                }));
            }
            let slot = &sh.slots[p as usize];
            if slot.unbuilt.load(Ordering::Acquire) || slot.building.load(Ordering::Acquire) {
                Box::pin(labeled(OpKind::Setup, sh.complete_load(ep, p))).await?;
            }
            let view = match self.cached_view(p) {
                Some(v) => v,
                None => Box::pin(self.view(p, deadline)).await?,
            };
            // Checked here first so that the common case (no resize coming)
            // builds no future.
            if slot.watch.load(Ordering::Relaxed)
                && let Err(e) = Box::pin(sh.maybe_poll(ep, p, &view)).await
            {
                if let Some(n) = node_down(&e) {
                    Box::pin(sh.failover(ep, p, n)).await?;
                    continue;
                }
                return Err(e);
            }
            let table = view.table_for(key).clone();
            let (payload, bucket, used_seed) = make(&view, &table);
            let reply = match self.call(view.owner, payload).await {
                Ok(r) => Reply::parse(r)?,
                Err(e) => match node_down(&e) {
                    Some(n) => {
                        Box::pin(sh.failover(ep, p, n)).await?;
                        continue;
                    }
                    None => return Err(e),
                },
            };
            let slot = &sh.slots[p as usize];
            match reply.head.status {
                Status::Stale => {
                    sh.counters.stale_retries.fetch_add(1, Ordering::Relaxed);
                    let fresh = match Box::pin(labeled(OpKind::Other, sh.fetch(ep, p))).await {
                        Ok(f) => f,
                        Err(e) => match node_down(&e) {
                            Some(n) => {
                                Box::pin(sh.failover(ep, p, n)).await?;
                                continue;
                            }
                            None => return Err(e),
                        },
                    };
                    if !fresh {
                        // The new locator is not published yet.
                        sleep(Duration::from_micros(50)).await;
                    }
                }
                Status::NotOwner | Status::Recovering => {
                    sleep(Duration::from_micros(500)).await;
                }
                Status::Refused => {
                    return Err(KvError::Transport(TransportError::Backend(
                        "outback: request refused".into(),
                    )));
                }
                _ => {
                    slot.watch.store(reply.head.pre_resize(), Ordering::Relaxed);
                    return Ok(Exchange {
                        table,
                        bucket,
                        used_seed,
                        reply,
                    });
                }
            }
        }
    }

    fn target(view: &ShardView, table: &TableView, bucket: u32) -> Target {
        Target {
            shard: view.shard,
            table: table.desc.id,
            epoch: table.desc.epoch,
            bucket,
            compute: view.compute,
        }
    }

    /// The outcome of an insert or delete from its reply, which also
    /// teaches the bucket's seed. A write that reaches a table being
    /// resized is answered at once too (invariant 17; paper §4.4).
    fn write_outcome(&self, x: &Exchange) -> Status {
        x.table.learn_seed(x.bucket, x.reply.head.seed);
        x.reply.head.status
    }

    async fn makeup_get(&self, key: u64, deadline: &Deadline) -> Result<Option<Vec<u8>>> {
        self.sh.counters.makeup_gets.fetch_add(1, Ordering::Relaxed);
        let x = self
            .exchange(key, deadline, |v, t| {
                let b = t.bucket(key);
                let req = DataReq::MakeupGet {
                    t: Self::target(v, t, b),
                    key,
                };
                (req.encode(), b, t.seed(b))
            })
            .await?;
        x.table.learn_seed(x.bucket, x.reply.head.seed);
        match x.reply.head.status {
            Status::Ok => {
                let f = BlockFront::parse(x.reply.rest())
                    .ok_or_else(|| KvError::Corrupt("malformed KV block in a reply".into()))?;
                if f.key != key {
                    return Err(KvError::Corrupt(format!(
                        "makeup GET of {key:#x} returned key {:#x}",
                        f.key
                    )));
                }
                Ok(Some(f.value.to_vec()))
            }
            Status::NotFound => Ok(None),
            s => Err(malformed(format!("unexpected makeup reply {s:?}"))),
        }
    }

    /// INSERT or UPSERT: true if the key was new.
    async fn insert_like(&self, key: Key, value: &[u8], upsert: bool) -> Result<bool> {
        let deadline = &Deadline::new();
        // One session number for every send of this write (invariant 16).
        let lease = self.sh.lease()?;
        let s = lease.session();
        let x = self
            .exchange(key, deadline, |v, t| {
                let b = t.bucket(key);
                let req = DataReq::Insert {
                    t: Self::target(v, t, b),
                    key,
                    s,
                    value,
                    upsert,
                };
                (req.encode(), b, t.seed(b))
            })
            .await?;
        match self.write_outcome(&x) {
            Status::Ok => Ok(true),
            Status::Exists => Ok(false),
            s => Err(malformed(format!("unexpected insert reply {s:?}"))),
        }
    }
}

impl KvClient for Client {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let deadline = &Deadline::new();
        self.sh.counters.gets.fetch_add(1, Ordering::Relaxed);
        let x = self
            .exchange(key, deadline, |v, t| {
                let (b, s, seed) = t.locate(key);
                let buf = self.ep.request_buffer(proto::GET_LEN);
                let req = proto::encode_get_into(&Self::target(v, t, b), s, buf);
                (req, b, seed)
            })
            .await?;
        let head = x.reply.head;
        if head.status != Status::Ok {
            return Err(malformed(format!("unexpected GET reply {:?}", head.status)));
        }
        let moved = head.seed != x.used_seed;
        if moved {
            x.table.learn_seed(x.bucket, head.seed);
        }
        if let Some(value) = x.reply.into_value_of(key)? {
            return Ok(Some(value));
        }
        // Another key (or none) in the slot: the key is absent unless it
        // overflowed (cache bit), moved under a seed we did not know, or
        // was written while its table is being resized (BUFFERED).
        if head.cache() || head.buffered() || moved {
            return Box::pin(self.makeup_get(key, deadline)).await;
        }
        Ok(None)
    }

    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.insert_like(key, value, false).await
    }

    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.insert_like(key, value, true).await
    }

    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        let deadline = &Deadline::new();
        let lease = self.sh.lease()?;
        let session = lease.session();
        let x = self
            .exchange(key, deadline, |v, t| {
                let (b, s, seed) = t.locate(key);
                let req = DataReq::Update {
                    t: Self::target(v, t, b),
                    slot: s,
                    key,
                    s: session,
                    value,
                };
                (req.encode(), b, seed)
            })
            .await?;
        x.table.learn_seed(x.bucket, x.reply.head.seed);
        match x.reply.head.status {
            Status::Ok => Ok(true),
            Status::NotFound => Ok(false),
            s => Err(malformed(format!("unexpected update reply {s:?}"))),
        }
    }

    async fn delete(&self, key: Key) -> Result<bool> {
        let deadline = &Deadline::new();
        let lease = self.sh.lease()?;
        let session = lease.session();
        let x = self
            .exchange(key, deadline, |v, t| {
                let (b, s, seed) = t.locate(key);
                let req = DataReq::Delete {
                    t: Self::target(v, t, b),
                    slot: s,
                    key,
                    s: session,
                };
                (req.encode(), b, seed)
            })
            .await?;
        match self.write_outcome(&x) {
            Status::Ok => Ok(true),
            Status::NotFound => Ok(false),
            s => Err(malformed(format!("unexpected delete reply {s:?}"))),
        }
    }

    async fn scan(&self, _start: Key, _n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        Err(KvError::Unsupported {
            engine: "outback",
            what: "ordered scans (it is a hash index)",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{BLOCK_TAIL_WORDS, encode_block};

    /// A GET reply as the memory node builds it: the head, then the front
    /// of the block (the block without its tail words).
    fn get_reply(key: u64, value: &[u8]) -> Vec<u8> {
        let block = encode_block(key, value, 1);
        let front = block.len() - BLOCK_TAIL_WORDS as usize * 8;
        let mut reply = vec![Status::Ok as u8, 0, 0];
        reply.extend_from_slice(&block[..front]);
        reply
    }

    #[test]
    fn a_get_value_is_taken_from_the_reply_in_place() {
        for value in [&b""[..], b"v", b"eight by", b"a value of twenty bytes"] {
            let r = Reply::parse(get_reply(7, value)).unwrap();
            assert_eq!(r.into_value_of(7).unwrap().as_deref(), Some(value));
            // Another key's block, or an empty slot: not this key's value.
            let r = Reply::parse(get_reply(8, value)).unwrap();
            assert_eq!(r.into_value_of(7).unwrap(), None);
        }
        let empty = Reply::parse(vec![Status::Ok as u8, 0, 0]).unwrap();
        assert_eq!(empty.into_value_of(7).unwrap(), None);
        // A block front cut inside its value, or with a bad key length, is
        // corrupt, not absent.
        let mut cut = get_reply(7, b"a value of twenty bytes");
        cut.truncate(cut.len() - 16);
        assert!(matches!(
            Reply::parse(cut).unwrap().into_value_of(7),
            Err(KvError::Corrupt(_))
        ));
        let mut bad = get_reply(7, b"v");
        bad[3] = 9;
        assert!(matches!(
            Reply::parse(bad).unwrap().into_value_of(7),
            Err(KvError::Corrupt(_))
        ));
        // A reply shorter than its head, or with an unknown status.
        assert!(Reply::parse(vec![0, 0]).is_err());
        assert!(Reply::parse(vec![200, 0, 0]).is_err());
    }

    #[test]
    fn a_deadline_starts_when_first_asked_and_then_stays() {
        let d = Deadline::new();
        assert_eq!(d.0.get(), None, "no clock read before it is needed");
        assert!(!d.passed(), "a deadline just started has not passed");
        let at = d.0.get().expect("started by the first question");
        assert!(
            at.saturating_duration_since(Instant::now()) > OP_DEADLINE - Duration::from_secs(1)
        );
        assert_eq!(d.at(), at, "started once");
    }
}
