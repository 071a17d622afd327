//! Reports: one [`EngineReport`] per engine run, printed as a table (with
//! ratios to the first engine) and written as JSON.
//!
//! Per-operation figures are totals over the run's workload operations
//! divided by their count; the load and `--verify` are reported apart.
//! Counters are exact (see [`crate::metered`]); only latency and
//! throughput depend on the machine.

use crate::check::{Findings, Problem};
use crate::stats::{Errors, OpFigures, VerifyFigures};
use crate::workload::OpType;
use dmkv_memnode::NodeStats;
use dmkv_transport::Counters;
use hdrhistogram::Histogram;
use serde::Serialize;
use std::collections::BTreeMap;
use std::io::{self, Write};
use std::path::Path;

/// Latency percentiles in microseconds.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct Latency {
    pub p50: f64,
    pub p99: f64,
    pub p999: f64,
    pub mean: f64,
    pub max: f64,
}

impl Latency {
    /// From a histogram of nanoseconds.
    pub fn from_ns(h: &Histogram<u64>) -> Latency {
        if h.is_empty() {
            return Latency::default();
        }
        let us = |ns: u64| ns as f64 / 1000.0;
        Latency {
            p50: us(h.value_at_quantile(0.50)),
            p99: us(h.value_at_quantile(0.99)),
            p999: us(h.value_at_quantile(0.999)),
            mean: h.mean() / 1000.0,
            max: us(h.max()),
        }
    }
}

/// Costs per operation (or per loaded key): totals divided by a count.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct PerOp {
    /// Network round trips (a verb, a doorbell batch or an RPC).
    pub round_trips: f64,
    /// One-sided verbs: reads + writes + cas + faa.
    pub verbs: f64,
    pub reads: f64,
    pub writes: f64,
    pub cas: f64,
    pub faa: f64,
    pub rpcs: f64,
    pub bytes_read: f64,
    pub bytes_written: f64,
    /// CPU time memory-node handlers spent on this operation's RPCs.
    pub memnode_cpu_ns: f64,
}

impl PerOp {
    pub fn new(c: &Counters, n: u64) -> PerOp {
        if n == 0 {
            return PerOp::default();
        }
        let d = |x: u64| x as f64 / n as f64;
        PerOp {
            round_trips: d(c.round_trips),
            verbs: d(c.verbs),
            reads: d(c.reads),
            writes: d(c.writes),
            cas: d(c.cas),
            faa: d(c.faa),
            rpcs: d(c.rpcs),
            bytes_read: d(c.bytes_read),
            bytes_written: d(c.bytes_written),
            memnode_cpu_ns: d(c.memnode_cpu_ns),
        }
    }
}

/// Exact totals of counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct Totals {
    pub round_trips: u64,
    pub verbs: u64,
    pub reads: u64,
    pub writes: u64,
    pub cas: u64,
    pub faa: u64,
    pub rpcs: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    pub memnode_cpu_ns: u64,
}

impl From<&Counters> for Totals {
    fn from(c: &Counters) -> Totals {
        Totals {
            round_trips: c.round_trips,
            verbs: c.verbs,
            reads: c.reads,
            writes: c.writes,
            cas: c.cas,
            faa: c.faa,
            rpcs: c.rpcs,
            bytes_read: c.bytes_read,
            bytes_written: c.bytes_written,
            memnode_cpu_ns: c.memnode_cpu_ns,
        }
    }
}

/// One operation type's figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct OpReport {
    pub count: u64,
    #[serde(flatten)]
    pub per_op: PerOp,
    pub latency_us: Latency,
}

impl OpReport {
    pub fn new(f: &OpFigures) -> OpReport {
        OpReport {
            count: f.count,
            per_op: PerOp::new(&f.cost, f.count),
            latency_us: Latency::from_ns(&f.latency),
        }
    }
}

/// The bulk load before the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LoadReport {
    pub keys: u64,
    pub seconds: f64,
    pub keys_per_s: f64,
    /// Costs per loaded key.
    pub per_key: PerOp,
}

/// `--warmup-ops`: the operations run before the measured run, left out of
/// its figures (their errors and wrong answers are in the run's `errors`
/// and `checks`, so a warm-up can fail a run).
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WarmupReport {
    /// Operations completed.
    pub ops: u64,
    /// From the warm-up's start to its last operation's end: virtual time
    /// under `sim`; else the slowest thread's, wall-clock.
    pub seconds: f64,
    /// Costs per warm-up operation (against the run's `per_op`: what a
    /// cold cache cost, for example).
    pub per_op: PerOp,
    /// The design's figures (`Engine::stats`) when the run started: the
    /// report's `engine_stats` count from the engine's connect, so a
    /// counter's share of the run is its value there less its value here.
    pub engine_stats: serde_json::Value,
}

/// Memory-node figures: differences over the run (from its start to the
/// end of its last operation), and memory after it; summed over nodes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct MemnodeReport {
    pub nodes: usize,
    pub rpcs_served: u64,
    pub handler_cpu_ns: u64,
    pub background_cpu_ns: u64,
    pub background_jobs: u64,
    /// CPU of the transport's progress threads on the memory nodes during
    /// the run (UCX over TCP serves emulated one-sided verbs there; 0 for
    /// the in-process transport).
    pub progress_cpu_ns: u64,
    /// Bytes of registered memory in use after the run.
    pub memory_used: u64,
    /// Bytes of registered memory reserved after the run.
    pub memory_reserved: u64,
}

