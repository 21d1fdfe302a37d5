#!/usr/bin/env bash
# bench/kv.sh: KV-cache transfers over one and four rails, and with a NIC lost mid-transfer.
#
#   bench/kv.sh BUILD_DIR
#
# Builds a netns testbed of 2 hosts x 4 NICs with every rail shaped to 100mbit (aggregate link
# rate 4 x 12.5 MB/s = 50 MB/s), then runs the same r2ccl-kvbench push workload (prefill rank 0 on
# host 0, decode rank 1 on host 1, every block verified) three times in this one run:
#   one   R2CCL_NICS=eth1
#   four  all four rails
#   down  all four rails, eth2 of host 0 taken down at ~40% of the four-rail run's duration
# Prints a Markdown table and three targets:
#   - four rails goodput >= 90% of the aggregate link rate;
#   - NIC down: every request DONE and every block verified;
#   - NIC down p99 <= 4/3 x healthy p99 + failover time. Losing one rail of four leaves 3/4 of
#     the bandwidth (hence 4/3); the failover time is the time from the fault until the fabric
#     fenced eth2 (both on CLOCK_MONOTONIC: the fault command's timestamp and rank 0's log line)
#     plus the time to resend the fenced chunks at three rails' link rate (computed).
# p99 over 12 requests is the slowest request. Goodput counts KV bytes only (TCP/IP headers and
# the start and end of the run, when fewer requests are in flight, count against it).
# Exit status: 0 every target PASS, 1 a target FAILed (or a run failed), 2 usage, 77 no testbed.
set -euo pipefail

readonly TB_NAME=kvbench
readonly RATE=100mbit
readonly LINK_MBPS=12.5    # one rail at 100mbit, MB/s
readonly RAILS=4
readonly GOODPUT_TARGET=90 # % of the aggregate link rate
readonly FAULT_FRACTION=0.4
readonly RANK_TIMEOUT=180  # hard wall-clock limit per rank (s); one rail needs ~50 s
readonly ARGS=(--model llama3-8b --requests 12 --min-tokens 256 --max-tokens 512 --concurrency 4)

