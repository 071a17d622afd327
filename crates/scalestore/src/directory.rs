//! The directory (§3.3–3.4, §4.2–4.3, §6.5): page metadata only, never
//! conflict resolution (that is the requester's job, §3.5).
//!
//! Decisions for an ownership request (under the entry's frame mutex):
//!
//! - owners none: base case, the page comes from the directory's SSD into
//!   the requester's frame before the reply (the directory keeps no copy);
//! - exclusive owner `n`: exclusive conflict, the conflict epoch grows, the
//!   entry names the requester at once (immediate metadata update) and the
//!   requester moves the page from `n`, its anticipated predecessor (which
//!   may itself still be waiting for the page: anticipatory chaining);
//! - shared owners, shared request: no conflict, the requester joins and
//!   copies from a sharer (the directory notes the copy it granted, so the
//!   sharer's eviction waits until it served it: owner stability for copy
//!   sources);
//! - shared owners, exclusive request: shared conflict, epoch grows, the
//!   requester moves the page from one sharer (or keeps its own) and
//!   invalidates the others.
//!
//! Where the directory holds the page itself and can latch it at once, it
//! writes it into the requester's frame inline. Under FIFO
//! (`scalestore.protocol=fifo`, §3.4.2) a remote request finding a transfer
//! in flight is queued (its reply deferred) until the transfer before it is
//! acknowledged; the directory's own workers bypass the queue.

use crate::frames::{Awaiting, Dir, HeldRequest, Meta, NONE, Owners, Possession};
use crate::holder::{Answer, service_error};
use crate::msg::{EvictEntry, EvictReply, Grant, Reply, Source, Want};
use crate::node::{Counters, NodeState, Protocol, ScaleNode, Shard, corrupt, pick};
use crate::page::PAGE_SIZE;
use crate::pid::Pid;
use crate::ssd::AlignedPage;
use dmkv_api::KvError;
use dmkv_transport::Responder;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// An ownership request as the directory sees it.
#[derive(Debug, Clone, Copy)]
pub struct OwnRequest {
    pub from: u8,
    pub pid: Pid,
    pub want: Want,
    pub retry: bool,
    pub offset: u64,
}

/// What an eviction batch came to.
pub enum Evicted {
    /// Decided: answer now.
    Reply(EvictReply),
    /// Dirty last copies must be pulled from the evicter's cache first: the
    /// SSD completer posts the one-sided read and finishes the batch when
    /// it completes ([`ScaleNode::submit_pull`], invariant 20); the
    /// entries stay `evicting` until then, so the handler waits for
    /// nothing.
    Pulling(EvictPull),
    /// Dirty last copies were pulled and go to the SSD: the SSD completer
    /// writes them and answers the batch (`ScaleNode::submit_evict_write`).
    Writing(EvictWrite),
}

/// An eviction batch whose dirty last copies are to be pulled (their
/// entries are `evicting`).
pub struct EvictPull {
    /// The evicter.
    pub from: u8,
    /// The batch as received.
    pub entries: Vec<EvictEntry>,
    /// The entries to pull: (index in `entries`, frame).
    pub pulls: Vec<(usize, u32)>,
    /// The batch's answer so far (the pulled pages are not accepted yet).
    pub accepted: Vec<bool>,
}

/// An eviction batch waiting for the SSD write of the pages it pulled.
pub struct EvictWrite {
    /// The batch's answer so far (the pulled pages are not accepted yet).
    pub accepted: Vec<bool>,
    /// The pulled pages, per shard.
    pub pages: PulledPages,
}

/// Pulled pages, per shard (one write batch each).
pub type PulledPages = Vec<(Arc<Shard>, Vec<PulledPage>)>;

/// A dirty last copy pulled by an eviction, on its way to the SSD (its
/// entry is `evicting` until written).
pub struct PulledPage {
    /// Its index in the eviction batch.
    pub entry: usize,
    pub fi: u32,
    pub pid: Pid,
    /// The entry's conflict epoch when it was pulled.
    pub epoch: u64,
    pub page: AlignedPage,
}

/// The outcome of an ownership request.
pub enum Decision {
    Reply(Reply),
    /// Held with its responder (answered later).
    Held,
    /// A local request that would have been held: the worker tries again.
    Busy,
    /// Granted from our SSD to this node's own worker (split grant,
    /// invariant 19): the entry is `reading`; the worker reads and delivers
    /// the page without the entry's mutex ([`ScaleNode::read_for_self`])
    /// and lets the entry go through a [`LocalRead`], made at once.
    Read(Grant),
}

/// A worker's read of a page its own node directs, granted from the SSD:
/// while this lives the page's entry is `reading` (every other request for
/// the page is held, invariant 16). Dropping it lets the entry go and
/// answers what was held; if the read or the delivery failed
/// ([`LocalRead::failed`]) the grant is undone first. Dropped on every path
/// (a worker whose operation is abandoned mid-read included), so an entry
/// is never left `reading`.
pub struct LocalRead {
    node: Arc<ScaleNode>,
    pid: Pid,
    ok: bool,
}

impl LocalRead {
    /// Takes charge of the `reading` entry of `pid` that `node`'s
    /// [`Decision::Read`] left: make it before anything can yield.
    pub fn new(node: Arc<ScaleNode>, pid: Pid) -> LocalRead {
        LocalRead {
            node,
            pid,
            ok: true,
        }
    }

    /// The read or the delivery failed: the grant is undone on drop.
    pub fn failed(&mut self) {
        self.ok = false;
    }
}

impl Drop for LocalRead {
    fn drop(&mut self) {
        self.node.end_local_read(self.pid, self.ok);
    }
}

