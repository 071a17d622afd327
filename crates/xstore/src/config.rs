//! Typed configuration from the `xstore.*` knobs.

use dmkv_api::{KnobSpec, KvError, Result, ServeArgs};
use dmkv_xtree::XTreeConfig;
use std::str::FromStr;

/// Every knob of the engine, with its default and meaning.
pub const KNOBS: &[KnobSpec] = &[
    KnobSpec {
        name: "cache",
        default: "full",
        help: "what clients cache (§5.1, §7.6): full (models and TTs), models-only (TT entries read per lookup), top-only (sub-model and TT entries read per lookup)",
    },
    KnobSpec {
        name: "submodels",
        default: "auto",
        help: "sub-models of a full training: auto (keys / (keys_per_model / 2)) or a count, which is also the least a shrink goes to",
    },
    KnobSpec {
        name: "keys_per_model",
        default: "200",
        help: "model expansion threshold (§5.3.2): double the sub-models when keys per sub-model exceed it, halve them below 1/8 of it",
    },
    KnobSpec {
        name: "expansion",
        default: "on",
        help: "on|off: model expansion and shrinking",
    },
    KnobSpec {
        name: "retrain_threads",
        default: "2",
        help: "background retraining threads on each memory node (the paper uses up to two)",
    },
    KnobSpec {
        name: "speculation",
        default: "on",
        help: "on|off: follow a split leaf's right link once before falling back (§5.3.2)",
    },
    KnobSpec {
        name: "hints",
        default: "on",
        help: "on|off: ship the predicted leaf with UPDATE (§5.3.1)",
    },
    KnobSpec {
        name: "batch_limit",
        default: "16",
        help: "most leaf reads in one doorbell batch; wider predictions take more batches",
    },
    KnobSpec {
        name: "durability",
        default: "off",
        help: "on|off: log writes to per-worker files under --data-dir and recover from them (§5.4)",
    },
    KnobSpec {
        name: "log_sync",
        default: "fsync",
        help: "fsync|none: a write is acknowledged after fdatasync of its log record (fsync) or after write(2) only (none: survives a process crash, not a power failure)",
    },
    KnobSpec {
        name: "bounds",
        default: "",
        help: "range partitioning over --memnodes K: K-1 ascending split keys, comma-separated (empty: equal key ranges)",
    },
    KnobSpec {
        name: "slots",
        default: "16",
        help: "N, key slots per XTree node (4..=48; the paper uses 16)",
    },
    KnobSpec {
        name: "nodes",
        default: "0",
        help: "XTree nodes per memory node (0: sized from the expected key count)",
    },
    KnobSpec {
        name: "value_bytes",
        default: "0",
        help: "bytes of each memory node's out-of-line value region (0: sized from the expected keys and value size)",
    },
    KnobSpec {
        name: "model_bytes",
        default: "0",
        help: "bytes of each memory node's model region (0: sized from the node count)",
    },
];

/// What clients cache (§5.1, §7.6).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CacheMode {
    /// Top model, sub-models and their TTs: 2 round trips per GET.
    Full,
    /// Top model and sub-models; TT entries read per lookup: 3.
    ModelsOnly,
    /// Top model only; sub-model and TT entries read per lookup: 4.
    TopOnly,
}

impl CacheMode {
    pub fn name(self) -> &'static str {
        match self {
            CacheMode::Full => "full",
            CacheMode::ModelsOnly => "models-only",
            CacheMode::TopOnly => "top-only",
        }
    }
    pub fn code(self) -> u8 {
        match self {
            CacheMode::Full => 0,
            CacheMode::ModelsOnly => 1,
            CacheMode::TopOnly => 2,
        }
    }
    pub fn from_code(c: u8) -> Option<CacheMode> {
        Some(match c {
            0 => CacheMode::Full,
            1 => CacheMode::ModelsOnly,
            2 => CacheMode::TopOnly,
            _ => return None,
        })
    }
}

impl FromStr for CacheMode {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "full" => Ok(CacheMode::Full),
            "models-only" => Ok(CacheMode::ModelsOnly),
            "top-only" => Ok(CacheMode::TopOnly),
            _ => Err(format!("{s:?} is not full, models-only or top-only")),
        }
    }
}

/// `on` / `off`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Switch(pub bool);

impl FromStr for Switch {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "on" | "true" | "1" => Ok(Switch(true)),
            "off" | "false" | "0" => Ok(Switch(false)),
            _ => Err(format!("{s:?} is neither on nor off")),
        }
    }
}

/// Sub-models of a full training.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SubModels {
    Auto,
    Fixed(u32),
}

