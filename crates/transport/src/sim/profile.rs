//! Hardware profiles of the simulated cluster: data, not code.
//!
//! A profile is a TOML file (the shipped ones live in `profiles/` at the
//! repository root and are compiled in, so `--profile rolex-cx5` works from
//! any directory; `--profile path/to/file.toml` loads another). Every number
//! has its source in `docs/simulation.md`.

use serde::{Deserialize, Serialize};
use std::path::Path;

/// The network: NICs, wire and the PCIe path to memory.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NetworkProfile {
    /// One-way latency from one NIC to another (wire, switch, NIC pipeline).
    pub one_way_ns: u64,
    /// Messages per second each NIC processes in each direction (Mops).
    pub nic_msg_rate_mops: f64,
    /// Link bandwidth per direction, Gbit/s.
    pub link_gbps: f64,
    /// Bytes of headers per message on the wire (transport + link).
    pub header_bytes: u64,
    /// PCIe bandwidth between a memory node's NIC and its DRAM, Gbit/s: how
    /// fast a large read is fetched or a large write lands.
    pub pcie_gbps: f64,
    /// How long the NIC's atomics unit holds one 8-byte address per atomic
    /// (atomics on the same address serialise).
    pub atomic_ns: u64,
    /// Connection (RC queue pair) contexts the NIC keeps in its on-chip
    /// cache; a one-sided verb whose connection is not cached makes the NIC
    /// fetch the context from host memory first. 0: not modelled (every
    /// context fits).
    #[serde(default)]
    pub qp_cache_entries: u64,
    /// NIC time to fetch a missing connection context over PCIe (ns).
    #[serde(default)]
    pub qp_miss_ns: u64,
    /// NICs per machine (every node, compute and memory), each with its
    /// own message rate, link and connection cache as above. A node's
    /// `k`-th thread uses its NIC `k mod nics` and the peer's NIC `k mod
    /// nics` (docs/simulation.md, "The hardware model"). Default 1.
    #[serde(default = "one")]
    pub nics: u64,
}

fn one() -> u64 {
    1
}

/// The CPU of a compute thread.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ClientProfile {
    /// Per operation (request generation, the engine's own index work).
    pub cpu_per_op_ns: u64,
    /// Spread of that time: each operation's CPU is drawn (seeded)
    /// uniformly from `cpu_per_op_ns - s ..= cpu_per_op_ns + s`, so its mean
    /// stays `cpu_per_op_ns`; at most `cpu_per_op_ns`. 0 (the default, and
    /// every shipped profile): every operation takes `cpu_per_op_ns`
    /// exactly. An experimental control, not a measured figure: a closed
    /// loop of identical clients with constant service times can lock into
    /// phase, and which locked schedule a run ends in changes its
    /// throughput (docs/simulation.md, "Phase effects"); a spread of the
    /// clients' own time randomises the phases without changing a mean
    /// cost. `--cpu-spread-ns` overrides it.
    #[serde(default)]
    pub cpu_per_op_spread_ns: u64,
    /// Per posted verb or RPC (building and ringing the work request, polling
    /// its completion).
    pub cpu_per_verb_ns: u64,
}

