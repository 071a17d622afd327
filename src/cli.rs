//! The command line (a contract: scripts and tests rely on these names; see
//! DESIGN.md). Bad input is one line on stderr and exit code 2; a benchmark
//! that found wrong answers or errors exits 1.

use crate::engines::Registry;
use crate::shell;
use clap::{Args, Parser, Subcommand, ValueEnum};
use dmkv_api::Knobs;
use dmkv_api::deploy::DeployOptions;
use dmkv_bench::{
    BenchConfig, BenchError, Dist, EngineChoice, KeysetSpec, Workload, WorkloadSource, defaults,
};
use std::collections::BTreeMap;
use std::ffi::OsString;
use std::io::{BufRead, Write};
use std::path::PathBuf;

/// Exit codes.
pub const EXIT_OK: i32 = 0;
/// Errors, wrong answers or verification failures.
pub const EXIT_FAILED: i32 = 1;
/// Bad input.
pub const EXIT_USAGE: i32 = 2;

#[derive(Debug, Parser)]
#[command(
    name = "dmkv",
    version,
    about = "A key-value store for disaggregated memory: XStore, ROLEX, Outback and ScaleStore behind one API"
)]
pub struct Cli {
    #[command(subcommand)]
    pub command: Command,
}

// Parsed once per process: the size of the largest variant does not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug, Subcommand)]
pub enum Command {
    /// Load a key set, run a workload on one or more engines, check every answer, report.
    Bench(BenchArgs),
    /// Serve as a memory node for other processes (needs the `ucx` feature).
    Memnode(MemnodeArgs),
    /// Deploy an engine in this process and run get/put/delete/scan by hand or from a script on stdin.
    Shell(ShellArgs),
    /// Serve one ScaleStore node in this process, with peers in other processes or hosts (needs the `ucx` feature).
    Node(crate::node::NodeArgs),
    /// Ask a `dmkv node` process to leave, or show its members or figures (needs the `ucx` feature).
    NodeCtl(crate::node::NodeCtlArgs),
    /// Deterministic simulation testing: every engine's checks on the simulated cluster across many seeds.
    Dst(DstArgs),
    /// Rerun the papers' figures: raw JSON, plots (SVG, PNG) and a table beside the paper's numbers.
    Repro(ReproArgs),
}

#[derive(Debug, Args)]
pub struct ReproArgs {
    /// List the figures shipped with dmkv.
    #[arg(long, conflicts_with = "figure")]
    pub list: bool,
    /// A figure name (see --list), `all`, or a figure file (.toml).
    #[arg(value_name = "FIGURE|all|PATH")]
    pub figure: Option<String>,
    /// A reduced run: fewer points, smaller key sets (minutes, not hours).
    #[arg(long)]
    pub quick: bool,
    /// Where to write; each figure gets DIR/NAME/NAME.{json,svg,png,md}.
    #[arg(long, value_name = "DIR", default_value = "repro-out")]
    pub out: PathBuf,
    /// A knob for every point, applied after the figure's own (it wins):
    /// e.g. `--set scalestore.load=one` runs Fig. 7 with the harness's
    /// single-node load. Repeatable.
    #[arg(long = "set", value_name = "ENGINE.KNOB=VALUE")]
    pub set: Vec<String>,
}

#[derive(Debug, Args)]
pub struct DstArgs {
    /// Engines to test (default: every design).
    #[arg(long, value_name = "NAME[,NAME...]")]
    pub engine: Option<String>,
    /// How many seeds per engine, starting at --first-seed.
    #[arg(long, value_name = "N", default_value_t = 100)]
    pub seeds: u64,
    #[arg(long, value_name = "S", default_value_t = 0)]
    pub first_seed: u64,
    #[arg(long, value_name = "N", default_value_t = 256)]
    pub keys: u64,
    #[arg(long, value_name = "N", default_value_t = 1200)]
    pub ops: u64,
    /// Nodes of a symmetric design (ScaleStore).
    #[arg(long, value_name = "N", default_value_t = 3)]
    pub nodes: usize,
    /// Seeded random extra delay of up to this per message.
    #[arg(long, value_name = "NS", default_value_t = 400)]
    pub jitter_ns: u64,
    #[arg(long, value_name = "NAME|PATH", default_value = "rolex-cx5")]
    pub profile: String,
    /// Faults the seed may inject: delay (large delays on chosen messages,
    /// reordering them across connections), kill (a compute client dies
    /// mid-operation), crash (a memory node crashes mid-run), large (values
    /// of several cache lines, so reads tear where writes land), or all.
    #[arg(long, value_name = "KIND[,KIND...]", default_value = "")]
    pub faults: crate::dst::Faults,
    /// An operation of the mixed run or the insert race (or of the kill
    /// phase before its kill) still running after this many milliseconds
    /// of virtual time fails the seed (a livelock or a wait that never
    /// ends) and stops the run.
    #[arg(long, value_name = "MS", default_value_t = crate::dst::OP_LIMIT.as_millis() as u64)]
    pub op_limit_ms: u64,
    /// A synchronous wait (an RPC handler's `block_on`, `sleep_blocking`,
    /// `ssd_io_blocking`; worker jobs suspend instead) that holds the frame
    /// below it, whose tasks are done, for longer than this many
    /// milliseconds of virtual time fails the seed (docs/simulation.md,
    /// "The rule for synchronous waits"). Checked in every phase.
    #[arg(long, value_name = "MS", default_value_t = crate::dst::HOLD_LIMIT.as_millis() as u64)]
    pub hold_limit_ms: u64,
    /// An engine setting, e.g. --set rolex.slt_slots=8 (repeatable).
    #[arg(long = "set", value_name = "ENGINE.KNOB=VALUE")]
    pub set: Vec<String>,
    /// on: each seed also draws engine settings that take other code paths
    /// than the defaults (another lock protocol, no cache, small nodes;
    /// the list is `dst::VARIANTS`, docs/simulation.md), except those given
    /// with --set; the replay command names them. off: defaults only.
    #[arg(long, value_name = "on|off", default_value = "on", value_parser = ["on", "off"])]
    pub variants: String,
}

