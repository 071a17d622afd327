//! Scheduling evidence for a run on real threads: what each thread of this
//! process got from the OS during the run phase (CPU time, time spent
//! runnable but waiting for a core, context switches), and how much CPU the
//! rest of the host used meanwhile. It explains a slow run: threads that
//! waited long on the run queue while other processes kept the cores busy
//! lost their core to the host; threads that blocked (voluntary switches)
//! or handed their core away (`sched_yield`, counted as involuntary) lost
//! it to our own scheduling.
//!
//! Everything here is wall-clock evidence read from `/proc` (Linux): it
//! differs from run to run and is left out of every determinism comparison.
//! A simulated run reports none (its threads are virtual). Where `/proc`
//! lacks a file (another OS, a kernel without schedstats) the figures are
//! missing, never invented.
//!
//! Beside it, `schedstat` measures the compute threads from the inside
//! (each reads its own counters before its first and after its last
//! operation) to give CPU time per operation; this module looks at every
//! thread from the outside to say who lost the core to whom. Both parse
//! the kernel's `schedstat` line with `schedstat::Sched::parse`.

use dmkv_transport::servestats;
use serde::Serialize;
use std::collections::BTreeMap;

/// One thread's cumulative figures at one instant.
#[derive(Debug, Clone, Default, PartialEq)]
struct ThreadSample {
    name: String,
    /// `/proc/.../schedstat`: time on a CPU, time waiting on a run queue
    /// (both ns), and the number of times it was given a CPU.
    cpu_ns: u64,
    runq_wait_ns: u64,
    /// `/proc/.../status`: `voluntary_ctxt_switches` (the thread blocked)
    /// and `nonvoluntary_ctxt_switches` (switched away while runnable:
    /// preempted, or a `sched_yield` that ran another thread); the same
    /// counters `getrusage(RUSAGE_THREAD)` returns as `ru_nvcsw`/`ru_nivcsw`,
    /// read here for every thread from the outside.
    voluntary: u64,
    involuntary: u64,
}

/// The process's threads and the host's CPU counters at one instant.
#[derive(Debug, Clone, Default)]
pub struct Snapshot {
    /// By thread id.
    threads: BTreeMap<u64, ThreadSample>,
    /// `/proc/stat`'s first line: busy and steal time of all CPUs, in
    /// clock ticks.
    host_busy_ticks: Option<u64>,
    host_steal_ticks: Option<u64>,
    /// This process's user + system time (`/proc/self/stat`), clock ticks.
    process_ticks: Option<u64>,
    /// What the transport's handler and compute threads counted
    /// (`dmkv_transport::servestats`), by thread id.
    serving: BTreeMap<u64, Vec<u64>>,
}

/// Takes a snapshot (a few dozen small `/proc` reads: call it outside the
/// measured stretch, or accept a few hundred microseconds of one thread).
pub fn snapshot() -> Snapshot {
    let mut threads = BTreeMap::new();
    if let Ok(dir) = std::fs::read_dir("/proc/self/task") {
        for entry in dir.flatten() {
            let Some(tid) = entry.file_name().to_str().and_then(|s| s.parse().ok()) else {
                continue;
            };
            if let Some(s) = read_thread(&entry.path()) {
                threads.insert(tid, s);
            }
        }
    }
    let (host_busy_ticks, host_steal_ticks) = read_host().unzip();
    Snapshot {
        threads,
        host_busy_ticks,
        host_steal_ticks,
        process_ticks: read_process_ticks(),
        serving: servestats::snapshot()
            .into_iter()
            .map(|(tid, _, v)| (tid, v.to_vec()))
            .collect(),
    }
}

fn read_thread(dir: &std::path::Path) -> Option<ThreadSample> {
    let name = std::fs::read_to_string(dir.join("comm")).ok()?;
    let stat = std::fs::read_to_string(dir.join("schedstat")).ok()?;
    let s = crate::schedstat::Sched::parse(&stat)?;
    let (cpu_ns, runq_wait_ns) = (s.on_cpu_ns, s.runqueue_wait_ns);
    let status = std::fs::read_to_string(dir.join("status")).ok()?;
    let field = |key: &str| {
        status
            .lines()
            .find_map(|l| l.strip_prefix(key))
            .and_then(|v| v.trim().parse::<u64>().ok())
    };
    Some(ThreadSample {
        name: name.trim().to_string(),
        cpu_ns,
        runq_wait_ns,
        voluntary: field("voluntary_ctxt_switches:")?,
        involuntary: field("nonvoluntary_ctxt_switches:")?,
    })
}

