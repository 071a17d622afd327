//! A small single-threaded executor for compute threads.
//!
//! Each compute thread runs C operations at once as tasks (the papers'
//! coroutines): while one task waits for an RPC reply or an injected network
//! delay, the others run. Tasks never move between threads, so futures need
//! not be `Send`, and an endpoint's counters can live in plain cells.
//!
//! When no task is ready the thread runs the idle hooks that backends
//! register to drive their progress engines (and then never parks), or else
//! polls its wake-up flag for 50 µs, yielding its core between polls (the
//! reply it waits for may come from a handler thread that needs this very
//! core), and then parks until a waker unparks it or its earliest short
//! sleep is due. Parking at once and short spins without yielding were
//! measured slower on a loaded host (docs/performance.md, "Seventh pass").
//! Timers ([`sleep`]) work under any executor: waits under
//! `TIMER_SPIN_THRESHOLD` are kept in a per-thread list that this executor
//! parks on (under another executor they spin), longer ones are woken by
//! one shared timer thread.

use crate::parker::Parker;
use parking_lot::{Condvar, Mutex};
use std::cell::{Cell, RefCell};
use std::cmp::Reverse;
use std::collections::BinaryHeap;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::task::{Context, Poll, RawWakerVTable, Wake, Waker};
use std::time::{Duration, Instant};

/// How long an idle executor polls (yielding its core between polls) before
/// it parks.
const POLL_BEFORE_PARK: Duration = Duration::from_micros(50);
/// Waits shorter than this do not use the timer thread (its condition
/// variable's wake-up is too coarse for them).
const TIMER_SPIN_THRESHOLD: Duration = Duration::from_micros(200);
/// Timer slack asked for threads that park on short sleeps (the kernel's
/// default, 50 µs, would stretch a 20 µs sleep to 70 µs).
#[cfg(target_os = "linux")]
const SHORT_SLEEP_TIMER_SLACK_NS: libc::c_ulong = 1_000;

struct Shared {
    ready: Vec<AtomicBool>,
    parker: Parker,
}

struct TaskWaker {
    shared: Arc<Shared>,
    index: usize,
}

impl Wake for TaskWaker {
    fn wake(self: Arc<Self>) {
        self.wake_by_ref()
    }
    fn wake_by_ref(self: &Arc<Self>) {
        // A swap, not a store: on x86-64 both are one `xchg` (a SeqCst
        // store is compiled to one), and loom models a swap faithfully
        // where it mis-models a store racing the executor's swap
        // (`parker::loom_tests::the_executor_loop_never_parks_with_a_task_ready`).
        self.shared.ready[self.index].swap(true, Ordering::SeqCst);
        self.shared.parker.notify();
    }
}

/// A task's future, boxed and pinned.
pub type LocalTask<'a, T> = Pin<Box<dyn Future<Output = T> + 'a>>;

/// Runs all `tasks` to completion on this thread, interleaving them, and
/// returns their outputs in order.
pub fn run_tasks<'a, T>(tasks: Vec<LocalTask<'a, T>>) -> Vec<T> {
    // Inside a simulation the scheduler runs them, in virtual time.
    let mut tasks = match crate::sim::run_tasks(tasks) {
        Ok(out) => return out,
        Err(tasks) => tasks,
    };
    let n = tasks.len();
    let _running = ExecutorDepth::enter();
    let shared = Arc::new(Shared {
        ready: (0..n).map(|_| AtomicBool::new(true)).collect(),
        parker: Parker::new(),
    });
    let wakers: Vec<Waker> = (0..n)
        .map(|index| {
            Waker::from(Arc::new(TaskWaker {
                shared: shared.clone(),
                index,
            }))
        })
        .collect();
    // This executor is the innermost one of the thread until it returns
    // (W1, `wake_self`); the previous one is put back then, also on unwind.
    let _innermost = wakers
        .first()
        .map(|w| Innermost::enter(w.vtable(), &shared));
    let mut results: Vec<Option<T>> = (0..n).map(|_| None).collect();
    let mut remaining = n;
    while remaining > 0 {
        shared.parker.take();
        wake_due_short_sleeps();
        let mut polled = false;
        // Zipped, not indexed: no bounds check per task and round.
        let each = tasks
            .iter_mut()
            .zip(results.iter_mut())
            .zip(wakers.iter().zip(shared.ready.iter()));
        for ((task, result), (waker, ready)) in each {
            if result.is_some() || !ready.swap(false, Ordering::SeqCst) {
                continue;
            }
            polled = true;
            let mut cx = Context::from_waker(waker);
            if let Poll::Ready(v) = task.as_mut().poll(&mut cx) {
                *result = Some(v);
                remaining -= 1;
            }
        }
        if remaining > 0 && !polled {
            idle(&shared);
        }
    }
    results
        .into_iter()
        .map(|r| r.expect("every task completed"))
        .collect()
}

