//! The issuing side: one UCX worker per endpoint (per compute thread).
//!
//! The worker is driven by the thread's executor while its tasks wait
//! ([`exec::register_idle_hook`]); every completion and RPC reply happens
//! inside that progress call. Per node the endpoint keeps a session (a UCX
//! endpoint to the node's worker, and the node's endpoint back to ours for
//! replies) and a cache of remote keys fetched over the control connection.
//!
//! A batch is checked whole before anything is posted (node, region, access
//! key, bounds, alignment). Each node's verbs then take one path
//! ([`VerbPath`]): executed directly, word by word, on memory the transport
//! maps into this process (shared memory), like the `local` backend does;
//! posted with `ucp_get_nbx`, `ucp_put_nbx` and `ucp_atomic_op_nbx`, with a
//! fence between verbs whose order matters and a flush per node that was
//! written; or sent as one message per node to the node's progress thread
//! (the TCP path, [`crate::verbs`]). The batch waits once for all of them.

use crate::cluster::{ClusterInner, Peer, VerbPath};
use crate::control;
use crate::ffi::{Ep, MappedView, Op, Rkey, UcxError, Worker};
use crate::server::{AM_REPLY, AM_REQUEST, AM_VERBS};
use dmkv_transport::exec::{self, IdleHookGuard};
use dmkv_transport::region::RegionAccessError;
use dmkv_transport::{
    EndpointBackend, NodeId, OpFuture, RemoteAddr, Reply, Result, ServiceId, TransportError, Verb,
    VerbResult, VerbResults, Verbs, WireReader, WireWriter,
};
use rustc_hash::FxHashMap;
use std::cell::{Cell, RefCell};
use std::collections::HashMap;
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::Ordering::Relaxed;
use std::task::{Poll, Waker};
use std::time::{Duration, Instant};

/// How often waiting tasks are woken to re-check timeouts and node failures
/// even when UCX reports no progress.
const RECHECK: Duration = Duration::from_micros(100);
/// How long an idle thread with operations in flight polls UCX before it
/// sleeps on the worker's event fd: a reply that comes within this time
/// costs no wake-up. After [`SPINS`] empty polls it yields its core between
/// polls, so that on a small machine the serving threads get the CPU.
const SPIN_BEFORE_SLEEP: Duration = Duration::from_millis(1);
/// Empty polls before the thread yields between polls. None: like the
/// local executor, it yields from its first empty poll. Measured over shared
/// memory on the loaded 2-core host (docs/performance.md, sixth pass): 64
/// gave 36-49K RPC ops/s, 0 gave 45-66K, and 1024 gave 10-12K (a spinning
/// client holds the core its handler thread needs until preempted).
const SPINS: u32 = 0;
/// The longest such a sleep lasts (other wake-ups, such as timers, are not
/// seen while sleeping).
const SLEEP: i32 = 1;

/// A request waiting for its reply (an RPC's or a verbs message's).
#[derive(Default)]
struct Slot {
    /// Whether the request is an RPC (else a verbs message).
    is_rpc: bool,
    /// An RPC's reply, decoded as it arrives (one copy of its payload).
    rpc: Option<Result<Reply>>,
    /// A verbs message's reply, as it arrived.
    reply: Option<Vec<u8>>,
    waker: Option<Waker>,
}

/// Waiting requests by request id (looked up several times per RPC; the ids
/// are a counter, so FxHash instead of SipHash, branch i76).
type Rpcs = Rc<RefCell<FxHashMap<u64, Slot>>>;

/// How a node's verbs travel in a batch (a node takes the lowest path any
/// of its verbs has, so that they keep their order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Path {
    Messages,
    Ucx,
    Direct,
}

/// A remote key fetched for one region.
struct Cached {
    path: Path,
    key: u64,
    base: u64,
    len: u64,
    // The view (if any) before the rkey it borrows from.
    view: Option<MappedView>,
    rkey: Rc<Rkey>,
}

struct Conn {
    peer: Arc<Peer>,
    session: u32,
    token: u64,
    generation: Cell<u64>,
    rkeys: RefCell<HashMap<u32, Rc<Cached>>>,
    /// To the node's progress thread (verbs messages; RPCs if the node has
    /// no handler threads, which answers them with an error).
    ep: Ep,
    /// To each of the node's handler threads' workers, which serve RPCs
    /// inline; a call goes to `rpc_eps[rid % len]`.
    rpc_eps: Vec<Ep>,
}

impl Conn {
    /// The node is gone (its control connection ended): operations still
    /// in flight on its endpoints are leaked rather than awaited when they
    /// are dropped (a shared-memory endpoint would never report them failed).
    fn abandon(&self) {
        self.ep.abandon();
        for ep in &self.rpc_eps {
            ep.abandon();
        }
    }

    /// The endpoint RPC `rid` goes to.
    fn rpc_ep(&self, rid: u64) -> &Ep {
        if self.rpc_eps.is_empty() {
            &self.ep
        } else {
            &self.rpc_eps[(rid % self.rpc_eps.len() as u64) as usize]
        }
    }
}

