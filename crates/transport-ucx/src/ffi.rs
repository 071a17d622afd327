//! The FFI leaf: every `unsafe` line of the crate is in this module.
//!
//! It wraps the handful of UCP calls dmkv uses in safe types whose ownership
//! mirrors UCP's rules:
//!
//! - [`Context`] (`ucp_context_h`): one per process, created with
//!   `mt_workers_shared` so that memory mapping and rkey packing may be called
//!   from any thread while workers run on theirs.
//! - [`MappedMemory`]: memory allocated *by UCX* (`ucp_mem_map` with
//!   `UCP_MEM_MAP_ALLOCATE`), zeroed, with its packed rkey. Pools allocated by
//!   UCX are what shared-memory transports can map into a peer.
//! - [`Worker`] (`ucp_worker_h`, thread mode SINGLE): used only on the thread
//!   that made it (it is `!Send`); it owns its active-message handlers.
//! - [`Ep`] (`ucp_ep_h`): an endpoint of a worker to a remote worker address,
//!   with peer-failure error handling; [`Rkey`] is a remote key unpacked on it.
//! - [`Op`]: one posted operation (get, put, CAS, FAA, flush, AM send) that
//!   owns every buffer UCP may touch until the operation completes; dropping
//!   an unfinished op drives the worker until it completes, so UCP never
//!   writes into freed memory.
//!
//! The `UCS_PTR_*` macros and the `ucp_init` / `ucp_dt_make_contig` inlines of
//! the C API are re-implemented here.

#![allow(unsafe_code)]

use std::cell::{Cell, RefCell};
use std::ffi::{CStr, CString, c_void};
use std::marker::PhantomData;
use std::ptr::NonNull;
use std::rc::Rc;
use std::sync::Arc;

#[allow(
    non_camel_case_types,
    non_upper_case_globals,
    non_snake_case,
    dead_code,
    unused_imports,
    clippy::all
)]
mod sys {
    include!(concat!(env!("OUT_DIR"), "/ucp_bindings.rs"));
}

use sys::ucs_status_t;

/// A failed UCP call.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UcxError {
    /// The `ucs_status_t` code (negative).
    pub status: i8,
    /// Which call failed.
    pub what: &'static str,
}

impl UcxError {
    fn new(status: ucs_status_t, what: &'static str) -> Self {
        UcxError {
            status: status.0,
            what,
        }
    }

    /// Whether the failure means the peer is gone or unreachable (the UCS
    /// "endpoint failure" and "link failure" ranges and a few others).
    pub fn is_peer_failure(&self) -> bool {
        let s = self.status as i32;
        (-89..=-80).contains(&s)
            || (-59..=-40).contains(&s)
            || s == ucs_status_t::UCS_ERR_CONNECTION_RESET.0 as i32
            || s == ucs_status_t::UCS_ERR_UNREACHABLE.0 as i32
            || s == ucs_status_t::UCS_ERR_CANCELED.0 as i32
            || s == ucs_status_t::UCS_ERR_TIMED_OUT.0 as i32
            || s == ucs_status_t::UCS_ERR_ENDPOINT_TIMEOUT.0 as i32
            || s == ucs_status_t::UCS_ERR_REJECTED.0 as i32
            || s == ucs_status_t::UCS_ERR_IO_ERROR.0 as i32
    }
}

impl std::fmt::Display for UcxError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} failed: {}", self.what, status_string(self.status))
    }
}

impl std::error::Error for UcxError {}

/// UCS's text for a status code.
pub fn status_string(status: i8) -> String {
    let Some(s) = status_from_i8(status) else {
        return format!("unknown status {status}");
    };
    // SAFETY: ucs_status_string returns a pointer to a static NUL-terminated
    // string for every status value (or "unknown error" text).
    let p = unsafe { sys::ucs_status_string(s) };
    if p.is_null() {
        return format!("status {status}");
    }
    // SAFETY: non-null, NUL-terminated, static (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// The `ucs_status_t` for a raw status. bindgen makes it a newtype over the
/// C enum's integer, so any value (even one UCX does not define) is sound.
fn status_from_i8(v: i8) -> Option<ucs_status_t> {
    Some(ucs_status_t(v))
}

fn check(status: ucs_status_t, what: &'static str) -> Result<(), UcxError> {
    if status == ucs_status_t::UCS_OK {
        Ok(())
    } else {
        Err(UcxError::new(status, what))
    }
}

/// What a `ucs_status_ptr_t` says (the `UCS_PTR_IS_ERR` / `UCS_PTR_IS_PTR`
/// macros of `ucs/type/status.h`). Every value a `ucp_*_nbx` call returns
/// goes through this before anything else looks at it: only `Pending`
/// carries a request, and it is never null, so no error code or null
/// pointer can reach `ucp_request_check_status` or `ucp_request_free`
/// (invariant 5, `docs/ucx.md`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum StatusPtr {
    Done,
    Pending(NonNull<c_void>),
    Failed(i8),
}

fn status_ptr(p: *mut c_void) -> StatusPtr {
    let v = p as usize;
    let last = ucs_status_t::UCS_ERR_LAST.0 as isize as usize;
    if v >= last {
        StatusPtr::Failed(v as isize as i8)
    } else {
        match NonNull::new(p) {
            None => StatusPtr::Done,
            Some(req) => StatusPtr::Pending(req),
        }
    }
}

/// `ucp_dt_make_contig(elem_size)`.
fn dt_contig(elem: usize) -> sys::ucp_datatype_t {
    ((elem as u64) << sys::UCP_DATATYPE_SHIFT) | sys::UCP_DATATYPE_CONTIG as u64
}

/// The UCP context of this process.
pub struct Context {
    h: sys::ucp_context_h,
    /// The transports UCP opened (`ucp_context_print_info`'s resources:
    /// `tcp`, `sysv`, `posix`, `cma`, `rc_mlx5`, ...), in its order.
    transports: Vec<String>,
}

// SAFETY: the context is created with `mt_workers_shared = 1`, which makes
// UCP serialise its context-wide state (memory maps, rkey packing, worker
// creation); per-worker state is only touched through `Worker`, which is
// `!Send`.
unsafe impl Send for Context {}
// SAFETY: as above.
unsafe impl Sync for Context {}

