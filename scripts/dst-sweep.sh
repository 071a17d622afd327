#!/usr/bin/env bash
# Long deterministic-simulation sweeps (CI runs 300 seeds per engine, 100 for
# ScaleStore, with every fault kind on the seeds that choose it; this
# runs as many as you like). Every failing seed is printed with the command
# that replays exactly that run.
#
#   scripts/dst-sweep.sh [SEEDS] [FIRST_SEED] [extra `dmkv dst` flags...]
#   scripts/dst-sweep.sh 20000 0 --engine race,rolex --jitter-ns 1000
#   scripts/dst-sweep.sh 2000 0 --faults all   # delay, kill, crash, large
#   scripts/dst-sweep.sh 300 0 --engine rolex --op-limit-ms 10000 --set rolex.slt_slots=8
# Seeds also draw engine settings that take other code paths than the
# defaults (src/dst.rs VARIANTS; --variants off for defaults only; a knob
# given with --set is never drawn).
# An operation of the mixed run that runs past --op-limit-ms of virtual
# time (default 10 s) fails its seed as a livelock; --set passes engine
# settings, and both go into the printed replay command.
set -euo pipefail
cd "$(dirname "$0")/.."
seeds=${1:-10000}
first=${2:-0}
shift $(( $# > 2 ? 2 : $# ))
cargo build --release --quiet
exec ./target/release/dmkv dst --seeds "$seeds" --first-seed "$first" "$@"
