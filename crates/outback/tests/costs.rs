//! The paper's per-operation costs, from the transport's exact counters:
//! after a bulk load a GET is exactly one RPC and one round trip (no
//! one-sided verbs), the memory node's CPU per GET is measured, and the
//! compute node keeps about 2.33 + 2/ε bits per key.

mod common;

use dmkv_api::payload::{check_value, make_value};
use dmkv_testkit::oracle::spread_key;
use dmkv_transport::exec::block_on;
use dmkv_transport::{OpKind, labeled};

#[test]
fn a_get_is_one_rpc_and_the_locator_is_small() {
    for (lf, max_bits) in [("0.95", 5.5), ("0.85", 5.5)] {
        let mut knobs = dmkv_api::Knobs::new();
        knobs.set("load_factor", lf);
        let d = common::deploy_with(knobs, 1, 1);
        let ep = d.endpoint(0);
        const N: u64 = 30_000;
        let pairs: Vec<(u64, Vec<u8>)> = (0..N)
            .map(|i| (spread_key(i), make_value(spread_key(i), 0, 8)))
            .collect();
        block_on(d.engine.load(&ep, &pairs)).unwrap();
        let (cep, store) = d.client(0).unwrap();
        const GETS: u64 = 4000;
        cep.reset_counters();
        block_on(async {
            for i in 0..GETS {
                let k = spread_key((i * 7919) % N);
                let v = labeled(OpKind::Get, store.get(k)).await.unwrap().unwrap();
                assert_eq!(check_value(k, &v), Ok(0));
            }
        });
        let c = *cep.counters().get(OpKind::Get);
        assert_eq!((c.rpcs, c.round_trips, c.verbs), (GETS, GETS, 0), "{c:?}");
        // Reply: status, flags, seed, then key length, value length, key and
        // the 8-byte value; request: op, target (18 bytes), slot.
        assert_eq!(
            (c.bytes_read, c.bytes_written),
            (GETS * 35, GETS * 20),
            "{c:?}"
        );
        assert!(c.memnode_cpu_ns > 0);
        let present_cpu = c.memnode_cpu_ns / GETS;
        // Absent keys: one RPC each too (no overflow after a build).
        cep.reset_counters();
        block_on(async {
            for i in 0..GETS / 4 {
                let k = spread_key(N + i);
                assert_eq!(labeled(OpKind::Get, store.get(k)).await.unwrap(), None);
            }
        });
        let c = *cep.counters().get(OpKind::Get);
        assert_eq!(
            (c.rpcs, c.round_trips, c.verbs),
            (GETS / 4, GETS / 4, 0),
            "{c:?}"
        );
        let st = block_on(d.engine.stats(&ep)).unwrap();
        let bits = st["client_bits_per_key"].as_f64().unwrap();
        let load = st["load_factor"].as_f64().unwrap();
        println!(
            "load factor {load:.3}: {bits:.2} bits/key (paper {:.2}), {present_cpu} ns memnode CPU/GET",
            st["paper_bits_per_key"].as_f64().unwrap(),
        );
        assert!(
            bits <= max_bits && bits >= 4.0,
            "{bits} bits per key at ε={lf}"
        );
        let want: f64 = lf.parse().unwrap();
        assert!(
            (want - 0.01..=want + 0.001).contains(&load),
            "load factor {load} at ε={lf}"
        );
        assert_eq!(st["makeup_gets"].as_u64().unwrap(), 0, "{st}");
    }
}
