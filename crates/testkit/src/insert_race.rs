//! Concurrent inserts of the same new key: exactly one wins.
//!
//! Several clients on several OS threads (and several tasks per thread)
//! insert the same absent keys, in the same order, at the same time. For
//! every key exactly one insert must return `Ok(true)`, every other one
//! `Ok(false)` ("exists"), and the key must then read the winner's value.
//! Hash designs on disaggregated memory have got this wrong (two claims of
//! two free slots both win; Shard's Ordered-CAS was designed against it), and
//! ordered designs can get it wrong at a leaf split or a lock retry.
//!
//! Rounds alternate between fresh keys and, with
//! [`InsertRaceConfig::reinsert_deleted`], the previous round's keys after
//! they were deleted, so tombstones and freed slots are raced for too.
//!
//! [`insert_each`] and [`check_round`] are the pieces; `dmkv dst` uses them
//! under the simulator, [`insert_race`] on the local backend with real
//! threads.

use crate::history::StoreFactory;
use dmkv_api::deploy::LocalDeployment;
use dmkv_api::payload::{MIN_LEN, make_value};
use dmkv_api::{Capabilities, Key, KvStore};
use dmkv_transport::exec::{LocalTask, OpLimit, block_on, run_tasks};
use dmkv_transport::local::Faults;
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::sync::Barrier;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

/// What to race.
#[derive(Debug, Clone)]
pub struct InsertRaceConfig {
    /// OS threads, each with its own client; the deployment must have been
    /// made for at least this many compute threads.
    pub threads: usize,
    /// Racing tasks per thread (sharing the thread's client).
    pub tasks_per_thread: usize,
    /// Keys raced for per round.
    pub keys_per_round: usize,
    pub rounds: usize,
    /// Keys loaded before the race, so that learned and hashed layouts are
    /// not empty.
    pub loaded: usize,
    pub value_len: usize,
    /// Every other round deletes the previous round's keys and races for
    /// them again.
    pub reinsert_deleted: bool,
    /// Inject torn reads during the race.
    pub torn_reads: bool,
    pub seed: u64,
}

impl Default for InsertRaceConfig {
    fn default() -> Self {
        InsertRaceConfig {
            threads: 3,
            tasks_per_thread: 2,
            keys_per_round: 32,
            rounds: 12,
            loaded: 200,
            value_len: 16,
            reinsert_deleted: true,
            torn_reads: false,
            seed: 1,
        }
    }
}

/// What a race did.
#[derive(Debug, Clone, Default)]
pub struct InsertRaceReport {
    /// Keys raced for (a re-raced key counts again).
    pub keys: u64,
    /// Inserts issued.
    pub inserts: u64,
}

/// The value racer `racer` inserts for `key`.
pub fn racer_value(key: Key, racer: usize, len: usize) -> Vec<u8> {
    make_value(key, racer as u32 + 1, len.max(MIN_LEN))
}

/// Racer `racer` inserts every key of `keys` in order, each with
/// [`racer_value`]; the outcome of each, errors as strings. With `limit`
/// (`dmkv dst`: its `--op-limit-ms`, virtual time under the simulator), an
/// insert still running that long is given up: its outcome is an error
/// saying so and the racer stops there, so the outcomes end with it and a
/// livelocked insert fails the round instead of hanging it.
pub async fn insert_each(
    store: &dyn KvStore,
    keys: &[Key],
    racer: usize,
    value_len: usize,
    limit: Option<Duration>,
) -> Vec<Result<bool, String>> {
    let watch = limit.map(OpLimit::new);
    let mut out = Vec::with_capacity(keys.len());
    for &k in keys {
        let v = racer_value(k, racer, value_len);
        let insert = store.insert(k, &v);
        let outcome = match &watch {
            None => insert.await,
            Some(w) => match w.run(insert).await {
                Some(outcome) => outcome,
                None => {
                    out.push(Err(format!(
                        "did not complete within {:?} (a livelock or a wait that never ends); the racer stopped there",
                        w.limit()
                    )));
                    break;
                }
            },
        };
        out.push(outcome.map_err(|e| e.to_string()));
    }
    out
}

