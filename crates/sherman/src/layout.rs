//! Remote byte layouts of the tree, parsed through bounds-checked views.
//!
//! Every word is a little-endian u64. See `docs/sherman.md` for the picture.
//!
//! - [`GAddr`]: a global address, `offset:48 | memnode:16`.
//! - Tree node ([`NodeImage`]), `node_bytes` long (a multiple of 64, at most
//!   [`MAX_NODE_BYTES`]):
//!   `checksum | header | low | high | sibling | ool_bitmap | 0 | 0 | entries`
//!   where the checksum covers every byte after it, the header is
//!   `level:8 | count:8`, `[low, high)` are the fences (`high = u64::MAX` is
//!   +infinity), `sibling` is the right link (0 = none), `ool_bitmap` marks
//!   leaf entries whose value word is a [`FatPtr`], and entries are 16 bytes:
//!   `key | value-or-child`. Leaf entries are unsorted and
//!   `key = u64::MAX` marks an empty one; inner entries are sorted, the
//!   first `count` are used and entry 0's key is the node's low fence.
//! - Value block (out-of-line values): `key | len:32 tag:8 | checksum |
//!   bytes` padded to 8, the checksum covering the first two words and the
//!   bytes.

use dmkv_api::{checksum64, checksum64_concat};

/// Bytes before the first entry of a node.
pub const NODE_HEADER_BYTES: usize = 64;
pub const ENTRY_BYTES: usize = 16;
/// Leaves have at most 64 entries (one bit each in the bitmap).
pub const MAX_NODE_BYTES: usize = NODE_HEADER_BYTES + 64 * ENTRY_BYTES;
pub const MIN_NODE_BYTES: usize = 256;
/// The key that marks an empty leaf entry and the +infinity fence.
pub const EMPTY_KEY: u64 = u64::MAX;
/// Bytes of the node header a leaf write rewrites (checksum .. bitmap).
pub const LEAF_HEADER_WRITE: usize = 48;

const W_CHECKSUM: usize = 0;
const W_HEADER: usize = 8;
const W_LOW: usize = 16;
const W_HIGH: usize = 24;
const W_SIBLING: usize = 32;
const W_BITMAP: usize = 40;
const _: () = assert!(W_BITMAP + 8 == LEAF_HEADER_WRITE && LEAF_HEADER_WRITE <= NODE_HEADER_BYTES);

/// A global address: `offset` in bits 0..48, memory-node index (position in
/// the instance's node list) in bits 48..64. 0 is null (offset 0 of node 0
/// is the superblock).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct GAddr(pub u64);

const GADDR_OFFSET_BITS: u32 = 48;
const _: () = assert!(GADDR_OFFSET_BITS + 16 == 64);

impl GAddr {
    pub const NULL: GAddr = GAddr(0);
    pub fn new(mn: usize, offset: u64) -> GAddr {
        assert!(offset < 1 << GADDR_OFFSET_BITS && mn < 1 << 16);
        GAddr(offset | ((mn as u64) << GADDR_OFFSET_BITS))
    }
    pub fn mn(self) -> usize {
        (self.0 >> GADDR_OFFSET_BITS) as usize
    }
    pub fn offset(self) -> u64 {
        self.0 & ((1 << GADDR_OFFSET_BITS) - 1)
    }
    pub fn is_null(self) -> bool {
        self.0 == 0
    }
}

/// A pointer to an out-of-line value: `offset/8:32 | len:13 | tag:8 |
/// memnode:8 | 0:3`. The tag is the block's incarnation: a reused block
/// gets the next tag, so a reader holding an old pointer notices.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FatPtr(pub u64);

const FP_OFF_BITS: u32 = 32;
const FP_LEN_BITS: u32 = 13;
const FP_TAG_BITS: u32 = 8;
const FP_MN_BITS: u32 = 8;
const _: () = assert!(FP_OFF_BITS + FP_LEN_BITS + FP_TAG_BITS + FP_MN_BITS <= 64);
/// The largest value (bounded by the length field).
pub const MAX_VALUE_LEN: usize = 4096;
const _: () = assert!(MAX_VALUE_LEN < 1 << FP_LEN_BITS);
/// Memory nodes addressable by a fat pointer.
pub const MAX_MEMNODES: usize = 1 << FP_MN_BITS;

