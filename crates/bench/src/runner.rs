//! The runner: for each engine, deploy it on a fresh in-process cluster,
//! load the key set, run the request streams with T threads x C tasks,
//! optionally read every key back, and report.
//!
//! Phases of one engine run, and who counts what:
//!
//! 1. deploy, then load from the main thread in chunks of sorted keys
//!    (label `load`, counted on the main thread's endpoint);
//! 2. each thread makes its endpoint and client (label `setup`), then all
//!    start together; the run's clock and memory-node figures span from
//!    that start to the end of the last thread's last operation;
//! 3. every operation is labelled with its kind and metered exactly; its
//!    latency, cost, errors and check findings go to its thread's figures;
//! 4. with `--verify`, after every thread finished, the same threads and
//!    tasks read back every key of the universe (label `verify`).

use crate::check::Checker;
use crate::config::{BenchConfig, EngineChoice, WorkloadSource};
use crate::deployment::Deployment;
use crate::error::BenchError;
use crate::plan::{OpStream, Plan, SyntheticParams};
use crate::report::{
    ChecksReport, CrashReport, EngineReport, ErrorsReport, Latency, LoadReport, MemnodeReport,
    OpReport, PartitionReport, PerOp, SimReport, TimelineReport, Totals, TraceLoadReport,
    TraceReport, VerifyReport, WallReport, WarmupReport,
};
use crate::sampler::{EngineSampler, EngineTimeline};
use crate::schedstat::{ComputeSchedReport, Sched};
use crate::state::{KeyStates, LOAD_VERSION};
use crate::stats::{RunFigures, VerifyFigures};
use crate::trace::{TraceOpKind, read_load_trace, read_trace};
use crate::valuegen::TaskValues;
use crate::workload::{Op, OpType};
use dmkv_api::payload::make_value;
use dmkv_api::{Capabilities, FutureSlot, Key, KvStore};
use dmkv_memnode::NodeStats;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::time::{Instant, LatencyClock, Stopwatch};
use dmkv_transport::{CounterTable, Counters, Endpoint, OpKind, labeled};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::future::Future;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::rc::Rc;
use std::sync::Barrier;
use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::task::Poll;
use std::time::Duration;

/// What a whole invocation produced.
#[derive(Debug, Default)]
pub struct BenchOutcome {
    /// One per engine that completed its run, in the order given.
    pub reports: Vec<EngineReport>,
    /// Engines whose run could not complete (deploy or load failed, or the
    /// engine panicked outside an operation).
    pub failures: Vec<EngineFailure>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EngineFailure {
    pub engine: String,
    pub error: String,
}

impl BenchOutcome {
    /// Every engine ran, and nothing failed or was found wrong.
    pub fn ok(&self) -> bool {
        self.failures.is_empty() && self.reports.iter().all(|r| r.ok)
    }
}

/// Runs `cfg`: every engine on the same key set and request streams.
pub fn run(cfg: &BenchConfig) -> Result<BenchOutcome, BenchError> {
    cfg.validate()?;
    let trace = match &cfg.workload {
        WorkloadSource::Trace(path) => Some(read_trace(path)?),
        WorkloadSource::Synthetic(_) => None,
    };
    let load = match &cfg.trace_load {
        Some(path) => Some(read_load_trace(path)?),
        None => None,
    };
    let needs_scan = match (&cfg.workload, &trace) {
        (_, Some(t)) => t.ops.iter().any(|o| matches!(o.kind, TraceOpKind::Scan(_))),
        (WorkloadSource::Synthetic(w), None) => w.has_run_phase() && w.mix().scan > 0,
        _ => false,
    };
    let mut reserved: Vec<u64> = Vec::new();
    for e in &cfg.engines {
        let caps = preflight(e)?;
        if needs_scan && !caps.scan {
            return Err(BenchError::input(format!(
                "engine {} has no ordered scans, which this workload needs",
                e.spec.name()
            )));
        }
        if cfg.value_size > caps.max_value_len {
            return Err(BenchError::input(format!(
                "engine {} takes values of at most {} bytes; --value-size is {}",
                e.spec.name(),
                caps.max_value_len,
                cfg.value_size
            )));
        }
        reserved.extend_from_slice(caps.reserved_keys);
        if cfg.crash.is_some() && e.spec.topology() != dmkv_api::Topology::Disaggregated {
            return Err(BenchError::input(format!(
                "--crash-memnode crashes a memory node; engine {} runs on symmetric nodes (--nodes), not memory nodes",
                e.spec.name()
            )));
        }
    }
    let topologies: Vec<(&str, dmkv_api::Topology)> = cfg
        .engines
        .iter()
        .map(|e| (e.spec.name(), e.spec.topology()))
        .collect();
    let partition = cfg.partition_spec(&topologies)?;
    let plan = match (&cfg.workload, &trace) {
        (_, Some(t)) => Plan::from_trace_with_load(
            t,
            load.as_ref().map(|l| &l.keys[..]),
            cfg.total_threads(),
            cfg.tasks,
            &reserved,
            cfg.warmup_ops,
        )?,
        (WorkloadSource::Synthetic(w), None) => Plan::synthetic(
            &SyntheticParams {
                workload: *w,
                dist: cfg.effective_dist(),
                keyset: cfg.keyset.clone(),
                keys: cfg.keys,
                ops: cfg.ops,
                warmup_ops: cfg.warmup_ops,
                threads: cfg.total_threads(),
                tasks: cfg.tasks,
                seed: cfg.seed,
                partition,
            },
            &reserved,
        )?,
        (WorkloadSource::Trace(_), None) => unreachable!("the trace was read above"),
    };
    let trace_report = match (&cfg.workload, &trace) {
        (WorkloadSource::Trace(p), Some(t)) => Some(TraceReport {
            path: p.display().to_string(),
            lines: t.lines,
            operations: t.ops.len() as u64,
            ignored_lines: t.ignored_lines,
            load: match (&cfg.trace_load, &load) {
                (Some(p), Some(l)) => Some(TraceLoadReport {
                    path: p.display().to_string(),
                    lines: l.lines,
                    keys: l.keys.len() as u64,
                    ignored_lines: l.ignored_lines,
                }),
                _ => None,
            },
        }),
        _ => None,
    };
    let mut outcome = BenchOutcome::default();
    for e in &cfg.engines {
        let result = catch(|| run_engine(cfg, &plan, e, trace_report.clone()));
        match result {
            Ok(Ok(report)) => outcome.reports.push(report),
            Ok(Err(err)) => outcome.failures.push(EngineFailure {
                engine: e.spec.name().into(),
                error: err.to_string(),
            }),
            Err(panic) => outcome.failures.push(EngineFailure {
                engine: e.spec.name().into(),
                error: format!("panicked: {panic}"),
            }),
        }
    }
    Ok(outcome)
}

/// What `e` accepts (knobs, reserved keys, value sizes, scans), checked
/// before any key is generated; nothing is deployed.
fn preflight(e: &EngineChoice) -> Result<Capabilities, BenchError> {
    e.knobs.check(e.spec.name(), e.spec.knobs())?;
    Ok(e.spec.capabilities())
}

/// Runs `f`, turning a panic into its message.
fn catch<R>(f: impl FnOnce() -> R) -> Result<R, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into())
    })
}

/// The warm-up's progress bar: hidden without one.
fn warm_bar(cfg: &BenchConfig, plan: &Plan, name: &str) -> ProgressBar {
    match plan.warmup_ops() {
        0 => ProgressBar::hidden(),
        n => progress_bar(cfg, n, format!("{name}: warm-up")),
    }
}

