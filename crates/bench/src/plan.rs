//! A run's plan: its key universe and every task's request stream, fixed
//! before any engine runs so that every engine of the run gets the same keys
//! and the same operations.
//!
//! The key universe is a vector of distinct keys: indices `0..loaded` are
//! loaded before the run, the rest are inserted during it. Operations name
//! keys by index. Streams are deterministic functions of (seed, thread,
//! task) and the run's parameters, never of what an engine returns.
//!
//! Ownership (what makes exact checks possible): every key is owned by
//! exactly one task, and only its owner inserts or deletes it. A synthetic
//! run gives loaded key `i` to global task `i % T·C` and each insert key to
//! the task that inserts it; a trace gives every key to the task
//! `hash(key) % T·C`, which replays all of that key's operations in trace
//! order.

use crate::dist::{Latest, ScrambledZipfian, ZIPFIAN_THETA, zeta, zeta_extend};
use crate::error::BenchError;
use crate::keyset::{self, KeysetSpec};
use crate::partition::{PartChooser, PartitionSpec, Partitions};
use crate::rng::{Rng, derive_seed, mix64, stream};
use crate::trace::{Trace, TraceOpKind, key_universe};
use crate::workload::{Dist, MAX_SCAN_LEN, Mix, Op, OpType, Workload};
use std::collections::HashMap;

/// What a synthetic plan is made from.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticParams {
    pub workload: Workload,
    pub dist: Dist,
    pub keyset: KeysetSpec,
    /// Keys loaded before the run.
    pub keys: u64,
    /// Operations of the run (none for `load`).
    pub ops: u64,
    /// `--warmup-ops`: operations each task runs before `ops`, drawn from
    /// the same stream (same mix and distribution, its own insert keys
    /// first) and left out of the run's figures.
    pub warmup_ops: u64,
    pub threads: usize,
    pub tasks: usize,
    pub seed: u64,
    /// `--partitioned`: every thread draws from its node's partition of
    /// the loaded keys (see [`crate::partition`]).
    pub partition: Option<PartitionSpec>,
}

/// The key universe and the request streams of a run.
#[derive(Debug)]
pub struct Plan {
    keys: Vec<u64>,
    loaded: usize,
    /// (key, index), sorted by key: for scans and lookups.
    by_key: Vec<(u64, u32)>,
    threads: usize,
    tasks: usize,
    source: Source,
    /// Per global task: how many of its stream's first operations are the
    /// warm-up (`--warmup-ops`); the rest are the measured run.
    warm: Vec<u64>,
}

#[derive(Debug)]
enum Source {
    Synthetic(Synthetic),
    /// Per global task, its operations in trace order.
    Replay(Vec<Vec<Op>>),
}

#[derive(Debug)]
struct Synthetic {
    mix: Mix,
    dist: Dist,
    seed: u64,
    /// Per global task.
    ops: Vec<u64>,
    /// Per global task: the universe indices it inserts, in order.
    inserts: Vec<Vec<u32>>,
    /// ζ(loaded), for zipfian and latest.
    zeta_loaded: f64,
    /// `--partitioned`: the partitions keys are drawn from.
    partitions: Option<Partitions>,
}

