//! Deployments for the tests.

#![allow(dead_code)]

use dmkv_api::Knobs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};

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

pub fn deploy_with(knobs: Knobs, memnodes: usize, threads: usize) -> LocalDeployment {
    LocalDeployment::deploy(
        &dmkv_outback::SPEC,
        &DeployOptions {
            memnodes,
            threads,
            knobs,
            ..Default::default()
        },
    )
    .expect("deploy outback")
}

pub fn deploy() -> LocalDeployment {
    deploy_with(small_tables(), 1, 2)
}
