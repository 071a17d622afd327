//! The cluster as one process sees it: its UCX context, the nodes it serves,
//! and its control connections to the nodes it talks to.

use crate::client::UcxEndpoint;
use crate::control::{self, HandshakeError};
use crate::ffi::Context;
use crate::server::UcxNode;
use crossbeam_channel::Sender;
use dmkv_transport::{Endpoint, Fabric, NodeId, Result, TransportError, WireReader, WireWriter};
use parking_lot::{Mutex, RwLock};
use std::collections::{HashMap, HashSet};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// How one-sided verbs travel to a node.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum VerbPath {
    /// Direct word-by-word access where the transport maps the node's region
    /// into this process (shared memory); else `ucp_get/put/atomic_op_nbx`
    /// if this host has RDMA devices (InfiniBand/RoCE) and `UCX_TLS` does
    /// not exclude them; else messages served by the node's progress thread.
    Auto,
    /// Always `ucp_get/put/atomic_op_nbx`, whatever the transport (over TCP
    /// that is UCX's own emulation; see docs/ucx.md for its failure mode).
    Ucx,
    /// Always messages served by the node's progress thread.
    Messages,
}

/// Whether this host has RDMA devices that `tls` (UCX_TLS) allows.
fn native_rma(tls: Option<&str>) -> bool {
    let devices = std::fs::read_dir("/sys/class/infiniband")
        .map(|d| d.count() > 0)
        .unwrap_or(false);
    let env = std::env::var("UCX_TLS").ok();
    let tls = tls.or(env.as_deref()).unwrap_or("all");
    let allowed = tls.split(',').any(|t| {
        let t = t.trim().trim_start_matches('^');
        t == "all" || t == "ib" || t.starts_with("rc") || t.starts_with("dc")
    }) && !tls.starts_with('^');
    devices && allowed
}

/// How a process uses UCX.
#[derive(Debug, Clone)]
pub struct UcxConfig {
    /// The cluster secret every node and client must present.
    pub secret: Vec<u8>,
    /// `UCX_TLS`, e.g. `tcp` or `tcp,sm` or `rc,sm,tcp`; `None` leaves UCX's
    /// environment or default. Keep `tcp` for connection set-up.
    pub tls: Option<String>,
    /// `UCX_NET_DEVICES`, e.g. `lo` or `mlx5_0:1`.
    pub net_devices: Option<String>,
    /// Further UCX settings (`("RNDV_THRESH", "inf")`, names without `UCX_`).
    pub settings: Vec<(String, String)>,
    /// How long a caller waits for an RPC reply.
    pub rpc_timeout: Duration,
    /// How one-sided verbs travel (see [`VerbPath`]).
    pub verbs: VerbPath,
    /// How long to wait for a control connection to a node.
    pub connect_timeout: Duration,
}

impl UcxConfig {
    /// Defaults: UCX decides transports from its environment.
    pub fn new(secret: impl Into<Vec<u8>>) -> UcxConfig {
        UcxConfig {
            secret: secret.into(),
            tls: None,
            net_devices: None,
            settings: Vec::new(),
            rpc_timeout: Duration::from_secs(30),
            verbs: VerbPath::Auto,
            connect_timeout: Duration::from_secs(10),
        }
    }

    /// TCP only, on the loopback device (tests).
    pub fn tcp_loopback(secret: impl Into<Vec<u8>>) -> UcxConfig {
        UcxConfig {
            tls: Some("tcp".into()),
            net_devices: Some("lo".into()),
            ..UcxConfig::new(secret)
        }
    }

    /// Shared memory for data, TCP on loopback for set-up (tests).
    pub fn shm_loopback(secret: impl Into<Vec<u8>>) -> UcxConfig {
        UcxConfig {
            tls: Some("sm,tcp".into()),
            net_devices: Some("lo".into()),
            ..UcxConfig::new(secret)
        }
    }
}

/// A control answer: its frame kind and the body after the request id.
type Answer = (u8, Vec<u8>);

/// A control connection to a serving node (see [`crate::control`]).
pub(crate) struct Peer {
    pub(crate) id: NodeId,
    pub(crate) addr: SocketAddr,
    stream: TcpStream,
    write_lock: Mutex<()>,
    pending: Mutex<HashMap<u64, Sender<Answer>>>,
    next_rid: AtomicU64,
    down: AtomicBool,
    /// Bumped on every invalidation (and when the node goes down).
    pub(crate) generation: AtomicU64,
    pub(crate) invalidated: RwLock<HashSet<u32>>,
}

impl Peer {
    pub(crate) fn is_down(&self) -> bool {
        self.down.load(Ordering::Acquire)
    }

    fn mark_down(&self) {
        self.down.store(true, Ordering::Release);
        self.generation.fetch_add(1, Ordering::AcqRel);
        self.pending.lock().clear();
    }

