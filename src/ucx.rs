//! The UCX side of the command line (built with the `ucx` feature):
//! `dmkv memnode` and the deployer behind `dmkv bench --transport ucx`.
//! Everything else lives in `dmkv-transport-ucx`'s `deploy` module; this
//! file only turns command-line arguments into its options.

use crate::cli::MemnodeArgs;
use crate::engines::Registry;
use dmkv_api::deploy::DeployOptions;
use dmkv_api::{EngineSpec, KvError};
use dmkv_bench::{Deployer, Deployment};
use dmkv_memnode::NodeStats;
use dmkv_transport::{Endpoint, NodeId};
use dmkv_transport_ucx::UcxConfig;
use dmkv_transport_ucx::deploy::{
    EngineLookup, LISTENING, Memnode, MemnodeOptions, SpawnMemnode, UcxDeployOptions, UcxDeployment,
};
use std::io::{Read, Write};
use std::net::ToSocketAddrs;
use std::path::Path;
use std::process::Command;
use std::rc::Rc;
use std::sync::Arc;

/// Where the cluster secret comes from.
const SECRET_ENV: &str = "DMKV_SECRET";

pub(crate) fn read_secret(file: Option<&Path>) -> Result<Option<Vec<u8>>, String> {
    if let Some(path) = file {
        let s = std::fs::read(path)
            .map_err(|e| format!("cannot read the secret file {}: {e}", path.display()))?;
        let s = s.trim_ascii().to_vec();
        if s.is_empty() {
            return Err(format!("the secret file {} is empty", path.display()));
        }
        return Ok(Some(s));
    }
    Ok(std::env::var(SECRET_ENV)
        .ok()
        .filter(|s| !s.is_empty())
        .map(String::into_bytes))
}

fn lookup(registry: &Registry) -> EngineLookup {
    let engines: &'static [&'static dyn EngineSpec] = registry.engines;
    Arc::new(move |name: &str| engines.iter().copied().find(|e| e.name() == name))
}

/// `dmkv memnode`: serves until killed (or until stdin closes, with
/// `--exit-on-stdin-eof`). Prints `LISTENING ADDR` first.
pub fn memnode(registry: &Registry, a: MemnodeArgs, out: &mut dyn Write) -> Result<i32, String> {
    let secret = read_secret(a.secret_file.as_deref())?.ok_or_else(|| {
        format!("dmkv memnode needs the cluster secret: --secret-file PATH or {SECRET_ENV}")
    })?;
    let listen = a
        .listen
        .to_socket_addrs()
        .map_err(|e| format!("--listen {}: {e}", a.listen))?
        .next()
        .ok_or_else(|| format!("--listen {} resolves to nothing", a.listen))?;
    if a.threads == 0 {
        return Err("--threads must be at least 1".into());
    }
    let node = Memnode::start(
        &MemnodeOptions {
            listen,
            node: NodeId(a.node_id),
            handler_threads: a.threads,
            pool_bytes: a.pool_mb.map(|mb| mb << 20),
            data_dir: a.data_dir.clone(),
            config: UcxConfig::new(secret),
        },
        lookup(registry),
    )
    .map_err(|e| format!("cannot start the memory node: {e}"))?;
    writeln!(out, "{LISTENING} {}", node.listen_addr()).map_err(|e| e.to_string())?;
    out.flush().map_err(|e| e.to_string())?;
    if a.exit_on_stdin_eof {
        ParentStdin::open()?.wait_for_eof();
        // What serving cost outside the services, split into idle polling
        // and work (the stats service reports only the sum).
        eprintln!("{}", node.serving_summary());
    } else {
        loop {
            std::thread::park();
        }
    }
    drop(node);
    Ok(crate::cli::EXIT_OK)
}

/// `--exit-on-stdin-eof` (`dmkv memnode`, `dmkv node`): stdin opened anew.
/// Not `std::io::stdin()`: `main` holds its lock for the CLI's whole run,
/// so reading through it would wait forever (and a child would never see
/// its parent go). `/dev/stdin` is a new descriptor for the same pipe.
pub(crate) struct ParentStdin(std::fs::File);

impl ParentStdin {
    pub(crate) fn open() -> Result<Self, String> {
        std::fs::File::open("/dev/stdin")
            .map(Self)
            .map_err(|e| format!("--exit-on-stdin-eof: cannot read stdin: {e}"))
    }

    /// Returns once the parent has closed its end (or reading fails).
    pub(crate) fn wait_for_eof(mut self) {
        let mut sink = [0u8; 256];
        while matches!(self.0.read(&mut sink), Ok(n) if n > 0) {}
    }
}

/// The deployer of `dmkv bench --transport ucx`.
#[derive(Clone)]
struct UcxDeployer {
    opts: UcxDeployOptions,
}

impl std::fmt::Debug for UcxDeployer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("UcxDeployer")
            .field("memnodes", &self.opts.memnodes)
            .finish()
    }
}

/// A deployment over UCX as the runner sees it.
struct Ucx(UcxDeployment);

impl Deployment for Ucx {
    fn engine(&self) -> &Arc<dyn dmkv_api::Engine> {
        &self.0.engine
    }
    fn endpoint(&self, thread: usize) -> Rc<Endpoint> {
        self.0.endpoint(thread)
    }
    fn client(&self, thread: usize) -> Result<(Rc<Endpoint>, Rc<dyn dmkv_api::KvStore>), KvError> {
        self.0.client(thread)
    }
    fn node_stats(&self) -> Vec<NodeStats> {
        self.0.node_stats()
    }
}

