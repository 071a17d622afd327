//! The meta region on memory node 0: configuration, the directory root, the
//! retraining circular queues (CirQ, §3.5) and two directory image slots.
//!
//! ```text
//! word 0       magic
//! words 1..7   configuration: leaf slots, SLT slots, memory nodes, queue slots,
//!              directory slot words, leaf bytes
//! word 8       root: image length in words (bits 32..63) | version (bits 0..31)
//! word 9       CirQ tail   (FAA by compute nodes)
//! word 10      CirQ head   (memory node)
//! word 11      urgent CirQ tail (models whose SLT is full)
//! word 12      urgent CirQ head
//! word 13      retrains in flight (memory node)
//! word 14      retrains done (memory node)
//! word 15      queue polls (memory node)
//! words 16..   CirQ slots [Q], urgent CirQ slots [Q]: 0 = empty, else a model reference
//! then         directory image slot 0, slot 1 (version v lives in slot v % 2)
//! ```
//!
//! Directory image (words):
//! ```text
//! 0            front version (written last)
//! 1            model count M
//! 2            upper level count L
//! per level, top level first: segment count c, max error e, then c x
//!              [first key, last key, slope f64, intercept f64] predicting
//!              the index in the level below
//! M x          [model low key, model reference]
//! last         back version (written first)
//! ```
//! Model reference: memory node index (bits 56..62) | record byte offset in
//! that node's model region.

use crate::layout::leaf::words_of;
use crate::upper::{Segment, UpperIndex};

pub const META_MAGIC: u64 = 0x4154_454D_5845_4C4F; // "OLEXMETA"
pub const W_MAGIC: usize = 0;
pub const W_SLOTS: usize = 1;
pub const W_SLT: usize = 2;
pub const W_NODES: usize = 3;
pub const W_QUEUE: usize = 4;
pub const W_DIR_SLOT_WORDS: usize = 5;
pub const W_LEAF_BYTES: usize = 6;
pub const W_ROOT: usize = 8;
pub const W_QTAIL: usize = 9;
pub const W_QHEAD: usize = 10;
pub const W_UTAIL: usize = 11;
pub const W_UHEAD: usize = 12;
pub const W_INFLIGHT: usize = 13;
pub const W_RETRAINS: usize = 14;
pub const W_POLLS: usize = 15;
pub const W_QUEUE_BASE: usize = 16;

/// Word offsets of a meta region.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MetaLayout {
    pub queue: usize,
    pub dir_slot_words: usize,
}

impl MetaLayout {
    pub fn queue_slot(&self, urgent: bool, i: u64) -> usize {
        W_QUEUE_BASE + if urgent { self.queue } else { 0 } + (i % self.queue as u64) as usize
    }
    pub fn dir_slot(&self, version: u64) -> usize {
        W_QUEUE_BASE + 2 * self.queue + (version % 2) as usize * self.dir_slot_words
    }
    pub fn words(&self) -> usize {
        W_QUEUE_BASE + 2 * self.queue + 2 * self.dir_slot_words
    }
}

pub fn root_word(version: u32, len_words: u32) -> u64 {
    (len_words as u64) << 32 | version as u64
}

pub fn decode_root(w: u64) -> (u32, u32) {
    (w as u32, (w >> 32) as u32)
}

/// A model reference: where its record is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct ModelRef {
    pub node: u8,
    pub offset: u64,
}

impl ModelRef {
    pub fn encode(self) -> u64 {
        (self.node as u64) << 56 | self.offset
    }
    pub fn decode(w: u64) -> Option<ModelRef> {
        let r = ModelRef {
            node: (w >> 56) as u8,
            offset: w & ((1 << 56) - 1),
        };
        (w != 0 && r.node < 128 && r.offset.is_multiple_of(8)).then_some(r)
    }
}

/// A decoded directory: the models in key order and the upper levels over
/// their low keys.
#[derive(Debug, Clone, PartialEq)]
pub struct Directory {
    pub version: u64,
    pub lows: Vec<u64>,
    pub refs: Vec<ModelRef>,
    pub upper: UpperIndex,
}

impl Directory {
    /// Index of the model whose range holds `key`.
    pub fn model_for(&self, key: u64) -> usize {
        self.upper.lookup(&self.lows, key)
    }

