//! CPU time of the calling thread, for charging RPC handlers and background
//! workers with what they really consumed (not wall time, which a shared
//! machine inflates).

use std::cell::Cell;

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
/// happens. These notes carry no address, so they are charged as given,
/// not deduplicated: prefer [`touch_local_at`], which counts an object
/// once per operation however often it is touched, as the region lines are
/// (docs/simulation.md, "Distinct lines per operation").
#[inline]
pub fn touch_local_lines(lines: u64) {
    crate::sim::touch_local(lines)
}

/// Code on a compute thread touched `obj` (a latch word, a bucket, a
/// frame's bookkeeping word) in its own node's memory outside any
/// [`crate::RegionMem`]: inside an operation run by
/// [`crate::Endpoint::charged`] on `sim` it is one line of that operation,
/// counted once however many times the operation touches it (a later touch
/// hits L1); anywhere else nothing happens. Two different objects count as
/// two lines even if they share a cache line (whether they do depends on
/// where the allocator put them, which must not change a simulated run).
#[inline]
pub fn touch_local_at<T: ?Sized>(obj: &T) {
    crate::sim::touch_local_object((obj as *const T).cast::<u8>() as u64)
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

    /// Nanoseconds since [`CpuStopwatch::start`], scaled by the fraction
    /// of its busy time this thread recently spent on a CPU (see
    /// [`BusyClock`]; 1 on threads that do not report busy stretches).
    #[inline]
    pub fn elapsed_ns(&self) -> u64 {
        if let Some(v) = crate::sim::cpu_ns() {
            return v.saturating_sub(self.start);
        }
        let ns = ticks_to_ns(ticks().saturating_sub(self.start));
        let scale = ON_CPU_SCALE.with(Cell::get);
        ((ns as u128 * scale as u128) >> 32) as u64
    }
}

/// `ns` scaled by the calling thread's on-CPU fraction (see [`BusyClock`]).
pub(crate) fn on_cpu_scaled(ns: u64) -> u64 {
    let scale = ON_CPU_SCALE.with(Cell::get);
    ((ns as u128 * scale as u128) >> 32) as u64
}

/// 1.0 as a 32.32 fixed-point factor.
const SCALE_ONE: u64 = 1 << 32;

thread_local! {
    /// The fraction of its busy time this thread ran on a CPU, over its
    /// recent sampled busy stretches (32.32 fixed point, at most 1): what
    /// [`CpuStopwatch::elapsed_ns`] multiplies elapsed time by, so that a
    /// handler thread is not charged for time it sat descheduled.
    static ON_CPU_SCALE: Cell<u64> = const { Cell::new(SCALE_ONE) };
}

/// One busy stretch in this many is timed in thread CPU time (two system
/// calls): enough to follow the host's load, cheap next to the RPCs served
/// (in a strict ping-pong, one stretch per RPC, 2 / 64 system calls per
/// RPC). Where the `local` handler's charge detects descheduling itself
/// ([`crate::charge`], C2) the scale is evidence for the report only.
pub const BUSY_STRETCH_SAMPLE: u64 = 64;

/// Corrects a handler thread's [`CpuStopwatch`] charges for descheduling,
/// without a system call per RPC.
///
/// The thread reports when it takes a request after finding its queue empty
/// ([`BusyClock::busy`]) and when it finds the queue empty again
/// ([`BusyClock::idle`]): a busy stretch. One stretch in `sample` is timed
/// twice, in elapsed time (the time-stamp counter) and in thread CPU time
/// (`CLOCK_THREAD_CPUTIME_ID`, read at its two ends only); decayed sums of
/// both over the sampled stretches give the fraction of busy time the
/// thread was really on a CPU, and every later RPC's elapsed time is scaled
/// by it. So the charges add up to the thread's CPU time in its busy
/// stretches (less what it spends between requests), measured per stretch,
/// while each RPC keeps its own share (a GET and a PUT are still told
/// apart). The fraction is an estimate from earlier stretches: a stretch
/// descheduled unusually long is charged at the recent average.
///
/// Invariant: the scale is always in (0, 1]: the thread CPU time of a
/// stretch is capped at its elapsed time, and a thread that never reports
/// a stretch keeps scale 1 (the UCX backend's handler threads, for one).
#[derive(Debug)]
pub struct BusyClock {
    sample: u64,
    stretches: u64,
    in_stretch: bool,
    /// The timed stretch now open: thread CPU ns and ticks at its start.
    open: Option<(u64, u64)>,
    /// Decayed sums over the sampled stretches (ns).
    cpu_sum: u64,
    wall_sum: u64,
}

