//! A figure definition: data, not code. One TOML file per figure says which
//! engines (series) run, over which sweep of `dmkv bench` parameters, on
//! which transport and hardware profile, what is measured, and what the paper
//! reported for the same points, with the source of every number.
//!
//! Figures shipped with dmkv live in `figures/*.toml` and are compiled in;
//! `dmkv repro PATH.toml` runs a file instead. The format is described in
//! `docs/reproduction.md` ("Figure files").
//!
//! Invariants checked by [`Figure::parse`] (a bad file is refused with a
//! message naming the file and the field):
//! 1. Every bench parameter (in `params`, `quick`, `[[points]]`, a series'
//!    `params`) is a flag of `dmkv bench` that a figure may set; `engine`,
//!    `transport`, `profile`, `json` and `plot` belong to the figure itself.
//! 2. Series labels and point labels are unique and non-empty; every series
//!    names a registered engine; `quick.points` and every `[[paper]]` entry
//!    name existing points and series.
//! 3. A line plot has a numeric x for every point (its `x`, or its label).
//! 4. A series' `points` name existing points, and no paper value is for
//!    a point its series does not run at.
//! 5. `[[extra]]` quantities have unique names; a paper value's `metric`
//!    names one of them; an extra's `timeline` series needs a timeline plot.

use crate::engines::Registry;
use serde::Deserialize;
use std::collections::BTreeMap;

/// The figures shipped with dmkv, by name (the file name without `.toml`).
pub const BUILTIN: &[(&str, &str)] = &[
    (
        "xstore-fig10",
        include_str!("../../figures/xstore-fig10.toml"),
    ),
    (
        "xstore-fig11",
        include_str!("../../figures/xstore-fig11.toml"),
    ),
    (
        "xstore-fig12a",
        include_str!("../../figures/xstore-fig12a.toml"),
    ),
    (
        "xstore-fig15bc",
        include_str!("../../figures/xstore-fig15bc.toml"),
    ),
    (
        "xstore-fig15d",
        include_str!("../../figures/xstore-fig15d.toml"),
    ),
    ("rolex-fig7", include_str!("../../figures/rolex-fig7.toml")),
    (
        "rolex-fig8a",
        include_str!("../../figures/rolex-fig8a.toml"),
    ),
    (
        "rolex-synonyms",
        include_str!("../../figures/rolex-synonyms.toml"),
    ),
    (
        "rolex-retrain",
        include_str!("../../figures/rolex-retrain.toml"),
    ),
    (
        "outback-fig9c",
        include_str!("../../figures/outback-fig9c.toml"),
    ),
    (
        "outback-fig9c-cpu",
        include_str!("../../figures/outback-fig9c-cpu.toml"),
    ),
    (
        "outback-fig13",
        include_str!("../../figures/outback-fig13.toml"),
    ),
    (
        "outback-fig14",
        include_str!("../../figures/outback-fig14.toml"),
    ),
    (
        "outback-fig16",
        include_str!("../../figures/outback-fig16.toml"),
    ),
    (
        "outback-fig17",
        include_str!("../../figures/outback-fig17.toml"),
    ),
    (
        "scalestore-fig6",
        include_str!("../../figures/scalestore-fig6.toml"),
    ),
    (
        "scalestore-fig7",
        include_str!("../../figures/scalestore-fig7.toml"),
    ),
    (
        "scalestore-fig9",
        include_str!("../../figures/scalestore-fig9.toml"),
    ),
    (
        "scalestore-ssd",
        include_str!("../../figures/scalestore-ssd.toml"),
    ),
];

/// The longest `reason` or `differences` a figure may give, in characters.
/// Each lands in one cell of FIGURE.md's table beside the numbers, so it
/// says why ours differs now, in a few sentences; how a point moved from
/// pass to pass belongs in the docs the reason points to (before this
/// check, scalestore-fig7's reasons had grown to 3,400 characters of run
/// history per cell).
pub const MAX_REASON_CHARS: usize = 1000;

