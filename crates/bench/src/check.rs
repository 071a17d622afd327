//! Checking what an engine returns.
//!
//! Values are self-checking ([`dmkv_api::payload`]): a value must decode as
//! a value of the key it was read under, and its version must have been
//! handed out by the run ([`KeyStates`]). Existence is checked exactly
//! whenever it was stable during the operation (see [`crate::state`]).

use crate::plan::Plan;
use crate::state::{KeyStates, Stamp};
use dmkv_api::payload::check_value;

/// Kinds of wrong answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Problem {
    /// A value that is not a well-formed value of its key (another key's,
    /// torn, truncated, garbage).
    CorruptValue,
    /// A well-formed value whose version the run never wrote.
    FutureVersion,
    /// A key that existed throughout the operation was not found.
    Missing,
    /// A key that was absent throughout the operation was found.
    Unexpected,
    /// An insert, update or delete reported the wrong outcome (e.g. an insert
    /// of an absent key that said it exists).
    WrongResult,
    /// A scan result out of order, with duplicates, below its start key or
    /// longer than asked.
    BadScan,
    /// A scan returned a key the run never wrote.
    ForeignKey,
}

impl Problem {
    pub const COUNT: usize = 7;
    pub const ALL: [Problem; Problem::COUNT] = [
        Problem::CorruptValue,
        Problem::FutureVersion,
        Problem::Missing,
        Problem::Unexpected,
        Problem::WrongResult,
        Problem::BadScan,
        Problem::ForeignKey,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Problem::CorruptValue => "corrupt_value",
            Problem::FutureVersion => "future_version",
            Problem::Missing => "missing",
            Problem::Unexpected => "unexpected",
            Problem::WrongResult => "wrong_result",
            Problem::BadScan => "bad_scan",
            Problem::ForeignKey => "foreign_key",
        }
    }
}

/// How many sample messages a log keeps.
pub const MAX_SAMPLES: usize = 10;

/// Counts of problems found, with the first few described.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Findings {
    pub counts: [u64; Problem::COUNT],
    pub samples: Vec<String>,
}

impl Findings {
    pub fn push(&mut self, p: Problem, describe: impl FnOnce() -> String) {
        self.counts[p as usize] += 1;
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push(format!("{}: {}", p.name(), describe()));
        }
    }

    pub fn total(&self) -> u64 {
        self.counts.iter().sum()
    }

    pub fn count(&self, p: Problem) -> u64 {
        self.counts[p as usize]
    }

    pub fn merge(&mut self, o: &Findings) {
        for (a, b) in self.counts.iter_mut().zip(o.counts) {
            *a += b;
        }
        for s in &o.samples {
            if self.samples.len() < MAX_SAMPLES {
                self.samples.push(s.clone());
            }
        }
    }
}

/// Checks answers against the plan and the key states.
#[derive(Clone, Copy)]
pub struct Checker<'a> {
    pub plan: &'a Plan,
    pub states: &'a KeyStates,
}

