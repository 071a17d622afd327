//! Taking over a failed node's shard from a mirror (paper §4.1: replicas
//! "with checkpoints"; the paper gives no failover protocol, this is
//! dmkv's, see `docs/outback.md`).
//!
//! Shard `p`'s takeover order is its primary, then its mirrors in ring
//! order. A node takes `p` over only if every node before it in that order
//! is down (it probes them). It then:
//! 1. fences: re-registers its mirror under a new generation (a copy), and
//!    asks the later mirror holders to do the same, so that writes from a
//!    primary that is not quite dead fail instead of landing;
//! 2. scans its copy: live blocks (highest sequence number per key wins),
//!    dead blocks to recycle, the high-water mark;
//! 3. makes every later mirror an exact copy of its image (resync);
//! 4. builds the shard's index from the live blocks (a full build), publishes
//!    it and starts serving `p`, forwarding to the later mirrors.

use crate::layout::{HeapLayout, SlotWord, header_words, seq_offset};
use crate::proto::{ReplyHead, Status, op};
use crate::ring::replicas_of;
use crate::server::heap::{Heap, scan};
use crate::server::session::Sessions;
use crate::server::{
    MirrorImage, NodeServer, SERVICE, Takeover, mirror_name, mirror_prefix, new_shard, rebuild,
};
use dmkv_memnode::Region;
use dmkv_transport::exec::block_on;
use dmkv_transport::time::Instant;
use dmkv_transport::{
    AccessKey, NodeId, RegionId, RemoteRegion, ServiceError, TransportError, WireReader, WireWriter,
};
use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::Ordering;

/// Bytes copied per one-sided write during a resync.
const CHUNK: u64 = 1 << 20;

/// Work a takeover declares to the simulated cluster's instruction term
/// ([`dmkv_transport::sim::work`], a no-op off a metered memory-node core;
/// the takeover runs as a worker job; docs/simulation.md, "Declared work,
/// the rest (branch i60)"), beside the full build it ends in (which
/// declares its own, `rebuild::cost`). Each excludes region reads and
/// writes (the mirror's copy, the scan's and the session table's reads,
/// the resync: charged by their lines and the network's model) and the
/// fence RPCs and resync writes (messages and verbs).
///
/// Counted with callgrind on the `local` transport, main's binary fac3bce
/// (`/tmp/keep/dmkv-head15`): `valgrind --tool=callgrind dmkv bench
/// --engine outback --memnodes 3 --crash-memnode 1@0.5 --workload ycsb-a
/// --keys 50000 --ops 20000 --threads 1 --tasks 8 --seed 1` (one takeover,
/// 13,647 live blocks recovered, 16,384 session slots): `recover::run`
/// inclusive 64,988,684, of which the full build (`rebuild::run`,
/// 28,056,559), the fence's mirror copy (`refence`, 5,501,010), the fence
/// RPCs and resync writes (`with_endpoint`, 2,455,153), the scan's and
/// session table's region reads (5,191,955 and 2,634,684) and the probe of
/// the dead node (`is_down`, 5,128) are left out.
pub mod cost {
    /// Per takeover: the new shard (`new_shard`, 205,679: its regions,
    /// seeds and tables), the heap's adoption (3,574) and the rest of the
    /// job's calls made once (~2,000).
    pub const TAKEOVER: u64 = 211_250;
    /// Per live block scanned: the scan less its reads (3,896,206: headers
    /// parsed, checksums), the newest-copy map (BTreeMap inserts
    /// 2,356,774, its drop 322,219, vector growth 259,528), the live-address
    /// set (3,495,217) and `run`'s own loops (9,431,986: the loaded list's
    /// fingerprints, the dead-block pass), 19,761,930 over 13,647 blocks.
    pub const BLOCK: u64 = 1_448;
    /// Per session slot of the heap's session table (`Sessions::recover`
    /// less its reads, 1,170,780 over 16,384 slots).
    pub const SESSION: u64 = 71;
}

/// TAKEOVER: starts (once) or reports the takeover of shard `p`.
pub fn takeover(node: &Arc<NodeServer>, p: u16) -> Status {
    if let Ok(Some(_)) = node.shard(p) {
        return Status::Ok;
    }
    if node.mirrors.lock()[p as usize].is_none() {
        return Status::Refused;
    }
    let mut t = node.takeovers.lock();
    // Invariant 19: looked at again under the lock a takeover fills the
    // slot under, so no job starts for a shard that is already served.
    if let Ok(Some(_)) = node.shard(p) {
        return Status::Ok;
    }
    match t.get(&p) {
        Some(Takeover::Running) => return Status::Recovering,
        Some(Takeover::Refused) => {
            // The last attempt found an earlier holder alive; say so once,
            // and let the next request try again.
            t.remove(&p);
            return Status::Refused;
        }
        None => {}
    }
    t.insert(p, Takeover::Running);
    drop(t);
    let me = node.clone();
    let job = move || {
        let started = Instant::now();
        let outcome = run(&me, p);
        let mut t = me.takeovers.lock();
        match outcome {
            Ok(shard) => {
                t.remove(&p);
                shard.stats.takeovers.fetch_add(1, Ordering::Relaxed);
                shard
                    .stats
                    .takeover_ns
                    .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
                // Invariant 19: the slot is empty (this job was started
                // under this lock while it was, and is `p`'s only one).
                me.install_shard(p, shard);
                // The mirror is now this node's heap of shard `p`.
                me.mirrors.lock()[p as usize] = None;
            }
            Err(_) => {
                t.insert(p, Takeover::Refused);
            }
        }
    };
    if node.ctx.submit(job).is_err() {
        node.takeovers.lock().remove(&p);
        return Status::Refused;
    }
    Status::Recovering
}

