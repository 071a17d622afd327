//! YCSB traces: the verbose output of YCSB's `site.ycsb.BasicDB`.
//!
//! Operation lines look like
//!
//! ```text
//! READ usertable user123 [ <all fields>]
//! INSERT usertable user123 [ field0=... ]
//! UPDATE usertable user123 [ field0=... ]
//! SCAN usertable user123 57 [ <all fields>]
//! DELETE usertable user123
//! ```
//!
//! The digits of the key (`user123` → 123) are the u64 key; fields are
//! ignored (the harness writes its own self-checking values). Any line whose
//! first word is not one of these five operations (YCSB's status output,
//! blank lines) is ignored and counted; an operation line that cannot be
//! parsed is an error naming its line, and a file with no operation at all
//! is refused (it is not a YCSB trace).
//!
//! A replay takes YCSB's run phase (`ycsb run`) and, optionally, its load
//! phase (`ycsb load`, INSERT lines only): see [`key_universe`]. With the
//! load file the store holds exactly the keys YCSB loaded before the run
//! starts; without it, only the keys the run touches before inserting them
//! are loaded (a YCSB run over 50,000 records typically touches about half).

use crate::error::BenchError;
use std::io::BufRead;
use std::path::Path;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TraceOpKind {
    Read,
    Insert,
    Update,
    /// With the number of records asked for.
    Scan(u32),
    Delete,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TraceOp {
    pub kind: TraceOpKind,
    pub key: u64,
}

/// A parsed trace.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Trace {
    /// Operations in trace order.
    pub ops: Vec<TraceOp>,
    /// Lines read.
    pub lines: u64,
    /// Lines that were not operations.
    pub ignored_lines: u64,
}

/// Reads and parses the trace at `path`; a file without a single YCSB
/// operation line is refused.
pub fn read_trace(path: &Path) -> Result<Trace, BenchError> {
    let file = std::fs::File::open(path)
        .map_err(|e| BenchError::input(format!("cannot read {}: {e}", path.display())))?;
    let trace = parse_trace(std::io::BufReader::new(file))
        .map_err(|e| BenchError::input(format!("{}: {e}", path.display())))?;
    if trace.ops.is_empty() {
        return Err(BenchError::input(format!(
            "{}: no YCSB operation in its {} lines; a trace is the verbose output of YCSB's \
             site.ycsb.BasicDB (-p basicdb.verbose=true), with lines such as \
             `READ usertable user123 [ <all fields>]`",
            path.display(),
            trace.lines
        )));
    }
    Ok(trace)
}

/// YCSB's load phase: the keys it inserted, in file order.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadTrace {
    pub keys: Vec<u64>,
    /// Lines read.
    pub lines: u64,
    /// Lines that were not operations.
    pub ignored_lines: u64,
}

/// Reads the load-phase trace at `path` (`--trace-load`): only INSERT
/// operations, each of a different key.
pub fn read_load_trace(path: &Path) -> Result<LoadTrace, BenchError> {
    let trace = read_trace(path)?;
    load_keys(&trace).map_err(|e| BenchError::input(format!("{}: {e}", path.display())))
}

/// The keys a load-phase trace inserts; refuses any other operation and a
/// key inserted twice (neither can come from `ycsb load`).
pub fn load_keys(trace: &Trace) -> Result<LoadTrace, String> {
    let mut seen = std::collections::HashSet::with_capacity(trace.ops.len());
    let mut keys = Vec::with_capacity(trace.ops.len());
    for (n, op) in trace.ops.iter().enumerate() {
        if op.kind != TraceOpKind::Insert {
            return Err(format!(
                "operation {} is a {:?} of key {}: a load file is YCSB's load phase \
                 (`ycsb load`), INSERT lines only; pass the run phase with --trace",
                n + 1,
                op.kind,
                op.key
            ));
        }
        if !seen.insert(op.key) {
            return Err(format!(
                "operation {} inserts key {} a second time; YCSB's load phase inserts each key once",
                n + 1,
                op.key
            ));
        }
        keys.push(op.key);
    }
    Ok(LoadTrace {
        keys,
        lines: trace.lines,
        ignored_lines: trace.ignored_lines,
    })
}

