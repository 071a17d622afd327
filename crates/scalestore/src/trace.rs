//! Per-operation wait tracing: a debugging aid, off by default
//! (docs/scalestore.md, "Tracing an operation's waits").
//!
//! With `DMKV_SCALESTORE_TRACE=1` in the environment, every client
//! operation (`engine::Client`) records, in the runtime's time (virtual on
//! `sim`), how long it waited at each kind of await of the pager (latch
//! waits, each kind of protocol message, the local directory's SSD wait,
//! free-slot waits, back-off pauses) and how often the B-tree restarted its
//! descent (not the harness's read-back after the run). `engine_stats`
//! then carries `op_trace`: the latency
//! percentiles, and for the operations at or above the 99th percentile the
//! mean time by cause, when in the run they started and on which node.
//!
//! Invariants:
//! 1. Tracing never changes what a run does: it only reads the runtime's
//!    clock (`time::Instant::now`, a read of the scheduler's time on `sim`,
//!    no event) and writes to this module's own memory, never through
//!    `touch_local_at` or any transport call, so a traced `sim` run has the
//!    same virtual timing and report (apart from `op_trace`) as an
//!    untraced one (test `tracing_leaves_a_simulated_run_unchanged`).
//! 2. Off by default: with the variable unset, [`op`] awaits the operation
//!    directly and every [`Span`] is empty after one relaxed load.
//! 3. An operation's record is installed in this thread's slot only while
//!    its own future is being polled (as `sim`'s line counting does), so
//!    the waits of tasks that interleave with it at its awaits are never
//!    charged to it. Causes are recorded at leaf awaits only (no span
//!    encloses another), so an operation's causes never overlap and their
//!    sum is at most its latency; the rest is CPU and waiting for its core.
//! 4. Holder parks are the measured run's too: the first operation of the
//!    harness's read-back (`--verify`, [`OpKind::Verify`]) ends the
//!    measured run for them, and a park that starts after it is not
//!    counted (one that started before and ends after is); [`report`]
//!    opens the count again. Before, `holder_parks` counted the read-back
//!    while the operation figures left it out.

use dmkv_transport::OpKind;
use dmkv_transport::time::Instant;
use std::cell::RefCell;
use std::future::Future;
use std::sync::Mutex;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

/// What an operation waited for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cause {
    /// A latch (or a flag of its frame) held by another task or a handler.
    Latch,
    /// An ownership request answered with the page written by the
    /// directory (from its cache or its SSD).
    OwnWritten,
    /// An ownership request for an upgrade (the copy is kept).
    OwnKept,
    /// An ownership request that sent us to a predecessor for a move.
    OwnMove,
    /// An ownership request that sent us to a sharer for a copy.
    OwnCopy,
    /// Taking the page from the predecessor (a move).
    Move,
    /// A copy from a sharer.
    Copy,
    /// Invalidating the other sharers.
    Invalidate,
    /// Reading the page from the directory's SSD after a failed move.
    SsdFetch,
    /// Waiting for FIFO acknowledgements.
    Ack,
    /// Allocating a page id.
    Alloc,
    /// The local directory's SSD read, waited for as a task.
    LocalSsd,
    /// No free cache slot: waiting for the page provider.
    Slot,
    /// Back-off pauses of a busy local directory or a shard handover.
    Backoff,
}

const CAUSES: usize = 14;
const NAMES: [&str; CAUSES] = [
    "latch",
    "own_written",
    "own_kept",
    "own_move",
    "own_copy",
    "move",
    "copy",
    "invalidate",
    "ssd_fetch",
    "ack",
    "alloc",
    "local_ssd",
    "slot",
    "backoff",
];

/// One finished operation.
#[derive(Debug, Clone)]
struct OpRec {
    node: u8,
    write: bool,
    start: u64,
    end: u64,
    wait: [u64; CAUSES],
    count: [u32; CAUSES],
    restarts: u32,
}

