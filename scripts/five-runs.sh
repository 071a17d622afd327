#!/usr/bin/env bash
# Issue 13, item 4: five identical runs of
#
#   dmkv bench --engine outback,rpc-hash,rpc-btree --memnode-threads 1 [EXTRA...]
#
# back to back, then per engine: the five throughputs, their median, the
# run furthest from it (item 4 asks for every run within 15%), and per run
# the evidence that tells a serving mode apart without wall-clock time
# (from the report's `sched` object):
#   mn/GET   memory-node CPU charged per GET (ns)
#   other    CPU the rest of the host used during the run (cores): a
#            wall-clock figure means little when this is high
#   h cpu    handler thread's CPU per GET (ns, from schedstat)
#   c cpu    compute thread's CPU per GET (ns)
#   h inv    handler's involuntary switches per 1,000 GETs (a sched_yield
#            that handed the core to another thread counts here)
#   req/str  requests the handler served per busy stretch (its batch)
#   shared   fraction of the handler's CPU samples on the CPU where the
#            compute thread was last sampled (1: they share one CPU)
#   h mig    the handler's sampled migrations between CPUs
#   c parks  times the compute thread parked
#
#   scripts/five-runs.sh [EXTRA dmkv bench arguments, e.g. --pin-threads none]
#
# (`dmkv bench` pins the handler and compute thread to CPUs of their own by
# default when it can: `--pin-threads auto`.)
#
# Environment: DMKV (binary, default target/release/dmkv), RUNS (5),
# KEEP (directory for the JSON reports; default a temporary one).
set -euo pipefail
cd "$(dirname "$0")/.."
DMKV=${DMKV:-target/release/dmkv}
RUNS=${RUNS:-5}
KEEP=${KEEP:-$(mktemp -d)}
mkdir -p "$KEEP"
for i in $(seq 1 "$RUNS"); do
  echo "run $i: $(date -u +%H:%M:%S) load $(cut -d' ' -f1-3 /proc/loadavg)" >&2
  "$DMKV" bench --engine outback,rpc-hash,rpc-btree --memnode-threads 1 \
    --json "$KEEP/run-$i.json" "$@" >/dev/null
done
python3 - "$KEEP" "$RUNS" <<'EOF'
import json, os, statistics, sys

keep, runs = sys.argv[1], int(sys.argv[2])
by_engine = {}
for i in range(1, runs + 1):
    for r in json.load(open(os.path.join(keep, f"run-{i}.json"))):
        by_engine.setdefault(r["engine"], []).append(r)

def thread(r, prefix):
    for t in (r.get("sched") or {}).get("threads", []):
        if t["name"].startswith(prefix):
            return t
    return {}

def fmt(v, spec):
    return "-" if v is None else format(v, spec)

ok = True
for engine, rs in by_engine.items():
    tput = [r["throughput_ops_per_s"] for r in rs]
    med = statistics.median(tput)
    dev = [abs(t - med) / med for t in tput]
    far = max(range(len(dev)), key=dev.__getitem__)
    within = dev[far] <= 0.15
    ok &= within
    print(f"{engine}: ops/s {' '.join(f'{t:,.0f}' for t in tput)}; median {med:,.0f}; "
          f"furthest {dev[far]*100:.1f}% (run {far+1}) {'within' if within else 'NOT within'} 15%")
    print("  run      ops/s  mn/GET  other  h cpu  c cpu  h inv  req/str  shared  h mig  c parks")
    for i, r in enumerate(rs):
        s = r.get("sched") or {}
        ops = r["ops"] or 1
        h, c = thread(r, "dmkv-n0-h0"), thread(r, "bench-0")
        hs, cs = h.get("serving") or {}, c.get("serving") or {}
        print(f"  {i+1:>3} {r['throughput_ops_per_s']:>10,.0f} {r['per_op']['memnode_cpu_ns']:>7.0f}"
              f" {fmt(s.get('other_processes_cores'), '6.2f')}"
              f" {fmt(h.get('cpu_ms', 0) * 1e6 / ops, '6.0f')} {fmt(c.get('cpu_ms', 0) * 1e6 / ops, '6.0f')}"
              f" {fmt(h.get('involuntary_switches', 0) * 1000 / ops, '6.1f')}"
              f" {fmt(hs.get('requests_per_stretch'), '8.2f')} {fmt(hs.get('shared_cpu_fraction'), '7.2f')}"
              f" {fmt((hs.get('counters') or {}).get('migrations'), '6')}"
              f" {fmt((cs.get('counters') or {}).get('parks'), '8')}")
    pinned = (rs[0].get("sched") or {}).get("pinned")
    if pinned:
        print(f"  pinned: {pinned}")
print(f"reports in {keep}")
sys.exit(0 if ok else 1)
EOF
