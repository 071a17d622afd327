//! Byte and bit layouts of XTree's remote memory (docs/xtree.md, *Nodes*).
//!
//! Everything a one-sided reader parses is defined here: node geometry (where
//! each version word and payload word of a node lives), the packed 64-bit
//! words (header, meta, child pointer, fat pointer, root word, superblock
//! word) and the value block. Packing functions are `const fn` so that the
//! bit layouts are pinned by `const` assertions at the bottom of this file.

use thiserror::Error;

/// Bytes in one cache line, the unit of the version protocol.
pub const LINE_BYTES: usize = 64;
/// Words in one line: one version word and seven payload words.
pub const WORDS_PER_LINE: usize = 8;
/// Payload words per line.
pub const PAYLOAD_WORDS_PER_LINE: usize = 7;
/// Payload words before the keys: `hdr` and `meta`.
pub const HEAD_WORDS: usize = 2;

/// Fewest slots a node may have: a split must leave at least two pairs (or
/// children) on each side, so inner nodes always have a fanout of two.
pub const MIN_SLOTS: usize = 4;
/// Most slots a node may have: the out-of-line bitmap in `meta` has 48 bits.
pub const MAX_SLOTS: usize = 48;
/// The paper's setting.
pub const DEFAULT_SLOTS: usize = 16;

/// Bit 63 of a version word: a writer holds the line (or, in `V_0`, the node).
pub const LOCK_BIT: u64 = 1 << 63;
/// Bits 0..62 of a version word: the version.
pub const VERSION_MASK: u64 = LOCK_BIT - 1;

/// Incarnations are 24-bit and wrap (see docs/xtree.md, invariant 2).
pub const INCARNATION_BITS: u32 = 24;
pub const INCARNATION_MASK: u32 = (1 << INCARNATION_BITS) - 1;
/// Node numbers are 32-bit; 0 is the superblock, never a node.
pub const NO_NODE: u32 = 0;

/// Levels are 8-bit; a tree deeper than this is refused as garbage by views.
pub const MAX_LEVEL: u8 = 32;

/// Value block header: `key u64 | len u64 | checksum u64`.
pub const BLOCK_HEADER_BYTES: usize = 24;
/// Longest value XTree stores (out of line). Fat pointers could describe
/// 16 MiB; the limit keeps one value inside one RPC reply and one size class
/// of the value region's allocator (24 + 16 KiB rounds up to 32 KiB).
pub const MAX_VALUE_LEN: usize = 16 * 1024;
/// Length of a value stored inline in its slot.
pub const INLINE_VALUE_LEN: usize = 8;

/// Fat pointer fields: bits 0..39 offset, bits 40..63 length.
pub const FAT_OFFSET_BITS: u32 = 40;
pub const FAT_OFFSET_MASK: u64 = (1 << FAT_OFFSET_BITS) - 1;
pub const FAT_LEN_MASK: u64 = (1 << 24) - 1;

/// Superblock word 1: bits 0..7 slots, bits 8..63 this magic.
pub const SUPERBLOCK_MAGIC: u64 = 0x00_5854_5245_4531; // "XTREE1"
/// Byte offsets of the superblock words in node slot 0.
pub const SUPERBLOCK_ROOT_OFFSET: u64 = 0;
pub const SUPERBLOCK_FORMAT_OFFSET: u64 = 8;

/// A node geometry that cannot be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Error)]
#[error("{slots} slots per node: must be between {MIN_SLOTS} and {MAX_SLOTS}")]
pub struct BadSlots {
    pub slots: usize,
}

/// Where everything lives in a node of `slots` slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Geometry {
    slots: usize,
    lines: usize,
}

impl Geometry {
    pub fn new(slots: usize) -> Result<Geometry, BadSlots> {
        if !(MIN_SLOTS..=MAX_SLOTS).contains(&slots) {
            return Err(BadSlots { slots });
        }
        Ok(Geometry {
            slots,
            lines: lines_for(slots),
        })
    }

