//! The SSD completer: message handlers never wait for the SSD (issue 15,
//! §4.3: the paper's workers hand SSD reads to the I/O layer and go on).
//!
//! A handler that must serve a page from its node's SSD (an ownership
//! request granted in the base case, an SSD fetch) or write pages to it (a
//! leaver's page file handed over to this node) decides under the page's
//! entry mutex what it would have done, hands the I/O with its deferred
//! responder to this node's completer ([`SsdQueue::push`] through
//! `ScaleNode::submit_ssd`) and returns: its thread (its simulated core)
//! serves the next message meanwhile. The completer does the I/O, delivers
//! the page into the requester's frame (one-sided write), lets the entry go
//! (`ScaleNode::finish_ssd`) and replies.
//!
//! - Real backends: one thread per node (of the node's worker pool)
//!   submits the reads to the page file's io_uring read ring and reaps their
//!   completions, several reads in flight at once; a handed-over page
//!   batch is one io_uring write batch on that thread.
//! - Simulated cluster: the I/O is done at submission (the bytes of the
//!   file at that instant: nothing can rewrite the slot before the
//!   completion, invariant 16) and submitted to the modelled device, which
//!   gives the instant it completes; one task per node delivers and replies
//!   at that instant, in (instant, submission) order, so runs replay.
//!
//! The completer also finishes eviction batches whose dirty last copies
//! must be pulled from the evicter's cache (invariant 20): the handler
//! hands the batch over ([`Work::Pull`]) and the completer posts the one
//! batched one-sided READ; on the real backends its thread waits for that
//! round trip (`exec::block_on`), under the simulated cluster its task
//! polls the read beside the device's jobs and holds no core.
//!
//! Under the simulated cluster each completion's CPU is charged on the
//! node's completer core (invariant 21, [`run_async`]).
//!
//! A job whose completer is gone (the node's pool dropped at teardown) is
//! dropped with its responder, and the transport answers the requester
//! with an error ("dropped without replying"): never silence.

use crate::msg::Grant;
use crate::node::{ScaleNode, Shard};
use crate::pid::Pid;
use crate::ssd::{AlignedPage, ReadTicket};
use dmkv_transport::Responder;
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// How long the real backends' completer sleeps when it has nothing in
/// flight before it looks whether its node is still there.
const IDLE: Duration = Duration::from_millis(50);

/// What a job does once its I/O is complete.
pub enum Work {
    /// Deliver the page read from slot `pid` into `to`'s frame at `offset`,
    /// then answer the ownership request with `grant` (the entry of `pid`
    /// is `reading` until then).
    Grant {
        pid: Pid,
        to: u8,
        offset: u64,
        grant: Grant,
    },
    /// Deliver the page read from `pid`'s slot into `to`'s frame at
    /// `offset`, then answer the SSD fetch "done".
    Fetch { pid: Pid, to: u8, offset: u64 },
    /// Write `pages` into the shard's page file, then answer "done".
    Write { pages: Vec<(u64, AlignedPage)> },
    /// Write the dirty last copies an eviction batch pulled (one batch per
    /// shard), then let their entries go and answer the batch
    /// (`ScaleNode::finish_evict_write`).
    Evict(crate::directory::EvictWrite),
    /// Pull an eviction batch's dirty last copies from the evicter's cache
    /// (one batched one-sided READ, posted by the completer), then finish
    /// the batch (`ScaleNode::finish_pull_job`: into the cache, or on to
    /// the SSD as [`Work::Evict`]). The handler that decided the batch
    /// waits for nothing (invariant 20).
    Pull(crate::directory::EvictPull),
}

impl Work {
    /// The slot to read, for the reading kinds.
    fn read_slot(&self) -> Option<u64> {
        match self {
            Work::Grant { pid, .. } | Work::Fetch { pid, .. } => Some(pid.slot()),
            Work::Write { .. } | Work::Evict(_) | Work::Pull(_) => None,
        }
    }
}

/// The I/O's outcome.
pub enum Outcome {
    Page(AlignedPage),
    Written,
}

/// One deferred SSD access with the responder that waits for it.
pub struct Job {
    pub shard: Arc<Shard>,
    pub work: Work,
    pub responder: Responder,
    /// Simulated cluster: the I/O's result, taken at submission, and the
    /// virtual instant (ns) the modelled device completes it.
    done: Option<io::Result<Outcome>>,
    due_ns: u64,
}

impl Job {
    pub fn new(shard: Arc<Shard>, work: Work, responder: Responder) -> Job {
        Job {
            shard,
            work,
            responder,
            done: None,
            due_ns: 0,
        }
    }

