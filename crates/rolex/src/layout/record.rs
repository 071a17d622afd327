//! Model records: one per model, in the model region of the memory node that
//! holds the model's leaves (Fig. 4: parameters, LT, SLT).
//!
//! ```text
//! word 0   magic
//! word 1   low  (inclusive lower bound of the model's keys)
//! word 2   high (exclusive upper bound; u64::MAX = top)
//! word 3   kmin (first trained x)      \  the prediction clamps keys to
//! word 4   kmax (last trained x)       /  [kmin, kmax]
//! word 5   slope (f64 bits)
//! word 6   intercept (f64 bits): position = intercept + slope * (x - kmin)
//! word 7   err u32 (measured max error, positions) | leaves u32 (LT size)
//! word 8   SLT slots u32 | leaf region u32
//! word 9   urgent flag (CAS 0 -> 1 by the first writer that finds the SLT full)
//! word 10  state: 1 active, 2 training, 3 retired, 4 failed, 5 freezing
//! word 11  SLT[0] = slot_use (next free SLT slot; FAA by writers)
//! ...      SLT[1..S]
//! ...      LT[0..leaves]
//! ```
//!
//! Words 0..9 are written once before the record is published; state and
//! the tables change afterwards. State and slot_use are adjacent so a reader
//! gets both with one 16-byte read in its doorbell batch and notices a
//! retired model or new synonym leaves.

use crate::layout::leaf::words_of;

pub const RECORD_MAGIC: u64 = 0x444F_4D58_454C_4F52; // "ROLEXMOD"
pub const W_MAGIC: usize = 0;
pub const W_LOW: usize = 1;
pub const W_HIGH: usize = 2;
pub const W_KMIN: usize = 3;
pub const W_KMAX: usize = 4;
pub const W_SLOPE: usize = 5;
pub const W_INTERCEPT: usize = 6;
pub const W_ERR_LEAVES: usize = 7;
pub const W_SLT_REGION: usize = 8;
pub const W_URGENT: usize = 9;
pub const W_STATE: usize = 10;
pub const W_SLT: usize = 11;

const _: () = assert!(W_SLT == W_STATE + 1, "state and slot_use are read together");

/// Lifecycle of a model record.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u64)]
pub enum ModelState {
    Active = 1,
    /// The memory node is retraining it; writers must not unlink leaves.
    Training = 2,
    /// Replaced by newer models; its LT entries are all `RETIRED`.
    Retired = 3,
    /// Retraining failed for lack of space; writers that need a new SLT slot
    /// get an `Exhausted` error.
    Failed = 4,
    /// The memory node is freezing it (CASing its LT entries to RETIRED):
    /// writers stop taking its locks and wait for the new directory.
    Freezing = 5,
}

impl ModelState {
    pub fn from_word(w: u64) -> Option<ModelState> {
        Some(match w {
            1 => ModelState::Active,
            2 => ModelState::Training,
            3 => ModelState::Retired,
            4 => ModelState::Failed,
            5 => ModelState::Freezing,
            _ => return None,
        })
    }
}

/// The immutable part of a model.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ModelParams {
    pub low: u64,
    pub high: u64,
    pub kmin: u64,
    pub kmax: u64,
    pub slope: f64,
    pub intercept: f64,
    /// Maximum prediction error over the trained points, in positions,
    /// strictly above the measured one.
    pub err: u32,
    pub leaves: u32,
    pub slt_slots: u32,
    /// Leaf region (memory node index) of all the model's leaves.
    pub region: u8,
}

impl ModelParams {
    /// The predicted position of `key` (clamped into the trained range).
    pub fn position(&self, key: u64) -> f64 {
        let x = key.clamp(self.kmin, self.kmax);
        self.intercept + self.slope * ((x - self.kmin) as f64)
    }

    /// The trained leaves (LT indices) that may hold `key`'s group:
    /// positions `[f - err - δ, f + err]` mapped to leaves (Eq. 1-2 with the
    /// bias δ on the lower side; see docs/rolex.md, invariant 4).
    pub fn leaf_range(&self, key: u64, slots: usize) -> (usize, usize) {
        let f = self.position(key);
        let e = self.err as f64;
        let d = slots as f64;
        let last = self.leaves.max(1) as i64 - 1;
        let lo = (((f - e) / d).ceil() as i64 - 1).clamp(0, last);
        let hi = (((f + e) / d).floor() as i64).clamp(0, last);
        (lo as usize, hi.max(lo) as usize)
    }
}

