#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! In-process YCSB-style runs of `outback` (and `rpc-btree` for the
//! memory-node CPU comparison), measured with the transport's exact
//! counters, until `dmkv bench` lands. Every value read is checked.
//!
//! ```text
//! cargo run --release -p dmkv-outback --example ycsb -- c      [keys] [ops] [threads] [tasks]
//! cargo run --release -p dmkv-outback --example ycsb -- d      [keys] [ops] [threads] [tasks]
//! cargo run --release -p dmkv-outback --example ycsb -- insert [keys] [ops] [threads] [tasks]
//! cargo run --release -p dmkv-outback --example ycsb -- crash  [keys] [ops] [threads] [tasks]
//! ```
//!
//! `c`: uniform GETs over loaded keys, outback and rpc-btree, one memory-node
//! handler thread each. `d`: 95% GET / 5% INSERT (YCSB D, uniform over the
//! keys present), then every key read back (verify). `insert`: inserts
//! only, then verify. `crash`: YCSB D-like writes on three memory nodes,
//! one of them crashed in the middle, then verify.

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::{check_value, make_value};
use dmkv_api::{EngineSpec, Knobs};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::{CounterTable, OpKind, labeled};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Instant;

fn key(i: u64) -> u64 {
    dmkv_outback::hash::mix64(i ^ 0x00C0_FFEE)
}

struct Run {
    ops: u64,
    gets: u64,
    inserts: u64,
    /// Operations completed in each 250 ms window of the run.
    timeline: Vec<u64>,
    secs: f64,
    counters: CounterTable,
    stats: serde_json::Value,
    cache: u64,
    missing: u64,
}

#[derive(Clone, Copy, PartialEq)]
enum Mix {
    Reads,
    /// Percent of inserts, rest reads.
    Inserts(u64),
}

fn deploy(spec: &dyn EngineSpec, memnodes: usize, threads: usize, keys: u64) -> LocalDeployment {
    LocalDeployment::deploy(
        spec,
        &DeployOptions {
            memnodes,
            threads,
            expected_keys: keys,
            knobs: Knobs::new(),
            ..Default::default()
        },
    )
    .expect("deploy")
}