/// A reason fits one table cell: one line, at most [`MAX_REASON_CHARS`].
fn check_reason(what: &str, text: &str) -> Result<(), String> {
    if text.contains(['\n', '\r']) {
        return Err(format!(
            "{what}: must be one line (it fills one cell of the table)"
        ));
    }
    let chars = text.chars().count();
    if chars > MAX_REASON_CHARS {
        return Err(format!(
            "{what}: {chars} characters, more than {MAX_REASON_CHARS}: say why ours differs now and point to the docs for the history"
        ));
    }
    Ok(())
}

/// `dmkv bench` flags a figure sets itself rather than through parameters.
const RESERVED: &[&str] = &[
    "engine",
    "transport",
    "profile",
    "json",
    "plot",
    "help",
    "trace",
    "trace-load",
    "memnode-addr",
    "secret-file",
];

/// A parameter value: what a TOML value may be for a bench flag.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(untagged)]
pub enum Value {
    Bool(bool),
    Int(i64),
    Float(f64),
    Str(String),
    List(Vec<String>),
}

/// Bench parameters: flag name (without `--`; `_` may stand for `-`) to value.
pub type Params = BTreeMap<String, Value>;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum PlotKind {
    /// Grouped bars: one group per point, one bar per series.
    Bars,
    /// One line per series over a numeric x.
    Lines,
    /// Throughput over the run's time (needs the `timeline-ms` parameter):
    /// one line per series and point.
    Timeline,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum TransportKind {
    /// Virtual time on the simulated cluster (throughput and latency figures).
    Sim,
    /// In process (counter and memory figures: exact on any transport).
    Local,
}

/// One measured quantity: a dotted path into `dmkv bench --json`'s engine
/// object, optionally divided by another path (`per`), then multiplied by
/// `scale`. Divided, `engine_stats` counters (numerator and denominator)
/// count the run alone: after a `--warmup-ops` warm-up their values when the
/// run started (`warmup.engine_stats`) are taken off first.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Metric {
    pub path: String,
    #[serde(default)]
    pub per: Option<String>,
    #[serde(default = "one")]
    pub scale: f64,
    pub label: String,
}

fn one() -> f64 {
    1.0
}

/// `[[extra]]`: a further quantity of every point, tabled beside the main
/// metric (with its own paper values), and, on a timeline plot, drawn per
/// interval in a panel of its own when `timeline` names a per-interval
/// series of the report's `timeline` object.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Extra {
    /// What paper values name it by (`metric = NAME`).
    pub name: String,
    /// The whole run's value: a dotted path into the report, as `metric`.
    pub path: String,
    #[serde(default)]
    pub per: Option<String>,
    #[serde(default = "one")]
    pub scale: f64,
    pub label: String,
    /// A dotted path inside the report's `timeline` to an array with one
    /// value per interval (e.g. `engine_per_get.fallbacks`), times `scale`.
    #[serde(default)]
    pub timeline: Option<String>,
}

impl Extra {
    pub fn metric(&self) -> Metric {
        Metric {
            path: self.path.clone(),
            per: self.per.clone(),
            scale: self.scale,
            label: self.label.clone(),
        }
    }
}

/// A sweep point: a label and the parameters it overrides.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Point {
    pub label: String,
    /// The x value of a line plot (default: the label as a number).
    #[serde(default)]
    pub x: Option<f64>,
    #[serde(default)]
    pub params: Params,
    /// With `--quick`, applied after `params` (and after the figure's
    /// `quick.params`): what a point sets differently at the quick size,
    /// e.g. a sub-model count that keeps its keys per sub-model when the
    /// quick run loads fewer keys.
    #[serde(default)]
    pub quick_params: Params,
}

/// `[sweep]`: shorthand for points that each set one parameter.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Sweep {
    pub param: String,
    pub values: Vec<Value>,
}

/// One line (or bar of each group): an engine with its knobs.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Series {
    pub label: String,
    pub engine: String,
    /// Overrides for this series (e.g. `set = ["xstore.cache=top-only"]`).
    #[serde(default)]
    pub params: Params,
    /// Labels of the points this series runs at (default: all), for a
    /// series that has no meaning at some points (e.g. `--partitioned`
    /// needs two or more nodes).
    #[serde(default)]
    pub points: Option<Vec<String>>,
}

impl Series {
    /// Whether this series runs at the point labelled `point`.
    pub fn runs_at(&self, point: &str) -> bool {
        self.points
            .as_ref()
            .is_none_or(|keep| keep.iter().any(|l| l == point))
    }
}

