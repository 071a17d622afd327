//! Deterministic simulation testing (`dmkv dst`): every engine's workload,
//! oracle checks and read-back verification run on the simulated cluster
//! across many seeds, with seeded message jitter so that each seed explores
//! different interleavings (races, torn reads, lock conflicts), plus a race
//! of concurrent inserts of the same fresh keys. A failing
//! seed is printed with the `dmkv bench` command that replays exactly it.
//!
//! With `--faults`, the seed also chooses faults (see [`FaultPlan`]): large
//! delays on chosen messages (reordered across connections), a compute
//! client killed mid-operation ([`kill_client`]), a memory node crashing
//! mid-run, and values of several cache lines (torn reads). Everything is a
//! function of the seed and the flags, so `--first-seed S --seeds 1` with
//! the same `--faults` replays a failure exactly.
//!
//! Each seed also draws, last, settings of the engine that take other code
//! paths than its defaults ([`VARIANTS`]: another lock protocol, no cache,
//! small nodes that split often, ...), unless `--variants off` or the
//! setting is given with `--set`; the replay command names them.
//!
//! The test target runs a few hundred seeds per engine; `scripts/dst-sweep.sh`
//! runs many more.

use dmkv_api::EngineSpec;
use dmkv_bench::workload::Mix;
use dmkv_bench::{BenchConfig, Dist, EngineChoice, SimDeployer, Workload, WorkloadSource};
use dmkv_transport::sim::{MessageDelays, Profile, SimConfig};
use rand::{Rng, SeedableRng};
use std::io::Write;
use std::sync::Arc;

mod kill;
pub use kill::kill_client;

/// The designs `dmkv dst` tests by default: the default comparison set and
/// ScaleStore (on `DstParams::nodes` symmetric nodes): every design that
/// runs on the simulated cluster.
pub fn engines() -> Vec<&'static str> {
    let mut v = crate::engines::REGISTRY.default_set.to_vec();
    if !v.contains(&"scalestore") {
        v.push("scalestore");
    }
    v
}

/// Engine settings whose other values take other code paths than the
/// defaults: per engine, each knob and the values a seed may draw besides
/// its default (each with the default's chance: one alternative means half
/// the seeds). Every value must be one the engine accepts and that keeps
/// the DST's small runs (256 keys, 1,200 operations, up to three memory
/// nodes) within what the design promises: a seed that fails with one is a
/// bug to look at, not a setting to drop.
pub const VARIANTS: &[(&str, &str, &[&str])] = &[
    // CAS and READ in one batch (docs/sherman.md); every walk from the
    // root; 12-entry nodes, so loads and inserts split and grow the tree.
    ("sherman", "lock_read", &["combined"]),
    ("sherman", "cache_mb", &["0"]),
    ("sherman", "node_bytes", &["256"]),
    // No local lock sharing, or sharing without hand-overs; 4-pair
    // leaves (many synonym leaves and splits); 8-slot SLTs (full tables
    // wait for retraining); bulk-loaded models of at most 64 keys (the
    // loads' calls of 64 each meet the last model and reuse dead leaves).
    ("rolex", "lock_sharing", &["false"]),
    ("rolex", "max_handover", &["0"]),
    ("rolex", "leaf_slots", &["4"]),
    ("rolex", "slt_slots", &["8"]),
    ("rolex", "load_model_keys", &["64"]),
    // Whole-leaf reads; the smaller caches (TT entries read per lookup);
    // no speculation, no hints, no expansion; 4-slot XTree nodes; at most
    // two leaves per lookup (wider predictions take the fallback RPC).
    ("xstore", "get_read", &["leaves"]),
    ("xstore", "cache", &["models-only", "top-only"]),
    ("xstore", "speculation", &["off"]),
    ("xstore", "hints", &["off"]),
    ("xstore", "expansion", &["off"]),
    ("xstore", "slots", &["4"]),
    ("xstore", "max_leaves", &["2"]),
    // One subtable at the start (the directory doubles as keys arrive);
    // 4 bucket groups per subtable (splits early and often).
    ("race", "initial_depth", &["0"]),
    ("race", "groups", &["4"]),
    // Tables of ~64 keys (several tables per shard: splits and resizes);
    // resizes on a worker core of their own.
    ("outback", "table_keys", &["64"]),
    ("outback", "resize_share_handlers", &["false"]),
    // Every inner level cached, or no cache at all.
    ("cell", "cached_levels", &["1"]),
    ("cell", "cache_bytes", &["0"]),
    // 4-slot nodes (splits on nearly every few inserts).
    ("rpc-btree", "slots", &["4"]),
    // One main bucket (every key in one chain of indirect buckets).
    ("rpc-hash", "buckets", &["1"]),
    // The directory's FIFO queue (and its awaited acknowledgements);
    // new pages on the allocating node; the load spread by ranges; worker
    // lines priced through the LLC model.
    ("scalestore", "protocol", &["fifo"]),
    ("scalestore", "fifo_ack", &["await"]),
    ("scalestore", "alloc", &["local"]),
    ("scalestore", "load", &["ranges"]),
    ("scalestore", "worker_lines", &["llc"]),
];

