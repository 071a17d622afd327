//! # dmkv-rolex: ROLEX (FAST'23) on disaggregated memory
//!
//! A learned key-value store whose every operation is one-sided. Memory
//! nodes hold fixed-size leaves of δ sorted pairs, model records (model
//! parameters, leaf table LT, synonym leaf table SLT) and out-of-line
//! values; compute nodes cache the models, predict the leaves that may hold
//! a key and read them in one doorbell batch; writers lock a leaf group by
//! CAS on its LT entry, allocate synonym leaves by FAA, and write leaves back
//! with versions that readers validate. Memory node 0 retrains models whose
//! SLT fills up, in the background, without moving data, and publishes new
//! models by shadow redirection.
//!
//! How the parts fit:
//! - [`layout`]: remote byte layouts (leaves, LT/SLT entries, model records,
//!   the meta region with the directory and the retraining queue, value
//!   blocks), parsed through bounds-checked views;
//! - [`plr`], [`train`], [`upper`]: OptimalPLR, training models over keys or
//!   over leaves, and the PGM-style upper levels;
//! - [`server`]: what memory nodes run (regions, bulk load, retraining);
//! - [`client`]: the compute side (caches, lock sharing, operations);
//! - [`config`]: knobs and sizes.
//!
//! The design note is docs/rolex.md.

#![forbid(unsafe_code)]

pub mod client;
pub mod config;
pub mod io;
pub mod layout;
pub mod plr;
pub mod remote;
pub mod server;
pub mod train;
pub mod upper;

/// One memory node and one compute thread on the local backend, with
/// `knobs`: the set-up of this crate's step-by-step unit tests.
#[cfg(test)]
pub(crate) fn local_test_deployment(knobs: &[(&str, &str)]) -> dmkv_api::deploy::LocalDeployment {
    let mut k = dmkv_api::Knobs::new();
    for (name, value) in knobs {
        k.set(name, value);
    }
    dmkv_api::deploy::LocalDeployment::deploy(
        &SPEC,
        &dmkv_api::deploy::DeployOptions {
            knobs: k,
            threads: 1,
            memnodes: 1,
            expected_keys: 20_000,
            ..Default::default()
        },
    )
    .expect("deploy rolex")
}

pub use client::RolexSpec;

/// The ROLEX engine, for the engine registry.
pub static SPEC: RolexSpec = RolexSpec;
