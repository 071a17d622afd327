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
}
