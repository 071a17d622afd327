//! Remote byte layouts of RACE hashing (little-endian u64 words; picture in
//! `docs/race.md`).
//!
//! - Directory (region `dir` on memory node 0): word 0 global depth, word 1
//!   the resize lock, word 2 the count of resizes, then from byte
//!   [`DIR_ENTRIES`] one [`DirEntry`] per index up to `2^MAX_DEPTH`.
//! - Subtable: `groups` bucket groups of three 64-byte buckets
//!   `[main | overflow | main]`; a key's two hash choices each name a
//!   *combined bucket* (a main bucket and the overflow bucket it shares),
//!   128 contiguous bytes read by one READ. A bucket is a header word
//!   ([`BucketHeader`]: local depth and suffix) and 7 [`Slot`]s.
//! - KV block: `key | len:32 tag:8 | checksum | value` padded to 64-byte
//!   units, written out of place before the slot CAS that publishes it.

use dmkv_api::checksum64_concat;

pub const BUCKET_BYTES: u64 = 64;
pub const SLOTS_PER_BUCKET: usize = 7;
pub const GROUP_BYTES: u64 = 3 * BUCKET_BYTES;
pub const COMBINED_BYTES: usize = 2 * BUCKET_BYTES as usize;

/// Directory words.
pub const DIR_DEPTH: u64 = 0;
pub const DIR_LOCK: u64 = 8;
pub const DIR_RESIZES: u64 = 16;
/// Byte offset of directory entry 0.
pub const DIR_ENTRIES: u64 = 64;
/// Largest global depth (directory of 2^16 entries, 512 KiB).
pub const MAX_DEPTH: u8 = 16;

pub fn dir_bytes() -> u64 {
    DIR_ENTRIES + 8 * (1 << MAX_DEPTH)
}

/// The unit of KV block lengths.
pub const KV_UNIT: usize = 64;
pub const KV_HEADER_BYTES: usize = 24;
/// The largest value (a block of at most 255 units).
pub const MAX_VALUE_LEN: usize = 4096;
const _: () = assert!((KV_HEADER_BYTES + MAX_VALUE_LEN).div_ceil(KV_UNIT) < 256);

/// A global address: memory-node index and byte offset (64-aligned).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GAddr {
    pub mn: usize,
    pub offset: u64,
}

/// A directory entry: `offset/64:40 | mn:8 | local depth:8 | 0:8`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DirEntry(pub u64);

const DE_OFF_BITS: u32 = 40;
const DE_MN_BITS: u32 = 8;
const _: () = assert!(DE_OFF_BITS + DE_MN_BITS + 8 <= 64);

impl DirEntry {
    pub fn new(at: GAddr, local_depth: u8) -> DirEntry {
        assert!(at.offset.is_multiple_of(64) && at.offset / 64 < 1 << DE_OFF_BITS);
        assert!(at.mn < 1 << DE_MN_BITS && local_depth <= MAX_DEPTH);
        DirEntry(
            (at.offset / 64)
                | ((at.mn as u64) << DE_OFF_BITS)
                | (u64::from(local_depth) << (DE_OFF_BITS + DE_MN_BITS)),
        )
    }
    pub fn subtable(self) -> GAddr {
        GAddr {
            mn: ((self.0 >> DE_OFF_BITS) & ((1 << DE_MN_BITS) - 1)) as usize,
            offset: (self.0 & ((1 << DE_OFF_BITS) - 1)) * 64,
        }
    }
    pub fn local_depth(self) -> u8 {
        (self.0 >> (DE_OFF_BITS + DE_MN_BITS)) as u8
    }
    /// Well formed: a known memory node, a plausible depth, high bits
    /// clear, not offset 0 (reserved), so zeroed memory is no entry.
    pub fn is_sane(self, memnodes: usize) -> bool {
        self.0 >> 56 == 0
            && self.local_depth() <= MAX_DEPTH
            && self.subtable().mn < memnodes
            && self.subtable().offset != 0
    }
}

/// A bucket header: `local depth:8 | suffix:32 | 0:23 | valid:1` (the hash
/// suffix the subtable owns, `local depth` bits of it). Zeroed memory is
/// never a valid header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BucketHeader(pub u64);

const BH_VALID: u64 = 1 << 63;
const _: () = assert!(MAX_DEPTH as u32 <= 32);

