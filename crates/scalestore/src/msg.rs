//! Protocol messages (paper §3.5): small, fixed-size (64 bytes, one cache
//! line) requests and replies, carried by the transport's RPCs to the
//! node's message handler. Eviction batches (page provider to page provider,
//! §4.3), membership and handover messages are variable-length.
//!
//! Every message is encoded with `WireWriter` and parsed with `WireReader`;
//! the handler checks every field (page ids, modes, node indices, offsets,
//! counts) before acting on it.

use crate::pid::Pid;
use dmkv_transport::{
    AccessKey, NodeId, RegionId, RemoteRegion, ServiceError, ServiceId, WireError, WireReader,
    WireWriter,
};

/// Size of every fixed-size protocol request and reply.
pub const MSG_BYTES: usize = 64;
/// Most pages in one eviction batch (paper §4.3).
pub const EVICT_BATCH: usize = 100;
/// Pages per handover message of a leaving node.
pub const HANDOVER_PAGES: usize = 16;
/// Directory entries per handover message.
pub const HANDOVER_ENTRIES: usize = 256;

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
    /// A node introduces itself (at connect, or when it joins).
    Hello = 8,
    /// A leaving node asks its successor to adopt a directory shard.
    Adopt = 10,
    /// Page-file contents of an adopted shard.
    HandoverPages = 11,
    /// Directory entries of an adopted shard.
    HandoverEntries = 12,
    /// The successor now hosts the adopted shard.
    HostShard = 13,
    /// A node left; its shards moved.
    Depart = 14,
}

pub const KINDS: [Kind; 13] = [
    Kind::Request,
    Kind::Move,
    Kind::Copy,
    Kind::Ack,
    Kind::Alloc,
    Kind::SsdFetch,
    Kind::Evict,
    Kind::Hello,
    Kind::Adopt,
    Kind::HandoverPages,
    Kind::HandoverEntries,
    Kind::HostShard,
    Kind::Depart,
];

/// One more than the largest kind (size of per-kind counter arrays).
pub const KIND_SLOTS: usize = 16;
const _: () = assert!((Kind::Depart as usize) < KIND_SLOTS);

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
            Kind::Hello => "hello",
            Kind::Adopt => "adopt",
            Kind::HandoverPages => "handover_pages",
            Kind::HandoverEntries => "handover_entries",
            Kind::HostShard => "host_shard",
            Kind::Depart => "depart",
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

/// Fixed-size replies of the protocol.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reply {
    Grant(Grant),
    /// Done (a move, copy, invalidation, ack, SSD fetch, handover step).
    Done,
    /// The node has no copy (a move or copy found nothing to transfer).
    Gone,
    /// The shard is now hosted by this node index: ask there.
    Moved(u8),
    /// A page id allocated on the directory, at this conflict epoch.
    Allocated(Pid, u64),
    /// The directory is handing the shard over (its host is leaving):
    /// nothing is decided now. The requester lets go of every latch it
    /// holds (its operation restarts) and asks again; it then reaches the
    /// successor through `Moved`.
    Retry,
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::with_capacity(MSG_BYTES);
        match *self {
            Reply::Grant(g) => {
                let (k, n) = g.source.encode();
                w.u8(0).u64(g.epoch).u8(k).u8(n).u64(g.invalidate);
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
            Reply::Retry => {
                w.u8(7);
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
            3 => Reply::Done,
            4 => Reply::Gone,
            5 => Reply::Moved(r.u8()?),
            6 => Reply::Allocated(Pid(r.u64()?), r.u64()?),
            7 => Reply::Retry,
            s => return Err(WireError(format!("reply status {s}"))),
        })
    }
}

/// What a node publishes about itself to its peers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    pub index: u8,
    pub region: RemoteRegion,
    pub service: ServiceId,
}