fn progress_bar(cfg: &BenchConfig, len: u64, msg: String) -> ProgressBar {
    if !cfg.progress {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::with_draw_target(Some(len), ProgressDrawTarget::stderr());
    bar.set_style(
        ProgressStyle::with_template("{msg:<28} [{bar:30}] {pos}/{len} {per_sec} eta {eta}")
            .expect("a valid template")
            .progress_chars("=> "),
    );
    bar.set_message(msg);
    bar
}

/// One engine's figures from its run's threads.
struct Phases {
    /// `--transport sim`: the simulation's own figures for the run.
    sim: Option<SimReport>,
    figures: RunFigures,
    run_seconds: f64,
    run_table: CounterTable,
    verify: Option<VerifyFigures>,
    verify_table: CounterTable,
    nodes_after: Vec<NodeStats>,
    /// The memory nodes' figures when the run started: after the clients
    /// were made (a client's set-up, its node's engine's connect, is not
    /// the run's) and after any warm-up.
    nodes_before: Vec<NodeStats>,
    /// `--warmup-ops`: what the warm-up did.
    warmup: Option<WarmupReport>,
    /// `--crash-memnode`: what happened.
    crash: Option<CrashReport>,
    /// Real threads: what the OS gave each thread during the run phase.
    sched: Option<crate::sched::SchedReport>,
    /// `--timeline-ms` with an engine that exports client counters.
    engine_timeline: Option<EngineTimeline>,
    /// `--partitioned`: the keys each node touched in each phase.
    touched: BTreeMap<(u64, usize), Touched>,
    /// Real threads: their scheduling over the run, summed (None under
    /// `sim`, or where a thread could not read it).
    compute_sched: Option<Sched>,
}

/// A range-partitioned engine (one with a `bounds` knob: K-1 split keys
/// over `--memnodes K`, XStore's) gets its split keys at the loaded keys'
/// K-quantiles unless `--set` gave them: every memory node then holds an
/// equal share of the loaded keys whatever the key set (equal ranges of
/// the u64 space put sequential keys all on the first node). The knob is
/// part of the configuration every node and client gets, so the clients
/// route by the same split keys. Keys inserted later go where their range
/// is. Fewer loaded keys than nodes: the engine's default.
fn with_quantile_bounds(choice: &EngineChoice, plan: &Plan, memnodes: usize) -> EngineChoice {
    let mut out = choice.clone();
    let partitioned = choice.spec.knobs().iter().any(|k| k.name == "bounds");
    let given = choice.knobs.iter().any(|(k, _)| k == "bounds");
    let loaded = plan.loaded();
    if !partitioned || given || memnodes < 2 || loaded < memnodes {
        return out;
    }
    let mut keys: Vec<u64> = plan.keys()[..loaded].to_vec();
    keys.sort_unstable();
    // keys[j * L / K] for j = 1..K: strictly ascending (distinct keys,
    // distinct indices as L >= K) and above 0 (index >= 1).
    let bounds: Vec<String> = (1..memnodes)
        .map(|j| keys[j * loaded / memnodes].to_string())
        .collect();
    out.knobs.set("bounds", &bounds.join(","));
    out
}

fn run_engine(
    cfg: &BenchConfig,
    plan: &Plan,
    choice: &EngineChoice,
    trace: Option<TraceReport>,
) -> Result<EngineReport, BenchError> {
    let name = choice.spec.name();
    let placed = with_quantile_bounds(choice, plan, cfg.memnodes);
    let dep = cfg.deployer.deploy(
        placed.spec,
        &cfg.deploy_options(&placed, plan.keys().len() as u64),
    )?;
    let dep = &*dep;
    crate::valuegen::check_applies(cfg.value_gen, dep.sim())?;
    let main_ep = dep.endpoint(0);
    let (load_seconds, load_cost) = load(cfg, plan, dep, &main_ep)?;
    let states = KeyStates::new(plan.keys().len(), plan.loaded());
    let phases = if dep.sim().is_some() {
        run_threads_sim(cfg, plan, dep, &states, &main_ep)
    } else {
        run_threads(cfg, plan, dep, &states, &main_ep)
    };
    let engine_stats = engine_stats(dep, &main_ep);
    let memnode = MemnodeReport::new(&phases.nodes_before, &phases.nodes_after);
    let ops = phases.figures.ops();
    let loaded = plan.loaded() as u64;
    let verify = VerifyReport::new(phases.verify.as_ref());
    let checks = ChecksReport::new(&phases.figures.findings);
    let errors = ErrorsReport::new(&phases.figures.errors);
    let crash_failed = phases
        .crash
        .as_ref()
        .is_some_and(|c| c.failure.is_some() || !c.crashed);
    let ok = errors.count == 0 && checks.failures == 0 && verify.failures() == 0 && !crash_failed;
    let (workload, dist, keyset) = match &cfg.workload {
        WorkloadSource::Synthetic(w) => (
            w.to_string(),
            cfg.effective_dist().to_string(),
            cfg.keyset.to_string(),
        ),
        WorkloadSource::Trace(p) => (
            format!("trace:{}", p.display()),
            "trace".to_string(),
            "trace".to_string(),
        ),
    };
    Ok(EngineReport {
        engine: name.into(),
        workload,
        dist,
        keyset,
        keys: loaded,
        ops,
        value_size: cfg.value_size,
        value_gen: (cfg.value_gen != Default::default()).then(|| cfg.value_gen.to_string()),
        threads: cfg.threads,
        tasks_per_thread: cfg.tasks,
        memnode_threads: cfg.memnode_threads,
        memnodes: cfg.memnodes,
        nodes: cfg.nodes,
        transport: cfg.deployer.transport().into(),
        seed: cfg.seed,
        settings: choice
            .knobs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect(),
        throughput_ops_per_s: if phases.run_seconds > 0.0 {
            ops as f64 / phases.run_seconds
        } else {
            0.0
        },
        run_seconds: phases.run_seconds,
        compute_threads: phases
            .compute_sched
            .as_ref()
            .map(|s| ComputeSchedReport::new(s, ops)),
        latency_us: Latency::from_ns(&phases.figures.overall()),
        per_op: PerOp::new(&phases.figures.cost(), ops),
        by_op: OpType::ALL
            .iter()
            .filter(|t| phases.figures.by_op[t.index()].count > 0)
            .map(|t| {
                (
                    t.name().to_string(),
                    OpReport::new(&phases.figures.by_op[t.index()]),
                )
            })
            .collect(),
        counters_by_kind: OpKind::ALL
            .iter()
            .filter(|k| *phases.run_table.get(**k) != Counters::default())
            .map(|k| (k.name().to_string(), Totals::from(phases.run_table.get(*k))))
            .collect::<BTreeMap<_, _>>(),
        load: LoadReport {
            keys: loaded,
            seconds: load_seconds,
            keys_per_s: if load_seconds > 0.0 {
                loaded as f64 / load_seconds
            } else {
                0.0
            },
            per_key: PerOp::new(&load_cost, loaded),
        },
        warmup: phases.warmup.clone(),
        verify_counters: Totals::from(&phases.verify_table.sum(&OpKind::ALL)),
        client_cache_bytes: dep.engine().client_cache_bytes(),
        memnode_bytes: memnode.memory_used,
        memnode,
        verify,
        checks,
        errors,
        trace,
        engine_stats,
        timeline: TimelineReport::new(&phases.figures.timeline, phases.engine_timeline.as_ref()),
        partition: plan
            .partitions()
            .map(|parts| PartitionReport::new(cfg, plan, parts, &phases.touched)),
        sim: phases.sim,
        sched: phases.sched,
        crash: phases.crash,
        ok,
    })
}

/// Loads the plan's loaded keys in ascending key order, in chunks, from the
/// main thread. Returns the time it took and what it cost.
fn load(
    cfg: &BenchConfig,
    plan: &Plan,
    dep: &dyn Deployment,
    ep: &Endpoint,
) -> Result<(f64, Counters), BenchError> {
    let order = plan.load_order();
    let bar = progress_bar(
        cfg,
        order.len() as u64,
        format!("{}: load", dep.engine().name()),
    );
    let start = Instant::now();
    for chunk in order.chunks(cfg.load_chunk) {
        let pairs: Vec<(Key, Vec<u8>)> = chunk
            .iter()
            .map(|&i| {
                let key = plan.key(i);
                (key, make_value(key, LOAD_VERSION, cfg.value_size))
            })
            .collect();
        block_on(labeled(OpKind::Load, dep.engine().load(ep, &pairs))).map_err(|e| {
            BenchError::run(format!("{}: loading failed: {e}", dep.engine().name()))
        })?;
        bar.inc(chunk.len() as u64);
    }
    // Background work the load started (training models, resizing) finishes
    // before the run, so that the run measures the workload alone; its time
    // counts as loading.
    block_on(labeled(OpKind::Load, dep.engine().settle(ep))).map_err(|e| {
        BenchError::run(format!(
            "{}: settling after the load failed: {e}",
            dep.engine().name()
        ))
    })?;
    let seconds = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    Ok((seconds, *ep.counters().get(OpKind::Load)))
}

/// Shared by the threads of one engine run.
struct Ctx<'a> {
    cfg: &'a BenchConfig,
    plan: &'a Plan,
    states: &'a KeyStates,
    dep: &'a dyn Deployment,
    /// Threads + the main thread: clients made and warmed up / run starts /
    /// run done / verify may start.
    barrier: Barrier,
    run_bar: ProgressBar,
    /// `--warmup-ops`: the warm-up's (hidden without one).
    warm_bar: ProgressBar,
    verify_bar: ProgressBar,
    crash: Option<CrashRun>,
    /// `BenchConfig::op_limit` (sim runs only), and the first operation
    /// that exceeded it: once set, every task stops after its current
    /// operation.
    op_limit: Option<Duration>,
    stuck: std::sync::Mutex<Option<String>>,
    /// Set by the first thread to begin the run: its start on the runtime's
    /// clock (the origin of shifts and of the engine sampler's intervals)
    /// and the sampler.
    started: OnceLock<(u64, Option<EngineSampler>)>,
    /// `--partitioned`: per (phase, node), the keys touched; merged from
    /// each task when it ends.
    touched: Mutex<BTreeMap<(u64, usize), Touched>>,
}

