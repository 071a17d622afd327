//! Byte layouts of Outback's memory-node structures (all little-endian,
//! all 8-byte words; see `docs/outback.md` for pictures).
//!
//! - [`SlotWord`]: one slot of a 32-byte DMPH bucket (paper Fig. 5).
//! - [`ControlWord`]: per bucket, the latest seed plus the bucket's lock and
//!   version (the memory node's per-bucket mutex and seqlock).
//! - KV blocks: `key_len | value_len | key | value.. | seq | check`.
//! - The heap region (header, block-start bitmap, blocks), the table region
//!   (seeds array, then 64-byte bucket lines: control word and four slots), the per-shard control region (`ctl`)
//!   and the per-table locator region.

use dmkv_api::checksum64;

// ---------------------------------------------------------------- slots

/// A slot: bit 63 cache bit, bits 57..63 fingerprint, bits 48..57 block
/// length in 8-byte words (0 = empty), bits 0..48 block address (byte
/// offset in the shard's heap region).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct SlotWord(pub u64);

pub const ADDR_BITS: u32 = 48;
pub const LEN_SHIFT: u32 = 48;
pub const LEN_BITS: u32 = 9;
pub const FP_SHIFT: u32 = 57;
pub const FP_BITS: u32 = 6;
pub const CACHE_SHIFT: u32 = 63;
const ADDR_MASK: u64 = (1 << ADDR_BITS) - 1;
const LEN_MASK: u64 = ((1 << LEN_BITS) - 1) << LEN_SHIFT;
const FP_MASK: u64 = ((1 << FP_BITS) - 1) << FP_SHIFT;
const CACHE_BIT: u64 = 1 << CACHE_SHIFT;
// The four fields tile the word exactly (paper: 1 + 6 + 9 + 48 bits).
const _: () = assert!(ADDR_BITS == LEN_SHIFT && LEN_SHIFT + LEN_BITS == FP_SHIFT);
const _: () = assert!(FP_SHIFT + FP_BITS == CACHE_SHIFT && CACHE_SHIFT == 63);
const _: () = assert!(ADDR_MASK ^ LEN_MASK ^ FP_MASK ^ CACHE_BIT == u64::MAX);

/// The longest block a slot can describe, in words.
pub const MAX_BLOCK_WORDS: u64 = (1 << LEN_BITS) - 1;

impl SlotWord {
    pub fn new(fp: u8, len_words: u64, addr: u64) -> SlotWord {
        debug_assert!(len_words > 0 && len_words <= MAX_BLOCK_WORDS && addr <= ADDR_MASK);
        SlotWord(((fp as u64) << FP_SHIFT) & FP_MASK | len_words << LEN_SHIFT | addr)
    }
    pub fn is_empty(self) -> bool {
        self.len_words() == 0
    }
    pub fn len_words(self) -> u64 {
        (self.0 & LEN_MASK) >> LEN_SHIFT
    }
    pub fn addr(self) -> u64 {
        self.0 & ADDR_MASK
    }
    pub fn fp(self) -> u8 {
        ((self.0 & FP_MASK) >> FP_SHIFT) as u8
    }
    pub fn cache(self) -> bool {
        self.0 & CACHE_BIT != 0
    }
    pub fn with_cache(self, on: bool) -> SlotWord {
        SlotWord(if on {
            self.0 | CACHE_BIT
        } else {
            self.0 & !CACHE_BIT
        })
    }
    /// The same slot with the entry removed, keeping the cache bit.
    pub fn cleared(self) -> SlotWord {
        SlotWord(self.0 & CACHE_BIT)
    }
    /// The entry without the cache bit (what moves when a key moves).
    pub fn entry(self) -> SlotWord {
        SlotWord(self.0 & !CACHE_BIT)
    }
}

// --------------------------------------------------------- control words

/// Per bucket: bits 0..8 the latest seed, bits 8..63 a version bumped by
/// every writer, bit 63 the writer lock.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ControlWord(pub u64);

const SEED_MASK: u64 = 0xFF;
const VERSION_SHIFT: u32 = 8;
const LOCK_BIT: u64 = 1 << 63;
const _: () = assert!(SEED_MASK.count_ones() == 8 && VERSION_SHIFT == 8);
const VERSION_MASK: u64 = !(SEED_MASK | LOCK_BIT);

impl ControlWord {
    pub fn seed(self) -> u8 {
        (self.0 & SEED_MASK) as u8
    }
    pub fn locked(self) -> bool {
        self.0 & LOCK_BIT != 0
    }
    pub fn with_lock(self) -> ControlWord {
        ControlWord(self.0 | LOCK_BIT)
    }
    /// The unlocked word after a write that leaves `seed`.
    pub fn next(self, seed: u8) -> ControlWord {
        let version = ((self.0 & VERSION_MASK) >> VERSION_SHIFT).wrapping_add(1);
        ControlWord((version << VERSION_SHIFT) & VERSION_MASK | seed as u64)
    }
    pub fn initial(seed: u8) -> ControlWord {
        ControlWord(seed as u64)
    }
}

