/// A 64-bit checksum for self-validating remote blocks. It mixes every
/// 8-byte word with its position, so swapped, stale or torn words change it
/// with overwhelming probability; it is not cryptographic.
pub fn checksum64(data: &[u8]) -> u64 {
    const K: u64 = 0x9E37_79B9_7F4A_7C15;
    let mut h = 0x2545_F491_4F6C_DD1D ^ (data.len() as u64).wrapping_mul(K);
    let mut chunks = data.chunks_exact(8);
    for (i, c) in chunks.by_ref().enumerate() {
        let w = u64::from_le_bytes(c.try_into().expect("8 bytes"));
        h = mix(h ^ mix(w.wrapping_add((i as u64).wrapping_mul(K))));
    }
    let rest = chunks.remainder();
    if !rest.is_empty() {
        let mut b = [0u8; 8];
        b[..rest.len()].copy_from_slice(rest);
        h = mix(h ^ mix(u64::from_le_bytes(b) ^ 0xFF00_0000_0000_0000));
    }
    h
}

fn mix(mut x: u64) -> u64 {
    // splitmix64's finaliser.
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
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
