//! Shared helpers of the ROLEX test suites.
#![allow(dead_code)]

use dmkv_api::Knobs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};

pub fn knobs(pairs: &[(&str, &str)]) -> Knobs {
    let mut k = Knobs::new();
    for (n, v) in pairs {
        k.set(n, v);
    }
    k
}

/// Small tables so that splits, SLT overflow and retraining happen within a
/// few hundred operations.
pub fn small() -> Knobs {
    knobs(&[
        ("leaf_slots", "4"),
        ("epsilon", "4"),
        ("slt_slots", "16"),
        ("poll_us", "50"),
    ])
}

pub fn deploy_with(knobs: Knobs, threads: usize, memnodes: usize) -> LocalDeployment {
    LocalDeployment::deploy(
        &dmkv_rolex::SPEC,
        &DeployOptions {
            knobs,
            threads,
            memnodes,
            expected_keys: 20_000,
            ..Default::default()
        },
    )
    .expect("deploy rolex")
}
