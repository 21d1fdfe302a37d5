#!/usr/bin/env bash
# bench/failover.sh: how fast does r2ccl detect a failed rail and move its data elsewhere?
#
#   bench/failover.sh BUILD_DIR          (FAILOVER_TRIALS=N for more trials per kind; default 24)
#
# Builds a netns testbed of 2 hosts x 4 NICs (every rail shaped to 100mbit, so that transfers
# are long and chunks are always in flight), then runs one long verified r2ccl-perf sendrecv
# (16 MiB rounds, -c 1, --events) per fault kind:
#   link down   `ip -n NS link set ethN down`, restored with `testbed up` ~1 s later;
#   black hole  the nftables drop rules of `testbed blackhole`, added directly to the
#               pre-created table (one `nft -f`), restored with `testbed heal` ~1 s later.
# Faults rotate over eth1..eth4 of host 0, one every ~2.5 s; the injection time is taken with
# `date +%s%N` immediately before the action (no testbed start-up in the figure).  With
# R2CCL_HOLDDOWN=200ms / R2CCL_HOLDDOWN_MAX=1s a rail is back ~1.5 s after its restore, well
# before its next fault four trials later.  Events are only written when a run ends, so the
# trials are matched to them afterwards, by NIC and time window:
#   detection  first "failed" event for that NIC on either rank, minus the injection time;
#   recovery   first "replay_reconciled" (the peer said which of the rail's unconfirmed chunks
#              it lacks, and those went to the surviving rails), else "replay_started" (only
#              control messages to resend), else, if the rail had nothing in flight, "failed";
#   confirmed  first "first_replay_confirmed" (a replayed chunk confirmed on another rail),
#              else the recovery time (nothing needed replaying).
# Prints a Markdown table (p50/p99 in ms, nearest rank) and the targets:
#   link down: traffic on other rails within 50 ms (p99 recovery);
#   black hole: detected within 300 ms (p99 detection).
# Every run must also exit 0 with rank 0's "# Check: every byte verified on every rank".
# Exit status: 0 PASS, 1 FAIL (or a run failed), 2 usage, 77 no testbed here.
set -euo pipefail

readonly TB_NAME=failover
readonly RATE=100mbit
readonly PERIOD_MS=2500   # one fault every 2.5 s
readonly RESTORE_MS=1000  # restore the NIC this long after the fault
readonly LEAD_MS=3000     # first fault this long after the launch (start-up, first rounds)
readonly TAIL_S=3         # the run goes on this long after the last trial's slot
readonly DETECT_TARGET_MS=300
readonly RECOVER_TARGET_MS=50
readonly NFT_TABLE=r2t    # the table `testbed blackhole` / `testbed heal` use
readonly CHECK_LINE="# Check: every byte verified on every rank"

