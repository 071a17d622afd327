//! Replication of a shard's KV data to its mirrors (paper §4.1: "the KV data
//! in each shard is replicated to two other shards").
//!
//! The primary forwards every change of its heap to each live mirror with
//! one-sided writes, before it applies the change locally and before it
//! replies: new blocks, start bits of freshly carved blocks, and kills
//! (zeroing a dead block's sequence number). One-sided writes need no CPU
//! on the mirror and cannot wait on its handler threads, so forwarding from
//! inside a handler cannot deadlock. A mirror that is down is skipped from
//! then on; a mirror whose region is gone has been fenced by a takeover, so
//! this primary is presumed dead and refuses to go on.

use crate::layout::{HeapLayout, seq_offset};
use crate::server::ctx::NodeCtx;
use dmkv_transport::exec::block_on_network;
use dmkv_transport::{NodeId, RemoteRegion, ServiceError, TransportError};
use parking_lot::RwLock;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One change to forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MirrorOp {
    /// Bytes at a heap address (a whole block).
    Write { addr: u64, data: Vec<u8> },
    /// The start bit of the block at `addr` (after its block is written).
    Start { addr: u64 },
    /// Marks the block at `addr` of `words` words dead.
    Kill { addr: u64, words: u64 },
}

pub struct Mirror {
    pub node: NodeId,
    pub region: RemoteRegion,
    pub alive: AtomicBool,
}

/// Where a shard's changes go, and what forwarding cost.
#[derive(Default)]
pub struct ReplicaSet {
    mirrors: RwLock<Vec<Arc<Mirror>>>,
    pub verbs: AtomicU64,
    pub bytes: AtomicU64,
    pub round_trips: AtomicU64,
}

impl ReplicaSet {
    pub fn set(&self, mirrors: Vec<(NodeId, RemoteRegion)>) {
        *self.mirrors.write() = mirrors
            .into_iter()
            .map(|(node, region)| {
                Arc::new(Mirror {
                    node,
                    region,
                    alive: AtomicBool::new(true),
                })
            })
            .collect();
    }

    /// Mirrors still believed alive.
    pub fn live(&self) -> Vec<Arc<Mirror>> {
        self.mirrors
            .read()
            .iter()
            .filter(|m| m.alive.load(Ordering::Relaxed))
            .cloned()
            .collect()
    }

    pub fn configured(&self) -> usize {
        self.mirrors.read().len()
    }

    /// Forwards `ops` to every live mirror and waits until each has them.
    pub fn forward(
        &self,
        ctx: &NodeCtx,
        layout: &HeapLayout,
        ops: &[MirrorOp],
    ) -> Result<(), ServiceError> {
        let mirrors = self.live();
        if mirrors.is_empty() || ops.is_empty() {
            return Ok(());
        }
        // One-sided writes only: the network alone ends this wait (under the
        // simulated cluster no job starts on top of this handler meanwhile,
        // such as a takeover that needs this node's handler core).
        let results = ctx.with_endpoint(|ep| {
            block_on_network(futures::future::join_all(mirrors.iter().map(|m| {
                let mut b = ep.batch();
                for op in ops {
                    match op {
                        MirrorOp::Write { addr, data } => {
                            self.bytes.fetch_add(data.len() as u64, Ordering::Relaxed);
                            b.write(m.region.at(*addr), data.clone());
                        }
                        MirrorOp::Start { addr } => {
                            let (w, bit) = layout.start_bit(*addr);
                            self.bytes.fetch_add(8, Ordering::Relaxed);
                            b.faa(m.region.at(w), 1 << bit);
                        }
                        MirrorOp::Kill { addr, words } => {
                            self.bytes.fetch_add(8, Ordering::Relaxed);
                            b.write(m.region.at(addr + seq_offset(*words)), vec![0; 8]);
                        }
                    }
                }
                self.verbs.fetch_add(b.len() as u64, Ordering::Relaxed);
                self.round_trips.fetch_add(1, Ordering::Relaxed);
                b.run()
            })))
        })?;
        for (m, r) in mirrors.iter().zip(results) {
            match r {
                Ok(_) => {}
                Err(TransportError::NodeDown(_) | TransportError::UnknownNode(_)) => {
                    m.alive.store(false, Ordering::Relaxed);
                }
                Err(
                    e @ (TransportError::NoSuchRegion { .. } | TransportError::AccessDenied { .. }),
                ) => {
                    return Err(ServiceError::failed(format!(
                        "outback: mirror on {} refused the write ({e}): this shard was taken over",
                        m.node
                    )));
                }
                Err(e) => {
                    return Err(ServiceError::failed(format!(
                        "outback: forwarding to the mirror on {} failed: {e}",
                        m.node
                    )));
                }
            }
        }
        Ok(())
    }
}
