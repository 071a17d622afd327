//! [`Endpoint`]: what engines use to reach other nodes, with exact counters.

use crate::addr::{NodeId, RemoteAddr, RemoteRegion, ServiceId};
use crate::backend::{
    CallFuture, EndpointBackend, OpFuture, PooledResults, Verb, VerbResult, VerbResults, Verbs,
};
use crate::counters::{CounterTable, Counters, current_kind};
use crate::error::{Result, TransportError};
use crate::service::{decode_region, directory};
use crate::wire::WireWriter;
use std::cell::{Cell, RefCell};
use std::future::Future;
use std::pin::Pin;
use std::ptr::NonNull;
use std::task::{Context, Poll};

/// The issuing side of one thread: one-sided verbs, batches and RPCs. It
/// counts every round trip, verb, byte and RPC (and the serving side's CPU
/// time) under the operation kind of the task issuing it; counting happens
/// here, above the backend, so that all backends count alike.
///
/// Use an endpoint on the thread that made it; tasks of that thread share it.
pub struct Endpoint {
    backend: Box<dyn EndpointBackend>,
    counters: RefCell<CounterTable>,
    /// The accumulator of the stretch of polling being metered, if any
    /// ([`Endpoint::metering`]): every charge is added to it in place, as
    /// it is added to its kind's counters.
    ///
    /// Invariant (M1): it is `Some` only while a `metering` call runs on
    /// this thread, and then points at that call's `into`, which the call
    /// borrows exclusively for its whole duration; the call puts the
    /// previous value back before it returns or unwinds. The endpoint is
    /// neither `Send` nor `Sync` (its `RefCell` and this `Cell`), so only
    /// code inside that call can reach the pointer.
    meter: Cell<Option<NonNull<Counters>>>,
    /// The backend's [`EndpointBackend::begins_ops`], asked once.
    begins_ops: bool,
}

impl Endpoint {
    pub fn new(backend: Box<dyn EndpointBackend>) -> Endpoint {
        let begins_ops = backend.begins_ops();
        Endpoint {
            backend,
            counters: RefCell::new(CounterTable::default()),
            meter: Cell::new(None),
            begins_ops,
        }
    }

    /// The node this endpoint issues from.
    pub fn node(&self) -> NodeId {
        self.backend.local_node()
    }

    /// The counters so far.
    pub fn counters(&self) -> CounterTable {
        *self.counters.borrow()
    }

    /// Clears the counters (e.g. between load and run). A stretch being
    /// metered ([`Endpoint::metering`]) keeps what it has accumulated.
    pub fn reset_counters(&self) {
        *self.counters.borrow_mut() = CounterTable::default();
    }

    /// Everything charged so far, over all operation kinds (the sum of
    /// [`Endpoint::counters`]; summed when asked, not kept up to date on
    /// every charge).
    pub fn total_counters(&self) -> Counters {
        self.counters.borrow().sum(&crate::counters::OpKind::ALL)
    }

