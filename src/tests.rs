//! The command line, run in-process: names, exit codes, one-line errors.

use crate::cli::{EXIT_FAILED, EXIT_OK, EXIT_USAGE, Io, run};
use crate::engines::REGISTRY;
use std::ffi::OsString;

pub(crate) struct Outcome {
    pub(crate) code: i32,
    pub(crate) out: String,
    pub(crate) err: String,
}

/// Runs the command line in-process (also used by `repro::tests`).
pub(crate) fn dmkv_with_stdin(args: &[&str], stdin: &str) -> Outcome {
    let mut input = stdin.as_bytes();
    let mut out = Vec::new();
    let mut err = Vec::new();
    let argv: Vec<OsString> = std::iter::once("dmkv")
        .chain(args.iter().copied())
        .map(OsString::from)
        .collect();
    let code = run(
        &REGISTRY,
        argv,
        &mut Io {
            stdin: &mut input,
            stdin_is_terminal: false,
            out: &mut out,
            err: &mut err,
            progress: false,
        },
    );
    Outcome {
        code,
        out: String::from_utf8(out).unwrap(),
        err: String::from_utf8(err).unwrap(),
    }
}

fn dmkv(args: &[&str]) -> Outcome {
    dmkv_with_stdin(args, "")
}

/// Bad input: exit code 2 and exactly one line on stderr containing `needle`.
fn assert_usage_error(args: &[&str], needle: &str) {
    let o = dmkv(args);
    assert_eq!(o.code, EXIT_USAGE, "{args:?}: {}", o.err);
    assert_eq!(
        o.err.lines().count(),
        1,
        "{args:?}: one line, got {:?}",
        o.err
    );
    assert!(o.err.starts_with("error"), "{args:?}: {:?}", o.err);
    assert!(
        o.err.contains(needle),
        "{args:?}: {:?} lacks {needle:?}",
        o.err
    );
    assert!(o.out.is_empty(), "{args:?}: nothing on stdout: {:?}", o.out);
}

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    assert_usage_error(&["bench", "--engine", "nope"], "unknown engine \"nope\"");
    assert_usage_error(
        &["bench", "--load-chunk", "0"],
        "--load-chunk must be at least 1",
    );
    assert_usage_error(&["dst", "--variants", "maybe"], "--variants");
    assert_usage_error(&["dst", "--hold-limit-ms", "0"], "--hold-limit-ms");
    assert_usage_error(&["dst", "--op-limit-ms", "0"], "--op-limit-ms");
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--set",
            "reference.bogus=1",
        ],
        "unknown setting reference.bogus",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--set", "nodot=1"],
        "ENGINE.KNOB=VALUE",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--set", "xyz.a=1"],
        "unknown engine",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--value-size", "7"],
        "at least 8 bytes",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--workload",
            "mixed:50,50",
        ],
        "five percentages",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--workload",
            "mixed:50,50,10,0,0",
        ],
        "sum to 110",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--workload", "ycsb-z"],
        "unknown workload",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--dist", "pareto"],
        "unknown distribution",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--keyset",
            "sosd:/nonexistent/keys",
        ],
        "cannot read /nonexistent/keys",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--trace",
            "/nonexistent/trace",
        ],
        "cannot read /nonexistent/trace",
    );
    // A file that is not a YCSB trace, and --trace-load without --trace.
    let not_a_trace = std::env::temp_dir().join(format!("dmkv-not-a-trace-{}", std::process::id()));
    std::fs::write(&not_a_trace, "root:x:0:0:root:/root:/bin/bash\n").unwrap();
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--trace",
            not_a_trace.to_str().unwrap(),
        ],
        "no YCSB operation",
    );
    let _ = std::fs::remove_file(&not_a_trace);
    assert_usage_error(
        &["bench", "--engine", "reference", "--trace-load", "load.log"],
        "--trace-load needs --trace",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--threads", "0"],
        "--threads",
    );
    assert_usage_error(&["bench", "--engine", "reference", "--bogus"], "--bogus");
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--trace",
            "t",
            "--workload",
            "ycsb-a",
        ],
        "cannot be used with",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--json",
            "/nonexistent/dir/out.json",
        ],
        "cannot write",
    );
}

#[cfg(not(feature = "ucx"))]
#[test]
fn ucx_is_refused_clearly() {
    assert_usage_error(
        &["bench", "--engine", "reference", "--transport", "ucx"],
        "built without the `ucx` feature",
    );
    assert_usage_error(
        &["memnode", "--listen", "127.0.0.1:7000"],
        "built without the `ucx` feature",
    );
}

#[test]
fn node_commands_and_flags_are_checked() {
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "scalestore",
            "--node-addr",
            "127.0.0.1:1",
        ],
        "need --transport ucx",
    );
    #[cfg(not(feature = "ucx"))]
    for args in [
        &["node", "--listen", "127.0.0.1:7000"][..],
        &["node-ctl", "--addr", "127.0.0.1:7000", "leave"][..],
    ] {
        assert_usage_error(args, "built without the `ucx` feature");
    }
    #[cfg(feature = "ucx")]
    {
        assert_usage_error(
            &[
                "node",
                "--listen",
                "127.0.0.1:0",
                "--secret-file",
                "/nonexistent/s",
            ],
            "secret",
        );
    }
    assert_usage_error(
        &[
            "bench",
            "--transport",
            "ucx",
            "--node-addr",
            "127.0.0.1:1",
            "--memnode-addr",
            "127.0.0.1:2",
        ],
        "cannot be used with",
    );
}

#[test]
fn help_goes_to_stdout() {
    let o = dmkv(&["bench", "--help"]);
    assert_eq!(o.code, EXIT_OK);
    for flag in [
        "--engine",
        "--workload",
        "--dist",
        "--keyset",
        "--trace",
        "--keys",
        "--ops",
        "--value-size",
        "--threads",
        "--tasks",
        "--memnode-threads",
        "--memnodes",
        "--nodes",
        "--cache-mb",
        "--data-dir",
        "--transport",
        "--verify",
        "--json",
        "--seed",
        "--set",
    ] {
        assert!(o.out.contains(flag), "bench --help lacks {flag}");
    }
}

