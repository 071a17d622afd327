//! `--value-gen random-string` (ScaleStore's driver's values): the values
//! check and verify on `local` and `sim`, `sim` charges every update's and
//! insert's generation to the worker's core (and nothing for reads), and a
//! profile without an instruction term refuses it.

#[allow(dead_code)] // this test uses only part of the shared support
mod support;

use dmkv_bench::report::EngineReport;
use dmkv_bench::valuegen::{ValueGen, string_instructions};
use dmkv_bench::{BenchConfig, Workload};
use dmkv_transport::sim::Profile;
use support::{KEYS, on_sim, reference, small};

const SIZE: usize = 128;

fn config(workload: Workload, value_gen: ValueGen, sim: bool) -> BenchConfig {
    let mut cfg = small(vec![reference()], workload);
    cfg.value_size = SIZE;
    cfg.value_gen = value_gen;
    if sim {
        on_sim(&mut cfg, Profile::default_profile());
    }
    cfg
}

fn run_one(cfg: &BenchConfig) -> EngineReport {
    let outcome = dmkv_bench::run(cfg).expect("the run starts");
    assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
    outcome.reports.into_iter().next().unwrap()
}

/// Updates, inserts and read-modify-writes store random strings that every
/// read's check and `--verify` accept as the version the run wrote last.
#[test]
fn random_strings_check_and_verify_on_local_and_sim() {
    for sim in [false, true] {
        for w in [Workload::YcsbA, Workload::YcsbD, Workload::YcsbF] {
            let r = run_one(&config(w, ValueGen::RandomString, sim));
            assert!(r.ok, "sim {sim}, {w}: {:?} {:?}", r.checks, r.verify);
            assert_eq!(r.checks.failures, 0, "sim {sim}, {w}: {:?}", r.checks);
            assert_eq!(r.verify.mismatches, 0, "sim {sim}, {w}: {:?}", r.verify);
            assert!(r.verify.checked >= KEYS, "sim {sim}, {w}: {:?}", r.verify);
            assert_eq!(r.value_gen.as_deref(), Some("random-string"));
        }
    }
}

/// The client cores' busy time, ns, summed over the run's compute threads.
fn client_busy_ns(r: &EngineReport) -> f64 {
    let sim = r.sim.as_ref().expect("a simulated run");
    let run_ns = r.run_seconds * 1e9;
    sim.utilisation
        .iter()
        .filter(|u| u.name.contains("client core"))
        .map(|u| u.busy_percent / 100.0 * run_ns)
        .sum()
}

/// Under `sim`, each update costs its core `string_instructions(128)` at
/// the profile's instruction term more than with derived values; reads
/// cost the same.
#[test]
fn sim_charges_each_write_its_generation_and_reads_nothing() {
    let profile = Profile::default_profile();
    let rate = profile.memnode.instructions_per_us();
    assert!(rate > 0, "the default profile has an instruction term");
    let per_value = string_instructions(SIZE) * 1000 / rate;
    assert!(per_value > 0);
    let a = run_one(&config(Workload::YcsbA, ValueGen::Derived, true));
    let b = run_one(&config(Workload::YcsbA, ValueGen::RandomString, true));
    let writes = b.by_op["update"].count;
    assert!(writes > 0);
    let grown = client_busy_ns(&b) - client_busy_ns(&a);
    let expected = (writes * per_value) as f64;
    assert!(
        (grown - expected).abs() < 1.0,
        "busy grew {grown} ns, expected {writes} x {per_value} = {expected}"
    );
    assert!(b.run_seconds > a.run_seconds);
    // Read-only: nothing generated, nothing charged, the same run.
    let c = run_one(&config(Workload::YcsbC, ValueGen::Derived, true));
    let d = run_one(&config(Workload::YcsbC, ValueGen::RandomString, true));
    assert_eq!(c.run_seconds, d.run_seconds);
    assert_eq!(client_busy_ns(&c), client_busy_ns(&d));
}

/// A profile without an instruction term cannot charge the generation:
/// the run is refused with the reason, not run as if it were free.
#[test]
fn a_profile_without_an_instruction_term_refuses_random_strings() {
    let mut profile = Profile::default_profile();
    profile.memnode.cpu_ghz = 0.0;
    profile.memnode.ipc = 0.0;
    let mut cfg = config(Workload::YcsbA, ValueGen::RandomString, false);
    on_sim(&mut cfg, profile.clone());
    let outcome = dmkv_bench::run(&cfg).expect("the run starts");
    assert_eq!(outcome.failures.len(), 1, "{:?}", outcome.reports.len());
    let e = &outcome.failures[0].error;
    assert!(
        e.contains("--value-gen random-string") && e.contains("instruction term"),
        "{e}"
    );
    // Derived values need no instruction term.
    let mut cfg = config(Workload::YcsbA, ValueGen::Derived, false);
    on_sim(&mut cfg, profile);
    assert!(run_one(&cfg).ok);
}
