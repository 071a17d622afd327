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
    /// Unique in the process (see `ENDPOINTS`).
    id: u64,
    /// Alive as long as this context: a thread's `ENDPOINTS` entry for a
    /// dropped context is pruned by the next miss on that thread.
    alive: Arc<()>,
}

thread_local! {
    /// The endpoints this thread (a handler or the worker) issues from, one
    /// per node context it served, each with the id of its context and a
    /// token that dies with the context. Keyed by a process-unique id, not
    /// the context's address: a simulation runs every node and, in a seed
    /// sweep, one cluster after another on one thread, and a new context can
    /// sit at a freed one's address; an endpoint of the old cluster's fabric
    /// then reached the old (crashed) nodes, and a DST seed failed only after
    /// certain earlier seeds. One entry per context, not one slot per thread:
    /// under the simulation every memory node's handlers run on this one
    /// thread, and a single slot was replaced each time a mirror write of
    /// one node followed one of another, so a run with two memory nodes made
    /// an endpoint (and a simulated client core) per alternation, ~1,950 per
    /// node in a 10,000-operation YCSB A run (`ENDPOINTS` invariant: at most
    /// one entry per live context; tested by
    /// `one_endpoint_per_node_context_on_a_shared_thread`).
    static ENDPOINTS: RefCell<Vec<EndpointEntry>> = const { RefCell::new(Vec::new()) };
}

/// A thread's endpoint for one node context (`ENDPOINTS`).
struct EndpointEntry {
    ctx: u64,
    alive: Weak<()>,
    ep: Rc<Endpoint>,
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
            alive: Arc::new(()),
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

    /// Runs `f` with this thread's endpoint for this context (made on first
    /// use; `ENDPOINTS`). No borrow of the thread's table is held while `f`
    /// runs: under the simulation `f` may run other nodes' handlers, which
    /// look up their own endpoints.
    pub fn with_endpoint<R>(&self, f: impl FnOnce(&Endpoint) -> R) -> Result<R, ServiceError> {
        let found = ENDPOINTS.with(|t| {
            t.borrow()
                .iter()
                .find(|e| e.ctx == self.id)
                .map(|e| e.ep.clone())
        });
        let ep =
            match found {
                Some(ep) => ep,
                None => {
                    let rt = self.runtime()?;
                    let ep =
                        Rc::new(rt.host().fabric().endpoint(self.node).map_err(|e| {
                            ServiceError::failed(format!("outback: endpoint: {e}"))
                        })?);
                    ENDPOINTS.with(|t| {
                        let mut t = t.borrow_mut();
                        t.retain(|e| e.alive.strong_count() > 0);
                        t.push(EndpointEntry {
                            ctx: self.id,
                            alive: Arc::downgrade(&self.alive),
                            ep: ep.clone(),
                        });
                    });
                    ep
                }
            };
        Ok(f(&ep))
    }
}