    pub fn encode(&self) -> Vec<u64> {
        let mut w = vec![
            self.version,
            self.lows.len() as u64,
            self.upper.levels.len() as u64,
        ];
        for (segs, err) in self.upper.levels.iter().zip(&self.upper.errs) {
            w.push(segs.len() as u64);
            w.push(*err as u64);
            for s in segs {
                w.extend_from_slice(&[s.first, s.last, s.slope.to_bits(), s.intercept.to_bits()]);
            }
        }
        for (low, r) in self.lows.iter().zip(&self.refs) {
            w.push(*low);
            w.push(r.encode());
        }
        w.push(self.version);
        w
    }

    /// Parses an image; `Ok(None)` if it is torn or not version `version`
    /// (read again), `Err` if it is impossible.
    pub fn decode(bytes: &[u8], version: u32) -> Result<Option<Directory>, String> {
        let w = words_of(bytes);
        if w.len() < 4 {
            return Err("directory image too short".into());
        }
        let (front, back) = (w[0], w[w.len() - 1]);
        if front != back || front as u32 != version {
            return Ok(None);
        }
        let m = w[1] as usize;
        let levels = w[2] as usize;
        let mut pos = 3;
        let mut take = |n: usize| -> Result<&[u64], String> {
            if pos + n > w.len() - 1 {
                return Err("directory image truncated".into());
            }
            pos += n;
            Ok(&w[pos - n..pos])
        };
        let mut upper = UpperIndex::default();
        for _ in 0..levels.min(64) {
            let h = take(2)?;
            let (c, err) = (h[0] as usize, h[1] as u32);
            if c == 0 || c > m {
                return Err(format!("directory level with {c} segments over {m} models"));
            }
            let body = take(c.checked_mul(4).ok_or("segment count overflows")?)?;
            let segs = body
                .chunks_exact(4)
                .map(|s| Segment {
                    first: s[0],
                    last: s[1],
                    slope: f64::from_bits(s[2]),
                    intercept: f64::from_bits(s[3]),
                })
                .collect();
            upper.levels.push(segs);
            upper.errs.push(err);
        }
        let body = take(m.checked_mul(2).ok_or("model count overflows")?)?;
        if m == 0 || pos != w.len() - 1 {
            return Err(format!("directory of {m} models has a bad length"));
        }
        let mut lows = Vec::with_capacity(m);
        let mut refs = Vec::with_capacity(m);
        for p in body.chunks_exact(2) {
            if lows.last().is_some_and(|l| *l >= p[0]) {
                return Err("directory models out of order".into());
            }
            lows.push(p[0]);
            refs.push(ModelRef::decode(p[1]).ok_or("bad model reference")?);
        }
        if lows[0] != 0 {
            return Err("the first model does not start at key 0".into());
        }
        upper.check(&lows)?;
        Ok(Some(Directory {
            version: front,
            lows,
            refs,
            upper,
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn directory_round_trips_and_refuses_tears() {
        let lows: Vec<u64> = (0..500u64).map(|i| i * i * 1000).collect();
        let refs: Vec<ModelRef> = (0..500u64)
            .map(|i| ModelRef {
                node: (i % 3) as u8,
                offset: 64 + i * 800,
            })
            .collect();
        let d = Directory {
            version: 7,
            upper: UpperIndex::build(&lows, 4),
            lows,
            refs,
        };
        let w = d.encode();
        let b: Vec<u8> = w.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(Directory::decode(&b, 7).unwrap(), Some(d.clone()));
        assert_eq!(Directory::decode(&b, 9).unwrap(), None, "another version");
        let mut torn = b.clone();
        torn[..8].copy_from_slice(&9u64.to_le_bytes());
        assert_eq!(Directory::decode(&torn, 7).unwrap(), None);
        assert!(
            Directory::decode(&b[..b.len() - 16], 7).is_err()
                || Directory::decode(&b[..b.len() - 16], 7).unwrap().is_none()
        );
        for k in [0, 1, 999, 1000, 4000, 1_000_000, u64::MAX - 1] {
            let i = d.model_for(k);
            assert!(
                d.lows[i] <= k && d.lows.get(i + 1).is_none_or(|n| k < *n),
                "key {k}"
            );
        }
    }

    #[test]
    fn refs_round_trip() {
        let r = ModelRef {
            node: 5,
            offset: 4096,
        };
        assert_eq!(ModelRef::decode(r.encode()), Some(r));
        assert_eq!(ModelRef::decode(0), None);
    }
}
