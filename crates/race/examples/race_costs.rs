//! Per-operation costs of RACE and of the RPC-Cluster baseline (`rpc-hash`)
//! on YCSB-C-like (GETs) and YCSB-A-like (50% updates) runs, in process, from
//! the transport's exact counters, until the bench harness lands:
//! `cargo run --release -p dmkv-race --example race_costs [keys] [ops]`.

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::{check_value, make_value};
use dmkv_api::{EngineSpec, Knobs};
use dmkv_transport::exec::block_on;
use dmkv_transport::{OpKind, labeled};

/// Loads `keys` keys, warms up, then runs `ops` operations (`read` percent
/// GETs, `update` percent UPDATEs, the rest INSERTs of new keys) on one
/// client, uniform over the keys, checking every value read; prints the
/// per-operation counters by kind and the engine's stats.
fn run(spec: &dyn EngineSpec, name: &str, mix: (u64, u64), keys: u64, ops: u64) {
    let d = LocalDeployment::deploy(
        spec,
        &DeployOptions {
            knobs: Knobs::new(),
            expected_keys: keys + ops,
            ..Default::default()
        },
    )
    .expect("deploy");
    let key = |i: u64| 1 + i * 0x9E37_79B9;
    let pairs: Vec<(u64, Vec<u8>)> = (0..keys)
        .map(|i| (key(i), make_value(key(i), 0, 8)))
        .collect();
    let ep0 = d.endpoint(0);
    block_on(labeled(OpKind::Load, d.engine.load(&ep0, &pairs))).expect("load");
    let (ep, s) = d.client(0).expect("client");
    block_on(async {
        for (k, _) in pairs.iter().step_by(7) {
            s.get(*k).await.expect("warm-up get");
        }
    });
    ep.reset_counters();
    let mut next_new = keys;
    block_on(async {
        for i in 0..ops {
            let k = key((i * 7919) % keys);
            let dice = (i * 37) % 100;
            if dice < mix.0 {
                let v = labeled(OpKind::Get, s.get(k))
                    .await
                    .expect("get")
                    .expect("present");
                check_value(k, &v).expect("a self-checking value");
            } else if dice < mix.0 + mix.1 {
                let ok = labeled(OpKind::Update, s.update(k, &make_value(k, 1 + i as u32, 8)))
                    .await
                    .expect("update");
                assert!(ok);
            } else {
                let n = key(next_new);
                next_new += 1;
                let ok = labeled(OpKind::Insert, s.insert(n, &make_value(n, 0, 8)))
                    .await
                    .expect("insert");
                assert!(ok);
            }
        }
    });
    let t = ep.counters();
    for kind in [OpKind::Get, OpKind::Update, OpKind::Insert] {
        let c = t.get(kind);
        let n = match kind {
            OpKind::Get => (0..ops).filter(|i| (i * 37) % 100 < mix.0).count(),
            OpKind::Update => (0..ops)
                .filter(|i| (i * 37) % 100 >= mix.0 && (i * 37) % 100 < mix.0 + mix.1)
                .count(),
            _ => (0..ops).filter(|i| (i * 37) % 100 >= mix.0 + mix.1).count(),
        } as f64;
        if n == 0.0 {
            continue;
        }
        println!(
            "{:8} {:6} {:7}: round_trips {:.2} rpcs {:.2} verbs {:.2} bytes_read {:.1} bytes_written {:.1} memnode_cpu_ns {:.0}",
            spec.name(),
            name,
            kind.name(),
            c.round_trips as f64 / n,
            c.rpcs as f64 / n,
            c.verbs as f64 / n,
            c.bytes_read as f64 / n,
            c.bytes_written as f64 / n,
            c.memnode_cpu_ns as f64 / n,
        );
    }
    println!(
        "{:8} {:6} client_cache_bytes {} engine_stats {}",
        spec.name(),
        name,
        d.engine.client_cache_bytes(),
        block_on(d.engine.stats(&ep0)).expect("stats")
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let keys: u64 = args.next().map_or(100_000, |a| a.parse().expect("keys"));
    let ops: u64 = args.next().map_or(20_000, |a| a.parse().expect("ops"));
    for (name, mix) in [("ycsb-c", (100, 0)), ("ycsb-a", (50, 50))] {
        run(&dmkv_race::SPEC, name, mix, keys, ops);
        run(&dmkv_rpc_hash::SPEC, name, mix, keys, ops);
    }
}