/// Runs one future to completion on this thread.
pub fn block_on<F: Future>(fut: F) -> F::Output {
    let mut out = run_tasks(vec![Box::pin(fut) as LocalTask<'_, F::Output>]);
    out.pop().expect("one task")
}

/// Runs one future that only the network (one-sided verbs, message
/// delivery, core queues) and timers can complete, blocking this thread.
///
/// On real threads it is [`block_on`]. Under the simulated cluster it polls
/// no other task while it waits (a real thread blocked on a verb runs none
/// of its coroutines either): code on a simulated memory-node core that
/// holds a lock across the wait (ScaleStore's directory delivers a page
/// one-sided under the page's entry mutex) must not have the one OS thread
/// run a task that takes the same lock. A future that needs another task
/// to make progress must use [`block_on`] instead: here it would wait for
/// ever (reported as a simulation deadlock when no event is left).
pub fn block_on_network<F: Future>(fut: F) -> F::Output {
    match crate::sim::run_alone(Box::pin(fut) as LocalTask<'_, F::Output>) {
        Ok(v) => v,
        Err(fut) => block_on(fut),
    }
}

fn idle(shared: &Shared) {
    let hooks = IDLE_HOOKS.with(|h| h.borrow().clone());
    if !hooks.is_empty() {
        // A backend must be driven to make progress: never park.
        while !shared.parker.is_notified() {
            for hook in &hooks {
                hook();
            }
        }
        return;
    }
    #[allow(clippy::disallowed_methods)]
    let start = Instant::now();
    // On a CPU of its own the reply cannot need this core, and a yield
    // would hand another process the CPU for a time slice: spin instead
    // (placement::alone_on_own_cpu).
    let yield_between_polls = !crate::placement::alone_on_own_cpu();
    // Counted for the report (servestats), once per idle round.
    let mut yields = 0u64;
    let count = |yields: u64, parked: bool| {
        use crate::servestats::{Counter, Role};
        crate::servestats::add_all(
            Role::Compute,
            &[
                (Counter::Yields, yields),
                (Counter::Parks, u64::from(parked)),
            ],
        );
        crate::servestats::add_event(Role::Compute, Counter::Idles, 1);
    };
    loop {
        if shared.parker.is_notified() {
            count(yields, false);
            return;
        }
        let due = earliest_short_sleep();
        #[allow(clippy::disallowed_methods)]
        let now = Instant::now();
        if due.is_some_and(|d| d <= now) {
            count(yields, false);
            return; // the caller's loop wakes the sleepers now due
        }
        if now - start < POLL_BEFORE_PARK {
            // Give the core away while polling (unless alone on it): the
            // reply this thread waits for may come from a handler thread
            // that needs this very core (more busy threads than cores), and
            // must not be starved.
            if crate::placement::pause_between_polls(yield_between_polls) {
                yields += 1;
            }
            continue;
        }
        count(yields, true);
        let unnotified = match due {
            None => shared.parker.park(),
            Some(d) => {
                relax_timer_slack();
                shared.parker.park_at_most(d - now)
            }
        };
        if unnotified && woke_late(shared) {
            crate::servestats::add(
                crate::servestats::Role::Compute,
                crate::servestats::Counter::TimedOutWithWork,
                1,
            );
        }
        return;
    }
}

/// Spins `woke_late` waits for a notify that is on its way.
const LATE_WAKE_GRACE_SPINS: u32 = 1_000;

/// After a park that no notify ended (its timeout did): whether a task
/// was ready all the same, i.e. a waker set its flag and its notify did
/// not arrive. A waker between its two steps (the flag set, the notify
/// not yet) is given [`LATE_WAKE_GRACE_SPINS`] spins to notify; one
/// preempted for longer between them is counted too, so the count is an
/// upper bound on lost wake-ups (the lost-wake-up detector of
/// docs/transport.md, "Executor").
fn woke_late(shared: &Shared) -> bool {
    if !shared.ready.iter().any(|r| r.load(Ordering::SeqCst)) {
        return false;
    }
    for _ in 0..LATE_WAKE_GRACE_SPINS {
        if shared.parker.is_notified() {
            return false;
        }
        std::hint::spin_loop();
    }
    !shared.parker.is_notified()
}

thread_local! {
    /// Short sleeps (under `TIMER_SPIN_THRESHOLD`) of tasks run by an
    /// executor of this thread: their deadlines and wakers, woken by the
    /// executor's loop once due. Unordered and small (at most one entry per
    /// sleeping task).
    static SHORT_SLEEPS: RefCell<Vec<(Instant, Waker)>> = const { RefCell::new(Vec::new()) };
    /// Whether `SHORT_SLEEPS` has entries (checked on every executor loop).
    static HAS_SHORT_SLEEPS: Cell<bool> = const { Cell::new(false) };
    /// How many of this crate's executors run on this thread (nested
    /// `block_on`s count each): with none, a short sleep has nobody to wake
    /// it from the list and spins instead.
    static EXECUTOR_DEPTH: Cell<u32> = const { Cell::new(0) };
    static TIMER_SLACK_SET: Cell<bool> = const { Cell::new(false) };
}

/// Marks an executor running on this thread for as long as it lives.
struct ExecutorDepth;

impl ExecutorDepth {
    fn enter() -> ExecutorDepth {
        EXECUTOR_DEPTH.with(|d| d.set(d.get() + 1));
        ExecutorDepth
    }
}

impl Drop for ExecutorDepth {
    fn drop(&mut self) {
        EXECUTOR_DEPTH.with(|d| d.set(d.get() - 1));
    }
}

thread_local! {
    /// The innermost executor of [`run_tasks`] running on this thread: its
    /// wakers' vtable and its shared state (null pointers: none). See
    /// [`wake_self`].
    static INNERMOST: Cell<(*const RawWakerVTable, *const Shared)> =
        const { Cell::new((std::ptr::null(), std::ptr::null())) };
}

/// Marks an executor as the thread's innermost for as long as it lives,
/// and puts the previous one back when dropped.
struct Innermost((*const RawWakerVTable, *const Shared));

impl Innermost {
    fn enter(vtable: &'static RawWakerVTable, shared: &Arc<Shared>) -> Innermost {
        let me = (vtable as *const RawWakerVTable, Arc::as_ptr(shared));
        Innermost(INNERMOST.with(|c| c.replace(me)))
    }
}

impl Drop for Innermost {
    fn drop(&mut self) {
        INNERMOST.with(|c| c.set(self.0));
    }
}

/// Wakes `waker`, the waker of the task being polled (what
/// `waker.wake_by_ref()` does), without its two locked operations and its
/// dynamic call when it is a waker of the executor polling: a future that
/// completed at once and yields once before it hands its result out (a
/// batch executed in place, [`crate::backend::OpFuture::ready_after_yield`],
/// [`yield_now`]) only needs its task polled again.
///
/// Invariant (W1): if `waker` is a task waker of [`run_tasks`] (its vtable
/// is the innermost executor's) and belongs to the innermost executor
/// running on this thread (its shared state is that executor's), the task's
/// ready flag is set with a plain store and the parker is not notified: the
/// caller is inside that executor's poll of one of its tasks (only a poll
/// has a waker to pass), after which the executor scans its flags again
/// before it can idle or park (a round that polled a task never parks), and
/// the flag is read on this very thread. Any other waker (another
/// executor's, a simulation's, a foreign one, or this executor's from
/// another thread) is woken as usual. Call it only from within a poll, with
/// that poll's waker or a waker of the same executor.
#[inline]
#[allow(unsafe_code)]
pub fn wake_self(waker: &Waker) {
    let (vtable, shared) = INNERMOST.with(Cell::get);
    if std::ptr::eq(waker.vtable(), vtable) {
        // SAFETY: the vtable is the one `run_tasks` built its wakers with
        // (`Waker::from(Arc<TaskWaker>)`), so the data pointer is the
        // `TaskWaker` of a live `Arc` that `waker` holds a reference to for
        // as long as it is borrowed here.
        let tw = unsafe { &*waker.data().cast::<TaskWaker>() };
        if std::ptr::eq(Arc::as_ptr(&tw.shared), shared) {
            tw.shared.ready[tw.index].store(true, Ordering::Relaxed);
            return;
        }
    }
    waker.wake_by_ref();
}

/// Adds a short sleep to this thread's list; false if no executor of ours
/// runs here to wake it.
fn register_short_sleep(deadline: Instant, waker: &Waker) -> bool {
    if EXECUTOR_DEPTH.with(Cell::get) == 0 {
        return false;
    }
    SHORT_SLEEPS.with(|l| {
        let mut l = l.borrow_mut();
        // A sleep polled again (woken by something else) is listed once.
        if !l.iter().any(|(d, w)| *d == deadline && w.will_wake(waker)) {
            l.push((deadline, waker.clone()));
        }
    });
    HAS_SHORT_SLEEPS.with(|h| h.set(true));
    true
}

/// Wakes this thread's short sleepers whose deadline has passed. Called
/// once per executor round: the common case (no short sleeper on this
/// thread) is one thread-local load inlined into the loop; the list's walk
/// is a call of its own ([`wake_due_short_sleeps_now`]). Before, the whole
/// function was one out-of-line call per round (~19 instructions for its
/// prologue, check and epilogue: ~57 per race update with one task, whose
/// every round trip is a round).
#[inline(always)]
fn wake_due_short_sleeps() {
    if HAS_SHORT_SLEEPS.with(Cell::get) {
        wake_due_short_sleeps_now();
    }
}

/// [`wake_due_short_sleeps`] when this thread has short sleepers.
#[cold]
#[inline(never)]
fn wake_due_short_sleeps_now() {
    #[allow(clippy::disallowed_methods)]
    let now = Instant::now();
    let due: Vec<Waker> = SHORT_SLEEPS.with(|l| {
        let mut l = l.borrow_mut();
        let mut due = Vec::new();
        l.retain(|(d, w)| {
            if *d <= now {
                due.push(w.clone());
                false
            } else {
                true
            }
        });
        HAS_SHORT_SLEEPS.with(|h| h.set(!l.is_empty()));
        due
    });
    // Woken outside the borrow: a waker may run code that sleeps again.
    for w in due {
        w.wake();
    }
}

/// The earliest deadline of this thread's short sleepers.
fn earliest_short_sleep() -> Option<Instant> {
    if !HAS_SHORT_SLEEPS.with(Cell::get) {
        return None;
    }
    SHORT_SLEEPS.with(|l| l.borrow().iter().map(|(d, _)| *d).min())
}

/// Asks the kernel once per thread for a fine timer slack, so a park until a
/// short sleep's deadline ends close to it.
#[allow(unsafe_code)]
fn relax_timer_slack() {
    if TIMER_SLACK_SET.with(|s| s.replace(true)) {
        return;
    }
    #[cfg(target_os = "linux")]
    // SAFETY: PR_SET_TIMERSLACK takes a plain integer and changes only the
    // calling thread's timer slack; a failure leaves the default in force.
    unsafe {
        libc::prctl(libc::PR_SET_TIMERSLACK, SHORT_SLEEP_TIMER_SLACK_NS);
    }
}

type IdleHook = Rc<dyn Fn()>;

thread_local! {
    static IDLE_HOOKS: RefCell<Vec<IdleHook>> = const { RefCell::new(Vec::new()) };
}

/// Registers a function that an idle executor on this thread calls in a loop
/// (a backend's progress engine). It stays registered until the guard drops.
pub fn register_idle_hook(hook: Rc<dyn Fn()>) -> IdleHookGuard {
    IDLE_HOOKS.with(|h| h.borrow_mut().push(hook.clone()));
    IdleHookGuard { hook }
}

/// Unregisters its idle hook when dropped.
pub struct IdleHookGuard {
    hook: Rc<dyn Fn()>,
}

impl Drop for IdleHookGuard {
    fn drop(&mut self) {
        // A guard held in another thread-local (an endpoint cached per
        // thread) may be dropped while the thread exits, after the hook list
        // itself is gone: then there is nothing left to unregister from.
        let _ = IDLE_HOOKS.try_with(|h| h.borrow_mut().retain(|x| !Rc::ptr_eq(x, &self.hook)));
    }
}

/// Virtual time a yield takes inside a simulation: a task that spins on
/// yields until another task changes something must let time pass, or
/// nothing else would ever run at a later instant.
pub const SIM_YIELD_NS: u64 = 50;

/// Lets the other tasks of this thread run once.
pub fn yield_now() -> YieldNow {
    YieldNow {
        yielded: false,
        sim: None,
    }
}

/// See [`yield_now`].
pub struct YieldNow {
    yielded: bool,
    sim: Option<crate::sim::SleepUntil>,
}

impl Future for YieldNow {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(s) = self.sim.as_mut() {
            return Pin::new(s).poll(cx);
        }
        if self.yielded {
            return Poll::Ready(());
        }
        self.yielded = true;
        if let Some(now) = crate::sim::now_ns() {
            let mut s = crate::sim::sleep_until_ns(now + SIM_YIELD_NS);
            let p = Pin::new(&mut s).poll(cx);
            self.sim = Some(s);
            return p;
        }
        wake_self(cx.waker());
        Poll::Pending
    }
}

/// Completes after `d` (virtual time inside a simulation).
pub fn sleep(d: Duration) -> Sleep {
    sleep_until(crate::time::Instant::now() + d)
}

/// Completes at `deadline` (see [`crate::time::Instant`]).
pub fn sleep_until(deadline: crate::time::Instant) -> Sleep {
    if crate::sim::active() {
        return Sleep {
            deadline: None,
            sim: Some(crate::sim::sleep_until_ns(deadline.as_nanos())),
        };
    }
    let wait = deadline.saturating_duration_since(crate::time::Instant::now());
    #[allow(clippy::disallowed_methods)]
    let real = Instant::now() + wait;
    Sleep {
        deadline: Some(real),
        sim: None,
    }
}

/// See [`sleep`].
pub struct Sleep {
    deadline: Option<Instant>,
    sim: Option<crate::sim::SleepUntil>,
}

impl Future for Sleep {
    type Output = ();
    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        if let Some(s) = self.sim.as_mut() {
            return Pin::new(s).poll(cx);
        }
        let deadline = self.deadline.expect("a real sleep has a deadline");
        #[allow(clippy::disallowed_methods)]
        let now = Instant::now();
        if now >= deadline {
            return Poll::Ready(());
        }
        if deadline - now < TIMER_SPIN_THRESHOLD {
            // Woken by this thread's executor when due; under a foreign
            // executor, polled again at once (a spin).
            if !register_short_sleep(deadline, cx.waker()) {
                cx.waker().wake_by_ref();
            }
        } else {
            timer().register(deadline, cx.waker().clone());
        }
        Poll::Pending
    }
}

