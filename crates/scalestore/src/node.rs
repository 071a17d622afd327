//! One ScaleStore node (paper §2.2): its cache (a registered region of page
//! slots), frames and translation table, the directory shards it hosts
//! (page files on its SSD), what it knows of the other members, and its
//! counters. The protocol roles live in their own modules:
//!
//! - [`crate::directory`]: deciding ownership requests (§3.3–3.4),
//!   evictions from other nodes (§4.2–4.3), allocation (§6.5);
//! - [`crate::holder`]: serving moves, invalidations and copies of this
//!   node's copies;
//! - [`crate::handler`]: the message handler that dispatches requests;
//! - [`crate::repoll`]: re-trying requests that were parked (the paper's
//!   handler re-polls a mailbox whose request could not be served yet);
//! - [`crate::membership`]: joining and leaving at run time (§6.6).

use crate::frames::{FrameTable, Local, Meta, Possession};
use crate::msg::{KIND_SLOTS, Kind};
use crate::page::{PAGE_SIZE, PageRef};
use crate::pid::{MAX_SHARDS, Pid};
use crate::repoll::Repoll;
use crate::ssd::{AlignedPage, PageFile};
use dmkv_api::KvError;
use dmkv_transport::exec::block_on_network;
use dmkv_transport::{Endpoint, Fabric, NodeId, RegionMem, RemoteRegion, Responder, ServiceId};
use parking_lot::{Condvar, Mutex, RwLock};
use std::cell::RefCell;
use std::collections::{BTreeSet, HashMap};
use std::future::Future;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Weak};
use std::time::Duration;

/// Most node indices a cluster can have (owner bitmaps are 64 bits).
pub const MAX_MEMBERS: usize = 64;

/// How conflicting requests are ordered (§3.4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Protocol {
    /// Anticipatory chaining with immediate metadata updates.
    Chaining,
    /// Requests queue at the directory and are served one transfer at a
    /// time, each acknowledged; the directory's own workers bypass the queue.
    Fifo,
}

/// Where new pages get their directory (§6.5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AllocPolicy {
    /// On the allocating node.
    Local,
    /// Round-robin over the members (remote allocation by message).
    RoundRobin,
}

/// Typed configuration of a node.
#[derive(Debug, Clone)]
pub struct NodeConfig {
    /// Page slots of the cache.
    pub pages: usize,
    pub protocol: Protocol,
    /// FIFO: the grantee awaits the answer to its acknowledgement before
    /// it uses the page (`scalestore.fifo_ack=await`) instead of posting
    /// it (`post`, the default; see `Worker::acknowledge`).
    pub await_ack: bool,
    pub alloc: AllocPolicy,
    /// Where page files go.
    pub data_dir: PathBuf,
    /// Free-slot target of the page provider, percent of the cache.
    pub free_percent: usize,
    /// Share of sampled frames under the eviction threshold, percent.
    pub evict_percent: usize,
    /// How long a worker waits for a free cache slot before it fails the
    /// operation (`scalestore.slot_wait_ms`; the page provider frees slots
    /// continuously, so only a stuck provider or all slots latched make it
    /// wait that long).
    pub slot_wait: std::time::Duration,
}

/// A member of the cluster, as seen by this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub node: NodeId,
    pub region: RemoteRegion,
    pub service: ServiceId,
}

/// Where a node is in its life (§6.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum NodeState {
    /// Served, but not yet a member (it joins later).
    Dormant = 0,
    Active = 1,
    /// Handing its pages and directory over; its workers issue nothing.
    Leaving = 2,
    Left = 3,
}

/// A directory shard hosted here: its page file and slot allocator.
pub struct Shard {
    pub id: u8,
    pub file: PageFile,
    pub next_slot: AtomicU64,
    /// Source of conflict epochs: directory entries come and go (an entry
    /// whose page is only on the SSD is dropped), but a page's epochs must
    /// only grow, so they are drawn from one clock per shard.
    pub clock: AtomicU64,
    /// Being handed over to a successor: no grants, no evictions.
    pub frozen: AtomicBool,
    /// Set once the shard was handed over: requests that still reach this
    /// node are answered "moved to" it.
    pub moved_to: Mutex<Option<u8>>,
}

