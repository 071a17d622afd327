//! Oracle tests: an engine must behave exactly like a `BTreeMap`.

use dmkv_api::deploy::LocalDeployment;
use dmkv_api::{Capabilities, Key, KvStore};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use proptest::prelude::*;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeMap;

/// What a store should hold.
pub type Model = BTreeMap<Key, Vec<u8>>;

/// One client operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    Get(Key),
    Insert(Key, Vec<u8>),
    Update(Key, Vec<u8>),
    Upsert(Key, Vec<u8>),
    Delete(Key),
    Scan(Key, usize),
}

/// Spreads small indices over the key space, keeping their order, so that
/// learned models see a non-trivial distribution and trees see many leaves.
pub fn spread_key(i: u64) -> Key {
    1 + i * 0x9E37_79B9
}

/// A `bounds` knob (range partitioning, `dmkv_api::RangePartitions`) that
/// cuts `spread_key(0..key_space)` into `ranges` equal ranges, so that an
/// oracle run's operations cross ranges.
pub fn range_bounds(key_space: u64, ranges: u64) -> String {
    (1..ranges)
        .map(|r| spread_key(r * key_space / ranges).to_string())
        .collect::<Vec<_>>()
        .join(",")
}

fn value_strategy(max_len: usize) -> BoxedStrategy<Vec<u8>> {
    let lens = prop_oneof![
        6 => Just(8usize),
        1 => Just(0usize),
        1 => 1usize..=16,
        1 => Just(max_len.min(100)),
        1 => Just(max_len),
    ];
    lens.prop_flat_map(|n| prop::collection::vec(any::<u8>(), n))
        .boxed()
}

/// Random operations on `key_space` keys with values up to `max_value_len`
/// bytes; scans only if `scans`.
pub fn op_strategy(key_space: u64, max_value_len: usize, scans: bool) -> BoxedStrategy<Op> {
    let key = (0..key_space).prop_map(spread_key);
    // Starts between keys too, so scans begin at absent keys.
    let start = (0..key_space * 0x9E37_79B9 + 2).prop_map(|s| s);
    let v = value_strategy(max_value_len);
    let mut ops: Vec<(u32, BoxedStrategy<Op>)> = vec![
        (3, key.clone().prop_map(Op::Get).boxed()),
        (
            4,
            (key.clone(), v.clone())
                .prop_map(|(k, v)| Op::Insert(k, v))
                .boxed(),
        ),
        (
            2,
            (key.clone(), v.clone())
                .prop_map(|(k, v)| Op::Update(k, v))
                .boxed(),
        ),
        (
            2,
            (key.clone(), v).prop_map(|(k, v)| Op::Upsert(k, v)).boxed(),
        ),
        (2, key.prop_map(Op::Delete).boxed()),
    ];
    if scans {
        ops.push((
            1,
            (start, 0usize..40)
                .prop_map(|(s, n)| Op::Scan(s, n))
                .boxed(),
        ));
    }
    prop::strategy::Union::new_weighted(ops).boxed()
}

