//! Request distributions: YCSB's zipfian (with its scrambled variant) and
//! skewed-latest, implemented after YCSB's `ZipfianGenerator`,
//! `ScrambledZipfianGenerator` and `SkewedLatestGenerator` (Gray et al.,
//! "Quickly generating billion-record synthetic databases", SIGMOD'94).

use crate::rng::Rng;

/// YCSB's zipfian constant.
pub const ZIPFIAN_THETA: f64 = 0.99;

/// ζ(n, θ) = Σ_{i=1..n} 1 / i^θ.
pub fn zeta(n: u64, theta: f64) -> f64 {
    zeta_extend(0, n, theta, 0.0)
}

/// ζ(to, θ) given ζ(from, θ) = `zeta_from`.
pub fn zeta_extend(from: u64, to: u64, theta: f64, zeta_from: f64) -> f64 {
    (from + 1..=to).fold(zeta_from, |z, i| z + 1.0 / (i as f64).powf(theta))
}

/// Zipfian over item ranks 0..n: rank 0 is the most popular, rank i has
/// probability ∝ 1 / (i+1)^θ. The item count may grow between draws (for
/// "latest" and for inserts); ζ is then extended incrementally.
#[derive(Debug, Clone)]
pub struct Zipfian {
    theta: f64,
    alpha: f64,
    zeta2: f64,
    /// Items ζ was computed for.
    n: u64,
    zetan: f64,
    eta: f64,
}

impl Zipfian {
    /// A zipfian over `n` items with θ = [`ZIPFIAN_THETA`].
    pub fn new(n: u64) -> Zipfian {
        Zipfian::with_zeta(n, zeta(n, ZIPFIAN_THETA))
    }

    /// Like [`Zipfian::new`] with ζ(n) already known (it costs O(n) to
    /// compute, so a run computes it once and shares it).
    pub fn with_zeta(n: u64, zetan: f64) -> Zipfian {
        let theta = ZIPFIAN_THETA;
        let mut z = Zipfian {
            theta,
            alpha: 1.0 / (1.0 - theta),
            zeta2: zeta(2, theta),
            n,
            zetan,
            eta: 0.0,
        };
        z.eta = z.eta_for(n);
        z
    }

    fn eta_for(&self, n: u64) -> f64 {
        (1.0 - (2.0 / n as f64).powf(1.0 - self.theta)) / (1.0 - self.zeta2 / self.zetan)
    }

    /// Items ζ is currently computed for.
    pub fn items(&self) -> u64 {
        self.n
    }

    /// Extends the item count to `n` (never shrinks it).
    pub fn grow_to(&mut self, n: u64) {
        if n > self.n {
            self.zetan = zeta_extend(self.n, n, self.theta, self.zetan);
            self.n = n;
            self.eta = self.eta_for(n);
        }
    }

    /// A rank in [0, n) over the current item count (which must be ≥ 1).
    pub fn next(&mut self, rng: &mut Rng) -> u64 {
        let n = self.n;
        assert!(n > 0, "zipfian over no items");
        let u = rng.next_f64();
        let uz = u * self.zetan;
        if uz < 1.0 {
            return 0;
        }
        if uz < 1.0 + 0.5f64.powf(self.theta) {
            return 1.min(n - 1);
        }
        let r = (n as f64 * (self.eta * u - self.eta + 1.0).powf(self.alpha)) as u64;
        r.min(n - 1)
    }
}

/// 64-bit FNV-1a over the 8 little-endian bytes of `x` (YCSB's `fnvhash64`).
pub fn fnv1a64(x: u64) -> u64 {
    const OFFSET: u64 = 0xCBF2_9CE4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01B3;
    x.to_le_bytes()
        .iter()
        .fold(OFFSET, |h, &b| (h ^ b as u64).wrapping_mul(PRIME))
}

/// YCSB's scrambled zipfian: a zipfian rank hashed with FNV, so that the hot
/// items are spread over the key space instead of clustered at its start.
/// Like YCSB's, hashing modulo n makes a few items collide; the popularity
/// profile stays zipfian.
#[derive(Debug, Clone)]
pub struct ScrambledZipfian {
    zipf: Zipfian,
}

impl ScrambledZipfian {
    pub fn with_zeta(n: u64, zetan: f64) -> ScrambledZipfian {
        ScrambledZipfian {
            zipf: Zipfian::with_zeta(n, zetan),
        }
    }

    pub fn new(n: u64) -> ScrambledZipfian {
        ScrambledZipfian {
            zipf: Zipfian::new(n),
        }
    }

    /// An item in [0, n).
    pub fn next(&mut self, rng: &mut Rng) -> u64 {
        fnv1a64(self.zipf.next(rng)) % self.zipf.items()
    }
}

/// YCSB's skewed-latest: zipfian over recency. Items are numbered in the
/// order they were created; the newest is the most popular.
#[derive(Debug, Clone)]
pub struct Latest {
    zipf: Zipfian,
}

impl Latest {
    /// Over `n` existing items, ζ(n) given.
    pub fn with_zeta(n: u64, zetan: f64) -> Latest {
        Latest {
            zipf: Zipfian::with_zeta(n, zetan),
        }
    }

    /// An item in [0, n), where item n-1 is the newest; `n` may have grown
    /// since the last call.
    pub fn next(&mut self, n: u64, rng: &mut Rng) -> u64 {
        self.zipf.grow_to(n);
        debug_assert_eq!(self.zipf.items(), n, "latest items never shrink");
        n - 1 - self.zipf.next(rng)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn zeta_extends_incrementally() {
        let a = zeta(1000, ZIPFIAN_THETA);
        let b = zeta_extend(400, 1000, ZIPFIAN_THETA, zeta(400, ZIPFIAN_THETA));
        assert!((a - b).abs() < 1e-9);
        assert_eq!(zeta(1, 0.99), 1.0);
    }

    #[test]
    fn fnv_matches_the_reference_values() {
        // FNV-1a 64 of eight zero bytes, from the FNV reference code.
        assert_eq!(fnv1a64(0), 0xA8C7_F832_281A_39C5);
    }
}
