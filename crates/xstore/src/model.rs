//! Training (paper Fig. 6), as pure functions over leaves: the top model,
//! the key interval each sub-model serves, and one sub-model with its
//! translation table. The server runs these on its retraining workers; the
//! micro-benchmark (`examples/train.rs`) times them.
//!
//! Positions follow Fig. 6: the `r`-th smallest key of logical leaf `l`
//! (leaves numbered from 0 within the sub-model) is at `l * N + r`. Errors
//! are kept at leaf granularity: they are the smallest `min_err`, `max_err`
//! such that `[floor((P - min_err) / N), floor((P + max_err) / N)]` holds
//! the leaf of every trained key, which is what a lookup needs (Fig. 7,
//! lines 4-5). The boundary keys of §5.2.3 are added as two virtual points:
//! the interval's first key must predict leaf 0 and its last key the last
//! leaf, so that absent keys near the interval's edges still reach the edge
//! leaves (see docs/xstore.md, invariant 6, for why lookups stay correct
//! whatever the prediction).

use crate::layout::{TopModel, TtEntry, predict_position};
use dmkv_xtree::CoveredLeaf;

/// A trained sub-model and its translation table, before publication.
#[derive(Debug, Clone, PartialEq)]
pub struct TrainedSub {
    pub slope: f64,
    pub intercept: f64,
    pub base: u64,
    pub min_err: u32,
    pub max_err: u32,
    /// Packed [`TtEntry`]s, one per leaf, in key order.
    pub entries: Vec<u64>,
    /// Keys trained on (straddling leaves' keys count in both neighbours).
    pub keys: u64,
    /// Mean |P(k) - position(k)| over the trained keys, in slots (the
    /// paper's "prediction error").
    pub mean_abs_err: f64,
}

/// Least squares over `(x, y)`: (slope, intercept), slope clamped to be
/// non-negative (monotonic models, §5.2.3). Fewer than two distinct `x`
/// give a flat line through the mean.
fn fit(points: impl Iterator<Item = (f64, f64)> + Clone) -> (f64, f64) {
    let (mut n, mut sx, mut sy) = (0f64, 0f64, 0f64);
    for (x, y) in points.clone() {
        n += 1.0;
        sx += x;
        sy += y;
    }
    if n == 0.0 {
        return (0.0, 0.0);
    }
    let (mx, my) = (sx / n, sy / n);
    let (mut sxx, mut sxy) = (0f64, 0f64);
    for (x, y) in points {
        let dx = x - mx;
        sxx += dx * dx;
        sxy += dx * (y - my);
    }
    let slope = if sxx > 0.0 { sxy / sxx } else { 0.0 };
    let slope = if slope.is_finite() && slope > 0.0 {
        slope
    } else {
        0.0
    };
    let intercept = my - slope * mx;
    (
        slope,
        if intercept.is_finite() {
            intercept
        } else {
            0.0
        },
    )
}

/// TRAIN_SUBMODEL (Fig. 6, lines 12-22) over `leaves`, the leaves covering
/// the sub-model's interval `[base, last]` in key order (from
/// [`dmkv_xtree::XTree::leaves_covering`]). Every key of those leaves is
/// trained, including keys of straddling leaves outside the interval.
pub fn train_submodel(leaves: &[CoveredLeaf], base: u64, last: u64, slots: u32) -> TrainedSub {
    let n = slots as i64;
    let points = leaves.iter().enumerate().flat_map(|(lln, l)| {
        l.info
            .keys
            .iter()
            .enumerate()
            .map(move |(r, &k)| (k, lln as i64 * n + r as i64))
    });
    let (slope, intercept) = fit(points
        .clone()
        .map(|(k, pos)| (k.saturating_sub(base) as f64, pos as f64)));
    let (mut min_err, mut max_err) = (0i64, 0i64);
    let (mut keys, mut abs) = (0u64, 0f64);
    for (k, pos) in points {
        let p = predict_position(slope, intercept, base, k);
        let l = pos.div_euclid(n);
        // s(k) <= l  <=>  P - min_err < (l + 1) N
        min_err = min_err.max(p.saturating_sub((l + 1) * n - 1));
        // e(k) >= l  <=>  P + max_err >= l N
        max_err = max_err.max((l * n).saturating_sub(p));
        keys += 1;
        abs += (p as f64 - pos as f64).abs();
    }
    if !leaves.is_empty() {
        // §5.2.3 boundary keys: the interval's first key reaches leaf 0 and
        // its last key the last leaf.
        let t = leaves.len() as i64;
        min_err = min_err.max(predict_position(slope, intercept, base, base).saturating_sub(n - 1));
        max_err = max_err
            .max(((t - 1) * n).saturating_sub(predict_position(slope, intercept, base, last)));
    }
    let entries = leaves
        .iter()
        .map(|l| {
            TtEntry {
                valid: true,
                leaf: l.info.node,
                incarnation: l.info.incarnation,
                count: l.info.count,
            }
            .pack()
        })
        .collect();
    TrainedSub {
        slope,
        intercept,
        base,
        min_err: min_err.clamp(0, u32::MAX as i64) as u32,
        max_err: max_err.clamp(0, u32::MAX as i64) as u32,
        entries,
        keys,
        mean_abs_err: if keys == 0 { 0.0 } else { abs / keys as f64 },
    }
}

