//! At-most-once writes across a takeover (dmkv's; the paper has no
//! failover protocol, see `docs/outback.md`, invariant 16).
//!
//! Every write a client sends carries a [`Session`]: a session id (one per
//! write lane of a compute process: a random incarnation of the process
//! and the lane's index) and the lane's sequence number, which grows by
//! one per write operation and stays the same while that operation is
//! re-sent (after STALE, a failover, a lost buffered outcome). A lane runs
//! one write at a time, so per session the memory node sees sequence
//! numbers in order, each possibly several times.
//!
//! The shard keeps, per session, the sequence number and outcome of the
//! last write that changed something (inserted, updated, deleted): a
//! 32-byte entry in the session table of its heap region
//! (`layout::HeapLayout::session`), written to the mirrors in the same
//! forward as the write's own heap changes, after them (the record is the
//! forward's last verb), and then locally. The node that takes the shard
//! over reads the entries from its image ([`Sessions::recover`]); so a
//! write the old primary applied and mirrored has its outcome on the new
//! primary too, and its re-send gets that outcome instead of being
//! applied again ([`Check::Replay`]).
//!
//! Writes that changed nothing (an insert of a present key, an update or
//! delete of an absent one) are not recorded: their re-send runs again,
//! which is linearizable (the first attempt had no effect; the second
//! takes effect within the same operation's interval).
//!
//! Bound: one entry per session that has written to the shard, never
//! freed while the shard lives (a lane is reused by its process, so a
//! process holds at most as many sessions as it ever had writes in flight
//! at once). A new session when the table is full gets an `Exhausted`
//! error naming the knob (`outback.sessions`); nothing is dropped
//! silently. A takeover frees the entries never written (reserved on a
//! primary whose write then failed).

use crate::layout::{HeapLayout, SESSION_BYTES};
use crate::server::heap::Heap;
use crate::server::replica::MirrorOp;
use crate::server::shard::Outcome;
use dmkv_api::checksum64;
use dmkv_transport::ServiceError;
use parking_lot::Mutex;
use std::collections::HashMap;

/// Who sent a write, and which of its writes it is. `id` 0: none (no
/// at-most-once check; server-internal writes and raw test requests).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Session {
    pub id: u64,
    pub seq: u64,
}

impl Session {
    pub const NONE: Session = Session { id: 0, seq: 0 };

    pub fn is_none(&self) -> bool {
        self.id == 0
    }
}

/// What the table says about a write.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Check {
    /// Not applied yet (or it changed nothing): apply it.
    New,
    /// Applied already, with this outcome: answer it, apply nothing.
    Replay(Outcome),
    /// Older than the session's last applied write: a late duplicate,
    /// refused.
    Old { last: u64 },
}

#[derive(Debug, Clone, Copy)]
struct Entry {
    pos: u32,
    /// Last applied sequence number (0: none yet, position reserved).
    seq: u64,
    outcome: Outcome,
}

struct Inner {
    map: HashMap<u64, Entry>,
    /// Free positions, the lowest on top (so a run allocates positions in
    /// a fixed order).
    free: Vec<u32>,
}

/// A record to write: where, and its bytes.
#[derive(Debug, Clone)]
pub struct Record {
    s: Session,
    pos: u32,
    outcome: Outcome,
    /// The entry's write (its address, its bytes), the last op of the
    /// write's forward.
    op: MirrorOp,
}

impl Record {
    /// The mirror op that carries it, as a one-op tail for a forward.
    pub fn ops(&self) -> &[MirrorOp] {
        std::slice::from_ref(&self.op)
    }
}

/// The tail ops of an optional record (none without one).
pub fn tail(r: &Option<Record>) -> &[MirrorOp] {
    r.as_ref().map_or(&[], Record::ops)
}

/// A shard's session table (in memory; the heap region holds its image).
pub struct Sessions {
    layout: HeapLayout,
    inner: Mutex<Inner>,
}

fn outcome_code(o: Outcome) -> u64 {
    match o {
        Outcome::Inserted => 1,
        Outcome::Updated => 2,
        Outcome::Deleted => 3,
        // Only writes that changed something are recorded.
        Outcome::Exists | Outcome::NotFound => 0,
    }
}

fn outcome_of(code: u64) -> Option<Outcome> {
    match code {
        1 => Some(Outcome::Inserted),
        2 => Some(Outcome::Updated),
        3 => Some(Outcome::Deleted),
        _ => None,
    }
}

