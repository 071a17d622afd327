//! How much of the run the compute threads actually ran, from the kernel's
//! per-thread scheduler statistics (`/proc/thread-self/schedstat`, Linux):
//! time on a CPU, time waiting on a run queue for one, and the number of
//! time slices. Read twice per compute thread (before its first operation
//! and after its last), never per operation.
//!
//! On a host shared with other busy processes a compute thread may spend as
//! long waiting for a core as running, and then wall-clock throughput says
//! more about the host than about dmkv; operations per second *on CPU*
//! does not depend on how often the thread was descheduled (it still
//! depends on what other processes leave in the shared caches).
//!
//! `sched` (the run's scheduling evidence for every thread, read from the
//! outside, with the host's CPU use) reuses [`Sched::parse`].

use serde::Serialize;

/// One reading for the calling thread, or a difference of two.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Sched {
    pub on_cpu_ns: u64,
    pub runqueue_wait_ns: u64,
    pub timeslices: u64,
}

impl Sched {
    /// The calling thread's figures so far; None where the kernel does not
    /// provide them.
    pub fn now() -> Option<Sched> {
        let text = std::fs::read_to_string("/proc/thread-self/schedstat").ok()?;
        Sched::parse(&text)
    }

    /// Parses the file's one line: three unsigned numbers.
    pub fn parse(text: &str) -> Option<Sched> {
        let mut it = text.split_ascii_whitespace().map(|w| w.parse::<u64>().ok());
        Some(Sched {
            on_cpu_ns: it.next()??,
            runqueue_wait_ns: it.next()??,
            timeslices: it.next()??,
        })
    }

    /// `self - earlier` (saturating: the counters only grow).
    pub fn since(&self, earlier: &Sched) -> Sched {
        Sched {
            on_cpu_ns: self.on_cpu_ns.saturating_sub(earlier.on_cpu_ns),
            runqueue_wait_ns: self
                .runqueue_wait_ns
                .saturating_sub(earlier.runqueue_wait_ns),
            timeslices: self.timeslices.saturating_sub(earlier.timeslices),
        }
    }

    pub fn merge(&mut self, o: &Sched) {
        self.on_cpu_ns += o.on_cpu_ns;
        self.runqueue_wait_ns += o.runqueue_wait_ns;
        self.timeslices += o.timeslices;
    }
}

/// The compute threads' scheduling over the run phase, summed over threads
/// (real transports only; under `sim` the run is virtual).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ComputeSchedReport {
    /// Time the compute threads ran on a CPU, all threads together.
    pub on_cpu_seconds: f64,
    /// Time they were runnable but waiting for a CPU.
    pub runqueue_wait_seconds: f64,
    pub timeslices: u64,
    /// Operations per second of compute-thread CPU time.
    pub ops_per_cpu_second: f64,
    /// CPU time per operation, nanoseconds.
    pub cpu_ns_per_op: f64,
}

impl ComputeSchedReport {
    pub fn new(s: &Sched, ops: u64) -> ComputeSchedReport {
        let cpu = s.on_cpu_ns as f64 / 1e9;
        ComputeSchedReport {
            on_cpu_seconds: cpu,
            runqueue_wait_seconds: s.runqueue_wait_ns as f64 / 1e9,
            timeslices: s.timeslices,
            ops_per_cpu_second: if cpu > 0.0 { ops as f64 / cpu } else { 0.0 },
            cpu_ns_per_op: if ops > 0 {
                s.on_cpu_ns as f64 / ops as f64
            } else {
                0.0
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_kernels_line_and_refuses_anything_else() {
        assert_eq!(
            Sched::parse("217011781 613945118 70\n"),
            Some(Sched {
                on_cpu_ns: 217011781,
                runqueue_wait_ns: 613945118,
                timeslices: 70
            })
        );
        assert_eq!(Sched::parse("1 2"), None);
        assert_eq!(Sched::parse("1 x 3"), None);
        assert_eq!(Sched::parse(""), None);
    }

    #[test]
    fn differences_and_sums() {
        let a = Sched {
            on_cpu_ns: 10,
            runqueue_wait_ns: 5,
            timeslices: 1,
        };
        let b = Sched {
            on_cpu_ns: 25,
            runqueue_wait_ns: 9,
            timeslices: 4,
        };
        let mut d = b.since(&a);
        assert_eq!((d.on_cpu_ns, d.runqueue_wait_ns, d.timeslices), (15, 4, 3));
        d.merge(&a);
        assert_eq!((d.on_cpu_ns, d.runqueue_wait_ns, d.timeslices), (25, 9, 4));
        let r = ComputeSchedReport::new(&d, 5);
        assert_eq!(r.cpu_ns_per_op, 5.0);
        assert_eq!(r.ops_per_cpu_second, 5.0 / 25e-9);
    }

    #[test]
    fn a_busy_thread_is_seen_on_cpu() {
        // Linux only; elsewhere there is nothing to read.
        let Some(before) = Sched::now() else { return };
        let mut x = 0u64;
        for i in 0..20_000_000u64 {
            x = std::hint::black_box(x.wrapping_mul(31).wrapping_add(i));
        }
        let d = Sched::now().expect("readable once").since(&before);
        assert!(d.on_cpu_ns > 0, "{d:?} after {x}");
    }
}
