//! Replaying a YCSB run with its load phase (`--trace-load`): the store
//! holds exactly the keys YCSB loaded when the run starts, reads of keys YCSB
//! never loaded find nothing, and files that are not YCSB traces are refused.

use async_trait::async_trait;
use dmkv_api::{
    Capabilities, ConnectArgs, Engine, EngineSpec, Key, KnobSpec, KvStore, Result, ServeArgs,
};
use dmkv_bench::plan::Plan;
use dmkv_bench::report::EngineReport;
use dmkv_bench::trace::{key_universe, load_keys, parse_trace, read_load_trace, read_trace};
use dmkv_bench::{BenchConfig, BenchError, EngineChoice, WorkloadSource};
use dmkv_memnode::NodeRuntime;
use dmkv_testkit::reference::Reference;
use dmkv_transport::{Endpoint, NodeId};
use std::collections::BTreeSet;
use std::fmt::Write as _;
use std::path::{Path, PathBuf};
use std::rc::Rc;
use std::sync::{Arc, Mutex};

/// The reference engine, remembering every key handed to its bulk load.
struct Recording {
    loaded: Arc<Mutex<Vec<Key>>>,
}

fn recording() -> &'static Recording {
    Box::leak(Box::new(Recording {
        loaded: Arc::default(),
    }))
}

impl EngineSpec for Recording {
    fn name(&self) -> &'static str {
        "recording"
    }
    fn about(&self) -> &'static str {
        "the reference engine, recording what it bulk-loads"
    }
    fn knobs(&self) -> &'static [KnobSpec] {
        &[]
    }
    fn capabilities(&self) -> Capabilities {
        Reference.capabilities()
    }
    fn serve(&self, rt: &Arc<NodeRuntime>, args: &ServeArgs) -> Result<()> {
        Reference.serve(rt, args)
    }
    fn connect(&self, args: ConnectArgs) -> Result<Arc<dyn Engine>> {
        Ok(Arc::new(RecordingEngine {
            inner: Reference.connect(args)?,
            loaded: self.loaded.clone(),
        }))
    }
}

struct RecordingEngine {
    inner: Arc<dyn Engine>,
    loaded: Arc<Mutex<Vec<Key>>>,
}

#[async_trait(?Send)]
impl Engine for RecordingEngine {
    fn name(&self) -> &'static str {
        "recording"
    }
    fn capabilities(&self) -> Capabilities {
        self.inner.capabilities()
    }
    fn home_node(&self, thread: usize) -> NodeId {
        self.inner.home_node(thread)
    }
    async fn client(&self, ep: Rc<Endpoint>, thread: usize) -> Result<Rc<dyn KvStore>> {
        self.inner.client(ep, thread).await
    }
    async fn load(&self, ep: &Endpoint, pairs: &[(Key, Vec<u8>)]) -> Result<()> {
        self.loaded
            .lock()
            .unwrap()
            .extend(pairs.iter().map(|p| p.0));
        self.inner.load(ep, pairs).await
    }
    async fn stats(&self, ep: &Endpoint) -> Result<serde_json::Value> {
        self.inner.stats(ep).await
    }
    fn client_cache_bytes(&self) -> u64 {
        0
    }
}

/// A YCSB-like pair of traces: `load` inserts `n` hashed keys; `run` reads
/// and updates a third of them, scans, inserts two new keys, deletes one
/// loaded key and reads a key YCSB never loaded.
struct Traces {
    load_keys: Vec<u64>,
    touched_before_insert: BTreeSet<u64>,
    never_loaded: u64,
    load: String,
    run: String,
}

fn hashed(i: u64) -> u64 {
    // FNV-like scattering, as YCSB's hashed insert order does.
    (i.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ 0x5555) >> 1
}

