//! A small, fully specified pseudo-random generator.
//!
//! Request streams and key sets must be the same on every machine and with
//! every version of our dependencies (the same `--seed` must give the same
//! run), so the harness does not use `rand`'s generators, whose streams are
//! not guaranteed stable. This is xoshiro256** seeded through SplitMix64, as
//! published by Blackman and Vigna.

/// SplitMix64's finaliser: a good 64-bit mixing function.
pub fn mix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// A seed derived from a base seed and a path of labels, so that independent
/// streams (keys, one task's operation kinds, its keys) never share state.
pub fn derive_seed(seed: u64, path: &[u64]) -> u64 {
    path.iter().fold(mix64(seed), |h, &p| mix64(h ^ mix64(p)))
}

/// Labels for [`derive_seed`].
pub mod stream {
    pub const KEYS: u64 = 1;
    pub const OP_KINDS: u64 = 2;
    pub const OP_KEYS: u64 = 3;
}

/// xoshiro256**.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in [0, 1), with 53 random bits.
    pub fn next_f64(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Uniform in [0, n), without bias (Lemire's multiply-and-reject).
    /// `n` must be positive.
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0, "below(0)");
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = (self.next_u64() as u128) * (n as u128);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// Uniform in [lo, hi] (inclusive).
    pub fn range_inclusive(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi);
        match (hi - lo).checked_add(1) {
            Some(span) => lo + self.below(span),
            None => self.next_u64(),
        }
    }

    /// A standard normal sample (Box-Muller; one of the pair is dropped so
    /// that the generator has no hidden state).
    pub fn standard_normal(&mut self) -> f64 {
        // 1 - u is in (0, 1], so the logarithm is finite.
        let u1 = 1.0 - self.next_f64();
        let u2 = self.next_f64();
        (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn same_seed_same_stream_and_seeds_differ() {
        let a: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let b: Vec<u64> = {
            let mut r = Rng::new(7);
            (0..8).map(|_| r.next_u64()).collect()
        };
        let c: Vec<u64> = {
            let mut r = Rng::new(8);
            (0..8).map(|_| r.next_u64()).collect()
        };
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(derive_seed(1, &[2, 3]), derive_seed(1, &[3, 2]));
    }

    #[test]
    fn below_stays_in_range_and_covers_it() {
        let mut r = Rng::new(1);
        let mut seen = [0u32; 10];
        for _ in 0..10_000 {
            seen[r.below(10) as usize] += 1;
        }
        // Each bucket expects 1000; 800 is > 6 standard deviations away.
        assert!(seen.iter().all(|&n| n > 800), "{seen:?}");
        assert_eq!(r.range_inclusive(5, 5), 5);
        let _ = r.range_inclusive(0, u64::MAX);
    }

    #[test]
    fn normal_has_roughly_zero_mean_and_unit_variance() {
        let mut r = Rng::new(3);
        let n = 20_000;
        let xs: Vec<f64> = (0..n).map(|_| r.standard_normal()).collect();
        let mean = xs.iter().sum::<f64>() / n as f64;
        let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n as f64;
        assert!(mean.abs() < 0.05, "{mean}");
        assert!((var - 1.0).abs() < 0.05, "{var}");
    }
}
