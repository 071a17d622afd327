#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Killing one memory node of three during a run of concurrent writers and
//! readers loses no acknowledged write, and reads go on from a replica.

mod common;

use dmkv_api::payload::{check_value, make_value};
use dmkv_testkit::oracle::spread_key;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use parking_lot::Mutex;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

const KEYS: u64 = 240;
const WRITERS: usize = 4;
const WRITES_PER_WRITER: usize = 300;

fn crash_one_of_three(knobs: dmkv_api::Knobs, victim: usize) {
    let d = common::deploy_with(knobs, 3, 2);
    let keys: Vec<u64> = (0..KEYS).map(spread_key).collect();
    let ep = d.endpoint(0);
    let loaded: Vec<(u64, Vec<u8>)> = keys.iter().map(|&k| (k, make_value(k, 0, 8))).collect();
    block_on(d.engine.load(&ep, &loaded)).unwrap();
    // The last acknowledged version of every key.
    let acked: Vec<AtomicU32> = keys.iter().map(|_| AtomicU32::new(0)).collect();
    let done = AtomicU64::new(0);
    let errors: Mutex<Vec<String>> = Mutex::new(Vec::new());
    let victim_node = d.runtimes[victim].id();
    std::thread::scope(|s| {
        let (done_ref, d_ref) = (&done, &d);
        s.spawn(move || {
            while done_ref.load(Ordering::Relaxed) < (WRITERS * WRITES_PER_WRITER / 3) as u64 {
                std::thread::yield_now();
            }
            d_ref.cluster.crash(victim_node);
        });
        for t in 0..2usize {
            let (d, keys, acked, done, errors) = (&d, &keys, &acked, &done, &errors);
            s.spawn(move || {
                let (_ep, store) = d.client(t).unwrap();
                let store = &*store;
                let mut tasks: Vec<LocalTask<'_, ()>> = Vec::new();
                for w in 0..2usize {
                    let me = t * 2 + w;
                    tasks.push(Box::pin(async move {
                        let mine: Vec<usize> = (me..keys.len()).step_by(WRITERS).collect();
                        for n in 0..WRITES_PER_WRITER {
                            let i = mine[n % mine.len()];
                            let v = acked[i].load(Ordering::Relaxed) + 1;
                            match store.upsert(keys[i], &make_value(keys[i], v, 8)).await {
                                Ok(false) => acked[i].store(v, Ordering::Relaxed),
                                other => errors
                                    .lock()
                                    .push(format!("upsert {:#x} v{v}: {other:?}", keys[i])),
                            }
                            done.fetch_add(1, Ordering::Relaxed);
                        }
                    }));
                }
                for r in 0..2u64 {
                    tasks.push(Box::pin(async move {
                        let mut x = r + 10 * t as u64;
                        while done.load(Ordering::Relaxed) < (WRITERS * WRITES_PER_WRITER) as u64 {
                            x = dmkv_outback::hash::mix64(x);
                            let i = (x % KEYS) as usize;
                            let before = acked[i].load(Ordering::Relaxed);
                            match store.get(keys[i]).await {
                                Ok(Some(v)) => match check_value(keys[i], &v) {
                                    Ok(ver) if ver >= before => {}
                                    got => errors.lock().push(format!(
                                        "get {:#x}: {got:?}, acknowledged v{before}",
                                        keys[i]
                                    )),
                                },
                                other => {
                                    errors.lock().push(format!("get {:#x}: {other:?}", keys[i]))
                                }
                            }
                        }
                    }));
                }
                run_tasks(tasks);
            });
        }
    });
    let errors = errors.into_inner();
    assert!(
        errors.is_empty(),
        "{} errors; first: {}",
        errors.len(),
        errors[0]
    );
    // Every acknowledged write is there, from whichever node serves it now.
    let (_ep, store) = d.client(0).unwrap();
    block_on(async {
        for (i, &k) in keys.iter().enumerate() {
            let v = store.get(k).await.unwrap().expect("key present");
            assert_eq!(
                check_value(k, &v),
                Ok(acked[i].load(Ordering::Relaxed)),
                "{k:#x}"
            );
        }
    });
    let st = block_on(d.engine.stats(&ep)).unwrap();
    assert_eq!(st["takeovers"].as_u64().unwrap(), 1, "{st}");
    assert!(st["failovers"].as_u64().unwrap() >= 1, "{st}");
    assert_eq!(st["keys"].as_u64().unwrap(), KEYS, "{st}");
}

#[test]
fn crash_of_a_primary_loses_no_acknowledged_write() {
    crash_one_of_three(dmkv_api::Knobs::new(), 1);
}

#[test]
fn crash_during_resizes_loses_no_acknowledged_write() {
    crash_one_of_three(common::small_tables(), 2);
}
