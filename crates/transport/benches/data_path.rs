//! The transport's data path on the local backend: what one one-sided read,
//! a batch of four reads and one RPC round trip cost the issuing thread
//! (`cargo bench -p dmkv-transport`). Each iteration is one `block_on`, so
//! the figures include the executor's poll and the one yield every round
//! trip makes; a slower verb, executor or RPC path shows up here. The
//! `empty handler` bench also prints what the memory node was charged per
//! RPC (with `--features charge-breakdown`, split into its parts), and
//! `charge parts` times the charge's own readings and a cache line's round
//! trip between two threads (docs/performance.md, "Tenth pass").

use criterion::{Criterion, criterion_group, criterion_main};
use dmkv_transport::exec::block_on;
use dmkv_transport::local::{LocalCluster, LocalConfig};
use dmkv_transport::{NodeHost, RpcContext, ServiceError, ServiceId, charge, placement};
use std::hint::black_box;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

fn one_sided(c: &mut Criterion) {
    let cluster = LocalCluster::new(LocalConfig::default());
    let mem = cluster.add_node(0);
    let (region, _local) = mem.register_region(1 << 16).unwrap();
    let ep = cluster.fabric().endpoint(cluster.add_node(0).id()).unwrap();
    c.bench_function("read 8 B", |b| {
        b.iter(|| block_on(ep.read(region.at(black_box(64)), 8)).unwrap())
    });
    c.bench_function("read 256 B", |b| {
        b.iter(|| block_on(ep.read(region.at(black_box(256)), 256)).unwrap())
    });
    c.bench_function("batch of 4 reads of 64 B", |b| {
        b.iter(|| {
            block_on(async {
                let mut batch = ep.batch();
                for i in 0..4u64 {
                    batch.read(region.at(black_box(i * 512)), 64);
                }
                batch.run().await.unwrap()
            })
        })
    });
    c.bench_function("cas", |b| {
        b.iter(|| block_on(ep.cas(region.at(black_box(8)), 0, 0)).unwrap())
    });
    // A race update's verbs (docs/performance.md, twenty-fourth pass): a
    // 64-byte KV block written with two 128-byte bucket reads in one
    // batch, then the slot's CAS in a batch of its own.
    c.bench_function("write 64 B + 2 reads of 128 B, then a cas", |b| {
        let block = vec![7u8; 64];
        b.iter(|| {
            block_on(async {
                let mut batch = ep.batch();
                batch.write(region.at(black_box(4096)), block.clone());
                batch.read(region.at(black_box(8192)), 128);
                batch.read(region.at(black_box(12288)), 128);
                batch.run().await.unwrap();
                let mut cas = ep.batch();
                cas.cas(region.at(black_box(16)), 0, 0);
                cas.run().await.unwrap()
            })
        })
    });
}

/// Where the RPC benches' handler thread and calling thread run, from
/// `DMKV_BENCH_PIN`: `distinct` (each on a CPU of its own, what `dmkv bench
/// --pin-threads auto` picks when the CPUs suffice), `shared` (both on one
/// CPU) or `none` (the OS decides; the default, as before). Left to the OS,
/// the two threads share a CPU in some runs and not in others, and an
/// empty handler is charged several times more when its lines cross cores;
/// `distinct` and `shared` measure each case on its own. On a loaded host
/// `distinct` is the slow one: a pinned thread cannot move off a CPU that
/// other processes keep busy (docs/performance.md, "Twenty-first pass
/// (branch i80)").
fn rpc_placement() -> (&'static str, Option<placement::Plan>) {
    let asked = std::env::var("DMKV_BENCH_PIN").unwrap_or_default();
    match asked.as_str() {
        "none" | "" => ("none", None),
        "shared" => (
            "shared",
            Some(placement::Plan::shared().expect("DMKV_BENCH_PIN=shared")),
        ),
        "distinct" => (
            "distinct",
            Some(placement::Plan::distinct(1, 1).expect("DMKV_BENCH_PIN=distinct")),
        ),
        other => panic!("DMKV_BENCH_PIN={other}: expected distinct, shared or none"),
    }
}

