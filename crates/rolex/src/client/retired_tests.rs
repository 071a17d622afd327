//! Invariant 13 of docs/rolex.md, driven step by step on the local
//! backend: a RETIRED word a table refresh cached during a freeze (of a
//! retrain that is then given up, invariant 12) is stale, never corrupt,
//! and never locked from. The test plays the memory node's freeze itself
//! (one-sided writes of RETIRED into LT entries and FREEZING into the
//! record's state, then the give-up's write-back), so every step happens
//! in a chosen order with no retrain running.
//!
//! Both tests fail with the fix of df9b449 reverted: the first with
//! `Corrupt("retired entry")` (the lock CAS from the cached RETIRED word
//! "succeeds" on the frozen entry), the second with `Corrupt("retired LT
//! entry")` (the insert's fetch of the next group's fence leaf).

use super::Shared;
use super::ops::RolexClient;
use crate::config::Config;
use crate::layout::entry::RETIRED;
use crate::layout::record::{ModelState, RecordLayout, W_STATE};
use dmkv_api::deploy::LocalDeployment;
use dmkv_api::{Key, KvClient};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks, yield_now};
use dmkv_transport::{Endpoint, RemoteAddr};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::cache::ModelCache;

/// Loaded keys are multiples of 10; keys ending in 5 are free to insert.
const LOADED: u64 = 2000;

struct Setup {
    ep: Rc<Endpoint>,
    sh: Arc<Shared>,
    client: RolexClient,
    // Last: the deployment outlives the endpoint and the client.
    _d: LocalDeployment,
}

fn setup() -> Setup {
    // Small leaves: many groups per model, so a key has a next group.
    let d = crate::local_test_deployment(&[("leaf_slots", "8")]);
    let ep = d.endpoint(0);
    let pairs: Vec<(Key, Vec<u8>)> = (0..LOADED)
        .map(|i| (i * 10, (i * 10).to_le_bytes().to_vec()))
        .collect();
    block_on(d.engine.load(&ep, &pairs)).expect("load");
    // A compute process of our own, whose shared state (caches, lock
    // table, counters) the test can reach.
    let cfg = Config::from_args(&d.args).expect("config");
    let sh = Arc::new(block_on(Shared::connect(&ep, cfg, &d.args)).expect("connect"));
    let client = RolexClient::new(ep.clone(), sh.clone());
    Setup {
        ep,
        sh,
        client,
        _d: d,
    }
}

impl Setup {
    /// A free key whose predicted groups `lo..=hi` have a next group, its
    /// model, and `(lo, hi)`.
    fn pick(&self) -> (Key, Arc<ModelCache>, usize, usize) {
        let slots = self.sh.cfg.leaf.slots();
        for i in (LOADED / 2)..LOADED {
            let key = i * 10 + 5;
            let mc = block_on(self.sh.model_for(&self.ep, key, true)).expect("model");
            let (lo, hi) = mc.p.leaf_range(key, slots);
            if hi + 1 < mc.p.leaves as usize {
                return (key, mc, lo, hi);
            }
        }
        panic!("no key with a next group");
    }

    fn lt_addr(&self, mc: &ModelCache, j: usize) -> RemoteAddr {
        let rl = RecordLayout {
            slt: mc.p.slt_slots as usize,
        };
        self.sh.remote.record(mc.m, rl.lt_word(j)).expect("LT word")
    }

    fn state_addr(&self, mc: &ModelCache) -> RemoteAddr {
        self.sh.remote.record(mc.m, W_STATE).expect("state word")
    }

    async fn word(&self, a: RemoteAddr) -> u64 {
        u64::from_le_bytes(self.ep.read(a, 8).await.expect("read").try_into().unwrap())
    }

    async fn put(&self, a: RemoteAddr, w: u64) {
        self.ep.write(a, &w.to_le_bytes()).await.expect("write");
    }

    /// What the retrainer's freeze does (server/retrain.rs): the state
    /// FREEZING, then each entry of `js` RETIRED. Returns what it replaced.
    async fn freeze(&self, mc: &ModelCache, js: &[usize]) -> (u64, Vec<u64>) {
        let st = self.word(self.state_addr(mc)).await;
        self.put(self.state_addr(mc), ModelState::Freezing as u64)
            .await;
        let mut old = Vec::new();
        for &j in js {
            let a = self.lt_addr(mc, j);
            old.push(self.word(a).await);
            self.put(a, RETIRED).await;
        }
        (st, old)
    }

    /// A freeze given up (invariant 12): the entries' old words back, then
    /// the old state.
    async fn give_up(&self, mc: &ModelCache, js: &[usize], (st, old): (u64, Vec<u64>)) {
        for (&j, w) in js.iter().zip(old) {
            self.put(self.lt_addr(mc, j), w).await;
        }
        self.put(self.state_addr(mc), st).await;
    }

