//! The simulated compute CPU for an engine's work in its own node's memory
//! (`Endpoint::charged`, `touch_local_lines`; docs/simulation.md, "The
//! hardware model", compute CPU): on `sim` every line a charged operation
//! touches costs the profile's `line_ns` on the thread's core, flat (no
//! cache model, no DRAM miss), charged when the operation ends; lines
//! touched outside a charged operation, or by another task while it waits,
//! are not its own; on `local` nothing is charged. An operation is charged
//! its DISTINCT lines: touching a line again in the same operation (even
//! after an await) costs nothing more ("Distinct lines per operation").

use dmkv_transport::exec::{LocalTask, block_on, run_tasks, sleep};
use dmkv_transport::local::{LocalCluster, LocalConfig};
use dmkv_transport::sim::{Profile, SimConfig, Simulation};
use dmkv_transport::time::Instant;
use dmkv_transport::{Endpoint, NodeHost, RegionMem, touch_local_at, touch_local_lines};
use std::rc::Rc;
use std::time::Duration;

/// A profile with a small LLC, so that a line that went through the cache
/// model would cost `dram_miss_ns` when cold: the compute side must not.
fn profile() -> Profile {
    let mut p = Profile::default_profile();
    p.memnode.llc_bytes = 64 << 10;
    p.memnode.llc_ways = 8;
    assert!(p.memnode.dram_miss_ns > p.memnode.line_ns);
    p
}

fn sim() -> Simulation {
    Simulation::new(SimConfig {
        profile: profile(),
        seed: 7,
        jitter_ns: 0,
        delays: Default::default(),
    })
}

/// The busy time of `node`'s client cores so far.
fn client_busy(sim: &Simulation, node: u16) -> u64 {
    sim.resources()
        .iter()
        .filter(|r| r.name.starts_with(&format!("node{node} client core")))
        .map(|r| r.busy_ns)
        .sum()
}

/// 4 lines in one read (bytes 0..256), 1 line (the word at 1024), and 3
/// lines reported by hand: 8 lines; returns a value read, to check that
/// the operation's output comes through.
fn work(mem: &RegionMem) -> u64 {
    let mut buf = [0u8; 256];
    mem.read(0, &mut buf).unwrap();
    let w = mem.load_u64(1024).unwrap();
    touch_local_lines(3);
    w + buf[0] as u64
}

#[test]
fn a_charged_operation_costs_line_ns_per_line_on_its_core() {
    let sim = sim();
    let line_ns = sim.profile().memnode.line_ns;
    let node = sim.add_node(0);
    let (_r, mem) = node.register_region(1 << 16).unwrap();
    mem.store_u64(1024, 41).unwrap();
    let ep: Endpoint = sim.fabric().endpoint(node.id()).unwrap();
    let id = node.id().0;

    // Outside `charged`, the same accesses cost nothing.
    let t0 = sim.now_ns();
    assert_eq!(work(&mem), 41);
    touch_local_lines(100);
    assert_eq!(sim.now_ns(), t0);
    assert_eq!(client_busy(&sim, id), 0);

    // Cold lines under a cache model: still `line_ns` each.
    let out = block_on(ep.charged(async { work(&mem) }));
    assert_eq!(out, 41);
    assert_eq!(sim.now_ns() - t0, 8 * line_ns, "8 lines, flat");
    assert_eq!(client_busy(&sim, id), 8 * line_ns);
    assert!(
        sim.resources().iter().all(|r| !r.name.contains("llc")),
        "the compute side's lines do not go through the memory node's cache"
    );

    // Nothing touched: nothing charged, no wait.
    let t1 = sim.now_ns();
    block_on(ep.charged(async {}));
    assert_eq!(sim.now_ns(), t1);
    assert_eq!(client_busy(&sim, id), 8 * line_ns);
}