impl FatPtr {
    pub fn new(mn: usize, offset: u64, len: usize, tag: u8) -> FatPtr {
        assert!(offset.is_multiple_of(8) && offset / 8 < 1 << FP_OFF_BITS);
        assert!(len <= MAX_VALUE_LEN && mn < MAX_MEMNODES);
        FatPtr(
            (offset / 8)
                | ((len as u64) << FP_OFF_BITS)
                | (u64::from(tag) << (FP_OFF_BITS + FP_LEN_BITS))
                | ((mn as u64) << (FP_OFF_BITS + FP_LEN_BITS + FP_TAG_BITS)),
        )
    }
    pub fn offset(self) -> u64 {
        (self.0 & ((1 << FP_OFF_BITS) - 1)) * 8
    }
    pub fn len(self) -> usize {
        ((self.0 >> FP_OFF_BITS) & ((1 << FP_LEN_BITS) - 1)) as usize
    }
    pub fn is_empty(self) -> bool {
        self.len() == 0
    }
    pub fn tag(self) -> u8 {
        (self.0 >> (FP_OFF_BITS + FP_LEN_BITS)) as u8
    }
    pub fn mn(self) -> usize {
        ((self.0 >> (FP_OFF_BITS + FP_LEN_BITS + FP_TAG_BITS)) & ((1 << FP_MN_BITS) - 1)) as usize
    }
}

/// Bytes of a value block's header.
pub const BLOCK_HEADER_BYTES: usize = 24;

/// Bytes a block for `len` value bytes occupies (padded to 8).
pub fn block_bytes(len: usize) -> usize {
    BLOCK_HEADER_BYTES + len.div_ceil(8) * 8
}

/// The bytes of a value block.
pub fn encode_block(key: u64, tag: u8, value: &[u8]) -> Vec<u8> {
    let mut b = vec![0u8; block_bytes(value.len())];
    b[0..8].copy_from_slice(&key.to_le_bytes());
    let lt = value.len() as u64 | (u64::from(tag) << 32);
    b[8..16].copy_from_slice(&lt.to_le_bytes());
    b[24..24 + value.len()].copy_from_slice(value);
    let sum = block_checksum(&b[0..16], value);
    b[16..24].copy_from_slice(&sum.to_le_bytes());
    b
}

fn block_checksum(head: &[u8], value: &[u8]) -> u64 {
    checksum64_concat(head, value)
}

/// The value in block image `b` if it is the block `ptr` names for `key`:
/// same key, length and tag, and an intact checksum.
pub fn decode_block(b: &[u8], key: u64, ptr: FatPtr) -> Option<Vec<u8>> {
    let len = ptr.len();
    if b.len() < block_bytes(len) {
        return None;
    }
    let word = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let lt = word(1);
    if word(0) != key
        || lt & 0xFFFF_FFFF != len as u64
        || (lt >> 32) as u8 != ptr.tag()
        || lt >> 40 != 0
    {
        return None;
    }
    let value = &b[24..24 + len];
    (block_checksum(&b[0..16], value) == word(2)).then(|| value.to_vec())
}

/// A leaf entry's value: inline (exactly 8 bytes) or out of line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ValueRef {
    Inline(u64),
    OutOfLine(FatPtr),
}

/// A copy of one node, read or being built. Accessors are bounds-checked by
/// construction: the image has exactly `node_bytes` bytes and entry indices
/// are checked against the capacity. Its buffer goes back to the thread's
/// spare read buffers when it drops (`dmkv_transport::buffers`), so the next
/// node read fills it instead of allocating.
#[derive(Clone, PartialEq, Eq)]
pub struct NodeImage {
    bytes: Vec<u8>,
}

impl Drop for NodeImage {
    fn drop(&mut self) {
        dmkv_transport::buffers::give(std::mem::take(&mut self.bytes));
    }
}

impl std::fmt::Debug for NodeImage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeImage")
            .field("level", &self.level())
            .field("low", &self.low())
            .field("high", &self.high())
            .field("sibling", &self.sibling())
            .finish()
    }
}

