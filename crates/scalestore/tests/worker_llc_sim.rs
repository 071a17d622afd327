//! `scalestore.worker_lines=llc` (invariant 27, docs/scalestore.md "i88"):
//! on the simulated cluster a worker's lines in its own node's memory (the
//! frames and pages its B-tree walk reads) go through that node's LLC
//! model, as the artifact's workers share one socket's LLC with its
//! message handlers; with an LLC far smaller than the tree (the paper's
//! data size, `--llc-keys`) they miss it and cost `dram_miss_ns`. By
//! default (`flat`) they cost `line_ns` each and never touch the LLC.

mod common;

use common::Cluster;
use dmkv_api::sim_deploy::SimDeployment;
use dmkv_transport::exec::block_on;

/// `what` of node 0's LLC ("hits", "misses", "dependent misses").
fn llc(d: &SimDeployment, what: &str) -> u64 {
    d.sim
        .resources()
        .iter()
        .filter(|r| r.name.starts_with("node") && r.name.ends_with(&format!("llc {what}")))
        .map(|r| r.count)
        .sum()
}

fn client_busy(d: &SimDeployment) -> u64 {
    d.sim
        .resources()
        .iter()
        .filter(|r| r.name.contains("client core"))
        .map(|r| r.busy_ns)
        .sum()
}

/// One node, 400 keys, then 200 GETs: (client core ns, LLC dependent
/// misses) of the GETs alone.
fn gets(worker_lines: &str) -> (u64, u64) {
    let mut p = common::profile();
    // 16 lines: far smaller than the tree, as 19.25 MiB is against the
    // paper's 56 GB per node.
    p.memnode.llc_bytes = 16 * 64;
    p.memnode.llc_ways = 16;
    let knobs = [("worker_lines", worker_lines)];
    let d = Cluster {
        profile: Some(p),
        knobs: &knobs,
        ..Cluster::new(1, 3)
    }
    .deploy();
    let (_ep, store) = d.client(0).unwrap();
    block_on(async {
        for k in 0..400u64 {
            store.upsert(k * 7919, &k.to_le_bytes()).await.unwrap();
        }
    });
    let (busy, misses) = (client_busy(&d), llc(&d, "dependent misses"));
    block_on(async {
        for i in 0..200u64 {
            let k = (i * 37 % 400) * 7919;
            let v = store.get(k).await.unwrap().expect("loaded");
            assert_eq!(v, (k / 7919).to_le_bytes());
        }
    });
    (client_busy(&d) - busy, llc(&d, "dependent misses") - misses)
}

#[test]
fn a_workers_lines_miss_a_small_llc_only_with_worker_lines_llc() {
    let (flat_ns, flat_misses) = gets("flat");
    let (llc_ns, llc_misses) = gets("llc");
    assert_eq!(
        flat_misses, 0,
        "flat: the workers' lines never reach the LLC"
    );
    assert!(
        llc_misses >= 200,
        "every GET's walk misses the 16-line LLC at least once: {llc_misses}"
    );
    let p = common::profile().memnode;
    assert!(
        llc_ns >= flat_ns + llc_misses * (p.dram_miss_ns - p.line_ns),
        "each dependent miss costs dram_miss_ns instead of line_ns: {llc_ns} vs {flat_ns}"
    );
}

#[test]
fn worker_lines_takes_flat_or_llc() {
    let knobs = [("worker_lines", "l3")];
    let r = std::panic::catch_unwind(|| {
        Cluster {
            knobs: &knobs,
            ..Cluster::new(1, 3)
        }
        .deploy()
    });
    assert!(r.is_err(), "an unknown value is refused");
}
