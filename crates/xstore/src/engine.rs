//! `xstore` as an engine: the spec, connecting, loading, stats.

use crate::cache::PartClient;
use crate::client::{Client, Shared};
use crate::config::{CacheMode, KNOBS, XStoreConfig};
use crate::layout::{HEADER_BYTES, RECORD_BYTES};
use crate::stats::ClientStats;
use crate::wire::*;
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvError, KvStore, Result,
    ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, OpKind, WireWriter, labeled};
use dmkv_xtree::MAX_VALUE_LEN;
use dmkv_xtree::layout::{SUPERBLOCK_FORMAT_OFFSET, parse_format_word};
use serde_json::json;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, Ordering};

/// What XStore accepts: every key (XTree reserves none) and values up to
/// XTree's limit.
pub const CAPS: Capabilities = Capabilities {
    scan: true,
    max_value_len: MAX_VALUE_LEN,
    reserved_keys: &[],
    reserved_why: "",
};

/// The spec of `xstore`.
pub struct XStoreSpec;

/// Registered as `xstore` for `dmkv bench`.
pub static SPEC: XStoreSpec = XStoreSpec;

/// Largest LOAD request payload.
const LOAD_BYTES: usize = 256 * 1024;

impl EngineSpec for XStoreSpec {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        "xstore"
    }
    fn about(&self) -> &'static str {
        "XStore (OSDI'20): clients cache a learned model and translation table and read XTree leaves one-sided; writes by RPC, retraining on the memory node"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        KNOBS
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        crate::server::serve(rt, args).map(|_| ())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let cfg = XStoreConfig::from_args(&args.serve)?;
        let ep = args.fabric.endpoint(args.compute_node)?;
        // Another compute process of a simulated cluster counts into
        // compute node 0's counters (only those; its cache is its own).
        let stats = match args.counting_into::<XStore>() {
            Some(first) => first.shared.stats.clone(),
            None => Arc::new(ClientStats::default()),
        };
        let bytes = Arc::new(AtomicI64::new(0));
        let mut parts = Vec::new();
        for (i, node) in args.serve.node_ids().into_iter().enumerate() {
            let p = block_on(labeled(
                OpKind::Setup,
                connect_part(
                    &ep,
                    &args.serve,
                    &cfg,
                    i,
                    node,
                    bytes.clone(),
                    stats.clone(),
                ),
            ))?;
            parts.push(p);
        }
        Ok(Arc::new(XStore {
            shared: Arc::new(Shared {
                // xstore.get_read: `keys` (default) reads the key lines of
                // each predicted leaf (200 bytes for N = 16) and then the
                // value's slot line, the paper's two READs (§5.2.1, Fig.
                // 12b); `leaves` reads whole leaves (320 bytes), so an
                // inline value arrives with its key in one round trip.
                whole_leaves: cfg.get_read == crate::config::GetRead::Leaves,
                cfg,
                parts,
                stats,
            }),
            cache_bytes: bytes,
            compute: args.compute_node,
        }))
    }
}

