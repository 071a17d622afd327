//! Optional CPU placement of RPC handler and compute threads on real
//! threads (`dmkv bench --pin-threads`).
//!
//! Without it the OS decides where the threads run, and with one handler
//! and one compute thread on a 2-CPU host it sometimes puts them on one CPU
//! and sometimes on two, which serve RPCs at different rates
//! (docs/performance.md, "Eighth pass"). With a plan in force, handler
//! thread `h` of every node runs only on `plan.handlers[h % len]` and
//! compute thread `t` only on `plan.compute[t % len]`.
//!
//! [`Plan::distinct`] gives each thread a CPU of its own when the process
//! may use enough CPUs (handlers from the last allowed CPU downwards,
//! compute threads from the first upwards), and refuses otherwise: pinning
//! more busy threads than CPUs would make them share by force.
//! [`Plan::shared`] puts every thread on one CPU (a measurement setting: it
//! reproduces the one-CPU mode on purpose).

use parking_lot::Mutex;
use std::cell::Cell;
use std::sync::atomic::{AtomicU32, Ordering};

/// Which CPU each handler and compute thread runs on.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    pub handlers: Vec<usize>,
    pub compute: Vec<usize>,
}

impl Plan {
    /// One CPU of its own for each of `handlers` handler threads and
    /// `compute` compute threads, from the CPUs this process may use; an
    /// error saying why when there are not enough.
    pub fn distinct(handlers: usize, compute: usize) -> Result<Plan, String> {
        let cpus = allowed_cpus().ok_or("the CPUs this process may use are unknown here")?;
        Plan::distinct_from(&cpus, handlers, compute)
    }

    /// [`Plan::distinct`] from a given CPU list.
    pub fn distinct_from(cpus: &[usize], handlers: usize, compute: usize) -> Result<Plan, String> {
        if handlers + compute > cpus.len() {
            return Err(format!(
                "{handlers} handler and {compute} compute threads need {} CPUs of their own; \
                 this process may use {} ({cpus:?})",
                handlers + compute,
                cpus.len()
            ));
        }
        Ok(Plan {
            compute: cpus[..compute].to_vec(),
            handlers: cpus[cpus.len() - handlers..]
                .iter()
                .rev()
                .copied()
                .collect(),
        })
    }

    /// Every thread on the first CPU this process may use.
    pub fn shared() -> Result<Plan, String> {
        let cpus = allowed_cpus().ok_or("the CPUs this process may use are unknown here")?;
        let first = *cpus.first().ok_or("no CPU allowed")?;
        Ok(Plan {
            handlers: vec![first],
            compute: vec![first],
        })
    }
}

static PLAN: Mutex<Option<Plan>> = Mutex::new(None);

/// Puts `plan` in force for threads that start serving or computing from
/// now on (`None`: leave placement to the OS).
pub fn set_plan(plan: Option<Plan>) {
    *PLAN.lock() = plan;
}

/// The plan in force.
pub fn plan() -> Option<Plan> {
    PLAN.lock().clone()
}

/// Pins the calling thread as handler thread `index` if a plan is in force;
/// the CPU it was pinned to.
pub fn pin_handler(index: usize) -> Option<usize> {
    let cpu = PLAN
        .lock()
        .as_ref()
        .and_then(|p| p.handlers.get(index % p.handlers.len().max(1)).copied())?;
    pin_and_note(cpu)
}

/// Pins the calling thread to `cpu` and, if the OS agreed, counts it there
/// ([`alone_on_own_cpu`]).
fn pin_and_note(cpu: usize) -> Option<usize> {
    pin_current_thread(cpu).then(|| {
        note_pinned(cpu);
        cpu
    })
}

/// CPUs [`PINNED`] keeps counts for (Linux's `CPU_SETSIZE`); a thread
/// pinned beyond them is never counted alone.
const COUNTED_CPUS: usize = 1024;

/// Per CPU: the threads of this process that [`pin_handler`] or
/// [`pin_compute`] pinned there and that are still running (P1: a thread
/// counts on one CPU at most, and its count goes when it exits, by
/// [`PinnedHere`]'s drop).
static PINNED: [AtomicU32; COUNTED_CPUS] = [const { AtomicU32::new(0) }; COUNTED_CPUS];

