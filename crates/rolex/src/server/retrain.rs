//! Asynchronous retraining on memory node 0 (§3.5).
//!
//! 1. The model's state goes ACTIVE -> TRAINING (from then on writers do not
//!    unlink emptied synonym leaves, so every leaf of the snapshot stays
//!    live until the swap).
//! 2. Snapshot: each group in turn is locked (its LT entry, by CAS, like a
//!    writer), its chain and leaves are read, and it is unlocked. Writers
//!    keep working on the other groups, and on this one right after.
//! 3. Training: the live leaves in key order, minus empty ones (except the
//!    first), become the trained leaves of one or more new models
//!    (`train::train_leaves`). No data moves.
//! 4. Swap ("locks the old model"): every LT entry of the old model is CASed
//!    to `RETIRED`, waiting for holders. With the model frozen, the chains
//!    are walked again: leaves created since the snapshot go to the new SLT
//!    of the model holding their predecessor, right behind it (consistency
//!    rule 1); snapshot leaves left out because they were empty and still
//!    are get merged into their predecessor (their range appended to it and
//!    the leaf marked dead). Then the new records are written, a new
//!    directory is published, and the old record's state becomes RETIRED.

use super::{Server, push_leaf_write};
use crate::io::{LeafId, chain, corrupt, read_leaves, read_params};
use crate::layout::entry::{Entry, LOCK_BIT, RETIRED};
use crate::layout::leaf::{Leaf, words_of};
use crate::layout::meta::ModelRef;
use crate::layout::record::{ModelParams, ModelState, RecordLayout, W_SLT, W_STATE, encode_record};
use crate::remote::Remote;
use crate::train::{LeafKeys, train_leaves};
use dmkv_api::{KvError, Result};
use dmkv_transport::Endpoint;
use dmkv_transport::exec::yield_now;
use dmkv_transport::time::Instant;
use std::collections::HashMap;
use std::sync::atomic::Ordering;

/// Work a retraining declares to `sim`'s instruction term
/// ([`dmkv_transport::sim::work`], a no-op off a metered memory-node core;
/// docs/simulation.md, "Declared work for worker jobs and ScaleStore
/// (branch i55)"), counted with callgrind on the `local` transport, main's
/// binary 751ec1c (`/tmp/keep/dmkv-head14`): `valgrind --tool=callgrind
/// dmkv bench --engine rolex --workload insert --keys 50000 --ops 30000
/// --threads 1 --tasks 8 --seed 1` (4 retrainings of 3,659 leaves, 10,948
/// keys), inclusive counts of the call edges below `retrain_active`.
pub(crate) mod cost {
    /// Training, per key: `train_leaves` (the PLR over the leaves' keys),
    /// 4,210,622 over 10,948 keys.
    pub const TRAIN_KEY: u64 = 385;
    /// The rest of a retraining's own work, per trained leaf (snapshot
    /// parsing, the new models' tables, the swap's chain walk and maps):
    /// `retrain_active` 12,187,130 less `train_leaves` and the endpoint's
    /// share (verbs posted, their results and drops, clock reads: 2,228,389
    /// directly and 835,390 inside `read_leaves`), 4,912,729 over 3,659
    /// leaves. The verbs themselves are the network's and the lines' cost.
    pub const RETRAIN_LEAF: u64 = 1_343;
}

/// Where a leaf hangs in a new model: its LT entry or an SLT slot.
#[derive(Debug, Clone, Copy)]
enum Hook {
    Lt(usize),
    Slt(usize),
}

/// What [`Server::take_entry`] got.
enum Take {
    /// The entry's unlocked value, now ours.
    Taken(u64),
    /// The model was retired meanwhile.
    Retired,
    /// A compute node held the lock for the whole `retrain_lock_wait`.
    TimedOut,
}

/// A retrain given up because a compute node held a leaf lock too long
/// (its holder may have died): the model is back in service, unchanged.
const LOCK_WAIT_GAVE_UP: &str =
    "a compute node held a leaf lock of the model longer than rolex.retrain_lock_wait_us";

struct NewModel {
    params: ModelParams,
    lt: Vec<u64>,
    slt: Vec<u64>,
}

