//! Index rebuilds on the memory node's worker (paper §4.4, Fig. 7–8).
//!
//! Two kinds, one protocol:
//! - **resize** (extendible hashing): the keys of a table over its
//!   thresholds are rebuilt (fresh Othello and seeds) into new tables sized
//!   for them at the growth load factor: two (a split: the keys whose next
//!   directory bit is 1 go to the second; the directory doubles when the
//!   table's local depth reaches the global depth) if the table holds more
//!   than `table_keys` keys, else one (the table grows in place); the old
//!   table is retired;
//! - **full build**: every key of the shard (including bulk-loaded and
//!   recovered ones) into freshly built tables (bulk loads, takeovers).
//!
//! Protocol: the affected tables go to REBUILDING (inserts and deletes are
//! buffered from then on; GET and UPDATE go on), their keys are
//! snapshotted bucket by bucket under the bucket locks, new tables are built
//! off to the side, then the switch: the old tables' epochs are bumped
//! (requests naming the old epoch get STALE), every bucket is passed under
//! its lock (a barrier for writers that checked the old epoch) while the
//! moving keys' current entries are copied, the new tables and directory are
//! installed and published, the buffered writes are applied, and the old
//! tables' regions are handed over to be withdrawn once compute nodes have
//! counted down their fetches (`retire`; the worker does not wait).

use crate::config::Config;
use crate::hash::{candidates, dir};
use crate::layout::{SlotWord, TableLayout, seq_offset};
use crate::ludo::{self, LudoBuild};
use crate::publish::{encode_locator, locator_len, locator_name, table_name, table_prefix};
use crate::server::ctx::NodeCtx;
use crate::server::replica::MirrorOp;
use crate::server::shard::{Directory, ShardServer};
use crate::server::table::{Buffer, Overflow, Table, state};
use dmkv_transport::ServiceError;
use dmkv_transport::time::Instant;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};

/// Work a rebuild declares to `sim`'s instruction term
/// ([`dmkv_transport::sim::work`], a no-op off a metered memory-node core;
/// docs/simulation.md, "Declared work for worker jobs and ScaleStore
/// (branch i55)"), per step where the work is, so a resize's work passes at
/// its progress points as it goes.
///
/// Counted with callgrind on the `local` transport, main's binary 751ec1c
/// (`/tmp/keep/dmkv-head14`): `valgrind --tool=callgrind dmkv bench
/// --engine outback --workload insert --keys 50000 --ops 30000 --threads 1
/// --tasks 8 --seed 1 --set outback.load_factor=0.95`; inclusive counts of
/// the worker's functions below `rebuild::execute` (call edges of the
/// callgrind file), over what they processed in that run: 31 jobs (the
/// bulk load's full build of 50,000 loaded keys and 30 resizes), 118,488
/// old buckets and 386,223 keys snapshotted (`take_entry`'s calls),
/// 436,223 keys built and filled. The counts include the `sim` hooks'
/// checks that region accesses make on `local`. The rebuild's lines (region
/// and private, `charge_private_lines`) are charged apart, as before.
pub mod cost {
    /// Snapshot, per old bucket: its lock and unlock (183 + 94), the four
    /// slot words (4 x 60), the overflow cache's lookup (114) and the
    /// loop's own lines whose counts are multiples of the bucket count
    /// (66 per bucket): `snapshot` 139,528,013 in all.
    pub const SNAPSHOT_BUCKET: u64 = 697;
    /// Snapshot, per key: the rest of `snapshot` over its 386,223 keys
    /// ((139,528,013 - 697 x 118,488) / 386,223 = 147.4: the block's key
    /// read, 60, the list's growth, 46, and the loop's own).
    pub const SNAPSHOT_KEY: u64 = 147;
    /// The switch, per old bucket: its lock and unlock
    /// (`Table::lock` 21,720,087 and the guard's drop 11,166,834 over
    /// 118,689 calls from `execute`).
    pub const SWITCH_BUCKET: u64 = 277;
    /// The switch, per key: `take_entry`, 41,681,308 over 386,223 calls.
    pub const SWITCH_KEY: u64 = 108;
    /// A new table, per key it holds: `new_table` (the Ludo build, its
    /// cuckoo inserts and seed search, the Othello build, the table's
    /// regions and seeds) 378,133,168 over the 436,223 keys built.
    pub const BUILD_KEY: u64 = 867;
    /// Filling a new table, per key: `fill`, 38,390,018 over 436,223.
    pub const FILL_KEY: u64 = 88;
    /// The job's own, per key placed (partitions, entry lists, the
    /// arrays' memsets, the pending writes' merge): what `execute`
    /// spends beside the calls above, 48,304,143 over 436,223.
    pub const KEY_OWN: u64 = 111;
    /// A full build, per loaded pair: the map of loaded keys (its
    /// inserts, 10,751,109, and hashing, 7,100,000, over the 50,000 pairs).
    pub const LOADED_KEY: u64 = 357;

