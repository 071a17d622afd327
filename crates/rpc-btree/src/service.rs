//! The memory node's side: an XTree and the RPC service that runs every
//! operation on it. `cell` installs exactly this and sends its writes here.

use crate::wire::*;
use dmkv_api::{KnobSpec, KvError, RangePartitions, Result, ServeArgs};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::{RpcContext, Service, ServiceError, WireReader, WireWriter};
use dmkv_xtree::{LeafRef, MAX_VALUE_LEN, XTree, XTreeConfig};
use std::sync::Arc;

/// Knobs every engine built on this service has.
pub const KNOB_SLOTS: KnobSpec = KnobSpec {
    name: "slots",
    default: "16",
    help: "N, key slots per XTree node (4..=48; the paper uses 16)",
};
pub const KNOB_NODES: KnobSpec = KnobSpec {
    name: "nodes",
    default: "0",
    help: "nodes the node region holds, up to 2^32 (0: sized from the expected key count)",
};
pub const KNOB_BOUNDS: KnobSpec = KnobSpec {
    name: "bounds",
    default: "",
    help: "range partitioning over --memnodes K: K-1 ascending split keys, comma-separated (empty: equal key ranges; dmkv bench sets the loaded keys' quantiles)",
};
pub const KNOB_VALUE_BYTES: KnobSpec = KnobSpec {
    name: "value_bytes",
    default: "0",
    help: "bytes of the out-of-line value region, up to 2^40 (0: sized from the expected keys and value size)",
};

/// The tree's sizes from `args` and the knobs above.
pub fn tree_config(engine: &str, specs: &[KnobSpec], args: &ServeArgs) -> Result<XTreeConfig> {
    let k = &args.knobs;
    let slots: usize = k.get(engine, specs, KNOB_SLOTS.name)?;
    let mut cfg = XTreeConfig::sized_for(args.expected_keys, args.value_size, slots)
        .map_err(|e| KvError::Config(format!("{engine}.slots: {e}")))?;
    let nodes: u64 = k.get_in(engine, specs, KNOB_NODES.name, 0..=1 << 32)?;
    if nodes > 0 {
        cfg.max_nodes = nodes;
    }
    let value_bytes: u64 = k.get_in(engine, specs, KNOB_VALUE_BYTES.name, 0..=1 << 40)?;
    if value_bytes > 0 {
        cfg.value_region_bytes = value_bytes;
    }
    Ok(cfg)
}

/// The key ranges of the instance's memory nodes (the `bounds` knob):
/// memory node `args.nodes[p]` holds range `p`.
pub fn partitions(engine: &str, specs: &[KnobSpec], args: &ServeArgs) -> Result<RangePartitions> {
    let bounds: String = args.knobs.get(engine, specs, KNOB_BOUNDS.name)?;
    RangePartitions::parse(engine, &bounds, args.nodes.len())
}

/// Builds this memory node's tree, the one of its key range (every memory
/// node of the instance holds one range, [`partitions`]), and registers its
/// service. Each tree is sized for all the expected keys, not its share:
/// the split keys need not divide them evenly, and regions are reserved
/// untouched.
pub fn serve_tree(
    rt: &Arc<NodeRuntime>,
    args: &ServeArgs,
    engine: &str,
    specs: &[KnobSpec],
) -> Result<Arc<XTree>> {
    partitions(engine, specs, args)?;
    let cfg = tree_config(engine, specs, args)?;
    let tree = XTree::create(rt, &args.name(NODE_REGION), &args.name(VALUE_REGION), cfg)
        .map_err(|e| KvError::Config(e.to_string()))?;
    let t = tree.clone();
    rt.register_service(&args.name(SERVICE), Arc::new(Op(t)))
        .map_err(|e| KvError::Config(e.to_string()))?;
    Ok(tree)
}

fn value<'a>(r: &mut WireReader<'a>) -> std::result::Result<&'a [u8], ServiceError> {
    let v = r.bytes()?;
    if v.len() > MAX_VALUE_LEN {
        return Err(ServiceError::malformed(format!(
            "value of {} bytes exceeds {MAX_VALUE_LEN}",
            v.len()
        )));
    }
    Ok(v)
}

/// The node's service: a GET's reply is encoded straight into the handler
/// thread's reply buffer (`Service::handle_into`, docs/transport.md "Reply
/// buffers"), byte for byte what [`handle`] encodes; every other request
/// goes through [`handle`].
struct Op(Arc<XTree>);

impl Service for Op {
    fn handle(&self, _: &RpcContext, req: &[u8]) -> std::result::Result<Vec<u8>, ServiceError> {
        handle(&self.0, req)
    }

