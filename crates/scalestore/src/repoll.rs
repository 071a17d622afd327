//! Re-polling parked requests (paper §3.5: a message handler that cannot
//! serve a request yet — the page is latched, or still on its way — leaves
//! it in the mailbox and looks at it again later).
//!
//! Here a handler parks such a request with its deferred-reply
//! `Responder` in the frame (`Meta::parked`), or in the directory entry (a
//! FIFO queue position, a request held during an eviction pull). The
//! events that may make it servable kick the node's re-poll thread with the
//! frame: a worker or the page provider letting go of the latch
//! (`ScaleNode::released`), a worker learning or finishing its grant, an
//! acknowledgement, an eviction pull finishing. As a safety net the thread
//! also sweeps every frame with parked work every few milliseconds.

use crate::node::ScaleNode;
use parking_lot::{Condvar, Mutex};
use std::collections::BTreeSet;
use std::time::Duration;

/// Sweep interval while some request is parked.
const SWEEP: Duration = Duration::from_millis(2);
/// Wake-up interval with nothing parked (to notice `stop`).
const IDLE: Duration = Duration::from_millis(50);

#[derive(Default)]
struct State {
    kicked: Vec<u32>,
    parked: BTreeSet<u32>,
    stop: bool,
    /// The re-poll task, waiting in virtual time (`--transport sim`).
    waker: Option<std::task::Waker>,
}

/// The kick queue of one node's re-poll thread.
#[derive(Default)]
pub struct Repoll {
    state: Mutex<State>,
    cv: Condvar,
}

impl Repoll {
    /// Frame `fi` may have servable parked work.
    pub fn kick(&self, fi: u32) {
        let w = {
            let mut s = self.state.lock();
            s.kicked.push(fi);
            s.waker.take()
        };
        self.cv.notify_one();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// Frame `fi` has parked work (swept until [`Repoll::clear`]).
    pub fn note_parked(&self, fi: u32) {
        self.state.lock().parked.insert(fi);
    }

    /// Frame `fi` has no parked work any more.
    pub fn clear(&self, fi: u32) {
        self.state.lock().parked.remove(&fi);
    }

    /// Frames with parked work right now.
    pub fn parked(&self) -> Vec<u32> {
        self.state.lock().parked.iter().copied().collect()
    }

    pub fn stop(&self) {
        let w = {
            let mut s = self.state.lock();
            s.stop = true;
            s.waker.take()
        };
        self.cv.notify_all();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// [`Repoll::next`] for the re-poll task under the simulated cluster:
    /// waits in virtual time.
    async fn next_async(&self) -> Option<Vec<u32>> {
        let wait = if self.state.lock().parked.is_empty() {
            IDLE
        } else {
            SWEEP
        };
        let mut sleep = Box::pin(dmkv_transport::exec::sleep(wait));
        std::future::poll_fn(|cx| {
            use std::future::Future;
            let mut s = self.state.lock();
            if s.stop {
                return std::task::Poll::Ready(None);
            }
            if !s.kicked.is_empty() {
                let mut v = std::mem::take(&mut s.kicked);
                v.sort_unstable();
                v.dedup();
                return std::task::Poll::Ready(Some(v));
            }
            if sleep.as_mut().poll(cx).is_ready() {
                return std::task::Poll::Ready(Some(s.parked.iter().copied().collect()));
            }
            s.waker = Some(cx.waker().clone());
            std::task::Poll::Pending
        })
        .await
    }

    /// The next frames to look at: kicked ones, or after a sweep interval
    /// every frame with parked work (possibly none, so that the caller can
    /// check whether to go on); `None` once stopped.
    fn next(&self) -> Option<Vec<u32>> {
        let mut s = self.state.lock();
        if s.stop {
            return None;
        }
        if s.kicked.is_empty() {
            let wait = if s.parked.is_empty() { IDLE } else { SWEEP };
            if self.cv.wait_for(&mut s, wait).timed_out() {
                return Some(s.parked.iter().copied().collect());
            }
        }
        let mut v = std::mem::take(&mut s.kicked);
        v.sort_unstable();
        v.dedup();
        Some(v)
    }
}

/// [`run`] as a task of the simulated cluster.
pub async fn run_async(node: &ScaleNode, mut keep_going: impl FnMut() -> bool) {
    while keep_going() {
        let Some(frames) = node.repoll.next_async().await else {
            return;
        };
        for fi in frames {
            node.retry_parked(fi);
            // Held requests granted from the SSD (replies already sent:
            // the device time delays the next retry only).
            crate::ssd::settle_sim_wait().await;
        }
    }
}

/// The re-poll thread of `node`: runs until the node stops or `keep_going`
/// says stop.
pub fn run(node: &ScaleNode, mut keep_going: impl FnMut() -> bool) {
    while keep_going() {
        let Some(frames) = node.repoll.next() else {
            return;
        };
        for fi in frames {
            node.retry_parked(fi);
        }
    }
}
