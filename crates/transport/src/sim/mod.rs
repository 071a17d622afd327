//! The `sim` backend: a whole cluster in one OS thread, in virtual time.
//!
//! A [`Simulation`] owns a discrete-event scheduler ([`sched`]), the
//! hardware model ([`net`], parameters from a [`Profile`]) and the nodes.
//! While it lives, the thread that made it runs everything: the executor's
//! `run_tasks`/`block_on` drive the simulation's events until their tasks
//! finish, `exec::sleep` and [`crate::time::Instant`] use virtual time,
//! `thread_cpu_ns` returns the virtual CPU of the simulated core that runs,
//! and background work submitted through the runtime
//! ([`crate::exec::spawn_background`], memory-node worker pools) runs on
//! simulated cores. The same seed and inputs give the same run.
//!
//! See `docs/simulation.md` for the model, its calibration and what it
//! leaves out.

pub(crate) mod cache;
mod calendar;
pub mod faults;
mod jobco;
mod jobwork;
mod lines;
pub mod net;
pub mod profile;
#[allow(unsafe_code)]
mod sched;

pub use faults::MessageDelays;
pub use jobwork::{charge_private_lines, job_progress};
pub use net::{ResourceUse, SimNode};
pub use profile::Profile;

pub(crate) use cache::{UNTAGGED, region_tag};

use crate::addr::NodeId;
use crate::backend::Fabric;
use net::{Cluster, Net, SimFabric};
pub use sched::FramesHeld;
use sched::Sched;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::Arc;
use std::task::{Context, Poll};

/// The simulation state of the thread that runs it.
pub(crate) struct Sim {
    pub(crate) sched: Sched,
    pub(crate) net: RefCell<Net>,
    pub(crate) profile: Profile,
    pub(crate) jitter_ns: u64,
    pub(crate) cluster: Arc<Cluster>,
    /// Seeded message delays (fault injection, see [`faults`]).
    pub(crate) delays: MessageDelays,
    /// Messages delayed so far.
    pub(crate) delayed: Cell<u64>,
    /// Each node's last-level cache (index: node id), made at its first
    /// touch; empty when the profile does not model it (`llc_bytes` 0).
    pub(crate) llc: RefCell<Vec<Option<cache::Llc>>>,
    /// The profile's per-size costs, kept once computed.
    pub(crate) costs: net::Costs,
    /// Regions the verbs found, while the cluster's generation holds.
    pub(crate) regions: RefCell<net::RegionCache>,
    /// Compute operations' own lines charged so far (`Endpoint::charged`):
    /// distinct lines and objects, and address-less notes; reported as
    /// `compute distinct lines` and `compute line notes`.
    pub(crate) local_lines: Cell<(u64, u64)>,
    /// The profile's instruction rate, instructions per microsecond (0: no
    /// instruction term; see [`work`]).
    pub(crate) instructions_per_us: u64,
    /// Instructions memory-node jobs declared so far ([`work`]), reported
    /// as `memnode declared instructions`.
    pub(crate) work_instructions: Cell<u64>,
    /// Each core's private cache (index: the core's number, `CoreSet`
    /// invariant 7), made at its first metered touch; empty when the
    /// profile has none (`core_cache_bytes` 0).
    pub(crate) core_caches: RefCell<Vec<Option<cache::Llc>>>,
    /// Per node: the cores whose private caches took lines of its memory
    /// (the only caches a write to it must look in), and a flag per core
    /// number for the check.
    pub(crate) core_sharers: RefCell<Vec<(Vec<u32>, Vec<bool>)>>,
    /// Per node: whether compute operations' lines of its memory go
    /// through its cache model ([`set_compute_llc`]); flat otherwise.
    pub(crate) compute_llc: RefCell<Vec<bool>>,
}

thread_local! {
    static CURRENT: RefCell<Option<Rc<Sim>>> = const { RefCell::new(None) };
    /// Nanoseconds per cache line of registered memory touched, while code
    /// runs on a simulated memory-node core (0: not metering;
    /// [`COUNT_LOCAL`]: counting a compute task's own lines instead).
    static METER_LINE_NS: Cell<u64> = const { Cell::new(0) };
    /// Lines the compute operation being polled reported without an
    /// address ([`crate::touch_local_lines`]), while `METER_LINE_NS` is
    /// [`COUNT_LOCAL`] (see [`CountLocal`]): counted as given.
    static LOCAL_LINES: Cell<u64> = const { Cell::new(0) };
    /// The distinct lines (and objects) the compute operation being polled
    /// touched by address, while `METER_LINE_NS` is [`COUNT_LOCAL`]: the
    /// operation's own set, moved in for each poll (see [`CountLocal`]).
    static LOCAL_SET: RefCell<lines::LineSet> = const { RefCell::new(lines::LineSet::new()) };
    /// Of the compute operation being polled (while `METER_LINE_NS` is
    /// [`COUNT_LOCAL`]): its distinct lines of registered memory, and what
    /// they cost through their node's cache model ([`Sim::charge_lines`];
    /// see [`CountLocal`]).
    static LOCAL_PRICED: Cell<(u64, u64)> = const { Cell::new((0, 0)) };
    /// The last compute operation that ended on this thread: (its lines,
    /// of them the lines priced through a cache model, their ns), for the
    /// charge that follows it at once ([`local_lines_ns`]).
    static LOCAL_DONE: Cell<Option<(u64, u64, u64)>> = const { Cell::new(None) };
    /// The distinct lines the memory-node job running now has touched
    /// (`Some` inside [`job_lines`]: a handler call or a worker job, see
    /// `net::on_core`); `None` outside any job, where a metered access is
    /// charged every line it spans.
    static JOB_SET: RefCell<Option<lines::LineSet>> = const { RefCell::new(None) };
    /// Instructions the memory-node job running now has declared so far
    /// ([`work`]; reset for each job by [`job_lines`], the outer job's
    /// count put back when an inner one ends): the job is charged
    /// `floor(count x 1000 / rate)` ns in all, exactly, however its work is
    /// split into declarations.
    static JOB_WORK: Cell<u64> = const { Cell::new(0) };
    /// The number of the simulated core whose job runs now (`CoreSet`
    /// invariant 7; [`NO_CORE`] outside any job), for its private cache.
    /// It counts only while a memory-node meter is on: code that runs in a
    /// nested frame a job waits in, other than the job's own tasks, runs
    /// unmetered (`OwnCoreOnly`), and is no core's.
    static RUNNING_CORE: Cell<u32> = const { Cell::new(NO_CORE) };
    /// Whether the simulation of this thread models private caches
    /// (`memnode.core_cache_bytes` > 0 with the cache model on): writes
    /// then invalidate ([`touch_write`]); when false that check is all a
    /// write costs.
    static CORE_CACHES_ON: Cell<bool> = const { Cell::new(false) };
    /// True while a [`Simulation`] drops its pending events and background
    /// tasks (it is no longer current): state dropped then may still try to
    /// answer an RPC (a handler's parked `Responder` answers on drop), and
    /// such a reply has no caller left to reach (see `net::reply_ready`).
    static TEARING_DOWN: Cell<bool> = const { Cell::new(false) };
}

/// [`RUNNING_CORE`] outside any job.
const NO_CORE: u32 = u32::MAX;

