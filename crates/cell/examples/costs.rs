//! Per-operation costs of the two XTree baselines on a YCSB-C-like run
//! (uniform GETs over loaded keys), in process, from the transport's exact
//! counters. `cargo run -p dmkv-cell --example costs [keys] [gets]`.

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::{EngineSpec, Knobs};
use dmkv_transport::exec::block_on;
use dmkv_transport::{OpKind, labeled};

fn run(spec: &dyn EngineSpec, knobs: &[(&str, &str)], keys: u64, gets: u64) {
    let mut k = Knobs::new();
    for (n, v) in knobs {
        k.set(n, v);
    }
    let d = LocalDeployment::deploy(
        spec,
        &DeployOptions {
            knobs: k,
            expected_keys: keys,
            ..Default::default()
        },
    )
    .expect("deploy");
    let ep0 = d.endpoint(0);
    let pairs: Vec<(u64, Vec<u8>)> = (0..keys)
        .map(|i| {
            (
                i * 0x9E37_79B9,
                dmkv_api::payload::make_value(i * 0x9E37_79B9, 0, 8),
            )
        })
        .collect();
    block_on(labeled(OpKind::Load, d.engine.load(&ep0, &pairs))).expect("load");
    let (ep, s) = d.client(0).expect("client");
    // Warm the client cache with one pass, as a benchmark's warm-up would.
    block_on(async {
        for (k, _) in pairs.iter().step_by(7) {
            s.get(*k).await.expect("get");
        }
    });
    ep.reset_counters();
    block_on(async {
        for i in 0..gets {
            let k = pairs[((i * 7919) % keys) as usize].0;
            let v = labeled(OpKind::Get, s.get(k))
                .await
                .expect("get")
                .expect("present");
            dmkv_api::payload::check_value(k, &v).expect("a self-checking value");
        }
    });
    let c = *ep.counters().get(OpKind::Get);
    let g = gets as f64;
    let stats = block_on(d.engine.stats(&ep0)).expect("stats");
    println!(
        "{:10} {:>24}: per GET rpcs {:.2} round_trips {:.2} verbs {:.2} bytes_read {:.1} memnode_cpu_ns {:.0}; height {} client_cache_bytes {}",
        spec.name(),
        knobs
            .iter()
            .map(|(n, v)| format!("{n}={v}"))
            .collect::<Vec<_>>()
            .join(","),
        c.rpcs as f64 / g,
        c.round_trips as f64 / g,
        c.verbs as f64 / g,
        c.bytes_read as f64 / g,
        c.memnode_cpu_ns as f64 / g,
        stats["height"],
        d.engine.client_cache_bytes(),
    );
}

fn main() {
    let mut args = std::env::args().skip(1);
    let keys: u64 = args.next().map_or(100_000, |a| a.parse().expect("keys"));
    let gets: u64 = args.next().map_or(20_000, |a| a.parse().expect("gets"));
    run(&dmkv_rpc_btree::SPEC, &[], keys, gets);
    for levels in ["4", "2", "1"] {
        run(&dmkv_cell::SPEC, &[("cached_levels", levels)], keys, gets);
    }
}
