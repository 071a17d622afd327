//! `rpc-btree` as an engine: the spec, the connected engine, its stats.

use crate::client::{
    PartitionedClient, RpcTreeClient, TreeService, TreeServices, load_partitioned,
    stats_partitioned,
};
use crate::service::{
    KNOB_BOUNDS, KNOB_NODES, KNOB_SLOTS, KNOB_VALUE_BYTES, partitions, serve_tree,
};
use crate::wire::{SERVICE, stats_json};
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvStore, Result, ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, OpKind, labeled};
use dmkv_xtree::MAX_VALUE_LEN;
use std::rc::Rc;
use std::sync::Arc;

/// What both baselines accept: every key (XTree reserves none: empty slots
/// are told by the count) and values up to XTree's limit.
pub const CAPS: Capabilities = Capabilities {
    scan: true,
    max_value_len: MAX_VALUE_LEN,
    reserved_keys: &[],
    reserved_why: "",
};

const KNOBS: &[KnobSpec] = &[KNOB_SLOTS, KNOB_NODES, KNOB_VALUE_BYTES, KNOB_BOUNDS];

/// The spec of `rpc-btree`.
pub struct RpcBtreeSpec;

/// Registered as `rpc-btree` for `dmkv bench`.
pub static SPEC: RpcBtreeSpec = RpcBtreeSpec;

/// Resolves the tree services of an installed instance, one per memory
/// node and key range (a Setup RPC each), with `engine`'s `bounds` knob.
pub fn connect_services(
    args: &ConnectArgs,
    engine: &str,
    specs: &[KnobSpec],
) -> Result<(Endpoint, TreeServices)> {
    let parts = partitions(engine, specs, &args.serve)?;
    let ep = args.fabric.endpoint(args.compute_node)?;
    let mut svcs = Vec::with_capacity(args.serve.nodes.len());
    for &n in &args.serve.nodes {
        let node = NodeId(n);
        let service = block_on(labeled(
            OpKind::Setup,
            ep.lookup_service(node, &args.serve.name(SERVICE)),
        ))?;
        svcs.push(TreeService { node, service });
    }
    Ok((ep, TreeServices { parts, svcs }))
}

/// The engine stats of range-partitioned trees: the summed figures, and
/// each range's own under `partitions` when there are several.
pub fn partitioned_stats_json(
    sum: &dmkv_xtree::TreeStats,
    each: &[dmkv_xtree::TreeStats],
) -> serde_json::Value {
    let mut v = stats_json(sum);
    if each.len() > 1 {
        v.as_object_mut().expect("stats are an object").insert(
            "partitions".into(),
            serde_json::Value::Array(each.iter().map(stats_json).collect()),
        );
    }
    v
}

impl EngineSpec for RpcBtreeSpec {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        "rpc-btree"
    }
    fn about(&self) -> &'static str {
        "server-centric B+tree (DrTM-Tree / eRPC+Masstree): every operation is one RPC and the memory node traverses XTree"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        KNOBS
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        serve_tree(rt, args, self.name(), KNOBS).map(|_| ())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let (_ep, services) = connect_services(&args, self.name(), KNOBS)?;
        Ok(Arc::new(RpcBtree {
            services,
            compute: args.compute_node,
        }))
    }
}

struct RpcBtree {
    services: TreeServices,
    compute: NodeId,
}

#[async_trait(?Send)]
impl Engine for RpcBtree {
    fn name(&self) -> &'static str {
        "rpc-btree"
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        // One range: the plain client, without the routing layer (~30
        // instructions a GET).
        if let [svc] = self.services.svcs[..] {
            return Ok(Rc::new(RpcTreeClient::new(ep, svc)));
        }
        Ok(Rc::new(PartitionedClient::new(ep, &self.services)))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        load_partitioned(ep, &self.services, pairs).await
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let (sum, each) = stats_partitioned(ep, &self.services).await?;
        Ok(partitioned_stats_json(&sum, &each))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}