impl BusyClock {
    /// A clock for the calling handler thread that times one busy stretch
    /// in `sample` (at least 1).
    pub fn new(sample: u64) -> BusyClock {
        // Calibrate now rather than in the first stretch.
        let _ = ticks_to_ns(1);
        let _ = thread_clock_overhead_ns();
        BusyClock {
            sample: sample.max(1),
            stretches: 0,
            in_stretch: false,
            open: None,
            cpu_sum: 0,
            wall_sum: 0,
        }
    }

    /// The thread took a request: a busy stretch starts if none is open.
    #[inline]
    pub fn busy(&mut self) {
        if self.in_stretch {
            return;
        }
        self.in_stretch = true;
        self.stretches += 1;
        if self.stretches % self.sample == 1 || self.sample == 1 {
            // CPU first, ticks last: the clock's own cost falls outside the
            // elapsed interval and is subtracted from the CPU interval.
            let before = ticks();
            let cpu = thread_cpu_ns();
            let after = ticks();
            self.open = Some((cpu, after));
            // The read (a system call, ~0.5 µs) is this clock's, not the
            // request's: left out of the RPC's charge (branch i75; before,
            // one RPC in `sample` carried it).
            crate::charge::skip(after.saturating_sub(before));
        }
    }

    /// The thread found its queue empty: the busy stretch, if any, ends.
    #[inline]
    pub fn idle(&mut self) {
        if !std::mem::take(&mut self.in_stretch) {
            return;
        }
        let Some((cpu0, t0)) = self.open.take() else {
            return;
        };
        let wall = ticks_to_ns(ticks().saturating_sub(t0));
        let cpu = thread_cpu_ns()
            .saturating_sub(cpu0)
            .saturating_sub(thread_clock_overhead_ns())
            .min(wall);
        // Decay by 1/8 per sampled stretch: the last few dozen stretches
        // count, so the scale follows the host's load within milliseconds.
        {
            use crate::servestats::{Counter, Role};
            crate::servestats::add_all(
                Role::Handler,
                &[(Counter::BusyCpuNs, cpu), (Counter::BusyWallNs, wall)],
            );
        }
        self.cpu_sum = self.cpu_sum - self.cpu_sum / 8 + cpu;
        self.wall_sum = self.wall_sum - self.wall_sum / 8 + wall;
        if self.wall_sum > 0 {
            let scale = ((self.cpu_sum as u128) << 32) / self.wall_sum as u128;
            // In (0, 1]: a stretch measured as no CPU at all (below the
            // clock's resolution) must not make later charges zero.
            ON_CPU_SCALE.with(|s| s.set((scale as u64).clamp(1, SCALE_ONE)));
        }
    }

    /// The calling thread's current scale, as a fraction.
    pub fn on_cpu_fraction() -> f64 {
        ON_CPU_SCALE.with(Cell::get) as f64 / SCALE_ONE as f64
    }
}

/// What two back-to-back [`thread_cpu_ns`] calls measure with nothing in
/// between (the clock's own cost), subtracted from every interval measured
/// with it.
pub(crate) fn thread_clock_overhead_ns() -> u64 {
    static OVERHEAD: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *OVERHEAD.get_or_init(|| {
        (0..16)
            .map(|_| {
                let a = thread_cpu_ns();
                thread_cpu_ns().saturating_sub(a)
            })
            .min()
            .unwrap_or(0)
    })
}

#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn ticks() -> u64 {
    // SAFETY: RDTSC is available on every x86-64 CPU and has no preconditions.
    unsafe { core::arch::x86_64::_rdtsc() }
}

