//! ScaleStore's message handlers declare their work to the simulated
//! cluster's instruction term (docs/simulation.md, "Declared work for
//! worker jobs and ScaleStore (branch i55)"): a remote shared fix of a page
//! another node directs is one ownership request, whose handler declares
//! the per-message, request and delivery constants (`handler::cost`), and
//! the directory node's handler core is busy longer by exactly what the
//! profile's clock x IPC makes of them. With `sim::work` a no-op (the model
//! before i55) nothing is declared and the core's busy time does not
//! change with the term: both assertions fail.

mod common;

use common::{Cluster, allocate, nodes_of, read_shared, worker};
use dmkv_api::sim_deploy::SimDeployment;
use dmkv_scalestore::handler::cost;
use dmkv_transport::sim::Profile;

fn declared(d: &SimDeployment) -> u64 {
    d.sim
        .resources()
        .iter()
        .find(|r| r.name == "memnode declared instructions")
        .map_or(0, |r| r.count)
}

fn handler_busy(d: &SimDeployment, node: u16) -> u64 {
    d.sim
        .resources()
        .iter()
        .filter(|r| r.name == format!("node{node} handler cores"))
        .map(|r| r.busy_ns)
        .sum()
}

/// Node 1 fixes (shared) a page node 0 allocated and directs: returns the
/// instructions declared meanwhile, node 0's handler-core busy time
/// meanwhile, and the messages node 0 handled meanwhile.
fn remote_fix(profile: Option<Profile>) -> (u64, u64, u64) {
    let d = Cluster {
        profile,
        ..Cluster::new(2, 3)
    }
    .deploy();
    let nodes = nodes_of(&d);
    let id0 = nodes[0].id.0;
    let w0 = worker(&nodes[0]);
    let w1 = worker(&nodes[1]);
    let pid = allocate(&w0, 11);
    assert_eq!(pid.shard(), 0);
    let msgs = |d: &SimDeployment| -> u64 {
        d.sim
            .resources()
            .iter()
            .filter(|r| r.name == format!("node{id0} handler cores"))
            .map(|r| r.count)
            .sum()
    };
    let (dec0, busy0, m0) = (declared(&d), handler_busy(&d, id0), msgs(&d));
    assert_eq!(read_shared(&w1, pid), 11);
    (
        declared(&d) - dec0,
        handler_busy(&d, id0) - busy0,
        msgs(&d) - m0,
    )
}

#[test]
fn a_remote_fix_declares_the_request_and_delivery_work() {
    let with = common::profile();
    let rate = with.memnode.instructions_per_us();
    assert!(rate > 0, "the shipped profile has the instruction term");
    let mut without = with.clone();
    without.memnode.cpu_ghz = 0.0;
    without.memnode.ipc = 0.0;
    let (declared, busy, msgs) = remote_fix(Some(with));
    let (none, busy_without, msgs_without) = remote_fix(Some(without));
    assert_eq!(none, 0, "no term: nothing declared");
    assert_eq!(msgs, 1, "one ownership request reached node 0");
    assert_eq!(msgs_without, 1);
    // The request's handler: the message, the directory's decision, and the
    // page written into node 1's frame from node 0's copy.
    assert_eq!(declared, cost::MESSAGE + cost::OWN + cost::DELIVERY);
    assert_eq!(
        busy - busy_without,
        declared * 1000 / rate,
        "the handler's core is busy longer by exactly its work at {rate} instructions per us"
    );
}
