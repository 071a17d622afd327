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
//! batched one-sided READ and finishes the batch when it completes. On the
//! real backends it posts the page WRITEs of handlers' deliveries too
//! ([`NetJob::Deliver`], invariant 22) and of its own SSD grants and
//! fetches: it polls every verb in flight between its SSD completions (on
//! the transport's executor, so UCX is driven) and waits for one only when
//! nothing else can move, so no completion queues behind a round trip
//! (branch i42). Under the simulated cluster its task polls the pulls
//! beside the device's jobs and holds no core (deliveries are posted
//! writes there, `sim::write_posted`, and never come here).
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
use crate::ssd::{AlignedPage, ReadTicket, Wakeup};
use dmkv_transport::Responder;
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, VecDeque};
use std::io;
use std::sync::Arc;
use std::time::Duration;

/// How long the real backends' completer sleeps when it has nothing in
/// flight before it looks whether its node is still there.
const IDLE: Duration = Duration::from_millis(50);

/// How long the real backends' completer waits for a posted verb before it
/// looks at its SSD reads in flight again (above the executor's short-sleep
/// threshold, so that the timer thread wakes it even while an idle hook
/// drives UCX).
const READ_POLL: Duration = Duration::from_micros(250);

/// A page WRITE the completer posts for a handler (real backends): the
/// page's bytes, taken under the entry's mutex (and the frame's latch),
/// written into member `to`'s cache at `offset`; what follows is `then`.
pub struct Delivery {
    pub to: u8,
    pub offset: u64,
    pub bytes: Vec<u8>,
    pub then: Then,
}

/// What follows a [`Delivery`]'s write (`ScaleNode::finish_delivery`).
pub enum Then {
    /// A directory's grant served from its own copy (the entry is
    /// `delivering`, invariant 22): the grant is recorded; on success our
    /// copy is downgraded or dropped as `own` says, on failure the owners
    /// go back to `undo`; the latch (held unless `own` is
    /// [`OwnCopy::Keep`]) is let go, what the entry held is answered and
    /// then the grant.
    Grant {
        pid: Pid,
        fi: u32,
        grant: Grant,
        undo: crate::frames::Owners,
        own: OwnCopy,
    },
    /// A holder's move of its copy (frame `fi` latched exclusively until
    /// the write ends): the copy is dropped if written, the latch let go,
    /// then "done".
    Moved { pid: Pid, fi: u32 },
    /// Only the answer "done" (a copy, a move of an older copy).
    Done,
    /// An SSD grant or fetch (`Work::Grant`, `Work::Fetch`) whose read
    /// completed: finished as [`ScaleNode::finish_ssd`] would have.
    Read(Box<Work>),
}

/// What a directory's inline grant does to its own copy once the page is
/// written (see [`Then::Grant`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum OwnCopy {
    /// Unchanged; not latched (a shared grant from our shared copy).
    Keep,
    /// Downgraded to shared (a shared grant from our exclusive copy).
    Downgrade,
    /// Dropped (an exclusive grant).
    Drop,
}

/// A one-sided verb the completer posts, with the responder that waits for
/// it.
pub enum NetJob {
    Pull(crate::directory::EvictPull, Responder),
    Deliver(Delivery, Responder),
}

/// A posted verb's outcome, to finish with [`finish_net`].
pub enum NetOut {
    Pulled(
        crate::directory::EvictPull,
        Responder,
        Result<dmkv_transport::BatchResult, dmkv_api::KvError>,
    ),
    Delivered(Delivery, Responder, Result<(), dmkv_api::KvError>),
}

type NetFuture<'a> = std::pin::Pin<Box<dyn std::future::Future<Output = NetOut> + 'a>>;

/// Which posted verbs a [`NetGate`] holds.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum NetKind {
    Pull,
    Deliver,
}

/// Test hook (`ScaleNode::set_net_gate`): holds the first `first` of the
/// completer's posted verbs of the kinds named before they are posted, as
/// a slow network would, without blocking the completer's thread, until
/// [`NetGate::open`]; later ones pass. Not used by the engine.
#[doc(hidden)]
pub struct NetGate {
    kinds: Vec<NetKind>,
    first: usize,
    caught: std::sync::atomic::AtomicUsize,
    open: std::sync::atomic::AtomicBool,
    held: std::sync::atomic::AtomicUsize,
    wakers: Mutex<Vec<std::task::Waker>>,
}

