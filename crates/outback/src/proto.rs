//! The RPC messages between compute and memory nodes, built with
//! [`WireWriter`] and parsed with [`WireReader`] (bounds-checked; a short or
//! over-long payload is a malformed request, never a panic).
//!
//! Every data request names its target: shard, table, the table epoch the
//! client believes in, bucket, and the caller's compute-node id. A GET adds
//! only the slot (paper §4.3.1: the memory node computes nothing); writes
//! add the key and value. Replies start with [`ReplyHead`].

use crate::server::session::Session;
use dmkv_transport::{WireError, WireReader, WireWriter};

pub mod op {
    pub const GET: u8 = 1;
    pub const MAKEUP_GET: u8 = 2;
    pub const INSERT: u8 = 3;
    pub const UPSERT: u8 = 4;
    pub const UPDATE: u8 = 5;
    pub const DELETE: u8 = 6;
    // 7 was RESULT (the outcome of a buffered write, asked later); writes
    // during a rebuild are answered at once now (invariant 17).
    pub const LOAD: u8 = 8;
    pub const BUILD: u8 = 9;
    pub const REGISTER: u8 = 10;
    pub const DEREGISTER: u8 = 11;
    /// Resolve replica mirrors (once, after every node is served).
    pub const INIT: u8 = 12;
    pub const TAKEOVER: u8 = 13;
    pub const FENCE: u8 = 14;
    pub const STATS: u8 = 15;
}

/// Outcome of a request, first byte of every data reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Status {
    /// Done (found, inserted, updated, deleted, ready).
    Ok = 0,
    NotFound = 1,
    /// Insert of an existing key (an upsert reports an update this way).
    Exists = 2,
    /// The table epoch is not current: fetch the new locator and retry.
    Stale = 3,
    // 4 was BUFFERED (a write during a rebuild, answered later).
    /// This node does not serve the shard (ask a replica to take over).
    NotOwner = 5,
    /// Not ready yet (taking over, initialising): retry.
    Recovering = 6,
    /// Refused (takeover of a shard whose primary is alive).
    Refused = 7,
}

impl Status {
    pub fn from_u8(v: u8) -> Option<Status> {
        Some(match v {
            0 => Status::Ok,
            1 => Status::NotFound,
            2 => Status::Exists,
            3 => Status::Stale,
            5 => Status::NotOwner,
            6 => Status::Recovering,
            7 => Status::Refused,
            _ => return None,
        })
    }
}

/// Reply flag: the shard is preparing or running a resize (PRE_RESIZE).
pub const FLAG_PRE_RESIZE: u8 = 1;
/// Reply flag (GET): the slot's cache bit is set.
pub const FLAG_CACHE: u8 = 2;
/// Reply flag (GET): the table is being rebuilt and some key of the
/// bucket has a write answered meanwhile (invariant 17); on a key mismatch
/// the client asks MAKEUP GET, as for the cache bit.
pub const FLAG_BUFFERED: u8 = 4;

/// Bytes of a [`ReplyHead`].
pub const REPLY_HEAD_LEN: usize = 3;

/// `status u8 | flags u8 | seed u8`: the bucket's latest seed rides on every
/// data reply, which is how compute nodes learn new seeds lazily.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ReplyHead {
    pub status: Status,
    pub flags: u8,
    pub seed: u8,
}

impl ReplyHead {
    pub fn new(status: Status) -> ReplyHead {
        ReplyHead {
            status,
            flags: 0,
            seed: 0,
        }
    }
    pub fn write(&self, w: &mut WireWriter) {
        w.u8(self.status as u8).u8(self.flags).u8(self.seed);
    }
    pub fn read(r: &mut WireReader<'_>) -> Result<ReplyHead, WireError> {
        let status = r.u8()?;
        Ok(ReplyHead {
            status: Status::from_u8(status)
                .ok_or_else(|| WireError(format!("unknown status {status}")))?,
            flags: r.u8()?,
            seed: r.u8()?,
        })
    }
    /// The head at the start of a reply (what [`ReplyHead::read`] reads,
    /// with the same checks, without a reader).
    pub fn parse(reply: &[u8]) -> Result<ReplyHead, WireError> {
        let Some(&[status, flags, seed]) = reply.first_chunk::<REPLY_HEAD_LEN>() else {
            return Err(WireError(format!(
                "reply head: need {REPLY_HEAD_LEN} bytes, reply has {}",
                reply.len()
            )));
        };
        Ok(ReplyHead {
            status: Status::from_u8(status)
                .ok_or_else(|| WireError(format!("unknown status {status}")))?,
            flags,
            seed,
        })
    }
    pub fn pre_resize(&self) -> bool {
        self.flags & FLAG_PRE_RESIZE != 0
    }
    pub fn cache(&self) -> bool {
        self.flags & FLAG_CACHE != 0
    }
    pub fn buffered(&self) -> bool {
        self.flags & FLAG_BUFFERED != 0
    }
}

