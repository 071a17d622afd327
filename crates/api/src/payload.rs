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
    if make_value(key, version, value.len()) != value {
        return Err(format!(
            "value of key {key:#x} is not this key's (claims version {version}, {} bytes)",
            value.len()
        ));
    }
    Ok(version)
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
}
