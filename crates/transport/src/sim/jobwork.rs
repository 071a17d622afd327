//! Long background jobs that let virtual time pass as they work.
//!
//! A job on a simulated core ([`super::SimCores`]) runs in one virtual
//! instant and then holds its core for its metered cost. That is right for
//! short jobs, but a job that rebuilds an index (Outback's resize) would
//! then change everything at once and take no time that requests can fall
//! into. [`job_progress`] lets such a job pass the CPU it has been charged
//! so far *now*, at a point where it holds no lock, while the rest of the
//! simulation runs (the job suspends, `super::jobco`; a nested frame
//! where it cannot), so that its steps are spread over virtual time as a
//! real worker's are.
//!
//! Invariants:
//! 1. A job's CPU is counted once: what [`job_progress`] passed is not
//!    charged again when the job returns (`JobMeter::spent`), and the CPU
//!    metered by code that ran during a progress wait (handlers, other
//!    jobs, verbs landing) is not the job's (`JobMeter::excluded`).
//! 2. On its own core the job keeps that core for the whole wait; shared
//!    with a node's handler cores, its work occupies one of those cores in
//!    the cores' ready order (a slice is ready when submitted), at most
//!    `slice_ns` at a time, and after each slice, if ready requests wait
//!    there, it lets them have the core for as long as its slice (two
//!    runnable threads on one core take equal turns, as an OS scheduler
//!    gives them).
//! 3. Outside a simulation, or outside a job, [`job_progress`] does nothing.
//! 4. A progress point ends a slice of the job for the distinct-lines rule
//!    (`sim::job_lines`): a line the job touched before it is charged again
//!    at its first touch after it (the wait let other work use the core and
//!    virtual time pass; the line is no longer assumed to be in L1). A
//!    progress point that passes nothing (no CPU charged since the last)
//!    returns at once and keeps the set.

use super::{COUNT_LOCAL, METER_LINE_NS, Sim, current, net, sleep_until_ns, with_metering};
use crate::addr::NodeId;
use std::cell::{Cell, RefCell};
use std::rc::Rc;
use std::task::{Poll, Waker};

/// The CPU accounting of the job that runs now.
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct JobMeter {
    /// `sched.cpu_ns` at the job's start or its last progress point.
    mark: u64,
    /// CPU already passed in virtual time on the job's own core.
    pub(crate) spent_own: u64,
    /// CPU already passed on a node's handler cores.
    pub(crate) spent_shared: u64,
    /// CPU metered by other code during progress waits (invariant 1).
    pub(crate) excluded: u64,
}

thread_local! {
    static JOB: Cell<Option<JobMeter>> = const { Cell::new(None) };
}

/// The meter of the job running now, moved out (`jobco` swaps it).
pub(crate) fn take_meter() -> Option<JobMeter> {
    JOB.with(|j| j.take())
}

/// Puts a job's meter in (`jobco`).
pub(crate) fn set_meter(m: Option<JobMeter>) {
    JOB.with(|j| j.set(m));
}

/// Runs `f` as a job's body with a fresh meter; returns the meter after.
pub(crate) fn metered<R>(sim: &Sim, f: impl FnOnce() -> R) -> (R, JobMeter) {
    let prev = JOB.with(|j| {
        j.replace(Some(JobMeter {
            mark: sim.sched.cpu_ns.get(),
            ..JobMeter::default()
        }))
    });
    struct Restore(Option<JobMeter>);
    impl Drop for Restore {
        fn drop(&mut self) {
            JOB.with(|j| j.set(self.0));
        }
    }
    let restore = Restore(prev);
    let r = f();
    let meter = JOB.with(|j| j.get()).unwrap_or_default();
    drop(restore);
    (r, meter)
}

/// Charges `lines` cache lines of memory no backend registered (a job's
/// private arrays) at the flat `line_ns`, when code runs on a simulated
/// core (the rule for unregistered memory, docs/simulation.md).
///
/// Inside a compute operation counted for its own lines
/// (`Endpoint::charged`, where the meter holds `COUNT_LOCAL` rather than a
/// price) the lines are that operation's: they are noted as
/// [`crate::touch_local_lines`] notes are, and charged once, when the
/// operation ends, on its compute core. (This used to multiply by the
/// marker itself, `u64::MAX`: a wrapped, negative charge on whatever core
/// ran, and nothing for the operation.) Outside a simulation, or where
/// nothing meters, it does nothing.
pub fn charge_private_lines(lines: u64) {
    let line_ns = METER_LINE_NS.with(|m| m.get());
    if line_ns == 0 || lines == 0 {
        return;
    }
    if line_ns == COUNT_LOCAL {
        super::touch_local(lines);
        return;
    }
    if let Some(s) = current() {
        s.sched.cpu_ns.set(
            s.sched
                .cpu_ns
                .get()
                .saturating_add(lines.saturating_mul(line_ns)),
        );
    }
}