impl MemnodeReport {
    pub fn new(before: &[NodeStats], after: &[NodeStats]) -> MemnodeReport {
        let sum = |v: &[NodeStats], f: fn(&NodeStats) -> u64| v.iter().map(f).sum::<u64>();
        let delta = |f: fn(&NodeStats) -> u64| sum(after, f).saturating_sub(sum(before, f));
        MemnodeReport {
            nodes: after.len(),
            rpcs_served: delta(|s| s.rpcs_served),
            handler_cpu_ns: delta(|s| s.handler_cpu_ns),
            background_cpu_ns: delta(|s| s.background_cpu_ns),
            background_jobs: delta(|s| s.background_jobs),
            progress_cpu_ns: delta(|s| s.progress_cpu_ns),
            memory_used: sum(after, |s| s.memory_used),
            memory_reserved: sum(after, |s| s.memory_reserved),
        }
    }
}

/// `--verify`: every key of the universe read back after the run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct VerifyReport {
    pub enabled: bool,
    pub checked: u64,
    pub mismatches: u64,
    pub missing: u64,
    pub unexpected: u64,
    pub skipped: u64,
    pub errors: u64,
    pub samples: Vec<String>,
}

impl VerifyReport {
    pub fn new(v: Option<&VerifyFigures>) -> VerifyReport {
        match v {
            None => VerifyReport::default(),
            Some(v) => VerifyReport {
                enabled: true,
                checked: v.checked,
                mismatches: v.mismatches,
                missing: v.missing,
                unexpected: v.unexpected,
                skipped: v.skipped,
                errors: v.errors,
                samples: v.samples.clone(),
            },
        }
    }
    pub fn failures(&self) -> u64 {
        self.mismatches + self.missing + self.unexpected + self.errors
    }
}

/// Wrong answers found while the workload ran.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ChecksReport {
    pub failures: u64,
    pub by_problem: BTreeMap<String, u64>,
    pub samples: Vec<String>,
}

impl ChecksReport {
    pub fn new(f: &Findings) -> ChecksReport {
        ChecksReport {
            failures: f.total(),
            by_problem: Problem::ALL
                .iter()
                .filter(|p| f.count(**p) > 0)
                .map(|p| (p.name().to_string(), f.count(*p)))
                .collect(),
            samples: f.samples.clone(),
        }
    }
}

/// Operations that failed with an error, and errors outside operations.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct ErrorsReport {
    pub count: u64,
    pub by_op: BTreeMap<String, u64>,
    pub samples: Vec<String>,
}

impl ErrorsReport {
    pub fn new(e: &Errors) -> ErrorsReport {
        let mut by_op: BTreeMap<String, u64> = OpType::ALL
            .iter()
            .filter(|t| e.by_op[t.index()] > 0)
            .map(|t| (t.name().to_string(), e.by_op[t.index()]))
            .collect();
        if e.other > 0 {
            by_op.insert("other".into(), e.other);
        }
        ErrorsReport {
            count: e.total(),
            by_op,
            samples: e.samples.clone(),
        }
    }
}

/// `--crash-memnode`: a memory node crashed during the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CrashReport {
    /// The memory node crashed (0-based).
    pub node: usize,
    pub at_fraction: f64,
    /// The completion of this operation (1-based, all threads) crashed it.
    pub at_op: u64,
    /// The crash happened (false: the run never reached `at_op`, or the
    /// transport refused; see `failure`).
    pub crashed: bool,
    /// When, in seconds after the run phase began.
    pub at_seconds: f64,
    /// Failover time as the clients saw it: the latency of the longest
    /// operation among those that completed after the crash (an operation
    /// on the lost node's keys waits until another node serves them; it
    /// includes whatever the operation spent before the crash, so it is an
    /// upper bound within one operation's normal latency).
    pub failover_ms: f64,
    pub ops_after_crash: u64,
    /// Operations that completed after the crash with an error.
    pub errors_after_crash: u64,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub failure: Option<String>,
}

/// What a trace replay read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceReport {
    pub path: String,
    pub lines: u64,
    pub operations: u64,
    pub ignored_lines: u64,
    /// `--trace-load`: YCSB's load phase, loaded before the replay.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub load: Option<TraceLoadReport>,
}

/// What a replay's load file (`--trace-load`) held.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TraceLoadReport {
    pub path: String,
    pub lines: u64,
    /// Keys inserted by the load phase (all loaded before the run).
    pub keys: u64,
    pub ignored_lines: u64,
}

