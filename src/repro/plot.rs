//! Plots with plotters: a figure run (grouped bars or lines, one colour per
//! series, the paper's values as black-edged markers) and `dmkv bench
//! --plot` (throughput, latency percentiles and per-operation counters per
//! engine, side by side). The same drawing code renders SVG and PNG; text
//! is drawn with the DejaVu Sans font shipped in `assets/fonts/` (through
//! plotters' `ab_glyph` feature), so no system font or library is needed.

use super::FigureRun;
use super::figure::{Figure, PlotKind};
use dmkv_bench::EngineReport;
use plotters::coord::Shift;
use plotters::prelude::*;
use plotters::style::text_anchor::{HPos, Pos, VPos};
use std::path::Path;

const FONT: &[u8] = include_bytes!("../../assets/fonts/DejaVuSans.ttf");
const FAMILY: &str = "sans-serif";
const SIZE: (u32, u32) = (1100, 650);

/// Colours of series, in order (colour-blind-safe Okabe–Ito palette).
const COLOURS: [RGBColor; 8] = [
    RGBColor(0, 114, 178),
    RGBColor(213, 94, 0),
    RGBColor(0, 158, 115),
    RGBColor(204, 121, 167),
    RGBColor(230, 159, 0),
    RGBColor(86, 180, 233),
    RGBColor(120, 120, 120),
    RGBColor(240, 228, 66),
];

fn colour(i: usize) -> RGBColor {
    COLOURS[i % COLOURS.len()]
}

fn register_font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The font is compiled in; a failure here is a broken build.
        if plotters::style::register_font(FAMILY, FontStyle::Normal, FONT).is_err() {
            panic!("the shipped font assets/fonts/DejaVuSans.ttf does not parse");
        }
    });
}

type DrawResult<T> = Result<T, String>;

type Chart<'a, DB> = ChartContext<
    'a,
    DB,
    Cartesian2d<plotters::coord::types::RangedCoordf64, plotters::coord::types::RangedCoordf64>,
>;

fn err<E: std::fmt::Debug>(e: E) -> String {
    format!("plot: {e:?}")
}

/// A paper marker in a bar chart: (group, series, value, is a ratio scaled
/// by our base).
pub struct Marker {
    pub group: usize,
    pub series: usize,
    pub value: f64,
    pub from_ratio: bool,
}

/// Grouped bars: `groups` along x, one bar per series in each group.
/// `values[s][g]` is series s in group g (None: not measured).
#[allow(clippy::too_many_arguments)]
fn grouped_bars<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    x_label: &str,
    y_label: &str,
    groups: &[String],
    series: &[String],
    values: &[Vec<Option<f64>>],
    markers: &[Marker],
) -> DrawResult<()> {
    let max = values
        .iter()
        .flatten()
        .flatten()
        .copied()
        .chain(markers.iter().map(|m| m.value))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let top = if max > 0.0 { max * 1.15 } else { 1.0 };
    let n = groups.len().max(1) as f64;
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FAMILY, 20))
        .margin(12)
        .x_label_area_size(60)
        .y_label_area_size(70)
        .build_cartesian_2d(-0.5f64..n - 0.5, 0f64..top)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_x_mesh()
        .x_labels(0)
        .x_desc(x_label)
        .y_desc(y_label)
        .label_style((FAMILY, 14))
        .axis_desc_style((FAMILY, 16))
        .draw()
        .map_err(err)?;
    let ns = series.len().max(1) as f64;
    let width = 0.8 / ns;
    let left = |g: usize, s: usize| g as f64 - 0.4 + s as f64 * width;
    for (s, label) in series.iter().enumerate() {
        let c = colour(s);
        let bars: Vec<Rectangle<(f64, f64)>> = values[s]
            .iter()
            .enumerate()
            .filter_map(|(g, v)| {
                v.map(|v| {
                    Rectangle::new(
                        [(left(g, s) + 0.01, 0.0), (left(g, s) + width - 0.01, v)],
                        c.filled(),
                    )
                })
            })
            .collect();
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| Rectangle::new([(x, y - 6), (x + 14, y + 6)], c.filled()));
    }
    draw_markers(
        &mut chart,
        markers.iter().map(|m| {
            let x = left(m.group, m.series) + width / 2.0;
            (x, m.value, m.series, m.from_ratio)
        }),
    )?;
    // Group labels under the axis.
    let style = TextStyle::from((FAMILY, 14).into_font())
        .color(&BLACK)
        .pos(Pos::new(HPos::Center, VPos::Top));
    for (g, label) in groups.iter().enumerate() {
        let (px, py) = chart.backend_coord(&(g as f64, 0.0));
        area.draw(&Text::new(label.clone(), (px, py + 6), style.clone()))
            .map_err(err)?;
    }
    legend(&mut chart)
}

