//! Typed configuration from the `xstore.*` knobs.

use dmkv_api::{KnobSpec, KvError, RangePartitions, Result, ServeArgs};
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
        name: "get_read",
        default: "keys",
        help: "what a lookup reads of each predicted leaf (§5.2.1): keys (the key lines, then the value's slot line: two READs, Fig. 12's NIC_IDX and NIC_VAL) or leaves (whole leaves, the inline value included: one READ)",
    },
    KnobSpec {
        name: "submodels",
        default: "auto",
        help: "sub-models of a full training: auto (from keys / (keys_per_model / 2), raised until lookups meet target_leaves within cache_budget_mb) or a count in 1..=2^26, which is also the least a shrink goes to",
    },
    KnobSpec {
        name: "target_leaves",
        default: "3",
        help: "with submodels=auto: mean leaves a lookup's prediction may span; a full training doubles the sub-models (§7.7) until a sample of lookups meets it (1..=64)",
    },
    KnobSpec {
        name: "max_leaves",
        default: "16",
        help: "most leaves one lookup reads for its prediction; a wider prediction takes the fallback RPC instead (counted as wide_prediction) (1..=4096)",
    },
    KnobSpec {
        name: "cache_budget_mb",
        default: "64",
        help: "client memory (MiB) a full cache (sub-model records and TTs) may take when submodels=auto raises the count for target_leaves; never lowers it below the keys_per_model count (1..=1048576)",
    },
    KnobSpec {
        name: "keys_per_model",
        default: "200",
        help: "model expansion threshold (§5.3.2): double the sub-models when keys per sub-model exceed it, halve them below 1/8 of it; scaled down by the factor auto sizing raised the count by (2..=1048576)",
    },
    KnobSpec {
        name: "expansion",
        default: "on",
        help: "on|off: model expansion and shrinking",
    },
    KnobSpec {
        name: "retrain_threads",
        default: "2",
        help: "background retraining threads on each memory node (the paper uses up to two) (1..=64)",
    },
    KnobSpec {
        name: "retrain_share_handlers",
        default: "on",
        help: "on|off, sim only: a sub-model's retraining, an expansion and a shrink take turns with the RPC handlers on the memory node's handler cores (ROLEX's XStore-D: one core per memory node, §4) instead of running on a worker core of their own",
    },
    KnobSpec {
        name: "retrain_slice_us",
        default: "750",
        help: "sim only, with retrain_share_handlers: the longest turn a retraining takes on a handler core before queued requests get one as long (Linux's base time slice, 0.75 ms) (1..=1000000)",
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
        help: "most leaf reads in one doorbell batch; more leaves (up to max_leaves, coverage extensions) take more batches (1..=4096)",
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
        help: "XTree nodes per memory node (0: sized from the expected key count; at most 2^31 - 1)",
    },
    KnobSpec {
        name: "value_bytes",
        default: "0",
        help: "bytes of each memory node's out-of-line value region (0: sized from the expected keys and value size; at most 2^40)",
    },
    KnobSpec {
        name: "model_bytes",
        default: "0",
        help: "bytes of each memory node's model region (0: sized from the node count and cache_budget_mb; else 65536..=2^40)",
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

/// What a GET's lookup reads of each predicted leaf (§5.2.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GetRead {
    /// The key lines (N keys and the header), then the value's slot line:
    /// the paper's two READs.
    Keys,
    /// Whole leaves: an inline value arrives with its key (one READ).
    Leaves,
}