    // Branch i60 (docs/simulation.md, "Declared work, the rest (branch
    // i60)"): the switch's tail and the settling of a table in place,
    // counted the same way with main's binary fac3bce
    // (`/tmp/keep/dmkv-head15`), same command (33 jobs: a full build and
    // 32 resizes; 34 publications, 209 buffered writes merged).

    /// A publication of the shard's view (`ShardServer::publish`, 4,472.1
    /// per call from `execute`, less its region writes of the control
    /// region, 440 per call: charged by their lines).
    pub const PUBLISH: u64 = 4_032;
    /// A buffered write merged into a table (`ShardServer::merge_pending`
    /// from `execute`, 457,880 over 209 writes: its bucket's seed search,
    /// an overflow insert or a removal).
    pub const MERGE: u64 = 2_191;
    /// Settling a table in place before a full build, per bucket: its lock
    /// and unlock and the buffer's look (`settle_in_place`, 98,089 over
    /// 256 buckets, no write merged), besides the merges (`MERGE` each).
    pub const SETTLE_BUCKET: u64 = 383;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Job {
    Full,
    Resize(u32, Start),
}

/// What let a resize start (paper Fig. 8 ②).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Start {
    /// Every registered compute node had seen PRE_RESIZE.
    AllTold,
    /// The PRE_RESIZE wait (`pre_resize_timeout_ms`) ran out.
    Timeout,
    /// The overflow cache reached s_stop.
    StopFill,
}

/// Runs rebuilds until none is due; the shard's `job_active` flag is held.
pub fn run(shard: Arc<ShardServer>) {
    loop {
        while let Some(job) = next_job(&shard) {
            if let Err(e) = execute(&shard, job) {
                // Stop here rather than retry at once; the next trigger
                // (an insert over a threshold, a BUILD) runs us again.
                *shard.last_error.lock() = Some(e.to_string());
                shard.job_active.store(false, Ordering::Release);
                return;
            }
        }
        shard.job_active.store(false, Ordering::Release);
        // Work that arrived after the last check and found the flag held.
        if next_job(&shard).is_none()
            || shard
                .job_active
                .compare_exchange(false, true, Ordering::AcqRel, Ordering::Acquire)
                .is_err()
        {
            return;
        }
    }
}

fn next_job(shard: &ShardServer) -> Option<Job> {
    if shard.build_requested.load(Ordering::Acquire) > shard.build_done.load(Ordering::Acquire) {
        return Some(Job::Full);
    }
    if !shard.split_ready() {
        return None;
    }
    let tables = shard.live_tables();
    // Tables stopped at s_stop first, then those in PRE_RESIZE.
    if let Some(t) = tables
        .iter()
        .find(|t| t.state.load(Ordering::Acquire) == state::REBUILDING)
    {
        return Some(Job::Resize(t.id, Start::StopFill));
    }
    let start = if shard.all_told() {
        Start::AllTold
    } else {
        Start::Timeout
    };
    tables
        .iter()
        .find(|t| t.state.load(Ordering::Acquire) == state::PRE_RESIZE)
        .map(|t| Job::Resize(t.id, start))
}

