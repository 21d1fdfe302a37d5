#!/usr/bin/python3
"""bench/degraded.py: degraded-mode all-reduce on the testbed beside r2ccl-sim's prediction.


    bench/degraded.py BUILD_DIR [--bytes 16M] [--iters 5] [--quick]     (root; /usr/bin/python3)

The netns testbed of 4 hosts x 4 NICs, every link shaped to 100 Mbit/s, one r2ccl-perf rank per
host. Settings: no fault; host 1 with 1, 2 or 3 NICs down (`ip link set down` before the job);
host 1 with all four NICs shaped to 50 Mbit/s. In each, an int32 sum all-reduce of --bytes runs
with every plan forced (R2CCL_ALGO=balance, r2cc, weighted) and with the automatic choice
(R2CCL_ALGO=auto), every byte checked (-c 1) on every rank.

r2ccl-sim predicts each time for the same setting: a NIC's rate and a message's latency are
calibrated once, from the fault-free run's ring (its measured time) and the ranks' agreed latency;
nothing else is fitted. Then, for every plan, the job runs again while host 2 loses eth2 in the
middle of it, and must still finish with every byte right.

Prints a Markdown table (measured, predicted, ratio; the automatic choice and the fastest plan)
and PASS when every run finished verified, every measured time is within 10% of its prediction,
and the automatic choice was the fastest plan (or within 5% of it) in every setting.
Exit status: 0 PASS, 1 FAIL, 2 usage, 77 no testbed here.
"""
import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "system"))