    /// Runs `f` and adds to `into` everything this endpoint charges while
    /// `f` runs (to whatever operation kind), in place as each charge is
    /// made: how the harness meters each poll of an operation's future
    /// (its `Metered`), without copying or differencing counter tables. A
    /// compute thread polls one task at a time and a charge happens only
    /// while the task issuing it is polled, so what a poll's `f` adds is
    /// exactly that task's cost. Nested calls each see their own charges:
    /// the inner `into` gets them first and the outer one is credited with
    /// the same amounts when the inner call returns, so an outer meter sees
    /// all charges made during its call, as before.
    #[inline]
    #[allow(unsafe_code)]
    pub fn metering<R>(&self, into: &mut Counters, f: impl FnOnce() -> R) -> R {
        /// Puts the previous meter back, also when `f` unwinds (M1).
        struct Restore<'e>(
            &'e Cell<Option<NonNull<Counters>>>,
            Option<NonNull<Counters>>,
        );
        impl Drop for Restore<'_> {
            #[inline]
            fn drop(&mut self) {
                self.0.set(self.1);
            }
        }
        let outer = self.meter.get();
        if let Some(outer) = outer {
            return self.metering_nested(outer, into, f);
        }
        // The common case, no meter running: nothing to credit afterwards,
        // so no starting value is copied (a nested call's is, below).
        let restore = Restore(&self.meter, None);
        self.meter.set(Some(NonNull::from(&mut *into)));
        let r = f();
        drop(restore);
        r
    }

    /// [`Endpoint::metering`] inside another one, whose accumulator is
    /// `outer`: the outer meter is credited with what `into` gets.
    #[cold]
    #[allow(unsafe_code)]
    fn metering_nested<R>(
        &self,
        outer: NonNull<Counters>,
        into: &mut Counters,
        f: impl FnOnce() -> R,
    ) -> R {
        /// Puts the outer meter back, also when `f` unwinds (M1).
        struct Restore<'e>(&'e Cell<Option<NonNull<Counters>>>, NonNull<Counters>);
        impl Drop for Restore<'_> {
            fn drop(&mut self) {
                self.0.set(Some(self.1));
            }
        }
        // The starting value, to credit the outer meter with the difference.
        let start = *into;
        let restore = Restore(&self.meter, outer);
        self.meter.set(Some(NonNull::from(&mut *into)));
        let r = f();
        drop(restore);
        // SAFETY: `outer` was installed by an enclosing `metering` call on
        // this thread that is still running (it is what `restore` put
        // back), so it points at that call's exclusively borrowed
        // accumulator (M1); nothing else refers to it now.
        unsafe { *outer.as_ptr() += crate::counters::since(into, &start) };
        r
    }

    /// Adds a charge to the current kind's counters and to the meter, if
    /// one is running, by applying `f` to both in place: `f` only adds to
    /// fields (every caller's closure is a list of `+=`), so this is what
    /// adding `f(&mut Counters::default())` to both would do, without
    /// building and adding the whole 80-byte `Counters` twice (an RPC
    /// charges twice: ~54 instructions each that way).
    #[inline]
    #[allow(unsafe_code)]
    fn charge(&self, f: impl Fn(&mut Counters)) {
        f(self.counters.borrow_mut().get_mut(current_kind()));
        if let Some(m) = self.meter.get() {
            // SAFETY: a meter is installed only by `metering`, which is
            // running on this thread (the endpoint is not `Sync`) with the
            // accumulator exclusively borrowed and untouched by anything
            // else until it returns (M1); no other reference to it exists
            // during this add.
            f(unsafe { &mut *m.as_ptr() });
        }
    }

    /// Adds one batch's charge ([`BatchCost::add_to`]) to the current
    /// kind's counters and to the meter, if one is running: what adding
    /// `cost.counters()` to both would do, without building and adding a
    /// whole `Counters` twice.
    #[inline]
    #[allow(unsafe_code)]
    fn add_batch(&self, cost: &BatchCost) {
        cost.add_to(self.counters.borrow_mut().get_mut(current_kind()));
        if let Some(m) = self.meter.get() {
            // SAFETY: as in `charge` (M1): the meter's accumulator is
            // exclusively borrowed by the running `metering` call on this
            // thread and nothing else refers to it during this add.
            unsafe { cost.add_to(&mut *m.as_ptr()) };
        }
    }

    /// Counts `bytes` that another node wrote one-sided into this node's
    /// memory on behalf of the operation being polled, as read by it
    /// (ScaleStore's page transfers: the holder writes the page into the
    /// requester's frame, §3.5). No verb or round trip is added: the issuing
    /// node's endpoint counts the write, and the RPC that asked for it is
    /// this operation's round trip.
    /// An empty buffer with room for `capacity` bytes, to encode a request
    /// for [`Endpoint::call`] in: on the `local` backend the allocation of
    /// this endpoint's last small request (its payload was copied into the
    /// request slot and the `Vec` kept), so encoding allocates nothing. Any
    /// `Vec` may be passed to `call`; this only spares the allocation.
    #[inline]
    pub fn request_buffer(&self, capacity: usize) -> Vec<u8> {
        let mut v = self.backend.request_buffer();
        v.reserve(capacity);
        v
    }

    /// Gives a reply's buffer back to the endpoint once its caller has
    /// read it (a write's acknowledgement, a reply whose value was copied
    /// out): on the `local` backend its allocation is kept for the next
    /// request or reply ([`Endpoint::request_buffer`]), so a small RPC
    /// whose reply comes back here allocates and frees nothing. Optional:
    /// dropping the buffer instead is always correct.
    #[inline]
    pub fn recycle(&self, buf: Vec<u8>) {
        self.backend.recycle(buf)
    }

    pub fn charge_pushed(&self, bytes: u64) {
        self.charge(|c| c.bytes_read += bytes);
    }

    /// Marks the start of one operation of the workload: the `sim` backend
    /// charges the thread's simulated core its per-operation CPU here (the
    /// engine's index work and the request's preparation); other backends
    /// do nothing.
    /// (The backend's future itself, not an `async fn` wrapping it.)
    #[inline]
    pub fn begin_op(&self) -> OpFuture<'_, ()> {
        self.backend.begin_op()
    }

    /// Whether [`Self::begin_op`] may do anything on this backend (false
    /// where it is always the default ready future, e.g. `local`): a caller
    /// may then skip it. Calling it anyway is always right.
    #[inline]
    pub fn begin_op_needed(&self) -> bool {
        self.begins_ops
    }

    /// Runs `op`, an operation that works in this compute node's own
    /// memory (ScaleStore's and `btree-local`'s B-tree walks over cached
    /// pages), and charges that work to this thread's core: on `sim`, every
    /// DISTINCT cache line of region memory `op` reads or writes on this
    /// thread (a line touched again in the same operation is free: it hits
    /// L1), every distinct object it reports with [`crate::touch_local_at`],
    /// and every line it reports with [`crate::touch_local_lines`] (latch
    /// words, a translation table; counted as given), costs the profile's
    /// `line_ns`, charged
    /// when `op` ends (the task waits until its core has done it, behind
    /// whatever else the core has queued); the per-operation CPU of
    /// [`Self::begin_op`] stays as it is. On `local` and `ucx` the real CPU
    /// did the work: `op` runs as it is. Engines that call neither this nor
    /// `touch_local_lines` are charged exactly as before.
    /// (docs/simulation.md, "The hardware model", compute CPU.)
    pub async fn charged<F: std::future::Future>(&self, op: F) -> F::Output {
        if !crate::sim::active() {
            return op.await;
        }
        let op = std::pin::pin!(op);
        let (out, lines) = crate::sim::CountLocal::new(op).await;
        self.backend.charge_local_lines(lines).await;
        out
    }

    /// Charges this thread's core for `instructions` of work the caller
    /// did outside any engine (the benchmark driver's, e.g. generating an
    /// update's value as ScaleStore's YCSB driver does): on `sim` they cost
    /// `instructions / (cpu_ghz x ipc)` ns of the core (the profile's
    /// instruction term, `MemnodeProfile::instructions_per_us`; the
    /// profiles describe one CPU generation per testbed, as for
    /// [`Self::charged`]'s lines), and the task waits until the core has
    /// done it; nothing with a profile without an instruction term. On
    /// `local` and `ucx` the real CPU did the work: nothing to charge.
    pub async fn charge_instructions(&self, instructions: u64) {
        if instructions > 0 {
            self.backend.charge_instructions(instructions).await;
        }
    }

    // The single-verb helpers below build their one-verb batch when called
    // and return a future holding only its `BatchRun` (an `async fn` or
    // block would keep a second copy of the batch in its state). The verb is
    // still counted and posted when the future is first polled.

    /// Reads `len` bytes at `addr`: one round trip.
    #[inline]
    pub fn read(&self, addr: RemoteAddr, len: usize) -> OneVerb<'_, Vec<u8>> {
        OneVerb {
            run: self.single(Verb::Read { addr, len }),
            out: |mut r| r.take_read(0),
        }
    }

    /// Reads `len` bytes at `addr` (one round trip, counted as
    /// [`Endpoint::read`]) into a buffer that goes back to the thread's
    /// spare buffers ([`crate::buffers`]) when dropped: for callers that only
    /// look at the bytes.
    #[inline]
    pub fn read_buf(&self, addr: RemoteAddr, len: usize) -> OneVerb<'_, ReadBuf> {
        OneVerb {
            run: self.single(Verb::Read { addr, len }),
            out: |r| ReadBuf { r },
        }
    }

    /// Writes `data` at `addr`: one round trip.
    pub fn write(&self, addr: RemoteAddr, data: &[u8]) -> OneVerb<'_, ()> {
        OneVerb {
            run: self.single(Verb::Write {
                addr,
                data: data.to_vec(),
            }),
            out: |_| (),
        }
    }

    /// 8-byte compare-and-swap at `addr`; returns the value found there
    /// (equal to `expected` iff the swap happened).
    #[inline]
    pub fn cas(&self, addr: RemoteAddr, expected: u64, new: u64) -> OneVerb<'_, u64> {
        OneVerb {
            run: self.single(Verb::Cas {
                addr,
                expected,
                new,
            }),
            out: |r| r.word(0),
        }
    }

    /// 8-byte fetch-and-add at `addr`; returns the previous value.
    #[inline]
    pub fn faa(&self, addr: RemoteAddr, add: u64) -> OneVerb<'_, u64> {
        OneVerb {
            run: self.single(Verb::Faa { addr, add }),
            out: |r| r.word(0),
        }
    }

    /// A batch of the one verb `v`, ready to post.
    #[inline]
    fn single(&self, v: Verb) -> BatchRun<'_> {
        let mut cost = BatchCost::default();
        cost.note(&v);
        let mut verbs = Verbs::new();
        verbs.push(v);
        BatchRun {
            ep: self,
            deferred: false,
            state: std::mem::ManuallyDrop::new(RunState::Unposted(verbs, cost)),
        }
    }

    /// Starts a batch of verbs that is posted at once and costs one round
    /// trip (RDMA doorbell batching).
    #[inline]
    pub fn batch(&self) -> Batch<'_> {
        Batch {
            ep: self,
            verbs: Verbs::new(),
            cost: BatchCost::default(),
        }
    }

    /// An empty batch built in its future itself: verbs are added to the
    /// returned [`BatchRun`] ([`BatchRun::read`], ...), which the caller
    /// then awaits by reference (`(&mut run).await`). For a caller whose
    /// future keeps the batch across its round trip: `batch()` then
    /// [`Batch::run`] moves the verbs into the batch's future and that
    /// future into the caller's state (`memcpy` calls of a few hundred
    /// bytes per round trip); a future made here stays where it was made.
    /// Counted, posted and answered as [`Batch::run`]'s future.
    #[inline]
    pub fn batch_run(&self) -> BatchRun<'_> {
        BatchRun {
            ep: self,
            deferred: false,
            state: std::mem::ManuallyDrop::new(RunState::Unposted(
                Verbs::new(),
                BatchCost::default(),
            )),
        }
    }

    /// Sends `request` to `service` on `node` and returns the reply payload.
    /// A refusal by the service comes back as [`TransportError::Remote`].
    ///
    /// The request is counted and sent when the returned future is first
    /// polled (so the counts go to the operation kind of the task polling
    /// it, as with a batch), and the reply counted when it arrives.
    #[inline]
    pub fn call(&self, node: NodeId, service: ServiceId, request: Vec<u8>) -> RpcCall<'_> {
        RpcCall {
            ep: self,
            node,
            state: std::mem::ManuallyDrop::new(CallState::Unsent(service, request)),
        }
    }

    /// Resolves a service name on `node` through its directory.
    pub async fn lookup_service(&self, node: NodeId, name: &str) -> Result<ServiceId> {
        let mut w = WireWriter::new();
        w.u8(directory::RESOLVE_SERVICE).str(name);
        let reply = self.call(node, ServiceId::DIRECTORY, w.finish()).await?;
        let bytes: [u8; 4] = reply
            .as_slice()
            .try_into()
            .map_err(|_| TransportError::Malformed("directory reply for a service".into()))?;
        Ok(ServiceId(u32::from_le_bytes(bytes)))
    }

    /// Resolves a published region name on `node` through its directory.
    pub async fn lookup_region(&self, node: NodeId, name: &str) -> Result<RemoteRegion> {
        let mut w = WireWriter::new();
        w.u8(directory::RESOLVE_REGION).str(name);
        let reply = self.call(node, ServiceId::DIRECTORY, w.finish()).await?;
        Ok(decode_region(&reply)?)
    }
}