    /// N: keys (and values, or children) a node holds.
    pub fn slots(&self) -> usize {
        self.slots
    }

    /// LINES: cache lines per node.
    pub fn lines(&self) -> usize {
        self.lines
    }

    pub fn node_bytes(&self) -> usize {
        self.lines * LINE_BYTES
    }

    /// Words per node (versions included).
    pub fn node_words(&self) -> usize {
        self.lines * WORDS_PER_LINE
    }

    /// Logical payload words: hdr, meta, N keys, N slots.
    pub fn payload_words(&self) -> usize {
        HEAD_WORDS + 2 * self.slots
    }

    /// Word index (within the node) of logical payload word `i`.
    pub fn payload_word(&self, i: usize) -> usize {
        debug_assert!(i < self.payload_words());
        // = (i / 7) * 8 + 1 + i % 7: one division where that takes two
        // (the tree walk computes it per key compared).
        i + i / PAYLOAD_WORDS_PER_LINE + 1
    }

    /// Byte offset (within the node) of logical payload word `i`.
    pub fn payload_offset(&self, i: usize) -> usize {
        8 * self.payload_word(i)
    }

    /// The line holding logical payload word `i`.
    pub fn line_of(&self, i: usize) -> usize {
        i / PAYLOAD_WORDS_PER_LINE
    }

    /// Word index of line `l`'s version `V_l`.
    pub fn version_word(&self, line: usize) -> usize {
        line * WORDS_PER_LINE
    }

    /// Word index of the trailing version `T` (last word of the last line).
    pub fn trailer_word(&self) -> usize {
        self.node_words() - 1
    }

    /// Logical index of the header word.
    pub const HDR: usize = 0;
    /// Logical index of the meta word.
    pub const META: usize = 1;

    /// Logical index of key `j`.
    pub fn key(&self, j: usize) -> usize {
        HEAD_WORDS + j
    }

    /// Logical index of slot (value or child pointer) `j`.
    pub fn slot(&self, j: usize) -> usize {
        HEAD_WORDS + self.slots + j
    }

    /// Lines `0..k` hold the header, meta and every key.
    pub fn key_lines(&self) -> usize {
        self.line_of(self.key(self.slots - 1)) + 1
    }

    /// The span a lookup reads: the key lines plus the next version word.
    pub fn key_span(&self) -> Span {
        Span {
            first_line: 0,
            lines: self.key_lines(),
        }
    }

    /// The span an inline-value read of slot `j` covers: its line plus the
    /// next version word.
    pub fn slot_span(&self, j: usize) -> Span {
        Span {
            first_line: self.line_of(self.slot(j)),
            lines: 1,
        }
    }

    /// The whole node.
    pub fn node_span(&self) -> Span {
        Span {
            first_line: 0,
            lines: self.lines,
        }
    }
}

/// `ceil((2 + 2N + 1) / 7)`: payload plus the trailing version.
const fn lines_for(slots: usize) -> usize {
    (HEAD_WORDS + 2 * slots + 1).div_ceil(PAYLOAD_WORDS_PER_LINE)
}

/// A run of whole lines of a node as one read covers it: lines
/// `first_line..first_line + lines`, plus the following line's version word
/// when the run does not reach the end of the node (when it does, the
/// trailing version `T` is already inside the last line).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Span {
    pub first_line: usize,
    pub lines: usize,
}

impl Span {
    /// Byte offset of the span within its node.
    pub fn offset(&self) -> usize {
        self.first_line * LINE_BYTES
    }

    /// Whether the span ends at the node's end (so `T` closes it).
    pub fn reaches_end(&self, geo: &Geometry) -> bool {
        self.first_line + self.lines >= geo.lines()
    }

    /// Bytes a read of this span covers.
    pub fn len(&self, geo: &Geometry) -> usize {
        self.lines * LINE_BYTES + if self.reaches_end(geo) { 0 } else { 8 }
    }