impl Server {
    /// CASes an LT entry from its unlocked value to `to(unlocked)` (locked
    /// like a writer for the snapshot, `RETIRED` for the freeze), waiting
    /// for a holder at most `retrain_lock_wait` (invariant 12).
    async fn take_entry(
        &self,
        ep: &Endpoint,
        addr: dmkv_transport::RemoteAddr,
        to: impl Fn(u64) -> u64,
    ) -> Result<Take> {
        let deadline = Instant::now() + self.cfg.retrain_lock_wait;
        let mut w = u64::from_le_bytes(ep.read(addr, 8).await?.try_into().expect("8"));
        let mut spins = 0u32;
        loop {
            if w == RETIRED {
                return Ok(Take::Retired);
            }
            let expected = w & !LOCK_BIT;
            let got = ep.cas(addr, expected, to(expected)).await?;
            if got == expected {
                return Ok(Take::Taken(expected));
            }
            w = got;
            if w != RETIRED && w & LOCK_BIT != 0 && Instant::now() >= deadline {
                return Ok(Take::TimedOut);
            }
            polite_spin(&mut spins);
            yield_now().await;
        }
    }

    pub(crate) async fn retrain(&self, ep: &Endpoint, m: ModelRef) -> Result<()> {
        let wall = Instant::now();
        let r = self.remote(ep).await?;
        let p = read_params(ep, &r, m, self.cfg.slt_slots).await?;
        let rl = RecordLayout {
            slt: p.slt_slots as usize,
        };
        let addr = |w: usize| {
            r.record(m, w)
                .ok_or_else(|| corrupt("record outside its region"))
        };
        let state = addr(W_STATE)?;
        if ep
            .cas(
                state,
                ModelState::Active as u64,
                ModelState::Training as u64,
            )
            .await?
            != ModelState::Active as u64
        {
            return Ok(()); // retired already, or queued twice
        }
        let res = self.retrain_active(ep, &r, m, &p, &rl, wall).await;
        if res.is_err() {
            // Leave the model usable (a freeze given up wrote ACTIVE
            // itself); it will be queued again when writers find its SLT
            // full.
            let _ = ep
                .cas(
                    state,
                    ModelState::Training as u64,
                    ModelState::Active as u64,
                )
                .await;
        }
        if matches!(&res, Err(KvError::Exhausted(e)) if e == LOCK_WAIT_GAVE_UP) {
            // A lock wait given up: the model goes to the back of the queue
            // at once, so other models are retrained meanwhile and this one
            // again once the lock is free.
            self.stats
                .retrain_lock_timeouts
                .fetch_add(1, Ordering::Relaxed);
            self.push(m);
        }
        res
    }