impl ScaleNode {
    /// Decides an ownership request for a page this node directs. A remote
    /// request comes with its responder, which is kept if the request must
    /// wait; a local one (`responder` none) gets [`Decision::Busy`] instead.
    pub fn own_request(
        &self,
        q: OwnRequest,
        responder: &mut Option<Responder>,
    ) -> Result<Decision, KvError> {
        let Some(shard) = self.shard(q.pid.shard()) else {
            // Handed over since the caller looked (the new host is recorded
            // before the shard is removed).
            return match self.host_of(q.pid.shard()).filter(|h| *h != self.index) {
                Some(h) => Ok(Decision::Reply(Reply::Moved(h))),
                None => Err(corrupt(format!("{}: shard not hosted here", q.pid))),
            };
        };
        if shard.frozen.load(Ordering::SeqCst) {
            return Ok(self.answer_during_handover(&shard, responder));
        }
        let fi = self
            .frames
            .find_or_insert(q.pid)
            .map_err(|_| KvError::Exhausted("the frame table is full".into()))?;
        let f = self.frames.frame(fi);
        let mut m = f.meta.lock();
        if f.pid() != q.pid {
            // Freed and reused between lookup and lock: rare; ask again.
            drop(m);
            return self.own_request(q, responder);
        }
        if shard.frozen.load(Ordering::SeqCst) {
            drop(m);
            return Ok(self.answer_during_handover(&shard, responder));
        }
        let d = self.decide(&shard, fi, &mut m, q, responder);
        let parked = f.local().parked;
        drop(m);
        if parked {
            // An inline transfer let go of our own latch.
            self.repoll.kick(fi);
        }
        d
    }

    /// A request for a page of a frozen shard (being handed over). It is
    /// never held here: the requester may hold latches (an optimistic
    /// guard on a freshly fetched page, say) that a transfer in flight on
    /// another entry of this shard waits for, and the handover waits for
    /// that transfer (see `membership`). So it is answered "retry": the
    /// requester lets go of everything and asks again; once the handover
    /// is done, "moved to" the successor.
    fn answer_during_handover(&self, shard: &Shard, responder: &mut Option<Responder>) -> Decision {
        if let Some(h) = shard.moved_to.lock().as_ref() {
            return Decision::Reply(Reply::Moved(*h));
        }
        match responder {
            Some(_) => {
                Counters::add(&self.stats.handover_retries, 1);
                Decision::Reply(Reply::Retry)
            }
            None => Decision::Busy,
        }
    }

    /// [`Self::own_request`] under the entry's frame mutex.
    fn decide(
        &self,
        shard: &Shard,
        fi: u32,
        m: &mut Meta,
        q: OwnRequest,
        responder: &mut Option<Responder>,
    ) -> Result<Decision, KvError> {
        let mut d = m
            .dir
            .take()
            .unwrap_or_else(|| Box::new(Dir::new(shard.tick())));
        let res = self.decide_entry(shard, fi, m, &mut d, q, responder);
        m.dir = Some(d);
        res
    }

    fn decide_entry(
        &self,
        shard: &Shard,
        fi: u32,
        m: &mut Meta,
        d: &mut Dir,
        q: OwnRequest,
        responder: &mut Option<Responder>,
    ) -> Result<Decision, KvError> {
        let local = q.from == self.index;
        let hold = |r: &mut Option<Responder>| {
            r.take().map(|responder| HeldRequest {
                from: q.from,
                want: q.want,
                retry: q.retry,
                offset: q.offset,
                responder,
            })
        };
        if d.in_flight() {
            // An eviction pull, or the page on its way from our SSD or our
            // own copy to the grantee (invariants 16 and 22): wait, in
            // arrival order.
            return Ok(match hold(responder) {
                Some(h) => {
                    Counters::add(&self.stats.parked_directory, 1);
                    d.held.push(h);
                    Decision::Held
                }
                None => Decision::Busy,
            });
        }
        if self.cfg.protocol == Protocol::Fifo && local && d.transfer.is_some() {
            // The directory's own workers bypass the queue (§3.4.2), but
            // never a transfer in flight: the acknowledgement ending it
            // leaves the page to them (`local_waiting`).
            d.local_waiting = true;
            return Ok(Decision::Busy);
        }
        if self.cfg.protocol == Protocol::Fifo
            && !local
            && (d.transfer.is_some() || !d.queue.is_empty() || d.local_waiting)
        {
            // A node asks for the page at most once at a time (its frame is
            // latched through the request). Its request can find its own
            // transfer still open: the acknowledgement is posted without
            // waiting (worker `acknowledge`), and another thread of that
            // node, or a message on another handler, may overtake it. It
            // then queues like any other.
            if d.queue.iter().any(|h| h.from == q.from) {
                return Err(corrupt(format!(
                    "{}: node {} asks again while its request is pending",
                    q.pid, q.from
                )));
            }
            let h = hold(responder).expect("a remote request has a responder");
            Counters::add(&self.stats.fifo_queued, 1);
            Counters::add(
                &self.stats.fifo_before_ack,
                (d.transfer == Some(q.from)) as u64,
            );
            d.queue.push_back(h);
            return Ok(Decision::Held);
        }
        let mut post = None;
        let g = self.grant(shard, fi, m, d, q, &mut post)?;
        if self.cfg.protocol == Protocol::Fifo {
            d.transfer = Some(q.from);
            if local {
                d.local_waiting = false;
                Counters::add(&self.stats.fifo_bypassed, !d.queue.is_empty() as u64);
            }
        }
        if local {
            Counters::add(&self.stats.local_grants, 1);
        }
        if let Some(p) = post {
            // Written from our own copy by the completer, which then
            // answers (invariant 22): the handler does not wait.
            let responder = responder.take().expect("a remote request has a responder");
            self.submit_delivery(decided(p, g), responder);
            return Ok(Decision::Held);
        }
        if d.reading {
            if local {
                // Our own worker reads for itself, without the mutex
                // (invariant 19): a handler wanting this entry meanwhile
                // finds it `reading` and holds its request.
                return Ok(Decision::Read(g));
            }
            // Granted from our SSD to a remote requester: the completer
            // reads, delivers and replies (the handler does not wait).
            let responder = responder.take().expect("a remote request has a responder");
            self.submit_grant_read(q, g, responder);
            return Ok(Decision::Held);
        }
        Ok(Decision::Reply(Reply::Grant(g)))
    }

