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
//! Each poll runs inside [`Endpoint::metering`], which adds every charge
//! made during the poll to the future's own accumulator in place, as the
//! endpoint bumps its counters: nothing is copied or differenced per poll,
//! and a poll that charges nothing costs two pointer-sized writes.

use dmkv_transport::counters::Labeled;
use dmkv_transport::{Counters, Endpoint, OpKind, labeled};
use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

/// Everything `ep` has charged so far, over all operation kinds.
pub fn total(ep: &Endpoint) -> Counters {
    ep.total_counters()
}

/// Runs `fut` labelled `kind` ([`dmkv_transport::labeled`]: every charge
/// made while it is polled goes to `kind`) and returns its output with what
/// it cost on `ep`. (Setting the label inside the meter's own poll through
/// `with_kind` was tried: it compiled to an out-of-line `with_kind` of ~50
/// instructions per poll, more than the `Labeled` layer it replaced.)
pub fn metered<'a, F: Future>(ep: &'a Endpoint, kind: OpKind, fut: F) -> Metered<'a, F> {
    Metered {
        ep,
        cost: Counters::default(),
        inner: labeled(kind, fut),
    }
}

pin_project_lite::pin_project! {
    /// See [`metered`].
    pub struct Metered<'a, F> {
        ep: &'a Endpoint,
        cost: Counters,
        #[pin]
        inner: Labeled<F>,
    }
}

impl<F: Future> Future for Metered<'_, F> {
    type Output = (F::Output, Counters);
    #[inline]
    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let this = self.project();
        let (inner, ep, cost) = (this.inner, *this.ep, this.cost);
        match ep.metering(&mut *cost, || inner.poll(cx)) {
            Poll::Ready(out) => Poll::Ready((out, *cost)),
            Poll::Pending => Poll::Pending,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use dmkv_transport::NodeHost;
    use dmkv_transport::exec::block_on;
    use dmkv_transport::local::{LocalCluster, LocalConfig};

    #[test]
    fn total_is_the_sum_over_kinds_and_metering_sees_only_its_future() {
        let cluster = LocalCluster::new(LocalConfig::default());
        let mem = cluster.add_node(0);
        let (region, _) = mem.register_region(64).unwrap();
        let ep = cluster.fabric().endpoint(mem.id()).unwrap();
        block_on(labeled(OpKind::Load, ep.read(region.at(0), 8))).unwrap();
        let (r, cost) = block_on(metered(&ep, OpKind::Get, ep.read(region.at(8), 16)));
        r.unwrap();
        assert_eq!(cost.reads, 1);
        assert_eq!(cost.bytes_read, 16);
        assert_eq!(cost.round_trips, 1);
        assert_eq!(cost.verbs, 1);
        // Charges of other futures polled between this one's polls are not
        // its own; a poll that charges nothing adds nothing.
        let mut other = std::pin::pin!(labeled(OpKind::Scan, ep.read(region.at(0), 8)));
        let mut mine = std::pin::pin!(metered(&ep, OpKind::Get, ep.read(region.at(8), 24)));
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
        // Both metered reads were charged to the kind `metered` was given.
        assert_eq!(ep.counters().get(OpKind::Get).reads, 2);
        assert_eq!(ep.counters().get(OpKind::Get).bytes_read, 16 + 24);
        ep.reset_counters();
        assert_eq!(total(&ep), Counters::default());
    }
}
