//! # dmkv-api: the client API and the engine interface
//!
//! An application talks to every dmkv design (XStore, ROLEX, Outback,
//! ScaleStore and the baselines) through one trait, [`KvStore`], on a
//! deployment of the design's [`Engine`] over some transport (in-process
//! `local`, simulated `sim`, or `ucx` across processes and hosts).
//!
//! ## Using dmkv as a library
//!
//! Two runnable examples in the `dmkv` repository walk through it:
//!
//! - `examples/in_process.rs` (`cargo run --release --example in_process
//!   [-- ENGINE,...]`): deploys engines in one process with
//!   [`deploy::LocalDeployment`], bulk-loads, then uses them from several
//!   threads and tasks;
//! - `examples/over_ucx.rs` (`--features ucx`): the same against `dmkv
//!   memnode` processes, with `dmkv_transport_ucx::deploy::UcxDeployment`.
//!
//! In short:
//!
//! ```text
//! let d = LocalDeployment::deploy(&dmkv_xstore::SPEC, &DeployOptions::default())?;
//! block_on(d.engine.load(&d.endpoint(0), &sorted_pairs))?;   // optional bulk load
//! let (_endpoint, kv) = d.client(thread)?;                   // one client per compute thread
//! block_on(async { kv.insert(42, b"value").await })?;        // tasks of that thread share it
//! ```
//!
//! ## The API
//!
//! - Keys ([`Key`]) are `u64`, as in the papers; values are byte strings up
//!   to [`Capabilities::max_value_len`].
//! - [`KvStore`] is a compute thread's handle (it is `!Send`: each thread
//!   asks the deployment for its own with `client(thread)`); its methods take
//!   `&self` and are `async`, so several tasks of the thread
//!   ([`dmkv_transport::exec::run_tasks`]) run operations at once and overlap
//!   their network waits, like the papers' coroutines.
//! - `get(k)` → `Ok(Some(value))` or `Ok(None)` (not found);
//!   `insert(k, v)` → `Ok(true)` if inserted, `Ok(false)` if `k` exists
//!   (nothing changed; of several concurrent inserts of one new key exactly
//!   one returns `true`); `update(k, v)` → `Ok(false)` if `k` is missing;
//!   `upsert(k, v)` → `Ok(true)` if `k` was new; `delete(k)` → `Ok(false)` if
//!   `k` was missing; `scan(start, n)` → up to `n` pairs with key ≥ `start`,
//!   in key order.
//!
//! ## Errors
//!
//! Expected outcomes (not found, exists) are results, as above. [`KvError`]
//! is for everything else:
//!
//! | variant | when | what to do |
//! |---|---|---|
//! | [`KvError::ReservedKey`] | a key the engine reserves (an empty-slot marker, a fence) | use another key; [`Capabilities::reserved_keys`] lists them |
//! | [`KvError::ValueTooLarge`] | a value over [`Capabilities::max_value_len`] | split it or pick an engine/knob with a larger limit |
//! | [`KvError::Unsupported`] | `scan` on an engine without ordered scans (hash designs) | check [`Capabilities::scan`] first |
//! | [`KvError::Exhausted`] | a memory node's region or pool is full | deploy with more memory (`expected_keys`, pool size) or more memory nodes |
//! | [`KvError::Config`] | bad deployment options or knobs (unknown knob, value out of range) | fix the options; the message names the accepted range |
//! | [`KvError::Corrupt`] | remote data failed validation even after retries | a bug or a broken node: report it |
//! | [`KvError::Transport`] | the network failed: a node down, a timeout, an access refused | retry or fail over; the store's state for that operation is unknown |
//!
//! Bad input (reserved keys, oversized values, unsupported scans) is caught
//! by [`Checked`], which wraps every client a deployment hands out, before
//! anything reaches the engine or the network.
//!
//! ## Capabilities
//!
//! [`Engine::capabilities`] (or [`EngineSpec::capabilities`], before
//! deploying) says what a design offers: `scan` (ordered designs: xstore,
//! rolex, scalestore, btree-local, rpc-btree, cell, sherman; not the hash
//! designs outback, race, rpc-hash), the largest value, and the reserved
//! keys. Asking is cheaper than catching [`KvError::Unsupported`], but both
//! work:
//!
//! ```
//! use dmkv_api::{Capabilities, KvError, KvStore};
//!
//! /// What `examples/in_process.rs` does with any store.
//! async fn basics(kv: &dyn KvStore, caps: &Capabilities) -> Result<(), KvError> {
//!     assert_eq!(kv.get(15).await?, None); // not found: a result
//!     assert!(kv.insert(15, b"fifteen").await?); // inserted
//!     assert!(!kv.insert(15, b"again").await?); // exists: a result
//!     assert!(kv.update(15, b"FIFTEEN").await?);
//!     assert!(!kv.update(16, b"x").await?); // missing: not updated
//!     assert!(kv.upsert(16, b"16").await?); // was new
//!     assert!(kv.delete(16).await?);
//!     assert_eq!(kv.get(15).await?.as_deref(), Some(&b"FIFTEEN"[..]));
//!     let too_big = vec![0; caps.max_value_len + 1];
//!     assert!(matches!(
//!         kv.insert(17, &too_big).await,
//!         Err(KvError::ValueTooLarge { .. })
//!     ));
//!     if let Some(&k) = caps.reserved_keys.first() {
//!         assert!(matches!(kv.get(k).await, Err(KvError::ReservedKey { .. })));
//!     }
//!     match kv.scan(10, 3).await {
//!         Ok(pairs) => assert!(caps.scan && pairs.len() <= 3),
//!         Err(KvError::Unsupported { .. }) => assert!(!caps.scan),
//!         Err(e) => return Err(e),
//!     }
//!     Ok(())
//! }
//! # // A stand-in engine (a map behind `Checked`), so that this runs here.
//! # use async_trait::async_trait;
//! # use dmkv_api::{Checked, Key, Result};
//! # use std::cell::RefCell;
//! # use std::collections::BTreeMap;
//! # use std::rc::Rc;
//! # struct Map(RefCell<BTreeMap<Key, Vec<u8>>>);
//! # #[async_trait(?Send)]
//! # impl KvStore for Map {
//! #     async fn get(&self, k: Key) -> Result<Option<Vec<u8>>> { Ok(self.0.borrow().get(&k).cloned()) }
//! #     async fn insert(&self, k: Key, v: &[u8]) -> Result<bool> {
//! #         let mut m = self.0.borrow_mut();
//! #         if m.contains_key(&k) { return Ok(false) }
//! #         m.insert(k, v.to_vec()); Ok(true)
//! #     }
//! #     async fn update(&self, k: Key, v: &[u8]) -> Result<bool> {
//! #         Ok(self.0.borrow_mut().get_mut(&k).map(|x| *x = v.to_vec()).is_some())
//! #     }
//! #     async fn upsert(&self, k: Key, v: &[u8]) -> Result<bool> { Ok(self.0.borrow_mut().insert(k, v.to_vec()).is_none()) }
//! #     async fn delete(&self, k: Key) -> Result<bool> { Ok(self.0.borrow_mut().remove(&k).is_some()) }
//! #     async fn scan(&self, s: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
//! #         Ok(self.0.borrow().range(s..).take(n).map(|(k, v)| (*k, v.clone())).collect())
//! #     }
//! # }
//! # for scan in [true, false] {
//! #     let caps = Capabilities { scan, max_value_len: 64, reserved_keys: &[0], reserved_why: "empty slot" };
//! #     let kv = Checked::new("map", caps.clone(), Rc::new(Map(RefCell::new(BTreeMap::new()))));
//! #     dmkv_transport::exec::block_on(basics(&kv, &caps)).unwrap();
//! # }
//! ```
//!
//! ## Parts of this crate
//!
//! - [`KvStore`]: what applications call, per compute thread: `get`,
//!   `insert` (fails on an existing key), `update` (fails on a missing key),
//!   `upsert`, `delete`, `scan`. Expected outcomes (not found, exists) are
//!   results; [`KvError`] is for transport failures, bad input and exhausted
//!   resources.
//! - [`Engine`] and [`EngineSpec`]: how a design plugs in. A spec installs
//!   the design's server side on each memory node ([`EngineSpec::serve`],
//!   through the node's [`NodeRuntime`](dmkv_memnode::NodeRuntime)) and
//!   connects a compute process to it ([`EngineSpec::connect`]); the engine
//!   then hands each compute thread a [`KvStore`].
//! - [`KvClient`]: what an engine's client implements (the six operations
//!   as plain `async fn`s); every `KvClient` is a `KvStore`, whose `*_in`
//!   methods run an operation's future in a caller's [`FutureSlot`] without
//!   allocating (the harness keeps one slot per task).
//! - [`Checked`]: the input validation every engine gets for free (reserved
//!   keys, value limits, scan capability).
//! - [`Knobs`]: typed `--set engine.knob=value` settings
//!   ([`DeployOptions::knobs`](deploy::DeployOptions::knobs)).
//! - [`checksum64`]: the checksum layouts use to detect torn one-sided reads.
//! - [`deploy`]: an engine on a fresh in-process cluster (applications,
//!   benchmarks, tests); [`sim_deploy`]: on the simulator.
//! - [`payload`]: self-checking values derived from a key and a version.

#![forbid(unsafe_code)]

mod checked;
mod checksum;
pub mod deploy;
mod engine;
mod error;
pub mod fetch_gate;
mod knobs;
pub mod payload;
mod range_partitions;
pub mod sim_deploy;
mod store;

pub use checked::Checked;
pub use checksum::{checksum64, checksum64_concat};
pub use dmkv_transport::{FutureSlot, SlotFuture};
pub use engine::{ConnectArgs, Engine, EngineSpec, ServeArgs, Topology};
pub use error::{KvError, Result};
pub use knobs::{KnobSpec, Knobs};
pub use range_partitions::RangePartitions;
pub use store::{Capabilities, Key, KvClient, KvStore};
