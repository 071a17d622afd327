//! Seeded network faults of a simulation (deterministic simulation testing,
//! `dmkv dst --faults delay`, `dmkv bench --delay-faults`).
//!
//! A chosen message (one-sided verb, its response, an RPC request or reply)
//! arrives later than the model says, by a large seeded extra delay. Messages
//! between two different pairs of nodes can then arrive in either order
//! (across connections, as on a real fabric); within one ordered pair they
//! never overtake each other (invariant 1 of `net`: a reliable-connection
//! queue pair delivers in order, so a delayed message holds back the ones
//! sent after it on the same pair).
//!
//! With no delays configured, no random number is drawn: runs without faults
//! replay exactly as before the faults existed.

use super::Sim;

/// Which messages are delayed, and by how much.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MessageDelays {
    /// Chance per message, in parts per million (0: none).
    pub per_million: u32,
    /// A chosen message's extra delay is uniform in `[max_ns / 2, max_ns]`.
    pub max_ns: u64,
}

impl MessageDelays {
    pub fn enabled(&self) -> bool {
        self.per_million > 0 && self.max_ns > 0
    }
}

impl std::fmt::Display for MessageDelays {
    /// `PER_MILLION@MAX_NS`, as `--delay-faults` takes it.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}@{}", self.per_million, self.max_ns)
    }
}

impl std::str::FromStr for MessageDelays {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let bad = || {
            format!(
                "expected PER_MILLION@MAX_NS (e.g. 20000@20000: 2% of messages up to 20 us late), got {s:?}"
            )
        };
        let (p, m) = s.split_once('@').ok_or_else(bad)?;
        let per_million: u32 = p.trim().parse().map_err(|_| bad())?;
        let max_ns: u64 = m.trim().parse().map_err(|_| bad())?;
        if per_million > 1_000_000 {
            return Err(format!(
                "{s:?}: the chance is in parts per million, at most 1000000"
            ));
        }
        Ok(MessageDelays {
            per_million,
            max_ns,
        })
    }
}

/// The extra delay of the message being sent now (0 for most messages).
/// Called once per message by `net::send_message`.
#[inline]
pub(crate) fn extra_delay(sim: &Sim) -> u64 {
    // The usual case first: no faults configured, nothing drawn.
    if !sim.delays.enabled() {
        return 0;
    }
    let d = sim.delays;
    if sim.sched.random(1_000_000) >= u64::from(d.per_million) {
        return 0;
    }
    sim.delayed.set(sim.delayed.get() + 1);
    d.max_ns / 2 + sim.sched.random(d.max_ns - d.max_ns / 2 + 1)
}

#[cfg(test)]
mod tests {
    use super::MessageDelays;

    #[test]
    fn delays_parse_and_print_alike() {
        let d: MessageDelays = "20000@15000".parse().unwrap();
        assert_eq!(
            d,
            MessageDelays {
                per_million: 20000,
                max_ns: 15000
            }
        );
        assert_eq!(d.to_string().parse::<MessageDelays>().unwrap(), d);
        assert!("5".parse::<MessageDelays>().is_err());
        assert!("2000000@1".parse::<MessageDelays>().is_err());
        assert!(!"0@100".parse::<MessageDelays>().unwrap().enabled());
    }
}
