//! The SSD of one directory shard: a file of 4 KiB page slots under the
//! data directory, opened with `O_DIRECT` (paper §4.3), written in batches
//! through io_uring (the paper used libaio; io_uring is its successor).
//!
//! Page reads go through a second ring shared by every thread that reads
//! the file (the node's SSD completer serving remote requesters, which
//! keeps many reads in flight with [`PageFile::submit_read`] and
//! [`PageFile::poll_read`]; workers fetching for themselves, which wait for
//! their own): a reader submits its read and then waits for its own
//! completion outside the ring's lock, so reads of different threads are
//! in flight together (§4: many outstanding I/Os keep the SSD busy). The
//! depth each read found at submission is recorded ([`ReadDepth`]).
//!
//! Falls back, and says so in the stats, where the file system refuses
//! `O_DIRECT` (tmpfs) or the kernel refuses io_uring (seccomp, old kernel):
//! then plain `pwrite`/`pread` (with a one-line note on stderr the first
//! time a ring cannot be made).
//!
//! The node's SSD completer waits for its reads on a [`Wakeup`] (an
//! eventfd) that every read ring it reads through signals on each
//! completion ([`PageFile::notify_completions`]) and that a handler
//! handing it work signals too (`ssdio`), so it sleeps until something
//! happened rather than polling (branch i52).
//!
//! This module holds the crate's only `unsafe`: pushing io_uring
//! submissions, whose buffers must outlive the kernel's use of them, and
//! the eventfd's system calls.

#![allow(unsafe_code)]

use crate::page::PAGE_SIZE;
use parking_lot::Mutex;
use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};

/// A page-aligned buffer of one page (what `O_DIRECT` needs), without
/// unsafe allocation: an over-allocated vector viewed at an aligned offset.
pub struct AlignedPage {
    buf: Vec<u8>,
    off: usize,
}

impl Default for AlignedPage {
    fn default() -> Self {
        let buf = vec![0u8; 2 * PAGE_SIZE];
        let off = buf.as_ptr().align_offset(PAGE_SIZE);
        assert!(
            off < PAGE_SIZE,
            "a vector of two pages holds an aligned page"
        );
        AlignedPage { buf, off }
    }
}

impl AlignedPage {
    pub fn bytes(&self) -> &[u8] {
        &self.buf[self.off..self.off + PAGE_SIZE]
    }
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        &mut self.buf[self.off..self.off + PAGE_SIZE]
    }
}

thread_local! {
    /// Under `--transport sim`: the virtual instant the SSD reads this
    /// thread issued (under a lock) complete; 0 = none pending.
    static SIM_DUE: std::cell::Cell<u64> = const { std::cell::Cell::new(0) };
}

/// The SSD reads this thread issued and has not waited for yet (simulated
/// cluster only): the instant the last completes.
fn take_sim_due() -> Option<dmkv_transport::time::Instant> {
    let due = SIM_DUE.with(|d| d.replace(0));
    (due > 0).then(|| dmkv_transport::time::Instant::from_nanos(due))
}

/// Waits (in virtual time, as a task) for the SSD reads this thread issued
/// under a lock: where a worker or the re-poll task let go of it. At once
/// outside the simulated cluster. Must be called before the code yields, so
/// that another node's code on the same OS thread cannot take the wait.
pub async fn settle_sim_wait() {
    if let Some(due) = take_sim_due() {
        dmkv_transport::exec::sleep_until(due).await;
    }
}

/// One shard's page file.
pub struct PageFile {
    file: File,
    /// The node whose SSD holds the file (the simulated cluster charges its
    /// I/O to that node's device).
    node: dmkv_transport::NodeId,
    path: PathBuf,
    direct: bool,
    #[cfg(target_os = "linux")]
    ring: Mutex<Option<io_uring::IoUring>>,
    #[cfg(target_os = "linux")]
    read_ring: Option<ReadRing>,
    reads: AtomicU64,
    writes: AtomicU64,
    depth: ReadDepth,
    /// Test hook: called with the slot before each [`PageFile::read`] (a
    /// slow device, for tests on the real backends).
    read_hook: Mutex<Option<ReadHook>>,
    /// Whether the read ring signals a [`Wakeup`] on every completion
    /// ([`PageFile::notify_completions`]).
    #[cfg(target_os = "linux")]
    notifies: std::sync::OnceLock<bool>,
    /// Test hook ([`PageFile::hold_next_ring_read`]).
    #[cfg(target_os = "linux")]
    hold: Mutex<RingHold>,
}

