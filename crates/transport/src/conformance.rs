//! The conformance suite: what every backend must do.
//!
//! A backend's test crate implements [`Target`] and expands
//! [`conformance_tests!`](crate::conformance_tests), which turns every check
//! below into a `#[test]`. The checks use only the contract ([`Fabric`],
//! [`NodeHost`], [`Endpoint`]), so they run unchanged on every backend.

use crate::addr::{AccessKey, NodeId, RegionId, ServiceId};
use crate::backend::{Fabric, NodeHost};
use crate::counters::{OpKind, labeled};
use crate::endpoint::Endpoint;
use crate::error::{ErrorCode, ServiceError, TransportError};
use crate::exec::{LocalTask, block_on, run_tasks};
use crate::service::RpcContext;
use parking_lot::{Condvar, Mutex};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

/// A cluster made for one check.
pub trait TestCluster {
    fn fabric(&self) -> Arc<dyn Fabric>;
    /// Serving node `i` (0-based).
    fn server(&self, i: usize) -> Arc<dyn NodeHost>;
    /// A node that only issues requests.
    fn client(&self) -> NodeId;
    /// Crashes serving node `i`; returns false if the backend cannot.
    fn crash(&self, i: usize) -> bool;
}

/// Makes clusters of a backend.
pub trait Target {
    fn cluster(&self, servers: usize, handler_threads: usize) -> Box<dyn TestCluster>;
}

fn endpoint(c: &dyn TestCluster) -> Endpoint {
    c.fabric()
        .endpoint(c.client())
        .expect("endpoint on the client node")
}

/// Writes and reads back bytes at aligned and unaligned offsets and lengths.
pub fn read_write(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let (region, _mem) = c.server(0).register_region(4096).unwrap();
    let ep = endpoint(&*c);
    block_on(async {
        for (off, len) in [
            (0u64, 8usize),
            (3, 1),
            (5, 13),
            (64, 64),
            (100, 333),
            (4095, 1),
            (0, 4096),
        ] {
            let data: Vec<u8> = (0..len).map(|i| (i as u64 * 7 + off) as u8).collect();
            ep.write(region.at(off), &data).await.unwrap();
            assert_eq!(
                ep.read(region.at(off), len).await.unwrap(),
                data,
                "at {off}+{len}"
            );
        }
        // A partial-word write leaves its neighbours alone.
        ep.write(region.at(0), &[0xff; 16]).await.unwrap();
        ep.write(region.at(3), &[1, 2]).await.unwrap();
        let back = ep.read(region.at(0), 16).await.unwrap();
        assert_eq!(&back[..6], &[0xff, 0xff, 0xff, 1, 2, 0xff]);
    });
}

/// CAS and FAA semantics, and their atomicity under concurrent threads.
pub fn atomics(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let (region, _mem) = c.server(0).register_region(64).unwrap();
    let ep = endpoint(&*c);
    block_on(async {
        assert_eq!(ep.cas(region.at(8), 0, 5).await.unwrap(), 0);
        assert_eq!(
            ep.cas(region.at(8), 0, 6).await.unwrap(),
            5,
            "a failed CAS returns the value found"
        );
        assert_eq!(ep.faa(region.at(8), 10).await.unwrap(), 5);
        assert_eq!(
            ep.faa(region.at(8), u64::MAX).await.unwrap(),
            15,
            "FAA wraps"
        );
        assert_eq!(ep.read(region.at(8), 8).await.unwrap(), 14u64.to_le_bytes());
    });
    let threads = 4;
    let per_thread = 500;
    let wins = Arc::new(AtomicUsize::new(0));
    std::thread::scope(|s| {
        for _ in 0..threads {
            let fabric = c.fabric();
            let client = c.client();
            let wins = wins.clone();
            s.spawn(move || {
                let ep = fabric.endpoint(client).unwrap();
                block_on(async {
                    for _ in 0..per_thread {
                        ep.faa(region.at(16), 1).await.unwrap();
                    }
                    // Exactly one thread's CAS from 0 succeeds.
                    if ep.cas(region.at(24), 0, 1).await.unwrap() == 0 {
                        wins.fetch_add(1, Ordering::Relaxed);
                    }
                });
            });
        }
    });
    let total = block_on(ep.read(region.at(16), 8)).unwrap();
    assert_eq!(
        u64::from_le_bytes(total.try_into().unwrap()),
        (threads * per_thread) as u64
    );
    assert_eq!(wins.load(Ordering::Relaxed), 1);
}

