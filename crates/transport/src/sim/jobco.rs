//! Worker jobs as coroutines of the scheduler's thread.
//!
//! A worker job ([`super::SimCores::submit`]) used to run from its start to
//! its end inside the event that started it, and its synchronous waits
//! (`job_progress`, `sleep_blocking`, `exec::block_on`) were nested frames
//! of the scheduler. Another job that started during such a wait ran
//! inside it, to its end, so the first job resumed only after the second
//! one had finished, whatever its own wait was (a held frame: jobs that
//! overlapped in virtual time ran last in, first out; docs/simulation.md,
//! "Held frames"). Here a worker job runs on a stack of its own (a
//! `corosensei` coroutine on the same OS thread, so the thread-locals the
//! simulation reads are still there): it starts at once, as before, and a
//! synchronous wait inside it suspends it instead of nesting a frame. A
//! background task of the scheduler resumes it whenever what it waits for
//! wakes it, and it releases its core when it ends.
//!
//! Invariants:
//! 1. A job that never waits runs as before: started synchronously in its
//!    core's event, ended before that event returns, its core released by
//!    the caller (`net::run_job`). What differs is the scheduler's CPU
//!    clock after it: the event's again (invariant 2), where it used to
//!    keep the job's CPU added (which code that read it across the event,
//!    ROLEX's poller's `poll_cpu_ns`, counted as its own).
//! 2. The thread-locals that describe the code running now on a simulated
//!    core ([`JobState`]: the scheduler's CPU clock, the core, the job
//!    meter, the metering line price, the job's line set and declared
//!    work, the coroutine itself) are the job's while it runs and the
//!    resumer's otherwise: every resume swaps them in and back out, also
//!    when the job panics or is dropped suspended (its stack unwinds with
//!    its own state in place). So a job is charged its own code only, as a
//!    nested frame's `OwnCoreOnly` made sure, and the code that resumed it
//!    is not charged the job's.
//! 3. Inside a job, a wait made while the scheduler waits on the network
//!    alone (`Sched::run_alone`) still nests (it must run no other code),
//!    as do waits of code that is not a worker job (RPC handlers).
//! 4. A suspended job's tasks are polled with the waker of its background
//!    task, all of them at each resume; it suspends again until they are
//!    all done.

use super::jobwork::{self, JobMeter};
use super::{JOB_SET, JOB_WORK, METER_LINE_NS, RUNNING_CORE, Sim, lines::LineSet};
use corosensei::stack::DefaultStack;
use corosensei::{Coroutine, CoroutineResult, Yielder};
use std::cell::RefCell;
use std::future::Future;
use std::pin::Pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

/// A job's coroutine: resumed with the waker of the task that resumes it
/// (`None` the first time, from the job's core event), it yields `()` at a
/// wait and returns the job's result.
type JobCo = Coroutine<Option<Waker>, (), u64, DefaultStack>;

/// Stack of a job's coroutine: reserved, and touched only as deep as the
/// job goes.
const STACK_BYTES: usize = 8 << 20;

/// The coroutine running now, if code runs inside a worker job.
struct CoCtx {
    yielder: *const Yielder<Option<Waker>, ()>,
    /// The waker of the background task that resumed it last.
    waker: Option<Waker>,
}

thread_local! {
    static CO: RefCell<Option<CoCtx>> = const { RefCell::new(None) };
    /// Stacks of ended coroutines, for the next ones.
    static STACKS: RefCell<Vec<DefaultStack>> = const { RefCell::new(Vec::new()) };
}

/// The thread-locals of the code that runs now on a simulated core
/// (invariant 2).
struct JobState {
    /// The scheduler's CPU clock (`Sched::cpu_ns`): what other code
    /// charges while the job is suspended is not the job's, as a nested
    /// frame's `OwnCoreOnly` kept it apart.
    cpu: u64,
    core: u32,
    meter: Option<JobMeter>,
    line_ns: u64,
    set: Option<LineSet>,
    work: u64,
    co: Option<CoCtx>,
}

impl JobState {
    /// Moves the thread's values out (leaving those of no job).
    fn take() -> JobState {
        JobState {
            cpu: super::current().map_or(0, |s| s.sched.cpu_ns.get()),
            core: RUNNING_CORE.with(|c| c.replace(super::NO_CORE)),
            meter: jobwork::take_meter(),
            line_ns: METER_LINE_NS.with(|m| m.replace(0)),
            set: JOB_SET.with(|j| j.borrow_mut().take()),
            work: JOB_WORK.with(|w| w.replace(0)),
            co: CO.with(|c| c.borrow_mut().take()),
        }
    }

    /// Puts these values in; what was there is dropped.
    fn put(self) {
        if let Some(s) = super::current() {
            s.sched.cpu_ns.set(self.cpu);
        }
        RUNNING_CORE.with(|c| c.set(self.core));
        jobwork::set_meter(self.meter);
        METER_LINE_NS.with(|m| m.set(self.line_ns));
        JOB_SET.with(|j| *j.borrow_mut() = self.set);
        JOB_WORK.with(|w| w.set(self.work));
        CO.with(|c| *c.borrow_mut() = self.co);
    }

    /// A job's values at its start: the resumer's scalars (the core its
    /// event runs it on, the meter state), no line set of its own yet.
    fn start_of(outer: &JobState) -> JobState {
        JobState {
            cpu: outer.cpu,
            core: outer.core,
            meter: outer.meter,
            line_ns: outer.line_ns,
            set: None,
            work: outer.work,
            co: None,
        }
    }
}

