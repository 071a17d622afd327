//! Durability (§5.4): per-worker write-ahead logs on the memory node's
//! local disk, a group-committing logger thread per log, and recovery.
//!
//! A worker (RPC handler thread) applies a write to XTree, appends the
//! record `(key, value or delete, version)` to its own log buffer
//! ([`Wal::append`]) and hands the request's reply to the log
//! ([`Wal::when_durable`]); it does not wait, and serves the next request.
//! The worker's logger thread writes out everything buffered since its last
//! batch with one `write(2)`, then (with `log_sync=fsync`) `fdatasync`s the
//! file once for the whole batch, and only then sends the replies of every
//! write in it (group commit). "Durable" means: after `fdatasync` returned
//! (fsync), or after `write(2)` returned (none: the record survives a crash
//! of the process but not of the machine).
//!
//! Versions are assigned by the writer while it holds its key's stripe
//! lock, so versions of one key are in the order the writes were applied;
//! recovery keeps the highest version of every key.
//!
//! Files: `<dir>/e<epoch>-w<worker>.log`, and `e<epoch>-snapshot.log`
//! written by a recovery (the recovered state, as records) before the
//! older epochs' files are removed; `LOCK`, locked while the log is live.

use crate::config::LogSync;
use crate::layout::{LogOp, LogRecord};
use dmkv_transport::thread_cpu_ns;
use dmkv_transport::time::Instant;
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::ThreadId;

/// What recovery found.
#[derive(Debug, Default)]
pub struct Recovered {
    /// The latest state of every key that exists.
    pub pairs: Vec<(u64, Vec<u8>)>,
    /// The highest version seen (0 if none).
    pub max_version: u64,
    /// Records read (all files) and files read.
    pub records: u64,
    pub files: u64,
}

/// Called once a record is durable (`Ok`) or can no longer become durable
/// (`Err`: the log failed or was crashed).
pub type Waiter = Box<dyn FnOnce(Result<(), String>) + Send>;

#[derive(Default)]
struct LogState {
    buf: Vec<u8>,
    /// Records in `buf`, and how many of them are writes (not loads).
    buffered: u64,
    buffered_writes: u64,
    /// Sequence number of the last record appended (the first is 1).
    appended: u64,
    /// Every record up to this sequence number is durable.
    durable: u64,
    /// Waiting for a sequence number to become durable.
    waiters: Vec<(u64, Waiter)>,
    failed: Option<String>,
    stop: bool,
}

/// One worker's log: its buffer, its logger thread's file.
pub struct WorkerLog {
    index: usize,
    state: Mutex<LogState>,
    /// The logger waits on it for records.
    wake: Condvar,
}

impl WorkerLog {
    /// Fails every waiter and every later append with `why`.
    fn fail(&self, why: String) -> Vec<Waiter> {
        let mut st = self.state.lock();
        if st.failed.is_none() {
            st.failed = Some(why);
        }
        st.buf.clear();
        st.buffered = 0;
        st.buffered_writes = 0;
        st.waiters.drain(..).map(|(_, w)| w).collect()
    }
}

/// Where a record sits: in which worker log, at which sequence number.
#[derive(Clone)]
pub struct Ticket {
    log: Arc<WorkerLog>,
    lsn: u64,
}

impl Ticket {
    /// Whether the record is durable already.
    pub fn is_durable(&self) -> bool {
        self.log.state.lock().durable >= self.lsn
    }
}

impl std::fmt::Debug for Ticket {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Ticket(w{}, #{})", self.log.index, self.lsn)
    }
}

/// Figures for `engine_stats`.
#[derive(Debug, Default)]
pub struct WalCounters {
    pub records: AtomicU64,
    pub bytes: AtomicU64,
    /// Batches written (one `write(2)` each) and `fdatasync`s.
    pub batches: AtomicU64,
    pub syncs: AtomicU64,
    /// Records of single writes (not bulk loads), and the batches that
    /// held any: their ratio is the group-commit factor of the writes.
    pub write_records: AtomicU64,
    pub write_batches: AtomicU64,
    /// Most write records one batch held.
    pub max_batch_writes: AtomicU64,
    /// Wall time in `write(2)` and `fdatasync` (reported, never asserted).
    pub io_ns: AtomicU64,
    /// CPU time of the logger threads.
    pub logger_cpu_ns: AtomicU64,
}

