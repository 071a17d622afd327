//! Bounds-checked views of node images and value blocks, for one-sided
//! readers (clients) and the memory node's own optimistic readers alike.
//!
//! A view parses bytes that came over the network and trusts none of them:
//! lengths are checked, version words are validated by the protocol
//! ([`check_span`]), packed words are unpacked with their reserved bits
//! checked, counts are bounded by N, and inner nodes must have sorted keys
//! and real child pointers. Each failure is reported distinctly: a torn or
//! locked image is retried, an incarnation mismatch means a stale pointer,
//! and a malformed image means the bytes are not an XTree node at all.

use crate::layout::{
    BLOCK_HEADER_BYTES, ChildPtr, FatPtr, Geometry, Header, INLINE_VALUE_LEN, MAX_LEVEL, Meta, Span,
};
use crate::protocol::{Inconsistent, check_span, word_at};
use dmkv_api::checksum64;
use thiserror::Error;

/// Why an image was not accepted.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum ViewError {
    #[error("image of {got} bytes where {want} were expected")]
    Length { want: usize, got: usize },
    #[error("a writer held the node while it was read")]
    Locked,
    #[error("torn read: the node's version words differ")]
    Torn,
    #[error("incarnation {found} where the pointer expected {expected}")]
    IncarnationMismatch { expected: u32, found: u32 },
    #[error("not an XTree node: {0}")]
    Malformed(String),
}

impl ViewError {
    /// Torn and locked images are retried as they are; the others are not.
    pub fn is_transient(&self) -> bool {
        matches!(self, ViewError::Locked | ViewError::Torn)
    }
}

impl From<Inconsistent> for ViewError {
    fn from(e: Inconsistent) -> ViewError {
        match e {
            Inconsistent::Locked => ViewError::Locked,
            Inconsistent::Torn => ViewError::Torn,
        }
    }
}

fn malformed(s: impl Into<String>) -> ViewError {
    ViewError::Malformed(s.into())
}

/// The header, meta and keys of a node, from a read of at least its key
/// lines (a lookup's prefix read or a whole-node read).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeysView {
    /// The version every version word of the read carried.
    pub version: u64,
    pub header: Header,
    pub meta: Meta,
    /// `K_0..K_{count-1}`: unsorted in a leaf, sorted in an inner node.
    pub keys: Vec<u64>,
}

impl KeysView {
    /// Parses a span image starting at line 0 that covers every key line.
    pub fn parse(geo: &Geometry, span: Span, bytes: &[u8]) -> Result<KeysView, ViewError> {
        if span.first_line != 0 || span.lines < geo.key_lines() || span.lines > geo.lines() {
            return Err(malformed(format!(
                "span {span:?} does not cover the key lines"
            )));
        }
        let want = span.len(geo);
        if bytes.len() != want {
            return Err(ViewError::Length {
                want,
                got: bytes.len(),
            });
        }
        let version = check_span(geo, span, bytes)?;
        Self::parse_payload(geo, version, bytes)
    }

    /// Parses the payload without checking versions (the caller holds the
    /// node's lock or has checked them).
    pub(crate) fn parse_payload(
        geo: &Geometry,
        version: u64,
        bytes: &[u8],
    ) -> Result<KeysView, ViewError> {
        let header = Header::unpack(word_at(bytes, geo.payload_offset(Geometry::HDR)));
        let meta = Meta::unpack(word_at(bytes, geo.payload_offset(Geometry::META)))
            .ok_or_else(|| malformed("reserved bits set in meta"))?;
        let count = header.count as usize;
        if count > geo.slots() {
            return Err(malformed(format!(
                "count {count} exceeds {} slots",
                geo.slots()
            )));
        }
        if meta.level > MAX_LEVEL {
            return Err(malformed(format!("level {}", meta.level)));
        }
        if meta.out_of_line >> count != 0 {
            return Err(malformed("out-of-line bits beyond the count"));
        }
        if meta.level > 0 {
            if meta.out_of_line != 0 {
                return Err(malformed("an inner node with out-of-line bits"));
            }
            if count == 0 {
                return Err(malformed("an inner node without children"));
            }
        }
        let keys: Vec<u64> = (0..count)
            .map(|j| word_at(bytes, geo.payload_offset(geo.key(j))))
            .collect();
        if meta.level > 0 && keys.windows(2).any(|w| w[0] >= w[1]) {
            return Err(malformed("inner keys are not strictly ascending"));
        }
        Ok(KeysView {
            version,
            header,
            meta,
            keys,
        })
    }