impl Drop for Conn {
    fn drop(&mut self) {
        self.rkeys.borrow_mut().clear();
        let mut w = WireWriter::new();
        w.u32(self.session);
        if !self.peer.is_down() {
            self.peer.send(control::CLOSE_SESSION, &w.finish());
        }
    }
}

struct State {
    cluster: Arc<ClusterInner>,
    node: NodeId,
    conns: RefCell<FxHashMap<NodeId, Rc<Conn>>>,
    rpcs: Rpcs,
    /// The buffer of the last request sent, handed back by
    /// `request_buffer` for the next one (UCX copied the request out).
    spare_request: RefCell<Vec<u8>>,
    /// Wakers being woken by `wake_all` (kept to reuse the allocation).
    scratch: RefCell<Vec<Waker>>,
    next_rid: Cell<u64>,
    waiters: RefCell<Vec<Waker>>,
    last_wake: Cell<Instant>,
    idle_since: Cell<Option<Instant>>,
    /// Empty polls since the last event.
    empty_polls: Cell<u32>,
    event_fd: Option<i32>,
    address: Vec<u8>,
    // Last: everything above may hold UCX objects of this worker.
    worker: Worker,
}

impl State {
    /// Wakes the batches waiting for verbs to complete (their ops complete
    /// inside UCX's progress, with no callback of ours).
    fn wake_waiters(&self) {
        let mut ws = self.scratch.take();
        ws.append(&mut self.waiters.borrow_mut());
        for w in ws.drain(..) {
            w.wake();
        }
        *self.scratch.borrow_mut() = ws;
    }

    /// Wakes every waiting task, so that each looks at its timeout and its
    /// node's health again.
    fn wake_all(&self) {
        self.wake_waiters();
        let mut ws = self.scratch.take();
        ws.extend(
            self.rpcs
                .borrow_mut()
                .values_mut()
                .filter_map(|s| s.waker.take()),
        );
        for w in ws.drain(..) {
            w.wake();
        }
        *self.scratch.borrow_mut() = ws;
        self.last_wake.set(Instant::now());
    }

    /// The idle hook: drive UCX, then let waiting tasks look again. With
    /// operations in flight and nothing happening for a while, sleep until
    /// UCX has an event (or briefly); with none, give the CPU away.
    ///
    /// After a progress call that did something only the batches waiting
    /// for verbs are woken: a reply wakes its own caller (the message
    /// handler), so the other callers, still waiting, are not polled for
    /// nothing (branch i76: with 8 RPCs in flight every reply woke all 8).
    /// Everyone is woken every [`RECHECK`] (timeouts, failed sends, nodes
    /// gone).
    fn idle(&self) {
        if self.worker.progress() {
            self.idle_since.set(None);
            self.empty_polls.set(0);
            self.after_progress();
            return;
        }
        let polls = self.empty_polls.get().saturating_add(1);
        self.empty_polls.set(polls);
        let now = Instant::now();
        let since = *self.idle_since.get().get_or_insert(now);
        self.idle_since.set(Some(since));
        let in_flight = !self.waiters.borrow().is_empty() || !self.rpcs.borrow().is_empty();
        if !in_flight {
            std::thread::yield_now();
        } else if now - since >= SPIN_BEFORE_SLEEP
            && let Some(fd) = self.event_fd
            && self.worker.arm()
        {
            crate::ffi::poll_readable(&[fd], SLEEP);
            self.empty_polls.set(0);
        } else if polls > SPINS {
            std::thread::yield_now();
        }
        if self.last_wake.get().elapsed() >= RECHECK {
            self.wake_all();
        }
    }

    /// Keeps a sent request's allocation for the next request (see
    /// [`EndpointBackend::request_buffer`]), emptied.
    fn keep_request_buffer(&self, mut request: Vec<u8>) {
        let mut spare = self.spare_request.borrow_mut();
        if request.capacity() > spare.capacity() {
            request.clear();
            *spare = request;
        }
    }

    /// Who is woken after a progress call that did something (see
    /// [`State::idle`]).
    fn after_progress(&self) {
        self.wake_waiters();
        if self.last_wake.get().elapsed() >= RECHECK {
            self.wake_all();
        }
    }

    fn ucx_error(&self, node: NodeId, e: UcxError) -> TransportError {
        if e.is_peer_failure() {
            TransportError::NodeDown(node)
        } else {
            TransportError::Backend(format!("to node {node}: {e}"))
        }
    }