/// `op`'s output, unless `stop` completes first (`stop` is polled first:
/// once it is ready, `op` is never polled again and is dropped where it
/// stands).
pub async fn unless<T>(op: impl Future<Output = T>, stop: impl Future<Output = ()>) -> Option<T> {
    let mut op = std::pin::pin!(op);
    let mut stop = std::pin::pin!(stop);
    std::future::poll_fn(|cx| {
        if stop.as_mut().poll(cx).is_ready() {
            return Poll::Ready(None);
        }
        op.as_mut().poll(cx).map(Some)
    })
    .await
}

/// A livelock limit for one task's operations, run one after another: each
/// must end within `limit` of (virtual) time, or it is given up.
///
/// Under `sim` one watchdog serves all of the task's operations
/// (`crate::sim::Watch`): at most one pending check, which draws nothing
/// from the scheduler's generator and wakes the task only once the limit
/// passed, so a run in which no operation reaches the limit is the same
/// run under any limit. Elsewhere each operation races a [`sleep`].
pub struct OpLimit {
    limit: Duration,
    sim: Option<Rc<crate::sim::Watch>>,
}

impl OpLimit {
    pub fn new(limit: Duration) -> OpLimit {
        let sim = crate::sim::active()
            .then(|| crate::sim::Watch::new(u64::try_from(limit.as_nanos()).unwrap_or(u64::MAX)));
        OpLimit { limit, sim }
    }

