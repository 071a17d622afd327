//! Replies a handler thread's services send while the thread runs them
//! (branch i76).
//!
//! A reply sink may be called on any thread (a deferred reply), so it holds
//! only the loop's `Send` half ([`crate::server`]'s `LoopShared`) and used to
//! hand every reply to the loop's command queue: a channel send, a fence,
//! an encoded reply allocated per RPC. Most replies are sent on the loop's
//! own thread, inside the service the loop just ran; those now go into this
//! thread's queue instead, encoded into a buffer kept from an earlier reply,
//! and the loop sends them after the service returns, from the same
//! worker, as before (invariant 2 of `docs/ucx.md`: no service runs inside
//! UCX's progress, and no reply is sent from inside a callback).
//!
//! Invariant D (with `serve_loop`): a thread queues a reply here only for
//! the loop it runs ([`adopt`] names it, once, before the loop starts), and
//! only while a service runs on it, which happens only inside the loop's
//! work; the loop drains the queue after every call of its work that ran a
//! service, and checks it before it sleeps, so a queued reply waits for no
//! event. Every other reply (another
//! thread's, or a thread that runs no loop) goes through the command queue.

use dmkv_transport::LentReply;
use std::cell::RefCell;

/// A reply waiting for the loop: its session and the message (`rid u64 |
/// status u8 | cpu_ns u64 | payload or message`, header and data of
/// `AM_REPLY` in one buffer: [`HEADER`] bytes of header).
pub(crate) struct Queued {
    pub(crate) session: u32,
    pub(crate) message: Vec<u8>,
}

/// Bytes of an `AM_REPLY`'s header (the request id).
pub(crate) const HEADER: usize = 8;

struct Direct {
    /// The loop this thread runs (its `LoopShared`'s address), 0 if none.
    owner: usize,
    queued: Vec<Queued>,
    /// Buffers of replies already sent, for the next ones.
    free: Vec<Vec<u8>>,
}

/// Buffers kept for later replies at most (a burst of deferred replies
/// answered at once may queue more; the rest are freed).
const KEEP: usize = 64;

thread_local! {
    // Const-initialised: no lazy-initialisation check per access.
    static DIRECT: RefCell<Direct> = const {
        RefCell::new(Direct {
            owner: 0,
            queued: Vec::new(),
            free: Vec::new(),
        })
    };
}

/// Names the loop this thread runs (invariant D): from now on its sinks
/// called here queue their replies on this thread.
pub(crate) fn adopt(owner: usize) {
    DIRECT.with(|d| d.borrow_mut().owner = owner);
}

/// Queues the reply to request `rid` of `session` here if this thread runs
/// loop `owner`; false (nothing queued) otherwise.
pub(crate) fn offer(
    owner: usize,
    session: u32,
    rid: u64,
    server_cpu_ns: u64,
    result: &LentReply<'_>,
) -> bool {
    DIRECT.with(|d| {
        let mut d = d.borrow_mut();
        if d.owner != owner || owner == 0 {
            return false;
        }
        let mut message = d.free.pop().unwrap_or_default();
        message.clear();
        message.extend_from_slice(&rid.to_le_bytes());
        encode_reply(&mut message, server_cpu_ns, result);
        d.queued.push(Queued { session, message });
        true
    })
}

/// Whether replies wait in this thread's queue.
pub(crate) fn pending() -> bool {
    DIRECT.with(|d| !d.borrow().queued.is_empty())
}

/// Hands every queued reply to `send` (in the order they were queued) and
/// keeps their buffers for the next ones; returns whether there were any.
/// `send` must not queue replies itself (it sends them: a UCX send, or the
/// command queue): this thread's queue is borrowed meanwhile, and a reply
/// queued from `send` would panic rather than be lost.
pub(crate) fn drain(mut send: impl FnMut(&Queued)) -> bool {
    DIRECT.with(|d| {
        let Direct { queued, free, .. } = &mut *d.borrow_mut();
        if queued.is_empty() {
            return false;
        }
        for q in queued.drain(..) {
            send(&q);
            if free.len() < KEEP {
                free.push(q.message);
            }
        }
        true
    })
}

/// Appends a reply in [`dmkv_transport::Reply::encode`]'s format (`status
/// u8 | cpu_ns u64 | payload or message`) to `out`: the bytes are copied out
/// of the handler thread's buffer here (R3 of docs/transport.md, "Reply
/// buffers").
pub(crate) fn encode_reply(out: &mut Vec<u8>, server_cpu_ns: u64, result: &LentReply<'_>) {
    match result {
        Ok(p) => {
            out.push(0);
            out.extend_from_slice(&server_cpu_ns.to_le_bytes());
            out.extend_from_slice(p);
        }
        Err(e) => {
            out.push(e.code as u8);
            out.extend_from_slice(&server_cpu_ns.to_le_bytes());
            out.extend_from_slice(e.message.as_bytes());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::{Reply, ServiceError};

    #[test]
    fn replies_are_queued_only_on_the_thread_of_their_loop() {
        let mut payload = b"value".to_vec();
        // No loop adopted on this thread: the command queue's turn.
        assert!(!offer(7, 1, 2, 3, &Ok(&mut payload)));
        adopt(7);
        // Another loop's reply is not this thread's to send.
        assert!(!offer(8, 1, 2, 3, &Ok(&mut payload)));
        assert!(!pending());
        assert!(offer(7, 1, 42, 3, &Ok(&mut payload)));
        assert!(offer(7, 5, 43, 4, &Err(ServiceError::failed("no"))));
        assert!(pending());
        let mut seen = Vec::new();
        assert!(drain(|q| seen.push((q.session, q.message.clone()))));
        assert!(!pending());
        assert!(!drain(|_| panic!("nothing is queued")));
        assert_eq!(seen.len(), 2);
        // Header (rid) and data (the format Reply::decode reads).
        let (s, m) = &seen[0];
        assert_eq!(*s, 1);
        assert_eq!(m[..HEADER], 42u64.to_le_bytes());
        let r = Reply::decode(&m[HEADER..]).expect("decodes");
        assert_eq!(
            (r.result.expect("ok"), r.server_cpu_ns),
            (b"value".to_vec(), 3)
        );
        let (s, m) = &seen[1];
        assert_eq!(*s, 5);
        assert_eq!(m[..HEADER], 43u64.to_le_bytes());
        let r = Reply::decode(&m[HEADER..]).expect("decodes");
        assert_eq!(r.server_cpu_ns, 4);
        assert_eq!(r.result.expect_err("an error").message, "no");
        // The buffers are kept: the next reply reuses one.
        let kept = DIRECT.with(|d| d.borrow().free.len());
        assert_eq!(kept, 2);
        assert!(offer(7, 1, 44, 3, &Ok(&mut payload)));
        assert_eq!(DIRECT.with(|d| d.borrow().free.len()), 1);
        adopt(0);
        assert!(!offer(0, 1, 2, 3, &Ok(&mut payload)));
    }
}
