#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Loom model of the per-bucket lock and seqlock (`server::seqlock`), with
//! the orderings of `RegionMem`: a GET must never accept a slot together
//! with a block or a seed that belongs to another moment, even when the old
//! block is recycled by a writer of another bucket.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p dmkv-outback --release --test loom`.

#![cfg(loom)]

use dmkv_outback::layout::ControlWord;
use dmkv_outback::server::seqlock::{Words, lock, read, unlock};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};

struct LoomWords(Vec<AtomicU64>);

impl Words for LoomWords {
    fn load(&self, at: u64) -> u64 {
        self.0[at as usize / 8].load(Ordering::Acquire)
    }
    fn store(&self, at: u64, v: u64) {
        self.0[at as usize / 8].store(v, Ordering::Release)
    }
    fn cas(&self, at: u64, e: u64, n: u64) -> u64 {
        match self.0[at as usize / 8].compare_exchange(e, n, Ordering::AcqRel, Ordering::Acquire) {
            Ok(v) | Err(v) => v,
        }
    }
    fn pause(&self, _spins: &mut u32) {
        loom::thread::yield_now();
    }
}

const CTRL: u64 = 0;
const SLOT0: u64 = 8;
const SLOT1: u64 = 16;
const BLOCK_A: u64 = 24;
const BLOCK_B: u64 = 32;
/// A block word: key * 100 + value version.
const KEY: u64 = 7;

fn words(init: &[(u64, u64)]) -> Arc<LoomWords> {
    let w = LoomWords((0..6).map(|_| AtomicU64::new(0)).collect());
    for &(at, v) in init {
        w.store(at, v);
    }
    Arc::new(w)
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

#[test]
fn an_update_out_of_place_with_the_old_block_recycled_elsewhere() {
    model(|| {
        // Slot 0 points at block A holding (KEY, v1).
        let w = words(&[
            (CTRL, ControlWord::initial(0).0),
            (SLOT0, BLOCK_A),
            (BLOCK_A, KEY * 100 + 1),
        ]);
        let freed = Arc::new(AtomicU64::new(0));
        // The bucket's writer: new block B, slot to B, then A is freed.
        let (w1, f1) = (w.clone(), freed.clone());
        let writer = loom::thread::spawn(move || {
            let prev = lock(&*w1, CTRL);
            w1.store(BLOCK_B, KEY * 100 + 2);
            w1.store(SLOT0, BLOCK_B);
            unlock(&*w1, CTRL, prev, prev.seed());
            f1.store(1, Ordering::Release);
        });
        // A writer of another bucket reuses A for another key if it was
        // freed (the allocator hands it over: an acquire of the free).
        let (w2, f2) = (w.clone(), freed.clone());
        let recycler = loom::thread::spawn(move || {
            if f2.load(Ordering::Acquire) == 1 {
                w2.store(BLOCK_A, 999 * 100 + 1);
            }
        });
        // A GET of slot 0.
        let (_, block) = read(&*w, CTRL, || {
            let at = w.load(SLOT0);
            Ok::<_, ()>(w.load(at))
        })
        .unwrap();
        assert_eq!(block / 100, KEY, "a GET accepted another key's block");
        writer.join().unwrap();
        recycler.join().unwrap();
    });
}

/// Re-seeding moves the key from slot 0 to slot 1 and publishes seed 1; a
/// GET that accepts must see the layout of the seed it reports.
fn reseed_race(writer_locks: bool) {
    model(move || {
        let w = words(&[(CTRL, ControlWord::initial(0).0), (SLOT0, BLOCK_A)]);
        let w1 = w.clone();
        let writer = loom::thread::spawn(move || {
            if writer_locks {
                let prev = lock(&*w1, CTRL);
                w1.store(SLOT1, BLOCK_A);
                w1.store(SLOT0, 0);
                unlock(&*w1, CTRL, prev, 1);
            } else {
                // Broken: rewrites the bucket without taking the lock.
                let prev = ControlWord(w1.load(CTRL));
                w1.store(SLOT1, BLOCK_A);
                w1.store(SLOT0, 0);
                w1.store(CTRL, prev.next(1).0);
            }
        });
        let (c, (s0, s1)) =
            read(&*w, CTRL, || Ok::<_, ()>((w.load(SLOT0), w.load(SLOT1)))).unwrap();
        let ok = match c.seed() {
            0 => (s0, s1) == (BLOCK_A, 0),
            1 => (s0, s1) == (0, BLOCK_A),
            _ => false,
        };
        assert!(
            ok,
            "a mix of two layouts: seed {} with slots {s0}, {s1}",
            c.seed()
        );
        writer.join().unwrap();
    });
}

#[test]
fn a_reseed_is_seen_whole_or_not_at_all() {
    reseed_race(true);
}

#[test]
#[should_panic(expected = "a mix of two layouts")]
fn the_model_catches_a_writer_that_does_not_lock() {
    reseed_race(false);
}
