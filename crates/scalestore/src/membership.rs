//! Membership (§6.6): how nodes learn each other, join at run time, and
//! leave, handing over their pages and directory entries.
//!
//! - **Introduction** (at connect, and when a node joins): a node finds a
//!   peer's message service and cache region through the peer's transport
//!   directory (by name, by message), then sends it a `Hello` with its own;
//!   the peer records it (checking that the transport's caller id is the
//!   node it claims to be) and answers with the members and shard hosts it
//!   knows, which the newcomer introduces itself to in turn.
//! - **Leaving** (node L, successor S):
//!   1. L becomes `Leaving` only if `Active` and adopting nothing, under
//!      the lock under which a node accepts an `Adopt`: an `Adopt` reaching
//!      a node that is not `Active` is refused (`Retry`), and a node that
//!      accepted one may not start leaving until the leaver's `Depart`
//!      reached it (invariant 13 in `docs/scalestore.md`; otherwise a node
//!      could adopt a shard after it listed its own, and carry it away).
//!      L stops issuing (its workers' operations drain; new ones go
//!      through another member);
//!   2. L evicts every page of other directories it caches, round after
//!      round: a declined eviction means a move or copy for it is coming
//!      (owner stability), which L's handler serves;
//!   3. L freezes its shards (requests for their pages are answered
//!      "retry", never held: see below; evictions declined), answers
//!      "retry" to what their entries hold, waits for transfers and pulls
//!      in flight, and drops its own copies of their pages (dirty sole
//!      copies to its SSD first);
//!   4. S is the first other member (lowest index first) that accepts
//!      the first shard's `Adopt`; if none does (all leaving), L unfreezes
//!      its shards and is `Active` again, and the leave fails;
//!      per shard: `Adopt` (S creates the page file), `HandoverPages`
//!      (every written slot of L's file), `HandoverEntries` (every
//!      directory entry: owners, conflict epoch, dirty flags, pending copy
//!      grants), `HostShard` (S serves the shard from now on); requests
//!      that still reach L are answered "moved to S";
//!   5. `Depart` to every member, S last (S may leave once it has it, and
//!      its own `Depart` must not reach a member before L's): they note the
//!      new host (before they forget L), forget L, and scrub L from their
//!      directory entries (it holds nothing by now).
//!
//! Why "retry" and not hold: step 3 waits for transfers in flight, and a
//! transfer can wait for a requester of *another* page of the frozen shard
//! to let go of a latch (a FIFO grant's invalidation parked on a page the
//! requester fetched for an optimistic read, while it asks for the child).
//! Holding that requester's request until the handover is done closes the
//! cycle (the run stalls until the transport's timeout); "retry" makes it
//! restart its operation, which lets go of every latch.
//!
//! A worker whose directory or allocation target turns out to be no
//! member any more (it read the host before a `Depart` and the member
//! after) reads the host again: `Depart` records the new host first.

use crate::frames::{Dir, Owners, Possession};
use crate::msg::{
    self, Depart, EntryState, HANDOVER_ENTRIES, HANDOVER_PAGES, Hello, Kind, Reply, Request,
    Welcome, WireOwners,
};
use crate::node::{Member, NodeState, ScaleNode, corrupt};
use crate::pid::Pid;
use crate::ssd::AlignedPage;
use dmkv_api::KvError;
use dmkv_transport::exec::{block_on, sleep_until};
use dmkv_transport::time::Instant;
use dmkv_transport::{Endpoint, NodeId, Responder, ServiceError};
use std::collections::{HashSet, VecDeque};
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Names under which a node publishes its service and region.
pub fn service_name(instance: &str) -> String {
    format!("{instance}/msg")
}
pub fn region_name(instance: &str) -> String {
    format!("{instance}/cache")
}

fn to_wire(o: Owners) -> WireOwners {
    match o {
        Owners::None => WireOwners::None,
        Owners::Exclusive(n) => WireOwners::Exclusive(n),
        Owners::Shared(s) => WireOwners::Shared(s),
    }
}