    pub fn is_leaf(&self) -> bool {
        self.meta.level == 0
    }

    pub fn incarnation(&self) -> u32 {
        self.header.incarnation
    }

    /// Fails unless the node has the incarnation a pointer expected.
    pub fn expect_incarnation(&self, expected: u32) -> Result<(), ViewError> {
        if self.header.incarnation != expected {
            return Err(ViewError::IncarnationMismatch {
                expected,
                found: self.header.incarnation,
            });
        }
        Ok(())
    }

    /// The slot holding `key` in a leaf (a linear search: leaves are
    /// unsorted).
    pub fn find(&self, key: u64) -> Option<usize> {
        self.keys.iter().position(|&k| k == key)
    }
}

/// A whole node: keys and slots.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NodeView {
    pub keys: KeysView,
    /// `S_0..S_{count-1}`: values or fat pointers in a leaf, child pointers
    /// (packed) in an inner node.
    pub slots: Vec<u64>,
}

impl NodeView {
    /// Parses a whole-node image (a read of [`Geometry::node_span`]).
    pub fn parse(geo: &Geometry, bytes: &[u8]) -> Result<NodeView, ViewError> {
        let keys = KeysView::parse(geo, geo.node_span(), bytes)?;
        Self::with_slots(geo, keys, bytes)
    }

    /// Parses a node image without checking versions (the caller holds the
    /// node's lock, or serialises all writers).
    pub(crate) fn parse_locked(geo: &Geometry, bytes: &[u8]) -> Result<NodeView, ViewError> {
        let keys = KeysView::parse_payload(geo, 0, bytes)?;
        Self::with_slots(geo, keys, bytes)
    }

    fn with_slots(geo: &Geometry, keys: KeysView, bytes: &[u8]) -> Result<NodeView, ViewError> {
        let slots: Vec<u64> = (0..keys.keys.len())
            .map(|j| word_at(bytes, geo.payload_offset(geo.slot(j))))
            .collect();
        if !keys.is_leaf() && slots.iter().any(|&s| ChildPtr::unpack(s).is_none()) {
            return Err(malformed("an inner node with an invalid child pointer"));
        }
        Ok(NodeView { keys, slots })
    }

    pub fn level(&self) -> u8 {
        self.keys.meta.level
    }

    pub fn header(&self) -> Header {
        self.keys.header
    }

    /// In an inner node: the child whose range holds `key` (the last `K_j`
    /// not above it), or `None` if `key` is below the node's lower bound
    /// (which a current image never shows: the reader's copy is stale).
    pub fn child_for(&self, key: u64) -> Option<(usize, ChildPtr)> {
        debug_assert!(!self.keys.is_leaf());
        let j = self
            .keys
            .keys
            .partition_point(|&k| k <= key)
            .checked_sub(1)?;
        Some((j, self.child(j)))
    }

    /// Child pointer `j` of an inner node (validated when parsed).
    pub fn child(&self, j: usize) -> ChildPtr {
        ChildPtr::unpack(self.slots[j]).expect("validated when parsed")
    }

    /// The value stored in leaf slot `j`.
    pub fn value(&self, j: usize) -> SlotValue {
        SlotValue::decode(&self.keys.meta, j, self.slots[j])
    }

    /// The leaf's pairs sorted by key.
    pub fn sorted_pairs(&self) -> Vec<(u64, SlotValue)> {
        let mut v: Vec<(u64, SlotValue)> = (0..self.keys.keys.len())
            .map(|j| (self.keys.keys[j], self.value(j)))
            .collect();
        v.sort_unstable_by_key(|p| p.0);
        v
    }
}

/// What a leaf slot holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SlotValue {
    /// An 8-byte value, stored in the slot.
    Inline([u8; INLINE_VALUE_LEN]),
    /// Any other length, in a value block.
    OutOfLine(FatPtr),
}

impl SlotValue {
    pub fn decode(meta: &Meta, slot: usize, word: u64) -> SlotValue {
        if meta.is_out_of_line(slot) {
            SlotValue::OutOfLine(FatPtr::unpack(word))
        } else {
            SlotValue::Inline(word.to_le_bytes())
        }
    }
}

