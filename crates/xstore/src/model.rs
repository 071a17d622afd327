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

use crate::layout::{MAX_TT_LEN, TopModel, TtEntry, leaf_range, predict_position, top_route};
use dmkv_xtree::CoveredLeaf;
use std::collections::BTreeMap;

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

/// Work XStore's training declares to `sim`'s instruction term
/// ([`dmkv_transport::sim::work`], a no-op off a metered memory-node core;
/// docs/simulation.md, "Declared work for worker jobs and ScaleStore
/// (branch i55)"), counted with callgrind on the `local` transport, main's
/// binary 751ec1c (`/tmp/keep/dmkv-head14`): `valgrind --tool=callgrind
/// dmkv bench --engine xstore --workload insert --keys 50000 --ops 30000
/// --threads 1 --tasks 8 --seed 1` (698 retrainings and 2 full trainings:
/// 2,199 sub-models, 278,506 keys trained, 1,199 publications).
pub mod cost {
    /// Training a sub-model, per key: `train_submodel` (the fit and the
    /// error bounds), 47,440,970 over 278,506 keys.
    pub const TRAIN_KEY: u64 = 170;
    /// Publishing a retrained sub-model: `ModelStore::publish` 2,358,920
    /// over 1,199 publications less its region writes (728,932, charged
    /// by their lines): the TT block's encoding, its allocation, the
    /// checksum, the swap.
    pub const PUBLISH: u64 = 1_359;
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
    dmkv_transport::sim::work(cost::TRAIN_KEY * keys);
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

/// Which line the top model is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopKind {
    /// Least squares over sampled `(key, rank)` (Fig. 6, the paper's).
    LeastSquares,
    /// The line from the first sampled key (sub-model 0) to the last (sub-model
    /// M - 1). Least squares clamps the tails of an S-shaped CDF (normal
    /// keys: beyond about 1.8 sigma on each side) into the first and last
    /// sub-model whatever M is, so more sub-models never shorten them;
    /// this line clamps nothing, so doubling M narrows every interval.
    Span,
}

impl TopKind {
    pub fn name(self) -> &'static str {
        match self {
            TopKind::LeastSquares => "least_squares",
            TopKind::Span => "span",
        }
    }
}

/// The top model of kind `kind` (see [`train_top`]).
pub fn train_top_kind(
    kind: TopKind,
    samples: &[(u64, u64)],
    total: u64,
    lo: u64,
    hi: u64,
    m: u32,
) -> TopModel {
    match kind {
        TopKind::LeastSquares => train_top(samples, total, lo, hi, m),
        TopKind::Span => {
            let (Some(first), Some(last)) = (samples.first(), samples.last()) else {
                return train_top(samples, total, lo, hi, m);
            };
            if last.0 <= first.0 {
                return train_top(samples, total, lo, hi, m);
            }
            let slope = m as f64 / ((last.0 - first.0) as f64 + 1.0);
            TopModel {
                slope,
                intercept: -slope * (first.0 - lo) as f64,
            }
        }
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

/// Lookups a sizing candidate is judged by: sampled keys, spread evenly
/// over the partition's keys by rank.
pub const SIZING_PROBES: usize = 4096;

/// A sub-model count tried by [`size_submodels`] and how lookups fared.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Candidate {
    pub submodels: u32,
    pub top: TopKind,
    /// Mean leaves a probe key's prediction spans (`e - s + 1`).
    pub mean_leaves: f64,
    /// Probes whose prediction spans more than `max_leaves`.
    pub wide: u64,
    pub probes: u64,
    /// Sub-models at least one key routes to (an upper bound from the
    /// samples; every sampled key's sub-model counts).
    pub reachable_bound: u64,
}

/// Why [`size_submodels`] stopped where it did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SizeLimit {
    /// The sample of lookups met the target.
    Target,
    /// Doubling again would pass the client cache budget.
    CacheBudget,
    /// Doubling again would not fit the model region.
    ModelRegion,
    /// [`crate::layout::MAX_SUBMODELS`].
    MaxSubmodels,
}