async fn connect_part(
    ep: &Endpoint,
    serve: &ServeArgs,
    cfg: &XStoreConfig,
    i: usize,
    node: NodeId,
    bytes: Arc<AtomicI64>,
    stats: Arc<ClientStats>,
) -> Result<PartClient> {
    let service = ep.lookup_service(node, &serve.name(SERVICE)).await?;
    let nodes = ep.lookup_region(node, &serve.name(NODE_REGION)).await?;
    let values = ep.lookup_region(node, &serve.name(VALUE_REGION)).await?;
    let models = ep.lookup_region(node, &serve.name(MODEL_REGION)).await?;
    let w = ep.read(nodes.at(SUPERBLOCK_FORMAT_OFFSET), 8).await?;
    let geo = parse_format_word(u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .ok_or_else(|| KvError::Corrupt(format!("node {node} holds no XTree")))?;
    Ok(PartClient::new(
        i,
        node,
        service,
        cfg.parts.range(i),
        nodes,
        values,
        models,
        geo,
        cfg.cache,
        bytes,
        stats,
    ))
}

struct XStore {
    shared: Arc<Shared>,
    cache_bytes: Arc<AtomicI64>,
    compute: NodeId,
}

impl XStore {
    async fn call_all(&self, ep: &Endpoint, op: u8) -> Result<Vec<Vec<u8>>> {
        let mut out = Vec::new();
        for p in &self.shared.parts {
            out.push(ep.call(p.node, p.service, vec![op]).await?);
        }
        Ok(out)
    }
}

#[async_trait(?Send)]
impl Engine for XStore {
    fn name(&self) -> &'static str {
        "xstore"
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }

    /// Waits until each memory node's model covers what was loaded, then
    /// fills this process's cache ("the client can fill XCACHE from
    /// scratch", §5.1) as the cache mode allows.
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        self.call_all(&ep, OP_PREPARE).await?;
        for p in &self.shared.parts {
            let complete = p.cached_gen().is_some_and(|g| {
                p.mode == CacheMode::TopOnly || g.subs.iter().all(|s| s.read().is_some())
            });
            if !complete {
                p.prefetch(&ep, 64).await?;
            }
        }
        Ok(Rc::new(Client::new(ep, self.shared.clone())))
    }

    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let mut by_part: Vec<Vec<&(Key, Vec<u8>)>> = vec![Vec::new(); self.shared.parts.len()];
        for kv in pairs {
            if kv.1.len() > MAX_VALUE_LEN {
                return Err(KvError::ValueTooLarge {
                    len: kv.1.len(),
                    max: MAX_VALUE_LEN,
                    engine: "xstore",
                });
            }
            by_part[self.shared.cfg.parts.of(kv.0)].push(kv);
        }
        for (p, kvs) in self.shared.parts.iter().zip(by_part) {
            let mut i = 0;
            while i < kvs.len() {
                let mut body = WireWriter::new();
                let mut n = 0u32;
                while i < kvs.len() && (n == 0 || body.len() + 12 + kvs[i].1.len() <= LOAD_BYTES) {
                    body.u64(kvs[i].0).bytes(&kvs[i].1);
                    n += 1;
                    i += 1;
                }
                let mut w = WireWriter::with_capacity(body.len() + 5);
                w.u8(OP_LOAD).u32(n).raw(&body.finish());
                ep.call(p.node, p.service, w.finish()).await?;
            }
        }
        Ok(())
    }

    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let mut parts = Vec::new();
        for reply in self.call_all(ep, OP_STATS).await? {
            let text = std::str::from_utf8(&reply)
                .map_err(|e| KvError::Corrupt(format!("stats reply: {e}")))?;
            parts.push(
                serde_json::from_str::<serde_json::Value>(text)
                    .map_err(|e| KvError::Corrupt(format!("stats reply: {e}")))?,
            );
        }
        let sum = |f: &str| -> u64 { parts.iter().map(|p| p[f].as_u64().unwrap_or(0)).sum() };
        let (mut header, mut records, mut tt) = (0u64, 0u64, 0u64);
        for p in &self.shared.parts {
            if let Some(g) = p.cached_gen() {
                header += HEADER_BYTES as u64;
                for s in g.subs.iter().filter_map(|s| s.read().clone()) {
                    records += RECORD_BYTES as u64;
                    tt += 8 * s.tt.len() as u64;
                }
            }
        }
        let keys = sum("keys");
        let weighted_err: f64 = parts
            .iter()
            .map(|p| {
                p["prediction_error"]["mean_abs_slots"]
                    .as_f64()
                    .unwrap_or(0.0)
                    * p["keys"].as_f64().unwrap_or(0.0)
            })
            .sum();
        let retrains = sum("retrains");
        Ok(json!({
            "cache": self.shared.cfg.cache.name(),
            "get_read": if self.shared.whole_leaves { "leaves" } else { "keys" },
            "memnodes": self.shared.parts.len(),
            "submodels": sum("submodels"),
            "sizing": parts.iter().map(|p| p["sizing"].clone()).collect::<Vec<_>>(),
            "tt_entries": sum("tt_entries"),
            "prediction_error_slots": if keys == 0 { 0.0 } else { weighted_err / keys as f64 },
            "retrains": retrains,
            "retrain_cpu_ns": sum("retrain_cpu_ns"),
            "retrain_us_avg": if retrains == 0 { 0.0 } else { sum("retrain_cpu_ns") as f64 / retrains as f64 / 1000.0 },
            "full_trainings": sum("full_trainings"),
            "expansions": sum("expansions"),
            "shrinks": sum("shrinks"),
            "client": self.shared.stats.json(),
            "client_cache_bytes": {
                "total": self.client_cache_bytes(),
                "top_and_headers": header,
                "sub_model_records": records,
                "translation_tables": tt,
            },
            "partitions": parts,
        }))
    }

    fn client_cache_bytes(&self) -> u64 {
        self.cache_bytes.load(Ordering::Relaxed).max(0) as u64
    }

    fn client_counters(&self) -> Vec<(&'static str, u64)> {
        self.shared.stats.counters()
    }

    async fn settle(&self, ep: &Endpoint) -> Result<()> {
        self.call_all(ep, OP_SETTLE).await?;
        Ok(())
    }
}

/// Reads a stats reply for tests.
pub fn parse_stats(reply: &[u8]) -> Option<serde_json::Value> {
    serde_json::from_slice(reply).ok()
}
