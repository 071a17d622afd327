//! A worker: a compute thread's view of its node, implementing [`Pager`]
//! for the guards. The local hot path (§3.2) decides without any message;
//! the remote invocation (§3.3) asks the directory and resolves conflicts
//! on the requester's side (§3.5): it moves the page from the predecessor
//! the directory named (which may still be waiting for it: anticipatory
//! chaining, §3.4.3), or copies it from a sharer, then invalidates the
//! other sharers, all invalidations in flight at once.

use crate::directory::{Decision, LocalRead, OwnRequest};
use crate::frames::{Awaiting, NONE, Possession};
use crate::guard::{Fixed, Mode, PageError, PageResult, Pager};
use crate::latch::{Backoff, HybridLatch};
use crate::msg::{Grant, Reply, Request, Source, Want};
use crate::node::{Counters, Protocol, ScaleNode, members_of};
use crate::page::{PAGE_SIZE, PageRef};
use crate::pid::Pid;
use crate::trace::{self, Cause};
use dmkv_api::KvError;
use dmkv_transport::Endpoint;
use dmkv_transport::exec::yield_now;
use dmkv_transport::time::Instant;
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::Poll;

/// A compute thread's pager on a node.
pub struct Worker {
    pub node: Arc<ScaleNode>,
    pub ep: Rc<Endpoint>,
    /// FIFO acknowledgements posted to remote directories whose answers
    /// are not awaited yet (see [`Worker::acknowledge`]), oldest first.
    /// Dropping the worker drops them unanswered: the messages went out at
    /// their first poll (sim and UCX post in the call; the local transport
    /// too unless it injects latency, which is why engine operations end
    /// with [`Worker::settle_acks`] and users of a bare worker should).
    acks: RefCell<Vec<PendingAck>>,
}

/// The answer to a posted acknowledgement.
type AckReply = Pin<Box<dyn Future<Output = dmkv_transport::Result<Vec<u8>>>>>;

/// An acknowledgement (`Request::Ack`) posted to directory `dir`.
struct PendingAck {
    dir: u8,
    pid: Pid,
    reply: AckReply,
}

fn fatal(e: impl Into<KvError>) -> PageError {
    PageError::Fatal(e.into())
}

fn corrupt(m: String) -> PageError {
    PageError::Fatal(KvError::Corrupt(m))
}

fn need_of(mode: Mode) -> Possession {
    if mode == Mode::Exclusive {
        Possession::Exclusive
    } else {
        Possession::Shared
    }
}

impl Worker {
    pub fn new(node: Arc<ScaleNode>, ep: Rc<Endpoint>) -> Worker {
        Worker {
            node,
            ep,
            acks: RefCell::new(Vec::new()),
        }
    }

    /// Sends a protocol message to member `to` and decodes the reply.
    async fn send(&self, to: u8, q: Request) -> PageResult<Reply> {
        self.send_member(to, q)
            .await?
            .ok_or_else(|| corrupt(format!("node {to} is no member")))
    }

    /// [`Self::send`], or `None` if `to` is no member (any more). An
    /// acknowledgement to `to` still unanswered is awaited first: one
    /// message at a time from a worker to a node, as with the paper's
    /// per-worker mailboxes (§3.5), and the directory sees our
    /// acknowledgement before our next request.
    async fn send_member(&self, to: u8, q: Request) -> PageResult<Option<Reply>> {
        self.settle_to(Some(to)).await?;
        self.post_member(to, q).await
    }

    /// [`Self::send_member`] without settling acknowledgements first.
    async fn post_member(&self, to: u8, q: Request) -> PageResult<Option<Reply>> {
        let Some(m) = self.node.member(to) else {
            return Ok(None);
        };
        self.node.stats.sent(q.kind());
        let reply = self
            .ep
            .call(m.node, m.service, q.encode())
            .await
            .map_err(fatal)?;
        Reply::decode(&reply)
            .map(Some)
            .map_err(|e| fatal(dmkv_transport::TransportError::from(e)))
    }

    /// Sends `q` about `pid` to its directory `dir`; `None` if `dir` left
    /// in the meantime (a `Depart` arrived between our reading the host and
    /// the member). `Depart` records the shard's new host before it forgets
    /// the member, so asking again reaches the new host.
    async fn send_directory(&self, pid: Pid, dir: u8, q: Request) -> PageResult<Option<Reply>> {
        let r = self.send_member(dir, q).await?;
        if r.is_none() && self.node.host_of(pid.shard()) == Some(dir) {
            return Err(corrupt(format!(
                "{pid}: directory {dir} is no member, and no other host is known"
            )));
        }
        Ok(r)
    }

