//! Bulk loading: the compute node stages pairs with the admin service and
//! commits; memory node 0 merges them with everything stored, trains models
//! over the sorted keys (OptimalPLR, §3.2), packs them δ per leaf into
//! leaves (dead ones from the free list first, then fresh ones from the
//! region), and publishes the new directory. Old leaves are marked dead
//! before the directory switches, so a compute node with a stale cache can
//! never read a leaf that no longer receives writes; reused leaves are
//! written only after that, and the old leaves go on the free list after
//! the publication (docs/rolex.md, invariant 14).

use super::{FreeLeaf, Server, push_leaf_write};
use crate::io::{LeafId, chain, corrupt, read_leaves, read_params};
use crate::layout::entry::{Entry, LOCK_BIT, RETIRED};
use crate::layout::leaf::{Leaf, Slot, words_of};
use crate::layout::meta::ModelRef;
use crate::layout::record::{ModelParams, ModelState, RecordLayout, W_SLT, W_STATE, encode_record};
use crate::layout::value::{FatPtr, block_bytes, encode_block};
use crate::remote::{H_ALLOC, H_CAPACITY, Remote};
use crate::train::{KeySegment, cap_segments, train_keys};
use dmkv_api::{KvError, Result};
use dmkv_transport::exec::yield_now;
use dmkv_transport::time::Instant;
use dmkv_transport::{Batch, Endpoint};
use std::sync::atomic::Ordering;

/// Verbs per doorbell batch on the bulk path.
const BATCH: usize = 256;

enum Val {
    Stored(Slot),
    New(Vec<u8>),
}

/// What [`Server::rebuild`] made: the new models' low keys and records
/// (written), and the reused leaves' images with their versions, which the
/// caller writes only once the leaves they replace are dead.
struct Rebuilt {
    lows: Vec<u64>,
    refs: Vec<ModelRef>,
    reborn: Vec<(LeafId, Leaf, u64)>,
}

/// Posts verbs in batches of [`BATCH`].
struct Poster<'a> {
    ep: &'a Endpoint,
    batch: Option<Batch<'a>>,
}

impl<'a> Poster<'a> {
    fn new(ep: &'a Endpoint) -> Self {
        Poster { ep, batch: None }
    }
    async fn with(&mut self, f: impl FnOnce(&mut Batch<'a>) -> Result<()>) -> Result<()> {
        let b = self.batch.get_or_insert_with(|| self.ep.batch());
        f(b)?;
        if b.len() >= BATCH {
            self.flush().await?;
        }
        Ok(())
    }
    async fn flush(&mut self) -> Result<()> {
        if let Some(b) = self.batch.take() {
            b.run().await?;
        }
        Ok(())
    }
}

impl Server {
    /// CASes every LT entry of `m` to RETIRED (waiting for lock holders);
    /// returns the last words.
    pub(crate) async fn freeze(
        &self,
        ep: &Endpoint,
        r: &Remote,
        m: ModelRef,
        rl: &RecordLayout,
        n: usize,
    ) -> Result<Vec<u64>> {
        let addr = |j: usize| {
            r.record(m, rl.lt_word(j))
                .ok_or_else(|| corrupt("record outside its region"))
        };
        // Writers stop handing locks over locally on a model that is not
        // ACTIVE, so the CASes below find them free soon.
        let state = r
            .record(m, W_STATE)
            .ok_or_else(|| corrupt("record outside its region"))?;
        ep.cas(
            state,
            ModelState::Active as u64,
            ModelState::Training as u64,
        )
        .await?;
        let words = words_of(&ep.read(addr(0)?, n * 8).await?);
        let mut finals = vec![None; n];
        let mut b = ep.batch();
        let mut tried = Vec::new();
        for (j, w) in words.iter().enumerate() {
            if *w != RETIRED && w & LOCK_BIT == 0 {
                b.cas(addr(j)?, *w, RETIRED);
                tried.push(j);
            }
        }
        let res = b.run().await?;
        for (i, j) in tried.iter().enumerate() {
            if res.word(i) == words[*j] {
                finals[*j] = Some(words[*j]);
            }
        }
        for (j, f) in finals.iter_mut().enumerate() {
            let mut w = words[j];
            while f.is_none() {
                if w == RETIRED {
                    return Err(corrupt("model retired by somebody else"));
                }
                let expected = w & !LOCK_BIT;
                let got = ep.cas(addr(j)?, expected, RETIRED).await?;
                if got == expected {
                    *f = Some(expected);
                } else {
                    w = got;
                    std::hint::spin_loop();
                    yield_now().await;
                }
            }
        }
        Ok(finals.into_iter().map(|f| f.expect("frozen")).collect())
    }

