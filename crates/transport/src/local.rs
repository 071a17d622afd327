//! The `local` backend: every node in one process.
//!
//! One-sided verbs execute in the calling thread directly against the target
//! region's memory: true CPU bypass, as with an RDMA NIC. RPCs travel through
//! the calling endpoint's lane to the target node (`local_rpc`: a request
//! ring and reply slots, payloads inline) to its handler threads (one by
//! default, as the papers model weak memory nodes), and the reply wakes the
//! calling task.
//!
//! Test knobs ([`Faults`]), changeable at run time: injected latency per round
//! trip, torn reads (a read is copied in pieces, yielding to other tasks and
//! threads between pieces, so that concurrent writes land in the middle),
//! delayed and dropped messages, and node crashes ([`LocalCluster::crash`]).

use crate::addr::{AccessKey, NodeId, RegionId, RemoteAddr, RemoteRegion, ServiceId};
use crate::backend::{
    CallFuture, EndpointBackend, Fabric, NodeHost, OpFuture, PooledResults, Verb, VerbResult,
    VerbResults, Verbs,
};
use crate::cputime::BusyClock;
use crate::endpoint::Endpoint;
use crate::error::{Result, TransportError};
use crate::exec::{sleep, yield_now};
use crate::local_rpc::{Doorbell, Incoming, Lane, Reaper, ReplyWait, RequestHeader, RpcSlots};
use crate::region::{RegionEntry, RegionMem};
use crate::servestats::{self, Counter, Role};
use crate::service::{HandlerCache, Reply, RpcContext, ServiceTable};
use parking_lot::{Mutex, RwLock};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Faults and delays injected by the local backend.
#[derive(Debug, Clone, PartialEq)]
pub struct Faults {
    /// Added to every round trip (a verb, a batch or an RPC): half before the
    /// verbs execute, half after, so concurrent operations overlap.
    pub round_trip_latency: Duration,
    /// Copy every read of more than 8 bytes in random word-aligned pieces,
    /// yielding between pieces.
    pub torn_reads: bool,
    /// Every message waits this long before a handler serves it.
    pub rpc_delay: Duration,
    /// Probability that a request is lost; the caller then times out.
    pub rpc_drop_probability: f64,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            round_trip_latency: Duration::ZERO,
            torn_reads: false,
            rpc_delay: Duration::ZERO,
            rpc_drop_probability: 0.0,
        }
    }
}

/// Settings of a local cluster.
#[derive(Debug, Clone)]
pub struct LocalConfig {
    pub faults: Faults,
    /// How long a caller waits for an RPC reply before it fails.
    pub rpc_timeout: Duration,
    /// How long an idle handler thread keeps polling its queue (spinning
    /// briefly, then yielding its core between polls) before it blocks until
    /// a request wakes it (`dmkv bench --handler-poll-us`; zero: block as
    /// soon as the queue is empty). Polling keeps RPC latency free of OS
    /// wake-ups while requests keep coming; blocking keeps an idle node off
    /// the CPU.
    pub handler_poll: Duration,
    /// The same for a handler thread pinned to a CPU no other thread of
    /// this process is pinned to (`crate::placement::alone_on_own_cpu`),
    /// which polls without yielding (`dmkv bench --handler-poll-own-cpu-us`):
    /// it spins on a CPU the placement gave it alone, so polling longer
    /// costs no thread of ours, and a handler that blocked makes the
    /// compute thread's next request wake it, which on a CPU another
    /// process also runs on cost the compute thread its turn, a time slice
    /// per wake-up (docs/performance.md, "Thirty-seventh session").
    pub handler_poll_own_cpu: Duration,
    /// Where handler threads (and the bench's compute threads) run
    /// (`dmkv bench --pin-threads`); `None`: wherever the OS puts them. A
    /// new cluster puts its plan, or none, in force for the whole process
    /// ([`crate::placement::set_plan`]); threads pin when they start.
    pub placement: Option<crate::placement::Plan>,
}

/// [`LocalConfig::handler_poll`]'s default, chosen by measurement against
/// pure spinning and against blocking sooner (docs/performance.md,
/// "Seventh pass").
pub const DEFAULT_HANDLER_POLL: Duration = Duration::from_millis(1);

/// [`LocalConfig::handler_poll_own_cpu`]'s default: longer than a time
/// slice of the Linux scheduler (a few milliseconds), so a compute thread
/// that another process held off its CPU for one finds the handler still
/// polling.
pub const DEFAULT_HANDLER_POLL_OWN_CPU: Duration = Duration::from_millis(100);

impl Default for LocalConfig {
    fn default() -> Self {
        LocalConfig {
            faults: Faults::default(),
            rpc_timeout: Duration::from_secs(30),
            handler_poll: DEFAULT_HANDLER_POLL,
            handler_poll_own_cpu: DEFAULT_HANDLER_POLL_OWN_CPU,
            placement: None,
        }
    }
}

struct Inner {
    nodes: RwLock<Vec<Arc<NodeState>>>,
    faults: RwLock<Faults>,
    /// Whether `faults` injects anything, so that verbs on the fault-free
    /// path need not take the lock.
    faults_active: AtomicBool,
    rpc_timeout: Duration,
    handler_poll: Duration,
    handler_poll_own_cpu: Duration,
    /// Ticks every endpoint's RPC watchdog (see `local_rpc`).
    reaper: Arc<Reaper>,
}

impl Faults {
    /// Whether any fault or delay is injected.
    fn any(&self) -> bool {
        *self != Faults::default()
    }
}

impl Inner {
    /// The faults now in force; the common fault-free case takes no lock.
    fn faults(&self) -> Faults {
        if self.faults_active.load(Ordering::Acquire) {
            self.faults.read().clone()
        } else {
            Faults::default()
        }
    }

    fn node(&self, id: NodeId) -> Result<Arc<NodeState>> {
        self.nodes
            .read()
            .get(id.0 as usize)
            .cloned()
            .ok_or(TransportError::UnknownNode(id))
    }
}

/// Aligned so that the reference counts of its `Arc` (bumped by callers)
/// do not share a line with the fields its handler threads read.
#[repr(align(128))]
struct NodeState {
    id: NodeId,
    crashed: AtomicBool,
    /// Bumped whenever a region is withdrawn, so endpoint caches revalidate.
    region_generation: AtomicU64,
    regions: RwLock<Vec<Option<RegionEntry>>>,
    /// In lines of its own: its handler threads write its counters and
    /// lock words on every RPC, while callers read `crashed`,
    /// `handler_threads` and the doorbell's sleeper count on every RPC (on
    /// one line, those would move between the two cores each time).
    services: Padded<ServiceTable>,
    /// Every endpoint's lane to this node (see `local_rpc`), and a version
    /// bumped whenever the list changes, so handler threads refresh their
    /// copy only then.
    lanes: Mutex<Vec<Arc<Lane>>>,
    lanes_version: AtomicU64,
    /// Where idle handler threads block.
    bell: Doorbell,
    handler_threads: usize,
    handler_poll: Duration,
    handler_poll_own_cpu: Duration,
    handlers: Mutex<Vec<JoinHandle<()>>>,
}

impl NodeState {
    fn check_up(&self) -> Result<()> {
        if self.crashed.load(Ordering::Acquire) {
            Err(TransportError::NodeDown(self.id))
        } else {
            Ok(())
        }
    }

