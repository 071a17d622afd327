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

/// The same batch with no fault injected (executed at once, `execute_now`)
/// and with a fault that leaves one-sided verbs alone (an RPC delay: through
/// `execute`'s future): the same results, the same refusal at the same verb
/// with the earlier verbs executed, the same counters, and each yields to
/// the executor exactly once (waking itself) before it answers.
#[test]
fn a_batch_executed_at_once_answers_as_the_posted_path_does() {
    use dmkv_transport::{Endpoint, OpKind, labeled};
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::{Context, Poll, Wake, Waker};
    struct Count(AtomicUsize);
    impl Wake for Count {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
        fn wake_by_ref(self: &Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }
    /// Polls `f` by hand: (polls until ready, wakes, output).
    fn drive<F: std::future::Future>(f: F) -> (usize, usize, F::Output) {
        let count = Arc::new(Count(AtomicUsize::new(0)));
        let waker = Waker::from(count.clone());
        let mut cx = Context::from_waker(&waker);
        let mut f = std::pin::pin!(f);
        for polls in 1..10 {
            if let Poll::Ready(out) = f.as_mut().poll(&mut cx) {
                return (polls, count.0.load(Ordering::Relaxed), out);
            }
        }
        panic!("not ready after 9 polls");
    }
    type Outcome = (Vec<u8>, Vec<u8>, u64, u64, String, Vec<u8>);
    fn run(faults: Faults) -> (Outcome, dmkv_transport::CounterTable, Vec<(usize, usize)>) {
        let (cluster, server, client) = one_server(LocalConfig {
            faults,
            ..LocalConfig::default()
        });
        let (region, _) = server.register_region(4096).unwrap();
        let ep: Endpoint = cluster.fabric().endpoint(client).unwrap();
        let mut yields = Vec::new();
        // Writes, atomics and reads (aligned and not) in one batch.
        let mut b = ep.batch();
        b.write(region.at(0), (1..=40).collect());
        let whole = b.read(region.at(0), 40);
        let cas = b.cas(region.at(64), 0, 9);
        let faa = b.faa(region.at(64), 5);
        let odd = b.read(region.at(3), 13);
        let (polls, wakes, r) = drive(labeled(OpKind::Get, b.run()));
        yields.push((polls, wakes));
        let mut r = r.unwrap();
        let (w, c, f) = (r.take_read(whole), r.word(cas), r.word(faa));
        let o = r.take_read(odd);
        // A refused verb fails the batch; the write before it happened.
        let mut b = ep.batch();
        b.write(region.at(128), vec![7; 16]);
        b.read(region.at(4090), 16);
        let (polls, wakes, r) = drive(labeled(OpKind::Update, b.run()));
        yields.push((polls, wakes));
        let err = r.unwrap_err().to_string();
        let (polls, wakes, after) = drive(labeled(OpKind::Get, ep.read(region.at(128), 16)));
        yields.push((polls, wakes));
        ((w, o, c, f, err, after.unwrap()), ep.counters(), yields)
    }
    let now = run(Faults::default());
    let posted = run(Faults {
        rpc_delay: Duration::from_micros(1),
        ..Faults::default()
    });
    assert_eq!(now.0, posted.0);
    assert_eq!(now.1, posted.1, "the same counters by kind");
    assert_eq!(now.2, posted.2);
    assert_eq!(now.2, vec![(2, 1); 3], "one yield, one wake per round trip");
    let (w, o, c, f, err, after) = now.0;
    assert_eq!(w, (1..=40).collect::<Vec<u8>>());
    assert_eq!(o, (4..=16).collect::<Vec<u8>>());
    assert_eq!((c, f), (0, 9), "CAS found 0 and set 9; FAA found 9");
    assert!(err.contains("out of bounds"), "{err}");
    assert_eq!(after, vec![7; 16]);
}

#[test]
fn a_batch_executes_on_the_poll_after_its_post() {
    // L1 (`LocalEndpoint::prefetch`): without injected faults a batch is
    // counted and its lines hinted when first polled, and executed on the
    // next poll, before its results are handed out: a store between the two
    // polls is seen by a read of the batch, and the batch's write is not
    // visible before its second poll. (Executed at its first poll, the read
    // would return the old bytes and the write would be visible at once.)
    use std::task::{Context, Poll, Waker};
    let (cluster, server, client) = one_server(LocalConfig::default());
    let (region, mem) = server.register_region(4096).unwrap();
    let ep = cluster.fabric().endpoint(client).unwrap();
    mem.write(0, &[1; 64]).unwrap();
    let mut cx = Context::from_waker(Waker::noop());
    let mut b = ep.batch();
    let read = b.read(region.at(0), 64);
    b.write(region.at(2048), vec![5; 8]);
    let mut run = std::pin::pin!(b.run());
    assert!(
        run.as_mut().poll(&mut cx).is_pending(),
        "one yield per round trip"
    );
    let counted = ep.total_counters();
    assert_eq!(
        (counted.round_trips, counted.reads, counted.writes),
        (1, 1, 1),
        "counted at the post"
    );
    assert_eq!(
        mem.read_vec(2048, 8).unwrap(),
        vec![0; 8],
        "the write waits for the next poll"
    );
    mem.write(0, &[2; 64]).unwrap();
    let Poll::Ready(r) = run.as_mut().poll(&mut cx) else {
        panic!("a batch executed at its second poll is complete");
    };
    let mut r = r.unwrap();
    assert_eq!(
        r.take_read(read),
        vec![2; 64],
        "the read ran after the store"
    );
    assert_eq!(mem.read_vec(2048, 8).unwrap(), vec![5; 8]);
    assert_eq!(ep.total_counters(), counted, "nothing counted twice");
}

/// Polls `f` once with a waker that does nothing.
fn poll_once<F: std::future::Future + Unpin>(f: &mut F) -> std::task::Poll<F::Output> {
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    std::pin::Pin::new(f).poll(&mut cx)
}

#[test]
fn what_happens_between_a_post_and_its_execution_is_checked_at_the_execution() {
    // L1 and R1 (`LocalEndpoint::run_verbs`): a batch deferred at its post
    // (its regions already in the endpoint's cache) is checked when it
    // executes. A region withdrawn in between, a region withdrawn and
    // another registered, and a crashed node refuse the batch with the
    // error the same read gets afterwards; a withdrawal elsewhere on the
    // node (a new generation) only makes the batch resolve its regions
    // again, verb after verb, and it completes.
    use dmkv_transport::TransportError;
    let (cluster, server, client) = one_server(LocalConfig::default());
    let ep = cluster.fabric().endpoint(client).unwrap();
    let mut regions = Vec::new();
    for i in 0..4u8 {
        let (r, mem) = server.register_region(4096).unwrap();
        mem.write(0, &[i + 1; 256]).unwrap();
        // Cached by the endpoint, so the post hints it.
        assert_eq!(poll_ready(ep.read(r.at(0), 8)).unwrap(), vec![i + 1; 8]);
        regions.push(r);
    }
    let (a, b, c, d) = (regions[0], regions[1], regions[2], regions[3]);
    fn batch(
        ep: &dmkv_transport::Endpoint,
        x: dmkv_transport::RemoteRegion,
    ) -> dmkv_transport::Batch<'_> {
        let mut run = ep.batch();
        run.read(x.at(0), 64);
        run.read(x.at(64), 64);
        run.read(x.at(128), 8);
        run
    }

    // Another region of the node withdrawn: every region resolved again
    // (the stale cache's path, then the fresh one's), in posting order.
    let mut run = ep.batch();
    let first = run.read(a.at(0), 64);
    let second = run.read(a.at(64), 64);
    let third = run.read(c.at(0), 16);
    let fourth = run.read(a.at(128), 8);
    let mut run = run.run();
    assert!(poll_once(&mut run).is_pending());
    server.deregister_region(b.id);
    let std::task::Poll::Ready(r) = poll_once(&mut run) else {
        panic!("executed at the second poll");
    };
    let r = r.unwrap();
    assert_eq!(
        (r.read(first), r.read(second), r.read(third), r.read(fourth)),
        (&[1; 64][..], &[1; 64][..], &[3; 16][..], &[1; 8][..])
    );

    // The batch's own region withdrawn.
    let mut run = batch(&ep, c).run();
    assert!(poll_once(&mut run).is_pending());
    server.deregister_region(c.id);
    let std::task::Poll::Ready(r) = poll_once(&mut run) else {
        panic!("executed at the second poll");
    };
    let e = r.unwrap_err();
    assert!(matches!(e, TransportError::NoSuchRegion { .. }), "{e}");
    let again = poll_ready(ep.read(c.at(0), 8)).unwrap_err();
    assert_eq!(
        e.to_string(),
        again.to_string(),
        "the error a read gets now"
    );

    // Withdrawn and another registered (ids are not reused).
    let mut run = batch(&ep, d).run();
    assert!(poll_once(&mut run).is_pending());
    server.deregister_region(d.id);
    let (fresh, _) = server.register_region(4096).unwrap();
    let std::task::Poll::Ready(r) = poll_once(&mut run) else {
        panic!("executed at the second poll");
    };
    let e = r.unwrap_err();
    assert!(matches!(e, TransportError::NoSuchRegion { .. }), "{e}");
    assert_eq!(poll_ready(ep.read(fresh.at(0), 8)).unwrap(), vec![0; 8]);

    // A verb of a run under another key than the run's first: refused,
    // though its region's resolution is shared.
    let mut bad = a;
    bad.key = dmkv_transport::AccessKey(a.key.0 ^ 1);
    let mut run = ep.batch();
    run.read(a.at(0), 8);
    run.read(bad.at(8), 8);
    let e = poll_ready(run.run()).unwrap_err();
    assert!(matches!(e, TransportError::AccessDenied { .. }), "{e}");

    // The node crashed.
    let mut run = batch(&ep, a).run();
    assert!(poll_once(&mut run).is_pending());
    cluster.crash(server.id());
    let std::task::Poll::Ready(r) = poll_once(&mut run) else {
        panic!("executed at the second poll");
    };
    let e = r.unwrap_err();
    assert!(matches!(e, TransportError::NodeDown(_)), "{e}");
}

