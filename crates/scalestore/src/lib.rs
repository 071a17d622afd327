//! # dmkv-scalestore: ScaleStore (SIGMOD'22) and the `btree-local` baseline
//!
//! ScaleStore joins the DRAM of symmetric nodes into one cache over their
//! NVMe SSDs. Pages (4 KiB, [`page`]) are named by [`pid::Pid`]s that carry
//! their directory node; a directory-based coherence protocol with
//! anticipatory chaining moves pages between caches; a page provider evicts
//! cold pages with an epoch-based LRU approximation; applications program
//! against page guards ([`guard`]) and need not know where pages live.
//!
//! - [`latch`]: the hybrid latch (exclusive, shared, optimistic);
//! - [`guard`]: guards and the [`guard::Pager`] trait they run over;
//! - [`btree`]: the B-tree with optimistic lock coupling, written only
//!   against guards;
//! - [`local`]: `btree-local`, the same tree on plain memory.
//!
//! Design note: `docs/scalestore.md`, `docs/btree-local.md`.

#![deny(unsafe_code)]

pub mod btree;
pub mod directory;
pub mod engine;
pub mod frames;
pub mod guard;
pub mod handler;
pub mod holder;
pub mod latch;
pub mod local;
pub mod membership;
pub mod msg;
pub mod node;
pub mod page;
pub mod pid;
pub mod process;
pub mod provider;
pub mod repoll;
pub mod ssd;
pub mod ssdio;
pub mod trace;
pub mod worker;

pub use engine::{SCALESTORE, ScaleStoreSpec};
pub use local::{BTREE_LOCAL, BTreeLocalSpec, LocalPager};

/// The `scalestore` engine spec (the name the engine registry expects).
pub static SPEC: &ScaleStoreSpec = &SCALESTORE;
