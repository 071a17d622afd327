//! Servers that are reserved ahead of virtual time, and the in-order
//! delivery of a pair of nodes' messages when they are.
//!
//! The network model reserves a NIC direction when it knows a message's
//! instant, which is often later than the current virtual time: a reply is
//! reserved when its handler starts, for the instant the handler ends; a
//! response's return trip when the verb acts on memory, for the instant the
//! client's NIC will receive it. A first-come-first-served server (`start =
//! max(at, free_at)`) serves such reservations in the order they were
//! *made*, so a reservation far ahead pushes every later call for an
//! earlier instant behind it although the server is idle meanwhile
//! (docs/simulation.md, "Fig. 7's random pattern (branch i35)" and
//! "Virtual-time order at the NICs (branch i36)").
//!
//! [`Calendar`] keeps a server's busy intervals instead: a reservation for
//! instant `at` starts at the earliest instant `>= at` at which the server
//! is free for its whole service time, in an idle gap before reservations
//! already made for later instants if one is long enough.
//!
//! Invariants (checked by the tests below and `tests/sim_backend.rs`):
//! 1. A calendar's intervals are sorted, disjoint and never touch (touching
//!    ones are merged); a reservation never overlaps an earlier one, and no
//!    reservation starts before its `at`.
//! 2. Reservations are never moved once made (their instants are already in
//!    events); a new one only fills idle time.
//! 3. Intervals that end at or before the current virtual time are dropped:
//!    no later reservation can be for an earlier instant than now, so they
//!    can never matter again. The structure holds only what is reserved
//!    ahead (dropped ones leave the vector in bulk, see [`compact`]; a
//!    calendar with nothing left after `now` is as good as a fresh one,
//!    which lets the atomics units drop idle addresses, see
//!    `Calendar::idle_from`).
//! 4. When every reservation is for the current virtual time (a client core,
//!    an SSD), the calendar gives exactly what `start = max(at, free_at)`
//!    gives: its intervals after `at` are then contiguous.
//! 5. Busy time, reservation count and bytes are summed exactly as the
//!    first-come-first-served server summed them.
//!
//! [`PairOrder`] keeps messages from one node to another arriving in the
//! order they were posted in virtual time (see its invariant).

/// Live entries are `v[head..]`; the dead ones before `head` are dropped
/// in one move once they are at least [`COMPACT_AT`] and half the vector
/// (amortised O(1) per entry), or at once when nothing live is left. A
/// vector with a start index instead of a `VecDeque`: indexing, binary
/// search and a middle insert near the back (the usual place of a late
/// reservation) are plain slice operations, with no wrap-around.
const COMPACT_AT: usize = 16;

/// Drops `v[..head]` when [`COMPACT_AT`] says so; returns the new head.
#[inline]
fn compact<T: Copy>(v: &mut Vec<T>, head: usize) -> usize {
    if head == v.len() {
        v.clear();
        0
    } else if head >= COMPACT_AT && 2 * head >= v.len() {
        v.drain(..head);
        0
    } else {
        head
    }
}

/// A server (a NIC direction, an atomics unit's address) that serves work
/// in virtual-time order, first fit, with its busy time and traffic.
#[derive(Debug, Default, Clone)]
pub(crate) struct Calendar {
    /// Busy intervals `[start, end)`: `busy[head..]` are held, sorted,
    /// disjoint, not touching; the ones before `head` ended at or before
    /// an earlier call's horizon (invariant 3) and are dropped in bulk (see
    /// [`compact`]).
    busy: Vec<(u64, u64)>,
    head: usize,
    pub(crate) busy_ns: u64,
    /// Time work waited for the server: the sum of (start - ready instant)
    /// over everything served (queueing delay, not service).
    pub(crate) wait_ns: u64,
    pub(crate) count: u64,
    pub(crate) bytes: u64,
}

impl Calendar {
    /// Serves a message of `bytes` that is ready at `at` (`>= now`) for
    /// `service` ns; returns when it is done.
    #[inline]
    pub(crate) fn occupy(&mut self, now: u64, at: u64, service: u64, bytes: u64) -> u64 {
        self.count += 1;
        self.bytes += bytes;
        self.stall(now, at, service)
    }

