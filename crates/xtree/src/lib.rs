//! # dmkv-xtree: the memory-node B+tree of XStore (paper 000, §5.1, §5.3)
//!
//! XTree lives in a memory node's registered memory. The node's handler
//! threads run every structural operation; clients read nodes and values
//! one-sided. docs/xtree.md is the specification; this crate implements it:
//!
//! - [`layout`]: node geometry (N slots in `LINES` cache lines with a version
//!   word each), the packed header/meta/pointer words and value blocks, with
//!   `const` assertions pinning the bit layouts;
//! - [`protocol`]: the writer/reader version protocol over an abstract word
//!   array (the same code runs on the node, in readers and in the loom model);
//! - [`view`]: bounds-checked parsing of node images and value blocks, used
//!   by one-sided readers and by the node's own readers, with torn, locked,
//!   incarnation-mismatch and malformed images told apart;
//! - [`XTree`] (in `tree`): get, insert, update, upsert, delete, scan, bulk
//!   load, leaf lookup and iteration, split hook and hinted updates, safe to
//!   call from several handler threads;
//! - [`XTreeConfig`]: region sizes from the expected key count.
//!
//! Engines build on it: `rpc-btree` serves every operation by RPC, `cell`
//! reads the tree one-sided with a client cache of upper levels, and
//! `xstore` trains learned models over its leaves.

#![forbid(unsafe_code)]

mod config;
pub mod layout;
pub mod protocol;
mod tree;
pub mod view;

pub use config::XTreeConfig;
pub use layout::{ChildPtr, FatPtr, Geometry, Header, MAX_VALUE_LEN, Meta, RootWord, Span};
pub use tree::{
    CoveredLeaf, HintedUpdate, LeafInfo, LeafRef, MAX_HINT_LEAVES, SplitEvent, SplitHook,
    TreeStats, XTree, XTreeError,
};
pub use view::{BlockError, ChildLookup, KeysView, LeafFind, NodeView, SlotValue, ViewError};
