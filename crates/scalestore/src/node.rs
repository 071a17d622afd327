//! One ScaleStore node (paper §2.2): its cache (a registered region of page
//! slots), frames and translation table, the directory shards it hosts
//! (page files on its SSD), the membership, and the message handler logic.
//!
//! The directory logic ([`ScaleNode::grant`]) implements §3.3–3.4: the
//! base case, exclusive and shared conflicts, anticipatory chaining with
//! immediate metadata updates (the entry is updated when the request is
//! processed; the requester fetches from its anticipated predecessor), the
//! conflict epoch and owner stability (evictions with a stale epoch are
//! declined), and the FIFO-queue variant. Requesters resolve conflicts
//! themselves (`worker`), as in the paper.

use crate::frames::{Awaiting, Dir, FrameTable, Local, Owners, Possession};
use crate::msg::{self, EvictEntry, Grant, Kind, Reply, Request, Source, Want};
use crate::page::{PAGE_SIZE, PageRef};
use crate::pid::Pid;
use crate::ssd::{AlignedPage, PageFile};
use dmkv_api::KvError;
use dmkv_transport::exec::block_on;
use dmkv_transport::{
    Endpoint, Fabric, NodeId, RegionMem, RemoteRegion, RpcContext, ServiceError, ServiceId,
};
use parking_lot::{Mutex, RwLock};
use rand::Rng;
use std::cell::RefCell;
use std::collections::HashMap;
use std::path::PathBuf;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};

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
    pub alloc: AllocPolicy,
    /// Where page files go.
    pub data_dir: PathBuf,
    /// Free-slot target of the page provider, percent of the cache.
    pub free_percent: usize,
    /// Share of sampled frames under the eviction threshold, percent.
    pub evict_percent: usize,
}

/// A member of the cluster, as seen by this node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Member {
    pub node: NodeId,
    pub region: RemoteRegion,
    pub service: ServiceId,
}

/// A directory shard hosted here: its page file and slot allocator.
pub struct Shard {
    pub file: PageFile,
    pub next_slot: AtomicU64,
    /// Source of conflict epochs: directory entries come and go (an entry
    /// whose page is only on the SSD is dropped), but a page's epochs must
    /// only grow, so they are drawn from one clock per shard.
    pub clock: AtomicU64,
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
    pub sent: [AtomicU64; 16],
    pub busy: AtomicU64,
    pub queued: AtomicU64,
    pub gone: AtomicU64,
    pub fixes: AtomicU64,
    pub hot: AtomicU64,
    pub local_grants: AtomicU64,
    pub pages_remote: AtomicU64,
    pub pages_ssd: AtomicU64,
    pub evictions: AtomicU64,
    pub evict_declined: AtomicU64,
    pub evict_batches: AtomicU64,
    pub restarts: AtomicU64,
    pub retries: AtomicU64,
    pub pulled: AtomicU64,
}

impl Counters {
    pub fn add(c: &AtomicU64, n: u64) {
        c.fetch_add(n, Ordering::Relaxed);
    }
    pub fn sent(&self, k: Kind) {
        Self::add(&self.sent[k as usize], 1);
    }
}

/// One node's state, shared by its workers, handlers and page provider.
pub struct ScaleNode {
    pub index: u8,
    pub id: NodeId,
    pub cfg: NodeConfig,
    pub mem: Arc<RegionMem>,
    pub region: RemoteRegion,
    pub frames: FrameTable,
    slots: Mutex<Vec<u32>>,
    free_slots: AtomicUsize,
    members: RwLock<Vec<Option<Member>>>,
    /// Which member hosts each directory shard.
    hosts: RwLock<Vec<Option<u8>>>,
    shards: RwLock<HashMap<u8, Arc<Shard>>>,
    pub global_epoch: AtomicU64,
    pub stats: Counters,
    pub fabric: Arc<dyn Fabric>,
    alloc_rr: AtomicU64,
    pub stop: AtomicBool,
    /// The default data directory, removed when the node goes away.
    pub tmp: Mutex<Option<tempfile::TempDir>>,
}

