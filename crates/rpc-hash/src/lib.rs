//! # dmkv-rpc-hash: the memory node does everything (Outback's RPC-Cluster)
//!
//! The baseline Outback (VLDB'24, §3 and §5.1) argues against: a chained hash
//! table with associativity and 14-bit fingerprints (Cluster hashing, from
//! DrTM+H) that lives on the memory node and is driven by RPC. A client
//! sends the key (and value); the memory node hashes it, probes the main
//! bucket's slots by fingerprint, compares keys in the KV blocks, follows the
//! chain of indirect buckets, and replies. One round trip per operation, and
//! all index work on the memory node's CPU, which is what the benchmark's
//! `memnode_cpu_ns` shows.
//!
//! - [`table`]: the table itself (layout, probing, chaining, allocation);
//! - [`proto`]: the request and reply encoding (bounds-checked; the handler
//!   trusts nothing a client sends);
//! - this file: the engine spec, the service and the client.
//!
//! With `--memnodes K` keys are sharded over K tables by a multiplicative
//! hash of the key; the memory node still does all of the table's work.

#![forbid(unsafe_code)]

pub mod proto;
pub mod table;

use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvClient, KvError, KvStore,
    Result, ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, RpcContext, Service, ServiceError, ServiceId};
use proto::{Reply, Request};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use table::{ClusterTable, MAX_VALUE_LEN, PutMode, TableConfig, TableError};

/// The engine spec; register it as `rpc-hash`.
pub struct RpcHashSpec;

/// The spec of `rpc-hash`.
pub static SPEC: RpcHashSpec = RpcHashSpec;

const NAME: &str = "rpc-hash";

const KNOBS: &[KnobSpec] = &[KnobSpec {
    name: "buckets",
    default: "0",
    help: "main buckets per memory node (a power of two up to 2^32; 0 = sized for the expected keys at ~75% slot occupancy)",
}];

/// Keys are stored whole in KV blocks and empty slots are the zero word, so
/// no key is reserved.
pub const CAPS: Capabilities = Capabilities {
    scan: false,
    max_value_len: MAX_VALUE_LEN,
    reserved_keys: &[],
    reserved_why: "rpc-hash reserves no keys",
};

fn config_for(args: &ServeArgs) -> Result<TableConfig> {
    let shards = args.nodes.len().max(1) as u64;
    let mut cfg = TableConfig::for_keys(
        args.expected_keys.div_ceil(shards),
        u64::from(args.value_size),
    );
    let buckets: u64 = args.knobs.get_in(NAME, KNOBS, "buckets", 0..=1 << 32)?;
    if buckets != 0 {
        if !buckets.is_power_of_two() {
            return Err(KvError::Config(format!(
                "{NAME}.buckets={buckets} is not a power of two"
            )));
        }
        cfg.main_buckets = buckets;
        // Fewer main buckets than the sizing chose put more keys in chains:
        // the indirect buckets must then hold them, with the headroom the
        // sized table has (main and indirect slots at least twice the
        // expected keys), or a table given few buckets fills up before its
        // expected keys are in.
        let keys = args.expected_keys.div_ceil(shards);
        let slots = (keys * 2).div_ceil(table::SLOTS_PER_BUCKET);
        cfg.indirect_buckets = cfg
            .indirect_buckets
            .max(buckets / 2 + 64)
            .max(slots.saturating_sub(buckets) + 64);
    }
    Ok(cfg)
}

/// The memory node's service: every request decoded and answered into the
/// handler thread's reply buffer (`Service::handle_into`; a GET's reply is
/// built in place there, so a GET allocates nothing on the node).
struct Op(Arc<ClusterTable>);

impl Service for Op {
    fn handle(&self, ctx: &RpcContext, req: &[u8]) -> std::result::Result<Vec<u8>, ServiceError> {
        let mut out = Vec::new();
        self.handle_into(ctx, req, &mut out)?;
        Ok(out)
    }

