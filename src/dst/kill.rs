//! A compute client dying mid-operation (`dmkv dst --faults kill`).
//!
//! Four client threads, two per compute node (on symmetric designs, where
//! the engine puts them), two tasks each, every task owning its own keys
//! (interleaved in key order, so that in the tree designs the tasks' keys
//! share leaves). Each task updates its existing keys and inserts its fresh
//! ones, in a seeded order; after each of its operations a survivor also
//! reads a key of the victim. At a seeded virtual instant during the
//! victim's run (while its `n`-th operation is in flight, `d` ns after it
//! started) the victim compute node dies: the tasks of its threads are dropped where they stand
//! and never polled again. Verbs it had posted still land (or not) as the
//! network delivers them; locks it held stay held (no design here recovers
//! a dead client's lock).
//!
//! What is checked:
//! 1. The victim issues nothing after the kill: its client cores post no
//!    verb or RPC after that instant.
//! 2. Every acknowledged operation (the victim's before the kill, every
//!    survivor's) answered rightly and is visible in the end.
//! 3. An operation in flight when the kill hit (or a survivor's abandoned
//!    as blocked) is all-or-nothing for its key: the key ends with the old
//!    value or the new one, intact; an operation never started left its
//!    key alone. Every read, during the run and after, returns an intact
//!    value of its key at an allowed version (a torn or foreign value
//!    fails).
//! 4. Survivors' operations complete, except that an operation blocked by
//!    the dead client's lock would wait forever in every design here (none
//!    bounds its lock waits, and none recovers a dead holder's lock): the
//!    harness abandons an operation still running [`OP_LIMIT`] of virtual
//!    time after the kill instant and counts it as blocked. Before the
//!    kill nothing is dead, so nothing is abandoned then (an operation
//!    dropped mid-way could leave a lock held by no one): an operation of
//!    the victim or a survivor past the livelock limit (`--op-limit-ms`)
//!    before the kill fails the seed. Designs whose writers take no lock a client
//!    holds across round trips (RPC writes: xstore, rpc-btree, rpc-hash,
//!    outback; lock-free RACE) must never block ([`may_block`]): their
//!    survivors are abandoned only at the mixed run's `--op-limit-ms` (a
//!    wait that never ends), and an operation longer than [`OP_LIMIT`]
//!    fails the seed unless the engine's own bounded waits explain it
//!    ([`bounded_wait`]: Outback buffers inserts and deletes while a table
//!    is resized, and the writer waits for the resize, which the memory
//!    node ends by itself, dead client or not).

use super::{DstFailure, DstParams, FaultPlan, dst_replay, sim_config};
use dmkv_api::EngineSpec;
use dmkv_api::payload::{check_value, make_value};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks, sleep, sleep_until, unless};
use dmkv_transport::time::Instant;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use std::cell::{Cell, RefCell};
use std::task::Poll;
use std::time::Duration;

/// Client threads, [`PER_NODE`] per compute node on disaggregated designs.
const THREADS: usize = 4;
const PER_NODE: usize = 2;
/// Tasks per client thread.
const TASKS: usize = 2;
/// Existing keys each task updates, and fresh keys it inserts.
const OWN_KEYS: usize = 6;
const OWN_FRESH: usize = 3;
/// A survivor's operation taking longer than this (virtual time) is
/// abandoned and counted as blocked; operations take microseconds.
pub const OP_LIMIT: Duration = Duration::from_micros(300);

/// Whether `engine`'s survivors may be blocked by a dead client: its
/// writers hold a lock word in memory-node memory across round trips, and
/// nothing recovers a dead holder's lock (see docs/simulation.md).
pub fn may_block(engine: &str) -> bool {
    matches!(engine, "sherman" | "rolex" | "cell" | "scalestore")
}