fn traces(n: u64) -> Traces {
    let load_keys: Vec<u64> = (0..n).map(hashed).collect();
    let mut load = String::from(
        "Command line: -db site.ycsb.BasicDB -p basicdb.verbose=true -load\n\
         YCSB Client 0.17.0\n\nLoading workload...\nStarting test.\n",
    );
    for k in &load_keys {
        writeln!(load, "INSERT usertable user{k} [ field0=x field1=y ]").unwrap();
    }
    writeln!(
        load,
        "[OVERALL], RunTime(ms), 20\n[INSERT], Operations, {n}"
    )
    .unwrap();

    let mut run = String::from("Command line: -db site.ycsb.BasicDB -t\nStarting test.\n");
    let mut touched = BTreeSet::new();
    for (j, k) in load_keys.iter().enumerate().filter(|(j, _)| j % 3 == 0) {
        let op = if j % 2 == 0 { "READ" } else { "UPDATE" };
        writeln!(run, "{op} usertable user{k} [ <all fields>]").unwrap();
        touched.insert(*k);
    }
    writeln!(
        run,
        "SCAN usertable user{} 10 [ <all fields>]",
        load_keys[1]
    )
    .unwrap();
    touched.insert(load_keys[1]);
    let fresh = [hashed(n + 1), hashed(n + 2)];
    for k in fresh {
        writeln!(run, "INSERT usertable user{k} [ field0=new ]").unwrap();
        writeln!(run, "READ usertable user{k} [ <all fields>]").unwrap();
    }
    writeln!(run, "DELETE usertable user{}", load_keys[2]).unwrap();
    touched.insert(load_keys[2]);
    let never_loaded = hashed(n + 3);
    writeln!(run, "READ usertable user{never_loaded} [ <all fields>]").unwrap();
    touched.insert(never_loaded);
    run.push_str("[OVERALL], RunTime(ms), 1000\n");
    Traces {
        load_keys,
        touched_before_insert: touched,
        never_loaded,
        load,
        run,
    }
}

