//! What a thread accumulates during a run: per operation type a count, the
//! exact costs and a latency histogram; errors; check findings.

use crate::check::{Findings, MAX_SAMPLES};
use crate::workload::OpType;
use dmkv_transport::Counters;
use hdrhistogram::Histogram;

/// Latencies are recorded in nanoseconds, from 1 ns to an hour, with three
/// significant digits.
pub fn new_histogram() -> Histogram<u64> {
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// One operation type's figures.
#[derive(Debug, Clone)]
pub struct OpFigures {
    pub count: u64,
    pub cost: Counters,
    /// Nanoseconds.
    pub latency: Histogram<u64>,
}

impl Default for OpFigures {
    fn default() -> Self {
        OpFigures {
            count: 0,
            cost: Counters::default(),
            latency: new_histogram(),
        }
    }
}

/// Operation errors (transport failures, refusals): not results.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Errors {
    pub by_op: [u64; OpType::COUNT],
    /// Errors outside operations: making a client, a panic in a thread.
    pub other: u64,
    pub samples: Vec<String>,
}

impl Errors {
    pub fn push_other(&mut self, msg: String) {
        self.other += 1;
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push(msg);
        }
    }
    pub fn push(&mut self, op: OpType, key: u64, error: &dyn std::fmt::Display) {
        self.by_op[op.index()] += 1;
        if self.samples.len() < MAX_SAMPLES {
            self.samples
                .push(format!("{} of key {key}: {error}", op.name()));
        }
    }
    pub fn total(&self) -> u64 {
        self.by_op.iter().sum::<u64>() + self.other
    }
    pub fn merge(&mut self, o: &Errors) {
        self.other += o.other;
        for (a, b) in self.by_op.iter_mut().zip(o.by_op) {
            *a += b;
        }
        for s in &o.samples {
            if self.samples.len() < MAX_SAMPLES {
                self.samples.push(s.clone());
            }
        }
    }
}

/// A thread's (or, merged, the run's) figures.
///
/// Each operation's latency is recorded once, in its type's histogram; the
/// run's histogram over all types is their sum, made when asked for
/// ([`RunFigures::overall`]): the same counts as recording every latency
/// twice, for one histogram update per operation instead of two.
#[derive(Debug, Clone, Default)]
pub struct RunFigures {
    pub by_op: [OpFigures; OpType::COUNT],
    pub errors: Errors,
    pub findings: Findings,
    pub timeline: Timeline,
}

/// Operations completed per interval of the run (`--timeline-ms`), by the
/// runtime's clock (virtual time under `sim`): `counts[i]` holds those
/// completed in `[start + i * interval, start + (i + 1) * interval)`.
/// Off (nothing recorded, no clock read) while `interval_ns` is 0.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Timeline {
    pub start_ns: u64,
    pub interval_ns: u64,
    pub counts: Vec<u64>,
    /// The window in which every thread merged in was running (branch
    /// i84): for one thread, its first and its last completion; merged,
    /// the latest first completion and the earliest last one (`from >
    /// to`: the threads never all ran at once). `None` before any
    /// completion.
    pub all_running: Option<(u64, u64)>,
}

impl Timeline {
    pub fn new(start_ns: u64, interval_ns: u64) -> Timeline {
        Timeline {
            start_ns,
            interval_ns,
            counts: Vec::new(),
            all_running: None,
        }
    }

    /// Counts one completion at `now_ns` (the vector grows by whole
    /// intervals, so steady state allocates nothing).
    pub fn note(&mut self, now_ns: u64) {
        if self.interval_ns == 0 {
            return;
        }
        let i = (now_ns.saturating_sub(self.start_ns) / self.interval_ns) as usize;
        if i >= self.counts.len() {
            self.counts.resize(i + 1, 0);
        }
        self.counts[i] += 1;
        let first = self.all_running.map_or(now_ns, |(first, _)| first);
        self.all_running = Some((first, now_ns));
    }

    /// Adds another thread's counts, interval by interval (threads of one
    /// run share the interval and, to within a barrier, the start).
    pub fn merge(&mut self, o: &Timeline) {
        if o.interval_ns == 0 {
            return;
        }
        if self.interval_ns == 0 {
            *self = o.clone();
            return;
        }
        if o.counts.len() > self.counts.len() {
            self.counts.resize(o.counts.len(), 0);
        }
        for (a, b) in self.counts.iter_mut().zip(&o.counts) {
            *a += b;
        }
        self.all_running = match (self.all_running, o.all_running) {
            (Some((f1, l1)), Some((f2, l2))) => Some((f1.max(f2), l1.min(l2))),
            (a, b) => a.or(b),
        };
    }
}

