//! `cell` as an engine.

use crate::reader::TreeReader;
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvClient, KvError, KvStore,
    Result, ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_rpc_btree::client::{load_partitioned, stats_partitioned};
use dmkv_rpc_btree::service::{KNOB_BOUNDS, KNOB_NODES, KNOB_SLOTS, KNOB_VALUE_BYTES, serve_tree};
use dmkv_rpc_btree::wire::{NODE_REGION, VALUE_REGION};
use dmkv_rpc_btree::{
    CAPS, PartitionedClient, TreeServices, connect_services, partitioned_stats_json,
    scan_partitions,
};
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
    KNOB_BOUNDS,
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
        let (ep, services) = connect_services(&args, self.name(), KNOBS)?;
        // One reader (and node cache) per key range; the cache budget is
        // split evenly between them.
        let per_range_cache = cache_bytes / services.svcs.len();
        let mut readers = Vec::with_capacity(services.svcs.len());
        // Another compute process of a simulated cluster counts into
        // compute node 0's counters (only those; its caches are its own).
        let first = args.counting_into::<Cell>();
        for (p, svc) in services.svcs.iter().enumerate() {
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
            let geo = parse_format_word(w).ok_or_else(|| {
                KvError::Corrupt(format!("no XTree superblock (format word {w:#x})"))
            })?;
            readers.push(Arc::new(TreeReader::new(
                geo,
                nodes,
                values,
                cached_levels,
                per_range_cache,
                first
                    .and_then(|c| c.readers.get(p))
                    .map(|r| r.stats.clone())
                    .unwrap_or_default(),
            )));
        }
        Ok(Arc::new(Cell {
            services,
            compute: args.compute_node,
            readers,
        }))
    }
}

struct Cell {
    services: TreeServices,
    compute: NodeId,
    /// Range `p`'s reader is `readers[p]`.
    readers: Vec<Arc<TreeReader>>,
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
            writes: PartitionedClient::new(ep.clone(), &self.services),
            ep,
            readers: self.readers.clone(),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        load_partitioned(ep, &self.services, pairs).await
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let (sum, each) = stats_partitioned(ep, &self.services).await?;
        let mut v = partitioned_stats_json(&sum, &each);
        let obj = v.as_object_mut().expect("stats are an object");
        let clients: Vec<serde_json::Value> = self.readers.iter().map(|r| r.stats_json()).collect();
        if let serde_json::Value::Object(client) = summed_counts(&clients) {
            obj.extend(client);
        }
        if let Some(serde_json::Value::Array(parts)) = obj.get_mut("partitions") {
            for (p, c) in parts.iter_mut().zip(clients) {
                if let (Some(p), serde_json::Value::Object(c)) = (p.as_object_mut(), c) {
                    p.extend(c);
                }
            }
        }
        Ok(v)
    }
    fn client_cache_bytes(&self) -> u64 {
        self.readers.iter().map(|r| r.cache_bytes()).sum()
    }
}

/// The readers' counters of every range as one: integer fields summed,
/// other fields (the cached levels, the per-level ratios) the first
/// range's when there is one range, left to `partitions` otherwise.
fn summed_counts(each: &[serde_json::Value]) -> serde_json::Value {
    if each.len() == 1 {
        return each[0].clone();
    }
    let mut out = serde_json::Map::new();
    if let Some(serde_json::Value::Object(first)) = each.first() {
        for (k, v) in first {
            if k == "cached_levels" {
                out.insert(k.clone(), v.clone());
            } else if v.is_u64() {
                let sum: u64 = each.iter().filter_map(|e| e[k].as_u64()).sum();
                out.insert(k.clone(), sum.into());
            }
        }
    }
    serde_json::Value::Object(out)
}

/// A thread's handle: reads one-sided, writes by RPC.
struct CellClient {
    ep: Rc<Endpoint>,
    /// Range `p`'s reader is `readers[p]`; the ranges are `writes.parts()`.
    readers: Vec<Arc<TreeReader>>,
    writes: PartitionedClient,
}

impl KvClient for CellClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        self.readers[self.writes.parts().of(key)]
            .get(&self.ep, key)
            .await
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
        scan_partitions(self.writes.parts(), start, n, async |p, from, want| {
            self.readers[p].scan(&self.ep, from, want).await
        })
        .await
    }
}
