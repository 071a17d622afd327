//! What a backend implements. Engines never see this: they use [`Endpoint`]
//! (which counts every verb the same way whatever the backend) and
//! [`NodeHost`].
//!
//! [`Endpoint`]: crate::Endpoint

use crate::addr::{NodeId, RegionId, RemoteAddr, RemoteRegion, ServiceId};
use crate::endpoint::Endpoint;
use crate::error::Result;
use crate::region::RegionMem;
use crate::service::{Reply, ServiceTable};
use smallvec::SmallVec;
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// One one-sided verb of a batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Verb {
    Read {
        addr: RemoteAddr,
        len: usize,
    },
    Write {
        addr: RemoteAddr,
        data: Vec<u8>,
    },
    /// 8-byte compare-and-swap; yields the value found.
    Cas {
        addr: RemoteAddr,
        expected: u64,
        new: u64,
    },
    /// 8-byte fetch-and-add; yields the previous value.
    Faa {
        addr: RemoteAddr,
        add: u64,
    },
}

impl Verb {
    /// The address the verb accesses.
    #[inline]
    pub fn addr(&self) -> &RemoteAddr {
        match self {
            Verb::Read { addr, .. }
            | Verb::Write { addr, .. }
            | Verb::Cas { addr, .. }
            | Verb::Faa { addr, .. } => addr,
        }
    }

    pub fn node(&self) -> crate::addr::NodeId {
        match self {
            Verb::Read { addr, .. }
            | Verb::Write { addr, .. }
            | Verb::Cas { addr, .. }
            | Verb::Faa { addr, .. } => addr.node,
        }
    }
}

/// The outcome of one verb, in the order the verbs were posted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum VerbResult {
    Read(Vec<u8>),
    Write,
    Cas(u64),
    Faa(u64),
}

/// Verbs of one batch. Most batches hold one to four verbs, which then live
/// inline: posting a batch allocates nothing for its list.
pub type Verbs = SmallVec<[Verb; 4]>;

/// Results of one batch, in posting order; inline up to four like [`Verbs`].
pub type VerbResults = SmallVec<[VerbResult; 4]>;

pub use crate::buffers::PooledResults;

/// A backend operation that either completed at once (one-sided verbs in the
/// local backend) or must be awaited. Completing at once costs no allocation.
pub enum OpFuture<'a, T> {
    Ready(Option<T>),
    /// Done, but the caller's task yields once before it sees the result, as
    /// it would while waiting for a real network round trip.
    ReadyAfterYield(Option<T>, bool),
    Pending(Pin<Box<dyn Future<Output = T> + 'a>>),
    /// The simulated backend's wait `.0` until a virtual instant (a CPU
    /// charge), then `.1`: no allocation (branch i54).
    SimSleep(crate::sim::SleepUntil, Option<T>),
    /// An operation whose state the backend keeps in a shared allocation
    /// it made anyway (the simulated backend's batch states, which it
    /// reuses, and RPC completions): polled through it, without a box per
    /// operation (branch i54).
    Shared(std::rc::Rc<dyn SharedOp<T> + 'a>),
}

/// An operation's state shared by a backend and the task awaiting it
/// ([`OpFuture::Shared`]).
pub trait SharedOp<T> {
    /// [`Future::poll`] of the operation.
    fn poll_op(&self, cx: &mut Context<'_>) -> Poll<T>;
}

impl<'a, T> OpFuture<'a, T> {
    pub fn ready(v: T) -> Self {
        OpFuture::Ready(Some(v))
    }
    /// A result obtained at once that is handed over after one yield, so that
    /// every round trip is a point where the thread's other tasks run (a task
    /// spinning on a remote lock held by a task of its own thread must not
    /// starve it).
    pub fn ready_after_yield(v: T) -> Self {
        OpFuture::ReadyAfterYield(Some(v), false)
    }
    pub fn boxed(f: impl Future<Output = T> + 'a) -> Self {
        OpFuture::Pending(Box::pin(f))
    }
}

impl<T> Future for OpFuture<'_, T> {
    type Output = T;
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<T> {
        match self.get_mut() {
            OpFuture::Ready(v) => Poll::Ready(v.take().expect("OpFuture polled after completion")),
            OpFuture::ReadyAfterYield(v, yielded) => {
                if *yielded {
                    Poll::Ready(v.take().expect("OpFuture polled after completion"))
                } else {
                    *yielded = true;
                    crate::exec::wake_self(cx.waker());
                    Poll::Pending
                }
            }
            OpFuture::Pending(f) => f.as_mut().poll(cx),
            OpFuture::SimSleep(s, v) => Pin::new(s)
                .poll(cx)
                .map(|()| v.take().expect("OpFuture polled after completion")),
            OpFuture::Shared(op) => op.poll_op(cx),
        }
    }
}

impl<T> Unpin for OpFuture<'_, T> {}

/// The future of an RPC ([`EndpointBackend::call_unboxed`]): the backend's
/// operation, or on the `local` backend without injected faults the reply
/// slot's wait itself, held in place instead of boxed (no allocation per
/// RPC).
pub struct CallFuture<'a>(CallInner<'a>);

