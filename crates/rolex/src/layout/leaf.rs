//! Leaves: fixed-size arrays of δ sorted pairs with a key range, read and
//! written whole by compute nodes and validated by front/back versions.
//!
//! ```text
//! word 0            front version  (written LAST by a writer)
//! word 1            low fence      (inclusive; never changes after the leaf is created)
//! word 2            high fence     (exclusive; u64::MAX = top of the key space)
//! word 3            meta: bits 0..7 count, bit 8 dead, bits 16..63 out-of-line bitmap of slots 0..47
//! words 4..4+E      more bitmap words for slots 48.. (E = ceil((δ-48)/64) when δ > 48)
//! next δ words      keys, the first `count` sorted ascending, all in [low, high)
//! next δ words      values: the 8 bytes themselves, or a fat pointer if the slot's bitmap bit is set
//! last word         back version   (written FIRST by a writer)
//! ```
//!
//! A writer (holding the leaf's group lock) posts, in one doorbell batch to
//! the leaf's node: the back word with the new version `v+1`, then words
//! 1..last-1, then the front word `v+1`. A reader reads the whole leaf in one
//! read (words observed in increasing address order) and accepts it iff
//! front == back != 0. Why a reader can never accept a torn leaf: the front
//! word it saw (`v`) is the last store of writer `W_v`, so every store of
//! `W_v` (and of every earlier writer, writers being serialised by the lock)
//! happened before the reader's first load; the back word it saw is still
//! `v`, and the back word is the first store of writer `W_{v+1}`, so no
//! store of a later writer happened before the reader's last load. Between
//! its first and last load nothing was stored: the image is exactly `W_v`'s.

use dmkv_api::Key;

/// Slots (δ) a leaf may have.
pub const MIN_SLOTS: usize = 2;
pub const MAX_SLOTS: usize = 128;

const W_FRONT: usize = 0;
const W_LOW: usize = 1;
const W_HIGH: usize = 2;
const W_META: usize = 3;
const META_COUNT_MASK: u64 = 0xFF;
const META_DEAD: u64 = 1 << 8;
const META_BITMAP_SHIFT: u32 = 16;
const META_BITMAP_SLOTS: usize = 48;

const _: () = {
    assert!(MAX_SLOTS as u64 <= META_COUNT_MASK);
    assert!(META_BITMAP_SHIFT as usize + META_BITMAP_SLOTS == 64);
    assert!(META_DEAD < (1 << META_BITMAP_SHIFT) && META_DEAD > META_COUNT_MASK);
};

/// The word positions of a leaf with δ slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeafLayout {
    slots: usize,
}

impl LeafLayout {
    pub fn new(slots: usize) -> LeafLayout {
        assert!(
            (MIN_SLOTS..=MAX_SLOTS).contains(&slots),
            "leaf slots in [{MIN_SLOTS}, {MAX_SLOTS}]"
        );
        LeafLayout { slots }
    }

    pub fn slots(&self) -> usize {
        self.slots
    }

    fn ext_words(&self) -> usize {
        self.slots.saturating_sub(META_BITMAP_SLOTS).div_ceil(64)
    }

    fn key_word(&self, i: usize) -> usize {
        4 + self.ext_words() + i
    }

    fn val_word(&self, i: usize) -> usize {
        4 + self.ext_words() + self.slots + i
    }

    fn back_word(&self) -> usize {
        4 + self.ext_words() + 2 * self.slots
    }

    pub fn words(&self) -> usize {
        self.back_word() + 1
    }

    /// Size of a leaf in bytes.
    pub fn bytes(&self) -> usize {
        self.words() * 8
    }

    /// Byte offset of the low fence inside a leaf (immutable once written,
    /// so a single 8-byte read of it needs no validation).
    pub fn low_offset(&self) -> u64 {
        (W_LOW * 8) as u64
    }

    /// Byte offset of the back version word.
    pub fn back_offset(&self) -> u64 {
        (self.back_word() * 8) as u64
    }