    /// Holds the server `ns` from `at` or the first gap after it that is
    /// long enough (work that is not a message of its own, e.g. a
    /// connection-context fetch); returns when it is done.
    #[inline]
    pub(crate) fn stall(&mut self, now: u64, at: u64, ns: u64) -> u64 {
        self.busy_ns += ns;
        let start = self.place(now, at, ns);
        self.wait_ns += start - at;
        start + ns
    }

    /// Whether nothing is reserved after `now`: every later call (for an
    /// instant `>= now`, made at a virtual time `>= now`) would find this
    /// calendar empty after pruning (invariant 3), so it can be dropped
    /// and made afresh without changing any result (the atomics units do,
    /// see `net::Net::atomic_free`).
    #[inline]
    pub(crate) fn idle_from(&self, now: u64) -> bool {
        self.busy.last().is_none_or(|&(_, e)| e <= now)
    }

    /// Reserves `[start, start + len)` for the earliest `start >= at` that
    /// fits (invariant 1) and returns `start`.
    #[inline]
    fn place(&mut self, now: u64, at: u64, len: u64) -> u64 {
        // Invariant 3: nothing can be placed before min(now, at) again.
        let horizon = now.min(at);
        let mut head = self.head;
        while head < self.busy.len() && self.busy[head].1 <= horizon {
            head += 1;
        }
        if head != self.head {
            self.head = compact(&mut self.busy, head);
        }
        // The common case: after everything reserved so far (O(1)).
        match self.busy.last_mut() {
            None => {
                if len > 0 {
                    self.busy.push((at, at + len));
                }
                at
            }
            Some(last) if at >= last.1 => {
                if len > 0 {
                    if at == last.1 {
                        last.1 = at + len;
                    } else {
                        self.busy.push((at, at + len));
                    }
                }
                at
            }
            // Within the last interval: no gap after `at` before its end,
            // so the reservation follows it (what `place_between` finds
            // for this case, without its search; branch i50).
            Some(last) if at >= last.0 && len > 0 => {
                let t = last.1;
                last.1 = t + len;
                t
            }
            Some(_) => self.place_between(at, len),
        }
    }

    /// [`Calendar::place`] for an `at` before the end of the last interval
    /// held (there is at least one).
    fn place_between(&mut self, at: u64, len: u64) -> u64 {
        let head = self.head;
        let busy = &self.busy[head..];
        // The first interval that ends after `at`, then first fit.
        let mut i = busy.partition_point(|&(_, e)| e <= at);
        let mut t = at;
        while i < busy.len() {
            let (s, e) = busy[i];
            if s >= t.saturating_add(len) {
                break;
            }
            t = t.max(e);
            i += 1;
        }
        if len == 0 {
            return t;
        }
        let end = t + len;
        // `busy[i - 1]` ends at or before `t`; `busy[i]` starts at or after
        // `end`: merge with whichever touches.
        let prev = i > 0 && busy[i - 1].1 == t;
        let next = i < busy.len() && busy[i].0 == end;
        let i = head + i;
        match (prev, next) {
            (true, true) => {
                self.busy[i - 1].1 = self.busy[i].1;
                self.busy.remove(i);
            }
            (true, false) => self.busy[i - 1].1 = end,
            (false, true) => self.busy[i].0 = t,
            (false, false) => self.busy.insert(i, (t, end)),
        }
        t
    }

    /// Intervals held (reserved ahead of the last call's horizon).
    #[cfg(test)]
    fn intervals(&self) -> Vec<(u64, u64)> {
        self.busy[self.head..].to_vec()
    }

    /// Entries kept, dead ones not yet compacted away included.
    #[cfg(test)]
    fn stored(&self) -> usize {
        self.busy.len()
    }
}

