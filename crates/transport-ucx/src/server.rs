//! A node this process serves over UCX.
//!
//! Threads of a serving node:
//!
//! - **handler threads** (the node's configured number, 1 by default) each
//!   own a UCX worker that clients send their RPCs to: the thread drives its
//!   worker, runs each request's service inline, found in the thread's own
//!   copy of the handler table ([`ServiceTable::dispatch_cached`]),
//!   as soon as the worker delivers it, and sends the reply from its own
//!   worker. An RPC crosses no other thread (a service that defers its reply
//!   hands it back through the loop's command queue). After its last event a
//!   handler thread polls for [`HANDLER_POLL`] (yielding its core between
//!   polls from the first empty one), then sleeps on its worker's event fd;
//! - the **progress thread** owns the node's main UCX worker. It drives UCX
//!   (which over TCP executes the emulated one-sided verbs of clients here,
//!   on this thread), executes verbs carried as messages (the TCP path) and
//!   wires up sessions. When nothing happens for [`SPIN_BEFORE_SLEEP`] it
//!   arms the worker's event fd and sleeps in `poll`;
//! - the **control listener** accepts TCP connections and runs one thread per
//!   client process for the control protocol ([`crate::control`]): the
//!   secret handshake, sessions, remote keys, invalidation and liveness.
//!
//! Invariant 4 (numbering as in `docs/ucx.md`): a client process that
//! reaches the node over shared memory sends into workers that the serving
//! loops made for it alone (one per loop: the loop's spare, made in advance
//! and taken on the process's first session; destroyed when its control
//! connection ends), never into a worker other processes send to. One gap:
//! a loop whose spare is not ready yet (two processes' first sessions in
//! quick succession, or a failed worker creation) serves that process on
//! its shared worker, as it serves remote clients. UCX's shared-memory transports deliver through one
//! FIFO per receiving worker, written by every sender; a sender killed
//! between reserving an element and marking it written blocks that FIFO
//! for good, so it may only ever block its own workers (`docs/ucx.md`, *A
//! killed client's FIFO slot*; test `dead_client`). Clients reached over
//! TCP or RDMA, whose connections are their own, share each loop's worker.
//!
//! [`UcxNode::progress_cpu_ns`] reports what the progress thread and the
//! handler threads spend outside the services (receiving, sending, polling);
//! the services' own CPU is charged to each RPC's caller.

use crate::cluster::ClusterInner;
use crate::control::{self, HandshakeError};
use crate::ffi::{self, Context, Ep, MappedMemory, Op, Worker};
use crossbeam_channel::{Receiver, Sender};
use dmkv_transport::{
    AccessKey, Fabric, HandlerCache, LentReply, NodeHost, NodeId, RegionId, RegionMem,
    RemoteRegion, Result, RpcContext, ServiceId, ServiceTable, TransportError, WireReader,
    WireWriter,
};
use parking_lot::{Condvar, Mutex, RwLock};
use std::cell::RefCell;
use std::collections::{BTreeMap, HashMap, HashSet, VecDeque};
use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::os::unix::net::UnixStream;
use std::rc::Rc;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Weak};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Active-message ids.
pub(crate) const AM_REQUEST: u32 = 1;
pub(crate) const AM_REPLY: u32 = 2;
/// One-sided verbs carried as a message and executed by the progress thread
/// (the TCP path; see `docs/ucx.md`). Same header as a request without the
/// service and caller; the reply comes back as `AM_REPLY`.
pub(crate) const AM_VERBS: u32 = 3;
pub(crate) const VERBS_HEADER: usize = 4 + 8 + 8;

/// RPC request header: `session u32 | token u64 | request id u64 |
/// service u32 | caller u16`.
pub(crate) const REQUEST_HEADER: usize = 4 + 8 + 8 + 4 + 2;

/// How long the progress thread spins after the last event before it sleeps.
pub const SPIN_BEFORE_SLEEP: Duration = Duration::from_micros(200);
/// How long a handler thread keeps polling its queue after its last request
/// before it blocks (yielding its core between
/// polls), so that a request arriving in a busy stretch does not pay a
/// futex wake-up of a parked thread.
pub const HANDLER_POLL: Duration = Duration::from_millis(1);
/// How long a withdrawn region that a client process held stays mapped after
/// that process disconnects (UCX may still be delivering its last verbs).
pub const RELEASE_GRACE: Duration = Duration::from_secs(2);
/// How long deregistration waits for client processes to acknowledge.
pub const INVALIDATE_TIMEOUT: Duration = Duration::from_secs(5);

pub(crate) struct RegionEntry {
    pub(crate) key: AccessKey,
    mem: Arc<MappedMemory>,
    pub(crate) view: Arc<RegionMem>,
}

type Regions = Arc<RwLock<HashMap<u32, RegionEntry>>>;

/// Every open session's token, shared by the node's serving loops. The
/// control thread enters a session's token before it answers the client,
/// so a request never reaches a loop before its session's token does.
type Tokens = Arc<RwLock<rustc_hash::FxHashMap<u32, u64>>>;

enum Cmd {
    /// Give the loop's spare worker (whose address the sender took from
    /// `LoopShared::spare`) to client process `client` (a control
    /// connection from this host, served over shared memory; invariant 4),
    /// and make the next spare.
    AddClient(u64),
    /// Drop client process `client`'s worker, with any session still on it
    /// (its process is gone).
    RemoveClient(u64),
    /// Connect back to a client worker for `session` (its token is in the
    /// node's table already), from `client`'s own worker if it has one,
    /// else from the loop's shared worker. The progress loop reports the
    /// outcome; the handler loops' endpoints are made without anyone
    /// waiting for them.
    OpenSession {
        session: u32,
        client: Option<u64>,
        address: Vec<u8>,
        /// The client's host id ([`crate::shm::host_id`]).
        host: Vec<u8>,
        done: Option<Sender<std::result::Result<(), String>>>,
    },
    CloseSession(u32),
    Reply {
        session: u32,
        rid: u64,
        reply: Vec<u8>,
    },
    Stop,
}

struct Job {
    session: u32,
    rid: u64,
    service: ServiceId,
    caller: NodeId,
    payload: Vec<u8>,
}