/// A ring read held by a test ([`PageFile::hold_next_ring_read`]): the
/// pipe end the next read is taken from, and the ends of reads submitted
/// (kept open while the kernel may still use them).
#[cfg(target_os = "linux")]
#[derive(Default)]
struct RingHold {
    next: Option<(
        std::os::fd::OwnedFd,
        std::sync::Arc<std::sync::atomic::AtomicBool>,
    )>,
    used: Vec<std::os::fd::OwnedFd>,
}

/// A ring read held until this is released or dropped (test hook, see
/// [`PageFile::hold_next_ring_read`]).
#[doc(hidden)]
pub struct ReadHold {
    writer: Option<std::io::PipeWriter>,
    submitted: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl ReadHold {
    /// Whether the held read was submitted to the ring (it is in flight
    /// until [`ReadHold::release`]).
    pub fn submitted(&self) -> bool {
        self.submitted.load(Ordering::SeqCst)
    }

    /// Lets the held read complete (it then reads its page from the file).
    pub fn release(mut self) {
        self.writer.take();
    }
}

/// An eventfd the SSD completer sleeps on: signalled by the read rings it
/// reads through (every completion) and by threads handing it work.
pub struct Wakeup {
    fd: std::os::fd::OwnedFd,
}

impl Wakeup {
    /// A fresh eventfd (non-blocking, close-on-exec).
    pub fn new() -> io::Result<Wakeup> {
        use std::os::fd::FromRawFd;
        // SAFETY: eventfd takes no pointer; it returns a new descriptor or
        // -1.
        let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by eventfd and is owned by
        // nothing else.
        Ok(Wakeup {
            fd: unsafe { std::os::fd::OwnedFd::from_raw_fd(fd) },
        })
    }

    fn raw(&self) -> std::os::fd::RawFd {
        use std::os::fd::AsRawFd;
        self.fd.as_raw_fd()
    }

    /// Signals the eventfd: a sleeper in [`Wakeup::wait`] returns, or the
    /// next one returns at once.
    pub fn wake(&self) {
        let one = 1u64.to_ne_bytes();
        // SAFETY: the buffer is 8 valid bytes for the duration of the call
        // and `fd` is an open eventfd. A full counter (EAGAIN) means it is
        // signalled already.
        let _ = unsafe { libc::write(self.raw(), one.as_ptr().cast(), one.len()) };
    }

    /// Waits until the eventfd is signalled or `timeout` passes; clears it
    /// if signalled. Whether it was (an interrupted wait counts as
    /// signalled: the caller looks again either way).
    pub fn wait(&self, timeout: std::time::Duration) -> bool {
        let mut p = libc::pollfd {
            fd: self.raw(),
            events: libc::POLLIN,
            revents: 0,
        };
        let ms = timeout.as_millis().clamp(1, i32::MAX as u128) as i32;
        // SAFETY: `p` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        if n == 0 {
            return false;
        }
        let mut buf = [0u8; 8];
        // SAFETY: the buffer is 8 writable bytes for the duration of the
        // call. Non-blocking: EAGAIN if another reader cleared it.
        let _ = unsafe { libc::read(self.raw(), buf.as_mut_ptr().cast(), buf.len()) };
        true
    }
}

/// See [`PageFile::set_read_hook`].
pub type ReadHook = std::sync::Arc<dyn Fn(u64) + Send + Sync>;

/// How many page reads were in flight on a file's read ring when each read
/// was submitted (itself included).
#[derive(Default)]
pub struct ReadDepth {
    now: AtomicU64,
    /// Reads submitted through the ring.
    pub submitted: AtomicU64,
    /// Sum of the depths seen at submission (mean = sum / submitted).
    pub sum: AtomicU64,
    pub max: AtomicU64,
}