/// `--pin-threads`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum PinThreads {
    /// `distinct` when the run's handler and compute threads fit on CPUs of
    /// their own (one memory node, one node), else `none`.
    Auto,
    Distinct,
    Shared,
    /// The OS places every thread.
    None,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub enum Transport {
    Local,
    Ucx,
    /// A simulated cluster in virtual time, with a hardware model (--profile).
    Sim,
}

#[derive(Debug, Args)]
pub struct BenchArgs {
    /// Engines to compare, in order (ratios are relative to the first); default: the default comparison set.
    #[arg(long, value_name = "NAME[,NAME...]")]
    pub engine: Option<String>,
    /// ycsb-a ... ycsb-f, insert, load, or mixed:R,U,I,D,S (percentages of read, update, insert, delete, scan).
    #[arg(long, conflicts_with = "trace")]
    pub workload: Option<Workload>,
    /// uniform, zipfian (θ = 0.99, scrambled) or latest; default: latest for ycsb-d, else uniform.
    #[arg(long, conflicts_with = "trace")]
    pub dist: Option<Dist>,
    /// uniform, sequential, normal, lognormal or sosd:PATH.
    #[arg(long, conflicts_with = "trace", value_name = "KEYSET")]
    pub keyset: Option<KeysetSpec>,
    /// Replay a YCSB trace (verbose BasicDB output of `ycsb run`) instead of a synthetic workload;
    /// without --trace-load, the keys the run reads, updates, deletes or scans before inserting them are loaded.
    #[arg(long, value_name = "PATH")]
    pub trace: Option<PathBuf>,
    /// With --trace: YCSB's load phase (verbose BasicDB output of `ycsb load`, INSERT lines only);
    /// exactly its keys are loaded before the run is replayed.
    #[arg(long, value_name = "PATH")]
    pub trace_load: Option<PathBuf>,
    /// Keys loaded before the run.
    #[arg(long, value_name = "N", default_value_t = defaults::KEYS, conflicts_with = "trace")]
    pub keys: u64,
    /// Operations in the run.
    #[arg(long, value_name = "N", default_value_t = defaults::OPS, conflicts_with = "trace")]
    pub ops: u64,
    /// Run N operations first, from the same request streams (same mix and
    /// key distribution), and measure only the --ops after them: caches and
    /// the memory nodes reach their steady state before the run. The
    /// warm-up's errors and wrong answers still fail the run; the JSON's
    /// `warmup` gives its operations, time and costs per operation. With
    /// --trace, the trace's first N operations (each task's share).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub warmup_ops: u64,
    /// Value size in bytes (at least 8: values check themselves).
    #[arg(long, value_name = "BYTES", default_value_t = defaults::VALUE_SIZE)]
    pub value_size: usize,
    /// How updates and inserts make their values: derived (from key and
    /// version; the default) or random-string (as ScaleStore's YCSB driver:
    /// one MT19937-64 draw and a modulo per byte, charged to the client core
    /// on --transport sim at the profile's instruction term).
    #[arg(long, value_name = "GEN", default_value = "derived")]
    pub value_gen: dmkv_bench::valuegen::ValueGen,
    /// Compute threads [default: 1; with --nodes K > 1, K: one per node].
    #[arg(long, value_name = "T")]
    pub threads: Option<usize>,
    /// Tasks (coroutines) per compute thread.
    #[arg(long, value_name = "C", default_value_t = defaults::TASKS)]
    pub tasks: usize,
    /// RPC handler threads per memory node.
    #[arg(long, value_name = "M", default_value_t = defaults::MEMNODE_THREADS)]
    pub memnode_threads: usize,
    /// Memory nodes an engine spreads over.
    #[arg(long, value_name = "K", default_value_t = defaults::MEMNODES)]
    pub memnodes: usize,
    /// Symmetric nodes (ScaleStore).
    #[arg(long, value_name = "K", default_value_t = defaults::NODES)]
    pub nodes: usize,
    /// Cache per symmetric node, MiB (ScaleStore).
    #[arg(long, value_name = "MB", default_value_t = defaults::CACHE_MB)]
    pub cache_mb: u64,
    /// Where symmetric nodes keep on-disk data (ScaleStore).
    #[arg(long, value_name = "PATH")]
    pub data_dir: Option<PathBuf>,
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    pub transport: Transport,
    /// With --transport ucx: running memory nodes (`dmkv memnode --listen`)
    /// to use, in order; without it, --memnodes children start on loopback.
    #[arg(long, value_name = "ADDR[,ADDR...]", value_delimiter = ',')]
    pub memnode_addr: Vec<String>,
    /// With --transport ucx and --engine scalestore: running ScaleStore node
    /// processes (`dmkv node --listen`); compute thread t sends its
    /// operations to node t % K, whose workers run them.
    #[arg(
        long,
        value_name = "ADDR[,ADDR...]",
        value_delimiter = ',',
        conflicts_with = "memnode_addr"
    )]
    pub node_addr: Vec<String>,
    /// With --transport ucx: a file holding the cluster secret (else the
    /// DMKV_SECRET environment variable; children started here get a fresh one).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// After the run, read back every key and check it.
    #[arg(long)]
    pub verify: bool,
    /// Crash memory node NODE (0-based) once FRACTION of the run's
    /// operations have completed, e.g. 1@0.5; needs --memnodes 2 or more
    /// and --transport local or sim. Reports failover time and the errors
    /// clients saw.
    #[arg(long, value_name = "NODE@FRACTION")]
    pub crash_memnode: Option<dmkv_bench::CrashPlan>,
    /// Write the reports as JSON (an object, or an array for several engines),
    /// each with `run`: the command line, seed, profile and git commit.
    #[arg(long, value_name = "PATH")]
    pub json: Option<PathBuf>,
    /// Report throughput per interval of this many milliseconds of the run
    /// (virtual time under --transport sim), in the JSON's `timeline`.
    #[arg(long, value_name = "MS")]
    pub timeline_ms: Option<f64>,
    /// Each node's threads draw keys only from their node's partition of the
    /// loaded keys (contiguous in key order, one per node: --nodes for
    /// ScaleStore, where thread t runs on node t % nodes; --compute-nodes
    /// under --transport sim for the others, thread t on compute node
    /// t / threads). Uniform or zipfian within the partition; reads,
    /// updates, scans and read-modify-writes only.
    #[arg(long)]
    pub partitioned: bool,
    /// With --partitioned: every MS milliseconds of the run (virtual time
    /// under --transport sim) reassign the partitions: after the k-th
    /// shift, node i draws from partition (i + k) mod N.
    #[arg(long, value_name = "MS")]
    pub shift_every_ms: Option<f64>,
    /// Draw the run (throughput, latency percentiles, per-op counters per
    /// engine) as SVG (PATH ending .svg) or PNG (any other PATH).
    #[arg(long, value_name = "PATH")]
    pub plot: Option<PathBuf>,
    /// Seed of the key set and the request streams.
    #[arg(long, value_name = "S", default_value_t = defaults::SEED)]
    pub seed: u64,
    /// An engine setting, e.g. --set xstore.submodels=500000 (repeatable).
    #[arg(long = "set", value_name = "ENGINE.KNOB=VALUE")]
    pub set: Vec<String>,
    /// Local transport: copy every read in pieces, yielding between them, so
    /// that concurrent writes tear it (engines must detect and retry).
    #[arg(long)]
    pub torn_reads: bool,
    /// Local transport: add this network latency to every round trip.
    #[arg(long, value_name = "MICROS", default_value_t = 0)]
    pub rtt_us: u64,
    /// Local transport: how long an idle RPC handler thread polls its queue
    /// (yielding its core between polls) before it blocks until a request
    /// wakes it (0: block at once).
    #[arg(long, value_name = "MICROS",
          default_value_t = dmkv_transport::local::DEFAULT_HANDLER_POLL.as_micros() as u64)]
    pub handler_poll_us: u64,
    /// Local transport: the same for a handler thread pinned to a CPU of its
    /// own (--pin-threads), which polls without yielding.
    #[arg(long, value_name = "MICROS",
          default_value_t = dmkv_transport::local::DEFAULT_HANDLER_POLL_OWN_CPU.as_micros() as u64)]
    pub handler_poll_own_cpu_us: u64,
    /// Local transport: pin RPC handler and compute threads to CPUs.
    /// `distinct`: each on a CPU of its own (refused when the process may
    /// use fewer CPUs than --memnode-threads + --threads); `shared`: all on
    /// one CPU; `none`: the OS places them; `auto` (the default): `distinct`
    /// when they fit (one memory node, one node), else `none`.
    #[arg(long, value_enum, value_name = "HOW")]
    pub pin_threads: Option<PinThreads>,
    /// With --transport sim: the hardware profile, a shipped name
    /// (xstore-cx4, rolex-cx5, outback-cx6, scalestore-cx5) or a TOML file.
    #[arg(long, value_name = "NAME|PATH")]
    pub profile: Option<String>,
    /// With --transport sim: compute nodes, each running --threads threads
    /// of --tasks tasks and with its own NIC.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub compute_nodes: usize,
    /// With --transport sim: add a seeded random delay of up to this many
    /// nanoseconds to every message (explores interleavings; --seed replays).
    #[arg(long, value_name = "NS", default_value_t = 0)]
    pub jitter_ns: u64,
    /// With --transport sim: draw each operation's client CPU (seeded)
    /// from the profile's cpu_per_op_ns +- NS, keeping its mean: randomises
    /// the phases of a closed loop of identical clients (docs/simulation.md,
    /// "Phase effects"). Overrides the profile's client.cpu_per_op_spread_ns.
    #[arg(long, value_name = "NS")]
    pub cpu_spread_ns: Option<u64>,
    /// With --transport sim: delay PER_MILLION of the messages by a seeded
    /// MAX_NS/2..MAX_NS each (reorders them across connections, never within
    /// one queue pair).
    #[arg(long, value_name = "PER_MILLION@MAX_NS")]
    pub delay_faults: Option<dmkv_transport::sim::MessageDelays>,
    /// With --transport sim: the key count the profile's memory-node cache
    /// stands for (the paper's); the simulated cache is scaled by
    /// --keys / N, keeping the paper's ratio of index to cache bytes.
    #[arg(long, value_name = "N")]
    pub llc_keys: Option<u64>,
    /// With --transport sim: an operation still running after this many
    /// milliseconds of virtual time fails the run (printed with its key)
    /// and stops it: catches livelocks and waits that never end.
    #[arg(long, value_name = "MS")]
    pub op_limit_ms: Option<u64>,
    /// Keys per load call: the harness loads the key set in ascending calls
    /// of this many keys (engines build from the first call and insert the
    /// rest, or build each). `dmkv dst` loads in calls of 64 and names this
    /// in its replay commands.
    #[arg(long, value_name = "N", default_value_t = dmkv_bench::config::defaults::LOAD_CHUNK)]
    pub load_chunk: usize,
}