/// Which bucket of which table a request is about.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Target {
    pub shard: u16,
    pub table: u32,
    pub epoch: u32,
    pub bucket: u32,
    pub compute: u32,
}

impl Target {
    pub fn write(&self, w: &mut WireWriter) {
        w.u16(self.shard)
            .u32(self.table)
            .u32(self.epoch)
            .u32(self.bucket)
            .u32(self.compute);
    }
    pub fn read(r: &mut WireReader<'_>) -> Result<Target, WireError> {
        Ok(Target {
            shard: r.u16()?,
            table: r.u32()?,
            epoch: r.u32()?,
            bucket: r.u32()?,
            compute: r.u32()?,
        })
    }
}

/// Bytes of a GET request: op, [`Target`] (18 bytes), slot.
pub const GET_LEN: usize = 20;

/// A GET request, encoded in one fixed-size step (the GET path's encoding;
/// the same bytes as `DataReq::Get { .. }.encode()`, which calls it).
pub fn encode_get(t: &Target, slot: u8) -> Vec<u8> {
    encode_get_into(t, slot, Vec::new())
}

/// [`encode_get`] appended to `buf` (an endpoint's `request_buffer`: a GET
/// then allocates nothing on the client).
pub fn encode_get_into(t: &Target, slot: u8, mut buf: Vec<u8>) -> Vec<u8> {
    let mut b = [0u8; GET_LEN];
    b[0] = op::GET;
    b[1..3].copy_from_slice(&t.shard.to_le_bytes());
    b[3..7].copy_from_slice(&t.table.to_le_bytes());
    b[7..11].copy_from_slice(&t.epoch.to_le_bytes());
    b[11..15].copy_from_slice(&t.bucket.to_le_bytes());
    b[15..19].copy_from_slice(&t.compute.to_le_bytes());
    b[19] = slot;
    buf.extend_from_slice(&b);
    buf
}

/// A whole request that is a well-formed GET, decoded in one step; `None`
/// for anything else (which [`DataReq::decode`] then parses or rejects).
pub fn decode_get(req: &[u8]) -> Option<(Target, u8)> {
    let b: &[u8; GET_LEN] = req.try_into().ok()?;
    if b[0] != op::GET {
        return None;
    }
    let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
    let t = Target {
        shard: u16::from_le_bytes([b[1], b[2]]),
        table: u32_at(3),
        epoch: u32_at(7),
        bucket: u32_at(11),
        compute: u32_at(15),
    };
    Some((t, b[19]))
}

fn read_session(r: &mut WireReader<'_>) -> Result<Session, WireError> {
    Ok(Session {
        id: r.u64()?,
        seq: r.u64()?,
    })
}

/// A data request, decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DataReq<'a> {
    Get {
        t: Target,
        slot: u8,
    },
    MakeupGet {
        t: Target,
        key: u64,
    },
    /// Insert (`upsert` false) or upsert. Writes carry their session
    /// (at-most-once across a takeover, `server::session`).
    Insert {
        t: Target,
        key: u64,
        s: Session,
        value: &'a [u8],
        upsert: bool,
    },
    Update {
        t: Target,
        slot: u8,
        key: u64,
        s: Session,
        value: &'a [u8],
    },
    Delete {
        t: Target,
        slot: u8,
        key: u64,
        s: Session,
    },
}

