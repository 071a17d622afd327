//! MT19937-64, the Mersenne Twister ScaleStore's benchmark driver draws its
//! random strings from (`utils::MersenneTwister`, DataManagementLab/
//! ScaleStore `backend/scalestore/utils/RandomGenerator.cpp`, itself the
//! reference `mt19937-64.c` of Matsumoto and Nishimura): the same state,
//! seeding (`init`), refill of 312 words at a time and tempering, written
//! here from the algorithm.

const NN: usize = 312;
const MM: usize = 156;
const MATRIX_A: u64 = 0xB502_6F5A_A966_19E9;
/// The most significant 33 bits.
const UM: u64 = 0xFFFF_FFFF_8000_0000;
/// The least significant 31 bits.
const LM: u64 = 0x7FFF_FFFF;

/// One generator: 312 words of state and the index of the next word
/// (`NN`: the state must be refilled before the next draw).
#[derive(Clone)]
pub struct Mt64 {
    mt: Box<[u64; NN]>,
    mti: usize,
}

impl Mt64 {
    /// Seeded as `MersenneTwister::init(seed)` (the reference
    /// `init_genrand64`).
    pub fn new(seed: u64) -> Mt64 {
        let mut mt = Box::new([0u64; NN]);
        mt[0] = seed;
        for i in 1..NN {
            mt[i] = 6_364_136_223_846_793_005u64
                .wrapping_mul(mt[i - 1] ^ (mt[i - 1] >> 62))
                .wrapping_add(i as u64);
        }
        Mt64 { mt, mti: NN }
    }

    /// The next 64-bit draw (`MersenneTwister::rnd`). Kept out of line, as
    /// the artifact's is (defined in its own translation unit), so that a
    /// string's generation costs what the artifact's does: a call per byte.
    #[inline(never)]
    pub fn next_u64(&mut self) -> u64 {
        if self.mti >= NN {
            self.refill();
        }
        let mut x = self.mt[self.mti];
        self.mti += 1;
        x ^= (x >> 29) & 0x5555_5555_5555_5555;
        x ^= (x << 17) & 0x71D6_7FFF_EDA6_0000;
        x ^= (x << 37) & 0xFFF7_EEE0_0000_0000;
        x ^= x >> 43;
        x
    }

    /// Generates the next `NN` words of state at once.
    fn refill(&mut self) {
        let mt = &mut *self.mt;
        let mag = |x: u64| if x & 1 == 1 { MATRIX_A } else { 0 };
        for i in 0..NN - MM {
            let x = (mt[i] & UM) | (mt[i + 1] & LM);
            mt[i] = mt[i + MM] ^ (x >> 1) ^ mag(x);
        }
        for i in NN - MM..NN - 1 {
            let x = (mt[i] & UM) | (mt[i + 1] & LM);
            mt[i] = mt[i + MM - NN] ^ (x >> 1) ^ mag(x);
        }
        let x = (mt[NN - 1] & UM) | (mt[0] & LM);
        mt[NN - 1] = mt[MM - 1] ^ (x >> 1) ^ mag(x);
        self.mti = 0;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The reference outputs of MT19937-64 seeded with 5489 (the C++
    /// standard's `std::mt19937_64` default seed; [rand.predef] gives its
    /// 10000th output, 9981545732273789042).
    #[test]
    fn matches_the_reference_generator() {
        let mut m = Mt64::new(5489);
        assert_eq!(m.next_u64(), 14_514_284_786_278_117_030);
        for _ in 1..9_999 {
            m.next_u64();
        }
        assert_eq!(m.next_u64(), 9_981_545_732_273_789_042);
    }
}