    pub fn limit(&self) -> Duration {
        self.limit
    }

    /// `op`'s output, or None if `limit` passed first. The limit is looked
    /// at before each poll of `op`, so once it passed `op` is never polled
    /// again.
    pub async fn run<T>(&self, op: impl Future<Output = T>) -> Option<T> {
        let mut op = std::pin::pin!(op);
        let Some(watch) = &self.sim else {
            return unless(op, sleep(self.limit)).await;
        };
        watch.begin();
        let out = std::future::poll_fn(|cx| {
            if watch.expired(cx) {
                return Poll::Ready(None);
            }
            op.as_mut().poll(cx).map(Some)
        })
        .await;
        watch.end();
        out
    }
}

/// A background activity of an engine (a retrainer, a logger, a page
/// provider): an OS thread running the future on real backends, a task of
/// the simulation inside one, so that its timing is part of the virtual run.
/// Engines never spawn threads themselves.
pub fn spawn_background(
    name: &str,
    fut: impl Future<Output = ()> + Send + 'static,
) -> BackgroundHandle {
    if crate::sim::active() {
        let index = crate::sim::spawn_background(Box::pin(fut))
            .unwrap_or_else(|_| unreachable!("the thread runs a simulation"));
        return BackgroundHandle {
            inner: BgInner::Sim(index),
        };
    }
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || block_on(fut))
        .expect("spawn a background thread");
    BackgroundHandle {
        inner: BgInner::Thread(Some(handle)),
    }
}