/// The CPU the calling thread was pinned to and counted on, if any; takes
/// the count back when the thread exits.
struct PinnedHere(Cell<Option<usize>>);

impl Drop for PinnedHere {
    fn drop(&mut self) {
        if let Some(cpu) = self.0.get() {
            PINNED[cpu].fetch_sub(1, Ordering::Relaxed);
        }
    }
}

thread_local! {
    static PINNED_HERE: PinnedHere = const { PinnedHere(Cell::new(None)) };
}

/// Counts the calling thread on `cpu` (and no longer on the CPU it was
/// counted on before, P1).
fn note_pinned(cpu: usize) {
    if cpu >= COUNTED_CPUS {
        return;
    }
    let _ = PINNED_HERE.try_with(|p| {
        if let Some(old) = p.0.replace(Some(cpu)) {
            PINNED[old].fetch_sub(1, Ordering::Relaxed);
        }
        PINNED[cpu].fetch_add(1, Ordering::Relaxed);
    });
}

/// Whether the calling thread is pinned to a CPU that no other pinned
/// thread of this process runs on. Then yielding that CPU between polls
/// helps no thread of ours (the handler or compute thread it waits for
/// runs elsewhere), and under a scheduler that runs another process there
/// it hands that process a whole time slice, milliseconds, per yield: an
/// idle loop should spin instead. Unpinned threads (timers, background
/// workers) are not counted; they wake onto the CPU within a time slice
/// either way, and the spins end in a park or a block soon.
pub fn alone_on_own_cpu() -> bool {
    PINNED_HERE
        .try_with(|p| p.0.get())
        .ok()
        .flatten()
        .is_some_and(|cpu| PINNED[cpu].load(Ordering::Relaxed) == 1)
}

/// One pause of an idle poll loop (a handler's or an executor's): a
/// `sched_yield` when `yield_cpu` (another thread of ours may need this
/// CPU), else a spin hint (see [`alone_on_own_cpu`] for why). Whether it
/// yielded, for the loop's counts.
#[inline]
pub fn pause_between_polls(yield_cpu: bool) -> bool {
    if yield_cpu {
        std::thread::yield_now();
    } else {
        std::hint::spin_loop();
    }
    yield_cpu
}

/// Whether handler thread `index` is planned on a CPU that a compute
/// thread is planned on too (`--pin-threads shared`): then every cycle it
/// polls is a cycle the thread that sends its next request cannot run.
pub fn handler_shares_cpu(index: usize) -> bool {
    PLAN.lock().as_ref().is_some_and(|p| {
        p.handlers
            .get(index % p.handlers.len().max(1))
            .is_some_and(|cpu| p.compute.contains(cpu))
    })
}

/// Pins the calling thread as compute thread `index` if a plan is in force;
/// the CPU it was pinned to.
pub fn pin_compute(index: usize) -> Option<usize> {
    let cpu = PLAN
        .lock()
        .as_ref()
        .and_then(|p| p.compute.get(index % p.compute.len().max(1)).copied())?;
    pin_and_note(cpu)
}

/// Restricts the calling thread to `cpu`; false if the OS refused.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub fn pin_current_thread(cpu: usize) -> bool {
    if cpu >= libc::CPU_SETSIZE as usize {
        return false;
    }
    // SAFETY: `set` is a plain bit set, zeroed and then given one bit below
    // CPU_SETSIZE (checked above); sched_setaffinity with pid 0 changes only
    // the calling thread and reads `size_of::<cpu_set_t>()` bytes of `set`.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        libc::CPU_SET(cpu, &mut set);
        libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
    }
}

#[cfg(not(target_os = "linux"))]
pub fn pin_current_thread(_cpu: usize) -> bool {
    false
}

/// The CPUs the calling thread may run on, in increasing order.
#[cfg(target_os = "linux")]
#[allow(unsafe_code)]
pub fn allowed_cpus() -> Option<Vec<usize>> {
    // SAFETY: sched_getaffinity with pid 0 writes at most
    // `size_of::<cpu_set_t>()` bytes into `set`, which is that large;
    // CPU_ISSET reads bits below CPU_SETSIZE only.
    unsafe {
        let mut set: libc::cpu_set_t = std::mem::zeroed();
        if libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) != 0 {
            return None;
        }
        Some(
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| libc::CPU_ISSET(c, &set))
                .collect(),
        )
    }
}