[[ $# -ge 1 ]] || { echo "usage: bench/failover.sh BUILD_DIR" >&2; exit 2; }
build=$1
trials=${FAILOVER_TRIALS:-24}
if ! [[ $trials =~ ^[0-9]{1,3}$ ]] || ((10#$trials < 20)); then
  echo "failover: FAILOVER_TRIALS must be 20..999 (got '$trials')" >&2
  exit 2
fi
trials=$((10#$trials))
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
testbed=$root/tests/testbed/testbed
perf=$build/bin/r2ccl-perf
[[ -x $perf ]] || { echo "failover: $perf not found (build first: scripts/run build)" >&2; exit 2; }
command -v python3 >/dev/null 2>&1 || { echo "failover: python3 not found" >&2; exit 2; }

NAME=failover
duration_s=$(((LEAD_MS + trials * PERIOD_MS) / 1000 + TAIL_S))
RANK_TIMEOUT=$((duration_s + 90)) # hard wall-clock limit per rank (s)
# shellcheck source=scripts/lib.sh
source "$root/scripts/lib.sh"
r2_require_testbed
r2_init failover

ns0=$TB_NAME-h0 # host 0's namespace (testbed layout)

now_ns() { date +%s%N; }

# sleep_until T0_NS OFFSET_MS: sleeps until OFFSET_MS after T0_NS (at most OFFSET_MS).
sleep_until() {
  local left
  left=$((($1 + $2 * 1000000 - $(now_ns)) / 1000000))
  ((left > 0)) || return 0
  ((left <= $2)) || left=$2
  sleep "$(printf '%d.%03d' $((left / 1000)) $((left % 1000)))"
}

# inject KIND DEV: the fault itself; prints the wall time (ns) taken just before it.
inject() {
  local t
  case $1 in
    linkdown)
      t=$(now_ns)
      ip -n "$ns0" link set "$2" down
      ;;
    blackhole)
      t=$(now_ns)
      ip netns exec "$ns0" nft -f - <<EOF
add rule inet $NFT_TABLE ingress iifname "$2" counter drop comment "r2t:$2"
add rule inet $NFT_TABLE egress oifname "$2" counter drop comment "r2t:$2"
EOF
      ;;
  esac
  echo "$t"
}

restore() {
  case $1 in
    linkdown) "$testbed" up "$TB_NAME" 0 "$2" ;;
    blackhole) "$testbed" heal "$TB_NAME" 0 "$2" ;;
  esac
}

# run_kind KIND PORT: one long run with a fault every PERIOD_MS; writes $work/KIND.trials
# ("NS_TIME NIC" per trial) and the ranks' events to $work/KIND.ev.rank{0,1}.
run_kind() {
  local kind=$1 port=$2 pair t0 i dev ok=0
  local env=(R2CCL_NRANKS=2 "R2CCL_BOOTSTRAP=198.19.0.1:$port" R2CCL_BOOTSTRAP_TIMEOUT=30s
    R2CCL_HOLDDOWN=200ms R2CCL_HOLDDOWN_MAX=1s)
  local args=(sendrecv -b 16M -e 16M -w 0 -c 1 --duration "$duration_s" --events "$work/$kind.ev")
  cmd0=("$testbed" exec "$TB_NAME" 0 -- env R2CCL_RANK=0 "${env[@]}" "$perf" "${args[@]}")
  cmd1=("$testbed" exec "$TB_NAME" 1 -- env R2CCL_RANK=1 "${env[@]}" "$perf" "${args[@]}")
  : >"$work/$kind.trials"
  t0=$(now_ns)
  r2_run_pair "$kind" &
  pair=$!
  for ((i = 0; i < trials; i++)); do
    dev=eth$((i % 4 + 1))
    sleep_until "$t0" $((LEAD_MS + i * PERIOD_MS))
    kill -0 "$pair" 2>/dev/null || break # the run ended early: it failed
    echo "$(inject "$kind" "$dev") $dev" >>"$work/$kind.trials"
    sleep_until "$t0" $((LEAD_MS + i * PERIOD_MS + RESTORE_MS))
    restore "$kind" "$dev"
  done
  wait "$pair" || ok=1
  if ((ok == 0)) && ! grep -qxF "$CHECK_LINE" "$work/$kind.0.out"; then
    echo "$NAME: the $kind run did not print '$CHECK_LINE'" >&2
    cat "$work/$kind.0.out" >&2
    ok=1
  fi
  return "$ok"
}

echo "failover: testbed '$TB_NAME': 2 hosts x 4 NICs at $RATE; r2ccl-perf sendrecv 16M -c 1 for ${duration_s}s per kind;"
echo "failover: $trials faults per kind on host 0, rotating eth1..eth4, one every ${PERIOD_MS} ms, restored after ${RESTORE_MS} ms"
r2_create_testbed --hosts 2 --nics 4 --rate "$RATE"
# The black-hole table and chains exist beforehand, so a fault is only the two rules.
ip netns exec "$ns0" nft -f - <<EOF
add table inet $NFT_TABLE
add chain inet $NFT_TABLE ingress { type filter hook prerouting priority -300; policy accept; }
add chain inet $NFT_TABLE egress { type filter hook postrouting priority -300; policy accept; }
EOF

runs_ok=1
run_kind linkdown 29521 || runs_ok=0
run_kind blackhole 29522 || runs_ok=0

python3 - "$work" "$runs_ok" "$PERIOD_MS" "$DETECT_TARGET_MS" "$RECOVER_TARGET_MS" <<'EOF'
import json, math, os, sys

work, runs_ok, period_ms, detect_target, recover_target = sys.argv[1], sys.argv[2] == "1", *map(int, sys.argv[3:])


def load(kind):
    events = []
    for r in (0, 1):
        path = os.path.join(work, f"{kind}.ev.rank{r}")
        if os.path.exists(path):
            with open(path) as f:
                events += [e for e in map(json.loads, filter(str.strip, f)) if e["kind"] != "final"]
    trials = []
    with open(os.path.join(work, f"{kind}.trials")) as f:
        for line in f:
            t, nic = line.split()
            trials.append((int(t), nic))
    return trials, events


def pct(values, p):
    if not values:
        return float("nan")
    v = sorted(values)
    return v[max(0, math.ceil(p / 100 * len(v)) - 1)]


rows, verdicts, notes = [], [], []
for kind, label in (("linkdown", "link down"), ("blackhole", "black hole")):
    trials, events = load(kind)
    det, rec, conf = [], [], []
    missed = replays = readmitted = 0
    for i, (t, nic) in enumerate(trials):
        end = trials[i + 1][0] if i + 1 < len(trials) else t + period_ms * 1_000_000

        def first(k):
            ts = [e["wall_ns"] for e in events if e["nic"] == nic and e["kind"] == k and t <= e["wall_ns"] < end]
            return min(ts) if ts else None

        failed = first("failed")
        if failed is None:
            missed += 1
            continue
        started, confirmed = first("replay_started"), first("first_replay_confirmed")
        reconciled = first("replay_reconciled")
        replays += started is not None
        readmitted += first("readmitted") is not None
        recovered = next(x for x in (reconciled, started, failed) if x is not None)
        det.append((failed - t) / 1e6)
        rec.append((recovered - t) / 1e6)
        conf.append(((confirmed if confirmed is not None else recovered) - t) / 1e6)
    n = len(trials)
    rows.append(f"| {label} | {n} | {pct(det, 50):.1f} | {pct(det, 99):.1f} | {pct(rec, 50):.1f} | "
                f"{pct(rec, 99):.1f} | {pct(conf, 50):.1f} | {pct(conf, 99):.1f} |")
    notes.append(f"{label}: {n} trials, {n - missed} detected, {replays} with chunks to replay, "
                 f"{readmitted} re-admitted before the next fault")
    ok = missed == 0 and n >= 20
    if kind == "linkdown":
        ok = ok and pct(rec, 99) <= recover_target
        verdicts.append(("link down: traffic on other rails <= %d ms (p99 recovery)" % recover_target, ok,
                         pct(rec, 99)))
    else:
        ok = ok and pct(det, 99) <= detect_target
        verdicts.append(("black hole detected <= %d ms (p99 detection)" % detect_target, ok, pct(det, 99)))

print()
print("| fault | trials | detection p50 | p99 | recovery (replay started) p50 | p99 | replayed data confirmed p50 | p99 |")
print("|---|---:|---:|---:|---:|---:|---:|---:|")
print("\n".join(rows))
print("\n(ms after the injection)")
for line in notes:
    print(f"  {line}")
print()
all_ok = runs_ok
for what, ok, value in verdicts:
    print(f"target: {what}: {'PASS' if ok else 'FAIL'} ({value:.1f} ms)")
    all_ok = all_ok and ok
print(f"every run exited 0 with every byte verified: {'PASS' if runs_ok else 'FAIL'}")
sys.exit(0 if all_ok else 1)
EOF
