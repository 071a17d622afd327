//! Services: the handlers a node runs for RPCs, and the name directory.
//!
//! A node's [`ServiceTable`] maps service ids to handlers. Engines register
//! services and publish regions under names (namespaced by engine instance);
//! clients resolve names through the directory, service 0, which every node
//! serves. The table also measures the CPU time of every handler run, which
//! travels back in the reply and is charged to the caller's counters.

use crate::addr::{AccessKey, NodeId, RegionId, RemoteRegion, ServiceId};
use crate::cputime::{CpuStopwatch, thread_clock_overhead_ns, thread_cpu_ns};
use crate::error::{ErrorCode, ServiceError};
use crate::wire::{WireReader, WireWriter};
use parking_lot::RwLock;
use std::collections::HashMap;
use std::panic::AssertUnwindSafe;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};

/// Who is calling, and where.
#[derive(Debug, Clone, Copy)]
pub struct RpcContext {
    pub caller: NodeId,
    pub node: NodeId,
}

/// An RPC handler. It runs on one of the node's handler threads and must not
/// block for long: on a weak memory node every handler thread is precious.
pub trait Service: Send + Sync {
    fn handle(&self, ctx: &RpcContext, request: &[u8]) -> Result<Vec<u8>, ServiceError>;

    /// [`Service::handle`] writing the reply into `out`, which is empty on
    /// entry (R1 below): a `local` handler thread passes the same buffer for
    /// every request it serves, so a handler that appends its reply there
    /// allocates nothing per request. What `out` holds when this returns
    /// `Ok` is the reply; after an `Err` it is ignored.
    ///
    /// The default calls [`Service::handle`]; a reply that fits the room
    /// `out` has (a `local` handler thread's buffer, R4) is copied into
    /// it, so the thread keeps its buffer; a longer one (or any, into
    /// `sim`'s and UCX's empty buffers) is taken as the buffer, not
    /// copied. Before (branch i91), the `Vec` was always taken, and a
    /// short one left the thread a buffer too small for `local`'s
    /// fixed-size reply copies.
    fn handle_into(
        &self,
        ctx: &RpcContext,
        request: &[u8],
        out: &mut Vec<u8>,
    ) -> Result<(), ServiceError> {
        reply_into(out, self.handle(ctx, request)?);
        Ok(())
    }
}

/// Makes `reply` the reply in `out` (R4, branch i91), replacing what it
/// held (nothing, under R1): copied into it if it fits the room `out` has
/// (a `local` handler thread's buffer keeps its allocation), else taken as
/// the buffer (no copy: a long reply, or any reply into `sim`'s and UCX's
/// empty buffers).
#[inline]
fn reply_into(out: &mut Vec<u8>, reply: Vec<u8>) {
    out.clear();
    if reply.len() <= out.capacity() {
        out.extend_from_slice(&reply);
    } else {
        *out = reply;
    }
}

impl<F> Service for F
where
    F: Fn(&RpcContext, &[u8]) -> Result<Vec<u8>, ServiceError> + Send + Sync,
{
    fn handle(&self, ctx: &RpcContext, request: &[u8]) -> Result<Vec<u8>, ServiceError> {
        self(ctx, request)
    }
}

/// An RPC handler that may answer later, from any thread: it receives a
/// [`Responder`] and calls [`Responder::reply`] when it has the answer (for
/// example a directory that queues a request until a page is free).
pub trait DeferredService: Send + Sync {
    fn handle(&self, ctx: &RpcContext, request: &[u8], responder: Responder);

    /// [`DeferredService::handle`] that may answer at once, into `out`
    /// (empty on entry, as for [`Service::handle_into`]): it returns
    /// [`Answered::Now`] with the reply in `out` (or an error), and no
    /// responder, shared state or boxed sink is made for the request
    /// (invariant D1 below). A request that must wait takes its
    /// [`Responder`] from `later` (at most once: [`Later::responder`] takes
    /// it by value), answers through it, and returns [`Answered::Later`];
    /// `out` is then ignored (a reply kept for later is moved out of it).
    ///
    /// D1: every request gets exactly one answer. With no responder taken,
    /// the answer is what this returns: `Now`'s result, or an error for
    /// `Later` (nothing can answer it: "dropped without replying") or a
    /// panic. With a responder taken, the answer is the responder's
    /// (its reply, or its drop's error), and what this returns is not sent.
    ///
    /// The charge is a deferred request's either way: the CPU time of this
    /// call (an answer given at once is sent after it, as the responder's
    /// was), so the same request is charged the same on either path.
    ///
    /// The default takes the responder and calls [`DeferredService::handle`].
    fn handle_into(
        &self,
        ctx: &RpcContext,
        request: &[u8],
        out: &mut Vec<u8>,
        later: Later<'_>,
    ) -> Answered {
        let _ = out;
        self.handle(ctx, request, later.responder());
        Answered::Later
    }
}

/// How [`DeferredService::handle_into`] answered.
#[derive(Debug)]
pub enum Answered {
    /// At once: `Ok` with the reply in `out`, or the error.
    Now(Result<(), ServiceError>),
    /// Through the [`Responder`] taken from [`Later`].
    Later,
}

/// The means to answer a request later: [`Later::responder`] makes the
/// request's [`Responder`] (its shared state and boxed sink), only when a
/// [`DeferredService::handle_into`] asks for it.
pub struct Later<'a> {
    make: &'a mut dyn FnMut() -> Responder,
}

impl Later<'_> {
    /// The request's responder (one per request: this takes `self`).
    pub fn responder(self) -> Responder {
        (self.make)()
    }
}

impl<F> DeferredService for F
where
    F: Fn(&RpcContext, &[u8], Responder) + Send + Sync,
{
    fn handle(&self, ctx: &RpcContext, request: &[u8], responder: Responder) {
        self(ctx, request, responder)
    }
}

