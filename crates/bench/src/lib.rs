//! # dmkv-bench: the benchmark harness behind `dmkv bench`
//!
//! A run compares engines on the same ground: one key set and one set of
//! request streams, generated once from the seed and replayed against every
//! engine, each deployed on a fresh in-process cluster.
//!
//! - [`config`]: what a run is told ([`BenchConfig`]), with the defaults.
//! - [`keyset`]: the keys (uniform, sequential, normal, lognormal, SOSD
//!   files); [`trace`]: YCSB traces; [`workload`] and [`dist`]: YCSB's
//!   workloads and request distributions; [`rng`]: a fully specified PRNG so
//!   streams are the same everywhere.
//! - [`plan`]: the key universe and each task's request stream, deterministic
//!   per (seed, thread, task), and which task owns which key.
//! - [`runner`]: deploy, load, run T threads x C tasks, verify.
//! - [`deployment`]: where engines are deployed (in process by default, or
//!   through another transport's [`deployment::Deployer`]).
//! - [`state`] and [`check`]: what the harness knows about every key, and
//!   how it checks every answer against it; [`metered`]: exact costs per
//!   operation; [`stats`]: per-thread figures; [`schedstat`]: how long the
//!   compute threads ran and waited for a core.
//! - [`report`]: the table, the ratios and the JSON.
//! - [`valuegen`]: how updates make their values (`--value-gen`; ScaleStore's
//!   driver's random strings, from [`mt64`]).

#![forbid(unsafe_code)]

pub mod check;
pub mod config;
pub mod deployment;
pub mod dist;
pub mod error;
pub mod keyset;
pub mod metered;
pub mod mt64;
pub mod partition;
pub mod plan;
pub mod report;
pub mod rng;
pub mod runner;
pub mod sampler;
pub mod sched;
pub mod schedstat;
pub mod state;
pub mod stats;
pub mod trace;
pub mod valuegen;
pub mod workload;

pub use config::{BenchConfig, CrashPlan, EngineChoice, WorkloadSource, defaults};
pub use deployment::{Deployer, Deployment, LocalDeployer, SimDeployer};
pub use error::BenchError;
pub use keyset::KeysetSpec;
pub use report::{EngineReport, print_table, write_json};
pub use runner::{BenchOutcome, EngineFailure, run};
pub use workload::{Dist, Workload};