fn run(
    d: &LocalDeployment,
    keys: u64,
    ops: u64,
    threads: usize,
    tasks: usize,
    mix: Mix,
    crash_at: Option<u64>,
) -> Run {
    let ep0 = d.endpoint(0);
    let t0 = Instant::now();
    for chunk in (0..keys).collect::<Vec<_>>().chunks(100_000) {
        let pairs: Vec<(u64, Vec<u8>)> = chunk
            .iter()
            .map(|&i| (key(i), make_value(key(i), 0, 8)))
            .collect();
        block_on(labeled(OpKind::Load, d.engine.load(&ep0, &pairs))).expect("load");
    }
    eprintln!("  loaded {keys} keys in {:.2}s", t0.elapsed().as_secs_f64());
    let present = AtomicU64::new(keys);
    let next_new = AtomicU64::new(keys);
    let issued = AtomicU64::new(0);
    let completed = AtomicU64::new(0);
    let gets = AtomicU64::new(0);
    let inserts = AtomicU64::new(0);
    let timeline = Mutex::new(Vec::new());
    let counters = Mutex::new(CounterTable::default());
    let errors = Mutex::new(Vec::<String>::new());
    let start = Instant::now();
    std::thread::scope(|s| {
        {
            let (completed, timeline) = (&completed, &timeline);
            s.spawn(move || {
                let mut last = 0;
                while last < ops {
                    std::thread::sleep(std::time::Duration::from_millis(250));
                    let now = completed.load(Ordering::Relaxed);
                    timeline.lock().push(now - last);
                    last = now;
                }
            });
        }
        if let Some(at) = crash_at {
            let (issued, d) = (&issued, d);
            s.spawn(move || {
                while issued.load(Ordering::Relaxed) < at {
                    std::thread::yield_now();
                }
                eprintln!("  crashing memory node 1");
                d.cluster.crash(d.runtimes[1].id());
            });
        }
        for t in 0..threads {
            let (present, next_new, issued, counters, errors) =
                (&present, &next_new, &issued, &counters, &errors);
            let (completed, gets, inserts) = (&completed, &gets, &inserts);
            s.spawn(move || {
                let (ep, store) = d.client(t).expect("client");
                let store = &*store;
                let tasks: Vec<LocalTask<'_, ()>> = (0..tasks)
                    .map(|j| {
                        Box::pin(async move {
                            let mut x = (t * 1000 + j) as u64 + 1;
                            loop {
                                let n = issued.fetch_add(1, Ordering::Relaxed);
                                if n >= ops {
                                    return;
                                }
                                x = dmkv_outback::hash::mix64(x);
                                let insert = matches!(mix, Mix::Inserts(p) if x % 100 < p);
                                if insert {
                                    inserts.fetch_add(1, Ordering::Relaxed);
                                    let i = next_new.fetch_add(1, Ordering::Relaxed);
                                    let k = key(i);
                                    match labeled(
                                        OpKind::Insert,
                                        store.insert(k, &make_value(k, 0, 8)),
                                    )
                                    .await
                                    {
                                        Ok(true) => {
                                            present.fetch_max(i + 1, Ordering::Relaxed);
                                        }
                                        other => {
                                            errors.lock().push(format!("insert {k:#x}: {other:?}"))
                                        }
                                    }
                                } else {
                                    gets.fetch_add(1, Ordering::Relaxed);
                                    // Uniform over keys loaded or inserted
                                    // before (some inserts may still be in
                                    // flight: absent is then allowed).
                                    let bound = present.load(Ordering::Relaxed);
                                    let i = (x >> 8) % bound;
                                    let k = key(i);
                                    match labeled(OpKind::Get, store.get(k)).await {
                                        Ok(Some(v)) => {
                                            if check_value(k, &v) != Ok(0) {
                                                errors
                                                    .lock()
                                                    .push(format!("get {k:#x}: bad value"));
                                            }
                                        }
                                        Ok(None) if i >= keys => {}
                                        other => {
                                            errors.lock().push(format!("get {k:#x}: {other:?}"))
                                        }
                                    }
                                }
                                completed.fetch_add(1, Ordering::Relaxed);
                            }
                        }) as LocalTask<'_, ()>
                    })
                    .collect();
                run_tasks(tasks);
                counters.lock().merge(&ep.counters());
            });
        }
    });
    let secs = start.elapsed().as_secs_f64();
    let errors = errors.into_inner();
    if !errors.is_empty() {
        panic!("{} errors; first: {}", errors.len(), errors[0]);
    }
    // Verify: every key that should exist is read back.
    let total = next_new.load(Ordering::Relaxed);
    let (_ep, store) = d.client(0).expect("client");
    let missing = block_on(async {
        let mut missing = 0;
        for i in 0..total {
            let k = key(i);
            match labeled(OpKind::Verify, store.get(k))
                .await
                .expect("verify get")
            {
                Some(v) if check_value(k, &v) == Ok(0) => {}
                _ => missing += 1,
            }
        }
        missing
    });
    let stats = block_on(d.engine.stats(&ep0)).unwrap_or_default();
    Run {
        ops,
        gets: gets.load(Ordering::Relaxed),
        inserts: inserts.load(Ordering::Relaxed),
        timeline: timeline.into_inner(),
        secs,
        counters: counters.into_inner(),
        stats,
        cache: d.engine.client_cache_bytes(),
        missing,
    }
}

fn per_insert(r: &Run) -> String {
    let c = r.counters.get(OpKind::Insert);
    let n = r.inserts.max(1) as f64;
    format!(
        "per INSERT ({}): rpcs {:.3} round_trips {:.3} verbs {:.3} memnode_cpu_ns {:.0}",
        r.inserts,
        c.rpcs as f64 / n,
        c.round_trips as f64 / n,
        c.verbs as f64 / n,
        c.memnode_cpu_ns as f64 / n
    )
}