/// What a serving loop (the progress thread's or a handler thread's) shares
/// with the threads that send it commands.
pub(crate) struct LoopShared {
    cmd_tx: Sender<Cmd>,
    wake: UnixStream,
    /// Set by the loop's thread while it sleeps (or is about to) in `poll`:
    /// only then does a command need a byte on `wake`.
    sleeping: AtomicBool,
    /// The loop thread's CPU time, sampled every few thousand iterations
    /// and before every sleep.
    cpu_ns: AtomicU64,
    /// CPU charged to the RPCs this loop's services handled (the sum of
    /// their replies' `server_cpu_ns`): the part of `cpu_ns` that callers
    /// already see as `memnode_cpu_ns`.
    charged_ns: AtomicU64,
    /// Wall time of the loop's iterations that did something (received,
    /// ran a service, sent, executed verbs): its work, services included.
    /// These iterations never yield, so their wall time is their CPU time
    /// unless the thread lost its core in one (then it is too high).
    busy_ns: AtomicU64,
    /// The address of a worker the loop made in advance (with its message
    /// handlers) for the next client process on this host; taken by that
    /// process's control thread, which then sends [`Cmd::AddClient`]. Made
    /// in advance because the control thread must not wait for the loop: a
    /// service running on a handler loop may itself open a session with
    /// this node (ROLEX's memory nodes do), and the loop runs nothing else
    /// meanwhile.
    spare: Mutex<Option<Vec<u8>>>,
}

impl LoopShared {
    fn new() -> Result<(Arc<LoopShared>, Receiver<Cmd>, UnixStream)> {
        let (wake, wake_rx) = UnixStream::pair()
            .map_err(|e| TransportError::Backend(format!("wake-up socket: {e}")))?;
        wake.set_nonblocking(true).expect("nonblocking wake socket");
        wake_rx
            .set_nonblocking(true)
            .expect("nonblocking wake socket");
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded::<Cmd>();
        Ok((
            Arc::new(LoopShared {
                cmd_tx,
                wake,
                sleeping: AtomicBool::new(false),
                cpu_ns: AtomicU64::new(0),
                charged_ns: AtomicU64::new(0),
                busy_ns: AtomicU64::new(0),
                spare: Mutex::new(None),
            }),
            cmd_rx,
            wake_rx,
        ))
    }

    /// Queues a command for the loop, writing to its wake-up socket (a
    /// system call) only if it sleeps. Invariant (with the loop's sleep): it
    /// sets `sleeping`, then checks the queue; this sends, then checks
    /// `sleeping`, each with a `SeqCst` fence in between, so either it sees
    /// the command or this sees it sleeping. (A reply a service sends on
    /// the loop's own thread does not come here: `crate::replies`.)
    fn send_cmd(&self, cmd: Cmd) {
        if self.cmd_tx.send(cmd).is_ok() {
            std::sync::atomic::fence(Ordering::SeqCst);
            if self.sleeping.load(Ordering::SeqCst) {
                // Non-blocking: if the socket is full a wake-up is pending
                // anyway.
                let _ = (&self.wake).write(&[1]);
            }
        }
    }

    /// CPU the loop spent outside the services it ran.
    fn overhead_ns(&self) -> u64 {
        self.cpu_ns
            .load(Ordering::Relaxed)
            .saturating_sub(self.charged_ns.load(Ordering::Relaxed))
    }

    /// The part of [`LoopShared::overhead_ns`] spent working (not polling
    /// idle): busy iterations less the services' charge, at most the whole.
    fn busy_overhead_ns(&self) -> u64 {
        self.busy_ns
            .load(Ordering::Relaxed)
            .saturating_sub(self.charged_ns.load(Ordering::Relaxed))
            .min(self.overhead_ns())
    }
}

/// The workers a client process on this host reaches the node's loops
/// through (invariant 4): their addresses, as its sessions are told them.
#[derive(Clone)]
struct ClientWorkers {
    /// The progress loop's worker for this client.
    progress: Vec<u8>,
    /// Each handler loop's worker for this client, in handler order.
    handlers: Vec<Vec<u8>>,
}

/// One client process's control connection.
struct ServerConn {
    /// The node's number for this connection (the key of `conns`, and of
    /// the loops' per-client workers).
    id: u64,
    stream: TcpStream,
    /// Made when its first session over shared memory opens; dropped (in
    /// every loop) when the connection ends.
    workers: Mutex<Option<ClientWorkers>>,
    /// Regions whose rkey this process was given: kept mapped until it goes.
    held: Mutex<HashMap<u32, Arc<MappedMemory>>>,
    sessions: Mutex<HashSet<u32>>,
    acked: Mutex<u64>,
    ack_cv: Condvar,
}

pub(crate) struct NodeInner {
    pub(crate) id: NodeId,
    ctx: Arc<Context>,
    cluster: Weak<ClusterInner>,
    secret: Arc<[u8]>,
    services: ServiceTable,
    regions: Regions,
    tokens: Tokens,
    next_region: AtomicU32,
    handler_threads: usize,
    /// The progress thread's loop (verbs messages, session wire-up).
    progress: Arc<LoopShared>,
    /// Each handler thread's loop: it owns a UCX worker of its own that
    /// clients send their RPCs to, and serves them inline.
    handlers: Vec<Arc<LoopShared>>,
    /// The handler threads' worker addresses, in order (sent to a client
    /// with its session).
    handler_addresses: Vec<Vec<u8>>,
    pub(crate) worker_address: Vec<u8>,
    pub(crate) listen_addr: SocketAddr,
    conns: Mutex<HashMap<u64, Arc<ServerConn>>>,
    next_conn: AtomicU64,
    next_session: AtomicU32,
    invalidate_seq: AtomicU64,
    stopped: AtomicBool,
    threads: Mutex<Vec<JoinHandle<()>>>,
    /// Most bytes of regions registered at once (`u64::MAX`: no limit).
    pool_limit: AtomicU64,
    registered: AtomicU64,
}

impl NodeInner {
    /// Every serving loop: the progress thread's, then the handlers'.
    fn loops(&self) -> impl Iterator<Item = &Arc<LoopShared>> {
        std::iter::once(&self.progress).chain(&self.handlers)
    }