/// Parses the read of one leaf slot's line ([`Geometry::slot_span`]) and
/// returns the slot word, accepting it only if the line carried `version`,
/// the version of the keys read that found the slot.
pub fn parse_slot_line(
    geo: &Geometry,
    slot: usize,
    version: u64,
    bytes: &[u8],
) -> Result<u64, ViewError> {
    if slot >= geo.slots() {
        return Err(malformed(format!("slot {slot} of {}", geo.slots())));
    }
    let span = geo.slot_span(slot);
    let want = span.len(geo);
    if bytes.len() != want {
        return Err(ViewError::Length {
            want,
            got: bytes.len(),
        });
    }
    let v = check_span(geo, span, bytes)?;
    if v != version {
        // The node changed between the keys read and this one.
        return Err(ViewError::Torn);
    }
    Ok(word_at(
        bytes,
        geo.payload_offset(geo.slot(slot)) - span.offset(),
    ))
}

/// Why a value block read was not accepted. All are transient for a reader
/// that got the fat pointer from a consistent leaf image: the block was
/// freed and reused, or is being written.
#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum BlockError {
    #[error("block of {got} bytes where {want} were expected")]
    Length { want: usize, got: usize },
    #[error("block holds key {found:#x}, not {expected:#x}")]
    WrongKey { expected: u64, found: u64 },
    #[error("block holds {found} bytes, the pointer says {expected}")]
    WrongLen { expected: u32, found: u64 },
    #[error("block checksum mismatch")]
    Checksum,
}

/// The checksum of a block: over key, len and the value bytes.
pub fn block_checksum(key: u64, value: &[u8]) -> u64 {
    let mut buf = Vec::with_capacity(16 + value.len());
    buf.extend_from_slice(&key.to_le_bytes());
    buf.extend_from_slice(&(value.len() as u64).to_le_bytes());
    buf.extend_from_slice(value);
    checksum64(&buf)
}

/// The bytes of a block holding `value` for `key` (padded to 8).
pub fn encode_block(key: u64, value: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(crate::layout::block_bytes(value.len()));
    b.extend_from_slice(&key.to_le_bytes());
    b.extend_from_slice(&(value.len() as u64).to_le_bytes());
    b.extend_from_slice(&block_checksum(key, value).to_le_bytes());
    b.extend_from_slice(value);
    b.resize(crate::layout::block_bytes(value.len()), 0);
    b
}

