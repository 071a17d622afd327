//! The operations of a compute thread (§3.4), every one of them one-sided.
//!
//! - get: predict the leaf range, read the trained leaves and their synonym
//!   chains (from the cached LT/SLT) plus the record's state and slot_use in
//!   one doorbell batch; answer from the live leaf whose fences cover the key.
//! - insert / update / upsert / delete: fetch like a get (insert: trained
//!   leaves only), lock the group's LT entry by CAS and re-read its chain in
//!   the same batch, check the chain tiles the group, modify, and write the
//!   leaves and the unlock in one batch; a full leaf is split into a new
//!   synonym leaf allocated by FAA on the leaf region and on slot_use; a
//!   synonym leaf emptied by a delete is unlinked.
//! - scan: like a get over `N/δ` more trained leaves, following fences from
//!   leaf to leaf and on into the next models.

use super::cache::{LeafIds, ModelCache};
use super::{Shared, bump};
use crate::io::{LeafId, Link, chain, corrupt};
use crate::layout::entry::{Entry, LOCK_BIT, RETIRED, unlocked};
use crate::layout::leaf::{Leaf, LeafError, LeafView, Slot};
use crate::layout::meta::{ModelRef, W_QTAIL, W_UTAIL};
use crate::layout::record::{ModelState, RecordLayout, W_SLT, W_STATE, W_URGENT};
use crate::layout::value::{FatPtr, block_bytes, decode_block, encode_block};
use crate::remote::{H_ALLOC, LEAF_BASE};
use crate::server::push_leaf_write;
use dmkv_api::{Key, KvClient, KvError, Result};
use dmkv_transport::exec::{sleep, yield_now};
use dmkv_transport::{Batch, Endpoint, RemoteAddr};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Every retry path awaits [`backoff`]: with the local backend, verbs
/// complete without suspending, so a retry loop that never yields would keep
/// the other tasks of its thread (maybe the holder of the lock it waits for)
/// from running.
///
/// Attempts before an operation gives up (each failed attempt means the
/// cache was stale or a leaf was being written; a live system converges in
/// a few).
const MAX_ATTEMPTS: u32 = 200_000;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Insert,
    Update,
    Upsert,
    Delete,
}

const GET: usize = 0;
const SCAN: usize = 5;

fn kind_index(k: Kind) -> usize {
    match k {
        Kind::Insert => 1,
        Kind::Update => 2,
        Kind::Upsert => 3,
        Kind::Delete => 4,
    }
}

enum Outcome {
    Done(bool),
    Retry,
}

async fn backoff(attempt: u32) {
    if attempt < 4 {
        yield_now().await;
    } else {
        sleep(Duration::from_micros((attempt as u64 * 5).min(500))).await;
    }
}

fn word(b: &[u8]) -> u64 {
    u64::from_le_bytes(b[..8].try_into().expect("8 bytes"))
}

/// A compute thread's handle.
pub struct RolexClient {
    ep: Rc<Endpoint>,
    sh: Arc<Shared>,
}

/// The group a writer locked and what it knows about it.
struct Group<'a> {
    mc: &'a ModelCache,
    j: usize,
    low: Key,
    high: Key,
    /// The LT word (unlocked) while we hold the lock.
    lt: u64,
    links: Vec<Link>,
    leaves: Vec<Leaf>,
    state: u64,
    slot_use: u64,
    /// Set once `finish` has released the lock or handed it over: from
    /// then on it is not ours, and an error after that point (queueing a
    /// retrain, waiting for one, both on memory node 0) must not release
    /// it again (`bail`; docs/rolex.md, invariant 15).
    released: std::cell::Cell<bool>,
}

impl RolexClient {
    pub fn new(ep: Rc<Endpoint>, sh: Arc<Shared>) -> RolexClient {
        RolexClient { ep, sh }
    }

    fn leaf_addr(&self, id: LeafId) -> Result<RemoteAddr> {
        self.sh
            .remote
            .leaf(id.region, id.leaf)
            .ok_or_else(|| corrupt(format!("leaf {id:?} is outside its region")))
    }

    fn rec(&self, m: ModelRef, w: usize) -> Result<RemoteAddr> {
        self.sh
            .remote
            .record(m, w)
            .ok_or_else(|| corrupt(format!("model {m:?} is outside its region")))
    }

    fn lt_addr(&self, mc: &ModelCache, j: usize) -> Result<RemoteAddr> {
        let rl = RecordLayout {
            slt: mc.p.slt_slots as usize,
        };
        self.rec(mc.m, rl.lt_word(j))
    }

    fn slt_addr(&self, mc: &ModelCache, s: usize) -> Result<RemoteAddr> {
        self.rec(mc.m, W_SLT + s)
    }

