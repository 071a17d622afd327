//! # dmkv-rpc-btree: the server-centric baseline
//!
//! DrTM-Tree and eRPC+Masstree in XStore's evaluation (paper 000, §7.1):
//! clients ship every operation to the memory node in one RPC, and the
//! node's handler threads traverse and update an [`XTree`](dmkv_xtree::XTree).
//! It costs one round trip per operation and all of the work lands on the
//! memory node's CPU, which is what the paper compares against.
//!
//! - [`wire`]: the service's opcodes and byte formats;
//! - [`service`]: the tree and its RPC service on the memory node, and the
//!   knobs that size it (shared with `cell`, which installs the same service);
//! - [`client`]: the per-thread RPC client (a complete `KvStore`), batched
//!   loading and the stats call;
//! - the engine spec, [`SPEC`], registered as `rpc-btree`.
//!
//! docs/rpc-btree.md gives the byte formats, invariants and tests.

#![forbid(unsafe_code)]

pub mod client;
mod engine;
pub mod service;
pub mod wire;

pub use client::{PartitionedClient, RpcTreeClient, TreeService, TreeServices, scan_partitions};
pub use engine::{CAPS, RpcBtreeSpec, SPEC, connect_services, partitioned_stats_json};
