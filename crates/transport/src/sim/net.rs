//! The simulated cluster: nodes, their regions and services, and the
//! hardware model every verb and RPC goes through.
//!
//! A one-sided verb: client core (post cost) -> client NIC tx -> wire ->
//! memory node NIC rx, where it acts on memory at that instant (large reads
//! and writes move in pieces at PCIe speed, so a concurrent writer can tear
//! a reader; atomics wait for the NIC's per-address atomics unit) -> memory
//! node NIC tx -> wire -> client NIC rx. An RPC: the same to the memory
//! node's NIC, then a queue in front of the node's handler cores, served in
//! the order requests are ready (through the NIC); the handler runs at the
//! instant a core takes it, for a service time from the
//! cost model (`rpc_base_ns` plus `line_ns` per distinct cache line of
//! registered memory it touched, plus the work it declared, `sim::work`),
//! and the reply leaves when the service time is over.
//! When the profile models the NIC's queue-pair context cache, a one-sided
//! verb whose queue pair (one per compute thread and memory node) is not
//! cached first holds the memory node's NIC while the context is fetched.
//! A node has `network.nics` NICs (1 unless the profile says otherwise); the
//! queue pairs of a node's `k`-th thread (endpoint) go through its NIC
//! `k mod nics` and the peer's NIC `k mod nics`, replies included (its
//! *lane*), so each NIC has its own message-rate and bandwidth queues.
//!
//! Invariants:
//! 1. Messages from one node to another arrive in the order they were
//!    posted in virtual time (`calendar::PairOrder`: the instant each is
//!    handed to the sending NIC, not the order the model reserved them),
//!    and verbs from one node to another act on memory in that order and
//!    never overlap (a reliable-connection queue pair): the next verb acts
//!    once the previous one's last piece is through and its response has
//!    left, so one queue pair's responses also leave, and arrive, in order
//!    (branch i47; `a_queue_pairs_responses_arrive_in_order`).
//! 2. Each NIC direction and each atomics address serves one thing at a
//!    time in virtual-time order: a message ready at `at` starts at the
//!    first instant `>= at` at which the server is free for its whole
//!    service time, in an idle gap before work reserved ahead for later
//!    instants if one fits (`calendar::Calendar`; branch i36). Client cores
//!    and SSDs are only ever reserved for the current instant, so they stay
//!    first come first served (`Server`), which is the same thing for
//!    them. Busy time, counts and bytes are counted for the utilisation
//!    report.
//! 3. A node's cores (handler cores, a worker pool: [`CoreSet`]) take jobs
//!    in the order they are ready (an RPC: when its request is through the
//!    NIC), never sit idle while a ready job waits, and are never reserved
//!    for a job that is not ready yet (branch i41; `CoreSet`'s own
//!    invariants give the details).

use super::calendar::{Calendar, PairOrder};
use super::{Sim, current, with_metering};
use crate::addr::{NodeId, RegionId, RemoteAddr, RemoteRegion, ServiceId};
use crate::backend::{
    EndpointBackend, Fabric, NodeHost, OpFuture, SharedOp, Verb, VerbResult, VerbResults, Verbs,
};
use crate::endpoint::Endpoint;
use crate::error::{Result, TransportError};
use crate::region::{RegionEntry, RegionMem};
use crate::service::{Reply, RpcContext, ServiceTable};
use parking_lot::RwLock;
use smallvec::SmallVec;
use std::cell::{Cell, RefCell};
use std::collections::{HashMap, VecDeque};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::task::{Context, Poll, Waker};

/// Reads and writes larger than this move in pieces (at most [`MAX_PIECES`]).
const PIECE_BYTES: usize = 64;
const MAX_PIECES: usize = 8;

// ---------------------------------------------------------------------------
// Resources

/// A first-come-first-served server (a client core, an SSD): only ever
/// reserved for the current virtual time, which never goes back, so the
/// order of calls is the order of virtual time (the NICs, reserved ahead,
/// are [`Calendar`]s).
#[derive(Debug, Default, Clone)]
pub(crate) struct Server {
    free_at: u64,
    busy_ns: u64,
    /// Sum of (start - arrival) over what it served: queueing delay.
    wait_ns: u64,
    count: u64,
    bytes: u64,
}

impl Server {
    /// Serves something arriving at `at` for `service` ns; returns when done.
    fn occupy(&mut self, at: u64, service: u64, bytes: u64) -> u64 {
        let start = at.max(self.free_at);
        self.wait_ns += start - at;
        self.free_at = start + service;
        self.busy_ns += service;
        self.count += 1;
        self.bytes += bytes;
        self.free_at
    }
}

/// The NIC's cache of connection (RC queue pair) contexts, least recently
/// used first out. A one-sided verb names its queue pair; if its context is
/// not cached, the NIC fetches it over PCIe before it can serve the verb
/// (`qp_miss_ns` of the receiving direction), evicting the least recently
/// used one. RPCs are not charged: the RPC designs serve from a handful of
/// datagram (UD) queue pairs, one per handler thread, which always fit.
#[derive(Debug, Default)]
pub(crate) struct QpCache {
    /// Cached queue pairs (the issuing endpoint's id), most recent last.
    recent: Vec<u64>,
    hits: u64,
    misses: u64,
}

impl QpCache {
    /// Looks up `qp` in a cache of `capacity` entries; true on a hit.
    fn access(&mut self, qp: u64, capacity: usize) -> bool {
        if let Some(i) = self.recent.iter().rposition(|&q| q == qp) {
            self.recent.remove(i);
            self.recent.push(qp);
            self.hits += 1;
            return true;
        }
        if self.recent.len() >= capacity {
            self.recent.remove(0);
        }
        self.recent.push(qp);
        self.misses += 1;
        false
    }
}

type Job = Box<dyn FnOnce() -> u64>;

/// `n` identical cores in front of one queue of jobs ordered by the instant
/// each is ready (a memory node's handler threads, a worker pool). A job is
/// submitted with its ready instant (an RPC: when the memory node's NIC has
/// received it; a worker job or a progress slice: now); a core takes it
/// once it is ready, runs it, and is busy for the service time it returns.
///
/// Invariants (branch i41; before it, a core was taken when the job was
/// submitted and stayed reserved until the job was ready, and the queue was
/// first in, first out in submission order):
/// 1. Jobs start in ready order: a job starts no earlier than its ready
///    instant, and of two jobs the one with the smaller (ready instant,
///    submission number) starts first, or at the same instant.
/// 2. A core is never idle while a ready job waits: at every instant, once
///    the events of that instant have run, either no job in the queue is
///    ready or no core is idle.
/// 3. A core is taken only by a job that is ready, so a job that is ready
///    earlier never waits behind a core reserved for one that is not.
/// 4. No busy wait: the core set acts at submissions, at job ends and at
///    wake events (`wakes`). A wake is scheduled at a job's ready instant
///    when the job is submitted while more cores are idle than wakes are
///    due by then (so, with cores to spare, each job gets the event it got
///    before this branch, at the same place in the event order), and when a
///    core is left idle with jobs queued and no wake due by the first one's
///    ready instant; never one per idle core per instant.
/// 5. Busy time and job counts: a job's service time is added once, when
///    it runs (with `add_busy`'s progress-point work), and counted as one
///    job, as before.
/// 6. The DST hold (`Sched::holding_jobs`): a job due to start during a
///    wait on the network alone keeps the core it took and starts when
///    that wait ends, as before: the one exception to 1 and 2.
/// 7. Cores have identities (branch i69, for their private caches): each
///    core set's cores are numbered `first_core..first_core + cores` in a
///    numbering shared by all sets; a job takes the idle core that became
///    idle last (the free cores are a stack, core `first_core` on top at
///    the start), holds it until its service time is over, and the code
///    it runs sees that core as the running core (`sim::on_numbered_core`).
///    Which core a job gets never changes when or in what order jobs run:
///    only what their lines cost, through the private caches.
///
/// Checked by `core_set_serves_in_ready_order_like_a_reference` (unit test
/// below: random submissions against a reference simulation) and
/// `a_handler_core_waits_for_no_request_that_is_not_ready`
/// (`tests/sim_backend.rs`).
pub(crate) struct CoreSet {
    idle: usize,
    /// Jobs not started: (ready instant, submission number, job), sorted by
    /// (ready instant, submission number).
    queue: VecDeque<(u64, u64, Job)>,
    /// Jobs submitted so far (the next submission number).
    submitted: u64,
    /// Instants of wake events scheduled and not run yet, sorted.
    wakes: SmallVec<[u64; 4]>,
    busy_ns: u64,
    /// Sum of (start - ready instant) over the jobs started: the time they
    /// queued for a core.
    wait_ns: u64,
    jobs: u64,
    cores: usize,
    /// The idle cores' numbers (invariant 7): `idle` of them, the next to
    /// be taken last.
    free: Vec<u32>,
}

impl CoreSet {
    fn new(cores: usize, first_core: u32) -> CoreSet {
        CoreSet {
            free: (first_core..first_core + cores as u32).rev().collect(),
            idle: cores,
            queue: VecDeque::new(),
            submitted: 0,
            wakes: SmallVec::new(),
            busy_ns: 0,
            wait_ns: 0,
            jobs: 0,
            cores,
        }
    }

    /// Takes an idle core for the first job of the queue if it is ready at
    /// `now` (invariants 1 and 3); the job and the core's number
    /// (invariant 7).
    fn take_ready(&mut self, now: u64) -> Option<(Job, u32)> {
        if self.idle == 0 || self.queue.front().is_none_or(|&(r, _, _)| r > now) {
            return None;
        }
        self.idle -= 1;
        let core = self.free.pop().expect("an idle core has a number");
        let (ready, _, job) = self.queue.pop_front()?;
        self.wait_ns += now - ready;
        Some((job, core))
    }

    /// Notes a wake event at `at` (the caller schedules it).
    fn add_wake(&mut self, at: u64) -> u64 {
        let i = self.wakes.partition_point(|&w| w <= at);
        self.wakes.insert(i, at);
        at
    }

    /// With a core idle and jobs queued, the instant of the wake event that
    /// must be scheduled for the first of them, unless one is due by then
    /// (invariant 2; the wake that runs then re-checks for the next job).
    fn wake_for_first(&mut self) -> Option<u64> {
        let &(first, _, _) = self.queue.front()?;
        if self.idle == 0 || self.wakes.first().is_some_and(|&w| w <= first) {
            return None;
        }
        Some(self.add_wake(first))
    }
}

/// Submits `job`, ready at `ready_at`, to the core set `id`.
pub(crate) fn submit_job(sim: &Rc<Sim>, id: usize, ready_at: u64, job: Job) {
    let at = ready_at.max(sim.sched.now());
    let wake = {
        let mut net = sim.net.borrow_mut();
        let cs = &mut net.coresets[id];
        let seq = cs.submitted;
        cs.submitted += 1;
        // Every queued job was submitted before this one: it goes after
        // those ready at or before `at` (in the common case, at the back).
        let i = cs.queue.partition_point(|&(r, _, _)| r <= at);
        cs.queue.insert(i, (at, seq, job));
        // Invariant 4: a wake of its own unless the idle cores are all
        // due to wake by its ready instant.
        let due = cs.wakes.partition_point(|&w| w <= at);
        (cs.idle > due).then(|| cs.add_wake(at))
    };
    if let Some(at) = wake {
        schedule_wake(sim, id, at);
    }
}