    /// Stops the handler threads and drops queued requests (their callers
    /// see the node as down).
    fn stop(&self) {
        self.crashed.store(true, Ordering::Release);
        self.bell.stop();
        let handlers: Vec<_> = self.handlers.lock().drain(..).collect();
        let me = std::thread::current().id();
        for h in handlers {
            if h.thread().id() != me {
                let _ = h.join();
            }
        }
        // Pairs with the fence in the caller's `Doorbell::ring` before it
        // reads `crashed`: either the caller sees the crash and drains its
        // lane itself, or this drain sees its request.
        std::sync::atomic::fence(Ordering::SeqCst);
        self.drain_lanes();
    }

    /// Answers every queued request with `NodeDown`.
    fn drain_lanes(&self) {
        let lanes = self.lanes.lock().clone();
        for lane in &lanes {
            lane.drain();
        }
    }

    /// Registers a new endpoint's lane with this node.
    fn add_lane(&self, lane: Arc<Lane>) {
        self.lanes.lock().push(lane);
        self.lanes_version.fetch_add(1, Ordering::AcqRel);
    }

    /// Forgets lanes whose endpoint is gone and that hold no request.
    fn forget_finished_lanes(&self) {
        let mut lanes = self.lanes.lock();
        let before = lanes.len();
        lanes.retain(|l| !l.finished());
        if lanes.len() != before {
            self.lanes_version.fetch_add(1, Ordering::AcqRel);
        }
    }

    /// A handler thread's loop: it takes requests from every lane of the
    /// node (one at a time, see `local_rpc` invariant 2) and, when none is
    /// left, waits in [`NodeState::wait_for_request`]. Its busy stretches
    /// (from the request that found it idle to the next time every lane is
    /// empty) go to its [`BusyClock`], which scales the RPC charges by the
    /// share of that time the thread was on a CPU. It counts requests,
    /// stretches and its waiting in [`servestats`] (evidence for the
    /// report, nothing decided by it) and runs on its planned CPU if a
    /// [`crate::placement`] plan is in force.
    fn serve(self: Arc<Self>, index: usize) {
        crate::placement::pin_handler(index);
        // Sharing its CPU with a compute thread, the handler's spins only
        // delay the thread that would send the next request: yield at once.
        let spins = if crate::placement::handler_shares_cpu(index) {
            0
        } else {
            HANDLER_SPINS
        };
        let mut clock = BusyClock::new(crate::cputime::BUSY_STRETCH_SAMPLE);
        let mut lanes: Vec<Arc<Lane>> = Vec::new();
        let mut version = u64::MAX;
        let mut buf = Vec::new();
        // The reply buffer every request's handler writes into (R1-R3,
        // docs/transport.md "Reply buffers").
        let mut out = Vec::with_capacity(crate::local_rpc::REPLY_INLINE);
        // This thread's copy of the handler table (`HandlerCache`, G1-G3).
        let mut handlers = HandlerCache::new();
        // The thread's `requests` counter, bumped once per request.
        let mut requests = servestats::Tally::for_this_thread(Role::Handler, Counter::Requests);
        loop {
            if self.bell.stopping() {
                return;
            }
            let v = self.lanes_version.load(Ordering::Acquire);
            if v != version {
                lanes = self.lanes.lock().clone();
                version = v;
            }
            // G3: a change of the table is picked up at this poll, so an
            // unregistered handler is not kept alive by an idle thread.
            self.services.refresh(&mut handlers);
            let mut served = 0u64;
            // Charging (docs/transport.md): a stretch's readings start at
            // the poll that found a request (no-op while one is open).
            crate::charge::begin_stretch();
            // Handler `index` starts at its own share of the lanes: the
            // lanes from `first` on, then those before it (one division per
            // pass, not one per lane).
            let first = if lanes.is_empty() {
                0
            } else {
                index % lanes.len()
            };
            let (before, from) = lanes.split_at(first);
            for lane in from.iter().chain(before) {
                while let Some(req) = lane.take(&mut buf) {
                    crate::charge::stamp(crate::charge::Stage::Taken);
                    served += 1;
                    requests.bump();
                    clock.busy();
                    self.handle(req, &buf, &mut out, &mut handlers);
                }
            }
            if served > 0 {
                continue;
            }
            crate::charge::end_stretch();
            clock.idle();
            if lanes.iter().any(|l| l.finished()) {
                self.forget_finished_lanes();
                continue;
            }
            self.wait_for_request(&lanes, version, spins, &mut handlers);
        }
    }

    /// Runs one request's handler (found in the thread's `handlers` copy)
    /// and sends its reply.
    fn handle(
        &self,
        req: Incoming<'_>,
        inline: &[u8],
        out: &mut Vec<u8>,
        handlers: &mut HandlerCache,
    ) {
        if self.crashed.load(Ordering::Acquire) {
            return; // `req.reply` answers `NodeDown`
        }
        if let Some(at) = req.deliver_at {
            let now = Instant::now();
            if at > now {
                std::thread::sleep(at - now);
            }
            // The injected delay is not the handler's work.
            crate::charge::restart();
        }
        let ctx = RpcContext {
            caller: req.from,
            node: self.id,
        };
        let payload = req.big.as_deref().unwrap_or(inline);
        self.services
            .dispatch_cached(handlers, &ctx, req.service, payload, out, req.reply);
    }

    /// Whether a request waits in one of `lanes`, the lane list changed
    /// since `version`, or the node stops.
    fn anything_to_do(&self, lanes: &[Arc<Lane>], version: u64) -> bool {
        self.bell.stopping()
            || self.lanes_version.load(Ordering::Acquire) != version
            || lanes.iter().any(|l| l.has_request())
    }

    /// Waits until [`NodeState::anything_to_do`]: first `spins` bare polls,
    /// then polls with the core yielded between them (so a compute thread on
    /// the same core still runs) for up to `handler_poll`, then blocks on the
    /// node's [`Doorbell`] (no lost wake-up: `local_rpc` invariant 4, the
    /// H1 tests below). Pinned to a CPU of its own
    /// ([`crate::placement::alone_on_own_cpu`]) it polls without yielding,
    /// for up to `handler_poll_own_cpu`.
    #[inline(never)] // kept apart (and so named) so profiles can tell idle
    // polling from work: scripts/instructions-per-op.sh counts
    // `wait_for_request` as idle
    fn wait_for_request(
        &self,
        lanes: &[Arc<Lane>],
        version: u64,
        spins: u32,
        handlers: &mut HandlerCache,
    ) {
        // Pinned to a CPU of its own, a yield between polls helps no thread
        // of ours and hands another process the CPU for a time slice:
        // spin there instead (placement::alone_on_own_cpu).
        let own_cpu = crate::placement::alone_on_own_cpu();
        let yield_between_polls = !own_cpu;
        let window = poll_window(own_cpu, self.handler_poll, self.handler_poll_own_cpu);
        // Counted for the report (servestats) once per wait, not per poll.
        let mut polls = 0u32;
        let mut yields = 0u64;
        let mut since: Option<Instant> = None;
        let counts = |polls: u32, yields: u64, blocks: u64| {
            servestats::add_all(
                Role::Handler,
                &[
                    (Counter::Stretches, 1),
                    (Counter::EmptyPolls, u64::from(polls) + 1),
                    (Counter::Yields, yields),
                    (Counter::Blocks, blocks),
                ],
            );
        };
        loop {
            // The reading a stretch starts at if this poll finds a request.
            crate::charge::note_poll();
            // A changed handler table ends the wait too, so that the loop
            // refreshes its copy (G3).
            if self.anything_to_do(lanes, version) || !handlers.is_current(&self.services) {
                counts(polls, yields, 0);
                return;
            }
            polls += 1;
            if polls < spins {
                std::hint::spin_loop();
                continue;
            }
            // Counted (and the CPU sampled) only once the spins are over, so
            // the spin itself stays a bare poll.
            servestats::event(Role::Handler);
            let start = *since.get_or_insert_with(Instant::now);
            if window.is_zero() || start.elapsed() >= window {
                counts(polls, yields, 1);
                // A blocked thread holds no handler (G3): an unregister
                // while it sleeps drops the handler at once.
                handlers.release();
                self.bell.sleep(|| self.anything_to_do(lanes, version));
                return;
            }
            if crate::placement::pause_between_polls(yield_between_polls) {
                yields += 1;
            }
        }
    }
}