impl Context {
    /// Reads UCX's configuration (the `UCX_*` environment variables), applies
    /// `overrides` (`("TLS", "tcp,sm")`, `("NET_DEVICES", "lo")`, ...) and
    /// initialises UCP with RMA, 64-bit atomics, active messages and wakeup.
    pub fn new(overrides: &[(&str, &str)], name: &str) -> Result<Arc<Context>, UcxError> {
        let mut config: *mut sys::ucp_config_t = std::ptr::null_mut();
        // SAFETY: null prefix and file mean the defaults ("UCX_", no file);
        // `config` receives a handle we release below.
        check(
            unsafe { sys::ucp_config_read(std::ptr::null(), std::ptr::null(), &mut config) },
            "ucp_config_read",
        )?;
        let result = (|| {
            for (k, v) in overrides {
                let (k, v) = (
                    CString::new(*k).expect("no NUL in a UCX setting name"),
                    CString::new(*v).expect("no NUL in a UCX setting value"),
                );
                // SAFETY: `config` is a live config handle; both strings are
                // NUL-terminated and outlive the call.
                check(
                    unsafe { sys::ucp_config_modify(config, k.as_ptr(), v.as_ptr()) },
                    "ucp_config_modify",
                )?;
            }
            let cname = CString::new(name).expect("no NUL in a context name");
            let params = sys::ucp_params_t {
                field_mask: (sys::UCP_PARAM_FIELD_FEATURES
                    | sys::UCP_PARAM_FIELD_MT_WORKERS_SHARED
                    | sys::UCP_PARAM_FIELD_NAME) as u64,
                features: (sys::UCP_FEATURE_RMA
                    | sys::UCP_FEATURE_AMO64
                    | sys::UCP_FEATURE_AM
                    | sys::UCP_FEATURE_WAKEUP) as u64,
                mt_workers_shared: 1,
                name: cname.as_ptr(),
                ..Default::default()
            };
            let mut h: sys::ucp_context_h = std::ptr::null_mut();
            // SAFETY: `ucp_init` is a static inline in ucp.h that calls
            // `ucp_init_version` with the header's API version; `params` and
            // `config` are valid for the call and `h` receives the context.
            check(
                unsafe {
                    sys::ucp_init_version(
                        sys::UCP_API_MAJOR,
                        sys::UCP_API_MINOR,
                        &params,
                        config,
                        &mut h,
                    )
                },
                "ucp_init",
            )?;
            // SAFETY: `h` is the live context just created; the stream is a
            // valid memory stream for the call.
            let info = capture(|f| unsafe { sys::ucp_context_print_info(h, f.cast()) });
            Ok(Arc::new(Context {
                h,
                transports: resource_transports(&info),
            }))
        })();
        // SAFETY: `config` came from ucp_config_read and is not used again
        // (ucp_init copies what it needs).
        unsafe { sys::ucp_config_release(config) };
        result
    }

    /// The transports this context opened (`tcp`, `sysv`, `posix`, ...).
    pub fn transports(&self) -> &[String] {
        &self.transports
    }

    /// Allocates `len` bytes through UCX (`ucp_mem_map` with ALLOCATE),
    /// zeroes them and packs their rkey.
    pub fn map_memory(self: &Arc<Self>, len: usize) -> Result<MappedMemory, UcxError> {
        let params = sys::ucp_mem_map_params_t {
            field_mask: (sys::UCP_MEM_MAP_PARAM_FIELD_ADDRESS
                | sys::UCP_MEM_MAP_PARAM_FIELD_LENGTH
                | sys::UCP_MEM_MAP_PARAM_FIELD_FLAGS) as u64,
            address: std::ptr::null_mut(),
            length: len,
            flags: sys::UCP_MEM_MAP_ALLOCATE,
            ..Default::default()
        };
        let mut memh: sys::ucp_mem_h = std::ptr::null_mut();
        // SAFETY: the context is live; with ALLOCATE and a null address UCX
        // allocates `len` bytes itself and returns the handle in `memh`.
        check(
            unsafe { sys::ucp_mem_map(self.h, &params, &mut memh) },
            "ucp_mem_map",
        )?;
        let mut mem = MappedMemory {
            ctx: self.clone(),
            memh,
            ptr: std::ptr::null_mut(),
            len: 0,
            packed_rkey: Vec::new(),
        };
        let mut attr = sys::ucp_mem_attr_t {
            field_mask: (sys::UCP_MEM_ATTR_FIELD_ADDRESS | sys::UCP_MEM_ATTR_FIELD_LENGTH) as u64,
            ..Default::default()
        };
        // SAFETY: `memh` is the live handle from above; `attr` is writable.
        check(
            unsafe { sys::ucp_mem_query(memh, &mut attr) },
            "ucp_mem_query",
        )?;
        if attr.address.is_null()
            || attr.length < len
            || !(attr.address as usize).is_multiple_of(64)
        {
            return Err(UcxError::new(
                ucs_status_t::UCS_ERR_NO_MEMORY,
                "ucp_mem_map returned unusable memory",
            ));
        }
        mem.ptr = attr.address.cast();
        mem.len = len;
        // SAFETY: UCX just allocated `attr.length >= len` bytes at `ptr` for
        // this handle and nobody else has its address or rkey yet, so plain
        // writes cannot race; zeroing makes the region start as the contract
        // says (UCX's heap allocation method does not zero).
        unsafe { std::ptr::write_bytes(mem.ptr, 0, len) };
        let mut buf: *mut c_void = std::ptr::null_mut();
        let mut size = 0usize;
        // SAFETY: context and memh are live; UCX returns a buffer of `size`
        // bytes that we copy and release at once.
        check(
            unsafe { sys::ucp_rkey_pack(self.h, memh, &mut buf, &mut size) },
            "ucp_rkey_pack",
        )?;
        // SAFETY: `buf` points to `size` initialised bytes (see above).
        mem.packed_rkey = unsafe { std::slice::from_raw_parts(buf.cast::<u8>(), size) }.to_vec();
        // SAFETY: `buf` came from ucp_rkey_pack and is released once.
        unsafe { sys::ucp_rkey_buffer_release(buf) };
        Ok(mem)
    }
}

impl Drop for Context {
    fn drop(&mut self) {
        // SAFETY: every worker and memory map holds an `Arc<Context>`, so none
        // is left when the last reference drops.
        unsafe { sys::ucp_cleanup(self.h) };
    }
}

/// Runs `print` on a C memory stream and returns what it wrote (UCP's
/// `*_print_info` calls are the only way UCX 1.13 tells which transports a
/// context opened and which lanes an endpoint uses).
fn capture(print: impl FnOnce(*mut libc::FILE)) -> String {
    let mut buf: *mut libc::c_char = std::ptr::null_mut();
    let mut size: libc::size_t = 0;
    // SAFETY: `buf` and `size` outlive the stream (it is closed below);
    // glibc allocates the buffer, which we free once after `fclose`.
    let f = unsafe { libc::open_memstream(&mut buf, &mut size) };
    if f.is_null() {
        return String::new();
    }
    print(f);
    // SAFETY: `f` is the open stream from above, closed once; closing
    // flushes it and leaves a NUL-terminated copy in `buf`.
    unsafe { libc::fclose(f) };
    if buf.is_null() {
        return String::new();
    }
    // SAFETY: after `fclose`, `buf` is a NUL-terminated buffer glibc
    // allocated; it is copied and then freed once.
    let text = unsafe { CStr::from_ptr(buf) }
        .to_string_lossy()
        .into_owned();
    // SAFETY: see above.
    unsafe { libc::free(buf.cast()) };
    text
}

