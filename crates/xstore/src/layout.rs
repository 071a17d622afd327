//! Byte and bit layouts of what clients read one-sided from a memory node's
//! model region, and of the durability log (docs/xstore.md, *Layouts*).
//!
//! The model region holds, at fixed offset 0, the [`ModelHeader`] of the
//! current generation (top model, number of sub-models, where their table
//! is); the table of [`SubRecord`]s, one 64-byte line per sub-model; and the
//! translation tables (TTs), each in a line-tagged [`TtBlock`]. Everything
//! is little-endian and parsed through the bounds-checked functions here;
//! packed words are pinned by the `const` assertions at the bottom.
//!
//! Torn reads are detected by a checksum (header, records: rewritten in
//! place) or by line tags (TT blocks: immutable while published, and every
//! reuse of a block writes new tags from its end towards its start).

use dmkv_api::checksum64;
use thiserror::Error;

/// Bytes of one cache line.
pub const LINE: usize = 64;

/// Why bytes read from the model region were not accepted. All are
/// retried by re-reading (a concurrent rewrite, a reused block, a newer
/// generation) and, past a bound, end in the fallback RPC.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum LayoutError {
    #[error("{what}: {got} bytes where {want} were expected")]
    Length {
        what: &'static str,
        want: usize,
        got: usize,
    },
    #[error("{0}: checksum mismatch (torn or garbage)")]
    Checksum(&'static str),
    #[error("{0}: bad magic")]
    Magic(&'static str),
    #[error("{what}: {why}")]
    Invalid { what: &'static str, why: String },
    #[error("translation table: line tag {found:#x} where {expected:#x} was expected")]
    Tag { expected: u64, found: u64 },
}

fn word(b: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(b[8 * i..8 * i + 8].try_into().expect("8 bytes"))
}

fn put(b: &mut [u8], i: usize, v: u64) {
    b[8 * i..8 * i + 8].copy_from_slice(&v.to_le_bytes());
}

// ---- model header ----------------------------------------------------------

/// "XSTMODL1".
pub const HEADER_MAGIC: u64 = 0x314C_444F_4D54_5358;
/// Byte offset of the header in the model region.
pub const HEADER_OFFSET: u64 = 0;
/// Bytes a client reads for the header: ten words, the last the checksum.
pub const HEADER_BYTES: usize = 80;
/// The allocation arena of the region starts after the header's two lines.
pub const ARENA_START: u64 = 2 * LINE as u64;

/// The top model: `mid(k) = clamp(floor(slope * (k - lo) + intercept), 0,
/// M - 1)`. Monotonic (slope >= 0), so each sub-model serves one
/// contiguous key interval.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TopModel {
    pub slope: f64,
    pub intercept: f64,
}

/// What the header of a generation says.
///
/// ```text
/// w0 magic | w1 generation | w2 M (u32) | N slots << 32 | w3 table offset
/// w4 top slope (f64) | w5 top intercept (f64) | w6 partition lo
/// w7 partition hi (inclusive) | w8 keys at training | w9 checksum(w0..w8)
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelHeader {
    pub generation: u32,
    pub submodels: u32,
    pub slots: u32,
    pub table_offset: u64,
    pub top: TopModel,
    pub lo: u64,
    pub hi: u64,
    pub trained_keys: u64,
}

impl ModelHeader {
    pub fn encode(&self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        put(&mut b, 0, HEADER_MAGIC);
        put(&mut b, 1, self.generation as u64);
        put(&mut b, 2, self.submodels as u64 | (self.slots as u64) << 32);
        put(&mut b, 3, self.table_offset);
        put(&mut b, 4, self.top.slope.to_bits());
        put(&mut b, 5, self.top.intercept.to_bits());
        put(&mut b, 6, self.lo);
        put(&mut b, 7, self.hi);
        put(&mut b, 8, self.trained_keys);
        let c = checksum64(&b[..72]);
        put(&mut b, 9, c);
        b
    }

    /// Parses and validates a header read (torn reads fail the checksum).
    pub fn decode(b: &[u8]) -> Result<ModelHeader, LayoutError> {
        if b.len() != HEADER_BYTES {
            return Err(LayoutError::Length {
                what: "model header",
                want: HEADER_BYTES,
                got: b.len(),
            });
        }
        if word(b, 9) != checksum64(&b[..72]) {
            return Err(LayoutError::Checksum("model header"));
        }
        if word(b, 0) != HEADER_MAGIC {
            return Err(LayoutError::Magic("model header"));
        }
        let w2 = word(b, 2);
        let h = ModelHeader {
            generation: u32::try_from(word(b, 1)).map_err(|_| invalid("header", "generation"))?,
            submodels: w2 as u32,
            slots: (w2 >> 32) as u32,
            table_offset: word(b, 3),
            top: TopModel {
                slope: f64::from_bits(word(b, 4)),
                intercept: f64::from_bits(word(b, 5)),
            },
            lo: word(b, 6),
            hi: word(b, 7),
            trained_keys: word(b, 8),
        };
        if h.submodels == 0 || h.submodels > MAX_SUBMODELS {
            return Err(invalid("header", format!("{} sub-models", h.submodels)));
        }
        if !(h.top.slope.is_finite() && h.top.slope >= 0.0 && h.top.intercept.is_finite()) {
            return Err(invalid("header", "top model is not a monotonic line"));
        }
        if h.lo > h.hi {
            return Err(invalid("header", "empty partition"));
        }
        Ok(h)
    }

    /// The sub-model serving `key` (which the caller routed to this
    /// partition).
    pub fn route(&self, key: u64) -> u32 {
        top_route(&self.top, self.lo, self.submodels, key)
    }

    /// Byte offset of sub-model `i`'s record.
    pub fn record_offset(&self, i: u32) -> u64 {
        self.table_offset + i as u64 * RECORD_BYTES as u64
    }
}

/// Most sub-models one generation may have (the table of records must fit
/// the region; 2^26 records are 4 GiB).
pub const MAX_SUBMODELS: u32 = 1 << 26;

/// `mid(k)`, shared by the server (which derives each sub-model's key
/// interval from it) and clients (which route with it): same operations in
/// the same order on both sides, so both get the same answer.
pub fn top_route(top: &TopModel, lo: u64, submodels: u32, key: u64) -> u32 {
    let x = key.saturating_sub(lo) as f64;
    let p = (top.slope * x + top.intercept).floor();
    // `as` saturates (and maps NaN to 0): monotonic in `p`.
    (p as i64).clamp(0, submodels as i64 - 1) as u32
}

fn invalid(what: &'static str, why: impl Into<String>) -> LayoutError {
    LayoutError::Invalid {
        what,
        why: why.into(),
    }
}

// ---- sub-model records ------------------------------------------------------

/// Bytes of one sub-model record: one line.
pub const RECORD_BYTES: usize = 64;

/// A sub-model: a monotonic line over `x = key - base` predicting a
/// position (logical leaf number x N + rank), errors in positions, and
/// where its TT is.
///
/// ```text
/// w0 generation (u32) | index << 32 | w1 TT tag | w2 slope (f64)
/// w3 intercept (f64) | w4 base key | w5 min_err (u32) | max_err << 32
/// w6 TT offset (bits 0..39) | TT length << 40 | w7 checksum(w0..w6)
/// ```
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SubRecord {
    pub generation: u32,
    pub index: u32,
    /// Unique per publication (never 0, never reused): the tag of every line
    /// of this record's TT block.
    pub tag: u64,
    pub slope: f64,
    pub intercept: f64,
    /// The first key of the sub-model's interval (`B_i`).
    pub base: u64,
    pub min_err: u32,
    pub max_err: u32,
    pub tt_offset: u64,
    /// Entries of the TT (leaves); 0 only for a sub-model no key routes to.
    pub tt_len: u32,
}

/// TT offsets are 40-bit, lengths 24-bit.
pub const TT_OFFSET_BITS: u32 = 40;
pub const TT_OFFSET_MASK: u64 = (1 << TT_OFFSET_BITS) - 1;
pub const MAX_TT_LEN: u32 = (1 << 24) - 1;

impl SubRecord {
    pub fn encode(&self) -> [u8; RECORD_BYTES] {
        let mut b = [0u8; RECORD_BYTES];
        put(
            &mut b,
            0,
            self.generation as u64 | (self.index as u64) << 32,
        );
        put(&mut b, 1, self.tag);
        put(&mut b, 2, self.slope.to_bits());
        put(&mut b, 3, self.intercept.to_bits());
        put(&mut b, 4, self.base);
        put(&mut b, 5, self.min_err as u64 | (self.max_err as u64) << 32);
        put(
            &mut b,
            6,
            (self.tt_offset & TT_OFFSET_MASK) | (self.tt_len as u64) << TT_OFFSET_BITS,
        );
        let c = checksum64(&b[..56]);
        put(&mut b, 7, c);
        b
    }

    pub fn decode(b: &[u8]) -> Result<SubRecord, LayoutError> {
        if b.len() != RECORD_BYTES {
            return Err(LayoutError::Length {
                what: "sub-model record",
                want: RECORD_BYTES,
                got: b.len(),
            });
        }
        if word(b, 7) != checksum64(&b[..56]) {
            return Err(LayoutError::Checksum("sub-model record"));
        }
        let w0 = word(b, 0);
        let w5 = word(b, 5);
        let w6 = word(b, 6);
        let r = SubRecord {
            generation: w0 as u32,
            index: (w0 >> 32) as u32,
            tag: word(b, 1),
            slope: f64::from_bits(word(b, 2)),
            intercept: f64::from_bits(word(b, 3)),
            base: word(b, 4),
            min_err: w5 as u32,
            max_err: (w5 >> 32) as u32,
            tt_offset: w6 & TT_OFFSET_MASK,
            tt_len: (w6 >> TT_OFFSET_BITS) as u32,
        };
        if !(r.slope.is_finite() && r.slope >= 0.0 && r.intercept.is_finite()) {
            return Err(invalid("sub-model record", "not a monotonic line"));
        }
        if r.tag == 0 && r.tt_len != 0 {
            return Err(invalid("sub-model record", "a TT without a tag"));
        }
        Ok(r)
    }

    /// The predicted position of `key`, floored: `P(key)`.
    pub fn position(&self, key: u64) -> i64 {
        predict_position(self.slope, self.intercept, self.base, key)
    }

    /// The logical leaves `[s, e]` that must hold `key` if it was trained
    /// (clamped to the TT). `None` for a sub-model without a TT.
    pub fn leaf_range(&self, key: u64, slots: u32) -> Option<(u32, u32)> {
        leaf_range(
            self.position(key),
            self.min_err,
            self.max_err,
            slots,
            self.tt_len,
        )
    }
}

/// `P(key) = floor(slope * (key - base) + intercept)`, as an integer
/// position. Monotonic in `key` for `slope >= 0`.
pub fn predict_position(slope: f64, intercept: f64, base: u64, key: u64) -> i64 {
    let x = key.saturating_sub(base) as f64;
    (slope * x + intercept).floor() as i64
}

/// `s = floor((P - min_err) / N)`, `e = floor((P + max_err) / N)`, both
/// clamped to `[0, tt_len - 1]` (Fig. 7, lines 4-5).
pub fn leaf_range(
    position: i64,
    min_err: u32,
    max_err: u32,
    slots: u32,
    tt_len: u32,
) -> Option<(u32, u32)> {
    if tt_len == 0 || slots == 0 {
        return None;
    }
    let n = slots as i64;
    let last = tt_len as i64 - 1;
    let s = position.saturating_sub(min_err as i64).div_euclid(n);
    let e = position.saturating_add(max_err as i64).div_euclid(n);
    Some((s.clamp(0, last) as u32, e.clamp(0, last) as u32))
}

// ---- translation-table entries and blocks -----------------------------------

/// A TT entry (Fig. 5): bits 0..7 CNT, bits 8..31 INCA, bits 32..62 ALN
/// (the leaf's node number), bit 63 VALID.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtEntry {
    pub valid: bool,
    pub leaf: u32,
    pub incarnation: u32,
    pub count: u8,
}