    /// The hot path (§3.2): the page is here in a sufficient mode; latch it
    /// without any message. `None` means "take the slow path".
    fn hot(&self, pid: Pid, mode: Mode) -> Option<Fixed> {
        let fi = self.node.frames.find(pid)?;
        let f = self.node.frames.frame(fi);
        let need = need_of(mode);
        let epoch = self.node.global_epoch.load(Ordering::Relaxed);
        match mode {
            Mode::Optimistic => {
                let v = f.latch.optimistic()?;
                let l = f.local();
                if l.mode < need || l.waiting || f.pid() != pid || !f.latch.validate(v) {
                    return None;
                }
                f.touch(epoch);
                Some(Fixed {
                    pid,
                    frame: fi,
                    slot: l.slot,
                    version: v,
                    fresh: false,
                })
            }
            Mode::Shared | Mode::Exclusive => {
                let l = f.local();
                if l.mode < need || l.waiting {
                    return None;
                }
                let ok = if mode == Mode::Shared {
                    f.latch.try_shared()
                } else {
                    f.latch.try_exclusive()
                };
                if !ok {
                    return None;
                }
                let l = f.local();
                if l.mode < need || f.pid() != pid {
                    if mode == Mode::Shared {
                        f.latch.unlock_shared();
                    } else {
                        f.latch.unlock_exclusive();
                    }
                    self.node.released(fi);
                    return None;
                }
                f.touch(epoch);
                Some(Fixed {
                    pid,
                    frame: fi,
                    slot: l.slot,
                    version: 0,
                    fresh: false,
                })
            }
        }
    }

    /// A free cache slot, waking the page provider and waiting if needed.
    async fn slot(&self) -> PageResult<u32> {
        let span = trace::span();
        let r = self.slot_inner().await;
        span.end(Cause::Slot);
        r
    }

    async fn slot_inner(&self) -> PageResult<u32> {
        let start = Instant::now();
        let mut b = Backoff::default();
        loop {
            if let Some(s) = self.node.take_slot() {
                return Ok(s);
            }
            self.node.wake_provider();
            if start.elapsed() > self.node.cfg.slot_wait {
                return Err(fatal(KvError::Exhausted(format!(
                    "node {}: no free cache slot for {:?} (all {} pages latched?)",
                    self.node.index, self.node.cfg.slot_wait, self.node.cfg.pages
                ))));
            }
            b.pause().await;
        }
    }

    /// The directory of `pid` now (following `Moved` answers).
    fn directory_of(&self, pid: Pid) -> PageResult<u8> {
        self.node
            .host_of(pid.shard())
            .ok_or_else(|| corrupt(format!("{pid}: no directory known")))
    }

