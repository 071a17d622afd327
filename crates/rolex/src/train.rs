//! Training (§3.2): models from sorted keys (bulk load) or from a model's
//! live leaves in order (retraining, §3.5, which moves no data).
//!
//! A model's training points are, per leaf at position `r` in the model:
//! its fence `(low, r·δ)` — for `r = 0` only when the leaf is empty, for
//! `r > 0` when the leaf is empty or its first key is above its fence — and
//! its keys `(key_s, r·δ + ⌊s·δ/count⌋)`. With these points every key of the model's
//! range, trained or not, is predicted within one leaf of its group (see
//! docs/rolex.md, invariant 4).

use crate::plr::{Line, OptimalPlr, max_error, segment_keys};

/// A model trained over `keys[start..end]` (bulk load): its keys are packed
/// δ per leaf.
#[derive(Debug, Clone, PartialEq)]
pub struct KeySegment {
    pub start: usize,
    pub end: usize,
    pub line: Line,
    pub err: u32,
}

/// Segments sorted distinct keys into models with error `eps`.
pub fn train_keys(keys: &[u64], eps: u64) -> Vec<KeySegment> {
    segment_keys(keys, eps)
        .into_iter()
        .map(|(start, end, line)| KeySegment {
            start,
            end,
            err: max_error(&line, (start..end).map(|i| (keys[i], (i - start) as i64))),
            line,
        })
        .collect()
}

/// Splits every segment longer than `cap` keys into pieces of at most
/// `cap` (`cap = 0`: none), each keeping its segment's line moved to start
/// at its own first key, so its error is the segment's at most (plus one
/// position of floating-point rounding in the move). Bulk loads cap
/// their models this way (`rolex.load_model_keys`): a load into a loaded
/// store rewrites every model its keys meet, and near-linear keys loaded in
/// ascending calls would otherwise grow the last model, and each call's
/// work, with the whole store (docs/rolex.md, "Departures").
pub fn cap_segments(segs: Vec<KeySegment>, keys: &[u64], cap: usize) -> Vec<KeySegment> {
    if cap == 0 || segs.iter().all(|s| s.end - s.start <= cap) {
        return segs;
    }
    let mut out = Vec::with_capacity(segs.len());
    for s in segs {
        let mut start = s.start;
        while start < s.end {
            let end = (start + cap).min(s.end);
            // A record keeps no origin: a model's line starts at its first
            // key (`ModelParams::position` measures from `kmin`).
            let line = Line {
                origin: keys[start],
                slope: s.line.slope,
                intercept: s.line.eval(keys[start]) - (start - s.start) as f64,
            };
            out.push(KeySegment {
                start,
                end,
                err: max_error(&line, (start..end).map(|i| (keys[i], (i - start) as i64))),
                line,
            });
            start = end;
        }
    }
    out
}

/// What training needs of a leaf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeafKeys {
    pub low: u64,
    pub keys: Vec<u64>,
}

/// A model trained over `leaves[start..end]`.
#[derive(Debug, Clone, PartialEq)]
pub struct LeafSegment {
    pub start: usize,
    pub end: usize,
    pub line: Line,
    pub err: u32,
    pub kmin: u64,
    pub kmax: u64,
}

/// The training points of `leaf` at position `r` of its model.
pub fn leaf_points(
    leaf: &LeafKeys,
    r: usize,
    slots: usize,
) -> impl Iterator<Item = (u64, i64)> + '_ {
    let base = (r * slots) as i64;
    let fence = if r == 0 {
        leaf.keys.is_empty()
    } else {
        leaf.keys.first().is_none_or(|k| leaf.low < *k)
    };
    // A leaf's keys are spread evenly over its δ labels, so partly filled
    // leaves (after splits) do not turn the CDF into a sawtooth that eats
    // the error budget; labels stay within [r·δ, r·δ + δ).
    let count = leaf.keys.len().max(1) as i64;
    let d = slots as i64;
    fence.then_some((leaf.low, base)).into_iter().chain(
        leaf.keys
            .iter()
            .enumerate()
            .map(move |(s, k)| (*k, base + s as i64 * d / count)),
    )
}