/// (busy, steal) ticks of all CPUs together.
fn read_host() -> Option<(u64, u64)> {
    let text = std::fs::read_to_string("/proc/stat").ok()?;
    parse_host(text.lines().next()?)
}

/// `cpu  user nice system idle iowait irq softirq steal ...`: busy is
/// everything but idle and iowait (steal included: the hypervisor ran
/// something else on our virtual CPU).
fn parse_host(line: &str) -> Option<(u64, u64)> {
    let mut f = line.split_whitespace();
    if f.next()? != "cpu" {
        return None;
    }
    let v: Vec<u64> = f.map(|x| x.parse().ok()).collect::<Option<_>>()?;
    if v.len() < 8 {
        return None;
    }
    // guest and guest_nice (fields 9, 10) are already inside user and nice.
    let total: u64 = v.iter().take(8).sum();
    Some((total - v[3] - v[4], v[7]))
}

fn read_process_ticks() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/self/stat").ok()?;
    parse_process_ticks(&text)
}

/// utime + stime, fields 14 and 15 of `/proc/self/stat` (counted after the
/// command, which is in parentheses and may contain spaces).
fn parse_process_ticks(text: &str) -> Option<u64> {
    let rest = &text[text.rfind(')')? + 1..];
    let mut f = rest.split_whitespace().skip(11);
    let utime: u64 = f.next()?.parse().ok()?;
    let stime: u64 = f.next()?.parse().ok()?;
    Some(utime + stime)
}

/// What the OS gave each thread of the process during the run phase, and
/// what the rest of the host took. Wall-clock evidence, not a result: two
/// runs of one seed differ here.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SchedReport {
    /// The threads alive at both ends of the run phase that ran or switched
    /// during it, by name (then thread id).
    pub threads: Vec<ThreadSched>,
    /// CPU time the rest of the host used during the run, in cores (busy
    /// time of all CPUs less this process's, over the run's seconds);
    /// `/proc/stat` counts in clock ticks (10 ms), so short runs are coarse.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub other_processes_cores: Option<f64>,
    /// Of the host's busy time, what the hypervisor stole, in cores.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub steal_cores: Option<f64>,
    /// The CPUs handler and compute threads were pinned to
    /// (`--pin-threads`); absent when the OS placed them.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pinned: Option<Pinned>,
}

/// A `--pin-threads` placement.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Pinned {
    pub handler_cpus: Vec<usize>,
    pub compute_cpus: Vec<usize>,
}

/// What a handler or compute thread counted during the run
/// (`dmkv_transport::servestats`): counters by name, and the ratios that
/// tell a run's serving mode.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Serving {
    pub counters: BTreeMap<String, u64>,
    /// Handler: requests per busy stretch (the batch served between two
    /// empty polls of its queue).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub requests_per_stretch: Option<f64>,
    /// Handler: empty polls of its queue per request served.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub empty_polls_per_request: Option<f64>,
    /// Handler: thread CPU time over elapsed time in its sampled busy
    /// stretches (what scales its RPC charges).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub busy_on_cpu_fraction: Option<f64>,
    /// Of the thread's CPU samples, the fraction on the CPU where the other
    /// role's thread (handler / compute) was last sampled.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shared_cpu_fraction: Option<f64>,
}

impl Serving {
    fn new(before: Option<&Vec<u64>>, after: &[u64]) -> Serving {
        let counters: BTreeMap<String, u64> = servestats::COUNTER_NAMES
            .iter()
            .enumerate()
            .map(|(i, (_, name))| {
                let b = before.and_then(|b| b.get(i)).copied().unwrap_or(0);
                (name.to_string(), after[i].saturating_sub(b))
            })
            .collect();
        let get = |k: &str| counters.get(k).copied().unwrap_or(0);
        let ratio = |a: u64, b: u64| (b > 0).then(|| a as f64 / b as f64);
        Serving {
            requests_per_stretch: ratio(get("requests"), get("stretches")),
            empty_polls_per_request: ratio(get("empty_polls"), get("requests")),
            busy_on_cpu_fraction: ratio(get("busy_sampled_cpu_ns"), get("busy_sampled_wall_ns")),
            shared_cpu_fraction: ratio(get("shared_cpu_samples"), get("cpu_samples")),
            counters,
        }
    }
}

