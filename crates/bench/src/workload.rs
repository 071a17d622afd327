//! Workloads (XStore's Table 1 / YCSB core workloads, insert, load and
//! mixes), request distributions and the operations a task issues.

use std::fmt;
use std::str::FromStr;

/// What a workload operation does. `Rmw` (YCSB F's read-modify-write) is a
/// get followed by an update of the same key: one operation in the report,
/// charged to the `get` and `update` kinds in transport counters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum OpType {
    Read,
    Update,
    Insert,
    Delete,
    Scan,
    Rmw,
}

impl OpType {
    pub const COUNT: usize = 6;
    pub const ALL: [OpType; OpType::COUNT] = [
        OpType::Read,
        OpType::Update,
        OpType::Insert,
        OpType::Delete,
        OpType::Scan,
        OpType::Rmw,
    ];

    /// The name in reports (`by_op`).
    pub fn name(self) -> &'static str {
        match self {
            OpType::Read => "get",
            OpType::Update => "update",
            OpType::Insert => "insert",
            OpType::Delete => "delete",
            OpType::Scan => "scan",
            OpType::Rmw => "rmw",
        }
    }

    pub fn index(self) -> usize {
        self as usize
    }
}

/// One operation of a request stream, on keys named by their index in the
/// run's key universe (see [`crate::plan::Plan`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Op {
    Read(u32),
    Update(u32),
    Insert(u32),
    Delete(u32),
    /// Start key and the number of pairs asked for.
    Scan(u32, u32),
    Rmw(u32),
}

impl Op {
    /// The universe index of the key the operation names (a scan's start).
    pub fn index(&self) -> u32 {
        match *self {
            Op::Read(i)
            | Op::Update(i)
            | Op::Insert(i)
            | Op::Delete(i)
            | Op::Scan(i, _)
            | Op::Rmw(i) => i,
        }
    }

    pub fn op_type(&self) -> OpType {
        match self {
            Op::Read(_) => OpType::Read,
            Op::Update(_) => OpType::Update,
            Op::Insert(_) => OpType::Insert,
            Op::Delete(_) => OpType::Delete,
            Op::Scan(..) => OpType::Scan,
            Op::Rmw(_) => OpType::Rmw,
        }
    }
}

/// Percentages of each operation type; they sum to 100.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Mix {
    pub read: u32,
    pub update: u32,
    pub insert: u32,
    pub delete: u32,
    pub scan: u32,
    pub rmw: u32,
}

impl Mix {
    fn parts(&self) -> [(OpType, u32); OpType::COUNT] {
        [
            (OpType::Read, self.read),
            (OpType::Update, self.update),
            (OpType::Insert, self.insert),
            (OpType::Delete, self.delete),
            (OpType::Scan, self.scan),
            (OpType::Rmw, self.rmw),
        ]
    }

    /// The operation type for a draw `d` uniform in [0, 100).
    pub fn pick(&self, d: u32) -> OpType {
        debug_assert!(d < 100);
        let mut acc = 0;
        for (t, p) in self.parts() {
            acc += p;
            if d < acc {
                return t;
            }
        }
        unreachable!("percentages sum to 100")
    }

    /// Whether operations name existing keys (and so need loaded keys).
    pub fn reads_existing_keys(&self) -> bool {
        self.read + self.update + self.delete + self.scan + self.rmw > 0
    }
}

/// `--workload`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Workload {
    /// 50% read, 50% update.
    YcsbA,
    /// 95% read, 5% update (YCSB's definition; XStore's Table 1 prints 90:10).
    YcsbB,
    /// 100% read.
    YcsbC,
    /// 95% read, 5% insert; its natural distribution is `latest`.
    YcsbD,
    /// 95% scan (length uniform in [1, 100]), 5% insert.
    YcsbE,
    /// 50% read, 50% read-modify-write.
    YcsbF,
    /// `--ops` inserts of new keys into the loaded set.
    Insert,
    /// Loads the key set and runs nothing.
    Load,
    /// `mixed:R,U,I,D,S`.
    Mixed(Mix),
}

impl Workload {
    pub fn mix(&self) -> Mix {
        let m = Mix::default();
        match self {
            Workload::YcsbA => Mix {
                read: 50,
                update: 50,
                ..m
            },
            Workload::YcsbB => Mix {
                read: 95,
                update: 5,
                ..m
            },
            Workload::YcsbC => Mix { read: 100, ..m },
            Workload::YcsbD => Mix {
                read: 95,
                insert: 5,
                ..m
            },
            Workload::YcsbE => Mix {
                scan: 95,
                insert: 5,
                ..m
            },
            Workload::YcsbF => Mix {
                read: 50,
                rmw: 50,
                ..m
            },
            Workload::Insert => Mix { insert: 100, ..m },
            // Never drawn from: a load workload runs no operations.
            Workload::Load => Mix { read: 100, ..m },
            Workload::Mixed(mix) => *mix,
        }
    }

    /// The distribution used when `--dist` is not given.
    pub fn natural_dist(&self) -> Dist {
        match self {
            Workload::YcsbD => Dist::Latest,
            _ => Dist::Uniform,
        }
    }

    /// Whether the workload runs operations after the load.
    pub fn has_run_phase(&self) -> bool {
        !matches!(self, Workload::Load)
    }
}