/// The keys one node's operations named in one phase of a partitioned run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Touched {
    pub min_key: u64,
    pub max_key: u64,
    pub ops: u64,
}

impl Touched {
    fn note(slot: &mut Option<Touched>, key: u64) {
        let t = slot.get_or_insert(Touched {
            min_key: key,
            max_key: key,
            ops: 0,
        });
        t.min_key = t.min_key.min(key);
        t.max_key = t.max_key.max(key);
        t.ops += 1;
    }
    fn merge(&mut self, o: &Touched) {
        self.min_key = self.min_key.min(o.min_key);
        self.max_key = self.max_key.max(o.max_key);
        self.ops += o.ops;
    }
}

/// `--crash-memnode` during one engine run: counts completed operations,
/// crashes the node when the count reaches `at_op`, and measures what the
/// clients saw afterwards.
struct CrashRun {
    node: usize,
    at_fraction: f64,
    at_op: u64,
    /// Operations completed so far, all threads.
    completed: AtomicU64,
    /// `Instant::as_nanos` of the crash; `u64::MAX` before it.
    crashed_at: AtomicU64,
    /// Among operations that completed after the crash: how many, how many
    /// failed, and the longest one's latency (ns).
    ops_after: AtomicU64,
    errors_after: AtomicU64,
    longest_after_ns: AtomicU64,
    /// Why the crash could not be made.
    failure: Mutex<Option<String>>,
}

impl CrashRun {
    fn new(cfg: &BenchConfig, total_ops: u64) -> Option<CrashRun> {
        cfg.crash.map(|c| CrashRun {
            node: c.node,
            at_fraction: c.at_fraction,
            at_op: c.at_op(total_ops),
            completed: AtomicU64::new(0),
            crashed_at: AtomicU64::new(u64::MAX),
            ops_after: AtomicU64::new(0),
            errors_after: AtomicU64::new(0),
            longest_after_ns: AtomicU64::new(0),
            failure: Mutex::new(None),
        })
    }

    /// After an operation that ran from `start` to `end` (and `failed` with
    /// an error); the operation completing number `at_op` crashes the node.
    fn after_op(&self, dep: &dyn Deployment, start: Instant, end: Instant, failed: bool) {
        let crashed = self.crashed_at.load(Ordering::Acquire);
        if crashed != u64::MAX && end.as_nanos() >= crashed {
            self.ops_after.fetch_add(1, Ordering::Relaxed);
            self.errors_after
                .fetch_add(failed as u64, Ordering::Relaxed);
            self.longest_after_ns.fetch_max(
                end.saturating_duration_since(start).as_nanos() as u64,
                Ordering::Relaxed,
            );
        }
        if self.completed.fetch_add(1, Ordering::AcqRel) + 1 == self.at_op {
            // Marked before the crash, so that an operation failing because
            // of it (on another thread) always counts as after it.
            self.crashed_at
                .store(Instant::now().as_nanos(), Ordering::Release);
            if let Err(e) = dep.crash_node(self.node) {
                self.crashed_at.store(u64::MAX, Ordering::Release);
                *self.failure.lock().unwrap_or_else(|p| p.into_inner()) =
                    Some(format!("crashing memory node {}: {e}", self.node));
            }
        }
    }

    fn report(&self, run_start: Instant) -> CrashReport {
        let crashed = self.crashed_at.load(Ordering::Acquire);
        let ms = |ns: u64| ns as f64 / 1e6;
        CrashReport {
            node: self.node,
            at_fraction: self.at_fraction,
            at_op: self.at_op,
            crashed: crashed != u64::MAX,
            at_seconds: if crashed != u64::MAX {
                crashed.saturating_sub(run_start.as_nanos()) as f64 / 1e9
            } else {
                0.0
            },
            failover_ms: ms(self.longest_after_ns.load(Ordering::Relaxed)),
            ops_after_crash: self.ops_after.load(Ordering::Relaxed),
            errors_after_crash: self.errors_after.load(Ordering::Relaxed),
            failure: self
                .failure
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
        }
    }
}

