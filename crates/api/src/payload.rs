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

/// Makes `buf` (at least [`MIN_LEN`] bytes) a value of `key` at `version`
/// that keeps the caller's bytes as its filler: the first 8 bytes are
/// overwritten with the version and a tag that hashes (key, version,
/// length, filler), so [`check_value`] accepts it, and a wrong key's value
/// or a tear between two such values fails the check with probability
/// 1 - 2^-32. For fillers the harness does not derive (ScaleStore's
/// driver's random strings, `dmkv bench --value-gen random-string`).
pub fn seal_value(key: u64, version: u32, buf: &mut [u8]) {
    assert!(
        buf.len() >= MIN_LEN,
        "self-checking values have at least {MIN_LEN} bytes"
    );
    let tag = filler_tag(key, version, buf);
    buf[..4].copy_from_slice(&version.to_le_bytes());
    buf[4..8].copy_from_slice(&tag.to_le_bytes());
}

/// The tag of a sealed value ([`seal_value`]): a hash of the filler
/// (`value[8..]`), started from the derived values' seed with a distinct
/// constant mixed in, so the two kinds' tags differ.
fn filler_tag(key: u64, version: u32, value: &[u8]) -> u32 {
    let mut h = mix(seed(key, version, value.len()) ^ 0x5EA1_ED00_F111_E700);
    for chunk in value[MIN_LEN..].chunks(8) {
        let mut w = [0u8; 8];
        w[..chunk.len()].copy_from_slice(chunk);
        h = mix(h ^ u64::from_le_bytes(w));
    }
    h as u32
}

/// Whether `value` is a value of `key` at `version` sealed by
/// [`seal_value`].
fn is_sealed(key: u64, version: u32, value: &[u8]) -> bool {
    value.len() >= MIN_LEN
        && value[..4] == version.to_le_bytes()
        && value[4..8] == filler_tag(key, version, value).to_le_bytes()
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
    // A derived value ([`make_value`]) or, failing that, a sealed one
    // ([`seal_value`]): a derived value is never checked as sealed.
    if !is_value(key, version, value) && !is_sealed(key, version, value) {
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

    /// A sealed value keeps its filler, checks as its key's at its
    /// version, and fails as another key's, another version's, with any
    /// filler byte changed, or torn with another sealed value.
    #[test]
    fn sealed_values_check_themselves() {
        for len in [8usize, 9, 16, 100, 128] {
            let filler: Vec<u8> = (0..len).map(|i| 48 + (i * 7 % 75) as u8).collect();
            let mut v = filler.clone();
            seal_value(42, 7, &mut v);
            assert_eq!(v[8..], filler[8..]);
            assert_eq!(check_value(42, &v), Ok(7));
            assert!(check_value(43, &v).is_err(), "another key's value");
            let mut w = v.clone();
            w[..4].copy_from_slice(&8u32.to_le_bytes());
            assert!(check_value(42, &w).is_err(), "another version");
            for i in 8..len {
                let mut w = v.clone();
                w[i] ^= 0x01;
                assert!(check_value(42, &w).is_err(), "byte {i} changed");
            }
            let mut other: Vec<u8> = filler.iter().map(|b| b ^ 0x0F).collect();
            seal_value(42, 8, &mut other);
            let mut torn = v.clone();
            torn[len / 2..].copy_from_slice(&other[len / 2..]);
            assert!(len < 16 || check_value(42, &torn).is_err(), "torn");
        }
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