impl FromStr for Workload {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        Ok(match s {
            "ycsb-a" => Workload::YcsbA,
            "ycsb-b" => Workload::YcsbB,
            "ycsb-c" => Workload::YcsbC,
            "ycsb-d" => Workload::YcsbD,
            "ycsb-e" => Workload::YcsbE,
            "ycsb-f" => Workload::YcsbF,
            "insert" => Workload::Insert,
            "load" => Workload::Load,
            _ => match s.strip_prefix("mixed:") {
                Some(spec) => Workload::Mixed(parse_mix(spec)?),
                None => {
                    return Err(format!(
                        "unknown workload {s:?}; expected ycsb-a ... ycsb-f, insert, load or mixed:R,U,I,D,S"
                    ));
                }
            },
        })
    }
}

/// Parses `R,U,I,D,S[,M]`: whole percentages of read, update, insert,
/// delete, scan and (optionally) read-modify-write that sum to 100. The
/// sixth field lets `dmkv dst`'s replay commands, whose mixes include
/// read-modify-writes, run through `dmkv bench`.
pub fn parse_mix(spec: &str) -> Result<Mix, String> {
    let parts: Vec<&str> = spec.split(',').map(str::trim).collect();
    if !(5..=6).contains(&parts.len()) {
        return Err(format!(
            "mixed:{spec} has {} fields; expected five percentages mixed:R,U,I,D,S (read, update, insert, delete, scan), optionally a sixth for read-modify-write",
            parts.len()
        ));
    }
    let mut p = [0u32; 6];
    for (i, (field, name)) in parts
        .iter()
        .zip([
            "read",
            "update",
            "insert",
            "delete",
            "scan",
            "read-modify-write",
        ])
        .enumerate()
    {
        p[i] = field.parse::<u32>().map_err(|_| {
            format!("mixed:{spec}: the {name} percentage {field:?} is not a whole number")
        })?;
    }
    let sum: u32 = p.iter().sum();
    if sum != 100 {
        return Err(format!("mixed:{spec}: percentages sum to {sum}, not 100"));
    }
    Ok(Mix {
        read: p[0],
        update: p[1],
        insert: p[2],
        delete: p[3],
        scan: p[4],
        rmw: p[5],
    })
}

impl fmt::Display for Workload {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Workload::YcsbA => write!(f, "ycsb-a"),
            Workload::YcsbB => write!(f, "ycsb-b"),
            Workload::YcsbC => write!(f, "ycsb-c"),
            Workload::YcsbD => write!(f, "ycsb-d"),
            Workload::YcsbE => write!(f, "ycsb-e"),
            Workload::YcsbF => write!(f, "ycsb-f"),
            Workload::Insert => write!(f, "insert"),
            Workload::Load => write!(f, "load"),
            Workload::Mixed(m) if m.rmw > 0 => write!(
                f,
                "mixed:{},{},{},{},{},{}",
                m.read, m.update, m.insert, m.delete, m.scan, m.rmw
            ),
            Workload::Mixed(m) => write!(
                f,
                "mixed:{},{},{},{},{}",
                m.read, m.update, m.insert, m.delete, m.scan
            ),
        }
    }
}

/// `--dist`: which keys operations pick.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dist {
    Uniform,
    /// YCSB's scrambled zipfian, θ = 0.99.
    Zipfian,
    /// YCSB's skewed-latest: zipfian over recency.
    Latest,
}

impl FromStr for Dist {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "uniform" => Ok(Dist::Uniform),
            "zipfian" => Ok(Dist::Zipfian),
            "latest" => Ok(Dist::Latest),
            _ => Err(format!(
                "unknown distribution {s:?}; expected uniform, zipfian or latest"
            )),
        }
    }
}

impl fmt::Display for Dist {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Dist::Uniform => "uniform",
            Dist::Zipfian => "zipfian",
            Dist::Latest => "latest",
        })
    }
}

/// YCSB E's scan lengths: uniform in [1, MAX_SCAN_LEN].
pub const MAX_SCAN_LEN: u64 = 100;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_round_trip() {
        for s in [
            "ycsb-a",
            "ycsb-b",
            "ycsb-c",
            "ycsb-d",
            "ycsb-e",
            "ycsb-f",
            "insert",
            "load",
            "mixed:10,20,30,20,20",
        ] {
            assert_eq!(s.parse::<Workload>().unwrap().to_string(), s);
        }
        for s in ["uniform", "zipfian", "latest"] {
            assert_eq!(s.parse::<Dist>().unwrap().to_string(), s);
        }
    }

    #[test]
    fn table_one_mixes() {
        for w in [
            Workload::YcsbA,
            Workload::YcsbB,
            Workload::YcsbC,
            Workload::YcsbD,
            Workload::YcsbE,
            Workload::YcsbF,
            Workload::Insert,
        ] {
            let m = w.mix();
            let sum = m.read + m.update + m.insert + m.delete + m.scan + m.rmw;
            assert_eq!(sum, 100, "{w}");
        }
        assert_eq!(Workload::YcsbB.mix().update, 5);
        assert_eq!(Workload::YcsbD.natural_dist(), Dist::Latest);
        assert_eq!(Workload::YcsbC.natural_dist(), Dist::Uniform);
        let m = Workload::YcsbF.mix();
        assert_eq!(m.pick(49), OpType::Read);
        assert_eq!(m.pick(50), OpType::Rmw);
        assert_eq!(m.pick(99), OpType::Rmw);
    }
}