fn report(name: &str, r: &Run) {
    let c = r.counters.get(OpKind::Get);
    let g = r.gets.max(1) as f64;
    println!(
        "{name:10} {:>10.0} ops/s  per GET ({}): rpcs {:.3} round_trips {:.3} verbs {:.3} bytes_read {:.1} memnode_cpu_ns {:.0}  client_cache_bytes {}  verify: {} missing",
        r.ops as f64 / r.secs,
        r.gets,
        c.rpcs as f64 / g,
        c.round_trips as f64 / g,
        c.verbs as f64 / g,
        c.bytes_read as f64 / g,
        c.memnode_cpu_ns as f64 / g,
        r.cache,
        r.missing,
    );
}

fn outback_figures(r: &Run) {
    let s = &r.stats;
    let f = |k: &str| s[k].as_f64().unwrap_or(0.0);
    println!(
        "  outback: keys {} load_factor {:.3} client_bits_per_key {:.2} (paper {:.2}) makeup_gets {} reseeds {} overflow_keys {}",
        s["keys"],
        f("load_factor"),
        f("client_bits_per_key"),
        f("paper_bits_per_key"),
        s["makeup_gets"],
        s["reseeds"],
        s["overflow_keys"],
    );
    println!(
        "  resizes {} (ms total {:.1}, max {:.1}, until fetched {:.1}), requests served during resizes {} ({:.0}/s); full builds {} ({:.1} ms)",
        s["resizes"],
        f("resize_ms_total"),
        f("resize_ms_max"),
        f("resize_until_fetched_ms_total"),
        s["requests_during_resize"],
        f("requests_per_s_during_resize"),
        s["full_builds"],
        f("full_build_ms_total"),
    );
    println!(
        "  takeovers {} ({:.1} ms, {} keys recovered), failovers {}, replica verbs {} bytes {}",
        s["takeovers"],
        f("takeover_ms"),
        s["recovered_keys"],
        s["failovers"],
        s["replica_verbs"],
        s["replica_bytes"],
    );
    println!("  ops per 250 ms window: {:?}", r.timeline);
}

fn main() {
    let mut args = std::env::args().skip(1);
    let what = args.next().unwrap_or_else(|| "c".into());
    let mut num = |d: u64| args.next().map_or(d, |a| a.parse().expect("a number"));
    let keys = num(1_000_000);
    let ops = num(1_000_000);
    let threads = num(1) as usize;
    let tasks = num(2) as usize;
    println!("workload {what}: keys {keys} ops {ops} threads {threads} tasks {tasks}");
    match what.as_str() {
        "c" => {
            let d = deploy(&dmkv_outback::SPEC, 1, threads, keys);
            let o = run(&d, keys, ops, threads, tasks, Mix::Reads, None);
            report("outback", &o);
            outback_figures(&o);
            drop(d);
            let d = deploy(&dmkv_rpc_btree::SPEC, 1, threads, keys);
            let b = run(&d, keys, ops, threads, tasks, Mix::Reads, None);
            report("rpc-btree", &b);
            let cpu = |r: &Run| r.counters.get(OpKind::Get).memnode_cpu_ns as f64 / ops as f64;
            println!(
                "outback / rpc-btree: throughput {:.2}x, memnode CPU per GET {:.2}x",
                (o.ops as f64 / o.secs) / (b.ops as f64 / b.secs),
                cpu(&o) / cpu(&b)
            );
        }
        "d" | "insert" | "crash" => {
            let (mix, memnodes, crash) = match what.as_str() {
                "d" => (Mix::Inserts(5), 1, None),
                "insert" => (Mix::Inserts(100), 1, None),
                _ => (Mix::Inserts(5), 3, Some(ops / 3)),
            };
            let d = deploy(&dmkv_outback::SPEC, memnodes, threads, keys + ops);
            let r = run(&d, keys, ops, threads, tasks, mix, crash);
            report("outback", &r);
            println!("  {}", per_insert(&r));
            outback_figures(&r);
        }
        other => panic!("unknown workload {other}"),
    }
}
