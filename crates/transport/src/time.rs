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
