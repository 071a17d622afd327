//! Exact per-operation costs.
//!
//! An endpoint charges a verb or RPC to its counters only while the issuing
//! task is being polled, and a compute thread polls one task at a time. So
//! the difference of the endpoint's counters across each poll of an
//! operation's future is exactly what that operation cost, whatever the
//! other tasks of the thread do in between. This is how the harness
//! attributes costs to report operation types that the transport's
//! [`OpKind`](dmkv_transport::OpKind) labels do not separate (YCSB F's
//! read-modify-write is charged to `get` and `update` there).
//!
//! Most polls charge nothing (a task resumed after its round trip's yield
//! only takes the result), so a poll first compares the endpoint's charge
//! count ([`Endpoint::charges`], which changes with every charge) and
//! computes the counters' difference only when it changed; the result is
//! the same difference either way.

#[cfg(test)]
use dmkv_transport::OpKind;
use dmkv_transport::{Counters, Endpoint};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Everything `ep` has charged so far, over all operation kinds.
pub fn total(ep: &Endpoint) -> Counters {
    ep.total_counters()
}

/// `a - b`, field by field; `b` must be an earlier reading of the same
/// monotone counters.
pub fn difference(a: &Counters, b: &Counters) -> Counters {
    Counters {
        round_trips: a.round_trips - b.round_trips,
        verbs: a.verbs - b.verbs,
        reads: a.reads - b.reads,
        writes: a.writes - b.writes,
        cas: a.cas - b.cas,
        faa: a.faa - b.faa,
        rpcs: a.rpcs - b.rpcs,
        bytes_read: a.bytes_read - b.bytes_read,
        bytes_written: a.bytes_written - b.bytes_written,
        memnode_cpu_ns: a.memnode_cpu_ns - b.memnode_cpu_ns,
    }
}

/// Runs `fut` and returns its output with what it cost on `ep`.
pub fn metered<'a, F: Future>(ep: &'a Endpoint, fut: F) -> Metered<'a, F> {
    Metered {
        ep,
        cost: Counters::default(),
        inner: fut,
    }
}

pin_project_lite::pin_project! {
    /// See [`metered`].
    pub struct Metered<'a, F> {
        ep: &'a Endpoint,
        cost: Counters,
        #[pin]
        inner: F,
    }
}

impl<F: Future> Future for Metered<'_, F> {
    type Output = (F::Output, Counters);
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let ep = *this.ep;
        let charges = ep.charges();
        let before = total(ep);
        let polled = this.inner.poll(cx);
        if ep.charges() != charges {
            *this.cost += difference(&total(ep), &before);
        }
        match polled {
            Poll::Ready(out) => Poll::Ready((out, *this.cost)),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::exec::block_on;
    use dmkv_transport::local::{LocalCluster, LocalConfig};
    use dmkv_transport::{NodeHost, labeled};

    #[test]
    fn total_is_the_sum_over_kinds_and_metering_sees_only_its_future() {
        let cluster = LocalCluster::new(LocalConfig::default());
        let mem = cluster.add_node(0);
        let (region, _) = mem.register_region(64).unwrap();
        let ep = cluster.fabric().endpoint(mem.id()).unwrap();
        block_on(labeled(OpKind::Load, ep.read(region.at(0), 8))).unwrap();
        let (r, cost) = block_on(metered(
            &ep,
            labeled(OpKind::Get, ep.read(region.at(8), 16)),
        ));
        r.unwrap();
        assert_eq!(cost.reads, 1);
        assert_eq!(cost.bytes_read, 16);
        assert_eq!(cost.round_trips, 1);
        assert_eq!(cost.verbs, 1);
        // Charges of other futures polled between this one's polls are not
        // its own; a poll that charges nothing adds nothing.
        let mut other = std::pin::pin!(labeled(OpKind::Scan, ep.read(region.at(0), 8)));
        let mut mine = std::pin::pin!(metered(
            &ep,
            labeled(OpKind::Get, ep.read(region.at(8), 24))
        ));
        let mut cx = std::task::Context::from_waker(std::task::Waker::noop());
        assert!(
            mine.as_mut().poll(&mut cx).is_pending(),
            "yields once per round trip"
        );
        assert!(other.as_mut().poll(&mut cx).is_pending());
        let std::task::Poll::Ready((r, cost)) = mine.as_mut().poll(&mut cx) else {
            panic!("done after its yield")
        };
        r.unwrap();
        assert_eq!((cost.round_trips, cost.reads, cost.bytes_read), (1, 1, 24));
        assert_eq!(total(&ep), ep.counters().sum(&OpKind::ALL));
        // Two reads before, `other`'s and `mine`'s (`other` posted its read
        // on its one poll).
        assert_eq!(total(&ep).reads, 4);
        assert_eq!(ep.counters().get(OpKind::Scan).reads, 1);
        ep.reset_counters();
        assert_eq!(total(&ep), Counters::default());
    }
}