impl Plan {
    /// A plan for a synthetic workload. `reserved` keys are never generated.
    pub fn synthetic(p: &SyntheticParams, reserved: &[u64]) -> Result<Plan, BenchError> {
        let total_tasks = p.threads * p.tasks;
        if total_tasks == 0 {
            return Err(BenchError::input(
                "--threads and --tasks must be at least 1",
            ));
        }
        let mix = p.workload.mix();
        let run_ops = if p.workload.has_run_phase() { p.ops } else { 0 };
        if run_ops > 0 && mix.reads_existing_keys() && p.keys == 0 {
            return Err(BenchError::input(format!(
                "workload {} operates on existing keys: --keys must be at least 1",
                p.workload
            )));
        }
        if run_ops > 0 && mix.delete > 0 && p.keys < total_tasks as u64 {
            return Err(BenchError::input(format!(
                "workload {} deletes keys, and each of the {total_tasks} tasks deletes only keys it owns: --keys must be at least threads x tasks = {total_tasks}",
                p.workload
            )));
        }
        if let Some(ps) = &p.partition {
            check_partitioned(p, ps, &mix)?;
        }
        if p.warmup_ops > 0 && run_ops == 0 {
            return Err(BenchError::input(format!(
                "--warmup-ops: workload {} has no run phase to warm up for",
                p.workload
            )));
        }
        if run_ops.checked_add(p.warmup_ops).is_none() {
            return Err(BenchError::input(
                "--ops plus --warmup-ops exceed 2^64 operations",
            ));
        }
        let warm = split_evenly(p.warmup_ops, total_tasks);
        // A task's stream: its warm-up, then its share of the run.
        let ops: Vec<u64> = split_evenly(run_ops, total_tasks)
            .into_iter()
            .zip(&warm)
            .map(|(run, warm)| warm + run)
            .collect();
        // Inserts per task: its kind stream alone decides them.
        let quotas: Vec<u64> = (0..total_tasks)
            .map(|g| {
                let mut kinds = KindStream::new(p.seed, g / p.tasks, g % p.tasks, mix);
                (0..ops[g])
                    .filter(|_| kinds.next() == OpType::Insert)
                    .count() as u64
            })
            .collect();
        let inserted: u64 = quotas.iter().sum();
        let universe = p
            .keys
            .checked_add(inserted)
            .filter(|&n| n <= u32::MAX as u64)
            .ok_or_else(|| {
                BenchError::input(format!(
                    "{} loaded + {inserted} inserted keys exceed the harness's limit of 2^32 keys",
                    p.keys
                ))
            })?;
        let keys = keyset::generate(
            &p.keyset,
            universe as usize,
            reserved,
            derive_seed(p.seed, &[stream::KEYS]),
        )?;
        let loaded = p.keys as usize;
        let inserts = assign_round_robin(&quotas, loaded as u32);
        let zeta_loaded = match (p.dist, &p.partition) {
            // Partitioned draws use each partition's own ζ.
            (_, Some(_)) | (Dist::Uniform, None) => 0.0,
            (Dist::Zipfian | Dist::Latest, None) => zeta(p.keys, ZIPFIAN_THETA),
        };
        let mut plan = Plan::new(
            keys,
            loaded,
            p.threads,
            p.tasks,
            Source::Synthetic(Synthetic {
                mix,
                dist: p.dist,
                seed: p.seed,
                ops,
                inserts,
                zeta_loaded,
                partitions: None,
            }),
            warm,
        );
        if let (Some(ps), Source::Synthetic(s)) = (&p.partition, &mut plan.source) {
            s.partitions = Some(Partitions::new(
                ps.map,
                plan.by_key
                    .iter()
                    .filter(|&&(_, i)| (i as usize) < loaded)
                    .map(|&(_, i)| i)
                    .collect(),
                p.dist,
            ));
        }
        Ok(plan)
    }

    /// A plan replaying `trace`. Keys whose first operation is not an insert
    /// are loaded before the run; the others are inserted by the trace.
    pub fn from_trace(
        trace: &Trace,
        threads: usize,
        tasks: usize,
        reserved: &[u64],
    ) -> Result<Plan, BenchError> {
        Plan::from_trace_with_load(trace, None, threads, tasks, reserved, 0)
    }

