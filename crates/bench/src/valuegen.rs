//! How the harness makes the value of each update and insert
//! (`--value-gen`).
//!
//! - [`ValueGen::Derived`] (the default): the self-checking value of
//!   (key, version, length) ([`dmkv_api::payload::make_value`]), cheap and
//!   not modelled as work on `sim`.
//! - [`ValueGen::RandomString`]: what ScaleStore's YCSB driver does inside
//!   its measured loop (DataManagementLab/ScaleStore
//!   `frontend/ycsb/ycsb.cpp`: `utils::RandomGenerator::getRandString
//!   (payload, sizeof(V))` before every `tree.insert`): every byte of the
//!   value is `48 + rnd() % 75` (`getRand(48, 123)`), one MT19937-64 draw
//!   ([`crate::mt64`]) and a modulo per byte. The harness really generates
//!   the string, then seals it ([`dmkv_api::payload::seal_value`]: version
//!   and a tag over the string in its first 8 bytes), so `--verify` and
//!   every read's check still know the value. On `local` and `ucx` the
//!   generation costs what it costs; on `sim` the thread's core is charged
//!   [`string_instructions`] (measured, see there;
//!   `dmkv_transport::Endpoint::charge_instructions`) at the profile's
//!   instruction term, and the task waits for it before the operation's
//!   stopwatch starts (the artifact's latency timer starts after the
//!   generation too; its throughput includes it).

use crate::error::BenchError;
use crate::mt64::Mt64;
use dmkv_api::payload::{make_value, seal_value};

/// `--value-gen`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ValueGen {
    #[default]
    Derived,
    RandomString,
}

impl ValueGen {
    pub fn name(self) -> &'static str {
        match self {
            ValueGen::Derived => "derived",
            ValueGen::RandomString => "random-string",
        }
    }
}

impl std::fmt::Display for ValueGen {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for ValueGen {
    type Err = String;
    fn from_str(s: &str) -> Result<ValueGen, String> {
        match s {
            "derived" => Ok(ValueGen::Derived),
            "random-string" => Ok(ValueGen::RandomString),
            _ => Err(format!(
                "--value-gen takes derived (the default: values derived from key and version) or random-string (ScaleStore's driver: MT19937-64 and a modulo per byte); got {s:?}"
            )),
        }
    }
}

/// Instructions of one `getRandString` of `len` bytes on our generator:
/// `STRING_INSTRUCTIONS + len x BYTE_CENTI_INSTRUCTIONS / 100`, measured
/// with callgrind on [`random_strings`] (examples/value-gen-instructions.rs):
/// `valgrind --tool=callgrind --toggle-collect='*random_strings*'
/// target/release/examples/value-gen-instructions N LEN` gave
/// 119,835,279 and 239,667,204 instructions for N = 20,000 and 40,000
/// strings of 128 bytes (5,991.6 per string, the generator's refills
/// amortised) and 954,321,780 and 1,908,640,165 for 20,000 and 40,000 of
/// 1,024 bytes (47,715.9 per string): 46.57 per byte, 31 per string
/// (docs/scalestore.md, "(branch i81)").
pub const BYTE_CENTI_INSTRUCTIONS: u64 = 4_657;
pub const STRING_INSTRUCTIONS: u64 = 31;

/// The declared work of one string of `len` bytes (see the constants).
pub fn string_instructions(len: usize) -> u64 {
    STRING_INSTRUCTIONS + len as u64 * BYTE_CENTI_INSTRUCTIONS / 100
}

/// `getRandString`: fills `dst` with bytes in `48..123`, one draw each.
#[inline(never)]
pub fn random_string(mt: &mut Mt64, dst: &mut [u8]) {
    for b in dst.iter_mut() {
        *b = (48 + mt.next_u64() % (123 - 48)) as u8;
    }
}

/// `count` strings of `len` bytes (the measured loop of the instruction
/// count above); returns a byte of the last so the work is kept.
#[inline(never)]
pub fn random_strings(mt: &mut Mt64, count: usize, len: usize) -> u8 {
    let mut buf = vec![0u8; len];
    let mut x = 0u8;
    for _ in 0..count {
        random_string(mt, &mut buf);
        x ^= buf[len - 1];
    }
    x
}

/// One task's value maker.
pub struct TaskValues {
    /// `RandomString`: the task's generator (the artifact has one per
    /// thread; one per task keeps the streams independent of scheduling).
    mt: Option<Mt64>,
}

impl TaskValues {
    /// The maker of task `task` of thread `thread` in a run of `seed`.
    pub fn new(kind: ValueGen, seed: u64, thread: usize, task: usize) -> TaskValues {
        let mt = match kind {
            ValueGen::Derived => None,
            ValueGen::RandomString => {
                // "valuegen" in ASCII: a stream of its own.
                let path = [0x7661_6C75_6567_656E, thread as u64, task as u64];
                Some(Mt64::new(crate::rng::derive_seed(seed, &path)))
            }
        };
        TaskValues { mt }
    }

    /// The value of `key` at `version`, `len` bytes. Under `RandomString`
    /// the caller then charges [`Self::declared`] to its core (kept out of
    /// this function so that the default path has no future to build:
    /// an `async` maker cost every update ~64 instructions with derived
    /// values, `scripts/instructions-per-op.sh btree-floor ycsb-a`).
    #[inline]
    pub fn make(&mut self, key: u64, version: u32, len: usize) -> Vec<u8> {
        match &mut self.mt {
            None => make_value(key, version, len),
            Some(mt) => {
                let mut v = vec![0u8; len];
                random_string(mt, &mut v);
                seal_value(key, version, &mut v);
                v
            }
        }
    }

    /// The work to declare for a value of `len` bytes just made: `None`
    /// for derived values (nothing to charge).
    #[inline]
    pub fn declared(&self, len: usize) -> Option<u64> {
        self.mt.as_ref().map(|_| string_instructions(len))
    }
}

/// Refuses `kind` where it cannot be modelled: on `sim` with a profile
/// without an instruction term (`memnode.cpu_ghz`, `memnode.ipc`), the
/// generation would be free, which is the default's model, not the
/// artifact's.
pub fn check_applies(
    kind: ValueGen,
    sim: Option<&dmkv_transport::sim::Simulation>,
) -> Result<(), BenchError> {
    match (kind, sim) {
        (ValueGen::RandomString, Some(s)) if s.profile().memnode.instructions_per_us() == 0 => {
            Err(BenchError::input(format!(
                "--value-gen random-string on --transport sim charges the generation at the profile's instruction term, and profile {} has none (memnode.cpu_ghz and memnode.ipc): give a --profile that sets them (e.g. profiles/scalestore-cx5.toml)",
                s.profile().name
            )))
        }
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for g in [ValueGen::Derived, ValueGen::RandomString] {
            assert_eq!(g.name().parse::<ValueGen>(), Ok(g));
        }
        assert!("random".parse::<ValueGen>().is_err());
        assert_eq!(ValueGen::default(), ValueGen::Derived);
    }

    /// `getRandString`'s bytes are in `48..123`, one draw each, in the
    /// generator's order.
    #[test]
    fn random_strings_are_the_artifacts() {
        let mut a = Mt64::new(9);
        let mut b = Mt64::new(9);
        let mut s = [0u8; 200];
        random_string(&mut a, &mut s);
        for &x in &s {
            assert_eq!(x as u64, 48 + b.next_u64() % 75);
            assert!((48..123).contains(&x));
        }
    }
}