/// The logs of one memory node.
pub struct Wal {
    dir: PathBuf,
    epoch: u64,
    sync: LogSync,
    temporary: bool,
    logs: Mutex<HashMap<ThreadId, Arc<WorkerLog>>>,
    loggers: Mutex<Vec<(Arc<WorkerLog>, dmkv_transport::exec::BackgroundHandle)>>,
    next_version: AtomicU64,
    /// Fault injection (tests): loggers start no batch while set.
    held: Arc<AtomicBool>,
    /// Fault injection (tests): the logs were crashed; nothing more is
    /// written.
    crashed: Arc<AtomicBool>,
    pub counters: Arc<WalCounters>,
    /// Holds the directory's `LOCK` file locked while the log is live.
    lock: Mutex<Option<File>>,
}

/// While alive, no logger starts writing a batch (see [`Wal::hold`]).
pub struct LogHold<'a> {
    wal: &'a Wal,
}

impl Drop for LogHold<'_> {
    fn drop(&mut self) {
        self.wal.held.store(false, Ordering::SeqCst);
        self.wal.wake_all();
    }
}

fn io(what: &str, path: &Path, e: std::io::Error) -> String {
    format!("{what} {}: {e}", path.display())
}

/// `e<epoch>-...log` files in `dir`, with their epochs.
fn log_files(dir: &Path) -> Result<Vec<(u64, PathBuf)>, String> {
    let mut out = Vec::new();
    let rd = match std::fs::read_dir(dir) {
        Ok(rd) => rd,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(out),
        Err(e) => return Err(io("reading", dir, e)),
    };
    for ent in rd {
        let ent = ent.map_err(|e| io("reading", dir, e))?;
        let name = ent.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix('e') else {
            continue;
        };
        let Some((epoch, tail)) = rest.split_once('-') else {
            continue;
        };
        if !tail.ends_with(".log") {
            continue;
        }
        if let Ok(e) = epoch.parse::<u64>() {
            out.push((e, ent.path()));
        }
    }
    out.sort();
    Ok(out)
}