impl ReadDepth {
    /// Counts a submission; returns the depth it made.
    fn enter(&self) -> u64 {
        let d = self.now.fetch_add(1, Ordering::AcqRel) + 1;
        self.submitted.fetch_add(1, Ordering::Relaxed);
        self.sum.fetch_add(d, Ordering::Relaxed);
        self.max.fetch_max(d, Ordering::Relaxed);
        d
    }
    fn leave(&self) {
        self.now.fetch_sub(1, Ordering::AcqRel);
    }
}

/// A read started by [`PageFile::submit_read`].
pub enum ReadTicket {
    /// Done at submission (no ring, or a full queue): the result, until
    /// taken.
    Ready(Option<io::Result<AlignedPage>>),
    /// In flight on the read ring.
    #[cfg(target_os = "linux")]
    Ring { slot: u64, id: u64 },
}

/// The read ring: submissions and completions are taken under `queues`;
/// the wait for a completion happens outside it.
#[cfg(target_os = "linux")]
struct ReadRing {
    ring: io_uring::IoUring,
    queues: Mutex<ReadQueues>,
}

/// Reads in flight own their buffers here until the kernel is done with
/// them, so a reader that gives up (an error) leaves nothing the kernel
/// could still write into.
#[cfg(target_os = "linux")]
#[derive(Default)]
struct ReadQueues {
    next: u64,
    inflight: std::collections::HashMap<u64, AlignedPage>,
    /// Completions reaped by one reader for another: result and buffer.
    done: std::collections::HashMap<u64, (i32, AlignedPage)>,
}

/// Makes a ring of `entries`, or says once (on stderr) why it cannot.
#[cfg(target_os = "linux")]
fn make_ring(entries: u32) -> Option<io_uring::IoUring> {
    match io_uring::IoUring::new(entries) {
        Ok(r) => Some(r),
        Err(e) => {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| {
                eprintln!(
                    "note: scalestore: io_uring is unavailable ({e}); SSD pages are read and written synchronously (pread/pwrite)"
                )
            });
            None
        }
    }
}

impl PageFile {
    /// Test hook: `hook` runs with the slot on the reading thread before
    /// each [`PageFile::read`] (the synchronous read a worker makes of a
    /// page its own node directs), e.g. to hold the read as a slow device
    /// would. `None` removes it. Not used by the engine.
    #[doc(hidden)]
    pub fn set_read_hook(&self, hook: Option<ReadHook>) {
        *self.read_hook.lock() = hook;
    }

    /// Creates (or truncates) the file at `path`.
    pub fn create(path: &Path, node: dmkv_transport::NodeId) -> io::Result<PageFile> {
        let open = |direct: bool| {
            let mut o = OpenOptions::new();
            o.read(true).write(true).create(true).truncate(true);
            if direct {
                o.custom_flags(libc::O_DIRECT);
            }
            o.open(path)
        };
        let (file, direct) = match open(true) {
            Ok(f) => (f, true),
            Err(_) => (open(false)?, false),
        };
        Ok(PageFile {
            file,
            node,
            path: path.to_path_buf(),
            direct,
            #[cfg(target_os = "linux")]
            ring: Mutex::new(make_ring(128)),
            #[cfg(target_os = "linux")]
            read_ring: make_ring(256).map(|ring| ReadRing {
                ring,
                queues: Mutex::new(ReadQueues::default()),
            }),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
            depth: ReadDepth::default(),
            read_hook: Mutex::new(None),
            #[cfg(target_os = "linux")]
            notifies: std::sync::OnceLock::new(),
            #[cfg(target_os = "linux")]
            hold: Mutex::new(RingHold::default()),
        })
    }

    /// Has the read ring signal `w` on every completion (the SSD completer's
    /// [`Wakeup`]; a ring takes one, the first asked for). Whether it does:
    /// false without a ring or if the kernel refused, and then the
    /// completer's wait for this file's reads stays bounded
    /// ([`PageFile::wait_read`]).
    pub fn notify_completions(&self, w: &Wakeup) -> bool {
        #[cfg(target_os = "linux")]
        {
            *self.notifies.get_or_init(|| {
                self.read_ring
                    .as_ref()
                    .is_some_and(|r| r.ring.submitter().register_eventfd(w.raw()).is_ok())
            })
        }
        #[cfg(not(target_os = "linux"))]
        {
            let _ = w;
            false
        }
    }

