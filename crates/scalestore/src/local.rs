//! `btree-local`: the same B-tree over the same guards on plain local memory
//! (paper §6.7.1's single-node in-memory baseline). A page id is an index
//! into lazily allocated chunks of pages; there is no translation table, no
//! ownership, no directory and no messages, so `scalestore` against
//! `btree-local` on one node measures the cost of the distribution layer.

use crate::btree::{self, BTree, MAX_VALUE_LEN, WriteKind};
use crate::guard::{Fixed, Mode, PageError, PageResult, Pager};
use crate::latch::HybridLatch;
use crate::page::{PAGE_SIZE, PageRef};
use crate::pid::Pid;
use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvError, KvStore, Result,
    ServeArgs, Topology,
};
use dmkv_memnode::NodeRuntime;
use dmkv_transport::{Endpoint, NodeId, RegionMem};
use std::rc::Rc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, OnceLock};

/// Pages per chunk (4 MiB).
const CHUNK_PAGES: u64 = 1024;
/// Chunks the pager can grow to (64 GiB).
const MAX_CHUNKS: usize = 16 * 1024;

struct Chunk {
    mem: RegionMem,
    latches: Box<[HybridLatch]>,
}

/// Pages in plain memory; see the module documentation.
pub struct LocalPager {
    chunks: Box<[OnceLock<Chunk>]>,
    next: AtomicU64,
    restarts: AtomicU64,
}

impl Default for LocalPager {
    fn default() -> Self {
        Self::new()
    }
}

impl LocalPager {
    /// A pager holding an empty tree (catalog page 0, root leaf page 1).
    pub fn new() -> LocalPager {
        let p = LocalPager {
            chunks: (0..MAX_CHUNKS).map(|_| OnceLock::new()).collect(),
            next: AtomicU64::new(0),
            restarts: AtomicU64::new(0),
        };
        let cat = p.grab().expect("the first page");
        let root = p.grab().expect("the second page");
        btree::init_pages(&p.page(cat as u32), &p.page(root as u32), Pid::new(0, root));
        p
    }

    fn chunk(&self, index: u64) -> Option<&Chunk> {
        self.chunks.get((index / CHUNK_PAGES) as usize)?.get()
    }

    /// A new page index, its chunk allocated.
    fn grab(&self) -> std::result::Result<u64, KvError> {
        let i = self.next.fetch_add(1, Ordering::Relaxed);
        let c = self.chunks.get((i / CHUNK_PAGES) as usize).ok_or_else(|| {
            KvError::Exhausted(format!(
                "btree-local holds at most {} pages",
                MAX_CHUNKS as u64 * CHUNK_PAGES
            ))
        })?;
        c.get_or_init(|| Chunk {
            mem: RegionMem::zeroed(CHUNK_PAGES as usize * PAGE_SIZE)
                .expect("allocate a page chunk"),
            latches: (0..CHUNK_PAGES).map(|_| HybridLatch::new()).collect(),
        });
        Ok(i)
    }

    pub fn pages(&self) -> u64 {
        self.next.load(Ordering::Relaxed)
    }

    pub fn restarts(&self) -> u64 {
        self.restarts.load(Ordering::Relaxed)
    }

    /// Simulated compute CPU (`touch_local_at`): the page count and the
    /// chunk's pointer are the two words this reads (the latch is counted
    /// by the latch), each a line once per operation.
    fn index(&self, pid: Pid) -> PageResult<u64> {
        dmkv_transport::touch_local_at(&self.next);
        let i = pid.slot();
        if let Some(slot) = self.chunks.get((i / CHUNK_PAGES) as usize) {
            dmkv_transport::touch_local_at(slot);
        }
        if pid.shard() != 0 || i >= self.next.load(Ordering::Acquire) || self.chunk(i).is_none() {
            return Err(PageError::Fatal(KvError::Corrupt(format!("no page {pid}"))));
        }
        Ok(i)
    }
}

impl Pager for LocalPager {
    fn latch(&self, frame: u32) -> &HybridLatch {
        let c = self.chunk(frame as u64).expect("a fixed page's chunk");
        &c.latches[(frame as u64 % CHUNK_PAGES) as usize]
    }