/// Shard `p`'s takeover order: its primary's shard, then its mirrors.
fn order(node: &NodeServer, p: u16) -> Vec<u16> {
    let mut o = vec![p];
    o.extend(replicas_of(p, node.ctx.shards(), node.ctx.cfg.replicas));
    o
}

/// Whether the node first serving shard `s` is down (its service does not
/// answer because the node is gone).
fn is_down(node: &NodeServer, s: u16) -> bool {
    let target = node.node_of(s);
    let name = node.ctx.name(SERVICE);
    matches!(
        node.ctx
            .with_endpoint(|ep| block_on(ep.lookup_service(target, &name))),
        Ok(Err(
            TransportError::NodeDown(_) | TransportError::UnknownNode(_)
        ))
    )
}

/// Copies the used part of a heap image (header, bitmap, blocks up to the
/// high-water mark) into a fresh region of generation `g`, withdraws the old
/// one, and returns the new one.
fn refence(node: &NodeServer, p: u16) -> Result<Region, ServiceError> {
    let layout = node.layout;
    let (old, g) = {
        let m = node.mirrors.lock();
        let img = m[p as usize]
            .as_ref()
            .ok_or_else(|| ServiceError::failed("outback: no mirror of that shard here"))?;
        (img.region.clone(), img.generation)
    };
    let fresh = node
        .ctx
        .region(&mirror_name(p, g + 1), layout.region_len())?;
    let end = extent(&layout, &old);
    let mut at = 0;
    while at < end {
        let n = (end - at).min(CHUNK);
        let bytes = old
            .mem
            .read_vec(at, n as usize)
            .map_err(|e| ServiceError::failed(format!("outback: mirror copy: {e}")))?;
        fresh
            .mem
            .write(at, &bytes)
            .map_err(|e| ServiceError::failed(format!("outback: mirror copy: {e}")))?;
        at += n;
    }
    crate::server::account_mirror(&fresh, &layout);
    node.mirrors.lock()[p as usize] = Some(MirrorImage {
        region: fresh.clone(),
        generation: g + 1,
    });
    node.ctx.withdraw(&mirror_prefix(p, g));
    Ok(fresh)
}

/// End of the last block whose start bit is set (or of the bitmap).
pub(crate) fn extent(layout: &HeapLayout, r: &Region) -> u64 {
    let words = layout.data_len / 8;
    let bitmap_words = words.div_ceil(64);
    let mut end = layout.data_start;
    for i in (0..bitmap_words).rev() {
        let w = r.mem.load_u64(layout.bitmap_start + i * 8).unwrap_or(0);
        if w != 0 {
            let bit = 63 - w.leading_zeros() as u64;
            let addr = layout.data_start + (i * 64 + bit) * 8;
            let klen = r.mem.load_u64(addr).unwrap_or(0);
            let vlen = r.mem.load_u64(addr + 8).unwrap_or(0);
            let n = header_words(klen, vlen).unwrap_or(crate::layout::MAX_BLOCK_WORDS);
            end = (addr + n * 8).min(layout.data_start + layout.data_len);
            break;
        }
    }
    end
}

/// FENCE (from the node taking shard `p` over, `by`): if every node before
/// `by` in the takeover order is down, re-registers this node's mirror and
/// returns the new region.
pub fn fence(node: &Arc<NodeServer>, p: u16, by: u16) -> Result<Vec<u8>, ServiceError> {
    let o = order(node, p);
    let (Some(by_pos), Some(my_pos)) = (
        o.iter().position(|&s| s == by),
        o.iter().position(|&s| s == node.own),
    ) else {
        return Ok(crate::server::shard::status_reply(Status::Refused));
    };
    if by_pos >= my_pos || node.mirrors.lock()[p as usize].is_none() {
        return Ok(crate::server::shard::status_reply(Status::Refused));
    }
    if o[..by_pos].iter().any(|&s| !is_down(node, s)) {
        return Ok(crate::server::shard::status_reply(Status::Refused));
    }
    let region = refence(node, p)?;
    let mut w = WireWriter::new();
    ReplyHead::new(Status::Ok).write(&mut w);
    let r = region.remote;
    w.u16(r.node.0).u32(r.id.0).u64(r.key.0).u64(r.len);
    Ok(w.finish())
}

