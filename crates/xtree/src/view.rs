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
    BLOCK_HEADER_BYTES, ChildPtr, FatPtr, Geometry, Header, INLINE_VALUE_LEN, MAX_LEVEL, Meta,
    Span, WORDS_PER_LINE,
};
use crate::protocol::{Inconsistent, check_span, word_at};
use dmkv_api::checksum64_concat;
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

/// The header and meta of a node image, with every check of them that does
/// not need the keys: the count is within N, the level within
/// [`MAX_LEVEL`], out-of-line bits only below the count, and an inner node
/// has children and no out-of-line bits. Shared by the parsing views and
/// the in-place lookups so that both refuse exactly the same images.
fn check_head(geo: &Geometry, bytes: &[u8]) -> Result<(Header, Meta), ViewError> {
    check_head_words(
        geo,
        word_at(bytes, geo.payload_offset(Geometry::HDR)),
        word_at(bytes, geo.payload_offset(Geometry::META)),
    )
}

/// [`check_head`] on the header and meta words themselves (the hinted
/// update reads them in place, under the leaf's lock).
pub(crate) fn check_head_words(
    geo: &Geometry,
    hdr: u64,
    meta: u64,
) -> Result<(Header, Meta), ViewError> {
    let header = Header::unpack(hdr);
    let meta = Meta::unpack(meta).ok_or_else(|| malformed("reserved bits set in meta"))?;
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
    Ok((header, meta))
}

/// Checks that `bytes` is a whole image of `span` (which must start at line
/// 0 and cover the key lines) with consistent versions; returns the version.
/// The checks of [`KeysView::parse`] before it looks at the payload.
fn check_keys_span(geo: &Geometry, span: Span, bytes: &[u8]) -> Result<u64, ViewError> {
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
    Ok(check_span(geo, span, bytes)?)
}

/// Byte offsets of `n` consecutive logical payload words from `first`, as
/// [`Geometry::payload_offset`] places them, found by stepping over each
/// line's version word instead of dividing per word.
fn payload_offsets(geo: &Geometry, first: usize, n: usize) -> impl Iterator<Item = usize> {
    let mut w = geo.payload_word(first);
    (0..n).map(move |_| {
        let at = 8 * w;
        w += 1;
        if w.is_multiple_of(WORDS_PER_LINE) {
            w += 1; // the next line's version word
        }
        at
    })
}

