//! Protocol messages (paper §3.5): small, fixed-size (64 bytes, one cache
//! line) requests and replies, carried by the transport's RPCs to the
//! node's message handler threads. Eviction batches (page provider to page
//! provider, §4.3) and membership messages are variable-length.
//!
//! Every message is encoded with `WireWriter` and parsed with `WireReader`;
//! a handler checks every field (page ids, modes, node indices, offsets)
//! before acting on it.

use crate::pid::Pid;
use dmkv_transport::{ServiceError, WireError, WireReader, WireWriter};

/// Size of every protocol request and reply.
pub const MSG_BYTES: usize = 64;
/// Most pages in one eviction batch (paper §4.3).
pub const EVICT_BATCH: usize = 100;

/// Message kinds, also the index of the per-kind counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// Ownership request to the directory.
    Request = 1,
    /// Ownership transfer: move the page to the requester (or just drop it:
    /// an invalidation).
    Move = 2,
    /// Copy a shared page to the requester.
    Copy = 3,
    /// FIFO variant: the transfer finished.
    Ack = 4,
    /// Remote allocation of a page id.
    Alloc = 5,
    /// Read a clean page from the directory's SSD after every listed copy
    /// turned out to be gone.
    SsdFetch = 6,
    /// Eviction batch to a directory.
    Evict = 7,
    /// Membership table.
    Members = 8,
    /// Figures for `engine_stats`.
    Stats = 9,
    /// A leaving node hands a shard's pages and directory entries over.
    Handover = 10,
}

pub const KINDS: [Kind; 10] = [
    Kind::Request,
    Kind::Move,
    Kind::Copy,
    Kind::Ack,
    Kind::Alloc,
    Kind::SsdFetch,
    Kind::Evict,
    Kind::Members,
    Kind::Stats,
    Kind::Handover,
];

impl Kind {
    pub fn from_u8(v: u8) -> Option<Kind> {
        KINDS.iter().copied().find(|k| *k as u8 == v)
    }
    pub fn name(self) -> &'static str {
        match self {
            Kind::Request => "request",
            Kind::Move => "move",
            Kind::Copy => "copy",
            Kind::Ack => "ack",
            Kind::Alloc => "alloc",
            Kind::SsdFetch => "ssd_fetch",
            Kind::Evict => "evict",
            Kind::Members => "members",
            Kind::Stats => "stats",
            Kind::Handover => "handover",
        }
    }
}

/// Which node-level ownership a request asks for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[repr(u8)]
pub enum Want {
    Shared = 1,
    Exclusive = 2,
}

impl Want {
    pub fn from_u8(v: u8) -> Result<Want, WireError> {
        match v {
            1 => Ok(Want::Shared),
            2 => Ok(Want::Exclusive),
            _ => Err(WireError(format!("ownership mode {v}"))),
        }
    }
}

/// Where a granted page comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Source {
    /// Already written into the requester's frame (from the directory's
    /// cache or SSD) before the reply.
    Written,
    /// The requester keeps the copy it has (an upgrade).
    Kept,
    /// Move it from this node, which drops it.
    Move(u8),
    /// Copy it from this sharer.
    Copy(u8),
}

impl Source {
    fn encode(self) -> (u8, u8) {
        match self {
            Source::Written => (0, 0),
            Source::Kept => (1, 0),
            Source::Move(n) => (2, n),
            Source::Copy(n) => (3, n),
        }
    }
    fn decode(k: u8, n: u8) -> Result<Source, WireError> {
        Ok(match k {
            0 => Source::Written,
            1 => Source::Kept,
            2 => Source::Move(n),
            3 => Source::Copy(n),
            _ => return Err(WireError(format!("page source {k}"))),
        })
    }
}

/// The directory's answer to an ownership request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Grant {
    /// The page's conflict epoch after this grant.
    pub epoch: u64,
    pub source: Source,
    /// Other nodes to invalidate (bitmap of node indices).
    pub invalidate: u64,
}