    /// Test hook: the next read submitted to the read ring is taken from a
    /// pipe instead of the file, so it stays in flight until the returned
    /// [`ReadHold`] is released or dropped; then the pipe reads empty and
    /// the read's page comes from the file (the short-read path). None
    /// without a ring. Not used by the engine.
    #[doc(hidden)]
    pub fn hold_next_ring_read(&self) -> io::Result<Option<ReadHold>> {
        #[cfg(target_os = "linux")]
        if self.read_ring.is_some() {
            let (reader, writer) = std::io::pipe()?;
            let submitted = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
            self.hold.lock().next = Some((reader.into(), submitted.clone()));
            return Ok(Some(ReadHold {
                writer: Some(writer),
                submitted,
            }));
        }
        Ok(None)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file is opened with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Whether batched writes and page reads go through io_uring.
    pub fn uring(&self) -> bool {
        #[cfg(target_os = "linux")]
        {
            self.ring.lock().is_some() && self.read_ring.is_some()
        }
        #[cfg(not(target_os = "linux"))]
        {
            false
        }
    }

    pub fn reads(&self) -> u64 {
        self.reads.load(Ordering::Relaxed)
    }
    pub fn writes(&self) -> u64 {
        self.writes.load(Ordering::Relaxed)
    }

    /// The read ring's depth figures.
    pub fn read_depth(&self) -> &ReadDepth {
        &self.depth
    }

    /// Reads page `slot` into `out`; a slot never written reads as zeroes.
    /// Through the read ring where it exists (see the module doc), else a
    /// synchronous `pread`.
    ///
    /// Under the simulated cluster the modelled device time is not waited
    /// for here (callers hold the page's entry mutex): it is recorded for
    /// this thread and waited for by [`settle_sim_wait`] once the lock is
    /// let go.
    pub fn read(&self, slot: u64, out: &mut AlignedPage) -> io::Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let hook = self.read_hook.lock().clone();
        if let Some(h) = hook {
            h(slot);
        }
        if let Some(due) = dmkv_transport::sim::ssd_io_submit(self.node, false, 1) {
            SIM_DUE.with(|d| d.set(d.get().max(due)));
        }
        #[cfg(target_os = "linux")]
        if let Some(r) = &self.read_ring {
            return self.read_uring(r, slot, out);
        }
        self.pread(slot, out.bytes_mut(), 0)
    }

    /// `pread`s the page at `slot` from byte `from` on (zeroes past the end
    /// of the file).
    fn pread(&self, slot: u64, buf: &mut [u8], from: usize) -> io::Result<()> {
        let pos = slot * PAGE_SIZE as u64;
        let mut done = from;
        while done < PAGE_SIZE {
            let n = self.file.read_at(&mut buf[done..], pos + done as u64)?;
            if n == 0 {
                buf[done..].fill(0);
                break;
            }
            done += n;
        }
        Ok(())
    }

    #[cfg(target_os = "linux")]
    fn read_uring(&self, r: &ReadRing, slot: u64, out: &mut AlignedPage) -> io::Result<()> {
        let id = match self.submit_uring(r, slot)? {
            Some(id) => id,
            // Queue full (more readers than entries): read directly.
            None => return self.pread(slot, out.bytes_mut(), 0),
        };
        loop {
            if let Some(res) = self.reap_uring(r, slot, id) {
                let page = res?;
                out.bytes_mut().copy_from_slice(page.bytes());
                return Ok(());
            }
            Self::wait_uring(r);
        }
    }

