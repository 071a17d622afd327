#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! The workload change of the paper's §6.5 / Fig. 9 ("cache follows
//! workload shifts"): the pages are split into one partition per node,
//! allocated on that node (which is therefore their directory and first
//! holder). In phase 0 every node's worker accesses only its own partition;
//! at every phase boundary the partitions are reassigned, node `i` moving
//! to partition `(i + phase) % nodes`, so every worker's hot set suddenly
//! lies in another node's cache.
//!
//! Every `--interval-ms` the example samples the engine's counters and
//! prints, per interval: operations per second, the share of page fixes
//! served on the local hot path, pages sent between nodes (remote-memory
//! fetches), pages read from the SSDs and evictions, per second. The
//! adaptation is visible as the local share dropping and remote fetches
//! jumping at each shift, then decaying as the pages move to (or are
//! copied into) the caches of their new users and the page providers evict
//! the previous partition.
//!
//! ```text
//! cargo run --release -p dmkv-scalestore --example shift -- [--nodes 3] [--pages 2000] [--cache-pages 3000] [--phases 3] [--phase-seconds 2] [--interval-ms 250] [--write-percent 0]
//! ```
//!
//! `--pages` is per partition; `--cache-pages` per node. With a cache
//! smaller than two partitions a node cannot keep its old partition next to
//! the new one, so each shift also exercises eviction. Updates increment a
//! counter in the page; at the end the example checks that every increment
//! is in the pages.

use dmkv_api::Knobs;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_scalestore::SCALESTORE;
use dmkv_scalestore::engine::served_nodes;
use dmkv_scalestore::guard::{ExclusiveGuard, SharedGuard};
use dmkv_scalestore::node::ScaleNode;
use dmkv_scalestore::pid::Pid;
use dmkv_scalestore::worker::Worker;
use dmkv_transport::exec::block_on;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

struct Args {
    nodes: usize,
    pages: usize,
    cache_pages: usize,
    phases: usize,
    phase_seconds: f64,
    interval_ms: u64,
    write_percent: u32,
    protocol: String,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        nodes: 3,
        pages: 2000,
        cache_pages: 3000,
        phases: 3,
        phase_seconds: 2.0,
        interval_ms: 250,
        write_percent: 0,
        protocol: "chaining".into(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--help" || flag == "-h" {
            return Err("flags: --nodes N --pages PER_PARTITION --cache-pages PER_NODE --phases N --phase-seconds S --interval-ms MS --write-percent P --protocol chaining|fifo".into());
        }
        let v = it.next().ok_or_else(|| format!("{flag} needs a value"))?;
        let bad = |e: &dyn std::fmt::Display| format!("{flag} {v}: {e}");
        match flag.as_str() {
            "--nodes" => a.nodes = v.parse().map_err(|e| bad(&e))?,
            "--pages" => a.pages = v.parse().map_err(|e| bad(&e))?,
            "--cache-pages" => a.cache_pages = v.parse().map_err(|e| bad(&e))?,
            "--phases" => a.phases = v.parse().map_err(|e| bad(&e))?,
            "--phase-seconds" => a.phase_seconds = v.parse().map_err(|e| bad(&e))?,
            "--interval-ms" => a.interval_ms = v.parse().map_err(|e| bad(&e))?,
            "--write-percent" => a.write_percent = v.parse().map_err(|e| bad(&e))?,
            "--protocol" => a.protocol = v,
            _ => return Err(format!("unknown flag {flag}")),
        }
    }
    if a.nodes < 2 || a.pages == 0 || a.phases == 0 || a.interval_ms == 0 || a.write_percent > 100 {
        return Err("needs at least 2 nodes, 1 page, 1 phase, an interval and a percentage".into());
    }
    Ok(a)
}

/// The counters the report samples, summed over nodes.
#[derive(Clone, Copy, Default)]
struct Sample {
    ops: u64,
    fixes: u64,
    hot: u64,
    remote: u64,
    ssd: u64,
    evictions: u64,
}

fn sample(nodes: &[Arc<ScaleNode>], ops: u64) -> Sample {
    let ld = |c: &AtomicU64| c.load(Ordering::Relaxed);
    let mut s = Sample {
        ops,
        ..Default::default()
    };
    for n in nodes {
        s.fixes += ld(&n.stats.fixes);
        s.hot += ld(&n.stats.hot);
        s.remote += ld(&n.stats.pages_remote);
        s.ssd += ld(&n.stats.pages_ssd);
        s.evictions += ld(&n.stats.evictions);
    }
    s
}

