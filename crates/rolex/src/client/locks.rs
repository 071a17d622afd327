//! Sharing acquired leaf locks among the threads of one compute node
//! (§3.4: "other threads of C_node can leverage the acquired lock to modify
//! the same leaves").
//!
//! The engine object is per compute process and shared by its threads, so a
//! process-local table can coalesce lock holders: only one local task at a
//! time works on a group; when it finishes and another local task is
//! waiting for the same group, it hands the remote lock (the LT entry's lock
//! bit, still set) over instead of releasing it, and the next task skips the
//! remote CAS. After `max` consecutive hand-overs the lock is released
//! remotely so other compute nodes are not starved.

use crate::layout::meta::ModelRef;
use dmkv_transport::exec::yield_now;
use parking_lot::Mutex;
use std::collections::HashMap;

pub type GroupKey = (ModelRef, usize);

#[derive(Default)]
struct LockState {
    busy: bool,
    held_remote: bool,
    waiters: u32,
    handovers: u32,
}

pub struct LockTable {
    enabled: bool,
    max: u32,
    map: Mutex<HashMap<GroupKey, LockState>>,
}

impl LockTable {
    pub fn new(enabled: bool, max: u32) -> LockTable {
        LockTable {
            enabled,
            max,
            map: Mutex::new(HashMap::new()),
        }
    }

    /// Waits until this task may work on `key`; returns whether the remote
    /// lock is already held (handed over).
    pub async fn acquire(&self, key: GroupKey) -> bool {
        if !self.enabled {
            return false;
        }
        let mut waiting = false;
        loop {
            {
                let mut m = self.map.lock();
                let e = m.entry(key).or_default();
                if !e.busy {
                    e.busy = true;
                    if waiting {
                        e.waiters -= 1;
                    }
                    return e.held_remote;
                }
                if !waiting {
                    e.waiters += 1;
                    waiting = true;
                }
            }
            yield_now().await;
        }
    }

    /// Whether the holder of `key` should keep the remote lock for a local
    /// waiter.
    pub fn hand_over_wanted(&self, key: GroupKey) -> bool {
        if !self.enabled {
            return false;
        }
        let m = self.map.lock();
        m.get(&key)
            .is_some_and(|e| e.waiters > 0 && e.handovers < self.max)
    }

    /// Ends this task's turn; `still_held` if the remote lock was kept for
    /// the next local task.
    pub fn release(&self, key: GroupKey, still_held: bool) {
        if !self.enabled {
            return;
        }
        let mut m = self.map.lock();
        let Some(e) = m.get_mut(&key) else { return };
        e.busy = false;
        e.held_remote = still_held;
        if still_held {
            e.handovers += 1;
        } else {
            e.handovers = 0;
            if e.waiters == 0 {
                m.remove(&key);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::exec::{LocalTask, run_tasks};
    use std::cell::Cell;

    #[test]
    fn one_holder_at_a_time_and_hand_overs() {
        let t = LockTable::new(true, 2);
        let key = (
            ModelRef {
                node: 0,
                offset: 64,
            },
            3,
        );
        let inside = Cell::new(0);
        let handed = Cell::new(0);
        let tasks: Vec<LocalTask<'_, ()>> = (0..4)
            .map(|_| {
                Box::pin(async {
                    let held = t.acquire(key).await;
                    handed.set(handed.get() + held as u32);
                    inside.set(inside.get() + 1);
                    assert_eq!(inside.get(), 1);
                    yield_now().await;
                    inside.set(inside.get() - 1);
                    let keep = t.hand_over_wanted(key);
                    t.release(key, keep);
                }) as LocalTask<'_, ()>
            })
            .collect();
        run_tasks(tasks);
        assert_eq!(handed.get(), 2, "two hand-overs, then a remote release");
        assert!(t.map.lock().is_empty() || !t.map.lock()[&key].held_remote);
    }
}
