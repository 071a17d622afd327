//! `dmkv repro`: the papers' evaluation figures as runnable data.
//!
//! - [`figure`]: the figure files (`figures/*.toml`, compiled in, or a path)
//!   and their checks.
//! - this module: runs every (point, series) of a figure as the `dmkv bench`
//!   command line the figure file describes (parsed by the same CLI, run by
//!   the harness as a library, so each point's recorded command reruns it
//!   exactly), and writes `NAME.json`, `NAME.svg`, `NAME.png` and `NAME.md`
//!   under `--out DIR/NAME/`.
//! - [`table`]: the Markdown table, ours beside the paper's.
//! - [`plot`]: figures and `dmkv bench --plot`, drawn with plotters.

pub mod figure;
pub mod plot;
pub mod table;
#[cfg(test)]
mod tests;

use crate::cli::{Cli, Command, Io};
use crate::engines::Registry;
use clap::Parser;
use figure::{Figure, Metric, Point, Series};
use serde::Serialize;
use std::io::Write;
use std::path::{Path, PathBuf};

/// The commit this binary was built from (build.rs; "unknown" without git).
pub const GIT_COMMIT: &str = env!("DMKV_GIT_COMMIT");

/// One measured point of one series.
#[derive(Debug, Clone, Serialize)]
pub struct PointResult {
    pub series: String,
    pub engine: String,
    pub point: String,
    /// The plotted x: the point's x, or the measured `x_metric`.
    pub x: Option<f64>,
    /// The measured metric, in the figure's unit.
    pub y: Option<f64>,
    /// The figure's `[[extra]]` quantities, by name.
    #[serde(skip_serializing_if = "std::collections::BTreeMap::is_empty")]
    pub extra: std::collections::BTreeMap<String, Option<f64>>,
    /// `dmkv bench` arguments that rerun this point exactly.
    pub command: Vec<String>,
    /// Wall-clock seconds the point took here (not a result: simulated
    /// throughput is virtual time).
    pub wall_seconds: f64,
    /// The run failed or found wrong answers: what went wrong.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
    /// The engine's whole `dmkv bench --json` object.
    pub report: serde_json::Value,
}

/// A figure's run: what `NAME.json` holds.
#[derive(Debug, Clone, Serialize)]
pub struct FigureRun {
    pub figure: String,
    pub title: String,
    pub source: String,
    pub caption: String,
    pub quick: bool,
    pub git_commit: String,
    pub y_label: String,
    pub x_label: String,
    pub points: Vec<PointResult>,
}

impl FigureRun {
    /// The result of `series` at `point`, if it ran.
    pub fn get(&self, series: &str, point: &str) -> Option<&PointResult> {
        self.points
            .iter()
            .find(|p| p.series == series && p.point == point)
    }

    /// The value of `metric` (an `[[extra]]` name; None: the main metric)
    /// for `series` at `point`.
    pub fn value(&self, series: &str, point: &str, metric: Option<&str>) -> Option<f64> {
        let r = self.get(series, point)?;
        match metric {
            None => r.y,
            Some(m) => *r.extra.get(m)?,
        }
    }
}

/// Reads a dotted path (`latency_us.p50`, `engine_stats.retrains`) from a
/// report as a number.
pub fn lookup(report: &serde_json::Value, path: &str) -> Option<f64> {
    let mut v = report;
    for part in path.split('.') {
        v = match v {
            serde_json::Value::Object(m) => m.get(part)?,
            serde_json::Value::Array(a) => a.get(part.parse::<usize>().ok()?)?,
            _ => return None,
        };
    }
    v.as_f64()
}

fn measure(report: &serde_json::Value, m: &Metric) -> Option<f64> {
    let x = lookup(report, &m.path)?;
    let x = match &m.per {
        Some(per) => {
            let d = lookup(report, per)? - counted_before_the_run(report, per);
            if d == 0.0 {
                return None;
            }
            (x - counted_before_the_run(report, &m.path)) / d
        }
        None => x,
    };
    Some(x * m.scale)
}