/// The key universe of a replay: `(keys, loaded)`, the first `loaded` keys
/// being in the store before the run, the rest absent until the run inserts
/// them. With `load` (YCSB's load phase), the loaded keys are exactly those,
/// in load order, and the run's other keys follow in order of first
/// appearance (a read of one finds nothing, as it did for YCSB). Without
/// it, a key is loaded if the run's first operation on it is not an INSERT.
pub fn key_universe(run: &Trace, load: Option<&[u64]>) -> (Vec<u64>, usize) {
    let mut known: std::collections::HashSet<u64> = std::collections::HashSet::new();
    let mut keys: Vec<u64> = Vec::new();
    if let Some(load) = load {
        for &k in load {
            if known.insert(k) {
                keys.push(k);
            }
        }
        let loaded = keys.len();
        for op in &run.ops {
            if known.insert(op.key) {
                keys.push(op.key);
            }
        }
        return (keys, loaded);
    }
    // First appearance of each key, in trace order, and whether it was an
    // insert.
    let mut inserted_first = Vec::new();
    for op in &run.ops {
        if known.insert(op.key) {
            if op.kind == TraceOpKind::Insert {
                inserted_first.push(op.key);
            } else {
                keys.push(op.key);
            }
        }
    }
    let loaded = keys.len();
    keys.extend(inserted_first);
    (keys, loaded)
}

/// Parses a trace; errors name the offending line.
pub fn parse_trace(input: impl BufRead) -> Result<Trace, String> {
    let mut trace = Trace::default();
    for (i, line) in input.split(b'\n').enumerate() {
        let line = line.map_err(|e| format!("line {}: {e}", i + 1))?;
        trace.lines += 1;
        // Field values may hold arbitrary bytes; only the first words matter.
        let line = String::from_utf8_lossy(&line);
        match parse_line(&line) {
            Ok(Some(op)) => trace.ops.push(op),
            Ok(None) => trace.ignored_lines += 1,
            Err(e) => return Err(format!("line {}: {e}: {:?}", i + 1, truncate(&line))),
        }
    }
    Ok(trace)
}

fn truncate(line: &str) -> &str {
    match line.char_indices().nth(80) {
        Some((i, _)) => &line[..i],
        None => line,
    }
}

/// One line: an operation, None for a line that is not one, or an error for
/// an operation line that is malformed.
pub fn parse_line(line: &str) -> Result<Option<TraceOp>, String> {
    let mut words = line.split_whitespace();
    let op = match words.next() {
        Some(op @ ("READ" | "INSERT" | "UPDATE" | "SCAN" | "DELETE")) => op,
        _ => return Ok(None),
    };
    let _table = words.next().ok_or("no table name")?;
    let key = parse_key(words.next().ok_or("no key")?)?;
    let kind = match op {
        "READ" => TraceOpKind::Read,
        "INSERT" => TraceOpKind::Insert,
        "UPDATE" => TraceOpKind::Update,
        "DELETE" => TraceOpKind::Delete,
        _ => {
            let n = words.next().ok_or("SCAN without a record count")?;
            TraceOpKind::Scan(
                n.parse::<u32>()
                    .map_err(|_| format!("SCAN record count {n:?} is not a number"))?,
            )
        }
    };
    Ok(Some(TraceOp { kind, key }))
}

/// `user123` → 123: the digits after a non-digit prefix.
pub fn parse_key(word: &str) -> Result<u64, String> {
    let digits = word.trim_start_matches(|c: char| !c.is_ascii_digit());
    if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!("key {word:?} is not a prefix followed by digits"));
    }
    digits
        .parse::<u64>()
        .map_err(|_| format!("key {word:?} does not fit in 64 bits"))
}
