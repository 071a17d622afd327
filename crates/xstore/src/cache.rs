//! XCACHE (§5.1): what a compute process caches of each memory node's
//! learned model, and how it fetches it one-sided.
//!
//! One [`PartClient`] per memory node (range partition, §5.5) holds the
//! generation it knows ([`GenCache`]: header and top model) and, by cache
//! mode, its sub-models: with their TTs (full), records only (models-only),
//! or nothing (top-only). Entries are filled on demand by one-sided reads
//! (header, record, TT block) or by fallback replies, and replaced when a
//! newer version arrives. TT entries are atomics so that a thread can
//! invalidate an entry (Fig. 7, line 18) that other threads share.

use crate::config::CacheMode;
use crate::layout::{
    HEADER_BYTES, HEADER_OFFSET, ModelHeader, RECORD_BYTES, SubRecord, TT_VALID_BIT, TtBlock,
};
use crate::stats::ClientStats;
use crate::wire::{ModelUpdate, SubUpdate};
use dmkv_api::{KvError, Result};
use dmkv_transport::{Endpoint, NodeId, RemoteRegion, ServiceId};
use dmkv_xtree::Geometry;
use parking_lot::RwLock;
use std::sync::Arc;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering};

/// Reads of model bytes retried (torn, reused, superseded) before the
/// lookup gives up and falls back.
pub const MODEL_RETRIES: usize = 8;

/// A cached sub-model.
pub struct SubCache {
    pub record: SubRecord,
    /// Its TT (full mode); empty otherwise.
    pub tt: Vec<AtomicU64>,
}

impl SubCache {
    fn bytes(&self) -> i64 {
        // What the client keeps: the record's fields and 8 bytes per entry.
        (RECORD_BYTES + 8 * self.tt.len()) as i64
    }

    /// Entry `n` as cached.
    pub fn entry(&self, n: u32) -> u64 {
        self.tt[n as usize].load(Ordering::Acquire)
    }

    /// Clears the valid bit of entry `n` if it still is `seen`.
    pub fn invalidate(&self, n: u32, seen: u64) {
        let _ = self.tt[n as usize].compare_exchange(
            seen,
            seen & !TT_VALID_BIT,
            Ordering::AcqRel,
            Ordering::Acquire,
        );
    }
}

/// A generation of one memory node's model, as this process knows it.
pub struct GenCache {
    pub header: ModelHeader,
    pub subs: Vec<RwLock<Option<Arc<SubCache>>>>,
}

impl GenCache {
    fn new(header: ModelHeader, mode: CacheMode) -> GenCache {
        let n = if mode == CacheMode::TopOnly {
            0
        } else {
            header.submodels as usize
        };
        GenCache {
            header,
            subs: (0..n).map(|_| RwLock::new(None)).collect(),
        }
    }

    pub fn sub(&self, i: u32) -> Option<Arc<SubCache>> {
        self.subs.get(i as usize)?.read().clone()
    }
}

/// One memory node (partition) as a client sees it.
pub struct PartClient {
    pub index: usize,
    pub node: NodeId,
    pub service: ServiceId,
    pub lo: u64,
    pub hi: u64,
    pub nodes: RemoteRegion,
    pub values: RemoteRegion,
    pub models: RemoteRegion,
    pub geo: Geometry,
    pub mode: CacheMode,
    known: RwLock<Option<Arc<GenCache>>>,
    /// Bytes cached, shared by all partitions of the engine.
    cache_bytes: Arc<AtomicI64>,
    stats: Arc<ClientStats>,
}

