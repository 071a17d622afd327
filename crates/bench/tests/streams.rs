//! Request distributions and streams: skew, spread, recency, and
//! determinism per (seed, thread, task).

use dmkv_bench::dist::{Latest, ScrambledZipfian, ZIPFIAN_THETA, Zipfian, zeta};
use dmkv_bench::plan::{Plan, SyntheticParams};
use dmkv_bench::rng::Rng;
use dmkv_bench::workload::{Op, OpType};
use dmkv_bench::{Dist, KeysetSpec, Workload};
use std::collections::{HashMap, HashSet};

fn counts(n: u64, draws: usize, mut draw: impl FnMut(&mut Rng) -> u64) -> Vec<u64> {
    let mut rng = Rng::new(99);
    let mut c = vec![0u64; n as usize];
    for _ in 0..draws {
        let x = draw(&mut rng);
        assert!(x < n, "{x} out of [0, {n})");
        c[x as usize] += 1;
    }
    c
}

#[test]
fn zipfian_follows_its_law() {
    let n = 1_000;
    let draws = 200_000;
    let mut z = Zipfian::new(n);
    let c = counts(n, draws, |r| z.next(r));
    let zn = zeta(n, ZIPFIAN_THETA);
    let p = |rank: usize| 1.0 / ((rank + 1) as f64).powf(ZIPFIAN_THETA) / zn;
    // Ranks 0 and 1 are drawn exactly by Gray et al.'s method (YCSB's)...
    for rank in [0, 1] {
        let got = c[rank] as f64 / draws as f64;
        assert!(
            (got - p(rank)).abs() <= 0.03 * p(rank),
            "rank {rank}: frequency {got:.4}, expected {:.4}",
            p(rank)
        );
    }
    // ...later ranks by its approximation (which overweights rank 2 by
    // about a fifth), so the cumulative mass follows the law closely.
    for upto in [10, 100, 500] {
        let got = c[..upto].iter().sum::<u64>() as f64 / draws as f64;
        let want: f64 = (0..upto).map(p).sum();
        assert!(
            (got - want).abs() < 0.03,
            "ranks below {upto}: {got:.4} vs {want:.4}"
        );
    }
    // Heavily skewed: the top 1% of ranks get far more than 1% of draws.
    let top: u64 = c[..10].iter().sum();
    assert!(top as f64 / draws as f64 > 0.35, "{top}");
    assert!(c[0] > c[1] && c[1] > c[9] && c[9] > c[999]);
}

#[test]
fn zipfian_grows_incrementally() {
    let mut grown = Zipfian::new(100);
    grown.grow_to(5_000);
    let mut fresh = Zipfian::new(5_000);
    let (mut a, mut b) = (Rng::new(5), Rng::new(5));
    for _ in 0..1_000 {
        assert_eq!(grown.next(&mut a), fresh.next(&mut b));
    }
}

#[test]
fn scrambled_zipfian_spreads_hot_items() {
    let n = 10_000;
    let draws = 200_000;
    let mut z = ScrambledZipfian::new(n);
    let c = counts(n, draws, |r| z.next(r));
    let mut by_heat: Vec<(u64, usize)> = c.iter().enumerate().map(|(i, &k)| (k, i)).collect();
    by_heat.sort_unstable_by(|a, b| b.cmp(a));
    // Still skewed like a zipfian...
    let hottest = by_heat[0].0 as f64 / draws as f64;
    assert!(hottest > 0.05, "hottest item has {hottest}");
    // ...but the 20 hottest items are spread over the key space rather than
    // being the first 20.
    let hot: Vec<usize> = by_heat[..20].iter().map(|&(_, i)| i).collect();
    let in_first_tenth = hot.iter().filter(|&&i| i < n as usize / 10).count();
    assert!(in_first_tenth < 8, "{hot:?}");
    let span = hot.iter().max().unwrap() - hot.iter().min().unwrap();
    assert!(span > n as usize / 2, "{hot:?}");
}

#[test]
fn latest_prefers_the_newest_items_as_they_grow() {
    let mut l = Latest::with_zeta(1_000, zeta(1_000, ZIPFIAN_THETA));
    let mut rng = Rng::new(1);
    let newest = (0..10_000)
        .filter(|_| l.next(1_000, &mut rng) == 999)
        .count();
    // The newest item is rank 0 of a zipfian over 1000: about 13%.
    assert!((1_000..1_700).contains(&newest), "{newest}");
    // After 500 more items, the newest is 1499 and old ones fade.
    let draws: Vec<u64> = (0..10_000).map(|_| l.next(1_500, &mut rng)).collect();
    assert!(draws.iter().all(|&d| d < 1_500));
    let newest = draws.iter().filter(|&&d| d == 1_499).count();
    let old = draws.iter().filter(|&&d| d == 999).count();
    assert!(
        newest > 1_000 && old < 50,
        "newest {newest}, 999 drawn {old} times"
    );
}