/// [`spawn_background`] for a future that is not `Send` (it holds an
/// endpoint): only inside a simulation, where everything runs on one thread.
/// Returns the future back elsewhere, for the caller to run its own way.
pub fn spawn_simulated(
    fut: impl Future<Output = ()> + 'static,
) -> Result<BackgroundHandle, Pin<Box<dyn Future<Output = ()>>>> {
    crate::sim::spawn_background(Box::pin(fut)).map(|index| BackgroundHandle {
        inner: BgInner::Sim(index),
    })
}

/// [`spawn_background`] for an activity whose future is not `Send` (it
/// keeps a thread's endpoint across its awaits): `make` builds the future
/// where it will run. Inside a simulation that is a task of the
/// simulation's background set, polled like any other task, so each of its
/// waits is an await of that task and never a nested frame of the
/// scheduler (two such activities then interleave in virtual time instead
/// of one waiting inside the other's wait); elsewhere an OS thread named
/// `name` of its own runs it with [`block_on`], as [`spawn_background`]
/// does.
pub fn spawn_background_local<M, F>(name: &str, make: M) -> BackgroundHandle
where
    M: FnOnce() -> F + Send + 'static,
    F: Future<Output = ()> + 'static,
{
    if crate::sim::active() {
        return spawn_simulated(make())
            .unwrap_or_else(|_| unreachable!("the thread runs a simulation"));
    }
    let handle = std::thread::Builder::new()
        .name(name.to_string())
        .spawn(move || block_on(make()))
        .expect("spawn a background thread");
    BackgroundHandle {
        inner: BgInner::Thread(Some(handle)),
    }
}