    fn handle_into(
        &self,
        _: &RpcContext,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> std::result::Result<(), ServiceError> {
        handle(&self.0, req, out)
    }
}

fn handle(
    t: &ClusterTable,
    req: &[u8],
    out: &mut Vec<u8>,
) -> std::result::Result<(), ServiceError> {
    let reply = match Request::decode(req)? {
        Request::Get { key } => {
            // The handler's own part of a GET (decoding, the reply's
            // encoding), declared to `sim`'s instruction term: 43 + 131 + 35
            // instructions (`handle_into`, `Request::decode`,
            // `encode_get_into`; table::cost says how they were counted).
            dmkv_transport::sim::work(209);
            proto::encode_get_into(out, |out| t.get_into(key, out));
            return Ok(());
        }
        Request::Put { mode, key, value } => Reply::Existed({
            // The handler's own part of a write (decoding with its value,
            // the reply's encoding, freeing it): on ycsb-a per update,
            // `Request::decode` 265, `Reply::encode` 106, frees 22, the
            // entry's own 60 (table::cost says how they were counted).
            dmkv_transport::sim::work(453);
            t.put(key, value, mode)
                .map_err(|TableError::Exhausted(m)| ServiceError::exhausted(m))?
        }),
        Request::Delete { key } => Reply::Existed({
            // Measured apart (branch i55, table::cost::DELETE says how):
            // `handle_into` 734.6 per delete less `delete` 411.5.
            dmkv_transport::sim::work(323);
            t.delete(key)
        }),
        Request::Load { pairs } => {
            for (k, v) in pairs {
                t.put(k, v, PutMode::Upsert)
                    .map_err(|TableError::Exhausted(m)| ServiceError::exhausted(m))?;
            }
            Reply::Done
        }
        Request::Stats => {
            let c = &t.counters;
            let (chain_mean, chain_max) = t.chain_lengths();
            Reply::Stats(proto::TableStats {
                keys: c.keys.load(Ordering::Relaxed),
                main_buckets: t.main_buckets(),
                slots: t.slots(),
                lookups: c.lookups.load(Ordering::Relaxed),
                buckets_visited: c.buckets_visited.load(Ordering::Relaxed),
                slots_probed: c.slots_probed.load(Ordering::Relaxed),
                keys_compared: c.keys_compared.load(Ordering::Relaxed),
                chain_mean,
                chain_max,
            })
        }
    };
    // Into the buffer, not `*out = reply.encode()`: that would replace the
    // handler thread's reply buffer with a one-byte `Vec` after every write,
    // and the next GET would regrow it (docs/rpc-hash.md, invariant 6).
    out.clear();
    reply.encode_into(out);
    Ok(())
}

impl EngineSpec for RpcHashSpec {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        NAME
    }
    fn about(&self) -> &'static str {
        "Outback's RPC-Cluster baseline: chained hash table with 14-bit fingerprints on the memory node, one RPC per operation"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        KNOBS
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        let cfg = config_for(args)?;
        let buckets =
            rt.register_region(&args.name("buckets"), cfg.bucket_region_bytes() as usize)?;
        let kv = rt.register_region(&args.name("kv"), cfg.kv_region_bytes() as usize)?;
        let table = Arc::new(ClusterTable::new(&buckets, &kv, cfg));
        rt.register_service(&args.name("op"), Arc::new(Op(table)))
            .map_err(|e| KvError::Config(e.to_string()))?;
        Ok(())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let ep = args.fabric.endpoint(args.compute_node)?;
        let mut shards = Vec::new();
        for node in args.serve.node_ids() {
            let svc = block_on(ep.lookup_service(node, &args.serve.name("op")))?;
            shards.push((node, svc));
        }
        if shards.is_empty() {
            return Err(KvError::Config(format!("{NAME} needs a memory node")));
        }
        Ok(Arc::new(RpcHashEngine {
            shards: Arc::new(shards),
            compute: args.compute_node,
        }))
    }
}