impl<'a> Ctx<'a> {
    /// A run's context, its barrier for `parties` (the compute threads and
    /// the main thread; 1 under sim, where one thread runs them all).
    fn new(
        cfg: &'a BenchConfig,
        plan: &'a Plan,
        states: &'a KeyStates,
        dep: &'a dyn Deployment,
        parties: usize,
    ) -> Ctx<'a> {
        let name = dep.engine().name();
        Ctx {
            cfg,
            plan,
            states,
            dep,
            barrier: Barrier::new(parties),
            run_bar: progress_bar(cfg, plan.total_ops(), format!("{name}: run")),
            warm_bar: warm_bar(cfg, plan, name),
            verify_bar: if cfg.verify {
                progress_bar(cfg, plan.keys().len() as u64, format!("{name}: verify"))
            } else {
                ProgressBar::hidden()
            },
            crash: CrashRun::new(cfg, plan.total_ops()),
            op_limit: None,
            stuck: Default::default(),
            started: OnceLock::new(),
            touched: Mutex::new(BTreeMap::new()),
        }
    }

    fn checker(&self) -> Checker<'_> {
        Checker {
            plan: self.plan,
            states: self.states,
        }
    }

    /// The run's start: the first caller's `now_ns` (threads begin within a
    /// barrier of each other).
    fn begin_run(&self, now_ns: u64) -> u64 {
        self.started
            .get_or_init(|| {
                let sampler =
                    EngineSampler::start(&**self.dep.engine(), now_ns, self.cfg.timeline_ns);
                (now_ns, sampler)
            })
            .0
    }

    fn sampler(&self) -> Option<&EngineSampler> {
        self.started.get().and_then(|(_, s)| s.as_ref())
    }

    /// After the run: the per-interval engine counters, and the keys
    /// touched per phase and node.
    fn finish(self, phases: &mut Phases) {
        let intervals = phases.figures.timeline.counts.len();
        phases.engine_timeline = self
            .started
            .into_inner()
            .and_then(|(_, s)| s)
            .map(|s| s.finish(intervals));
        phases.touched = self.touched.into_inner().unwrap_or_else(|p| p.into_inner());
    }

    /// The run phase ended (before `--verify`).
    fn end_run(&self) {
        if let Some(s) = self.sampler() {
            s.close(&**self.dep.engine());
        }
    }
}

/// The design's own figures now (`Engine::stats`, asked through `ep`), or
/// the error that asking gave.
fn engine_stats(dep: &dyn Deployment, ep: &Endpoint) -> serde_json::Value {
    match block_on(labeled(OpKind::Setup, dep.engine().stats(ep))) {
        Ok(v) => v,
        Err(e) => serde_json::json!({ "error": e.to_string() }),
    }
}

/// `--warmup-ops` (none without): the warm-up's report. Its errors and
/// wrong answers join the run's (`figures`), so that they fail the run; its
/// operations, costs and latencies stay out.
fn fold_warmup(
    plan: &Plan,
    warm: &RunFigures,
    (seconds, engine_stats): (f64, serde_json::Value),
    figures: &mut RunFigures,
) -> Option<WarmupReport> {
    if plan.warmup_ops() == 0 {
        return None;
    }
    figures.errors.merge(&warm.errors);
    figures.findings.merge(&warm.findings);
    let ops = warm.ops();
    Some(WarmupReport {
        ops,
        seconds,
        per_op: PerOp::new(&warm.cost(), ops),
        engine_stats,
    })
}

/// What one thread hands back.
#[derive(Default)]
struct ThreadResult {
    /// How long this thread ran and waited for a core during the run.
    sched: Option<Sched>,
    /// `--warmup-ops`: the warm-up's figures and how long it took.
    warm: RunFigures,
    warm_seconds: f64,
    figures: RunFigures,
    run_table: CounterTable,
    verify: VerifyFigures,
    verify_table: CounterTable,
}

fn run_threads(
    cfg: &BenchConfig,
    plan: &Plan,
    dep: &dyn Deployment,
    states: &KeyStates,
    main_ep: &Endpoint,
) -> Phases {
    // The latency clock is calibrated now, not inside a measured operation.
    Stopwatch::warm_up();
    let ctx = Ctx::new(cfg, plan, states, dep, cfg.threads + 1);
    let mut phases = std::thread::scope(|s| {
        let ctx = &ctx;
        let handles: Vec<_> = (0..cfg.threads)
            .map(|t| {
                std::thread::Builder::new()
                    .name(format!("bench-{t}"))
                    .spawn_scoped(s, move || thread_main(ctx, t))
                    .expect("spawn a compute thread")
            })
            .collect();
        // Every thread has made its client (and warmed up): the figures the
        // run's are taken against, before it starts (the engine's first:
        // asking may make RPCs, which are not the run's).
        ctx.barrier.wait();
        ctx.warm_bar.finish_and_clear();
        let stats_at_start = (plan.warmup_ops() > 0).then(|| engine_stats(dep, main_ep));
        let nodes_before = dep.node_stats();
        ctx.barrier.wait();
        let start = Instant::now();
        let sched_before = crate::sched::snapshot();
        ctx.barrier.wait();
        let run_seconds = start.elapsed().as_secs_f64();
        let sched = crate::sched::SchedReport::between(
            &sched_before,
            &crate::sched::snapshot(),
            run_seconds,
        );
        ctx.end_run();
        let nodes_after = dep.node_stats();
        ctx.run_bar.finish_and_clear();
        ctx.barrier.wait();
        let mut figures = RunFigures::default();
        let mut run_table = CounterTable::default();
        let mut verify = VerifyFigures::default();
        let mut verify_table = CounterTable::default();
        let mut compute_sched = Some(Sched::default());
        let mut warm = RunFigures::default();
        let mut warm_seconds = 0.0f64;
        for h in handles {
            // Threads catch their own panics, so a join error is a harness bug.
            let r = h.join().expect("compute threads do not panic");
            compute_sched = compute_sched.zip(r.sched).map(|(mut a, b)| {
                a.merge(&b);
                a
            });
            figures.merge(&r.figures);
            warm.merge(&r.warm);
            warm_seconds = warm_seconds.max(r.warm_seconds);
            run_table.merge(&r.run_table);
            verify.merge(&r.verify);
            verify_table.merge(&r.verify_table);
        }
        ctx.verify_bar.finish_and_clear();
        let warmup = fold_warmup(
            plan,
            &warm,
            (warm_seconds, stats_at_start.unwrap_or_default()),
            &mut figures,
        );
        Phases {
            sim: None,
            nodes_before,
            warmup,
            figures,
            run_seconds,
            run_table,
            verify: cfg.verify.then_some(verify),
            verify_table,
            nodes_after,
            crash: ctx.crash.as_ref().map(|c| c.report(start)),
            sched: Some(sched),
            engine_timeline: None,
            touched: BTreeMap::new(),
            compute_sched,
        }
    });
    ctx.finish(&mut phases);
    phases
}

