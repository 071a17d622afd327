//! XStore's durability across processes: a memory-node **process** serving
//! XStore with `xstore.durability=on` on its own `--data-dir` is killed
//! with SIGKILL while clients write through it; a new memory-node process
//! started on the same directory recovers, and a new client finds every
//! acknowledged write (docs/xstore.md, Durability; docs/ucx.md).
//!
//! The memory node is `dmkv memnode --data-dir` when `DMKV_BIN` names a
//! dmkv binary built with the `ucx` feature (scripts/ci-ucx.sh sets it);
//! otherwise this test binary re-runs itself as the memory node through
//! the same `Memnode` options the command line fills in.

#![cfg(feature = "ucx")]
#![allow(clippy::disallowed_methods)] // tests use real threads and clocks

use dmkv_api::deploy::DeployOptions;
use dmkv_api::payload::{check_value, make_value};
use dmkv_api::{EngineSpec, Knobs, KvStore};
use dmkv_transport::NodeId;
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use dmkv_transport_ucx::UcxConfig;
use dmkv_transport_ucx::deploy::{
    LISTENING, Memnode, MemnodeOptions, UcxDeployOptions, UcxDeployment,
};
use std::cell::RefCell;
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::rc::Rc;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

const SECRET: &str = "xstore-durability-test";
const CHILD_ENV: &str = "DMKV_UCX_TEST_MEMNODE_DIR";

fn config() -> UcxConfig {
    UcxConfig::tcp_loopback(SECRET.as_bytes().to_vec())
}

/// Not a test of its own: the memory-node process the test starts and
/// kills (without `DMKV_BIN`).
#[test]
fn child_memnode() {
    let Ok(dir) = std::env::var(CHILD_ENV) else {
        return;
    };
    let node = Memnode::start(
        &MemnodeOptions {
            listen: "127.0.0.1:0".parse().unwrap(),
            node: NodeId(0),
            handler_threads: 2,
            pool_bytes: None,
            data_dir: Some(PathBuf::from(dir)),
            config: config(),
        },
        Arc::new(|name: &str| {
            (name == dmkv_xstore::SPEC.name()).then_some(&dmkv_xstore::SPEC as &dyn EngineSpec)
        }),
    )
    .unwrap();
    {
        use std::io::Write;
        let mut out = std::io::stdout().lock();
        writeln!(out, "{LISTENING} {}", node.listen_addr()).unwrap();
        out.flush().unwrap();
    }
    // Bounded, so that a child whose parent died does not run on.
    std::thread::sleep(Duration::from_secs(300));
}