impl SizeLimit {
    pub fn name(self) -> &'static str {
        match self {
            SizeLimit::Target => "target_leaves",
            SizeLimit::CacheBudget => "cache_budget_mb",
            SizeLimit::ModelRegion => "model_region",
            SizeLimit::MaxSubmodels => "max_submodels",
        }
    }
}

/// What sizing decided.
#[derive(Debug, Clone, PartialEq)]
pub struct Sizing {
    pub start: u32,
    pub chosen: u32,
    pub limit: SizeLimit,
    /// Every count tried, in order; the last is `chosen`.
    pub tried: Vec<Candidate>,
}

/// What [`size_submodels`] aims for and may spend.
#[derive(Debug, Clone, Copy)]
pub struct SizingGoal {
    pub slots: u32,
    pub target_leaves: f64,
    pub max_leaves: usize,
    /// Leaves of the partition (TT entries a full client cache holds).
    pub leaves: u64,
    /// Client cache bytes allowed: 80 (header) + 64 per sub-model + 8 per
    /// TT entry (one per leaf, plus one per sub-model for leaves that
    /// straddle two).
    pub cache_budget: u64,
    /// Bytes of the model region a generation may take (two must fit).
    pub region_budget: u64,
}

/// Model-region bytes one generation of `m` sub-models may take, at most
/// `reachable` of them with a TT, over `leaves` leaves: the record table
/// (one block, rounded to a power of two) and per reachable sub-model a TT
/// block (at least 128 bytes; entries plus a tag word per 7, doubled for
/// size-class rounding).
pub fn region_bytes_for(m: u64, reachable: u64, leaves: u64) -> u64 {
    let table = (m * 64).next_power_of_two();
    let entries = leaves + reachable;
    table + reachable * 128 + entries * 8 * 8 / 7 * 2
}

/// Chooses how many sub-models a full training gets (§7.7: skewed keys
/// need more simple sub-models for the same prediction error): starting at
/// `start`, the count doubles until a sample of lookups (every
/// `samples.len() / SIZING_PROBES`-th sampled key) predicts at most
/// `target_leaves` leaves on average and at most one probe in a thousand
/// spans more than `max_leaves` (or the last doubling did not reduce such
/// probes), or until doubling again would pass the
/// client cache budget or the model region. It never goes below `start`.
///
/// A candidate is judged by training, on the tree's current leaves
/// (`leaves_for(a, b)`: the leaves covering `[a, b]`), exactly the
/// sub-models the probes route to, with the same top model and intervals
/// a full training with that count would have; so its figures are those
/// lookups would see.
pub fn size_submodels<E>(
    samples: &[(u64, u64)],
    total: u64,
    lo: u64,
    hi: u64,
    start: u32,
    goal: &SizingGoal,
    mut leaves_for: impl FnMut(u64, u64) -> Result<Vec<CoveredLeaf>, E>,
) -> Result<Sizing, E> {
    let max = crate::layout::MAX_SUBMODELS;
    let mut m = start.clamp(1, max);
    let mut tried = Vec::new();
    loop {
        let ls = evaluate(
            TopKind::LeastSquares,
            samples,
            total,
            lo,
            hi,
            m,
            goal,
            &mut leaves_for,
        )?;
        let span = evaluate(
            TopKind::Span,
            samples,
            total,
            lo,
            hi,
            m,
            goal,
            &mut leaves_for,
        )?;
        // The better: fewer wide predictions, then fewer leaves.
        let c = if (span.wide, span.mean_leaves) < (ls.wide, ls.mean_leaves) {
            span
        } else {
            ls
        };
        // Wide predictions that doubling did not reduce (keys least
        // squares clamps into an end sub-model at any M) do not call for
        // more sub-models: they take the bounded fallback.
        let wide_settled =
            c.wide * 1000 <= c.probes || tried.last().is_some_and(|p: &Candidate| c.wide >= p.wide);
        tried.push(c);
        if c.mean_leaves <= goal.target_leaves && wide_settled {
            return Ok(Sizing {
                start,
                chosen: m,
                limit: SizeLimit::Target,
                tried,
            });
        }
        let next = m as u64 * 2;
        let limit = if next > max as u64 {
            Some(SizeLimit::MaxSubmodels)
        } else if 80 + next * 64 + (goal.leaves + next) * 8 > goal.cache_budget {
            Some(SizeLimit::CacheBudget)
        } else if region_bytes_for(next, (c.reachable_bound * 2).min(next), goal.leaves)
            > goal.region_budget
        {
            Some(SizeLimit::ModelRegion)
        } else {
            None
        };
        if let Some(limit) = limit {
            return Ok(Sizing {
                start,
                chosen: m,
                limit,
                tried,
            });
        }
        m = next as u32;
    }
}

