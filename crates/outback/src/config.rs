//! Outback's settings (`--set outback.KNOB=VALUE`), typed and checked.

use dmkv_api::{KnobSpec, Knobs, KvError, Result};

pub const KNOBS: &[KnobSpec] = &[
    KnobSpec {
        name: "load_factor",
        default: "0.95",
        help: "target load factor ε of a freshly built DMPH table (paper default 0.95)",
    },
    KnobSpec {
        name: "growth_load_factor",
        default: "0.5",
        help: "lowest load factor a resize builds its table(s) at (the most room for inserts before the next resize), when growth_bits_per_key allows it",
    },
    KnobSpec {
        name: "growth_bits_per_key",
        default: "5.2",
        help: "compute-node memory a resize may bring the shard's index to, in bits per key: a resize builds at the lowest load factor (>= growth_load_factor, <= load_factor) that keeps the shard within it",
    },
    KnobSpec {
        name: "initial_buckets",
        default: "256",
        help: "buckets of each shard's table before the first bulk load",
    },
    KnobSpec {
        name: "table_keys",
        default: "16384",
        help: "keys per table after a full build, about (more go to several tables, so a later split moves fewer keys and stalls fewer inserts)",
    },
    KnobSpec {
        name: "overflow_ratio",
        default: "0.03125",
        help: "overflow cache capacity of a table, as a fraction of its slots",
    },
    KnobSpec {
        name: "slow_fill",
        default: "0.5",
        help: "s_slow: overflow fill (fraction of capacity) that starts PRE_RESIZE",
    },
    KnobSpec {
        name: "stop_fill",
        default: "0.9",
        help: "s_stop: overflow fill at which inserts stop and the rebuild starts",
    },
    KnobSpec {
        name: "slow_load",
        default: "0.97",
        help: "s_slow: table load factor that starts PRE_RESIZE",
    },
    KnobSpec {
        name: "pre_resize_timeout_ms",
        default: "50",
        help: "longest wait for every compute node to see PRE_RESIZE before rebuilding",
    },
    KnobSpec {
        name: "countdown_poll_ms",
        default: "5",
        help: "how often the memory node checks the fetch countdown (paper: 500)",
    },
    KnobSpec {
        name: "countdown_timeout_ms",
        default: "1000",
        help: "longest wait for compute nodes to fetch a new locator",
    },
    KnobSpec {
        name: "poll_us",
        default: "200",
        help: "how often a compute node polls a resizing shard's control region",
    },
    KnobSpec {
        name: "heap_mb",
        default: "0",
        help: "KV block space per shard in MiB (0: sized from the expected keys)",
    },
    KnobSpec {
        name: "sessions",
        default: "16384",
        help: "session entries per shard (at-most-once writes across a takeover): one per write lane of every connected compute process that has written to the shard; full, a new lane's write fails with Exhausted",
    },
    KnobSpec {
        name: "vnodes",
        default: "64",
        help: "points per shard on the consistent-hashing ring",
    },
    KnobSpec {
        name: "replicas",
        default: "2",
        help: "shards that mirror each shard's KV data (0: none; more than memnodes - 1 acts as memnodes - 1)",
    },
    KnobSpec {
        name: "resize_share_handlers",
        default: "true",
        help: "sim only: a resize's work takes turns with the RPC handlers on the memory node's handler cores (the paper's one-thread memory node, §5.9) instead of running on a worker core of its own",
    },
    KnobSpec {
        name: "resize_slice_us",
        default: "750",
        help: "sim only, with resize_share_handlers: the longest turn a resize takes on a handler core before queued requests get one as long (Linux's base time slice, 0.75 ms)",
    },
    KnobSpec {
        name: "max_global_depth",
        default: "12",
        help: "largest extendible-hashing global depth (2^depth tables per shard)",
    },
];

/// Typed settings, the same on memory nodes and compute nodes.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub load_factor: f64,
    pub growth_load_factor: f64,
    pub growth_bits_per_key: f64,
    pub initial_buckets: u32,
    pub table_keys: u64,
    pub overflow_ratio: f64,
    pub slow_fill: f64,
    pub stop_fill: f64,
    pub slow_load: f64,
    pub pre_resize_timeout_ms: u64,
    pub countdown_poll_ms: u64,
    pub countdown_timeout_ms: u64,
    pub poll_us: u64,
    pub heap_mb: u64,
    pub sessions: u64,
    pub vnodes: u32,
    pub replicas: usize,
    pub max_global_depth: u8,
    pub resize_share_handlers: bool,
    pub resize_slice_us: u64,
}

