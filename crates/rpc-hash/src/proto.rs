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
//!   GET     found: value | len u32 | 1; not found: 0
//!           (the value first, its length and the flag after it, so the
//!           client hands the value over in the reply's buffer by cutting
//!           the 5-byte trailer off: no copy; branch i91)
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
    /// The encoded length (so a request is built in one allocation).
    fn encoded_len(&self) -> usize {
        match self {
            Request::Get { .. } | Request::Delete { .. } => 9,
            Request::Put { value, .. } => 14 + value.len(),
            Request::Load { pairs } => 5 + pairs.iter().map(|(_, v)| 12 + v.len()).sum::<usize>(),
            Request::Stats => 1,
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        self.encode_into(Vec::new())
    }

    /// [`Request::encode`] appended to `buf` (an endpoint's
    /// `request_buffer`, so a small request allocates nothing).
    pub fn encode_into(&self, buf: Vec<u8>) -> Vec<u8> {
        let mut w = WireWriter::append_to(buf, self.encoded_len());
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
    fn encoded_len(&self) -> usize {
        match self {
            Reply::Value(None) | Reply::Existed(_) => 1,
            Reply::Value(Some(v)) => 5 + v.len(),
            Reply::Done => 0,
            Reply::Stats(_) => 72,
        }
    }

    /// Appends [`Reply::encode`]'s bytes to `out`. The replies a write gets
    /// (`Existed`, `Done`) are written straight into it, so a handler
    /// thread's reply buffer keeps its allocation across write replies (it
    /// was replaced by `encode`'s one-byte `Vec`, and the next GET regrew
    /// it); the others go through `encode`.
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        match self {
            Reply::Existed(e) => out.push(*e as u8),
            Reply::Done => {}
            _ => out.extend_from_slice(&self.encode()),
        }
    }

    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::with_capacity(self.encoded_len());
        match self {
            Reply::Value(None) => {
                w.bool(false);
            }
            Reply::Value(Some(v)) => {
                w.raw(v).u32(v.len() as u32).bool(true);
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
            // The value first, its trailer after it: read from the end.
            Request::Get { .. } => {
                return Ok(Reply::Value(get_value_len(buf)?.map(|n| buf[..n].to_vec())));
            }
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

/// Encodes a GET reply exactly as `Reply::Value(..).encode()` does, with
/// the value appended by `read` straight into the reply instead of being
/// copied from a vector of its own: `read(out)` appends the value to `out`
/// and returns whether the key was found.
pub fn encode_get(read: impl FnOnce(&mut Vec<u8>) -> bool) -> Vec<u8> {
    // Room for the header and a typical value; a longer one grows it once.
    let mut out = Vec::with_capacity(5 + 64);
    encode_get_into(&mut out, read);
    out
}

/// [`encode_get`] into `out`, which must be empty (the handler thread's
/// reply buffer: no allocation once it has grown to a value's size).
pub fn encode_get_into(out: &mut Vec<u8>, read: impl FnOnce(&mut Vec<u8>) -> bool) {
    debug_assert!(out.is_empty());
    if !read(out) {
        out.clear();
        out.push(0);
        return;
    }
    let len = u32::try_from(out.len()).expect("values are below MAX_VALUE_LEN");
    out.extend_from_slice(&len.to_le_bytes());
    out.push(1);
}

/// The GET reply's trailer: the value's length (u32) and the found flag.
const GET_TRAILER: usize = 5;

/// The value's length in a GET reply (`None`: not found), with the checks
/// [`Reply::decode`] makes: the flag is 0 or 1, a not-found reply is that
/// byte alone, a found one's length is the bytes before its trailer and
/// at most [`MAX_VALUE_LEN`].
fn get_value_len(buf: &[u8]) -> Result<Option<usize>, WireError> {
    match buf.split_last() {
        Some((0, [])) => Ok(None),
        Some((1, rest)) if rest.len() >= GET_TRAILER - 1 => {
            let (value, len) = rest.split_at(rest.len() - (GET_TRAILER - 1));
            let len = u32::from_le_bytes(len.try_into().expect("four bytes")) as usize;
            if len != value.len() {
                return Err(WireError(format!(
                    "a GET reply of {} bytes says its value has {len}",
                    buf.len()
                )));
            }
            if len > MAX_VALUE_LEN {
                return Err(WireError(format!(
                    "value of {len} bytes exceeds the limit of {MAX_VALUE_LEN}"
                )));
            }
            Ok(Some(len))
        }
        _ => Err(WireError(format!(
            "malformed GET reply of {} bytes",
            buf.len()
        ))),
    }
}

/// Decodes a GET reply as [`Reply::decode`] does (same checks), taking the
/// reply's buffer and returning the value in it rather than a copy: the
/// trailer is cut off (the value is the reply's first bytes; before branch
/// i91 it came after a 5-byte header and was moved to the front, a
/// `memcpy` call per GET).
pub fn decode_get(mut buf: Vec<u8>) -> Result<Option<Vec<u8>>, WireError> {
    let Some(len) = get_value_len(&buf)? else {
        return Ok(None);
    };
    buf.truncate(len);
    Ok(Some(buf))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One request of every kind (both put modes).
    fn sample_requests() -> Vec<Request<'static>> {
        vec![
            Request::Get { key: 7 },
            Request::Put {
                mode: PutMode::Update,
                key: 9,
                value: b"abc",
            },
            Request::Put {
                mode: PutMode::Upsert,
                key: 9,
                value: b"abcde",
            },
            Request::Delete { key: 1 },
            Request::Load {
                pairs: vec![(1, b"x".as_slice()), (2, b"".as_slice())],
            },
            Request::Stats,
        ]
    }

    #[test]
    fn requests_round_trip_and_bad_ones_are_refused() {
        let reqs = sample_requests();
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

    #[test]
    fn get_replies_built_in_place_match_the_general_encoding() {
        for v in [
            None,
            Some(vec![]),
            Some(b"abc".to_vec()),
            Some(vec![7; 300]),
        ] {
            let req = Request::Get { key: 1 };
            let general = Reply::Value(v.clone()).encode();
            let direct = encode_get(|out| match &v {
                Some(v) => {
                    out.extend_from_slice(v);
                    true
                }
                None => false,
            });
            assert_eq!(direct, general, "{v:?}");
            assert_eq!(decode_get(direct.clone()).unwrap(), v);
            assert_eq!(
                Reply::decode(&direct, &req).unwrap(),
                Reply::Value(v.clone())
            );
            for cut in 0..direct.len() {
                // A found empty value's first byte is the not-found reply
                // (a reply arrives whole: the transport frames it).
                if v == Some(vec![]) && cut == 1 {
                    continue;
                }
                assert!(decode_get(direct[..cut].to_vec()).is_err(), "cut at {cut}");
            }
            let mut long = direct.clone();
            long.push(0);
            assert!(decode_get(long).is_err());
        }
        for req in sample_requests() {
            assert_eq!(req.encode().len(), req.encoded_len(), "{req:?}");
        }
        let stats = Reply::Stats(TableStats::default());
        for r in [
            Reply::Value(None),
            Reply::Value(Some(vec![1, 2])),
            Reply::Existed(true),
            Reply::Done,
            stats,
        ] {
            assert_eq!(r.encode().len(), r.encoded_len(), "{r:?}");
        }
    }

    #[test]
    fn a_get_replys_value_comes_first_and_is_handed_over_in_place() {
        let reply = encode_get(|out| {
            out.extend_from_slice(b"abc");
            true
        });
        assert_eq!(reply, [b'a', b'b', b'c', 3, 0, 0, 0, 1]);
        assert_eq!(encode_get(|_| false), [0]);
        let at = reply.as_ptr();
        let value = decode_get(reply).unwrap().unwrap();
        assert_eq!(value, b"abc");
        assert_eq!(value.as_ptr(), at, "the reply's own buffer");
        for bad in [
            &[][..],
            &[2],
            &[0, 0],
            &[3, 0, 0, 0, 1],
            &[b'a', 2, 0, 0, 0, 1],
            &[b'a', 1, 0, 0, 0, 2],
        ] {
            assert!(decode_get(bad.to_vec()).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn replies_encoded_into_a_buffer_are_the_general_encoding() {
        let stats = Reply::Stats(TableStats {
            keys: 3,
            chain_max: 9,
            ..TableStats::default()
        });
        for r in [
            Reply::Value(None),
            Reply::Value(Some(vec![1, 2])),
            Reply::Existed(true),
            Reply::Existed(false),
            Reply::Done,
            stats,
        ] {
            let mut out = Vec::with_capacity(64);
            r.encode_into(&mut out);
            assert_eq!(out, r.encode(), "{r:?}");
        }
    }
}