/// How much longer than [`OP_LIMIT`] a survivor's operation may take in a
/// run whose engine reported `stats`: the time the engine itself held
/// requests back, which no client (dead or alive) prolongs. For Outback,
/// the resizes: a write during one is answered at once (invariant 17 of
/// docs/outback.md), but under sim the resize's work takes the memory
/// node's handler core in turns with requests (`resize_slice_us` at a
/// time), so a request can queue behind it, and a write that meets a
/// switch is told STALE and re-fetches the locator. Bound: the resizes'
/// held time (`resize_ms_total`; an operation can wait behind several
/// resizes one after another, never longer than all of them) plus one
/// [`OP_LIMIT`] per resize for the STALE re-fetch and re-send. Zero for
/// every other engine (RACE reports `resizes` too, but its directory
/// doublings hold no writer back) and for Outback runs without resizes.
pub fn bounded_wait(engine: &str, stats: &serde_json::Value) -> Duration {
    if engine != "outback" {
        return Duration::ZERO;
    }
    let held_ms = stats["resize_ms_total"].as_f64().unwrap_or(0.0);
    let resizes = stats["resizes"].as_u64().unwrap_or(0);
    Duration::from_nanos((held_ms * 1e6) as u64) + OP_LIMIT * resizes as u32
}

/// What one kill did.
#[derive(Debug, Clone)]
pub struct KillOutcome {
    /// The kill hit while a victim operation was in flight (not after the
    /// victim had finished).
    pub killed_mid_op: bool,
    /// Survivor operations abandoned as blocked.
    pub blocked: u64,
    /// Survivor operations longer than [`OP_LIMIT`] that completed, and the
    /// longest survivor operation (engines that never block).
    pub slow: u64,
    pub longest: Duration,
    /// The engine's figures at the end (`engine_stats`).
    pub stats: serde_json::Value,
    /// The simulation's held frames (`Simulation::frames_held`).
    pub held: dmkv_transport::sim::FramesHeld,
}

#[derive(Debug, Clone, Copy, PartialEq)]
enum Kind {
    Update,
    Insert,
}

#[derive(Debug, Clone, PartialEq)]
enum Status {
    NotStarted,
    /// In flight when the client died or was abandoned.
    InDoubt,
    Acked(Result<bool, String>),
}

/// Counts a victim task out of `victim_left` when it ends (drops).
struct VictimLeft<'a>(&'a Cell<usize>);

impl Drop for VictimLeft<'_> {
    fn drop(&mut self) {
        self.0.set(self.0.get() - 1);
    }
}

