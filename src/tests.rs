//! The command line, run in-process: names, exit codes, one-line errors.

use crate::cli::{EXIT_FAILED, EXIT_OK, EXIT_USAGE, Io, run};
use crate::engines::REGISTRY;
use std::ffi::OsString;

struct Outcome {
    code: i32,
    out: String,
    err: String,
}

fn dmkv_with_stdin(args: &[&str], stdin: &str) -> Outcome {
    let mut input = stdin.as_bytes();
    let mut out = Vec::new();
    let mut err = Vec::new();
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
    Outcome {
        code,
        out: String::from_utf8(out).unwrap(),
        err: String::from_utf8(err).unwrap(),
    }
}

fn dmkv(args: &[&str]) -> Outcome {
    dmkv_with_stdin(args, "")
}

/// Bad input: exit code 2 and exactly one line on stderr containing `needle`.
fn assert_usage_error(args: &[&str], needle: &str) {
    let o = dmkv(args);
    assert_eq!(o.code, EXIT_USAGE, "{args:?}: {}", o.err);
    assert_eq!(
        o.err.lines().count(),
        1,
        "{args:?}: one line, got {:?}",
        o.err
    );
    assert!(o.err.starts_with("error"), "{args:?}: {:?}", o.err);
    assert!(
        o.err.contains(needle),
        "{args:?}: {:?} lacks {needle:?}",
        o.err
    );
    assert!(o.out.is_empty(), "{args:?}: nothing on stdout: {:?}", o.out);
}

#[test]
fn bad_input_is_one_line_and_exit_code_2() {
    assert_usage_error(&["bench", "--engine", "nope"], "unknown engine \"nope\"");
    assert_usage_error(&["bench"], "no engine is in the default comparison set");
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--set",
            "reference.bogus=1",
        ],
        "unknown setting reference.bogus",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--set", "nodot=1"],
        "ENGINE.KNOB=VALUE",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--set", "xyz.a=1"],
        "unknown engine",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--value-size", "7"],
        "at least 8 bytes",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--workload",
            "mixed:50,50",
        ],
        "five percentages",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--workload",
            "mixed:50,50,10,0,0",
        ],
        "sum to 110",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--workload", "ycsb-z"],
        "unknown workload",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--dist", "pareto"],
        "unknown distribution",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--keyset",
            "sosd:/nonexistent/keys",
        ],
        "cannot read /nonexistent/keys",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--trace",
            "/nonexistent/trace",
        ],
        "cannot read /nonexistent/trace",
    );
    assert_usage_error(
        &["bench", "--engine", "reference", "--threads", "0"],
        "--threads",
    );
    assert_usage_error(&["bench", "--engine", "reference", "--bogus"], "--bogus");
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--trace",
            "t",
            "--workload",
            "ycsb-a",
        ],
        "cannot be used with",
    );
    assert_usage_error(
        &[
            "bench",
            "--engine",
            "reference",
            "--json",
            "/nonexistent/dir/out.json",
        ],
        "cannot write",
    );
}

#[test]
fn ucx_is_refused_clearly() {
    assert_usage_error(
        &["bench", "--engine", "reference", "--transport", "ucx"],
        "built without the `ucx` feature",
    );
    assert_usage_error(
        &["memnode", "--listen", "127.0.0.1:7000"],
        "built without the `ucx` feature",
    );
}

#[test]
fn help_goes_to_stdout() {
    let o = dmkv(&["bench", "--help"]);
    assert_eq!(o.code, EXIT_OK);
    for flag in [
        "--engine",
        "--workload",
        "--dist",
        "--keyset",
        "--trace",
        "--keys",
        "--ops",
        "--value-size",
        "--threads",
        "--tasks",
        "--memnode-threads",
        "--memnodes",
        "--nodes",
        "--cache-mb",
        "--data-dir",
        "--transport",
        "--verify",
        "--json",
        "--seed",
        "--set",
    ] {
        assert!(o.out.contains(flag), "bench --help lacks {flag}");
    }
}

#[test]
fn bench_runs_the_reference_engine_and_writes_json() {
    let dir = std::env::temp_dir().join(format!("dmkv-cli-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let json = dir.join("out.json");
    let o = dmkv(&[
        "bench",
        "--engine",
        "reference",
        "--workload",
        "ycsb-a",
        "--keys",
        "500",
        "--ops",
        "2000",
        "--threads",
        "2",
        "--tasks",
        "2",
        "--verify",
        "--json",
        json.to_str().unwrap(),
    ]);
    assert_eq!(o.code, EXIT_OK, "{}\n{}", o.out, o.err);
    assert!(
        o.out.contains("throughput (ops/s)") && o.out.contains("ok (500 keys)"),
        "{}",
        o.out
    );
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&json).unwrap()).unwrap();
    assert_eq!(v["engine"], "reference");
    assert_eq!(v["workload"], "ycsb-a");
    assert_eq!(v["ops"], 2000);
    assert_eq!(v["verify"]["checked"], 500);
    assert_eq!(v["verify"]["mismatches"], 0);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn shell_reads_a_script_from_stdin() {
    let o = dmkv_with_stdin(
        &["shell", "--engine", "reference"],
        "put 10 ten\nget 10\nscan 0 5\ndelete 10\nget 10\nquit\n",
    );
    assert_eq!(o.code, EXIT_OK, "{}", o.err);
    assert_eq!(
        o.out,
        "inserted\nten\n10 ten\n(1 pairs)\ndeleted\n(not found)\n"
    );
    let o = dmkv_with_stdin(&["shell", "--engine", "reference"], "get nope\n");
    assert_eq!(o.code, EXIT_FAILED);
    assert!(o.out.starts_with("error:"), "{}", o.out);
    let o = dmkv(&["shell"]);
    assert_eq!(o.code, EXIT_USAGE);
    assert!(o.err.contains("default comparison set"), "{}", o.err);
}

#[test]
fn a_failing_run_exits_1() {
    // A trace that inserts a key twice: the second insert must say the key
    // exists; the reference engine does, so this passes, and proves the
    // replay path end to end through the CLI.
    let dir = std::env::temp_dir().join(format!("dmkv-cli-trace-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("t.log");
    std::fs::write(
        &trace,
        "INSERT usertable user1 [ field0=a ]\nINSERT usertable user1 [ field0=b ]\nREAD usertable user1 [ <all fields>]\n[OVERALL], RunTime(ms), 10\n",
    )
    .unwrap();
    let o = dmkv(&[
        "bench",
        "--engine",
        "reference",
        "--trace",
        trace.to_str().unwrap(),
        "--verify",
    ]);
    assert_eq!(o.code, EXIT_OK, "{}\n{}", o.out, o.err);
    assert!(
        o.out.contains("3 operations, 1 other lines ignored"),
        "{}",
        o.out
    );
    std::fs::remove_dir_all(&dir).unwrap();
}
