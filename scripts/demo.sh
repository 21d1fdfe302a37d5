#!/usr/bin/env bash
# r2ccl demo: a NIC dies under load and nothing is lost.
#
#   scripts/demo.sh BUILD_DIR [--plot PNG]       (normally through `scripts/run demo`)
#
# With root and a working netns testbed it builds testbed "demo" (2 hosts x 4 NICs, every rail
# shaped to 200mbit), runs rank 0 on host 0 and rank 1 on host 1 exchanging 16 MiB messages both
# ways for RUN_S seconds, every byte verified, takes eth2 of host 0 down from outside the
# processes at FAULT_S and brings it back at RESTORE_S. Then it reports, from the ranks' rail
# events and per-rail counters (scripts/demo_report.py): the per-rail traffic before, during and
# after the outage, when the failure was detected and what in-flight data was replayed on which
# rails, when the rail was re-admitted, and whether every byte was verified.
# Otherwise (not root, no namespaces) it says why and runs the same two ranks on loopback, each
# with four 127.0.0.x rails, for 10 s, without the fault. Exit status: 0 when both ranks verified every byte.
# --plot PNG: also draws the rails over time to PNG (per-rail throughput, rail states and events,
# the outage; needs python3-matplotlib for /usr/bin/python3) and keeps the records it is drawn
# from as PNG with .json (bench/failover_plot.py --data JSON draws them again).
set -euo pipefail

RUN_S=32 # 10 on loopback, where nothing is taken down
readonly FAULT_S=10
readonly RESTORE_S=20
readonly TB_NAME=demo
readonly RATE=200mbit
readonly FAULT_NIC=eth2