/// A wake event of core set `id` at `at`: an idle core takes the first
/// ready job, if any.
fn schedule_wake(sim: &Rc<Sim>, id: usize, at: u64) {
    let s = sim.clone();
    sim.sched.at(at, move || {
        let now = s.sched.now();
        let (job, wake) = {
            let mut net = s.net.borrow_mut();
            let cs = &mut net.coresets[id];
            debug_assert_eq!(cs.wakes.first(), Some(&now), "a wake runs at its instant");
            if cs.wakes.first() == Some(&now) {
                cs.wakes.remove(0);
            }
            let job = cs.take_ready(now);
            (job, cs.wake_for_first())
        };
        // Before the job runs: a job may wait in a nested frame, during
        // which the next job must be able to start.
        if let Some(at) = wake {
            schedule_wake(&s, id, at);
        }
        if let Some((job, core)) = job {
            run_job(&s, id, job, core);
        }
    });
}

/// The core set of `node`'s handler cores, if it serves RPCs.
pub(crate) fn handler_coreset(net: &Net, node: NodeId) -> Option<usize> {
    net.nodes.get(node.0 as usize)?.handlers
}

/// Adds `ns` to core set `id`'s busy time (a job's work passed at its
/// progress points while it held the core).
pub(crate) fn add_busy(net: &mut Net, id: usize, ns: u64) {
    net.coresets[id].busy_ns += ns;
}

/// Jobs of core set `id` that are ready at `now` and wait for a core (so
/// none of its cores is free, invariant 2).
pub(crate) fn coreset_queued(net: &Net, id: usize, now: u64) -> usize {
    net.coresets[id]
        .queue
        .partition_point(|&(r, _, _)| r <= now)
}

/// Runs `job` on core `core` of set `id` now (the core is taken), then
/// frees the core when its service time is over and starts the first ready
/// job.
fn run_job(sim: &Rc<Sim>, id: usize, job: Job, core: u32) {
    if sim.sched.holding_jobs() {
        let s = sim.clone();
        sim.sched
            .hold_job(Box::new(move || run_job(&s, id, job, core)));
        return;
    }
    let cost = super::on_numbered_core(core, job);
    if cost == SUSPENDED {
        return;
    }
    release_core(sim, id, core, cost);
}

/// What a job returns when it suspended (a worker job waiting, `jobco`):
/// its core stays held until the job ends and calls [`release_core`].
pub(crate) const SUSPENDED: u64 = u64::MAX;

/// A job that ran on `core` of core set `id` is done and holds the core
/// `cost` ns longer (the CPU it was charged and did not pass at progress
/// points); then the core takes the next ready job.
pub(crate) fn release_core(sim: &Rc<Sim>, id: usize, core: u32, cost: u64) {
    {
        let mut net = sim.net.borrow_mut();
        let cs = &mut net.coresets[id];
        cs.busy_ns += cost;
        cs.jobs += 1;
    }
    let s = sim.clone();
    sim.sched.at(sim.sched.now() + cost, move || {
        let now = s.sched.now();
        let (next, wake) = {
            let mut net = s.net.borrow_mut();
            let cs = &mut net.coresets[id];
            cs.idle += 1;
            cs.free.push(core);
            let next = cs.take_ready(now);
            (next, cs.wake_for_first())
        };
        // The next job starts in an event of its own at this instant, as
        // it did before invariant 1.
        if let Some((job, core)) = next {
            let s2 = s.clone();
            s.sched.at(now, move || run_job(&s2, id, job, core));
        }
        if let Some(at) = wake {
            schedule_wake(&s, id, at);
        }
    });
}

/// Runs `f` as code on a simulated core, as one job (an RPC handler call,
/// a worker job): registered memory it touches is charged per DISTINCT
/// cache line and the work it declares once per job (`sim::job_lines`,
/// `sim::work`); returns `f`'s result and the CPU it used.
pub(crate) fn on_core<R>(sim: &Sim, f: impl FnOnce() -> R) -> (R, u64) {
    let before = sim.sched.cpu_ns.get();
    let r = super::job_lines(|| with_metering(sim.profile.memnode.line_ns, f));
    (r, sim.sched.cpu_ns.get() - before)
}

/// A hash map for the model's small integer keys: the default SipHash costs
/// more than the rest of a message's bookkeeping, and nothing here needs
/// protection from chosen keys.
type FastMap<K, V> = HashMap<K, V, std::hash::BuildHasherDefault<FastHasher>>;

/// Multiply-and-rotate hashing of integers (the FxHash scheme).
#[derive(Default)]
pub(crate) struct FastHasher(u64);

impl std::hash::Hasher for FastHasher {
    fn finish(&self) -> u64 {
        self.0
    }
    fn write(&mut self, bytes: &[u8]) {
        for &b in bytes {
            self.write_u64(b as u64);
        }
    }
    fn write_u16(&mut self, n: u16) {
        self.write_u64(n as u64);
    }
    fn write_u32(&mut self, n: u32) {
        self.write_u64(n as u64);
    }
    fn write_u64(&mut self, n: u64) {
        self.0 = (self.0.rotate_left(5) ^ n).wrapping_mul(0x51_7c_c1_b7_27_22_0a_95);
    }
}

/// One NIC of a node: each direction a server, and its connection-context
/// cache (when the profile models one).
#[derive(Default)]
pub(crate) struct Nic {
    tx: Calendar,
    rx: Calendar,
    qp_cache: QpCache,
}

/// One node's resources in the model.
pub(crate) struct NodeModel {
    /// Its NICs (`network.nics`, at least one); lane `k` uses
    /// `nics[k % nics.len()]`.
    nics: Vec<Nic>,
    /// Its handler cores' set, if it serves RPCs.
    handlers: Option<usize>,
    /// Its SSD: occupancy per I/O is the device's IOPS share.
    ssd: Server,
    /// Writes of several pieces whose first piece has landed and whose last
    /// has not: while there are none, a read cannot tear and is done in one
    /// event (see `arrive_verb`).
    writes_landing: u32,
    /// Services whose requests are written into mailboxes
    /// ([`super::set_mailbox_requests`]): each request is two messages,
    /// its payload and then a flag of [`MAILBOX_FLAG_BYTES`]. Usually
    /// empty (one engine registers one service).
    mailbox_services: Vec<ServiceId>,
}

/// The mailbox flag's size: ScaleStore's artifact writes one byte
/// (`uint8_t flag = 1`, `threads/Worker.hpp` `Worker::writeMsg`).
pub(crate) const MAILBOX_FLAG_BYTES: u64 = 1;

/// Marks `service` on `node` as one whose requests are written into
/// mailboxes (see [`super::set_mailbox_requests`]); false if the node is
/// not in the model.
pub(crate) fn set_mailbox_requests(net: &mut Net, node: NodeId, service: ServiceId) -> bool {
    let Some(n) = net.nodes.get_mut(node.0 as usize) else {
        return false;
    };
    if !n.mailbox_services.contains(&service) {
        n.mailbox_services.push(service);
    }
    true
}

/// Takes one I/O on `node`'s SSD now; returns when it completes.
pub(crate) fn ssd_io(sim: &Sim, node: NodeId, write: bool) -> u64 {
    let now = sim.sched.now();
    let slot = sim.profile.ssd_slot_ns();
    let latency = if write {
        sim.profile.ssd.write_ns
    } else {
        sim.profile.ssd.read_ns
    };
    let mut net = sim.net.borrow_mut();
    let Some(n) = net.nodes.get_mut(node.0 as usize) else {
        return now;
    };
    let started = n.ssd.occupy(now, slot, 4096) - slot;
    started + latency.max(slot)
}

/// What the model holds besides the nodes' memory.
#[derive(Default)]
pub(crate) struct Net {
    pub(crate) nodes: Vec<NodeModel>,
    pub(crate) coresets: Vec<CoreSet>,
    coreset_names: Vec<String>,
    /// Cores of all core sets so far (the next set's first core number,
    /// `CoreSet` invariant 7).
    cores_total: u32,
    /// Client cores (one per endpoint): name and server.
    clients: Vec<(String, Rc<RefCell<Server>>)>,
    /// Per ordered node pair: the arrivals of messages posted ahead, so
    /// that every message arrives in posting order (invariant 1).
    arrivals: PairTable<PairOrder>,
    /// Per ordered node pair: when the last verb's memory access ends. Set
    /// when a verb arrives (an event, so in virtual-time order), for an
    /// instant that may be ahead when the queue pair is still busy: the
    /// next verb of the pair must act after it anyway (invariant 1).
    qp_busy_until: PairTable<u64>,
    /// Per atomic address: the NIC's atomics unit's reservations for it
    /// (invariant 2: an atomic whose queue pair lets it start early is not
    /// queued behind one reserved for later).
    atomic_free: AtomicUnits,
}

/// The NICs' atomics units: a calendar per address with atomics reserved
/// after the current instant. An address whose calendar holds nothing
/// after `now` is dropped (`Calendar::idle_from`: made afresh, it gives
/// every later atomic the same start) when the map reaches `sweep_at`
/// entries, then `sweep_at` doubles what the sweep left (at least
/// [`ATOMIC_SWEEP_MIN`]): amortised O(1) per atomic, and the map holds the
/// addresses with atomics in flight, not every address an atomic ever
/// touched (`atomic_units_are_dropped_once_idle` checks both).
#[derive(Default)]
struct AtomicUnits {
    units: FastMap<(u16, u32, u64), Calendar>,
    sweep_at: usize,
}

const ATOMIC_SWEEP_MIN: usize = 1024;

impl AtomicUnits {
    /// An atomic on `key` that could start at `at` (`>= now`) and holds
    /// the address's unit for `ns`: when it starts.
    fn start(&mut self, now: u64, key: (u16, u32, u64), at: u64, ns: u64) -> u64 {
        let start = self.units.entry(key).or_default().stall(now, at, ns) - ns;
        if self.units.len() >= self.sweep_at {
            self.units.retain(|_, unit| !unit.idle_from(now));
            self.sweep_at = ATOMIC_SWEEP_MIN.max(2 * self.units.len());
        }
        start
    }
}

/// A value per ordered pair of nodes (default until set), indexed
/// directly: node ids are small and dense, and a message looks up one of
/// these twice.
#[derive(Default)]
struct PairTable<T> {
    /// `rows[from][to]`, grown on first use.
    rows: Vec<Vec<T>>,
}

impl<T: Default> PairTable<T> {
    fn get_mut(&mut self, from: NodeId, to: NodeId) -> &mut T {
        let (from, to) = (from.0 as usize, to.0 as usize);
        if self.rows.len() <= from {
            self.rows.resize_with(from + 1, Vec::new);
        }
        let row = &mut self.rows[from];
        if row.len() <= to {
            row.resize_with(to + 1, T::default);
        }
        &mut row[to]
    }
}

/// The model's per-size costs (NIC occupancy of a message, PCIe and link
/// time of a transfer), each computed once per size from the profile and
/// kept: a message asks for two or three of them, and each is a float
/// division and a rounding. Sizes up to [`COST_MEMO_BYTES`]; larger ones
/// are computed each time. The profile does not change during a
/// simulation, so a kept value is the value the profile gives.
pub(crate) struct Costs {
    nic: Box<[Cell<u64>]>,
    pcie: Box<[Cell<u64>]>,
    link: Box<[Cell<u64>]>,
    /// Whole-verb piece sums ([`span_ns`]), direct-mapped: (key, value),
    /// key 0 for an empty entry.
    spans: Box<[Cell<(u64, u64)>]>,
}

/// Entries of [`Costs::spans`] (a power of two).
const SPAN_MEMO: usize = 64;

const COST_MEMO_BYTES: usize = 4096;
/// Not computed yet (a cost that really is `u64::MAX` is recomputed each
/// time, which gives the same value).
const UNSET: u64 = u64::MAX;