    pub fn is_empty(&self) -> bool {
        self.lines == 0
    }
}

/// The paper's 64-bit leaf header (used by inner nodes too): bits 0..23
/// incarnation, bits 24..31 count, bits 32..63 right link.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Header {
    pub incarnation: u32,
    pub count: u8,
    /// Right sibling's node number, [`NO_NODE`] for the rightmost node.
    pub next: u32,
}

impl Header {
    pub const fn pack(self) -> u64 {
        (self.incarnation & INCARNATION_MASK) as u64
            | (self.count as u64) << 24
            | (self.next as u64) << 32
    }
    pub const fn unpack(w: u64) -> Header {
        Header {
            incarnation: (w as u32) & INCARNATION_MASK,
            count: (w >> 24) as u8,
            next: (w >> 32) as u32,
        }
    }
}

/// The next incarnation (24-bit, wrapping).
pub const fn next_incarnation(inca: u32) -> u32 {
    inca.wrapping_add(1) & INCARNATION_MASK
}

/// `meta`: bits 0..7 level (0 = leaf); in a leaf, bits 8..55 the bitmap of
/// slots whose value is out of line. Bits 56..63 are zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Meta {
    pub level: u8,
    /// Bit `j`: slot `j` holds a fat pointer.
    pub out_of_line: u64,
}

impl Meta {
    pub const BITMAP_SHIFT: u32 = 8;
    pub const BITMAP_MASK: u64 = (1 << MAX_SLOTS) - 1;
    pub const RESERVED_MASK: u64 = !((1u64 << (8 + MAX_SLOTS)) - 1);

    pub const fn pack(self) -> u64 {
        self.level as u64 | (self.out_of_line & Self::BITMAP_MASK) << Self::BITMAP_SHIFT
    }
    /// `None` if reserved bits are set.
    pub const fn unpack(w: u64) -> Option<Meta> {
        if w & Self::RESERVED_MASK != 0 {
            return None;
        }
        Some(Meta {
            level: w as u8,
            out_of_line: (w >> Self::BITMAP_SHIFT) & Self::BITMAP_MASK,
        })
    }
    pub const fn is_out_of_line(&self, slot: usize) -> bool {
        self.out_of_line >> slot & 1 == 1
    }
}

/// An inner node's slot: bits 0..31 child node number, bits 32..55 the
/// child's incarnation when the pointer was written; bits 56..63 zero.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChildPtr {
    pub node: u32,
    pub incarnation: u32,
}

impl ChildPtr {
    pub const RESERVED_MASK: u64 = 0xFF << 56;
    pub const fn pack(self) -> u64 {
        self.node as u64 | ((self.incarnation & INCARNATION_MASK) as u64) << 32
    }
    /// `None` if reserved bits are set or the node number is 0.
    pub const fn unpack(w: u64) -> Option<ChildPtr> {
        if w & Self::RESERVED_MASK != 0 || w as u32 == NO_NODE {
            return None;
        }
        Some(ChildPtr {
            node: w as u32,
            incarnation: (w >> 32) as u32 & INCARNATION_MASK,
        })
    }
}

/// A leaf slot holding an out-of-line value: bits 0..39 the block's byte
/// offset in the value region, bits 40..63 the value's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FatPtr {
    pub offset: u64,
    pub len: u32,
}

impl FatPtr {
    pub const fn pack(self) -> u64 {
        (self.offset & FAT_OFFSET_MASK) | ((self.len as u64) & FAT_LEN_MASK) << FAT_OFFSET_BITS
    }
    pub const fn unpack(w: u64) -> FatPtr {
        FatPtr {
            offset: w & FAT_OFFSET_MASK,
            len: (w >> FAT_OFFSET_BITS) as u32,
        }
    }
    /// Bytes of the block (header and value, without padding).
    pub const fn block_len(&self) -> usize {
        BLOCK_HEADER_BYTES + self.len as usize
    }
}