    fn bitmap_set(&self, w: &mut [u64], i: usize) {
        if i < META_BITMAP_SLOTS {
            w[W_META] |= 1 << (META_BITMAP_SHIFT as usize + i);
        } else {
            let j = i - META_BITMAP_SLOTS;
            w[4 + j / 64] |= 1 << (j % 64);
        }
    }
}

/// One pair in a leaf: the value word is the value itself (8-byte values)
/// or a fat pointer (`out_of_line`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Slot {
    pub key: Key,
    pub word: u64,
    pub out_of_line: bool,
}

/// A decoded, validated leaf.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Leaf {
    pub version: u64,
    pub low: Key,
    /// Exclusive; `u64::MAX` is the top of the key space (the key `u64::MAX`
    /// itself is reserved).
    pub high: Key,
    /// Unlinked from its chain (its range now belongs to its predecessor).
    pub dead: bool,
    pub pairs: Vec<Slot>,
}

/// Why a leaf image was refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LeafError {
    /// Front and back versions differ (or the leaf was never written): read
    /// again.
    Torn,
    /// Consistent versions but impossible contents.
    Corrupt(String),
}

impl Leaf {
    /// A fresh leaf covering `[low, high)`.
    pub fn empty(low: Key, high: Key) -> Leaf {
        Leaf {
            version: 0,
            low,
            high,
            dead: false,
            pairs: Vec::new(),
        }
    }

    pub fn covers(&self, key: Key) -> bool {
        !self.dead && self.low <= key && key < self.high
    }

    /// Position of `key` among the pairs: `Ok(i)` if present, else where it
    /// would go.
    pub fn search(&self, key: Key) -> Result<usize, usize> {
        self.pairs.binary_search_by_key(&key, |s| s.key)
    }

    pub fn get(&self, key: Key) -> Option<Slot> {
        self.search(key).ok().map(|i| self.pairs[i])
    }

    /// Encodes the leaf with `version` into its words.
    pub fn encode(&self, layout: &LeafLayout, version: u64) -> Vec<u64> {
        assert!(self.pairs.len() <= layout.slots, "leaf overflow");
        let mut w = vec![0u64; layout.words()];
        w[W_FRONT] = version;
        w[W_LOW] = self.low;
        w[W_HIGH] = self.high;
        w[W_META] = self.pairs.len() as u64 | if self.dead { META_DEAD } else { 0 };
        for (i, s) in self.pairs.iter().enumerate() {
            w[layout.key_word(i)] = s.key;
            w[layout.val_word(i)] = s.word;
            if s.out_of_line {
                layout.bitmap_set(&mut w, i);
            }
        }
        w[layout.back_word()] = version;
        w
    }

    /// Parses and validates a leaf image of `layout.bytes()` bytes.
    pub fn decode(layout: &LeafLayout, bytes: &[u8]) -> Result<Leaf, LeafError> {
        let v = LeafView::parse(layout, bytes)?;
        Ok(Leaf {
            version: v.version,
            low: v.low,
            high: v.high,
            dead: v.dead,
            pairs: (0..v.count).map(|i| v.slot(i)).collect(),
        })
    }
}

/// A validated leaf image read in place: what [`Leaf::decode`] checks and
/// answers, without copying the pairs out (a GET looks at one key of one
/// leaf; decoding every pair of every leaf it reads cost more than the rest
/// of its work).
#[derive(Debug, Clone, Copy)]
pub struct LeafView<'b> {
    layout: LeafLayout,
    bytes: &'b [u8],
    pub version: u64,
    pub low: Key,
    pub high: Key,
    pub dead: bool,
    count: usize,
}