/// The transport names of `ucp_context_print_info`'s resource lines
/// (`#      resource 2  :  md 2  dev 2  flags -- sysv/memory`).
fn resource_transports(info: &str) -> Vec<String> {
    info.lines()
        .filter(|l| l.contains("resource") && l.contains("--"))
        .filter_map(|l| l.rsplit("--").next())
        .filter_map(|t| t.trim().split('/').next())
        .filter(|t| !t.is_empty())
        .map(str::to_string)
        .collect()
}

/// The transport names of `ucp_ep_print_info`'s lane lines
/// (`#   lane[0]:  2:sysv/memory.0 md[2]  -> md[2]/sysv/sysdev[255] am`).
fn lane_transports(info: &str) -> Vec<String> {
    info.lines()
        .filter(|l| l.contains("lane["))
        .filter_map(|l| {
            l.split_whitespace()
                .find(|w| !w.starts_with("lane[") && w.contains(':') && w.contains('/'))
        })
        .filter_map(|w| w.split_once(':').map(|(_, t)| t))
        .filter_map(|t| t.split('/').next())
        .map(str::to_string)
        .collect()
}

/// Memory allocated and registered by UCX. Unmapped on drop.
pub struct MappedMemory {
    ctx: Arc<Context>,
    memh: sys::ucp_mem_h,
    ptr: *mut u8,
    len: usize,
    packed_rkey: Vec<u8>,
}

// SAFETY: the handle is only passed to ucp_mem_unmap (thread-safe with
// mt_workers_shared); the memory is accessed by others only atomically
// through `RegionMem` (see `into_region_mem`).
unsafe impl Send for MappedMemory {}
// SAFETY: as above; `&MappedMemory` exposes only addresses and the rkey.
unsafe impl Sync for MappedMemory {}

impl MappedMemory {
    /// The address remote verbs name (the region's offset 0).
    pub fn remote_base(&self) -> u64 {
        self.ptr as u64
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn packed_rkey(&self) -> &[u8] {
        &self.packed_rkey
    }

    /// The node's own view of the memory, accessed word-atomically. The view
    /// keeps the mapping alive.
    pub fn region_mem(self: &Arc<Self>) -> dmkv_transport::RegionMem {
        // SAFETY: `ptr` is 64-byte aligned (checked in `map_memory`) and valid
        // for `len` bytes until this mapping is unmapped, which cannot happen
        // while the view's owner (an `Arc` of the mapping) lives. Remote peers
        // access it through UCX (a NIC, shared-memory copies or the progress
        // thread's emulation), which make aligned 8-byte accesses whole.
        unsafe { dmkv_transport::RegionMem::from_raw(self.ptr, self.len, Box::new(self.clone())) }
    }
}

impl Drop for MappedMemory {
    fn drop(&mut self) {
        // SAFETY: `memh` was mapped by this context and is unmapped once;
        // callers keep the mapping alive while any view or rkey holder may
        // still access it.
        unsafe { sys::ucp_mem_unmap(self.ctx.h, self.memh) };
    }
}

/// What an active-message handler is given: the user header and the data.
pub type AmHandler = dyn Fn(&[u8], &[u8]);

struct WorkerInner {
    /// Keeps the context alive while the worker exists.
    _ctx: Arc<Context>,
    h: sys::ucp_worker_h,
    /// Boxed twice: UCP gets a thin pointer to the inner (fat) box.
    #[allow(clippy::vec_box)]
    handlers: RefCell<Vec<Box<Box<AmHandler>>>>,
}

impl Drop for WorkerInner {
    fn drop(&mut self) {
        // SAFETY: every Ep and Op holds an `Rc<WorkerInner>`, so all are
        // closed and completed before the worker is destroyed; handlers are
        // dropped after (field order), when no callback can run any more.
        unsafe { sys::ucp_worker_destroy(self.h) };
    }
}

/// A UCP worker, used only on the thread that made it.
#[derive(Clone)]
pub struct Worker {
    inner: Rc<WorkerInner>,
    _not_send: PhantomData<*mut ()>,
}

unsafe extern "C" fn am_trampoline(
    arg: *mut c_void,
    header: *const c_void,
    header_length: usize,
    data: *mut c_void,
    length: usize,
    param: *const sys::ucp_am_recv_param_t,
) -> ucs_status_t {
    // SAFETY: UCP passes back the `arg` registered in `set_am_handler`: a
    // pointer to a boxed handler owned by the worker, which outlives every
    // callback (handlers are dropped after the worker is destroyed).
    let handler = unsafe { &*(arg as *const Box<AmHandler>) };
    // SAFETY: `param` is valid for the duration of the callback.
    let attr = unsafe { (*param).recv_attr };
    if attr & sys::UCP_AM_RECV_ATTR_FLAG_RNDV as u64 != 0 {
        // dmkv always sends eager; a rendezvous message is not ours. Dropping
        // it (UCS_OK) releases its descriptor.
        return ucs_status_t::UCS_OK;
    }
    let h: &[u8] = if header_length == 0 || header.is_null() {
        &[]
    } else {
        // SAFETY: UCP guarantees `header` points to `header_length` bytes
        // valid during the callback.
        unsafe { std::slice::from_raw_parts(header.cast::<u8>(), header_length) }
    };
    let d: &[u8] = if length == 0 || data.is_null() {
        &[]
    } else {
        // SAFETY: for an eager message `data` points to `length` bytes valid
        // during the callback; the handler copies what it keeps.
        unsafe { std::slice::from_raw_parts(data.cast::<u8>().cast_const(), length) }
    };
    // A panic must not unwind into C.
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| handler(h, d)));
    ucs_status_t::UCS_OK
}

impl Worker {
    pub fn new(ctx: &Arc<Context>) -> Result<Worker, UcxError> {
        let params = sys::ucp_worker_params_t {
            field_mask: sys::UCP_WORKER_PARAM_FIELD_THREAD_MODE as u64,
            thread_mode: sys::UCS_THREAD_MODE_SINGLE,
            ..Default::default()
        };
        let mut h: sys::ucp_worker_h = std::ptr::null_mut();
        // SAFETY: the context is live (held by the worker); `h` receives the
        // worker. SINGLE mode is sound because `Worker` is `!Send`.
        check(
            unsafe { sys::ucp_worker_create(ctx.h, &params, &mut h) },
            "ucp_worker_create",
        )?;
        Ok(Worker {
            inner: Rc::new(WorkerInner {
                _ctx: ctx.clone(),
                h,
                handlers: RefCell::new(Vec::new()),
            }),
            _not_send: PhantomData,
        })
    }

