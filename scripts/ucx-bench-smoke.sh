#!/usr/bin/env bash
# Runs every engine of this dmkv build on YCSB C with --verify over
# --transport local and over --transport ucx (memory nodes started as child
# processes on loopback), with the same seed, and checks that each UCX run
# verifies, that its per-operation counters equal the local run's, and that
# it reports the memory nodes' progress-thread CPU.
#
# usage: scripts/ucx-bench-smoke.sh [path/to/dmkv] [extra dmkv bench args...]
set -euo pipefail
DMKV=${1:-target/release/dmkv}
shift || true
OUT=$(mktemp -d)
trap 'rm -rf "$OUT"' EXIT

# The engines this build knows (the CLI lists them when asked for none).
engines=$("$DMKV" bench --engine __list__ 2>&1 | sed -n 's/.*(known: \(.*\)).*/\1/p' | tr -d ' ' || true)
[ -n "$engines" ] || { echo "could not list engines" >&2; exit 1; }
[ -z "${ENGINES:-}" ] || engines=$ENGINES
echo "engines: $engines"

# One task per thread by default: with several, tasks interleave where verbs
# really take time (UCX) and not where they complete at once (local), and a
# design whose cache fills on demand (cell) then pays a few more misses.
TASKS=${TASKS:-1}
ENGINES=${ENGINES:-}
args=(--workload ycsb-c --keys 20000 --ops 20000 --threads 1 --tasks "$TASKS" --verify --seed 7 "$@")
for e in ${engines//,/ }; do
    "$DMKV" bench --transport local --engine "$e" "${args[@]}" --json "$OUT/$e-local.json" >/dev/null
    "$DMKV" bench --transport ucx --engine "$e" "${args[@]}" --json "$OUT/$e-ucx.json"
    python3 - "$e" "$OUT/$e-local.json" "$OUT/$e-ucx.json" <<'PY'
import json, sys
name, local, ucx = sys.argv[1], json.load(open(sys.argv[2])), json.load(open(sys.argv[3]))
assert ucx["transport"] == "ucx" and local["transport"] == "local", (local["transport"], ucx["transport"])
assert ucx["ok"], f"{name}: the ucx run failed"
v = ucx["verify"]
assert v["enabled"] and v["checked"] > 0 and v["mismatches"] == 0 and v["missing"] == 0, v
fields = ["round_trips", "verbs", "rpcs", "bytes_read", "bytes_written"]
for f in fields:
    assert local["per_op"][f] == ucx["per_op"][f], (name, f, local["per_op"][f], ucx["per_op"][f])
for op, l in local["by_op"].items():
    u = ucx["by_op"][op]
    for k, val in l.items():
        if k in ("count", "round_trips", "verbs", "rpcs", "bytes_read", "bytes_written"):
            assert u[k] == val, (name, op, k, val, u[k])
# With --warmup-ops both runs warm up the same way and count only the run.
if "warmup" in local:
    assert ucx["warmup"]["ops"] == local["warmup"]["ops"], (name, local["warmup"], ucx.get("warmup"))
    assert ucx["ops"] == local["ops"], (name, local["ops"], ucx["ops"])
cpu = ucx["memnode"]["progress_cpu_ns"]
counters = ", ".join("%s=%s" % (f, ucx["per_op"][f]) for f in fields)
print("%s: ucx verified %d keys; per-op counters equal local (%s); memnode progress-thread CPU %.1f ms"
      % (name, v["checked"], counters, cpu / 1e6))
PY
done
echo "ucx bench smoke: passed"