impl PartClient {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        index: usize,
        node: NodeId,
        service: ServiceId,
        (lo, hi): (u64, u64),
        nodes: RemoteRegion,
        values: RemoteRegion,
        models: RemoteRegion,
        geo: Geometry,
        mode: CacheMode,
        cache_bytes: Arc<AtomicI64>,
        stats: Arc<ClientStats>,
    ) -> PartClient {
        PartClient {
            index,
            node,
            service,
            lo,
            hi,
            nodes,
            values,
            models,
            geo,
            mode,
            known: RwLock::new(None),
            cache_bytes,
            stats,
        }
    }

    /// The generation this process knows, if any.
    pub fn cached_gen(&self) -> Option<Arc<GenCache>> {
        self.known.read().clone()
    }

    fn account(&self, delta: i64) {
        self.cache_bytes.fetch_add(delta, Ordering::Relaxed);
    }

    /// Installs `header` if it is newer than what is cached; returns the
    /// generation now cached.
    pub fn install_header(&self, header: ModelHeader) -> Arc<GenCache> {
        let mut g = self.known.write();
        if let Some(cur) = &*g
            && cur.header.generation >= header.generation
        {
            return cur.clone();
        }
        let new = Arc::new(GenCache::new(header, self.mode));
        // The top model and header are what every mode keeps.
        let mut delta = HEADER_BYTES as i64;
        if let Some(old) = g.replace(new.clone()) {
            delta -= HEADER_BYTES as i64;
            for s in &old.subs {
                if let Some(s) = &*s.read() {
                    delta -= s.bytes();
                }
            }
        }
        self.account(delta);
        ClientStats::bump(&self.stats.generations_installed);
        new
    }

    /// Caches `u` for generation `g` unless an entry with the same tag is
    /// already there (which keeps its invalidated entries). Returns what is
    /// cached afterwards.
    pub fn install_sub(&self, g: &GenCache, u: SubUpdate) -> Option<Arc<SubCache>> {
        let slot = g.subs.get(u.record.index as usize)?;
        if u.record.generation != g.header.generation {
            return None;
        }
        let mut s = slot.write();
        if let Some(cur) = &*s
            && cur.record.tag == u.record.tag
        {
            return Some(cur.clone());
        }
        let tt: Vec<AtomicU64> = match (self.mode, u.entries) {
            (CacheMode::Full, Some(e)) => e.into_iter().map(AtomicU64::new).collect(),
            (CacheMode::Full, None) => return s.clone(),
            _ => Vec::new(),
        };
        let new = Arc::new(SubCache {
            record: u.record,
            tt,
        });
        let mut delta = new.bytes();
        if let Some(old) = s.replace(new.clone()) {
            delta -= old.bytes();
        }
        self.account(delta);
        ClientStats::bump(&self.stats.submodels_installed);
        Some(new)
    }

    /// Drops sub-model `i` of `g` from the cache (its TT block was reused:
    /// the record is stale).
    pub fn evict_sub(&self, g: &GenCache, i: u32) {
        if let Some(slot) = g.subs.get(i as usize)
            && let Some(old) = slot.write().take()
        {
            self.account(-old.bytes());
        }
    }

    /// Applies the model part of a fallback reply.
    pub fn install_update(&self, update: ModelUpdate) {
        match update {
            ModelUpdate::None => {}
            ModelUpdate::Sub(u) => {
                if let Some(g) = self.cached_gen() {
                    self.install_sub(&g, u);
                }
            }
            ModelUpdate::Generation(h, u) => {
                if h.lo != self.lo || h.hi != self.hi {
                    return;
                }
                let g = self.install_header(h);
                if let Some(u) = u {
                    self.install_sub(&g, u);
                }
            }
        }
    }

    // ---- one-sided fetches ------------------------------------------------

    /// Reads the header one-sided and installs it.
    pub async fn fetch_header(&self, ep: &Endpoint) -> Result<Arc<GenCache>> {
        for _ in 0..MODEL_RETRIES {
            ClientStats::bump(&self.stats.header_reads);
            let b = ep.read(self.models.at(HEADER_OFFSET), HEADER_BYTES).await?;
            if let Ok(h) = ModelHeader::decode(&b) {
                if h.lo != self.lo || h.hi != self.hi || h.slots as usize != self.geo.slots() {
                    return Err(KvError::Corrupt(format!(
                        "memory node {} serves keys [{:#x}, {:#x}] with N = {}, not partition {} [{:#x}, {:#x}] with N = {}",
                        self.node,
                        h.lo,
                        h.hi,
                        h.slots,
                        self.index,
                        self.lo,
                        self.hi,
                        self.geo.slots()
                    )));
                }
                return Ok(self.install_header(h));
            }
        }
        Err(KvError::Corrupt(format!(
            "the model header of node {} never read consistently",
            self.node
        )))
    }

    /// The generation to use, fetched if none is cached.
    pub async fn generation(&self, ep: &Endpoint) -> Result<Arc<GenCache>> {
        match self.cached_gen() {
            Some(g) => Ok(g),
            None => self.fetch_header(ep).await,
        }
    }

    /// Reads sub-model `i`'s record of `g` one-sided. `None` if it is not
    /// `g`'s (the table was freed after a newer generation committed).
    pub async fn read_record(
        &self,
        ep: &Endpoint,
        g: &GenCache,
        i: u32,
    ) -> Result<Option<SubRecord>> {
        for _ in 0..MODEL_RETRIES {
            ClientStats::bump(&self.stats.record_reads);
            let b = ep
                .read(self.models.at(g.header.record_offset(i)), RECORD_BYTES)
                .await?;
            match SubRecord::decode(&b) {
                Ok(r) if r.generation == g.header.generation && r.index == i => return Ok(Some(r)),
                // Another generation's bytes, or garbage where a freed
                // table was reused.
                Ok(_) => return Ok(None),
                Err(_) => continue,
            }
        }
        Ok(None)
    }

    /// Reads entries `first..=last` of `r`'s TT one-sided. `None` if the
    /// block no longer holds `r`'s TT (retrained since).
    pub async fn read_tt(
        &self,
        ep: &Endpoint,
        r: &SubRecord,
        first: u32,
        last: u32,
    ) -> Result<Option<Vec<u64>>> {
        let blk = TtBlock { len: r.tt_len };
        let (off, len) = blk.span(first, last);
        ClientStats::bump(&self.stats.tt_reads);
        let b = ep
            .read(self.models.at(r.tt_offset + off as u64), len)
            .await?;
        Ok(blk.parse_span(r.tag, first, last, &b).ok())
    }

    /// Sub-model `i` of `g` from the cache, or fetched one-sided (record,
    /// then the whole TT in full mode) and cached. `None` if `g` is no
    /// longer what the node publishes.
    pub async fn sub(&self, ep: &Endpoint, g: &GenCache, i: u32) -> Result<Option<Arc<SubCache>>> {
        if let Some(s) = g.sub(i) {
            return Ok(Some(s));
        }
        for _ in 0..MODEL_RETRIES {
            let Some(r) = self.read_record(ep, g, i).await? else {
                return Ok(None);
            };
            let entries = match self.mode {
                CacheMode::Full if r.tt_len > 0 => {
                    match self.read_tt(ep, &r, 0, r.tt_len - 1).await? {
                        Some(e) => Some(e),
                        None => continue,
                    }
                }
                CacheMode::Full => Some(Vec::new()),
                _ => None,
            };
            let u = SubUpdate { record: r, entries };
            if self.mode == CacheMode::TopOnly {
                return Ok(Some(Arc::new(SubCache {
                    record: u.record,
                    tt: Vec::new(),
                })));
            }
            return Ok(self.install_sub(g, u));
        }
        Ok(None)
    }

    /// Fills the cache for the current generation (at client start): every
    /// record (models-only) or every record and TT (full), in large reads
    /// and batches. Sub-models that change meanwhile are skipped; they are
    /// fetched on demand later.
    pub async fn prefetch(&self, ep: &Endpoint, batch: usize) -> Result<()> {
        let g = self.fetch_header(ep).await?;
        if self.mode == CacheMode::TopOnly {
            return Ok(());
        }
        let m = g.header.submodels;
        const CHUNK: u32 = 1024;
        let mut start = 0;
        while start < m {
            let n = CHUNK.min(m - start);
            let b = ep
                .read(
                    self.models.at(g.header.record_offset(start)),
                    n as usize * RECORD_BYTES,
                )
                .await?;
            let mut records = Vec::new();
            for j in 0..n {
                let at = j as usize * RECORD_BYTES;
                if let Ok(r) = SubRecord::decode(&b[at..at + RECORD_BYTES])
                    && r.generation == g.header.generation
                    && r.index == start + j
                    && g.sub(r.index).is_none()
                {
                    records.push(r);
                }
            }
            if self.mode == CacheMode::ModelsOnly {
                for r in records {
                    self.install_sub(
                        &g,
                        SubUpdate {
                            record: r,
                            entries: None,
                        },
                    );
                }
            } else {
                for chunk in records.chunks(batch.max(1)) {
                    let mut bt = ep.batch();
                    let mut idx = Vec::new();
                    for r in chunk {
                        if r.tt_len == 0 {
                            continue;
                        }
                        let blk = TtBlock { len: r.tt_len };
                        let (off, len) = blk.span(0, r.tt_len - 1);
                        idx.push((bt.read(self.models.at(r.tt_offset + off as u64), len), *r));
                    }
                    let mut res = bt.run().await?;
                    for (i, r) in idx {
                        let bytes = res.take_read(i);
                        let blk = TtBlock { len: r.tt_len };
                        if let Ok(e) = blk.parse_span(r.tag, 0, r.tt_len - 1, &bytes) {
                            self.install_sub(
                                &g,
                                SubUpdate {
                                    record: r,
                                    entries: Some(e),
                                },
                            );
                        }
                    }
                    for r in chunk.iter().filter(|r| r.tt_len == 0) {
                        self.install_sub(
                            &g,
                            SubUpdate {
                                record: *r,
                                entries: Some(Vec::new()),
                            },
                        );
                    }
                }
            }
            start += n;
        }
        Ok(())
    }
}