    /// The session with `node`, opened on first use.
    fn conn(&self, node: NodeId) -> Result<Rc<Conn>> {
        if let Some(c) = self.conns.borrow().get(&node) {
            if c.peer.is_down() || c.ep.failed().is_some() {
                c.abandon();
                return Err(TransportError::NodeDown(node));
            }
            return Ok(c.clone());
        }
        let peer = self.cluster.peer(node)?;
        if peer.is_down() {
            return Err(TransportError::NodeDown(node));
        }
        let SessionAnswer {
            session,
            token,
            handler_addresses,
            node_host,
            progress_address,
        } = open_session(&peer, &self.address)?;
        // Shared memory where the node is on this host (`crate::shm`).
        let connect = |address: &[u8]| {
            let (ep, shm) = crate::shm::connect(&self.worker, address, &node_host)?;
            let stats = &self.cluster.stats;
            if shm {
                &stats.shm_endpoints
            } else {
                &stats.checked_endpoints
            }
            .fetch_add(1, Relaxed);
            Ok::<Ep, UcxError>(ep)
        };
        let ep = connect(&progress_address).map_err(|e| self.ucx_error(node, e))?;
        let rpc_eps = handler_addresses
            .iter()
            .map(|a| connect(a))
            .collect::<std::result::Result<Vec<Ep>, UcxError>>()
            .map_err(|e| self.ucx_error(node, e))?;
        let c = Rc::new(Conn {
            generation: Cell::new(peer.generation.load(std::sync::atomic::Ordering::Acquire)),
            peer,
            session,
            token,
            rkeys: RefCell::new(HashMap::new()),
            ep,
            rpc_eps,
        });
        self.conns.borrow_mut().insert(node, c.clone());
        self.cluster.stats.sessions.fetch_add(1, Relaxed);
        Ok(c)
    }

    /// The remote key for `addr`'s region, fetched by presenting its access
    /// key to the owning node (a wrong key is refused there).
    fn rkey(&self, conn: &Conn, addr: &RemoteAddr) -> Result<Rc<Cached>> {
        let g = conn
            .peer
            .generation
            .load(std::sync::atomic::Ordering::Acquire);
        if g != conn.generation.get() {
            if conn.peer.is_down() {
                return Err(TransportError::NodeDown(addr.node));
            }
            let inv = conn.peer.invalidated.read();
            conn.rkeys.borrow_mut().retain(|r, _| !inv.contains(r));
            conn.generation.set(g);
        }
        if let Some(c) = conn.rkeys.borrow().get(&addr.region.0)
            && c.key == addr.key.0
        {
            return Ok(c.clone());
        }
        self.cluster.stats.rkey_fetches.fetch_add(1, Relaxed);
        let (kind, body) = conn.peer.request(control::FETCH_RKEY, |w| {
            w.u32(addr.region.0).u64(addr.key.0);
        })?;
        let mut r = WireReader::new(&body);
        if kind == control::DENIED {
            return Err(match r.u8()? {
                control::DENIED_NO_REGION => TransportError::NoSuchRegion {
                    node: addr.node,
                    region: addr.region,
                },
                control::DENIED_WRONG_KEY => TransportError::AccessDenied {
                    node: addr.node,
                    region: addr.region,
                },
                _ => TransportError::Backend(format!(
                    "node {} refused a remote key: {}",
                    addr.node,
                    r.str().unwrap_or("?")
                )),
            });
        }
        let base = r.u64()?;
        let len = r.u64()?;
        let packed = r.bytes()?;
        r.end()?;
        let rkey = Rc::new(
            conn.ep
                .unpack_rkey(packed)
                .map_err(|e| self.ucx_error(addr.node, e))?,
        );
        let view = match self.cluster.config.verbs {
            VerbPath::Auto => rkey.mapped_view(base, len as usize),
            VerbPath::Ucx | VerbPath::Messages => None,
        };
        let path = if view.is_some() {
            Path::Direct
        } else if self.cluster.config.verbs == VerbPath::Ucx || self.cluster.native_rma {
            Path::Ucx
        } else {
            Path::Messages
        };
        let c = Rc::new(Cached {
            path,
            key: addr.key.0,
            base,
            len,
            view,
            rkey,
        });
        conn.rkeys.borrow_mut().insert(addr.region.0, c.clone());
        Ok(c)
    }
}

/// What a node answers to `OPEN_SESSION`.
pub(crate) struct SessionAnswer {
    pub(crate) session: u32,
    pub(crate) token: u64,
    /// The node's handler threads' worker addresses (RPCs go to one of
    /// them by request id).
    pub(crate) handler_addresses: Vec<Vec<u8>>,
    /// The node's host id ([`crate::shm::host_id`]).
    pub(crate) node_host: Vec<u8>,
    /// The worker of the node's progress thread to send verbs messages to.
    /// This and the handler addresses are workers of this client process's
    /// own when it reaches the node over shared memory (`docs/ucx.md`, *A
    /// killed client's FIFO slot*).
    pub(crate) progress_address: Vec<u8>,
}

/// Opens a session with the node behind `peer` for the worker at
/// `address` (this process's, on this host).
pub(crate) fn open_session(peer: &Peer, address: &[u8]) -> Result<SessionAnswer> {
    let node = peer.id;
    let (kind, body) = peer.request(control::OPEN_SESSION, |w| {
        w.bytes(address).bytes(crate::shm::host_id());
    })?;
    let mut r = WireReader::new(&body);
    if kind != control::SESSION {
        let _ = r.u8();
        let why = r.str().unwrap_or("?").to_string();
        return Err(TransportError::Backend(format!(
            "node {node} refused a session: {why}"
        )));
    }
    let session = r.u32()?;
    let token = r.u64()?;
    let handlers = r.u16()?;
    let mut handler_addresses = Vec::with_capacity(handlers as usize);
    for _ in 0..handlers {
        handler_addresses.push(r.bytes()?.to_vec());
    }
    let node_host = r.bytes()?.to_vec();
    let progress_address = r.bytes()?.to_vec();
    r.end()?;
    Ok(SessionAnswer {
        session,
        token,
        handler_addresses,
        node_host,
        progress_address,
    })
}