    /// The decision proper (see the module documentation).
    ///
    /// On the real backends a page this directory writes from its own copy
    /// is not written here: the grant is recorded, the entry marked
    /// `delivering`, our copy (if the grant takes or downgrades it) stays
    /// latched exclusively, and the write is left in `post` for the caller
    /// to hand to the completer with the request's responder (invariant
    /// 22).
    fn grant(
        &self,
        shard: &Shard,
        fi: u32,
        m: &mut Meta,
        d: &mut Dir,
        q: OwnRequest,
        post: &mut Option<crate::ssdio::Delivery>,
    ) -> Result<Grant, KvError> {
        use crate::ssdio::{Delivery, OwnCopy, Then};
        let posting = self.posts_deliveries();
        let mut later = |d: &mut Dir, bytes: Vec<u8>, undo: Owners, own: OwnCopy| {
            d.delivering = true;
            *post = Some(Delivery {
                to: q.from,
                offset: q.offset,
                bytes,
                // The grant is filled in by `decided`.
                then: Then::Grant {
                    pid: q.pid,
                    fi,
                    grant: Grant {
                        epoch: 0,
                        source: Source::Written,
                        invalidate: 0,
                    },
                    undo,
                    own,
                },
            });
        };
        let f = self.frames.frame(fi);
        let me = self.index;
        let r = q.from;
        if q.retry {
            if d.owners == Owners::Exclusive(r) {
                return Err(corrupt(format!(
                    "{}: node {r} says it lost the page it owns exclusively",
                    q.pid
                )));
            }
            d.owners = d.owners.without(r);
            d.forget_copies(r);
        }
        let l = f.local();
        // Our own copy, if it is stable (no worker of ours is fetching it).
        let my_copy = l.mode != Possession::None
            && l.slot != NONE
            && m.awaiting == Awaiting::No
            && !m.phantom;
        let mut invalidate = 0u64;
        let source = match (d.owners, q.want) {
            (Owners::None, w) => {
                if d.dirty {
                    return Err(corrupt(format!(
                        "{} is dirty but nobody holds a copy",
                        q.pid
                    )));
                }
                // Split grant (invariants 16 and 19): the grant is
                // recorded now and the entry marked `reading`; the read and
                // the delivery happen without the entry's mutex: a remote
                // requester's by the SSD completer, our own worker's by
                // that worker (`Decision::Read`).
                d.reading = true;
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
                // Exclusive conflict.
                d.epoch = shard.tick();
                d.prev_dirty = d.dirty;
                d.dirty = true;
                d.copy_grants.clear();
                if n == me && my_copy && f.latch.try_exclusive() {
                    if posting {
                        // Our copy stays latched until the write ends.
                        let undo = d.owners;
                        let own = match w {
                            Want::Shared => {
                                d.owners = Owners::Shared(1 << me | 1 << r);
                                OwnCopy::Downgrade
                            }
                            Want::Exclusive => {
                                d.owners = Owners::Exclusive(r);
                                OwnCopy::Drop
                            }
                        };
                        later(d, self.frame_bytes(l.slot, r), undo, own);
                        return Ok(Grant {
                            epoch: d.epoch,
                            source: Source::Written,
                            invalidate,
                        });
                    }
                    if let Err(e) = self.deliver_copy(r, q.offset, &self.frame_bytes(l.slot, r)) {
                        f.latch.unlock_exclusive();
                        return Err(e);
                    }
                    match w {
                        Want::Shared => {
                            // Downgrade our own copy and share it.
                            d.owners = Owners::Shared(1 << me | 1 << r);
                            f.set_possession(Possession::Shared, l.slot);
                            m.epoch = d.epoch;
                            m.copies_served = 0;
                        }
                        Want::Exclusive => {
                            d.owners = Owners::Exclusive(r);
                            self.drop_copy(fi, true);
                        }
                    }
                    f.latch.unlock_exclusive();
                    Source::Written
                } else {
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
                } else if set & (1 << me) != 0 && my_copy && f.latch.try_shared() {
                    let bytes = self.frame_bytes(l.slot, r);
                    f.latch.unlock_shared();
                    if posting {
                        d.owners = Owners::Shared(set | 1 << r);
                        later(d, bytes, Owners::Shared(set), OwnCopy::Keep);
                        return Ok(Grant {
                            epoch: d.epoch,
                            source: Source::Written,
                            invalidate,
                        });
                    }
                    self.deliver_copy(r, q.offset, &bytes)?;
                    d.owners = Owners::Shared(set | 1 << r);
                    Source::Written
                } else {
                    let mut cands = set;
                    if !my_copy && cands & !(1 << me) != 0 {
                        cands &= !(1 << me);
                    }
                    let s = pick(cands);
                    d.note_copy_grant(s);
                    d.owners = Owners::Shared(set | 1 << r);
                    Source::Copy(s)
                }
            }
            (Owners::Shared(set), Want::Exclusive) => {
                let others = set & !(1 << r);
                d.prev_dirty = d.dirty;
                d.dirty = true;
                if others == 0 {
                    // The only sharer upgrades: no conflict.
                    d.owners = Owners::Exclusive(r);
                    Source::Kept
                } else {
                    // Shared conflict.
                    d.epoch = shard.tick();
                    d.copy_grants.clear();
                    if set & (1 << r) != 0 {
                        d.owners = Owners::Exclusive(r);
                        invalidate = others;
                        Source::Kept
                    } else if others & (1 << me) != 0 && my_copy && f.latch.try_exclusive() {
                        if posting {
                            // Our copy stays latched until the write ends.
                            d.owners = Owners::Exclusive(r);
                            let bytes = self.frame_bytes(l.slot, r);
                            later(d, bytes, Owners::Shared(set), OwnCopy::Drop);
                            return Ok(Grant {
                                epoch: d.epoch,
                                source: Source::Written,
                                invalidate: others & !(1 << me),
                            });
                        }
                        let res = self.deliver_copy(r, q.offset, &self.frame_bytes(l.slot, r));
                        if res.is_ok() {
                            self.drop_copy(fi, true);
                            d.owners = Owners::Exclusive(r);
                        }
                        f.latch.unlock_exclusive();
                        res?;
                        invalidate = others & !(1 << me);
                        Source::Written
                    } else {
                        let mut cands = others;
                        if !my_copy && cands & !(1 << me) != 0 {
                            cands &= !(1 << me);
                        }
                        let s = pick(cands);
                        d.owners = Owners::Exclusive(r);
                        invalidate = others & !(1 << s);
                        Source::Move(s)
                    }
                }
            }
        };
        Ok(Grant {
            epoch: d.epoch,
            source,
            invalidate,
        })
    }