/// The run under `--transport sim`: every simulated compute thread's tasks
/// (all compute nodes' threads) run together on this OS thread, in virtual
/// time; throughput and latency are virtual, wall-clock figures apart.
fn run_threads_sim(
    cfg: &BenchConfig,
    plan: &Plan,
    dep: &dyn Deployment,
    states: &KeyStates,
    main_ep: &Endpoint,
) -> Phases {
    let sim = dep.sim().expect("a simulated deployment");
    let threads = cfg.total_threads();
    let mut ctx = Ctx::new(cfg, plan, states, dep, 1);
    ctx.op_limit = cfg.op_limit;
    let mut figures = RunFigures::default();
    let mut clients = Vec::new();
    for t in 0..threads {
        match catch(|| dep.client(t)) {
            Ok(Ok((ep, kv))) => {
                ep.reset_counters();
                clients.push((t, ep, kv));
            }
            Ok(Err(e)) => figures
                .errors
                .push_other(format!("thread {t}: making a client failed: {e}")),
            Err(p) => figures
                .errors
                .push_other(format!("thread {t}: making a client panicked: {p}")),
        }
    }
    let mut task_states: Vec<TaskState<'_>> = clients
        .iter()
        .flat_map(|(thread, _, _)| (0..cfg.tasks).map(|task| TaskState::new(&ctx, *thread, task)))
        .collect();
    // `--warmup-ops`: every task's warm-up, as one batch, before the run.
    let mut warm = RunFigures::default();
    let mut warm_seconds = 0.0;
    let mut stats_at_start = serde_json::Value::Null;
    if plan.warmup_ops() > 0 {
        let began = Instant::now();
        let per_thread: Vec<RefCell<RunFigures>> =
            (0..clients.len()).map(|_| RefCell::default()).collect();
        let (last_end, ran) = run_sim_phase(
            &ctx,
            &clients,
            &mut task_states,
            Phase::Warmup,
            &per_thread,
            began,
        );
        warm_seconds = (last_end - began).as_secs_f64();
        for f in per_thread {
            warm.merge(&f.into_inner());
        }
        if let Err(p) = ran {
            warm.errors
                .push_other(format!("the simulated warm-up panicked: {p}"));
        }
        ctx.warm_bar.finish_and_clear();
        for (_, ep, _) in &clients {
            ep.reset_counters();
        }
        // The engine's figures first: asking may make RPCs, which are not
        // the run's.
        stats_at_start = engine_stats(dep, main_ep);
    }
    // After the clients were made and any warm-up.
    let nodes_before = dep.node_stats();
    let before = sim.resources();
    let events_before = sim.events();
    let overtaken_before = sim.messages_overtaken();
    #[allow(clippy::disallowed_methods)]
    let wall = std::time::Instant::now();
    let start = Instant::now();
    ctx.begin_run(start.as_nanos());
    let per_thread: Vec<RefCell<RunFigures>> = (0..clients.len())
        .map(|_| RefCell::new(RunFigures::with_timeline(start.as_nanos(), cfg.timeline_ns)))
        .collect();
    // When the last client task ended: the run's end. Under sim a
    // memory-node job that waits in virtual time (a nested frame, e.g.
    // Outback's countdown after a resize) can keep the scheduler from
    // returning here after the clients are done; that time is not the run's.
    let (last_end, ran) = run_sim_phase(
        &ctx,
        &clients,
        &mut task_states,
        Phase::Run,
        &per_thread,
        start,
    );
    let run_seconds = (last_end - start).as_secs_f64();
    ctx.end_run();
    let wall_seconds = wall.elapsed().as_secs_f64();
    let after = sim.resources();
    let events = sim.events() - events_before;
    let overtaken = sim.messages_overtaken() - overtaken_before;
    // Worker jobs still running when the last client ended (an Outback
    // resize, an XStore-D retrain) finish before the figures below and the
    // verification: their work after the run is not the run's (the
    // utilisation above is already read), and verification reads should
    // not fall into them. Bounded, so that a job waiting for clients
    // cannot hang the harness.
    sim.finish_jobs(cfg.op_limit.unwrap_or(std::time::Duration::from_secs(10)));
    let nodes_after = dep.node_stats();
    ctx.run_bar.finish_and_clear();
    if let Err(p) = ran {
        figures
            .errors
            .push_other(format!("the simulated run panicked: {p}"));
    }
    let stuck = ctx.stuck.lock().expect("stuck").take();
    if let Some(s) = &stuck {
        // First, so that it is the first sample a caller sees.
        figures.errors.samples.insert(0, s.clone());
        figures.errors.other += 1;
    }
    let mut run_table = CounterTable::default();
    for ((_, ep, _), f) in clients.iter().zip(per_thread) {
        figures.merge(&f.into_inner());
        run_table.merge(&ep.counters());
        ep.reset_counters();
    }
    let mut verify = VerifyFigures::default();
    let mut verify_table = CounterTable::default();
    // After a stuck operation the run stopped with operations in flight:
    // their keys are in doubt, and what they wait for may still block
    // reads, so there is nothing to verify.
    if cfg.verify && stuck.is_none() {
        let per_thread: Vec<RefCell<VerifyFigures>> =
            (0..clients.len()).map(|_| RefCell::default()).collect();
        let ran = catch(|| {
            let mut tasks: Vec<LocalTask<'_, ()>> = Vec::new();
            for ((thread, _, kv), v) in clients.iter().zip(&per_thread) {
                for task in 0..cfg.tasks {
                    tasks.push(Box::pin(verify_task(&ctx, &**kv, *thread, task, v)));
                }
            }
            run_tasks(tasks);
        });
        for v in per_thread {
            verify.merge(&v.into_inner());
        }
        if let Err(p) = ran {
            verify.errors += 1;
            verify.note(|| format!("verification panicked: {p}"));
        }
        for (_, ep, _) in &clients {
            verify_table.merge(&ep.counters());
        }
        ctx.verify_bar.finish_and_clear();
    }
    let warmup = fold_warmup(plan, &warm, (warm_seconds, stats_at_start), &mut figures);
    let ops = figures.ops();
    let profile = sim.profile();
    let crash = ctx.crash.as_ref().map(|c| c.report(start));
    let mut phases = Phases {
        sim: Some(SimReport::new(
            (&profile.name, profile.client.cpu_per_op_spread_ns),
            cfg.compute_nodes,
            (events, overtaken, sim.frames_held()),
            run_seconds,
            &before,
            &after,
            WallReport {
                run_seconds: wall_seconds,
                sim_ops_per_s: if wall_seconds > 0.0 {
                    ops as f64 / wall_seconds
                } else {
                    0.0
                },
            },
        )),
        nodes_before,
        warmup,
        figures,
        run_seconds,
        run_table,
        verify: (cfg.verify && stuck.is_none()).then_some(verify),
        verify_table,
        nodes_after,
        crash,
        sched: None,
        engine_timeline: None,
        touched: BTreeMap::new(),
        compute_sched: None,
    };
    ctx.finish(&mut phases);
    phases
}