    /// Notes what the 16-byte state/slot_use read says about the cache.
    fn observe(&self, mc: &ModelCache, b: &[u8]) -> (u64, u64) {
        let w = [word(b), word(&b[8..])];
        let going = w[0] == ModelState::Retired as u64 || w[0] == ModelState::Freezing as u64;
        if going && !mc.retired.swap(true, Ordering::AcqRel) {
            bump(&self.sh.stats.retired_noticed);
        }
        if mc.note_slot_use(w[1]) {
            bump(&self.sh.stats.slot_use_changes_noticed);
        }
        (w[0], w[1])
    }

    async fn refresh_after_miss(&self, mc: &ModelCache) -> Result<()> {
        bump(&self.sh.stats.coverage_misses);
        if mc.retired.load(Ordering::Acquire) {
            self.sh.refresh_dir(&self.ep).await?;
        }
        self.sh.refresh_tables(&self.ep, mc).await
    }

    async fn value_of(&self, key: Key, s: Slot) -> Result<Vec<u8>> {
        if !s.out_of_line {
            return Ok(s.word.to_le_bytes().to_vec());
        }
        let p = FatPtr::decode(s.word);
        if p.len == 0 {
            return Ok(Vec::new());
        }
        let addr = self
            .sh
            .remote
            .value(p.region, p.offset)
            .ok_or_else(|| corrupt(format!("value pointer {p:?} is outside its region")))?;
        let b = self.ep.read(addr, block_bytes(p.len as usize)).await?;
        decode_block(key, p, &b).map_err(corrupt)
    }

    async fn get_inner(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let sh = &self.sh;
        let layout = sh.cfg.leaf;
        // The rare paths (a model or table to fetch, a miss to refresh) are
        // boxed: their futures are large (~1 KiB) and would otherwise make
        // every GET's future, which the API boxes per operation, too large
        // for the allocator's small-object fast path.
        for attempt in 0..MAX_ATTEMPTS {
            let mc = match sh.cached_model(key) {
                Some(mc) => mc,
                None => Box::pin(sh.model_for(&self.ep, key, false)).await?,
            };
            let (lo, hi) = mc.p.leaf_range(key, layout.slots());
            let mut ids = LeafIds::new();
            if !mc.chain_leaves(lo, hi, &mut ids) {
                Box::pin(sh.refresh_tables(&self.ep, &mc)).await?;
                backoff(attempt).await;
                continue;
            }
            // The batch is built in a block so that only its future, not
            // the batch it moved out of, is kept across the await.
            let (si, run) = {
                let mut b = self.ep.batch();
                for id in &ids {
                    b.read(self.leaf_addr(*id)?, layout.bytes());
                }
                (b.read(self.rec(mc.m, W_STATE)?, 16), b.run())
            };
            let res = run.await?;
            sh.stats.leaves_read[GET].fetch_add(ids.len() as u64, Ordering::Relaxed);
            self.observe(&mc, res.read(si));
            let mut torn = false;
            for i in 0..ids.len() {
                // Validated as `Leaf::decode` would, searched in place.
                match LeafView::parse(&layout, res.read(i)) {
                    Ok(l) if l.covers(key) => {
                        let found = l.get(key);
                        drop(res);
                        return match found {
                            Some(s) => Ok(Some(self.value_of(key, s).await?)),
                            None => Ok(None),
                        };
                    }
                    Ok(_) => {}
                    Err(LeafError::Torn) => torn = true,
                    Err(LeafError::Corrupt(e)) => return Err(corrupt(e)),
                }
            }
            if torn {
                bump(&sh.stats.torn_leaves);
            } else {
                Box::pin(self.refresh_after_miss(&mc)).await?;
            }
            backoff(attempt).await;
        }
        Err(corrupt(format!("get {key:#x}: no leaf covered the key")))
    }