#[derive(Debug, Args)]
pub struct MemnodeArgs {
    /// Address to listen on.
    #[arg(long, value_name = "ADDR")]
    pub listen: String,
    /// RPC handler threads.
    #[arg(long, value_name = "M", default_value_t = defaults::MEMNODE_THREADS)]
    pub threads: usize,
    /// Memory pool size, MiB.
    #[arg(long, value_name = "MB")]
    pub pool_mb: Option<u64>,
    /// This node's id (memory nodes of one engine have distinct ids).
    #[arg(long, value_name = "N", default_value_t = 0)]
    pub node_id: u16,
    /// A file holding the cluster secret (else the DMKV_SECRET environment variable).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
    /// Exit when standard input closes (for memory nodes started by `dmkv bench`).
    #[arg(long)]
    pub exit_on_stdin_eof: bool,
    /// This node's directory for engines' on-disk state (XStore's logs with
    /// xstore.durability=on); it replaces the compute side's --data-dir.
    /// A node restarted on it recovers what was logged there.
    #[arg(long, value_name = "PATH")]
    pub data_dir: Option<PathBuf>,
}

#[derive(Debug, Args)]
pub struct ShellArgs {
    /// Engine to deploy; default: the first of the default comparison set.
    #[arg(long, value_name = "NAME")]
    pub engine: Option<String>,
    #[arg(long, value_name = "M", default_value_t = defaults::MEMNODE_THREADS)]
    pub memnode_threads: usize,
    #[arg(long, value_name = "K", default_value_t = defaults::MEMNODES)]
    pub memnodes: usize,
    #[arg(long, value_name = "K", default_value_t = defaults::NODES)]
    pub nodes: usize,
    #[arg(long, value_name = "MB", default_value_t = defaults::CACHE_MB)]
    pub cache_mb: u64,
    #[arg(long, value_name = "PATH")]
    pub data_dir: Option<PathBuf>,
    #[arg(long = "set", value_name = "ENGINE.KNOB=VALUE")]
    pub set: Vec<String>,
    /// local (the engine in this process) or ucx (memory nodes, or
    /// ScaleStore node processes with --node-addr); not sim.
    #[arg(long, value_enum, default_value_t = Transport::Local)]
    pub transport: Transport,
    /// With --transport ucx: running memory nodes (`dmkv memnode --listen`);
    /// without it (and without --node-addr), --memnodes children start on loopback.
    #[arg(long, value_name = "ADDR[,ADDR...]", value_delimiter = ',')]
    pub memnode_addr: Vec<String>,
    /// With --transport ucx and --engine scalestore: running ScaleStore node
    /// processes (`dmkv node`); the shell's operations go to the first.
    #[arg(
        long,
        value_name = "ADDR[,ADDR...]",
        value_delimiter = ',',
        conflicts_with = "memnode_addr"
    )]
    pub node_addr: Vec<String>,
    /// With --transport ucx: a file holding the cluster secret (else DMKV_SECRET).
    #[arg(long, value_name = "PATH")]
    pub secret_file: Option<PathBuf>,
}

