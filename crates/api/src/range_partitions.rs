//! Range partitioning of the key space over a deployment's memory nodes:
//! `K - 1` ascending split keys cut `u64` into `K` ranges, and range `p` is
//! served by the `p`-th memory node. XStore (§5.5) and the tree baselines
//! (`rpc-btree`, `cell`) use it; their `bounds` knob gives the split keys,
//! and `dmkv bench` sets them at the loaded keys' quantiles unless the knob
//! is given (crates/bench/src/runner.rs, `with_quantile_bounds`).

use crate::{Key, KvError, Result};

/// `K` key ranges: range `p` is `[low(p), low(p + 1))`, the last one up to
/// and including `u64::MAX`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RangePartitions {
    /// The `K - 1` split keys, strictly ascending and above 0.
    bounds: Vec<Key>,
}

impl RangePartitions {
    /// Parses `engine`'s `bounds` knob for `parts` ranges: empty gives equal
    /// ranges of the `u64` space; otherwise exactly `parts - 1` split keys,
    /// comma-separated, strictly ascending and above 0.
    pub fn parse(engine: &str, s: &str, parts: usize) -> Result<RangePartitions> {
        let parts = parts.max(1);
        if s.trim().is_empty() {
            let width = (u64::MAX as u128 + 1) / parts as u128;
            return Ok(RangePartitions {
                bounds: (1..parts).map(|p| (width * p as u128) as u64).collect(),
            });
        }
        let v: Vec<u64> = s
            .split(',')
            .map(|x| x.trim().parse::<u64>())
            .collect::<std::result::Result<_, _>>()
            .map_err(|e| KvError::Config(format!("{engine}.bounds={s:?}: {e}")))?;
        if v.len() + 1 != parts {
            return Err(KvError::Config(format!(
                "{engine}.bounds has {} split keys; {} memory nodes need {}",
                v.len(),
                parts,
                parts - 1
            )));
        }
        if v.first() == Some(&0) || v.windows(2).any(|w| w[0] >= w[1]) {
            return Err(KvError::Config(format!(
                "{engine}.bounds={s:?} must be ascending and above 0"
            )));
        }
        Ok(RangePartitions { bounds: v })
    }

    /// The split keys.
    pub fn bounds(&self) -> &[Key] {
        &self.bounds
    }

    /// How many ranges.
    pub fn count(&self) -> usize {
        self.bounds.len() + 1
    }

    /// The range holding `key`.
    #[inline]
    pub fn of(&self, key: Key) -> usize {
        self.bounds.partition_point(|&b| b <= key)
    }

    /// The smallest key of range `p`.
    pub fn low(&self, p: usize) -> Key {
        if p == 0 { 0 } else { self.bounds[p - 1] }
    }

    /// The keys of range `p` as `[lo, hi]`.
    pub fn range(&self, p: usize) -> (Key, Key) {
        let hi = self.bounds.get(p).map_or(u64::MAX, |b| b - 1);
        (self.low(p), hi)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_cover_the_key_space_and_bad_bounds_are_refused() {
        let r = RangePartitions::parse("e", "10,20", 3).unwrap();
        assert_eq!(r.count(), 3);
        assert_eq!(
            (r.of(0), r.of(9), r.of(10), r.of(19), r.of(20)),
            (0, 0, 1, 1, 2)
        );
        assert_eq!(r.of(u64::MAX), 2);
        assert_eq!(
            (r.range(0), r.range(1), r.range(2)),
            ((0, 9), (10, 19), (20, u64::MAX))
        );
        let one = RangePartitions::parse("e", "", 1).unwrap();
        assert_eq!(
            (one.count(), one.of(u64::MAX), one.range(0)),
            (1, 0, (0, u64::MAX))
        );
        let equal = RangePartitions::parse("e", " ", 4).unwrap();
        assert_eq!(equal.bounds(), [1 << 62, 2 << 62, 3 << 62]);
        for (bad, needle) in [
            ("10", "has 1 split keys; 3 memory nodes need 2"),
            ("20,10", "must be ascending"),
            ("0,10", "above 0"),
            ("10,x", "e.bounds=\"10,x\""),
        ] {
            let e = RangePartitions::parse("e", bad, 3).unwrap_err().to_string();
            assert!(e.contains(needle), "{bad}: {e}");
        }
    }
}