/// 8-byte words are never torn, whatever races.
pub fn word_atomicity(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let (region, _mem) = c.server(0).register_region(256).unwrap();
    std::thread::scope(|s| {
        let fabric = c.fabric();
        let client = c.client();
        s.spawn(move || {
            let ep = fabric.endpoint(client).unwrap();
            block_on(async {
                for i in 1..=2000u64 {
                    // Each word holds i in both halves; a torn word would not.
                    let w = i | (i << 32);
                    let block: Vec<u8> = (0..32).flat_map(|_| w.to_le_bytes()).collect();
                    ep.write(region.at(0), &block).await.unwrap();
                }
            });
        });
        let fabric = c.fabric();
        let client = c.client();
        s.spawn(move || {
            let ep = fabric.endpoint(client).unwrap();
            block_on(async {
                for _ in 0..2000 {
                    let b = ep.read(region.at(0), 256).await.unwrap();
                    for chunk in b.chunks(8) {
                        let w = u64::from_le_bytes(chunk.try_into().unwrap());
                        assert_eq!(w >> 32, w & 0xffff_ffff, "torn word {w:#x}");
                    }
                }
            });
        });
    });
}

/// A batch costs one round trip and counts every verb and byte exactly.
pub fn batch_counts_once(t: &dyn Target) {
    let c = t.cluster(2, 1);
    let (r0, _m0) = c.server(0).register_region(1024).unwrap();
    let (r1, _m1) = c.server(1).register_region(1024).unwrap();
    let ep = endpoint(&*c);
    block_on(labeled(OpKind::Get, async {
        ep.write(r0.at(0), &[7; 100]).await.unwrap();
        ep.write(r1.at(512), &[9; 50]).await.unwrap();
        let before = *ep.counters().get(OpKind::Get);
        let mut b = ep.batch();
        let a = b.read(r0.at(0), 100);
        let bb = b.read(r1.at(512), 50);
        let cas = b.cas(r0.at(200), 0, 1);
        let faa = b.faa(r1.at(8), 3);
        let w = b.write(r0.at(300), vec![1; 24]);
        let mut res = b.run().await.unwrap();
        assert_eq!(res.take_read(a), vec![7; 100]);
        assert_eq!(res.take_read(bb), vec![9; 50]);
        assert_eq!(res.word(cas), 0);
        assert_eq!(res.word(faa), 0);
        assert_eq!(w, 4);
        let after = *ep.counters().get(OpKind::Get);
        assert_eq!(after.round_trips - before.round_trips, 1);
        assert_eq!(after.verbs - before.verbs, 5);
        assert_eq!(
            (after.reads, after.writes, after.cas, after.faa),
            (before.reads + 2, before.writes + 1, 1, 1)
        );
        assert_eq!(after.bytes_read - before.bytes_read, 100 + 50 + 8 + 8);
        assert_eq!(after.bytes_written - before.bytes_written, 24 + 16 + 8);
        assert_eq!(after.rpcs, 0);
        // Verbs to one node execute in posting order.
        let mut b = ep.batch();
        b.write(r0.at(600), vec![1; 8]);
        b.write(r0.at(600), vec![2; 8]);
        let rd = b.read(r0.at(600), 8);
        assert_eq!(b.run().await.unwrap().take_read(rd), vec![2; 8]);
        // An empty batch costs nothing.
        let before = ep.counters();
        ep.batch().run().await.unwrap();
        assert_eq!(ep.counters(), before);
    }));
}