/// Replies of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    Grant(Grant),
    /// Could not latch now; send again.
    Busy,
    /// FIFO variant: queued behind other requesters; ask again.
    Queued,
    /// Done (a move, copy, invalidation, ack, SSD fetch).
    Done,
    /// The node has no copy (a move or copy found nothing to transfer).
    Gone,
    /// The shard is now hosted by this node index.
    Moved(u8),
    /// A page id allocated on the directory.
    /// ... at this conflict epoch.
    Allocated(Pid, u64),
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::with_capacity(MSG_BYTES);
        match *self {
            Reply::Grant(g) => {
                let (k, n) = g.source.encode();
                w.u8(0).u64(g.epoch).u8(k).u8(n).u64(g.invalidate);
            }
            Reply::Busy => {
                w.u8(1);
            }
            Reply::Queued => {
                w.u8(2);
            }
            Reply::Done => {
                w.u8(3);
            }
            Reply::Gone => {
                w.u8(4);
            }
            Reply::Moved(n) => {
                w.u8(5).u8(n);
            }
            Reply::Allocated(p, e) => {
                w.u8(6).u64(p.0).u64(e);
            }
        }
        pad(w)
    }

    pub fn decode(buf: &[u8]) -> Result<Reply, WireError> {
        if buf.len() != MSG_BYTES {
            return Err(WireError(format!("reply of {} bytes", buf.len())));
        }
        let mut r = WireReader::new(buf);
        Ok(match r.u8()? {
            0 => {
                let epoch = r.u64()?;
                let (k, n) = (r.u8()?, r.u8()?);
                Reply::Grant(Grant {
                    epoch,
                    source: Source::decode(k, n)?,
                    invalidate: r.u64()?,
                })
            }
            1 => Reply::Busy,
            2 => Reply::Queued,
            3 => Reply::Done,
            4 => Reply::Gone,
            5 => Reply::Moved(r.u8()?),
            6 => Reply::Allocated(Pid(r.u64()?), r.u64()?),
            s => return Err(WireError(format!("reply status {s}"))),
        })
    }
}

/// A protocol request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// To the directory: I (`from`) want `pid` in `want` mode, written into
    /// my frame at `offset`. `retry`: I hold no copy even if you think so.
    Own {
        pid: Pid,
        want: Want,
        retry: bool,
        offset: u64,
    },
    /// To a possessor: give up `pid` for the grant at `epoch`, writing it to
    /// `offset` first if `need_page`.
    Move {
        pid: Pid,
        epoch: u64,
        need_page: bool,
        offset: u64,
    },
    /// To a sharer: copy `pid` to `offset` for the grant at `epoch`.
    Copy {
        pid: Pid,
        epoch: u64,
        offset: u64,
    },
    Ack {
        pid: Pid,
    },
    Alloc,
    SsdFetch {
        pid: Pid,
        epoch: u64,
        offset: u64,
    },
    Stats,
}