    async fn retrain_active(
        &self,
        ep: &Endpoint,
        r: &Remote,
        m: ModelRef,
        p: &ModelParams,
        rl: &RecordLayout,
        wall: Instant,
    ) -> Result<()> {
        let n = p.leaves as usize;
        let addr = |w: usize| {
            r.record(m, w)
                .ok_or_else(|| corrupt("record outside its region"))
        };
        // 2. Snapshot, one locked group at a time.
        let mut snap: Vec<(LeafId, Leaf)> = Vec::new();
        for j in 0..n {
            let lt = addr(rl.lt_word(j))?;
            let v = match self.take_entry(ep, lt, |e| e | LOCK_BIT).await? {
                Take::Taken(v) => v,
                Take::Retired => return Err(corrupt("model retired during retraining")),
                Take::TimedOut => return Err(KvError::Exhausted(LOCK_WAIT_GAVE_UP.into())),
            };
            let read = async {
                let slt = words_of(&ep.read(addr(W_SLT)?, rl.slt * 8).await?);
                let links = chain(v, &slt).map_err(corrupt)?;
                let ids: Vec<LeafId> = links.iter().map(|l| l.entry.into()).collect();
                let leaves = read_leaves(ep, r, &self.cfg.leaf, &ids).await?;
                Ok::<_, KvError>(ids.into_iter().zip(leaves))
            }
            .await;
            ep.write(lt, &v.to_le_bytes()).await?;
            snap.extend(read?);
        }
        check_tiling(snap.iter().map(|s| &s.1), p.low, p.high)?;
        // 3. Train on the live leaves (empty ones left out, except the first).
        let kept: Vec<usize> = (0..snap.len())
            .filter(|&i| i == 0 || !snap[i].1.pairs.is_empty())
            .collect();
        let keys: Vec<LeafKeys> = kept
            .iter()
            .map(|&i| LeafKeys {
                low: snap[i].1.low,
                keys: snap[i].1.pairs.iter().map(|s| s.key).collect(),
            })
            .collect();
        let t0 = Instant::now();
        let segs = train_leaves(&keys, self.cfg.slots(), self.cfg.epsilon);
        let train_ns = t0.elapsed().as_nanos() as u64;
        dmkv_transport::sim::work(
            cost::TRAIN_KEY * keys.iter().map(|k| k.keys.len() as u64).sum::<u64>()
                + cost::RETRAIN_LEAF * kept.len() as u64,
        );
        let mut models: Vec<NewModel> = segs
            .iter()
            .enumerate()
            .map(|(i, s)| {
                let high = segs.get(i + 1).map_or(p.high, |n| keys[n.start].low);
                let mut slt = vec![0u64; rl.slt];
                slt[0] = 1;
                NewModel {
                    params: ModelParams {
                        low: if i == 0 { p.low } else { keys[s.start].low },
                        high,
                        kmin: s.kmin,
                        kmax: s.kmax,
                        slope: s.line.slope,
                        intercept: s.line.intercept,
                        err: s.err,
                        leaves: (s.end - s.start) as u32,
                        slt_slots: p.slt_slots,
                        region: p.region,
                    },
                    lt: kept[s.start..s.end]
                        .iter()
                        .map(|&i| Entry::new(snap[i].0.region, snap[i].0.leaf).encode())
                        .collect(),
                    slt,
                }
            })
            .collect();
        // Where each kept leaf went.
        let mut home: HashMap<LeafId, (usize, usize)> = HashMap::new();
        for (mi, s) in segs.iter().enumerate() {
            for (j, &i) in kept[s.start..s.end].iter().enumerate() {
                home.insert(snap[i].0, (mi, j));
            }
        }
        let excluded: HashMap<LeafId, ()> = (0..snap.len())
            .filter(|i| !kept.contains(i))
            .map(|i| (snap[i].0, ()))
            .collect();

        // 4. Swap, alone among publishers.
        let _publishing = self.publishing().await;
        // Writers that see FREEZING stop taking this model's locks, so the
        // freeze below waits only for the holders of the moment.
        if ep
            .cas(
                addr(W_STATE)?,
                ModelState::Training as u64,
                ModelState::Freezing as u64,
            )
            .await?
            != ModelState::Training as u64
        {
            return Err(corrupt("model retired during retraining"));
        }
        let offsets = {
            let mut st = self.dir.lock();
            if st.refs.len() - 1 + models.len() > self.cfg.max_models {
                None
            } else {
                let saved = st.bump.clone();
                let offs: Option<Vec<u64>> = models
                    .iter()
                    .map(|nm| {
                        st.alloc_record(
                            p.region as usize,
                            rl.words(nm.lt.len()),
                            self.cfg.model_bytes,
                        )
                    })
                    .collect();
                if offs.is_none() {
                    st.bump = saved;
                }
                offs
            }
        };
        let Some(offsets) = offsets else {
            self.stats.retrain_failures.fetch_add(1, Ordering::Relaxed);
            ep.write(addr(W_STATE)?, &(ModelState::Failed as u64).to_le_bytes())
                .await?;
            return Ok(());
        };
        // Freeze the old model.
        let mut finals = vec![0u64; n];
        for j in 0..n {
            let lt = addr(rl.lt_word(j))?;
            match self.take_entry(ep, lt, |_| RETIRED).await? {
                Take::Taken(v) => finals[j] = v,
                Take::Retired => return Err(corrupt("model retired during retraining")),
                Take::TimedOut => {
                    // Unfreeze what is frozen (nobody else writes a RETIRED
                    // entry) and put the model back in service: clients
                    // that saw RETIRED or FREEZING re-read its state.
                    for (k, f) in finals.iter().enumerate().take(j) {
                        ep.write(addr(rl.lt_word(k))?, &f.to_le_bytes()).await?;
                    }
                    ep.write(addr(W_STATE)?, &(ModelState::Active as u64).to_le_bytes())
                        .await?;
                    return Err(KvError::Exhausted(LOCK_WAIT_GAVE_UP.into()));
                }
            }
        }
        let frozen = self
            .place_new_leaves(ep, r, m, &finals, &home, &excluded, &mut models, rl)
            .await;
        let merges = match frozen {
            Ok(merges) => merges,
            Err(e) => {
                // Unfreeze: the old model stays in service.
                for (j, f) in finals.iter().enumerate() {
                    ep.write(addr(rl.lt_word(j))?, &f.to_le_bytes()).await?;
                }
                self.stats.retrain_failures.fetch_add(1, Ordering::Relaxed);
                ep.write(addr(W_STATE)?, &(ModelState::Failed as u64).to_le_bytes())
                    .await?;
                return Err(e);
            }
        };
        // Empty leaves merged into their predecessor: predecessor first (both
        // claim the range, both empty there), then the dead mark.
        for (pred_id, pred, dead_id, dead) in &merges {
            let mut b = ep.batch();
            push_leaf_write(&mut b, r, &self.cfg, *pred_id, pred, pred.version)?;
            push_leaf_write(&mut b, r, &self.cfg, *dead_id, dead, dead.version)?;
            b.run().await?;
        }
        self.stats
            .empty_leaves_merged
            .fetch_add(merges.len() as u64, Ordering::Relaxed);
        let mut refs = Vec::new();
        for (nm, off) in models.iter().zip(&offsets) {
            let rec = encode_record(&nm.params, ModelState::Active, &nm.slt, &nm.lt);
            let nref = ModelRef {
                node: p.region,
                offset: *off,
            };
            let bytes: Vec<u8> = rec.iter().flat_map(|w| w.to_le_bytes()).collect();
            ep.write(
                r.record(nref, 0).ok_or_else(|| corrupt("record space"))?,
                &bytes,
            )
            .await?;
            refs.push(nref);
        }
        {
            let mut st = self.dir.lock();
            let Some(at) = st.refs.iter().position(|x| *x == m) else {
                return Err(corrupt("retrained model missing from the directory"));
            };
            let mut lows = st.lows.clone();
            let mut all = st.refs.clone();
            lows.splice(at..=at, models.iter().map(|nm| nm.params.low));
            all.splice(at..=at, refs.iter().copied());
            self.publish(&mut st, lows, all)
                .map_err(KvError::Exhausted)?;
        }
        // The merged leaves are dead and no published model names them:
        // free for a later bulk load (invariant 14).
        {
            let mut free = self.free.lock();
            for (_, _, id, dead) in &merges {
                free.give_leaf(*id, dead.version + 1);
            }
        }
        self.stats
            .leaves_freed
            .fetch_add(merges.len() as u64, Ordering::Relaxed);
        ep.write(addr(W_STATE)?, &(ModelState::Retired as u64).to_le_bytes())
            .await?;
        self.note_model_usage(ep, r).await?;
        for (nm, nref) in models.iter().zip(&refs) {
            if nm.slt[0] > self.cfg.retrain_threshold {
                self.push(*nref);
            }
        }
        let s = &self.stats;
        s.retrains.fetch_add(1, Ordering::Relaxed);
        s.retrain_train_ns.fetch_add(train_ns, Ordering::Relaxed);
        s.retrain_keys.fetch_add(
            keys.iter().map(|k| k.keys.len() as u64).sum(),
            Ordering::Relaxed,
        );
        s.retrain_leaves
            .fetch_add(kept.len() as u64, Ordering::Relaxed);
        s.models_from_retrains
            .fetch_add(models.len() as u64, Ordering::Relaxed);
        s.retrain_wall_ns
            .fetch_add(wall.elapsed().as_nanos() as u64, Ordering::Relaxed);
        Ok(())
    }