#[test]
fn a_batch_deferred_before_faults_were_injected_runs_through_the_fault_path() {
    // `BatchRun::execute_deferred` declines when faults were injected
    // between the post and the execution (`execute_now` answers `None`):
    // the batch then goes through `execute`, counted once, and completes.
    let (cluster, server, client) = one_server(LocalConfig::default());
    let (region, mem) = server.register_region(4096).unwrap();
    let ep = cluster.fabric().endpoint(client).unwrap();
    mem.write(0, &[4; 64]).unwrap();
    poll_ready(ep.read(region.at(0), 8)).unwrap();
    let before = ep.total_counters();
    let mut run = ep.batch();
    let read = run.read(region.at(0), 64);
    run.write(region.at(64), vec![6; 8]);
    let mut run = run.run();
    assert!(poll_once(&mut run).is_pending());
    cluster.set_faults(Faults {
        rpc_delay: Duration::from_micros(1),
        ..Faults::default()
    });
    let r = poll_ready(run).unwrap();
    assert_eq!(r.read(read), &[4; 64][..]);
    assert_eq!(mem.read_vec(64, 8).unwrap(), vec![6; 8]);
    let after = ep.total_counters();
    assert_eq!(
        (
            after.round_trips - before.round_trips,
            after.verbs - before.verbs
        ),
        (1, 2),
        "counted once"
    );
}