impl Shard {
    /// A fresh, larger epoch.
    pub fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::AcqRel) + 1
    }
}

/// Counters for `engine_stats`.
#[derive(Default)]
pub struct Counters {
    /// Requests sent, by kind.
    pub sent: [AtomicU64; KIND_SLOTS],
    /// Requests parked at a holder, at a directory (eviction pull, handover)
    /// and in FIFO queues.
    pub parked_holder: AtomicU64,
    pub parked_directory: AtomicU64,
    /// Requests answered "retry" by a shard being handed over.
    pub handover_retries: AtomicU64,
    pub fifo_queued: AtomicU64,
    /// FIFO: grants to this node's own workers while remote requests were
    /// queued (the bypass of §3.4.2).
    pub fifo_bypassed: AtomicU64,
    /// FIFO: requests that arrived while their own node's acknowledgement
    /// of the previous transfer was still on its way (posted acks).
    pub fifo_before_ack: AtomicU64,
    pub gone: AtomicU64,
    pub copy_failures: AtomicU64,
    /// Moves or copies for a grant older than this node's possession
    /// (answered without effect; they never happen in a correct run).
    pub stale: AtomicU64,
    pub fixes: AtomicU64,
    pub hot: AtomicU64,
    pub local_grants: AtomicU64,
    pub pages_remote: AtomicU64,
    pub pages_ssd: AtomicU64,
    pub evictions: AtomicU64,
    pub evict_declined: AtomicU64,
    pub evict_batches: AtomicU64,
    /// Provider SSD writes whose page stayed dirty because a reader still
    /// held it shared when the write finished (invariant 17).
    pub evict_writes_kept_dirty: AtomicU64,
    pub restarts: AtomicU64,
    /// Fixes that waited on a frame's latch waiter list (the page here but
    /// latched against them, or a parked remote move going first).
    pub latch_waits: AtomicU64,
    pub pulled: AtomicU64,
    pub ops: AtomicU64,
}

impl Counters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
    pub fn sent(&self, k: Kind) {
        Self::add(&self.sent[k as usize], 1);
    }
}

/// One node's state, shared by its workers, handlers, re-poll thread and
/// page provider.
pub struct ScaleNode {
    pub index: u8,
    pub id: NodeId,
    pub cfg: NodeConfig,
    pub mem: Arc<RegionMem>,
    pub region: RemoteRegion,
    pub service: ServiceId,
    pub frames: FrameTable,
    slots: Mutex<Vec<u32>>,
    free_slots: AtomicUsize,
    members: RwLock<Vec<Option<Member>>>,
    /// Which member hosts each directory shard.
    hosts: RwLock<Vec<Option<u8>>>,
    shards: RwLock<HashMap<u8, Arc<Shard>>>,
    state: AtomicU8,
    /// Taken to make this node `Leaving` and to accept an `Adopt`, so the
    /// two exclude each other (invariant 13 in `docs/scalestore.md`); holds
    /// the leavers whose shards this node accepted to adopt and that have
    /// not departed yet (it may not start leaving while any is listed).
    adopting_from: Mutex<BTreeSet<u8>>,
    /// Operations of this node's workers in progress (a leaving node waits
    /// for them to finish).
    pub inflight: AtomicU64,
    pub global_epoch: AtomicU64,
    pub stats: Counters,
    pub fabric: Arc<dyn Fabric>,
    alloc_rr: AtomicU64,
    pub repoll: Repoll,
    /// SSD accesses handed off by handlers, for the node's SSD completer
    /// (`ssdio`): handlers never wait for the SSD.
    pub ssd_jobs: crate::ssdio::SsdQueue,
    /// Test hook: holds the completer's posted verbs (`set_net_gate`).
    pub net_gate: Mutex<Option<Arc<crate::ssdio::NetGate>>>,
    /// Wakes the page provider when a worker finds no free slot.
    provider_wake: (Mutex<bool>, Condvar),
    /// The page provider's task, waiting in virtual time (`--transport sim`).
    provider_waker: Mutex<Option<std::task::Waker>>,
    pub stop: AtomicBool,
    /// The default data directory, removed when the node goes away.
    pub tmp: Mutex<Option<tempfile::TempDir>>,
}