    /// Asks the directory of `pid` (a message, or a call if it is here);
    /// returns the grant and the directory that gave it.
    async fn ask_directory(
        &self,
        pid: Pid,
        want: Want,
        retry: bool,
        offset: u64,
    ) -> PageResult<(Grant, u8)> {
        let node = &self.node;
        let mut b = Backoff::default();
        loop {
            let dir = self.directory_of(pid)?;
            let reply = if dir == node.index {
                let q = OwnRequest {
                    from: node.index,
                    pid,
                    want,
                    retry,
                    offset,
                };
                match node.own_request(q, &mut None).map_err(fatal)? {
                    Decision::Reply(r) => r,
                    Decision::Read(g) => {
                        // Granted from our SSD (invariant 19): the entry is
                        // `reading` until `read` drops, and we read and
                        // deliver without its mutex, so our handlers hold
                        // requests for it meanwhile instead of blocking
                        // their threads on the mutex. Under the simulated
                        // cluster the device's time passes as a task
                        // (other tasks of this thread run meanwhile),
                        // with the entry still `reading`.
                        let mut read = LocalRead::new(node.clone(), pid);
                        let span = trace::span();
                        let r = node.read_for_self(pid, offset);
                        if r.is_err() {
                            read.failed();
                        }
                        crate::ssd::settle_sim_wait().await;
                        span.end(Cause::LocalSsd);
                        drop(read);
                        r.map_err(fatal)?;
                        Reply::Grant(g)
                    }
                    Decision::Busy | Decision::Held => {
                        // Our own directory is busy with this entry (an
                        // eviction pull, a FIFO transfer, a handover).
                        // Under FIFO the page is left to us after the
                        // acknowledgement: ask again soon.
                        let span = trace::span();
                        if node.cfg.protocol == Protocol::Fifo {
                            b.pause_short().await;
                        } else {
                            b.pause().await;
                        }
                        span.end(Cause::Backoff);
                        continue;
                    }
                }
            } else {
                let q = Request::Own {
                    pid,
                    want,
                    retry,
                    offset,
                };
                let span = trace::span();
                let r = self.send_directory(pid, dir, q).await?;
                span.end(match r {
                    Some(Reply::Grant(g)) => match g.source {
                        Source::Written => Cause::OwnWritten,
                        Source::Kept => Cause::OwnKept,
                        Source::Move(_) => Cause::OwnMove,
                        Source::Copy(_) => Cause::OwnCopy,
                    },
                    _ => Cause::OwnWritten,
                });
                match r {
                    Some(r) => r,
                    None => continue,
                }
            };
            match reply {
                Reply::Grant(g) => return Ok((g, dir)),
                Reply::Moved(h) if h != dir => node.set_host(pid.shard(), h),
                Reply::Retry => {
                    // The shard is being handed over: let go of every latch
                    // (see `answer_during_handover`) and ask again.
                    let span = trace::span();
                    b.pause().await;
                    span.end(Cause::Backoff);
                    return Err(PageError::Restart);
                }
                r => return Err(corrupt(format!("{pid}: unexpected directory reply {r:?}"))),
            }
        }
    }

    /// Sends `q` about `pid` to its directory, following `Moved`; returns
    /// the reply and the directory that gave it.
    async fn to_directory(&self, pid: Pid, q: Request) -> PageResult<(Reply, u8)> {
        loop {
            let dir = self.directory_of(pid)?;
            let r = if dir == self.node.index {
                match q {
                    Request::Ack { pid } => {
                        self.node.ack(dir, pid, false).map_err(fatal)?;
                        Reply::Done
                    }
                    Request::SsdFetch { pid, epoch, offset } => {
                        let r = self.node.ssd_fetch(dir, pid, epoch, offset);
                        let span = trace::span();
                        crate::ssd::settle_sim_wait().await;
                        span.end(Cause::LocalSsd);
                        r.map_err(fatal)?
                    }
                    _ => unreachable!("only acks and SSD fetches"),
                }
            } else {
                let span = trace::span();
                let r = self.send_directory(pid, dir, q).await?;
                span.end(match q {
                    Request::Ack { .. } => Cause::Ack,
                    _ => Cause::SsdFetch,
                });
                match r {
                    Some(r) => r,
                    None => continue,
                }
            };
            match r {
                Reply::Moved(h) if h != dir => self.node.set_host(pid.shard(), h),
                r => return Ok((r, dir)),
            }
        }
    }

    /// The remote invocation path with frame `fi` latched exclusively:
    /// obtains `want` ownership and the page into `slot`. `Ok(false)`: a copy
    /// from a sharer found nothing; the caller lets go and asks again.
    async fn obtain(
        &self,
        fi: u32,
        pid: Pid,
        want: Want,
        retry: bool,
        slot: u32,
    ) -> PageResult<bool> {
        let res = self.obtain_inner(fi, pid, want, retry, slot).await;
        if res.is_err() {
            self.node.frames.frame(fi).meta.lock().awaiting = Awaiting::No;
            self.node.released(fi);
        }
        res
    }

