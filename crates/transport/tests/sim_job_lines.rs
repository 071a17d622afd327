//! `sim`'s distinct-lines rule for memory-node jobs (docs/simulation.md,
//! "Distinct lines for memory-node jobs (branch i46)"): one RPC handler
//! call, or one worker job between progress points, is charged each cache
//! line of registered memory at its FIRST touch only (`line_ns`, or the
//! LLC model's miss cost where it misses); later touches of the line in
//! the same job are free. Each test says what the per-access rule of
//! earlier versions charged, which it would fail on.

use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::sim::{Profile, SimConfig, SimCores, Simulation, job_progress};
use dmkv_transport::thread_cpu_ns;
use dmkv_transport::{NodeHost, RegionMem, RpcContext};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

/// A step of a handler's script: read the word at the start of line `l`
/// (`Word`), read lines `a..=b` in one access (`Span`), or wait for one
/// SSD read of the handler's node in a nested scheduler frame (`Ssd`).
#[derive(Clone, Copy)]
enum Step {
    Word(u64),
    Span(u64, u64),
    Ssd,
}

fn encode(steps: &[Step]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in steps {
        let (tag, a, b) = match *s {
            Step::Word(l) => (0u64, l, 0),
            Step::Span(a, b) => (1, a, b),
            Step::Ssd => (2, 0, 0),
        };
        for x in [tag, a, b] {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

fn decode(req: &[u8]) -> Vec<Step> {
    req.chunks_exact(24)
        .map(|c| {
            let x = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap());
            match x(0) {
                0 => Step::Word(x(1)),
                1 => Step::Span(x(1), x(2)),
                _ => Step::Ssd,
            }
        })
        .collect()
}

fn run_steps(mem: &RegionMem, node: dmkv_transport::NodeId, steps: &[Step]) {
    for s in steps {
        match *s {
            Step::Word(l) => {
                mem.load_u64(l * 64).unwrap();
            }
            Step::Span(a, b) => {
                let mut buf = vec![0u8; ((b - a + 1) * 64) as usize];
                mem.read(a * 64, &mut buf).unwrap();
            }
            Step::Ssd => dmkv_transport::sim::ssd_io_blocking(node, false, 1),
        }
    }
}

/// One memory node (`cores` handler cores, a 1 MiB region) whose service
/// `script` runs the steps in its request and answers with the CPU its
/// core was charged for them (the virtual CPU clock of its core before and
/// after, so the per-message `rpc_base_ns` is not in it).
struct Rig {
    sim: Simulation,
    server: dmkv_transport::NodeId,
    client: dmkv_transport::NodeId,
    script: dmkv_transport::ServiceId,
    mem: Arc<RegionMem>,
}

fn rig(profile: Profile, cores: usize) -> Rig {
    let sim = Simulation::new(SimConfig {
        profile,
        seed: 1,
        jitter_ns: 0,
        delays: Default::default(),
    });
    let node = sim.add_node(cores);
    let server = node.id();
    let (_region, mem) = node.register_region(1 << 20).unwrap();
    let m = mem.clone();
    let script = node
        .services()
        .register(
            "script",
            Arc::new(move |_: &RpcContext, req: &[u8]| {
                let t0 = thread_cpu_ns();
                run_steps(&m, server, &decode(req));
                Ok((thread_cpu_ns() - t0).to_le_bytes().to_vec())
            }),
        )
        .unwrap();
    let client = sim.add_node(0).id();
    Rig {
        sim,
        server,
        client,
        script,
        mem,
    }
}

impl Rig {
    /// The CPU one call of `steps` was charged for its memory accesses.
    fn charged(&self, steps: &[Step]) -> u64 {
        self.charged_together(&[steps]).pop().unwrap()
    }

    /// Issues one call per script at once, from one client task each;
    /// returns each call's charged CPU.
    fn charged_together(&self, scripts: &[&[Step]]) -> Vec<u64> {
        let ep = Rc::new(self.sim.fabric().endpoint(self.client).unwrap());
        let tasks: Vec<LocalTask<'_, u64>> = scripts
            .iter()
            .map(|s| {
                let (ep, req) = (ep.clone(), encode(s));
                let (server, svc) = (self.server, self.script);
                Box::pin(async move {
                    let r = ep.call(server, svc, req).await.unwrap();
                    u64::from_le_bytes(r[..8].try_into().unwrap())
                }) as LocalTask<'_, u64>
            })
            .collect();
        run_tasks(tasks)
    }

    fn count(&self, what: &str) -> u64 {
        self.sim
            .resources()
            .iter()
            .find(|r| r.name == format!("node0 llc {what}"))
            .map_or(0, |r| r.count)
    }
}

/// The default profile without a cache model: every first touch costs
/// `line_ns`.
fn flat() -> Profile {
    let mut p = Profile::default_profile();
    p.memnode.llc_bytes = 0;
    p
}

/// The default profile with a 64 KiB, 8-way LLC (1024 lines).
fn small_llc() -> Profile {
    let mut p = Profile::default_profile();
    p.memnode.llc_bytes = 64 << 10;
    p.memnode.llc_ways = 8;
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