/// A value in cache lines of its own (128 bytes: the adjacent-line
/// prefetcher pairs lines).
#[repr(align(128))]
struct Padded<T>(T);

impl<T> std::ops::Deref for Padded<T> {
    type Target = T;
    fn deref(&self) -> &T {
        &self.0
    }
}

/// Bare polls of an idle handler thread before it starts yielding its core
/// between polls (none when it shares its CPU with a compute thread).
const HANDLER_SPINS: u32 = 64;

/// How long an idle handler polls before it blocks: `own_cpu_poll` when it
/// is pinned alone on its CPU (`own_cpu`), else `poll`.
fn poll_window(own_cpu: bool, poll: Duration, own_cpu_poll: Duration) -> Duration {
    if own_cpu { own_cpu_poll } else { poll }
}

/// A cluster whose nodes all live in this process. Dropping it stops every
/// node's handler threads.
pub struct LocalCluster {
    inner: Arc<Inner>,
    reaper: Option<JoinHandle<()>>,
}

impl LocalCluster {
    pub fn new(config: LocalConfig) -> LocalCluster {
        // The plan in force is this cluster's, also when it has none: a plan
        // left by an earlier cluster of the process must not pin this one's
        // threads.
        crate::placement::set_plan(config.placement.clone());
        let (reaper, handle) = Reaper::start(config.rpc_timeout);
        LocalCluster {
            inner: Arc::new(Inner {
                nodes: RwLock::new(Vec::new()),
                faults_active: AtomicBool::new(config.faults.any()),
                faults: RwLock::new(config.faults),
                rpc_timeout: config.rpc_timeout,
                handler_poll: config.handler_poll,
                handler_poll_own_cpu: config.handler_poll_own_cpu,
                reaper,
            }),
            reaper: Some(handle),
        }
    }

    /// Adds a node served by `handler_threads` RPC handler threads (0 for a
    /// node that only issues requests).
    pub fn add_node(&self, handler_threads: usize) -> Arc<LocalNode> {
        let mut nodes = self.inner.nodes.write();
        let id = NodeId(u16::try_from(nodes.len()).expect("at most 65536 nodes"));
        let state = Arc::new(NodeState {
            id,
            crashed: AtomicBool::new(false),
            region_generation: AtomicU64::new(0),
            regions: RwLock::new(Vec::new()),
            services: Padded(ServiceTable::new()),
            lanes: Mutex::new(Vec::new()),
            lanes_version: AtomicU64::new(0),
            bell: Doorbell::default(),
            handler_threads,
            handler_poll: self.inner.handler_poll,
            handler_poll_own_cpu: self.inner.handler_poll_own_cpu,
            handlers: Mutex::new(Vec::new()),
        });
        for h in 0..handler_threads {
            let s = state.clone();
            let handle = std::thread::Builder::new()
                .name(format!("dmkv-{id}-h{h}"))
                .spawn(move || s.serve(h))
                .expect("spawn a handler thread");
            state.handlers.lock().push(handle);
        }
        nodes.push(state.clone());
        Arc::new(LocalNode {
            state,
            inner: self.inner.clone(),
        })
    }

    /// The node with this id.
    pub fn node(&self, id: NodeId) -> Option<Arc<LocalNode>> {
        let state = self.inner.node(id).ok()?;
        Some(Arc::new(LocalNode {
            state,
            inner: self.inner.clone(),
        }))
    }

    pub fn fabric(&self) -> Arc<dyn Fabric> {
        Arc::new(LocalFabric {
            inner: self.inner.clone(),
        })
    }

    pub fn faults(&self) -> Faults {
        self.inner.faults.read().clone()
    }

    pub fn set_faults(&self, faults: Faults) {
        let mut f = self.inner.faults.write();
        self.inner
            .faults_active
            .store(faults.any(), Ordering::Release);
        *f = faults;
    }

    /// Crashes `node`: its memory is gone, its handlers stop, every later
    /// verb or RPC to it fails with [`TransportError::NodeDown`], and callers
    /// waiting for its replies get that error too.
    pub fn crash(&self, node: NodeId) {
        if let Ok(state) = self.inner.node(node) {
            state.stop();
            state.regions.write().clear();
            state.region_generation.fetch_add(1, Ordering::AcqRel);
        }
    }
}

impl Drop for LocalCluster {
    fn drop(&mut self) {
        for n in self.inner.nodes.read().iter() {
            n.stop();
            // Handlers may hold the fabric (and so every node): dropping them
            // and the regions breaks such cycles, so a torn-down cluster
            // frees its memory even if an engine kept a strong reference.
            n.services.clear();
            n.regions.write().clear();
            n.region_generation.fetch_add(1, Ordering::AcqRel);
        }
        self.inner.reaper.shut_down();
        if let Some(h) = self.reaper.take() {
            let _ = h.join();
        }
    }
}

/// A node of a [`LocalCluster`].
pub struct LocalNode {
    state: Arc<NodeState>,
    inner: Arc<Inner>,
}

impl NodeHost for LocalNode {
    fn id(&self) -> NodeId {
        self.state.id
    }

    fn register_region(&self, len: usize) -> Result<(RemoteRegion, Arc<RegionMem>)> {
        self.state.check_up()?;
        crate::region::register_zeroed(&self.state.regions, self.state.id, len)
    }

    fn deregister_region(&self, id: RegionId) {
        if let Some(slot) = self.state.regions.write().get_mut(id.0 as usize) {
            *slot = None;
        }
        self.state.region_generation.fetch_add(1, Ordering::AcqRel);
    }

    fn services(&self) -> &ServiceTable {
        &self.state.services
    }

    fn fabric(&self) -> Arc<dyn Fabric> {
        Arc::new(LocalFabric {
            inner: self.inner.clone(),
        })
    }

    fn handler_threads(&self) -> usize {
        self.state.handler_threads
    }
}

struct LocalFabric {
    inner: Arc<Inner>,
}

impl Fabric for LocalFabric {
    fn name(&self) -> &'static str {
        "local"
    }

    fn endpoint(&self, node: NodeId) -> Result<Endpoint> {
        self.inner.node(node)?;
        Ok(Endpoint::new(Box::new(LocalEndpoint {
            inner: self.inner.clone(),
            node,
            regions: RefCell::new(Vec::new()),
            rng: RefCell::new(SmallRng::from_entropy()),
            targets: RefCell::new(Vec::new()),
            rpcs: RpcSlots::new(&self.inner.reaper),
        })))
    }
}

/// A region resolved once and reused while its node's generation holds.
struct ResolvedRegion {
    node: Arc<NodeState>,
    generation: u64,
    key: AccessKey,
    mem: Arc<RegionMem>,
}

struct LocalEndpoint {
    inner: Arc<Inner>,
    node: NodeId,
    /// Resolved regions, indexed by node id and then region id (both are
    /// small dense counters), so a verb finds its memory without hashing or
    /// reference counting.
    regions: RefCell<Vec<Vec<Option<ResolvedRegion>>>>,
    rng: RefCell<SmallRng>,
    /// RPC targets by node id (nodes are never removed from a cluster), so
    /// an RPC finds its node's queue without a lock or reference count.
    targets: RefCell<Vec<Option<Arc<NodeState>>>>,
    /// Where this endpoint's RPC replies land (see `local_rpc`).
    rpcs: RpcSlots,
}