    async fn obtain_inner(
        &self,
        fi: u32,
        pid: Pid,
        want: Want,
        retry: bool,
        slot: u32,
    ) -> PageResult<bool> {
        let node = &self.node;
        let f = node.frames.frame(fi);
        let offset = ScaleNode::offset_of(slot);
        let retry = {
            let mut m = f.meta.lock();
            m.awaiting = Awaiting::Unknown;
            retry || m.phantom
        };
        let (g, granted_by) = self.ask_directory(pid, want, retry, offset).await?;
        f.meta.lock().awaiting = Awaiting::Known(g.epoch);
        // Requests parked on our older copy can be decided now.
        node.released(fi);
        let mut invalidate = g.invalidate & !(1 << node.index);
        let mut ok = true;
        // The node that wrote the page into our slot one-sided, if another
        // one did: its 4 KiB are this operation's (see `charge_pushed`).
        let mut pushed_by: Option<u8> = None;
        match g.source {
            Source::Written => pushed_by = Some(granted_by),
            Source::Kept => {
                if f.local().mode == Possession::None {
                    return Err(corrupt(format!(
                        "{pid}: the directory says we keep a copy we do not have"
                    )));
                }
            }
            Source::Move(n) => {
                // Take the page from the predecessor; if it turns out not to
                // hold it (a sharer whose copy failed), try the others; if
                // nobody does, the SSD copy is current (checked there).
                let mut cands = vec![n];
                cands.extend(members_of(invalidate).filter(|c| *c != n));
                let mut got = false;
                for c in cands {
                    let span = trace::span();
                    let r = self
                        .send(
                            c,
                            Request::Move {
                                pid,
                                epoch: g.epoch,
                                need_page: true,
                                offset,
                            },
                        )
                        .await?;
                    span.end(Cause::Move);
                    invalidate &= !(1 << c);
                    if r == Reply::Done {
                        pushed_by = Some(c);
                        got = true;
                        break;
                    }
                }
                if !got {
                    let q = Request::SsdFetch {
                        pid,
                        epoch: g.epoch,
                        offset,
                    };
                    let (r, d) = self.to_directory(pid, q).await?;
                    if r != Reply::Done {
                        return Err(corrupt(format!("{pid}: SSD fetch answered {r:?}")));
                    }
                    pushed_by = Some(d);
                }
            }
            Source::Copy(s) => {
                let q = Request::Copy {
                    pid,
                    epoch: g.epoch,
                    offset,
                };
                let span = trace::span();
                let r = self.send(s, q).await?;
                span.end(Cause::Copy);
                match r {
                    Reply::Done => pushed_by = Some(s),
                    Reply::Gone => {
                        Counters::add(&node.stats.copy_failures, 1);
                        ok = false;
                    }
                    r => return Err(corrupt(format!("{pid}: copy answered {r:?}"))),
                }
            }
        }
        if pushed_by.is_some_and(|n| n != node.index) {
            self.ep.charge_pushed(PAGE_SIZE as u64);
        }
        if ok && invalidate != 0 {
            // Invalidate the other sharers, all at once (§3.3).
            let calls = members_of(invalidate).map(|t| {
                self.send(
                    t,
                    Request::Move {
                        pid,
                        epoch: g.epoch,
                        need_page: false,
                        offset: 0,
                    },
                )
            });
            let span = trace::span();
            let rs = futures::future::join_all(calls).await;
            span.end(Cause::Invalidate);
            for r in rs {
                match r? {
                    Reply::Done => {}
                    r => return Err(corrupt(format!("{pid}: invalidation answered {r:?}"))),
                }
            }
        }
        if node.cfg.protocol == Protocol::Fifo {
            // Posted, not awaited: the page is ours to use now (see
            // `acknowledge`), unless `scalestore.fifo_ack=await`.
            self.acknowledge(pid).await?;
            if node.cfg.await_ack {
                self.settle_to(None).await?;
            }
        }
        {
            let mut m = f.meta.lock();
            m.awaiting = Awaiting::No;
            m.phantom = !ok;
            if ok {
                m.epoch = g.epoch;
                m.copies_served = 0;
                let mode = if want == Want::Exclusive {
                    Possession::Exclusive
                } else {
                    Possession::Shared
                };
                f.set_possession(mode, slot);
            } else {
                f.set_possession(Possession::None, slot);
            }
        }
        node.released(fi);
        Ok(ok)
    }

