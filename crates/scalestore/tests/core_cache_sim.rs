//! ScaleStore's page deliveries leave by the NIC's DMA read of the frame,
//! as the artifact posts its WRITE from the frame
//! (`MessageHandler::writePageAndMsg`; docs/scalestore.md, "i77: pages
//! delivered from the frame"): the handler core that serves a delivery
//! takes none of the page's lines into its private cache (before branch
//! i77 it copied the page, 64 lines), the NIC carries the page, and the
//! bytes delivered are the frame's at the post, a worker's stores in
//! between included (they are made under the exclusive latch and reported,
//! invariant 24; the delivery is read under the latch, invariant 25).

mod common;

use common::{Cluster, allocate, nodes_of, read_shared, worker};
use dmkv_api::sim_deploy::SimDeployment;
use dmkv_scalestore::guard::ExclusiveGuard;
use dmkv_scalestore::node::ScaleNode;
use dmkv_scalestore::page::PAGE_SIZE;
use dmkv_scalestore::pid::Pid;
use dmkv_transport::exec::block_on;

/// Node `node`'s handler cores' private (hits, misses) so far.
fn private(d: &SimDeployment, node: u16) -> (u64, u64) {
    let count = |what: &str| -> u64 {
        d.sim
            .resources()
            .iter()
            .filter(|r| r.name == format!("node{node} handler cores private {what}"))
            .map(|r| r.count)
            .sum()
    };
    (count("hits"), count("misses"))
}

/// Bytes node `node`'s NICs sent so far.
fn nic_tx_bytes(d: &SimDeployment, node: u16) -> u64 {
    d.sim
        .resources()
        .iter()
        .filter(|r| r.name.starts_with(&format!("node{node} nic")) && r.name.ends_with(" tx"))
        .map(|r| r.bytes)
        .sum()
}

/// The bytes of `node`'s copy of `pid` (read off the simulation's clock).
fn frame_of(node: &ScaleNode, pid: Pid) -> Vec<u8> {
    let fi = node.frames.find(pid).expect("a frame for the page");
    node.page(node.frames.frame(fi).local().slot).to_bytes()
}

/// What node 0's handler core and NIC did for one delivery.
struct Delivery {
    /// Its handler cores' private (hits, misses) meanwhile.
    lines: (u64, u64),
    /// Bytes its NICs sent meanwhile.
    nic_bytes: u64,
    /// Node 1's copy equals node 0's frame.
    same_bytes: bool,
    /// Word 100 of node 1's copy.
    word100: u64,
}

/// Node 1 fixes (shared) a page node 0 allocated and directs, twice; in
/// between node 0's worker fixes it exclusively (which takes node 1's copy
/// away, so the second fix asks node 0 again) and, if `store`, stores
/// words 0 and 100 (two different lines). Node 0 has one handler core,
/// which serves both deliveries from its own copy. Returns the second.
fn second_delivery(store: bool) -> Delivery {
    let d = Cluster::new(2, 5).deploy();
    let nodes = nodes_of(&d);
    let id0 = nodes[0].id.0;
    let (w0, w1) = (worker(&nodes[0]), worker(&nodes[1]));
    let pid = allocate(&w0, 11);
    assert_eq!(pid.shard(), 0);
    assert_eq!(read_shared(&w1, pid), 11);
    block_on(async {
        let g = ExclusiveGuard::fix(&w0, pid).await.unwrap();
        if store {
            g.page().set_word(0, 12);
            g.page().set_word(100, 13);
        }
        drop(g);
        w0.settle_acks().await.unwrap();
    });
    let (lines0, nic0) = (private(&d, id0), nic_tx_bytes(&d, id0));
    assert_eq!(read_shared(&w1, pid), if store { 12 } else { 11 });
    let (lines1, nic1) = (private(&d, id0), nic_tx_bytes(&d, id0));
    let copy = frame_of(&nodes[1], pid);
    Delivery {
        lines: (lines1.0 - lines0.0, lines1.1 - lines0.1),
        nic_bytes: nic1 - nic0,
        same_bytes: copy == frame_of(&nodes[0], pid),
        word100: u64::from_le_bytes(copy[800..808].try_into().unwrap()),
    }
}

#[test]
fn a_delivery_is_read_by_the_nic_not_the_handler_core() {
    let profile = common::profile();
    assert!(
        profile.memnode.core_cache_bytes > 0,
        "the shipped profile models private caches"
    );
    for store in [false, true] {
        let got = second_delivery(store);
        // Before branch i77 the handler copied the page: 64 lines (hits on
        // its first copy's lines; 2 of them misses after the stores).
        assert_eq!(
            got.lines,
            (0, 0),
            "store {store}: the handler core read page lines"
        );
        assert!(
            got.nic_bytes >= PAGE_SIZE as u64,
            "store {store}: the NIC sent {} bytes",
            got.nic_bytes
        );
        assert!(
            got.same_bytes,
            "store {store}: delivered bytes differ from the frame"
        );
        assert_eq!(got.word100, if store { 13 } else { 0 });
    }
}