const UNKNOWN: u8 = 0;
const ON: u8 = 1;
const OFF: u8 = 2;
static STATE: AtomicU8 = AtomicU8::new(UNKNOWN);
/// The harness's read-back has begun: holder parks starting now are not
/// counted (invariant 4); [`report`] clears it.
static MEASURED_OVER: AtomicBool = AtomicBool::new(false);

/// Whether tracing is on (`DMKV_SCALESTORE_TRACE` set to anything but
/// `0` or empty), read once per process.
pub fn enabled() -> bool {
    match STATE.load(Ordering::Relaxed) {
        ON => true,
        OFF => false,
        _ => {
            let on =
                std::env::var("DMKV_SCALESTORE_TRACE").is_ok_and(|v| !v.is_empty() && v != "0");
            STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
            on
        }
    }
}

/// Switches tracing on or off for this process (tests).
pub fn set_enabled(on: bool) {
    STATE.store(if on { ON } else { OFF }, Ordering::Relaxed);
}

thread_local! {
    /// The record of the operation being polled on this thread.
    static CURRENT: RefCell<Option<Box<OpRec>>> = const { RefCell::new(None) };
}

fn done() -> &'static Mutex<Vec<OpRec>> {
    static DONE: OnceLock<Mutex<Vec<OpRec>>> = OnceLock::new();
    DONE.get_or_init(|| Mutex::new(Vec::new()))
}

/// Runs one client operation of node `node`, recording its waits if
/// tracing is on.
///
/// The harness's read-back after a run (`--verify`, labelled
/// [`OpKind::Verify`]) is not recorded: the trace is the measured run's.
pub async fn op<F: Future>(node: u8, write: bool, fut: F) -> F::Output {
    if !enabled() {
        return fut.await;
    }
    if dmkv_transport::counters::current_kind() == OpKind::Verify {
        // The measured run is over (invariant 4).
        MEASURED_OVER.store(true, Ordering::Relaxed);
        return fut.await;
    }
    let mut fut = std::pin::pin!(fut);
    let mut rec = Some(Box::new(OpRec {
        node,
        write,
        start: Instant::now().as_nanos(),
        end: 0,
        wait: [0; CAUSES],
        count: [0; CAUSES],
        restarts: 0,
    }));
    let out = std::future::poll_fn(|cx| {
        let outer = CURRENT.with(|c| c.replace(rec.take()));
        let r = fut.as_mut().poll(cx);
        rec = CURRENT.with(|c| c.replace(outer));
        r
    })
    .await;
    if let Some(mut r) = rec {
        r.end = Instant::now().as_nanos();
        done().lock().unwrap_or_else(|e| e.into_inner()).push(*r);
    }
    out
}

/// A wait being timed: [`Span::end`] charges it to the current operation.
#[must_use]
pub struct Span(Option<u64>);

/// Starts timing a wait of the operation being polled (nothing if tracing
/// is off or no traced operation is being polled).
#[inline]
pub fn span() -> Span {
    if !enabled() || !CURRENT.with(|c| c.borrow().is_some()) {
        return Span(None);
    }
    Span(Some(Instant::now().as_nanos()))
}

impl Span {
    /// The wait ended: charge it to `cause`.
    #[inline]
    pub fn end(self, cause: Cause) {
        let Some(t0) = self.0 else { return };
        let dt = Instant::now().as_nanos().saturating_sub(t0);
        CURRENT.with(|c| {
            if let Some(r) = c.borrow_mut().as_mut() {
                r.wait[cause as usize] += dt;
                r.count[cause as usize] += 1;
            }
        });
    }
}

/// The B-tree restarted a descent.
#[inline]
pub fn restart() {
    if !enabled() {
        return;
    }
    CURRENT.with(|c| {
        if let Some(r) = c.borrow_mut().as_mut() {
            r.restarts += 1;
        }
    });
}

/// Why a holder parked a move or copy of its copy (`holder::serve_holder`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ParkWhy {
    /// This node's own worker is fetching the page (its grant is pending).
    OwnFetch,
    /// A worker just fetched the page for an optimistic first use.
    Fresh,
    /// The latch is held exclusively (a worker's protocol step or write,
    /// or the page provider).
    Exclusive,
    /// The latch is held shared.
    Shared,
}

