#![allow(clippy::disallowed_methods)] // tests and examples use real threads and clocks
//! `btree-local` against the shared suites: oracle (single and multi
//! client), races with and without torn reads, bad input.

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_scalestore::BTREE_LOCAL;
use dmkv_testkit::bad_input::check_api_input;
use dmkv_testkit::history::{RaceConfig, race};
use dmkv_testkit::oracle::{check_multi, check_single, op_strategy};
use proptest::prelude::*;

fn deploy(threads: usize) -> LocalDeployment {
    arm_watchdog();
    LocalDeployment::deploy(
        &BTREE_LOCAL,
        &DeployOptions {
            threads,
            ..Default::default()
        },
    )
    .unwrap()
}

/// No test may hang CI: the first deployment arms a watchdog that aborts
/// the whole test binary (with a message) if it is still running after
/// `SCALESTORE_TEST_DEADLINE` seconds (default 300; the file normally takes
/// seconds). A hang then fails fast instead of eating CI's time limit.
fn arm_watchdog() {
    static ARMED: std::sync::Once = std::sync::Once::new();
    ARMED.call_once(|| {
        let secs: u64 = std::env::var("SCALESTORE_TEST_DEADLINE")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(300);
        std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_secs(secs));
            // Straight to stderr: `eprintln!` would be captured by the test.
            use std::io::Write;
            let _ = writeln!(
                std::io::stderr(),
                "{}: tests still running after {secs} s: aborting (a hang)",
                file!()
            );
            std::process::abort();
        });
    });
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 24, ..ProptestConfig::default() })]
    #[test]
    fn oracle_single_client(ops in prop::collection::vec(op_strategy(400, 1024, true), 1..400)) {
        let d = deploy(1);
        prop_assert_eq!(check_single(&d, &ops), Ok(()));
    }
}

#[test]
fn oracle_multi_client() {
    let d = deploy(2);
    check_multi(&d, 2, 3, 400, 11).unwrap();
}

#[test]
fn races_with_and_without_torn_reads() {
    for torn in [false, true] {
        let d = deploy(2);
        let r = race(
            &d,
            &RaceConfig {
                torn_reads: torn,
                keys: 400,
                loaded: 300,
                value_len: 200,
                ..Default::default()
            },
        )
        .unwrap();
        assert!(r.writes > 0 && r.reads > 0 && r.scans > 0, "{r:?}");
    }
}

#[test]
fn bad_input_is_refused() {
    check_api_input(&deploy(1)).unwrap();
}

#[test]
fn concurrent_inserts_of_one_new_key_have_exactly_one_winner() {
    use dmkv_testkit::insert_race::{InsertRaceConfig, insert_race};
    for torn in [false, true] {
        let d = deploy(3);
        let cfg = InsertRaceConfig {
            torn_reads: torn,
            ..Default::default()
        };
        let r = insert_race(&d, &cfg).unwrap_or_else(|e| panic!("torn={torn}: {e}"));
        assert_eq!(r.keys, (cfg.rounds * cfg.keys_per_round) as u64);
    }
}
