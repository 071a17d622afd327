//! `rpc-btree` as an engine: the spec, the connected engine, its stats.

use crate::client::{RpcTreeClient, TreeService, load, stats};
use crate::service::{KNOB_NODES, KNOB_SLOTS, KNOB_VALUE_BYTES, serve_tree};
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

const KNOBS: &[KnobSpec] = &[KNOB_SLOTS, KNOB_NODES, KNOB_VALUE_BYTES];

/// The spec of `rpc-btree`.
pub struct RpcBtreeSpec;

/// Registered as `rpc-btree` for `dmkv bench`.
pub static SPEC: RpcBtreeSpec = RpcBtreeSpec;

/// Resolves the tree service of an installed instance (a Setup RPC).
pub fn connect_service(args: &ConnectArgs) -> Result<(Endpoint, TreeService)> {
    let node = NodeId(args.serve.nodes[0]);
    let ep = args.fabric.endpoint(args.compute_node)?;
    let service = block_on(labeled(
        OpKind::Setup,
        ep.lookup_service(node, &args.serve.name(SERVICE)),
    ))?;
    Ok((ep, TreeService { node, service }))
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
        let (_ep, svc) = connect_service(&args)?;
        Ok(Arc::new(RpcBtree {
            svc,
            compute: args.compute_node,
        }))
    }
}

struct RpcBtree {
    svc: TreeService,
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
        Ok(Rc::new(RpcTreeClient::new(ep, self.svc)))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        load(ep, self.svc, pairs).await
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        Ok(stats_json(&stats(ep, self.svc).await?))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}