// ------------------------------------------------------------- KV blocks

/// Words of a block before the value: key length, value length, key.
pub const BLOCK_HEAD_WORDS: u64 = 3;
/// Words after the value: sequence number and check.
pub const BLOCK_TAIL_WORDS: u64 = 2;
/// The largest value a block holds (a block is at most
/// [`MAX_BLOCK_WORDS`] words).
pub const MAX_VALUE_LEN: usize =
    ((MAX_BLOCK_WORDS - BLOCK_HEAD_WORDS - BLOCK_TAIL_WORDS) * 8) as usize;
const _: () = assert!(MAX_VALUE_LEN == 4048);

pub fn value_words(value_len: usize) -> u64 {
    (value_len as u64).div_ceil(8)
}

/// Words of the block of a `value_len`-byte value.
pub fn block_words(value_len: usize) -> u64 {
    BLOCK_HEAD_WORDS + value_words(value_len) + BLOCK_TAIL_WORDS
}

/// Encodes a live block: `8 | value_len | key | value (zero-padded) | seq |
/// checksum64(all previous words)`. `seq` must be non-zero.
pub fn encode_block(key: u64, value: &[u8], seq: u64) -> Vec<u8> {
    debug_assert!(seq != 0 && value.len() <= MAX_VALUE_LEN);
    let words = block_words(value.len()) as usize;
    let mut b = Vec::with_capacity(words * 8);
    b.extend_from_slice(&8u64.to_le_bytes());
    b.extend_from_slice(&(value.len() as u64).to_le_bytes());
    b.extend_from_slice(&key.to_le_bytes());
    b.extend_from_slice(value);
    b.resize((words - BLOCK_TAIL_WORDS as usize) * 8, 0);
    b.extend_from_slice(&seq.to_le_bytes());
    let check = checksum64(&b);
    b.extend_from_slice(&check.to_le_bytes());
    b
}

/// Byte offset of the sequence word in a block of `words` words (a dead
/// block has seq 0).
pub fn seq_offset(words: u64) -> u64 {
    (words - BLOCK_TAIL_WORDS) * 8
}

fn word(b: &[u8], i: usize) -> Option<u64> {
    Some(u64::from_le_bytes(
        b.get(i * 8..i * 8 + 8)?.try_into().ok()?,
    ))
}

/// The front of a block as a GET reply carries it (key length, value
/// length, key, value), parsed with bounds checks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockFront<'a> {
    pub key: u64,
    pub value: &'a [u8],
}

impl<'a> BlockFront<'a> {
    /// Where a block's value starts.
    pub const VALUE_AT: usize = BLOCK_HEAD_WORDS as usize * 8;

    pub fn parse(b: &'a [u8]) -> Option<BlockFront<'a>> {
        let (klen, vlen, key) = (word(b, 0)?, word(b, 1)?, word(b, 2)?);
        if klen != 8 || vlen > MAX_VALUE_LEN as u64 {
            return None;
        }
        let start = Self::VALUE_AT;
        let value = b.get(start..start + vlen as usize)?;
        Some(BlockFront { key, value })
    }
}

/// A whole block read back from a heap (recovery): its key, value and
/// sequence number, if it is a complete live block.
pub fn parse_live_block(b: &[u8]) -> Option<(u64, &[u8], u64)> {
    let front = BlockFront::parse(b)?;
    let words = block_words(front.value.len()) as usize;
    if b.len() != words * 8 {
        return None;
    }
    let seq = word(b, words - 2)?;
    let check = word(b, words - 1)?;
    (seq != 0 && checksum64(&b[..(words - 1) * 8]) == check).then_some((
        front.key,
        front.value,
        seq,
    ))
}

/// The block length in words a block header claims, if plausible.
pub fn header_words(klen: u64, vlen: u64) -> Option<u64> {
    (klen == 8 && vlen <= MAX_VALUE_LEN as u64).then(|| block_words(vlen as usize))
}

// ---------------------------------------------------------------- heap

/// Heap region: a 64-byte header, a bitmap with one bit per data word that
/// marks where blocks start (set once, when a block is first carved), the
/// session table (at-most-once writes, `server::session`), then the blocks.
/// Mirrors on replica nodes have exactly this layout, so block and session
/// entry addresses are the same everywhere.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HeapLayout {
    pub bitmap_start: u64,
    /// First session entry ([`SESSION_BYTES`] each).
    pub sessions_start: u64,
    /// Session entries.
    pub sessions: u64,
    pub data_start: u64,
    pub data_len: u64,
}