/// Bad addresses, keys, regions and nodes are refused and harm nothing.
pub fn bad_access_is_refused(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let (region, _mem) = c.server(0).register_region(128).unwrap();
    let ep = endpoint(&*c);
    block_on(async {
        ep.write(region.at(0), &[5; 128]).await.unwrap();
        let e = ep.read(region.at(120), 16).await.unwrap_err();
        assert!(matches!(e, TransportError::OutOfBounds { .. }), "{e}");
        let e = ep
            .write(region.at(u64::MAX - 3), &[0; 8])
            .await
            .unwrap_err();
        assert!(matches!(e, TransportError::OutOfBounds { .. }), "{e}");
        let mut bad_key = region;
        bad_key.key = AccessKey(region.key.0 ^ 1);
        let e = ep.read(bad_key.at(0), 8).await.unwrap_err();
        assert!(matches!(e, TransportError::AccessDenied { .. }), "{e}");
        let e = ep.write(bad_key.at(0), &[0; 8]).await.unwrap_err();
        assert!(matches!(e, TransportError::AccessDenied { .. }), "{e}");
        let mut no_region = region;
        no_region.id = RegionId(region.id.0 + 1000);
        let e = ep.read(no_region.at(0), 8).await.unwrap_err();
        assert!(matches!(e, TransportError::NoSuchRegion { .. }), "{e}");
        let mut no_node = region;
        no_node.node = NodeId(999);
        let e = ep.read(no_node.at(0), 8).await.unwrap_err();
        assert!(matches!(e, TransportError::UnknownNode(_)), "{e}");
        let e = ep.cas(region.at(4), 0, 1).await.unwrap_err();
        assert!(matches!(e, TransportError::Misaligned { .. }), "{e}");
        let e = ep.faa(region.at(128), 1).await.unwrap_err();
        assert!(matches!(e, TransportError::OutOfBounds { .. }), "{e}");
        // Nothing was harmed.
        assert_eq!(ep.read(region.at(0), 128).await.unwrap(), vec![5; 128]);
    });
}

fn echo(_: &RpcContext, req: &[u8]) -> Result<Vec<u8>, ServiceError> {
    if req.first() == Some(&0xee) {
        return Err(ServiceError::malformed("first byte 0xee is refused"));
    }
    Ok(req.iter().rev().copied().collect())
}

/// RPCs: replies, refusals, unknown services, directory, counters.
pub fn rpc(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let node = c.server(0);
    node.services().register("echo", Arc::new(echo)).unwrap();
    let spin = node
        .services()
        .register(
            "spin",
            Arc::new(|_: &RpcContext, _: &[u8]| {
                let mut x = 0u64;
                for i in 0..2_000_000u64 {
                    x = x.wrapping_mul(31).wrapping_add(i);
                }
                Ok(std::hint::black_box(x).to_le_bytes().to_vec())
            }),
        )
        .unwrap();
    let (region, _mem) = node.register_region(64).unwrap();
    node.services().publish_region("things", region);
    let ep = endpoint(&*c);
    let id = node.id();
    block_on(labeled(OpKind::Update, async {
        let svc = ep.lookup_service(id, "echo").await.unwrap();
        assert_eq!(ep.lookup_region(id, "things").await.unwrap(), region);
        let before = *ep.counters().get(OpKind::Update);
        assert_eq!(
            ep.call(id, svc, vec![1, 2, 3]).await.unwrap(),
            vec![3, 2, 1]
        );
        let after = *ep.counters().get(OpKind::Update);
        assert_eq!(after.rpcs - before.rpcs, 1);
        assert_eq!(after.round_trips - before.round_trips, 1);
        assert_eq!(after.bytes_written - before.bytes_written, 3);
        assert_eq!(after.bytes_read - before.bytes_read, 3);
        assert_eq!(after.verbs, before.verbs);

        let e = ep.call(id, svc, vec![0xee]).await.unwrap_err();
        assert_eq!(e.service_error().unwrap().code, ErrorCode::Malformed);
        let e = ep.call(id, ServiceId(12345), vec![]).await.unwrap_err();
        assert_eq!(e.service_error().unwrap().code, ErrorCode::UnknownService);
        let e = ep.lookup_service(id, "nope").await.unwrap_err();
        assert_eq!(e.service_error().unwrap().code, ErrorCode::UnknownService);
        assert!(ep.lookup_region(id, "nope").await.is_err());
        // A malformed directory request is refused, not fatal.
        let e = ep
            .call(id, ServiceId::DIRECTORY, vec![9])
            .await
            .unwrap_err();
        assert_eq!(e.service_error().unwrap().code, ErrorCode::Malformed);

        // The serving side's CPU time is charged to the caller.
        let before = *ep.counters().get(OpKind::Update);
        ep.call(id, spin, vec![]).await.unwrap();
        let after = *ep.counters().get(OpKind::Update);
        assert!(
            after.memnode_cpu_ns > before.memnode_cpu_ns,
            "handler CPU time is reported"
        );
        // The node still serves after all of that.
        assert_eq!(ep.call(id, svc, vec![4]).await.unwrap(), vec![4]);
    }));
}