#[test]
fn bench_runs_the_reference_engine_and_writes_json() {
    let dir = std::env::temp_dir().join(format!("dmkv-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let o = dmkv(&[
        "bench",
        "--engine",
        "reference",
        "--workload",
        "ycsb-a",
        "--keys",
        "500",
        "--ops",
        "2000",
        "--threads",
        "2",
        "--tasks",
        "2",
        "--verify",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.code, EXIT_OK, "{}\n{}", o.out, o.err);
    assert!(
        o.out.contains("throughput (ops/s)") && o.out.contains("ok (500 keys)"),
        "{}",
        o.out
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["engine"], "reference");
    assert_eq!(v["workload"], "ycsb-a");
    assert_eq!(v["ops"], 2000);
    assert_eq!(v["verify"]["checked"], 500);
    assert_eq!(v["verify"]["mismatches"], 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn symmetric_nodes_get_one_thread_each_by_default() {
    let dir = std::env::temp_dir().join(format!("dmkv-cli-nodes-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let run = |extra: &[&str]| {
        let mut args = vec![
            "bench",
            "--engine",
            "scalestore",
            "--nodes",
            "3",
            "--workload",
            "ycsb-a",
            "--keys",
            "2000",
            "--ops",
            "3000",
            "--json",
            json.to_str().unwrap(),
        ];
        args.extend_from_slice(extra);
        let o = dmkv(&args);
        assert_eq!(o.code, EXIT_OK, "{}\n{}", o.out, o.err);
        let v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        (o.err, v)
    };
    // Without --threads: one compute thread per node, each issuing, so the
    // protocol's messages flow.
    let (err, v) = run(&[]);
    assert!(err.contains("one per node"), "{err}");
    assert_eq!(v["threads"], 3);
    let st = &v["engine_stats"];
    for n in st["per_node"].as_array().unwrap() {
        assert!(n["ops"].as_u64().unwrap() > 0, "node idle: {st}");
    }
    assert!(st["messages_total"].as_u64().unwrap() > 0, "{st}");
    // Fewer threads than nodes: said, and the run still goes.
    let (err, v) = run(&["--threads", "1"]);
    assert!(err.contains("nodes 1..2 issue no operations"), "{err}");
    assert_eq!(v["threads"], 1);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bench_with_torn_reads_verifies_the_tree_engines() {
    // Scans and updates race one-sided readers whose reads are torn: cell
    // must detect the tears (it reports retries) and nothing may be wrong.
    let dir = std::env::temp_dir().join(format!("dmkv-cli-torn-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let o = dmkv(&[
        "bench",
        "--engine",
        "rpc-btree,cell",
        "--workload",
        "mixed:50,30,10,5,5",
        "--keys",
        "2000",
        "--ops",
        "4000",
        "--threads",
        "2",
        "--tasks",
        "4",
        "--torn-reads",
        "--verify",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.code, EXIT_OK, "{}\n{}", o.out, o.err);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    for r in v.as_array().unwrap() {
        assert_eq!(r["verify"]["mismatches"], 0, "{r}");
        assert_eq!(r["verify"]["missing"], 0, "{r}");
    }
    assert_eq!(v[1]["engine"], "cell");
    assert!(
        v[1]["engine_stats"]["torn_retries"].as_u64().unwrap() > 0,
        "{}",
        v[1]
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn shell_reads_a_script_from_stdin() {
    let o = dmkv_with_stdin(
        &["shell", "--engine", "reference"],
        "put 10 ten\nget 10\nscan 0 5\ndelete 10\nget 10\nquit\n",
    );
    assert_eq!(o.code, EXIT_OK, "{}", o.err);
    assert_eq!(
        o.out,
        "inserted\nten\n10 ten\n(1 pairs)\ndeleted\n(not found)\n"
    );
    let o = dmkv_with_stdin(&["shell", "--engine", "reference"], "get nope\n");
    assert_eq!(o.code, EXIT_FAILED);
    assert!(o.out.starts_with("error:"), "{}", o.out);
    // Without --engine the shell deploys the first engine of the default set.
    let o = dmkv_with_stdin(&["shell"], "put 7 seven\nget 7\nquit\n");
    assert_eq!(o.code, EXIT_OK, "{}", o.err);
    assert_eq!(o.out, "inserted\nseven\n");
}

#[test]
fn a_trace_replays_through_the_cli() {
    // A trace that inserts a key twice: the second insert must say the key
    // exists, and the read must find the first value.
    let dir = std::env::temp_dir().join(format!("dmkv-cli-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.log");
    std::fs::write(
        &trace,
        "INSERT usertable user1 [ field0=a ]\nINSERT usertable user1 [ field0=b ]\nREAD usertable user1 [ <all fields>]\n[OVERALL], RunTime(ms), 10\n",
    )
    .unwrap();
    let o = dmkv(&[
        "bench",
        "--engine",
        "reference",
        "--trace",
        trace.to_str().unwrap(),
        "--verify",
    ]);
    assert_eq!(o.code, EXIT_OK, "{}\n{}", o.out, o.err);
    assert!(
        o.out.contains("3 operations, 1 other lines ignored"),
        "{}",
        o.out
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--trace",
            trace.to_str().unwrap(),
            "--keys",
            "5",
        ],
        "cannot be used with",
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The reference engine with a load that loses the first pair of every
/// chunk: a wrong engine the harness must catch.
mod lossy {
    use async_trait::async_trait;
    use dmkv_api::{
        Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvStore, Result, ServeArgs,
    };
    use dmkv_memnode::NodeRuntime;
    use dmkv_testkit::reference::Reference;
    use dmkv_transport::{Endpoint, NodeId};
    use std::rc::Rc;
    use std::sync::Arc;

    pub struct LossyLoad;

    impl EngineSpec for LossyLoad {
        fn capabilities(&self) -> Capabilities {
            Reference.capabilities()
        }
        fn name(&self) -> &'static str {
            "lossy-load"
        }
        fn about(&self) -> &'static str {
            "loses a pair per load chunk"
        }
        fn knobs(&self) -> &'static [KnobSpec] {
            &[]
        }
        fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
            Reference.serve(rt, args)
        }
        fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
            Ok(Arc::new(Lossy(Reference.connect(args)?)))
        }
    }

    struct Lossy(Arc<dyn Engine>);

    #[async_trait(?Send)]
    impl Engine for Lossy {
        fn name(&self) -> &'static str {
            "lossy-load"
        }
        fn capabilities(&self) -> Capabilities {
            self.0.capabilities()
        }
        fn home_node(&self, thread: usize) -> NodeId {
            self.0.home_node(thread)
        }
        async fn client(&self, ep: Rc<Endpoint>, thread: usize) -> Result<Rc<dyn KvStore>> {
            self.0.client(ep, thread).await
        }
        async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
            self.0.load(ep, &pairs[1..]).await
        }
        async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
            self.0.stats(ep).await
        }
        fn client_cache_bytes(&self) -> u64 {
            0
        }
    }
}

#[test]
fn a_wrong_engine_fails_the_run_with_exit_code_1() {
    let registry = crate::engines::Registry {
        engines: &[&dmkv_testkit::reference::Reference, &lossy::LossyLoad],
        default_set: &["reference", "lossy-load"],
    };
    let mut out = Vec::new();
    let mut err = Vec::new();
    let argv = ["dmkv", "bench", "--keys", "100", "--ops", "200", "--verify"]
        .map(OsString::from)
        .to_vec();
    let code = run(
        &registry,
        argv,
        &mut Io {
            stdin: &mut "".as_bytes(),
            stdin_is_terminal: false,
            out: &mut out,
            err: &mut err,
            progress: false,
        },
    );
    let (out, err) = (
        String::from_utf8(out).unwrap(),
        String::from_utf8(err).unwrap(),
    );
    assert_eq!(code, EXIT_FAILED, "{out}\n{err}");
    assert!(err.contains("FAILED: lossy-load"), "{err}");
    assert!(out.contains("relative to reference"), "{out}");
    assert!(out.contains("FAILED: 0 mismatched, 1 missing"), "{out}");
    assert!(out.contains("lossy-load: verify: key"), "{out}");
}

/// Deterministic simulation testing in CI: every engine that runs on the
/// simulated cluster (ScaleStore included), its oracle checks, read-back
/// verification, the same-key insert race and, on the seeds that choose
/// them, every fault kind (delayed messages, a killed compute node, a
/// crashed memory node, multi-line values), across many seeds with message
/// jitter. A failure prints the seed and the command that replays it.
/// `DMKV_DST_SEEDS` changes the count (scripts/dst-sweep.sh runs far more);
/// ScaleStore, whose seeds cost several times more, runs a third of it.
/// Failures DST found that are not fixed yet, each recorded in
/// docs/simulation.md: (engine, seed of `dst_every_engine_across_seeds`'s
/// parameters, text of the failure). The sweep leaves the seed out and
/// checks that it still fails that way.
const KNOWN_DST_FAILURES: &[(&str, u64, &str)] = &[
    // (XStore seed 201, a scan skipping a key, is fixed: see
    // crates/xstore/src/scan_chain.rs and docs/simulation.md.)
];

/// A seed gives the same outcome inside a sweep as alone. Outback's memory
/// node cached its own endpoint per thread under the address of its
/// context; in a sweep (one thread, one cluster after another) a new
/// context could reuse a freed one's address and issue through the
/// previous cluster's fabric, so seed 59 timed out after seeds 55..59 and
/// passed alone.
#[test]
fn an_outback_seed_is_the_same_after_earlier_seeds() {
    let spec = crate::engines::REGISTRY.find("outback").unwrap();
    let params = crate::dst::DstParams {
        faults: crate::dst::Faults::ALL,
        ..Default::default()
    };
    let mut log = Vec::new();
    let failures = crate::dst::sweep(&[spec], 55..60, &params, &mut log);
    assert!(failures.is_empty(), "{}", String::from_utf8_lossy(&log));
}

#[test]
fn dst_every_engine_across_seeds() {
    let seeds: u64 = std::env::var("DMKV_DST_SEEDS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(300);
    let mut log = Vec::new();
    let mut failures = Vec::new();
    for e in crate::dst::engines() {
        let spec = crate::engines::REGISTRY.find(e).unwrap();
        let params = crate::dst::DstParams {
            faults: crate::dst::Faults::ALL,
            ..Default::default()
        };
        let n = if e == "scalestore" {
            seeds.div_ceil(3)
        } else {
            seeds
        };
        // Every seed but the known failures, which must still fail as
        // recorded (so this test says when a fix lands).
        let known: Vec<&(&str, u64, &str)> = KNOWN_DST_FAILURES
            .iter()
            .filter(|k| k.0 == e && k.1 < n)
            .collect();
        let mut from = 0;
        for &&(_, seed, needle) in &known {
            failures.extend(crate::dst::sweep(&[spec], from..seed, &params, &mut log));
            let mut quiet = Vec::new();
            let f = crate::dst::sweep(&[spec], seed..seed + 1, &params, &mut quiet);
            assert!(
                f.len() == 1 && f[0].why.contains(needle),
                "{e} seed {seed} was recorded as failing with {needle:?}; now: {}",
                String::from_utf8_lossy(&quiet)
            );
            from = seed + 1;
        }
        let before = failures.len();
        failures.extend(crate::dst::sweep(&[spec], from..n, &params, &mut log));
        assert_eq!(
            failures.len(),
            before,
            "{e}: {}",
            String::from_utf8_lossy(&log)
        );
    }
    let log = String::from_utf8(log).unwrap();
    assert!(failures.is_empty(), "{log}");
    // The faults were injected: some seeds of every engine delayed
    // messages and killed a client mid-operation, and of every engine with
    // memory nodes crashed one (each happens on a third to a half of the
    // seeds; with a handful of seeds it may not).
    let lines: Vec<&str> = log.lines().collect();
    for (i, line) in lines.iter().enumerate().filter(|_| seeds >= 60) {
        if line.trim_start().starts_with("faults:") {
            assert!(!line.contains(" 0 runs with delayed messages"), "{line}");
            assert!(!line.contains("(0 mid-operation"), "{line}");
            // The engine's summary line, the nearest unindented one before,
            // names it; ScaleStore has no memory nodes to crash.
            let symmetric = lines[..i]
                .iter()
                .rev()
                .find(|l| !l.starts_with(' '))
                .is_some_and(|l| l.starts_with("scalestore:"));
            assert!(
                symmetric || !line.contains(" 0 memory-node crashes"),
                "{line}"
            );
        }
    }
}

/// The kill fault: a compute node dies mid-operation and the engine keeps
/// its promises (see `src/dst/kill.rs`); the victim's tasks really stop
/// (checked inside: no verb posted after the kill) and for some seed the
/// kill hits an operation in flight.
#[test]
fn dst_a_killed_compute_node_stops_and_survivors_stay_correct() {
    let params = crate::dst::DstParams::default();
    for e in ["rpc-hash", "race"] {
        let spec = crate::engines::REGISTRY.find(e).unwrap();
        let plan = crate::dst::FaultPlan::choose(spec, 0, crate::dst::Faults::default(), None);
        let mut mid_op = 0;
        for seed in 0..6 {
            match crate::dst::kill_client(spec, seed, &params, &plan) {
                Ok(k) => mid_op += k.killed_mid_op as u32,
                Err(f) => panic!("{e} seed {seed}: {}\n{}", f.why, f.replay),
            }
        }
        assert!(mid_op > 0, "{e}: no kill hit an operation in flight");
    }
}

/// ROLEX's retrainer and a compute node that died holding a leaf lock
/// (docs/rolex.md, invariant 12): with tables small enough that the kill
/// phase's inserts fill synonym tables and queue retrains, the retrainer
/// meets the dead node's lock, gives the model back after
/// `retrain_lock_wait_us` (counted in `retrain_lock_timeouts`) instead of
/// waiting forever, and every promise of the kill phase still holds: no
/// acknowledged write lost, every read intact (`kill_client`'s checks).
#[test]
fn dst_rolex_retrainer_gives_up_a_dead_clients_lock() {
    let spec = crate::engines::REGISTRY.find("rolex").unwrap();
    let mut params = crate::dst::DstParams::default();
    let mut k = dmkv_api::Knobs::new();
    for (name, v) in [
        ("leaf_slots", "4"),
        ("slt_slots", "4"),
        ("retrain_threshold", "2"),
        ("retrain_lock_wait_us", "100"),
        ("poll_us", "10"),
    ] {
        k.set(name, v);
    }
    params.knobs.insert("rolex".into(), k);
    let plan = crate::dst::FaultPlan::choose(spec, 0, crate::dst::Faults::default(), None);
    let (mut timeouts, mut retrains, mut blocked) = (0, 0, 0);
    for seed in 0..8 {
        match crate::dst::kill_client(spec, seed, &params, &plan) {
            Ok(k) => {
                let m = &k.stats["memnode"];
                timeouts += m["retrain_lock_timeouts"].as_u64().unwrap();
                retrains += m["retrains"].as_u64().unwrap();
                blocked += k.blocked;
            }
            Err(f) => panic!("seed {seed}: {}\n{}", f.why, f.replay),
        }
    }
    eprintln!("{timeouts} lock waits given up, {retrains} retrains, {blocked} blocked");
    assert!(blocked > 0, "no survivor met the dead node's lock");
    assert!(timeouts > 0, "the retrainer never met the dead node's lock");
    assert!(retrains > 0, "no retrain completed");
}

/// A ROLEX writer whose work after releasing its group's lock fails
/// (queueing the model for retraining on memory node 0, which crashed)
/// must not release the lock again: it was handed over to a local waiter
/// or taken by another compute node by then, and the second release let
/// two writers into the group at once, one overwriting the other's insert
/// (docs/rolex.md, invariant 15). Found by the `rolex.load_model_keys=64`
/// DST variant (seed 50116): models on both memory nodes, the appends'
/// last model on node 1, node 0 crashed. Before the fix this replay (seed
/// 2) verified with 7 keys missing; now only the crashed node's errors.
#[test]
fn rolex_writer_errors_after_its_release_do_not_release_again() {
    // DST seed 50116's replay at seed 2. (Until the thirty-fourth session
    // it loaded the keys in one call, `--load-chunk 256`; with one engine
    // per simulated compute node that run no longer met the bug, and this
    // one, with the DST's chunks of 64, fails without the fix: checked
    // with the fix reverted, 7 keys missing.)
    let replay = "bench --transport sim --profile rolex-cx5 --engine rolex \
        --keyset sequential --workload mixed:60,0,40,0,0,0 --dist latest \
        --keys 256 --ops 4000 --compute-nodes 2 --threads 4 --tasks 8 \
        --jitter-ns 400 --seed 2 --verify --value-size 280 --memnodes 2 \
        --set rolex.load_model_keys=64 --crash-memnode 0@0.75 --load-chunk 64";
    let out = dmkv(&replay.split_whitespace().collect::<Vec<_>>());
    let all = format!("{}{}", out.out, out.err);
    assert!(
        all.contains("0 mismatched, 0 missing, 0 unexpected,"),
        "{all}"
    );
    assert!(!all.contains("check: missing"), "{all}");
    // The crash happened and was met (errors), so the path was exercised.
    assert!(all.contains("errors") && all.contains("is down"), "{all}");
}

/// Survivors of the kill phase are abandoned only after the kill instant.
/// Before, a survivor's operation was abandoned 300 us after it began,
/// kill or not. A ROLEX writer that waits for retraining
/// (`rolex.slt_slots=8`) takes longer than that. Dropped mid-way, it left
/// its group's lock held by no one, and a later operation of the victim,
/// still alive, spun on that lock for good. The killer then polled for a
/// kill instant that never came: ROLEX's seed 3636 ran without end.
/// Survivors abandoned before the kill were confirmed there, at 0.55,
/// 0.89 and 0.92 ms with no kill chosen yet, and the victim's update
/// looping on the held lock.
/// - **Now.** An operation past the livelock limit before the kill fails
///   the seed, and the killer stops once every victim task has ended.
/// - **What the test checks.** Seed 3027 (`leaf_slots=4`, `slt_slots=8`)
///   has survivor operations longer than 300 us (4). They must complete,
///   not be abandoned. (Seed 3152 had them until each simulated compute
///   node got an engine of its own, thirty-fourth session; it has none
///   since. Seed 3027 was the first of 3000-3100 with `slt_slots` drawn,
///   a kill mid-operation, slow survivors and none blocked by the dead
///   node's lock.)
/// - **How it runs.** On a thread of its own, so that a hang fails the
///   test instead of hanging it.
#[test]
fn dst_survivors_are_abandoned_only_after_the_kill() {
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let spec = crate::engines::REGISTRY.find("rolex").unwrap();
        let params = crate::dst::DstParams {
            faults: crate::dst::Faults::ALL,
            ..Default::default()
        };
        let plan = params.plan(spec, 3027);
        let drawn: Vec<_> = plan.variant.iter().map(|v| v.0).collect();
        let outcome = crate::dst::kill_client(spec, 3027, &params, &plan)
            .map(|k| (k.killed_mid_op, k.slow, k.blocked))
            .map_err(|f| f.why);
        let _ = tx.send((drawn, plan.kill, outcome));
    });
    let (drawn, kill, outcome) = rx
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the kill phase of rolex seed 3027 did not end within 120 s");
    assert!(kill, "seed 3027 no longer kills a client");
    assert!(drawn.contains(&"slt_slots"), "seed 3027 draws {drawn:?}");
    let (mid_op, slow, blocked) = outcome.unwrap();
    assert!(mid_op);
    assert!(
        slow > 0,
        "no survivor operation outlived 300 us: nothing is checked"
    );
    assert_eq!(blocked, 0, "{blocked} survivors were abandoned");
}

/// `--faults` parses, prints and replays: the plan is a function of the
/// seed, and what `delay` chooses is the same with `all`.
#[test]
fn dst_fault_plans_follow_the_seed() {
    use crate::dst::{FaultPlan, Faults};
    let spec = crate::engines::REGISTRY.find("race").unwrap();
    let all: Faults = "all".parse().unwrap();
    assert_eq!(all, Faults::ALL);
    assert_eq!(all.to_string().parse::<Faults>().unwrap(), all);
    assert!("delay,bogus".parse::<Faults>().is_err());
    let delay: Faults = "delay".parse().unwrap();
    let mut delayed = 0;
    for seed in 0..40 {
        let a = FaultPlan::choose(spec, seed, all, None);
        let d = FaultPlan::choose(spec, seed, delay, None);
        assert_eq!(a.delays, d.delays);
        assert_eq!(d.crash, None);
        assert!(!d.kill);
        delayed += a.delays.enabled() as u32;
        let none = FaultPlan::choose(spec, seed, Faults::default(), None);
        assert!(!none.delays.enabled() && none.crash.is_none() && !none.kill);
        assert_eq!(none.value_size, dmkv_bench::config::defaults::VALUE_SIZE);
    }
    assert!(delayed > 5 && delayed < 35, "{delayed} of 40 seeds delay");
}

/// Every setting variant a DST seed may draw (`dst::VARIANTS`) names a
/// knob its engine declares, with a value other than the default that the
/// engine accepts (a local deployment with it comes up); seeds draw them
/// as the seed says, never over a `--set` of the same knob, never with
/// `--variants off`; and the other draws of a seed do not move when
/// variants are drawn (they come last).
#[test]
fn dst_setting_variants_are_valid_and_follow_the_seed() {
    use crate::dst::{DstParams, FaultPlan, Faults, VARIANTS};
    for &(engine, knob, values) in VARIANTS {
        let spec = crate::engines::REGISTRY
            .find(engine)
            .unwrap_or_else(|| panic!("{engine} is not registered"));
        let declared = spec
            .knobs()
            .iter()
            .find(|k| k.name == knob)
            .unwrap_or_else(|| panic!("{engine} declares no knob {knob}"));
        for v in values {
            assert_ne!(*v, declared.default, "{engine}.{knob}={v} is the default");
            let mut k = dmkv_api::Knobs::new();
            k.set(knob, v);
            let d = dmkv_api::deploy::LocalDeployment::deploy(
                spec,
                &dmkv_api::deploy::DeployOptions {
                    knobs: k,
                    expected_keys: 256,
                    ..Default::default()
                },
            );
            assert!(d.is_ok(), "{engine}.{knob}={v}: {}", d.err().unwrap());
        }
    }
    let spec = crate::engines::REGISTRY.find("sherman").unwrap();
    let none = dmkv_api::Knobs::new();
    let mut set = dmkv_api::Knobs::new();
    set.set("lock_read", "separate");
    let (mut drawn, mut lock_read) = (0, 0);
    for seed in 0..60 {
        let plain = FaultPlan::choose(spec, seed, Faults::ALL, None);
        let a = FaultPlan::choose(spec, seed, Faults::ALL, Some(&none));
        let b = FaultPlan::choose(spec, seed, Faults::ALL, Some(&none));
        assert!(plain.variant.is_empty());
        assert_eq!(a.variant, b.variant, "seed {seed}");
        assert_eq!(
            (
                plain.delays,
                plain.value_size,
                plain.memnodes,
                plain.crash,
                plain.kill,
                plain.hot
            ),
            (a.delays, a.value_size, a.memnodes, a.crash, a.kill, a.hot),
            "seed {seed}: variants moved another draw"
        );
        drawn += !a.variant.is_empty() as u32;
        lock_read += a.variant.iter().any(|v| v.0 == "lock_read") as u32;
        let given = FaultPlan::choose(spec, seed, Faults::ALL, Some(&set));
        assert!(
            given.variant.iter().all(|v| v.0 != "lock_read"),
            "seed {seed}"
        );
        let mut p = DstParams::default();
        p.knobs.insert("sherman".into(), set.clone());
        let k = p.knobs_for("sherman", &a);
        for (knob, value) in &a.variant {
            assert_eq!(
                k.get::<String>("sherman", spec.knobs(), knob).unwrap(),
                *value
            );
        }
        p.variants = false;
        assert!(p.plan(spec, seed).variant.is_empty());
    }
    assert!(drawn > 40, "{drawn} of 60 seeds drew a variant");
    assert!(
        lock_read > 15 && lock_read < 45,
        "{lock_read} of 60 seeds drew lock_read"
    );
}

/// The `dmkv bench` command a failing DST seed prints replays that run:
/// the same first error, to the key, task and virtual instant. Outback's
/// seed 5 with every fault and setting variants, its operations limited
/// to 1 ms of virtual time, fails on an operation that waits through the
/// crash's failover. The replay must carry every choice of the seed; it
/// once lacked the load's 64-key calls (`--load-chunk`), so the engine
/// started from another state and failed elsewhere.
#[test]
fn a_failing_dst_seeds_replay_command_fails_the_same_way() {
    let spec = crate::engines::REGISTRY.find("outback").unwrap();
    let params = crate::dst::DstParams {
        faults: crate::dst::Faults::ALL,
        op_limit: std::time::Duration::from_millis(1),
        ..Default::default()
    };
    let seed = 5;
    let plan = params.plan(spec, seed);
    assert!(
        !plan.variant.is_empty(),
        "seed {seed} drew no setting variant"
    );
    let (failure, _, _) = crate::dst::run_mixed(spec, seed, &params, &plan);
    let f = failure.expect("seed 5 fails with a 1 ms operation limit");
    let first = f.why.split("first: ").nth(1).unwrap().to_string();
    let replay: Vec<&str> = f.replay.split_whitespace().skip(1).collect();
    assert!(replay.contains(&"--load-chunk"), "{}", f.replay);
    let o = dmkv(&replay);
    assert!(
        o.out.contains(&first) || o.err.contains(&first),
        "the replay `{}` did not fail with {first:?}:\n{}\n{}",
        f.replay,
        o.out,
        o.err
    );
}

#[test]
fn a_dst_seed_replays_exactly() {
    // The same seed twice gives the same report, apart from wall-clock time.
    let path = std::env::temp_dir().join(format!("dmkv-replay-{}.json", std::process::id()));
    let run = || {
        let out = dmkv(&[
            "bench",
            "--transport",
            "sim",
            "--engine",
            "race,rolex",
            "--workload",
            "ycsb-a",
            "--keys",
            "2000",
            "--ops",
            "3000",
            "--compute-nodes",
            "2",
            "--jitter-ns",
            "300",
            "--seed",
            "7",
            "--verify",
            "--json",
            path.to_str().unwrap(),
        ]);
        assert_eq!(out.code, 0, "{}", out.err);
        let text = std::fs::read_to_string(&path).unwrap();
        let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
        for r in v.as_array_mut().unwrap() {
            r["sim"].as_object_mut().unwrap().remove("wall");
        }
        v
    };
    assert_eq!(run(), run());
    let _ = std::fs::remove_file(&path);
}

/// The livelock limit (`--op-limit-ms`) is not part of a seed's identity:
/// a run in which no operation reaches it gives the same report under any
/// limit and without one. Before its checks were quiet (one watchdog per
/// task, `sim::Watch`), each operation's timer drew a tie from the
/// scheduler's generator on every poll and woke its task when it fired,
/// after the operation had ended: this Sherman seed (a DST mixed run with
/// a delayed message; its slowest operation takes 2.2 ms) gave 97 of 259
/// fields otherwise under 5 ms than under 10 s.
#[test]
fn a_runs_report_is_the_same_under_any_op_limit() {
    let run = |limit: Option<&str>| {
        let mut args = vec![
            "--transport",
            "sim",
            "--engine",
            "sherman",
            "--keyset",
            "sequential",
            "--workload",
            "mixed:60,0,40,0,0,0",
            "--dist",
            "latest",
            "--keys",
            "256",
            "--ops",
            "4000",
            "--compute-nodes",
            "2",
            "--threads",
            "4",
            "--tasks",
            "8",
            "--jitter-ns",
            "400",
            "--seed",
            "7339",
            "--verify",
            "--load-chunk",
            "64",
            "--value-size",
            "152",
            "--delay-faults",
            "20000@31596",
        ];
        if let Some(ms) = limit {
            args.extend(["--op-limit-ms", ms]);
        }
        // One engine: the report is one object.
        let mut r = bench_json(&args, &format!("limit-{}", limit.unwrap_or("none")));
        r["sim"].as_object_mut().unwrap().remove("wall");
        r["run"].as_object_mut().unwrap().remove("command");
        assert!(
            r["latency_us"]["max"].as_f64().unwrap() < 5000.0,
            "an operation reached the 5 ms limit"
        );
        r
    };
    let plain = run(None);
    assert_eq!(run(Some("5")), plain, "under a 5 ms limit");
    assert_eq!(run(Some("10000")), plain, "under a 10 s limit");
}

/// Every engine replays its seed exactly on a multi-node cluster with the
/// faults DST injects (delayed messages, multi-line values and, where the
/// engine survives one, a memory-node crash). Both runs are in this one
/// process, where every new `HashMap` gets other hash keys: a code path
/// whose effect depends on a `HashMap`'s iteration order (Outback's bulk
/// load and crash recovery did) gives two different reports here.
#[test]
fn every_engine_replays_a_seed_exactly_under_faults() {
    let path = std::env::temp_dir().join(format!("dmkv-replay-faults-{}.json", std::process::id()));
    for e in crate::dst::engines() {
        let mut args: Vec<&str> = vec![
            "bench",
            "--transport",
            "sim",
            "--engine",
            e,
            "--workload",
            "mixed:45,25,15,10,0,5",
            "--dist",
            "zipfian",
            "--keys",
            "256",
            "--ops",
            "1200",
            "--compute-nodes",
            "2",
            "--threads",
            "2",
            "--tasks",
            "4",
            "--jitter-ns",
            "400",
            "--seed",
            "12",
            "--verify",
            "--value-size",
            "280",
            "--delay-faults",
            "20000@50000",
        ];
        if e == "scalestore" {
            args.extend(["--nodes", "3"]);
        } else {
            args.extend(["--memnodes", "3"]);
        }
        // As in the CI sweep, no crash for ROLEX and Sherman (too slow).
        if !["scalestore", "rolex", "sherman"].contains(&e) {
            args.extend(["--crash-memnode", "2@0.55"]);
        }
        args.extend(["--json", path.to_str().unwrap()]);
        let run = || {
            let out = dmkv(&args);
            // Engines that keep no replica report the crashed node's keys
            // as errors (EXIT_FAILED); the report must still replay.
            assert!(out.code == 0 || out.code == EXIT_FAILED, "{e}: {}", out.err);
            let text = std::fs::read_to_string(&path).unwrap();
            // One engine: the report is an object.
            let mut v: serde_json::Value = serde_json::from_str(&text).unwrap();
            assert_eq!(v["engine"], e, "{text}");
            v["sim"].as_object_mut().unwrap().remove("wall");
            v
        };
        let (a, b) = (run(), run());
        assert!(a == b, "{e}: two runs of one seed differ:\n{a}\n{b}");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn outback_fails_over_a_crashed_memory_node_in_the_simulation() {
    // Memory node 1 of 3 crashes half way through a write-heavy run in
    // virtual time: clients see no error and every key reads back. With
    // seed 2 this deadlocked the simulator while a handler's wait for its
    // mirror writes was a nested frame that ran the takeover job on top of
    // it (now a wait on the network alone, `block_on_network`).
    for seed in ["1", "2"] {
        let out = dmkv(&[
            "bench",
            "--transport",
            "sim",
            "--engine",
            "outback",
            "--workload",
            "ycsb-a",
            "--keys",
            "20000",
            "--ops",
            "20000",
            "--memnodes",
            "3",
            "--crash-memnode",
            "1@0.5",
            "--seed",
            seed,
            "--verify",
        ]);
        assert_eq!(out.code, 0, "seed {seed}: {}", out.err);
        assert!(
            out.out
                .contains("verify                         ok (20000 keys)"),
            "{}",
            out.out
        );
        let errors_after = out
            .out
            .lines()
            .find(|l| l.starts_with("crash: ops / errors after"))
            .unwrap_or_else(|| panic!("no crash line: {}", out.out));
        assert!(errors_after.trim_end().ends_with("/ 0"), "{errors_after}");
    }
}

/// Outback's memory nodes mirror their writes to each other with verbs they
/// issue themselves, each node from its own endpoint (`NodeCtx::with_endpoint`,
/// crates/outback/src/server/ctx.rs). Under the simulation every node's
/// handlers run on one thread; when that thread kept one endpoint, each
/// mirror write of one node after one of the other made a new endpoint, and
/// the report listed ~1,950 client cores per memory node for a 10,000-op
/// run (and the run slowed twelvefold). One endpoint per memory node now.
#[test]
fn one_endpoint_per_node_context_on_a_shared_thread() {
    let r = bench_json(
        &[
            "--transport",
            "sim",
            "--engine",
            "outback",
            "--workload",
            "ycsb-a",
            "--keys",
            "2000",
            "--ops",
            "4000",
            "--memnodes",
            "2",
            "--compute-nodes",
            "2",
            "--threads",
            "2",
            "--tasks",
            "2",
            "--seed",
            "3",
            "--verify",
        ],
        "outback-mirror-endpoints",
    );
    assert_eq!(r["ok"], true, "{r}");
    // The mirror path ran many times on both memory nodes.
    for shard in r["engine_stats"]["per_shard"].as_array().unwrap() {
        assert!(
            shard["replica_round_trips"].as_u64().unwrap() > 100,
            "{shard}"
        );
    }
    let rows: Vec<&str> = r["sim"]["utilisation"]
        .as_array()
        .unwrap()
        .iter()
        .map(|u| u["name"].as_str().unwrap())
        .collect();
    for node in ["node0", "node1"] {
        assert!(
            rows.contains(&format!("{node} handler cores").as_str()),
            "{rows:?}"
        );
        let cores = rows
            .iter()
            .filter(|n| n.starts_with(&format!("{node} client core ")))
            .count();
        assert_eq!(cores, 1, "{node}: {cores} client cores in the report");
    }
}
/// Every disaggregated design of the default set spreads its data over the
/// memory nodes: on three, each memory node sends at least 20% of the
/// bytes. The twenty-eighth session found three that did not: rpc-btree
/// and Cell kept their tree on the first memory node (0% on the others;
/// now range-partitioned, docs/rpc-btree.md), and Sherman kept every split
/// sibling on its left node's memory node, so that everything the
/// harness's ascending load inserted after its first (bulk-built) call
/// stayed on one memory node (93% of the bytes from node 1; now the
/// client's allocation target rotates per chunk as the artifact's
/// `DSM::alloc`, docs/sherman.md invariant 2).
#[test]
fn every_design_spreads_over_its_memory_nodes() {
    for engine in crate::engines::REGISTRY.default_set {
        let r = bench_json(
            &[
                "--transport",
                "sim",
                "--engine",
                engine,
                "--workload",
                "ycsb-a",
                "--keys",
                "40000",
                "--ops",
                "20000",
                "--memnodes",
                "3",
                "--threads",
                "2",
                "--tasks",
                "4",
                "--seed",
                "3",
                "--verify",
            ],
            &format!("spread-{engine}"),
        );
        assert_eq!(r["ok"], true, "{engine}: {r}");
        let sent: Vec<f64> = (0..3)
            .map(|n| utilisation(&r, &format!("node{n} nic tx"), "bytes_per_s"))
            .collect();
        let total: f64 = sent.iter().sum();
        for (n, b) in sent.iter().enumerate() {
            assert!(
                *b >= 0.2 * total,
                "{engine}: memory node {n} sent {:.1}% of the bytes: {sent:?}",
                100.0 * b / total
            );
        }
    }
}

/// xtree's in-place writes (`NodeSlice`'s stores and CASes, which the
/// region cannot see) are reported to `sim` (docs/xtree.md invariant 12),
/// so with private core caches a line one handler core wrote leaves the
/// other cores' caches. rpc-btree's updates write only through them: before
/// the report, a run with two handler cores showed no invalidations at all
/// and priced the written lines as private hits on the other core.
#[test]
fn xtree_writes_invalidate_other_cores_private_copies() {
    let r = bench_json(
        &[
            "--transport",
            "sim",
            "--engine",
            "rpc-btree",
            "--workload",
            "ycsb-a",
            "--keys",
            "5000",
            "--ops",
            "5000",
            "--memnode-threads",
            "2",
        ],
        "core-cache-inv",
    );
    assert!(
        utilisation_per_s(&r, "node0 handler cores private hits") > 0.0,
        "the shipped default profile has private caches"
    );
    // Half the operations are updates, each committing a leaf (every
    // line's version word) on one of two cores that both read the tree.
    assert!(
        utilisation_per_s(&r, "node0 handler cores private invalidations") > 0.0,
        "no private copy was dropped by an xtree write"
    );
}

/// `--cpu-spread-ns` is a sim knob, refused above the profile's client
/// CPU per operation, and recorded in the report (absent without one, so
/// reports without a spread are as before).
#[test]
fn cpu_spread_is_checked_and_reported() {
    assert_usage_error(&["bench", "--cpu-spread-ns", "100"], "--cpu-spread-ns");
    assert_usage_error(
        &[
            "bench",
            "--transport",
            "sim",
            "--profile",
            "xstore-cx4",
            "--cpu-spread-ns",
            "301",
        ],
        "client CPU per operation (300 ns)",
    );
    let args = |spread: &'static str| {
        let mut a = vec![
            "--transport",
            "sim",
            "--profile",
            "xstore-cx4",
            "--engine",
            "race",
            "--workload",
            "ycsb-c",
            "--keys",
            "2000",
            "--ops",
            "4000",
        ];
        if !spread.is_empty() {
            a.extend_from_slice(&["--cpu-spread-ns", spread]);
        }
        a
    };
    let spread = bench_json(&args("250"), "cpu-spread");
    let fixed = bench_json(&args(""), "cpu-fixed");
    assert_eq!(spread["sim"]["cpu_spread_ns"].as_u64(), Some(250));
    assert!(fixed["sim"].get("cpu_spread_ns").is_none());
    // Nearly every GET is the same round trips (a few read a second
    // bucket), so the fixed model's p99 is close to its p50 and the
    // spread's is not (measured: 0.11 against 0.98 us).
    let p = |r: &serde_json::Value, q: &str| r["latency_us"][q].as_f64().unwrap();
    assert!(
        p(&spread, "p99") - p(&spread, "p50") > 0.3 + (p(&fixed, "p99") - p(&fixed, "p50")),
        "spread {:?} fixed {:?}",
        spread["latency_us"],
        fixed["latency_us"]
    );
}

/// The phase effect the spread is for (docs/simulation.md, "Phase
/// effects"): RACE with 72 one-request threads on two compute nodes. With
/// constant steps the threads move in lockstep and their responses queue
/// at the memory node's NIC (measured: 383 ns per message, 73% busy,
/// 18.2 M ops/s); with each operation's CPU drawn from 300 +- 300 ns they
/// disperse (94 ns, 83% busy, 20.6 M ops/s), and the report's queueing
/// figure shows the difference. Fails if the spread draws nothing, or if
/// `mean_wait_ns` does not count the NIC's queue.
#[test]
fn a_cpu_spread_takes_a_lockstep_convoy_apart() {
    let run = |spread: &'static str, name: &str| {
        bench_json(
            &[
                "--transport",
                "sim",
                "--profile",
                "outback-cx6",
                "--engine",
                "race",
                "--workload",
                "ycsb-c",
                "--keys",
                "20000",
                "--ops",
                "20000",
                "--llc-keys",
                "64000000",
                "--memnode-threads",
                "1",
                "--compute-nodes",
                "2",
                "--threads",
                "36",
                "--tasks",
                "1",
                "--cpu-spread-ns",
                spread,
            ],
            name,
        )
    };
    let (lockstep, spread) = (run("0", "convoy-0"), run("300", "convoy-300"));
    let wait = |r: &serde_json::Value| utilisation(r, "node0 nic tx", "mean_wait_ns");
    let ops = |r: &serde_json::Value| r["throughput_ops_per_s"].as_f64().unwrap();
    assert!(
        wait(&lockstep) > 2.0 * wait(&spread),
        "queued at the memory node's NIC: {} ns in lockstep, {} ns spread",
        wait(&lockstep),
        wait(&spread)
    );
    assert!(
        ops(&spread) > 1.05 * ops(&lockstep),
        "{} ops/s in lockstep, {} spread",
        ops(&lockstep),
        ops(&spread)
    );
}

#[test]
fn llc_keys_scales_the_simulated_memory_node_cache() {
    assert_usage_error(&["bench", "--llc-keys", "1000000"], "--llc-keys");
    // rpc-hash, 20,000 keys: its table fits the full 35.75 MiB cache; with
    // the cache scaled as for 2e9 keys (one set) nearly every access misses.
    let run = |extra: &[&str], name: &str| -> serde_json::Value {
        let mut args = vec![
            "--transport",
            "sim",
            "--engine",
            "rpc-hash",
            "--workload",
            "ycsb-c",
            "--keys",
            "20000",
            "--ops",
            "20000",
        ];
        args.extend_from_slice(extra);
        bench_json(&args, name)
    };
    let per_s = utilisation_per_s;
    let full = run(&[], "llc-full");
    let scaled = run(&["--llc-keys", "2000000000"], "llc-scaled");
    let cpu = |r: &serde_json::Value| r["per_op"]["memnode_cpu_ns"].as_f64().unwrap();
    // Hits anywhere: with the shipped profile's private core caches (i69)
    // a warm table's lines hit the core's cache before the LLC is asked.
    let hits = |r: &serde_json::Value| {
        per_s(r, "node0 llc hits") + per_s(r, "node0 handler cores private hits")
    };
    assert!(
        per_s(&full, "node0 llc misses") < 0.01 * hits(&full),
        "the table fits the full cache"
    );
    // A GET reads a bucket, then the KV block it points to: two dependent
    // accesses, both missing a one-set cache.
    let gets = scaled["throughput_ops_per_s"].as_f64().unwrap();
    assert!(
        per_s(&scaled, "node0 llc dependent misses") > 1.5 * gets,
        "a one-set cache misses: {} dependent misses/s at {gets} GETs/s",
        per_s(&scaled, "node0 llc dependent misses")
    );
    assert!(
        cpu(&scaled) > cpu(&full) + 100.0,
        "misses cost handler time: {} vs {} ns per GET",
        cpu(&scaled),
        cpu(&full)
    );
}

/// Several ScaleStore leaves in one simulated run, overlapping (a leave
/// is an async task there; as blocking tasks they nested on the
/// simulator's one thread and such runs never ended: docs/scalestore.md),
/// with both protocols: the run verifies every key, both leaves are done
/// (node 1, the survivor, serves everything), and the same seed gives the
/// same report apart from wall-clock time. One leave still runs and
/// verifies too.
#[test]
fn scalestore_overlapping_leaves_verify_and_replay_on_sim() {
    let json = std::env::temp_dir().join(format!("dmkv-two-leaves-{}.json", std::process::id()));
    let run = |protocol: &str, leave: &str| {
        let proto = format!("scalestore.protocol={protocol}");
        let leave = format!("scalestore.leave={leave}");
        let o = dmkv(&[
            "bench",
            "--transport",
            "sim",
            "--engine",
            "scalestore",
            "--nodes",
            "3",
            "--threads",
            "3",
            "--tasks",
            "2",
            "--workload",
            "ycsb-a",
            "--keys",
            "400",
            "--ops",
            "800",
            "--value-size",
            "64",
            "--verify",
            "--seed",
            "100",
            "--set",
            &proto,
            "--set",
            &leave,
            "--json",
            json.to_str().unwrap(),
        ]);
        assert_eq!(o.code, 0, "{protocol} {leave}: {}\n{}", o.out, o.err);
        assert!(o.out.contains("ok (400 keys)"), "{}", o.out);
        let mut v: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        v["sim"].as_object_mut().unwrap().remove("wall");
        v
    };
    for protocol in ["chaining", "fifo"] {
        let a = run(protocol, "0@300,2@400");
        let es = &a["engine_stats"];
        let events: Vec<String> = serde_json::from_value(es["membership_events"].clone()).unwrap();
        for n in [0, 2] {
            assert!(
                events
                    .iter()
                    .any(|e| e.starts_with(&format!("node {n} left at op"))),
                "{protocol}: {events:?}"
            );
        }
        let states: Vec<&str> = es["per_node"]
            .as_array()
            .unwrap()
            .iter()
            .map(|n| n["state"].as_str().unwrap())
            .collect();
        assert_eq!(states, ["left", "active", "left"], "{protocol}: {es}");
        let b = run(protocol, "0@300,2@400");
        assert!(a == b, "{protocol}: two runs of one seed differ:\n{a}\n{b}");
    }
    let one = run("chaining", "2@300");
    let _ = std::fs::remove_file(&json);
    let events = one["engine_stats"]["membership_events"].to_string();
    assert!(events.contains("node 2 left at op"), "{events}");
}

/// A ScaleStore node with several handler cores on the simulated cluster,
/// its cache far smaller than the data so handlers wait for the SSD: such a
/// wait runs the node's other handlers nested on the simulator's thread,
/// and the handler used to hold the node slot's lock through `handle`, so
/// the nested one waited for it for ever (the run hung at once; see
/// `scalestore::engine`). The run happens on a thread so that a hang fails
/// the test instead of stalling the suite; 120 s is a hang guard, not a
/// timing (the run takes a few seconds).
#[test]
fn scalestore_with_several_handler_cores_and_its_ssd_finishes_on_sim() {
    let (done, finished) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let o = dmkv(&[
            "bench",
            "--transport",
            "sim",
            "--engine",
            "scalestore",
            "--nodes",
            "2",
            "--threads",
            "2",
            "--tasks",
            "2",
            "--workload",
            "ycsb-a",
            "--keys",
            "20000",
            "--ops",
            "4000",
            "--value-size",
            "128",
            "--cache-mb",
            "1",
            "--memnode-threads",
            "4",
            "--verify",
            "--seed",
            "5",
        ]);
        let _ = done.send(o);
    });
    let o = finished
        .recv_timeout(std::time::Duration::from_secs(120))
        .expect("the simulated run hung (nested handlers waiting on each other)");
    assert_eq!(o.code, 0, "{}\n{}", o.out, o.err);
    assert!(o.out.contains("ok (20000 keys)"), "{}", o.out);
}