/// One thread's share of the run phase.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ThreadSched {
    pub name: String,
    /// Time on a CPU, in milliseconds.
    pub cpu_ms: f64,
    /// Time runnable but waiting for a CPU (run-queue wait), in ms: high
    /// means something else had the core.
    pub runq_wait_ms: f64,
    /// Switches away while still runnable: preemptions, and `sched_yield`
    /// calls that handed the core to another thread (Linux counts a yield
    /// that switches as involuntary; one that finds nothing else to run is
    /// no switch at all).
    pub involuntary_switches: u64,
    /// Switches away because the thread blocked (parked, waited on a lock,
    /// a condition or a futex).
    pub voluntary_switches: u64,
    /// For RPC handler and compute threads: what they counted themselves.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub serving: Option<Serving>,
}

impl SchedReport {
    /// The difference between two snapshots `seconds` apart.
    pub fn between(before: &Snapshot, after: &Snapshot, seconds: f64) -> SchedReport {
        let mut threads: Vec<(String, u64, ThreadSched)> = after
            .threads
            .iter()
            .filter_map(|(tid, a)| {
                let b = before.threads.get(tid)?;
                (b.name == a.name).then_some(())?;
                let t = ThreadSched {
                    name: a.name.clone(),
                    cpu_ms: a.cpu_ns.saturating_sub(b.cpu_ns) as f64 / 1e6,
                    runq_wait_ms: a.runq_wait_ns.saturating_sub(b.runq_wait_ns) as f64 / 1e6,
                    involuntary_switches: a.involuntary.saturating_sub(b.involuntary),
                    voluntary_switches: a.voluntary.saturating_sub(b.voluntary),
                    serving: after
                        .serving
                        .get(tid)
                        .map(|v| Serving::new(before.serving.get(tid), v)),
                };
                let idle = t.cpu_ms == 0.0 && t.involuntary_switches + t.voluntary_switches == 0;
                (!idle).then(|| (a.name.clone(), *tid, t))
            })
            .collect();
        threads.sort_by(|x, y| (&x.0, x.1).cmp(&(&y.0, y.1)));
        let tick_s = clock_tick_seconds();
        let per_s = |ticks: u64| ticks as f64 * tick_s / seconds.max(1e-9);
        let other = match (
            before.host_busy_ticks,
            after.host_busy_ticks,
            before.process_ticks,
            after.process_ticks,
        ) {
            (Some(hb), Some(ha), Some(pb), Some(pa)) => Some(per_s(
                ha.saturating_sub(hb).saturating_sub(pa.saturating_sub(pb)),
            )),
            _ => None,
        };
        let steal = match (before.host_steal_ticks, after.host_steal_ticks) {
            (Some(b), Some(a)) => Some(per_s(a.saturating_sub(b))),
            _ => None,
        };
        SchedReport {
            threads: threads.into_iter().map(|t| t.2).collect(),
            other_processes_cores: other,
            steal_cores: steal,
            pinned: dmkv_transport::placement::plan().map(|p| Pinned {
                handler_cpus: p.handlers,
                compute_cpus: p.compute,
            }),
        }
    }
}

/// `/proc/stat` and `/proc/self/stat` count in USER_HZ ticks, which the
/// kernel fixes at 100 per second on every architecture we run on
/// (`sysconf(_SC_CLK_TCK)`; not called here, the crate has no `unsafe`).
fn clock_tick_seconds() -> f64 {
    0.01
}