impl DataReq<'_> {
    pub fn target(&self) -> &Target {
        match self {
            DataReq::Get { t, .. }
            | DataReq::MakeupGet { t, .. }
            | DataReq::Insert { t, .. }
            | DataReq::Update { t, .. }
            | DataReq::Delete { t, .. } => t,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::with_capacity(32);
        match self {
            DataReq::Get { t, slot } => return encode_get(t, *slot),
            DataReq::MakeupGet { t, key } => {
                w.u8(op::MAKEUP_GET);
                t.write(&mut w);
                w.u64(*key);
            }
            DataReq::Insert {
                t,
                key,
                s,
                value,
                upsert,
            } => {
                w.u8(if *upsert { op::UPSERT } else { op::INSERT });
                t.write(&mut w);
                w.u64(*key).u64(s.id).u64(s.seq).bytes(value);
            }
            DataReq::Update {
                t,
                slot,
                key,
                s,
                value,
            } => {
                w.u8(op::UPDATE);
                t.write(&mut w);
                w.u8(*slot).u64(*key).u64(s.id).u64(s.seq).bytes(value);
            }
            DataReq::Delete { t, slot, key, s } => {
                w.u8(op::DELETE);
                t.write(&mut w);
                w.u8(*slot).u64(*key).u64(s.id).u64(s.seq);
            }
        }
        w.finish()
    }

    /// Parses a data request whose op byte `op` was already read.
    pub fn decode<'a>(op: u8, r: &mut WireReader<'a>) -> Result<DataReq<'a>, WireError> {
        let t = Target::read(r)?;
        let req = match op {
            op::GET => DataReq::Get { t, slot: r.u8()? },
            op::MAKEUP_GET => DataReq::MakeupGet { t, key: r.u64()? },
            op::INSERT | op::UPSERT => DataReq::Insert {
                t,
                key: r.u64()?,
                s: read_session(r)?,
                value: r.bytes()?,
                upsert: op == op::UPSERT,
            },
            op::UPDATE => DataReq::Update {
                t,
                slot: r.u8()?,
                key: r.u64()?,
                s: read_session(r)?,
                value: r.bytes()?,
            },
            op::DELETE => DataReq::Delete {
                t,
                slot: r.u8()?,
                key: r.u64()?,
                s: read_session(r)?,
            },
            other => return Err(WireError(format!("op {other} is not a data request"))),
        };
        r.end()?;
        Ok(req)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn data_requests_round_trip_and_reject_cuts() {
        let t = Target {
            shard: 2,
            table: 7,
            epoch: 3,
            bucket: 99,
            compute: 1,
        };
        let reqs = [
            DataReq::Get { t, slot: 3 },
            DataReq::MakeupGet { t, key: 5 },
            DataReq::Insert {
                t,
                key: 5,
                s: Session { id: 3, seq: 9 },
                value: b"abc",
                upsert: true,
            },
            DataReq::Update {
                t,
                slot: 1,
                key: 6,
                s: Session {
                    id: 1 << 63,
                    seq: 1,
                },
                value: b"",
            },
            DataReq::Delete {
                t,
                slot: 0,
                key: 8,
                s: Session::NONE,
            },
        ];
        for req in reqs {
            let buf = req.encode();
            let mut r = WireReader::new(&buf);
            let op = r.u8().unwrap();
            assert_eq!(DataReq::decode(op, &mut r).unwrap(), req);
            for cut in 1..buf.len() {
                let mut r = WireReader::new(&buf[..cut]);
                let op = r.u8().unwrap();
                assert!(DataReq::decode(op, &mut r).is_err());
            }
        }
        let mut w = WireWriter::new();
        ReplyHead {
            status: Status::Exists,
            flags: FLAG_PRE_RESIZE | FLAG_BUFFERED,
            seed: 200,
        }
        .write(&mut w);
        let b = w.finish();
        let h = ReplyHead::read(&mut WireReader::new(&b)).unwrap();
        assert!(h.pre_resize() && !h.cache() && h.seed == 200);
        assert!(ReplyHead::read(&mut WireReader::new(&[9, 0, 0])).is_err());
        assert_eq!(ReplyHead::parse(&b).unwrap(), h);
        assert!(ReplyHead::parse(&[9, 0, 0]).is_err());
        assert!(ReplyHead::parse(&b[..2]).is_err());
    }

    /// The GET path's fixed-size encoding and decoding agree with the
    /// general ones, byte for byte, and the one-step decoder takes nothing
    /// but a whole GET.
    #[test]
    fn get_fast_path_matches_the_general_encoding() {
        let t = Target {
            shard: 0x0102,
            table: 0x0304_0506,
            epoch: 0x0708_090a,
            bucket: 0x0b0c_0d0e,
            compute: 0x0f10_1112,
        };
        let mut w = WireWriter::new();
        w.u8(op::GET);
        t.write(&mut w);
        w.u8(7);
        let general = w.finish();
        let fast = encode_get(&t, 7);
        assert_eq!(fast, general);
        assert_eq!(fast.len(), GET_LEN);
        assert_eq!(DataReq::Get { t, slot: 7 }.encode(), general);
        assert_eq!(decode_get(&fast), Some((t, 7)));
        let mut r = WireReader::new(&fast);
        let op = r.u8().unwrap();
        assert_eq!(
            DataReq::decode(op, &mut r).unwrap(),
            DataReq::Get { t, slot: 7 }
        );
        // Cut, extended, or another op: not a GET for the fast path.
        assert_eq!(decode_get(&fast[..GET_LEN - 1]), None);
        let mut longer = fast.clone();
        longer.push(0);
        assert_eq!(decode_get(&longer), None);
        let mut other = fast.clone();
        other[0] = op::MAKEUP_GET;
        assert_eq!(decode_get(&other), None);
    }
}
