//! The suites run on the reference engine (they must pass) and on broken
//! stores (they must fail), so that a passing suite means something.

use async_trait::async_trait;
use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::{Key, KvStore, Result};
use dmkv_testkit::bad_input::{check_api_input, check_garbage_rpcs};
use dmkv_testkit::history::{RaceConfig, race, race_on};
use dmkv_testkit::oracle::{Op, apply, check_multi, check_single, op_strategy};
use dmkv_testkit::reference::{CAPS, Reference};
use dmkv_transport::exec::block_on;
use proptest::prelude::*;
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap};
use std::rc::Rc;

fn deploy() -> LocalDeployment {
    LocalDeployment::deploy(&Reference, &DeployOptions::default()).unwrap()
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(ops in prop::collection::vec(op_strategy(40, 100, true), 1..150)) {
        let d = deploy();
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client() {
    let d = LocalDeployment::deploy(
        &Reference,
        &DeployOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    check_multi(&d, 2, 3, 200, 7).unwrap();
}

#[test]
fn race_with_and_without_torn_reads() {
    for torn in [false, true] {
        let d = deploy();
        let r = race(
            &d,
            &RaceConfig {
                torn_reads: torn,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(r.writes > 0 && r.reads > 0 && r.scans > 0, "{r:?}");
    }
}

#[test]
fn bad_input_is_refused() {
    let d = deploy();
    check_api_input(&d).unwrap();
    check_garbage_rpcs(&d, 50, 3).unwrap();
}

/// A store that remembers the first value it read of every key and returns
/// it forever: stale reads.
struct Stale {
    inner: Rc<dyn KvStore>,
    seen: RefCell<HashMap<Key, Option<Vec<u8>>>>,
}

#[async_trait(?Send)]
impl KvStore for Stale {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        if let Some(v) = self.seen.borrow().get(&key) {
            return Ok(v.clone());
        }
        let v = self.inner.get(key).await?;
        self.seen.borrow_mut().insert(key, v.clone());
        Ok(v)
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.inner.insert(key, value).await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.inner.update(key, value).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.inner.upsert(key, value).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        self.inner.delete(key).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        self.inner.scan(start, n).await
    }
}

#[test]
fn the_oracle_catches_a_stale_store() {
    let d = deploy();
    let (_ep, store) = d.client(0).unwrap();
    let stale = Stale {
        inner: store,
        seen: RefCell::new(HashMap::new()),
    };
    let ops = [Op::Get(5), Op::Insert(5, vec![1; 8]), Op::Get(5)];
    let res = block_on(async {
        let mut model = BTreeMap::new();
        for op in &ops {
            apply(&stale, &mut model, &CAPS, op).await?;
        }
        Ok::<_, String>(())
    });
    assert!(res.unwrap_err().contains("Get(5)"));
}

#[test]
fn the_race_checker_catches_a_stale_store() {
    let d = deploy();
    let res = race_on(&d, &RaceConfig::default(), &|t| {
        let (_ep, store) = d.client(t).map_err(|e| e.to_string())?;
        Ok(Rc::new(Stale {
            inner: store,
            seen: RefCell::new(HashMap::new()),
        }) as Rc<dyn KvStore>)
    });
    let e = res.unwrap_err();
    assert!(e.contains("read of key"), "{e}");
}

#[test]
fn insert_race_with_and_without_torn_reads() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for torn in [false, true] {
        let d = LocalDeployment::deploy(
            &Reference,
            &DeployOptions {
                threads: 3,
                ..Default::default()
            },
        )
        .unwrap();
        let r = insert_race(
            &d,
            &InsertRaceConfig {
                torn_reads: torn,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(r.keys, 12 * 32);
    }
}

/// A store whose insert is a blind write that always reports success: the
/// bug the insert race exists to catch.
struct BlindInsert(Rc<dyn KvStore>);

#[async_trait(?Send)]
impl KvStore for BlindInsert {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        self.0.get(key).await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.0.upsert(key, value).await.map(|_| true)
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.0.update(key, value).await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.0.upsert(key, value).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        self.0.delete(key).await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        self.0.scan(start, n).await
    }
}

#[test]
fn the_insert_race_catches_two_winners() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race_on};
    let d = LocalDeployment::deploy(
        &Reference,
        &DeployOptions {
            threads: 2,
            ..Default::default()
        },
    )
    .unwrap();
    let cfg = InsertRaceConfig {
        threads: 2,
        rounds: 1,
        ..Default::default()
    };
    let e = insert_race_on(&d, &cfg, &|t| {
        let (_ep, store) = d.client(t).map_err(|e| e.to_string())?;
        Ok(Rc::new(BlindInsert(store)) as Rc<dyn KvStore>)
    })
    .unwrap_err();
    assert!(e.contains("concurrent inserts succeeded"), "{e}");
}
