//! Typed configuration: knobs (`--set rolex.NAME=VALUE`) plus sizes derived
//! from the deployment. Servers and clients derive the same values from the
//! same [`ServeArgs`]; node 0 also records the essentials in its meta region
//! and clients check them when they connect.

use crate::layout::entry::{MAX_LEAF, MAX_REGIONS, MAX_SLT_SLOTS};
use crate::layout::leaf::{LeafLayout, MAX_SLOTS, MIN_SLOTS};
use crate::layout::value::block_bytes;
use dmkv_api::{KnobSpec, KvError, Result, ServeArgs};

pub const ENGINE: &str = "rolex";

pub const KNOBS: &[KnobSpec] = &[
    KnobSpec {
        name: "epsilon",
        default: "16",
        help: "maximum model error ε in positions (paper default 16)",
    },
    KnobSpec {
        name: "leaf_slots",
        default: "16",
        help: "pairs per leaf δ, 2..=128 (paper default 16)",
    },
    KnobSpec {
        name: "slt_slots",
        default: "256",
        help: "synonym leaf table slots per model, 4..=256 (slot 0 counts used slots)",
    },
    KnobSpec {
        name: "retrain_threshold",
        default: "0",
        help: "used SLT slots that queue a model for retraining; 0 = half the SLT (2^7)",
    },
    KnobSpec {
        name: "retrain_threads",
        default: "1",
        help: "memory-node threads that retrain models (its limited CPU), 1..=64",
    },
    KnobSpec {
        name: "upper_epsilon",
        default: "8",
        help: "error of the upper model levels over the models' first keys, 1..=2^20",
    },
    KnobSpec {
        name: "leaves",
        default: "0",
        help: "leaves per memory node; 0 = sized from the expected keys",
    },
    KnobSpec {
        name: "model_region_mb",
        default: "0",
        help: "model region MiB per memory node; 0 = sized from the expected keys",
    },
    KnobSpec {
        name: "value_region_mb",
        default: "0",
        help: "out-of-line value region MiB per memory node; 0 = sized from the expected keys",
    },
    KnobSpec {
        name: "load_model_keys",
        default: "16384",
        help: "most keys of a model a bulk load makes (a load into a loaded store rewrites the models it meets; this bounds that work); 0 = no cap",
    },
    KnobSpec {
        name: "max_models",
        default: "0",
        help: "models a directory image can hold; 0 = sized from the expected keys",
    },
    KnobSpec {
        name: "queue_slots",
        default: "1024",
        help: "slots of the retraining circular queue",
    },
    KnobSpec {
        name: "poll_us",
        default: "2000",
        help: "how often the memory node checks the retraining queue, in µs, 1..=1000000 (each check costs ~10 µs of CPU, wake-up included)",
    },
    KnobSpec {
        name: "lock_sharing",
        default: "true",
        help: "threads of one compute node hand a held leaf lock to each other (§3.4)",
    },
    KnobSpec {
        name: "max_handover",
        default: "16",
        help: "consecutive local hand-overs of a leaf lock before it is released remotely (0 = none: every release is remote)",
    },
    KnobSpec {
        name: "retrain_lock_wait_us",
        default: "50000",
        help: "longest the retrainer waits for one leaf lock a compute node holds before it puts the model back in service and queues it again, in µs, 1..=600000000 (a holder that died never releases; see docs/rolex.md)",
    },
];

/// Everything both sides need to agree on, plus local tuning.
#[derive(Debug, Clone, PartialEq)]
pub struct Config {
    pub epsilon: u64,
    pub leaf: LeafLayout,
    pub slt_slots: usize,
    pub retrain_threshold: u64,
    pub retrain_threads: usize,
    pub upper_epsilon: u64,
    pub nodes: usize,
    pub leaves_per_node: u64,
    pub model_bytes: u64,
    pub value_bytes: u64,
    pub max_models: usize,
    /// Most keys per bulk-loaded model (`load_model_keys`; 0 = no cap).
    pub load_model_keys: usize,
    pub queue_slots: usize,
    pub poll_us: u64,
    pub lock_sharing: bool,
    pub max_handover: u32,
    /// Longest the retrainer waits for one LT lock held by a compute node
    /// (`retrain_lock_wait_us`): then it gives the model back (invariant 12
    /// of docs/rolex.md).
    pub retrain_lock_wait: std::time::Duration,
}

fn bad(what: String) -> KvError {
    KvError::Config(what)
}