/// The fault kinds a seed may inject (`--faults`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Faults {
    /// Large seeded delays on chosen messages.
    pub delay: bool,
    /// A compute client killed mid-operation.
    pub kill: bool,
    /// A memory node crashing mid-run (disaggregated designs).
    pub crash: bool,
    /// Values of several cache lines (torn reads where writes land).
    pub large: bool,
}

impl Faults {
    pub const ALL: Faults = Faults {
        delay: true,
        kill: true,
        crash: true,
        large: true,
    };
}

impl std::str::FromStr for Faults {
    type Err = String;
    fn from_str(s: &str) -> Result<Faults, String> {
        let mut f = Faults::default();
        for kind in s.split(',').map(str::trim).filter(|k| !k.is_empty()) {
            match kind {
                "delay" => f.delay = true,
                "kill" => f.kill = true,
                "crash" => f.crash = true,
                "large" => f.large = true,
                "all" => f = Faults::ALL,
                "none" => {}
                _ => {
                    return Err(format!(
                        "unknown fault {kind:?}: expected delay, kill, crash, large, all or none"
                    ));
                }
            }
        }
        Ok(f)
    }
}

impl std::fmt::Display for Faults {
    /// The `--faults` value that selects these (empty for none).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let kinds: Vec<&str> = [
            (self.delay, "delay"),
            (self.kill, "kill"),
            (self.crash, "crash"),
            (self.large, "large"),
        ]
        .iter()
        .filter(|k| k.0)
        .map(|k| k.1)
        .collect();
        write!(f, "{}", kinds.join(","))
    }
}

/// The faults one seed injects into one engine's runs. Every choice is drawn
/// from the seed, all of them whatever `--faults` enables (so a seed's
/// delays are the same with `--faults delay` as with `--faults all`), then
/// the kinds not enabled are left out.
#[derive(Debug, Clone)]
pub struct FaultPlan {
    /// Message delays (every simulated run of the seed).
    pub delays: MessageDelays,
    /// Value size of the mixed workload (8 bytes without `large`).
    pub value_size: usize,
    /// The mixed workload's memory nodes, and the crash of one of them.
    pub memnodes: usize,
    pub crash: Option<dmkv_bench::CrashPlan>,
    /// Whether the kill phase runs ([`kill_client`]).
    pub kill: bool,
    /// The mixed run's shape is a hot tail instead of zipfian over random
    /// keys (not a fault: every seed may get it, whatever `--faults` says).
    pub hot: bool,
    /// Settings from [`VARIANTS`] this seed runs the engine with, besides
    /// its defaults (not a fault either): `(knob, value)`, only those that
    /// differ from the default and that `--set` does not give.
    pub variant: Vec<(&'static str, &'static str)>,
}

impl FaultPlan {
    /// The seed's engine settings are drawn from [`VARIANTS`] when
    /// `variants` gives the sweep's own settings (those knobs keep the
    /// sweep's value); `None`: no variants.
    pub fn choose(
        spec: &dyn EngineSpec,
        seed: u64,
        faults: Faults,
        variants: Option<&dmkv_api::Knobs>,
    ) -> FaultPlan {
        let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0xfa17_5eed_0bad_c0de);
        // Half the seeds delay 2% of the messages by 5-40 us each: far
        // beyond the ~1 us wire latency and the 400 ns jitter, so messages
        // on different connections overtake each other.
        let delay = rng.gen_bool(0.5);
        let delays = MessageDelays {
            per_million: 20_000,
            max_ns: rng.gen_range(10_000..=40_000),
        };
        // Half the seeds use values of 2-4 cache lines (the simulator moves
        // reads and writes of more than 64 bytes in pieces, so a read
        // racing a write of the same value tears).
        let large = rng.gen_bool(0.5);
        let large_size = (64 * rng.gen_range(2..=4) + 24).min(spec.capabilities().max_value_len);
        // A third of the seeds crash a memory node once 20-80% of the
        // operations completed: Outback (which fails over) on 3 memory
        // nodes, the others on 2 (keys on the survivor stay reachable).
        let crash = rng.gen_bool(1.0 / 3.0);
        let memnodes = if spec.name() == "outback" { 3 } else { 2 };
        let crash_plan = dmkv_bench::CrashPlan {
            node: rng.gen_range(0..memnodes),
            at_fraction: rng.gen_range(4..=16) as f64 / 20.0,
        };
        let kill = rng.gen_bool(0.5);
        // A quarter of the seeds run the hot-tail shape (drawn last, so the
        // draws above are what they were before it existed).
        let hot = rng.gen_bool(0.25);
        // Seeds that crash nothing run on one, two or three memory nodes
        // alike (drawn last too), so that a design's checks also run with
        // its data spread over memory nodes (routing by key, scans across
        // ranges, allocation on several nodes) without a crash.
        let spread = rng.gen_range(1..=3);
        // The engine's setting variants, drawn after everything above (so
        // those draws are what they were before variants existed), one
        // draw per listed knob whether or not it is used.
        let mut variant = Vec::new();
        for &(_, knob, values) in VARIANTS.iter().filter(|v| v.0 == spec.name()) {
            let pick = rng.gen_range(0..=values.len());
            if let Some(set) = variants
                && pick > 0
                && set.iter().all(|(k, _)| k != knob)
            {
                variant.push((knob, values[pick - 1]));
            }
        }
        let disaggregated = spec.topology() == dmkv_api::Topology::Disaggregated;
        let crash = faults.crash && crash && disaggregated;
        FaultPlan {
            delays: if faults.delay && delay {
                delays
            } else {
                MessageDelays::default()
            },
            value_size: if faults.large && large && large_size > 64 {
                large_size
            } else {
                dmkv_bench::config::defaults::VALUE_SIZE
            },
            memnodes: match (crash, disaggregated) {
                (true, _) => memnodes,
                (false, true) => spread,
                (false, false) => 1,
            },
            crash: crash.then_some(crash_plan),
            kill: faults.kill && kill,
            hot,
            variant,
        }
    }
}

