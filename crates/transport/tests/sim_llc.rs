//! `sim`'s memory-node cache model, checked against its own rule
//! (docs/simulation.md, "Memory-node CPU"): a handler's service time is
//! `rpc_base_ns` plus, per access (one region read or write), `dram_miss_ns`
//! if the access's first line misses the node's LLC or `line_ns` if it hits,
//! and `line_ns` for each further line of the access. Every script here
//! touches each line once per call, so the distinct-lines rule of branch
//! i46 (a re-touch in the same call is free: `sim_job_lines.rs`) charges
//! them exactly as the per-access rule did.

use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimConfig, Simulation};
use dmkv_transport::{NodeHost, RpcContext};
use std::sync::Arc;

/// A simulation with one memory node (one handler core, a 1 MiB region)
/// under `profile`, serving `chase` (8-byte reads of each line listed in
/// the request, one access each: a pointer chase) and `span` (one read of
/// the lines from the first listed to the second, one access).
struct Rig {
    sim: Simulation,
    server: dmkv_transport::NodeId,
    client: dmkv_transport::NodeId,
    chase: dmkv_transport::ServiceId,
    span: dmkv_transport::ServiceId,
}

fn rig(profile: Profile) -> Rig {
    let sim = Simulation::new(SimConfig {
        profile,
        seed: 1,
        jitter_ns: 0,
        delays: Default::default(),
    });
    let node = sim.add_node(1);
    let (_region, mem) = node.register_region(1 << 20).unwrap();
    let lines = |req: &[u8]| -> Vec<u64> {
        req.chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    let m = mem.clone();
    let chase = node
        .services()
        .register(
            "chase",
            Arc::new(move |_: &RpcContext, req: &[u8]| {
                let mut x = 0u64;
                for l in lines(req) {
                    x ^= m.load_u64(l * 64).unwrap();
                }
                Ok(x.to_le_bytes().to_vec())
            }),
        )
        .unwrap();
    let span = node
        .services()
        .register(
            "span",
            Arc::new(move |_: &RpcContext, req: &[u8]| {
                let l = lines(req);
                let mut out = vec![0u8; ((l[1] - l[0] + 1) * 64) as usize];
                mem.read(l[0] * 64, &mut out).unwrap();
                Ok(vec![out.iter().fold(0, |a, b| a ^ b)])
            }),
        )
        .unwrap();
    let server = node.id();
    let client = sim.add_node(0).id();
    Rig {
        sim,
        server,
        client,
        chase,
        span,
    }
}

impl Rig {
    /// The handler core's busy time for one call.
    fn service_ns(&self, svc: dmkv_transport::ServiceId, lines: &[u64]) -> u64 {
        let busy = || {
            self.sim
                .resources()
                .iter()
                .find(|r| r.name.contains("handler"))
                .map_or(0, |r| r.busy_ns)
        };
        let before = busy();
        let ep = self.sim.fabric().endpoint(self.client).unwrap();
        let req: Vec<u8> = lines.iter().flat_map(|l| l.to_le_bytes()).collect();
        block_on(ep.call(self.server, svc, req)).unwrap();
        busy() - before
    }

    fn count(&self, what: &str) -> u64 {
        self.sim
            .resources()
            .iter()
            .find(|r| r.name == format!("node0 llc {what}"))
            .map_or(0, |r| r.count)
    }
}

/// The default profile with a 64 KiB, 8-way LLC (1024 lines), without the
/// pair prefetcher (the tests of the base rule; the prefetcher's are at
/// the end).
fn small_llc() -> Profile {
    let mut p = Profile::default_profile();
    p.memnode.llc_bytes = 64 << 10;
    p.memnode.llc_ways = 8;
    p.memnode.pair_prefetch = false;
    // The LLC rule alone (private caches: sim_core_cache.rs).
    p.memnode.core_cache_bytes = 0;
    p.memnode.core_cache_ways = 0;
    p.memnode.core_cache_hit_ns = 0;
    p
}

#[test]
fn a_pointer_chase_pays_the_dram_latency_per_missing_step_and_line_ns_once_cached() {
    let p = small_llc();
    let m = p.memnode.clone();
    let r = rig(p);
    let chain = [3, 900, 17, 4000, 123, 777, 2048, 11];
    assert_eq!(
        r.service_ns(r.chase, &chain),
        m.rpc_base_ns + 8 * m.dram_miss_ns,
        "cold: every step misses and waits for DRAM"
    );
    assert_eq!(
        r.service_ns(r.chase, &chain),
        m.rpc_base_ns + 8 * m.line_ns,
        "warm: 8 lines fit the cache, every step hits"
    );
    assert_eq!(
        (
            r.count("hits"),
            r.count("misses"),
            r.count("dependent misses")
        ),
        (8, 8, 8)
    );
}

#[test]
fn the_lines_of_one_access_overlap_behind_its_first_miss() {
    let p = small_llc();
    let m = p.memnode.clone();
    let r = rig(p);
    // Lines 100..=107: one access of 8 lines.
    assert_eq!(
        r.service_ns(r.span, &[100, 107]),
        m.rpc_base_ns + m.dram_miss_ns + 7 * m.line_ns
    );
    assert_eq!(
        r.service_ns(r.span, &[100, 107]),
        m.rpc_base_ns + 8 * m.line_ns
    );
    assert_eq!(
        (
            r.count("hits"),
            r.count("misses"),
            r.count("dependent misses")
        ),
        (8, 8, 1)
    );
}

#[test]
fn a_working_set_larger_than_the_cache_keeps_missing() {
    let p = small_llc();
    let m = p.memnode.clone();
    let r = rig(p);
    // 4096 distinct lines (4x the cache), visited in the same order twice:
    // LRU holds none of them when they come round again.
    let chain: Vec<u64> = (0..4096).map(|i| (i * 7919) % 16384).collect();
    r.service_ns(r.chase, &chain);
    let second = r.service_ns(r.chase, &chain);
    let all_miss = m.rpc_base_ns + 4096 * m.dram_miss_ns;
    assert!(
        second as f64 > 0.95 * all_miss as f64,
        "second pass {second} ns, all misses {all_miss} ns"
    );
}

#[test]
fn without_a_cache_in_the_profile_every_line_costs_line_ns() {
    let mut p = small_llc();
    p.memnode.llc_bytes = 0;
    let m = p.memnode.clone();
    let r = rig(p);
    assert_eq!(
        r.service_ns(r.chase, &[1, 2, 3, 400]),
        m.rpc_base_ns + 4 * m.line_ns
    );
    assert_eq!(
        r.service_ns(r.span, &[10, 19]),
        m.rpc_base_ns + 10 * m.line_ns
    );
    assert_eq!(r.count("misses"), 0, "no cache rows without a cache");
}

#[test]
fn the_pair_prefetcher_brings_a_missing_lines_buddy() {
    // The same script with and without `pair_prefetch`: lines 10 and 11
    // (one 128-byte pair, 10 first), 13 and 12 (one pair, 13 first), 21
    // and 22 (two pairs), each line its own access (a pointer chase).
    let script: [&[u64]; 3] = [&[10, 11], &[13, 12], &[21, 22]];
    let mut p = small_llc();
    let m = p.memnode.clone();
    {
        // One simulation per thread at a time: this one ends here.
        let r = rig(p.clone());
        let off: Vec<u64> = script.iter().map(|s| r.service_ns(r.chase, s)).collect();
        assert_eq!(off, vec![m.rpc_base_ns + 2 * m.dram_miss_ns; 3]);
        assert!(
            !r.sim
                .resources()
                .iter()
                .any(|u| u.name.contains("prefetched")),
            "no prefetch row without the prefetcher"
        );
    }

    p.memnode.pair_prefetch = true;
    let r = rig(p);
    let on: Vec<u64> = script.iter().map(|s| r.service_ns(r.chase, s)).collect();
    let one_miss = m.rpc_base_ns + m.dram_miss_ns + m.line_ns;
    assert_eq!(
        on,
        vec![one_miss, one_miss, m.rpc_base_ns + 2 * m.dram_miss_ns],
        "a miss brings its pair's other line, whichever comes first; other pairs still miss"
    );
    // 10, 13, 21, 22 missed and brought 11, 12, 20, 23; 11 and 12 hit.
    assert_eq!(
        (
            r.count("hits"),
            r.count("misses"),
            r.count("dependent misses"),
            r.count("prefetched lines")
        ),
        (2, 4, 4, 4)
    );
    let row = r
        .sim
        .resources()
        .into_iter()
        .find(|u| u.name == "node0 llc prefetched lines")
        .unwrap();
    assert_eq!(row.bytes, 4 * 64, "prefetched lines come from DRAM");
    // The prefetched buddies of 21 and 22 are in the cache now.
    assert_eq!(
        r.service_ns(r.chase, &[20, 23]),
        m.rpc_base_ns + 2 * m.line_ns
    );
    // A prefetch that finds its line present changes nothing: 11 is
    // cached, so 10's miss after an eviction would not count it again;
    // here 10 and 11 both hit, and the count stays.
    assert_eq!(
        r.service_ns(r.chase, &[10, 11]),
        m.rpc_base_ns + 2 * m.line_ns
    );
    assert_eq!(r.count("prefetched lines"), 4);
}