    /// Submits a read of `slot` to the read ring; its id, or None if the
    /// submission queue is full.
    #[cfg(target_os = "linux")]
    fn submit_uring(&self, r: &ReadRing, slot: u64) -> io::Result<Option<u64>> {
        use io_uring::{opcode, types};
        use std::os::fd::AsRawFd;
        let mut q = r.queues.lock();
        let id = q.next;
        q.next += 1;
        let mut buf = AlignedPage::default();
        // A held read (test hook) reads a pipe, at its current position.
        let (fd, offset, held) = {
            let mut h = self.hold.lock();
            match h.next.take() {
                Some((pipe, submitted)) => {
                    let fd = pipe.as_raw_fd();
                    h.used.push(pipe);
                    (fd, u64::MAX, Some(submitted))
                }
                None => (self.file.as_raw_fd(), slot * PAGE_SIZE as u64, None),
            }
        };
        let entry = opcode::Read::new(
            types::Fd(fd),
            buf.bytes_mut().as_mut_ptr(),
            PAGE_SIZE as u32,
        )
        .offset(offset)
        .build()
        .user_data(id);
        // SAFETY: the queues are only touched under `r.queues`, held
        // here, so no other submission queue handle exists. The buffer
        // is kept in `inflight` (its heap allocation does not move) until
        // the completion is reaped, and the file lives as long as the
        // ring (both fields of `self`; the ring is dropped with it, after
        // which the kernel no longer writes); so does a held read's pipe
        // (kept in `hold.used`).
        let pushed = unsafe { r.ring.submission_shared().push(&entry) };
        if pushed.is_err() {
            return Ok(None);
        }
        q.inflight.insert(id, buf);
        self.depth.enter();
        if let Some(h) = held {
            h.store(true, Ordering::SeqCst);
        }
        // Submitted now or by the next enter of any reader (the waits
        // submit what is queued), so an error here is not final.
        let _ = r.ring.submit();
        Ok(Some(id))
    }

    /// Reaps the ring's completions (for every reader) and takes read
    /// `id`'s if it is there.
    #[cfg(target_os = "linux")]
    fn reap_uring(&self, r: &ReadRing, slot: u64, id: u64) -> Option<io::Result<AlignedPage>> {
        let mut q = r.queues.lock();
        // SAFETY: as in `submit_uring`, the completion queue only under
        // `queues`.
        for c in unsafe { r.ring.completion_shared() } {
            if let Some(buf) = q.inflight.remove(&c.user_data()) {
                self.depth.leave();
                q.done.insert(c.user_data(), (c.result(), buf));
            }
        }
        let (res, mut buf) = q.done.remove(&id)?;
        drop(q);
        if res < 0 {
            return Some(Err(io::Error::from_raw_os_error(-res)));
        }
        // A short read: at the end of the file (zeroes beyond).
        Some(
            self.pread(slot, buf.bytes_mut(), res as usize)
                .map(|()| buf),
        )
    }

