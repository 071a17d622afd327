//! The page provider (paper §4): a background thread per node that keeps
//! free cache slots available.
//!
//! Workers stamp frames with the global epoch on access (§4.1). When free
//! slots fall below the target, the provider samples frames, takes the
//! epoch below which the coldest `evict_percent` of the sample lie, and
//! evicts frames at or below it (§4.2):
//!
//! - pages this node directs: if other nodes hold copies too, ours is just
//!   dropped; a dirty sole copy is written to the shard's page file (one
//!   io_uring batch per round and shard) and then dropped; a clean one is
//!   dropped;
//! - other pages: batched per directory (up to 100) into one eviction
//!   message; the directory accepts a page only if this node still owns it
//!   at the conflict epoch it sent and has served every copy it was named
//!   the source of (owner stability), pulling dirty last copies by one
//!   batched one-sided read; accepted pages are dropped.
//!
//! Frames that are latched, awaited, parked on or phantom are skipped. The
//! global epoch advances whenever a tenth of the cache was evicted since
//! the last advance.

use crate::frames::{Awaiting, Local, NONE, Owners, Possession};
use crate::msg::{self, EVICT_BATCH, EvictEntry, EvictReply, Kind};
use crate::node::{Counters, NodeState, ScaleNode};
use crate::pid::Pid;
use crate::ssd::AlignedPage;
use dmkv_api::KvError;
use dmkv_transport::Endpoint;
use dmkv_transport::exec::block_on;
use std::collections::BTreeMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Frames sampled to find the eviction threshold.
const SAMPLES: usize = 256;

/// The provider's state between rounds.
#[derive(Default)]
pub struct Provider {
    cursor: u32,
    evicted_since_bump: usize,
}

/// A frame latched for eviction.
struct Victim {
    fi: u32,
    pid: Pid,
    entry: EvictEntry,
}

impl Provider {
    pub fn new() -> Provider {
        Provider::default()
    }

    fn target(node: &ScaleNode) -> usize {
        (node.cfg.pages * node.cfg.free_percent / 100).max(4)
    }

    /// One round; returns whether it found work (else the caller sleeps).
    /// Asynchronous so that under the simulated cluster the provider waits
    /// for its eviction messages and SSD writes as a task: a synchronous
    /// wait there is a nested frame of the one-thread scheduler, and an
    /// outer frame cannot return before an inner one does, so two nodes'
    /// providers each waiting (synchronously) for the other's directory,
    /// whose handler parks on a frame the outer provider has latched, never
    /// finished (the 3-node hang with eviction).
    pub async fn round(&mut self, node: &ScaleNode, ep: &Endpoint) -> bool {
        if node.state() != NodeState::Active || node.free_slots() >= Self::target(node) {
            return false;
        }
        let high = node.frames.high_water();
        if high == 0 {
            return false;
        }
        let threshold = self.threshold(node);
        let want = Self::target(node).saturating_sub(node.free_slots()).max(1) * 2;
        // Candidates are only looked at here; each is latched just before
        // its own step (invariant 17).
        let mut candidates = Vec::new();
        let mut scanned = 0u32;
        while candidates.len() < want && scanned < high {
            let fi = self.cursor % high;
            self.cursor = self.cursor.wrapping_add(1);
            scanned += 1;
            if node.frames.frame(fi).lru.load(Ordering::Relaxed) > threshold {
                continue;
            }
            if let Some(pid) = Self::candidate(node, fi, |_| true) {
                candidates.push((fi, pid));
            }
        }
        let evicted = self.evict(node, ep, candidates).await;
        self.evicted_since_bump += evicted;
        if self.evicted_since_bump * 10 >= node.cfg.pages {
            node.global_epoch.fetch_add(1, Ordering::Relaxed);
            self.evicted_since_bump = 0;
        }
        Counters::add(&node.stats.evictions, evicted as u64);
        true
    }

