//! What the UCX backend adds to the contract: the cluster secret, which data
//! path each transport takes, the progress thread's CPU in the node's stats,
//! and memory nodes that survive clients killed mid-operation.

#![cfg(feature = "ucx")]

use dmkv_memnode::{NodeRuntime, NodeStats};
use dmkv_transport::exec::block_on;
use dmkv_transport::{NodeHost, NodeId, RpcContext, ServiceError, TransportError};
use dmkv_transport_ucx::{UcxCluster, UcxConfig, UcxNode};
use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

fn serve(config: UcxConfig) -> (UcxCluster, Arc<UcxNode>) {
    let c = UcxCluster::new(config, NodeId(100)).unwrap();
    let n = c
        .serve(NodeId(0), "127.0.0.1:0".parse().unwrap(), 1)
        .unwrap();
    (c, n)
}

fn echo(_: &RpcContext, r: &[u8]) -> Result<Vec<u8>, ServiceError> {
    Ok(r.to_vec())
}

/// Polls `f` until it holds (or fails the test after 20 s): for effects of
/// other threads and processes, never for timing.
fn eventually(what: &str, mut f: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !f() {
        assert!(Instant::now() < deadline, "never happened: {what}");
        std::thread::sleep(Duration::from_millis(5));
    }
}

#[test]
fn a_client_without_the_secret_is_refused() {
    let (_sc, node) = serve(UcxConfig::tcp_loopback("the right secret"));
    let intruder = UcxCluster::new(UcxConfig::tcp_loopback("a wrong secret"), NodeId(7)).unwrap();
    let e = intruder.connect(node.listen_addr()).unwrap_err();
    assert!(e.to_string().contains("secret"), "{e}");
    assert_eq!(node.connected_processes(), 0);
    // The node still serves clients that know the secret.
    let client = UcxCluster::new(UcxConfig::tcp_loopback("the right secret"), NodeId(8)).unwrap();
    assert_eq!(client.connect(node.listen_addr()).unwrap(), NodeId(0));
    eventually("the client is connected", || {
        node.connected_processes() == 1
    });
}

fn read_a_region(config: fn(Vec<u8>) -> UcxConfig) -> dmkv_transport_ucx::UcxStats {
    let (_sc, node) = serve(config(b"s".to_vec()));
    let (region, mem) = node.register_region(4096).unwrap();
    mem.write(0, &[3; 64]).unwrap();
    let client = UcxCluster::new(config(b"s".to_vec()), NodeId(1)).unwrap();
    client.connect(node.listen_addr()).unwrap();
    let ep = client.fabric().endpoint(NodeId(1)).unwrap();
    block_on(async {
        for _ in 0..10 {
            assert_eq!(ep.read(region.at(0), 64).await.unwrap(), vec![3; 64]);
        }
    });
    client.stats()
}

#[test]
fn shared_memory_maps_regions_and_tcp_posts_verbs() {
    let s = read_a_region(UcxConfig::shm_loopback);
    assert_eq!((s.direct_verbs, s.posted_verbs), (10, 0), "{s:?}");
    // Both UCX endpoints of the session (to the node's progress worker and
    // to its one handler worker) go through shared memory only: with UCX's
    // peer-failure handling they would be tcp on loopback.
    assert_eq!((s.shm_endpoints, s.checked_endpoints), (2, 0), "{s:?}");
    let s = read_a_region(UcxConfig::tcp_loopback);
    assert_eq!(
        (s.direct_verbs, s.posted_verbs, s.message_verbs),
        (0, 0, 10),
        "{s:?}"
    );
    // Without shared memory in `UCX_TLS`, UCX detects a dead peer itself.
    assert_eq!((s.shm_endpoints, s.checked_endpoints), (0, 2), "{s:?}");
    // One session and one key fetch, however many verbs.
    assert_eq!((s.sessions, s.rkey_fetches), (1, 1), "{s:?}");
}