fn from_wire(o: WireOwners) -> Owners {
    match o {
        WireOwners::None => Owners::None,
        WireOwners::Exclusive(n) => Owners::Exclusive(n),
        WireOwners::Shared(s) => Owners::Shared(s),
    }
}

impl ScaleNode {
    // ---- handlers ----------------------------------------------------------

    /// A node introduces itself.
    pub fn handle_hello(&self, caller: NodeId, h: Hello) -> Result<Vec<u8>, ServiceError> {
        if h.region.node != caller {
            return Err(ServiceError::malformed(format!(
                "{caller} offers a region of {}",
                h.region.node
            )));
        }
        if h.index as usize >= crate::node::MAX_MEMBERS || h.index == self.index {
            return Err(ServiceError::malformed(format!("member index {}", h.index)));
        }
        if self.state() == NodeState::Left {
            return Err(ServiceError::failed("this node left the cluster"));
        }
        match (self.member(h.index), self.index_of(caller)) {
            (Some(m), _) if m.node != caller => {
                return Err(ServiceError::failed(format!(
                    "member {} is {}, not {caller}",
                    h.index, m.node
                )));
            }
            (_, Some(i)) if i != h.index => {
                return Err(ServiceError::failed(format!(
                    "{caller} is member {i}, not {}",
                    h.index
                )));
            }
            (None, None) if self.host_of(h.index).is_some_and(|x| x != h.index) => {
                return Err(ServiceError::failed(format!(
                    "index {} belonged to a node that left",
                    h.index
                )));
            }
            _ => {}
        }
        self.set_member(
            h.index,
            Member {
                node: caller,
                region: h.region,
                service: h.service,
            },
        );
        if self.host_of(h.index).is_none() {
            // A new node hosts its own shard.
            self.set_host(h.index, h.index);
        }
        let mut members: Vec<(u8, NodeId)> = self
            .members()
            .into_iter()
            .map(|(i, m)| (i, m.node))
            .collect();
        members.push((self.index, self.id));
        Ok(Welcome {
            members,
            hosts: self.hosts(),
        }
        .encode())
    }

    /// The leaving host of `shard` asks us to adopt it. Refused
    /// (`Ok(false)`, answered `Retry`) unless this node is `Active`, under
    /// the lock that makes it `Leaving` (invariant 13): a node that is
    /// leaving has listed its shards already and would not hand this one
    /// on. Once accepted, this node cannot start leaving until `from`
    /// departed.
    pub fn handle_adopt(
        &self,
        from: u8,
        shard: u8,
        next_slot: u64,
        clock: u64,
    ) -> Result<bool, KvError> {
        if self.host_of(shard) != Some(from) || self.shard(shard).is_some() {
            return Err(corrupt(format!(
                "node {from} cannot hand over shard {shard}"
            )));
        }
        if next_slot > crate::pid::SLOT_MASK {
            return Err(corrupt(format!("next slot {next_slot}")));
        }
        self.accept_adoption(from, || {
            let s = self
                .add_shard(shard, next_slot, clock)
                .map_err(|e| KvError::Exhausted(format!("page file for shard {shard}: {e}")))?;
            // Not served until `HostShard`.
            s.frozen.store(true, Ordering::SeqCst);
            Ok(())
        })
    }

    fn adopting(&self, from: u8, shard: u8) -> Result<std::sync::Arc<crate::node::Shard>, KvError> {
        match self.shard(shard) {
            Some(s) if s.frozen.load(Ordering::SeqCst) && self.host_of(shard) == Some(from) => {
                Ok(s)
            }
            _ => Err(corrupt(format!(
                "node {from} hands over shard {shard}, which is not being adopted from it"
            ))),
        }
    }

