//! Per-interval engine counters for `--timeline-ms`: the engine's running
//! client-side totals (`Engine::client_counters`, e.g. XStore's fallbacks)
//! are sampled at interval boundaries, never per operation, and differenced
//! into per-interval counts.
//!
//! A sample is taken by the first operation to complete at or after a
//! boundary (one clock read and one relaxed atomic load per operation while
//! a timeline is on; the lock and the engine's snapshot only once per
//! interval), so a boundary's sample lags it by at most the time to the next
//! completion; it is attributed to the last boundary passed. An interval in
//! which nothing completed carries the previous sample (no client work, no
//! client counter moved). The last sample is taken when the run ends, and
//! closes the last (usually partial) interval.

use dmkv_api::Engine;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

/// One sample: the interval boundary it stands for and the totals.
type Sample = (u64, Vec<(&'static str, u64)>);

pub struct EngineSampler {
    start_ns: u64,
    interval_ns: u64,
    /// Absolute time of the next boundary not sampled yet.
    next_ns: AtomicU64,
    samples: Mutex<Vec<Sample>>,
    /// The totals when the run phase ended (before `--verify` reads).
    closing: Mutex<Option<Vec<(&'static str, u64)>>>,
}

impl EngineSampler {
    /// Starts sampling at `start_ns` (the run's start) if a timeline is on
    /// and the engine exports counters.
    pub fn start(engine: &dyn Engine, start_ns: u64, interval_ns: u64) -> Option<EngineSampler> {
        if interval_ns == 0 {
            return None;
        }
        let first = engine.client_counters();
        if first.is_empty() {
            return None;
        }
        Some(EngineSampler {
            start_ns,
            interval_ns,
            next_ns: AtomicU64::new(start_ns.saturating_add(interval_ns)),
            samples: Mutex::new(vec![(0, first)]),
            closing: Mutex::new(None),
        })
    }

    /// After an operation completed at `now_ns`.
    pub fn tick(&self, engine: &dyn Engine, now_ns: u64) {
        if now_ns < self.next_ns.load(Ordering::Relaxed) {
            return;
        }
        let mut samples = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        // Another thread may have sampled this boundary meanwhile.
        if now_ns < self.next_ns.load(Ordering::Relaxed) {
            return;
        }
        let j = now_ns.saturating_sub(self.start_ns) / self.interval_ns;
        samples.push((j, engine.client_counters()));
        self.next_ns.store(
            self.start_ns.saturating_add((j + 1) * self.interval_ns),
            Ordering::Relaxed,
        );
    }

    /// When the run phase has ended: the closing totals.
    pub fn close(&self, engine: &dyn Engine) {
        *self.closing.lock().unwrap_or_else(|p| p.into_inner()) = Some(engine.client_counters());
    }

    /// The per-interval counts of `intervals` intervals (the timeline's
    /// length); the closing totals ([`EngineSampler::close`]) end the last.
    pub fn finish(self, intervals: usize) -> EngineTimeline {
        let mut samples = self.samples.into_inner().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = self.closing.into_inner().unwrap_or_else(|p| p.into_inner()) {
            samples.push((intervals as u64, c));
        }
        EngineTimeline::from_samples(&samples, intervals)
    }
}

/// Counter name to its count in each interval.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct EngineTimeline {
    pub counters: Vec<(&'static str, Vec<u64>)>,
}

impl EngineTimeline {
    /// `samples` in the order taken, each (boundary, totals); the last one
    /// closes interval `intervals - 1`.
    fn from_samples(samples: &[Sample], intervals: usize) -> EngineTimeline {
        let Some((_, first)) = samples.first() else {
            return EngineTimeline::default();
        };
        let names: Vec<&'static str> = first.iter().map(|(n, _)| *n).collect();
        // at[j]: totals at boundary j, for j in 0..=intervals.
        let mut at: Vec<Option<&Vec<(&'static str, u64)>>> = vec![None; intervals + 1];
        let (last, body) = samples.split_last().expect("at least the first");
        for (j, v) in body {
            let j = (*j as usize).min(intervals);
            // The first sample of a boundary is the closest to it.
            at[j].get_or_insert(v);
        }
        at[intervals] = Some(&last.1);
        let mut carried = &first.clone();
        let mut filled: Vec<&Vec<(&'static str, u64)>> = Vec::with_capacity(intervals + 1);
        for a in &at {
            if let Some(v) = a {
                carried = v;
            }
            filled.push(carried);
        }
        let value = |v: &Vec<(&'static str, u64)>, name: &str| {
            v.iter().find(|(n, _)| *n == name).map_or(0, |(_, x)| *x)
        };
        EngineTimeline {
            counters: names
                .iter()
                .map(|&name| {
                    let per: Vec<u64> = filled
                        .windows(2)
                        .map(|w| value(w[1], name).saturating_sub(value(w[0], name)))
                        .collect();
                    (name, per)
                })
                .collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(j: u64, gets: u64, fb: u64) -> Sample {
        (j, vec![("gets", gets), ("fallbacks", fb)])
    }

    #[test]
    fn samples_difference_into_intervals() {
        // Boundaries 0, 1, 3 sampled (2 skipped: carried), 1 sampled twice
        // (the first wins), the run ends in interval 3.
        let t = EngineTimeline::from_samples(
            &[
                s(0, 0, 0),
                s(1, 100, 5),
                s(1, 120, 6),
                s(3, 300, 20),
                s(4, 350, 21),
            ],
            4,
        );
        assert_eq!(
            t.counters,
            vec![
                ("gets", vec![100, 0, 200, 50]),
                ("fallbacks", vec![5, 0, 15, 1])
            ]
        );
    }
}