/// Waits until `n` handlers are inside at once, or fails after a while.
struct Rendezvous {
    inside: Mutex<usize>,
    max_inside: AtomicUsize,
    cv: Condvar,
    n: usize,
}

impl Rendezvous {
    fn new(n: usize) -> Arc<Self> {
        Arc::new(Rendezvous {
            inside: Mutex::new(0),
            max_inside: AtomicUsize::new(0),
            cv: Condvar::new(),
            n,
        })
    }
    fn meet(&self) -> bool {
        let mut g = self.inside.lock();
        *g += 1;
        self.max_inside.fetch_max(*g, Ordering::SeqCst);
        self.cv.notify_all();
        !self
            .cv
            .wait_while_for(&mut g, |inside| *inside < self.n, Duration::from_secs(10))
            .timed_out()
    }
}

/// Several tasks of one thread have RPCs in flight at once, served by several
/// handler threads; with one handler thread, requests are served one by one.
pub fn tasks_overlap_and_handlers_are_counted(t: &dyn Target) {
    let n = 4;
    let c = t.cluster(1, n);
    let meet = Rendezvous::new(n);
    let m = meet.clone();
    let svc = c
        .server(0)
        .services()
        .register(
            "meet",
            Arc::new(move |_: &RpcContext, _: &[u8]| {
                if m.meet() {
                    Ok(vec![1])
                } else {
                    Err(ServiceError::failed("handlers did not overlap"))
                }
            }),
        )
        .unwrap();
    let ep = endpoint(&*c);
    let node = c.server(0).id();
    let tasks: Vec<LocalTask<'_, Vec<u8>>> = (0..n)
        .map(|_| Box::pin(async { ep.call(node, svc, vec![]).await.unwrap() }) as LocalTask<'_, _>)
        .collect();
    assert_eq!(run_tasks(tasks), vec![vec![1]; n]);
    assert_eq!(meet.max_inside.load(Ordering::SeqCst), n);

    // One handler thread: never two requests inside at once.
    let c = t.cluster(1, 1);
    let inside = Arc::new(AtomicUsize::new(0));
    let max = Arc::new(AtomicUsize::new(0));
    let (i2, m2) = (inside.clone(), max.clone());
    let svc = c
        .server(0)
        .services()
        .register(
            "count",
            Arc::new(move |_: &RpcContext, _: &[u8]| {
                let now = i2.fetch_add(1, Ordering::SeqCst) + 1;
                m2.fetch_max(now, Ordering::SeqCst);
                std::thread::sleep(Duration::from_millis(2));
                i2.fetch_sub(1, Ordering::SeqCst);
                Ok(vec![])
            }),
        )
        .unwrap();
    let ep = endpoint(&*c);
    let node = c.server(0).id();
    let tasks: Vec<LocalTask<'_, ()>> = (0..n)
        .map(|_| {
            Box::pin(async {
                ep.call(node, svc, vec![]).await.unwrap();
            }) as LocalTask<'_, _>
        })
        .collect();
    run_tasks(tasks);
    assert_eq!(max.load(Ordering::SeqCst), 1);
    assert_eq!(c.server(0).handler_threads(), 1);
}

/// Interleaved tasks with different labels are charged to their own kinds.
pub fn counters_follow_labels(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let (region, _mem) = c.server(0).register_region(64).unwrap();
    c.server(0)
        .services()
        .register("echo", Arc::new(echo))
        .unwrap();
    let ep = endpoint(&*c);
    let node = c.server(0).id();
    let svc = block_on(ep.lookup_service(node, "echo")).unwrap();
    let ep = &ep;
    let tasks: Vec<LocalTask<'_, ()>> = vec![
        Box::pin(labeled(OpKind::Get, async move {
            for _ in 0..3 {
                ep.read(region.at(0), 16).await.unwrap();
                crate::exec::yield_now().await;
            }
        })),
        Box::pin(labeled(OpKind::Scan, async move {
            for _ in 0..2 {
                ep.call(node, svc, vec![0; 10]).await.unwrap();
                crate::exec::yield_now().await;
            }
        })),
    ];
    run_tasks(tasks);
    let k = ep.counters();
    assert_eq!(k.get(OpKind::Get).round_trips, 3);
    assert_eq!(k.get(OpKind::Get).bytes_read, 48);
    assert_eq!(k.get(OpKind::Get).rpcs, 0);
    assert_eq!(k.get(OpKind::Scan).rpcs, 2);
    assert_eq!(k.get(OpKind::Scan).bytes_written, 20);
    assert_eq!(k.get(OpKind::Scan).reads, 0);
}