/// Applies `op` to the store and the model and compares the results.
pub async fn apply(
    store: &dyn KvStore,
    model: &mut BTreeMap<Key, Vec<u8>>,
    caps: &Capabilities,
    op: &Op,
) -> Result<(), String> {
    let fail = |got: String, want: String| Err(format!("{op:?}: got {got}, want {want}"));
    match op {
        Op::Get(k) => {
            let got = store.get(*k).await.map_err(|e| format!("{op:?}: {e}"))?;
            let want = model.get(k).cloned();
            if got != want {
                return fail(format!("{got:?}"), format!("{want:?}"));
            }
        }
        Op::Insert(k, v) => {
            let got = store
                .insert(*k, v)
                .await
                .map_err(|e| format!("{op:?}: {e}"))?;
            let want = !model.contains_key(k);
            if want {
                model.insert(*k, v.clone());
            }
            if got != want {
                return fail(got.to_string(), want.to_string());
            }
        }
        Op::Update(k, v) => {
            let got = store
                .update(*k, v)
                .await
                .map_err(|e| format!("{op:?}: {e}"))?;
            let want = model.contains_key(k);
            if want {
                model.insert(*k, v.clone());
            }
            if got != want {
                return fail(got.to_string(), want.to_string());
            }
        }
        Op::Upsert(k, v) => {
            let got = store
                .upsert(*k, v)
                .await
                .map_err(|e| format!("{op:?}: {e}"))?;
            let want = model.insert(*k, v.clone()).is_none();
            if got != want {
                return fail(got.to_string(), want.to_string());
            }
        }
        Op::Delete(k) => {
            let got = store.delete(*k).await.map_err(|e| format!("{op:?}: {e}"))?;
            let want = model.remove(k).is_some();
            if got != want {
                return fail(got.to_string(), want.to_string());
            }
        }
        Op::Scan(s, n) => {
            if !caps.scan {
                return Ok(());
            }
            let got = store
                .scan(*s, *n)
                .await
                .map_err(|e| format!("{op:?}: {e}"))?;
            let want: Vec<(Key, Vec<u8>)> = model
                .range(*s..)
                .take(*n)
                .map(|(k, v)| (*k, v.clone()))
                .collect();
            if got != want {
                let keys = |v: &[(Key, Vec<u8>)]| v.iter().map(|p| p.0).collect::<Vec<_>>();
                return fail(
                    format!("keys {:?}", keys(&got)),
                    format!("keys {:?}", keys(&want)),
                );
            }
        }
    }
    Ok(())
}

/// Reads back every key of the model, a few absent keys, and (if the engine
/// scans) the whole store in order.
pub async fn check_contents(
    store: &dyn KvStore,
    model: &BTreeMap<Key, Vec<u8>>,
    caps: &Capabilities,
) -> Result<(), String> {
    for (k, v) in model {
        let got = store.get(*k).await.map_err(|e| format!("get {k}: {e}"))?;
        if got.as_ref() != Some(v) {
            return Err(format!("final get {k:#x}: got {got:?}, want {v:?}"));
        }
        if !model.contains_key(&(k + 1)) && !caps.reserved_keys.contains(&(k + 1)) {
            let absent = store
                .get(k + 1)
                .await
                .map_err(|e| format!("get {}: {e}", k + 1))?;
            if absent.is_some() {
                return Err(format!("final get {:#x}: found a key never stored", k + 1));
            }
        }
    }
    if caps.scan {
        let all = store
            .scan(0, model.len() + 10)
            .await
            .map_err(|e| format!("full scan: {e}"))?;
        let want: Vec<(Key, Vec<u8>)> = model.iter().map(|(k, v)| (*k, v.clone())).collect();
        if all != want {
            return Err(format!(
                "full scan returned {} pairs, want {}",
                all.len(),
                want.len()
            ));
        }
    }
    Ok(())
}

/// Runs `ops` on a fresh client of `d`, comparing with a model, then checks
/// the final contents.
pub fn check_single(d: &LocalDeployment, ops: &[Op]) -> Result<(), String> {
    let (_ep, store) = d.client(0).map_err(|e| e.to_string())?;
    let caps = d.engine.capabilities();
    block_on(async {
        let mut model = BTreeMap::new();
        for op in ops {
            if op_key(op).is_some_and(|k| caps.reserved_keys.contains(&k)) {
                continue;
            }
            apply(&*store, &mut model, &caps, op).await?;
        }
        check_contents(&*store, &model, &caps).await
    })
}

fn op_key(op: &Op) -> Option<Key> {
    match op {
        Op::Get(k) | Op::Insert(k, _) | Op::Update(k, _) | Op::Upsert(k, _) | Op::Delete(k) => {
            Some(*k)
        }
        Op::Scan(..) => None,
    }
}