/// The arrival instants of the messages from one node to another that were
/// posted later than the current virtual time, so that a message posted
/// (in virtual time) before them, but reserved after them, still arrives
/// before them.
///
/// Invariant: a message from one node to another arrives strictly after
/// every message between them that was posted before it (posted: handed to
/// the sending NIC; messages posted at the same instant in the order the
/// model posted them), so that the seeded order of events at one instant
/// cannot reorder them; and before every message posted after it, except
/// when one of those is already on its way (its arrival is in an event) and
/// leaves no instant free: then the later-posted one is overtaken (counted
/// in `overtaken`) rather than moved. That exception never reorders two
/// messages of one endpoint (one queue pair): an endpoint posts its
/// requests in virtual-time order (its core serves it first come first
/// served at the current instant), and the memory node posts a queue
/// pair's responses in order (the pair's next verb acts only once the
/// previous one's response has left, `net` invariant 1), so of two of its
/// messages the one posted first is always reserved first, and the later
/// one is placed strictly after it. (Before branch i47 a verb after a
/// multi-piece one could answer first, which was ~70% of ROLEX's
/// overtaken messages; see docs/simulation.md, "Reports".)
#[derive(Debug, Default)]
pub(crate) struct PairOrder {
    /// The latest arrival of the messages posted at or before the last
    /// call's horizon (every later message is posted after them).
    floor: u64,
    /// The latest arrival of all messages placed so far.
    latest: u64,
    /// (posted at, arrives) of messages posted after that, in posting
    /// order: `ahead[head..]` (the ones before `head` are folded into
    /// `floor` and dropped in bulk, see [`compact`]).
    ahead: Vec<(u64, u64)>,
    head: usize,
    /// Messages overtaken by one posted before them (see the invariant).
    pub(crate) overtaken: u64,
}

impl PairOrder {
    /// A message posted at `at` (`>= now`) that would arrive at `arrive`
    /// on its own: when it arrives in posting order. Always inlined into
    /// the message path (out of line it cost ~25 instructions of call per
    /// message more; branch i70).
    #[inline(always)]
    pub(crate) fn place(&mut self, now: u64, at: u64, arrive: u64) -> u64 {
        let horizon = now.min(at);
        let mut head = self.head;
        while let Some(&(p, a)) = self.ahead.get(head) {
            if p > horizon {
                break;
            }
            self.floor = self.floor.max(a);
            head += 1;
        }
        if head != self.head {
            self.head = compact(&mut self.ahead, head);
        }
        // The common case: posted at or after every message held (O(1)).
        let (arrive, i) = match self.ahead.last() {
            Some(&(p, _)) if p > at => self.place_between(at, arrive),
            _ => {
                let arrive = arrive.max(self.latest + 1);
                self.latest = arrive;
                (arrive, self.ahead.len())
            }
        };
        if at > horizon {
            if i == self.ahead.len() {
                self.ahead.push((at, arrive));
            } else {
                self.ahead.insert(i, (at, arrive));
            }
        } else {
            self.floor = self.floor.max(arrive);
        }
        arrive
    }

    /// [`PairOrder::place`] for a message posted before the last one held:
    /// after every message posted at or before `at`, before every one
    /// posted after it that is already on its way. Returns its arrival
    /// and its place in `ahead`.
    fn place_between(&mut self, at: u64, arrive: u64) -> (u64, usize) {
        let ahead = &self.ahead[self.head..];
        let i = ahead.partition_point(|&(p, _)| p <= at);
        let before = ahead[..i]
            .iter()
            .map(|&(_, a)| a)
            .fold(self.floor, u64::max);
        let mut arrive = arrive.max(before + 1);
        let after = ahead[i..].iter().map(|&(_, a)| a).min();
        if let Some(after) = after
            && arrive >= after
        {
            if before + 1 < after {
                arrive = after - 1;
            } else {
                self.overtaken += 1;
            }
        }
        self.latest = self.latest.max(arrive);
        (arrive, self.head + i)
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        self.ahead.len() - self.head
    }

    #[cfg(test)]
    fn stored(&self) -> usize {
        self.ahead.len()
    }
}

#[cfg(test)]
mod tests {
    use super::{COMPACT_AT, Calendar, PairOrder};
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    /// The model the calendar must agree with: every reservation kept as
    /// made, and a new one placed at the first `t >= at` where it overlaps
    /// none of them.
    #[derive(Default)]
    struct Brute {
        held: Vec<(u64, u64)>,
    }

