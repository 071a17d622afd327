//! ScaleStore's messages on the simulated cluster cost the NIC messages
//! the artifact's RDMA WRITEs do (docs/scalestore.md, "i84: the artifact's
//! verbs per message"): a worker's request is two WRITEs, the message and
//! then its mailbox's flag (`threads/Worker.hpp`, `Worker::writeMsg`); a
//! handler's reply with a page is two, the page and then the message
//! (`rdma/MessageHandler.hpp`, `writePageAndMsg`); a reply without one is
//! one (`writeMsg`). Counted at both NICs in the utilisation report.

mod common;

use common::{
    Cluster, allocate, node1_dirties_a_page_of_node0, nodes_of, read_exclusive, read_shared, worker,
};
use dmkv_api::sim_deploy::SimDeployment;
use dmkv_scalestore::msg::MSG_BYTES;
use dmkv_scalestore::page::PAGE_SIZE;

/// Node `node`'s NIC direction `dir` ("tx", "rx"): (messages, bytes) so far.
fn nic(d: &SimDeployment, node: u16, dir: &str) -> (u64, u64) {
    d.sim
        .resources()
        .iter()
        .filter(|r| r.name.starts_with(&format!("node{node} nic")) && r.name.ends_with(dir))
        .fold((0, 0), |(m, b), r| (m + r.count, b + r.bytes))
}

/// (messages, bytes) of every node's NIC directions, tx then rx.
fn all_nics(d: &SimDeployment, ids: &[u16]) -> Vec<(u64, u64)> {
    ids.iter()
        .flat_map(|&n| [nic(d, n, "tx"), nic(d, n, "rx")])
        .collect()
}

fn diff(after: &[(u64, u64)], before: &[(u64, u64)]) -> Vec<(u64, u64)> {
    after
        .iter()
        .zip(before)
        .map(|(a, b)| (a.0 - b.0, a.1 - b.1))
        .collect()
}

/// Node 1 fixes (shared) a page node 0 allocated, directs and holds: one
/// request to node 0 (the message and its flag), which answers from its
/// own copy with the page and the reply; node 1's NIC acknowledges the
/// page's posted write (`sim::write_posted`'s completion). Then node 0's
/// worker takes a page node 1 holds dirty back exclusively: node 0
/// decides at its own directory and sends node 1 a move (message and
/// flag), answered with the page and the reply.
#[test]
fn a_request_is_two_writes_and_a_page_reply_two() {
    let d = Cluster::new(2, 5).deploy();
    let nodes = nodes_of(&d);
    let ids = [nodes[0].id.0, nodes[1].id.0];
    let h = common::profile().network.header_bytes;
    let msg = MSG_BYTES as u64;
    let page = PAGE_SIZE as u64;
    let (w0, w1) = (worker(&nodes[0]), worker(&nodes[1]));
    let pid = allocate(&w0, 11);
    assert_eq!(pid.shard(), 0);

    let before = all_nics(&d, &ids);
    assert_eq!(read_shared(&w1, pid), 11);
    let got = diff(&all_nics(&d, &ids), &before);
    // node 0 tx, node 0 rx, node 1 tx, node 1 rx.
    let request = (2, msg + 1 + 2 * h);
    let page_reply = (2, page + msg + 2 * h);
    let ack = (1, h);
    assert_eq!(
        got,
        vec![
            page_reply,
            (request.0 + ack.0, request.1 + ack.1),
            (request.0 + ack.0, request.1 + ack.1),
            page_reply,
        ],
        "a shared fix from the directory's copy"
    );

    drop((w0, w1, nodes, d));
    let d = Cluster::new(2, 5).deploy();
    let nodes = nodes_of(&d);
    let ids = [nodes[0].id.0, nodes[1].id.0];
    let (pid, w0, _w1) = node1_dirties_a_page_of_node0(&nodes);
    let before = all_nics(&d, &ids);
    assert_eq!(read_exclusive(&w0, pid), 42);
    let got = diff(&all_nics(&d, &ids), &before);
    assert_eq!(
        got,
        vec![
            (request.0 + ack.0, request.1 + ack.1),
            page_reply,
            page_reply,
            (request.0 + ack.0, request.1 + ack.1),
        ],
        "a move decided at the requester's own directory"
    );
}