/// `[quick]`: the reduced run of `--quick`.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Quick {
    /// Overrides of `params` (points' own parameters still win).
    #[serde(default)]
    pub params: Params,
    /// Labels of the points to run (default: all).
    #[serde(default)]
    pub points: Option<Vec<String>>,
}

/// A number the paper gives for one point of one series.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PaperValue {
    pub series: String,
    pub point: String,
    /// In the figure's unit (after `metric.scale`), or a ratio if `ratio_to`.
    pub value: f64,
    /// Where the marker goes on a plot whose x is measured (`x_metric`),
    /// e.g. the throughput of a throughput-latency point.
    #[serde(default)]
    pub x: Option<f64>,
    /// The paper gives only `series / ratio_to` at this point: compare ours
    /// as the same ratio.
    #[serde(default)]
    pub ratio_to: Option<String>,
    /// The `[[extra]]` quantity this value is for (default: the main
    /// metric).
    #[serde(default)]
    pub metric: Option<String>,
    /// Where the number comes from (section, figure, table, quoted text).
    pub source: String,
    /// Why ours differs, if it does, for this point (else `differences`).
    #[serde(default)]
    pub reason: Option<String>,
}

/// A whole figure file.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Figure {
    pub name: String,
    pub title: String,
    /// The paper and the figure reproduced, e.g. "XStore (OSDI'20) §7.2, Fig. 10".
    pub source: String,
    /// What the plot shows, in one or two sentences.
    pub caption: String,
    pub transport: TransportKind,
    /// A shipped profile name or a TOML path (with `transport = "sim"`).
    #[serde(default)]
    pub profile: Option<String>,
    pub plot: PlotKind,
    pub x_label: String,
    /// Line plots: x on a logarithmic scale.
    #[serde(default)]
    pub log_x: bool,
    pub metric: Metric,
    /// Plot x as a measured quantity instead of the point (e.g. a
    /// throughput-latency curve: points sweep load, x is throughput).
    #[serde(default)]
    pub x_metric: Option<Metric>,
    /// Further quantities measured at every point.
    #[serde(default)]
    pub extra: Vec<Extra>,
    /// The default one-line reason where ours differs from the paper's.
    #[serde(default)]
    pub differences: Option<String>,
    /// Points of the figure that cannot be run here, and why.
    #[serde(default)]
    pub not_run: Vec<String>,
    #[serde(default)]
    pub params: Params,
    #[serde(default)]
    pub quick: Quick,
    #[serde(default)]
    pub sweep: Option<Sweep>,
    #[serde(default)]
    pub points: Vec<Point>,
    pub series: Vec<Series>,
    #[serde(default)]
    pub paper: Vec<PaperValue>,
    /// `dmkv repro --set` knobs (not in the file): appended to every
    /// point's `set` after the figure's own layers, so they win (e.g.
    /// `scalestore.load=one` reruns Fig. 7 with the harness's old load).
    #[serde(skip)]
    pub overrides: Vec<String>,
}

impl Value {
    /// The flag's argument text.
    pub fn text(&self) -> String {
        match self {
            Value::Bool(b) => b.to_string(),
            Value::Int(i) => i.to_string(),
            Value::Float(f) => f.to_string(),
            Value::Str(s) => s.clone(),
            Value::List(l) => l.join(","),
        }
    }
    fn as_f64(&self) -> Option<f64> {
        match self {
            Value::Int(i) => Some(*i as f64),
            Value::Float(f) => Some(*f),
            Value::Str(s) => s.parse().ok(),
            _ => None,
        }
    }
}

/// The names `dmkv bench` takes as `--NAME`.
fn bench_flags() -> Vec<String> {
    use clap::CommandFactory;
    let cli = crate::cli::Cli::command();
    let bench = cli
        .find_subcommand("bench")
        .expect("dmkv has a bench subcommand");
    bench
        .get_arguments()
        .filter_map(|a| a.get_long().map(str::to_string))
        .collect()
}

/// `keys_per_model` style keys become `keys-per-model` flags.
fn normalise(params: &Params) -> Params {
    params
        .iter()
        .map(|(k, v)| (k.replace('_', "-"), v.clone()))
        .collect()
}