/// Waits for a background activity; see [`spawn_background`].
pub struct BackgroundHandle {
    inner: BgInner,
}

enum BgInner {
    Thread(Option<std::thread::JoinHandle<()>>),
    Sim(usize),
}

impl BackgroundHandle {
    /// Waits until the activity finished (it must have been told to stop).
    pub fn join(mut self) {
        match &mut self.inner {
            BgInner::Thread(h) => {
                if let Some(h) = h.take() {
                    let _ = h.join();
                }
            }
            BgInner::Sim(index) => {
                let index = *index;
                block_on(std::future::poll_fn(|cx| {
                    if crate::sim::background_done(index) {
                        Poll::Ready(())
                    } else {
                        // The task wakes nobody when it ends: look again.
                        let w = cx.waker().clone();
                        let mut s =
                            crate::sim::sleep_until_ns(crate::sim::now_ns().unwrap_or(0) + 1000);
                        let _ = Pin::new(&mut s).poll(&mut Context::from_waker(&w));
                        Poll::Pending
                    }
                }));
            }
        }
    }

    /// Whether it has finished.
    pub fn is_finished(&self) -> bool {
        match &self.inner {
            BgInner::Thread(h) => h.as_ref().is_none_or(|h| h.is_finished()),
            BgInner::Sim(index) => crate::sim::background_done(*index),
        }
    }
}

/// One thread that wakes sleepers whose deadline passed.
struct Timer {
    queue: Mutex<BinaryHeap<Reverse<TimerEntry>>>,
    changed: Condvar,
}

struct TimerEntry {
    deadline: Instant,
    seq: u64,
    waker: Waker,
}

impl PartialEq for TimerEntry {
    fn eq(&self, o: &Self) -> bool {
        (self.deadline, self.seq) == (o.deadline, o.seq)
    }
}
impl Eq for TimerEntry {}
impl PartialOrd for TimerEntry {
    fn partial_cmp(&self, o: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for TimerEntry {
    fn cmp(&self, o: &Self) -> std::cmp::Ordering {
        (self.deadline, self.seq).cmp(&(o.deadline, o.seq))
    }
}

impl Timer {
    fn register(&self, deadline: Instant, waker: Waker) {
        static SEQ: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
        let seq = SEQ.fetch_add(1, Ordering::Relaxed);
        let mut q = self.queue.lock();
        let earliest = q.peek().map(|e| e.0.deadline);
        q.push(Reverse(TimerEntry {
            deadline,
            seq,
            waker,
        }));
        if earliest.is_none_or(|e| deadline < e) {
            self.changed.notify_one();
        }
    }

    fn run(&self) {
        let mut q = self.queue.lock();
        loop {
            #[allow(clippy::disallowed_methods)]
            let now = Instant::now();
            while q.peek().is_some_and(|e| e.0.deadline <= now) {
                let Reverse(e) = q.pop().expect("peeked");
                e.waker.wake();
            }
            match q.peek().map(|e| e.0.deadline) {
                Some(d) => {
                    self.changed.wait_until(&mut q, d);
                }
                None => self.changed.wait(&mut q),
            }
        }
    }
}

fn timer() -> &'static Timer {
    static TIMER: OnceLock<&'static Timer> = OnceLock::new();
    TIMER.get_or_init(|| {
        let t: &'static Timer = Box::leak(Box::new(Timer {
            queue: Mutex::new(BinaryHeap::new()),
            changed: Condvar::new(),
        }));
        std::thread::Builder::new()
            .name("dmkv-timer".into())
            .spawn(move || t.run())
            .expect("spawn the timer thread");
        t
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::cell::Cell;

    #[test]
    fn tasks_interleave_and_return_in_order() {
        let log = Rc::new(RefCell::new(Vec::new()));
        let tasks: Vec<LocalTask<'_, usize>> = (0..3usize)
            .map(|i| {
                let log = log.clone();
                Box::pin(async move {
                    for step in 0..3 {
                        log.borrow_mut().push((i, step));
                        yield_now().await;
                    }
                    i * 10usize
                }) as LocalTask<'_, usize>
            })
            .collect();
        assert_eq!(run_tasks(tasks), vec![0, 10, 20]);
        let log = log.borrow();
        // Every task took its first step before any took its second.
        assert_eq!(&log[..3], &[(0, 0), (1, 0), (2, 0)]);
        assert_eq!(log.len(), 9);
    }