/// Runs `f`, a job that took core `core` (`net::run_job`), with `core` as
/// the running core; the previous one is back when it returns (jobs nest
/// in scheduler frames), also on a panic.
pub(crate) fn on_numbered_core<R>(core: u32, f: impl FnOnce() -> R) -> R {
    struct Restore(u32);
    impl Drop for Restore {
        fn drop(&mut self) {
            let _ = RUNNING_CORE.try_with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(RUNNING_CORE.with(|c| c.replace(core)));
    f()
}

/// Region memory `[offset, offset + len)` of the region tagged `tag` was
/// written (after its [`touch`]): by the NIC (a one-sided WRITE, CAS or
/// FAA, which run unmetered in the network's events), by a compute
/// operation, or by code on a memory-node core. Every private cache but
/// the writing core's loses the lines, so none of them prices a stale copy
/// as a private hit (docs/simulation.md, "A private cache per core (branch
/// i69)"). Without private caches in the profile it returns at its first
/// check.
///
/// The check is always inlined (it is all a write costs without private
/// caches); the invalidation is [`invalidate_written`], out of line.
#[inline(always)]
pub(crate) fn touch_write(tag: u64, offset: u64, len: u64) {
    if !CORE_CACHES_ON.with(|c| c.get()) || len == 0 || tag == UNTAGGED {
        return;
    }
    invalidate_written(tag, offset, len);
}

/// [`touch_write`] with private caches on, `len` non-zero, `tag` tagged.
#[inline(never)]
fn invalidate_written(tag: u64, offset: u64, len: u64) {
    let meter = METER_LINE_NS.with(|m| m.get());
    let writer = if meter == 0 || meter == COUNT_LOCAL {
        NO_CORE
    } else {
        RUNNING_CORE.with(|c| c.get())
    };
    CURRENT.with(|c| {
        if let Some(s) = c.borrow().as_ref() {
            s.invalidate_lines(tag, offset / 64, (offset + len - 1) / 64, writer);
        }
    });
}

/// Whether the calling thread is dropping a simulation's remaining state.
pub(crate) fn tearing_down() -> bool {
    TEARING_DOWN.with(|t| t.get())
}

/// `METER_LINE_NS` while a compute operation runs under
/// [`crate::Endpoint::charged`]: region accesses (and
/// [`crate::touch_local_lines`]) are counted in `LOCAL_LINES`, to be
/// charged to the compute thread's core when the operation ends, instead of
/// being charged to a memory-node core now.
const COUNT_LOCAL: u64 = u64::MAX;

pub(crate) fn current() -> Option<Rc<Sim>> {
    CURRENT.with(|c| c.borrow().clone())
}

/// Whether the calling thread runs a simulation.
pub fn active() -> bool {
    CURRENT.with(|c| c.borrow().is_some())
}

/// Virtual time in ns, if the calling thread runs a simulation.
pub fn now_ns() -> Option<u64> {
    CURRENT.with(|c| c.borrow().as_ref().map(|s| s.sched.now()))
}

/// Virtual CPU time of the simulated core running now.
pub(crate) fn cpu_ns() -> Option<u64> {
    CURRENT.with(|c| c.borrow().as_ref().map(|s| s.sched.cpu_ns.get()))
}

/// The per-message cost an RPC handler is charged in a simulation (0
/// elsewhere), so that the reply's `server_cpu_ns` is the modelled service
/// time.
pub fn rpc_overhead_ns() -> u64 {
    CURRENT.with(|c| {
        c.borrow()
            .as_ref()
            .map_or(0, |s| s.profile.memnode.rpc_base_ns)
    })
}

/// A random number for engine code: drawn from the simulation's seeded
/// generator under `sim` (so a seed replays exactly), from the OS elsewhere.
pub fn random_u64() -> u64 {
    CURRENT.with(|c| match c.borrow().as_ref() {
        Some(s) => s.sched.random(u64::MAX),
        None => rand::random(),
    })
}

/// A fast generator seeded by [`random_u64`].
pub fn rng() -> rand::rngs::SmallRng {
    use rand::SeedableRng;
    rand::rngs::SmallRng::seed_from_u64(random_u64())
}

/// Runs `f` with region accesses charged at `line_ns` per cache line.
pub(crate) fn with_metering<R>(line_ns: u64, f: impl FnOnce() -> R) -> R {
    let prev = METER_LINE_NS.with(|m| m.replace(line_ns));
    struct Restore(u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            METER_LINE_NS.with(|m| m.set(self.0));
        }
    }
    let _restore = Restore(prev);
    f()
}

/// Kept by a nested frame of the scheduler (`Sched::run_frame`) whose
/// blocking code runs on a metered simulated core (a message handler
/// waiting for its SSD read, `ssd_io_blocking`; a background job waiting
/// for its verbs). The tasks, jobs and events that run while it waits are
/// not that core's work: metering is on only while the frame's own tasks
/// are polled, and when the frame ends the CPU counter is put back to
/// where it was plus what those tasks used, so the core is charged for its
/// own code only (handlers that run inside the frame meter and charge
/// their own cores, `net::on_core`). Without this a handler was charged
/// every cache line the cluster touched during its wait: at 5 ScaleStore
/// nodes, update-heavy, 874 such handlers were charged 596 ms of CPU in
/// all (up to 7 ms each; the other 80,931 handlers 70 ms), and their
/// replies and cores were held back that long (docs/simulation.md,
/// ScaleStore section).
pub(crate) struct OwnCoreOnly<'a> {
    sched: &'a sched::Sched,
    line_ns: u64,
    /// The CPU counter when the frame began.
    cpu_ns: u64,
    /// CPU charged while the frame's own tasks were polled.
    own_ns: u64,
}

impl<'a> OwnCoreOnly<'a> {
    /// `None` when the caller is not metered (a compute task, the top
    /// frame): nothing to keep apart.
    pub(crate) fn enter(sched: &'a sched::Sched) -> Option<OwnCoreOnly<'a>> {
        let line_ns = METER_LINE_NS.with(|m| m.replace(0));
        (line_ns != 0).then(|| OwnCoreOnly {
            sched,
            line_ns,
            cpu_ns: sched.cpu_ns.get(),
            own_ns: 0,
        })
    }

    /// Runs `poll` (a poll of the frame's own tasks) metered, if the frame
    /// is metered at all.
    pub(crate) fn poll_own<R>(own: &mut Option<Self>, poll: impl FnOnce() -> R) -> R {
        let Some(o) = own.as_mut() else {
            return poll();
        };
        let before = o.sched.cpu_ns.get();
        METER_LINE_NS.with(|m| m.set(o.line_ns));
        let r = poll();
        METER_LINE_NS.with(|m| m.set(0));
        o.own_ns += o.sched.cpu_ns.get().wrapping_sub(before);
        r
    }
}

impl Drop for OwnCoreOnly<'_> {
    fn drop(&mut self) {
        self.sched.cpu_ns.set(self.cpu_ns + self.own_ns);
        METER_LINE_NS.with(|m| m.set(self.line_ns));
    }
}

/// Whether [`touch`] does anything on this thread now (a memory-node core's
/// metering or a compute operation's line count is on). For code that
/// touches several accesses in a row with nothing in between that could
/// switch either on or off (a `local` batch's reads): it reads this once
/// and skips `touch`, which would return at its first check, while false.
#[inline]
pub(crate) fn lines_metered() -> bool {
    METER_LINE_NS.with(|m| m.get()) != 0
}

