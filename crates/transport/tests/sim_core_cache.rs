//! `sim`'s private cache per memory-node core (docs/simulation.md, "A
//! private cache per core (branch i69)"): with `memnode.core_cache_bytes`
//! set, a line a core touched in an earlier job, and that nothing wrote
//! since, costs `core_cache_hit_ns`; on another core it costs the LLC's
//! `line_ns`; after a write by another core or by the NIC (a one-sided
//! WRITE), the LLC's `line_ns` again. The same script runs with the knob
//! off, where every warm line costs `line_ns`, as before.
//!
//! Checked to fail without the mechanism: with the private cache lookup
//! taken out of `Sim::charge_lines` the "on" expectations of step 1 fail
//! (`4 x line_ns` instead of `4 x core_cache_hit_ns`); with `touch_write`
//! returning at once, steps 4 and 5 fail (the written lines still priced
//! as private hits).

use dmkv_transport::exec::block_on;
use dmkv_transport::sim::Profile;

mod script_rig;
use script_rig::{Rig, Step, rig};

/// The default profile with a 64 KiB, 8-way LLC, no pair prefetcher, and,
/// if `on`, an 8 KiB, 4-way private cache per core with a 5 ns hit.
fn profile(on: bool) -> Profile {
    let mut p = Profile::default_profile();
    p.memnode.llc_bytes = 64 << 10;
    p.memnode.llc_ways = 8;
    p.memnode.pair_prefetch = false;
    let (bytes, ways, hit) = if on { (8 << 10, 4, 5) } else { (0, 0, 0) };
    p.memnode.core_cache_bytes = bytes;
    p.memnode.core_cache_ways = ways;
    p.memnode.core_cache_hit_ns = hit;
    p
}

/// Four lines, each its own access (a pointer chase).
const CHAIN: [Step; 4] = [
    Step::Word(3),
    Step::Word(900),
    Step::Word(17),
    Step::Word(4000),
];

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

/// The script of the module's doc on a rig with two handler cores: each
/// step's charged CPU per call (concurrent calls sorted, since which of
/// them takes which core is the core set's business), and the report.
fn script(on: bool) -> (Vec<Vec<u64>>, Vec<dmkv_transport::sim::ResourceUse>) {
    let r: Rig = rig(profile(on), 2);
    let mut steps = vec![
        // 0: cold, on one core: every line misses everything.
        vec![r.charged(&CHAIN)],
        // 1: the same core again (a core freed last is taken first).
        vec![r.charged(&CHAIN)],
        // 2: two calls at once, so both cores: one has the lines, one not.
        sorted(r.charged_together(&[&CHAIN, &CHAIN])),
        // 3: both cores have them now; one reads them all while the other
        // stores to line 17 (the read runs first: it arrived first).
        sorted(r.charged_together(&[&CHAIN, &[Step::Store(17)]])),
        // 4: the writer's copy of 17 is valid, the reader's is gone.
        sorted(r.charged_together(&[&CHAIN, &CHAIN])),
    ];
    // 5: the NIC writes line 900 (a one-sided WRITE from the client):
    // neither core's copy survives.
    let ep = r.sim.fabric().endpoint(r.client).unwrap();
    block_on(ep.write(r.region.at(900 * 64), &[7u8; 8])).unwrap();
    steps.push(sorted(r.charged_together(&[&CHAIN, &CHAIN])));
    (steps, r.sim.resources())
}

fn count(report: &[dmkv_transport::sim::ResourceUse], name: &str) -> Option<u64> {
    report.iter().find(|u| u.name == name).map(|u| u.count)
}