impl LocalEndpoint {
    /// Runs `f` on the memory behind `addr` after checking node, region and
    /// key.
    fn with_region<R>(&self, addr: &RemoteAddr, f: impl FnOnce(&RegionMem) -> R) -> Result<R> {
        {
            let cache = self.regions.borrow();
            if let Some(r) = Self::cached_entry(&cache, addr) {
                return Self::checked(r, addr).map(f);
            }
        }
        let (n, i) = (addr.node.0 as usize, addr.region.0 as usize);
        let r = self.resolve_slow(addr)?;
        let mut cache = self.regions.borrow_mut();
        if cache.len() <= n {
            cache.resize_with(n + 1, Vec::new);
        }
        if cache[n].len() <= i {
            cache[n].resize_with(i + 1, || None);
        }
        let r = cache[n][i].insert(r);
        Self::checked(r, addr).map(f)
    }

    /// `addr`'s region in `cache` if it is there and still current (its
    /// node's generation unchanged), unchecked; `None` if the cache cannot
    /// answer. [`Self::run_region`] checks it as [`Self::checked`] does.
    #[inline(always)]
    fn cached_entry<'r>(
        cache: &'r [Vec<Option<ResolvedRegion>>],
        addr: &RemoteAddr,
    ) -> Option<&'r ResolvedRegion> {
        let (n, i) = (addr.node.0 as usize, addr.region.0 as usize);
        match cache.get(n).and_then(|regions| regions.get(i)) {
            Some(Some(r)) if r.node.region_generation.load(Ordering::Acquire) == r.generation => {
                Some(r)
            }
            _ => None,
        }
    }

    /// The region's memory if its node is up and `addr` carries its key.
    #[inline(always)]
    fn checked<'r>(r: &'r ResolvedRegion, addr: &RemoteAddr) -> Result<&'r RegionMem> {
        r.node.check_up()?;
        Self::key_checked(r, addr)
    }

    /// The region's memory if `addr` carries its key (its node checked
    /// already: [`Self::checked`], or the start of a run, R1).
    #[inline(always)]
    fn key_checked<'r>(r: &'r ResolvedRegion, addr: &RemoteAddr) -> Result<&'r RegionMem> {
        if r.key != addr.key {
            return Err(TransportError::AccessDenied {
                node: addr.node,
                region: addr.region,
            });
        }
        Ok(&r.mem)
    }

    /// Looks `addr`'s region up in its node's table.
    fn resolve_slow(&self, addr: &RemoteAddr) -> Result<ResolvedRegion> {
        let node = self.inner.node(addr.node)?;
        let generation = node.region_generation.load(Ordering::Acquire);
        let (key, mem) = {
            let regions = node.regions.read();
            match regions.get(addr.region.0 as usize) {
                Some(Some(e)) => (e.key, e.mem.clone()),
                _ => {
                    node.check_up()?;
                    return Err(TransportError::NoSuchRegion {
                        node: addr.node,
                        region: addr.region,
                    });
                }
            }
        };
        Ok(ResolvedRegion {
            node,
            generation,
            key,
            mem,
        })
    }

    /// Executes one verb at once.
    fn perform(&self, verb: &Verb) -> Result<VerbResult> {
        match verb {
            Verb::Read { addr, len } => self.read_now(addr, *len),
            // The batch loop's execution of a write or an atomic, after
            // this path's region look-up (`local` never meters lines, so
            // `metered` only keeps the `sim` touch as `RegionMem::write`
            // and `cas_u64` made it).
            Verb::Write { addr, .. } | Verb::Cas { addr, .. } | Verb::Faa { addr, .. } => {
                self.with_region(addr, |mem| Self::perform_on(mem, verb, true))?
            }
        }
    }

    /// A write or an atomic verb executed at once against `mem`, its
    /// region, already resolved and checked (node up, key): what
    /// [`Self::perform`] does after [`Self::with_region`], with the word
    /// stores and the atomic inlined and `sim`'s touch skipped while
    /// `metered` is false (`run_verbs` reads it once per batch). Not for
    /// reads (`run_verbs` fills their buffers in place).
    #[inline(always)]
    fn perform_on(mem: &RegionMem, verb: &Verb, metered: bool) -> Result<VerbResult> {
        match verb {
            Verb::Write { addr, data } => {
                mem.write_from(addr.offset, data, metered)
                    .map_err(|e| e.at(addr))?;
                Ok(VerbResult::Write)
            }
            Verb::Cas {
                addr,
                expected,
                new,
            } => {
                let w = mem
                    .word_for_verb(addr.offset, metered)
                    .map_err(|e| e.at(addr))?;
                Ok(VerbResult::Cas(
                    match w.compare_exchange(*expected, *new, Ordering::AcqRel, Ordering::Acquire) {
                        Ok(v) | Err(v) => v,
                    },
                ))
            }
            Verb::Faa { addr, add } => {
                let w = mem
                    .word_for_verb(addr.offset, metered)
                    .map_err(|e| e.at(addr))?;
                Ok(VerbResult::Faa(w.fetch_add(*add, Ordering::AcqRel)))
            }
            Verb::Read { .. } => unreachable!("run_verbs executes reads itself"),
        }
    }

    /// A one-sided read, executed at once.
    fn read_now(&self, addr: &RemoteAddr, len: usize) -> Result<VerbResult> {
        // A spare buffer of this thread if it has one (returned by a dropped
        // `BatchResult` or `ReadBuf`), else a new one.
        let mut buf = crate::buffers::take();
        self.with_region(addr, |mem| mem.read_to_vec(addr.offset, len, &mut buf))?
            .map_err(|e| e.at(addr))?;
        Ok(VerbResult::Read(buf))
    }

    /// Executes `verbs` at once, in order, into `out`; stops at the first
    /// refused verb. The fault-free path of [`EndpointBackend::execute_now`]
    /// and [`EndpointBackend::execute`]:
    /// the region cache is borrowed once for a stretch of verbs (let go
    /// only to resolve a region it does not hold, then borrowed again for
    /// the rest), the thread's spare read buffers are taken in one access
    /// (`spares`), and whether `sim` meters lines is read once
    /// (`sim::lines_metered`: nothing in the loop can change it), so a read
    /// verb costs its checks and its copy.
    ///
    /// R1: consecutive verbs on one region share its resolution (a run,
    /// [`Self::run_region`]): the first verb of a run looks the region up
    /// and checks its generation and its node, as [`Self::with_region`]
    /// does; the run's later verbs check only their key and their bounds.
    /// A region dropped or re-registered, or a node crashed, before the run
    /// began refuses its verbs exactly as before; one that happens while a
    /// run executes may let the run's later verbs complete, as verbs
    /// already handed to a NIC would (the cache's `Arc` keeps the memory
    /// alive). Always inlined into its callers: one call less per batch.
    /// `Ok` tells whether a verb was a write ([`Self::clear_verbs`]).
    #[inline(always)]
    fn run_verbs(
        &self,
        verbs: &mut Verbs,
        out: &mut VerbResults,
        mut spares: Option<&mut crate::buffers::Spares<'_>>,
    ) -> Result<()> {
        // `out` may hold an earlier batch's results (a pooled list, see
        // `buffers::Spares::take_results`): entry `i` becomes verb `i`'s
        // result, a read filling in place the buffer entry `i` holds.
        // Missing entries are added as placeholders (`Write` holds
        // nothing), so the loop walks the verbs and their entries side by
        // side; entries beyond the batch stay, with their buffers, for
        // later batches (`execute_now`'s contract: the batch's results are
        // the list's first `verbs.len()` entries).
        let verbs = verbs.as_mut_slice();
        let n = verbs.len();
        if out.len() < n {
            out.resize_with(n, || VerbResult::Write);
        }
        let metered = crate::sim::lines_metered();
        let mut next = 0;
        while next < n {
            // A stretch of verbs whose regions the cache holds: `run`
            // borrows from it, so both end before a region is resolved.
            let cache = self.regions.borrow();
            let mut run = None;
            for (v, entry) in verbs[next..].iter_mut().zip(out[next..].iter_mut()) {
                let Some(mem) = Self::run_region(&cache, &mut run, v.addr()) else {
                    break;
                };
                Self::execute_on(mem?, v, entry, spares.as_deref_mut(), metered)?;
                next += 1;
            }
            drop(cache);
            if next < n {
                // A region the cache does not hold (or holds stale): the
                // general path resolves it (filling the cache) and checks
                // it, then the verb executes there.
                let v = &mut verbs[next];
                let entry = &mut out[next];
                let addr = *v.addr();
                self.with_region(&addr, |mem| {
                    Self::execute_on(mem, v, entry, spares.as_deref_mut(), metered)
                })??;
                next += 1;
            }
        }
        Ok(())
    }

    /// Empties `verbs` after [`Self::run_verbs`] gave `done`: a batch that
    /// executed in full holds nothing to free (a read's and an atomic's
    /// fields are plain integers, and every write's data went back to the
    /// spares as it executed, W2 on [`Self::execute_on`]), so its verbs are
    /// forgotten at once instead of walked by the drop loop (~7
    /// instructions a verb); a refused batch's verbs are dropped.
    #[inline(always)]
    #[allow(unsafe_code)]
    fn clear_verbs(verbs: &mut Verbs, done: &Result<()>) {
        // What the SAFETY comment below relies on, checked by the compiler:
        // a verb without a `Write`'s buffer has nothing to drop.
        const _: () = assert!(!std::mem::needs_drop::<RemoteAddr>());
        if done.is_ok() {
            // SAFETY: `run_verbs` executed every verb (it returned `Ok`):
            // each is a `Read`, `Cas` or `Faa`, whose fields (`RemoteAddr`,
            // lengths, words) own nothing and have no drop glue, or a
            // `Write` whose data `execute_on` replaced by an empty vector
            // (no allocation, W2): setting the length to zero skips no drop
            // that does anything. The list's own storage is untouched.
            unsafe { verbs.set_len(0) };
        } else {
            verbs.clear();
        }
    }

    /// `addr`'s region for a verb of a batch (R1 on [`Self::run_verbs`]):
    /// `run`'s if `addr` is in it (only its key checked: node and
    /// generation were checked when the run began), else the cache's
    /// ([`Self::cached_entry`], all checks), which then starts a new run; `None`
    /// if the cache cannot answer.
    #[inline(always)]
    fn run_region<'r>(
        cache: &'r [Vec<Option<ResolvedRegion>>],
        run: &mut Option<(NodeId, RegionId, &'r ResolvedRegion)>,
        addr: &RemoteAddr,
    ) -> Option<Result<&'r RegionMem>> {
        if let Some((node, region, r)) = *run
            && node == addr.node
            && region == addr.region
        {
            return Some(Self::key_checked(r, addr));
        }
        let r = Self::cached_entry(cache, addr)?;
        let mem = Self::checked(r, addr);
        if mem.is_ok() {
            *run = Some((addr.node, addr.region, r));
        }
        Some(mem)
    }

    /// Executes `v` against `mem`, its region (resolved and checked for
    /// node and key), into `entry`: a read fills the buffer the entry holds
    /// (a spare one put there first if it holds none), anything else
    /// replaces the entry ([`Self::perform_on`]), whose buffer, if any, goes
    /// back to the spares.
    ///
    /// W2: a write's data, once copied into the region, goes to the spares
    /// too (the verb is left with an empty vector), so the thread's next
    /// buffer ([`crate::buffers::take`]: a read's, or an engine's image of
    /// what it writes next) reuses its allocation instead of a free here
    /// and an allocation there. [`Self::clear_verbs`] relies on it.
    #[inline(always)]
    fn execute_on(
        mem: &RegionMem,
        v: &mut Verb,
        entry: &mut VerbResult,
        spares: Option<&mut crate::buffers::Spares<'_>>,
        metered: bool,
    ) -> Result<()> {
        let Verb::Read { addr, len } = v else {
            let old = std::mem::replace(entry, Self::perform_on(mem, v, metered)?);
            let data = match v {
                Verb::Write { data, .. } => std::mem::take(data),
                _ => Vec::new(),
            };
            match spares {
                Some(s) => {
                    if let VerbResult::Read(b) = old {
                        s.give(b);
                    }
                    s.give(data);
                }
                // Not borrowed (a list from the fast slot): an access of
                // its own for each buffer there is (none for an empty
                // vector; dropped during teardown).
                None => {
                    if let VerbResult::Read(b) = old {
                        crate::buffers::give(b);
                    }
                    crate::buffers::give(data);
                }
            }
            return Ok(());
        };
        // The buffer to fill: the entry's own if it is a read's, else a
        // spare one put there first (an atomic's, a write's or a
        // placeholder's entry holds nothing to free).
        if !matches!(entry, VerbResult::Read(_)) {
            *entry = VerbResult::Read(match spares {
                Some(s) => s.take(),
                // Not borrowed: one access of its own (a new vector
                // during teardown).
                None => crate::buffers::take(),
            });
        }
        let VerbResult::Read(buf) = entry else {
            unreachable!("a read's entry was just stored")
        };
        mem.read_into(addr.offset, *len, buf, metered)
            .map_err(|e| e.at(addr))
    }
}