    /// Sends a one-way control frame.
    pub(crate) fn send(&self, kind: u8, body: &[u8]) {
        let _g = self.write_lock.lock();
        if control::write_frame(&self.stream, kind, body).is_err() {
            drop(_g);
            self.mark_down();
        }
    }

    /// Sends a request (`rid` first, then what `body` writes) and waits for
    /// the answer: `(kind, body after rid)`.
    pub(crate) fn request(
        &self,
        kind: u8,
        body: impl FnOnce(&mut WireWriter),
    ) -> Result<(u8, Vec<u8>)> {
        if self.is_down() {
            return Err(TransportError::NodeDown(self.id));
        }
        let rid = self.next_rid.fetch_add(1, Ordering::Relaxed);
        let (tx, rx) = crossbeam_channel::bounded(1);
        self.pending.lock().insert(rid, tx);
        let mut w = WireWriter::new();
        w.u64(rid);
        body(&mut w);
        self.send(kind, &w.finish());
        match rx.recv_timeout(control::HANDSHAKE_TIMEOUT) {
            Ok(answer) => Ok(answer),
            Err(crossbeam_channel::RecvTimeoutError::Disconnected) => {
                Err(TransportError::NodeDown(self.id))
            }
            Err(crossbeam_channel::RecvTimeoutError::Timeout) => {
                self.pending.lock().remove(&rid);
                Err(TransportError::Timeout { node: self.id })
            }
        }
    }

    fn read_loop(self: Arc<Self>) {
        let mut stream = &self.stream;
        while let Ok((kind, body)) = control::read_frame(stream) {
            match kind {
                control::INVALIDATE => {
                    let mut r = WireReader::new(&body);
                    let (Ok(seq), Ok(region)) = (r.u64(), r.u32()) else {
                        break;
                    };
                    self.invalidated.write().insert(region);
                    self.generation.fetch_add(1, Ordering::AcqRel);
                    let mut w = WireWriter::new();
                    w.u64(seq);
                    self.send(control::ACK, &w.finish());
                }
                _ => {
                    let mut r = WireReader::new(&body);
                    let Ok(rid) = r.u64() else { break };
                    let rest = body[8..].to_vec();
                    if let Some(tx) = self.pending.lock().remove(&rid) {
                        let _ = tx.send((kind, rest));
                    }
                }
            }
            stream = &self.stream;
        }
        self.mark_down();
    }
}

/// What this process's endpoints did, for tests and diagnostics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct UcxStats {
    /// Verbs executed directly on peer memory mapped into this process.
    pub direct_verbs: u64,
    /// Verbs posted through `ucp_get/put/atomic_op_nbx`.
    pub posted_verbs: u64,
    /// Verbs sent as messages to the node's progress thread.
    pub message_verbs: u64,
    /// Remote keys fetched over control connections.
    pub rkey_fetches: u64,
    /// Sessions opened (one per endpoint and node it talks to).
    pub sessions: u64,
    /// UCX endpoints this process's endpoints made to nodes' workers that
    /// go through shared memory only (a peer on this host; no UCX
    /// peer-failure handling, see `docs/ucx.md`).
    pub shm_endpoints: u64,
    /// UCX endpoints made with UCX's peer-failure handling (other hosts,
    /// or `UCX_TLS` without shared memory).
    pub checked_endpoints: u64,
}

#[derive(Default)]
pub(crate) struct StatCounters {
    pub(crate) direct_verbs: AtomicU64,
    pub(crate) posted_verbs: AtomicU64,
    pub(crate) message_verbs: AtomicU64,
    pub(crate) rkey_fetches: AtomicU64,
    pub(crate) sessions: AtomicU64,
    pub(crate) shm_endpoints: AtomicU64,
    pub(crate) checked_endpoints: AtomicU64,
}

pub(crate) struct ClusterInner {
    /// RDMA devices usable here (for [`VerbPath::Auto`]).
    pub(crate) native_rma: bool,
    pub(crate) stats: StatCounters,
    pub(crate) config: UcxConfig,
    pub(crate) ctx: Arc<Context>,
    pub(crate) local: NodeId,
    secret: Arc<[u8]>,
    peers: RwLock<HashMap<NodeId, Arc<Peer>>>,
    hosted: RwLock<HashMap<NodeId, Arc<UcxNode>>>,
    connecting: Mutex<()>,
}