    /// A batch of the leaver's page file: checked here, written by the
    /// SSD completer (`ssdio`), which answers "done" once the pages are on
    /// the SSD (the leaver awaits that before it sends the entries), so
    /// this handler does not wait for the device.
    pub fn handle_pages(
        &self,
        from: u8,
        shard: u8,
        pages: &[(u64, Vec<u8>)],
        responder: Responder,
    ) -> Result<(), (Responder, KvError)> {
        let s = match self.adopting(from, shard) {
            Ok(s) => s,
            Err(e) => return Err((responder, e)),
        };
        let next = s.next_slot.load(Ordering::Acquire);
        let mut bufs = Vec::with_capacity(pages.len());
        for (slot, bytes) in pages {
            if *slot >= next {
                return Err((responder, corrupt(format!("slot {slot} beyond {next}"))));
            }
            let mut p = AlignedPage::default();
            p.bytes_mut().copy_from_slice(bytes);
            bufs.push((*slot, p));
        }
        self.ssd_jobs.push(crate::ssdio::Job::new(
            s,
            crate::ssdio::Work::Write { pages: bufs },
            responder,
        ));
        Ok(())
    }

    pub fn handle_entries(
        &self,
        from: u8,
        shard: u8,
        entries: &[EntryState],
    ) -> Result<(), KvError> {
        let s = self.adopting(from, shard)?;
        let next = s.next_slot.load(Ordering::Acquire);
        for e in entries {
            if e.pid.shard() != shard || e.pid.slot() >= next {
                return Err(corrupt(format!("entry {} in shard {shard}", e.pid)));
            }
            let owners = from_wire(e.owners);
            if owners.bitmap() & (1 << from) != 0 {
                return Err(corrupt(format!(
                    "{}: the leaving node still owns it",
                    e.pid
                )));
            }
            // Under the mutex of a frame checked to be the page's: a
            // worker of ours that was told "retry" for this page may be
            // removing the frame we would find (invariant 12).
            let (_, mut m) = self
                .frames
                .lock_or_insert(e.pid)
                .map_err(|_| KvError::Exhausted("the frame table is full".into()))?;
            let mut d = Dir::new(e.epoch);
            d.owners = owners;
            d.dirty = e.dirty;
            d.prev_dirty = e.prev_dirty;
            d.copy_grants = e.copy_grants.clone();
            m.dir = Some(Box::new(d));
        }
        Ok(())
    }

    pub fn handle_host_shard(&self, from: u8, shard: u8) -> Result<(), KvError> {
        let s = self.adopting(from, shard)?;
        self.set_host(shard, self.index);
        // Anything that reached us early was told to retry.
        s.frozen.store(false, Ordering::SeqCst);
        Ok(())
    }

    /// A member left: note where its shards went, forget it, scrub it from
    /// our directory entries.
    pub fn handle_depart(&self, from: u8, d: &Depart) -> Result<(), KvError> {
        if d.index != from {
            return Err(corrupt(format!(
                "node {from} announces the departure of {}",
                d.index
            )));
        }
        for &(shard, host) in &d.moved {
            if self.member(host).is_none() && host != self.index {
                return Err(corrupt(format!(
                    "shard {shard} moved to unknown node {host}"
                )));
            }
            self.set_host(shard, host);
        }
        self.remove_member(from);
        // Its handover to us (if it chose us) is complete: we may leave.
        self.adoption_done(from);
        let mut lost = Vec::new();
        for fi in 0..self.frames.high_water() {
            let f = self.frames.frame(fi);
            let mut m = f.meta.lock();
            if let Some(dir) = m.dir.as_mut() {
                if dir.owners.contains(from) {
                    // It evicted everything before leaving, so this is a
                    // phantom listing; a dirty page it held alone would be
                    // lost, which we report.
                    if dir.dirty && dir.owners.without(from) == Owners::None {
                        lost.push(f.pid());
                    }
                    dir.owners = dir.owners.without(from);
                }
                dir.forget_copies(from);
                if dir.transfer == Some(from) {
                    dir.transfer = None;
                    self.repoll.kick(fi);
                }
            }
        }
        if !lost.is_empty() {
            return Err(corrupt(format!(
                "node {from} left holding the only copy of dirty pages {lost:?}"
            )));
        }
        Ok(())
    }