    /// A plan replaying `trace` after loading exactly the keys of `load`
    /// (YCSB's load phase), or as [`Plan::from_trace`] without it; see
    /// [`key_universe`](crate::trace::key_universe). The first `warmup_ops`
    /// of the trace's operations (`--warmup-ops`) are its warm-up: each
    /// task's stream gives the warm-up its share of them, in proportion to
    /// its length, from its front.
    pub fn from_trace_with_load(
        trace: &Trace,
        load: Option<&[u64]>,
        threads: usize,
        tasks: usize,
        reserved: &[u64],
        warmup_ops: u64,
    ) -> Result<Plan, BenchError> {
        let total_tasks = threads * tasks;
        if total_tasks == 0 {
            return Err(BenchError::input(
                "--threads and --tasks must be at least 1",
            ));
        }
        let (keys, loaded) = key_universe(trace, load);
        if let Some(k) = keys.iter().find(|k| reserved.contains(k)) {
            return Err(BenchError::input(format!(
                "the trace uses key {k}, which an engine of this run reserves"
            )));
        }
        if keys.len() > u32::MAX as usize {
            return Err(BenchError::input(
                "the trace has more than 2^32 distinct keys",
            ));
        }
        let index: HashMap<u64, u32> = keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, i as u32))
            .collect();
        let mut streams: Vec<Vec<Op>> = vec![Vec::new(); total_tasks];
        for op in &trace.ops {
            let i = index[&op.key];
            streams[trace_owner(op.key, total_tasks)].push(match op.kind {
                TraceOpKind::Read => Op::Read(i),
                TraceOpKind::Insert => Op::Insert(i),
                TraceOpKind::Update => Op::Update(i),
                TraceOpKind::Delete => Op::Delete(i),
                TraceOpKind::Scan(n) => Op::Scan(i, n),
            });
        }
        let total = trace.ops.len() as u64;
        if warmup_ops > 0 && warmup_ops >= total {
            return Err(BenchError::input(format!(
                "--warmup-ops {warmup_ops}: the trace has {total} operations, and the warm-up must leave some to measure"
            )));
        }
        let lengths: Vec<u64> = streams.iter().map(|s| s.len() as u64).collect();
        let warm = split_proportionally(warmup_ops, &lengths);
        Ok(Plan::new(
            keys,
            loaded,
            threads,
            tasks,
            Source::Replay(streams),
            warm,
        ))
    }

    fn new(
        keys: Vec<u64>,
        loaded: usize,
        threads: usize,
        tasks: usize,
        source: Source,
        warm: Vec<u64>,
    ) -> Plan {
        let mut by_key: Vec<(u64, u32)> = keys
            .iter()
            .enumerate()
            .map(|(i, &k)| (k, i as u32))
            .collect();
        by_key.sort_unstable();
        Plan {
            keys,
            loaded,
            by_key,
            threads,
            tasks,
            source,
            warm,
        }
    }

    /// Every key of the run: loaded ones first, then inserted ones.
    pub fn keys(&self) -> &[u64] {
        &self.keys
    }

    pub fn key(&self, index: u32) -> u64 {
        self.keys[index as usize]
    }

    /// Reads universe key `index` and discards it: brings its cache line in
    /// ahead of the operation that will name it (the runner's lookahead).
    #[inline]
    pub fn touch_key(&self, index: u32) {
        std::hint::black_box(self.keys[index as usize]);
    }

    /// How many keys are loaded before the run (indices `0..loaded`).
    pub fn loaded(&self) -> usize {
        self.loaded
    }

    pub fn threads(&self) -> usize {
        self.threads
    }

    pub fn tasks(&self) -> usize {
        self.tasks
    }

    /// Operations of the measured run over all tasks (the warm-up's not
    /// included).
    pub fn total_ops(&self) -> u64 {
        let streams: u64 = match &self.source {
            Source::Synthetic(s) => s.ops.iter().sum(),
            Source::Replay(streams) => streams.iter().map(|s| s.len() as u64).sum(),
        };
        streams - self.warmup_ops()
    }

    /// Operations of the warm-up (`--warmup-ops`) over all tasks.
    pub fn warmup_ops(&self) -> u64 {
        self.warm.iter().sum()
    }

    /// How many of the first operations of `task` on `thread`'s stream are
    /// its warm-up.
    pub fn warmup_of(&self, thread: usize, task: usize) -> u64 {
        self.warm[thread * self.tasks + task]
    }

    /// The universe index of `key`, if it is in the universe.
    pub fn index_of(&self, key: u64) -> Option<u32> {
        self.by_key
            .binary_search_by_key(&key, |&(k, _)| k)
            .ok()
            .map(|p| self.by_key[p].1)
    }

    /// Universe keys ≥ `start`, ascending, with their indices.
    pub fn keys_from(&self, start: u64) -> &[(u64, u32)] {
        let p = self.by_key.partition_point(|&(k, _)| k < start);
        &self.by_key[p..]
    }

    /// Loaded keys in ascending key order: the order of the bulk load.
    pub fn load_order(&self) -> Vec<u32> {
        self.by_key
            .iter()
            .filter(|&&(_, i)| (i as usize) < self.loaded)
            .map(|&(_, i)| i)
            .collect()
    }

    /// The request stream of `task` on `thread`.
    pub fn stream(&self, thread: usize, task: usize) -> OpStream<'_> {
        assert!(thread < self.threads && task < self.tasks);
        let g = thread * self.tasks + task;
        match &self.source {
            Source::Replay(streams) => OpStream::Replay(streams[g].iter()),
            Source::Synthetic(s) => OpStream::Synthetic(Box::new(TaskGen::new(
                s,
                self.loaded as u64,
                thread,
                task,
                g,
                self.threads * self.tasks,
            ))),
        }
    }

    /// `--partitioned`: the partitions of the loaded keys.
    pub fn partitions(&self) -> Option<&Partitions> {
        match &self.source {
            Source::Synthetic(s) => s.partitions.as_ref(),
            Source::Replay(_) => None,
        }
    }

    /// The universe indices `task` on `thread` reads back in `--verify`.
    pub fn verify_indices(&self, thread: usize, task: usize) -> impl Iterator<Item = u32> {
        let g = thread * self.tasks + task;
        (g..self.keys.len())
            .step_by(self.threads * self.tasks)
            .map(|i| i as u32)
    }
}