/// Swaps `job`'s state in for the call, and back out after, also on unwind.
fn with_state<R>(job: &mut Option<JobState>, f: impl FnOnce() -> R) -> R {
    struct Back<'a> {
        job: &'a mut Option<JobState>,
        outer: Option<JobState>,
    }
    impl Drop for Back<'_> {
        fn drop(&mut self) {
            *self.job = Some(JobState::take());
            if let Some(o) = self.outer.take() {
                o.put();
            }
        }
    }
    let outer = JobState::take();
    job.take().expect("a job's state").put();
    let _back = Back {
        job,
        outer: Some(outer),
    };
    f()
}

/// Runs `body` as a worker job. Returns its result if it ended without
/// waiting; else `None`, and `finish` gets the result when it ends (from
/// the background task that resumes it).
pub(crate) fn run(
    sim: &Rc<Sim>,
    body: Box<dyn FnOnce() -> u64>,
    finish: Box<dyn FnOnce(u64)>,
) -> Option<u64> {
    let stack = STACKS
        .with(|s| s.borrow_mut().pop())
        .map_or_else(|| DefaultStack::new(STACK_BYTES), Ok)
        .expect("a coroutine stack");
    let mut co: JobCo = Coroutine::with_stack(stack, move |y: &Yielder<Option<Waker>, ()>, w| {
        CO.with(|c| {
            *c.borrow_mut() = Some(CoCtx {
                yielder: y as *const _,
                waker: w,
            })
        });
        body()
    });
    let outer_now = JobState::take();
    let mut state = Some(JobState::start_of(&outer_now));
    outer_now.put();
    let first = with_state(&mut state, || co.resume(None));
    match first {
        CoroutineResult::Return(r) => {
            recycle(co);
            Some(r)
        }
        CoroutineResult::Yield(()) => {
            sim.sched.job_suspended();
            let task = Suspended {
                co: Some(co),
                state,
                finish: Some(finish),
            };
            sim.sched.spawn_background(Box::pin(task));
            None
        }
    }
}

/// Keeps an ended coroutine's stack for the next job.
fn recycle(co: JobCo) {
    if co.done() {
        let stack = co.into_stack();
        STACKS.with(|s| s.borrow_mut().push(stack));
    }
}

/// A suspended worker job, as a background task of the scheduler.
struct Suspended {
    co: Option<JobCo>,
    state: Option<JobState>,
    finish: Option<Box<dyn FnOnce(u64)>>,
}

impl Future for Suspended {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        let this = &mut *self;
        let co = this.co.as_mut().expect("polled after it ended");
        let waker = cx.waker().clone();
        match with_state(&mut this.state, || co.resume(Some(waker))) {
            CoroutineResult::Yield(()) => Poll::Pending,
            CoroutineResult::Return(r) => {
                recycle(this.co.take().expect("the coroutine"));
                (this.finish.take().expect("finished once"))(r);
                ended_one();
                Poll::Ready(())
            }
        }
    }
}

impl Drop for Suspended {
    /// A job dropped while suspended (the simulation ends first) unwinds
    /// its stack with its own thread-locals in place (invariant 2).
    fn drop(&mut self) {
        if let Some(mut co) = self.co.take() {
            if co.started() && !co.done() && self.state.is_some() {
                with_state(&mut self.state, || co.force_unwind());
            }
            ended_one();
        }
    }
}

/// One suspended job ended, or was dropped (not counted while its
/// simulation is torn down: it is no longer current then, and goes with
/// its count).
fn ended_one() {
    if let Some(sim) = super::current() {
        sim.sched.job_ended();
    }
}

/// Whether code runs inside a worker job that can suspend.
pub(crate) fn in_job() -> bool {
    CO.with(|c| c.borrow().is_some())
}

/// Runs `tasks` to completion by suspending the worker job that runs now
/// (invariant 4); call only when [`in_job`].
#[allow(unsafe_code)] // the one dereference of the coroutine's yielder
pub(crate) fn wait_in_job<'a, T>(mut tasks: Vec<crate::exec::LocalTask<'a, T>>) -> Vec<T> {
    let mut out: Vec<Option<T>> = (0..tasks.len()).map(|_| None).collect();
    let mut left = tasks.len();
    loop {
        let waker = CO.with(|c| c.borrow().as_ref().and_then(|c| c.waker.clone()));
        if let Some(w) = waker {
            let mut cx = Context::from_waker(&w);
            for (task, slot) in tasks.iter_mut().zip(out.iter_mut()) {
                if slot.is_none()
                    && let Poll::Ready(v) = task.as_mut().poll(&mut cx)
                {
                    *slot = Some(v);
                    left -= 1;
                }
            }
            if left == 0 {
                return out.into_iter().map(|v| v.expect("done")).collect();
            }
        }
        let y = CO.with(|c| c.borrow().as_ref().expect("in a job").yielder);
        // SAFETY: `y` is the running coroutine's own yielder, set at its
        // start; the coroutine (and so the yielder on its stack) lives
        // until it returns, and this code runs on that coroutine's stack.
        let w = unsafe { &*y }.suspend(());
        CO.with(|c| {
            if let Some(ctx) = c.borrow_mut().as_mut() {
                ctx.waker = w;
            }
        });
    }
}
