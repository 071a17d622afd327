//! The partitioned access pattern (`--partitioned`) and its shifts
//! (`--shift-every-ms`), after ScaleStore's workload-shift experiment
//! (SIGMOD'22 §6.5, Fig. 9): the loaded keys are split, in key order, into
//! one contiguous partition per node; every compute thread draws the keys of
//! its operations (uniform or zipfian) from the partition its node is
//! assigned; after the k-th shift node `i` is assigned partition
//! `(i + k) mod N`, so each node's working set moves to another node's keys
//! at once.
//!
//! Invariants (tests: `plan::tests::partitioned_*`, the `partitioned_*`
//! tests of the runner in `src/tests.rs`):
//! 1. Partitions cover the loaded keys exactly once, in key order; sizes
//!    differ by at most one; each holds at least one key.
//! 2. Between shifts a thread names only keys of partition
//!    `(node + phase) mod N`; the phase is the number of whole shift
//!    intervals elapsed since the run began, read from the runtime's clock
//!    when the operation is drawn (virtual time under `sim`, so a seed
//!    replays its shifts exactly).
//! 3. Which node a thread belongs to follows the deployment:
//!    [`NodeMap::Modulo`] for symmetric engines (thread `t` runs on node
//!    `t mod --nodes`, ScaleStore's `home_node`), [`NodeMap::Block`] for
//!    disaggregated engines on several compute nodes (thread `t` on compute
//!    node `t / --threads`, the simulated deployment's rule).

use crate::dist::{ScrambledZipfian, ZIPFIAN_THETA, zeta};
use crate::rng::Rng;
use crate::workload::Dist;

/// How compute threads map to nodes (invariant 3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeMap {
    /// Thread `t` runs on node `t % nodes` (symmetric nodes, `--nodes`).
    Modulo { nodes: usize },
    /// Thread `t` runs on node `t / per_node` (`--compute-nodes` under
    /// `sim`, `per_node` = `--threads`).
    Block { nodes: usize, per_node: usize },
}

impl NodeMap {
    pub fn nodes(&self) -> usize {
        match *self {
            NodeMap::Modulo { nodes } | NodeMap::Block { nodes, .. } => nodes,
        }
    }

    /// The node of global compute thread `thread`.
    pub fn node_of(&self, thread: usize) -> usize {
        match *self {
            NodeMap::Modulo { nodes } => thread % nodes,
            NodeMap::Block { nodes, per_node } => (thread / per_node).min(nodes - 1),
        }
    }
}

/// What `--partitioned` asks of a plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PartitionSpec {
    pub map: NodeMap,
}

/// The partitions of one plan: loaded keys in key order, cut in N.
#[derive(Debug)]
pub struct Partitions {
    pub map: NodeMap,
    /// Universe indices of the loaded keys, ascending by key.
    sorted: Vec<u32>,
    /// `bounds[p]..bounds[p + 1]` are partition p's ranks in `sorted`.
    bounds: Vec<usize>,
    /// ζ(size of partition p), for zipfian draws.
    zetas: Vec<f64>,
}

impl Partitions {
    /// Cuts `sorted` (the loaded keys' indices in key order) into one
    /// partition per node. The caller checked there are at least as many
    /// keys as nodes.
    pub fn new(map: NodeMap, sorted: Vec<u32>, dist: Dist) -> Partitions {
        let n = map.nodes();
        let len = sorted.len();
        assert!(n >= 1 && len >= n, "checked by the plan");
        let bounds: Vec<usize> = (0..=n).map(|p| p * len / n).collect();
        // At most two distinct sizes: compute each ζ once.
        let mut known: Vec<(usize, f64)> = Vec::new();
        let zetas = (0..n)
            .map(|p| {
                let size = bounds[p + 1] - bounds[p];
                if dist != Dist::Zipfian {
                    return 0.0;
                }
                if let Some(&(_, z)) = known.iter().find(|(s, _)| *s == size) {
                    return z;
                }
                let z = zeta(size as u64, ZIPFIAN_THETA);
                known.push((size, z));
                z
            })
            .collect();
        Partitions {
            map,
            sorted,
            bounds,
            zetas,
        }
    }

    pub fn count(&self) -> usize {
        self.bounds.len() - 1
    }

    /// The partition compute thread `thread` draws from in `phase`
    /// (invariant 2).
    pub fn partition_of(&self, thread: usize, phase: u64) -> usize {
        let n = self.count() as u64;
        ((self.map.node_of(thread) as u64 + phase % n) % n) as usize
    }

    /// Partition `p`'s keys, as universe indices ascending by key.
    pub fn members(&self, p: usize) -> &[u32] {
        &self.sorted[self.bounds[p]..self.bounds[p + 1]]
    }

    /// A chooser for one task of `thread`.
    pub fn chooser(&self, thread: usize, dist: Dist) -> PartChooser {
        let zipfs = match dist {
            Dist::Zipfian => (0..self.count())
                .map(|p| ScrambledZipfian::with_zeta(self.members(p).len() as u64, self.zetas[p]))
                .collect(),
            _ => Vec::new(),
        };
        PartChooser {
            thread,
            phase: 0,
            zipfs,
        }
    }
}

/// One task's draws under the partitioned pattern.
#[derive(Debug, Clone)]
pub struct PartChooser {
    thread: usize,
    /// Shifts elapsed (invariant 2); set before each draw by the runner.
    pub phase: u64,
    /// Per partition, for zipfian draws (empty for uniform).
    zipfs: Vec<ScrambledZipfian>,
}

impl PartChooser {
    /// A universe index from this task's current partition.
    pub fn choose(&mut self, parts: &Partitions, rng: &mut Rng) -> u32 {
        let p = parts.partition_of(self.thread, self.phase);
        let members = parts.members(p);
        let r = match self.zipfs.get_mut(p) {
            Some(z) => z.next(rng),
            None => rng.below(members.len() as u64),
        };
        members[r as usize]
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_maps_follow_the_deployments() {
        let m = NodeMap::Modulo { nodes: 5 };
        assert_eq!(
            (0..7).map(|t| m.node_of(t)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 0, 1]
        );
        let b = NodeMap::Block {
            nodes: 3,
            per_node: 2,
        };
        assert_eq!(
            (0..6).map(|t| b.node_of(t)).collect::<Vec<_>>(),
            [0, 0, 1, 1, 2, 2]
        );
    }

    #[test]
    fn partitions_cover_the_keys_once_in_order() {
        let sorted: Vec<u32> = (0..103).rev().collect();
        let p = Partitions::new(NodeMap::Modulo { nodes: 5 }, sorted.clone(), Dist::Zipfian);
        let joined: Vec<u32> = (0..5).flat_map(|i| p.members(i).to_vec()).collect();
        assert_eq!(joined, sorted);
        let sizes: Vec<usize> = (0..5).map(|i| p.members(i).len()).collect();
        assert!(sizes.iter().all(|&s| s == 20 || s == 21), "{sizes:?}");
        // Node 0 takes partition 1 after the first shift, 4 after the fourth,
        // its own again after the fifth.
        assert_eq!(
            (0..6).map(|k| p.partition_of(0, k)).collect::<Vec<_>>(),
            [0, 1, 2, 3, 4, 0]
        );
        assert_eq!(p.partition_of(4, 1), 0);
    }
}
