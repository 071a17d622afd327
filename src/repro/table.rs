//! The Markdown table of a figure run: every measured point, the paper's
//! number for the same point where it gives one (the cell stays empty where
//! it does not), the ratio ours / paper, and a one-line reason where they
//! differ by more than [`AGREES`].

use super::FigureRun;
use super::figure::{Figure, PaperValue};
use std::fmt::Write;

/// Ours within this factor of the paper's (either way) counts as agreeing.
pub const AGREES: f64 = 1.25;

/// Formats a number with about three significant digits.
pub fn num(x: f64) -> String {
    let a = x.abs();
    if a == 0.0 {
        "0".into()
    } else if a >= 100.0 {
        format!("{x:.0}")
    } else if a >= 10.0 {
        format!("{x:.1}")
    } else if a >= 1.0 {
        format!("{x:.2}")
    } else {
        format!("{x:.3}")
    }
}

/// Ours for a paper value: the metric, or the same ratio when the paper
/// gives only a ratio.
pub fn ours_for(run: &FigureRun, v: &PaperValue) -> Option<f64> {
    let m = v.metric.as_deref();
    let y = run.value(&v.series, &v.point, m)?;
    match &v.ratio_to {
        None => Some(y),
        Some(base) => {
            let b = run.value(base, &v.point, m)?;
            (b != 0.0).then(|| y / b)
        }
    }
}

fn escape(s: &str) -> String {
    s.replace('|', "\\|").replace('\n', " ")
}

/// The figure's Markdown section.
pub fn markdown(fig: &Figure, run: &FigureRun) -> String {
    let mut s = String::new();
    let _ = writeln!(s, "## {}: {}\n", fig.name, fig.title);
    let _ = writeln!(s, "Paper: {}. {}\n", fig.source, fig.caption);
    let mode = if run.quick { " --quick" } else { "" };
    let _ = writeln!(
        s,
        "Run: `dmkv repro {}{mode}` at commit `{}`; {} on {}{}. Plot: `{}.svg` / `{}.png`; every point's raw report and exact `dmkv bench` command: `{}.json`.\n",
        fig.name,
        run.git_commit,
        fig.metric.label,
        match fig.transport {
            super::figure::TransportKind::Sim => "the simulated cluster",
            super::figure::TransportKind::Local => "the local transport",
        },
        fig.profile
            .as_ref()
            .map(|p| format!(" (profile {p})"))
            .unwrap_or_default(),
        fig.name,
        fig.name,
        fig.name
    );
    let _ = writeln!(
        s,
        "| point | series | ours | paper | ours / paper | paper's source | why they differ |"
    );
    let _ = writeln!(s, "|---|---|---:|---:|---:|---|---|");
    let mut points: Vec<&str> = Vec::new();
    for p in &run.points {
        if !points.contains(&p.point.as_str()) {
            points.push(&p.point);
        }
    }
    for point in &points {
        for series in &fig.series {
            let Some(r) = run.get(&series.label, point) else {
                continue;
            };
            let ours = match (&r.error, r.y) {
                (Some(e), _) => format!("FAILED: {}", escape(e)),
                (None, Some(y)) => num(y),
                (None, None) => "-".into(),
            };
            let values: Vec<&PaperValue> = fig
                .paper
                .iter()
                .filter(|v| v.series == series.label && v.point == *point && v.metric.is_none())
                .collect();
            // The plain value first; a ratio gets its own row.
            let plain = values.iter().find(|v| v.ratio_to.is_none());
            let (paper, ratio, src, why) = match plain {
                Some(v) => cells(fig, run, v),
                None => Default::default(),
            };
            let _ = writeln!(
                s,
                "| {point} | {} | {ours} | {paper} | {ratio} | {src} | {why} |",
                series.label
            );
            for v in values.iter().filter(|v| v.ratio_to.is_some()) {
                let base = v.ratio_to.as_deref().unwrap_or("");
                let ours = ours_for(run, v)
                    .map(|x| format!("{x:.2}x"))
                    .unwrap_or("-".into());
                let (paper, ratio, src, why) = cells(fig, run, v);
                let _ = writeln!(
                    s,
                    "| {point} | {} / {base} | {ours} | {paper}x | {ratio} | {src} | {why} |",
                    series.label
                );
            }
            // The figure's further quantities, each on its own row.
            for e in &fig.extra {
                let ours = match (&r.error, r.extra.get(&e.name).copied().flatten()) {
                    (Some(_), _) => "FAILED".to_string(),
                    (None, Some(y)) => num(y),
                    (None, None) => "-".into(),
                };
                let v = fig.paper.iter().find(|v| {
                    v.series == series.label
                        && v.point == *point
                        && v.metric.as_deref() == Some(e.name.as_str())
                        && v.ratio_to.is_none()
                });
                // An engine without this quantity (and no paper value for
                // it) gets no row.
                if ours == "-" && v.is_none() {
                    continue;
                }
                let (paper, ratio, src, why) = match v {
                    Some(v) => cells(fig, run, v),
                    None => Default::default(),
                };
                let _ = writeln!(
                    s,
                    "| {point} | {}: {} | {ours} | {paper} | {ratio} | {src} | {why} |",
                    series.label,
                    escape(&e.label)
                );
            }
        }
    }
    let _ = writeln!(s);
    if !fig.not_run.is_empty() {
        let _ = writeln!(s, "Not run here:\n");
        for n in &fig.not_run {
            let _ = writeln!(s, "- {n}");
        }
        let _ = writeln!(s);
    }
    s
}

/// Paper value, ratio, source and reason cells for one paper value.
fn cells(fig: &Figure, run: &FigureRun, v: &PaperValue) -> (String, String, String, String) {
    let ours = ours_for(run, v);
    let ratio = ours.map(|o| o / v.value);
    let why = match ratio {
        Some(r) if (1.0 / AGREES..=AGREES).contains(&r) => "agrees within 25%".to_string(),
        Some(_) => {
            let reason = v
                .reason
                .as_deref()
                .or(fig.differences.as_deref())
                .unwrap_or("not yet explained");
            if run.quick {
                format!("quick run (smaller key set, fewer ops); {reason}")
            } else {
                reason.to_string()
            }
        }
        None => "no measurement".into(),
    };
    (
        num(v.value),
        ratio
            .map(|r| format!("{r:.2}"))
            .unwrap_or_else(|| "-".into()),
        escape(&v.source),
        escape(&why),
    )
}
