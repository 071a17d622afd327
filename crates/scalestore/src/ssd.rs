//! The SSD of one directory shard: a file of 4 KiB page slots under the
//! data directory, opened with `O_DIRECT` (paper §4.3), written in batches
//! through io_uring (the paper used libaio; io_uring is its successor).
//!
//! Falls back, and says so in the stats, where the file system refuses
//! `O_DIRECT` (tmpfs) or the kernel refuses io_uring (seccomp): then plain
//! buffered `pwrite`/`pread`. Reads are synchronous `pread`s of one page.
//!
//! This module holds the crate's only `unsafe`: pushing io_uring
//! submissions, whose buffers must outlive the kernel's use of them.

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
    reads: AtomicU64,
    writes: AtomicU64,
}

impl PageFile {
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
            ring: Mutex::new(io_uring::IoUring::new(128).ok()),
            reads: AtomicU64::new(0),
            writes: AtomicU64::new(0),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Whether the file is opened with `O_DIRECT`.
    pub fn direct(&self) -> bool {
        self.direct
    }

    /// Whether batched writes go through io_uring.
    pub fn uring(&self) -> bool {
        #[cfg(target_os = "linux")]
        {
            self.ring.lock().is_some()
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

    /// Reads page `slot` into `out`; a slot never written reads as zeroes.
    pub fn read(&self, slot: u64, out: &mut AlignedPage) -> io::Result<()> {
        self.reads.fetch_add(1, Ordering::Relaxed);
        dmkv_transport::sim::ssd_io_blocking(self.node, false, 1);
        let pos = slot * PAGE_SIZE as u64;
        let buf = out.bytes_mut();
        let mut done = 0;
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
}
