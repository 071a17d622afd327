//! The runner end to end: correct engines pass every workload with
//! `--verify` (also with 2 threads x 4 tasks and torn reads injected), wrong
//! engines are caught, counters are exact, reports carry their fields.

mod support;

use dmkv_bench::report::EngineReport;
use dmkv_bench::{BenchConfig, BenchError, Dist, KeysetSpec, Workload, WorkloadSource};
use support::{Fault, Faulty, KEYS, NAIVE_VALUE, NaiveSlots, OPS, choice, reference, small};

fn run_one(cfg: &BenchConfig) -> EngineReport {
    let outcome = dmkv_bench::run(cfg).expect("the run starts");
    assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
    assert_eq!(outcome.reports.len(), 1);
    outcome.reports.into_iter().next().unwrap()
}

fn assert_clean(r: &EngineReport) {
    assert!(
        r.ok,
        "{} on {}: errors {:?}, checks {:?}, verify {:?}",
        r.engine, r.workload, r.errors, r.checks, r.verify
    );
    assert_eq!(r.errors.count, 0);
    assert_eq!(r.checks.failures, 0);
    assert!(r.verify.enabled);
    assert_eq!(r.verify.failures(), 0);
}

/// Σ over operation types of the metered costs equals what the endpoints
/// counted under every label during the run: no cost is lost or invented.
fn assert_counters_add_up(r: &EngineReport) {
    let counted: u64 = r.counters_by_kind.values().map(|t| t.round_trips).sum();
    let metered: f64 = r
        .by_op
        .values()
        .map(|o| o.per_op.round_trips * o.count as f64)
        .sum();
    assert_eq!(metered.round() as u64, counted, "{}", r.workload);
    let counted_bytes: u64 = r.counters_by_kind.values().map(|t| t.bytes_read).sum();
    let metered_bytes: f64 = r
        .by_op
        .values()
        .map(|o| o.per_op.bytes_read * o.count as f64)
        .sum();
    assert_eq!(
        metered_bytes.round() as u64,
        counted_bytes,
        "{}",
        r.workload
    );
    assert!(
        !r.counters_by_kind.contains_key("load"),
        "the load is not counted in the run"
    );
    assert!(!r.counters_by_kind.contains_key("verify"));
}

#[test]
fn reference_passes_every_workload_with_torn_reads_and_verify() {
    let workloads = [
        Workload::YcsbA,
        Workload::YcsbB,
        Workload::YcsbC,
        Workload::YcsbD,
        Workload::YcsbE,
        Workload::YcsbF,
        Workload::Insert,
        Workload::Load,
        "mixed:30,20,20,20,10".parse().unwrap(),
    ];
    for w in workloads {
        let mut cfg = small(vec![reference()], w);
        cfg.local.faults.torn_reads = true;
        let r = run_one(&cfg);
        assert_clean(&r);
        assert_counters_add_up(&r);
        assert_eq!(r.keys, KEYS);
        assert_eq!(r.load.keys, KEYS);
        assert_eq!((r.threads, r.tasks_per_thread), (2, 4));
        if w == Workload::Load {
            assert_eq!(r.ops, 0);
            assert_eq!(r.verify.checked, KEYS);
            continue;
        }
        assert_eq!(r.ops, OPS, "{w}");
        let inserts = r.by_op.get("insert").map_or(0, |o| o.count);
        assert_eq!(r.verify.checked, KEYS + inserts, "{w}: every key read back");
        // The reference engine: one RPC, one round trip, no verbs per op.
        for (name, o) in &r.by_op {
            let rpcs = if name == "rmw" { 2.0 } else { 1.0 };
            assert_eq!(o.per_op.rpcs, rpcs, "{w} {name}");
            assert_eq!(o.per_op.round_trips, rpcs, "{w} {name}");
            assert_eq!(o.per_op.verbs, 0.0, "{w} {name}");
        }
    }
}

