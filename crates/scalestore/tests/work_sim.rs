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
use dmkv_scalestore::guard::ExclusiveGuard;
use dmkv_scalestore::handler::cost;
use dmkv_transport::exec::block_on;
use dmkv_transport::sim::Profile;
use std::sync::atomic::Ordering;

fn declared(d: &SimDeployment) -> u64 {
    d.sim.declared_instructions()
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
    // (Each message also costs the artifact's mailbox scan that found it,
    // branch i88.)
    assert_eq!(
        declared,
        cost::MESSAGE + cost::MAILBOX_SCAN + cost::OWN + cost::DELIVERY
    );
    assert_eq!(
        busy - busy_without,
        declared * 1000 / rate,
        "the handler's core is busy longer by exactly its work at {rate} instructions per us"
    );
}

/// The messages declared since branch i60 (docs/simulation.md, "Declared
/// work, the rest (branch i60)"): an acknowledgement (FIFO). Node 1 fixes
/// exclusively a page node 0 directs and holds, and acknowledges the
/// transfer: node 0 handles the ownership request (its own copy written
/// into node 1's frame) and the acknowledgement, and declares exactly
/// their constants. Without `ACK` (main before i60) the count is short by
/// it.
#[test]
fn an_acknowledgement_declares_its_work() {
    let knobs = [("protocol", "fifo"), ("alloc", "local")];
    let d = Cluster {
        knobs: &knobs,
        ..Cluster::new(2, 3)
    }
    .deploy();
    let nodes = nodes_of(&d);
    let w0 = worker(&nodes[0]);
    let w1 = worker(&nodes[1]);
    let pid = allocate(&w0, 7);
    assert_eq!(pid.shard(), 0);
    let acks = |n: &dmkv_scalestore::node::ScaleNode| {
        n.stats.sent[dmkv_scalestore::msg::Kind::Ack as usize].load(Ordering::Relaxed)
    };
    let (dec0, acks0) = (declared(&d), acks(&nodes[1]));
    block_on(async {
        let g = ExclusiveGuard::fix(&w1, pid).await.unwrap();
        g.page().set_word(0, 42);
        drop(g);
        w1.settle_acks().await.unwrap();
    });
    assert_eq!(acks(&nodes[1]) - acks0, 1, "one acknowledgement sent");
    assert_eq!(
        declared(&d) - dec0,
        2 * (cost::MESSAGE + cost::MAILBOX_SCAN) + cost::OWN + cost::DELIVERY + cost::ACK
    );
    assert_eq!(read_shared(&w0, pid), 42);
}

/// An eviction whose pulled page goes to the directory's SSD declares per
/// batch and per page, and the completer's write completion declares its
/// own (branch i60): node 1 evicts the only (dirty) copy of a page node 0
/// directs while node 0's cache has no free slot (`cache_pages` = 64, all
/// taken), so node 0 pulls it and writes it to its SSD. Declared: the
/// message, the batch and its one page, the pull's completion, and the
/// write's completion (batch and page).
#[test]
fn an_eviction_written_to_the_ssd_declares_per_batch_and_page() {
    let knobs = [("protocol", "chaining"), ("alloc", "local")];
    let d = Cluster {
        knobs: &knobs,
        ..Cluster::new(3, 5)
    }
    .deploy();
    let nodes = nodes_of(&d);
    let (pid, _w0, _w1) = common::node1_dirties_a_page_of_node0(&nodes);
    let f0 = nodes[0].frames.frame(nodes[0].frames.find(pid).unwrap());
    // Node 0's cache takes nothing while the page's frame is latched: the
    // pulled page goes to its SSD (as in ssd_sim's eviction test).
    assert!(f0.latch.try_shared(), "node 0 holds no copy");
    let dec0 = declared(&d);
    let ep1 = nodes[1].fabric.endpoint(nodes[1].id).unwrap();
    let held = block_on(dmkv_scalestore::provider::Provider::new().evict_everything(
        &nodes[1],
        &ep1,
        |p| p == pid,
    ))
    .unwrap();
    f0.latch.unlock_shared();
    assert_eq!(held, 0, "node 0 accepted the eviction");
    assert_eq!(
        declared(&d) - dec0,
        cost::MESSAGE
            + cost::MAILBOX_SCAN
            + cost::EVICT
            + cost::EVICT_PAGE
            + cost::PULL
            + cost::EVICT_WRITTEN
            + cost::EVICT_WRITTEN_PAGE
    );
}

/// A leave's hand-over declares its messages (branch i60): node 1 of two
/// allocates `PAGES` pages (its shard) and node 0 reads one of them, then
/// node 1 leaves. Node 0 adopts the shard: an adoption, the page file in
/// page batches written to its SSD by its completer, the entries of the
/// pages someone caches, the shard's hand-over and the departure, whose
/// scrub looks at every frame of node 0's table. Each declares its
/// constants, per message and per page, entry or frame.
#[test]
fn a_leave_declares_its_hand_over() {
    use dmkv_scalestore::msg::Kind;
    const PAGES: u64 = 5;
    let knobs = [("protocol", "chaining"), ("alloc", "local")];
    let d = Cluster {
        knobs: &knobs,
        ..Cluster::new(2, 7)
    }
    .deploy();
    let nodes = nodes_of(&d);
    let w1 = worker(&nodes[1]);
    let pids: Vec<_> = (0..PAGES).map(|i| allocate(&w1, 100 + i)).collect();
    assert!(pids.iter().all(|p| p.shard() == 1));
    let w0 = worker(&nodes[0]);
    assert_eq!(read_shared(&w0, pids[0]), 100);
    // Messages node 1 has sent so far of the kinds a leave may send.
    let sent = || -> Vec<u64> {
        [
            Kind::Adopt,
            Kind::HandoverPages,
            Kind::HandoverEntries,
            Kind::HostShard,
            Kind::Depart,
            Kind::Evict,
        ]
        .iter()
        .map(|&k| nodes[1].stats.sent[k as usize].load(Ordering::Relaxed))
        .collect()
    };
    let before = sent();
    let dec0 = declared(&d);
    let succ = block_on(nodes[1].leave_async()).unwrap();
    assert_eq!(succ, 0);
    let after = sent();
    let n: Vec<u64> = after.iter().zip(&before).map(|(a, b)| a - b).collect();
    assert_eq!(
        n,
        [1, 1, 1, 1, 1, 0],
        "adopt, pages, entries, host, depart, evict"
    );
    // The page file holds the pages written to node 1's SSD: its own
    // dirty copies, written as it drops them; not the page node 0 caches
    // (its copy stays, dirty in the entry, which goes over instead).
    let pages_sent = PAGES - 1;
    let entries_sent = 1;
    let frames = u64::from(nodes[0].frames.high_water());
    let expected = 5 * (cost::MESSAGE + cost::MAILBOX_SCAN)
        + cost::ADOPT
        + cost::HANDOVER_PAGES
        + cost::HANDOVER_PAGE * pages_sent
        + cost::HANDOVER_WRITTEN
        + cost::HANDOVER_WRITTEN_PAGE * pages_sent
        + cost::HANDOVER_ENTRIES
        + cost::HANDOVER_ENTRY * entries_sent
        + cost::HOST_SHARD
        + cost::DEPART
        + cost::DEPART_FRAME * frames;
    assert_eq!(declared(&d) - dec0, expected, "{frames} frames on node 0");
    for (i, p) in pids.iter().enumerate() {
        assert_eq!(read_shared(&w0, *p), 100 + i as u64);
    }
}
