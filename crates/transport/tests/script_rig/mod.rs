//! A scripted memory-node handler for the sim cost-model tests
//! (`sim_job_lines.rs`, `sim_work.rs`): one memory node whose service runs
//! the steps in its request and answers with the CPU its core was charged
//! for them, so each test states exactly what the model must charge.
//!
//! Shared by several test targets, each of which uses part of it.
#![allow(dead_code)]

use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport::sim::{Profile, SimConfig, Simulation, work};
use dmkv_transport::thread_cpu_ns;
use dmkv_transport::{NodeHost, NodeId, RegionMem, RpcContext, ServiceId};
use std::rc::Rc;
use std::sync::Arc;

/// A step of a handler's script: read the word at the start of line `l`
/// (`Word`), read lines `a..=b` in one access (`Span`), declare `n`
/// instructions of work (`Work`), wait for one SSD read of the
/// handler's node in a nested scheduler frame (`Ssd`), or store to the
/// word at the start of line `l` (`Store`).
#[derive(Clone, Copy)]
pub enum Step {
    Word(u64),
    Span(u64, u64),
    Work(u64),
    Ssd,
    Store(u64),
}

pub fn encode(steps: &[Step]) -> Vec<u8> {
    let mut out = Vec::new();
    for s in steps {
        let (tag, a, b) = match *s {
            Step::Word(l) => (0u64, l, 0),
            Step::Span(a, b) => (1, a, b),
            Step::Work(n) => (2, n, 0),
            Step::Ssd => (3, 0, 0),
            Step::Store(l) => (4, l, 0),
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
                2 => Step::Work(x(1)),
                4 => Step::Store(x(1)),
                _ => Step::Ssd,
            }
        })
        .collect()
}

fn run_steps(mem: &RegionMem, node: NodeId, steps: &[Step]) {
    for s in steps {
        match *s {
            Step::Word(l) => {
                mem.load_u64(l * 64).unwrap();
            }
            Step::Span(a, b) => {
                let mut buf = vec![0u8; ((b - a + 1) * 64) as usize];
                mem.read(a * 64, &mut buf).unwrap();
            }
            Step::Work(n) => work(n),
            Step::Ssd => dmkv_transport::sim::ssd_io_blocking(node, false, 1),
            Step::Store(l) => mem.store_u64(l * 64, 1).unwrap(),
        }
    }
}

/// One memory node (`cores` handler cores, a 1 MiB region) whose service
/// `script` runs the steps in its request and answers with the CPU its
/// core was charged for them (the virtual CPU clock of its core before and
/// after, so the per-message `rpc_base_ns` is not in it), and one client.
pub struct Rig {
    pub sim: Simulation,
    pub server: NodeId,
    pub client: NodeId,
    pub script: ServiceId,
    pub mem: Arc<RegionMem>,
    /// The region, for one-sided verbs on it.
    pub region: dmkv_transport::RemoteRegion,
}

pub fn rig(profile: Profile, cores: usize) -> Rig {
    let sim = Simulation::new(SimConfig {
        profile,
        seed: 1,
        jitter_ns: 0,
        delays: Default::default(),
    });
    let node = sim.add_node(cores);
    let server = node.id();
    let (region, mem) = node.register_region(1 << 20).unwrap();
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
        region,
    }
}

impl Rig {
    /// The CPU one call of `steps` was charged.
    pub fn charged(&self, steps: &[Step]) -> u64 {
        self.charged_together(&[steps]).pop().unwrap()
    }

    /// Issues one call per script at once, from one client task each;
    /// returns each call's charged CPU.
    pub fn charged_together(&self, scripts: &[&[Step]]) -> Vec<u64> {
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
    pub fn round_trip(&self, steps: &[Step]) -> u64 {
        let ep = self.sim.fabric().endpoint(self.client).unwrap();
        let t0 = self.sim.now_ns();
        block_on(ep.call(self.server, self.script, encode(steps))).unwrap();
        self.sim.now_ns() - t0
    }

    /// The count of the report's resource row `name` (0 without one).
    pub fn resource_count(&self, name: &str) -> u64 {
        self.sim
            .resources()
            .iter()
            .find(|r| r.name == name)
            .map_or(0, |r| r.count)
    }
}

/// The default profile without a cache model: every first touch costs
/// `line_ns`.
pub fn flat() -> Profile {
    let mut p = Profile::default_profile();
    p.memnode.llc_bytes = 0;
    p
}