/// One engine's run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EngineReport {
    pub engine: String,
    pub workload: String,
    pub dist: String,
    pub keyset: String,
    /// Keys loaded before the run.
    pub keys: u64,
    /// Workload operations run.
    pub ops: u64,
    pub value_size: usize,
    /// `--value-gen` when not the default (`random-string`): the JSON
    /// gives it in the run's description (`run.value_gen`, `dmkv bench
    /// --json`), with the command line.
    #[serde(skip)]
    pub value_gen: Option<String>,
    pub threads: usize,
    pub tasks_per_thread: usize,
    pub memnode_threads: usize,
    pub memnodes: usize,
    pub nodes: usize,
    pub transport: String,
    pub seed: u64,
    /// `--set` knobs of this engine.
    pub settings: BTreeMap<String, String>,
    pub throughput_ops_per_s: f64,
    pub run_seconds: f64,
    /// Real transports on Linux: how long the compute threads ran on a CPU
    /// during the run and how long they waited for one (a timing, like
    /// `run_seconds`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub compute_threads: Option<crate::schedstat::ComputeSchedReport>,
    pub latency_us: Latency,
    pub per_op: PerOp,
    pub by_op: BTreeMap<String, OpReport>,
    /// The run's transport counters by operation label, exact totals (YCSB
    /// F's read-modify-write appears under get and update here).
    pub counters_by_kind: BTreeMap<String, Totals>,
    pub load: LoadReport,
    /// `--warmup-ops`: what ran before the measured run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warmup: Option<WarmupReport>,
    /// Costs of `--verify` (label `verify`), exact totals.
    pub verify_counters: Totals,
    /// What one compute process caches (compute node 0's engine under
    /// `--compute-nodes N`: every node keeps its own cache).
    pub client_cache_bytes: u64,
    /// Registered memory in use on the memory nodes after the run.
    pub memnode_bytes: u64,
    pub memnode: MemnodeReport,
    pub verify: VerifyReport,
    pub checks: ChecksReport,
    pub errors: ErrorsReport,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub trace: Option<TraceReport>,
    /// The engine's own figures (`Engine::stats` of the compute process
    /// that loaded). Under `sim` with several compute nodes, each node is a
    /// compute process of its own that counts its events into node 0's
    /// (`ConnectArgs::counters_from`): counters cover the whole cluster,
    /// while figures of one process's state (cache sizes) are node 0's.
    pub engine_stats: serde_json::Value,
    /// `--transport sim`: the simulated cluster's figures (`throughput`,
    /// `run_seconds`, latencies and `load.seconds` are then virtual time).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sim: Option<SimReport>,
    /// Real threads (not `sim`): what the OS gave each thread of this
    /// process during the run phase and what the rest of the host used
    /// (`crate::sched`). Wall-clock evidence like latencies: it differs
    /// between two runs of one seed and is left out of exactness diffs.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sched: Option<crate::sched::SchedReport>,
    #[serde(skip_serializing_if = "Option::is_none")]
    pub crash: Option<CrashReport>,
    /// `--timeline-ms`: throughput per interval of the run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeline: Option<TimelineReport>,
    /// `--partitioned`: the partitions, the shifts, and the keys each node
    /// actually touched in each phase.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub partition: Option<PartitionReport>,
    /// No error, no failed check, no verification failure (and, with
    /// `--crash-memnode`, the crash happened).
    pub ok: bool,
}

/// Throughput over the run, interval by interval (virtual time under
/// `sim`); the last interval is usually partial.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimelineReport {
    pub interval_ms: f64,
    /// Operations completed in each interval.
    pub ops: Vec<u64>,
    /// The same, per second.
    pub ops_per_s: Vec<f64>,
    /// The median of `ops_per_s` over the whole intervals (the last,
    /// partial one left out): the level the run holds between dips.
    pub median_ops_per_s: f64,
    /// The 90th percentile of the same (nearest rank): the level the run
    /// recovers to between dips, such as the baseline a workload shift
    /// returns to (ScaleStore Fig. 9).
    pub p90_ops_per_s: f64,
    /// The window in which every client thread was running (branch i84),
    /// in ms from the run's start: from the latest first completion of a
    /// thread to the earliest last one. Absent if no thread completed an
    /// operation.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub all_running_ms: Option<[f64; 2]>,
    /// Throughput while every client thread was running: the operations
    /// of the whole intervals inside `all_running_ms`, per second of those
    /// intervals (null if no whole interval fits). With a fixed quota of
    /// operations per thread, the run's `throughput_ops_per_s` also counts
    /// the start, before every thread has completed one, and the end,
    /// where the slowest threads run alone; a steady state measured for a
    /// fixed time (ScaleStore's 90 s, §6.1) has neither.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steady_ops_per_s: Option<f64>,
    /// The engine's client counters (`Engine::client_counters`), counted
    /// per interval (sampled at interval boundaries, see
    /// `dmkv_bench::sampler`); absent for engines that export none.
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub engine: BTreeMap<String, Vec<u64>>,
    /// Each engine counter divided by the engine's `gets` in the same
    /// interval (null where the interval had no GET).
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    pub engine_per_get: BTreeMap<String, Vec<Option<f64>>>,
}

impl TimelineReport {
    pub fn new(
        t: &crate::stats::Timeline,
        engine: Option<&crate::sampler::EngineTimeline>,
    ) -> Option<TimelineReport> {
        if t.interval_ns == 0 {
            return None;
        }
        let secs = t.interval_ns as f64 / 1e9;
        let ops_per_s: Vec<f64> = t.counts.iter().map(|&c| c as f64 / secs).collect();
        let mut whole: Vec<f64> = ops_per_s[..ops_per_s.len().saturating_sub(1)].to_vec();
        if whole.is_empty() {
            whole = ops_per_s.clone();
        }
        whole.sort_by(f64::total_cmp);
        let median_ops_per_s = match whole.len() {
            0 => 0.0,
            n if n % 2 == 1 => whole[n / 2],
            n => (whole[n / 2 - 1] + whole[n / 2]) / 2.0,
        };
        let p90_ops_per_s = match whole.len() {
            0 => 0.0,
            n => whole[((n * 9).div_ceil(10)).clamp(1, n) - 1],
        };
        let counters: BTreeMap<String, Vec<u64>> = engine
            .map(|e| {
                e.counters
                    .iter()
                    .map(|(n, v)| (n.to_string(), v.clone()))
                    .collect()
            })
            .unwrap_or_default();
        let engine_per_get = match counters.get("gets") {
            Some(gets) => counters
                .iter()
                .filter(|(n, _)| *n != "gets")
                .map(|(n, v)| {
                    let rate = v
                        .iter()
                        .zip(gets)
                        .map(|(&c, &g)| (g > 0).then(|| c as f64 / g as f64))
                        .collect();
                    (n.clone(), rate)
                })
                .collect(),
            None => BTreeMap::new(),
        };
        let (all_running_ms, steady_ops_per_s) = match all_running(t) {
            Some((window, steady)) => (Some(window), steady),
            None => (None, None),
        };
        Some(TimelineReport {
            interval_ms: t.interval_ns as f64 / 1e6,
            ops: t.counts.clone(),
            ops_per_s,
            median_ops_per_s,
            p90_ops_per_s,
            all_running_ms,
            steady_ops_per_s,
            engine: counters,
            engine_per_get,
        })
    }
}