fn run(a: &Args) -> Result<(), String> {
    let mut knobs = Knobs::new();
    knobs.set("protocol", &a.protocol);
    knobs.set("alloc", "local");
    knobs.set("cache_pages", &a.cache_pages.to_string());
    let d = LocalDeployment::deploy(
        &SCALESTORE,
        &DeployOptions {
            nodes: a.nodes,
            threads: a.nodes,
            cache_mb: 16,
            knobs,
            ..Default::default()
        },
    )
    .map_err(|e| e.to_string())?;
    let nodes = served_nodes(&d.runtimes, &d.args);
    // Partition i: pages allocated on node i (alloc=local), so node i is
    // their directory and holds them when the run starts.
    let mut parts: Vec<Vec<Pid>> = Vec::new();
    for n in &nodes {
        let w = Worker::new(
            n.clone(),
            Rc::new(n.fabric.endpoint(n.id).map_err(|e| e.to_string())?),
        );
        parts.push(block_on(async {
            let mut v = Vec::with_capacity(a.pages);
            for _ in 0..a.pages {
                v.push(
                    ExclusiveGuard::allocate(&w)
                        .await
                        .map_err(|e| format!("{e:?}"))?
                        .pid(),
                );
            }
            Ok::<_, String>(v)
        })?);
    }
    let phase = AtomicUsize::new(0);
    let stop = AtomicBool::new(false);
    let ops = AtomicU64::new(0);
    let updates = AtomicU64::new(0);
    let barrier = std::sync::Barrier::new(nodes.len() + 1);
    println!(
        "{} nodes, {} pages per partition, {} cache pages per node, {} % updates, {}, {} phases of {:.1} s",
        a.nodes, a.pages, a.cache_pages, a.write_percent, a.protocol, a.phases, a.phase_seconds
    );
    println!(
        "{:>6} {:>5} {:>9} {:>11} {:>14} {:>10} {:>12}",
        "t s", "phase", "ops/s", "local share", "remote pages/s", "ssd reads/s", "evictions/s"
    );
    std::thread::scope(|s| {
        for (i, node) in nodes.iter().enumerate() {
            let (parts, phase, stop, ops, updates, barrier) =
                (&parts, &phase, &stop, &ops, &updates, &barrier);
            s.spawn(move || {
                let w = Worker::new(
                    node.clone(),
                    Rc::new(node.fabric.endpoint(node.id).expect("endpoint")),
                );
                let mut rng = SmallRng::seed_from_u64(i as u64);
                barrier.wait();
                block_on(async {
                    while !stop.load(Ordering::Relaxed) {
                        let part = &parts[(i + phase.load(Ordering::Relaxed)) % parts.len()];
                        let pid = part[rng.gen_range(0..part.len())];
                        if rng.gen_range(0..100) < a.write_percent {
                            let g = ExclusiveGuard::fix(&w, pid).await.expect("fix");
                            let p = g.page();
                            p.set_word(0, p.word(0).expect("word") + 1);
                            updates.fetch_add(1, Ordering::Relaxed);
                        } else {
                            let g = SharedGuard::fix(&w, pid).await.expect("fix");
                            std::hint::black_box(g.page().word(0).expect("word"));
                        }
                        ops.fetch_add(1, Ordering::Relaxed);
                    }
                });
            });
        }
        barrier.wait();
        let start = Instant::now();
        let interval = Duration::from_millis(a.interval_ms);
        let per_phase = (a.phase_seconds * 1000.0 / a.interval_ms as f64)
            .round()
            .max(1.0) as usize;
        let mut prev = sample(&nodes, ops.load(Ordering::Relaxed));
        let mut t_prev = start;
        for tick in 1..=per_phase * a.phases {
            std::thread::sleep(
                (start + interval * tick as u32).saturating_duration_since(Instant::now()),
            );
            let now = Instant::now();
            let cur = sample(&nodes, ops.load(Ordering::Relaxed));
            let dt = now.duration_since(t_prev).as_secs_f64();
            let fixes = cur.fixes - prev.fixes;
            println!(
                "{:>6.2} {:>5} {:>9.0} {:>11.3} {:>14.0} {:>10.0} {:>12.0}",
                now.duration_since(start).as_secs_f64(),
                phase.load(Ordering::Relaxed),
                (cur.ops - prev.ops) as f64 / dt,
                if fixes == 0 {
                    0.0
                } else {
                    (cur.hot - prev.hot) as f64 / fixes as f64
                },
                (cur.remote - prev.remote) as f64 / dt,
                (cur.ssd - prev.ssd) as f64 / dt,
                (cur.evictions - prev.evictions) as f64 / dt,
            );
            (prev, t_prev) = (cur, now);
            if tick % per_phase == 0 && tick < per_phase * a.phases {
                phase.fetch_add(1, Ordering::Relaxed);
                println!(
                    "-- shift: node i now accesses partition (i + {}) % {}",
                    tick / per_phase,
                    a.nodes
                );
            }
        }
        stop.store(true, Ordering::Relaxed);
    });
    // Every update is in the pages.
    let w = Worker::new(
        nodes[0].clone(),
        Rc::new(
            nodes[0]
                .fabric
                .endpoint(nodes[0].id)
                .map_err(|e| e.to_string())?,
        ),
    );
    let counted: u64 = block_on(async {
        let mut c = 0;
        for pid in parts.iter().flatten() {
            c += SharedGuard::fix(&w, *pid)
                .await
                .expect("fix")
                .page()
                .word(0)
                .expect("word");
        }
        c
    });
    let made = updates.load(Ordering::Relaxed);
    if counted != made {
        return Err(format!("{counted} increments in the pages, {made} made"));
    }
    let stats = block_on(d.engine.stats(&d.endpoint(0))).map_err(|e| e.to_string())?;
    println!(
        "check ok: {made} updates all in the pages; totals: {} page fixes, {} pages between nodes, {} SSD reads, {} evictions",
        stats["page_fixes"],
        stats["pages_from_remote_memory"],
        stats["pages_from_ssd"],
        stats["evictions"]
    );
    Ok(())
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("shift: {e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&a) {
        eprintln!("shift: {e}");
        std::process::exit(1);
    }
}