fn write(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn temp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("dmkv-trace-load-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn config(spec: &'static Recording, run: PathBuf, load: Option<PathBuf>) -> BenchConfig {
    let mut cfg = BenchConfig::new(vec![EngineChoice {
        spec,
        knobs: Default::default(),
    }]);
    cfg.workload = WorkloadSource::Trace(run);
    cfg.trace_load = load;
    cfg.threads = 2;
    cfg.tasks = 2;
    cfg.verify = true;
    cfg
}

fn run_one(cfg: &BenchConfig) -> EngineReport {
    let outcome = dmkv_bench::run(cfg).expect("the run starts");
    assert!(outcome.failures.is_empty(), "{:?}", outcome.failures);
    let r = outcome.reports.into_iter().next().unwrap();
    assert!(
        r.ok,
        "errors {:?}, checks {:?}, verify {:?}",
        r.errors, r.checks, r.verify
    );
    r
}

#[test]
fn the_load_file_loads_exactly_ycsbs_keys() {
    let t = traces(300);
    let dir = temp_dir("exact");
    let load = write(&dir, "load.log", &t.load);
    let run = write(&dir, "run.log", &t.run);

    // The plan: the load phase's keys are the loaded ones, in load order.
    let run_trace = read_trace(&run).unwrap();
    let load_trace = read_load_trace(&load).unwrap();
    assert_eq!(load_trace.keys, t.load_keys);
    let plan =
        Plan::from_trace_with_load(&run_trace, Some(&load_trace.keys), 2, 2, &[], 0).unwrap();
    assert_eq!(plan.loaded(), 300);
    assert_eq!(&plan.keys()[..300], &t.load_keys[..]);
    assert!(plan.keys()[300..].contains(&t.never_loaded));

    // The run: the engine's bulk load got exactly those keys, reads of the
    // key YCSB never loaded found nothing (a check), and --verify read back
    // every key of the universe with the right existence.
    let spec = recording();
    let r = run_one(&config(spec, run.clone(), Some(load.clone())));
    let got: BTreeSet<u64> = spec.loaded.lock().unwrap().iter().copied().collect();
    assert_eq!(
        spec.loaded.lock().unwrap().len(),
        300,
        "each key loaded once"
    );
    assert_eq!(got, t.load_keys.iter().copied().collect::<BTreeSet<_>>());
    assert_eq!(r.keys, 300);
    assert_eq!(r.verify.checked, 300 + 3);
    let tr = r.trace.as_ref().unwrap();
    let l = tr.load.as_ref().expect("the report names the load file");
    assert_eq!((l.keys, l.ignored_lines), (300, 7));
    assert_eq!(l.path, load.display().to_string());

    // Without the load file only the keys the run touches before inserting
    // them are loaded (as YCSB's 50,000-record run touches 24,484), and the
    // key YCSB never loaded is among them.
    let spec = recording();
    let r = run_one(&config(spec, run, None));
    let got: BTreeSet<u64> = spec.loaded.lock().unwrap().iter().copied().collect();
    assert_eq!(got, t.touched_before_insert);
    assert_eq!(r.keys, t.touched_before_insert.len() as u64);
    assert!(r.keys < 300);
    assert!(r.trace.as_ref().unwrap().load.is_none());
    std::fs::remove_dir_all(dir).unwrap();
}

#[test]
fn key_universes_with_and_without_a_load_phase() {
    let run = parse_trace(
        "READ t user5 [ ]\nINSERT t user7 [ ]\nREAD t user9 [ ]\nINSERT t user5 [ ]\n".as_bytes(),
    )
    .unwrap();
    assert_eq!(key_universe(&run, None), (vec![5, 9, 7], 2));
    assert_eq!(
        key_universe(&run, Some(&[1, 5, 3])),
        (vec![1, 5, 3, 7, 9], 3)
    );
}

#[test]
fn files_that_are_not_ycsb_traces_are_refused() {
    let dir = temp_dir("refused");
    let passwd = write(
        &dir,
        "passwd",
        "root:x:0:0:root:/root:/bin/bash\ndaemon:x:1:1:daemon:/usr/sbin:/usr/sbin/nologin\n",
    );
    let e = read_trace(&passwd).unwrap_err().to_string();
    assert!(e.contains("no YCSB operation in its 2 lines"), "{e}");
    let empty = write(&dir, "empty", "");
    assert!(read_trace(&empty).is_err());

    // The whole run refuses it before deploying anything.
    let spec = recording();
    let e = dmkv_bench::run(&config(spec, passwd.clone(), None)).unwrap_err();
    assert!(
        matches!(&e, BenchError::Input(m) if m.contains("no YCSB operation")),
        "{e}"
    );
    let t = traces(10);
    let run = write(&dir, "run.log", &t.run);
    let e = dmkv_bench::run(&config(spec, run.clone(), Some(passwd))).unwrap_err();
    assert!(
        matches!(&e, BenchError::Input(m) if m.contains("no YCSB operation")),
        "{e}"
    );

    // A load file holds INSERTs only, each key once.
    let e = load_keys(&parse_trace("INSERT t user1 [ ]\nREAD t user1 [ ]\n".as_bytes()).unwrap())
        .unwrap_err();
    assert!(e.contains("operation 2 is a Read of key 1"), "{e}");
    let e = load_keys(&parse_trace("INSERT t user1 [ ]\nINSERT t user1 [ ]\n".as_bytes()).unwrap())
        .unwrap_err();
    assert!(e.contains("inserts key 1 a second time"), "{e}");
    // The run file passed as the load file says which is which.
    let e = dmkv_bench::run(&config(spec, run.clone(), Some(run.clone()))).unwrap_err();
    assert!(
        matches!(&e, BenchError::Input(m) if m.contains("INSERT lines only")),
        "{e}"
    );

    // --trace-load without --trace.
    let mut cfg = config(spec, run, None);
    cfg.workload = WorkloadSource::Synthetic(dmkv_bench::Workload::YcsbC);
    cfg.trace_load = Some(dir.join("load.log"));
    let e = dmkv_bench::run(&cfg).unwrap_err();
    assert!(
        matches!(&e, BenchError::Input(m) if m.contains("--trace-load needs --trace")),
        "{e}"
    );
    std::fs::remove_dir_all(dir).unwrap();
}