impl LocalEndpoint {
    /// A read copied in random word-aligned pieces with yields in between, so
    /// that writers on other tasks and threads land in the middle of it.
    async fn torn_read(&self, addr: RemoteAddr, len: usize) -> Result<VerbResult> {
        self.with_region(&addr, |mem| mem.check(addr.offset, len as u64))?
            .map_err(|e| e.at(&addr))?;
        let mut buf = vec![0; len];
        let mut done = 0;
        while done < len {
            let piece = 8 * self.rng.borrow_mut().gen_range(1..=4usize);
            // End pieces on word boundaries of the region.
            let pos = addr.offset as usize + done;
            let n = (piece - pos % 8).min(len - done);
            self.with_region(&addr, |mem| mem.read(pos as u64, &mut buf[done..done + n]))?
                .map_err(|e| e.at(&addr))?;
            done += n;
            if done < len {
                std::thread::yield_now();
                yield_now().await;
            }
        }
        Ok(VerbResult::Read(buf))
    }
}

impl EndpointBackend for LocalEndpoint {
    fn local_node(&self) -> NodeId {
        self.node
    }

    /// Nothing to charge at an operation's start: the real CPU does the work.
    fn begins_ops(&self) -> bool {
        false
    }

    /// Hints the lines of every verb whose region the cache holds (a region
    /// not cached yet is resolved when the verbs execute) and defers the
    /// batch to its next poll, so that the 8 tasks' misses overlap as a
    /// NIC's DMA reads would (L1 below). Only when `execute_now` will run
    /// the verbs (no injected faults: the flag, as there).
    ///
    /// L1: a deferred batch executes on the poll after its post, before its
    /// results are handed out, with the same checks, order and results as
    /// if it ran at the post: what another task or thread did in between
    /// may be seen, which the transport allows (a verb happens somewhere
    /// between its post and its completion). Within a batch the verbs still
    /// run in posting order, and a task's next batch is posted only after
    /// this one completed.
    fn prefetch(&self, verbs: &Verbs) -> bool {
        if self.inner.faults_active.load(Ordering::Acquire) {
            return false;
        }
        // Only the cached memory, unchecked: a hint to a region since
        // dropped, or under another key, is harmless (the cache's `Arc`
        // keeps the memory alive, nothing is read), and the verb's
        // execution checks all of it.
        let cache = self.regions.borrow();
        for v in verbs.as_slice() {
            let (addr, len) = match v {
                Verb::Read { addr, len } => (addr, *len as u64),
                Verb::Write { addr, data } => (addr, data.len() as u64),
                Verb::Cas { addr, .. } | Verb::Faa { addr, .. } => (addr, 8),
            };
            let (n, i) = (addr.node.0 as usize, addr.region.0 as usize);
            if let Some(Some(r)) = cache.get(n).and_then(|regions| regions.get(i)) {
                r.mem.prefetch(addr.offset, len);
            }
        }
        true
    }

