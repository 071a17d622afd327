//! Which UCX endpoints may go through shared memory.
//!
//! UCX 1.13 gives an endpoint created with peer-failure error handling
//! (`UCP_ERR_HANDLING_MODE_PEER`) only transports that detect a dead peer,
//! and its shared-memory transports (`sysv`, `posix`, `cma`) are not among
//! them: such an endpoint between two processes of one host goes over
//! `tcp` on loopback (seen with `ucp_ep_print_info`: `lane[0]: tcp/lo am
//! keepalive wireup`). So an endpoint to a peer on this host, when this
//! process's UCX has a shared-memory message transport, is created without
//! UCX's error handling ([`ErrorMode::None`]) and checked to use shared
//! memory only; a dead peer is then learnt from dmkv's control connection,
//! which ends when the peer's process does (`docs/ucx.md`, *Shared memory
//! and peer failure*). Every other endpoint keeps peer-failure handling.

use crate::ffi::{Context, Ep, ErrorMode, UcxError, Worker};
use std::sync::OnceLock;
use std::sync::atomic::{AtomicBool, Ordering};

/// UCX transports that move data through memory shared between processes
/// of one host (or within one process: `self`).
const SHM_TRANSPORTS: &[&str] = &["self", "sysv", "posix", "cma", "knem", "xpmem"];
/// Those of them that carry active messages (what RPCs need).
const SHM_MESSAGES: &[&str] = &["sysv", "posix", "xpmem"];

/// This host as shared memory sees it: the kernel's boot id, and the
/// identities of `/dev/shm` and of this process's IPC and PID namespaces
/// (UCX's `posix` transport opens a peer's segment through `/proc/PID`,
/// `sysv` through System V IPC). Two processes with equal ids share memory
/// the way UCX needs; empty if any part is unknown (then never equal).
pub(crate) fn host_id() -> &'static [u8] {
    static ID: OnceLock<Vec<u8>> = OnceLock::new();
    ID.get_or_init(|| {
        use std::os::unix::fs::MetadataExt;
        let Ok(boot) = std::fs::read_to_string("/proc/sys/kernel/random/boot_id") else {
            return Vec::new();
        };
        let mut id = boot.trim().as_bytes().to_vec();
        for path in ["/dev/shm", "/proc/self/ns/ipc", "/proc/self/ns/pid"] {
            match std::fs::metadata(path) {
                Ok(m) => id.extend_from_slice(format!("|{}:{}", m.dev(), m.ino()).as_bytes()),
                Err(_) => return Vec::new(),
            }
        }
        id
    })
}

/// Whether a peer with `peer_host` (its [`host_id`]) should be reached over
/// shared memory from this process's context `ctx`: same host, and UCX
/// opened a shared-memory message transport (`UCX_TLS` allows it).
pub(crate) fn same_host(ctx: &Context, peer_host: &[u8]) -> bool {
    let mine = host_id();
    !mine.is_empty()
        && mine == peer_host
        && ctx
            .transports()
            .iter()
            .any(|t| SHM_MESSAGES.contains(&t.as_str()))
}

/// Connects `worker` to the worker at `address` on a peer whose host id is
/// `peer_host`: over shared memory only, without UCX's error handling, if
/// the peer is on this host and UCX chose only shared-memory lanes; else
/// with peer-failure handling. Returns the endpoint and whether it is the
/// shared-memory kind.
pub(crate) fn connect(
    worker: &Worker,
    address: &[u8],
    peer_host: &[u8],
) -> Result<(Ep, bool), UcxError> {
    if same_host(worker.context(), peer_host) {
        let ep = worker.connect(address, ErrorMode::None)?;
        let lanes = ep.lane_transports();
        if !lanes.is_empty() && lanes.iter().all(|t| SHM_TRANSPORTS.contains(&t.as_str())) {
            return Ok((ep, true));
        }
        // Not expected (the host ids say the peer shares our memory): fall
        // back to an endpoint that detects a dead peer, and say so once.
        static WARNED: AtomicBool = AtomicBool::new(false);
        if !WARNED.swap(true, Ordering::Relaxed) {
            eprintln!(
                "dmkv ucx: a peer on this host was given lanes {lanes:?}, not only shared \
                 memory; using UCX's peer-failure handling (tcp) for such endpoints"
            );
        }
        drop(ep);
    }
    Ok((worker.connect(address, ErrorMode::Peer)?, false))
}