#[test]
fn lines_touched_while_an_operation_waits_are_not_its_own() {
    let sim = sim();
    let line_ns = sim.profile().memnode.line_ns;
    let node = sim.add_node(0);
    let (_r, mem) = node.register_region(1 << 16).unwrap();
    let ep = Rc::new(sim.fabric().endpoint(node.id()).unwrap());
    let (m1, m2, e1) = (mem.clone(), mem.clone(), ep.clone());
    // Task A (charged): 2 lines, a 1 µs wait, 1 line. Task B (not
    // charged) touches 50 lines during A's wait.
    let a: LocalTask<'_, u64> = Box::pin(async move {
        let start = Instant::now();
        e1.charged(async {
            m1.load_u64(0).unwrap();
            m1.load_u64(4096).unwrap();
            sleep(Duration::from_micros(1)).await;
            m1.load_u64(8192).unwrap();
        })
        .await;
        (Instant::now() - start).as_nanos() as u64
    });
    let b: LocalTask<'_, u64> = Box::pin(async move {
        sleep(Duration::from_nanos(500)).await;
        let mut buf = vec![0u8; 50 * 64];
        m2.read(0, &mut buf).unwrap();
        touch_local_lines(7);
        0
    });
    let out = run_tasks(vec![a, b]);
    assert_eq!(
        out[0],
        1_000 + 3 * line_ns,
        "A waited 1 µs, then its 3 lines"
    );
    assert_eq!(client_busy(&sim, node.id().0), 3 * line_ns);
}

#[test]
fn on_the_local_transport_charged_runs_the_operation_and_charges_nothing() {
    let cluster = LocalCluster::new(LocalConfig::default());
    let node = cluster.add_node(0);
    let (_r, mem) = node.register_region(1 << 16).unwrap();
    mem.store_u64(1024, 41).unwrap();
    let ep = cluster.fabric().endpoint(node.id()).unwrap();
    let before = ep.total_counters();
    let out = block_on(ep.charged(async { work(&mem) }));
    assert_eq!(out, 41);
    assert_eq!(
        ep.total_counters(),
        before,
        "no verb, round trip or CPU counted"
    );
}

#[test]
fn one_line_touched_a_hundred_times_is_charged_once() {
    let sim = sim();
    let line_ns = sim.profile().memnode.line_ns;
    let node = sim.add_node(0);
    let (_r, mem) = node.register_region(1 << 16).unwrap();
    let ep: Endpoint = sim.fabric().endpoint(node.id()).unwrap();
    let id = node.id().0;
    let t0 = sim.now_ns();
    block_on(ep.charged(async {
        for i in 0..100u64 {
            // The 8 words of line 2, round and round.
            mem.load_u64(128 + 8 * (i % 8)).unwrap();
        }
    }));
    assert_eq!(sim.now_ns() - t0, line_ns, "one distinct line");
    assert_eq!(client_busy(&sim, id), line_ns);

    // The next operation starts with an empty set: the same line costs
    // again.
    block_on(ep.charged(async {
        mem.load_u64(128).unwrap();
    }));
    assert_eq!(
        client_busy(&sim, id),
        2 * line_ns,
        "reset between operations"
    );
}

#[test]
fn a_page_walked_word_by_word_costs_what_one_copy_of_it_costs() {
    let sim = sim();
    let line_ns = sim.profile().memnode.line_ns;
    let node = sim.add_node(0);
    let (_r, mem) = node.register_region(1 << 16).unwrap();
    let ep: Endpoint = sim.fabric().endpoint(node.id()).unwrap();
    let id = node.id().0;
    // 512 word loads of the page at 4096, then a copy of it and a write
    // of its first half: still its 64 lines.
    block_on(ep.charged(async {
        for w in 0..512u64 {
            mem.load_u64(4096 + 8 * w).unwrap();
        }
        let mut page = vec![0u8; 4096];
        mem.read(4096, &mut page).unwrap();
        mem.write(4096, &page[..2048]).unwrap();
    }));
    assert_eq!(client_busy(&sim, id), 64 * line_ns);
    // A copy of the page alone: the same.
    block_on(ep.charged(async {
        let mut page = vec![0u8; 4096];
        mem.read(4096, &mut page).unwrap();
    }));
    assert_eq!(client_busy(&sim, id), 128 * line_ns);
    // A read that straddles two lines counts both; the same offsets of
    // another region are other lines.
    let (_r2, other) = node.register_region(1 << 12).unwrap();
    block_on(ep.charged(async {
        let mut b = [0u8; 16];
        mem.read(56, &mut b).unwrap();
        other.read(56, &mut b).unwrap();
    }));
    assert_eq!(client_busy(&sim, id), 132 * line_ns);
}