impl RunFigures {
    /// Figures that also count completions per `interval_ns` from `start_ns`
    /// (0: no timeline).
    pub fn with_timeline(start_ns: u64, interval_ns: u64) -> RunFigures {
        RunFigures {
            timeline: Timeline::new(start_ns, interval_ns),
            ..RunFigures::default()
        }
    }

    /// Records one completed operation, its latency in nanoseconds (taken
    /// as 1 if 0: the histogram's lowest value).
    /// (Its cost is added apart, [`RunFigures::add_costs`].)
    #[inline]
    pub fn record(&mut self, op: OpType, latency_ns: u64) {
        if self.timeline.interval_ns > 0 {
            self.timeline
                .note(dmkv_transport::time::Instant::now().as_nanos());
        }
        let ns = latency_ns.max(1);
        let f = &mut self.by_op[op.index()];
        f.count += 1;
        f.latency.saturating_record(ns);
    }

    /// Latencies of all operation types together.
    pub fn overall(&self) -> Histogram<u64> {
        let mut all = new_histogram();
        for f in &self.by_op {
            all.add(&f.latency).expect("histograms share bounds");
        }
        all
    }

    /// Adds costs per operation type ([`OpType::index`]) to the figures'.
    pub fn add_costs(&mut self, costs: &[Counters; OpType::COUNT]) {
        for (f, c) in self.by_op.iter_mut().zip(costs) {
            f.cost += *c;
        }
    }

    pub fn ops(&self) -> u64 {
        self.by_op.iter().map(|f| f.count).sum()
    }

    pub fn cost(&self) -> Counters {
        self.by_op
            .iter()
            .fold(Counters::default(), |acc, f| acc + f.cost)
    }

    pub fn merge(&mut self, o: &RunFigures) {
        for (a, b) in self.by_op.iter_mut().zip(&o.by_op) {
            a.count += b.count;
            a.cost += b.cost;
            a.latency.add(&b.latency).expect("histograms share bounds");
        }
        self.errors.merge(&o.errors);
        self.findings.merge(&o.findings);
        self.timeline.merge(&o.timeline);
    }
}

/// What `--verify` found.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VerifyFigures {
    /// Keys read back.
    pub checked: u64,
    /// Keys whose value was wrong (corrupt or a version never written).
    pub mismatches: u64,
    /// Keys that should exist and were not found.
    pub missing: u64,
    /// Keys that should not exist and were found.
    pub unexpected: u64,
    /// Keys not checked because an earlier error left their existence
    /// unknown.
    pub skipped: u64,
    /// Reads that failed with an error.
    pub errors: u64,
    pub samples: Vec<String>,
}

impl VerifyFigures {
    pub fn note(&mut self, msg: impl FnOnce() -> String) {
        if self.samples.len() < MAX_SAMPLES {
            self.samples.push(msg());
        }
    }

    pub fn failures(&self) -> u64 {
        self.mismatches + self.missing + self.unexpected + self.errors
    }

    pub fn merge(&mut self, o: &VerifyFigures) {
        self.checked += o.checked;
        self.mismatches += o.mismatches;
        self.missing += o.missing;
        self.unexpected += o.unexpected;
        self.skipped += o.skipped;
        self.errors += o.errors;
        for s in &o.samples {
            if self.samples.len() < MAX_SAMPLES {
                self.samples.push(s.clone());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn overall_latency_is_every_recorded_latency_once() {
        let mut f = RunFigures::default();
        let mut g = RunFigures::default();
        let mut reference = new_histogram();
        for (n, ty) in [(1u64, OpType::Read), (7, OpType::Update), (3, OpType::Read)]
            .into_iter()
            .cycle()
            .take(300)
            .enumerate()
            .map(|(i, (n, ty))| (n * 1000 + i as u64, ty))
        {
            let target = if n % 2 == 0 { &mut f } else { &mut g };
            target.record(ty, n);
            reference.record(n).unwrap();
        }
        f.merge(&g);
        let all = f.overall();
        assert_eq!(all.len(), 300);
        assert_eq!(all, reference);
        assert_eq!(all.max(), reference.max());
        assert_eq!(all.value_at_quantile(0.5), reference.value_at_quantile(0.5));
        assert_eq!(f.by_op[OpType::Read.index()].latency.len(), 200);
    }
}
