//! Serving evidence on real threads: what each `local` RPC handler thread
//! and each compute thread running this crate's executor did between and
//! around requests, counted by the thread itself, so that a slow run can be
//! told apart from a fast one by counters that are not wall-clock: requests
//! per busy stretch (the batch a handler serves between two empty polls of
//! its queue), empty polls, `sched_yield` calls, blocks and parks, and
//! where the thread ran (the CPU it is on, sampled with `sched_getcpu`
//! every [`CPU_SAMPLE_EVERY`] events; a sample on another CPU than the
//! thread's previous one counts as a migration; a sample on the CPU where
//! the other role's thread (handler / compute) was last sampled counts as
//! sharing a CPU with it).
//!
//! Cost: every counter has one writer, its own thread, which bumps it with a
//! plain load and store (no locked instruction) in a cache line of its own
//! (the block is 128-byte aligned, so a handler's and a compute thread's
//! counters never share a line); `sched_getcpu` is a vDSO or rseq read.
//! Nothing here runs under `sim` (its scheduler runs tasks and handlers on
//! one OS thread and never reaches these loops), and nothing here changes
//! what the threads do: it only counts.
//!
//! The bench harness reads [`snapshot`] before and after its run phase and
//! reports the differences per thread beside the OS's scheduling figures
//! (`sched` in the report; left out of exactness comparisons like every
//! wall-clock field).

use parking_lot::Mutex;
use std::cell::RefCell;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// What a thread does in the RPC path.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Role {
    /// A `local` node's RPC handler thread.
    Handler,
    /// A thread running [`crate::exec::run_tasks`].
    Compute,
}

/// The counters. Handler threads use `Requests` to `Blocks`, the busy
/// times and `ChargeDropped`; compute threads `Idles` to `Parks`; both the
/// CPU samples and `TimedOutWithWork`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(usize)]
pub enum Counter {
    /// Requests taken from the queue.
    Requests,
    /// Busy stretches: a request taken after the queue was found empty.
    Stretches,
    /// Polls of the queue that found it empty.
    EmptyPolls,
    /// `sched_yield` calls while waiting (handler or executor).
    Yields,
    /// Times the handler gave up polling and blocked in the queue.
    Blocks,
    /// Times the executor found no task ready.
    Idles,
    /// Times the executor parked (after its poll window).
    Parks,
    /// `sched_getcpu` samples taken.
    CpuSamples,
    /// Samples on another CPU than the thread's previous sample.
    Migrations,
    /// Samples on the CPU where the other role's thread was last sampled.
    SharedCpu,
    /// Sampled busy stretches' thread CPU time and elapsed time (ns), as
    /// the handler's [`crate::BusyClock`] measured them.
    BusyCpuNs,
    BusyWallNs,
    /// Intervals of the handler's RPC charge left out because the thread
    /// was off its CPU in them (`crate::charge`, invariant C2).
    ChargeDropped,
    /// Waits that ended by their timeout, not by a wake-up, while there was
    /// work: an executor park with a task's ready flag set (after a short
    /// grace for a notify on its way, `exec::woke_late`), a handler's block
    /// with a request in its lanes (`local_rpc::Doorbell::sleep`). Each is
    /// a wake-up that was lost or came late; expected zero.
    TimedOutWithWork,
}

const COUNTERS: usize = Counter::TimedOutWithWork as usize + 1;

/// Events (polls, requests, idle rounds) between two CPU samples.
pub const CPU_SAMPLE_EVERY: u64 = 32;

/// One thread's counters, on cache lines of their own.
#[repr(align(128))]
pub struct ThreadCounters {
    /// The OS thread id (`gettid`), to match `/proc/self/task/<tid>`.
    pub tid: u64,
    pub role: Role,
    values: [AtomicU64; COUNTERS],
}

impl ThreadCounters {
    /// The counter's value so far.
    pub fn get(&self, c: Counter) -> u64 {
        self.values[c as usize].load(Ordering::Relaxed)
    }
}

/// Every thread that ever counted, in registration order.
static REGISTRY: Mutex<Vec<Arc<ThreadCounters>>> = Mutex::new(Vec::new());

/// The CPU each role's threads were last sampled on (`u32::MAX`: none yet).
#[repr(align(128))]
struct LastCpu(AtomicU32);
static LAST_CPU: [LastCpu; 2] = [
    LastCpu(AtomicU32::new(u32::MAX)),
    LastCpu(AtomicU32::new(u32::MAX)),
];

struct Local {
    shared: Arc<ThreadCounters>,
    events: u64,
    last_cpu: u32,
}

thread_local! {
    static LOCAL: RefCell<Option<Local>> = const { RefCell::new(None) };
}

/// Adds `n` to the calling thread's counter `c`, registering the thread
/// under `role` on its first count.
#[inline]
pub fn add(role: Role, c: Counter, n: u64) {
    with_local(role, |l| bump(&l.shared, c, n));
}

/// Adds each `(counter, n)` of `counts` to the calling thread's counters
/// (one thread-local access for all of them).
#[inline]
pub fn add_all(role: Role, counts: &[(Counter, u64)]) {
    with_local(role, |l| {
        for &(c, n) in counts {
            bump(&l.shared, c, n);
        }
    });
}