    /// FIFO variant: the transfer to `from` completed. The next queued
    /// request is granted at once (its deferred reply goes out) when
    /// `inline`; otherwise the re-poll thread does it.
    pub fn ack(&self, from: u8, pid: Pid, inline: bool) -> Result<(), KvError> {
        let fi = self
            .frames
            .find(pid)
            .ok_or_else(|| corrupt(format!("{pid}: acknowledgement without an entry")))?;
        let f = self.frames.frame(fi);
        let mut out = Vec::new();
        {
            let mut m = f.meta.lock();
            let d = m
                .dir
                .as_mut()
                .filter(|_| f.pid() == pid)
                .ok_or_else(|| corrupt(format!("{pid}: acknowledgement without an entry")))?;
            if d.transfer != Some(from) {
                return Err(corrupt(format!(
                    "{pid}: acknowledgement from {from}, but the transfer is {:?}",
                    d.transfer
                )));
            }
            d.transfer = None;
            if inline {
                self.directory_retry(fi, &mut m, &mut out);
            }
        }
        if inline {
            for (r, a) in out {
                r.reply(a);
            }
        } else {
            self.repoll.kick(fi);
        }
        Ok(())
    }

    /// Answers what the entry of frame `fi` holds, if it can now: requests
    /// held during an eviction pull, and the head of the FIFO queue once no
    /// transfer is in flight.
    pub fn directory_retry(&self, fi: u32, m: &mut Meta, out: &mut Vec<(Responder, Answer)>) {
        let pid = self.frames.frame(fi).pid();
        let Some(shard) = self.shard(pid.shard()) else {
            return;
        };
        if shard.frozen.load(Ordering::SeqCst) {
            // Being handed over: nothing is granted any more, and whoever
            // waits here is told to let go and ask again (see
            // `answer_during_handover`).
            self.release_for_handover(m, out);
            return;
        }
        let Some(mut d) = m.dir.take() else {
            return;
        };
        if !d.in_flight() && !d.held.is_empty() {
            for h in std::mem::take(&mut d.held) {
                self.answer_held(&shard, fi, m, &mut d, h, out);
            }
        }
        // A waiting worker of this node goes first: it asks again (its
        // backoff) and is granted; its acknowledgement grants the queue.
        while self.cfg.protocol == Protocol::Fifo
            && d.transfer.is_none()
            && !d.in_flight()
            && !d.local_waiting
        {
            let Some(h) = d.queue.pop_front() else { break };
            let q = OwnRequest {
                from: h.from,
                pid,
                want: h.want,
                retry: h.retry,
                offset: h.offset,
            };
            let mut post = None;
            match self.grant(&shard, fi, m, &mut d, q, &mut post) {
                Ok(g) => {
                    d.transfer = Some(h.from);
                    if let Some(p) = post {
                        self.submit_delivery(decided(p, g), h.responder);
                    } else if d.reading {
                        self.submit_grant_read(q, g, h.responder);
                    } else {
                        out.push((h.responder, Ok(Reply::Grant(g).encode())));
                    }
                }
                Err(e) => out.push((h.responder, Err(service_error(e)))),
            }
        }
        m.dir = Some(d);
    }

    /// Answers "retry" to every request the entry of a frozen shard holds
    /// (held during an eviction pull, or queued behind a FIFO transfer):
    /// they are never granted here any more, and their senders may hold
    /// latches that the handover waits for.
    pub fn release_for_handover(&self, m: &mut Meta, out: &mut Vec<(Responder, Answer)>) {
        let Some(d) = m.dir.as_mut() else {
            return;
        };
        for h in d.held.drain(..).chain(d.queue.drain(..)) {
            Counters::add(&self.stats.handover_retries, 1);
            out.push((h.responder, Ok(Reply::Retry.encode())));
        }
    }

    fn answer_held(
        &self,
        shard: &Shard,
        fi: u32,
        m: &mut Meta,
        d: &mut Dir,
        h: HeldRequest,
        out: &mut Vec<(Responder, Answer)>,
    ) {
        let q = OwnRequest {
            from: h.from,
            pid: self.frames.frame(fi).pid(),
            want: h.want,
            retry: h.retry,
            offset: h.offset,
        };
        let mut responder = Some(h.responder);
        match self.decide_entry(shard, fi, m, d, q, &mut responder) {
            Ok(Decision::Reply(r)) => {
                if let Some(resp) = responder {
                    out.push((resp, Ok(r.encode())));
                }
            }
            Ok(Decision::Held) | Ok(Decision::Busy) => {}
            Ok(Decision::Read(_)) => unreachable!("a held request is a remote one"),
            Err(e) => {
                if let Some(resp) = responder {
                    out.push((resp, Err(service_error(e))));
                }
            }
        }
    }

    /// Checks an SSD fetch: every copy the grant named was gone, so the SSD
    /// copy must be current (the page was clean before the grant).
    fn check_fetch(&self, r: u8, pid: Pid, epoch: u64) -> Result<(), KvError> {
        let fi = self
            .frames
            .find(pid)
            .ok_or_else(|| corrupt(format!("{pid}: SSD fetch without an entry")))?;
        let f = self.frames.frame(fi);
        let m = f.meta.lock();
        let ok = m.dir.as_ref().is_some_and(|d| {
            f.pid() == pid && d.owners.contains(r) && d.epoch == epoch && !d.prev_dirty
        });
        if !ok {
            return Err(corrupt(format!(
                "{pid}: SSD fetch by {r} at epoch {epoch} does not match the entry (every copy gone from a dirty page?)"
            )));
        }
        Ok(())
    }

    /// Serves an SSD fetch of this node's own worker (`r` is this node): it
    /// reads and delivers now (the worker waits as a task for the modelled
    /// device, `settle_sim_wait`).
    pub fn ssd_fetch(&self, r: u8, pid: Pid, epoch: u64, offset: u64) -> Result<Reply, KvError> {
        self.check_fetch(r, pid, epoch)?;
        let bytes = self.read_ssd(pid)?;
        self.deliver(r, offset, &bytes)?;
        Ok(Reply::Done)
    }