/// The bytes of an entry: id, seq, outcome code, checksum64 of the three.
pub fn encode_entry(s: Session, outcome: Outcome) -> Vec<u8> {
    let mut b = Vec::with_capacity(SESSION_BYTES as usize);
    b.extend_from_slice(&s.id.to_le_bytes());
    b.extend_from_slice(&s.seq.to_le_bytes());
    b.extend_from_slice(&outcome_code(outcome).to_le_bytes());
    let check = checksum64(&b);
    b.extend_from_slice(&check.to_le_bytes());
    b
}

/// An entry's session and outcome, if it is a whole, valid record.
pub fn parse_entry(b: &[u8]) -> Option<(Session, Outcome)> {
    if b.len() != SESSION_BYTES as usize {
        return None;
    }
    let w = |i: usize| u64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
    let (id, seq, code, check) = (w(0), w(1), w(2), w(3));
    if id == 0 || seq == 0 || checksum64(&b[..24]) != check {
        return None;
    }
    Some((Session { id, seq }, outcome_of(code)?))
}

impl Sessions {
    /// An empty table for `layout`'s entries.
    pub fn new(layout: HeapLayout) -> Sessions {
        Sessions {
            layout,
            inner: Mutex::new(Inner {
                map: HashMap::new(),
                free: (0..layout.sessions as u32).rev().collect(),
            }),
        }
    }

    /// The table of a heap image (a mirror taken over): every valid entry;
    /// invalid ones (never written, or torn) are free. If one session had
    /// two valid entries (it cannot: a position is its session's for the
    /// shard's life) the higher sequence number wins.
    pub fn recover(layout: HeapLayout, read: impl Fn(u64, usize) -> Option<Vec<u8>>) -> Sessions {
        let mut map: HashMap<u64, Entry> = HashMap::new();
        let mut free = Vec::new();
        for pos in (0..layout.sessions as u32).rev() {
            match read(layout.session(pos), SESSION_BYTES as usize)
                .as_deref()
                .and_then(parse_entry)
            {
                Some((s, outcome)) => {
                    let e = Entry {
                        pos,
                        seq: s.seq,
                        outcome,
                    };
                    match map.get(&s.id) {
                        Some(old) if old.seq >= s.seq => free.push(pos),
                        Some(old) => {
                            free.push(old.pos);
                            map.insert(s.id, e);
                        }
                        None => {
                            map.insert(s.id, e);
                        }
                    }
                }
                None => free.push(pos),
            }
        }
        // Lowest position on top, as in `new`.
        free.sort_unstable_by(|a, b| b.cmp(a));
        Sessions {
            layout,
            inner: Mutex::new(Inner { map, free }),
        }
    }

    /// Sessions with a position.
    pub fn len(&self) -> usize {
        self.inner.lock().map.len()
    }

    /// No session has a position.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// What to do with write `s`.
    pub fn check(&self, s: Session) -> Check {
        if s.is_none() {
            return Check::New;
        }
        match self.inner.lock().map.get(&s.id) {
            Some(e) if e.seq == s.seq => Check::Replay(e.outcome),
            Some(e) if e.seq > s.seq => Check::Old { last: e.seq },
            _ => Check::New,
        }
    }

    /// The record of write `s` with `outcome`, to forward with the write's
    /// heap changes; reserves a position for a new session. `None` for no
    /// session or an outcome that changed nothing. Full: `Exhausted`.
    pub fn prepare(&self, s: Session, outcome: Outcome) -> Result<Option<Record>, ServiceError> {
        if s.is_none() || outcome_code(outcome) == 0 {
            return Ok(None);
        }
        let mut g = self.inner.lock();
        let pos = match g.map.get(&s.id) {
            Some(e) => e.pos,
            None => {
                let Some(pos) = g.free.pop() else {
                    return Err(ServiceError::exhausted(format!(
                        "outback: the shard's session table is full ({} sessions); raise \
                         outback.sessions",
                        self.layout.sessions
                    )));
                };
                g.map.insert(
                    s.id,
                    Entry {
                        pos,
                        seq: 0,
                        outcome,
                    },
                );
                pos
            }
        };
        Ok(Some(Record {
            s,
            pos,
            outcome,
            op: MirrorOp::Write {
                addr: self.layout.session(pos),
                data: encode_entry(s, outcome),
            },
        }))
    }

