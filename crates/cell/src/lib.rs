//! # dmkv-cell: the client-direct baseline
//!
//! Cell (Mitchell et al., ATC'16) as XStore evaluates it (paper 000, §7.1,
//! footnote 8): clients traverse the memory node's B+tree with one-sided
//! reads, caching inner nodes at least `cached_levels` (4 in the paper)
//! levels above the leaves in an LRU; writes go to the memory node by RPC.
//! Here the tree is [`XTree`](dmkv_xtree::XTree) and the write path is
//! `rpc-btree`'s service, installed unchanged.
//!
//! - [`cache`]: the byte-bounded LRU of inner-node images;
//! - [`reader`]: the descent (root word, cached or fetched inner nodes
//!   checked against their pointers' incarnations, retry from the
//!   superblock on any mismatch), GET (key lines, then the value line or
//!   block) and SCAN (whole leaves along right links);
//! - the engine spec, [`SPEC`], registered as `cell`.
//!
//! docs/cell.md gives the invariants and the costs per operation.

#![forbid(unsafe_code)]

pub mod cache;
mod engine;
pub mod reader;

pub use engine::{CellSpec, SPEC};