impl NetGate {
    pub fn new(kinds: &[NetKind], first: usize) -> Arc<NetGate> {
        Arc::new(NetGate {
            kinds: kinds.to_vec(),
            first,
            caught: Default::default(),
            open: Default::default(),
            held: Default::default(),
            wakers: Mutex::new(Vec::new()),
        })
    }

    /// Verbs waiting at the gate now.
    pub fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }

    /// Lets every verb through, now and later.
    pub fn open(&self) {
        self.open.store(true, std::sync::atomic::Ordering::SeqCst);
        for w in std::mem::take(&mut *self.wakers.lock()) {
            w.wake();
        }
    }

    /// Whether this verb of `kind` waits (counted if of a held kind).
    fn holds(&self, kind: NetKind) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        self.kinds.contains(&kind) && self.caught.fetch_add(1, SeqCst) < self.first
    }

    async fn pass(&self) {
        use std::sync::atomic::Ordering::SeqCst;
        let mut counted = false;
        std::future::poll_fn(|cx| {
            if !self.open.load(SeqCst) {
                self.wakers.lock().push(cx.waker().clone());
                if !self.open.load(SeqCst) {
                    if !counted {
                        counted = true;
                        self.held.fetch_add(1, SeqCst);
                    }
                    return std::task::Poll::Pending;
                }
            }
            if counted {
                self.held.fetch_sub(1, SeqCst);
            }
            std::task::Poll::Ready(())
        })
        .await
    }
}

/// The future of a posted verb (on this thread's endpoint).
fn start_net(node: &ScaleNode, job: NetJob) -> NetFuture<'_> {
    let gate = node.net_gate.lock().clone();
    match job {
        NetJob::Pull(p, responder) => Box::pin(async move {
            if let Some(g) = gate.filter(|g| g.holds(NetKind::Pull)) {
                g.pass().await;
            }
            let read = node.read_pulled(&p).await;
            NetOut::Pulled(p, responder, read)
        }),
        NetJob::Deliver(d, responder) => Box::pin(async move {
            if let Some(g) = gate.filter(|g| g.holds(NetKind::Deliver)) {
                g.pass().await;
            }
            let w = node.write_delivery(&d).await;
            NetOut::Delivered(d, responder, w)
        }),
    }
}

/// Finishes a posted verb: an eviction batch's pull, or a delivery.
fn finish_net(node: &ScaleNode, out: NetOut) {
    match out {
        NetOut::Pulled(p, responder, read) => node.finish_pull_job(p, read, responder),
        NetOut::Delivered(d, responder, w) => node.finish_delivery(d, responder, w),
    }
}

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
    /// Verbs to post (real backends: handlers' deliveries).
    net: Vec<NetJob>,
    /// The simulated cluster's completer task, when it waits.
    waker: Option<std::task::Waker>,
    /// The real backends' completer sleeps on its [`Wakeup`] for its SSD
    /// reads: work queued now must signal it.
    reads_wait: bool,
}

impl State {
    /// Whether a job or a verb is queued.
    fn has_work(&self) -> bool {
        !self.jobs.is_empty() || !self.net.is_empty()
    }
}

/// A node's queue of deferred SSD accesses.
#[derive(Default)]
pub struct SsdQueue {
    state: Mutex<State>,
    cv: Condvar,
    /// What the real backends' completer sleeps on while its SSD reads are
    /// in flight (made by the completer; `None` inside: no eventfd, and
    /// then it polls its read rings as before). Never made under the
    /// simulated cluster.
    wakeup: std::sync::OnceLock<Option<Wakeup>>,
    /// Test hook ([`SsdQueue::set_read_wait`]): the longest such sleep in
    /// ns (0 = [`IDLE`]).
    read_wait_ns: std::sync::atomic::AtomicU64,
}

impl SsdQueue {
    /// Queues `job` for the completer (under the simulated cluster its I/O
    /// is done here). Never blocks: handlers call it under entry mutexes.
    pub fn push(&self, mut job: Job) {
        job.start_simulated();
        self.enqueue(|s| s.jobs.push_back(job));
    }

