//! The simulated compute CPU counts a frame's hot words as the cache lines
//! they share (docs/scalestore.md, "Frame layout"): a translation-table
//! lookup and a fix's reads of the latch word, page id and hot-path word
//! are the bucket's line and the frame's line 0, the LRU stamp its line 1.
//! Before the layout was pinned each word counted as a line of its own
//! (6 lines for what is 3).

use dmkv_scalestore::frames::FrameTable;
use dmkv_scalestore::pid::Pid;
use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimConfig, Simulation};
use dmkv_transport::{Endpoint, NodeHost};

fn client_busy(sim: &Simulation, node: u16) -> u64 {
    sim.resources()
        .iter()
        .filter(|r| r.name.starts_with(&format!("node{node} client core")))
        .map(|r| r.busy_ns)
        .sum()
}

#[test]
fn a_lookup_and_fix_of_one_frame_touch_three_lines() {
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
    let table = FrameTable::new(64, 64);
    let pid = Pid::new(1, 7);
    let fi = table.find_or_insert(pid).unwrap();
    let before = client_busy(&sim, id);
    block_on(ep.charged(async {
        let found = table.find(pid).expect("inserted");
        assert_eq!(found, fi);
        let f = table.frame(found);
        let v = f.latch.optimistic().expect("not latched");
        assert_eq!(f.pid(), pid);
        let _ = f.local();
        f.touch(1);
        assert!(f.latch.validate(v));
    }));
    assert_eq!(
        client_busy(&sim, id) - before,
        3 * line_ns,
        "bucket + frame line 0 (latch word, pid, hot-path word) + line 1 (LRU)"
    );
}
