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
//! parsed is an error naming its line.

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

/// Reads and parses the trace at `path`.
pub fn read_trace(path: &Path) -> Result<Trace, BenchError> {
    let file = std::fs::File::open(path)
        .map_err(|e| BenchError::input(format!("cannot read {}: {e}", path.display())))?;
    parse_trace(std::io::BufReader::new(file))
        .map_err(|e| BenchError::input(format!("{}: {e}", path.display())))
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