impl Costs {
    pub(crate) fn new() -> Costs {
        let table = || (0..=COST_MEMO_BYTES).map(|_| Cell::new(UNSET)).collect();
        Costs {
            nic: table(),
            pcie: table(),
            link: table(),
            spans: (0..SPAN_MEMO).map(|_| Cell::new((0, 0))).collect(),
        }
    }
}

#[inline]
fn memo(table: &[Cell<u64>], bytes: u64, f: impl FnOnce() -> u64) -> u64 {
    match table.get(bytes as usize) {
        Some(c) if c.get() != UNSET => c.get(),
        Some(c) => {
            let v = f();
            c.set(v);
            v
        }
        None => f(),
    }
}

/// Nanoseconds a message with `payload` bytes occupies a NIC direction.
fn nic_ns(sim: &Sim, payload: u64) -> u64 {
    memo(&sim.costs.nic, payload, || {
        sim.profile.nic_service_ns(payload)
    })
}

impl Net {
    pub(crate) fn add_coreset(&mut self, name: String, cores: usize) -> usize {
        self.coresets.push(CoreSet::new(cores, self.cores_total));
        self.cores_total += cores as u32;
        self.coreset_names.push(name);
        self.coresets.len() - 1
    }

    /// Each core set's name and its cores' numbers (`CoreSet` invariant 7).
    pub(crate) fn coreset_cores(&self) -> impl Iterator<Item = (&str, std::ops::Range<u32>)> {
        let mut first = 0;
        self.coresets
            .iter()
            .zip(&self.coreset_names)
            .map(move |(cs, name)| {
                let r = first..first + cs.cores as u32;
                first = r.end;
                (name.as_str(), r)
            })
    }
}

/// Busy time and traffic of one modelled resource so far.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct ResourceUse {
    /// e.g. `node0 nic tx`, `node0 handler cores`, `node3 client core 2`.
    pub name: String,
    /// Cores or servers behind the name (utilisation is busy / (cores x time)).
    pub servers: usize,
    pub busy_ns: u64,
    /// Queueing delay: the sum over what it served of the time from when
    /// it was ready until the server started it.
    pub wait_ns: u64,
    /// Messages, jobs or operations served.
    pub count: u64,
    pub bytes: u64,
}

/// Messages so far that arrived out of posting order
/// (`PairOrder::overtaken`, the one exception to invariant 1), over every
/// ordered node pair.
pub(crate) fn messages_overtaken(net: &Net) -> u64 {
    net.arrivals
        .rows
        .iter()
        .flatten()
        .map(|p| p.overtaken)
        .sum()
}

pub(crate) fn resources(net: &Net, miss_ns: u64) -> Vec<ResourceUse> {
    let mut out = Vec::new();
    for (i, n) in net.nodes.iter().enumerate() {
        for (k, nic) in n.nics.iter().enumerate() {
            // One NIC keeps the names of the one-NIC model (`node0 nic tx`);
            // several are numbered (`node0 nic1 tx`).
            let name = if n.nics.len() == 1 {
                "nic".to_string()
            } else {
                format!("nic{k}")
            };
            for (dir, s) in [("tx", &nic.tx), ("rx", &nic.rx)] {
                out.push(ResourceUse {
                    name: format!("node{i} {name} {dir}"),
                    servers: 1,
                    busy_ns: s.busy_ns,
                    wait_ns: s.wait_ns,
                    count: s.count,
                    bytes: s.bytes,
                });
            }
            if nic.qp_cache.misses > 0 {
                // Count: misses; busy: the NIC time the fetches took.
                out.push(ResourceUse {
                    name: format!("node{i} {name} qp-context misses"),
                    servers: 1,
                    busy_ns: nic.qp_cache.misses * miss_ns,
                    wait_ns: 0,
                    count: nic.qp_cache.misses,
                    bytes: 0,
                });
            }
        }
        if n.ssd.count > 0 {
            out.push(ResourceUse {
                name: format!("node{i} ssd"),
                servers: 1,
                busy_ns: n.ssd.busy_ns,
                wait_ns: n.ssd.wait_ns,
                count: n.ssd.count,
                bytes: n.ssd.bytes,
            });
        }
    }
    for (cs, name) in net.coresets.iter().zip(&net.coreset_names) {
        out.push(ResourceUse {
            name: name.clone(),
            servers: cs.cores,
            busy_ns: cs.busy_ns,
            wait_ns: cs.wait_ns,
            count: cs.jobs,
            bytes: 0,
        });
    }
    for (name, s) in &net.clients {
        let s = s.borrow();
        out.push(ResourceUse {
            name: name.clone(),
            servers: 1,
            busy_ns: s.busy_ns,
            wait_ns: s.wait_ns,
            count: s.count,
            bytes: 0,
        });
    }
    out
}

// ---------------------------------------------------------------------------
// Nodes

pub(crate) struct NodeState {
    id: NodeId,
    crashed: AtomicBool,
    regions: RwLock<Vec<Option<RegionEntry>>>,
    services: ServiceTable,
    handler_threads: usize,
}

/// The nodes of a simulation; shared by its fabric and node handles, which
/// must be used on the simulation's thread.
pub(crate) struct Cluster {
    nodes: RwLock<Vec<Arc<NodeState>>>,
    /// Bumped whenever a region is withdrawn or a node crashes (or the
    /// cluster is cleared): what [`RegionCache`] found before is stale.
    /// (Registration only adds regions, under ids never used before.)
    generation: AtomicU64,
}

impl Cluster {
    pub(crate) fn new() -> Arc<Cluster> {
        Arc::new(Cluster {
            nodes: RwLock::new(Vec::new()),
            generation: AtomicU64::new(0),
        })
    }

    fn node(&self, id: NodeId) -> Result<Arc<NodeState>> {
        self.nodes
            .read()
            .get(id.0 as usize)
            .cloned()
            .ok_or(TransportError::UnknownNode(id))
    }

    /// Whether `id` names a node ([`Cluster::node`] without taking a
    /// reference: a verb checks it on every post).
    fn has_node(&self, id: NodeId) -> Result<()> {
        if (id.0 as usize) < self.nodes.read().len() {
            Ok(())
        } else {
            Err(TransportError::UnknownNode(id))
        }
    }

    pub(crate) fn add_node(self: &Arc<Self>, sim: &Sim, handler_threads: usize) -> Arc<SimNode> {
        let mut nodes = self.nodes.write();
        let id = NodeId(u16::try_from(nodes.len()).expect("at most 65536 nodes"));
        let state = Arc::new(NodeState {
            id,
            crashed: AtomicBool::new(false),
            regions: RwLock::new(Vec::new()),
            services: ServiceTable::new(),
            handler_threads,
        });
        nodes.push(state.clone());
        let mut net = sim.net.borrow_mut();
        let handlers = (handler_threads > 0)
            .then(|| net.add_coreset(format!("node{} handler cores", id.0), handler_threads));
        let nics = sim.profile.network.nics.max(1) as usize;
        net.nodes.push(NodeModel {
            nics: (0..nics).map(|_| Nic::default()).collect(),
            handlers,
            ssd: Server::default(),
            writes_landing: 0,
            mailbox_services: Vec::new(),
        });
        Arc::new(SimNode {
            state,
            cluster: self.clone(),
        })
    }

    /// Crashes `node` now: its memory is gone and it answers nothing.
    pub(crate) fn crash(&self, node: NodeId) {
        if let Ok(n) = self.node(node) {
            n.crashed.store(true, Ordering::Release);
            n.regions.write().clear();
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
    }

    pub(crate) fn clear(&self) {
        for n in self.nodes.read().iter() {
            n.services.clear();
            n.regions.write().clear();
        }
        self.generation.fetch_add(1, Ordering::AcqRel);
    }
}

/// A node of a simulated cluster.
pub struct SimNode {
    state: Arc<NodeState>,
    cluster: Arc<Cluster>,
}

impl NodeHost for SimNode {
    fn id(&self) -> NodeId {
        self.state.id
    }

    fn register_region(&self, len: usize) -> Result<(RemoteRegion, Arc<RegionMem>)> {
        if self.state.crashed.load(Ordering::Acquire) {
            return Err(TransportError::NodeDown(self.state.id));
        }
        crate::region::register_zeroed(&self.state.regions, self.state.id, len)
    }

    fn deregister_region(&self, id: RegionId) {
        if let Some(slot) = self.state.regions.write().get_mut(id.0 as usize) {
            *slot = None;
        }
        self.cluster.generation.fetch_add(1, Ordering::AcqRel);
    }

    fn services(&self) -> &ServiceTable {
        &self.state.services
    }

    fn fabric(&self) -> Arc<dyn Fabric> {
        Arc::new(SimFabric {
            cluster: self.cluster.clone(),
        })
    }

    fn handler_threads(&self) -> usize {
        self.state.handler_threads
    }
}

/// Makes endpoints of a simulated cluster.
pub(crate) struct SimFabric {
    pub(crate) cluster: Arc<Cluster>,
}

impl Fabric for SimFabric {
    fn name(&self) -> &'static str {
        "sim"
    }

    fn endpoint(&self, node: NodeId) -> Result<Endpoint> {
        self.cluster.node(node)?;
        let sim = current().ok_or_else(|| {
            TransportError::Backend(
                "a sim endpoint must be made on the thread that runs the simulation".into(),
            )
        })?;
        let core = Rc::new(RefCell::new(Server::default()));
        let (id, lane) = {
            let mut net = sim.net.borrow_mut();
            let n = net
                .clients
                .iter()
                .filter(|(name, _)| name.starts_with(&format!("node{} ", node.0)))
                .count();
            net.clients
                .push((format!("node{} client core {n}", node.0), core.clone()));
            (net.clients.len() as u64 - 1, n as u32)
        };
        Ok(Endpoint::new(Box::new(SimEndpoint {
            shared: Rc::new(EpShared {
                cluster: self.cluster.clone(),
                node,
                id,
                lane,
                pool: RefCell::new(Vec::new()),
                next: Cell::new(0),
            }),
            cluster: self.cluster.clone(),
            node,
            core,
            known_nodes: Cell::new(0),
            own_cpu: Cell::new(None),
        })))
    }
}

// ---------------------------------------------------------------------------
// Completions

/// A result filled in by events and awaited by one task.
struct Slot<T> {
    value: Option<T>,
    waker: Option<Waker>,
    /// A value on its way, handed over by [`Completion::deliver`].
    staged: Option<T>,
}

pub(crate) struct Completion<T>(Rc<RefCell<Slot<T>>>);

impl<T> Completion<T> {
    fn new() -> Completion<T> {
        Completion(Rc::new(RefCell::new(Slot {
            value: None,
            waker: None,
            staged: None,
        })))
    }
    fn handle(&self) -> Completion<T> {
        Completion(self.0.clone())
    }
    /// Keeps `v` until [`Completion::deliver`] (an event that then carries
    /// only the completion).
    fn stage(&self, v: T) {
        self.0.borrow_mut().staged = Some(v);
    }
    /// Completes with the staged value.
    fn deliver(&self) {
        let v = self.0.borrow_mut().staged.take().expect("a staged value");
        self.complete(v)
    }
    fn complete(&self, v: T) {
        let w = {
            let mut s = self.0.borrow_mut();
            s.value = Some(v);
            s.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }
}

impl<T> Future for Completion<T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        self.0.poll_op(cx)
    }
}