impl Wal {
    /// Opens the logs in `dir` (created if missing; a fresh temporary
    /// directory if `None`), replays every log found there, writes the
    /// recovered state as a snapshot of a new epoch, removes the older
    /// files, and returns the log with what it recovered.
    pub fn open(dir: Option<PathBuf>, sync: LogSync) -> Result<(Wal, Recovered), String> {
        let (dir, temporary) = match dir {
            Some(d) => (d, false),
            None => {
                let nanos = std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0);
                (
                    std::env::temp_dir()
                        .join(format!("dmkv-xstore-{}-{nanos}", std::process::id())),
                    true,
                )
            }
        };
        std::fs::create_dir_all(&dir).map_err(|e| io("creating", &dir, e))?;
        // One live log per directory: a second instance (another install
        // on the same memory node, another process) would interleave its
        // epochs with ours and compact our files away. The OS drops the
        // lock when the process dies, so a restart after kill -9 gets it.
        let lock_path = dir.join("LOCK");
        let lock = OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .open(&lock_path)
            .map_err(|e| io("opening", &lock_path, e))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(format!(
                    "the data directory {} is in use by another live XStore partition (one per directory)",
                    dir.display()
                ));
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(io("locking", &lock_path, e)),
        }
        let files = log_files(&dir)?;
        let epoch = files.iter().map(|f| f.0).max().map_or(1, |e| e + 1);
        let mut latest: BTreeMap<u64, (u64, LogOp)> = BTreeMap::new();
        let mut rec = Recovered::default();
        for (_, path) in &files {
            let bytes = std::fs::read(path).map_err(|e| io("reading", path, e))?;
            rec.files += 1;
            let mut at = 0;
            // A record cut short or damaged ends the file: it can only be
            // the tail a crash interrupted, whose write was never
            // acknowledged.
            while let Some((r, n)) = LogRecord::decode(&bytes[at..]) {
                at += n;
                rec.records += 1;
                rec.max_version = rec.max_version.max(r.version);
                match latest.get(&r.key) {
                    Some((v, _)) if *v >= r.version => {}
                    _ => {
                        latest.insert(r.key, (r.version, r.op));
                    }
                }
            }
        }
        let wal = Wal {
            dir,
            epoch,
            sync,
            temporary,
            logs: Mutex::new(HashMap::new()),
            loggers: Mutex::new(Vec::new()),
            next_version: AtomicU64::new(rec.max_version + 1),
            held: Arc::new(AtomicBool::new(false)),
            crashed: Arc::new(AtomicBool::new(false)),
            counters: Arc::new(WalCounters::default()),
            lock: Mutex::new(Some(lock)),
        };
        if !files.is_empty() {
            // The snapshot keeps deletes too, with their versions, so that
            // a later replay of it alone gives the same state.
            let mut snap = Vec::new();
            for (k, (v, op)) in &latest {
                LogRecord {
                    version: *v,
                    key: *k,
                    op: op.clone(),
                }
                .encode_into(&mut snap);
            }
            let path = wal.dir.join(format!("e{epoch}-snapshot.log"));
            let mut f = File::create(&path).map_err(|e| io("creating", &path, e))?;
            f.write_all(&snap).map_err(|e| io("writing", &path, e))?;
            f.sync_all().map_err(|e| io("syncing", &path, e))?;
            sync_dir(&wal.dir)?;
            for (_, old) in &files {
                std::fs::remove_file(old).map_err(|e| io("removing", old, e))?;
            }
            sync_dir(&wal.dir)?;
        }
        rec.pairs = latest
            .into_iter()
            .filter_map(|(k, (_, op))| match op {
                LogOp::Put(v) => Some((k, v)),
                LogOp::Delete => None,
            })
            .collect();
        Ok((wal, rec))
    }

    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// A new version (call with the key's stripe held).
    pub fn next_version(&self) -> u64 {
        self.next_version.fetch_add(1, Ordering::Relaxed)
    }

    /// The log of the calling worker thread, started on first use.
    fn worker_log(&self) -> Result<Arc<WorkerLog>, String> {
        let me = std::thread::current().id();
        let mut logs = self.logs.lock();
        if let Some(l) = logs.get(&me) {
            return Ok(l.clone());
        }
        let w = logs.len();
        let path = self.dir.join(format!("e{}-w{w}.log", self.epoch));
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&path)
            .map_err(|e| io("opening", &path, e))?;
        let log = Arc::new(WorkerLog {
            index: w,
            state: Mutex::new(LogState::default()),
            wake: Condvar::new(),
        });
        let l = log.clone();
        let ctx = LoggerCtx {
            sync: self.sync,
            counters: self.counters.clone(),
            held: self.held.clone(),
            crashed: self.crashed.clone(),
        };
        // A runtime background activity: its own thread on real backends,
        // a task in virtual time under `sim`.
        let handle =
            dmkv_transport::exec::spawn_background(&format!("xstore-log-w{w}"), async move {
                logger(&l, &mut file, &path, &ctx)
            });
        self.loggers.lock().push((log.clone(), handle));
        logs.insert(me, log.clone());
        Ok(log)
    }

    /// Appends `records` to the calling worker's log buffer and returns the
    /// ticket of the last one (all of them are durable when it is). Nothing
    /// waits: the logger writes the buffer out in its next batch. `bulk`:
    /// they come from a load (counted apart from single writes).
    pub fn append(&self, records: &[LogRecord], bulk: bool) -> Result<Option<Ticket>, String> {
        if records.is_empty() {
            return Ok(None);
        }
        let log = self.worker_log()?;
        let mut st = log.state.lock();
        if let Some(e) = &st.failed {
            return Err(e.clone());
        }
        let before = st.buf.len();
        for r in records {
            r.encode_into(&mut st.buf);
        }
        let n = records.len() as u64;
        st.buffered += n;
        st.appended += n;
        if !bulk {
            st.buffered_writes += n;
            self.counters.write_records.fetch_add(n, Ordering::Relaxed);
        }
        let lsn = st.appended;
        self.counters.records.fetch_add(n, Ordering::Relaxed);
        self.counters
            .bytes
            .fetch_add((st.buf.len() - before) as u64, Ordering::Relaxed);
        drop(st);
        log.wake.notify_one();
        Ok(Some(Ticket { log, lsn }))
    }

    /// Runs `then` once `ticket`'s record is durable: at once on this
    /// thread if it is already, else on the logger thread right after the
    /// batch holding it is synced. `then` gets an error if the record can
    /// no longer become durable.
    pub fn when_durable(&self, ticket: &Ticket, then: Waiter) {
        let mut st = ticket.log.state.lock();
        if st.durable >= ticket.lsn {
            drop(st);
            then(Ok(()));
        } else if let Some(e) = st.failed.clone() {
            drop(st);
            then(Err(e));
        } else {
            st.waiters.push((ticket.lsn, then));
        }
    }

    /// Appends `records` and blocks until they are durable (recovery
    /// tests; the service never blocks a handler thread on the log).
    pub fn append_and_wait(&self, records: &[LogRecord]) -> Result<(), String> {
        let Some(t) = self.append(records, false)? else {
            return Ok(());
        };
        let (tx, rx) = std::sync::mpsc::channel();
        self.when_durable(
            &t,
            Box::new(move |r| {
                let _ = tx.send(r);
            }),
        );
        rx.recv()
            .unwrap_or_else(|_| Err("the logger went away".into()))
    }

    /// Fault injection: no logger starts a batch until the returned guard
    /// is dropped, so that records accumulate (and their writes stay
    /// unacknowledged) deterministically.
    pub fn hold(&self) -> LogHold<'_> {
        self.held.store(true, Ordering::SeqCst);
        LogHold { wal: self }
    }

    /// Fault injection: the machine loses power. Batches not yet handed to
    /// `write(2)` are discarded, their writers get an error, and nothing is
    /// written from now on (what a batch already written survives, as
    /// after a process crash; with `log_sync=fsync`, every acknowledged
    /// record was synced before).
    pub fn crash(&self) {
        self.crashed.store(true, Ordering::SeqCst);
        // A dead process holds no lock.
        self.lock.lock().take();
        let logs: Vec<Arc<WorkerLog>> = self.logs.lock().values().cloned().collect();
        for log in logs {
            let waiters = log.fail("the memory node crashed".into());
            log.wake.notify_all();
            for w in waiters {
                w(Err("the memory node crashed".into()));
            }
        }
    }

    /// Replies (or other waiters) waiting for records to become durable.
    pub fn waiting(&self) -> usize {
        let logs: Vec<Arc<WorkerLog>> = self.logs.lock().values().cloned().collect();
        logs.iter().map(|l| l.state.lock().waiters.len()).sum()
    }

    fn wake_all(&self) {
        for log in self.logs.lock().values() {
            let _st = log.state.lock();
            log.wake.notify_all();
        }
    }
}