/// The CPU of a memory node (or a symmetric node's serving side).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MemnodeProfile {
    /// Per RPC served: receive, dispatch, reply (the message cost).
    pub rpc_base_ns: u64,
    /// Per cache line of registered memory a handler or job touches that
    /// hits the last-level cache, or that misses but overlaps with the
    /// first line of its access (see `dram_miss_ns`).
    pub line_ns: u64,
    /// Per background job (waking a worker, bookkeeping).
    pub job_base_ns: u64,
    /// The memory node's last-level cache per socket (the CPU's data
    /// sheet), bytes; 0: not modelled, every line costs `line_ns`.
    #[serde(default)]
    pub llc_bytes: u64,
    /// Its associativity (lines per set).
    #[serde(default)]
    pub llc_ways: u64,
    /// A dependent load that misses the last-level cache: the first line of
    /// an access that misses waits this long for DRAM (idle load-to-use
    /// latency of the CPU, published measurements).
    #[serde(default)]
    pub dram_miss_ns: u64,
    /// The L2 adjacent-line ("spatial") prefetcher: a line that misses the
    /// modelled cache also brings the other line of its 128-byte-aligned
    /// pair into it (Intel 64 and IA-32 Architectures Optimization
    /// Reference Manual, "Data Prefetching": the spatial prefetcher
    /// "strives to complete every cache line fetched to the L2 cache with
    /// the pair line that completes it to a 128-byte aligned chunk").
    /// Needs the cache model (`llc_bytes` > 0). Off (false) when absent;
    /// docs/simulation.md, "Memory-node CPU".
    #[serde(default)]
    pub pair_prefetch: bool,
    /// The memory node CPU's clock, GHz (its data sheet's base clock), for
    /// the instruction term: work a handler or job declares in
    /// instructions ([`crate::sim::work`]) costs `instructions / (cpu_ghz x
    /// ipc)` ns. 0 (with `ipc` 0): no instruction term, declared work is
    /// free (the model of earlier versions).
    #[serde(default)]
    pub cpu_ghz: f64,
    /// Instructions per cycle of handler code apart from its memory
    /// accesses (those are charged per line): an assumption, see
    /// docs/simulation.md ("An instruction term for memory-node jobs").
    #[serde(default)]
    pub ipc: f64,
    /// The share of its core's instruction rate each simulated thread of
    /// the node gets, in (0, 1]: 1 (the default) when every simulated
    /// thread (handler core, worker) has a physical core to itself. Below 1
    /// where the testbed pins two threads that never idle (they poll) to
    /// the two hardware threads of one core (simultaneous multithreading),
    /// so that each issues instructions at this share of a core running it
    /// alone. It scales the instruction term only: handlers' and jobs'
    /// declared work, and work charged on a compute thread with
    /// `Endpoint::charge_instructions` (the harness's value generation:
    /// ScaleStore's workers, the one testbed that shares cores, are its
    /// compute threads), which is priced with this CPU's term. Lines
    /// (memory stalls) are not slowed, and the `[client]` constants are
    /// left as they are. docs/simulation.md, "Profiles" (ScaleStore's
    /// pinning).
    #[serde(default = "solo_core")]
    pub smt_share: f64,
    /// Each memory-node core's private cache (its L2, with L1 folded in),
    /// bytes: a line the core touched in an earlier job and that nothing
    /// wrote since costs `core_cache_hit_ns` instead of going to the
    /// last-level cache (docs/simulation.md, "Memory-node CPU" and "A
    /// private cache per core (branch i69)"). 0 (the default): no private
    /// cache, every line goes to the last-level cache model as before.
    /// Needs the cache model (`llc_bytes` > 0).
    #[serde(default)]
    pub core_cache_bytes: u64,
    /// Its associativity (lines per set).
    #[serde(default)]
    pub core_cache_ways: u64,
    /// Per line that hits a core's private cache: its load-to-use latency
    /// (the CPU's L2 latency in cycles at its base clock, rounded to ns).
    #[serde(default)]
    pub core_cache_hit_ns: u64,
}

/// `smt_share` when a profile leaves it out: a core per simulated thread.
fn solo_core() -> f64 {
    1.0
}

impl MemnodeProfile {
    /// Instructions per microsecond of the instruction term (`cpu_ghz x ipc
    /// x smt_share x 1000`, rounded), 0 when the profile has none: integer,
    /// so that the charge is exact and the same on every machine.
    pub fn instructions_per_us(&self) -> u64 {
        (self.cpu_ghz * self.ipc * self.smt_share * 1000.0).round() as u64
    }
}

/// A node's SSD (ScaleStore).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SsdProfile {
    pub read_ns: u64,
    pub write_ns: u64,
    /// I/O operations per second the device sustains (K IOPS).
    pub kiops: f64,
}

/// A whole testbed.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profile {
    pub name: String,
    pub description: String,
    pub network: NetworkProfile,
    pub client: ClientProfile,
    pub memnode: MemnodeProfile,
    pub ssd: SsdProfile,
}

/// The profiles shipped with dmkv, by name.
pub const SHIPPED: &[(&str, &str)] = &[
    (
        "xstore-cx4",
        include_str!("../../../../profiles/xstore-cx4.toml"),
    ),
    (
        "rolex-cx5",
        include_str!("../../../../profiles/rolex-cx5.toml"),
    ),
    (
        "outback-cx6",
        include_str!("../../../../profiles/outback-cx6.toml"),
    ),
    (
        "scalestore-cx5",
        include_str!("../../../../profiles/scalestore-cx5.toml"),
    ),
];

