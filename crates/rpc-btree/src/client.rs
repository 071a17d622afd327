//! The compute side of the tree service: one RPC per operation.

use crate::wire::*;
use dmkv_api::{Key, KvClient, RangePartitions, Result};
use dmkv_transport::{
    Endpoint, NodeId, RpcCall, ServiceId, TransportError, WireReader, WireWriter,
};
use dmkv_xtree::{HintedUpdate, LeafRef, TreeStats};
use std::rc::Rc;

/// Where the tree service is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TreeService {
    pub node: NodeId,
    pub service: ServiceId,
}

/// The tree services of an instance: one per memory node, memory node
/// `svcs[p]` holding key range `p` of `parts`.
#[derive(Debug, Clone)]
pub struct TreeServices {
    pub parts: RangePartitions,
    pub svcs: Vec<TreeService>,
}

/// Runs a scan of up to `n` pairs from `start` over range-partitioned
/// trees: `scan(p, from, want)` scans range `p`'s tree, and when a range
/// runs out before `n` pairs the scan goes on from the next range's
/// lowest key. Each tree holds only its range's keys, so the pairs come
/// out in key order.
pub async fn scan_partitions(
    parts: &RangePartitions,
    start: Key,
    n: usize,
    mut scan: impl AsyncFnMut(usize, Key, usize) -> Result<Vec<(Key, Vec<u8>)>>,
) -> Result<Vec<(Key, Vec<u8>)>> {
    let mut p = parts.of(start);
    let mut out = scan(p, start, n).await?;
    while out.len() < n && p + 1 < parts.count() {
        p += 1;
        let more = scan(p, parts.low(p), n - out.len()).await?;
        out.extend(more);
    }
    Ok(out)
}

/// A thread's client of a range-partitioned instance (rpc-btree's
/// `KvStore`): each operation goes to its key's range, one RPC to that
/// memory node; a scan goes on into the next ranges ([`scan_partitions`]).
pub struct PartitionedClient {
    ep: Rc<Endpoint>,
    parts: RangePartitions,
    clients: Vec<RpcTreeClient>,
}

impl PartitionedClient {
    pub fn new(ep: Rc<Endpoint>, services: &TreeServices) -> PartitionedClient {
        PartitionedClient {
            clients: services
                .svcs
                .iter()
                .map(|s| RpcTreeClient::new(ep.clone(), *s))
                .collect(),
            parts: services.parts.clone(),
            ep,
        }
    }

    /// The key ranges it routes by.
    pub fn parts(&self) -> &RangePartitions {
        &self.parts
    }

    /// The client of `key`'s range.
    #[inline]
    pub fn of(&self, key: Key) -> &RpcTreeClient {
        &self.clients[self.parts.of(key)]
    }
}

impl KvClient for PartitionedClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        self.of(key).get(key).await
    }
    /// Every range's client shares this endpoint (see
    /// [`RpcTreeClient::recycles_to`]).
    #[inline]
    fn recycles_to(&self) -> Option<&Endpoint> {
        Some(&*self.ep)
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.of(key).insert(key, value).await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.of(key).update(key, value).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.of(key).upsert(key, value).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        self.of(key).delete(key).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        scan_partitions(&self.parts, start, n, async |p, from, want| {
            self.clients[p].scan(from, want).await
        })
        .await
    }
}

/// A thread's RPC client of the tree service. It is a complete `KvStore`
/// (rpc-btree hands it out as is); `cell` uses it for writes.
pub struct RpcTreeClient {
    ep: Rc<Endpoint>,
    svc: TreeService,
}