/// An RPC in flight; see [`Endpoint::call`]. Written out instead of as an
/// `async fn` (branch i66): the request and the backend's reply future stay
/// in place, and a poll is a branch and the reply future's poll, where the
/// generated state machine moved them between its states.
pub struct RpcCall<'a> {
    ep: &'a Endpoint,
    node: NodeId,
    /// Dropped by `RpcCall`'s own `Drop` only when it is not `Done` (branch
    /// i83): a finished call's drop is then one inlined check instead of
    /// an out-of-line call of `CallState`'s drop glue.
    state: std::mem::ManuallyDrop<CallState<'a>>,
}

impl Drop for RpcCall<'_> {
    #[inline]
    fn drop(&mut self) {
        if !matches!(*self.state, CallState::Done) {
            self.drop_state();
        }
    }
}

impl RpcCall<'_> {
    /// Drops an unfinished call's state (its request, or its wait for the
    /// reply: a call given up).
    #[cold]
    #[inline(never)]
    #[allow(unsafe_code)]
    fn drop_state(&mut self) {
        // SAFETY: called once, from `drop`; the state is not used again.
        unsafe { std::mem::ManuallyDrop::drop(&mut self.state) }
    }
}

enum CallState<'a> {
    /// Not polled yet: nothing counted or sent.
    Unsent(ServiceId, Vec<u8>),
    /// Sent (and counted); waiting for the reply.
    Sent(CallFuture<'a>),
    /// The reply was handed out (or the send failed).
    Done,
}

impl Future for RpcCall<'_> {
    type Output = Result<Vec<u8>>;
    #[allow(unsafe_code)]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<Vec<u8>>> {
        // Every field is `Unpin` (`CallFuture` is).
        let this = self.get_mut();
        if matches!(*this.state, CallState::Unsent(..)) {
            let CallState::Unsent(service, request) =
                std::mem::replace(&mut *this.state, CallState::Done)
            else {
                unreachable!("checked above")
            };
            let sent = request.len() as u64;
            this.ep.charge(|c| {
                c.round_trips += 1;
                c.rpcs += 1;
                c.bytes_written += sent;
            });
            let reply = this.ep.backend.call_unboxed(this.node, service, request);
            // SAFETY: `state` is `Done` (replaced above; the backend cannot
            // reach this future), which owns nothing: overwriting it without
            // running its drop glue (an out-of-line call per RPC, branch
            // i71) leaks nothing.
            unsafe { std::ptr::write(&mut *this.state, CallState::Sent(reply)) };
        }
        let CallState::Sent(wait) = &mut *this.state else {
            panic!("RpcCall polled after completion");
        };
        let reply = std::task::ready!(Pin::new(&mut *wait).poll(cx));
        if wait.is_spent() {
            // SAFETY: a spent wait owns nothing and its drop does nothing
            // (`CallFuture::is_spent`), so overwriting it without running
            // its drop glue (an out-of-line call per RPC, branch i83)
            // leaks nothing.
            unsafe { std::ptr::write(&mut *this.state, CallState::Done) };
        } else {
            *this.state = CallState::Done;
        }
        let reply = reply?;
        let received = reply.result.as_ref().map_or(0, |p| p.len() as u64);
        this.ep.charge(|c| {
            c.bytes_read += received;
            c.memnode_cpu_ns += reply.server_cpu_ns;
        });
        let node = this.node;
        Poll::Ready(
            reply
                .result
                .map_err(|error| TransportError::Remote { node, error }),
        )
    }
}

/// Verbs posted together; see [`Endpoint::batch`].
pub struct Batch<'a> {
    ep: &'a Endpoint,
    verbs: Verbs,
    /// What the verbs cost, counted as they are added (invariant: equal to
    /// `batch_counters(&verbs)` without its round trip and verb count).
    cost: BatchCost,
}

/// Adds a verb to a batch being built, its cost counted as it is added
/// (the invariant on [`Batch`]'s `cost`); returns its index in the
/// results. Shared by [`Batch`] and [`BatchRun`]; always inlined so that
/// `note`'s match folds away for the variant the caller built.
#[inline(always)]
fn add_verb(verbs: &mut Verbs, cost: &mut BatchCost, v: Verb) -> usize {
    cost.note(&v);
    verbs.push(v);
    verbs.len() - 1
}

