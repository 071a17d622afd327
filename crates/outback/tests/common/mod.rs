#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Deployments for the tests.

#![allow(dead_code)]

use dmkv_api::Knobs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use std::sync::mpsc::{RecvTimeoutError, Sender, channel};
use std::time::Duration;

/// How long one deployment may live in a test before the whole test binary
/// is stopped. Every test here finishes in a few seconds; a bug that makes
/// one wait forever (a lost wake-up, a takeover that never ends) must fail
/// the run with a message instead of eating CI's time limit.
pub const TEST_LIMIT: Duration = Duration::from_secs(60);

/// Stops the process if it is not dropped within its limit.
pub struct Watchdog {
    _alive: Sender<()>,
}

pub fn watchdog(what: &str, limit: Duration) -> Watchdog {
    let (tx, rx) = channel::<()>();
    let what = what.to_string();
    std::thread::spawn(move || {
        if let Err(RecvTimeoutError::Timeout) = rx.recv_timeout(limit) {
            eprintln!("watchdog: {what} still running after {limit:?}; stopping the test binary");
            std::process::exit(101);
        }
    });
    Watchdog { _alive: tx }
}

/// A deployment guarded by a watchdog (dropped after the deployment, so a
/// teardown that hangs is caught too).
pub struct Deployed {
    d: LocalDeployment,
    _watchdog: Watchdog,
}

impl std::ops::Deref for Deployed {
    type Target = LocalDeployment;
    fn deref(&self) -> &LocalDeployment {
        &self.d
    }
}

/// Knobs that make resizes happen with few keys.
pub fn small_tables() -> Knobs {
    let mut k = Knobs::new();
    k.set("initial_buckets", "2");
    k.set("overflow_ratio", "0.5");
    k.set("pre_resize_timeout_ms", "2");
    k.set("countdown_poll_ms", "1");
    k.set("countdown_timeout_ms", "200");
    k.set("poll_us", "50");
    k.set("heap_mb", "8");
    k
}

pub fn deploy_with(knobs: Knobs, memnodes: usize, threads: usize) -> Deployed {
    let what = format!(
        "{} (outback, {memnodes} memory nodes)",
        std::thread::current().name().unwrap_or("a test")
    );
    let watchdog = watchdog(&what, TEST_LIMIT);
    let d = LocalDeployment::deploy(
        &dmkv_outback::SPEC,
        &DeployOptions {
            memnodes,
            threads,
            knobs,
            ..Default::default()
        },
    )
    .expect("deploy outback");
    Deployed {
        d,
        _watchdog: watchdog,
    }
}

pub fn deploy() -> Deployed {
    deploy_with(small_tables(), 1, 2)
}