impl BucketHeader {
    pub fn new(local_depth: u8, suffix: u64) -> BucketHeader {
        assert!(local_depth <= MAX_DEPTH && suffix < 1 << local_depth);
        BucketHeader(u64::from(local_depth) | (suffix << 8) | BH_VALID)
    }
    pub fn local_depth(self) -> u8 {
        self.0 as u8
    }
    pub fn suffix(self) -> u64 {
        (self.0 >> 8) & 0xFFFF_FFFF
    }
    /// Whether this is a valid header of a subtable of `local_depth` that
    /// owns keys with directory hash `h`.
    pub fn matches(self, local_depth: u8, h: u64) -> bool {
        self.0 & BH_VALID != 0
            && self.local_depth() == local_depth
            && local_depth <= MAX_DEPTH
            && self.suffix() == h & ((1u64 << local_depth) - 1)
    }
}

/// A slot: `kv/64:36 | mn:4 | len units:8 | tag:6 | tentative:1 | frozen:1 |
/// fingerprint:8`. 0 is empty.
///
/// - `tentative`: an insert has claimed the slot but not yet checked for a
///   concurrent insert of the same key; readers treat it as absent.
/// - `frozen`: the subtable is being split (or was retired by a split); the
///   slot never changes again and writers wait for the new subtables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot(pub u64);

const S_OFF_BITS: u32 = 36;
const S_MN_BITS: u32 = 4;
const S_LEN_BITS: u32 = 8;
const S_TAG_BITS: u32 = 6;
const S_TENTATIVE: u64 = 1 << 54;
const S_FROZEN: u64 = 1 << 55;
const S_FP_SHIFT: u32 = 56;
const _: () = assert!(S_OFF_BITS + S_MN_BITS + S_LEN_BITS + S_TAG_BITS == 54);
/// Memory nodes a slot can point into.
pub const MAX_MEMNODES: usize = 1 << S_MN_BITS;
/// Tags wrap after this many reuses of one block.
pub const TAG_MOD: u8 = 1 << S_TAG_BITS;

impl Slot {
    pub const EMPTY: Slot = Slot(0);

    pub fn new(fp: u8, kv: GAddr, units: u8, tag: u8) -> Slot {
        assert!(kv.offset.is_multiple_of(KV_UNIT as u64) && kv.offset / 64 < 1 << S_OFF_BITS);
        assert!(kv.mn < MAX_MEMNODES && tag < TAG_MOD && units > 0);
        Slot(
            (kv.offset / 64)
                | ((kv.mn as u64) << S_OFF_BITS)
                | (u64::from(units) << (S_OFF_BITS + S_MN_BITS))
                | (u64::from(tag) << (S_OFF_BITS + S_MN_BITS + S_LEN_BITS))
                | (u64::from(fp) << S_FP_SHIFT),
        )
    }
    pub fn is_empty(self) -> bool {
        self.0 & !S_FROZEN == 0
    }
    pub fn kv(self) -> GAddr {
        GAddr {
            mn: ((self.0 >> S_OFF_BITS) & ((1 << S_MN_BITS) - 1)) as usize,
            offset: (self.0 & ((1 << S_OFF_BITS) - 1)) * 64,
        }
    }
    pub fn units(self) -> u8 {
        (self.0 >> (S_OFF_BITS + S_MN_BITS)) as u8
    }
    pub fn tag(self) -> u8 {
        ((self.0 >> (S_OFF_BITS + S_MN_BITS + S_LEN_BITS)) & ((1 << S_TAG_BITS) - 1)) as u8
    }
    pub fn fp(self) -> u8 {
        (self.0 >> S_FP_SHIFT) as u8
    }
    pub fn is_tentative(self) -> bool {
        self.0 & S_TENTATIVE != 0
    }
    pub fn is_frozen(self) -> bool {
        self.0 & S_FROZEN != 0
    }
    pub fn tentative(self) -> Slot {
        Slot(self.0 | S_TENTATIVE)
    }
    pub fn final_(self) -> Slot {
        Slot(self.0 & !S_TENTATIVE)
    }
    pub fn frozen(self) -> Slot {
        Slot(self.0 | S_FROZEN)
    }
    /// The slot as copied into a new subtable: not frozen.
    pub fn thawed(self) -> Slot {
        Slot(self.0 & !S_FROZEN)
    }
    /// A used, decided slot (maybe frozen): one readers may return.
    pub fn is_visible(self) -> bool {
        !self.is_empty() && !self.is_tentative()
    }
}

/// Hashes of a key: the directory hash (suffix bits pick the subtable, top
/// byte is the fingerprint) and the two bucket choices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KeyHash {
    pub dir: u64,
    pub fp: u8,
    pub b1: u64,
    pub b2: u64,
}

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 33)).wrapping_mul(0xFF51_AFD7_ED55_8CCD);
    x = (x ^ (x >> 33)).wrapping_mul(0xC4CE_B9FE_1A85_EC53);
    x ^ (x >> 33)
}

