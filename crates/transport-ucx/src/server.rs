//! A node this process serves over UCX.
//!
//! Threads of a serving node:
//!
//! - the **progress thread** owns the node's UCX worker. It drives UCX (which
//!   over TCP executes the emulated one-sided verbs of clients here, on this
//!   thread), receives RPC requests as active messages and hands them to the
//!   handler threads, and sends their replies. When nothing happens for
//!   [`SPIN_BEFORE_SLEEP`] it arms the worker's event fd and sleeps in
//!   `poll`, so its CPU time (reported in [`UcxNode::progress_cpu_ns`]) is
//!   what the node really spent moving data for clients;
//! - **handler threads** (the node's configured number, 1 by default) run
//!   the services through [`ServiceTable::dispatch`];
//! - the **control listener** accepts TCP connections and runs one thread per
//!   client process for the control protocol ([`crate::control`]): the
//!   secret handshake, sessions, remote keys, invalidation and liveness.

use crate::cluster::ClusterInner;
use crate::control::{self, HandshakeError};
use crate::ffi::{self, Context, Ep, MappedMemory, Op, Worker};
use crossbeam_channel::{Receiver, Sender};
use dmkv_transport::{
    AccessKey, Fabric, NodeHost, NodeId, RegionId, RegionMem, RemoteRegion, Result, RpcContext,
    ServiceId, ServiceTable, TransportError, WireReader, WireWriter,
};
use parking_lot::{Condvar, Mutex, RwLock};
use std::collections::{HashMap, HashSet};
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
/// before it blocks (first a short spin, then yielding its core between
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

