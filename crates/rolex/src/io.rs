//! Remote reads shared by compute nodes and memory node 0: model records,
//! chains of synonym leaves, and leaves validated by their versions.

use crate::layout::entry::Entry;
use crate::layout::leaf::{Leaf, LeafError, LeafLayout, words_of};
use crate::layout::meta::ModelRef;
use crate::layout::record::{ModelParams, RecordLayout, W_STATE, decode_header};
use crate::remote::Remote;
use dmkv_api::{KvError, Result};
use dmkv_transport::Endpoint;
use dmkv_transport::exec::yield_now;

/// How often a torn leaf is read again before the reader gives up (a
/// writer would have to rewrite the leaf this many times during reads).
pub const TORN_RETRIES: usize = 100_000;

pub fn corrupt(what: impl Into<String>) -> KvError {
    KvError::Corrupt(what.into())
}

/// A leaf's identity: its leaf region and number.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct LeafId {
    pub region: u8,
    pub leaf: u64,
}

impl From<Entry> for LeafId {
    fn from(e: Entry) -> LeafId {
        LeafId {
            region: e.region,
            leaf: e.leaf,
        }
    }
}

/// The mutable part of a record as read in one go.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Tables {
    pub state: u64,
    /// All SLT words; `slt[0]` is slot_use.
    pub slt: Vec<u64>,
    pub lt: Vec<u64>,
}

impl Tables {
    pub fn slot_use(&self) -> u64 {
        self.slt[0]
    }
}

/// Reads a record's parameters.
pub async fn read_params(
    ep: &Endpoint,
    r: &Remote,
    m: ModelRef,
    max_slt: usize,
) -> Result<ModelParams> {
    let addr = r
        .record(m, 0)
        .ok_or_else(|| corrupt(format!("bad model reference {m:?}")))?;
    let b = ep.read(addr, RecordLayout::header_words() * 8).await?;
    let p = decode_header(&b, max_slt).map_err(corrupt)?;
    if p.region as usize >= r.nodes() {
        return Err(corrupt(format!(
            "model {m:?} names leaf region {}",
            p.region
        )));
    }
    Ok(p)
}

/// Byte range of a record's state word through its last LT entry.
pub fn tables_span(p: &ModelParams) -> (usize, usize) {
    let l = RecordLayout {
        slt: p.slt_slots as usize,
    };
    (W_STATE, l.words(p.leaves as usize) - W_STATE)
}

pub fn decode_tables(p: &ModelParams, bytes: &[u8]) -> Tables {
    let w = words_of(bytes);
    let s = p.slt_slots as usize;
    Tables {
        state: w[0],
        slt: w[1..1 + s].to_vec(),
        lt: w[1 + s..].to_vec(),
    }
}

/// Reads a record's state, SLT and LT in one read.
pub async fn read_tables(
    ep: &Endpoint,
    r: &Remote,
    m: ModelRef,
    p: &ModelParams,
) -> Result<Tables> {
    let (word, words) = tables_span(p);
    let addr = r
        .record(m, word)
        .ok_or_else(|| corrupt("model record out of its region"))?;
    let b = ep.read(addr, words * 8).await?;
    Ok(decode_tables(p, &b))
}

/// One leaf of a group's chain: `slot` 0 is the trained leaf (its entry is
/// in the LT), otherwise the SLT slot of a synonym leaf.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Link {
    pub slot: usize,
    pub entry: Entry,
}

/// The chain of a group: its trained leaf, then its synonym leaves in key
/// order, following synonym pointers through `slt`. Refuses pointers past
/// slot_use and cycles (a scribbled table must not hang anyone).
pub fn chain(lt_word: u64, slt: &[u64]) -> Result<Vec<Link>, String> {
    let mut out = Vec::new();
    walk_chain(lt_word, slt, |l| out.push(l))?;
    Ok(out)
}

/// Hands each link of the chain to `f`, in the order [`chain`] lists them,
/// with the same refusals (links before a refused pointer were handed
/// over already); for callers that need no list.
pub fn walk_chain(lt_word: u64, slt: &[u64], mut f: impl FnMut(Link)) -> Result<(), String> {
    let head = Entry::decode(lt_word).ok_or("retired entry")?;
    let used = (slt.first().copied().unwrap_or(1) as usize).min(slt.len());
    f(Link {
        slot: 0,
        entry: head,
    });
    let mut links = 1;
    let mut next = head.syn as usize;
    while next != 0 {
        if next >= used || links > slt.len() {
            return Err(format!(
                "synonym pointer {next} past the {used} used SLT slots or in a cycle"
            ));
        }
        let e = Entry::decode(slt[next]).ok_or("retired SLT entry")?;
        f(Link {
            slot: next,
            entry: e,
        });
        links += 1;
        next = e.syn as usize;
    }
    Ok(())
}

/// Reads leaves in one batch, reading torn ones again until every image is
/// consistent.
pub async fn read_leaves(
    ep: &Endpoint,
    r: &Remote,
    layout: &LeafLayout,
    ids: &[LeafId],
) -> Result<Vec<Leaf>> {
    let mut out: Vec<Option<Leaf>> = vec![None; ids.len()];
    for _ in 0..TORN_RETRIES {
        let todo: Vec<usize> = (0..ids.len()).filter(|i| out[*i].is_none()).collect();
        if todo.is_empty() {
            return Ok(out.into_iter().map(|l| l.expect("read")).collect());
        }
        let mut b = ep.batch();
        for &i in &todo {
            let addr = r
                .leaf(ids[i].region, ids[i].leaf)
                .ok_or_else(|| corrupt(format!("leaf {:?} is outside its region", ids[i])))?;
            b.read(addr, layout.bytes());
        }
        let mut res = b.run().await?;
        for (n, &i) in todo.iter().enumerate() {
            match Leaf::decode(layout, &res.take_read(n)) {
                Ok(l) => out[i] = Some(l),
                Err(LeafError::Torn) => {}
                Err(LeafError::Corrupt(e)) => {
                    return Err(corrupt(format!("leaf {:?}: {e}", ids[i])));
                }
            }
        }
        yield_now().await;
    }
    Err(corrupt("leaves stayed torn across every retry"))
}