// ---- `--partitioned` and `--shift-every-ms` (ScaleStore Fig. 9) ----------

/// Runs `dmkv bench ARGS --json` and returns the single engine's report.
fn bench_json(args: &[&str], name: &str) -> serde_json::Value {
    let path = std::env::temp_dir().join(format!("dmkv-part-{}-{name}.json", std::process::id()));
    let mut a: Vec<&str> = vec!["bench"];
    a.extend_from_slice(args);
    a.extend(["--json", path.to_str().unwrap()]);
    let o = dmkv(&a);
    assert_eq!(o.code, EXIT_OK, "{a:?}: {}", o.err);
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).expect("the report is JSON");
    let _ = std::fs::remove_file(&path);
    v
}

/// A `sim` report's utilisation row `row`, per second (0 when the report
/// has no such row).
fn utilisation_per_s(report: &serde_json::Value, row: &str) -> f64 {
    utilisation(report, row, "per_s")
}

/// A `sim` report's utilisation row `row`, its `field` (0 when the report
/// has no such row).
fn utilisation(report: &serde_json::Value, row: &str, field: &str) -> f64 {
    report["sim"]["utilisation"]
        .as_array()
        .unwrap()
        .iter()
        .find(|u| u["name"] == row)
        .map_or(0.0, |u| u[field].as_f64().unwrap())
}