/// What the faults of a sweep did, per engine.
#[derive(Debug, Default, Clone, Copy)]
struct FaultTally {
    delayed_runs: u64,
    large_runs: u64,
    crashes: u64,
    kills: u64,
    kills_mid_op: u64,
    blocked: u64,
    /// Mixed runs in the hot-tail shape.
    hot_runs: u64,
    /// The slowest operation of the mixed runs, and its seed.
    slowest_us: f64,
    slowest_seed: u64,
    /// Seeds with a held frame in any phase, and the longest hold (ns of
    /// virtual time) with its seed.
    held_seeds: u64,
    held_max_ns: u64,
    held_seed: u64,
}

impl FaultTally {
    fn note_held(&mut self, seed: u64, held: dmkv_transport::sim::FramesHeld) {
        if held.max_ns > self.held_max_ns {
            (self.held_max_ns, self.held_seed) = (held.max_ns, seed);
        }
    }
}

/// The shape of one simulated run.
#[derive(Debug, Clone)]
pub struct DstParams {
    pub keys: u64,
    pub ops: u64,
    pub compute_nodes: usize,
    /// Nodes of a symmetric design (ScaleStore's `--nodes`).
    pub nodes: usize,
    pub threads: usize,
    pub tasks: usize,
    pub jitter_ns: u64,
    pub profile: String,
    /// Fault kinds the seeds may inject.
    pub faults: Faults,
    /// Virtual time after which an operation of the mixed run fails the
    /// seed and stops the run (`--op-limit-ms`; see [`OP_LIMIT`]).
    pub op_limit: std::time::Duration,
    /// A nested wait may hold the frame below it this long in virtual time
    /// before the seed fails (`--hold-limit-ms`; see [`HOLD_LIMIT`]).
    pub hold_limit: std::time::Duration,
    /// Engine settings (`--set ENGINE.KNOB=VALUE`), per engine name.
    pub knobs: std::collections::BTreeMap<String, dmkv_api::Knobs>,
    /// Whether seeds draw engine settings from [`VARIANTS`] (`--variants`).
    pub variants: bool,
}

impl DstParams {
    /// The settings of `engine` in this sweep.
    pub fn knobs_of(&self, engine: &str) -> dmkv_api::Knobs {
        self.knobs.get(engine).cloned().unwrap_or_default()
    }

    /// ` --set ENGINE.KNOB=VALUE` for each setting of `engine`.
    fn set_flags(&self, engine: &str) -> String {
        self.knobs_of(engine)
            .iter()
            .map(|(k, v)| format!(" --set {engine}.{k}={v}"))
            .collect()
    }

    /// The seed's plan, its variants drawn if this sweep draws them.
    pub fn plan(&self, spec: &dyn EngineSpec, seed: u64) -> FaultPlan {
        let own = self.knobs_of(spec.name());
        FaultPlan::choose(spec, seed, self.faults, self.variants.then_some(&own))
    }

    /// The settings `engine` runs with on a seed of `plan`: the sweep's own
    /// and the seed's variants.
    pub fn knobs_for(&self, engine: &str, plan: &FaultPlan) -> dmkv_api::Knobs {
        let mut k = self.knobs_of(engine);
        for (knob, value) in &plan.variant {
            k.set(knob, value);
        }
        k
    }
}

