//! Waits and the livelock limit under `sim`: a wait polled again by its
//! task schedules no second wake, and `OpLimit` gives an operation up at
//! its limit while leaving every other event of the run as it was.

use dmkv_transport::exec::{LocalTask, OpLimit, block_on, run_tasks, sleep};
use dmkv_transport::sim::{Profile, SimConfig, Simulation};
use std::cell::RefCell;
use std::future::Future;
use std::pin::pin;
use std::time::Duration;

fn sim(seed: u64) -> Simulation {
    Simulation::new(SimConfig {
        profile: Profile::default_profile(),
        seed,
        jitter_ns: 0,
        delays: Default::default(),
    })
}

#[test]
fn a_wait_polled_again_by_its_task_schedules_no_second_wake() {
    let sim = sim(1);
    let start = sim.now_ns();
    let (pending_during, woke_at) = block_on(async {
        let mut long = pin!(sleep(Duration::from_millis(1)));
        let mut most = 0;
        // 1,000 short waits, each waking the task, which polls the long
        // wait again every time (a wait inside a select).
        for _ in 0..1000 {
            let mut short = pin!(sleep(Duration::from_nanos(100)));
            std::future::poll_fn(|cx| {
                assert!(long.as_mut().poll(cx).is_pending());
                short.as_mut().poll(cx)
            })
            .await;
            most = most.max(sim.pending_events());
        }
        long.await;
        (most, sim.now_ns())
    });
    // The long wait's wake and at most the next short one's: before waits
    // were armed once per waker, one more wake per poll (1,000).
    assert!(
        pending_during <= 2,
        "{pending_during} events pending while one wait was polled 1,000 times"
    );
    assert_eq!(
        woke_at - start,
        1_000_000,
        "the long wait ends when it is due"
    );
}

/// One run of `tasks` tasks doing `ops` operations each, every operation a
/// wait of a seeded random length (drawn from the simulation's generator,
/// so that any extra draw would move every later one) and a yield; with
/// `limit`, each operation under an `OpLimit`. Returns each operation's end
/// (task, virtual time), the events run and the most events pending.
fn seeded_run(
    limit: Option<Duration>,
    tasks: usize,
    ops: usize,
) -> (Vec<(usize, u64)>, u64, usize) {
    let sim = sim(7);
    let ends = RefCell::new(Vec::new());
    let most = std::cell::Cell::new(0);
    let work: Vec<LocalTask<'_, ()>> = (0..tasks)
        .map(|t| {
            let (sim, ends, most) = (&sim, &ends, &most);
            Box::pin(async move {
                let watchdog = limit.map(OpLimit::new);
                for _ in 0..ops {
                    let op = async {
                        let ns = 50 + dmkv_transport::sim::random_u64() % 2000;
                        sleep(Duration::from_nanos(ns)).await;
                        dmkv_transport::exec::yield_now().await;
                    };
                    match &watchdog {
                        Some(w) => {
                            assert!(w.run(op).await.is_some(), "no operation reaches the limit")
                        }
                        None => op.await,
                    }
                    ends.borrow_mut().push((t, sim.now_ns()));
                    most.set(most.get().max(sim.pending_events()));
                }
            }) as LocalTask<'_, ()>
        })
        .collect();
    run_tasks(work);
    let events = sim.events();
    (ends.into_inner(), events, most.get())
}

#[test]
fn an_op_limit_changes_nothing_in_a_run_where_no_operation_reaches_it() {
    let (tasks, ops) = (8, 2000);
    let plain = seeded_run(None, tasks, ops);
    for limit in [
        Duration::from_micros(5),
        Duration::from_millis(1),
        Duration::from_secs(10),
    ] {
        let limited = seeded_run(Some(limit), tasks, ops);
        assert_eq!(limited.0.len(), plain.0.len());
        if let Some(i) = (0..plain.0.len()).find(|&i| limited.0[i] != plain.0[i]) {
            panic!(
                "under a {limit:?} limit operation end {i} is (task, ns) {:?}, without {:?}",
                limited.0[i], plain.0[i]
            );
        }
        assert_eq!(limited.1, plain.1, "events counted under a {limit:?} limit");
        // Each task's wait and yield, and at most one check per task: the
        // per-operation timer left one wake per operation pending until
        // its instant (16,000 at 10 s).
        assert!(
            limited.2 <= plain.2 + tasks,
            "{} events pending under a {limit:?} limit, {} without",
            limited.2,
            plain.2
        );
    }
}

#[test]
fn an_op_limit_gives_up_an_operation_at_its_limit() {
    let sim = sim(3);
    let limit = Duration::from_micros(10);
    let watchdog = OpLimit::new(limit);
    // A wait nothing ends: given up when the limit passes.
    let began = sim.now_ns();
    let out = block_on(watchdog.run(std::future::pending::<()>()));
    assert_eq!(out, None);
    assert_eq!(
        sim.now_ns() - began,
        10_000,
        "given up exactly at the limit"
    );
    // A livelock (an operation that keeps waiting 100 ns at a time): given
    // up at the first poll at or after the limit, and never polled again.
    let polls = std::cell::Cell::new(0u64);
    let began = sim.now_ns();
    let out = block_on(watchdog.run(async {
        loop {
            polls.set(polls.get() + 1);
            sleep(Duration::from_nanos(100)).await;
        }
    }));
    let took = sim.now_ns() - began;
    assert_eq!(out, None::<()>);
    assert!((10_000..10_100).contains(&took), "given up after {took} ns");
    assert_eq!(
        polls.get(),
        took / 100,
        "the operation ran until it was given up"
    );
    // An operation inside the limit completes, and the next one gets a
    // limit of its own (not what is left of the first's).
    assert_eq!(
        block_on(watchdog.run(sleep(Duration::from_micros(9)))),
        Some(())
    );
    assert_eq!(
        block_on(watchdog.run(sleep(Duration::from_micros(9)))),
        Some(())
    );
}