fn parse<T>(
    reply: &[u8],
    f: impl FnOnce(&mut WireReader<'_>) -> std::result::Result<T, dmkv_transport::WireError>,
) -> Result<T> {
    let mut r = WireReader::new(reply);
    let v = f(&mut r).map_err(TransportError::from)?;
    r.end().map_err(TransportError::from)?;
    Ok(v)
}

/// Bytes before a found GET reply's value: the flag and the u32 length.
const GET_VALUE_AT: usize = 5;

/// A GET reply's checks as [`parse`] makes them (the flag, the value's
/// length, nothing after it): `Some(n)` when found with an `n`-byte value.
fn parse_get(reply: &[u8]) -> Result<Option<usize>> {
    parse(reply, |r| {
        Ok(if r.bool()? {
            Some(r.bytes()?.len())
        } else {
            None
        })
    })
}

/// The value of a found GET reply whose value has `n` bytes, in the
/// reply's own allocation: the value moved to its front (a copy of the
/// value within the buffer, no allocation), the rest cut off.
fn value_in_place(mut reply: Vec<u8>, n: usize) -> Vec<u8> {
    debug_assert_eq!(reply.len(), GET_VALUE_AT + n);
    reply.copy_within(GET_VALUE_AT.., 0);
    reply.truncate(n);
    reply
}

impl RpcTreeClient {
    pub fn new(ep: Rc<Endpoint>, svc: TreeService) -> RpcTreeClient {
        RpcTreeClient { ep, svc }
    }

    /// The tree service's RPC with `w`'s request: the endpoint's call
    /// future itself, not an `async fn` around it (whose own state machine
    /// cost a GET instructions, branch i87).
    fn call(&self, w: WireWriter) -> RpcCall<'_> {
        self.ep.call(self.svc.node, self.svc.service, w.finish())
    }

    /// INSERT, UPDATE or UPSERT: built in the endpoint's request buffer
    /// (on `local` the last small request's allocation, kept) with room
    /// for the whole request, and awaited on the endpoint's call future
    /// itself ([`Self::call`]), as xstore's writes are.
    async fn write(&self, op: u8, key: Key, value: &[u8]) -> Result<bool> {
        let mut w = WireWriter::append_to(self.ep.request_buffer(0), 13 + value.len());
        w.u8(op).u64(key).bytes(value);
        let reply = self.call(w).await?;
        self.parse_and_recycle(reply, |r| r.bool())
    }

    /// [`parse`], then the reply's buffer goes back to the endpoint (to
    /// take the next request or reply without an allocation, branch i83).
    fn parse_and_recycle<T>(
        &self,
        reply: Vec<u8>,
        f: impl FnOnce(&mut WireReader<'_>) -> std::result::Result<T, dmkv_transport::WireError>,
    ) -> Result<T> {
        let v = parse(&reply, f);
        self.ep.recycle(reply);
        v
    }

    /// UPDATE with a position hint (XStore §5.3.1).
    pub async fn update_hinted(
        &self,
        key: Key,
        value: &[u8],
        hint: LeafRef,
    ) -> Result<HintedUpdate> {
        let mut w = WireWriter::new();
        w.u8(UPDATE_HINTED)
            .u64(key)
            .u32(hint.node)
            .u32(hint.incarnation)
            .bytes(value);
        let reply = self.call(w).await?;
        parse(&reply, |r| {
            Ok(HintedUpdate {
                updated: r.bool()?,
                hint_used: r.bool()?,
            })
        })
    }

    /// The leaf holding (or that would hold) `key`.
    pub async fn find_leaf(&self, key: Key) -> Result<LeafRef> {
        let mut w = WireWriter::new();
        w.u8(FIND_LEAF).u64(key);
        let reply = self.call(w).await?;
        parse(&reply, |r| {
            Ok(LeafRef {
                node: r.u32()?,
                incarnation: r.u32()?,
            })
        })
    }
}

/// Loads pairs into the trees of their key ranges ([`load`] per range).
pub async fn load_partitioned(
    ep: &Endpoint,
    services: &TreeServices,
    pairs: &[(Key, Vec<u8>)],
) -> Result<()> {
    let parts = &services.parts;
    if parts.count() == 1 {
        return load(ep, services.svcs[0], pairs).await;
    }
    if pairs.is_sorted_by_key(|p| p.0) {
        // Ascending (the harness's loads): each range is one run of pairs.
        let mut rest = pairs;
        for (p, svc) in services.svcs.iter().enumerate() {
            let end = if p + 1 == parts.count() {
                rest.len()
            } else {
                rest.partition_point(|(k, _)| *k < parts.low(p + 1))
            };
            let (mine, next) = rest.split_at(end);
            load(ep, *svc, mine).await?;
            rest = next;
        }
        return Ok(());
    }
    let mut by_range: Vec<Vec<(Key, Vec<u8>)>> = vec![Vec::new(); parts.count()];
    for (k, v) in pairs {
        by_range[parts.of(*k)].push((*k, v.clone()));
    }
    for (svc, mine) in services.svcs.iter().zip(&by_range) {
        load(ep, *svc, mine).await?;
    }
    Ok(())
}

/// Loads pairs by LOAD RPCs of up to [`LOAD_REQUEST_BYTES`] each.
pub async fn load(ep: &Endpoint, svc: TreeService, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
    let mut i = 0;
    while i < pairs.len() {
        let mut body = WireWriter::new();
        let mut n = 0u32;
        while i < pairs.len()
            && (n == 0 || body.len() + 12 + pairs[i].1.len() <= LOAD_REQUEST_BYTES)
        {
            body.u64(pairs[i].0).bytes(&pairs[i].1);
            n += 1;
            i += 1;
        }
        let mut w = WireWriter::with_capacity(5 + body.len());
        w.u8(LOAD).u32(n).raw(&body.finish());
        ep.call(svc.node, svc.service, w.finish()).await?;
    }
    Ok(())
}

/// The figures of every range's tree: summed, the height the tallest's,
/// and each tree's own when there are several.
pub async fn stats_partitioned(
    ep: &Endpoint,
    services: &TreeServices,
) -> Result<(TreeStats, Vec<TreeStats>)> {
    let mut each = Vec::with_capacity(services.svcs.len());
    for svc in &services.svcs {
        each.push(stats(ep, *svc).await?);
    }
    let mut sum = each[0];
    for s in &each[1..] {
        sum.height = sum.height.max(s.height);
        sum.leaves += s.leaves;
        sum.inner_nodes += s.inner_nodes;
        sum.keys += s.keys;
        sum.leaf_splits += s.leaf_splits;
        sum.inner_splits += s.inner_splits;
        sum.max_nodes += s.max_nodes;
        sum.value_bytes_live += s.value_bytes_live;
        sum.value_region_bytes += s.value_region_bytes;
        sum.hinted_updates += s.hinted_updates;
        sum.hinted_updates_used += s.hinted_updates_used;
    }
    Ok((sum, each))
}

/// The tree's figures.
pub async fn stats(ep: &Endpoint, svc: TreeService) -> Result<TreeStats> {
    let mut w = WireWriter::new();
    w.u8(STATS);
    let reply = ep.call(svc.node, svc.service, w.finish()).await?;
    Ok(decode_stats(&reply).map_err(TransportError::from)?)
}

impl KvClient for RpcTreeClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        // As `write`: in the endpoint's request buffer (a `WireWriter::new`
        // grew an empty `Vec` twice per GET, ~300 instructions of
        // allocator, branch i87), awaited on the call future itself.
        let mut w = WireWriter::append_to(self.ep.request_buffer(0), 9);
        w.u8(GET).u64(key);
        let reply = self.call(w).await?;
        // The value is handed over in the reply's own buffer (its header
        // moved out of the way), not copied into a new allocation; the
        // harness gives it back through `recycle` (branch i103).
        match parse_get(&reply) {
            Ok(Some(n)) => Ok(Some(value_in_place(reply, n))),
            other => {
                // Not found or malformed: the buffer goes straight back.
                self.ep.recycle(reply);
                other.map(|_| None)
            }
        }
    }
    /// A GET's value is its reply's buffer: it goes back to the endpoint
    /// (the trait's `recycle`), whose next request or reply then reuses
    /// the allocation; the harness hands values there directly.
    #[inline]
    fn recycles_to(&self) -> Option<&Endpoint> {
        Some(&*self.ep)
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
        // As `write`.
        let mut w = WireWriter::append_to(self.ep.request_buffer(0), 9);
        w.u8(DELETE).u64(key);
        let reply = self.call(w).await?;
        self.parse_and_recycle(reply, |r| r.bool())
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        let mut out: Vec<(Key, Vec<u8>)> = Vec::new();
        let mut from = start;
        loop {
            let want = (n - out.len()).min(u32::MAX as usize) as u32;
            let mut w = WireWriter::append_to(self.ep.request_buffer(0), 13);
            w.u8(SCAN).u64(from).u32(want);
            let reply = self.call(w).await?;
            let (more, pairs) = self.parse_and_recycle(reply, |r| {
                let more = r.bool()?;
                let k = r.count(12)?;
                let pairs = (0..k)
                    .map(|_| Ok((r.u64()?, r.bytes()?.to_vec())))
                    .collect::<std::result::Result<Vec<_>, _>>()?;
                Ok((more, pairs))
            })?;
            let last = pairs.last().map(|p| p.0);
            out.extend(pairs);
            match last {
                Some(l) if more && out.len() < n && l < u64::MAX => from = l + 1,
                _ => return Ok(out),
            }
        }
    }
}
