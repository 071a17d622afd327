//! Requests and replies of the `op` service.
//!
//! ```text
//! request:  op u8 | fields                      (little-endian, WireWriter)
//!   GET     1 | key u64
//!   PUT     2 | mode u8 (0 insert, 1 update, 2 upsert) | key u64 | value bytes
//!   DELETE  3 | key u64
//!   LOAD    4 | count u32 | (key u64 | value bytes) * count
//!   STATS   5
//! reply:
//!   GET     found bool | [value bytes]
//!   PUT, DELETE   existed bool
//!   LOAD    (empty)
//!   STATS   keys, main_buckets, slots, lookups, buckets_visited,
//!           slots_probed, keys_compared u64 | chain_mean f64 | chain_max u64
//! ```
//!
//! Decoding refuses unknown ops and modes, short or trailing bytes and
//! values longer than [`MAX_VALUE_LEN`]; the table never sees them.

use crate::table::{MAX_VALUE_LEN, PutMode};
use dmkv_transport::{WireError, WireReader, WireWriter};

const GET: u8 = 1;
const PUT: u8 = 2;
const DELETE: u8 = 3;
const LOAD: u8 = 4;
const STATS: u8 = 5;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Request<'a> {
    Get {
        key: u64,
    },
    Put {
        mode: PutMode,
        key: u64,
        value: &'a [u8],
    },
    Delete {
        key: u64,
    },
    Load {
        pairs: Vec<(u64, &'a [u8])>,
    },
    Stats,
}

fn value<'a>(r: &mut WireReader<'a>) -> Result<&'a [u8], WireError> {
    let v = r.bytes()?;
    if v.len() > MAX_VALUE_LEN {
        return Err(WireError(format!(
            "value of {} bytes exceeds the limit of {MAX_VALUE_LEN}",
            v.len()
        )));
    }
    Ok(v)
}

impl<'a> Request<'a> {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::new();
        match self {
            Request::Get { key } => {
                w.u8(GET).u64(*key);
            }
            Request::Put { mode, key, value } => {
                let m = match mode {
                    PutMode::Insert => 0,
                    PutMode::Update => 1,
                    PutMode::Upsert => 2,
                };
                w.u8(PUT).u8(m).u64(*key).bytes(value);
            }
            Request::Delete { key } => {
                w.u8(DELETE).u64(*key);
            }
            Request::Load { pairs } => {
                w.u8(LOAD).u32(pairs.len() as u32);
                for (k, v) in pairs {
                    w.u64(*k).bytes(v);
                }
            }
            Request::Stats => {
                w.u8(STATS);
            }
        }
        w.finish()
    }

    pub fn decode(buf: &'a [u8]) -> Result<Request<'a>, WireError> {
        let mut r = WireReader::new(buf);
        let req = match r.u8()? {
            GET => Request::Get { key: r.u64()? },
            PUT => {
                let mode = match r.u8()? {
                    0 => PutMode::Insert,
                    1 => PutMode::Update,
                    2 => PutMode::Upsert,
                    m => return Err(WireError(format!("unknown put mode {m}"))),
                };
                Request::Put {
                    mode,
                    key: r.u64()?,
                    value: value(&mut r)?,
                }
            }
            DELETE => Request::Delete { key: r.u64()? },
            LOAD => {
                let n = r.count(12)?;
                let mut pairs = Vec::with_capacity(n);
                for _ in 0..n {
                    pairs.push((r.u64()?, value(&mut r)?));
                }
                Request::Load { pairs }
            }
            STATS => Request::Stats,
            op => return Err(WireError(format!("unknown op {op}"))),
        };
        r.end()?;
        Ok(req)
    }
}

/// The memory node's figures.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TableStats {
    pub keys: u64,
    pub main_buckets: u64,
    pub slots: u64,
    pub lookups: u64,
    pub buckets_visited: u64,
    pub slots_probed: u64,
    pub keys_compared: u64,
    pub chain_mean: f64,
    pub chain_max: u64,
}

impl TableStats {
    /// Adds another node's figures (chain mean weighted by buckets).
    pub fn merge(&mut self, o: &TableStats) {
        let buckets = self.main_buckets + o.main_buckets;
        if buckets > 0 {
            self.chain_mean = (self.chain_mean * self.main_buckets as f64
                + o.chain_mean * o.main_buckets as f64)
                / buckets as f64;
        }
        self.keys += o.keys;
        self.main_buckets = buckets;
        self.slots += o.slots;
        self.lookups += o.lookups;
        self.buckets_visited += o.buckets_visited;
        self.slots_probed += o.slots_probed;
        self.keys_compared += o.keys_compared;
        self.chain_max = self.chain_max.max(o.chain_max);
    }
}

#[derive(Debug, Clone, PartialEq)]
pub enum Reply {
    Value(Option<Vec<u8>>),
    Existed(bool),
    Done,
    Stats(TableStats),
}

impl Reply {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::new();
        match self {
            Reply::Value(None) => {
                w.bool(false);
            }
            Reply::Value(Some(v)) => {
                w.bool(true).bytes(v);
            }
            Reply::Existed(e) => {
                w.bool(*e);
            }
            Reply::Done => {}
            Reply::Stats(s) => {
                w.u64(s.keys)
                    .u64(s.main_buckets)
                    .u64(s.slots)
                    .u64(s.lookups)
                    .u64(s.buckets_visited)
                    .u64(s.slots_probed)
                    .u64(s.keys_compared)
                    .f64(s.chain_mean)
                    .u64(s.chain_max);
            }
        }
        w.finish()
    }

    /// Decodes the reply to `req`.
    pub fn decode(buf: &[u8], req: &Request<'_>) -> Result<Reply, WireError> {
        let mut r = WireReader::new(buf);
        let reply = match req {
            Request::Get { .. } => Reply::Value(if r.bool()? {
                Some(value(&mut r)?.to_vec())
            } else {
                None
            }),
            Request::Put { .. } | Request::Delete { .. } => Reply::Existed(r.bool()?),
            Request::Load { .. } => Reply::Done,
            Request::Stats => Reply::Stats(TableStats {
                keys: r.u64()?,
                main_buckets: r.u64()?,
                slots: r.u64()?,
                lookups: r.u64()?,
                buckets_visited: r.u64()?,
                slots_probed: r.u64()?,
                keys_compared: r.u64()?,
                chain_mean: r.f64()?,
                chain_max: r.u64()?,
            }),
        };
        r.end()?;
        Ok(reply)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn requests_round_trip_and_bad_ones_are_refused() {
        let reqs = [
            Request::Get { key: 7 },
            Request::Put {
                mode: PutMode::Update,
                key: 9,
                value: b"abc",
            },
            Request::Delete { key: 1 },
            Request::Load {
                pairs: vec![(1, b"x".as_slice()), (2, b"".as_slice())],
            },
            Request::Stats,
        ];
        for req in &reqs {
            let buf = req.encode();
            assert_eq!(&Request::decode(&buf).unwrap(), req);
            for cut in 0..buf.len() {
                assert!(
                    Request::decode(&buf[..cut]).is_err(),
                    "{req:?} cut at {cut}"
                );
            }
            let mut long = buf.clone();
            long.push(0);
            assert!(Request::decode(&long).is_err());
        }
        let big = vec![0u8; MAX_VALUE_LEN + 1];
        let buf = Request::Put {
            mode: PutMode::Insert,
            key: 1,
            value: &big,
        }
        .encode();
        assert!(Request::decode(&buf).is_err(), "oversized value");
        assert!(Request::decode(&[2, 7, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]).is_err());
    }
}