/// The keys each node actually named, per phase, lie in the partition it
/// was assigned (node i takes partition (i + k) mod N after the k-th
/// shift); shifts happened; every node worked in at least two phases; and
/// `--verify` read every key back.
fn check_touched(v: &serde_json::Value, nodes: usize) {
    assert_eq!(v["ok"], true, "{v}");
    assert_eq!(v["verify"]["mismatches"], 0);
    assert_eq!(v["verify"]["missing"], 0);
    let p = &v["partition"];
    assert_eq!(p["partitions"].as_u64(), Some(nodes as u64));
    let ranges: Vec<(u64, u64)> = p["key_ranges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| (r[0].as_u64().unwrap(), r[1].as_u64().unwrap()))
        .collect();
    for w in ranges.windows(2) {
        assert!(w[0].1 < w[1].0, "partitions in key order: {ranges:?}");
    }
    let touched = p["touched"].as_array().unwrap();
    let mut phases_per_node = vec![std::collections::BTreeSet::new(); nodes];
    let mut ops = 0;
    for t in touched {
        let (phase, node) = (
            t["phase"].as_u64().unwrap(),
            t["node"].as_u64().unwrap() as usize,
        );
        let want = (node + phase as usize) % nodes;
        assert_eq!(t["partition"].as_u64(), Some(want as u64), "{t}");
        let (lo, hi) = ranges[want];
        let (min, max) = (
            t["min_key"].as_u64().unwrap(),
            t["max_key"].as_u64().unwrap(),
        );
        assert!(
            lo <= min && max <= hi,
            "node {node} phase {phase} named keys {min}..={max} outside partition {want} {lo}..={hi}"
        );
        phases_per_node[node].insert(phase);
        ops += t["ops"].as_u64().unwrap();
    }
    assert_eq!(
        Some(ops),
        v["ops"].as_u64(),
        "every operation is accounted for"
    );
    for (n, ph) in phases_per_node.iter().enumerate() {
        assert!(ph.len() >= 2, "node {n} saw a shift: phases {ph:?}");
    }
}

#[test]
fn partitioned_scalestore_shifts_on_sim_and_verifies() {
    let v = bench_json(
        &[
            "--engine",
            "scalestore",
            "--transport",
            "sim",
            "--profile",
            "scalestore-cx5",
            "--nodes",
            "3",
            "--threads",
            "3",
            "--tasks",
            "2",
            "--keys",
            "3000",
            "--ops",
            "12000",
            "--workload",
            "mixed:50,50,0,0,0",
            "--partitioned",
            "--shift-every-ms",
            "0.2",
            "--timeline-ms",
            "0.1",
            "--verify",
        ],
        "ss-sim",
    );
    assert_eq!(v["partition"]["node_of_thread"], "thread % nodes");
    check_touched(&v, 3);
}

#[test]
fn partitioned_compute_nodes_shift_with_zipfian_draws() {
    let v = bench_json(
        &[
            "--engine",
            "rpc-btree",
            "--transport",
            "sim",
            "--compute-nodes",
            "2",
            "--threads",
            "2",
            "--tasks",
            "2",
            "--keys",
            "2000",
            "--ops",
            "8000",
            "--workload",
            "ycsb-b",
            "--dist",
            "zipfian",
            "--partitioned",
            "--shift-every-ms",
            "0.1",
            "--verify",
        ],
        "cn-sim",
    );
    assert_eq!(v["partition"]["node_of_thread"], "thread / threads");
    check_touched(&v, 2);
}

#[test]
fn partitioned_without_shifts_stays_in_the_local_partition_on_local() {
    let v = bench_json(
        &[
            "--engine",
            "scalestore",
            "--nodes",
            "2",
            "--threads",
            "2",
            "--keys",
            "1000",
            "--ops",
            "2000",
            "--partitioned",
            "--verify",
        ],
        "ss-local",
    );
    let touched = v["partition"]["touched"].as_array().unwrap();
    assert_eq!(touched.len(), 2, "one phase, two nodes: {touched:?}");
    assert!(
        touched
            .iter()
            .all(|t| t["phase"] == 0 && t["partition"] == t["node"])
    );
    assert_eq!(v["ok"], true);
}

#[test]
fn partitioned_runs_refuse_bad_input() {
    let base = [
        "bench",
        "--engine",
        "scalestore",
        "--nodes",
        "2",
        "--threads",
        "2",
    ];
    let with = |extra: &[&'static str]| -> Vec<&'static str> {
        base.iter().chain(extra).copied().collect()
    };
    assert_usage_error(&with(&["--shift-every-ms", "5"]), "give --partitioned too");
    assert_usage_error(
        &with(&["--partitioned", "--shift-every-ms", "0"]),
        "at least 0.001 ms",
    );
    assert_usage_error(
        &with(&["--partitioned", "--keys", "1"]),
        "at least one loaded key per partition",
    );
    assert_usage_error(
        &with(&["--partitioned", "--workload", "ycsb-d"]),
        "inserts or deletes",
    );
    assert_usage_error(
        &["bench", "--engine", "xstore", "--partitioned"],
        "two or more nodes",
    );
    // (This one also prints the note that nodes 2..3 would only serve.)
    let o = dmkv(&[
        "bench",
        "--engine",
        "scalestore",
        "--nodes",
        "4",
        "--threads",
        "2",
        "--partitioned",
    ]);
    assert_eq!(o.code, EXIT_USAGE, "{}", o.err);
    assert!(o.err.contains("a worker on every node"), "{}", o.err);
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "scalestore,xstore",
            "--nodes",
            "2",
            "--threads",
            "2",
            "--partitioned",
        ],
        "maps threads to nodes differently",
    );
}