/// The default per-operation limit of the mixed run: 10 s of virtual time.
/// It must exceed every wait an engine legitimately makes, and such waits
/// chain: the longest an engine bounds itself by is Outback's
/// `countdown_timeout_ms` (1 s: a memory node waits that long for compute
/// nodes to fetch a new locator during a resize), and in a 300-seed sweep
/// of every engine with every fault (docs/simulation.md) the slowest
/// passing operation was an Outback insert behind two of them, 2.01 s
/// (seeds 55 and 276: a memory-node crash in the hot-tail shape); with a
/// 2 s limit those seeds failed. The other engines' slowest were under
/// 7 ms (delayed messages at most 40 us each, `NodeDown` at once from a
/// crashed node, ScaleStore's SSD, ROLEX's full-SLT wait for a retrain
/// whose lock waits are bounded at 50 ms). 10 s is 5 times the slowest
/// operation seen and 10 times the longest engine timeout; a livelocked
/// ROLEX operation (backoffs of at most 500 us) reaches it in tens of
/// seconds of wall time. The sweep prints the slowest operation per
/// engine and its distribution over the seeds, so the margin can be
/// watched. (Those Outback seconds were a takeover queued behind
/// countdowns its stalled clients could not answer; since the countdown
/// left the worker, branch i28, Outback's slowest over 300 seeds is
/// 4.8 ms: docs/outback.md, "The countdown off the worker".)
pub const OP_LIMIT: std::time::Duration = std::time::Duration::from_secs(10);

/// The default limit on a held frame (`--hold-limit-ms`): 100 ms of
/// virtual time (docs/simulation.md, "Held frames"). While worker jobs
/// still nested, one started inside another's synchronous wait held that
/// one for its own remaining length: over 750 passing seeds of the
/// default shape the longest such hold was 8.15 ms (XStore-D's retrains;
/// Outback's resizes 4.62 ms), 12 times below this limit, and 20 times
/// above it the 2 s and longer holds of Outback's countdown when its
/// worker waited for it synchronously (the pre-i28 bug, re-introduced on
/// a scratch build: 171 of 300 seeds failed with the check, none
/// without it). Worker jobs are coroutines now (`sim::jobco`) and hold
/// nothing; the check guards the waits that still nest (RPC handlers').
/// Shapes with longer handler waits may need it raised; the summary
/// prints the longest hold.
pub const HOLD_LIMIT: std::time::Duration = std::time::Duration::from_millis(100);

/// Why a run's nested waits fail its seed, if one held the frame below it
/// longer than `limit` (docs/simulation.md, "The rule for synchronous
/// waits": a synchronous wait of code that is not a worker job must be
/// short and must not wait for compute clients or other nodes; the code
/// waiting in the frame below resumes only when it ends).
pub fn held_too_long(
    held: dmkv_transport::sim::FramesHeld,
    limit: std::time::Duration,
) -> Option<String> {
    (held.max_ns > limit.as_nanos() as u64).then(|| {
        format!(
            "a synchronous wait held the frame below it for {:.3} ms of virtual time (limit {limit:?}; {} frames held, {:.3} ms in all): code that waits synchronously and is not a worker job (an RPC handler's `block_on`, `sleep_blocking`, `ssd_io_blocking`) waited for clients or other nodes instead of being awaited, or longer than the limit (docs/simulation.md, \"The rule for synchronous waits\", \"Held frames\")",
            held.max_ns as f64 / 1e6,
            held.count,
            held.total_ns as f64 / 1e6
        )
    })
}

impl Default for DstParams {
    fn default() -> Self {
        DstParams {
            keys: 256,
            ops: 1200,
            compute_nodes: 2,
            nodes: 3,
            threads: 2,
            tasks: 4,
            jitter_ns: 400,
            profile: dmkv_transport::sim::profile::DEFAULT_PROFILE.into(),
            faults: Faults::default(),
            op_limit: OP_LIMIT,
            hold_limit: HOLD_LIMIT,
            knobs: Default::default(),
            variants: true,
        }
    }
}

/// A seed on which an engine answered wrongly, failed or lost data.
#[derive(Debug, Clone)]
pub struct DstFailure {
    pub engine: String,
    pub seed: u64,
    pub why: String,
    /// The command that replays exactly this run.
    pub replay: String,
}

/// A contended mix of every operation the engine supports, on a zipfian
/// distribution over a small key set.
fn mix(spec: &dyn EngineSpec) -> Mix {
    let scan = if spec.capabilities().scan { 5 } else { 0 };
    Mix {
        read: 45 - scan,
        update: 25,
        insert: 15,
        delete: 10,
        scan,
        rmw: 5,
    }
}

/// The simulation of one run of `seed`.
fn sim_config(p: &DstParams, seed: u64, plan: &FaultPlan) -> Result<SimConfig, String> {
    Ok(SimConfig {
        profile: Profile::load(&p.profile)?,
        seed,
        jitter_ns: p.jitter_ns,
        delays: plan.delays,
    })
}