impl FromStr for SubModels {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        if s == "auto" || s == "0" {
            return Ok(SubModels::Auto);
        }
        let n: u32 = s.parse().map_err(|e| format!("{s:?}: {e}"))?;
        if n > crate::layout::MAX_SUBMODELS {
            return Err(format!(
                "at most {} sub-models",
                crate::layout::MAX_SUBMODELS
            ));
        }
        Ok(SubModels::Fixed(n))
    }
}

/// How the log acknowledges.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogSync {
    /// `fdatasync` before the write is acknowledged.
    Fsync,
    /// `write(2)` only.
    None,
}

impl FromStr for LogSync {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "fsync" => Ok(LogSync::Fsync),
            "none" => Ok(LogSync::None),
            _ => Err(format!("{s:?} is neither fsync nor none")),
        }
    }
}

/// The engine's whole configuration, the same on every node and client.
#[derive(Debug, Clone, PartialEq)]
pub struct XStoreConfig {
    pub cache: CacheMode,
    pub submodels: SubModels,
    pub keys_per_model: u64,
    pub expansion: bool,
    pub retrain_threads: usize,
    pub speculation: bool,
    pub hints: bool,
    pub batch_limit: usize,
    pub durability: bool,
    pub log_sync: LogSync,
    /// Split keys between partitions (K - 1 of them).
    pub bounds: Vec<u64>,
    pub tree: XTreeConfig,
    pub model_bytes: u64,
}

const ENGINE: &str = "xstore";

impl XStoreConfig {
    pub fn from_args(args: &ServeArgs) -> Result<XStoreConfig> {
        let k = &args.knobs;
        k.check(ENGINE, KNOBS)?;
        let get = |name| k.get::<String>(ENGINE, KNOBS, name);
        let keys_per_model: u64 = k.get(ENGINE, KNOBS, "keys_per_model")?;
        if keys_per_model < 2 {
            return Err(KvError::Config(
                "xstore.keys_per_model must be at least 2".into(),
            ));
        }
        let retrain_threads: usize = k.get(ENGINE, KNOBS, "retrain_threads")?;
        if retrain_threads == 0 || retrain_threads > 64 {
            return Err(KvError::Config(
                "xstore.retrain_threads must be between 1 and 64".into(),
            ));
        }
        let batch_limit: usize = k.get(ENGINE, KNOBS, "batch_limit")?;
        if batch_limit == 0 {
            return Err(KvError::Config(
                "xstore.batch_limit must be positive".into(),
            ));
        }
        let slots: usize = k.get(ENGINE, KNOBS, "slots")?;
        let mut tree = XTreeConfig::sized_for(args.expected_keys, args.value_size, slots)
            .map_err(|e| KvError::Config(format!("xstore.slots: {e}")))?;
        let nodes: u64 = k.get(ENGINE, KNOBS, "nodes")?;
        if nodes > 0 {
            tree.max_nodes = nodes;
        }
        if tree.max_nodes > crate::layout::MAX_TT_LEAF as u64 {
            return Err(KvError::Config(format!(
                "xstore.nodes: TT entries name leaves in 31 bits; {} nodes are too many",
                tree.max_nodes
            )));
        }
        let value_bytes: u64 = k.get(ENGINE, KNOBS, "value_bytes")?;
        if value_bytes > 0 {
            tree.value_region_bytes = value_bytes;
        }
        let parts = args.nodes.len().max(1);
        let bounds = parse_bounds(&get("bounds")?, parts)?;
        Ok(XStoreConfig {
            cache: k.get(ENGINE, KNOBS, "cache")?,
            submodels: k.get(ENGINE, KNOBS, "submodels")?,
            keys_per_model,
            expansion: k.get::<Switch>(ENGINE, KNOBS, "expansion")?.0,
            retrain_threads,
            speculation: k.get::<Switch>(ENGINE, KNOBS, "speculation")?.0,
            hints: k.get::<Switch>(ENGINE, KNOBS, "hints")?.0,
            batch_limit,
            durability: k.get::<Switch>(ENGINE, KNOBS, "durability")?.0,
            log_sync: k.get(ENGINE, KNOBS, "log_sync")?,
            bounds,
            tree,
            model_bytes: k.get(ENGINE, KNOBS, "model_bytes")?,
        })
    }

    /// The key range `[lo, hi]` of partition `p` (of `bounds.len() + 1`).
    pub fn partition(&self, p: usize) -> (u64, u64) {
        let lo = if p == 0 { 0 } else { self.bounds[p - 1] };
        let hi = if p == self.bounds.len() {
            u64::MAX
        } else {
            self.bounds[p] - 1
        };
        (lo, hi)
    }

    /// The partition holding `key`.
    pub fn partition_of(&self, key: u64) -> usize {
        self.bounds.partition_point(|&b| b <= key)
    }

