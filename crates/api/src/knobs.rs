use crate::error::{KvError, Result};
use std::collections::BTreeMap;
use std::str::FromStr;

/// One documented engine setting.
#[derive(Debug, Clone, Copy)]
pub struct KnobSpec {
    pub name: &'static str,
    pub default: &'static str,
    pub help: &'static str,
}

/// Settings for one engine, from `--set engine.knob=value` (stored without
/// the engine prefix). Unknown names are refused when an engine checks them
/// against its [`KnobSpec`]s.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Knobs {
    values: BTreeMap<String, String>,
}

impl Knobs {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn set(&mut self, name: &str, value: &str) {
        self.values.insert(name.to_string(), value.to_string());
    }

    pub fn iter(&self) -> impl Iterator<Item = (&str, &str)> {
        self.values.iter().map(|(k, v)| (k.as_str(), v.as_str()))
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    /// Fails on any name not in `specs`, listing the known ones.
    pub fn check(&self, engine: &str, specs: &[KnobSpec]) -> Result<()> {
        for name in self.values.keys() {
            if !specs.iter().any(|s| s.name == name) {
                let known: Vec<_> = specs
                    .iter()
                    .map(|s| format!("{engine}.{}", s.name))
                    .collect();
                return Err(KvError::Config(format!(
                    "unknown setting {engine}.{name}; known settings: {}",
                    if known.is_empty() {
                        "none".to_string()
                    } else {
                        known.join(", ")
                    }
                )));
            }
        }
        Ok(())
    }

    /// The value of `name` parsed as `T`, or the spec's default.
    pub fn get<T: FromStr>(&self, engine: &str, specs: &[KnobSpec], name: &str) -> Result<T>
    where
        T::Err: std::fmt::Display,
    {
        let spec = specs
            .iter()
            .find(|s| s.name == name)
            .unwrap_or_else(|| panic!("{engine} reads undeclared knob {name}"));
        let raw = self
            .values
            .get(name)
            .map(String::as_str)
            .unwrap_or(spec.default);
        raw.parse::<T>().map_err(|e| {
            KvError::Config(format!(
                "{engine}.{name}={raw:?} is invalid: {e} ({})",
                spec.help
            ))
        })
    }

    /// [`Knobs::get`], then refuses a value outside `range` with a message
    /// that names the knob, the value, the accepted range and the knob's
    /// help. Every numeric engine knob goes through this (or documents what
    /// 0 or an extreme value means), so a bad setting is never taken
    /// silently.
    pub fn get_in<T>(
        &self,
        engine: &str,
        specs: &[KnobSpec],
        name: &str,
        range: impl std::ops::RangeBounds<T>,
    ) -> Result<T>
    where
        T: FromStr + PartialOrd + std::fmt::Display + std::fmt::Debug,
        T::Err: std::fmt::Display,
    {
        let v: T = self.get(engine, specs, name)?;
        if range.contains(&v) {
            return Ok(v);
        }
        let help = specs
            .iter()
            .find(|s| s.name == name)
            .map(|s| s.help)
            .unwrap_or_default();
        Err(KvError::Config(format!(
            "{engine}.{name}={v} is out of range (accepted: {}) ({help})",
            describe_range(&range)
        )))
    }
}

/// "1..=64" style text for a range's bounds, for error messages.
fn describe_range<T: std::fmt::Debug>(range: &impl std::ops::RangeBounds<T>) -> String {
    use std::ops::Bound::*;
    let lo = match range.start_bound() {
        Included(v) => format!("{v:?} <= value"),
        Excluded(v) => format!("{v:?} < value"),
        Unbounded => "value".to_string(),
    };
    match range.end_bound() {
        Included(v) => format!("{lo} <= {v:?}"),
        Excluded(v) => format!("{lo} < {v:?}"),
        Unbounded => lo,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const SPECS: &[KnobSpec] = &[
        KnobSpec {
            name: "levels",
            default: "4",
            help: "cached levels",
        },
        KnobSpec {
            name: "mode",
            default: "full",
            help: "full|none",
        },
    ];

    #[test]
    fn defaults_overrides_and_errors() {
        let mut k = Knobs::new();
        assert_eq!(k.get::<usize>("cell", SPECS, "levels").unwrap(), 4);
        k.set("levels", "2");
        assert_eq!(k.get::<usize>("cell", SPECS, "levels").unwrap(), 2);
        k.set("levels", "two");
        let e = k
            .get::<usize>("cell", SPECS, "levels")
            .unwrap_err()
            .to_string();
        assert!(e.contains("cell.levels=\"two\""), "{e}");
        k.check("cell", SPECS).unwrap();
        k.set("bogus", "1");
        let e = k.check("cell", SPECS).unwrap_err().to_string();
        assert!(e.contains("cell.bogus") && e.contains("cell.levels"), "{e}");
    }

    #[test]
    fn out_of_range_values_are_refused_with_the_range() {
        let mut k = Knobs::new();
        assert_eq!(
            k.get_in::<usize>("cell", SPECS, "levels", 1..=8).unwrap(),
            4
        );
        k.set("levels", "0");
        let e = k
            .get_in::<usize>("cell", SPECS, "levels", 1..=8)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("cell.levels=0") && e.contains("1 <= value <= 8"),
            "{e}"
        );
        k.set("levels", "8");
        assert_eq!(
            k.get_in::<usize>("cell", SPECS, "levels", 1..=8).unwrap(),
            8
        );
        let e = k
            .get_in::<f64>("cell", SPECS, "levels", 0.0..1.0)
            .unwrap_err()
            .to_string();
        assert!(e.contains("0.0 <= value < 1.0"), "{e}");
    }
}