/// What an `engine_stats` counter held when the run started after a
/// `--warmup-ops` warm-up (0 without one, or for other paths). The report's
/// `engine_stats` count from the engine's connect, while the run's figures
/// (`ops`, ...) count the run alone: a counter divided by one of them
/// (`per`), or by another counter, must count the run alone too.
fn counted_before_the_run(report: &serde_json::Value, path: &str) -> f64 {
    match path.strip_prefix("engine_stats.") {
        Some(rest) => lookup(report, &format!("warmup.engine_stats.{rest}")).unwrap_or(0.0),
        None => 0.0,
    }
}

/// Runs one `dmkv bench` command line through the CLI's own parsing and
/// the harness; returns the engine's report and, if the run found errors or
/// wrong answers, what they were.
fn run_bench(
    registry: &Registry,
    argv: &[String],
    err: &mut dyn Write,
) -> Result<(serde_json::Value, Option<String>), String> {
    let cli = Cli::try_parse_from(argv).map_err(|e| {
        e.render()
            .to_string()
            .lines()
            .next()
            .unwrap_or("bad arguments")
            .to_string()
    })?;
    let Command::Bench(args) = cli.command else {
        return Err("not a bench command".into());
    };
    let cfg = crate::cli::bench_config(registry, args, err, false).map_err(|f| f.1)?;
    let outcome = dmkv_bench::run(&cfg).map_err(|e| e.to_string())?;
    if let Some(f) = outcome.failures.first() {
        return Err(format!("engine {}: {}", f.engine, f.error));
    }
    let report = outcome
        .reports
        .first()
        .ok_or("the run produced no report")?;
    let value = crate::cli::report_json(report, argv);
    // A run with wrong answers or errors keeps its report (with samples).
    let error = (!report.ok).then(|| {
        format!(
            "wrong answers or errors: {} check failures, {} errors, {} verify failures; first: {}",
            report.checks.failures,
            report.errors.count,
            report.verify.failures(),
            report
                .errors
                .samples
                .iter()
                .chain(&report.checks.samples)
                .next()
                .map_or("-", String::as_str)
        )
    });
    Ok((value, error))
}

/// Runs every point of every series of `fig`, printing progress on `out`.
pub fn run_figure(registry: &Registry, fig: &Figure, quick: bool, io: &mut Io<'_>) -> FigureRun {
    let points: Vec<&Point> = fig.points_to_run(quick);
    let total = points
        .iter()
        .map(|p| fig.series.iter().filter(|s| s.runs_at(&p.label)).count())
        .sum::<usize>();
    let mut results = Vec::with_capacity(total);
    let mut n = 0;
    for point in &points {
        for series in fig.series.iter().filter(|s| s.runs_at(&point.label)) {
            n += 1;
            results.push(run_point(registry, fig, point, series, quick, io));
            let r = results.last().expect("just pushed");
            let shown = match (&r.y, &r.error) {
                (_, Some(e)) => format!("FAILED: {e}"),
                (Some(y), None) => format!("{y:.3} {}", fig.metric.label),
                (None, None) => format!("no value at {}", fig.metric.path),
            };
            let _ = writeln!(
                io.out,
                "{} [{n}/{total}] {} @ {}: {shown} ({:.1} s)",
                fig.name, series.label, point.label, r.wall_seconds
            );
        }
    }
    FigureRun {
        figure: fig.name.clone(),
        title: fig.title.clone(),
        source: fig.source.clone(),
        caption: fig.caption.clone(),
        quick,
        git_commit: GIT_COMMIT.into(),
        y_label: fig.metric.label.clone(),
        x_label: fig
            .x_metric
            .as_ref()
            .map_or(fig.x_label.clone(), |m| m.label.clone()),
        points: results,
    }
}

