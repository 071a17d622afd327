//! Resizing: splitting one subtable at a time under the directory's resize
//! lock, one-sided, without blocking readers.
//!
//! To split subtable S (local depth d, suffix s):
//! 1. take the resize lock (CAS on the directory's lock word), re-read the
//!    directory and check that S still needs splitting;
//! 2. get two fresh subtables S0 and S1 from the memory nodes;
//! 3. freeze every slot of S by CAS (`v` -> `v | FROZEN`; empty slots too),
//!    so no write lands in S any more; readers keep reading S;
//! 4. read the KV blocks of S's visible slots to learn their keys, and copy
//!    each slot to the same position of S0 or S1 by bit d of the key's
//!    directory hash (tentative claims are dropped: their inserts retry);
//! 5. write S0 and S1 (bucket headers carry depth d+1 and their suffix),
//!    double the directory if d was the global depth (copy the lower half,
//!    then bump the depth), point S's entries at S0/S1;
//! 6. release the lock.
//!
//! A split that fails after step 3 began and before step 5's directory
//! writes (a memory node holding S1 or some of S's KV blocks failed) thaws
//! S before step 6: visible slots unfrozen, claims and empty slots back to
//! empty (invariant 10 in docs/race.md); S0 and S1 are abandoned.
//!
//! S is retired, not reused: its frozen slots tell any client still
//! directed to it to refresh its directory (invariant 5 in docs/race.md).
//! Departure from RACE, which splits in place: an in-place split must clear
//! moved slots, and a reader whose single bucket READ is torn across that
//! clearing and the header update would miss a key. Retiring costs the
//! memory of the old subtable.

use crate::alloc::ALLOC_SUBTABLE;
use crate::layout::{
    DIR_DEPTH, DIR_ENTRIES, DIR_LOCK, DIR_RESIZES, DirEntry, GAddr, GROUP_BYTES, KeyHash,
    SLOTS_PER_BUCKET, Slot, decode_kv,
};
use crate::ops::{Ctx, subtable_image};
use dmkv_api::{KvError, Result};
use dmkv_transport::RemoteAddr;
use dmkv_transport::exec::sleep;
use std::cell::Cell;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Verbs per batch while freezing and copying.
const BATCH: usize = 128;
/// Backoff of a client waiting for another's split.
const MIN_BACKOFF: Duration = Duration::from_micros(2);
const MAX_BACKOFF: Duration = Duration::from_micros(128);

pub async fn split(ctx: &Ctx<'_>, h: &KeyHash, seen: DirEntry) -> Result<()> {
    let mut b = ctx.ep.batch();
    let c = b.cas(ctx.t.dir.at(DIR_LOCK), 0, ctx.t.lock_tag);
    if ctx.run(b).await?.word(c) != 0 {
        // Another client is resizing; its split may make room. Poll the
        // 8-byte lock word (not the whole directory), backing off, until it
        // is free.
        ctx.t
            .stats
            .resize_lock_waits
            .fetch_add(1, Ordering::Relaxed);
        let mut pause = MIN_BACKOFF;
        loop {
            sleep(pause).await;
            pause = (pause * 2).min(MAX_BACKOFF);
            let mut b = ctx.ep.batch();
            let r = b.read(ctx.t.dir.at(DIR_LOCK), 8);
            if ctx.run(b).await?.take_read(r) == [0u8; 8] {
                break;
            }
        }
        return ctx.refresh_dir().await;
    }
    // The subtable this split froze, until the directory starts moving off
    // it: if the split fails in between (a memory node holding S1 or some
    // of S's KV blocks fails), S is thawed before the lock is released.
    let frozen = Cell::new(None);
    let res = split_locked(ctx, h, seen, &frozen).await;
    if res.is_err()
        && let Some(st) = frozen.get()
    {
        ctx.t.stats.split_aborts.fetch_add(1, Ordering::Relaxed);
        // Best effort: if S's own memory node is the one that failed, its
        // keys are unreachable anyway.
        let _ = thaw(ctx, st).await;
    }
    // All directory writes above were awaited: the unlock comes after them.
    let mut b = ctx.ep.batch();
    b.write(ctx.t.dir.at(DIR_LOCK), 0u64.to_le_bytes().to_vec());
    ctx.run(b).await?;
    res
}