impl KeyHash {
    /// `groups` bucket groups give `2 * groups` combined buckets.
    pub fn new(key: u64, groups: u64) -> KeyHash {
        let dir = mix(key ^ 0x2545_F491_4F6C_DD1D);
        let h1 = mix(key ^ 0x9E37_79B9_7F4A_7C15);
        let h2 = mix(key ^ 0xD1B5_4A32_D192_ED03);
        let b1 = h1 % (2 * groups);
        let mut b2 = h2 % (2 * groups);
        if groups > 1 && b2 / 2 == b1 / 2 {
            // Two choices in one group would share the overflow bucket.
            b2 = (b2 + 2) % (2 * groups);
        }
        KeyHash {
            dir,
            fp: (dir >> 56) as u8,
            b1,
            b2,
        }
    }
}

/// Byte offset, inside a subtable, of combined bucket `b` (main bucket and
/// the overflow bucket it shares): buckets 0+1 of group b/2 for even b,
/// 1+2 for odd b.
pub fn combined_offset(b: u64) -> u64 {
    (b / 2) * GROUP_BYTES + (b % 2) * BUCKET_BYTES
}

/// Bytes of the KV block for `len` value bytes, in 64-byte units.
pub fn kv_units(len: usize) -> u8 {
    u8::try_from((KV_HEADER_BYTES + len).div_ceil(KV_UNIT)).expect("bounded by MAX_VALUE_LEN")
}

/// The KV block of `key`'s `value` under `tag`: header (key, length and
/// tag, checksum), value, zeroes to the unit's end. Built in one of the
/// thread's spare transport buffers (`dmkv_transport::buffers::take`; the
/// local transport gives a write's data back there once executed), so an
/// update's image reuses the last write's allocation instead of a new
/// zeroed one; `take` gives it empty and it is zeroed to the block's length
/// first, so no byte depends on what the buffer held.
pub fn encode_kv(key: u64, tag: u8, value: &[u8]) -> Vec<u8> {
    let mut b = dmkv_transport::buffers::take();
    b.resize(kv_units(value.len()) as usize * KV_UNIT, 0);
    b[0..8].copy_from_slice(&key.to_le_bytes());
    b[8..16].copy_from_slice(&(value.len() as u64 | (u64::from(tag) << 32)).to_le_bytes());
    b[24..24 + value.len()].copy_from_slice(value);
    let sum = kv_checksum(&b[0..16], value);
    b[16..24].copy_from_slice(&sum.to_le_bytes());
    b
}

fn kv_checksum(head: &[u8], value: &[u8]) -> u64 {
    checksum64_concat(head, value)
}

/// The (key, value) of a block read for `slot`, if it is intact and is the
/// block the slot names (its tag and length agree).
pub fn decode_kv(b: &[u8], slot: Slot) -> Option<(u64, Vec<u8>)> {
    decode_kv_ref(b, slot).map(|(key, value)| (key, value.to_vec()))
}

