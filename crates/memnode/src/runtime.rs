//! The runtime of one node.

use crate::workers::WorkerPool;
use dmkv_transport::{
    DeferredService, NodeHost, NodeId, RegionMem, RemoteRegion, RpcContext, Service, ServiceError,
    ServiceId, TransportError, WireError, WireReader, WireWriter,
};
use parking_lot::Mutex;
use std::any::Any;
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

/// A registered region: the client's view and the node's own memory.
#[derive(Clone)]
pub struct Region {
    pub remote: RemoteRegion,
    pub mem: Arc<RegionMem>,
    /// Bytes of this region in use; allocators over it keep this current,
    /// otherwise it is the whole region.
    pub(crate) used: Arc<AtomicU64>,
}

impl Region {
    /// Size in bytes.
    pub fn len(&self) -> u64 {
        self.remote.len
    }
    pub fn is_empty(&self) -> bool {
        self.remote.len == 0
    }

    /// Sets the bytes of this region in use, for engines that hand out its
    /// space themselves (one-sided FAA allocation) rather than through an
    /// allocator of this crate.
    pub fn set_used(&self, bytes: u64) {
        self.used.store(bytes.min(self.len()), Ordering::Relaxed);
    }
}

impl std::fmt::Debug for Region {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Region")
            .field("remote", &self.remote)
            .finish()
    }
}

/// Figures of one node for reports.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct NodeStats {
    /// Bytes of registered memory in use.
    pub memory_used: u64,
    /// Bytes of registered memory reserved.
    pub memory_reserved: u64,
    pub rpcs_served: u64,
    pub handler_cpu_ns: u64,
    /// CPU time of background workers (retraining, resizing, ...).
    pub background_cpu_ns: u64,
    pub background_jobs: u64,
    /// CPU time of the backend's progress thread on this node (UCX over TCP
    /// serves emulated one-sided verbs there); 0 on backends without one.
    pub progress_cpu_ns: u64,
}

impl NodeStats {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::new();
        w.u64(self.memory_used)
            .u64(self.memory_reserved)
            .u64(self.rpcs_served)
            .u64(self.handler_cpu_ns)
            .u64(self.background_cpu_ns)
            .u64(self.background_jobs)
            .u64(self.progress_cpu_ns);
        w.finish()
    }

    pub fn decode(buf: &[u8]) -> Result<NodeStats, WireError> {
        let mut r = WireReader::new(buf);
        let s = NodeStats {
            memory_used: r.u64()?,
            memory_reserved: r.u64()?,
            rpcs_served: r.u64()?,
            handler_cpu_ns: r.u64()?,
            background_cpu_ns: r.u64()?,
            background_jobs: r.u64()?,
            progress_cpu_ns: r.u64()?,
        };
        r.end()?;
        Ok(s)
    }
}

/// The runtime of one node: what engines' server sides use.
pub struct NodeRuntime {
    host: Arc<dyn NodeHost>,
    regions: Mutex<BTreeMap<String, Region>>,
    services: Mutex<Vec<String>>,
    pools: Mutex<Vec<Arc<WorkerPool>>>,
    /// Engine state attached to this node by name (see [`NodeRuntime::attach`]).
    attachments: Mutex<BTreeMap<String, Arc<dyn Any + Send + Sync>>>,
    /// CPU of pools already dropped.
    retired_cpu_ns: AtomicU64,
    retired_jobs: AtomicU64,
}

impl NodeRuntime {
    /// The runtime of `host`. It serves [`NodeRuntime::STATS_SERVICE`], which
    /// returns the node's [`NodeStats`] to any client.
    pub fn new(host: Arc<dyn NodeHost>) -> Arc<NodeRuntime> {
        let rt = Arc::new(NodeRuntime {
            host,
            regions: Mutex::new(BTreeMap::new()),
            services: Mutex::new(Vec::new()),
            pools: Mutex::new(Vec::new()),
            attachments: Mutex::new(BTreeMap::new()),
            retired_cpu_ns: AtomicU64::new(0),
            retired_jobs: AtomicU64::new(0),
        });
        let weak = Arc::downgrade(&rt);
        let stats = move |_: &RpcContext, req: &[u8]| -> Result<Vec<u8>, ServiceError> {
            WireReader::new(req).end()?;
            let rt = weak
                .upgrade()
                .ok_or_else(|| ServiceError::failed("node is shutting down"))?;
            Ok(rt.stats().encode())
        };
        // A fresh host has no services yet, so the name is free.
        rt.host
            .services()
            .register(Self::STATS_SERVICE, Arc::new(stats))
            .expect("the stats service is registered first");
        rt
    }

    /// Name of the service every runtime serves with its [`NodeStats`].
    pub const STATS_SERVICE: &'static str = "dmkv/node-stats";

    pub fn id(&self) -> NodeId {
        self.host.id()
    }

    pub fn host(&self) -> &Arc<dyn NodeHost> {
        &self.host
    }

    /// Registers `len` zeroed bytes and publishes them under `name`, which
    /// must be new on this node.
    pub fn register_region(&self, name: &str, len: usize) -> Result<Region, TransportError> {
        let mut regions = self.regions.lock();
        if regions.contains_key(name) {
            return Err(TransportError::Backend(format!(
                "region {name:?} is already registered"
            )));
        }
        let (remote, mem) = self.host.register_region(len)?;
        let used = Arc::new(AtomicU64::new(remote.len));
        let region = Region { remote, mem, used };
        self.host.services().publish_region(name, remote);
        regions.insert(name.to_string(), region.clone());
        Ok(region)
    }

    /// The region registered under `name`.
    pub fn region(&self, name: &str) -> Option<Region> {
        self.regions.lock().get(name).cloned()
    }

