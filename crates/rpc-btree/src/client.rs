//! The compute side of the tree service: one RPC per operation.

use crate::wire::*;
use dmkv_api::{Key, KvClient, Result};
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