/// Paper markers: a black-edged diamond in the series' colour for a value
/// the paper gives, a triangle for one derived from a ratio the paper gives.
fn draw_markers<'a, DB: DrawingBackend + 'a>(
    chart: &mut Chart<'a, DB>,
    markers: impl Iterator<Item = (f64, f64, usize, bool)>,
) -> DrawResult<()> {
    let markers: Vec<_> = markers.collect();
    let mut shown = [false; 2];
    for &(x, y, s, from_ratio) in &markers {
        let c = colour(s);
        let k = usize::from(from_ratio);
        let first = !shown[k];
        shown[k] = true;
        if from_ratio {
            let m = EmptyElement::at((x, y))
                + TriangleMarker::new((0, 0), 8, c.filled())
                + TriangleMarker::new((0, 0), 8, BLACK.stroke_width(2));
            let anno = chart.draw_series(std::iter::once(m)).map_err(err)?;
            if first {
                anno.label("paper: its ratio x our baseline")
                    .legend(|(x, y)| {
                        EmptyElement::at((x + 7, y))
                            + TriangleMarker::new((0, 0), 7, BLACK.stroke_width(2))
                    });
            }
        } else {
            let diamond = |r: i32| vec![(0, -r), (r, 0), (0, r), (-r, 0), (0, -r)];
            let m = EmptyElement::at((x, y))
                + Polygon::new(diamond(8), c.filled())
                + PathElement::new(diamond(8), BLACK.stroke_width(2));
            let anno = chart.draw_series(std::iter::once(m)).map_err(err)?;
            if first {
                anno.label("paper value").legend(move |(x, y)| {
                    EmptyElement::at((x + 7, y))
                        + PathElement::new(diamond(7), BLACK.stroke_width(2))
                });
            }
        }
    }
    Ok(())
}

fn legend<'a, DB: DrawingBackend + 'a>(chart: &mut Chart<'a, DB>) -> DrawResult<()> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font((FAMILY, 14))
        .draw()
        .map_err(err)
}

