//! The holder's side of the protocol: serving moves, invalidations and
//! copies of this node's copy of a page (§3.3), parking those that cannot be
//! served yet and serving them later (§3.4.3, §3.5).
//!
//! A request for a conflict grant at epoch `e` finds this node's frame in
//! one of three states:
//!
//! - **idle** (no worker is fetching the page): serve it under the latch;
//!   if a worker holds the latch, park it (and, under chaining, raise the
//!   frame's `waiting` flag so that no new local access starts: the page
//!   leaves in request order, §3.4 fairness);
//! - **awaiting a grant at `g > e`**: the directory decided our newer
//!   request after the one that sent this, so the request concerns the copy
//!   we held before. Our worker does not touch the page while it waits, so
//!   the copy is served without the latch (deadlock avoidance, §3.4.3: the
//!   node with the lower conflict epoch backs off);
//! - **awaiting a grant at `g < e`, or not knowing its epoch yet**: the
//!   request is for the copy we are about to receive (anticipatory
//!   chaining: the directory named us as the predecessor); park it until
//!   our worker has received and used the page. Under FIFO the directory
//!   grants one acknowledged transfer at a time, so a request arriving
//!   while our own is still unanswered is always for the older copy.

use crate::frames::{Awaiting, Meta, Parked, Possession};
use crate::msg::{Reply, Request};
use crate::node::{Counters, Protocol, ScaleNode, try_latch};
use crate::trace::ParkWhy;
use dmkv_api::KvError;
use dmkv_transport::{Responder, ServiceError};

/// What to do with a holder request now.
pub enum HolderAnswer {
    Reply(Reply),
    Park,
    /// The page is written by the node's completer, which then answers
    /// (real backends, invariant 22): hand it over with the responder
    /// ([`ScaleNode::submit_delivery`]).
    Deliver(crate::ssdio::Delivery),
}

/// Reply payload or error for a deferred answer.
pub type Answer = Result<Vec<u8>, ServiceError>;

pub fn service_error(e: KvError) -> ServiceError {
    match e {
        KvError::Exhausted(m) => ServiceError::exhausted(m),
        e => ServiceError::failed(e.to_string()),
    }
}

fn nothing_for(q: &Request) -> Reply {
    match q {
        Request::Move {
            need_page: false, ..
        } => Reply::Done,
        _ => Reply::Gone,
    }
}

impl ScaleNode {
    /// A move, invalidation or copy of this node's copy for member `from`:
    /// answered now, or parked in the frame and answered by the re-poll
    /// thread.
    pub fn serve_holder(&self, from: u8, q: Request, responder: Responder) {
        let pid = match q {
            Request::Move { pid, .. } | Request::Copy { pid, .. } => pid,
            _ => unreachable!("only moves and copies reach the holder"),
        };
        let Some(fi) = self.frames.find(pid) else {
            Counters::add(&self.stats.gone, 1);
            responder.reply(Ok(nothing_for(&q).encode()));
            return;
        };
        let f = self.frames.frame(fi);
        let mut m = f.meta.lock();
        if f.pid() != pid {
            drop(m);
            responder.reply(Ok(nothing_for(&q).encode()));
            return;
        }
        match self.holder_decide(fi, &mut m, from, &q) {
            Ok(HolderAnswer::Reply(r)) => {
                if m.parked.is_empty()
                    && f.local().mode == Possession::None
                    && f.latch.try_exclusive()
                {
                    self.maybe_remove(fi, &mut m);
                    f.latch.unlock_exclusive();
                }
                drop(m);
                responder.reply(Ok(r.encode()));
            }
            Ok(HolderAnswer::Park) => {
                Counters::add(&self.stats.parked_holder, 1);
                let traced = crate::trace::Park::start(|| {
                    let l = f.local();
                    if m.awaiting != Awaiting::No {
                        ParkWhy::OwnFetch
                    } else if l.fresh {
                        ParkWhy::Fresh
                    } else if f.latch.is_exclusive() {
                        ParkWhy::Exclusive
                    } else {
                        ParkWhy::Shared
                    }
                });
                m.parked.push(Parked {
                    from,
                    request: q,
                    responder,
                    traced,
                });
                self.update_flags(fi, &m);
                self.repoll.note_parked(fi);
                // Pairs with the fence in `ScaleNode::released` (loom test
                // `parked_requests_are_never_missed`): if the worker let go
                // before it could see our flag, we see the latch free.
                std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
                let free = !f.latch.is_latched();
                drop(m);
                // The latch may have been let go before our flags were
                // visible to the worker: look again.
                if free {
                    self.repoll.kick(fi);
                }
            }
            Ok(HolderAnswer::Deliver(d)) => {
                drop(m);
                self.submit_delivery(d, responder);
            }
            Err(e) => {
                drop(m);
                responder.reply(Err(service_error(e)));
            }
        }
    }

    /// Sets the frame's `waiting` and `parked` flags from its parked list.
    pub fn update_flags(&self, fi: u32, m: &Meta) {
        let f = self.frames.frame(fi);
        let parked = !m.parked.is_empty();
        let waiting = self.cfg.protocol == Protocol::Chaining
            && m.parked
                .iter()
                .any(|p| matches!(p.request, Request::Move { .. }));
        f.set_flags(waiting, parked);
        if !parked {
            self.repoll.clear(fi);
        }
    }