    async fn write_inner(&self, kind: Kind, key: Key, value: Option<&[u8]>) -> Result<bool> {
        let sh = &self.sh;
        let layout = sh.cfg.leaf;
        let slots = layout.slots();
        let mut block: Option<(FatPtr, Vec<u8>)> = None;
        let needs_block = value.is_some_and(|v| v.len() != 8 && !v.is_empty());
        for attempt in 0..MAX_ATTEMPTS {
            let mc = sh.model_for(&self.ep, key, true).await?;
            let n = mc.p.leaves as usize;
            let (lo, hi) = mc.p.leaf_range(key, slots);
            let Some(mut chains) = mc.chains(lo, hi) else {
                sh.refresh_tables(&self.ep, &mc).await?;
                backoff(attempt).await;
                continue;
            };
            if kind == Kind::Insert {
                // §3.4 ①: the fetch phase reads no synonym leaves.
                chains.iter_mut().for_each(|c| c.truncate(1));
            }
            // The next group's trained leaf, for its low fence. A RETIRED
            // word cached by a refresh during a freeze is stale, not
            // corrupt: refresh (invariant 13).
            let next = if hi + 1 < n {
                let Some(e) = Entry::decode(mc.lt(hi + 1)) else {
                    bump(&sh.stats.retired_cached);
                    sh.refresh_tables(&self.ep, &mc).await?;
                    backoff(attempt).await;
                    continue;
                };
                Some(e)
            } else {
                None
            };
            // ① Fetch.
            let mut b = self.ep.batch();
            let mut idx = Vec::new();
            for c in &chains {
                let first = b.len();
                for l in c {
                    b.read(self.leaf_addr(l.entry.into())?, layout.bytes());
                }
                idx.push(first);
            }
            let read = b.len();
            let next_low = match next {
                Some(e) => {
                    let a = self.leaf_addr(e.into())?;
                    Some(b.read(
                        RemoteAddr {
                            offset: a.offset + layout.low_offset(),
                            ..a
                        },
                        8,
                    ))
                }
                None => None,
            };
            let si = b.read(self.rec(mc.m, W_STATE)?, 16);
            let fa = match (needs_block && block.is_none(), value) {
                (true, Some(v)) => {
                    let region = mc.p.region;
                    Some((
                        b.faa(
                            sh.remote.values[region as usize].at(H_ALLOC),
                            block_bytes(v.len()) as u64,
                        ),
                        region,
                    ))
                }
                _ => None,
            };
            let mut res = b.run().await?;
            sh.stats.leaves_read[kind_index(kind)].fetch_add(read as u64, Ordering::Relaxed);
            if let (Some((i, region)), Some(v)) = (fa, value) {
                let off = res.word(i);
                let cap = sh.remote.values[region as usize]
                    .len
                    .min(FatPtr::MAX_OFFSET);
                if off + block_bytes(v.len()) as u64 > cap {
                    return Err(KvError::Exhausted(format!(
                        "value region of memory node {region} is full (raise rolex.value_region_mb)"
                    )));
                }
                block = Some((
                    FatPtr {
                        region,
                        offset: off,
                        len: v.len() as u32,
                    },
                    encode_block(key, v),
                ));
            }
            self.observe(&mc, &res.take_read(si));
            if mc.retired.load(Ordering::Acquire) {
                // Being replaced: take no lock, wait for the new models.
                backoff(attempt).await;
                continue;
            }
            let images: Vec<Vec<u8>> = (0..read).map(|i| res.take_read(i)).collect();
            // The group: the last trained leaf whose (immutable) low fence is
            // at or below the key.
            let lows: Vec<Key> = idx.iter().map(|&i| word(&images[i][8..16])).collect();
            let Some(g) = lows.iter().rposition(|l| *l <= key) else {
                self.refresh_after_miss(&mc).await?;
                backoff(attempt).await;
                continue;
            };
            let high = if g + 1 < lows.len() {
                lows[g + 1]
            } else if let Some(i) = next_low {
                word(&res.take_read(i))
            } else {
                mc.p.high
            };
            // Answers that need no lock: a consistent live leaf covering the
            // key says whether it is there.
            for img in &images {
                if let Ok(l) = Leaf::decode(&layout, img)
                    && l.covers(key)
                {
                    let present = l.get(key).is_some();
                    let done = match kind {
                        Kind::Insert => present,
                        Kind::Update | Kind::Delete => !present,
                        Kind::Upsert => false,
                    };
                    if done {
                        bump(&sh.stats.answered_without_lock);
                        return Ok(false);
                    }
                }
            }
            // ② Lock.
            let j = lo + g;
            let gk = (mc.m, j);
            // The turn is released explicitly on every path of `locked`;
            // if an error or a dropped future skips that, dropping it does.
            let turn = sh.locks.acquire(gk).await;
            let held = turn.held;
            let res = self
                .locked(
                    kind,
                    key,
                    value,
                    block.as_ref(),
                    &mc,
                    j,
                    lows[g],
                    high,
                    held,
                )
                .await;
            drop(turn);
            match res {
                Ok(Outcome::Done(b)) => return Ok(b),
                Ok(Outcome::Retry) => backoff(attempt).await,
                Err(e) => return Err(e),
            }
        }
        Err(corrupt(format!("write of {key:#x} did not converge")))
    }