/// Where a command reads and writes; the binary passes the process's own.
pub struct Io<'a> {
    pub stdin: &'a mut dyn BufRead,
    pub stdin_is_terminal: bool,
    pub out: &'a mut dyn Write,
    pub err: &'a mut dyn Write,
    /// Draw progress bars (on the process's stderr).
    pub progress: bool,
}

/// A message for stderr and the exit code that goes with it.
#[derive(Debug)]
pub(crate) struct Failure(pub i32, pub String);

fn usage(msg: impl Into<String>) -> Failure {
    Failure(EXIT_USAGE, msg.into())
}

#[cfg(not(feature = "ucx"))]
const NO_UCX: &str = "dmkv was built without the `ucx` feature, so it has no UCX transport";

/// Runs the command line `args` (including the program name) and returns
/// the process's exit code.
pub fn run(registry: &Registry, args: Vec<OsString>, io: &mut Io<'_>) -> i32 {
    let argv: Vec<String> = args
        .iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    let cli = match Cli::try_parse_from(args) {
        Ok(cli) => cli,
        Err(e) => return clap_error(e, io),
    };
    let result = match cli.command {
        Command::Bench(args) => bench(registry, args, &argv, io),
        #[cfg(feature = "ucx")]
        Command::Memnode(args) => crate::ucx::memnode(registry, args, io.out).map_err(usage),
        #[cfg(not(feature = "ucx"))]
        Command::Memnode(_) => Err(usage(format!(
            "{NO_UCX}: `dmkv memnode` cannot serve other processes (run engines in-process with `dmkv bench --transport local`)"
        ))),
        #[cfg(feature = "ucx")]
        Command::Node(args) => crate::node::node(args, io.out).map_err(usage),
        #[cfg(feature = "ucx")]
        Command::NodeCtl(args) => crate::node::node_ctl(args, io.out).map_err(usage),
        #[cfg(not(feature = "ucx"))]
        Command::Node(_) | Command::NodeCtl(_) => Err(usage(format!(
            "{NO_UCX}: `dmkv node` cannot run ScaleStore nodes as processes (run them in-process with `dmkv bench --engine scalestore --nodes K`)"
        ))),
        Command::Shell(args) => shell_command(registry, args, io),
        Command::Dst(args) => dst_command(registry, args, io),
        Command::Repro(args) => repro_command(registry, args, io),
    };
    match result {
        Ok(code) => code,
        Err(Failure(code, msg)) => {
            let _ = writeln!(io.err, "error: {msg}");
            code
        }
    }
}

