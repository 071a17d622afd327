//! `dmkv shell`: an engine, deployed in this process or running elsewhere
//! (memory nodes, or ScaleStore node processes with `--node-addr`), driven
//! by commands read from stdin (interactive or piped).

use dmkv_api::{Key, KvStore};
use dmkv_bench::Deployment;
use dmkv_transport::exec::block_on;
use dmkv_transport::{Endpoint, OpKind, labeled};
use std::io::{self, BufRead, Write};

pub const HELP: &str = "\
commands (keys are decimal or 0x-prefixed hex; a value is the rest of the line):
  get K          the value of K
  put K V        insert or replace (upsert)
  insert K V     insert; refused if K exists
  update K V     replace; refused if K is missing
  delete K       remove K
  scan K N       up to N pairs with key >= K, in key order
  stats          the engine's figures, client cache, memory nodes, counters
  help           this text
  quit           leave (end of input works too)";

/// One parsed command.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Command {
    Get(Key),
    Put(Key, Vec<u8>),
    Insert(Key, Vec<u8>),
    Update(Key, Vec<u8>),
    Delete(Key),
    Scan(Key, usize),
    Stats,
    Help,
    Quit,
    /// A blank or comment line.
    Nothing,
}

fn parse_key(word: Option<&str>) -> Result<Key, String> {
    let w = word.ok_or("missing key")?;
    let parsed = match w.strip_prefix("0x").or_else(|| w.strip_prefix("0X")) {
        Some(hex) => u64::from_str_radix(hex, 16),
        None => w.parse::<u64>(),
    };
    parsed.map_err(|_| format!("{w:?} is not a u64 key"))
}

/// Splits off the first word of `s`.
fn word(s: &str) -> (Option<&str>, &str) {
    let s = s.trim_start();
    if s.is_empty() {
        return (None, s);
    }
    match s.find(char::is_whitespace) {
        Some(i) => (Some(&s[..i]), &s[i..]),
        None => (Some(s), ""),
    }
}

/// Splits off a key.
fn keyed(rest: &str) -> Result<(Key, &str), String> {
    let (k, rest) = word(rest);
    Ok((parse_key(k)?, rest.trim()))
}

/// Parses one input line.
pub fn parse_command(line: &str) -> Result<Command, String> {
    let line = line.trim();
    if line.is_empty() || line.starts_with('#') {
        return Ok(Command::Nothing);
    }
    let (cmd, rest) = word(line);
    let cmd = cmd.expect("the line is not empty");
    let value = |rest: &str| -> Result<Vec<u8>, String> {
        if rest.is_empty() {
            Err(format!("{cmd} needs a value"))
        } else {
            Ok(rest.as_bytes().to_vec())
        }
    };
    let no_more = |rest: &str| -> Result<(), String> {
        if rest.is_empty() {
            Ok(())
        } else {
            Err(format!("{cmd}: unexpected {rest:?}"))
        }
    };
    Ok(match cmd {
        "get" => {
            let (k, rest) = keyed(rest)?;
            no_more(rest)?;
            Command::Get(k)
        }
        "delete" | "del" => {
            let (k, rest) = keyed(rest)?;
            no_more(rest)?;
            Command::Delete(k)
        }
        "put" | "upsert" => {
            let (k, rest) = keyed(rest)?;
            Command::Put(k, value(rest)?)
        }
        "insert" => {
            let (k, rest) = keyed(rest)?;
            Command::Insert(k, value(rest)?)
        }
        "update" => {
            let (k, rest) = keyed(rest)?;
            Command::Update(k, value(rest)?)
        }
        "scan" => {
            let (k, rest) = keyed(rest)?;
            let (n, rest) = word(rest);
            no_more(rest.trim())?;
            let n = n.ok_or("scan needs a count: scan K N")?;
            let n = n
                .parse::<usize>()
                .map_err(|_| format!("{n:?} is not a count"))?;
            Command::Scan(k, n)
        }
        "stats" => Command::Stats,
        "help" | "?" => Command::Help,
        "quit" | "exit" => Command::Quit,
        other => return Err(format!("unknown command {other:?}; try help")),
    })
}

/// A value for display: text if it is printable UTF-8, else hex.
pub fn show_value(v: &[u8]) -> String {
    match std::str::from_utf8(v) {
        Ok(s) if !s.chars().any(char::is_control) => s.to_string(),
        _ => {
            let hex: String = v.iter().map(|b| format!("{b:02x}")).collect();
            format!("0x{hex}")
        }
    }
}

/// Runs commands from `input` against `dep` (as compute thread 0) until
/// `quit` or its end; `banner` says where the engine runs. Returns whether
/// every command succeeded.
pub fn run(
    dep: &dyn Deployment,
    banner: &str,
    input: &mut dyn BufRead,
    out: &mut dyn Write,
    interactive: bool,
) -> Result<bool, String> {
    let (ep, kv) = dep.client(0).map_err(|e| e.to_string())?;
    if interactive {
        writeln!(out, "dmkv shell: {banner}; type help").map_err(|e| e.to_string())?;
    }
    let mut all_ok = true;
    let mut line = String::new();
    loop {
        if interactive {
            write!(out, "dmkv> ")
                .and_then(|_| out.flush())
                .map_err(|e| e.to_string())?;
        }
        line.clear();
        if input.read_line(&mut line).map_err(|e| e.to_string())? == 0 {
            break;
        }
        let done = match parse_command(&line) {
            Err(e) => {
                all_ok = false;
                writeln!(out, "error: {e}").map(|_| false)
            }
            Ok(Command::Quit) => Ok(true),
            Ok(cmd) => match execute(dep, &ep, &*kv, cmd, out) {
                Ok(ok) => {
                    all_ok &= ok;
                    Ok(false)
                }
                Err(e) => Err(e),
            },
        };
        if done.map_err(|e| e.to_string())? {
            break;
        }
    }
    Ok(all_ok)
}