fn decode_fence(reply: &[u8]) -> Option<RemoteRegion> {
    let mut r = WireReader::new(reply);
    let head = ReplyHead::read(&mut r).ok()?;
    if head.status != Status::Ok {
        return None;
    }
    let region = RemoteRegion {
        node: NodeId(r.u16().ok()?),
        id: RegionId(r.u32().ok()?),
        key: AccessKey(r.u64().ok()?),
        len: r.u64().ok()?,
    };
    r.end().ok()?;
    Some(region)
}

/// The takeover itself, on the worker.
fn run(
    node: &Arc<NodeServer>,
    p: u16,
) -> Result<Arc<crate::server::shard::ShardServer>, ServiceError> {
    let ctx = &node.ctx;
    let o = order(node, p);
    let me = o
        .iter()
        .position(|&s| s == node.own)
        .ok_or_else(|| ServiceError::failed("outback: not a mirror of that shard"))?;
    if o[..me].iter().any(|&s| !is_down(node, s)) {
        return Err(ServiceError::failed(
            "outback: an earlier holder of the shard is alive",
        ));
    }
    // 1. Fence: my copy, then the later holders'.
    let region = refence(node, p)?;
    let mut later: Vec<(NodeId, RemoteRegion)> = Vec::new();
    for &s in &o[me + 1..] {
        let target = node.node_of(s);
        let mut w = WireWriter::new();
        w.u8(op::FENCE).u16(p).u16(node.own);
        let name = ctx.name(SERVICE);
        let reply = ctx.with_endpoint(|ep| {
            block_on(async {
                let svc = ep.lookup_service(target, &name).await?;
                ep.call(target, svc, w.finish()).await
            })
        })?;
        if let Ok(reply) = reply
            && let Some(r) = decode_fence(&reply)
        {
            later.push((target, r));
        }
    }
    // 2. Scan.
    let layout = node.layout;
    let image = scan(&layout, |at, n| region.mem.read_vec(at, n).ok());
    // Ordered by key: the loaded list below is built in this order, and a
    // simulation must replay it (a HashMap's order differs between runs).
    let mut best: BTreeMap<u64, (u64, u64, u64)> = BTreeMap::new();
    let mut dead = image.dead.clone();
    let mut max_seq = 0;
    for &(key, addr, words, seq) in &image.live {
        max_seq = max_seq.max(seq);
        match best.get(&key) {
            Some(&(_, _, s)) if s >= seq => dead.push((addr, words)),
            Some(&(a, w, _)) => {
                dead.push((a, w));
                best.insert(key, (addr, words, seq));
            }
            None => {
                best.insert(key, (addr, words, seq));
            }
        }
    }
    // Superseded live blocks die before the image is copied anywhere.
    let live_addrs: std::collections::HashSet<u64> = best.values().map(|v| v.0).collect();
    for &(addr, words) in &dead {
        if !live_addrs.contains(&addr) {
            let _ = region.mem.store_u64(addr + seq_offset(words), 0);
        }
    }
    // 3. Resync the later mirrors to exactly this image.
    let end = image.high_water;
    ctx.with_endpoint(|ep| -> Result<(), ServiceError> {
        for (_, r) in &later {
            let mut at = 0;
            while at < end {
                let n = (end - at).min(CHUNK);
                let bytes = region
                    .mem
                    .read_vec(at, n as usize)
                    .map_err(|e| ServiceError::failed(format!("outback: resync: {e}")))?;
                match block_on(ep.write(r.at(at), &bytes)) {
                    Ok(()) | Err(TransportError::NodeDown(_)) => {}
                    Err(e) => return Err(ServiceError::failed(format!("outback: resync: {e}"))),
                }
                at += n;
            }
        }
        Ok(())
    })??;
    // 4. Serve: a full build of the recovered keys.
    // The session table: the last applied write of every session, as
    // the old primary recorded it with the writes themselves.
    let sessions = Sessions::recover(layout, |at, n| region.mem.read_vec(at, n).ok());
    dmkv_transport::sim::work(
        cost::TAKEOVER + cost::BLOCK * image.live.len() as u64 + cost::SESSION * layout.sessions,
    );
    let heap = Heap::adopt(region, layout, end, &dead);
    let shard = new_shard(ctx, p, heap, max_seq + 1, sessions)?;
    shard.replicas.set(later);
    {
        let mut loaded = shard.loaded.lock();
        for (&key, &(addr, words, _)) in &best {
            loaded.push((
                key,
                SlotWord::new(crate::hash::fingerprint(key), words, addr),
            ));
        }
    }
    shard
        .stats
        .recovered_keys
        .store(best.len() as u64, Ordering::Relaxed);
    shard.ready.store(true, Ordering::Release);
    shard.build_requested.store(1, Ordering::Release);
    shard.job_active.store(true, Ordering::Release);
    rebuild::run(shard.clone());
    if shard.build_done.load(Ordering::Acquire) < 1 {
        return Err(ServiceError::failed(format!(
            "outback: rebuilding shard {p} failed: {:?}",
            shard.last_error.lock()
        )));
    }
    Ok(shard)
}