/// What `--partitioned` needs of a synthetic plan.
fn check_partitioned(p: &SyntheticParams, ps: &PartitionSpec, mix: &Mix) -> Result<(), BenchError> {
    let n = ps.map.nodes();
    if n < 2 {
        return Err(BenchError::input(
            "--partitioned needs two or more nodes to partition over: --nodes K for a symmetric engine (ScaleStore), --compute-nodes K under --transport sim for the others",
        ));
    }
    if p.keys < n as u64 {
        return Err(BenchError::input(format!(
            "--partitioned over {n} nodes needs at least one loaded key per partition; --keys is {}",
            p.keys
        )));
    }
    if mix.insert > 0 || mix.delete > 0 {
        return Err(BenchError::input(format!(
            "--partitioned draws keys from the loaded key set; workload {} inserts or deletes keys (use reads, updates, scans and read-modify-writes)",
            p.workload
        )));
    }
    if p.dist == Dist::Latest {
        return Err(BenchError::input(
            "--partitioned draws uniform or zipfian keys within each partition; --dist latest has no meaning there",
        ));
    }
    Ok(())
}

/// `total` split over `parts`: the first `total % parts` get one more.
fn split_evenly(total: u64, parts: usize) -> Vec<u64> {
    let n = parts as u64;
    (0..n)
        .map(|g| total / n + u64::from(g < total % n))
        .collect()
}

/// `total` (less than the sum of `lengths`) split in proportion to
/// `lengths`, no part above its length: each gets the floor of its share,
/// and what the floors leave goes one by one to the first parts with room.
fn split_proportionally(total: u64, lengths: &[u64]) -> Vec<u64> {
    let sum: u64 = lengths.iter().sum();
    if sum == 0 {
        return vec![0; lengths.len()];
    }
    let mut parts: Vec<u64> = lengths
        .iter()
        .map(|&l| (total as u128 * l as u128 / sum as u128) as u64)
        .collect();
    let mut left = total - parts.iter().sum::<u64>();
    for (p, &l) in parts.iter_mut().zip(lengths) {
        if left == 0 {
            break;
        }
        if *p < l {
            *p += 1;
            left -= 1;
        }
    }
    parts
}

/// The task that owns a trace key.
pub fn trace_owner(key: u64, total_tasks: usize) -> usize {
    (mix64(key) % total_tasks as u64) as usize
}