    fn retired_cached(&self) -> u64 {
        self.sh.stats.retired_cached.load(Ordering::Relaxed)
    }

    /// Every loaded key still answers its value, and `key` answers `v`.
    fn check(&self, key: Key, v: &[u8]) {
        block_on(async {
            assert_eq!(self.client.get(key).await.unwrap().as_deref(), Some(v));
            for i in (0..LOADED).step_by(7) {
                let k = i * 10;
                assert_eq!(
                    self.client.get(k).await.unwrap(),
                    Some(k.to_le_bytes().to_vec()),
                    "key {k}"
                );
            }
        });
    }
}

/// The lock path: a writer fetched with a live cache and waits for its
/// local turn; meanwhile the group is frozen and another task's refresh
/// caches RETIRED. When its turn comes, its expected LT word (from the
/// cache) is RETIRED. Without the check in `locked`, the CAS of RETIRED
/// to RETIRED | LOCK_BIT (the same word) "succeeds" on the frozen entry,
/// takes no lock, and the chain walk fails with Corrupt("retired entry").
/// With it, the writer retries, waits out the freeze and inserts.
#[test]
fn a_writer_never_locks_from_a_cached_retired_word() {
    let s = setup();
    let (key, mc, lo, hi) = s.pick();
    let n = mc.p.leaves as usize;
    let all: Vec<usize> = (0..n).collect();
    let value = b"inserted after the freeze".to_vec();
    let done = Cell::new(false);
    let tasks: Vec<LocalTask<'_, Option<dmkv_api::Result<bool>>>> = vec![
        // The other local task: holds the turns of every group the key
        // may fall in until the writer waits for one, freezes and
        // refreshes, lets the turns go, then gives the freeze up.
        Box::pin(async {
            let turns: Vec<_> = {
                let mut t = Vec::new();
                for j in lo..=hi {
                    t.push(s.sh.locks.acquire((mc.m, j)).await);
                }
                t
            };
            let mut spins = 0;
            while (lo..=hi).all(|j| s.sh.locks.waiting((mc.m, j)) == 0) {
                yield_now().await;
                spins += 1;
                assert!(spins < 100_000, "the writer never waited for its turn");
            }
            let frozen = s.freeze(&mc, &all).await;
            s.sh.refresh_tables(&s.ep, &mc).await.expect("refresh");
            assert!(
                (lo..=hi).all(|j| mc.lt(j) == RETIRED),
                "the refresh cached the frozen entries"
            );
            drop(turns);
            // The writer runs its turn now; wait until it has seen the
            // cached RETIRED word (or finished: it failed).
            let mut spins = 0;
            while !done.get() && s.retired_cached() == 0 {
                yield_now().await;
                spins += 1;
                assert!(spins < 100_000, "the writer never took its turn");
            }
            s.give_up(&mc, &all, frozen).await;
            None
        }),
        // The writer.
        Box::pin(async {
            let r = s.client.insert(key, &value).await;
            done.set(true);
            Some(r)
        }),
    ];
    let out = run_tasks(tasks);
    let r = out
        .into_iter()
        .flatten()
        .next()
        .expect("the writer's result");
    assert!(
        matches!(r, Ok(true)),
        "insert of {key} after a cached RETIRED word: {r:?}"
    );
    assert!(s.retired_cached() >= 1, "the cached RETIRED word was seen");
    s.check(key, &value);
}

/// The insert's fence path: a refresh during an ascending freeze read
/// group `hi` before the freeze reached it and group `hi + 1` after (a
/// table read sees its words in increasing address order), so the cache
/// holds a live word for the key's groups and RETIRED for the next one;
/// the freeze is then given up, which puts the model back in service.
/// Without the check the insert's fetch fails with Corrupt("retired LT
/// entry"); with it, it refreshes and inserts.
#[test]
fn an_insert_refreshes_a_cached_retired_fence_entry() {
    let s = setup();
    let (key, mc, _lo, hi) = s.pick();
    let next = [hi + 1];
    block_on(async {
        let frozen = s.freeze(&mc, &next).await;
        s.sh.refresh_tables(&s.ep, &mc).await.expect("refresh");
        assert_eq!(
            mc.lt(hi + 1),
            RETIRED,
            "the refresh cached the frozen entry"
        );
        assert!(mc.lt(hi) != RETIRED);
        s.give_up(&mc, &next, frozen).await;
    });
    let value = b"inserted past a cached fence".to_vec();
    let r = block_on(s.client.insert(key, &value));
    assert!(
        matches!(r, Ok(true)),
        "insert of {key} with a cached RETIRED next entry: {r:?}"
    );
    assert!(s.retired_cached() >= 1, "the cached RETIRED word was seen");
    s.check(key, &value);
}