/// Help and version go to stdout with their own exit code; any other clap
/// error becomes its first line (e.g. `error: invalid value ...`) and exit 2.
fn clap_error(e: clap::Error, io: &mut Io<'_>) -> i32 {
    use clap::error::ErrorKind;
    let text = e.render().to_string();
    match e.kind() {
        ErrorKind::DisplayHelp | ErrorKind::DisplayVersion => {
            let _ = write!(io.out, "{text}");
            EXIT_OK
        }
        ErrorKind::DisplayHelpOnMissingArgumentOrSubcommand | ErrorKind::MissingSubcommand => {
            let _ = write!(io.err, "{text}");
            EXIT_USAGE
        }
        _ => {
            let first = text.lines().next().unwrap_or("error: bad arguments");
            let _ = writeln!(io.err, "{first} (see dmkv --help)");
            EXIT_USAGE
        }
    }
}

/// Parses `--set ENGINE.KNOB=VALUE` flags into knobs per engine name.
fn parse_sets(registry: &Registry, sets: &[String]) -> Result<BTreeMap<String, Knobs>, Failure> {
    let mut out: BTreeMap<String, Knobs> = BTreeMap::new();
    for s in sets {
        let bad = || usage(format!("--set {s:?} is not ENGINE.KNOB=VALUE"));
        let (name, value) = s.split_once('=').ok_or_else(bad)?;
        let (engine, knob) = name.split_once('.').ok_or_else(bad)?;
        if engine.is_empty() || knob.is_empty() {
            return Err(bad());
        }
        if registry.find(engine).is_none() {
            return Err(usage(format!(
                "--set {s}: unknown engine {engine:?} (known: {})",
                registry.names().join(", ")
            )));
        }
        out.entry(engine.to_string()).or_default().set(knob, value);
    }
    Ok(out)
}

fn choices(
    registry: &Registry,
    engine_arg: Option<&str>,
    sets: &[String],
    err: &mut dyn Write,
) -> Result<Vec<EngineChoice>, Failure> {
    let specs = registry.resolve(engine_arg).map_err(usage)?;
    let mut knobs = parse_sets(registry, sets)?;
    let choices: Vec<EngineChoice> = specs
        .iter()
        .map(|&spec| EngineChoice {
            spec,
            knobs: knobs.remove(spec.name()).unwrap_or_default(),
        })
        .collect();
    for c in &choices {
        c.knobs
            .check(c.spec.name(), c.spec.knobs())
            .map_err(|e| usage(e.to_string()))?;
    }
    for engine in knobs.keys() {
        let _ = writeln!(
            err,
            "note: ignoring --set {engine}.*: {engine} is not in this run"
        );
    }
    Ok(choices)
}

fn dst_command(registry: &Registry, a: DstArgs, io: &mut Io<'_>) -> Result<i32, Failure> {
    let engines = match &a.engine {
        Some(list) => registry.resolve(Some(list)).map_err(usage)?,
        None => crate::dst::engines()
            .iter()
            .map(|n| registry.find(n).expect("a registered engine"))
            .collect(),
    };
    if a.seeds == 0 || a.keys == 0 || a.ops == 0 || a.op_limit_ms == 0 || a.hold_limit_ms == 0 {
        return Err(usage(
            "--seeds, --keys, --ops, --op-limit-ms and --hold-limit-ms must be at least 1",
        ));
    }
    dmkv_transport::sim::Profile::load(&a.profile).map_err(usage)?;
    let params = crate::dst::DstParams {
        keys: a.keys,
        ops: a.ops,
        nodes: a.nodes,
        jitter_ns: a.jitter_ns,
        profile: a.profile,
        faults: a.faults,
        op_limit: std::time::Duration::from_millis(a.op_limit_ms),
        hold_limit: std::time::Duration::from_millis(a.hold_limit_ms),
        knobs: parse_sets(registry, &a.set)?,
        variants: a.variants == "on",
        ..Default::default()
    };
    let failures = crate::dst::sweep(
        &engines,
        a.first_seed..a.first_seed + a.seeds,
        &params,
        io.out,
    );
    Ok(if failures.is_empty() {
        EXIT_OK
    } else {
        EXIT_FAILED
    })
}

/// The compute threads of a bench run. Compute thread `t` of a symmetric
/// design issues from node `t % K`, so one thread with `--nodes K > 1` would
/// run every operation on node 0 and send no message: without `--threads`
/// the run gets one thread per node, and a run with fewer threads than nodes
/// is told which nodes stay idle.
fn bench_threads(threads: Option<usize>, nodes: usize, err: &mut dyn Write) -> usize {
    match threads {
        None if nodes > 1 => {
            let _ = writeln!(
                err,
                "note: --threads not given: {nodes} compute threads, one per node of --nodes {nodes}"
            );
            nodes
        }
        None => defaults::THREADS,
        Some(t) => {
            if t > 0 && t < nodes {
                let _ = writeln!(
                    err,
                    "note: --threads {t} < --nodes {nodes}: nodes {t}..{} issue no operations (they only serve)",
                    nodes - 1
                );
            }
            t
        }
    }
}

/// The CPU placement of a bench run's handler and compute threads
/// (`--pin-threads`; `None`: the OS places them).
///
/// `auto`, the default, pins each thread to a CPU of its own when they fit
/// and the run has one memory node and one node: left to the OS, one
/// handler and one compute thread on a 2-CPU host land sometimes on one CPU
/// and sometimes on two, and on one CPU RPCs are served at about half the
/// rate, so identical runs disagreed (docs/performance.md, "Eleventh
/// session").
/// With several memory nodes (handler thread `h` of every node would share
/// one CPU) or ScaleStore nodes (their workers are threads of their own)
/// `auto` leaves placement to the OS, as it does on other transports.
fn placement_plan(
    how: Option<PinThreads>,
    transport: Transport,
    (handlers, memnodes): (usize, usize),
    compute: usize,
    nodes: usize,
) -> Result<Option<dmkv_transport::placement::Plan>, Failure> {
    use dmkv_transport::placement::Plan;
    let how = how.unwrap_or(PinThreads::Auto);
    if transport != Transport::Local {
        return match how {
            PinThreads::Auto | PinThreads::None => Ok(None),
            _ => Err(usage("--pin-threads is a local-transport knob")),
        };
    }
    let plan = match how {
        PinThreads::None => return Ok(None),
        PinThreads::Auto => {
            return Ok(if memnodes <= 1 && nodes <= 1 {
                Plan::distinct(handlers, compute).ok()
            } else {
                None
            });
        }
        PinThreads::Distinct => Plan::distinct(handlers, compute),
        PinThreads::Shared => Plan::shared(),
    };
    plan.map(Some)
        .map_err(|e| usage(format!("--pin-threads: {e}")))
}