pub const TT_VALID_BIT: u64 = 1 << 63;
/// Leaf numbers in a TT entry are 31-bit.
pub const MAX_TT_LEAF: u32 = (1 << 31) - 1;

impl TtEntry {
    pub const fn pack(self) -> u64 {
        self.count as u64
            | ((self.incarnation & 0xFF_FFFF) as u64) << 8
            | ((self.leaf & MAX_TT_LEAF) as u64) << 32
            | if self.valid { TT_VALID_BIT } else { 0 }
    }
    pub const fn unpack(w: u64) -> TtEntry {
        TtEntry {
            valid: w & TT_VALID_BIT != 0,
            leaf: ((w >> 32) as u32) & MAX_TT_LEAF,
            incarnation: ((w >> 8) as u32) & 0xFF_FFFF,
            count: w as u8,
        }
    }
}

/// Entries per TT line: the first word of every line is its tag.
pub const TT_PER_LINE: usize = 7;

/// Geometry of a TT block of `len` entries: `ceil(len / 7)` lines (tag and
/// seven entries each), then one tail word carrying the tag again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TtBlock {
    pub len: u32,
}

impl TtBlock {
    pub fn lines(&self) -> usize {
        (self.len as usize).div_ceil(TT_PER_LINE)
    }

    pub fn bytes(&self) -> usize {
        self.lines() * LINE + 8
    }