    /// Decides a holder request on frame `fi` (its mutex held); see the
    /// module documentation.
    pub fn holder_decide(
        &self,
        fi: u32,
        m: &mut Meta,
        from: u8,
        q: &Request,
    ) -> Result<HolderAnswer, KvError> {
        let f = self.frames.frame(fi);
        let l = f.local();
        let fifo = self.cfg.protocol == Protocol::Fifo;
        let epoch = match *q {
            Request::Move { epoch, .. } | Request::Copy { epoch, .. } => epoch,
            _ => unreachable!("only moves and copies reach the holder"),
        };
        let old = match m.awaiting {
            Awaiting::Known(g) if g > epoch => true,
            Awaiting::Known(_) => return Ok(HolderAnswer::Park),
            Awaiting::Unknown if fifo => true,
            Awaiting::Unknown => return Ok(HolderAnswer::Park),
            Awaiting::No => false,
        };
        let nothing = nothing_for(q);
        if l.mode == Possession::None {
            Counters::add(&self.stats.gone, (nothing == Reply::Gone) as u64);
            return Ok(HolderAnswer::Reply(nothing));
        }
        let posting = self.posts_deliveries();
        let later = |then: crate::ssdio::Then, offset: u64, bytes: Vec<u8>| {
            HolderAnswer::Deliver(crate::ssdio::Delivery {
                to: from,
                offset,
                bytes,
                then,
            })
        };
        match *q {
            Request::Move {
                need_page, offset, ..
            } => {
                if old {
                    if need_page && posting {
                        // The bytes are taken now: our worker's page may
                        // land in the slot before the write is made.
                        let bytes = self.frame_bytes(l.slot, from);
                        self.drop_copy(fi, false);
                        return Ok(later(crate::ssdio::Then::Done, offset, bytes));
                    }
                    if need_page {
                        self.deliver_copy(from, offset, &self.frame_bytes(l.slot, from))?;
                    }
                    // Keep the slot: our worker receives its page there.
                    self.drop_copy(fi, false);
                    return Ok(HolderAnswer::Reply(Reply::Done));
                }
                if epoch < m.epoch {
                    // A late request for a grant older than our current
                    // possession: the copy it concerned is long gone.
                    Counters::add(&self.stats.stale, 1);
                    Counters::add(&self.stats.gone, need_page as u64);
                    return Ok(HolderAnswer::Reply(nothing));
                }
                if l.fresh || !try_latch(|| f.latch.try_exclusive()) {
                    return Ok(HolderAnswer::Park);
                }
                if need_page && posting {
                    // Latched until the write ends (`finish_delivery`):
                    // whatever else wants the page parks meanwhile.
                    let pid = f.pid();
                    let bytes = self.frame_bytes(l.slot, from);
                    return Ok(later(crate::ssdio::Then::Moved { pid, fi }, offset, bytes));
                }
                let res = if need_page {
                    self.deliver_copy(from, offset, &self.frame_bytes(l.slot, from))
                } else {
                    Ok(())
                };
                if res.is_ok() {
                    self.drop_copy(fi, true);
                }
                f.latch.unlock_exclusive();
                res?;
                Ok(HolderAnswer::Reply(Reply::Done))
            }
            Request::Copy { offset, .. } => {
                if old {
                    // Our newer grant (an upgrade) has not changed the page.
                    if posting {
                        let bytes = self.frame_bytes(l.slot, from);
                        return Ok(later(crate::ssdio::Then::Done, offset, bytes));
                    }
                    self.deliver_copy(from, offset, &self.frame_bytes(l.slot, from))?;
                    return Ok(HolderAnswer::Reply(Reply::Done));
                }
                if l.mode == Possession::Exclusive || epoch < m.epoch {
                    Counters::add(&self.stats.stale, 1);
                    Counters::add(&self.stats.gone, 1);
                    return Ok(HolderAnswer::Reply(Reply::Gone));
                }
                if !try_latch(|| f.latch.try_shared()) {
                    return Ok(HolderAnswer::Park);
                }
                let bytes = self.frame_bytes(l.slot, from);
                f.latch.unlock_shared();
                if posting {
                    // Counted as served now (the bytes are taken): an
                    // eviction of our copy may then be accepted before the
                    // write lands, which is safe, the requester being a
                    // sharer that uses the page only after the answer.
                    m.copies_served += 1;
                    return Ok(later(crate::ssdio::Then::Done, offset, bytes));
                }
                self.deliver_copy(from, offset, &bytes)?;
                m.copies_served += 1;
                Ok(HolderAnswer::Reply(Reply::Done))
            }
            _ => unreachable!("only moves and copies reach the holder"),
        }
    }

    /// The re-poll thread's look at frame `fi`: serves what parked requests
    /// it can, and lets the directory entry answer held requests.
    pub fn retry_parked(&self, fi: u32) {
        let f = self.frames.frame(fi);
        let mut out: Vec<(Responder, Answer)> = Vec::new();
        {
            let mut m = f.meta.lock();
            let parked = std::mem::take(&mut m.parked);
            for p in parked {
                match self.holder_decide(fi, &mut m, p.from, &p.request) {
                    Ok(HolderAnswer::Park) => m.parked.push(p),
                    Ok(HolderAnswer::Deliver(d)) => {
                        if let Some(t) = p.traced {
                            t.end();
                        }
                        self.submit_delivery(d, p.responder);
                    }
                    Ok(HolderAnswer::Reply(r)) => {
                        if let Some(t) = p.traced {
                            t.end();
                        }
                        out.push((p.responder, Ok(r.encode())))
                    }
                    Err(e) => out.push((p.responder, Err(service_error(e)))),
                }
            }
            self.update_flags(fi, &m);
            self.directory_retry(fi, &mut m, &mut out);
            if m.parked.is_empty() && f.local().mode == Possession::None && f.latch.try_exclusive()
            {
                self.maybe_remove(fi, &mut m);
                f.latch.unlock_exclusive();
            }
        }
        for (r, a) in out {
            r.reply(a);
        }
    }
}