    /// The context the worker belongs to.
    pub fn context(&self) -> &Arc<Context> {
        &self.inner._ctx
    }

    /// The worker's address, for a peer to connect to.
    pub fn address(&self) -> Result<Vec<u8>, UcxError> {
        let mut addr: *mut sys::ucp_address_t = std::ptr::null_mut();
        let mut len = 0usize;
        // SAFETY: the worker is live; UCX returns an address buffer of `len`
        // bytes that we copy and release at once.
        check(
            unsafe { sys::ucp_worker_get_address(self.inner.h, &mut addr, &mut len) },
            "ucp_worker_get_address",
        )?;
        // SAFETY: `addr` points to `len` bytes (see above).
        let v = unsafe { std::slice::from_raw_parts(addr.cast::<u8>(), len) }.to_vec();
        // SAFETY: released once, with the worker that produced it.
        unsafe { sys::ucp_worker_release_address(self.inner.h, addr) };
        Ok(v)
    }

    /// Drives the worker; returns whether anything happened. Handlers and
    /// completions run inside this call.
    pub fn progress(&self) -> bool {
        // SAFETY: the worker is live and used only on this thread.
        unsafe { sys::ucp_worker_progress(self.inner.h) != 0 }
    }

    /// Registers `handler` for active messages with `id`. It must not call
    /// back into the worker (it runs inside `progress`).
    pub fn set_am_handler(&self, id: u32, handler: Box<AmHandler>) -> Result<(), UcxError> {
        let boxed: Box<Box<AmHandler>> = Box::new(handler);
        let arg = &*boxed as *const Box<AmHandler> as *mut c_void;
        self.inner.handlers.borrow_mut().push(boxed);
        let params = sys::ucp_am_handler_param_t {
            field_mask: (sys::UCP_AM_HANDLER_PARAM_FIELD_ID
                | sys::UCP_AM_HANDLER_PARAM_FIELD_CB
                | sys::UCP_AM_HANDLER_PARAM_FIELD_ARG) as u64,
            id,
            cb: Some(am_trampoline),
            arg,
            ..Default::default()
        };
        // SAFETY: the worker is live; `arg` points into a box the worker owns
        // until after it is destroyed, so every callback finds it.
        check(
            unsafe { sys::ucp_worker_set_am_recv_handler(self.inner.h, &params) },
            "ucp_worker_set_am_recv_handler",
        )
    }

    /// The worker's event file descriptor (readable when there is work).
    pub fn event_fd(&self) -> Result<i32, UcxError> {
        let mut fd = -1;
        // SAFETY: the worker is live; `fd` is writable.
        check(
            unsafe { sys::ucp_worker_get_efd(self.inner.h, &mut fd) },
            "ucp_worker_get_efd",
        )?;
        Ok(fd)
    }

    /// Arms the event fd; false if events are pending (progress first).
    pub fn arm(&self) -> bool {
        // SAFETY: the worker is live and used only on this thread.
        let s = unsafe { sys::ucp_worker_arm(self.inner.h) };
        s == ucs_status_t::UCS_OK
    }

    /// Operations posted after the fence are executed after those before it.
    pub fn fence(&self) -> Result<(), UcxError> {
        // SAFETY: the worker is live and used only on this thread.
        check(
            unsafe { sys::ucp_worker_fence(self.inner.h) },
            "ucp_worker_fence",
        )
    }

    /// Connects to the worker at `remote_address`. With
    /// [`ErrorMode::Peer`] the returned endpoint's `failed()` turns true if
    /// UCX reports the peer gone; UCX 1.13 then uses only transports that
    /// detect peer failure, which excludes shared memory (`sysv`, `posix`,
    /// `cma`: the endpoint goes over `tcp` even between two processes of one
    /// host). With [`ErrorMode::None`] UCX may pick shared memory, and
    /// reports no failure: the caller learns that the peer is gone some
    /// other way (dmkv: its control connection) and then calls
    /// [`Ep::abandon`].
    pub fn connect(&self, remote_address: &[u8], mode: ErrorMode) -> Result<Ep, UcxError> {
        let failed = Box::new(Cell::new(0i8));
        // Only an endpoint with peer error handling gets an error callback:
        // one without is never closed by us (see `EpInner::drop`), so UCX
        // must keep no pointer into memory we free.
        let (err_mode, handler_field) = match mode {
            ErrorMode::Peer => (
                sys::UCP_ERR_HANDLING_MODE_PEER,
                sys::UCP_EP_PARAM_FIELD_ERR_HANDLER,
            ),
            ErrorMode::None => (sys::UCP_ERR_HANDLING_MODE_NONE, 0),
        };
        let params = sys::ucp_ep_params_t {
            field_mask: (sys::UCP_EP_PARAM_FIELD_REMOTE_ADDRESS
                | sys::UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE
                | handler_field) as u64,
            address: remote_address.as_ptr().cast(),
            err_mode,
            err_handler: sys::ucp_err_handler_t {
                cb: Some(ep_error),
                arg: &*failed as *const Cell<i8> as *mut c_void,
            },
            ..Default::default()
        };
        let mut h: sys::ucp_ep_h = std::ptr::null_mut();
        // SAFETY: the worker is live; `remote_address` is a worker address a
        // peer sent us (UCP validates what it parses; a malformed address is
        // an error status); the error-handler argument (given to UCX only
        // with peer error handling) points into a box the Ep owns until the
        // ep is closed, or leaks if UCX refuses to close it.
        check(
            unsafe { sys::ucp_ep_create(self.inner.h, &params, &mut h) },
            "ucp_ep_create",
        )?;
        Ok(Ep {
            inner: Rc::new(EpInner {
                worker: self.clone(),
                h,
                mode,
                failed: Some(failed),
                abandoned: Cell::new(false),
            }),
        })
    }
}

/// How an endpoint learns that its peer failed (see [`Worker::connect`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ErrorMode {
    /// UCX detects it (and so uses no shared-memory transport).
    Peer,
    /// UCX does not; shared memory is allowed.
    None,
}

unsafe extern "C" fn ep_error(arg: *mut c_void, _ep: sys::ucp_ep_h, status: ucs_status_t) {
    // SAFETY: `arg` is the `Cell` boxed by `Worker::connect`, owned by the Ep
    // until after the ep is closed, and callbacks run on the worker's thread.
    let flag = unsafe { &*(arg as *const Cell<i8>) };
    let s = status.0;
    flag.set(if s == 0 { -1 } else { s });
}