/// A fixed-size protocol request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// To the directory: the sender wants `pid` in `want` mode, written
    /// into its cache at `offset`. `retry`: the sender holds no copy even
    /// if the directory lists it (its copy from a sharer failed).
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
    Hello(Hello),
    /// To a successor: adopt `shard`, whose next free slot and epoch clock
    /// are given.
    Adopt {
        shard: u8,
        next_slot: u64,
        clock: u64,
    },
    /// To a successor: from now on host `shard`.
    HostShard {
        shard: u8,
    },
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
            Request::Hello(_) => Kind::Hello,
            Request::Adopt { .. } => Kind::Adopt,
            Request::HostShard { .. } => Kind::HostShard,
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
            Request::Alloc => {}
            Request::Hello(h) => {
                w.u8(h.index)
                    .u16(h.region.node.0)
                    .u32(h.region.id.0)
                    .u64(h.region.key.0)
                    .u64(h.region.len)
                    .u32(h.service.0);
            }
            Request::Adopt {
                shard,
                next_slot,
                clock,
            } => {
                w.u8(shard).u64(next_slot).u64(clock);
            }
            Request::HostShard { shard } => {
                w.u8(shard);
            }
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
            Kind::Hello => Request::Hello(Hello {
                index: r.u8()?,
                region: RemoteRegion {
                    node: NodeId(r.u16()?),
                    id: RegionId(r.u32()?),
                    key: AccessKey(r.u64()?),
                    len: r.u64()?,
                },
                service: ServiceId(r.u32()?),
            }),
            Kind::Adopt => Request::Adopt {
                shard: r.u8()?,
                next_slot: r.u64()?,
                clock: r.u64()?,
            },
            Kind::HostShard => Request::HostShard { shard: r.u8()? },
            k => {
                return Err(ServiceError::malformed(format!(
                    "{} is not a fixed-size protocol message",
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

// ---- eviction batches ------------------------------------------------------

/// One page of an eviction batch: the evicting node's conflict epoch for
/// its copy, where the copy is in its cache (for the directory's one-sided
/// read of a dirty last copy), and how many copies it served to sharers
/// since it got the page (the directory declines while some copy it told a
/// requester to take from this node has not been served: owner stability
/// for copy sources).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EvictEntry {
    pub pid: Pid,
    pub epoch: u64,
    pub offset: u64,
    pub copies: u32,
}

const EVICT_ENTRY_BYTES: usize = 28;

pub fn encode_evict(entries: &[EvictEntry]) -> Vec<u8> {
    assert!(entries.len() <= EVICT_BATCH);
    let mut w = WireWriter::with_capacity(5 + EVICT_ENTRY_BYTES * entries.len());
    w.u8(Kind::Evict as u8).u32(entries.len() as u32);
    for e in entries {
        w.u64(e.pid.0).u64(e.epoch).u64(e.offset).u32(e.copies);
    }
    w.finish()
}

pub fn decode_evict(buf: &[u8]) -> Result<Vec<EvictEntry>, ServiceError> {
    let mut r = WireReader::new(buf);
    if r.u8()? != Kind::Evict as u8 {
        return Err(ServiceError::malformed("not an eviction batch"));
    }
    let n = r.count(EVICT_ENTRY_BYTES)?;
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
                copies: r.u32()?,
            })
        })
        .collect::<Result<Vec<_>, WireError>>()?;
    r.end()?;
    Ok(v)
}

/// The directory's answer to an eviction batch.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictReply {
    /// One flag per entry: accepted (drop your copy) or declined (keep it).
    Decided(Vec<bool>),
    /// The shard moved to this node index: send the batch there.
    Moved(u8),
}

impl EvictReply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::new();
        match self {
            EvictReply::Decided(v) => {
                w.u8(0).u32(v.len() as u32);
                for a in v {
                    w.bool(*a);
                }
            }
            EvictReply::Moved(h) => {
                w.u8(5).u8(*h);
            }
        }
        w.finish()
    }

    pub fn decode(buf: &[u8], expect: usize) -> Result<EvictReply, WireError> {
        let mut r = WireReader::new(buf);
        let out = match r.u8()? {
            0 => {
                let n = r.count(1)?;
                if n != expect {
                    return Err(WireError(format!(
                        "{n} eviction decisions for {expect} pages"
                    )));
                }
                EvictReply::Decided((0..n).map(|_| r.bool()).collect::<Result<_, _>>()?)
            }
            5 => EvictReply::Moved(r.u8()?),
            s => return Err(WireError(format!("eviction reply status {s}"))),
        };
        r.end()?;
        Ok(out)
    }
}

// ---- membership ------------------------------------------------------------

/// A node's answer to a [`Hello`]: the members it knows (index, node id)
/// and which member hosts each directory shard it knows of.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Welcome {
    pub members: Vec<(u8, NodeId)>,
    pub hosts: Vec<(u8, u8)>,
}