impl<'b> LeafView<'b> {
    /// Validates a leaf image of `layout.bytes()` bytes exactly as
    /// [`Leaf::decode`] does (same checks, same order, same errors).
    pub fn parse(layout: &LeafLayout, bytes: &'b [u8]) -> Result<LeafView<'b>, LeafError> {
        if bytes.len() != layout.bytes() {
            return Err(LeafError::Corrupt(format!(
                "leaf image of {} bytes, want {}",
                bytes.len(),
                layout.bytes()
            )));
        }
        let w = |i: usize| word_at(bytes, i);
        let version = w(W_FRONT);
        if version == 0 || version != w(layout.back_word()) {
            return Err(LeafError::Torn);
        }
        let (low, high) = (w(W_LOW), w(W_HIGH));
        let meta = w(W_META);
        let count = (meta & META_COUNT_MASK) as usize;
        if count > layout.slots {
            return Err(LeafError::Corrupt(format!(
                "count {count} exceeds {} slots",
                layout.slots
            )));
        }
        if low > high {
            return Err(LeafError::Corrupt(format!(
                "fences out of order: [{low:#x}, {high:#x})"
            )));
        }
        let mut prev: Option<Key> = None;
        for i in 0..count {
            let key = w(layout.key_word(i));
            if key < low || key >= high {
                return Err(LeafError::Corrupt(format!(
                    "key {key:#x} outside the fences [{low:#x}, {high:#x})"
                )));
            }
            if prev.is_some_and(|p| p >= key) {
                return Err(LeafError::Corrupt("keys not strictly ascending".into()));
            }
            prev = Some(key);
        }
        Ok(LeafView {
            layout: *layout,
            bytes,
            version,
            low,
            high,
            dead: meta & META_DEAD != 0,
            count,
        })
    }

    /// Number of pairs.
    pub fn len(&self) -> usize {
        self.count
    }

    pub fn is_empty(&self) -> bool {
        self.count == 0
    }

    /// As [`Leaf::covers`].
    pub fn covers(&self, key: Key) -> bool {
        !self.dead && self.low <= key && key < self.high
    }

    fn key(&self, i: usize) -> Key {
        word_at(self.bytes, self.layout.key_word(i))
    }

    /// Pair `i` (< `len()`).
    pub fn slot(&self, i: usize) -> Slot {
        let bitmap = |j: usize| {
            if j < META_BITMAP_SLOTS {
                word_at(self.bytes, W_META) >> (META_BITMAP_SHIFT as usize + j) & 1 == 1
            } else {
                let k = j - META_BITMAP_SLOTS;
                word_at(self.bytes, 4 + k / 64) >> (k % 64) & 1 == 1
            }
        };
        Slot {
            key: self.key(i),
            word: word_at(self.bytes, self.layout.val_word(i)),
            out_of_line: bitmap(i),
        }
    }

    /// As [`Leaf::get`]: a binary search over the key words in place (the
    /// keys are strictly ascending, checked by `parse`).
    pub fn get(&self, key: Key) -> Option<Slot> {
        let (mut lo, mut hi) = (0, self.count);
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match self.key(mid).cmp(&key) {
                std::cmp::Ordering::Less => lo = mid + 1,
                std::cmp::Ordering::Greater => hi = mid,
                std::cmp::Ordering::Equal => return Some(self.slot(mid)),
            }
        }
        None
    }
}

/// Word `i` of a leaf image (little-endian).
fn word_at(bytes: &[u8], i: usize) -> u64 {
    u64::from_le_bytes(bytes[i * 8..i * 8 + 8].try_into().expect("8 bytes"))
}

/// The three writes that store `words` (an encoded leaf) at leaf byte
/// offset `base` so that readers can validate it: back version, body, front
/// version, in that order. Returns (offset, bytes) pairs.
pub fn write_order(words: &[u64], base: u64) -> [(u64, Vec<u8>); 3] {
    let last = words.len() - 1;
    let bytes = |ws: &[u64]| ws.iter().flat_map(|w| w.to_le_bytes()).collect::<Vec<u8>>();
    [
        (base + (last * 8) as u64, bytes(&words[last..])),
        (base + 8, bytes(&words[1..last])),
        (base, bytes(&words[..1])),
    ]
}