    impl Brute {
        fn place(&mut self, at: u64, len: u64) -> u64 {
            let mut t = at;
            loop {
                let clash = self
                    .held
                    .iter()
                    .filter(|&&(s, e)| s < t + len && t < e)
                    .map(|&(_, e)| e)
                    .max();
                match clash {
                    Some(e) => t = e,
                    None => break,
                }
            }
            if len > 0 {
                self.held.push((t, t + len));
            }
            t
        }
    }

    /// The previous storage of both structures (`VecDeque`s, pruned from
    /// the front, as of branch i36), kept as the model their vector-with-a-
    /// start-index storage must agree with exactly over long runs (where
    /// the dead entries are compacted away many times).
    mod deque {
        use std::collections::VecDeque;

        #[derive(Default)]
        pub(super) struct Calendar {
            busy: VecDeque<(u64, u64)>,
        }

        impl Calendar {
            pub(super) fn place(&mut self, now: u64, at: u64, len: u64) -> u64 {
                let horizon = now.min(at);
                while self.busy.front().is_some_and(|&(_, e)| e <= horizon) {
                    self.busy.pop_front();
                }
                match self.busy.back_mut() {
                    None => {
                        if len > 0 {
                            self.busy.push_back((at, at + len));
                        }
                        return at;
                    }
                    Some(last) if at >= last.1 => {
                        if len > 0 {
                            if at == last.1 {
                                last.1 = at + len;
                            } else {
                                self.busy.push_back((at, at + len));
                            }
                        }
                        return at;
                    }
                    Some(_) => {}
                }
                let mut i = self.busy.partition_point(|&(_, e)| e <= at);
                let mut t = at;
                while i < self.busy.len() {
                    let (s, e) = self.busy[i];
                    if s >= t.saturating_add(len) {
                        break;
                    }
                    t = t.max(e);
                    i += 1;
                }
                if len == 0 {
                    return t;
                }
                let end = t + len;
                let prev = i > 0 && self.busy[i - 1].1 == t;
                let next = i < self.busy.len() && self.busy[i].0 == end;
                match (prev, next) {
                    (true, true) => {
                        self.busy[i - 1].1 = self.busy[i].1;
                        self.busy.remove(i);
                    }
                    (true, false) => self.busy[i - 1].1 = end,
                    (false, true) => self.busy[i].0 = t,
                    (false, false) => self.busy.insert(i, (t, end)),
                }
                t
            }

            pub(super) fn intervals(&self) -> Vec<(u64, u64)> {
                self.busy.iter().copied().collect()
            }
        }

        #[derive(Default)]
        pub(super) struct PairOrder {
            floor: u64,
            latest: u64,
            ahead: VecDeque<(u64, u64)>,
            pub(super) overtaken: u64,
        }

        impl PairOrder {
            pub(super) fn place(&mut self, now: u64, at: u64, arrive: u64) -> u64 {
                let horizon = now.min(at);
                while let Some(&(p, a)) = self.ahead.front() {
                    if p > horizon {
                        break;
                    }
                    self.floor = self.floor.max(a);
                    self.ahead.pop_front();
                }
                let (i, before) = match self.ahead.back() {
                    Some(&(p, _)) if p > at => {
                        let i = self.ahead.partition_point(|&(p, _)| p <= at);
                        let before = self
                            .ahead
                            .range(..i)
                            .map(|&(_, a)| a)
                            .fold(self.floor, u64::max);
                        (i, before)
                    }
                    _ => (self.ahead.len(), self.latest),
                };
                let mut arrive = arrive.max(before + 1);
                let after = self.ahead.range(i..).map(|&(_, a)| a).min();
                if let Some(after) = after
                    && arrive >= after
                {
                    if before + 1 < after {
                        arrive = after - 1;
                    } else {
                        self.overtaken += 1;
                    }
                }
                self.latest = self.latest.max(arrive);
                if at > horizon {
                    self.ahead.insert(i, (at, arrive));
                } else {
                    self.floor = self.floor.max(arrive);
                }
                arrive
            }

            pub(super) fn len(&self) -> usize {
                self.ahead.len()
            }
        }
    }