#[test]
fn per_op_counters_are_exact() {
    let r = run_one(&small(vec![reference()], Workload::YcsbC));
    let get = &r.by_op["get"];
    assert_eq!(get.count, OPS);
    // A get request is op (1) + key (8); its reply is found (1) + length
    // (4) + the 8-byte value; every key exists in YCSB C.
    assert_eq!(get.per_op.bytes_written, 9.0);
    assert_eq!(get.per_op.bytes_read, 13.0);
    assert_eq!(r.per_op.bytes_read, 13.0);
    assert_eq!(r.counters_by_kind["get"].rpcs, OPS);
    // The load went in one chunk of 4096 pairs or fewer: one RPC per 1024
    // pairs in the reference engine.
    assert_eq!(
        (r.load.per_key.rpcs * KEYS as f64).round() as u64,
        KEYS.div_ceil(1024)
    );
    // --verify read every key once, one RPC each.
    assert_eq!(r.verify_counters.rpcs, KEYS);
    // Memory-node figures cover the run: the stats service is not called in
    // process, so every RPC served was one of the run's.
    assert_eq!(r.memnode.rpcs_served, OPS);
    assert!(r.memnode.handler_cpu_ns > 0);

    let f = run_one(&small(vec![reference()], Workload::YcsbF));
    let rmw = &f.by_op["rmw"];
    let reads = f.by_op["get"].count;
    assert_eq!(rmw.count + reads, OPS);
    // A read-modify-write is one op charged as a get and an update.
    assert_eq!(f.counters_by_kind["get"].rpcs, reads + rmw.count);
    assert_eq!(f.counters_by_kind["update"].rpcs, rmw.count);
    assert_eq!(rmw.per_op.bytes_written, 9.0 + 1.0 + 8.0 + 4.0 + 8.0);
}

#[test]
fn several_engines_get_the_same_keys_and_operations() {
    let twin = Faulty::leak("reference-twin", Fault::None);
    let mut cfg = small(
        vec![reference(), choice(twin)],
        "mixed:40,20,20,10,10".parse().unwrap(),
    );
    cfg.dist = Some(Dist::Zipfian);
    let outcome = dmkv_bench::run(&cfg).unwrap();
    assert!(outcome.ok(), "{:?}", outcome.failures);
    let [a, b] = &outcome.reports[..] else {
        panic!("two reports")
    };
    assert_eq!(a.engine, "reference");
    assert_eq!(b.engine, "reference-twin");
    for (name, oa) in &a.by_op {
        let ob = &b.by_op[name];
        assert_eq!(oa.count, ob.count, "{name}");
        // Requests are the same bytes, so what they cost is too.
        assert_eq!(oa.per_op.bytes_written, ob.per_op.bytes_written, "{name}");
        assert_eq!(oa.per_op.rpcs, ob.per_op.rpcs, "{name}");
    }
    assert_eq!(a.verify.checked, b.verify.checked);
    let mut table = Vec::new();
    dmkv_bench::print_table(&mut table, &outcome.reports).unwrap();
    let table = String::from_utf8(table).unwrap();
    assert!(table.contains("relative to reference"), "{table}");
    assert!(table.contains("1.00x"), "{table}");
}

/// The table warns under its rows when other processes loaded the host
/// during an engine's wall-clock run (more than
/// `report::HOST_LOAD_NOTE_CORES`), naming the engine and the load, and
/// says nothing when they did not or when the load is unknown.
#[test]
fn the_table_notes_a_run_that_shared_the_host() {
    use dmkv_bench::sched::SchedReport;
    let outcome = dmkv_bench::run(&small(vec![reference()], Workload::YcsbC)).unwrap();
    assert!(outcome.ok(), "{:?}", outcome.failures);
    let mut reports = outcome.reports;
    let table_with = |reports: &[EngineReport], cores: Option<f64>| {
        let mut reports = reports.to_vec();
        reports[0].sched = Some(SchedReport {
            threads: Vec::new(),
            other_processes_cores: cores,
            steal_cores: None,
            pinned: None,
        });
        let mut table = Vec::new();
        dmkv_bench::print_table(&mut table, &reports).unwrap();
        String::from_utf8(table).unwrap()
    };
    let loaded = table_with(&reports, Some(0.8));
    assert!(
        loaded.contains("note: other processes used 0.80 cores during reference's run"),
        "{loaded}"
    );
    for quiet in [
        Some(0.1),
        Some(dmkv_bench::report::HOST_LOAD_NOTE_CORES),
        None,
    ] {
        let t = table_with(&reports, quiet);
        assert!(!t.contains("note: other processes"), "{quiet:?}: {t}");
    }
    reports[0].sched = None;
    let mut table = Vec::new();
    dmkv_bench::print_table(&mut table, &reports).unwrap();
    assert!(
        !String::from_utf8(table)
            .unwrap()
            .contains("note: other processes")
    );
}

