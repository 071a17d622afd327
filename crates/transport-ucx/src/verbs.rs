//! One-sided verbs carried as messages: the TCP path.
//!
//! Over TCP, UCX emulates `ucp_get/put/atomic_op_nbx` itself with messages
//! that the target's progress thread serves, without checking addresses and
//! (UCX 1.13) aborting the target process when a get arrives from a peer
//! whose endpoint has failed. dmkv therefore carries verbs over TCP itself,
//! exactly as UCX would (one message per node and batch, served on the
//! node's progress thread, with no handler thread involved), but checked
//! against the node's region table (key, bounds, alignment, before any byte
//! moves) and executed through `RegionMem` (word-atomic, increasing address
//! order, CPU atomics), so the contract holds in full.
//!
//! Request: `count u32`, then per verb `kind u8 | region u32 | key u64 |
//! offset u64` and `len u32` (read), `bytes` (write), `expected u64 | new
//! u64` (CAS) or `add u64` (FAA). Reply: `status u8` (0 = ok) and the
//! results in order (read: `bytes`; CAS and FAA: `u64`), or an error.

use crate::server::RegionEntry;
use dmkv_transport::region::RegionAccessError;
use dmkv_transport::{
    NodeId, RegionId, Result, TransportError, Verb, VerbResult, WireReader, WireWriter,
};
use std::collections::HashMap;

const READ: u8 = 1;
const WRITE: u8 = 2;
const CAS: u8 = 3;
const FAA: u8 = 4;

const OK: u8 = 0;
const NO_REGION: u8 = 1;
const DENIED: u8 = 2;
const OUT_OF_BOUNDS: u8 = 3;
const MISALIGNED: u8 = 4;
const MALFORMED: u8 = 5;

/// Encodes the verbs of one batch to one node.
pub(crate) fn encode(verbs: &[Verb]) -> Vec<u8> {
    let mut w = WireWriter::new();
    w.u32(verbs.len() as u32);
    for v in verbs {
        let (kind, a) = match v {
            Verb::Read { addr, .. } => (READ, addr),
            Verb::Write { addr, .. } => (WRITE, addr),
            Verb::Cas { addr, .. } => (CAS, addr),
            Verb::Faa { addr, .. } => (FAA, addr),
        };
        w.u8(kind).u32(a.region.0).u64(a.key.0).u64(a.offset);
        match v {
            Verb::Read { len, .. } => {
                w.u32(u32::try_from(*len).expect("reads are below 4 GiB"));
            }
            Verb::Write { data, .. } => {
                w.bytes(data);
            }
            Verb::Cas { expected, new, .. } => {
                w.u64(*expected).u64(*new);
            }
            Verb::Faa { add, .. } => {
                w.u64(*add);
            }
        }
    }
    w.finish()
}

enum Op<'a> {
    Read(u64, usize),
    Write(u64, &'a [u8]),
    Cas(u64, u64, u64),
    Faa(u64, u64),
}

/// Serves one verbs message against the node's regions: checks every verb,
/// then executes them in order. Returns the encoded reply.
pub(crate) fn serve(regions: &HashMap<u32, RegionEntry>, data: &[u8]) -> Vec<u8> {
    let mut w = WireWriter::new();
    match serve_inner(regions, data, &mut w) {
        Ok(()) => w.finish(),
        Err(e) => e,
    }
}