/// Several clients on `threads` threads x `tasks` tasks each apply random
/// operations to keys they own (key index mod clients), each against its own
/// model; reads and scans range over everybody's keys and must at least be
/// well-formed. At the end the union of the models must be exactly the
/// store's contents.
pub fn check_multi(
    d: &LocalDeployment,
    threads: usize,
    tasks: usize,
    ops_per_task: usize,
    seed: u64,
) -> Result<(), String> {
    let clients = threads * tasks;
    let key_space = (clients * 24) as u64;
    let caps = d.engine.capabilities();
    let models: Vec<Result<Vec<Model>, String>> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|t| {
                let caps = caps.clone();
                s.spawn(move || -> Result<Vec<Model>, String> {
                    let (_ep, store) = d.client(t).map_err(|e| e.to_string())?;
                    let store = &*store;
                    let caps = &caps;
                    let futs: Vec<LocalTask<'_, Result<Model, String>>> = (0..tasks)
                        .map(|j| {
                            let me = (t * tasks + j) as u64;
                            Box::pin(async move {
                                let mut rng = SmallRng::seed_from_u64(seed ^ (me << 32));
                                let mut model = BTreeMap::new();
                                for _ in 0..ops_per_task {
                                    let own = spread_key(
                                        me + clients as u64
                                            * rng.gen_range(0..key_space / clients as u64),
                                    );
                                    let any = spread_key(rng.gen_range(0..key_space));
                                    let val: Vec<u8> = (0..[0, 8, 8, 8, 24][rng.gen_range(0..5)])
                                        .map(|_| rng.r#gen())
                                        .collect();
                                    let op = match rng.gen_range(0..10) {
                                        0..=2 => Op::Insert(own, val),
                                        3 => Op::Update(own, val),
                                        4 => Op::Upsert(own, val),
                                        5 => Op::Delete(own),
                                        6 | 7 => Op::Get(own),
                                        8 => {
                                            // Someone else's key: the answer is
                                            // only checked for form.
                                            let got = store
                                                .get(any)
                                                .await
                                                .map_err(|e| format!("get {any}: {e}"))?;
                                            if got.is_some_and(|v| v.len() > caps.max_value_len) {
                                                return Err(format!(
                                                    "get {any:#x}: oversized value"
                                                ));
                                            }
                                            continue;
                                        }
                                        _ => {
                                            if caps.scan {
                                                let n = rng.gen_range(1..30);
                                                let got = store
                                                    .scan(any, n)
                                                    .await
                                                    .map_err(|e| format!("scan: {e}"))?;
                                                check_scan_form(any, n, &got)?;
                                            }
                                            continue;
                                        }
                                    };
                                    apply(store, &mut model, caps, &op)
                                        .await
                                        .map_err(|e| format!("client {me}: {e}"))?;
                                }
                                Ok(model)
                            }) as LocalTask<'_, _>
                        })
                        .collect();
                    run_tasks(futs).into_iter().collect()
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("client thread"))
            .collect()
    });
    let mut union = BTreeMap::new();
    for m in models {
        for part in m? {
            union.extend(part);
        }
    }
    let (_ep, store) = d.client(0).map_err(|e| e.to_string())?;
    block_on(check_contents(&*store, &union, &caps))
}

/// A scan's result is sorted, starts at or after `start`, has at most `n`
/// pairs and no duplicates.
pub fn check_scan_form(start: Key, n: usize, got: &[(Key, Vec<u8>)]) -> Result<(), String> {
    if got.len() > n {
        return Err(format!("scan({start}, {n}) returned {} pairs", got.len()));
    }
    if got.first().is_some_and(|p| p.0 < start) {
        return Err(format!(
            "scan({start}, {n}) returned key {} below the start",
            got[0].0
        ));
    }
    if got.windows(2).any(|w| w[0].0 >= w[1].0) {
        return Err(format!("scan({start}, {n}) is not strictly ascending"));
    }
    Ok(())
}
