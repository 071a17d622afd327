//! # dmkv-transport-ucx: the transport contract over UCX
//!
//! Runs dmkv's nodes in separate processes and on separate hosts through
//! UCX (the communication layer under Open MPI and MPICH): TCP and shared
//! memory on any machine, InfiniBand/RoCE verbs (rc, dc) on clusters, chosen
//! by UCX's own configuration (`UCX_TLS`, `UCX_NET_DEVICES`, or
//! [`UcxConfig`]) with no change to dmkv or its engines.
//!
//! How the parts fit:
//!
//! - [`UcxCluster`] is one process's part of a cluster: it owns the UCX
//!   context, serves nodes ([`UcxCluster::serve`] → [`UcxNode`], a
//!   [`NodeHost`](dmkv_transport::NodeHost)) and connects to nodes served by
//!   other processes ([`UcxCluster::connect`]); its
//!   [`Fabric`](dmkv_transport::Fabric) makes endpoints.
//! - `control`: a TCP connection per (client process, node) outside UCX for
//!   the cluster-secret handshake, sessions, remote keys (handed out only
//!   against the region's access key), invalidation and liveness.
//! - `server`: a serving node's progress thread (drives its UCX worker,
//!   which over TCP executes clients' emulated one-sided verbs; its CPU time
//!   is reported), handler threads and control listener.
//! - `client`: the per-thread endpoint: its own UCX worker driven by the
//!   executor's idle hook, one-sided verbs with `ucp_get/put/atomic_op_nbx`
//!   (or direct word-by-word access where shared memory maps the node's
//!   region here), batches posted at once and awaited once, RPC over active
//!   messages.
//! - [`deploy`]: `dmkv memnode` (a node with the admin service that installs
//!   engines by name) and [`deploy::UcxDeployment`], the compute side beside
//!   the in-process `LocalDeployment`.
//! - `ffi`: the only `unsafe` code: bindgen bindings over the system's
//!   `<ucp/api/ucp.h>` and safe wrappers.
//!
//! The crate is empty unless its `ucx` feature is on, so that default
//! builds need neither libucx nor libclang. See `docs/ucx.md` for the memory
//! semantics each UCX transport gives and how to deploy.

#![cfg(feature = "ucx")]
#![deny(unsafe_code)]

mod client;
mod cluster;
mod control;
#[cfg(test)]
mod dead_client;
#[cfg(test)]
mod dead_peer;
pub mod deploy;
mod ffi;
mod replies;
mod server;
mod shm;
mod verbs;

pub use cluster::{PeerLinker, UcxCluster, UcxConfig, UcxStats, VerbPath};
pub use server::UcxNode;
