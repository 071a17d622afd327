#!/usr/bin/env bash
# The UCX part of dmkv's CI (called by .ci/run). Installs libucx-dev and
# libclang-dev when missing, then: clippy and the conformance and backend
# suites of dmkv-transport-ucx with the `ucx` feature (tcp, shared memory,
# shared memory through ucp_get/put), a `dmkv bench --transport ucx` smoke
# run compared with --transport local, XStore's logs surviving kill -9 of a
# `dmkv memnode --data-dir` process, ScaleStore as `dmkv node` processes on
# loopback (scripts/scalestore-nodes.sh), and the multi-host namespace test when
# this machine allows network namespaces.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { printf '\n==> %s\n' "$*"; }

step "ucx: system packages"
need=()
[ -f /usr/include/ucp/api/ucp.h ] || need+=(libucx-dev)
# bindgen needs libclang itself (libclang.so*, libclang-N.so*); a machine may
# have only libclang-cpp (a different library), which must not count.
have_libclang() {
    local f
    for f in /usr/lib/llvm-*/lib/libclang.so* /usr/lib/llvm-*/lib/libclang-[0-9]*.so* \
        /usr/lib/x86_64-linux-gnu/libclang.so* /usr/lib/x86_64-linux-gnu/libclang-[0-9]*.so*; do
        [ -e "$f" ] && return 0
    done
    return 1
}
have_libclang || need+=(libclang-dev)
command -v pkg-config >/dev/null 2>&1 || need+=(pkg-config)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi

# Tests use loopback only; keep UCX off other devices.
export UCX_NET_DEVICES=lo

step "ucx: clippy"
cargo clippy -p dmkv-transport-ucx -p dmkv --features dmkv-transport-ucx/ucx,dmkv/ucx --all-targets -- -D warnings

step "ucx: conformance (tcp, shm, shm via ucp_get/put) and backend tests"
cargo test --release -p dmkv-transport-ucx --features ucx

step "ucx: dmkv bench --transport ucx against --transport local"
cargo build --release --features ucx
bash scripts/ucx-bench-smoke.sh target/release/dmkv
UCX_TLS=tcp bash scripts/ucx-bench-smoke.sh target/release/dmkv
# A warm-up over UCX: the compute threads' barrier after it and the memory
# nodes' figures taken when the run starts, across processes.
ENGINES=rolex,outback bash scripts/ucx-bench-smoke.sh target/release/dmkv --warmup-ops 10000

step "ucx: xstore durability across processes (dmkv memnode --data-dir, kill -9, restart, verify)"
DMKV_BIN="$PWD/target/release/dmkv" cargo test --release -p dmkv-transport-ucx --features ucx \
    --test ucx_xstore_durability -- --test-threads=1

step "ucx: scalestore as node processes (dmkv node): ycsb-a/c uniform/zipfian, join + leave mid-run, kill -9"
timeout 600 bash scripts/scalestore-nodes.sh target/release/dmkv

step "ucx: multi-host test in network namespaces"
if ip netns add dmkv-ci-probe 2>/dev/null; then
    ip netns del dmkv-ci-probe
    timeout 900 bash scripts/netns-test.sh target/release/dmkv
else
    echo "skipped: this machine does not allow network namespaces (ip netns add failed)"
fi
echo "ucx: all passed"