    fn execute_now(&self, verbs: &mut Verbs) -> Option<Result<PooledResults>> {
        // Only without injected faults (the flag alone, as in `execute`):
        // with faults, `execute` decides how the verbs run.
        if self.inner.faults_active.load(Ordering::Acquire) {
            return None;
        }
        // The list the thread's last batch gave back, if it is in the fast
        // slot (B2): its entries' buffers are filled in place, and a
        // buffer it lacks is taken from the spares on its own.
        if let Some(mut list) = crate::buffers::take_fast_results() {
            let done = self.run_verbs(verbs, &mut list, None);
            Self::clear_verbs(verbs, &done);
            return Some(done.map(|()| list));
        }
        // One access to the thread's spares for the result list and every
        // read's buffer.
        let done = crate::buffers::with_spares(|mut spares| {
            let mut list = match spares.as_deref_mut() {
                Some(s) => s.take_results(),
                None => PooledResults::default(),
            };
            let done = self.run_verbs(verbs, &mut list, spares);
            (done, list)
        });
        Self::clear_verbs(verbs, &done.0);
        Some(done.0.map(|()| done.1))
    }

    fn execute(&self, verbs: &mut Verbs) -> OpFuture<'_, Result<VerbResults>> {
        // No fault injected (the flag alone, without building a `Faults`):
        // the common case; otherwise the faults decide.
        let faults = self
            .inner
            .faults_active
            .load(Ordering::Acquire)
            .then(|| self.inner.faults());
        if faults
            .as_ref()
            .is_none_or(|f| f.round_trip_latency.is_zero() && !f.torn_reads)
        {
            // The verbs run now, against the memory, like a NIC would; the
            // task still yields once, as a real round trip would make it.
            // A plain loop: collecting into `Result<VerbResults>` goes through
            // iterator adapters that cost more than the verbs themselves.
            // The verbs are looked at in place and cleared at the end (not
            // moved out one by one).
            // A new list: `run_verbs` makes exactly one entry per verb.
            let mut out = VerbResults::new();
            let done =
                crate::buffers::with_spares(|spares| self.run_verbs(verbs, &mut out, spares));
            Self::clear_verbs(verbs, &done);
            return OpFuture::ready_after_yield(done.map(|_| out));
        }
        let faults = faults.expect("the fault-free path returned above");
        let verbs = std::mem::take(verbs);
        OpFuture::boxed(async move {
            let half = faults.round_trip_latency / 2;
            if !half.is_zero() {
                sleep(half).await;
            }
            let mut out = VerbResults::with_capacity(verbs.len());
            for v in verbs {
                out.push(match v {
                    Verb::Read { addr, len } if faults.torn_reads && len > 8 => {
                        self.torn_read(addr, len).await?
                    }
                    v => self.perform(&v)?,
                });
            }
            if !half.is_zero() {
                sleep(half).await;
            }
            Ok(out)
        })
    }

    fn call(
        &self,
        node: NodeId,
        service: ServiceId,
        payload: Vec<u8>,
    ) -> OpFuture<'_, Result<Reply>> {
        match self.call_local(node, service, payload) {
            Ok(wait) => OpFuture::boxed(wait),
            Err(op) => op,
        }
    }

    fn request_buffer(&self) -> Vec<u8> {
        self.rpcs.request_buffer()
    }

    fn recycle(&self, buf: Vec<u8>) {
        self.rpcs.recycle(buf)
    }

    // Inlined here, with the fast path of `call_local` and `RpcSlots::send`
    // (branch i71): the reply slot's wait is built once, in the future this
    // returns, instead of being moved out of three nested calls.
    #[inline]
    fn call_unboxed(&self, node: NodeId, service: ServiceId, payload: Vec<u8>) -> CallFuture<'_> {
        match self.call_local(node, service, payload) {
            Ok(wait) => CallFuture::slot(wait),
            Err(op) => CallFuture::op(op),
        }
    }
}

impl LocalEndpoint {
    /// Sends an RPC: on the fault-free path the reply slot's wait (`Ok`),
    /// else the operation that answers it (an error, or the faulty path).
    /// Always inlined (with `send_fault_free` and `RpcSlots::send`, branch
    /// i71): `#[inline]` alone left three calls, each moving the wait out.
    #[inline(always)]
    fn call_local(
        &self,
        node: NodeId,
        service: ServiceId,
        payload: Vec<u8>,
    ) -> std::result::Result<ReplyWait<'_>, OpFuture<'_, Result<Reply>>> {
        // The common case borrows the node from this endpoint's table (no
        // reference count changes hands per RPC); the same checks as
        // `call_slow`, in the same order.
        {
            let targets = self.targets.borrow();
            if let Some(Some(target)) = targets.get(node.0 as usize)
                && target.handler_threads > 0
                && !self.inner.faults_active.load(Ordering::Acquire)
            {
                if target.crashed.load(Ordering::Acquire) {
                    return Err(OpFuture::ready(Err(TransportError::NodeDown(target.id))));
                }
                return self.send_fault_free(target, node, service, payload);
            }
        }
        self.call_slow(node, service, payload)
    }

    /// [`LocalEndpoint::call_local`] for a node not in this endpoint's table
    /// yet, a node without handler threads, or with faults injected.
    #[cold]
    #[inline(never)]
    fn call_slow(
        &self,
        node: NodeId,
        service: ServiceId,
        payload: Vec<u8>,
    ) -> std::result::Result<ReplyWait<'_>, OpFuture<'_, Result<Reply>>> {
        let target = match self.target(node) {
            Ok(n) => n,
            Err(e) => return Err(OpFuture::ready(Err(e))),
        };
        if target.handler_threads == 0 {
            return Err(OpFuture::ready(Err(TransportError::Backend(format!(
                "node {node} has no handler threads and serves no RPCs"
            )))));
        }
        if self.inner.faults_active.load(Ordering::Acquire) {
            return Err(self.call_with_faults(target, node, service, payload));
        }
        self.send_fault_free(&target, node, service, payload)
    }

    /// The fault-free path: no timer, no clock read, no allocation per RPC;
    /// the request goes into this endpoint's lane to the node (the node is
    /// cloned only when the lane is full and the call must wait for room).
    #[inline(always)]
    fn send_fault_free(
        &self,
        target: &Arc<NodeState>,
        node: NodeId,
        service: ServiceId,
        payload: Vec<u8>,
    ) -> std::result::Result<ReplyWait<'_>, OpFuture<'_, Result<Reply>>> {
        let header = RequestHeader {
            from: self.node,
            service,
            deliver_at: None,
        };
        match self.rpcs.send(node, header, payload) {
            Ok(wait) => {
                self.sent(target, node);
                Ok(wait)
            }
            Err(payload) => Err(self.wait_for_room(target, node, service, payload)),
        }
    }

