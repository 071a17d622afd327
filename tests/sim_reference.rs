//! The simulated cluster's reports, pinned to committed snapshots.
//!
//! Issue 15 asks that the same seed and flags give byte-identical reports
//! "run after run and machine after machine", and issue 13 that a change
//! meant to leave the numbers alone leaves every counter and simulated
//! figure unchanged. Each case below runs `dmkv bench --transport sim ...
//! --json` as a user would, drops the fields that are not simulated (wall
//! time, the command line, the build's identity: `NOT_SIMULATED`), and
//! compares the rest with its snapshot in tests/snapshots/. The snapshots
//! were recorded on one machine and CI checks them on whichever machine it
//! gets, so a report that depends on the host shows up as a failure here.
//!
//! Each case also runs a second time with glibc's AVX2/FMA code paths
//! turned off (`GLIBC_TUNABLES`), as on a CPU without them, and must give
//! the same report: libm's `pow`, `exp`, `log` and `cos` (zipfian draws,
//! lognormal key sets) have per-CPU variants in glibc, and this is where a
//! result that depended on them would show.
//!
//! A change that is meant to move simulated figures updates the snapshots
//! with `INSTA_UPDATE=always cargo test --release --test sim_reference`;
//! `git diff tests/snapshots` then lists every field that moved, which the
//! commit should explain (docs/simulation.md, "Reference reports").

use std::path::PathBuf;
use std::process::Command;

/// Report fields that are not simulated: removed before the comparison.
/// `run.command` holds the `--json` path and the binary's path,
/// `run.git_commit` and `run.dmkv_version` the build, `sim.wall` wall-clock
/// time and speed.
const NOT_SIMULATED: [(&str, &str); 4] = [
    ("run", "command"),
    ("run", "git_commit"),
    ("run", "dmkv_version"),
    ("sim", "wall"),
];

/// glibc's tunable that hides AVX, AVX2, FMA and AVX-512 from its
/// IFUNC resolvers, so libm and the string functions take their baseline
/// x86-64 paths. Ignored where glibc is not the C library.
const BASELINE_CPU: &str =
    "glibc.cpu.hwcaps=-AVX,-AVX2,-FMA,-FMA4,-AVX512F,-AVX512VL,-AVX512DQ,-AVX512BW";

/// Options every case shares.
const COMMON: &[&str] = &["--transport", "sim", "--seed", "7", "--verify"];

/// Runs one case (twice: as is, and on glibc's baseline paths) and returns
/// its report without the `NOT_SIMULATED` fields.
fn report(case: &str, args: &[&str]) -> serde_json::Value {
    let as_is = run(case, args, None);
    let baseline = run(case, args, Some(BASELINE_CPU));
    assert!(
        as_is == baseline,
        "{case}: the report differs when glibc's AVX2/FMA paths are off \
         (GLIBC_TUNABLES={BASELINE_CPU}): the simulation depends on the CPU"
    );
    as_is
}

fn run(case: &str, args: &[&str], tunables: Option<&str>) -> serde_json::Value {
    let json: PathBuf = std::env::temp_dir().join(format!(
        "dmkv-sim-reference-{case}-{}-{}.json",
        std::process::id(),
        tunables.is_some()
    ));
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_dmkv"));
    cmd.arg("bench")
        .args(COMMON)
        .args(args)
        .arg("--json")
        .arg(&json);
    if let Some(t) = tunables {
        cmd.env("GLIBC_TUNABLES", t);
    }
    let out = cmd.output().expect("dmkv runs");
    assert!(
        out.status.success(),
        "{case}: dmkv bench {args:?} failed:\n{}\n{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let text = std::fs::read_to_string(&json).expect("the report was written");
    let _ = std::fs::remove_file(&json);
    let mut v: serde_json::Value = serde_json::from_str(&text).expect("the report is JSON");
    // One engine gives one report, several an array of them.
    match &mut v {
        serde_json::Value::Array(reports) => reports.iter_mut().for_each(strip),
        one => strip(one),
    }
    v
}

fn strip(report: &mut serde_json::Value) {
    for (outer, inner) in NOT_SIMULATED {
        let removed = report
            .get_mut(outer)
            .and_then(|o| o.as_object_mut())
            .and_then(|o| o.remove(inner));
        assert!(removed.is_some(), "the report has no {outer}.{inner}");
    }
    assert_eq!(report["ok"], true, "the run failed its checks: {report}");
}

/// One test per case, so that every case that differs is reported.
macro_rules! cases {
    ($($name:ident: [$($arg:expr),* $(,)?];)*) => {$(
        #[test]
        fn $name() {
            let v = report(stringify!($name), &[$($arg),*]);
            insta::assert_json_snapshot!(stringify!($name), v);
        }
    )*};
}

// Every design of the default comparison set on YCSB A with zipfian draws
// over a lognormal key set, two compute nodes, two memory nodes and
// seeded message jitter; then ScaleStore and its single-node baseline,
// inserts, scans, a memory-node crash, and Outback's resizing.
const MIXED: &[&str] = &[
    "--workload",
    "ycsb-a",
    "--dist",
    "zipfian",
    "--keyset",
    "lognormal",
    "--keys",
    "5000",
    "--ops",
    "10000",
    "--compute-nodes",
    "2",
    "--memnodes",
    "2",
    "--threads",
    "2",
    "--tasks",
    "4",
    "--jitter-ns",
    "300",
];

/// One test per design of the default set on `MIXED`.
macro_rules! mixed {
    ($($name:ident: $engine:expr;)*) => {$(
        #[test]
        fn $name() {
            let mut args = vec!["--engine", $engine];
            args.extend_from_slice(MIXED);
            let v = report(stringify!($name), &args);
            insta::assert_json_snapshot!(stringify!($name), v);
        }
    )*};
}

mixed! {
    mixed_xstore: "xstore";
    mixed_rpc_btree: "rpc-btree";
    mixed_cell: "cell";
    mixed_sherman: "sherman";
    mixed_race: "race";
    mixed_rpc_hash: "rpc-hash";
    mixed_outback: "outback";
    mixed_rolex: "rolex";
}

cases! {
    scalestore_partitioned: [
        "--engine", "scalestore", "--workload", "ycsb-a", "--dist", "zipfian",
        "--partitioned", "--keys", "5000", "--ops", "10000", "--nodes", "3",
        "--threads", "3", "--tasks", "1",
    ];
    btree_local: [
        "--engine", "btree-local", "--workload", "ycsb-a", "--keys", "5000",
        "--ops", "10000", "--threads", "2", "--tasks", "2",
    ];
    inserts: [
        "--engine", "rolex,xstore,sherman,race", "--workload", "insert",
        "--keys", "5000", "--ops", "10000", "--threads", "2", "--tasks", "4",
    ];
    scans: [
        "--engine", "rolex,xstore,sherman,cell,rpc-btree", "--workload", "ycsb-e",
        "--keys", "5000", "--ops", "2000", "--threads", "2", "--tasks", "4",
    ];
    outback_memnode_crash: [
        "--engine", "outback", "--workload", "ycsb-a", "--keys", "5000",
        "--ops", "10000", "--memnodes", "3", "--crash-memnode", "1@0.5",
        "--threads", "2", "--tasks", "4",
    ];
    outback_resizing: [
        "--engine", "outback", "--workload", "ycsb-d", "--keys", "5000",
        "--ops", "10000", "--threads", "2", "--tasks", "4",
        "--set", "outback.load_factor=0.95",
    ];
}
