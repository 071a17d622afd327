//! Deterministic simulation testing (`dmkv dst`): every engine's workload,
//! oracle checks and read-back verification run on the simulated cluster
//! across many seeds, with seeded message jitter so that each seed explores
//! different interleavings (races, torn reads, lock conflicts), plus a race
//! of concurrent inserts of the same fresh keys. A failing
//! seed is printed with the `dmkv bench` command that replays exactly it.
//!
//! The test target runs a few hundred seeds per engine; `scripts/dst-sweep.sh`
//! runs many more.

use dmkv_api::EngineSpec;
use dmkv_bench::workload::Mix;
use dmkv_bench::{BenchConfig, Dist, EngineChoice, SimDeployer, Workload, WorkloadSource};
use dmkv_transport::sim::{Profile, SimConfig};
use std::io::Write;
use std::sync::Arc;

/// The designs `dmkv dst` tests by default: the default comparison set,
/// every design that runs on the simulated cluster.
/// ScaleStore runs here on request (`--engine scalestore`, on
/// `DstParams::nodes` nodes) but is not in the default set yet: its seed 6
/// fails the insert race, and its seeds cost several seconds each (see
/// docs/simulation.md).
pub fn engines() -> Vec<&'static str> {
    crate::engines::REGISTRY.default_set.to_vec()
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

/// Runs `spec` once with `seed`; None if every check passed.
pub fn run_one(spec: &'static dyn EngineSpec, seed: u64, p: &DstParams) -> Option<DstFailure> {
    let profile = match Profile::load(&p.profile) {
        Ok(pr) => pr,
        Err(e) => {
            return Some(DstFailure {
                engine: spec.name().into(),
                seed,
                why: e,
                replay: String::new(),
            });
        }
    };
    let m = mix(spec);
    let mut cfg = BenchConfig::new(vec![EngineChoice {
        spec,
        knobs: Default::default(),
    }]);
    cfg.workload = WorkloadSource::Synthetic(Workload::Mixed(m));
    cfg.dist = Some(Dist::Zipfian);
    cfg.keys = p.keys;
    cfg.ops = p.ops;
    cfg.threads = p.threads;
    cfg.tasks = p.tasks;
    cfg.compute_nodes = p.compute_nodes;
    cfg.nodes = p.nodes;
    cfg.verify = true;
    cfg.seed = seed;
    cfg.load_chunk = 64;
    cfg.deployer = Arc::new(SimDeployer {
        options: dmkv_api::sim_deploy::SimOptions {
            config: SimConfig {
                profile,
                seed,
                jitter_ns: p.jitter_ns,
            },
            compute_nodes: p.compute_nodes,
            threads_per_node: p.threads,
        },
    });
    let replay = format!(
        "dmkv bench --transport sim --profile {} --engine {} --workload mixed:{},{},{},{},{},{} --dist zipfian --keys {} --ops {} --compute-nodes {} --nodes {} --threads {} --tasks {} --jitter-ns {} --seed {seed} --verify",
        p.profile,
        spec.name(),
        m.read,
        m.update,
        m.insert,
        m.delete,
        m.scan,
        m.rmw,
        p.keys,
        p.ops,
        p.compute_nodes,
        p.nodes,
        p.threads,
        p.tasks,
        p.jitter_ns
    );
    let fail = |why: String| {
        Some(DstFailure {
            engine: spec.name().into(),
            seed,
            why,
            replay: replay.clone(),
        })
    };
    let outcome = match dmkv_bench::run(&cfg) {
        Ok(o) => o,
        Err(e) => return fail(e.to_string()),
    };
    if let Some(f) = outcome.failures.first() {
        return fail(f.error.clone());
    }
    let r = outcome.reports.first()?;
    if r.ok {
        return None;
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
    fail(format!(
        "{} errors, {} failed checks, {} verification failures; first: {sample}",
        r.errors.count,
        r.checks.failures,
        r.verify.failures()
    ))
}

/// Runs every engine on every seed of `seeds`; reports failures as they come.
pub fn sweep(
    engines: &[&'static dyn EngineSpec],
    seeds: std::ops::Range<u64>,
    p: &DstParams,
    out: &mut dyn Write,
) -> Vec<DstFailure> {
    let mut failures = Vec::new();
    for &spec in engines {
        let mut failed = 0;
        for seed in seeds.clone() {
            if let Some(f) = run_one(spec, seed, p).or_else(|| insert_race(spec, seed, p)) {
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
    }
    failures
}

/// Tasks that race to insert each fresh key in [`insert_race`].
const RACERS: usize = 8;
/// Fresh keys raced for per seed.
const RACED_KEYS: usize = 24;

/// Concurrent inserts of the same new key from tasks on several compute
/// nodes: exactly one succeeds, the others see "exists", and the key then
/// holds the winner's value (hash engines on disaggregated memory have got
/// this wrong; RACE once let two claims win). None if it holds for `seed`.
pub fn insert_race(spec: &'static dyn EngineSpec, seed: u64, p: &DstParams) -> Option<DstFailure> {
    use dmkv_api::payload::make_value;
    use dmkv_testkit::insert_race::{check_round, fresh_keys, insert_each};
    use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
    use rand::SeedableRng;
    let fail = |why: String| {
        Some(DstFailure {
            engine: spec.name().into(),
            seed,
            why: format!("insert race: {why}"),
            replay: format!(
                "dmkv dst --engine {} --first-seed {seed} --seeds 1 --nodes {} --jitter-ns {} --profile {}",
                spec.name(),
                p.nodes,
                p.jitter_ns,
                p.profile
            ),
        })
    };
    let profile = match Profile::load(&p.profile) {
        Ok(pr) => pr,
        Err(e) => return fail(e),
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
        ..Default::default()
    };
    let sim_opts = dmkv_api::sim_deploy::SimOptions {
        config: SimConfig {
            profile,
            seed,
            jitter_ns: p.jitter_ns,
        },
        compute_nodes: 2,
        threads_per_node: RACERS / 4,
    };
    let dep = match dmkv_api::sim_deploy::SimDeployment::deploy(spec, &opts, &sim_opts) {
        Ok(d) => d,
        Err(e) => return fail(format!("deploy: {e}")),
    };
    let mut pairs: Vec<(u64, Vec<u8>)> =
        base.iter().map(|&k| (k, make_value(k, 1, size))).collect();
    pairs.sort_by_key(|p| p.0);
    let ep = dep.endpoint(0);
    if let Err(e) = block_on(dep.engine.load(&ep, &pairs)) {
        return fail(format!("load: {e}"));
    }
    let mut clients = Vec::new();
    for t in 0..RACERS / 2 {
        match dep.client(t) {
            Ok(c) => clients.push(c),
            Err(e) => return fail(format!("client: {e}")),
        }
    }
    // Two tasks per client thread, all inserting the same keys in the same
    // order; the check is the testkit's (which races real threads on the
    // local backend in every engine's tests).
    let tasks: Vec<LocalTask<'_, Vec<Result<bool, String>>>> = (0..RACERS)
        .map(|i| {
            let kv = clients[i / 2].1.clone();
            let raced = &raced;
            Box::pin(async move { insert_each(&*kv, raced, i, size).await }) as LocalTask<'_, _>
        })
        .collect();
    let results = run_tasks(tasks);
    if let Err(e) = block_on(check_round(&raced, &results, size, &*clients[0].1)) {
        return fail(e);
    }
    None
}