    /// Waits briefly (at most 100 µs) for any completion of the read ring:
    /// another reader may reap ours meanwhile, so the wait is bounded and
    /// the caller looks again.
    #[cfg(target_os = "linux")]
    fn wait_uring(r: &ReadRing) {
        let ts = io_uring::types::Timespec::new().nsec(100_000);
        let args = io_uring::types::SubmitArgs::new().timespec(&ts);
        match r.ring.submitter().submit_with_args(1, &args) {
            Ok(_) => {}
            Err(e) if e.raw_os_error() == Some(libc::ETIME) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINTR) => {}
            Err(e) if e.raw_os_error() == Some(libc::EBUSY) => {}
            // EXT_ARG unsupported (kernel < 5.11) and the like: poll.
            Err(_) => std::thread::yield_now(),
        }
    }

    /// Starts a read of page `slot` without waiting for it (the SSD
    /// completer of `ssdio`, real backends): through the read ring where it
    /// exists, else a `pread` now. Poll it with [`PageFile::poll_read`].
    pub fn submit_read(&self, slot: u64) -> ReadTicket {
        self.reads.fetch_add(1, Ordering::Relaxed);
        #[cfg(target_os = "linux")]
        if let Some(r) = &self.read_ring {
            match self.submit_uring(r, slot) {
                Ok(Some(id)) => return ReadTicket::Ring { slot, id },
                Ok(None) => {}
                Err(e) => return ReadTicket::Ready(Some(Err(e))),
            }
        }
        let mut page = AlignedPage::default();
        let res = self.pread(slot, page.bytes_mut(), 0).map(|()| page);
        ReadTicket::Ready(Some(res))
    }

    /// The page of a read started by [`PageFile::submit_read`], if it is
    /// complete (once: later polls answer None).
    pub fn poll_read(&self, t: &mut ReadTicket) -> Option<io::Result<AlignedPage>> {
        match t {
            ReadTicket::Ready(r) => r.take(),
            #[cfg(target_os = "linux")]
            ReadTicket::Ring { slot, id } => {
                let r = self.read_ring.as_ref().expect("a ring ticket");
                self.reap_uring(r, *slot, *id)
            }
        }
    }

    /// Waits briefly (at most 100 µs) for a read started by
    /// [`PageFile::submit_read`] to complete (at once without a ring).
    pub fn wait_read(&self) {
        #[cfg(target_os = "linux")]
        if let Some(r) = &self.read_ring {
            Self::wait_uring(r);
        }
    }

    /// Reads page `slot` now (the bytes are those of the file at this
    /// instant) for the simulated cluster's SSD completer: the modelled
    /// device time is not waited for; the result is the virtual instant the
    /// read completes (None outside a simulation), for the completer to
    /// deliver the page then.
    pub fn read_posted(
        &self,
        slot: u64,
        out: &mut AlignedPage,
    ) -> io::Result<Option<dmkv_transport::time::Instant>> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        let due = dmkv_transport::sim::ssd_io_submit(self.node, false, 1)
            .map(dmkv_transport::time::Instant::from_nanos);
        self.pread(slot, out.bytes_mut(), 0)?;
        Ok(due)
    }

    /// Writes every `(slot, page)` and waits for all of them: one io_uring
    /// submission for the whole batch.
    pub fn write_batch(&self, pages: &[(u64, &AlignedPage)]) -> io::Result<()> {
        if pages.is_empty() {
            return Ok(());
        }
        dmkv_transport::sim::ssd_io_blocking(self.node, true, pages.len());
        self.write_now(pages)
    }

    /// [`PageFile::write_batch`] for a background activity: under the
    /// simulated cluster it waits for the modelled device as a task (no
    /// nested frame of the scheduler held while other nodes' activities
    /// run), then writes.
    pub async fn write_batch_async(&self, pages: &[(u64, &AlignedPage)]) -> io::Result<()> {
        if pages.is_empty() {
            return Ok(());
        }
        dmkv_transport::sim::ssd_io_batch(self.node, true, pages.len()).await;
        self.write_now(pages)
    }

    /// [`PageFile::write_batch`] for code that holds a lock where it writes
    /// (a leaving node writes its dirty sole copies under their entries'
    /// mutexes): the pages are written now (on the real backends the
    /// write is complete on return, as with `write_batch`), and under the
    /// simulated cluster the batch is submitted to the modelled device
    /// without waiting for it; the result is the virtual instant it
    /// completes, for the caller to wait for (`exec::sleep_until`) once it
    /// let go of the lock. None outside the simulated cluster.
    pub fn write_batch_posted(
        &self,
        pages: &[(u64, &AlignedPage)],
    ) -> io::Result<Option<dmkv_transport::time::Instant>> {
        if pages.is_empty() {
            return Ok(None);
        }
        let due = dmkv_transport::sim::ssd_io_submit(self.node, true, pages.len());
        self.write_now(pages)?;
        Ok(due.map(dmkv_transport::time::Instant::from_nanos))
    }

    /// The writes themselves (counted): one io_uring submission for the
    /// batch where the ring exists.
    fn write_now(&self, pages: &[(u64, &AlignedPage)]) -> io::Result<()> {
        self.writes.fetch_add(pages.len() as u64, Ordering::Relaxed);
        #[cfg(target_os = "linux")]
        {
            let mut ring = self.ring.lock();
            if let Some(ring) = ring.as_mut() {
                return write_uring(ring, &self.file, pages);
            }
        }
        for (slot, page) in pages {
            self.file
                .write_all_at(page.bytes(), slot * PAGE_SIZE as u64)?;
        }
        Ok(())
    }
}