/// A crashed node refuses everything; the others go on.
pub fn crash_isolates_the_node(t: &dyn Target) {
    let c = t.cluster(2, 1);
    let (r0, _m0) = c.server(0).register_region(64).unwrap();
    let (r1, _m1) = c.server(1).register_region(64).unwrap();
    c.server(0)
        .services()
        .register("echo", Arc::new(echo))
        .unwrap();
    c.server(1)
        .services()
        .register("echo", Arc::new(echo))
        .unwrap();
    let ep = endpoint(&*c);
    let (n0, n1) = (c.server(0).id(), c.server(1).id());
    let s0 = block_on(ep.lookup_service(n0, "echo")).unwrap();
    let s1 = block_on(ep.lookup_service(n1, "echo")).unwrap();
    block_on(ep.write(r0.at(0), &[1; 8])).unwrap();
    if !c.crash(0) {
        return;
    }
    block_on(async {
        assert!(matches!(
            ep.read(r0.at(0), 8).await,
            Err(TransportError::NodeDown(_))
        ));
        assert!(matches!(
            ep.cas(r0.at(0), 0, 1).await,
            Err(TransportError::NodeDown(_))
        ));
        assert!(matches!(
            ep.call(n0, s0, vec![1]).await,
            Err(TransportError::NodeDown(_))
        ));
        ep.write(r1.at(0), &[2; 8]).await.unwrap();
        assert_eq!(ep.read(r1.at(0), 8).await.unwrap(), vec![2; 8]);
        assert_eq!(ep.call(n1, s1, vec![1, 2]).await.unwrap(), vec![2, 1]);
    });
}

/// Withdrawn regions are refused.
pub fn deregistered_region_is_refused(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let (region, _mem) = c.server(0).register_region(64).unwrap();
    let ep = endpoint(&*c);
    block_on(ep.write(region.at(0), &[1; 8])).unwrap();
    c.server(0).deregister_region(region.id);
    let e = block_on(ep.read(region.at(0), 8)).unwrap_err();
    assert!(matches!(e, TransportError::NoSuchRegion { .. }), "{e}");
}