/// A deferred request's sink: [`ReplySink::into_deferred`]'s box, called
/// with the reply's charge and the answer lent to it.
type SendReply = Box<dyn FnOnce(u64, LentReply<'_>) + Send>;

/// A reply lent to its sender: the payload in the handler thread's buffer
/// (R2 in docs/transport.md, "Reply buffers") or an error.
pub type LentReply<'a> = Result<&'a mut Vec<u8>, ServiceError>;

/// Where a reply goes, with its charge (ns): the `local` backend's reply
/// slot (`local_rpc::ReplyTo`, which borrows its lane for the request, so
/// no reference count per RPC), or any `FnOnce` closure (`sim`, UCX,
/// tests).
pub trait ReplySink: Send {
    /// Sends the reply; copies what it keeps before returning (R3).
    fn send(self, server_cpu_ns: u64, result: LentReply<'_>);
    /// The sink, boxed, for a deferred handler's later answer (it outlives
    /// the request; the `local` slot takes its own reference to the lane).
    fn into_deferred(self) -> Box<dyn FnOnce(u64, LentReply<'_>) + Send>;
}

impl<F> ReplySink for F
where
    F: FnOnce(u64, LentReply<'_>) + Send + 'static,
{
    fn send(self, server_cpu_ns: u64, result: LentReply<'_>) {
        self(server_cpu_ns, result)
    }
    fn into_deferred(self) -> Box<dyn FnOnce(u64, LentReply<'_>) + Send> {
        Box::new(self)
    }
}

/// Shared between a deferred request's handler run and its responder: the
/// reply goes out once both the answer and the handler's CPU time are known.
#[derive(Default)]
struct Pending {
    /// CPU time of the `handle` call, once it returned.
    handler_cpu_ns: Option<u64>,
    answer: Option<Result<Vec<u8>, ServiceError>>,
    /// The responder was dropped without a reply.
    abandoned: bool,
    send: Option<SendReply>,
}

impl Pending {
    fn try_send(&mut self) {
        let (Some(server_cpu_ns), true) = (self.handler_cpu_ns, self.answer.is_some()) else {
            return;
        };
        if let Some(send) = self.send.take() {
            // A late answer arrives as an owned `Vec`; it is lent to
            // `send` like a buffer (R3: nothing outlives the call).
            match self.answer.take().expect("checked above") {
                Ok(mut v) => send(server_cpu_ns, Ok(&mut v)),
                Err(e) => send(server_cpu_ns, Err(e)),
            }
        }
    }
}

/// The right to answer one deferred request. The reply carries the CPU time
/// of the handler's `handle` call (work done later for it on other threads is
/// accounted where it runs). Dropping a responder without replying answers
/// with an error, so no caller waits for a reply that cannot come.
pub struct Responder {
    pending: Arc<parking_lot::Mutex<Pending>>,
    replied: bool,
}

impl Responder {
    /// Answers the request.
    pub fn reply(mut self, result: Result<Vec<u8>, ServiceError>) {
        self.replied = true;
        let mut p = self.pending.lock();
        p.answer = Some(result);
        p.try_send();
    }
}

impl Drop for Responder {
    fn drop(&mut self) {
        if !self.replied {
            let mut p = self.pending.lock();
            p.answer = Some(Err(ServiceError::failed(
                "the service dropped the request without replying",
            )));
            p.abandoned = true;
            p.try_send();
        }
    }
}

/// What comes back from an RPC.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    pub result: Result<Vec<u8>, ServiceError>,
    /// CPU time the handler thread spent serving the request.
    pub server_cpu_ns: u64,
}

impl Reply {
    /// Encodes the reply for backends that send it as bytes:
    /// `status u8 (0 = ok, else ErrorCode) | cpu_ns u64 | payload or message`.
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::new();
        match &self.result {
            Ok(p) => {
                w.u8(0).u64(self.server_cpu_ns).raw(p);
            }
            Err(e) => {
                w.u8(e.code as u8)
                    .u64(self.server_cpu_ns)
                    .raw(e.message.as_bytes());
            }
        }
        w.finish()
    }

    pub fn decode(buf: &[u8]) -> Result<Reply, crate::wire::WireError> {
        let mut r = WireReader::new(buf);
        let status = r.u8()?;
        let server_cpu_ns = r.u64()?;
        let rest = r.raw(r.remaining())?.to_vec();
        let result = if status == 0 {
            Ok(rest)
        } else {
            let code = ErrorCode::from_u8(status)
                .ok_or_else(|| crate::wire::WireError(format!("unknown reply status {status}")))?;
            Err(ServiceError::new(
                code,
                String::from_utf8_lossy(&rest).into_owned(),
            ))
        };
        Ok(Reply {
            result,
            server_cpu_ns,
        })
    }
}

/// Directory requests (service 0): `op u8 | name str`.
pub(crate) mod directory {
    pub const RESOLVE_SERVICE: u8 = 1;
    pub const RESOLVE_REGION: u8 = 2;
}

#[derive(Clone)]
enum Handler {
    Now(Arc<dyn Service>),
    Deferred(Arc<dyn DeferredService>),
}

/// What a request's service id names.
enum Lookup<'a> {
    Directory,
    Found(&'a Handler),
    Missing,
}

/// [`HandlerCache::generation`] of a cache that holds nothing.
const NO_GENERATION: u64 = u64::MAX;

/// A serving thread's own copy of its node's handler table, so that a
/// request finds its handler with one atomic load and an index
/// ([`ServiceTable::dispatch_cached`]) instead of the table's lock and a
/// reference count changing hands per RPC.
///
/// Invariants (docs/transport.md, "Handler lookup"):
/// - G1: the table's generation is bumped, under the table's write lock,
///   by every change of its handlers (register, unregister, clear), and a
///   copy records the generation it was taken at under the read lock; so a
///   copy whose generation equals the table's holds exactly the table's
///   handlers.
/// - G2: every dispatch through a cache first compares the generations
///   (acquire) and refreshes on a difference: a request sent after
///   `unregister` returned finds no handler (the unknown-service error),
///   and one sent after `register` returned finds it.
/// - G3: a copy keeps handlers alive only while its thread serves or polls:
///   the `local` handler loop refreshes it at its first poll after a
///   change (also when idle) and releases it ([`HandlerCache::release`])
///   before it blocks; so an unregistered handler, and what it owns, is
///   dropped once every handler thread has finished the request it was
///   serving and polled once (tests in `local`:
///   `an_unregistered_handler_is_dropped_by_idle_handler_threads`).
pub struct HandlerCache {
    generation: u64,
    handlers: Vec<Option<Handler>>,
    /// This thread's served counters in the table it serves (N1), and that
    /// table's [`ServiceTable`] identity; registered at the first dispatch.
    served: Option<(Arc<ServedCell>, u64)>,
}

/// One serving thread's RPCs served and handler CPU charged in one
/// [`ServiceTable`] (N1, docs/transport.md, "Self-wakes, the fast result slot, served counters"): written only
/// by the thread whose [`HandlerCache`] holds it, with a plain load and
/// store (no locked read-modify-write, no line shared with the node's
/// other handler threads: one cache line each), and summed by
/// [`ServiceTable::served`] with the table's shared counters.
#[derive(Default)]
#[repr(align(64))]
struct ServedCell {
    served: AtomicU64,
    cpu_ns: AtomicU64,
}

impl ServedCell {
    /// Counts one RPC charged `cpu_ns` (the single writer's add).
    #[inline]
    fn add(&self, cpu_ns: u64) {
        self.served
            .store(self.served.load(Ordering::Relaxed) + 1, Ordering::Relaxed);
        self.cpu_ns.store(
            self.cpu_ns.load(Ordering::Relaxed) + cpu_ns,
            Ordering::Relaxed,
        );
    }
}

/// [`ServiceTable`]'s identity for the cells of [`HandlerCache`]s (an
/// address could be reused by a later table).
struct TableUid(u64);

impl Default for TableUid {
    fn default() -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        TableUid(NEXT.fetch_add(1, Ordering::Relaxed))
    }
}

impl Default for HandlerCache {
    fn default() -> Self {
        Self::new()
    }
}

impl HandlerCache {
    /// An empty cache (filled at its first use).
    pub fn new() -> Self {
        HandlerCache {
            generation: NO_GENERATION,
            handlers: Vec::new(),
            served: None,
        }
    }

    /// Drops every handler the copy holds (its thread is about to block).
    pub fn release(&mut self) {
        self.generation = NO_GENERATION;
        self.handlers = Vec::new();
    }

    /// Whether the copy is that of `table`'s current generation (false for
    /// an empty copy).
    #[inline]
    pub fn is_current(&self, table: &ServiceTable) -> bool {
        self.generation == table.generation.load(Ordering::Acquire)
    }
}

/// The services and published regions of one node.
#[derive(Default)]
pub struct ServiceTable {
    /// Indexed by service id (ids are handed out densely from 1), so a
    /// request finds its handler without hashing.
    handlers: RwLock<Vec<Option<Handler>>>,
    /// Bumped under `handlers`' write lock by every change of it
    /// ([`HandlerCache`], G1).
    generation: AtomicU64,
    names: RwLock<HashMap<String, ServiceId>>,
    regions: RwLock<HashMap<String, RemoteRegion>>,
    next_id: AtomicU32,
    /// RPCs served and their charge where no serving thread's cell counts
    /// them (`dispatch`: `sim`, UCX); the cells hold the rest (N1).
    served: AtomicU64,
    handler_cpu_ns: AtomicU64,
    /// The cells of the [`HandlerCache`]s that dispatched here (one per
    /// serving thread; kept after the thread ends, so no count is lost).
    cells: parking_lot::Mutex<Vec<Arc<ServedCell>>>,
    uid: TableUid,
    /// Immediate replies sent so far.
    replies: AtomicU64,
    /// Sampled reply sends (one in [`SEND_SAMPLE`]) and the thread CPU time
    /// they took (waking the caller, or posting the reply message).
    replies_sent: AtomicU64,
    reply_send_ns: AtomicU64,
}

/// One reply in this many has its send timed in thread CPU time.
const SEND_SAMPLE: u64 = 64;

impl ServiceTable {
    pub fn new() -> Self {
        // Calibrate the clocks now rather than inside the first RPC.
        let _ = CpuStopwatch::start().elapsed_ns();
        let _ = thread_clock_overhead_ns();
        Self {
            next_id: AtomicU32::new(1),
            ..Default::default()
        }
    }

    /// Registers `handler` under `name`; the name must be new on this node.
    pub fn register(
        &self,
        name: &str,
        handler: Arc<dyn Service>,
    ) -> Result<ServiceId, ServiceError> {
        self.insert(name, Handler::Now(handler))
    }

    /// Registers a handler that answers through a [`Responder`], possibly
    /// later and from another thread.
    pub fn register_deferred(
        &self,
        name: &str,
        handler: Arc<dyn DeferredService>,
    ) -> Result<ServiceId, ServiceError> {
        self.insert(name, Handler::Deferred(handler))
    }

    fn insert(&self, name: &str, handler: Handler) -> Result<ServiceId, ServiceError> {
        let mut names = self.names.write();
        if names.contains_key(name) {
            return Err(ServiceError::failed(format!(
                "service {name:?} is already registered"
            )));
        }
        let id = ServiceId(self.next_id.fetch_add(1, Ordering::Relaxed));
        let mut handlers = self.handlers.write();
        let i = id.0 as usize;
        if handlers.len() <= i {
            handlers.resize_with(i + 1, || None);
        }
        handlers[i] = Some(handler);
        self.generation.fetch_add(1, Ordering::Release);
        names.insert(name.to_string(), id);
        Ok(id)
    }

    /// Removes the service registered under `name`, if any. A request sent
    /// after this returns gets the unknown-service error; the handler is
    /// dropped here unless a `local` handler thread holds it in its
    /// [`HandlerCache`], which drops it at its next poll (G3).
    pub fn unregister(&self, name: &str) {
        let Some(id) = self.names.write().remove(name) else {
            return;
        };
        let old = {
            let mut handlers = self.handlers.write();
            let old = handlers.get_mut(id.0 as usize).and_then(Option::take);
            self.generation.fetch_add(1, Ordering::Release);
            old
        };
        // Dropped outside the lock: a handler's state may unregister more.
        drop(old);
    }

    /// Drops every handler and published name (the node is going away).
    pub fn clear(&self) {
        let old = {
            let mut handlers = self.handlers.write();
            self.generation.fetch_add(1, Ordering::Release);
            std::mem::take(&mut *handlers)
        };
        drop(old);
        self.names.write().clear();
        self.regions.write().clear();
    }

    /// Brings `cache` up to the table's generation if it is behind (G1).
    /// The handlers it held are dropped outside the table's lock.
    ///
    /// A serving loop calls this on every pass: the check is inlined there
    /// (one load and a compare), the copy is out of line.
    #[inline]
    pub fn refresh(&self, cache: &mut HandlerCache) {
        if !cache.is_current(self) {
            self.refresh_slow(cache);
        }
    }

    #[cold]
    #[inline(never)]
    fn refresh_slow(&self, cache: &mut HandlerCache) {
        let fresh = {
            let handlers = self.handlers.read();
            // Under the read lock the generation cannot move (G1).
            cache.generation = self.generation.load(Ordering::Acquire);
            handlers.clone()
        };
        drop(std::mem::replace(&mut cache.handlers, fresh));
    }

    /// Makes `region` findable under `name` (replacing an older entry).
    pub fn publish_region(&self, name: &str, region: RemoteRegion) {
        self.regions.write().insert(name.to_string(), region);
    }

    /// Removes a published region name.
    pub fn unpublish_region(&self, name: &str) {
        self.regions.write().remove(name);
    }

    /// Names of the registered services (the directory is not listed).
    pub fn service_names(&self) -> Vec<String> {
        let mut v: Vec<String> = self.names.read().keys().cloned().collect();
        v.sort();
        v
    }

    pub fn resolve_service(&self, name: &str) -> Option<ServiceId> {
        self.names.read().get(name).copied()
    }

    pub fn resolve_region(&self, name: &str) -> Option<RemoteRegion> {
        self.regions.read().get(name).copied()
    }

    /// RPCs served and the handler CPU charged for them (with sending their
    /// replies), since the node started: the shared counters and every
    /// serving thread's cell, summed now (N1). Exact once the replies
    /// counted have been received (each is counted before it is sent).
    pub fn served(&self) -> (u64, u64) {
        let (mut served, mut cpu) = (
            self.served.load(Ordering::Relaxed),
            self.handler_cpu_ns.load(Ordering::Relaxed),
        );
        for c in self.cells.lock().iter() {
            served += c.served.load(Ordering::Relaxed);
            cpu += c.cpu_ns.load(Ordering::Relaxed);
        }
        (served, cpu)
    }

    /// A cache's cell in this table (`served`: the cache's field),
    /// registered on first use (or when the cache moves to another table).
    #[inline]
    fn cell<'c>(&self, served: &'c mut Option<(Arc<ServedCell>, u64)>) -> &'c ServedCell {
        if !matches!(served, Some((_, uid)) if *uid == self.uid.0) {
            self.register_cell(served);
        }
        &served.as_ref().expect("registered above").0
    }

    #[cold]
    #[inline(never)]
    fn register_cell(&self, served: &mut Option<(Arc<ServedCell>, u64)>) {
        let cell = Arc::new(ServedCell::default());
        self.cells.lock().push(cell.clone());
        *served = Some((cell, self.uid.0));
    }

    /// Counts one RPC charged `cpu_ns`: in the serving thread's `cell`, or
    /// in the shared counters (two locked read-modify-writes) without one.
    #[inline]
    fn count(&self, cell: Option<&ServedCell>, cpu_ns: u64) {
        match cell {
            Some(c) => c.add(cpu_ns),
            None => {
                self.served.fetch_add(1, Ordering::Relaxed);
                self.handler_cpu_ns.fetch_add(cpu_ns, Ordering::Relaxed);
            }
        }
    }

    /// Runs the handler for `service`, measures its CPU time, and hands the
    /// reply to `send` (at once, or later for a deferred service). A
    /// panicking handler becomes an error reply; the handler thread survives.
    pub fn dispatch(
        &self,
        ctx: &RpcContext,
        service: ServiceId,
        request: &[u8],
        send: impl FnOnce(Reply) + Send + 'static,
    ) {
        // On a `local` handler thread inside a busy stretch the charge comes
        // from the thread's chain of readings (`charge`, which started
        // before the request was read): no stopwatch. Elsewhere, and always
        // under `sim` (where the stopwatch reads virtual CPU, a message's
        // fixed cost included, see `CpuStopwatch::start`), the stopwatch.
        let start = (!crate::charge::active()).then(CpuStopwatch::start);
        // A fresh buffer per request, moved into the reply (no copy): these
        // callers (`sim`, UCX) keep the reply after `send` returns.
        let mut out = Vec::new();
        let send = move |server_cpu_ns: u64, result: LentReply<'_>| {
            send(Reply {
                result: result.map(std::mem::take),
                server_cpu_ns,
            })
        };
        if service == ServiceId::DIRECTORY {
            return self.run(
                start,
                None,
                ctx,
                service,
                Lookup::Directory,
                request,
                &mut out,
                send,
            );
        }
        let found = self
            .handlers
            .read()
            .get(service.0 as usize)
            .and_then(|h| h.clone());
        crate::charge::stamp(crate::charge::Stage::Found);
        let lookup = found.as_ref().map_or(Lookup::Missing, Lookup::Found);
        self.run(start, None, ctx, service, lookup, request, &mut out, send);
    }

    /// [`ServiceTable::dispatch`] finding the handler in the calling
    /// thread's `cache` (refreshed first if the table changed, G2): one
    /// atomic load and an index per request, no lock, no reference count.
    ///
    /// The reply is built in the calling thread's `out` and lent to `send`
    /// (with the charge, in ns), which copies what it needs before it
    /// returns (R1-R3 in docs/transport.md, "Reply buffers"): `out` is
    /// cleared before the handler runs, and a handler that writes into it
    /// ([`Service::handle_into`]) allocates nothing per request. `send` may
    /// take the buffer's allocation (`std::mem::take`) for a reply it must
    /// keep; the next request then starts with an empty `Vec`.
    #[inline]
    pub fn dispatch_cached(
        &self,
        cache: &mut HandlerCache,
        ctx: &RpcContext,
        service: ServiceId,
        request: &[u8],
        out: &mut Vec<u8>,
        send: impl ReplySink,
    ) {
        let start = (!crate::charge::active()).then(CpuStopwatch::start);
        if !cache.is_current(self) {
            self.refresh(cache);
        }
        // The thread's own counters (N1), then the handler.
        let cell = self.cell(&mut cache.served);
        // The common case, inline (branch i83): an immediate handler on a
        // `local` handler thread in a busy stretch (charged by the chain,
        // no stopwatch). The same steps in the same order as `run`'s
        // `Found(Now)` arm followed by `finish` without a `start`, without
        // their two out-of-line calls (their prologues and the arguments
        // passed through them); every other case goes through `run`.
        if start.is_none()
            && service != ServiceId::DIRECTORY
            && let Some(Some(Handler::Now(h))) = cache.handlers.get(service.0 as usize)
        {
            crate::charge::stamp(crate::charge::Stage::Found);
            return Self::answer_now(cell, h, ctx, request, out, send);
        }
        let lookup = if service == ServiceId::DIRECTORY {
            Lookup::Directory
        } else {
            match cache.handlers.get(service.0 as usize) {
                Some(Some(h)) => Lookup::Found(h),
                _ => Lookup::Missing,
            }
        };
        crate::charge::stamp(crate::charge::Stage::Found);
        self.run(start, Some(cell), ctx, service, lookup, request, out, send);
    }

    /// Runs the immediate handler `h` with its reply built in `out`
    /// (cleared first, R1) and sends it, charged by the thread's chain of
    /// readings (C1-C4): what `run`'s `Found(Now)` arm and `finish` without
    /// a `start` do, in the same order (the RPC counted in the thread's
    /// `cell`, N1, before the send).
    #[inline(always)]
    fn answer_now(
        cell: &ServedCell,
        h: &Arc<dyn Service>,
        ctx: &RpcContext,
        request: &[u8],
        out: &mut Vec<u8>,
        send: impl ReplySink,
    ) {
        out.clear();
        let result =
            std::panic::catch_unwind(AssertUnwindSafe(|| h.handle_into(ctx, request, &mut *out)))
                .unwrap_or_else(|_| Err(ServiceError::failed("the handler panicked")))
                .map(|()| out);
        crate::charge::stamp(crate::charge::Stage::Handled);
        let server_cpu_ns = crate::charge::before_send();
        cell.add(server_cpu_ns);
        send.send(server_cpu_ns, result);
        crate::charge::after_send();
    }

    /// Runs the handler `lookup` found (see [`ServiceTable::dispatch`]),
    /// its reply built in `out` (cleared first) and lent to `send`.
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        start: Option<CpuStopwatch>,
        cell: Option<&ServedCell>,
        ctx: &RpcContext,
        service: ServiceId,
        lookup: Lookup<'_>,
        request: &[u8],
        out: &mut Vec<u8>,
        send: impl ReplySink,
    ) {
        match lookup {
            Lookup::Missing => {
                let error = ServiceError::new(
                    ErrorCode::UnknownService,
                    format!("no service with id {} on node {}", service.0, ctx.node),
                );
                self.finish(start, cell, Err(error), send);
            }
            Lookup::Directory => {
                let result = self.directory(ctx.node, request).map(|v| {
                    reply_into(out, v);
                    out
                });
                crate::charge::stamp(crate::charge::Stage::Handled);
                self.finish(start, cell, result, send);
            }
            Lookup::Found(Handler::Now(h)) => {
                // R1: the handler sees an empty buffer, whatever the last
                // reply (or a handler that panicked half-way) left in it.
                out.clear();
                let result = std::panic::catch_unwind(AssertUnwindSafe(|| {
                    h.handle_into(ctx, request, &mut *out)
                }))
                .unwrap_or_else(|_| Err(ServiceError::failed("the handler panicked")))
                .map(|()| out);
                crate::charge::stamp(crate::charge::Stage::Handled);
                self.finish(start, cell, result, send);
            }
            Lookup::Found(Handler::Deferred(h)) => {
                // The sink stays here unless the handler takes a responder
                // (D1): then it is boxed once (no second box around it to
                // take a `Reply`: `Pending::try_send` lends the answer).
                let mut sink = Some(send);
                let mut pending: Option<Arc<parking_lot::Mutex<Pending>>> = None;
                out.clear();
                let answered = {
                    let mut make = || {
                        let send: SendReply = sink
                            .take()
                            .expect("one responder per request (`Later` is taken by value)")
                            .into_deferred();
                        let p = Arc::new(parking_lot::Mutex::new(Pending {
                            send: Some(send),
                            ..Pending::default()
                        }));
                        pending = Some(p.clone());
                        Responder {
                            pending: p,
                            replied: false,
                        }
                    };
                    let later = Later { make: &mut make };
                    std::panic::catch_unwind(AssertUnwindSafe(|| {
                        h.handle_into(ctx, request, &mut *out, later)
                    }))
                };
                // Chained: the `handle_into` call is measured like an
                // immediate reply's, and its answer, when given at once,
                // sent after it (a responder's `reply` inside the call only
                // stores the answer until `handler_cpu_ns` is known); a
                // later answer's send is charged where it runs.
                let cpu = match start {
                    Some(start) => start.elapsed_ns() + self.mean_reply_send_ns(),
                    None => crate::charge::before_send(),
                };
                self.count(cell, cpu);
                match pending {
                    Some(pending) => {
                        let mut p = pending.lock();
                        if answered.is_err() && p.abandoned {
                            // The responder was dropped while unwinding:
                            // say why.
                            p.answer = Some(Err(ServiceError::failed("the handler panicked")));
                        }
                        p.handler_cpu_ns = Some(cpu);
                        p.try_send();
                    }
                    None => {
                        crate::charge::stamp(crate::charge::Stage::Handled);
                        let result = match answered {
                            Ok(Answered::Now(result)) => result.map(|()| out),
                            Ok(Answered::Later) => Err(ServiceError::failed(
                                "the service dropped the request without replying",
                            )),
                            Err(_) => Err(ServiceError::failed("the handler panicked")),
                        };
                        sink.take()
                            .expect("no responder took the sink")
                            .send(cpu, result);
                    }
                }
                if start.is_none() {
                    crate::charge::after_send();
                }
            }
        }
    }

    /// Sends an immediate reply charged with the time since `start` and
    /// the cost of sending it; with no `start` (a `local` handler thread in
    /// a busy stretch), with what the thread's chain of readings says: the
    /// time since the previous reading and the previous reply's measured
    /// send (`charge`, invariants C1-C4).
    ///
    /// The reply carries its cost, so its own send cannot be timed before it
    /// goes out: each reply is charged the mean send cost of this node's
    /// sampled earlier replies. The send is sampled in thread CPU time (a
    /// system call, so only one reply in [`SEND_SAMPLE`]), not with the
    /// stopwatch: a send that wakes another thread (the UCX progress thread,
    /// a caller on this core) may be preempted by it, and elapsed time would
    /// charge the woken thread's work to this one.
    fn finish(
        &self,
        start: Option<CpuStopwatch>,
        cell: Option<&ServedCell>,
        result: LentReply<'_>,
        send: impl ReplySink,
    ) {
        let Some(start) = start else {
            let server_cpu_ns = crate::charge::before_send();
            self.count(cell, server_cpu_ns);
            send.send(server_cpu_ns, result);
            crate::charge::after_send();
            return;
        };
        let server_cpu_ns = start.elapsed_ns() + self.mean_reply_send_ns();
        self.count(cell, server_cpu_ns);
        if self
            .replies
            .fetch_add(1, Ordering::Relaxed)
            .is_multiple_of(SEND_SAMPLE)
        {
            // Two upper bounds on the send's CPU: the elapsed time (too high
            // only if the thread lost its core meanwhile) and the thread CPU
            // time less the clock's least back-to-back cost (too high by the
            // clock's jitter, which is larger than a cheap send). The smaller
            // is the better estimate; both include a wake-up's system call.
            // Under `sim` only the virtual CPU counts (as before).
            let before = thread_cpu_ns();
            let watch = crate::sim::cpu_ns().is_none().then(CpuStopwatch::start);
            send.send(server_cpu_ns, result);
            let elapsed = watch.map_or(u64::MAX, |w| w.elapsed_ns());
            let spent = thread_cpu_ns()
                .saturating_sub(before)
                .saturating_sub(thread_clock_overhead_ns());
            self.record_reply_send(elapsed.min(spent));
        } else {
            send.send(server_cpu_ns, result);
        }
    }

    /// The mean cost of this node's sampled reply sends, in nanoseconds
    /// (what every reply charged by the stopwatch is charged for its own
    /// send; replies charged by a `local` handler's chain carry measured
    /// sends instead, see [`crate::charge::summary`]).
    pub fn mean_reply_send_ns(&self) -> u64 {
        let n = self.replies_sent.load(Ordering::Relaxed);
        self.reply_send_ns
            .load(Ordering::Relaxed)
            .checked_div(n)
            .unwrap_or(0)
    }

    fn record_reply_send(&self, ns: u64) {
        self.reply_send_ns.fetch_add(ns, Ordering::Relaxed);
        self.replies_sent.fetch_add(1, Ordering::Relaxed);
    }

    fn directory(&self, node: NodeId, request: &[u8]) -> Result<Vec<u8>, ServiceError> {
        let mut r = WireReader::new(request);
        let op = r.u8()?;
        let name = r.str()?;
        r.end()?;
        let mut w = WireWriter::new();
        match op {
            directory::RESOLVE_SERVICE => {
                let id = self.resolve_service(name).ok_or_else(|| {
                    ServiceError::new(
                        ErrorCode::UnknownService,
                        format!("no service named {name:?} on node {node}"),
                    )
                })?;
                w.u32(id.0);
            }
            directory::RESOLVE_REGION => {
                let reg = self.resolve_region(name).ok_or_else(|| {
                    ServiceError::failed(format!("no region named {name:?} on node {node}"))
                })?;
                w.u16(reg.node.0).u32(reg.id.0).u64(reg.key.0).u64(reg.len);
            }
            op => {
                return Err(ServiceError::malformed(format!(
                    "unknown directory op {op}"
                )));
            }
        }
        Ok(w.finish())
    }
}