impl Figure {
    /// Parses and checks a figure file; `origin` names it in errors.
    pub fn parse(text: &str, origin: &str, registry: &Registry) -> Result<Figure, String> {
        // One line: the TOML error's message and where it is.
        let mut fig: Figure = toml::from_str(text).map_err(|e: toml::de::Error| {
            let line = e.span().map(|sp| {
                text.as_bytes()[..sp.start.min(text.len())]
                    .iter()
                    .filter(|&&b| b == b'\n')
                    .count()
                    + 1
            });
            let at = line.map(|l| format!("line {l}: ")).unwrap_or_default();
            format!("figure {origin}: {at}{}", e.message().replace('\n', " "))
        })?;
        fig.normalise();
        fig.check(registry)
            .map_err(|e| format!("figure {origin}: {e}"))?;
        Ok(fig)
    }

    /// The figure with `sets` (each `ENGINE.KNOB=VALUE`, ENGINE a
    /// registered engine) applied after its own knobs at every point.
    pub fn with_overrides(
        mut self,
        sets: &[String],
        registry: &Registry,
    ) -> Result<Figure, String> {
        for s in sets {
            let engine = s
                .split_once('=')
                .and_then(|(n, _)| n.split_once('.'))
                .map(|(e, _)| e);
            match engine {
                Some(e) if registry.find(e).is_some() => self.overrides.push(s.clone()),
                _ => {
                    return Err(format!(
                        "--set {s:?}: use ENGINE.KNOB=VALUE with a known engine"
                    ));
                }
            }
        }
        Ok(self)
    }

    fn normalise(&mut self) {
        self.params = normalise(&self.params);
        self.quick.params = normalise(&self.quick.params);
        if let Some(s) = &mut self.sweep {
            s.param = s.param.replace('_', "-");
        }
        for p in &mut self.points {
            p.params = normalise(&p.params);
            p.quick_params = normalise(&p.quick_params);
        }
        for s in &mut self.series {
            s.params = normalise(&s.params);
        }
        // The sweep shorthand becomes points.
        if let Some(s) = self.sweep.take() {
            for v in &s.values {
                let mut params = Params::new();
                params.insert(s.param.clone(), v.clone());
                self.points.push(Point {
                    label: v.text(),
                    x: v.as_f64(),
                    params,
                    quick_params: Params::new(),
                });
            }
        }
    }

