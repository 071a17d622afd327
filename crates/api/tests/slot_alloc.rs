//! An operation run in a [`FutureSlot`] allocates nothing once the slot has
//! grown, for an engine implementing [`KvClient`], also behind [`Checked`];
//! the boxed methods allocate one future per operation (what the harness
//! paid per operation before its tasks held slots).
//!
//! Allocations are counted per thread by a global allocator wrapping the
//! system's (this test binary only).

use dmkv_api::{Capabilities, Checked, FutureSlot, Key, KvClient, KvError, KvStore, Result};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::future::Future;
use std::pin::pin;
use std::rc::Rc;
use std::task::{Context, Poll, Waker};

#[global_allocator]
static GLOBAL: dmkv_alloc_count::Counting = dmkv_alloc_count::Counting;

use dmkv_alloc_count::allocs;

/// A map behind the native-`async fn` client trait.
struct Map(RefCell<BTreeMap<Key, Vec<u8>>>);

impl KvClient for Map {
    async fn get(&self, k: Key) -> Result<Option<Vec<u8>>> {
        Ok(self.0.borrow().get(&k).cloned())
    }
    async fn insert(&self, k: Key, v: &[u8]) -> Result<bool> {
        let mut m = self.0.borrow_mut();
        if m.contains_key(&k) {
            return Ok(false);
        }
        m.insert(k, v.to_vec());
        Ok(true)
    }
    async fn update(&self, k: Key, v: &[u8]) -> Result<bool> {
        Ok(self
            .0
            .borrow_mut()
            .get_mut(&k)
            .map(|x| *x = v.to_vec())
            .is_some())
    }
    async fn upsert(&self, k: Key, v: &[u8]) -> Result<bool> {
        Ok(self.0.borrow_mut().insert(k, v.to_vec()).is_none())
    }
    async fn delete(&self, k: Key) -> Result<bool> {
        Ok(self.0.borrow_mut().remove(&k).is_some())
    }
    async fn scan(&self, s: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        Ok(self
            .0
            .borrow()
            .range(s..)
            .take(n)
            .map(|(k, v)| (*k, v.clone()))
            .collect())
    }
}

/// Polls `f` once (every future here is ready at once) and returns its
/// output with the allocations made while it was built and polled.
fn once<T>(f: impl FnOnce() -> T) -> (T, u64) {
    let before = allocs();
    let out = f();
    (out, allocs() - before)
}

fn ready<F: Future>(f: F) -> F::Output {
    let mut f = pin!(f);
    match f.as_mut().poll(&mut Context::from_waker(Waker::noop())) {
        Poll::Ready(v) => v,
        Poll::Pending => panic!("these futures are ready at once"),
    }
}

#[test]
fn slot_operations_allocate_nothing_and_answer_as_the_boxed_ones() {
    let caps = Capabilities {
        scan: true,
        max_value_len: 64,
        reserved_keys: &[0],
        reserved_why: "empty slot",
    };
    let map = Rc::new(Map(RefCell::new(BTreeMap::new())));
    let kv: Rc<dyn KvStore> = Rc::new(Checked::new("map", caps, map));
    let mut slot = FutureSlot::new();
    // The first use grows the slot.
    assert!(ready(kv.insert_in(7, b"seven", &mut slot)).unwrap());
    let value = b"eight".to_vec();
    for round in 0..3 {
        // Absent keys and outcomes that return no bytes: nothing to allocate
        // but the future, which the slot holds.
        let (r, n) = once(|| ready(kv.get_in(1000 + round, &mut slot)));
        assert_eq!(r.unwrap(), None);
        assert_eq!(n, 0, "get_in allocated");
        let (r, n) = once(|| ready(kv.delete_in(2000, &mut slot)));
        assert!(!r.unwrap());
        assert_eq!(n, 0, "delete_in allocated");
        let (r, n) = once(|| ready(kv.update_in(3000, &value, &mut slot)));
        assert!(!r.unwrap());
        assert_eq!(n, 0, "update_in allocated");
        // The boxed form allocates its future.
        let (r, n) = once(|| ready(kv.get(1000 + round)));
        assert_eq!(r.unwrap(), None);
        assert_eq!(n, 1, "the boxed get allocates one future");
    }
    // Same answers as the boxed methods, and the same refusals.
    assert_eq!(
        ready(kv.get_in(7, &mut slot)).unwrap(),
        ready(kv.get(7)).unwrap()
    );
    assert!(!ready(kv.insert_in(7, b"x", &mut slot)).unwrap());
    assert!(ready(kv.upsert_in(9, b"nine", &mut slot)).unwrap());
    assert_eq!(
        ready(kv.scan_in(0, 10, &mut slot)).unwrap(),
        ready(kv.scan(0, 10)).unwrap()
    );
    assert!(matches!(
        ready(kv.get_in(0, &mut slot)),
        Err(KvError::ReservedKey { key: 0, .. })
    ));
    assert!(matches!(
        ready(kv.insert_in(5, &[0; 65], &mut slot)),
        Err(KvError::ValueTooLarge { len: 65, .. })
    ));
    assert!(ready(kv.scan_in(0, 0, &mut slot)).unwrap().is_empty());
}