    /// Frame `fi`'s page if the frame looks evictable and `filter` accepts
    /// the page (read without the latch: [`Provider::latch_victim`] checks
    /// again).
    fn candidate(node: &ScaleNode, fi: u32, filter: impl Fn(Pid) -> bool) -> Option<Pid> {
        let f = node.frames.frame(fi);
        let l = f.local();
        let pid = f.pid();
        if l.mode == Possession::None
            || l.slot == NONE
            || l.waiting
            || l.parked
            || l.fresh
            || f.latch.is_latched()
            || pid == Pid::EMPTY
            || !filter(pid)
        {
            return None;
        }
        Some(pid)
    }

    /// Latches frame `fi` exclusively if it still holds an evictable copy
    /// of `want`.
    fn latch_victim(node: &ScaleNode, fi: u32, want: Pid) -> Option<Victim> {
        let f = node.frames.frame(fi);
        Self::candidate(node, fi, |p| p == want)?;
        if !f.latch.try_exclusive() {
            return None;
        }
        let m = f.meta.lock();
        let l = f.local();
        let pid = f.pid();
        if l.mode == Possession::None
            || l.slot == NONE
            || m.awaiting != Awaiting::No
            || !m.parked.is_empty()
            || m.phantom
            || pid != want
        {
            drop(m);
            f.latch.unlock_exclusive();
            return None;
        }
        let entry = EvictEntry {
            pid,
            epoch: m.epoch,
            offset: ScaleNode::offset_of(l.slot),
            copies: m.copies_served,
        };
        Some(Victim { fi, pid, entry })
    }

    /// The epoch at or below which the coldest sampled frames lie.
    fn threshold(&mut self, node: &ScaleNode) -> u64 {
        let high = node.frames.high_water();
        let mut epochs = Vec::with_capacity(SAMPLES);
        let mut i = self.cursor;
        let mut seen = 0;
        while epochs.len() < SAMPLES && seen < high {
            let f = node.frames.frame(i % high);
            if f.local().mode != Possession::None {
                epochs.push(f.lru.load(Ordering::Relaxed));
            }
            i = i.wrapping_add(1);
            seen += 1;
        }
        if epochs.is_empty() {
            return u64::MAX;
        }
        epochs.sort_unstable();
        let k = (epochs.len() * node.cfg.evict_percent / 100).min(epochs.len() - 1);
        epochs[k]
    }

    /// Evicts the candidates' copies; returns how many were dropped. Each
    /// frame is latched only for its own step: a local one for its own
    /// decision or its shard's write, a remote batch for its own message
    /// (invariant 17).
    async fn evict(
        &mut self,
        node: &ScaleNode,
        ep: &Endpoint,
        candidates: Vec<(u32, Pid)>,
    ) -> usize {
        let mut local = Vec::new();
        let mut remote: BTreeMap<u8, Vec<(u32, Pid)>> = BTreeMap::new();
        for (fi, pid) in candidates {
            if node.directs(pid) {
                local.push((fi, pid));
            } else if let Some(h) = node.host_of(pid.shard())
                && h != node.index
            {
                remote.entry(h).or_default().push((fi, pid));
            }
        }
        let mut evicted = self.evict_local(node, local).await;
        for (host, list) in remote {
            for chunk in list.chunks(EVICT_BATCH) {
                let batch: Vec<Victim> = chunk
                    .iter()
                    .filter_map(|&(fi, pid)| Self::latch_victim(node, fi, pid))
                    .collect();
                if !batch.is_empty() {
                    evicted += self.evict_remote(node, ep, host, batch).await;
                }
            }
        }
        evicted
    }

    fn unlatch(node: &ScaleNode, fi: u32) {
        node.frames.frame(fi).latch.unlock_exclusive();
        node.released(fi);
    }

    fn unlatch_shared(node: &ScaleNode, fi: u32) {
        node.frames.frame(fi).latch.unlock_shared();
        node.released(fi);
    }

