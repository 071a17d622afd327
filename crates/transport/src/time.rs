//! Time as engines and the harness see it: real time on the `local` and
//! `ucx` backends, virtual time inside the simulated cluster (`sim`).
//!
//! Engines never call `std::time::Instant::now` (clippy refuses it in the
//! engine crates): they use [`Instant::now`] here, so that the same code
//! measures real nanoseconds on real backends and virtual nanoseconds in a
//! simulation, where a run's timing is a pure function of its seed.

use std::ops::{Add, AddAssign, Sub};
use std::sync::OnceLock;
use std::time::Duration;

/// A point in time, in nanoseconds since an epoch: the process's first use
/// of this module on real backends, the simulation's start under `sim`.
/// Do not compare instants taken inside a simulation with ones taken outside.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Instant(u64);

/// The monotonic clock (`CLOCK_MONOTONIC`, the clock `std::time::Instant`
/// reads on Linux) in nanoseconds: the only place outside the simulator
/// where a real clock is read. Read directly rather than through
/// `std::time::Instant::elapsed`, whose `Timespec` subtraction and `u128`
/// nanoseconds cost more than the clock read itself (the harness reads the
/// clock twice per operation).
#[allow(unsafe_code)]
#[inline]
fn monotonic_ns() -> u64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec; CLOCK_MONOTONIC exists on
    // every platform this crate builds for (it cannot fail with these
    // arguments, and if it did `ts` would stay zero).
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    (ts.tv_sec as u64)
        .wrapping_mul(1_000_000_000)
        .wrapping_add(ts.tv_nsec as u64)
}

/// The real clock's reading at the process's first use of this module.
fn real_epoch_ns() -> u64 {
    static EPOCH: OnceLock<u64> = OnceLock::new();
    *EPOCH.get_or_init(monotonic_ns)
}

impl Instant {
    /// Now: virtual time when the calling thread runs a simulation.
    pub fn now() -> Instant {
        if let Some(t) = crate::sim::now_ns() {
            return Instant(t);
        }
        let epoch = real_epoch_ns();
        Instant(monotonic_ns().saturating_sub(epoch))
    }

    /// Nanoseconds since the epoch.
    pub fn as_nanos(self) -> u64 {
        self.0
    }

    pub fn from_nanos(ns: u64) -> Instant {
        Instant(ns)
    }

    /// Time since `self` (zero if `self` is in the future).
    pub fn elapsed(self) -> Duration {
        Instant::now().saturating_duration_since(self)
    }

    pub fn saturating_duration_since(self, earlier: Instant) -> Duration {
        Duration::from_nanos(self.0.saturating_sub(earlier.0))
    }

    pub fn duration_since(self, earlier: Instant) -> Duration {
        self.saturating_duration_since(earlier)
    }

    pub fn checked_add(self, d: Duration) -> Option<Instant> {
        self.0
            .checked_add(u64::try_from(d.as_nanos()).ok()?)
            .map(Instant)
    }
}

impl Add<Duration> for Instant {
    type Output = Instant;
    fn add(self, d: Duration) -> Instant {
        Instant(
            self.0
                .saturating_add(d.as_nanos().min(u64::MAX as u128) as u64),
        )
    }
}

impl AddAssign<Duration> for Instant {
    fn add_assign(&mut self, d: Duration) {
        *self = *self + d;
    }
}

impl Sub<Instant> for Instant {
    type Output = Duration;
    fn sub(self, o: Instant) -> Duration {
        self.saturating_duration_since(o)
    }
}

impl Sub<Duration> for Instant {
    type Output = Instant;
    fn sub(self, d: Duration) -> Instant {
        Instant(
            self.0
                .saturating_sub(d.as_nanos().min(u64::MAX as u128) as u64),
        )
    }
}

/// Measures one short interval (an operation's latency) at the cost of a
/// counter read at each end: virtual time inside a simulation, exactly as
/// [`Instant::now`] measures it there; elsewhere the time-stamp counter
/// where it is a reliable clock, else the monotonic clock.
///
/// [`Instant::now`] reads `CLOCK_MONOTONIC` (the vDSO's `clock_gettime`,
/// ~40-50 instructions with its call and conversion); the harness measures
/// every operation, so it reads the clock twice per operation. The
/// time-stamp counter is read by one instruction and converted to
/// nanoseconds by one multiplication, at the rate calibrated once per
/// process against the monotonic clock (the rate [`crate::CpuStopwatch`]
/// uses; its error is at most 0.04%).
///
/// The counter is used only on x86-64 and only when the kernel's own
/// clocksource is `tsc`
/// (`/sys/devices/system/clocksource/clocksource0/current_clocksource`,
/// read once): the kernel picks it only if the counter runs at a constant
/// rate, does not stop in idle states and is synchronized across CPUs (it
/// checks at boot and falls back to another clocksource otherwise), so an
/// interval started on one core and ended on another is as right as
/// `CLOCK_MONOTONIC`'s. Anywhere else (other architectures, a `kvm-clock`
/// or `hpet` host) this is [`Instant::now`]'s clock. An interval that
/// would be negative (it cannot be, with a synchronized counter) is zero.
///
/// [`Stopwatch::warm_up`] calibrates before the first interval, so that no
/// measured interval includes the calibration (a few milliseconds).
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch(Start);