/// A completion awaited as the backend's `OpFuture::Shared` (branch i54:
/// not boxed once more).
impl<T> SharedOp<T> for RefCell<Slot<T>> {
    fn poll_op(&self, cx: &mut Context<'_>) -> Poll<T> {
        let mut s = self.borrow_mut();
        match s.value.take() {
            Some(v) => Poll::Ready(v),
            None => {
                s.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

// ---------------------------------------------------------------------------
// The issuing side

struct SimEndpoint {
    cluster: Arc<Cluster>,
    node: NodeId,
    /// This compute thread's core.
    core: Rc<RefCell<Server>>,
    /// What its verbs' events need (made once, not per batch).
    shared: Rc<EpShared>,
    /// Nodes the cluster had when last looked at (`SimEndpoint::has_node`).
    known_nodes: Cell<usize>,
    /// CPU reserved on the core for the task that runs now, without a
    /// sleep (an operation's CPU, `begin_op`; an RPC's payload post before
    /// its flag's): (the instant it was reserved, when it ends). The
    /// task's next charge at that instant is ready only when that work
    /// ends, so the time between is not counted as waiting for the core
    /// (`Server::wait_ns`: queueing behind other tasks). Taken by the next
    /// charge; the schedule does not depend on it (the core is free no
    /// earlier than that end anyway).
    own_cpu: Cell<Option<(u64, u64)>>,
}

fn sim_or_err() -> Result<Rc<Sim>> {
    current().ok_or_else(|| {
        TransportError::Backend(
            "a sim endpoint was used outside its simulation's thread (an engine thread that \
             does not come from the runtime?)"
                .into(),
        )
    })
}

/// The bytes a verb carries to the memory node and back.
fn verb_bytes(v: &Verb) -> (u64, u64) {
    match v {
        Verb::Read { len, .. } => (0, *len as u64),
        Verb::Write { data, .. } => (data.len() as u64, 0),
        Verb::Cas { .. } => (16, 8),
        Verb::Faa { .. } => (8, 8),
    }
}

impl NodeModel {
    /// The NIC a queue pair of lane `lane` uses on this node.
    fn nic(&mut self, lane: u32) -> &mut Nic {
        let n = self.nics.len();
        // One NIC (the usual profile): no division.
        if n == 1 {
            return &mut self.nics[0];
        }
        &mut self.nics[lane as usize % n]
    }
}

/// When a message sent at `at` from `from` arrives at `to`, through the
/// sender's NIC of `lane` and the wire (jitter included; invariant 1 kept).
#[inline]
fn send_message(sim: &Sim, from: NodeId, to: NodeId, at: u64, payload: u64, lane: u32) -> u64 {
    let m = MessageCost::draw(sim, at, payload);
    let mut net = sim.net.borrow_mut();
    transmit(
        sim,
        &mut net,
        from,
        to,
        at,
        m.service,
        m.wire_bytes,
        m.jitter,
        lane,
    )
}

/// What a message posted at `at` costs, drawn once per message by both
/// senders ([`send_message`], [`send_and_receive`]) in the same order (the
/// NIC time, then the jitter draw: the seed's sequence of draws is the
/// same whichever sender a message takes).
struct MessageCost {
    /// Each NIC's time for the payload (both directions use the same).
    service: u64,
    /// Wire jitter plus any injected delay.
    jitter: u64,
    /// Payload and headers.
    wire_bytes: u64,
}

impl MessageCost {
    #[inline(always)]
    fn draw(sim: &Sim, at: u64, payload: u64) -> MessageCost {
        let service = nic_ns(sim, payload);
        let jitter = sim.sched.random(sim.jitter_ns + 1) + super::faults::extra_delay(sim);
        debug_assert!(at >= sim.sched.now(), "a message posted in the past");
        MessageCost {
            service,
            jitter,
            wire_bytes: payload + sim.profile.network.header_bytes,
        }
    }
}

/// The sending half of a message, on a borrowed model: the sender's NIC
/// of `lane`, then the wire; returns when it arrives at `to` (in posting
/// order, invariant 1). Always inlined into its two callers (out of line,
/// its call cost more than the second borrow it saves).
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn transmit(
    sim: &Sim,
    net: &mut Net,
    from: NodeId,
    to: NodeId,
    at: u64,
    service: u64,
    wire_bytes: u64,
    jitter: u64,
    lane: u32,
) -> u64 {
    let now = sim.sched.now();
    let sent = net.nodes[from.0 as usize]
        .nic(lane)
        .tx
        .occupy(now, at, service, wire_bytes);
    let arrive = sent + sim.profile.network.one_way_ns + jitter;
    net.arrivals.get_mut(from, to).place(now, at, arrive)
}

/// [`send_message`] then [`receive_message_at`] for its arrival (a verb's
/// response, an RPC's reply, a posted write's two legs): the same draws,
/// reservations and instants as the two calls, with one borrow of the
/// model and one look-up of the message's NIC time (both directions
/// occupy a NIC for the same payload). Returns when the receiving NIC is
/// through with it.
fn send_and_receive(sim: &Sim, from: NodeId, to: NodeId, at: u64, payload: u64, lane: u32) -> u64 {
    let m = MessageCost::draw(sim, at, payload);
    let mut guard = sim.net.borrow_mut();
    let net = &mut *guard;
    let arrive = transmit(
        sim,
        net,
        from,
        to,
        at,
        m.service,
        m.wire_bytes,
        m.jitter,
        lane,
    );
    net.nodes[to.0 as usize]
        .nic(lane)
        .rx
        .occupy(sim.sched.now(), arrive, m.service, m.wire_bytes)
}

/// The receiving NIC of `lane` takes a message that arrived now; returns
/// when it is through.
fn receive_message(sim: &Sim, to: NodeId, payload: u64, lane: u32) -> u64 {
    receive_message_at(sim, to, payload, sim.sched.now(), lane)
}

/// The receiving NIC of `lane` takes a message arriving at `at`.
#[inline]
fn receive_message_at(sim: &Sim, to: NodeId, payload: u64, at: u64, lane: u32) -> u64 {
    let service = nic_ns(sim, payload);
    let wire_bytes = payload + sim.profile.network.header_bytes;
    let now = sim.sched.now();
    sim.net.borrow_mut().nodes[to.0 as usize]
        .nic(lane)
        .rx
        .occupy(now, at, service, wire_bytes)
}

/// One batch in flight: shared by its verbs' events and the task that
/// awaits it ([`BatchFuture`]), in one allocation that the endpoint reuses
/// for its next batches (`EpShared::spare`).
pub(crate) struct BatchState {
    /// The batch's verbs as posted: its events name a verb by its index
    /// (branch i50: an event is a reference to the state and an index, not
    /// the verb and the simulation; a write's data stays here until its
    /// last piece has landed).
    verbs: Verbs,
    /// Per verb: its result, and a read's state while it waits for its
    /// turn at the memory.
    slots: SmallVec<[VerbSlot; 4]>,
    left: usize,
    /// Latest completion time of a verb so far.
    done_at: u64,
    /// The batch's outcome once its last response is through, until the
    /// awaiting task takes it.
    outcome: Option<Result<VerbResults>>,
    waker: Option<Waker>,
    /// The posting endpoint's node, its queue pairs' lane and id
    /// (`EpShared`), and the cluster it resolves addresses in: the same for
    /// every batch of a state (an endpoint reuses only its own states).
    node: NodeId,
    lane: u32,
    qp: u64,
    cluster: Arc<Cluster>,
}

/// One verb of a batch in flight.
#[derive(Default)]
struct VerbSlot {
    result: Option<Result<VerbResult>>,
    /// A read that arrived and waits for its turn at the memory
    /// (`NetEvent::Read`).
    read: Option<PendingRead>,
}

/// What a read that waits for its turn at the memory needs then.
struct PendingRead {
    mem: Arc<RegionMem>,
    /// When the memory node's NIC has received it.
    rx_done: u64,
    back_bytes: u64,
    /// Its pieces' PCIe time ([`span_ns`]).
    span: u64,
}

impl BatchState {
    /// The batch is over: hands `v` to the awaiting task and wakes it.
    fn complete(state: &RefCell<BatchState>, v: Result<VerbResults>) {
        let w = {
            let mut st = state.borrow_mut();
            st.outcome = Some(v);
            st.waker.take()
        };
        if let Some(w) = w {
            w.wake();
        }
    }
}

/// A batch's state shared with its events.
type BatchRef = Rc<RefCell<BatchState>>;

/// Batch states an endpoint keeps for reuse, at most.
const POOLED_BATCHES: usize = 16;

/// What the task that posted a batch awaits: the batch's state itself, as
/// the backend's `OpFuture::Shared` (branch i54: it was a `BatchFuture`
/// boxed per batch, which gave the state back to the endpoint when it
/// dropped; the endpoint now finds its free states itself,
/// `EpShared::batch_state`).
impl SharedOp<Result<VerbResults>> for RefCell<BatchState> {
    fn poll_op(&self, cx: &mut Context<'_>) -> Poll<Result<VerbResults>> {
        let mut st = self.borrow_mut();
        match st.outcome.take() {
            Some(v) => Poll::Ready(v),
            None => {
                st.waker = Some(cx.waker().clone());
                Poll::Pending
            }
        }
    }
}

impl EpShared {
    /// A batch state for `verbs` (taken out of the caller's list, which is
    /// left empty): a free one of the endpoint's pool if it has one (one
    /// nothing else holds: its batch's task dropped its future, and no
    /// event of the batch is pending, as it completed or never will),
    /// looked for from the one after the state taken last (batches finish
    /// about in the order they were posted).
    fn batch_state(&self, verbs: &mut Verbs) -> BatchRef {
        let n = verbs.len();
        let free = {
            let pool = self.pool.borrow();
            let len = pool.len();
            let from = self.next.get();
            (0..len)
                .map(|k| {
                    let j = from + k;
                    if j >= len { j - len } else { j }
                })
                .find(|&j| Rc::strong_count(&pool[j]) == 1)
                .map(|j| {
                    self.next.set(if j + 1 == len { 0 } else { j + 1 });
                    pool[j].clone()
                })
        };
        match free {
            Some(state) => {
                // Reset in place (a fresh state written over it is a copy
                // of the whole inline arrays).
                {
                    let mut guard = state.borrow_mut();
                    let st = &mut *guard;
                    st.verbs.clear();
                    // (Moving the caller's list in with `mem::take` was
                    // measured dearer than the swap: a `memcpy` call and
                    // the old list's drop, +150 instructions per RACE GET;
                    // branch i70.)
                    std::mem::swap(&mut st.verbs, verbs);
                    // The slots the last batch left, reset in place (they
                    // are empty unless it ended early), then as many more
                    // or fewer as this batch has verbs: the same list as
                    // `clear` and `extend` with fresh slots, without
                    // writing them anew (branch i70).
                    for slot in st.slots.iter_mut().take(n) {
                        slot.result = None;
                        slot.read = None;
                    }
                    if st.slots.len() > n {
                        st.slots.truncate(n);
                    }
                    while st.slots.len() < n {
                        st.slots.push(VerbSlot::default());
                    }
                    st.left = n;
                    st.done_at = 0;
                    st.outcome = None;
                    st.waker = None;
                }
                state
            }
            None => {
                let state = Rc::new(RefCell::new(BatchState {
                    verbs: std::mem::take(verbs),
                    slots: (0..n).map(|_| VerbSlot::default()).collect(),
                    left: n,
                    done_at: 0,
                    outcome: None,
                    waker: None,
                    node: self.node,
                    lane: self.lane,
                    qp: self.id,
                    cluster: self.cluster.clone(),
                }));
                let mut pool = self.pool.borrow_mut();
                if pool.len() < POOLED_BATCHES {
                    pool.push(state.clone());
                }
                state
            }
        }
    }
}

impl SimEndpoint {
    /// Whether `id` names a node ([`Cluster::has_node`]), without the
    /// cluster's lock while `id` is below the node count last seen: nodes
    /// are only ever added, never removed.
    fn has_node(&self, id: NodeId) -> Result<()> {
        if (id.0 as usize) < self.known_nodes.get() {
            return Ok(());
        }
        self.known_nodes.set(self.cluster.nodes.read().len());
        self.cluster.has_node(id)
    }

    /// Charges this thread's core `ns` of CPU; returns when it is done.
    fn charge(&self, sim: &Sim, ns: u64) -> u64 {
        let now = sim.sched.now();
        let ready = match self.own_cpu.take() {
            Some((at, end)) if at == now => end,
            _ => now,
        };
        self.core.borrow_mut().occupy(ready, ns, 0)
    }

    /// [`SimEndpoint::charge`] for CPU the running task goes on from at
    /// once, without a sleep: its next charge now follows this one.
    fn charge_and_go_on(&self, sim: &Sim, ns: u64) -> u64 {
        let end = self.charge(sim, ns);
        self.own_cpu.set(Some((sim.sched.now(), end)));
        end
    }
}

/// Finds the memory behind `addr` after checking node, region and key.
fn resolve(cluster: &Cluster, addr: &RemoteAddr) -> Result<Arc<RegionMem>> {
    let nodes = cluster.nodes.read();
    let node = nodes
        .get(addr.node.0 as usize)
        .ok_or(TransportError::UnknownNode(addr.node))?;
    if node.crashed.load(Ordering::Acquire) {
        return Err(TransportError::NodeDown(addr.node));
    }
    let regions = node.regions.read();
    match regions.get(addr.region.0 as usize) {
        Some(Some(e)) if e.key == addr.key => Ok(e.mem.clone()),
        Some(Some(_)) => Err(TransportError::AccessDenied {
            node: addr.node,
            region: addr.region,
        }),
        _ => Err(TransportError::NoSuchRegion {
            node: addr.node,
            region: addr.region,
        }),
    }
}

/// What [`resolve`] found for the simulation's verbs, kept while the
/// cluster's generation stays the same (branch i54: every verb took the
/// cluster's and its node's read locks and looked the region up). Holds
/// only successful lookups; anything else (an unknown node or region, a
/// wrong key, a crashed node) goes to `resolve` every time, so a verb gets
/// exactly what `resolve` would give it.
#[derive(Default)]
pub(crate) struct RegionCache {
    generation: u64,
    /// Per node, per region: its key and memory.
    nodes: Vec<Vec<Option<CachedRegion>>>,
}

/// A region [`RegionCache`] found: its key and memory.
type CachedRegion = (crate::addr::AccessKey, Arc<RegionMem>);

/// [`resolve`] through the simulation's [`RegionCache`] (for `cluster`, the
/// simulation's own; another cluster is looked up directly).
fn resolve_cached(sim: &Sim, cluster: &Arc<Cluster>, addr: &RemoteAddr) -> Result<Arc<RegionMem>> {
    if !Arc::ptr_eq(cluster, &sim.cluster) {
        return resolve(cluster, addr);
    }
    let generation = cluster.generation.load(Ordering::Acquire);
    let mut cache = sim.regions.borrow_mut();
    if cache.generation != generation {
        cache.nodes.clear();
        cache.generation = generation;
    }
    let (node, region) = (addr.node.0 as usize, addr.region.0 as usize);
    if let Some(Some((key, mem))) = cache.nodes.get(node).and_then(|n| n.get(region))
        && *key == addr.key
    {
        return Ok(mem.clone());
    }
    let found = resolve(cluster, addr);
    if let Ok(mem) = &found {
        if cache.nodes.len() <= node {
            cache.nodes.resize_with(node + 1, Vec::new);
        }
        let regions = &mut cache.nodes[node];
        if regions.len() <= region {
            regions.resize_with(region + 1, || None);
        }
        regions[region] = Some((addr.key, mem.clone()));
    }
    found
}

/// Word-aligned pieces of `[offset, offset + len)`: at most `MAX_PIECES`,
/// each a whole number of cache lines except at the ends.
fn pieces(offset: u64, len: usize) -> Vec<(usize, usize)> {
    pieces_iter(offset, len).collect()
}

/// [`pieces`] without a vector (a read that cannot tear only needs their
/// PCIe time).
fn pieces_iter(offset: u64, len: usize) -> impl Iterator<Item = (usize, usize)> {
    let per = if len <= PIECE_BYTES {
        len.max(1)
    } else {
        len.div_ceil(PIECE_BYTES).div_ceil(MAX_PIECES) * PIECE_BYTES
    };
    let mut done = 0;
    let mut first = true;
    std::iter::from_fn(move || {
        if len <= PIECE_BYTES {
            // One piece, even when empty.
            return std::mem::take(&mut first).then_some((0, len));
        }
        if done >= len {
            return None;
        }
        // End each piece on a word boundary of the region.
        let pos = offset as usize + done;
        let n = (per - pos % 8).min(len - done);
        let piece = (done, n);
        done += n;
        Some(piece)
    })
}

/// Runs `f` at virtual time `at`: now, inline, if `at` has come (saves an
/// event per verb), else as an event.
fn at_or_now(sim: &Sim, at: u64, f: impl FnOnce() + 'static) {
    if at <= sim.sched.now() {
        f()
    } else {
        sim.sched.at(at, f)
    }
}

/// The network's most frequent events, carried in the scheduler's slab
/// instead of as boxed closures (see `sched::Event`). Each is 16 bytes:
/// the simulation is the scheduler's (`Sched::step` passes it), and a
/// verb's event names its batch's state and the verb's index there
/// (branch i50; they were up to ~100 bytes, copied several times per
/// event).
pub(crate) enum NetEvent {
    /// Verb `i` of a batch reaches its memory node (`arrive_verb`).
    Arrive { state: BatchRef, i: usize },
    /// Read `i` of a batch has its turn at the memory (`read_now`; its
    /// state is the verb's `PendingRead`).
    Read { state: BatchRef, i: usize },
    /// A batch's last response is through the client's NIC.
    BatchDone { state: BatchRef },
    /// An RPC's reply is through the caller's NIC (the reply waits in the
    /// completion, `Completion::stage`).
    Reply { done: Completion<Result<Reply>> },
}

impl NetEvent {
    pub(crate) fn run(self, sim: &Rc<Sim>) {
        match self {
            NetEvent::Arrive { state, i } => arrive_verb(sim, state, i),
            NetEvent::Read { state, i } => {
                let read = state.borrow_mut().slots[i]
                    .read
                    .take()
                    .expect("a deferred read's state");
                read_now(sim, state, i, read)
            }
            NetEvent::BatchDone { state } => finish_batch(&state),
            NetEvent::Reply { done } => done.deliver(),
        }
    }
}

/// Delivers a batch's results (or its first error) to the waiting task.
fn finish_batch(state: &RefCell<BatchState>) {
    let waker = {
        // Drained in place (the state is reused, see `batch_state`), into
        // the outcome in place (branch i54: the result list was built
        // aside and moved in).
        let mut guard = state.borrow_mut();
        let st = &mut *guard;
        let mut err = None;
        let out = match st.outcome.insert(Ok(VerbResults::new())) {
            Ok(out) => out,
            Err(_) => unreachable!("just set"),
        };
        for slot in st.slots.iter_mut() {
            match slot.result.take().expect("every verb answered") {
                Ok(v) => out.push(v),
                Err(e) => {
                    err.get_or_insert(e);
                }
            }
        }
        if let Some(e) = err {
            st.outcome = Some(Err(e));
        }
        st.waker.take()
    };
    if let Some(w) = waker {
        w.wake();
    }
}

/// Read `i` of a batch acts on memory now (its turn at the memory node has
/// come).
fn read_now(sim: &Rc<Sim>, state: BatchRef, i: usize, read: PendingRead) {
    let (addr, len) = match &state.borrow().verbs[i] {
        Verb::Read { addr, len } => (*addr, *len),
        _ => unreachable!("verb {i} of the batch is a read"),
    };
    let dst = addr.node;
    let whole = sim.net.borrow().nodes[dst.0 as usize].writes_landing == 0;
    if whole {
        // No write is landing on this node: nothing can tear this read, so
        // it is copied in one event and answered when its last piece would
        // have been fetched.
        // A spare read buffer of this thread if it has one (the batch's
        // caller gives its read buffers back, `buffers::pooled`).
        // `read_to_vec`: the words stored straight into the buffer, with
        // the checks, loads and (unmetered) touch of `RegionMem::read`,
        // without zero-filling it first (branch i70).
        let mut buf = crate::buffers::take();
        let r = read
            .mem
            .read_to_vec(addr.offset, len, &mut buf)
            .map(|_| VerbResult::Read(buf))
            .map_err(|e| e.at(&addr));
        let at = (sim.sched.now() + read.span).max(read.rx_done);
        respond(sim, &state, i, dst, at, read.back_bytes, r);
    } else {
        let parts = pieces(addr.offset, len);
        read_in_pieces(
            sim,
            state,
            i,
            read.mem,
            addr,
            parts,
            read.rx_done,
            read.back_bytes,
        );
    }
}

/// What a verb does at the memory, copied out of its batch's state.
#[derive(Clone, Copy)]
enum VerbKind {
    Read(usize),
    Write(usize),
    Cas(u64, u64),
    Faa(u64),
}

/// Executes verb `i` of a batch at the memory node, now (it just arrived).
fn arrive_verb(sim: &Rc<Sim>, state: BatchRef, i: usize) {
    let (addr, kind, out_bytes, back_bytes, src, lane, qp) = {
        let st = state.borrow();
        let verb = &st.verbs[i];
        let (out_bytes, back_bytes) = verb_bytes(verb);
        let (addr, kind) = match verb {
            Verb::Read { addr, len } => (*addr, VerbKind::Read(*len)),
            Verb::Write { addr, data } => (*addr, VerbKind::Write(data.len())),
            Verb::Cas {
                addr,
                expected,
                new,
            } => (*addr, VerbKind::Cas(*expected, *new)),
            Verb::Faa { addr, add } => (*addr, VerbKind::Faa(*add)),
        };
        (addr, kind, out_bytes, back_bytes, st.node, st.lane, st.qp)
    };
    let dst = addr.node;
    let mut rx_done = receive_message(sim, dst, out_bytes, lane);
    let now = sim.sched.now();
    let resolved = resolve_cached(sim, &state.borrow().cluster, &addr);
    let mem = match resolved {
        Ok(m) => m,
        Err(e) => return respond(sim, &state, i, dst, rx_done, 0, Err(e)),
    };
    // The queue pair's context must be in the NIC's cache before the verb
    // is served; a miss holds the receiving direction while it is fetched.
    let net_profile = &sim.profile.network;
    let mut context_ready = now;
    if net_profile.qp_cache_entries > 0 {
        let mut net = sim.net.borrow_mut();
        let nic = net.nodes[dst.0 as usize].nic(lane);
        if !nic
            .qp_cache
            .access(qp, net_profile.qp_cache_entries as usize)
        {
            rx_done = nic.rx.stall(now, rx_done, net_profile.qp_miss_ns);
            context_ready = rx_done;
        }
    }
    // Start after the previous verb of this queue pair (and, for atomics,
    // after the atomics unit frees the address), and once the NIC has it.
    let mut guard = sim.net.borrow_mut();
    let net = &mut *guard;
    let qp_free = net.qp_busy_until.get_mut(src, dst);
    let mut start = now.max(*qp_free).max(context_ready);
    // Until the verb's last piece is through: the sum of its pieces' times,
    // each rounded up, exactly as they are scheduled below (branch i47:
    // this was the whole length's time rounded once, up to a nanosecond per
    // piece less, so the queue pair's next verb could act before a write's
    // last piece landed and answer before a long read had answered).
    let duration = match kind {
        VerbKind::Read(len) => span_ns(sim, addr.offset, len, false),
        VerbKind::Write(len) => span_ns(sim, addr.offset, len, true),
        VerbKind::Cas(..) | VerbKind::Faa(..) => net_profile.atomic_ns,
    };
    if let VerbKind::Cas(..) | VerbKind::Faa(..) = kind {
        let key = (dst.0, addr.region.0, addr.offset);
        start = net
            .atomic_free
            .start(now, key, start, net_profile.atomic_ns);
    }
    // Invariant 1: the pair's next verb acts once this one is over, which
    // is when its response leaves (`respond` below is called for exactly
    // this instant), so a queue pair's responses also leave in order.
    *qp_free = (start + duration).max(rx_done);
    drop(guard);
    // A read or write outside the region is refused before any piece moves
    // (atomics are checked by the region when they run).
    let span = match kind {
        VerbKind::Read(len) | VerbKind::Write(len) => Some(len),
        VerbKind::Cas(..) | VerbKind::Faa(..) => None,
    };
    if let Some(Err(e)) = span.map(|n| mem.check(addr.offset, n as u64)) {
        return respond(sim, &state, i, dst, rx_done, 0, Err(e.at(&addr)));
    }
    match kind {
        VerbKind::Read(_) => {
            let read = PendingRead {
                mem,
                rx_done,
                back_bytes,
                span: duration,
            };
            if start <= sim.sched.now() {
                read_now(sim, state, i, read)
            } else {
                state.borrow_mut().slots[i].read = Some(read);
                sim.sched.net_at(start, NetEvent::Read { state, i })
            }
        }
        VerbKind::Write(len) => {
            // The data stays in the batch's state (the verb), read by each
            // piece when it lands.
            let parts = pieces(addr.offset, len);
            let last = parts.len() - 1;
            let mut t = start;
            for (k, (from, n)) in parts.into_iter().enumerate() {
                let piece_at = t;
                t += link_ns(sim, n);
                let (mem, sim2, st2) = (mem.clone(), sim.clone(), state.clone());
                at_or_now(sim, piece_at, move || {
                    // While a write of several pieces lands, reads on this
                    // node go piece by piece so that it can tear them.
                    if last > 0 && k == 0 {
                        sim2.net.borrow_mut().nodes[dst.0 as usize].writes_landing += 1;
                    }
                    let w = match &st2.borrow().verbs[i] {
                        Verb::Write { data, .. } => {
                            mem.write(addr.offset + from as u64, &data[from..from + n])
                        }
                        _ => unreachable!("verb {i} of the batch is a write"),
                    };
                    if k == last {
                        if last > 0 {
                            sim2.net.borrow_mut().nodes[dst.0 as usize].writes_landing -= 1;
                        }
                        let r = w.map(|_| VerbResult::Write).map_err(|e| e.at(&addr));
                        let at = (sim2.sched.now() + link_ns(&sim2, n)).max(rx_done);
                        respond(&sim2, &st2, i, dst, at, back_bytes, r);
                    }
                });
            }
        }
        VerbKind::Cas(expected, new) => {
            let (sim2, st2) = (sim.clone(), state.clone());
            at_or_now(sim, start, move || {
                let r = mem
                    .cas_u64(addr.offset, expected, new)
                    .map(VerbResult::Cas)
                    .map_err(|e| e.at(&addr));
                let at = (sim2.sched.now() + sim2.profile.network.atomic_ns).max(rx_done);
                respond(&sim2, &st2, i, dst, at, back_bytes, r);
            });
        }
        VerbKind::Faa(add) => {
            let (sim2, st2) = (sim.clone(), state.clone());
            at_or_now(sim, start, move || {
                let r = mem
                    .faa_u64(addr.offset, add)
                    .map(VerbResult::Faa)
                    .map_err(|e| e.at(&addr));
                let at = (sim2.sched.now() + sim2.profile.network.atomic_ns).max(rx_done);
                respond(&sim2, &st2, i, dst, at, back_bytes, r);
            });
        }
    }
}

/// A read while a write lands on its node: each piece is fetched at its
/// own instant (from now, at PCIe speed), so a write landing between two
/// pieces tears the read where virtual time puts it.
#[allow(clippy::too_many_arguments)]
fn read_in_pieces(
    sim: &Rc<Sim>,
    state: BatchRef,
    i: usize,
    mem: Arc<RegionMem>,
    addr: RemoteAddr,
    parts: Vec<(usize, usize)>,
    rx_done: u64,
    back_bytes: u64,
) {
    let dst = addr.node;
    let len: usize = parts.iter().map(|&(_, n)| n).sum();
    let buf = Rc::new(RefCell::new(vec![0u8; len]));
    let last = parts.len() - 1;
    let mut t = sim.sched.now();
    for (k, (from, n)) in parts.into_iter().enumerate() {
        let piece_at = t;
        t += pcie_ns_of(sim, n);
        let (buf, mem, sim2, st2) = (buf.clone(), mem.clone(), sim.clone(), state.clone());
        at_or_now(sim, piece_at, move || {
            let read = mem.read(
                addr.offset + from as u64,
                &mut buf.borrow_mut()[from..from + n],
            );
            if k == last {
                let r = read
                    .map(|_| VerbResult::Read(std::mem::take(&mut *buf.borrow_mut())))
                    .map_err(|e| e.at(&addr));
                let at = (sim2.sched.now() + pcie_ns_of(&sim2, n)).max(rx_done);
                respond(&sim2, &st2, i, dst, at, back_bytes, r);
            }
        });
    }
}

/// A write's data streams in from the wire: its pieces land at the link's
/// rate, slower than a read is fetched over PCIe, so a read that starts
/// after a write can overtake it (a torn read).
fn link_ns(sim: &Sim, n: usize) -> u64 {
    memo(&sim.costs.link, n as u64, || {
        ceil_u64((n as u64 * 8) as f64 / sim.profile.network.link_gbps)
    })
}

/// `x.ceil() as u64`, without a call into libm (the default x86-64 target
/// has no rounding instruction): `x as u64` truncates, which for x >= 0 is
/// the floor, and one is added when x was not whole. NaN gives 0 and
/// infinity `u64::MAX`, as the cast of `ceil` does.
fn ceil_u64(x: f64) -> u64 {
    let t = x as u64;
    if (t as f64) < x {
        t.saturating_add(1)
    } else {
        t
    }
}

fn pcie_ns_of(sim: &Sim, n: usize) -> u64 {
    memo(&sim.costs.pcie, n as u64, || sim.profile.pcie_ns(n as u64))
}

/// The time a read (`write` false: its pieces' PCIe times) or a write
/// (`write` true: its pieces' link times) of `len` bytes at `offset`
/// takes at the memory: the sum of its pieces' times, each rounded up, as
/// the pieces are scheduled. A verb of one piece is that piece's time; a
/// longer one's pieces depend only on `len` and `offset % 8` (every piece
/// but the last ends on a word boundary of the region, and `pieces_iter`'s
/// piece size is a multiple of 64), so the sum is kept per (`len`, `offset
/// % 8`, kind) in a small direct-mapped table (branch i50: a ROLEX leaf
/// read summed its pieces twice per verb). Exactly the sum
/// `pieces_iter` gives (`span_ns_is_the_sum_of_the_pieces` checks it).
fn span_ns(sim: &Sim, offset: u64, len: usize, write: bool) -> u64 {
    let piece = |n: usize| {
        if write {
            link_ns(sim, n)
        } else {
            pcie_ns_of(sim, n)
        }
    };
    if len <= PIECE_BYTES {
        // One piece, even when empty.
        return piece(len);
    }
    let key = ((len as u64) << 4) | ((offset % 8) << 1) | write as u64;
    let cell = &sim.costs.spans[(key as usize ^ (len >> 6)) & (SPAN_MEMO - 1)];
    let (k, v) = cell.get();
    if k == key {
        return v;
    }
    let v = pieces_iter(offset, len).map(|(_, n)| piece(n)).sum();
    cell.set((key, v));
    v
}

/// Sends verb `i`'s response from `dst` at `at`; the batch completes when
/// the last response is through the client's NIC.
#[allow(clippy::too_many_arguments)]
fn respond(
    sim: &Rc<Sim>,
    state: &BatchRef,
    i: usize,
    dst: NodeId,
    at: u64,
    back_bytes: u64,
    result: Result<VerbResult>,
) {
    let back_bytes = if result.is_ok() { back_bytes } else { 0 };
    let (node, lane) = {
        let mut st = state.borrow_mut();
        st.slots[i].result = Some(result);
        (st.node, st.lane)
    };
    // The client's NIC takes the response when it arrives; it is reserved
    // now, ahead of that instant, which saves an event per verb: its
    // calendar serves it in virtual-time order all the same (invariant 2).
    let done = send_and_receive(sim, dst, node, at, back_bytes, lane);
    let finished = {
        let mut st = state.borrow_mut();
        st.left -= 1;
        st.done_at = st.done_at.max(done);
        (st.left == 0).then_some(st.done_at)
    };
    if let Some(t) = finished {
        sim.sched.net_at(
            t,
            NetEvent::BatchDone {
                state: state.clone(),
            },
        );
    }
}

/// A one-sided write that its poster does not wait for (see
/// [`super::write_posted`]): the bytes are placed now; the sender's NIC,
/// the wire and the receiver's NIC are reserved for it as for a verb of
/// lane 0, and the instant its completion would be back is returned.
pub(crate) fn write_posted(
    sim: &Rc<Sim>,
    from: NodeId,
    addr: &RemoteAddr,
    data: &[u8],
) -> Result<u64> {
    let mem = resolve(&sim.cluster, addr)?;
    // Not the poster's memory: no cache lines are charged to its core.
    with_metering(0, || mem.write(addr.offset, data)).map_err(|e| e.at(addr))?;
    let len = data.len() as u64;
    let landed = send_and_receive(sim, from, addr.node, sim.sched.now(), len, 0);
    Ok(send_and_receive(sim, addr.node, from, landed, 0, 0))
}

/// What event closures need of an endpoint (it cannot be borrowed by them).
pub(crate) struct EpShared {
    cluster: Arc<Cluster>,
    node: NodeId,
    /// The issuing endpoint's id, unique in the simulation (its queue pair
    /// to each node).
    id: u64,
    /// Its index among its node's endpoints: which NIC its queue pairs use
    /// at both ends (`NodeModel::nic`).
    lane: u32,
    /// Batch states for reuse (`batch_state`): free once nothing else
    /// holds them.
    pool: RefCell<Vec<BatchRef>>,
    /// Where `batch_state` looks first.
    next: Cell<usize>,
}

impl EndpointBackend for SimEndpoint {
    fn local_node(&self) -> NodeId {
        self.node
    }

    fn execute(&self, verbs: &mut Verbs) -> OpFuture<'_, Result<VerbResults>> {
        let sim = match sim_or_err() {
            Ok(s) => s,
            Err(e) => {
                verbs.clear();
                return OpFuture::ready(Err(e));
            }
        };
        let ep = &self.shared;
        // The verbs move into the batch's state; their events name them by
        // index.
        let state = ep.batch_state(verbs);
        let n = state.borrow().verbs.len();
        // Posting costs the core; then the verbs leave back to back.
        let posted = self.charge(&sim, sim.profile.client.cpu_per_verb_ns * n as u64);
        for i in 0..n {
            let (out_bytes, dst) = {
                let st = state.borrow();
                let verb = &st.verbs[i];
                (verb_bytes(verb).0, verb.node())
            };
            if let Err(e) = self.has_node(dst) {
                state.borrow_mut().slots[i].result = Some(Err(e));
                let st = state.clone();
                sim.sched.at(posted, move || {
                    let err = {
                        let mut s = st.borrow_mut();
                        s.left -= 1;
                        (s.left == 0).then(|| {
                            s.slots
                                .iter_mut()
                                .find_map(|r| r.result.take().and_then(|r| r.err()))
                                .expect("an error was recorded")
                        })
                    };
                    if let Some(e) = err {
                        BatchState::complete(&st, Err(e));
                    }
                });
                continue;
            }
            let arrive = send_message(&sim, self.node, dst, posted, out_bytes, ep.lane);
            sim.sched.net_at(
                arrive,
                NetEvent::Arrive {
                    state: state.clone(),
                    i,
                },
            );
        }
        OpFuture::Shared(state)
    }

    fn call(
        &self,
        node: NodeId,
        service: ServiceId,
        payload: Vec<u8>,
    ) -> OpFuture<'_, Result<Reply>> {
        let sim = match sim_or_err() {
            Ok(s) => s,
            Err(e) => return OpFuture::ready(Err(e)),
        };
        let target = match self.cluster.node(node) {
            Ok(n) => n,
            Err(e) => return OpFuture::ready(Err(e)),
        };
        if target.crashed.load(Ordering::Acquire) {
            return OpFuture::ready(Err(TransportError::NodeDown(node)));
        }
        if target.handler_threads == 0 {
            return OpFuture::ready(Err(TransportError::Backend(format!(
                "node {node} has no handler threads and serves no RPCs"
            ))));
        }
        let completion: Completion<Result<Reply>> = Completion::new();
        let two_posts = mailbox(&sim, node, service);
        let posted = if two_posts {
            // The flag's post follows at once (below).
            self.charge_and_go_on(&sim, sim.profile.client.cpu_per_verb_ns)
        } else {
            self.charge(&sim, sim.profile.client.cpu_per_verb_ns)
        };
        let lane = self.shared.lane;
        let len = payload.len() as u64;
        // A mailbox service's request is two posted WRITEs, as ScaleStore's
        // artifact's workers post them (`Worker::writeMsg`: `postWrite` of
        // the message, then `postWrite` of the one-byte flag, two
        // `ibv_post_send`s): the payload, its NICs reserved now (the
        // receiving one ahead of its arrival), then the flag, posted when
        // the core has posted the payload (a second verb's posting cost).
        // The handler sees the request when the flag is through its NIC.
        // Any other service: one message.
        let (arrive, payload_in) = if two_posts {
            let landed = send_and_receive(&sim, self.node, node, posted, len, lane);
            let flag_posted = self.charge(&sim, sim.profile.client.cpu_per_verb_ns);
            let flag = send_message(&sim, self.node, node, flag_posted, MAILBOX_FLAG_BYTES, lane);
            (flag, Some(landed))
        } else {
            (send_message(&sim, self.node, node, posted, len, lane), None)
        };
        let from = self.node;
        let done = completion.handle();
        let s2 = sim.clone();
        sim.sched.at(arrive, move || {
            let ready = match payload_in {
                None => receive_message(&s2, node, len, lane),
                Some(landed) => receive_message(&s2, node, MAILBOX_FLAG_BYTES, lane).max(landed),
            };
            let coreset = s2.net.borrow().nodes[node.0 as usize]
                .handlers
                .expect("a node with handler threads has handler cores");
            let s3 = s2.clone();
            submit_job(
                &s2,
                coreset,
                ready,
                Box::new(move || serve_rpc(&s3, target, from, lane, service, payload, done)),
            );
        });
        OpFuture::Shared(completion.0)
    }

    fn begin_op(&self) -> OpFuture<'_, ()> {
        let Some(sim) = current() else {
            return OpFuture::ready(());
        };
        // The core is reserved for the operation's CPU now, and the task
        // goes on at once (branch i57): its first verb or RPC is charged
        // on the same core behind this reservation (`charge`), so it is
        // posted when this CPU is done, as when the task slept until then,
        // without the wake event in between (one event of the 7.35 of a
        // RACE GET). The engine's code before that first post runs at the
        // operation's start instead of at the end of its CPU, and the
        // task's post is charged before the next task's operation instead
        // of after it (a real thread runs a task until it yields, so this
        // is the more faithful order). docs/simulation.md, "Ninth pass
        // (branch i57)".
        let c = &sim.profile.client;
        // A spread draws only when set: without one, schedules are as
        // before (the seed's sequence of draws is unchanged).
        let ns = match c.cpu_per_op_spread_ns {
            0 => c.cpu_per_op_ns,
            s => c.cpu_per_op_ns - s + sim.sched.random(2 * s + 1),
        };
        self.charge_and_go_on(&sim, ns);
        OpFuture::ready(())
    }

    fn charge_instructions(&self, instructions: u64) -> OpFuture<'_, ()> {
        let Some(sim) = current() else {
            return OpFuture::ready(());
        };
        // The instruction term of memory-node work (`crate::sim::work`),
        // floor-rounded as there; no term, no charge.
        let rate = sim.profile.memnode.instructions_per_us();
        let ns = instructions
            .saturating_mul(1000)
            .checked_div(rate)
            .unwrap_or(0);
        if ns == 0 {
            return OpFuture::ready(());
        }
        let done = self.charge(&sim, ns);
        OpFuture::SimSleep(super::sleep_until_ns(done), Some(()))
    }