pub const HEAP_MAGIC: u64 = u64::from_le_bytes(*b"OBHEAP02");

/// Bytes of one session entry: session id, sequence number, outcome,
/// checksum64 of the three.
pub const SESSION_BYTES: u64 = 32;

impl HeapLayout {
    /// A heap with about `data_bytes` of block space and `sessions` session
    /// entries.
    pub fn for_data(data_bytes: u64, sessions: u64) -> HeapLayout {
        let data_len = data_bytes.div_ceil(64) * 64;
        let bitmap_len = (data_len / 8).div_ceil(8).div_ceil(64) * 64;
        let sessions_start = 64 + bitmap_len;
        let sessions_len = (sessions * SESSION_BYTES).div_ceil(64) * 64;
        HeapLayout {
            bitmap_start: 64,
            sessions_start,
            sessions,
            data_start: sessions_start + sessions_len,
            data_len,
        }
    }
    pub fn region_len(&self) -> u64 {
        self.data_start + self.data_len
    }
    /// The bitmap word (byte offset) and bit of the block starting at `addr`.
    pub fn start_bit(&self, addr: u64) -> (u64, u64) {
        let w = (addr - self.data_start) / 8;
        (self.bitmap_start + (w / 64) * 8, w % 64)
    }
    /// Byte offset of session entry `pos`.
    pub fn session(&self, pos: u32) -> u64 {
        debug_assert!((pos as u64) < self.sessions);
        self.sessions_start + pos as u64 * SESSION_BYTES
    }
    /// The header words written at creation: magic, data start, data
    /// length, first session entry, session entries.
    pub fn header(&self) -> [u64; 5] {
        [
            HEAP_MAGIC,
            self.data_start,
            self.data_len,
            self.sessions_start,
            self.sessions,
        ]
    }
}

// --------------------------------------------------------------- tables

/// Table region: the latest-seeds array (`buckets` bytes, one per bucket,
/// padded to a whole cache line), then `buckets` bucket lines of 64 bytes:
///
/// ```text
/// word 0      control word (lock, version, latest seed)
/// words 1..5  the bucket's four slots (the paper's 32-byte bucket)
/// words 5..8  reserved, zero
/// ```
///
/// The control word shares the slots' cache line so that a GET (control
/// word, slot, control word again) touches one line of the table, as the
/// paper's GET touches one bucket line, and one line of the heap (the
/// block). The seeds array duplicates the control words' seed bytes for
/// compute nodes, which fetch it one-sided (one byte per bucket, the
/// paper's seed array); a writer stores it under the bucket's lock, before
/// the control word (so it is never behind the control word once unlocked).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TableLayout {
    pub buckets: u32,
    pub buckets_start: u64,
}

/// Bytes of one bucket line (control word, four slots, three reserved words).
pub const BUCKET_BYTES: u64 = 64;
/// Offset of slot 0 within a bucket line.
pub const BUCKET_SLOTS_AT: u64 = 8;
const _: () = assert!(BUCKET_SLOTS_AT + 4 * 8 <= BUCKET_BYTES && BUCKET_BYTES == 64);

impl TableLayout {
    pub fn new(buckets: u32) -> TableLayout {
        TableLayout {
            buckets,
            buckets_start: (buckets as u64).div_ceil(64) * 64,
        }
    }
    pub fn region_len(&self) -> u64 {
        self.buckets_start + self.buckets as u64 * BUCKET_BYTES
    }
    /// Byte offset of bucket `bucket`'s seed in the seeds array.
    pub fn seed(&self, bucket: u32) -> u64 {
        bucket as u64
    }
    /// Bytes a compute node reads for all seeds (the array, rounded up to
    /// whole words; the padding is zero and ignored).
    pub fn seeds_read_len(&self) -> usize {
        (self.buckets as usize).div_ceil(8) * 8
    }
    pub fn control(&self, bucket: u32) -> u64 {
        self.buckets_start + bucket as u64 * BUCKET_BYTES
    }
    pub fn slot(&self, bucket: u32, slot: usize) -> u64 {
        self.control(bucket) + BUCKET_SLOTS_AT + slot as u64 * 8
    }
}

// ------------------------------------------------------ control region

/// The per-shard control region `ctl` that compute nodes poll one-sided:
///
/// ```text
/// word 0  countdown   compute nodes still to fetch the last publication (FAA -1 each)
/// word 1  version     publications so far (0: none yet)
/// word 2  applied     the last rebuild whose buffered inserts/deletes are applied
/// word 3  body_len    bytes of the body
/// word 4  body_check  checksum64 of the body
/// word 5  built       full builds completed (bulk loads wait for theirs)
/// 64..    body        (see `publish::ViewDesc`)
/// ```
pub mod ctl {
    pub const COUNTDOWN: u64 = 0;
    pub const VERSION: u64 = 8;
    pub const APPLIED: u64 = 16;
    pub const BODY_LEN: u64 = 24;
    pub const BODY_CHECK: u64 = 32;
    pub const BUILT: u64 = 40;
    pub const HEADER_BYTES: u64 = 64;
    /// Bytes of the header a poll reads (countdown .. built).
    pub const POLL_BYTES: usize = 48;
    pub const BODY: u64 = HEADER_BYTES;
}