/// A deferred service answers later from another thread; callers wait for it
/// while other requests are served, and an abandoned request fails cleanly.
pub fn deferred_replies(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let parked: Arc<Mutex<Vec<crate::service::Responder>>> = Arc::default();
    let p = parked.clone();
    let node = c.server(0);
    let svc = node
        .services()
        .register_deferred(
            "later",
            Arc::new(
                move |_: &RpcContext, req: &[u8], r: crate::service::Responder| match req {
                    b"park" => p.lock().push(r),
                    b"drop" => drop(r),
                    _ => r.reply(Ok(req.to_vec())),
                },
            ),
        )
        .unwrap();
    let echo = node.services().register("echo", Arc::new(echo)).unwrap();
    let ep = endpoint(&*c);
    let id = node.id();
    let releaser = {
        let parked = parked.clone();
        std::thread::spawn(move || {
            // Answer the parked request from this thread once it is there.
            for _ in 0..1000 {
                if let Some(r) = parked.lock().pop() {
                    r.reply(Ok(b"released".to_vec()));
                    return true;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
            false
        })
    };
    let tasks: Vec<LocalTask<'_, Vec<u8>>> = vec![
        Box::pin(async { ep.call(id, svc, b"park".to_vec()).await.unwrap() }),
        // The single handler thread is free while the first request waits.
        Box::pin(async { ep.call(id, echo, vec![1, 2]).await.unwrap() }),
        Box::pin(async { ep.call(id, svc, b"now".to_vec()).await.unwrap() }),
    ];
    assert_eq!(
        run_tasks(tasks),
        vec![b"released".to_vec(), vec![2, 1], b"now".to_vec()]
    );
    assert!(releaser.join().unwrap());
    let e = block_on(ep.call(id, svc, b"drop".to_vec())).unwrap_err();
    assert!(
        e.service_error()
            .unwrap()
            .message
            .contains("without replying"),
        "{e}"
    );
}

/// Every round trip lets the thread's other tasks run: a task spinning on a
/// remote lock held by another task of its thread does not starve it.
pub fn round_trips_let_other_tasks_run(t: &dyn Target) {
    let c = t.cluster(1, 1);
    let (region, _mem) = c.server(0).register_region(64).unwrap();
    let ep = endpoint(&*c);
    let lock = region.at(0);
    let ep = &ep;
    let tasks: Vec<LocalTask<'_, Result<(), String>>> = vec![
        Box::pin(async move {
            assert_eq!(
                ep.cas(lock, 0, 1).await.unwrap(),
                0,
                "the holder locks first"
            );
            // Suspend while holding the lock (as if waiting on an RPC).
            crate::exec::yield_now().await;
            for _ in 0..10 {
                ep.read(region.at(8), 8).await.unwrap();
            }
            ep.write(lock, &0u64.to_le_bytes()).await.unwrap();
            Ok(())
        }),
        Box::pin(async move {
            for _ in 0..1_000_000 {
                if ep.cas(lock, 0, 2).await.unwrap() == 0 {
                    return Ok(());
                }
            }
            Err("the spinning task never saw the lock released".into())
        }),
    ];
    for r in run_tasks(tasks) {
        r.unwrap();
    }
}

/// Expands every conformance check into a `#[test]` for a backend: pass an
/// expression that evaluates to a [`Target`].
#[macro_export]
macro_rules! conformance_tests {
    ($target:expr) => {
        #[test]
        fn conformance_read_write() {
            $crate::conformance::read_write(&$target)
        }
        #[test]
        fn conformance_atomics() {
            $crate::conformance::atomics(&$target)
        }
        #[test]
        fn conformance_word_atomicity() {
            $crate::conformance::word_atomicity(&$target)
        }
        #[test]
        fn conformance_batch_counts_once() {
            $crate::conformance::batch_counts_once(&$target)
        }
        #[test]
        fn conformance_bad_access_is_refused() {
            $crate::conformance::bad_access_is_refused(&$target)
        }
        #[test]
        fn conformance_rpc() {
            $crate::conformance::rpc(&$target)
        }
        #[test]
        fn conformance_tasks_overlap_and_handlers_are_counted() {
            $crate::conformance::tasks_overlap_and_handlers_are_counted(&$target)
        }
        #[test]
        fn conformance_counters_follow_labels() {
            $crate::conformance::counters_follow_labels(&$target)
        }
        #[test]
        fn conformance_crash_isolates_the_node() {
            $crate::conformance::crash_isolates_the_node(&$target)
        }
        #[test]
        fn conformance_deferred_replies() {
            $crate::conformance::deferred_replies(&$target)
        }
        #[test]
        fn conformance_round_trips_let_other_tasks_run() {
            $crate::conformance::round_trips_let_other_tasks_run(&$target)
        }
        #[test]
        fn conformance_deregistered_region_is_refused() {
            $crate::conformance::deregistered_region_is_refused(&$target)
        }
    };
}