impl ClusterInner {
    fn connect(&self, addr: impl ToSocketAddrs) -> Result<NodeId> {
        let addr = addr
            .to_socket_addrs()
            .map_err(|e| TransportError::Backend(format!("address: {e}")))?
            .next()
            .ok_or_else(|| TransportError::Backend("address resolves to nothing".into()))?;
        let _g = self.connecting.lock();
        let peer = self.open(addr)?;
        let id = peer.id;
        let mut peers = self.peers.write();
        if let Some(old) = peers.get(&id)
            && !old.is_down()
        {
            let _ = peer.stream.shutdown(Shutdown::Both);
            return Err(TransportError::Backend(format!(
                "{addr} serves node {id}, which {} already serves",
                old.addr
            )));
        }
        peers.insert(id, peer);
        Ok(id)
    }

    /// The control connection to `node`, connecting to nodes this process
    /// serves on first use.
    pub(crate) fn peer(&self, node: NodeId) -> Result<Arc<Peer>> {
        if let Some(p) = self.peers.read().get(&node) {
            return Ok(p.clone());
        }
        let _g = self.connecting.lock();
        if let Some(p) = self.peers.read().get(&node) {
            return Ok(p.clone());
        }
        let hosted = self.hosted.read().get(&node).map(|n| n.listen_addr());
        match hosted {
            Some(mut addr) => {
                if addr.ip().is_unspecified() {
                    addr.set_ip(std::net::Ipv4Addr::LOCALHOST.into());
                }
                let p = self.open(addr)?;
                if p.id != node {
                    return Err(TransportError::Backend(format!(
                        "node {node} answered as {}",
                        p.id
                    )));
                }
                self.peers.write().insert(node, p.clone());
                Ok(p)
            }
            None => Err(TransportError::UnknownNode(node)),
        }
    }

    fn open(&self, addr: SocketAddr) -> Result<Arc<Peer>> {
        let stream = TcpStream::connect_timeout(&addr, self.config.connect_timeout)
            .map_err(|e| TransportError::Backend(format!("connect to {addr}: {e}")))?;
        let _ = stream.set_nodelay(true);
        let welcome = control::client_handshake(&stream, &self.secret, self.local.0).map_err(
            |e| match e {
                HandshakeError::Refused(why) => {
                    TransportError::Backend(format!("{addr} refused us: {why}"))
                }
                HandshakeError::Io(e) => {
                    TransportError::Backend(format!("handshake with {addr}: {e}"))
                }
            },
        )?;
        let peer = Arc::new(Peer {
            id: NodeId(welcome.node),
            addr,
            stream,
            write_lock: Mutex::new(()),
            pending: Mutex::new(HashMap::new()),
            next_rid: AtomicU64::new(1),
            down: AtomicBool::new(false),
            generation: AtomicU64::new(0),
            invalidated: RwLock::new(HashSet::new()),
        });
        let p = peer.clone();
        std::thread::Builder::new()
            .name(format!("dmkv-ctl-{}", peer.id))
            .spawn(move || p.read_loop())
            .map_err(|e| TransportError::Backend(format!("spawn control reader: {e}")))?;
        Ok(peer)
    }
}

/// One process's part of a UCX cluster: it serves nodes ([`UcxCluster::serve`])
/// and connects to nodes served elsewhere ([`UcxCluster::connect`]); its
/// [`Fabric`] makes endpoints that reach all of them. Dropping it stops the
/// nodes it serves and closes its control connections.
pub struct UcxCluster {
    pub(crate) inner: Arc<ClusterInner>,
}

impl UcxCluster {
    /// A process that issues as node `local` (its compute identity).
    pub fn new(config: UcxConfig, local: NodeId) -> Result<UcxCluster> {
        if config.secret.is_empty() {
            return Err(TransportError::Backend(
                "the cluster secret must not be empty".into(),
            ));
        }
        let mut settings: Vec<(String, String)> = Vec::new();
        if let Some(t) = &config.tls {
            settings.push(("TLS".into(), t.clone()));
        }
        if let Some(d) = &config.net_devices {
            settings.push(("NET_DEVICES".into(), d.clone()));
        }
        settings.extend(config.settings.iter().cloned());
        let refs: Vec<(&str, &str)> = settings
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let ctx = Context::new(&refs, "dmkv")
            .map_err(|e| TransportError::Backend(format!("UCX context: {e}")))?;
        Ok(UcxCluster {
            inner: Arc::new(ClusterInner {
                native_rma: native_rma(config.tls.as_deref()),
                stats: StatCounters::default(),
                secret: config.secret.clone().into(),
                config,
                ctx,
                local,
                peers: RwLock::new(HashMap::new()),
                hosted: RwLock::new(HashMap::new()),
                connecting: Mutex::new(()),
            }),
        })
    }