struct LoggerCtx {
    sync: LogSync,
    counters: Arc<WalCounters>,
    held: Arc<AtomicBool>,
    crashed: Arc<AtomicBool>,
}

/// The logger thread of one worker log (group commit): takes everything
/// buffered since its last batch, writes it with one `write(2)`, syncs it
/// once, then runs the waiters of every record it made durable. Records
/// buffered while it writes and syncs form the next batch.
fn logger(log: &WorkerLog, file: &mut File, path: &Path, ctx: &LoggerCtx) {
    let c = &ctx.counters;
    loop {
        let (batch, upto, writes) = {
            let mut st = log.state.lock();
            while !st.stop && (st.buf.is_empty() || ctx.held.load(Ordering::SeqCst)) {
                if dmkv_transport::sim::active() {
                    // One OS thread runs the simulated cluster: look again
                    // after a little virtual time instead of blocking it.
                    parking_lot::MutexGuard::unlocked(&mut st, || {
                        dmkv_transport::time::sleep_blocking(std::time::Duration::from_micros(5))
                    });
                } else {
                    log.wake.wait(&mut st);
                }
            }
            if st.buf.is_empty() || ctx.crashed.load(Ordering::SeqCst) {
                if st.stop {
                    break;
                }
                continue;
            }
            st.buffered = 0;
            let writes = std::mem::take(&mut st.buffered_writes);
            (std::mem::take(&mut st.buf), st.appended, writes)
        };
        let cpu = thread_cpu_ns();
        let wall = Instant::now();
        let res = file.write_all(&batch).and_then(|_| match ctx.sync {
            LogSync::Fsync => {
                c.syncs.fetch_add(1, Ordering::Relaxed);
                file.sync_data()
            }
            LogSync::None => Ok(()),
        });
        c.io_ns
            .fetch_add(wall.elapsed().as_nanos() as u64, Ordering::Relaxed);
        c.batches.fetch_add(1, Ordering::Relaxed);
        if writes > 0 {
            c.write_batches.fetch_add(1, Ordering::Relaxed);
            c.max_batch_writes.fetch_max(writes, Ordering::Relaxed);
        }
        let done: Vec<(Waiter, Result<(), String>)> = match res {
            Ok(()) => {
                let mut st = log.state.lock();
                st.durable = upto;
                let (ready, wait): (Vec<_>, Vec<_>) =
                    st.waiters.drain(..).partition(|(lsn, _)| *lsn <= upto);
                st.waiters = wait;
                ready.into_iter().map(|(_, w)| (w, Ok(()))).collect()
            }
            Err(e) => {
                let why = io("writing", path, e);
                log.fail(why.clone())
                    .into_iter()
                    .map(|w| (w, Err(why.clone())))
                    .collect()
            }
        };
        for (w, r) in done {
            w(r);
        }
        c.logger_cpu_ns
            .fetch_add(thread_cpu_ns().saturating_sub(cpu), Ordering::Relaxed);
    }
    // Stopped: whoever still waits learns that nothing more is written.
    for w in log.fail("the log was closed".into()) {
        w(Err("the log was closed".into()));
    }
}

