#!/usr/bin/env bash
# r2ccl demo: two ranks with four rails each move one large verified message and
# show how the bytes were striped over the rails.
#
#   scripts/demo.sh BUILD_DIR        (normally through `scripts/run demo`)
#
# With root and a working netns testbed it builds testbed "demo" (2 hosts x 4 NICs,
# every rail shaped to 200mbit) and runs rank 0 on host 0 and rank 1 on host 1.
# Otherwise it says why and runs the same two ranks on loopback, each with four
# 127.0.0.x addresses as its rails.  Exit status: 0 when both ranks succeed.
set -euo pipefail

readonly RANK_TIMEOUT=180 # hard wall-clock limit per rank (s)
readonly TB_NAME=demo
readonly RATE=200mbit
readonly ARGS=(sendrecv -b 64M -e 64M -n 2 -w 1 -c 1 --rails)

[[ $# -ge 1 ]] || { echo "usage: scripts/demo.sh BUILD_DIR" >&2; exit 2; }
build=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
testbed=$root/tests/testbed/testbed
perf=$build/bin/r2ccl-perf
[[ -x $perf ]] || { echo "demo: $perf not found (build first: scripts/run build)" >&2; exit 2; }

NAME=demo
# shellcheck source=scripts/lib.sh
source "$root/scripts/lib.sh"
r2_init demo

mode=loopback
why=
if [[ $EUID -ne 0 ]]; then
  why="not root, so no network namespaces"
elif ! why=$("$testbed" check 2>&1 >/dev/null); then
  why=${why#testbed: }
else
  mode=testbed
fi

echo "r2ccl demo: two ranks, one 64 MiB message each way (rank 0 -> rank 1 -> rank 0), every byte verified."
echo "r2ccl demo: each rank has four rails; r2ccl splits the message into 512K chunks and stripes them over all four."
if [[ $mode == testbed ]]; then
  echo "r2ccl demo: network: testbed '$TB_NAME', 2 hosts (network namespaces) x 4 NICs eth1..eth4, each rail shaped to $RATE."
  r2_create_testbed --hosts 2 --nics 4 --rate "$RATE"
  boot=198.19.0.1:29500
  cmd0=("$testbed" exec "$TB_NAME" 0 -- env R2CCL_RANK=0 R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=$boot")
  cmd1=("$testbed" exec "$TB_NAME" 1 -- env R2CCL_RANK=1 R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=$boot")
else
  echo "r2ccl demo: no testbed ($why); running on loopback instead."
  echo "r2ccl demo: network: loopback, rank 0 rails 127.0.0.11-14, rank 1 rails 127.0.0.21-24 (not shaped)."
  port=$(r2_free_port)
  boot=127.0.0.1:$port
  cmd0=(env R2CCL_RANK=0 R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=$boot" "R2CCL_NICS=127.0.0.11,127.0.0.12,127.0.0.13,127.0.0.14")
  cmd1=(env R2CCL_RANK=1 R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=$boot" "R2CCL_NICS=127.0.0.21,127.0.0.22,127.0.0.23,127.0.0.24")
fi
echo "r2ccl demo: command: r2ccl-perf ${ARGS[*]}  (bootstrap at $boot)"
echo

common=(R2CCL_BOOTSTRAP_TIMEOUT=30s R2CCL_TIMEOUT=60s)
cmd0+=("${common[@]}" "$perf" "${ARGS[@]}")
cmd1+=("${common[@]}" "$perf" "${ARGS[@]}")
if ! r2_run_pair demo; then
  echo "r2ccl demo: FAILED" >&2
  exit 1
fi
cat "$work/demo.0.out"
echo
echo "r2ccl demo: OK: both ranks exited 0."
