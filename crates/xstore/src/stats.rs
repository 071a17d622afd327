//! Client-side figures (shared by a compute process's threads).

use serde_json::json;
use std::sync::atomic::{AtomicU64, Ordering};

/// Why a read went to the server.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackCause {
    /// A TT entry the client had invalidated (Fig. 7, line 9).
    InvalidEntry,
    /// A leaf's incarnation differed from its TT entry and speculation did
    /// not find the key (Fig. 7, line 17).
    Incarnation,
    /// The fetched leaves could not show the key absent (or where a scan
    /// starts) even after extending them.
    Coverage,
    /// A leaf was read torn or locked too many times in a row.
    Torn,
    /// The model could not be fetched consistently (a generation changing
    /// under the reader, a sub-model without a TT).
    Model,
    /// A scan met a stale leaf or a broken chain of leaves.
    ScanChain,
    /// The prediction spanned more than `xstore.max_leaves` leaves.
    WidePrediction,
}

impl FallbackCause {
    pub const ALL: [FallbackCause; 7] = [
        FallbackCause::InvalidEntry,
        FallbackCause::Incarnation,
        FallbackCause::Coverage,
        FallbackCause::Torn,
        FallbackCause::Model,
        FallbackCause::ScanChain,
        FallbackCause::WidePrediction,
    ];
    pub fn name(self) -> &'static str {
        match self {
            FallbackCause::InvalidEntry => "invalid_entry",
            FallbackCause::Incarnation => "incarnation_mismatch",
            FallbackCause::Coverage => "coverage",
            FallbackCause::Torn => "torn",
            FallbackCause::Model => "model",
            FallbackCause::ScanChain => "scan_chain",
            FallbackCause::WidePrediction => "wide_prediction",
        }
    }
}

#[derive(Default)]
pub struct ClientStats {
    pub gets: AtomicU64,
    pub scans: AtomicU64,
    pub lookups: AtomicU64,
    pub leaves_read: AtomicU64,
    /// Lookups by the leaves their first prediction spans (`e - s + 1`):
    /// 1, 2, 3, 4, 5 or more (wide predictions that fall back included).
    pub predicted_span: [AtomicU64; 5],
    pub leaf_batches: AtomicU64,
    /// Leaf reads that took more than one batch (`batch_limit`).
    pub multi_batch_reads: AtomicU64,
    pub coverage_extensions: AtomicU64,
    pub torn_retries: AtomicU64,
    pub value_retries: AtomicU64,
    pub speculations: AtomicU64,
    pub speculative_hits: AtomicU64,
    /// Keys found in a split leaf itself (no sibling read needed).
    pub found_in_split_leaf: AtomicU64,
    pub fallbacks: [AtomicU64; 7],
    pub header_reads: AtomicU64,
    pub record_reads: AtomicU64,
    pub tt_reads: AtomicU64,
    pub generations_installed: AtomicU64,
    pub submodels_installed: AtomicU64,
    pub hints_sent: AtomicU64,
    /// Leaves named by the hints sent (TT entries, at most
    /// `MAX_HINT_LEAVES` per hint).
    pub hint_leaves: AtomicU64,
    pub hints_used: AtomicU64,
    pub scan_leaves: AtomicU64,
    pub scan_rounds: AtomicU64,
    /// Scans that went on into the next partition within a batch (§5.5).
    pub scan_partition_crossings: AtomicU64,
}

impl ClientStats {
    pub fn fallback(&self, c: FallbackCause) {
        let i = FallbackCause::ALL
            .iter()
            .position(|x| *x == c)
            .expect("listed");
        self.fallbacks[i].fetch_add(1, Ordering::Relaxed);
    }

    pub fn bump(a: &AtomicU64) {
        a.fetch_add(1, Ordering::Relaxed);
    }

    /// Running totals for per-interval timelines (`Engine::client_counters`):
    /// GETs; fallbacks (reads the cache could not serve: the server looked
    /// the key up); speculations (lookups that met a leaf split since the
    /// client cached its TT entry, which they invalidated, §5.3.2) and how
    /// many of those the speculative sibling read still served;
    /// invalid-entry fallbacks (the entry had been invalidated before).
    pub fn counters(&self) -> Vec<(&'static str, u64)> {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let cause = |c: FallbackCause| {
            let i = FallbackCause::ALL
                .iter()
                .position(|x| *x == c)
                .expect("listed");
            ld(&self.fallbacks[i])
        };
        vec![
            ("gets", ld(&self.gets)),
            ("fallbacks", self.fallbacks.iter().map(ld).sum()),
            ("speculations", ld(&self.speculations)),
            ("speculative_hits", ld(&self.speculative_hits)),
            ("incarnation_fallbacks", cause(FallbackCause::Incarnation)),
            (
                "invalid_entry_fallbacks",
                cause(FallbackCause::InvalidEntry),
            ),
        ]
    }

    pub fn json(&self) -> serde_json::Value {
        let ld = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let lookups = ld(&self.lookups);
        let fallbacks: u64 = self.fallbacks.iter().map(ld).sum();
        let reads = ld(&self.gets) + ld(&self.scans);
        let mut by_cause = serde_json::Map::new();
        for (i, c) in FallbackCause::ALL.iter().enumerate() {
            by_cause.insert(c.name().into(), ld(&self.fallbacks[i]).into());
        }
        json!({
            "gets": ld(&self.gets),
            "scans": ld(&self.scans),
            "lookups": lookups,
            "leaves_read_per_lookup": if lookups == 0 { 0.0 } else { ld(&self.leaves_read) as f64 / lookups as f64 },
            "predicted_leaves": {
                "1": ld(&self.predicted_span[0]),
                "2": ld(&self.predicted_span[1]),
                "3": ld(&self.predicted_span[2]),
                "4": ld(&self.predicted_span[3]),
                "5+": ld(&self.predicted_span[4]),
            },
            "leaf_batches": ld(&self.leaf_batches),
            "multi_batch_reads": ld(&self.multi_batch_reads),
            "coverage_extensions": ld(&self.coverage_extensions),
            "torn_retries": ld(&self.torn_retries),
            "value_retries": ld(&self.value_retries),
            "fallbacks": fallbacks,
            "fallback_rate": if reads == 0 { 0.0 } else { fallbacks as f64 / reads as f64 },
            "fallbacks_by_cause": by_cause,
            "speculations": ld(&self.speculations),
            "speculative_hits": ld(&self.speculative_hits),
            "found_in_split_leaf": ld(&self.found_in_split_leaf),
            "model_fetches": {
                "header": ld(&self.header_reads),
                "record": ld(&self.record_reads),
                "tt": ld(&self.tt_reads),
                "generations_installed": ld(&self.generations_installed),
                "submodels_installed": ld(&self.submodels_installed),
            },
            "update_hints": {
                "sent": ld(&self.hints_sent),
                "leaves": ld(&self.hint_leaves),
                "used": ld(&self.hints_used),
            },
            "scan_leaves": ld(&self.scan_leaves),
            "scan_rounds": ld(&self.scan_rounds),
            "scan_partition_crossings": ld(&self.scan_partition_crossings),
        })
    }
}
