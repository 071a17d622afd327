//! CPU time of the calling thread, for charging RPC handlers and background
//! workers with what they really consumed (not wall time, which a shared
//! machine inflates).

/// Nanoseconds of CPU time the calling thread has used; inside a simulation,
/// the virtual CPU time of the simulated core that runs (see `sim`).
pub fn thread_cpu_ns() -> u64 {
    if let Some(v) = crate::sim::cpu_ns() {
        return v;
    }
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_THREAD_CPUTIME_ID is
    // supported on every Linux we run on, and on failure `ts` stays zero.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    if rc != 0 {
        return 0;
    }
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

/// Code on a compute thread touched `lines` cache lines of its own node's
/// memory that no [`crate::RegionMem`] access reports (a latch word, a
/// translation-table bucket, a frame's bookkeeping words): inside an
/// operation run by [`crate::Endpoint::charged`] on `sim` they are charged
/// to the thread's core with the region lines it touched; anywhere else
/// (other backends, memory-node code, code outside `charged`) nothing
/// happens. Count one line per access of a word, as a region access of one
/// word counts one (docs/simulation.md, "The hardware model").
#[inline]
pub fn touch_local_lines(lines: u64) {
    crate::sim::touch_local(lines)
}

/// Measures a short stretch of a handler thread's work (one RPC and its
/// reply) without a system call: `clock_gettime(CLOCK_THREAD_CPUTIME_ID)` is
/// a real system call on many hosts (~0.5 µs), far more than a memory node's
/// handler costs, so calling it around every RPC would mostly measure
/// itself.
///
/// On x86-64 this reads the time-stamp counter (invariant on every CPU we
/// run on), converted to nanoseconds at a rate calibrated once per process
/// against the monotonic clock. It is elapsed time, not CPU time: if the OS
/// deschedules the thread inside the stretch, that time is charged too. The
/// stretches measured are sub-microsecond and handler threads poll instead of
/// sleeping, so this is rare; the node-wide totals of [`thread_cpu_ns`] over a
/// whole run bound it. Elsewhere it falls back to the monotonic clock.
#[derive(Debug, Clone, Copy)]
pub struct CpuStopwatch {
    start: u64,
}

impl CpuStopwatch {
    /// Starts measuring now.
    #[inline]
    pub fn start() -> CpuStopwatch {
        // Under `sim`: the simulated core's virtual CPU, less the message's
        // fixed cost, so that elapsed time is the modelled service time.
        if let Some(v) = crate::sim::cpu_ns() {
            return CpuStopwatch {
                start: v.saturating_sub(crate::sim::rpc_overhead_ns()),
            };
        }
        CpuStopwatch { start: ticks() }
    }

    /// Nanoseconds since [`CpuStopwatch::start`].
    #[inline]
    pub fn elapsed_ns(&self) -> u64 {
        if let Some(v) = crate::sim::cpu_ns() {
            return v.saturating_sub(self.start);
        }
        ticks_to_ns(ticks().saturating_sub(self.start))
    }
}

#[cfg(target_arch = "x86_64")]
#[inline]
fn ticks() -> u64 {
    // SAFETY: RDTSC is available on every x86-64 CPU and has no preconditions.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(target_arch = "x86_64")]
fn ticks_to_ns(ticks: u64) -> u64 {
    // Nanoseconds per tick as a 32.32 fixed-point factor.
    static NS_PER_TICK_32: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    let f = *NS_PER_TICK_32.get_or_init(calibrate);
    ((ticks as u128 * f as u128) >> 32) as u64
}

/// Ticks of the time-stamp counter against the monotonic clock over a few
/// milliseconds (once per process).
#[cfg(target_arch = "x86_64")]
fn calibrate() -> u64 {
    use std::time::{Duration, Instant};
    let (t0, c0) = (Instant::now(), ticks());
    while t0.elapsed() < Duration::from_millis(5) {
        std::hint::spin_loop();
    }
    let (ns, c1) = (t0.elapsed().as_nanos() as u64, ticks());
    let dticks = (c1 - c0).max(1);
    (((ns as u128) << 32) / dticks as u128) as u64
}

#[cfg(not(target_arch = "x86_64"))]
fn ticks() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

#[cfg(not(target_arch = "x86_64"))]
fn ticks_to_ns(ticks: u64) -> u64 {
    ticks
}

#[cfg(test)]
mod tests {
    #[test]
    fn advances_with_work() {
        let a = super::thread_cpu_ns();
        let mut x = 0u64;
        for i in 0..5_000_000u64 {
            x = x.wrapping_mul(31).wrapping_add(i);
        }
        std::hint::black_box(x);
        let b = super::thread_cpu_ns();
        assert!(b > a);
    }

    #[test]
    fn stopwatch_agrees_with_the_monotonic_clock() {
        // Not a timing assertion on the code: it checks the calibration, by
        // comparing two clocks over the same sleep (after calibrating, which
        // takes a few milliseconds itself).
        let _ = super::CpuStopwatch::start().elapsed_ns();
        let w = super::CpuStopwatch::start();
        let t = std::time::Instant::now();
        std::thread::sleep(std::time::Duration::from_millis(20));
        let (sw, mono) = (w.elapsed_ns(), t.elapsed().as_nanos() as u64);
        assert!(
            sw * 10 >= mono * 9 && sw * 10 <= mono * 11,
            "{sw} vs {mono}"
        );
    }
}