/// Region memory `[offset, offset + len)` of the region tagged `tag`, whose
/// memory starts at byte address `base` (64-byte aligned), was touched by
/// code on the calling thread: charged when a simulated core is metering
/// (see [`Sim::charge_lines`]), or added to the distinct lines of the
/// compute operation being counted ([`CountLocal`]).
///
/// Split in two: this check, always inlined (off `sim`, and on `sim` while
/// no core meters, a touch is one thread-local load and a branch, no call:
/// every region access makes one), and [`touch_metered`], out of line.
#[inline(always)]
pub(crate) fn touch(tag: u64, base: u64, offset: u64, len: u64) {
    let line_ns = METER_LINE_NS.with(|m| m.get());
    if line_ns == 0 || len == 0 {
        return;
    }
    touch_metered(line_ns, tag, base, offset, len);
}

/// [`touch`] while metering (`line_ns` non-zero) and `len` non-zero.
#[inline(never)]
fn touch_metered(line_ns: u64, tag: u64, base: u64, offset: u64, len: u64) {
    if line_ns == COUNT_LOCAL {
        // A compute operation's own memory: the lines of the access, by
        // their real address, into the operation's set of distinct lines
        // (docs/simulation.md, "Distinct lines per operation"). On a node
        // declared with `set_compute_llc`, each new line is also priced
        // through the cache model of the node the region lives on (its
        // LLC, which its handler cores' lines go through too).
        let (first, last) = (offset / 64, (offset + len - 1) / 64);
        let priced = CURRENT.with(|c| {
            let c = c.borrow();
            let s = c.as_ref()?;
            if tag == UNTAGGED || !s.compute_llc(cache::split_tag(tag).0) {
                return None;
            }
            LOCAL_SET.with(|set| {
                let mut set = set.borrow_mut();
                let before = set.distinct();
                let flat = s.profile.memnode.line_ns;
                let cost = s.charge_lines(tag, first, last, flat, Some(&mut set), base / 64, false);
                Some((set.distinct() - before, cost))
            })
        });
        match priced {
            Some((new, cost)) => LOCAL_PRICED.with(|p| {
                let (l, ns) = p.get();
                p.set((l + new, ns + cost));
            }),
            None => LOCAL_SET.with(|s| {
                s.borrow_mut()
                    .insert_lines(base / 64 + first, base / 64 + last)
            }),
        }
        return;
    }
    let (first, last) = (offset / 64, (offset + len - 1) / 64);
    CURRENT.with(|c| {
        if let Some(s) = c.borrow().as_ref() {
            // The job's own lines, by real address (region memory is 64-byte
            // aligned: `base / 64 + line` is the line's address / 64).
            let cost = JOB_SET.with(|j| {
                s.charge_lines(
                    tag,
                    first,
                    last,
                    line_ns,
                    j.borrow_mut().as_mut(),
                    base / 64,
                    true,
                )
            });
            s.sched.cpu_ns.set(s.sched.cpu_ns.get() + cost);
        }
    });
}

/// Runs `f` as one memory-node job for the distinct-lines rule
/// (docs/simulation.md, "Distinct lines for memory-node jobs (branch
/// i46)"): the lines of registered memory it touches while metered are
/// charged at their first touch in `f` only.
///
/// Invariants:
/// 1. A job's set starts empty and holds only lines the job touched while
///    metered; a re-touch of one of them is free and does not go through
///    the node's cache model (it hits L1).
/// 2. Jobs never share a set: a job started inside another (a handler run
///    by an event in a nested scheduler frame the outer job waits in, a
///    job's progress wait) gets a fresh one, and the outer job's set is
///    back in place, unchanged, when the inner one ends (also on a panic).
/// 3. [`restart_job_lines`] empties the set of the job that runs (a
///    worker's progress point: the lines it touches after it are charged
///    again).
/// 4. Steady state allocates nothing: the set's table comes from the
///    per-thread pool of `lines` and goes back to it cleared when `f` ends.
///
/// The job's declared instructions ([`work`]) follow the same nesting: a
/// job's count starts at 0 and the outer job's count is back in place when
/// an inner job ends.
pub(crate) fn job_lines<R>(f: impl FnOnce() -> R) -> R {
    struct Restore(Option<lines::LineSet>, u64);
    impl Drop for Restore {
        fn drop(&mut self) {
            let outer = self.0.take();
            // The job's own set goes back to the pool (its `Drop`).
            let _ = JOB_SET.try_with(|j| drop(j.replace(outer)));
            let _ = JOB_WORK.try_with(|w| w.set(self.1));
        }
    }
    let _restore = Restore(
        JOB_SET.with(|j| j.replace(Some(lines::LineSet::new()))),
        JOB_WORK.with(|w| w.replace(0)),
    );
    f()
}

/// Declares `instructions` of work done by the memory-node code that runs
/// now (an RPC handler, a worker job): under `sim`, on a metered
/// memory-node core, it costs `instructions / (cpu_ghz x ipc)` ns of that
/// core's time, on top of the per-message (`rpc_base_ns`) or per-job
/// (`job_base_ns`) cost and the lines the code touches (docs/simulation.md,
/// "An instruction term for memory-node jobs (branch i49)").
///
/// Invariants:
/// 1. Off `sim`, outside a metered memory-node core (compute tasks, the
///    network's events, code waiting in a nested frame that is not the
///    core's own), inside a compute operation counted by
///    `Endpoint::charged`, or with a profile without an instruction term
///    (`cpu_ghz` = `ipc` = 0), it returns at its first check and costs
///    nothing: the compute side's CPU keeps its own model.
/// 2. A job declaring `n1, n2, ...` is charged `floor((n1 + n2 + ...) x
///    1000 / rate)` ns in all (`rate`: the profile's
///    [`instructions_per_us`](profile::MemnodeProfile::instructions_per_us)),
///    charged as declared (so a progress point passes what was declared
///    before it): how the work is split into declarations never changes
///    the total.
/// 3. Jobs nest as for lines ([`job_lines`]): an inner job's declarations
///    are its own and leave the outer job's count as they found it.
#[inline]
pub fn work(instructions: u64) {
    let meter = METER_LINE_NS.with(|m| m.get());
    if meter == 0 || meter == COUNT_LOCAL || instructions == 0 {
        return;
    }
    CURRENT.with(|c| {
        let c = c.borrow();
        let Some(s) = c.as_ref() else { return };
        let rate = s.instructions_per_us;
        if rate == 0 {
            return;
        }
        let before = JOB_WORK.with(|w| w.get());
        let after = before.saturating_add(instructions);
        JOB_WORK.with(|w| w.set(after));
        let cost = after.saturating_mul(1000) / rate - before.saturating_mul(1000) / rate;
        s.sched.cpu_ns.set(s.sched.cpu_ns.get() + cost);
        s.work_instructions
            .set(s.work_instructions.get().saturating_add(instructions));
    });
}

/// Empties the set of distinct lines of the memory-node job that runs now
/// (nothing outside a job): called at a worker's progress point
/// ([`job_progress`]), after which the job is a new slice of work.
pub(crate) fn restart_job_lines() {
    JOB_SET.with(|j| {
        if let Some(set) = j.borrow_mut().as_mut() {
            set.release();
        }
    });
}

/// Runs `f` (a nested scheduler frame) with a compute operation's line
/// counting switched off: the events and other tasks the frame runs are not
/// that operation's work. Memory-node metering is left as it is.
pub(crate) fn without_local_count<R>(f: impl FnOnce() -> R) -> R {
    if METER_LINE_NS.with(|m| m.get()) == COUNT_LOCAL {
        with_metering(0, f)
    } else {
        f()
    }
}