/// Prints the report under the table: one line for the host, one per
/// thread.
pub fn print(out: &mut dyn std::io::Write, engine: &str, r: &SchedReport) -> std::io::Result<()> {
    let cores = |c: Option<f64>| c.map_or("?".to_string(), |c| format!("{c:.2}"));
    writeln!(out)?;
    writeln!(
        out,
        "{engine}: scheduling during the run (wall clock): other processes {} cores, steal {} cores",
        cores(r.other_processes_cores),
        cores(r.steal_cores)
    )?;
    if let Some(p) = &r.pinned {
        writeln!(
            out,
            "  pinned: handler threads on CPUs {:?}, compute threads on CPUs {:?}",
            p.handler_cpus, p.compute_cpus
        )?;
    }
    for t in &r.threads {
        writeln!(
            out,
            "  {:<16} cpu {:>8.1} ms, run-queue wait {:>7.1} ms, {:>6} preempted or yielded, {:>6} blocked",
            t.name, t.cpu_ms, t.runq_wait_ms, t.involuntary_switches, t.voluntary_switches
        )?;
        if let Some(s) = &t.serving {
            let c = |k: &str| s.counters.get(k).copied().unwrap_or(0);
            let f = |v: Option<f64>| v.map_or("-".to_string(), |v| format!("{v:.2}"));
            writeln!(
                out,
                "  {:<16} requests {}, per stretch {}, empty polls per request {}, yields {}, blocks {}, idles {}, parks {}, on a CPU shared with the other side {} of {} samples ({}), migrations {}",
                "",
                c("requests"),
                f(s.requests_per_stretch),
                f(s.empty_polls_per_request),
                c("yields"),
                c("blocks"),
                c("idles"),
                c("parks"),
                c("shared_cpu_samples"),
                c("cpu_samples"),
                f(s.shared_cpu_fraction),
                c("migrations"),
            )?;
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn serving_counts_are_differences_with_their_ratios() {
        let names: Vec<&str> = servestats::COUNTER_NAMES.iter().map(|(_, n)| *n).collect();
        let at = |pairs: &[(&str, u64)]| -> Vec<u64> {
            names
                .iter()
                .map(|n| pairs.iter().find(|(k, _)| k == n).map_or(0, |p| p.1))
                .collect()
        };
        let before = at(&[("requests", 100), ("stretches", 10), ("cpu_samples", 4)]);
        let after = at(&[
            ("requests", 900),
            ("stretches", 110),
            ("empty_polls", 1_600),
            ("cpu_samples", 44),
            ("shared_cpu_samples", 30),
            ("busy_sampled_cpu_ns", 300),
            ("busy_sampled_wall_ns", 400),
        ]);
        let s = Serving::new(Some(&before), &after);
        assert_eq!(s.counters["requests"], 800);
        assert_eq!(s.counters["stretches"], 100);
        assert_eq!(s.requests_per_stretch, Some(8.0));
        assert_eq!(s.empty_polls_per_request, Some(2.0));
        assert_eq!(s.shared_cpu_fraction, Some(0.75));
        assert_eq!(s.busy_on_cpu_fraction, Some(0.75));
        // A compute thread serves no requests: no per-request ratios.
        let c = Serving::new(None, &at(&[("idles", 5), ("parks", 1)]));
        assert_eq!(c.counters["parks"], 1);
        assert_eq!(c.requests_per_stretch, None);
        assert_eq!(c.empty_polls_per_request, None);
    }

    #[test]
    fn host_and_process_lines_parse() {
        assert_eq!(
            parse_host("cpu  100 5 50 1000 20 3 2 7 0 0"),
            Some((100 + 5 + 50 + 3 + 2 + 7, 7))
        );
        assert_eq!(parse_host("cpu0 1 2 3 4 5 6 7 8"), None);
        assert_eq!(parse_host("cpu 1 2 3"), None);
        let stat = "4242 (dmkv (x) y) S 1 2 3 4 5 6 7 8 9 10 111 22 0 0 20 0";
        assert_eq!(parse_process_ticks(stat), Some(133));
    }

    #[test]
    fn a_busy_thread_shows_its_cpu_and_a_blocked_one_its_switches() {
        if snapshot().threads.is_empty() {
            return; // no /proc here: nothing to report, nothing invented
        }
        let (go_tx, go_rx) = std::sync::mpsc::channel::<()>();
        let (end_tx, end_rx) = std::sync::mpsc::channel::<()>();
        let worker = std::thread::Builder::new()
            .name("sched-test-busy".into())
            .spawn(move || {
                go_rx.recv().unwrap();
                let mut x = 0u64;
                for i in 0..20_000_000u64 {
                    x = x.wrapping_mul(31).wrapping_add(i);
                }
                std::hint::black_box(x);
                end_rx.recv().unwrap();
            })
            .unwrap();
        let voluntary = || {
            snapshot()
                .threads
                .values()
                .find(|t| t.name == "sched-test-busy")
                .map_or(0, |t| t.voluntary)
        };
        // Wait until the worker blocked on `go` (a voluntary switch).
        while voluntary() == 0 {
            std::thread::yield_now();
        }
        let before = snapshot();
        let blocked = before
            .threads
            .values()
            .find(|t| t.name == "sched-test-busy");
        let v0 = blocked.map_or(0, |t| t.voluntary);
        go_tx.send(()).unwrap();
        // It worked, then blocked again on `end`.
        while voluntary() <= v0 {
            std::thread::yield_now();
        }
        let after = snapshot();
        end_tx.send(()).unwrap();
        worker.join().unwrap();
        let r = SchedReport::between(&before, &after, 0.1);
        let busy = r
            .threads
            .iter()
            .find(|t| t.name == "sched-test-busy")
            .expect("the worker ran");
        // 20M multiply-adds take milliseconds on any CPU.
        assert!(busy.cpu_ms > 1.0, "{r:?}");
        assert!(busy.voluntary_switches >= 1, "{r:?}");
        assert!(r.threads.windows(2).all(|w| w[0].name <= w[1].name));
        assert!(r.other_processes_cores.is_some_and(|c| c >= 0.0));
    }
}