/// A verb checked and ready to post.
struct Prepared {
    verb: Verb,
    conn: Rc<Conn>,
    /// The region's key and mapping (not fetched for the message path,
    /// where the node checks every verb itself).
    target: Option<Rc<Cached>>,
    path: Path,
}

fn verb_addr(v: &Verb) -> &RemoteAddr {
    match v {
        Verb::Read { addr, .. }
        | Verb::Write { addr, .. }
        | Verb::Cas { addr, .. }
        | Verb::Faa { addr, .. } => addr,
    }
}

/// Checks a verb against its region: bounds, and alignment for atomics.
fn check_range(v: &Verb, len: u64) -> Result<()> {
    let addr = verb_addr(v);
    let (n, atomic) = match v {
        Verb::Read { len, .. } => (*len as u64, false),
        Verb::Write { data, .. } => (data.len() as u64, false),
        Verb::Cas { .. } | Verb::Faa { .. } => (8, true),
    };
    if atomic && !addr.offset.is_multiple_of(8) {
        return Err(TransportError::Misaligned {
            offset: addr.offset,
        });
    }
    match addr.offset.checked_add(n) {
        Some(end) if end <= len => Ok(()),
        _ => Err(RegionAccessError::OutOfBounds {
            offset: addr.offset,
            len: n,
            size: len,
        }
        .at(addr)),
    }
}

/// Executes a verb on memory mapped into this process.
fn perform_direct(view: &MappedView, v: Verb) -> Result<VerbResult> {
    let mem = view.mem();
    let addr = *verb_addr(&v);
    let map = |e: RegionAccessError| e.at(&addr);
    Ok(match v {
        Verb::Read { addr, len } => {
            let mut buf = vec![0; len];
            mem.read(addr.offset, &mut buf).map_err(map)?;
            VerbResult::Read(buf)
        }
        Verb::Write { addr, data } => {
            mem.write(addr.offset, &data).map_err(map)?;
            VerbResult::Write
        }
        Verb::Cas {
            addr,
            expected,
            new,
        } => VerbResult::Cas(mem.cas_u64(addr.offset, expected, new).map_err(map)?),
        Verb::Faa { addr, add } => VerbResult::Faa(mem.faa_u64(addr.offset, add).map_err(map)?),
    })
}

enum Posted {
    Done(VerbResult),
    /// Carried by a verbs message to this node; filled in from its reply.
    Message(NodeId),
    Read(NodeId, Op),
    Write(NodeId, Op),
    Cas(NodeId, Op),
    Faa(NodeId, Op),
}

/// A UCX endpoint backend: one per issuing thread.
pub(crate) struct UcxEndpoint {
    state: Rc<State>,
    _hook: IdleHookGuard,
}

impl UcxEndpoint {
    pub(crate) fn new(cluster: Arc<ClusterInner>, node: NodeId) -> Result<UcxEndpoint> {
        let worker = Worker::new(&cluster.ctx)
            .map_err(|e| TransportError::Backend(format!("UCX worker: {e}")))?;
        let address = worker
            .address()
            .map_err(|e| TransportError::Backend(format!("UCX worker address: {e}")))?;
        let rpcs: Rpcs = Rc::default();
        {
            let rpcs = rpcs.clone();
            worker
                .set_am_handler(
                    AM_REPLY,
                    Box::new(move |header: &[u8], data: &[u8]| {
                        let Ok(rid) = <[u8; 8]>::try_from(header).map(u64::from_le_bytes) else {
                            return;
                        };
                        let waker = {
                            let mut rpcs = rpcs.borrow_mut();
                            let Some(slot) = rpcs.get_mut(&rid) else {
                                // Its caller gave up (timeout): drop it.
                                return;
                            };
                            if slot.is_rpc {
                                slot.rpc = Some(Reply::decode(data).map_err(Into::into));
                            } else {
                                slot.reply = Some(data.to_vec());
                            }
                            slot.waker.take()
                        };
                        if let Some(w) = waker {
                            w.wake();
                        }
                    }),
                )
                .map_err(|e| TransportError::Backend(format!("UCX handler: {e}")))?;
        }
        let event_fd = worker.event_fd().ok();
        let state = Rc::new(State {
            idle_since: Cell::new(None),
            empty_polls: Cell::new(0),
            event_fd,
            cluster,
            node,
            conns: RefCell::default(),
            rpcs,
            spare_request: RefCell::default(),
            scratch: RefCell::default(),
            next_rid: Cell::new(1),
            waiters: RefCell::new(Vec::new()),
            last_wake: Cell::new(Instant::now()),
            address,
            worker,
        });
        let s = Rc::downgrade(&state);
        let hook = exec::register_idle_hook(Rc::new(move || {
            if let Some(s) = s.upgrade() {
                s.idle();
            }
        }));
        Ok(UcxEndpoint { state, _hook: hook })
    }