/// The hot-tail shape of the mixed run ([`FaultPlan::hot`]): a sequential
/// key set, so every insert goes to the tail of the key space; reads of the
/// latest keys, so other compute nodes miss on new leaves and refresh their
/// caches; more writers per compute node, so locks are contended and
/// handed over. ROLEX's lock hand-over bug livelocked in this shape
/// (docs/simulation.md).
const HOT_MIX: Mix = Mix {
    read: 60,
    update: 0,
    insert: 40,
    delete: 0,
    scan: 0,
    rmw: 0,
};
const HOT_THREADS: usize = 4;
const HOT_TASKS: usize = 8;
/// Operations of a hot-tail run: with the DST's 1,200 the re-introduced
/// ROLEX bug showed in 0 of 6 seeds, with 4,000 in 3 of 12
/// (docs/simulation.md).
const HOT_OPS: u64 = 4000;

/// Keys per load call of the mixed run: the key set is loaded in several
/// calls, so engines' incremental load paths run too (the replay command
/// passes it as `--load-chunk`).
const LOAD_CHUNK: usize = 64;

/// What a mixed run measured besides its checks.
#[derive(Debug, Clone, Copy, Default)]
pub struct MixedFigures {
    /// The slowest operation's latency, in microseconds of virtual time.
    pub slowest_us: f64,
    /// Its simulation's held frames (load, run and verify).
    pub held: dmkv_transport::sim::FramesHeld,
}

/// Runs `spec` once with `seed` (the mixed workload, with the seed's
/// delays, value size and memory-node crash); the failure, if a check
/// failed, what the run measured, and the `dmkv bench` command that
/// replays the run.
pub fn run_mixed(
    spec: &'static dyn EngineSpec,
    seed: u64,
    p: &DstParams,
    plan: &FaultPlan,
) -> (Option<DstFailure>, MixedFigures, String) {
    let config = match sim_config(p, seed, plan) {
        Ok(c) => c,
        Err(e) => {
            let f = DstFailure {
                engine: spec.name().into(),
                seed,
                why: e,
                replay: String::new(),
            };
            return (Some(f), MixedFigures::default(), String::new());
        }
    };
    let (m, dist, keyset, threads, tasks, ops) = if plan.hot {
        (
            HOT_MIX,
            Dist::Latest,
            dmkv_bench::KeysetSpec::Sequential,
            HOT_THREADS,
            HOT_TASKS,
            HOT_OPS,
        )
    } else {
        (
            mix(spec),
            Dist::Zipfian,
            dmkv_bench::KeysetSpec::Uniform,
            p.threads,
            p.tasks,
            p.ops,
        )
    };
    let mut cfg = BenchConfig::new(vec![EngineChoice {
        spec,
        knobs: p.knobs_for(spec.name(), plan),
    }]);
    cfg.workload = WorkloadSource::Synthetic(Workload::Mixed(m));
    cfg.dist = Some(dist);
    cfg.keyset = keyset.clone();
    cfg.keys = p.keys;
    cfg.ops = ops;
    cfg.threads = threads;
    cfg.tasks = tasks;
    cfg.op_limit = Some(p.op_limit);
    cfg.compute_nodes = p.compute_nodes;
    cfg.nodes = p.nodes;
    cfg.verify = true;
    cfg.seed = seed;
    cfg.load_chunk = LOAD_CHUNK;
    cfg.value_size = plan.value_size;
    cfg.memnodes = plan.memnodes;
    cfg.crash = plan.crash;
    cfg.deployer = Arc::new(SimDeployer {
        options: dmkv_api::sim_deploy::SimOptions {
            config,
            compute_nodes: p.compute_nodes,
            threads_per_node: threads,
        },
    });
    let mut replay = format!(
        "dmkv bench --transport sim --profile {} --engine {} --keyset {keyset} --workload mixed:{},{},{},{},{},{} --dist {} --keys {} --ops {ops} --compute-nodes {} --nodes {} --threads {threads} --tasks {tasks} --jitter-ns {} --seed {seed} --verify --op-limit-ms {} --load-chunk {LOAD_CHUNK}",
        p.profile,
        spec.name(),
        m.read,
        m.update,
        m.insert,
        m.delete,
        m.scan,
        m.rmw,
        if plan.hot { "latest" } else { "zipfian" },
        p.keys,
        p.compute_nodes,
        p.nodes,
        p.jitter_ns,
        p.op_limit.as_millis()
    );
    replay += &p.set_flags(spec.name());
    for (knob, value) in &plan.variant {
        replay += &format!(" --set {}.{knob}={value}", spec.name());
    }
    if plan.value_size != dmkv_bench::config::defaults::VALUE_SIZE {
        replay += &format!(" --value-size {}", plan.value_size);
    }
    if plan.delays.enabled() {
        replay += &format!(" --delay-faults {}", plan.delays);
    }
    if let Some(c) = plan.crash {
        replay += &format!(
            " --memnodes {} --crash-memnode {}@{}",
            plan.memnodes, c.node, c.at_fraction
        );
    } else if plan.memnodes > 1 {
        replay += &format!(" --memnodes {}", plan.memnodes);
    }
    let fail = |why: String| {
        Some(DstFailure {
            engine: spec.name().into(),
            seed,
            why,
            replay: replay.clone(),
        })
    };
    let none = MixedFigures::default();
    let outcome = match dmkv_bench::run(&cfg) {
        Ok(o) => o,
        Err(e) => return (fail(e.to_string()), none, replay),
    };
    if let Some(f) = outcome.failures.first() {
        return (fail(f.error.clone()), none, replay);
    }
    let Some(r) = outcome.reports.first() else {
        return (None, none, replay);
    };
    let held = r
        .sim
        .as_ref()
        .map_or_else(Default::default, |s| s.frames_held);
    let figures = MixedFigures {
        slowest_us: r.latency_us.max,
        held,
    };
    let failure = judge(spec, plan, r)
        .or_else(|| held_too_long(held, p.hold_limit))
        .and_then(fail);
    (failure, figures, replay)
}