    fn check(&self, registry: &Registry) -> Result<(), String> {
        if self.name.trim().is_empty() || self.name.contains(['/', ' ']) {
            return Err(format!(
                "name {:?} must be non-empty, without spaces or slashes (it names the output directory)",
                self.name
            ));
        }
        let flags = bench_flags();
        let check_params = |what: &str, p: &Params| -> Result<(), String> {
            for (k, v) in p {
                if RESERVED.contains(&k.as_str()) {
                    return Err(format!(
                        "{what}: {k:?} is set by the figure itself (series engines, transport, profile), not as a parameter"
                    ));
                }
                if !flags.iter().any(|f| f == k) {
                    return Err(format!(
                        "{what}: {k:?} is not a `dmkv bench` flag (see dmkv bench --help)"
                    ));
                }
                if matches!(v, Value::List(_)) && k != "set" {
                    return Err(format!("{what}: only `set` takes a list, not {k:?}"));
                }
                if k == "set" {
                    let items = match v {
                        Value::List(l) => l.clone(),
                        other => vec![other.text()],
                    };
                    for item in items {
                        let engine = item
                            .split_once('=')
                            .and_then(|(n, _)| n.split_once('.'))
                            .map(|(e, _)| e);
                        match engine {
                            Some(e) if registry.find(e).is_some() => {}
                            _ => {
                                return Err(format!(
                                    "{what}: set {item:?} is not ENGINE.KNOB=VALUE with a known engine"
                                ));
                            }
                        }
                    }
                }
            }
            Ok(())
        };
        check_params("params", &self.params)?;
        check_params("quick.params", &self.quick.params)?;
        if self.points.is_empty() {
            return Err("no points: give [sweep] param and values, or [[points]]".into());
        }
        for (i, p) in self.points.iter().enumerate() {
            if p.label.trim().is_empty() {
                return Err(format!("point {} has an empty label", i + 1));
            }
            if self.points[..i].iter().any(|o| o.label == p.label) {
                return Err(format!("point {:?} is listed twice", p.label));
            }
            check_params(&format!("point {:?}", p.label), &p.params)?;
            check_params(
                &format!("point {:?} quick_params", p.label),
                &p.quick_params,
            )?;
            if self.plot == PlotKind::Lines
                && self.x_metric.is_none()
                && p.x.is_none()
                && p.label.parse::<f64>().is_err()
            {
                return Err(format!(
                    "point {:?}: a line plot needs a numeric x (give `x = ...` or a numeric label)",
                    p.label
                ));
            }
        }
        if self.series.is_empty() {
            return Err("no [[series]]: name at least one engine".into());
        }
        if self.plot == PlotKind::Timeline && !self.params.contains_key("timeline-ms") {
            return Err(
                "plot \"timeline\" needs params.timeline-ms (the interval of the throughput timeline)"
                    .into(),
            );
        }
        for (i, s) in self.series.iter().enumerate() {
            if s.label.trim().is_empty() {
                return Err(format!("series {} has an empty label", i + 1));
            }
            if self.series[..i].iter().any(|o| o.label == s.label) {
                return Err(format!("series {:?} is listed twice", s.label));
            }
            if registry.find(&s.engine).is_none() {
                return Err(format!(
                    "series {:?}: unknown engine {:?} (known: {})",
                    s.label,
                    s.engine,
                    registry.names().join(", ")
                ));
            }
            check_params(&format!("series {:?}", s.label), &s.params)?;
            for l in s.points.iter().flatten() {
                if !self.points.iter().any(|p| &p.label == l) {
                    return Err(format!("series {:?}: points: no point {l:?}", s.label));
                }
            }
        }
        if let Some(q) = &self.quick.points {
            for l in q {
                if !self.points.iter().any(|p| &p.label == l) {
                    return Err(format!("quick.points: no point {l:?}"));
                }
            }
        }
        match (self.transport, &self.profile) {
            (TransportKind::Sim, Some(p)) => {
                dmkv_transport::sim::Profile::load(p).map_err(|e| format!("profile: {e}"))?;
            }
            (TransportKind::Sim, None) => {
                return Err("transport \"sim\" needs a profile (e.g. xstore-cx4)".into());
            }
            (TransportKind::Local, Some(_)) => {
                return Err("a profile only applies to transport \"sim\"".into());
            }
            (TransportKind::Local, None) => {}
        }
        for m in std::iter::once(&self.metric).chain(&self.x_metric) {
            if m.path.trim().is_empty() || !(m.scale.is_finite() && m.scale != 0.0) {
                return Err(format!(
                    "metric {:?}: needs a path and a finite, non-zero scale",
                    m.label
                ));
            }
        }
        for (i, e) in self.extra.iter().enumerate() {
            if e.name.trim().is_empty() || self.extra[..i].iter().any(|o| o.name == e.name) {
                return Err(format!(
                    "extra {:?}: names must be non-empty and unique",
                    e.name
                ));
            }
            if e.path.trim().is_empty() || !(e.scale.is_finite() && e.scale != 0.0) {
                return Err(format!(
                    "extra {:?}: needs a path and a finite, non-zero scale",
                    e.name
                ));
            }
            if e.timeline.is_some() && self.plot != PlotKind::Timeline {
                return Err(format!(
                    "extra {:?}: a timeline series needs plot = \"timeline\"",
                    e.name
                ));
            }
        }
        for v in &self.paper {
            let where_ = format!("paper value for {:?} at {:?}", v.series, v.point);
            if let Some(m) = &v.metric
                && !self.extra.iter().any(|e| &e.name == m)
            {
                return Err(format!("{where_}: no [[extra]] named {m:?}"));
            }
            if !self.series.iter().any(|s| s.label == v.series) {
                return Err(format!("{where_}: no series {:?}", v.series));
            }
            if !self.points.iter().any(|p| p.label == v.point) {
                return Err(format!("{where_}: no point {:?}", v.point));
            }
            if self
                .series
                .iter()
                .any(|s| s.label == v.series && !s.runs_at(&v.point))
            {
                return Err(format!(
                    "{where_}: the series does not run at that point (its `points`)"
                ));
            }
            if let Some(r) = &v.ratio_to
                && (!self.series.iter().any(|s| &s.label == r) || r == &v.series)
            {
                return Err(format!("{where_}: ratio_to {r:?} is not another series"));
            }
            if !v.value.is_finite() || v.source.trim().is_empty() {
                return Err(format!("{where_}: needs a finite value and a source"));
            }
            if let Some(r) = &v.reason {
                check_reason(&format!("{where_}: reason"), r)?;
            }
        }
        if let Some(d) = &self.differences {
            check_reason("differences", d)?;
        }
        Ok(())
    }

