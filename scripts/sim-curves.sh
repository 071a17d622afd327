#!/usr/bin/env bash
# Throughput-latency curves on the simulated cluster: the same workload at a
# growing number of client threads, one engine at a time, with the busiest
# simulated resource at each point (where the knee comes from).
#
#   scripts/sim-curves.sh [ENGINE[,ENGINE...]] [THREADS...]
#
# Environment (defaults in brackets): DMKV [target/release/dmkv],
# PROFILE [outback-cx6], WORKLOAD [ycsb-c], KEYS [200000], OPS [200000],
# NODES (compute nodes) [2], TASKS (per thread) [1], MEMNODE_THREADS [1],
# EXTRA (more `dmkv bench` flags) [], OUT (directory for the JSON reports)
# [a temporary directory].
#
# Threads are per compute node: the cluster has NODES x THREADS x TASKS
# clients. Prints one table row per point: engine, clients, throughput
# (Mops), p50 and p99 latency (us), and the busiest resource with its busy
# percentage. The tables in docs/simulation.md came from this script.
set -euo pipefail

engines="${1:-outback,race,rpc-hash}"
shift || true
threads=("$@")
if [ ${#threads[@]} -eq 0 ]; then
  threads=(1 2 4 8 16 36 72)
fi
dmkv="${DMKV:-target/release/dmkv}"
out="${OUT:-$(mktemp -d)}"
mkdir -p "$out"

printf '| engine | clients | Mops | p50 us | p99 us | busiest resource |\n'
printf '|---|---|---|---|---|---|\n'
for engine in ${engines//,/ }; do
  for t in "${threads[@]}"; do
    json="$out/$engine-$t.json"
    # shellcheck disable=SC2086
    "$dmkv" bench --transport sim --profile "${PROFILE:-outback-cx6}" \
      --engine "$engine" --workload "${WORKLOAD:-ycsb-c}" \
      --keys "${KEYS:-200000}" --ops "${OPS:-200000}" \
      --compute-nodes "${NODES:-2}" --threads "$t" --tasks "${TASKS:-1}" \
      --memnode-threads "${MEMNODE_THREADS:-1}" ${EXTRA:-} \
      --json "$json" >/dev/null
    python3 - "$json" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
r = r[0] if isinstance(r, list) else r
clients = r["sim"]["compute_nodes"] * r["threads"] * r["tasks_per_thread"]
top = r["sim"]["utilisation"][0]
print(f"| {r['engine']} | {clients} | {r['throughput_ops_per_s'] / 1e6:.2f} | "
      f"{r['latency_us']['p50']:.1f} | {r['latency_us']['p99']:.1f} | "
      f"{top['name']} {top['busy_percent']:.0f}% |")
PY
  done
done