#[cfg(not(target_os = "linux"))]
pub fn allowed_cpus() -> Option<Vec<usize>> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn distinct_plans_give_each_thread_its_own_cpu_or_refuse() {
        let p = Plan::distinct_from(&[0, 1], 1, 1).unwrap();
        assert_eq!(
            p,
            Plan {
                handlers: vec![1],
                compute: vec![0]
            }
        );
        let p = Plan::distinct_from(&[2, 3, 5, 7], 2, 2).unwrap();
        assert_eq!(
            p,
            Plan {
                handlers: vec![7, 5],
                compute: vec![2, 3]
            }
        );
        let e = Plan::distinct_from(&[0, 1], 1, 2).unwrap_err();
        assert!(e.contains("need 3 CPUs"), "{e}");
    }

    /// Counting without pinning, on a CPU number no real CPU has (so no
    /// other test's threads count there): one thread alone, a second one
    /// on the same CPU makes neither alone, and when it exits the first is
    /// alone again; a thread never counted is not alone.
    #[test]
    fn a_thread_is_alone_on_its_cpu_until_another_pins_there() {
        const CPU: usize = COUNTED_CPUS - 1;
        assert!(!alone_on_own_cpu(), "this test thread was never counted");
        let (to_first, first_rx) = std::sync::mpsc::channel::<()>();
        let (from_first, first_says) = std::sync::mpsc::channel::<bool>();
        let first = std::thread::spawn(move || {
            note_pinned(CPU);
            from_first.send(alone_on_own_cpu()).unwrap();
            first_rx.recv().unwrap();
            from_first.send(alone_on_own_cpu()).unwrap();
            first_rx.recv().unwrap();
            from_first.send(alone_on_own_cpu()).unwrap();
        });
        assert!(first_says.recv().unwrap(), "alone on its CPU");
        let (release_second, second_rx) = std::sync::mpsc::channel::<()>();
        let second = std::thread::spawn(move || {
            note_pinned(CPU);
            to_first.send(()).unwrap();
            let me = alone_on_own_cpu();
            // Stays (counted) until the first thread has looked.
            second_rx.recv().unwrap();
            (me, to_first)
        });
        assert!(!first_says.recv().unwrap(), "a second thread counts there");
        release_second.send(()).unwrap();
        let (second_alone, to_first) = second.join().unwrap();
        assert!(!second_alone);
        // The second thread has exited: its count went with it.
        to_first.send(()).unwrap();
        assert!(first_says.recv().unwrap(), "alone again");
        first.join().unwrap();
        assert_eq!(PINNED[CPU].load(Ordering::Relaxed), 0);
        // Counted again elsewhere: no longer on the first CPU (P1).
        std::thread::spawn(|| {
            note_pinned(CPU);
            note_pinned(CPU - 1);
            assert_eq!(PINNED[CPU].load(Ordering::Relaxed), 0);
            assert!(alone_on_own_cpu());
        })
        .join()
        .unwrap();
        assert_eq!(PINNED[CPU - 1].load(Ordering::Relaxed), 0);
    }

    #[cfg(target_os = "linux")]
    #[test]
    fn a_pinned_thread_runs_only_on_its_cpu() {
        let cpus = allowed_cpus().expect("readable on Linux");
        assert!(!cpus.is_empty());
        let last = *cpus.last().unwrap();
        std::thread::spawn(move || {
            assert!(pin_current_thread(last));
            assert_eq!(allowed_cpus().unwrap(), vec![last]);
            for _ in 0..1000 {
                std::thread::yield_now();
                // SAFETY: sched_getcpu has no preconditions.
                #[allow(unsafe_code)]
                let on = unsafe { libc::sched_getcpu() };
                assert_eq!(on as usize, last);
            }
        })
        .join()
        .unwrap();
        assert!(!pin_current_thread(libc::CPU_SETSIZE as usize));
    }
}