/// [`add`] and [`event`] in one thread-local access.
#[inline]
pub fn add_event(role: Role, c: Counter, n: u64) {
    with_local(role, |l| {
        bump(&l.shared, c, n);
        l.events += 1;
        if l.events.is_multiple_of(CPU_SAMPLE_EVERY) {
            sample_cpu(l);
        }
    });
}

/// Counts one event (a poll, a request, an idle round) of the calling
/// thread and samples its CPU every [`CPU_SAMPLE_EVERY`] events.
#[inline]
pub fn event(role: Role) {
    with_local(role, |l| {
        l.events += 1;
        if l.events.is_multiple_of(CPU_SAMPLE_EVERY) {
            sample_cpu(l);
        }
    });
}

/// A thread's own handle on one of its counters, for a loop that bumps it
/// once per item (the handler's serving loop: one per request): a plain
/// load and store on the counter, without [`add_event`]'s thread-local
/// access and `RefCell` borrow per call (branch i75). Its bumps are events
/// of their own for the CPU sampling: every [`CPU_SAMPLE_EVERY`]-th samples
/// the thread's CPU, as [`add_event`] would (counted apart from the
/// thread's other events, so the samples may fall on other bumps than
/// before; the counter's value is the same).
pub struct Tally {
    shared: Arc<ThreadCounters>,
    role: Role,
    counter: Counter,
    events: u64,
}

impl Tally {
    /// The calling thread's counter `c`, registering the thread under
    /// `role` if it counted nothing yet. To be used on this thread only
    /// (the counter has one writer, its thread).
    pub fn for_this_thread(role: Role, c: Counter) -> Tally {
        let mut shared = None;
        with_local(role, |l| shared = Some(l.shared.clone()));
        Tally {
            // A thread whose thread-local is being torn down: a block of
            // its own, registered like any.
            shared: shared.unwrap_or_else(|| register(role).shared),
            role,
            counter: c,
            events: 0,
        }
    }

    /// Adds one to the counter; samples the CPU every
    /// [`CPU_SAMPLE_EVERY`] calls.
    #[inline]
    pub fn bump(&mut self) {
        bump(&self.shared, self.counter, 1);
        self.events += 1;
        if self.events.is_multiple_of(CPU_SAMPLE_EVERY) {
            self.sample();
        }
    }

    #[cold]
    #[inline(never)]
    fn sample(&self) {
        with_local(self.role, sample_cpu);
    }
}

#[inline]
fn with_local(role: Role, f: impl FnOnce(&mut Local)) {
    // `try_with`: a thread being torn down counts nothing more.
    let _ = LOCAL.try_with(|l| {
        let mut l = l.borrow_mut();
        let l = l.get_or_insert_with(|| register(role));
        f(l)
    });
}

/// Single writer: a load and a store, no read-modify-write.
#[inline]
fn bump(t: &ThreadCounters, c: Counter, n: u64) {
    let v = &t.values[c as usize];
    v.store(v.load(Ordering::Relaxed).wrapping_add(n), Ordering::Relaxed);
}

fn register(role: Role) -> Local {
    let shared = Arc::new(ThreadCounters {
        tid: current_tid(),
        role,
        values: Default::default(),
    });
    REGISTRY.lock().push(shared.clone());
    Local {
        shared,
        events: 0,
        last_cpu: u32::MAX,
    }
}

#[cold]
fn sample_cpu(l: &mut Local) {
    if let Some(cpu) = current_cpu() {
        record_sample(l, cpu, &LAST_CPU);
    }
}

/// Counts a sample of `cpu` for `l`'s thread, against the other role's
/// last sample in `last` (indexed handler, compute).
fn record_sample(l: &mut Local, cpu: u32, last: &[LastCpu; 2]) {
    let t = &l.shared;
    bump(t, Counter::CpuSamples, 1);
    if l.last_cpu != u32::MAX && l.last_cpu != cpu {
        bump(t, Counter::Migrations, 1);
    }
    l.last_cpu = cpu;
    let (mine, other) = match t.role {
        Role::Handler => (0, 1),
        Role::Compute => (1, 0),
    };
    last[mine].0.store(cpu, Ordering::Relaxed);
    if last[other].0.load(Ordering::Relaxed) == cpu {
        bump(t, Counter::SharedCpu, 1);
    }
}

/// The calling thread's counter `c` (0 if it counted nothing yet).
#[cfg(test)]
pub(crate) fn own(c: Counter) -> u64 {
    LOCAL.with(|l| l.borrow().as_ref().map_or(0, |l| l.shared.get(c)))
}

/// Every registered thread's counters now (threads that ended included).
pub fn snapshot() -> Vec<(u64, Role, [u64; COUNTERS])> {
    REGISTRY
        .lock()
        .iter()
        .map(|t| {
            let mut v = [0; COUNTERS];
            for (o, a) in v.iter_mut().zip(&t.values) {
                *o = a.load(Ordering::Relaxed);
            }
            (t.tid, t.role, v)
        })
        .collect()
}