    fn charge_local_lines(&self, lines: u64) -> OpFuture<'_, ()> {
        let Some(sim) = current() else {
            return OpFuture::ready(());
        };
        if lines == 0 {
            return OpFuture::ready(());
        }
        // The memory-node handlers' per-line price (the profiles describe
        // one CPU generation per testbed); lines of registered memory at
        // what their node's cache model priced them (`sim::touch`, branch
        // i88), the rest flat (docs/simulation.md).
        let ns = super::local_lines_ns(lines, sim.profile.memnode.line_ns);
        let done = self.charge(&sim, ns);
        OpFuture::SimSleep(super::sleep_until_ns(done), Some(()))
    }
}

/// Whether requests to `service` on `node` are written into mailboxes
/// (payload, then flag: [`super::set_mailbox_requests`]).
#[inline]
fn mailbox(sim: &Sim, node: NodeId, service: ServiceId) -> bool {
    sim.net
        .borrow()
        .nodes
        .get(node.0 as usize)
        .is_some_and(|n| n.mailbox_services.contains(&service))
}

/// Where a reply goes once the handler produced it.
struct ReplyRoute {
    from: NodeId,
    to: NodeId,
    /// The caller's lane: the NICs the reply goes through.
    lane: u32,
    /// When the handler's service time ends (None while it runs).
    handler_end: Option<u64>,
    /// A reply given while the handler still ran.
    early: Option<Reply>,
    done: Completion<Result<Reply>>,
}