/// Under sim: runs `phase` of every client's tasks as one batch on this
/// thread (`task_states` holds each client's tasks in turn, `figures` one
/// entry per client). Returns when the last task ended (at least `start`)
/// and the message of a panic that escaped.
fn run_sim_phase(
    ctx: &Ctx<'_>,
    clients: &[(usize, Rc<Endpoint>, Rc<dyn KvStore>)],
    task_states: &mut [TaskState<'_>],
    phase: Phase,
    figures: &[RefCell<RunFigures>],
    start: Instant,
) -> (Instant, Result<(), String>) {
    let last_end = std::cell::Cell::new(start);
    let ran = catch(|| {
        let mut tasks: Vec<LocalTask<'_, ()>> = Vec::new();
        let per_client = task_states.chunks_mut(ctx.cfg.tasks);
        for (((thread, ep, kv), f), states) in clients.iter().zip(figures).zip(per_client) {
            for (task, state) in states.iter_mut().enumerate() {
                let last_end = &last_end;
                tasks.push(Box::pin(async move {
                    run_task(ctx, ep, &**kv, (*thread, task), state, phase, f).await;
                    last_end.set(last_end.get().max(Instant::now()));
                }));
            }
        }
        run_tasks(tasks);
    });
    (last_end.get(), ran)
}

/// One compute thread. It always reaches the four barriers, whatever fails,
/// so that the main thread never waits forever.
fn thread_main(ctx: &Ctx<'_>, thread: usize) -> ThreadResult {
    // `--pin-threads`: this compute thread's CPU (nothing without a plan).
    dmkv_transport::placement::pin_compute(thread);
    let mut res = ThreadResult::default();
    let client: Option<(Rc<Endpoint>, Rc<dyn KvStore>)> = match catch(|| ctx.dep.client(thread)) {
        Ok(Ok(c)) => Some(c),
        Ok(Err(e)) => {
            res.figures
                .errors
                .push_other(format!("thread {thread}: making a client failed: {e}"));
            None
        }
        Err(p) => {
            res.figures
                .errors
                .push_other(format!("thread {thread}: making a client panicked: {p}"));
            None
        }
    };
    if let Some((ep, _)) = &client {
        ep.reset_counters();
    }
    let mut task_states: Vec<TaskState<'_>> = (0..ctx.cfg.tasks)
        .map(|task| TaskState::new(ctx, thread, task))
        .collect();
    if ctx.plan.warmup_ops() > 0
        && let Some((ep, kv)) = &client
    {
        let warm = RefCell::new(RunFigures::default());
        let began = Instant::now();
        let ran = run_phase(
            ctx,
            (ep, &**kv),
            thread,
            &mut task_states,
            Phase::Warmup,
            &warm,
        );
        res.warm_seconds = (Instant::now() - began).as_secs_f64();
        res.warm = warm.into_inner();
        if let Err(p) = ran {
            res.warm
                .errors
                .push_other(format!("thread {thread}: the warm-up panicked: {p}"));
        }
        ep.reset_counters();
    }
    // Every thread's client is made and its warm-up over: the main thread
    // takes the memory nodes' figures, then the run starts.
    ctx.barrier.wait();
    ctx.barrier.wait();
    if let Some((ep, kv)) = &client {
        let started = ctx.begin_run(Instant::now().as_nanos());
        let figures = RefCell::new(RunFigures::with_timeline(started, ctx.cfg.timeline_ns));
        let sched_before = Sched::now();
        let ran = run_phase(
            ctx,
            (ep, &**kv),
            thread,
            &mut task_states,
            Phase::Run,
            &figures,
        );
        res.sched = sched_before
            .zip(Sched::now())
            .map(|(before, after)| after.since(&before));
        let mut figures = figures.into_inner();
        if let Err(p) = ran {
            figures
                .errors
                .push_other(format!("thread {thread}: the run panicked: {p}"));
        }
        res.figures.merge(&figures);
        res.run_table = ep.counters();
        ep.reset_counters();
    }
    ctx.barrier.wait();
    ctx.barrier.wait();
    if let (true, Some((ep, kv))) = (ctx.cfg.verify, &client) {
        let verify = RefCell::new(VerifyFigures::default());
        let ran = catch(|| {
            let tasks: Vec<LocalTask<'_, ()>> = (0..ctx.cfg.tasks)
                .map(|task| {
                    Box::pin(verify_task(ctx, &**kv, thread, task, &verify)) as LocalTask<'_, ()>
                })
                .collect();
            run_tasks(tasks);
        });
        let mut verify = verify.into_inner();
        if let Err(p) = ran {
            verify.errors += 1;
            verify.note(|| format!("thread {thread}: verification panicked: {p}"));
        }
        res.verify = verify;
        res.verify_table = ep.counters();
    }
    res
}

/// Runs `phase` of every task of `thread` (one OS thread, its tasks on its
/// executor) into `figures`; a panic's message if one escaped.
fn run_phase(
    ctx: &Ctx<'_>,
    (ep, kv): (&Endpoint, &dyn KvStore),
    thread: usize,
    task_states: &mut [TaskState<'_>],
    phase: Phase,
    figures: &RefCell<RunFigures>,
) -> Result<(), String> {
    catch(|| {
        let tasks: Vec<LocalTask<'_, ()>> = task_states
            .iter_mut()
            .enumerate()
            .map(|(task, state)| {
                Box::pin(run_task(ctx, ep, kv, (thread, task), state, phase, figures))
                    as LocalTask<'_, ()>
            })
            .collect();
        run_tasks(tasks);
    })
}

/// Ops between progress bar updates.
const PROGRESS_STEP: u64 = 256;

/// Which part of its stream a task runs.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Phase {
    /// `--warmup-ops`: the stream's first operations, recorded in figures
    /// of their own (only their errors and wrong answers reach the report);
    /// no crash, sampler, shifts or partition tally; a progress bar of its own.
    Warmup,
    /// The measured run: the rest of the stream.
    Run,
}

/// What a task keeps from its warm-up to its run: where its stream stands
/// and its value maker.
struct TaskState<'p> {
    stream: OpStream<'p>,
    values: TaskValues,
}

