//! Retiring a rebuild's old tables once compute nodes have the new index
//! (paper §4.4, Fig. 8 ④: "Once all compute nodes have obtained the new
//! bucket locator arrays and seeds, N_cNode in the memory node becomes
//! zero. The memory node detects this change through periodic checks ...
//! It proceeds to discard the bucket locator arrays").
//!
//! The wait is a background activity of the shard, not the worker's: the
//! worker publishes, hands the old tables' regions here and goes on with
//! its next job. It used to wait for the countdown itself (up to
//! `countdown_timeout_ms`, 1 s), which held everything queued behind it on
//! the node's one worker; in particular a TAKEOVER of a crashed node's
//! shard waited while the compute nodes that would have counted down were
//! all waiting for that takeover, so the countdown always ran into its
//! timeout (docs/outback.md, "The countdown off the worker"). Under `sim`
//! the wait was also a nested frame (`time::sleep_blocking`), which other
//! nodes' waits nested inside and serialized.
//!
//! Invariants:
//! 1. An old table's regions are withdrawn only once the countdown reads 0
//!    at a check made after the publication that retired it, or once
//!    `countdown_timeout_ms` has passed since that publication: exactly the
//!    rule of the worker's wait before. A later publication resets the
//!    countdown; reaching 0 then means every compute node fetched a view at
//!    least as new, which names none of the retired tables either.
//! 2. Nothing handed over is left behind: handing over and the waiter's
//!    "nothing left, stop" both happen under the queue's lock, and at most
//!    one waiter runs per shard.
//! 3. `resize_total_ns` still counts each resize until its countdown ended
//!    (`resize_until_fetched_ms_total`), now at the check that ends it.

use crate::layout::ctl;
use crate::server::shard::ShardServer;
use dmkv_transport::time::Instant;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

/// Old tables waiting for the countdown, and whether a waiter runs.
#[derive(Default)]
pub(crate) struct Retiring {
    queue: Vec<Retired>,
    waiting: bool,
}

/// The regions one rebuild retired.
struct Retired {
    /// Region name prefixes to withdraw.
    prefixes: Vec<String>,
    /// The rebuild's start (for `resize_total_ns`; `None` for a full build).
    resize_started: Option<Instant>,
    /// When to withdraw them whatever the countdown says.
    deadline: Instant,
}

/// Hands the regions under `prefixes` (retired by the publication just
/// made) over to be withdrawn after the countdown; `resize_started` is the
/// start of the resize that retired them (`None` for a full build).
/// Withdraws them at once if the countdown is already 0, else makes sure a
/// waiter runs. Never waits.
pub(crate) fn after_countdown(
    shard: &Arc<ShardServer>,
    prefixes: Vec<String>,
    resize_started: Option<Instant>,
) {
    let timeout = Duration::from_millis(shard.ctx.cfg.countdown_timeout_ms);
    let mut r = shard.retiring.lock();
    r.queue.push(Retired {
        prefixes,
        resize_started,
        deadline: Instant::now() + timeout,
    });
    if r.waiting {
        return;
    }
    if sweep(shard, &mut r).is_none() {
        return;
    }
    r.waiting = true;
    drop(r);
    let me = shard.clone();
    let poll = Duration::from_millis(shard.ctx.cfg.countdown_poll_ms.max(1));
    // Detached: it ends when nothing is left to retire (invariant 2).
    drop(dmkv_transport::exec::spawn_background(
        "outback-retire",
        async move {
            loop {
                let next = {
                    let r = me.retiring.lock();
                    r.queue.iter().map(|e| e.deadline).min()
                };
                let wake = match next {
                    Some(d) => d.min(Instant::now() + poll),
                    None => Instant::now() + poll,
                };
                dmkv_transport::exec::sleep_until(wake).await;
                let mut r = me.retiring.lock();
                if sweep(&me, &mut r).is_none() {
                    r.waiting = false;
                    return;
                }
            }
        },
    ));
}

/// Withdraws what may go now (invariant 1); `None` if nothing is left.
fn sweep(shard: &ShardServer, r: &mut Retiring) -> Option<()> {
    let left = shard
        .ctl
        .mem
        .load_u64(ctl::COUNTDOWN)
        .expect("control header") as i64;
    let now = Instant::now();
    let (done, keep): (Vec<Retired>, Vec<Retired>) = std::mem::take(&mut r.queue)
        .into_iter()
        .partition(|e| left <= 0 || now >= e.deadline);
    r.queue = keep;
    for e in done {
        for p in &e.prefixes {
            shard.ctx.withdraw(p);
        }
        if let Some(s) = e.resize_started {
            shard
                .stats
                .resize_total_ns
                .fetch_add(s.elapsed().as_nanos() as u64, Ordering::Relaxed);
        }
    }
    (!r.queue.is_empty()).then_some(())
}

/// Rebuilds whose old tables wait for the countdown.
#[cfg(test)]
pub(crate) fn waiting(shard: &ShardServer) -> usize {
    shard.retiring.lock().queue.len()
}