#[test]
fn a_line_touched_before_and_after_an_await_is_one_line() {
    let sim = sim();
    let line_ns = sim.profile().memnode.line_ns;
    let node = sim.add_node(0);
    let (_r, mem) = node.register_region(1 << 16).unwrap();
    let ep = Rc::new(sim.fabric().endpoint(node.id()).unwrap());
    let (m1, m2, e1, e2) = (mem.clone(), mem.clone(), ep.clone(), ep.clone());
    // A and B are both charged and interleave at their sleeps; each
    // touches line 0 and its own line twice, around its await.
    let a: LocalTask<'_, u64> = Box::pin(async move {
        e1.charged(async {
            m1.load_u64(0).unwrap();
            m1.load_u64(640).unwrap();
            sleep(Duration::from_micros(1)).await;
            m1.load_u64(8).unwrap();
            m1.load_u64(648).unwrap();
        })
        .await;
        0
    });
    let b: LocalTask<'_, u64> = Box::pin(async move {
        e2.charged(async {
            sleep(Duration::from_nanos(500)).await;
            m2.load_u64(0).unwrap();
            m2.load_u64(1280).unwrap();
            sleep(Duration::from_micros(1)).await;
            m2.load_u64(1288).unwrap();
        })
        .await;
        0
    });
    run_tasks(vec![a, b]);
    assert_eq!(
        client_busy(&sim, node.id().0),
        4 * line_ns,
        "2 lines each: a set per operation, kept across its awaits"
    );
}

#[test]
fn objects_touched_by_address_count_once_and_notes_count_as_given() {
    let sim = sim();
    let line_ns = sim.profile().memnode.line_ns;
    let node = sim.add_node(0);
    let ep: Endpoint = sim.fabric().endpoint(node.id()).unwrap();
    let id = node.id().0;
    let words = [0u64; 4];
    block_on(ep.charged(async {
        for _ in 0..10 {
            touch_local_at(&words[0]);
            touch_local_at(&words[1]);
        }
        // Address-less notes: no deduplication.
        touch_local_lines(1);
        touch_local_lines(1);
    }));
    assert_eq!(client_busy(&sim, id), 4 * line_ns, "2 objects + 2 notes");
    // Outside `charged`: nothing.
    touch_local_at(&words[2]);
    assert_eq!(client_busy(&sim, id), 4 * line_ns);
}

/// `sim::charge_private_lines` (a job's private arrays, on a memory-node
/// core) inside a charged compute operation: the lines are the operation's,
/// charged at `line_ns` each on its core when it ends, like
/// `touch_local_lines` notes (it used to add `lines * u64::MAX`, wrapped,
/// to the clock and charge the operation nothing).
#[test]
fn private_lines_inside_a_charged_operation_are_charged_to_it() {
    let sim = sim();
    let line_ns = sim.profile().memnode.line_ns;
    let node = sim.add_node(0);
    let ep: Endpoint = sim.fabric().endpoint(node.id()).unwrap();
    let t0 = sim.now_ns();
    block_on(ep.charged(async {
        dmkv_transport::sim::charge_private_lines(5);
    }));
    assert_eq!(sim.now_ns() - t0, 5 * line_ns);
    assert_eq!(client_busy(&sim, node.id().0), 5 * line_ns);
    // Outside one (and off any simulated core): nothing.
    dmkv_transport::sim::charge_private_lines(5);
    assert_eq!(client_busy(&sim, node.id().0), 5 * line_ns);
}