enum CallInner<'a> {
    Op(OpFuture<'a, Result<Reply>>),
    Slot(crate::local_rpc::ReplyWait<'a>),
}

impl<'a> CallFuture<'a> {
    /// A backend operation.
    pub fn op(op: OpFuture<'a, Result<Reply>>) -> Self {
        CallFuture(CallInner::Op(op))
    }
    /// A local reply slot's wait.
    pub(crate) fn slot(wait: crate::local_rpc::ReplyWait<'a>) -> Self {
        CallFuture(CallInner::Slot(wait))
    }
    /// Whether dropping this future would do nothing: a `local` reply
    /// slot's wait whose answer was taken and its slot given back
    /// (`ReplyWait::is_spent`; branch i83). [`crate::endpoint::RpcCall`]
    /// then overwrites it without calling its drop glue.
    #[inline]
    pub(crate) fn is_spent(&self) -> bool {
        matches!(&self.0, CallInner::Slot(wait) if wait.is_spent())
    }
}

impl Future for CallFuture<'_> {
    type Output = Result<Reply>;
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Reply>> {
        // Both variants are `Unpin` (the operation's future is boxed if
        // pending; the wait holds indices and a reference).
        match &mut self.get_mut().0 {
            CallInner::Op(op) => Pin::new(op).poll(cx),
            CallInner::Slot(wait) => Pin::new(wait).poll(cx),
        }
    }
}