/// Runs `workload` on the reference engine broken by `fault` and returns
/// the report, which must not be ok.
fn broken(name: &'static str, fault: Fault, workload: Workload) -> EngineReport {
    let mut cfg = small(vec![choice(Faulty::leak(name, fault))], workload);
    cfg.load_chunk = 100;
    let outcome = dmkv_bench::run(&cfg).unwrap();
    assert!(!outcome.ok(), "{name} must be caught");
    let r = outcome.reports.into_iter().next().unwrap();
    assert!(!r.ok, "{name} must be flagged");
    r
}

#[test]
fn wrong_engines_are_caught() {
    let r = broken("corrupt", Fault::CorruptEveryNthGet(7), Workload::YcsbC);
    assert!(r.checks.by_problem["corrupt_value"] > 0, "{:?}", r.checks);
    assert!(r.verify.mismatches > 0);
    assert!(r.checks.samples[0].starts_with("corrupt_value: get: value of key"));

    let r = broken("wrong-key", Fault::WrongKeyEveryNthGet(5), Workload::YcsbC);
    assert!(r.checks.by_problem["corrupt_value"] > 0, "{:?}", r.checks);

    let r = broken(
        "lossy-load",
        Fault::DropFirstLoadedPairPerChunk,
        Workload::YcsbC,
    );
    // Chunks of 100 keys: one key lost per chunk.
    assert_eq!(r.verify.missing, KEYS / 100);
    assert_eq!(r.verify.mismatches, 0);
    assert!(r.checks.by_problem["missing"] > 0, "{:?}", r.checks);

    let r = broken(
        "lossy-insert",
        Fault::DropEveryNthInsert(3),
        Workload::YcsbD,
    );
    assert!(r.verify.missing > 0, "{:?}", r.verify);

    let r = broken(
        "sticky-delete",
        Fault::IgnoreEveryNthDelete(2),
        "mixed:50,0,0,50,0".parse().unwrap(),
    );
    assert!(r.verify.unexpected > 0, "{:?}", r.verify);

    let r = broken("gappy-scan", Fault::ScanSkipsSecondPair, Workload::YcsbE);
    assert!(r.checks.by_problem["missing"] > 0, "{:?}", r.checks);

    let r = broken(
        "refusing-update",
        Fault::RefuseEveryNthUpdate(4),
        Workload::YcsbA,
    );
    assert!(r.checks.by_problem["wrong_result"] > 0, "{:?}", r.checks);
}

fn naive_config(torn_reads: bool) -> BenchConfig {
    let mut cfg = small(vec![choice(&NaiveSlots)], Workload::YcsbA);
    cfg.keyset = KeysetSpec::Sequential;
    cfg.keys = 64;
    cfg.dist = Some(Dist::Zipfian);
    cfg.value_size = NAIVE_VALUE;
    // One thread: its tasks interleave only where the executor yields, so
    // without injected tears no read can overlap a write.
    cfg.threads = 1;
    cfg.tasks = 8;
    cfg.local.faults.torn_reads = torn_reads;
    cfg
}

#[test]
fn torn_one_sided_reads_are_caught() {
    // The naive engine reads without validating; on one thread without
    // injected tears it is correct...
    assert_clean(&run_one(&naive_config(false)));
    // ...and with torn reads, every 64-byte read is copied in at least two
    // pieces with a yield between, while other tasks update the same few
    // hot keys: the harness must see torn values.
    let r = run_one(&naive_config(true));
    assert!(!r.ok);
    assert!(r.checks.by_problem["corrupt_value"] > 0, "{:?}", r.checks);
    // The load and the verification happen without racing writers.
    assert_eq!(r.verify.failures(), 0, "{:?}", r.verify);
    let naive = &r.by_op["get"];
    assert_eq!(naive.per_op.rpcs, 0.0);
    assert_eq!(naive.per_op.verbs, 1.0);
    assert_eq!(naive.per_op.bytes_read, 72.0);
}