impl<'p> TaskState<'p> {
    fn new(ctx: &Ctx<'p>, thread: usize, task: usize) -> TaskState<'p> {
        TaskState {
            stream: ctx.plan.stream(thread, task),
            values: TaskValues::new(ctx.cfg.value_gen, ctx.cfg.seed, thread, task),
        }
    }
}

/// A task's stream for one phase: at most `left` more operations (the
/// warm-up's share), or all that remain (`None`: the run).
struct PhaseDraws<'s, 'p> {
    stream: &'s mut OpStream<'p>,
    left: Option<u64>,
}

impl PhaseDraws<'_, '_> {
    fn next(&mut self) -> Option<Op> {
        match &mut self.left {
            Some(0) => None,
            Some(n) => {
                *n -= 1;
                self.stream.next()
            }
            None => self.stream.next(),
        }
    }
}

/// Runs `phase` of one task's stream (`state`), recording into `figures`.
/// The callers run every task's warm-up, then (after a barrier of all
/// threads, or under sim once the warm-up's batch of tasks has ended) every
/// task's run, so no measured operation overlaps a warm-up one.
async fn run_task(
    ctx: &Ctx<'_>,
    ep: &Endpoint,
    kv: &dyn KvStore,
    (thread, task): (usize, usize),
    state: &mut TaskState<'_>,
    phase: Phase,
    figures: &RefCell<RunFigures>,
) {
    let run = phase == Phase::Run;
    let bar = if run { &ctx.run_bar } else { &ctx.warm_bar };
    let mut unreported = 0;
    let shift_ns = std::num::NonZeroU64::new(ctx.cfg.shift_every_ns).filter(|_| run);
    let start_ns = ctx.started.get().map_or(0, |s| s.0);
    let sampler = ctx.sampler().filter(|_| run);
    let crash = ctx.crash.as_ref().filter(|_| run);
    // `--partitioned`: this task's node, and per phase the keys it named.
    let node = ctx
        .plan
        .partitions()
        .filter(|_| run)
        .map(|p| p.map.node_of(thread));
    let mut touched: Vec<Option<Touched>> = Vec::new();
    let mut phase_no = 0u64;
    let mut stream = PhaseDraws {
        stream: &mut state.stream,
        left: (!run).then(|| ctx.plan.warmup_of(thread, task)),
    };
    // Without shifts the stream does not depend on when an operation is
    // drawn, so the next one is drawn an operation early and its key and
    // key state fetched while this one runs: at 1M keys both are cache
    // misses, which then overlap the engine's work instead of preceding it.
    // (With shifts an operation is drawn in the phase it starts in.)
    let lookahead = shift_ns.is_none();
    let mut next = if lookahead { stream.next() } else { None };
    // One livelock watchdog for all of this task's operations.
    let op_limit = ctx.op_limit.map(dmkv_transport::exec::OpLimit::new);
    let mut io = TaskIo {
        ctx,
        ep,
        // Chosen once: this task runs on one thread, inside a simulation
        // or not, for its whole life.
        clock: LatencyClock::here(),
        kv,
        recycles: kv.recycles_values(),
        recycles_to: kv.recycles_to(),
        figures,
        slot: FutureSlot::new(),
        values: &mut state.values,
        costs: Default::default(),
    };
    loop {
        if ctx.op_limit.is_some() && ctx.stuck.lock().expect("stuck").is_some() {
            break;
        }
        // The clock is read only when shifts are on.
        if let Some(every) = shift_ns {
            phase_no = Instant::now().as_nanos().saturating_sub(start_ns) / every;
            stream.stream.set_phase(phase_no);
        }
        let op = if lookahead {
            let op = next.take();
            if op.is_some() {
                next = stream.next();
                if let Some(n) = next {
                    ctx.plan.touch_key(n.index());
                    ctx.states.touch(n.index());
                }
            }
            op
        } else {
            stream.next()
        };
        let Some(op) = op else { break };
        if node.is_some() {
            let p = phase_no as usize;
            if touched.len() <= p {
                touched.resize(p + 1, None);
            }
            Touched::note(&mut touched[p], ctx.plan.key(op.index()));
        }
        // The clock only where something needs it (the plain loop reads
        // none per operation).
        let start = (crash.is_some() || ctx.op_limit.is_some()).then(Instant::now);
        let executed = execute(&mut io, op);
        let failed = match &op_limit {
            None => executed.await,
            Some(watchdog) => match watchdog.run(executed).await {
                Some(failed) => failed,
                None => {
                    // Dropped where it stands (as a killed client's would be).
                    let key = ctx.plan.key(op.index());
                    let mut s = ctx.stuck.lock().expect("stuck");
                    if s.is_none() {
                        *s = Some(format!(
                            "{}{} of key {key:#x} (thread {thread}, task {task}) did not complete within {:?} of virtual time (started at {} ns): a livelock or a wait that never ends; the run was stopped",
                            if run { "" } else { "a warm-up " },
                            op.op_type().name(),
                            watchdog.limit(),
                            start.map_or(0, |s| s.as_nanos())
                        ));
                    }
                    break;
                }
            },
        };
        if let (Some(c), Some(start)) = (crash, start) {
            c.after_op(ctx.dep, start, Instant::now(), failed);
        }
        if let Some(s) = sampler {
            s.tick(&**ctx.dep.engine(), Instant::now().as_nanos());
        }
        unreported += 1;
        if unreported == PROGRESS_STEP {
            bar.inc(unreported);
            unreported = 0;
        }
    }
    bar.inc(unreported);
    figures.borrow_mut().add_costs(&io.costs);
    if let Some(node) = node {
        let mut all = ctx.touched.lock().unwrap_or_else(|p| p.into_inner());
        for (phase, t) in touched.iter().enumerate() {
            if let Some(t) = t {
                all.entry((phase as u64, node))
                    .and_modify(|a| a.merge(t))
                    .or_insert(*t);
            }
        }
    }
}

/// Issues `fut` labelled `kind`: its output, latency (nanoseconds) and
/// exact cost.
///
/// The latency is measured on `clock`, the task's [`LatencyClock`] (the
/// clock a [`Stopwatch`] reads): virtual time under `sim` (as [`Instant`]
/// measures it there), else the time-stamp counter where the kernel trusts
/// it as a clock (two counter reads per operation instead of two
/// `clock_gettime` calls; docs/performance.md, "Fourteenth pass"),
/// converted to nanoseconds per operation (one multiplication). The clock
/// is chosen once per task, not per operation (docs/performance.md,
/// "Twenty-second pass").
///
/// The cost is added to `cost` in place, as each charge is made (what
/// [`crate::metered::metered`] returns, without the future moving its counters out); the
/// caller passes a zeroed accumulator.
///
/// Written out as a future (not an `async fn`): one state, polled in place;
/// the generated state machine moved the operation's future and its
/// counters between its states and out through two outputs on every
/// operation (docs/performance.md, "Sixteenth pass").
#[inline]
fn call<'a, F: Future>(
    ep: &'a Endpoint,
    clock: LatencyClock,
    kind: OpKind,
    fut: F,
    cost: &'a mut Counters,
) -> Call<'a, F> {
    let start = clock.read();
    // The simulated thread's core spends its per-operation CPU first
    // (`begin_op`: made now, when the stopwatch starts, as the `async fn`
    // made it on its first poll; skipped where it never does anything).
    let begin = ep.begin_op_needed().then(|| ep.begin_op());
    Call {
        ep,
        kind,
        clock,
        start,
        begin,
        cost,
        fut,
    }
}

pin_project_lite::pin_project! {
    /// See [`call`].
    struct Call<'a, F> {
        ep: &'a Endpoint,
        kind: OpKind,
        clock: LatencyClock,
        // `clock`'s reading when the operation was issued.
        start: u64,
        begin: Option<dmkv_transport::OpFuture<'a, ()>>,
        cost: &'a mut Counters,
        #[pin]
        fut: F,
    }
}