/// A node declared with `sim::set_compute_llc` (ScaleStore's
/// `worker_lines=llc`, invariant 27 of docs/scalestore.md) prices a charged
/// operation's lines of its memory through its LLC model: a cold line that
/// an access starts with costs `dram_miss_ns`, the access's further lines
/// `line_ns`, a line the LLC holds `line_ns`; address-less notes and the
/// lines of an undeclared node stay flat.
#[test]
fn a_node_declared_with_compute_llc_prices_its_lines_through_its_llc() {
    let mut p = profile();
    p.memnode.pair_prefetch = false;
    p.memnode.core_cache_bytes = 0;
    let sim = Simulation::new(SimConfig {
        profile: p,
        seed: 7,
        jitter_ns: 0,
        delays: Default::default(),
    });
    let (line_ns, miss_ns) = (
        sim.profile().memnode.line_ns,
        sim.profile().memnode.dram_miss_ns,
    );
    let node = sim.add_node(0);
    let flat_node = sim.add_node(0);
    assert!(dmkv_transport::sim::set_compute_llc(node.id()));
    let (_r, mem) = node.register_region(1 << 16).unwrap();
    let (_f, flat_mem) = flat_node.register_region(1 << 16).unwrap();
    let ep: Endpoint = sim.fabric().endpoint(node.id()).unwrap();
    let fep: Endpoint = sim.fabric().endpoint(flat_node.id()).unwrap();
    let id = node.id().0;
    let words = |m: &RegionMem| {
        // Three dependent probes on three lines, one line twice.
        for off in [0u64, 640, 1280, 8] {
            m.load_u64(off).unwrap();
        }
    };
    // Cold: three misses, each the first line of its access.
    block_on(ep.charged(async { words(&mem) }));
    assert_eq!(client_busy(&sim, id), 3 * miss_ns, "3 dependent misses");
    // Warm: the LLC holds them.
    block_on(ep.charged(async { words(&mem) }));
    assert_eq!(client_busy(&sim, id), 3 * miss_ns + 3 * line_ns);
    // One access of four cold lines: its first line's miss, then three
    // overlapped lines; two notes, flat.
    block_on(ep.charged(async {
        let mut b = [0u8; 256];
        mem.read(4096, &mut b).unwrap();
        touch_local_lines(2);
    }));
    assert_eq!(
        client_busy(&sim, id),
        3 * miss_ns + 3 * line_ns + miss_ns + 3 * line_ns + 2 * line_ns
    );
    // An undeclared node's lines: flat, cold as they are.
    block_on(fep.charged(async { words(&flat_mem) }));
    assert_eq!(client_busy(&sim, flat_node.id().0), 3 * line_ns);
}

/// Without an LLC in the profile there is nothing to price through:
/// `set_compute_llc` says so and the lines stay flat.
#[test]
fn set_compute_llc_without_an_llc_changes_nothing() {
    let mut p = profile();
    p.memnode.llc_bytes = 0;
    let sim = Simulation::new(SimConfig {
        profile: p,
        seed: 7,
        jitter_ns: 0,
        delays: Default::default(),
    });
    let line_ns = sim.profile().memnode.line_ns;
    let node = sim.add_node(0);
    assert!(!dmkv_transport::sim::set_compute_llc(node.id()));
    let (_r, mem) = node.register_region(1 << 16).unwrap();
    let ep: Endpoint = sim.fabric().endpoint(node.id()).unwrap();
    block_on(ep.charged(async { work(&mem) }));
    assert_eq!(client_busy(&sim, node.id().0), 8 * line_ns);
}