impl Deployer for UcxDeployer {
    fn transport(&self) -> &'static str {
        "ucx"
    }
    fn deploy(
        &self,
        spec: &'static dyn EngineSpec,
        opts: &DeployOptions,
    ) -> Result<Box<dyn Deployment>, KvError> {
        Ok(Box::new(Ucx(UcxDeployment::deploy(
            spec, opts, &self.opts,
        )?)))
    }
}

/// The deployer for `--transport ucx`: listed memory nodes, or children of
/// this process (`dmkv memnode` on loopback) started for each run.
pub fn deployer(
    memnodes: &[String],
    secret_file: Option<&Path>,
) -> Result<Arc<dyn Deployer>, String> {
    let secret = match read_secret(secret_file)? {
        Some(s) => s,
        None if memnodes.is_empty() => {
            // Children started here share a fresh secret.
            dmkv_transport_ucx::deploy::fresh_secret()
        }
        None => {
            return Err(format!(
                "connecting to memory nodes needs the cluster secret: --secret-file PATH or {SECRET_ENV}"
            ));
        }
    };
    let exe = std::env::current_exe().map_err(|e| format!("cannot find this program: {e}"))?;
    let spawn: SpawnMemnode = Arc::new(move |id: NodeId, secret: &[u8], threads: usize| {
        let mut c = Command::new(&exe);
        c.args([
            "memnode",
            "--listen",
            "127.0.0.1:0",
            "--exit-on-stdin-eof",
            "--node-id",
            &id.0.to_string(),
            "--threads",
            &threads.to_string(),
        ])
        .env(SECRET_ENV, String::from_utf8_lossy(secret).as_ref());
        c
    });
    let mut opts = UcxDeployOptions::new(UcxConfig::new(secret));
    opts.memnodes = memnodes.to_vec();
    opts.spawn = Some(spawn);
    Ok(Arc::new(UcxDeployer { opts }))
}

#[cfg(test)]
mod tests {
    //! The UCX commands, run in-process against a memory node served by the
    //! test over loopback.
    use crate::cli::{EXIT_OK, EXIT_USAGE, Io, run};
    use crate::engines::REGISTRY;
    use std::ffi::OsString;

    fn dmkv(args: &[&str]) -> (i32, String, String) {
        let mut input: &[u8] = b"";
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let argv: Vec<OsString> = std::iter::once("dmkv")
            .chain(args.iter().copied())
            .map(OsString::from)
            .collect();
        let code = run(
            &REGISTRY,
            argv,
            &mut Io {
                stdin: &mut input,
                stdin_is_terminal: false,
                out: &mut out,
                err: &mut err,
                progress: false,
            },
        );
        (
            code,
            String::from_utf8(out).unwrap(),
            String::from_utf8(err).unwrap(),
        )
    }

    #[test]
    fn bench_over_ucx_against_a_listed_memory_node_verifies() {
        let dir = std::env::temp_dir().join(format!("dmkv-ucx-cli-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let secret = dir.join("secret");
        std::fs::write(&secret, "cli-test-secret\n").unwrap();
        let node = super::Memnode::start(
            &super::MemnodeOptions {
                listen: "127.0.0.1:0".parse().unwrap(),
                node: dmkv_transport::NodeId(0),
                handler_threads: 1,
                pool_bytes: None,
                data_dir: None,
                config: super::UcxConfig::tcp_loopback(b"cli-test-secret".to_vec()),
            },
            super::lookup(&REGISTRY),
        )
        .unwrap();
        let addr = node.listen_addr().to_string();
        let json = dir.join("out.json");
        let (code, out, err) = dmkv(&[
            "bench",
            "--transport",
            "ucx",
            "--memnode-addr",
            &addr,
            "--secret-file",
            secret.to_str().unwrap(),
            "--engine",
            "reference",
            "--keys",
            "2000",
            "--ops",
            "2000",
            "--verify",
            "--json",
            json.to_str().unwrap(),
        ]);
        assert_eq!(code, EXIT_OK, "{out}\n{err}");
        let r: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
        assert_eq!(r["transport"], "ucx");
        assert_eq!(r["verify"]["mismatches"], 0);
        assert_eq!(r["verify"]["checked"], 2000);
        assert!(r["memnode"]["progress_cpu_ns"].as_u64().is_some());
        // The same node refuses a client with another secret.
        std::fs::write(&secret, "another secret").unwrap();
        let (code, _, err) = dmkv(&[
            "bench",
            "--transport",
            "ucx",
            "--memnode-addr",
            &addr,
            "--secret-file",
            secret.to_str().unwrap(),
            "--engine",
            "reference",
        ]);
        assert_ne!(code, EXIT_OK);
        assert!(err.contains("secret"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn memnode_needs_a_secret_and_ucx_flags_need_ucx() {
        let (code, _, err) = dmkv(&[
            "memnode",
            "--listen",
            "127.0.0.1:0",
            "--secret-file",
            "/nonexistent/secret",
        ]);
        assert_eq!(code, EXIT_USAGE, "{err}");
        assert!(err.contains("secret"), "{err}");
        let (code, _, err) = dmkv(&[
            "bench",
            "--engine",
            "reference",
            "--memnode-addr",
            "127.0.0.1:1",
        ]);
        assert_eq!(code, EXIT_USAGE, "{err}");
        assert!(err.contains("--transport ucx"), "{err}");
    }
}
