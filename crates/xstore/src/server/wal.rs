//! Durability (§5.4): per-worker write-ahead logs on the memory node's
//! local disk, a batching logger thread per log, and recovery.
//!
//! A worker (RPC handler thread) applies a write to XTree, appends the
//! record `(key, value or delete, version)` to its own log buffer, and
//! waits until its logger thread reports the record durable; only then is
//! the write acknowledged. The logger writes out whatever has accumulated
//! since its last write as one batch, then (with `log_sync=fsync`)
//! `fdatasync`s the file once for the batch. "Durable" means: after
//! `fdatasync` returned (fsync), or after `write(2)` returned (none: the
//! record survives a crash of the process but not of the machine).
//!
//! Versions are assigned by the writer while it holds its key's stripe
//! lock, so versions of one key are in the order the writes were applied;
//! recovery keeps the highest version of every key.
//!
//! Files: `<dir>/e<epoch>-w<worker>.log`, and `e<epoch>-snapshot.log`
//! written by a recovery (the recovered state, as records) before the
//! older epochs' files are removed.

use crate::config::LogSync;
use crate::layout::{LogOp, LogRecord};
use parking_lot::{Condvar, Mutex};
use std::collections::{BTreeMap, HashMap};
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::thread::{JoinHandle, ThreadId};

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

#[derive(Default)]
struct LogState {
    buf: Vec<u8>,
    appended: u64,
    durable: u64,
    failed: Option<String>,
    stop: bool,
}

struct WorkerLog {
    state: Mutex<LogState>,
    /// The logger waits on it for records; writers wait on it for
    /// durability.
    wake: Condvar,
    done: Condvar,
}

/// Figures for `engine_stats`.
#[derive(Debug, Default)]
pub struct WalCounters {
    pub records: AtomicU64,
    pub bytes: AtomicU64,
    pub batches: AtomicU64,
    pub syncs: AtomicU64,
}

/// The logs of one memory node.
pub struct Wal {
    dir: PathBuf,
    epoch: u64,
    sync: LogSync,
    temporary: bool,
    logs: Mutex<HashMap<ThreadId, Arc<WorkerLog>>>,
    loggers: Mutex<Vec<(Arc<WorkerLog>, JoinHandle<()>)>>,
    next_version: AtomicU64,
    pub counters: Arc<WalCounters>,
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
            counters: Arc::new(WalCounters::default()),
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
            state: Mutex::new(LogState::default()),
            wake: Condvar::new(),
            done: Condvar::new(),
        });
        let l = log.clone();
        let sync = self.sync;
        let counters = self.counters.clone();
        let handle = std::thread::Builder::new()
            .name(format!("xstore-log-w{w}"))
            .spawn(move || logger(&l, &mut file, &path, sync, &counters))
            .map_err(|e| format!("starting a logger thread: {e}"))?;
        self.loggers.lock().push((log.clone(), handle));
        logs.insert(me, log.clone());
        Ok(log)
    }

    /// Appends `records` to the calling worker's log and waits until they
    /// are durable.
    pub fn append_and_wait(&self, records: &[LogRecord]) -> Result<(), String> {
        if records.is_empty() {
            return Ok(());
        }
        let log = self.worker_log()?;
        let mut st = log.state.lock();
        let before = st.buf.len();
        for r in records {
            r.encode_into(&mut st.buf);
        }
        self.counters
            .records
            .fetch_add(records.len() as u64, Ordering::Relaxed);
        self.counters
            .bytes
            .fetch_add((st.buf.len() - before) as u64, Ordering::Relaxed);
        st.appended += 1;
        let lsn = st.appended;
        log.wake.notify_one();
        while st.durable < lsn {
            if let Some(e) = &st.failed {
                return Err(e.clone());
            }
            log.done.wait(&mut st);
        }
        Ok(())
    }
}

/// The logger thread of one worker log: writes out each accumulated batch
/// and syncs it once.
fn logger(log: &WorkerLog, file: &mut File, path: &Path, sync: LogSync, c: &WalCounters) {
    loop {
        let (batch, upto) = {
            let mut st = log.state.lock();
            while st.buf.is_empty() && !st.stop {
                log.wake.wait(&mut st);
            }
            if st.buf.is_empty() && st.stop {
                return;
            }
            (std::mem::take(&mut st.buf), st.appended)
        };
        let res = file.write_all(&batch).and_then(|_| match sync {
            LogSync::Fsync => {
                c.syncs.fetch_add(1, Ordering::Relaxed);
                file.sync_data()
            }
            LogSync::None => Ok(()),
        });
        c.batches.fetch_add(1, Ordering::Relaxed);
        let mut st = log.state.lock();
        match res {
            Ok(()) => st.durable = upto,
            Err(e) => st.failed = Some(io("writing", path, e)),
        }
        log.done.notify_all();
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
            let _ = handle.join();
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
}