fn params(workload: Workload, dist: Dist, seed: u64) -> SyntheticParams {
    SyntheticParams {
        workload,
        dist,
        keyset: KeysetSpec::Uniform,
        keys: 1_000,
        ops: 5_000,
        warmup_ops: 0,
        threads: 2,
        tasks: 3,
        seed,
        partition: None,
    }
}

fn streams(plan: &Plan) -> Vec<Vec<Op>> {
    (0..plan.threads())
        .flat_map(|t| (0..plan.tasks()).map(move |c| (t, c)))
        .map(|(t, c)| plan.stream(t, c).collect())
        .collect()
}

#[test]
fn the_same_seed_gives_the_same_keys_and_streams() {
    for dist in [Dist::Uniform, Dist::Zipfian, Dist::Latest] {
        let w: Workload = "mixed:40,20,20,10,10".parse().unwrap();
        let a = Plan::synthetic(&params(w, dist, 7), &[]).unwrap();
        let b = Plan::synthetic(&params(w, dist, 7), &[]).unwrap();
        let c = Plan::synthetic(&params(w, dist, 8), &[]).unwrap();
        assert_eq!(a.keys(), b.keys());
        assert_eq!(streams(&a), streams(&b), "{dist}");
        // Streaming a task twice from one plan gives the same operations.
        assert_eq!(
            a.stream(1, 2).collect::<Vec<_>>(),
            a.stream(1, 2).collect::<Vec<_>>()
        );
        assert_ne!(a.keys(), c.keys());
        assert_ne!(streams(&a), streams(&c));
        let s = streams(&a);
        assert_ne!(s[0], s[1], "tasks have their own streams");
        assert_eq!(s.iter().map(Vec::len).sum::<usize>(), 5_000);
    }
}

#[test]
fn streams_follow_the_mix_and_the_ownership_rules() {
    let w: Workload = "mixed:40,20,20,10,10".parse().unwrap();
    let plan = Plan::synthetic(&params(w, Dist::Zipfian, 3), &[]).unwrap();
    let total_tasks = 6;
    let loaded = plan.loaded();
    assert_eq!(loaded, 1_000);
    let keys: HashSet<u64> = plan.keys().iter().copied().collect();
    assert_eq!(keys.len(), plan.keys().len(), "keys are distinct");
    let mut kinds: HashMap<OpType, usize> = HashMap::new();
    let mut inserted = HashSet::new();
    for (g, s) in streams(&plan).iter().enumerate() {
        let mut own_inserts = HashSet::new();
        for op in s {
            *kinds.entry(op.op_type()).or_default() += 1;
            match *op {
                Op::Insert(i) => {
                    assert!(i as usize >= loaded, "inserts add keys not loaded");
                    assert!(inserted.insert(i), "each key is inserted once");
                    own_inserts.insert(i);
                }
                Op::Delete(i) => {
                    let owned = if (i as usize) < loaded {
                        i as usize % total_tasks == g
                    } else {
                        own_inserts.contains(&i)
                    };
                    assert!(owned, "task {g} deletes key {i} it does not own");
                }
                Op::Scan(_, n) => assert!((1..=100).contains(&n)),
                Op::Read(i) | Op::Update(i) => {
                    assert!((i as usize) < loaded || own_inserts.contains(&i))
                }
                Op::Rmw(_) => panic!("no rmw in a mix"),
            }
        }
    }
    assert_eq!(inserted.len(), plan.keys().len() - loaded);
    // 5000 draws: each share within a few points of its percentage.
    for (t, pct) in [
        (OpType::Read, 40.0),
        (OpType::Update, 20.0),
        (OpType::Insert, 20.0),
        (OpType::Delete, 10.0),
        (OpType::Scan, 10.0),
    ] {
        let share = kinds[&t] as f64 / 50.0;
        assert!(
            (share - pct).abs() < 3.0,
            "{t:?}: {share}% instead of {pct}%"
        );
    }
}

