//! `reference`: the simplest correct engine, a `BTreeMap` on one memory node
//! behind one RPC service. It exists to test the harness and the test
//! suites themselves; it is not one of dmkv's designs.

use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvError, KvStore, Result,
    ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::exec::block_on;
use dmkv_transport::{
    Endpoint, NodeId, RpcContext, ServiceError, ServiceId, WireReader, WireWriter,
};
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;

const GET: u8 = 1;
const INSERT: u8 = 2;
const UPDATE: u8 = 3;
const UPSERT: u8 = 4;
const DELETE: u8 = 5;
const SCAN: u8 = 6;
const LOAD: u8 = 7;

/// The spec of the reference engine.
pub struct Reference;

pub const CAPS: Capabilities = Capabilities {
    scan: true,
    max_value_len: 1 << 16,
    reserved_keys: &[u64::MAX],
    reserved_why: "the reference engine reserves u64::MAX to test reserved-key handling",
};

fn handle(map: &Mutex<BTreeMap<u64, Vec<u8>>>, req: &[u8]) -> Result<Vec<u8>, ServiceError> {
    let mut r = WireReader::new(req);
    let op = r.u8()?;
    let mut w = WireWriter::new();
    let mut m = map.lock();
    match op {
        GET => {
            let k = r.u64()?;
            r.end()?;
            match m.get(&k) {
                Some(v) => w.bool(true).bytes(v),
                None => w.bool(false),
            };
        }
        INSERT | UPDATE | UPSERT => {
            let k = r.u64()?;
            let v = r.bytes()?.to_vec();
            r.end()?;
            let exists = m.contains_key(&k);
            let apply = match op {
                INSERT => !exists,
                UPDATE => exists,
                _ => true,
            };
            if apply {
                m.insert(k, v);
            }
            w.bool(if op == UPSERT { !exists } else { apply });
        }
        DELETE => {
            let k = r.u64()?;
            r.end()?;
            w.bool(m.remove(&k).is_some());
        }
        SCAN => {
            let start = r.u64()?;
            let n = r.u32()? as usize;
            r.end()?;
            let items: Vec<_> = m.range(start..).take(n).collect();
            w.u32(items.len() as u32);
            for (k, v) in items {
                w.u64(*k).bytes(v);
            }
        }
        LOAD => {
            let n = r.count(12)?;
            for _ in 0..n {
                let k = r.u64()?;
                let v = r.bytes()?.to_vec();
                m.insert(k, v);
            }
            r.end()?;
        }
        op => return Err(ServiceError::malformed(format!("unknown op {op}"))),
    }
    Ok(w.finish())
}

impl EngineSpec for Reference {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        "reference"
    }
    fn about(&self) -> &'static str {
        "a BTreeMap behind one RPC service (for testing the harness)"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        &[]
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        if args.node_index != 0 {
            return Ok(());
        }
        let map = Arc::new(Mutex::new(BTreeMap::new()));
        rt.register_service(
            &args.name("op"),
            Arc::new(move |_: &RpcContext, req: &[u8]| handle(&map, req)),
        )
        .map_err(|e| KvError::Config(e.to_string()))?;
        Ok(())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let node = NodeId(args.serve.nodes[0]);
        let ep = args.fabric.endpoint(args.compute_node)?;
        let service = block_on(ep.lookup_service(node, &args.serve.name("op")))?;
        Ok(Arc::new(ReferenceEngine {
            node,
            service,
            compute: args.compute_node,
        }))
    }
}

struct ReferenceEngine {
    node: NodeId,
    service: ServiceId,
    compute: NodeId,
}

#[async_trait(?Send)]
impl Engine for ReferenceEngine {
    fn name(&self) -> &'static str {
        "reference"
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(ReferenceClient {
            ep,
            node: self.node,
            service: self.service,
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        for chunk in pairs.chunks(1024) {
            let mut w = WireWriter::new();
            w.u8(LOAD).u32(chunk.len() as u32);
            for (k, v) in chunk {
                w.u64(*k).bytes(v);
            }
            ep.call(self.node, self.service, w.finish()).await?;
        }
        Ok(())
    }
    async fn stats(&self, _ep: &Endpoint) -> Result<serde_json::Value> {
        Ok(serde_json::json!({}))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}

struct ReferenceClient {
    ep: Rc<Endpoint>,
    node: NodeId,
    service: ServiceId,
}

impl ReferenceClient {
    async fn call(&self, w: WireWriter) -> Result<Vec<u8>> {
        Ok(self.ep.call(self.node, self.service, w.finish()).await?)
    }
    async fn write(&self, op: u8, key: Key, value: &[u8]) -> Result<bool> {
        let mut w = WireWriter::new();
        w.u8(op).u64(key).bytes(value);
        let reply = self.call(w).await?;
        Ok(WireReader::new(&reply)
            .bool()
            .map_err(dmkv_transport::TransportError::from)?)
    }
}

#[async_trait(?Send)]
impl KvStore for ReferenceClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let mut w = WireWriter::new();
        w.u8(GET).u64(key);
        let reply = self.call(w).await?;
        let mut r = WireReader::new(&reply);
        let mut parse = || -> std::result::Result<Option<Vec<u8>>, dmkv_transport::WireError> {
            Ok(if r.bool()? {
                Some(r.bytes()?.to_vec())
            } else {
                None
            })
        };
        Ok(parse().map_err(dmkv_transport::TransportError::from)?)
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.write(INSERT, key, value).await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.write(UPDATE, key, value).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.write(UPSERT, key, value).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        let mut w = WireWriter::new();
        w.u8(DELETE).u64(key);
        let reply = self.call(w).await?;
        Ok(WireReader::new(&reply)
            .bool()
            .map_err(dmkv_transport::TransportError::from)?)
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        let mut w = WireWriter::new();
        w.u8(SCAN).u64(start).u32(n.min(u32::MAX as usize) as u32);
        let reply = self.call(w).await?;
        let mut r = WireReader::new(&reply);
        let mut parse =
            || -> std::result::Result<Vec<(Key, Vec<u8>)>, dmkv_transport::WireError> {
                let n = r.count(12)?;
                (0..n)
                    .map(|_| Ok((r.u64()?, r.bytes()?.to_vec())))
                    .collect()
            };
        Ok(parse().map_err(dmkv_transport::TransportError::from)?)
    }
}
