//! The conformance suite on the local backend, plus the local backend's own
//! fault knobs.

use dmkv_transport::conformance::{Target, TestCluster};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks, yield_now};
use dmkv_transport::local::{Faults, LocalCluster, LocalConfig, LocalNode};
use dmkv_transport::{Fabric, NodeHost, NodeId, RpcContext, ServiceError, TransportError};
use std::sync::Arc;
use std::time::{Duration, Instant};

struct Local;

struct LocalTest {
    cluster: LocalCluster,
    servers: Vec<Arc<LocalNode>>,
    client: NodeId,
}

impl TestCluster for LocalTest {
    fn fabric(&self) -> Arc<dyn Fabric> {
        self.cluster.fabric()
    }
    fn server(&self, i: usize) -> Arc<dyn NodeHost> {
        self.servers[i].clone()
    }
    fn client(&self) -> NodeId {
        self.client
    }
    fn crash(&self, i: usize) -> bool {
        self.cluster.crash(self.servers[i].id());
        true
    }
}

impl Target for Local {
    fn cluster(&self, servers: usize, handler_threads: usize) -> Box<dyn TestCluster> {
        let cluster = LocalCluster::new(LocalConfig::default());
        let servers = (0..servers)
            .map(|_| cluster.add_node(handler_threads))
            .collect();
        let client = cluster.add_node(0).id();
        Box::new(LocalTest {
            cluster,
            servers,
            client,
        })
    }
}

dmkv_transport::conformance_tests!(Local);

fn one_server(config: LocalConfig) -> (LocalCluster, Arc<LocalNode>, NodeId) {
    let cluster = LocalCluster::new(config);
    let server = cluster.add_node(1);
    let client = cluster.add_node(0).id();
    (cluster, server, client)
}

#[test]
fn torn_reads_really_tear() {
    // One task reads 256 bytes with torn reads on; another task of the same
    // thread rewrites the block while the read is in pieces. The read must
    // see both old and new words: the knob works. Pieces are 8 to 32 bytes,
    // so a 256-byte read takes at least 8 pieces and the writer (which
    // yields once before writing) always lands inside it; with 64 bytes a
    // 32 + 32 split finished before the write (about 1 run in 16).
    let (cluster, server, client) = one_server(LocalConfig::default());
    let (region, _mem) = server.register_region(256).unwrap();
    let ep = cluster.fabric().endpoint(client).unwrap();
    block_on(ep.write(region.at(0), &[1; 256])).unwrap();
    cluster.set_faults(Faults {
        torn_reads: true,
        ..Faults::default()
    });
    let ep = &ep;
    let tasks: Vec<LocalTask<'_, Option<Vec<u8>>>> = vec![
        Box::pin(async move { Some(ep.read(region.at(0), 256).await.unwrap()) }),
        Box::pin(async move {
            yield_now().await;
            ep.write(region.at(0), &[2; 256]).await.unwrap();
            None
        }),
    ];
    let got = run_tasks(tasks).remove(0).unwrap();
    assert_eq!(got[0], 1, "the first piece was copied before the write");
    assert_eq!(got[255], 2, "the last piece was copied after the write");
}

#[test]
fn injected_latency_applies_once_per_round_trip() {
    let lat = Duration::from_millis(4);
    let (cluster, server, client) = one_server(LocalConfig {
        faults: Faults {
            round_trip_latency: lat,
            ..Faults::default()
        },
        ..LocalConfig::default()
    });
    let (region, _mem) = server.register_region(64).unwrap();
    let ep = cluster.fabric().endpoint(client).unwrap();
    let start = Instant::now();
    block_on(async {
        let mut b = ep.batch();
        for i in 0..8 {
            b.read(region.at(i * 8), 8);
        }
        b.run().await.unwrap();
    });
    let took = start.elapsed();
    assert!(took >= lat, "a batch waits at least one round trip");
}

#[test]
fn dropped_messages_time_out_and_delayed_ones_arrive() {
    let (cluster, server, client) = one_server(LocalConfig {
        rpc_timeout: Duration::from_millis(50),
        ..LocalConfig::default()
    });
    let svc = server
        .services()
        .register(
            "echo",
            Arc::new(
                |_: &RpcContext, r: &[u8]| -> Result<Vec<u8>, ServiceError> { Ok(r.to_vec()) },
            ),
        )
        .unwrap();
    let ep = cluster.fabric().endpoint(client).unwrap();
    cluster.set_faults(Faults {
        rpc_drop_probability: 1.0,
        ..Faults::default()
    });
    let e = block_on(ep.call(server.id(), svc, vec![1])).unwrap_err();
    assert!(matches!(e, TransportError::Timeout { .. }), "{e}");
    let delay = Duration::from_millis(5);
    cluster.set_faults(Faults {
        rpc_delay: delay,
        ..Faults::default()
    });
    let start = Instant::now();
    assert_eq!(
        block_on(ep.call(server.id(), svc, vec![1])).unwrap(),
        vec![1]
    );
    assert!(start.elapsed() >= delay);
}

#[test]
fn a_caller_waiting_on_a_crashing_node_gets_an_error() {
    let (cluster, server, client) = one_server(LocalConfig::default());
    let svc = server
        .services()
        .register(
            "slow",
            Arc::new(
                |_: &RpcContext, _: &[u8]| -> Result<Vec<u8>, ServiceError> {
                    std::thread::sleep(Duration::from_millis(100));
                    Ok(vec![])
                },
            ),
        )
        .unwrap();
    let fabric = cluster.fabric();
    let id = server.id();
    let waiter = std::thread::spawn(move || {
        let ep = fabric.endpoint(client).unwrap();
        // The first call occupies the only handler; the second waits in the
        // queue and is dropped by the crash.
        let tasks: Vec<LocalTask<'_, Result<Vec<u8>, TransportError>>> = vec![
            Box::pin(ep.call(id, svc, vec![])),
            Box::pin(ep.call(id, svc, vec![])),
        ];
        run_tasks(tasks)
    });
    std::thread::sleep(Duration::from_millis(30));
    cluster.crash(id);
    let results = waiter.join().unwrap();
    assert!(
        results
            .iter()
            .any(|r| matches!(r, Err(TransportError::NodeDown(_)))),
        "{results:?}"
    );
}