    /// Calls like the network model's (most for now or a little ahead, some
    /// far ahead, time advancing in steps): `(now, at, len)`.
    fn model_calls(seed: u64, n: usize) -> Vec<(u64, u64, u64)> {
        let mut rng = SmallRng::seed_from_u64(seed);
        let mut now = 0u64;
        (0..n)
            .map(|_| {
                if rng.gen_bool(0.4) {
                    now += rng.gen_range(0..60);
                }
                let at = now
                    + match rng.gen_range(0..10) {
                        0..=3 => 0,
                        4..=8 => rng.gen_range(0..600),
                        _ => rng.gen_range(0..5_000),
                    };
                (now, at, rng.gen_range(0..45))
            })
            .collect()
    }

    /// The vector storage gives the deque storage's every start and holds
    /// the same intervals, over runs long enough to compact many times.
    #[test]
    fn agrees_with_the_deque_calendar_over_long_runs() {
        let mut compacted = 0;
        for seed in 0..8 {
            let (mut c, mut d) = (Calendar::default(), deque::Calendar::default());
            let mut stored = 0;
            for (k, (now, at, len)) in model_calls(seed, 60_000).into_iter().enumerate() {
                let got = c.stall(now, at, len) - len;
                assert_eq!(got, d.place(now, at, len), "seed {seed} call {k}");
                if c.stored() < stored {
                    compacted += 1;
                }
                stored = c.stored();
                if k % 97 == 0 {
                    assert_eq!(c.intervals(), d.intervals(), "seed {seed} call {k}");
                }
                assert!(c.stored() <= 2 * c.intervals().len() + COMPACT_AT + 1);
            }
        }
        assert!(compacted > 100, "compacted only {compacted} times");
    }

    /// The same for the pair order: every arrival and every overtaking.
    #[test]
    fn agrees_with_the_deque_pair_order_over_long_runs() {
        let mut overtaken = 0;
        for seed in 0..8 {
            let (mut p, mut d) = (PairOrder::default(), deque::PairOrder::default());
            let mut rng = SmallRng::seed_from_u64(seed ^ 0xabc);
            for (k, (now, at, _)) in model_calls(seed, 60_000).into_iter().enumerate() {
                let want = at + rng.gen_range(10..2_000);
                assert_eq!(
                    p.place(now, at, want),
                    d.place(now, at, want),
                    "seed {seed} message {k}"
                );
                assert_eq!(p.overtaken, d.overtaken, "seed {seed} message {k}");
                assert_eq!(p.len(), d.len(), "seed {seed} message {k}");
                assert!(p.stored() <= 2 * p.len() + COMPACT_AT + 1);
            }
            overtaken += p.overtaken;
        }
        assert!(overtaken > 0, "the runs never overtook");
    }

    /// A calendar with nothing reserved after `now` can be replaced by a
    /// fresh one: every later call gives the same start (what lets the
    /// atomics units drop idle addresses).
    #[test]
    fn an_idle_calendar_is_as_good_as_a_fresh_one() {
        // Sparser than `model_calls`, so that the calendar is often idle.
        let mut rng = SmallRng::seed_from_u64(11);
        let mut now = 0u64;
        let calls: Vec<(u64, u64, u64)> = (0..20_000)
            .map(|_| {
                now += rng.gen_range(0..150);
                let ahead = if rng.gen_bool(0.5) {
                    0
                } else {
                    rng.gen_range(0..400)
                };
                (now, now + ahead, rng.gen_range(0..45))
            })
            .collect();
        let mut dropped = 0;
        let mut c = Calendar::default();
        let mut fresh = Calendar::default();
        for (k, &(now, at, len)) in calls.iter().enumerate() {
            if fresh.idle_from(now) {
                fresh = Calendar::default();
                dropped += 1;
            }
            assert_eq!(c.stall(now, at, len), fresh.stall(now, at, len), "call {k}");
        }
        assert!(dropped > 100, "dropped only {dropped} times");
        let mut c = Calendar::default();
        c.occupy(0, 100, 50, 0);
        assert!(!c.idle_from(149));
        assert!(c.idle_from(150));
    }

