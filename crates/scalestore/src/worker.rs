//! A worker: a compute thread's view of its node, implementing [`Pager`]
//! for the guards (paper §3.2 local hot path, §3.3 remote invocation with
//! conflict resolution on the requester's side).

use crate::frames::{Awaiting, Local, NONE, Possession};
use crate::guard::{Fixed, Mode, PageError, PageResult, Pager};
use crate::latch::{HybridLatch, acquire_with};
use crate::msg::{Grant, Kind, Reply, Request, Source, Want};
use crate::node::{Counters, Protocol, ScaleNode};
use crate::page::{PAGE_SIZE, PageRef};
use crate::pid::Pid;
use dmkv_api::KvError;
use dmkv_transport::Endpoint;
use dmkv_transport::exec::yield_now;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

/// How long a worker waits for a free cache slot before giving up with a
/// clear error (the page provider frees slots continuously).
const SLOT_WAIT: Duration = Duration::from_secs(30);

/// How one round of the remote invocation ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Done,
    /// A copy from a sharer found nothing: ask again with `retry`.
    CopyFailed,
    /// The directory was busy or queued us: let go and ask again.
    Again,
}

/// A compute thread's pager on its home node.
pub struct Worker {
    pub node: Arc<ScaleNode>,
    pub ep: Rc<Endpoint>,
}

fn fatal(e: impl Into<KvError>) -> PageError {
    PageError::Fatal(e.into())
}

fn corrupt(m: String) -> PageError {
    PageError::Fatal(KvError::Corrupt(m))
}

impl Worker {
    pub fn new(node: Arc<ScaleNode>, ep: Rc<Endpoint>) -> Worker {
        Worker { node, ep }
    }

    /// Sends a protocol message to member `to` and decodes the reply.
    async fn send(&self, to: u8, q: Request) -> PageResult<Reply> {
        let m = self
            .node
            .member(to)
            .ok_or_else(|| corrupt(format!("no member {to}")))?;
        self.node.stats.sent(q.kind());
        let reply = self
            .ep
            .call(m.node, m.service, q.encode())
            .await
            .map_err(fatal)?;
        let r =
            Reply::decode(&reply).map_err(|e| fatal(dmkv_transport::TransportError::from(e)))?;
        match r {
            Reply::Busy => Counters::add(&self.node.stats.busy, 1),
            Reply::Queued => Counters::add(&self.node.stats.queued, 1),
            Reply::Gone => Counters::add(&self.node.stats.gone, 1),
            _ => {}
        }
        Ok(r)
    }

    /// Backs off after a busy reply.
    async fn backoff(&self, round: u32) {
        Counters::add(&self.node.stats.retries, 1);
        if round > 4 {
            std::thread::yield_now();
        }
        yield_now().await;
    }