impl Request {
    pub fn kind(&self) -> Kind {
        match self {
            Request::Own { .. } => Kind::Request,
            Request::Move { .. } => Kind::Move,
            Request::Copy { .. } => Kind::Copy,
            Request::Ack { .. } => Kind::Ack,
            Request::Alloc => Kind::Alloc,
            Request::SsdFetch { .. } => Kind::SsdFetch,
            Request::Stats => Kind::Stats,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::with_capacity(MSG_BYTES);
        w.u8(self.kind() as u8);
        match *self {
            Request::Own {
                pid,
                want,
                retry,
                offset,
            } => {
                w.u64(pid.0).u8(want as u8).bool(retry).u64(offset);
            }
            Request::Move {
                pid,
                epoch,
                need_page,
                offset,
            } => {
                w.u64(pid.0).u64(epoch).bool(need_page).u64(offset);
            }
            Request::Copy { pid, epoch, offset } | Request::SsdFetch { pid, epoch, offset } => {
                w.u64(pid.0).u64(epoch).u64(offset);
            }
            Request::Ack { pid } => {
                w.u64(pid.0);
            }
            Request::Alloc | Request::Stats => {}
        }
        pad(w)
    }

    pub fn decode(buf: &[u8]) -> Result<Request, ServiceError> {
        if buf.len() != MSG_BYTES {
            return Err(ServiceError::malformed(format!(
                "protocol messages are {MSG_BYTES} bytes, got {}",
                buf.len()
            )));
        }
        let mut r = WireReader::new(buf);
        let kind = r.u8()?;
        let kind = Kind::from_u8(kind)
            .ok_or_else(|| ServiceError::malformed(format!("unknown message kind {kind}")))?;
        Ok(match kind {
            Kind::Request => Request::Own {
                pid: Pid(r.u64()?),
                want: Want::from_u8(r.u8()?)?,
                retry: r.bool()?,
                offset: r.u64()?,
            },
            Kind::Move => Request::Move {
                pid: Pid(r.u64()?),
                epoch: r.u64()?,
                need_page: r.bool()?,
                offset: r.u64()?,
            },
            Kind::Copy => Request::Copy {
                pid: Pid(r.u64()?),
                epoch: r.u64()?,
                offset: r.u64()?,
            },
            Kind::SsdFetch => Request::SsdFetch {
                pid: Pid(r.u64()?),
                epoch: r.u64()?,
                offset: r.u64()?,
            },
            Kind::Ack => Request::Ack { pid: Pid(r.u64()?) },
            Kind::Alloc => Request::Alloc,
            Kind::Stats => Request::Stats,
            k => {
                return Err(ServiceError::malformed(format!(
                    "{} is not a protocol message",
                    k.name()
                )));
            }
        })
    }
}

fn pad(mut w: WireWriter) -> Vec<u8> {
    assert!(
        w.len() <= MSG_BYTES,
        "protocol messages fit in {MSG_BYTES} bytes"
    );
    let n = MSG_BYTES - w.len();
    w.raw(&[0u8; MSG_BYTES][..n]);
    w.finish()
}

/// One page of an eviction batch: the evicting node's conflict epoch and
/// where the page is in its cache (for the directory's one-sided read).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictEntry {
    pub pid: Pid,
    pub epoch: u64,
    pub offset: u64,
}

pub fn encode_evict(entries: &[EvictEntry]) -> Vec<u8> {
    assert!(entries.len() <= EVICT_BATCH);
    let mut w = WireWriter::with_capacity(5 + 24 * entries.len());
    w.u8(Kind::Evict as u8).u32(entries.len() as u32);
    for e in entries {
        w.u64(e.pid.0).u64(e.epoch).u64(e.offset);
    }
    w.finish()
}

pub fn decode_evict(buf: &[u8]) -> Result<Vec<EvictEntry>, ServiceError> {
    let mut r = WireReader::new(buf);
    if r.u8()? != Kind::Evict as u8 {
        return Err(ServiceError::malformed("not an eviction batch"));
    }
    let n = r.count(24)?;
    if n > EVICT_BATCH {
        return Err(ServiceError::malformed(format!(
            "eviction batch of {n} pages exceeds {EVICT_BATCH}"
        )));
    }
    let v = (0..n)
        .map(|_| {
            Ok(EvictEntry {
                pid: Pid(r.u64()?),
                epoch: r.u64()?,
                offset: r.u64()?,
            })
        })
        .collect::<Result<Vec<_>, WireError>>()?;
    r.end()?;
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_are_one_cache_line_and_round_trip() {
        let reqs = [
            Request::Own {
                pid: Pid::new(2, 9),
                want: Want::Exclusive,
                retry: true,
                offset: 4096,
            },
            Request::Move {
                pid: Pid::new(1, 1),
                epoch: 7,
                need_page: false,
                offset: 0,
            },
            Request::Copy {
                pid: Pid::new(0, 3),
                epoch: 1,
                offset: 8192,
            },
            Request::Ack {
                pid: Pid::new(0, 0),
            },
            Request::Alloc,
            Request::Stats,
        ];
        for q in reqs {
            let b = q.encode();
            assert_eq!(b.len(), MSG_BYTES);
            assert_eq!(Request::decode(&b).unwrap(), q);
        }
        let replies = [
            Reply::Grant(Grant {
                epoch: 3,
                source: Source::Move(4),
                invalidate: 0b1010,
            }),
            Reply::Busy,
            Reply::Moved(3),
            Reply::Allocated(Pid::new(1, 2), 9),
        ];
        for r in replies {
            assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        }
        assert!(Request::decode(&[1; 10]).is_err());
        let e = [EvictEntry {
            pid: Pid::new(1, 5),
            epoch: 2,
            offset: 4096,
        }];
        assert_eq!(decode_evict(&encode_evict(&e)).unwrap(), e);
    }
}