pub(crate) fn decode_region(buf: &[u8]) -> Result<RemoteRegion, crate::wire::WireError> {
    let mut r = WireReader::new(buf);
    let reg = RemoteRegion {
        node: NodeId(r.u16()?),
        id: RegionId(r.u32()?),
        key: AccessKey(r.u64()?),
        len: r.u64()?,
    };
    r.end()?;
    Ok(reg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ctx() -> RpcContext {
        RpcContext {
            caller: NodeId(1),
            node: NodeId(0),
        }
    }

    /// Dispatches and waits for the reply, however late it comes.
    fn call(t: &ServiceTable, id: ServiceId, req: &[u8]) -> Reply {
        let (tx, rx) = std::sync::mpsc::channel();
        t.dispatch(&ctx(), id, req, move |r| tx.send(r).unwrap());
        rx.recv_timeout(std::time::Duration::from_secs(10))
            .expect("a reply")
    }

    #[test]
    fn unknown_service_and_panics_become_error_replies() {
        let t = ServiceTable::new();
        let r = call(&t, ServiceId(99), b"x");
        assert_eq!(r.result.unwrap_err().code, ErrorCode::UnknownService);
        let id = t
            .register(
                "boom",
                Arc::new(
                    |_: &RpcContext, _: &[u8]| -> Result<Vec<u8>, ServiceError> { panic!("boom") },
                ),
            )
            .unwrap();
        let r = call(&t, id, b"");
        assert_eq!(r.result.unwrap_err().code, ErrorCode::Failed);
    }

    #[test]
    fn deferred_services_reply_late_from_other_threads() {
        let t = ServiceTable::new();
        let parked: Arc<parking_lot::Mutex<Vec<Responder>>> = Arc::default();
        let p = parked.clone();
        let id = t
            .register_deferred(
                "later",
                Arc::new(move |_: &RpcContext, req: &[u8], r: Responder| match req {
                    b"now" => r.reply(Ok(b"at once".to_vec())),
                    b"drop" => drop(r),
                    b"boom" => panic!("boom"),
                    _ => p.lock().push(r),
                }),
            )
            .unwrap();
        assert_eq!(call(&t, id, b"now").result.unwrap(), b"at once");
        assert!(
            call(&t, id, b"drop")
                .result
                .unwrap_err()
                .message
                .contains("without replying")
        );
        assert!(
            call(&t, id, b"boom")
                .result
                .unwrap_err()
                .message
                .contains("panicked")
        );
        let (tx, rx) = std::sync::mpsc::channel();
        t.dispatch(&ctx(), id, b"park", move |r| tx.send(r).unwrap());
        assert!(
            rx.try_recv().is_err(),
            "no reply while the request is parked"
        );
        let r = parked.lock().pop().unwrap();
        std::thread::spawn(move || r.reply(Ok(b"late".to_vec())))
            .join()
            .unwrap();
        assert_eq!(rx.recv().unwrap().result.unwrap(), b"late");
        assert_eq!(t.served().0, 4);
    }

    /// A deferred service that answers some requests at once
    /// (`DeferredService::handle_into`) and others through a responder.
    struct AtOnceOrLater {
        parked: parking_lot::Mutex<Vec<Responder>>,
    }

    impl DeferredService for AtOnceOrLater {
        fn handle(&self, _: &RpcContext, _: &[u8], _: Responder) {
            unreachable!("handle_into serves every request");
        }

        fn handle_into(
            &self,
            _: &RpcContext,
            req: &[u8],
            out: &mut Vec<u8>,
            later: Later<'_>,
        ) -> Answered {
            assert!(out.is_empty(), "R1: the buffer is empty on entry");
            match req {
                b"now" => {
                    out.extend_from_slice(b"at once");
                    Answered::Now(Ok(()))
                }
                b"err" => Answered::Now(Err(ServiceError::failed("refused at once"))),
                b"reply-inside" => {
                    later.responder().reply(Ok(b"replied inside".to_vec()));
                    Answered::Later
                }
                b"park" => {
                    self.parked.lock().push(later.responder());
                    Answered::Later
                }
                b"both" => {
                    // D1: with a responder taken, its answer is the one
                    // sent; `Now` is not sent as well.
                    later.responder().reply(Ok(b"the responder's".to_vec()));
                    out.extend_from_slice(b"not sent");
                    Answered::Now(Ok(()))
                }
                b"later-without-responder" => Answered::Later,
                b"boom" => panic!("boom"),
                b"boom-after-taking" => {
                    let _r = later.responder();
                    panic!("boom")
                }
                _ => unreachable!(),
            }
        }
    }

    /// Every answer sent: request id, payload or error message.
    type AnswerLog = Arc<parking_lot::Mutex<Vec<(usize, Result<Vec<u8>, String>)>>>;

    /// A sink that logs every answer it sends and counts the times it is
    /// boxed for a later answer.
    struct LoggingSink {
        id: usize,
        log: AnswerLog,
        boxed: Arc<AtomicU32>,
    }

    impl ReplySink for LoggingSink {
        fn send(self, _: u64, result: LentReply<'_>) {
            let r = result.map(|v| v.clone()).map_err(|e| e.message);
            self.log.lock().push((self.id, r));
        }
        fn into_deferred(self) -> Box<dyn FnOnce(u64, LentReply<'_>) + Send> {
            self.boxed.fetch_add(1, Ordering::Relaxed);
            Box::new(move |cpu, r| self.send(cpu, r))
        }
    }

    /// D1: every request to a deferred service gets exactly one answer,
    /// at once (no responder made, the sink never boxed) or later (the
    /// sink boxed once), through the cached dispatch (a thread's reusable,
    /// dirty buffer) and the plain one; each counted once.
    #[test]
    fn a_deferred_service_answers_at_once_or_later_exactly_once() {
        let t = ServiceTable::new();
        let svc = Arc::new(AtOnceOrLater {
            parked: parking_lot::Mutex::new(Vec::new()),
        });
        let id = t.register_deferred("mixed", svc.clone()).unwrap();
        let log: AnswerLog = Arc::default();
        let boxed = Arc::new(AtomicU32::new(0));
        let reqs: [&[u8]; 8] = [
            b"now",
            b"err",
            b"reply-inside",
            b"park",
            b"both",
            b"later-without-responder",
            b"boom",
            b"boom-after-taking",
        ];
        let mut cache = HandlerCache::new();
        let mut out = b"left over from the last reply".to_vec();
        for (i, req) in reqs.iter().enumerate() {
            let sink = LoggingSink {
                id: i,
                log: log.clone(),
                boxed: boxed.clone(),
            };
            t.dispatch_cached(&mut cache, &ctx(), id, req, &mut out, sink);
            out.extend_from_slice(b"dirty");
        }
        // Boxed only for the requests that took a responder.
        assert_eq!(boxed.load(Ordering::Relaxed), 4);
        assert_eq!(log.lock().len(), 7, "all answered but the parked one");
        let parked = svc.parked.lock().pop().unwrap();
        std::thread::spawn(move || parked.reply(Ok(b"late".to_vec())))
            .join()
            .unwrap();
        let mut got = log.lock().clone();
        got.sort_by_key(|(i, _)| *i);
        let ok = |s: &[u8]| Ok(s.to_vec());
        let err = |i: usize| got[i].1.clone().unwrap_err();
        assert_eq!(got.len(), reqs.len(), "one answer per request: {got:?}");
        assert!(got.iter().enumerate().all(|(i, (id, _))| *id == i));
        assert_eq!(got[0].1, ok(b"at once"));
        assert_eq!(err(1), "refused at once");
        assert_eq!(got[2].1, ok(b"replied inside"));
        assert_eq!(got[3].1, ok(b"late"));
        assert_eq!(got[4].1, ok(b"the responder's"));
        assert!(err(5).contains("without replying"), "{}", err(5));
        assert!(err(6).contains("panicked"), "{}", err(6));
        assert!(err(7).contains("panicked"), "{}", err(7));
        assert_eq!(t.served().0, reqs.len() as u64);
        // The plain dispatch (`sim`, UCX): the same answers.
        assert_eq!(call(&t, id, b"now").result.unwrap(), b"at once");
        assert_eq!(
            call(&t, id, b"err").result.unwrap_err().message,
            "refused at once"
        );
        assert_eq!(call(&t, id, b"both").result.unwrap(), b"the responder's");
        assert!(
            call(&t, id, b"boom")
                .result
                .unwrap_err()
                .message
                .contains("panicked")
        );
        assert_eq!(t.served().0, reqs.len() as u64 + 4);
    }

    /// G1/G2: a cache follows the table: a handler registered after the
    /// cache was filled is found, an unregistered one is not (the
    /// unknown-service error) and the cache no longer holds it, and a
    /// released cache holds nothing until its next dispatch.
    #[test]
    fn a_handler_cache_follows_registrations() {
        let t = ServiceTable::new();
        let mut cache = HandlerCache::new();
        let call = |t: &ServiceTable, cache: &mut HandlerCache, id| {
            let (tx, rx) = std::sync::mpsc::channel();
            let mut out = Vec::new();
            t.dispatch_cached(
                cache,
                &ctx(),
                id,
                b"x",
                &mut out,
                move |_, r: LentReply<'_>| tx.send(r.map(|v| v.clone())).unwrap(),
            );
            rx.recv().unwrap()
        };
        let state = Arc::new(1u8);
        let weak = Arc::downgrade(&state);
        let a = t
            .register(
                "a",
                Arc::new(move |_: &RpcContext, _: &[u8]| Ok(vec![*state])),
            )
            .unwrap();
        assert_eq!(call(&t, &mut cache, a).unwrap(), [1]);
        assert!(cache.is_current(&t));
        let b = t
            .register("b", Arc::new(|_: &RpcContext, _: &[u8]| Ok(vec![2])))
            .unwrap();
        assert!(
            !cache.is_current(&t),
            "a registration changes the generation"
        );
        assert_eq!(call(&t, &mut cache, b).unwrap(), [2]);
        t.unregister("a");
        assert_eq!(weak.strong_count(), 1, "only the cache holds it now");
        let e = call(&t, &mut cache, a).unwrap_err();
        assert_eq!(e.code, ErrorCode::UnknownService);
        assert_eq!(weak.strong_count(), 0, "the refresh dropped it");
        // The directory is served from a cache too.
        let mut w = WireWriter::new();
        w.u8(directory::RESOLVE_SERVICE).str("b");
        let (tx, rx) = std::sync::mpsc::channel();
        t.dispatch_cached(
            &mut cache,
            &ctx(),
            ServiceId::DIRECTORY,
            &w.finish(),
            &mut Vec::new(),
            move |_, r: LentReply<'_>| tx.send(r.map(|v| v.clone())).unwrap(),
        );
        assert_eq!(rx.recv().unwrap().unwrap(), b.0.to_le_bytes());
        cache.release();
        assert!(!cache.is_current(&t));
        assert_eq!(call(&t, &mut cache, b).unwrap(), [2]);
        t.clear();
        assert_eq!(
            call(&t, &mut cache, b).unwrap_err().code,
            ErrorCode::UnknownService
        );
    }

    #[test]
    fn duplicate_names_are_refused() {
        let t = ServiceTable::new();
        let h: Arc<dyn Service> = Arc::new(|_: &RpcContext, r: &[u8]| Ok(r.to_vec()));
        t.register("echo", h.clone()).unwrap();
        assert!(t.register("echo", h).is_err());
    }

    #[test]
    fn reply_encoding_round_trips() {
        for result in [Ok(vec![1, 2, 3]), Err(ServiceError::malformed("bad"))] {
            let r = Reply {
                result,
                server_cpu_ns: 77,
            };
            assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        }
        assert!(Reply::decode(&[9, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
    }

    /// N1: RPCs dispatched through handler threads' caches are counted in
    /// each thread's own cell, never in the table's shared counters (no
    /// locked read-modify-write per RPC), and `served` sums the cells and
    /// the shared counters exactly: counts and charges, also for a cache
    /// that moved to a second table and for threads that have ended.
    #[test]
    fn cached_dispatches_count_in_the_threads_cells_and_sum_exactly() {
        let t = Arc::new(ServiceTable::new());
        let id = t
            .register(
                "echo",
                Arc::new(
                    |_: &RpcContext, req: &[u8]| -> Result<Vec<u8>, ServiceError> {
                        Ok(req.to_vec())
                    },
                ),
            )
            .unwrap();
        let (threads, per_thread) = (3u64, 200u64);
        let charged: u64 = std::thread::scope(|s| {
            (0..threads)
                .map(|_| {
                    let t = &t;
                    s.spawn(move || {
                        let mut cache = HandlerCache::new();
                        let mut out = Vec::new();
                        let mut sum = 0u64;
                        for _ in 0..per_thread {
                            let (tx, rx) = std::sync::mpsc::channel();
                            t.dispatch_cached(
                                &mut cache,
                                &ctx(),
                                id,
                                b"x",
                                &mut out,
                                move |ns: u64, r: LentReply<'_>| tx.send((ns, r.is_ok())).unwrap(),
                            );
                            let (ns, ok) = rx.try_recv().expect("answered at once");
                            assert!(ok);
                            sum += ns;
                        }
                        sum
                    })
                })
                .collect::<Vec<_>>()
                .into_iter()
                .map(|h| h.join().unwrap())
                .sum()
        });
        // Two more through the shared path (`dispatch`: sim, UCX).
        let shared: u64 = (0..2).map(|_| call(&t, id, b"y").server_cpu_ns).sum();
        assert_eq!(
            t.served.load(Ordering::Relaxed),
            2,
            "cached dispatches must not touch the shared counters"
        );
        assert_eq!(t.served(), (threads * per_thread + 2, charged + shared));
        // A cache moved to another table counts there, not here.
        let u = ServiceTable::new();
        let uid = u
            .register(
                "echo",
                Arc::new(
                    |_: &RpcContext, _: &[u8]| -> Result<Vec<u8>, ServiceError> { Ok(Vec::new()) },
                ),
            )
            .unwrap();
        let mut cache = HandlerCache::new();
        let mut out = Vec::new();
        for table in [&*t, &u, &*t] {
            let i = if std::ptr::eq(table, &u) { uid } else { id };
            table.dispatch_cached(
                &mut cache,
                &ctx(),
                i,
                b"z",
                &mut out,
                |_: u64, _: LentReply<'_>| {},
            );
        }
        assert_eq!(t.served().0, threads * per_thread + 2 + 2);
        assert_eq!(u.served().0, 1);
    }
}
