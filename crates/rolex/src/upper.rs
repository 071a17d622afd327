//! Upper model levels (as in the PGM-index, §3.3): piecewise-linear models
//! over the models' low keys, recursively, until one segment remains. A
//! lookup predicts an index in the level below and searches only a window
//! of ±(error + 1) around it.

use crate::plr::{Line, max_error, segment_keys};

/// One upper-level segment: predicts the index, in the level below, of the
/// last key `<= x` for `x` in `[first, ...)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Segment {
    pub first: u64,
    pub last: u64,
    pub slope: f64,
    pub intercept: f64,
}

impl Segment {
    fn predict(&self, x: u64) -> f64 {
        let x = x.clamp(self.first, self.last);
        self.intercept + self.slope * ((x - self.first) as f64)
    }
}

/// The upper levels, top level (one segment) first.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct UpperIndex {
    pub levels: Vec<Vec<Segment>>,
    /// Per level: error bound of its predictions.
    pub errs: Vec<u32>,
    /// Per level: the first keys of its segments (derived).
    firsts: Vec<Vec<u64>>,
}

impl UpperIndex {
    /// Builds levels over `lows` (sorted, distinct) with error `eps`.
    pub fn build(lows: &[u64], eps: u64) -> UpperIndex {
        let mut levels = Vec::new();
        let mut errs = Vec::new();
        let mut keys = lows.to_vec();
        while keys.len() > 1 {
            let segs = segment_keys(&keys, eps);
            let mut err = 0;
            let level: Vec<Segment> = segs
                .iter()
                .map(|(s, e, line)| {
                    // Labels are global indices in the level below.
                    let line = Line {
                        origin: keys[*s],
                        slope: line.slope,
                        intercept: line.intercept + *s as f64,
                    };
                    err = err.max(max_error(&line, (*s..*e).map(|i| (keys[i], i as i64))));
                    Segment {
                        first: keys[*s],
                        last: keys[*e - 1],
                        slope: line.slope,
                        intercept: line.intercept,
                    }
                })
                .collect();
            keys = level.iter().map(|s| s.first).collect();
            levels.push(level);
            errs.push(err);
        }
        levels.reverse();
        errs.reverse();
        let mut u = UpperIndex {
            levels,
            errs,
            firsts: Vec::new(),
        };
        u.check(lows).expect("a freshly built index is consistent");
        u
    }

    /// Checks the shape against `lows` and derives the search arrays.
    pub fn check(&mut self, lows: &[u64]) -> Result<(), String> {
        if lows.is_empty() {
            return Err("no models".into());
        }
        if self.levels.is_empty() != (lows.len() == 1) {
            return Err("upper levels do not match the model count".into());
        }
        if self.levels.first().is_some_and(|l| l.len() != 1) {
            return Err("the top upper level must have one segment".into());
        }
        self.firsts = self
            .levels
            .iter()
            .map(|l| l.iter().map(|s| s.first).collect())
            .collect();
        for (i, f) in self.firsts.iter().enumerate() {
            if f.windows(2).any(|w| w[0] >= w[1]) {
                return Err(format!("upper level {i} is not sorted"));
            }
        }
        Ok(())
    }

    /// Index of the last key of `lows` that is `<= key` (0 if none).
    pub fn lookup(&self, lows: &[u64], key: u64) -> usize {
        let mut idx = 0;
        for (l, level) in self.levels.iter().enumerate() {
            let target: &[u64] = match self.firsts.get(l + 1) {
                Some(f) => f,
                None => lows,
            };
            let seg = &level[idx.min(level.len() - 1)];
            let p = seg.predict(key);
            let e = self.errs[l] as f64 + 1.0;
            let last = target.len() as i64 - 1;
            let lo = ((p - e).floor() as i64).clamp(0, last) as usize;
            let hi = ((p + e).ceil() as i64).clamp(0, last) as usize;
            idx = if target[lo] <= key && target.get(hi + 1).is_none_or(|n| *n > key) {
                lo + target[lo..=hi].partition_point(|k| *k <= key) - 1
            } else {
                // Cannot happen with a consistent index; stay correct anyway.
                target.partition_point(|k| *k <= key).saturating_sub(1)
            };
        }
        idx
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn lookups_match_binary_search(mut lows in prop::collection::vec(any::<u64>(), 1..3000), probes in prop::collection::vec(any::<u64>(), 1..200), eps in 1u64..16) {
            lows.push(0);
            lows.sort_unstable();
            lows.dedup();
            let u = UpperIndex::build(&lows, eps);
            for k in probes.into_iter().chain(lows.iter().copied()) {
                let want = lows.partition_point(|x| *x <= k) - 1;
                prop_assert_eq!(u.lookup(&lows, k), want);
            }
        }
    }
}