/// Segments a model's leaves (in key order, fences increasing) into one or
/// more models; segments break only between leaves. A leaf whose points do
/// not fit one segment alone becomes a model of its own with its measured
/// (larger) error.
pub fn train_leaves(leaves: &[LeafKeys], slots: usize, eps: u64) -> Vec<LeafSegment> {
    let mut out = Vec::new();
    let mut start = 0;
    while start < leaves.len() {
        let mut plr = OptimalPlr::new(eps);
        let mut end = start;
        'leaves: while end < leaves.len() {
            for (x, y) in leaf_points(&leaves[end], end - start, slots) {
                if !plr.add(x, y) {
                    if end == start {
                        end += 1;
                    }
                    break 'leaves;
                }
            }
            end += 1;
        }
        let line = plr.line();
        let points = || (start..end).flat_map(|j| leaf_points(&leaves[j], j - start, slots));
        let err = max_error(&line, points());
        let kmin = points().next().map_or(leaves[start].low, |p| p.0);
        let kmax = points().last().map_or(kmin, |p| p.0);
        out.push(LeafSegment {
            start,
            end,
            line,
            err,
            kmin,
            kmax,
        });
        start = end;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::record::ModelParams;
    use proptest::prelude::*;

    /// The group of `key`: the last leaf whose fence is <= key.
    fn group(leaves: &[LeafKeys], key: u64) -> usize {
        leaves.partition_point(|l| l.low <= key) - 1
    }

    proptest! {
        // A capped piece keeps its segment's line, moved to start at its
        // first key as every model's does: each key's prediction within the
        // piece is within the piece's error, which is the segment's (up to
        // one position of rounding in the move).
        #[test]
        fn capped_segments_predict_within_their_error(
            raw in prop::collection::vec(any::<u64>(), 1..600),
            eps in 1u64..40,
            cap in 1usize..200,
        ) {
            let mut keys = raw;
            keys.sort_unstable();
            keys.dedup();
            let whole = train_keys(&keys, eps);
            let capped = cap_segments(whole.clone(), &keys, cap);
            prop_assert_eq!(capped.first().map(|s| s.start), Some(0));
            prop_assert_eq!(capped.last().map(|s| s.end), Some(keys.len()));
            for w in capped.windows(2) {
                prop_assert_eq!(w[0].end, w[1].start);
            }
            for p in &capped {
                prop_assert!(p.end - p.start <= cap && p.end > p.start);
                let parent = whole.iter().find(|s| s.start <= p.start && p.end <= s.end).unwrap();
                prop_assert_eq!(p.line.origin, keys[p.start]);
                prop_assert!(p.err <= parent.err + 1, "{} > {}", p.err, parent.err);
                // As the loader stores it (no origin: it measures from kmin).
                let model = ModelParams {
                    low: keys[p.start],
                    high: u64::MAX,
                    kmin: keys[p.start],
                    kmax: keys[p.end - 1],
                    slope: p.line.slope,
                    intercept: p.line.intercept,
                    err: p.err,
                    leaves: 1,
                    slt_slots: 1,
                    region: 0,
                };
                for (label, &k) in keys[p.start..p.end].iter().enumerate() {
                    let d = (model.position(k) - label as f64).abs();
                    prop_assert!(d < p.err as f64, "key {k}: off by {d}, err {}", p.err);
                }
            }
        }

        // Invariant 4: for any key in a model's range, trained or not, the
        // predicted leaf range holds its group.
        #[test]
        fn predictions_cover_every_key(
            raw in prop::collection::vec((any::<u64>(), 0usize..=16), 1..200),
            probes in prop::collection::vec(any::<u64>(), 1..300),
            eps in 1u64..40,
            slots in 2usize..=16,
        ) {
            // Build leaves with increasing fences and up to `slots` keys each.
            let mut fences: Vec<u64> = raw.iter().map(|r| r.0 >> 1).collect();
            fences.push(0);
            fences.sort_unstable();
            fences.dedup();
            let mut leaves = Vec::new();
            for (i, f) in fences.iter().enumerate() {
                let next = fences.get(i + 1).copied().unwrap_or(u64::MAX);
                let want = raw.get(i).map_or(0, |r| r.1).min(slots);
                let gap = (next - f) / (want as u64 + 2);
                let keys: Vec<u64> = if gap == 0 { vec![] } else {
                    (0..want as u64).map(|s| f + gap * (s + 1)).collect()
                };
                leaves.push(LeafKeys { low: *f, keys });
            }
            for seg in train_leaves(&leaves, slots, eps) {
                let model = &leaves[seg.start..seg.end];
                let p = ModelParams {
                    low: model[0].low,
                    high: leaves.get(seg.end).map_or(u64::MAX, |l| l.low),
                    kmin: seg.kmin,
                    kmax: seg.kmax,
                    slope: seg.line.slope,
                    intercept: seg.line.intercept,
                    err: seg.err,
                    leaves: model.len() as u32,
                    slt_slots: 16,
                    region: 0,
                };
                let check = |k: u64| -> Result<(), TestCaseError> {
                    if k < p.low || k >= p.high { return Ok(()); }
                    let g = group(model, k);
                    let (lo, hi) = p.leaf_range(k, slots);
                    prop_assert!(lo <= g && g <= hi, "key {} group {} range {:?} {:?}", k, g, (lo, hi), p);
                    Ok(())
                };
                for l in model {
                    check(l.low)?;
                    check(l.low.saturating_sub(1))?;
                    for k in &l.keys { check(*k)?; check(k + 1)?; check(k - 1)?; }
                }
                for k in &probes { check(*k)?; }
                check(p.high - 1)?;
            }
        }
    }

    #[test]
    fn bulk_segments_cover_all_keys() {
        let keys: Vec<u64> = (0..5000u64).map(|i| i * i + 7).collect();
        let segs = train_keys(&keys, 16);
        assert_eq!(segs.first().unwrap().start, 0);
        assert_eq!(segs.last().unwrap().end, keys.len());
        assert!(segs.iter().all(|s| s.err <= 17));
    }
}