/// Checks one round: `results[racer][j]` is racer `racer`'s outcome for
/// `keys[j]`. Exactly one racer won each key, no insert failed, and `read`
/// returns the winner's value.
pub async fn check_round(
    keys: &[Key],
    results: &[Vec<Result<bool, String>>],
    value_len: usize,
    read: &dyn KvStore,
) -> Result<(), String> {
    for (j, &k) in keys.iter().enumerate() {
        let mut winners = Vec::new();
        for (i, r) in results.iter().enumerate() {
            match r.get(j) {
                Some(Ok(true)) => winners.push(i),
                Some(Ok(false)) => {}
                Some(Err(e)) => {
                    return Err(format!("insert of key {k:#x} by racer {i} failed: {e}"));
                }
                // A racer's outcomes end early only with an error (an insert
                // given up, `insert_each`), which an earlier key reported.
                None => return Err(format!("racer {i} stopped before key {k:#x}")),
            }
        }
        if winners.len() != 1 {
            return Err(format!(
                "key {k:#x}: {} of {} concurrent inserts succeeded (racers {winners:?}); \
                 exactly one must, the others must see 'exists'",
                winners.len(),
                results.len()
            ));
        }
        let want = racer_value(k, winners[0], value_len);
        match read.get(k).await {
            Ok(Some(v)) if v == want => {}
            Ok(Some(v)) => {
                let who = (0..results.len()).find(|&i| racer_value(k, i, value_len) == v);
                return Err(format!(
                    "key {k:#x} does not hold the value of its one successful insert \
                     (racer {}); it holds {}",
                    winners[0],
                    match who {
                        Some(i) => format!("the value of racer {i}, whose insert saw 'exists'"),
                        None => format!("{} bytes no racer wrote", v.len()),
                    }
                ));
            }
            Ok(None) => return Err(format!("key {k:#x} was inserted but is not found")),
            Err(e) => return Err(format!("get of key {k:#x} failed: {e}")),
        }
    }
    Ok(())
}

/// `n` distinct random keys, none reserved by `caps` and none in `taken`
/// (which they are added to).
pub fn fresh_keys(
    caps: &Capabilities,
    rng: &mut SmallRng,
    n: usize,
    taken: &mut HashSet<Key>,
) -> Vec<Key> {
    let mut out = Vec::with_capacity(n);
    while out.len() < n {
        let k: Key = rng.r#gen::<u64>() >> 1;
        if k != 0 && !caps.reserved_keys.contains(&k) && taken.insert(k) {
            out.push(k);
        }
    }
    out
}

/// Runs the race on `d` with real threads and checks every round; returns
/// an error naming the first violation.
pub fn insert_race(
    d: &LocalDeployment,
    cfg: &InsertRaceConfig,
) -> Result<InsertRaceReport, String> {
    insert_race_on(d, cfg, &|t| {
        d.client(t).map(|c| c.1).map_err(|e| e.to_string())
    })
}

