//! A GET over `local` builds its request in the endpoint's kept request
//! buffer and gives the reply's buffer back (branch i87): once warm, a GET
//! of an absent key allocates nothing on the client's thread. (Built with
//! `WireWriter::new`, each GET allocated its request twice: the empty
//! `Vec`'s first push and the key's growth. A GET of a present key
//! allocates its value and, on `local`, a reply buffer: two per GET here,
//! not asserted: the reply's buffer is the transport's.)
//!
//! A GET of a present key hands its value over in the reply's buffer and
//! takes it back with `recycle` (branch i103): once warm, such a GET whose
//! value is recycled allocates nothing either (with the value copied out
//! of the reply, one allocation per GET).
//!
//! Allocations are counted per thread by a global allocator wrapping the
//! system's (this test binary only): the handler thread's are not counted.

use dmkv_api::EngineSpec;
use dmkv_api::KvClient;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_rpc_btree::{RpcTreeClient, SPEC, connect_services};
use dmkv_transport::Endpoint;
use dmkv_transport::exec::block_on;

#[global_allocator]
static GLOBAL: dmkv_alloc_count::Counting = dmkv_alloc_count::Counting;

use dmkv_alloc_count::allocs;

/// One memory node serving the tree and a client of it on thread 0 (the
/// deployment and the service's endpoint are returned to keep them alive).
fn client() -> (LocalDeployment, Endpoint, RpcTreeClient) {
    let d = LocalDeployment::deploy(
        &SPEC,
        &DeployOptions {
            threads: 1,
            expected_keys: 1_000,
            ..Default::default()
        },
    )
    .unwrap();
    let (e, svc) = connect_services(&d.connect_args(d.compute), SPEC.name(), SPEC.knobs()).unwrap();
    let c = RpcTreeClient::new(d.endpoint(0), svc.svcs[0]);
    (d, e, c)
}

#[test]
fn a_warm_get_of_an_absent_key_allocates_nothing() {
    let (_d, _e, c) = client();
    block_on(async {
        for k in 1..=20u64 {
            assert!(c.insert(k, &k.to_le_bytes()).await.unwrap());
        }
        // Warm up: the endpoint's lanes, slots and kept buffer.
        for k in 1..=40u64 {
            c.get(k).await.unwrap();
        }
        let before = allocs();
        for k in 100..110u64 {
            assert_eq!(c.get(k).await.unwrap(), None);
        }
        assert_eq!(allocs() - before, 0, "GETs of absent keys allocated");
    });
}

/// Fails without `RpcTreeClient`'s in-place value (the value copied out
/// with `to_vec`: one allocation per GET) or without its `recycles_to`
/// (the trait's `recycle` then drops the value).
#[test]
fn a_warm_get_of_a_present_key_with_its_value_recycled_allocates_nothing() {
    let (_d, _e, c) = client();
    assert!(c.recycles_values());
    block_on(async {
        for k in 1..=40u64 {
            assert!(c.insert(k, &[k as u8; 24]).await.unwrap());
        }
        // Warm up: the endpoint's lanes, slots and kept buffer.
        for k in 1..=20u64 {
            let v = c.get(k).await.unwrap().unwrap();
            c.recycle(v);
        }
        let mut got = Vec::with_capacity(20);
        for k in 21..=40u64 {
            let before = allocs();
            let v = c.get(k).await.unwrap().unwrap();
            assert_eq!(v, [k as u8; 24]);
            c.recycle(v);
            got.push(allocs() - before);
        }
        assert!(got.iter().all(|&n| n == 0), "{got:?}");
    });
}