impl FromStr for GetRead {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "keys" => Ok(GetRead::Keys),
            "leaves" => Ok(GetRead::Leaves),
            _ => Err(format!("{s:?} is not keys or leaves")),
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
        if s == "auto" {
            return Ok(SubModels::Auto);
        }
        let n: u64 = s
            .parse()
            .map_err(|e| format!("{s:?} is neither auto nor a count: {e}"))?;
        if n == 0 || n > crate::layout::MAX_SUBMODELS as u64 {
            return Err(format!(
                "{n} sub-models: a count must be in 1..={} (or auto)",
                crate::layout::MAX_SUBMODELS
            ));
        }
        Ok(SubModels::Fixed(n as u32))
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
    pub get_read: GetRead,
    pub submodels: SubModels,
    pub keys_per_model: u64,
    pub expansion: bool,
    pub retrain_threads: usize,
    /// Sim only: a retraining's CPU passes on the handler cores, in turns
    /// with the requests queued there (`xstore.retrain_share_handlers`).
    pub retrain_share_handlers: bool,
    /// Sim only: the longest such turn, µs (`xstore.retrain_slice_us`).
    pub retrain_slice_us: u64,
    pub speculation: bool,
    pub hints: bool,
    pub batch_limit: usize,
    /// Mean leaves per lookup that auto sizing aims for.
    pub target_leaves: f64,
    /// Widest prediction read one-sided; wider ones fall back.
    pub max_leaves: usize,
    /// Client cache bytes auto sizing may spend.
    pub cache_budget_bytes: u64,
    pub durability: bool,
    pub log_sync: LogSync,
    /// The key ranges of the memory nodes (the `bounds` knob: K - 1 split
    /// keys): memory node `p` holds range `p`.
    pub parts: RangePartitions,
    pub tree: XTreeConfig,
    pub model_bytes: u64,
}

const ENGINE: &str = "xstore";

impl XStoreConfig {
    pub fn from_args(args: &ServeArgs) -> Result<XStoreConfig> {
        let k = &args.knobs;
        k.check(ENGINE, KNOBS)?;
        let get = |name| k.get::<String>(ENGINE, KNOBS, name);
        let keys_per_model: u64 = k.get_in(ENGINE, KNOBS, "keys_per_model", 2..=1 << 20)?;
        let retrain_threads: usize = k.get_in(ENGINE, KNOBS, "retrain_threads", 1..=64)?;
        let batch_limit: usize = k.get_in(ENGINE, KNOBS, "batch_limit", 1..=4096)?;
        let target_leaves: f64 = k.get_in(ENGINE, KNOBS, "target_leaves", 1.0..=64.0)?;
        let max_leaves: usize = k.get_in(ENGINE, KNOBS, "max_leaves", 1..=4096)?;
        let cache_budget_mb: u64 = k.get_in(ENGINE, KNOBS, "cache_budget_mb", 1..=1 << 20)?;
        let slots: usize = k.get_in(ENGINE, KNOBS, "slots", 4..=48)?;
        let mut tree = XTreeConfig::sized_for(args.expected_keys, args.value_size, slots)
            .map_err(|e| KvError::Config(format!("xstore.slots: {e}")))?;
        let nodes: u64 = k.get_in(
            ENGINE,
            KNOBS,
            "nodes",
            0..=crate::layout::MAX_TT_LEAF as u64,
        )?;
        if nodes > 0 {
            tree.max_nodes = nodes;
        }
        if tree.max_nodes > crate::layout::MAX_TT_LEAF as u64 {
            return Err(KvError::Config(format!(
                "xstore.nodes: TT entries name leaves in 31 bits; {} nodes are too many",
                tree.max_nodes
            )));
        }
        let value_bytes: u64 = k.get_in(ENGINE, KNOBS, "value_bytes", 0..=1 << 40)?;
        if value_bytes > 0 {
            tree.value_region_bytes = value_bytes;
        }
        let model_bytes: u64 = k.get_in(ENGINE, KNOBS, "model_bytes", 0..=1 << 40)?;
        if model_bytes > 0 && model_bytes < 1 << 16 {
            return Err(KvError::Config(format!(
                "xstore.model_bytes={model_bytes} is out of range (accepted: 0, or 65536 <= value <= {})",
                1u64 << 40
            )));
        }
        let parts = RangePartitions::parse(ENGINE, &get("bounds")?, args.nodes.len())?;
        Ok(XStoreConfig {
            cache: k.get(ENGINE, KNOBS, "cache")?,
            get_read: k.get(ENGINE, KNOBS, "get_read")?,
            submodels: k.get(ENGINE, KNOBS, "submodels")?,
            keys_per_model,
            expansion: k.get::<Switch>(ENGINE, KNOBS, "expansion")?.0,
            retrain_threads,
            retrain_share_handlers: k.get::<Switch>(ENGINE, KNOBS, "retrain_share_handlers")?.0,
            retrain_slice_us: k.get_in(ENGINE, KNOBS, "retrain_slice_us", 1..=1_000_000)?,
            speculation: k.get::<Switch>(ENGINE, KNOBS, "speculation")?.0,
            hints: k.get::<Switch>(ENGINE, KNOBS, "hints")?.0,
            batch_limit,
            target_leaves,
            max_leaves,
            cache_budget_bytes: cache_budget_mb << 20,
            durability: k.get::<Switch>(ENGINE, KNOBS, "durability")?.0,
            log_sync: k.get(ENGINE, KNOBS, "log_sync")?,
            parts,
            tree,
            model_bytes,
        })
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
        // Room for auto sizing to raise the count (skewed keys, §7.7): up
        // to what the client cache budget allows, at most one sub-model
        // per two expected keys, two generations of it.
        let sized = if self.submodels == SubModels::Auto {
            let m = (self.cache_budget_bytes / 72)
                .min(self.tree.max_nodes * self.tree.slots as u64 / 8)
                .min(crate::layout::MAX_SUBMODELS as u64);
            2 * crate::model::region_bytes_for(m, m, leaves)
        } else {
            0
        };
        (tt + table + (8 << 20)).max(sized).next_power_of_two()
    }
}