    fn handle_into(
        &self,
        _: &RpcContext,
        req: &[u8],
        out: &mut Vec<u8>,
    ) -> std::result::Result<(), ServiceError> {
        if req.first() != Some(&GET) {
            // Encoded into the thread's buffer (which keeps its capacity
            // for the next request: a replaced buffer made the GET after
            // every write grow a fresh one again, ~107 instructions per GET
            // on ycsb-a), not into a reply of its own that is then copied
            // there and freed.
            let mut w = WireWriter::append_to(std::mem::take(out), 0);
            let served = serve(&self.0, req, &mut w);
            *out = w.finish();
            return served;
        }
        // The handler's own part of a GET (decoding; the reply's encoding
        // now runs inside `get_with`, which declares it), declared to
        // `sim`'s instruction term: `handle_into` 1,645.2 instructions per
        // GET less `XTree::get_with`'s 1,506.2 (callgrind, `local`, branch
        // i53's binary b72b7b2, `scripts/instructions-per-op.sh rpc-btree`,
        // ycsb-c, 50,000 keys; docs/simulation.md, "A lean xtree (branch
        // i53)"; was 208: main's a1dce1e, 2,863.4 less `get`'s 2,655.3).
        dmkv_transport::sim::work(139);
        let mut r = WireReader::new(req);
        r.u8()?;
        let key = r.u64()?;
        r.end()?;
        // `bool(true).bytes(v)` or `bool(false)`, as `handle` writes them.
        // The value goes from the leaf (or its block) straight into the
        // reply, without a copy of its own.
        let found = self.0.get_with(key, |v| {
            let len = u32::try_from(v.len()).expect("values are below MAX_VALUE_LEN");
            out.push(1);
            out.extend_from_slice(&len.to_le_bytes());
            out.extend_from_slice(v);
        })?;
        if found.is_none() {
            out.push(0);
        }
        Ok(())
    }
}

/// Serves one request. Nothing in it is trusted: every field is parsed with
/// bounds checks, lengths are limited, trailing bytes are refused, and node
/// numbers in hints are checked by the tree.
pub fn handle(tree: &XTree, req: &[u8]) -> std::result::Result<Vec<u8>, ServiceError> {
    let mut w = WireWriter::new();
    serve(tree, req, &mut w)?;
    Ok(w.finish())
}