/// Lines: one per series over a numeric x.
fn lines<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    fig: &Figure,
    run: &FigureRun,
    title: &str,
) -> DrawResult<()> {
    // A log-scale x is drawn as log10(x) on a linear axis, labelled 10^v.
    let tx = |x: f64| -> Option<f64> {
        if fig.log_x {
            (x > 0.0).then(|| x.log10())
        } else {
            Some(x)
        }
    };
    let mut xs: Vec<f64> = run.points.iter().filter_map(|p| tx(p.x?)).collect();
    let mut ys: Vec<f64> = run.points.iter().filter_map(|p| p.y).collect();
    let markers: Vec<_> = paper_points(fig, run)
        .into_iter()
        .filter_map(|(x, y, s, r)| Some((tx(x)?, y, s, r)))
        .collect();
    xs.extend(markers.iter().map(|m| m.0));
    ys.extend(markers.iter().map(|m| m.1));
    let finite = |v: &Vec<f64>| {
        v.iter()
            .copied()
            .filter(|x| x.is_finite())
            .collect::<Vec<_>>()
    };
    let (xs, ys) = (finite(&xs), finite(&ys));
    let xmin = xs.iter().copied().fold(f64::INFINITY, f64::min);
    let xmax = xs.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    let ymax = ys.iter().copied().fold(0.0f64, f64::max);
    let (xmin, xmax) = if xmin.is_finite() && xmax > xmin {
        let pad = (xmax - xmin) * 0.05;
        (xmin - pad, xmax + pad)
    } else if xmin.is_finite() {
        (xmin - 1.0, xmin + 1.0)
    } else {
        (0.0, 1.0)
    };
    let ytop = if ymax > 0.0 { ymax * 1.15 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FAMILY, 20))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(xmin..xmax, 0f64..ytop)
        .map_err(err)?;
    let log_label = |v: &f64| {
        let x = 10f64.powf(*v);
        if x >= 1e6 {
            format!("{}M", super::table::num(x / 1e6))
        } else if x >= 1e3 {
            format!("{}K", super::table::num(x / 1e3))
        } else {
            super::table::num(x)
        }
    };
    let plain_label = |v: &f64| super::table::num(*v);
    let x_fmt: &dyn Fn(&f64) -> String = if fig.log_x { &log_label } else { &plain_label };
    chart
        .configure_mesh()
        .x_label_formatter(x_fmt)
        .x_desc(&run.x_label)
        .y_desc(&run.y_label)
        .label_style((FAMILY, 14))
        .axis_desc_style((FAMILY, 16))
        .draw()
        .map_err(err)?;
    for (s, series) in fig.series.iter().enumerate() {
        let c = colour(s);
        let mut pts: Vec<(f64, f64)> = run
            .points
            .iter()
            .filter(|p| p.series == series.label)
            .filter_map(|p| Some((tx(p.x?)?, p.y?)))
            .collect();
        if fig.x_metric.is_none() {
            pts.sort_by(|a, b| a.0.total_cmp(&b.0));
        }
        chart
            .draw_series(LineSeries::new(pts.clone(), c.stroke_width(3)))
            .map_err(err)?
            .label(series.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(3)));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, c.filled())))
            .map_err(err)?;
    }
    draw_markers(&mut chart, markers.into_iter())?;
    legend(&mut chart)
}

/// One curve of a timeline panel: legend label, colour index, points.
type Curve = (String, usize, Vec<(f64, f64)>);

/// A paper value drawn across a timeline panel: its legend label, colour
/// index and value.
type PaperLine = (String, usize, f64);