/// Words of `bytes` (little-endian).
pub fn words_of(bytes: &[u8]) -> Vec<u64> {
    bytes
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn bytes(w: &[u64]) -> Vec<u8> {
        w.iter().flat_map(|x| x.to_le_bytes()).collect()
    }

    #[test]
    fn sixteen_slots_is_296_bytes() {
        assert_eq!(LeafLayout::new(16).bytes(), 296);
        assert_eq!(LeafLayout::new(48).bytes(), 8 * (5 + 96));
        assert_eq!(LeafLayout::new(49).bytes(), 8 * (6 + 98));
        assert_eq!(LeafLayout::new(128).bytes(), 8 * (7 + 256));
    }

    proptest! {
        #[test]
        fn round_trips(slots in 2usize..=128, n in 0usize..128, seed: u64, dead: bool, version in 1u64..) {
            let l = LeafLayout::new(slots);
            let n = n.min(slots);
            let mut keys: Vec<u64> = (0..n as u64).map(|i| 100 + i * 3 + (seed % 3)).collect();
            keys.dedup();
            let leaf = Leaf {
                version,
                low: 50,
                high: 10_000,
                dead,
                pairs: keys.iter().enumerate().map(|(i, k)| Slot {
                    key: *k,
                    word: seed.wrapping_mul(i as u64 + 1),
                    out_of_line: (seed >> (i % 64)) & 1 == 1,
                }).collect(),
            };
            let img = bytes(&leaf.encode(&l, version));
            prop_assert_eq!(Leaf::decode(&l, &img), Ok(leaf.clone()));
            // The in-place view answers every key as the decoded leaf does.
            let v = LeafView::parse(&l, &img).unwrap();
            prop_assert_eq!(v.len(), leaf.pairs.len());
            for probe in (0..20_000u64).step_by(7).chain(keys.iter().copied()) {
                prop_assert_eq!(v.get(probe), leaf.get(probe));
                prop_assert_eq!(v.covers(probe), leaf.covers(probe));
            }
        }

        // Any mix of two versions' words where the front and back come from
        // different writes is refused.
        #[test]
        fn mixed_versions_are_torn(split in 1usize..36, v in 1u64..1000) {
            let l = LeafLayout::new(16);
            let a = Leaf::empty(0, 100).encode(&l, v);
            let mut b = Leaf::empty(0, 100);
            b.pairs.push(Slot { key: 5, word: 1, out_of_line: false });
            let b = b.encode(&l, v + 1);
            let mut mix = a.clone();
            mix[..split].copy_from_slice(&b[..split]);
            prop_assert_eq!(Leaf::decode(&l, &bytes(&mix)), Err(LeafError::Torn));
        }
    }

    #[test]
    fn impossible_contents_are_corrupt() {
        let l = LeafLayout::new(4);
        let mut leaf = Leaf::empty(10, 20);
        leaf.pairs.push(Slot {
            key: 25,
            word: 0,
            out_of_line: false,
        });
        let img = bytes(&leaf.encode(&l, 3));
        assert!(matches!(Leaf::decode(&l, &img), Err(LeafError::Corrupt(_))));
        assert!(matches!(
            LeafView::parse(&l, &img),
            Err(LeafError::Corrupt(_))
        ));
        let mut w = Leaf::empty(10, 20).encode(&l, 3);
        w[3] = 200;
        assert!(matches!(
            Leaf::decode(&l, &bytes(&w)),
            Err(LeafError::Corrupt(_))
        ));
        assert_eq!(
            Leaf::decode(&l, &vec![0; l.bytes()]),
            Err(LeafError::Torn),
            "an unwritten leaf"
        );
        assert_eq!(
            LeafView::parse(&l, &vec![0; l.bytes()]).map(|v| v.version),
            Err(LeafError::Torn)
        );
    }

    #[test]
    fn write_order_is_back_body_front() {
        let w: Vec<u64> = (1..=5).collect();
        let [back, body, front] = write_order(&w, 1000);
        assert_eq!(back, (1032, 5u64.to_le_bytes().to_vec()));
        assert_eq!(body.0, 1008);
        assert_eq!(body.1.len(), 24);
        assert_eq!(front, (1000, 1u64.to_le_bytes().to_vec()));
    }
}