    /// What this process's endpoints have done so far.
    pub fn stats(&self) -> UcxStats {
        let s = &self.inner.stats;
        UcxStats {
            direct_verbs: s.direct_verbs.load(Ordering::Relaxed),
            posted_verbs: s.posted_verbs.load(Ordering::Relaxed),
            message_verbs: s.message_verbs.load(Ordering::Relaxed),
            rkey_fetches: s.rkey_fetches.load(Ordering::Relaxed),
            sessions: s.sessions.load(Ordering::Relaxed),
            shm_endpoints: s.shm_endpoints.load(Ordering::Relaxed),
            checked_endpoints: s.checked_endpoints.load(Ordering::Relaxed),
        }
    }

    /// The node this process issues as.
    pub fn local_node(&self) -> NodeId {
        self.inner.local
    }

    /// Serves node `id` here: control connections on `listen` (port 0 picks
    /// one; see [`UcxNode::listen_addr`]), RPCs on `handler_threads` threads.
    pub fn serve(
        &self,
        id: NodeId,
        listen: SocketAddr,
        handler_threads: usize,
    ) -> Result<Arc<UcxNode>> {
        if self.inner.hosted.read().contains_key(&id) || self.inner.peers.read().contains_key(&id) {
            return Err(TransportError::Backend(format!("node {id} already exists")));
        }
        let node = UcxNode::start(
            self.inner.ctx.clone(),
            Arc::downgrade(&self.inner),
            self.inner.secret.clone(),
            id,
            listen,
            handler_threads,
        )?;
        self.inner.hosted.write().insert(id, node.clone());
        Ok(node)
    }

    /// Connects to the node serving at `addr` (authenticating with the
    /// cluster secret) and returns its id.
    pub fn connect(&self, addr: impl ToSocketAddrs) -> Result<NodeId> {
        self.inner.connect(addr)
    }

    /// Makes sure node `node`, serving at `addr`, is reachable from this
    /// process (connecting unless it is served here or already connected),
    /// through a handle that does not keep the cluster alive: memory nodes
    /// learn their peers this way when an engine is installed (engines
    /// whose memory nodes talk to each other, such as Outback's replicas).
    pub fn peer_linker(&self) -> PeerLinker {
        PeerLinker(Arc::downgrade(&self.inner))
    }
    /// The fabric endpoints of this process come from.
    pub fn fabric(&self) -> Arc<dyn Fabric> {
        fabric_of(self.inner.clone())
    }

    /// A node served by this process.
    pub fn node(&self, id: NodeId) -> Option<Arc<UcxNode>> {
        self.inner.hosted.read().get(&id).cloned()
    }

    /// Whether this process has seen `node` go down.
    pub fn is_down(&self, node: NodeId) -> bool {
        self.inner
            .peers
            .read()
            .get(&node)
            .is_some_and(|p| p.is_down())
    }

    /// Stops serving `node` here, as a crash would: its clients (in this
    /// process too) see it go down. Waits until this process has noticed.
    pub fn crash(&self, node: NodeId) {
        if let Some(n) = self.inner.hosted.read().get(&node).cloned() {
            n.shutdown();
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(p) = self.inner.peers.read().get(&node).cloned() {
            if p.is_down() || Instant::now() > deadline {
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
    }
}

impl Drop for UcxCluster {
    fn drop(&mut self) {
        for p in self.inner.peers.read().values() {
            let _ = p.stream.shutdown(Shutdown::Both);
        }
        let nodes: Vec<_> = self.inner.hosted.read().values().cloned().collect();
        for n in nodes {
            n.shutdown();
        }
    }
}

struct UcxFabric {
    inner: Arc<ClusterInner>,
}

pub(crate) fn fabric_of(inner: Arc<ClusterInner>) -> Arc<dyn Fabric> {
    Arc::new(UcxFabric { inner })
}

impl Fabric for UcxFabric {
    fn name(&self) -> &'static str {
        "ucx"
    }

    fn endpoint(&self, node: NodeId) -> Result<Endpoint> {
        if node != self.inner.local && !self.inner.hosted.read().contains_key(&node) {
            return Err(TransportError::UnknownNode(node));
        }
        Ok(Endpoint::new(Box::new(UcxEndpoint::new(
            self.inner.clone(),
            node,
        )?)))
    }
}

/// See [`UcxCluster::peer_linker`].
#[derive(Clone)]
pub struct PeerLinker(std::sync::Weak<ClusterInner>);

impl PeerLinker {
    pub fn link(&self, node: NodeId, addr: &str) -> Result<()> {
        let inner = self
            .0
            .upgrade()
            .ok_or_else(|| TransportError::Backend("the cluster is shutting down".into()))?;
        if inner.hosted.read().contains_key(&node) {
            return Ok(());
        }
        if let Some(p) = inner.peers.read().get(&node)
            && !p.is_down()
        {
            return Ok(());
        }
        let id = inner.connect(addr)?;
        if id != node {
            return Err(TransportError::Backend(format!(
                "{addr} answered as node {id}, not {node}"
            )));
        }
        Ok(())
    }
}