    pub(crate) async fn bulk_load(
        &self,
        ep: &Endpoint,
        mut pairs: Vec<(u64, Vec<u8>)>,
    ) -> Result<()> {
        let _publishing = self.publishing().await;
        let r = self.remote(ep).await?;
        let cfg = &self.cfg;
        // The new pairs, sorted, the last of equal keys winning.
        pairs.sort_by_key(|p| p.0);
        let mut fresh: Vec<(u64, Vec<u8>)> = Vec::with_capacity(pairs.len());
        for (k, v) in pairs {
            match fresh.last_mut() {
                Some(last) if last.0 == k => last.1 = v,
                _ => fresh.push((k, v)),
            }
        }
        // Freeze every model and collect what is stored.
        if fresh.is_empty() {
            return Ok(());
        }
        // Only the models whose ranges meet the new keys' range are rebuilt
        // (the harness loads ascending chunks: then that is about one model
        // per call, and a whole load costs O(keys)).
        let (first, last, range_low, range_high, refs) = {
            let st = self.dir.lock();
            let d = crate::layout::meta::Directory {
                version: st.version,
                lows: st.lows.clone(),
                refs: st.refs.clone(),
                upper: crate::upper::UpperIndex::default(),
            };
            let at = |k: u64| d.lows.partition_point(|l| *l <= k) - 1;
            let (a, b) = (at(fresh[0].0), at(fresh[fresh.len() - 1].0));
            let high = st.lows.get(b + 1).copied().unwrap_or(u64::MAX);
            (a, b, st.lows[a], high, st.refs[a..=b].to_vec())
        };
        let mut frozen: Vec<(ModelRef, RecordLayout, Vec<u64>)> = Vec::new();
        let mut old: Vec<(LeafId, Leaf)> = Vec::new();
        let res = async {
            for &m in &refs {
                let p = read_params(ep, &r, m, cfg.slt_slots).await?;
                let rl = RecordLayout {
                    slt: p.slt_slots as usize,
                };
                let finals = self.freeze(ep, &r, m, &rl, p.leaves as usize).await?;
                frozen.push((m, rl, finals.clone()));
                let slt_addr = r
                    .record(m, W_SLT)
                    .ok_or_else(|| corrupt("record outside its region"))?;
                let slt = words_of(&ep.read(slt_addr, rl.slt * 8).await?);
                let mut ids = Vec::new();
                for f in &finals {
                    ids.extend(
                        chain(*f, &slt)
                            .map_err(corrupt)?
                            .into_iter()
                            .map(|l| LeafId::from(l.entry)),
                    );
                }
                let leaves = read_leaves(ep, &r, &cfg.leaf, &ids).await?;
                old.extend(ids.into_iter().zip(leaves));
            }
            self.rebuild(ep, &r, &old, fresh, range_low, range_high, first)
                .await
        }
        .await;
        let Rebuilt {
            lows,
            refs: new_refs,
            reborn,
        } = match res {
            Ok(d) => d,
            Err(e) => {
                // Put the old models back in service.
                for (m, rl, finals) in &frozen {
                    for (j, f) in finals.iter().enumerate() {
                        if let Some(a) = r.record(*m, rl.lt_word(j)) {
                            ep.write(a, &f.to_le_bytes()).await?;
                        }
                    }
                }
                return Err(e);
            }
        };
        #[cfg(test)]
        if let Some(hook) = test_hooks::BEFORE_DEAD_MARKS
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
        {
            hook(&self.meta, &reborn.iter().map(|r| r.0).collect::<Vec<_>>());
        }
        // Old leaves die before the new directory is visible.
        let mut post = Poster::new(ep);
        for (id, leaf) in &old {
            let mut dead = leaf.clone();
            dead.dead = true;
            post.with(|b| push_leaf_write(b, &r, cfg, *id, &dead, leaf.version + 1))
                .await?;
        }
        post.flush().await?;
        // Reused leaves come back to life only now: a reader with a stale
        // cache may still name one, and must not find it live beside the
        // leaves it replaces (invariant 14).
        for (id, leaf, version) in &reborn {
            post.with(|b| push_leaf_write(b, &r, cfg, *id, leaf, *version))
                .await?;
        }
        post.flush().await?;
        {
            let mut st = self.dir.lock();
            // The directory may not have changed meanwhile: retrains and
            // loads publish one at a time.
            let mut all_lows = st.lows[..first].to_vec();
            all_lows.extend(lows);
            all_lows.extend_from_slice(&st.lows[last + 1..]);
            let mut all_refs = st.refs[..first].to_vec();
            all_refs.extend(new_refs);
            all_refs.extend_from_slice(&st.refs[last + 1..]);
            self.publish(&mut st, all_lows, all_refs)
                .map_err(KvError::Exhausted)?;
        }
        // Dead, and named by no published model: free (invariant 14). Their
        // next image is one version above the dead one.
        {
            let mut free = self.free.lock();
            for (id, leaf) in &old {
                free.give_leaf(*id, leaf.version + 2);
            }
        }
        self.stats
            .leaves_freed
            .fetch_add(old.len() as u64, Ordering::Relaxed);
        self.note_model_usage(ep, &r).await?;
        for (m, _, _) in &frozen {
            if let Some(a) = r.record(*m, W_STATE) {
                ep.write(a, &(ModelState::Retired as u64).to_le_bytes())
                    .await?;
            }
        }
        Ok(())
    }