impl Checker<'_> {
    /// Checks a value read for universe key `i`: its version, or the problem.
    pub fn value(&self, i: u32, value: &[u8]) -> Result<u32, (Problem, String)> {
        let key = self.plan.key(i);
        let version = check_value(key, value).map_err(|e| (Problem::CorruptValue, e))?;
        let max = self.states.max_version(i);
        if version == 0 || version > max {
            return Err((
                Problem::FutureVersion,
                format!(
                    "key {key}: value version {version}, but the run wrote versions 1..={max} of it"
                ),
            ));
        }
        Ok(version)
    }

    /// Checks a get of universe key `i` that began at `t0`.
    pub fn get(&self, op: &str, i: u32, t0: Stamp, got: Option<&[u8]>, f: &mut Findings) {
        let key = self.plan.key(i);
        let expected = self.states.stable_existence(i, t0);
        match got {
            Some(v) => {
                if let Err((p, m)) = self.value(i, v) {
                    f.push(p, || format!("{op}: {m}"));
                }
                if expected == Some(false) {
                    f.push(Problem::Unexpected, || {
                        format!(
                            "{op} of key {key} found a value, but the key was absent throughout"
                        )
                    });
                }
            }
            None => {
                if expected == Some(true) {
                    f.push(Problem::Missing, || {
                        format!(
                            "{op} of key {key} found nothing, but the key was present throughout"
                        )
                    });
                }
            }
        }
    }

    /// Checks the boolean outcome of a write: `expected` is what it must be
    /// when certain.
    pub fn outcome(&self, op: &str, i: u32, expected: Option<bool>, got: bool, f: &mut Findings) {
        if expected.is_some_and(|e| e != got) {
            let key = self.plan.key(i);
            f.push(Problem::WrongResult, || {
                format!("{op} of key {key} returned {got}, expected {}", !got)
            });
        }
    }

    /// Checks a scan of up to `n` pairs from `start` that began at `t0`.
    ///
    /// The pairs are checked where they are, in one walk beside the plan's
    /// keys from `start` (ascending): while the pairs ascend, a pair's key is
    /// found by stepping a cursor over the plan's keys (no binary search per
    /// pair), and the plan keys stepped over are exactly the keys the scan
    /// skipped, which is what the completeness check asks about. Verdicts,
    /// counts and sample messages (and their order) are those of checking
    /// each pair by lookup and then walking the range again (the reference
    /// in this module's tests, `scan_reference`).
    pub fn scan(
        &self,
        start: u64,
        n: usize,
        t0: Stamp,
        items: &[(u64, Vec<u8>)],
        f: &mut Findings,
    ) {
        if items.len() > n {
            f.push(Problem::BadScan, || {
                format!("scan({start}, {n}) returned {} pairs", items.len())
            });
        }
        // The plan's keys ≥ start; `pos` is the first not yet passed.
        let from = self.plan.keys_from(start);
        let mut pos = 0usize;
        // The first key of the range that no pair returned and that was
        // present throughout (one report per scan is enough, and keeps a
        // broken engine from making this quadratic).
        let mut skipped: Option<u64> = None;
        let mut ordered = true;
        let mut prev: Option<u64> = None;
        for (k, v) in items {
            let k = *k;
            if k < start {
                ordered = false;
                f.push(Problem::BadScan, || {
                    format!("scan({start}, {n}) returned key {k}, below its start")
                });
            }
            if prev.is_some_and(|p| k <= p) {
                ordered = false;
                f.push(Problem::BadScan, || {
                    format!(
                        "scan({start}, {n}) returned key {k} after key {}: out of order or duplicated",
                        prev.unwrap_or_default()
                    )
                });
            }
            prev = Some(k);
            let index = if ordered {
                // Every pair so far ascends from `start`: the plan keys below
                // `k` not yet passed lie between two returned keys (or before
                // the first), so the scan skipped them.
                while let Some(&(pk, pi)) = from.get(pos) {
                    if pk >= k {
                        break;
                    }
                    if skipped.is_none() && self.states.stable_existence(pi, t0) == Some(true) {
                        skipped = Some(pk);
                    }
                    pos += 1;
                }
                match from.get(pos) {
                    Some(&(pk, pi)) if pk == k => {
                        pos += 1;
                        Some(pi)
                    }
                    _ => None,
                }
            } else {
                self.plan.index_of(k)
            };
            match index {
                None => f.push(Problem::ForeignKey, || {
                    format!("scan({start}, {n}) returned key {k}, which the run never wrote")
                }),
                Some(i) => {
                    if let Err((p, m)) = self.value(i, v) {
                        f.push(p, || format!("scan({start}, {n}): {m}"));
                    }
                    if self.states.stable_existence(i, t0) == Some(false) {
                        f.push(Problem::Unexpected, || {
                            format!("scan({start}, {n}) returned key {k}, absent throughout")
                        });
                    }
                }
            }
        }
        if !ordered || n == 0 {
            return;
        }
        // Completeness: a full result covers [start, its last key] (walked
        // above); a short one covers every key ≥ start, so the plan's keys
        // after its last pair are skipped too.
        if skipped.is_none() && items.len() < n {
            skipped = from[pos..]
                .iter()
                .find(|&&(_, i)| self.states.stable_existence(i, t0) == Some(true))
                .map(|&(k, _)| k);
        }
        if let Some(k) = skipped {
            f.push(Problem::Missing, || {
                format!(
                    "scan({start}, {n}) returned {} pairs and skipped key {k}, present throughout",
                    items.len()
                )
            });
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::trace::{Trace, TraceOp, TraceOpKind};
    use dmkv_api::payload::make_value;

    /// Keys 10, 20, 30, 40, 50 loaded; 35 inserted later (absent now).
    fn plan() -> Plan {
        let mut ops: Vec<TraceOp> = [10, 20, 30, 40, 50]
            .map(|key| TraceOp {
                kind: TraceOpKind::Read,
                key,
            })
            .to_vec();
        ops.push(TraceOp {
            kind: TraceOpKind::Insert,
            key: 35,
        });
        Plan::from_trace(
            &Trace {
                ops,
                lines: 6,
                ignored_lines: 0,
            },
            1,
            1,
            &[],
        )
        .unwrap()
    }

    /// The scan check before branch i56 (each pair's index by binary
    /// search, then the range walked again for completeness), kept as the
    /// reference the in-place walk must agree with.
    fn scan_reference(
        c: &Checker<'_>,
        start: u64,
        n: usize,
        t0: Stamp,
        items: &[(u64, Vec<u8>)],
        f: &mut Findings,
    ) {
        if items.len() > n {
            f.push(Problem::BadScan, || {
                format!("scan({start}, {n}) returned {} pairs", items.len())
            });
        }
        let mut ordered = true;
        let mut prev: Option<u64> = None;
        for (k, v) in items {
            let k = *k;
            if k < start {
                ordered = false;
                f.push(Problem::BadScan, || {
                    format!("scan({start}, {n}) returned key {k}, below its start")
                });
            }
            if prev.is_some_and(|p| k <= p) {
                ordered = false;
                f.push(Problem::BadScan, || {
                    format!(
                        "scan({start}, {n}) returned key {k} after key {}: out of order or duplicated",
                        prev.unwrap_or_default()
                    )
                });
            }
            prev = Some(k);
            match c.plan.index_of(k) {
                None => f.push(Problem::ForeignKey, || {
                    format!("scan({start}, {n}) returned key {k}, which the run never wrote")
                }),
                Some(i) => {
                    if let Err((p, m)) = c.value(i, v) {
                        f.push(p, || format!("scan({start}, {n}): {m}"));
                    }
                    if c.states.stable_existence(i, t0) == Some(false) {
                        f.push(Problem::Unexpected, || {
                            format!("scan({start}, {n}) returned key {k}, absent throughout")
                        });
                    }
                }
            }
        }
        if !ordered || n == 0 {
            return;
        }
        // Completeness: a full result covers [start, its last key]; a short
        // one covers every key ≥ start. Every key present throughout the
        // scan in that range must be in it. One report per scan is enough
        // (and keeps a broken engine from making this quadratic).
        let covered_to = if items.len() >= n {
            items.last().map(|&(k, _)| k)
        } else {
            None
        };
        let mut returned = items.iter().map(|&(k, _)| k).peekable();
        for &(k, i) in c.plan.keys_from(start) {
            if covered_to.is_some_and(|hi| k > hi) {
                break;
            }
            while returned.next_if(|&r| r < k).is_some() {}
            let found = returned.peek() == Some(&k);
            if !found && c.states.stable_existence(i, t0) == Some(true) {
                f.push(Problem::Missing, || {
                    format!(
                        "scan({start}, {n}) returned {} pairs and skipped key {k}, present throughout",
                        items.len()
                    )
                });
                break;
            }
        }
    }

    fn pairs(keys: &[u64]) -> Vec<(u64, Vec<u8>)> {
        keys.iter().map(|&k| (k, make_value(k, 1, 8))).collect()
    }

    fn scan(start: u64, n: usize, keys: &[u64]) -> Findings {
        let plan = plan();
        let states = KeyStates::new(plan.keys().len(), plan.loaded());
        let c = Checker {
            plan: &plan,
            states: &states,
        };
        let mut f = Findings::default();
        c.scan(start, n, states.stamp(), &pairs(keys), &mut f);
        f
    }

    #[test]
    fn correct_scans_pass() {
        assert_eq!(scan(0, 10, &[10, 20, 30, 40, 50]).total(), 0);
        assert_eq!(scan(15, 2, &[20, 30]).total(), 0);
        assert_eq!(scan(31, 1, &[40]).total(), 0);
        assert_eq!(scan(51, 5, &[]).total(), 0);
        assert_eq!(scan(0, 0, &[]).total(), 0);
    }

    #[test]
    fn wrong_scans_are_caught() {
        let cases: [(u64, usize, &[u64], Problem); 8] = [
            (0, 10, &[10, 30, 40, 50], Problem::Missing),
            (0, 3, &[10, 20, 40], Problem::Missing),
            (0, 10, &[10, 20, 30, 40], Problem::Missing),
            (0, 2, &[10, 20, 30], Problem::BadScan),
            (0, 10, &[20, 10, 30, 40, 50], Problem::BadScan),
            (0, 10, &[10, 10, 20, 30, 40, 50], Problem::BadScan),
            (25, 10, &[20, 30, 40, 50], Problem::BadScan),
            (0, 10, &[10, 20, 30, 35, 40, 50], Problem::Unexpected),
        ];
        for (start, n, keys, problem) in cases {
            let f = scan(start, n, keys);
            assert!(f.count(problem) > 0, "scan({start}, {n}) = {keys:?}: {f:?}");
        }
        assert_eq!(
            scan(0, 10, &[7, 10, 20, 30, 40, 50]).count(Problem::ForeignKey),
            1
        );
    }

    /// The in-place scan check gives the reference's findings (counts,
    /// samples and their order) on thousands of scan results, right and
    /// wrong: skipped keys, foreign keys, keys below the start, disorder,
    /// duplicates, wrong values, too many pairs, short and empty results,
    /// over keys present, absent and being changed.
    #[test]
    fn the_in_place_scan_check_agrees_with_the_reference() {
        // Loaded keys 10, 20, .., 600; keys 15, 35, .. inserted later.
        let mut ops: Vec<TraceOp> = (1..=60u64)
            .map(|k| TraceOp {
                kind: TraceOpKind::Read,
                key: k * 10,
            })
            .collect();
        ops.extend((0..30u64).map(|k| TraceOp {
            kind: TraceOpKind::Insert,
            key: k * 20 + 15,
        }));
        let lines = ops.len() as u64;
        let plan = Plan::from_trace(
            &Trace {
                ops,
                lines,
                ignored_lines: 0,
            },
            1,
            1,
            &[],
        )
        .unwrap();
        let states = KeyStates::new(plan.keys().len(), plan.loaded());
        let idx = |k: u64| plan.index_of(k).unwrap();
        // Some inserted keys now exist, some loaded ones were deleted.
        for k in [15u64, 55, 95, 135] {
            states.begin_change(idx(k));
            states.end_change(idx(k), Some(true));
        }
        for k in [30u64, 70, 200] {
            states.begin_change(idx(k));
            states.end_change(idx(k), Some(false));
        }
        let c = Checker {
            plan: &plan,
            states: &states,
        };
        let t0 = states.stamp();
        // Keys changing or changed during the scan (existence unknown).
        for k in [40u64, 175, 330] {
            states.begin_change(idx(k));
        }
        states.end_change(idx(175), Some(true));
        let mut x = 0x9E37_79B9_7F4A_7C15u64;
        let mut rnd = |m: u64| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x % m
        };
        let universe: Vec<u64> = plan.keys().to_vec();
        let mut differing_verdicts = 0;
        for case in 0..4000 {
            let start = rnd(640);
            let n = rnd(12) as usize;
            let mut keys: Vec<u64> = universe.iter().copied().filter(|&k| k >= start).collect();
            keys.sort_unstable();
            let mut items: Vec<(u64, Vec<u8>)> = Vec::new();
            for &k in &keys {
                if items.len() >= n + rnd(2) as usize {
                    break;
                }
                match rnd(40) {
                    0 => continue,                                     // skipped
                    1 => items.push((k + 1, make_value(k + 1, 1, 8))), // foreign
                    2 => items.push((k, make_value(k + 10, 1, 8))),    // wrong value
                    3 => items.push((k, make_value(k, 9, 8))),         // future version
                    4 => {
                        items.push((k, make_value(k, 1, 8)));
                        items.push((k, make_value(k, 1, 8))); // duplicated
                    }
                    5 if start > 0 => items.push((start - 1, make_value(start - 1, 1, 8))),
                    6 => {
                        if let Some(p) = items.pop() {
                            items.push((k, make_value(k, 1, 8)));
                            items.push(p); // out of order
                        }
                    }
                    _ => items.push((k, make_value(k, 1, 8))),
                }
            }
            if rnd(8) == 0 {
                items.truncate(rnd(items.len() as u64 + 1) as usize);
            }
            let mut got = Findings::default();
            c.scan(start, n, t0, &items, &mut got);
            let mut want = Findings::default();
            scan_reference(&c, start, n, t0, &items, &mut want);
            assert_eq!(got, want, "case {case}: scan({start}, {n}) = {items:?}");
            differing_verdicts += usize::from(want.total() > 0);
        }
        // The cases exercise both verdicts.
        assert!(differing_verdicts > 500, "{differing_verdicts} wrong scans");
    }

    #[test]
    fn values_must_be_the_keys_and_from_the_run() {
        let plan = plan();
        let states = KeyStates::new(plan.keys().len(), plan.loaded());
        let c = Checker {
            plan: &plan,
            states: &states,
        };
        let i = plan.index_of(20).unwrap();
        assert_eq!(c.value(i, &make_value(20, 1, 8)), Ok(1));
        assert_eq!(
            c.value(i, &make_value(30, 1, 8)).unwrap_err().0,
            Problem::CorruptValue
        );
        assert_eq!(
            c.value(i, &make_value(20, 2, 8)).unwrap_err().0,
            Problem::FutureVersion
        );
        assert_eq!(states.next_version(i), 2);
        assert_eq!(c.value(i, &make_value(20, 2, 8)), Ok(2));
        let mut f = Findings::default();
        let absent = plan.index_of(35).unwrap();
        c.get(
            "get",
            absent,
            states.stamp(),
            Some(&make_value(35, 0, 8)),
            &mut f,
        );
        assert_eq!(f.count(Problem::Unexpected), 1);
        assert_eq!(f.count(Problem::FutureVersion), 1);
        c.get("get", i, states.stamp(), None, &mut f);
        assert_eq!(f.count(Problem::Missing), 1);
        c.outcome("update", i, Some(true), false, &mut f);
        c.outcome("update", i, None, false, &mut f);
        assert_eq!(f.count(Problem::WrongResult), 1);
        assert_eq!(f.total(), 4);
        assert_eq!(f.samples.len(), 4);
    }
}