/// The counters of [`snapshot`]'s arrays, in order, with their names.
pub const COUNTER_NAMES: [(Counter, &str); COUNTERS] = [
    (Counter::Requests, "requests"),
    (Counter::Stretches, "stretches"),
    (Counter::EmptyPolls, "empty_polls"),
    (Counter::Yields, "yields"),
    (Counter::Blocks, "blocks"),
    (Counter::Idles, "idles"),
    (Counter::Parks, "parks"),
    (Counter::CpuSamples, "cpu_samples"),
    (Counter::Migrations, "migrations"),
    (Counter::SharedCpu, "shared_cpu_samples"),
    (Counter::BusyCpuNs, "busy_sampled_cpu_ns"),
    (Counter::BusyWallNs, "busy_sampled_wall_ns"),
    (Counter::ChargeDropped, "charge_dropped_intervals"),
    (Counter::TimedOutWithWork, "timed_out_with_work"),
];

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn current_cpu() -> Option<u32> {
    // SAFETY: sched_getcpu takes no arguments and only reads the calling
    // thread's CPU number; it returns -1 on failure.
    let c = unsafe { libc::sched_getcpu() };
    u32::try_from(c).ok()
}

#[cfg(not(target_os = "linux"))]
fn current_cpu() -> Option<u32> {
    None
}

#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
fn current_tid() -> u64 {
    // SAFETY: gettid takes no arguments and cannot fail.
    unsafe { libc::gettid() as u64 }
}

#[cfg(not(target_os = "linux"))]
fn current_tid() -> u64 {
    0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mine(tid: u64) -> [u64; COUNTERS] {
        snapshot()
            .into_iter()
            .find(|(t, _, _)| *t == tid)
            .map(|(_, _, v)| v)
            .expect("the thread registered")
    }

    #[test]
    fn a_thread_counts_its_own_events_and_samples_its_cpu() {
        std::thread::spawn(|| {
            add(Role::Handler, Counter::Requests, 3);
            add(Role::Handler, Counter::Requests, 2);
            for _ in 0..CPU_SAMPLE_EVERY * 4 {
                event(Role::Handler);
            }
            let v = mine(current_tid());
            assert_eq!(v[Counter::Requests as usize], 5);
            assert_eq!(v[Counter::Stretches as usize], 0);
            if cfg!(target_os = "linux") {
                assert_eq!(v[Counter::CpuSamples as usize], 4);
                assert!(v[Counter::Migrations as usize] <= 3);
            }
        })
        .join()
        .unwrap();
    }

    /// A `Tally` bumps the thread's own counter (the one `add` and the
    /// snapshot see, one block per thread) and samples the CPU every
    /// `CPU_SAMPLE_EVERY` bumps. Fails if the tally registered a block of
    /// its own (the thread's `add` and the tally's bumps would be two
    /// threads' counters) or did not sample.
    #[test]
    fn a_tally_bumps_the_threads_own_counter_and_samples_its_cpu() {
        std::thread::spawn(|| {
            add(Role::Handler, Counter::Requests, 2);
            let mut t = Tally::for_this_thread(Role::Handler, Counter::Requests);
            for _ in 0..CPU_SAMPLE_EVERY * 3 {
                t.bump();
            }
            add(Role::Handler, Counter::Requests, 1);
            let v = mine(current_tid());
            assert_eq!(v[Counter::Requests as usize], 2 + CPU_SAMPLE_EVERY * 3 + 1);
            assert_eq!(own(Counter::Requests), v[Counter::Requests as usize]);
            if cfg!(target_os = "linux") {
                assert_eq!(v[Counter::CpuSamples as usize], 3);
            }
            let tid = current_tid();
            let blocks = snapshot().iter().filter(|(t, _, _)| *t == tid).count();
            assert_eq!(blocks, 1, "one block per thread");
        })
        .join()
        .unwrap();
    }

    #[test]
    fn samples_count_migrations_and_cpus_shared_with_the_other_role() {
        // Private last-CPU slots: other tests' threads cannot move them.
        let last = [
            LastCpu(AtomicU32::new(u32::MAX)),
            LastCpu(AtomicU32::new(u32::MAX)),
        ];
        let mut h = register(Role::Handler);
        let mut c = register(Role::Compute);
        record_sample(&mut h, 1, &last); // first sample: no partner yet
        record_sample(&mut c, 1, &last); // on the handler's CPU
        record_sample(&mut c, 0, &last); // migrated, alone
        record_sample(&mut h, 0, &last); // migrated, on the compute's CPU
        record_sample(&mut h, 0, &last); // stays
        let get = |l: &Local, k: Counter| l.shared.get(k);
        assert_eq!(get(&h, Counter::CpuSamples), 3);
        assert_eq!(get(&h, Counter::Migrations), 1);
        assert_eq!(get(&h, Counter::SharedCpu), 2);
        assert_eq!(get(&c, Counter::CpuSamples), 2);
        assert_eq!(get(&c, Counter::Migrations), 1);
        assert_eq!(get(&c, Counter::SharedCpu), 1);
    }
}
