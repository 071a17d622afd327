//! `btree-floor`: a `BTreeMap` in the compute process, behind the same API
//! wrapper, harness and executor as every engine but with no transport at
//! all. `dmkv bench --engine btree-floor,...` measures it in the same binary
//! and run as the designs, so their throughput and instructions per
//! operation can be quoted as ratios to this floor (issue 13). It is not a
//! design: nothing is remote, and with `--transport ucx` the map still lives
//! in the compute process.
//!
//! Values of up to [`INLINE_VALUE`] bytes (the papers' 8-byte values) are
//! stored inline in the map's leaves, as the designs store them in their
//! leaves and buckets; longer ones out of line. With every value in its own
//! heap block instead, a GET at 1M keys paid one more cache miss (the
//! block) after the leaf's: a floor that is slower than it need be flatters
//! every engine quoted against it (docs/performance.md, sixth pass).

use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvStore, Result, ServeArgs,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::{Endpoint, NodeId};
use parking_lot::RwLock;
use smallvec::SmallVec;
use std::collections::BTreeMap;
use std::rc::Rc;
use std::sync::Arc;

/// The spec of the floor.
pub struct BTreeFloor;

pub const CAPS: Capabilities = Capabilities {
    scan: true,
    max_value_len: 1 << 16,
    reserved_keys: &[],
    reserved_why: "",
};

/// Values up to this many bytes live inline in the map (a `SmallVec` of
/// this capacity takes no more room than a `Vec`: 24 bytes).
pub const INLINE_VALUE: usize = 16;

type Value = SmallVec<[u8; INLINE_VALUE]>;
type Map = Arc<RwLock<BTreeMap<Key, Value>>>;

impl EngineSpec for BTreeFloor {
    fn name(&self) -> &'static str {
        "btree-floor"
    }
    fn about(&self) -> &'static str {
        "a BTreeMap in the compute process, no transport: the floor other engines are quoted against"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        &[]
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn serve(&self, _rt: &Arc<NodeRuntime>, _args: &ServeArgs) -> Result<()> {
        // Nothing on the memory nodes: the map is the compute process's.
        Ok(())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        // The floor is no distributed design: its map is in the compute
        // process. Simulated compute nodes beyond the first (which connect
        // with `counters_from` set) read the first one's map, so that
        // `--compute-nodes N` still measures a lookup in one map.
        let map = match args.counting_into::<FloorEngine>() {
            Some(first) => first.map.clone(),
            None => Map::default(),
        };
        Ok(Arc::new(FloorEngine {
            map,
            compute: args.compute_node,
        }))
    }
}

struct FloorEngine {
    map: Map,
    compute: NodeId,
}

#[async_trait(?Send)]
impl Engine for FloorEngine {
    fn name(&self) -> &'static str {
        "btree-floor"
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }
    async fn client(&self, _ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(FloorClient {
            map: self.map.clone(),
        }))
    }
    async fn load(&self, _ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let mut m = self.map.write();
        for (k, v) in pairs {
            m.insert(*k, Value::from_slice(v));
        }
        Ok(())
    }
    async fn stats(&self, _ep: &Endpoint) -> Result<serde_json::Value> {
        Ok(serde_json::json!({ "keys": self.map.read().len() }))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}

struct FloorClient {
    map: Map,
}

#[async_trait(?Send)]
impl KvStore for FloorClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        Ok(self.map.read().get(&key).map(|v| v.to_vec()))
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        let mut m = self.map.write();
        if m.contains_key(&key) {
            return Ok(false);
        }
        m.insert(key, Value::from_slice(value));
        Ok(true)
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        Ok(match self.map.write().get_mut(&key) {
            Some(v) => {
                v.clear();
                v.extend_from_slice(value);
                true
            }
            None => false,
        })
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        Ok(self
            .map
            .write()
            .insert(key, Value::from_slice(value))
            .is_none())
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        Ok(self.map.write().remove(&key).is_some())
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        Ok(self
            .map
            .read()
            .range(start..)
            .take(n)
            .map(|(k, v)| (*k, v.to_vec()))
            .collect())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::oracle::{check_multi, check_single, op_strategy};
    use dmkv_api::deploy::{DeployOptions, LocalDeployment};
    use dmkv_transport::exec::block_on;
    use proptest::prelude::*;

    fn deploy(threads: usize) -> LocalDeployment {
        LocalDeployment::deploy(
            &BTreeFloor,
            &DeployOptions {
                threads,
                ..Default::default()
            },
        )
        .unwrap()
    }

    proptest! {
        #![proptest_config(ProptestConfig { cases: 16, ..ProptestConfig::default() })]
        #[test]
        fn the_floor_agrees_with_a_model(ops in prop::collection::vec(op_strategy(60, 200, true), 1..200)) {
            prop_assert_eq!(check_single(&deploy(1), &ops), Ok(()));
        }
    }

    #[test]
    fn inline_values_take_no_more_room_than_a_vec() {
        assert_eq!(std::mem::size_of::<Value>(), std::mem::size_of::<Vec<u8>>());
        let short = Value::from_slice(&[7; INLINE_VALUE]);
        assert!(!short.spilled());
        assert!(Value::from_slice(&[7; INLINE_VALUE + 1]).spilled());
    }

    #[test]
    fn values_on_both_sides_of_the_inline_limit_round_trip() {
        let dep = deploy(1);
        let (_, kv) = dep.client(0).unwrap();
        for (key, len) in [
            (1u64, 8usize),
            (2, INLINE_VALUE),
            (3, INLINE_VALUE + 1),
            (4, 300),
        ] {
            let v: Vec<u8> = (0..len).map(|i| (i as u8) ^ key as u8).collect();
            assert!(block_on(kv.insert(key, &v)).unwrap());
            assert_eq!(block_on(kv.get(key)).unwrap().as_deref(), Some(&v[..]));
            // Grow past the limit, then shrink below it.
            let long = vec![9u8; len + INLINE_VALUE];
            assert!(block_on(kv.update(key, &long)).unwrap());
            assert_eq!(block_on(kv.get(key)).unwrap(), Some(long));
            assert!(block_on(kv.update(key, &v[..1])).unwrap());
            assert_eq!(block_on(kv.get(key)).unwrap().as_deref(), Some(&v[..1]));
        }
    }

    #[test]
    fn clients_of_several_threads_share_one_map() {
        check_multi(&deploy(2), 2, 4, 150, 11).unwrap();
    }
}
