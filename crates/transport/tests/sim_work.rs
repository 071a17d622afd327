//! `sim`'s instruction term for memory-node jobs (docs/simulation.md, "An
//! instruction term for memory-node jobs (branch i49)"): work a handler or
//! worker job declares with `sim::work(n)` costs `n / (cpu_ghz x ipc)` ns
//! of its core, exactly (`floor(total x 1000 / rate)` per job), on top of
//! the per-message cost and the lines it touches. Each test says what the
//! model without the term (declared work free) would give, which it fails
//! on.

use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::sim::{Profile, SimConfig, SimCores, Simulation, job_progress, work};
use dmkv_transport::thread_cpu_ns;
use dmkv_transport::{NodeHost, RegionMem, RpcContext};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

/// A step of a handler's script: read the word at the start of line `l`,
/// declare `n` instructions, or wait for one SSD read of the handler's
/// node in a nested scheduler frame.
#[derive(Clone, Copy)]
enum Step {
    Word(u64),
    Work(u64),
    Ssd,
}

fn encode(steps: &[Step]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in steps {
        let (tag, a) = match *s {
            Step::Word(l) => (0u64, l),
            Step::Work(n) => (1, n),
            Step::Ssd => (2, 0),
        };
        for x in [tag, a] {
            out.extend_from_slice(&x.to_le_bytes());
        }
    }
    out
}

fn decode(req: &[u8]) -> Vec<Step> {
    req.chunks_exact(16)
        .map(|c| {
            let x = |i: usize| u64::from_le_bytes(c[i * 8..i * 8 + 8].try_into().unwrap());
            match x(0) {
                0 => Step::Word(x(1)),
                1 => Step::Work(x(1)),
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
            Step::Work(n) => work(n),
            Step::Ssd => dmkv_transport::sim::ssd_io_blocking(node, false, 1),
        }
    }
}

/// One memory node (`cores` handler cores, a 1 MiB region) whose service
/// runs the steps in its request and answers with the CPU its core was
/// charged for them (so `rpc_base_ns` is not in it).
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
    fn charged(&self, steps: &[Step]) -> u64 {
        self.charged_together(&[steps]).pop().unwrap()
    }

    /// One call per script at once, one client task each; each call's
    /// charged CPU.
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

    /// The virtual time one call takes, end to end.
    fn round_trip(&self, steps: &[Step]) -> u64 {
        let ep = self.sim.fabric().endpoint(self.client).unwrap();
        let t0 = self.sim.now_ns();
        block_on(ep.call(self.server, self.script, encode(steps))).unwrap();
        self.sim.now_ns() - t0
    }

    fn declared(&self) -> u64 {
        self.sim
            .resources()
            .iter()
            .find(|r| r.name == "memnode declared instructions")
            .map_or(0, |r| r.count)
    }
}

/// The default profile (rolex-cx5: 2.1 GHz, IPC 2, 4,200 instructions per
/// microsecond) without a cache model: every first touch costs `line_ns`.
fn flat() -> Profile {
    let mut p = Profile::default_profile();
    p.memnode.llc_bytes = 0;
    p
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