fn rpc(c: &mut Criterion) {
    // The cluster puts its plan in force before the handler thread starts
    // (it pins itself as it starts serving); this thread is the compute
    // thread.
    let (placed, plan) = rpc_placement();
    let cluster = LocalCluster::new(LocalConfig {
        placement: plan,
        ..LocalConfig::default()
    });
    let pinned = placement::pin_compute(0);
    eprintln!("rpc benches: threads placed {placed} (calling thread on CPU {pinned:?})");
    let server = cluster.add_node(1);
    let echo = server
        .services()
        .register(
            "echo",
            Arc::new(
                |_: &RpcContext, req: &[u8]| -> Result<Vec<u8>, ServiceError> { Ok(req.to_vec()) },
            ),
        )
        .unwrap();
    let ep = cluster.fabric().endpoint(cluster.add_node(0).id()).unwrap();
    let node = server.id();
    c.bench_function("rpc round trip, 16 B echo", |b| {
        b.iter(|| block_on(ep.call(node, black_box(echo), vec![7; 16])).unwrap())
    });
    c.bench_function("rpc round trip, unknown service", |b| {
        b.iter(|| block_on(ep.call(node, ServiceId(9999), Vec::new())).unwrap_err())
    });
    // What the memory node is charged for an empty handler: dispatch, the
    // handler and sending the reply (the bound is 100 ns).
    let empty = server
        .services()
        .register(
            "empty",
            Arc::new(
                |_: &RpcContext, _: &[u8]| -> Result<Vec<u8>, ServiceError> { Ok(Vec::new()) },
            ),
        )
        .unwrap();
    let before = ep.total_counters();
    let charge_before = charge::summary();
    c.bench_function("rpc round trip, empty handler", |b| {
        b.iter(|| block_on(ep.call(node, black_box(empty), Vec::new())).unwrap())
    });
    let after = ep.total_counters();
    let rpcs = after.rpcs - before.rpcs;
    eprintln!(
        "empty handler: {rpcs} RPCs, memory-node CPU charged {:.1} ns per RPC",
        (after.memnode_cpu_ns - before.memnode_cpu_ns) as f64 / rpcs.max(1) as f64,
    );
    // The handler thread's chain over this bench's RPCs (its stretches end
    // when the caller stops sending).
    let s = charge::summary().since(&charge_before);
    let per = |x: f64| x / s.replies.max(1) as f64;
    eprintln!(
        "  handler chain: {} replies, charged {:.1} ns each: own work {:.1} ns, \
         send {:.1} ns; {} intervals dropped (thread off its CPU; detector \
         available: {})",
        s.replies,
        per(s.charged_ns as f64),
        per(s.work_ns),
        per(s.send_ns),
        s.dropped,
        charge::preemption_detected()
    );
    eprintln!(
        "  one counter reading, taken off each interval: {:.1} ns",
        ((charge::reading_overhead_ticks() as u128 * charge::ns_per_tick_32() as u128) >> 32)
            as f64
    );
    if s.part_samples > 0 {
        eprintln!(
            "  breakdown over {} RPCs (feature charge-breakdown):",
            s.part_samples
        );
        for (name, ns) in charge::PARTS.iter().zip(s.parts_ns) {
            eprintln!("    {name:28} {:7.1} ns", ns / s.part_samples as f64);
        }
    }
}

/// What the charge's own pieces cost on this host, and the floor under any
/// RPC between two cores: one cache line's round trip between two threads.
fn charge_parts(c: &mut Criterion) {
    c.bench_function("charge parts: rdtsc", |b| b.iter(charge::ticks));
    c.bench_function("charge parts: lfence + rdtsc", |b| {
        b.iter(charge::ticks_fenced)
    });
    c.bench_function("charge parts: reading and rseq arm (note_poll)", |b| {
        b.iter(charge::note_poll)
    });
    c.bench_function("charge parts: thread CPU clock (clock_gettime)", |b| {
        b.iter(dmkv_transport::thread_cpu_ns)
    });
    // Two threads pass one counter back and forth through one line: each
    // iteration is a line moved to the other core and back (two transfers),
    // the least an RPC between two cores can cost the two of them.
    let line = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let echo = {
        let (line, stop) = (line.clone(), stop.clone());
        std::thread::spawn(move || {
            let mut seen = 0;
            while !stop.load(Ordering::Relaxed) {
                let v = line.load(Ordering::Acquire);
                if v != seen && v % 2 == 1 {
                    seen = v + 1;
                    line.store(seen, Ordering::Release);
                } else {
                    std::hint::spin_loop();
                }
            }
        })
    };
    let mut next = 1u64;
    c.bench_function(
        "charge parts: cache line round trip between two threads",
        |b| {
            b.iter(|| {
                line.store(next, Ordering::Release);
                while line.load(Ordering::Acquire) != next + 1 {
                    std::hint::spin_loop();
                }
                next += 2;
            })
        },
    );
    stop.store(true, Ordering::Relaxed);
    echo.join().unwrap();
}

criterion_group!(benches, one_sided, rpc, charge_parts);
criterion_main!(benches);