/// Trains the sub-models of an `m`-sub-model generation that the probes
/// route to and measures their predictions for the probes.
#[allow(clippy::too_many_arguments)]
fn evaluate<E>(
    kind: TopKind,
    samples: &[(u64, u64)],
    total: u64,
    lo: u64,
    hi: u64,
    m: u32,
    goal: &SizingGoal,
    leaves_for: &mut impl FnMut(u64, u64) -> Result<Vec<CoveredLeaf>, E>,
) -> Result<Candidate, E> {
    let top = train_top_kind(kind, samples, total, lo, hi, m);
    let first = interval_starts(&top, lo, hi, m);
    let step = (samples.len() / SIZING_PROBES).max(1);
    let mut by_sub: BTreeMap<u32, Vec<u64>> = BTreeMap::new();
    for &(k, _) in samples.iter().step_by(step) {
        by_sub.entry(top_route(&top, lo, m, k)).or_default().push(k);
    }
    // Reachable sub-models: between two consecutive samples (`stride`
    // keys apart) the keys reach at most `stride` further sub-models.
    let stride = (total / samples.len().max(1) as u64).max(1);
    let mut reachable = if samples.is_empty() { 0 } else { 1u64 };
    for w in samples.windows(2) {
        let (a, b) = (
            top_route(&top, lo, m, w[0].0) as u64,
            top_route(&top, lo, m, w[1].0) as u64,
        );
        reachable += (b - a).min(stride);
    }
    let (mut sum, mut wide, mut probes) = (0u64, 0u64, 0u64);
    for (i, keys) in by_sub {
        let (a, b) = (first[i as usize] as u64, (first[i as usize + 1] - 1) as u64);
        let leaves = leaves_for(a, b)?;
        probes += keys.len() as u64;
        if leaves.len() > MAX_TT_LEN as usize {
            sum += leaves.len() as u64 * keys.len() as u64;
            wide += keys.len() as u64;
            continue;
        }
        let t = train_submodel(&leaves, a, b, goal.slots);
        for k in keys {
            let p = predict_position(t.slope, t.intercept, a, k);
            let (s, e) = leaf_range(p, t.min_err, t.max_err, goal.slots, leaves.len() as u32)
                .unwrap_or((0, 0));
            let width = (e - s + 1) as u64;
            sum += width;
            if width > goal.max_leaves as u64 {
                wide += 1;
            }
        }
    }
    Ok(Candidate {
        submodels: m,
        top: kind,
        mean_leaves: if probes == 0 {
            0.0
        } else {
            sum as f64 / probes as f64
        },
        wide,
        probes,
        reachable_bound: reachable.min(m as u64),
    })
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

    /// Sorted keys in leaves of 8, as `leaves_covering` would give them.
    fn covering(all: &[u64]) -> impl FnMut(u64, u64) -> Result<Vec<CoveredLeaf>, ()> {
        let groups: Vec<Vec<u64>> = all.chunks(8).map(|c| c.to_vec()).collect();
        let ls = leaves(&groups);
        move |a, b| {
            let from = ls.partition_point(|l| l.upper.is_some_and(|u| u <= a));
            let to = ls.partition_point(|l| l.lower <= b);
            Ok(ls[from..to.max(from)].to_vec())
        }
    }

    #[test]
    fn sizing_doubles_until_the_target_and_stops_at_the_budget() {
        // Skewed keys: 90% dense near 0, the rest spread over a range a
        // million times wider.
        let all: Vec<u64> = (0..18_000u64)
            .map(|i| i * 1000 + 1)
            .chain((0..2000u64).map(|j| 1_000_000_000_000 + j * 500_000_000_000_000))
            .collect();
        let samples: Vec<(u64, u64)> = all
            .iter()
            .enumerate()
            .map(|(r, &k)| (k, r as u64))
            .collect();
        let leaves = all.len().div_ceil(8) as u64;
        let goal = SizingGoal {
            slots: 16,
            target_leaves: 3.0,
            max_leaves: 16,
            leaves,
            cache_budget: 1 << 30,
            region_budget: 1 << 40,
        };
        let lo = 0;
        let hi = u64::MAX;
        let s = size_submodels(
            &samples,
            all.len() as u64,
            lo,
            hi,
            100,
            &goal,
            covering(&all),
        )
        .unwrap();
        assert_eq!(s.start, 100);
        assert_eq!(s.limit, SizeLimit::Target, "{s:?}");
        assert!(s.chosen > 100, "{s:?}");
        let last = s.tried.last().unwrap();
        assert_eq!(last.submodels, s.chosen);
        assert!(
            last.mean_leaves <= 3.0 && last.wide * 1000 <= last.probes,
            "{s:?}"
        );
        for w in s.tried.windows(2) {
            assert_eq!(w[1].submodels, 2 * w[0].submodels);
            assert!(w[0].mean_leaves > 3.0 || w[0].wide * 1000 > w[0].probes);
        }
        // The same with a budget that allows one doubling.
        let tight = SizingGoal {
            cache_budget: 80 + 200 * 64 + (leaves + 200) * 8,
            ..goal
        };
        let s = size_submodels(
            &samples,
            all.len() as u64,
            lo,
            hi,
            100,
            &tight,
            covering(&all),
        )
        .unwrap();
        assert_eq!((s.chosen, s.limit), (200, SizeLimit::CacheBudget), "{s:?}");
        // Uniform keys meet the target at the start.
        let flat: Vec<u64> = (0..20_000u64).map(|i| i * 1_000_003).collect();
        let fs: Vec<(u64, u64)> = flat
            .iter()
            .enumerate()
            .map(|(r, &k)| (k, r as u64))
            .collect();
        let s =
            size_submodels(&fs, flat.len() as u64, lo, hi, 100, &goal, covering(&flat)).unwrap();
        assert_eq!((s.chosen, s.tried.len()), (100, 1), "{s:?}");
    }

    #[test]
    fn the_span_line_clamps_no_tail() {
        // An S-shaped CDF: least squares routes both tails to the end
        // sub-models whatever M; the span line spreads them.
        let mut all: Vec<u64> = (0..4000u64)
            .map(|i| {
                let x = (i as f64 / 4000.0 - 0.5) * 12.0;
                ((x.powi(3) + 200.0) * 1e12) as u64
            })
            .collect();
        all.dedup();
        let samples: Vec<(u64, u64)> = all
            .iter()
            .enumerate()
            .map(|(r, &k)| (k, r as u64))
            .collect();
        let n = all.len() as u64;
        for m in [64u32, 1024] {
            let ls = train_top_kind(TopKind::LeastSquares, &samples, n, 0, u64::MAX, m);
            let span = train_top_kind(TopKind::Span, &samples, n, 0, u64::MAX, m);
            let in_last = |t: &TopModel| {
                all.iter()
                    .filter(|&&k| top_route(t, 0, m, k) == m - 1)
                    .count()
            };
            assert!(
                in_last(&ls) > all.len() / 20,
                "least squares clamps the upper tail"
            );
            assert!(in_last(&span) <= all.len() / 20 * 64 / m as usize + 1);
            assert_eq!(top_route(&span, 0, m, all[0]), 0);
            assert_eq!(top_route(&span, 0, m, *all.last().unwrap()), m - 1);
        }
    }
}