    /// The pull and its responder, if this is a [`Work::Pull`]; the job
    /// itself back otherwise (moved once per job, never boxed).
    #[allow(clippy::result_large_err)]
    fn into_pull(self) -> Result<(crate::directory::EvictPull, Responder), Job> {
        match self.work {
            Work::Pull(p) => Ok((p, self.responder)),
            work => Err(Job { work, ..self }),
        }
    }

    /// Under the simulated cluster: does the I/O now and notes when the
    /// modelled device completes it. False elsewhere (the completer does
    /// it).
    fn start_simulated(&mut self) -> bool {
        if !dmkv_transport::sim::active() {
            return false;
        }
        let file = &self.shard.file;
        let (res, due) = match &self.work {
            // Posted by the completer task (a network wait, not a device's).
            Work::Pull(_) => return true,
            Work::Write { pages } => {
                let batch: Vec<(u64, &AlignedPage)> = pages.iter().map(|(s, p)| (*s, p)).collect();
                match file.write_batch_posted(&batch) {
                    Ok(due) => (Ok(Outcome::Written), due),
                    Err(e) => (Err(e), None),
                }
            }
            Work::Evict(w) => {
                // Each shard's batch is posted at once: the device
                // completes them together, the job at the last.
                let mut due = None;
                let mut res = Ok(Outcome::Written);
                for (shard, list) in &w.pages {
                    let batch: Vec<(u64, &AlignedPage)> =
                        list.iter().map(|p| (p.pid.slot(), &p.page)).collect();
                    match shard.file.write_batch_posted(&batch) {
                        Ok(d) => due = due.max(d),
                        Err(e) => {
                            res = Err(e);
                            break;
                        }
                    }
                }
                (res, due)
            }
            w => {
                let slot = w.read_slot().expect("a read");
                let mut page = AlignedPage::default();
                match file.read_posted(slot, &mut page) {
                    Ok(due) => (Ok(Outcome::Page(page)), due),
                    Err(e) => (Err(e), None),
                }
            }
        };
        self.done = Some(res);
        self.due_ns = due.map_or(0, |d| d.as_nanos());
        true
    }
}

#[derive(Default)]
struct State {
    jobs: VecDeque<Job>,
    /// The simulated cluster's completer task, when it waits.
    waker: Option<std::task::Waker>,
}

/// A node's queue of deferred SSD accesses.
#[derive(Default)]
pub struct SsdQueue {
    state: Mutex<State>,
    cv: Condvar,
}

impl SsdQueue {
    /// Queues `job` for the completer (under the simulated cluster its I/O
    /// is done here). Never blocks: handlers call it under entry mutexes.
    pub fn push(&self, mut job: Job) {
        job.start_simulated();
        let w = {
            let mut s = self.state.lock();
            s.jobs.push_back(job);
            s.waker.take()
        };
        self.cv.notify_one();
        if let Some(w) = w {
            w.wake();
        }
    }

    /// The jobs queued, waiting up to [`IDLE`] for one if `wait`.
    fn take(&self, wait: bool) -> Vec<Job> {
        let mut s = self.state.lock();
        if wait && s.jobs.is_empty() {
            let _ = self.cv.wait_for(&mut s, IDLE);
        }
        s.jobs.drain(..).collect()
    }
}

/// The completer on the real backends (a thread of the node's pool): runs
/// while `keep_going`.
pub fn run(node: &ScaleNode, mut keep_going: impl FnMut() -> bool) {
    let mut reading: Vec<(Job, ReadTicket)> = Vec::new();
    while keep_going() {
        for job in node.ssd_jobs.take(reading.is_empty()) {
            let job = match job.into_pull() {
                Ok((p, responder)) => {
                    // The pull's one round trip: this thread waits for it
                    // (the handler that decided the batch does not), on
                    // the transport's executor so that UCX is driven.
                    let read = dmkv_transport::exec::block_on(node.read_pulled(&p));
                    node.finish_pull_job(p, read, responder);
                    continue;
                }
                Err(job) => job,
            };
            match job.work.read_slot() {
                Some(slot) => {
                    let t = job.shard.file.submit_read(slot);
                    reading.push((job, t));
                }
                None => {
                    let res = match &job.work {
                        Work::Write { pages } => {
                            let batch: Vec<(u64, &AlignedPage)> =
                                pages.iter().map(|(s, p)| (*s, p)).collect();
                            job.shard.file.write_batch(&batch)
                        }
                        Work::Evict(w) => w.pages.iter().try_for_each(|(shard, list)| {
                            let batch: Vec<(u64, &AlignedPage)> =
                                list.iter().map(|p| (p.pid.slot(), &p.page)).collect();
                            shard.file.write_batch(&batch)
                        }),
                        _ => unreachable!("not a read"),
                    };
                    node.finish_ssd(job, res.map(|()| Outcome::Written));
                }
            }
        }
        let mut progressed = false;
        let mut i = 0;
        while i < reading.len() {
            let (job, t) = &mut reading[i];
            match job.shard.file.poll_read(t) {
                Some(res) => {
                    let (job, _) = reading.remove(i);
                    node.finish_ssd(job, res.map(Outcome::Page));
                    progressed = true;
                }
                None => i += 1,
            }
        }
        if !progressed && let Some((job, _)) = reading.first() {
            job.shard.file.wait_read();
        }
    }
}