/// `lines` cache lines of compute-node memory that no region access
/// reports were touched (see [`crate::touch_local_lines`]): counted only
/// while a compute operation is counted ([`CountLocal`]), as given (no
/// address, so no deduplication).
#[inline]
pub(crate) fn touch_local(lines: u64) {
    if METER_LINE_NS.with(|m| m.get()) == COUNT_LOCAL {
        LOCAL_LINES.with(|l| l.set(l.get() + lines));
    }
}

/// The object at byte address `addr` of compute-node memory was touched
/// (see [`crate::touch_local_at`]): one distinct key of the operation being
/// counted ([`CountLocal`]), however often it is touched.
#[inline]
pub(crate) fn touch_local_object(addr: u64) {
    if METER_LINE_NS.with(|m| m.get()) == COUNT_LOCAL {
        LOCAL_SET.with(|s| s.borrow_mut().insert_object(addr));
    }
}

/// Polls `fut` with the lines it touches in its own node's memory counted
/// (region accesses and [`touch_local_object`] by distinct line or object,
/// [`touch_local`] notes as given).
///
/// Invariants (docs/simulation.md, "Compute CPU" and "Distinct lines per
/// operation"):
/// 1. Counting is on for one poll of `fut` at a time, and each poll
///    restores the mode, count and set it found: tasks that interleave with
///    this one at its awaits are never counted here. The operation's set of
///    distinct lines lives here between polls, so a line it touched before
///    an await and again after is still one line.
/// 2. Memory-node code replaces the mode with its own metering
///    (`with_metering`) and nested scheduler frames switch counting off
///    (`Sched::run_frame`): neither is charged to the compute thread.
/// 3. Outside a simulation nothing sets the mode, so `touch`,
///    [`touch_local`] and [`touch_local_object`] return at their first
///    check.
pub(crate) struct CountLocal<F> {
    fut: F,
    /// Lines reported without an address.
    notes: u64,
    /// Of its distinct lines, those of registered memory, and their cost
    /// through their node's cache model (`touch`).
    priced: (u64, u64),
    set: lines::LineSet,
}

/// What the compute operation that just ended on this thread costs, if it
/// reported `lines` lines: `lines x line_ns`, except that its lines of
/// registered memory cost what their node's cache model priced them at
/// (`touch`, [`Sim::charge_lines`]: a hit `line_ns`, a miss on an
/// access's first line `dram_miss_ns`). Invariant: [`CountLocal`] records
/// an operation's prices when it ends, and the endpoint's `charged` charges
/// them at once, on the same thread with no await in between; a record
/// whose line count does not match is not this charge's and prices flat.
pub(crate) fn local_lines_ns(lines: u64, line_ns: u64) -> u64 {
    match LOCAL_DONE.with(|d| d.take()) {
        Some((n, priced, ns)) if n == lines && priced <= n => (n - priced) * line_ns + ns,
        _ => lines * line_ns,
    }
}

impl<F> CountLocal<F> {
    pub(crate) fn new(fut: F) -> CountLocal<F> {
        CountLocal {
            fut,
            notes: 0,
            priced: (0, 0),
            set: lines::LineSet::new(),
        }
    }
}

impl<F: Future + Unpin> Future for CountLocal<F> {
    /// The future's output and the lines it touched (distinct lines and
    /// objects, plus the notes).
    type Output = (F::Output, u64);
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<(F::Output, u64)> {
        struct Restore {
            meter: u64,
            lines: u64,
            priced: (u64, u64),
            set: lines::LineSet,
        }
        impl Drop for Restore {
            fn drop(&mut self) {
                METER_LINE_NS.with(|m| m.set(self.meter));
                LOCAL_LINES.with(|l| l.set(self.lines));
                LOCAL_PRICED.with(|p| p.set(self.priced));
                let outer = std::mem::take(&mut self.set);
                // (If a poll panicked, the operation's set is still in
                // the slot: dropping it returns its table to the pool.)
                LOCAL_SET.with(|s| drop(s.replace(outer)));
            }
        }
        let own = std::mem::take(&mut self.set);
        let restore = Restore {
            meter: METER_LINE_NS.with(|m| m.replace(COUNT_LOCAL)),
            lines: LOCAL_LINES.with(|l| l.replace(0)),
            priced: LOCAL_PRICED.with(|p| p.replace(self.priced)),
            set: LOCAL_SET.with(|s| s.replace(own)),
        };
        let r = Pin::new(&mut self.fut).poll(cx);
        self.notes += LOCAL_LINES.with(|l| l.get());
        self.priced = LOCAL_PRICED.with(|p| p.get());
        self.set = LOCAL_SET.with(|s| s.take());
        drop(restore);
        match r {
            Poll::Ready(out) => {
                let distinct = self.set.distinct();
                self.set.release();
                if let Some(sim) = current() {
                    let (d, n) = sim.local_lines.get();
                    sim.local_lines.set((d + distinct, n + self.notes));
                }
                let (priced, ns) = self.priced;
                LOCAL_DONE.with(|d| d.set(Some((distinct + self.notes, priced, ns))));
                Poll::Ready((out, distinct + self.notes))
            }
            Poll::Pending => Poll::Pending,
        }
    }
}