impl<'a> Batch<'a> {
    /// Adds a read; returns its index in the results.
    #[inline]
    pub fn read(&mut self, addr: RemoteAddr, len: usize) -> usize {
        self.push(Verb::Read { addr, len })
    }
    #[inline]
    pub fn write(&mut self, addr: RemoteAddr, data: Vec<u8>) -> usize {
        self.push(Verb::Write { addr, data })
    }
    #[inline]
    pub fn cas(&mut self, addr: RemoteAddr, expected: u64, new: u64) -> usize {
        self.push(Verb::Cas {
            addr,
            expected,
            new,
        })
    }
    #[inline]
    pub fn faa(&mut self, addr: RemoteAddr, add: u64) -> usize {
        self.push(Verb::Faa { addr, add })
    }
    // Always inlined (into the engine's code: the workspace builds without
    // LTO) so that `note`'s match on the verb folds away for the variant
    // the caller built.
    #[inline(always)]
    fn push(&mut self, v: Verb) -> usize {
        add_verb(&mut self.verbs, &mut self.cost, v)
    }
    #[inline]
    pub fn len(&self) -> usize {
        self.verbs.len()
    }
    #[inline]
    pub fn is_empty(&self) -> bool {
        self.verbs.is_empty()
    }

    /// Posts the verbs and waits once. An empty batch costs nothing.
    ///
    /// The returned future counts the batch and hands it to the backend on
    /// its first poll (so the counts go to the operation kind of the task
    /// polling it, as with any verb), then waits for the backend's answer.
    /// Written out instead of as an `async fn`: the batch and the backend's
    /// future stay in place in it, where the generated state machine moved
    /// them between its states (several `memcpy` calls of a few hundred
    /// bytes per round trip), and a resumed poll is one branch and the
    /// backend future's poll.
    #[inline]
    pub fn run(self) -> BatchRun<'a> {
        BatchRun {
            ep: self.ep,
            deferred: false,
            state: std::mem::ManuallyDrop::new(RunState::Unposted(self.verbs, self.cost)),
        }
    }
}

/// What a batch's verbs cost apart from its round trip, counted verb by
/// verb as they are added (so posting a batch does not walk it again).
/// Narrow fields keep every batch future small; a batch has far fewer than
/// 2^32 verbs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct BatchCost {
    reads: u32,
    writes: u32,
    cas: u32,
    faa: u32,
    bytes_read: u64,
    bytes_written: u64,
}

impl BatchCost {
    /// Adds `v`'s cost (the byte accounting of [`crate::counters`]).
    #[inline(always)]
    fn note(&mut self, v: &Verb) {
        match v {
            Verb::Read { len, .. } => {
                self.reads += 1;
                self.bytes_read += *len as u64;
            }
            Verb::Write { data, .. } => {
                self.writes += 1;
                self.bytes_written += data.len() as u64;
            }
            Verb::Cas { .. } => {
                self.cas += 1;
                self.bytes_written += 16;
                self.bytes_read += 8;
            }
            Verb::Faa { .. } => {
                self.faa += 1;
                self.bytes_written += 8;
                self.bytes_read += 8;
            }
        }
    }

    /// Adds the batch's counters ([`Self::counters`]) to `c` in place.
    #[inline]
    fn add_to(&self, c: &mut Counters) {
        c.round_trips += 1;
        c.verbs += u64::from(self.reads + self.writes + self.cas + self.faa);
        c.reads += u64::from(self.reads);
        c.writes += u64::from(self.writes);
        c.cas += u64::from(self.cas);
        c.faa += u64::from(self.faa);
        c.bytes_read += self.bytes_read;
        c.bytes_written += self.bytes_written;
    }

    /// The counters of the batch: one round trip and these verbs.
    #[cfg(test)]
    fn counters(&self) -> Counters {
        Counters {
            round_trips: 1,
            verbs: u64::from(self.reads + self.writes + self.cas + self.faa),
            reads: u64::from(self.reads),
            writes: u64::from(self.writes),
            cas: u64::from(self.cas),
            faa: u64::from(self.faa),
            bytes_read: self.bytes_read,
            bytes_written: self.bytes_written,
            ..Counters::default()
        }
    }
}

/// The counters one batch of `verbs` is charged: one round trip, its verbs
/// and the bytes each moves (what [`BatchCost`] counts as verbs are added;
/// the tests check the two agree).
#[cfg(test)]
fn batch_counters(verbs: &Verbs) -> Counters {
    let mut c = Counters {
        round_trips: 1,
        verbs: verbs.len() as u64,
        ..Counters::default()
    };
    for v in verbs {
        match v {
            Verb::Read { len, .. } => {
                c.reads += 1;
                c.bytes_read += *len as u64;
            }
            Verb::Write { data, .. } => {
                c.writes += 1;
                c.bytes_written += data.len() as u64;
            }
            Verb::Cas { .. } => {
                c.cas += 1;
                c.bytes_written += 16;
                c.bytes_read += 8;
            }
            Verb::Faa { .. } => {
                c.faa += 1;
                c.bytes_written += 8;
                c.bytes_read += 8;
            }
        }
    }
    c
}

/// The future of [`Batch::run`].
#[must_use = "a batch is posted only when its future is polled"]
pub struct BatchRun<'a> {
    ep: &'a Endpoint,
    /// Posted and counted, its execution deferred to the next poll
    /// ([`EndpointBackend::prefetch`]); the verbs are still in `state`.
    deferred: bool,
    /// Dropped by `BatchRun`'s own `drop`, which skips the drop glue's call
    /// for a state with nothing to drop (a batch whose results were handed
    /// out, the common end of every round trip).
    state: std::mem::ManuallyDrop<RunState<'a>>,
}

impl Drop for BatchRun<'_> {
    /// Inlined into the engines' futures: a batch that handed out its
    /// results (`Executed(None, _)`) owns nothing, and is done with a
    /// compare instead of a call into the state's drop glue.
    #[inline]
    #[allow(unsafe_code)]
    fn drop(&mut self) {
        if !matches!(*self.state, RunState::Executed(None, _)) {
            drop_state(&mut self.state);
        }
    }
}

/// A `BatchRun`'s state that owns something, dropped out of line (cold: a
/// batch dropped before it handed its results out), so that the common
/// drop is a compare without saved registers.
#[cold]
#[inline(never)]
#[allow(unsafe_code)]
fn drop_state(state: &mut std::mem::ManuallyDrop<RunState<'_>>) {
    // SAFETY: called only from `BatchRun`'s `drop`, once: `state` is
    // dropped here and not used after (the `BatchRun` is being dropped).
    unsafe { std::mem::ManuallyDrop::drop(state) };
}