    /// Byte offset (within the block) of entry `i`.
    pub fn entry_offset(i: usize) -> usize {
        (i / TT_PER_LINE) * LINE + 8 + 8 * (i % TT_PER_LINE)
    }

    /// The bytes of a block holding `entries` under `tag`.
    pub fn encode(tag: u64, entries: &[u64]) -> Vec<u8> {
        let blk = TtBlock {
            len: entries.len() as u32,
        };
        let mut b = vec![0u8; blk.bytes()];
        for l in 0..blk.lines() {
            put(&mut b, l * 8, tag);
        }
        let tail = blk.lines() * 8;
        put(&mut b, tail, tag);
        for (i, e) in entries.iter().enumerate() {
            b[Self::entry_offset(i)..Self::entry_offset(i) + 8].copy_from_slice(&e.to_le_bytes());
        }
        b
    }

    /// The read that covers entries `first..=last`: (byte offset within the
    /// block, length): their lines plus the next line's tag (or the tail).
    pub fn span(&self, first: u32, last: u32) -> (usize, usize) {
        let l0 = first as usize / TT_PER_LINE;
        let l1 = last as usize / TT_PER_LINE;
        (l0 * LINE, (l1 - l0 + 1) * LINE + 8)
    }

    /// Parses the read of [`Self::span`]`(first, last)`: every tag in it
    /// must be `tag`. Returns entries `first..=last`.
    pub fn parse_span(
        &self,
        tag: u64,
        first: u32,
        last: u32,
        bytes: &[u8],
    ) -> Result<Vec<u64>, LayoutError> {
        if first > last || last >= self.len {
            return Err(invalid(
                "translation table",
                format!("entries {first}..={last} of {}", self.len),
            ));
        }
        let (_, want) = self.span(first, last);
        if bytes.len() != want {
            return Err(LayoutError::Length {
                what: "translation table",
                want,
                got: bytes.len(),
            });
        }
        let lines = (want - 8) / LINE;
        for at in (0..lines).map(|l| l * 8).chain([lines * 8]) {
            let found = word(bytes, at);
            if found != tag {
                return Err(LayoutError::Tag {
                    expected: tag,
                    found,
                });
            }
        }
        let l0 = first as usize / TT_PER_LINE;
        Ok((first..=last)
            .map(|i| {
                let off = Self::entry_offset(i as usize) - l0 * LINE;
                word(bytes, off / 8)
            })
            .collect())
    }
}