/// Deals insert keys `first..` to tasks round robin, skipping tasks whose
/// quota is full; with a sequential key set, inserts then advance through
/// the key space together.
fn assign_round_robin(quotas: &[u64], first: u32) -> Vec<Vec<u32>> {
    let mut out: Vec<Vec<u32>> = quotas
        .iter()
        .map(|&q| Vec::with_capacity(q as usize))
        .collect();
    let mut next = first;
    let rounds = quotas.iter().copied().max().unwrap_or(0);
    for r in 0..rounds {
        for (g, &q) in quotas.iter().enumerate() {
            if r < q {
                out[g].push(next);
                next += 1;
            }
        }
    }
    out
}

/// The operation types of one task: a stream of its own, so that a plan can
/// count a task's inserts without drawing its keys.
struct KindStream {
    rng: Rng,
    mix: Mix,
}

impl KindStream {
    fn new(seed: u64, thread: usize, task: usize, mix: Mix) -> KindStream {
        KindStream {
            rng: Rng::new(derive_seed(
                seed,
                &[stream::OP_KINDS, thread as u64, task as u64],
            )),
            mix,
        }
    }
    fn next(&mut self) -> OpType {
        self.mix.pick(self.rng.below(100) as u32)
    }
}

/// A task's operations, in order.
pub enum OpStream<'a> {
    Synthetic(Box<TaskGen<'a>>),
    Replay(std::slice::Iter<'a, Op>),
}

impl OpStream<'_> {
    /// `--shift-every-ms`: the number of shifts elapsed, for the draws that
    /// follow (no effect unless the plan is partitioned).
    pub fn set_phase(&mut self, phase: u64) {
        if let OpStream::Synthetic(g) = self
            && let Chooser::Partitioned(c) = &mut g.chooser
        {
            c.phase = phase;
        }
    }
}

impl Iterator for OpStream<'_> {
    type Item = Op;
    fn next(&mut self) -> Option<Op> {
        match self {
            OpStream::Synthetic(g) => g.next(),
            OpStream::Replay(it) => it.next().copied(),
        }
    }
}

/// How a task picks existing keys.
enum Chooser {
    Uniform,
    /// Scrambled zipfian over loaded + all of this task's insert keys;
    /// draws of keys not inserted yet are redrawn (as YCSB does).
    Zipfian(ScrambledZipfian),
    /// Skewed-latest over loaded keys in load order followed by this task's
    /// inserted keys in insertion order: the newest is this task's last
    /// insert, or the last loaded key before it inserted any.
    Latest(Latest),
    /// `--partitioned`: from the partition the task's node is assigned.
    Partitioned(PartChooser),
}

/// Generates one task's synthetic stream.
pub struct TaskGen<'a> {
    partitions: Option<&'a Partitions>,
    loaded: u64,
    /// Global task number and the number of tasks.
    g: usize,
    total_tasks: usize,
    remaining: u64,
    kinds: KindStream,
    rng: Rng,
    inserts: &'a [u32],
    inserted: usize,
    chooser: Chooser,
}

/// Redraws of a not-yet-inserted zipfian item before falling back to a
/// modulo (bounds the time of pathological configurations).
const MAX_REDRAWS: usize = 64;