impl Config {
    pub fn from_knobs(k: &Knobs) -> Result<Config> {
        let g = |n: &str| -> Result<f64> { k.get::<f64>("outback", KNOBS, n) };
        let u = |n: &str| -> Result<u64> { k.get::<u64>("outback", KNOBS, n) };
        let c = Config {
            load_factor: g("load_factor")?,
            growth_load_factor: g("growth_load_factor")?,
            growth_bits_per_key: g("growth_bits_per_key")?,
            initial_buckets: u("initial_buckets")? as u32,
            table_keys: u("table_keys")?,
            overflow_ratio: g("overflow_ratio")?,
            slow_fill: g("slow_fill")?,
            stop_fill: g("stop_fill")?,
            slow_load: g("slow_load")?,
            pre_resize_timeout_ms: u("pre_resize_timeout_ms")?,
            countdown_poll_ms: u("countdown_poll_ms")?,
            countdown_timeout_ms: u("countdown_timeout_ms")?,
            poll_us: u("poll_us")?,
            heap_mb: u("heap_mb")?,
            sessions: u("sessions")?,
            vnodes: u("vnodes")? as u32,
            replicas: u("replicas")? as usize,
            max_global_depth: u("max_global_depth")? as u8,
            resize_share_handlers: k.get::<bool>("outback", KNOBS, "resize_share_handlers")?,
            resize_slice_us: u("resize_slice_us")?,
        };
        let bad = |what: &str| Err(KvError::Config(format!("outback.{what}")));
        if !(0.3..=0.99).contains(&c.load_factor) {
            return bad("load_factor must be in [0.3, 0.99]");
        }
        if !(0.3..=c.load_factor).contains(&c.growth_load_factor) {
            return bad("growth_load_factor must be in [0.3, load_factor]");
        }
        if !(2.0..=64.0).contains(&c.growth_bits_per_key) {
            return bad("growth_bits_per_key must be in [2, 64]");
        }
        if c.initial_buckets == 0 || c.initial_buckets > 1 << 30 {
            return bad("initial_buckets must be in [1, 2^30]");
        }
        if c.table_keys == 0 {
            return bad("table_keys must be at least 1");
        }
        if !(0.0..=1.0).contains(&c.overflow_ratio) || c.overflow_ratio == 0.0 {
            return bad("overflow_ratio must be in (0, 1]");
        }
        if !(0.0 < c.slow_fill && c.slow_fill < c.stop_fill && c.stop_fill <= 1.0) {
            return bad("slow_fill and stop_fill need 0 < slow_fill < stop_fill <= 1");
        }
        if !(0.0..=1.0).contains(&c.slow_load) {
            return bad("slow_load must be in [0, 1]");
        }
        if c.vnodes == 0 || c.vnodes > 4096 {
            return bad("vnodes must be in [1, 4096]");
        }
        if c.max_global_depth > 16 {
            return bad("max_global_depth must be at most 16");
        }
        if !(1..=60_000).contains(&c.pre_resize_timeout_ms) {
            return bad("pre_resize_timeout_ms must be in [1, 60000]");
        }
        if !(1..=60_000).contains(&c.countdown_poll_ms) {
            return bad("countdown_poll_ms must be in [1, 60000]");
        }
        if !(c.countdown_poll_ms..=3_600_000).contains(&c.countdown_timeout_ms) {
            return bad("countdown_timeout_ms must be in [countdown_poll_ms, 3600000]");
        }
        if !(1..=1_000_000).contains(&c.poll_us) {
            return bad("poll_us must be in [1, 1000000]");
        }
        if !(1..=1 << 24).contains(&c.sessions) {
            return bad("sessions must be in [1, 2^24]");
        }
        if c.heap_mb > 1 << 20 {
            return bad("heap_mb must be at most 2^20 (1 TiB; 0: sized from the expected keys)");
        }
        if !(1..=1_000_000).contains(&c.resize_slice_us) {
            return bad("resize_slice_us must be in [1, 1000000]");
        }
        if c.replicas > 64 {
            return bad(
                "replicas must be at most 64 (more than memnodes - 1 acts as memnodes - 1)",
            );
        }
        Ok(c)
    }

    /// Overflow cache capacity of a table with `buckets` buckets.
    pub fn overflow_capacity(&self, buckets: u32) -> usize {
        ((buckets as f64 * 4.0 * self.overflow_ratio) as usize).max(8)
    }

    /// Buckets for `keys` keys at the target load factor (full builds).
    pub fn buckets_for(&self, keys: usize) -> u32 {
        buckets_at(keys, self.load_factor)
    }

    /// Buckets for `keys` keys at load factor `load`.
    pub fn buckets_at(&self, keys: usize, load: f64) -> u32 {
        buckets_at(keys, load)
    }

    /// The largest control-region body (a full directory and table list).
    pub fn ctl_body_max(&self) -> u64 {
        let dirs = 1u64 << self.max_global_depth;
        64 + dirs * 4 + dirs * crate::publish::TABLE_ENTRY_BYTES
    }
}

fn buckets_at(keys: usize, load: f64) -> u32 {
    ((keys as f64 / (4.0 * load)).ceil() as u64).clamp(1, 1 << 30) as u32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_parse_and_bad_values_are_refused() {
        let c = Config::from_knobs(&Knobs::new()).unwrap();
        assert_eq!(c.load_factor, 0.95);
        assert_eq!(c.buckets_for(95), 25);
        assert_eq!(c.buckets_at(50, c.growth_load_factor), 25);
        let mut k = Knobs::new();
        k.set("stop_fill", "0.1");
        assert!(Config::from_knobs(&k).is_err());
        let mut k = Knobs::new();
        k.set("load_factor", "2");
        assert!(Config::from_knobs(&k).is_err());
        let mut k = Knobs::new();
        k.set("growth_load_factor", "0.1");
        assert!(Config::from_knobs(&k).is_err());
        let mut k = Knobs::new();
        k.set("growth_bits_per_key", "1");
        assert!(Config::from_knobs(&k).is_err());
        let mut k = Knobs::new();
        k.set("table_keys", "0");
        assert!(Config::from_knobs(&k).is_err());
        for (knob, bad) in [
            ("pre_resize_timeout_ms", "0"),
            ("countdown_poll_ms", "0"),
            ("countdown_timeout_ms", "1"),
            ("poll_us", "0"),
            ("heap_mb", "2000000"),
            ("sessions", "0"),
            ("replicas", "65"),
            ("resize_slice_us", "0"),
            ("resize_share_handlers", "maybe"),
        ] {
            let mut k = Knobs::new();
            k.set(knob, bad);
            let e = Config::from_knobs(&k).unwrap_err().to_string();
            assert!(e.contains(knob), "{knob}={bad}: {e}");
        }
    }
}