    /// Takes the group lock (unless it was handed over), then works under it.
    /// Always leaves the lock released (or handed over) and the local turn
    /// ended.
    #[allow(clippy::too_many_arguments)]
    async fn locked(
        &self,
        kind: Kind,
        key: Key,
        value: Option<&[u8]>,
        block: Option<&(FatPtr, Vec<u8>)>,
        mc: &ModelCache,
        j: usize,
        low: Key,
        high: Key,
        held: Option<u64>,
    ) -> Result<Outcome> {
        let sh = &self.sh;
        let gk = (mc.m, j);
        let lt_addr = self.lt_addr(mc, j)?;
        let mut g = Group {
            mc,
            j,
            low,
            high,
            lt: held.unwrap_or_else(|| mc.lt(j)),
            links: Vec::new(),
            leaves: Vec::new(),
            state: 0,
            slot_use: 0,
            released: std::cell::Cell::new(false),
        };
        if let Some(lt) = held {
            bump(&sh.stats.lock_handovers);
            mc.set_lt(j, lt);
            if let Err(e) = self.reread(&mut g, None).await {
                return Err(self.bail(&g, lt_addr, e).await);
            }
        } else {
            let mut expected = g.lt;
            let mut contended = false;
            loop {
                if expected == RETIRED {
                    // Another local task's table refresh, after this one's
                    // fetch, cached the entry as RETIRED (a retrain froze
                    // the group). A CAS from RETIRED to RETIRED | LOCK_BIT
                    // (the same word) would "succeed" on a frozen entry
                    // and take no lock: retry as when a CAS finds RETIRED
                    // (invariant 13).
                    sh.locks.release(gk, None);
                    mc.retired.store(true, Ordering::Release);
                    bump(&sh.stats.retired_cached);
                    return Ok(Outcome::Retry);
                }
                let links = chain(expected, &mc.snapshot().slt).ok();
                let mut b = self.ep.batch();
                let ci = b.cas(lt_addr, expected, expected | LOCK_BIT);
                let with_reads = !contended && links.is_some();
                if with_reads {
                    self.push_group_reads(&mut b, links.as_deref().unwrap_or(&[]), mc)?;
                }
                let mut res = b.run().await?;
                let got = res.word(ci);
                if got == expected {
                    g.lt = expected;
                    mc.set_lt(j, expected);
                    let r = if with_reads {
                        let links = links.expect("with reads");
                        self.reread(&mut g, Some((links, &mut res, 1))).await
                    } else {
                        self.reread(&mut g, None).await
                    };
                    if let Err(e) = r {
                        return Err(self.bail(&g, lt_addr, e).await);
                    }
                    break;
                }
                if got == RETIRED {
                    sh.locks.release(gk, None);
                    mc.retired.store(true, Ordering::Release);
                    return Ok(Outcome::Retry);
                }
                if got & LOCK_BIT != 0 {
                    // Another compute process holds the group: try again
                    // at once, as Sherman's released code does (its
                    // `try_lock_addr` re-posts the CAS in a loop; ROLEX's
                    // paper names no back-off, §3.4 ②, and defers one
                    // for contention among many compute nodes to future
                    // work, §3.6). The CAS is a verb, so the retry costs
                    // a round trip and NIC capacity, not a spin. (Until
                    // the thirty-fourth session this slept from the fourth
                    // try on, 20-500 us, which nothing in the paper has:
                    // docs/rolex.md, departures.)
                    bump(&sh.stats.lock_retries);
                    contended = true;
                    yield_now().await;
                }
                expected = unlocked(got);
                mc.set_lt(j, expected);
            }
        }
        match self.modify(kind, key, value, block, &mut g).await {
            Ok(o) => Ok(o),
            Err(e) => Err(self.bail(&g, lt_addr, e).await),
        }
    }

    /// Releases the lock after an error (best effort) and passes the error
    /// on; if `finish` already released it or handed it over, it is
    /// somebody else's by now and is left alone (invariant 15).
    async fn bail(&self, g: &Group<'_>, lt_addr: RemoteAddr, e: KvError) -> KvError {
        if !g.released.get() {
            let _ = self.ep.write(lt_addr, &g.lt.to_le_bytes()).await;
            self.sh.locks.release((g.mc.m, g.j), None);
        }
        e
    }

    fn push_group_reads(&self, b: &mut Batch<'_>, links: &[Link], mc: &ModelCache) -> Result<()> {
        b.read(self.rec(mc.m, W_STATE)?, 16);
        for l in links {
            b.read(self.leaf_addr(l.entry.into())?, self.sh.cfg.leaf.bytes());
        }
        Ok(())
    }