impl NodeImage {
    /// A fresh node: no entries (leaf entries all empty).
    pub fn new(node_bytes: usize, level: u8, low: u64, high: u64, sibling: GAddr) -> NodeImage {
        assert!(
            (MIN_NODE_BYTES..=MAX_NODE_BYTES).contains(&node_bytes)
                && node_bytes.is_multiple_of(64)
        );
        let mut n = NodeImage {
            bytes: vec![0; node_bytes],
        };
        n.set_word(W_HEADER, u64::from(level));
        n.set_word(W_LOW, low);
        n.set_word(W_HIGH, high);
        n.set_word(W_SIBLING, sibling.0);
        if level == 0 {
            for i in 0..n.capacity() {
                n.set_leaf_entry(i, EMPTY_KEY, ValueRef::Inline(0));
            }
        }
        n
    }

    /// Takes a read image; `None` if its length is wrong or its checksum does
    /// not match (a torn or concurrent read).
    pub fn validated(bytes: Vec<u8>, node_bytes: usize) -> Option<NodeImage> {
        if bytes.len() != node_bytes {
            return None;
        }
        let n = NodeImage { bytes };
        let level = n.word(W_HEADER) & 0xFF;
        let count = (n.word(W_HEADER) >> 8) & 0xFF;
        let sane = n.word(W_HEADER) >> 16 == 0
            && count as usize <= n.capacity()
            && (level != 0 || count == 0)
            && n.low() < n.high();
        (sane && n.word(W_CHECKSUM) == checksum64(&n.bytes[8..])).then_some(n)
    }

    /// Seals the image: computes the checksum. Call before writing it.
    pub fn seal(&mut self) {
        let sum = checksum64(&self.bytes[8..]);
        self.set_word(W_CHECKSUM, sum);
    }

    pub fn bytes(&self) -> &[u8] {
        &self.bytes
    }

    fn word(&self, at: usize) -> u64 {
        u64::from_le_bytes(self.bytes[at..at + 8].try_into().expect("8 bytes"))
    }
    fn set_word(&mut self, at: usize, v: u64) {
        self.bytes[at..at + 8].copy_from_slice(&v.to_le_bytes());
    }

    pub fn capacity(&self) -> usize {
        (self.bytes.len() - NODE_HEADER_BYTES) / ENTRY_BYTES
    }
    pub fn level(&self) -> u8 {
        self.word(W_HEADER) as u8
    }
    pub fn is_leaf(&self) -> bool {
        self.level() == 0
    }
    pub fn low(&self) -> u64 {
        self.word(W_LOW)
    }
    pub fn high(&self) -> u64 {
        self.word(W_HIGH)
    }
    pub fn set_high(&mut self, high: u64) {
        self.set_word(W_HIGH, high);
    }
    pub fn sibling(&self) -> GAddr {
        GAddr(self.word(W_SIBLING))
    }
    pub fn set_sibling(&mut self, s: GAddr) {
        self.set_word(W_SIBLING, s.0);
    }
    /// Whether `key` is inside this node's fences.
    pub fn covers(&self, key: u64) -> bool {
        self.low() <= key && key < self.high()
    }

    fn entry_at(&self, i: usize) -> usize {
        assert!(i < self.capacity(), "entry {i} of {}", self.capacity());
        NODE_HEADER_BYTES + i * ENTRY_BYTES
    }
    /// Byte range of entry `i` (for one-entry writes).
    pub fn entry_range(&self, i: usize) -> std::ops::Range<usize> {
        let at = self.entry_at(i);
        at..at + ENTRY_BYTES
    }

    // ---- leaves ----