/// Throughput over time: one line per (series, point) from each report's
/// `timeline` (the last, partial interval left out), the paper's values of
/// a plain metric as dashed lines, shifts (`--shift-every-ms`) as grey
/// verticals; below it, one panel per `[[extra]]` with a per-interval
/// series (e.g. XStore's fallbacks per GET), with its paper values.
fn timeline<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    fig: &Figure,
    run: &FigureRun,
    title: &str,
) -> DrawResult<()> {
    let many_points = fig.points_to_run(run.quick).len() > 1;
    // The colour of (series, point): per series, or per curve when the
    // figure has several points.
    let mut colour_of: Vec<(String, String, usize)> = Vec::new();
    for p in &run.points {
        let Some(s) = fig.series.iter().position(|s| s.label == p.series) else {
            continue;
        };
        let ci = if many_points { colour_of.len() } else { s };
        colour_of.push((p.series.clone(), p.point.clone(), ci));
    }
    let ci_of = |series: &str, point: &str| {
        colour_of
            .iter()
            .find(|(s, p, _)| s == series && p == point)
            .map(|c| c.2)
    };
    let label_of = |series: &str, point: &str| {
        if many_points {
            format!("{series} @ {point}")
        } else {
            series.to_string()
        }
    };
    // Per-interval series at `path` inside each report's timeline.
    let curves_at = |path: &str, scale: f64| -> Vec<Curve> {
        let mut out = Vec::new();
        for p in &run.points {
            let Some(ci) = ci_of(&p.series, &p.point) else {
                continue;
            };
            let t = &p.report["timeline"];
            let Some(ms) = t["interval_ms"].as_f64() else {
                continue;
            };
            let mut v = t;
            for part in path.split('.') {
                v = &v[part];
            }
            let Some(v) = v.as_array() else {
                continue;
            };
            let n = v.len().saturating_sub(1).max(1);
            let pts: Vec<(f64, f64)> = v
                .iter()
                .take(n)
                .enumerate()
                .filter_map(|(i, y)| Some(((i as f64 + 0.5) * ms, y.as_f64()? * scale)))
                .collect();
            out.push((label_of(&p.series, &p.point), ci, pts));
        }
        out
    };
    let paper_lines = |metric: Option<&str>| -> Vec<PaperLine> {
        fig.paper
            .iter()
            .filter(|v| v.metric.as_deref() == metric && v.ratio_to.is_none())
            .filter_map(|v| {
                let ci = ci_of(&v.series, &v.point)?;
                Some((
                    format!(
                        "paper: {} {}",
                        label_of(&v.series, &v.point),
                        super::table::num(v.value)
                    ),
                    ci,
                    v.value,
                ))
            })
            .collect()
    };
    // Shifts of a partitioned run, from the first report that has them.
    let shift_ms = run
        .points
        .iter()
        .find_map(|p| p.report["partition"]["shift_every_ms"].as_f64())
        .filter(|&ms| ms > 0.0);
    let extras: Vec<&super::figure::Extra> =
        fig.extra.iter().filter(|e| e.timeline.is_some()).collect();
    let main = curves_at("ops_per_s", fig.metric.scale);
    // Paper values of the main metric are drawn only when it is a plain
    // quantity in the timeline's unit (not a ratio).
    let main_paper = if fig.metric.per.is_none() {
        paper_lines(None)
    } else {
        Vec::new()
    };
    let xmax = main
        .iter()
        .flat_map(|c| c.2.iter().map(|p| p.0))
        .fold(0.0f64, f64::max)
        .max(1e-3);
    let panels: Vec<DrawingArea<DB, Shift>> = if extras.is_empty() {
        vec![area.clone()]
    } else {
        let (_, h) = area.dim_in_pixel();
        let top = (h as f64 * 0.58) as u32;
        let (a, rest) = area.split_vertically(top);
        let mut v = vec![a];
        let each = (h - top) / extras.len() as u32;
        let mut rest = rest;
        for _ in 1..extras.len() {
            let (b, r) = rest.split_vertically(each);
            v.push(b);
            rest = r;
        }
        v.push(rest);
        v
    };
    let x_desc = "time since the run began (ms, virtual time on sim)";
    timeline_panel(
        &panels[0],
        title,
        x_desc,
        &run.y_label,
        main,
        &main_paper,
        shift_ms,
        xmax,
    )?;
    for (e, panel) in extras.iter().zip(&panels[1..]) {
        let path = e.timeline.as_deref().expect("filtered");
        timeline_panel(
            panel,
            &format!("{} per interval", e.label),
            x_desc,
            &e.label,
            curves_at(path, e.scale),
            &paper_lines(Some(&e.name)),
            shift_ms,
            xmax,
        )?;
    }
    Ok(())
}