    // ---- procedures -------------------------------------------------------
    //
    // Asynchronous: every RPC, SSD wait and pause of a join or leave is an
    // await. On the real backends one runs on a thread of its own
    // (`block_on`); on the simulated cluster it is a task of the
    // simulation (`exec::spawn_background_local`), so overlapping leaves
    // interleave in virtual time. A synchronous wait there would be a
    // nested frame of the one-thread scheduler: a leave started during
    // another's wait would run inside it, and the outer leave could not go
    // on until the inner one ended, while the inner one waited for the
    // outer (the hang of `scalestore.leave=0@1500,2@1600`, seed 100). No
    // lock guard is held across an await.

    /// Learns `peers` through their transport directories and introduces
    /// this node to them and to every member they know (see the module
    /// documentation).
    pub async fn introduce(
        &self,
        ep: &Endpoint,
        instance: &str,
        peers: &[(u8, NodeId)],
    ) -> Result<(), KvError> {
        let mut queue: VecDeque<(u8, NodeId)> = peers.iter().copied().collect();
        let mut seen: HashSet<u8> = HashSet::new();
        while let Some((i, node)) = queue.pop_front() {
            if i == self.index || !seen.insert(i) {
                continue;
            }
            let service = ep.lookup_service(node, &service_name(instance)).await?;
            let region = ep.lookup_region(node, &region_name(instance)).await?;
            // Recorded before the hello: the peer may message us as soon
            // as it has recorded us, before its welcome reaches us.
            let known = self.member(i).is_some();
            self.set_member(
                i,
                Member {
                    node,
                    region,
                    service,
                },
            );
            self.stats.sent(Kind::Hello);
            let reply = ep
                .call(node, service, Request::Hello(self.hello()).encode())
                .await;
            let welcome = match reply {
                Ok(bytes) => Welcome::decode(&bytes).map_err(|e| corrupt(e.to_string()))?,
                // A node that left (or never joined) is no member: skip it.
                Err(_) => {
                    if !known {
                        self.remove_member(i);
                    }
                    continue;
                }
            };
            for (idx, n) in welcome.members {
                if !seen.contains(&idx) {
                    queue.push_back((idx, n));
                }
            }
            for (s, h) in welcome.hosts {
                if s != self.index {
                    self.set_host(s, h);
                }
            }
        }
        self.set_host(self.index, self.index);
        Ok(())
    }

    /// Joins the cluster at run time (a dormant node), blocking this
    /// thread; see [`Self::join_async`].
    pub fn join(&self, instance: &str, peers: &[(u8, NodeId)]) -> Result<(), KvError> {
        block_on(self.join_async(instance, peers))
    }

    /// Joins the cluster at run time (a dormant node).
    pub async fn join_async(&self, instance: &str, peers: &[(u8, NodeId)]) -> Result<(), KvError> {
        let ep = self.thread_ep()?;
        self.introduce(&ep, instance, peers).await?;
        self.set_state(NodeState::Active);
        Ok(())
    }

    /// Leaves the cluster at run time, handing every shard to the
    /// lowest-indexed other member that accepts them; returns it. A leave
    /// that fails before its departure went out (no other member accepts:
    /// they are all leaving, or this is the last member) makes the node
    /// serve its remaining shards again (`Active`), so nothing is lost.
    /// Blocks this thread (a node process's leave); see
    /// [`Self::leave_async`].
    pub fn leave(&self) -> Result<u8, KvError> {
        block_on(self.leave_async())
    }