    /// Queues a verb for the completer to post (a handler's delivery).
    /// Never blocks: handlers call it under entry mutexes.
    pub fn push_net(&self, job: NetJob) {
        self.enqueue(|s| s.net.push(job));
    }

    /// Adds work under the queue's lock with `add`, then wakes the
    /// completer: its thread (real backends) or its task (simulated).
    fn enqueue(&self, add: impl FnOnce(&mut State)) {
        let (w, reads_wait) = {
            let mut s = self.state.lock();
            add(&mut s);
            (s.waker.take(), s.reads_wait)
        };
        self.cv.notify_one();
        if let Some(w) = w {
            w.wake();
        }
        if reads_wait && let Some(Some(w)) = self.wakeup.get() {
            w.wake();
        }
    }

    /// Test hook: the real backends' completer sleeps at most `d` at a
    /// time while its SSD reads are in flight and it has nothing else to
    /// do (it wakes for every completion and every hand-off; [`IDLE`] by
    /// default, after which it looks whether its node is still there). Not
    /// used by the engine.
    #[doc(hidden)]
    pub fn set_read_wait(&self, d: Duration) {
        self.read_wait_ns.store(
            d.as_nanos().min(u64::MAX as u128) as u64,
            std::sync::atomic::Ordering::Relaxed,
        );
    }

    /// The completer's [`Wakeup`], made at its first use.
    fn wakeup(&self) -> Option<&Wakeup> {
        self.wakeup
            .get_or_init(|| match Wakeup::new() {
                Ok(w) => Some(w),
                Err(e) => {
                    static SAID: std::sync::Once = std::sync::Once::new();
                    SAID.call_once(|| {
                        eprintln!(
                            "note: scalestore: no eventfd ({e}); the SSD completer polls its reads every 100 us"
                        )
                    });
                    None
                }
            })
            .as_ref()
    }

    /// The completer (real backends) has SSD reads in flight and nothing
    /// else to do: sleeps until a read completes (on any ring in
    /// `reading`), work is queued, or the read wait passes; with no
    /// [`Wakeup`] for all of them, waits briefly on the first one's ring
    /// as before ([`PageFile::wait_read`](crate::ssd::PageFile::wait_read),
    /// at most 100 us). Invariant 23 of docs/scalestore.md.
    fn wait_for_reads(&self, reading: &[(Job, ReadTicket)]) {
        let Some((first, _)) = reading.first() else {
            return;
        };
        let w = match self.wakeup() {
            Some(w)
                if reading
                    .iter()
                    .all(|(j, _)| j.shard.file.notify_completions(w)) =>
            {
                w
            }
            _ => return first.shard.file.wait_read(),
        };
        {
            // Under the queue's lock: work queued after this look sees
            // `reads_wait` and signals (no lost wake-up); a completion
            // after the caller's poll has signalled already (the eventfd
            // counts until a wait clears it).
            let mut s = self.state.lock();
            if s.has_work() {
                return;
            }
            s.reads_wait = true;
        }
        let ns = self.read_wait_ns.load(std::sync::atomic::Ordering::Relaxed);
        w.wait(if ns == 0 {
            IDLE
        } else {
            Duration::from_nanos(ns)
        });
        self.state.lock().reads_wait = false;
    }

    /// The jobs and verbs queued, waiting up to [`IDLE`] for one if `wait`.
    fn take(&self, wait: bool) -> (Vec<Job>, Vec<NetJob>) {
        let mut s = self.state.lock();
        if wait && !s.has_work() {
            let _ = self.cv.wait_for(&mut s, IDLE);
        }
        (s.jobs.drain(..).collect(), s.net.drain(..).collect())
    }
}