#[test]
fn ycsb_d_reads_mostly_what_its_task_just_inserted() {
    let plan = Plan::synthetic(&params(Workload::YcsbD, Dist::Latest, 1), &[]).unwrap();
    let s: Vec<Op> = plan.stream(0, 0).collect();
    let mut inserted: Vec<u32> = Vec::new();
    let mut recent = 0;
    let mut reads = 0;
    for op in &s {
        match *op {
            Op::Insert(i) => inserted.push(i),
            Op::Read(i) if !inserted.is_empty() => {
                reads += 1;
                if inserted[inserted.len().saturating_sub(10)..].contains(&i) {
                    recent += 1;
                }
            }
            _ => {}
        }
    }
    assert!(reads > 500, "{reads}");
    assert!(
        recent * 3 > reads,
        "only {recent} of {reads} reads hit the 10 newest keys"
    );
    // Before a task's first insert, the newest key is the last loaded one:
    // reads then cluster at the end of the load order.
    let early: Vec<u32> = streams(&plan)
        .iter()
        .flat_map(|s| {
            s.iter()
                .take_while(|op| !matches!(op, Op::Insert(_)))
                .filter_map(|op| match *op {
                    Op::Read(i) => Some(i),
                    _ => None,
                })
                .collect::<Vec<_>>()
        })
        .collect();
    assert!(early.len() > 20, "{}", early.len());
    let near_end = early.iter().filter(|&&i| i >= 900).count();
    assert!(
        near_end * 2 > early.len(),
        "{near_end} of {} near the end",
        early.len()
    );
}

#[test]
fn insert_workload_inserts_every_op_once() {
    let plan = Plan::synthetic(&params(Workload::Insert, Dist::Uniform, 1), &[]).unwrap();
    assert_eq!(plan.keys().len(), 6_000);
    let ops: Vec<Op> = streams(&plan).concat();
    assert_eq!(ops.len(), 5_000);
    let distinct: HashSet<u32> = ops
        .iter()
        .map(|op| match op {
            Op::Insert(i) => *i,
            other => panic!("{other:?} in an insert workload"),
        })
        .collect();
    assert_eq!(distinct.len(), 5_000);
    let load = Plan::synthetic(&params(Workload::Load, Dist::Uniform, 1), &[]).unwrap();
    assert_eq!(load.total_ops(), 0);
    assert_eq!(load.keys().len(), 1_000);
}

#[test]
fn plans_refuse_workloads_they_cannot_generate() {
    let mut p = params(Workload::YcsbC, Dist::Uniform, 1);
    p.keys = 0;
    assert!(Plan::synthetic(&p, &[]).is_err(), "reads need keys");
    let mut p = params("mixed:50,0,0,50,0".parse().unwrap(), Dist::Uniform, 1);
    p.keys = 5;
    let e = Plan::synthetic(&p, &[]).unwrap_err().to_string();
    assert!(e.contains("threads x tasks = 6"), "{e}");
    let mut p = params(Workload::Insert, Dist::Uniform, 1);
    p.keys = 0;
    assert!(
        Plan::synthetic(&p, &[]).is_ok(),
        "inserting into nothing is fine"
    );
}

/// `--warmup-ops`: each task's stream is its warm-up followed by its run,
/// the warm-up split like the run; the measured count is `--ops` whatever
/// the warm-up, and the warm-up's inserts take the task's first insert keys
/// (the run's inserts follow, so no key is inserted twice).
#[test]
fn a_warmup_is_the_front_of_each_stream() {
    let mut p = params(Workload::YcsbD, Dist::Latest, 11);
    p.warmup_ops = 1_001;
    let plan = Plan::synthetic(&p, &[]).unwrap();
    assert_eq!(plan.total_ops(), 5_000);
    assert_eq!(plan.warmup_ops(), 1_001);
    let all = streams(&plan);
    let mut warm_total = 0;
    for (g, s) in all.iter().enumerate() {
        let (t, c) = (g / plan.tasks(), g % plan.tasks());
        let warm = plan.warmup_of(t, c);
        // 1,001 over 6 tasks: 167 for the first five, 166 for the last.
        assert_eq!(warm, if g < 5 { 167 } else { 166 });
        warm_total += warm;
        // 5,000 over 6: 834 for the first two, 833 for the rest.
        assert_eq!(s.len() as u64 - warm, if g < 2 { 834 } else { 833 });
    }
    assert_eq!(warm_total, 1_001);
    let mut inserted = std::collections::HashSet::new();
    let mut inserts = 0;
    for op in all.iter().flatten() {
        if let Op::Insert(i) = op {
            inserts += 1;
            assert!(inserted.insert(*i), "key index {i} inserted twice");
            assert!(*i as usize >= plan.loaded());
        }
    }
    assert!(inserts > 100, "{inserts} inserts: ycsb-d inserts 5%");
    assert_eq!(plan.keys().len(), plan.loaded() + inserts);
    // A workload without a run phase has nothing to warm up for.
    let mut load = params(Workload::Load, Dist::Uniform, 11);
    load.warmup_ops = 10;
    let e = Plan::synthetic(&load, &[]).unwrap_err().to_string();
    assert!(e.contains("no run phase"), "{e}");
}