    /// [`Self::leave`] as a future (module documentation, steps 1 to 5).
    pub async fn leave_async(&self) -> Result<u8, KvError> {
        let ep = self.thread_ep()?;
        if !self.members().iter().any(|(i, _)| *i != self.index) {
            return Err(KvError::Config(format!(
                "node {} is the last member: it cannot leave (it holds the only copy of the data)",
                self.index
            )));
        }
        self.begin_leave().await?;
        let r = self.hand_everything_over(&ep).await;
        match r {
            Ok(succ) => {
                self.set_state(NodeState::Left);
                Ok(succ)
            }
            Err(Failed::Before(e)) => {
                // Serve again what we still host (shards handed over
                // already stay with their successor; we answer "moved").
                for (id, s) in self.shard_list() {
                    if self.host_of(id) == Some(self.index) {
                        s.frozen.store(false, Ordering::SeqCst);
                    }
                }
                self.set_state(NodeState::Active);
                Err(e)
            }
            Err(Failed::Departing(e)) => Err(e),
        }
    }

    /// `Active` to `Leaving` (invariant 13), waiting (bounded) for the
    /// handovers of leavers whose shards we accepted to adopt: until such a
    /// leaver departed, leaving would carry its shard away.
    async fn begin_leave(&self) -> Result<(), KvError> {
        const WAIT: Duration = Duration::from_secs(30);
        const STEP: Duration = Duration::from_millis(1);
        let mut waited = Duration::ZERO;
        loop {
            match self.try_begin_leave() {
                Ok(()) => return Ok(()),
                Err(None) => {
                    return Err(KvError::Config(format!(
                        "node {} is not an active member ({:?}): it cannot leave",
                        self.index,
                        self.state()
                    )));
                }
                Err(Some(from)) if waited >= WAIT => {
                    return Err(KvError::Config(format!(
                        "node {} still adopts shards of leaving node(s) {from:?} after {WAIT:?}; try again later",
                        self.index
                    )));
                }
                Err(Some(_)) => {
                    waited += pause(STEP).await;
                }
            }
        }
    }

    /// Steps 1 to 5 of leaving (module documentation) for a `Leaving` node.
    async fn hand_everything_over(&self, ep: &Endpoint) -> Result<u8, Failed> {
        while self.inflight.load(Ordering::SeqCst) > 0 {
            pause(Duration::from_micros(200)).await;
        }
        // 2. Other directories' pages.
        loop {
            let left = self.evict_all_remote(ep).await.map_err(Failed::Before)?;
            if left == 0 {
                break;
            }
            pause(Duration::from_millis(1)).await;
        }
        // 3. Freeze our shards and let go of our own copies. (Only shards
        // we host: one a failed handover left half-adopted here is not
        // ours to hand on.) No shard is added from now on: `Adopt` is
        // refused while we are `Leaving` (invariant 13).
        let shards: Vec<_> = self
            .shard_list()
            .into_iter()
            .filter(|(id, _)| self.host_of(*id) == Some(self.index))
            .collect();
        for (_, s) in &shards {
            s.frozen.store(true, Ordering::SeqCst);
        }
        loop {
            let (busy, written) = self.drop_own_copies().map_err(Failed::Before)?;
            // The modelled SSD time of the dirty pages written under their
            // entries' mutexes, waited for now that none is held.
            if let Some(due) = written {
                sleep_until(due).await;
            }
            if busy == 0 {
                break;
            }
            pause(Duration::from_millis(1)).await;
        }
        // 4. Hand each shard over. The successor is the first other member
        // (lowest index first) that accepts our first shard; having
        // accepted, it cannot start leaving before our departure reached
        // it, so it accepts the others too.
        let mut succ = None;
        let mut moved = Vec::new();
        for (id, s) in &shards {
            let to = match succ {
                Some(to) => {
                    if !self
                        .adopt_call(ep, *id, s, to)
                        .await
                        .map_err(Failed::Before)?
                    {
                        return Err(Failed::Before(corrupt(format!(
                            "node {to} accepted our shards, then refused shard {id}"
                        ))));
                    }
                    to
                }
                None => {
                    let to = self
                        .find_successor(ep, *id, s)
                        .await
                        .map_err(Failed::Before)?;
                    succ = Some(to);
                    to
                }
            };
            self.hand_over(ep, *id, s, to)
                .await
                .map_err(Failed::Before)?;
            moved.push((*id, to));
        }
        let succ = match succ {
            Some(s) => s,
            // Nothing to hand over: name the lowest other member.
            None => self
                .members()
                .into_iter()
                .map(|(i, _)| i)
                .find(|&i| i != self.index)
                .ok_or_else(|| Failed::Before(KvError::Config("no other member".into())))?,
        };
        // 5. Tell everybody, the successor last: once it has our departure
        // it may leave itself, and its own departure must not reach a
        // member before ours (which names it as a host).
        let depart = Depart {
            index: self.index,
            moved,
        }
        .encode();
        let mut members = self.members();
        members.sort_by_key(|(i, _)| *i == succ);
        for (i, m) in members {
            self.stats.sent(Kind::Depart);
            if let Err(e) = ep.call(m.node, m.service, depart.clone()).await {
                // A member that departed meanwhile needs no word from us.
                if self.member(i).is_some() {
                    return Err(Failed::Departing(corrupt(format!("departure to {i}: {e}"))));
                }
            }
        }
        Ok(succ)
    }

