//! Engines over UCX: a memory node with the admin service, an engine
//! installed on it by name with serialised serve arguments, clients on
//! several compute threads, node stats through the stats service, and the
//! instance removed when the deployment ends.

#![cfg(feature = "ucx")]

use dmkv_api::EngineSpec;
use dmkv_api::deploy::DeployOptions;
use dmkv_testkit::reference::Reference;
use dmkv_transport::NodeId;
use dmkv_transport::exec::block_on;
use dmkv_transport_ucx::UcxConfig;
use dmkv_transport_ucx::deploy::{Memnode, MemnodeOptions, UcxDeployOptions, UcxDeployment};
use std::sync::Arc;

const ENGINES: &[&dyn EngineSpec] = &[
    &Reference,
    &dmkv_cell::CellSpec,
    &dmkv_rpc_btree::RpcBtreeSpec,
];

fn lookup() -> dmkv_transport_ucx::deploy::EngineLookup {
    Arc::new(|name: &str| ENGINES.iter().copied().find(|e| e.name() == name))
}

fn memnode(id: u16, config: &UcxConfig) -> Memnode {
    Memnode::start(
        &MemnodeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            node: NodeId(id),
            handler_threads: 1,
            pool_bytes: None,
            data_dir: None,
            config: config.clone(),
        },
        lookup(),
    )
    .unwrap()
}

#[test]
fn an_engine_installed_by_name_serves_clients_and_goes_away() {
    for config in [
        UcxConfig::tcp_loopback(b"deploy".to_vec()),
        UcxConfig::shm_loopback(b"deploy".to_vec()),
    ] {
        let m0 = memnode(0, &config);
        let mut ucx = UcxDeployOptions::new(config.clone());
        ucx.memnodes = vec![m0.listen_addr().to_string()];
        let dep = UcxDeployment::deploy(
            &Reference,
            &DeployOptions {
                threads: 2,
                ..DeployOptions::default()
            },
            &ucx,
        )
        .unwrap();
        let installed = m0.runtime.host().services().service_names();
        assert!(
            installed.iter().any(|n| n.starts_with(&dep.args.instance)),
            "{installed:?}"
        );
        std::thread::scope(|s| {
            for t in 0..2u64 {
                let dep = &dep;
                s.spawn(move || {
                    let (_ep, kv) = dep.client(t as usize).unwrap();
                    block_on(async {
                        for k in 0..100u64 {
                            let key = k * 2 + t;
                            assert!(kv.insert(key, &key.to_le_bytes()).await.unwrap());
                            assert_eq!(
                                kv.get(key).await.unwrap(),
                                Some(key.to_le_bytes().to_vec())
                            );
                        }
                    });
                });
            }
        });
        let (_ep, kv) = dep.client(0).unwrap();
        let all = block_on(kv.scan(0, 1000)).unwrap();
        assert_eq!(all.len(), 200);
        let stats = dep.node_stats();
        assert_eq!(stats.len(), 1);
        assert!(stats[0].rpcs_served >= 400, "{stats:?}");
        let instance = dep.args.instance.clone();
        drop(kv);
        drop(_ep);
        drop(dep);
        let left = m0.runtime.host().services().service_names();
        assert!(!left.iter().any(|n| n.starts_with(&instance)), "{left:?}");
    }
}

#[test]
fn unknown_engines_and_wrong_secrets_are_refused() {
    let config = UcxConfig::tcp_loopback(b"deploy".to_vec());
    let m0 = memnode(0, &config);
    // A memory node that does not know the engine refuses to install it.
    let none: dmkv_transport_ucx::deploy::EngineLookup = Arc::new(|_: &str| None);
    let m1 = Memnode::start(
        &MemnodeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            node: NodeId(1),
            handler_threads: 1,
            pool_bytes: None,
            data_dir: None,
            config: config.clone(),
        },
        none,
    )
    .unwrap();
    let mut ucx = UcxDeployOptions::new(config.clone());
    ucx.memnodes = vec![m1.listen_addr().to_string()];
    let e = UcxDeployment::deploy(&Reference, &DeployOptions::default(), &ucx)
        .err()
        .unwrap();
    assert!(e.to_string().contains("no engine named"), "{e}");
    let mut ucx = UcxDeployOptions::new(UcxConfig::tcp_loopback(b"not it".to_vec()));
    ucx.memnodes = vec![m0.listen_addr().to_string()];
    let e = UcxDeployment::deploy(&Reference, &DeployOptions::default(), &ucx)
        .err()
        .unwrap();
    assert!(e.to_string().contains("secret"), "{e}");
}

/// Engines that read one-sided (cell: one-sided traversal with a cache of
/// upper levels; writes by rpc-btree's service) and by RPC, over TCP (verbs
/// as messages) and shared memory (direct), from two compute threads, with
/// every value checked and a scan over all keys.
#[test]
fn one_sided_and_rpc_engines_run_unchanged() {
    for config in [
        UcxConfig::tcp_loopback(b"deploy".to_vec()),
        UcxConfig::shm_loopback(b"deploy".to_vec()),
    ] {
        for spec in [
            &dmkv_cell::CellSpec as &dyn EngineSpec,
            &dmkv_rpc_btree::RpcBtreeSpec,
        ] {
            let m0 = memnode(0, &config);
            let mut ucx = UcxDeployOptions::new(config.clone());
            ucx.memnodes = vec![m0.listen_addr().to_string()];
            let dep = UcxDeployment::deploy(
                spec,
                &DeployOptions {
                    threads: 2,
                    expected_keys: 4000,
                    ..DeployOptions::default()
                },
                &ucx,
            )
            .unwrap();
            let (ep0, kv0) = dep.client(0).unwrap();
            let pairs: Vec<(u64, Vec<u8>)> = (1..=1000u64)
                .map(|k| (k * 7, (k * 7).to_le_bytes().to_vec()))
                .collect();
            block_on(dep.engine.load(&ep0, &pairs)).unwrap();
            std::thread::scope(|s| {
                for t in 0..2u64 {
                    let dep = &dep;
                    s.spawn(move || {
                        let (_ep, kv) = dep.client(t as usize).unwrap();
                        block_on(async {
                            for k in 1..=1000u64 {
                                let key = k * 7;
                                let got = kv.get(key).await.unwrap();
                                assert_eq!(got, Some(key.to_le_bytes().to_vec()), "{key}");
                            }
                            for k in 0..150u64 {
                                let key = 100_000 + k * 2 + t;
                                assert!(kv.insert(key, &key.to_le_bytes()).await.unwrap());
                            }
                        });
                    });
                }
            });
            let all = block_on(kv0.scan(0, 10_000)).unwrap();
            assert_eq!(all.len(), 1300, "{}", spec.name());
            assert!(all.windows(2).all(|w| w[0].0 < w[1].0));
            for (k, v) in &all {
                assert_eq!(v, &k.to_le_bytes().to_vec());
            }
            let verbs = ep0.counters().sum(&dmkv_transport::OpKind::ALL);
            eprintln!(
                "{} over {:?}: client 0 used {} verbs and {} rpcs; {:?}",
                spec.name(),
                config.tls,
                verbs.verbs,
                verbs.rpcs,
                dep.cluster().stats()
            );
        }
    }
}
