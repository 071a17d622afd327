//! The transport's data path on the local backend: what one one-sided read,
//! a batch of four reads and one RPC round trip cost the issuing thread
//! (`cargo bench -p dmkv-transport`). Each iteration is one `block_on`, so
//! the figures include the executor's poll and the one yield every round
//! trip makes; a slower verb, executor or RPC path shows up here.

use criterion::{Criterion, criterion_group, criterion_main};
use dmkv_transport::exec::block_on;
use dmkv_transport::local::{LocalCluster, LocalConfig};
use dmkv_transport::{NodeHost, RpcContext, ServiceError, ServiceId};
use std::hint::black_box;
use std::sync::Arc;

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
}

fn rpc(c: &mut Criterion) {
    let cluster = LocalCluster::new(LocalConfig::default());
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
    c.bench_function("rpc round trip, empty handler", |b| {
        b.iter(|| block_on(ep.call(node, black_box(empty), Vec::new())).unwrap())
    });
    let after = ep.total_counters();
    let rpcs = after.rpcs - before.rpcs;
    eprintln!(
        "empty handler: {rpcs} RPCs, memory-node CPU charged {:.0} ns per RPC \
         (of which the mean sampled reply send: {} ns)",
        (after.memnode_cpu_ns - before.memnode_cpu_ns) as f64 / rpcs.max(1) as f64,
        server.services().mean_reply_send_ns()
    );
}

criterion_group!(benches, one_sided, rpc);
criterion_main!(benches);