    /// Evicts copies of pages this node directs. Each frame is latched
    /// exclusively for its decision; a dirty sole copy then stays latched
    /// shared (readers and copies go on, nobody writes it) until its
    /// shard's write batch is done.
    async fn evict_local(&mut self, node: &ScaleNode, candidates: Vec<(u32, Pid)>) -> usize {
        let me = node.index;
        // (frame, slot, page, conflict epoch when the write was decided)
        let mut writes: BTreeMap<u8, Vec<(u32, u64, AlignedPage, u64)>> = BTreeMap::new();
        let mut done = 0;
        for (fi, pid) in candidates {
            let Some(v) = Self::latch_victim(node, fi, pid) else {
                continue;
            };
            let f = node.frames.frame(v.fi);
            let mut m = f.meta.lock();
            let copies = m.copies_served;
            let Some(d) = m.dir.as_mut() else {
                drop(m);
                Self::unlatch(node, v.fi);
                continue;
            };
            // Owner stability: a pending grant may name our copy as the
            // source of a move or copy.
            if !d.owners.contains(me)
                || d.transfer.is_some()
                || d.evicting
                || d.delivering
                || d.copies_granted(me) > copies
            {
                drop(m);
                Self::unlatch(node, v.fi);
                continue;
            }
            let rest = d.owners.without(me);
            if rest == Owners::None && d.dirty {
                let mut page = AlignedPage::default();
                page.bytes_mut()
                    .copy_from_slice(&node.page(f.local().slot).to_bytes());
                let epoch = d.epoch;
                writes
                    .entry(v.pid.shard())
                    .or_default()
                    .push((v.fi, v.pid.slot(), page, epoch));
                drop(m);
                // Shared until written (invariant 17): no local worker can
                // write the page, readers and copies to others go on.
                f.latch.downgrade_exclusive_to_shared();
                node.released(v.fi);
                continue;
            }
            // Other nodes hold it too (§4.2: "the directory can evict the
            // page immediately"), or it is clean.
            d.owners = rest;
            d.forget_copies(me);
            Self::drop_frame(node, v.fi, &mut m);
            drop(m);
            Self::unlatch(node, v.fi);
            done += 1;
        }
        for (shard, list) in writes {
            let Some(s) = node.shard(shard) else {
                for (fi, _, _, _) in list {
                    Self::unlatch_shared(node, fi);
                }
                continue;
            };
            let batch: Vec<(u64, &AlignedPage)> =
                list.iter().map(|(_, slot, p, _)| (*slot, p)).collect();
            let ok = s.file.write_batch_async(&batch).await.is_ok();
            for (fi, _, _, epoch) in &list {
                let f = node.frames.frame(*fi);
                // Only as the latch's sole holder may we clear `dirty`: a
                // worker that holds the page exclusively writes it without
                // asking the directory again, so once we let go of the
                // latch a page whose entry says clean could be changed and
                // then dropped clean. A reader still holding it shared
                // costs the write (the page stays dirty for a later round).
                if !f.latch.try_upgrade_shared_to_exclusive() {
                    Counters::add(&node.stats.evict_writes_kept_dirty, 1);
                    Self::unlatch_shared(node, *fi);
                    continue;
                }
                let mut m = f.meta.lock();
                let copies = m.copies_served;
                let Some(d) = m.dir.as_mut() else {
                    // Handed over meanwhile (a leave): the successor
                    // directs the page now; our copy stays as it was.
                    drop(m);
                    Self::unlatch(node, *fi);
                    continue;
                };
                // The SSD now has our (latched, unchanged) copy. It is the
                // page's content only if no conflict grant happened while we
                // wrote (shared joins do not change content; any grant that
                // lets someone write bumps the epoch).
                if ok && d.epoch == *epoch && d.owners.contains(me) {
                    d.dirty = false;
                    let sole = d.owners.without(me) == Owners::None;
                    if sole && d.transfer.is_none() && d.copies_granted(me) <= copies {
                        d.owners = Owners::None;
                        d.forget_copies(me);
                        Self::drop_frame(node, *fi, &mut m);
                        done += 1;
                    }
                }
                drop(m);
                Self::unlatch(node, *fi);
            }
        }
        done
    }