/// Word offsets of a record with `slt` SLT slots.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RecordLayout {
    pub slt: usize,
}

impl RecordLayout {
    pub fn header_words() -> usize {
        W_SLT
    }
    pub fn slt_word(&self, i: usize) -> usize {
        W_SLT + i
    }
    pub fn lt_word(&self, i: usize) -> usize {
        W_SLT + self.slt + i
    }
    pub fn words(&self, leaves: usize) -> usize {
        W_SLT + self.slt + leaves
    }
    pub fn bytes(&self, leaves: usize) -> usize {
        self.words(leaves) * 8
    }
}

/// Encodes a whole record (header, SLT, LT).
pub fn encode_record(p: &ModelParams, state: ModelState, slt: &[u64], lt: &[u64]) -> Vec<u64> {
    assert_eq!(slt.len(), p.slt_slots as usize);
    assert_eq!(lt.len(), p.leaves as usize);
    let mut w = vec![0u64; W_SLT];
    w[W_MAGIC] = RECORD_MAGIC;
    w[W_LOW] = p.low;
    w[W_HIGH] = p.high;
    w[W_KMIN] = p.kmin;
    w[W_KMAX] = p.kmax;
    w[W_SLOPE] = p.slope.to_bits();
    w[W_INTERCEPT] = p.intercept.to_bits();
    w[W_ERR_LEAVES] = p.err as u64 | (p.leaves as u64) << 32;
    w[W_SLT_REGION] = p.slt_slots as u64 | (p.region as u64) << 32;
    w[W_URGENT] = 0;
    w[W_STATE] = state as u64;
    w.extend_from_slice(slt);
    w.extend_from_slice(lt);
    w
}

/// Parses the header of a record (at least [`RecordLayout::header_words`]
/// words), checking what a client must be able to rely on.
pub fn decode_header(bytes: &[u8], max_slt: usize) -> Result<ModelParams, String> {
    if bytes.len() < W_SLT * 8 {
        return Err("short model record".into());
    }
    let w = words_of(&bytes[..W_SLT * 8]);
    if w[W_MAGIC] != RECORD_MAGIC {
        return Err(format!("bad model record magic {:#x}", w[W_MAGIC]));
    }
    let p = ModelParams {
        low: w[W_LOW],
        high: w[W_HIGH],
        kmin: w[W_KMIN],
        kmax: w[W_KMAX],
        slope: f64::from_bits(w[W_SLOPE]),
        intercept: f64::from_bits(w[W_INTERCEPT]),
        err: w[W_ERR_LEAVES] as u32,
        leaves: (w[W_ERR_LEAVES] >> 32) as u32,
        slt_slots: w[W_SLT_REGION] as u32,
        region: (w[W_SLT_REGION] >> 32) as u8,
    };
    if p.leaves == 0
        || p.slt_slots < 2
        || p.slt_slots as usize > max_slt
        || p.low >= p.high
        || p.kmin > p.kmax
        || !p.slope.is_finite()
        || !p.intercept.is_finite()
    {
        return Err(format!("implausible model record {p:?}"));
    }
    Ok(p)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> ModelParams {
        ModelParams {
            low: 0,
            high: u64::MAX,
            kmin: 100,
            kmax: 1000,
            slope: 0.1,
            intercept: 0.0,
            err: 3,
            leaves: 8,
            slt_slots: 16,
            region: 2,
        }
    }

    #[test]
    fn header_round_trips_and_ranges_clamp() {
        let p = params();
        let w = encode_record(&p, ModelState::Active, &[1; 16], &[7; 8]);
        assert_eq!(w.len(), RecordLayout { slt: 16 }.words(8));
        let b: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(decode_header(&b, 256).unwrap(), p);
        assert_eq!(p.leaf_range(0, 16), (0, 0));
        assert_eq!(
            p.leaf_range(u64::MAX - 1, 16),
            (5, 5),
            "f = 90: [87-16, 93]/16"
        );
        let (lo, hi) = p.leaf_range(600, 16);
        assert!(lo <= 3 && hi >= 3);
    }
}