/// The per-table locator region: a 64-byte header, then the Othello's
/// packed bits.
///
/// ```text
/// word 0 magic   word 1 othello seed   word 2 ma | mb << 32
/// word 3 bits words   word 4 checksum64 of the bits
/// ```
pub mod locator {
    pub const MAGIC: u64 = u64::from_le_bytes(*b"OBLOC001");
    pub const HEADER_BYTES: u64 = 64;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_fields_round_trip() {
        let s = SlotWord::new(0x3F, MAX_BLOCK_WORDS, (1 << 48) - 8);
        assert_eq!(
            (s.fp(), s.len_words(), s.addr(), s.cache()),
            (0x3F, 511, (1 << 48) - 8, false)
        );
        let c = s.with_cache(true);
        assert!(c.cache() && c.entry() == s);
        assert!(c.cleared().is_empty() && c.cleared().cache());
        assert!(SlotWord::default().is_empty());
    }

    #[test]
    fn control_words_version_and_lock() {
        let c = ControlWord::initial(7);
        assert_eq!((c.seed(), c.locked()), (7, false));
        let l = c.with_lock();
        assert!(l.locked());
        let n = l.next(9);
        assert_eq!((n.seed(), n.locked()), (9, false));
        assert_ne!(n, c.next(9).next(9));
        assert_ne!(n.0 & !0xFF, c.0 & !0xFF, "the version moved");
    }

    #[test]
    fn blocks_round_trip_and_detect_damage() {
        for len in [0usize, 1, 8, 9, 100, MAX_VALUE_LEN] {
            let v: Vec<u8> = (0..len).map(|i| i as u8).collect();
            let b = encode_block(42, &v, 5);
            assert_eq!(b.len() as u64, block_words(len) * 8);
            assert!(block_words(len) <= MAX_BLOCK_WORDS);
            let f = BlockFront::parse(&b).unwrap();
            assert_eq!((f.key, f.value), (42, &v[..]));
            assert_eq!(parse_live_block(&b), Some((42, &v[..], 5)));
            let mut dead = b.clone();
            let at = seq_offset(block_words(len)) as usize;
            dead[at..at + 8].fill(0);
            assert_eq!(parse_live_block(&dead), None);
            let mut torn = b.clone();
            torn[16] ^= 1;
            assert_eq!(parse_live_block(&torn), None);
        }
        assert!(BlockFront::parse(&[0; 20]).is_none());
        let mut long = encode_block(1, &[1; 8], 1);
        long[8] = 200; // value length beyond the bytes
        assert!(BlockFront::parse(&long[..40]).is_none());
    }

    #[test]
    fn heap_and_table_geometry() {
        let h = HeapLayout::for_data(1 << 20, 3);
        assert!(h.data_start >= 64 + (1 << 20) / 64 + 3 * SESSION_BYTES);
        assert_eq!(h.sessions_start, 64 + (1 << 20) / 64);
        assert_eq!(h.session(2), h.sessions_start + 64);
        assert!(h.session(2) + SESSION_BYTES <= h.data_start);
        assert!(h.data_start.is_multiple_of(64));
        assert_eq!(h.start_bit(h.data_start + 8 * 65), (h.bitmap_start + 8, 1));
        let t = TableLayout::new(3);
        assert_eq!(t.buckets_start, 64);
        assert_eq!((t.seed(2), t.seeds_read_len()), (2, 8));
        assert_eq!(t.control(2), 64 + 128);
        assert_eq!(t.slot(2, 3), 64 + 128 + 8 + 24);
        assert_eq!(t.region_len(), 64 + 192);
        // Every bucket's control word and slots lie in one 64-byte line
        // (the seeds array ends on a line boundary), and no two buckets
        // share a line.
        for buckets in [1u32, 7, 64, 65, 1000] {
            let t = TableLayout::new(buckets);
            assert!(t.buckets_start.is_multiple_of(64) && t.buckets_start >= buckets as u64);
            assert!(t.seeds_read_len() as u64 <= t.buckets_start);
            for b in [0, buckets / 2, buckets - 1] {
                let line = t.control(b) / 64;
                assert!((0..4).all(|s| t.slot(b, s) / 64 == line), "bucket {b}");
                assert!(b == 0 || t.control(b - 1) / 64 != line);
                assert!(t.slot(b, 3) + 8 <= t.region_len());
            }
        }
    }
}
