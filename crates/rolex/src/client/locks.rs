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
use parking_lot::Mutex;
use std::collections::HashMap;
use std::task::{Poll, Waker};

pub type GroupKey = (ModelRef, usize);

#[derive(Default)]
struct LockState {
    busy: bool,
    /// Which turn holds the group while `busy` (each turn gets a new one),
    /// so that a [`Turn`] dropped after its explicit release frees nothing.
    ticket: u64,
    /// The LT entry's value (lock bit clear) while the remote lock is kept
    /// for the next local task. The next holder must use this word, not
    /// its model cache: a concurrent table refresh may have put an older
    /// LT value there, and releasing or relinking from an older word would
    /// drop synonym leaves.
    held_remote: Option<u64>,
    waiters: u32,
    handovers: u32,
    /// Tasks waiting for the turn. Every release wakes them all: a waiter
    /// may have been dropped (its operation abandoned), so waking only one
    /// could wake nobody. They wait without polling, so a turn held for
    /// long (behind a remote lock a dead client holds) costs no events.
    wakers: Vec<Waker>,
}

pub struct LockTable {
    enabled: bool,
    max: u32,
    map: Mutex<HashMap<GroupKey, LockState>>,
    next_ticket: std::sync::atomic::AtomicU64,
}

/// A task's turn on a group. Dropping it without [`LockTable::release`]
/// (the operation failed on a path that did not release, or its future was
/// dropped mid-operation) ends the turn as a release without hand-over:
/// otherwise the group would stay busy for this compute node forever.
/// Invariant 11 of docs/rolex.md.
pub struct Turn<'a> {
    table: &'a LockTable,
    key: GroupKey,
    ticket: u64,
    /// The LT entry's value if the remote lock was handed over to this turn.
    pub held: Option<u64>,
}

impl Drop for Turn<'_> {
    fn drop(&mut self) {
        if self.table.enabled {
            self.table.abandon(self.key, self.ticket);
        }
    }
}

/// A task waiting in [`LockTable::acquire`].
struct Waiting<'a> {
    table: &'a LockTable,
    key: GroupKey,
    counted: bool,
}

impl Drop for Waiting<'_> {
    fn drop(&mut self) {
        if self.counted {
            self.table.stop_waiting(self.key);
        }
    }
}

impl LockTable {
    pub fn new(enabled: bool, max: u32) -> LockTable {
        LockTable {
            enabled,
            max,
            map: Mutex::new(HashMap::new()),
            next_ticket: std::sync::atomic::AtomicU64::new(1),
        }
    }

    /// Waits until this task may work on `key`; the turn carries the LT
    /// entry's value if the remote lock is already held (handed over).
    pub async fn acquire(&self, key: GroupKey) -> Turn<'_> {
        let mut turn = Turn {
            table: self,
            key,
            ticket: 0,
            held: None,
        };
        if !self.enabled {
            return turn;
        }
        // Counted in `waiters` while waiting; uncounted if dropped while
        // waiting (an abandoned operation), so holders do not keep the
        // remote lock for a waiter that is gone.
        let mut w = Waiting {
            table: self,
            key,
            counted: false,
        };
        let (ticket, held) = std::future::poll_fn(|cx| {
            let mut m = self.map.lock();
            let e = m.entry(key).or_default();
            if !e.busy {
                e.busy = true;
                e.ticket = self
                    .next_ticket
                    .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                if w.counted {
                    e.waiters -= 1;
                    w.counted = false;
                }
                return Poll::Ready((e.ticket, e.held_remote));
            }
            if !w.counted {
                e.waiters += 1;
                w.counted = true;
            }
            e.wakers.push(cx.waker().clone());
            Poll::Pending
        })
        .await;
        turn.ticket = ticket;
        turn.held = held;
        turn
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

    /// Ends this task's turn; `still_held` carries the LT entry's value
    /// (lock bit clear) if the remote lock was kept for the next local task.
    pub fn release(&self, key: GroupKey, still_held: Option<u64>) {
        if !self.enabled {
            return;
        }
        let mut m = self.map.lock();
        let Some(e) = m.get_mut(&key) else { return };
        e.busy = false;
        e.ticket = 0;
        e.held_remote = still_held;
        let wakers = std::mem::take(&mut e.wakers);
        if still_held.is_some() {
            e.handovers += 1;
        } else {
            e.handovers = 0;
            if e.waiters == 0 {
                m.remove(&key);
            }
        }
        drop(m);
        wakers.into_iter().for_each(Waker::wake);
    }

    /// Tasks waiting for `key`'s turn now (tests step writers with it).
    #[cfg(test)]
    pub fn waiting(&self, key: GroupKey) -> u32 {
        self.map.lock().get(&key).map_or(0, |e| e.waiters)
    }

    /// A waiter dropped while waiting: no longer counted.
    fn stop_waiting(&self, key: GroupKey) {
        let mut m = self.map.lock();
        if let Some(e) = m.get_mut(&key) {
            e.waiters -= 1;
            if !e.busy && e.waiters == 0 && e.held_remote.is_none() {
                m.remove(&key);
            }
        }
    }

    /// A dropped turn: releases `key` if `ticket` still holds it.
    fn abandon(&self, key: GroupKey, ticket: u64) {
        let mine = self
            .map
            .lock()
            .get(&key)
            .is_some_and(|e| e.busy && e.ticket == ticket);
        if mine {
            self.release(key, None);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::exec::{LocalTask, run_tasks, yield_now};
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
                    let turn = t.acquire(key).await;
                    let held = turn.held;
                    if let Some(lt) = held {
                        assert_eq!(lt, 77, "the handed-over LT value comes through");
                    }
                    handed.set(handed.get() + held.is_some() as u32);
                    inside.set(inside.get() + 1);
                    assert_eq!(inside.get(), 1);
                    yield_now().await;
                    inside.set(inside.get() - 1);
                    let keep = t.hand_over_wanted(key);
                    t.release(key, keep.then_some(77));
                }) as LocalTask<'_, ()>
            })
            .collect();
        run_tasks(tasks);
        assert_eq!(handed.get(), 2, "two hand-overs, then a remote release");
        assert!(t.map.lock().is_empty() || t.map.lock()[&key].held_remote.is_none());
    }

    /// A turn dropped without a release (its operation failed on the way
    /// or was abandoned) frees the group for the next local task, and a
    /// dropped turn that was released frees nothing it no longer holds.
    #[test]
    fn a_dropped_turn_frees_the_group_once() {
        let t = LockTable::new(true, 2);
        let key = (
            ModelRef {
                node: 0,
                offset: 64,
            },
            5,
        );
        let order = std::cell::RefCell::new(Vec::new());
        let tasks: Vec<LocalTask<'_, ()>> = vec![
            Box::pin(async {
                let turn = t.acquire(key).await;
                order.borrow_mut().push("a holds");
                yield_now().await;
                // Fails without releasing: the drop must.
                drop(turn);
            }),
            Box::pin(async {
                yield_now().await;
                let turn = t.acquire(key).await;
                order.borrow_mut().push("b holds");
                t.release(key, None);
                let third = t.acquire(key).await;
                // `turn` was released; dropping it must not free `third`.
                drop(turn);
                assert!(t.map.lock()[&key].busy, "a released turn freed another");
                drop(third);
                assert!(t.map.lock().get(&key).is_none_or(|e| !e.busy));
            }),
        ];
        run_tasks(tasks);
        assert_eq!(*order.borrow(), vec!["a holds", "b holds"]);
    }
}
