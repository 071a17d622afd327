//! §3.5's per-worker mailboxes against our transport RPCs, on the simulated
//! cluster (docs/scalestore.md, "Mailboxes or RPCs"): one requester sends
//! `N` 64-byte messages one after another to one node and waits for each
//! 64-byte answer.
//!
//! - RPC (what we do): `ep.call` of a handler that answers 64 bytes at
//!   once. Measured: latency per message, and the target's handler-core
//!   busy time per message (`sim.resources()`).
//! - Mailbox (the paper): the message is a 64-byte one-sided write into the
//!   target's mailbox and the answer a 64-byte one-sided write back. The sim
//!   has no polling thread, so the example measures the two writes (each
//!   `ep.write` completes when the NIC acknowledges it; the write lands
//!   half a round trip earlier) and adds, from the profile's own
//!   parameters, the poll (`memnode.line_ns` per cache line read: a handler
//!   sweeping `M` mailboxes finds a message after half a sweep on average,
//!   and reads one line per message it finds) and the handler's post of the
//!   answer write (`client.cpu_per_verb_ns`, what any core pays to post a
//!   verb in the model; an RPC's reply is inside `rpc_base_ns`).
//!
//! Usage: `cargo run --release -p dmkv-scalestore --example mailbox_cost
//! [PROFILE] [MAILBOXES...]` (default scalestore-cx5; 10 40 160 mailboxes:
//! 2 workers x 5 nodes, 8 x 5, 32 x 5).

use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimConfig, Simulation};
use dmkv_transport::time::Instant;
use dmkv_transport::{NodeHost, RpcContext};
use std::sync::Arc;

const N: u64 = 2000;
const MSG: usize = 64;

fn sim(profile: &Profile) -> Simulation {
    Simulation::new(SimConfig {
        profile: profile.clone(),
        seed: 1,
        jitter_ns: 0,
        delays: Default::default(),
    })
}

/// Latency per call and handler-core ns per call of `N` sequential RPCs.
fn rpc(profile: &Profile) -> (f64, f64) {
    let sim = sim(profile);
    let server = sim.add_node(1);
    let client = sim.add_node(0).id();
    let svc = server
        .services()
        .register(
            "answer",
            Arc::new(|_: &RpcContext, _: &[u8]| Ok(vec![0u8; MSG])),
        )
        .unwrap();
    let ep = sim.fabric().endpoint(client).unwrap();
    let t0 = Instant::now();
    block_on(async {
        for _ in 0..N {
            ep.call(server.id(), svc, vec![0u8; MSG]).await.unwrap();
        }
    });
    let took = (Instant::now() - t0).as_nanos() as f64;
    let core = sim
        .resources()
        .into_iter()
        .find(|r| r.name.contains("handler"))
        .expect("the server's handler cores");
    assert_eq!(core.count, N, "one handler job per call");
    (took / N as f64, core.busy_ns as f64 / N as f64)
}

/// Completion time of one 64-byte one-sided write (`N` in sequence), and
/// handler-core busy ns per write (none: the NIC does it).
fn write(profile: &Profile) -> (f64, f64) {
    let sim = sim(profile);
    let server = sim.add_node(1);
    let client = sim.add_node(0).id();
    let (region, _mem) = server.register_region(4096).unwrap();
    let ep = sim.fabric().endpoint(client).unwrap();
    let t0 = Instant::now();
    block_on(async {
        for _ in 0..N {
            ep.write(region.at(0), &[1u8; MSG]).await.unwrap();
        }
    });
    let took = (Instant::now() - t0).as_nanos() as f64;
    let busy: u64 = sim
        .resources()
        .iter()
        .filter(|r| r.name.contains("handler"))
        .map(|r| r.busy_ns)
        .sum();
    (took / N as f64, busy as f64 / N as f64)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let name = args.next().unwrap_or_else(|| "scalestore-cx5".into());
    let profile = Profile::load(&name).unwrap_or_else(|e| panic!("{e}"));
    let mut boxes: Vec<u64> = args.map(|a| a.parse().expect("a mailbox count")).collect();
    if boxes.is_empty() {
        boxes = vec![10, 40, 160];
    }
    let line = profile.memnode.line_ns as f64;
    let (rpc_lat, rpc_cpu) = rpc(&profile);
    let (w_lat, w_cpu) = write(&profile);
    println!(
        "profile {name}: one_way_ns {}, rpc_base_ns {}, line_ns {}",
        profile.network.one_way_ns, profile.memnode.rpc_base_ns, profile.memnode.line_ns
    );
    println!("measured on sim, {N} sequential 64-byte messages:");
    println!(
        "  RPC (64 B request, 64 B reply): {rpc_lat:.0} ns per message, receiver handler core {rpc_cpu:.0} ns per message"
    );
    println!(
        "  one-sided 64 B write:           {w_lat:.0} ns to completion, receiver handler core {w_cpu:.0} ns"
    );
    // A message and its answer are two writes, each landing half a round
    // trip after its post: together one write's completion (measured: one
    // post, two wire trips, four NIC passes) plus the handler's post of
    // the answer, plus the polls.
    let post = profile.client.cpu_per_verb_ns as f64;
    for m in boxes {
        let detect = m as f64 * line / 2.0;
        println!(
            "  mailbox, {m:>3} mailboxes per handler: ~{:.0} ns per message (write {w_lat:.0} + answer post {post:.0} + half a sweep {detect:.0}); receiver CPU {:.0} ns per message (line read {line:.0} + answer post {post:.0}), plus its core polls when idle",
            w_lat + post + detect,
            line + post
        );
    }
}