/// The timeline's all-running window in ms from its start, and the
/// throughput of the whole intervals inside it (None if none fits).
fn all_running(t: &crate::stats::Timeline) -> Option<([f64; 2], Option<f64>)> {
    let (from, to) = t.all_running?;
    let ms = |ns: u64| ns.saturating_sub(t.start_ns) as f64 / 1e6;
    // Whole intervals inside [from, to]: the first starting at or after
    // `from`, up to the last ending at or before `to`.
    let first = (from.saturating_sub(t.start_ns)).div_ceil(t.interval_ns) as usize;
    let end = (to.saturating_sub(t.start_ns) / t.interval_ns) as usize;
    let end = end.min(t.counts.len());
    let steady = (to > from && end > first).then(|| {
        let ops: u64 = t.counts[first..end].iter().sum();
        ops as f64 / ((end - first) as f64 * t.interval_ns as f64 / 1e9)
    });
    Some(([ms(from), ms(to)], steady))
}

/// `--partitioned`: how the run was partitioned and what it touched.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PartitionReport {
    pub partitions: usize,
    /// How threads map to nodes: `thread % nodes` (symmetric nodes) or
    /// `thread / threads` (compute nodes).
    pub node_of_thread: String,
    /// `--shift-every-ms` (0: no shifts).
    pub shift_every_ms: f64,
    /// Each partition's smallest and largest key.
    pub key_ranges: Vec<[u64; 2]>,
    /// Per phase (shifts elapsed) and node: the partition assigned and the
    /// smallest and largest key its operations actually named.
    pub touched: Vec<TouchedReport>,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct TouchedReport {
    pub phase: u64,
    pub node: usize,
    pub partition: usize,
    pub ops: u64,
    pub min_key: u64,
    pub max_key: u64,
}

impl PartitionReport {
    pub fn new(
        cfg: &crate::config::BenchConfig,
        plan: &crate::plan::Plan,
        parts: &crate::partition::Partitions,
        touched: &BTreeMap<(u64, usize), crate::runner::Touched>,
    ) -> PartitionReport {
        use crate::partition::NodeMap;
        PartitionReport {
            partitions: parts.count(),
            node_of_thread: match parts.map {
                NodeMap::Modulo { .. } => "thread % nodes".into(),
                NodeMap::Block { .. } => "thread / threads".into(),
            },
            shift_every_ms: cfg.shift_every_ns as f64 / 1e6,
            key_ranges: (0..parts.count())
                .map(|p| {
                    let m = parts.members(p);
                    [plan.key(m[0]), plan.key(m[m.len() - 1])]
                })
                .collect(),
            touched: touched
                .iter()
                .map(|(&(phase, node), t)| TouchedReport {
                    phase,
                    node,
                    partition: ((node as u64 + phase) % parts.count() as u64) as usize,
                    ops: t.ops,
                    min_key: t.min_key,
                    max_key: t.max_key,
                })
                .collect(),
        }
    }
}

/// What a simulated run reports besides the usual figures.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimReport {
    /// The hardware profile's name.
    pub profile: String,
    /// The spread of the clients' CPU per operation, when there is one
    /// (the profile's `client.cpu_per_op_spread_ns` or `--cpu-spread-ns`).
    #[serde(skip_serializing_if = "is_zero")]
    pub cpu_spread_ns: u64,
    pub compute_nodes: usize,
    /// Scheduler events of the run phase.
    pub events: u64,
    /// Messages of the run phase that arrived out of posting order between
    /// two nodes (the model's one exception to in-order arrival, never two
    /// messages of one endpoint: docs/simulation.md, "Reports").
    pub messages_overtaken: u64,
    /// Nested waits held over the whole simulation (load, run and verify):
    /// frames whose tasks were done while a synchronous wait started inside
    /// them still ran (`dmkv_transport::sim::FramesHeld`; docs/simulation.md,
    /// "The rule for synchronous waits"), in virtual nanoseconds.
    pub frames_held: dmkv_transport::sim::FramesHeld,
    /// Each modelled resource during the run phase, busiest first: the
    /// bottleneck is at the top.
    pub utilisation: Vec<ResourceReport>,
    /// Wall-clock figures: the only part of a simulated report that differs
    /// between two runs with the same seed and flags.
    pub wall: WallReport,
}

fn is_zero(n: &u64) -> bool {
    *n == 0
}

/// One resource's share of the run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ResourceReport {
    pub name: String,
    /// Busy time over (servers x run time), in percent.
    pub busy_percent: f64,
    /// Messages, jobs or operations served per second of virtual time.
    pub per_s: f64,
    /// Bytes per second of virtual time (NICs).
    pub bytes_per_s: f64,
    /// Mean queueing delay per message, job or operation served: the time
    /// from when it was ready until the resource started it, in ns. With
    /// `per_s`, the waiting this resource adds per second of run.
    pub mean_wait_ns: f64,
}

impl ResourceReport {
    /// Waiting at this resource per second of virtual time (ns/s): where
    /// operations queue, whichever resource is busiest.
    pub fn wait_ns_per_s(&self) -> f64 {
        self.mean_wait_ns * self.per_s
    }
}

