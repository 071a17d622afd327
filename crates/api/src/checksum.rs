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

#[cfg(test)]
mod tests {
    use super::checksum64;

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