    /// Keeps `state` with this node under `name` (namespaced like regions),
    /// replacing an older attachment of that name. Symmetric designs, whose
    /// compute threads work on their node's own state, find it again when
    /// they connect (`ConnectArgs::hosted`); nothing outside the process can.
    pub fn attach(&self, name: &str, state: Arc<dyn Any + Send + Sync>) {
        self.attachments.lock().insert(name.to_string(), state);
    }

    /// The state attached under `name`, if it has type `T`.
    pub fn attachment<T: Any + Send + Sync>(&self, name: &str) -> Option<Arc<T>> {
        let a = self.attachments.lock().get(name).cloned()?;
        a.downcast::<T>().ok()
    }

    /// Withdraws every region, service and attachment whose name starts with
    /// `prefix` (an engine instance going away).
    pub fn remove_prefixed(&self, prefix: &str) {
        self.attachments
            .lock()
            .retain(|n, _| !n.starts_with(prefix));
        let mut regions = self.regions.lock();
        let names: Vec<String> = regions
            .keys()
            .filter(|n| n.starts_with(prefix))
            .cloned()
            .collect();
        for n in names {
            if let Some(r) = regions.remove(&n) {
                self.host.services().unpublish_region(&n);
                self.host.deregister_region(r.remote.id);
            }
        }
        let mut services = self.services.lock();
        services.retain(|n| {
            if n.starts_with(prefix) {
                self.host.services().unregister(n);
                false
            } else {
                true
            }
        });
    }

    /// Registers an RPC service under `name`, which must be new on this node.
    pub fn register_service(
        &self,
        name: &str,
        handler: Arc<dyn Service>,
    ) -> Result<ServiceId, ServiceError> {
        let id = self.host.services().register(name, handler)?;
        self.services.lock().push(name.to_string());
        Ok(id)
    }

    /// Registers a service that answers through a `Responder`, possibly later
    /// and from another thread (see `DeferredService`).
    pub fn register_deferred_service(
        &self,
        name: &str,
        handler: Arc<dyn DeferredService>,
    ) -> Result<ServiceId, ServiceError> {
        let id = self.host.services().register_deferred(name, handler)?;
        self.services.lock().push(name.to_string());
        Ok(id)
    }

    /// Starts a pool of `threads` background workers whose CPU time is
    /// accounted to this node.
    pub fn worker_pool(&self, name: &str, threads: usize) -> Arc<WorkerPool> {
        let pool = Arc::new(WorkerPool::new(&format!("{}-{name}", self.id()), threads));
        let mut pools = self.pools.lock();
        // Forget pools nobody else holds, keeping their figures.
        pools.retain(|p| {
            if Arc::strong_count(p) == 1 {
                self.retired_cpu_ns.fetch_add(p.cpu_ns(), Ordering::Relaxed);
                self.retired_jobs
                    .fetch_add(p.jobs_done(), Ordering::Relaxed);
                false
            } else {
                true
            }
        });
        pools.push(pool.clone());
        pool
    }

    pub fn stats(&self) -> NodeStats {
        let (rpcs_served, handler_cpu_ns) = self.host.services().served();
        let regions = self.regions.lock();
        let pools = self.pools.lock();
        NodeStats {
            memory_used: regions
                .values()
                .map(|r| r.used.load(Ordering::Relaxed))
                .sum(),
            memory_reserved: regions.values().map(|r| r.remote.len).sum(),
            rpcs_served,
            handler_cpu_ns,
            background_cpu_ns: self.retired_cpu_ns.load(Ordering::Relaxed)
                + pools.iter().map(|p| p.cpu_ns()).sum::<u64>(),
            background_jobs: self.retired_jobs.load(Ordering::Relaxed)
                + pools.iter().map(|p| p.jobs_done()).sum::<u64>(),
            progress_cpu_ns: self.host.progress_cpu_ns(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::exec::block_on;
    use dmkv_transport::local::{LocalCluster, LocalConfig};

    #[test]
    fn stats_are_served_and_prefixes_are_removed() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        rt.register_region("i1/a", 4096).unwrap();
        rt.register_region("i2/b", 4096).unwrap();
        rt.register_service("i1/svc", Arc::new(|_: &RpcContext, _: &[u8]| Ok(vec![])))
            .unwrap();
        let pool = rt.worker_pool("train", 1);
        pool.submit(|| {
            let mut x = 0u64;
            for i in 0..100_000u64 {
                x = x.wrapping_add(i * i);
            }
            std::hint::black_box(x);
        });
        pool.wait_idle();
        let ep = c.fabric().endpoint(c.add_node(0).id()).unwrap();
        let svc = block_on(ep.lookup_service(rt.id(), NodeRuntime::STATS_SERVICE)).unwrap();
        let s = NodeStats::decode(&block_on(ep.call(rt.id(), svc, vec![])).unwrap()).unwrap();
        assert_eq!(s.memory_reserved, 8192);
        assert_eq!(s.background_jobs, 1);
        assert!(s.background_cpu_ns > 0);
        assert!(
            block_on(ep.call(rt.id(), svc, vec![1])).is_err(),
            "a payload is malformed"
        );
        rt.attach("i1/state", Arc::new(7u32));
        assert_eq!(rt.attachment::<u32>("i1/state").as_deref(), Some(&7));
        assert!(rt.attachment::<u64>("i1/state").is_none(), "wrong type");
        rt.remove_prefixed("i1/");
        assert!(rt.attachment::<u32>("i1/state").is_none());
        assert!(rt.region("i1/a").is_none());
        assert!(rt.region("i2/b").is_some());
        assert!(block_on(ep.lookup_service(rt.id(), "i1/svc")).is_err());
        assert!(block_on(ep.lookup_region(rt.id(), "i1/a")).is_err());
        assert_eq!(rt.stats().memory_reserved, 4096);
    }
}
