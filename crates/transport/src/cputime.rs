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
}
