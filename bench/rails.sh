#!/usr/bin/env bash
# bench/rails.sh: does striping over four rails give four times one rail?
#
#   bench/rails.sh BUILD_DIR        (normally through `scripts/run bench`)
#
# Builds a netns testbed of 2 hosts x 4 NICs with every rail shaped to 100mbit,
# then runs a verified 64 MiB sendrecv between the two hosts twice in this one
# run: with R2CCL_NICS=eth1 (one rail) and with all four rails.  Prints a Markdown
# table and the target "four rails >= 3.6x one rail".
# Exit status: 0 PASS, 1 FAIL (or a run failed), 2 usage, 77 no testbed here.
set -euo pipefail

readonly TB_NAME=rails
readonly RATE=100mbit
readonly TARGET=3.6
readonly RANK_TIMEOUT=240 # hard wall-clock limit per rank (s); one rail needs ~30 s
readonly ARGS=(sendrecv -b 64M -e 64M -n 3 -w 1 -c 1)

[[ $# -ge 1 ]] || { echo "usage: bench/rails.sh BUILD_DIR" >&2; exit 2; }
build=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
testbed=$root/tests/testbed/testbed
perf=$build/bin/r2ccl-perf
[[ -x $perf ]] || { echo "bench: $perf not found (build first: scripts/run build)" >&2; exit 2; }

NAME=bench
# shellcheck source=scripts/lib.sh
source "$root/scripts/lib.sh"
r2_require_testbed
r2_init bench

# run_pair TAG PORT [ENV...] -> rank 0 on host 0, rank 1 on host 1; rank 0 writes $work/TAG.json.
run_pair() {
  local tag=$1 port=$2
  shift 2
  local env=(R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=198.19.0.1:$port" R2CCL_BOOTSTRAP_TIMEOUT=30s R2CCL_TIMEOUT=120s "$@")
  cmd0=("$testbed" exec "$TB_NAME" 0 -- env R2CCL_RANK=0 "${env[@]}" "$perf" "${ARGS[@]}" --json "$work/$tag.json")
  cmd1=("$testbed" exec "$TB_NAME" 1 -- env R2CCL_RANK=1 "${env[@]}" "$perf" "${ARGS[@]}")
  r2_run_pair "$tag"
}

# busbw_mbps FILE -> the 64 MiB row's bus bandwidth in MB/s from rank 0's JSON.
busbw_mbps() {
  local v
  v=$(sed -n 's/^ *"avg_busbw_gbps": *\([0-9.eE+-]*\),\{0,1\}$/\1/p' "$1" | head -n 1)
  [[ -n $v ]] || { echo "bench: no avg_busbw_gbps in $1" >&2; return 1; }
  awk -v g="$v" 'BEGIN { printf "%.2f", g * 1000 }'
}

echo "bench: testbed '$TB_NAME': 2 hosts x 4 NICs, every rail shaped to $RATE; r2ccl-perf ${ARGS[*]}"
r2_create_testbed --hosts 2 --nics 4 --rate "$RATE"

# rails_in FILE -> the number of rails rank 0 used, from its JSON.
rails_in() { sed -n 's/^ *"rails": *\([0-9]*\),\{0,1\}$/\1/p' "$1" | head -n 1; }

run_pair one 29501 R2CCL_NICS=eth1
run_pair four 29502
for want in one:1 four:4; do
  got=$(rails_in "$work/${want%%:*}.json")
  if [[ $got != "${want#*:}" ]]; then
    echo "bench: the ${want%%:*}-rail run used '${got}' rails, expected ${want#*:}" >&2
    exit 1
  fi
done
one=$(busbw_mbps "$work/one.json")
four=$(busbw_mbps "$work/four.json")
ratio=$(awk -v a="$four" -v b="$one" 'BEGIN { if (b > 0) printf "%.2f", a / b; else print "0" }')
verdict=$(awk -v r="$ratio" -v t="$TARGET" 'BEGIN { print (r >= t) ? "PASS" : "FAIL" }')

# Rebalancing: one NIC at a quarter of the others' rate. Jumbo frames (as RDMA fabrics use) so
# that header overhead does not hide what the scheduler does.
"$testbed" destroy "$TB_NAME" >/dev/null
r2_create_testbed --hosts 2 --nics 4 --rate "$RATE" --mtu 9000
for h in 0 1; do "$testbed" degrade "$TB_NAME" "$h" eth2 25mbit; done
run_pair quarter 29503
quarter=$(busbw_mbps "$work/quarter.json")
sum_rates=40.625 # 3 x 100 Mbit/s + 25 Mbit/s, in MB/s
share=$(awk -v a="$quarter" -v b="$sum_rates" 'BEGIN { printf "%.1f", 100 * a / b }')
weight=$(sed -n '/"nic": "eth2"/,/}/s/^ *"weight": *\([0-9.eE+-]*\),\{0,1\}$/\1/p' "$work/quarter.json" | head -n 1)
qverdict=$(awk -v s="$share" 'BEGIN { print (s >= 90) ? "PASS" : "FAIL" }')

echo
echo "| rails | busbw (MB/s) | vs one rail |"
echo "|---|---:|---:|"
echo "| 1 (eth1) | $one | 1.00x |"
echo "| 4 (eth1..eth4) | $four | ${ratio}x |"
echo "| 4, eth2 at 25 Mbit/s (MTU 9000) | $quarter | ${share}% of the summed link rates; eth2 weight ${weight:-?} |"
echo
echo "four rails >= ${TARGET}x one rail: $verdict (${ratio}x)"
echo "one NIC at a quarter rate: >= 90% of the summed link rates: $qverdict (${share}%)"
[[ $verdict == PASS && $qverdict == PASS ]]
