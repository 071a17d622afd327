//! The page provider latches each victim only for its own step
//! (invariant 17 in docs/scalestore.md), on the simulated cluster where
//! time is virtual: a dirty page it writes to the SSD is held shared (local
//! readers go on), a remote victim is not latched while the node's own
//! pages are written, and a page a reader still holds when its write ends
//! stays dirty, so that a later write to it is not dropped as clean.

mod common;

use common::read_shared as read;
use common::{Cluster, allocate, evict, nodes_of, profile, worker};
use dmkv_api::sim_deploy::SimDeployment;
use dmkv_scalestore::guard::{ExclusiveGuard, SharedGuard};
use dmkv_scalestore::node::ScaleNode;
use dmkv_scalestore::pid::Pid;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks, sleep};
use dmkv_transport::time::Instant;
use std::sync::atomic::Ordering;
use std::time::Duration;

fn deploy(nodes: usize, seed: u64) -> SimDeployment {
    Cluster {
        knobs: &[("alloc", "local")],
        ..Cluster::new(nodes, seed)
    }
    .deploy()
}

fn write_ns() -> u64 {
    profile().ssd.write_ns
}

fn kept_dirty(n: &ScaleNode) -> u64 {
    n.stats.evict_writes_kept_dirty.load(Ordering::Relaxed)
}

/// Node 0 evicts four dirty pages it directs (one SSD write batch); 1 µs
/// later one of its workers reads the first. Before the change the page
/// stayed latched exclusively for the whole batch and the read ended after
/// the write's device time; now the page is latched shared while it is
/// written and the read ends at once. The page is still evicted (the
/// reader is gone when the write ends) and its content comes back from the
/// SSD.
#[test]
fn a_local_reader_is_not_blocked_by_the_write_of_its_page() {
    let d = deploy(2, 3);
    let nodes = nodes_of(&d);
    let w0 = worker(&nodes[0]);
    let pids: Vec<Pid> = (0..4).map(|i| allocate(&w0, 100 + i)).collect();
    let start = Instant::now();
    let (node, w, ps) = (&nodes[0], &w0, &pids);
    let tasks: Vec<LocalTask<'_, (u64, u64)>> = vec![
        Box::pin(async move { (evict(node, ps).await as u64, 0) }),
        Box::pin(async move {
            sleep(Duration::from_micros(1)).await;
            let word = SharedGuard::fix(w, ps[0])
                .await
                .unwrap()
                .page()
                .word(0)
                .unwrap();
            (word, Instant::now().duration_since(start).as_nanos() as u64)
        }),
    ];
    let out = run_tasks(tasks);
    assert_eq!(out[0].0, 0, "node 0 evicted all four pages");
    assert_eq!(out[1].0, 100, "the reader saw the page's content");
    assert!(
        out[1].1 < write_ns(),
        "the read ended {} ns after the start: it waited for the SSD write ({} ns)",
        out[1].1,
        write_ns()
    );
    assert_eq!(kept_dirty(&nodes[0]), 0, "no write was kept dirty");
    for (i, &p) in pids.iter().enumerate() {
        assert_eq!(
            read(&w0, p),
            100 + i as u64,
            "page {i} came back from the SSD"
        );
    }
}

/// Node 1 holds a dirty page it directs and an exclusive copy of a page
/// node 0 directs, and evicts both: its own page goes to its SSD, the
/// other to node 0 by an eviction message. 1 µs in, a worker of node 1
/// writes the remote page. Before the change every victim was latched up
/// front and the remote one stayed latched across the local write and its
/// own message; now it is latched only for its message, so the worker
/// writes at once (and the provider then leaves the page to it). Nothing
/// is lost: both pages read back with their last values.
#[test]
fn a_remote_victim_is_not_latched_across_the_local_write() {
    let d = deploy(2, 5);
    let nodes = nodes_of(&d);
    let w0 = worker(&nodes[0]);
    let w1 = worker(&nodes[1]);
    let remote = allocate(&w0, 7);
    let own = allocate(&w1, 8);
    assert_eq!((remote.shard(), own.shard()), (0, 1));
    block_on(async {
        let g = ExclusiveGuard::fix(&w1, remote).await.unwrap();
        g.page().set_word(0, 70);
        drop(g);
        w1.settle_acks().await.unwrap();
    });
    let start = Instant::now();
    let (node, w, both) = (&nodes[1], &w1, [remote, own]);
    let both = &both;
    let tasks: Vec<LocalTask<'_, u64>> = vec![
        Box::pin(async move { evict(node, both).await as u64 }),
        Box::pin(async move {
            sleep(Duration::from_micros(1)).await;
            let g = ExclusiveGuard::fix(w, remote).await.unwrap();
            g.page().set_word(0, 71);
            drop(g);
            Instant::now().duration_since(start).as_nanos() as u64
        }),
    ];
    let out = run_tasks(tasks);
    assert!(
        out[1] < write_ns(),
        "the write of the remote page ended {} ns after the start: it waited \
         for node 1's SSD write ({} ns)",
        out[1],
        write_ns()
    );
    assert_eq!(
        read(&w1, own),
        8,
        "node 1's own page came back from its SSD"
    );
    block_on(async { w1.settle_acks().await.unwrap() });
    assert_eq!(read(&w0, remote), 71, "the remote page kept its last write");
}

/// Node 0 writes a dirty page it directs while one of its workers reads it
/// and holds it past the write's end. The provider is then not the latch's
/// only holder, so the page stays dirty (`evict_writes_kept_dirty`) and
/// cached. The worker's later write needs no grant (node 0 holds the page
/// exclusively), so had the provider marked the page clean, the next
/// eviction would have dropped the new value and the SSD's old one would
/// come back.
#[test]
fn a_page_still_read_when_its_write_ends_stays_dirty() {
    let d = deploy(2, 9);
    let nodes = nodes_of(&d);
    let w0 = worker(&nodes[0]);
    let pid = allocate(&w0, 100);
    let hold = Duration::from_nanos(2 * write_ns());
    let (node, w) = (&nodes[0], &w0);
    let tasks: Vec<LocalTask<'_, u64>> = vec![
        Box::pin(async move { evict(node, &[pid]).await as u64 }),
        Box::pin(async move {
            sleep(Duration::from_micros(1)).await;
            let g = SharedGuard::fix(w, pid).await.unwrap();
            let word = g.page().word(0).unwrap();
            sleep(hold).await;
            drop(g);
            word
        }),
    ];
    let out = run_tasks(tasks);
    assert_eq!(
        out,
        vec![1, 100],
        "still held by node 0; the reader saw 100"
    );
    assert_eq!(kept_dirty(&nodes[0]), 1, "the write left the page dirty");
    block_on(async {
        let g = ExclusiveGuard::fix(&w0, pid).await.unwrap();
        g.page().set_word(0, 200);
    });
    assert_eq!(block_on(evict(&nodes[0], &[pid])), 0, "evicted now");
    assert_eq!(read(&w0, pid), 200, "the later write reached the SSD");
}
