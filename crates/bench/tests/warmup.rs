//! `--warmup-ops`: the warm-up runs before the measured run, on the same
//! streams and clients, and is left out of every figure of the run (counts,
//! costs, memory-node figures, virtual time); its wrong answers still fail
//! the run; under `sim` it is deterministic and the run's clock starts when
//! it ends; a trace's warm-up is the front of its operations.

#[allow(dead_code)] // this test uses only part of the shared support
mod support;

use dmkv_bench::report::EngineReport;
use dmkv_bench::{BenchConfig, Workload, WorkloadSource};
use dmkv_transport::sim::Profile;
use support::{Fault, Faulty, KEYS, OPS, choice, on_sim, reference, small};

fn run_one(cfg: &BenchConfig) -> EngineReport {
    let outcome = dmkv_bench::run(cfg).expect("the run starts");
    assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
    outcome.reports.into_iter().next().unwrap()
}

/// The reference engine makes one RPC per operation, so every figure of the
/// run can be checked against its operation count: a warm-up operation
/// counted anywhere would show.
fn assert_run_figures_are_the_runs(r: &EngineReport, ops: u64) {
    assert_eq!(r.ops, ops);
    assert_eq!(r.by_op.values().map(|o| o.count).sum::<u64>(), ops);
    let rpcs: u64 = r.counters_by_kind.values().map(|t| t.rpcs).sum();
    assert_eq!(rpcs, ops, "{:?}", r.counters_by_kind);
    assert_eq!(r.per_op.rpcs, 1.0);
    // The memory node's figures are taken when the run starts.
    assert_eq!(r.memnode.rpcs_served, ops, "{:?}", r.memnode);
}

#[test]
fn a_warmup_is_left_out_of_the_run_and_verifies() {
    for sim in [false, true] {
        let mut cfg = small(vec![reference()], Workload::YcsbD);
        cfg.warmup_ops = 3_000;
        if sim {
            on_sim(&mut cfg, Profile::default_profile());
        }
        let r = run_one(&cfg);
        assert!(
            r.ok,
            "sim {sim}: {:?} {:?} {:?}",
            r.errors, r.checks, r.verify
        );
        assert_run_figures_are_the_runs(&r, OPS);
        let w = r.warmup.as_ref().expect("a warm-up report");
        assert_eq!(w.ops, 3_000, "sim {sim}");
        assert_eq!(w.per_op.rpcs, 1.0, "sim {sim}");
        assert!(w.seconds > 0.0, "sim {sim}");
        // Both phases insert (ycsb-d: 5%), each its own keys: the verified
        // keys are the loaded ones and all of both phases' inserts.
        let inserts = r.by_op["insert"].count;
        assert!(inserts > 0);
        assert!(
            r.verify.checked > KEYS + inserts,
            "sim {sim}: {} verified, {KEYS} loaded + {inserts} inserted in the run",
            r.verify.checked
        );
        // Without a warm-up there is no report of one.
        cfg.warmup_ops = 0;
        assert!(run_one(&cfg).warmup.is_none());
    }
}

/// Every 600th GET of each client is corrupted; the two clients make 1,000
/// warm-up GETs and then 100 measured ones each, so both wrong answers fall
/// in the warm-up, and they still fail the run.
#[test]
fn wrong_answers_in_the_warm_up_fail_the_run() {
    let spec = Faulty::leak("corrupt-600", Fault::CorruptEveryNthGet(600));
    let mut cfg = small(vec![choice(spec)], Workload::YcsbC);
    cfg.tasks = 1;
    cfg.ops = 200;
    cfg.warmup_ops = 2_000;
    let r = run_one(&cfg);
    assert_eq!(r.checks.failures, 2, "{:?}", r.checks);
    assert!(!r.ok);
    assert_eq!(r.ops, 200);
}

/// Under sim the warm-up is part of the deterministic run, and the measured
/// run's virtual time starts when it ends: with an engine whose every
/// operation costs the same, the run takes the time it takes without one.
#[test]
fn a_simulated_warm_up_is_deterministic_and_outside_the_runs_time() {
    let mut cfg = small(vec![reference()], Workload::YcsbC);
    on_sim(&mut cfg, Profile::default_profile());
    let plain = run_one(&cfg);
    cfg.warmup_ops = 20_000;
    let warm = run_one(&cfg);
    let again = run_one(&cfg);
    let strip = |r: &EngineReport| {
        let mut r = r.clone();
        let wall = &mut r.sim.as_mut().unwrap().wall;
        (wall.run_seconds, wall.sim_ops_per_s) = (0.0, 0.0);
        r.load.keys_per_s = 0.0;
        r
    };
    assert_eq!(strip(&warm), strip(&again));
    let w = warm.warmup.as_ref().unwrap();
    // 20,000 warm-up operations took ten times the 2,000 measured ones.
    let ratio = w.seconds / warm.run_seconds;
    assert!((9.5..10.5).contains(&ratio), "{ratio}");
    let (a, b) = (plain.run_seconds, warm.run_seconds);
    assert!(
        (a - b).abs() < 0.02 * a,
        "{a} s without a warm-up, {b} s after one"
    );
}

fn trace_config(warmup_ops: u64) -> BenchConfig {
    let mut cfg = BenchConfig::new(vec![reference()]);
    cfg.workload = WorkloadSource::Trace(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/data/ycsb-run.log"),
    );
    cfg.threads = 2;
    cfg.tasks = 2;
    cfg.verify = true;
    cfg.warmup_ops = warmup_ops;
    cfg
}

/// A trace's warm-up is its first operations (each task's share of them);
/// the run replays the rest, and the trace's keys all verify.
#[test]
fn a_traces_warm_up_is_its_front() {
    let r = run_one(&trace_config(7));
    assert!(r.ok, "{:?} {:?} {:?}", r.errors, r.checks, r.verify);
    assert_eq!(r.trace.as_ref().unwrap().operations, 18);
    assert_run_figures_are_the_runs(&r, 11);
    assert_eq!(r.warmup.as_ref().unwrap().ops, 7);
    assert_eq!(r.verify.checked, 8);
    let e = dmkv_bench::run(&trace_config(18)).unwrap_err().to_string();
    assert!(e.contains("must leave some to measure"), "{e}");
}