/// Creates a table (regions, seeds, locator) for `build`.
pub(crate) fn create_table(
    ctx: &NodeCtx,
    shard: u16,
    id: u32,
    build: LudoBuild,
    local_depth: u8,
) -> Result<Arc<Table>, ServiceError> {
    let layout = TableLayout::new(build.buckets);
    let region = ctx.region(&table_name(shard, id), layout.region_len())?;
    let loc = encode_locator(&build.othello);
    let locator = ctx.region(
        &locator_name(shard, id),
        locator_len(build.othello.ma(), build.othello.mb()),
    )?;
    locator
        .mem
        .write(0, &loc)
        .map_err(|e| ServiceError::failed(format!("outback: locator region: {e}")))?;
    let t = Table {
        id,
        buckets: build.buckets,
        layout,
        region,
        locator,
        bucket_seed: build.bucket_seed,
        othello: build.othello,
        epoch: AtomicU32::new(1),
        local_depth: AtomicU8::new(local_depth),
        state: AtomicU8::new(state::NORMAL),
        pre_resize_since: Mutex::new(None),
        overflow: Mutex::new(Overflow::default()),
        overflow_len: AtomicUsize::new(0),
        overflow_cap: ctx.cfg.overflow_capacity(build.buckets),
        slot_keys: AtomicU64::new(0),
        buffer: Mutex::new(Buffer::default()),
    };
    t.init_seeds(&build.seeds);
    Ok(Arc::new(t))
}

/// Builds and creates a table holding `keys` (entries filled later).
fn new_table(
    shard: &ShardServer,
    keys: &[u64],
    buckets: u32,
    local_depth: u8,
) -> Result<(Arc<Table>, LudoBuild), ServiceError> {
    let id = shard.next_table.fetch_add(1, Ordering::AcqRel);
    let build = ludo::build(
        keys,
        buckets,
        dmkv_transport::sim::random_u64(),
        dmkv_transport::sim::random_u64(),
    );
    shard
        .stats
        .fallback_keys
        .fetch_add(build.fallback as u64, Ordering::Relaxed);
    // The build's own arrays are not registered memory: charged by the
    // lines it counted (sim only; a no-op elsewhere).
    dmkv_transport::sim::charge_private_lines(build.lines);
    dmkv_transport::sim::work(cost::BUILD_KEY * keys.len() as u64);
    let placement = LudoBuild {
        othello: crate::othello::Othello::empty(),
        ..build.clone()
    };
    let t = create_table(&shard.ctx, shard.id, id, build, local_depth)?;
    Ok((t, placement))
}

/// The table for a shard that has no keys yet.
pub(crate) fn empty_table(
    ctx: &NodeCtx,
    shard: u16,
    id: u32,
    cfg: &Config,
) -> Result<Arc<Table>, ServiceError> {
    let build = ludo::build(
        &[],
        cfg.initial_buckets,
        dmkv_transport::sim::random_u64(),
        dmkv_transport::sim::random_u64(),
    );
    create_table(ctx, shard, id, build, 0)
}

/// A progress point of a resize (sim only, docs/outback.md "Resizes in
/// virtual time"): the CPU the worker was charged since the last one passes
/// now in virtual time, on the node's handler cores in turns with the
/// requests queued there (`resize_share_handlers`) or on the worker's own
/// core, while requests go on being served. Called only where the worker
/// holds no lock. Elsewhere the work took its time already.
fn pace(shard: &ShardServer) {
    let cfg = &shard.ctx.cfg;
    dmkv_transport::sim::job_progress(
        cfg.resize_share_handlers.then_some(shard.ctx.node),
        cfg.resize_slice_us * 1000,
    );
}

/// Buckets a resize snapshots between two progress points.
const PACE_BUCKETS: u32 = 64;

/// A key's position in a table at snapshot time.
#[derive(Debug, Clone, Copy)]
struct Snap {
    key: u64,
    table: u32,
    bucket: u32,
    /// `None`: in the overflow cache.
    slot: Option<u8>,
    /// The block address the slot held at snapshot time (0 for overflow).
    addr: u64,
}