fn repro_command(registry: &Registry, a: ReproArgs, io: &mut Io<'_>) -> Result<i32, Failure> {
    if !a.list && a.figure.is_none() {
        return Err(usage(
            "dmkv repro needs --list, a figure name, `all`, or a figure file",
        ));
    }
    let ok = crate::repro::command(
        registry,
        a.list,
        a.figure.as_deref(),
        a.quick,
        &a.out,
        &a.set,
        io,
    )
    .map_err(usage)?;
    Ok(if ok { EXIT_OK } else { EXIT_FAILED })
}

/// One engine's report as `--json` writes it: the report, plus `run`, what
/// reruns it exactly (the command line, which holds every flag and the
/// seed; the hardware profile; the git commit of the binary).
pub(crate) fn report_json(r: &dmkv_bench::EngineReport, argv: &[String]) -> serde_json::Value {
    let mut v = serde_json::to_value(r).unwrap_or(serde_json::Value::Null);
    if let serde_json::Value::Object(m) = &mut v {
        m.insert(
            "run".into(),
            serde_json::json!({
                "command": argv,
                "seed": r.seed,
                "profile": r.sim.as_ref().map(|s| s.profile.clone()),
                "git_commit": crate::repro::GIT_COMMIT,
                "dmkv_version": env!("CARGO_PKG_VERSION"),
            }),
        );
        // `--value-gen` only when not the default, so default reports are
        // as before.
        if let (Some(g), Some(serde_json::Value::Object(run))) = (&r.value_gen, m.get_mut("run")) {
            run.insert("value_gen".into(), g.clone().into());
        }
    }
    v
}

fn bench(
    registry: &Registry,
    mut a: BenchArgs,
    argv: &[String],
    io: &mut Io<'_>,
) -> Result<i32, Failure> {
    let json = a.json.take();
    let plot = a.plot.take();
    let cfg = bench_config(registry, a, io.err, io.progress)?;
    // Fail on an unwritable report path before spending minutes on a run.
    for path in json.iter().chain(&plot) {
        std::fs::File::create(path)
            .map_err(|e| usage(format!("cannot write {}: {e}", path.display())))?;
    }
    let outcome = dmkv_bench::run(&cfg).map_err(bench_failure)?;
    let write = |r: std::io::Result<()>| r.map_err(|e| Failure(EXIT_FAILED, e.to_string()));
    write(dmkv_bench::print_table(io.out, &outcome.reports))?;
    write(crate::node::print_per_node(io.out, &outcome.reports))?;
    for f in &outcome.failures {
        let _ = writeln!(io.err, "error: engine {}: {}", f.engine, f.error);
    }
    if let Some(path) = &json {
        let values: Vec<serde_json::Value> = outcome
            .reports
            .iter()
            .map(|r| report_json(r, argv))
            .collect();
        let text = if values.len() == 1 {
            serde_json::to_string_pretty(&values[0])
        } else {
            serde_json::to_string_pretty(&values)
        }
        .map_err(|e| Failure(EXIT_FAILED, e.to_string()))?;
        std::fs::write(path, text + "\n")
            .map_err(|e| Failure(EXIT_FAILED, format!("cannot write {}: {e}", path.display())))?;
    }
    if let Some(path) = &plot {
        crate::repro::plot::bench_plot(&outcome.reports, path)
            .map_err(|e| Failure(EXIT_FAILED, e))?;
    }
    if outcome.ok() {
        Ok(EXIT_OK)
    } else {
        let bad: Vec<&str> = outcome
            .reports
            .iter()
            .filter(|r| !r.ok)
            .map(|r| r.engine.as_str())
            .chain(outcome.failures.iter().map(|f| f.engine.as_str()))
            .collect();
        let _ = writeln!(
            io.err,
            "dmkv bench: FAILED: {} (errors, wrong answers or verification failures; see above)",
            bad.join(", ")
        );
        Ok(EXIT_FAILED)
    }
}

