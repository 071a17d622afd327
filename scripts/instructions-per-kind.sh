#!/usr/bin/env bash
# Instructions per operation of one engine for each operation kind, split
# into harness / framework / engine, counted with callgrind.
#
#   scripts/instructions-per-kind.sh ENGINE
#
# A mixed workload's instructions cannot be split per kind by differencing
# (both runs mix the kinds in the same proportion), so each kind is counted
# on a workload of that kind alone, with `scripts/instructions-per-op.sh`
# (same keys, seed, threads and attribution rules; see that script):
#   get     ycsb-c                    (100% read)
#   update  mixed:0,100,0,0,0         (100% update of loaded keys: ycsb-a's UPDATE)
#   insert  insert                    (inserts of new keys into the loaded set)
#   delete  mixed:0,0,0,100,0         (deletes of loaded keys, uniform: a key
#                                      drawn twice is deleted once, then absent)
#   scan    mixed:0,0,0,0,100         (scans of 1..100 pairs, uniform; only
#                                      engines with ordered scans)
# Each kind's two runs use OPS_SMALL_<KIND> / OPS_LARGE_<KIND> operations
# (defaults below; scans are ~50 pairs each, so fewer).
#
# Environment: KINDS (default "get update insert scan"), DMKV, KEYS, THREADS,
# TASKS, SEED, EXTRA as for instructions-per-op.sh; KEEP (directory: the
# callgrind files and each kind's full output go to KEEP/<kind>/), REUSE.
# Prints one line per kind, with the second attribution of
# instructions-per-op.sh in parentheses and the `yield_now` and `sleep`
# polls per operation after it (a task waiting for another task or thread
# polls them; under callgrind such a wait spins until valgrind switches
# threads, so a row with many polls carries spin, not code: count it again
# with TASKS=1, where the wait is the executor's idle); a kind the engine refuses (no
# ordered scans) is reported as such, any other failure stops the script.
set -euo pipefail
ENGINE=${1:?usage: $0 ENGINE}
cd "$(dirname "$0")/.."
KINDS=${KINDS:-get update insert scan}
DIR=${KEEP:-$(mktemp -d)}
mkdir -p "$DIR"
printf '%s: instructions per operation by kind (callgrind, single-kind workloads differenced)\n' "$ENGINE"
printf '  %-7s %-20s %9s %9s %9s %9s %9s   %s\n' kind workload harness framework engine total fw-engine \
  '(second attribution: harness / framework / engine, fw-engine)   polls yield_now / sleep per op'
for kind in $KINDS; do
  case $kind in
    get) wl=ycsb-c; small=10000; large=60000 ;;
    update) wl=mixed:0,100,0,0,0; small=10000; large=60000 ;;
    insert) wl=insert; small=10000; large=60000 ;;
    delete) wl=mixed:0,0,0,100,0; small=5000; large=25000 ;;
    scan) wl=mixed:0,0,0,0,100; small=1000; large=6000 ;;
    *) echo "unknown kind $kind (get, update, insert, delete, scan)" >&2; exit 2 ;;
  esac
  up=$(echo "$kind" | tr '[:lower:]' '[:upper:]')
  s_var="OPS_SMALL_$up"; l_var="OPS_LARGE_$up"
  small=${!s_var:-$small}; large=${!l_var:-$large}
  mkdir -p "$DIR/$kind"
  if ! OPS_SMALL=$small OPS_LARGE=$large KEEP="$DIR/$kind" \
      scripts/instructions-per-op.sh "$ENGINE" "$wl" >"$DIR/$kind/split.txt" 2>&1; then
    if grep -qs 'has no ordered scans' "$DIR/$kind"/*.log; then
      printf '  %-7s %-20s %s\n' "$kind" "$wl" "(the engine has no ordered scans)"
      continue
    fi
    echo "counting $kind failed:" >&2
    cat "$DIR/$kind/split.txt" >&2
    exit 1
  fi
  python3 - "$DIR/$kind/split.txt" "$kind" "$wl" <<'PY'
import re, sys
path, kind, wl = sys.argv[1:4]
v = {}
alt = ""
spin = {}
for line in open(path):
    m = re.match(r"\s+(harness|framework|engine|total)\s+(-?\d+)", line)
    if m:
        v[m.group(1)] = int(m.group(2))
    m = re.search(r"counted as theirs: harness (-?\d+) / framework (-?\d+) / engine (-?\d+)", line)
    if m:
        h, f, e = (int(x) for x in m.groups())
        alt = f"   ({h:,} / {f:,} / {e:,}, {f - e:,})"
    m = re.match(r"\s+(yield_now|sleep) polls per op: (-?[\d.]+)", line)
    if m:
        spin[m.group(1)] = float(m.group(2))
polls = f"   polls {spin.get('yield_now', 0):.2f} / {spin.get('sleep', 0):.2f}" if spin else ""
print(f"  {kind:<7} {wl:<20} {v['harness']:>9,} {v['framework']:>9,} {v['engine']:>9,} {v['total']:>9,} {v['framework'] - v['engine']:>9,}{alt}{polls}")
PY
done
echo "  (each kind's top functions: $DIR/<kind>/split.txt)"