/// Every key of `t` and where it is, bucket by bucket under the locks
/// (inserts and deletes are already buffered, so the set is then fixed).
/// With `paced`, a progress point every [`PACE_BUCKETS`] buckets.
fn snapshot(
    shard: &ShardServer,
    t: &Table,
    out: &mut Vec<Snap>,
    paced: bool,
) -> Result<(), ServiceError> {
    for b in 0..t.buckets {
        if paced && b % PACE_BUCKETS == 0 && b > 0 {
            pace(shard);
        }
        let _g = t.lock(b);
        let listed = out.len();
        for s in 0..ludo::SLOTS {
            let w = t.slot(b, s);
            if !w.is_empty() {
                out.push(Snap {
                    key: shard.heap.key_at(w.addr())?,
                    table: t.id,
                    bucket: b,
                    slot: Some(s as u8),
                    addr: w.addr(),
                });
            }
        }
        for &key in t.overflow.lock().keys_of(b) {
            out.push(Snap {
                key,
                table: t.id,
                bucket: b,
                slot: None,
                addr: 0,
            });
        }
        dmkv_transport::sim::work(
            cost::SNAPSHOT_BUCKET + cost::SNAPSHOT_KEY * (out.len() - listed) as u64,
        );
    }
    Ok(())
}

/// The current entry of a snapshotted key (under its bucket's lock); with
/// `clear`, the key leaves the table.
fn take_entry(
    shard: &ShardServer,
    t: &Table,
    s: &Snap,
    clear: bool,
) -> Result<SlotWord, ServiceError> {
    let e = match s.slot {
        Some(slot) => {
            let w = t.slot(s.bucket, slot as usize);
            // An unchanged address is the same block, so the same key
            // (blocks are immutable while referenced); an UPDATE during
            // the rebuild moved it to a new block, whose key is read.
            if w.is_empty() || w.addr() != s.addr && shard.heap.key_at(w.addr())? != s.key {
                return Err(ServiceError::failed(format!(
                    "outback: key {:#x} moved during a rebuild (bug)",
                    s.key
                )));
            }
            if clear {
                t.set_slot(s.bucket, slot as usize, w.cleared());
                t.slot_keys.fetch_sub(1, Ordering::Relaxed);
            }
            w.entry()
        }
        None => {
            let mut o = t.overflow.lock();
            let (_, e) = o.get(s.key).ok_or_else(|| {
                ServiceError::failed(format!(
                    "outback: overflow key {:#x} vanished during a rebuild (bug)",
                    s.key
                ))
            })?;
            if clear {
                o.remove(s.key);
                t.overflow_len.fetch_sub(1, Ordering::Relaxed);
            }
            e
        }
    };
    Ok(e)
}

/// Puts `entries` (key, entry) into the freshly built `t` at the placements
/// of `build` (same order).
fn fill(t: &Table, build: &LudoBuild, entries: &[(u64, SlotWord)]) {
    dmkv_transport::sim::work((cost::FILL_KEY + cost::KEY_OWN) * entries.len() as u64);
    let mut overflow = t.overflow.lock();
    let mut cache_buckets = Vec::new();
    for (i, &(key, e)) in entries.iter().enumerate() {
        let p = build.placement[i];
        match p.slot {
            Some(s) => {
                t.set_slot(p.bucket, s as usize, e);
                t.slot_keys.fetch_add(1, Ordering::Relaxed);
            }
            None => {
                overflow.insert(key, p.bucket, e);
                t.overflow_len.fetch_add(1, Ordering::Relaxed);
                cache_buckets.push(p.bucket);
            }
        }
    }
    for b in cache_buckets {
        t.refresh_cache_bits(b, build.seeds[b as usize], overflow.keys_of(b));
    }
}

fn execute(shard: &Arc<ShardServer>, job: Job) -> Result<(), ServiceError> {
    let started = Instant::now();
    let old: Vec<Arc<Table>> = match job {
        Job::Full => shard.live_tables(),
        Job::Resize(id, _) => shard.table(id).into_iter().collect(),
    };
    if old.is_empty() && job != Job::Full {
        return Ok(());
    }
    if let Job::Resize(_, start) = job {
        let st = &shard.stats;
        match start {
            Start::AllTold => &st.start_all_told,
            Start::Timeout => &st.start_timeout,
            Start::StopFill => &st.start_stop_fill,
        }
        .fetch_add(1, Ordering::Relaxed);
    }
    let build_target = shard.build_requested.load(Ordering::Acquire);
    // Freeze: from here inserts and deletes to these tables are buffered.
    shard.resize_pending.store(true, Ordering::Release);
    shard.rebuilding.store(
        match job {
            Job::Full => crate::server::shard::REBUILD_FULL,
            Job::Resize(..) => crate::server::shard::REBUILD_SPLIT,
        },
        Ordering::Release,
    );
    for t in &old {
        t.state.store(state::REBUILDING, Ordering::Release);
    }
    let result = match job {
        Job::Full => full(shard, &old, build_target, started),
        Job::Resize(..) => resize(shard, &old[0], started),
    };
    if let Err(e) = result {
        // Failed before the switch (regions, depth): the tables serve on
        // and the buffered writes are applied to them.
        // Their pending writes are merged into them first (invariant 17).
        for t in &old {
            let merged = settle_in_place(shard, t);
            t.state.store(state::NORMAL, Ordering::Release);
            t.buffer.lock().drained = false;
            if let Err(m) = merged {
                *shard.last_error.lock() = Some(m.to_string());
            }
        }
        finish(shard, job, build_target, started, None);
        return Err(e);
    }
    Ok(())
}