    /// The hot path (§3.2): the page is here in a sufficient mode; latch it
    /// without any message. `None` means "take the slow path".
    fn hot(&self, pid: Pid, mode: Mode) -> Option<Fixed> {
        let fi = self.node.frames.find(pid)?;
        let f = self.node.frames.frame(fi);
        let need = if mode == Mode::Exclusive {
            Possession::Exclusive
        } else {
            Possession::Shared
        };
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
                    return None;
                }
                f.touch(epoch);
                Some(Fixed {
                    pid,
                    frame: fi,
                    slot: l.slot,
                    version: 0,
                })
            }
        }
    }

    /// A free cache slot, waiting for the page provider if needed.
    async fn slot(&self) -> PageResult<u32> {
        let start = Instant::now();
        loop {
            if let Some(s) = self.node.take_slot() {
                return Ok(s);
            }
            if start.elapsed() > SLOT_WAIT {
                return Err(fatal(KvError::Exhausted(format!(
                    "node {}: no free cache slot for {:?} (all {} pages latched?)",
                    self.node.index, SLOT_WAIT, self.node.cfg.pages
                ))));
            }
            std::thread::yield_now();
            yield_now().await;
        }
    }

    /// Asks the directory of `pid` (a message, or a call if it is here);
    /// `None` if it is busy or queued us (the caller lets go of the frame
    /// before asking again, so that transfers ahead of it can take its copy).
    async fn request(
        &self,
        pid: Pid,
        want: Want,
        retry: bool,
        offset: u64,
    ) -> PageResult<Option<Grant>> {
        loop {
            let dir = self
                .node
                .host_of(pid.shard())
                .ok_or_else(|| corrupt(format!("{pid}: no directory known")))?;
            let reply = if dir == self.node.index && self.node.directs(pid) {
                self.node
                    .grant(self.node.index, pid, want, retry, offset)
                    .map_err(fatal)?
            } else {
                self.send(
                    dir,
                    Request::Own {
                        pid,
                        want,
                        retry,
                        offset,
                    },
                )
                .await?
            };
            match reply {
                Reply::Grant(g) => return Ok(Some(g)),
                Reply::Busy | Reply::Queued => return Ok(None),
                Reply::Moved(h) => self.node.set_host(pid.shard(), h),
                r => return Err(corrupt(format!("{pid}: unexpected directory reply {r:?}"))),
            }
        }
    }

    /// Sends a move/invalidation/copy until it is not busy.
    async fn until_done(&self, to: u8, q: Request) -> PageResult<Reply> {
        let mut round = 0;
        loop {
            match self.send(to, q).await? {
                Reply::Busy => {
                    self.backoff(round).await;
                    round += 1;
                }
                r => return Ok(r),
            }
        }
    }

    /// The remote invocation path with the frame latched exclusively:
    /// obtains `want` ownership and the page into `slot`.
    async fn obtain(
        &self,
        fi: u32,
        pid: Pid,
        want: Want,
        retry: bool,
        slot: u32,
    ) -> PageResult<Outcome> {
        let res = self.obtain_inner(fi, pid, want, retry, slot).await;
        if res.is_err() {
            self.node.frames.frame(fi).meta.lock().awaiting = Awaiting::No;
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
    ) -> PageResult<Outcome> {
        let node = &self.node;
        let f = node.frames.frame(fi);
        let offset = ScaleNode::offset_of(slot);
        let retry = {
            let mut m = f.meta.lock();
            m.awaiting = Awaiting::Unknown;
            retry || m.phantom
        };
        let g = match self.request(pid, want, retry, offset).await {
            Ok(Some(g)) => g,
            Ok(None) => {
                f.meta.lock().awaiting = Awaiting::No;
                return Ok(Outcome::Again);
            }
            Err(e) => {
                f.meta.lock().awaiting = Awaiting::No;
                return Err(e);
            }
        };
        f.meta.lock().awaiting = Awaiting::Known(g.epoch);
        let mut invalidate = g.invalidate;
        let mut ok = true;
        match g.source {
            Source::Written => {
                if node.host_of(pid.shard()) != Some(node.index) {
                    Counters::add(&node.stats.pages_remote, 1);
                }
            }
            Source::Kept if f.local().mode != Possession::None => {}
            Source::Kept if want == Want::Shared => {
                // The directory lists us, but our copy failed earlier (or was
                // taken): ask again saying so.
                ok = false;
            }
            Source::Kept | Source::Move(_) => {
                // Take the page from the predecessor; if it turns out not to
                // hold it (a sharer whose copy failed), try the others; if
                // nobody does, the SSD copy is current.
                let mut cands = match g.source {
                    Source::Move(n) => vec![n],
                    _ => Vec::new(),
                };
                cands.extend((0..64u8).filter(|i| invalidate & (1 << i) != 0 && *i != node.index));
                let mut got = false;
                for c in cands {
                    let r = self
                        .until_done(
                            c,
                            Request::Move {
                                pid,
                                epoch: g.epoch,
                                need_page: true,
                                offset,
                            },
                        )
                        .await?;
                    invalidate &= !(1 << c);
                    if r == Reply::Done {
                        got = true;
                        Counters::add(&node.stats.pages_remote, 1);
                        break;
                    }
                }
                if !got {
                    let dir = node.host_of(pid.shard()).expect("known directory");
                    let r = if dir == node.index {
                        node.ssd_fetch_local(pid, g.epoch, offset).map_err(fatal)?
                    } else {
                        self.until_done(
                            dir,
                            Request::SsdFetch {
                                pid,
                                epoch: g.epoch,
                                offset,
                            },
                        )
                        .await?
                    };
                    if r != Reply::Done {
                        return Err(corrupt(format!("{pid}: SSD fetch failed: {r:?}")));
                    }
                }
            }
            Source::Copy(s) => {
                match self
                    .until_done(
                        s,
                        Request::Copy {
                            pid,
                            epoch: g.epoch,
                            offset,
                        },
                    )
                    .await?
                {
                    Reply::Done => Counters::add(&node.stats.pages_remote, 1),
                    _ => ok = false,
                }
            }
        }
        if ok {
            // Invalidate the other sharers, all requests out before waiting.
            let targets: Vec<u8> = (0..64u8).filter(|i| invalidate & (1 << i) != 0).collect();
            for t in targets {
                if t == node.index {
                    continue;
                }
                self.until_done(
                    t,
                    Request::Move {
                        pid,
                        epoch: g.epoch,
                        need_page: false,
                        offset: 0,
                    },
                )
                .await?;
            }
        }
        if node.cfg.protocol == Protocol::Fifo && (g.source != Source::Kept || g.invalidate != 0) {
            let dir = node.host_of(pid.shard()).expect("known directory");
            if dir == node.index {
                node.ack(node.index, pid);
            } else {
                self.send(dir, Request::Ack { pid }).await?;
            }
        }
        let mut m = f.meta.lock();
        m.awaiting = Awaiting::No;
        m.phantom = !ok;
        if ok {
            m.epoch = g.epoch;
            f.set_local(Local {
                mode: if want == Want::Exclusive {
                    Possession::Exclusive
                } else {
                    Possession::Shared
                },
                waiting: false,
                slot,
            });
        } else {
            f.set_local(Local {
                mode: Possession::None,
                waiting: false,
                slot,
            });
        }
        Ok(if ok {
            Outcome::Done
        } else {
            Outcome::CopyFailed
        })
    }

    /// The slow path: latch the frame exclusively and run the protocol.
    async fn cold(&self, pid: Pid, mode: Mode) -> PageResult<Option<Fixed>> {
        let node = &self.node;
        let fi = node
            .frames
            .find_or_insert(pid)
            .map_err(|_| fatal(KvError::Exhausted("the frame table is full".into())))?;
        let f = node.frames.frame(fi);
        acquire_with(|| !f.local().waiting && f.latch.try_exclusive()).await;
        if f.pid() != pid {
            f.latch.unlock_exclusive();
            return Ok(None);
        }
        let need = if mode == Mode::Exclusive {
            Possession::Exclusive
        } else {
            Possession::Shared
        };
        let mut retry = false;
        loop {
            let l = f.local();
            if l.mode >= need {
                break;
            }
            let want = if mode == Mode::Exclusive {
                Want::Exclusive
            } else {
                Want::Shared
            };
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
                f.set_local(Local {
                    mode: Possession::None,
                    waiting: false,
                    slot: s,
                });
                s
            };
            match self.obtain(fi, pid, want, retry, slot).await {
                Ok(Outcome::Done) => break,
                Ok(again) => {
                    // Let go (a transfer ahead of us, or an invalidation, may
                    // need this frame), then ask again; after a failed copy,
                    // tell the directory we hold nothing.
                    if again == Outcome::CopyFailed {
                        retry = true;
                    }
                    self.release_empty(fi);
                    self.backoff(1).await;
                    acquire_with(|| !f.local().waiting && f.latch.try_exclusive()).await;
                    if f.pid() != pid {
                        f.latch.unlock_exclusive();
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
        let version = match mode {
            Mode::Exclusive => 0,
            Mode::Shared => {
                f.latch.downgrade_exclusive_to_shared();
                0
            }
            Mode::Optimistic => f.latch.downgrade_exclusive_to_optimistic(),
        };
        Ok(Some(Fixed {
            pid,
            frame: fi,
            slot: l.slot,
            version,
        }))
    }

    /// Unlatches a frame that holds no copy, giving its slot back (and the
    /// frame, if nothing else needs it).
    fn release_empty(&self, fi: u32) {
        let f = self.node.frames.frame(fi);
        let mut m = f.meta.lock();
        let l = f.local();
        if l.mode == Possession::None {
            if l.slot != NONE {
                self.node.free_slot(l.slot);
            }
            f.set_local(Local {
                mode: Possession::None,
                waiting: l.waiting,
                slot: NONE,
            });
            self.node.maybe_remove(fi, &mut m);
        }
        drop(m);
        f.latch.unlock_exclusive();
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
        let mut spins = 0u32;
        loop {
            if let Some(f) = self.hot(pid, mode) {
                Counters::add(&self.node.stats.hot, 1);
                return Ok(f);
            }
            // Possessed but latched by someone else: wait on the hot path.
            if let Some(fi) = self.node.frames.find(pid) {
                let f = self.node.frames.frame(fi);
                let l = f.local();
                let need = if mode == Mode::Exclusive {
                    Possession::Exclusive
                } else {
                    Possession::Shared
                };
                if l.mode >= need && f.latch.is_latched() || l.waiting {
                    spins += 1;
                    if spins.is_multiple_of(32) {
                        std::thread::yield_now();
                    }
                    yield_now().await;
                    continue;
                }
            }
            if let Some(f) = self.cold(pid, mode).await? {
                return Ok(f);
            }
        }
    }

    async fn allocate(&self) -> PageResult<Fixed> {
        let node = &self.node;
        let shard = node.alloc_target();
        let (pid, fi, epoch) = if shard == node.index && node.directs(Pid::new(shard, 0)) {
            node.alloc_here(shard, node.index).map_err(fatal)?
        } else {
            let (pid, epoch) = match self.until_done(shard, Request::Alloc).await? {
                Reply::Allocated(p, e) => (p, e),
                r => return Err(corrupt(format!("unexpected allocation reply {r:?}"))),
            };
            let fi = node
                .frames
                .find_or_insert(pid)
                .map_err(|_| fatal(KvError::Exhausted("the frame table is full".into())))?;
            (pid, fi, epoch)
        };
        let f = node.frames.frame(fi);
        acquire_with(|| f.latch.try_exclusive()).await;
        let slot = match self.slot().await {
            Ok(s) => s,
            Err(e) => {
                f.latch.unlock_exclusive();
                return Err(e);
            }
        };
        node.page(slot).fill(&[0u8; PAGE_SIZE]);
        f.meta.lock().epoch = epoch;
        f.set_local(Local {
            mode: Possession::Exclusive,
            waiting: false,
            slot,
        });
        f.touch(node.global_epoch.load(Ordering::Relaxed));
        Ok(Fixed {
            pid,
            frame: fi,
            slot,
            version: 0,
        })
    }

    fn try_upgrade_exclusive(&self, f: &Fixed) -> bool {
        let fr = self.node.frames.frame(f.frame);
        fr.local().mode == Possession::Exclusive
            && fr.latch.try_upgrade_optimistic_to_exclusive(f.version)
    }

    fn catalog(&self) -> Pid {
        Pid::new(0, 0)
    }

    fn note_restart(&self) {
        Counters::add(&self.node.stats.restarts, 1);
    }
}

/// Kinds counted in `engine_stats`.
pub fn kind_name(i: usize) -> Option<&'static str> {
    crate::msg::KINDS
        .iter()
        .find(|k| **k as usize == i)
        .map(|k| k.name())
}

#[allow(dead_code)]
fn _kinds_fit(_: Kind) {}
