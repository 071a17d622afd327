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
    pin_current_thread(cpu).then_some(cpu)
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
    pin_current_thread(cpu).then_some(cpu)
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