    /// After the record went to the mirrors (with its write): writes it to
    /// this node's heap and makes it the session's last applied write.
    pub fn commit(&self, heap: &Heap, r: &Record) -> Result<(), ServiceError> {
        if let MirrorOp::Write { addr, data } = &r.op {
            heap.write(*addr, data)?;
        }
        let mut g = self.inner.lock();
        if let Some(e) = g.map.get_mut(&r.s.id)
            && e.pos == r.pos
            && e.seq < r.s.seq
        {
            e.seq = r.s.seq;
            e.outcome = r.outcome;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn image(layout: &HeapLayout, entries: &[(u32, Vec<u8>)]) -> Vec<u8> {
        let mut img = vec![0u8; layout.data_start as usize];
        for (pos, b) in entries {
            let at = layout.session(*pos) as usize;
            img[at..at + b.len()].copy_from_slice(b);
        }
        img
    }

    #[test]
    fn entries_round_trip_and_damage_is_refused() {
        let s = Session { id: 77, seq: 5 };
        let b = encode_entry(s, Outcome::Deleted);
        assert_eq!(b.len(), SESSION_BYTES as usize);
        assert_eq!(parse_entry(&b), Some((s, Outcome::Deleted)));
        for i in 0..b.len() {
            let mut d = b.clone();
            d[i] ^= 0x10;
            assert_eq!(parse_entry(&d), None, "byte {i}");
        }
        assert_eq!(parse_entry(&[0; 32]), None);
        assert_eq!(parse_entry(&b[..31]), None);
    }

    #[test]
    fn checks_follow_the_last_applied_write_and_survive_recovery() {
        let layout = HeapLayout::for_data(4096, 4);
        let t = Sessions::new(layout);
        assert!(t.is_empty());
        let a = Session { id: 9, seq: 3 };
        assert_eq!(t.check(a), Check::New);
        // Nothing changed: no record.
        assert!(t.prepare(a, Outcome::Exists).unwrap().is_none());
        assert!(
            t.prepare(Session::NONE, Outcome::Inserted)
                .unwrap()
                .is_none()
        );
        let r = t.prepare(a, Outcome::Inserted).unwrap().unwrap();
        // Reserved, not yet applied.
        assert_eq!(t.check(a), Check::New);
        let mut img = image(&layout, &[]);
        let [MirrorOp::Write { addr, data }] = r.ops() else {
            panic!("a record is a write")
        };
        img[*addr as usize..*addr as usize + data.len()].copy_from_slice(data);
        // `commit` without a heap: what it does to the map.
        {
            let mut g = t.inner.lock();
            let e = g.map.get_mut(&a.id).unwrap();
            e.seq = a.seq;
            e.outcome = Outcome::Inserted;
        }
        assert_eq!(t.check(a), Check::Replay(Outcome::Inserted));
        assert_eq!(t.check(Session { seq: 2, ..a }), Check::Old { last: 3 });
        assert_eq!(t.check(Session { seq: 4, ..a }), Check::New);
        // A takeover reads the same table from the image.
        let back = Sessions::recover(layout, |at, n| {
            img.get(at as usize..at as usize + n).map(<[u8]>::to_vec)
        });
        assert_eq!(back.check(a), Check::Replay(Outcome::Inserted));
        assert_eq!(back.check(Session { seq: 4, ..a }), Check::New);
        assert_eq!(back.len(), 1);
    }

    #[test]
    fn a_full_table_refuses_new_sessions_with_a_clear_error() {
        let layout = HeapLayout::for_data(4096, 2);
        let t = Sessions::new(layout);
        for id in 1..=2 {
            t.prepare(Session { id, seq: 1 }, Outcome::Updated)
                .unwrap()
                .unwrap();
        }
        // A known session still gets its position.
        assert!(
            t.prepare(Session { id: 2, seq: 2 }, Outcome::Deleted)
                .is_ok()
        );
        let e = t
            .prepare(Session { id: 3, seq: 1 }, Outcome::Inserted)
            .unwrap_err();
        assert!(e.to_string().contains("outback.sessions"), "{e}");
    }

    #[test]
    fn recovery_keeps_the_newest_entry_and_frees_torn_ones() {
        let layout = HeapLayout::for_data(4096, 4);
        let s = Session { id: 5, seq: 8 };
        let mut torn = encode_entry(Session { id: 6, seq: 1 }, Outcome::Inserted);
        torn[20] ^= 1;
        let img = image(
            &layout,
            &[
                (0, encode_entry(Session { seq: 7, ..s }, Outcome::Inserted)),
                (2, encode_entry(s, Outcome::Updated)),
                (3, torn),
            ],
        );
        let t = Sessions::recover(layout, |at, n| {
            img.get(at as usize..at as usize + n).map(<[u8]>::to_vec)
        });
        assert_eq!(t.check(s), Check::Replay(Outcome::Updated));
        assert_eq!(t.check(Session { id: 6, seq: 1 }), Check::New);
        assert_eq!(t.len(), 1);
        // Positions 0, 1 and 3 are free again: three new sessions fit.
        for id in 10..13 {
            t.prepare(Session { id, seq: 1 }, Outcome::Inserted)
                .unwrap()
                .unwrap();
        }
        assert!(
            t.prepare(Session { id: 13, seq: 1 }, Outcome::Inserted)
                .is_err()
        );
    }
}