/// The profile used when none is named.
pub const DEFAULT_PROFILE: &str = "rolex-cx5";

impl Profile {
    /// Parses a profile and checks that its numbers make sense.
    pub fn parse(text: &str) -> Result<Profile, String> {
        let p: Profile = toml::from_str(text).map_err(|e| e.to_string())?;
        p.validate()?;
        Ok(p)
    }

    /// A shipped profile by name, or a TOML file by path.
    pub fn load(name_or_path: &str) -> Result<Profile, String> {
        if let Some((_, text)) = SHIPPED.iter().find(|(n, _)| *n == name_or_path) {
            return Profile::parse(text)
                .map_err(|e| format!("shipped profile {name_or_path}: {e}"));
        }
        let path = Path::new(name_or_path);
        if !path.exists() {
            let names: Vec<&str> = SHIPPED.iter().map(|(n, _)| *n).collect();
            return Err(format!(
                "no profile {name_or_path:?}: name a shipped one ({}) or a TOML file",
                names.join(", ")
            ));
        }
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading profile {}: {e}", path.display()))?;
        Profile::parse(&text).map_err(|e| format!("profile {}: {e}", path.display()))
    }

    /// The default profile.
    pub fn default_profile() -> Profile {
        Profile::load(DEFAULT_PROFILE).expect("the shipped default profile parses")
    }

