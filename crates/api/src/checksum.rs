/// A 64-bit checksum for self-validating remote blocks: XXH3-64 of the
/// bytes (the `xxhash-rust` crate). Every output bit depends on every input
/// bit and on the length, so swapped, stale or torn words change it with
/// overwhelming probability; it is not cryptographic.
///
/// Why XXH3 and not a mix per word: every one-sided GET checks a leaf or a
/// bucket with it, and the earlier checksum (two dependent splitmix64
/// finalisers per 8-byte word) cost ~20 instructions a word, a quarter of
/// a simulated Sherman GET's instructions (docs/simulation.md, "Simulation
/// speed"); XXH3 processes 64-byte stripes in independent lanes.
/// Checksums are only ever compared with checksums this function computed
/// in the same build (memory-node regions and the durability log are not
/// read across versions with different checksums).
pub fn checksum64(data: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(data)
}

/// [`checksum64`] of `head` followed by `tail` (a block's header words and
/// its value), equal to `checksum64` of the two concatenated, without a
/// heap allocation for up to 1 KiB: the bytes are gathered in a buffer on
/// the stack. Every one-sided engine checks each block it reads this way;
/// building the concatenation in a `Vec` cost an allocation and a free per
/// check (~100 instructions per GET, docs/performance.md, "Fourteenth
/// pass").
#[inline]
pub fn checksum64_concat(head: &[u8], tail: &[u8]) -> u64 {
    fn gathered<const N: usize>(head: &[u8], tail: &[u8]) -> u64 {
        let mut buf = [0u8; N];
        let n = head.len() + tail.len();
        buf[..head.len()].copy_from_slice(head);
        buf[head.len()..n].copy_from_slice(tail);
        checksum64(&buf[..n])
    }
    match head.len() + tail.len() {
        0..=64 => gathered::<64>(head, tail),
        65..=1024 => gathered::<1024>(head, tail),
        n => {
            let mut v = Vec::with_capacity(n);
            v.extend_from_slice(head);
            v.extend_from_slice(tail);
            checksum64(&v)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{checksum64, checksum64_concat};

    /// The gathered checksum is the checksum of the concatenation, for
    /// every split and across the stack buffers' sizes.
    #[test]
    fn the_concatenated_checksum_is_the_checksum_of_the_concatenation() {
        let data: Vec<u8> = (0..1100u32).map(|i| (i * 7 + 3) as u8).collect();
        for n in [0, 1, 16, 24, 63, 64, 65, 200, 1023, 1024, 1025, 1100] {
            for head in [0, 1, 8, 16, n / 2, n] {
                let head = head.min(n);
                assert_eq!(
                    checksum64_concat(&data[..head], &data[head..n]),
                    checksum64(&data[..n]),
                    "n {n}, head {head}"
                );
            }
        }
    }

    #[test]
    fn detects_swaps_and_single_bit_changes() {
        let a: Vec<u8> = (0..64).collect();
        let mut b = a.clone();
        b.swap(0, 8);
        b[1..8].copy_from_slice(&a[9..16]);
        b[9..16].copy_from_slice(&a[1..8]);
        assert_ne!(checksum64(&a), checksum64(&b), "swapped words");
        for bit in 0..a.len() * 8 {
            let mut c = a.clone();
            c[bit / 8] ^= 1 << (bit % 8);
            assert_ne!(checksum64(&a), checksum64(&c), "bit {bit}");
        }
        assert_ne!(checksum64(&a[..63]), checksum64(&a), "length");
        assert_ne!(checksum64(&[]), checksum64(&[0]));
    }
}