impl Welcome {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::new();
        w.u32(self.members.len() as u32);
        for (i, n) in &self.members {
            w.u8(*i).u16(n.0);
        }
        w.u32(self.hosts.len() as u32);
        for (s, h) in &self.hosts {
            w.u8(*s).u8(*h);
        }
        w.finish()
    }

    pub fn decode(buf: &[u8]) -> Result<Welcome, WireError> {
        let mut r = WireReader::new(buf);
        let n = r.count(3)?;
        let members = (0..n)
            .map(|_| Ok((r.u8()?, NodeId(r.u16()?))))
            .collect::<Result<Vec<_>, WireError>>()?;
        let n = r.count(2)?;
        let hosts = (0..n)
            .map(|_| Ok((r.u8()?, r.u8()?)))
            .collect::<Result<Vec<_>, WireError>>()?;
        r.end()?;
        Ok(Welcome { members, hosts })
    }
}

/// A node left: it is no member any more, and its shards are hosted
/// elsewhere. `(shard, new host)` pairs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Depart {
    pub index: u8,
    pub moved: Vec<(u8, u8)>,
}

impl Depart {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::new();
        w.u8(Kind::Depart as u8)
            .u8(self.index)
            .u32(self.moved.len() as u32);
        for (s, h) in &self.moved {
            w.u8(*s).u8(*h);
        }
        w.finish()
    }

    pub fn decode(buf: &[u8]) -> Result<Depart, ServiceError> {
        let mut r = WireReader::new(buf);
        if r.u8()? != Kind::Depart as u8 {
            return Err(ServiceError::malformed("not a departure"));
        }
        let index = r.u8()?;
        let n = r.count(2)?;
        let moved = (0..n)
            .map(|_| Ok((r.u8()?, r.u8()?)))
            .collect::<Result<Vec<_>, WireError>>()?;
        r.end()?;
        Ok(Depart { index, moved })
    }
}

// ---- handover of a leaving node's shard ------------------------------------

/// Who possesses a page, as the directory sees it (wire form of
/// `frames::Owners`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WireOwners {
    None,
    Exclusive(u8),
    Shared(u64),
}

/// One directory entry handed to a successor.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct EntryState {
    pub pid: Pid,
    pub owners: WireOwners,
    pub epoch: u64,
    pub dirty: bool,
    pub prev_dirty: bool,
    /// Copies granted from each sharer and not yet known to be served.
    pub copy_grants: Vec<(u8, u32)>,
}

pub fn encode_entries(shard: u8, entries: &[EntryState]) -> Vec<u8> {
    assert!(entries.len() <= HANDOVER_ENTRIES);
    let mut w = WireWriter::new();
    w.u8(Kind::HandoverEntries as u8)
        .u8(shard)
        .u32(entries.len() as u32);
    for e in entries {
        w.u64(e.pid.0);
        match e.owners {
            WireOwners::None => w.u8(0).u64(0),
            WireOwners::Exclusive(n) => w.u8(1).u64(n as u64),
            WireOwners::Shared(s) => w.u8(2).u64(s),
        };
        w.u64(e.epoch).bool(e.dirty).bool(e.prev_dirty);
        w.u32(e.copy_grants.len() as u32);
        for (s, c) in &e.copy_grants {
            w.u8(*s).u32(*c);
        }
    }
    w.finish()
}

pub fn decode_entries(buf: &[u8]) -> Result<(u8, Vec<EntryState>), ServiceError> {
    let mut r = WireReader::new(buf);
    if r.u8()? != Kind::HandoverEntries as u8 {
        return Err(ServiceError::malformed("not a handover of entries"));
    }
    let shard = r.u8()?;
    let n = r.count(30)?;
    if n > HANDOVER_ENTRIES {
        return Err(ServiceError::malformed(format!(
            "{n} entries in one handover"
        )));
    }
    let mut out = Vec::with_capacity(n);
    for _ in 0..n {
        let pid = Pid(r.u64()?);
        let (k, v) = (r.u8()?, r.u64()?);
        let owners = match k {
            0 => WireOwners::None,
            1 if v < 64 => WireOwners::Exclusive(v as u8),
            2 if v != 0 => WireOwners::Shared(v),
            _ => return Err(ServiceError::malformed(format!("owners {k}/{v}"))),
        };
        let epoch = r.u64()?;
        let dirty = r.bool()?;
        let prev_dirty = r.bool()?;
        let c = r.count(5)?;
        if c > 64 {
            return Err(ServiceError::malformed("more copy sources than nodes"));
        }
        let copy_grants = (0..c)
            .map(|_| Ok((r.u8()?, r.u32()?)))
            .collect::<Result<Vec<_>, WireError>>()?;
        out.push(EntryState {
            pid,
            owners,
            epoch,
            dirty,
            prev_dirty,
            copy_grants,
        });
    }
    r.end()?;
    Ok((shard, out))
}

