//! The engine registry: every design this `dmkv` binary knows, and which of
//! them `dmkv bench` compares when no `--engine` is given.
//!
//! To add an engine, list its spec in [`REGISTRY`]'s `engines`, and its name
//! in `default_set` once it belongs in the default comparison.

use dmkv_api::EngineSpec;
use dmkv_testkit::floor::BTreeFloor;
use dmkv_testkit::reference::Reference;

/// Engines by name, and the default comparison set.
pub struct Registry {
    pub engines: &'static [&'static dyn EngineSpec],
    /// Names from `engines`, in the order the default comparison runs them
    /// (ratios are relative to the first).
    pub default_set: &'static [&'static str],
}

/// The registry of this build. `reference` (a BTreeMap behind one RPC, for
/// testing the harness) can be chosen with `--engine reference` but is not
/// one of the designs compared by default; nor is `btree-floor` (a BTreeMap in
/// the compute process, the floor the designs are quoted against).
pub const REGISTRY: Registry = Registry {
    engines: &[
        &dmkv_xstore::SPEC,
        &dmkv_rpc_btree::SPEC,
        &dmkv_cell::SPEC,
        &dmkv_sherman::SPEC,
        &dmkv_race::SPEC,
        &dmkv_rpc_hash::SPEC,
        &dmkv_outback::SPEC,
        &dmkv_rolex::SPEC,
        dmkv_scalestore::SPEC,
        &dmkv_scalestore::BTREE_LOCAL,
        &Reference,
        &BTreeFloor,
    ],
    default_set: &[
        "xstore",
        "rpc-btree",
        "cell",
        "sherman",
        "race",
        "rpc-hash",
        "outback",
        "rolex",
    ],
};

impl Registry {
    pub fn find(&self, name: &str) -> Option<&'static dyn EngineSpec> {
        self.engines.iter().copied().find(|e| e.name() == name)
    }

    pub fn names(&self) -> Vec<&'static str> {
        self.engines.iter().map(|e| e.name()).collect()
    }

    /// The engines of `--engine a,b,c`, or the default set without one.
    pub fn resolve(&self, arg: Option<&str>) -> Result<Vec<&'static dyn EngineSpec>, String> {
        let names: Vec<&str> = match arg {
            Some(list) => list.split(',').map(str::trim).collect(),
            None if self.default_set.is_empty() => {
                return Err(format!(
                    "no engine is in the default comparison set yet; choose one with --engine (known: {})",
                    self.names().join(", ")
                ));
            }
            None => self.default_set.to_vec(),
        };
        let mut out: Vec<&'static dyn EngineSpec> = Vec::new();
        for name in names {
            if name.is_empty() {
                return Err("--engine has an empty name in its list".into());
            }
            let spec = self.find(name).ok_or_else(|| {
                format!(
                    "unknown engine {name:?} (known: {})",
                    self.names().join(", ")
                )
            })?;
            if out.iter().any(|e| e.name() == name) {
                return Err(format!("engine {name} is listed twice in --engine"));
            }
            out.push(spec);
        }
        Ok(out)
    }

    /// The engine a shell uses without `--engine`: the first of the default
    /// set.
    pub fn resolve_one(&self, arg: Option<&str>) -> Result<&'static dyn EngineSpec, String> {
        match arg {
            Some(name) => self.find(name).ok_or_else(|| {
                format!(
                    "unknown engine {name:?} (known: {})",
                    self.names().join(", ")
                )
            }),
            None => self.resolve(None).map(|v| v[0]),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_set_names_registered_engines() {
        for name in REGISTRY.default_set {
            assert!(REGISTRY.find(name).is_some(), "{name} is not registered");
        }
        let names = REGISTRY.names();
        let mut unique = names.clone();
        unique.sort();
        unique.dedup();
        assert_eq!(unique.len(), names.len(), "engine names are unique");
    }

    #[test]
    fn resolves_lists_and_refuses_unknown_or_repeated_names() {
        assert_eq!(REGISTRY.resolve(Some("reference")).unwrap().len(), 1);
        let Err(e) = REGISTRY.resolve(Some("reference,nope")) else {
            panic!("an unknown name resolves")
        };
        assert!(
            e.contains("unknown engine \"nope\"") && e.contains("reference"),
            "{e}"
        );
        assert!(REGISTRY.resolve(Some("reference,reference")).is_err());
        assert!(REGISTRY.resolve(Some("")).is_err());
    }

    #[test]
    fn an_empty_default_set_says_so() {
        let empty = Registry {
            engines: &[&Reference],
            default_set: &[],
        };
        let Err(e) = empty.resolve(None) else {
            panic!("an empty default set resolves")
        };
        assert!(
            e.contains("no engine is in the default comparison set"),
            "{e}"
        );
        let one = Registry {
            engines: &[&Reference],
            default_set: &["reference"],
        };
        assert_eq!(one.resolve(None).unwrap()[0].name(), "reference");
        assert_eq!(one.resolve_one(None).unwrap().name(), "reference");
    }
}
