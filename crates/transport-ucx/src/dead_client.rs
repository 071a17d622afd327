//! Regression test: a client process killed in the middle of a
//! shared-memory send leaves the node serving new clients.
//!
//! UCX's shared-memory transports (`sysv`, `posix`) deliver active messages
//! through one FIFO per receiving worker that every sender writes into: a
//! sender reserves the next element (a compare-and-swap on the FIFO's
//! head), copies its message into it, then flips the element's owner flag;
//! the receiver reads elements strictly in order and waits for the flag. A
//! sender killed between the reservation and the flag leaves an element
//! that is never marked written, and the receiving worker delivers nothing
//! after it, from anyone, ever. The child here dies exactly there (a
//! generic datatype whose pack callback, called by UCX inside the send,
//! kills the process), so the test fails every time on a node whose
//! clients share its workers' FIFOs (docs/ucx.md, *A killed client's FIFO
//! slot*).

use crate::client::open_session;
use crate::ffi::Worker;
use crate::server::{AM_REQUEST, REQUEST_HEADER};
use crate::{UcxCluster, UcxConfig};
use dmkv_transport::exec::block_on;
use dmkv_transport::{NodeHost, NodeId, RpcContext, ServiceError, WireWriter};
use std::os::unix::process::ExitStatusExt;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const CHILD_ENV: &str = "DMKV_UCX_DEAD_SENDER";
const SECRET: &[u8] = b"dead-sender";

/// Exit codes of a child that did not die where it should have.
const NOT_SHM: i32 = 3;
const NEVER_PACKED: i32 = 4;

/// Not a test of its own: the client process that
/// `a_client_killed_inside_a_shared_memory_send_leaves_the_node_serving`
/// starts. It opens a session like any client, connects to the node's
/// handler worker over shared memory and dies inside an RPC's send.
#[test]
fn dead_sender_child() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let (addr, service) = spec.split_once(';').expect("addr;service");
    let service: u32 = service.parse().unwrap();
    let c = UcxCluster::new(UcxConfig::shm_loopback(SECRET), NodeId(50)).unwrap();
    let node = c.connect(addr).unwrap();
    let peer = c.inner.peer(node).unwrap();
    let worker = Worker::new(&c.inner.ctx).unwrap();
    let s = open_session(&peer, &worker.address().unwrap()).unwrap();
    let (ep, shm) = crate::shm::connect(&worker, &s.handler_addresses[0], &s.node_host).unwrap();
    if !shm {
        std::process::exit(NOT_SHM);
    }
    let mut h = WireWriter::with_capacity(REQUEST_HEADER);
    h.u32(s.session).u64(s.token).u64(1).u32(service).u16(50);
    // Small enough for one FIFO element (a single copy).
    let op = ep.am_send_killed_mid_copy(AM_REQUEST, h.finish(), 100);
    // UCX packs at once unless the send was queued: drive it a while.
    let deadline = Instant::now() + Duration::from_secs(10);
    while Instant::now() < deadline {
        worker.progress();
    }
    drop(op);
    std::process::exit(NEVER_PACKED);
}

fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_client_killed_inside_a_shared_memory_send_leaves_the_node_serving() {
    // A lost request shows up as a timeout: 5 s is ample on loopback.
    let config = || UcxConfig {
        rpc_timeout: Duration::from_secs(5),
        ..UcxConfig::shm_loopback(SECRET)
    };
    let sc = UcxCluster::new(config(), NodeId(100)).unwrap();
    let node = sc
        .serve(NodeId(0), "127.0.0.1:0".parse().unwrap(), 1)
        .unwrap();
    let delivered = Arc::new(AtomicU64::new(0));
    let d = delivered.clone();
    let counted = node
        .services()
        .register(
            "counted",
            Arc::new(move |_: &RpcContext, _: &[u8]| {
                d.fetch_add(1, Ordering::Relaxed);
                Ok::<_, ServiceError>(Vec::new())
            }),
        )
        .unwrap();
    node.services()
        .register(
            "echo",
            Arc::new(|_: &RpcContext, r: &[u8]| Ok::<_, ServiceError>(r.to_vec())),
        )
        .unwrap();
    let status = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "dead_client::dead_sender_child",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_ENV, format!("{};{}", node.listen_addr(), counted.0))
        .stdout(Stdio::null())
        .status()
        .unwrap();
    assert_eq!(
        (status.signal(), status.code()),
        (Some(libc::SIGKILL), None),
        "the child must die inside its send ({NOT_SHM}: no shared-memory endpoint, \
         {NEVER_PACKED}: UCX never packed the message)"
    );
    eventually("the node notices the client is gone", || {
        node.connected_processes() == 0
    });
    // A new client process (here: a new UCX context) is served, RPCs
    // included.
    let other = UcxCluster::new(config(), NodeId(60)).unwrap();
    other.connect(node.listen_addr()).unwrap();
    let ep = other.fabric().endpoint(NodeId(60)).unwrap();
    let svc = block_on(ep.lookup_service(NodeId(0), "echo")).unwrap();
    for i in 0..20u8 {
        assert_eq!(block_on(ep.call(NodeId(0), svc, vec![i])).unwrap(), vec![i]);
    }
    // The killed send was never completed, so never delivered.
    assert_eq!(delivered.load(Ordering::Relaxed), 0);
}