usage() { echo "usage: scripts/demo.sh BUILD_DIR [--plot PNG]" >&2; exit 2; }
[[ $# -ge 1 ]] || usage
build=$1
shift
plot=()
while [[ $# -gt 0 ]]; do
  case $1 in
    --plot) [[ $# -ge 2 ]] || usage; plot=(--plot "$2"); shift 2 ;;
    *) usage ;;
  esac
done
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
testbed=$root/tests/testbed/testbed
perf=$build/bin/r2ccl-perf
[[ -x $perf ]] || { echo "demo: $perf not found (build first: scripts/run build)" >&2; exit 2; }
python=python3
if [[ ${#plot[@]} -gt 0 ]]; then
  # The picture needs matplotlib: Debian's Python with python3-matplotlib (as scripts/run simplots).
  python=/usr/bin/python3
  "$python" -c 'import matplotlib' 2>/dev/null ||
    { echo "demo: --plot needs matplotlib for $python (Debian package python3-matplotlib)" >&2; exit 2; }
fi
command -v "$python" >/dev/null || { echo "demo: $python not found (Debian package python3)" >&2; exit 2; }

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

[[ $mode == testbed ]] || RUN_S=10
RANK_TIMEOUT=$((RUN_S + 90)) # hard wall-clock limit per rank (s)
args=(sendrecv -b 16M -e 16M -w 1 -c 1 --duration "$RUN_S")
shown="r2ccl-perf ${args[*]} --events E --rail-samples S --json J"
args+=(--events "$work/events" --rail-samples "$work/samples" --json "$work/result.json")
echo "r2ccl demo: two ranks exchange 16 MiB messages both ways for ${RUN_S} s, every byte of every round verified."
echo "r2ccl demo: each rank has four rails; r2ccl stripes every message over all of them in 512 KiB chunks."
if [[ $mode == testbed ]]; then
  echo "r2ccl demo: network: 2 hosts (network namespaces) x 4 NICs eth1..eth4, each shaped to $RATE."
  echo "r2ccl demo: at ${FAULT_S} s, $FAULT_NIC of host 0 is taken down from outside the processes; at ${RESTORE_S} s it comes back."
  r2_create_testbed --hosts 2 --nics 4 --rate "$RATE" >/dev/null
  boot=198.19.0.1:29500
  cmd0=("$testbed" exec "$TB_NAME" 0 -- env R2CCL_RANK=0 R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=$boot")
  cmd1=("$testbed" exec "$TB_NAME" 1 -- env R2CCL_RANK=1 R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=$boot")
else
  echo "r2ccl demo: no testbed ($why); running on loopback instead, without taking a NIC down"
  echo "r2ccl demo: (that needs root: run scripts/run demo as root to see the failover)."
  echo "r2ccl demo: network: loopback, rank 0 rails 127.0.0.11-14, rank 1 rails 127.0.0.21-24 (not shaped)."
  port=$(r2_free_port)
  boot=127.0.0.1:$port
  cmd0=(env R2CCL_RANK=0 R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=$boot" "R2CCL_NICS=127.0.0.11,127.0.0.12,127.0.0.13,127.0.0.14")
  cmd1=(env R2CCL_RANK=1 R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=$boot" "R2CCL_NICS=127.0.0.21,127.0.0.22,127.0.0.23,127.0.0.24")
fi
echo "r2ccl demo: command, on each host: $shown"
echo

common=(R2CCL_BOOTSTRAP_TIMEOUT=30s R2CCL_TIMEOUT=60s)
cmd0+=("${common[@]}" "$perf" "${args[@]}")
cmd1+=("${common[@]}" "$perf" "${args[@]}")

now_ns() { date +%s%N; }
# link_bytes NS DEV: bytes received plus sent so far by DEV in namespace NS.
link_bytes() {
  ip -n "$1" -s link show dev "$2" 2>/dev/null |
    awk '/RX:|TX:/ { getline; n += $1 } END { print n + 0 }'
}
# wait_busy NS DEV: returns once DEV carries data (32 KiB within 10 ms), so that the fault hits
# chunks in flight rather than a pause between rounds; gives up after 500 tries (about 5 s).
wait_busy() {
  local prev cur i
  prev=$(link_bytes "$1" "$2")
  for ((i = 0; i < 500; i++)); do
    sleep 0.01
    cur=$(link_bytes "$1" "$2")
    ((cur - prev >= 32768)) && return 0
    prev=$cur
  done
}
# The fault, from outside the processes, timed against the launch; its times go to $work/faults.
inject_faults() {
  sleep "$FAULT_S"
  wait_busy "$TB_NAME-h0" "$FAULT_NIC"
  echo "down $(now_ns) $FAULT_NIC" >>"$work/faults"
  ip -n "$TB_NAME-h0" link set dev "$FAULT_NIC" down
  sleep $((RESTORE_S - FAULT_S))
  echo "up $(now_ns) $FAULT_NIC" >>"$work/faults"
  "$testbed" up "$TB_NAME" 0 "$FAULT_NIC"
}

echo "start $(now_ns)" >"$work/faults"
injector=
if [[ $mode == testbed ]]; then
  inject_faults &
  injector=$!
fi
rc=0
r2_run_pair demo || rc=$?
if [[ -n $injector ]]; then
  wait "$injector" || { echo "r2ccl demo: taking $FAULT_NIC down or up again FAILED" >&2; rc=1; }
fi
((rc == 0)) || { echo "r2ccl demo: FAILED" >&2; exit 1; }
if [[ ${#plot[@]} -gt 0 ]]; then
  # What was run, kept beside the picture's records (the command without its output paths).
  about="scripts/demo.sh on loopback ($why), no fault"
  [[ $mode == testbed ]] && about="scripts/demo.sh: 2 hosts x 4 NICs (netns testbed, every rail \
shaped to $RATE); $FAULT_NIC of host 0 down ${FAULT_S} s after the launch, up at ${RESTORE_S} s"
  plot+=(--about "$about; each rank: r2ccl-perf ${args[*]:0:11}")
fi
"$python" "$root/scripts/demo_report.py" --faults "$work/faults" --events "$work/events" \
  --samples "$work/samples" --result "$work/result.json" --output "$work/demo.0.out" "${plot[@]}"