fn corrupt(m: impl Into<String>) -> KvError {
    KvError::Corrupt(m.into())
}

thread_local! {
    /// Handler threads' endpoints, by node (handlers get no per-thread state
    /// from the transport, and endpoints must stay on their thread).
    static HANDLER_EPS: RefCell<HashMap<usize, Rc<Endpoint>>> = RefCell::new(HashMap::new());
}

impl ScaleNode {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        index: u8,
        id: NodeId,
        cfg: NodeConfig,
        mem: Arc<RegionMem>,
        region: RemoteRegion,
        fabric: Arc<dyn Fabric>,
    ) -> ScaleNode {
        let pages = cfg.pages;
        ScaleNode {
            index,
            id,
            frames: FrameTable::new(pages * MAX_MEMBERS + 1024, pages * 2),
            slots: Mutex::new((0..pages as u32).rev().collect()),
            free_slots: AtomicUsize::new(pages),
            members: RwLock::new(vec![None; MAX_MEMBERS]),
            hosts: RwLock::new(vec![None; 256]),
            shards: RwLock::new(HashMap::new()),
            global_epoch: AtomicU64::new(1),
            stats: Counters::default(),
            fabric,
            alloc_rr: AtomicU64::new(index as u64),
            stop: AtomicBool::new(false),
            tmp: Mutex::new(None),
            cfg,
            mem,
            region,
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

    // ---- membership and shards ---------------------------------------------

    pub fn set_member(&self, index: u8, m: Member) {
        self.members.write()[index as usize] = Some(m);
        let mut h = self.hosts.write();
        if h[index as usize].is_none() {
            h[index as usize] = Some(index);
        }
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
        self.members()
            .into_iter()
            .find(|(_, m)| m.node == node)
            .map(|(i, _)| i)
    }

    pub fn host_of(&self, shard: u8) -> Option<u8> {
        self.hosts.read()[shard as usize]
    }

    pub fn set_host(&self, shard: u8, host: u8) {
        self.hosts.write()[shard as usize] = Some(host);
    }

    pub fn add_shard(&self, id: u8, next_slot: u64) -> std::io::Result<Arc<Shard>> {
        let path = self
            .cfg
            .data_dir
            .join(format!("shard{id}-on-node{}.pages", self.index));
        let s = Arc::new(Shard {
            file: PageFile::create(&path)?,
            next_slot: AtomicU64::new(next_slot),
            clock: AtomicU64::new(1),
        });
        self.shards.write().insert(id, s.clone());
        self.set_host(id, self.index);
        Ok(s)
    }

    pub fn shard(&self, id: u8) -> Option<Arc<Shard>> {
        self.shards.read().get(&id).cloned()
    }

    pub fn shard_list(&self) -> Vec<(u8, Arc<Shard>)> {
        self.shards
            .read()
            .iter()
            .map(|(k, v)| (*k, v.clone()))
            .collect()
    }

    /// Whether this node is the directory of `pid`.
    pub fn directs(&self, pid: Pid) -> bool {
        self.shards.read().contains_key(&pid.shard())
    }

    /// Checks that `pid` names an allocated page of a shard hosted here.
    fn check_pid(&self, pid: Pid) -> Result<Arc<Shard>, ServiceError> {
        let s = self.shard(pid.shard()).ok_or_else(|| {
            ServiceError::malformed(format!("{pid}: shard not hosted on node {}", self.index))
        })?;
        if pid.slot() >= s.next_slot.load(Ordering::Acquire) {
            return Err(ServiceError::malformed(format!(
                "{pid} was never allocated"
            )));
        }
        Ok(s)
    }

    /// Picks the directory shard of a new page.
    pub fn alloc_target(&self) -> u8 {
        match self.cfg.alloc {
            AllocPolicy::Local => self.index,
            AllocPolicy::RoundRobin => {
                let ms = self.members();
                let hosts: Vec<u8> = ms
                    .iter()
                    .map(|(i, _)| *i)
                    .filter(|i| self.host_of(*i) == Some(*i))
                    .collect();
                if hosts.is_empty() {
                    return self.index;
                }
                let n = self.alloc_rr.fetch_add(1, Ordering::Relaxed);
                hosts[(n % hosts.len() as u64) as usize]
            }
        }
    }

    /// Allocates a page id in a shard hosted here, the directory entry
    /// making `owner` its exclusive (dirty) owner.
    pub fn alloc_here(&self, shard: u8, owner: u8) -> Result<(Pid, u32, u64), KvError> {
        let s = self
            .shard(shard)
            .ok_or_else(|| corrupt(format!("shard {shard} not hosted here")))?;
        let slot = s.next_slot.fetch_add(1, Ordering::AcqRel);
        let pid = Pid::new(shard, slot);
        let fi = self
            .frames
            .find_or_insert(pid)
            .map_err(|_| KvError::Exhausted("the frame table is full".into()))?;
        let f = self.frames.frame(fi);
        let mut m = f.meta.lock();
        m.dir = Some(Dir {
            owners: Owners::Exclusive(owner),
            dirty: true,
            epoch: s.tick(),
            ..Dir::on_ssd()
        });
        Ok((pid, fi, m.dir.as_ref().expect("just set").epoch))
    }

    // ---- sending from handler threads --------------------------------------

    /// The calling handler thread's endpoint.
    fn handler_ep(&self) -> Result<Rc<Endpoint>, KvError> {
        let key = self as *const ScaleNode as usize;
        HANDLER_EPS.with(|m| {
            let mut m = m.borrow_mut();
            if let Some(ep) = m.get(&key).filter(|ep| ep.node() == self.id) {
                return Ok(ep.clone());
            }
            let ep = Rc::new(self.fabric.endpoint(self.id)?);
            m.insert(key, ep.clone());
            Ok(ep)
        })
    }

    /// Writes a page into member `to`'s cache at `offset` (one-sided), or
    /// into this node's own cache.
    fn deliver(&self, to: u8, offset: u64, bytes: &[u8]) -> Result<(), KvError> {
        if !offset.is_multiple_of(PAGE_SIZE as u64) {
            return Err(KvError::Corrupt(format!(
                "page offset {offset} is not page-aligned"
            )));
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
        let ep = self.handler_ep()?;
        block_on(ep.write(m.region.at(offset), bytes))?;
        Ok(())
    }

    fn read_ssd(&self, pid: Pid) -> Result<Vec<u8>, KvError> {
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
    fn drop_copy(&self, fi: u32, free: bool) {
        let f = self.frames.frame(fi);
        let l = f.local();
        if l.slot != crate::frames::NONE && free {
            self.free_slot(l.slot);
        }
        f.set_local(Local {
            mode: Possession::None,
            waiting: false,
            slot: if free { crate::frames::NONE } else { l.slot },
        });
    }

    /// Removes frame `fi` (latched exclusively, mutex held) if nothing
    /// needs it any more.
    pub fn maybe_remove(&self, fi: u32, m: &mut crate::frames::Meta) {
        let f = self.frames.frame(fi);
        if f.local().slot == crate::frames::NONE
            && m.awaiting == Awaiting::No
            && m.dir.as_ref().is_none_or(|d| d.idle())
        {
            m.dir = None;
            self.frames.remove(fi);
        }
    }

    // ---- the directory -----------------------------------------------------

    /// Decides an ownership request for `pid` from member `r` (§3.3–3.4),
    /// updating the entry at once (anticipatory chaining) and writing the
    /// page into the requester's frame at `offset` when the directory can
    /// (its SSD or its own copy).
    pub fn grant(
        &self,
        r: u8,
        pid: Pid,
        want: Want,
        retry: bool,
        offset: u64,
    ) -> Result<Reply, KvError> {
        let fi = match self.frames.find_or_insert(pid) {
            Ok(fi) => fi,
            Err(_) => return Ok(Reply::Busy),
        };
        let f = self.frames.frame(fi);
        let mut m = f.meta.lock();
        if f.pid() != pid {
            return Ok(Reply::Busy);
        }
        let shard = self
            .shard(pid.shard())
            .ok_or_else(|| corrupt(format!("{pid}: shard not here")))?;
        let mut d = m.dir.take().unwrap_or_else(|| Dir {
            epoch: shard.tick(),
            ..Dir::on_ssd()
        });
        let res = self.grant_entry(&shard, fi, &mut d, &mut m, r, pid, want, retry, offset);
        m.dir = Some(d);
        res
    }

    #[allow(clippy::too_many_arguments)]
    fn grant_entry(
        &self,
        shard: &Shard,
        fi: u32,
        d: &mut Dir,
        m: &mut crate::frames::Meta,
        r: u8,
        pid: Pid,
        want: Want,
        retry: bool,
        offset: u64,
    ) -> Result<Reply, KvError> {
        let f = self.frames.frame(fi);
        let me = self.index;
        let local = r == me;
        let fifo = self.cfg.protocol == Protocol::Fifo;
        if d.evicting {
            return Ok(Reply::Busy);
        }
        if fifo {
            if let Some(t) = d.transfer {
                if local || t == r {
                    return Ok(Reply::Busy);
                }
                if !d.queue.contains(&r) {
                    d.queue.push_back(r);
                }
                return Ok(Reply::Queued);
            }
            if !local {
                match d.queue.front() {
                    Some(&h) if h != r => {
                        if !d.queue.contains(&r) {
                            d.queue.push_back(r);
                        }
                        return Ok(Reply::Queued);
                    }
                    Some(_) => {
                        d.queue.pop_front();
                    }
                    None => {}
                }
            }
            // The directory's own workers bypass the queue (§3.4.2).
        }
        if retry {
            if d.owners == Owners::Exclusive(r) {
                return Err(corrupt(format!(
                    "{pid}: retry from its exclusive owner {r}"
                )));
            }
            d.owners = d.owners.without(r);
        }
        let my_local = f.local();
        let my_copy = my_local.mode != Possession::None && my_local.slot != crate::frames::NONE;
        let owners = d.owners;
        let mut invalidate = 0u64;
        let source = match (owners, want) {
            (Owners::None, w) => {
                if d.dirty {
                    return Err(corrupt(format!("{pid} is dirty but nobody holds a copy")));
                }
                let bytes = self.read_ssd(pid)?;
                self.deliver(r, offset, &bytes)?;
                d.prev_dirty = false;
                d.owners = match w {
                    Want::Shared => Owners::Shared(1 << r),
                    Want::Exclusive => {
                        d.dirty = true;
                        Owners::Exclusive(r)
                    }
                };
                Source::Written
            }
            (Owners::Exclusive(n), _) if n == r => Source::Kept,
            (Owners::Exclusive(n), w) => {
                d.epoch = shard.tick();
                d.prev_dirty = d.dirty;
                d.dirty = true;
                if n == me && my_copy && f.latch.try_exclusive() {
                    let bytes = self.page(my_local.slot).to_bytes();
                    if let Err(e) = self.deliver(r, offset, &bytes) {
                        f.latch.unlock_exclusive();
                        return Err(e);
                    }
                    match w {
                        Want::Shared => {
                            d.owners = Owners::Shared(1 << me | 1 << r);
                            f.set_local(Local {
                                mode: Possession::Shared,
                                waiting: false,
                                slot: my_local.slot,
                            });
                            m.epoch = d.epoch;
                        }
                        Want::Exclusive => {
                            d.owners = Owners::Exclusive(r);
                            self.drop_copy(fi, true);
                        }
                    }
                    f.latch.unlock_exclusive();
                    Source::Written
                } else {
                    if n == me {
                        f.set_waiting(true);
                    }
                    d.owners = match w {
                        Want::Shared => Owners::Shared(1 << r),
                        Want::Exclusive => Owners::Exclusive(r),
                    };
                    Source::Move(n)
                }
            }
            (Owners::Shared(set), Want::Shared) => {
                if set & (1 << r) != 0 {
                    Source::Kept
                } else {
                    d.owners = Owners::Shared(set | 1 << r);
                    if set & (1 << me) != 0 && my_copy && f.latch.try_shared() {
                        let bytes = self.page(my_local.slot).to_bytes();
                        f.latch.unlock_shared();
                        self.deliver(r, offset, &bytes)?;
                        Source::Written
                    } else {
                        let mut cands = set;
                        if !my_copy && cands & !(1 << me) != 0 {
                            cands &= !(1 << me);
                        }
                        Source::Copy(pick(cands))
                    }
                }
            }
            (Owners::Shared(set), Want::Exclusive) => {
                let others = set & !(1 << r);
                if others == 0 {
                    d.owners = Owners::Exclusive(r);
                    d.prev_dirty = d.dirty;
                    d.dirty = true;
                    Source::Kept
                } else {
                    d.epoch = shard.tick();
                    d.prev_dirty = d.dirty;
                    d.dirty = true;
                    d.owners = Owners::Exclusive(r);
                    if set & (1 << r) != 0 {
                        invalidate = others;
                        Source::Kept
                    } else if others & (1 << me) != 0 && my_copy && f.latch.try_exclusive() {
                        let bytes = self.page(my_local.slot).to_bytes();
                        let res = self.deliver(r, offset, &bytes);
                        if res.is_ok() {
                            self.drop_copy(fi, true);
                        }
                        f.latch.unlock_exclusive();
                        res?;
                        invalidate = others & !(1 << me);
                        Source::Written
                    } else {
                        let s = pick(others);
                        invalidate = others & !(1 << s);
                        Source::Move(s)
                    }
                }
            }
        };
        let epoch = d.epoch;
        if (invalidate & (1 << me) != 0 || source == Source::Move(me)) && !local {
            // Our workers yield to the coming transfer (§3.4 fairness).
            f.set_waiting(true);
        }
        if fifo && (source != Source::Kept || invalidate != 0) {
            d.transfer = Some(r);
        }
        if local {
            Counters::add(&self.stats.local_grants, 1);
        }
        Ok(Reply::Grant(Grant {
            epoch,
            source,
            invalidate,
        }))
    }

    /// FIFO variant: the transfer to `r` completed.
    pub fn ack(&self, r: u8, pid: Pid) {
        if let Some(fi) = self.frames.find(pid) {
            let f = self.frames.frame(fi);
            let mut m = f.meta.lock();
            if let Some(d) = m
                .dir
                .as_mut()
                .filter(|d| f.pid() == pid && d.transfer == Some(r))
            {
                d.transfer = None;
            }
        }
    }

    /// Serves a move or an invalidation of this node's copy for a grant at
    /// `epoch` (to member `r`).
    fn serve_move(
        &self,
        r: u8,
        pid: Pid,
        epoch: u64,
        need_page: bool,
        offset: u64,
    ) -> Result<Reply, KvError> {
        let Some(fi) = self.frames.find(pid) else {
            return Ok(if need_page { Reply::Gone } else { Reply::Done });
        };
        let f = self.frames.frame(fi);
        let mut m = f.meta.lock();
        if f.pid() != pid {
            return Ok(if need_page { Reply::Gone } else { Reply::Done });
        }
        let l = f.local();
        match m.awaiting {
            Awaiting::Known(g) if g > epoch => {
                // Deadlock avoidance (§3.4.3): our own pending grant is newer,
                // so this request concerns the copy we held before it. Our
                // worker waits for the network and does not touch the page.
                if l.mode == Possession::None {
                    return Ok(if need_page { Reply::Gone } else { Reply::Done });
                }
                if need_page {
                    let bytes = self.page(l.slot).to_bytes();
                    self.deliver(r, offset, &bytes)?;
                }
                self.drop_copy(fi, false);
                return Ok(Reply::Done);
            }
            Awaiting::Known(_) | Awaiting::Unknown => {
                f.set_waiting(true);
                return Ok(Reply::Busy);
            }
            Awaiting::No => {}
        }
        if l.mode != Possession::None && epoch < m.epoch {
            // A late request for a grant older than our current possession:
            // the copy it concerned is long gone (we obtained this one after).
            return Ok(if need_page { Reply::Gone } else { Reply::Done });
        }
        if !try_latch(|| f.latch.try_exclusive()) {
            f.set_waiting(true);
            return Ok(Reply::Busy);
        }
        let l = f.local();
        if l.mode == Possession::None {
            f.set_waiting(false);
            f.latch.unlock_exclusive();
            return Ok(if need_page { Reply::Gone } else { Reply::Done });
        }
        if need_page {
            let bytes = self.page(l.slot).to_bytes();
            if let Err(e) = self.deliver(r, offset, &bytes) {
                f.latch.unlock_exclusive();
                return Err(e);
            }
        }
        self.drop_copy(fi, true);
        self.maybe_remove(fi, &mut m);
        f.latch.unlock_exclusive();
        Ok(Reply::Done)
    }

    /// Serves a copy of this node's shared page.
    fn serve_copy(&self, r: u8, pid: Pid, epoch: u64, offset: u64) -> Result<Reply, KvError> {
        let Some(fi) = self.frames.find(pid) else {
            return Ok(Reply::Gone);
        };
        let f = self.frames.frame(fi);
        let m = f.meta.lock();
        if f.pid() != pid {
            return Ok(Reply::Gone);
        }
        let l = f.local();
        if l.mode == Possession::None {
            return Ok(Reply::Gone);
        }
        match m.awaiting {
            Awaiting::Known(g) if g > epoch => {
                // Our newer grant (an upgrade) has not changed the page yet.
                let bytes = self.page(l.slot).to_bytes();
                self.deliver(r, offset, &bytes)?;
                return Ok(Reply::Done);
            }
            Awaiting::Known(_) | Awaiting::Unknown => return Ok(Reply::Gone),
            Awaiting::No => {}
        }
        if !try_latch(|| f.latch.try_shared()) {
            return Ok(Reply::Busy);
        }
        let bytes = self.page(l.slot).to_bytes();
        f.latch.unlock_shared();
        self.deliver(r, offset, &bytes)?;
        Ok(Reply::Done)
    }

    /// Serves an SSD fetch: every listed copy was gone, so the SSD copy is
    /// current (checked: nothing was dirty before the grant).
    fn serve_ssd_fetch(&self, r: u8, pid: Pid, epoch: u64, offset: u64) -> Result<Reply, KvError> {
        let fi = self
            .frames
            .find(pid)
            .ok_or_else(|| corrupt(format!("{pid}: SSD fetch without an entry")))?;
        let f = self.frames.frame(fi);
        let m = f.meta.lock();
        let ok = m
            .dir
            .as_ref()
            .is_some_and(|d| d.owners == Owners::Exclusive(r) && d.epoch == epoch && !d.prev_dirty);
        if !ok {
            return Err(corrupt(format!(
                "{pid}: SSD fetch by {r} at epoch {epoch} does not match the entry"
            )));
        }
        let bytes = self.read_ssd(pid)?;
        self.deliver(r, offset, &bytes)?;
        Ok(Reply::Done)
    }

    /// [`Self::serve_ssd_fetch`] for this node's own worker.
    pub fn ssd_fetch_local(&self, pid: Pid, epoch: u64, offset: u64) -> Result<Reply, KvError> {
        self.serve_ssd_fetch(self.index, pid, epoch, offset)
    }

    /// The message handler (§3.5): one protocol message from `ctx.caller`.
    pub fn handle(&self, ctx: &RpcContext, req: &[u8]) -> Result<Vec<u8>, ServiceError> {
        let r = self
            .index_of(ctx.caller)
            .ok_or_else(|| ServiceError::failed(format!("{} is not a member", ctx.caller)))?;
        if req.first() == Some(&(Kind::Evict as u8)) {
            let entries = msg::decode_evict(req)?;
            return self
                .handle_evict(r, &entries)
                .map_err(|e| ServiceError::failed(e.to_string()));
        }
        let q = Request::decode(req)?;
        let check_offset = |o: u64| -> Result<(), ServiceError> {
            if !o.is_multiple_of(PAGE_SIZE as u64) {
                return Err(ServiceError::malformed(format!(
                    "page offset {o} is not page-aligned"
                )));
            }
            Ok(())
        };
        let reply = match q {
            Request::Own {
                pid,
                want,
                retry,
                offset,
            } => {
                check_offset(offset)?;
                if !self.directs(pid) {
                    match self.host_of(pid.shard()) {
                        Some(h) if h != self.index => return Ok(Reply::Moved(h).encode()),
                        _ => {}
                    }
                }
                self.check_pid(pid)?;
                self.grant(r, pid, want, retry, offset)
            }
            Request::Move {
                pid,
                epoch,
                need_page,
                offset,
            } => {
                check_offset(offset)?;
                self.serve_move(r, pid, epoch, need_page, offset)
            }
            Request::Copy { pid, epoch, offset } => {
                check_offset(offset)?;
                self.serve_copy(r, pid, epoch, offset)
            }
            Request::SsdFetch { pid, epoch, offset } => {
                check_offset(offset)?;
                self.check_pid(pid)?;
                self.serve_ssd_fetch(r, pid, epoch, offset)
            }
            Request::Ack { pid } => {
                self.check_pid(pid)?;
                self.ack(r, pid);
                Ok(Reply::Done)
            }
            Request::Alloc => self
                .alloc_here(self.index, r)
                .map(|(p, _, e)| Reply::Allocated(p, e)),
            Request::Stats => return Ok(self.stats_bytes()),
        };
        reply.map(|r| r.encode()).map_err(|e| match e {
            KvError::Exhausted(m) => ServiceError::exhausted(m),
            e => ServiceError::failed(e.to_string()),
        })
    }

    /// An eviction batch from member `from` (§4.2–4.3): accepts a page iff
    /// `from` still owns it at the epoch it sent (owner stability); dirty
    /// pages whose last copy goes are pulled by one batched one-sided read
    /// into this node's cache (or written straight to the SSD if the cache
    /// is full).
    fn handle_evict(&self, from: u8, entries: &[EvictEntry]) -> Result<Vec<u8>, KvError> {
        let mut accepted = vec![false; entries.len()];
        let mut pulls: Vec<(usize, u32)> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            if self.check_pid(e.pid).is_err() || !e.offset.is_multiple_of(PAGE_SIZE as u64) {
                continue;
            }
            let Some(fi) = self.frames.find(e.pid) else {
                continue;
            };
            let f = self.frames.frame(fi);
            let mut m = f.meta.lock();
            if f.pid() != e.pid {
                continue;
            }
            let Some(d) = m.dir.as_mut() else { continue };
            if d.epoch != e.epoch || d.transfer.is_some() || d.evicting || !d.owners.contains(from)
            {
                Counters::add(&self.stats.evict_declined, 1);
                continue;
            }
            let last = d.owners.without(from) == Owners::None;
            if last && d.dirty {
                d.evicting = true;
                pulls.push((i, fi));
            } else {
                d.owners = d.owners.without(from);
                accepted[i] = true;
                if d.idle()
                    && f.local().mode == Possession::None
                    && m.awaiting == Awaiting::No
                    && !f.latch.is_latched()
                    && f.latch.try_exclusive()
                {
                    m.dir = None;
                    self.frames.remove(fi);
                    f.latch.unlock_exclusive();
                }
            }
        }
        if !pulls.is_empty() {
            let m = self
                .member(from)
                .ok_or_else(|| corrupt(format!("unknown member {from}")))?;
            let ep = self.handler_ep()?;
            let mut b = ep.batch();
            for (i, _) in &pulls {
                b.read(m.region.at(entries[*i].offset), PAGE_SIZE);
            }
            let mut res = block_on(b.run());
            for (k, (i, fi)) in pulls.iter().enumerate() {
                let f = self.frames.frame(*fi);
                let mut meta = f.meta.lock();
                let bytes = match res.as_mut() {
                    Ok(r) => r.take_read(k),
                    Err(_) => {
                        meta.dir.as_mut().expect("entry").evicting = false;
                        continue;
                    }
                };
                Counters::add(&self.stats.pulled, 1);
                let slot = if f.local().slot == crate::frames::NONE {
                    self.take_slot()
                } else {
                    None
                };
                let d = meta.dir.as_mut().expect("entry");
                d.evicting = false;
                match slot {
                    Some(s) => {
                        self.page(s).fill(&bytes);
                        d.owners = Owners::Exclusive(self.index);
                        let epoch = d.epoch;
                        meta.epoch = epoch;
                        f.touch(self.global_epoch.load(Ordering::Relaxed));
                        f.set_local(Local {
                            mode: Possession::Exclusive,
                            waiting: false,
                            slot: s,
                        });
                    }
                    None => {
                        let shard = self.shard(entries[*i].pid.shard()).expect("checked");
                        let mut page = AlignedPage::default();
                        page.bytes_mut().copy_from_slice(&bytes);
                        shard
                            .file
                            .write_batch(&[(entries[*i].pid.slot(), &page)])
                            .map_err(|e| KvError::Exhausted(format!("SSD write: {e}")))?;
                        d.owners = Owners::None;
                        d.dirty = false;
                    }
                }
                accepted[*i] = true;
            }
        }
        let mut out = Vec::with_capacity(entries.len());
        for a in accepted {
            out.push(a as u8);
        }
        Ok(out)
    }

    /// This node's figures, encoded for the Stats message.
    pub fn stats_bytes(&self) -> Vec<u8> {
        let mut w = dmkv_transport::WireWriter::new();
        let s = &self.stats;
        for c in &s.sent {
            w.u64(c.load(Ordering::Relaxed));
        }
        for c in [
            &s.busy,
            &s.queued,
            &s.gone,
            &s.fixes,
            &s.hot,
            &s.local_grants,
            &s.pages_remote,
            &s.pages_ssd,
            &s.evictions,
            &s.evict_declined,
            &s.evict_batches,
            &s.restarts,
            &s.retries,
            &s.pulled,
        ] {
            w.u64(c.load(Ordering::Relaxed));
        }
        let (mut reads, mut writes, mut direct, mut uring) = (0, 0, true, true);
        for (_, sh) in self.shard_list() {
            reads += sh.file.reads();
            writes += sh.file.writes();
            direct &= sh.file.direct();
            uring &= sh.file.uring();
        }
        w.u64(reads).u64(writes).bool(direct).bool(uring);
        w.u64(self.cfg.pages as u64).u64(self.free_slots() as u64);
        w.u64(self.global_epoch.load(Ordering::Relaxed));
        w.finish()
    }
}

/// Tries a latch operation a bounded number of times (handlers never wait
/// long: they answer "busy" instead).
fn try_latch(mut f: impl FnMut() -> bool) -> bool {
    for i in 0..64 {
        if f() {
            return true;
        }
        if i > 8 {
            std::thread::yield_now();
        } else {
            std::hint::spin_loop();
        }
    }
    false
}

/// A random member of a non-empty bitmap.
fn pick(set: u64) -> u8 {
    debug_assert!(set != 0);
    let n = set.count_ones();
    let mut k = rand::thread_rng().gen_range(0..n);
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

impl ScaleNode {
    /// Frames that are latched, awaited or waited for (for diagnosing hangs).
    pub fn debug_dump(&self) -> String {
        let mut out = String::new();
        for i in 0..self.frames.high_water() {
            let f = self.frames.frame(i);
            let l = f.local();
            let m = f.meta.lock();
            if f.latch.is_latched()
                || l.waiting
                || m.awaiting != Awaiting::No
                || m.dir
                    .as_ref()
                    .is_some_and(|d| d.transfer.is_some() || d.evicting)
            {
                out.push_str(&format!(
                    "node {} frame {i} {} latched={} x={} local={l:?} meta.epoch={} awaiting={:?} dir={:?}\n",
                    self.index,
                    f.pid(),
                    f.latch.is_latched(),
                    f.latch.is_exclusive(),
                    m.epoch,
                    m.awaiting,
                    m.dir.as_ref().map(|d| (d.owners, d.epoch, d.dirty))
                ));
            }
        }
        out
    }
}