/// One panel of a timeline figure.
#[allow(clippy::too_many_arguments)]
fn timeline_panel<DB: DrawingBackend>(
    area: &DrawingArea<DB, Shift>,
    title: &str,
    x_desc: &str,
    y_desc: &str,
    curves: Vec<Curve>,
    paper: &[PaperLine],
    shift_ms: Option<f64>,
    xmax: f64,
) -> DrawResult<()> {
    let ymax = curves
        .iter()
        .flat_map(|c| c.2.iter().map(|p| p.1))
        .chain(paper.iter().map(|p| p.2))
        .filter(|v| v.is_finite())
        .fold(0.0f64, f64::max);
    let ytop = if ymax > 0.0 { ymax * 1.15 } else { 1.0 };
    let mut chart = ChartBuilder::on(area)
        .caption(title, (FAMILY, 18))
        .margin(12)
        .x_label_area_size(45)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..xmax * 1.02, 0f64..ytop)
        .map_err(err)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .label_style((FAMILY, 14))
        .axis_desc_style((FAMILY, 15))
        .draw()
        .map_err(err)?;
    if let Some(ms) = shift_ms {
        let grey = RGBColor(150, 150, 150);
        let mut first = true;
        let mut t = ms;
        while t < xmax * 1.02 {
            let anno = chart
                .draw_series(DashedLineSeries::new(
                    vec![(t, 0.0), (t, ytop)],
                    4,
                    4,
                    grey.stroke_width(1),
                ))
                .map_err(err)?;
            if first {
                anno.label("partitions shift").legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 18, y)], grey.stroke_width(1))
                });
                first = false;
            }
            t += ms;
        }
    }
    for (label, ci, pts) in curves {
        let c = colour(ci);
        chart
            .draw_series(LineSeries::new(pts, c.stroke_width(2)))
            .map_err(err)?
            .label(label)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 18, y)], c.stroke_width(3)));
    }
    for (label, ci, value) in paper {
        let c = colour(*ci);
        chart
            .draw_series(DashedLineSeries::new(
                vec![(0.0, *value), (xmax * 1.02, *value)],
                10,
                6,
                c.stroke_width(2),
            ))
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| {
                EmptyElement::at((x, y))
                    + PathElement::new(vec![(0, 0), (6, 0)], c.stroke_width(2))
                    + PathElement::new(vec![(12, 0), (18, 0)], c.stroke_width(2))
            });
    }
    legend(&mut chart)
}

/// Paper values placed on a line plot: (x, y, series index, from ratio).
fn paper_points(fig: &Figure, run: &FigureRun) -> Vec<(f64, f64, usize, bool)> {
    fig.paper
        .iter()
        .filter_map(|v| {
            let s = fig.series.iter().position(|s| s.label == v.series)?;
            let x = match (&fig.x_metric, v.x) {
                (_, Some(x)) => x,
                (Some(_), None) => return None,
                (None, None) => {
                    let p = fig.points.iter().find(|p| p.label == v.point)?;
                    p.x.or_else(|| p.label.parse().ok())?
                }
            };
            let y = scaled(run, v)?;
            Some((x, y, s, v.ratio_to.is_some()))
        })
        .collect()
}

/// A paper value in the plot's unit: as given, or its ratio times our
/// value of the base series at the same point.
fn scaled(run: &FigureRun, v: &super::figure::PaperValue) -> Option<f64> {
    match &v.ratio_to {
        None => Some(v.value),
        Some(base) => Some(v.value * run.get(base, &v.point)?.y?),
    }
}

fn figure_on<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    fig: &Figure,
    run: &FigureRun,
) -> DrawResult<()> {
    register_font();
    root.fill(&WHITE).map_err(err)?;
    let title = format!("{}{}", fig.title, if run.quick { " (--quick)" } else { "" });
    match fig.plot {
        PlotKind::Lines => lines(&root, fig, run, &title)?,
        PlotKind::Timeline => timeline(&root, fig, run, &title)?,
        PlotKind::Bars => {
            let mut groups: Vec<String> = Vec::new();
            for p in &run.points {
                if !groups.contains(&p.point) {
                    groups.push(p.point.clone());
                }
            }
            let series: Vec<String> = fig.series.iter().map(|s| s.label.clone()).collect();
            let values: Vec<Vec<Option<f64>>> = fig
                .series
                .iter()
                .map(|s| {
                    groups
                        .iter()
                        .map(|g| run.get(&s.label, g).and_then(|p| p.y))
                        .collect()
                })
                .collect();
            let markers: Vec<Marker> = fig
                .paper
                .iter()
                .filter_map(|v| {
                    Some(Marker {
                        group: groups.iter().position(|g| *g == v.point)?,
                        series: fig.series.iter().position(|s| s.label == v.series)?,
                        value: scaled(run, v)?,
                        from_ratio: v.ratio_to.is_some(),
                    })
                })
                .collect();
            grouped_bars(
                &root,
                &title,
                &fig.x_label,
                &run.y_label,
                &groups,
                &series,
                &values,
                &markers,
            )?;
        }
    }
    root.present().map_err(err)
}