pub(crate) fn corrupt(m: impl Into<String>) -> KvError {
    KvError::Corrupt(m.into())
}

thread_local! {
    /// Endpoints of the transport's handler threads (and of our own
    /// threads), by fabric and node: handlers get no per-thread state from
    /// the transport, and an endpoint must stay on its thread. Each entry
    /// keeps a weak handle on its fabric: while it lives, the fabric's
    /// address cannot be reused by a later fabric (a later simulation on
    /// this thread), and an entry whose fabric is gone is stale.
    #[allow(clippy::type_complexity)]
    static THREAD_EPS: RefCell<HashMap<(usize, NodeId), (Weak<dyn Fabric>, Rc<Endpoint>)>> =
        RefCell::new(HashMap::new());
}

impl ScaleNode {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        index: u8,
        id: NodeId,
        cfg: NodeConfig,
        mem: Arc<RegionMem>,
        region: RemoteRegion,
        service: ServiceId,
        fabric: Arc<dyn Fabric>,
        state: NodeState,
    ) -> ScaleNode {
        let pages = cfg.pages;
        ScaleNode {
            index,
            id,
            frames: FrameTable::new(pages * MAX_MEMBERS + 1024, pages * 2),
            slots: Mutex::new((0..pages as u32).rev().collect()),
            free_slots: AtomicUsize::new(pages),
            members: RwLock::new(vec![None; MAX_MEMBERS]),
            hosts: RwLock::new(vec![None; MAX_SHARDS]),
            shards: RwLock::new(HashMap::new()),
            state: AtomicU8::new(state as u8),
            adopting_from: Mutex::new(BTreeSet::new()),
            inflight: AtomicU64::new(0),
            global_epoch: AtomicU64::new(1),
            stats: Counters::default(),
            fabric,
            alloc_rr: AtomicU64::new(index as u64),
            repoll: Repoll::default(),
            ssd_jobs: crate::ssdio::SsdQueue::default(),
            net_gate: Mutex::new(None),
            provider_wake: (Mutex::new(false), Condvar::new()),
            provider_waker: Mutex::new(None),
            stop: AtomicBool::new(false),
            tmp: Mutex::new(None),
            cfg,
            mem,
            region,
            service,
        }
    }

    pub fn state(&self) -> NodeState {
        match self.state.load(Ordering::SeqCst) {
            0 => NodeState::Dormant,
            1 => NodeState::Active,
            2 => NodeState::Leaving,
            _ => NodeState::Left,
        }
    }

    pub fn set_state(&self, s: NodeState) {
        self.state.store(s as u8, Ordering::SeqCst);
    }

    /// Makes an `Active` node `Leaving`, under the lock `Adopt` takes
    /// (invariant 13): refused unless the node is `Active`, and refused
    /// while it adopts a shard from a leaver that has not departed yet
    /// (`Some(leavers)`: the caller may wait and try again).
    pub fn try_begin_leave(&self) -> Result<(), Option<Vec<u8>>> {
        let a = self.adopting_from.lock();
        if self.state() != NodeState::Active {
            return Err(None);
        }
        if !a.is_empty() {
            return Err(Some(a.iter().copied().collect()));
        }
        self.set_state(NodeState::Leaving);
        Ok(())
    }

    /// Accepts to adopt shards of `from` if this node is `Active` (under
    /// the lock `try_begin_leave` takes), running `adopt` under it; `Ok(false)`
    /// if refused.
    pub fn accept_adoption(
        &self,
        from: u8,
        adopt: impl FnOnce() -> Result<(), KvError>,
    ) -> Result<bool, KvError> {
        let mut a = self.adopting_from.lock();
        if self.state() != NodeState::Active {
            return Ok(false);
        }
        adopt()?;
        a.insert(from);
        Ok(true)
    }

    /// `from` departed: its handover to us, if any, is complete.
    pub fn adoption_done(&self, from: u8) {
        self.adopting_from.lock().remove(&from);
    }

    /// What this node tells its peers about itself.
    pub fn hello(&self) -> crate::msg::Hello {
        crate::msg::Hello {
            index: self.index,
            region: self.region,
            service: self.service,
        }
    }

    // ---- cache slots -------------------------------------------------------

    pub fn page(&self, slot: u32) -> PageRef<'_> {
        PageRef::new(&self.mem, slot as u64 * PAGE_SIZE as u64)
    }

    pub fn offset_of(slot: u32) -> u64 {
        slot as u64 * PAGE_SIZE as u64
    }

    pub fn take_slot(&self) -> Option<u32> {
        let s = self.slots.lock().pop();
        if s.is_some() {
            self.free_slots.fetch_sub(1, Ordering::Relaxed);
        }
        s
    }

    pub fn free_slot(&self, s: u32) {
        debug_assert!((s as usize) < self.cfg.pages);
        self.slots.lock().push(s);
        self.free_slots.fetch_add(1, Ordering::Relaxed);
    }

    pub fn free_slots(&self) -> usize {
        self.free_slots.load(Ordering::Relaxed)
    }

    /// Asks the page provider for free slots now.
    pub fn wake_provider(&self) {
        let (m, cv) = &self.provider_wake;
        *m.lock() = true;
        cv.notify_one();
        if let Some(w) = self.provider_waker.lock().take() {
            w.wake();
        }
    }

    /// [`ScaleNode::provider_sleep`] for the provider's task under the
    /// simulated cluster: waits in virtual time until woken or `d` passed.
    pub async fn provider_wait(&self, d: Duration) {
        let mut sleep = Box::pin(dmkv_transport::exec::sleep(d));
        std::future::poll_fn(|cx| {
            let (m, _) = &self.provider_wake;
            let mut woken = m.lock();
            if *woken || sleep.as_mut().poll(cx).is_ready() {
                *woken = false;
                return std::task::Poll::Ready(());
            }
            *self.provider_waker.lock() = Some(cx.waker().clone());
            std::task::Poll::Pending
        })
        .await
    }

    /// The page provider sleeps until woken or `d` passed.
    pub fn provider_sleep(&self, d: Duration) {
        let (m, cv) = &self.provider_wake;
        let mut woken = m.lock();
        if !*woken {
            cv.wait_for(&mut woken, d);
        }
        *woken = false;
    }

    // ---- membership and shards ---------------------------------------------

    pub fn set_member(&self, index: u8, m: Member) {
        self.members.write()[index as usize] = Some(m);
    }

    pub fn remove_member(&self, index: u8) {
        self.members.write()[index as usize] = None;
    }

    pub fn member(&self, index: u8) -> Option<Member> {
        self.members.read().get(index as usize).copied().flatten()
    }

    pub fn members(&self) -> Vec<(u8, Member)> {
        self.members
            .read()
            .iter()
            .enumerate()
            .filter_map(|(i, m)| m.map(|m| (i as u8, m)))
            .collect()
    }

    /// Member index of a node id.
    pub fn index_of(&self, node: NodeId) -> Option<u8> {
        self.members
            .read()
            .iter()
            .position(|m| m.is_some_and(|m| m.node == node))
            .map(|i| i as u8)
    }

    pub fn host_of(&self, shard: u8) -> Option<u8> {
        self.hosts.read()[shard as usize]
    }

    pub fn set_host(&self, shard: u8, host: u8) {
        self.hosts.write()[shard as usize] = Some(host);
    }

    /// Every known `(shard, host)`.
    pub fn hosts(&self) -> Vec<(u8, u8)> {
        self.hosts
            .read()
            .iter()
            .enumerate()
            .filter_map(|(s, h)| h.map(|h| (s as u8, h)))
            .collect()
    }

    /// Creates (or adopts) shard `id` with a fresh page file.
    pub fn add_shard(&self, id: u8, next_slot: u64, clock: u64) -> std::io::Result<Arc<Shard>> {
        let path = self
            .cfg
            .data_dir
            .join(format!("shard{id}-on-node{}.pages", self.index));
        let s = Arc::new(Shard {
            id,
            file: PageFile::create(&path, self.id)?,
            next_slot: AtomicU64::new(next_slot),
            clock: AtomicU64::new(clock),
            frozen: AtomicBool::new(false),
            moved_to: Mutex::new(None),
        });
        self.shards.write().insert(id, s.clone());
        Ok(s)
    }

    pub fn remove_shard(&self, id: u8) -> Option<Arc<Shard>> {
        self.shards.write().remove(&id)
    }

    pub fn shard(&self, id: u8) -> Option<Arc<Shard>> {
        self.shards.read().get(&id).cloned()
    }

    pub fn shard_list(&self) -> Vec<(u8, Arc<Shard>)> {
        let mut v: Vec<(u8, Arc<Shard>)> = self
            .shards
            .read()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect();
        v.sort_by_key(|(k, _)| *k);
        v
    }

    /// Whether this node is the directory of `pid` now.
    pub fn directs(&self, pid: Pid) -> bool {
        self.host_of(pid.shard()) == Some(self.index)
            && self.shards.read().contains_key(&pid.shard())
    }

    /// Picks the directory shard of a new page: a member that hosts its own
    /// shard.
    pub fn alloc_target(&self) -> u8 {
        match self.cfg.alloc {
            AllocPolicy::Local => self.index,
            AllocPolicy::RoundRobin => {
                // `members` lists the other nodes; this node takes its turn
                // too while it allocates (not when leaving).
                let mut hosts: Vec<u8> = self
                    .members()
                    .iter()
                    .map(|(i, _)| *i)
                    .filter(|i| self.host_of(*i) == Some(*i))
                    .collect();
                if self.allocates() {
                    hosts.push(self.index);
                    hosts.sort_unstable();
                }
                if hosts.is_empty() {
                    return self.index;
                }
                let n = self.alloc_rr.fetch_add(1, Ordering::Relaxed);
                hosts[(n % hosts.len() as u64) as usize]
            }
        }
    }

    // ---- page transfers ----------------------------------------------------

    /// This thread's endpoint on this node.
    pub fn thread_ep(&self) -> Result<Rc<Endpoint>, KvError> {
        let key = (Arc::as_ptr(&self.fabric) as *const () as usize, self.id);
        THREAD_EPS.with(|m| {
            let mut m = m.borrow_mut();
            if let Some((_, ep)) = m.get(&key) {
                return Ok(ep.clone());
            }
            // Endpoints of fabrics that are gone (earlier deployments).
            m.retain(|_, (fabric, _)| fabric.strong_count() > 0);
            let ep = Rc::new(self.fabric.endpoint(self.id)?);
            m.insert(key, (Arc::downgrade(&self.fabric), ep.clone()));
            Ok(ep)
        })
    }

    /// Writes a page into member `to`'s cache at `offset` (one-sided, §3.5),
    /// or into this node's own cache.
    pub fn deliver(&self, to: u8, offset: u64, bytes: &[u8]) -> Result<(), KvError> {
        if !offset.is_multiple_of(PAGE_SIZE as u64) {
            return Err(corrupt(format!("page offset {offset} is not page-aligned")));
        }
        if to == self.index {
            if offset + PAGE_SIZE as u64 > self.mem.len() as u64 {
                return Err(corrupt("page offset outside the cache"));
            }
            self.mem
                .write(offset, bytes)
                .map_err(|e| corrupt(e.to_string()))?;
            return Ok(());
        }
        let m = self
            .member(to)
            .ok_or_else(|| corrupt(format!("unknown member {to}")))?;
        // Under the simulated cluster the write is posted, not awaited
        // (§3.5: the handler writes pages asynchronously): callers hold the
        // page's entry mutex, and a wait here would have to hold every task
        // and job of the cluster back (`block_on_network`) for the round
        // trip. The page is in place at once and any reply we send to `to`
        // afterwards queues behind it in the NICs (reliable connection).
        if let Some(r) = dmkv_transport::sim::write_posted(self.id, m.region.at(offset), bytes) {
            r?;
            // What the real backends' completer does after the WRITE
            // (`finish_delivery`) follows here (a no-op off a metered core).
            dmkv_transport::sim::work(crate::handler::cost::DELIVERY);
            return Ok(());
        }
        // On the real backends the protocol's deliveries to other nodes
        // are posted to the completer (`submit_delivery`, invariant 22);
        // what reaches this wait is none of them (kept for any other
        // caller). It waits on the network alone.
        let ep = self.thread_ep()?;
        block_on_network(ep.write(m.region.at(offset), bytes))?;
        Ok(())
    }

    /// Whether a handler's page delivery to another node is posted to the
    /// node's completer ([`Self::submit_delivery`], invariant 22) rather
    /// than written where it is decided: on the real backends. Under the
    /// simulated cluster [`Self::deliver`] is already a posted write
    /// (`sim::write_posted`), which the reply queues behind.
    pub fn posts_deliveries(&self) -> bool {
        !dmkv_transport::sim::active()
    }

    /// Hands a page delivery, with the responder that waits for it, to the
    /// node's completer, which posts the WRITE and finishes it
    /// ([`Self::finish_delivery`]) when it completes. Never blocks.
    pub fn submit_delivery(&self, d: crate::ssdio::Delivery, responder: Responder) {
        self.ssd_jobs
            .push_net(crate::ssdio::NetJob::Deliver(d, responder));
    }

    /// The WRITE of a posted delivery, from this thread's endpoint (the
    /// completer's).
    pub async fn write_delivery(&self, d: &crate::ssdio::Delivery) -> Result<(), KvError> {
        let m = self
            .member(d.to)
            .ok_or_else(|| corrupt(format!("unknown member {}", d.to)))?;
        let ep = self.thread_ep()?;
        ep.write(m.region.at(d.offset), &d.bytes)
            .await
            .map_err(KvError::from)
    }

    /// Test hook: the completer's posted verbs of the gate's kinds wait at
    /// `gate` until it is opened (a slow network, without blocking the
    /// completer's thread). `None` removes it. Not used by the engine.
    #[doc(hidden)]
    pub fn set_net_gate(&self, gate: Option<Arc<crate::ssdio::NetGate>>) {
        *self.net_gate.lock() = gate;
    }

    /// The page in `slot` as it leaves for member `to`: for another node the
    /// NIC's DMA read of the frame ([`PageRef::dma_bytes`], no core's lines
    /// under `sim`), for this node a core's copy ([`PageRef::to_bytes`]).
    /// Taken while the frame is latched (exclusively for a move, shared for
    /// a copy) or, for a move of an older copy, while its waiting worker
    /// does not touch it (invariant 4): no store races it. Under `sim` the
    /// bytes are placed by `sim::write_posted` at the same virtual instant
    /// (nothing runs in between), so they are the frame's at the post.
    pub fn frame_bytes(&self, slot: u32, to: u8) -> Vec<u8> {
        if to == self.index {
            self.page(slot).to_bytes()
        } else {
            self.page(slot).dma_bytes()
        }
    }

    /// [`Self::deliver`] of a copy from this node's memory, counted as a page
    /// served from remote memory when it goes to another node.
    pub fn deliver_copy(&self, to: u8, offset: u64, bytes: &[u8]) -> Result<(), KvError> {
        self.deliver(to, offset, bytes)?;
        if to != self.index {
            Counters::add(&self.stats.pages_remote, 1);
        }
        Ok(())
    }

    /// Reads a page of a hosted shard from its SSD.
    pub fn read_ssd(&self, pid: Pid) -> Result<Vec<u8>, KvError> {
        let s = self
            .shard(pid.shard())
            .ok_or_else(|| corrupt(format!("{pid}: shard not here")))?;
        let mut buf = AlignedPage::default();
        s.file
            .read(pid.slot(), &mut buf)
            .map_err(|e| KvError::Exhausted(format!("SSD read of {pid}: {e}")))?;
        Counters::add(&self.stats.pages_ssd, 1);
        Ok(buf.bytes().to_vec())
    }

    /// Drops this node's copy held in frame `fi` (latched exclusively, or
    /// its worker awaiting; mutex held by the caller). `free` returns the
    /// cache slot (an awaiting worker keeps it for the page it fetches).
    pub fn drop_copy(&self, fi: u32, free: bool) {
        let f = self.frames.frame(fi);
        let l = f.local();
        if l.slot != crate::frames::NONE && free {
            self.free_slot(l.slot);
        }
        f.set_local(Local {
            mode: Possession::None,
            slot: if free { crate::frames::NONE } else { l.slot },
            ..l
        });
    }

    /// Removes frame `fi` (latched exclusively, mutex held) if nothing
    /// needs it any more.
    pub fn maybe_remove(&self, fi: u32, m: &mut Meta) {
        let f = self.frames.frame(fi);
        let l = f.local();
        if l.slot == crate::frames::NONE && l.mode == Possession::None && m.unused() {
            m.dir = None;
            self.frames.remove(fi);
        }
    }

    /// After a worker or the provider let go of frame `fi`'s latch (or
    /// changed what it awaits): parked requests may be servable now.
    pub fn released(&self, fi: u32) {
        let f = self.frames.frame(fi);
        // Pairs with the fence in `serve_holder` (loom test
        // `parked_requests_are_never_missed`).
        std::sync::atomic::fence(Ordering::SeqCst);
        if f.local().fresh {
            // A local access to the fetched page is over.
            let _m = f.meta.lock();
            f.set_fresh(false);
        }
        if f.local().parked {
            self.repoll.kick(fi);
        }
    }
}