#[test]
fn a_private_hit_needs_the_same_core_and_no_write_since() {
    let m = profile(true).memnode;
    let (dram, line, hit) = (m.dram_miss_ns, m.line_ns, m.core_cache_hit_ns);
    assert!(hit < line);

    let (off, report_off) = script(false);
    assert_eq!(
        off,
        vec![
            vec![4 * dram],
            vec![4 * line],
            vec![4 * line, 4 * line],
            vec![line, 4 * line],
            vec![4 * line, 4 * line],
            vec![4 * line, 4 * line],
        ],
        "off: every warm line is an LLC hit"
    );
    assert!(
        !report_off.iter().any(|u| u.name.contains("private")),
        "no private rows without private caches"
    );

    let (on, report) = script(true);
    assert_eq!(
        on,
        vec![
            vec![4 * dram],
            vec![4 * hit],
            vec![4 * hit, 4 * line],
            vec![hit, 4 * hit],
            vec![4 * hit, 3 * hit + line],
            vec![3 * hit + line, 3 * hit + line],
        ],
        "on: private hits on the core that has the line, LLC prices elsewhere and after writes"
    );
    // Hits: 4 + 4 + (4 + 1) + (4 + 3) + (3 + 3) = 26; misses: the cold
    // 4, the other core's 4, 17 after the store, 900 on both cores.
    let name = |what: &str| format!("node0 handler cores private {what}");
    assert_eq!(count(&report, &name("hits")), Some(26));
    assert_eq!(count(&report, &name("misses")), Some(4 + 4 + 1 + 2));
    // The store removed 17 from one core, the NIC's write 900 from two.
    assert_eq!(count(&report, &name("invalidations")), Some(3));
    // The LLC saw only the private misses: 4 cold misses, 7 hits.
    assert_eq!(count(&report, "node0 llc misses"), Some(4));
    assert_eq!(count(&report, "node0 llc hits"), Some(7));
}

#[test]
fn the_same_script_gives_the_same_report() {
    let a = script(true);
    let b = script(true);
    assert_eq!(a, b);
}

#[test]
fn inconsistent_private_caches_are_refused() {
    let text = include_str!("../../../profiles/rolex-cx5.toml");
    assert!(text.contains("core_cache_bytes = "));
    let expect = |t: String, what: &str| {
        let e = Profile::parse(&t).unwrap_err();
        assert!(e.contains(what), "{e}");
    };
    expect(
        text.replace("core_cache_ways = ", "core_cache_ways = 0 # "),
        "core_cache_ways and memnode.core_cache_hit_ns must be positive",
    );
    expect(
        text.replace("core_cache_hit_ns = ", "core_cache_hit_ns = 0 # "),
        "must be positive",
    );
    expect(
        text.replace("core_cache_hit_ns = ", "core_cache_hit_ns = 500 # "),
        "cannot be slower than the last-level cache",
    );
    expect(
        text.replace("core_cache_bytes = ", "core_cache_bytes = 64 # "),
        "less than one set",
    );
    expect(
        text.replace("core_cache_bytes = ", "core_cache_bytes = 0 # "),
        "set but memnode.core_cache_bytes is 0",
    );
    expect(
        text.replace("llc_bytes = ", "llc_bytes = 0 # ")
            .replace("pair_prefetch = true", "pair_prefetch = false"),
        "core_cache_bytes needs the cache model",
    );
    // Off entirely (all three 0 or absent) is fine.
    let off = text
        .replace("core_cache_bytes = ", "core_cache_bytes = 0 # ")
        .replace("core_cache_ways = ", "core_cache_ways = 0 # ")
        .replace("core_cache_hit_ns = ", "# ");
    assert_eq!(Profile::parse(&off).unwrap().memnode.core_cache_bytes, 0);
}

#[test]
fn shipped_profiles_give_each_core_its_l2() {
    for (name, bytes, ways) in [
        ("xstore-cx4", 256 << 10, 8),
        ("rolex-cx5", 1 << 20, 16),
        ("outback-cx6", 1280 << 10, 20),
        ("scalestore-cx5", 1 << 20, 16),
    ] {
        let m = Profile::load(name).unwrap().memnode;
        assert_eq!(
            (m.core_cache_bytes, m.core_cache_ways),
            (bytes, ways),
            "{name}"
        );
        assert!(
            m.core_cache_hit_ns > 0 && m.core_cache_hit_ns < m.line_ns,
            "{name}"
        );
    }
    // --llc-keys scales the private caches with the LLC.
    let mut p = Profile::load("xstore-cx4").unwrap();
    p.scale_llc(1_000_000, 100_000_000).unwrap();
    assert_eq!(p.memnode.core_cache_bytes, (256 << 10) / 100);
    p.scale_llc(1, 1 << 40).unwrap();
    assert_eq!(p.memnode.core_cache_bytes, 64 * 8, "one set stays");
}
