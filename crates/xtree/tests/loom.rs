#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! Loom model of the version protocol: a writer committing through
//! `protocol::commit` races a reader that loads the node word by word in
//! increasing address order (as the transport and RDMA do) and validates
//! with the same views clients use. An accepted image must be exactly one
//! committed state, never a mix.
//!
//! Run with `RUSTFLAGS="--cfg loom" cargo test -p dmkv-xtree --release --test loom`.

#![cfg(loom)]

use dmkv_xtree::layout::{Geometry, Header, Meta};
use dmkv_xtree::protocol::{NodeWords, commit, lock};
use dmkv_xtree::view::{KeysView, NodeView, ViewError, parse_slot_line};
use loom::sync::Arc;
use loom::sync::atomic::{AtomicU64, Ordering};

/// A tiny node (N = 4: two lines, 16 words) in loom atomics, with the
/// orderings of `RegionMem`: acquire loads, release stores, AcqRel CAS.
struct LoomNode {
    words: Vec<AtomicU64>,
}

impl NodeWords for LoomNode {
    fn load(&self, i: usize) -> u64 {
        self.words[i].load(Ordering::Acquire)
    }
    fn store(&self, i: usize, v: u64) {
        self.words[i].store(v, Ordering::Release)
    }
    fn cas(&self, i: usize, e: u64, n: u64) -> u64 {
        match self.words[i].compare_exchange(e, n, Ordering::AcqRel, Ordering::Acquire) {
            Ok(v) | Err(v) => v,
        }
    }
}

impl LoomNode {
    /// One read of words `first..first + n`, in increasing address order.
    fn read(&self, first: usize, n: usize) -> Vec<u8> {
        (first..first + n)
            .flat_map(|i| self.load(i).to_le_bytes())
            .collect()
    }
}

const KEY_BASE: u64 = 100;
const VALUE_BASE: u64 = 200;

/// State `s`: key 0 is `KEY_BASE + s` (line 0) and the value of slot 3 is
/// `VALUE_BASE + s` (line 1), so a mix of two states is visible.
fn changes(geo: &Geometry, s: u64) -> Vec<(usize, u64)> {
    vec![(geo.key(0), KEY_BASE + s), (geo.slot(3), VALUE_BASE + s)]
}

fn setup() -> (Geometry, Arc<LoomNode>) {
    let geo = Geometry::new(4).unwrap();
    assert_eq!(geo.lines(), 2);
    let node = LoomNode {
        words: (0..geo.node_words()).map(|_| AtomicU64::new(0)).collect(),
    };
    let x = lock(&node);
    let mut ch = changes(&geo, 0);
    ch.push((
        Geometry::HDR,
        Header {
            incarnation: 0,
            count: 4,
            next: 0,
        }
        .pack(),
    ));
    ch.push((Geometry::META, Meta::default().pack()));
    commit(&node, &geo, x, &ch);
    (geo, Arc::new(node))
}

fn model(f: impl Fn() + Sync + Send + 'static) {
    let mut b = loom::model::Builder::new();
    b.preemption_bound = Some(3);
    b.check(f);
}

#[test]
fn whole_node_reads_see_one_state() {
    model(|| {
        let (geo, node) = setup();
        let w = node.clone();
        let writer = loom::thread::spawn(move || {
            for s in 1..=2 {
                let x = lock(&*w);
                commit(&*w, &geo, x, &changes(&geo, s));
            }
        });
        let bytes = node.read(0, geo.node_words());
        match NodeView::parse(&geo, &bytes) {
            Ok(img) => {
                let s = img.keys.keys[0] - KEY_BASE;
                assert_eq!(img.slots[3], VALUE_BASE + s, "a mix of two states");
                assert_eq!(img.keys.version, s + 1, "state and version agree");
            }
            Err(e) => assert!(matches!(e, ViewError::Torn | ViewError::Locked), "{e}"),
        }
        writer.join().unwrap();
    });
}

#[test]
fn key_prefix_then_value_line_see_one_state() {
    // A lookup: the key lines plus V_1, then slot 3's line closed by T; the
    // value is accepted only if its line carries the keys' version.
    model(|| {
        let (geo, node) = setup();
        let w = node.clone();
        let writer = loom::thread::spawn(move || {
            let x = lock(&*w);
            commit(&*w, &geo, x, &changes(&geo, 1));
        });
        let ks = geo.key_span();
        let keys = node.read(0, ks.len(&geo) / 8);
        if let Ok(k) = KeysView::parse(&geo, ks, &keys) {
            let s = k.keys[0] - KEY_BASE;
            let span = geo.slot_span(3);
            let line = node.read(span.offset() / 8, span.len(&geo) / 8);
            match parse_slot_line(&geo, 3, k.version, &line) {
                Ok(v) => assert_eq!(v, VALUE_BASE + s, "value of another state"),
                Err(e) => assert!(matches!(e, ViewError::Torn | ViewError::Locked), "{e}"),
            }
        }
        writer.join().unwrap();
    });
}

/// A writer that stores each line's payload without locking the line first
/// and stores `T` last: the model must catch a reader accepting a mix.
fn broken_commit(w: &LoomNode, geo: &Geometry, x: u64, ch: &[(usize, u64)]) {
    let y = x + 1;
    for line in (0..geo.lines()).rev() {
        for &(i, v) in ch {
            if geo.line_of(i) == line {
                w.store(geo.payload_word(i), v);
            }
        }
        w.store(geo.version_word(line), y);
    }
    w.store(geo.trailer_word(), y);
}

#[test]
#[should_panic(expected = "a mix of two states")]
fn the_model_catches_a_writer_that_breaks_the_protocol() {
    model(|| {
        let (geo, node) = setup();
        let w = node.clone();
        let writer = loom::thread::spawn(move || {
            let x = lock(&*w);
            broken_commit(&w, &geo, x, &changes(&geo, 1));
        });
        let bytes = node.read(0, geo.node_words());
        if let Ok(img) = NodeView::parse(&geo, &bytes) {
            let s = img.keys.keys[0] - KEY_BASE;
            assert_eq!(img.slots[3], VALUE_BASE + s, "a mix of two states");
        }
        writer.join().unwrap();
    });
}