    fn page(&self, slot: u32) -> PageRef<'_> {
        let c = self.chunk(slot as u64).expect("a fixed page's chunk");
        PageRef::new(&c.mem, (slot as u64 % CHUNK_PAGES) * PAGE_SIZE as u64)
    }

    async fn fix(&self, pid: Pid, mode: Mode) -> PageResult<Fixed> {
        let i = self.index(pid)?;
        let latch = self.latch(i as u32);
        let mut version = 0;
        match mode {
            Mode::Optimistic => {
                latch
                    .wait_until(|| match latch.optimistic() {
                        Some(v) => {
                            version = v;
                            true
                        }
                        None => false,
                    })
                    .await
            }
            Mode::Shared => latch.wait_until(|| latch.try_shared()).await,
            Mode::Exclusive => latch.wait_until(|| latch.try_exclusive()).await,
        }
        Ok(Fixed {
            pid,
            frame: i as u32,
            slot: i as u32,
            version,
            fresh: false,
        })
    }

    async fn allocate(&self) -> PageResult<Fixed> {
        let i = self.grab()?;
        let latch = self.latch(i as u32);
        assert!(latch.try_exclusive(), "a new page is unlatched");
        Ok(Fixed {
            pid: Pid::new(0, i),
            frame: i as u32,
            slot: i as u32,
            version: 0,
            fresh: false,
        })
    }

    fn try_upgrade_exclusive(&self, f: &Fixed) -> bool {
        self.latch(f.frame)
            .try_upgrade_optimistic_to_exclusive(f.version)
    }

    fn catalog(&self) -> Pid {
        Pid::new(0, 0)
    }

    fn note_restart(&self) {
        self.restarts.fetch_add(1, Ordering::Relaxed);
    }
}

/// The spec of `btree-local`.
pub struct BTreeLocalSpec;

/// The engine spec registered as `btree-local`.
pub static BTREE_LOCAL: BTreeLocalSpec = BTreeLocalSpec;

const CAPS: Capabilities = Capabilities {
    scan: true,
    max_value_len: MAX_VALUE_LEN,
    reserved_keys: &[],
    reserved_why: "",
};

impl EngineSpec for BTreeLocalSpec {
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn name(&self) -> &'static str {
        "btree-local"
    }
    fn about(&self) -> &'static str {
        "ScaleStore's B-tree and guards on plain local memory (no distribution layer)"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        &[]
    }
    fn topology(&self) -> Topology {
        Topology::Symmetric
    }
    fn serve(&self, _rt: &Arc<NodeRuntime>, _args: &ServeArgs) -> Result<()> {
        // The tree lives in the compute process; nodes serve nothing.
        Ok(())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let home = NodeId(
            *args
                .serve
                .nodes
                .first()
                .ok_or_else(|| KvError::Config("btree-local needs a node".into()))?,
        );
        Ok(Arc::new(BTreeLocalEngine {
            pager: Arc::new(LocalPager::new()),
            home,
        }))
    }
}

struct BTreeLocalEngine {
    pager: Arc<LocalPager>,
    home: NodeId,
}

#[async_trait(?Send)]
impl Engine for BTreeLocalEngine {
    fn name(&self) -> &'static str {
        "btree-local"
    }
    fn capabilities(&self) -> Capabilities {
        CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.home
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(LocalClient {
            pager: self.pager.clone(),
            ep,
        }))
    }
    async fn load(&self, _ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        let t = BTree::new(&*self.pager);
        for (k, v) in pairs {
            t.write(WriteKind::Upsert, *k, v).await?;
        }
        Ok(())
    }
    async fn stats(&self, _ep: &Endpoint) -> Result<serde_json::Value> {
        Ok(serde_json::json!({
            "pages": self.pager.pages(),
            "restarts": self.pager.restarts(),
        }))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}

/// Every operation runs under `Endpoint::charged`, as ScaleStore's client
/// does: on `sim` the tree walk's lines (page words, latch words, the
/// pager's own words) cost the thread's core; elsewhere nothing changes.
struct LocalClient {
    pager: Arc<LocalPager>,
    ep: Rc<Endpoint>,
}

#[async_trait(?Send)]
impl KvStore for LocalClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        self.ep.charged(BTree::new(&*self.pager).lookup(key)).await
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.ep
            .charged(BTree::new(&*self.pager).write(WriteKind::Insert, key, value))
            .await
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.ep
            .charged(BTree::new(&*self.pager).write(WriteKind::Update, key, value))
            .await
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.ep
            .charged(BTree::new(&*self.pager).write(WriteKind::Upsert, key, value))
            .await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        self.ep
            .charged(BTree::new(&*self.pager).write(WriteKind::Delete, key, &[]))
            .await
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        self.ep
            .charged(BTree::new(&*self.pager).scan(start, n))
            .await
    }
}
