//! Writers racing readers, with histories checked afterwards.
//!
//! Every key has one writer task (its owner), so the writes to a key are
//! totally ordered; readers on other tasks and threads read any key. A global
//! logical clock stamps each operation's start and end. A read is correct if
//! it returns the state left by some write `w` of its key such that
//! - `w` started before the read ended (no values from the future), and
//! - no later write of that key had completed before the read started (no
//!   stale values).
//!
//! Values are self-checking ([`dmkv_api::payload`]), so a read that returns a
//! torn value or another key's value fails at once. Scans are checked the
//! same way key by key, and must not miss a key that was present throughout.

use crate::oracle::{check_scan_form, spread_key};
use dmkv_api::deploy::LocalDeployment;
use dmkv_api::payload::{check_value, make_value};
use dmkv_api::{Key, KvStore};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::local::Faults;
use parking_lot::Mutex;
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};

/// What to race.
#[derive(Debug, Clone)]
pub struct RaceConfig {
    /// Keys (few, so that writers and readers collide on the same leaves,
    /// buckets or pages).
    pub keys: u64,
    /// Keys loaded before the race (the rest start absent).
    pub loaded: u64,
    pub threads: usize,
    pub writers_per_thread: usize,
    pub readers_per_thread: usize,
    pub writes_per_writer: usize,
    pub reads_per_reader: usize,
    pub value_len: usize,
    /// Writers also delete and re-insert their keys.
    pub deletes: bool,
    /// Readers also scan (engines with ordered scans).
    pub scans: bool,
    /// Inject torn reads during the race.
    pub torn_reads: bool,
    pub seed: u64,
}

impl Default for RaceConfig {
    fn default() -> Self {
        RaceConfig {
            keys: 64,
            loaded: 48,
            threads: 2,
            writers_per_thread: 2,
            readers_per_thread: 2,
            writes_per_writer: 300,
            reads_per_reader: 600,
            value_len: 8,
            deletes: true,
            scans: true,
            torn_reads: false,
            seed: 1,
        }
    }
}

/// What a race did, for assertions and messages.
#[derive(Debug, Clone, Default)]
pub struct RaceReport {
    pub writes: u64,
    pub reads: u64,
    pub scans: u64,
    /// Reads that returned a value written by a write still in progress.
    pub reads_of_concurrent_writes: u64,
}

#[derive(Debug, Clone, Copy)]
enum State {
    Present(u32),
    Absent,
}

#[derive(Debug, Clone, Copy)]
struct Write {
    state: State,
    start: u64,
    end: u64,
}

#[derive(Debug, Clone)]
struct Read {
    key: Key,
    got: State,
    start: u64,
    end: u64,
}

/// A scan: start, n, keys returned, start and end stamps.
type ScanRecord = (Key, usize, Vec<Key>, u64, u64);

struct Shared {
    clock: AtomicU64,
    /// Per key, its writes in order (the initial state first).
    writes: Vec<Mutex<Vec<Write>>>,
    reads: Mutex<Vec<Read>>,
    scans: Mutex<Vec<ScanRecord>>,
    errors: Mutex<Vec<String>>,
}

impl Shared {
    fn tick(&self) -> u64 {
        self.clock.fetch_add(1, Ordering::SeqCst)
    }
}

/// Runs the race on `d` and checks every history; returns an error naming
/// the first violation.
pub fn race(d: &LocalDeployment, cfg: &RaceConfig) -> Result<RaceReport, String> {
    race_on(d, cfg, &|t| {
        d.client(t).map(|c| c.1).map_err(|e| e.to_string())
    })
}

/// Makes the store thread `t` uses.
pub type StoreFactory<'a> = dyn Fn(usize) -> Result<Rc<dyn KvStore>, String> + Sync + 'a;