#[test]
fn the_progress_threads_cpu_is_in_the_node_stats() {
    let (_sc, node) = serve(UcxConfig::tcp_loopback(b"s".to_vec()));
    let rt = NodeRuntime::new(node.clone());
    let region = rt.register_region("r", 4096).unwrap();
    let client = UcxCluster::new(UcxConfig::tcp_loopback(b"s".to_vec()), NodeId(1)).unwrap();
    client.connect(node.listen_addr()).unwrap();
    let ep = client.fabric().endpoint(NodeId(1)).unwrap();
    let svc = block_on(ep.lookup_service(NodeId(0), NodeRuntime::STATS_SERVICE)).unwrap();
    // Over TCP the node's progress thread serves every emulated verb.
    block_on(async {
        for i in 0..200u64 {
            ep.write(region.remote.at(0), &i.to_le_bytes())
                .await
                .unwrap();
            ep.read(region.remote.at(0), 8).await.unwrap();
        }
    });
    eventually("the progress thread reports CPU time", || {
        let s = NodeStats::decode(&block_on(ep.call(NodeId(0), svc, vec![])).unwrap()).unwrap();
        s.progress_cpu_ns > 0
    });
}

const CHILD_ENV: &str = "DMKV_UCX_TEST_CHILD";

/// Not a test of its own: the body of the client process that
/// `a_killed_client_leaves_the_node_serving` starts and kills.
#[test]
fn child_client() {
    let Ok(spec) = std::env::var(CHILD_ENV) else {
        return;
    };
    let mut parts = spec.split(';');
    let (tls, addr, region, key) = (
        parts.next().unwrap().to_string(),
        parts.next().unwrap().to_string(),
        parts.next().unwrap().parse::<u32>().unwrap(),
        parts.next().unwrap().parse::<u64>().unwrap(),
    );
    let config = UcxConfig {
        tls: Some(tls),
        net_devices: Some("lo".into()),
        ..UcxConfig::new(b"kill-test".to_vec())
    };
    let c = UcxCluster::new(config, NodeId(50)).unwrap();
    let node = c.connect(addr.as_str()).unwrap();
    let ep = c.fabric().endpoint(NodeId(50)).unwrap();
    let region = dmkv_transport::RemoteRegion {
        node,
        id: dmkv_transport::RegionId(region),
        key: dmkv_transport::AccessKey(key),
        len: 1 << 16,
    };
    let svc = block_on(ep.lookup_service(node, "echo")).unwrap();
    let mut said_ready = false;
    // Bounded, so that a child whose parent died does not run on.
    let deadline = Instant::now() + Duration::from_secs(60);
    block_on(async {
        // Keep RPCs, reads, writes and atomics in flight until killed.
        for i in 0u64.. {
            if Instant::now() > deadline {
                break;
            }
            let mut b = ep.batch();
            b.write(region.at(0), vec![i as u8; 4096]);
            b.read(region.at(8192), 32 * 1024);
            b.faa(region.at(60000), 1);
            b.run().await.unwrap();
            ep.call(node, svc, vec![7; 10_000]).await.unwrap();
            if !said_ready {
                use std::io::Write;
                let mut out = std::io::stdout().lock();
                writeln!(out, "ready").unwrap();
                out.flush().unwrap();
                said_ready = true;
            }
        }
    });
}

fn kill_a_client_mid_run(config: fn(Vec<u8>) -> UcxConfig, tls: &str) {
    let (_sc, node) = serve(config(b"kill-test".to_vec()));
    node.services().register("echo", Arc::new(echo)).unwrap();
    let (region, mem) = node.register_region(1 << 16).unwrap();
    /// Kills the child however the test ends.
    struct Reap(std::process::Child);
    impl Drop for Reap {
        fn drop(&mut self) {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "child_client", "--nocapture", "--test-threads=1"])
        .env(
            CHILD_ENV,
            format!(
                "{tls};{};{};{}",
                node.listen_addr(),
                region.id.0,
                region.key.0
            ),
        )
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut child = Reap(child);
    loop {
        let line = lines.next().expect("the child reports").unwrap();
        // libtest prints "test child_client ... " before the child's output.
        if line.trim_end().ends_with("ready") {
            break;
        }
    }
    // The child is in the middle of its loop: kill it without warning.
    child.0.kill().unwrap();
    child.0.wait().unwrap();
    eventually("the node notices the client is gone", || {
        node.connected_processes() == 0
    });
    // The node serves another client, verbs and RPCs alike.
    let other = UcxCluster::new(config(b"kill-test".to_vec()), NodeId(60)).unwrap();
    other.connect(node.listen_addr()).unwrap();
    let ep = other.fabric().endpoint(NodeId(60)).unwrap();
    let svc = block_on(ep.lookup_service(NodeId(0), "echo")).unwrap();
    block_on(async {
        for i in 0..50u64 {
            ep.write(region.at(128), &i.to_le_bytes()).await.unwrap();
            assert_eq!(ep.read(region.at(128), 8).await.unwrap(), i.to_le_bytes());
            assert_eq!(
                ep.call(NodeId(0), svc, vec![1, 2]).await.unwrap(),
                vec![1, 2]
            );
        }
    });
    assert!(mem.load_u64(60000).unwrap() > 0, "the child did run");
}