    /// Sub-models a full training over `keys` keys gets (before the floor
    /// of a fixed count).
    pub fn submodels_for(&self, keys: u64) -> u32 {
        let auto = keys.div_ceil((self.keys_per_model / 2).max(1)).max(1);
        let auto = auto.min(crate::layout::MAX_SUBMODELS as u64) as u32;
        match self.submodels {
            SubModels::Auto => auto,
            SubModels::Fixed(n) => n.max(1),
        }
    }

    /// The fewest sub-models a shrink may leave.
    pub fn min_submodels(&self) -> u32 {
        match self.submodels {
            SubModels::Auto => 1,
            SubModels::Fixed(n) => n.max(1),
        }
    }

    /// Bytes of the model region: room for two generations of records and
    /// translation tables (the committed one and one being built), with
    /// size classes rounding each block up to a power of two.
    pub fn model_region_bytes(&self) -> u64 {
        if self.model_bytes > 0 {
            return self.model_bytes;
        }
        let leaves = self.tree.max_nodes;
        let max_subs = (self.submodels_for(leaves * self.tree.slots as u64) as u64)
            .max(self.min_submodels() as u64)
            * 2;
        // TT: 8 bytes per leaf and per straddle, 8/7 for tags, x2 for size
        // classes, x2 generations; records: 64 bytes, x2 classes, x2.
        let tt = (leaves + max_subs) * 8 * 8 / 7 * 4 + max_subs * 4 * 128;
        let table = max_subs * 64 * 4;
        (tt + table + (8 << 20)).next_power_of_two()
    }
}

/// K - 1 ascending split keys from `s`, or an even split of the key space.
fn parse_bounds(s: &str, parts: usize) -> Result<Vec<u64>> {
    if s.trim().is_empty() {
        let width = (u64::MAX as u128 + 1) / parts as u128;
        return Ok((1..parts).map(|p| (width * p as u128) as u64).collect());
    }
    let v: Vec<u64> = s
        .split(',')
        .map(|x| x.trim().parse::<u64>())
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| KvError::Config(format!("xstore.bounds={s:?}: {e}")))?;
    if v.len() + 1 != parts {
        return Err(KvError::Config(format!(
            "xstore.bounds has {} split keys; {} memory nodes need {}",
            v.len(),
            parts,
            parts - 1
        )));
    }
    if v.first() == Some(&0) || v.windows(2).any(|w| w[0] >= w[1]) {
        return Err(KvError::Config(format!(
            "xstore.bounds={s:?} must be ascending and above 0"
        )));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_api::Knobs;

    fn args(knobs: &[(&str, &str)], nodes: usize) -> ServeArgs {
        let mut k = Knobs::new();
        for (n, v) in knobs {
            k.set(n, v);
        }
        ServeArgs {
            instance: "t/xstore".into(),
            knobs: k,
            node_index: 0,
            nodes: (0..nodes as u16).collect(),
            expected_keys: 1000,
            value_size: 8,
            cache_mb: 0,
            data_dir: None,
        }
    }

    #[test]
    fn defaults_partitions_and_refusals() {
        let c = XStoreConfig::from_args(&args(&[], 1)).unwrap();
        assert_eq!(c.cache, CacheMode::Full);
        assert_eq!(c.partition(0), (0, u64::MAX));
        let c = XStoreConfig::from_args(&args(&[], 4)).unwrap();
        assert_eq!(c.bounds.len(), 3);
        assert_eq!(c.partition(0).0, 0);
        assert_eq!(c.partition(3).1, u64::MAX);
        for p in 0..3 {
            assert_eq!(c.partition(p).1 + 1, c.partition(p + 1).0);
            assert_eq!(c.partition_of(c.partition(p + 1).0), p + 1);
            assert_eq!(c.partition_of(c.partition(p).1), p);
        }
        let c = XStoreConfig::from_args(&args(&[("bounds", "10,20")], 3)).unwrap();
        assert_eq!(c.partition(1), (10, 19));
        assert_eq!(c.partition_of(9), 0);
        assert_eq!(c.partition_of(20), 2);
        for bad in [
            vec![("bounds", "10")],
            vec![("bounds", "20,10")],
            vec![("cache", "some")],
            vec![("retrain_threads", "0")],
            vec![("bogus", "1")],
            vec![("slots", "3")],
        ] {
            assert!(XStoreConfig::from_args(&args(&bad, 3)).is_err(), "{bad:?}");
        }
        let c = XStoreConfig::from_args(&args(&[("cache", "top-only")], 1)).unwrap();
        assert_eq!(c.cache, CacheMode::TopOnly);
        assert_eq!(c.submodels_for(1000), 10);
    }
}