    /// Asks the other members, lowest index first, to adopt shard `id`;
    /// returns the first that accepts.
    async fn find_successor(
        &self,
        ep: &Endpoint,
        id: u8,
        s: &crate::node::Shard,
    ) -> Result<u8, KvError> {
        let mut refused = Vec::new();
        for (i, _) in self.members() {
            if i == self.index {
                continue;
            }
            match self.adopt_call(ep, id, s, i).await {
                Ok(true) => return Ok(i),
                Ok(false) => refused.push(format!("node {i} is not active")),
                // Gone, or left meanwhile: ask the next.
                Err(e) => refused.push(format!("node {i}: {e}")),
            }
        }
        Err(KvError::Config(format!(
            "node {}: no other member can adopt shard {id} now ({})",
            self.index,
            refused.join("; ")
        )))
    }

    /// `Adopt` for shard `id` to `to`: `Ok(false)` if refused (invariant
    /// 13).
    async fn adopt_call(
        &self,
        ep: &Endpoint,
        id: u8,
        s: &crate::node::Shard,
        to: u8,
    ) -> Result<bool, KvError> {
        let m = self
            .member(to)
            .ok_or_else(|| corrupt(format!("successor {to} is no member")))?;
        self.stats.sent(Kind::Adopt);
        let r = ep
            .call(
                m.node,
                m.service,
                Request::Adopt {
                    shard: id,
                    next_slot: s.next_slot.load(Ordering::Acquire),
                    clock: s.clock.load(Ordering::Acquire),
                }
                .encode(),
            )
            .await?;
        match Reply::decode(&r).map_err(|e| corrupt(e.to_string()))? {
            Reply::Done => Ok(true),
            Reply::Retry => Ok(false),
            r => Err(corrupt(format!("adopt answered {r:?}"))),
        }
    }

    /// Sends eviction batches for every page of another directory this node
    /// caches; returns how many it still holds.
    async fn evict_all_remote(&self, ep: &Endpoint) -> Result<usize, KvError> {
        let mut p = crate::provider::Provider::new();
        p.evict_everything(self, ep, |pid| !self.directs(pid)).await
    }