const WHYS: usize = 4;
const WHY_NAMES: [&str; WHYS] = ["own_fetch", "fresh", "latched_exclusive", "latched_shared"];

/// Holder parks served so far: (count, total ns, max ns) per reason.
fn parks() -> &'static Mutex<[(u64, u64, u64); WHYS]> {
    static PARKS: OnceLock<Mutex<[(u64, u64, u64); WHYS]>> = OnceLock::new();
    PARKS.get_or_init(|| Mutex::new([(0, 0, 0); WHYS]))
}

/// A request parked at a holder, timed while tracing is on.
#[derive(Debug, Clone, Copy)]
pub struct Park {
    why: ParkWhy,
    since: u64,
}

impl Park {
    /// `None` unless tracing is on and the measured run is not over
    /// (invariant 4; `why` is only evaluated then).
    pub fn start(why: impl FnOnce() -> ParkWhy) -> Option<Park> {
        (enabled() && !MEASURED_OVER.load(Ordering::Relaxed)).then(|| Park {
            why: why(),
            since: Instant::now().as_nanos(),
        })
    }

    /// The parked request was answered.
    pub fn end(self) {
        let dt = Instant::now().as_nanos().saturating_sub(self.since);
        let mut p = parks().lock().unwrap_or_else(|e| e.into_inner());
        let e = &mut p[self.why as usize];
        e.0 += 1;
        e.1 += dt;
        e.2 = e.2.max(dt);
    }
}

fn us(ns: f64) -> f64 {
    (ns / 10.0).round() / 100.0
}

/// Mean wait per cause (µs per operation) and its share of the mean
/// latency, over `ops`.
fn breakdown(ops: &[&OpRec]) -> serde_json::Value {
    let n = ops.len().max(1) as f64;
    let lat: u64 = ops.iter().map(|r| r.end - r.start).sum();
    let mut by = serde_json::Map::new();
    let mut waited = 0u64;
    for (i, name) in NAMES.iter().enumerate() {
        let w: u64 = ops.iter().map(|r| r.wait[i]).sum();
        let c: u64 = ops.iter().map(|r| r.count[i] as u64).sum();
        waited += w;
        if c > 0 {
            by.insert(
                (*name).into(),
                serde_json::json!({
                    "us_per_op": us(w as f64 / n),
                    "share": (w as f64 / lat.max(1) as f64 * 1000.0).round() / 1000.0,
                    "waits_per_op": (c as f64 / n * 1000.0).round() / 1000.0,
                }),
            );
        }
    }
    let other = lat.saturating_sub(waited);
    by.insert(
        "cpu_and_other".into(),
        serde_json::json!({
            "us_per_op": us(other as f64 / n),
            "share": (other as f64 / lat.max(1) as f64 * 1000.0).round() / 1000.0,
        }),
    );
    serde_json::json!({
        "ops": ops.len(),
        "mean_us": us(lat as f64 / n),
        "restarts_per_op": (ops.iter().map(|r| r.restarts as u64).sum::<u64>() as f64 / n * 1000.0).round() / 1000.0,
        "by_cause": by,
    })
}

