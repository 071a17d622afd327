//! # dmkv-xstore: XStore (paper 000, OSDI'20) on disaggregated memory
//!
//! A B+tree (XTree, `dmkv-xtree`) lives on each memory node; compute nodes
//! cache a learned model of it (XCACHE: a top model routing to linear
//! sub-models, each with a translation table from logical to actual leaves)
//! and read leaves one-sided: a GET is one doorbell batch of predicted
//! leaves and one value read. Writes go to the memory node by RPC; leaf
//! splits queue retraining of the affected sub-models on the memory node's
//! worker pool, and stale caches stay correct through incarnation checks,
//! speculative execution and a fallback RPC that returns the retrained
//! model. docs/xstore.md is the design note (layouts, invariants, tests).
//!
//! - [`layout`]: byte layouts clients read one-sided (model header,
//!   sub-model records, line-tagged TT blocks) and the log record;
//! - [`model`]: training (Fig. 6) as pure functions;
//! - [`config`]: the `xstore.*` knobs;
//! - [`server`]: the memory node's side (XTree, model region, retraining,
//!   model expansion, durability log, RPC service);
//! - [`wire`]: the RPC formats;
//! - [`cache`] and [`client`]: XCACHE and the per-thread client (GET, SCAN,
//!   writes, fallbacks, speculation);
//! - [`SPEC`]: the engine, registered as `xstore`.

#![forbid(unsafe_code)]

pub mod cache;
pub mod client;
pub mod config;
mod engine;
pub mod layout;
pub mod model;
mod scan_chain;
pub mod server;
pub mod stats;
pub mod wire;

pub use engine::{CAPS, SPEC, XStoreSpec, parse_stats};