    pub fn leaf_key(&self, i: usize) -> u64 {
        self.word(self.entry_at(i))
    }
    pub fn leaf_value(&self, i: usize) -> ValueRef {
        let w = self.word(self.entry_at(i) + 8);
        if self.word(W_BITMAP) >> i & 1 == 1 {
            ValueRef::OutOfLine(FatPtr(w))
        } else {
            ValueRef::Inline(w)
        }
    }
    pub fn set_leaf_entry(&mut self, i: usize, key: u64, v: ValueRef) {
        let at = self.entry_at(i);
        self.set_word(at, key);
        let (w, ool) = match v {
            ValueRef::Inline(w) => (w, false),
            ValueRef::OutOfLine(p) => (p.0, true),
        };
        self.set_word(at + 8, w);
        let bm = self.word(W_BITMAP) & !(1 << i);
        self.set_word(W_BITMAP, bm | (u64::from(ool) << i));
    }
    /// The entry holding `key`.
    pub fn leaf_find(&self, key: u64) -> Option<usize> {
        (0..self.capacity()).find(|&i| self.leaf_key(i) == key)
    }
    pub fn leaf_free(&self) -> Option<usize> {
        self.leaf_find(EMPTY_KEY)
    }
    /// Used entries, sorted by key.
    pub fn leaf_sorted(&self) -> Vec<(u64, ValueRef)> {
        let mut v: Vec<_> = (0..self.capacity())
            .filter(|&i| self.leaf_key(i) != EMPTY_KEY)
            .map(|i| (self.leaf_key(i), self.leaf_value(i)))
            .collect();
        v.sort_unstable_by_key(|e| e.0);
        v
    }

    // ---- inner nodes ----