thread_local! {
    /// Replies on their way, by call id (the reply closure must be `Send`,
    /// so it carries an id rather than the route).
    static ROUTES: RefCell<HashMap<u64, ReplyRoute>> = RefCell::new(HashMap::new());
    static NEXT_CALL: Cell<u64> = const { Cell::new(0) };
}

/// Runs an RPC's handler on a core now; returns its service time.
fn serve_rpc(
    sim: &Rc<Sim>,
    target: Arc<NodeState>,
    from: NodeId,
    lane: u32,
    service: ServiceId,
    payload: Vec<u8>,
    done: Completion<Result<Reply>>,
) -> u64 {
    let node = target.id;
    if target.crashed.load(Ordering::Acquire) {
        // The node died while the request queued: the caller learns when the
        // error would come back.
        let now = sim.sched.now();
        let arrive = send_message(sim, node, from, now, 0, lane);
        sim.sched.at(arrive, move || {
            done.complete(Err(TransportError::NodeDown(node)))
        });
        return 0;
    }
    let id = NEXT_CALL.with(|c| {
        let id = c.get();
        c.set(id + 1);
        id
    });
    ROUTES.with(|r| {
        r.borrow_mut().insert(
            id,
            ReplyRoute {
                from: node,
                to: from,
                lane,
                handler_end: None,
                early: None,
                done,
            },
        )
    });
    let ctx = RpcContext { caller: from, node };
    let ((), cpu) = on_core(sim, || {
        target
            .services
            .dispatch(&ctx, service, &payload, move |reply| {
                reply_ready(id, reply);
            })
    });
    let cost = cpu + sim.profile.memnode.rpc_base_ns;
    let end = sim.sched.now() + cost;
    let early = ROUTES.with(|r| {
        let mut r = r.borrow_mut();
        let route = r.get_mut(&id).expect("route of a running call");
        route.handler_end = Some(end);
        route.early.take()
    });
    if let Some(reply) = early {
        send_reply(sim, id, reply, end);
    }
    cost
}