// ---- durability log ---------------------------------------------------------

/// What a log record does to its key.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LogOp {
    Put(Vec<u8>),
    Delete,
}

/// One log record: `len u32 | checksum u64 | body`, where the body is
/// `version u64 | key u64 | op u8 (1 put, 2 delete) | value_len u32 |
/// value` and the checksum covers the body. A record cut short by a crash
/// fails its length or checksum and ends the file's replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogRecord {
    pub version: u64,
    pub key: u64,
    pub op: LogOp,
}

pub const LOG_HEAD_BYTES: usize = 12;
pub const LOG_BODY_FIXED: usize = 21;

impl LogRecord {
    pub fn encode_into(&self, out: &mut Vec<u8>) {
        let (op, value): (u8, &[u8]) = match &self.op {
            LogOp::Put(v) => (1, v),
            LogOp::Delete => (2, &[]),
        };
        let mut body = Vec::with_capacity(LOG_BODY_FIXED + value.len());
        body.extend_from_slice(&self.version.to_le_bytes());
        body.extend_from_slice(&self.key.to_le_bytes());
        body.push(op);
        body.extend_from_slice(&(value.len() as u32).to_le_bytes());
        body.extend_from_slice(value);
        out.extend_from_slice(&(body.len() as u32).to_le_bytes());
        out.extend_from_slice(&checksum64(&body).to_le_bytes());
        out.extend_from_slice(&body);
    }