    /// The lane to `target` was full: the RPC waits for room
    /// ([`LocalEndpoint::send_when_room`]), boxed.
    #[cold]
    #[inline(never)]
    fn wait_for_room(
        &self,
        target: &Arc<NodeState>,
        node: NodeId,
        service: ServiceId,
        payload: Vec<u8>,
    ) -> OpFuture<'_, Result<Reply>> {
        OpFuture::boxed(self.send_when_room(target.clone(), node, service, payload, None))
    }

    /// After a request went into the lane to `target`: wake a sleeping
    /// handler, and if the node went down meanwhile, answer what is queued
    /// (its callers see `NodeDown`).
    #[inline]
    fn sent(&self, target: &NodeState, node: NodeId) {
        target.bell.ring();
        if target.crashed.load(Ordering::Acquire) {
            self.drain_after_crash(node);
        }
    }

    /// The node went down while a request was being queued to it.
    #[cold]
    #[inline(never)]
    fn drain_after_crash(&self, node: NodeId) {
        if let Some(lane) = self.rpcs.lane(node) {
            lane.drain();
        }
    }

    /// An RPC whose lane was full when it was sent: it waits for room,
    /// yielding to the other tasks, then for its reply; it gives up with
    /// `Timeout` after `rpc_timeout` without room (`local_rpc`
    /// invariant 7).
    async fn send_when_room(
        &self,
        target: Arc<NodeState>,
        node: NodeId,
        service: ServiceId,
        mut payload: Vec<u8>,
        deliver_at: Option<Instant>,
    ) -> Result<Reply> {
        let since = self.rpcs.tick_now();
        loop {
            target.check_up()?;
            let header = RequestHeader {
                from: self.node,
                service,
                deliver_at,
            };
            match self.rpcs.send(node, header, payload) {
                Ok(wait) => {
                    self.sent(&target, node);
                    return wait.await;
                }
                Err(p) => payload = p,
            }
            if self.rpcs.room_wait_timed_out(since) {
                return Err(TransportError::Timeout { node });
            }
            yield_now().await;
        }
    }
}

impl LocalEndpoint {
    /// The node `node`, if it exists and is up.
    fn target(&self, node: NodeId) -> Result<Arc<NodeState>> {
        let i = node.0 as usize;
        if let Some(Some(n)) = self.targets.borrow().get(i) {
            n.check_up()?;
            return Ok(n.clone());
        }
        let n = self.inner.node(node)?;
        n.check_up()?;
        if !self.rpcs.has_lane(node) {
            let lane = Lane::new();
            n.add_lane(lane.clone());
            self.rpcs.add_lane(node, lane);
        }
        let mut t = self.targets.borrow_mut();
        if t.len() <= i {
            t.resize_with(i + 1, || None);
        }
        t[i] = Some(n.clone());
        Ok(n)
    }