/// [`insert_race`] on stores made by `make_store` (to check the checker on
/// broken stores).
pub fn insert_race_on(
    d: &LocalDeployment,
    cfg: &InsertRaceConfig,
    make_store: &StoreFactory<'_>,
) -> Result<InsertRaceReport, String> {
    assert!(
        cfg.threads > 0 && cfg.tasks_per_thread > 0 && cfg.threads * cfg.tasks_per_thread > 1,
        "an insert race needs at least two racers"
    );
    let caps = d.engine.capabilities();
    let mut rng = SmallRng::seed_from_u64(cfg.seed ^ 0x1a5e_47ace);
    let mut taken = HashSet::new();
    let mut loaded: Vec<(Key, Vec<u8>)> = fresh_keys(&caps, &mut rng, cfg.loaded, &mut taken)
        .into_iter()
        .map(|k| (k, make_value(k, 0, cfg.value_len.max(MIN_LEN))))
        .collect();
    loaded.sort_by_key(|p| p.0);
    {
        let ep = d.endpoint(0);
        block_on(d.engine.load(&ep, &loaded)).map_err(|e| format!("load: {e}"))?;
    }
    // Round r races for rounds[r]; a re-race round reuses the previous keys.
    let mut rounds: Vec<Vec<Key>> = Vec::with_capacity(cfg.rounds);
    for r in 0..cfg.rounds {
        if cfg.reinsert_deleted && r % 2 == 1 {
            rounds.push(rounds[r - 1].clone());
        } else {
            rounds.push(fresh_keys(&caps, &mut rng, cfg.keys_per_round, &mut taken));
        }
    }
    let racers = cfg.threads * cfg.tasks_per_thread;
    let results: Mutex<Vec<Vec<Result<bool, String>>>> = Mutex::new(vec![Vec::new(); racers]);
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let stop = AtomicBool::new(false);
    let barrier = Barrier::new(cfg.threads);
    let faults_before = d.cluster.faults();
    if cfg.torn_reads {
        d.cluster.set_faults(Faults {
            torn_reads: true,
            ..faults_before.clone()
        });
    }
    std::thread::scope(|s| {
        for t in 0..cfg.threads {
            let (rounds, results, errors, stop, barrier) =
                (&rounds, &results, &errors, &stop, &barrier);
            s.spawn(move || {
                let store = match make_store(t) {
                    Ok(c) => Some(c),
                    Err(e) => {
                        errors.lock().push(format!("client {t}: {e}"));
                        stop.store(true, Ordering::SeqCst);
                        None
                    }
                };
                barrier.wait();
                let Some(store) = store else { return };
                if stop.load(Ordering::SeqCst) {
                    return;
                }
                let store = &*store;
                for (r, keys) in rounds.iter().enumerate() {
                    // Start together.
                    barrier.wait();
                    let tasks: Vec<LocalTask<'_, Vec<Result<bool, String>>>> = (0..cfg
                        .tasks_per_thread)
                        .map(|j| {
                            let racer = t * cfg.tasks_per_thread + j;
                            Box::pin(insert_each(store, keys, racer, cfg.value_len, None))
                                as LocalTask<'_, _>
                        })
                        .collect();
                    let outs = run_tasks(tasks);
                    {
                        let mut res = results.lock();
                        for (j, out) in outs.into_iter().enumerate() {
                            res[t * cfg.tasks_per_thread + j] = out;
                        }
                    }
                    barrier.wait();
                    if t == 0 {
                        let res = std::mem::take(&mut *results.lock());
                        let checked = block_on(check_round(keys, &res, cfg.value_len, store));
                        *results.lock() = vec![Vec::new(); racers];
                        if let Err(e) = checked {
                            errors.lock().push(format!("round {r}: {e}"));
                            stop.store(true, Ordering::SeqCst);
                        } else if cfg.reinsert_deleted && r % 2 == 0 && r + 1 < rounds.len() {
                            for &k in keys {
                                match block_on(store.delete(k)) {
                                    Ok(true) => {}
                                    other => {
                                        errors.lock().push(format!(
                                            "round {r}: delete of raced key {k:#x} gave {other:?}"
                                        ));
                                        stop.store(true, Ordering::SeqCst);
                                        break;
                                    }
                                }
                            }
                        }
                    }
                    // Wait for the check (and the deletes) before going on.
                    barrier.wait();
                    if stop.load(Ordering::SeqCst) {
                        return;
                    }
                }
            });
        }
    });
    d.cluster.set_faults(faults_before);
    if let Some(e) = errors.into_inner().into_iter().next() {
        return Err(e);
    }
    Ok(InsertRaceReport {
        keys: (cfg.rounds * cfg.keys_per_round) as u64,
        inserts: (cfg.rounds * cfg.keys_per_round * racers) as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use async_trait::async_trait;

    /// Inserts of `stuck` never complete; every other insert wins, and a
    /// key reads racer 0's value.
    struct StuckOn {
        stuck: Key,
    }

    #[async_trait(?Send)]
    impl KvStore for StuckOn {
        async fn get(&self, key: Key) -> dmkv_api::Result<Option<Vec<u8>>> {
            Ok(Some(racer_value(key, 0, 16)))
        }
        async fn insert(&self, key: Key, _: &[u8]) -> dmkv_api::Result<bool> {
            if key == self.stuck {
                std::future::pending::<()>().await;
            }
            Ok(true)
        }
        async fn update(&self, _: Key, _: &[u8]) -> dmkv_api::Result<bool> {
            unreachable!()
        }
        async fn upsert(&self, _: Key, _: &[u8]) -> dmkv_api::Result<bool> {
            unreachable!()
        }
        async fn delete(&self, _: Key) -> dmkv_api::Result<bool> {
            unreachable!()
        }
        async fn scan(&self, _: Key, _: usize) -> dmkv_api::Result<Vec<(Key, Vec<u8>)>> {
            unreachable!()
        }
    }

    /// With a limit, an insert that never completes ends the racer with an
    /// error at that key, and the round's check reports it (it used to hang
    /// `dmkv dst`'s insert race, which had no limit).
    #[test]
    fn an_insert_that_never_completes_fails_the_round_under_a_limit() {
        let store = StuckOn { stuck: 2 };
        let keys = [1, 2, 3];
        let limit = Duration::from_millis(20);
        let stuck = block_on(insert_each(&store, &keys, 0, 16, Some(limit)));
        assert_eq!(stuck.len(), 2, "{stuck:?}");
        assert_eq!(stuck[0], Ok(true));
        assert!(
            stuck[1]
                .as_ref()
                .is_err_and(|e| e.contains("did not complete within 20ms")),
            "{stuck:?}"
        );
        let other = vec![Ok(false); keys.len()];
        let e = block_on(check_round(&keys, &[stuck, other], 16, &store)).unwrap_err();
        assert!(
            e.starts_with("insert of key 0x2 by racer 0 failed: did not complete"),
            "{e}"
        );
        // Without a stuck key the limit changes nothing.
        let free = block_on(insert_each(
            &StuckOn { stuck: 9 },
            &keys,
            0,
            16,
            Some(limit),
        ));
        assert_eq!(free, vec![Ok(true); 3]);
    }
}