pub fn encode_pages(shard: u8, pages: &[(u64, Vec<u8>)]) -> Vec<u8> {
    assert!(pages.len() <= HANDOVER_PAGES);
    let mut w = WireWriter::new();
    w.u8(Kind::HandoverPages as u8)
        .u8(shard)
        .u32(pages.len() as u32);
    for (slot, bytes) in pages {
        assert_eq!(bytes.len(), crate::page::PAGE_SIZE);
        w.u64(*slot).raw(bytes);
    }
    w.finish()
}

pub type PageBatch = (u8, Vec<(u64, Vec<u8>)>);

pub fn decode_pages(buf: &[u8]) -> Result<PageBatch, ServiceError> {
    let mut r = WireReader::new(buf);
    if r.u8()? != Kind::HandoverPages as u8 {
        return Err(ServiceError::malformed("not a handover of pages"));
    }
    let shard = r.u8()?;
    let n = r.count(8 + crate::page::PAGE_SIZE)?;
    if n > HANDOVER_PAGES {
        return Err(ServiceError::malformed(format!(
            "{n} pages in one handover"
        )));
    }
    let pages = (0..n)
        .map(|_| Ok((r.u64()?, r.raw(crate::page::PAGE_SIZE)?.to_vec())))
        .collect::<Result<Vec<_>, WireError>>()?;
    r.end()?;
    Ok((shard, pages))
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
            Request::SsdFetch {
                pid: Pid::new(3, 4),
                epoch: 2,
                offset: 0,
            },
            Request::Hello(Hello {
                index: 3,
                region: RemoteRegion {
                    node: NodeId(7),
                    id: RegionId(2),
                    key: AccessKey(99),
                    len: 1 << 20,
                },
                service: ServiceId(5),
            }),
            Request::Adopt {
                shard: 4,
                next_slot: 100,
                clock: 77,
            },
            Request::HostShard { shard: 4 },
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
            Reply::Done,
            Reply::Gone,
            Reply::Moved(3),
            Reply::Retry,
            Reply::Allocated(Pid::new(1, 2), 9),
        ];
        for r in replies {
            assert_eq!(Reply::decode(&r.encode()).unwrap(), r);
        }
        assert!(Request::decode(&[1; 10]).is_err());
    }

    #[test]
    fn variable_messages_round_trip() {
        let e = [EvictEntry {
            pid: Pid::new(1, 5),
            epoch: 2,
            offset: 4096,
            copies: 3,
        }];
        assert_eq!(decode_evict(&encode_evict(&e)).unwrap(), e);
        for r in [EvictReply::Decided(vec![true, false]), EvictReply::Moved(2)] {
            let n = if let EvictReply::Decided(v) = &r {
                v.len()
            } else {
                0
            };
            assert_eq!(EvictReply::decode(&r.encode(), n).unwrap(), r);
        }
        assert!(EvictReply::decode(&EvictReply::Decided(vec![true]).encode(), 2).is_err());
        let w = Welcome {
            members: vec![(0, NodeId(1)), (2, NodeId(5))],
            hosts: vec![(0, 0), (1, 2)],
        };
        assert_eq!(Welcome::decode(&w.encode()).unwrap(), w);
        let d = Depart {
            index: 1,
            moved: vec![(1, 0)],
        };
        assert_eq!(Depart::decode(&d.encode()).unwrap(), d);
        let es = vec![EntryState {
            pid: Pid::new(1, 2),
            owners: WireOwners::Shared(0b101),
            epoch: 9,
            dirty: true,
            prev_dirty: false,
            copy_grants: vec![(2, 1)],
        }];
        assert_eq!(decode_entries(&encode_entries(1, &es)).unwrap(), (1, es));
        let pages = vec![(3u64, vec![7u8; crate::page::PAGE_SIZE])];
        assert_eq!(decode_pages(&encode_pages(1, &pages)).unwrap(), (1, pages));
    }
}
