//! A GET over `local` builds its request in the endpoint's kept request
//! buffer and gives the reply's buffer back (branch i87): once warm, a GET
//! of an absent key allocates nothing on the client's thread. (Built with
//! `WireWriter::new`, each GET allocated its request twice: the empty
//! `Vec`'s first push and the key's growth. A GET of a present key
//! allocates its value and, on `local`, a reply buffer: two per GET here,
//! not asserted: the reply's buffer is the transport's.)
//!
//! Allocations are counted per thread by a global allocator wrapping the
//! system's (this test binary only): the handler thread's are not counted.

use dmkv_api::KvClient;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_rpc_btree::{RpcTreeClient, SPEC, connect_service};
use dmkv_transport::exec::block_on;

#[global_allocator]
static GLOBAL: dmkv_alloc_count::Counting = dmkv_alloc_count::Counting;

use dmkv_alloc_count::allocs;

#[test]
fn a_warm_get_of_an_absent_key_allocates_nothing() {
    let d = LocalDeployment::deploy(
        &SPEC,
        &DeployOptions {
            threads: 1,
            expected_keys: 1_000,
            ..Default::default()
        },
    )
    .unwrap();
    let (_e, svc) = connect_service(&d.connect_args(d.compute)).unwrap();
    let c = RpcTreeClient::new(d.endpoint(0), svc);
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