async fn split_locked(
    ctx: &Ctx<'_>,
    h: &KeyHash,
    seen: DirEntry,
    frozen_st: &Cell<Option<GAddr>>,
) -> Result<()> {
    ctx.refresh_dir().await?;
    let (gd, entries) = {
        let c = ctx.t.cache.read();
        (c.depth, c.entries.clone())
    };
    let entry = entries[(h.dir & ((1u64 << gd) - 1)) as usize];
    if entry != seen {
        return Ok(()); // Split by someone else already.
    }
    let d = entry.local_depth();
    let s = h.dir & ((1u64 << d) - 1);
    let old = entry.subtable();
    let mns = ctx.t.pools.len();
    let st0 = GAddr {
        mn: old.mn,
        offset: ctx.t.allocs[old.mn].fetch(ctx.ep, ALLOC_SUBTABLE).await?,
    };
    let mn1 = (old.mn + 1) % mns;
    let st1 = GAddr {
        mn: mn1,
        offset: ctx.t.allocs[mn1].fetch(ctx.ep, ALLOC_SUBTABLE).await?,
    };

    // From the first freezing CAS on, a failure leaves S to be thawed.
    frozen_st.set(Some(old));
    let frozen = freeze(ctx, old).await?;

    // Learn the keys of the visible slots and route them.
    let mut images = [
        subtable_image(ctx.t.groups, d + 1, s),
        subtable_image(ctx.t.groups, d + 1, s | (1 << d)),
    ];
    let visible: Vec<(u64, Slot)> = frozen.into_iter().filter(|(_, v)| v.is_visible()).collect();
    for chunk in visible.chunks(BATCH) {
        let mut b = ctx.ep.batch();
        let mut idx: Vec<usize> = Vec::with_capacity(chunk.len());
        for (_, v) in chunk {
            idx.push(b.read(ctx.pool_at(v.kv()).await?, usize::from(v.units()) * 64));
        }
        let mut res = ctx.run(b).await?;
        for ((off, v), i) in chunk.iter().zip(idx) {
            // A frozen slot's block is never freed, so it must decode.
            let (key, _) = decode_kv(&res.take_read(i), *v).ok_or_else(|| {
                KvError::Corrupt(format!("KV block of frozen slot at {off:#x} is invalid"))
            })?;
            let bit = (KeyHash::new(key, ctx.t.groups).dir >> d) & 1;
            let img = &mut images[bit as usize];
            let at = *off as usize;
            img[at..at + 8].copy_from_slice(&v.thawed().0.to_le_bytes());
        }
    }
    let mut b = ctx.ep.batch();
    b.write(ctx.pool_at(st0).await?, std::mem::take(&mut images[0]));
    b.write(ctx.pool_at(st1).await?, std::mem::take(&mut images[1]));
    ctx.run(b).await?;

    // Directory: double if needed, then switch S's entries. From here on
    // S stays frozen whatever happens: once an entry may name S0 or S1,
    // writes must not land in S again (invariant 5), and these writes fail
    // only if the directory's own memory node failed.
    frozen_st.set(None);
    let new_gd = gd.max(d + 1);
    if new_gd > gd {
        let mut copy = Vec::with_capacity(entries.len() * 8);
        for e in &entries {
            copy.extend_from_slice(&e.0.to_le_bytes());
        }
        let mut b = ctx.ep.batch();
        b.write(ctx.t.dir.at(DIR_ENTRIES + 8 * entries.len() as u64), copy);
        ctx.run(b).await?;
        let mut b = ctx.ep.batch();
        b.write(
            ctx.t.dir.at(DIR_DEPTH),
            u64::from(new_gd).to_le_bytes().to_vec(),
        );
        ctx.run(b).await?;
    }
    let e0 = DirEntry::new(st0, d + 1);
    let e1 = DirEntry::new(st1, d + 1);
    let targets: Vec<u64> = (0..1u64 << new_gd)
        .filter(|i| i & ((1u64 << d) - 1) == s)
        .collect();
    for chunk in targets.chunks(BATCH) {
        let mut b = ctx.ep.batch();
        for &i in chunk {
            let e = if (i >> d) & 1 == 0 { e0 } else { e1 };
            b.write(
                ctx.t.dir.at(DIR_ENTRIES + 8 * i),
                e.0.to_le_bytes().to_vec(),
            );
        }
        ctx.run(b).await?;
    }
    let mut b = ctx.ep.batch();
    b.faa(ctx.t.dir.at(DIR_RESIZES), 1);
    ctx.run(b).await?;
    ctx.t.stats.resizes.fetch_add(1, Ordering::Relaxed);
    ctx.refresh_dir().await
}