/// K - 1 ascending split keys from `s`, or an even split of the key space.
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
        assert_eq!(c.parts.range(0), (0, u64::MAX));
        let c = XStoreConfig::from_args(&args(&[], 4)).unwrap();
        assert_eq!(c.parts.bounds().len(), 3);
        assert_eq!(c.parts.range(0).0, 0);
        assert_eq!(c.parts.range(3).1, u64::MAX);
        for p in 0..3 {
            assert_eq!(c.parts.range(p).1 + 1, c.parts.range(p + 1).0);
            assert_eq!(c.parts.of(c.parts.range(p + 1).0), p + 1);
            assert_eq!(c.parts.of(c.parts.range(p).1), p);
        }
        let c = XStoreConfig::from_args(&args(&[("bounds", "10,20")], 3)).unwrap();
        assert_eq!(c.parts.range(1), (10, 19));
        assert_eq!(c.parts.of(9), 0);
        assert_eq!(c.parts.of(20), 2);
        for bad in [
            vec![("bounds", "10")],
            vec![("bounds", "20,10")],
            vec![("cache", "some")],
            vec![("retrain_threads", "0")],
            vec![("retrain_share_handlers", "maybe")],
            vec![("retrain_slice_us", "0")],
            vec![("bogus", "1")],
            vec![("slots", "3")],
            vec![("submodels", "0")],
            vec![("submodels", "some")],
            vec![("target_leaves", "0.5")],
            vec![("max_leaves", "0")],
            vec![("cache_budget_mb", "0")],
            vec![("batch_limit", "0")],
            vec![("keys_per_model", "1")],
            vec![("model_bytes", "100")],
        ] {
            assert!(XStoreConfig::from_args(&args(&bad, 3)).is_err(), "{bad:?}");
        }
        // Refusals name the knob, the value and what is accepted.
        let e = XStoreConfig::from_args(&args(&[("submodels", "0")], 1))
            .unwrap_err()
            .to_string();
        assert!(e.contains("xstore.submodels") && e.contains("1..="), "{e}");
        let e = XStoreConfig::from_args(&args(&[("max_leaves", "0")], 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("xstore.max_leaves=0") && e.contains("4096"),
            "{e}"
        );
        let e = XStoreConfig::from_args(&args(&[("get_read", "values")], 1))
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("xstore.get_read=\"values\"") && e.contains("not keys or leaves"),
            "{e}"
        );
        assert_eq!(
            XStoreConfig::from_args(&args(&[], 1)).unwrap().get_read,
            GetRead::Keys
        );
        let c = XStoreConfig::from_args(&args(&[("get_read", "leaves")], 1)).unwrap();
        assert_eq!(c.get_read, GetRead::Leaves);
        let c = XStoreConfig::from_args(&args(&[("submodels", "7")], 1)).unwrap();
        assert_eq!(c.submodels, SubModels::Fixed(7));
        let c = XStoreConfig::from_args(&args(&[("cache", "top-only")], 1)).unwrap();
        assert_eq!(c.cache, CacheMode::TopOnly);
        assert_eq!(c.submodels_for(1000), 10);
    }
}