/// Shifts and the engine sampler run in virtual time: the same seed gives
/// the same report twice (apart from wall-clock figures), timeline and
/// per-interval engine counters included.
#[test]
fn partitioned_shifts_and_engine_timelines_replay_exactly() {
    let args = [
        "--engine",
        "xstore",
        "--transport",
        "sim",
        "--compute-nodes",
        "2",
        "--threads",
        "2",
        "--keys",
        "3000",
        "--ops",
        "9000",
        "--workload",
        "mixed:90,10,0,0,0",
        "--partitioned",
        "--shift-every-ms",
        "0.05",
        "--timeline-ms",
        "0.02",
    ];
    // Wall-clock figures and the command (its --json path) differ.
    let strip = |mut v: serde_json::Value| {
        v["sim"].as_object_mut().unwrap().remove("wall");
        v.as_object_mut().unwrap().remove("run");
        v
    };
    let a = strip(bench_json(&args, "replay-a"));
    let b = strip(bench_json(&args, "replay-b"));
    assert!(
        a["timeline"]["engine"]["gets"].is_array(),
        "{}",
        a["timeline"]
    );
    assert_eq!(a, b);
}

/// Each simulated compute node is its own compute process (one engine per
/// node, `SimDeployment::peers`) that counts its events into node 0's
/// counters: Sherman's writers on two nodes meet on the memory node's lock
/// word, where a CAS fails and is retried, instead of handing the lock over
/// through one shared local lock table. Before (every node on compute node
/// 0's engine) the same run had 0 lock retries and 1,159 hand-overs: each
/// writer waited in the one local table, whichever node it ran on. Node 1
/// starts with a cold cache (node 0 loaded) and fills it as it writes, as
/// Sherman's searches cache each level-1 node they read: without that, a
/// node that only writes never filled its cache (2,008 misses here).
#[test]
fn simulated_compute_nodes_keep_their_own_lock_tables_and_caches() {
    let args = "--transport sim --engine sherman --workload mixed:0,100,0,0,0,0 \
        --dist zipfian --keys 2000 --ops 4000 --compute-nodes 2 --threads 2 \
        --tasks 4 --seed 3 --verify";
    let r = bench_json(
        &args.split_whitespace().collect::<Vec<_>>(),
        "per-node-engines",
    );
    let s = &r["engine_stats"];
    let n = |k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k}: {s}"));
    // The nodes met each other's locks on the memory node.
    assert!(n("lock_retries") > 0, "{s}");
    // Both nodes' lookups are counted: 4,000 updates and 2,000 verified
    // reads, each one cache lookup.
    assert!(n("cache_hits") + n("cache_misses") >= 6000, "{s}");
    // Node 1's cold cache misses once per level-1 node, not per write.
    assert!(n("cache_misses") < 50, "{s}");
    assert_eq!(r["verify"]["errors"], 0, "{r}");
    assert_eq!(r["verify"]["mismatches"], 0, "{r}");
}

