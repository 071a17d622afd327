//! Self-checking values for the benchmark harness and the test suites.
//!
//! A value is derived from its key and a version: `version u32 | tag u32 |
//! filler`, where the tag and the filler are functions of (key, version,
//! length). Reading a value back tells which version it is and whether it is
//! really this key's (a wrong key's value or a torn mix of two versions fails
//! the check with overwhelming probability).

/// The shortest self-checking value.
pub const MIN_LEN: usize = 8;

fn mix(mut x: u64) -> u64 {
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

fn seed(key: u64, version: u32, len: usize) -> u64 {
    mix(key ^ mix(((version as u64) << 32) | len as u64))
}

/// The value of `key` at `version`, `len` bytes long (at least [`MIN_LEN`]).
pub fn make_value(key: u64, version: u32, len: usize) -> Vec<u8> {
    assert!(
        len >= MIN_LEN,
        "self-checking values have at least {MIN_LEN} bytes"
    );
    let mut v = Vec::with_capacity(len);
    let mut s = seed(key, version, len);
    v.extend_from_slice(&version.to_le_bytes());
    v.extend_from_slice(&(s as u32).to_le_bytes());
    while v.len() < len {
        s = mix(s.wrapping_add(0x9E37_79B9_7F4A_7C15));
        let b = s.to_le_bytes();
        let n = (len - v.len()).min(8);
        v.extend_from_slice(&b[..n]);
    }
    v
}

/// The version `value` encodes if it is a well-formed value of `key`.
pub fn check_value(key: u64, value: &[u8]) -> Result<u32, String> {
    if value.len() < MIN_LEN {
        return Err(format!(
            "value of key {key:#x} has {} bytes, fewer than {MIN_LEN}",
            value.len()
        ));
    }
    let version = u32::from_le_bytes(value[..4].try_into().expect("4 bytes"));
    if !is_value(key, version, value) {
        return Err(format!(
            "value of key {key:#x} is not this key's (claims version {version}, {} bytes)",
            value.len()
        ));
    }
    Ok(version)
}

/// Whether `value` is exactly `make_value(key, version, value.len())`,
/// compared as it is generated, without building it (the harness checks
/// every value it reads: building the expected value cost an allocation
/// and a free per check).
fn is_value(key: u64, version: u32, value: &[u8]) -> bool {
    let len = value.len();
    if len < MIN_LEN {
        return false;
    }
    let mut s = seed(key, version, len);
    if value[..4] != version.to_le_bytes() || value[4..8] != (s as u32).to_le_bytes() {
        return false;
    }
    let mut rest = &value[8..];
    while !rest.is_empty() {
        s = mix(s.wrapping_add(0x9E37_79B9_7F4A_7C15));
        let n = rest.len().min(8);
        if rest[..n] != s.to_le_bytes()[..n] {
            return false;
        }
        rest = &rest[n..];
    }
    true
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_catches_wrong_keys_and_tears() {
        for len in [8, 9, 16, 100] {
            let v = make_value(42, 7, len);
            assert_eq!(v.len(), len);
            assert_eq!(check_value(42, &v), Ok(7));
            assert!(check_value(43, &v).is_err(), "another key's value");
            let w = make_value(42, 8, len);
            let mut torn = v.clone();
            torn[4..].copy_from_slice(&w[4..]);
            assert!(check_value(42, &torn).is_err(), "torn between versions");
        }
        assert!(check_value(1, &[0; 4]).is_err());
    }

    /// `is_value` (the check's in-place comparison) agrees with comparing
    /// against `make_value` for every length around the word boundaries and
    /// for a change of any single byte.
    #[test]
    fn the_in_place_check_is_the_built_comparison() {
        for len in 8..=40 {
            let v = make_value(0xABCD, 3, len);
            assert!(is_value(0xABCD, 3, &v));
            assert!(!is_value(0xABCD, 4, &v));
            assert!(!is_value(0xABCE, 3, &v));
            for i in 0..len {
                let mut w = v.clone();
                w[i] ^= 0x40;
                assert_eq!(is_value(0xABCD, 3, &w), make_value(0xABCD, 3, len) == w);
                assert!(check_value(0xABCD, &w).is_err() || i < 4);
            }
        }
        assert!(!is_value(1, 0, &[0; 7]));
    }
}
