//! Engines for testing the harness: the reference engine, a wrapper that
//! breaks it in chosen ways, and a naive one-sided store that does not
//! validate what it reads.

use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvError, KvStore, Result,
    ServeArgs,
};
use dmkv_bench::{BenchConfig, EngineChoice, Workload, WorkloadSource};
use dmkv_memnode::NodeRuntime;
use dmkv_testkit::reference::Reference;
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, NodeId, RemoteRegion};
use std::cell::Cell;
use std::rc::Rc;
use std::sync::Arc;

pub fn choice(spec: &'static dyn EngineSpec) -> EngineChoice {
    EngineChoice {
        spec,
        knobs: Default::default(),
    }
}

pub fn reference() -> EngineChoice {
    choice(&Reference)
}

/// Runs `cfg` on the simulated cluster: `profile`, seed 1, no jitter or
/// delays, one compute node of `cfg.threads` threads.
#[allow(dead_code)] // `runner.rs` runs on `local` only
pub fn on_sim(cfg: &mut BenchConfig, profile: dmkv_transport::sim::Profile) {
    cfg.deployer = Arc::new(dmkv_bench::SimDeployer {
        options: dmkv_api::sim_deploy::SimOptions {
            config: dmkv_transport::sim::SimConfig {
                profile,
                seed: 1,
                jitter_ns: 0,
                delays: Default::default(),
            },
            compute_nodes: 1,
            threads_per_node: cfg.threads,
        },
    });
}

/// Keys and operations of [`small`] runs.
pub const KEYS: u64 = 1_000;
pub const OPS: u64 = 2_000;

/// A small, quick configuration of `workload` on `engines`.
pub fn small(engines: Vec<EngineChoice>, workload: Workload) -> BenchConfig {
    let mut cfg = BenchConfig::new(engines);
    cfg.workload = WorkloadSource::Synthetic(workload);
    cfg.keys = KEYS;
    cfg.ops = OPS;
    cfg.threads = 2;
    cfg.tasks = 4;
    cfg.verify = true;
    cfg
}

/// Ways to break the reference engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// No fault: a second engine that behaves like the reference.
    None,
    /// Every n-th get returns its value with one byte flipped.
    CorruptEveryNthGet(u64),
    /// Every n-th get returns the value of the next key up.
    WrongKeyEveryNthGet(u64),
    /// The load silently skips the first pair of every chunk.
    DropFirstLoadedPairPerChunk,
    /// Every n-th insert says it inserted but stores nothing.
    DropEveryNthInsert(u64),
    /// Every n-th delete says it deleted but deletes nothing.
    IgnoreEveryNthDelete(u64),
    /// Scans leave out their second pair.
    ScanSkipsSecondPair,
    /// Every n-th update reports that the key is missing (and does nothing).
    RefuseEveryNthUpdate(u64),
}

/// The reference engine with a fault.
pub struct Faulty {
    pub name: &'static str,
    pub fault: Fault,
}

impl Faulty {
    pub fn leak(name: &'static str, fault: Fault) -> &'static Faulty {
        Box::leak(Box::new(Faulty { name, fault }))
    }
}

impl EngineSpec for Faulty {
    fn capabilities(&self) -> Capabilities {
        Reference.capabilities()
    }
    fn name(&self) -> &'static str {
        self.name
    }
    fn about(&self) -> &'static str {
        "the reference engine, broken on purpose"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        &[]
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        Reference.serve(rt, args)
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(FaultyEngine {
            name: self.name,
            fault: self.fault,
            inner: Reference.connect(args)?,
        }))
    }
}

struct FaultyEngine {
    name: &'static str,
    fault: Fault,
    inner: Arc<dyn Engine>,
}

