#!/usr/bin/env bash
# bench/verbs.sh: is r2ccl over one verbs rail as fast as the rail itself?
#
#   bench/verbs.sh [BUILD_DIR]        (default: build)
#
# In ONE Soft-RoCE VM run (tests/rdma/run.sh, 2 hosts x 1 rxe NIC) it measures, at 4 MiB
# messages over the same rail (rxe_h0n0 <-> rxe_h1n0):
#   * ib_write_bw, one QP, one direction, and ib_write_bw -b (both directions at once; perftest
#     then reports the sum, halved here to a per-direction figure);
#   * r2ccl-perf sendrecv with R2CCL_PROVIDER=verbs and R2CCL_NICS=rxe_h0n0 / rxe_h1n0, every
#     byte verified: --oneway (rank 0 sends, rank 1 receives) beside ib_write_bw, and plain
#     sendrecv (both directions at once; algbw is per direction) beside ib_write_bw -b.
# Prints the figures (Gb/s = 10^9 bit/s) and the ratios; the target is r2ccl one way
# >= 0.9 x ib_write_bw one way.  The guest is emulated (TCG): the figures are for comparing the two, not
# absolute speeds.
# Exit status: 0 PASS, 1 FAIL or a run failed, 2 usage, 77 the VM cannot run here.
set -euo pipefail

readonly SIZE=4194304 # 4 MiB: per-message handshakes (r2ccl) amortised as in a stream
readonly IB_ITERS=100
readonly R2_ITERS=50
readonly R2_WARMUP=5
readonly TARGET=0.9
readonly STEP_TIMEOUT=240 # s, per measured run: catches hangs only

root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)