/// A memory-node process; killed with SIGKILL (and reaped) on drop.
struct Proc(Child);

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Starts a memory node on `dir` and returns it with its address.
fn start_memnode(dir: &Path) -> (Proc, String) {
    let mut cmd = match std::env::var("DMKV_BIN") {
        Ok(bin) if !bin.is_empty() => {
            let mut c = Command::new(bin);
            c.args([
                "memnode",
                "--listen",
                "127.0.0.1:0",
                "--node-id",
                "0",
                "--threads",
                "2",
                "--data-dir",
            ])
            .arg(dir)
            .env("DMKV_SECRET", SECRET)
            .env("UCX_TLS", "tcp")
            .env("UCX_NET_DEVICES", "lo");
            c
        }
        _ => {
            let mut c = Command::new(std::env::current_exe().unwrap());
            c.args([
                "--exact",
                "child_memnode",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(CHILD_ENV, dir);
            c
        }
    };
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let proc = Proc(child);
    let (tx, rx) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        let mut lines = BufReader::new(stdout).lines();
        for line in lines.by_ref() {
            let Ok(line) = line else { break };
            // libtest prints "test child_memnode ... " before the output.
            if let Some(at) = line.find(LISTENING) {
                let _ = tx.send(line[at + LISTENING.len()..].trim().to_string());
                break;
            }
        }
        // Keep draining so the child never blocks on a full pipe.
        for _ in lines {}
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(60))
        .expect("the memory node reports its address");
    (proc, addr)
}

fn deploy(addr: &str) -> UcxDeployment {
    let mut knobs = Knobs::new();
    knobs.set("durability", "on");
    knobs.set("log_sync", "fsync");
    knobs.set("slots", "4");
    let mut ucx = UcxDeployOptions::new(config());
    ucx.memnodes = vec![addr.to_string()];
    UcxDeployment::deploy(
        &dmkv_xstore::SPEC,
        &DeployOptions {
            knobs,
            expected_keys: 10_000,
            threads: 1,
            // A path on the compute side: the memory node's own
            // --data-dir replaces it.
            data_dir: Some(PathBuf::from("/nonexistent/compute-side-dir")),
            ..DeployOptions::default()
        },
        &ucx,
    )
    .unwrap()
}

/// Per key: (last acknowledged state: Some(version), Some(0) for a delete,
/// None if nothing was acknowledged; last version attempted).
type Log = BTreeMap<u64, (Option<u32>, u32)>;

#[test]
fn a_killed_memnode_process_recovers_every_acknowledged_write() {
    let dir = std::env::temp_dir().join(format!("dmkv-ucx-xstore-wal-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();

    // Phase 1: load, then write until the memory node is killed.
    let (node, addr) = start_memnode(&dir);
    let loaded: Vec<(u64, Vec<u8>)> = (0..2000u64)
        .map(|i| (i * 1000 + 7, make_value(i * 1000 + 7, 1, 8)))
        .collect();
    let acked = Arc::new(AtomicU64::new(0));
    let logs: Vec<Log> = {
        let dep = deploy(&addr);
        let (ep, kv) = dep.client(0).unwrap();
        block_on(dep.engine.load(&ep, &loaded)).unwrap();
        // SIGKILL from another thread once enough writes were acknowledged,
        // while tasks keep writing (some in flight, some in the log).
        let killer = {
            let acked = acked.clone();
            let mut node = node;
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(120);
                while acked.load(Ordering::SeqCst) < 1500 && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_millis(1));
                }
                node.0.kill().unwrap();
                node.0.wait().unwrap();
            })
        };
        let logs: Vec<RefCell<Log>> = (0..6).map(|_| RefCell::default()).collect();
        let tasks: Vec<LocalTask<'_, ()>> = logs
            .iter()
            .enumerate()
            .map(|(j, log)| {
                let kv: Rc<dyn KvStore> = kv.clone();
                let acked = acked.clone();
                Box::pin(async move {
                    for step in 0..100_000u32 {
                        // Each task owns its keys: 100 of them, some loaded
                        // (overwritten), some new.
                        let key =
                            (step as u64 % 100) * 1000 + j as u64 * 10 + 3 + 4 * (step as u64 % 2);
                        let version = step + 2;
                        let delete = step % 7 == 6;
                        log.borrow_mut().entry(key).or_insert((None, 0)).1 = version;
                        let res = if delete {
                            kv.delete(key).await.map(|_| ())
                        } else {
                            kv.upsert(key, &make_value(key, version, 8))
                                .await
                                .map(|_| ())
                        };
                        match res {
                            Ok(()) => {
                                log.borrow_mut().get_mut(&key).unwrap().0 =
                                    Some(if delete { 0 } else { version });
                                acked.fetch_add(1, Ordering::SeqCst);
                            }
                            Err(_) => return,
                        }
                    }
                }) as LocalTask<'_, ()>
            })
            .collect();
        run_tasks(tasks);
        killer.join().unwrap();
        logs.into_iter().map(RefCell::into_inner).collect()
    };
    let acked = acked.load(Ordering::SeqCst);
    assert!(acked >= 1500, "{acked} writes acknowledged before the kill");

    // Phase 2: a new memory-node process on the same directory, a new
    // deployment and client.
    let (_node2, addr2) = start_memnode(&dir);
    let dep = deploy(&addr2);
    let (_ep, kv) = dep.client(0).unwrap();
    let written: std::collections::BTreeSet<u64> =
        logs.iter().flat_map(|l| l.keys().copied()).collect();
    block_on(async {
        for (k, v) in &loaded {
            if !written.contains(k) {
                assert_eq!(
                    kv.get(*k).await.unwrap().as_ref(),
                    Some(v),
                    "loaded key {k}"
                );
            }
        }
        let mut checked = 0;
        for log in &logs {
            for (&key, &(ack, tried)) in log {
                let got = kv.get(key).await.unwrap();
                let got_v = got.as_ref().map(|v| check_value(key, v).unwrap());
                // A key's recovered state is its last acknowledged write or
                // the one attempt after it that was in flight at the kill
                // (durable, its reply lost).
                match (ack, got_v) {
                    (Some(ack), Some(v)) => {
                        checked += 1;
                        assert!(
                            v == ack || v == tried,
                            "key {key}: recovered v{v}, acknowledged {ack}, tried {tried}"
                        );
                    }
                    (Some(ack), None) => {
                        checked += 1;
                        assert!(
                            ack == 0 || (tried != ack && (tried - 2) % 7 == 6),
                            "key {key}: lost acknowledged v{ack} (tried {tried})"
                        );
                    }
                    (None, _) => {}
                }
            }
        }
        assert!(checked > 0);
    });
    let stats = block_on(dep.engine.stats(&dep.endpoint(0))).unwrap();
    let d = &stats["partitions"][0]["durability"];
    assert!(
        d["dir"]
            .as_str()
            .unwrap()
            .starts_with(dir.to_str().unwrap()),
        "the memory node logs in its own directory: {d}"
    );
    // Recovery read the killed node's logs: the loaded pairs and the
    // writes after them (a delete of a missing key logs nothing).
    assert!(d["recovered"]["files"].as_u64().unwrap() >= 1, "{d}");
    assert!(
        d["recovered"]["records"].as_u64().unwrap() > loaded.len() as u64 + acked / 2,
        "{d}"
    );
    drop(kv);
    drop(dep);
    let _ = std::fs::remove_dir_all(&dir);
}