#[async_trait(?Send)]
impl Engine for FaultyEngine {
    fn name(&self) -> &'static str {
        self.name
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn home_node(&self, thread: usize) -> NodeId {
        self.inner.home_node(thread)
    }
    async fn client(&self, ep: Rc<Endpoint>, thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(FaultyClient {
            fault: self.fault,
            inner: self.inner.client(ep, thread).await?,
            calls: Cell::new(0),
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        match self.fault {
            Fault::DropFirstLoadedPairPerChunk => self.inner.load(ep, &pairs[1..]).await,
            _ => self.inner.load(ep, pairs).await,
        }
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        self.inner.stats(ep).await
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}

struct FaultyClient {
    fault: Fault,
    inner: Rc<dyn KvStore>,
    calls: Cell<u64>,
}

impl FaultyClient {
    /// Counts a call; true on every n-th.
    fn nth(&self, n: u64) -> bool {
        self.calls.set(self.calls.get() + 1);
        self.calls.get().is_multiple_of(n)
    }
}

#[async_trait(?Send)]
impl KvStore for FaultyClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        match self.fault {
            Fault::CorruptEveryNthGet(n) if self.nth(n) => {
                let mut v = self.inner.get(key).await?;
                if let Some(v) = v.as_mut() {
                    let last = v.len() - 1;
                    v[last] ^= 0x10;
                }
                Ok(v)
            }
            Fault::WrongKeyEveryNthGet(n) if self.nth(n) => {
                let other = self.inner.scan(key.wrapping_add(1), 1).await?;
                match other.into_iter().next() {
                    Some((_, v)) => Ok(Some(v)),
                    None => self.inner.get(key).await,
                }
            }
            _ => self.inner.get(key).await,
        }
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        match self.fault {
            Fault::DropEveryNthInsert(n) if self.nth(n) => Ok(true),
            _ => self.inner.insert(key, value).await,
        }
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        match self.fault {
            Fault::RefuseEveryNthUpdate(n) if self.nth(n) => Ok(false),
            _ => self.inner.update(key, value).await,
        }
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        self.inner.upsert(key, value).await
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        match self.fault {
            Fault::IgnoreEveryNthDelete(n) if self.nth(n) => Ok(true),
            _ => self.inner.delete(key).await,
        }
    }
    async fn scan(&self, start: Key, n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        let mut items = self.inner.scan(start, n).await?;
        if self.fault == Fault::ScanSkipsSecondPair && items.len() >= 2 {
            items.remove(1);
        }
        Ok(items)
    }
}

/// A naive store of sequential keys 0..SLOTS in fixed slots of one region,
/// read and written one-sided with no version or checksum: exactly what the
/// transport contract warns against. Reads racing writes can return torn
/// values, which the harness must catch. Slot layout: `present: u64 |
/// value: [u8; VALUE]`.
pub struct NaiveSlots;

pub const SLOTS: u64 = 4_096;
pub const NAIVE_VALUE: usize = 64;
const SLOT: u64 = 8 + NAIVE_VALUE as u64;

const NAIVE_CAPS: Capabilities = Capabilities {
    scan: false,
    max_value_len: NAIVE_VALUE,
    reserved_keys: &[],
    reserved_why: "",
};

impl EngineSpec for NaiveSlots {
    fn capabilities(&self) -> Capabilities {
        NAIVE_CAPS
    }
    fn name(&self) -> &'static str {
        "naive-slots"
    }
    fn about(&self) -> &'static str {
        "fixed slots read one-sided without validation (a harness test)"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        &[]
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        rt.register_region(&args.name("slots"), (SLOTS * SLOT) as usize)?;
        Ok(())
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        let node = NodeId(args.serve.nodes[0]);
        let ep = args.fabric.endpoint(args.compute_node)?;
        let region = block_on(ep.lookup_region(node, &args.serve.name("slots")))?;
        Ok(Arc::new(NaiveEngine {
            region,
            compute: args.compute_node,
        }))
    }
}

struct NaiveEngine {
    region: RemoteRegion,
    compute: NodeId,
}

#[async_trait(?Send)]
impl Engine for NaiveEngine {
    fn name(&self) -> &'static str {
        "naive-slots"
    }
    fn capabilities(&self) -> Capabilities {
        NAIVE_CAPS
    }
    fn home_node(&self, _thread: usize) -> NodeId {
        self.compute
    }
    async fn client(&self, ep: Rc<Endpoint>, _thread: usize) -> Result<Rc<dyn KvStore>> {
        Ok(Rc::new(NaiveClient {
            ep,
            region: self.region,
        }))
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        for (k, v) in pairs {
            store_with(ep, self.region, *k, v).await?;
        }
        Ok(())
    }
    async fn stats(&self, _ep: &Endpoint) -> Result<serde_json::Value> {
        Ok(serde_json::json!({ "slots": SLOTS }))
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}

struct NaiveClient {
    ep: Rc<Endpoint>,
    region: RemoteRegion,
}

fn slot_of(key: Key) -> Result<u64> {
    if key >= SLOTS {
        return Err(KvError::Exhausted(format!(
            "naive-slots holds keys below {SLOTS}"
        )));
    }
    Ok(key * SLOT)
}

async fn store_with(ep: &Endpoint, region: RemoteRegion, key: Key, value: &[u8]) -> Result<()> {
    let mut slot = vec![0u8; SLOT as usize];
    slot[..8].copy_from_slice(&(value.len() as u64).to_le_bytes());
    slot[8..8 + value.len()].copy_from_slice(value);
    ep.write(region.at(slot_of(key)?), &slot).await?;
    Ok(())
}

impl NaiveClient {
    async fn store(&self, key: Key, value: &[u8]) -> Result<()> {
        store_with(&self.ep, self.region, key, value).await
    }
    async fn present(&self, key: Key) -> Result<bool> {
        let w = self.ep.read(self.region.at(slot_of(key)?), 8).await?;
        Ok(u64::from_le_bytes(w.try_into().expect("8 bytes")) != 0)
    }
}

#[async_trait(?Send)]
impl KvStore for NaiveClient {
    async fn get(&self, key: Key) -> Result<Option<Vec<u8>>> {
        let slot = self
            .ep
            .read(self.region.at(slot_of(key)?), SLOT as usize)
            .await?;
        let len = u64::from_le_bytes(slot[..8].try_into().expect("8 bytes")) as usize;
        Ok((len != 0).then(|| slot[8..8 + len.min(NAIVE_VALUE)].to_vec()))
    }
    async fn insert(&self, key: Key, value: &[u8]) -> Result<bool> {
        if self.present(key).await? {
            return Ok(false);
        }
        self.store(key, value).await?;
        Ok(true)
    }
    async fn update(&self, key: Key, value: &[u8]) -> Result<bool> {
        if !self.present(key).await? {
            return Ok(false);
        }
        self.store(key, value).await?;
        Ok(true)
    }
    async fn upsert(&self, key: Key, value: &[u8]) -> Result<bool> {
        let new = !self.present(key).await?;
        self.store(key, value).await?;
        Ok(new)
    }
    async fn delete(&self, key: Key) -> Result<bool> {
        if !self.present(key).await? {
            return Ok(false);
        }
        self.ep
            .write(self.region.at(slot_of(key)?), &0u64.to_le_bytes())
            .await?;
        Ok(true)
    }
    async fn scan(&self, _start: Key, _n: usize) -> Result<Vec<(Key, Vec<u8>)>> {
        Err(KvError::Unsupported {
            engine: "naive-slots",
            what: "ordered scans",
        })
    }
}