/// The verbs before the first poll, the backend's operation (or the results
/// of a batch executed at once) after it: one or the other, so the future
/// is as large as the larger of the two (every engine operation's future
/// holds one of these at each round trip).
enum RunState<'a> {
    Unposted(Verbs, BatchCost),
    /// Executed at once ([`EndpointBackend::execute_now`]); handed out on
    /// the poll after the task's one yield (taken out of the `Option`, not
    /// by replacing the whole state: that would copy the state's largest
    /// variant, the verbs, on every round trip).
    /// The list may hold more entries than the batch had verbs (spare
    /// buffers of earlier batches, [`EndpointBackend::execute_now`]); the
    /// second field is the batch's length.
    /// The second field also tells whether the list may hold a read buffer
    /// larger than the pool keeps (B1), i.e. whether giving it back must
    /// look at every entry: [`BatchResult`]'s `len`, with the same flag bit.
    Executed(Option<Result<PooledResults>>, usize),
    Posted(OpFuture<'a, Result<VerbResults>>),
}

impl Future for BatchRun<'_> {
    type Output = Result<BatchResult>;
    /// The poll after the round trip's one yield (a batch the backend
    /// executed at once) hands the results out here, inlined into the
    /// caller; everything else ([`BatchRun::post`], the backend's future) is
    /// one call away. A batch is polled twice on the local backend, and the
    /// second poll then costs a branch and a move of two words instead of
    /// a call into the whole posting function.
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        // Every field is `Unpin` (the backend's future is boxed if pending).
        let this = self.get_mut();
        if let RunState::Executed(r, len) = &mut *this.state {
            let len = *len;
            let r = r.take().expect("a batch future polled after completion");
            return Poll::Ready(r.map(|results| BatchResult {
                results: Some(results),
                len,
            }));
        }
        // The poll after a deferred post: the verbs execute now, in a call
        // of their own (not the whole posting function again).
        if this.deferred
            && let Some(done) = this.execute_deferred()
        {
            return Poll::Ready(done);
        }
        this.post(cx)
    }
}

impl BatchRun<'_> {
    /// Adds a read to a batch not posted yet ([`Endpoint::batch_run`]);
    /// returns its index in the results, as [`Batch::read`].
    #[inline]
    pub fn read(&mut self, addr: RemoteAddr, len: usize) -> usize {
        self.push(Verb::Read { addr, len })
    }
    /// Adds a write, as [`Batch::write`].
    #[inline]
    pub fn write(&mut self, addr: RemoteAddr, data: Vec<u8>) -> usize {
        self.push(Verb::Write { addr, data })
    }
    /// Adds a compare-and-swap, as [`Batch::cas`].
    #[inline]
    pub fn cas(&mut self, addr: RemoteAddr, expected: u64, new: u64) -> usize {
        self.push(Verb::Cas {
            addr,
            expected,
            new,
        })
    }
    /// Whether the batch has no verbs and was not posted (an empty batch
    /// costs nothing: no round trip, as [`Batch::is_empty`]).
    #[inline]
    pub fn is_unposted_empty(&self) -> bool {
        matches!(&*self.state, RunState::Unposted(verbs, _) if verbs.is_empty())
    }
    // As `Batch::push`: the verb's cost counted as it is added.
    #[inline(always)]
    fn push(&mut self, v: Verb) -> usize {
        match &mut *self.state {
            RunState::Unposted(verbs, cost) => add_verb(verbs, cost, v),
            _ => panic!("a verb added to a batch already posted"),
        }
    }

    /// The execution of a batch whose post was deferred
    /// ([`EndpointBackend::prefetch`]: counted and hinted on the poll
    /// before, the round trip's yield behind it): the backend runs the
    /// verbs at once and the results are handed out, the state left with
    /// nothing to drop. `None` if the backend cannot run them at once now
    /// (faults injected since the post): `post` then hands them to
    /// `execute`, as it does for a batch not deferred. What `post`'s
    /// deferred path did, without its first poll's branches and state
    /// moves (~85 instructions per round trip for the call before).
    #[inline(never)]
    fn execute_deferred(&mut self) -> Option<Result<BatchResult>> {
        let RunState::Unposted(verbs, cost) = &mut *self.state else {
            unreachable!("a deferred batch keeps its verbs until it executes")
        };
        let len = results_len(verbs, cost);
        let done = self.ep.backend.execute_now(verbs)?;
        leave_unposted(&mut self.state, RunState::Executed(None, len));
        Some(done.map(|results| BatchResult {
            results: Some(results),
            len,
        }))
    }

    /// Every poll but the one handing out a batch executed at once (and the
    /// deferred execution, [`Self::execute_deferred`]): the first poll
    /// counts and posts the verbs, later ones poll the backend's operation.
    #[inline(never)]
    fn post(&mut self, cx: &mut Context<'_>) -> Poll<Result<BatchResult>> {
        let this = self;
        if let RunState::Unposted(verbs, cost) = &mut *this.state {
            if verbs.is_empty() {
                return Poll::Ready(Ok(BatchResult {
                    results: None,
                    len: 0,
                }));
            }
            let ep = this.ep;
            if this.deferred {
                // Reached only when `execute_deferred` declined (faults
                // injected between the post and its execution, the
                // fault-flip race): counted and hinted already, the verbs
                // go straight to `execute`, which decides how they run
                // under the faults. (Before, `execute_now` was asked a
                // second time first, and declined for the same flag.)
                let op = ep.backend.execute(verbs);
                // No longer deferred: later polls poll the backend's operation.
                this.deferred = false;
                *this.state = RunState::Posted(op);
            } else {
                // Counted as the verbs were added; added to the kind's
                // counters and the meter here, on the first poll, as before.
                ep.add_batch(cost);
                // The round trip's one yield before the execution, if the
                // backend has started loading the verbs' lines: the task's
                // next poll executes them (the verbs stay in the state).
                if ep.backend.prefetch(verbs) {
                    this.deferred = true;
                    crate::exec::wake_self(cx.waker());
                    return Poll::Pending;
                }
                let len = results_len(verbs, cost);
                // Executed at once if the backend can: the results wait in
                // the state for the poll after the one yield a round trip
                // costs.
                if let Some(done) = ep.backend.execute_now(verbs) {
                    leave_unposted(&mut this.state, RunState::Executed(Some(done), len));
                    // Its own task, polled again by the executor without a
                    // wake-up's locked operations (W1, `exec::wake_self`).
                    crate::exec::wake_self(cx.waker());
                    return Poll::Pending;
                }
                let op = ep.backend.execute(verbs);
                *this.state = RunState::Posted(op);
            }
        }
        match &mut *this.state {
            RunState::Posted(op) => match Pin::new(op).poll(cx) {
                // A backend's own buffers: any capacity.
                Poll::Ready(r) => Poll::Ready(r.map(|results| BatchResult {
                    len: results.len() | OVERSIZED,
                    results: Some(crate::buffers::pooled(results)),
                })),
                Poll::Pending => Poll::Pending,
            },
            RunState::Executed(..) => unreachable!("handed out by `poll`"),
            RunState::Unposted(..) => unreachable!("posted above"),
        }
    }
}