/// Runs the kill phase of `seed`; Err names the first broken promise.
pub fn kill_client(
    spec: &'static dyn EngineSpec,
    seed: u64,
    p: &DstParams,
    plan: &FaultPlan,
) -> Result<KillOutcome, DstFailure> {
    let fail = |why: String| DstFailure {
        engine: spec.name().into(),
        seed,
        why: format!("kill: {why}"),
        replay: dst_replay(spec, seed, p),
    };
    let config = sim_config(p, seed, plan).map_err(fail)?;
    let caps = spec.capabilities();
    let mut rng = rand::rngs::SmallRng::seed_from_u64(seed ^ 0x00de_adc1_1e17);
    let owners = THREADS * TASKS;
    let mut taken = std::collections::HashSet::new();
    let mut base =
        dmkv_testkit::insert_race::fresh_keys(&caps, &mut rng, owners * OWN_KEYS, &mut taken);
    base.sort_unstable();
    let fresh =
        dmkv_testkit::insert_race::fresh_keys(&caps, &mut rng, owners * OWN_FRESH, &mut taken);
    let size = 16usize.max(dmkv_api::payload::MIN_LEN);
    // Each task's script: (key, kind), in a seeded order.
    let scripts: Vec<Vec<(u64, Kind)>> = (0..owners)
        .map(|j| {
            let mut ops: Vec<(u64, Kind)> = base
                .iter()
                .skip(j)
                .step_by(owners)
                .map(|&k| (k, Kind::Update))
                .chain(
                    fresh
                        .iter()
                        .skip(j)
                        .step_by(owners)
                        .map(|&k| (k, Kind::Insert)),
                )
                .collect();
            ops.shuffle(&mut rng);
            ops
        })
        .collect();
    // The victim is a whole compute node (both its threads): a thread
    // cannot die alone in a real process, and the threads of one compute
    // node share its local state (Sherman's and ROLEX's local lock tables).
    let victim = rng.gen_range(0..THREADS / PER_NODE);
    let victim_of = |thread: usize| thread / PER_NODE == victim;
    let kill_op = rng.gen_range(0..OWN_KEYS + OWN_FRESH);
    let kill_delay = rng.gen_range(1..3_000u64);
    let opts = dmkv_api::deploy::DeployOptions {
        nodes: p.nodes,
        expected_keys: (base.len() + fresh.len()) as u64,
        value_size: size as u32,
        threads: THREADS,
        knobs: p.knobs_for(spec.name(), plan),
        ..Default::default()
    };
    let sim_opts = dmkv_api::sim_deploy::SimOptions {
        config,
        compute_nodes: THREADS / PER_NODE,
        threads_per_node: PER_NODE,
    };
    let dep = dmkv_api::sim_deploy::SimDeployment::deploy(spec, &opts, &sim_opts)
        .map_err(|e| fail(format!("deploy: {e}")))?;
    let mut pairs: Vec<(u64, Vec<u8>)> =
        base.iter().map(|&k| (k, make_value(k, 1, size))).collect();
    pairs.sort_by_key(|p| p.0);
    block_on(dep.engine.load(&dep.endpoint(0), &pairs)).map_err(|e| fail(format!("load: {e}")))?;
    // The victim's client cores: those its client adds.
    let core_names = |sim: &dmkv_transport::sim::Simulation| -> Vec<String> {
        sim.resources()
            .into_iter()
            .filter(|r| r.name.contains("client core"))
            .map(|r| r.name)
            .collect()
    };
    let mut clients = Vec::new();
    let mut victim_cores = Vec::new();
    for t in 0..THREADS {
        let before = core_names(&dep.sim);
        let c = dep.client(t).map_err(|e| fail(format!("client: {e}")))?;
        if victim_of(t) {
            victim_cores.extend(
                core_names(&dep.sim)
                    .into_iter()
                    .filter(|n| !before.contains(n)),
            );
        }
        clients.push(c.1);
    }
    let posted_by_victim = |sim: &dmkv_transport::sim::Simulation| -> u64 {
        sim.resources()
            .iter()
            .filter(|r| victim_cores.contains(&r.name))
            .map(|r| r.count)
            .sum()
    };
    let status: Vec<RefCell<Vec<Status>>> = scripts
        .iter()
        .map(|s| RefCell::new(vec![Status::NotStarted; s.len()]))
        .collect();
    let kill_at: Cell<Option<Instant>> = Cell::new(None);
    let killed: Cell<Option<(u64, u64)>> = Cell::new(None); // (instant, posted)
    // Victim tasks still running: the killer stops waiting for the kill
    // instant once none is (a victim that gave up never reaches it).
    let victim_tasks = (0..owners).filter(|j| victim_of(j / TASKS)).count();
    let victim_left = Cell::new(victim_tasks);
    // An operation that ran past the livelock limit (`--op-limit-ms`)
    // before the kill: nothing was dead yet, so it fails the seed.
    let stuck: RefCell<Option<String>> = RefCell::new(None);
    // Wakers of survivors' abandonment timers waiting for the kill instant,
    // one slot per task: a wait stores its task's waker in the task's slot
    // (once, not on every poll: the task wakes for each round trip of its
    // operation), so the list never grows past the tasks. A slot left by an
    // operation that ended before the kill only wakes its task once more
    // at the kill instant, as the waker a per-poll list kept for it did.
    let after_kill: RefCell<Vec<Option<std::task::Waker>>> = RefCell::new(vec![None; owners]);
    let blocked = Cell::new(0u64);
    let slow = Cell::new(0u64);
    let longest = Cell::new(Duration::ZERO);
    // A survivor is abandoned this long after the kill instant (not after
    // its operation began: before the kill nothing is dead, and an
    // operation dropped then could leave a lock held by no one, which a
    // later victim operation would wait on forever): a wait on the dead
    // client's lock never ends; an engine that takes none gets the
    // livelock limit.
    let abandon = if may_block(spec.name()) {
        OP_LIMIT
    } else {
        p.op_limit
    };
    let read_errors: RefCell<Vec<String>> = RefCell::new(Vec::new());
    let victim_keys: Vec<(u64, Kind, usize, usize)> = (0..owners)
        .filter(|j| victim_of(j / TASKS))
        .flat_map(|j| {
            scripts[j]
                .iter()
                .enumerate()
                .map(move |(i, &(k, kind))| (k, kind, j, i))
        })
        .collect();
    let read_seeds: Vec<u64> = (0..owners).map(|_| rng.r#gen()).collect();
    // Wakers of the victim's tasks, woken at the kill instant.
    let victims: RefCell<Vec<std::task::Waker>> = RefCell::new(Vec::new());
    let mut tasks: Vec<LocalTask<'_, ()>> = (0..owners)
        .map(|j| {
            let kv = clients[j / TASKS].clone();
            let (script, st) = (&scripts[j], &status[j]);
            let (kill_at, killed, blocked, read_errors, victim_keys, victims) = (
                &kill_at,
                &killed,
                &blocked,
                &read_errors,
                &victim_keys,
                &victims,
            );
            let (victim_left, stuck, after_kill) = (&victim_left, &stuck, &after_kill);
            let livelock = p.op_limit;
            // Ready `livelock` after `began`; if the kill instant has not
            // passed by then, `what` is recorded as stuck.
            let livelock_limit = move |began: Instant, what: String| async move {
                sleep_until(began + livelock).await;
                if kill_at.get().is_none_or(|t| Instant::now() < t) {
                    stuck.borrow_mut().get_or_insert(format!(
                        "{what} ran past {livelock:?} of virtual time before the kill (a livelock or a wait that never ends)"
                    ));
                }
            };
            // Ready `abandon` after the kill instant (the killer wakes it
            // then), or at the livelock limit, whichever comes first.
            let give_up = move |began: Instant, what: String| async move {
                let killed_then = async {
                    std::future::poll_fn(|cx| match kill_at.get() {
                        Some(t) if Instant::now() >= t => Poll::Ready(()),
                        _ => {
                            let mut slots = after_kill.borrow_mut();
                            let slot = &mut slots[j];
                            if !slot.as_ref().is_some_and(|w| w.will_wake(cx.waker())) {
                                *slot = Some(cx.waker().clone());
                            }
                            Poll::Pending
                        }
                    })
                    .await;
                    sleep(abandon).await;
                };
                unless(killed_then, livelock_limit(began, what)).await;
            };
            let (slow, longest) = (&slow, &longest);
            // Times a survivor's operation (virtual time).
            let timed = move |began: Instant| {
                let took = Instant::now().saturating_duration_since(began);
                longest.set(longest.get().max(took));
                if took > OP_LIMIT {
                    slow.set(slow.get() + 1);
                }
            };
            let sim = &dep.sim;
            let posted_by_victim = &posted_by_victim;
            let is_victim = victim_of(j / TASKS);
            let first_victim_task = is_victim && j % (TASKS * PER_NODE) == 0;
            let mut rng = rand::rngs::SmallRng::seed_from_u64(read_seeds[j]);
            Box::pin(async move {
                // Counts this victim task out however it ends.
                let _left = is_victim.then(|| VictimLeft(victim_left));
                for (i, &(k, kind)) in script.iter().enumerate() {
                    if first_victim_task && i == kill_op {
                        kill_at.set(Some(Instant::now() + Duration::from_nanos(kill_delay)));
                    }
                    let op = async {
                        match kind {
                            Kind::Update => kv.update(k, &make_value(k, 2, size)).await,
                            Kind::Insert => kv.insert(k, &make_value(k, 1, size)).await,
                        }
                    };
                    st.borrow_mut()[i] = Status::InDoubt;
                    let done = if is_victim {
                        // Dies at the kill instant (it never comes if the
                        // victim finishes first). Checked whenever the task
                        // is polled; the killer task wakes it at that
                        // instant. (No timer of its own: spurious polls of
                        // an engine's operation must not be what the kill
                        // adds.)
                        let dies = std::future::poll_fn(|cx| match kill_at.get() {
                            Some(t) if Instant::now() >= t => Poll::Ready(()),
                            _ => {
                                victims.borrow_mut().push(cx.waker().clone());
                                Poll::Pending
                            }
                        });
                        let began = Instant::now();
                        let what = format!("the victim's operation {i} on key {k:#x}");
                        // The kill ends the operation; so does the
                        // livelock limit (recorded as stuck).
                        let dies_or_stuck = async {
                            unless(dies, livelock_limit(began, what)).await;
                        };
                        match unless(op, dies_or_stuck).await {
                            Some(r) => r,
                            None if stuck.borrow().is_some() && killed.get().is_none() => {
                                return;
                            }
                            None => {
                                if killed.get().is_none() {
                                    killed.set(Some((
                                        Instant::now().as_nanos(),
                                        posted_by_victim(sim),
                                    )));
                                }
                                return;
                            }
                        }
                    } else {
                        let began = Instant::now();
                        let what = format!("survivor operation {i} on key {k:#x}");
                        match unless(op, give_up(began, what)).await {
                            Some(r) => {
                                timed(began);
                                r
                            }
                            None => {
                                blocked.set(blocked.get() + 1);
                                return;
                            }
                        }
                    };
                    st.borrow_mut()[i] = Status::Acked(done.map_err(|e| e.to_string()));
                    if !is_victim && !victim_keys.is_empty() {
                        // A read of one of the victim's keys: intact, at a
                        // version it may have.
                        let (vk, vkind, _, _) = victim_keys[rng.gen_range(0..victim_keys.len())];
                        let began = Instant::now();
                        let what = format!("a survivor's read of key {vk:#x}");
                        match unless(kv.get(vk), give_up(began, what)).await {
                            None => {
                                blocked.set(blocked.get() + 1);
                                return;
                            }
                            Some(r) => {
                                timed(began);
                                if let Err(e) = allowed(vk, vkind, None, &r) {
                                    read_errors
                                        .borrow_mut()
                                        .push(format!("during the run: {e}"));
                                }
                            }
                        }
                    }
                }
            }) as LocalTask<'_, ()>
        })
        .collect();
    // The killer: waits for the kill instant to be chosen, then for it,
    // then wakes the victim's tasks so that they die at that instant, and
    // the survivors' abandonment timers. It stops waiting if every victim
    // task ended first (one that ran past the livelock limit gives up).
    tasks.push(Box::pin(async {
        let t = loop {
            match kill_at.get() {
                Some(t) => break t,
                None if victim_left.get() == 0 => return,
                None => sleep(Duration::from_nanos(500)).await,
            }
        };
        sleep_until(t).await;
        for w in victims.borrow_mut().drain(..) {
            w.wake();
        }
        for w in after_kill.borrow_mut().iter_mut().filter_map(Option::take) {
            w.wake();
        }
    }));
    run_tasks(tasks);
    let mut outcome = KillOutcome {
        killed_mid_op: killed.get().is_some(),
        blocked: blocked.get(),
        slow: slow.get(),
        longest: longest.get(),
        stats: serde_json::Value::Null,
        held: Default::default(),
    };
    if let Some(why) = stuck.borrow().clone() {
        return Err(fail(format!(
            "{why} (victim compute node {victim}, to be killed during its operation {kill_op})"
        )));
    }
    if let Some((at, posted)) = killed.get() {
        let now = posted_by_victim(&dep.sim);
        if now != posted {
            return Err(fail(format!(
                "the victim (compute node {victim}) posted {} verbs or RPCs after it was killed at {at} ns",
                now - posted
            )));
        }
    }
    if outcome.blocked > 0 && !may_block(spec.name()) {
        return Err(fail(format!(
            "{} survivor operations blocked for {abandon:?} (victim compute node {victim}, killed during its operation {kill_op}); {} takes no lock a client holds across round trips",
            outcome.blocked,
            spec.name()
        )));
    }
    if outcome.slow > 0 && !may_block(spec.name()) {
        let stats = block_on(dep.engine.stats(&dep.endpoint(0)))
            .map_err(|e| fail(format!("engine figures: {e}")))?;
        let allowed = OP_LIMIT + bounded_wait(spec.name(), &stats);
        if outcome.longest > allowed {
            return Err(fail(format!(
                "{} survivor operations took longer than {OP_LIMIT:?}, the longest {:?}, more than the engine's own bounded waits explain ({allowed:?}: {} resizes holding writes for {} ms) (victim compute node {victim}, killed during its operation {kill_op}); {} takes no lock a client holds across round trips",
                outcome.slow,
                outcome.longest,
                stats["resizes"],
                stats["resize_ms_total"],
                spec.name()
            )));
        }
    }
    if let Some(e) = read_errors.borrow().first() {
        return Err(fail(e.clone()));
    }
    // Every answer, then every key read back by a survivor.
    let checker = clients[((victim + 1) % (THREADS / PER_NODE)) * PER_NODE].clone();
    for (j, script) in scripts.iter().enumerate() {
        for (i, &(k, kind)) in script.iter().enumerate() {
            let s = status[j].borrow()[i].clone();
            if let Status::Acked(r) = &s {
                match r {
                    Ok(true) => {}
                    Ok(false) => {
                        return Err(fail(format!(
                            "{kind:?} of key {k:#x} by task {j} answered false (the key {})",
                            if kind == Kind::Update {
                                "exists"
                            } else {
                                "was fresh"
                            }
                        )));
                    }
                    Err(e) => {
                        return Err(fail(format!(
                            "{kind:?} of key {k:#x} by task {j} failed: {e}"
                        )));
                    }
                }
            }
            let r = match block_on(unless(checker.get(k), sleep(OP_LIMIT))) {
                Some(r) => r,
                None if may_block(spec.name()) => {
                    // Behind the dead client's lock: counted, not checked.
                    continue;
                }
                None => {
                    return Err(fail(format!(
                        "the final read of key {k:#x} blocked for {OP_LIMIT:?}"
                    )));
                }
            };
            allowed(k, kind, Some(&s), &r).map_err(|e| {
                fail(format!(
                    "after the run (task {j}, victim compute node {victim}, kill during operation {kill_op}): {e}"
                ))
            })?;
        }
    }
    outcome.stats = block_on(dep.engine.stats(&dep.endpoint(0)))
        .map_err(|e| fail(format!("engine figures: {e}")))?;
    outcome.held = dep.sim.frames_held();
    if let Some(why) = crate::dst::held_too_long(outcome.held, p.hold_limit) {
        return Err(fail(why));
    }
    Ok(outcome)
}

/// Whether `read` of `key` is allowed given the operation on it: `status`
/// None for a read during the run (any state the key may pass through).
fn allowed(
    key: u64,
    kind: Kind,
    status: Option<&Status>,
    read: &Result<Option<Vec<u8>>, dmkv_api::KvError>,
) -> Result<(), String> {
    let got = match read {
        Ok(v) => v.as_ref().map(|v| check_value(key, v)).transpose()?,
        Err(e) => return Err(format!("get of key {key:#x} failed: {e}")),
    };
    // (old, new) states of the key: Some(version) or None (absent).
    let (old, new) = match kind {
        Kind::Update => (Some(1), Some(2)),
        Kind::Insert => (None, Some(1)),
    };
    let ok = match status {
        None | Some(Status::InDoubt) => got == old || got == new,
        Some(Status::NotStarted) => got == old,
        Some(Status::Acked(_)) => got == new,
    };
    if ok {
        Ok(())
    } else {
        Err(format!(
            "key {key:#x} reads {} after {kind:?} ({}): allowed {}",
            got.map_or("absent".to_string(), |v| format!("version {v}")),
            match status {
                None => "in progress",
                Some(Status::NotStarted) => "never started",
                Some(Status::InDoubt) => "in flight when its client died",
                Some(Status::Acked(_)) => "acknowledged",
            },
            match status {
                Some(Status::NotStarted) => format!("{old:?}"),
                Some(Status::Acked(_)) => format!("{new:?}"),
                _ => format!("{old:?} or {new:?}"),
            }
        ))
    }
}