/// The harness configuration of `dmkv bench` arguments (everything but
/// `--json` and `--plot`), checked.
pub(crate) fn bench_config(
    registry: &Registry,
    a: BenchArgs,
    err: &mut dyn Write,
    progress: bool,
) -> Result<BenchConfig, Failure> {
    #[cfg(not(feature = "ucx"))]
    if a.transport == Transport::Ucx {
        return Err(usage(format!(
            "{NO_UCX}: --transport ucx is unavailable; use --transport local"
        )));
    }
    if a.transport != Transport::Ucx
        && (!a.memnode_addr.is_empty() || !a.node_addr.is_empty() || a.secret_file.is_some())
    {
        return Err(usage(
            "--memnode-addr, --node-addr and --secret-file need --transport ucx",
        ));
    }
    let sim = a.transport == Transport::Sim;
    if sim && (a.torn_reads || a.rtt_us > 0) {
        return Err(usage(
            "--torn-reads and --rtt-us are local-transport knobs; under --transport sim, latency comes from --profile and reads tear where virtual time puts them (add --jitter-ns to explore)",
        ));
    }
    if !sim
        && (a.profile.is_some()
            || a.compute_nodes != 1
            || a.jitter_ns > 0
            || a.cpu_spread_ns.is_some()
            || a.delay_faults.is_some()
            || a.llc_keys.is_some()
            || a.op_limit_ms.is_some())
    {
        return Err(usage(
            "--profile, --compute-nodes, --jitter-ns, --cpu-spread-ns, --delay-faults, --llc-keys and --op-limit-ms need --transport sim",
        ));
    }
    if a.op_limit_ms == Some(0) {
        return Err(usage("--op-limit-ms must be at least 1"));
    }
    let mut engines = choices(registry, a.engine.as_deref(), &a.set, err)?;
    let workload = match (a.trace, a.workload) {
        (Some(path), _) => WorkloadSource::Trace(path),
        (None, w) => WorkloadSource::Synthetic(w.unwrap_or(Workload::YcsbC)),
    };
    // The default comparison leaves out engines that cannot run a scanning
    // workload (hash designs); engines named with --engine are refused instead.
    if a.engine.is_none()
        && matches!(&workload, WorkloadSource::Synthetic(w) if w.has_run_phase() && w.mix().scan > 0)
    {
        engines.retain(|e| {
            let scans = e.spec.capabilities().scan;
            if !scans {
                let _ = writeln!(
                    err,
                    "note: leaving out {}: it has no ordered scans, which this workload needs",
                    e.spec.name()
                );
            }
            scans
        });
    }
    // With node processes (`--node-addr`) there are as many nodes as addresses.
    let nodes = if a.node_addr.is_empty() {
        a.nodes
    } else {
        a.node_addr.len()
    };
    let threads = bench_threads(a.threads, nodes, err);
    let mut cfg = BenchConfig::new(engines);
    cfg.workload = workload;
    cfg.trace_load = a.trace_load;
    cfg.dist = a.dist;
    cfg.keyset = a.keyset.unwrap_or(KeysetSpec::Uniform);
    cfg.keys = a.keys;
    cfg.ops = a.ops;
    cfg.warmup_ops = a.warmup_ops;
    cfg.value_size = a.value_size;
    cfg.value_gen = a.value_gen;
    cfg.threads = threads;
    cfg.tasks = a.tasks;
    cfg.memnode_threads = a.memnode_threads;
    cfg.memnodes = a.memnodes;
    cfg.nodes = a.nodes;
    cfg.cache_mb = a.cache_mb;
    cfg.data_dir = a.data_dir;
    cfg.verify = a.verify;
    cfg.crash = a.crash_memnode;
    cfg.seed = a.seed;
    cfg.local.faults.torn_reads = a.torn_reads;
    cfg.local.faults.round_trip_latency = std::time::Duration::from_micros(a.rtt_us);
    cfg.local.handler_poll = std::time::Duration::from_micros(a.handler_poll_us);
    cfg.local.handler_poll_own_cpu = std::time::Duration::from_micros(a.handler_poll_own_cpu_us);
    cfg.local.placement = placement_plan(
        a.pin_threads,
        a.transport,
        (a.memnode_threads, a.memnodes),
        threads,
        nodes,
    )?;
    cfg.progress = progress;
    cfg.compute_nodes = a.compute_nodes;
    cfg.op_limit = a.op_limit_ms.map(std::time::Duration::from_millis);
    cfg.load_chunk = a.load_chunk;
    if let Some(ms) = a.timeline_ms {
        if !(ms.is_finite() && ms >= 0.001) {
            return Err(usage(format!(
                "--timeline-ms {ms}: the interval must be at least 0.001 ms (1 us)"
            )));
        }
        cfg.timeline_ns = (ms * 1e6).round() as u64;
    }
    cfg.partitioned = a.partitioned;
    if let Some(ms) = a.shift_every_ms {
        if !(ms.is_finite() && ms >= 0.001) {
            return Err(usage(format!(
                "--shift-every-ms {ms}: the interval between shifts must be at least 0.001 ms (1 us)"
            )));
        }
        cfg.shift_every_ns = (ms * 1e6).round() as u64;
    }
    if sim {
        let mut profile = match &a.profile {
            Some(p) => dmkv_transport::sim::Profile::load(p).map_err(usage)?,
            None => dmkv_transport::sim::Profile::default_profile(),
        };
        if let Some(n) = a.llc_keys {
            profile.scale_llc(a.keys, n).map_err(usage)?;
        }
        if let Some(ns) = a.cpu_spread_ns {
            profile.set_cpu_spread(ns).map_err(usage)?;
        }
        cfg.deployer = std::sync::Arc::new(dmkv_bench::SimDeployer {
            options: dmkv_api::sim_deploy::SimOptions {
                config: dmkv_transport::sim::SimConfig {
                    profile,
                    seed: a.seed,
                    jitter_ns: a.jitter_ns,
                    delays: a.delay_faults.unwrap_or_default(),
                },
                compute_nodes: a.compute_nodes,
                threads_per_node: threads,
            },
        });
    }
    #[cfg(feature = "ucx")]
    if a.transport == Transport::Ucx {
        cfg.deployer = if a.node_addr.is_empty() {
            crate::ucx::deployer(&a.memnode_addr, a.secret_file.as_deref()).map_err(usage)?
        } else {
            // Node processes: as many nodes as addresses.
            cfg.nodes = a.node_addr.len();
            crate::node::node_deployer(&a.node_addr, a.secret_file.as_deref()).map_err(usage)?
        };
    }
    cfg.validate().map_err(bench_failure)?;
    Ok(cfg)
}

fn bench_failure(e: BenchError) -> Failure {
    match e {
        BenchError::Input(m) => Failure(EXIT_USAGE, m),
        BenchError::Run(m) => Failure(EXIT_FAILED, m),
    }
}