    /// Drops this node's copies of pages it directs (dirty sole copies to
    /// the SSD first); returns how many it could not drop yet, plus entries
    /// with a transfer or pull in flight, and on the simulated cluster the
    /// virtual instant the modelled SSD completes the writes (the bytes are
    /// in the page file at once; the caller waits for the device once it
    /// holds no entry's mutex). Requests an entry still holds
    /// (queued behind a transfer, or held during a pull) are answered
    /// "retry" first: the transfer we wait for may wait for their senders
    /// to let go of a latch (invariant in `docs/scalestore.md`).
    fn drop_own_copies(&self) -> Result<(usize, Option<Instant>), KvError> {
        let mut busy = 0;
        let mut written: Option<Instant> = None;
        for fi in 0..self.frames.high_water() {
            let f = self.frames.frame(fi);
            let pid = f.pid();
            if pid == Pid::EMPTY || !self.directs(pid) {
                continue;
            }
            let mut out = Vec::new();
            let in_flight = {
                let mut m = f.meta.lock();
                if f.pid() == pid {
                    self.release_for_handover(&mut m, &mut out);
                }
                m.dir
                    .as_ref()
                    .is_some_and(|d| d.transfer.is_some() || d.in_flight())
            };
            for (r, a) in out {
                r.reply(a);
            }
            if in_flight {
                busy += 1;
                continue;
            }
            if f.local().mode == Possession::None {
                continue;
            }
            if !f.latch.try_exclusive() {
                busy += 1;
                continue;
            }
            let mut m = f.meta.lock();
            let l = f.local();
            let me = self.index;
            let ok = f.pid() == pid
                && l.mode != Possession::None
                && m.parked.is_empty()
                && m.dir.as_ref().is_some_and(|d| {
                    d.owners.contains(me) && d.copies_granted(me) <= m.copies_served
                });
            if !ok {
                drop(m);
                f.latch.unlock_exclusive();
                self.released(fi);
                busy += 1;
                continue;
            }
            let d = m.dir.as_mut().expect("checked");
            let rest = d.owners.without(me);
            if rest == Owners::None && d.dirty {
                let s = self.shard(pid.shard()).expect("directed");
                let mut page = AlignedPage::default();
                page.bytes_mut()
                    .copy_from_slice(&self.page(l.slot).to_bytes());
                // Under the entry's mutex and the frame's latch: the write
                // is posted (no wait here; on the simulated cluster a wait
                // would be a nested frame that could run code wanting this
                // mutex on the same OS thread).
                let due = s
                    .file
                    .write_batch_posted(&[(pid.slot(), &page)])
                    .map_err(|e| KvError::Exhausted(format!("SSD write: {e}")))?;
                written = written.max(due);
                d.dirty = false;
            }
            d.owners = rest;
            d.forget_copies(me);
            self.drop_copy(fi, true);
            self.maybe_remove(fi, &mut m);
            drop(m);
            f.latch.unlock_exclusive();
        }
        Ok((busy, written))
    }