/// `--warmup-ops` on a real design: Sherman's compute node 1 starts with a
/// cold index cache, which the warm-up fills, so the measured GETs all hit
/// it; the warm-up's misses and its cost per GET stay in `warmup`, and the
/// report's `warmup.engine_stats` (the counters when the run started) is
/// what the run's share of a counter is taken against.
#[test]
fn a_warm_up_fills_the_caches_before_the_run() {
    let args = "--transport sim --engine sherman --workload ycsb-c --keys 20000 \
        --ops 4000 --warmup-ops 8000 --compute-nodes 2 --threads 2 --tasks 2 --verify";
    let r = bench_json(&args.split_whitespace().collect::<Vec<_>>(), "warm-up");
    let (end, start) = (&r["engine_stats"], &r["warmup"]["engine_stats"]);
    let n = |s: &serde_json::Value, k: &str| s[k].as_u64().unwrap_or_else(|| panic!("{k}: {s}"));
    // Every measured GET and every verified key (read after the run, and
    // before `engine_stats` is asked) is one cache lookup, and a hit.
    let run = |k: &str| n(end, k) - n(start, k);
    assert_eq!(run("cache_hits"), 4000 + 20_000, "{end} against {start}");
    assert_eq!(run("cache_misses"), 0, "{end} against {start}");
    assert_eq!(r["ops"], 4000);
    assert_eq!(r["per_op"]["round_trips"], 1.0, "{}", r["per_op"]);
    // Node 1's cold misses were the warm-up's: more than one round trip per
    // GET there.
    assert_eq!(r["warmup"]["ops"], 8000);
    let warm_rt = r["warmup"]["per_op"]["round_trips"].as_f64().unwrap();
    assert!(warm_rt > 1.0, "{}", r["warmup"]);
    assert!(n(start, "cache_misses") > 0, "{start}");
    assert_eq!(r["verify"]["errors"], 0, "{r}");
    assert_eq!(r["verify"]["mismatches"], 0, "{r}");
}
