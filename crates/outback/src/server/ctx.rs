//! What every part of a memory node's server side shares: its identity, the
//! instance's settings, and access to the runtime (regions, the background
//! worker, an endpoint for the verbs the node itself issues).

use crate::config::Config;
use dmkv_api::ServeArgs;
use dmkv_memnode::{NodeRuntime, Region, WorkerPool};
use dmkv_transport::{Endpoint, NodeId, ServiceError};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::{Arc, Weak};

pub struct NodeCtx {
    pub node: NodeId,
    /// Shard `i` is first served by `nodes[i]`.
    pub nodes: Vec<NodeId>,
    pub args: ServeArgs,
    pub cfg: Config,
    /// Weak, so that the services the runtime holds do not keep it alive.
    pub rt: Weak<NodeRuntime>,
    pub pool: Weak<WorkerPool>,
}

/// A thread's cached endpoint and whose it is: the context's address and a
/// weak handle on the context's runtime. The weak handle keeps the
/// runtime's allocation, so a later deployment's runtime cannot get its
/// address: under `sim` every node of every deployment runs on one OS
/// thread, and an entry keyed by address alone was once reused by a new
/// context at a freed one's address, whose endpoint belonged to a dead
/// simulation ("RPC to node n0 timed out"; which seed failed depended on
/// the allocation history of the process, as ScaleStore's stale endpoint
/// cache did).
struct Cached {
    owner: usize,
    rt: Weak<NodeRuntime>,
    ep: Rc<Endpoint>,
}

thread_local! {
    /// The endpoint this thread (a handler or the worker) last issued from.
    static ENDPOINT: RefCell<Option<Cached>> = const { RefCell::new(None) };
}

impl NodeCtx {
    pub fn shards(&self) -> u16 {
        self.nodes.len() as u16
    }

    /// `instance/name`.
    pub fn name(&self, name: &str) -> String {
        self.args.name(name)
    }

    pub fn runtime(&self) -> Result<Arc<NodeRuntime>, ServiceError> {
        self.rt
            .upgrade()
            .ok_or_else(|| ServiceError::failed("outback: the node is shutting down"))
    }

    /// Registers (and publishes) a region of `len` bytes under `name`.
    pub fn region(&self, name: &str, len: u64) -> Result<Region, ServiceError> {
        self.runtime()?
            .register_region(&self.name(name), len as usize)
            .map_err(|e| ServiceError::exhausted(format!("outback: region {name}: {e}")))
    }

    /// Withdraws every region whose name starts with `prefix`.
    pub fn withdraw(&self, prefix: &str) {
        if let Ok(rt) = self.runtime() {
            rt.remove_prefixed(&self.name(prefix));
        }
    }

    /// Queues background work on the node's worker.
    pub fn submit(&self, job: impl FnOnce() + Send + 'static) -> Result<(), ServiceError> {
        let pool = self
            .pool
            .upgrade()
            .ok_or_else(|| ServiceError::failed("outback: the node is shutting down"))?;
        pool.submit(job);
        Ok(())
    }

    /// Runs `f` with this thread's endpoint (made on first use).
    pub fn with_endpoint<R>(&self, f: impl FnOnce(&Endpoint) -> R) -> Result<R, ServiceError> {
        let me = self as *const NodeCtx as usize;
        let ep = ENDPOINT.with(|cell| -> Result<Rc<Endpoint>, ServiceError> {
            if let Some(c) = &*cell.borrow()
                && c.owner == me
                && Weak::ptr_eq(&c.rt, &self.rt)
            {
                return Ok(c.ep.clone());
            }
            let rt = self.runtime()?;
            let ep = Rc::new(
                rt.host()
                    .fabric()
                    .endpoint(self.node)
                    .map_err(|e| ServiceError::failed(format!("outback: endpoint: {e}")))?,
            );
            *cell.borrow_mut() = Some(Cached {
                owner: me,
                rt: self.rt.clone(),
                ep: ep.clone(),
            });
            Ok(ep)
        })?;
        Ok(f(&ep))
    }
}
