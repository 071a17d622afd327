//! Exact, machine-independent cost counters.
//!
//! Every endpoint counts, per operation kind, what its verbs and RPCs cost:
//! round trips (a batch counts once), verbs, bytes each way, RPCs and the CPU
//! time the serving side spent on them. The operation kind is a label that
//! the caller puts on a future with [`Labeled`]; several tasks of one thread
//! may run operations of different kinds at once and each is charged exactly,
//! because a verb is issued (and an RPC completed) only while its own task is
//! being polled.
//!
//! Byte accounting: one-sided reads count their payload as read and writes as
//! written; CAS counts 16 bytes written (compare and swap values) and 8 read,
//! FAA 8 and 8; an RPC counts its request payload as written and its reply
//! payload as read. Headers are not counted, as in the papers.

use std::cell::Cell;
use std::future::Future;
use std::ops::{Add, AddAssign};
use std::pin::Pin;
use std::task::{Context, Poll};

/// What the issuing code is doing; counters are kept per kind.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[repr(u8)]
pub enum OpKind {
    Get = 0,
    Insert,
    Update,
    Upsert,
    Delete,
    Scan,
    /// Bulk loading before a run.
    Load,
    /// Reading back every key after a run.
    Verify,
    /// Connecting, name lookups, fetching models outside an operation.
    Setup,
    /// Anything not labelled.
    Other,
}

impl OpKind {
    pub const COUNT: usize = 10;
    pub const ALL: [OpKind; OpKind::COUNT] = [
        OpKind::Get,
        OpKind::Insert,
        OpKind::Update,
        OpKind::Upsert,
        OpKind::Delete,
        OpKind::Scan,
        OpKind::Load,
        OpKind::Verify,
        OpKind::Setup,
        OpKind::Other,
    ];
    /// The kinds a workload issues (what per-op figures are computed over).
    pub const WORKLOAD: [OpKind; 6] = [
        OpKind::Get,
        OpKind::Insert,
        OpKind::Update,
        OpKind::Upsert,
        OpKind::Delete,
        OpKind::Scan,
    ];

    pub fn name(self) -> &'static str {
        match self {
            OpKind::Get => "get",
            OpKind::Insert => "insert",
            OpKind::Update => "update",
            OpKind::Upsert => "upsert",
            OpKind::Delete => "delete",
            OpKind::Scan => "scan",
            OpKind::Load => "load",
            OpKind::Verify => "verify",
            OpKind::Setup => "setup",
            OpKind::Other => "other",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// Costs of some set of operations.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Counters {
    /// Network round trips: a single verb, a batch of verbs, or an RPC.
    pub round_trips: u64,
    /// One-sided verbs (reads + writes + cas + faa).
    pub verbs: u64,
    pub reads: u64,
    pub writes: u64,
    pub cas: u64,
    pub faa: u64,
    pub rpcs: u64,
    pub bytes_read: u64,
    pub bytes_written: u64,
    /// CPU time the serving nodes spent in handlers for these RPCs.
    pub memnode_cpu_ns: u64,
}

impl AddAssign for Counters {
    fn add_assign(&mut self, o: Counters) {
        self.round_trips += o.round_trips;
        self.verbs += o.verbs;
        self.reads += o.reads;
        self.writes += o.writes;
        self.cas += o.cas;
        self.faa += o.faa;
        self.rpcs += o.rpcs;
        self.bytes_read += o.bytes_read;
        self.bytes_written += o.bytes_written;
        self.memnode_cpu_ns += o.memnode_cpu_ns;
    }
}

/// `now - start`, field by field; `start` must be an earlier reading of the
/// same monotone counters.
#[inline]
pub fn since(now: &Counters, start: &Counters) -> Counters {
    Counters {
        round_trips: now.round_trips - start.round_trips,
        verbs: now.verbs - start.verbs,
        reads: now.reads - start.reads,
        writes: now.writes - start.writes,
        cas: now.cas - start.cas,
        faa: now.faa - start.faa,
        rpcs: now.rpcs - start.rpcs,
        bytes_read: now.bytes_read - start.bytes_read,
        bytes_written: now.bytes_written - start.bytes_written,
        memnode_cpu_ns: now.memnode_cpu_ns - start.memnode_cpu_ns,
    }
}

impl Add for Counters {
    type Output = Counters;
    fn add(mut self, o: Counters) -> Counters {
        self += o;
        self
    }
}

/// Counters for every operation kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CounterTable {
    by_kind: [Counters; OpKind::COUNT],
}

impl CounterTable {
    pub fn get(&self, kind: OpKind) -> &Counters {
        &self.by_kind[kind.index()]
    }
    pub fn get_mut(&mut self, kind: OpKind) -> &mut Counters {
        &mut self.by_kind[kind.index()]
    }
    /// The sum over the given kinds.
    pub fn sum(&self, kinds: &[OpKind]) -> Counters {
        kinds
            .iter()
            .fold(Counters::default(), |acc, k| acc + *self.get(*k))
    }
    pub fn merge(&mut self, other: &CounterTable) {
        for k in OpKind::ALL {
            *self.get_mut(k) += *other.get(k);
        }
    }
}

thread_local! {
    static CURRENT_KIND: Cell<OpKind> = const { Cell::new(OpKind::Other) };
}

/// The operation kind of the code running now on this thread.
#[inline]
pub fn current_kind() -> OpKind {
    CURRENT_KIND.with(|c| c.get())
}

/// Runs `f` with the current operation kind set to `kind`.
// Inlined, with the restore: it runs on every poll of a labelled future
// (every operation of the workload), and the workspace builds without LTO,
// so a non-generic `drop` was a call into this crate from every caller's.
#[inline]
pub fn with_kind<R>(kind: OpKind, f: impl FnOnce() -> R) -> R {
    let prev = CURRENT_KIND.with(|c| c.replace(kind));
    struct Restore(OpKind);
    impl Drop for Restore {
        #[inline]
        fn drop(&mut self) {
            CURRENT_KIND.with(|c| c.set(self.0));
        }
    }
    let _restore = Restore(prev);
    f()
}

pin_project_lite::pin_project! {
    /// A future whose verbs and RPCs are charged to `kind`.
    pub struct Labeled<F> {
        kind: OpKind,
        #[pin]
        inner: F,
    }
}

/// Charges everything `fut` does to `kind`.
pub fn labeled<F: Future>(kind: OpKind, fut: F) -> Labeled<F> {
    Labeled { kind, inner: fut }
}

impl<F: Future> Future for Labeled<F> {
    type Output = F::Output;
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<F::Output> {
        let this = self.project();
        let kind = *this.kind;
        let inner = this.inner;
        with_kind(kind, || inner.poll(cx))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_nest_and_restore() {
        assert_eq!(current_kind(), OpKind::Other);
        with_kind(OpKind::Get, || {
            assert_eq!(current_kind(), OpKind::Get);
            with_kind(OpKind::Scan, || assert_eq!(current_kind(), OpKind::Scan));
            assert_eq!(current_kind(), OpKind::Get);
        });
        assert_eq!(current_kind(), OpKind::Other);
    }

    #[test]
    fn table_sums_kinds() {
        let mut t = CounterTable::default();
        t.get_mut(OpKind::Get).round_trips = 2;
        t.get_mut(OpKind::Scan).round_trips = 3;
        t.get_mut(OpKind::Load).round_trips = 100;
        assert_eq!(t.sum(&OpKind::WORKLOAD).round_trips, 5);
        let mut u = CounterTable::default();
        u.merge(&t);
        u.merge(&t);
        assert_eq!(u.get(OpKind::Scan).round_trips, 6);
    }
}