impl Sim {
    /// The CPU cost of one access (one `touch`) to lines `first..=last` of
    /// the region tagged `tag`, and its effect on the node's cache.
    ///
    /// The rule (docs/simulation.md, "Memory-node CPU" and "Distinct lines
    /// for memory-node jobs (branch i46)"): inside a job (`seen`, the job's
    /// set of distinct lines, keyed by `base_line + line`), a line the job
    /// already touched costs nothing and does not go through the cache
    /// model (it is in L1). Every other line goes through the node's LLC
    /// model; a line that hits costs `line_ns`; the FIRST line of the
    /// access, if it is new and misses, costs `dram_miss_ns` (the access
    /// cannot start before its address is known, so a pointer chase pays
    /// the full DRAM latency at every step); the further new lines of the
    /// access cost `line_ns` whether they hit or miss (their addresses are
    /// known together with the first's, so their misses overlap with it and
    /// with each other: `line_ns` is the one-core rate of such independent
    /// misses), also when the first line was the job's already (a node's
    /// header word read, then the node: the rest of the node's address was
    /// known with the header's). So, from the same cache state, a job is
    /// never charged more than the per-access rule of earlier versions
    /// charged it. Without an LLC in
    /// the profile, or for memory no backend registered, every new line
    /// costs `line_ns` (the flat model). Outside a job (`seen` None) every
    /// line of the access is new.
    ///
    /// With private caches (`core_cache_bytes`, branch i69) and a running
    /// core, a new line is looked up in that core's cache first: a hit
    /// costs `core_cache_hit_ns` and goes no further; a miss fills the
    /// core's cache (with the pair prefetcher's buddy, if on) and then goes
    /// through the LLC as above, the dependent-miss rule unchanged. Writes
    /// keep the private caches coherent ([`touch_write`]).
    ///
    /// A compute operation's lines (`core_cache` false: the compute
    /// threads' private caches are not modelled) go through the LLC only.
    #[allow(clippy::too_many_arguments)]
    fn charge_lines(
        &self,
        tag: u64,
        first: u64,
        last: u64,
        line_ns: u64,
        mut seen: Option<&mut lines::LineSet>,
        base_line: u64,
        core_cache: bool,
    ) -> u64 {
        let mut is_new = |line: u64| {
            seen.as_mut()
                .is_none_or(|s| s.insert_line(base_line + line))
        };
        let m = &self.profile.memnode;
        if m.llc_bytes == 0 || tag == UNTAGGED {
            return (first..=last).filter(|&l| is_new(l)).count() as u64 * line_ns;
        }
        let (node, region) = cache::split_tag(tag);
        let mut caches = self.llc.borrow_mut();
        let node = node as usize;
        if caches.len() <= node {
            caches.resize_with(node + 1, || None);
        }
        let llc =
            caches[node].get_or_insert_with(|| cache::Llc::new(m.llc_bytes, m.llc_ways as usize));
        // The running core's private cache, if the profile models one.
        let core = if m.core_cache_bytes > 0 && core_cache {
            RUNNING_CORE.with(|c| c.get())
        } else {
            NO_CORE
        };
        let mut cores = (core != NO_CORE).then(|| {
            self.note_sharer(node, core);
            self.core_caches.borrow_mut()
        });
        let mut private = cores.as_mut().map(|v| {
            let i = core as usize;
            if v.len() <= i {
                v.resize_with(i + 1, || None);
            }
            v[i].get_or_insert_with(|| {
                cache::Llc::new(m.core_cache_bytes, m.core_cache_ways as usize)
            })
        });
        let mut cost = 0;
        for line in first..=last {
            if !is_new(line) {
                continue;
            }
            if let Some(p) = private.as_mut() {
                // Core cache first: a hit costs its latency and the LLC
                // never sees it (it does not refresh the line's LRU
                // place there, as on the hardware).
                if p.access(cache::core_line_key(tag, line)) {
                    cost += m.core_cache_hit_ns;
                    continue;
                }
                if m.pair_prefetch {
                    // The L2 spatial prefetcher completes the pair in L2.
                    p.prefetch(cache::core_line_key(tag, line ^ 1));
                }
            }
            let hit = llc.access(cache::line_key(region, line));
            if !hit && m.pair_prefetch {
                // The L2 adjacent-line prefetcher completes the miss's
                // 128-byte-aligned pair (by line number within the region:
                // regions are taken as 128-byte aligned, which the large
                // ones are, being page aligned). Free for this access; a
                // later touch of the buddy hits.
                llc.prefetch(cache::line_key(region, line ^ 1));
            }
            cost += if !hit && line == first {
                llc.dependent_misses += 1;
                m.dram_miss_ns
            } else {
                line_ns
            };
        }
        cost
    }
}

impl Sim {
    /// Whether compute operations' lines of node `node`'s memory go
    /// through its cache model ([`set_compute_llc`]).
    #[inline]
    fn compute_llc(&self, node: u16) -> bool {
        self.compute_llc
            .borrow()
            .get(node as usize)
            .copied()
            .unwrap_or(false)
    }

    /// Records that core `core`'s private cache takes lines of node
    /// `node`'s memory (so writes to it look there).
    fn note_sharer(&self, node: usize, core: u32) {
        let mut sharers = self.core_sharers.borrow_mut();
        if sharers.len() <= node {
            sharers.resize_with(node + 1, Default::default);
        }
        let (list, flag) = &mut sharers[node];
        let i = core as usize;
        if flag.len() <= i {
            flag.resize(i + 1, false);
        }
        if !flag[i] {
            flag[i] = true;
            list.push(core);
        }
    }

    /// Removes lines `first..=last` of the region tagged `tag` from every
    /// private cache that may hold them but `writer`'s ([`touch_write`]).
    fn invalidate_lines(&self, tag: u64, first: u64, last: u64, writer: u32) {
        let (node, _) = cache::split_tag(tag);
        let sharers = self.core_sharers.borrow();
        let Some((list, _)) = sharers.get(node as usize) else {
            return;
        };
        let mut caches = self.core_caches.borrow_mut();
        for &core in list {
            if core == writer {
                continue;
            }
            if let Some(Some(c)) = caches.get_mut(core as usize) {
                for line in first..=last {
                    c.invalidate(cache::core_line_key(tag, line));
                }
            }
        }
    }
}

/// Adds a background task to the running simulation; gives the task back
/// if the calling thread runs none.
pub(crate) fn spawn_background(
    fut: Pin<Box<dyn Future<Output = ()>>>,
) -> Result<usize, Pin<Box<dyn Future<Output = ()>>>> {
    match current() {
        Some(sim) => Ok(sim.sched.spawn_background(fut)),
        None => Err(fut),
    }
}

pub(crate) fn background_done(index: usize) -> bool {
    current().is_none_or(|s| s.sched.background_done(index))
}

/// Runs `tasks` in the simulation of the calling thread, if it has one.
pub(crate) fn run_tasks<'a, T>(
    tasks: Vec<crate::exec::LocalTask<'a, T>>,
) -> Result<Vec<T>, Vec<crate::exec::LocalTask<'a, T>>> {
    match current() {
        // Inside a worker job the wait suspends the job (`jobco`), except
        // while the scheduler waits on the network alone (jobco invariant 3).
        Some(sim) if jobco::in_job() && !sim.sched.holding_jobs() => Ok(jobco::wait_in_job(tasks)),
        Some(sim) => Ok(sim.sched.run_tasks(&sim, tasks)),
        None => Err(tasks),
    }
}

/// Runs `task` in the simulation of the calling thread, if it has one,
/// polling no other task while it waits (see `Sched::run_alone`).
pub(crate) fn run_alone<'a, T>(
    task: crate::exec::LocalTask<'a, T>,
) -> Result<T, crate::exec::LocalTask<'a, T>> {
    match current() {
        Some(sim) => Ok(sim.sched.run_alone(&sim, task)),
        None => Err(task),
    }
}

/// Completes at virtual time `at` (what `exec::sleep` waits on under
/// `sim`, and the backend's `OpFuture::SimSleep`, a CPU charge). Its wake
/// is scheduled once per waker (`Armed`).
pub struct SleepUntil {
    at: u64,
    armed: Armed,
}

pub(crate) fn sleep_until_ns(at: u64) -> SleepUntil {
    SleepUntil {
        at,
        armed: Armed::NONE,
    }
}

impl Future for SleepUntil {
    type Output = ();
    /// Ready once `at` has come (or outside a simulation); else pending,
    /// and unless `armed` says this task's wake is already scheduled for
    /// `at`, it is scheduled now and `armed` records it.
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = self.get_mut();
        // The simulation borrowed, not cloned (branch i50).
        CURRENT.with(|c| {
            let c = c.borrow();
            let Some(sim) = c.as_ref() else {
                return Poll::Ready(());
            };
            if sim.sched.now() >= this.at {
                return Poll::Ready(());
            }
            let me = Armed::of(cx.waker());
            if this.armed != me {
                // First poll, or another task's waker (the wait moved): its
                // own wake. A wake scheduled for an earlier waker still fires
                // (harmless: a spurious poll).
                sim.sched.wake_at(this.at, cx.waker().clone());
                this.armed = me;
            }
            Poll::Pending
        })
    }
}

