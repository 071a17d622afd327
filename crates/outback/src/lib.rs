//! # dmkv-outback: Outback (VLDB'24), the `outback` engine
//!
//! Dynamic minimal perfect hashing (Ludo hashing) split in two (paper §4):
//! compute nodes hold the compute-heavy half of the index — an Othello
//! bucket locator and one 8-bit seed per bucket — and compute every key's
//! exact (bucket, slot); memory nodes hold the memory-heavy half — 32-byte
//! buckets of four slots, the KV blocks, the latest seeds and an overflow
//! cache — and serve a GET with one RPC that reads the named slot and
//! returns its block, with no hashing and no key comparison.
//!
//! How the parts fit:
//! - [`hash`], [`othello`], [`ludo`]: the hash functions, the Othello
//!   locator, and Ludo's (2,4)-cuckoo control plane with per-bucket seeds;
//! - [`layout`], [`proto`], [`publish`]: remote byte layouts, RPC messages,
//!   and what memory nodes publish for compute nodes to fetch one-sided;
//! - [`ring`]: consistent hashing of keys onto shards and replica order;
//! - [`server`]: the memory-node side (tables, operations, resizing by
//!   extendible hashing, replication, takeover);
//! - [`client`]: the compute-node side (engine, per-thread client);
//! - [`config`]: the `outback.*` knobs.
//!
//! `docs/outback.md` gives the layouts, the numbered invariants, the tests
//! that check them, and where this departs from the paper.

#![forbid(unsafe_code)]
// engine_stats are built with serde_json::json!, whose expansion of an
// object of some eighty fields needs more than the default 128 levels.
#![recursion_limit = "256"]

pub mod client;
pub mod config;
pub mod hash;
pub mod layout;
pub mod ludo;
pub mod othello;
pub mod proto;
pub mod publish;
pub mod ring;
pub mod server;

use dmkv_api::{Capabilities, ConnectArgs, Engine, EngineSpec, KnobSpec, Result, ServeArgs};
use dmkv_memnode::NodeRuntime;
use std::sync::Arc;

pub use client::CAPS;

/// The `outback` engine.
pub struct OutbackSpec;

/// The spec the engine registry uses.
pub static SPEC: OutbackSpec = OutbackSpec;

impl EngineSpec for OutbackSpec {
    fn name(&self) -> &'static str {
        "outback"
    }
    fn about(&self) -> &'static str {
        "dynamic minimal perfect hashing split between compute nodes (Othello locator + seeds) \
         and memory nodes (buckets + KV blocks); GET in one RPC with O(1) memory-node work"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        config::KNOBS
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        server::serve(rt, args)
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        client::connect(args)
    }
}