    /// Serves a remote node's SSD fetch without waiting for the SSD: the
    /// completer reads, delivers and answers "done" (or the error). The
    /// slot cannot change meanwhile: the requester owns the page by the
    /// grant and awaits it, and the page was clean (invariant 16).
    pub fn ssd_fetch_deferred(
        &self,
        r: u8,
        pid: Pid,
        epoch: u64,
        offset: u64,
        responder: Responder,
    ) -> Result<(), (Responder, KvError)> {
        if let Err(e) = self.check_fetch(r, pid, epoch) {
            return Err((responder, e));
        }
        let Some(shard) = self.shard(pid.shard()) else {
            return Err((responder, corrupt(format!("{pid}: shard not here"))));
        };
        self.ssd_jobs.push(crate::ssdio::Job::new(
            shard,
            crate::ssdio::Work::Fetch { pid, to: r, offset },
            responder,
        ));
        Ok(())
    }

    /// Hands a grant's SSD read (entry marked `reading`, under its mutex)
    /// to the completer.
    fn submit_grant_read(&self, q: OwnRequest, grant: Grant, responder: Responder) {
        let shard = self
            .shard(q.pid.shard())
            .expect("a shard is not removed while an entry of it is locked and not frozen");
        self.ssd_jobs.push(crate::ssdio::Job::new(
            shard,
            crate::ssdio::Work::Grant {
                pid: q.pid,
                to: q.from,
                offset: q.offset,
                grant,
            },
            responder,
        ));
    }

    /// A worker of this node reads the page `pid` it was granted from our
    /// SSD ([`Decision::Read`]) and delivers it into its own frame at
    /// `offset`: without the entry's mutex (the entry is `reading`), so a
    /// handler that wants the entry meanwhile holds its request and goes
    /// on (invariant 19). On the real backends this thread waits for the
    /// device; under the simulated cluster the bytes are read now and the
    /// device's instant is left for `ssd::settle_sim_wait`.
    pub fn read_for_self(&self, pid: Pid, offset: u64) -> Result<(), KvError> {
        let bytes = self.read_ssd(pid)?;
        self.deliver(self.index, offset, &bytes)
    }

    /// Ends a worker's [`Decision::Read`] (through [`LocalRead`]'s drop):
    /// under the entry's mutex clears `reading`, undoes the grant if the
    /// read or the delivery failed (owners none, clean, `transfer`
    /// cleared: nothing else changed the entry meanwhile, as in
    /// [`Self::finish_ssd`]) and answers what was held.
    pub fn end_local_read(&self, pid: Pid, ok: bool) {
        let Some(fi) = self.frames.find(pid) else {
            return;
        };
        let f = self.frames.frame(fi);
        let mut out = Vec::new();
        {
            let mut m = f.meta.lock();
            if f.pid() != pid {
                return;
            }
            let Some(d) = m.dir.as_mut().filter(|d| d.reading) else {
                return;
            };
            d.reading = false;
            if !ok {
                d.owners = Owners::None;
                d.dirty = false;
                if d.transfer == Some(self.index) {
                    d.transfer = None;
                }
            }
            self.directory_retry(fi, &mut m, &mut out);
        }
        for (r, a) in out {
            r.reply(a);
        }
    }

    /// Completes a deferred SSD access (the completer, `ssdio`): delivers
    /// a page read into the requester's frame, lets the entry go and
    /// answers. A failed read or delivery undoes a grant (the entry was
    /// `reading`, so nothing else changed it: the page is again only on
    /// the SSD, clean) and answers the requester with the error.
    pub fn finish_ssd(&self, job: crate::ssdio::Job, res: std::io::Result<crate::ssdio::Outcome>) {
        use crate::ssdio::{Outcome, Work};
        let crate::ssdio::Job {
            work, responder, ..
        } = job;
        let delivered = |pid: Pid, to: u8, offset: u64| -> Result<(), KvError> {
            match res {
                Ok(Outcome::Page(ref page)) => {
                    Counters::add(&self.stats.pages_ssd, 1);
                    self.deliver(to, offset, page.bytes())
                }
                Ok(Outcome::Written) => Err(corrupt("a write completed a read")),
                Err(ref e) => Err(KvError::Exhausted(format!("SSD read of {pid}: {e}"))),
            }
        };
        match work {
            work @ Work::Fetch { .. } => {
                let Work::Fetch { pid, to, offset } = work else {
                    unreachable!("matched")
                };
                let r = delivered(pid, to, offset);
                self.finish_read(work, responder, r);
            }
            Work::Write { ref pages } => {
                dmkv_transport::sim::work(
                    crate::handler::cost::HANDOVER_WRITTEN
                        + crate::handler::cost::HANDOVER_WRITTEN_PAGE * pages.len() as u64,
                );
                let r = match res {
                    Ok(_) => Ok(Reply::Done.encode()),
                    Err(e) => Err(service_error(KvError::Exhausted(format!("SSD write: {e}")))),
                };
                responder.reply(r);
            }
            Work::Pull(p) => {
                // Pulls are finished by `finish_pull_job`; never here.
                let e = corrupt("a pull was completed as an SSD access");
                self.finish_pull_job(p, Err(e), responder);
            }
            Work::Evict(w) => {
                // A failed write declines the pulled pages (their evicter
                // keeps its copy), never answers an error for the batch:
                // the pages decided without a write are decided.
                let answer = self.finish_evict_write(w, res.is_ok());
                responder.reply(Ok(answer));
            }
            work @ Work::Grant { .. } => {
                let Work::Grant {
                    pid, to, offset, ..
                } = work
                else {
                    unreachable!("matched")
                };
                let r = delivered(pid, to, offset);
                self.finish_read(work, responder, r);
            }
        }
    }