    /// Forgets a session: its token, and every loop's endpoint back to it.
    fn close_session(&self, session: u32) {
        self.tokens.write().remove(&session);
        for l in self.loops() {
            l.send_cmd(Cmd::CloseSession(session));
        }
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Drops client process `client`'s workers in every loop.
    fn remove_client(&self, client: u64) {
        for l in self.loops() {
            l.send_cmd(Cmd::RemoveClient(client));
        }
    }

    /// The workers client process `conn` (on this host, over shared memory)
    /// reaches the loops through: each loop's spare, taken on its first
    /// session without waiting for the loop. A loop that has no spare ready
    /// (it is still making the next one) serves this process on its shared
    /// worker, as it serves remote clients.
    fn client_workers(&self, conn: &ServerConn) -> ClientWorkers {
        let mut workers = conn.workers.lock();
        if let Some(w) = &*workers {
            return w.clone();
        }
        let mut addresses: Vec<Vec<u8>> = self
            .loops()
            .zip(std::iter::once(&self.worker_address).chain(&self.handler_addresses))
            .map(|(l, shared)| match l.spare.lock().take() {
                Some(a) => {
                    l.send_cmd(Cmd::AddClient(conn.id));
                    a
                }
                None => shared.clone(),
            })
            .collect();
        let progress = addresses.remove(0);
        let w = ClientWorkers {
            progress,
            handlers: addresses,
        };
        *workers = Some(w.clone());
        w
    }
}

/// A node served over UCX by this process.
pub struct UcxNode {
    pub(crate) inner: Arc<NodeInner>,
}

impl UcxNode {
    /// Starts serving node `id` on `listen` (control connections), with
    /// `handler_threads` RPC handler threads.
    pub(crate) fn start(
        ctx: Arc<Context>,
        cluster: Weak<ClusterInner>,
        secret: Arc<[u8]>,
        id: NodeId,
        listen: SocketAddr,
        handler_threads: usize,
    ) -> Result<Arc<UcxNode>> {
        let listener = TcpListener::bind(listen)
            .map_err(|e| TransportError::Backend(format!("listen on {listen}: {e}")))?;
        let listen_addr = listener
            .local_addr()
            .map_err(|e| TransportError::Backend(format!("listener address: {e}")))?;
        let regions: Regions = Arc::default();
        let tokens: Tokens = Arc::default();
        let mut threads = Vec::new();

        // Each serving loop's thread makes its worker (it is used only
        // there) and reports its address.
        let (progress, cmd_rx, wake_rx) = LoopShared::new()?;
        let (addr_tx, addr_rx) = crossbeam_channel::bounded(1);
        {
            let ctx = ctx.clone();
            let regions = regions.clone();
            let tokens = tokens.clone();
            let shared = progress.clone();
            threads.push(
                std::thread::Builder::new()
                    .name(format!("dmkv-{id}-progress"))
                    .spawn(move || {
                        progress_thread(
                            ctx,
                            shared,
                            cmd_rx,
                            wake_rx,
                            handler_threads,
                            addr_tx,
                            regions,
                            tokens,
                        )
                    })
                    .map_err(|e| TransportError::Backend(format!("spawn progress thread: {e}")))?,
            );
        }
        let worker_address = addr_rx
            .recv()
            .map_err(|_| TransportError::Backend("the progress thread died".into()))?
            .map_err(|e| TransportError::Backend(format!("UCX worker: {e}")))?;

        // Handler threads get the node once it exists (they need its
        // services); until then they only make their workers.
        let mut handlers = Vec::new();
        let mut handler_addresses = Vec::new();
        let mut node_txs = Vec::new();
        for h in 0..handler_threads {
            let (shared, cmd_rx, wake_rx) = LoopShared::new()?;
            let (addr_tx, addr_rx) = crossbeam_channel::bounded(1);
            let (node_tx, node_rx) = crossbeam_channel::bounded::<Arc<NodeInner>>(1);
            let ctx = ctx.clone();
            let s = shared.clone();
            let tokens = tokens.clone();
            let t = std::thread::Builder::new()
                .name(format!("dmkv-{id}-h{h}"))
                .spawn(move || handler_thread(ctx, s, cmd_rx, wake_rx, addr_tx, node_rx, tokens))
                .map_err(|e| TransportError::Backend(format!("spawn handler thread: {e}")))?;
            threads.push(t);
            let address = addr_rx
                .recv()
                .map_err(|_| TransportError::Backend("a handler thread died".into()))?
                .map_err(|e| TransportError::Backend(format!("UCX worker: {e}")))?;
            handlers.push(shared);
            handler_addresses.push(address);
            node_txs.push(node_tx);
        }

        let inner = Arc::new(NodeInner {
            id,
            ctx,
            cluster,
            secret,
            services: ServiceTable::new(),
            regions,
            tokens,
            next_region: AtomicU32::new(0),
            handler_threads,
            progress,
            handlers,
            handler_addresses,
            worker_address,
            listen_addr,
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            next_session: AtomicU32::new(1),
            invalidate_seq: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
            threads: Mutex::new(threads),
            pool_limit: AtomicU64::new(u64::MAX),
            registered: AtomicU64::new(0),
        });
        for tx in node_txs {
            let _ = tx.send(inner.clone());
        }
        let node = inner.clone();
        let t = std::thread::Builder::new()
            .name(format!("dmkv-{id}-listen"))
            .spawn(move || accept_loop(node, listener))
            .map_err(|e| TransportError::Backend(format!("spawn listener thread: {e}")))?;
        inner.threads.lock().push(t);
        Ok(Arc::new(UcxNode { inner }))
    }

    /// The address control connections reach this node at.
    pub fn listen_addr(&self) -> SocketAddr {
        self.inner.listen_addr
    }

    /// CPU time this node's serving loops have used so far outside the
    /// services they ran: the progress thread (emulated one-sided verbs
    /// over TCP, session wire-up) and the handler threads' UCX work
    /// (receiving requests, sending replies), idle polling included (see
    /// [`UcxNode::progress_idle_ns`]). What the services themselves cost is
    /// charged to each RPC's caller (`memnode_cpu_ns`), not counted here.
    pub fn progress_cpu_ns(&self) -> u64 {
        self.inner.loops().map(|l| l.overhead_ns()).sum()
    }

    /// The part of [`UcxNode::progress_cpu_ns`] spent polling with nothing
    /// to do: the whole less the loops' work outside services, which is
    /// measured as the wall time of iterations that did something (so idle
    /// polling is if anything underestimated).
    pub fn progress_idle_ns(&self) -> u64 {
        self.inner
            .loops()
            .map(|l| l.overhead_ns() - l.busy_overhead_ns())
            .sum()
    }

