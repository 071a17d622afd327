//! The page provider (paper §4): a background thread per node that keeps
//! free cache slots available.
//!
//! Workers stamp frames with the global epoch on access (§4.1). When free
//! slots fall below the target, the provider samples frames, takes the
//! epoch below which the coldest `evict_percent` of the sample lie, and
//! evicts frames at or below it (§4.2):
//!
//! - pages this node directs: dirty ones are written to the shard's page
//!   file in one io_uring batch, then dropped; clean ones are dropped;
//! - other pages: batched per directory (up to 100) into one eviction
//!   message; the directory accepts a page only if this node still owns it
//!   at the conflict epoch it sent (owner stability), pulling dirty last
//!   copies by one batched one-sided read; accepted pages are dropped.
//!
//! The global epoch advances whenever a tenth of the cache was evicted since
//! the last advance.

use crate::frames::{Awaiting, NONE, Owners, Possession};
use crate::msg::{self, EVICT_BATCH, EvictEntry, Kind};
use crate::node::{Counters, ScaleNode};
use crate::ssd::AlignedPage;
use dmkv_transport::Endpoint;
use dmkv_transport::exec::block_on;
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Frames sampled to find the eviction threshold.
const SAMPLES: usize = 256;

/// The provider's state between rounds.
pub struct Provider {
    cursor: u32,
    evicted_since_bump: usize,
    ep: Option<Endpoint>,
}

impl Default for Provider {
    fn default() -> Self {
        Self::new()
    }
}

impl Provider {
    pub fn new() -> Provider {
        Provider {
            cursor: 0,
            evicted_since_bump: 0,
            ep: None,
        }
    }

    fn target(node: &ScaleNode) -> usize {
        (node.cfg.pages * node.cfg.free_percent / 100).max(4)
    }

