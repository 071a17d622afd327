#!/usr/bin/env bash
# Instructions per operation of one engine, split into harness / framework /
# engine, counted with callgrind.
#
#   scripts/instructions-per-op.sh ENGINE [WORKLOAD]
#
# Runs `dmkv bench` twice under callgrind with the same keys and seed, once
# with OPS_SMALL and once with OPS_LARGE operations, and divides the
# difference of the two instruction counts by the difference of the op
# counts: loading, set-up and tear-down are the same in both runs and cancel.
# Every process thread is counted (the memory node's handler threads too).
#
# Attribution is by the source file each instruction comes from (so code
# inlined into a caller still counts for the crate it was written in), else by
# the crate of the function symbol; std and dependency generics that belong to
# no crate of ours (Vec::from_iter, iterator folds, hash maps) are split over
# the categories of their callers, weighted by what each caller spends in them;
# libc (malloc, free, memcpy) and the allocator (mimalloc's mi_*) stay
# framework, wherever they are called from. (A second line gives the split
# with std and dependency code inlined into harness functions counted as
# harness, and dependency code inlined into engine functions as engine;
# the first split counts both as framework.)
#   engine    - the engine crates (xstore, rolex, outback, race, sherman,
#               rpc-hash, rpc-btree, cell, xtree, scalestore), and the
#               btree-floor's BTreeMap (testkit's floor.rs)
#   harness   - dmkv-bench (request generation, answer checking, recording)
#               except its metering, the dmkv binary, value payloads
#   framework - everything else: transport, api wrappers, metering, executor,
#               std/alloc/libc inlined or called outside engine code
#   idle      - waiting: the executor's idle spin, parking, handler threads
#               waiting for requests (reported, not part of the total)
#
# Environment: DMKV (binary, default target/release/dmkv), KEYS (50000),
# OPS_SMALL (10000), OPS_LARGE (60000), THREADS (1), TASKS (8), SEED (1),
# TOP (15 functions listed), TOP_BY (first, the default: the list's
# categories are the first attribution's; second: the second line's, so a
# row's framework pieces by that line can be read off), EXTRA (more `dmkv bench` arguments),
# KEEP (directory to keep the callgrind files in), REUSE (1: re-count the
# files already in KEEP), EVENT (what to count: Ir, the default, counts
# instructions; a callgrind cache-simulation event or a sum of them, e.g.
# EVENT=DLmr+DLmw for last-level data misses or EVENT=D1mr+D1mw for L1 data
# misses, runs callgrind with --cache-sim=yes and counts those per operation
# instead), CACHE (the simulated caches for such an EVENT, default
# "--D1=32768,8,64 --LL=33554432,16,64": a 32 KiB L1 and a 32 MiB last level).
set -euo pipefail
ENGINE=${1:?usage: $0 ENGINE [WORKLOAD]}
WORKLOAD=${2:-ycsb-c}
cd "$(dirname "$0")/.."
DMKV=${DMKV:-target/release/dmkv}
KEYS=${KEYS:-50000}
OPS_SMALL=${OPS_SMALL:-10000}
OPS_LARGE=${OPS_LARGE:-60000}
THREADS=${THREADS:-1}
TASKS=${TASKS:-8}
SEED=${SEED:-1}
TOP=${TOP:-15}
EVENT=${EVENT:-Ir}
SIM=""
TAG=""
if [ "$EVENT" != Ir ]; then
  SIM="--cache-sim=yes ${CACHE:---D1=32768,8,64 --LL=33554432,16,64}"
  TAG="-cache"
fi
[ -x "$DMKV" ] || { echo "no binary at $DMKV (cargo build --release)" >&2; exit 1; }
command -v valgrind >/dev/null || { echo "valgrind is not installed" >&2; exit 1; }
DIR=${KEEP:-$(mktemp -d)}
mkdir -p "$DIR"
for ops in "$OPS_SMALL" "$OPS_LARGE"; do
  # REUSE=1 with KEEP: re-count existing callgrind files without running.
  [ -n "${REUSE:-}" ] && [ -s "$DIR/$ENGINE-$WORKLOAD-$ops$TAG.out" ] && continue
  # shellcheck disable=SC2086
  valgrind --tool=callgrind $SIM --callgrind-out-file="$DIR/$ENGINE-$WORKLOAD-$ops$TAG.out" \
    "$DMKV" bench --engine "$ENGINE" --workload "$WORKLOAD" --keys "$KEYS" --ops "$ops" \
    --threads "$THREADS" --tasks "$TASKS" --seed "$SEED" ${EXTRA:-} \
    >"$DIR/$ENGINE-$WORKLOAD-$ops.log" 2>&1 ||
    { echo "run with $ops ops failed, see $DIR/$ENGINE-$WORKLOAD-$ops.log" >&2; exit 1; }