struct EpInner {
    worker: Worker,
    h: sys::ucp_ep_h,
    mode: ErrorMode,
    /// Where [`ep_error`] records a peer failure (`None` only once leaked,
    /// in `drop`).
    failed: Option<Box<Cell<i8>>>,
    /// Set by [`Ep::abandon`]: the peer is known to be gone, so an operation
    /// still in flight when it is dropped is leaked instead of awaited.
    abandoned: Cell<bool>,
}

impl Drop for EpInner {
    fn drop(&mut self) {
        if self.mode == ErrorMode::None {
            // UCX 1.13 refuses to close an endpoint without peer error
            // handling with FORCE (`UCS_ERR_INVALID_PARAM`, seen here), and
            // a flushing close could wait forever for a dead peer whose
            // shared-memory FIFO is full. So it is left open, and
            // `ucp_worker_destroy` destroys it with its worker (its lanes
            // are shared memory only, `crate::shm`: nothing reaches the
            // peer). It has no error callback (`Worker::connect`).
            return;
        }
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_EP_CLOSE_FLAG_FORCE,
            ..Default::default()
        };
        // SAFETY: the ep is live and closed once. Every Rkey and Op of this ep
        // holds an `Rc<EpInner>`, so none is left. FORCE (no flush with the
        // peer, which may be dead) is what UCP allows with peer error
        // handling.
        let p = unsafe { sys::ucp_ep_close_nbx(self.h, &param) };
        match status_ptr(p) {
            StatusPtr::Done => {}
            // The worker lives: this ep holds it.
            StatusPtr::Pending(req) => {
                wait_request(&self.worker, req);
            }
            // Refused: no request to wait for, and the ep stays open until
            // its worker is destroyed, so its error callback may still run:
            // its flag must outlive us.
            StatusPtr::Failed(_) => {
                if let Some(flag) = self.failed.take() {
                    Box::leak(flag);
                }
            }
        }
    }
}

/// Drives `worker` until `req` completes, then frees it. `req` came from a
/// `Pending` [`status_ptr`] of a call on `worker` (so it is a request, not
/// null and not an error code), and the caller holds `worker`, so the
/// worker lives while it is waited on.
fn wait_request(worker: &Worker, req: NonNull<c_void>) -> i8 {
    loop {
        if let Some(s) = request_status(req) {
            return s;
        }
        worker.progress();
    }
}

/// The status of a pending request: `None` while it is in progress; once it
/// has completed, frees it and returns its status (0 = ok). The caller must
/// not use `req` again after `Some`.
fn request_status(req: NonNull<c_void>) -> Option<i8> {
    // SAFETY: `req` is a live request (a `Pending` status pointer, never
    // null or an error code, not yet freed: it is freed below, once, and
    // callers drop it after `Some`); its worker is alive (callers hold it).
    let s = unsafe { sys::ucp_request_check_status(req.as_ptr()) };
    if s == ucs_status_t::UCS_INPROGRESS {
        return None;
    }
    // SAFETY: completed; freed once (see above).
    unsafe { sys::ucp_request_free(req.as_ptr()) };
    Some(s.0)
}

/// An endpoint to a remote worker.
#[derive(Clone)]
pub struct Ep {
    inner: Rc<EpInner>,
}

/// The buffers an operation owns until it completes.
enum Buffers {
    None,
    Bytes(Vec<u8>),
    /// `[operand, reply]` of an atomic.
    Words(Box<[u64; 2]>),
}

/// Where an [`Op`] is: its request in flight, or finished with a status.
/// An op is never built around an error-coded or null status pointer.
#[derive(Debug, Clone, Copy)]
enum OpState {
    InFlight(NonNull<c_void>),
    /// Completed (0 = ok, else the UCS status).
    Done(i8),
}

/// One posted operation. It completes during the worker's progress;
/// [`Op::poll`] reports whether it has. Dropping an unfinished op drives the
/// worker until it completes (UCP may still write into its buffers).
pub struct Op {
    ep: Rc<EpInner>,
    state: Cell<OpState>,
    bufs: Buffers,
}

impl Op {
    /// Wraps what a `ucp_*_nbx` call on `ep` returned. An error status means
    /// UCP made no request and keeps no pointer into `bufs`: it is returned
    /// as the error (a call on an endpoint whose peer UCX already marked
    /// failed ends here) and the buffers are freed at once. Until this was
    /// checked first, a half-built op holding no request was dropped here
    /// and its drop waited on a null request: SIGSEGV in
    /// `ucp_request_check_status` (`docs/ucx.md`, *A crash after a memory
    /// node was killed*).
    fn start(ep: &Ep, p: *mut c_void, bufs: Buffers, what: &'static str) -> Result<Op, UcxError> {
        let state = match status_ptr(p) {
            StatusPtr::Done => OpState::Done(0),
            StatusPtr::Pending(r) => OpState::InFlight(r),
            StatusPtr::Failed(s) => return Err(UcxError { status: s, what }),
        };
        Ok(Op {
            ep: ep.inner.clone(),
            state: Cell::new(state),
            bufs,
        })
    }

    fn is_done(&self) -> bool {
        matches!(self.state.get(), OpState::Done(_))
    }

    /// Whether the operation has completed (then `Some(status)`, 0 = ok).
    pub fn poll(&self) -> Option<i8> {
        match self.state.get() {
            OpState::Done(s) => Some(s),
            OpState::InFlight(req) => {
                let s = request_status(req)?;
                self.state.set(OpState::Done(s));
                Some(s)
            }
        }
    }

    /// The bytes of a completed get.
    pub fn take_bytes(&mut self) -> Vec<u8> {
        assert!(self.is_done(), "op still in flight");
        match std::mem::replace(&mut self.bufs, Buffers::None) {
            Buffers::Bytes(b) => b,
            _ => Vec::new(),
        }
    }

    /// The word a completed atomic returned.
    pub fn reply_word(&self) -> u64 {
        assert!(self.is_done(), "op still in flight");
        match &self.bufs {
            Buffers::Words(w) => w[1],
            _ => 0,
        }
    }
}

impl Drop for Op {
    fn drop(&mut self) {
        let OpState::InFlight(req) = self.state.get() else {
            return;
        };
        if self.ep.abandoned.get() {
            if self.poll().is_none() {
                // The peer is gone and UCX will not tell (no peer error
                // handling): waiting could last forever (a send queued
                // behind a full shared-memory FIFO nobody reads). Leak the
                // request and its buffers instead, so nothing UCP may still
                // touch is freed.
                std::mem::forget(std::mem::replace(&mut self.bufs, Buffers::None));
            }
            return;
        }
        wait_request(&self.ep.worker, req);
    }
}

