//! Key sets: which u64 keys a run loads and inserts.
//!
//! A run draws all its keys at once, loaded keys first and then the keys its
//! inserts will add, from one generator; so inserted keys follow the same
//! distribution as loaded ones and are disjoint from them. Keys are distinct
//! and never one that an engine of the run reserves.

use crate::error::BenchError;
use crate::rng::Rng;
use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

/// `--keyset`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum KeysetSpec {
    /// Uniform random u64.
    Uniform,
    /// 0, 1, 2, ... (skipping reserved keys).
    Sequential,
    /// Normal with mean 2^63 and standard deviation 2^60.
    Normal,
    /// ROLEX's lognormal(μ=0, σ=2), scaled by 2^40.
    Lognormal,
    /// Keys from a SOSD binary file: u64 count, then count u64 keys, all
    /// little-endian.
    Sosd(PathBuf),
}

impl FromStr for KeysetSpec {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "uniform" => KeysetSpec::Uniform,
            "sequential" => KeysetSpec::Sequential,
            "normal" => KeysetSpec::Normal,
            "lognormal" => KeysetSpec::Lognormal,
            _ => match s.strip_prefix("sosd:") {
                Some("") => return Err("sosd: needs a file, as in sosd:PATH".into()),
                Some(path) => KeysetSpec::Sosd(PathBuf::from(path)),
                None => {
                    return Err(format!(
                        "unknown key set {s:?}; expected uniform, sequential, normal, lognormal or sosd:PATH"
                    ));
                }
            },
        })
    }
}

impl fmt::Display for KeysetSpec {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeysetSpec::Uniform => write!(f, "uniform"),
            KeysetSpec::Sequential => write!(f, "sequential"),
            KeysetSpec::Normal => write!(f, "normal"),
            KeysetSpec::Lognormal => write!(f, "lognormal"),
            KeysetSpec::Sosd(p) => write!(f, "sosd:{}", p.display()),
        }
    }
}

/// Standard deviation of the normal key set: 2^60, so ±8σ stays in range.
const NORMAL_SD: f64 = (1u64 << 60) as f64;
const NORMAL_MEAN: f64 = (1u64 << 63) as f64;
/// Scale of the lognormal key set: exp(N(0, 2)) * 2^40 keeps distinct
/// samples distinct and overflows u64 only beyond 8.5σ (such draws are
/// redrawn).
const LOGNORMAL_SCALE: f64 = (1u64 << 40) as f64;
const TWO_POW_64: f64 = 18_446_744_073_709_551_616.0;

/// `count` distinct keys, none in `reserved`, in generation order.
pub fn generate(
    spec: &KeysetSpec,
    count: usize,
    reserved: &[u64],
    seed: u64,
) -> Result<Vec<u64>, BenchError> {
    let mut rng = Rng::new(seed);
    let reserved: HashSet<u64> = reserved.iter().copied().collect();
    match spec {
        KeysetSpec::Sequential => Ok((0..=u64::MAX)
            .filter(|k| !reserved.contains(k))
            .take(count)
            .collect()),
        KeysetSpec::Uniform => Ok(draw_distinct(count, &reserved, || Some(rng.next_u64()))),
        KeysetSpec::Normal => Ok(draw_distinct(count, &reserved, || {
            to_key(NORMAL_MEAN + rng.standard_normal() * NORMAL_SD)
        })),
        KeysetSpec::Lognormal => Ok(draw_distinct(count, &reserved, || {
            to_key((2.0 * rng.standard_normal()).exp() * LOGNORMAL_SCALE)
        })),
        KeysetSpec::Sosd(path) => {
            let mut keys = read_sosd(path)?;
            let total = keys.len();
            keys.sort_unstable();
            keys.dedup();
            keys.retain(|k| !reserved.contains(k));
            if keys.len() < count {
                return Err(BenchError::input(format!(
                    "{}: {} usable keys ({total} in the file, after removing duplicates and reserved keys) but the run needs {count}",
                    path.display(),
                    keys.len()
                )));
            }
            // A seeded shuffle picks which keys are loaded and which inserted.
            for i in (1..keys.len()).rev() {
                let j = rng.below(i as u64 + 1) as usize;
                keys.swap(i, j);
            }
            keys.truncate(count);
            Ok(keys)
        }
    }
}

/// A sample as a key, or None if it falls outside [0, 2^64).
fn to_key(x: f64) -> Option<u64> {
    (0.0..TWO_POW_64).contains(&x).then_some(x as u64)
}

fn draw_distinct(
    count: usize,
    reserved: &HashSet<u64>,
    mut draw: impl FnMut() -> Option<u64>,
) -> Vec<u64> {
    let mut seen = HashSet::with_capacity(count);
    let mut keys = Vec::with_capacity(count);
    while keys.len() < count {
        if let Some(k) = draw()
            && !reserved.contains(&k)
            && seen.insert(k)
        {
            keys.push(k);
        }
    }
    keys
}

/// The keys of a SOSD binary file, as stored (duplicates kept).
pub fn read_sosd(path: &Path) -> Result<Vec<u64>, BenchError> {
    let bytes = std::fs::read(path)
        .map_err(|e| BenchError::input(format!("cannot read {}: {e}", path.display())))?;
    parse_sosd(&bytes).map_err(|e| BenchError::input(format!("{}: {e}", path.display())))
}

/// Parses SOSD's binary format: a little-endian u64 count, then that many
/// little-endian u64 keys, and nothing after them.
pub fn parse_sosd(bytes: &[u8]) -> Result<Vec<u64>, String> {
    if bytes.len() < 8 {
        return Err(format!(
            "not a SOSD key file: {} bytes, shorter than its 8-byte header",
            bytes.len()
        ));
    }
    let count = u64::from_le_bytes(bytes[..8].try_into().expect("8 bytes"));
    let body = &bytes[8..];
    if !body.len().is_multiple_of(8) || (body.len() / 8) as u64 != count {
        return Err(format!(
            "not a SOSD key file: its header announces {count} keys but {} bytes follow it ({} keys' worth)",
            body.len(),
            body.len() as f64 / 8.0
        ));
    }
    Ok(body
        .chunks_exact(8)
        .map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes")))
        .collect())
}
