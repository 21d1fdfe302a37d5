#!/usr/bin/env bash
# bench/collectives.sh: r2ccl's all-reduce side by side with Open MPI's MPI_Allreduce and Gloo
# (torch.distributed) in one run, on the same hosts and sizes, as one table with ratios.
#
#   bench/collectives.sh BUILD_DIR [testbed|loopback|both]   (default both)
#
# testbed:  2 hosts x 4 NICs, every rail shaped to 100mbit; one rank per host. r2ccl stripes over
#           the four rails; Open MPI gets the same four interfaces (its TCP BTL stripes large
#           messages over them); Gloo gets them as GLOO_SOCKET_IFNAME (one device per interface,
#           used in turn by successive collectives).
# loopback: 2 ranks on 127.0.0.1, one interface for everyone.
# Every implementation runs float32 sum, out of place, -b 8 -e 4M -f 2 -n 50 -w 5 (fewer timed
# iterations leave microsecond latencies to chance), and checks every element
# once per size (-c 1). Before the first size each runs 5000 untimed 8-byte all-reduces (-W 5000):
# time for the scheduler to put the two processes on separate cores (Open MPI's start-up gave it
# that time; without it r2ccl's small sizes often ran with both ranks on one core, at twice the
# time; 1000 were not always enough). The implementations take turns, R2CCL_BENCH_ROUNDS times (default 5):
# each figure in the table is the median of its runs, so that a slow spell of the shared machine
# does not decide a comparison. Targets (issue "collectives"): at >= 1 MiB r2ccl's bus bandwidth >= 1.2x
# the better baseline; from 8 B to 64 KiB r2ccl's time <= the better baseline's.
# Exit status: 0 every target PASS, 1 a target FAILed or a run failed, 2 usage, 77 no testbed.
set -euo pipefail

readonly TB_NAME=collbench
readonly RANK_TIMEOUT=600
readonly SIZES=(-b 8 -e 4M -f 2 -n 50 -w 5 -W 5000 -c 1)
readonly ROUNDS=${R2CCL_BENCH_ROUNDS:-5}
[[ $ROUNDS =~ ^[1-9][0-9]*$ ]] ||
  { echo "bench: R2CCL_BENCH_ROUNDS='$ROUNDS': expected a whole number of rounds >= 1" >&2; exit 2; }