    fn prepare(&self, v: Verb) -> Result<Prepared> {
        let addr = *verb_addr(&v);
        let conn = self.state.conn(addr.node)?;
        if self.state.cluster.config.verbs == VerbPath::Messages {
            return Ok(Prepared {
                verb: v,
                conn,
                target: None,
                path: Path::Messages,
            });
        }
        let target = self.state.rkey(&conn, &addr)?;
        check_range(&v, target.len)?;
        Ok(Prepared {
            verb: v,
            conn,
            path: target.path,
            target: Some(target),
        })
    }

    fn post(&self, p: Prepared) -> Result<Posted> {
        let node = verb_addr(&p.verb).node;
        let target = p.target.as_ref().expect("the UCX path has a remote key");
        let raddr = |a: &RemoteAddr| target.base + a.offset;
        let ep = &p.conn.ep;
        let err = |e| self.state.ucx_error(node, e);
        Ok(match p.verb {
            Verb::Read { addr, len } => {
                Posted::Read(node, ep.get(raddr(&addr), len, &target.rkey).map_err(err)?)
            }
            Verb::Write { addr, data } => {
                Posted::Write(node, ep.put(raddr(&addr), data, &target.rkey).map_err(err)?)
            }
            Verb::Cas {
                addr,
                expected,
                new,
            } => Posted::Cas(
                node,
                ep.cas(raddr(&addr), expected, new, &target.rkey)
                    .map_err(err)?,
            ),
            Verb::Faa { addr, add } => {
                Posted::Faa(node, ep.faa(raddr(&addr), add, &target.rkey).map_err(err)?)
            }
        })
    }
}

impl Drop for UcxEndpoint {
    fn drop(&mut self) {
        // Close sessions (and their UCX endpoints) while the worker lives.
        let conns: Vec<_> = self.state.conns.borrow_mut().drain().collect();
        drop(conns);
    }
}

fn op_status(node: NodeId, op: &Op) -> Option<Result<()>> {
    op.poll().map(|s| {
        if s == 0 {
            Ok(())
        } else {
            let e = UcxError {
                status: s,
                what: "a verb",
            };
            Err(if e.is_peer_failure() {
                TransportError::NodeDown(node)
            } else {
                TransportError::Backend(format!("to node {node}: {e}"))
            })
        }
    })
}

impl EndpointBackend for UcxEndpoint {
    fn local_node(&self) -> NodeId {
        self.state.node
    }