    /// The points a run covers.
    pub fn points_to_run(&self, quick: bool) -> Vec<&Point> {
        match (&self.quick.points, quick) {
            (Some(keep), true) => self
                .points
                .iter()
                .filter(|p| keep.contains(&p.label))
                .collect(),
            _ => self.points.iter().collect(),
        }
    }

    /// The `dmkv bench` command line of one point of one series: figure
    /// parameters, then `--quick`'s, then the point's (with `--quick`, then
    /// its `quick_params`), then the series' (later wins; `set` lists
    /// accumulate, then `dmkv repro --set`'s).
    pub fn argv(&self, point: &Point, series: &Series, quick: bool) -> Vec<String> {
        let mut merged: BTreeMap<String, Value> = BTreeMap::new();
        let mut sets: Vec<String> = Vec::new();
        let layers: Vec<&Params> = if quick {
            vec![
                &self.params,
                &self.quick.params,
                &point.params,
                &point.quick_params,
                &series.params,
            ]
        } else {
            vec![&self.params, &point.params, &series.params]
        };
        for layer in layers {
            for (k, v) in layer {
                if k == "set" {
                    match v {
                        Value::List(l) => sets.extend(l.iter().cloned()),
                        other => sets.push(other.text()),
                    }
                } else {
                    merged.insert(k.clone(), v.clone());
                }
            }
        }
        sets.extend(self.overrides.iter().cloned());
        let mut argv = vec![
            "dmkv".to_string(),
            "bench".into(),
            "--engine".into(),
            series.engine.clone(),
        ];
        match self.transport {
            TransportKind::Sim => {
                argv.extend(["--transport".into(), "sim".into()]);
                if let Some(p) = &self.profile {
                    argv.extend(["--profile".into(), p.clone()]);
                }
            }
            TransportKind::Local => argv.extend(["--transport".into(), "local".into()]),
        }
        for (k, v) in merged {
            match v {
                Value::Bool(true) => argv.push(format!("--{k}")),
                Value::Bool(false) => {}
                v => {
                    argv.push(format!("--{k}"));
                    argv.push(v.text());
                }
            }
        }
        // Only this series' engine's knobs (a point may set knobs of every
        // engine of the figure), each once: the last setting wins.
        let mut knobs: Vec<(String, String)> = Vec::new();
        for s in sets {
            let (name, _) = s.split_once('=').unwrap_or((&s, ""));
            if name.split_once('.').map(|(e, _)| e) != Some(series.engine.as_str()) {
                continue;
            }
            let name = name.to_string();
            knobs.retain(|(n, _)| *n != name);
            knobs.push((name, s));
        }
        for (_, s) in knobs {
            argv.push("--set".into());
            argv.push(s);
        }
        argv
    }
}

/// Finds a figure by built-in name or loads one from a `.toml` path.
pub fn load(name_or_path: &str, registry: &Registry) -> Result<Figure, String> {
    if let Some((name, text)) = BUILTIN.iter().find(|(n, _)| *n == name_or_path) {
        return Figure::parse(text, name, registry);
    }
    let path = std::path::Path::new(name_or_path);
    if path.extension().is_some_and(|e| e == "toml") || path.exists() {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read figure {}: {e}", path.display()))?;
        return Figure::parse(&text, &path.display().to_string(), registry);
    }
    let names: Vec<&str> = BUILTIN.iter().map(|(n, _)| *n).collect();
    Err(format!(
        "no figure {name_or_path:?}: name one of {} (see dmkv repro --list), `all`, or a .toml file",
        names.join(", ")
    ))
}
