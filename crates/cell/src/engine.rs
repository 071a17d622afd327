//! `cell` as an engine.

use crate::reader::TreeReader;
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvClient, KvError, KvStore,
    Result, ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_rpc_btree::service::{KNOB_NODES, KNOB_SLOTS, KNOB_VALUE_BYTES, serve_tree};
use dmkv_rpc_btree::wire::{NODE_REGION, VALUE_REGION, stats_json};
use dmkv_rpc_btree::{CAPS, RpcTreeClient, TreeService, connect_service};
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, OpKind, labeled};
use dmkv_xtree::layout::{SUPERBLOCK_FORMAT_OFFSET, parse_format_word};
use std::rc::Rc;
use std::sync::Arc;

const KNOB_CACHED_LEVELS: KnobSpec = KnobSpec {
    name: "cached_levels",
    default: "4",
    help: "inner nodes at least this many levels above the leaves are cached, 0..=255 (the paper's Cell setting is 4; 0 and 1 both cache every inner level, a level above the root caches none)",
};
const KNOB_CACHE_BYTES: KnobSpec = KnobSpec {
    name: "cache_bytes",
    default: "67108864",
    help: "capacity of the client's LRU node cache in bytes (images plus bookkeeping), up to 2^40 (0 = no cache)",
};

const KNOBS: &[KnobSpec] = &[
    KNOB_SLOTS,
    KNOB_NODES,
    KNOB_VALUE_BYTES,
    KNOB_CACHED_LEVELS,
    KNOB_CACHE_BYTES,
];

/// The spec of `cell`.
pub struct CellSpec;

/// Registered as `cell` for `dmkv bench`.
pub static SPEC: CellSpec = CellSpec;

impl EngineSpec for CellSpec {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        "cell"
    }
    fn about(&self) -> &'static str {
        "client-direct B+tree (Cell): GET and SCAN traverse XTree one-sided with upper levels cached at the client; writes by RPC"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        KNOBS
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        serve_tree(rt, args, self.name(), KNOBS).map(|_| ())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let knobs = &args.serve.knobs;
        let cached_levels: u8 =
            knobs.get_in("cell", KNOBS, KNOB_CACHED_LEVELS.name, 0..=u8::MAX)?;
        let cache_bytes: usize = knobs.get_in("cell", KNOBS, KNOB_CACHE_BYTES.name, 0..=1 << 40)?;
        let (ep, svc) = connect_service(&args)?;
        let (nodes, values, format) = block_on(labeled(OpKind::Setup, async {
            let nodes = ep
                .lookup_region(svc.node, &args.serve.name(NODE_REGION))
                .await?;
            let values = ep
                .lookup_region(svc.node, &args.serve.name(VALUE_REGION))
                .await?;
            let f = ep.read(nodes.at(SUPERBLOCK_FORMAT_OFFSET), 8).await?;
            Ok::<_, KvError>((nodes, values, f))
        }))?;
        let w = u64::from_le_bytes(format[..8].try_into().expect("8 bytes"));
        let geo = parse_format_word(w)
            .ok_or_else(|| KvError::Corrupt(format!("no XTree superblock (format word {w:#x})")))?;
        Ok(Arc::new(Cell {
            svc,
            compute: args.compute_node,
            reader: Arc::new(TreeReader::new(
                geo,
                nodes,
                values,
                cached_levels,
                cache_bytes,
            )),
        }))
    }
}

struct Cell {
    svc: TreeService,
    compute: NodeId,
    reader: Arc<TreeReader>,
}

#[async_trait(?Send)]
impl Engine for Cell {
    fn name(&self) -> &'static str {
        "cell"
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(CellClient {
            writes: RpcTreeClient::new(ep.clone(), self.svc),
            ep,
            reader: self.reader.clone(),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        dmkv_rpc_btree::client::load(ep, self.svc, pairs).await
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let tree = dmkv_rpc_btree::client::stats(ep, self.svc).await?;
        let mut v = stats_json(&tree);
        let obj = v.as_object_mut().expect("stats are an object");
        if let serde_json::Value::Object(client) = self.reader.stats_json() {
            obj.extend(client);
        }
        Ok(v)
    }
    fn client_cache_bytes(&self) -> u64 {
        self.reader.cache_bytes()
    }
}

/// A thread's handle: reads one-sided, writes by RPC.
struct CellClient {
    ep: Rc<Endpoint>,
    reader: Arc<TreeReader>,
    writes: RpcTreeClient,
}

impl KvClient for CellClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        self.reader.get(&self.ep, key).await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        KvClient::insert(&self.writes, key, value).await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        KvClient::update(&self.writes, key, value).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        KvClient::upsert(&self.writes, key, value).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        KvClient::delete(&self.writes, key).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        self.reader.scan(&self.ep, start, n).await
    }
}