/// Tries a latch operation a bounded number of times (handlers never wait
/// long: they park the request instead).
pub fn try_latch(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..8 {
        if f() {
            return true;
        }
        std::hint::spin_loop();
    }
    false
}

/// A random member of a non-empty bitmap.
pub fn pick(set: u64) -> u8 {
    use rand::Rng;
    debug_assert!(set != 0);
    let n = set.count_ones();
    let mut k = dmkv_transport::sim::rng().gen_range(0..n);
    for i in 0..64u8 {
        if set & (1 << i) != 0 {
            if k == 0 {
                return i;
            }
            k -= 1;
        }
    }
    unreachable!("a non-empty bitmap has a member")
}

/// Node indices in a bitmap.
pub fn members_of(set: u64) -> impl Iterator<Item = u8> {
    (0..64u8).filter(move |i| set & (1 << i) != 0)
}

impl ScaleNode {
    /// Frames that are latched, awaited, parked on or busy at the directory
    /// (for diagnosing a stuck run).
    pub fn debug_dump(&self) -> String {
        let mut out = String::new();
        for i in 0..self.frames.high_water() {
            let f = self.frames.frame(i);
            let l = f.local();
            let m = f.meta.lock();
            let busy_dir = m.dir.as_ref().is_some_and(|d| {
                d.transfer.is_some() || d.evicting || !d.queue.is_empty() || !d.held.is_empty()
            });
            if f.latch.is_latched()
                || l.waiting
                || l.parked
                || m.awaiting != crate::frames::Awaiting::No
                || busy_dir
                || m.phantom
            {
                out.push_str(&format!(
                    "node {} frame {i} {} latched={} x={} local={l:?} epoch={} awaiting={:?} phantom={} parked={:?} dir={:?}\n",
                    self.index,
                    f.pid(),
                    f.latch.is_latched(),
                    f.latch.is_exclusive(),
                    m.epoch,
                    m.awaiting,
                    m.phantom,
                    m.parked.iter().map(|p| (p.from, p.request)).collect::<Vec<_>>(),
                    m.dir.as_ref().map(|d| (d.owners, d.epoch, d.dirty, d.transfer, d.queue.iter().map(|h| h.from).collect::<Vec<_>>(), d.held.len(), d.evicting))
                ));
            }
        }
        out
    }
}