    #[test]
    fn a_later_call_for_an_earlier_instant_uses_the_idle_gap() {
        let mut c = Calendar::default();
        // Reserved ahead: a reply at 1000.
        assert_eq!(c.occupy(0, 1000, 100, 8), 1100);
        // Then a message ready at 10: the NIC is idle until 1000.
        assert_eq!(c.occupy(0, 10, 100, 8), 110);
        // And one ready at 950 does not fit before 1000: after the reply.
        assert_eq!(c.occupy(0, 950, 100, 8), 1200);
        assert_eq!(c.intervals(), &[(10, 110), (1000, 1200)]);
        assert_eq!((c.busy_ns, c.count, c.bytes), (300, 3, 24));
        // Only the last one queued: ready at 950, started at 1100.
        assert_eq!(c.wait_ns, 150);
        // Nothing to serve: done at once in a gap, at the end of a busy
        // interval inside one.
        assert_eq!(c.occupy(0, 500, 0, 0), 500);
        assert_eq!(c.occupy(0, 1050, 0, 0), 1200);
        assert_eq!(c.intervals(), &[(10, 110), (1000, 1200)]);
    }

    #[test]
    fn a_reservation_that_does_not_fit_a_gap_goes_to_the_next_one() {
        let mut c = Calendar::default();
        c.occupy(0, 100, 50, 0); // [100, 150)
        c.occupy(0, 180, 50, 0); // [180, 230)
        c.occupy(0, 300, 50, 0); // [300, 350)
        // 40 ns from 90: not before 100 (10 ns), not in [150, 180) (30 ns),
        // in [230, 300).
        assert_eq!(c.occupy(0, 90, 40, 0), 270);
        assert_eq!(c.intervals(), &[(100, 150), (180, 270), (300, 350)]);
        // 30 ns from 140 fits [150, 180) exactly and merges both sides.
        assert_eq!(c.occupy(0, 140, 30, 0), 180);
        assert_eq!(c.intervals(), &[(100, 270), (300, 350)]);
    }

    #[test]
    fn touching_intervals_merge() {
        let mut c = Calendar::default();
        for k in 0..100 {
            c.occupy(0, k * 10, 10, 0);
        }
        assert_eq!(c.intervals(), &[(0, 1000)]);
        // Back to back calls for the same instant queue one after another.
        let mut c = Calendar::default();
        let ends: Vec<u64> = (0..4).map(|_| c.occupy(5, 5, 7, 0)).collect();
        assert_eq!(ends, [12, 19, 26, 33]);
        assert_eq!(c.intervals(), &[(5, 33)]);
    }

    #[test]
    fn pruning_keeps_only_what_is_reserved_ahead() {
        let mut c = Calendar::default();
        let mut now = 0;
        for k in 0..100_000u64 {
            // One reservation 3 us ahead and one now, with gaps between.
            c.occupy(now, now + 3_000, 20, 0);
            c.occupy(now, now, 20, 0);
            now += 100 + k % 7;
            assert!(
                c.intervals().len() <= 64,
                "{} intervals",
                c.intervals().len()
            );
        }
        let mut p = PairOrder::default();
        let mut now = 0;
        for k in 0..100_000u64 {
            p.place(now, now + 2_000 + k % 13, now + 3_000);
            p.place(now, now, now + 500);
            now += 100;
            assert!(p.len() <= 32, "{} messages", p.len());
        }
    }

    /// With every call for the current instant the calendar is the
    /// first-come-first-served server (invariant 4).
    #[test]
    fn calls_at_now_are_first_come_first_served() {
        let mut rng = SmallRng::seed_from_u64(3);
        let mut c = Calendar::default();
        let (mut now, mut free_at) = (0u64, 0u64);
        for _ in 0..50_000 {
            now += rng.gen_range(0..40);
            let service = rng.gen_range(0..60);
            let fcfs = now.max(free_at) + service;
            free_at = fcfs;
            assert_eq!(c.occupy(now, now, service, 0), fcfs);
        }
    }