/// The superblock's root word: root node number | height << 32, written
/// with one 8-byte store. Height counts levels: a lone leaf root has 1.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RootWord {
    pub node: u32,
    pub height: u32,
}

impl RootWord {
    pub const fn pack(self) -> u64 {
        self.node as u64 | (self.height as u64) << 32
    }
    /// `None` for a word no tree writes (node 0, height 0 or too tall).
    pub const fn unpack(w: u64) -> Option<RootWord> {
        let r = RootWord {
            node: w as u32,
            height: (w >> 32) as u32,
        };
        if r.node == NO_NODE || r.height == 0 || r.height > MAX_LEVEL as u32 + 1 {
            return None;
        }
        Some(r)
    }
    /// Level of the root node.
    pub const fn root_level(&self) -> u8 {
        (self.height - 1) as u8
    }
}

/// Superblock word 1: the format, so that a client learns N and can tell a
/// tree from garbage.
pub const fn format_word(slots: usize) -> u64 {
    SUPERBLOCK_MAGIC << 8 | slots as u64
}

/// The slots a format word announces, if it is one.
pub fn parse_format_word(w: u64) -> Option<Geometry> {
    if w >> 8 != SUPERBLOCK_MAGIC {
        return None;
    }
    Geometry::new((w & 0xFF) as usize).ok()
}

/// Bytes a value block of `len` value bytes occupies (padded to 8).
pub const fn block_bytes(len: usize) -> usize {
    BLOCK_HEADER_BYTES + len.div_ceil(8) * 8
}

// Pinned layouts: a change to any packing breaks the build.
const _: () = {
    assert!(lines_for(16) == 5, "N = 16 is exactly five lines");
    assert!(lines_for(16) * LINE_BYTES == 320);
    assert!(lines_for(4) == 2);
    assert!(lines_for(MAX_SLOTS) == 15);
    assert!(
        Header {
            incarnation: 0xAB_CDEF,
            count: 0x12,
            next: 0x3456_789A
        }
        .pack()
            == 0x3456_789A_12AB_CDEF
    );
    assert!(
        Header {
            incarnation: INCARNATION_MASK + 1,
            count: 0,
            next: 0
        }
        .pack()
            == 0,
        "incarnations wrap at 24 bits"
    );
    assert!(Header::unpack(0x3456_789A_12AB_CDEF).count == 0x12);
    assert!(
        Meta {
            level: 3,
            out_of_line: 0b101
        }
        .pack()
            == 0x503
    );
    assert!(Meta::RESERVED_MASK == 0xFF00_0000_0000_0000);
    assert!(
        ChildPtr {
            node: 7,
            incarnation: 0xFF_FFFF
        }
        .pack()
            == 0x00FF_FFFF_0000_0007
    );
    assert!(
        FatPtr {
            offset: 0xFF_FFFF_FFFF,
            len: 0xAB_CDEF
        }
        .pack()
            == 0xABCD_EFFF_FFFF_FFFF
    );
    assert!(RootWord { node: 9, height: 2 }.pack() == 0x2_0000_0009);
    assert!(MAX_VALUE_LEN as u64 <= FAT_LEN_MASK);
    assert!(block_bytes(0) == 24 && block_bytes(1) == 32 && block_bytes(8) == 32);
    assert!(LOCK_BIT == 0x8000_0000_0000_0000);
    assert!(
        WORDS_PER_LINE == PAYLOAD_WORDS_PER_LINE + 1,
        "payload_word's one-division form"
    );
};

#[cfg(test)]
mod tests {
    use super::*;