    /// An RPC while faults are injected: round-trip latency, delays and
    /// drops (a dropped request waits out the whole timeout).
    fn call_with_faults(
        &self,
        target: Arc<NodeState>,
        node: NodeId,
        service: ServiceId,
        payload: Vec<u8>,
    ) -> OpFuture<'_, Result<Reply>> {
        let faults = self.inner.faults();
        let timeout = self.inner.rpc_timeout;
        let dropped = faults.rpc_drop_probability > 0.0
            && self
                .rng
                .borrow_mut()
                .gen_bool(faults.rpc_drop_probability.min(1.0));
        OpFuture::boxed(async move {
            let half = faults.round_trip_latency / 2;
            if !half.is_zero() {
                sleep(half).await;
            }
            if dropped {
                sleep(timeout).await;
                return Err(TransportError::Timeout { node });
            }
            let deliver_at =
                (!faults.rpc_delay.is_zero()).then(|| Instant::now() + faults.rpc_delay);
            let reply = self
                .send_when_room(target, node, service, payload, deliver_at)
                .await?;
            if !half.is_zero() {
                sleep(half).await;
            }
            Ok(reply)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::NodeHost;
    use crate::error::ServiceError;
    use crate::exec::block_on;

    /// A handler pinned alone on its CPU polls for the own-CPU window,
    /// any other for `handler_poll`; zero still means blocking at once.
    #[test]
    fn a_handler_alone_on_its_cpu_polls_for_its_own_window() {
        let (poll, own) = (Duration::from_millis(1), Duration::from_millis(100));
        assert_eq!(poll_window(true, poll, own), own);
        assert_eq!(poll_window(false, poll, own), poll);
        assert_eq!(poll_window(true, poll, Duration::ZERO), Duration::ZERO);
        let d = LocalConfig::default();
        assert_eq!(
            (d.handler_poll, d.handler_poll_own_cpu),
            (DEFAULT_HANDLER_POLL, DEFAULT_HANDLER_POLL_OWN_CPU)
        );
    }

    /// H1 at the doorbell: one RPC in flight at a time, sent after a
    /// random short pause while the handler polls for nothing (`poll`
    /// zero: it blocks whenever its lanes are empty) or for 1 µs (it is
    /// often between polling and blocking when the request comes). A lost
    /// wake-up leaves a request unserved and its caller times out (10 s).
    #[test]
    fn enqueue_racing_a_handler_going_to_sleep_is_never_lost() {
        for poll in [Duration::ZERO, Duration::from_micros(1)] {
            let cluster = LocalCluster::new(LocalConfig {
                handler_poll: poll,
                rpc_timeout: Duration::from_secs(10),
                ..LocalConfig::default()
            });
            let server = cluster.add_node(1);
            let echo = register_echo(server.services());
            let me = cluster.add_node(0).id();
            let ep = cluster.fabric().endpoint(me).unwrap();
            let mut rng = SmallRng::seed_from_u64(7);
            for i in 0..20_000u32 {
                for _ in 0..rng.gen_range(0..2_000u32) {
                    std::hint::spin_loop();
                }
                let req = i.to_le_bytes().to_vec();
                let reply = block_on(ep.call(server.id(), echo, req.clone()));
                assert_eq!(
                    reply.unwrap(),
                    req,
                    "RPC {i} (poll {poll:?}) was never served"
                );
            }
        }
    }

    /// Registers a service that answers each request with its own bytes.
    fn register_echo(services: &crate::service::ServiceTable) -> crate::ServiceId {
        services
            .register(
                "echo",
                Arc::new(
                    |_: &RpcContext, r: &[u8]| -> std::result::Result<Vec<u8>, ServiceError> {
                        Ok(r.to_vec())
                    },
                ),
            )
            .unwrap()
    }

    /// G3 (`service::HandlerCache`): the handler threads' copies of the
    /// handler table do not keep an unregistered handler alive. Two handler
    /// threads serve the handler (so both hold it), then it is unregistered
    /// while they poll: for ever (`handler_poll` one hour: only the idle
    /// refresh can drop it), briefly (1 ms: polling, then blocking) or not
    /// at all (zero: they block at once, releasing their copies). Its state
    /// must be dropped (waited for up to 10 s; seen at once when it works)
    /// and a later RPC with its id must get the unknown-service error (G2).
    /// Checked to fail without the idle refresh: with the `is_current`
    /// test taken out of `wait_for_request`, the one-hour case never drops
    /// the state.
    #[test]
    fn an_unregistered_handler_is_dropped_by_idle_handler_threads() {
        for poll in [
            Duration::from_secs(3600),
            Duration::from_millis(1),
            Duration::ZERO,
        ] {
            let cluster = LocalCluster::new(LocalConfig {
                handler_poll: poll,
                rpc_timeout: Duration::from_secs(10),
                ..LocalConfig::default()
            });
            let server = cluster.add_node(2);
            let state = Arc::new(7u64);
            let weak = Arc::downgrade(&state);
            let id = server
                .services()
                .register(
                    "tracked",
                    Arc::new(
                        move |_: &RpcContext,
                              _: &[u8]|
                              -> std::result::Result<Vec<u8>, ServiceError> {
                            Ok(state.to_le_bytes().to_vec())
                        },
                    ),
                )
                .unwrap();
            let me = cluster.add_node(0).id();
            let ep = cluster.fabric().endpoint(me).unwrap();
            // Enough calls in flight at once that both threads serve some.
            let calls: Vec<crate::exec::LocalTask<'_, Result<Vec<u8>>>> = (0..64)
                .map(|_| Box::pin(ep.call(server.id(), id, Vec::new())) as _)
                .collect();
            for r in crate::exec::run_tasks(calls) {
                assert_eq!(r.unwrap(), 7u64.to_le_bytes());
            }
            server.services().unregister("tracked");
            let deadline = Instant::now() + Duration::from_secs(10);
            while weak.strong_count() > 0 && Instant::now() < deadline {
                std::thread::sleep(Duration::from_millis(1));
            }
            assert_eq!(
                weak.strong_count(),
                0,
                "handler_poll {poll:?}: a handler thread still holds the unregistered handler"
            );
            match block_on(ep.call(server.id(), id, Vec::new())) {
                Err(TransportError::Remote { error, .. }) => {
                    assert_eq!(error.code, crate::ErrorCode::UnknownService, "{error}")
                }
                other => panic!("handler_poll {poll:?}: expected unknown service, got {other:?}"),
            }
        }
    }

    /// R1-R3 (docs/transport.md, "Reply buffers"): a handler writing into
    /// the thread's reply buffer gets it empty every time, whatever the
    /// last reply left there (a longer one, one taken by a big reply, one
    /// a panicking handler half wrote), its replies arrive whole, and once
    /// the buffer has grown, small replies reuse its allocation.
    #[test]
    fn reply_buffers_are_empty_for_every_request_and_reused() {
        struct Echo {
            /// Per request: was `out` empty on entry, its address on entry
            /// and once the reply (or half of it) was written, its capacity
            /// on entry.
            seen: parking_lot::Mutex<Vec<(bool, usize, usize, usize)>>,
        }
        impl crate::service::Service for Echo {
            fn handle(
                &self,
                _: &RpcContext,
                _: &[u8],
            ) -> std::result::Result<Vec<u8>, ServiceError> {
                unreachable!("a local handler thread calls handle_into")
            }
            fn handle_into(
                &self,
                _: &RpcContext,
                req: &[u8],
                out: &mut Vec<u8>,
            ) -> std::result::Result<(), ServiceError> {
                let (empty, entry, room) = (out.is_empty(), out.as_ptr() as usize, out.capacity());
                // `len` bytes of `fill`; "p" panics half-way through.
                let len = u32::from_le_bytes(req[1..5].try_into().unwrap()) as usize;
                out.extend(std::iter::repeat_n(req[0], len / 2));
                if req[0] == b'p' {
                    self.seen
                        .lock()
                        .push((empty, entry, out.as_ptr() as usize, room));
                    panic!("half a reply");
                }
                out.extend(std::iter::repeat_n(req[0], len - len / 2));
                self.seen
                    .lock()
                    .push((empty, entry, out.as_ptr() as usize, room));
                Ok(())
            }
        }
        let cluster = LocalCluster::new(LocalConfig::default());
        let server = cluster.add_node(1);
        let echo = Arc::new(Echo {
            seen: parking_lot::Mutex::new(Vec::new()),
        });
        let id = server.services().register("echo", echo.clone()).unwrap();
        // A service with `handle_into`'s default, replying with a `Vec` of
        // three bytes' capacity (as the directory's service ids had four).
        let tiny = server
            .services()
            .register(
                "tiny",
                Arc::new(|_: &RpcContext, _: &[u8]| Ok(vec![7u8; 3])),
            )
            .unwrap();
        let me = cluster.add_node(0).id();
        let ep = cluster.fabric().endpoint(me).unwrap();
        let call = |fill: u8, len: u32| {
            // R4 after a default handler's short reply and the
            // directory's (a four-byte service id) too.
            let short = block_on(ep.call(server.id(), tiny, Vec::new())).unwrap();
            assert_eq!(short, vec![7u8; 3]);
            assert_eq!(
                block_on(ep.lookup_service(server.id(), "echo")).unwrap(),
                id
            );
            let mut req = vec![fill];
            req.extend_from_slice(&len.to_le_bytes());
            block_on(ep.call(server.id(), id, req))
        };
        let sizes = [
            (b'a', 40),
            (b'b', 3),
            (b'c', 64),
            (b'd', 0),
            (b'e', 5000),
            (b'f', 7),
            (b'p', 50),
            (b'g', 65),
            (b'h', 1),
            (b'i', 64),
            (b'j', 2),
        ];
        for (fill, len) in sizes {
            let r = call(fill, len);
            if fill == b'p' {
                match r {
                    Err(TransportError::Remote { error, .. }) => {
                        assert!(error.message.contains("panicked"), "{error}")
                    }
                    other => panic!("expected the panic's error, got {other:?}"),
                }
            } else {
                assert_eq!(
                    r.unwrap(),
                    vec![fill; len as usize],
                    "reply {}",
                    fill as char
                );
            }
        }
        let seen = echo.seen.lock().clone();
        assert_eq!(seen.len(), sizes.len());
        assert!(
            seen.iter().all(|&(empty, _, _, _)| empty),
            "R1: the buffer is empty on entry: {seen:?}"
        );
        // R4: it always has room for any inline reply, also after a large
        // reply took its allocation ('e', 'g'), so a small reply is put in
        // its slot with a fixed-size copy.
        assert!(
            seen.iter()
                .all(|&(_, _, _, room)| room >= crate::local_rpc::REPLY_INLINE),
            "R4: the buffer has room for an inline reply on entry: {seen:?}"
        );
        // R2: a reply that fits a slot (or an error, the panic's) leaves the
        // buffer's allocation with the thread: the next request gets it.
        let mut reused = 0;
        for (k, &(fill, len)) in sizes[..sizes.len() - 1].iter().enumerate() {
            if len as usize <= crate::local_rpc::REPLY_INLINE || fill == b'p' {
                assert_eq!(
                    seen[k + 1].1,
                    seen[k].2,
                    "R2: request {} did not get the buffer reply {} left",
                    k + 1,
                    k
                );
                reused += 1;
            }
        }
        assert_eq!(reused, 8);
    }

    /// H1 through the whole RPC path: a handler that blocks whenever its
    /// queue is empty, callers on three threads with one RPC in flight each.
    #[test]
    fn handler_sleeping_between_requests_loses_no_wake_up() {
        let cluster = LocalCluster::new(LocalConfig {
            handler_poll: Duration::ZERO,
            rpc_timeout: Duration::from_secs(10),
            ..LocalConfig::default()
        });
        let server = cluster.add_node(1);
        let echo = register_echo(server.services());
        let node = server.id();
        std::thread::scope(|s| {
            for t in 0..3u8 {
                let fabric = cluster.fabric();
                let me = cluster.add_node(0).id();
                s.spawn(move || {
                    let ep = fabric.endpoint(me).unwrap();
                    for i in 0..3_000u32 {
                        let req = [t, i as u8, (i >> 8) as u8];
                        let reply = block_on(ep.call(node, echo, req.to_vec()));
                        assert_eq!(reply.unwrap(), req, "thread {t}, RPC {i}");
                    }
                });
            }
        });
    }
}