fn serve_inner(
    regions: &HashMap<u32, RegionEntry>,
    data: &[u8],
    w: &mut WireWriter,
) -> std::result::Result<(), Vec<u8>> {
    let malformed = |m: String| {
        let mut e = WireWriter::new();
        e.u8(MALFORMED).str(&m);
        e.finish()
    };
    let mut r = WireReader::new(data);
    let n = r.count(21).map_err(|e| malformed(e.0))?;
    let mut ops = Vec::with_capacity(n);
    // Check everything first: a refused verb moves no byte.
    for _ in 0..n {
        let parse = (|| {
            let kind = r.u8()?;
            let region = r.u32()?;
            let key = r.u64()?;
            let offset = r.u64()?;
            let op = match kind {
                READ => Op::Read(offset, r.u32()? as usize),
                WRITE => Op::Write(offset, r.bytes()?),
                CAS => Op::Cas(offset, r.u64()?, r.u64()?),
                FAA => Op::Faa(offset, r.u64()?),
                k => return Err(dmkv_transport::WireError(format!("verb kind {k}"))),
            };
            Ok((region, key, op))
        })();
        let (region, key, op) = parse.map_err(|e| malformed(e.0))?;
        let Some(entry) = regions.get(&region) else {
            let mut e = WireWriter::new();
            e.u8(NO_REGION).u32(region);
            return Err(e.finish());
        };
        if entry.key.0 != key {
            let mut e = WireWriter::new();
            e.u8(DENIED).u32(region);
            return Err(e.finish());
        }
        let (offset, len, atomic) = match op {
            Op::Read(o, l) => (o, l as u64, false),
            Op::Write(o, d) => (o, d.len() as u64, false),
            Op::Cas(o, ..) | Op::Faa(o, _) => (o, 8, true),
        };
        if atomic && !offset.is_multiple_of(8) {
            let mut e = WireWriter::new();
            e.u8(MISALIGNED).u64(offset);
            return Err(e.finish());
        }
        if let Err(RegionAccessError::OutOfBounds { offset, len, size }) =
            entry.view.check(offset, len)
        {
            let mut e = WireWriter::new();
            e.u8(OUT_OF_BOUNDS)
                .u32(region)
                .u64(offset)
                .u64(len)
                .u64(size);
            return Err(e.finish());
        }
        ops.push((entry, op));
    }
    r.end().map_err(|e| malformed(e.0))?;
    w.u8(OK);
    for (entry, op) in ops {
        let mem = &entry.view;
        // Checked above, so these cannot fail.
        match op {
            Op::Read(o, l) => {
                let v = mem.read_vec(o, l).map_err(|e| malformed(e.to_string()))?;
                w.bytes(&v);
            }
            Op::Write(o, d) => mem.write(o, d).map_err(|e| malformed(e.to_string()))?,
            Op::Cas(o, expected, new) => {
                w.u64(
                    mem.cas_u64(o, expected, new)
                        .map_err(|e| malformed(e.to_string()))?,
                );
            }
            Op::Faa(o, add) => {
                w.u64(mem.faa_u64(o, add).map_err(|e| malformed(e.to_string()))?);
            }
        }
    }
    Ok(())
}

/// Decodes the reply to `verbs` sent to `node`.
pub(crate) fn decode_reply(node: NodeId, verbs: &[Verb], reply: &[u8]) -> Result<Vec<VerbResult>> {
    let mut r = WireReader::new(reply);
    match r.u8()? {
        OK => {}
        NO_REGION => {
            return Err(TransportError::NoSuchRegion {
                node,
                region: RegionId(r.u32()?),
            });
        }
        DENIED => {
            return Err(TransportError::AccessDenied {
                node,
                region: RegionId(r.u32()?),
            });
        }
        OUT_OF_BOUNDS => {
            return Err(TransportError::OutOfBounds {
                node,
                region: RegionId(r.u32()?),
                offset: r.u64()?,
                len: r.u64()?,
                size: r.u64()?,
            });
        }
        MISALIGNED => return Err(TransportError::Misaligned { offset: r.u64()? }),
        MALFORMED => {
            return Err(TransportError::Malformed(format!(
                "node {node} could not parse verbs: {}",
                r.str()?
            )));
        }
        s => return Err(TransportError::Malformed(format!("verbs reply status {s}"))),
    }
    let mut out = Vec::with_capacity(verbs.len());
    for v in verbs {
        out.push(match v {
            Verb::Read { len, .. } => {
                let b = r.bytes()?;
                if b.len() != *len {
                    return Err(TransportError::Malformed("short read reply".into()));
                }
                VerbResult::Read(b.to_vec())
            }
            Verb::Write { .. } => VerbResult::Write,
            Verb::Cas { .. } => VerbResult::Cas(r.u64()?),
            Verb::Faa { .. } => VerbResult::Faa(r.u64()?),
        });
    }
    r.end()?;
    Ok(out)
}