    /// Under the lock: gets the group's chain and leaves and checks that the
    /// chain tiles `[low, high)`; refreshes the SLT once if it does not.
    /// `first` carries reads posted with the CAS (links, results, index of
    /// the state read).
    async fn reread(
        &self,
        g: &mut Group<'_>,
        mut first: Option<(Vec<Link>, &mut dmkv_transport::BatchResult, usize)>,
    ) -> Result<()> {
        let layout = self.sh.cfg.leaf;
        for round in 0..8 {
            let (links, bytes, state) = match first.take() {
                Some((links, res, si)) => {
                    let st = res.take_read(si);
                    let bytes: Vec<Vec<u8>> = (0..links.len())
                        .map(|i| res.take_read(si + 1 + i))
                        .collect();
                    (links, bytes, st)
                }
                None => {
                    let links = match chain(g.lt, &g.mc.snapshot().slt) {
                        Ok(l) => l,
                        Err(_) => {
                            self.sh.refresh_tables(&self.ep, g.mc).await?;
                            chain(g.lt, &g.mc.snapshot().slt).map_err(corrupt)?
                        }
                    };
                    let mut b = self.ep.batch();
                    self.push_group_reads(&mut b, &links, g.mc)?;
                    let mut res = b.run().await?;
                    let st = res.take_read(0);
                    let bytes = (0..links.len()).map(|i| res.take_read(1 + i)).collect();
                    (links, bytes, st)
                }
            };
            let (state, slot_use) = self.observe(g.mc, &state);
            let mut leaves = Vec::with_capacity(links.len());
            let mut torn = false;
            for b in &bytes {
                match Leaf::decode(&layout, b) {
                    Ok(l) => leaves.push(l),
                    Err(LeafError::Torn) => torn = true,
                    Err(LeafError::Corrupt(e)) => return Err(corrupt(e)),
                }
            }
            if !torn && tiles(&leaves, g.low, g.high) {
                g.links = links;
                g.leaves = leaves;
                g.state = state;
                g.slot_use = slot_use;
                return Ok(());
            }
            if torn {
                bump(&self.sh.stats.torn_leaves);
            } else if round > 0 || g.mc.slot_use() == slot_use {
                // The chain is stale: read the tables again.
                bump(&self.sh.stats.coverage_misses);
            }
            self.sh.refresh_tables(&self.ep, g.mc).await?;
        }
        Err(corrupt(format!(
            "the leaves of group {} do not tile [{:#x}, {:#x}) even under its lock",
            g.j, g.low, g.high
        )))
    }

