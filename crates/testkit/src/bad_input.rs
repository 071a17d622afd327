//! Bad input must get a clear error and harm nothing.

use dmkv_api::deploy::{DeployOptions, LocalDeployment};
use dmkv_api::{EngineSpec, KvError, KvStore};
use dmkv_transport::exec::block_on;
use dmkv_transport::{ErrorCode, TransportError};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};

/// Each `(knob, value)` of `bad`, set alone on top of `base`'s knobs, must
/// be refused at deployment with a configuration error that names the
/// knob; a deployment that succeeds, or fails for another reason, is an
/// error naming the pair.
pub fn check_knobs_refused(
    spec: &dyn EngineSpec,
    base: &DeployOptions,
    bad: &[(&str, &str)],
) -> Result<(), String> {
    for &(knob, value) in bad {
        let mut opts = base.clone();
        opts.knobs.set(knob, value);
        match LocalDeployment::deploy(spec, &opts) {
            Ok(_) => return Err(format!("{}.{knob}={value} was accepted", spec.name())),
            Err(KvError::Config(msg)) if msg.contains(knob) => {}
            Err(e) => {
                return Err(format!(
                    "{}.{knob}={value} was refused, but not with a configuration \
                     error naming the knob: {e}",
                    spec.name()
                ));
            }
        }
    }
    Ok(())
}

/// Reserved keys, oversized values, empty and maximal values, scans where
/// unsupported, and the expected outcomes that are not errors.
pub fn check_api_input(d: &LocalDeployment) -> Result<(), String> {
    let (_ep, store) = d.client(0).map_err(|e| e.to_string())?;
    let caps = d.engine.capabilities();
    block_on(async {
        let s: &dyn KvStore = &*store;
        for &k in caps.reserved_keys {
            for (what, r) in [
                ("get", s.get(k).await.map(|_| ())),
                ("insert", s.insert(k, b"12345678").await.map(|_| ())),
                ("update", s.update(k, b"12345678").await.map(|_| ())),
                ("upsert", s.upsert(k, b"12345678").await.map(|_| ())),
                ("delete", s.delete(k).await.map(|_| ())),
            ] {
                if !matches!(r, Err(KvError::ReservedKey { .. })) {
                    return Err(format!("{what} of reserved key {k:#x} gave {r:?}"));
                }
            }
        }
        let big = vec![7u8; caps.max_value_len + 1];
        for (what, r) in [
            ("insert", s.insert(10, &big).await.map(|_| ())),
            ("upsert", s.upsert(10, &big).await.map(|_| ())),
        ] {
            if !matches!(r, Err(KvError::ValueTooLarge { .. })) {
                return Err(format!("{what} of an oversized value gave {r:?}"));
            }
        }
        if s.get(10).await.map_err(|e| e.to_string())?.is_some() {
            return Err("a refused insert left a key behind".into());
        }
        let max = vec![9u8; caps.max_value_len];
        let ok = |r: Result<bool, KvError>, want: bool, what: &str| match r {
            Ok(b) if b == want => Ok(()),
            other => Err(format!("{what}: got {other:?}, want Ok({want})")),
        };
        ok(s.insert(11, &max).await, true, "insert of a maximal value")?;
        if s.get(11).await.map_err(|e| e.to_string())?.as_deref() != Some(&max[..]) {
            return Err("maximal value did not read back".into());
        }
        if !matches!(s.update(11, &big).await, Err(KvError::ValueTooLarge { .. })) {
            return Err("update with an oversized value was not refused".into());
        }
        if s.get(11).await.map_err(|e| e.to_string())?.as_deref() != Some(&max[..]) {
            return Err("a refused update changed the value".into());
        }
        ok(s.insert(12, b"").await, true, "insert of an empty value")?;
        if s.get(12).await.map_err(|e| e.to_string())?.as_deref() != Some(&b""[..]) {
            return Err("empty value did not read back".into());
        }
        ok(
            s.insert(12, b"other").await,
            false,
            "insert of an existing key",
        )?;
        if s.get(12).await.map_err(|e| e.to_string())?.as_deref() != Some(&b""[..]) {
            return Err("a refused insert changed the value".into());
        }
        ok(s.update(13, b"x").await, false, "update of a missing key")?;
        ok(s.delete(13).await, false, "delete of a missing key")?;
        if s.get(13).await.map_err(|e| e.to_string())?.is_some() {
            return Err("a missing key appeared".into());
        }
        if caps.scan {
            if !s.scan(0, 0).await.map_err(|e| e.to_string())?.is_empty() {
                return Err("scan of 0 pairs returned pairs".into());
            }
            let tail = s.scan(u64::MAX - 1, 10).await.map_err(|e| e.to_string())?;
            if !tail.is_empty() {
                return Err(format!("scan past every key returned {tail:?}"));
            }
        } else if !matches!(s.scan(0, 10).await, Err(KvError::Unsupported { .. })) {
            return Err("scan on an engine without scans was not refused".into());
        }
        Ok(())
    })
}

/// Sends random payloads to every service the engine registered on its
/// nodes. Each must be answered (with an error or a reply), never crash a
/// handler, and the engine must still work afterwards.
pub fn check_garbage_rpcs(
    d: &LocalDeployment,
    payloads_per_service: usize,
    seed: u64,
) -> Result<(), String> {
    let ep = d.endpoint(0);
    let mut rng = SmallRng::seed_from_u64(seed);
    let mut tried = 0;
    for rt in &d.runtimes {
        let node = rt.id();
        for name in rt.host().services().service_names() {
            if !name.starts_with(&d.args.instance) {
                continue;
            }
            let svc = block_on(ep.lookup_service(node, &name)).map_err(|e| e.to_string())?;
            for _ in 0..payloads_per_service {
                let len = [0, 1, 2, 5, 9, 17, 33, 100, 1000][rng.gen_range(0..9)];
                let mut p: Vec<u8> = (0..len).map(|_| rng.r#gen()).collect();
                if !p.is_empty() && rng.gen_bool(0.5) {
                    // Plausible opcodes reach deeper into parsers.
                    p[0] = rng.gen_range(0..16);
                }
                tried += 1;
                match block_on(ep.call(node, svc, p.clone())) {
                    Ok(_) => {}
                    Err(TransportError::Remote { error, .. })
                        if error.code == ErrorCode::Failed
                            && error.message.contains("panicked") =>
                    {
                        return Err(format!("service {name} panicked on payload {p:?}"));
                    }
                    Err(TransportError::Remote { .. }) => {}
                    Err(e) => {
                        return Err(format!(
                            "service {name}: transport failure {e} on payload {p:?}"
                        ));
                    }
                }
            }
        }
    }
    if tried == 0 {
        return Err("the engine registered no services under its instance name".into());
    }
    // The engine still works.
    let (_ep, store) = d.client(0).map_err(|e| e.to_string())?;
    block_on(async {
        for k in [1_000_003u64, 2_000_003, 3_000_003] {
            let v = dmkv_api::payload::make_value(k, 1, 8);
            store.upsert(k, &v).await.map_err(|e| e.to_string())?;
            if store.get(k).await.map_err(|e| e.to_string())?.as_deref() != Some(&v[..]) {
                return Err(format!("after garbage RPCs, key {k} did not read back"));
            }
        }
        Ok(())
    })
}
