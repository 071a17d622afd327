//! `--crash-memnode`: the runner crashes the memory node it is told to at
//! the operation it is told to, on the local and the simulated transport,
//! and reports what the clients saw. The reference engine lives on memory
//! node 0 only (it has no failover), so crashing node 1 costs nothing and
//! crashing node 0 makes every later operation fail: both are checked.

#[allow(dead_code)] // this test uses only part of the shared support
mod support;

use dmkv_bench::report::EngineReport;
use dmkv_bench::{BenchConfig, CrashPlan, Workload};
use dmkv_transport::sim::Profile;
use support::{OPS, on_sim, reference, small};

fn run_one(cfg: &BenchConfig) -> EngineReport {
    let outcome = dmkv_bench::run(cfg).expect("the run starts");
    assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
    outcome.reports.into_iter().next().unwrap()
}

fn crashing(node: usize, sim: bool) -> BenchConfig {
    let mut cfg = small(vec![reference()], Workload::YcsbA);
    cfg.memnodes = 2;
    cfg.crash = Some(CrashPlan {
        node,
        at_fraction: 0.5,
    });
    if sim {
        on_sim(&mut cfg, Profile::default_profile());
    }
    cfg
}

fn check(sim: bool) {
    // Node 1 holds nothing of the reference engine: the crash happens at
    // the middle operation and nobody notices.
    let r = run_one(&crashing(1, sim));
    let c = r.crash.as_ref().expect("a crash report");
    assert!(c.crashed && c.failure.is_none(), "{c:?}");
    assert_eq!(c.at_op, OPS / 2);
    assert_eq!(c.errors_after_crash, 0);
    // The operations in flight at the crash complete after it too.
    assert!(c.ops_after_crash >= OPS / 2 - 1, "{c:?}");
    assert!(r.ok, "{:?} {:?}", r.errors, r.verify);

    // Node 0 is the reference engine's only node: every operation that
    // completes after the crash fails, and so does verification.
    let r = run_one(&crashing(0, sim));
    let c = r.crash.as_ref().expect("a crash report");
    assert!(c.crashed, "{c:?}");
    assert!(c.errors_after_crash > 0, "{c:?}");
    assert_eq!(c.errors_after_crash, r.errors.count, "{c:?}");
    assert!(r.verify.errors > 0);
    assert!(!r.ok);
}

#[test]
fn a_crash_is_made_and_reported_on_the_local_transport() {
    check(false);
}

#[test]
fn a_crash_is_made_and_reported_in_the_simulation() {
    check(true);
}

#[test]
fn bad_crash_plans_are_refused() {
    for bad in ["1", "a@0.5", "1@0", "1@1", "1@-0.2", "1@x"] {
        assert!(bad.parse::<CrashPlan>().is_err(), "{bad}");
    }
    assert_eq!(
        "2@0.25".parse::<CrashPlan>(),
        Ok(CrashPlan {
            node: 2,
            at_fraction: 0.25
        })
    );
    let mut cfg = crashing(1, false);
    cfg.memnodes = 1;
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("--memnodes 2"), "{e}");
    let mut cfg = crashing(2, false);
    cfg.memnodes = 2;
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("memory nodes 0..1"), "{e}");
    let mut cfg = crashing(1, false);
    cfg.workload = dmkv_bench::WorkloadSource::Synthetic(Workload::Load);
    assert!(cfg.validate().is_err());
}