    pub fn count(&self) -> usize {
        ((self.word(W_HEADER) >> 8) & 0xFF) as usize
    }
    pub fn inner_entry(&self, i: usize) -> (u64, GAddr) {
        assert!(i < self.count());
        let at = self.entry_at(i);
        (self.word(at), GAddr(self.word(at + 8)))
    }
    pub fn inner_entries(&self) -> Vec<(u64, GAddr)> {
        (0..self.count()).map(|i| self.inner_entry(i)).collect()
    }
    /// Replaces the entries of an inner node (sorted, at most capacity).
    pub fn set_inner_entries(&mut self, entries: &[(u64, GAddr)]) {
        assert!(entries.len() <= self.capacity() && entries.len() < 256);
        debug_assert!(entries.windows(2).all(|w| w[0].0 < w[1].0));
        for (i, (k, c)) in entries.iter().enumerate() {
            let at = self.entry_at(i);
            self.set_word(at, *k);
            self.set_word(at + 8, c.0);
        }
        for i in entries.len()..self.capacity() {
            let at = self.entry_at(i);
            self.set_word(at, 0);
            self.set_word(at + 8, 0);
        }
        let level = u64::from(self.level());
        self.set_word(W_HEADER, level | ((entries.len() as u64) << 8));
    }
    /// The child whose range holds `key` (the node must cover `key`).
    pub fn inner_child(&self, key: u64) -> Option<GAddr> {
        let n = self.count();
        if n == 0 {
            return None;
        }
        // Last entry with separator <= key.
        let mut lo = 0;
        let mut hi = n;
        while lo < hi {
            let mid = (lo + hi) / 2;
            if self.inner_entry(mid).0 <= key {
                lo = mid + 1;
            } else {
                hi = mid;
            }
        }
        (lo > 0).then(|| self.inner_entry(lo - 1).1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn packed_words_round_trip() {
        let g = GAddr::new(3, (1 << 48) - 8);
        assert_eq!((g.mn(), g.offset()), (3, (1 << 48) - 8));
        let p = FatPtr::new(MAX_MEMNODES - 1, ((1 << 32) - 1) * 8, MAX_VALUE_LEN, 255);
        assert_eq!(p.mn(), MAX_MEMNODES - 1);
        assert_eq!(p.offset(), ((1 << 32) - 1) * 8);
        assert_eq!((p.len(), p.tag()), (MAX_VALUE_LEN, 255));
        assert_eq!(p.0 >> 61, 0);
    }

    #[test]
    fn blocks_check_key_tag_length_and_bytes() {
        let b = encode_block(7, 3, b"hello");
        let p = FatPtr::new(0, 64, 5, 3);
        assert_eq!(decode_block(&b, 7, p).as_deref(), Some(&b"hello"[..]));
        assert_eq!(decode_block(&b, 8, p), None, "another key");
        assert_eq!(
            decode_block(&b, 7, FatPtr::new(0, 64, 5, 4)),
            None,
            "reused"
        );
        assert_eq!(
            decode_block(&b, 7, FatPtr::new(0, 64, 4, 3)),
            None,
            "length"
        );
        let mut c = b.clone();
        c[25] ^= 1;
        assert_eq!(decode_block(&c, 7, p), None, "torn bytes");
        assert_eq!(decode_block(&b[..20], 7, p), None, "short");
    }

    fn leaf_with(entries: &[(u64, ValueRef)]) -> NodeImage {
        let mut n = NodeImage::new(256, 0, 0, EMPTY_KEY, GAddr::NULL);
        for (i, (k, v)) in entries.iter().enumerate() {
            n.set_leaf_entry(i, *k, *v);
        }
        n.seal();
        n
    }

    #[test]
    fn inner_nodes_route_keys() {
        let mut n = NodeImage::new(256, 1, 10, 100, GAddr::NULL);
        n.set_inner_entries(&[(10, GAddr(1)), (20, GAddr(2)), (50, GAddr(3))]);
        n.seal();
        let n = NodeImage::validated(n.bytes().to_vec(), 256).unwrap();
        assert_eq!(n.inner_child(10), Some(GAddr(1)));
        assert_eq!(n.inner_child(19), Some(GAddr(1)));
        assert_eq!(n.inner_child(20), Some(GAddr(2)));
        assert_eq!(n.inner_child(99), Some(GAddr(3)));
        assert_eq!(n.inner_child(5), None);
    }

    proptest! {
        /// Invariant 1 (docs/sherman.md): an image that mixes words of two
        /// different committed versions of a node never validates, whatever
        /// order the reader observed the words in. We tear at every word
        /// boundary set the strategy picks: each word comes from the old or
        /// the new image independently.
        #[test]
        fn torn_images_never_validate(
            old in prop::collection::vec((0u64..1000, any::<u64>(), any::<bool>()), 1..12),
            change in 0usize..14,
            new_key in 0u64..1000,
            mask in prop::collection::vec(any::<bool>(), 32),
        ) {
            let entries: Vec<(u64, ValueRef)> = old
                .iter()
                .map(|(k, v, ool)| (*k, if *ool { ValueRef::OutOfLine(FatPtr(*v >> 3)) } else { ValueRef::Inline(*v) }))
                .collect();
            let a = leaf_with(&entries);
            let mut changed = entries.clone();
            let i = change % changed.len();
            changed[i].0 = new_key;
            let b = leaf_with(&changed);
            prop_assume!(a != b);
            let words = a.bytes().len() / 8;
            let mut torn = vec![0u8; a.bytes().len()];
            for w in 0..words {
                let src = if mask[w % mask.len()] ^ (w >= mask.len()) { &a } else { &b };
                torn[w * 8..w * 8 + 8].copy_from_slice(&src.bytes()[w * 8..w * 8 + 8]);
            }
            let mixed_a = torn == a.bytes();
            let mixed_b = torn == b.bytes();
            let v = NodeImage::validated(torn, 256);
            if mixed_a || mixed_b {
                prop_assert!(v.is_some());
            } else {
                prop_assert!(v.is_none(), "a torn image validated");
            }
        }
    }

    /// Every single-boundary tear (a prefix of words from one version and
    /// the rest from the other, in both directions) and every single-word
    /// substitution is refused.
    #[test]
    fn every_tear_at_every_word_boundary_is_refused() {
        let a = leaf_with(&[(1, ValueRef::Inline(11)), (2, ValueRef::Inline(22))]);
        let b = leaf_with(&[
            (1, ValueRef::Inline(11)),
            (2, ValueRef::Inline(23)),
            (3, ValueRef::OutOfLine(FatPtr::new(0, 64, 3, 1))),
        ]);
        let words = a.bytes().len() / 8;
        for (x, y) in [(&a, &b), (&b, &a)] {
            for cut in 0..=words {
                let mut t = x.bytes()[..cut * 8].to_vec();
                t.extend_from_slice(&y.bytes()[cut * 8..]);
                let ok = NodeImage::validated(t.clone(), 256).is_some();
                assert_eq!(ok, t == x.bytes() || t == y.bytes(), "cut at word {cut}");
            }
            for w in 0..words {
                let mut t = x.bytes().to_vec();
                t[w * 8..w * 8 + 8].copy_from_slice(&y.bytes()[w * 8..w * 8 + 8]);
                let ok = NodeImage::validated(t.clone(), 256).is_some();
                assert_eq!(ok, t == x.bytes(), "word {w} substituted");
            }
        }
    }
}