/// A handler (now or later) produced the reply of call `id`.
fn reply_ready(id: u64, reply: Reply) {
    let Some(sim) = current() else {
        if super::tearing_down() {
            // The simulation is ending and drops a handler's state that
            // still held this call's responder (e.g. a ScaleStore request
            // parked on a page when the run ended): every caller's future
            // is dropped with it, so the reply has nobody to reach.
            return;
        }
        // A deferred reply from a thread outside the simulation: nothing can
        // carry it (engines must not run their own threads under sim).
        panic!("a sim RPC was answered from outside the simulation's thread");
    };
    let end = ROUTES.with(|r| {
        let mut r = r.borrow_mut();
        let route = r.get_mut(&id)?;
        match route.handler_end {
            None => {
                route.early = Some(reply.clone());
                None
            }
            Some(end) => Some(end),
        }
    });
    if let Some(end) = end {
        let at = end.max(sim.sched.now());
        send_reply(&sim, id, reply, at);
    }
}

fn send_reply(sim: &Rc<Sim>, id: u64, reply: Reply, at: u64) {
    let Some(route) = ROUTES.with(|r| r.borrow_mut().remove(&id)) else {
        return;
    };
    let bytes = reply.result.as_ref().map_or(0, |p| p.len() as u64);
    let done = route.done;
    let t = send_and_receive(sim, route.from, route.to, at, bytes, route.lane);
    done.stage(Ok(reply));
    sim.sched.net_at(t, NetEvent::Reply { done });
}

