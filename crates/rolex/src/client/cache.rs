//! What a compute process caches: the directory (upper levels and every
//! model's low key), and per model its parameters, LT and SLT (§3.3:
//! "compute nodes cache all models and fetch leaf tables as needed").
//! Caches may be stale; every answer is validated against the leaves
//! themselves (docs/rolex.md, invariants 5-7), and staleness found that way
//! triggers a refresh.

use crate::io::{LeafId, Link, Tables, chain, walk_chain};

/// The leaves one GET reads, inline (a GET reads a few leaves: the
/// predicted range and its synonyms), so a GET allocates no list for them.
pub type LeafIds = smallvec::SmallVec<[LeafId; 4]>;
use crate::layout::entry::{RETIRED, unlocked};
use crate::layout::meta::{Directory, ModelRef};
use crate::layout::record::{ModelParams, ModelState};
use parking_lot::{Mutex, RwLock};
// Looked up on every operation: FxHash instead of SipHash (which cost ~200
// instructions per GET). Nothing depends on its iteration order (a sum, and
// a list that no caller orders by).
use rustc_hash::FxHashMap as HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

/// One cached model.
pub struct ModelCache {
    pub m: ModelRef,
    pub p: ModelParams,
    tables: Mutex<CachedTables>,
    /// The record said RETIRED, or a lock CAS found a RETIRED entry.
    pub retired: AtomicBool,
    /// The largest slot_use a read has shown (for counting changes noticed).
    noticed_use: AtomicU64,
}

#[derive(Debug, Clone)]
pub struct CachedTables {
    /// LT words with the lock bit cleared.
    pub lt: Vec<u64>,
    /// SLT words; `slt[0]` is slot_use as last seen.
    pub slt: Vec<u64>,
    pub state: u64,
}

impl ModelCache {
    pub fn new(m: ModelRef, p: ModelParams, t: &Tables) -> ModelCache {
        let mc = ModelCache {
            m,
            p,
            tables: Mutex::new(CachedTables {
                lt: Vec::new(),
                slt: Vec::new(),
                state: 0,
            }),
            retired: AtomicBool::new(false),
            noticed_use: AtomicU64::new(t.slt[0]),
        };
        mc.install(t);
        mc
    }

    /// Replaces the cached tables with freshly read ones.
    pub fn install(&self, t: &Tables) {
        let mut c = self.tables.lock();
        // A RETIRED word stays one (masking its lock bit would make it
        // look like an entry).
        c.lt =
            t.lt.iter()
                .map(|w| if *w == RETIRED { *w } else { unlocked(*w) })
                .collect();
        c.slt = t.slt.clone();
        c.state = t.state;
        if t.state == ModelState::Retired as u64 || t.state == ModelState::Freezing as u64 {
            self.retired.store(true, Ordering::Release);
        }
    }

    pub fn snapshot(&self) -> CachedTables {
        self.tables.lock().clone()
    }

    /// The cached chains of groups `lo..=hi`; `None` if the cache cannot
    /// produce one (a retired entry or an impossible pointer: refresh).
    pub fn chains(&self, lo: usize, hi: usize) -> Option<Vec<Vec<Link>>> {
        let c = self.tables.lock();
        (lo..=hi)
            .map(|j| chain(*c.lt.get(j)?, &c.slt).ok())
            .collect()
    }

    /// The leaves of the cached chains of groups `lo..=hi`, in the order
    /// [`ModelCache::chains`] lists them, into `out`; false (and `out`
    /// unspecified) where `chains` gives `None`.
    pub fn chain_leaves(&self, lo: usize, hi: usize, out: &mut LeafIds) -> bool {
        out.clear();
        let c = self.tables.lock();
        (lo..=hi).all(|j| {
            c.lt.get(j)
                .is_some_and(|&w| walk_chain(w, &c.slt, |l| out.push(l.entry.into())).is_ok())
        })
    }

    pub fn lt(&self, j: usize) -> u64 {
        self.tables.lock().lt[j]
    }

    /// Records slot_use as read; true if it is news (new synonym leaves
    /// this cache has not seen).
    pub fn note_slot_use(&self, seen: u64) -> bool {
        seen > self.noticed_use.fetch_max(seen, Ordering::AcqRel)
    }

    pub fn slot_use(&self) -> u64 {
        self.tables.lock().slt[0]
    }

    /// Records what this process itself wrote (it holds the lock).
    pub fn set_lt(&self, j: usize, w: u64) {
        self.tables.lock().lt[j] = if w == RETIRED { w } else { unlocked(w) };
    }

    pub fn set_slt(&self, s: usize, w: u64) {
        let mut c = self.tables.lock();
        if s < c.slt.len() {
            c.slt[s] = w;
            if c.slt[0] <= s as u64 {
                c.slt[0] = s as u64 + 1;
            }
        }
    }

    pub fn bytes(&self) -> u64 {
        let c = self.tables.lock();
        (std::mem::size_of::<ModelParams>() + 8 * (c.lt.len() + c.slt.len())) as u64
    }
}

/// The directory and the model caches of a compute process.
pub struct Caches {
    dir: RwLock<Arc<Directory>>,
    models: RwLock<HashMap<ModelRef, Arc<ModelCache>>>,
}

impl Caches {
    pub fn new(dir: Directory) -> Caches {
        Caches {
            dir: RwLock::new(Arc::new(dir)),
            models: RwLock::new(HashMap::default()),
        }
    }

    pub fn dir(&self) -> Arc<Directory> {
        self.dir.read().clone()
    }

    /// Installs a newer directory and forgets models it no longer lists.
    pub fn set_dir(&self, d: Directory) -> bool {
        let mut cur = self.dir.write();
        if d.version <= cur.version {
            return false;
        }
        let live: std::collections::HashSet<ModelRef> = d.refs.iter().copied().collect();
        self.models.write().retain(|m, _| live.contains(m));
        *cur = Arc::new(d);
        true
    }

    pub fn model(&self, m: ModelRef) -> Option<Arc<ModelCache>> {
        self.models.read().get(&m).cloned()
    }

    pub fn insert(&self, mc: ModelCache) -> Arc<ModelCache> {
        let mc = Arc::new(mc);
        self.models.write().insert(mc.m, mc.clone());
        mc
    }

    pub fn missing(&self) -> Vec<ModelRef> {
        let d = self.dir();
        let models = self.models.read();
        d.refs
            .iter()
            .filter(|m| !models.contains_key(m))
            .copied()
            .collect()
    }

    pub fn bytes(&self) -> u64 {
        let d = self.dir();
        let dir_bytes = 16 * d.lows.len() as u64
            + d.upper
                .levels
                .iter()
                .map(|l| 32 * l.len() as u64)
                .sum::<u64>();
        dir_bytes + self.models.read().values().map(|m| m.bytes()).sum::<u64>()
    }

    pub fn models(&self) -> Vec<Arc<ModelCache>> {
        self.models.read().values().cloned().collect()
    }
}