    fn validate(&self) -> Result<(), String> {
        let n = &self.network;
        let c = &self.client;
        if c.cpu_per_op_spread_ns > c.cpu_per_op_ns {
            return Err(format!(
                "client.cpu_per_op_spread_ns ({}) is more than client.cpu_per_op_ns ({}): an operation cannot take less than no time",
                c.cpu_per_op_spread_ns, c.cpu_per_op_ns
            ));
        }
        for (what, v) in [
            ("network.nic_msg_rate_mops", n.nic_msg_rate_mops),
            ("network.link_gbps", n.link_gbps),
            ("network.pcie_gbps", n.pcie_gbps),
            ("ssd.kiops", self.ssd.kiops),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(format!("{what} must be a positive number, not {v}"));
            }
        }
        let m = &self.memnode;
        if m.llc_bytes > 0 && (m.llc_ways == 0 || m.dram_miss_ns == 0) {
            return Err(
                "memnode.llc_bytes is set, so memnode.llc_ways and memnode.dram_miss_ns must be positive"
                    .into(),
            );
        }
        if m.llc_bytes > 0 && m.llc_bytes < 64 * m.llc_ways {
            return Err(format!(
                "memnode.llc_bytes {} is less than one set ({} ways of 64 bytes)",
                m.llc_bytes, m.llc_ways
            ));
        }
        if m.pair_prefetch && m.llc_bytes == 0 {
            return Err(
                "memnode.pair_prefetch needs the cache model: set memnode.llc_bytes (with llc_ways and dram_miss_ns) or drop pair_prefetch"
                    .into(),
            );
        }
        if m.core_cache_bytes > 0 {
            if m.llc_bytes == 0 {
                return Err(
                    "memnode.core_cache_bytes needs the cache model: set memnode.llc_bytes (with llc_ways and dram_miss_ns) or drop core_cache_bytes"
                        .into(),
                );
            }
            if m.core_cache_ways == 0 || m.core_cache_hit_ns == 0 {
                return Err(
                    "memnode.core_cache_bytes is set, so memnode.core_cache_ways and memnode.core_cache_hit_ns must be positive"
                        .into(),
                );
            }
            if m.core_cache_bytes < 64 * m.core_cache_ways {
                return Err(format!(
                    "memnode.core_cache_bytes {} is less than one set ({} ways of 64 bytes)",
                    m.core_cache_bytes, m.core_cache_ways
                ));
            }
            if m.core_cache_hit_ns > m.line_ns {
                return Err(format!(
                    "memnode.core_cache_hit_ns ({}) is more than memnode.line_ns ({}): a core's private cache cannot be slower than the last-level cache behind it",
                    m.core_cache_hit_ns, m.line_ns
                ));
            }
        } else if m.core_cache_ways != 0 || m.core_cache_hit_ns != 0 {
            return Err(format!(
                "memnode.core_cache_ways ({}) and memnode.core_cache_hit_ns ({}) are set but memnode.core_cache_bytes is 0 (no private cache): set core_cache_bytes or drop them",
                m.core_cache_ways, m.core_cache_hit_ns
            ));
        }
        for (what, v) in [("memnode.cpu_ghz", m.cpu_ghz), ("memnode.ipc", m.ipc)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("{what} must be a non-negative number, not {v}"));
            }
        }
        if (m.cpu_ghz > 0.0) != (m.ipc > 0.0) {
            return Err(format!(
                "memnode.cpu_ghz ({}) and memnode.ipc ({}) go together: set both (the instruction term) or neither",
                m.cpu_ghz, m.ipc
            ));
        }
        if !(m.smt_share.is_finite() && m.smt_share > 0.0 && m.smt_share <= 1.0) {
            return Err(format!(
                "memnode.smt_share must be in (0, 1] (a thread's share of its core's instruction rate; 1 = a core of its own), not {}",
                m.smt_share
            ));
        }
        if m.cpu_ghz > 0.0 && m.instructions_per_us() == 0 {
            return Err(format!(
                "memnode.cpu_ghz x memnode.ipc x memnode.smt_share = {} instructions per ns is too small to charge",
                m.cpu_ghz * m.ipc * m.smt_share
            ));
        }
        if n.nics == 0 || n.nics > 16 {
            return Err(format!(
                "network.nics must be 1..=16 (NICs per machine), not {}",
                n.nics
            ));
        }
        if n.qp_cache_entries > 0 && n.qp_miss_ns == 0 {
            return Err(
                "network.qp_cache_entries is set, so network.qp_miss_ns must be positive".into(),
            );
        }
        Ok(())
    }

    /// Scales the memory node's last-level cache (and its cores' private
    /// caches, if modelled) by `keys / paper_keys`, so that a run with fewer
    /// keys than the paper's keeps the paper's ratio of index bytes to cache
    /// bytes (docs/simulation.md, "Key-set size and the cache"); at least
    /// one set of each remains.
    pub fn scale_llc(&mut self, keys: u64, paper_keys: u64) -> Result<(), String> {
        let m = &mut self.memnode;
        if paper_keys == 0 {
            return Err("--llc-keys must be positive".into());
        }
        if m.llc_bytes == 0 {
            return Err(format!(
                "profile {} does not model the memory node's cache (memnode.llc_bytes = 0): nothing to scale",
                self.name
            ));
        }
        let scaled = (m.llc_bytes as u128 * keys as u128 / paper_keys as u128) as u64;
        m.llc_bytes = scaled.max(64 * m.llc_ways);
        // The cores' private caches hold the same share of the index as on
        // the testbed, too (at least one set).
        if m.core_cache_bytes > 0 {
            let scaled = (m.core_cache_bytes as u128 * keys as u128 / paper_keys as u128) as u64;
            m.core_cache_bytes = scaled.max(64 * m.core_cache_ways);
        }
        Ok(())
    }

    /// Sets the spread of the clients' CPU per operation
    /// (`--cpu-spread-ns`; see [`ClientProfile::cpu_per_op_spread_ns`]),
    /// refused above that CPU time.
    pub fn set_cpu_spread(&mut self, spread_ns: u64) -> Result<(), String> {
        let per_op = self.client.cpu_per_op_ns;
        if spread_ns > per_op {
            return Err(format!(
                "--cpu-spread-ns {spread_ns} is more than profile {}'s client CPU per operation ({per_op} ns)",
                self.name
            ));
        }
        self.client.cpu_per_op_spread_ns = spread_ns;
        Ok(())
    }

    /// Nanoseconds one message occupies a NIC direction: the message-rate
    /// limit or the bytes on the link, whichever is longer.
    pub(crate) fn nic_service_ns(&self, payload: u64) -> u64 {
        let n = &self.network;
        let by_rate = 1e3 / n.nic_msg_rate_mops;
        let by_bytes = ((payload + n.header_bytes) * 8) as f64 / n.link_gbps;
        by_rate.max(by_bytes).ceil() as u64
    }

    /// Nanoseconds to move `bytes` over PCIe.
    pub(crate) fn pcie_ns(&self, bytes: u64) -> u64 {
        ((bytes * 8) as f64 / self.network.pcie_gbps).ceil() as u64
    }

    /// Nanoseconds one SSD operation occupies the device (its IOPS share).
    pub(crate) fn ssd_slot_ns(&self) -> u64 {
        (1e6 / self.ssd.kiops).ceil() as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shipped_profiles_parse() {
        for (name, _) in SHIPPED {
            let p = Profile::load(name).unwrap();
            assert_eq!(&p.name, name);
        }
    }

    #[test]
    fn shipped_profiles_model_the_memory_node_cache() {
        for (name, _) in SHIPPED {
            let m = Profile::load(name).unwrap().memnode;
            assert!(m.llc_bytes >= 16 << 20, "{name}: {m:?}");
            assert!(m.dram_miss_ns > m.line_ns, "{name}: {m:?}");
            // Every shipped testbed's CPU is an Intel Xeon with the L2
            // adjacent-line prefetcher (the profiles say which).
            assert!(m.pair_prefetch, "{name}: {m:?}");
        }
    }

    #[test]
    fn the_cache_scales_with_the_key_count() {
        let mut p = Profile::load("xstore-cx4").unwrap();
        let full = p.memnode.llc_bytes;
        p.scale_llc(2_000_000, 100_000_000).unwrap();
        assert_eq!(p.memnode.llc_bytes, full / 50);
        p.scale_llc(1, 1 << 40).unwrap();
        assert_eq!(
            p.memnode.llc_bytes,
            64 * p.memnode.llc_ways,
            "one set stays"
        );
        assert!(p.scale_llc(1, 0).is_err());
        p.memnode.llc_bytes = 0;
        assert!(p.scale_llc(1, 2).unwrap_err().contains("does not model"));
    }

    #[test]
    fn bad_profiles_are_refused() {
        let mut text = SHIPPED[0].1.replace("link_gbps = ", "link_gbps = -");
        assert!(Profile::parse(&text).unwrap_err().contains("link_gbps"));
        text = format!("{}\nbogus = 1\n", SHIPPED[0].1);
        assert!(Profile::parse(&text).is_err());
        let no_ways = SHIPPED[0].1.replace("llc_ways = ", "llc_ways = 0 # ");
        assert!(Profile::parse(&no_ways).unwrap_err().contains("llc_ways"));
        let no_cache = SHIPPED[0].1.replace("llc_bytes = ", "llc_bytes = 0 # ");
        assert!(no_cache.contains("pair_prefetch = true"));
        assert!(
            Profile::parse(&no_cache)
                .unwrap_err()
                .contains("pair_prefetch needs the cache model")
        );
        let no_nics = SHIPPED[1].1.replace("nics = 1", "nics = 0");
        assert!(
            Profile::parse(&no_nics)
                .unwrap_err()
                .contains("network.nics")
        );
        assert!(
            Profile::load("no-such-profile")
                .unwrap_err()
                .contains("rolex-cx5")
        );
        for bad in ["0.0", "-0.5", "1.5", "nan", "inf"] {
            let text = SHIPPED[0]
                .1
                .replace("ipc = ", &format!("smt_share = {bad}\nipc = "));
            assert!(
                Profile::parse(&text)
                    .unwrap_err()
                    .contains("memnode.smt_share must be in (0, 1]"),
                "{bad}"
            );
        }
    }

    #[test]
    fn a_shared_core_slows_the_instruction_term_by_its_share() {
        let solo = Profile::load("rolex-cx5").unwrap();
        assert_eq!(solo.memnode.smt_share, 1.0, "left out: a core of its own");
        let text = SHIPPED
            .iter()
            .find(|(n, _)| *n == "rolex-cx5")
            .unwrap()
            .1
            .replace("ipc = ", "smt_share = 0.5\nipc = ");
        let shared = Profile::parse(&text).unwrap();
        let rate = solo.memnode.instructions_per_us();
        assert!(rate > 0);
        assert_eq!(shared.memnode.instructions_per_us(), rate / 2);
    }
}