/// A backend's per-thread issuing side.
pub trait EndpointBackend {
    /// The node this endpoint issues from.
    fn local_node(&self) -> NodeId;
    /// Posts every verb, waits once, and returns their results in order.
    /// Verbs to the same node execute in posting order; the batch fails as a
    /// whole on the first refused verb (earlier verbs may have executed, as
    /// with a failed RDMA work request list). The backend takes the verbs
    /// out of `verbs` (passed by reference so that the inline batch is not
    /// copied on every call).
    fn execute(&self, verbs: &mut Verbs) -> OpFuture<'_, Result<VerbResults>>;
    /// Whether the batch's execution may wait for its next poll: the backend
    /// would run `verbs` at once ([`Self::execute_now`]) and has started
    /// loading the lines they access (prefetch hints), so the caller yields
    /// first and executes them when the task is polled again, the one yield
    /// a round trip costs. A posted RDMA verb works so: the NIC fetches the
    /// memory while the CPU runs other tasks, and the read still happens
    /// between the post and the completion. Nothing is executed or checked
    /// here. False (the default): the batch is executed on its first poll.
    fn prefetch(&self, _verbs: &Verbs) -> bool {
        false
    }
    /// The same batch executed at once, when the backend has nothing to
    /// model in between (the `local` backend without injected faults): the
    /// outcome is `Some`, with the result list on success (from the
    /// thread's pool, [`crate::buffers::Spares::take_results`], whose read
    /// buffers the backend may fill in place; the batch's results are the
    /// list's first `verbs.len()` entries, and any entries beyond them are
    /// spare buffers the list keeps, never results; returned, not written
    /// through an out-parameter, so the caller repacks nothing), `verbs` is
    /// left empty; the caller then yields once before handing the
    /// results out, exactly as `execute`'s `OpFuture::ready_after_yield`
    /// would make it. The same verbs execute in the same order with the
    /// same results either way; this only spares the batch future the
    /// `OpFuture` it would move around and the results' moves (the list is
    /// boxed: handing it out moves a pointer). `None` (the default):
    /// nothing was executed and `verbs` is untouched, so the caller goes
    /// through `execute`.
    fn execute_now(&self, _verbs: &mut Verbs) -> Option<Result<PooledResults>> {
        None
    }
    /// Called once at the start of every operation a compute thread issues:
    /// the simulated backend charges the thread's core its per-operation CPU
    /// there. Others have nothing to do.
    fn begin_op(&self) -> OpFuture<'_, ()> {
        OpFuture::ready(())
    }
    /// Whether [`Self::begin_op`] may do anything (asked once, when the
    /// endpoint is made): a backend whose `begin_op` is the default
    /// ready future may say false, and [`Endpoint::begin_op_needed`] then
    /// lets the harness skip the call and the future's poll on every
    /// operation. True by default, so a backend that charges there is
    /// never skipped by mistake.
    fn begins_ops(&self) -> bool {
        true
    }
    /// Charges the thread's core for `lines` cache lines its operation
    /// touched in its own node's memory (see [`crate::Endpoint::charged`]):
    /// the simulated backend, at the same per-line price as a memory-node
    /// handler's lines; others have nothing to do (the real CPU did it).
    fn charge_local_lines(&self, _lines: u64) -> OpFuture<'_, ()> {
        OpFuture::ready(())
    }
    /// Charges the thread's core for `instructions` of work the caller
    /// declares (the benchmark driver's own work, e.g. generating an
    /// update's value; see [`crate::Endpoint::charge_instructions`]): the
    /// simulated backend, at the profile's instruction term; others have
    /// nothing to do (the real CPU did it).
    fn charge_instructions(&self, _instructions: u64) -> OpFuture<'_, ()> {
        OpFuture::ready(())
    }
    /// Sends a request to `service` on `node` and awaits the reply.
    fn call(
        &self,
        node: NodeId,
        service: ServiceId,
        request: Vec<u8>,
    ) -> OpFuture<'_, Result<Reply>>;
    /// An empty buffer to build the next request in (for
    /// [`crate::Endpoint::request_buffer`]): the `local` backend hands back
    /// the allocation of the last request it copied into its slot, so a
    /// small request allocates nothing; by default a new `Vec`.
    fn request_buffer(&self) -> Vec<u8> {
        Vec::new()
    }
    /// Takes back a reply's buffer its caller is done with (for
    /// [`crate::Endpoint::recycle`]): the `local` backend keeps it for the
    /// next request or reply (branch i83); by default it is dropped.
    fn recycle(&self, _buf: Vec<u8>) {}
    /// [`Self::call`], as the future [`Endpoint`](crate::Endpoint) awaits:
    /// the `local` backend answers its fault-free RPCs with the reply
    /// slot's wait in place (no box); the default wraps `call`.
    fn call_unboxed(&self, node: NodeId, service: ServiceId, request: Vec<u8>) -> CallFuture<'_> {
        CallFuture::op(self.call(node, service, request))
    }
}

/// A cluster as seen by one process: it makes endpoints.
pub trait Fabric: Send + Sync {
    /// The backend's name as reported in benchmark output (`local`, `ucx`).
    fn name(&self) -> &'static str;
    /// A new endpoint issuing from `node`, to be used on the calling thread.
    fn endpoint(&self, node: NodeId) -> Result<Endpoint>;
}

/// A node this process hosts: it registers memory and serves services.
pub trait NodeHost: Send + Sync {
    fn id(&self) -> NodeId;
    /// Registers `len` zeroed bytes (rounded up to a cache line) for remote
    /// access and returns the client's view and the local memory.
    fn register_region(&self, len: usize) -> Result<(RemoteRegion, Arc<RegionMem>)>;
    /// Withdraws a region; later accesses to it fail.
    fn deregister_region(&self, id: RegionId);
    /// The node's services and published region names.
    fn services(&self) -> &ServiceTable;
    /// The fabric this node belongs to, for code on the node that issues
    /// verbs or RPCs of its own (background workers, symmetric designs).
    fn fabric(&self) -> Arc<dyn Fabric>;
    /// Number of RPC handler threads serving this node.
    fn handler_threads(&self) -> usize;
    /// CPU time a backend's own progress thread on this node has used so far
    /// (e.g. UCX over TCP, which emulates one-sided verbs with messages that
    /// the target's CPU serves). Zero for backends that have none.
    fn progress_cpu_ns(&self) -> u64 {
        0
    }
}