[[ $# -ge 1 ]] || { echo "usage: bench/kv.sh BUILD_DIR" >&2; exit 2; }
build=$1
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
testbed=$root/tests/testbed/testbed
kvbench=$build/bin/r2ccl-kvbench
[[ -x $kvbench ]] || { echo "bench: $kvbench not found (build first: scripts/run build)" >&2; exit 2; }
command -v python3 >/dev/null || { echo "bench: needs python3 (reads the JSON results)" >&2; exit 2; }

NAME=bench
# shellcheck source=scripts/lib.sh
source "$root/scripts/lib.sh"
r2_require_testbed
r2_init kv

# run_pair TAG PORT [ENV...] [-- KVBENCH-ARGS...] -> rank 0 on host 0 (writes $work/TAG.json),
# rank 1 on host 1; returns 1 unless both exit 0.
run_pair() {
  local tag=$1 port=$2
  shift 2
  local env=(R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=198.19.0.1:$port" R2CCL_BOOTSTRAP_TIMEOUT=30s R2CCL_TIMEOUT=30s
    R2CCL_LOG=info)
  while [[ $# -gt 0 && $1 != -- ]]; do
    env+=("$1")
    shift
  done
  [[ $# -eq 0 ]] || shift
  cmd0=("$testbed" exec "$TB_NAME" 0 -- env R2CCL_RANK=0 "${env[@]}" "$kvbench" "${ARGS[@]}" "$@"
    --json "$work/$tag.json")
  cmd1=("$testbed" exec "$TB_NAME" 1 -- env R2CCL_RANK=1 "${env[@]}" "$kvbench" "${ARGS[@]}")
  r2_run_pair "$tag"
}

# field FILE EXPR -> a value from rank 0's JSON `j`, e.g. field f.json 'j["latency_ms"]["p99"]'.
field() {
  python3 -c 'import json, sys; j = json.load(open(sys.argv[1])); print(eval(sys.argv[2]))' "$1" "$2"
}

# calc EXPR [VAR=VALUE...] -> awk arithmetic, e.g. calc 'a / b' a=1 b=2.
calc() {
  local expr=$1 vars=()
  shift
  for v in "$@"; do vars+=(-v "$v"); done
  awk "${vars[@]}" "BEGIN { print ($expr) }"
}

# row TAG CASE -> the table row of one run; "-" everywhere if it wrote no JSON.
row() {
  local f=$work/$1.json
  if [[ ! -s $f ]]; then
    echo "| $2 | - | - | - | - | - | - | - |"
    return
  fi
  local g
  g=$(field "$f" 'j["goodput_gbps"] * 1000')
  printf '| %s | %.1f | %.1f%% | %.1f%% | %.0f / %.0f | %s / %s / %s | %s / %s |\n' "$2" "$g" \
    "$(calc 'g / agg * 100' "g=$g" "agg=$aggregate")" \
    "$(calc 'g / (l * r) * 100' "g=$g" "l=$LINK_MBPS" "r=$(field "$f" 'j["rails"]')")" \
    "$(field "$f" 'j["latency_ms"]["p50"]')" "$(field "$f" 'j["latency_ms"]["p99"]')" \
    "$(field "$f" 'j["done"]')" "$(field "$f" 'j["failed"]')" "$(field "$f" 'j["preserved"]')" \
    "$(field "$f" 'j["receiver_verified"]')" "$(field "$f" 'j["requests"]')"
}

aggregate=$(calc 'l * r' "l=$LINK_MBPS" "r=$RAILS")
echo "bench: testbed '$TB_NAME': 2 hosts x $RAILS NICs, every rail shaped to $RATE" \
  "(aggregate $aggregate MB/s); r2ccl-kvbench ${ARGS[*]}"
r2_create_testbed --hosts 2 --nics "$RAILS" --rate "$RATE"

run_pair one 29511 R2CCL_NICS=eth1
run_pair four 29512
for want in one:1 four:4; do
  got=$(field "$work/${want%%:*}.json" 'j["rails"]')
  if [[ $got != "${want#*:}" ]]; then
    echo "bench: the ${want%%:*}-rail run used '$got' rails, expected ${want#*:}" >&2
    exit 1
  fi
done

# The fault: at FAULT_FRACTION of the four-rail run's duration; the command notes the time
# (CLOCK_MONOTONIC, like r2ccl's log) just before the link goes down.
four_s=$(field "$work/four.json" 'j["seconds"]')
fault_at=$(calc 'sprintf("%.1f", f * s)' "f=$FAULT_FRACTION" "s=$four_s")
fault_cmd="python3 -c 'import time; print(\"%.6f\" % time.monotonic())' >$work/fault.t;"
fault_cmd+=" ip -n $TB_NAME-h0 link set eth2 down"
down_ok=1
run_pair down 29513 -- --fault "$fault_at:$fault_cmd" || down_ok=0

# Failover time: fault -> eth2 fenced (rank 0's log), + resending the fenced chunks on 3 rails.
failover_ms=
fenced=$(sed -n 's/^r2ccl\[rank 0 [^]]*\] \([0-9.]*\) [a-z]*: rail [0-9]* (eth2 -> [^)]*) to rank 1 is down: .*fenced epoch [0-9]*, \([0-9]*\) chunk(s) (\([0-9]*\) bytes) to replay.*$/\1 \2 \3/p' \
  "$work/down.0.err" | head -n 1)
if [[ -s $work/fault.t && -n $fenced ]]; then
  read -r fenced_t fenced_chunks fenced_bytes <<<"$fenced"
  detect_ms=$(calc 'sprintf("%.0f", (b - a) * 1000)' "a=$(cat "$work/fault.t")" "b=$fenced_t")
  replay_ms=$(calc 'sprintf("%.0f", b / (l * 1e6 * (r - 1)) * 1000)' "b=$fenced_bytes" \
    "l=$LINK_MBPS" "r=$RAILS")
  failover_ms=$((detect_ms + replay_ms))
fi

echo
echo "| case | goodput (MB/s) | vs aggregate link rate ($aggregate MB/s) | vs its rails' link rate |" \
  "p50 / p99 latency (ms) | DONE / FAILED / preserved | verified / requests |"
echo "|---|---:|---:|---:|---:|---:|---:|"
row one "one rail (eth1)"
row four "four rails"
row down "four rails, eth2 down at ${fault_at} s"
echo

verdict() { if [[ $1 == 1 ]]; then echo PASS; else echo FAIL; fi; }
status=0

four_pct=$(calc 'sprintf("%.1f", field / agg * 100)' "field=$(field "$work/four.json" 'j["goodput_gbps"] * 1000')" \
  "agg=$aggregate")
t1=$(calc "p >= $GOODPUT_TARGET ? 1 : 0" "p=$four_pct")
echo "four rails goodput >= ${GOODPUT_TARGET}% of the aggregate link rate: $(verdict "$t1") (${four_pct}%)"
((t1 == 1)) || status=1

t2=0
if ((down_ok == 1)) && [[ -s $work/down.json && -s $work/fault.t ]] &&
  [[ $(field "$work/down.json" 'j["done"] == j["requests"] and j["failed"] == 0 and j["receiver_verified"] == j["requests"]') == True ]]; then
  t2=1
fi
echo "NIC down: every request DONE and verified: $(verdict "$t2")"
((t2 == 1)) || status=1

healthy_p99=$(field "$work/four.json" 'j["latency_ms"]["p99"]')
if [[ -s $work/down.json && -n $failover_ms ]]; then
  down_p99=$(field "$work/down.json" 'j["latency_ms"]["p99"]')
  bound=$(calc 'sprintf("%.0f", h * 4 / 3 + f)' "h=$healthy_p99" "f=$failover_ms")
  t3=$(calc 'd <= b ? 1 : 0' "d=$down_p99" "b=$bound")
  echo "NIC down p99 <= 4/3 x healthy p99 + failover time: $(verdict "$t3")" \
    "($(calc 'sprintf("%.0f", d)' "d=$down_p99") ms <= 4/3 x $(calc 'sprintf("%.0f", h)' "h=$healthy_p99")" \
    "+ $failover_ms = $bound ms; NIC down p99 / healthy p99 = $(calc 'sprintf("%.2f", d / h)' "d=$down_p99" \
      "h=$healthy_p99"))"
  echo "  failover time $failover_ms ms = fault -> eth2 fenced $detect_ms ms (measured) + resending" \
    "$fenced_chunks fenced chunk(s), $fenced_bytes bytes, on $((RAILS - 1)) rails $replay_ms ms (computed)"
else
  t3=0
  echo "NIC down p99 <= 4/3 x healthy p99 + failover time: FAIL (no result, or the fault/fence times are missing)"
fi
((t3 == 1)) || status=1
exit "$status"