enum Cmd {
    OpenSession {
        session: u32,
        token: u64,
        address: Vec<u8>,
        done: Sender<std::result::Result<(), String>>,
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

/// One client process's control connection.
struct ServerConn {
    stream: TcpStream,
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
    next_region: AtomicU32,
    handler_threads: usize,
    progress_cpu_ns: Arc<AtomicU64>,
    cmd_tx: Sender<Cmd>,
    wake: UnixStream,
    /// Set by the progress thread while it sleeps (or is about to) in
    /// `poll`: only then does a command need a byte on `wake`.
    sleeping: Arc<AtomicBool>,
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
    /// Queues a command for the progress thread, writing to its wake-up
    /// socket (a system call) only if it sleeps. Invariant (with the
    /// progress thread's sleep): it sets `sleeping`, then checks the queue;
    /// this sends, then checks `sleeping`, each with a `SeqCst` fence in
    /// between, so either it sees the command or this sees it sleeping.
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

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
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
        let (wake, wake_rx) = UnixStream::pair()
            .map_err(|e| TransportError::Backend(format!("wake-up socket: {e}")))?;
        wake.set_nonblocking(true).expect("nonblocking wake socket");
        wake_rx
            .set_nonblocking(true)
            .expect("nonblocking wake socket");
        let (cmd_tx, cmd_rx) = crossbeam_channel::unbounded::<Cmd>();
        let (job_tx, job_rx) = crossbeam_channel::unbounded::<Job>();
        let progress_cpu_ns = Arc::new(AtomicU64::new(0));
        let sleeping = Arc::new(AtomicBool::new(false));
        let regions: Regions = Arc::default();

        // The progress thread makes the worker (it is used only there) and
        // reports its address.
        let (addr_tx, addr_rx) = crossbeam_channel::bounded(1);
        let progress = {
            let ctx = ctx.clone();
            let cmd_tx = cmd_tx.clone();
            let cpu = progress_cpu_ns.clone();
            let regions = regions.clone();
            let sleeping = sleeping.clone();
            std::thread::Builder::new()
                .name(format!("dmkv-{id}-progress"))
                .spawn(move || {
                    progress_thread(
                        ctx,
                        cmd_rx,
                        cmd_tx,
                        job_tx,
                        wake_rx,
                        cpu,
                        handler_threads,
                        addr_tx,
                        regions,
                        sleeping,
                    )
                })
                .map_err(|e| TransportError::Backend(format!("spawn progress thread: {e}")))?
        };
        let worker_address = addr_rx
            .recv()
            .map_err(|_| TransportError::Backend("the progress thread died".into()))?
            .map_err(|e| TransportError::Backend(format!("UCX worker: {e}")))?;

        let inner = Arc::new(NodeInner {
            id,
            ctx,
            cluster,
            secret,
            services: ServiceTable::new(),
            regions,
            next_region: AtomicU32::new(0),
            handler_threads,
            progress_cpu_ns,
            cmd_tx,
            wake,
            sleeping,
            worker_address,
            listen_addr,
            conns: Mutex::new(HashMap::new()),
            next_conn: AtomicU64::new(1),
            next_session: AtomicU32::new(1),
            invalidate_seq: AtomicU64::new(1),
            stopped: AtomicBool::new(false),
            threads: Mutex::new(vec![progress]),
            pool_limit: AtomicU64::new(u64::MAX),
            registered: AtomicU64::new(0),
        });
        for h in 0..handler_threads {
            let node = inner.clone();
            let rx = job_rx.clone();
            let t = std::thread::Builder::new()
                .name(format!("dmkv-{id}-h{h}"))
                .spawn(move || handler_thread(node, rx))
                .map_err(|e| TransportError::Backend(format!("spawn handler thread: {e}")))?;
            inner.threads.lock().push(t);
        }
        drop(job_rx);
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

    /// CPU time the progress thread has used so far (driving UCX: emulated
    /// one-sided verbs over TCP, moving RPC messages).
    pub fn progress_cpu_ns(&self) -> u64 {
        self.inner.progress_cpu_ns.load(Ordering::Relaxed)
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
        inner.send_cmd(Cmd::Stop);
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

fn handler_thread(node: Arc<NodeInner>, rx: Receiver<Job>) {
    while let Some(job) = dmkv_transport::local::recv_polling(&rx, HANDLER_POLL) {
        if node.is_stopped() {
            break;
        }
        let ctx = RpcContext {
            caller: job.caller,
            node: node.id,
        };
        // The reply goes out whenever the service produces it (at once, or
        // later from another thread for a deferred service).
        let n = node.clone();
        let (session, rid) = (job.session, job.rid);
        node.services
            .dispatch(&ctx, job.service, &job.payload, move |reply| {
                n.send_cmd(Cmd::Reply {
                    session,
                    rid,
                    reply: reply.encode(),
                });
            });
    }
}

struct Session {
    ep: Ep,
}

#[allow(clippy::too_many_arguments)]
fn progress_thread(
    ctx: Arc<Context>,
    cmd_rx: Receiver<Cmd>,
    cmd_tx: Sender<Cmd>,
    job_tx: Sender<Job>,
    mut wake_rx: UnixStream,
    cpu: Arc<AtomicU64>,
    handler_threads: usize,
    addr_tx: Sender<std::result::Result<Vec<u8>, ffi::UcxError>>,
    regions: Regions,
    sleeping: Arc<AtomicBool>,
) {
    let worker = match Worker::new(&ctx).and_then(|w| w.address().map(|a| (w, a))) {
        Ok((w, a)) => {
            let _ = addr_tx.send(Ok(a));
            w
        }
        Err(e) => {
            let _ = addr_tx.send(Err(e));
            return;
        }
    };
    let tokens: Rc<std::cell::RefCell<HashMap<u32, u64>>> = Rc::default();
    {
        let tokens = tokens.clone();
        let job_tx = job_tx.clone();
        let cmd_tx = cmd_tx.clone();
        let handler = move |header: &[u8], data: &[u8]| {
            let mut r = WireReader::new(header);
            let parsed = (|| {
                Ok::<_, dmkv_transport::WireError>((
                    r.u32()?,
                    r.u64()?,
                    r.u64()?,
                    r.u32()?,
                    r.u16()?,
                ))
            })();
            // Requests from unknown sessions or with a wrong token are
            // dropped unanswered: only authenticated clients are served.
            let Ok((session, token, rid, service, caller)) = parsed else {
                return;
            };
            if tokens.borrow().get(&session) != Some(&token) {
                return;
            }
            if handler_threads == 0 {
                let reply = dmkv_transport::Reply {
                    result: Err(dmkv_transport::ServiceError::failed(
                        "the node has no handler threads and serves no RPCs",
                    )),
                    server_cpu_ns: 0,
                };
                let _ = cmd_tx.send(Cmd::Reply {
                    session,
                    rid,
                    reply: reply.encode(),
                });
                return;
            }
            let _ = job_tx.send(Job {
                session,
                rid,
                service: ServiceId(service),
                caller: NodeId(caller),
                payload: data.to_vec(),
            });
        };
        if worker
            .set_am_handler(AM_REQUEST, Box::new(handler))
            .is_err()
        {
            return;
        }
    }
    {
        // Verbs carried as messages: checked and executed here, on the
        // progress thread, as UCX's own emulation would be.
        let tokens = tokens.clone();
        let cmd_tx = cmd_tx.clone();
        let handler = move |header: &[u8], data: &[u8]| {
            let mut r = WireReader::new(header);
            let parsed = (|| Ok::<_, dmkv_transport::WireError>((r.u32()?, r.u64()?, r.u64()?)))();
            let Ok((session, token, rid)) = parsed else {
                return;
            };
            if tokens.borrow().get(&session) != Some(&token) {
                return;
            }
            let reply = crate::verbs::serve(&regions.read(), data);
            let _ = cmd_tx.send(Cmd::Reply {
                session,
                rid,
                reply,
            });
        };
        if worker.set_am_handler(AM_VERBS, Box::new(handler)).is_err() {
            return;
        }
    }
    drop(job_tx);
    let efd = worker.event_fd().ok();
    let mut sessions: HashMap<u32, Session> = HashMap::new();
    let mut inflight: Vec<Op> = Vec::new();
    let mut last_event = Instant::now();
    let mut iterations: u64 = 0;
    let mut stop = false;
    while !stop {
        let mut busy = worker.progress();
        while let Ok(cmd) = cmd_rx.try_recv() {
            busy = true;
            match cmd {
                Cmd::OpenSession {
                    session,
                    token,
                    address,
                    done,
                } => match worker.connect(&address) {
                    Ok(ep) => {
                        tokens.borrow_mut().insert(session, token);
                        sessions.insert(session, Session { ep });
                        let _ = done.send(Ok(()));
                    }
                    Err(e) => {
                        let _ = done.send(Err(e.to_string()));
                    }
                },
                Cmd::CloseSession(s) => {
                    tokens.borrow_mut().remove(&s);
                    sessions.remove(&s);
                }
                Cmd::Reply {
                    session,
                    rid,
                    reply,
                } => {
                    if let Some(s) = sessions.get(&session)
                        && s.ep.failed().is_none()
                        && let Ok(op) = s.ep.am_send(AM_REPLY, rid.to_le_bytes().to_vec(), reply)
                    {
                        inflight.push(op);
                    }
                }
                Cmd::Stop => stop = true,
            }
        }
        inflight.retain(|op| op.poll().is_none());
        iterations += 1;
        if iterations.is_multiple_of(4096) {
            cpu.store(dmkv_transport::thread_cpu_ns(), Ordering::Relaxed);
            // Forget sessions whose peer UCX reported gone.
            let dead: Vec<u32> = sessions
                .iter()
                .filter(|(_, s)| s.ep.failed().is_some())
                .map(|(id, _)| *id)
                .collect();
            for id in dead {
                tokens.borrow_mut().remove(&id);
                sessions.remove(&id);
            }
        }
        if busy {
            last_event = Instant::now();
            continue;
        }
        if last_event.elapsed() < SPIN_BEFORE_SLEEP || !inflight.is_empty() {
            continue;
        }
        // Sleep until UCX or a handler has something for us.
        cpu.store(dmkv_transport::thread_cpu_ns(), Ordering::Relaxed);
        // See `NodeInner::send_cmd` for the handshake.
        sleeping.store(true, Ordering::SeqCst);
        std::sync::atomic::fence(Ordering::SeqCst);
        let mut sink = [0u8; 64];
        while matches!(wake_rx.read(&mut sink), Ok(n) if n > 0) {}
        if !cmd_rx.is_empty() {
            sleeping.store(false, Ordering::SeqCst);
            continue;
        }
        match efd {
            Some(efd) if worker.arm() => {
                ffi::poll_readable(&[efd, wake_rx.as_raw_fd()], 100);
            }
            Some(_) => {}
            None => {
                ffi::poll_readable(&[wake_rx.as_raw_fd()], 1);
            }
        }
        sleeping.store(false, Ordering::SeqCst);
        last_event = Instant::now();
    }
    // Close every endpoint and finish sends before the worker goes.
    drop(inflight);
    sessions.clear();
    tokens.borrow_mut().clear();
    cpu.store(dmkv_transport::thread_cpu_ns(), Ordering::Relaxed);
    drop(worker);
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
    let client =
        match control::server_handshake(&stream, &node.secret, node.id.0, &node.worker_address) {
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
        stream: s2,
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
        node.send_cmd(Cmd::CloseSession(s));
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
            let session = node.next_session.fetch_add(1, Ordering::Relaxed);
            let token: u64 = rand::random();
            let (tx, rx) = crossbeam_channel::bounded(1);
            node.send_cmd(Cmd::OpenSession {
                session,
                token,
                address,
                done: tx,
            });
            let mut w = WireWriter::new();
            w.u64(rid);
            match rx.recv_timeout(control::HANDSHAKE_TIMEOUT) {
                Ok(Ok(())) => {
                    conn.sessions.lock().insert(session);
                    w.u32(session).u64(token);
                    control::write_frame(&conn.stream, control::SESSION, &w.finish())
                        .map_err(|_| ())
                }
                Ok(Err(e)) => {
                    w.u8(control::DENIED_OTHER).str(&e);
                    control::write_frame(&conn.stream, control::DENIED, &w.finish()).map_err(|_| ())
                }
                Err(_) => {
                    w.u8(control::DENIED_OTHER).str("the node is shutting down");
                    control::write_frame(&conn.stream, control::DENIED, &w.finish()).map_err(|_| ())
                }
            }
        }
        control::CLOSE_SESSION => {
            let s = r.u32().map_err(|_| ())?;
            if conn.sessions.lock().remove(&s) {
                node.send_cmd(Cmd::CloseSession(s));
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
