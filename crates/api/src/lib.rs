//! # dmkv-api: the client API and the engine interface
//!
//! - [`KvStore`]: what applications call, per compute thread: `get`,
//!   `insert` (fails on an existing key), `update` (fails on a missing key),
//!   `upsert`, `delete`, `scan`. Expected outcomes (not found, exists) are
//!   results; [`KvError`] is for transport failures, bad input and exhausted
//!   resources.
//! - [`Engine`] and [`EngineSpec`]: how a design plugs in. A spec installs
//!   the design's server side on each memory node ([`EngineSpec::serve`],
//!   through the node's [`NodeRuntime`](dmkv_memnode::NodeRuntime)) and
//!   connects a compute process to it ([`EngineSpec::connect`]); the engine
//!   then hands each compute thread a [`KvStore`].
//! - [`Checked`]: the input validation every engine gets for free (reserved
//!   keys, value limits, scan capability).
//! - [`Knobs`]: typed `--set engine.knob=value` settings.
//! - [`checksum64`]: the checksum layouts use to detect torn one-sided reads.
//! - [`deploy`]: an engine on a fresh in-process cluster (benchmarks, tests).
//! - [`payload`]: self-checking values derived from a key and a version.

#![forbid(unsafe_code)]

mod checked;
mod checksum;
pub mod deploy;
mod engine;
mod error;
mod knobs;
pub mod payload;
pub mod sim_deploy;
mod store;

pub use checked::Checked;
pub use checksum::checksum64;
pub use engine::{ConnectArgs, Engine, EngineSpec, ServeArgs, Topology};
pub use error::{KvError, Result};
pub use knobs::{KnobSpec, Knobs};
pub use store::{Capabilities, Key, KvStore};