/// The length a batch's [`BatchResult`] records: its verb count, with the
/// [`OVERSIZED`] bit if its list may hold a read buffer larger than the
/// thread's pool keeps (B1). A read buffer filled in place has the capacity
/// of the read (`RegionMem::read_into` reserves exactly) or what it had in
/// the pool (at most `MAX_SPARE_BYTES`): only a batch that reads more than
/// that in all can leave a larger one in its list (a conservative bound:
/// the sum of its reads).
#[inline(always)]
fn results_len(verbs: &Verbs, cost: &BatchCost) -> usize {
    let oversized = cost.bytes_read > crate::buffers::MAX_SPARE_BYTES as u64;
    verbs.len() | if oversized { OVERSIZED } else { 0 }
}

/// Replaces a batch's `Unposted` state after its verbs executed at once
/// ([`EndpointBackend::execute_now`] empties them) by `executed`: without
/// the old state's drop glue when it owns nothing (inline verbs, empty;
/// the cost is plain integers), with it otherwise.
#[inline(always)]
#[allow(unsafe_code)]
fn leave_unposted<'a>(state: &mut RunState<'a>, executed: RunState<'a>) {
    if matches!(state, RunState::Unposted(verbs, _) if !verbs.spilled() && verbs.is_empty()) {
        // SAFETY: the state is `Unposted` with inline verbs (not spilled to
        // the heap) that are empty and a `BatchCost` (plain integers):
        // dropping it would free and run nothing, so overwriting it without
        // the drop glue's call leaks nothing. `state` is a valid, aligned,
        // exclusively borrowed place.
        unsafe { std::ptr::write(state, executed) };
    } else {
        *state = executed;
    }
}

/// The future of a one-verb helper ([`Endpoint::read`], [`Endpoint::cas`],
/// ...): its batch's future and what to take out of the result.
#[must_use = "the verb is posted only when its future is polled"]
pub struct OneVerb<'a, T> {
    run: BatchRun<'a>,
    out: fn(BatchResult) -> T,
}

impl<T> Future for OneVerb<'_, T> {
    type Output = Result<T>;
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Result<T>> {
        // `BatchRun` is `Unpin`, and so is this.
        let this = self.get_mut();
        match Pin::new(&mut this.run).poll(cx) {
            Poll::Ready(r) => Poll::Ready(r.map(this.out)),
            Poll::Pending => Poll::Pending,
        }
    }
}

/// Results of a batch, by the index each verb got when it was added. The
/// list is boxed ([`PooledResults`]: a batch future hands out a pointer, not
/// the inline list) and goes back to the thread's pool ([`crate::buffers`])
/// when this drops, with the read buffers not taken out still in it for
/// later batches' reads to fill.
#[derive(Debug)]
pub struct BatchResult {
    /// `None` for an empty batch.
    results: Option<PooledResults>,
    /// The batch's results are the list's first `len` entries; entries
    /// beyond them are spare read buffers the list keeps for later batches
    /// ([`EndpointBackend::execute_now`]), never results.
    ///
    /// Its top bit ([`OVERSIZED`]) tells whether an entry may hold a read
    /// buffer larger than the thread's pool keeps (B1, [`crate::buffers`]):
    /// clear for a batch executed in place whose reads total at most
    /// `MAX_SPARE_BYTES` (every buffer then has at most that capacity), set
    /// for a backend's results. The list is given back without looking at
    /// its entries when clear. (A bit of `len`, not a field of its own: a
    /// larger `BatchResult` made the engines' futures move it with `memcpy`
    /// calls, +116 instructions per RACE GET.)
    len: usize,
}

/// [`BatchResult`]'s flag bit in `len`: a batch has far fewer verbs.
const OVERSIZED: usize = 1 << (usize::BITS - 1);

impl Drop for BatchResult {
    #[inline]
    fn drop(&mut self) {
        if let Some(r) = self.results.take() {
            crate::buffers::give_results(r, self.len & OVERSIZED != 0);
        }
    }
}

impl BatchResult {
    #[inline]
    fn results(&self) -> &[VerbResult] {
        self.results
            .as_deref()
            .map_or(&[], |r| &r[..self.len & !OVERSIZED])
    }
    /// The bytes of read `i` (taken out; a second take panics).
    #[inline]
    pub fn take_read(&mut self, i: usize) -> Vec<u8> {
        let slot = match self.results.as_deref_mut() {
            Some(r) => &mut r[..self.len & !OVERSIZED][i],
            None => panic!("verb {i} of an empty batch"),
        };
        match std::mem::replace(slot, VerbResult::Write) {
            VerbResult::Read(b) => b,
            other => panic!("verb {i} is not an unread read: {other:?}"),
        }
    }
    /// The bytes of read `i`, borrowed (the buffer stays in the result and
    /// is reused once the result drops).
    #[inline]
    pub fn read(&self, i: usize) -> &[u8] {
        match &self.results()[i] {
            VerbResult::Read(b) => b,
            other => panic!("verb {i} is not an unread read: {other:?}"),
        }
    }
    /// The word a CAS found or an FAA returned.
    #[inline]
    pub fn word(&self, i: usize) -> u64 {
        match self.results()[i] {
            VerbResult::Cas(v) | VerbResult::Faa(v) => v,
            ref other => panic!("verb {i} is not an atomic: {other:?}"),
        }
    }
    pub fn len(&self) -> usize {
        self.results().len()
    }
    pub fn is_empty(&self) -> bool {
        self.results().is_empty()
    }
}

/// The bytes of one read ([`Endpoint::read_buf`]): its batch's result,
/// whose list (with the buffer in it) goes back to the thread's pool
/// ([`crate::buffers`]) when dropped.
#[derive(Debug)]
pub struct ReadBuf {
    r: BatchResult,
}

impl ReadBuf {
    /// The bytes as an owned vector (not reused).
    pub fn into_vec(mut self) -> Vec<u8> {
        self.r.take_read(0)
    }
}

