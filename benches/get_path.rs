//! Each engine's GET path on the local backend (`cargo bench -p dmkv --bench
//! get_path`): an engine is deployed with one memory node and one handler
//! thread, loaded with 20,000 keys of 8-byte values, and every iteration is
//! one GET of a present key issued by a single task (so it includes the
//! engine's round trips, the API wrapper and the executor). Engine names can
//! be narrowed with criterion's filter, e.g. `-- get/rolex`.

use criterion::{Criterion, criterion_group, criterion_main};
use dmkv_api::EngineSpec;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::make_value;
use dmkv_transport::exec::block_on;
use dmkv_transport::{OpKind, labeled};
use std::hint::black_box;

const KEYS: u64 = 20_000;

fn key(i: u64) -> u64 {
    // Spread keys over the key space, away from reserved extremes.
    (i + 1).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 1
}

fn get_path(c: &mut Criterion) {
    let engines: [&dyn EngineSpec; 8] = [
        &dmkv_rolex::SPEC,
        &dmkv_xstore::SPEC,
        &dmkv_outback::SPEC,
        &dmkv_race::SPEC,
        &dmkv_sherman::SPEC,
        &dmkv_rpc_hash::SPEC,
        &dmkv_rpc_btree::SPEC,
        &dmkv_cell::SPEC,
    ];
    for spec in engines {
        let dep = LocalDeployment::deploy(
            spec,
            &DeployOptions {
                expected_keys: KEYS,
                ..DeployOptions::default()
            },
        )
        .expect("deploy");
        let ep = dep.endpoint(0);
        let mut pairs: Vec<(u64, Vec<u8>)> = (0..KEYS)
            .map(|i| (key(i), make_value(key(i), 1, 8)))
            .collect();
        pairs.sort_by_key(|p| p.0);
        // One bulk load (ROLEX rewrites its leaves on every load call).
        block_on(labeled(OpKind::Load, dep.engine.load(&ep, &pairs))).expect("load");
        block_on(labeled(OpKind::Load, dep.engine.settle(&ep))).expect("settle");
        let (_ep, kv) = dep.client(0).expect("client");
        let mut i = 0u64;
        c.bench_function(&format!("get/{}", spec.name()), |b| {
            b.iter(|| {
                i = (i + 7919) % KEYS;
                let v = block_on(kv.get(black_box(key(i)))).expect("get");
                assert!(v.is_some(), "key {i} was loaded");
                v
            })
        });
    }
}

criterion_group!(benches, get_path);
criterion_main!(benches);
