//! The hash functions of Outback. Every use has its own salt, so the shard
//! ring, the extendible-hashing directory, the two candidate buckets, the
//! Othello arrays, the slot inside a bucket and the fingerprint are
//! independent functions of the key.
//!
//! All of them are splitmix64's finaliser (a bijection with full avalanche)
//! applied to the key mixed with a salt; ranges are mapped with Lemire's
//! multiply-shift, so table sizes need not be powers of two.

/// splitmix64's finaliser.
#[inline]
pub fn mix64(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

const RING_SALT: u64 = 0x5EED_0001_D15C_0C4A;
const DIR_SALT: u64 = 0x5EED_0002_0D1E_C7A1;
const SLOT_SALT: u64 = 0x5EED_0003_5107_5EED;
const FP_SALT: u64 = 0x5EED_0004_F1A6_E4B1;
const OTHELLO_SALT: u64 = 0x5EED_0005_07E1_1000;

/// `x` (uniform in `[0, 2^32)`) mapped to `[0, n)`.
#[inline]
pub fn reduce(x: u32, n: u32) -> u32 {
    ((x as u64 * n as u64) >> 32) as u32
}

/// The key's position on the consistent-hashing ring.
#[inline]
pub fn ring(key: u64) -> u64 {
    mix64(key ^ RING_SALT)
}

/// The key's extendible-hashing directory hash; a table at local depth `d`
/// holds the keys whose low `d` bits select it.
#[inline]
pub fn dir(key: u64) -> u64 {
    mix64(key ^ DIR_SALT)
}

/// The two candidate buckets of `key` in a table of `buckets` buckets whose
/// bucket hash is salted with `seed` (they may coincide).
#[inline]
pub fn candidates(key: u64, seed: u64, buckets: u32) -> [u32; 2] {
    let h = mix64(key ^ seed);
    [reduce(h as u32, buckets), reduce((h >> 32) as u32, buckets)]
}

/// The slot (0..4) of `key` inside its bucket under the bucket's 8-bit seed.
#[inline]
pub fn slot(key: u64, seed: u8) -> usize {
    let salt = mix64(SLOT_SALT.wrapping_add(seed as u64));
    (mix64(key ^ salt) >> 62) as usize
}

/// The 6-bit fingerprint stored in a slot; used only by writes, to skip
/// reading a KV block whose key cannot match.
#[inline]
pub fn fingerprint(key: u64) -> u8 {
    (mix64(key ^ FP_SALT) >> 58) as u8
}

/// The cells of `key` in the Othello arrays A (`ma` cells) and B (`mb`).
#[inline]
pub fn othello_cells(key: u64, seed: u64, ma: u32, mb: u32) -> (u32, u32) {
    let h = mix64(key ^ mix64(seed ^ OTHELLO_SALT));
    (reduce(h as u32, ma), reduce((h >> 32) as u32, mb))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranges_are_respected_and_spread() {
        let mut seen = [0u32; 4];
        let mut fps = [false; 64];
        for k in 0..10_000u64 {
            let [a, b] = candidates(k, 7, 13);
            assert!(a < 13 && b < 13);
            seen[slot(k, 3)] += 1;
            fps[fingerprint(k) as usize] = true;
            let (x, y) = othello_cells(k, 9, 100, 75);
            assert!(x < 100 && y < 75);
        }
        assert!(seen.iter().all(|&c| c > 2_000), "{seen:?}");
        assert!(fps.iter().all(|&f| f));
    }

    #[test]
    fn slot_functions_differ_between_seeds() {
        let keys = [11u64, 22, 33, 44];
        let distinct = (0..=255u8)
            .map(|s| keys.map(|k| slot(k, s)))
            .collect::<std::collections::HashSet<_>>();
        assert!(distinct.len() > 100, "{}", distinct.len());
    }
}