#[test]
fn a_killed_client_leaves_the_node_serving_over_tcp() {
    kill_a_client_mid_run(UcxConfig::tcp_loopback, "tcp");
}

#[test]
fn a_killed_client_leaves_the_node_serving_over_shm() {
    kill_a_client_mid_run(UcxConfig::shm_loopback, "sm,tcp");
}

fn a_node_that_is_gone_is_down(config: fn(Vec<u8>) -> UcxConfig) {
    let (sc, node) = serve(config(b"s".to_vec()));
    node.services().register("echo", Arc::new(echo)).unwrap();
    let (region, _mem) = node.register_region(64).unwrap();
    let client = UcxCluster::new(config(b"s".to_vec()), NodeId(1)).unwrap();
    client.connect(node.listen_addr()).unwrap();
    let ep = client.fabric().endpoint(NodeId(1)).unwrap();
    block_on(ep.write(region.at(0), &[1; 8])).unwrap();
    let svc = block_on(ep.lookup_service(NodeId(0), "echo")).unwrap();
    assert_eq!(block_on(ep.call(NodeId(0), svc, vec![7])).unwrap(), vec![7]);
    drop(node);
    drop(sc);
    eventually("the client sees the node down", || {
        client.is_down(NodeId(0))
    });
    let e = block_on(ep.read(region.at(0), 8)).unwrap_err();
    assert!(matches!(e, TransportError::NodeDown(_)), "{e}");
    // RPCs too (over shared memory UCX itself would not say so: the
    // control connection does).
    let e = block_on(ep.call(NodeId(0), svc, vec![7])).unwrap_err();
    assert!(matches!(e, TransportError::NodeDown(_)), "{e}");
}

#[test]
fn a_node_that_is_gone_is_down_for_its_clients() {
    a_node_that_is_gone_is_down(UcxConfig::tcp_loopback);
}

#[test]
fn a_node_that_is_gone_is_down_for_its_clients_over_shm() {
    a_node_that_is_gone_is_down(UcxConfig::shm_loopback);
}

#[test]
fn large_rpcs_and_replies() {
    for config in [UcxConfig::tcp_loopback, UcxConfig::shm_loopback] {
        let (_sc, node) = serve(config(b"s".to_vec()));
        let svc = node.services().register("echo", Arc::new(echo)).unwrap();
        let client = UcxCluster::new(config(b"s".to_vec()), NodeId(1)).unwrap();
        client.connect(node.listen_addr()).unwrap();
        let ep = client.fabric().endpoint(NodeId(1)).unwrap();
        for len in [0usize, 100, 4000, 8000, 10_000, 70_000, 1 << 20] {
            let req: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
            assert_eq!(block_on(ep.call(NodeId(0), svc, req.clone())).unwrap(), req);
        }
    }
}