impl<'a> TaskGen<'a> {
    fn new(
        plan: &'a Synthetic,
        loaded: u64,
        thread: usize,
        task: usize,
        g: usize,
        total_tasks: usize,
    ) -> TaskGen<'a> {
        let inserts = &plan.inserts[g][..];
        let chooser = match (&plan.partitions, plan.dist) {
            (Some(parts), dist) => Chooser::Partitioned(parts.chooser(thread, dist)),
            (None, Dist::Uniform) => Chooser::Uniform,
            (None, Dist::Zipfian) => {
                let n = loaded + inserts.len() as u64;
                Chooser::Zipfian(ScrambledZipfian::with_zeta(
                    n,
                    zeta_extend(loaded, n, ZIPFIAN_THETA, plan.zeta_loaded),
                ))
            }
            (None, Dist::Latest) => Chooser::Latest(Latest::with_zeta(loaded, plan.zeta_loaded)),
        };
        TaskGen {
            partitions: plan.partitions.as_ref(),
            loaded,
            g,
            total_tasks,
            remaining: plan.ops[g],
            kinds: KindStream::new(plan.seed, thread, task, plan.mix),
            rng: Rng::new(derive_seed(
                plan.seed,
                &[stream::OP_KEYS, thread as u64, task as u64],
            )),
            inserts,
            inserted: 0,
            chooser,
        }
    }

    /// Keys this task can name: loaded ones and its own inserted ones.
    fn readable(&self) -> u64 {
        self.loaded + self.inserted as u64
    }

    /// A position in [0, readable()) drawn from the distribution.
    fn choose_position(&mut self) -> u64 {
        let n = self.readable();
        debug_assert!(n > 0, "the plan checked that there are keys to name");
        match &mut self.chooser {
            Chooser::Uniform => self.rng.below(n),
            Chooser::Latest(l) => l.next(n, &mut self.rng),
            Chooser::Partitioned(_) => unreachable!("partitioned draws go through choose()"),
            Chooser::Zipfian(z) => {
                for _ in 0..MAX_REDRAWS {
                    let j = z.next(&mut self.rng);
                    if j < n {
                        return j;
                    }
                }
                z.next(&mut self.rng) % n
            }
        }
    }

    /// A key drawn from the distribution, as a universe index.
    fn choose(&mut self) -> u32 {
        if let (Chooser::Partitioned(c), Some(parts)) = (&mut self.chooser, self.partitions) {
            return c.choose(parts, &mut self.rng);
        }
        let p = self.choose_position();
        self.index_at(p)
    }

    fn index_at(&self, position: u64) -> u32 {
        if position < self.loaded {
            position as u32
        } else {
            self.inserts[(position - self.loaded) as usize]
        }
    }

    /// A key this task owns, near `position` in the key order: loaded key
    /// `i` is owned by task `i % total_tasks`, so `i` moves to the owned key
    /// of its group of `total_tasks` (the plan checked loaded ≥ total_tasks).
    fn owned_index_near(&self, position: u64) -> u32 {
        if position >= self.loaded {
            return self.index_at(position);
        }
        let t = self.total_tasks as u64;
        let mut i = position - position % t + self.g as u64;
        if i >= self.loaded {
            i -= t;
        }
        i as u32
    }
}

