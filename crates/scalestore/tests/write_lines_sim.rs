//! A write prices the leaf lines it reads and changes, not the whole leaf
//! (docs/scalestore.md, invariant 29): the simulated compute CPU charges
//! an operation its distinct lines, and a write that copied the 4 KiB leaf
//! and stored it back whole counted all 64 of them.

use dmkv_scalestore::LocalPager;
use dmkv_scalestore::btree::{BTree, WriteKind};
use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimConfig, Simulation};
use dmkv_transport::{Endpoint, NodeHost};
use std::future::Future;
use std::pin::Pin;

fn client_busy(sim: &Simulation, node: u16) -> u64 {
    sim.resources()
        .iter()
        .filter(|r| r.name.starts_with(&format!("node{node} client core")))
        .map(|r| r.busy_ns)
        .sum()
}

/// Lines charged for each write, on one leaf of 100 keys (16-byte values:
/// slots in lines 0..=25 of the leaf, values in the heap at its end).
#[test]
fn writes_price_the_lines_they_touch() {
    let sim = Simulation::new(SimConfig {
        profile: Profile::default_profile(),
        seed: 7,
        jitter_ns: 0,
        delays: Default::default(),
    });
    let line_ns = sim.profile().memnode.line_ns;
    assert!(line_ns > 0);
    let node = sim.add_node(0);
    let id = node.id().0;
    let ep: Endpoint = sim.fabric().endpoint(node.id()).unwrap();
    let pager = LocalPager::new();
    let tree = BTree::new(&pager);
    block_on(async {
        for k in 0..100u64 {
            assert!(
                tree.write(WriteKind::Insert, k, &[k as u8; 16])
                    .await
                    .unwrap()
            );
        }
    });
    let charged = |op: Pin<Box<dyn Future<Output = ()> + '_>>| {
        let before = client_busy(&sim, id);
        block_on(ep.charged(op));
        (client_busy(&sim, id) - before) / line_ns
    };
    let tree = &tree;
    let write = |kind: WriteKind, key: u64| {
        charged(Box::pin(async move {
            assert!(tree.write(kind, key, &[7; 16]).await.unwrap());
        }))
    };
    // A GET of key 50 reads the catalog's line 0, the leaf's line 0 (meta,
    // fences), the binary search's slot lines and the value's line.
    let get = charged(Box::pin(async {
        tree.lookup(50).await.unwrap().expect("loaded");
    }));
    // An update of it reads the same lines but the old value's and writes
    // the new value's line (the slot and meta words are in lines read).
    let update = write(WriteKind::Update, 50);
    assert!(
        update <= get + 1,
        "an update priced {update} lines, a GET {get}"
    );
    // A delete or insert at the front also moves slots 1..100: lines
    // 0..=25 of the leaf.
    let delete = write(WriteKind::Delete, 0);
    assert!(
        (26..=get + 26).contains(&delete),
        "a delete at the front priced {delete} lines, a GET {get}"
    );
    let insert = write(WriteKind::Insert, 0);
    assert!(
        (26..=get + 27).contains(&insert),
        "an insert at the front priced {insert} lines, a GET {get}"
    );
    // A key past the last slot shifts nothing.
    let append = write(WriteKind::Insert, 1000);
    assert!(
        append <= get + 1,
        "an insert at the end priced {append} lines, a GET {get}"
    );
    // Copying the leaf and storing it back counted all its 64 lines.
    assert!(update < 64 && delete < 64 && insert < 64);
}