    /// Parses the record at the start of `b`: the record and its length, or
    /// `None` if `b` holds no complete, intact record there.
    pub fn decode(b: &[u8]) -> Option<(LogRecord, usize)> {
        if b.len() < LOG_HEAD_BYTES {
            return None;
        }
        let len = u32::from_le_bytes(b[0..4].try_into().ok()?) as usize;
        let sum = u64::from_le_bytes(b[4..12].try_into().ok()?);
        let body = b.get(LOG_HEAD_BYTES..LOG_HEAD_BYTES.checked_add(len)?)?;
        if len < LOG_BODY_FIXED || checksum64(body) != sum {
            return None;
        }
        let version = u64::from_le_bytes(body[0..8].try_into().ok()?);
        let key = u64::from_le_bytes(body[8..16].try_into().ok()?);
        let vlen = u32::from_le_bytes(body[17..21].try_into().ok()?) as usize;
        if LOG_BODY_FIXED + vlen != len {
            return None;
        }
        let op = match body[16] {
            1 => LogOp::Put(body[LOG_BODY_FIXED..].to_vec()),
            2 if vlen == 0 => LogOp::Delete,
            _ => return None,
        };
        Some((LogRecord { version, key, op }, LOG_HEAD_BYTES + len))
    }
}

// Pinned layouts: a change to any packing breaks the build.
const _: () = {
    assert!(
        TtEntry {
            valid: true,
            leaf: 0x1234_5678,
            incarnation: 0xAB_CDEF,
            count: 0x10
        }
        .pack()
            == 0x9234_5678_ABCD_EF10
    );
    assert!(
        TtEntry {
            valid: false,
            leaf: MAX_TT_LEAF,
            incarnation: 0,
            count: 0
        }
        .pack()
            == 0x7FFF_FFFF_0000_0000
    );
    assert!(TtEntry::unpack(0x9234_5678_ABCD_EF10).incarnation == 0xAB_CDEF);
    assert!(TtEntry::unpack(0x9234_5678_ABCD_EF10).leaf == 0x1234_5678);
    assert!(HEADER_BYTES == 80 && RECORD_BYTES == LINE);
    assert!(ARENA_START as usize >= HEADER_BYTES);
    assert!(MAX_TT_LEN as u64 == (1u64 << (64 - TT_OFFSET_BITS)) - 1);
    assert!(TT_PER_LINE * 8 + 8 == LINE);
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn header_and_record_round_trip_and_catch_tears() {
        let h = ModelHeader {
            generation: 3,
            submodels: 1000,
            slots: 16,
            table_offset: 4096,
            top: TopModel {
                slope: 1e-12,
                intercept: 0.25,
            },
            lo: 0,
            hi: u64::MAX,
            trained_keys: 77,
        };
        let b = h.encode();
        assert_eq!(ModelHeader::decode(&b).unwrap(), h);
        for i in 0..HEADER_BYTES {
            let mut t = b;
            t[i] ^= 0x10;
            assert!(ModelHeader::decode(&t).is_err(), "byte {i}");
        }
        assert!(ModelHeader::decode(&b[..79]).is_err());
        let r = SubRecord {
            generation: 3,
            index: 9,
            tag: 42,
            slope: 0.5,
            intercept: -3.0,
            base: 100,
            min_err: 4,
            max_err: 7,
            tt_offset: 1 << 20,
            tt_len: 12,
        };
        let b = r.encode();
        assert_eq!(SubRecord::decode(&b).unwrap(), r);
        for i in 0..RECORD_BYTES {
            let mut t = b;
            t[i] ^= 1;
            assert!(SubRecord::decode(&t).is_err(), "byte {i}");
        }
        let mut neg = r;
        neg.slope = -1.0;
        assert!(SubRecord::decode(&neg.encode()).is_err(), "not monotonic");
    }

    #[test]
    fn routing_and_leaf_ranges_are_monotonic_and_clamped() {
        let top = TopModel {
            slope: 10.0 / 1000.0,
            intercept: 0.0,
        };
        let mut prev = 0;
        for k in (0..2000u64).step_by(7) {
            let m = top_route(&top, 0, 10, k);
            assert!(m >= prev && m < 10);
            prev = m;
        }
        assert_eq!(top_route(&top, 0, 10, u64::MAX), 9);
        assert_eq!(leaf_range(-100, 0, 0, 16, 5), Some((0, 0)));
        assert_eq!(leaf_range(i64::MAX, 3, 3, 16, 5), Some((4, 4)));
        assert_eq!(leaf_range(40, 9, 8, 16, 5), Some((1, 3)));
        assert_eq!(leaf_range(40, 0, 0, 16, 0), None);
    }

    #[test]
    fn tt_blocks_parse_spans_and_reject_foreign_tags() {
        let entries: Vec<u64> = (0..20u64).map(|i| i * 3 + 1).collect();
        let b = TtBlock::encode(99, &entries);
        let blk = TtBlock { len: 20 };
        assert_eq!(b.len(), blk.bytes());
        assert_eq!(blk.bytes(), 3 * 64 + 8);
        for first in 0..20u32 {
            for last in first..20 {
                let (off, len) = blk.span(first, last);
                let got = blk.parse_span(99, first, last, &b[off..off + len]).unwrap();
                assert_eq!(got, entries[first as usize..=last as usize]);
                assert!(blk.parse_span(98, first, last, &b[off..off + len]).is_err());
            }
        }
        // A reuse that rewrote only the closing tag is caught.
        let mut t = b.clone();
        t[64..72].copy_from_slice(&7u64.to_le_bytes());
        let (off, len) = blk.span(0, 6);
        assert!(matches!(
            blk.parse_span(99, 0, 6, &t[off..off + len]),
            Err(LayoutError::Tag { .. })
        ));
        assert!(blk.parse_span(99, 5, 20, &b).is_err(), "beyond the length");
    }

    #[test]
    fn log_records_round_trip_and_torn_tails_end_replay() {
        let mut buf = Vec::new();
        let a = LogRecord {
            version: 5,
            key: 77,
            op: LogOp::Put(b"hello".to_vec()),
        };
        let d = LogRecord {
            version: 6,
            key: 77,
            op: LogOp::Delete,
        };
        a.encode_into(&mut buf);
        d.encode_into(&mut buf);
        let (r1, n1) = LogRecord::decode(&buf).unwrap();
        assert_eq!(r1, a);
        let (r2, n2) = LogRecord::decode(&buf[n1..]).unwrap();
        assert_eq!(r2, d);
        assert_eq!(n1 + n2, buf.len());
        for cut in 0..n2 {
            assert!(LogRecord::decode(&buf[n1..n1 + cut]).is_none(), "cut {cut}");
        }
        let mut t = buf.clone();
        t[20] ^= 1;
        assert!(LogRecord::decode(&t).is_none());
    }
}