impl Ep {
    /// The transports of the endpoint's lanes (`sysv`, `posix`, `cma`,
    /// `tcp`, ...), as UCP chose them when it was created.
    pub fn lane_transports(&self) -> Vec<String> {
        // SAFETY: the ep is live; the stream is a valid memory stream for the
        // call.
        let info = capture(|f| unsafe { sys::ucp_ep_print_info(self.inner.h, f.cast()) });
        lane_transports(&info)
    }

    /// Marks the peer as gone: operations of this endpoint still in flight
    /// when they are dropped are leaked rather than awaited.
    pub fn abandon(&self) {
        self.inner.abandoned.set(true);
    }

    /// The status UCX reported for this endpoint's peer, if it failed.
    pub fn failed(&self) -> Option<i8> {
        match self.inner.failed.as_ref().map_or(0, |f| f.get()) {
            0 => None,
            s => Some(s),
        }
    }

    /// Unpacks an rkey a peer packed, for use on this endpoint.
    pub fn unpack_rkey(&self, packed: &[u8]) -> Result<Rkey, UcxError> {
        let mut h: sys::ucp_rkey_h = std::ptr::null_mut();
        // SAFETY: the ep is live; `packed` came from the peer's
        // ucp_rkey_pack over the authenticated control channel and UCP parses
        // it within its length-independent format (a corrupt buffer is an
        // error status).
        check(
            unsafe { sys::ucp_ep_rkey_unpack(self.inner.h, packed.as_ptr().cast(), &mut h) },
            "ucp_ep_rkey_unpack",
        )?;
        Ok(Rkey {
            h,
            _ep: self.inner.clone(),
        })
    }

    fn param(
        flags_reply: Option<*mut c_void>,
        datatype: Option<sys::ucp_datatype_t>,
    ) -> sys::ucp_request_param_t {
        let mut p = sys::ucp_request_param_t::default();
        if let Some(r) = flags_reply {
            p.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_REPLY_BUFFER;
            p.reply_buffer = r;
        }
        if let Some(dt) = datatype {
            p.op_attr_mask |= sys::UCP_OP_ATTR_FIELD_DATATYPE;
            p.datatype = dt;
        }
        p
    }

    /// Reads `len` bytes at remote address `raddr`. The caller has checked the
    /// range against the region the rkey belongs to.
    pub fn get(&self, raddr: u64, len: usize, rkey: &Rkey) -> Result<Op, UcxError> {
        let mut buf = vec![0u8; len];
        let param = Self::param(None, None);
        // SAFETY: the ep and rkey are live (the Op and Rkey hold them); `buf`
        // is moved into the Op, whose heap buffer does not move and is kept
        // until the request completes (Op::drop waits for it).
        let p = unsafe {
            sys::ucp_get_nbx(
                self.inner.h,
                buf.as_mut_ptr().cast(),
                len,
                raddr,
                rkey.h,
                &param,
            )
        };
        Op::start(self, p, Buffers::Bytes(buf), "ucp_get_nbx")
    }

    /// Writes `data` at remote address `raddr` (completion means the local
    /// buffer is free; remote completion needs [`Ep::flush`]).
    pub fn put(&self, raddr: u64, data: Vec<u8>, rkey: &Rkey) -> Result<Op, UcxError> {
        let param = Self::param(None, None);
        // SAFETY: as in `get`; `data` is owned by the Op until completion.
        let p = unsafe {
            sys::ucp_put_nbx(
                self.inner.h,
                data.as_ptr().cast(),
                data.len(),
                raddr,
                rkey.h,
                &param,
            )
        };
        Op::start(self, p, Buffers::Bytes(data), "ucp_put_nbx")
    }

    /// 8-byte compare-and-swap at `raddr`; the op's reply word is the value
    /// found.
    pub fn cas(&self, raddr: u64, expected: u64, new: u64, rkey: &Rkey) -> Result<Op, UcxError> {
        let mut words = Box::new([expected, new]);
        let reply = (&mut words[1]) as *mut u64 as *mut c_void;
        let param = Self::param(Some(reply), Some(dt_contig(8)));
        // SAFETY: for CSWAP, `buffer` holds the compare value and the reply
        // buffer holds the value to swap in and receives the old value
        // (ucp.h, table of ucp_atomic_op_nbx); both live in a box owned by the Op until completion. The
        // caller checked 8-byte alignment and bounds.
        let p = unsafe {
            sys::ucp_atomic_op_nbx(
                self.inner.h,
                sys::UCP_ATOMIC_OP_CSWAP,
                words.as_ptr().cast(),
                1,
                raddr,
                rkey.h,
                &param,
            )
        };
        Op::start(self, p, Buffers::Words(words), "ucp_atomic_op_nbx(CSWAP)")
    }

    /// 8-byte fetch-and-add at `raddr`; the op's reply word is the old value.
    pub fn faa(&self, raddr: u64, add: u64, rkey: &Rkey) -> Result<Op, UcxError> {
        let mut words = Box::new([add, 0]);
        let reply = (&mut words[1]) as *mut u64 as *mut c_void;
        let param = Self::param(Some(reply), Some(dt_contig(8)));
        // SAFETY: as in `cas`; ADD with a reply buffer fetches the old value.
        let p = unsafe {
            sys::ucp_atomic_op_nbx(
                self.inner.h,
                sys::UCP_ATOMIC_OP_ADD,
                words.as_ptr().cast(),
                1,
                raddr,
                rkey.h,
                &param,
            )
        };
        Op::start(self, p, Buffers::Words(words), "ucp_atomic_op_nbx(ADD)")
    }

    /// Completes every operation posted on this endpoint at the target.
    pub fn flush(&self) -> Result<Op, UcxError> {
        let param = Self::param(None, None);
        // SAFETY: the ep is live; flush has no buffers.
        let p = unsafe { sys::ucp_ep_flush_nbx(self.inner.h, &param) };
        Op::start(self, p, Buffers::None, "ucp_ep_flush_nbx")
    }

    /// Sends an active message `id` with `header` and `data`, eagerly (the
    /// receiver gets the whole message in its handler).
    pub fn am_send(&self, id: u32, header: Vec<u8>, data: Vec<u8>) -> Result<Op, UcxError> {
        self.am_send_owned(id, header, &data)
    }

