//! The memory node's RPC service: opcodes and byte formats
//! (docs/xstore.md, *RPCs*). Requests start with an opcode byte; every
//! field is parsed with bounds checks and trailing bytes are refused.
//!
//! Model updates travel in fallback replies as the exact bytes clients
//! would read one-sided (header, record, TT entries), so clients validate
//! them with the same code.

use crate::layout::{HEADER_BYTES, ModelHeader, RECORD_BYTES, SubRecord};
use dmkv_transport::{WireError, WireReader, WireWriter};

/// Name of the service (under the instance prefix).
pub const SERVICE: &str = "xstore";
/// Regions (under the instance prefix).
pub const NODE_REGION: &str = "nodes";
pub const VALUE_REGION: &str = "values";
pub const MODEL_REGION: &str = "models";

/// GET by the server (the fallback path): `key u64 | generation u32 |
/// want u8` -> `found bool | [value bytes] | update`.
pub const OP_GET: u8 = 1;
/// SCAN by the server: `start u64 | n u32 | generation u32 | want u8` ->
/// `count u32 | (key u64 | value bytes)* | complete bool | update`.
/// `complete` is false when the reply filled up before `n` pairs and the
/// partition's end: the client continues from after the last key.
pub const OP_SCAN: u8 = 2;
/// `key u64 | value bytes` -> `done bool`.
pub const OP_INSERT: u8 = 3;
/// `key u64 | value bytes | count u8 | (leaf u32 | incarnation u32) *
/// count` -> `updated bool | hint_used bool`. The position hint is `count`
/// TT entries (0: no hint), most likely leaf first, at most
/// [`dmkv_xtree::MAX_HINT_LEAVES`]; a longer one is refused as malformed,
/// as are entries the tree refuses (`XTree::update_hinted_leaves`). A
/// one-leaf hint has the bytes of the earlier `flag 1 | leaf |
/// incarnation`.
pub const OP_UPDATE: u8 = 4;
pub const OP_UPSERT: u8 = 5;
/// `key u64` -> `deleted bool`.
pub const OP_DELETE: u8 = 6;
/// `count u32 | (key u64 | value bytes)*` -> empty.
pub const OP_LOAD: u8 = 7;
/// Empty -> empty, once the committed model covers every loaded key.
pub const OP_PREPARE: u8 = 8;
/// Empty -> empty, once background retraining has caught up.
pub const OP_SETTLE: u8 = 9;
/// Empty -> a JSON object (UTF-8).
pub const OP_STATS: u8 = 10;

/// What model a fallback wants back, by cache mode.
pub const WANT_NOTHING: u8 = 0;
pub const WANT_RECORD: u8 = 1;
pub const WANT_RECORD_AND_TT: u8 = 2;

/// Largest reply payload the service builds (scans stop before it).
pub const MAX_REPLY_BYTES: usize = 1 << 20;
/// Largest SCAN count a request may ask for.
pub const MAX_SCAN: u32 = 1 << 20;

/// A sub-model as a fallback returns it.
#[derive(Debug, Clone, PartialEq)]
pub struct SubUpdate {
    pub record: SubRecord,
    pub entries: Option<Vec<u64>>,
}

/// The model part of a fallback reply.
#[derive(Debug, Clone, PartialEq)]
pub enum ModelUpdate {
    None,
    /// A sub-model of the generation the client has.
    Sub(SubUpdate),
    /// A newer generation, and the sub-model the key routes to in it.
    Generation(ModelHeader, Option<SubUpdate>),
}

fn put_sub(w: &mut WireWriter, s: &SubUpdate) {
    w.raw(&s.record.encode());
    match &s.entries {
        None => {
            w.u8(0);
        }
        Some(e) => {
            w.u8(1).u32(e.len() as u32);
            for x in e {
                w.u64(*x);
            }
        }
    }
}

fn get_sub(r: &mut WireReader<'_>) -> Result<SubUpdate, WireError> {
    let record = SubRecord::decode(r.raw(RECORD_BYTES)?).map_err(|e| WireError(e.to_string()))?;
    let entries = match r.u8()? {
        0 => None,
        1 => {
            let n = r.count(8)?;
            if n != record.tt_len as usize {
                return Err(WireError(format!(
                    "{n} TT entries for a record of {}",
                    record.tt_len
                )));
            }
            Some((0..n).map(|_| r.u64()).collect::<Result<_, _>>()?)
        }
        b => return Err(WireError(format!("TT flag {b}"))),
    };
    Ok(SubUpdate { record, entries })
}

impl ModelUpdate {
    pub fn encode(&self, w: &mut WireWriter) {
        match self {
            ModelUpdate::None => {
                w.u8(0);
            }
            ModelUpdate::Sub(s) => {
                w.u8(1);
                put_sub(w, s);
            }
            ModelUpdate::Generation(h, s) => {
                w.u8(2).raw(&h.encode());
                match s {
                    None => {
                        w.u8(0);
                    }
                    Some(s) => {
                        w.u8(1);
                        put_sub(w, s);
                    }
                }
            }
        }
    }

    pub fn decode(r: &mut WireReader<'_>) -> Result<ModelUpdate, WireError> {
        Ok(match r.u8()? {
            0 => ModelUpdate::None,
            1 => ModelUpdate::Sub(get_sub(r)?),
            2 => {
                let h = ModelHeader::decode(r.raw(HEADER_BYTES)?)
                    .map_err(|e| WireError(e.to_string()))?;
                let s = match r.u8()? {
                    0 => None,
                    1 => Some(get_sub(r)?),
                    b => return Err(WireError(format!("sub flag {b}"))),
                };
                ModelUpdate::Generation(h, s)
            }
            b => return Err(WireError(format!("model update kind {b}"))),
        })
    }
}