[[ $# -ge 1 ]] || { echo "usage: bench/collectives.sh BUILD_DIR [testbed|loopback|both]" >&2; exit 2; }
build=$1
which=${2:-both}
[[ $which == testbed || $which == loopback || $which == both ]] ||
  { echo "bench: unknown setup '$which': expected testbed, loopback or both" >&2; exit 2; }
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
testbed=$root/tests/testbed/testbed
perf=$build/bin/r2ccl-perf
[[ -x $perf ]] || { echo "bench: $perf not found (build first: scripts/run build)" >&2; exit 2; }
/usr/bin/python3 -c 'import torch.distributed' 2>/dev/null ||
  { echo "bench: needs Debian's python3-torch (Gloo) and openmpi-bin, libopenmpi-dev" >&2; exit 77; }

NAME=bench
# shellcheck source=scripts/lib.sh
source "$root/scripts/lib.sh"
r2_init coll

# r2ccl on the testbed (round R): rank h on host h, the rails chosen by default (every NIC but
# eth0).
r2ccl_testbed() {
  local round=$1 port
  port=$(r2_free_port)
  local env=(R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=198.19.0.1:$port")
  cmd0=("$testbed" exec "$TB_NAME" 0 -- env R2CCL_RANK=0 "${env[@]}" "$perf" allreduce "${SIZES[@]}"
    --json "$work/r2ccl-testbed.$round.json")
  cmd1=("$testbed" exec "$TB_NAME" 1 -- env R2CCL_RANK=1 "${env[@]}" "$perf" allreduce "${SIZES[@]}")
  r2_run_pair "r2ccl-testbed.$round"
}

r2ccl_loopback() {
  local round=$1 port
  port=$(r2_free_port)
  local env=(R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=127.0.0.1:$port" R2CCL_NICS=127.0.0.1)
  cmd0=(env R2CCL_RANK=0 "${env[@]}" "$perf" allreduce "${SIZES[@]}"
    --json "$work/r2ccl-loopback.$round.json")
  cmd1=(env R2CCL_RANK=1 "${env[@]}" "$perf" allreduce "${SIZES[@]}")
  r2_run_pair "r2ccl-loopback.$round"
}

# The baselines of round R (bench/baseline.sh prints one JSON line per implementation and size).
baselines() {
  local net=$1 round=$2
  shift 2
  timeout "$RANK_TIMEOUT" "$root/bench/baseline.sh" --net "$net" "$@" -- "${SIZES[@]}" \
    >"$work/baseline-$net.$round.jsonl" 2>"$work/baseline-$net.$round.err" || {
    echo "bench: the $net baselines failed (round $round):" >&2
    cat "$work/baseline-$net.$round.err" >&2
    return 1
  }
}

# table NET: the side-by-side table of one setup and its targets; returns 1 if a target failed.
table() {
  /usr/bin/python3 - "$work" "$1" "$ROUNDS" <<'PY'
import glob, json, statistics, sys
work, net, rounds = sys.argv[1], sys.argv[2], int(sys.argv[3])
runs = {}  # (bytes, impl) -> [(time_us, busbw_gbps)], one per round
for path in sorted(glob.glob(f"{work}/r2ccl-{net}.*.json")):
    for r in json.load(open(path))["results"]:
        runs.setdefault((r["bytes"], "r2ccl"), []).append((r["time_us"], r["busbw_gbps"]))
for path in sorted(glob.glob(f"{work}/baseline-{net}.*.jsonl")):
    for line in open(path):
        j = json.loads(line)
        runs.setdefault((j["bytes"], j["impl"]), []).append((j["time_us"], j["busbw_gbps"]))
rows = {}
for (b, impl), v in runs.items():  # the median run of each (bandwidth follows from time)
    rows.setdefault(b, {})[impl] = (statistics.median(t for t, _ in v),
                                    statistics.median(bw for _, bw in v))
impls = ["openmpi", "gloo"]
def size(b):
    for unit, n in (("MiB", 1 << 20), ("KiB", 1 << 10)):
        if b >= n and b % n == 0:
            return f"{b // n} {unit}"
    return f"{b} B"
print(f"\n{net}: all-reduce float32 sum, 2 ranks; time per operation (us) and bus bandwidth (MB/s),"
      f" the median of {rounds} runs each, taken in turns\n")
print("| size | r2ccl us | Open MPI us | Gloo us | r2ccl MB/s | Open MPI MB/s | Gloo MB/s |"
      " busbw vs better | time vs better |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
ok = True
for b in sorted(rows):
    r = rows[b]
    if "r2ccl" not in r or not all(i in r for i in impls):
        continue
    t, bw = r["r2ccl"]
    best_bw = max(r[i][1] for i in impls)
    best_t = min(r[i][0] for i in impls)
    bw_ratio = bw / best_bw if best_bw > 0 else float("inf")
    t_ratio = best_t / t if t > 0 else float("inf")  # > 1: r2ccl is faster
    mark = ""
    if b >= 1 << 20:
        mark = " PASS" if bw_ratio >= 1.2 else " FAIL"
        ok &= bw_ratio >= 1.2
    tmark = ""
    if b <= 64 << 10:
        tmark = " PASS" if t <= best_t else " FAIL"
        ok &= t <= best_t
    print(f"| {size(b)} | {t:.1f} | {r['openmpi'][0]:.1f} | {r['gloo'][0]:.1f} | {bw * 1e3:.2f} | "
          f"{r['openmpi'][1] * 1e3:.2f} | {r['gloo'][1] * 1e3:.2f} | {bw_ratio:.2f}x{mark} | "
          f"{t_ratio:.2f}x{tmark} |")
print("\nbusbw vs better: r2ccl / the better baseline (target >= 1.2x at >= 1 MiB); time vs better:"
      " the better baseline's time / r2ccl's (target >= 1x from 8 B to 64 KiB).")
sys.exit(0 if ok else 1)
PY
}

status=0
if [[ $which == testbed || $which == both ]]; then
  r2_require_testbed
  r2_create_testbed --hosts 2 --nics 4 --rate 100mbit
  echo "bench: testbed '$TB_NAME': 2 hosts x 4 NICs at 100mbit" >&2
  for ((round = 1; round <= ROUNDS && status == 0; round++)); do
    r2ccl_testbed "$round" || status=1
    baselines testbed "$round" --testbed "$TB_NAME" --nics 4 || status=1
  done
  [[ $status -ne 0 ]] || table testbed || status=1
fi
if [[ $which == loopback || $which == both ]]; then
  lstatus=0
  for ((round = 1; round <= ROUNDS && lstatus == 0; round++)); do
    r2ccl_loopback "$round" || lstatus=1
    baselines loopback "$round" || lstatus=1
  done
  [[ $lstatus -ne 0 ]] || table loopback || lstatus=1
  ((lstatus == 0)) || status=1
fi
exit "$status"