    /// [`Ep::am_send`] with `header` extended by `data` into the buffer the
    /// op owns.
    fn am_send_owned(&self, id: u32, header: Vec<u8>, data: &[u8]) -> Result<Op, UcxError> {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS,
            flags: sys::UCP_AM_SEND_FLAG_EAGER,
            ..Default::default()
        };
        // Both buffers travel in one allocation owned by the Op.
        let hlen = header.len();
        let mut both = header;
        both.extend_from_slice(data);
        // SAFETY: the ep is live; header and data point into `both`, owned by
        // the Op until the request completes.
        let p = unsafe {
            sys::ucp_am_send_nbx(
                self.inner.h,
                id,
                both.as_ptr().cast(),
                hlen,
                both.as_ptr().add(hlen).cast(),
                both.len() - hlen,
                &param,
            )
        };
        Op::start(self, p, Buffers::Bytes(both), "ucp_am_send_nbx")
    }

    /// Sends an active message `id` with `header` and `data` like
    /// [`Ep::am_send`], without copying them first where UCP can send them
    /// at once: `Ok(None)` when the message went out within this call (UCP
    /// copied it into the transport, the small messages of RPCs over shared
    /// memory and TCP); `Ok(Some(op))` when UCP could not, and the message
    /// was then copied into an op of [`Ep::am_send`] (to be kept until it
    /// completes). Invariant 6 (`docs/ucx.md`, branch i76): UCP sees the
    /// borrowed buffers only in a call with `UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL`,
    /// which either completes before it returns or fails making no request
    /// (`UCS_ERR_NO_RESOURCE`), so no pointer into them outlives the call.
    pub fn am_send_from(
        &self,
        id: u32,
        header: &[u8],
        data: &[u8],
    ) -> Result<Option<Op>, UcxError> {
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS | sys::UCP_OP_ATTR_FLAG_FORCE_IMM_CMPL,
            flags: sys::UCP_AM_SEND_FLAG_EAGER,
            ..Default::default()
        };
        // SAFETY: the ep is live; header and data are valid for the call,
        // and (invariant 6) UCP keeps no pointer into them after it.
        let p = unsafe {
            sys::ucp_am_send_nbx(
                self.inner.h,
                id,
                header.as_ptr().cast(),
                header.len(),
                data.as_ptr().cast(),
                data.len(),
                &param,
            )
        };
        match status_ptr(p) {
            StatusPtr::Done => Ok(None),
            StatusPtr::Failed(s) if s == ucs_status_t::UCS_ERR_NO_RESOURCE.0 => {
                let mut both = Vec::with_capacity(header.len() + data.len());
                both.extend_from_slice(header);
                self.am_send_owned(id, both, data).map(Some)
            }
            StatusPtr::Failed(s) => Err(UcxError {
                status: s,
                what: "ucp_am_send_nbx",
            }),
            // UCP's contract rules this out; should a request come back
            // anyway, it may point into the borrowed buffers, so it is
            // awaited here, while they live.
            StatusPtr::Pending(req) => match wait_request(&self.inner.worker, req) {
                0 => Ok(None),
                s => Err(UcxError {
                    status: s,
                    what: "ucp_am_send_nbx",
                }),
            },
        }
    }

    /// Tests only: sends active message `id` with `header` and `len` bytes
    /// of data, and kills this process (SIGKILL) while UCX copies the data
    /// into the transport. The data is a generic datatype, whose `pack`
    /// callback UCX calls from inside its send: over shared memory, after
    /// the send has reserved an element of the receiver's FIFO and before
    /// it marks the element written. So the process dies exactly where a
    /// client killed mid-send can (`docs/ucx.md`, *A killed client's FIFO
    /// slot*). Returns only if UCX did not pack at once (then the caller
    /// drives the worker until it does).
    #[cfg(test)]
    pub fn am_send_killed_mid_copy(
        &self,
        id: u32,
        header: Vec<u8>,
        len: usize,
    ) -> Result<Op, UcxError> {
        // The pack state is the length (no buffer is read).
        unsafe extern "C" fn start_pack(
            _: *mut c_void,
            _: *const c_void,
            count: usize,
        ) -> *mut c_void {
            count as *mut c_void
        }
        unsafe extern "C" fn start_unpack(_: *mut c_void, _: *mut c_void, _: usize) -> *mut c_void {
            std::ptr::null_mut()
        }
        unsafe extern "C" fn packed_size(state: *mut c_void) -> usize {
            state as usize
        }
        unsafe extern "C" fn pack(_: *mut c_void, _: usize, _: *mut c_void, _: usize) -> usize {
            // SAFETY: kill(2) on this process's own pid; SIGKILL cannot be
            // caught, so nothing of ours runs after it.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
            loop {
                std::hint::spin_loop();
            }
        }
        unsafe extern "C" fn unpack(
            _: *mut c_void,
            _: usize,
            _: *const c_void,
            _: usize,
        ) -> ucs_status_t {
            ucs_status_t::UCS_ERR_UNSUPPORTED
        }
        unsafe extern "C" fn finish(_: *mut c_void) {}
        let ops = sys::ucp_generic_dt_ops_t {
            start_pack: Some(start_pack),
            start_unpack: Some(start_unpack),
            packed_size: Some(packed_size),
            pack: Some(pack),
            unpack: Some(unpack),
            finish: Some(finish),
        };
        let mut dt: sys::ucp_datatype_t = 0;
        // SAFETY: `ops` is read during the call (UCP copies it); the
        // datatype is never destroyed (the process is about to die).
        check(
            unsafe { sys::ucp_dt_create_generic(&ops, std::ptr::null_mut(), &mut dt) },
            "ucp_dt_create_generic",
        )?;
        let param = sys::ucp_request_param_t {
            op_attr_mask: sys::UCP_OP_ATTR_FIELD_FLAGS | sys::UCP_OP_ATTR_FIELD_DATATYPE,
            flags: sys::UCP_AM_SEND_FLAG_EAGER,
            datatype: dt,
            ..Default::default()
        };
        // SAFETY: the ep is live; the header lives in the Op; the data
        // "buffer" is never read (the generic datatype packs nothing from
        // it), so the header's pointer stands in for it.
        let p = unsafe {
            sys::ucp_am_send_nbx(
                self.inner.h,
                id,
                header.as_ptr().cast(),
                header.len(),
                header.as_ptr().cast(),
                len,
                &param,
            )
        };
        Op::start(self, p, Buffers::Bytes(header), "ucp_am_send_nbx (generic)")
    }
}

/// A remote key unpacked on an endpoint.
pub struct Rkey {
    h: sys::ucp_rkey_h,
    _ep: Rc<EpInner>,
}

impl Rkey {
    /// A local pointer to remote address `raddr`, if the transport maps the
    /// peer's memory into this process (shared memory).
    fn local_ptr(&self, raddr: u64) -> Option<*mut u8> {
        let mut p: *mut c_void = std::ptr::null_mut();
        // SAFETY: the rkey is live; on success UCP stores a pointer into a
        // mapping that stays valid until the rkey is destroyed.
        let s = unsafe { sys::ucp_rkey_ptr(self.h, raddr, &mut p) };
        (s == ucs_status_t::UCS_OK && !p.is_null()).then_some(p.cast())
    }