/// The top model (Fig. 6, lines 1-5) from `samples` of `(key, rank)` among
/// `total` keys of the partition `[lo, hi]`, scaled so that it routes to
/// `[0, m)`. Without two distinct sampled keys it splits the partition's
/// key range evenly.
pub fn train_top(samples: &[(u64, u64)], total: u64, lo: u64, hi: u64, m: u32) -> TopModel {
    let even = TopModel {
        slope: m as f64 / ((hi - lo) as f64 + 1.0),
        intercept: 0.0,
    };
    if samples.len() < 2 || total == 0 {
        return even;
    }
    let (slope, intercept) = fit(samples
        .iter()
        .map(|&(k, r)| (k.saturating_sub(lo) as f64, r as f64)));
    if slope == 0.0 {
        return even;
    }
    let scale = m as f64 / total as f64;
    TopModel {
        slope: slope * scale,
        intercept: intercept * scale,
    }
}

/// The first key of every sub-model's interval: `first[i]` is the smallest
/// key of `[lo, hi]` the top model routes to `i` or above (`hi + 1` if
/// none), with `first[0] = lo` and `first[m] = hi + 1`. Sub-model `i`
/// serves `[first[i], first[i + 1])`, empty when they are equal. Found by
/// galloping from the line's inverse and bisecting, on the exact routing
/// function clients use.
pub fn interval_starts(top: &TopModel, lo: u64, hi: u64, m: u32) -> Vec<u128> {
    let route = |k: u128| crate::layout::top_route(top, lo, m, k as u64) as u64;
    let end = hi as u128 + 1;
    let mut first = Vec::with_capacity(m as usize + 1);
    first.push(lo as u128);
    for i in 1..m as u64 {
        let from = *first.last().expect("first[0] is set");
        // Smallest k in [from, end) with route(k) >= i, or `end`.
        let at_least = |k: u128| k >= end || route(k) >= i;
        let guess = if top.slope > 0.0 {
            let g = lo as f64 + (i as f64 - top.intercept) / top.slope;
            if g.is_finite() && g > 0.0 {
                (g as u128).clamp(from, end)
            } else {
                from
            }
        } else {
            end
        };
        // Gallop to a bracket [a, b] with !at_least(a) (or a = from) and
        // at_least(b).
        let (mut a, mut b);
        if at_least(guess) {
            b = guess;
            let mut step = 1u128;
            loop {
                let probe = b.saturating_sub(step).max(from);
                if probe == from || !at_least(probe) {
                    a = probe;
                    break;
                }
                b = probe;
                step *= 2;
            }
            if a == from && at_least(from) {
                first.push(from);
                continue;
            }
        } else {
            a = guess;
            let mut step = 1u128;
            loop {
                let probe = (a + step).min(end);
                if at_least(probe) {
                    b = probe;
                    break;
                }
                a = probe;
                step *= 2;
            }
        }
        // Invariant: !at_least(a), at_least(b), a < b.
        while b - a > 1 {
            let mid = a + (b - a) / 2;
            if at_least(mid) {
                b = mid;
            } else {
                a = mid;
            }
        }
        first.push(b);
    }
    first.push(end);
    first
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{leaf_range, top_route};
    use dmkv_xtree::LeafInfo;

    fn leaves(keys_per_leaf: &[Vec<u64>]) -> Vec<CoveredLeaf> {
        let mut lower = 0;
        keys_per_leaf
            .iter()
            .enumerate()
            .map(|(i, ks)| {
                let upper = keys_per_leaf
                    .get(i + 1)
                    .and_then(|n| n.first().copied())
                    .map(|f| f.saturating_sub(1).max(lower + 1));
                let l = CoveredLeaf {
                    info: LeafInfo {
                        node: 10 + i as u32,
                        incarnation: i as u32,
                        count: ks.len() as u8,
                        keys: ks.clone(),
                    },
                    lower,
                    upper,
                };
                lower = upper.unwrap_or(u64::MAX);
                l
            })
            .collect()
    }

    #[test]
    fn every_trained_key_is_inside_its_predicted_leaves() {
        let mut rng = 12345u64;
        let mut next = || {
            rng ^= rng << 13;
            rng ^= rng >> 7;
            rng ^= rng << 17;
            rng
        };
        for round in 0..50 {
            let per = 4 + round % 13;
            let mut all: Vec<u64> = (0..200).map(|_| next() >> (round % 40)).collect();
            all.sort_unstable();
            all.dedup();
            let groups: Vec<Vec<u64>> = all.chunks(per).map(|c| c.to_vec()).collect();
            let ls = leaves(&groups);
            let base = all[0] / 2;
            let last = all[all.len() - 1].saturating_add(1000);
            let t = train_submodel(&ls, base, last, 16);
            assert_eq!(t.entries.len(), ls.len());
            assert_eq!(t.keys, all.len() as u64);
            for (lln, g) in groups.iter().enumerate() {
                for &k in g {
                    let p = predict_position(t.slope, t.intercept, base, k);
                    let (s, e) = leaf_range(p, t.min_err, t.max_err, 16, ls.len() as u32).unwrap();
                    assert!(
                        s as usize <= lln && lln <= e as usize,
                        "round {round} key {k}"
                    );
                }
            }
            let pb = predict_position(t.slope, t.intercept, base, base);
            assert_eq!(
                leaf_range(pb, t.min_err, t.max_err, 16, ls.len() as u32)
                    .unwrap()
                    .0,
                0
            );
            let pl = predict_position(t.slope, t.intercept, base, last);
            assert_eq!(
                leaf_range(pl, t.min_err, t.max_err, 16, ls.len() as u32)
                    .unwrap()
                    .1 as usize,
                ls.len() - 1
            );
            assert!(t.slope >= 0.0);
        }
    }

    #[test]
    fn straight_lines_train_without_error() {
        // 8 keys per leaf at positions l*16 + r, keys spaced so the line
        // fits exactly within each leaf.
        let groups: Vec<Vec<u64>> = (0..10u64)
            .map(|l| (0..16u64).map(|r| 1000 + (l * 16 + r) * 10).collect())
            .collect();
        let ls = leaves(&groups);
        let t = train_submodel(&ls, 1000, 1000 + 160 * 10 - 1, 16);
        assert!(t.mean_abs_err < 1e-6, "{}", t.mean_abs_err);
        assert_eq!((t.min_err, t.max_err), (0, 0));
    }

    #[test]
    fn intervals_partition_the_key_space_exactly_as_routing_does() {
        for (lo, hi, m) in [
            (0u64, u64::MAX, 97u32),
            (1000, 1_000_000, 13),
            (5, 5, 4),
            (0, 100, 1),
        ] {
            let samples: Vec<(u64, u64)> = (0..500u64)
                .map(|i| (lo + ((hi - lo) / 500) * i + (i * i % 7), i))
                .collect();
            for top in [
                train_top(&samples, 500, lo, hi, m),
                train_top(&[], 0, lo, hi, m),
            ] {
                let first = interval_starts(&top, lo, hi, m);
                assert_eq!(first.len(), m as usize + 1);
                assert_eq!(first[0], lo as u128);
                assert_eq!(first[m as usize], hi as u128 + 1);
                for i in 0..m as usize {
                    assert!(first[i] <= first[i + 1]);
                    if first[i] < first[i + 1] {
                        let a = first[i] as u64;
                        let b = (first[i + 1] - 1) as u64;
                        assert_eq!(top_route(&top, lo, m, a) as usize, i);
                        assert_eq!(top_route(&top, lo, m, b) as usize, i);
                        if a > lo {
                            assert!((top_route(&top, lo, m, a - 1) as usize) < i);
                        }
                    }
                }
            }
        }
    }
}