    /// Limits the bytes of regions registered at once (`None`: no limit);
    /// a registration beyond it fails.
    pub fn set_pool_limit(&self, bytes: Option<u64>) {
        self.inner
            .pool_limit
            .store(bytes.unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Client processes connected now.
    pub fn connected_processes(&self) -> usize {
        self.inner.conns.lock().len()
    }

    /// Stops serving: the listener, every control connection (clients see
    /// the node as down), the progress and handler threads. Regions are
    /// withdrawn. Idempotent.
    pub fn shutdown(&self) {
        let inner = &self.inner;
        if inner.stopped.swap(true, Ordering::AcqRel) {
            return;
        }
        // Unblock the listener's accept.
        let mut wake_addr = inner.listen_addr;
        if wake_addr.ip().is_unspecified() {
            wake_addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
        }
        let _ = TcpStream::connect_timeout(&wake_addr, Duration::from_secs(1));
        for c in inner.conns.lock().values() {
            let _ = c.stream.shutdown(Shutdown::Both);
        }
        for l in inner.loops() {
            l.send_cmd(Cmd::Stop);
        }
        inner.regions.write().clear();
        let threads: Vec<_> = inner.threads.lock().drain(..).collect();
        let me = std::thread::current().id();
        for t in threads {
            if t.thread().id() != me {
                let _ = t.join();
            }
        }
    }
}

impl NodeHost for UcxNode {
    fn id(&self) -> NodeId {
        self.inner.id
    }

    fn register_region(&self, len: usize) -> Result<(RemoteRegion, Arc<RegionMem>)> {
        let inner = &self.inner;
        if inner.is_stopped() {
            return Err(TransportError::NodeDown(inner.id));
        }
        let len = len
            .max(dmkv_transport::region::REGION_ALIGN)
            .div_ceil(dmkv_transport::region::REGION_ALIGN)
            * dmkv_transport::region::REGION_ALIGN;
        let limit = inner.pool_limit.load(Ordering::Relaxed);
        let before = inner.registered.fetch_add(len as u64, Ordering::AcqRel);
        if before.saturating_add(len as u64) > limit {
            inner.registered.fetch_sub(len as u64, Ordering::AcqRel);
            return Err(TransportError::Backend(format!(
                "region of {len} bytes exceeds node {}'s pool ({before} of {limit} bytes in use)",
                inner.id
            )));
        }
        let mem = match inner.ctx.map_memory(len) {
            Ok(m) => Arc::new(m),
            Err(e) => {
                inner.registered.fetch_sub(len as u64, Ordering::AcqRel);
                return Err(TransportError::Backend(format!(
                    "region of {len} bytes: {e}"
                )));
            }
        };
        let key = AccessKey(rand::random());
        let id = inner.next_region.fetch_add(1, Ordering::Relaxed);
        let view = Arc::new(mem.region_mem());
        inner.regions.write().insert(
            id,
            RegionEntry {
                key,
                mem,
                view: view.clone(),
            },
        );
        Ok((
            RemoteRegion {
                node: inner.id,
                id: RegionId(id),
                key,
                len: len as u64,
            },
            view,
        ))
    }

    fn deregister_region(&self, id: RegionId) {
        let inner = &self.inner;
        let Some(gone) = inner.regions.write().remove(&id.0) else {
            return;
        };
        inner
            .registered
            .fetch_sub(gone.mem.len() as u64, Ordering::AcqRel);
        drop(gone);
        // Tell every client process that holds the rkey, and wait until each
        // has acknowledged (it then refuses new accesses with the old key).
        let holders: Vec<Arc<ServerConn>> = inner
            .conns
            .lock()
            .values()
            .filter(|c| c.held.lock().contains_key(&id.0))
            .cloned()
            .collect();
        let mut waits = Vec::new();
        for c in holders {
            let seq = inner.invalidate_seq.fetch_add(1, Ordering::Relaxed);
            let mut w = WireWriter::new();
            w.u64(seq).u32(id.0);
            if control::write_frame(&c.stream, control::INVALIDATE, &w.finish()).is_ok() {
                waits.push((c, seq));
            }
        }
        let deadline = Instant::now() + INVALIDATE_TIMEOUT;
        for (c, seq) in waits {
            let mut acked = c.acked.lock();
            while *acked < seq {
                if c.ack_cv.wait_until(&mut acked, deadline).timed_out() {
                    break;
                }
            }
        }
    }

    fn services(&self) -> &ServiceTable {
        &self.inner.services
    }

    fn fabric(&self) -> Arc<dyn Fabric> {
        let cluster = self
            .inner
            .cluster
            .upgrade()
            .expect("the cluster outlives its nodes");
        crate::cluster::fabric_of(cluster)
    }

    fn handler_threads(&self) -> usize {
        self.inner.handler_threads
    }

    fn progress_cpu_ns(&self) -> u64 {
        UcxNode::progress_cpu_ns(self)
    }
}

/// Makes a serving loop's worker and reports its address (or the error).
fn make_worker(
    ctx: &Arc<Context>,
    addr_tx: &Sender<std::result::Result<Vec<u8>, ffi::UcxError>>,
) -> Option<Worker> {
    match Worker::new(ctx).and_then(|w| w.address().map(|a| (w, a))) {
        Ok((w, a)) => {
            let _ = addr_tx.send(Ok(a));
            Some(w)
        }
        Err(e) => {
            let _ = addr_tx.send(Err(e));
            None
        }
    }
}

/// Parses an RPC request header: `(session, rid, service, caller)`, or
/// `None` for a malformed header, an unknown session or a wrong token
/// (such requests are dropped unanswered: only authenticated clients are
/// served).
fn parse_request(header: &[u8], tokens: &Tokens) -> Option<(u32, u64, u32, u16)> {
    let mut r = WireReader::new(header);
    let parsed = (|| {
        Ok::<_, dmkv_transport::WireError>((r.u32()?, r.u64()?, r.u64()?, r.u32()?, r.u16()?))
    })();
    let (session, token, rid, service, caller) = parsed.ok()?;
    (tokens.read().get(&session) == Some(&token)).then_some((session, rid, service, caller))
}

/// A handler thread: it owns a UCX worker that clients send their RPCs to
/// (one endpoint per client session, made when the session opens), runs
/// each request's service inline on this thread as soon as the worker
/// delivers it, and sends the reply from here. A service that defers its
/// reply sends it later from another thread through this loop's command
/// queue. No request or reply passes through another thread.
fn handler_thread(
    ctx: Arc<Context>,
    shared: Arc<LoopShared>,
    cmd_rx: Receiver<Cmd>,
    wake_rx: UnixStream,
    addr_tx: Sender<std::result::Result<Vec<u8>, ffi::UcxError>>,
    node_rx: Receiver<Arc<NodeInner>>,
    tokens: Tokens,
) {
    let Some(worker) = make_worker(&ctx, &addr_tx) else {
        return;
    };
    let Ok(node) = node_rx.recv() else {
        return;
    };
    // Requests the worker delivered during its last progress call. The
    // active-message callback only queues them: services run outside UCX's
    // progress, so that a reply they send at once goes out on a worker that
    // is not inside a callback.
    let jobs: Rc<RefCell<Jobs>> = Rc::default();
    // Every worker of this loop (its shared one and each client process's)
    // queues requests for the same loop.
    let install = |w: &Worker| {
        let tokens = tokens.clone();
        let jobs = jobs.clone();
        let handler = move |header: &[u8], data: &[u8]| {
            let Some((session, rid, service, caller)) = parse_request(header, &tokens) else {
                return;
            };
            let mut jobs = jobs.borrow_mut();
            // The request is copied (UCX's buffer is gone after the
            // callback) into the buffer of a request already served.
            let mut payload = jobs.free.pop().unwrap_or_default();
            payload.clear();
            payload.extend_from_slice(data);
            jobs.queue.push_back(Job {
                session,
                rid,
                service: ServiceId(service),
                caller: NodeId(caller),
                payload,
            });
        };
        w.set_am_handler(AM_REQUEST, Box::new(handler)).is_ok()
    };
    if !install(&worker) {
        return;
    }
    let idle = Idle {
        poll: HANDLER_POLL,
        yields: true,
    };
    // This thread's copy of the node's handler table (invariants G1-G3 of
    // docs/transport.md, "Handler lookup"): a request finds its handler
    // with one acquire load and an index, no lock and no reference count.
    // Refreshed at every poll when the table changed, released before the
    // thread sleeps (G3). `out` is the buffer replies are built in, lent
    // to the service and copied into the encoded reply.
    let mut cache = HandlerCache::new();
    let mut out = Vec::new();
    // Replies this thread's services send at once go to its own queue
    // (invariant D, `crate::replies`), not through the command queue.
    let owner = Arc::as_ptr(&shared) as usize;
    crate::replies::adopt(owner);
    serve_loop(&worker, &install, &shared, &cmd_rx, wake_rx, idle, |turn| {
        if turn == Turn::Sleep {
            cache.release();
            return false;
        }
        node.services.refresh(&mut cache);
        let mut served = false;
        loop {
            let Some(job) = jobs.borrow_mut().queue.pop_front() else {
                break;
            };
            served = true;
            if !node.is_stopped() {
                serve_job(&node, &shared, owner, &mut cache, &mut out, &job);
            }
            let mut jobs = jobs.borrow_mut();
            if jobs.free.len() < KEEP_REQUEST_BUFFERS {
                jobs.free.push(job.payload);
            }
        }
        served
    });
}

/// What a handler loop's message callback queued: the requests, and the
/// buffers of requests already served, to copy the next ones into.
#[derive(Default)]
struct Jobs {
    queue: VecDeque<Job>,
    free: Vec<Vec<u8>>,
}

/// Request buffers a handler loop keeps for later requests at most.
const KEEP_REQUEST_BUFFERS: usize = 64;

/// Runs one request's service on its handler loop's thread. The reply goes
/// out whenever the service produces it: at once (queued on this thread,
/// `crate::replies`, and sent by this loop after the service returns), or
/// later from another thread (deferred: through the loop's command queue).
fn serve_job(
    node: &NodeInner,
    shared: &Arc<LoopShared>,
    owner: usize,
    cache: &mut HandlerCache,
    out: &mut Vec<u8>,
    job: &Job,
) {
    let ctx = RpcContext {
        caller: job.caller,
        node: node.id,
    };
    let s = shared.clone();
    let (session, rid) = (job.session, job.rid);
    node.services.dispatch_cached(
        cache,
        &ctx,
        job.service,
        &job.payload,
        out,
        move |server_cpu_ns: u64, result: LentReply<'_>| {
            s.charged_ns.fetch_add(server_cpu_ns, Ordering::Relaxed);
            if !crate::replies::offer(owner, session, rid, server_cpu_ns, &result) {
                let mut reply = Vec::new();
                crate::replies::encode_reply(&mut reply, server_cpu_ns, &result);
                s.send_cmd(Cmd::Reply {
                    session,
                    rid,
                    reply,
                });
            }
        },
    );
}

/// The progress thread: verbs carried as messages (the TCP path), and an
/// error for an RPC sent to this worker instead of a handler thread's.
#[allow(clippy::too_many_arguments)] // one per thing the thread owns
fn progress_thread(
    ctx: Arc<Context>,
    shared: Arc<LoopShared>,
    cmd_rx: Receiver<Cmd>,
    wake_rx: UnixStream,
    handler_threads: usize,
    addr_tx: Sender<std::result::Result<Vec<u8>, ffi::UcxError>>,
    regions: Regions,
    tokens: Tokens,
) {
    let Some(worker) = make_worker(&ctx, &addr_tx) else {
        return;
    };
    // Installs the loop's message handlers on one of its workers (its
    // shared one and each client process's).
    let install = |w: &Worker| {
        // Clients send RPCs to the handler threads' workers; a node without
        // handler threads has none to give them, and its RPCs land here.
        let rpc = {
            let tokens = tokens.clone();
            let shared = shared.clone();
            move |header: &[u8], _data: &[u8]| {
                let Some((session, rid, _, _)) = parse_request(header, &tokens) else {
                    return;
                };
                let why = if handler_threads == 0 {
                    "the node has no handler threads and serves no RPCs".to_string()
                } else {
                    format!("RPCs go to the node's {handler_threads} handler workers")
                };
                let reply = dmkv_transport::Reply {
                    result: Err(dmkv_transport::ServiceError::failed(why)),
                    server_cpu_ns: 0,
                };
                shared.send_cmd(Cmd::Reply {
                    session,
                    rid,
                    reply: reply.encode(),
                });
            }
        };
        // Verbs carried as messages: checked and executed here, on the
        // progress thread, as UCX's own emulation would be.
        let verbs = {
            let tokens = tokens.clone();
            let shared = shared.clone();
            let regions = regions.clone();
            move |header: &[u8], data: &[u8]| {
                let mut r = WireReader::new(header);
                let parsed =
                    (|| Ok::<_, dmkv_transport::WireError>((r.u32()?, r.u64()?, r.u64()?)))();
                let Ok((session, token, rid)) = parsed else {
                    return;
                };
                if tokens.read().get(&session) != Some(&token) {
                    return;
                }
                let reply = crate::verbs::serve(&regions.read(), data);
                shared.send_cmd(Cmd::Reply {
                    session,
                    rid,
                    reply,
                });
            }
        };
        w.set_am_handler(AM_REQUEST, Box::new(rpc)).is_ok()
            && w.set_am_handler(AM_VERBS, Box::new(verbs)).is_ok()
    };
    if !install(&worker) {
        return;
    }
    let idle = Idle {
        poll: SPIN_BEFORE_SLEEP,
        yields: false,
    };
    serve_loop(&worker, &install, &shared, &cmd_rx, wake_rx, idle, |_| {
        false
    });
}

/// Why a serving loop calls its `work` (see [`serve_loop`]).
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
enum Turn {
    /// After a progress call: serve what the workers delivered.
    Poll,
    /// The loop is about to sleep: let go of what must not be kept while
    /// asleep (a handler thread's copy of the handler table, G3).
    Sleep,
}

/// How a serving loop waits when it has nothing to do.
struct Idle {
    /// How long it keeps polling after its last event before it sleeps.
    poll: Duration,
    /// Whether it yields its core between polls (after [`IDLE_SPINS`]
    /// polls), so that on a small machine the threads it waits for run.
    yields: bool,
}

/// Polls a loop makes without yielding before it yields between polls:
/// none (see the client's `SPINS` for what was measured).
const IDLE_SPINS: u32 = 0;

/// A loop's sessions: each one's endpoint back to its client, by session id
/// (looked up per reply; sessions are numbered by the node, so FxHash).
type Sessions = rustc_hash::FxHashMap<u32, SessionEp>;

/// Sends a reply (`AM_REPLY`, `header` the request id) to `session`'s
/// client, without copying it where UCX sends it at once; one UCX could not
/// send at once is kept in `inflight` until it completes. A reply to an
/// unknown session or a failed endpoint is dropped (its client is gone).
fn send_reply(
    sessions: &Sessions,
    inflight: &mut Vec<(u32, Op)>,
    session: u32,
    header: &[u8],
    data: &[u8],
) {
    if let Some(s) = sessions.get(&session)
        && s.ep.failed().is_none()
        && let Ok(Some(op)) = s.ep.am_send_from(AM_REPLY, header, data)
    {
        inflight.push((session, op));
    }
}

/// A worker a loop made for one client process (invariant 4).
struct ClientWorker {
    worker: Worker,
    efd: Option<i32>,
}

/// A session's endpoint back to its client, and the client process whose
/// own worker it was made from (`None`: the loop's shared worker).
struct SessionEp {
    ep: Ep,
    client: Option<u64>,
}

/// Runs a serving loop on `worker` until [`Cmd::Stop`]: drives UCX (that
/// worker and the loop's per-client workers, each given the loop's message
/// handlers by `install`), runs `work(Turn::Poll)` after every progress
/// call (a handler thread serves there the requests its workers delivered;
/// it says whether it ran any), carries out commands (client workers,
/// sessions, replies from other threads), then sends the replies the
/// services it ran queued on this thread (`crate::replies`). With nothing to do for `idle.poll` it calls
/// `work(Turn::Sleep)`, arms every worker's event fd and sleeps in `poll`
/// until UCX or a command wakes it.
fn serve_loop(
    worker: &Worker,
    install: &dyn Fn(&Worker) -> bool,
    shared: &LoopShared,
    cmd_rx: &Receiver<Cmd>,
    mut wake_rx: UnixStream,
    idle: Idle,
    mut work: impl FnMut(Turn) -> bool,
) {
    let efd = worker.event_fd().ok();
    // Ordered, so that every loop drives them in the same order.
    let mut clients: BTreeMap<u64, ClientWorker> = BTreeMap::new();
    let mut sessions: Sessions = Sessions::default();
    // Replies being sent, with their session.
    let mut inflight: Vec<(u32, Op)> = Vec::new();
    let mut last_event = Instant::now();
    // When a busy iteration ended: the next one starts then (one clock
    // read per busy iteration instead of two).
    let mut busy_until: Option<Instant> = None;
    let mut empty_polls: u32 = 0;
    let mut iterations: u64 = 0;
    // The worker the next client process on this host gets (see
    // `LoopShared::spare`), made whenever there is none.
    let mut spare: Option<Worker> = None;
    let mut stop = false;
    while !stop {
        if spare.is_none() {
            let made = Worker::new(worker.context())
                .and_then(|w| w.address().map(|a| (w, a)))
                .ok()
                .filter(|(w, _)| install(w));
            if let Some((w, a)) = made {
                spare = Some(w);
                *shared.spare.lock() = Some(a);
            }
        }
        let start = busy_until.take().unwrap_or_else(Instant::now);
        let mut busy = worker.progress();
        for c in clients.values() {
            busy |= c.worker.progress();
        }
        // Whether work ran services: only a service (run there, on this
        // thread) queues replies in `crate::replies`.
        let served = work(Turn::Poll);
        busy |= served;
        // (`is_empty` first: cheaper than `try_recv` on an empty queue.)
        while !cmd_rx.is_empty()
            && let Ok(cmd) = cmd_rx.try_recv()
        {
            busy = true;
            match cmd {
                Cmd::AddClient(client) => {
                    if let Some(w) = spare.take() {
                        let efd = w.event_fd().ok();
                        clients.insert(client, ClientWorker { worker: w, efd });
                    }
                }
                Cmd::RemoveClient(client) => {
                    // Its sessions are normally closed already; any left
                    // go with the worker their endpoints belong to.
                    let left: Vec<u32> = sessions
                        .iter()
                        .filter(|(_, s)| s.client == Some(client))
                        .map(|(id, _)| *id)
                        .collect();
                    for s in left {
                        if let Some(gone) = sessions.remove(&s) {
                            gone.ep.abandon();
                        }
                        inflight.retain(|(sess, _)| *sess != s);
                    }
                    // The worker is destroyed once its last endpoint and
                    // operation are (they hold it).
                    clients.remove(&client);
                }
                Cmd::OpenSession {
                    session,
                    client,
                    address,
                    host,
                    done,
                } => {
                    // The client process's own worker if this loop gave it
                    // one (its `AddClient` came first), else the shared one.
                    let client = client.filter(|c| clients.contains_key(c));
                    let from = client.map_or(worker, |c| &clients[&c].worker);
                    // Shared memory where the client is on this host.
                    let outcome = crate::shm::connect(from, &address, &host)
                        .map(|(ep, _)| {
                            sessions.insert(session, SessionEp { ep, client });
                        })
                        .map_err(|e| e.to_string());
                    if let Some(done) = done {
                        let _ = done.send(outcome);
                    }
                }
                Cmd::CloseSession(s) => {
                    // The client process may be gone, and a shared-memory
                    // endpoint would not say so: replies still in flight to
                    // it are leaked, not awaited (`Ep::abandon`).
                    if let Some(gone) = sessions.remove(&s) {
                        gone.ep.abandon();
                    }
                    inflight.retain(|(sess, _)| *sess != s);
                }
                Cmd::Reply {
                    session,
                    rid,
                    reply,
                } => {
                    send_reply(
                        &sessions,
                        &mut inflight,
                        session,
                        &rid.to_le_bytes(),
                        &reply,
                    );
                }
                Cmd::Stop => stop = true,
            }
        }
        // Replies the services run above sent at once (invariant D), after
        // the commands: a session's endpoint is opened by a command queued
        // before its client could send a request, so it is here by now. A
        // reply to a session this loop does not know (yet) goes through the
        // command queue instead, behind every command queued before it.
        // (An iteration that ran no service has none: no thread-local
        // access then.)
        busy |= served
            && crate::replies::drain(|q| {
                let (header, data) = q.message.split_at(crate::replies::HEADER);
                if sessions.contains_key(&q.session) {
                    send_reply(&sessions, &mut inflight, q.session, header, data);
                } else {
                    let rid = u64::from_le_bytes(header.try_into().expect("an 8-byte header"));
                    shared.send_cmd(Cmd::Reply {
                        session: q.session,
                        rid,
                        reply: data.to_vec(),
                    });
                }
            });
        if !inflight.is_empty() {
            inflight.retain(|(_, op)| op.poll().is_none());
        }
        iterations += 1;
        if iterations.is_multiple_of(4096) {
            shared
                .cpu_ns
                .store(dmkv_transport::thread_cpu_ns(), Ordering::Relaxed);
            // Drop endpoints whose peer UCX reported gone (the session's
            // token goes when its control connection ends).
            sessions.retain(|_, s| s.ep.failed().is_none());
        }
        if busy {
            last_event = Instant::now();
            busy_until = Some(last_event);
            shared.busy_ns.fetch_add(
                last_event.duration_since(start).as_nanos() as u64,
                Ordering::Relaxed,
            );
            empty_polls = 0;
            continue;
        }
        let now = start;
        if now - last_event < idle.poll || !inflight.is_empty() {
            empty_polls = empty_polls.saturating_add(1);
            if idle.yields && empty_polls > IDLE_SPINS {
                std::thread::yield_now();
            }
            continue;
        }
        // Sleep until UCX or another thread has something for us.
        work(Turn::Sleep);
        shared
            .cpu_ns
            .store(dmkv_transport::thread_cpu_ns(), Ordering::Relaxed);
        // See `LoopShared::send_cmd` for the handshake.
        shared.sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let mut sink = [0u8; 64];
        while matches!(wake_rx.read(&mut sink), Ok(n) if n > 0) {}
        if !cmd_rx.is_empty() || crate::replies::pending() {
            shared.sleeping.store(false, Ordering::SeqCst);
            continue;
        }
        // Every worker's event fd, armed (a worker with events pending
        // refuses: then progress again instead of sleeping).
        let mut fds = vec![wake_rx.as_raw_fd()];
        let mut all_fds = true;
        let mut armed = true;
        for (w, fd) in
            std::iter::once((worker, efd)).chain(clients.values().map(|c| (&c.worker, c.efd)))
        {
            match fd {
                Some(fd) => {
                    armed = armed && w.arm();
                    fds.push(fd);
                }
                None => all_fds = false,
            }
        }
        if armed {
            // Without an event fd for some worker, wake up often to drive it.
            ffi::poll_readable(&fds, if all_fds { 100 } else { 1 });
        }
        shared.sleeping.store(false, Ordering::SeqCst);
        empty_polls = 0;
        last_event = Instant::now();
    }
    // Close every endpoint and finish sends before the workers go (a send
    // to a client that stopped reading is leaked, not awaited).
    for s in sessions.values() {
        s.ep.abandon();
    }
    drop(inflight);
    sessions.clear();
    clients.clear();
    shared.spare.lock().take();
    drop(spare);
    shared
        .cpu_ns
        .store(dmkv_transport::thread_cpu_ns(), Ordering::Relaxed);
}

fn accept_loop(node: Arc<NodeInner>, listener: TcpListener) {
    for stream in listener.incoming() {
        if node.is_stopped() {
            break;
        }
        let Ok(stream) = stream else { continue };
        let _ = stream.set_nodelay(true);
        let n = node.clone();
        // A slow or hostile peer must not hold up the listener: each
        // connection gets its own thread (handshake, then its control loop).
        let _ = std::thread::Builder::new()
            .name(format!("dmkv-{}-ctl", node.id))
            .spawn(move || serve_conn(n, stream));
    }
}

fn serve_conn(node: Arc<NodeInner>, stream: TcpStream) {
    let client = match control::server_handshake(&stream, &node.secret, node.id.0) {
        Ok(c) => NodeId(c),
        Err(HandshakeError::Refused(why)) => {
            eprintln!(
                "dmkv node {}: refused a connection from {}: {why}",
                node.id,
                stream
                    .peer_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_else(|_| "?".into())
            );
            return;
        }
        Err(HandshakeError::Io(_)) => return,
    };
    let _ = client;
    if node.is_stopped() {
        return;
    }
    let conn_id = node.next_conn.fetch_add(1, Ordering::Relaxed);
    let Ok(s2) = stream.try_clone() else { return };
    let conn = Arc::new(ServerConn {
        id: conn_id,
        stream: s2,
        workers: Mutex::new(None),
        held: Mutex::new(HashMap::new()),
        sessions: Mutex::new(HashSet::new()),
        acked: Mutex::new(0),
        ack_cv: Condvar::new(),
    });
    node.conns.lock().insert(conn_id, conn.clone());
    if node.is_stopped() {
        // Raced with shutdown, which may not have seen this connection.
        let _ = stream.shutdown(Shutdown::Both);
    }
    while let Ok((kind, body)) = control::read_frame(&stream) {
        if handle_frame(&node, &conn, kind, &body).is_err() {
            break;
        }
    }
    // The client process is gone (or misbehaved): drop its sessions, and
    // release the regions it held after a grace period.
    let _ = stream.shutdown(Shutdown::Both);
    node.conns.lock().remove(&conn_id);
    for s in conn.sessions.lock().drain() {
        node.close_session(s);
    }
    // After its sessions (each loop takes commands in order): its workers,
    // with whatever a send killed midway left in their FIFOs.
    if conn.workers.lock().take().is_some() {
        node.remove_client(conn.id);
    }
    let held: Vec<Arc<MappedMemory>> = conn.held.lock().drain().map(|(_, m)| m).collect();
    if !held.is_empty() {
        let _ = std::thread::Builder::new()
            .name("dmkv-release".into())
            .spawn(move || {
                std::thread::sleep(RELEASE_GRACE);
                drop(held);
            });
    }
}

fn handle_frame(
    node: &Arc<NodeInner>,
    conn: &Arc<ServerConn>,
    kind: u8,
    body: &[u8],
) -> std::result::Result<(), ()> {
    let mut r = WireReader::new(body);
    match kind {
        control::OPEN_SESSION => {
            let rid = r.u64().map_err(|_| ())?;
            let address = r.bytes().map_err(|_| ())?.to_vec();
            let host = r.bytes().map_err(|_| ())?.to_vec();
            // A client on this host that shared memory reaches gets workers
            // of its own in every loop (invariant 4); others share the
            // loops' workers.
            let private =
                crate::shm::same_host(&node.ctx, &host).then(|| node.client_workers(conn));
            let client = private.as_ref().map(|_| conn.id);
            let session = node.next_session.fetch_add(1, Ordering::Relaxed);
            let token: u64 = rand::random();
            node.tokens.write().insert(session, token);
            // Every serving loop connects back to the client's worker: the
            // progress thread (verbs messages) and each handler thread (RPC
            // replies). A loop takes its commands in order, so a handler
            // loop has its endpoint before it sends a reply on it.
            let (tx, rx) = crossbeam_channel::bounded(1);
            node.progress.send_cmd(Cmd::OpenSession {
                session,
                client,
                address: address.clone(),
                host: host.clone(),
                done: Some(tx),
            });
            for l in &node.handlers {
                l.send_cmd(Cmd::OpenSession {
                    session,
                    client,
                    address: address.clone(),
                    host: host.clone(),
                    done: None,
                });
            }
            let outcome = match rx.recv_timeout(control::HANDSHAKE_TIMEOUT) {
                Ok(r) => r,
                Err(_) => Err("the node is shutting down".to_string()),
            };
            let mut w = WireWriter::new();
            w.u64(rid);
            match outcome {
                Ok(()) => {
                    conn.sessions.lock().insert(session);
                    let (progress, handlers) = match &private {
                        Some(p) => (&p.progress, &p.handlers),
                        None => (&node.worker_address, &node.handler_addresses),
                    };
                    w.u32(session).u64(token).u16(handlers.len() as u16);
                    for a in handlers {
                        w.bytes(a);
                    }
                    w.bytes(crate::shm::host_id()).bytes(progress);
                    control::write_frame(&conn.stream, control::SESSION, &w.finish())
                        .map_err(|_| ())
                }
                Err(e) => {
                    node.close_session(session);
                    w.u8(control::DENIED_OTHER).str(&e);
                    control::write_frame(&conn.stream, control::DENIED, &w.finish()).map_err(|_| ())
                }
            }
        }
        control::CLOSE_SESSION => {
            let s = r.u32().map_err(|_| ())?;
            if conn.sessions.lock().remove(&s) {
                node.close_session(s);
            }
            Ok(())
        }
        control::FETCH_RKEY => {
            let rid = r.u64().map_err(|_| ())?;
            let region = r.u32().map_err(|_| ())?;
            let key = r.u64().map_err(|_| ())?;
            let mut w = WireWriter::new();
            w.u64(rid);
            let found = node
                .regions
                .read()
                .get(&region)
                .map(|e| (e.key, e.mem.clone()));
            match found {
                None => {
                    w.u8(control::DENIED_NO_REGION).str("no such region");
                    control::write_frame(&conn.stream, control::DENIED, &w.finish())
                }
                Some((k, _)) if k.0 != key => {
                    w.u8(control::DENIED_WRONG_KEY).str("wrong access key");
                    control::write_frame(&conn.stream, control::DENIED, &w.finish())
                }
                Some((_, mem)) => {
                    conn.held.lock().insert(region, mem.clone());
                    // Deregistration removes the region first and then looks
                    // for holders: if it ran between our lookup and the insert
                    // above it did not see us, so look again.
                    if node.regions.read().contains_key(&region) {
                        w.u64(mem.remote_base())
                            .u64(mem.len() as u64)
                            .bytes(mem.packed_rkey());
                        control::write_frame(&conn.stream, control::RKEY, &w.finish())
                    } else {
                        w.u8(control::DENIED_NO_REGION).str("no such region");
                        control::write_frame(&conn.stream, control::DENIED, &w.finish())
                    }
                }
            }
            .map_err(|_| ())
        }
        control::ACK => {
            let seq = r.u64().map_err(|_| ())?;
            let mut a = conn.acked.lock();
            *a = (*a).max(seq);
            conn.ack_cv.notify_all();
            Ok(())
        }
        _ => Err(()),
    }
}