    /// An SSD read of the completer's completed (real backends): a page
    /// for another node comes back as a delivery for the completer to post
    /// (the grant or fetch is finished by [`Self::finish_delivery`] when
    /// the WRITE completes, so the completer's thread waits for no round
    /// trip); anything else is finished now ([`Self::finish_ssd`]).
    pub fn ssd_read_done(
        &self,
        job: crate::ssdio::Job,
        res: std::io::Result<crate::ssdio::Outcome>,
    ) -> Option<(crate::ssdio::Delivery, Responder)> {
        use crate::ssdio::{Delivery, Outcome, Then, Work};
        let remote = match &job.work {
            Work::Grant { to, offset, .. } | Work::Fetch { to, offset, .. } => {
                Some((*to, *offset)).filter(|(to, _)| *to != self.index)
            }
            _ => None,
        };
        match (remote, res) {
            (Some((to, offset)), Ok(Outcome::Page(page))) => {
                Counters::add(&self.stats.pages_ssd, 1);
                let crate::ssdio::Job {
                    work, responder, ..
                } = job;
                let d = Delivery {
                    to,
                    offset,
                    bytes: page.bytes().to_vec(),
                    then: Then::Read(Box::new(work)),
                };
                Some((d, responder))
            }
            (_, res) => {
                self.finish_ssd(job, res);
                None
            }
        }
    }

    /// Finishes a posted delivery (the completer, real backends) once its
    /// WRITE completed (`w`): see [`crate::ssdio::Then`].
    pub fn finish_delivery(
        &self,
        d: crate::ssdio::Delivery,
        responder: Responder,
        w: Result<(), KvError>,
    ) {
        use crate::ssdio::{OwnCopy, Then};
        let copied = !matches!(d.then, Then::Read(_));
        if copied && w.is_ok() {
            Counters::add(&self.stats.pages_remote, 1);
        }
        match d.then {
            Then::Read(work) => self.finish_read(*work, responder, w),
            Then::Done => responder.reply(w.map(|()| Reply::Done.encode()).map_err(service_error)),
            Then::Moved { pid, fi } => {
                let f = self.frames.frame(fi);
                let removed = {
                    let mut m = f.meta.lock();
                    // Latched by the move since it was decided: the frame
                    // still holds the page.
                    debug_assert_eq!(f.pid(), pid);
                    if w.is_ok() && f.pid() == pid {
                        self.drop_copy(fi, true);
                        if m.parked.is_empty() {
                            self.maybe_remove(fi, &mut m);
                        }
                    }
                    f.latch.unlock_exclusive();
                    f.pid() != pid
                };
                if !removed {
                    // Parked requests and latch waiters go on.
                    self.released(fi);
                }
                responder.reply(w.map(|()| Reply::Done.encode()).map_err(service_error));
            }
            Then::Grant {
                pid,
                fi,
                grant,
                undo,
                own,
            } => {
                let f = self.frames.frame(fi);
                let mut out = Vec::new();
                {
                    let mut m = f.meta.lock();
                    // `delivering` keeps the entry (it is not idle), so the
                    // frame still holds the page.
                    let ok = f.pid() == pid && m.dir.as_ref().is_some_and(|d| d.delivering);
                    if ok {
                        let d = m.dir.as_mut().expect("checked");
                        d.delivering = false;
                        if w.is_err() {
                            // Nothing changed the entry meanwhile (every
                            // request was held): as if never granted.
                            d.owners = undo;
                        }
                        if w.is_ok() {
                            match own {
                                OwnCopy::Keep => {}
                                OwnCopy::Downgrade => {
                                    let slot = f.local().slot;
                                    f.set_possession(Possession::Shared, slot);
                                    m.epoch = grant.epoch;
                                    m.copies_served = 0;
                                }
                                OwnCopy::Drop => self.drop_copy(fi, true),
                            }
                        }
                    }
                    if own != OwnCopy::Keep {
                        f.latch.unlock_exclusive();
                    }
                    if ok {
                        self.directory_retry(fi, &mut m, &mut out);
                    }
                }
                if own != OwnCopy::Keep {
                    self.released(fi);
                }
                responder.reply(
                    w.map(|()| Reply::Grant(grant).encode())
                        .map_err(service_error),
                );
                for (r, a) in out {
                    r.reply(a);
                }
            }
        }
    }

    /// Finishes an SSD grant or fetch whose page was delivered (`r`: the
    /// read's and the delivery's outcome): a fetch is answered; a grant's
    /// entry stops `reading` (the grant undone if `r` failed), what it held
    /// is answered, and then the grant.
    fn finish_read(&self, work: crate::ssdio::Work, responder: Responder, r: Result<(), KvError>) {
        use crate::ssdio::Work;
        dmkv_transport::sim::work(crate::handler::cost::FINISH_READ);
        match work {
            Work::Fetch { .. } => {
                responder.reply(r.map(|()| Reply::Done.encode()).map_err(service_error));
            }
            Work::Grant { pid, to, grant, .. } => {
                let mut out = Vec::new();
                let found = match self.frames.find(pid) {
                    Some(fi) => {
                        let f = self.frames.frame(fi);
                        let mut m = f.meta.lock();
                        let ok = f.pid() == pid && m.dir.as_ref().is_some_and(|d| d.reading);
                        if ok {
                            let d = m.dir.as_mut().expect("checked");
                            d.reading = false;
                            if r.is_err() {
                                d.owners = Owners::None;
                                d.dirty = false;
                                if d.transfer == Some(to) {
                                    d.transfer = None;
                                }
                            }
                            self.directory_retry(fi, &mut m, &mut out);
                        }
                        ok
                    }
                    None => false,
                };
                let answer = match (found, r) {
                    (true, Ok(())) => Ok(Reply::Grant(grant).encode()),
                    (true, Err(e)) => Err(service_error(e)),
                    (false, _) => Err(service_error(corrupt(format!(
                        "{pid}: the entry read from the SSD for node {to} is gone"
                    )))),
                };
                responder.reply(answer);
                for (r, a) in out {
                    r.reply(a);
                }
            }
            _ => responder.reply(Err(service_error(corrupt(
                "an SSD write was finished as a read",
            )))),
        }
    }

    /// Allocates a page id in the shard this node hosts as its own, the
    /// entry making `owner` its exclusive (dirty) owner (§6.5).
    pub fn alloc_here(&self, owner: u8) -> Result<(Pid, u32, u64), KvError> {
        let s = self
            .shard(self.index)
            .filter(|s| !s.frozen.load(Ordering::SeqCst))
            .ok_or_else(|| corrupt(format!("node {} hosts no own shard", self.index)))?;
        let slot = s.next_slot.fetch_add(1, Ordering::AcqRel);
        let pid = Pid::new(self.index, slot);
        let (fi, mut m) = self
            .frames
            .lock_or_insert(pid)
            .map_err(|_| KvError::Exhausted("the frame table is full".into()))?;
        let mut d = Dir::new(s.tick());
        d.owners = Owners::Exclusive(owner);
        d.dirty = true;
        let epoch = d.epoch;
        m.dir = Some(Box::new(d));
        Ok((pid, fi, epoch))
    }