/// The handler threads' own copies of the handler table (invariants G1-G3
/// of docs/transport.md, "Handler lookup", on UCX since branch i52): a
/// service registered after the threads served their first requests is
/// found; a handler's error reply and the unknown-service error come back
/// whole; an unregistered handler is dropped once the handler threads have
/// polled (they poll for 1 ms after their last request, then release
/// their copies and sleep), and a later call gets the unknown-service
/// error. Without the release before sleeping (checked by taking it out)
/// the idle threads keep the unregistered handler alive.
#[test]
fn handler_threads_follow_registrations_and_drop_unregistered_handlers() {
    for config in [UcxConfig::tcp_loopback, UcxConfig::shm_loopback] {
        let c = UcxCluster::new(config(b"s".to_vec()), NodeId(100)).unwrap();
        let node = c
            .serve(NodeId(0), "127.0.0.1:0".parse().unwrap(), 2)
            .unwrap();
        let state = Arc::new(7u64);
        let weak = Arc::downgrade(&state);
        let tracked = node
            .services()
            .register(
                "tracked",
                Arc::new(
                    move |_: &RpcContext, _: &[u8]| -> Result<Vec<u8>, ServiceError> {
                        Ok(state.to_le_bytes().to_vec())
                    },
                ),
            )
            .unwrap();
        let client = UcxCluster::new(config(b"s".to_vec()), NodeId(1)).unwrap();
        client.connect(node.listen_addr()).unwrap();
        let ep = client.fabric().endpoint(NodeId(1)).unwrap();
        // Consecutive requests go to the two handler threads in turn.
        for _ in 0..4 {
            assert_eq!(
                block_on(ep.call(NodeId(0), tracked, vec![])).unwrap(),
                7u64.to_le_bytes()
            );
        }
        let failing = node
            .services()
            .register(
                "failing",
                Arc::new(
                    |_: &RpcContext, _: &[u8]| -> Result<Vec<u8>, ServiceError> {
                        Err(ServiceError::failed("no such thing"))
                    },
                ),
            )
            .unwrap();
        let echoed = node.services().register("echo", Arc::new(echo)).unwrap();
        for i in 0..4u8 {
            let e = block_on(ep.call(NodeId(0), failing, vec![i])).unwrap_err();
            let error = e.service_error().unwrap_or_else(|| panic!("{e}"));
            assert_eq!(error.code, dmkv_transport::ErrorCode::Failed);
            assert_eq!(error.message, "no such thing");
            assert_eq!(
                block_on(ep.call(NodeId(0), echoed, vec![i; 100])).unwrap(),
                vec![i; 100]
            );
        }
        node.services().unregister("tracked");
        eventually("the handler threads drop the unregistered handler", || {
            weak.strong_count() == 0
        });
        for _ in 0..2 {
            let e = block_on(ep.call(NodeId(0), tracked, vec![])).unwrap_err();
            let error = e.service_error().unwrap_or_else(|| panic!("{e}"));
            assert_eq!(error.code, dmkv_transport::ErrorCode::UnknownService);
        }
    }
}

/// RPCs are served on the handler threads that own the workers they were
/// sent to, spread over all of them by request id, never on the progress
/// thread; a deferred reply sent later from another thread reaches the
/// caller through its handler's loop; the serving loops' CPU outside
/// services reaches `progress_cpu_ns`, and its idle part is at most the
/// whole.
#[test]
fn rpcs_are_served_inline_on_every_handler_thread() {
    for config in [UcxConfig::tcp_loopback, UcxConfig::shm_loopback] {
        let c = UcxCluster::new(config(b"s".to_vec()), NodeId(100)).unwrap();
        let node = c
            .serve(NodeId(0), "127.0.0.1:0".parse().unwrap(), 2)
            .unwrap();
        let where_served = |_: &RpcContext, _: &[u8]| -> Result<Vec<u8>, ServiceError> {
            Ok(std::thread::current()
                .name()
                .unwrap_or("?")
                .as_bytes()
                .to_vec())
        };
        let svc = node
            .services()
            .register("where", Arc::new(where_served))
            .unwrap();
        let later = node
            .services()
            .register_deferred(
                "later",
                Arc::new(
                    |_: &RpcContext, req: &[u8], responder: dmkv_transport::Responder| {
                        let req = req.to_vec();
                        std::thread::spawn(move || {
                            std::thread::sleep(Duration::from_millis(20));
                            responder.reply(Ok(req));
                        });
                    },
                ),
            )
            .unwrap();
        let client = UcxCluster::new(config(b"s".to_vec()), NodeId(1)).unwrap();
        client.connect(node.listen_addr()).unwrap();
        let ep = client.fabric().endpoint(NodeId(1)).unwrap();
        let names: Vec<String> = (0..8)
            .map(|_| String::from_utf8(block_on(ep.call(NodeId(0), svc, vec![])).unwrap()).unwrap())
            .collect();
        // Consecutive request ids go to the two handler workers in turn.
        for pair in names.windows(2) {
            assert_ne!(pair[0], pair[1], "{names:?}");
        }
        let distinct: std::collections::BTreeSet<&str> = names.iter().map(|n| n.as_str()).collect();
        assert_eq!(distinct, ["dmkv-n0-h0", "dmkv-n0-h1"].into(), "{names:?}");
        for i in 0..4u8 {
            assert_eq!(
                block_on(ep.call(NodeId(0), later, vec![i])).unwrap(),
                vec![i]
            );
        }
        eventually("the serving loops' CPU is reported", || {
            node.progress_cpu_ns() > 0
        });
        assert!(node.progress_idle_ns() <= node.progress_cpu_ns());
    }
}