    /// FIFO (§3.4.2, Fig. 5(b)): tells the directory of `pid` that the
    /// transfer it granted us is complete, so that it grants the next
    /// queued request. To a remote directory the message is posted (the
    /// first poll of a call posts it on every backend) and its answer is
    /// awaited only before this worker's next message to that node
    /// ([`Self::send_member`]), when an operation of the engine ends
    /// ([`Self::settle_acks`]), or found ready on a later `fix`: the page
    /// is used meanwhile. Awaiting the answer first would keep the page
    /// idle for a round trip per hand-over, which neither the paper's FIFO
    /// (whose mailboxes need the answer only before the next message,
    /// §3.5) nor anticipatory chaining pays. Acknowledgements to our own
    /// directory are a call, as before.
    async fn acknowledge(&self, pid: Pid) -> PageResult<()> {
        let dir = self.directory_of(pid)?;
        let member = if dir == self.node.index {
            None
        } else {
            self.node.member(dir)
        };
        let Some(m) = member else {
            // Ours, or the directory left since we read its host: the
            // awaited path (it follows the shard to its new host).
            let (r, _) = self.to_directory(pid, Request::Ack { pid }).await?;
            return Self::check_acked(pid, r);
        };
        self.settle_to(Some(dir)).await?;
        self.node.stats.sent(crate::msg::Kind::Ack);
        let ep = self.ep.clone();
        let payload = Request::Ack { pid }.encode();
        let mut reply: AckReply =
            Box::pin(async move { ep.call(m.node, m.service, payload).await });
        match futures::poll!(reply.as_mut()) {
            Poll::Ready(r) => self.acked(dir, pid, r).await,
            Poll::Pending => {
                self.acks.borrow_mut().push(PendingAck { dir, pid, reply });
                Ok(())
            }
        }
    }

    fn check_acked(pid: Pid, r: Reply) -> PageResult<()> {
        match r {
            Reply::Done => Ok(()),
            r => Err(corrupt(format!("{pid}: acknowledgement answered {r:?}"))),
        }
    }

    /// Handles the answer `r` of an acknowledgement posted to `dir`. If
    /// the shard moved meanwhile (a handover), the acknowledgement goes to
    /// its new host, awaited.
    async fn acked(&self, dir: u8, pid: Pid, r: dmkv_transport::Result<Vec<u8>>) -> PageResult<()> {
        let r = r.map_err(fatal)?;
        let mut r =
            Reply::decode(&r).map_err(|e| fatal(dmkv_transport::TransportError::from(e)))?;
        let mut dir = dir;
        loop {
            match r {
                Reply::Moved(h) if h != dir => self.node.set_host(pid.shard(), h),
                r => return Self::check_acked(pid, r),
            }
            dir = self.directory_of(pid)?;
            if dir == self.node.index {
                self.node.ack(dir, pid, false).map_err(fatal)?;
                return Ok(());
            }
            r = match self.post_member(dir, Request::Ack { pid }).await? {
                Some(r) => r,
                None if self.node.host_of(pid.shard()) == Some(dir) => {
                    return Err(corrupt(format!(
                        "{pid}: directory {dir} is no member, and no other host is known"
                    )));
                }
                None => Reply::Moved(self.directory_of(pid)?),
            };
        }
    }

    /// Awaits the answers of the acknowledgements posted to `dir` (to any
    /// node if `None`), oldest first.
    async fn settle_to(&self, dir: Option<u8>) -> PageResult<()> {
        loop {
            let next = {
                let mut acks = self.acks.borrow_mut();
                acks.iter()
                    .position(|p| dir.is_none_or(|d| p.dir == d))
                    .map(|i| acks.remove(i))
            };
            let Some(p) = next else {
                return Ok(());
            };
            let span = trace::span();
            let r = p.reply.await;
            span.end(Cause::Ack);
            self.acked(p.dir, p.pid, r).await?;
        }
    }

    /// Handles the acknowledgements whose answers have arrived, without
    /// waiting for the others.
    async fn reap_acks(&self) -> PageResult<()> {
        let ready = std::future::poll_fn(|cx| {
            let mut acks = self.acks.borrow_mut();
            let mut ready = Vec::new();
            let mut i = 0;
            while i < acks.len() {
                match acks[i].reply.as_mut().poll(cx) {
                    Poll::Ready(r) => {
                        let p = acks.remove(i);
                        ready.push((p.dir, p.pid, r));
                    }
                    Poll::Pending => i += 1,
                }
            }
            Poll::Ready(ready)
        })
        .await;
        for (dir, pid, r) in ready {
            self.acked(dir, pid, r).await?;
        }
        Ok(())
    }

    /// Awaits every acknowledgement this worker posted (FIFO): an engine
    /// operation ends with it, so that a failed acknowledgement is its
    /// error and none is left unsent by a backend that posts late (the
    /// local transport's injected latency). Nothing to do under chaining.
    pub async fn settle_acks(&self) -> Result<(), KvError> {
        match self.settle_to(None).await {
            Ok(()) => Ok(()),
            Err(PageError::Fatal(e)) => Err(e),
            Err(PageError::Restart) => Err(KvError::Corrupt(
                "an acknowledgement asked for a restart".into(),
            )),
        }
    }