    /// Writes the merged pairs of `[range_low, range_high)` into new leaves
    /// and models, which replace models `first_model..`; the caller publishes.
    #[allow(clippy::too_many_arguments)]
    async fn rebuild(
        &self,
        ep: &Endpoint,
        r: &Remote,
        old: &[(LeafId, Leaf)],
        fresh: Vec<(u64, Vec<u8>)>,
        range_low: u64,
        range_high: u64,
        first_model: usize,
    ) -> Result<Rebuilt> {
        let cfg = &self.cfg;
        let slots = cfg.slots();
        let t0 = Instant::now();
        // Merge (stored pairs are in key order: chains are).
        let stored = old.iter().flat_map(|(_, l)| l.pairs.iter().copied());
        let mut merged: Vec<(u64, Val)> = Vec::with_capacity(fresh.len() + old.len() * slots);
        let mut fresh = fresh.into_iter().peekable();
        for s in stored {
            while fresh.peek().is_some_and(|f| f.0 < s.key) {
                let (k, v) = fresh.next().expect("peeked");
                merged.push((k, Val::New(v)));
            }
            if fresh.peek().is_some_and(|f| f.0 == s.key) {
                let (k, v) = fresh.next().expect("peeked");
                merged.push((k, Val::New(v)));
            } else {
                merged.push((s.key, Val::Stored(s)));
            }
        }
        merged.extend(fresh.map(|(k, v)| (k, Val::New(v))));
        if merged.windows(2).any(|w| w[0].0 >= w[1].0) {
            return Err(corrupt("stored leaves are not in key order"));
        }
        let keys: Vec<u64> = merged.iter().map(|p| p.0).collect();
        let segs = cap_segments(train_keys(&keys, cfg.epsilon), &keys, cfg.load_model_keys);
        // Models round robin over the leaf regions.
        let nodes = r.nodes();
        let models = segs.len().max(1);
        if models + self.dir.lock().refs.len() > cfg.max_models {
            return Err(KvError::Exhausted(format!(
                "{models} models exceed the directory's {} (raise rolex.max_models)",
                cfg.max_models
            )));
        }
        let region_of = |i: usize| ((first_model + i) % nodes) as u8;
        let mut leaves_needed = vec![0u64; nodes];
        let mut value_bytes = vec![0u64; nodes];
        for i in 0..models {
            let (s, e) = segs.get(i).map_or((0, 0), |s| (s.start, s.end));
            let g = region_of(i) as usize;
            leaves_needed[g] += ((e - s).div_ceil(slots)).max(1) as u64;
            for (_, v) in &merged[s..e] {
                if let Val::New(v) = v
                    && v.len() != 8
                    && !v.is_empty()
                {
                    value_bytes[g] += block_bytes(v.len()) as u64;
                }
            }
        }
        // Dead leaves first (invariant 14), then the region's bump counter.
        let mut reuse: Vec<Vec<FreeLeaf>> = {
            let mut free = self.free.lock();
            (0..nodes)
                .map(|g| free.take(g as u8, leaves_needed[g] as usize))
                .collect()
        };
        let mut reborn = Vec::new();
        let res = self
            .rebuild_into(
                ep,
                r,
                merged,
                &keys,
                &segs,
                (range_low, range_high),
                first_model,
                (&leaves_needed, &value_bytes),
                &mut reuse,
                &mut reborn,
            )
            .await;
        let (lows, refs) = match res {
            Ok(made) => made,
            Err(e) => {
                // The free leaves go back: none was written (reborn leaves are
                // written by the caller, after this returns).
                let mut free = self.free.lock();
                for (g, v) in reuse.into_iter().enumerate() {
                    free.give(g as u8, v);
                }
                for (id, _, version) in reborn {
                    free.give_leaf(id, version);
                }
                return Err(e);
            }
        };
        self.stats
            .leaves_reused
            .fetch_add(reborn.len() as u64, Ordering::Relaxed);
        self.stats.loads.fetch_add(1, Ordering::Relaxed);
        self.stats
            .load_keys
            .fetch_add(keys.len() as u64, Ordering::Relaxed);
        self.stats
            .load_train_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(Rebuilt { lows, refs, reborn })
    }