    /// Random reservations (seeded) against the brute-force model: the same
    /// start for every one, and the calendar's intervals are the model's,
    /// merged.
    #[test]
    fn agrees_with_a_brute_force_calendar() {
        for seed in 0..40 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let (mut c, mut b) = (Calendar::default(), Brute::default());
            let mut now = 0u64;
            for step in 0..400 {
                if rng.gen_bool(0.3) {
                    now += rng.gen_range(0..50);
                }
                let at = now
                    + if rng.gen_bool(0.5) {
                        0
                    } else {
                        rng.gen_range(0..400)
                    };
                let len = rng.gen_range(1..40);
                let got = c.occupy(now, at, len, 0) - len;
                let want = b.place(at, len);
                assert_eq!(got, want, "seed {seed} step {step}: at {at} len {len}");
                assert!(got >= at);
                // Merged model intervals that end after now = the calendar's.
                let mut held = b.held.clone();
                held.sort();
                let mut merged: Vec<(u64, u64)> = Vec::new();
                for (s, e) in held {
                    match merged.last_mut() {
                        Some(last) if last.1 >= s => last.1 = last.1.max(e),
                        _ => merged.push((s, e)),
                    }
                }
                // Both from the horizon on (the calendar dropped what ended
                // before it, and keeps what it pruned no part of).
                let h = now.min(at);
                let clip = |v: &[(u64, u64)]| -> Vec<(u64, u64)> {
                    v.iter()
                        .filter(|&&(_, e)| e > h)
                        .map(|&(s, e)| (s.max(h), e))
                        .collect()
                };
                assert_eq!(
                    clip(&c.intervals()),
                    clip(&merged),
                    "seed {seed} step {step}"
                );
                assert!(
                    c.intervals().iter().all(|&(_, e)| e > h),
                    "seed {seed}: not pruned"
                );
            }
        }
    }

    #[test]
    fn messages_arrive_in_posting_order() {
        let mut p = PairOrder::default();
        // Posted at 1000 (a reply reserved ahead), arriving at 1800.
        assert_eq!(p.place(0, 1000, 1800), 1800);
        // Posted at 100, would arrive at 900: before it, unchanged.
        assert_eq!(p.place(0, 100, 900), 900);
        // Posted at 200 but would arrive at 2000 (e.g. a long message):
        // it cannot overtake the one posted at 1000, which cannot move, so
        // it arrives just before it.
        assert_eq!(p.place(0, 200, 2000), 1799);
        assert_eq!(p.overtaken, 0);
        // Posted at 300, would arrive at 850: after the one posted at 200,
        // and no instant is left before the one posted at 1000.
        assert_eq!(p.place(0, 300, 850), 1800);
        assert_eq!(p.overtaken, 1);
        // Posted at 1000 again: after everything posted until then.
        assert_eq!(p.place(0, 1000, 1500), 1801);
        // Posted at 0, before all of them: unchanged.
        assert_eq!(p.place(0, 0, 10), 10);
        // Posted at 1000 once it is 1000: after all of them.
        assert_eq!(p.place(1000, 1000, 1000), 1802);
        assert_eq!(p.len(), 0, "nothing is posted ahead any more");
    }

    /// Random placements (seeded): every message arrives strictly after
    /// every one posted before it, never earlier than asked unless a
    /// later-posted one forces it, and before every one posted after it
    /// unless counted as overtaken.
    #[test]
    fn posting_order_holds_under_random_placements() {
        let mut overtaken_seen = 0;
        for seed in 0..40 {
            let mut rng = SmallRng::seed_from_u64(seed);
            let mut p = PairOrder::default();
            let mut all: Vec<(u64, u64)> = Vec::new();
            let mut now = 0u64;
            for _ in 0..500usize {
                now += rng.gen_range(0..30);
                let at = now
                    + if rng.gen_bool(0.6) {
                        0
                    } else {
                        rng.gen_range(0..300)
                    };
                let want = at + rng.gen_range(10..200);
                let before = p.overtaken;
                let got = p.place(now, at, want);
                for &(a, t) in &all {
                    if a <= at {
                        assert!(got > t, "seed {seed}: {got} not after {t}");
                    } else if got >= t {
                        assert_eq!(p.overtaken, before + 1, "seed {seed}: overtook {t}");
                    }
                }
                if !all.iter().any(|&(a, _)| a > at) {
                    assert!(got >= want, "seed {seed}: nothing forced it earlier");
                }
                all.push((at, got));
            }
            overtaken_seen += p.overtaken;
        }
        assert!(overtaken_seen > 0, "the random placements never overtook");
    }
}