/// Which waker a pending wait until a virtual instant has scheduled its
/// wake for: that waker's identity (its data and vtable addresses, what
/// [`Waker::will_wake`] compares), not a clone of it, or none yet.
///
/// A wait is armed once per waker: a task woken for something else (a
/// wait inside a `select`, the livelock limit racing an operation) polls it
/// again, and before this it scheduled another wake each time. Those wakes
/// piled up in the event queue until their instant (an operation spinning
/// for millions of round trips under `--op-limit-ms` left one pending
/// event per poll, about 1 KB of queue per round trip, a seed at 10.5 GB)
/// and each drew a tie from the scheduler's generator, so waits that were
/// only polled more often changed every later tie. The wake scheduled first still fires, at
/// the same instant, for the same task.
#[derive(Clone, Copy, PartialEq, Eq)]
struct Armed {
    data: usize,
    vtable: usize,
}

impl Armed {
    /// Not armed (no vtable lives at address 0).
    const NONE: Armed = Armed { data: 0, vtable: 0 };

    fn of(w: &std::task::Waker) -> Armed {
        Armed {
            data: w.data() as usize,
            vtable: std::ptr::from_ref(w.vtable()) as usize,
        }
    }
}

/// A task's livelock watchdog under `sim` (what [`crate::exec::OpLimit`]
/// runs on): each of the task's operations, one at a time, must end
/// within `limit_ns` of virtual time.
///
/// Invariants:
/// 1. At most one check is pending per watchdog (`checking`), whatever the
///    number of operations and polls: the per-operation timer it replaces
///    left one pending event per operation until its instant, and one per
///    poll before waits were armed once ([`Armed`]).
/// 2. The checks are quiet events ([`sched::Sched::quiet_at`]): they draw
///    no tie and are not counted, and a check wakes the task only once the
///    current operation's deadline has passed. So the limit changes nothing
///    in a run where no operation reaches it (a seed's run is the same
///    under any `--op-limit-ms`; before, each limit gave another run).
/// 3. A pending check is due no later than the current operation's
///    deadline: deadlines only grow (each operation begins after the last
///    ended), so a check scheduled for an earlier operation comes first
///    and, finding a later deadline, schedules the next for it.
pub(crate) struct Watch {
    limit_ns: u64,
    /// The current operation's deadline; `u64::MAX` between operations.
    deadline: Cell<u64>,
    /// The task to wake when the deadline passes (its latest poll's).
    waker: RefCell<Option<std::task::Waker>>,
    checking: Cell<bool>,
}

impl Watch {
    pub(crate) fn new(limit_ns: u64) -> Rc<Watch> {
        Rc::new(Watch {
            limit_ns,
            deadline: Cell::new(u64::MAX),
            waker: RefCell::new(None),
            checking: Cell::new(false),
        })
    }

    /// An operation begins now: its deadline is `limit_ns` from now.
    pub(crate) fn begin(self: &Rc<Watch>) {
        let Some(sim) = current() else { return };
        let deadline = sim.sched.now().saturating_add(self.limit_ns);
        self.deadline.set(deadline);
        if !self.checking.get() {
            Watch::check_at(self.clone(), &sim, deadline);
        }
    }

    /// Whether the current operation's deadline has passed; if not, the
    /// polling task is the one a check wakes.
    pub(crate) fn expired(&self, cx: &Context<'_>) -> bool {
        let now = now_ns().unwrap_or(0);
        if now >= self.deadline.get() {
            return true;
        }
        let mut w = self.waker.borrow_mut();
        if !w.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
            *w = Some(cx.waker().clone());
        }
        false
    }

    /// The current operation ended (or was given up).
    pub(crate) fn end(&self) {
        self.deadline.set(u64::MAX);
        self.waker.borrow_mut().take();
    }

    fn check_at(watch: Rc<Watch>, sim: &Sim, at: u64) {
        watch.checking.set(true);
        sim.sched.quiet_at(at, move || watch.check());
    }

    /// A check's instant came: wake the task if its operation's deadline
    /// passed, else check again at that deadline (none between
    /// operations).
    fn check(self: Rc<Watch>) {
        self.checking.set(false);
        let Some(sim) = current() else { return };
        let deadline = self.deadline.get();
        if deadline == u64::MAX {
            return;
        }
        if sim.sched.now() >= deadline {
            if let Some(w) = self.waker.borrow_mut().take() {
                w.wake();
            }
        } else {
            Watch::check_at(self, &sim, deadline);
        }
    }
}

/// Virtual CPU of work done on a simulated background core: `f` runs now,
/// metered. Returns its whole cost (plus the per-job base), what of it is
/// still to pass on the job's core when `f` returns (less what
/// [`job_progress`] already passed), and what progress passed on the job's
/// own core (see `jobwork`).
pub(crate) fn metered_job_cost(f: impl FnOnce()) -> (u64, u64, u64) {
    match current() {
        Some(sim) => {
            let base = sim.profile.memnode.job_base_ns;
            let (((), cpu), m) = jobwork::metered(&sim, || net::on_core(&sim, f));
            let own = cpu - m.excluded + base;
            (own, own - m.spent_own - m.spent_shared, m.spent_own)
        }
        None => {
            f();
            (0, 0, 0)
        }
    }
}

/// A set of simulated cores with one FIFO queue, for background workers
/// (a memory node's worker pool).
#[derive(Clone, Copy, Debug)]
pub struct SimCores {
    id: usize,
}

impl SimCores {
    /// `cores` new cores named `name` in the calling thread's simulation.
    pub fn new(name: &str, cores: usize) -> Option<SimCores> {
        let sim = current()?;
        let id = sim
            .net
            .borrow_mut()
            .add_coreset(name.to_string(), cores.max(1));
        Some(SimCores { id })
    }

    /// Runs `job` on one of these cores as soon as one is free; `done` gets
    /// the job's virtual CPU time when it ran.
    pub fn submit(&self, job: Box<dyn FnOnce()>, done: Box<dyn FnOnce(u64)>) {
        let sim = current().expect("SimCores used outside its simulation's thread");
        let now = sim.sched.now();
        let id = self.id;
        net::submit_job(
            &sim,
            id,
            now,
            Box::new(move || {
                let body: Box<dyn FnOnce() -> u64> = Box::new(move || {
                    let (cost, left, spent_here) = metered_job_cost(job);
                    // The part passed at progress points held this core too.
                    if let Some(sim) = current() {
                        net::add_busy(&mut sim.net.borrow_mut(), id, spent_here);
                    }
                    done(cost);
                    left
                });
                // A job that waits suspends and releases its core itself
                // when it ends (`jobco`). The simulation is looked up, not
                // captured: a queued job holding it would be a cycle.
                let core = RUNNING_CORE.with(|c| c.get());
                let release = Box::new(move |left| {
                    if let Some(sim) = current() {
                        net::release_core(&sim, id, core, left);
                    }
                });
                match current() {
                    Some(sim) => jobco::run(&sim, body, release).unwrap_or(net::SUSPENDED),
                    None => body(),
                }
            }),
        );
    }
}

/// Submits `count` I/Os together to `node`'s SSD; the virtual instant the
/// last completes, or None outside a simulation.
fn ssd_batch_done(node: NodeId, write: bool, count: usize) -> Option<u64> {
    let sim = current()?;
    (0..count.max(1))
        .map(|_| net::ssd_io(&sim, node, write))
        .max()
}

