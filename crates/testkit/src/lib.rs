//! # dmkv-testkit: the test suites every engine runs
//!
//! - [`oracle`]: random operation sequences applied to an engine and to a
//!   `BTreeMap`, compared result by result (driven by proptest, so failures
//!   shrink), single- and multi-client.
//! - [`history`]: several threads x tasks racing writers against readers,
//!   with or without torn reads injected; every read is checked to return a
//!   value some write produced and never a value older than a write that
//!   completed before the read began.
//! - [`insert_race`]: several clients on several threads insert the same
//!   new keys at once; exactly one insert per key wins, the others see
//!   "exists", and the key holds the winner's value.
//! - [`bad_input`]: reserved keys, oversized values, scans where unsupported.
//! - [`declared`]: what engines declare to the simulated cluster's
//!   instruction term (a small simulated cluster; allocation RPCs).
//! - [`reference`]: a trivially correct engine to test the suites and the
//!   harness themselves.
//! - [`floor`]: `btree-floor`, a `BTreeMap` in the compute process with no
//!   transport, the floor the designs' costs are quoted against.

#![forbid(unsafe_code)]

pub mod bad_input;
pub mod declared;
pub mod floor;
pub mod history;
pub mod insert_race;
pub mod oracle;
pub mod reference;