    /// `payload_word`'s one-division form places every payload word of
    /// every geometry where the line formula (line `i / 7`, after its
    /// version word) does.
    #[test]
    fn payload_words_follow_the_line_formula() {
        for n in MIN_SLOTS..=MAX_SLOTS {
            let g = Geometry::new(n).unwrap();
            for i in 0..g.payload_words() {
                let line_formula =
                    (i / PAYLOAD_WORDS_PER_LINE) * WORDS_PER_LINE + 1 + i % PAYLOAD_WORDS_PER_LINE;
                assert_eq!(g.payload_word(i), line_formula, "N = {n}, word {i}");
                assert_eq!(g.line_of(i), g.payload_word(i) / WORDS_PER_LINE);
            }
        }
    }

    #[test]
    fn the_documented_n16_layout() {
        let g = Geometry::new(16).unwrap();
        assert_eq!(g.node_bytes(), 320);
        // line 0: V_0 | hdr | meta | K_0..K_4
        assert_eq!(g.payload_offset(Geometry::HDR), 8);
        assert_eq!(g.payload_offset(Geometry::META), 16);
        assert_eq!(g.payload_offset(g.key(0)), 24);
        assert_eq!(g.payload_offset(g.key(4)), 56);
        // line 1: V_1 | K_5..K_11
        assert_eq!(g.payload_offset(g.key(5)), 72);
        // line 2: V_2 | K_12..K_15 | S_0..S_2
        assert_eq!(g.payload_offset(g.key(15)), 128 + 8 + 24);
        assert_eq!(g.payload_offset(g.slot(0)), 128 + 40);
        // line 4: V_4 | S_10..S_15 | T
        assert_eq!(g.payload_offset(g.slot(10)), 256 + 8);
        assert_eq!(g.payload_offset(g.slot(15)), 304);
        assert_eq!(8 * g.trailer_word(), 312);
        // a lookup reads lines 0..2 and V_3: 200 bytes
        assert_eq!(g.key_span().len(&g), 200);
        // an inline value: its line plus the next version (72), or the last
        // line alone (T inside)
        assert_eq!(g.slot_span(0).len(&g), 72);
        assert_eq!(g.slot_span(15).len(&g), 64);
        assert_eq!(g.node_span().len(&g), 320);
    }

    #[test]
    fn payload_never_collides_with_versions_or_trailer() {
        for n in MIN_SLOTS..=MAX_SLOTS {
            let g = Geometry::new(n).unwrap();
            let mut seen = std::collections::HashSet::new();
            for i in 0..g.payload_words() {
                let w = g.payload_word(i);
                assert!(
                    !w.is_multiple_of(WORDS_PER_LINE),
                    "N={n}: payload on a version word"
                );
                assert!(w < g.trailer_word(), "N={n}: payload on or past T");
                assert!(seen.insert(w));
            }
        }
        assert!(Geometry::new(3).is_err() && Geometry::new(49).is_err());
    }

    #[test]
    fn packed_words_round_trip_and_reject_garbage() {
        let h = Header {
            incarnation: 77,
            count: 16,
            next: 123,
        };
        assert_eq!(Header::unpack(h.pack()), h);
        let m = Meta {
            level: 0,
            out_of_line: 1 << 47,
        };
        assert_eq!(Meta::unpack(m.pack()), Some(m));
        assert_eq!(Meta::unpack(1 << 60), None);
        let c = ChildPtr {
            node: 5,
            incarnation: 9,
        };
        assert_eq!(ChildPtr::unpack(c.pack()), Some(c));
        assert_eq!(ChildPtr::unpack(0), None, "node 0 is the superblock");
        assert_eq!(ChildPtr::unpack(5 | 1 << 60), None);
        let f = FatPtr {
            offset: 4096,
            len: 300,
        };
        assert_eq!(FatPtr::unpack(f.pack()), f);
        assert_eq!(RootWord::unpack(0), None);
        assert_eq!(
            parse_format_word(format_word(16)).map(|g| g.slots()),
            Some(16)
        );
        assert_eq!(parse_format_word(16), None);
        assert_eq!(next_incarnation(INCARNATION_MASK), 0);
    }
}
