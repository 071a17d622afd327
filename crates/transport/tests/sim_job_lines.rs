//! `sim`'s distinct-lines rule for memory-node jobs (docs/simulation.md,
//! "Distinct lines for memory-node jobs (branch i46)"): one RPC handler
//! call, or one worker job between progress points, is charged each cache
//! line of registered memory at its FIRST touch only (`line_ns`, or the
//! LLC model's miss cost where it misses); later touches of the line in
//! the same job are free. Each test says what the per-access rule of
//! earlier versions charged, which it would fail on.

use dmkv_transport::exec::block_on;
use dmkv_transport::sim::{Profile, SimCores, job_progress};
use std::cell::Cell;
use std::rc::Rc;

mod script_rig;
use script_rig::{Rig, Step, flat, rig};

impl Rig {
    /// The report's count of the memory node's LLC `what` (hits, misses,
    /// dependent misses).
    fn count(&self, what: &str) -> u64 {
        self.resource_count(&format!("node0 llc {what}"))
    }
}

/// The default profile with a 64 KiB, 8-way LLC (1024 lines).
fn small_llc() -> Profile {
    let mut p = Profile::default_profile();
    p.memnode.llc_bytes = 64 << 10;
    p.memnode.llc_ways = 8;
    // The LLC rule alone (private caches: sim_core_cache.rs).
    p.memnode.core_cache_bytes = 0;
    p.memnode.core_cache_ways = 0;
    p.memnode.core_cache_hit_ns = 0;
    p
}

/// A handler reading one line word by word is charged that line once;
/// reading it in one access costs the same. (Per access: 8 x `line_ns`
/// against 1 x.)
#[test]
fn a_handler_reading_one_line_word_by_word_is_charged_one_line() {
    let p = flat();
    let line = p.memnode.line_ns;
    let r = rig(p, 1);
    let by_word: Vec<Step> = (0..8).map(|_| Step::Word(40)).collect();
    assert_eq!(r.charged(&by_word), line);
    assert_eq!(r.charged(&[Step::Span(40, 40)]), line);
    // A line re-read after other lines, and a span over lines already
    // touched, add only the new lines.
    assert_eq!(
        r.charged(&[
            Step::Word(1),
            Step::Word(2),
            Step::Word(1),
            Step::Span(1, 4),
            Step::Word(3)
        ]),
        4 * line
    );
}

/// Each handler call is a job of its own: the second call of the same
/// script pays its lines again (two handlers are charged independently).
/// With a cache model the second call's lines hit.
#[test]
fn two_handler_calls_are_charged_independently() {
    let p = small_llc();
    let m = p.memnode.clone();
    let r = rig(p, 1);
    let script = [Step::Word(9), Step::Word(9), Step::Word(700), Step::Word(9)];
    assert_eq!(
        r.charged(&script),
        2 * m.dram_miss_ns,
        "cold: two lines, each a dependent miss"
    );
    assert_eq!(r.charged(&script), 2 * m.line_ns, "warm: two hits");
    // Re-touches never reach the cache model: 4 first touches in all, not
    // the 8 accesses (per access: 3 hits and 1 miss more).
    assert_eq!((r.count("misses"), r.count("hits")), (2, 2));
    assert_eq!(r.count("dependent misses"), 2);
}

/// A re-touched first line makes no later line of the access a dependent
/// miss: the further lines' addresses were known with the first's, so
/// their misses overlap as before (`line_ns` each), and a job is never
/// charged more than the per-access rule charged it. (Per access: the
/// span's first line is an LLC hit, one more `line_ns`.)
#[test]
fn a_span_after_its_first_line_pays_line_ns_for_the_rest() {
    let p = small_llc();
    let m = p.memnode.clone();
    let r = rig(p, 1);
    assert_eq!(
        r.charged(&[Step::Word(100), Step::Span(100, 103)]),
        m.dram_miss_ns + 3 * m.line_ns
    );
    assert_eq!(r.count("dependent misses"), 1);
    // A span whose first line is new still pays the dependent miss, and
    // lines the job touched before inside it are free.
    assert_eq!(
        r.charged(&[Step::Word(502), Step::Span(500, 503)]),
        m.dram_miss_ns + m.dram_miss_ns + 2 * m.line_ns
    );
}

/// A handler that waits in a nested scheduler frame (an SSD read) keeps
/// its set across the wait, and a handler that runs on another core during
/// that wait has a set of its own: nothing leaks either way. (A shared set
/// would let the second handler's lines be free; a set not put back would
/// charge the first handler its line 5 again.)
#[test]
fn a_handler_run_during_another_handlers_wait_has_its_own_lines() {
    let p = flat();
    let line = p.memnode.line_ns;
    let r = rig(p, 2);
    let waiting = [
        Step::Word(5),
        Step::Ssd,
        Step::Word(5),
        Step::Word(6),
        Step::Word(5),
    ];
    let during = [Step::Word(5), Step::Word(6), Step::Word(5), Step::Word(7)];
    let charged = r.charged_together(&[&waiting, &during]);
    assert_eq!(charged, vec![2 * line, 3 * line]);
    // Nothing of either set is left: a new call pays its lines.
    assert_eq!(r.charged(&[Step::Word(5), Step::Word(6)]), 2 * line);
}

/// A worker job is charged per distinct line between progress points: a
/// line re-touched after `job_progress` is charged again, and a line
/// re-touched within one slice is not. (Per access: 4 lines in both jobs;
/// without the restart at the progress point, 1 in the second.)
#[test]
fn a_worker_job_pays_a_line_again_after_a_progress_point() {
    let p = flat();
    let (line, base) = (p.memnode.line_ns, p.memnode.job_base_ns);
    let r = rig(p, 1);
    let cores = SimCores::new("worker", 1).unwrap();
    let run = |progress: bool| -> u64 {
        let cost = Rc::new(Cell::new(None));
        let (c, mem) = (cost.clone(), r.mem.clone());
        cores.submit(
            Box::new(move || {
                mem.load_u64(64 * 3).unwrap();
                mem.load_u64(64 * 3 + 8).unwrap();
                if progress {
                    job_progress(None, 1_000);
                }
                mem.load_u64(64 * 3).unwrap();
                mem.load_u64(64 * 3 + 16).unwrap();
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
    assert_eq!(run(false), base + line, "one slice: one line");
    assert_eq!(run(true), base + 2 * line, "two slices: the line in each");
}
