//! What a memory node publishes for compute nodes to fetch one-sided
//! (paper §4.4, Fig. 8): the shard's directory and table list in the body
//! of the control region, and each table's Othello in its locator region.
//! Seeds are read straight from the table region's control words, so a
//! fetch always gets the latest ones.

use crate::layout::locator;
use crate::othello::Othello;
use dmkv_api::checksum64;
use dmkv_transport::{WireError, WireReader, WireWriter};

/// Region names, relative to the engine instance (`ServeArgs::name`).
pub fn ctl_name(shard: u16) -> String {
    format!("s{shard}/ctl")
}
pub fn table_name(shard: u16, table: u32) -> String {
    format!("s{shard}/t{table}/bkt")
}
pub fn locator_name(shard: u16, table: u32) -> String {
    format!("s{shard}/t{table}/loc")
}
/// Prefix of every region of one table (for withdrawing them).
pub fn table_prefix(shard: u16, table: u32) -> String {
    format!("s{shard}/t{table}/")
}

/// One table as published.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableDesc {
    pub id: u32,
    pub epoch: u32,
    pub buckets: u32,
    pub local_depth: u8,
    pub bucket_seed: u64,
    pub othello_seed: u64,
    pub ma: u32,
    pub mb: u32,
}

pub const TABLE_ENTRY_BYTES: u64 = 4 + 4 + 4 + 1 + 8 + 8 + 4 + 4;

/// A shard's published view: extendible-hashing directory and tables.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ViewDesc {
    pub version: u64,
    pub global_depth: u8,
    /// `2^global_depth` table ids, indexed by the low bits of the key's
    /// directory hash.
    pub dir: Vec<u32>,
    pub tables: Vec<TableDesc>,
}

impl ViewDesc {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = WireWriter::new();
        w.u64(self.version).u8(self.global_depth);
        w.u32(self.dir.len() as u32);
        for &t in &self.dir {
            w.u32(t);
        }
        w.u32(self.tables.len() as u32);
        for t in &self.tables {
            w.u32(t.id)
                .u32(t.epoch)
                .u32(t.buckets)
                .u8(t.local_depth)
                .u64(t.bucket_seed)
                .u64(t.othello_seed)
                .u32(t.ma)
                .u32(t.mb);
        }
        w.finish()
    }

    /// Parses and validates a body: the directory has `2^depth` entries,
    /// each naming a listed table, and every table is well-formed.
    pub fn decode(body: &[u8]) -> Result<ViewDesc, WireError> {
        let mut r = WireReader::new(body);
        let version = r.u64()?;
        let global_depth = r.u8()?;
        if global_depth > 16 {
            return Err(WireError(format!("global depth {global_depth}")));
        }
        let n = r.count(4)?;
        if n != 1 << global_depth {
            return Err(WireError(format!(
                "{n} directory entries at depth {global_depth}"
            )));
        }
        let dir = (0..n).map(|_| r.u32()).collect::<Result<Vec<_>, _>>()?;
        let nt = r.count(TABLE_ENTRY_BYTES as usize)?;
        let mut tables = Vec::with_capacity(nt);
        for _ in 0..nt {
            let t = TableDesc {
                id: r.u32()?,
                epoch: r.u32()?,
                buckets: r.u32()?,
                local_depth: r.u8()?,
                bucket_seed: r.u64()?,
                othello_seed: r.u64()?,
                ma: r.u32()?,
                mb: r.u32()?,
            };
            if t.buckets == 0 || t.ma == 0 || t.mb == 0 || t.local_depth > global_depth {
                return Err(WireError(format!("malformed table entry {t:?}")));
            }
            tables.push(t);
        }
        r.end()?;
        if let Some(bad) = dir.iter().find(|d| !tables.iter().any(|t| t.id == **d)) {
            return Err(WireError(format!("directory names unknown table {bad}")));
        }
        Ok(ViewDesc {
            version,
            global_depth,
            dir,
            tables,
        })
    }
}

/// The bytes of a locator region for `o`.
pub fn encode_locator(o: &Othello) -> Vec<u8> {
    let mut bits = Vec::with_capacity(o.bits().len() * 8);
    for w in o.bits() {
        bits.extend_from_slice(&w.to_le_bytes());
    }
    let mut w = WireWriter::with_capacity(locator::HEADER_BYTES as usize + bits.len());
    w.u64(locator::MAGIC)
        .u64(o.seed())
        .u64(o.ma() as u64 | (o.mb() as u64) << 32)
        .u64(o.bits().len() as u64)
        .u64(checksum64(&bits))
        .u64(0)
        .u64(0)
        .u64(0)
        .raw(&bits);
    w.finish()
}

/// Bytes of the locator region of an Othello with `ma` and `mb` cells.
pub fn locator_len(ma: u32, mb: u32) -> u64 {
    locator::HEADER_BYTES + (ma as u64 + mb as u64).div_ceil(64) * 8
}

/// Parses a locator region read back whole; checks the table entry agrees.
pub fn decode_locator(bytes: &[u8], desc: &TableDesc) -> Result<Othello, WireError> {
    let mut r = WireReader::new(bytes);
    let (magic, seed, cells, nwords, check) = (r.u64()?, r.u64()?, r.u64()?, r.u64()?, r.u64()?);
    r.raw(24)?;
    let (ma, mb) = (cells as u32, (cells >> 32) as u32);
    if magic != locator::MAGIC || seed != desc.othello_seed || ma != desc.ma || mb != desc.mb {
        return Err(WireError("locator header does not match its table".into()));
    }
    let want = (ma as u64 + mb as u64).div_ceil(64);
    if nwords != want || r.remaining() as u64 != want * 8 {
        return Err(WireError(format!("locator of {nwords} words, want {want}")));
    }
    let raw = r.raw(r.remaining())?;
    if checksum64(raw) != check {
        return Err(WireError("locator checksum mismatch".into()));
    }
    let bits = raw
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect();
    Othello::from_parts(seed, ma, mb, bits).ok_or_else(|| WireError("bad Othello parts".into()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn table(id: u32) -> TableDesc {
        TableDesc {
            id,
            epoch: 1,
            buckets: 10,
            local_depth: 1,
            bucket_seed: 5,
            othello_seed: 6,
            ma: 64,
            mb: 64,
        }
    }

    #[test]
    fn views_round_trip_and_are_validated() {
        let v = ViewDesc {
            version: 3,
            global_depth: 1,
            dir: vec![4, 9],
            tables: vec![table(4), table(9)],
        };
        let b = v.encode();
        assert_eq!(ViewDesc::decode(&b).unwrap(), v);
        for cut in 0..b.len() {
            assert!(ViewDesc::decode(&b[..cut]).is_err());
        }
        let mut bad = v.clone();
        bad.dir[1] = 77;
        assert!(ViewDesc::decode(&bad.encode()).is_err());
    }

    #[test]
    fn locators_round_trip() {
        let o = Othello::build(&[1, 2, 3], &[true, false, true], 4);
        let d = TableDesc {
            othello_seed: o.seed(),
            ma: o.ma(),
            mb: o.mb(),
            ..table(1)
        };
        let b = encode_locator(&o);
        assert_eq!(b.len() as u64, locator_len(o.ma(), o.mb()));
        assert_eq!(decode_locator(&b, &d).unwrap(), o);
        let mut torn = b.clone();
        torn[70] ^= 4;
        assert!(decode_locator(&torn, &d).is_err());
        assert!(decode_locator(&b[..b.len() - 8], &d).is_err());
    }
}
