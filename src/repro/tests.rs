//! `dmkv repro` end to end on a tiny figure, the checks that refuse bad
//! figure files, the shipped figures, and `dmkv bench --plot` / `--json`.

use super::figure::{self, Figure};
use crate::cli::{EXIT_OK, EXIT_USAGE};
use crate::engines::REGISTRY;
use std::path::{Path, PathBuf};

fn dmkv(args: &[&str]) -> (i32, String, String) {
    let o = crate::tests::dmkv_with_stdin(args, "");
    (o.code, o.out, o.err)
}

/// A fresh directory under the system's temporary directory, removed when
/// the test is done with it (also when the test fails: a failed assertion
/// unwinds through the drop), so test runs do not fill the disk.
struct Scratch(PathBuf);

impl std::ops::Deref for Scratch {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn scratch(name: &str) -> Scratch {
    let d = std::env::temp_dir().join(format!("dmkv-repro-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    Scratch(d)
}

const TINY: &str = r#"
name = "tiny"
title = "Tiny: round trips per GET vs keys"
source = "no paper: a test figure"
caption = "Two engines, two key-set sizes."
transport = "local"
plot = "lines"
x_label = "keys"

[metric]
path = "per_op.round_trips"
label = "round trips per operation"

[params]
workload = "ycsb-c"
ops = 300
threads = 1
tasks = 2

[quick.params]
ops = 200

[sweep]
param = "keys"
values = [300, 600]

[[series]]
label = "rpc-hash"
engine = "rpc-hash"
[[series]]
label = "reference (BTreeMap by RPC)"
engine = "reference"

[[paper]]
series = "rpc-hash"
point = "600"
value = 2.0
source = "made up for the test: one RPC per GET is 1.0, so the ratio is 0.50"
reason = "the test's paper value is twice the truth"
"#;

fn read(p: &Path) -> String {
    std::fs::read_to_string(p).unwrap_or_else(|e| panic!("{}: {e}", p.display()))
}

#[test]
fn a_tiny_figure_runs_end_to_end_and_writes_json_svg_png_and_markdown() {
    let dir = scratch("tiny");
    let file = dir.join("tiny.toml");
    std::fs::write(&file, TINY).unwrap();
    let out = dir.join("out");
    let (code, stdout, stderr) = dmkv(&[
        "repro",
        file.to_str().unwrap(),
        "--quick",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, EXIT_OK, "stdout {stdout}\nstderr {stderr}");
    let base = out.join("tiny");

    // JSON: every (point, series) with its value and exact command.
    let json: serde_json::Value = serde_json::from_str(&read(&base.join("tiny.json"))).unwrap();
    assert_eq!(json["quick"], true);
    let points = json["points"].as_array().unwrap();
    assert_eq!(points.len(), 4, "2 points x 2 series");
    for p in points {
        assert!(p["error"].is_null(), "{p}");
        // Every GET of both engines is one RPC round trip.
        assert_eq!(p["y"].as_f64(), Some(1.0), "{}", p["series"]);
        let cmd: Vec<&str> = p["command"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_str().unwrap())
            .collect();
        assert_eq!(&cmd[..2], ["dmkv", "bench"]);
        // --quick's ops, the point's keys.
        let flag = |f: &str| cmd[cmd.iter().position(|c| *c == f).unwrap() + 1];
        assert_eq!(flag("--ops"), "200");
        assert_eq!(flag("--keys"), p["point"].as_str().unwrap());
        assert_eq!(
            p["report"]["keys"].as_u64().unwrap().to_string(),
            p["point"].as_str().unwrap()
        );
        assert_eq!(
            p["report"]["run"]["command"].as_array().unwrap().len(),
            cmd.len()
        );
    }

    // SVG: a line per series, labelled; the paper's marker in the legend.
    let svg = read(&base.join("tiny.svg"));
    assert!(svg.starts_with("<svg"), "{}", &svg[..100.min(svg.len())]);
    for label in [
        "rpc-hash",
        "reference (BTreeMap by RPC)",
        "paper value",
        "round trips per operation",
    ] {
        assert!(svg.contains(label), "SVG lacks {label:?}");
    }
    assert!(svg.matches("<polyline").count() >= 2, "one line per series");

    // PNG: a real PNG file.
    let png = std::fs::read(base.join("tiny.png")).unwrap();
    assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    assert!(png.len() > 5000, "a drawn image, not an empty one");

    // Markdown: each row, the paper's value beside ours with the ratio and
    // the reason, an empty paper cell where the paper has no number.
    let md = read(&base.join("tiny.md"));
    assert!(md.contains("## tiny: Tiny"), "{md}");
    assert!(
        md.contains("| 600 | rpc-hash | 1.00 | 2.00 | 0.50 | made up for the test"),
        "{md}"
    );
    assert!(
        md.contains("the test's paper value is twice the truth"),
        "{md}"
    );
    assert!(
        md.contains("| 300 | reference (BTreeMap by RPC) | 1.00 |  |  |  |  |"),
        "{md}"
    );
}

/// A timeline figure with an `[[extra]]` per-interval series: XStore's
/// fallbacks per GET, counted per interval by the engine sampler.
const TIMELINE: &str = r#"
name = "tl"
title = "Timeline with engine counters"
source = "no paper: a test figure"
caption = "XStore on YCSB D, fallbacks per GET per interval."
transport = "sim"
profile = "xstore-cx4"
plot = "timeline"
x_label = "time"

[metric]
path = "throughput_ops_per_s"
scale = 1e-6
label = "throughput (M ops/s)"

[[extra]]
name = "fallbacks"
path = "engine_stats.client.fallback_rate"
scale = 100
label = "fallbacks per GET (%)"
timeline = "engine_per_get.fallbacks"

[params]
workload = "ycsb-d"
keyset = "sequential"
keys = 2000
ops = 20000
compute-nodes = 2
threads = 2
tasks = 2
timeline-ms = 0.05
set = ["xstore.submodels=40"]

[[points]]
label = "latest"
params = { dist = "latest" }

[[series]]
label = "XStore"
engine = "xstore"

[[paper]]
series = "XStore"
point = "latest"
metric = "fallbacks"
value = 21.0
source = "made up for the test"
"#;

#[test]
fn a_timeline_figure_draws_per_interval_engine_counters() {
    let dir = scratch("timeline");
    let file = dir.join("tl.toml");
    std::fs::write(&file, TIMELINE).unwrap();
    let out = dir.join("out");
    let (code, stdout, stderr) = dmkv(&[
        "repro",
        file.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert_eq!(code, EXIT_OK, "stdout {stdout}\nstderr {stderr}");
    let base = out.join("tl");
    let run: serde_json::Value = serde_json::from_str(&read(&base.join("tl.json"))).unwrap();
    let p = &run["points"][0];
    let t = &p["report"]["timeline"];
    let intervals = t["ops"].as_array().unwrap().len();
    assert!(intervals >= 3, "{t}");
    // The per-interval counts add up to the engine's own whole-run totals.
    let client = &p["report"]["engine_stats"]["client"];
    for (name, total) in [
        ("gets", &client["gets"]),
        ("fallbacks", &client["fallbacks"]),
    ] {
        let per = t["engine"][name].as_array().unwrap();
        assert_eq!(per.len(), intervals, "{name}");
        let sum: u64 = per.iter().map(|x| x.as_u64().unwrap()).sum();
        assert_eq!(
            Some(sum),
            total.as_u64(),
            "{name} per interval sums to the total"
        );
    }
    let fallbacks: u64 = client["fallbacks"].as_u64().unwrap();
    assert!(
        fallbacks > 0,
        "latest reads past the trained keys fall back: {client}"
    );
    assert_eq!(
        t["engine_per_get"]["fallbacks"].as_array().unwrap().len(),
        intervals
    );
    let rate = p["extra"]["fallbacks"].as_f64().unwrap();
    assert!((rate - 100.0 * client["fallback_rate"].as_f64().unwrap()).abs() < 1e-9);
    // The table has the extra row with the paper's value; the SVG a panel.
    let md = read(&base.join("tl.md"));
    assert!(
        md.contains("| latest | XStore: fallbacks per GET (%) | "),
        "{md}"
    );
    assert!(md.contains("| 21.0 | "), "{md}");
    let svg = read(&base.join("tl.svg"));
    assert!(
        svg.contains("fallbacks per GET (%) per interval"),
        "a second panel"
    );
    assert!(svg.contains("paper: XStore 21.0"), "the paper's line");
}

#[test]
fn a_points_recorded_command_reruns_it() {
    let reg = &REGISTRY;
    let fig = Figure::parse(TINY, "tiny", reg).unwrap();
    let argv = fig.argv(&fig.points[1], &fig.series[0], false);
    let dir = scratch("rerun");
    let json = dir.join("a.json");
    let mut args: Vec<&str> = argv[1..].iter().map(String::as_str).collect();
    args.extend(["--json", json.to_str().unwrap()]);
    let (code, _, err) = dmkv(&args);
    assert_eq!(code, EXIT_OK, "{err}");
    let v: serde_json::Value = serde_json::from_str(&read(&json)).unwrap();
    assert_eq!(v["keys"], 600);
    assert_eq!(v["ops"], 300, "the full run's ops");
    assert_eq!(v["engine"], "rpc-hash");
    assert_eq!(v["run"]["seed"], 1);
    assert_eq!(v["run"]["git_commit"].as_str(), Some(super::GIT_COMMIT));
    assert!(!super::GIT_COMMIT.is_empty());
    let recorded: Vec<String> = v["run"]["command"]
        .as_array()
        .unwrap()
        .iter()
        .map(|s| s.as_str().unwrap().to_string())
        .collect();
    assert_eq!(recorded[1..argv.len()], argv[1..], "every flag recorded");
}

#[test]
fn parameters_layer_figure_then_quick_then_point_then_series() {
    let text = TINY.replace(
        "label = \"rpc-hash\"\nengine = \"rpc-hash\"",
        "label = \"rpc-hash\"\nengine = \"rpc-hash\"\nparams = { tasks = 4, set = [\"rpc-hash.buckets=1024\"] }",
    );
    let fig = Figure::parse(&text, "t", &REGISTRY).unwrap();
    let argv = fig.argv(&fig.points[0], &fig.series[0], true);
    let joined = argv.join(" ");
    assert!(joined.contains("--ops 200"), "{joined}");
    assert!(joined.contains("--keys 300"), "{joined}");
    assert!(joined.contains("--tasks 4"), "{joined}");
    assert!(joined.contains("--set rpc-hash.buckets=1024"), "{joined}");
    assert!(joined.contains("--transport local"), "{joined}");
    let full = fig.argv(&fig.points[0], &fig.series[0], false).join(" ");
    assert!(full.contains("--ops 300"), "{full}");
}

/// A point's `quick_params` apply with `--quick` only, after the point's
/// own parameters (so they win over them and over the figure's
/// `quick.params`), and before the series'; of two `set` entries for one
/// knob the later is the one passed.
#[test]
fn a_points_quick_params_apply_with_quick_only() {
    let text = TINY
        .replace(
            "[sweep]\nparam = \"keys\"\nvalues = [300, 600]",
            "[[points]]\nlabel = \"300\"\nparams = { keys = 300 }\n\
             [[points]]\nlabel = \"600\"\n\
             params = { keys = 600, tasks = 3, set = [\"rpc-hash.buckets=4096\"] }\n\
             quick_params = { keys = 60, set = [\"rpc-hash.buckets=512\"] }",
        )
        .replace(
            "label = \"rpc-hash\"\nengine = \"rpc-hash\"",
            "label = \"rpc-hash\"\nengine = \"rpc-hash\"\nparams = { tasks = 4 }",
        );
    let fig = Figure::parse(&text, "t", &REGISTRY).unwrap();
    let (small, large) = (&fig.points[0], &fig.points[1]);
    assert_eq!(large.label, "600");
    let quick = fig.argv(large, &fig.series[0], true).join(" ");
    assert!(quick.contains("--keys 60 "), "{quick}");
    assert!(quick.contains("--ops 200"), "{quick}");
    // The series' parameters still come last.
    assert!(quick.contains("--tasks 4"), "{quick}");
    let sets: Vec<&str> = quick
        .split(" --set ")
        .skip(1)
        .map(|s| s.split(' ').next().unwrap())
        .collect();
    assert_eq!(sets, ["rpc-hash.buckets=512"], "{quick}");
    let full = fig.argv(large, &fig.series[0], false).join(" ");
    assert!(full.contains("--keys 600"), "{full}");
    assert!(full.contains("--set rpc-hash.buckets=4096"), "{full}");
    assert!(!full.contains("buckets=512"), "{full}");
    // A point without quick_params is unchanged by the field.
    let other = fig.argv(small, &fig.series[1], true).join(" ");
    assert!(
        other.contains("--keys 300") && other.contains("--tasks 2"),
        "{other}"
    );
}

/// Each bad file is refused by `dmkv repro PATH` with exit code 2 and one
/// line naming the file and what is wrong.
#[test]
fn bad_figure_files_are_refused_with_a_clear_message() {
    let dir = scratch("bad");
    let cases: Vec<(String, &str)> = vec![
        (
            TINY.replace("[metric]", "colour = \"red\"\n[metric]"),
            "unknown field `colour`",
        ),
        (
            TINY.replace("engine = \"reference\"", "engine = \"nosuch\""),
            "unknown engine \"nosuch\"",
        ),
        (
            TINY.replace("tasks = 2", "tasks = 2\nwarp = 9"),
            "\"warp\" is not a `dmkv bench` flag",
        ),
        (
            TINY.replace("tasks = 2", "tasks = 2\nengine = \"race\""),
            "\"engine\" is set by the figure itself",
        ),
        (
            TINY.replace(
                "[sweep]\nparam = \"keys\"\nvalues = [300, 600]",
                "[[points]]\nlabel = \"300\"\nparams = { keys = 300 }\nquick_params = { warp = 9 }\n\
                 [[points]]\nlabel = \"600\"\nparams = { keys = 600 }",
            ),
            "point \"300\" quick_params: \"warp\" is not a `dmkv bench` flag",
        ),
        (
            TINY.replace("point = \"600\"", "point = \"700\""),
            "no point \"700\"",
        ),
        (
            TINY.replace("series = \"rpc-hash\"", "series = \"nobody\""),
            "no series \"nobody\"",
        ),
        (
            TINY.replace("transport = \"local\"", "transport = \"sim\""),
            "transport \"sim\" needs a profile",
        ),
        (
            TINY.replace("values = [300, 600]", "values = [\"small\", \"large\"]")
                .replace("point = \"600\"", "point = \"large\""),
            "a line plot needs a numeric x",
        ),
        (
            TINY.replace(
                "label = \"reference (BTreeMap by RPC)\"",
                "label = \"rpc-hash\"",
            ),
            "series \"rpc-hash\" is listed twice",
        ),
        (TINY.replace("value = 2.0", "value = \"two\""), "figure"),
        (
            TINY.replace("value = 2.0", "value = 2.0\nmetric = \"nosuch\""),
            "no [[extra]] named \"nosuch\"",
        ),
        (
            TINY.replace(
                "[params]",
                "[[extra]]\nname = \"x\"\npath = \"ops\"\nlabel = \"x\"\ntimeline = \"ops\"\n[params]",
            ),
            "a timeline series needs plot = \"timeline\"",
        ),
        (
            TINY.replace(
                "label = \"rpc-hash\"\nengine = \"rpc-hash\"",
                "label = \"rpc-hash\"\nengine = \"rpc-hash\"\npoints = [\"900\"]",
            ),
            "points: no point \"900\"",
        ),
        (
            TINY.replace(
                "label = \"rpc-hash\"\nengine = \"rpc-hash\"",
                "label = \"rpc-hash\"\nengine = \"rpc-hash\"\npoints = [\"300\"]",
            ),
            "the series does not run at that point",
        ),
        (
            TINY.replace(
                "reason = \"the test's paper value is twice the truth\"",
                &format!(
                    "reason = \"{}\"",
                    "x".repeat(figure::MAX_REASON_CHARS + 1)
                ),
            ),
            "reason: 1001 characters, more than 1000",
        ),
        (
            TINY.replace(
                "reason = \"the test's paper value is twice the truth\"",
                "reason = \"one\\ntwo\"",
            ),
            "reason: must be one line",
        ),
    ];
    for (i, (text, needle)) in cases.iter().enumerate() {
        let file = dir.join(format!("bad{i}.toml"));
        std::fs::write(&file, text).unwrap();
        let (code, out, err) = dmkv(&[
            "repro",
            file.to_str().unwrap(),
            "--out",
            dir.to_str().unwrap(),
        ]);
        assert_eq!(code, EXIT_USAGE, "case {i}: {err}");
        assert_eq!(err.lines().count(), 1, "case {i}: one line: {err:?}");
        assert!(
            err.contains(file.to_str().unwrap()),
            "case {i} names the file: {err}"
        );
        assert!(err.contains(needle), "case {i}: {err:?} lacks {needle:?}");
        assert!(out.is_empty(), "case {i}: nothing ran: {out}");
    }
    let (code, _, err) = dmkv(&["repro", "no-such-figure"]);
    assert_eq!(code, EXIT_USAGE);
    assert!(
        err.contains("xstore-fig10"),
        "lists the known figures: {err}"
    );
    let (code, _, err) = dmkv(&["repro"]);
    assert_eq!(code, EXIT_USAGE);
    assert!(err.contains("--list"), "{err}");
}

#[test]
fn every_shipped_figure_parses_and_is_listed() {
    let (code, out, err) = dmkv(&["repro", "--list"]);
    assert_eq!(code, EXIT_OK, "{err}");
    assert_eq!(out.lines().count(), figure::BUILTIN.len());
    for (name, text) in figure::BUILTIN {
        let fig = Figure::parse(text, name, &REGISTRY).unwrap();
        assert_eq!(&fig.name, name, "a shipped figure's name is its file name");
        assert!(out.contains(name));
        assert!(!fig.points_to_run(true).is_empty());
    }
    for paper in ["xstore-", "rolex-", "outback-", "scalestore-"] {
        assert!(out.contains(paper), "a figure of each paper: {paper}");
    }
}

#[test]
fn bench_plot_draws_svg_and_png() {
    let dir = scratch("plot");
    for name in ["run.svg", "run.png"] {
        let p = dir.join(name);
        let (code, _, err) = dmkv(&[
            "bench",
            "--engine",
            "rpc-hash,reference",
            "--keys",
            "300",
            "--ops",
            "300",
            "--plot",
            p.to_str().unwrap(),
        ]);
        assert_eq!(code, EXIT_OK, "{err}");
        let bytes = std::fs::read(&p).unwrap();
        if name.ends_with(".svg") {
            let svg = String::from_utf8(bytes).unwrap();
            for t in [
                "throughput",
                "latency",
                "round trips",
                "rpc-hash",
                "reference",
                "p99",
            ] {
                assert!(svg.contains(t), "SVG lacks {t:?}");
            }
        } else {
            assert_eq!(&bytes[..4], b"\x89PNG");
        }
    }
}

#[test]
fn metric_paths_read_nested_numbers() {
    let v = serde_json::json!({"a": {"b": 2.5, "c": [1, 7]}, "n": 4});
    assert_eq!(super::lookup(&v, "a.b"), Some(2.5));
    assert_eq!(super::lookup(&v, "a.c.1"), Some(7.0));
    assert_eq!(super::lookup(&v, "n"), Some(4.0));
    assert_eq!(super::lookup(&v, "a.x"), None);
    assert_eq!(super::lookup(&v, "a"), None, "an object is not a number");
}

/// A counter divided per operation counts the run alone: after a warm-up,
/// its value when the run started is taken off; undivided, or outside
/// `engine_stats`, a path reads as it is.
#[test]
fn per_op_engine_counters_leave_the_warm_up_out() {
    let metric = |path: &str, per: Option<&str>| super::figure::Metric {
        path: path.into(),
        per: per.map(Into::into),
        scale: 1.0,
        label: "x".into(),
    };
    let warm = serde_json::json!({
        "ops": 100,
        "per_op": {"rpcs": 2.0},
        "engine_stats": {"pages_from_ssd": 250, "height": 3, "gets": 500},
        "warmup": {"ops": 400, "engine_stats": {"pages_from_ssd": 200, "height": 3, "gets": 400}},
    });
    let per_ops = metric("engine_stats.pages_from_ssd", Some("ops"));
    assert_eq!(super::measure(&warm, &per_ops), Some(0.5));
    // A counter per another counter: both the run's share.
    let per_get = metric("engine_stats.pages_from_ssd", Some("engine_stats.gets"));
    assert_eq!(super::measure(&warm, &per_get), Some(0.5));
    assert_eq!(
        super::measure(&warm, &metric("engine_stats.height", None)),
        Some(3.0)
    );
    assert_eq!(
        super::measure(&warm, &metric("per_op.rpcs", Some("ops"))),
        Some(0.02)
    );
    let cold = serde_json::json!({"ops": 100, "engine_stats": {"pages_from_ssd": 250}});
    assert_eq!(super::measure(&cold, &per_ops), Some(2.5));
}

/// The value of `--FLAG` in a command line, if given with a value.
fn flag<'a>(argv: &'a [String], f: &str) -> Option<&'a str> {
    let i = argv.iter().position(|a| a == f)?;
    argv.get(i + 1).map(String::as_str)
}

/// ScaleStore Fig. 7 runs the paper's workers (§6.1: 20 worker threads
/// per node, one operation at a time, 4 message handlers) at every point,
/// verifies every run, and its partitioned series, and only those, pass
/// `--partitioned`, at two or more nodes.
#[test]
fn scalestore_fig7_runs_the_papers_workers_and_partitions_only_where_asked() {
    let fig = figure::load("scalestore-fig7", &REGISTRY).unwrap();
    let partitioned: Vec<&str> = fig
        .series
        .iter()
        .filter(|s| s.label.starts_with("partitioned"))
        .map(|s| s.label.as_str())
        .collect();
    assert_eq!(partitioned.len(), 2, "read-only and update-heavy");
    let mut runs = 0;
    for quick in [true, false] {
        for point in fig.points_to_run(quick) {
            for series in fig.series.iter().filter(|s| s.runs_at(&point.label)) {
                let argv = fig.argv(point, series, quick);
                let nodes: usize = flag(&argv, "--nodes").unwrap().parse().unwrap();
                let threads: usize = flag(&argv, "--threads").unwrap().parse().unwrap();
                assert_eq!(threads, 20 * nodes, "{argv:?}");
                assert_eq!(flag(&argv, "--tasks"), Some("1"), "{argv:?}");
                assert_eq!(flag(&argv, "--memnode-threads"), Some("4"), "{argv:?}");
                assert!(argv.iter().any(|a| a == "--verify"), "{argv:?}");
                let is_part = partitioned.contains(&series.label.as_str());
                assert_eq!(
                    argv.iter().any(|a| a == "--partitioned"),
                    is_part,
                    "{argv:?}"
                );
                if is_part {
                    assert!(nodes >= 2, "{argv:?}");
                }
                // Update-heavy series generate each value as the artifact's
                // driver does (branch i81); read-only ones write nothing.
                let updates = flag(&argv, "--workload") == Some("mixed:5,95,0,0,0");
                let value_gen = flag(&argv, "--value-gen");
                assert_eq!(value_gen, updates.then_some("random-string"), "{argv:?}");
                // The artifact's load (branch i88): each node inserts its
                // own key range, its pages allocated where inserted.
                assert_eq!(
                    knobs(&argv),
                    [
                        "scalestore.load=ranges",
                        "scalestore.alloc=local",
                        "scalestore.worker_lines=llc"
                    ]
                );
                // The caches scaled to the paper's 280 GB (933 M records).
                assert_eq!(flag(&argv, "--llc-keys"), Some("933333333"), "{argv:?}");
                runs += 1;
            }
        }
    }
    // Quick: 4 points, full: 5; the partitioned series skip one node.
    assert_eq!(runs, (4 * 4 - 2) + (5 * 4 - 2));
    for s in &fig.series {
        assert!(
            fig.paper
                .iter()
                .any(|v| v.series == s.label && v.point == "5"),
            "a paper value at 5 nodes for {}",
            s.label
        );
    }
}

/// The `--set` values of a command line, in order.
fn knobs(argv: &[String]) -> Vec<&str> {
    argv.windows(2)
        .filter(|w| w[0] == "--set")
        .map(|w| w[1].as_str())
        .collect()
}

/// `dmkv repro --set` knobs come after the figure's own at every point, so
/// they win (Fig. 7 with the harness's old single-node load), and only the
/// series' engine's knobs reach its command; an unknown engine is refused.
#[test]
fn repro_set_overrides_the_figures_knobs() {
    let old = ["scalestore.load=one", "scalestore.alloc=round-robin"].map(String::from);
    // The figure's own `worker_lines` stays; the overridden two come last.
    let fig = figure::load("scalestore-fig7", &REGISTRY)
        .unwrap()
        .with_overrides(&old, &REGISTRY)
        .unwrap();
    let (point, series) = (&fig.points[4], &fig.series[0]);
    let argv = fig.argv(point, series, true);
    // `argv` passes each knob once, its last setting.
    assert_eq!(
        knobs(&argv),
        [
            "scalestore.worker_lines=llc",
            "scalestore.load=one",
            "scalestore.alloc=round-robin"
        ],
        "{argv:?}"
    );
    let other = figure::load("scalestore-fig7", &REGISTRY)
        .unwrap()
        .with_overrides(&["rolex.anything=1".to_string()], &REGISTRY)
        .unwrap();
    let argv = other.argv(point, series, true);
    assert!(
        !argv.iter().any(|a| a.starts_with("rolex.")),
        "another engine's knob is not passed to scalestore: {argv:?}"
    );
    let bad = figure::load("scalestore-fig7", &REGISTRY)
        .unwrap()
        .with_overrides(&["nosuch.knob=1".to_string()], &REGISTRY);
    assert!(bad.is_err());
    let bad = figure::load("scalestore-fig7", &REGISTRY)
        .unwrap()
        .with_overrides(&["load=one".to_string()], &REGISTRY);
    assert!(bad.is_err());
}

/// The figure's own partitioned command, shrunk to a tiny key set, runs on
/// the simulated cluster: each node's operations stay in its own key range
/// and every key verifies.
#[test]
fn scalestore_fig7_partitioned_point_runs_at_a_tiny_size() {
    let fig = figure::load("scalestore-fig7", &REGISTRY).unwrap();
    let point = fig.points.iter().find(|p| p.label == "2").unwrap();
    let series = fig
        .series
        .iter()
        .find(|s| s.label == "partitioned, update-heavy (95% updates)")
        .unwrap();
    let mut argv = fig.argv(point, series, true);
    for (f, v) in [("--keys", "2000"), ("--ops", "4000")] {
        let i = argv.iter().position(|a| a == f).unwrap();
        argv[i + 1] = v.into();
    }
    let dir = scratch("fig7-part");
    let json = dir.join("p.json");
    let mut args: Vec<&str> = argv[1..].iter().map(String::as_str).collect();
    args.extend(["--json", json.to_str().unwrap()]);
    let (code, _, err) = dmkv(&args);
    assert_eq!(code, EXIT_OK, "{err}");
    let v: serde_json::Value = serde_json::from_str(&read(&json)).unwrap();
    assert_eq!(v["ok"], true, "{}", v["verify"]);
    assert_eq!(v["verify"]["checked"], 2000);
    assert_eq!(v["threads"], 40);
    let part = &v["partition"];
    assert_eq!(part["partitions"], 2, "{part}");
    let ranges = part["key_ranges"].as_array().unwrap();
    let touched = part["touched"].as_array().unwrap();
    assert_eq!(touched.len(), 2, "one phase, two nodes: {touched:?}");
    let mut ops = 0;
    for t in touched {
        let node = t["node"].as_u64().unwrap() as usize;
        assert_eq!(t["partition"].as_u64(), Some(node as u64), "{t}");
        let (lo, hi) = (ranges[node][0].as_u64(), ranges[node][1].as_u64());
        assert!(
            t["min_key"].as_u64() >= lo && t["max_key"].as_u64() <= hi,
            "{t}"
        );
        ops += t["ops"].as_u64().unwrap();
    }
    assert_eq!(ops, 4000, "every operation drawn from its node's range");
}