HOSTS, NICS = 4, 4
RATE_MBIT = 100
PLANS = ("balance", "r2cc", "weighted")
FAULTED_HOST = 1


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("build", help="build directory (its bin/ has r2ccl-perf and r2ccl-sim)")
    ap.add_argument("--bytes", default="16M", help="all-reduce size per rank (default 16M)")
    ap.add_argument("--iters", type=int, default=5, help="timed iterations (default 5)")
    ap.add_argument("--quick", action="store_true",
                    help="only the 2-NICs-down setting and no fault-during-run check")
    a = ap.parse_args()
    size = parse_size(a.bytes)
    bindir = Path(a.build).resolve() / "bin"
    os.environ["R2CCL_TEST_BIN"] = str(bindir)
    import r2ccl_testbed as t  # after R2CCL_TEST_BIN is set

    if os.geteuid() != 0:
        print("degraded: needs root (network namespaces)", file=sys.stderr)
        return 77
    work = Path(tempfile.mkdtemp(prefix="r2ccl-degraded-"))
    settings = [("no fault", 0, False), ("host 1: 1 NIC down", 1, False),
                ("host 1: 2 NICs down", 2, False), ("host 1: 3 NICs down", 3, False),
                ("host 1: every NIC at half", 0, True)]
    if a.quick:
        settings = [settings[0], settings[2]]
    problems, rows = [], []
    runs = 0

    def job(tb, plan: str, tag: str, faults=()):
        nonlocal runs
        runs += 1
        args = ["allreduce", "-d", "int32", "-b", str(size), "-e", str(size), "-n", str(a.iters),
                "-w", "1", "-c", "1"]
        rep, _, wrong = t.perf_job(tb, HOSTS, args, str(work / f"{tag}.json"),
                                   extra_env={"R2CCL_ALGO": plan}, faults=faults)
        if wrong:
            problems.append(f"{tag}: {wrong}")
        return rep

    def sim(nic_gbps: float, latency_us: float, lost: int, shaped: bool, plan: str,
            plan_from: str) -> float:
        argv = [str(bindir / "r2ccl-sim"), "-n", str(HOSTS), "--nics", str(NICS), "--nic-gbps",
                f"{nic_gbps:.6f}", "--latency-us", f"{latency_us:.3f}", "-b", str(size), "-d",
                "f32", "-a", plan, "--plan-from", plan_from, "--failed", str(FAULTED_HOST)]
        argv += ["--shaped", "-x", "0.5"] if shaped else ["--lost-nics", str(lost)]
        out = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=True).stdout
        row = [line for line in out.splitlines() if line.startswith(f"| {plan} |")]
        return float(row[0].split("|")[2])

    calibration = None
    for name, lost, shaped in settings:
        with t.Testbed(hosts=HOSTS, nics=NICS, rate=f"{RATE_MBIT}mbit") as tb:
            for k in range(lost):
                tb.tb("down", str(FAULTED_HOST), f"eth{NICS - k}")
            if shaped:
                for k in range(1, NICS + 1):
                    tb.tb("degrade", str(FAULTED_HOST), f"eth{k}", f"{RATE_MBIT // 2}mbit")
            measured = {}
            agreed = None
            for plan in PLANS + ("auto",):
                rep = job(tb, plan, f"{name.replace(' ', '_').replace(':', '')}-{plan}")
                if rep is None:
                    continue
                measured[plan] = (rep["results"][-1]["time_us"] * 1e-6, rep["results"][-1]["algo"],
                                  str(work / f"{name.replace(' ', '_').replace(':', '')}-{plan}.json"))
                agreed = rep.get("agreed", agreed)
            if calibration is None:
                if "balance" not in measured or agreed is None:
                    problems.append("the fault-free run gave nothing to calibrate on")
                    break
                # The ring moves 2(p-1)/p of the message through each rank's NICs.
                ring_s = measured["balance"][0]
                latency_us = agreed["latency_s"] * 1e6
                per_rank = 2 * (HOSTS - 1) / HOSTS * size / max(
                    ring_s - 2 * (HOSTS - 1) * latency_us * 1e-6, 1e-9)
                calibration = (per_rank / NICS * 8 / 1e9, latency_us)
            nic_gbps, latency_us = calibration
            if not measured:
                continue
            # Each plan as its own job made it: from the table its ranks agreed on.
            predicted = {p: sim(nic_gbps, latency_us, lost, shaped, p, measured[p][2])
                         for p in PLANS if p in measured}
            fastest = min((p for p in PLANS if p in measured), key=lambda p: measured[p][0])
            auto = measured.get("auto", (0, "?", ""))
            for plan in PLANS:
                if plan not in measured:
                    continue
                m, p = measured[plan][0], predicted[plan]
                rows.append((name, plan, m, p, m / p))
                if abs(m / p - 1) > 0.10:
                    problems.append(f"{name}, {plan}: measured {m:.3f} s, predicted {p:.3f} s")
            rows.append((name, f"auto ({auto[1]})", auto[0], 0, 0))
            if "auto" in measured and auto[0] > 1.05 * measured[fastest][0]:
                problems.append(f"{name}: auto chose {auto[1]} ({auto[0]:.3f} s), the fastest was "
                                f"{fastest} ({measured[fastest][0]:.3f} s)")
            rows.append((name, f"fastest: {fastest}", measured[fastest][0], 0, 0))

    # Every plan survives a NIC lost during the job, every byte checked.
    fault_rows = []
    if not a.quick:
        with t.Testbed(hosts=HOSTS, nics=NICS, rate=f"{RATE_MBIT}mbit") as tb:
            for plan in PLANS:
                down = t.Proc(argv=[str(t.TESTBED), "down", tb.name, "2", "eth2"], delay=3.0,
                              name="down eth2 @3s")
                up = t.Proc(argv=[str(t.TESTBED), "up", tb.name, "2", "eth2"], delay=8.0,
                            name="up eth2 @8s")
                rep = job(tb, plan, f"fault-{plan}", faults=(down, up))
                fault_rows.append((plan, "yes" if rep else "NO"))

    print(f"## degraded mode on the testbed: {HOSTS} hosts x {NICS} NICs at {RATE_MBIT} Mbit/s, "
          f"int32 all-reduce of {a.bytes}, {a.iters} timed iterations, every byte checked\n")
    if calibration:
        print(f"r2ccl-sim calibrated on the fault-free ring: {calibration[0] * 1e3:.1f} Mbit/s per "
              f"NIC, {calibration[1]:.0f} us per message.\n")
    print("| setting | plan | measured s | r2ccl-sim s | measured / predicted |")
    print("|---|---|---:|---:|---:|")
    for name, plan, m, p, ratio in rows:
        print(f"| {name} | {plan} | {m:.3f} | {p:.3f} | {ratio:.3f} |" if p else
              f"| {name} | {plan} | {m:.3f} | | |")
    if fault_rows:
        print("\n| plan, host 2 eth2 down 3 s into the job | finished, every byte verified |")
        print("|---|---|")
        for plan, ok in fault_rows:
            print(f"| {plan} | {ok} |")
    for p in problems:
        print(f"FAIL: {p}", file=sys.stderr)
    print("PASS" if not problems else "FAIL")
    print(f"degraded: {runs} jobs; outputs in {work}", file=sys.stderr)
    return 0 if not problems else 1


if __name__ == "__main__":
    sys.exit(main())