    fn execute(&self, verbs: &mut Verbs) -> OpFuture<'_, Result<VerbResults>> {
        let verbs = std::mem::take(verbs);
        // Check everything before anything is posted.
        let mut plan = Vec::with_capacity(verbs.len());
        for v in verbs {
            match self.prepare(v) {
                Ok(p) => plan.push(p),
                Err(e) => return OpFuture::ready(Err(e)),
            }
        }
        // Each node's verbs take the lowest path any of them has, so they
        // keep their order.
        let mut node_path: HashMap<NodeId, Path> = HashMap::new();
        for p in &plan {
            let e = node_path.entry(verb_addr(&p.verb).node).or_insert(p.path);
            *e = (*e).min(p.path);
        }
        let path_of = |p: &Prepared| node_path[&verb_addr(&p.verb).node];
        let stats = &self.state.cluster.stats;
        for p in &plan {
            match path_of(p) {
                Path::Direct => &stats.direct_verbs,
                Path::Ucx => &stats.posted_verbs,
                Path::Messages => &stats.message_verbs,
            }
            .fetch_add(1, Relaxed);
        }
        if plan.iter().all(|p| path_of(p) == Path::Direct) {
            let results: Result<VerbResults> = plan
                .into_iter()
                .map(|p| {
                    let view = p.target.as_ref().and_then(|t| t.view.as_ref());
                    perform_direct(view.expect("a direct verb has a view"), p.verb)
                })
                .collect();
            // Done already (true one-sided over shared memory); the task
            // still yields once, as every round trip does (the contract:
            // a task spinning on a lock held by a sibling task lets it run).
            return OpFuture::ready_after_yield(results);
        }
        let state = self.state.clone();
        let mut posted: Vec<Posted> = Vec::with_capacity(plan.len());
        // Per node: whether the last posted verb was a read only, and the
        // endpoint to flush if it was written.
        let mut last: HashMap<NodeId, bool> = HashMap::new();
        let mut written: Vec<(NodeId, Ep)> = Vec::new();
        // Per node on the message path: its connection and its verbs.
        let mut messages: Vec<(NodeId, Rc<Conn>, Vec<Verb>)> = Vec::new();
        for p in plan {
            let node = verb_addr(&p.verb).node;
            match path_of(&p) {
                Path::Direct => {
                    let view = p.target.as_ref().and_then(|t| t.view.as_ref());
                    match perform_direct(view.expect("a direct verb has a view"), p.verb) {
                        Ok(r) => posted.push(Posted::Done(r)),
                        Err(e) => return OpFuture::boxed(finish_err(posted, e)),
                    }
                }
                Path::Messages => {
                    match messages.iter_mut().find(|(n, ..)| *n == node) {
                        Some((_, _, vs)) => vs.push(p.verb),
                        None => messages.push((node, p.conn.clone(), vec![p.verb])),
                    }
                    posted.push(Posted::Message(node));
                }
                Path::Ucx => {
                    let is_read = matches!(p.verb, Verb::Read { .. });
                    if let Some(&prev_read) = last.get(&node)
                        && !(prev_read && is_read)
                        && let Err(e) = state.worker.fence()
                    {
                        return OpFuture::boxed(finish_err(posted, state.ucx_error(node, e)));
                    }
                    last.insert(node, is_read);
                    if matches!(p.verb, Verb::Write { .. })
                        && !written.iter().any(|(n, _)| *n == node)
                    {
                        written.push((node, p.conn.ep.clone()));
                    }
                    match self.post(p) {
                        Ok(op) => posted.push(op),
                        Err(e) => return OpFuture::boxed(finish_err(posted, e)),
                    }
                }
            }
        }
        // A put completes locally; a flush completes when it is done at the
        // target.
        let mut flushes = Vec::new();
        for (node, ep) in written {
            match ep.flush() {
                Ok(op) => flushes.push((node, op)),
                Err(e) => return OpFuture::boxed(finish_err(posted, state.ucx_error(node, e))),
            }
        }
        // One message per node on the message path.
        let mut sent: Vec<SentVerbs> = Vec::new();
        for (node, conn, vs) in messages {
            let rid = state.next_rid.get();
            state.next_rid.set(rid + 1);
            let mut h = WireWriter::with_capacity(crate::server::VERBS_HEADER);
            h.u32(conn.session).u64(conn.token).u64(rid);
            state.rpcs.borrow_mut().insert(rid, Slot::default());
            match conn
                .ep
                .am_send(AM_VERBS, h.finish(), crate::verbs::encode(&vs))
            {
                Ok(op) => sent.push(SentVerbs {
                    node,
                    conn,
                    rid,
                    verbs: vs,
                    send: op,
                }),
                Err(e) => {
                    state.rpcs.borrow_mut().remove(&rid);
                    let e = state.ucx_error(node, e);
                    drop(sent);
                    return OpFuture::boxed(finish_err(posted, e));
                }
            }
        }
        let deadline = Instant::now() + state.cluster.config.rpc_timeout;
        OpFuture::boxed(async move {
            /// Forgets the reply slots however the batch ends.
            struct Forget<'a>(&'a State, Vec<u64>);
            impl Drop for Forget<'_> {
                fn drop(&mut self) {
                    let mut rpcs = self.0.rpcs.borrow_mut();
                    for rid in &self.1 {
                        rpcs.remove(rid);
                    }
                }
            }
            let _forget = Forget(&state, sent.iter().map(|s| s.rid).collect());
            // Every round trip yields at least once, even when the verbs
            // completed while they were posted.
            dmkv_transport::exec::yield_now().await;
            let mut replies: Vec<Option<Vec<u8>>> = vec![None; sent.len()];
            std::future::poll_fn(|cx| {
                let mut done = true;
                for p in &posted {
                    if let Posted::Read(n, op)
                    | Posted::Write(n, op)
                    | Posted::Cas(n, op)
                    | Posted::Faa(n, op) = p
                    {
                        match op_status(*n, op) {
                            None => done = false,
                            Some(Err(e)) => return Poll::Ready(Err(e)),
                            Some(Ok(())) => {}
                        }
                    }
                }
                for (n, op) in &flushes {
                    match op_status(*n, op) {
                        None => done = false,
                        Some(Err(e)) => return Poll::Ready(Err(e)),
                        Some(Ok(())) => {}
                    }
                }
                for (i, m) in sent.iter().enumerate() {
                    if replies[i].is_some() {
                        continue;
                    }
                    let reply = state
                        .rpcs
                        .borrow_mut()
                        .get_mut(&m.rid)
                        .and_then(|s| s.reply.take());
                    if let Some(r) = reply {
                        replies[i] = Some(r);
                        continue;
                    }
                    done = false;
                    if let Some(Err(e)) = op_status(m.node, &m.send) {
                        return Poll::Ready(Err(e));
                    }
                    if m.conn.peer.is_down() || m.conn.ep.failed().is_some() {
                        m.conn.abandon();
                        return Poll::Ready(Err(TransportError::NodeDown(m.node)));
                    }
                    if Instant::now() >= deadline {
                        return Poll::Ready(Err(TransportError::Timeout { node: m.node }));
                    }
                    if let Some(s) = state.rpcs.borrow_mut().get_mut(&m.rid) {
                        s.waker = Some(cx.waker().clone());
                    }
                }
                if done {
                    Poll::Ready(Ok(()))
                } else {
                    state.waiters.borrow_mut().push(cx.waker().clone());
                    Poll::Pending
                }
            })
            .await?;
            // Results of each message, in the order its verbs were posted.
            let mut from_messages: HashMap<NodeId, std::vec::IntoIter<VerbResult>> = HashMap::new();
            for (m, r) in sent.iter().zip(replies) {
                let r = r.expect("every reply arrived");
                let results = crate::verbs::decode_reply(m.node, &m.verbs, &r)?;
                from_messages.insert(m.node, results.into_iter());
            }
            // A node's message verbs appear in `posted` in posting order.
            Ok(posted
                .into_iter()
                .map(|p| match p {
                    Posted::Done(r) => r,
                    Posted::Message(node) => from_messages
                        .get_mut(&node)
                        .and_then(|it| it.next())
                        .expect("one result per message verb"),
                    Posted::Read(_, mut op) => VerbResult::Read(op.take_bytes()),
                    Posted::Write(..) => VerbResult::Write,
                    Posted::Cas(_, op) => VerbResult::Cas(op.reply_word()),
                    Posted::Faa(_, op) => VerbResult::Faa(op.reply_word()),
                })
                .collect())
        })
    }

    fn call(
        &self,
        node: NodeId,
        service: ServiceId,
        request: Vec<u8>,
    ) -> OpFuture<'_, Result<Reply>> {
        let state = &self.state;
        let conn = match state.conn(node) {
            Ok(c) => c,
            Err(e) => return OpFuture::ready(Err(e)),
        };
        let rid = state.next_rid.get();
        state.next_rid.set(rid + 1);
        // `session u32 | token u64 | rid u64 | service u32 | caller u16`
        // (`server::REQUEST_HEADER`), on the stack.
        let mut h = [0u8; crate::server::REQUEST_HEADER];
        h[0..4].copy_from_slice(&conn.session.to_le_bytes());
        h[4..12].copy_from_slice(&conn.token.to_le_bytes());
        h[12..20].copy_from_slice(&rid.to_le_bytes());
        h[20..24].copy_from_slice(&service.0.to_le_bytes());
        h[24..26].copy_from_slice(&state.node.0.to_le_bytes());
        state.rpcs.borrow_mut().insert(
            rid,
            Slot {
                is_rpc: true,
                ..Slot::default()
            },
        );
        let ep = conn.rpc_ep(rid).clone();
        // Sent from `request` where UCX sends at once (no copy); its
        // allocation is then kept for the next request (`request_buffer`).
        let send = match ep.am_send_from(AM_REQUEST, &h, &request) {
            Ok(op) => op,
            Err(e) => {
                state.rpcs.borrow_mut().remove(&rid);
                return OpFuture::ready(Err(state.ucx_error(node, e)));
            }
        };
        state.keep_request_buffer(request);
        let deadline = Instant::now() + state.cluster.config.rpc_timeout;
        let state = self.state.clone();
        OpFuture::boxed(async move {
            /// Forgets the reply slot however the call ends.
            struct Forget<'a>(&'a State, u64);
            impl Drop for Forget<'_> {
                fn drop(&mut self) {
                    self.0.rpcs.borrow_mut().remove(&self.1);
                }
            }
            let _forget = Forget(&state, rid);
            // Every round trip yields at least once. The reply is normally
            // not there at the first poll (UCX delivers it while the
            // executor idles), and that poll waits for it; only if it is
            // (another task drove the worker meanwhile) does the call yield
            // explicitly. (Branch i76: an unconditional `yield_now` first
            // cost one more poll of the whole call chain per RPC.)
            let mut yielded = false;
            std::future::poll_fn(|cx| {
                let mut rpcs = state.rpcs.borrow_mut();
                let Some(slot) = rpcs.get_mut(&rid) else {
                    // Removed only when the call ends (`Forget`).
                    return Poll::Ready(Err(TransportError::Backend(format!(
                        "RPC {rid} to node {node}: its reply slot is gone"
                    ))));
                };
                if slot.rpc.is_some() && !yielded {
                    yielded = true;
                    cx.waker().wake_by_ref();
                    return Poll::Pending;
                }
                yielded = true;
                if let Some(reply) = slot.rpc.take() {
                    return Poll::Ready(reply);
                }
                // Checked on every wake-up that was not the reply: at least
                // every `RECHECK`.
                if let Some(op) = &send
                    && let Some(Err(e)) = op_status(node, op)
                {
                    return Poll::Ready(Err(e));
                }
                if conn.peer.is_down() || ep.failed().is_some() {
                    conn.abandon();
                    return Poll::Ready(Err(TransportError::NodeDown(node)));
                }
                if Instant::now() >= deadline {
                    return Poll::Ready(Err(TransportError::Timeout { node }));
                }
                slot.waker = Some(cx.waker().clone());
                Poll::Pending
            })
            .await
        })
    }

    fn request_buffer(&self) -> Vec<u8> {
        std::mem::take(&mut *self.state.spare_request.borrow_mut())
    }
}