/// Wall-clock time of a simulated run.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct WallReport {
    pub run_seconds: f64,
    /// Simulated operations per wall-clock second.
    pub sim_ops_per_s: f64,
}

impl SimReport {
    /// The run phase's report: its scheduler events and messages
    /// overtaken (after minus before), the simulation's held frames (all
    /// phases), its length, and the resources' figures before and after it.
    pub fn new(
        (profile, cpu_spread_ns): (&str, u64),
        compute_nodes: usize,
        (events, messages_overtaken, frames_held): (u64, u64, dmkv_transport::sim::FramesHeld),
        run_seconds: f64,
        before: &[dmkv_transport::sim::ResourceUse],
        after: &[dmkv_transport::sim::ResourceUse],
        wall: WallReport,
    ) -> SimReport {
        let mut utilisation: Vec<ResourceReport> = after
            .iter()
            .map(|a| {
                let b = before.iter().find(|b| b.name == a.name);
                let busy = a.busy_ns - b.map_or(0, |b| b.busy_ns);
                let count = a.count - b.map_or(0, |b| b.count);
                let bytes = a.bytes - b.map_or(0, |b| b.bytes);
                let wait = a.wait_ns - b.map_or(0, |b| b.wait_ns);
                let secs = run_seconds.max(1e-12);
                ResourceReport {
                    name: a.name.clone(),
                    busy_percent: busy as f64 / 1e9 / secs / a.servers as f64 * 100.0,
                    per_s: count as f64 / secs,
                    bytes_per_s: bytes as f64 / secs,
                    mean_wait_ns: if count > 0 {
                        wait as f64 / count as f64
                    } else {
                        0.0
                    },
                }
            })
            .filter(|r| r.per_s > 0.0)
            .collect();
        utilisation.sort_by(|a, b| {
            b.busy_percent
                .total_cmp(&a.busy_percent)
                .then_with(|| a.name.cmp(&b.name))
        });
        SimReport {
            profile: profile.to_string(),
            cpu_spread_ns,
            compute_nodes,
            events,
            messages_overtaken,
            frames_held,
            utilisation,
            wall,
        }
    }
}

