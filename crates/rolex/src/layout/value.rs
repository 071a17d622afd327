//! Values that are not exactly 8 bytes live out of line, in the value region
//! of the leaf's memory node, as immutable blocks; the leaf slot holds a fat
//! pointer to the block.
//!
//! Fat pointer (one word):
//! ```text
//!  63..40      39..7                    6..0
//!  length     offset in 8-byte units   value region (memory node index)
//! ```
//! Block: `key u64 | len u64 | checksum u64 | bytes, zero-padded to 8`.
//! The checksum ([`checksum64`](dmkv_api::checksum64)) covers key, len and the bytes. A block is
//! written before the leaf that points to it (same node, posting order) and
//! never changed or reused afterwards, so a reader that found the pointer in
//! a validated leaf reads the value that belonged to the key at that time;
//! the checksum is a second line of defence against memory scribbled by a
//! faulty client. An empty value needs no block (length 0, offset 0).

use dmkv_api::{Key, checksum64_concat};

pub const REGION_BITS: u32 = 7;
pub const OFFSET_SHIFT: u32 = 7;
pub const OFFSET_BITS: u32 = 33;
pub const LEN_SHIFT: u32 = 40;
pub const LEN_BITS: u32 = 24;

const _: () = {
    assert!(REGION_BITS + OFFSET_BITS + LEN_BITS == 64);
    assert!(OFFSET_SHIFT == REGION_BITS && LEN_SHIFT == OFFSET_SHIFT + OFFSET_BITS);
};

/// The largest value ROLEX stores (a documented limit well inside the
/// 24-bit length field).
pub const MAX_VALUE_LEN: usize = 64 * 1024;
/// Bytes of a block's header.
pub const BLOCK_HEADER: usize = 24;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FatPtr {
    pub region: u8,
    /// Byte offset in the value region (a multiple of 8).
    pub offset: u64,
    pub len: u32,
}

impl FatPtr {
    pub fn encode(self) -> u64 {
        debug_assert!(self.offset.is_multiple_of(8));
        (self.region as u64 & ((1 << REGION_BITS) - 1))
            | ((self.offset / 8) & ((1 << OFFSET_BITS) - 1)) << OFFSET_SHIFT
            | (self.len as u64 & ((1 << LEN_BITS) - 1)) << LEN_SHIFT
    }

    pub fn decode(w: u64) -> FatPtr {
        FatPtr {
            region: (w & ((1 << REGION_BITS) - 1)) as u8,
            offset: ((w >> OFFSET_SHIFT) & ((1 << OFFSET_BITS) - 1)) * 8,
            len: ((w >> LEN_SHIFT) & ((1 << LEN_BITS) - 1)) as u32,
        }
    }

    /// Largest byte offset a pointer can hold.
    pub const MAX_OFFSET: u64 = ((1 << OFFSET_BITS) - 1) * 8;
}

/// Size of the block holding a value of `len` bytes.
pub fn block_bytes(len: usize) -> usize {
    BLOCK_HEADER + len.div_ceil(8) * 8
}

pub fn encode_block(key: Key, value: &[u8]) -> Vec<u8> {
    let mut b = Vec::with_capacity(block_bytes(value.len()));
    b.extend_from_slice(&key.to_le_bytes());
    b.extend_from_slice(&(value.len() as u64).to_le_bytes());
    b.extend_from_slice(&block_checksum(key, value).to_le_bytes());
    b.extend_from_slice(value);
    b.resize(block_bytes(value.len()), 0);
    b
}

fn block_checksum(key: Key, value: &[u8]) -> u64 {
    let mut head = [0u8; 16];
    head[..8].copy_from_slice(&key.to_le_bytes());
    head[8..].copy_from_slice(&(value.len() as u64).to_le_bytes());
    checksum64_concat(&head, value)
}

/// Checks a block read for `key` through `ptr` and returns its value.
pub fn decode_block(key: Key, ptr: FatPtr, block: &[u8]) -> Result<Vec<u8>, String> {
    let len = ptr.len as usize;
    if block.len() != block_bytes(len) {
        return Err(format!(
            "block of {} bytes for a {len}-byte value",
            block.len()
        ));
    }
    let word = |i: usize| u64::from_le_bytes(block[i * 8..i * 8 + 8].try_into().expect("8"));
    if word(0) != key || word(1) != len as u64 {
        return Err(format!(
            "block at {:#x} belongs to key {:#x} len {}, not key {key:#x} len {len}",
            ptr.offset,
            word(0),
            word(1)
        ));
    }
    let value = &block[BLOCK_HEADER..BLOCK_HEADER + len];
    if word(2) != block_checksum(key, value) {
        return Err(format!("block at {:#x} fails its checksum", ptr.offset));
    }
    Ok(value.to_vec())
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        #[test]
        fn pointers_round_trip(region in 0u8..128, off in 0u64..(1 << 33), len in 0u32..(1 << 24)) {
            let p = FatPtr { region, offset: off * 8, len };
            prop_assert_eq!(FatPtr::decode(p.encode()), p);
        }

        #[test]
        fn blocks_round_trip_and_catch_damage(key: u64, v in prop::collection::vec(any::<u8>(), 0..100), flip in 0usize..1000) {
            let p = FatPtr { region: 0, offset: 64, len: v.len() as u32 };
            let mut b = encode_block(key, &v);
            prop_assert_eq!(decode_block(key, p, &b), Ok(v.clone()));
            prop_assert!(decode_block(key ^ 1, p, &b).is_err());
            let bit = flip % (8 * (BLOCK_HEADER + v.len()));
            b[bit / 8] ^= 1 << (bit % 8);
            prop_assert!(decode_block(key, p, &b).is_err());
        }
    }
}