/// Runs one command; Ok(false) if the operation failed with an error
/// (already printed).
fn execute(
    dep: &dyn Deployment,
    ep: &Endpoint,
    kv: &dyn KvStore,
    cmd: Command,
    out: &mut dyn Write,
) -> io::Result<bool> {
    macro_rules! op {
        ($kind:expr, $fut:expr) => {
            match block_on(labeled($kind, $fut)) {
                Ok(v) => v,
                Err(e) => {
                    writeln!(out, "error: {e}")?;
                    return Ok(false);
                }
            }
        };
    }
    match cmd {
        Command::Get(k) => match op!(OpKind::Get, kv.get(k)) {
            Some(v) => writeln!(out, "{}", show_value(&v))?,
            None => writeln!(out, "(not found)")?,
        },
        Command::Put(k, v) => {
            let new = op!(OpKind::Upsert, kv.upsert(k, &v));
            writeln!(out, "{}", if new { "inserted" } else { "updated" })?;
        }
        Command::Insert(k, v) => {
            let done = op!(OpKind::Insert, kv.insert(k, &v));
            writeln!(out, "{}", if done { "inserted" } else { "(exists)" })?;
        }
        Command::Update(k, v) => {
            let done = op!(OpKind::Update, kv.update(k, &v));
            writeln!(out, "{}", if done { "updated" } else { "(not found)" })?;
        }
        Command::Delete(k) => {
            let done = op!(OpKind::Delete, kv.delete(k));
            writeln!(out, "{}", if done { "deleted" } else { "(not found)" })?;
        }
        Command::Scan(k, n) => {
            let items = op!(OpKind::Scan, kv.scan(k, n));
            for (key, v) in &items {
                writeln!(out, "{key} {}", show_value(v))?;
            }
            writeln!(out, "({} pairs)", items.len())?;
        }
        Command::Stats => {
            let stats = op!(OpKind::Setup, dep.engine().stats(ep));
            writeln!(out, "engine {}: {stats}", dep.engine().name())?;
            writeln!(
                out,
                "client cache: {} bytes",
                dep.engine().client_cache_bytes()
            )?;
            for (i, s) in dep.node_stats().iter().enumerate() {
                writeln!(
                    out,
                    "node {i}: memory used {} of {} bytes, {} rpcs served, handler cpu {} ns, background cpu {} ns in {} jobs",
                    s.memory_used,
                    s.memory_reserved,
                    s.rpcs_served,
                    s.handler_cpu_ns,
                    s.background_cpu_ns,
                    s.background_jobs
                )?;
            }
            let table = ep.counters();
            for kind in OpKind::ALL {
                let c = table.get(kind);
                if c.round_trips > 0 {
                    writeln!(
                        out,
                        "{}: {} round trips, {} verbs, {} rpcs, {} bytes read, {} bytes written",
                        kind.name(),
                        c.round_trips,
                        c.verbs,
                        c.rpcs,
                        c.bytes_read,
                        c.bytes_written
                    )?;
                }
            }
        }
        Command::Help => writeln!(out, "{HELP}")?,
        Command::Nothing | Command::Quit => {}
    }
    Ok(true)
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_api::deploy::{DeployOptions, LocalDeployment};
    use dmkv_testkit::reference::Reference;

    #[test]
    fn parses_commands() {
        assert_eq!(parse_command("get 7"), Ok(Command::Get(7)));
        assert_eq!(parse_command("  get 0x10 "), Ok(Command::Get(16)));
        assert_eq!(
            parse_command("put 1 hello world"),
            Ok(Command::Put(1, b"hello world".to_vec()))
        );
        assert_eq!(parse_command("scan 5 10"), Ok(Command::Scan(5, 10)));
        assert_eq!(parse_command(""), Ok(Command::Nothing));
        assert_eq!(parse_command("# note"), Ok(Command::Nothing));
        assert!(parse_command("get").is_err());
        assert!(parse_command("get x").is_err());
        assert!(parse_command("get 1 2").is_err());
        assert!(parse_command("put 1").is_err());
        assert!(parse_command("scan 1").is_err());
        assert!(parse_command("frobnicate").is_err());
    }

    #[test]
    fn shows_text_or_hex() {
        assert_eq!(show_value(b"abc"), "abc");
        assert_eq!(show_value(&[0, 255]), "0x00ff");
    }

    #[test]
    fn runs_a_script_against_the_reference_engine() {
        let script = "put 1 one\nput 2 two\nget 1\ninsert 1 again\nupdate 3 x\nscan 0 10\ndelete 2\nget 2\nget 18446744073709551615\nbogus\nstats\nquit\nget 1\n";
        let mut out = Vec::new();
        let dep = LocalDeployment::deploy(&Reference, &DeployOptions::default()).unwrap();
        let ok = run(&dep, "reference", &mut script.as_bytes(), &mut out, false).unwrap();
        let out = String::from_utf8(out).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(
            &lines[..11],
            &[
                "inserted",
                "inserted",
                "one",
                "(exists)",
                "(not found)",
                "1 one",
                "2 two",
                "(2 pairs)",
                "deleted",
                "(not found)",
                lines[10],
            ]
        );
        assert!(
            lines[10].starts_with("error:") && lines[10].contains("reserved"),
            "{out}"
        );
        assert!(lines[11].starts_with("error: unknown command"), "{out}");
        assert!(out.contains("engine reference:"), "{out}");
        assert!(!ok, "a failed command is reported");
        // Nothing after quit ran: the last line is from stats.
        assert!(!out.ends_with("one\n"), "{out}");
    }
}