fn sync_dir(dir: &Path) -> Result<(), String> {
    File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(|e| io("syncing", dir, e))
}

impl Drop for Wal {
    fn drop(&mut self) {
        for (log, handle) in self.loggers.lock().drain(..) {
            log.state.lock().stop = true;
            log.wake.notify_all();
            handle.join();
        }
        if self.temporary {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latest_version_wins_and_recovery_compacts() {
        let dir = std::env::temp_dir().join(format!("xstore-wal-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        {
            let (wal, rec) = Wal::open(Some(dir.clone()), LogSync::Fsync).unwrap();
            assert!(rec.pairs.is_empty());
            let v1 = wal.next_version();
            let v2 = wal.next_version();
            let v3 = wal.next_version();
            // Two workers, records out of version order across them.
            std::thread::scope(|s| {
                s.spawn(|| {
                    wal.append_and_wait(&[LogRecord {
                        version: v3,
                        key: 1,
                        op: LogOp::Put(b"new".to_vec()),
                    }])
                    .unwrap()
                });
            });
            wal.append_and_wait(&[
                LogRecord {
                    version: v1,
                    key: 1,
                    op: LogOp::Put(b"old".to_vec()),
                },
                LogRecord {
                    version: v2,
                    key: 2,
                    op: LogOp::Put(b"gone".to_vec()),
                },
            ])
            .unwrap();
            let v4 = wal.next_version();
            wal.append_and_wait(&[LogRecord {
                version: v4,
                key: 2,
                op: LogOp::Delete,
            }])
            .unwrap();
        }
        // A torn tail in one file is ignored.
        let files = log_files(&dir).unwrap();
        let mut f = OpenOptions::new().append(true).open(&files[0].1).unwrap();
        f.write_all(&[9, 0, 0, 0, 1, 2]).unwrap();
        drop(f);
        let (wal, rec) = Wal::open(Some(dir.clone()), LogSync::Fsync).unwrap();
        assert_eq!(rec.pairs, vec![(1, b"new".to_vec())]);
        assert_eq!(rec.max_version, 4);
        assert!(wal.next_version() > 4);
        drop(wal);
        // Only the snapshot is left, and it replays to the same state.
        let left = log_files(&dir).unwrap();
        assert_eq!(left.len(), 1, "{left:?}");
        let (_wal, again) = Wal::open(Some(dir.clone()), LogSync::None).unwrap();
        assert_eq!(again.pairs, vec![(1, b"new".to_vec())]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    fn put(wal: &Wal, key: u64, v: &[u8]) -> LogRecord {
        LogRecord {
            version: wal.next_version(),
            key,
            op: LogOp::Put(v.to_vec()),
        }
    }

    /// Records appended while the logger is held form one batch and one
    /// fdatasync; none is reported durable before it.
    #[test]
    fn group_commit_syncs_a_batch_once_and_answers_after() {
        let dir = std::env::temp_dir().join(format!("xstore-wal-group-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (wal, _) = Wal::open(Some(dir.clone()), LogSync::Fsync).unwrap();
        let done = Arc::new(Mutex::new(Vec::new()));
        let hold = wal.hold();
        let mut tickets = Vec::new();
        for k in 0..8u64 {
            let t = wal.append(&[put(&wal, k, b"v")], false).unwrap().unwrap();
            let d = done.clone();
            wal.when_durable(&t, Box::new(move |r| d.lock().push((k, r))));
            tickets.push(t);
        }
        assert!(done.lock().is_empty(), "nothing is durable while held");
        assert!(tickets.iter().all(|t| !t.is_durable()));
        drop(hold);
        // The logger answers from its thread: wait for all eight.
        while done.lock().len() < 8 {
            std::thread::yield_now();
        }
        assert!(done.lock().iter().all(|(_, r)| r.is_ok()));
        assert!(tickets.iter().all(|t| t.is_durable()));
        let c = &wal.counters;
        assert_eq!(c.syncs.load(Ordering::Relaxed), 1);
        assert_eq!(c.write_batches.load(Ordering::Relaxed), 1);
        assert_eq!(c.max_batch_writes.load(Ordering::Relaxed), 8);
        // A ticket already durable runs its waiter at once.
        let (tx, rx) = std::sync::mpsc::channel();
        wal.when_durable(&tickets[0], Box::new(move |r| tx.send(r).unwrap()));
        assert_eq!(rx.try_recv().unwrap(), Ok(()));
        drop(wal);
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A crash loses what was never written and fails its waiters; what was
    /// durable before is recovered.
    #[test]
    fn a_crash_fails_unwritten_records_and_keeps_durable_ones() {
        let dir = std::env::temp_dir().join(format!("xstore-wal-crash-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        {
            let (wal, _) = Wal::open(Some(dir.clone()), LogSync::Fsync).unwrap();
            wal.append_and_wait(&[put(&wal, 1, b"kept")]).unwrap();
            let hold = wal.hold();
            let t = wal
                .append(&[put(&wal, 2, b"lost")], false)
                .unwrap()
                .unwrap();
            let (tx, rx) = std::sync::mpsc::channel();
            wal.when_durable(&t, Box::new(move |r| tx.send(r).unwrap()));
            wal.crash();
            assert!(rx.recv().unwrap().is_err(), "an unwritten record fails");
            assert!(wal.append(&[put(&wal, 3, b"late")], false).is_err());
            drop(hold);
        }
        let (_wal, rec) = Wal::open(Some(dir.clone()), LogSync::Fsync).unwrap();
        assert_eq!(rec.pairs, vec![(1, b"kept".to_vec())]);
        drop(_wal);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