/// [`handle`], the reply appended to `w` (after an error, what `w` holds
/// is not a reply).
fn serve(tree: &XTree, req: &[u8], w: &mut WireWriter) -> std::result::Result<(), ServiceError> {
    let mut r = WireReader::new(req);
    let op = r.u8()?;
    match op {
        GET => {
            let key = r.u64()?;
            r.end()?;
            match tree.get(key)? {
                Some(v) => w.bool(true).bytes(&v),
                None => w.bool(false),
            };
        }
        INSERT | UPDATE | UPSERT => {
            // The handler's own part of a write (decoding with its value,
            // the reply and its copy into the thread's buffer, freeing
            // them), declared to `sim`'s instruction term: on ycsb-a
            // `handle_into` 1,862.3 per operation, i.e. 3,724.6 per GET and
            // update, less a GET's 1,650.2 (ycsb-c's 1,645.2 and 5.0 more
            // in `get_with`) and `XTree::update`'s 1,633.2: 441 (callgrind,
            // as for the GET above, `... rpc-btree ycsb-a`, branch i53's
            // 22743c3; was 387 on a1dce1e: `handle` 3,998 less `update`
            // 3,661, plus ~50 of `handle_into`'s own).
            dmkv_transport::sim::work(441);
            let key = r.u64()?;
            let v = value(&mut r)?;
            r.end()?;
            let res = match op {
                INSERT => tree.insert(key, v)?,
                UPDATE => tree.update(key, v)?,
                _ => tree.upsert(key, v)?,
            };
            w.bool(res);
        }
        DELETE => {
            // As a write above (not measured apart).
            dmkv_transport::sim::work(441);
            let key = r.u64()?;
            r.end()?;
            w.bool(tree.delete(key)?);
        }
        SCAN => {
            let start = r.u64()?;
            let n = r.u32()? as usize;
            r.end()?;
            // `more`: pairs were left out for size, so the client continues.
            let limit = n.min(SCAN_MAX_PAIRS);
            let pairs = tree.scan(start, limit)?;
            let mut body = WireWriter::new();
            let mut taken = 0u32;
            for (k, v) in &pairs {
                if taken > 0 && body.len() + 12 + v.len() > SCAN_REPLY_BYTES {
                    break;
                }
                body.u64(*k).bytes(v);
                taken += 1;
            }
            let more = (taken as usize) < pairs.len() || (pairs.len() == limit && limit < n);
            w.bool(more).u32(taken).raw(&body.finish());
        }
        LOAD => {
            let n = r.count(12)?;
            let mut pairs = Vec::with_capacity(n);
            for _ in 0..n {
                let k = r.u64()?;
                pairs.push((k, value(&mut r)?));
            }
            r.end()?;
            tree.bulk_load(&pairs)?;
        }
        STATS => {
            r.end()?;
            w.raw(&encode_stats(&tree.stats()));
        }
        UPDATE_HINTED => {
            let key = r.u64()?;
            let hint = LeafRef {
                node: r.u32()?,
                incarnation: r.u32()?,
            };
            let v = value(&mut r)?;
            r.end()?;
            let res = tree.update_hinted(key, v, hint)?;
            w.bool(res.updated).bool(res.hint_used);
        }
        FIND_LEAF => {
            let key = r.u64()?;
            r.end()?;
            let leaf = tree.find_leaf(key)?;
            w.u32(leaf.node).u32(leaf.incarnation);
        }
        op => return Err(ServiceError::malformed(format!("unknown tree op {op}"))),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::NodeId;
    use dmkv_transport::local::{LocalCluster, LocalConfig};

    /// A GET answered into the thread's buffer is byte for byte the reply
    /// `handle` encodes (hits of every value length up to 300 bytes,
    /// misses), and bad GETs are refused alike; other ops are encoded into
    /// the buffer (`serve`) as `handle` encodes them.
    #[test]
    fn gets_into_the_buffer_answer_as_handle_does() {
        let c = LocalCluster::new(LocalConfig::default());
        let rt = NodeRuntime::new(c.add_node(1));
        let cfg = XTreeConfig::sized_for(1_000, 8, 16).unwrap();
        let t = XTree::create(&rt, "t/nodes", "t/values", cfg).unwrap();
        for k in 0..300u64 {
            let v: Vec<u8> = (0..k as usize).map(|i| (i as u64 ^ k) as u8).collect();
            t.insert(k * 2, &v).unwrap();
        }
        let op = Op(t.clone());
        let ctx = RpcContext {
            caller: NodeId(0),
            node: NodeId(1),
        };
        let mut out = Vec::new();
        for k in 0..620u64 {
            let mut w = WireWriter::new();
            w.u8(GET).u64(k);
            let req = w.finish();
            out.clear();
            op.handle_into(&ctx, &req, &mut out).unwrap();
            assert_eq!(out, handle(&t, &req).unwrap(), "key {k}");
        }
        for bad in [
            vec![GET],
            vec![GET, 1, 2],
            vec![GET, 0, 0, 0, 0, 0, 0, 0, 0, 9],
        ] {
            out.clear();
            let into = op.handle_into(&ctx, &bad, &mut out).unwrap_err();
            assert_eq!(into, handle(&t, &bad).unwrap_err(), "{bad:?}");
        }
        let mut w = WireWriter::new();
        w.u8(DELETE).u64(4);
        out.clear();
        op.handle_into(&ctx, &w.finish(), &mut out).unwrap();
        assert_eq!(out, [1], "DELETE of a stored key");
        // Every other request is encoded into the buffer as `handle`
        // encodes it (read-only ones compared directly), in the buffer's
        // own allocation once it has room.
        out.clear();
        out.reserve(4096);
        let kept = out.as_ptr();
        for k in [0u64, 7, 300, 599, 10_000] {
            let mut reqs = Vec::new();
            let mut w = WireWriter::new();
            w.u8(FIND_LEAF).u64(k);
            reqs.push(w.finish());
            let mut w = WireWriter::new();
            w.u8(SCAN).u64(k).u32(5);
            reqs.push(w.finish());
            let mut w = WireWriter::new();
            w.u8(STATS);
            reqs.push(w.finish());
            for req in &reqs {
                out.clear();
                op.handle_into(&ctx, req, &mut out).unwrap();
                assert_eq!(out, handle(&t, req).unwrap(), "{req:?}");
                assert_eq!(out.as_ptr(), kept, "the thread's buffer is kept");
            }
        }
        for (op_code, key, want) in [
            (UPDATE, 6u64, 1u8),
            (UPDATE, 7, 0),
            (UPSERT, 7, 1),
            (UPSERT, 7, 0),
            (INSERT, 7, 0),
            (INSERT, 9, 1),
        ] {
            let mut w = WireWriter::new();
            w.u8(op_code).u64(key).bytes(b"value");
            out.clear();
            op.handle_into(&ctx, &w.finish(), &mut out).unwrap();
            assert_eq!(out, [want], "op {op_code} of key {key}");
            assert_eq!(out.as_ptr(), kept, "the thread's buffer is kept");
        }
        let mut w = WireWriter::new();
        w.u8(99);
        out.clear();
        let into = op.handle_into(&ctx, &w.finish(), &mut out).unwrap_err();
        assert_eq!(into, handle(&t, &[99]).unwrap_err());
    }
}