impl Config {
    pub fn from_args(args: &ServeArgs) -> Result<Config> {
        let k = &args.knobs;
        let get = |name: &str| -> Result<u64> { k.get::<u64>(ENGINE, KNOBS, name) };
        let slots = get("leaf_slots")? as usize;
        if !(MIN_SLOTS..=MAX_SLOTS).contains(&slots) {
            return Err(bad(format!(
                "rolex.leaf_slots={slots}: must be in [{MIN_SLOTS}, {MAX_SLOTS}]"
            )));
        }
        let epsilon = get("epsilon")?;
        if epsilon == 0 || epsilon > 1 << 20 {
            return Err(bad(format!(
                "rolex.epsilon={epsilon}: must be in [1, 2^20]"
            )));
        }
        let slt_slots = get("slt_slots")? as usize;
        if !(4..=MAX_SLT_SLOTS).contains(&slt_slots) {
            return Err(bad(format!(
                "rolex.slt_slots={slt_slots}: must be in [4, {MAX_SLT_SLOTS}]"
            )));
        }
        let mut retrain_threshold = get("retrain_threshold")?;
        if retrain_threshold == 0 {
            retrain_threshold = (slt_slots / 2) as u64;
        }
        if retrain_threshold < 2 || retrain_threshold >= slt_slots as u64 {
            return Err(bad(format!(
                "rolex.retrain_threshold={retrain_threshold}: must be in [2, slt_slots)"
            )));
        }
        let nodes = args.nodes.len();
        if nodes == 0 || nodes > MAX_REGIONS {
            return Err(bad(format!(
                "rolex runs on 1 to {MAX_REGIONS} memory nodes, not {nodes}"
            )));
        }
        let leaf = LeafLayout::new(slots);
        let expected = args.expected_keys.max(1024);
        let per_node = |total: u64| total.div_ceil(nodes as u64);
        let mut leaves_per_node = get("leaves")?;
        if leaves_per_node == 0 {
            // Packed loads use 1/δ leaf per key; splits leave leaves half
            // full and every bulk load rewrites the leaves: reserve 6/δ.
            leaves_per_node = per_node(expected * 6 / slots as u64) + 4096;
        }
        if leaves_per_node > MAX_LEAF {
            return Err(bad("rolex.leaves exceeds 2^48".into()));
        }
        // Regions of at most 1 TiB: more is a typo, and `<< 20` must not wrap.
        let mb = |name: &str| -> Result<u64> {
            Ok(k.get_in::<u64>(ENGINE, KNOBS, name, 0..=1 << 20)? << 20)
        };
        let mut model_bytes = mb("model_region_mb")?;
        if model_bytes == 0 {
            model_bytes = per_node(expected * 192) + (16 << 20);
        }
        let mut value_bytes = mb("value_region_mb")?;
        if value_bytes == 0 {
            value_bytes =
                per_node(expected * 4 * block_bytes(args.value_size as usize) as u64) + (64 << 20);
        }
        let mut max_models = get("max_models")? as usize;
        if max_models == 0 {
            max_models = (expected as usize / slots).max(1024) + 1024;
        }
        let queue_slots = get("queue_slots")? as usize;
        if !(4..=1 << 20).contains(&queue_slots) {
            return Err(bad("rolex.queue_slots must be in [4, 2^20]".into()));
        }
        Ok(Config {
            epsilon,
            leaf,
            slt_slots,
            retrain_threshold,
            retrain_threads: k.get_in::<usize>(ENGINE, KNOBS, "retrain_threads", 1..=64)?,
            upper_epsilon: k.get_in::<u64>(ENGINE, KNOBS, "upper_epsilon", 1..=1 << 20)?,
            nodes,
            leaves_per_node,
            model_bytes,
            value_bytes,
            max_models,
            load_model_keys: k.get_in::<usize>(ENGINE, KNOBS, "load_model_keys", 0..=1 << 40)?,
            queue_slots,
            poll_us: k.get_in::<u64>(ENGINE, KNOBS, "poll_us", 1..=1_000_000)?,
            lock_sharing: k.get::<bool>(ENGINE, KNOBS, "lock_sharing")?,
            max_handover: k.get_in::<u32>(ENGINE, KNOBS, "max_handover", 0..=1 << 20)?,
            retrain_lock_wait: std::time::Duration::from_micros(k.get_in::<u64>(
                ENGINE,
                KNOBS,
                "retrain_lock_wait_us",
                1..=600_000_000,
            )?),
        })
    }

    pub fn slots(&self) -> usize {
        self.leaf.slots()
    }

    /// Words of one directory image slot.
    pub fn dir_slot_words(&self) -> usize {
        // Header, the models, and upper levels of at most one segment per
        // model (every segment covers at least two keys of the level below).
        8 + 2 * self.max_models + 6 * self.max_models
    }
}

/// Region names of an instance.
pub mod names {
    pub const META: &str = "rolex/meta";
    pub const LEAVES: &str = "rolex/leaves";
    pub const MODELS: &str = "rolex/models";
    pub const VALUES: &str = "rolex/values";
    pub const SERVICE: &str = "rolex/admin";
}