    /// Applies the operation to the locked group and writes it back.
    async fn modify(
        &self,
        kind: Kind,
        key: Key,
        value: Option<&[u8]>,
        block: Option<&(FatPtr, Vec<u8>)>,
        g: &mut Group<'_>,
    ) -> Result<Outcome> {
        let sh = &self.sh;
        let slots = sh.cfg.slots();
        let x = g
            .leaves
            .iter()
            .position(|l| l.covers(key))
            .ok_or_else(|| corrupt("no leaf of a tiled group covers the key"))?;
        let pos = g.leaves[x].search(key);
        let present = pos.is_ok();
        let refuse = match kind {
            Kind::Insert => present,
            Kind::Update | Kind::Delete => !present,
            Kind::Upsert => false,
        };
        if refuse {
            self.finish(g, Vec::new(), g.lt).await?;
            return Ok(Outcome::Done(false));
        }
        let result = match kind {
            Kind::Upsert => !present,
            _ => true,
        };
        let new_slot = value.map(|v| match (v.len(), block) {
            (8, _) => Slot {
                key,
                word: u64::from_le_bytes(v.try_into().expect("8 bytes")),
                out_of_line: false,
            },
            (0, _) => Slot {
                key,
                word: FatPtr {
                    region: 0,
                    offset: 0,
                    len: 0,
                }
                .encode(),
                out_of_line: true,
            },
            (_, Some((p, _))) => Slot {
                key,
                word: p.encode(),
                out_of_line: true,
            },
            (_, None) => unreachable!("a block was allocated for an out-of-line value"),
        });
        let mut writes: Vec<Write> = Vec::new();
        if let (Some(s), Some((p, bytes))) = (new_slot, block)
            && s.out_of_line
            && p.len > 0
        {
            let addr = sh
                .remote
                .value(p.region, p.offset)
                .ok_or_else(|| corrupt("value block outside its region"))?;
            writes.push(Write::Raw(addr, bytes.clone()));
        }
        let mut leaf = g.leaves[x].clone();
        let id: LeafId = g.links[x].entry.into();
        let mut final_lt = g.lt;
        match (kind, pos) {
            (Kind::Delete, Ok(i)) => {
                leaf.pairs.remove(i);
                if leaf.pairs.is_empty() && x > 0 && g.state == ModelState::Active as u64 {
                    // Unlink the emptied synonym leaf: the predecessor takes
                    // its range first, then it is marked dead, then the link
                    // skips it.
                    let mut pred = g.leaves[x - 1].clone();
                    pred.high = leaf.high;
                    writes.push(Write::Leaf(
                        g.links[x - 1].entry.into(),
                        pred.clone(),
                        pred.version + 1,
                    ));
                    leaf.dead = true;
                    writes.push(Write::Leaf(id, leaf.clone(), leaf.version + 1));
                    let skip = g.links[x].entry.syn;
                    if x - 1 == 0 {
                        final_lt = Entry::decode(g.lt).expect("live").with_syn(skip).encode();
                        writes.push(Write::LtLocked(final_lt));
                    } else {
                        let s = g.links[x - 1].slot;
                        let w = g.links[x - 1].entry.with_syn(skip).encode();
                        writes.push(Write::Slt(s, w));
                    }
                    bump(&sh.stats.unlinks);
                } else {
                    writes.push(Write::Leaf(id, leaf.clone(), leaf.version + 1));
                }
            }
            (_, Ok(i)) => {
                leaf.pairs[i] = new_slot.expect("a value for a write");
                writes.push(Write::Leaf(id, leaf.clone(), leaf.version + 1));
            }
            (_, Err(i)) if leaf.pairs.len() < slots => {
                leaf.pairs.insert(i, new_slot.expect("a value for a write"));
                writes.push(Write::Leaf(id, leaf.clone(), leaf.version + 1));
            }
            (_, Err(i)) => {
                // The leaf is full: a new synonym leaf takes its upper half.
                if g.state == ModelState::Failed as u64 {
                    self.finish(g, Vec::new(), g.lt).await?;
                    return Err(KvError::Exhausted(
                        "a model's synonym leaf table is full and retraining it failed (raise rolex.model_region_mb or rolex.max_models)".into(),
                    ));
                }
                if g.slot_use >= g.mc.p.slt_slots as u64 {
                    self.finish(g, Vec::new(), g.lt).await?;
                    self.wait_for_retrain(g.mc).await?;
                    return Ok(Outcome::Retry);
                }
                let region = g.mc.p.region;
                let mut b = self.ep.batch();
                b.faa(sh.remote.leaves[region as usize].at(H_ALLOC), 1);
                b.faa(self.slt_addr(g.mc, 0)?, 1);
                let res = b.run().await?;
                let (n, s) = (res.word(0), res.word(1) as usize);
                let capacity =
                    (sh.remote.leaves[region as usize].len - LEAF_BASE) / sh.remote.leaf_bytes;
                if n >= capacity {
                    self.finish(g, Vec::new(), g.lt).await?;
                    return Err(KvError::Exhausted(format!(
                        "leaf region of memory node {region} is full ({capacity} leaves; raise rolex.leaves)"
                    )));
                }
                if s >= g.mc.p.slt_slots as usize {
                    self.finish(g, Vec::new(), g.lt).await?;
                    self.wait_for_retrain(g.mc).await?;
                    return Ok(Outcome::Retry);
                }
                leaf.pairs.insert(i, new_slot.expect("a value for a write"));
                let right = leaf.pairs.split_off(leaf.pairs.len() / 2);
                let mut fresh = Leaf::empty(right[0].key, leaf.high);
                fresh.pairs = right;
                leaf.high = fresh.low;
                let fresh_id = LeafId { region, leaf: n };
                let fresh_entry = Entry::new(region, n)
                    .with_syn(g.links[x].entry.syn)
                    .encode();
                writes.push(Write::Leaf(fresh_id, fresh, 1));
                writes.push(Write::Slt(s, fresh_entry));
                if x == 0 {
                    final_lt = Entry::decode(g.lt)
                        .expect("live")
                        .with_syn(s as u8)
                        .encode();
                    writes.push(Write::LtLocked(final_lt));
                } else {
                    let w = g.links[x].entry.with_syn(s as u8).encode();
                    writes.push(Write::Slt(g.links[x].slot, w));
                }
                writes.push(Write::Leaf(id, leaf.clone(), leaf.version + 1));
                bump(&sh.stats.splits);
                let threshold = sh.cfg.retrain_threshold as usize;
                self.finish(g, writes, final_lt).await?;
                if s == threshold {
                    self.enqueue(g.mc.m, false).await?;
                }
                return Ok(Outcome::Done(result));
            }
        }
        self.finish(g, writes, final_lt).await?;
        Ok(Outcome::Done(result))
    }