done
python3 - "$DIR/$ENGINE-$WORKLOAD-$OPS_SMALL$TAG.out" "$DIR/$ENGINE-$WORKLOAD-$OPS_LARGE$TAG.out" \
  "$((OPS_LARGE - OPS_SMALL))" "$ENGINE" "$WORKLOAD" "$TOP" "$EVENT" "${TOP_BY:-first}" <<'PY'
import re, sys
from collections import defaultdict

small, large, dops, engine, workload, top, event, by = sys.argv[1:9]
WANTED = event.split("+")
dops, top = int(dops), int(top)
ENGINES = {"xstore", "rolex", "outback", "race", "sherman", "rpc_hash", "rpc_btree",
           "cell", "xtree", "scalestore"}

def parse(path):
    """Self cost (Ir) per (source file, function, object)."""
    names = {"fl": {}, "fn": {}, "ob": {}}
    cost = defaultdict(int)
    ob = fl = fi = fn = ""
    skip_next = False
    callee = ""
    edges = defaultdict(int)
    ncalls = defaultdict(int)  # calls per (caller, callee)
    cols = [0]  # the columns of the wanted events on a cost line (after the position)
    def value(parts):
        # Trailing zero costs are left off a cost line.
        return sum(int(parts[1 + c]) for c in cols if 1 + c < len(parts))
    def name(kind, rest):
        m = re.match(r"\((\d+)\)(?: (.*))?", rest)
        if not m:
            return rest
        if m.group(2) is not None:
            names[kind][m.group(1)] = m.group(2)
        return names[kind].get(m.group(1), "?")
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            if not line:
                continue
            c = line[0]
            if line.startswith("events:"):
                names_ = line.split()[1:]
                cols = [names_.index(w) for w in WANTED]
                continue
            if c.isdigit() or c in "+-*":
                if skip_next:
                    # The inclusive cost of a call (caller, callee).
                    skip_next = False
                    parts = line.split()
                    if len(parts) > 1:
                        edges[(fn, callee)] += value(parts)
                    continue
                parts = line.split()
                if len(parts) > 1:
                    cost[(fi or fl, fn, ob)] += value(parts)
                continue
            key, _, rest = line.partition("=")
            if key == "ob":
                ob = name("ob", rest)
            elif key == "fl":
                fl = name("fl", rest); fi = ""
            elif key in ("fi", "fe"):
                fi = name("fl", rest)
            elif key == "fn":
                fn = name("fn", rest); fi = ""
            elif key in ("cob",):
                name("ob", rest)
            elif key in ("cfi", "cfl"):
                name("fl", rest)
            elif key == "cfn":
                callee = name("fn", rest)
            elif key == "calls":
                skip_next = True
                ncalls[(fn, callee)] += int(rest.split()[0])
    return cost, edges, ncalls

def crate_of_symbol(fn):
    m = re.search(r"dmkv_(\w+?)::", fn)
    return m.group(1) if m else None

IDLE_FN = re.compile(r"exec::idle|parker::|Parker|park_timeout|thread::park|futex|"
                     r"sched_yield|nanosleep|epoll_wait|crossbeam_channel::.*(?:Backoff|Context::wait_until)|"
                     r"wait_for_request")