impl<F: Future> Future for Call<'_, F> {
    type Output = (F::Output, u64);
    #[inline]
    fn poll(self: std::pin::Pin<&mut Self>, cx: &mut std::task::Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        if let Some(begin) = this.begin {
            if std::pin::Pin::new(begin).poll(cx).is_pending() {
                return Poll::Pending;
            }
            *this.begin = None;
        }
        // Every charge made while `fut` is polled goes to `kind` and to
        // `cost` (what `metered` does).
        let (ep, kind, fut) = (*this.ep, *this.kind, this.fut);
        match ep.metering(this.cost, || {
            dmkv_transport::counters::with_kind(kind, || fut.poll(cx))
        }) {
            Poll::Ready(out) => Poll::Ready((out, this.clock.ns_since(*this.start))),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// What a task's operations share, borrowed by each [`execute`]: making an
/// operation's future then stores two words (this and the operation), not
/// the eight its parts took as arguments.
struct TaskIo<'c, 'e, 'v> {
    ctx: &'c Ctx<'e>,
    ep: &'c Endpoint,
    /// The task's latency clock.
    clock: LatencyClock,
    kv: &'c dyn KvStore,
    /// Whether `kv` takes a GET's value back ([`KvStore::recycle`]),
    /// asked once: an engine that does not gets no call per value.
    recycles: bool,
    /// The endpoint `kv`'s `recycle` hands values to, if that is all it
    /// does ([`KvStore::recycles_to`], asked once): values go there
    /// directly, one `dyn` call (the backend's) instead of three.
    recycles_to: Option<&'c Endpoint>,
    figures: &'c RefCell<RunFigures>,
    /// Where each operation's future runs (allocated once, reused).
    slot: FutureSlot,
    values: &'v mut TaskValues,
    /// The task's costs per operation type ([`OpType::index`]): each
    /// operation's charges are added to its type's entry in place, as they
    /// are made ([`Endpoint::metering`]), and the task adds these to its
    /// thread's figures when it ends. (Metered into a zeroed accumulator
    /// per operation and added to the figures with its latency, they cost
    /// a zeroing and a ten-field sum per operation, and the accumulator
    /// lived in the operation's future across its await.) An operation
    /// dropped unfinished (`--op-limit`'s stop) keeps what it was charged
    /// so far here; it used to be left out.
    costs: [Counters; OpType::COUNT],
}

/// Runs one operation, checks its answer and records it; true if it
/// failed with an error.
///
/// The engine's future runs in `slot`, the task's [`FutureSlot`], reused by
/// each of its operations: no allocation per operation for engines that
/// implement [`dmkv_api::KvClient`] (docs/performance.md, "Eleventh pass").
async fn execute(io: &mut TaskIo<'_, '_, '_>, op: Op) -> bool {
    let mut errored = false;
    let (ctx, ep, clock, kv, figures) = (io.ctx, io.ep, io.clock, io.kv, io.figures);
    // A checked GET's value goes back to the engine if it takes it
    // (rpc-hash: its next request's buffer); otherwise it is dropped here.
    let (recycles, recycles_to) = (io.recycles, io.recycles_to);
    let hand_back = |v: Option<Vec<u8>>| {
        if let Some(v) = v
            && recycles
        {
            match recycles_to {
                Some(home) => home.recycle(v),
                None => kv.recycle(v),
            }
        }
    };
    let (plan, states, check) = (ctx.plan, ctx.states, ctx.checker());
    let size = ctx.cfg.value_size;
    let ty = op.op_type();
    let (slot, values) = (&mut io.slot, &mut *io.values);
    // What this operation costs is metered straight into its type's total
    // (see `TaskIo::costs`).
    let cost = &mut io.costs[ty.index()];
    // The key's state is read only after the operation, but fetched now,
    // with the key: two overlapping misses instead of one before and one
    // after the operation (at 1M keys both tables are far beyond the LLC).
    states.touch(op.index());
    match op {
        Op::Read(i) => {
            let key = plan.key(i);
            let t0 = states.stamp();
            let (r, lat) = call(ep, clock, OpKind::Get, kv.get_in(key, slot), cost).await;
            let f = &mut *figures.borrow_mut();
            f.record(ty, lat);
            match r {
                Ok(v) => {
                    check.get("get", i, t0, v.as_deref(), &mut f.findings);
                    hand_back(v);
                }
                Err(e) => {
                    f.errors.push(ty, key, &e);
                    errored = true;
                }
            }
        }
        Op::Update(i) => {
            let key = plan.key(i);
            let value = values.make(key, states.next_version(i), size);
            if let Some(n) = values.declared(size) {
                ep.charge_instructions(n).await;
            }
            let t0 = states.stamp();
            let (r, lat) = call(
                ep,
                clock,
                OpKind::Update,
                kv.update_in(key, &value, slot),
                cost,
            )
            .await;
            let f = &mut *figures.borrow_mut();
            f.record(ty, lat);
            match r {
                Ok(b) => check.outcome(
                    "update",
                    i,
                    states.stable_existence(i, t0),
                    b,
                    &mut f.findings,
                ),
                Err(e) => {
                    f.errors.push(ty, key, &e);
                    errored = true;
                }
            }
        }
        Op::Insert(i) | Op::Delete(i) => {
            // Only this task (the key's owner) inserts or deletes this key.
            let insert = ty == OpType::Insert;
            let key = plan.key(i);
            let before = states.settled_existence(i);
            states.begin_change(i);
            let (r, lat) = if insert {
                let value = values.make(key, states.next_version(i), size);
                if let Some(n) = values.declared(size) {
                    ep.charge_instructions(n).await;
                }
                call(
                    ep,
                    clock,
                    OpKind::Insert,
                    kv.insert_in(key, &value, slot),
                    cost,
                )
                .await
            } else {
                call(ep, clock, OpKind::Delete, kv.delete_in(key, slot), cost).await
            };
            // An insert succeeds iff the key was absent; a delete iff present.
            let expected = before.map(|exists| exists != insert);
            let after = match &r {
                // A wrong answer leaves the key's existence unknown.
                Ok(got) if expected.is_some_and(|e| e != *got) => None,
                Ok(true) => Some(insert),
                Ok(false) => before,
                Err(_) => None,
            };
            states.end_change(i, after);
            let f = &mut *figures.borrow_mut();
            f.record(ty, lat);
            match r {
                Ok(got) => check.outcome(ty.name(), i, expected, got, &mut f.findings),
                Err(e) => {
                    f.errors.push(ty, key, &e);
                    errored = true;
                }
            }
        }
        Op::Scan(i, n) => {
            let key = plan.key(i);
            let t0 = states.stamp();
            let (r, lat) = call(
                ep,
                clock,
                OpKind::Scan,
                kv.scan_in(key, n as usize, slot),
                cost,
            )
            .await;
            let f = &mut *figures.borrow_mut();
            f.record(ty, lat);
            match r {
                Ok(items) => check.scan(key, n as usize, t0, &items, &mut f.findings),
                Err(e) => {
                    f.errors.push(ty, key, &e);
                    errored = true;
                }
            }
        }
        Op::Rmw(i) => {
            let key = plan.key(i);
            let t0 = states.stamp();
            let (r, read_lat) = call(ep, clock, OpKind::Get, kv.get_in(key, slot), cost).await;
            match r {
                Ok(v) => {
                    check.get(
                        "rmw",
                        i,
                        t0,
                        v.as_deref(),
                        &mut figures.borrow_mut().findings,
                    );
                    hand_back(v);
                }
                Err(e) => {
                    let f = &mut *figures.borrow_mut();
                    f.record(ty, read_lat);
                    f.errors.push(ty, key, &e);
                    return true;
                }
            }
            let value = values.make(key, states.next_version(i), size);
            if let Some(n) = values.declared(size) {
                ep.charge_instructions(n).await;
            }
            let t1 = states.stamp();
            let (r, write_lat) = call(
                ep,
                clock,
                OpKind::Update,
                kv.update_in(key, &value, slot),
                cost,
            )
            .await;
            let f = &mut *figures.borrow_mut();
            f.record(ty, read_lat + write_lat);
            match r {
                Ok(b) => check.outcome(
                    "rmw update",
                    i,
                    states.stable_existence(i, t1),
                    b,
                    &mut f.findings,
                ),
                Err(e) => {
                    f.errors.push(ty, key, &e);
                    errored = true;
                }
            }
        }
    }
    errored
}

/// Reads back this task's share of the universe after the run, when every
/// key's existence is settled.
async fn verify_task(
    ctx: &Ctx<'_>,
    kv: &dyn KvStore,
    thread: usize,
    task: usize,
    out: &RefCell<VerifyFigures>,
) {
    let (plan, states, check) = (ctx.plan, ctx.states, ctx.checker());
    let mut unreported = 0;
    for i in plan.verify_indices(thread, task) {
        unreported += 1;
        if unreported == PROGRESS_STEP {
            ctx.verify_bar.inc(unreported);
            unreported = 0;
        }
        let key = plan.key(i);
        let Some(expected) = states.settled_existence(i) else {
            out.borrow_mut().skipped += 1;
            continue;
        };
        let r = labeled(OpKind::Verify, kv.get(key)).await;
        let v = &mut *out.borrow_mut();
        v.checked += 1;
        match r {
            Err(e) => {
                v.errors += 1;
                v.note(|| format!("get of key {key} failed: {e}"));
            }
            Ok(Some(_)) if !expected => {
                v.unexpected += 1;
                v.note(|| format!("key {key} should be absent but was found"));
            }
            Ok(Some(value)) => {
                if let Err((_, m)) = check.value(i, &value) {
                    v.mismatches += 1;
                    v.note(|| m);
                }
            }
            Ok(None) if expected => {
                v.missing += 1;
                v.note(|| format!("key {key} should be present but was not found"));
            }
            Ok(None) => {}
        }
    }
    ctx.verify_bar.inc(unreported);
}