pub fn figure_svg(fig: &Figure, run: &FigureRun, path: &Path) -> DrawResult<()> {
    figure_on(SVGBackend::new(path, SIZE).into_drawing_area(), fig, run)
}

pub fn figure_png(fig: &Figure, run: &FigureRun, path: &Path) -> DrawResult<()> {
    figure_on(BitMapBackend::new(path, SIZE).into_drawing_area(), fig, run)
}

/// `dmkv bench --plot`: throughput, latency percentiles and per-operation
/// counters, one bar per engine, side by side.
fn bench_on<DB: DrawingBackend>(
    root: DrawingArea<DB, Shift>,
    reports: &[EngineReport],
) -> DrawResult<()> {
    register_font();
    root.fill(&WHITE).map_err(err)?;
    let Some(first) = reports.first() else {
        return Err("plot: no engine completed its run".into());
    };
    let time = if first.sim.is_some() {
        "virtual time"
    } else {
        "wall-clock time"
    };
    let head = format!(
        "dmkv bench: {} {}, {} keys, {} ops, {} thread(s) x {} task(s), transport {}{}",
        first.workload,
        first.dist,
        first.keys,
        first.ops,
        first.threads,
        first.tasks_per_thread,
        first.transport,
        first
            .sim
            .as_ref()
            .map(|s| format!(" ({})", s.profile))
            .unwrap_or_default()
    );
    let (top, rest) = root.split_vertically(40);
    top.draw(&Text::new(
        head,
        (20, 10),
        TextStyle::from((FAMILY, 18).into_font()).color(&BLACK),
    ))
    .map_err(err)?;
    let panels = rest.split_evenly((1, 3));
    let engines: Vec<String> = reports.iter().map(|r| r.engine.clone()).collect();
    let one = |f: &dyn Fn(&EngineReport) -> f64| -> Vec<Vec<Option<f64>>> {
        reports.iter().map(|r| vec![Some(f(r))]).collect()
    };
    grouped_bars(
        &panels[0],
        "throughput",
        time,
        "M ops/s",
        &["all operations".to_string()],
        &engines,
        &one(&|r| r.throughput_ops_per_s / 1e6),
        &[],
    )?;
    let lat: Vec<Vec<Option<f64>>> = reports
        .iter()
        .map(|r| {
            vec![
                Some(r.latency_us.p50),
                Some(r.latency_us.p99),
                Some(r.latency_us.p999),
            ]
        })
        .collect();
    grouped_bars(
        &panels[1],
        "latency",
        "percentile",
        "microseconds",
        &["p50".into(), "p99".into(), "p99.9".into()],
        &engines,
        &lat,
        &[],
    )?;
    let counters: Vec<Vec<Option<f64>>> = reports
        .iter()
        .map(|r| {
            vec![
                Some(r.per_op.round_trips),
                Some(r.per_op.verbs),
                Some(r.per_op.rpcs),
            ]
        })
        .collect();
    grouped_bars(
        &panels[2],
        "costs per operation",
        "counter",
        "per operation",
        &["round trips".into(), "verbs".into(), "RPCs".into()],
        &engines,
        &counters,
        &[],
    )?;
    root.present().map_err(err)
}

/// Writes `dmkv bench --plot PATH`: SVG if PATH ends in `.svg`, else PNG.
pub fn bench_plot(reports: &[EngineReport], path: &Path) -> DrawResult<()> {
    let size = (1500, 600);
    if path
        .extension()
        .is_some_and(|e| e.eq_ignore_ascii_case("svg"))
    {
        bench_on(SVGBackend::new(path, size).into_drawing_area(), reports)
    } else {
        bench_on(BitMapBackend::new(path, size).into_drawing_area(), reports)
    }
}