def classify(file, fn, ob):
    if IDLE_FN.search(fn):
        return "idle"
    m = re.search(r"/crates/([\w-]+)/", file)
    crate = m.group(1).replace("-", "_") if m else None
    if crate is None and re.search(r"(^|/)src/(main|cli|engines|shell)\.rs$", file) and "/rustc/" not in file and ".cargo" not in file:
        return "harness"
    if crate is None:
        crate = crate_of_symbol(fn)
        if crate is not None and "/rustc/" not in file and ".cargo" not in file and file != "???":
            pass
        # std or a dependency: only engine and harness code claims it back
        # (checksum64 is the layouts' torn-read check: engine, see above).
        if (crate in ENGINES or "floor::" in fn or "checksum::" in fn) and ("/rustc/" in file):
            return "engine"
        return "framework"
    if crate in ENGINES or (crate == "testkit" and "floor::" in fn):
        return "engine"
    if crate == "bench":
        return "framework" if file.endswith("metered.rs") else "harness"
    if crate == "api" and file.endswith("checksum.rs"):
        return "engine"  # layouts checksum their records to detect torn reads
    if crate == "api" and file.endswith("payload.rs"):
        return "harness"
    if crate == "testkit":
        return "harness"
    return "framework"

(a, edges_a, calls_a), (b, edges, calls_b) = parse(small), parse(large)
callers = defaultdict(list)
for (caller, callee), w in edges.items():
    if caller != callee:
        callers[callee].append((caller, w))

def symbol_category(fn):
    """The category of a function by the crate its symbol names, or None."""
    if IDLE_FN.search(fn):
        return "idle"
    crate = crate_of_symbol(fn)
    if crate is None:
        return None
    if crate in ENGINES or "checksum::" in fn or "testkit::floor::" in fn:
        return "engine"
    if crate == "bench":
        return "framework" if "metered::" in fn else "harness"
    if crate == "testkit" or "payload::" in fn:
        return "harness"
    return "framework"

def caller_mix(fn, depth=0, seen=()):
    """How a function that belongs to no crate of ours (a std or dependency
    generic, e.g. Vec::from_iter) splits over the categories of the code
    calling it, weighted by the instructions each caller spends in it."""
    mix = defaultdict(float)
    ws = callers.get(fn, [])
    total_w = sum(w for _, w in ws)
    if depth > 6 or total_w == 0:
        return {"framework": 1.0}
    for c, w in ws:
        cat = symbol_category(c)
        if cat is not None:
            mix[cat] += w / total_w
        elif c in seen:
            mix["framework"] += w / total_w
        else:
            for k, v in caller_mix(c, depth + 1, seen + (fn,)).items():
                mix[k] += v * w / total_w
    return mix

ALLOCATOR = re.compile(r"^_?mi_")
SYSTEM_OBJ = re.compile(r"libc\.so|ld-linux|vgpreload|libm\.so|libgcc")
_mix_cache = {}
def categories(file, fn, ob):
    """{category: share} of one cost entry."""
    cat = classify(file, fn, ob)
    if ALLOCATOR.search(fn) or "mimalloc" in file or "mimalloc" in ob:
        return {"framework": 1.0}  # the allocator (mimalloc), like libc's malloc
    owned = re.search(r"/crates/|(^|/)src/\w+\.rs$", file) and "/rustc/" not in file and ".cargo" not in file
    if cat == "framework" and not owned and crate_of_symbol(fn) is None and not SYSTEM_OBJ.search(ob):
        if fn not in _mix_cache:
            _mix_cache[fn] = caller_mix(fn)
        return _mix_cache[fn]
    return {cat: 1.0}

def alt_category(file, fn, ob, cats):
    """The second attribution the script reports (a line of its own; the
    split above is unchanged): std or dependency code inlined into a
    harness function (a `dmkv_bench` symbol outside metering, value
    payloads) counts as harness, and dependency code inlined into an engine
    function (xxhash inside `checksum64`) as engine, the way std code
    inlined into an engine function already counts as engine. The primary
    rule counts both as framework."""
    if cats != {"framework": 1.0}:
        return cats
    if not ("/rustc/" in file or ".cargo" in file):
        return cats
    sym = symbol_category(fn)
    if sym == "harness" or (sym == "engine" and ".cargo" in file):
        return {sym: 1.0}
    return cats

per_fn = defaultdict(float)
per_fn_alt = defaultdict(float)
by_cat = defaultdict(float)
by_alt = defaultdict(float)
# What idle loops call (clock reads, parking) is idle too. A std or
# dependency generic they call already follows its callers into idle (its
# share from `caller_mix`), so only the inclusive cost that reaches code
# classified by itself (a crate of ours, libc, the allocator) from an idle
# context is moved here: a call from an idle function counts whole, a
# call from a mixed function by that function's idle share. (Moving every
# call an idle function makes, as this script did before the nineteenth
# session, counted a generic's idle share twice: once through its callers'
# mix, once here; the framework column of the RPC engines then swung with
# the handler's idle polling.)
_file_ob = {}
for (file, fn, ob) in b:
    _file_ob.setdefault(fn, (file, ob))
