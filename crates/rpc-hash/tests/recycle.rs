//! A GET's value handed back with [`KvStore::recycle`] is the endpoint's
//! next request buffer: a GET after a recycled GET allocates nothing on
//! the client's thread, one after a dropped GET allocates its request
//! buffer (docs/performance.md, "Twenty-fifth pass (branch i96)").
//!
//! The same holds for a value handed straight to the endpoint
//! [`KvStore::recycles_to`] names (the harness's path since branch i109).
//!
//! Allocations are counted per thread by a global allocator wrapping the
//! system's (this test binary only).

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::payload::make_value;
use dmkv_api::{FutureSlot, KvStore};
use dmkv_rpc_hash::SPEC;
use dmkv_transport::Endpoint;
use dmkv_transport::exec::block_on;
use std::rc::Rc;

#[global_allocator]
static GLOBAL: dmkv_alloc_count::Counting = dmkv_alloc_count::Counting;

use dmkv_alloc_count::allocs;

/// What happens to a GET's value once it is read.
#[derive(Clone, Copy)]
enum Back {
    /// [`KvStore::recycle`].
    Recycle,
    /// `Endpoint::recycle` on [`KvStore::recycles_to`]'s endpoint.
    ToEndpoint,
    Drop,
}

/// Allocations on this thread of one GET of `key` run in `slot`, its
/// value then recycled or dropped (the expected value is built first).
async fn get_allocs(store: &dyn KvStore, slot: &mut FutureSlot, key: u64, recycle: Back) -> u64 {
    let expected = make_value(key, 0, 16);
    let before = allocs();
    let value = store.get_in(key, slot).await.unwrap().unwrap();
    let got = allocs() - before;
    assert_eq!(value, expected);
    let before = allocs() - got;
    match recycle {
        Back::Recycle => store.recycle(value),
        Back::ToEndpoint => store
            .recycles_to()
            .expect("rpc-hash names its endpoint")
            .recycle(value),
        Back::Drop => drop(value),
    }
    allocs() - before
}

/// One rpc-hash memory node and one client, keys `1..=keys` loaded with
/// 16-byte values (the deployment is returned to keep it alive).
fn deployed(keys: u64) -> (LocalDeployment, Rc<Endpoint>, Rc<dyn KvStore>) {
    let d = LocalDeployment::deploy(
        &SPEC,
        &DeployOptions {
            memnodes: 1,
            threads: 1,
            expected_keys: 1000,
            ..Default::default()
        },
    )
    .unwrap();
    let pairs: Vec<_> = (1..=keys).map(|k| (k, make_value(k, 0, 16))).collect();
    let (ep, store) = d.client(0).unwrap();
    block_on(d.engine.load(&ep, &pairs)).unwrap();
    (d, ep, store)
}

/// Fails without `RpcHashClient::recycle` (the default drops the value:
/// every GET then allocates its request buffer, 1 instead of 0).
#[test]
fn a_recycled_get_value_is_the_next_request_buffer() {
    let (_d, _ep, store) = deployed(50);
    // The harness asks this once per task and recycles only if true.
    assert!(store.recycles_values());
    let mut slot = FutureSlot::default();
    let (mut recycled, mut dropped) = (Vec::with_capacity(20), Vec::with_capacity(20));
    block_on(async {
        // Warm up: the slot grows, the lane and its reply slots are set up.
        for k in 1..=10 {
            get_allocs(&*store, &mut slot, k, Back::Recycle).await;
        }
        for k in 11..=30 {
            recycled.push(get_allocs(&*store, &mut slot, k, Back::Recycle).await);
        }
        // The first GET after a recycled one still finds the spare; from
        // then on each GET whose predecessor's value was dropped allocates
        // its request buffer.
        get_allocs(&*store, &mut slot, 31, Back::Drop).await;
        for k in 32..=50 {
            dropped.push(get_allocs(&*store, &mut slot, k, Back::Drop).await);
        }
    });
    assert!(recycled.iter().all(|&n| n == 0), "{recycled:?}");
    assert!(dropped.iter().all(|&n| n == 1), "{dropped:?}");
}

/// Fails without `RpcHashClient::recycles_to` (the default is `None`), or
/// if it names an endpoint other than the client's own (its next request
/// would not find the spare: 1 allocation per GET instead of 0).
#[test]
fn a_value_handed_to_recycles_to_is_the_next_request_buffer() {
    let (_d, ep, store) = deployed(40);
    let home = store.recycles_to().expect("rpc-hash names its endpoint");
    assert!(std::ptr::eq(home, &*ep), "the client's own endpoint");
    let mut slot = FutureSlot::default();
    let mut handed = Vec::with_capacity(20);
    block_on(async {
        for k in 1..=10 {
            get_allocs(&*store, &mut slot, k, Back::ToEndpoint).await;
        }
        for k in 11..=30 {
            handed.push(get_allocs(&*store, &mut slot, k, Back::ToEndpoint).await);
        }
    });
    assert!(handed.iter().all(|&n| n == 0), "{handed:?}");
}
