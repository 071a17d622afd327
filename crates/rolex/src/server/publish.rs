//! Shadow redirection (§3.5): new model records are written where nobody
//! looks yet, then a new directory image is written into the idle image slot
//! and the root word is switched to it. Compute nodes read the root and the
//! image when they notice a retired model.

use super::Server;
use crate::layout::meta::{Directory, ModelRef, W_ROOT, root_word};
use crate::remote::MODEL_BASE;
use crate::upper::UpperIndex;

/// The published directory and the model-region allocators.
pub struct DirState {
    pub version: u64,
    pub lows: Vec<u64>,
    pub refs: Vec<ModelRef>,
    /// Next free byte of each node's model region. Records are never freed:
    /// a compute node with a stale cache may still CAS an old LT entry, and
    /// must find `RETIRED` there, not somebody else's lock.
    pub bump: Vec<u64>,
}

impl DirState {
    pub fn new(nodes: usize) -> DirState {
        DirState {
            version: 0,
            lows: Vec::new(),
            refs: Vec::new(),
            bump: vec![MODEL_BASE; nodes],
        }
    }

    /// Reserves `words` words in node `node`'s model region.
    pub fn alloc_record(&mut self, node: usize, words: usize, capacity: u64) -> Option<u64> {
        let at = self.bump[node];
        let end = at.checked_add(words as u64 * 8)?;
        if end > capacity {
            return None;
        }
        self.bump[node] = end;
        Some(at)
    }
}

impl Server {
    /// Publishes a directory of models `lows`/`refs` (sorted by low key).
    pub(crate) fn publish(
        &self,
        st: &mut DirState,
        lows: Vec<u64>,
        refs: Vec<ModelRef>,
    ) -> Result<(), String> {
        if lows.len() > self.cfg.max_models {
            return Err(format!(
                "{} models exceed the directory's {} (raise rolex.max_models)",
                lows.len(),
                self.cfg.max_models
            ));
        }
        let dir = Directory {
            version: st.version + 1,
            upper: UpperIndex::build(&lows, self.cfg.upper_epsilon),
            lows,
            refs,
        };
        let words = dir.encode();
        if words.len() > self.meta_layout.dir_slot_words {
            return Err("the directory image outgrew its slot (raise rolex.max_models)".into());
        }
        // Back version first, body, front version last (readers check both).
        let base = self.meta_layout.dir_slot(dir.version) as u64 * 8;
        let last = words.len() - 1;
        let store = |i: usize| {
            self.meta
                .store_u64(base + i as u64 * 8, words[i])
                .expect("directory slot")
        };
        store(last);
        (1..last).for_each(store);
        store(0);
        self.meta
            .store_u64(
                W_ROOT as u64 * 8,
                root_word(dir.version as u32, words.len() as u32),
            )
            .expect("root word");
        st.version = dir.version;
        st.lows = dir.lows;
        st.refs = dir.refs;
        Ok(())
    }
}