impl Iterator for TaskGen<'_> {
    type Item = Op;
    fn next(&mut self) -> Option<Op> {
        if self.remaining == 0 {
            return None;
        }
        self.remaining -= 1;
        let op = match self.kinds.next() {
            OpType::Insert => {
                let i = self.inserts[self.inserted];
                self.inserted += 1;
                Op::Insert(i)
            }
            OpType::Read => Op::Read(self.choose()),
            OpType::Update => Op::Update(self.choose()),
            OpType::Rmw => Op::Rmw(self.choose()),
            OpType::Delete => {
                let p = self.choose_position();
                Op::Delete(self.owned_index_near(p))
            }
            OpType::Scan => {
                let i = self.choose();
                Op::Scan(i, self.rng.range_inclusive(1, MAX_SCAN_LEN) as u32)
            }
        };
        Some(op)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::partition::NodeMap;
    use crate::workload::parse_mix;

    #[test]
    fn warm_ups_split_in_proportion_to_the_streams() {
        assert_eq!(split_evenly(7, 3), vec![3, 2, 2]);
        assert_eq!(split_proportionally(0, &[4, 0, 9]), vec![0, 0, 0]);
        // Floors 2, 0, 4 leave one, which goes to the first with room.
        assert_eq!(split_proportionally(7, &[4, 1, 9]), vec![3, 0, 4]);
        // Never above a stream's length, even where its floor is.
        assert_eq!(split_proportionally(13, &[4, 1, 9]), vec![4, 1, 8]);
        assert_eq!(split_proportionally(5, &[0, 10]), vec![0, 5]);
    }

    #[test]
    fn round_robin_respects_quotas_and_interleaves() {
        let a = assign_round_robin(&[2, 0, 3], 10);
        assert_eq!(a, vec![vec![10, 12], vec![], vec![11, 13, 14]]);
    }

    fn partitioned(
        dist: Dist,
        workload: Workload,
        map: NodeMap,
        threads: usize,
    ) -> SyntheticParams {
        SyntheticParams {
            workload,
            dist,
            keyset: KeysetSpec::Uniform,
            keys: 1000,
            // 600 draws per task: 100 in each of up to 6 phases.
            ops: 1200 * threads as u64,
            warmup_ops: 0,
            threads,
            tasks: 2,
            seed: 7,
            partition: Some(PartitionSpec { map }),
        }
    }

    /// Invariant 2 of `partition` on real drawn keys: before a shift every
    /// key a thread names lies in its node's partition (by key value, the
    /// partition's min..=max), after k shifts in partition (node + k) mod N;
    /// and the draws reach every key range they should (not a constant).
    #[test]
    fn partitioned_draws_stay_in_the_assigned_partition_across_shifts() {
        for dist in [Dist::Uniform, Dist::Zipfian] {
            for (map, threads) in [
                (NodeMap::Modulo { nodes: 5 }, 10),
                (
                    NodeMap::Block {
                        nodes: 3,
                        per_node: 2,
                    },
                    6,
                ),
            ] {
                let plan = Plan::synthetic(
                    &partitioned(
                        dist,
                        Workload::Mixed(parse_mix("50,30,0,0,10,10").unwrap()),
                        map,
                        threads,
                    ),
                    &[],
                )
                .unwrap();
                let parts = plan.partitions().expect("partitioned");
                let n = map.nodes();
                // Key ranges of the partitions, from the plan's keys.
                let range = |p: usize| {
                    let m = parts.members(p);
                    (plan.key(m[0]), plan.key(*m.last().unwrap()))
                };
                for p in 1..n {
                    assert!(range(p - 1).1 < range(p).0, "partitions are in key order");
                }
                for t in 0..threads {
                    let node = map.node_of(t);
                    let mut stream = plan.stream(t, 0);
                    for phase in 0..(n as u64 + 1) {
                        stream.set_phase(phase);
                        let want = (node + phase as usize) % n;
                        let (lo, hi) = range(want);
                        let mut seen = std::collections::BTreeSet::new();
                        let mut drawn = 0;
                        for op in stream.by_ref().take(100) {
                            drawn += 1;
                            let i = match op {
                                Op::Read(i) | Op::Update(i) | Op::Rmw(i) | Op::Scan(i, _) => i,
                                other => panic!("unexpected {other:?}"),
                            };
                            let k = plan.key(i);
                            assert!(
                                (lo..=hi).contains(&k),
                                "{dist} thread {t} (node {node}) phase {phase}: key {k} outside partition {want} [{lo}, {hi}]"
                            );
                            seen.insert(k);
                        }
                        assert_eq!(drawn, 100, "the stream lasts the test");
                        assert!(seen.len() > 10, "{dist}: draws spread over the partition");
                    }
                }
            }
        }
    }

    #[test]
    fn partitioned_refuses_what_it_cannot_do() {
        let map = NodeMap::Modulo { nodes: 4 };
        let err = |p: &SyntheticParams| Plan::synthetic(p, &[]).unwrap_err().to_string();
        assert!(
            err(&partitioned(Dist::Uniform, Workload::YcsbD, map, 4))
                .contains("inserts or deletes")
        );
        assert!(err(&partitioned(Dist::Latest, Workload::YcsbC, map, 4)).contains("latest"));
        let mut few = partitioned(Dist::Uniform, Workload::YcsbC, map, 4);
        few.keys = 3;
        assert!(err(&few).contains("at least one loaded key per partition"));
        let one = partitioned(
            Dist::Uniform,
            Workload::YcsbC,
            NodeMap::Modulo { nodes: 1 },
            4,
        );
        assert!(err(&one).contains("two or more nodes"));
    }
}