fn run_point(
    registry: &Registry,
    fig: &Figure,
    point: &Point,
    series: &Series,
    quick: bool,
    io: &mut Io<'_>,
) -> PointResult {
    let argv = fig.argv(point, series, quick);
    // Wall time of the whole point, for the user's planning only.
    let start = std::time::Instant::now();
    let outcome = run_bench(registry, &argv, io.err);
    let wall_seconds = start.elapsed().as_secs_f64();
    let (report, error) = match outcome {
        Ok((v, error)) => (v, error),
        Err(e) => (serde_json::Value::Null, Some(e)),
    };
    let y = measure(&report, &fig.metric);
    let extra = fig
        .extra
        .iter()
        .map(|e| (e.name.clone(), measure(&report, &e.metric())))
        .collect();
    let x = match &fig.x_metric {
        Some(m) => measure(&report, m),
        None => point.x.or_else(|| point.label.parse().ok()),
    };
    PointResult {
        series: series.label.clone(),
        engine: series.engine.clone(),
        point: point.label.clone(),
        x,
        y,
        extra,
        command: argv,
        wall_seconds,
        error,
        report,
    }
}

/// Writes `NAME.json`, `NAME.svg`, `NAME.png` and `NAME.md` into `dir`.
pub fn write_outputs(fig: &Figure, run: &FigureRun, dir: &Path) -> Result<Vec<PathBuf>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("cannot create {}: {e}", dir.display()))?;
    let path = |ext: &str| dir.join(format!("{}.{ext}", fig.name));
    let write = |p: &Path, text: String| {
        std::fs::write(p, text).map_err(|e| format!("cannot write {}: {e}", p.display()))
    };
    let json = serde_json::to_string_pretty(run).map_err(|e| e.to_string())?;
    write(&path("json"), json + "\n")?;
    plot::figure_svg(fig, run, &path("svg"))?;
    plot::figure_png(fig, run, &path("png"))?;
    write(&path("md"), table::markdown(fig, run))?;
    Ok(["json", "svg", "png", "md"].map(path).to_vec())
}

/// `dmkv repro --list | FIGURE|all [--quick] [--out DIR] [--set K=V ...]`.
#[allow(clippy::too_many_arguments)]
pub fn command(
    registry: &Registry,
    list: bool,
    figure: Option<&str>,
    quick: bool,
    out_dir: &Path,
    sets: &[String],
    io: &mut Io<'_>,
) -> Result<bool, String> {
    if list {
        for (name, text) in figure::BUILTIN {
            let fig = Figure::parse(text, name, registry)?;
            let _ = writeln!(io.out, "{name:<18} {} ({})", fig.title, fig.source);
        }
        return Ok(true);
    }
    let Some(which) = figure else {
        return Err("name a figure (see dmkv repro --list), `all`, or a .toml file".into());
    };
    let figures: Vec<Figure> = if which == "all" {
        figure::BUILTIN
            .iter()
            .map(|(n, t)| Figure::parse(t, n, registry))
            .collect::<Result<_, _>>()?
    } else {
        vec![figure::load(which, registry)?]
    };
    let figures = figures
        .into_iter()
        .map(|f| f.with_overrides(sets, registry))
        .collect::<Result<Vec<_>, _>>()?;
    std::fs::create_dir_all(out_dir)
        .map_err(|e| format!("cannot create {}: {e}", out_dir.display()))?;
    let mut all_ok = true;
    let mut summary = String::new();
    for fig in &figures {
        let run = run_figure(registry, fig, quick, io);
        all_ok &= run.points.iter().all(|p| p.error.is_none());
        let files = write_outputs(fig, &run, &out_dir.join(&fig.name))?;
        for f in files {
            let _ = writeln!(io.out, "wrote {}", f.display());
        }
        summary.push_str(&table::markdown(fig, &run));
        summary.push('\n');
    }
    if figures.len() > 1 {
        let head = format!(
            "# dmkv repro all{}\n\nCommand: `dmkv repro all{} --out {}` at commit `{GIT_COMMIT}`.\n\n",
            if quick { " --quick" } else { "" },
            if quick { " --quick" } else { "" },
            out_dir.display()
        );
        let p = out_dir.join("README.md");
        std::fs::write(&p, head + &summary)
            .map_err(|e| format!("cannot write {}: {e}", p.display()))?;
        let _ = writeln!(io.out, "wrote {}", p.display());
    }
    Ok(all_ok)
}