/// What the simulated completer does next.
enum Next {
    /// A job whose device instant came.
    Due(Job),
    /// A pull whose read completed.
    Pulled(PullDone),
}

type PullDone = (
    crate::directory::EvictPull,
    Responder,
    Result<dmkv_transport::BatchResult, dmkv_api::KvError>,
);

type Pulling<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = PullDone> + 'a>>;

/// The completer under the simulated cluster (a background task of the
/// node, holding no simulated core while it waits): completes each job at
/// its device instant, in (instant, submission) order, and posts each
/// eviction pull's read, finishing the batch when the read completes.
/// Each completion's CPU (the delivery, the entry, the held requests, the
/// reply; a pull's placement) is a job on `cores`, the node's simulated
/// completer core, charged `memnode.job_base_ns` plus `line_ns` per line
/// it touches (invariant 21); without `cores` (no simulation) inline.
pub async fn run_async(
    node: Arc<ScaleNode>,
    cores: Option<dmkv_transport::sim::SimCores>,
    mut keep_going: impl FnMut() -> bool,
) {
    use std::future::Future;
    use std::task::Poll;
    let mut timed: BTreeMap<(u64, u64), Job> = BTreeMap::new();
    let mut pulling: Vec<Pulling<'_>> = Vec::new();
    let mut seq = 0u64;
    let mut sleep: Option<(u64, std::pin::Pin<Box<dmkv_transport::exec::Sleep>>)> = None;
    let n: &ScaleNode = &node;
    while keep_going() {
        let next = std::future::poll_fn(|cx| {
            // The waker first, then the jobs: a job pushed after the drain
            // wakes this task. No lock is held while the pulls are polled
            // (posting a verb may run code that pushes a job).
            let jobs: Vec<Job> = {
                let mut s = n.ssd_jobs.state.lock();
                s.waker = Some(cx.waker().clone());
                s.jobs.drain(..).collect()
            };
            for j in jobs {
                match j.into_pull() {
                    Ok((p, responder)) => pulling.push(Box::pin(async move {
                        let read = n.read_pulled(&p).await;
                        (p, responder, read)
                    })),
                    Err(j) => {
                        timed.insert((j.due_ns, seq), j);
                        seq += 1;
                    }
                }
            }
            // Pulls in submission order, so that runs replay.
            for i in 0..pulling.len() {
                if let Poll::Ready(done) = pulling[i].as_mut().poll(cx) {
                    drop(pulling.remove(i));
                    return Poll::Ready(Some(Next::Pulled(done)));
                }
            }
            loop {
                let Some(&(due, _)) = timed.keys().next() else {
                    return Poll::Pending;
                };
                if dmkv_transport::time::Instant::now().as_nanos() >= due {
                    return Poll::Ready(timed.pop_first().map(|(_, j)| Next::Due(j)));
                }
                if sleep.as_ref().is_none_or(|(d, _)| *d != due) {
                    let at = dmkv_transport::time::Instant::from_nanos(due);
                    sleep = Some((due, Box::pin(dmkv_transport::exec::sleep_until(at))));
                }
                let (_, sl) = sleep.as_mut().expect("armed");
                if sl.as_mut().poll(cx).is_ready() {
                    sleep = None;
                    continue;
                }
                return Poll::Pending;
            }
        })
        .await;
        let work: Box<dyn FnOnce()> = match next {
            Some(Next::Due(mut job)) => {
                let res = job.done.take().expect("done at submission");
                let node = node.clone();
                Box::new(move || node.finish_ssd(job, res))
            }
            Some(Next::Pulled((p, responder, read))) => {
                let node = node.clone();
                Box::new(move || node.finish_pull_job(p, read, responder))
            }
            None => continue,
        };
        match &cores {
            Some(c) => c.submit(work, Box::new(|_| {})),
            None => work(),
        }
    }
}