impl std::ops::Deref for ReadBuf {
    type Target = [u8];
    #[inline]
    fn deref(&self) -> &[u8] {
        self.r.read(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every engine operation's future holds a `BatchRun` (or a `OneVerb`)
    /// at each round trip: it holds the verbs or the backend's operation,
    /// never both.
    #[test]
    fn a_batch_future_holds_its_verbs_or_its_operation_not_both() {
        use std::mem::size_of;
        // The verbs travel with their cost (`BatchCost`, 24 bytes).
        let larger = (size_of::<Verbs>() + size_of::<BatchCost>())
            .max(size_of::<OpFuture<'static, Result<VerbResults>>>());
        // Plus the endpoint, the state's tag and the `deferred` flag.
        assert!(size_of::<BatchRun<'static>>() <= larger + 24);
        assert!(size_of::<OneVerb<'static, Vec<u8>>>() <= larger + 32);
    }

    /// A backend that completes every verb at once with a default result.
    struct Nop;
    impl EndpointBackend for Nop {
        fn local_node(&self) -> NodeId {
            NodeId(0)
        }
        fn execute(&self, verbs: &mut Verbs) -> OpFuture<'_, Result<VerbResults>> {
            let out = verbs
                .drain(..)
                .map(|v| match v {
                    Verb::Read { len, .. } => VerbResult::Read(vec![0; len]),
                    Verb::Write { .. } => VerbResult::Write,
                    Verb::Cas { expected, .. } => VerbResult::Cas(expected),
                    Verb::Faa { .. } => VerbResult::Faa(0),
                })
                .collect();
            OpFuture::ready(Ok(out))
        }
        fn call(
            &self,
            _: NodeId,
            _: ServiceId,
            _: Vec<u8>,
        ) -> OpFuture<'_, Result<crate::service::Reply>> {
            unreachable!("no RPCs here")
        }
    }

    /// Counting a batch's verbs as they are added charges exactly what
    /// walking the posted batch charged (`batch_counters`), to the kind
    /// polling it, and bumps `charges` once per batch (never for an empty
    /// one).
    #[test]
    fn a_batch_is_charged_what_its_verbs_cost_counted_as_added() {
        use crate::counters::{OpKind, labeled};
        use crate::exec::block_on;
        let ep = Endpoint::new(Box::new(Nop));
        let r = crate::addr::RemoteRegion {
            node: NodeId(0),
            id: crate::addr::RegionId(0),
            key: crate::addr::AccessKey(7),
            len: 4096,
        };
        let mut b = ep.batch();
        b.read(r.at(0), 40);
        b.write(r.at(64), vec![1; 24]);
        b.cas(r.at(128), 1, 2);
        b.faa(r.at(136), 3);
        b.read(r.at(256), 1000);
        let expected = batch_counters(&b.verbs);
        assert_eq!(b.cost.counters(), expected);
        assert_eq!(expected.verbs, 5);
        assert_eq!(expected.bytes_read, 40 + 8 + 8 + 1000);
        assert_eq!(expected.bytes_written, 24 + 16 + 8);
        let mut metered = Counters::default();
        ep.metering(&mut metered, || {
            block_on(labeled(OpKind::Scan, b.run())).unwrap();
        });
        assert_eq!(metered, expected, "the meter gets the batch's charge");
        assert_eq!(*ep.counters().get(OpKind::Scan), expected);
        assert_eq!(ep.total_counters(), expected);
        // The one-verb helpers count the same way.
        block_on(labeled(OpKind::Get, ep.cas(r.at(8), 0, 1))).unwrap();
        let mut one = Verbs::new();
        one.push(Verb::Cas {
            addr: r.at(8),
            expected: 0,
            new: 1,
        });
        assert_eq!(*ep.counters().get(OpKind::Get), batch_counters(&one));
        // An empty batch charges nothing.
        let mut none = Counters::default();
        ep.metering(&mut none, || block_on(ep.batch().run()).unwrap());
        assert_eq!(none, Counters::default());
        assert_eq!(ep.total_counters(), expected + batch_counters(&one));
        ep.reset_counters();
        assert_eq!(ep.total_counters(), Counters::default());
    }

    /// A batch built in its future (`Endpoint::batch_run`, awaited by
    /// reference) is charged and answered as the same verbs added to a
    /// `Batch` and run; an empty one charges nothing and is empty; a verb
    /// added after posting is refused.
    #[test]
    fn a_batch_built_in_its_future_runs_as_a_batch() {
        use crate::counters::{OpKind, labeled};
        use crate::exec::block_on;
        let ep = Endpoint::new(Box::new(Nop));
        let r = crate::addr::RemoteRegion {
            node: NodeId(0),
            id: crate::addr::RegionId(0),
            key: crate::addr::AccessKey(7),
            len: 4096,
        };
        let mut b = ep.batch();
        b.read(r.at(0), 40);
        b.write(r.at(64), vec![1; 24]);
        b.cas(r.at(128), 5, 2);
        let expected = batch_counters(&b.verbs);
        let mut run = ep.batch_run();
        assert!(run.is_unposted_empty());
        assert_eq!(run.read(r.at(0), 40), 0);
        assert_eq!(run.write(r.at(64), vec![1; 24]), 1);
        assert_eq!(run.cas(r.at(128), 5, 2), 2);
        assert!(!run.is_unposted_empty());
        let res = block_on(labeled(OpKind::Update, &mut run)).unwrap();
        assert_eq!(res.len(), 3);
        assert_eq!(res.read(0), &[0u8; 40][..]);
        assert_eq!(res.word(2), 5);
        assert_eq!(*ep.counters().get(OpKind::Update), expected);
        let added = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            run.read(r.at(0), 8);
        }));
        assert!(added.is_err(), "a posted batch takes no more verbs");
        drop(res);
        let mut none = Counters::default();
        ep.metering(&mut none, || {
            let mut empty = ep.batch_run();
            assert!(block_on(&mut empty).unwrap().is_empty());
        });
        assert_eq!(none, Counters::default());
        assert_eq!(ep.total_counters(), expected);
    }