/// Validates a block read of `fat.block_len()` bytes for `key` and returns
/// the value.
pub fn parse_block(key: u64, fat: FatPtr, bytes: &[u8]) -> Result<Vec<u8>, BlockError> {
    let want = fat.block_len();
    if bytes.len() != want {
        return Err(BlockError::Length {
            want,
            got: bytes.len(),
        });
    }
    let found_key = word_at(bytes, 0);
    if found_key != key {
        return Err(BlockError::WrongKey {
            expected: key,
            found: found_key,
        });
    }
    let len = word_at(bytes, 8);
    if len != fat.len as u64 {
        return Err(BlockError::WrongLen {
            expected: fat.len,
            found: len,
        });
    }
    let value = &bytes[BLOCK_HEADER_BYTES..];
    if word_at(bytes, 16) != block_checksum(key, value) {
        return Err(BlockError::Checksum);
    }
    Ok(value.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::layout::{LOCK_BIT, NO_NODE};
    use crate::protocol::{NodeWords, commit, lock};
    use proptest::prelude::*;
    use std::cell::RefCell;

    struct Plain(RefCell<Vec<u64>>);
    impl NodeWords for Plain {
        fn load(&self, i: usize) -> u64 {
            self.0.borrow()[i]
        }
        fn store(&self, i: usize, v: u64) {
            self.0.borrow_mut()[i] = v;
        }
        fn cas(&self, i: usize, e: u64, n: u64) -> u64 {
            let c = self.0.borrow()[i];
            if c == e {
                self.0.borrow_mut()[i] = n;
            }
            c
        }
    }
    impl Plain {
        fn bytes(&self) -> Vec<u8> {
            self.0
                .borrow()
                .iter()
                .flat_map(|w| w.to_le_bytes())
                .collect()
        }
    }

    /// A node written through the protocol.
    fn node(geo: &Geometry, hdr: Header, meta: Meta, keys: &[u64], slots: &[u64]) -> Plain {
        let p = Plain(RefCell::new(vec![0; geo.node_words()]));
        let x = lock(&p);
        let mut ch = vec![(Geometry::HDR, hdr.pack()), (Geometry::META, meta.pack())];
        ch.extend(keys.iter().enumerate().map(|(j, k)| (geo.key(j), *k)));
        ch.extend(slots.iter().enumerate().map(|(j, s)| (geo.slot(j), *s)));
        commit(&p, geo, x, &ch);
        p
    }

    fn leaf(geo: &Geometry) -> Plain {
        node(
            geo,
            Header {
                incarnation: 3,
                count: 3,
                next: 9,
            },
            Meta {
                level: 0,
                out_of_line: 0b010,
            },
            &[30, 10, 20],
            &[
                u64::from_le_bytes(*b"thirty!!"),
                FatPtr { offset: 64, len: 5 }.pack(),
                7,
            ],
        )
    }

    #[test]
    fn parses_a_leaf_by_prefix_and_whole() {
        let g = Geometry::new(16).unwrap();
        let n = leaf(&g);
        let b = n.bytes();
        let ks = g.key_span();
        let k = KeysView::parse(&g, ks, &b[..ks.len(&g)]).unwrap();
        assert_eq!(k.version, 1);
        assert_eq!(k.keys, vec![30, 10, 20]);
        assert_eq!(k.find(20), Some(2));
        assert_eq!(k.find(25), None);
        assert!(k.expect_incarnation(3).is_ok());
        assert_eq!(
            k.expect_incarnation(4),
            Err(ViewError::IncarnationMismatch {
                expected: 4,
                found: 3
            })
        );
        let whole = NodeView::parse(&g, &b).unwrap();
        assert_eq!(whole.value(0), SlotValue::Inline(*b"thirty!!"));
        assert_eq!(
            whole.value(1),
            SlotValue::OutOfLine(FatPtr { offset: 64, len: 5 })
        );
        let sorted: Vec<u64> = whole.sorted_pairs().iter().map(|p| p.0).collect();
        assert_eq!(sorted, vec![10, 20, 30]);
        // inline value line read
        let s = g.slot_span(0);
        let line = &b[s.offset()..s.offset() + s.len(&g)];
        assert_eq!(
            parse_slot_line(&g, 0, 1, line).unwrap(),
            u64::from_le_bytes(*b"thirty!!")
        );
        assert_eq!(
            parse_slot_line(&g, 0, 2, line),
            Err(ViewError::Torn),
            "a line of another version than the keys read is refused"
        );
        assert!(parse_slot_line(&g, 16, 1, line).is_err());
        assert!(matches!(
            parse_slot_line(&g, 0, 1, &line[..8]),
            Err(ViewError::Length { .. })
        ));
    }

    #[test]
    fn every_torn_and_locked_case_is_reported() {
        let g = Geometry::new(16).unwrap();
        let n = leaf(&g);
        for span in [g.key_span(), g.node_span()] {
            let closing = if span.reaches_end(&g) {
                g.trailer_word()
            } else {
                g.version_word(span.lines)
            };
            let version_words: Vec<usize> = (0..span.lines)
                .map(|l| g.version_word(l))
                .chain([closing])
                .collect();
            for &w in &version_words {
                for (val, want) in [(1 | LOCK_BIT, ViewError::Locked), (2, ViewError::Torn)] {
                    let mut words = n.0.borrow().clone();
                    words[w] = val;
                    let b: Vec<u8> = words.iter().flat_map(|x| x.to_le_bytes()).collect();
                    assert_eq!(
                        KeysView::parse(&g, span, &b[..span.len(&g)]),
                        Err(want.clone()),
                        "span {span:?} word {w}"
                    );
                    assert!(want.is_transient());
                }
            }
        }
    }

    #[test]
    fn garbage_images_are_malformed_not_panics() {
        let g = Geometry::new(16).unwrap();
        let good = leaf(&g);
        let edit = |f: &dyn Fn(&mut Vec<u64>)| {
            let mut w = good.0.borrow().clone();
            f(&mut w);
            w.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>()
        };
        let hdr = g.payload_word(Geometry::HDR);
        let meta = g.payload_word(Geometry::META);
        let cases: Vec<(&str, Vec<u8>)> = vec![
            (
                "count above N",
                edit(&|w| {
                    w[hdr] = Header {
                        incarnation: 0,
                        count: 17,
                        next: 0,
                    }
                    .pack()
                }),
            ),
            ("reserved meta bits", edit(&|w| w[meta] |= 1 << 60)),
            ("bitmap beyond count", edit(&|w| w[meta] |= 1 << (8 + 5))),
            ("level too high", edit(&|w| w[meta] = 200)),
            (
                "inner with oob bits",
                edit(&|w| {
                    w[meta] = Meta {
                        level: 1,
                        out_of_line: 1,
                    }
                    .pack()
                }),
            ),
            (
                "inner with unsorted keys",
                edit(&|w| {
                    w[meta] = Meta {
                        level: 1,
                        out_of_line: 0,
                    }
                    .pack()
                }),
            ),
            (
                "inner with a null child",
                edit(&|w| {
                    w[meta] = Meta {
                        level: 1,
                        out_of_line: 0,
                    }
                    .pack();
                    w[g.payload_word(g.key(0))] = 1;
                    w[g.payload_word(g.key(1))] = 2;
                    w[g.payload_word(g.key(2))] = 3;
                    w[g.payload_word(g.slot(0))] = NO_NODE as u64;
                }),
            ),
            (
                "inner without children",
                edit(&|w| {
                    w[meta] = Meta {
                        level: 1,
                        out_of_line: 0,
                    }
                    .pack();
                    w[hdr] = 0;
                }),
            ),
        ];
        for (what, b) in cases {
            assert!(
                matches!(NodeView::parse(&g, &b), Err(ViewError::Malformed(_))),
                "{what}"
            );
        }
        assert!(matches!(
            NodeView::parse(&g, &good.bytes()[..100]),
            Err(ViewError::Length { .. })
        ));
        assert!(KeysView::parse(&g, g.slot_span(0), &good.bytes()[..72]).is_err());
    }

    #[test]
    fn inner_nodes_route_keys() {
        let g = Geometry::new(4).unwrap();
        let c = |n| ChildPtr {
            node: n,
            incarnation: n + 100,
        };
        let n = node(
            &g,
            Header {
                incarnation: 0,
                count: 3,
                next: 0,
            },
            Meta {
                level: 1,
                out_of_line: 0,
            },
            &[10, 20, 30],
            &[c(1).pack(), c(2).pack(), c(3).pack()],
        );
        let v = NodeView::parse(&g, &n.bytes()).unwrap();
        assert_eq!(v.child_for(9), None, "below the lower bound: stale copy");
        assert_eq!(v.child_for(10), Some((0, c(1))));
        assert_eq!(v.child_for(29), Some((1, c(2))));
        assert_eq!(v.child_for(u64::MAX), Some((2, c(3))));
    }

    #[test]
    fn value_blocks_validate() {
        let b = encode_block(7, b"hello");
        assert_eq!(b.len(), 32);
        let fat = FatPtr { offset: 0, len: 5 };
        assert_eq!(parse_block(7, fat, &b[..29]).unwrap(), b"hello");
        assert!(matches!(
            parse_block(8, fat, &b[..29]),
            Err(BlockError::WrongKey { .. })
        ));
        let fat4 = FatPtr { offset: 0, len: 4 };
        assert!(matches!(
            parse_block(7, fat4, &b[..28]),
            Err(BlockError::WrongLen { .. })
        ));
        let mut t = b.clone();
        t[26] ^= 1;
        assert_eq!(parse_block(7, fat, &t[..29]), Err(BlockError::Checksum));
        assert!(matches!(
            parse_block(7, fat, &b),
            Err(BlockError::Length { .. })
        ));
        let empty = encode_block(1, b"");
        assert_eq!(
            parse_block(1, FatPtr { offset: 0, len: 0 }, &empty).unwrap(),
            b""
        );
    }

    proptest! {
        // Any bytes at all: parsing returns, never panics.
        #[test]
        fn random_bytes_never_panic(words in prop::collection::vec(any::<u64>(), 40), n in 4usize..=16) {
            let g = Geometry::new(n).unwrap();
            let b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            if b.len() >= g.node_bytes() {
                let _ = NodeView::parse(&g, &b[..g.node_bytes()]);
                let _ = NodeView::parse_locked(&g, &b[..g.node_bytes()]);
                let ks = g.key_span();
                let _ = KeysView::parse(&g, ks, &b[..ks.len(&g)]);
                let _ = parse_block(1, FatPtr::unpack(words[0]), &b[..24.min(b.len())]);
            }
        }
    }
}