/// Waits for `count` I/Os submitted together to `node`'s SSD (ScaleStore's
/// page reads and writes): the device serves `kiops` thousand operations
/// per second, each taking the profile's read or write latency; returns
/// when the last completes, in virtual time under `sim`; at once elsewhere
/// (the real I/O is the caller's). For
/// background activities (ScaleStore's page provider) that must not hold a
/// nested frame of the scheduler while they wait.
pub async fn ssd_io_batch(node: NodeId, write: bool, count: usize) {
    if let Some(done) = ssd_batch_done(node, write, count) {
        sleep_until_ns(done).await
    }
}

/// Submits `count` I/Os together to `node`'s SSD now and returns the
/// virtual instant (nanoseconds, as [`crate::time::Instant::as_nanos`]) the
/// last completes; None outside a simulation. For code that must not wait
/// where it issues the I/O (ScaleStore reads a page under the page's entry
/// mutex, which a job of another node on this one OS thread may want): it
/// waits for the instant later, with [`crate::exec::sleep_until`], once it
/// holds no lock.
pub fn ssd_io_submit(node: NodeId, write: bool, count: usize) -> Option<u64> {
    ssd_batch_done(node, write, count)
}

/// [`ssd_io_batch`] waited for synchronously (a worker's or handler's own
/// I/O): under `sim` a nested frame until the last I/O completes. (Not
/// [`crate::exec::block_on_network`]: that would hold every memory-node
/// job of the cluster back for a whole SSD access.)
pub fn ssd_io_blocking(node: NodeId, write: bool, count: usize) {
    if let Some(done) = ssd_batch_done(node, write, count) {
        crate::exec::block_on(sleep_until_ns(done));
    }
}

/// Posts a one-sided write of `data` to `addr` from node `from` without
/// waiting for it (None outside a simulation): for code that must not wait
/// where it writes, because it holds a lock that another node's code on
/// this one OS thread may want (ScaleStore's message handler delivers a
/// page under the page's entry mutex, and §3.5 of its paper posts that
/// write asynchronously). The bytes are placed at once; the NICs and the
/// wire carry it in the model (so a message the poster sends afterwards to
/// the same node queues behind it, as on a reliable-connection queue
/// pair), and the result is the virtual instant its completion would be
/// back, for a caller that wants to wait for it later.
/// ([`crate::exec::block_on_network`] would hold every task and job of the
/// cluster back for the whole round trip.)
pub fn write_posted(
    from: NodeId,
    addr: crate::addr::RemoteAddr,
    data: &[u8],
) -> Option<crate::error::Result<u64>> {
    let sim = current()?;
    Some(net::write_posted(&sim, from, &addr, data))
}

/// Declares that requests to `service` on `node` are written into
/// mailboxes, as ScaleStore's artifact's workers write them
/// (`backend/scalestore/threads/Worker.hpp`, `Worker::writeMsg`: an RDMA
/// WRITE of the message into the handler's payload slot, then a second
/// RDMA WRITE of a one-byte flag into its mailbox, each its own
/// `ibv_post_send`): from now on every RPC to it is two messages through
/// the NICs and the wire, each with its headers and its NIC message time,
/// the payload first and then the flag, and two posted verbs on the
/// caller's core; the handler takes the request when the flag is through
/// its NIC. Replies are unchanged (one message: the artifact's handler
/// answers with one WRITE whose flag is in its payload). Returns false
/// outside a simulation or for a node the simulation does not have. On
/// the real backends there is nothing to declare (their RPCs are what
/// they are).
pub fn set_mailbox_requests(node: NodeId, service: crate::addr::ServiceId) -> bool {
    let Some(sim) = current() else {
        return false;
    };
    net::set_mailbox_requests(&mut sim.net.borrow_mut(), node, service)
}

/// Declares that compute operations (`Endpoint::charged`) touching node
/// `node`'s registered memory are priced through that node's cache model,
/// as its memory-node handlers' accesses are ([`Sim::charge_lines`]): each
/// distinct line of the operation is looked up in the node's LLC (no
/// private cache is modelled for compute threads); a hit costs `line_ns`,
/// a miss on the first line of an access `dram_miss_ns` (a B-tree walk's
/// probes are dependent), a further line of the same access `line_ns`; the
/// lines fill the LLC (with the pair prefetcher's buddy, if on) that the
/// node's handler cores share. Without it (the default) such lines cost
/// `line_ns` each, flat. For a design whose workers walk a structure in
/// the same machine's memory as its handlers (ScaleStore's symmetric
/// nodes), so that a working set beyond the LLC (the paper's, with
/// `--llc-keys`) misses it. Returns false outside a simulation, or
/// without an LLC in the profile (then nothing changes). Nothing to do on
/// the real backends.
pub fn set_compute_llc(node: NodeId) -> bool {
    let Some(sim) = current() else {
        return false;
    };
    if sim.profile.memnode.llc_bytes == 0 {
        return false;
    }
    let mut v = sim.compute_llc.borrow_mut();
    let i = node.0 as usize;
    if v.len() <= i {
        v.resize(i + 1, false);
    }
    v[i] = true;
    true
}

/// How to build a simulation.
#[derive(Debug, Clone)]
pub struct SimConfig {
    pub profile: Profile,
    /// Seeds every choice: ties between simultaneous events, jitter, faults.
    pub seed: u64,
    /// Each message's wire latency gets a seeded random extra of up to this.
    pub jitter_ns: u64,
    /// Seeded large delays on chosen messages (fault injection).
    pub delays: MessageDelays,
}

/// A simulated cluster, run by the thread that made it (it is entered on
/// that thread until dropped). The handle itself may be shared with other
/// threads (it is `Sync`, as deployments are), but using the simulation
/// anywhere but on its own thread panics.
pub struct Simulation {
    cluster: Arc<Cluster>,
    thread: std::thread::ThreadId,
}

impl Simulation {
    /// Makes a simulation and enters it on the calling thread.
    ///
    /// # Panics
    /// If the thread already runs one.
    pub fn new(cfg: SimConfig) -> Simulation {
        let cluster = Cluster::new();
        let instructions_per_us = cfg.profile.memnode.instructions_per_us();
        let sim = Rc::new(Sim {
            sched: Sched::new(cfg.seed),
            net: RefCell::new(Net::default()),
            profile: cfg.profile,
            jitter_ns: cfg.jitter_ns,
            cluster: cluster.clone(),
            delays: cfg.delays,
            delayed: Cell::new(0),
            llc: RefCell::new(Vec::new()),
            costs: net::Costs::new(),
            regions: RefCell::new(net::RegionCache::default()),
            local_lines: Cell::new((0, 0)),
            instructions_per_us,
            work_instructions: Cell::new(0),
            core_caches: RefCell::new(Vec::new()),
            core_sharers: RefCell::new(Vec::new()),
            compute_llc: RefCell::new(Vec::new()),
        });
        let m = &sim.profile.memnode;
        let core_caches = m.core_cache_bytes > 0 && m.llc_bytes > 0;
        CURRENT.with(|c| {
            let mut c = c.borrow_mut();
            assert!(c.is_none(), "this thread already runs a simulation");
            *c = Some(sim);
        });
        CORE_CACHES_ON.with(|c| c.set(core_caches));
        Simulation {
            cluster,
            thread: std::thread::current().id(),
        }
    }

    /// This simulation's state; it must be the calling thread's.
    fn sim(&self) -> Rc<Sim> {
        let sim = current().expect("a simulation is used on the thread that runs it");
        assert!(
            Arc::ptr_eq(&sim.cluster, &self.cluster),
            "a simulation is used on the thread that runs it"
        );
        sim
    }