/// What a mixed run's report says: None if it passed, else why not.
fn judge(
    spec: &dyn EngineSpec,
    plan: &FaultPlan,
    r: &dmkv_bench::report::EngineReport,
) -> Option<String> {
    if r.ok {
        return None;
    }
    if let (Some(_), Some(c)) = (plan.crash, &r.crash) {
        // A memory node crashed. Outback replicates and fails over: its run
        // must pass every check (handled above). The other designs do not
        // promise availability: operations may fail with an error once the
        // node is gone, and keys it held may not read back, but no
        // operation may return a wrong answer and no key may read back a
        // wrong value.
        if spec.name() != "outback"
            && c.crashed
            && c.failure.is_none()
            && r.checks.failures == 0
            && r.verify.mismatches == 0
            && r.verify.unexpected == 0
        {
            return None;
        }
    }
    let sample = r
        .errors
        .samples
        .iter()
        .chain(&r.checks.samples)
        .chain(&r.verify.samples)
        .next()
        .cloned()
        .unwrap_or_default();
    // A failed check (a wrong answer) matters more than an error: name it.
    let check = r
        .checks
        .samples
        .first()
        .map(|c| format!("; first failed check: {c}"))
        .unwrap_or_default();
    Some(format!(
        "{} errors, {} failed checks, {} verification failures; first: {sample}{check}",
        r.errors.count,
        r.checks.failures,
        r.verify.failures()
    ))
}

/// The command that replays one seed of `dmkv dst` exactly.
fn dst_replay(spec: &dyn EngineSpec, seed: u64, p: &DstParams) -> String {
    let mut s = format!(
        "dmkv dst --engine {} --first-seed {seed} --seeds 1 --keys {} --ops {} --nodes {} --jitter-ns {} --profile {}",
        spec.name(),
        p.keys,
        p.ops,
        p.nodes,
        p.jitter_ns,
        p.profile
    );
    if p.faults != Faults::default() {
        s += &format!(" --faults {}", p.faults);
    }
    if p.hold_limit != HOLD_LIMIT {
        s += &format!(" --hold-limit-ms {}", p.hold_limit.as_millis());
    }
    if p.op_limit != OP_LIMIT {
        s += &format!(" --op-limit-ms {}", p.op_limit.as_millis());
    }
    if !p.variants {
        s += " --variants off";
    }
    s + &p.set_flags(spec.name())
}