/// The memory node (and its service) holding `key`.
fn shard_of(shards: &[(NodeId, ServiceId)], key: Key) -> (NodeId, ServiceId) {
    // Fibonacci hashing of the key: a multiply and a shift, only to pick the
    // node; the table's hashing and probing happen there.
    let i = ((key.wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32) % shards.len() as u64) as usize;
    shards[i]
}

struct RpcHashEngine {
    shards: Arc<Vec<(NodeId, ServiceId)>>,
    compute: NodeId,
}

async fn call(ep: &Endpoint, to: (NodeId, ServiceId), req: Request<'_>) -> Result<Reply> {
    let bytes = ep
        .call(to.0, to.1, req.encode_into(ep.request_buffer(0)))
        .await?;
    let reply = Reply::decode(&bytes, &req).map_err(dmkv_transport::TransportError::from);
    // Decoded (owned): the buffer goes back to the endpoint, to take the
    // next request or reply without an allocation (branch i83).
    ep.recycle(bytes);
    Ok(reply?)
}

#[async_trait(?Send)]
impl Engine for RpcHashEngine {
    fn name(&self) -> &'static str {
        NAME
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(RpcHashClient {
            ep,
            shards: self.shards.clone(),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        for &shard in self.shards.iter() {
            let mine: Vec<(Key, &[u8])> = pairs
                .iter()
                .filter(|(k, _)| shard_of(&self.shards, *k) == shard)
                .map(|(k, v)| (*k, v.as_slice()))
                .collect();
            for chunk in mine.chunks(512) {
                call(
                    ep,
                    shard,
                    Request::Load {
                        pairs: chunk.to_vec(),
                    },
                )
                .await?;
            }
        }
        Ok(())
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        let mut all = proto::TableStats::default();
        for &shard in self.shards.iter() {
            match call(ep, shard, Request::Stats).await? {
                Reply::Stats(s) => all.merge(&s),
                _ => return Err(KvError::Corrupt("stats reply of the wrong kind".into())),
            }
        }
        let per = |n: u64| {
            if all.lookups == 0 {
                0.0
            } else {
                n as f64 / all.lookups as f64
            }
        };
        Ok(serde_json::json!({
            "keys": all.keys,
            "main_buckets": all.main_buckets,
            "load_factor": if all.slots == 0 { 0.0 } else { all.keys as f64 / all.slots as f64 },
            "load_factor_main": all.keys as f64 / (all.main_buckets * table::SLOTS_PER_BUCKET) as f64,
            "chain_len_mean": all.chain_mean,
            "chain_len_max": all.chain_max,
            "lookups": all.lookups,
            "buckets_per_lookup": per(all.buckets_visited),
            "slots_probed_per_lookup": per(all.slots_probed),
            "keys_compared_per_lookup": per(all.keys_compared),
        }))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}

struct RpcHashClient {
    ep: Rc<Endpoint>,
    shards: Arc<Vec<(NodeId, ServiceId)>>,
}

impl RpcHashClient {
    async fn put(&self, mode: PutMode, key: Key, value: &[u8]) -> Result<bool> {
        let to = shard_of(&self.shards, key);
        match call(&self.ep, to, Request::Put { mode, key, value }).await? {
            Reply::Existed(e) => Ok(e),
            _ => Err(KvError::Corrupt("put reply of the wrong kind".into())),
        }
    }
}

impl KvClient for RpcHashClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        // The value is handed over in the reply's own buffer, not copied.
        let (node, svc) = shard_of(&self.shards, key);
        let bytes = self
            .ep
            .call(
                node,
                svc,
                Request::Get { key }.encode_into(self.ep.request_buffer(9)),
            )
            .await?;
        Ok(proto::decode_get(bytes).map_err(dmkv_transport::TransportError::from)?)
    }
    /// A GET's value is its reply's buffer: it goes back to the endpoint
    /// (the trait's `recycle`), whose next request or reply then reuses
    /// the allocation; the harness hands values there directly.
    #[inline]
    fn recycles_to(&self) -> Option<&Endpoint> {
        Some(&self.ep)
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        Ok(!self.put(PutMode::Insert, key, value).await?)
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.put(PutMode::Update, key, value).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        Ok(!self.put(PutMode::Upsert, key, value).await?)
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        match call(
            &self.ep,
            shard_of(&self.shards, key),
            Request::Delete { key },
        )
        .await?
        {
            Reply::Existed(e) => Ok(e),
            _ => Err(KvError::Corrupt("delete reply of the wrong kind".into())),
        }
    }
    async fn scan(&self, _start: Key, _n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        Err(KvError::Unsupported {
            engine: NAME,
            what: "ordered scans",
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::local::{LocalCluster, LocalConfig};

    /// Slots of main and indirect buckets: at least twice the expected keys
    /// whatever main bucket count is set (a table given `buckets=1` once
    /// had 576 indirect buckets for 4,096 keys and failed the load).
    #[test]
    fn a_table_given_few_buckets_still_holds_its_expected_keys_twice() {
        for (keys, shards, buckets) in [(4096, 1, 1), (4096, 3, 4), (100_000, 2, 64), (256, 1, 1)] {
            let mut knobs = dmkv_api::Knobs::new();
            knobs.set("buckets", &buckets.to_string());
            let args = ServeArgs {
                instance: NAME.into(),
                knobs,
                node_index: 0,
                nodes: (0..shards).collect(),
                expected_keys: keys,
                value_size: 8,
                cache_mb: 0,
                data_dir: None,
            };
            let cfg = config_for(&args).unwrap();
            assert_eq!(cfg.main_buckets, buckets);
            let slots = (cfg.main_buckets + cfg.indirect_buckets) * table::SLOTS_PER_BUCKET;
            let per_shard = keys.div_ceil(u64::from(shards));
            assert!(
                slots >= 2 * per_shard,
                "{keys} keys, {shards} shards, {buckets} buckets: {slots} slots"
            );
        }
    }

    /// A handler thread's reply buffer keeps its allocation across write
    /// replies (docs/rpc-hash.md, invariant 6): `*out = reply.encode()`
    /// replaced it with a one-byte `Vec`, which the next GET regrew.
    #[test]
    fn write_replies_keep_the_reply_buffer() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = TableConfig {
            main_buckets: 4,
            indirect_buckets: 16,
            kv_bytes: 1 << 16,
        };
        let b = rt
            .register_region("b", cfg.bucket_region_bytes() as usize)
            .unwrap();
        let kv = rt
            .register_region("kv", cfg.kv_region_bytes() as usize)
            .unwrap();
        let t = ClusterTable::new(&b, &kv, cfg);
        let mut out: Vec<u8> = Vec::with_capacity(256);
        let at = out.as_ptr();
        let requests = [
            proto::Request::Put {
                mode: PutMode::Insert,
                key: 5,
                value: b"hello",
            },
            proto::Request::Get { key: 5 },
            proto::Request::Put {
                mode: PutMode::Update,
                key: 5,
                value: b"world!",
            },
            proto::Request::Delete { key: 5 },
            proto::Request::Get { key: 5 },
            proto::Request::Delete { key: 5 },
        ];
        let expect: [&[u8]; 6] = [
            &[0],
            &[b'h', b'e', b'l', b'l', b'o', 5, 0, 0, 0, 1],
            &[1],
            &[1],
            &[0],
            &[0],
        ];
        for (req, want) in requests.iter().zip(expect) {
            out.clear();
            handle(&t, &req.encode(), &mut out).unwrap();
            assert_eq!(out, want, "{req:?}");
            assert_eq!(out.as_ptr(), at, "{req:?} replaced the reply buffer");
            assert!(out.capacity() >= 256, "{req:?}");
        }
    }
}