/// The resources at which work queued, most waiting first: (class,
/// waiting in ns per second of run, mean busy percent of the class).
/// Client cores are one class over all nodes (`nodeN client core K` ->
/// `client cores`): a run has one per simulated thread, and what queues
/// at them is the threads' tasks, wherever they run; every other resource
/// is its own class.
fn queueing_by_class(utilisation: &[ResourceReport]) -> Vec<(String, f64, f64)> {
    let mut classes: Vec<(String, f64, f64, usize)> = Vec::new();
    for u in utilisation.iter().filter(|u| u.mean_wait_ns > 0.0) {
        let class = if u.name.contains(" client core ") {
            "client cores".to_string()
        } else {
            u.name.clone()
        };
        match classes.iter_mut().find(|c| c.0 == class) {
            Some(c) => {
                c.1 += u.wait_ns_per_s();
                c.2 += u.busy_percent;
                c.3 += 1;
            }
            None => classes.push((class, u.wait_ns_per_s(), u.busy_percent, 1)),
        }
    }
    let mut out: Vec<(String, f64, f64)> = classes
        .into_iter()
        .map(|(class, wait, busy, n)| (class, wait, busy / n as f64))
        .collect();
    out.sort_by(|a, b| b.1.total_cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
    out
}

/// Writes the reports as JSON: an object for one engine, an array for more.
pub fn write_json(path: &Path, reports: &[EngineReport]) -> io::Result<()> {
    let text = if reports.len() == 1 {
        serde_json::to_string_pretty(&reports[0])
    } else {
        serde_json::to_string_pretty(reports)
    }
    .map_err(io::Error::other)?;
    std::fs::write(path, text + "\n")
}

/// A row of the table: a label and one cell per report.
type Row = (String, Vec<String>);

fn f2(x: f64) -> String {
    format!("{x:.2}")
}

fn f1(x: f64) -> String {
    format!("{x:.1}")
}

fn verify_cell(r: &EngineReport) -> String {
    let v = &r.verify;
    if !v.enabled {
        "off".into()
    } else if v.failures() == 0 {
        format!("ok ({} keys)", v.checked)
    } else {
        format!(
            "FAILED: {} mismatched, {} missing, {} unexpected, {} errors",
            v.mismatches, v.missing, v.unexpected, v.errors
        )
    }
}

fn rows(reports: &[EngineReport]) -> Vec<Row> {
    let col = |f: &dyn Fn(&EngineReport) -> String| reports.iter().map(f).collect::<Vec<_>>();
    let mut rows: Vec<Row> = vec![
        (
            "throughput (ops/s)".into(),
            col(&|r| format!("{:.0}", r.throughput_ops_per_s)),
        ),
        ("latency p50 (us)".into(), col(&|r| f1(r.latency_us.p50))),
        ("latency p99 (us)".into(), col(&|r| f1(r.latency_us.p99))),
        ("latency p999 (us)".into(), col(&|r| f1(r.latency_us.p999))),
        (
            "round trips / op".into(),
            col(&|r| f2(r.per_op.round_trips)),
        ),
        ("verbs / op".into(), col(&|r| f2(r.per_op.verbs))),
        (
            "  read/write/cas/faa".into(),
            col(&|r| {
                format!(
                    "{}/{}/{}/{}",
                    f2(r.per_op.reads),
                    f2(r.per_op.writes),
                    f2(r.per_op.cas),
                    f2(r.per_op.faa)
                )
            }),
        ),
        ("rpcs / op".into(), col(&|r| f2(r.per_op.rpcs))),
        ("bytes read / op".into(), col(&|r| f1(r.per_op.bytes_read))),
        (
            "bytes written / op".into(),
            col(&|r| f1(r.per_op.bytes_written)),
        ),
        (
            "memnode cpu / op (ns)".into(),
            col(&|r| f1(r.per_op.memnode_cpu_ns)),
        ),
        (
            "memnode bg cpu (ms)".into(),
            col(&|r| f1(r.memnode.background_cpu_ns as f64 / 1e6)),
        ),
        (
            "memnode progress cpu (ms)".into(),
            col(&|r| f1(r.memnode.progress_cpu_ns as f64 / 1e6)),
        ),
        (
            "client cache (bytes)".into(),
            col(&|r| r.client_cache_bytes.to_string()),
        ),
        (
            "memnode memory (bytes)".into(),
            col(&|r| r.memnode_bytes.to_string()),
        ),
        (
            "load (keys/s)".into(),
            col(&|r| format!("{:.0}", r.load.keys_per_s)),
        ),
    ];
    if reports.iter().any(|r| r.compute_threads.is_some()) {
        let cell = |f: &dyn Fn(&crate::schedstat::ComputeSchedReport) -> String| {
            col(&|r| {
                r.compute_threads
                    .as_ref()
                    .map(f)
                    .unwrap_or_else(|| "-".into())
            })
        };
        rows.push((
            "compute cpu / op (ns)".into(),
            cell(&|c| f1(c.cpu_ns_per_op)),
        ));
        rows.push((
            "compute cpu / wait (ms)".into(),
            cell(&|c| {
                format!(
                    "{:.0} / {:.0}",
                    c.on_cpu_seconds * 1e3,
                    c.runqueue_wait_seconds * 1e3
                )
            }),
        ));
    }
    for t in OpType::ALL {
        let name = t.name();
        if !reports.iter().any(|r| r.by_op.contains_key(name)) {
            continue;
        }
        let cell = |f: &dyn Fn(&OpReport) -> String| {
            col(&|r| r.by_op.get(name).map(f).unwrap_or_else(|| "-".into()))
        };
        rows.push((format!("{name}: ops"), cell(&|o| o.count.to_string())));
        rows.push((
            format!("{name}: rt / verbs / rpcs"),
            cell(&|o| {
                format!(
                    "{} / {} / {}",
                    f2(o.per_op.round_trips),
                    f2(o.per_op.verbs),
                    f2(o.per_op.rpcs)
                )
            }),
        ));
        rows.push((
            format!("{name}: bytes r / w"),
            cell(&|o| {
                format!(
                    "{} / {}",
                    f1(o.per_op.bytes_read),
                    f1(o.per_op.bytes_written)
                )
            }),
        ));
        rows.push((
            format!("{name}: p50 / p99 (us)"),
            cell(&|o| format!("{} / {}", f1(o.latency_us.p50), f1(o.latency_us.p99))),
        ));
    }
    rows.push(("verify".into(), col(&|r| verify_cell(r))));
    rows.push((
        "check failures".into(),
        col(&|r| r.checks.failures.to_string()),
    ));
    rows.push(("errors".into(), col(&|r| r.errors.count.to_string())));
    if reports.iter().any(|r| r.crash.is_some()) {
        let cell = |f: &dyn Fn(&CrashReport) -> String| {
            col(&|r| r.crash.as_ref().map(f).unwrap_or_else(|| "-".into()))
        };
        rows.push((
            "crash: memnode @ op".into(),
            cell(&|c| {
                if c.crashed {
                    format!("{} @ {} ({:.2} s)", c.node, c.at_op, c.at_seconds)
                } else {
                    format!(
                        "NOT CRASHED ({})",
                        c.failure.as_deref().unwrap_or("run ended first")
                    )
                }
            }),
        ));
        rows.push(("crash: failover (ms)".into(), cell(&|c| f1(c.failover_ms))));
        rows.push((
            "crash: ops / errors after".into(),
            cell(&|c| format!("{} / {}", c.ops_after_crash, c.errors_after_crash)),
        ));
    }
    rows
}

/// `x / base` as a ratio cell.
fn ratio(x: f64, base: f64) -> String {
    if base == 0.0 {
        if x == 0.0 { "-".into() } else { "inf".into() }
    } else {
        format!("{:.2}x", x / base)
    }
}

fn ratio_rows(reports: &[EngineReport]) -> Vec<Row> {
    let base = &reports[0];
    type Metric = (&'static str, fn(&EngineReport) -> f64);
    let metrics: [Metric; 9] = [
        ("throughput", |r| r.throughput_ops_per_s),
        ("latency p50", |r| r.latency_us.p50),
        ("round trips / op", |r| r.per_op.round_trips),
        ("verbs / op", |r| r.per_op.verbs),
        ("rpcs / op", |r| r.per_op.rpcs),
        ("bytes read / op", |r| r.per_op.bytes_read),
        ("bytes written / op", |r| r.per_op.bytes_written),
        ("memnode cpu / op", |r| r.per_op.memnode_cpu_ns),
        ("client cache", |r| r.client_cache_bytes as f64),
    ];
    metrics
        .iter()
        .map(|(label, f)| {
            (
                label.to_string(),
                reports[1..].iter().map(|r| ratio(f(r), f(base))).collect(),
            )
        })
        .collect()
}

fn print_rows(out: &mut dyn Write, header: &[String], rows: &[Row]) -> io::Result<()> {
    let label_w = rows.iter().map(|r| r.0.len()).max().unwrap_or(0).max(8);
    let widths: Vec<usize> = (0..header.len())
        .map(|c| {
            rows.iter()
                .map(|r| r.1[c].len())
                .chain([header[c].len()])
                .max()
                .unwrap_or(0)
        })
        .collect();
    write!(out, "{:label_w$}", "")?;
    for (h, w) in header.iter().zip(&widths) {
        write!(out, "  {h:>w$}")?;
    }
    writeln!(out)?;
    for (label, cells) in rows {
        write!(out, "{label:label_w$}")?;
        for (c, w) in cells.iter().zip(&widths) {
            write!(out, "  {c:>w$}")?;
        }
        writeln!(out)?;
    }
    Ok(())
}

/// The human report: the run's parameters, one column per engine, ratios to
/// the first engine when there are several, then samples of anything that
/// went wrong.
/// Other processes' CPU (in cores) during a wall-clock run above which the
/// table warns that its throughput and latency shared the host: a quarter
/// of a core already moves an RPC engine's run on a 2-core host
/// (docs/performance.md, "Yields under another process's load").
pub const HOST_LOAD_NOTE_CORES: f64 = 0.25;

/// Under the table: a line for each engine whose wall-clock run shared the
/// host with other processes' work (the `sched` report's
/// `other_processes_cores` above [`HOST_LOAD_NOTE_CORES`]).
fn print_host_load_notes(out: &mut dyn Write, reports: &[EngineReport]) -> io::Result<()> {
    let loaded: Vec<(&str, f64)> = reports
        .iter()
        .filter_map(|r| {
            let cores = r.sched.as_ref()?.other_processes_cores?;
            (cores > HOST_LOAD_NOTE_CORES).then_some((r.engine.as_str(), cores))
        })
        .collect();
    if loaded.is_empty() {
        return Ok(());
    }
    writeln!(out)?;
    for (engine, cores) in loaded {
        writeln!(
            out,
            "note: other processes used {cores:.2} cores during {engine}'s run: its throughput and latency shared the host (see its scheduling lines below)"
        )?;
    }
    Ok(())
}

pub fn print_table(out: &mut dyn Write, reports: &[EngineReport]) -> io::Result<()> {
    let Some(first) = reports.first() else {
        return writeln!(out, "no engine completed its run");
    };
    writeln!(
        out,
        "dmkv bench: workload {}, dist {}, keyset {}, {} keys loaded, {} ops, {}-byte values",
        first.workload, first.dist, first.keyset, first.keys, first.ops, first.value_size
    )?;
    writeln!(
        out,
        "            {} thread(s) x {} task(s), {} memnode(s) x {} handler thread(s), {} node(s), transport {}, seed {}",
        first.threads,
        first.tasks_per_thread,
        first.memnodes,
        first.memnode_threads,
        first.nodes,
        first.transport,
        first.seed
    )?;
    if let Some(s) = &first.sim {
        writeln!(
            out,
            "            simulated cluster: profile {}{}, {} compute node(s); throughput and latency in virtual time",
            s.profile,
            if s.cpu_spread_ns > 0 {
                format!(" (client CPU per op spread +-{} ns)", s.cpu_spread_ns)
            } else {
                String::new()
            },
            s.compute_nodes
        )?;
    }
    if let Some(w) = &first.warmup {
        writeln!(
            out,
            "            after a warm-up of {} ops (--warmup-ops), left out of every figure below but errors and check failures",
            w.ops
        )?;
    }
    if let Some(t) = &first.trace {
        writeln!(
            out,
            "            trace {}: {} lines, {} operations, {} other lines ignored",
            t.path, t.lines, t.operations, t.ignored_lines
        )?;
        if let Some(l) = &t.load {
            writeln!(
                out,
                "            load {}: {} lines, {} keys loaded, {} other lines ignored",
                l.path, l.lines, l.keys, l.ignored_lines
            )?;
        }
    }
    writeln!(out)?;
    let header: Vec<String> = reports.iter().map(|r| r.engine.clone()).collect();
    print_rows(out, &header, &rows(reports))?;
    print_host_load_notes(out, reports)?;
    if reports.len() > 1 {
        writeln!(out)?;
        writeln!(
            out,
            "relative to {} (same key set and request stream)",
            first.engine
        )?;
        print_rows(out, &header[1..], &ratio_rows(reports))?;
    }
    for r in reports {
        if let Some(s) = &r.sim {
            writeln!(out)?;
            writeln!(
                out,
                "{}: busiest simulated resources ({} events, {} messages overtaken, {:.0} simulated ops per wall-clock second):",
                r.engine, s.events, s.messages_overtaken, s.wall.sim_ops_per_s
            )?;
            for u in s.utilisation.iter().take(4) {
                writeln!(
                    out,
                    "  {:<32} {:>5.1}% busy, {:.2} M/s, {:.2} GB/s, {:.0} ns queued per use",
                    u.name,
                    u.busy_percent,
                    u.per_s / 1e6,
                    u.bytes_per_s / 1e9,
                    u.mean_wait_ns
                )?;
            }
            // Where operations wait: not always at the busiest resource
            // (a convoy queues at a server that is idle most of the time).
            let queued = queueing_by_class(&s.utilisation);
            if !queued.is_empty() && r.throughput_ops_per_s > 0.0 {
                writeln!(out, "  most queueing, per operation of the run:")?;
                for (class, wait_per_s, busy) in queued.iter().take(4) {
                    writeln!(
                        out,
                        "  {:<32} {:>7.1} ns per op ({:.1}% busy)",
                        class,
                        wait_per_s / r.throughput_ops_per_s,
                        busy
                    )?;
                }
            }
            let h = &s.frames_held;
            if h.count > 0 {
                writeln!(
                    out,
                    "  nested waits held: {} (longest {:.1} us, {:.1} us in all): code waiting in them resumed only when a synchronous wait started above it ended (docs/simulation.md, \"The rule for synchronous waits\")",
                    h.count,
                    h.max_ns as f64 / 1e3,
                    h.total_ns as f64 / 1e3
                )?;
            }
        }
    }
    for r in reports {
        if let Some(s) = &r.sched {
            crate::sched::print(out, &r.engine, s)?;
        }
    }
    for r in reports {
        let samples = r
            .errors
            .samples
            .iter()
            .map(|s| ("error", s))
            .chain(r.checks.samples.iter().map(|s| ("check", s)))
            .chain(r.verify.samples.iter().map(|s| ("verify", s)));
        let mut any = false;
        for (what, s) in samples {
            if !any {
                writeln!(out)?;
                any = true;
            }
            writeln!(out, "{}: {what}: {s}", r.engine)?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::{ResourceReport, SimReport, TimelineReport, queueing_by_class};
    use crate::stats::Timeline;
    use dmkv_transport::sim::ResourceUse;

    fn used(name: &str, busy_ns: u64, wait_ns: u64, count: u64) -> ResourceUse {
        ResourceUse {
            name: name.into(),
            servers: 1,
            busy_ns,
            wait_ns,
            count,
            bytes: 0,
        }
    }

    /// A resource's queueing is the run's share (after minus before) per
    /// use; the client cores add up to one class, so a convoy spread over
    /// many cores is not hidden behind one busier NIC.
    #[test]
    fn queueing_is_per_use_in_the_run_and_client_cores_are_one_class() {
        let before = [used("node0 nic tx", 100, 1_000, 10)];
        let after = [
            used("node0 nic tx", 600, 3_000, 110),
            used("node1 client core 0", 400, 20_000, 100),
            used("node2 client core 1", 200, 10_000, 50),
            used("node0 handler cores", 50, 0, 5),
        ];
        let r = SimReport::new(
            ("p", 0),
            2,
            (0, 0, Default::default()),
            1e-6,
            &before,
            &after,
            super::WallReport {
                run_seconds: 0.0,
                sim_ops_per_s: 0.0,
            },
        );
        let find =
            |n: &str| -> &ResourceReport { r.utilisation.iter().find(|u| u.name == n).unwrap() };
        // 2,000 ns over the run's 100 messages.
        assert_eq!(find("node0 nic tx").mean_wait_ns, 20.0);
        assert_eq!(find("node1 client core 0").mean_wait_ns, 200.0);
        assert_eq!(find("node0 handler cores").mean_wait_ns, 0.0);
        let q = queueing_by_class(&r.utilisation);
        let names: Vec<&str> = q.iter().map(|c| c.0.as_str()).collect();
        // Nothing queued at the handler cores: no row.
        assert_eq!(names, ["client cores", "node0 nic tx"]);
        // 30,000 ns of waiting in 1 us of run; mean busy of the class.
        assert!((q[0].1 - 3e10).abs() < 1.0, "{}", q[0].1);
        assert!((q[0].2 - 30.0).abs() < 1e-9, "{}", q[0].2);
        assert!((q[1].1 - 2e9).abs() < 1.0, "{}", q[1].1);
    }

    /// One thread's timeline of 1 us intervals from 0 with completions at
    /// `at` (ns).
    fn thread(at: &[u64]) -> Timeline {
        let mut t = Timeline::new(0, 1000);
        for &ns in at {
            t.note(ns);
        }
        t
    }

    /// The steady-state window is the latest first completion to the
    /// earliest last one, and its throughput counts the whole intervals
    /// inside it only: a thread that starts late and one that ends late
    /// leave out the ramp and the tail (branch i84).
    #[test]
    fn steady_throughput_counts_the_window_every_thread_runs() {
        // Thread a: one completion per 250 ns from 100 to 6,100 ns; b:
        // from 1,500 (a late start) to 9,900 (a late end), every 500 ns.
        let a: Vec<u64> = (0..=24).map(|i| 100 + 250 * i).collect();
        let b: Vec<u64> = (0..=16).map(|i| 1500 + 500 * i).collect();
        let mut all = Timeline::default();
        all.merge(&thread(&a));
        all.merge(&thread(&b));
        assert_eq!(all.all_running, Some((1500, 6100)));
        let r = TimelineReport::new(&all, None).unwrap();
        assert_eq!(r.all_running_ms, Some([0.0015, 0.0061]));
        // Whole intervals in [1.5, 6.1] us: [2, 3) .. [5, 6): 4 us, with
        // 4 completions of a and 2 of b in each.
        let steady = r.steady_ops_per_s.unwrap();
        assert!((steady - 6e6).abs() < 1e-3, "{steady}");
        // Threads that never ran together: a window but no steady figure.
        let mut apart = Timeline::default();
        apart.merge(&thread(&[100, 900]));
        apart.merge(&thread(&[5000, 5100]));
        let r = TimelineReport::new(&apart, None).unwrap();
        assert_eq!(r.all_running_ms, Some([0.005, 0.0009]));
        assert_eq!(r.steady_ops_per_s, None);
        // No completion: no window.
        let r = TimelineReport::new(&Timeline::new(0, 1000), None).unwrap();
        assert_eq!((r.all_running_ms, r.steady_ops_per_s), (None, None));
    }
}
