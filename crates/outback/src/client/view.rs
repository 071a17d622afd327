//! The compute-heavy half of the index that a compute node holds per shard
//! (paper §4.2): the directory, and per table its Othello bucket locator
//! and seeds. Everything here is computed locally; nothing is remote.

use crate::hash::{candidates, dir, slot};
use crate::othello::Othello;
use crate::publish::TableDesc;
use dmkv_transport::NodeId;
use std::sync::Arc;
use std::sync::atomic::{AtomicU8, Ordering};

/// One table's locator. Seeds are updated in place as replies bring newer
/// ones (lazy learning, paper §4.3.2).
pub struct TableView {
    pub desc: TableDesc,
    pub othello: Arc<Othello>,
    pub seeds: Arc<Vec<AtomicU8>>,
}

impl TableView {
    /// The bucket the locator assigns `key` (two hashes, two bits).
    #[inline]
    pub fn bucket(&self, key: u64) -> u32 {
        let c = candidates(key, self.desc.bucket_seed, self.desc.buckets);
        c[self.othello.lookup(key) as usize]
    }

    #[inline]
    pub fn seed(&self, bucket: u32) -> u8 {
        self.seeds[bucket as usize].load(Ordering::Relaxed)
    }

    pub fn learn_seed(&self, bucket: u32, seed: u8) {
        self.seeds[bucket as usize].store(seed, Ordering::Relaxed);
    }

    /// (bucket, slot) of `key` with the seed known here.
    #[inline]
    pub fn locate(&self, key: u64) -> (u32, u8, u8) {
        let b = self.bucket(key);
        let s = self.seed(b);
        (b, slot(key, s) as u8, s)
    }

    /// Bytes this locator takes: the two bit arrays and one byte per bucket.
    pub fn bytes(&self) -> u64 {
        self.othello.bytes() + self.seeds.len() as u64
    }
}

/// A shard as one compute node sees it.
pub struct ShardView {
    pub shard: u16,
    /// The node serving the shard (the primary, or the node that took over).
    pub owner: NodeId,
    /// Publication this view came from.
    pub version: u64,
    /// This compute node's id at the owner (for PRE_RESIZE and countdowns).
    pub compute: u32,
    pub global_depth: u8,
    pub dir: Vec<u32>,
    /// The live tables, sorted by id (a binary search over a handful of
    /// entries: the GET path finds its table without hashing; ids grow with
    /// every rebuild, so they are not dense enough to index by).
    pub tables: Vec<(u32, Arc<TableView>)>,
}

impl ShardView {
    /// The table holding `key` (extendible hashing on the directory hash).
    #[inline]
    pub fn table_for(&self, key: u64) -> &Arc<TableView> {
        let mask = (1u64 << self.global_depth) - 1;
        let id = self.dir[(dir(key) & mask) as usize];
        self.table(id)
            .expect("a published directory names only published tables")
    }

    /// The table with id `id`, if this view has it.
    #[inline]
    pub fn table(&self, id: u32) -> Option<&Arc<TableView>> {
        self.tables
            .binary_search_by_key(&id, |(i, _)| *i)
            .ok()
            .map(|at| &self.tables[at].1)
    }

    /// `(id, table)` pairs sorted by id, as [`ShardView::tables`] keeps them.
    pub fn sort_tables(mut tables: Vec<(u32, Arc<TableView>)>) -> Vec<(u32, Arc<TableView>)> {
        tables.sort_by_key(|(id, _)| *id);
        tables
    }

    pub fn bytes(&self) -> u64 {
        self.tables.iter().map(|(_, t)| t.bytes()).sum::<u64>() + self.dir.len() as u64 * 4
    }
}