/// Runs every engine on every seed of `seeds`: the mixed workload, the
/// insert race and, where the seed kills a client, the kill phase; reports
/// failures as they come, then per engine how many seeds passed and what
/// the faults did.
pub fn sweep(
    engines: &[&'static dyn EngineSpec],
    seeds: std::ops::Range<u64>,
    p: &DstParams,
    out: &mut dyn Write,
) -> Vec<DstFailure> {
    let mut failures = Vec::new();
    for &spec in engines {
        let mut failed = 0;
        let mut t = FaultTally::default();
        // Each seed's slowest operation, for the distribution printed below.
        let mut slowest_each = Vec::new();
        // The replay of the seed with the slowest operation.
        let mut slowest_replay = String::new();
        // Seeds per drawn setting variant.
        let mut variant_runs = std::collections::BTreeMap::new();
        for seed in seeds.clone() {
            let plan = p.plan(spec, seed);
            for v in &plan.variant {
                *variant_runs.entry(*v).or_insert(0u64) += 1;
            }
            t.delayed_runs += plan.delays.enabled() as u64;
            t.large_runs += (plan.value_size > 64) as u64;
            t.crashes += plan.crash.is_some() as u64;
            t.hot_runs += plan.hot as u64;
            let (mixed, figures, replay) = run_mixed(spec, seed, p, &plan);
            let slowest = figures.slowest_us;
            slowest_each.push(slowest);
            if slowest > t.slowest_us {
                (t.slowest_us, t.slowest_seed) = (slowest, seed);
                slowest_replay = replay;
            }
            let mut held = figures.held.count;
            t.note_held(seed, figures.held);
            let mut result = mixed.or_else(|| {
                let (race, race_held) = insert_race(spec, seed, p, &plan);
                held += race_held.count;
                t.note_held(seed, race_held);
                race
            });
            if result.is_none() && plan.kill {
                t.kills += 1;
                match kill_client(spec, seed, p, &plan) {
                    Ok(k) => {
                        t.kills_mid_op += k.killed_mid_op as u64;
                        t.blocked += k.blocked;
                        held += k.held.count;
                        t.note_held(seed, k.held);
                    }
                    Err(f) => result = Some(f),
                }
            }
            t.held_seeds += (held > 0) as u64;
            if let Some(f) = result {
                let _ = writeln!(
                    out,
                    "FAIL {} seed {}: {}\n  replay: {}",
                    f.engine, f.seed, f.why, f.replay
                );
                failed += 1;
                failures.push(f);
            }
        }
        let _ = writeln!(
            out,
            "{}: {} of {} seeds passed",
            spec.name(),
            seeds.end - seeds.start - failed,
            seeds.end - seeds.start
        );
        let _ = writeln!(
            out,
            "  {} mixed runs in the hot-tail shape; slowest operation {:.1} us of virtual time (seed {}; limit {:?})",
            t.hot_runs, t.slowest_us, t.slowest_seed, p.op_limit
        );
        let _ = writeln!(out, "  {}", slowest_summary(&mut slowest_each));
        let _ = writeln!(
            out,
            "  nested waits held: in {} seeds, longest {:.1} us of virtual time (seed {}; limit {:?})",
            t.held_seeds,
            t.held_max_ns as f64 / 1e3,
            t.held_seed,
            p.hold_limit
        );
        if !slowest_replay.is_empty() {
            let _ = writeln!(out, "  slowest seed's mixed run: {slowest_replay}");
        }
        if !variant_runs.is_empty() {
            let list: Vec<String> = variant_runs
                .iter()
                .map(|((knob, value), n)| format!("{}.{knob}={value} {n}", spec.name()))
                .collect();
            let _ = writeln!(out, "  setting variants (seeds): {}", list.join(", "));
        }
        if p.faults != Faults::default() {
            let _ = writeln!(
                out,
                "  faults: {} runs with delayed messages, {} with large values, {} memory-node crashes, {} clients killed ({} mid-operation; {} survivor operations blocked by a dead client)",
                t.delayed_runs, t.large_runs, t.crashes, t.kills, t.kills_mid_op, t.blocked
            );
        }
    }
    failures
}

/// The distribution over seeds of each seed's slowest operation (so that a
/// change that moves tails can be compared beyond the one maximum).
fn slowest_summary(each: &mut [f64]) -> String {
    if each.is_empty() {
        return "no runs".into();
    }
    each.sort_by(f64::total_cmp);
    let at = |q: f64| each[((each.len() - 1) as f64 * q).round() as usize];
    let over = |us: f64| each.iter().filter(|&&v| v > us).count();
    format!(
        "slowest operation per seed (us): p50 {:.1}, p90 {:.1}, p99 {:.1}, max {:.1}; {} seeds over 10 ms, {} over 100 ms",
        at(0.5),
        at(0.9),
        at(0.99),
        at(1.0),
        over(10_000.0),
        over(100_000.0)
    )
}

/// Tasks that race to insert each fresh key in [`insert_race`].
const RACERS: usize = 8;
/// Fresh keys raced for per seed.
const RACED_KEYS: usize = 24;

/// Concurrent inserts of the same new key from tasks on several compute
/// nodes: exactly one succeeds, the others see "exists", and the key then
/// holds the winner's value (hash engines on disaggregated memory have got
/// this wrong; RACE once let two claims win). None if it holds for `seed`.
/// The seed's message delays apply. Also returns the simulation's held
/// frames (none reported when the race failed).
pub fn insert_race(
    spec: &'static dyn EngineSpec,
    seed: u64,
    p: &DstParams,
    plan: &FaultPlan,
) -> (Option<DstFailure>, dmkv_transport::sim::FramesHeld) {
    match insert_race_in(spec, seed, p, plan) {
        Ok(held) => (None, held),
        Err(f) => (Some(f), Default::default()),
    }
}

fn insert_race_in(
    spec: &'static dyn EngineSpec,
    seed: u64,
    p: &DstParams,
    plan: &FaultPlan,
) -> Result<dmkv_transport::sim::FramesHeld, DstFailure> {
    use dmkv_api::payload::make_value;
    use dmkv_testkit::insert_race::{check_round, fresh_keys, insert_each};
    use dmkv_transport::exec::{LocalTask, OpLimit, block_on, run_tasks};
    let fail = |why: String| DstFailure {
        engine: spec.name().into(),
        seed,
        why: format!("insert race: {why}"),
        replay: dst_replay(spec, seed, p),
    };
    let config = match sim_config(p, seed, plan) {
        Ok(c) => c,
        Err(e) => return Err(fail(e)),
    };
    let caps = spec.capabilities();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0x1a5e_47ace);
    let mut taken = std::collections::HashSet::new();
    let base = fresh_keys(&caps, &mut rng, 64, &mut taken);
    let raced = fresh_keys(&caps, &mut rng, RACED_KEYS, &mut taken);
    let size = 16usize.max(dmkv_api::payload::MIN_LEN);
    let opts = dmkv_api::deploy::DeployOptions {
        nodes: p.nodes,
        expected_keys: (base.len() + raced.len()) as u64,
        value_size: size as u32,
        threads: RACERS / 2,
        knobs: p.knobs_for(spec.name(), plan),
        ..Default::default()
    };
    let sim_opts = dmkv_api::sim_deploy::SimOptions {
        config,
        compute_nodes: 2,
        threads_per_node: RACERS / 4,
    };
    let dep = match dmkv_api::sim_deploy::SimDeployment::deploy(spec, &opts, &sim_opts) {
        Ok(d) => d,
        Err(e) => return Err(fail(format!("deploy: {e}"))),
    };
    let mut pairs: Vec<(u64, Vec<u8>)> =
        base.iter().map(|&k| (k, make_value(k, 1, size))).collect();
    pairs.sort_by_key(|p| p.0);
    let ep = dep.endpoint(0);
    if let Err(e) = block_on(dep.engine.load(&ep, &pairs)) {
        return Err(fail(format!("load: {e}")));
    }
    let mut clients = Vec::new();
    for t in 0..RACERS / 2 {
        match dep.client(t) {
            Ok(c) => clients.push(c),
            Err(e) => return Err(fail(format!("client: {e}"))),
        }
    }
    // Two tasks per client thread, all inserting the same keys in the same
    // order; the check is the testkit's (which races real threads on the
    // local backend in every engine's tests). Each insert, and the check's
    // reads, under the livelock limit, as the mixed run's operations: a
    // seed whose race never ends fails and is printed instead of hanging
    // the sweep.
    let limit = p.op_limit;
    let tasks: Vec<LocalTask<'_, Vec<Result<bool, String>>>> = (0..RACERS)
        .map(|i| {
            let kv = clients[i / 2].1.clone();
            let raced = &raced;
            Box::pin(async move { insert_each(&*kv, raced, i, size, Some(limit)).await })
                as LocalTask<'_, _>
        })
        .collect();
    let results = run_tasks(tasks);
    // The check reads the raced keys one after another: the limit once per
    // read, for them all.
    let reads = raced.len() as u32;
    let check = block_on(async {
        OpLimit::new(limit * reads)
            .run(check_round(&raced, &results, size, &*clients[0].1))
            .await
    });
    match check {
        Some(Ok(())) => {}
        Some(Err(e)) => return Err(fail(e)),
        None => {
            return Err(fail(format!(
                "the check's {reads} reads of the raced keys did not complete within {:?} of virtual time ({limit:?} each; a livelock or a wait that never ends)",
                limit * reads
            )));
        }
    }
    let held = dep.sim.frames_held();
    match held_too_long(held, p.hold_limit) {
        Some(why) => Err(fail(why)),
        None => Ok(held),
    }
}