/// Polls `f` until it is ready (at most 9 times).
fn poll_ready<F: std::future::Future>(f: F) -> F::Output {
    let mut f = std::pin::pin!(f);
    let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
    for _ in 0..9 {
        if let std::task::Poll::Ready(out) = f.as_mut().poll(&mut cx) {
            return out;
        }
    }
    panic!("not ready after 9 polls");
}

#[test]
fn an_executed_writes_data_goes_back_to_the_threads_spares() {
    // W2 (`LocalEndpoint::execute_on`): once a write's bytes are in the
    // region, its data vector's allocation joins the thread's spare
    // buffers, and the thread's next buffer reuses it. Run on a thread of
    // its own, so no other test's buffers are among its spares.
    std::thread::spawn(|| {
        let (cluster, server, client) = one_server(LocalConfig::default());
        let (region, mem) = server.register_region(4096).unwrap();
        let ep = cluster.fabric().endpoint(client).unwrap();
        for deferred_first in [false, true] {
            // A read first: the batch's result list, and the thread's
            // pool, exist before the write (its list from the fast slot or
            // the pool, either way).
            if deferred_first {
                poll_ready(ep.read(region.at(0), 8)).unwrap();
            }
            let data = vec![9u8; 100];
            let at = data.as_ptr();
            let mut b = ep.batch();
            b.write(region.at(512), data);
            b.cas(region.at(1024), 0, 1);
            drop(poll_ready(b.run()).unwrap());
            assert_eq!(mem.read_vec(512, 100).unwrap(), vec![9; 100]);
            let next = dmkv_transport::buffers::take();
            assert_eq!(next.as_ptr(), at, "the write's allocation is reused");
            assert!(next.is_empty() && next.capacity() >= 100);
            mem.write(1024, &[0; 8]).unwrap();
        }
        // A refused batch still frees its write's data (no leak, no
        // double free: the drop loop runs on a verb list partly executed).
        let mut b = ep.batch();
        b.write(region.at(0), vec![1; 16]);
        b.read(region.at(4090), 16);
        b.write(region.at(16), vec![2; 16]);
        assert!(poll_ready(b.run()).is_err());
        assert_eq!(mem.read_vec(0, 16).unwrap(), vec![1; 16]);
        assert_eq!(mem.read_vec(16, 16).unwrap(), vec![0; 16]);
    })
    .join()
    .unwrap();
}