#[test]
fn engines_that_cannot_run_a_workload_are_refused_before_running() {
    let mut cfg = naive_config(false);
    cfg.workload = WorkloadSource::Synthetic(Workload::YcsbE);
    let e = dmkv_bench::run(&cfg).unwrap_err();
    assert!(
        matches!(&e, BenchError::Input(m) if m.contains("no ordered scans")),
        "{e}"
    );
    let mut cfg = naive_config(false);
    cfg.value_size = NAIVE_VALUE + 1;
    let e = dmkv_bench::run(&cfg).unwrap_err();
    assert!(
        matches!(&e, BenchError::Input(m) if m.contains("at most 64 bytes")),
        "{e}"
    );
}

fn trace_config(file: &str) -> BenchConfig {
    let mut cfg = BenchConfig::new(vec![reference()]);
    cfg.workload = WorkloadSource::Trace(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/data")
            .join(file),
    );
    cfg.threads = 2;
    cfg.tasks = 2;
    cfg.verify = true;
    cfg
}

#[test]
fn traces_replay_with_checks() {
    let r = run_one(&trace_config("ycsb-run.log"));
    assert_clean(&r);
    let t = r.trace.as_ref().unwrap();
    assert_eq!((t.lines, t.operations, t.ignored_lines), (29, 18, 11));
    // Keys read, updated, deleted or scanned before any insert are loaded.
    assert_eq!(r.keys, 6);
    assert_eq!(r.ops, 18);
    assert_eq!(r.by_op["insert"].count, 4);
    assert_eq!(r.by_op["delete"].count, 3);
    assert_eq!(r.by_op["scan"].count, 2);
    assert_eq!(r.verify.checked, 8);
    assert!(r.workload.starts_with("trace:"));

    // A load-phase trace is an insert workload.
    let r = run_one(&trace_config("ycsb-load.log"));
    assert_clean(&r);
    assert_eq!((r.keys, r.ops), (0, 5));
    assert_eq!(r.by_op.keys().collect::<Vec<_>>(), ["insert"]);
    assert_eq!(r.verify.checked, 5);
}

#[test]
fn json_reports_carry_the_design_fields() {
    let dir = std::env::temp_dir().join(format!("dmkv-bench-json-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let r = run_one(&small(vec![reference()], Workload::YcsbB));
    let one = dir.join("one.json");
    dmkv_bench::write_json(&one, std::slice::from_ref(&r)).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&one).unwrap()).unwrap();
    for field in [
        "engine",
        "workload",
        "dist",
        "keyset",
        "keys",
        "ops",
        "value_size",
        "threads",
        "tasks_per_thread",
        "memnode_threads",
        "transport",
        "throughput_ops_per_s",
        "latency_us",
        "per_op",
        "by_op",
        "client_cache_bytes",
        "memnode_bytes",
        "verify",
        "engine_stats",
        "memnode",
        "checks",
        "errors",
        "load",
    ] {
        assert!(v.get(field).is_some(), "missing {field}");
    }
    for f in ["p50", "p99", "p999"] {
        assert!(v["latency_us"][f].as_f64().unwrap() > 0.0, "{f}");
    }
    for f in [
        "round_trips",
        "verbs",
        "rpcs",
        "bytes_read",
        "bytes_written",
        "memnode_cpu_ns",
    ] {
        assert!(v["per_op"][f].is_number(), "per_op.{f}");
        assert!(v["by_op"]["get"][f].is_number(), "by_op.get.{f}");
    }
    assert!(v["by_op"]["get"]["latency_us"]["p99"].is_number());
    for f in ["checked", "mismatches", "missing", "unexpected"] {
        assert!(v["verify"][f].is_u64(), "verify.{f}");
    }
    for f in [
        "rpcs_served",
        "handler_cpu_ns",
        "background_cpu_ns",
        "background_jobs",
        "memory_used",
    ] {
        assert!(v["memnode"][f].is_u64(), "memnode.{f}");
    }
    assert_eq!(v["workload"], "ycsb-b");
    assert_eq!(v["transport"], "local");
    let two = dir.join("two.json");
    dmkv_bench::write_json(&two, &[r.clone(), r]).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&two).unwrap()).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 2);
    std::fs::remove_dir_all(&dir).unwrap();
}