def is_mixed(fn):
    file, ob = _file_ob.get(fn, ("???", ""))
    if IDLE_FN.search(fn) or ALLOCATOR.search(fn) or "mimalloc" in file or "mimalloc" in ob:
        return False
    owned = re.search(r"/crates/|(^|/)src/\w+\.rs$", file) and "/rustc/" not in file and ".cargo" not in file
    return classify(file, fn, ob) == "framework" and not owned \
        and crate_of_symbol(fn) is None and not SYSTEM_OBJ.search(ob)
def idle_weight(fn):
    if IDLE_FN.search(fn):
        return 1.0
    if is_mixed(fn):
        if fn not in _mix_cache:
            _mix_cache[fn] = caller_mix(fn)
        return _mix_cache[fn].get("idle", 0.0)
    return 0.0
def idle_reached(es):
    total = 0.0
    for (caller, callee), w in es.items():
        if caller == callee or IDLE_FN.search(callee) or is_mixed(callee):
            continue
        total += w * idle_weight(caller)
    return total
idle_moved = (idle_reached(edges) - idle_reached(edges_a)) / dops
by_cat["idle"] += idle_moved
by_cat["framework"] -= idle_moved
by_alt["idle"] += idle_moved
by_alt["framework"] -= idle_moved
for k in set(a) | set(b):
    d = (b.get(k, 0) - a.get(k, 0)) / dops
    if d == 0:
        continue
    short = re.sub(r"::h[0-9a-f]{16}$", "", k[1])
    cats = categories(*k)
    for cat, share in cats.items():
        by_cat[cat] += d * share
        per_fn[(cat, short)] += d * share
    for cat, share in alt_category(*k, cats).items():
        by_alt[cat] += d * share
        per_fn_alt[(cat, short)] += d * share
total = sum(v for c, v in by_cat.items() if c != "idle")
prec = 0 if event == "Ir" else 3
what = "instructions" if event == "Ir" else event
print(f"{engine} {workload}: {what} per operation (callgrind, differenced over {dops} ops)")
for cat in ("harness", "framework", "engine"):
    print(f"  {cat:<10} {by_cat.get(cat, 0):>9.{prec}f}")
print(f"  {'total':<10} {total:>9.{prec}f}   (idle polling, not counted: {by_cat.get('idle', 0):.0f}; of it called from idle loops: {idle_moved:.0f})")
print(f"  std/dependency code inlined into harness and engine functions counted as theirs: "
      f"harness {by_alt.get('harness', 0):.0f} / framework {by_alt.get('framework', 0):.0f} / engine {by_alt.get('engine', 0):.0f}")
# Tasks waiting for another task or thread by polling `yield_now` (RACE's
# chunk wait, a split's frozen slots, a lower insert claim) or a timer
# (`sleep`, a split lock's backoff): under callgrind such a wait spins until
# valgrind switches threads, so a row with many polls per operation counts
# spin as work and is not a measurement of the code (count it with TASKS=1,
# where the wait is the executor's idle). An operation that never waits
# polls neither.
def polls(calls, pat):
    return sum(n for (_, callee), n in calls.items() if re.search(pat, callee))
for what_, pat in (("yield_now", r"YieldNow as core::future::future::Future>::poll"),
                   ("sleep", r"exec::Sleep as core::future::future::Future>::poll")):
    print(f"  {what_} polls per op: {(polls(calls_b, pat) - polls(calls_a, pat)) / dops:.3f}"
          f" ({polls(calls_a, pat)} and {polls(calls_b, pat)} in the two runs)")
listed = per_fn_alt if by == "second" else per_fn
print(f"  top {top} functions (self cost per op{', second attribution' if by == 'second' else ''}):")
for (cat, f), v in sorted(listed.items(), key=lambda kv: -kv[1])[:top]:
    print(f"    {v:>8.{prec}f}  {cat:<9} {f[:150]}")
PY