/// The report of the operations finished since the last call (`None` if
/// tracing is off); drains them.
pub fn report() -> Option<serde_json::Value> {
    if !enabled() {
        return None;
    }
    let ops = std::mem::take(&mut *done().lock().unwrap_or_else(|e| e.into_inner()));
    // The next measured run's parks count again (invariant 4).
    MEASURED_OVER.store(false, Ordering::Relaxed);
    if ops.is_empty() {
        return Some(serde_json::json!({ "ops": 0 }));
    }
    let mut lat: Vec<u64> = ops.iter().map(|r| r.end - r.start).collect();
    lat.sort_unstable();
    let pct = |p: f64| lat[((lat.len() - 1) as f64 * p).round() as usize];
    let p99 = pct(0.99);
    let t0 = ops.iter().map(|r| r.start).min().unwrap_or(0);
    let t1 = ops.iter().map(|r| r.end).max().unwrap_or(t0).max(t0 + 1);
    let tail: Vec<&OpRec> = ops.iter().filter(|r| r.end - r.start >= p99).collect();
    let all: Vec<&OpRec> = ops.iter().collect();
    // When in the run the tail operations started (tenths of the run).
    let mut tenths = [0u64; 10];
    for r in &tail {
        let i = ((r.start - t0) as u128 * 10 / (t1 - t0) as u128).min(9) as usize;
        tenths[i] += 1;
    }
    let nodes = ops.iter().map(|r| r.node).max().unwrap_or(0) as usize + 1;
    let mut by_node = vec![0u64; nodes];
    for r in &tail {
        by_node[r.node as usize] += 1;
    }
    let mut slowest: Vec<&OpRec> = tail.clone();
    slowest.sort_by_key(|r| std::cmp::Reverse((r.end - r.start, r.start)));
    let slowest: Vec<serde_json::Value> = slowest
        .iter()
        .take(5)
        .map(|r| {
            let mut w = serde_json::Map::new();
            for (i, name) in NAMES.iter().enumerate() {
                if r.count[i] > 0 {
                    w.insert(
                        (*name).into(),
                        serde_json::json!([us(r.wait[i] as f64), r.count[i]]),
                    );
                }
            }
            serde_json::json!({
                "node": r.node,
                "write": r.write,
                "start_us": us((r.start - t0) as f64),
                "latency_us": us((r.end - r.start) as f64),
                "restarts": r.restarts,
                "waits_us_count": w,
            })
        })
        .collect();
    let parks = std::mem::take(&mut *parks().lock().unwrap_or_else(|e| e.into_inner()));
    let mut holder_parks = serde_json::Map::new();
    for (i, (n, total, max)) in parks.iter().enumerate() {
        if *n > 0 {
            holder_parks.insert(
                WHY_NAMES[i].into(),
                serde_json::json!({
                    "count": n,
                    "mean_us": us(*total as f64 / *n as f64),
                    "max_us": us(*max as f64),
                }),
            );
        }
    }
    Some(serde_json::json!({
        "holder_parks": holder_parks,
        "ops": ops.len(),
        "p50_us": us(pct(0.5) as f64),
        "p99_us": us(p99 as f64),
        "p999_us": us(pct(0.999) as f64),
        "max_us": us(*lat.last().unwrap_or(&0) as f64),
        "span_us": us((t1 - t0) as f64),
        "all": breakdown(&all),
        "tail_p99": breakdown(&tail),
        "tail_starts_by_tenth_of_run": tenths,
        "tail_by_node": by_node,
        "slowest": slowest,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::counters::labeled;
    use dmkv_transport::exec::block_on;

    /// Invariant 4. Without the stop at the read-back's first operation
    /// the park started during it is counted (`latched_shared` appears).
    #[test]
    fn holder_parks_of_the_read_back_are_not_counted() {
        set_enabled(true);
        let _ = report();
        // A park of the measured run that is still open when it ends.
        let open = Park::start(|| ParkWhy::Exclusive).expect("tracing is on");
        block_on(op(0, false, async {}));
        // The read-back: its operations and the parks starting meanwhile
        // are left out.
        block_on(labeled(OpKind::Verify, op(0, false, async {})));
        if let Some(p) = Park::start(|| ParkWhy::Shared) {
            p.end();
        }
        open.end();
        let r = report().expect("tracing is on");
        assert_eq!(r["ops"], 1, "{r}");
        assert_eq!(r["holder_parks"]["latched_exclusive"]["count"], 1, "{r}");
        assert!(r["holder_parks"].get("latched_shared").is_none(), "{r}");
        // The report opens the count for the next measured run.
        assert!(Park::start(|| ParkWhy::Shared).is_some());
        let _ = report();
        set_enabled(false);
    }
}
