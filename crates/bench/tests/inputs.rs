//! Inputs: key sets (incl. SOSD files), YCSB traces and workload specs.

use dmkv_bench::keyset::{self, KeysetSpec, parse_sosd};
use dmkv_bench::plan::{Plan, trace_owner};
use dmkv_bench::trace::{TraceOp, TraceOpKind, parse_key, parse_line, parse_trace, read_trace};
use dmkv_bench::workload::{Op, Workload, parse_mix};
use std::collections::{HashMap, HashSet};
use std::path::{Path, PathBuf};

fn data(file: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/data")
        .join(file)
}

/// A file under the system's temporary directory, removed (with its
/// directory once empty) when the test drops it.
struct TempFile(PathBuf);

impl Drop for TempFile {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
        if let Some(dir) = self.0.parent() {
            let _ = std::fs::remove_dir(dir); // fails while other files remain
        }
    }
}

fn temp_file(name: &str, bytes: &[u8]) -> TempFile {
    let dir = std::env::temp_dir().join(format!("dmkv-bench-inputs-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let p = dir.join(name);
    std::fs::write(&p, bytes).unwrap();
    TempFile(p)
}

fn sosd_bytes(keys: &[u64]) -> Vec<u8> {
    let mut b = (keys.len() as u64).to_le_bytes().to_vec();
    for k in keys {
        b.extend_from_slice(&k.to_le_bytes());
    }
    b
}

#[test]
fn generated_key_sets_are_distinct_and_avoid_reserved_keys() {
    for spec in [
        KeysetSpec::Uniform,
        KeysetSpec::Sequential,
        KeysetSpec::Normal,
        KeysetSpec::Lognormal,
    ] {
        let keys = keyset::generate(&spec, 20_000, &[0, 5, u64::MAX], 11).unwrap();
        assert_eq!(keys.len(), 20_000, "{spec}");
        let set: HashSet<u64> = keys.iter().copied().collect();
        assert_eq!(set.len(), keys.len(), "{spec}: distinct");
        for r in [0, 5, u64::MAX] {
            assert!(!set.contains(&r), "{spec}: reserved key {r}");
        }
        assert_eq!(
            keys,
            keyset::generate(&spec, 20_000, &[0, 5, u64::MAX], 11).unwrap()
        );
    }
    let seq = keyset::generate(&KeysetSpec::Sequential, 6, &[0, 5], 1).unwrap();
    assert_eq!(seq, [1, 2, 3, 4, 6, 7]);
    // Normal: centred on 2^63.
    let normal = keyset::generate(&KeysetSpec::Normal, 20_000, &[], 2).unwrap();
    let mean = normal.iter().map(|&k| k as f64).sum::<f64>() / normal.len() as f64;
    assert!((mean / 2f64.powi(63) - 1.0).abs() < 0.01, "{mean}");
    // Lognormal(0, 2): heavily skewed, the median near 2^40 (e^0 * scale).
    let mut logn = keyset::generate(&KeysetSpec::Lognormal, 20_000, &[], 3).unwrap();
    logn.sort_unstable();
    let median = logn[logn.len() / 2] as f64 / 2f64.powi(40);
    assert!((0.9..1.1).contains(&median), "median {median} x 2^40");
    assert!(logn[logn.len() - 1] / logn[logn.len() / 2] > 1_000);
}

#[test]
fn keyset_names_parse() {
    assert_eq!(
        "sequential".parse::<KeysetSpec>(),
        Ok(KeysetSpec::Sequential)
    );
    assert_eq!(
        "sosd:/data/books_200M_uint64".parse::<KeysetSpec>(),
        Ok(KeysetSpec::Sosd("/data/books_200M_uint64".into()))
    );
    assert!("sosd:".parse::<KeysetSpec>().is_err());
    assert!("zipf".parse::<KeysetSpec>().is_err());
    assert_eq!(KeysetSpec::Lognormal.to_string(), "lognormal");
}

#[test]
fn sosd_files_parse_dedupe_and_fail_clearly() {
    assert_eq!(parse_sosd(&sosd_bytes(&[3, 1, 2])).unwrap(), [3, 1, 2]);
    assert!(
        parse_sosd(&[1, 2, 3])
            .unwrap_err()
            .contains("shorter than its 8-byte header")
    );
    let mut truncated = sosd_bytes(&[1, 2, 3]);
    truncated.truncate(truncated.len() - 3);
    assert!(
        parse_sosd(&truncated)
            .unwrap_err()
            .contains("announces 3 keys")
    );
    let mut long = sosd_bytes(&[1, 2]);
    long.extend_from_slice(&9u64.to_le_bytes());
    assert!(parse_sosd(&long).unwrap_err().contains("announces 2 keys"));

    // Duplicates and reserved keys are dropped; the run takes a seeded sample.
    let file = temp_file(
        "keys.sosd",
        &sosd_bytes(&[10, 10, 20, 30, 40, 40, 50, u64::MAX]),
    );
    let spec = KeysetSpec::Sosd(file.0.clone());
    let keys = keyset::generate(&spec, 5, &[u64::MAX], 1).unwrap();
    let mut sorted = keys.clone();
    sorted.sort_unstable();
    assert_eq!(sorted, [10, 20, 30, 40, 50]);
    assert_eq!(keys, keyset::generate(&spec, 5, &[u64::MAX], 1).unwrap());
    let e = keyset::generate(&spec, 6, &[u64::MAX], 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("5 usable keys") && e.contains("needs 6"), "{e}");
    let e = keyset::generate(&KeysetSpec::Sosd("/no/such/file".into()), 1, &[], 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("cannot read /no/such/file"), "{e}");
    let bad = temp_file("bad.sosd", b"not a key file at all");
    let e = keyset::generate(&KeysetSpec::Sosd(bad.0.clone()), 1, &[], 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("not a SOSD key file"), "{e}");
}

#[test]
fn trace_lines_parse() {
    assert_eq!(
        parse_line("READ usertable user123 [ <all fields>]"),
        Ok(Some(TraceOp {
            kind: TraceOpKind::Read,
            key: 123
        }))
    );
    assert_eq!(
        parse_line("SCAN usertable user9 57 [ <all fields>]"),
        Ok(Some(TraceOp {
            kind: TraceOpKind::Scan(57),
            key: 9
        }))
    );
    assert_eq!(
        parse_line("DELETE usertable user18446744073709551615"),
        Ok(Some(TraceOp {
            kind: TraceOpKind::Delete,
            key: u64::MAX
        }))
    );
    for other in [
        "",
        "[READ], Operations, 6",
        "Loading workload...",
        "READING is fun",
    ] {
        assert_eq!(parse_line(other), Ok(None), "{other:?}");
    }
    assert!(parse_line("READ usertable").is_err());
    assert!(
        parse_line("SCAN usertable user1")
            .unwrap_err()
            .contains("record count")
    );
    assert!(parse_line("SCAN usertable user1 many").is_err());
    assert!(parse_key("user").is_err());
    assert!(parse_key("userabc").is_err());
    assert!(parse_key("user12x").is_err());
    assert!(
        parse_key("user18446744073709551616")
            .unwrap_err()
            .contains("64 bits")
    );
    let e =
        parse_trace("READ usertable user1 [ ]\nUPDATE usertable bob [ ]\n".as_bytes()).unwrap_err();
    assert!(e.starts_with("line 2:"), "{e}");
}

#[test]
fn the_test_trace_parses_and_splits_by_key() {
    let t = read_trace(&data("ycsb-run.log")).unwrap();
    assert_eq!((t.lines, t.ops.len(), t.ignored_lines), (29, 18, 11));
    assert_eq!(t.ops[4].key, 6_284_781_860_667_377_211);
    assert_eq!(t.ops[4].kind, TraceOpKind::Insert);
    assert!(
        read_trace(Path::new("/no/such/trace"))
            .unwrap_err()
            .to_string()
            .contains("cannot read")
    );

    let plan = Plan::from_trace(&t, 2, 2, &[]).unwrap();
    // user100, 200, 300, 400, 500 and 0 appear before any insert of them.
    let loaded: HashSet<u64> = plan.keys()[..plan.loaded()].iter().copied().collect();
    assert_eq!(loaded, HashSet::from([100, 200, 300, 400, 500, 0]));
    let inserted: HashSet<u64> = plan.keys()[plan.loaded()..].iter().copied().collect();
    assert_eq!(inserted, HashSet::from([6_284_781_860_667_377_211, 600]));
    // Every key's operations go to one task, in trace order.
    let mut per_key: HashMap<u64, Vec<Op>> = HashMap::new();
    for (g, (th, ta)) in [(0, 0), (0, 1), (1, 0), (1, 1)].into_iter().enumerate() {
        for op in plan.stream(th, ta) {
            let i = match op {
                Op::Read(i) | Op::Update(i) | Op::Insert(i) | Op::Delete(i) | Op::Scan(i, _) => i,
                Op::Rmw(_) => unreachable!(),
            };
            let key = plan.key(i);
            assert_eq!(trace_owner(key, 4), g, "key {key} replayed by its owner");
            per_key.entry(key).or_default().push(op);
        }
    }
    let user300: Vec<&str> = per_key[&300]
        .iter()
        .map(|op| match op {
            Op::Read(_) => "read",
            Op::Update(_) => "update",
            Op::Insert(_) => "insert",
            Op::Delete(_) => "delete",
            _ => "other",
        })
        .collect();
    assert_eq!(
        user300,
        ["update", "delete", "read", "insert", "update", "read"]
    );
    assert_eq!(per_key.values().map(Vec::len).sum::<usize>(), 18);
    let e = Plan::from_trace(&t, 1, 1, &[600]).unwrap_err().to_string();
    assert!(e.contains("key 600"), "{e}");
}

#[test]
fn mixed_specs_parse_or_say_why_not() {
    let m = parse_mix("10,20,30,25,15").unwrap();
    assert_eq!(
        (m.read, m.update, m.insert, m.delete, m.scan),
        (10, 20, 30, 25, 15)
    );
    assert!(parse_mix(" 100 ,0,0,0,0").is_ok());
    let m = parse_mix("40,25,15,10,5,5").unwrap();
    assert_eq!(
        (m.scan, m.rmw),
        (5, 5),
        "a sixth field is read-modify-write"
    );
    for (spec, why) in [
        ("50,50", "has 2 fields"),
        ("10,20,30,40,0,0,0", "has 7 fields"),
        ("10,20,30,x,40", "delete percentage \"x\""),
        ("10,20,30,-5,45", "delete percentage \"-5\""),
        ("10,20,30,40,1", "sum to 101"),
        ("0,0,0,0,0", "sum to 0"),
        ("", "has 1 fields"),
    ] {
        let e = parse_mix(spec).unwrap_err();
        assert!(e.contains(why), "{spec}: {e}");
    }
    assert!("mixed:1,2".parse::<Workload>().is_err());
    assert!(
        "ycsb-g"
            .parse::<Workload>()
            .unwrap_err()
            .contains("unknown workload")
    );
}
