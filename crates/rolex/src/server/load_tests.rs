//! Invariant 14's order of writes, checked at the instant it matters: when
//! a bulk load is about to write the dead marks of the leaves it replaces,
//! every leaf it reuses must still be dead in memory (written live any
//! earlier, a reader whose cache still names it could find it live beside
//! the old leaf of its range). `tests/loads.rs` checks the answers readers
//! get; this checks the order itself, which a reader meets only by chance.
//!
//! With the reused leaves written together with the fresh ones (inside
//! `rebuild_into`, before the dead marks) this test fails.

use super::load::test_hooks::BEFORE_DEAD_MARKS;
use crate::config::names;
use crate::io::LeafId;
use crate::layout::leaf::{Leaf, LeafLayout};
use crate::remote::LEAF_BASE;
use dmkv_api::Key;
use dmkv_transport::exec::block_on;
use std::sync::{Arc, Mutex};

/// Takes the hook away however the test ends.
struct Unhook;

impl Drop for Unhook {
    fn drop(&mut self) {
        *BEFORE_DEAD_MARKS.lock().unwrap_or_else(|e| e.into_inner()) = None;
    }
}

#[test]
fn reused_leaves_are_still_dead_when_the_old_leaves_die() {
    let d = crate::local_test_deployment(&[("leaf_slots", "8"), ("load_model_keys", "32")]);
    let rt = &d.runtimes[0];
    let meta = rt.region(&d.args.name(names::META)).expect("meta").mem;
    let leaves = rt.region(&d.args.name(names::LEAVES)).expect("leaves").mem;
    let layout = LeafLayout::new(8);
    // (leaf, dead at the instant) for every reused leaf of this store.
    let seen: Arc<Mutex<Vec<(LeafId, bool)>>> = Arc::default();
    let _unhook = Unhook;
    {
        let seen = seen.clone();
        *BEFORE_DEAD_MARKS.lock().unwrap() = Some(Box::new(move |m, reborn| {
            // Other tests of this binary load stores of their own.
            if !Arc::ptr_eq(m, &meta) {
                return;
            }
            for id in reborn {
                let at = LEAF_BASE + id.leaf * layout.bytes() as u64;
                let bytes = leaves
                    .read_vec(at, layout.bytes())
                    .expect("leaf in its region");
                let dead = Leaf::decode(&layout, &bytes).expect("a whole image").dead;
                seen.lock().unwrap().push((*id, dead));
            }
        }));
    }
    // Ascending calls: each rewrites the last model (32 keys at most) and,
    // from the third on, reuses what the one before killed.
    let ep = d.endpoint(0);
    for c in 0..6u64 {
        let pairs: Vec<(Key, Vec<u8>)> = (c * 100..(c + 1) * 100)
            .map(|k| (k * 3 + 1, k.to_le_bytes().to_vec()))
            .collect();
        block_on(d.engine.load(&ep, &pairs)).expect("load");
    }
    let seen = seen.lock().unwrap();
    assert!(seen.len() >= 4, "too few leaves reused to test: {seen:?}");
    let live: Vec<_> = seen.iter().filter(|(_, dead)| !dead).collect();
    assert!(
        live.is_empty(),
        "reused leaves live before the old leaves died: {live:?}"
    );
}