#[cfg(test)]
mod tests {
    use super::{ceil_u64, submit_job};
    use crate::sim::{Profile, SimConfig, Simulation, current, sleep_until_ns};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};
    use std::cell::RefCell;
    use std::rc::Rc;

    /// One job of [`run_core_set`]: submitted at `submit`, ready `delay`
    /// later, running `cost` ns.
    #[derive(Clone, Copy, Debug)]
    struct TestJob {
        submit: u64,
        delay: u64,
        cost: u64,
    }

    /// Runs `jobs` through a fresh core set of `cores` cores; returns each
    /// job's start instant, the order the jobs were submitted in (events
    /// at one instant run in the seed's order), the set's busy time, job
    /// count and queueing time, and the events the run took.
    fn run_core_set(
        cores: usize,
        jobs: &[TestJob],
        seed: u64,
    ) -> (Vec<u64>, Vec<usize>, (u64, u64, u64), u64) {
        let simulation = Simulation::new(SimConfig {
            profile: Profile::default_profile(),
            seed,
            jitter_ns: 0,
            delays: Default::default(),
        });
        let sim = current().expect("in a simulation");
        let id = sim.net.borrow_mut().add_coreset("test".into(), cores);
        let starts = Rc::new(RefCell::new(vec![u64::MAX; jobs.len()]));
        let order = Rc::new(RefCell::new(Vec::new()));
        let events0 = simulation.events();
        for (i, &j) in jobs.iter().enumerate() {
            let (s, starts, order) = (sim.clone(), starts.clone(), order.clone());
            sim.sched.at(j.submit, move || {
                order.borrow_mut().push(i);
                let s2 = s.clone();
                submit_job(
                    &s,
                    id,
                    j.submit + j.delay,
                    Box::new(move || {
                        let mut st = starts.borrow_mut();
                        assert_eq!(st[i], u64::MAX, "job {i} ran twice");
                        st[i] = s2.sched.now();
                        j.cost
                    }),
                );
            });
        }
        let end = jobs.iter().map(|j| j.submit + j.delay).max().unwrap_or(0)
            + jobs.iter().map(|j| j.cost).sum::<u64>()
            + 1;
        crate::exec::block_on(sleep_until_ns(end));
        let events = simulation.events() - events0;
        let figures = {
            let net = sim.net.borrow();
            let cs = &net.coresets[id];
            (cs.busy_ns, cs.jobs, cs.wait_ns)
        };
        let starts = starts.borrow().clone();
        let order = order.borrow().clone();
        drop(sim);
        drop(simulation);
        (starts, order, figures, events)
    }

    /// The reference: `cores` cores serve the jobs in (ready instant,
    /// submission order) order, each on the core that frees first, never
    /// before the job is ready. (Serving in ready order makes starts
    /// monotone in that order, so this list schedule is the simulation of
    /// cores that are never idle while a ready job waits.)
    fn reference(cores: usize, jobs: &[TestJob], order: &[usize]) -> Vec<u64> {
        let mut seq = vec![0; jobs.len()];
        for (n, &i) in order.iter().enumerate() {
            seq[i] = n;
        }
        let mut by_ready: Vec<usize> = (0..jobs.len()).collect();
        by_ready.sort_by_key(|&i| (jobs[i].submit + jobs[i].delay, seq[i]));
        let mut free = vec![0u64; cores];
        let mut starts = vec![0; jobs.len()];
        for i in by_ready {
            let k = (0..cores).min_by_key(|&k| free[k]).expect("a core");
            let start = free[k].max(jobs[i].submit + jobs[i].delay);
            free[k] = start + jobs[i].cost;
            starts[i] = start;
        }
        starts
    }

    /// A client core (first come, first served) adds up how long work
    /// waited for it, apart from its busy time.
    #[test]
    fn a_server_counts_the_time_work_queued() {
        let mut s = super::Server::default();
        assert_eq!(s.occupy(100, 50, 0), 150);
        // Ready at 120, starts at 150: 30 ns queued.
        assert_eq!(s.occupy(120, 10, 0), 160);
        // Ready after the server is free: none.
        assert_eq!(s.occupy(200, 10, 0), 210);
        assert_eq!((s.busy_ns, s.wait_ns, s.count), (70, 30, 3));
    }

    /// The brief's example at the core set's level: a job submitted first
    /// but ready late must not keep the only core from a job submitted
    /// after it and ready before it. Before branch i41 the second job
    /// started at 1,010, when the first one's core was free again.
    #[test]
    fn a_core_is_not_reserved_for_a_job_that_is_not_ready() {
        let jobs = [
            TestJob {
                submit: 0,
                delay: 1_000,
                cost: 10,
            },
            TestJob {
                submit: 100,
                delay: 50,
                cost: 500,
            },
        ];
        let (starts, ..) = run_core_set(1, &jobs, 1);
        assert_eq!(starts, vec![1_000, 150]);
    }

    /// Random submissions (instants, ready delays and service times drawn
    /// from small ranges, so that ties, queues and idle cores all occur)
    /// give exactly the reference's start instants, busy time and job
    /// count, for 1 to 4 cores; and the core set schedules at most one
    /// wake event per job (plus its end event).
    #[test]
    fn core_set_serves_in_ready_order_like_a_reference() {
        let mut reordered = 0;
        for seed in 0..200u64 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let cores = 1 + (seed % 4) as usize;
            let n = rng.gen_range(1..60);
            let spread = [50, 500, 5_000][(seed / 4 % 3) as usize];
            let jobs: Vec<TestJob> = (0..n)
                .map(|_| TestJob {
                    submit: rng.gen_range(0..spread),
                    delay: if rng.gen_bool(0.3) {
                        0
                    } else {
                        rng.gen_range(0..spread / 2)
                    },
                    cost: rng.gen_range(1..spread / 5),
                })
                .collect();
            let (starts, order, (busy, count, wait), events) = run_core_set(cores, &jobs, seed);
            let want = reference(cores, &jobs, &order);
            assert_eq!(starts, want, "seed {seed}, {cores} cores: {jobs:?}");
            // The queueing time is each job's wait from ready to start.
            let waited: u64 = jobs
                .iter()
                .zip(&starts)
                .map(|(j, &s)| s - (j.submit + j.delay))
                .sum();
            assert_eq!(wait, waited, "seed {seed}");
            assert_eq!(
                busy,
                jobs.iter().map(|j| j.cost).sum::<u64>(),
                "seed {seed}"
            );
            assert_eq!(count, n as u64, "seed {seed}");
            // No busy wait: a submission and an end event per job, at most
            // two more per job (wakes, a start after an end), and the wait.
            assert!(
                events <= 4 * n as u64 + 1,
                "seed {seed}: {events} events for {n} jobs"
            );
            // The case that matters occurred: a job started before one
            // submitted before it.
            let started: Vec<u64> = order.iter().map(|&i| starts[i]).collect();
            reordered += started.windows(2).filter(|w| w[1] < w[0]).count();
        }
        assert!(
            reordered > 0,
            "no job ever overtook one submitted before it"
        );
    }

    /// `ceil_u64` agrees with `f64::ceil` (the oracle) on whole numbers,
    /// fractions on both sides of them, the link rates' quotients and the
    /// edge cases.
    /// Atomics on ever new addresses: the map keeps only the addresses
    /// reserved after `now` (fails without the sweep: one entry per address
    /// ever touched), and every start is what a map that never drops an
    /// entry gives.
    #[test]
    fn atomic_units_are_dropped_once_idle() {
        use super::{AtomicUnits, Calendar, FastMap};
        let mut swept = AtomicUnits::default();
        let mut kept: FastMap<(u16, u32, u64), Calendar> = FastMap::default();
        let mut most = 0;
        let mut now = 0u64;
        for k in 0..200_000u64 {
            now += k % 3;
            // A few hot addresses and a stream of new ones, some reserved
            // ahead of now.
            let addr = if k % 4 == 0 { k % 5 } else { k };
            let at = now + (k % 7) * 40;
            let key = (0, 1, addr * 8);
            let want = kept.entry(key).or_default().stall(now, at, 50) - 50;
            assert_eq!(swept.start(now, key, at, 50), want, "atomic {k}");
            most = most.max(swept.units.len());
        }
        assert!(kept.len() > 150_000);
        assert!(most <= 2 * super::ATOMIC_SWEEP_MIN, "{most} entries");
    }

    /// `span_ns` (memoized per length, offset mod 8 and kind) is exactly
    /// the sum of the pieces' times `pieces_iter` gives, for reads and
    /// writes, every offset within a word and lengths across the piece
    /// sizes, asked in an order that makes entries of the direct-mapped
    /// memo replace each other, and again from the memo.
    #[test]
    fn span_ns_is_the_sum_of_the_pieces() {
        use super::{link_ns, pcie_ns_of, pieces_iter, span_ns};
        let simulation = Simulation::new(SimConfig {
            profile: Profile::default_profile(),
            seed: 1,
            jitter_ns: 0,
            delays: Default::default(),
        });
        let sim = current().expect("in a simulation");
        let mut lens: Vec<usize> = (0..300).collect();
        lens.extend((300..20_000).step_by(37));
        lens.extend([511, 512, 513, 1024, 4096, 4097, 65_536, 1 << 20]);
        for round in 0..2 {
            for &len in &lens {
                for offset in [0u64, 1, 3, 7, 8, 13, 64, 4093] {
                    for write in [false, true] {
                        let want: u64 = pieces_iter(offset, len)
                            .map(|(_, n)| {
                                if write {
                                    link_ns(&sim, n)
                                } else {
                                    pcie_ns_of(&sim, n)
                                }
                            })
                            .sum();
                        assert_eq!(
                            span_ns(&sim, offset, len, write),
                            want,
                            "round {round}, len {len}, offset {offset}, write {write}"
                        );
                    }
                }
            }
        }
        drop(sim);
        drop(simulation);
    }

    /// `send_and_receive` is `send_message` then `receive_message_at` for
    /// its arrival: 2,000 jittered messages both ways on three lanes over
    /// two NICs, posted now and ahead, time moving between them, give the
    /// same instants, NIC busy time, counts and bytes, overtaken count, and
    /// leave the seeded generator in the same state (test from branch
    /// i61's attempt, 5c7ac3c).
    #[test]
    fn send_and_receive_is_send_then_receive() {
        use super::{receive_message_at, resources, send_and_receive, send_message};
        use crate::backend::NodeHost;
        type Run = (Vec<u64>, Vec<(u64, u64, u64)>, u64, u64);
        fn run(fused: bool) -> Run {
            let mut profile = Profile::default_profile();
            profile.network.nics = 2;
            let simulation = Simulation::new(SimConfig {
                profile,
                seed: 7,
                jitter_ns: 250,
                delays: Default::default(),
            });
            let (a, b) = (simulation.add_node(1).id(), simulation.add_node(1).id());
            let sim = current().expect("in a simulation");
            let mut rng = SmallRng::seed_from_u64(3);
            let mut out = Vec::new();
            for k in 0..2000 {
                if k % 40 == 39 {
                    let t = sim.sched.now() + rng.gen_range(0..3000);
                    crate::exec::block_on(sleep_until_ns(t));
                }
                let (from, to) = if rng.gen_bool(0.5) { (a, b) } else { (b, a) };
                let at = sim.sched.now() + rng.gen_range(0..2000);
                let payload = rng.gen_range(0..5000);
                let lane = rng.gen_range(0..3);
                out.push(if fused {
                    send_and_receive(&sim, from, to, at, payload, lane)
                } else {
                    let arrive = send_message(&sim, from, to, at, payload, lane);
                    receive_message_at(&sim, to, payload, arrive, lane)
                });
            }
            let nics = resources(&sim.net.borrow(), 0)
                .iter()
                .map(|r| (r.busy_ns, r.count, r.bytes))
                .collect();
            let overtaken = super::messages_overtaken(&sim.net.borrow());
            let next = sim.sched.random(1 << 40);
            drop(sim);
            drop(simulation);
            (out, nics, overtaken, next)
        }
        assert_eq!(run(false), run(true));
    }

    #[test]
    fn ceil_u64_matches_ceil() {
        let mut xs = vec![0.0, 0.5, 1.0, 1.0 - f64::EPSILON, 1.0 + 1e-12, 2.5e9, 1e300];
        xs.extend([
            f64::NAN,
            f64::INFINITY,
            (1u64 << 53) as f64,
            u64::MAX as f64,
        ]);
        for bytes in 0..5000u64 {
            for gbps in [25.0, 56.0, 100.0, 128.0, 200.0, 12.5, 3.3] {
                xs.push((bytes * 8) as f64 / gbps);
            }
        }
        for x in xs {
            assert_eq!(ceil_u64(x), x.ceil() as u64, "x = {x}");
        }
    }
}