    /// ③ Writes everything and releases the lock in one doorbell batch, or
    /// keeps it for a local waiter.
    async fn finish(&self, g: &Group<'_>, writes: Vec<Write>, final_lt: u64) -> Result<()> {
        let sh = &self.sh;
        let gk = (g.mc.m, g.j);
        // Hand the lock over locally only while the model is ACTIVE: once
        // the memory node wants it (retraining, bulk load), release it.
        let keep = g.state == ModelState::Active as u64 && sh.locks.hand_over_wanted(gk);
        let lt_addr = self.lt_addr(g.mc, g.j)?;
        let mut b = self.ep.batch();
        let mut slt_updates = Vec::new();
        for w in &writes {
            match w {
                Write::Raw(addr, bytes) => {
                    b.write(*addr, bytes.clone());
                }
                Write::Leaf(id, leaf, version) => {
                    push_leaf_write(&mut b, &sh.remote, &sh.cfg, *id, leaf, *version)?;
                }
                Write::Slt(s, w) => {
                    b.write(self.slt_addr(g.mc, *s)?, w.to_le_bytes().to_vec());
                    slt_updates.push((*s, *w));
                }
                Write::LtLocked(w) => {
                    b.write(lt_addr, (w | LOCK_BIT).to_le_bytes().to_vec());
                }
            }
        }
        if !keep {
            b.write(lt_addr, final_lt.to_le_bytes().to_vec());
        }
        b.run().await?;
        for (s, w) in slt_updates {
            g.mc.set_slt(s, w);
        }
        g.mc.set_lt(g.j, final_lt);
        sh.locks.release(gk, keep.then_some(final_lt));
        g.released.set(true);
        Ok(())
    }

    /// The model's SLT is full: make sure it is queued (urgently), then wait
    /// until the memory node has replaced it.
    async fn wait_for_retrain(&self, mc: &ModelCache) -> Result<()> {
        let sh = &self.sh;
        bump(&sh.stats.slt_full_waits);
        if self.ep.cas(self.rec(mc.m, W_URGENT)?, 0, 1).await? == 0 {
            self.enqueue(mc.m, true).await?;
        }
        let mut waited = 0u64;
        loop {
            let st = word(&self.ep.read(self.rec(mc.m, W_STATE)?, 8).await?);
            if st == ModelState::Retired as u64 {
                mc.retired.store(true, Ordering::Release);
                return Ok(());
            }
            if st == ModelState::Failed as u64 {
                return Err(KvError::Exhausted(
                    "a model's synonym leaf table is full and retraining it failed (raise rolex.model_region_mb or rolex.max_models)".into(),
                ));
            }
            waited += 1;
            sleep(Duration::from_micros((50 * waited).min(1000))).await;
        }
    }

    /// Puts a model into the memory node's circular queue: FAA on the tail,
    /// then CAS the slot from empty (the memory node empties slots as it
    /// takes them).
    async fn enqueue(&self, m: ModelRef, urgent: bool) -> Result<()> {
        let sh = &self.sh;
        bump(if urgent {
            &sh.stats.urgent_enqueued
        } else {
            &sh.stats.enqueued
        });
        let tail = if urgent { W_UTAIL } else { W_QTAIL };
        let t = self.ep.faa(sh.remote.meta_word(tail), 1).await?;
        let slot = sh
            .remote
            .meta_word(sh.remote.meta_layout.queue_slot(urgent, t));
        let mut waited = 0;
        while self.ep.cas(slot, 0, m.encode()).await? != 0 {
            waited += 1;
            sleep(Duration::from_micros((20 * waited).min(1000))).await;
        }
        Ok(())
    }