    /// Latches frame `fi` exclusively for the slow path, waiting while a
    /// remote request is parked on it (under chaining it goes first).
    async fn latch_cold(&self, fi: u32) {
        let f = self.node.frames.frame(fi);
        // Woken by the latch's release or by `waiting` clearing (no
        // polling; invariant 15).
        let span = trace::span();
        f.latch
            .wait_until(|| !f.local().waiting && f.latch.try_exclusive())
            .await;
        span.end(Cause::Latch);
    }

    /// The slow path: latch the frame exclusively and run the protocol.
    async fn cold(&self, pid: Pid, mode: Mode) -> PageResult<Option<Fixed>> {
        let node = &self.node;
        let fi = node
            .frames
            .find_or_insert(pid)
            .map_err(|_| fatal(KvError::Exhausted("the frame table is full".into())))?;
        let f = node.frames.frame(fi);
        self.latch_cold(fi).await;
        if f.pid() != pid {
            f.latch.unlock_exclusive();
            node.released(fi);
            return Ok(None);
        }
        let need = need_of(mode);
        let want = if mode == Mode::Exclusive {
            Want::Exclusive
        } else {
            Want::Shared
        };
        let mut retry = false;
        loop {
            let l = f.local();
            if l.mode >= need {
                break;
            }
            let slot = if l.slot != NONE {
                l.slot
            } else {
                let s = match self.slot().await {
                    Ok(s) => s,
                    Err(e) => {
                        self.release_empty(fi);
                        return Err(e);
                    }
                };
                let _m = f.meta.lock();
                f.set_possession(Possession::None, s);
                s
            };
            match self.obtain(fi, pid, want, retry, slot).await {
                Ok(true) => break,
                Ok(false) => {
                    // Our copy failed (its source was invalidated before it
                    // served us): let go, so that whoever is ahead of us can
                    // finish, and ask again telling the directory we hold
                    // nothing.
                    retry = true;
                    self.release_empty(fi);
                    std::thread::yield_now();
                    yield_now().await;
                    self.latch_cold(fi).await;
                    if f.pid() != pid {
                        f.latch.unlock_exclusive();
                        node.released(fi);
                        return Ok(None);
                    }
                }
                Err(e) => {
                    self.release_empty(fi);
                    return Err(e);
                }
            }
        }
        f.touch(node.global_epoch.load(Ordering::Relaxed));
        let l = f.local();
        let fixed = |version, fresh| Fixed {
            pid,
            frame: fi,
            slot: l.slot,
            version,
            fresh,
        };
        Ok(Some(match mode {
            Mode::Exclusive => fixed(0, false),
            Mode::Shared => {
                f.latch.downgrade_exclusive_to_shared();
                node.released(fi);
                fixed(0, false)
            }
            Mode::Optimistic => {
                // Keep the page here until the optimistic guard is dropped:
                // a move parked on it would otherwise take the page before
                // this first use could validate, and under contention no
                // optimistic reader would ever finish (see `holder`).
                {
                    let _m = f.meta.lock();
                    f.set_fresh(true);
                }
                let v = f.latch.downgrade_exclusive_to_optimistic();
                fixed(v, true)
            }
        }))
    }

    /// Unlatches a frame that holds no copy, giving its slot back (and the
    /// frame, if nothing else needs it).
    fn release_empty(&self, fi: u32) {
        let f = self.node.frames.frame(fi);
        {
            let mut m = f.meta.lock();
            let l = f.local();
            if l.mode == Possession::None {
                if l.slot != NONE {
                    self.node.free_slot(l.slot);
                }
                f.set_possession(Possession::None, NONE);
                self.node.maybe_remove(fi, &mut m);
            }
        }
        f.latch.unlock_exclusive();
        self.node.released(fi);
    }