    /// One round; returns whether it found work (else the caller sleeps).
    pub fn round(&mut self, node: &ScaleNode) -> bool {
        if node.free_slots() >= Self::target(node) {
            return false;
        }
        if self.ep.is_none() {
            match node.fabric.endpoint(node.id) {
                Ok(ep) => self.ep = Some(ep),
                Err(_) => return false,
            }
        }
        let threshold = self.threshold(node);
        let high = node.frames.high_water();
        if high == 0 {
            return false;
        }
        let mut local: Vec<u32> = Vec::new();
        let mut remote: HashMap<u8, Vec<(u32, EvictEntry)>> = HashMap::new();
        let want = (Self::target(node) - node.free_slots()).max(1) * 2;
        let mut picked = 0;
        let mut scanned = 0u32;
        while picked < want && scanned < high {
            let fi = self.cursor % high;
            self.cursor = self.cursor.wrapping_add(1);
            scanned += 1;
            let f = node.frames.frame(fi);
            let l = f.local();
            if l.mode == Possession::None || l.slot == NONE || l.waiting || f.latch.is_latched() {
                continue;
            }
            if f.lru.load(Ordering::Relaxed) > threshold {
                continue;
            }
            if !f.latch.try_exclusive() {
                continue;
            }
            let m = f.meta.lock();
            let l = f.local();
            if l.mode == Possession::None || l.waiting || m.awaiting != Awaiting::No {
                drop(m);
                f.latch.unlock_exclusive();
                continue;
            }
            let pid = f.pid();
            if node.directs(pid) {
                drop(m);
                local.push(fi);
            } else {
                let Some(host) = node.host_of(pid.shard()) else {
                    drop(m);
                    f.latch.unlock_exclusive();
                    continue;
                };
                let e = EvictEntry {
                    pid,
                    epoch: m.epoch,
                    offset: ScaleNode::offset_of(l.slot),
                };
                drop(m);
                remote.entry(host).or_default().push((fi, e));
            }
            picked += 1;
        }
        let mut evicted = self.evict_local(node, &local);
        for (host, list) in remote {
            for chunk in list.chunks(EVICT_BATCH) {
                evicted += self.evict_remote(node, host, chunk);
            }
        }
        self.evicted_since_bump += evicted;
        if self.evicted_since_bump * 10 >= node.cfg.pages {
            node.global_epoch.fetch_add(1, Ordering::Relaxed);
            self.evicted_since_bump = 0;
        }
        Counters::add(&node.stats.evictions, evicted as u64);
        true
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

    /// Evicts pages this node directs (frames latched exclusively).
    fn evict_local(&mut self, node: &ScaleNode, frames: &[u32]) -> usize {
        let mut writes: HashMap<u8, Vec<(u32, u64, AlignedPage)>> = HashMap::new();
        let mut done = 0;
        for &fi in frames {
            let f = node.frames.frame(fi);
            let mut m = f.meta.lock();
            let pid = f.pid();
            let me = node.index;
            let Some(d) = m.dir.as_ref() else {
                drop(m);
                f.latch.unlock_exclusive();
                continue;
            };
            // Owner stability: a pending grant may name our copy as source.
            if !d.owners.contains(me) || d.transfer.is_some() || d.evicting {
                drop(m);
                f.latch.unlock_exclusive();
                continue;
            }
            if d.dirty {
                let mut page = AlignedPage::default();
                page.bytes_mut()
                    .copy_from_slice(&node.page(f.local().slot).to_bytes());
                writes
                    .entry(pid.shard())
                    .or_default()
                    .push((fi, pid.slot(), page));
                continue; // stays latched until written
            }
            self.drop_local(node, fi, &mut m);
            drop(m);
            f.latch.unlock_exclusive();
            done += 1;
        }
        for (shard, list) in writes {
            let Some(s) = node.shard(shard) else { continue };
            let batch: Vec<(u64, &AlignedPage)> =
                list.iter().map(|(_, slot, p)| (*slot, p)).collect();
            let ok = s.file.write_batch(&batch).is_ok();
            for (fi, _, _) in &list {
                let f = node.frames.frame(*fi);
                let mut m = f.meta.lock();
                if ok {
                    let me = node.index;
                    let d = m.dir.as_mut().expect("a directed page has an entry");
                    // Only what we wrote is clean: a grant made meanwhile
                    // (our copy named as source) keeps it dirty and ours.
                    if d.owners.contains(me) && d.transfer.is_none() {
                        d.dirty = false;
                        self.drop_local(node, *fi, &mut m);
                        done += 1;
                    }
                }
                drop(m);
                f.latch.unlock_exclusive();
            }
        }
        done
    }

    fn drop_local(&self, node: &ScaleNode, fi: u32, m: &mut crate::frames::Meta) {
        let f = node.frames.frame(fi);
        let l = f.local();
        if let Some(d) = m.dir.as_mut() {
            d.owners = d.owners.without(node.index);
            if d.owners == Owners::None {
                d.epoch += 0;
            }
        }
        if l.slot != NONE {
            node.free_slot(l.slot);
        }
        f.set_local(crate::frames::Local::EMPTY);
        node.maybe_remove(fi, m);
    }

    /// Sends one eviction batch to `host` and drops what it accepted.
    fn evict_remote(&mut self, node: &ScaleNode, host: u8, batch: &[(u32, EvictEntry)]) -> usize {
        let entries: Vec<EvictEntry> = batch.iter().map(|(_, e)| *e).collect();
        let reply = node.member(host).and_then(|m| {
            node.stats.sent(Kind::Evict);
            Counters::add(&node.stats.evict_batches, 1);
            let ep = self.ep.as_ref().expect("endpoint made above");
            block_on(ep.call(m.node, m.service, msg::encode_evict(&entries))).ok()
        });
        let mut done = 0;
        for (k, (fi, _)) in batch.iter().enumerate() {
            let f = node.frames.frame(*fi);
            let mut m = f.meta.lock();
            let accepted = reply.as_ref().is_some_and(|r| r.get(k) == Some(&1));
            if accepted {
                let l = f.local();
                if l.slot != NONE {
                    node.free_slot(l.slot);
                }
                f.set_local(crate::frames::Local::EMPTY);
                node.maybe_remove(*fi, &mut m);
                done += 1;
            }
            drop(m);
            f.latch.unlock_exclusive();
        }
        done
    }
}

/// Runs rounds until `keep_going` says stop.
pub fn run(node: &ScaleNode, mut keep_going: impl FnMut() -> bool) {
    let mut p = Provider::new();
    while keep_going() && !node.stop.load(Ordering::Relaxed) {
        if !p.round(node) {
            std::thread::sleep(Duration::from_micros(200));
        }
    }
}