/// [`race`] on stores made by `make_store` (to check the checker on broken
/// stores).
pub fn race_on(
    d: &LocalDeployment,
    cfg: &RaceConfig,
    make_store: &StoreFactory<'_>,
) -> Result<RaceReport, String> {
    let keys: Vec<Key> = (0..cfg.keys).map(spread_key).collect();
    let index: HashMap<Key, usize> = keys.iter().enumerate().map(|(i, k)| (*k, i)).collect();
    let writers = cfg.threads * cfg.writers_per_thread;
    assert!(writers > 0, "a race needs writers");
    // Load the initial state.
    let loaded: Vec<(Key, Vec<u8>)> = keys
        .iter()
        .take(cfg.loaded as usize)
        .map(|k| (*k, make_value(*k, 0, cfg.value_len)))
        .collect();
    {
        let ep = d.endpoint(0);
        block_on(d.engine.load(&ep, &loaded)).map_err(|e| format!("load: {e}"))?;
    }
    let shared = Shared {
        clock: AtomicU64::new(1),
        writes: keys
            .iter()
            .enumerate()
            .map(|(i, _)| {
                let state = if (i as u64) < cfg.loaded {
                    State::Present(0)
                } else {
                    State::Absent
                };
                Mutex::new(vec![Write {
                    state,
                    start: 0,
                    end: 0,
                }])
            })
            .collect(),
        reads: Mutex::new(Vec::new()),
        scans: Mutex::new(Vec::new()),
        errors: Mutex::new(Vec::new()),
    };
    let faults_before = d.cluster.faults();
    if cfg.torn_reads {
        d.cluster.set_faults(Faults {
            torn_reads: true,
            ..faults_before.clone()
        });
    }
    std::thread::scope(|s| {
        for t in 0..cfg.threads {
            let shared = &shared;
            let keys = &keys;
            s.spawn(move || {
                let store = match make_store(t) {
                    Ok(c) => c,
                    Err(e) => {
                        shared.errors.lock().push(format!("client {t}: {e}"));
                        return;
                    }
                };
                let store = &*store;
                let mut tasks: Vec<LocalTask<'_, ()>> = Vec::new();
                for w in 0..cfg.writers_per_thread {
                    let me = t * cfg.writers_per_thread + w;
                    tasks.push(Box::pin(writer(store, shared, keys, me, writers, cfg)));
                }
                for r in 0..cfg.readers_per_thread {
                    let seed = cfg.seed ^ ((t * 1000 + r) as u64) << 20;
                    tasks.push(Box::pin(reader(store, shared, keys, seed, cfg)));
                }
                run_tasks(tasks);
            });
        }
    });
    d.cluster.set_faults(faults_before);
    let errors = shared.errors.into_inner();
    if let Some(e) = errors.first() {
        return Err(format!("{} operations failed; first: {e}", errors.len()));
    }
    let writes: Vec<Vec<Write>> = shared.writes.into_iter().map(|m| m.into_inner()).collect();
    let mut report = RaceReport {
        writes: writes.iter().map(|w| w.len() as u64 - 1).sum(),
        ..Default::default()
    };
    for read in shared.reads.into_inner() {
        report.reads += 1;
        let i = index[&read.key];
        if check_read(&writes[i], &read)? {
            report.reads_of_concurrent_writes += 1;
        }
    }
    for (start, n, got, t0, t1) in shared.scans.into_inner() {
        report.scans += 1;
        // Keys present throughout the scan and inside the range it covered
        // must be in it.
        let complete = got.len() < n;
        let last = got.last().copied();
        for (i, k) in keys.iter().enumerate() {
            if *k < start
                || (!complete && last.is_some_and(|l| *k > l))
                || (!complete && last.is_none())
            {
                continue;
            }
            let stable_present = candidates(&writes[i], t0, t1)
                .iter()
                .all(|w| matches!(w.state, State::Present(_)));
            if stable_present && got.binary_search(k).is_err() {
                return Err(format!(
                    "scan({start}, {n}) missed key {k:#x}, present throughout the scan"
                ));
            }
        }
    }
    Ok(report)
}

/// The writes whose state a read spanning `[start, end]` may observe.
fn candidates(writes: &[Write], start: u64, end: u64) -> Vec<Write> {
    // The last write completed before the read started...
    let base = writes.iter().rposition(|w| w.end < start).unwrap_or(0);
    // ...and every later write that started before the read ended.
    writes[base..]
        .iter()
        .filter(|w| w.start < end || w.end == 0)
        .copied()
        .collect()
}

/// Checks one read; returns whether it saw a write that was in progress.
fn check_read(writes: &[Write], read: &Read) -> Result<bool, String> {
    let cands = candidates(writes, read.start, read.end);
    let ok = cands.iter().position(|w| match (w.state, read.got) {
        (State::Present(a), State::Present(b)) => a == b,
        (State::Absent, State::Absent) => true,
        _ => false,
    });
    match ok {
        Some(i) => Ok(i > 0 || cands[0].end > read.start),
        None => Err(format!(
            "read of key {:#x} during [{}, {}] returned {:?}; allowed: {:?}; all writes: {:?}",
            read.key, read.start, read.end, read.got, cands, writes
        )),
    }
}