/// Slots of a subtable: (offset in the subtable, slot word).
type SlotList = Vec<(u64, Slot)>;

/// Every slot word of the subtable at `st`, read in one READ.
async fn read_slots(ctx: &Ctx<'_>, st: GAddr) -> Result<SlotList> {
    let mut b = ctx.ep.batch();
    let r = b.read(ctx.pool_at(st).await?, ctx.t.subtable_bytes as usize);
    let img = ctx.run(b).await?.take_read(r);
    let mut slots = Vec::new();
    for bucket in 0..ctx.t.groups * (GROUP_BYTES / 64) {
        for i in 0..SLOTS_PER_BUCKET as u64 {
            let off = bucket * 64 + 8 + 8 * i;
            let at = off as usize;
            let word = u64::from_le_bytes(img[at..at + 8].try_into().expect("8 bytes"));
            slots.push((off, Slot(word)));
        }
    }
    Ok(slots)
}

/// The address of the slot `off` bytes into the subtable at `st`.
async fn slot_at(ctx: &Ctx<'_>, st: GAddr, off: u64) -> Result<RemoteAddr> {
    ctx.pool_at(GAddr {
        mn: st.mn,
        offset: st.offset + off,
    })
    .await
}

/// Undoes a split's freeze of the subtable at `st` after the split failed
/// before the directory moved off it: every frozen slot is CASed back,
/// visible ones to their unfrozen word, tentative claims and empty slots
/// to empty (as a split drops claims: their inserts retry, invariant 3).
/// Nothing else writes a frozen slot (writers wait), so each CAS finds the
/// word the read saw unless another client's failed split thawed it first.
async fn thaw(ctx: &Ctx<'_>, st: GAddr) -> Result<()> {
    let frozen: SlotList = read_slots(ctx, st)
        .await?
        .into_iter()
        .filter(|(_, v)| v.is_frozen())
        .collect();
    for chunk in frozen.chunks(BATCH) {
        let mut b = ctx.ep.batch();
        for &(off, v) in chunk {
            let back = if v.is_visible() { v.thawed() } else { Slot(0) };
            b.cas(slot_at(ctx, st, off).await?, v.0, back.0);
        }
        ctx.run(b).await?;
    }
    Ok(())
}

/// Freezes every slot of the subtable at `st`; returns (offset in the
/// subtable, slot as frozen) for all of them.
async fn freeze(ctx: &Ctx<'_>, st: GAddr) -> Result<SlotList> {
    let (mut done, mut pending): (SlotList, SlotList) = read_slots(ctx, st)
        .await?
        .into_iter()
        .partition(|(_, v)| v.is_frozen());
    while !pending.is_empty() {
        let mut retry = Vec::new();
        for chunk in pending.chunks(BATCH) {
            let mut b = ctx.ep.batch();
            let mut idx: Vec<usize> = Vec::with_capacity(chunk.len());
            for &(off, v) in chunk {
                idx.push(b.cas(slot_at(ctx, st, off).await?, v.0, v.frozen().0));
            }
            let res = ctx.run(b).await?;
            for ((off, v), i) in chunk.iter().zip(idx) {
                let found = Slot(res.word(i));
                if found == *v {
                    done.push((*off, v.frozen()));
                } else if found.is_frozen() {
                    done.push((*off, found));
                } else {
                    retry.push((*off, found));
                }
            }
        }
        pending = retry;
    }
    Ok(done)
}