    /// Allocates a page id on a directory (round-robin or here, §6.5).
    async fn allocate_pid(&self) -> PageResult<(Pid, u64)> {
        let node = &self.node;
        let mut target = node.alloc_target();
        for _ in 0..64 {
            if target == node.index && node.allocates() {
                let (pid, _, epoch) = node.alloc_here(node.index).map_err(fatal)?;
                return Ok((pid, epoch));
            }
            if target == node.index {
                // We take no allocations (leaving): ask someone who does.
                target = node
                    .members()
                    .into_iter()
                    .map(|(i, _)| i)
                    .find(|&i| i != node.index && node.host_of(i) == Some(i))
                    .ok_or_else(|| {
                        fatal(KvError::Exhausted("no member takes allocations".into()))
                    })?;
            }
            let span = trace::span();
            let r = self.send_member(target, Request::Alloc).await?;
            span.end(Cause::Alloc);
            match r {
                Some(Reply::Allocated(p, e)) if p.shard() == target => return Ok((p, e)),
                Some(Reply::Moved(h)) => target = h,
                // It left since we picked it: pick again.
                None => target = node.alloc_target(),
                Some(r) => return Err(corrupt(format!("unexpected allocation reply {r:?}"))),
            }
        }
        Err(fatal(KvError::Exhausted(
            "no member took the allocation".into(),
        )))
    }
}

impl Pager for Worker {
    fn latch(&self, frame: u32) -> &HybridLatch {
        &self.node.frames.frame(frame).latch
    }

    fn page(&self, slot: u32) -> PageRef<'_> {
        self.node.page(slot)
    }

    async fn fix(&self, pid: Pid, mode: Mode) -> PageResult<Fixed> {
        Counters::add(&self.node.stats.fixes, 1);
        // The cold paths' futures (a directory request, a page transfer,
        // acknowledgements) are boxed where they start: inline, they made
        // every operation's future ~9.5 KB, which each operation moved into
        // its slot (`KvStore::get_in`, one libc memcpy of the whole future
        // per op), though a page fixed hot never enters them.
        if !self.acks.borrow().is_empty() {
            Box::pin(self.reap_acks()).await?;
        }
        loop {
            if let Some(f) = self.hot(pid, mode) {
                Counters::add(&self.node.stats.hot, 1);
                return Ok(f);
            }
            // Here in a sufficient mode but latched against us, or a
            // remote request goes first: wait for the latch's release or
            // the flag's clearing on the latch's waiter list (invariant
            // 14), then try the hot path again.
            if let Some(fi) = self.node.frames.find(pid) {
                let f = self.node.frames.frame(fi);
                // Not blocked once the frame no longer holds `pid` (it
                // was removed, and may be reused for another page, while
                // we waited): the loop then looks the page up again.
                let blocked = || {
                    if f.pid() != pid {
                        return false;
                    }
                    let l = f.local();
                    let latched = if mode == Mode::Exclusive {
                        f.latch.is_latched()
                    } else {
                        f.latch.is_exclusive()
                    };
                    (l.mode >= need_of(mode) && latched) || l.waiting
                };
                if blocked() {
                    Counters::add(&self.node.stats.latch_waits, 1);
                    let span = trace::span();
                    f.latch.wait_until(|| !blocked()).await;
                    span.end(Cause::Latch);
                    continue;
                }
            }
            if let Some(f) = Box::pin(self.cold(pid, mode)).await? {
                return Ok(f);
            }
        }
    }

    async fn allocate(&self) -> PageResult<Fixed> {
        let node = &self.node;
        let (pid, epoch) = self.allocate_pid().await?;
        let fi = node
            .frames
            .find_or_insert(pid)
            .map_err(|_| fatal(KvError::Exhausted("the frame table is full".into())))?;
        let f = node.frames.frame(fi);
        f.latch.wait_until(|| f.latch.try_exclusive()).await;
        let slot = match self.slot().await {
            Ok(s) => s,
            Err(e) => {
                f.latch.unlock_exclusive();
                return Err(e);
            }
        };
        node.page(slot).fill(&[0u8; PAGE_SIZE]);
        {
            let mut m = f.meta.lock();
            m.epoch = epoch;
            m.copies_served = 0;
            f.set_possession(Possession::Exclusive, slot);
        }
        f.touch(node.global_epoch.load(Ordering::Relaxed));
        Ok(Fixed {
            pid,
            frame: fi,
            slot,
            version: 0,
            fresh: false,
        })
    }

    fn try_upgrade_exclusive(&self, f: &Fixed) -> bool {
        let fr = self.node.frames.frame(f.frame);
        if fr.local().mode != Possession::Exclusive || fr.local().waiting {
            return false;
        }
        fr.latch.try_upgrade_optimistic_to_exclusive(f.version)
    }

    fn catalog(&self) -> Pid {
        Pid::new(0, 0)
    }

    fn note_restart(&self) {
        Counters::add(&self.node.stats.restarts, 1);
        trace::restart();
    }

    fn released(&self, frame: u32) {
        self.node.released(frame);
    }
}