if [[ -z ${RDMA_VM:-} ]]; then
  [[ $# -le 1 ]] || { echo "usage: bench/verbs.sh [BUILD_DIR]" >&2; exit 2; }
  build=$(cd "${1:-$root/build}" 2>/dev/null && pwd) || { echo "bench: no build dir '${1:-$root/build}'" >&2; exit 2; }
  [[ -x $build/bin/r2ccl-perf ]] || { echo "bench: $build/bin/r2ccl-perf not found (build first)" >&2; exit 2; }
  echo "bench: booting the Soft-RoCE VM (2 hosts x 1 NIC; emulated, expect ~1 min plus the runs)" >&2
  exec "$root/tests/rdma/run.sh" --hosts 2 --nics 1 --timeout 900 -- bash "$root/bench/verbs.sh" "$build"
fi

# ------------------------------------------------------------------------ in the guest
build=$1
perf=$build/bin/r2ccl-perf
work=$(mktemp -d /tmp/verbs-bench.XXXXXX)
gidx=${RDMA_VM_GID_INDEX:-1}
fail() { echo "bench: $*" >&2; exit 1; }

# wait_listen PORT -> returns once a TCP socket listens on PORT (bounded: 30 s).
wait_listen() {
  local hex i
  hex=$(printf ':%04X ' "$1")
  for ((i = 0; i < 300; i++)); do
    grep -q "${hex}[0-9A-F:]* 0A " /proc/net/tcp /proc/net/tcp6 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

# ib_bw TAG PORT [ARGS...] -> the client's average bandwidth in Gb/s (sum of both ways with -b).
# perftest prints MiB/s with two decimals (more digits than its --report_gbits); converted here.
ib_bw() {
  local tag=$1 port=$2 spid v
  shift 2
  local common=(-x "$gidx" -s "$SIZE" -n "$IB_ITERS" -p "$port" "$@")
  timeout "$STEP_TIMEOUT" ib_write_bw -d rxe_h1n0 "${common[@]}" >"$work/$tag.server" 2>&1 &
  spid=$!
  wait_listen "$port" || { kill "$spid" 2>/dev/null; fail "ib_write_bw server ($tag) did not listen on $port"; }
  if ! timeout "$STEP_TIMEOUT" ib_write_bw -d rxe_h0n0 "${common[@]}" 198.18.0.2 >"$work/$tag.client" 2>&1; then
    cat "$work/$tag.client" "$work/$tag.server" >&2
    kill "$spid" 2>/dev/null || true
    fail "ib_write_bw ($tag) failed"
  fi
  wait "$spid" || true
  # #bytes #iterations BW-peak BW-average[MiB/s] MsgRate
  v=$(awk -v s="$SIZE" '$1 == s && NF >= 4 { printf "%.3f", $4 * 1048576 * 8 / 1e9; exit }' "$work/$tag.client")
  [[ -n $v ]] || { cat "$work/$tag.client" >&2; fail "no $SIZE-byte row in ib_write_bw's ($tag) output"; }
  echo "$v"
}

uni=$(ib_bw uni 18515)
bidir_sum=$(ib_bw bidir 18516 -b)
bidir=$(awk -v v="$bidir_sum" 'BEGIN { printf "%.3f", v / 2 }')
echo "bench: ib_write_bw 4 MiB: one direction $uni Gb/s; -b: $bidir_sum Gb/s both ways, $bidir per direction" >&2

# r2ccl-perf sendrecv over one verbs rail, verified. algbw (GB/s) from the receiving rank's row:
# --oneway (rank 0 sends, rank 1 receives) against ib_write_bw one direction; plain sendrecv
# (both ways at once, algbw per direction) against ib_write_bw -b.
r2_run() { # TAG PORT [ARGS...] -> Gb/s per direction
  local tag=$1 port=$2 rc0=0 rc1=0 r1 algbw
  shift 2
  local args=(sendrecv -b "$SIZE" -e "$SIZE" -n "$R2_ITERS" -w "$R2_WARMUP" -c 1 "$@")
  local env=(R2CCL_PROVIDER=verbs R2CCL_NRANKS=2 R2CCL_BOOTSTRAP=127.0.0.1:$port
    R2CCL_BOOTSTRAP_TIMEOUT=60s R2CCL_CONNECT_TIMEOUT=30s R2CCL_TIMEOUT=120s)
  timeout "$STEP_TIMEOUT" env "${env[@]}" R2CCL_RANK=1 R2CCL_NICS=rxe_h1n0 "$perf" "${args[@]}" \
    >"$work/$tag.rank1" 2>&1 &
  r1=$!
  timeout "$STEP_TIMEOUT" env "${env[@]}" R2CCL_RANK=0 R2CCL_NICS=rxe_h0n0 "$perf" "${args[@]}" \
    >"$work/$tag.rank0" 2>&1 || rc0=$?
  wait "$r1" || rc1=$?
  if [[ $rc0 != 0 || $rc1 != 0 ]]; then
    echo "--- rank 0 (rc $rc0)" >&2; cat "$work/$tag.rank0" >&2
    echo "--- rank 1 (rc $rc1)" >&2; cat "$work/$tag.rank1" >&2
    fail "r2ccl-perf ($tag) failed"
  fi
  grep -q 'provider verbs' "$work/$tag.rank0" || { cat "$work/$tag.rank0" >&2; fail "r2ccl-perf ($tag) did not run on the verbs provider"; }
  grep -q '^# Check: every byte verified on every rank' "$work/$tag.rank0" ||
    { cat "$work/$tag.rank0" >&2; fail "r2ccl-perf ($tag) did not verify its data"; }
  # size count type redop root time algbw busbw #wrong algo
  algbw=$(awk -v s="$SIZE" '$1 == s && NF >= 9 { print $7; exit }' "$work/$tag.rank0")
  [[ -n $algbw ]] || { cat "$work/$tag.rank0" >&2; fail "no $SIZE-byte row in r2ccl-perf's ($tag) output"; }
  awk -v g="$algbw" 'BEGIN { printf "%.3f", g * 8 }' # GB/s -> Gb/s
}
r2_uni=$(r2_run oneway 29611 --oneway)
r2_bidir=$(r2_run bidir 29612)

ratio=$(awk -v a="$r2_uni" -v b="$uni" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "0" }')
ratio_bidir=$(awk -v a="$r2_bidir" -v b="$bidir" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "0" }')
verdict=$(awk -v r="$ratio" -v t="$TARGET" 'BEGIN { print (r >= t) ? "PASS" : "FAIL" }')

echo
echo "One Soft-RoCE rail (rxe_h0n0 <-> rxe_h1n0, emulated guest), 4 MiB messages, Gb/s per direction:"
echo
echo "| direction | ib_write_bw | r2ccl-perf sendrecv (verified) | ratio |"
echo "|---|---:|---:|---:|"
echo "| one way (ib_write_bw; r2ccl --oneway) | $uni | $r2_uni | $ratio |"
echo "| both ways at once (ib_write_bw -b; r2ccl sendrecv) | $bidir | $r2_bidir | $ratio_bidir |"
echo
echo "r2ccl / ib_write_bw one way = $ratio (target >= $TARGET): $verdict"
rm -rf "$work"
[[ $verdict == PASS ]]