fn shell_command(registry: &Registry, a: ShellArgs, io: &mut Io<'_>) -> Result<i32, Failure> {
    let spec = registry.resolve_one(a.engine.as_deref()).map_err(usage)?;
    let mut engines = choices(registry, Some(spec.name()), &a.set, io.err)?;
    let knobs = engines.remove(0).knobs;
    if [a.memnode_threads, a.memnodes, a.nodes].contains(&0) {
        return Err(usage(
            "--memnode-threads, --memnodes and --nodes must be at least 1",
        ));
    }
    let remote = !a.memnode_addr.is_empty() || !a.node_addr.is_empty() || a.secret_file.is_some();
    if a.transport != Transport::Ucx && remote {
        return Err(usage(
            "--memnode-addr, --node-addr and --secret-file need --transport ucx",
        ));
    }
    let nodes = if a.node_addr.is_empty() {
        a.nodes
    } else {
        a.node_addr.len()
    };
    let opts = DeployOptions {
        memnodes: a.memnodes,
        nodes,
        handler_threads: a.memnode_threads,
        knobs,
        cache_mb: a.cache_mb,
        data_dir: a.data_dir,
        instance: "shell".into(),
        ..DeployOptions::default()
    };
    let (deployer, banner): (std::sync::Arc<dyn dmkv_bench::Deployer>, String) = match a.transport {
        Transport::Local => (
            std::sync::Arc::new(dmkv_bench::LocalDeployer),
            format!("engine {} ({}), in-process", spec.name(), spec.about()),
        ),
        Transport::Sim => {
            return Err(usage(
                "the shell runs in real time: --transport local or ucx",
            ));
        }
        #[cfg(not(feature = "ucx"))]
        Transport::Ucx => return Err(usage(format!("{NO_UCX}; use --transport local"))),
        #[cfg(feature = "ucx")]
        Transport::Ucx if a.node_addr.is_empty() => (
            crate::ucx::deployer(&a.memnode_addr, a.secret_file.as_deref()).map_err(usage)?,
            format!("engine {} over UCX", spec.name()),
        ),
        #[cfg(feature = "ucx")]
        Transport::Ucx => (
            crate::node::node_deployer(&a.node_addr, a.secret_file.as_deref()).map_err(usage)?,
            format!(
                "engine {} on node processes {} (operations go to the first)",
                spec.name(),
                a.node_addr.join(",")
            ),
        ),
    };
    let dep = deployer
        .deploy(spec, &opts)
        .map_err(|e| Failure(EXIT_FAILED, e.to_string()))?;
    match shell::run(&*dep, &banner, io.stdin, io.out, io.stdin_is_terminal) {
        Ok(true) => Ok(EXIT_OK),
        Ok(false) => Ok(EXIT_FAILED),
        Err(e) => Err(Failure(EXIT_FAILED, e)),
    }
}

#[cfg(test)]
mod placement_tests {
    use super::{PinThreads, Transport, placement_plan};
    use dmkv_transport::placement::{Plan, allowed_cpus};

    #[test]
    fn auto_pins_each_thread_to_a_cpu_of_its_own_only_when_they_fit() {
        let cpus = allowed_cpus().expect("the CPUs this process may use");
        let auto = |handlers, memnodes, compute, nodes| {
            placement_plan(None, Transport::Local, (handlers, memnodes), compute, nodes)
                .expect("auto never refuses")
        };
        // One handler and one compute thread: distinct CPUs when the process
        // may use two, else the OS places them.
        let expected = Plan::distinct_from(&cpus, 1, 1).ok();
        assert_eq!(auto(1, 1, 1, 1), expected);
        if let Some(plan) = &expected {
            assert_ne!(plan.handlers[0], plan.compute[0]);
        }
        // More threads than CPUs, several memory nodes, several nodes: the OS.
        assert_eq!(auto(1, 1, cpus.len(), 1), None);
        assert_eq!(auto(1, 2, 1, 1), None);
        assert_eq!(auto(1, 1, 1, 3), None);
        // Explicitly `auto` is the same as not saying.
        assert_eq!(
            placement_plan(Some(PinThreads::Auto), Transport::Local, (1, 1), 1, 1).unwrap(),
            expected
        );
    }

    #[test]
    fn explicit_placements_are_kept_or_refused_with_a_reason() {
        let cpus = allowed_cpus().expect("the CPUs this process may use");
        let none = placement_plan(Some(PinThreads::None), Transport::Local, (1, 1), 1, 1);
        assert_eq!(none.unwrap(), None);
        let shared = placement_plan(Some(PinThreads::Shared), Transport::Local, (1, 1), 1, 1)
            .unwrap()
            .expect("a plan");
        assert_eq!(shared.handlers, shared.compute);
        // `distinct` with more threads than CPUs is refused, not weakened.
        let refused = placement_plan(
            Some(PinThreads::Distinct),
            Transport::Local,
            (1, 1),
            cpus.len(),
            1,
        );
        let msg = match refused {
            Err(super::Failure(_, msg)) => msg,
            Ok(p) => panic!("distinct with too many threads gave {p:?}"),
        };
        assert!(msg.contains("--pin-threads"), "{msg}");
        // Other transports: auto and none place nothing; a placement is refused.
        for t in [Transport::Sim, Transport::Ucx] {
            assert_eq!(placement_plan(None, t, (1, 1), 1, 1).unwrap(), None);
            assert_eq!(
                placement_plan(Some(PinThreads::None), t, (1, 1), 1, 1).unwrap(),
                None
            );
            assert!(placement_plan(Some(PinThreads::Shared), t, (1, 1), 1, 1).is_err());
        }
    }
}
