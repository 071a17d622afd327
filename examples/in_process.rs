//! dmkv as a library, in one process: deploy an engine on the in-process
//! `local` transport and use it through [`KvStore`].
//!
//! ```text
//! cargo run --release --example in_process                  # xstore and race
//! cargo run --release --example in_process -- rolex,outback # any engines
//! ```
//!
//! What it shows, in order:
//! 1. picking a design by name and deploying it ([`LocalDeployment::deploy`]:
//!    memory nodes with their RPC handler threads, the engine's server side
//!    installed on them, a compute node to issue from);
//! 2. bulk-loading sorted pairs ([`Engine::load`](dmkv_api::Engine::load));
//! 3. get / insert / update / upsert / delete: "not found" and "exists" are
//!    `Ok(None)` / `Ok(false)`, not errors;
//! 4. errors ([`KvError`]): a reserved key, an oversized value;
//! 5. the scan capability: ordered engines scan, hash engines refuse with
//!    [`KvError::Unsupported`] (check [`Capabilities::scan`] first);
//! 6. several compute threads, each with its own client, and several tasks
//!    per thread sharing one client (the papers' coroutines).

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::{Capabilities, EngineSpec, Key, Knobs, KvError, KvStore};
use dmkv_transport::exec::{LocalTask, block_on, run_tasks};
use std::error::Error;

/// The designs linked into this example (the `dmkv` binary's registry lists
/// the same ones).
fn engines() -> Vec<&'static dyn EngineSpec> {
    vec![
        &dmkv_xstore::SPEC,
        &dmkv_rolex::SPEC,
        &dmkv_outback::SPEC,
        dmkv_scalestore::SPEC,
        &dmkv_scalestore::BTREE_LOCAL,
        &dmkv_rpc_btree::SPEC,
        &dmkv_cell::SPEC,
        &dmkv_sherman::SPEC,
        &dmkv_race::SPEC,
        &dmkv_rpc_hash::SPEC,
    ]
}

fn find(name: &str) -> Result<&'static dyn EngineSpec, String> {
    let all = engines();
    all.iter()
        .copied()
        .find(|e| e.name() == name)
        .ok_or_else(|| {
            let names: Vec<_> = all.iter().map(|e| e.name()).collect();
            format!("unknown engine {name:?} (known: {})", names.join(", "))
        })
}

fn value(i: u64) -> Vec<u8> {
    format!("value-{i:04}").into_bytes()
}

fn main() -> Result<(), Box<dyn Error>> {
    let names = std::env::args().nth(1).unwrap_or("xstore,race".into());
    for name in names.split(',') {
        let spec = find(name.trim())?;
        println!("== {} ({})", spec.name(), spec.about());
        run(spec)?;
    }
    Ok(())
}

fn run(spec: &'static dyn EngineSpec) -> Result<(), Box<dyn Error>> {
    // 1. Deploy. Knobs are the `--set engine.knob=value` settings of
    // `dmkv bench`; they are checked against the engine's list.
    let threads = 2;
    let opts = DeployOptions {
        memnodes: 1,
        threads,
        expected_keys: 10_000,
        value_size: 16,
        knobs: Knobs::new(),
        ..DeployOptions::default()
    };
    let d = LocalDeployment::deploy(spec, &opts)?;
    let caps = d.engine.capabilities();
    println!(
        "   scans: {}, values up to {} bytes, reserved keys: {:?}",
        caps.scan, caps.max_value_len, caps.reserved_keys
    );

    // 2. Bulk load: distinct keys in ascending order, through the design's
    // own bulk path (a learned index trains on them, a hash table sizes).
    let pairs: Vec<(Key, Vec<u8>)> = (1..=1000u64).map(|i| (i * 10, value(i))).collect();
    block_on(d.engine.load(&d.endpoint(0), &pairs))?;

    // 3.-5. One client, used from this thread.
    let (_endpoint, kv) = d.client(0)?;
    block_on(basics(&*kv, &caps))?;

    // 6. Each compute thread gets its own client (a `KvStore` is not Send);
    // inside a thread, tasks share it and overlap their network waits.
    std::thread::scope(|s| -> Result<(), String> {
        let workers: Vec<_> = (0..threads)
            .map(|t| {
                let d = &d;
                s.spawn(move || -> Result<u64, String> {
                    let (_ep, kv) = d.client(t).map_err(|e| e.to_string())?;
                    let tasks: Vec<LocalTask<'_, Result<u64, KvError>>> = (0..4u64)
                        .map(|task| {
                            let kv = &*kv;
                            Box::pin(async move {
                                let mut inserted = 0;
                                for i in 0..100u64 {
                                    let k = 1_000_000 + (t as u64) * 10_000 + task * 1000 + i;
                                    inserted += kv.insert(k, &value(k)).await? as u64;
                                }
                                Ok(inserted)
                            }) as LocalTask<'_, _>
                        })
                        .collect();
                    let mut n = 0;
                    for r in run_tasks(tasks) {
                        n += r.map_err(|e| e.to_string())?;
                    }
                    Ok(n)
                })
            })
            .collect();
        for (t, w) in workers.into_iter().enumerate() {
            let n = w.join().map_err(|_| "a worker panicked")??;
            println!("   thread {t}: 4 tasks inserted {n} keys");
        }
        Ok(())
    })?;
    Ok(())
}

/// Steps 3 to 5 on any store: what an application does with a `KvStore`.
async fn basics(kv: &dyn KvStore, caps: &Capabilities) -> Result<(), Box<dyn Error>> {
    // Expected outcomes are results, not errors.
    assert_eq!(kv.get(10).await?, Some(value(1)));
    assert_eq!(kv.get(15).await?, None, "never inserted: not found");
    assert!(kv.insert(15, b"fifteen").await?, "new key: inserted");
    assert!(!kv.insert(15, b"again").await?, "existing key: 'exists'");
    assert!(kv.update(15, b"FIFTEEN").await?);
    assert!(!kv.update(16, b"x").await?, "missing key: not updated");
    assert!(!kv.upsert(15, b"15").await?, "upsert of an existing key");
    assert!(kv.upsert(16, b"16").await?, "upsert of a new key");
    assert!(kv.delete(16).await?);
    assert!(!kv.delete(16).await?, "already gone");
    println!(
        "   get/insert/update/upsert/delete: ok; key 15 = {:?}",
        String::from_utf8_lossy(&kv.get(15).await?.unwrap_or_default())
    );

    // Errors: bad input is refused before it reaches the engine.
    if let Some(&k) = caps.reserved_keys.first() {
        match kv.insert(k, b"x").await {
            Err(e @ KvError::ReservedKey { .. }) => println!("   reserved key: {e}"),
            other => return Err(format!("reserved key {k} gave {other:?}").into()),
        }
    }
    let too_big = vec![0u8; caps.max_value_len + 1];
    match kv.insert(17, &too_big).await {
        Err(e @ KvError::ValueTooLarge { .. }) => println!("   oversized value: {e}"),
        other => return Err(format!("an oversized value gave {other:?}").into()),
    }

    // The scan capability: ask before scanning; hash designs say no.
    match kv.scan(12, 3).await {
        Ok(pairs) => {
            assert!(caps.scan);
            let keys: Vec<Key> = pairs.iter().map(|p| p.0).collect();
            assert_eq!(keys, [15, 20, 30]);
            println!("   scan(12, 3) -> keys {keys:?}");
        }
        Err(e @ KvError::Unsupported { .. }) => {
            assert!(!caps.scan);
            println!("   scan refused: {e}");
        }
        Err(e) => return Err(e.into()),
    }
    Ok(())
}
