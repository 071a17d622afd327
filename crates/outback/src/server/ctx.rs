//! What every part of a memory node's server side shares: its identity, the
//! instance's settings, and access to the runtime (regions, the background
//! worker, an endpoint for the verbs the node itself issues).

use crate::config::Config;
use dmkv_api::ServeArgs;
use dmkv_memnode::{NodeRuntime, Region, WorkerPool};
use dmkv_transport::{Endpoint, NodeId, ServiceError};
use std::cell::RefCell;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
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
    /// Unique in the process (see `ENDPOINT`).
    id: u64,
}

thread_local! {
    /// The endpoint this thread (a handler or the worker) issues from, with
    /// the id of the context it belongs to. Keyed by a process-unique id,
    /// not the context's address: a simulation runs every node and, in a
    /// seed sweep, one cluster after another on one thread, and a new
    /// context can sit at a freed one's address; an endpoint of the old
    /// cluster's fabric then reached the old (crashed) nodes, and a DST seed
    /// failed only after certain earlier seeds.
    static ENDPOINT: RefCell<Option<(u64, Rc<Endpoint>)>> = const { RefCell::new(None) };
}

static NEXT_CTX_ID: AtomicU64 = AtomicU64::new(0);

impl NodeCtx {
    pub fn new(
        node: NodeId,
        nodes: Vec<NodeId>,
        args: ServeArgs,
        cfg: Config,
        rt: Weak<NodeRuntime>,
        pool: Weak<WorkerPool>,
    ) -> NodeCtx {
        NodeCtx {
            node,
            nodes,
            args,
            cfg,
            rt,
            pool,
            id: NEXT_CTX_ID.fetch_add(1, Ordering::Relaxed),
        }
    }

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
        let me = self.id;
        let ep = ENDPOINT.with(|cell| -> Result<Rc<Endpoint>, ServiceError> {
            if let Some((owner, ep)) = &*cell.borrow()
                && *owner == me
            {
                return Ok(ep.clone());
            }
            let rt = self.runtime()?;
            let ep = Rc::new(
                rt.host()
                    .fabric()
                    .endpoint(self.node)
                    .map_err(|e| ServiceError::failed(format!("outback: endpoint: {e}")))?,
            );
            *cell.borrow_mut() = Some((me, ep.clone()));
            Ok(ep)
        })?;
        Ok(f(&ep))
    }
}
