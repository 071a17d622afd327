//! `sim`'s instruction term for memory-node jobs (docs/simulation.md, "An
//! instruction term for memory-node jobs (branch i49)"): work a handler or
//! worker job declares with `sim::work(n)` costs `n / (cpu_ghz x ipc)` ns
//! of its core, exactly (`floor(total x 1000 / rate)` per job), on top of
//! the per-message cost and the lines it touches. Each test says what the
//! model without the term (declared work free) would give, which it fails
//! on.

use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimCores, job_progress, work};
use dmkv_transport::thread_cpu_ns;
use std::cell::Cell;
use std::rc::Rc;

mod script_rig;
use script_rig::{Rig, Step, flat, rig};

impl Rig {
    /// Instructions memory-node jobs declared so far (the report's row).
    fn declared(&self) -> u64 {
        self.resource_count("memnode declared instructions")
    }
}

/// ns the model charges a job that declared `n` instructions in all.
fn ns(p: &Profile, n: u64) -> u64 {
    n * 1000 / p.memnode.instructions_per_us()
}

/// Two handlers touching the same lines but declaring different work are
/// charged differently, by exactly the modelled amount, in their core's
/// CPU and in the caller's round trip. (Without the term: equal.)
#[test]
fn the_same_lines_with_different_work_cost_exactly_the_work_apart() {
    let p = flat();
    assert_eq!(p.memnode.instructions_per_us(), 4_200, "rolex-cx5's rate");
    let line = p.memnode.line_ns;
    let r = rig(p.clone(), 1);
    let lines = [Step::Word(3), Step::Word(4), Step::Word(3), Step::Word(9)];
    let with = |n: u64| -> Vec<Step> {
        let mut s = lines.to_vec();
        s.insert(2, Step::Work(n));
        s
    };
    let light = r.charged(&with(300));
    let heavy = r.charged(&with(1_200));
    assert_eq!(light, 3 * line + ns(&p, 300));
    assert_eq!(heavy, 3 * line + ns(&p, 1_200));
    assert_eq!(
        heavy - light,
        285 - 71,
        "1,200 and 300 instructions at 4.2 per ns"
    );
    assert_eq!(r.charged(&lines), 3 * line, "no declaration: lines only");
    // The reply leaves when the service time (rpc_base_ns included) is
    // over: the round trips differ by the same amount.
    let a = r.round_trip(&with(300));
    let b = r.round_trip(&with(1_200));
    assert_eq!(b - a, heavy - light);
    assert_eq!(r.declared(), 2 * (300 + 1_200), "reported in all");
}

/// A job's work is charged as one total, however it is declared: 4,200
/// single instructions are exactly 1,000 ns (not 4,200 x floor(0.24) = 0),
/// and 3 x 100 is what 300 is.
#[test]
fn a_jobs_work_is_charged_as_one_total() {
    let p = flat();
    let r = rig(p.clone(), 1);
    let singles = vec![Step::Work(1); 4_200];
    assert_eq!(r.charged(&singles), 1_000);
    assert_eq!(
        r.charged(&[Step::Work(100), Step::Work(100), Step::Work(100)]),
        ns(&p, 300)
    );
    assert_eq!(ns(&p, 300), 71);
}

/// Declared work costs nothing off `sim`, on a compute task (not a metered
/// memory-node core), and with a profile without the instruction term.
#[test]
fn declared_work_off_a_memory_node_core_costs_nothing() {
    // No simulation on this thread: a no-op.
    work(1 << 40);
    // A compute task's core is not charged.
    let r = rig(flat(), 1);
    let cpu = block_on(async {
        let t0 = thread_cpu_ns();
        work(1_000_000);
        thread_cpu_ns() - t0
    });
    assert_eq!(cpu, 0);
    assert_eq!(r.declared(), 0, "not a memory-node job's work");
    drop(r);
    // A profile without the term (the model of earlier versions).
    let mut p = flat();
    p.memnode.cpu_ghz = 0.0;
    p.memnode.ipc = 0.0;
    let line = p.memnode.line_ns;
    let r = rig(p, 1);
    assert_eq!(r.charged(&[Step::Word(1), Step::Work(1_000_000)]), line);
}

/// A handler that waits in a nested scheduler frame keeps its count across
/// the wait, and a handler that runs on another core during that wait has a
/// count of its own. (A shared count would charge the second handler
/// floor(200k/4200) - floor(100k/4200) = 24 instead of 23; a count not put
/// back would charge the first 23 + 23 = 46 instead of 47.)
#[test]
fn a_handler_run_during_another_handlers_wait_declares_its_own_work() {
    let p = flat();
    let r = rig(p.clone(), 2);
    let waiting = [Step::Work(100), Step::Ssd, Step::Work(100)];
    let during = [Step::Work(100)];
    let charged = r.charged_together(&[&waiting, &during]);
    assert_eq!(charged, vec![ns(&p, 200), ns(&p, 100)]);
    assert_eq!((ns(&p, 200), ns(&p, 100)), (47, 23));
}

/// A worker job's declared work is part of its cost (`job_base_ns` + work),
/// also across a progress point, where what was declared before it passes
/// in virtual time and the total stays exact.
#[test]
fn a_worker_jobs_work_is_charged_across_progress_points() {
    let p = flat();
    let base = p.memnode.job_base_ns;
    let r = rig(p.clone(), 1);
    let cores = SimCores::new("worker", 1).unwrap();
    let run = |progress: bool| -> u64 {
        let cost = Rc::new(Cell::new(None));
        let c = cost.clone();
        let mem = r.mem.clone();
        cores.submit(
            Box::new(move || {
                mem.load_u64(0).unwrap();
                work(2_000);
                if progress {
                    job_progress(None, 1_000);
                }
                work(2_200);
            }),
            Box::new(move |ns| c.set(Some(ns))),
        );
        block_on(async {
            while cost.get().is_none() {
                dmkv_transport::exec::sleep(std::time::Duration::from_micros(1)).await;
            }
        });
        cost.get().unwrap()
    };
    let line = p.memnode.line_ns;
    assert_eq!(run(false), base + line + 1_000);
    // After the progress point the line is charged again only if touched
    // again (it is not here); the work is 4,200 instructions either way.
    assert_eq!(run(true), base + line + 1_000);
}

/// Profiles refuse half an instruction term.
#[test]
fn a_profile_with_half_an_instruction_term_is_refused() {
    let text = dmkv_transport::sim::profile::SHIPPED[0].1;
    let no_ipc = text.replace("ipc = 2.0", "ipc = 0.0");
    let e = Profile::parse(&no_ipc).unwrap_err();
    assert!(e.contains("memnode.ipc"), "{e}");
    let bad = text.replace("ipc = 2.0", "ipc = -1.0");
    assert!(Profile::parse(&bad).unwrap_err().contains("memnode.ipc"));
    let none = text.replace("ipc = 2.0", "").replace("cpu_ghz = ", "# ");
    let p = Profile::parse(&none).unwrap();
    assert_eq!(p.memnode.instructions_per_us(), 0, "no term: parses");
}