    /// A meter gets exactly the charges made while its `metering` call
    /// runs; a nested meter gets its own, and the outer one is credited
    /// with them too; charges outside any call reach no meter; the previous
    /// meter is back after a call, also after a panic inside it.
    #[test]
    fn meters_get_their_charges_in_place_and_nest() {
        use crate::counters::{OpKind, labeled};
        use crate::exec::block_on;
        let ep = Endpoint::new(Box::new(Nop));
        let r = crate::addr::RemoteRegion {
            node: NodeId(0),
            id: crate::addr::RegionId(0),
            key: crate::addr::AccessKey(7),
            len: 4096,
        };
        let read = |len| {
            let mut v = Verbs::new();
            v.push(Verb::Read { addr: r.at(0), len });
            batch_counters(&v)
        };
        let (mut outer, mut inner) = (Counters::default(), Counters::default());
        block_on(ep.read(r.at(0), 100)).unwrap(); // before: no meter
        ep.metering(&mut outer, || {
            block_on(labeled(OpKind::Get, ep.read(r.at(0), 16))).unwrap();
            ep.metering(&mut inner, || {
                block_on(labeled(OpKind::Update, ep.read(r.at(0), 24))).unwrap();
            });
            block_on(ep.read(r.at(0), 32)).unwrap();
        });
        block_on(ep.read(r.at(0), 200)).unwrap(); // after: no meter
        assert_eq!(inner, read(24));
        assert_eq!(outer, read(16) + read(24) + read(32));
        // A second stretch adds to what the accumulator holds.
        ep.metering(&mut inner, || block_on(ep.read(r.at(0), 8)).unwrap());
        assert_eq!(inner, read(24) + read(8));
        // Unwinding out of a meter puts the previous one back.
        let mut lost = Counters::default();
        ep.metering(&mut outer, || {
            let caught = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                ep.metering(&mut lost, || panic!("inside the inner meter"))
            }));
            assert!(caught.is_err());
            block_on(ep.read(r.at(0), 40)).unwrap();
        });
        assert_eq!(lost, Counters::default());
        assert_eq!(outer, read(16) + read(24) + read(32) + read(40));
        assert_eq!(
            ep.total_counters(),
            [100, 16, 24, 32, 200, 8, 40]
                .into_iter()
                .fold(Counters::default(), |a, l| a + read(l))
        );
    }

    /// A backend whose every RPC is a boxed operation holding a guard that
    /// counts its drops, and answers `answer` (or never, with `None`).
    struct Guarded {
        drops: std::rc::Rc<std::cell::Cell<u32>>,
        answer: Option<Vec<u8>>,
    }
    struct Guard(std::rc::Rc<std::cell::Cell<u32>>);
    impl Drop for Guard {
        fn drop(&mut self) {
            self.0.set(self.0.get() + 1);
        }
    }
    impl EndpointBackend for Guarded {
        fn local_node(&self) -> NodeId {
            NodeId(0)
        }
        fn execute(&self, _: &mut Verbs) -> OpFuture<'_, Result<VerbResults>> {
            unreachable!("no verbs here")
        }
        fn call(
            &self,
            _: NodeId,
            _: ServiceId,
            _: Vec<u8>,
        ) -> OpFuture<'_, Result<crate::service::Reply>> {
            let guard = Guard(self.drops.clone());
            let answer = self.answer.clone();
            OpFuture::boxed(async move {
                let _guard = guard;
                match answer {
                    Some(bytes) => Ok(crate::service::Reply {
                        result: Ok(bytes),
                        server_cpu_ns: 0,
                    }),
                    None => std::future::pending().await,
                }
            })
        }
    }

    /// `RpcCall` drops its state itself (branch i83: `ManuallyDrop`, so a
    /// finished call's drop is one check): a call given up while waiting
    /// drops the backend's operation once, a finished call dropped its
    /// operation when it finished (and not again), an unpolled call sends
    /// nothing. Fails with the state never dropped (the guard's count stays
    /// 0 for the call given up) or dropped twice.
    #[test]
    fn an_rpc_call_drops_its_operation_once_whether_finished_or_given_up() {
        use std::task::{Context, Poll, Waker};
        let drops = std::rc::Rc::new(std::cell::Cell::new(0));
        let waiting = Endpoint::new(Box::new(Guarded {
            drops: drops.clone(),
            answer: None,
        }));
        let mut cx = Context::from_waker(Waker::noop());
        let mut call = waiting.call(NodeId(1), ServiceId(3), vec![1, 2, 3]);
        assert!(Pin::new(&mut call).poll(&mut cx).is_pending());
        assert_eq!(drops.get(), 0);
        drop(call);
        assert_eq!(drops.get(), 1, "given up: dropped once");
        drop(waiting.call(NodeId(1), ServiceId(3), vec![4]));
        assert_eq!(drops.get(), 1, "never sent: no operation");
        let answering = Endpoint::new(Box::new(Guarded {
            drops: drops.clone(),
            answer: Some(vec![9, 9]),
        }));
        let mut call = answering.call(NodeId(1), ServiceId(3), vec![5]);
        match Pin::new(&mut call).poll(&mut cx) {
            Poll::Ready(Ok(bytes)) => assert_eq!(bytes, vec![9, 9]),
            _ => panic!("answered at once"),
        }
        assert_eq!(drops.get(), 2, "finished: dropped when it finished");
        drop(call);
        assert_eq!(drops.get(), 2, "and not again");
    }

    /// The counters of a call given up (`--op-limit`'s stop drops an
    /// operation unfinished, which "keeps what it was charged so far"):
    /// a call sent and then dropped while waiting keeps its send's charge
    /// (one round trip, one RPC, its request's bytes) in the kind and the
    /// meter current when it was sent, and its drop (under another kind,
    /// outside any meter) charges nothing; a finished call is charged its
    /// send and its reply's bytes; an unpolled call charges nothing. A
    /// one-charge-per-RPC change (charging the send with the reply) must
    /// keep this: it passes on the two-charge code (78936c5) and fails if
    /// the send's charge is moved to the reply without a charge on drop
    /// (the given-up call's round trip and RPC go missing).
    #[test]
    fn a_call_given_up_keeps_its_send_charge_in_its_kind_and_meter() {
        use crate::counters::{OpKind, labeled};
        use std::task::{Context, Poll, Waker};
        let drops = std::rc::Rc::new(std::cell::Cell::new(0));
        let waiting = Endpoint::new(Box::new(Guarded {
            drops: drops.clone(),
            answer: None,
        }));
        let sent = |bytes| Counters {
            round_trips: 1,
            rpcs: 1,
            bytes_written: bytes,
            ..Counters::default()
        };
        let mut cx = Context::from_waker(Waker::noop());
        let mut meter = Counters::default();
        let mut call = waiting.call(NodeId(1), ServiceId(3), vec![1, 2, 3]);
        waiting.metering(&mut meter, || {
            let mut polled = labeled(OpKind::Update, &mut call);
            assert!(Pin::new(&mut polled).poll(&mut cx).is_pending());
        });
        // Dropped under another kind, with no meter running.
        let other = std::pin::pin!(labeled(OpKind::Get, async { drop(call) }));
        assert!(other.poll(&mut cx).is_ready());
        assert_eq!(drops.get(), 1);
        assert_eq!(meter, sent(3), "the meter keeps the send's charge");
        let table = waiting.counters();
        assert_eq!(*table.get(OpKind::Update), sent(3));
        assert_eq!(*table.get(OpKind::Get), Counters::default());
        assert_eq!(waiting.total_counters(), sent(3));
        // Never polled: nothing charged.
        drop(waiting.call(NodeId(1), ServiceId(3), vec![4]));
        assert_eq!(waiting.total_counters(), sent(3));

        let answering = Endpoint::new(Box::new(Guarded {
            drops,
            answer: Some(vec![9, 9]),
        }));
        let mut meter = Counters::default();
        let mut call = answering.call(NodeId(1), ServiceId(3), vec![5]);
        answering.metering(&mut meter, || {
            let mut polled = labeled(OpKind::Insert, &mut call);
            match Pin::new(&mut polled).poll(&mut cx) {
                Poll::Ready(Ok(bytes)) => assert_eq!(bytes, vec![9, 9]),
                _ => panic!("answered at once"),
            }
        });
        drop(call);
        let finished = Counters {
            bytes_read: 2,
            ..sent(1)
        };
        assert_eq!(meter, finished);
        assert_eq!(*answering.counters().get(OpKind::Insert), finished);
        assert_eq!(answering.total_counters(), finished);
    }
}