#[cfg(target_os = "linux")]
fn write_uring(
    ring: &mut io_uring::IoUring,
    file: &File,
    pages: &[(u64, &AlignedPage)],
) -> io::Result<()> {
    use io_uring::{opcode, types};
    use std::os::fd::AsRawFd;
    let fd = types::Fd(file.as_raw_fd());
    for chunk in pages.chunks(ring.params().sq_entries() as usize) {
        for (i, (slot, page)) in chunk.iter().enumerate() {
            let bytes = page.bytes();
            let entry = opcode::Write::new(fd, bytes.as_ptr(), PAGE_SIZE as u32)
                .offset(slot * PAGE_SIZE as u64)
                .build()
                .user_data(i as u64);
            // SAFETY: the buffer (borrowed from `pages`) and the file stay
            // alive and unmodified until every completion of this chunk has
            // been reaped below, before this function returns.
            unsafe { ring.submission().push(&entry) }
                .map_err(|_| io::Error::other("io_uring submission queue full"))?;
        }
        ring.submit_and_wait(chunk.len())?;
        let mut seen = 0;
        while seen < chunk.len() {
            let cqes: Vec<_> = ring.completion().collect();
            if cqes.is_empty() {
                ring.submit_and_wait(1)?;
                continue;
            }
            for c in cqes {
                seen += 1;
                if c.result() < 0 {
                    return Err(io::Error::from_raw_os_error(-c.result()));
                }
                if c.result() as usize != PAGE_SIZE {
                    return Err(io::Error::other(format!(
                        "short write of {} bytes",
                        c.result()
                    )));
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pages_round_trip_through_the_file() {
        let dir = tempfile::tempdir().unwrap();
        let f =
            PageFile::create(&dir.path().join("shard0.pages"), dmkv_transport::NodeId(0)).unwrap();
        let mut a = AlignedPage::default();
        a.bytes_mut()[..3].copy_from_slice(b"abc");
        let mut b = AlignedPage::default();
        b.bytes_mut()[4095] = 9;
        f.write_batch(&[(3, &a), (7, &b)]).unwrap();
        let mut out = AlignedPage::default();
        f.read(3, &mut out).unwrap();
        assert_eq!(&out.bytes()[..3], b"abc");
        f.read(7, &mut out).unwrap();
        assert_eq!(out.bytes()[4095], 9);
        f.read(100, &mut out).unwrap();
        assert!(
            out.bytes().iter().all(|&x| x == 0),
            "unwritten slots read as zero"
        );
        assert_eq!((f.reads(), f.writes()), (3, 2));
    }

    /// The SSD completer's path (`ssdio::run`): one thread submits 32 reads
    /// before it looks at any completion, then polls them all; every read
    /// gets its own page, each completes once, and with a ring all 32 were
    /// in flight together (depth 32 at the last submission).
    #[test]
    fn submitted_reads_complete_with_their_own_pages() {
        let dir = tempfile::tempdir().unwrap();
        let f =
            PageFile::create(&dir.path().join("shard0.pages"), dmkv_transport::NodeId(0)).unwrap();
        let pages: Vec<AlignedPage> = (0..32u8)
            .map(|i| {
                let mut p = AlignedPage::default();
                p.bytes_mut().fill(i + 1);
                p
            })
            .collect();
        let batch: Vec<(u64, &AlignedPage)> = pages
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u64, p))
            .collect();
        f.write_batch(&batch).unwrap();
        let mut tickets: Vec<(u64, ReadTicket)> =
            (0..32u64).rev().map(|s| (s, f.submit_read(s))).collect();
        let mut done = 0;
        while !tickets.is_empty() {
            let mut i = 0;
            while i < tickets.len() {
                let (slot, t) = &mut tickets[i];
                match f.poll_read(t) {
                    Some(r) => {
                        let page = r.unwrap();
                        assert!(
                            page.bytes().iter().all(|&b| b == *slot as u8 + 1),
                            "slot {slot}"
                        );
                        assert!(f.poll_read(t).is_none(), "a read completes once");
                        tickets.remove(i);
                        done += 1;
                    }
                    None => i += 1,
                }
            }
            if !tickets.is_empty() {
                f.wait_read();
            }
        }
        assert_eq!((done, f.reads()), (32, 32));
        let d = f.read_depth();
        if f.uring() {
            assert_eq!(d.max.load(Ordering::Relaxed), 32, "all in flight at once");
            assert_eq!(d.now.load(Ordering::Relaxed), 0, "nothing left in flight");
        }
    }

    /// `Wakeup` (invariant 23 of docs/scalestore.md): a wait with nothing
    /// signalled times out; a signal made before the wait is not lost and
    /// the wait clears it; another thread's `wake` ends a wait; and a read
    /// ring registered with it signals it when a read completes, not
    /// before (the read is held by the test hook until released, then
    /// reads its page from the file).
    #[test]
    fn a_wakeup_is_signalled_by_a_completion_and_by_a_hand_off() {
        use std::time::Duration;
        let w = Wakeup::new().unwrap();
        assert!(!w.wait(Duration::from_millis(1)), "nothing signalled");
        w.wake();
        assert!(w.wait(Duration::from_secs(60)), "an earlier signal counts");
        assert!(!w.wait(Duration::from_millis(1)), "the wait cleared it");
        std::thread::scope(|s| {
            s.spawn(|| {
                // A real pause (no simulation runs here), from the runtime.
                dmkv_transport::time::sleep_blocking(Duration::from_millis(20));
                w.wake();
            });
            assert!(w.wait(Duration::from_secs(60)), "another thread's wake");
        });
        let dir = tempfile::tempdir().unwrap();
        let f =
            PageFile::create(&dir.path().join("shard0.pages"), dmkv_transport::NodeId(0)).unwrap();
        let mut page = AlignedPage::default();
        page.bytes_mut().fill(7);
        f.write_batch(&[(3, &page)]).unwrap();
        let Some(hold) = f.hold_next_ring_read().unwrap() else {
            eprintln!("skipped the ring part: no io_uring read ring here");
            return;
        };
        assert!(f.notify_completions(&w), "the ring takes the eventfd");
        let mut t = f.submit_read(3);
        assert!(hold.submitted());
        assert!(
            !w.wait(Duration::from_millis(20)),
            "nothing completed while the read is held"
        );
        assert!(f.poll_read(&mut t).is_none(), "still in flight");
        hold.release();
        assert!(w.wait(Duration::from_secs(60)), "the completion signals");
        let got = loop {
            if let Some(r) = f.poll_read(&mut t) {
                break r.unwrap();
            }
            f.wait_read();
        };
        assert!(got.bytes().iter().all(|&b| b == 7), "the file's page");
    }

    /// Reads from several threads at once through the read ring: every page
    /// comes back with its own content (no completion delivered to the
    /// wrong reader), and the depth figures count every read.
    #[test]
    fn concurrent_reads_get_their_own_pages() {
        let dir = tempfile::tempdir().unwrap();
        let f =
            PageFile::create(&dir.path().join("shard0.pages"), dmkv_transport::NodeId(0)).unwrap();
        let pages: Vec<AlignedPage> = (0..64u8)
            .map(|i| {
                let mut p = AlignedPage::default();
                p.bytes_mut().fill(i);
                p
            })
            .collect();
        let batch: Vec<(u64, &AlignedPage)> = pages
            .iter()
            .enumerate()
            .map(|(i, p)| (i as u64, p))
            .collect();
        f.write_batch(&batch).unwrap();
        std::thread::scope(|s| {
            for t in 0..4u64 {
                let f = &f;
                s.spawn(move || {
                    let mut out = AlignedPage::default();
                    for round in 0..200u64 {
                        let slot = (t * 17 + round * 7) % 64;
                        f.read(slot, &mut out).unwrap();
                        assert!(
                            out.bytes().iter().all(|&b| b == slot as u8),
                            "slot {slot} read by thread {t}"
                        );
                    }
                });
            }
        });
        assert_eq!(f.reads(), 800);
        let d = f.read_depth();
        if f.uring() {
            assert_eq!(d.submitted.load(Ordering::Relaxed), 800);
            let (sum, max) = (d.sum.load(Ordering::Relaxed), d.max.load(Ordering::Relaxed));
            assert!((1..=4).contains(&max), "max depth {max} with 4 readers");
            assert!(sum >= 800 && sum <= 800 * max, "sum {sum}");
            assert_eq!(d.now.load(Ordering::Relaxed), 0, "nothing left in flight");
        } else {
            assert_eq!(d.submitted.load(Ordering::Relaxed), 0);
        }
    }
}