    #[test]
    fn sleep_waits_at_least_its_duration() {
        for d in [Duration::from_micros(50), Duration::from_millis(5)] {
            let start = Instant::now();
            block_on(sleep(d));
            assert!(start.elapsed() >= d);
        }
    }

    /// A future that counts how often it is polled.
    struct Counted<F> {
        inner: Pin<Box<F>>,
        polls: Rc<Cell<u32>>,
    }

    impl<F: Future> Future for Counted<F> {
        type Output = F::Output;
        fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
            self.polls.set(self.polls.get() + 1);
            self.inner.as_mut().poll(cx)
        }
    }

    #[test]
    fn a_short_sleep_is_not_polled_until_due() {
        // Before, a sleep under the timer threshold woke itself on every
        // poll: thousands of polls in 100 µs. Now the executor keeps it in
        // its short-sleep list and polls it once it is due: a handful of
        // polls (a park may end early; the sleep re-arms).
        for d in [Duration::from_micros(20), Duration::from_micros(100)] {
            let polls = Rc::new(Cell::new(0));
            let start = Instant::now();
            block_on(Counted {
                inner: Box::pin(sleep(d)),
                polls: polls.clone(),
            });
            assert!(start.elapsed() >= d);
            assert!(polls.get() <= 10, "{d:?}: polled {} times", polls.get());
        }
        // Several tasks sleeping different short times all finish, each
        // after its own sleep.
        let tasks: Vec<LocalTask<'_, Duration>> = [150u64, 30, 90, 60]
            .into_iter()
            .map(|us| {
                Box::pin(async move {
                    let start = Instant::now();
                    sleep(Duration::from_micros(us)).await;
                    assert!(start.elapsed() >= Duration::from_micros(us));
                    Duration::from_micros(us)
                }) as LocalTask<'_, Duration>
            })
            .collect();
        let out = run_tasks(tasks);
        assert_eq!(out.len(), 4);
        assert_eq!(SHORT_SLEEPS.with(|l| l.borrow().len()), 0);
    }

    #[test]
    fn a_short_sleep_under_a_foreign_executor_wakes_itself() {
        // No executor of ours runs on this thread: nobody would look at the
        // short-sleep list, so a pending short sleep must wake itself (or a
        // foreign executor would wait for ever).
        struct Flag(AtomicBool);
        impl Wake for Flag {
            fn wake(self: Arc<Self>) {
                self.0.store(true, Ordering::SeqCst);
            }
        }
        let flag = Arc::new(Flag(AtomicBool::new(false)));
        let waker = Waker::from(flag.clone());
        let mut cx = Context::from_waker(&waker);
        let start = Instant::now();
        let mut s = std::pin::pin!(sleep(Duration::from_micros(50)));
        loop {
            flag.0.store(false, Ordering::SeqCst);
            if s.as_mut().poll(&mut cx).is_ready() {
                break;
            }
            assert!(flag.0.load(Ordering::SeqCst), "pending without a wake");
        }
        assert!(start.elapsed() >= Duration::from_micros(50));
        assert_eq!(SHORT_SLEEPS.with(|l| l.borrow().len()), 0);
    }

    /// The lost-wake-up detector (`woke_late`): a park that ends by its
    /// timeout with a task's ready flag set and no notify is counted; one
    /// with nothing ready, or ended by a waker's notify, is not. The faulty
    /// waker here sets the flag and never notifies. Fails without the
    /// detector (the count stays 0).
    #[test]
    fn a_park_timed_out_with_a_task_ready_is_counted() {
        use crate::servestats::{Counter, own};
        std::thread::spawn(|| {
            let shared = Arc::new(Shared {
                ready: vec![AtomicBool::new(false)],
                parker: Parker::new(),
            });
            // Nothing ready: the park times out, nothing is counted.
            shared.parker.take();
            idle(&shared);
            assert_eq!(own(Counter::TimedOutWithWork), 0);
            // A waker that sets the flag without notifying.
            shared.parker.take();
            shared.ready[0].swap(true, Ordering::SeqCst);
            idle(&shared);
            assert_eq!(own(Counter::TimedOutWithWork), 1);
            // A waker that does both, from another thread, later.
            shared.ready[0].store(false, Ordering::SeqCst);
            shared.parker.take();
            let s = shared.clone();
            let waker = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(2));
                s.ready[0].swap(true, Ordering::SeqCst);
                s.parker.notify();
            });
            while !shared.parker.is_notified() {
                idle(&shared);
            }
            waker.join().unwrap();
            assert_eq!(own(Counter::TimedOutWithWork), 1);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn cross_thread_wake_unparks() {
        let (tx, rx) = futures::channel::oneshot::channel::<u32>();
        let h = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            tx.send(7).unwrap();
        });
        assert_eq!(block_on(rx).unwrap(), 7);
        h.join().unwrap();
    }

    #[test]
    fn idle_hooks_run_while_waiting() {
        let calls = Rc::new(Cell::new(0u32));
        let c = calls.clone();
        let _g = register_idle_hook(Rc::new(move || c.set(c.get() + 1)));
        block_on(sleep(Duration::from_millis(1)));
        assert!(calls.get() > 0);
    }

    /// W1: a task that wakes itself through `wake_self` is polled again
    /// without its executor's parker being notified (no locked operation),
    /// also inside a nested `block_on` (the inner executor is the innermost
    /// one) and again in the outer one after it returned; a waker that is
    /// not the innermost executor's (the outer executor's while an inner
    /// one runs, another thread's, a foreign one) is woken as usual.
    #[test]
    #[allow(unsafe_code)]
    fn a_self_wake_repolls_without_notifying_and_other_wakers_are_woken() {
        /// Whether the innermost executor's parker was notified since its
        /// round began.
        fn notified() -> bool {
            let (_, shared) = INNERMOST.with(Cell::get);
            assert!(!shared.is_null(), "inside an executor");
            // SAFETY: the innermost executor is running (this is called
            // from one of its task's polls), so its `Shared` is alive.
            unsafe { (*shared).parker.is_notified() }
        }
        /// Wakes itself with `wake_self` `n` times, checking each time
        /// that the parker was not notified.
        struct SelfWaking(u32);
        impl Future for SelfWaking {
            type Output = ();
            fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
                if self.0 == 0 {
                    return Poll::Ready(());
                }
                self.0 -= 1;
                let before = notified();
                wake_self(cx.waker());
                assert_eq!(notified(), before, "a self-wake notified the parker");
                Poll::Pending
            }
        }
        // Alone, beside a task that yields, and nested.
        block_on(SelfWaking(5));
        let tasks: Vec<LocalTask<'_, u32>> = vec![
            Box::pin(async {
                SelfWaking(3).await;
                1
            }),
            Box::pin(async {
                yield_now().await;
                block_on(SelfWaking(4));
                SelfWaking(2).await;
                2
            }),
        ];
        assert_eq!(run_tasks(tasks), vec![1, 2]);
        assert!(INNERMOST.with(Cell::get).1.is_null(), "no executor left");

        /// A waker counting its wakes.
        struct Count(std::sync::atomic::AtomicU32);
        impl Wake for Count {
            fn wake(self: Arc<Self>) {
                self.wake_by_ref();
            }
            fn wake_by_ref(self: &Arc<Self>) {
                self.0.fetch_add(1, Ordering::SeqCst);
            }
        }
        let count = Arc::new(Count(Default::default()));
        let foreign = Waker::from(count.clone());
        block_on(async {
            wake_self(&foreign);
        });
        wake_self(&foreign); // outside any executor
        assert_eq!(count.0.load(Ordering::SeqCst), 2);
        // The outer executor's waker, used while an inner one runs: woken
        // as usual (its parker notified).
        block_on(std::future::poll_fn(|cx| {
            let outer = cx.waker().clone();
            block_on(std::future::poll_fn(|_| {
                wake_self(&outer);
                Poll::Ready(())
            }));
            Poll::Ready(())
        }));
        let outer_notified = Rc::new(Cell::new(false));
        let seen = outer_notified.clone();
        let mut first = true;
        block_on(std::future::poll_fn(move |cx| {
            if !first {
                return Poll::Ready(());
            }
            first = false;
            let outer = cx.waker().clone();
            let seen = seen.clone();
            block_on(std::future::poll_fn(move |_| {
                wake_self(&outer);
                Poll::Ready(())
            }));
            seen.set(notified());
            Poll::Pending
        }));
        assert!(outer_notified.get(), "the outer executor's waker notifies");
        // Another thread's executor's waker: woken (through its parker).
        let (tx, rx) = std::sync::mpsc::channel::<Waker>();
        let t = std::thread::spawn(move || {
            let mut sent = false;
            block_on(std::future::poll_fn(move |cx| {
                if sent {
                    return Poll::Ready(());
                }
                sent = true;
                tx.send(cx.waker().clone()).unwrap();
                Poll::Pending
            }));
        });
        let w = rx.recv().unwrap();
        block_on(async { wake_self(&w) });
        t.join().unwrap();
    }
}