    /// Adds a node with `handler_threads` simulated handler cores (0 for a
    /// node that only issues).
    pub fn add_node(&self, handler_threads: usize) -> Arc<SimNode> {
        self.cluster.add_node(&self.sim(), handler_threads)
    }

    pub fn fabric(&self) -> Arc<dyn Fabric> {
        Arc::new(SimFabric {
            cluster: self.cluster.clone(),
        })
    }

    /// Crashes `node` at virtual time `at_ns` (now if already past): its
    /// memory is gone, queued and later requests fail with `NodeDown`.
    pub fn crash_at(&self, node: NodeId, at_ns: u64) {
        let cluster = self.cluster.clone();
        self.sim().sched.at(at_ns, move || cluster.crash(node));
    }

    pub fn profile(&self) -> Profile {
        self.sim().profile.clone()
    }

    /// Virtual time now, in ns.
    pub fn now_ns(&self) -> u64 {
        self.sim().sched.now()
    }

    /// Messages given a fault-injection delay so far
    /// ([`SimConfig::delays`]).
    pub fn delayed_messages(&self) -> u64 {
        self.sim().delayed.get()
    }

    /// Events run so far.
    pub fn events(&self) -> u64 {
        self.sim().sched.events()
    }

    /// Events scheduled and not yet run, the livelock watchdog's checks
    /// included (which [`Simulation::events`] does not count once run).
    pub fn pending_events(&self) -> usize {
        self.sim().sched.pending_events()
    }

    /// Messages so far that arrived out of posting order: each was posted
    /// before another message between the same two nodes that was already
    /// on its way and left no instant free before it, so it arrived no
    /// earlier than that one (`PairOrder`'s one exception to the model's
    /// invariant 1; never two messages of one endpoint).
    pub fn messages_overtaken(&self) -> u64 {
        net::messages_overtaken(&self.sim().net.borrow())
    }

    /// Nested waits held so far: frames whose tasks were done while a
    /// synchronous wait started inside them still ran ([`FramesHeld`];
    /// docs/simulation.md, "The rule for synchronous waits"). A long hold is
    /// code breaking that rule: a wait started by a job or handler that
    /// waits for clients or other nodes instead of being awaited.
    pub fn frames_held(&self) -> FramesHeld {
        self.sim().sched.frames_held()
    }

    /// Worker jobs suspended in a wait now (`jobco`: a job that waits is a
    /// coroutine resumed by a background task until it ends).
    pub fn jobs_running(&self) -> usize {
        self.sim().sched.jobs_suspended()
    }

    /// Lets virtual time pass until no worker job is suspended, or for at
    /// most `limit`; true if none is left. The harness calls it between
    /// a run and what follows, so that jobs still running when the last
    /// client ended finish before the next phase, as they did when a job
    /// ran to its end inside the event that started it.
    pub fn finish_jobs(&self, limit: std::time::Duration) -> bool {
        let sim = self.sim();
        if sim.sched.jobs_suspended() == 0 {
            return true;
        }
        let ended = std::future::poll_fn(|cx| sim.sched.poll_jobs_ended(cx));
        crate::exec::block_on(crate::exec::unless(ended, crate::exec::sleep(limit))).is_some()
    }

    /// Background tasks started so far.
    pub fn background_tasks(&self) -> usize {
        self.sim().sched.background_count()
    }

    /// Instructions memory-node jobs declared so far ([`work`]): the
    /// `memnode declared instructions` row of [`Self::resources`], 0 when
    /// nothing declared (the row is then left out).
    pub fn declared_instructions(&self) -> u64 {
        self.sim().work_instructions.get()
    }

    /// Every modelled resource's busy time and traffic so far, then each
    /// memory node's cache counts (rows with no busy time: `count` is hits,
    /// misses, misses charged the DRAM latency, or lines the pair prefetcher
    /// brought in (with `pair_prefetch` only); a miss or prefetch row's `bytes` are
    /// the lines fetched from DRAM).
    pub fn resources(&self) -> Vec<ResourceUse> {
        let sim = self.sim();
        let mut out = net::resources(&sim.net.borrow(), sim.profile.network.qp_miss_ns);
        for (i, c) in sim.llc.borrow().iter().enumerate() {
            let Some(c) = c else { continue };
            for (what, count, bytes) in [
                ("llc hits", c.hits, 0),
                ("llc misses", c.misses, c.misses * 64),
                ("llc dependent misses", c.dependent_misses, 0),
                ("llc prefetched lines", c.prefetches, c.prefetches * 64),
            ] {
                if what == "llc prefetched lines" && !sim.profile.memnode.pair_prefetch {
                    // No prefetcher in the profile: no row (reports as before).
                    continue;
                }
                out.push(ResourceUse {
                    name: format!("node{i} {what}"),
                    servers: 1,
                    busy_ns: 0,
                    wait_ns: 0,
                    count,
                    bytes,
                });
            }
        }
        // The cores' private caches (only with `core_cache_bytes`; reports
        // without them are as before): per core set, summed over its cores.
        if sim.profile.memnode.core_cache_bytes > 0 {
            let caches = sim.core_caches.borrow();
            for (name, cores) in sim.net.borrow().coreset_cores() {
                let (mut hits, mut misses, mut inval) = (0, 0, 0);
                for c in cores {
                    if let Some(Some(c)) = caches.get(c as usize) {
                        hits += c.hits;
                        misses += c.misses;
                        inval += c.invalidations;
                    }
                }
                if hits + misses + inval == 0 {
                    continue;
                }
                for (what, count) in [
                    ("private hits", hits),
                    ("private misses", misses),
                    ("private invalidations", inval),
                ] {
                    out.push(ResourceUse {
                        name: format!("{name} {what}"),
                        servers: 1,
                        busy_ns: 0,
                        wait_ns: 0,
                        count,
                        bytes: 0,
                    });
                }
            }
        }
        // Work memory-node code declared (`work`; only with an instruction
        // term in the profile and engines that declare).
        let declared = sim.work_instructions.get();
        if declared > 0 {
            out.push(ResourceUse {
                name: "memnode declared instructions".to_string(),
                servers: 1,
                busy_ns: 0,
                wait_ns: 0,
                count: declared,
                bytes: 0,
            });
        }
        // Compute-side lines (only engines that use `Endpoint::charged`
        // have any; the others' reports are unchanged).
        let (distinct, notes) = sim.local_lines.get();
        for (what, count) in [
            ("compute distinct lines", distinct),
            ("compute line notes", notes),
        ] {
            if count > 0 {
                out.push(ResourceUse {
                    name: what.to_string(),
                    servers: 1,
                    busy_ns: 0,
                    wait_ns: 0,
                    count,
                    bytes: 0,
                });
            }
        }
        out
    }
}

impl Drop for Simulation {
    fn drop(&mut self) {
        // Handlers and regions may hold the fabric: break such cycles.
        self.cluster.clear();
        if std::thread::current().id() == self.thread {
            // Background tasks and pending events go with the state.
            let _ = CORE_CACHES_ON.try_with(|c| c.set(false));
            if let Ok(Some(sim)) = CURRENT.try_with(|c| c.borrow_mut().take()) {
                // Pending events hold the state: break the cycle. What they
                // drop may answer RPCs whose callers are gone with them.
                TEARING_DOWN.with(|t| t.set(true));
                sim.sched.clear();
                TEARING_DOWN.with(|t| t.set(false));
            }
        }
    }
}