    fn drop_frame(node: &ScaleNode, fi: u32, m: &mut crate::frames::Meta) {
        let f = node.frames.frame(fi);
        let l = f.local();
        if l.slot != NONE {
            node.free_slot(l.slot);
        }
        f.set_local(Local {
            mode: Possession::None,
            slot: NONE,
            ..l
        });
        node.maybe_remove(fi, m);
    }

    /// Sends one eviction batch to `host` and drops what it accepted.
    async fn evict_remote(
        &mut self,
        node: &ScaleNode,
        ep: &Endpoint,
        host: u8,
        batch: Vec<Victim>,
    ) -> usize {
        let entries: Vec<EvictEntry> = batch.iter().map(|v| v.entry).collect();
        let reply = match node.member(host) {
            Some(m) => {
                node.stats.sent(Kind::Evict);
                Counters::add(&node.stats.evict_batches, 1);
                match ep
                    .call(m.node, m.service, msg::encode_evict(&entries))
                    .await
                {
                    Ok(bytes) => EvictReply::decode(&bytes, entries.len()).ok(),
                    Err(_) => None,
                }
            }
            None => None,
        };
        let accepted: Vec<bool> = match reply {
            Some(EvictReply::Decided(v)) => v,
            Some(EvictReply::Moved(h)) => {
                if let Some(v) = batch.first() {
                    node.set_host(v.pid.shard(), h);
                }
                vec![false; batch.len()]
            }
            None => vec![false; batch.len()],
        };
        let mut done = 0;
        for (v, ok) in batch.iter().zip(accepted) {
            let f = node.frames.frame(v.fi);
            if ok {
                let mut m = f.meta.lock();
                Self::drop_frame(node, v.fi, &mut m);
                done += 1;
            }
            Self::unlatch(node, v.fi);
        }
        done
    }

    /// Evicts every copy of a page `filter` accepts (a leaving node);
    /// returns how many such copies are still held. Asynchronous like
    /// [`Provider::round`]: a leave is a task of the simulated cluster.
    pub async fn evict_everything(
        &mut self,
        node: &ScaleNode,
        ep: &Endpoint,
        filter: impl Fn(Pid) -> bool,
    ) -> Result<usize, KvError> {
        let mut candidates = Vec::new();
        for fi in 0..node.frames.high_water() {
            if let Some(pid) = Self::candidate(node, fi, &filter) {
                candidates.push((fi, pid));
            }
        }
        let evicted = self.evict(node, ep, candidates).await;
        Counters::add(&node.stats.evictions, evicted as u64);
        let mut held = 0;
        for fi in 0..node.frames.high_water() {
            let f = node.frames.frame(fi);
            if f.local().mode != Possession::None && filter(f.pid()) {
                held += 1;
            }
        }
        Ok(held)
    }
}

/// [`run`] as a task of the simulated cluster: the same rounds, waiting in
/// virtual time between them.
pub async fn run_async(node: &ScaleNode, mut keep_going: impl FnMut() -> bool) {
    let Ok(ep) = node.fabric.endpoint(node.id) else {
        return;
    };
    let mut p = Provider::new();
    while keep_going() && !node.stop.load(Ordering::Relaxed) {
        if !p.round(node, &ep).await {
            node.provider_wait(Duration::from_millis(1)).await;
        }
    }
}

/// Runs rounds until `keep_going` says stop (the provider's own thread).
pub fn run(node: &ScaleNode, mut keep_going: impl FnMut() -> bool) {
    let Ok(ep) = node.fabric.endpoint(node.id) else {
        return;
    };
    let mut p = Provider::new();
    while keep_going() && !node.stop.load(Ordering::Relaxed) {
        if !block_on(p.round(node, &ep)) {
            node.provider_sleep(Duration::from_millis(1));
        }
    }
}