    /// The rest of [`Server::rebuild`]: allocates the leaves not in `reuse`
    /// (`needed` leaves and value bytes per region) and the value space,
    /// writes the value blocks, the fresh leaves and the records, and moves
    /// each free leaf it uses from `reuse` to `reborn` with its image,
    /// unwritten. Returns the new models' low keys and records.
    #[allow(clippy::too_many_arguments)]
    async fn rebuild_into(
        &self,
        ep: &Endpoint,
        r: &Remote,
        merged: Vec<(u64, Val)>,
        keys: &[u64],
        segs: &[KeySegment],
        (range_low, range_high): (u64, u64),
        first_model: usize,
        (leaves_needed, value_bytes): (&[u64], &[u64]),
        reuse: &mut [Vec<FreeLeaf>],
        reborn: &mut Vec<(LeafId, Leaf, u64)>,
    ) -> Result<(Vec<u64>, Vec<ModelRef>)> {
        let cfg = &self.cfg;
        let slots = cfg.slots();
        let nodes = r.nodes();
        let models = segs.len().max(1);
        let region_of = |i: usize| ((first_model + i) % nodes) as u8;
        let mut leaf_next = vec![0u64; nodes];
        let mut value_next = vec![0u64; nodes];
        for g in 0..nodes {
            let la = r.leaves[g].at(H_ALLOC);
            let lc = u64::from_le_bytes(
                ep.read(r.leaves[g].at(H_CAPACITY), 8)
                    .await?
                    .try_into()
                    .expect("8"),
            );
            let from_region = leaves_needed[g] - reuse[g].len() as u64;
            if from_region > 0 {
                leaf_next[g] = ep.faa(la, from_region).await?;
                if leaf_next[g] + from_region > lc {
                    return Err(KvError::Exhausted(format!(
                        "leaf region of memory node {g} is full ({lc} leaves; raise rolex.leaves)"
                    )));
                }
            }
            let va = r.values[g].at(H_ALLOC);
            value_next[g] = ep.faa(va, value_bytes[g]).await?;
            if value_next[g] + value_bytes[g] > r.values[g].len.min(FatPtr::MAX_OFFSET) {
                return Err(KvError::Exhausted(format!(
                    "value region of memory node {g} is full (raise rolex.value_region_mb)"
                )));
            }
        }
        let mut post = Poster::new(ep);
        let mut lows = Vec::with_capacity(models);
        let mut records = Vec::with_capacity(models);
        for i in 0..models {
            let g = region_of(i);
            let (s, e, line, err) = match segs.get(i) {
                Some(sg) => (sg.start, sg.end, Some(sg.line), sg.err),
                None => (0, 0, None, 1),
            };
            let low = if i == 0 { range_low } else { keys[s] };
            let high = segs.get(i + 1).map_or(range_high, |n| keys[n.start]);
            let n = (e - s).div_ceil(slots).max(1);
            let mut lt = Vec::with_capacity(n);
            for j in 0..n {
                let chunk = &merged[(s + j * slots).min(e)..(s + (j + 1) * slots).min(e)];
                let leaf_low = if j == 0 { low } else { chunk[0].0 };
                let leaf_high = if j + 1 < n {
                    merged[s + (j + 1) * slots].0
                } else {
                    high
                };
                let mut leaf = Leaf::empty(leaf_low, leaf_high);
                for (k, v) in chunk {
                    let slot = match v {
                        Val::Stored(slot) => *slot,
                        Val::New(v) if v.len() == 8 => Slot {
                            key: *k,
                            word: u64::from_le_bytes(v[..].try_into().expect("8")),
                            out_of_line: false,
                        },
                        Val::New(v) if v.is_empty() => Slot {
                            key: *k,
                            word: FatPtr {
                                region: g,
                                offset: 0,
                                len: 0,
                            }
                            .encode(),
                            out_of_line: true,
                        },
                        Val::New(v) => {
                            let off = value_next[g as usize];
                            value_next[g as usize] += block_bytes(v.len()) as u64;
                            let addr = r.value(g, off).ok_or_else(|| corrupt("value offset"))?;
                            let block = encode_block(*k, v);
                            post.with(|b| {
                                b.write(addr, block);
                                Ok(())
                            })
                            .await?;
                            Slot {
                                key: *k,
                                word: FatPtr {
                                    region: g,
                                    offset: off,
                                    len: v.len() as u32,
                                }
                                .encode(),
                                out_of_line: true,
                            }
                        }
                    };
                    leaf.pairs.push(slot);
                }
                let id = match reuse[g as usize].pop() {
                    Some(f) => {
                        // Reborn only after the leaves it replaces are
                        // dead: the caller writes it (invariant 14).
                        let id = LeafId {
                            region: g,
                            leaf: f.leaf,
                        };
                        reborn.push((id, leaf, f.version));
                        id
                    }
                    None => {
                        let id = LeafId {
                            region: g,
                            leaf: leaf_next[g as usize],
                        };
                        leaf_next[g as usize] += 1;
                        post.with(|b| push_leaf_write(b, r, cfg, id, &leaf, 1))
                            .await?;
                        id
                    }
                };
                lt.push(Entry::new(g, id.leaf).encode());
            }
            let (kmin, kmax) = if e > s {
                (keys[s], keys[e - 1])
            } else {
                (low, low)
            };
            let line = line.unwrap_or(crate::plr::Line {
                origin: kmin,
                slope: 0.0,
                intercept: 0.0,
            });
            let params = ModelParams {
                low,
                high,
                kmin,
                kmax,
                slope: line.slope,
                intercept: line.intercept,
                err,
                leaves: n as u32,
                slt_slots: cfg.slt_slots as u32,
                region: g,
            };
            let mut slt = vec![0u64; cfg.slt_slots];
            slt[0] = 1;
            lows.push(low);
            records.push(encode_record(&params, ModelState::Active, &slt, &lt));
        }
        let offsets: Option<Vec<u64>> = {
            let mut st = self.dir.lock();
            let saved = st.bump.clone();
            let o: Option<Vec<u64>> = records
                .iter()
                .enumerate()
                .map(|(i, rec)| st.alloc_record(region_of(i) as usize, rec.len(), cfg.model_bytes))
                .collect();
            if o.is_none() {
                st.bump = saved;
            }
            o
        };
        let offsets = offsets.ok_or_else(|| {
            KvError::Exhausted("model region full (raise rolex.model_region_mb)".into())
        })?;
        let mut refs = Vec::with_capacity(models);
        for (i, (rec, off)) in records.iter().zip(&offsets).enumerate() {
            let m = ModelRef {
                node: region_of(i),
                offset: *off,
            };
            let bytes: Vec<u8> = rec.iter().flat_map(|w| w.to_le_bytes()).collect();
            let addr = r.record(m, 0).ok_or_else(|| corrupt("record space"))?;
            post.with(|b| {
                b.write(addr, bytes);
                Ok(())
            })
            .await?;
            refs.push(m);
        }
        post.flush().await?;
        // The caller writes the reborn leaves and publishes once the old
        // leaves are dead.
        Ok((lows, refs))
    }
}

/// Hooks for tests of the load's order of writes.
#[cfg(test)]
pub(crate) mod test_hooks {
    use crate::io::LeafId;
    use dmkv_transport::RegionMem;
    use std::sync::{Arc, Mutex};

    /// Called with node 0's meta region (which names the store) and the
    /// leaves a load is about to reuse, just before it writes the dead
    /// marks of the leaves it replaces.
    pub type BeforeDeadMarks = Box<dyn Fn(&Arc<RegionMem>, &[LeafId]) + Send + Sync>;
    pub static BEFORE_DEAD_MARKS: Mutex<Option<BeforeDeadMarks>> = Mutex::new(None);
}