/// Merges the pending writes of `t` (invariant 17) into `t` itself: a
/// resize that failed before its switch, or a full build that takes over a
/// table stopped at s_stop. Writers are turned away first (`drained`: they
/// are answered STALE and retry); then every bucket is passed under its
/// lock, so a writer that held a lock when `drained` was set has added its
/// pending write before its bucket is taken.
fn settle_in_place(shard: &ShardServer, t: &Table) -> Result<(), ServiceError> {
    t.buffer.lock().drained = true;
    dmkv_transport::sim::work(cost::SETTLE_BUCKET * u64::from(t.buckets));
    for b in 0..t.buckets {
        let mut g = t.lock(b);
        let items = t.buffer.lock().take_bucket(b);
        dmkv_transport::sim::work(cost::MERGE * items.len() as u64);
        for (key, p) in items {
            shard.merge_pending(t, b, &mut g, key, p)?;
        }
    }
    Ok(())
}

/// Ends a rebuild: counts it, publishes progress and, if it published
/// (`retired`: the region prefixes of the tables it retired), hands those
/// over to be withdrawn after the countdown (`retire`: the worker does not
/// wait for compute nodes).
fn finish(
    shard: &Arc<ShardServer>,
    job: Job,
    build_target: u64,
    started: Instant,
    retired: Option<Vec<String>>,
) {
    let published = retired.is_some();
    if !shard
        .live_tables()
        .iter()
        .any(|t| t.state.load(Ordering::Acquire) != state::NORMAL)
    {
        shard.resize_pending.store(false, Ordering::Release);
    }
    shard
        .rebuilding
        .store(crate::server::shard::REBUILD_NONE, Ordering::Release);
    if job == Job::Full {
        shard.build_done.store(build_target, Ordering::Release);
    }
    shard.applied.fetch_add(1, Ordering::AcqRel);
    shard.publish_progress();
    if matches!(job, Job::Resize(..)) && published {
        let (bytes, keys) = shard.index_size();
        shard.stats.after_resize.lock().record(bytes, keys);
    }
    let held = started.elapsed().as_nanos() as u64;
    let st = &shard.stats;
    if job == Job::Full {
        st.full_build_ns.fetch_add(held, Ordering::Relaxed);
    } else {
        st.split_ns.fetch_add(held, Ordering::Relaxed);
        st.split_max_ns.fetch_max(held, Ordering::Relaxed);
    }
    let resize_started = (job != Job::Full).then_some(started);
    match retired {
        // Counted in `resize_total_ns` when its countdown ends.
        Some(prefixes) => crate::server::retire::after_countdown(shard, prefixes, resize_started),
        None => {
            if resize_started.is_some() {
                st.resize_total_ns
                    .fetch_add(started.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
        }
    }
}

/// Resize (extendible hashing, §4.4): every key of `t` goes into new
/// tables built for them at the growth load factor (fresh Othello and
/// seeds), so that compute nodes cache no more than a load factor's worth
/// per key; `t` is retired. A table of more than `table_keys` keys splits
/// in two on its next directory bit; a smaller one is rebuilt alone,
/// larger (its keys at the growth load factor).
///
/// Keeping the old table for the keys that stay (as an earlier version
/// did) left both halves of a split at half the old load factor: inserts
/// after a build have one bucket choice (the Othello's arbitrary bit), so
/// a table overflows at about half load and its split halves start at a
/// quarter; compute nodes then cached 6.3–7.1 bits per key instead of the
/// paper's ~5.
fn resize(shard: &Arc<ShardServer>, t: &Arc<Table>, started: Instant) -> Result<(), ServiceError> {
    let cfg = &shard.ctx.cfg;
    let d = t.local_depth.load(Ordering::Acquire);
    let mut snaps = Vec::new();
    snapshot(shard, t, &mut snaps, true)?;
    pace(shard);
    let split = snaps.len() as u64 > cfg.table_keys && d < cfg.max_global_depth;
    let side = |k: u64| if split { (dir(k) >> d & 1) as usize } else { 0 };
    let mut parts: Vec<Vec<usize>> = vec![Vec::new(); if split { 2 } else { 1 }];
    for (i, s) in snaps.iter().enumerate() {
        parts[side(s.key)].push(i);
    }
    let depth = if split { d + 1 } else { d };
    let load = growth_load(shard, t, &parts, split);
    let mut built = Vec::with_capacity(parts.len());
    for idx in &parts {
        let keys: Vec<u64> = idx.iter().map(|&i| snaps[i].key).collect();
        let buckets = cfg.buckets_at(keys.len(), load).max(cfg.initial_buckets);
        built.push(new_table(shard, &keys, buckets, depth)?);
        pace(shard);
    }

    // Switch: the epoch bump, then every bucket passed under its lock (a
    // barrier for writers that checked the old epoch) while the current
    // entries are read.
    t.epoch.fetch_add(1, Ordering::AcqRel);
    // `snapshot` lists keys bucket by bucket, in bucket order.
    let mut current = vec![SlotWord::default(); snaps.len()];
    let mut i = 0;
    for b in 0..t.buckets {
        let g = t.lock(b);
        let first = i;
        while i < snaps.len() && snaps[i].bucket == b {
            current[i] = take_entry(shard, t, &snaps[i], false)?;
            i += 1;
        }
        drop(g);
        dmkv_transport::sim::work(cost::SWITCH_BUCKET + cost::SWITCH_KEY * (i - first) as u64);
    }
    debug_assert_eq!(i, snaps.len());
    // The writes answered during the resize (invariant 17). After the
    // barrier none is added: a writer checks the epoch under its bucket's
    // lock and now gets STALE.
    let pend = {
        let mut buf = t.buffer.lock();
        buf.drained = true;
        std::mem::take(&mut buf.pend)
    };
    for ((nt, build), idx) in built.iter().zip(&parts) {
        let entries: Vec<(u64, SlotWord)> =
            idx.iter().map(|&i| (snaps[i].key, current[i])).collect();
        fill(nt, build, &entries);
    }
    // Merged before the new tables are installed, so that no request
    // reaches a new table without them: inserted keys are placed where
    // the new Othello sends them (one bucket choice, as any insert after
    // a build), deleted ones leave, and the blocks they killed are
    // recycled now that only the retired table points at them (requests
    // naming it get STALE since the epoch bump).
    dmkv_transport::sim::work(cost::MERGE * pend.len() as u64);
    for ((_, key), p) in pend {
        let nt = &built[side(key)].0;
        let b = candidates(key, nt.bucket_seed, nt.buckets)[nt.othello.lookup(key) as usize];
        let mut g = nt.lock(b);
        shard.merge_pending(nt, b, &mut g, key, p)?;
    }
    for (nt, _) in &built {
        shard.install(nt.clone());
    }
    {
        let mut dirs = shard.dir.lock();
        if split && d == dirs.global_depth {
            let copy = dirs.entries.clone();
            dirs.entries.extend(copy);
            dirs.global_depth += 1;
        }
        for (i, e) in dirs.entries.iter_mut().enumerate() {
            if *e == t.id {
                *e = built[if split { (i >> d) & 1 } else { 0 }].0.id;
            }
        }
    }
    shard.retire(t.id);
    for (nt, _) in &built {
        // Merged inserts may have filled a new table's overflow cache.
        shard.check_thresholds(nt);
    }
    if split {
        shard.stats.splits.fetch_add(1, Ordering::Relaxed);
    } else {
        shard.stats.grows.fetch_add(1, Ordering::Relaxed);
    }
    dmkv_transport::sim::work(cost::PUBLISH);
    shard.publish()?;
    // The switch's work passes here, while the new tables serve and the
    // buffered writes still wait (as they may on a real worker thread).
    pace(shard);
    finish(
        shard,
        Job::Resize(t.id, Start::AllTold),
        0,
        started,
        Some(vec![table_prefix(shard.id, t.id)]),
    );
    Ok(())
}

/// The load factor a resize of `t` builds its table(s) at: the lowest in
/// [`growth_load_factor`, `load_factor`] that keeps what a compute node
/// caches for the shard (Othello arrays, a seed byte per bucket, the
/// directory) within `growth_bits_per_key` of its keys. Tables elsewhere
/// in the shard that filled up since their own resize leave room, which
/// this one takes: the more room a table gets, the more inserts it absorbs
/// (each with one bucket choice) before its overflow cache starts the next
/// resize.
fn growth_load(shard: &ShardServer, t: &Table, parts: &[Vec<usize>], split: bool) -> f64 {
    let cfg = &shard.ctx.cfg;
    let mut others = 0u64;
    let mut keys = 0u64;
    for o in shard.live_tables() {
        keys += o.keys();
        if o.id != t.id {
            others += o.othello.bytes() + o.buckets as u64;
        }
    }
    let dir_entries = shard.dir.lock().entries.len() as u64;
    let dir_bytes = dir_entries * if split && dir_entries > 0 { 8 } else { 4 };
    let othello: u64 = parts
        .iter()
        .map(|p| crate::othello::Othello::expected_bytes(p.len()))
        .sum();
    let n: usize = parts.iter().map(Vec::len).sum();
    let budget = (cfg.growth_bits_per_key * keys as f64 / 8.0) as i64
        - (others + dir_bytes + othello) as i64;
    if n == 0 || budget <= 0 {
        return cfg.load_factor;
    }
    // One seed byte per bucket, four slots per bucket.
    (n as f64 / (4.0 * budget as f64)).clamp(cfg.growth_load_factor, cfg.load_factor)
}

/// Full build: every key of the shard, plus bulk-loaded ones, into new
/// tables sized for them at the target load factor.
fn full(
    shard: &Arc<ShardServer>,
    old: &[Arc<Table>],
    build_target: u64,
    started: Instant,
) -> Result<(), ServiceError> {
    // A full build answers no write meanwhile: writers are turned away
    // (STALE) until the new tables are published, and a table stopped at
    // s_stop merges the writes it answered first (invariant 17).
    for t in old {
        settle_in_place(shard, t)?;
    }
    // A build after a bulk load passes its CPU in virtual time before it
    // completes, so that the run starts after it (sim only).
    let paced = shard.pace_full.swap(false, Ordering::AcqRel);
    let mut snaps = Vec::new();
    for t in old {
        snapshot(shard, t, &mut snaps, paced)?;
    }
    let loaded: Vec<(u64, SlotWord)> = std::mem::take(&mut *shard.loaded.lock());
    dmkv_transport::sim::work(cost::LOADED_KEY * loaded.len() as u64);
    // Loaded pairs replace stored ones with the same key.
    let loaded_keys: HashMap<u64, usize> = loaded
        .iter()
        .enumerate()
        .map(|(i, (k, _))| (*k, i))
        .collect();
    let (kept, superseded): (Vec<Snap>, Vec<Snap>) = snaps
        .into_iter()
        .partition(|s| !loaded_keys.contains_key(&s.key));
    let mut loaded_unique: Vec<(u64, SlotWord)> = Vec::with_capacity(loaded_keys.len());
    let mut dup_loads: Vec<SlotWord> = Vec::new();
    for (i, (k, e)) in loaded.iter().enumerate() {
        if loaded_keys[k] == i {
            loaded_unique.push((*k, *e));
        } else {
            dup_loads.push(*e);
        }
    }
    let n = kept.len() + loaded_unique.len();
    let mut depth = 0u8;
    while (n >> depth) as u64 > shard.ctx.cfg.table_keys && depth < shard.ctx.cfg.max_global_depth {
        depth += 1;
    }
    let parts = 1usize << depth;
    let part = |k: u64| (dir(k) & (parts as u64 - 1)) as usize;
    // Keys per part: kept snapshots (entries read at the switch) and
    // loaded entries.
    enum Src {
        Kept(usize),
        Loaded(SlotWord),
    }
    let mut part_keys: Vec<Vec<u64>> = vec![Vec::new(); parts];
    let mut part_src: Vec<Vec<Src>> = (0..parts).map(|_| Vec::new()).collect();
    for (i, s) in kept.iter().enumerate() {
        part_keys[part(s.key)].push(s.key);
        part_src[part(s.key)].push(Src::Kept(i));
    }
    for &(k, e) in &loaded_unique {
        part_keys[part(k)].push(k);
        part_src[part(k)].push(Src::Loaded(e));
    }
    let cfg = &shard.ctx.cfg;
    let mut built = Vec::with_capacity(parts);
    for keys in &part_keys {
        let buckets = if keys.is_empty() {
            cfg.initial_buckets
        } else {
            cfg.buckets_for(keys.len())
        };
        built.push(new_table(shard, keys, buckets, depth)?);
        if paced {
            pace(shard);
        }
    }

    // Switch: every old bucket is passed under its lock after the epoch
    // bump; current entries of kept keys are read there.
    let mut current: Vec<SlotWord> = vec![SlotWord::default(); kept.len()];
    let mut old_entries: Vec<SlotWord> = Vec::with_capacity(superseded.len());
    enum Pos {
        Kept(usize),
        Superseded(usize),
    }
    let mut by_pos: HashMap<(u32, u32), Vec<Pos>> = HashMap::new();
    for (i, s) in kept.iter().enumerate() {
        by_pos
            .entry((s.table, s.bucket))
            .or_default()
            .push(Pos::Kept(i));
    }
    for (i, s) in superseded.iter().enumerate() {
        by_pos
            .entry((s.table, s.bucket))
            .or_default()
            .push(Pos::Superseded(i));
    }
    for t in old {
        t.epoch.fetch_add(1, Ordering::AcqRel);
    }
    for t in old {
        for b in 0..t.buckets {
            let g = t.lock(b);
            let items = by_pos.get(&(t.id, b));
            dmkv_transport::sim::work(
                cost::SWITCH_BUCKET + cost::SWITCH_KEY * items.map_or(0, |v| v.len() as u64),
            );
            if let Some(items) = items {
                for item in items {
                    match *item {
                        Pos::Kept(i) => current[i] = take_entry(shard, t, &kept[i], false)?,
                        Pos::Superseded(i) => {
                            old_entries.push(take_entry(shard, t, &superseded[i], false)?)
                        }
                    }
                }
            }
            drop(g);
        }
    }
    for (p, (nt, build)) in built.iter().enumerate() {
        let entries: Vec<(u64, SlotWord)> = part_src[p]
            .iter()
            .zip(&part_keys[p])
            .map(|(src, &k)| match src {
                Src::Kept(i) => (k, current[*i]),
                Src::Loaded(e) => (k, *e),
            })
            .collect();
        fill(nt, build, &entries);
        shard.install(nt.clone());
    }
    *shard.dir.lock() = Directory {
        global_depth: depth,
        entries: built.iter().map(|(t, _)| t.id).collect(),
    };
    for t in old {
        shard.retire(t.id);
    }
    // Blocks replaced by loaded pairs die (mirrors first).
    old_entries.extend(dup_loads);
    if !old_entries.is_empty() {
        let kills: Vec<MirrorOp> = old_entries
            .iter()
            .map(|e| MirrorOp::Kill {
                addr: e.addr(),
                words: e.len_words(),
            })
            .collect();
        shard
            .replicas
            .forward(&shard.ctx, &shard.heap.layout, &kills)?;
        for e in &old_entries {
            shard
                .heap
                .write(e.addr() + seq_offset(e.len_words()), &[0; 8])?;
            shard.heap.free(e.addr(), e.len_words());
        }
    }
    shard.stats.full_builds.fetch_add(1, Ordering::Relaxed);
    dmkv_transport::sim::work(cost::PUBLISH);
    shard.publish()?;
    if paced {
        pace(shard);
    }
    let retired = old.iter().map(|t| table_prefix(shard.id, t.id)).collect();
    finish(shard, Job::Full, build_target, started, Some(retired));
    Ok(())
}