    async fn scan_inner(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        let sh = &self.sh;
        let layout = sh.cfg.leaf;
        let slots = layout.slots();
        let mut out: Vec<Slot> = Vec::new();
        let mut cursor = start;
        let mut attempt = 0u32;
        while out.len() < n {
            attempt += 1;
            if attempt > MAX_ATTEMPTS {
                return Err(corrupt(format!("scan from {start:#x} did not converge")));
            }
            let mc = sh.model_for(&self.ep, cursor, false).await?;
            let nl = mc.p.leaves as usize;
            let (lo, hi) = mc.p.leaf_range(cursor, slots);
            let hi = (hi + (n - out.len()).div_ceil(slots)).min(nl - 1);
            let Some(chains) = mc.chains(lo, hi) else {
                sh.refresh_tables(&self.ep, &mc).await?;
                backoff(attempt).await;
                continue;
            };
            let ids: Vec<LeafId> = chains.iter().flatten().map(|l| l.entry.into()).collect();
            let mut b = self.ep.batch();
            for id in &ids {
                b.read(self.leaf_addr(*id)?, layout.bytes());
            }
            let si = b.read(self.rec(mc.m, W_STATE)?, 16);
            let mut res = b.run().await?;
            sh.stats.leaves_read[SCAN].fetch_add(ids.len() as u64, Ordering::Relaxed);
            self.observe(&mc, &res.take_read(si));
            let mut leaves = Vec::with_capacity(ids.len());
            let mut torn = false;
            for i in 0..ids.len() {
                match Leaf::decode(&layout, &res.take_read(i)) {
                    Ok(l) if !l.dead => leaves.push(l),
                    Ok(_) => {}
                    Err(LeafError::Torn) => torn = true,
                    Err(LeafError::Corrupt(e)) => return Err(corrupt(e)),
                }
            }
            let Some(mut at) = leaves.iter().position(|l| l.covers(cursor)) else {
                if torn {
                    bump(&sh.stats.torn_leaves);
                } else {
                    self.refresh_after_miss(&mc).await?;
                }
                backoff(attempt).await;
                continue;
            };
            // Follow the fences from leaf to leaf as far as the batch reached.
            loop {
                let l = &leaves[at];
                for s in &l.pairs {
                    if s.key >= cursor && out.len() < n {
                        out.push(*s);
                    }
                }
                cursor = l.high;
                if out.len() >= n || cursor == u64::MAX {
                    break;
                }
                match leaves.iter().position(|x| x.low == cursor) {
                    Some(next) => at = next,
                    None => break,
                }
            }
            if cursor == u64::MAX {
                break;
            }
        }
        // Values out of line, in one batch.
        let mut b = self.ep.batch();
        let mut reads = Vec::new();
        for (i, s) in out.iter().enumerate() {
            if s.out_of_line {
                let p = FatPtr::decode(s.word);
                if p.len > 0 {
                    let addr = sh
                        .remote
                        .value(p.region, p.offset)
                        .ok_or_else(|| corrupt("value pointer outside its region"))?;
                    reads.push((i, b.read(addr, block_bytes(p.len as usize)), p));
                }
            }
        }
        let mut res = b.run().await?;
        let mut values: Vec<Option<Vec<u8>>> = vec![None; out.len()];
        for (i, r, p) in reads {
            values[i] = Some(decode_block(out[i].key, p, &res.take_read(r)).map_err(corrupt)?);
        }
        Ok(out
            .iter()
            .zip(values)
            .map(|(s, v)| {
                let v = v.unwrap_or_else(|| {
                    if s.out_of_line {
                        Vec::new()
                    } else {
                        s.word.to_le_bytes().to_vec()
                    }
                });
                (s.key, v)
            })
            .collect())
    }
}

/// A write of the final batch.
enum Write {
    Raw(RemoteAddr, Vec<u8>),
    Leaf(LeafId, Leaf, u64),
    Slt(usize, u64),
    /// The LT entry with a new link, still locked.
    LtLocked(u64),
}

/// Whether live leaves tile `[low, high)` in order.
fn tiles(leaves: &[Leaf], low: Key, high: Key) -> bool {
    let mut at = low;
    for l in leaves {
        if l.dead || l.low != at {
            return false;
        }
        at = l.high;
    }
    at == high
}

impl KvClient for RolexClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        bump(&self.sh.stats.ops[GET]);
        self.get_inner(key).await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        bump(&self.sh.stats.ops[1]);
        self.write_inner(Kind::Insert, key, Some(value)).await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        bump(&self.sh.stats.ops[2]);
        self.write_inner(Kind::Update, key, Some(value)).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        bump(&self.sh.stats.ops[3]);
        self.write_inner(Kind::Upsert, key, Some(value)).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        bump(&self.sh.stats.ops[4]);
        self.write_inner(Kind::Delete, key, None).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        bump(&self.sh.stats.ops[SCAN]);
        self.scan_inner(start, n).await
    }
}

#[cfg(test)]
mod future_size {
    use super::*;

    fn size_of_future<'a, F>(_: impl FnOnce(&'a RolexClient) -> F) -> usize {
        std::mem::size_of::<F>()
    }

    /// The API boxes every operation's future; a GET's must stay small
    /// enough for the allocator's small-object path (mimalloc: 1 KiB), which
    /// is why its rare paths (fetching a model, refreshing tables) are boxed
    /// and its batch is built in a block. Before that it was 1,424 bytes.
    #[test]
    fn a_get_future_stays_under_one_kib() {
        let get = size_of_future(|c| c.get_inner(0));
        assert!(
            get <= 1024,
            "RolexClient::get_inner's future is {get} bytes"
        );
    }
}