#[derive(Debug, Clone, Copy)]
enum Start {
    /// Virtual nanoseconds (a simulation).
    Virtual(u64),
    /// Time-stamp counter ticks, with the calibrated nanoseconds per tick
    /// (32.32 fixed point).
    Ticks(u64, u64),
    /// Nanoseconds of the monotonic clock.
    Monotonic(u64),
}

impl Stopwatch {
    /// Starts measuring now.
    #[inline]
    pub fn start() -> Stopwatch {
        if let Some(t) = crate::sim::now_ns() {
            return Stopwatch(Start::Virtual(t));
        }
        match tsc_ns_per_tick_32() {
            Some(rate) => Stopwatch(Start::Ticks(crate::cputime::ticks(), rate)),
            None => Stopwatch(Start::Monotonic(monotonic_ns())),
        }
    }

    /// Time since [`Stopwatch::start`], on the clock it started on.
    #[inline]
    pub fn elapsed(&self) -> Duration {
        Duration::from_nanos(match self.0 {
            Start::Virtual(t) => crate::sim::now_ns().unwrap_or(t).saturating_sub(t),
            Start::Ticks(t, rate) => ticks_to_ns(crate::cputime::ticks().saturating_sub(t), rate),
            Start::Monotonic(t) => monotonic_ns().saturating_sub(t),
        })
    }

    /// Decides which clock this process's stopwatches read and calibrates
    /// the counter, if not done yet: call before the first interval that
    /// is measured (the first call takes a few milliseconds).
    pub fn warm_up() {
        let _ = tsc_ns_per_tick_32();
    }

    /// Whether stopwatches outside a simulation read the time-stamp counter
    /// (see the type's doc).
    pub fn reads_tsc() -> bool {
        tsc_ns_per_tick_32().is_some()
    }
}

/// The clock a [`Stopwatch`] would read on this thread, chosen once by a
/// caller that measures many intervals on one thread (the harness: once per
/// task), so that each interval costs only its two raw readings and, on the
/// time-stamp counter, one multiplication: no test for a running simulation
/// (a thread-local look-up) and no check of the calibration per reading.
///
/// Readings ([`LatencyClock::read`]) are raw: virtual nanoseconds, counter
/// ticks or monotonic nanoseconds; [`LatencyClock::ns_since`] converts an
/// interval to nanoseconds, exactly as [`Stopwatch::elapsed`] does on the
/// same clock. Use a clock only on the thread, and inside or outside the
/// simulation, where [`LatencyClock::here`] chose it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LatencyClock {
    /// Virtual nanoseconds (the calling thread runs a simulation).
    Virtual,
    /// Time-stamp counter ticks, at this many nanoseconds per tick (32.32
    /// fixed point, the calibrated rate).
    Ticks(u64),
    /// Nanoseconds of the monotonic clock.
    Monotonic,
}

impl LatencyClock {
    /// The clock [`Stopwatch::start`] would read here and now (calibrating
    /// the counter if not done yet).
    pub fn here() -> LatencyClock {
        if crate::sim::active() {
            return LatencyClock::Virtual;
        }
        match tsc_ns_per_tick_32() {
            Some(rate) => LatencyClock::Ticks(rate),
            None => LatencyClock::Monotonic,
        }
    }

    /// A raw reading (see the type's doc).
    #[inline]
    pub fn read(self) -> u64 {
        match self {
            LatencyClock::Virtual => crate::sim::now_ns().unwrap_or(0),
            LatencyClock::Ticks(_) => crate::cputime::ticks(),
            LatencyClock::Monotonic => monotonic_ns(),
        }
    }

    /// Nanoseconds since `start`, a [`LatencyClock::read`] of this clock
    /// (zero if the clock reads less now).
    #[inline]
    pub fn ns_since(self, start: u64) -> u64 {
        let now = self.read();
        match self {
            LatencyClock::Ticks(rate) => ticks_to_ns(now.saturating_sub(start), rate),
            LatencyClock::Virtual | LatencyClock::Monotonic => now.saturating_sub(start),
        }
    }
}

/// `ticks` of the time-stamp counter in nanoseconds at `rate` (nanoseconds
/// per tick, 32.32 fixed point), rounded down.
#[inline]
fn ticks_to_ns(ticks: u64, rate: u64) -> u64 {
    ((ticks as u128 * rate as u128) >> 32) as u64
}

/// The time-stamp counter's calibrated nanoseconds per tick (32.32 fixed
/// point) if it is a reliable clock here (see [`Stopwatch`]), decided once.
#[inline]
fn tsc_ns_per_tick_32() -> Option<u64> {
    static RATE: OnceLock<Option<u64>> = OnceLock::new();
    *RATE.get_or_init(|| {
        if cfg!(target_arch = "x86_64") && kernel_clocksource_is_tsc() {
            Some(crate::cputime::ns_per_tick_32())
        } else {
            None
        }
    })
}