/// The verbs message of one batch to one node.
struct SentVerbs {
    node: NodeId,
    conn: Rc<Conn>,
    rid: u64,
    verbs: Vec<Verb>,
    send: Op,
}

/// A batch that failed after some verbs were posted: wait for those (their
/// buffers must outlive them), then report the error.
async fn finish_err(posted: Vec<Posted>, e: TransportError) -> Result<VerbResults> {
    drop(posted);
    Err(e)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::task::Wake;

    #[derive(Default)]
    struct Wakes(AtomicUsize);

    impl Wake for Wakes {
        fn wake(self: Arc<Self>) {
            self.0.fetch_add(1, Ordering::Relaxed);
        }
    }

    impl Wakes {
        fn count(&self) -> usize {
            self.0.load(Ordering::Relaxed)
        }
    }

    /// Branch i76: a progress call that did something wakes the batches
    /// waiting for verbs (no callback tells them), not the callers waiting
    /// for a reply that has not come (the reply handler wakes its own);
    /// those are woken only when `RECHECK` is due. (Before, every progress
    /// call that did anything woke every waiting caller: with 8 RPCs in
    /// flight, 8 polls per reply.)
    #[test]
    fn progress_wakes_waiting_batches_but_not_callers_whose_reply_has_not_come() {
        let c =
            crate::UcxCluster::new(crate::UcxConfig::shm_loopback(b"wakes".to_vec()), NodeId(1))
                .unwrap();
        let ep = UcxEndpoint::new(c.inner.clone(), NodeId(1)).unwrap();
        let s = &ep.state;
        let (caller, batch) = (Arc::new(Wakes::default()), Arc::new(Wakes::default()));
        s.rpcs.borrow_mut().insert(
            1,
            Slot {
                is_rpc: true,
                waker: Some(Waker::from(caller.clone())),
                ..Slot::default()
            },
        );
        s.waiters.borrow_mut().push(Waker::from(batch.clone()));
        // No re-check due.
        s.last_wake.set(Instant::now() + Duration::from_secs(3600));
        s.after_progress();
        assert_eq!(batch.count(), 1, "the batch is woken");
        assert_eq!(caller.count(), 0, "the caller waits for its reply");
        assert!(s.rpcs.borrow()[&1].waker.is_some());
        // A re-check is due: everyone looks again.
        s.waiters.borrow_mut().push(Waker::from(batch.clone()));
        s.last_wake.set(Instant::now() - RECHECK);
        s.after_progress();
        assert_eq!((batch.count(), caller.count()), (2, 1));
        assert!(s.rpcs.borrow()[&1].waker.is_none());
    }

    /// Every round trip yields at least once: a call whose reply came
    /// before its first poll (another task drove the worker) returns
    /// `Pending` once (waking itself) before it is ready; one whose reply
    /// has not come waits at its first poll (branch i76: no unconditional
    /// `yield_now` first).
    #[test]
    fn a_call_yields_once_even_when_its_reply_came_before_its_first_poll() {
        use dmkv_transport::{NodeHost, RpcContext, ServiceError};
        let config = || crate::UcxConfig::shm_loopback(b"yield-once".to_vec());
        let sc = crate::UcxCluster::new(config(), NodeId(100)).unwrap();
        let node = sc
            .serve(NodeId(0), "127.0.0.1:0".parse().unwrap(), 1)
            .unwrap();
        let echo = node
            .services()
            .register(
                "echo",
                Arc::new(|_: &RpcContext, r: &[u8]| Ok::<_, ServiceError>(r.to_vec())),
            )
            .unwrap();
        let cc = crate::UcxCluster::new(config(), NodeId(60)).unwrap();
        cc.connect(node.listen_addr()).unwrap();
        let ep = UcxEndpoint::new(cc.inner.clone(), NodeId(60)).unwrap();
        let s = ep.state.clone();
        let wakes = Arc::new(Wakes::default());
        let waker = Waker::from(wakes.clone());
        let mut cx = std::task::Context::from_waker(&waker);
        let deadline = Instant::now() + Duration::from_secs(20);
        for early in [false, true, false, true] {
            let mut call = ep.call(NodeId(0), echo, vec![7]);
            let rid = s.next_rid.get() - 1;
            if early {
                while s.rpcs.borrow()[&rid].rpc.is_none() {
                    assert!(Instant::now() < deadline, "no reply");
                    s.worker.progress();
                }
            }
            let woken = wakes.count();
            assert!(
                std::pin::Pin::new(&mut call).poll(&mut cx).is_pending(),
                "the first poll never completes the call (reply there: {early})"
            );
            assert_eq!(
                wakes.count() - woken,
                usize::from(early),
                "woken at once iff the reply is there"
            );
            let reply = loop {
                assert!(Instant::now() < deadline, "no reply");
                s.worker.progress();
                if let Poll::Ready(r) = std::pin::Pin::new(&mut call).poll(&mut cx) {
                    break r.unwrap();
                }
            };
            assert_eq!(reply.result.unwrap(), vec![7]);
        }
    }
}