/// Polls the posted verbs once each (on the transport's executor, so that
/// UCX is driven) and returns those that completed. With `wait`, if none
/// did, waits until one does, a job or verb is queued, or `wait` passes.
fn poll_net<'a>(
    node: &ScaleNode,
    net: &mut Vec<NetFuture<'a>>,
    wait: Option<Duration>,
) -> Vec<NetOut> {
    use std::future::Future;
    use std::task::Poll;
    let mut sleep = wait.map(|d| Box::pin(dmkv_transport::exec::sleep(d)));
    let done = dmkv_transport::exec::block_on(std::future::poll_fn(|cx| {
        let mut done = Vec::new();
        let mut i = 0;
        while i < net.len() {
            match net[i].as_mut().poll(cx) {
                Poll::Ready(o) => {
                    drop(net.remove(i));
                    done.push(o);
                }
                Poll::Pending => i += 1,
            }
        }
        if !done.is_empty() {
            return Poll::Ready(done);
        }
        let Some(sl) = sleep.as_mut() else {
            return Poll::Ready(done);
        };
        {
            // The waker under the queue's lock: a push after this look
            // wakes us.
            let mut s = node.ssd_jobs.state.lock();
            if s.has_work() {
                return Poll::Ready(done);
            }
            s.waker = Some(cx.waker().clone());
        }
        if sl.as_mut().poll(cx).is_ready() {
            return Poll::Ready(done);
        }
        Poll::Pending
    }));
    node.ssd_jobs.state.lock().waker = None;
    done
}

/// The completer on the real backends (a thread of the node's pool): runs
/// while `keep_going`.
///
/// It waits for nothing another completion could be finished during: a
/// pull's READ and every delivery's WRITE are posted and polled between
/// the SSD's completions (invariants 20 and 22); with reads but no verb in
/// flight it sleeps until a read completes or a job or verb is handed to it
/// (invariant 23, [`SsdQueue::wait_for_reads`]), and it waits for a verb
/// (or a new job) only when no read completed, at most [`READ_POLL`] while
/// reads are in flight.
pub fn run(node: &ScaleNode, mut keep_going: impl FnMut() -> bool) {
    let mut reading: Vec<(Job, ReadTicket)> = Vec::new();
    let mut net: Vec<NetFuture<'_>> = Vec::new();
    while keep_going() {
        let (jobs, verbs) = node.ssd_jobs.take(reading.is_empty() && net.is_empty());
        for v in verbs {
            net.push(start_net(node, v));
        }
        for job in jobs {
            let job = match job.into_pull() {
                Ok((p, responder)) => {
                    // Posted: polled below beside the SSD's completions
                    // (the handler that decided the batch waits for
                    // nothing, nor does this thread).
                    net.push(start_net(node, NetJob::Pull(p, responder)));
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
                    // A page for another node: its WRITE is posted too.
                    if let Some((d, responder)) = node.ssd_read_done(job, res.map(Outcome::Page)) {
                        net.push(start_net(node, NetJob::Deliver(d, responder)));
                    }
                    progressed = true;
                }
                None => i += 1,
            }
        }
        if !net.is_empty() {
            let wait = if progressed {
                None
            } else if reading.is_empty() {
                Some(IDLE)
            } else {
                Some(READ_POLL)
            };
            for out in poll_net(node, &mut net, wait) {
                finish_net(node, out);
            }
            continue;
        }
        if !progressed {
            node.ssd_jobs.wait_for_reads(&reading);
        }
    }
}

/// What the simulated completer does next.
enum Next {
    /// A job whose device instant came.
    Due(Job),
    /// A posted verb (a pull's read) that completed.
    Pulled(NetOut),
}

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
    let mut pulling: Vec<NetFuture<'_>> = Vec::new();
    let mut seq = 0u64;
    let mut sleep: Option<(u64, std::pin::Pin<Box<dmkv_transport::exec::Sleep>>)> = None;
    let n: &ScaleNode = &node;
    while keep_going() {
        let next = std::future::poll_fn(|cx| {
            // The waker first, then the jobs: a job pushed after the drain
            // wakes this task. No lock is held while the pulls are polled
            // (posting a verb may run code that pushes a job).
            let (jobs, verbs): (Vec<Job>, Vec<NetJob>) = {
                let mut s = n.ssd_jobs.state.lock();
                s.waker = Some(cx.waker().clone());
                (s.jobs.drain(..).collect(), s.net.drain(..).collect())
            };
            for v in verbs {
                pulling.push(start_net(n, v));
            }
            for j in jobs {
                match j.into_pull() {
                    Ok((p, responder)) => pulling.push(start_net(n, NetJob::Pull(p, responder))),
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
            Some(Next::Pulled(out)) => {
                let node = node.clone();
                Box::new(move || finish_net(&node, out))
            }
            None => continue,
        };
        match &cores {
            Some(c) => c.submit(work, Box::new(|_| {})),
            None => work(),
        }
    }
}