/// [`decode_kv`] without copying the value out of the read.
pub fn decode_kv_ref(b: &[u8], slot: Slot) -> Option<(u64, &[u8])> {
    if b.len() < KV_HEADER_BYTES {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let (key, lt) = (word(0), word(1));
    let len = (lt & 0xFFFF_FFFF) as usize;
    if lt >> 40 != 0
        || (lt >> 32) as u8 != slot.tag()
        || len > MAX_VALUE_LEN
        || kv_units(len) != slot.units()
        || b.len() < KV_HEADER_BYTES + len
    {
        return None;
    }
    let value = &b[24..24 + len];
    (kv_checksum(&b[0..16], value) == word(2)).then_some((key, value))
}

/// A read combined bucket: two buckets, each a header and 7 slots.
pub struct Combined {
    /// Byte offset of the first bucket in its subtable.
    pub offset: u64,
    pub headers: [BucketHeader; 2],
    pub slots: [Slot; 2 * SLOTS_PER_BUCKET],
}

impl Combined {
    pub fn parse(offset: u64, b: &[u8]) -> Combined {
        assert_eq!(b.len(), COMBINED_BYTES, "a combined bucket read");
        let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
        let mut slots = [Slot::EMPTY; 2 * SLOTS_PER_BUCKET];
        for (i, s) in slots.iter_mut().enumerate() {
            let bucket = i / SLOTS_PER_BUCKET;
            *s = Slot(word(bucket * 8 + 1 + i % SLOTS_PER_BUCKET));
        }
        Combined {
            offset,
            headers: [BucketHeader(word(0)), BucketHeader(word(8))],
            slots,
        }
    }
    /// Byte offset in the subtable of slot `i`.
    pub fn slot_offset(&self, i: usize) -> u64 {
        self.offset
            + (i / SLOTS_PER_BUCKET) as u64 * BUCKET_BYTES
            + 8
            + 8 * (i % SLOTS_PER_BUCKET) as u64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn packed_words_round_trip() {
        let at = GAddr {
            mn: MAX_MEMNODES - 1,
            offset: ((1 << S_OFF_BITS) - 1) * 64,
        };
        let s = Slot::new(0xAB, at, 255, TAG_MOD - 1);
        assert_eq!(
            (s.fp(), s.kv(), s.units(), s.tag()),
            (0xAB, at, 255, TAG_MOD - 1)
        );
        assert!(!s.is_tentative() && !s.is_frozen() && s.is_visible());
        let t = s.tentative();
        assert!(t.is_tentative() && !t.is_visible() && t.final_() == s);
        let f = s.frozen();
        assert!(f.is_frozen() && f.is_visible() && f.kv() == at && f.thawed() == s);
        assert!(Slot::EMPTY.frozen().is_empty());
        let e = DirEntry::new(
            GAddr {
                mn: 3,
                offset: 64 * 12345,
            },
            9,
        );
        assert_eq!(
            (e.subtable(), e.local_depth()),
            (
                GAddr {
                    mn: 3,
                    offset: 64 * 12345
                },
                9
            )
        );
        assert!(e.is_sane(4) && !e.is_sane(3) && !DirEntry(0).is_sane(4));
        let h = BucketHeader::new(3, 5);
        assert!(h.matches(3, 0b1101) && !h.matches(3, 0b1100) && !h.matches(2, 0b1101));
        assert!(!BucketHeader(0).matches(0, 0), "zeroed memory is no header");
    }

    #[test]
    #[allow(clippy::disallowed_methods)] // a thread of its own: its spares are this test's
    fn a_kv_block_is_built_in_a_spare_buffer_whatever_it_held() {
        // `encode_kv` takes the thread's spare transport buffer (the last
        // write's data on `local`) and writes every byte of the block: the
        // same block as in a new zeroed vector, in the spare's allocation.
        std::thread::spawn(|| {
            let value = [7u8; 50];
            let fresh = {
                let mut b = vec![0u8; kv_units(value.len()) as usize * KV_UNIT];
                b[0..8].copy_from_slice(&9u64.to_le_bytes());
                b[8..16].copy_from_slice(&(50u64 | (5u64 << 32)).to_le_bytes());
                b[24..74].copy_from_slice(&value);
                let sum = kv_checksum(&b[0..16], &value);
                b[16..24].copy_from_slice(&sum.to_le_bytes());
                b
            };
            let dirty = vec![0xffu8; 256];
            let at = dirty.as_ptr();
            dmkv_transport::buffers::give(dirty);
            let b = encode_kv(9, 5, &value);
            assert_eq!(b.as_ptr(), at, "the spare's allocation");
            assert_eq!(b, fresh);
        })
        .join()
        .unwrap();
    }

    #[test]
    fn kv_blocks_check_tag_length_and_bytes() {
        let b = encode_kv(9, 5, b"value");
        let s = Slot::new(1, GAddr { mn: 0, offset: 64 }, kv_units(5), 5);
        assert_eq!(decode_kv(&b, s), Some((9, b"value".to_vec())));
        assert_eq!(
            decode_kv(&b, Slot::new(1, s.kv(), kv_units(5), 6)),
            None,
            "reused"
        );
        let mut c = b.clone();
        c[26] ^= 4;
        assert_eq!(decode_kv(&c, s), None, "torn");
        let big = encode_kv(9, 5, &[1; 100]);
        assert_eq!(decode_kv(&big, s), None, "length disagrees with the slot");
    }

    #[test]
    fn combined_buckets_share_the_overflow_bucket() {
        assert_eq!(combined_offset(0), 0);
        assert_eq!(combined_offset(1), 64);
        assert_eq!(combined_offset(2), 192);
        assert_eq!(combined_offset(3), 256);
        for k in 0..1000 {
            let h = KeyHash::new(k, 8);
            assert!(h.b1 < 16 && h.b2 < 16 && h.b1 / 2 != h.b2 / 2);
        }
    }
}