fn kernel_clocksource_is_tsc() -> bool {
    std::fs::read_to_string("/sys/devices/system/clocksource/clocksource0/current_clocksource")
        .is_ok_and(|s| s.trim() == "tsc")
}

/// Blocks the calling OS thread for `d` (real backends), or lets `d` pass in
/// virtual time. Prefer [`crate::exec::sleep`] in async code; this is for the
/// few synchronous waits of background threads.
pub fn sleep_blocking(d: Duration) {
    if crate::sim::active() {
        crate::exec::block_on(crate::exec::sleep(d));
    } else {
        #[allow(clippy::disallowed_methods)]
        std::thread::sleep(d);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn real_time_advances_and_arithmetic_saturates() {
        let a = Instant::now();
        let b = a + Duration::from_micros(5);
        assert_eq!(b - a, Duration::from_micros(5));
        assert_eq!(a - b, Duration::ZERO);
        assert!(Instant::now() >= a);
    }

    /// A stopwatch measures what the monotonic clock measures (within the
    /// calibration's error and the reads' own time), whichever clock it
    /// reads here.
    #[test]
    #[allow(clippy::disallowed_methods)]
    fn a_stopwatch_measures_what_the_monotonic_clock_measures() {
        Stopwatch::warm_up();
        for _ in 0..3 {
            let s0 = std::time::Instant::now();
            let w = Stopwatch::start();
            let a = Instant::now();
            std::thread::sleep(Duration::from_millis(20));
            let b = Instant::now();
            let ours = w.elapsed();
            let s1 = std::time::Instant::now();
            // At least the inner interval less 0.1% (the rate's error),
            // at most the outer one plus 0.1%.
            let (inner, outer) = (b - a, s1 - s0);
            assert!(ours >= inner - inner / 1000, "{ours:?} < {inner:?}");
            assert!(ours <= outer + outer / 1000, "{ours:?} > {outer:?}");
        }
        // Intervals never go backwards.
        let w = Stopwatch::start();
        let (e1, e2) = (w.elapsed(), w.elapsed());
        assert!(e2 >= e1, "{e2:?} < {e1:?}");
        if cfg!(target_arch = "x86_64") && kernel_clocksource_is_tsc() {
            assert!(Stopwatch::reads_tsc());
        } else {
            assert!(!Stopwatch::reads_tsc());
        }
    }

    /// Ticks convert to nanoseconds at the calibrated rate: a known 32.32
    /// rate (a 2.5 GHz counter: 0.4 ns per tick) gives known nanoseconds.
    #[test]
    fn ticks_convert_at_the_rate() {
        let rate = (4u64 << 32) / 10; // 0.4 ns per tick, rounded down
        assert_eq!(ticks_to_ns(0, rate), 0);
        assert_eq!(ticks_to_ns(2_500_000_000, rate), 999_999_999);
        assert_eq!(ticks_to_ns(1 << 40, 1 << 32), 1 << 40);
        assert_eq!(ticks_to_ns(3, 3 << 31), 4); // 1.5 ns per tick
        // No overflow for a day of ticks at a high rate.
        assert_eq!(ticks_to_ns(86_400 << 32, 1 << 32), 86_400 << 32);
    }

    /// A latency clock measures what a stopwatch on the same clock
    /// measures, and is the clock a stopwatch would read here.
    #[test]
    #[allow(clippy::disallowed_methods)]
    fn a_latency_clock_measures_what_a_stopwatch_measures() {
        Stopwatch::warm_up();
        let clock = LatencyClock::here();
        assert_eq!(
            matches!(clock, LatencyClock::Ticks(_)),
            Stopwatch::reads_tsc()
        );
        assert_ne!(clock, LatencyClock::Virtual, "no simulation runs here");
        for _ in 0..3 {
            let outer = Stopwatch::start();
            let start = clock.read();
            let inner = Stopwatch::start();
            std::thread::sleep(Duration::from_millis(20));
            let i = inner.elapsed();
            let ours = Duration::from_nanos(clock.ns_since(start));
            let o = outer.elapsed();
            assert!(ours >= i && ours <= o, "{i:?} <= {ours:?} <= {o:?}");
            assert!(ours >= Duration::from_millis(20), "{ours:?}");
        }
        // An end read before the start (cannot happen on one clock) is zero.
        assert_eq!(clock.ns_since(u64::MAX), 0);
    }

    /// The clock read directly agrees with `std::time::Instant` (the same
    /// clock): an interval measured by both brackets the other.
    #[test]
    #[allow(clippy::disallowed_methods)]
    fn real_time_measures_what_std_measures() {
        let s0 = std::time::Instant::now();
        let a = Instant::now();
        std::thread::sleep(Duration::from_millis(20));
        let b = Instant::now();
        let s1 = std::time::Instant::now();
        let ours = b - a;
        assert!(ours >= Duration::from_millis(20), "{ours:?}");
        assert!(ours <= s1 - s0, "{ours:?} > {:?}", s1 - s0);
    }
}