    /// Hands shard `id` (frozen, no copies here) over to `succ`, which
    /// accepted to adopt it.
    async fn hand_over(
        &self,
        ep: &Endpoint,
        id: u8,
        s: &crate::node::Shard,
        succ: u8,
    ) -> Result<(), KvError> {
        let m = self
            .member(succ)
            .ok_or_else(|| corrupt(format!("successor {succ} is no member")))?;
        let call = |kind: Kind, bytes: Vec<u8>| {
            self.stats.sent(kind);
            let reply = ep.call(m.node, m.service, bytes);
            async move {
                let r = reply.await?;
                match Reply::decode(&r).map_err(|e| corrupt(e.to_string()))? {
                    Reply::Done => Ok::<(), KvError>(()),
                    r => Err(corrupt(format!("handover step answered {r:?}"))),
                }
            }
        };
        let next_slot = s.next_slot.load(Ordering::Acquire);
        // The page file: every slot ever written (unwritten ones read as
        // zeroes on the successor too).
        let mut batch: Vec<(u64, Vec<u8>)> = Vec::new();
        let mut buf = AlignedPage::default();
        // Reads are issued back to back and their modelled device time is
        // waited for once per message (`settle_sim_wait`: the instant the
        // last completes), as a batch of I/Os in flight together; no await
        // comes between a read and that wait (the due instant is kept per
        // OS thread).
        for slot in 0..next_slot {
            s.file
                .read(slot, &mut buf)
                .map_err(|e| KvError::Exhausted(format!("SSD read: {e}")))?;
            if buf.bytes().iter().all(|&b| b == 0) {
                continue;
            }
            batch.push((slot, buf.bytes().to_vec()));
            if batch.len() == HANDOVER_PAGES {
                crate::ssd::settle_sim_wait().await;
                call(Kind::HandoverPages, msg::encode_pages(id, &batch)).await?;
                batch.clear();
            }
        }
        crate::ssd::settle_sim_wait().await;
        if !batch.is_empty() {
            call(Kind::HandoverPages, msg::encode_pages(id, &batch)).await?;
        }
        // The directory entries.
        let mut entries = Vec::new();
        let mut frames = Vec::new();
        for fi in 0..self.frames.high_water() {
            let f = self.frames.frame(fi);
            let m = f.meta.lock();
            let pid = f.pid();
            if pid == Pid::EMPTY || pid.shard() != id {
                continue;
            }
            if let Some(d) = m.dir.as_ref() {
                if d.owners.contains(self.index) {
                    return Err(corrupt(format!("{pid}: still cached by the leaving node")));
                }
                if d.owners != Owners::None || d.dirty {
                    entries.push(EntryState {
                        pid,
                        owners: to_wire(d.owners),
                        epoch: d.epoch,
                        dirty: d.dirty,
                        prev_dirty: d.prev_dirty,
                        copy_grants: d.copy_grants.clone(),
                    });
                }
                frames.push((fi, pid));
            }
        }
        for chunk in entries.chunks(HANDOVER_ENTRIES) {
            call(Kind::HandoverEntries, msg::encode_entries(id, chunk)).await?;
        }
        call(Kind::HostShard, Request::HostShard { shard: id }.encode()).await?;
        // From now on the successor directs the shard.
        self.set_host(id, succ);
        self.remove_shard(id);
        // Requests that got hold of the shard before it was removed.
        *s.moved_to.lock() = Some(succ);
        for (fi, pid) in frames {
            let f = self.frames.frame(fi);
            let mut replies = Vec::new();
            {
                let mut m = f.meta.lock();
                if f.pid() != pid {
                    // Removed (its entry was idle) and reused since.
                    continue;
                }
                if let Some(mut d) = m.dir.take() {
                    replies.extend(d.held.drain(..).map(|h| h.responder));
                    replies.extend(d.queue.drain(..).map(|h| h.responder));
                }
                if f.local().mode == Possession::None
                    && f.local().slot == crate::frames::NONE
                    && f.latch.try_exclusive()
                {
                    self.maybe_remove(fi, &mut m);
                    f.latch.unlock_exclusive();
                }
            }
            for r in replies {
                r.reply(Ok(Reply::Moved(succ).encode()));
            }
        }
        Ok(())
    }
}

/// A leave's pause before it looks again (for its in-flight operations,
/// declined evictions, transfers in flight, another leaver's departure).
/// On the real backends the leave has an OS thread of its own and sleeps
/// it for `d`, as it always did. On the simulated cluster a pause costs no
/// CPU and is an await of the leave's task; it is at most
/// [`SIM_PAUSE`]: what a leave waits for there takes a few modelled round
/// trips (a message's is about 1.6 µs on `scalestore-cx5`), and 1 ms
/// pauses made a leave take several virtual milliseconds (longer than a
/// short run). (So on the real backends a leave's future must run on a
/// thread of its own, as `spawn_background_local` and `ScaleNode::leave`
/// run it.)
/// Returns the pause it made (bounded waits count it).
async fn pause(d: Duration) -> Duration {
    if dmkv_transport::sim::active() {
        let d = d.min(SIM_PAUSE);
        dmkv_transport::exec::sleep(d).await;
        d
    } else {
        dmkv_transport::time::sleep_blocking(d);
        d
    }
}

/// The longest pause of a leave on the simulated cluster (see [`pause`]).
const SIM_PAUSE: Duration = Duration::from_micros(50);

/// How a leave failed: before its departure went out (the node serves
/// again), or while sending it (some members forgot it already).
enum Failed {
    Before(KvError),
    Departing(KvError),
}