    /// Whether this node takes allocations (it hosts its own shard and is
    /// not leaving).
    pub fn allocates(&self) -> bool {
        self.state() == NodeState::Active
            && self
                .shard(self.index)
                .is_some_and(|s| !s.frozen.load(Ordering::SeqCst))
    }

    /// An eviction batch from member `from` (§4.2–4.3): accepts a page iff
    /// `from` still owns it at the epoch it sent (owner stability) and has
    /// served every copy the directory told others to take from it; dirty
    /// pages whose last copy goes are marked `evicting` and returned as
    /// [`Evicted::Pulling`]: the SSD completer pulls them by one batched
    /// one-sided read into this node's cache (or, if it has no room, to
    /// the SSD) and answers the batch, so the handler waits neither for
    /// the network nor for the device (invariants 16 and 20).
    pub fn handle_evict(&self, from: u8, entries: &[EvictEntry]) -> Result<Evicted, KvError> {
        if let Some(e) = entries.first()
            && self.shard(e.pid.shard()).is_none()
            && let Some(h) = self.host_of(e.pid.shard()).filter(|h| *h != self.index)
        {
            return Ok(Evicted::Reply(EvictReply::Moved(h)));
        }
        let mut accepted = vec![false; entries.len()];
        let mut pulls: Vec<(usize, u32)> = Vec::new();
        for (i, e) in entries.iter().enumerate() {
            let Some(shard) = self.shard(e.pid.shard()) else {
                continue;
            };
            if shard.frozen.load(Ordering::SeqCst)
                || e.pid.slot() >= shard.next_slot.load(Ordering::Acquire)
                || !e.offset.is_multiple_of(PAGE_SIZE as u64)
            {
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
            // Again under the entry's mutex (invariant 18): a leaver that
            // froze the shard after the look above may have read this
            // entry for its successor already; deciding now would change
            // an entry that is no longer the one handed over.
            if shard.frozen.load(Ordering::SeqCst) {
                Counters::add(&self.stats.evict_declined, 1);
                continue;
            }
            let Some(d) = m.dir.as_mut() else { continue };
            if d.epoch != e.epoch
                || d.transfer.is_some()
                || d.in_flight()
                || !d.owners.contains(from)
                || d.copies_granted(from) > e.copies
            {
                Counters::add(&self.stats.evict_declined, 1);
                continue;
            }
            let rest = d.owners.without(from);
            if rest == Owners::None && d.dirty {
                d.evicting = true;
                pulls.push((i, fi));
            } else {
                d.owners = rest;
                d.forget_copies(from);
                accepted[i] = true;
                if f.local().mode == Possession::None
                    && f.local().slot == NONE
                    && m.unused()
                    && f.latch.try_exclusive()
                {
                    self.maybe_remove(fi, &mut m);
                    f.latch.unlock_exclusive();
                }
            }
        }
        if pulls.is_empty() {
            return Ok(Evicted::Reply(EvictReply::Decided(accepted)));
        }
        let p = EvictPull {
            from,
            entries: entries.to_vec(),
            pulls,
            accepted,
        };
        if self.member(from).is_none() {
            self.pull_failed(&p);
            return Err(corrupt(format!("unknown member {from}")));
        }
        Ok(Evicted::Pulling(p))
    }

    /// Hands an eviction batch's pull, with the batch's responder, to the
    /// SSD completer, which posts the one-sided read and finishes the
    /// batch when it completes ([`Self::finish_pull_job`]): the handler
    /// does not wait for the network (invariant 20).
    pub fn submit_pull(&self, p: EvictPull, responder: Responder) {
        let pid = p.entries[p.pulls[0].0].pid;
        // The shard cannot go while entries of it are `evicting`: a leaver
        // waits for them before it hands the shard over.
        let shard = self
            .shard(pid.shard())
            .expect("checked under the entry's mutex");
        self.ssd_jobs.push(crate::ssdio::Job::new(
            shard,
            crate::ssdio::Work::Pull(p),
            responder,
        ));
    }

    /// Reads the pages of pull `p` from the evicter's cache: one batched
    /// one-sided READ, from this thread's endpoint (the completer's).
    pub async fn read_pulled(&self, p: &EvictPull) -> Result<dmkv_transport::BatchResult, KvError> {
        let member = self
            .member(p.from)
            .ok_or_else(|| corrupt(format!("unknown member {}", p.from)))?;
        let ep = self.thread_ep()?;
        let mut b = ep.batch();
        for (i, _) in &p.pulls {
            b.read(member.region.at(p.entries[*i].offset), PAGE_SIZE);
        }
        b.run().await.map_err(KvError::from)
    }

    /// Finishes an eviction batch whose pull completed (`read`) and
    /// answers it, or hands its SSD write on to the completer (which then
    /// answers).
    pub fn finish_pull_job(
        &self,
        p: EvictPull,
        read: Result<dmkv_transport::BatchResult, KvError>,
        responder: Responder,
    ) {
        dmkv_transport::sim::work(crate::handler::cost::PULL);
        match self.finish_pull(p, read) {
            Ok(Evicted::Reply(r)) => responder.reply(Ok(r.encode())),
            Ok(Evicted::Writing(w)) => self.submit_evict_write(w, responder),
            Ok(Evicted::Pulling(_)) => unreachable!("a pull is finished once"),
            Err(e) => responder.reply(Err(service_error(e))),
        }
    }

    /// A pull could not be made: its entries stop `evicting` (the evicter
    /// keeps its copies) and what they held is answered.
    fn pull_failed(&self, p: &EvictPull) {
        let mut out = Vec::new();
        for (_, fi) in &p.pulls {
            let mut m = self.frames.frame(*fi).meta.lock();
            if let Some(d) = m.dir.as_mut() {
                d.evicting = false;
            }
            self.directory_retry(*fi, &mut m, &mut out);
        }
        for (r, a) in out {
            r.reply(a);
        }
    }

    /// Hands the SSD write of an eviction batch's pulled pages, with the
    /// batch's responder, to the SSD completer, which answers the batch
    /// once they are written ([`Self::finish_evict_write`]).
    pub fn submit_evict_write(&self, w: EvictWrite, responder: Responder) {
        let shard = w.pages[0].0.clone();
        self.ssd_jobs.push(crate::ssdio::Job::new(
            shard,
            crate::ssdio::Work::Evict(w),
            responder,
        ));
    }

    /// The pulled pages of an eviction batch are written (`ok`) or not:
    /// under each entry's mutex the entry stops `evicting`; written, the
    /// page is only on the SSD, clean, and accepted; not written, the
    /// evicter keeps its copy (declined) and the entry is as before the
    /// pull. Requests held meanwhile are answered. Returns the batch's
    /// answer.
    pub fn finish_evict_write(&self, w: EvictWrite, ok: bool) -> Vec<u8> {
        let EvictWrite {
            mut accepted,
            pages,
        } = w;
        let n: usize = pages.iter().map(|(_, list)| list.len()).sum();
        dmkv_transport::sim::work(
            crate::handler::cost::EVICT_WRITTEN
                + crate::handler::cost::EVICT_WRITTEN_PAGE * n as u64,
        );
        let mut out = Vec::new();
        for (_, list) in &pages {
            for p in list {
                let f = self.frames.frame(p.fi);
                let mut m = f.meta.lock();
                // The frame cannot have been removed or reused: an entry
                // that is `evicting` is not idle.
                let Some(d) = m.dir.as_mut().filter(|_| f.pid() == p.pid) else {
                    continue;
                };
                d.evicting = false;
                // While `evicting`, nothing was granted (every request was
                // held), so the epoch is the one the pull saw and the page
                // written is the page's content (invariant 17's rule:
                // nothing modified since the copy is dropped clean).
                if ok && d.epoch == p.epoch {
                    d.owners = Owners::None;
                    d.dirty = false;
                    d.copy_grants.clear();
                    accepted[p.entry] = true;
                }
                self.directory_retry(p.fi, &mut m, &mut out);
            }
        }
        for (r, a) in out {
            r.reply(a);
        }
        EvictReply::Decided(accepted).encode()
    }

    /// The pull of `p` completed with `read`: the pages this node's cache
    /// takes are decided here; the rest are returned, per shard, for the
    /// SSD completer to write (their entries stay `evicting` until then).
    /// A failed read lets the entries go (the evicter keeps its copies)
    /// and is the batch's error.
    pub fn finish_pull(
        &self,
        p: EvictPull,
        read: Result<dmkv_transport::BatchResult, KvError>,
    ) -> Result<Evicted, KvError> {
        let mut res = match read {
            Ok(r) => r,
            Err(e) => {
                self.pull_failed(&p);
                return Err(e);
            }
        };
        let EvictPull {
            entries,
            pulls,
            mut accepted,
            ..
        } = p;
        // Into our cache where there is room; the rest to the SSD in one
        // batch per shard.
        let caching = self.state() == NodeState::Active;
        let mut to_ssd: Vec<(usize, u32, u64, AlignedPage)> = Vec::new();
        for (k, (i, fi)) in pulls.iter().enumerate() {
            let bytes = res.take_read(k);
            Counters::add(&self.stats.pulled, 1);
            let f = self.frames.frame(*fi);
            let mut m = f.meta.lock();
            let l = f.local();
            let slot = if caching
                && l.mode == Possession::None
                && l.slot == NONE
                && m.awaiting == Awaiting::No
                && f.latch.try_exclusive()
            {
                match self.take_slot() {
                    Some(s) => Some(s),
                    None => {
                        f.latch.unlock_exclusive();
                        None
                    }
                }
            } else {
                None
            };
            match slot {
                Some(s) => {
                    self.page(s).fill(&bytes);
                    let d = m.dir.as_mut().expect("an entry being evicted");
                    d.owners = Owners::Exclusive(self.index);
                    d.copy_grants.clear();
                    d.evicting = false;
                    m.epoch = m.dir.as_ref().map_or(0, |d| d.epoch);
                    m.copies_served = 0;
                    f.touch(self.global_epoch.load(Ordering::Relaxed));
                    f.set_possession(Possession::Exclusive, s);
                    f.latch.unlock_exclusive();
                    accepted[*i] = true;
                    let mut out = Vec::new();
                    self.directory_retry(*fi, &mut m, &mut out);
                    drop(m);
                    for (r, a) in out {
                        r.reply(a);
                    }
                }
                None => {
                    let mut page = AlignedPage::default();
                    page.bytes_mut().copy_from_slice(&bytes);
                    let epoch = m.dir.as_ref().map_or(0, |d| d.epoch);
                    to_ssd.push((*i, *fi, epoch, page));
                }
            }
        }
        if to_ssd.is_empty() {
            return Ok(Evicted::Reply(EvictReply::Decided(accepted)));
        }
        // One write batch per shard (a node may host an adopted shard
        // besides its own), in shard order.
        let mut by_shard: std::collections::BTreeMap<u8, Vec<PulledPage>> = Default::default();
        for (i, fi, epoch, page) in to_ssd {
            let pid = entries[i].pid;
            by_shard.entry(pid.shard()).or_default().push(PulledPage {
                entry: i,
                fi,
                pid,
                epoch,
                page,
            });
        }
        let pages = by_shard
            .into_iter()
            .map(|(id, list)| {
                // The shard cannot go while entries of it are `evicting`:
                // a leaver waits for them before it hands the shard over.
                (self.shard(id).expect("checked above"), list)
            })
            .collect();
        Ok(Evicted::Writing(EvictWrite { accepted, pages }))
    }
}

/// A grant's posted delivery with the grant it answers filled in.
fn decided(mut p: crate::ssdio::Delivery, g: Grant) -> crate::ssdio::Delivery {
    if let crate::ssdio::Then::Grant { grant, .. } = &mut p.then {
        *grant = g;
    }
    p
}