async fn writer(
    store: &dyn KvStore,
    sh: &Shared,
    keys: &[Key],
    me: usize,
    writers: usize,
    cfg: &RaceConfig,
) {
    let mine: Vec<usize> = (me..keys.len()).step_by(writers).collect();
    if mine.is_empty() {
        return;
    }
    let mut rng = SmallRng::seed_from_u64(cfg.seed ^ 0xABCD ^ me as u64);
    let mut version = vec![0u32; keys.len()];
    for _ in 0..cfg.writes_per_writer {
        let i = mine[rng.gen_range(0..mine.len())];
        let k = keys[i];
        let present = matches!(
            sh.writes[i].lock().last().expect("initial").state,
            State::Present(_)
        );
        let start = sh.tick();
        let (res, state) = if present && cfg.deletes && rng.gen_bool(0.2) {
            (
                store.delete(k).await.map(|ok| ok.then_some(())),
                State::Absent,
            )
        } else {
            version[i] += 1;
            let v = make_value(k, version[i], cfg.value_len);
            let state = State::Present(version[i]);
            let res = if present {
                if rng.gen_bool(0.5) {
                    store.update(k, &v).await
                } else {
                    store.upsert(k, &v).await.map(|new| !new)
                }
            } else {
                store.insert(k, &v).await
            };
            (res.map(|ok| ok.then_some(())), state)
        };
        // Record the write as started before issuing it would be simpler, but
        // the owner is the only writer, so recording at completion with the
        // start stamp taken before the call is exact.
        let end = sh.tick();
        match res {
            Ok(Some(())) => sh.writes[i].lock().push(Write { state, start, end }),
            Ok(None) => sh.errors.lock().push(format!(
                "owner's write of key {k:#x} was refused (state {state:?})"
            )),
            Err(e) => sh.errors.lock().push(format!("write of key {k:#x}: {e}")),
        }
    }
}

async fn reader(store: &dyn KvStore, sh: &Shared, keys: &[Key], seed: u64, cfg: &RaceConfig) {
    let mut rng = SmallRng::seed_from_u64(seed);
    for _ in 0..cfg.reads_per_reader {
        if cfg.scans && rng.gen_ratio(1, 8) {
            let start = keys[rng.gen_range(0..keys.len())] - rng.gen_range(0..2);
            let n = rng.gen_range(1..20);
            let t0 = sh.tick();
            let res = store.scan(start, n).await;
            let t1 = sh.tick();
            match res {
                Err(e) => sh.errors.lock().push(format!("scan({start}, {n}): {e}")),
                Ok(pairs) => {
                    if let Err(e) = check_scan_form(start, n, &pairs) {
                        sh.errors.lock().push(e);
                        continue;
                    }
                    let mut got = Vec::new();
                    for (k, v) in pairs {
                        match check_value(k, &v) {
                            Ok(ver) => sh.reads.lock().push(Read {
                                key: k,
                                got: State::Present(ver),
                                start: t0,
                                end: t1,
                            }),
                            Err(e) => sh
                                .errors
                                .lock()
                                .push(format!("scan returned a bad value: {e}")),
                        }
                        if !keys.contains(&k) {
                            sh.errors
                                .lock()
                                .push(format!("scan returned key {k:#x}, never written"));
                        }
                        got.push(k);
                    }
                    sh.scans.lock().push((start, n, got, t0, t1));
                }
            }
            continue;
        }
        let k = keys[rng.gen_range(0..keys.len())];
        let start = sh.tick();
        let res = store.get(k).await;
        let end = sh.tick();
        match res {
            Err(e) => sh.errors.lock().push(format!("get {k:#x}: {e}")),
            Ok(None) => sh.reads.lock().push(Read {
                key: k,
                got: State::Absent,
                start,
                end,
            }),
            Ok(Some(v)) => match check_value(k, &v) {
                Ok(ver) => sh.reads.lock().push(Read {
                    key: k,
                    got: State::Present(ver),
                    start,
                    end,
                }),
                Err(e) => sh
                    .errors
                    .lock()
                    .push(format!("get returned a bad value: {e}")),
            },
        }
    }
}
