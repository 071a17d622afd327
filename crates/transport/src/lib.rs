//! # dmkv-transport: the transport contract and the in-process backend
//!
//! Everything an engine knows about the network is here. A cluster is a set
//! of nodes; any node may register memory regions and serve RPCs (a memory
//! node is a node that only serves). Engines reach other nodes through an
//! [`Endpoint`], one per issuing thread:
//!
//! - one-sided verbs — [`Endpoint::read`], [`Endpoint::write`],
//!   [`Endpoint::cas`], [`Endpoint::faa`] — on `(node, region, offset)`
//!   addresses guarded by an access key; every access is bounds- and
//!   key-checked and a bad one is an error, never undefined behaviour;
//! - [`Endpoint::batch`]: several verbs posted at once for one round trip
//!   (RDMA doorbell batching);
//! - [`Endpoint::call`]: request/reply RPC to a service on a node, run by the
//!   node's handler threads;
//! - exact counters per operation kind ([`counters`]).
//!
//! Memory semantics are RDMA's: 8-byte aligned words are atomic (and CAS and
//! FAA work on them); a larger read racing a write may see some words old and
//! some new. Within one read, words are observed in increasing address order,
//! and a write's words become visible in increasing address order (what RC
//! NICs do in practice; see `docs/transport.md` for what layouts may assume).
//! Layouts that are read one-sided carry versions or checksums, and readers
//! validate and retry.
//!
//! Operations are `async` and run as tasks on a compute thread's executor
//! ([`exec`]); a backend that completes a verb at once costs no allocation.
//!
//! Backends implement [`Fabric`], [`EndpointBackend`] and [`NodeHost`]:
//! [`local`] runs every node in this process with fault injection; [`sim`]
//! runs a whole cluster in virtual time on one thread with a hardware model; a UCX
//! backend lives in its own crate. [`conformance`] is the test suite every
//! backend must pass.

#![deny(unsafe_code)]

pub mod addr;
pub mod backend;
pub mod buffers;
#[allow(unsafe_code)]
pub mod charge;
pub mod conformance;
pub mod counters;
#[allow(unsafe_code)]
mod cputime;
pub mod endpoint;
pub mod error;
pub mod exec;
pub mod local;
#[allow(unsafe_code)]
mod local_rpc;
mod parker;
#[allow(unsafe_code)]
pub mod placement;
#[allow(unsafe_code)]
pub mod region;
mod reply_state;
#[allow(unsafe_code)]
pub mod servestats;
pub mod service;
pub mod sim;
#[allow(unsafe_code)]
pub mod slot;
pub mod time;
pub mod wire;

pub use addr::{AccessKey, NodeId, RegionId, RemoteAddr, RemoteRegion, ServiceId};
pub use backend::{
    CallFuture, EndpointBackend, Fabric, NodeHost, OpFuture, PooledResults, SharedOp, Verb,
    VerbResult, VerbResults, Verbs,
};
pub use counters::{CounterTable, Counters, OpKind, labeled};
pub use cputime::{BusyClock, thread_cpu_ns, touch_local_at, touch_local_lines};
pub use endpoint::{Batch, BatchResult, BatchRun, Endpoint, OneVerb, ReadBuf, RpcCall};
pub use error::{ErrorCode, Result, ServiceError, TransportError};
pub use region::RegionMem;
pub use service::{
    Answered, DeferredService, HandlerCache, Later, LentReply, Reply, ReplySink, Responder,
    RpcContext, Service, ServiceTable,
};
pub use slot::{FutureSlot, SlotFuture};
pub use wire::{WireError, WireReader, WireWriter};
