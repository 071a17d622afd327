//! dmkv as a library across processes: connect to `dmkv memnode` processes
//! over UCX, install an engine on them, and use it through [`KvStore`].
//!
//! ```text
//! cargo build --release --features ucx          # needs libucx-dev, libclang-dev
//! echo my-cluster-secret > /tmp/dmkv.secret
//! target/release/dmkv memnode --listen 127.0.0.1:7400 --node-id 0 --secret-file /tmp/dmkv.secret &
//! cargo run --release --features ucx --example over_ucx -- \
//!     --memnode 127.0.0.1:7400 --secret-file /tmp/dmkv.secret [--engine race] [--tls tcp]
//! ```
//!
//! Several `--memnode ADDR` spread a disaggregated engine over several
//! memory nodes (in the order given). The memory node installs the engine's
//! server side by name (its binary's registry) when this process deploys;
//! dropping the deployment uninstalls it, so memory nodes outlive clients.
//! Everything after the deployment is the same code as `in_process`: a
//! `KvStore` does not know which transport it runs on.

use dmkv_api::deploy::DeployOptions;
use dmkv_api::{EngineSpec, KvError, KvStore};
use dmkv_transport::exec::block_on;
use dmkv_transport_ucx::UcxConfig;
use dmkv_transport_ucx::deploy::{UcxDeployOptions, UcxDeployment};
use std::error::Error;
use std::path::PathBuf;

fn engines() -> Vec<&'static dyn EngineSpec> {
    // Disaggregated designs: their server side runs on the memory nodes.
    // (ScaleStore is symmetric: its nodes are served by `dmkv node`.)
    vec![
        &dmkv_xstore::SPEC,
        &dmkv_rolex::SPEC,
        &dmkv_outback::SPEC,
        &dmkv_rpc_btree::SPEC,
        &dmkv_cell::SPEC,
        &dmkv_sherman::SPEC,
        &dmkv_race::SPEC,
        &dmkv_rpc_hash::SPEC,
    ]
}

struct Args {
    memnodes: Vec<String>,
    secret_file: PathBuf,
    engine: String,
    tls: Option<String>,
}

fn parse_args() -> Result<Args, String> {
    let usage = "usage: over_ucx --memnode ADDR [--memnode ADDR ...] --secret-file PATH \
                 [--engine NAME] [--tls UCX_TLS]";
    let mut a = Args {
        memnodes: Vec::new(),
        secret_file: PathBuf::new(),
        engine: "xstore".into(),
        tls: None,
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value\n{usage}"));
        match flag.as_str() {
            "--memnode" => a.memnodes.push(val()?),
            "--secret-file" => a.secret_file = val()?.into(),
            "--engine" => a.engine = val()?,
            "--tls" => a.tls = Some(val()?),
            _ => return Err(format!("unknown argument {flag:?}\n{usage}")),
        }
    }
    if a.memnodes.is_empty() || a.secret_file.as_os_str().is_empty() {
        return Err(usage.into());
    }
    Ok(a)
}

fn main() -> Result<(), Box<dyn Error>> {
    let a = parse_args()?;
    let spec = engines()
        .into_iter()
        .find(|e| e.name() == a.engine)
        .ok_or_else(|| format!("unknown or symmetric engine {:?}", a.engine))?;
    let secret = std::fs::read(&a.secret_file)
        .map_err(|e| format!("cannot read {}: {e}", a.secret_file.display()))?;
    let mut config = UcxConfig::new(secret.trim_ascii().to_vec());
    config.tls = a.tls.clone();
    let mut ucx = UcxDeployOptions::new(config);
    ucx.memnodes = a.memnodes.clone();
    let opts = DeployOptions {
        memnodes: a.memnodes.len(),
        expected_keys: 10_000,
        value_size: 8,
        ..DeployOptions::default()
    };
    // Reaches every memory node (secret handshake), installs the engine's
    // server side on each, and connects this process as a compute node.
    let d = UcxDeployment::deploy(spec, &opts, &ucx)?;
    let caps = d.engine.capabilities();
    println!(
        "{} on {} memory node(s) over UCX; scans: {}",
        spec.name(),
        a.memnodes.len(),
        caps.scan
    );

    let pairs: Vec<(u64, Vec<u8>)> = (1..=1000u64)
        .map(|k| (k * 10, (k * 10).to_le_bytes().to_vec()))
        .collect();
    block_on(d.engine.load(&d.endpoint(0), &pairs))?;

    let (ep, kv) = d.client(0)?;
    block_on(async {
        let kv: &dyn KvStore = &*kv;
        assert_eq!(kv.get(500).await?, Some(500u64.to_le_bytes().to_vec()));
        assert_eq!(kv.get(505).await?, None);
        assert!(kv.insert(505, b"new").await?);
        assert!(!kv.insert(505, b"again").await?, "exists");
        assert!(kv.update(505, b"changed").await?);
        assert_eq!(kv.get(505).await?.as_deref(), Some(&b"changed"[..]));
        assert!(kv.delete(505).await?);
        match kv.scan(495, 3).await {
            Ok(p) => println!(
                "scan(495, 3) -> keys {:?}",
                p.iter().map(|p| p.0).collect::<Vec<_>>()
            ),
            Err(e @ KvError::Unsupported { .. }) => println!("scan refused: {e}"),
            Err(e) => return Err(e),
        }
        Ok::<_, KvError>(())
    })?;
    // Every backend counts the same way: these match the local backend's.
    let c = ep.total_counters();
    println!(
        "client counters: {} round trips, {} verbs, {} RPCs, {} bytes read, {} bytes written",
        c.round_trips, c.verbs, c.rpcs, c.bytes_read, c.bytes_written
    );
    Ok(())
}