#[cfg(target_arch = "x86_64")]
fn ticks_to_ns(ticks: u64) -> u64 {
    ((ticks as u128 * ns_per_tick_32() as u128) >> 32) as u64
}

/// Nanoseconds per tick as a 32.32 fixed-point factor, calibrated once per
/// process (below).
#[cfg(target_arch = "x86_64")]
#[inline]
pub(crate) fn ns_per_tick_32() -> u64 {
    static NS_PER_TICK_32: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NS_PER_TICK_32.get_or_init(calibrate)
}

/// Ticks of the time-stamp counter against the monotonic clock over a few
/// milliseconds (once per process). Each end pairs a counter reading with
/// the monotonic clock read just before and just after it, retried until
/// the two clock reads are under a microsecond apart (so a preemption at
/// either end cannot skew the rate): the rate's error is then at most
/// 2 µs in 5 ms, 0.04%.
#[cfg(target_arch = "x86_64")]
fn calibrate() -> u64 {
    use std::time::{Duration, Instant};
    fn bracketed() -> (Instant, u64) {
        let mut best: Option<(Duration, Instant, u64)> = None;
        for _ in 0..1_000 {
            let a = Instant::now();
            let t = ticks();
            let b = Instant::now();
            let w = b - a;
            if best.is_none_or(|(bw, _, _)| w < bw) {
                best = Some((w, a + w / 2, t));
            }
            if w < Duration::from_micros(1) {
                break;
            }
        }
        let (_, at, t) = best.expect("at least one reading");
        (at, t)
    }
    let (t0, c0) = bracketed();
    while t0.elapsed() < Duration::from_millis(5) {
        std::hint::spin_loop();
    }
    let (t1, c1) = bracketed();
    let ns = (t1 - t0).as_nanos() as u64;
    let dticks = c1.saturating_sub(c0).max(1);
    (((ns as u128) << 32) / dticks as u128) as u64
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn ticks() -> u64 {
    use std::sync::OnceLock;
    use std::time::Instant;
    static BASE: OnceLock<Instant> = OnceLock::new();
    BASE.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

#[cfg(not(target_arch = "x86_64"))]
fn ticks_to_ns(ticks: u64) -> u64 {
    ticks
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) fn ns_per_tick_32() -> u64 {
    1 << 32
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
    fn busy_stretches_off_the_cpu_scale_charges_down() {
        // A fresh thread (the scale is per thread). Its stretches sleep: on
        // the CPU for microseconds out of milliseconds, as a handler
        // descheduled for most of its stretches would be.
        std::thread::spawn(|| {
            assert_eq!(super::BusyClock::on_cpu_fraction(), 1.0);
            let mut clock = super::BusyClock::new(1);
            for _ in 0..4 {
                clock.busy();
                clock.busy(); // a second request in the same stretch
                std::thread::sleep(std::time::Duration::from_millis(3));
                clock.idle();
            }
            let f = super::BusyClock::on_cpu_fraction();
            assert!(f > 0.0 && f < 0.1, "on-CPU fraction {f}");
            // A 3 ms stretch off the CPU is now charged a small part of it.
            let w = super::CpuStopwatch::start();
            std::thread::sleep(std::time::Duration::from_millis(3));
            let charged = w.elapsed_ns();
            assert!(charged < 300_000, "charged {charged} ns");
            // Idle without a stretch changes nothing.
            clock.idle();
            assert_eq!(super::BusyClock::on_cpu_fraction(), f);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn unsampled_stretches_read_no_clock() {
        std::thread::spawn(|| {
            let mut clock = super::BusyClock::new(4);
            for i in 0..8u64 {
                clock.busy();
                // Only stretches 1 and 5 are timed.
                assert_eq!(clock.open.is_some(), i % 4 == 0, "stretch {}", i + 1);
                std::thread::sleep(std::time::Duration::from_millis(1));
                clock.idle();
            }
            assert!(super::BusyClock::on_cpu_fraction() < 0.5);
        })
        .join()
        .unwrap();
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