    /// A word-atomic view of `len` bytes of peer memory starting at `raddr`,
    /// if the transport maps it into this process. The view keeps the rkey
    /// (and so the mapping) alive.
    pub fn mapped_view(self: &Rc<Self>, raddr: u64, len: usize) -> Option<MappedView> {
        if len < 8 {
            return None;
        }
        let p = self.local_ptr(raddr)?;
        if !(p as usize).is_multiple_of(8) {
            return None;
        }
        // The whole range must be mapped contiguously.
        let last = self.local_ptr(raddr + len as u64 - 8)?;
        if last as usize != p as usize + len - 8 {
            return None;
        }
        /// The rkey cannot be the owner (it is `!Send`); the view keeps it.
        struct HeldByView;
        // SAFETY: `p` is 8-aligned (checked) and valid for `len` bytes (both
        // ends checked) while the rkey lives; the region lives inside the view
        // next to an `Rc` of the rkey and is dropped before it (field order),
        // and only `&RegionMem` borrowed from the view is handed out. The peer
        // and UCX access the memory only word-atomically or with aligned
        // copies.
        let mem = unsafe { dmkv_transport::RegionMem::from_raw(p, len, Box::new(HeldByView)) };
        Some(MappedView {
            mem,
            _rkey: self.clone(),
        })
    }
}

impl Drop for Rkey {
    fn drop(&mut self) {
        // SAFETY: destroyed once, before its endpoint (we hold the ep), and no
        // pointer from `local_ptr` outlives the rkey (views hold an `Rc`).
        unsafe { sys::ucp_rkey_destroy(self.h) };
    }
}

/// A peer's memory mapped into this process (shared-memory transports).
pub struct MappedView {
    // Dropped before the rkey that keeps the mapping.
    mem: dmkv_transport::RegionMem,
    _rkey: Rc<Rkey>,
}

impl MappedView {
    /// The view as a region accessed only word-atomically, like the node's
    /// own (acquire loads and release stores in increasing address order,
    /// CPU atomics for CAS and FAA).
    pub fn mem(&self) -> &dmkv_transport::RegionMem {
        &self.mem
    }
}

/// Waits until one of `fds` is readable or `timeout_ms` passes; returns which
/// are readable (all false on timeout or interruption).
pub fn poll_readable(fds: &[i32], timeout_ms: i32) -> Vec<bool> {
    let mut pfds: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    // SAFETY: `pfds` is a valid array of `pfds.len()` pollfd structs that
    // poll may write `revents` into.
    let n = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout_ms) };
    if n <= 0 {
        return vec![false; fds.len()];
    }
    pfds.iter()
        .map(|p| p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0)
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn resource_lines_give_transport_names() {
        let info = "#\n# UCP context\n#\n#     component 0  :  self\n\
                    #            md 1  :  component 1  tcp \n\
                    #      resource 0  :  md 0  dev 0  flags -- self/memory0\n\
                    #      resource 1  :  md 1  dev 1  flags -- tcp/lo\n\
                    #      resource 2  :  md 2  dev 2  flags -- sysv/memory\n\
                    #      resource 3  :  md 3  dev 2  flags -- posix/memory\n\
                    #      resource 4  :  md 4  dev 2  flags -- cma/memory\n#\n";
        assert_eq!(
            resource_transports(info),
            ["self", "tcp", "sysv", "posix", "cma"]
        );
        assert!(resource_transports("# nothing here\n").is_empty());
    }

    #[test]
    fn lane_lines_give_transport_names() {
        // As UCX 1.13 prints them: peer error handling (tcp only), then none
        // (shared memory).
        let peer = "#                 lane[0]:  1:tcp/lo.0 md[1]                -> md[1]/tcp/sysdev[255] am am_bw#0 keepalive wireup\n";
        assert_eq!(lane_transports(peer), ["tcp"]);
        let none = "# UCP endpoint\n\
                    #                 lane[0]:  2:sysv/memory.0 md[2]           -> md[2]/sysv/sysdev[255] amo#0 am am_bw#0\n\
                    #                 lane[1]:  3:posix/memory.0 md[3]          -> md[3]/posix/sysdev[255] amo#1\n\
                    #                 lane[2]:  4:cma/memory.0 md[4]            -> md[4]/cma/sysdev[255] rma_bw#0\n";
        assert_eq!(lane_transports(none), ["sysv", "posix", "cma"]);
    }

    /// Invariant 6 and its fallback: messages sent from buffers freed right
    /// after the call all arrive intact, both those UCP sent at once and
    /// those it could not (the receiver's shared-memory FIFO full), which
    /// `am_send_from` copied into an op.
    #[test]
    fn messages_sent_from_borrowed_buffers_arrive_when_the_receiver_lags() {
        let c = crate::UcxCluster::new(
            crate::UcxConfig::shm_loopback(b"send-from".to_vec()),
            dmkv_transport::NodeId(1),
        )
        .unwrap();
        let ctx = c.inner.ctx.clone();
        let (tx, rx) = (Worker::new(&ctx).unwrap(), Worker::new(&ctx).unwrap());
        // What arrived: (id, data).
        type Arrived = Vec<(u64, Vec<u8>)>;
        let got: std::rc::Rc<RefCell<Arrived>> = Default::default();
        {
            let got = got.clone();
            rx.set_am_handler(
                7,
                Box::new(move |h: &[u8], d: &[u8]| {
                    let id = u64::from_le_bytes(h.try_into().expect("an 8-byte header"));
                    got.borrow_mut().push((id, d.to_vec()));
                }),
            )
            .unwrap();
        }
        let (ep, shm) =
            crate::shm::connect(&tx, &rx.address().unwrap(), crate::shm::host_id()).unwrap();
        assert!(shm, "one host: the endpoint goes over shared memory");
        let message = |i: u64| vec![i as u8; 64 + (i % 100) as usize];
        let n = 2_000u64;
        let (mut at_once, mut ops) = (0, Vec::new());
        for i in 0..n {
            // Freed as soon as the call returns.
            let data = message(i);
            match ep.am_send_from(7, &i.to_le_bytes(), &data).unwrap() {
                None => at_once += 1,
                Some(op) => ops.push(op),
            }
            tx.progress();
        }
        assert!(at_once > 0, "UCP sent none at once");
        assert!(!ops.is_empty(), "the receiver's FIFO never filled");
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        while got.borrow().len() < n as usize || ops.iter().any(|op| op.poll().is_none()) {
            assert!(std::time::Instant::now() < deadline, "messages lost");
            rx.progress();
            tx.progress();
        }
        assert!(ops.iter().all(|op| op.poll() == Some(0)));
        let mut got = got.take();
        got.sort();
        assert_eq!(got.len(), n as usize);
        for (i, (id, data)) in got.into_iter().enumerate() {
            assert_eq!(id, i as u64);
            assert_eq!(data, message(id), "message {id} arrived changed");
        }
    }
}