/// A progress point of a long job: the CPU it was charged since it started
/// or since its last progress point passes in virtual time now, while the
/// rest of the simulation runs. With `share`, that work is done on `share`'s
/// handler cores, in turn with the requests queued there, `slice_ns` at a
/// time (invariant 2); else on the job's own core. Call it only where the
/// job holds no lock that code of the simulation may take.
pub fn job_progress(share: Option<NodeId>, slice_ns: u64) {
    let Some(sim) = current() else { return };
    let Some(mut m) = JOB.with(|j| j.get()) else {
        return;
    };
    let before = sim.sched.cpu_ns.get();
    let pending = before - m.mark;
    if pending == 0 {
        return;
    }
    let coreset = share.and_then(|n| net::handler_coreset(&sim.net.borrow(), n));
    // The wait is not the job's code: nothing that lands meanwhile is
    // metered to it (handlers meter themselves).
    with_metering(0, || match coreset {
        None => {
            let until = sim.sched.now() + pending;
            crate::exec::block_on(sleep_until_ns(until));
        }
        Some(id) => {
            let slice = slice_ns.max(1);
            let mut left = pending;
            while left > 0 {
                let q = left.min(slice);
                occupy(&sim, id, q);
                left -= q;
                if left > 0 && net::coreset_queued(&sim.net.borrow(), id, sim.sched.now()) > 0 {
                    let until = sim.sched.now() + q;
                    crate::exec::block_on(sleep_until_ns(until));
                }
            }
        }
    });
    // What the job touches from here on is a new slice of work: its lines
    // are charged again (invariant 4).
    super::restart_job_lines();
    let after = sim.sched.cpu_ns.get();
    m.excluded += after - before;
    m.mark = after;
    if coreset.is_some() {
        m.spent_shared += pending;
    } else {
        m.spent_own += pending;
    }
    JOB.with(|j| j.set(Some(m)));
}

/// Holds one core of core set `id` for `ns` (queued behind what waits
/// there) and returns when that time is over.
fn occupy(sim: &Rc<Sim>, id: usize, ns: u64) {
    let started: Rc<Cell<Option<u64>>> = Rc::new(Cell::new(None));
    let waker: Rc<RefCell<Option<Waker>>> = Rc::new(RefCell::new(None));
    let (s2, w2) = (started.clone(), waker.clone());
    let s = sim.clone();
    net::submit_job(
        sim,
        id,
        sim.sched.now(),
        Box::new(move || {
            s2.set(Some(s.sched.now()));
            if let Some(w) = w2.borrow_mut().take() {
                w.wake();
            }
            ns
        }),
    );
    crate::exec::block_on(async {
        let at = std::future::poll_fn(|cx| match started.get() {
            Some(t) => Poll::Ready(t),
            None => {
                *waker.borrow_mut() = Some(cx.waker().clone());
                Poll::Pending
            }
        })
        .await;
        sleep_until_ns(at + ns).await;
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sim::{LOCAL_LINES, Profile, SimConfig, Simulation};

    fn sim() -> Simulation {
        Simulation::new(SimConfig {
            profile: Profile::default_profile(),
            seed: 1,
            jitter_ns: 0,
            delays: Default::default(),
        })
    }

    /// On a metered memory-node core a private line costs the meter's
    /// `line_ns`; where nothing meters, nothing.
    #[test]
    fn private_lines_cost_line_ns_on_a_metered_core() {
        let s = sim();
        let cpu = || current().expect("in a simulation").sched.cpu_ns.get();
        let c0 = cpu();
        charge_private_lines(10);
        assert_eq!(cpu(), c0, "not metering: free");
        with_metering(7, || charge_private_lines(10));
        assert_eq!(cpu(), c0 + 70);
        with_metering(7, || charge_private_lines(0));
        assert_eq!(cpu(), c0 + 70);
        drop(s);
    }

    /// Inside a compute operation counted for its own lines the private
    /// lines are the operation's notes (charged when it ends), not a
    /// charge on the core now: before the fix this added `10 * u64::MAX`
    /// (wrapped) to the CPU clock and counted nothing.
    #[test]
    fn private_lines_inside_a_charged_operation_are_its_own() {
        let s = sim();
        let cpu = || current().expect("in a simulation").sched.cpu_ns.get();
        let c0 = cpu();
        let before = LOCAL_LINES.with(|l| l.get());
        with_metering(COUNT_LOCAL, || charge_private_lines(10));
        assert_eq!(cpu(), c0, "no charge on the core now");
        assert_eq!(LOCAL_LINES.with(|l| l.get()), before + 10);
        LOCAL_LINES.with(|l| l.set(before));
        drop(s);
    }
}
