//! # dmkv-memnode: the memory-node runtime
//!
//! What an engine's server side runs on, whatever backend hosts the node:
//!
//! - [`NodeRuntime`]: named regions (registered with the backend and
//!   published in the node's directory so clients find them by name), named
//!   RPC services, background [`WorkerPool`]s, and accounting of memory in
//!   use and CPU spent by handlers and workers;
//! - allocators over a region's bytes: [`BumpAllocator`] and
//!   [`SlabAllocator`] (fixed-size blocks with a free list), and
//!   [`SizeClassAllocator`] for variable-length values;
//! - [`GrowingPool`]: a pool that registers further segment regions when
//!   its first one (sized from the expected load) is full, and
//!   [`RemoteSegments`], with which clients find those segments.
//!
//! Allocators run on the node's CPU; designs that allocate one-sided (ROLEX's
//! FAA on a leaf counter) keep their counters in the region itself.

#![forbid(unsafe_code)]

mod alloc;
mod grow;
mod runtime;
mod workers;

pub use alloc::{AllocError, BumpAllocator, SizeClassAllocator, SlabAllocator};
pub use grow::{GrowingPool, RemoteSegments, SegmentShape, segment_name};
pub use runtime::{NodeRuntime, NodeStats, Region};
pub use workers::WorkerPool;