#[cfg(test)]
mod summary_tests {
    /// A hold fails a seed only above the limit, and the reason names the
    /// longest hold, the count and the total.
    #[test]
    fn a_hold_fails_the_seed_only_above_the_limit() {
        use dmkv_transport::sim::FramesHeld;
        use std::time::Duration;
        let limit = Duration::from_millis(100);
        let at = |max_ns| FramesHeld {
            count: 3,
            total_ns: max_ns + 2_000,
            max_ns,
        };
        assert_eq!(super::held_too_long(FramesHeld::default(), limit), None);
        assert_eq!(super::held_too_long(at(100_000_000), limit), None);
        let why = super::held_too_long(at(100_000_001), limit).expect("over the limit");
        assert!(
            why.starts_with("a synchronous wait held the frame below it for 100.000 ms of virtual time (limit 100ms; 3 frames held, 100.002 ms in all)"),
            "{why}"
        );
    }

    /// Quantiles by nearest rank over the seeds, counts over 10 and 100 ms.
    #[test]
    fn the_slowest_operation_summary_reads_quantiles_and_counts() {
        let mut each: Vec<f64> = (1..=101).rev().map(|v| v as f64 * 1000.0).collect();
        let s = super::slowest_summary(&mut each);
        assert_eq!(
            s,
            "slowest operation per seed (us): p50 51000.0, p90 91000.0, p99 100000.0, max 101000.0; 91 seeds over 10 ms, 1 over 100 ms"
        );
        assert_eq!(super::slowest_summary(&mut []), "no runs");
    }
}