/// In an inner node's image: whether its `count` keys ascend strictly (the
/// check [`KeysView::parse`] makes on its collected keys) and the index of
/// the first key above `key` (`count` if none is): where the linear scan of
/// `child_for` and the memory node's walk stops, the child before it
/// covering `key` (when the keys ascend). Every key is read, for the check.
fn inner_keys_route(geo: &Geometry, bytes: &[u8], count: usize, key: u64) -> (bool, usize) {
    let mut prev = None;
    let mut above = None;
    for (j, at) in payload_offsets(geo, geo.key(0), count).enumerate() {
        let k = word_at(bytes, at);
        if prev.is_some_and(|p| p >= k) {
            return (false, above.unwrap_or(j));
        }
        prev = Some(k);
        if above.is_none() && key < k {
            above = Some(j);
        }
    }
    (true, above.unwrap_or(count))
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
        let version = check_keys_span(geo, span, bytes)?;
        Self::parse_payload(geo, version, bytes)
    }

    /// What [`KeysView::parse`] followed by [`KeysView::find`] gives, found
    /// in the image itself without collecting its keys: the image is checked
    /// exactly as `parse` checks it (same errors in the same order), then
    /// the keys are searched linearly where they lie.
    pub fn find_in_image(
        geo: &Geometry,
        span: Span,
        bytes: &[u8],
        key: u64,
    ) -> Result<LeafFind, ViewError> {
        let version = check_keys_span(geo, span, bytes)?;
        let (header, meta) = check_head(geo, bytes)?;
        let count = header.count as usize;
        if meta.level > 0 && !inner_keys_route(geo, bytes, count, key).0 {
            return Err(malformed("inner keys are not strictly ascending"));
        }
        let slot = payload_offsets(geo, geo.key(0), count).position(|at| word_at(bytes, at) == key);
        Ok(LeafFind {
            version,
            header,
            meta,
            slot,
        })
    }

    /// Parses the payload without checking versions (the caller holds the
    /// node's lock or has checked them).
    pub(crate) fn parse_payload(
        geo: &Geometry,
        version: u64,
        bytes: &[u8],
    ) -> Result<KeysView, ViewError> {
        let (header, meta) = check_head(geo, bytes)?;
        let count = header.count as usize;
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

    /// What [`NodeView::parse`] followed by [`NodeView::child_for`] gives
    /// (`child_for` only in an inner node), found in the image itself
    /// without collecting keys or slots: the image is checked exactly as
    /// `parse` checks it (same errors in the same order), then the keys are
    /// searched in place. For readers that walk past a node without keeping
    /// its image.
    pub fn child_in_image(
        geo: &Geometry,
        bytes: &[u8],
        key: u64,
    ) -> Result<ChildLookup, ViewError> {
        check_keys_span(geo, geo.node_span(), bytes)?;
        let (header, meta) = check_head(geo, bytes)?;
        let count = header.count as usize;
        if meta.level == 0 {
            return Ok(ChildLookup {
                header,
                level: 0,
                child: None,
            });
        }
        let (ascend, below) = inner_keys_route(geo, bytes, count, key);
        if !ascend {
            return Err(malformed("inner keys are not strictly ascending"));
        }
        // Keys ascend, so `below`, the first key above `key`, follows the
        // keys at most `key`: the child is the one before it, as
        // `child_for`'s scan finds it. Every child pointer is checked, as
        // `parse` does.
        let mut child = None;
        for (j, at) in payload_offsets(geo, geo.slot(0), count).enumerate() {
            let Some(c) = ChildPtr::unpack(word_at(bytes, at)) else {
                return Err(malformed("an inner node with an invalid child pointer"));
            };
            if j + 1 == below {
                child = Some((j, c));
            }
        }
        Ok(ChildLookup {
            header,
            level: meta.level,
            child,
        })
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
    /// Found by the XStore artifact's linear scan (`NaiveTree`: the first
    /// key above `key`, the child before it), as the memory node's walk
    /// finds it.
    pub fn child_for(&self, key: u64) -> Option<(usize, ChildPtr)> {
        debug_assert!(!self.keys.is_leaf());
        let keys = &self.keys.keys;
        let j = keys
            .iter()
            .position(|&k| key < k)
            .unwrap_or(keys.len())
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

/// What [`NodeImage`] checked of a whole-node image: the version its
/// version words carried (0 for a locked read) and its header and meta.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct NodeHead {
    pub version: u64,
    pub header: Header,
    pub meta: Meta,
}

/// A whole-node image checked exactly as [`NodeView::parse`] (or
/// [`NodeView::parse_locked`]) checks it, same errors in the same order,
/// but kept as the bytes themselves: keys, slots and values are read where
/// they lie, nothing is collected (no allocation). The memory node's lean
/// read and write paths (`XTree::get`, `leaf_apply`, `update_hinted`) look
/// up and change leaves through it; `view::tests::
/// node_images_equal_parsed_views` compares it with the parsing view on
/// generated, torn, locked and damaged images.
#[derive(Debug, Clone, Copy)]
pub struct NodeImage<'a> {
    geo: Geometry,
    bytes: &'a [u8],
    head: NodeHead,
}

impl<'a> NodeImage<'a> {
    /// Checks a whole-node image (a read of [`Geometry::node_span`]) as
    /// [`NodeView::parse`] does.
    pub fn parse(geo: &Geometry, bytes: &'a [u8]) -> Result<NodeImage<'a>, ViewError> {
        let head = check_node_image(geo, bytes, true)?;
        Ok(NodeImage::from_checked(geo, bytes, head))
    }

    /// Checks a node image without its versions, as
    /// [`NodeView::parse_locked`] does (the caller holds the node's lock,
    /// or serialises all writers).
    pub fn parse_locked(geo: &Geometry, bytes: &'a [u8]) -> Result<NodeImage<'a>, ViewError> {
        let head = check_node_image(geo, bytes, false)?;
        Ok(NodeImage::from_checked(geo, bytes, head))
    }

    /// An image `check_node_image` accepted with `head` (a retry loop checks
    /// its buffer before it borrows it for the image).
    pub(crate) fn from_checked(geo: &Geometry, bytes: &'a [u8], head: NodeHead) -> NodeImage<'a> {
        NodeImage {
            geo: *geo,
            bytes,
            head,
        }
    }

    pub fn head(&self) -> NodeHead {
        self.head
    }

    pub fn version(&self) -> u64 {
        self.head.version
    }

    pub fn header(&self) -> Header {
        self.head.header
    }

    pub fn meta(&self) -> Meta {
        self.head.meta
    }

    pub fn level(&self) -> u8 {
        self.head.meta.level
    }

    /// CNT: the keys (and slots) in use.
    pub fn count(&self) -> usize {
        self.head.header.count as usize
    }

    /// `K_j`, `j` below the count.
    pub fn key(&self, j: usize) -> u64 {
        assert!(j < self.count(), "key {j} of {}", self.count());
        word_at(self.bytes, self.geo.payload_offset(self.geo.key(j)))
    }

    /// `S_j` as stored, `j` below the count.
    pub fn slot(&self, j: usize) -> u64 {
        assert!(j < self.count(), "slot {j} of {}", self.count());
        word_at(self.bytes, self.geo.payload_offset(self.geo.slot(j)))
    }

    /// The keys in slot order.
    pub fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        payload_offsets(&self.geo, self.geo.key(0), self.count()).map(|at| word_at(self.bytes, at))
    }

    /// The slot holding `key` ([`KeysView::find`]: a linear search, in
    /// place, over the key words).
    pub fn find(&self, key: u64) -> Option<usize> {
        self.keys().position(|k| k == key)
    }

    /// The value stored in leaf slot `j` ([`NodeView::value`]).
    pub fn value(&self, j: usize) -> SlotValue {
        SlotValue::decode(&self.head.meta, j, self.slot(j))
    }

    /// Child pointer `j` of an inner node (validated when checked).
    pub fn child(&self, j: usize) -> ChildPtr {
        ChildPtr::unpack(self.slot(j)).expect("validated when checked")
    }

    /// The same node collected into a [`NodeView`] (for the rare paths that
    /// keep a node's pairs, and for the tests comparing the two).
    pub fn to_view(&self) -> NodeView {
        NodeView {
            keys: KeysView {
                version: self.head.version,
                header: self.head.header,
                meta: self.head.meta,
                keys: self.keys().collect(),
            },
            slots: (0..self.count()).map(|j| self.slot(j)).collect(),
        }
    }
}

/// The checks of [`NodeView::parse`] (`versions`) or
/// [`NodeView::parse_locked`] on a whole-node image, in the same order and
/// through the same helpers, without collecting anything: versions (and
/// length), head, inner keys ascending, inner child pointers valid.
pub(crate) fn check_node_image(
    geo: &Geometry,
    bytes: &[u8],
    versions: bool,
) -> Result<NodeHead, ViewError> {
    let version = if versions {
        check_keys_span(geo, geo.node_span(), bytes)?
    } else {
        0
    };
    let (header, meta) = check_head(geo, bytes)?;
    if meta.level > 0 {
        let count = header.count as usize;
        if !inner_keys_route(geo, bytes, count, 0).0 {
            return Err(malformed("inner keys are not strictly ascending"));
        }
        if payload_offsets(geo, geo.slot(0), count)
            .any(|at| ChildPtr::unpack(word_at(bytes, at)).is_none())
        {
            return Err(malformed("an inner node with an invalid child pointer"));
        }
    }
    Ok(NodeHead {
        version,
        header,
        meta,
    })
}

/// A key looked up in a leaf's key read ([`KeysView::find_in_image`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeafFind {
    /// The version every version word of the read carried.
    pub version: u64,
    pub header: Header,
    pub meta: Meta,
    /// The slot holding the key, if the image has it.
    pub slot: Option<usize>,
}

/// An inner node's routing of one key, found in a whole-node image
/// ([`NodeView::child_in_image`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChildLookup {
    pub header: Header,
    pub level: u8,
    /// In an inner node, [`NodeView::child_for`] of the key; `None` in a
    /// leaf or when the key is below the node's lower bound.
    pub child: Option<(usize, ChildPtr)>,
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
    let mut head = [0u8; 16];
    head[..8].copy_from_slice(&key.to_le_bytes());
    head[8..].copy_from_slice(&(value.len() as u64).to_le_bytes());
    checksum64_concat(&head, value)
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
    block_value(key, fat, bytes).map(<[u8]>::to_vec)
}

/// [`parse_block`]'s checks, returning the value where it lies in `bytes`.
pub fn block_value(key: u64, fat: FatPtr, bytes: &[u8]) -> Result<&[u8], BlockError> {
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
    Ok(value)
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

    /// The child pointer `inner_10_20_30` stores for node `n`.
    fn inner_child(n: u32) -> ChildPtr {
        ChildPtr {
            node: n,
            incarnation: n + 100,
        }
    }

    /// An inner node (N = 4) routing by separators 10, 20 and 30 to
    /// children 1, 2 and 3.
    fn inner_10_20_30(g: &Geometry) -> Plain {
        let c = inner_child;
        node(
            g,
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
        )
    }

    #[test]
    fn inner_nodes_route_keys() {
        let g = Geometry::new(4).unwrap();
        let c = inner_child;
        let n = inner_10_20_30(&g);
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

    /// What the in-place lookups must equal: parse, then search the
    /// collected keys.
    fn parsed_child(g: &Geometry, b: &[u8], key: u64) -> Result<ChildLookup, ViewError> {
        NodeView::parse(g, b).map(|v| ChildLookup {
            header: v.header(),
            level: v.level(),
            child: if v.level() > 0 {
                v.child_for(key)
            } else {
                None
            },
        })
    }

    fn parsed_find(g: &Geometry, span: Span, b: &[u8], key: u64) -> Result<LeafFind, ViewError> {
        KeysView::parse(g, span, b).map(|k| LeafFind {
            version: k.version,
            header: k.header,
            meta: k.meta,
            slot: k.find(key),
        })
    }

    /// A node written through the protocol from generated parts: `level`
    /// 0 is a leaf with the keys as given, else an inner node with the keys
    /// sorted and deduplicated and real child pointers.
    fn generated(g: &Geometry, level: u8, keys: &[u64], oob: u64) -> Plain {
        let mut keys = keys.to_vec();
        keys.truncate(g.slots());
        if level > 0 {
            keys.sort_unstable();
            keys.dedup();
        }
        let slots: Vec<u64> = (0..keys.len() as u32)
            .map(|j| {
                ChildPtr {
                    node: j + 1,
                    incarnation: j * 7,
                }
                .pack()
            })
            .collect();
        let meta = Meta {
            level,
            out_of_line: if level == 0 {
                oob & ((1u64 << keys.len()) - 1)
            } else {
                0
            },
        };
        let hdr = Header {
            incarnation: 5,
            count: keys.len() as u8,
            next: 0,
        };
        node(g, hdr, meta, &keys, &slots)
    }

    #[test]
    fn payload_offsets_step_like_payload_offset() {
        for n in [4, 5, 16, 31, 48] {
            let g = Geometry::new(n).unwrap();
            for first in 0..g.payload_words() {
                let stepped: Vec<usize> =
                    payload_offsets(&g, first, g.payload_words() - first).collect();
                let direct: Vec<usize> = (first..g.payload_words())
                    .map(|i| g.payload_offset(i))
                    .collect();
                assert_eq!(stepped, direct, "N = {n}, from {first}");
            }
        }
    }

    #[test]
    fn in_place_lookups_route_like_parsed_images() {
        let g = Geometry::new(4).unwrap();
        let c = inner_child;
        let n = inner_10_20_30(&g);
        let b = n.bytes();
        let at = |k| NodeView::child_in_image(&g, &b, k).unwrap().child;
        assert_eq!(at(9), None, "below the lower bound");
        assert_eq!(at(10), Some((0, c(1))));
        assert_eq!(at(29), Some((1, c(2))));
        assert_eq!(at(u64::MAX), Some((2, c(3))));
        let g16 = Geometry::new(16).unwrap();
        let l = leaf(&g16).bytes();
        let ks = g16.key_span();
        let f = KeysView::find_in_image(&g16, ks, &l[..ks.len(&g16)], 20).unwrap();
        assert_eq!((f.version, f.slot), (1, Some(2)));
        assert_eq!(f.meta.out_of_line, 0b010);
        assert_eq!(
            KeysView::find_in_image(&g16, ks, &l[..ks.len(&g16)], 25)
                .unwrap()
                .slot,
            None
        );
    }

    proptest! {
        // The in-place lookups accept and refuse exactly the images the
        // parsing views do, with the same errors, and route every key the
        // same way: valid leaves and inner nodes, and the same with one
        // word overwritten (torn or locked versions, bad heads, unsorted
        // keys, null children, anything).
        #[test]
        fn in_place_lookups_equal_parse_then_search(
            n in 4usize..=16,
            level in prop_oneof![Just(0u8), Just(1u8), 2u8..40],
            keys in prop::collection::vec(0u64..64, 0..20),
            oob in any::<u64>(),
            probe in 0u64..70,
            poke in prop::option::of((0usize..400, prop_oneof![
                any::<u64>(), 0u64..64, Just(LOCK_BIT | 1), Just(2u64), Just(0u64)])),
        ) {
            let g = Geometry::new(n).unwrap();
            let p = generated(&g, level.min(MAX_LEVEL), &keys, oob);
            if let Some((w, v)) = poke {
                let w = w % g.node_words();
                p.0.borrow_mut()[w] = v;
            }
            let b = p.bytes();
            prop_assert_eq!(NodeView::child_in_image(&g, &b, probe), parsed_child(&g, &b, probe));
            for span in [g.key_span(), g.node_span()] {
                let img = &b[..span.len(&g)];
                prop_assert_eq!(
                    KeysView::find_in_image(&g, span, img, probe),
                    parsed_find(&g, span, img, probe)
                );
            }
            // Wrong lengths and spans are refused alike.
            prop_assert_eq!(
                NodeView::child_in_image(&g, &b[..b.len() - 8], probe),
                parsed_child(&g, &b[..b.len() - 8], probe)
            );
            let s = g.slot_span(0);
            prop_assert_eq!(
                KeysView::find_in_image(&g, s, &b[..s.len(&g)], probe),
                parsed_find(&g, s, &b[..s.len(&g)], probe)
            );
        }

        // The lean whole-node image (`NodeImage`, the memory node's read
        // and write paths) accepts and refuses exactly the images the
        // parsing view does, with the same errors, versions checked or not;
        // what it reads in place (head, every key and slot, the probe's
        // slot and value) is what the parsed view holds: valid leaves and
        // inner nodes, and the same with one word overwritten (torn or
        // locked versions, bad heads, unsorted keys, null children,
        // anything), and cut short.
        #[test]
        fn node_images_equal_parsed_views(
            n in 4usize..=48,
            level in prop_oneof![Just(0u8), Just(1u8), 2u8..40],
            keys in prop::collection::vec(0u64..64, 0..50),
            oob in any::<u64>(),
            probe in 0u64..70,
            pokes in prop::collection::vec((0usize..1000, prop_oneof![
                any::<u64>(), 0u64..64, Just(LOCK_BIT | 1), Just(2u64), Just(0u64)]), 0..3),
        ) {
            let g = Geometry::new(n).unwrap();
            let p = generated(&g, level.min(MAX_LEVEL), &keys, oob);
            for (w, v) in pokes {
                let w = w % g.node_words();
                p.0.borrow_mut()[w] = v;
            }
            let b = p.bytes();
            let lean = |i: NodeImage<'_>| {
                let j = i.find(probe);
                let leaf_value = (i.level() == 0).then(|| j.map(|j| i.value(j))).flatten();
                (i.head(), i.to_view(), j, leaf_value)
            };
            let parsed = |v: NodeView| {
                let j = v.keys.find(probe);
                let leaf_value = (v.level() == 0).then(|| j.map(|j| v.value(j))).flatten();
                let head = NodeHead { version: v.keys.version, header: v.header(), meta: v.keys.meta };
                (head, v, j, leaf_value)
            };
            prop_assert_eq!(
                NodeImage::parse(&g, &b).map(lean),
                NodeView::parse(&g, &b).map(parsed)
            );
            prop_assert_eq!(
                NodeImage::parse_locked(&g, &b).map(lean),
                NodeView::parse_locked(&g, &b).map(parsed)
            );
            if let Ok(i) = NodeImage::parse(&g, &b) && i.level() > 0 {
                let v = NodeView::parse(&g, &b).unwrap();
                for j in 0..i.count() {
                    prop_assert_eq!(i.child(j), v.child(j));
                }
            }
            // Wrong lengths are refused alike.
            for cut in [8, 64] {
                prop_assert_eq!(
                    NodeImage::parse(&g, &b[..b.len() - cut]).map(lean),
                    NodeView::parse(&g, &b[..b.len() - cut]).map(parsed)
                );
            }
        }

        // A block's value in place is what `parse_block` copies, and both
        // refuse the same damaged blocks with the same errors.
        #[test]
        fn block_values_in_place_equal_parsed_blocks(
            key in 0u64..4,
            value in prop::collection::vec(any::<u8>(), 0..40),
            want_key in 0u64..4,
            len_delta in 0u32..3,
            flip in prop::option::of(0usize..80),
        ) {
            let mut b = encode_block(key, &value);
            if let Some(at) = flip {
                let at = at % b.len();
                b[at] ^= 0x10;
            }
            let fat = FatPtr { offset: 0, len: value.len() as u32 + len_delta };
            let want = fat.block_len().min(b.len());
            let bytes = &b[..want];
            prop_assert_eq!(
                block_value(want_key, fat, bytes).map(<[u8]>::to_vec),
                parse_block(want_key, fat, bytes)
            );
        }

        // Any bytes at all: parsing returns, never panics.
        #[test]
        fn random_bytes_never_panic(words in prop::collection::vec(any::<u64>(), 40), n in 4usize..=16) {
            let g = Geometry::new(n).unwrap();
            let b: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
            if b.len() >= g.node_bytes() {
                let _ = NodeView::parse(&g, &b[..g.node_bytes()]);
                let _ = NodeView::parse_locked(&g, &b[..g.node_bytes()]);
                let _ = NodeImage::parse(&g, &b[..g.node_bytes()]).map(|i| i.find(words[1]));
                let _ = NodeImage::parse_locked(&g, &b[..g.node_bytes()]).map(|i| i.find(words[1]));
                let ks = g.key_span();
                let _ = KeysView::parse(&g, ks, &b[..ks.len(&g)]);
                let _ = NodeView::child_in_image(&g, &b[..g.node_bytes()], words[1]);
                let _ = KeysView::find_in_image(&g, ks, &b[..ks.len(&g)], words[1]);
                let _ = parse_block(1, FatPtr::unpack(words[0]), &b[..24.min(b.len())]);
            }
        }
    }
}