    /// With the old model frozen (`finals` are its last LT words), walks its
    /// chains and hangs every leaf that is not a trained leaf of a new model
    /// into the new SLTs, right behind its predecessor. Returns the merges of
    /// left-out leaves that are still empty (predecessor image, dead image),
    /// to be written once the whole plan is known to fit.
    #[allow(clippy::type_complexity, clippy::too_many_arguments)]
    async fn place_new_leaves(
        &self,
        ep: &Endpoint,
        r: &Remote,
        m: ModelRef,
        finals: &[u64],
        home: &HashMap<LeafId, (usize, usize)>,
        excluded: &HashMap<LeafId, ()>,
        models: &mut [NewModel],
        rl: &RecordLayout,
    ) -> Result<Vec<(LeafId, Leaf, LeafId, Leaf)>> {
        let slt_addr = r
            .record(m, W_SLT)
            .ok_or_else(|| corrupt("record outside its region"))?;
        let slt = words_of(&ep.read(slt_addr, rl.slt * 8).await?);
        let mut order: Vec<LeafId> = Vec::new();
        for &f in finals {
            for link in chain(f, &slt).map_err(corrupt)? {
                order.push(link.entry.into());
            }
        }
        let others: Vec<LeafId> = order
            .iter()
            .filter(|id| !home.contains_key(id))
            .copied()
            .collect();
        let images: HashMap<LeafId, Leaf> = others
            .iter()
            .copied()
            .zip(read_leaves(ep, r, &self.cfg.leaf, &others).await?)
            .collect();
        let mut hook: Option<(usize, Hook)> = None;
        let mut pred: Option<(LeafId, Option<Leaf>)> = None;
        let mut merges = Vec::new();
        for id in order {
            if let Some(&(mi, j)) = home.get(&id) {
                hook = Some((mi, Hook::Lt(j)));
                pred = Some((id, None));
                continue;
            }
            let leaf = images[&id].clone();
            let (mi, at) = hook.ok_or_else(|| corrupt("a model's first leaf is not trained"))?;
            if excluded.contains_key(&id) && leaf.pairs.is_empty() {
                let (pid, pimg) = pred.take().expect("a hook implies a predecessor");
                let mut pimg = match pimg {
                    Some(l) => l,
                    None => read_leaves(ep, r, &self.cfg.leaf, &[pid]).await?.remove(0),
                };
                pimg.high = leaf.high;
                pimg.version += 1;
                let mut dead = leaf;
                dead.dead = true;
                dead.version += 1;
                merges.push((pid, pimg.clone(), id, dead));
                pred = Some((pid, Some(pimg)));
                continue;
            }
            let nm = &mut models[mi];
            let s = nm.slt[0] as usize;
            if s >= nm.slt.len() {
                return Err(KvError::Exhausted("a new model's SLT overflowed".into()));
            }
            nm.slt[s] = Entry::new(id.region, id.leaf).encode();
            nm.slt[0] += 1;
            let relink = |w: &mut u64| {
                let e = Entry::decode(*w).expect("a fresh entry").with_syn(s as u8);
                *w = e.encode();
            };
            match at {
                Hook::Lt(j) => relink(&mut nm.lt[j]),
                Hook::Slt(t) => relink(&mut nm.slt[t]),
            }
            hook = Some((mi, Hook::Slt(s)));
            pred = Some((id, Some(leaf)));
        }
        Ok(merges)
    }
}

/// The leaves of a model, in chain order, must tile `[low, high)`.
pub(crate) fn check_tiling<'a>(
    leaves: impl Iterator<Item = &'a Leaf>,
    low: u64,
    high: u64,
) -> Result<()> {
    let mut at = low;
    for l in leaves {
        if l.dead || l.low != at {
            return Err(corrupt(format!(
                "leaf chain broken at {at:#x}: next leaf covers [{:#x}, {:#x}) dead={}",
                l.low, l.high, l.dead
            )));
        }
        at = l.high;
    }
    if at != high {
        return Err(corrupt(format!(
            "leaf chain ends at {at:#x}, model at {high:#x}"
        )));
    }
    Ok(())
}

/// Waiting for a lock a compute node holds: give the CPU back (the holder
/// may need it on a small memory node), and sleep a little once it takes
/// long.
pub(crate) fn polite_spin(spins: &mut u32) {
    *spins += 1;
    if *spins < 64 {
        std::thread::yield_now();
    } else {
        dmkv_transport::time::sleep_blocking(std::time::Duration::from_micros(10));
    }
}
